"""The gated delta rule token by token in one Triton kernel: a decode step (T = 1, one launch, gates optionally
computed in the kernel), or any T sequentially.

Each program owns one value head and a block of value columns: its slice of the fp32 state ``[K, BLOCK_V]`` stays
in registers across the tokens, so the state is read once and written once per call. q/k are L2-normalised in the
kernel, and the QK head of value head ``h`` is ``h // (HV // H)`` (no repeat in memory).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import runtime
from ..runtime import kernel_view, pdl_enter
from . import spec
from .spec import TL_L2NORM_EPS as _EPS
from .spec import TL_SUM as _SUM  # tl.sum costs ~2 ms a call under the interpreter, every token here
from .spec import check_devices, last_dim_contiguous


@triton.jit
def _recurrent_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, alog_ptr, dtb_ptr, h0_ptr, o_ptr, ht_ptr,
    T, HV, GROUP, scale,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_gb, stride_gt, stride_gh, stride_bb, stride_bt, stride_bh, stride_ob, stride_ot, stride_oh,
    K: tl.constexpr, V: tl.constexpr, IN_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr, BETA_DTYPE: tl.constexpr,
    OUT_DTYPE: tl.constexpr, L2NORM: tl.constexpr, FUSED_GATES: tl.constexpr, HAS_INIT: tl.constexpr,
    STORE_FINAL: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, INTERPRET: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """With ``FUSED_GATES``, ``g_ptr`` / ``beta_ptr`` hold the raw ``a`` / ``b`` and ``alog_ptr`` / ``dtb_ptr`` the
    per-head fp32 ``A_log`` / ``dt_bias``."""
    pdl_enter(USE_PDL)
    pid_v = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_b, pid_hv = pid_bh // HV, pid_bh % HV
    pid_hq = pid_hv // GROUP
    offs_k = tl.arange(0, BLOCK_K)
    mask_k = offs_k < K
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_v = offs_v < V
    mask_kv = mask_k[:, None] & mask_v[None, :]
    offs_kv = offs_k[:, None] * V + offs_v[None, :]                                   # [BLOCK_K, BLOCK_V]
    state_base = pid_bh.to(tl.int64) * K * V
    if HAS_INIT:
        s = tl.load(h0_ptr + state_base + offs_kv, mask=mask_kv, other=0.0)
    else:
        s = tl.zeros((BLOCK_K, BLOCK_V), dtype=tl.float32)
    if FUSED_GATES:
        neg_a = -tl.exp(tl.load(alog_ptr + pid_hv))                                   # -exp(A_log), fp32
        dt_bias = tl.load(dtb_ptr + pid_hv)

    q_ptr += pid_b.to(tl.int64) * stride_qb + pid_hq * stride_qh
    k_ptr += pid_b.to(tl.int64) * stride_kb + pid_hq * stride_kh
    v_ptr += pid_b.to(tl.int64) * stride_vb + pid_hv * stride_vh
    g_ptr += pid_b.to(tl.int64) * stride_gb + pid_hv * stride_gh
    beta_ptr += pid_b.to(tl.int64) * stride_bb + pid_hv * stride_bh
    o_ptr += pid_b.to(tl.int64) * stride_ob + pid_hv * stride_oh
    for t in range(T):
        q = tl.load(q_ptr + offs_k, mask=mask_k, other=0)                             # [BLOCK_K]
        k = tl.load(k_ptr + offs_k, mask=mask_k, other=0)                             # [BLOCK_K]
        v = tl.load(v_ptr + offs_v, mask=mask_v, other=0)                             # [BLOCK_V]
        g = tl.load(g_ptr)
        beta = tl.load(beta_ptr)
        # runtime.to_float32 written out: a @jit helper call costs ~2 ms under the interpreter, every token
        if INTERPRET and IN_DTYPE == tl.bfloat16:                                     # bf16 travels as int16 bits
            q = (q.to(tl.int32) << 16).to(tl.float32, bitcast=True)
            k = (k.to(tl.int32) << 16).to(tl.float32, bitcast=True)
            v = (v.to(tl.int32) << 16).to(tl.float32, bitcast=True)
        else:
            q, k, v = q.to(tl.float32), k.to(tl.float32), v.to(tl.float32)
        if INTERPRET and G_DTYPE == tl.bfloat16:
            g = (g.to(tl.int32) << 16).to(tl.float32, bitcast=True)
        else:
            g = g.to(tl.float32)
        if INTERPRET and BETA_DTYPE == tl.bfloat16:
            beta = (beta.to(tl.int32) << 16).to(tl.float32, bitcast=True)
        else:
            beta = beta.to(tl.float32)
        if FUSED_GATES:                           # softplus as torch (identity past 20), log1p by Goldberg's trick
            x = g + dt_bias
            e = tl.exp(tl.minimum(x, 20.0))
            y = 1.0 + e
            g = neg_a * tl.where(x > 20.0, x, tl.where(y == 1.0, e, tl.log(y) * e / (y - 1.0)))
            beta = 1.0 / (1.0 + tl.exp(-beta))                                        # sigmoid
        if L2NORM:
            q = q * tl.rsqrt(tl.reduce(q * q, 0, _SUM) + _EPS)
            k = k * tl.rsqrt(tl.reduce(k * k, 0, _SUM) + _EPS)
        q = q * scale
        s = s * tl.exp(g)                                                             # forget
        delta = (v - tl.reduce(s * k[:, None], 0, _SUM)) * beta                       # [BLOCK_V]: v - S^T k
        s = s + k[:, None] * delta[None, :]                                           # write the correction
        o = tl.reduce(s * q[:, None], 0, _SUM)                                        # [BLOCK_V]: S^T q
        if INTERPRET and OUT_DTYPE == tl.bfloat16:                                    # runtime.cast_output, inline
            bits = o.to(tl.uint32, bitcast=True)
            o = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.uint16).to(tl.int16, bitcast=True)
        else:
            o = o.to(OUT_DTYPE)
        tl.store(o_ptr + offs_v, o, mask=mask_v)
        q_ptr += stride_qt
        k_ptr += stride_kt
        v_ptr += stride_vt
        g_ptr += stride_gt
        beta_ptr += stride_bt
        o_ptr += stride_ot
    if STORE_FINAL:
        tl.store(ht_ptr + state_base + offs_kv, s, mask=mask_kv)


RECURRENT = runtime.Kernel("deltanet.recurrent", _recurrent_kernel)


def recurrent_config(K: int, V: int, interpret: bool = runtime.INTERPRET) -> tuple[int, int]:
    """(BLOCK_V, num_warps). Under the interpreter one program per head (fewer programs run faster); on the GPU
    narrow value blocks and one warp, as fla's fused recurrent kernel: B=1, 32 heads, V=128 gives 512 programs whose
    state slices are read and written once. Untuned guesses until measured on the H200. ``interpret=False``: the
    GPU's, for tests."""
    if interpret:
        return runtime.next_power_of_2(V), 4
    return min(runtime.next_power_of_2(V), 8), 1


def recurrent_gated_delta_rule_triton(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                                      use_qk_l2norm=False, *, out_state=None):
    """Host side of :func:`lynn_kernels.deltanet.recurrent_gated_delta_rule`."""
    dims = spec.check_delta_rule(q, k, v, g, beta, scale, initial_state, out_state)
    check_devices(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state, out_state=out_state)
    return _run(q, k, v, g, beta, None, None, dims, scale, initial_state, output_final_state, use_qk_l2norm,
                out_state)


def recurrent_gated_delta_rule_gates_triton(q, k, v, A_log, a, dt_bias, b, scale=None, initial_state=None,
                                            output_final_state=False, use_qk_l2norm=False, *, out_state=None):
    """Host side of :func:`lynn_kernels.deltanet.recurrent_gated_delta_rule_gates` (gates computed in the kernel)."""
    dims = spec.check_delta_rule_gates(q, k, v, A_log, a, dt_bias, b, scale, initial_state, out_state)
    check_devices(q=q, k=k, v=v, A_log=A_log, a=a, dt_bias=dt_bias, b=b, initial_state=initial_state,
                  out_state=out_state)
    # fp32 per-head parameters (a no-op for the fp32 A_log / dt_bias a checkpoint keeps; a cast otherwise)
    return _run(q, k, v, a, b, A_log.float().contiguous(), dt_bias.float().contiguous(), dims, scale, initial_state,
                output_final_state, use_qk_l2norm, out_state)


def _run(q, k, v, g, beta, A_log, dt_bias, dims: spec.Dims, scale, initial_state, output_final_state: bool,
         use_qk_l2norm: bool, out_state):
    B, T, HV, K, V = dims.B, dims.T, dims.HV, dims.K, dims.V
    o = torch.empty((B, T, HV, V), dtype=v.dtype, device=q.device)
    final = out_state
    if final is None and output_final_state:
        final = torch.empty((B, HV, K, V), dtype=torch.float32, device=q.device)
    launch_recurrent(q, k, v, g, beta, A_log, dt_bias, dims, dims.K ** -0.5 if scale is None else float(scale),
                     initial_state, use_qk_l2norm, o, final)
    return o, final


def launch_recurrent(q, k, v, g, beta, A_log, dt_bias, dims: spec.Dims, scale: float, initial_state,
                     use_qk_l2norm: bool, o: torch.Tensor, final: torch.Tensor | None, *, kernel=None) -> None:
    """Launch only (no checks). ``A_log``/``dt_bias`` given: ``g``/``beta`` are the raw ``a``/``b``. ``final`` may be
    ``initial_state`` itself (each program reads its slice of the state before it writes it). ``kernel`` (a
    ``@triton.jit`` function with ``_recurrent_kernel``'s parameters) replaces the shipped kernel."""
    q, k, v = (last_dim_contiguous(x) for x in (q, k, v))
    h0 = initial_state
    if h0 is not None and not h0.is_contiguous():
        if final is not None and final.data_ptr() == h0.data_ptr():
            raise ValueError("an in-place state update needs a contiguous initial_state")
        h0 = h0.contiguous()
    if final is not None and not final.is_contiguous():
        raise ValueError(f"out_state must be contiguous, found strides {final.stride()}")
    fused = A_log is not None
    BLOCK_V, num_warps = recurrent_config(dims.K, dims.V)
    grid = (runtime.cdiv(dims.V, BLOCK_V), dims.B * dims.HV)
    dummy = o
    RECURRENT.current(kernel)[grid](
        kernel_view(q), kernel_view(k), kernel_view(v), kernel_view(g), kernel_view(beta),
        A_log if fused else dummy, dt_bias if fused else dummy, h0 if h0 is not None else dummy, kernel_view(o),
        final if final is not None else dummy,
        dims.T, dims.HV, dims.group, scale,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), g.stride(0), g.stride(1), g.stride(2),
        beta.stride(0), beta.stride(1), beta.stride(2), o.stride(0), o.stride(1), o.stride(2),
        K=dims.K, V=dims.V, IN_DTYPE=runtime.TORCH_TO_TL[q.dtype], G_DTYPE=runtime.TORCH_TO_TL[g.dtype],
        BETA_DTYPE=runtime.TORCH_TO_TL[beta.dtype], OUT_DTYPE=runtime.TORCH_TO_TL[o.dtype], L2NORM=use_qk_l2norm,
        FUSED_GATES=fused, HAS_INIT=h0 is not None, STORE_FINAL=final is not None,
        BLOCK_K=runtime.next_power_of_2(dims.K), BLOCK_V=BLOCK_V, num_warps=num_warps, **runtime.kernel_flags(),
        **runtime.pdl_flags())
