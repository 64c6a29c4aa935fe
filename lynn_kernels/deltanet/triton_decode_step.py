"""A Gated DeltaNet decode step after the input projections in one kernel: the conv update (+ SiLU) of ``[q | k | v]``,
the gates, the l2-normed delta rule on the fp32 state, and the gated RMSNorm.

One program per (sequence, value head) holds the head's whole ``K x V`` state tile, so the norm over ``V`` needs no
second pass. It computes its own q, k and v from the raw projection and the conv state; where ``GROUP = HV / H``
value heads share a key head, each of the group's programs convolves the same q / k channels, and the last of them
to finish reading (a ticket per key head, the split-K hand-off of the matmul) writes their rolled conv state, so no
program reads a state another has already rolled. Each stage keeps the unfused kernels' order of operations and
roundings (the conv output and the delta rule's output rounded to the run dtype where the chain stores them); the
reductions run over a wider tile than the recurrent kernel's, so the sums may differ from the chain's in the last
bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import runtime
from ..runtime import cast_output, kernel_view, round_to_dtype, to_float32
from ..triton_shared import COUNTER_SLOTS, split_k_counter
from . import spec
from .spec import TL_L2NORM_EPS as _EPS
from .triton_conv import conv_finish, conv_state_sum


@triton.jit
def _roll_load(state_row, chan, mask, stride_sc, stride_ss, S, BLOCK_S: tl.constexpr):
    offs_s = tl.arange(0, BLOCK_S)
    keep = (offs_s + 1) < S
    return tl.load(state_row + chan[:, None] * stride_sc + (offs_s + 1)[None, :] * stride_ss,
                   mask=mask[:, None] & keep[None, :], other=0, cache_modifier=".cg")


@triton.jit
def _roll_store(state_row, chan, mask, shifted, x_raw, stride_sc, stride_ss, S, BLOCK_S: tl.constexpr):
    offs_s = tl.arange(0, BLOCK_S)
    keep = (offs_s + 1) < S
    tl.store(state_row + chan[:, None] * stride_sc + offs_s[None, :] * stride_ss, shifted,
             mask=mask[:, None] & keep[None, :])
    tl.store(state_row + chan * stride_sc + (S - 1) * stride_ss, x_raw, mask=mask)


@triton.jit
def _gdn_decode_kernel(
    x_ptr, conv_ptr, cw_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, h_ptr, z_ptr, nw_ptr, out_ptr, count_ptr,
    hx_ptr, wa_ptr, wb_ptr,
    S, HV, scale, eps, HD,
    stride_xb, stride_cb, stride_cc, stride_cs, stride_wc, stride_ww, stride_ab, stride_bb, stride_zb, stride_zh,
    stride_hx, stride_wa, stride_wb,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, GROUP: tl.constexpr, W: tl.constexpr,
    X_DTYPE: tl.constexpr, W_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr, BETA_DTYPE: tl.constexpr,
    NW_DTYPE: tl.constexpr,
    WX_DTYPE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_S: tl.constexpr,
    BA_PROJ: tl.constexpr, HX_DTYPE: tl.constexpr, BLOCK_HD: tl.constexpr,
    INTERPRET: tl.constexpr, USE_PDL: tl.constexpr = False, STATE_EARLY: tl.constexpr = False,
):
    """Program ``b * HV + hv``: value head ``hv`` of sequence ``b`` (key head ``hv // GROUP``). With ``BA_PROJ``
    the head's raw gates come from the layer input ``hx [B, HD]`` and rows ``hv`` of ``in_proj_a`` /
    ``in_proj_b``: two dot products, fp32 sums rounded to hx's dtype (what ``F.linear`` returns).

    With ``USE_PDL`` the program lets the next kernel launch at once and waits for the kernels ahead of it. With
    ``STATE_EARLY`` too it first loads what none of them writes: the head's recurrent state and its channels' conv
    state, the conv weights, the gates' constants and the gate projections' rows (their first chunk). The
    states are written only by this layer's decode step (this kernel, one step earlier); the caller promises that
    the kernel launched right before this one releases its dependents only after its own wait (the packed GEMV of the
    layer's input projection) or is launched without PDL, and that the previous step on these states came before
    that kernel: it has finished, then. The states load through L2 (``.cg``). Nothing is written before the wait.
    After it, everything the kernels before wrote loads at once, and a shared key head's ticket is taken then and
    read at the end, where the group's last reader rolls the shared conv state."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        if not STATE_EARLY:
            tl.extra.cuda.gdc_wait()
    pid = tl.program_id(0)
    pid_b, pid_hv = pid // HV, pid % HV
    pid_hq = pid_hv // GROUP
    offs_k = tl.arange(0, BLOCK_K)
    mask_k = offs_k < K
    offs_v = tl.arange(0, BLOCK_V)
    mask_v = offs_v < V
    conv_row = conv_ptr + pid_b.to(tl.int64) * stride_cb
    chan_q = pid_hq * K + offs_k
    chan_k = H * K + pid_hq * K + offs_k
    chan_v = 2 * H * K + pid_hv * V + offs_v

    # 0. the layer's own states and the constants: before the wait with STATE_EARLY (see above)
    state = h_ptr + pid.to(tl.int64) * K * V + offs_k[:, None] * V + offs_v[None, :]
    mask_kv = mask_k[:, None] & mask_v[None, :]
    s = tl.load(state, mask=mask_kv, other=0.0, cache_modifier=".cg")               # [BLOCK_K, BLOCK_V] fp32
    acc_q, wl_q = conv_state_sum(conv_row, cw_ptr, chan_q, mask_k, stride_cc, stride_cs, stride_wc, stride_ww, S,
                                 W, X_DTYPE, W_DTYPE, INTERPRET, True)
    acc_k, wl_k = conv_state_sum(conv_row, cw_ptr, chan_k, mask_k, stride_cc, stride_cs, stride_wc, stride_ww, S,
                                 W, X_DTYPE, W_DTYPE, INTERPRET, True)
    acc_v, wl_v = conv_state_sum(conv_row, cw_ptr, chan_v, mask_v, stride_cc, stride_cs, stride_wc, stride_ww, S,
                                 W, X_DTYPE, W_DTYPE, INTERPRET, True)
    roll_q = _roll_load(conv_row, chan_q, mask_k, stride_cc, stride_cs, S, BLOCK_S)
    roll_k = _roll_load(conv_row, chan_k, mask_k, stride_cc, stride_cs, S, BLOCK_S)
    roll_v = _roll_load(conv_row, chan_v, mask_v, stride_cc, stride_cs, S, BLOCK_S)
    a_log = tl.load(alog_ptr + pid_hv)
    dt_bias = tl.load(dtb_ptr + pid_hv)
    nw = to_float32(tl.load(nw_ptr + offs_v, mask=mask_v, other=0), NW_DTYPE, INTERPRET)
    offs_h0 = tl.arange(0, BLOCK_HD)
    mask_h0 = offs_h0 < HD
    if BA_PROJ:                                          # raw, converted where used
        wa0 = tl.load(wa_ptr + pid_hv * stride_wa + offs_h0, mask=mask_h0, other=0)
        wb0 = tl.load(wb_ptr + pid_hv * stride_wb + offs_h0, mask=mask_h0, other=0)
    if USE_PDL:
        if STATE_EARLY:
            tl.extra.cuda.gdc_wait()

    # 1. everything the kernels before wrote, loaded at once: the projections, z, the gates or the layer input;
    #    then the ticket of a shared key head (its answer is read at the end)
    x_row = x_ptr + pid_b.to(tl.int64) * stride_xb
    xq = tl.load(x_row + chan_q, mask=mask_k, other=0)
    xk = tl.load(x_row + chan_k, mask=mask_k, other=0)
    xv = tl.load(x_row + chan_v, mask=mask_v, other=0)
    zf = to_float32(tl.load(z_ptr + pid_b.to(tl.int64) * stride_zb + pid_hv * stride_zh + offs_v, mask=mask_v,
                            other=0), X_DTYPE, INTERPRET)
    if BA_PROJ:
        hx_row = hx_ptr + pid_b.to(tl.int64) * stride_hx
        hx = to_float32(tl.load(hx_row + offs_h0, mask=mask_h0, other=0), HX_DTYPE, INTERPRET)
    else:
        g = to_float32(tl.load(a_ptr + pid_b.to(tl.int64) * stride_ab + pid_hv), G_DTYPE, INTERPRET)
        beta = to_float32(tl.load(b_ptr + pid_b.to(tl.int64) * stride_bb + pid_hv), BETA_DTYPE, INTERPRET)
    tl.debug_barrier()                                   # every thread has read the old conv state
    ticket = 0
    if GROUP > 1:                                        # q / k shared by GROUP heads: the last reader rolls them
        ticket = tl.atomic_add(count_ptr + pid_b * H + pid_hq, 1, sem="acq_rel")

    # 2. the conv update of this head's channels; its own rolled state written now, the shared ones at the end
    q = round_to_dtype(conv_finish(acc_q, wl_q, xq, X_DTYPE, INTERPRET), X_DTYPE, INTERPRET)
    k = round_to_dtype(conv_finish(acc_k, wl_k, xk, X_DTYPE, INTERPRET), X_DTYPE, INTERPRET)
    v = round_to_dtype(conv_finish(acc_v, wl_v, xv, X_DTYPE, INTERPRET), X_DTYPE, INTERPRET)
    _roll_store(conv_row, chan_v, mask_v, roll_v, xv, stride_cc, stride_cs, S, BLOCK_S)
    if GROUP == 1:
        _roll_store(conv_row, chan_q, mask_k, roll_q, xq, stride_cc, stride_cs, S, BLOCK_S)
        _roll_store(conv_row, chan_k, mask_k, roll_k, xk, stride_cc, stride_cs, S, BLOCK_S)

    # 3. the gates and the delta rule (the recurrent kernel's operations, one token)
    if BA_PROJ:                                          # the head's in_proj_a / in_proj_b rows against hx
        acc_a = tl.zeros((BLOCK_HD,), dtype=tl.float32)
        acc_b = tl.zeros((BLOCK_HD,), dtype=tl.float32)
        acc_a += hx * to_float32(wa0, HX_DTYPE, INTERPRET)   # the first chunk came before the wait
        acc_b += hx * to_float32(wb0, HX_DTYPE, INTERPRET)
        for h0 in range(BLOCK_HD, HD, BLOCK_HD):
            offs_h = h0 + tl.arange(0, BLOCK_HD)
            mask_h = offs_h < HD
            hx = to_float32(tl.load(hx_row + offs_h, mask=mask_h, other=0), HX_DTYPE, INTERPRET)
            wa = to_float32(tl.load(wa_ptr + pid_hv * stride_wa + offs_h, mask=mask_h, other=0), HX_DTYPE,
                            INTERPRET)
            wb = to_float32(tl.load(wb_ptr + pid_hv * stride_wb + offs_h, mask=mask_h, other=0), HX_DTYPE,
                            INTERPRET)
            acc_a += hx * wa
            acc_b += hx * wb
        g = round_to_dtype(tl.sum(acc_a, axis=0), HX_DTYPE, INTERPRET)
        beta = round_to_dtype(tl.sum(acc_b, axis=0), HX_DTYPE, INTERPRET)
    x = g + dt_bias
    e = tl.exp(tl.minimum(x, 20.0))
    y = 1.0 + e
    g = -tl.exp(a_log) * tl.where(x > 20.0, x, tl.where(y == 1.0, e, tl.log(y) * e / (y - 1.0)))
    beta = 1.0 / (1.0 + tl.exp(-beta))
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + _EPS)
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + _EPS)
    q = q * scale
    s = s * tl.exp(g)                                                               # forget
    delta = (v - tl.sum(s * k[:, None], axis=0)) * beta                             # v - S^T k
    s = s + k[:, None] * delta[None, :]
    o = round_to_dtype(tl.sum(s * q[:, None], axis=0), X_DTYPE, INTERPRET)          # S^T q, as the chain stores it
    tl.store(state, s, mask=mask_kv)

    # 4. the gated RMSNorm over the head's V values
    rstd = 1.0 / tl.sqrt(tl.sum(o * o, axis=0) / V + eps)
    normed = round_to_dtype(o * rstd, X_DTYPE, INTERPRET)
    hh = round_to_dtype(nw * normed, WX_DTYPE, INTERPRET)
    out = hh * (zf * tl.sigmoid(zf))
    tl.store(out_ptr + pid.to(tl.int64) * V + offs_v, cast_output(out, X_DTYPE, INTERPRET), mask=mask_v)
    if GROUP > 1:                                        # the last of the group to read rolls the shared q / k
        if ticket == GROUP - 1:
            _roll_store(conv_row, chan_q, mask_k, roll_q, xq, stride_cc, stride_cs, S, BLOCK_S)
            _roll_store(conv_row, chan_k, mask_k, roll_k, xk, stride_cc, stride_cs, S, BLOCK_S)
            tl.atomic_xchg(count_ptr + pid_b * H + pid_hq, 0)              # ready for the next call


DECODE_STEP = runtime.Kernel("deltanet.decode_step", _gdn_decode_kernel)


#: ``num_warps`` of the fused step on the GPU (one program holds a head's K x V fp32 state: 64 KB at 128 x 128).
#: Measured on the H200 at the Qwen3.5 head shape (docs/history/decode.md, issue 16): 4 warps fastest at every
#: batch from 1 to 32; 8 and 16 were 1.8-2.8x slower, 2 about 7x slower. Splitting a head's V columns over
#: programs (the last one normalising the row) was no faster at any batch and was removed (docs/deltanet.md).
DECODE_STEP_WARPS = 4

#: Columns of the gates' projection rows a step of the fused kernel takes (the first before the PDL wait). 1,024:
#: compiled for sm_90 at the Qwen3.5 head shape, 2,048 (the whole row) spills 40 bytes (255 registers), 1,024
#: takes 252 registers and spills none (docs/history/decode.md, "The states before the wait").
GATE_CHUNK = 1024


def _pdl_flags(states_early: bool) -> dict:
    flags = runtime.pdl_flags()
    return {**flags, "STATE_EARLY": True} if states_early and flags["USE_PDL"] else flags


def gated_delta_decode_triton(qkv, z, a, b, conv_state, conv_weight, A_log, dt_bias, state, norm_weight,
                              num_k_heads, eps=1e-6, x=None, a_weight=None, b_weight=None, states_early=False):
    """Host side of :func:`lynn_kernels.deltanet.gated_delta_decode`: checks, allocates the output, launches."""
    dims = spec.check_decode_step(qkv, z, a, b, conv_state, conv_weight, A_log, dt_bias, state, norm_weight,
                                  num_k_heads, eps, x=x, a_weight=a_weight, b_weight=b_weight)
    spec.check_devices(qkv=qkv, z=z, a=a, b=b, conv_state=conv_state, conv_weight=conv_weight, A_log=A_log,
                       dt_bias=dt_bias, state=state, norm_weight=norm_weight, x=x, a_weight=a_weight,
                       b_weight=b_weight)
    out = torch.empty((dims.B, dims.HV, dims.V), dtype=qkv.dtype, device=qkv.device)
    return launch_gated_delta_decode(qkv, z, a, b, conv_state, conv_weight, A_log.float().contiguous(),
                                     dt_bias.float().contiguous(), state, norm_weight, dims, float(eps), out,
                                     x=x, a_weight=a_weight, b_weight=b_weight, states_early=states_early)


def launch_gated_delta_decode(qkv, z, a, b, conv_state, conv_weight, A_log, dt_bias, state, norm_weight,
                              dims: spec.Dims, eps: float, out: torch.Tensor, num_warps: int | None = None,
                              x=None, a_weight=None, b_weight=None, states_early: bool = False, *, kernel=None):
    """Launch only (no checks, no host sync), into a contiguous ``out [B, HV, V]``: ``A_log`` / ``dt_bias`` fp32
    contiguous, ``state`` contiguous; the conv state is rolled and ``state`` updated in place. With ``x`` (and
    ``a_weight`` / ``b_weight`` ``[HV, HD]`` of its dtype, unit stride along HD; ``a`` / ``b`` unused) the gates'
    projections run in the kernel. ``states_early``: the kernel's ``STATE_EARLY`` under PDL (the caller's promise,
    :func:`lynn_kernels.deltanet.gated_delta_decode`). The tickets of shared
    key heads use the matmul's zeroed per-stream buffer (one stream at a time), one per sequence and key head: at
    most :data:`~lynn_kernels.triton_shared.COUNTER_SLOTS` of them. ``kernel`` (a ``@triton.jit`` function with
    ``_gdn_decode_kernel``'s parameters) replaces the shipped kernel."""
    B, H, HV, K, V = dims.B, dims.H, dims.HV, dims.K, dims.V
    if B == 0:
        return out
    if HV > H and B * H > COUNTER_SLOTS:
        raise ValueError(f"qkv has B={B} sequences of {H} key heads shared by {HV // H} value heads each: the fused "
                         f"decode step keeps one ticket per sequence and key head, at most {COUNTER_SLOTS} "
                         f"(B <= {COUNTER_SLOTS // H}); split the batch or run the three-kernel chain")
    qkv, z = spec.last_dim_contiguous(qkv), spec.last_dim_contiguous(z)
    proj = x is not None
    if proj:
        x, a_weight, b_weight = (spec.last_dim_contiguous(t) for t in (x, a_weight, b_weight))
        a = b = x                                        # valid pointers, unused
    else:
        a, b = spec.last_dim_contiguous(a), spec.last_dim_contiguous(b)
        x = a_weight = b_weight = a
    hd = x.shape[-1] if proj else 1
    group = HV // H
    counter = split_k_counter(qkv.device, B * H if group > 1 else 0)
    wx = torch.promote_types(norm_weight.dtype, qkv.dtype)
    S = conv_state.shape[2]
    DECODE_STEP.current(kernel)[(B * HV,)](
        kernel_view(qkv), kernel_view(conv_state), kernel_view(conv_weight), kernel_view(a), kernel_view(b), A_log,
        dt_bias, state, kernel_view(z), kernel_view(norm_weight.contiguous()), kernel_view(out), counter,
        kernel_view(x), kernel_view(a_weight), kernel_view(b_weight),
        S, HV, K ** -0.5, eps, hd,
        qkv.stride(0), conv_state.stride(0), conv_state.stride(1), conv_state.stride(2), conv_weight.stride(0),
        conv_weight.stride(1), a.stride(0), b.stride(0), z.stride(0), z.stride(1),
        x.stride(0), a_weight.stride(0), b_weight.stride(0),
        H=H, K=K, V=V, GROUP=group, W=conv_weight.shape[1], X_DTYPE=runtime.TORCH_TO_TL[qkv.dtype],
        W_DTYPE=runtime.TORCH_TO_TL[conv_weight.dtype], G_DTYPE=runtime.TORCH_TO_TL[a.dtype],
        BETA_DTYPE=runtime.TORCH_TO_TL[b.dtype],
        NW_DTYPE=runtime.TORCH_TO_TL[norm_weight.dtype], WX_DTYPE=runtime.TORCH_TO_TL[wx],
        BLOCK_K=runtime.next_power_of_2(K), BLOCK_V=runtime.next_power_of_2(V),
        BLOCK_S=max(2, runtime.next_power_of_2(S)),
        BA_PROJ=proj, HX_DTYPE=runtime.TORCH_TO_TL[x.dtype], BLOCK_HD=min(GATE_CHUNK, runtime.next_power_of_2(hd)),
        num_warps=num_warps or (4 if runtime.INTERPRET else DECODE_STEP_WARPS), **runtime.kernel_flags(),
        **_pdl_flags(states_early))
    return out
