"""Chunked (WY / UT) prefill of the gated delta rule in three Triton kernels:

1. ``_chunk_wy_kernel``     per chunk: ``G = cumsum(g)``, ``A = strictly_lower(beta k k^T * exp(G_i - G_j))``,
   ``Ai = (I + A)^-1`` by 16x16 blocks (forward substitution, then block merges), ``w = Ai (beta exp(G) k)``,
   ``u = Ai (beta v)``, ``A`` and ``Ai`` never leaving registers (fla runs these as three kernels: kkt, solve,
   wu);
2. ``_chunk_state_kernel``  per head, sequential over chunks: stores the state entering each chunk, the deltas
   ``v' = u - w S`` and the final state;
3. ``_chunk_output_kernel`` per chunk: ``o = (exp(G) q) S + lower(q k^T * exp(G_i - G_j)) v'``.

The math is in docs/deltanet.md and :func:`.reference.chunk_gated_delta_rule`. Intermediates live in buffers padded
to whole chunks (so every buffer access is in bounds without a mask); the carried state is fp32 in registers.
Packed sequences (``cu_seqlens``, constexpr ``IS_VARLEN``): chunks restart at every sequence start; kernels 1 and 3
run over a host-built chunk table (:func:`.spec.packed_blocks`) and kernel 2 runs one program per sequence and head.
``tl.dot`` operands are bf16 on the GPU for bf16/fp16 inputs and tf32-free fp32 otherwise (fp32 under the
interpreter). The triangular inverse is *computed* in IEEE fp32, but with bf16 operands it is rounded to bf16 where
it multiplies k and v, and the fp32 state is rounded to bf16 where it multiplies ``w`` (kernel 2) and ``q``
(kernel 3); only the accumulations and the state update stay fp32. On the H200 (``lynn check``, bf16, T=65) that
puts the final state at rel_l2 2.9e-3 (the recurrent kernel: 6e-8) and the output at 2.5x the error of a bf16
rounding of the exact answer; fp32 inputs round nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import runtime
from ..runtime import cast_output, kernel_view, to_float32
from . import spec
from .spec import CHUNK, check_devices, last_dim_contiguous
from .spec import TL_L2NORM_EPS as _EPS
from .spec import TL_SUM as _SUM

# ---------------------------------------------------------------------------------------------------------------
# helpers shared by the kernels


@triton.jit
def _dot(a, b, DOT: tl.constexpr):
    """``a @ b`` with fp32 accumulation; operands cast to ``DOT`` (fp32 means IEEE fp32, never tf32)."""
    if DOT == tl.float32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a.to(DOT), b.to(DOT))


@triton.jit
def _load_rows(ptr, offs_t, mask_t, stride_t, offs_d, mask_d, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """Rows ``offs_t`` of a ``[T, D]`` slice (last dim contiguous) as fp32, zeros where masked."""
    x = tl.load(ptr + offs_t[:, None].to(tl.int64) * stride_t + offs_d[None, :],
                mask=mask_t[:, None] & mask_d[None, :], other=0)
    return to_float32(x, DTYPE, INTERPRET)


@triton.jit
def _l2norm_rows(x):
    """``x * rsqrt(sum(x^2) + eps)`` per row of a ``[R, D]`` fp32 tile."""
    return x * tl.rsqrt(tl.reduce(x * x, 1, _SUM) + _EPS)[:, None]


@triton.jit
def _packed_chunk(pid_c, cu_ptr, idx_ptr, BT: tl.constexpr):
    """Packed sequences: the first input row and the end of chunk ``pid_c``, row ``pid_c`` of the chunk table
    ``idx [NC, 2]`` = (sequence ``n``, chunk ``j`` of it): rows ``cu[n] + j * BT`` up to (not with) ``cu[n+1]``."""
    i_n = tl.load(idx_ptr + 2 * pid_c)
    return tl.load(cu_ptr + i_n) + tl.load(idx_ptr + 2 * pid_c + 1) * BT, tl.load(cu_ptr + i_n + 1)


@triton.jit
def _load_vec(ptr, offs_t, mask_t, stride_t, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """``ptr[offs_t * stride_t]`` as fp32, zeros where masked (g or beta of one head)."""
    x = tl.load(ptr + offs_t.to(tl.int64) * stride_t, mask=mask_t, other=0)
    return to_float32(x, DTYPE, INTERPRET)


# ---------------------------------------------------------------------------------------------------------------
# 1. the chunk's gates, the UT system, its inverse and the WY representation: w and u, by 16-row blocks in registers

#: Launch shapes tried on the GPU for the kernels that only write fresh buffers (safe to run repeatedly); the
#: interpreter keeps the first. The state kernel may write into ``initial_state`` (in place), so it is not tuned.
_TUNE = [triton.Config({}, num_warps=4, num_stages=2), triton.Config({}, num_warps=8, num_stages=2),
         triton.Config({}, num_warps=4, num_stages=3), triton.Config({}, num_warps=2, num_stages=2)]



@triton.jit
def _wy_rows(k_base, g_base, b_base, t0, t_end, stride_kt, stride_gt, stride_bt, offs_k, mask_k,
             IN_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr, BETA_DTYPE: tl.constexpr, L2NORM: tl.constexpr,
             INTERPRET: tl.constexpr):
    """Input rows ``t0 .. t0 + 15`` (zeros past ``t_end``): keys (normalised if asked), gates, betas."""
    offs_t = t0 + tl.arange(0, 16)
    mask_t = offs_t < t_end
    k = _load_rows(k_base, offs_t, mask_t, stride_kt, offs_k, mask_k, IN_DTYPE, INTERPRET)      # [16, BLOCK_K]
    if L2NORM:
        k = _l2norm_rows(k)
    g = _load_vec(g_base, offs_t, mask_t, stride_gt, G_DTYPE, INTERPRET)
    beta = _load_vec(b_base, offs_t, mask_t, stride_bt, BETA_DTYPE, INTERPRET)
    return k, g, beta


@triton.jit
def _wy_values(v_base, t0, t_end, stride_vt, offs_v, mask_v, beta, DOT: tl.constexpr, IN_DTYPE: tl.constexpr,
               INTERPRET: tl.constexpr):
    """``beta v`` of input rows ``t0 .. t0 + 15`` as a dot operand."""
    offs_t = t0 + tl.arange(0, 16)
    v = _load_rows(v_base, offs_t, offs_t < t_end, stride_vt, offs_v, mask_v, IN_DTYPE, INTERPRET)
    return (v * beta[:, None]).to(DOT)                                                          # [16, BLOCK_V]


@runtime.autotune(configs=_TUNE, key=["K", "V", "BT", "GRID_BUCKET"])
@triton.jit
def _chunk_wy_kernel(
    k_ptr, v_ptr, g_ptr, beta_ptr, gcum_ptr, w_ptr, u_ptr, cu_ptr, idx_ptr,
    T, T_PAD, HV, GROUP, GRID_BUCKET,                      # GRID_BUCKET: the autotuner's key only (size_bucket)
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_gb, stride_gt, stride_gh,
    stride_bb, stride_bt, stride_bh,
    K: tl.constexpr, V: tl.constexpr, IN_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr, BETA_DTYPE: tl.constexpr,
    L2NORM: tl.constexpr, DOT: tl.constexpr, IS_VARLEN: tl.constexpr, BT: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr, INTERPRET: tl.constexpr,
):
    """For ``BT = 64``: the chunk's four 16-row blocks stay in registers, so neither ``A`` nor its inverse goes
    through memory. Written out block by block (Triton cannot slice a register tile); the dots inline, since under
    the interpreter every @jit helper call costs ~2 ms."""
    pid_c = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_b, pid_hv = pid_bh // HV, pid_bh % HV
    if IS_VARLEN:
        t0, t_end = _packed_chunk(pid_c, cu_ptr, idx_ptr, BT)
    else:
        t0, t_end = pid_c * BT, T
    offs_k = tl.arange(0, BLOCK_K)
    mask_k = offs_k < K
    offs_v = tl.arange(0, BLOCK_V)
    mask_v = offs_v < V
    k_base = k_ptr + pid_b.to(tl.int64) * stride_kb + (pid_hv // GROUP) * stride_kh
    g_base = g_ptr + pid_b.to(tl.int64) * stride_gb + pid_hv * stride_gh
    b_base = beta_ptr + pid_b.to(tl.int64) * stride_bb + pid_hv * stride_bh
    k0, g0, b0 = _wy_rows(k_base, g_base, b_base, t0, t_end, stride_kt, stride_gt, stride_bt, offs_k, mask_k,
                          IN_DTYPE, G_DTYPE, BETA_DTYPE, L2NORM, INTERPRET)
    k1, g1, b1 = _wy_rows(k_base, g_base, b_base, t0 + 16, t_end, stride_kt, stride_gt, stride_bt, offs_k, mask_k,
                          IN_DTYPE, G_DTYPE, BETA_DTYPE, L2NORM, INTERPRET)
    k2, g2, b2 = _wy_rows(k_base, g_base, b_base, t0 + 32, t_end, stride_kt, stride_gt, stride_bt, offs_k, mask_k,
                          IN_DTYPE, G_DTYPE, BETA_DTYPE, L2NORM, INTERPRET)
    k3, g3, b3 = _wy_rows(k_base, g_base, b_base, t0 + 48, t_end, stride_kt, stride_gt, stride_bt, offs_k, mask_k,
                          IN_DTYPE, G_DTYPE, BETA_DTYPE, L2NORM, INTERPRET)
    # G, the log of the decay since the chunk start: each block's running sum continues from the last of the block
    # before (a cumulative sum like any other; kernels 2 and 3 read these stored values, so all agree)
    offs = tl.arange(0, 16)
    c0 = tl.cumsum(g0, axis=0)
    c1 = tl.cumsum(g1, axis=0) + tl.reduce(tl.where(offs == 15, c0, 0.0), 0, _SUM)
    c2 = tl.cumsum(g2, axis=0) + tl.reduce(tl.where(offs == 15, c1, 0.0), 0, _SUM)
    c3 = tl.cumsum(g3, axis=0) + tl.reduce(tl.where(offs == 15, c2, 0.0), 0, _SUM)
    row = pid_bh.to(tl.int64) * T_PAD + pid_c * BT + offs          # rows of block 0 in the padded buffers
    tl.store(gcum_ptr + row, c0)
    tl.store(gcum_ptr + row + 16, c1)
    tl.store(gcum_ptr + row + 32, c2)
    tl.store(gcum_ptr + row + 48, c3)

    # the keys as the three products take them, in the operand dtype (the fp32 keys are not needed after this)
    PREC: tl.constexpr = "ieee" if DOT == tl.float32 else "tf32"       # tf32 never applies: bf16 operands then
    kg0 = (k0 * (b0 * tl.exp(c0))[:, None]).to(DOT)                    # beta exp(G) k, for w
    kg1 = (k1 * (b1 * tl.exp(c1))[:, None]).to(DOT)
    kg2 = (k2 * (b2 * tl.exp(c2))[:, None]).to(DOT)
    kg3 = (k3 * (b3 * tl.exp(c3))[:, None]).to(DOT)
    kb0 = (k0 * b0[:, None]).to(DOT)
    kb1 = (k1 * b1[:, None]).to(DOT)
    kb2 = (k2 * b2[:, None]).to(DOT)
    kb3 = (k3 * b3[:, None]).to(DOT)
    kt0 = tl.trans(k0.to(DOT))
    kt1 = tl.trans(k1.to(DOT))
    kt2 = tl.trans(k2.to(DOT))
    kt3 = tl.trans(k3.to(DOT))
    # A = strictly_lower(beta k k^T * exp(G_i - G_j)), its ten non-zero 16x16 blocks (row block >= column block)
    lower = offs[:, None] > offs[None, :]
    a00 = tl.dot(kb0, kt0, input_precision=PREC) * tl.exp(tl.where(lower, c0[:, None] - c0[None, :], float("-inf")))
    a11 = tl.dot(kb1, kt1, input_precision=PREC) * tl.exp(tl.where(lower, c1[:, None] - c1[None, :], float("-inf")))
    a22 = tl.dot(kb2, kt2, input_precision=PREC) * tl.exp(tl.where(lower, c2[:, None] - c2[None, :], float("-inf")))
    a33 = tl.dot(kb3, kt3, input_precision=PREC) * tl.exp(tl.where(lower, c3[:, None] - c3[None, :], float("-inf")))
    a10 = tl.dot(kb1, kt0, input_precision=PREC) * tl.exp(c1[:, None] - c0[None, :])
    a20 = tl.dot(kb2, kt0, input_precision=PREC) * tl.exp(c2[:, None] - c0[None, :])
    a21 = tl.dot(kb2, kt1, input_precision=PREC) * tl.exp(c2[:, None] - c1[None, :])
    a30 = tl.dot(kb3, kt0, input_precision=PREC) * tl.exp(c3[:, None] - c0[None, :])
    a31 = tl.dot(kb3, kt1, input_precision=PREC) * tl.exp(c3[:, None] - c1[None, :])
    a32 = tl.dot(kb3, kt2, input_precision=PREC) * tl.exp(c3[:, None] - c2[None, :])

    # (I + A)^-1: forward substitution on the diagonal blocks, X_i = -a_i - sum_j a_ij X_j
    # (rows j < i of x hold X_j, row i still -a_i), then the off-diagonal blocks one sub-diagonal at a time
    x0 = -a00
    x1 = -a11
    x2 = -a22
    x3 = -a33
    row_id = offs[:, None]
    for i in range(2, 16):
        r0 = tl.reduce(tl.where(row_id == i, x0, 0.0), 0, _SUM)
        r1 = tl.reduce(tl.where(row_id == i, x1, 0.0), 0, _SUM)
        r2 = tl.reduce(tl.where(row_id == i, x2, 0.0), 0, _SUM)
        r3 = tl.reduce(tl.where(row_id == i, x3, 0.0), 0, _SUM)
        x0 = tl.where(row_id == i, (r0 + tl.reduce(r0[:, None] * x0, 0, _SUM))[None, :], x0)
        x1 = tl.where(row_id == i, (r1 + tl.reduce(r1[:, None] * x1, 0, _SUM))[None, :], x1)
        x2 = tl.where(row_id == i, (r2 + tl.reduce(r2[:, None] * x2, 0, _SUM))[None, :], x2)
        x3 = tl.where(row_id == i, (r3 + tl.reduce(r3[:, None] * x3, 0, _SUM))[None, :], x3)
    eye = tl.where(offs[:, None] == offs[None, :], 1.0, 0.0)
    ai00 = x0 + eye
    ai11 = x1 + eye
    ai22 = x2 + eye
    ai33 = x3 + eye
    ai10 = -tl.dot(ai11, tl.dot(a10, ai00, input_precision="ieee"), input_precision="ieee")
    ai21 = -tl.dot(ai22, tl.dot(a21, ai11, input_precision="ieee"), input_precision="ieee")
    ai32 = -tl.dot(ai33, tl.dot(a32, ai22, input_precision="ieee"), input_precision="ieee")
    ai20 = -tl.dot(ai22, tl.dot(a20, ai00, input_precision="ieee") + tl.dot(a21, ai10, input_precision="ieee"),
                   input_precision="ieee")
    ai31 = -tl.dot(ai33, tl.dot(a31, ai11, input_precision="ieee") + tl.dot(a32, ai21, input_precision="ieee"),
                   input_precision="ieee")
    ai30 = -tl.dot(ai33, tl.dot(a30, ai00, input_precision="ieee") + tl.dot(a31, ai10, input_precision="ieee")
                   + tl.dot(a32, ai20, input_precision="ieee"), input_precision="ieee")
    ai00 = ai00.to(DOT)                        # the inverse enters its products in the operand dtype
    ai10 = ai10.to(DOT)
    ai11 = ai11.to(DOT)
    ai20 = ai20.to(DOT)
    ai21 = ai21.to(DOT)
    ai22 = ai22.to(DOT)
    ai30 = ai30.to(DOT)
    ai31 = ai31.to(DOT)
    ai32 = ai32.to(DOT)
    ai33 = ai33.to(DOT)

    # w = Ai (beta exp(G) k): the keys as seen by the chunk's start state; block r sums its blocks c <= r in order
    w_rows = w_ptr + row[:, None] * K + offs_k[None, :]
    W_T = w_ptr.dtype.element_ty
    w = tl.dot(ai00, kg0, input_precision=PREC)
    tl.store(w_rows, w.to(W_T), mask=mask_k[None, :])
    w = tl.dot(ai11, kg1, tl.dot(ai10, kg0, input_precision=PREC), input_precision=PREC)
    tl.store(w_rows + 16 * K, w.to(W_T), mask=mask_k[None, :])
    w = tl.dot(ai22, kg2, tl.dot(ai21, kg1, tl.dot(ai20, kg0, input_precision=PREC), input_precision=PREC),
               input_precision=PREC)
    tl.store(w_rows + 32 * K, w.to(W_T), mask=mask_k[None, :])
    w = tl.dot(ai33, kg3, tl.dot(ai32, kg2, tl.dot(ai31, kg1, tl.dot(ai30, kg0, input_precision=PREC),
                                                    input_precision=PREC), input_precision=PREC),
               input_precision=PREC)
    tl.store(w_rows + 48 * K, w.to(W_T), mask=mask_k[None, :])

    # u = Ai (beta v): the deltas if the start state were zero
    v_base = v_ptr + pid_b.to(tl.int64) * stride_vb + pid_hv * stride_vh
    vb0 = _wy_values(v_base, t0, t_end, stride_vt, offs_v, mask_v, b0, DOT, IN_DTYPE, INTERPRET)
    vb1 = _wy_values(v_base, t0 + 16, t_end, stride_vt, offs_v, mask_v, b1, DOT, IN_DTYPE, INTERPRET)
    vb2 = _wy_values(v_base, t0 + 32, t_end, stride_vt, offs_v, mask_v, b2, DOT, IN_DTYPE, INTERPRET)
    vb3 = _wy_values(v_base, t0 + 48, t_end, stride_vt, offs_v, mask_v, b3, DOT, IN_DTYPE, INTERPRET)
    u_rows = u_ptr + row[:, None] * V + offs_v[None, :]
    u = tl.dot(ai00, vb0, input_precision=PREC)
    tl.store(u_rows, u, mask=mask_v[None, :])
    u = tl.dot(ai11, vb1, tl.dot(ai10, vb0, input_precision=PREC), input_precision=PREC)
    tl.store(u_rows + 16 * V, u, mask=mask_v[None, :])
    u = tl.dot(ai22, vb2, tl.dot(ai21, vb1, tl.dot(ai20, vb0, input_precision=PREC), input_precision=PREC),
               input_precision=PREC)
    tl.store(u_rows + 32 * V, u, mask=mask_v[None, :])
    u = tl.dot(ai33, vb3, tl.dot(ai32, vb2, tl.dot(ai31, vb1, tl.dot(ai30, vb0, input_precision=PREC),
                                                    input_precision=PREC), input_precision=PREC),
               input_precision=PREC)
    tl.store(u_rows + 48 * V, u, mask=mask_v[None, :])


CHUNK_WY = runtime.Kernel("deltanet.chunk_wy", _chunk_wy_kernel)


# ---------------------------------------------------------------------------------------------------------------
# 2. the state recurrence across chunks


@triton.jit
def _state_inputs(k_base, w_ptr, u_ptr, gcum_ptr, i_buf, c0, c, nt, bos, eos, T_PAD, stride_kt, offs_k, mask_k,
                  offs_v, mask_v, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr):
    """What the state scan reads for chunk ``c`` (nothing past the last chunk ``nt - 1``), as loaded: ``w``, ``u``,
    the cumulative gates, the chunk's last gate and the raw keys."""
    live = c < nt
    offs_t = bos + c * BT + tl.arange(0, BT)                                         # input rows
    row = i_buf.to(tl.int64) * T_PAD + (c0 + c) * BT + tl.arange(0, BT)             # buffer rows
    w = tl.load(w_ptr + row[:, None] * K + offs_k[None, :], mask=mask_k[None, :] & live, other=0.0)
    u = tl.load(u_ptr + row[:, None] * V + offs_v[None, :], mask=mask_v[None, :] & live, other=0.0)
    gcum = tl.load(gcum_ptr + row, mask=live, other=0.0)
    g_last = tl.load(gcum_ptr + i_buf.to(tl.int64) * T_PAD + (c0 + c) * BT + BT - 1, mask=live, other=0.0)
    k = tl.load(k_base + offs_t[:, None].to(tl.int64) * stride_kt + offs_k[None, :],
                mask=((offs_t < eos) & live)[:, None] & mask_k[None, :], other=0)
    return w, u, gcum, g_last, k


@triton.jit
def _chunk_state_kernel(
    k_ptr, w_ptr, u_ptr, gcum_ptr, h0_ptr, h_ptr, vnew_ptr, ht_ptr, cu_ptr, first_ptr,
    T, T_PAD, NT, HV, GROUP,
    stride_kb, stride_kt, stride_kh,
    K: tl.constexpr, V: tl.constexpr, IN_DTYPE: tl.constexpr, L2NORM: tl.constexpr, HAS_INIT: tl.constexpr,
    STORE_FINAL: tl.constexpr, DOT: tl.constexpr, IS_VARLEN: tl.constexpr, BT: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Program ``(pid_v, n * HV + hv)`` scans the chunks of sequence ``n`` (a batch row, or packed sequence ``n``:
    rows ``cu[n]:cu[n+1]``, chunks ``first[n]:first[n+1]`` of the buffers of head ``hv``) from state row ``n``."""
    pid_v = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_n, pid_hv = pid_bh // HV, pid_bh % HV
    if IS_VARLEN:                                            # B = 1: every sequence is in row 0 of k and the buffers
        bos = tl.load(cu_ptr + pid_n)
        eos = tl.load(cu_ptr + pid_n + 1)
        c0 = tl.load(first_ptr + pid_n)                      # the sequence's first chunk in the buffers
        nt = tl.load(first_ptr + pid_n + 1) - c0             # its chunks (none for an empty sequence)
        i_buf = pid_hv
        k_base = k_ptr + (pid_hv // GROUP) * stride_kh
    else:
        bos = 0
        eos = T
        c0 = 0
        nt = NT
        i_buf = pid_bh
        k_base = k_ptr + pid_n.to(tl.int64) * stride_kb + (pid_hv // GROUP) * stride_kh
    offs_k = tl.arange(0, BLOCK_K)
    mask_k = offs_k < K
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_v = offs_v < V
    mask_kv = mask_k[:, None] & mask_v[None, :]
    offs_kv = offs_k[:, None] * V + offs_v[None, :]                                              # [BLOCK_K, BLOCK_V]
    state_base = pid_bh.to(tl.int64) * K * V
    if HAS_INIT:
        s = tl.load(h0_ptr + state_base + offs_kv, mask=mask_kv, other=0.0)
    else:
        s = tl.zeros((BLOCK_K, BLOCK_V), dtype=tl.float32)
    w_n, u_n, g_n, gl_n, k_n = _state_inputs(k_base, w_ptr, u_ptr, gcum_ptr, i_buf, c0, 0, nt, bos, eos, T_PAD,
                                              stride_kt, offs_k, mask_k, offs_v, mask_v, K, V, BT)
    for c in range(nt):
        w, u, gcum, g_last, k = w_n, u_n, g_n, gl_n, k_n
        # the next chunk's inputs depend on no state: their loads fly while this chunk's two products run
        w_n, u_n, g_n, gl_n, k_n = _state_inputs(k_base, w_ptr, u_ptr, gcum_ptr, i_buf, c0, c + 1, nt, bos, eos,
                                                  T_PAD, stride_kt, offs_k, mask_k, offs_v, mask_v, K, V, BT)
        tl.store(h_ptr + (i_buf.to(tl.int64) * NT + c0 + c) * K * V + offs_kv, s.to(h_ptr.dtype.element_ty),
                 mask=mask_kv)                                                   # state entering c
        row = i_buf.to(tl.int64) * T_PAD + (c0 + c) * BT + tl.arange(0, BT)     # buffer rows
        v_new = u - _dot(w, s, DOT)                                                       # the chunk's deltas
        tl.store(vnew_ptr + row[:, None] * V + offs_v[None, :], v_new.to(vnew_ptr.dtype.element_ty),
                 mask=mask_v[None, :])
        k = to_float32(k, IN_DTYPE, INTERPRET)
        if L2NORM:
            k = _l2norm_rows(k)
        k = k * tl.exp(g_last - gcum)[:, None]                 # decay from each token to the chunk end
        s = s * tl.exp(g_last) + _dot(tl.trans(k), v_new, DOT)
    if STORE_FINAL:
        tl.store(ht_ptr + state_base + offs_kv, s, mask=mask_kv)


CHUNK_STATE = runtime.Kernel("deltanet.chunk_state", _chunk_state_kernel)


# ---------------------------------------------------------------------------------------------------------------
# 3. the output


@runtime.autotune(configs=_TUNE, key=["K", "V", "BT", "BLOCK_V", "GRID_BUCKET"])
@triton.jit
def _chunk_output_kernel(
    q_ptr, k_ptr, gcum_ptr, h_ptr, vnew_ptr, o_ptr, cu_ptr, idx_ptr,
    T, T_PAD, NT, HV, GROUP, scale, GRID_BUCKET,           # GRID_BUCKET: the autotuner's key only (size_bucket)
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_ob, stride_ot, stride_oh,
    K: tl.constexpr, V: tl.constexpr, IN_DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr, L2NORM: tl.constexpr,
    DOT: tl.constexpr, IS_VARLEN: tl.constexpr, BT: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    pid_c = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_v = tl.program_id(2)
    pid_b, pid_hv = pid_bh // HV, pid_bh % HV
    if IS_VARLEN:
        t0, t_end = _packed_chunk(pid_c, cu_ptr, idx_ptr, BT)
    else:
        t0, t_end = pid_c * BT, T
    offs_t = t0 + tl.arange(0, BT)
    mask_t = offs_t < t_end
    offs_k = tl.arange(0, BLOCK_K)
    mask_k = offs_k < K
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_v = offs_v < V
    row = pid_bh.to(tl.int64) * T_PAD + pid_c * BT + tl.arange(0, BT)
    q = _load_rows(q_ptr + pid_b.to(tl.int64) * stride_qb + (pid_hv // GROUP) * stride_qh, offs_t, mask_t,
                   stride_qt, offs_k, mask_k, IN_DTYPE, INTERPRET)                              # [BT, BLOCK_K]
    k = _load_rows(k_ptr + pid_b.to(tl.int64) * stride_kb + (pid_hv // GROUP) * stride_kh, offs_t, mask_t,
                   stride_kt, offs_k, mask_k, IN_DTYPE, INTERPRET)
    if L2NORM:
        q = _l2norm_rows(q)
        k = _l2norm_rows(k)
    q = q * scale
    gcum = tl.load(gcum_ptr + row)                                                               # [BT]
    h = tl.load(h_ptr + (pid_bh.to(tl.int64) * NT + pid_c) * K * V + offs_k[:, None] * V + offs_v[None, :],
                mask=mask_k[:, None] & mask_v[None, :], other=0.0)                             # [BLOCK_K, BLOCK_V]
    o = _dot(q * tl.exp(gcum)[:, None], h, DOT)                      # what the state entering the chunk gives
    attn = _dot(q, tl.trans(k), DOT)                                                             # [BT, BT]
    offs_j = tl.arange(0, BT)
    causal = tl.arange(0, BT)[:, None] >= offs_j[None, :]
    attn = attn * tl.exp(tl.where(causal, gcum[:, None] - gcum[None, :], float("-inf")))
    v_new = tl.load(vnew_ptr + row[:, None] * V + offs_v[None, :], mask=mask_v[None, :], other=0.0)
    o = o + _dot(attn, v_new, DOT)                                   # plus the chunk's own writes
    o_base = o_ptr + pid_b.to(tl.int64) * stride_ob + pid_hv * stride_oh
    tl.store(o_base + offs_t[:, None].to(tl.int64) * stride_ot + offs_v[None, :], cast_output(o, OUT_DTYPE, INTERPRET),
             mask=mask_t[:, None] & mask_v[None, :])


CHUNK_OUTPUT = runtime.Kernel("deltanet.chunk_output", _chunk_output_kernel)


# ---------------------------------------------------------------------------------------------------------------
# host


def dot_dtype(dtype: torch.dtype):
    """``tl.dot`` operand dtype for inputs of ``dtype``: fp32 under the interpreter or for fp32 inputs (IEEE, not
    tf32), bf16 on the GPU for 16-bit inputs."""
    return tl.float32 if runtime.INTERPRET or dtype == torch.float32 else tl.bfloat16


def block_v(V: int, interpret: bool = runtime.INTERPRET) -> tuple[int, int]:
    """Value columns per program of (the state kernel, the output kernel): all of them under the interpreter (fewer
    programs run faster there); on the GPU 32 for the sequential state scan (B=1, 32 heads, V=128: 128 programs on
    132 SMs) and 64 for the output (parallel over chunks already). Untuned until measured on the H200.
    ``interpret=False``: the GPU's, for tests."""
    full = max(16, runtime.next_power_of_2(V))
    return (full, full) if interpret else (min(full, 32), min(full, 64))


def chunk_gated_delta_rule_triton(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                                  use_qk_l2norm=False, *, out_state=None, cu_seqlens=None):
    """Host side of :func:`lynn_kernels.deltanet.chunk_gated_delta_rule`: check, allocate, launch five kernels
    (reads ``cu_seqlens`` to the host once: the chunk table and the grids depend on it)."""
    check_devices(q=q)                  # first: check_delta_rule reads cu_seqlens once it is on q's device
    dims = spec.check_delta_rule(q, k, v, g, beta, scale, initial_state, out_state, cu_seqlens)
    check_devices(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state, out_state=out_state,
                  cu_seqlens=cu_seqlens)
    B, T, HV, K, V = dims.B, dims.T, dims.HV, dims.K, dims.V
    dev = q.device
    o = torch.empty((B, T, HV, V), dtype=v.dtype, device=dev)
    want_state = output_final_state or out_state is not None
    final = None
    if want_state:
        final = (out_state if out_state is not None
                 else torch.empty((dims.N, HV, K, V), dtype=torch.float32, device=dev))
    if T == 0:                                        # nothing to scan: the state passes through
        if final is not None and initial_state is not None:
            final.copy_(initial_state)
        elif final is not None:
            final.zero_()
        return o, final
    launch_chunk(q, k, v, g, beta, dims, dims.K ** -0.5 if scale is None else float(scale), initial_state,
                 use_qk_l2norm, o, final)
    return o, final


def launch_chunk(q, k, v, g, beta, dims: spec.Dims, scale: float, initial_state, use_qk_l2norm: bool,
                 o: torch.Tensor, final: torch.Tensor | None, config: dict | None = None) -> None:
    """Launch only (no checks), into ``o [B, T, HV, V]`` and ``final [N, HV, K, V]`` (or no final state).
    ``config`` overrides the state scan's launch (``state_block_v``, ``state_warps``, ``state_stages``) and the
    output's ``out_block_v``, for experiments and tests of one tiling.

    Packed sequences (``dims.cu``, host offsets; B = 1): the chunks of every sequence, counted from its own first
    token, are numbered one after another (:func:`.spec.packed_blocks`, built once per layout); the per-chunk kernels
    run over that table and the padded buffers hold chunk ``i`` at rows ``64 i``, the state scan runs one program per
    sequence and head. Without: chunk ``c`` of batch row ``b`` and head ``hv`` at rows ``64 c`` of buffer row
    ``b * HV + hv``."""
    B, T, HV, K, V = dims.B, dims.T, dims.HV, dims.K, dims.V
    q, k, v = (last_dim_contiguous(x) for x in (q, k, v))
    h0 = initial_state.contiguous() if initial_state is not None else None
    dev = q.device
    BT = CHUNK
    packed = dims.cu is not None
    if packed:
        cu_t, chunks, first = spec.packed_blocks(dims.cu, BT, dev)
        NT = chunks.shape[0]                              # chunks of all sequences (sequence n: first[n]:first[n+1])
    else:
        NT = runtime.cdiv(T, BT)
    T_PAD = NT * BT
    BH = B * HV
    DOT = dot_dtype(q.dtype)
    f32 = dict(dtype=torch.float32, device=dev)
    ops = dict(dtype=torch.float32 if DOT == tl.float32 else torch.bfloat16, device=dev)
    gcum = torch.empty((BH, T_PAD), **f32)
    u = torch.empty((BH, T_PAD, V), **f32)
    # buffers only ever read as tl.dot operands are stored in the operand dtype: the cast happens anyway
    w = torch.empty((BH, T_PAD, K), **ops)
    v_new = torch.empty((BH, T_PAD, V), **ops)
    h = torch.empty((BH, NT, K, V), **ops)
    if not packed:
        cu_t = chunks = first = gcum                      # never read

    in_dtype = runtime.TORCH_TO_TL[q.dtype]
    flags = runtime.kernel_flags()
    BLOCK_K = max(16, runtime.next_power_of_2(K))
    BLOCK_V_ALL = max(16, runtime.next_power_of_2(V))
    BLOCK_V_STATE, BLOCK_V_OUT = block_v(V)
    config = config or {}
    BLOCK_V_STATE = config.get("state_block_v", BLOCK_V_STATE)
    BLOCK_V_OUT = config.get("out_block_v", BLOCK_V_OUT)
    state_launch = {"num_warps": config.get("state_warps", 8 if K > 64 else 4)}
    if "state_stages" in config:
        state_launch["num_stages"] = config["state_stages"]
    qv, kv, vv, gv, bv = (kernel_view(x) for x in (q, k, v, g, beta))
    grid_bucket = runtime.size_bucket(NT * BH)           # the per-chunk kernels' programs: tuned per size
    common = dict(K=K, IN_DTYPE=in_dtype, L2NORM=use_qk_l2norm, DOT=DOT, IS_VARLEN=packed, BT=BT, BLOCK_K=BLOCK_K,
                  **flags)

    CHUNK_WY.current()[(NT, BH)](
        kv, vv, gv, bv, gcum, w, u, cu_t, chunks, T, T_PAD, HV, dims.group, grid_bucket,
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        g.stride(0), g.stride(1), g.stride(2), beta.stride(0), beta.stride(1), beta.stride(2),
        V=V, G_DTYPE=runtime.TORCH_TO_TL[g.dtype], BETA_DTYPE=runtime.TORCH_TO_TL[beta.dtype],
        BLOCK_V=BLOCK_V_ALL, **common)
    CHUNK_STATE.current()[(runtime.cdiv(V, BLOCK_V_STATE), dims.N * HV)](
        kv, w, u, gcum, h0 if h0 is not None else gcum, h, v_new, final if final is not None else gcum, cu_t, first,
        T, T_PAD, NT, HV, dims.group, k.stride(0), k.stride(1), k.stride(2),
        V=V, HAS_INIT=h0 is not None, STORE_FINAL=final is not None, BLOCK_V=BLOCK_V_STATE,
        **state_launch, **common)                         # w, k [64, K] and the state tile in registers
    CHUNK_OUTPUT.current()[(NT, BH, runtime.cdiv(V, BLOCK_V_OUT))](
        qv, kv, gcum, h, v_new, kernel_view(o), cu_t, chunks, T, T_PAD, NT, HV, dims.group, scale, grid_bucket,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        o.stride(0), o.stride(1), o.stride(2),
        V=V, OUT_DTYPE=runtime.TORCH_TO_TL[o.dtype], BLOCK_V=BLOCK_V_OUT, **common)
