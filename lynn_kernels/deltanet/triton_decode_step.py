"""A Gated DeltaNet decode step after the input projections in one kernel: the conv update (+ SiLU) of ``[q | k | v]``,
the gates, the l2-normed delta rule on the fp32 state, and the gated RMSNorm.

A program holds a ``K x BLOCK_V`` slice of one (sequence, value head)'s fp32 state: the whole head (``BLOCK_V = V``)
or, at small batches where a program per head would leave most of the GPU idle and each program would stream 128
KB of state through one SM, a slice of its columns. It computes its own q, k and v slice from the raw projection
and the conv state; where several programs share q / k (``GROUP = HV / H`` value heads on a key head, times the V
slices), each convolves the same q / k channels, and the last of them to finish reading (a ticket per key head, the
split-K hand-off of the matmul) writes their rolled conv state, so no program reads a state another has already
rolled. The gated RMSNorm needs the head's whole row of V outputs: a program holding the row normalises it; with
V split, each program stores its slice of ``o`` (already rounded to the run dtype, so storing it is exact) and the
last of the head's programs to take a ticket reads the row back and normalises it. Each stage keeps the unfused
kernels' order of operations and roundings (the conv output and the delta rule's output rounded to the run dtype
where the chain stores them); the reductions over K run over a different tile than the recurrent kernel's, so the
sums may differ from the chain's in the last bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import runtime
from ..matmul.triton_matmul import COUNTER_SLOTS, split_k_counter
from ..runtime import cast_output, kernel_view, pdl_enter, round_to_dtype, to_float32
from . import spec
from .spec import TL_L2NORM_EPS as _EPS
from .triton_conv import conv_update_channels


@triton.jit
def _conv_channels(x_row, state_row, w_ptr, chan, mask, stride_sc, stride_ss, stride_wc, stride_ww, S,
                   W: tl.constexpr, X_DTYPE: tl.constexpr, W_DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """The conv update's output of channels ``chan`` rounded to x's dtype as the conv kernel stores it (held as
    fp32), and their raw new inputs."""
    y, x_raw = conv_update_channels(x_row, state_row, w_ptr, chan, mask, stride_sc, stride_ss, stride_wc, stride_ww,
                                    S, W, X_DTYPE, W_DTYPE, INTERPRET)
    return round_to_dtype(y, X_DTYPE, INTERPRET), x_raw


@triton.jit
def _roll_load(state_row, chan, mask, stride_sc, stride_ss, S, BLOCK_S: tl.constexpr):
    offs_s = tl.arange(0, BLOCK_S)
    keep = (offs_s + 1) < S
    return tl.load(state_row + chan[:, None] * stride_sc + (offs_s + 1)[None, :] * stride_ss,
                   mask=mask[:, None] & keep[None, :], other=0)


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
    S, B, HV, scale, eps,
    stride_xb, stride_cb, stride_cc, stride_cs, stride_wc, stride_ww, stride_ab, stride_bb, stride_zb, stride_zh,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, GROUP: tl.constexpr, W: tl.constexpr,
    X_DTYPE: tl.constexpr, W_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr, BETA_DTYPE: tl.constexpr,
    NW_DTYPE: tl.constexpr,
    WX_DTYPE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, FULL_V: tl.constexpr,
    BLOCK_S: tl.constexpr, INTERPRET: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    """Program ``(b * HV + hv) * NV + j``: columns ``[j * BLOCK_V, (j + 1) * BLOCK_V)`` of value head ``hv`` of
    sequence ``b`` (key head ``hv // GROUP``), ``NV = cdiv(V, BLOCK_V)``."""
    pdl_enter(USE_PDL)
    NV: tl.constexpr = (V + BLOCK_V - 1) // BLOCK_V
    pid = tl.program_id(0)
    pid_head = pid // NV                                 # b * HV + hv
    pid_v = pid % NV
    pid_b, pid_hv = pid_head // HV, pid_head % HV
    pid_hq = pid_hv // GROUP
    offs_k = tl.arange(0, BLOCK_K)
    mask_k = offs_k < K
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_v = offs_v < V
    x_row = x_ptr + pid_b.to(tl.int64) * stride_xb
    conv_row = conv_ptr + pid_b.to(tl.int64) * stride_cb
    chan_q = pid_hq * K + offs_k
    chan_k = H * K + pid_hq * K + offs_k
    chan_v = 2 * H * K + pid_hv * V + offs_v

    # 1. the conv update of this program's channels; the rolled states are written once every reader is done
    q, xq = _conv_channels(x_row, conv_row, cw_ptr, chan_q, mask_k, stride_cc, stride_cs, stride_wc, stride_ww, S,
                           W, X_DTYPE, W_DTYPE, INTERPRET)
    k, xk = _conv_channels(x_row, conv_row, cw_ptr, chan_k, mask_k, stride_cc, stride_cs, stride_wc, stride_ww, S,
                           W, X_DTYPE, W_DTYPE, INTERPRET)
    v, xv = _conv_channels(x_row, conv_row, cw_ptr, chan_v, mask_v, stride_cc, stride_cs, stride_wc, stride_ww, S,
                           W, X_DTYPE, W_DTYPE, INTERPRET)
    roll_q = _roll_load(conv_row, chan_q, mask_k, stride_cc, stride_cs, S, BLOCK_S)
    roll_k = _roll_load(conv_row, chan_k, mask_k, stride_cc, stride_cs, S, BLOCK_S)
    roll_v = _roll_load(conv_row, chan_v, mask_v, stride_cc, stride_cs, S, BLOCK_S)
    tl.debug_barrier()                                   # every thread has read the old conv state
    _roll_store(conv_row, chan_v, mask_v, roll_v, xv, stride_cc, stride_cs, S, BLOCK_S)   # this program's own
    if GROUP * NV == 1:
        _roll_store(conv_row, chan_q, mask_k, roll_q, xq, stride_cc, stride_cs, S, BLOCK_S)
        _roll_store(conv_row, chan_k, mask_k, roll_k, xk, stride_cc, stride_cs, S, BLOCK_S)
    else:                                                # q / k shared by GROUP * NV programs: the last rolls them
        ticket = tl.atomic_add(count_ptr + pid_b * H + pid_hq, 1, sem="acq_rel")
        if ticket == GROUP * NV - 1:
            _roll_store(conv_row, chan_q, mask_k, roll_q, xq, stride_cc, stride_cs, S, BLOCK_S)
            _roll_store(conv_row, chan_k, mask_k, roll_k, xk, stride_cc, stride_cs, S, BLOCK_S)
            tl.atomic_xchg(count_ptr + pid_b * H + pid_hq, 0)              # ready for the next call

    # 2. the gates and the delta rule (the recurrent kernel's operations, one token)
    g = to_float32(tl.load(a_ptr + pid_b.to(tl.int64) * stride_ab + pid_hv), G_DTYPE, INTERPRET)
    beta = to_float32(tl.load(b_ptr + pid_b.to(tl.int64) * stride_bb + pid_hv), BETA_DTYPE, INTERPRET)
    x = g + tl.load(dtb_ptr + pid_hv)
    e = tl.exp(tl.minimum(x, 20.0))
    y = 1.0 + e
    g = -tl.exp(tl.load(alog_ptr + pid_hv)) * tl.where(x > 20.0, x, tl.where(y == 1.0, e, tl.log(y) * e / (y - 1.0)))
    beta = 1.0 / (1.0 + tl.exp(-beta))
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + _EPS)
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + _EPS)
    q = q * scale
    state = h_ptr + pid_head.to(tl.int64) * K * V + offs_k[:, None] * V + offs_v[None, :]
    mask_kv = mask_k[:, None] & mask_v[None, :]
    s = tl.load(state, mask=mask_kv, other=0.0)                                     # [BLOCK_K, BLOCK_V] fp32
    s = s * tl.exp(g)                                                               # forget
    delta = (v - tl.sum(s * k[:, None], axis=0)) * beta                             # v - S^T k
    s = s + k[:, None] * delta[None, :]
    o = round_to_dtype(tl.sum(s * q[:, None], axis=0), X_DTYPE, INTERPRET)          # S^T q, as the chain stores it
    tl.store(state, s, mask=mask_kv)

    # 3. the gated RMSNorm over the head's V values: by this program when it holds them all; else each program
    #    stores its slice of o (x's dtype: o is already rounded to it) and the last of the head's NV normalises
    out_row = out_ptr + pid_head.to(tl.int64) * V
    z_row = z_ptr + pid_b.to(tl.int64) * stride_zb + pid_hv * stride_zh
    if NV == 1:
        _gated_norm_store(o, offs_v, mask_v, z_row, nw_ptr, out_row, V, eps, X_DTYPE, NW_DTYPE, WX_DTYPE, INTERPRET)
    else:
        tl.store(out_row + offs_v, cast_output(o, X_DTYPE, INTERPRET), mask=mask_v)
        tl.debug_barrier()                               # every thread's slice is written before the ticket
        slot = count_ptr + B * H + pid_head
        ticket = tl.atomic_add(slot, 1, sem="acq_rel")
        if ticket == NV - 1:                             # the head's whole row of o is in
            offs_all = tl.arange(0, FULL_V)
            mask_all = offs_all < V
            o_all = to_float32(tl.load(out_row + offs_all, mask=mask_all, other=0, cache_modifier=".cg"), X_DTYPE,
                               INTERPRET)
            _gated_norm_store(o_all, offs_all, mask_all, z_row, nw_ptr, out_row, V, eps, X_DTYPE, NW_DTYPE,
                              WX_DTYPE, INTERPRET)
            tl.atomic_xchg(slot, 0)                      # ready for the next call


@triton.jit
def _gated_norm_store(o, offs_v, mask_v, z_row, nw_ptr, out_row, V, eps, X_DTYPE: tl.constexpr,
                      NW_DTYPE: tl.constexpr, WX_DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """``out = (norm_weight * rmsnorm(o)) * silu(z)`` over a head's V values ``o`` (fp32 holding x's dtype), with the
    gated-norm kernel's roundings."""
    zf = to_float32(tl.load(z_row + offs_v, mask=mask_v, other=0), X_DTYPE, INTERPRET)
    nw = to_float32(tl.load(nw_ptr + offs_v, mask=mask_v, other=0), NW_DTYPE, INTERPRET)
    rstd = 1.0 / tl.sqrt(tl.sum(o * o, axis=0) / V + eps)
    normed = round_to_dtype(o * rstd, X_DTYPE, INTERPRET)
    hh = round_to_dtype(nw * normed, WX_DTYPE, INTERPRET)
    out = hh * (zf * tl.sigmoid(zf))
    tl.store(out_row + offs_v, cast_output(out, X_DTYPE, INTERPRET), mask=mask_v)


#: GPU launch of the fused step by batch size: ``(BLOCK_V, num_warps)`` for ``B <=`` each key, the last for any
#: larger batch. A program holds a ``K x BLOCK_V`` slice of a head's fp32 state; below V the head's last program
#: normalises the row. Measured on the H200 (``experiments/gdn_decode_fused.py``).
DECODE_STEP_CONFIG = {1: (32, 4), 2: (32, 4), 8: (64, 4), 1 << 30: (128, 4)}


def decode_step_config(B: int, V: int) -> tuple[int, int]:
    """``(BLOCK_V, num_warps)`` for a batch of ``B`` on the GPU (:data:`DECODE_STEP_CONFIG`), BLOCK_V at most V's
    power of two."""
    for top, (bv, warps) in sorted(DECODE_STEP_CONFIG.items()):
        if B <= top:
            return min(bv, runtime.next_power_of_2(V)), warps
    raise AssertionError("DECODE_STEP_CONFIG has no entry for every batch")


def gated_delta_decode_triton(qkv, z, a, b, conv_state, conv_weight, A_log, dt_bias, state, norm_weight,
                              num_k_heads, eps=1e-6):
    """Host side of :func:`lynn_kernels.deltanet.gated_delta_decode`: checks, allocates the output, launches."""
    dims = spec.check_decode_step(qkv, z, a, b, conv_state, conv_weight, A_log, dt_bias, state, norm_weight,
                                  num_k_heads, eps)
    spec.check_devices(qkv=qkv, z=z, a=a, b=b, conv_state=conv_state, conv_weight=conv_weight, A_log=A_log,
                       dt_bias=dt_bias, state=state, norm_weight=norm_weight)
    out = torch.empty((dims.B, dims.HV, dims.V), dtype=qkv.dtype, device=qkv.device)
    return launch_gated_delta_decode(qkv, z, a, b, conv_state, conv_weight, A_log.float().contiguous(),
                                     dt_bias.float().contiguous(), state, norm_weight, dims, float(eps), out)


def launch_gated_delta_decode(qkv, z, a, b, conv_state, conv_weight, A_log, dt_bias, state, norm_weight,
                              dims: spec.Dims, eps: float, out: torch.Tensor, num_warps: int | None = None,
                              block_v: int | None = None):
    """Launch only (no checks, no host sync), into a contiguous ``out [B, HV, V]``: ``A_log`` / ``dt_bias`` fp32
    contiguous, ``state`` contiguous; the conv state is rolled and ``state`` updated in place. ``block_v`` (a power
    of two) and ``num_warps`` replace :func:`decode_step_config`'s (the interpreter's default: one program a head).
    The tickets (one per sequence and key head where programs share q / k, one per sequence and value head where
    a head's V is split) use the matmul's zeroed per-stream buffer (one stream at a time): at most
    :data:`~lynn_kernels.matmul.triton_matmul.COUNTER_SLOTS` of them."""
    B, H, HV, K, V = dims.B, dims.H, dims.HV, dims.K, dims.V
    if B == 0:
        return out
    bv, warps = (runtime.next_power_of_2(V), 4) if runtime.INTERPRET else decode_step_config(B, V)
    bv, warps = block_v or bv, num_warps or warps
    group, nv = HV // H, runtime.cdiv(V, bv)
    slots = B * H + (B * HV if nv > 1 else 0) if group * nv > 1 else 0
    if slots > COUNTER_SLOTS:
        raise ValueError(f"qkv has B={B} sequences of {H} key heads and {HV} value heads: the fused decode step "
                         f"with V={V} in blocks of {bv} keeps {slots} tickets, at most {COUNTER_SLOTS}; split the "
                         f"batch or run the three-kernel chain")
    qkv, z = spec.last_dim_contiguous(qkv), spec.last_dim_contiguous(z)
    a, b = spec.last_dim_contiguous(a), spec.last_dim_contiguous(b)
    counter = split_k_counter(qkv.device, slots)
    wx = torch.promote_types(norm_weight.dtype, qkv.dtype)
    S = conv_state.shape[2]
    _gdn_decode_kernel[(B * HV * nv,)](
        kernel_view(qkv), kernel_view(conv_state), kernel_view(conv_weight), kernel_view(a), kernel_view(b), A_log,
        dt_bias, state, kernel_view(z), kernel_view(norm_weight.contiguous()), kernel_view(out), counter,
        S, B, HV, K ** -0.5, eps,
        qkv.stride(0), conv_state.stride(0), conv_state.stride(1), conv_state.stride(2), conv_weight.stride(0),
        conv_weight.stride(1), a.stride(0), b.stride(0), z.stride(0), z.stride(1),
        H=H, K=K, V=V, W=conv_weight.shape[1], X_DTYPE=runtime.TORCH_TO_TL[qkv.dtype],
        W_DTYPE=runtime.TORCH_TO_TL[conv_weight.dtype], G_DTYPE=runtime.TORCH_TO_TL[a.dtype],
        BETA_DTYPE=runtime.TORCH_TO_TL[b.dtype],
        NW_DTYPE=runtime.TORCH_TO_TL[norm_weight.dtype], WX_DTYPE=runtime.TORCH_TO_TL[wx],
        BLOCK_K=runtime.next_power_of_2(K), BLOCK_V=bv, FULL_V=runtime.next_power_of_2(V),
        BLOCK_S=max(2, runtime.next_power_of_2(S)), GROUP=group, num_warps=warps, **runtime.kernel_flags(),
        **runtime.pdl_flags())
    return out
