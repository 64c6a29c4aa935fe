"""The routed experts' decode path in Triton (``M <= DECODE_MAX_M``, chosen by :mod:`.triton_experts`): no align,
gate_up one program per slot (token x expert), down one per token, summing the token's slots itself (the combine, in
a fixed order), all on the FMA units.

* checkpoint layout or float weights: ``_moe_decode_gate_up_kernel`` and ``_moe_decode_down_kernel`` on the weight
  tile's even / odd halves (:func:`_weight_halves`), tiles :data:`DECODE_UP_CONFIGS` / :data:`DECODE_DOWN_CONFIGS`;
* packed experts (:mod:`.packed`): ``_moe_packed_gate_up_kernel`` and ``_moe_packed_down_kernel``, the packed GEMV's
  word decode, every slot of a token loading at once, chained by PDL on the GPU; tiles :data:`PACKED_UP_CONFIGS` /
  :data:`PACKED_DOWN_CONFIGS`.

:func:`_launch_decode` launches either pair (:func:`_launch_packed_decode` the packed one). docs/moe.md, sections 3,
4 and 6.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .. import runtime
from ..runtime import cast_output, kernel_view, to_float32
from ..triton_shared import (
    FMA_UNIT,
    X_PRESCALE,
    decode_word,
    fma_row_step,
    fma_scales,
    load_words,
    split8,
    w_halves,
)
from .triton_experts_common import _expert, _flags, _round_h, _tiles, _w2_global, _w13_global, _Weights

#: GPU tiles of the two decode kernels (FMA, one slot or token per program), ``(M <= 2, M > 2)``: the best of 16 by
#: kernel time at M = 1, and at M = 4 / 16, on the H200 (docs/moe.md,
#: section 4). Fewer, wider programs pay at M = 1; at M >= 4 there are programs enough and smaller tiles win.
DECODE_UP_CONFIGS = ({"BLOCK_N": 16, "BLOCK_K": 512, "num_warps": 8, "num_stages": 3},
                     {"BLOCK_N": 8, "BLOCK_K": 256, "num_warps": 4, "num_stages": 3})
DECODE_DOWN_CONFIGS = ({"BLOCK_N": 8, "BLOCK_K": 256, "num_warps": 8, "num_stages": 3},
                       {"BLOCK_N": 8, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3})
#: GPU tiles of the packed decode kernels (FMA on the packed layout, :mod:`.packed`), ``(M <= 2, M > 2)``:
#: ``BLOCK_N`` rows per program, ``TW`` words of K per step: the best tiles of the GPU sweeps at M = 1 and M = 8
#: (docs/moe.md, section 6).
PACKED_UP_CONFIGS = ({"BLOCK_N": 8, "TW": 64, "num_warps": 4}, {"BLOCK_N": 8, "TW": 64, "num_warps": 4})
PACKED_DOWN_CONFIGS = ({"BLOCK_N": 8, "TW": 32, "num_warps": 8}, {"BLOCK_N": 4, "TW": 16, "num_warps": 2})

# ---------------------------------------------------------------------------------------------------------------
# kernels


@triton.jit
def _weight_halves(w_ptr, scales_ptr, offs_n, mask_n, k0, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   X_DTYPE: tl.constexpr, FLOAT_W: tl.constexpr, PACKED_DECODE: tl.constexpr,
                   INTERPRET: tl.constexpr):
    """W[offs_n, k0:k0+BLOCK_K] of one expert ``[N, K]`` for the FMA kernels, as its even and odd columns, fp32
    ``[BLOCK_N, BLOCK_K/2]`` each: float weights loaded as one tile and split, or NVFP4 by the matmul's ``w_halves``."""
    if FLOAT_W:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * K + offs_k[None, :],
                    mask=mask_n[:, None] & (offs_k[None, :] < K), other=0)
        w = to_float32(w, X_DTYPE, INTERPRET)                                         # [BLOCK_N, BLOCK_K]
        return tl.split(tl.reshape(w, (BLOCK_N, BLOCK_K // 2, 2)))
    else:
        return w_halves(w_ptr, scales_ptr, offs_n, mask_n, k0, K, BLOCK_N, BLOCK_K, PACKED_DECODE, INTERPRET)


@triton.jit
def _moe_decode_gate_up_kernel(
    x_ptr, codes_ptr, scales_ptr, g_ptr, ids_ptr, h_ptr,
    H, I, stride_xm, G_STRIDE,
    TOP_K: tl.constexpr, DENSE: tl.constexpr, FLOAT_W: tl.constexpr, G_PER_ROW: tl.constexpr,
    X_DTYPE: tl.constexpr, H_DTYPE: tl.constexpr,
    PACKED_DECODE: tl.constexpr, ACC_UNIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    slot = tl.program_id(0)
    pid_n = tl.program_id(1)
    if DENSE:                                                      # the shared expert: slot = token, expert 0
        e = (slot * 0).to(tl.int64)
    else:
        e = tl.load(ids_ptr + slot).to(tl.int64)
    x_row = x_ptr + (slot // TOP_K).to(tl.int64) * stride_xm
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < I
    codes_e, scales_e = _expert(codes_ptr, scales_ptr, e, 2 * I, H, FLOAT_W)
    acc_gate = tl.zeros((BLOCK_N, BLOCK_K // 2), dtype=tl.float32)          # per-lane partial sums, reduced once
    acc_up = tl.zeros((BLOCK_N, BLOCK_K // 2), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        offs_x = k0 + 2 * tl.arange(0, BLOCK_K // 2)                        # x's even and odd columns
        x_even = to_float32(tl.load(x_row + offs_x, mask=offs_x < H, other=0), X_DTYPE, INTERPRET)
        x_odd = to_float32(tl.load(x_row + offs_x + 1, mask=offs_x < H, other=0), X_DTYPE, INTERPRET)
        w_even, w_odd = _weight_halves(codes_e, scales_e, offs_n, mask_n, k0, H, BLOCK_N, BLOCK_K, X_DTYPE,
                                       FLOAT_W, PACKED_DECODE, INTERPRET)
        acc_gate += w_even * x_even[None, :] + w_odd * x_odd[None, :]
        w_even, w_odd = _weight_halves(codes_e, scales_e, offs_n + I, mask_n, k0, H, BLOCK_N, BLOCK_K, X_DTYPE,
                                       FLOAT_W, PACKED_DECODE, INTERPRET)
        acc_up += w_even * x_even[None, :] + w_odd * x_odd[None, :]
    g_gate, g_up = _w13_global(g_ptr, e, offs_n, mask_n, I, G_STRIDE, BLOCK_N, FLOAT_W, G_PER_ROW, ACC_UNIT)
    gate = tl.sum(acc_gate, axis=1) * g_gate
    h = gate * tl.sigmoid(gate) * (tl.sum(acc_up, axis=1) * g_up)             # [BLOCK_N]
    tl.store(h_ptr + slot.to(tl.int64) * I + offs_n, _round_h(h, X_DTYPE, H_DTYPE, INTERPRET), mask=mask_n)


MOE_DECODE_GATE_UP = runtime.Kernel("moe.decode_gate_up", _moe_decode_gate_up_kernel)


@triton.jit
def _moe_decode_down_kernel(
    h_ptr, codes_ptr, scales_ptr, g_ptr, ids_ptr, weights_ptr, shared_ptr, out_ptr,
    H, I, stride_om, G_STRIDE,
    TOP_K: tl.constexpr, TOP_K_P2: tl.constexpr, DENSE: tl.constexpr, HAS_SHARED: tl.constexpr,
    FLOAT_W: tl.constexpr, X_DTYPE: tl.constexpr, W_DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr,
    PACKED_DECODE: tl.constexpr, ACC_UNIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_j = tl.arange(0, TOP_K_P2)                      # token t's slots, all at once: their loads overlap
    mask_j = offs_j < TOP_K
    slots = t * TOP_K + offs_j
    if DENSE:
        e = (offs_j * 0).to(tl.int64)
    else:
        e = tl.load(ids_ptr + slots, mask=mask_j, other=0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < H
    # rows e * H + n of the stack [E * H, I]: one [TOP_K_P2 * BLOCK_N, BLOCK_K] weight tile per step
    rows = tl.reshape(e[:, None] * H + offs_n[None, :], (TOP_K_P2 * BLOCK_N,))
    mask_rows = tl.reshape(mask_j[:, None] & mask_n[None, :], (TOP_K_P2 * BLOCK_N,))
    h_rows = h_ptr + slots[:, None].to(tl.int64) * I
    acc = tl.zeros((TOP_K_P2, BLOCK_N, BLOCK_K // 2), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        offs_h = k0 + 2 * tl.arange(0, BLOCK_K // 2)
        mask_h = mask_j[:, None] & (offs_h[None, :] < I)
        h_even = tl.load(h_rows + offs_h[None, :], mask=mask_h, other=0).to(tl.float32)       # [TOP_K_P2, BK/2]
        h_odd = tl.load(h_rows + offs_h[None, :] + 1, mask=mask_h, other=0).to(tl.float32)
        w_even, w_odd = _weight_halves(codes_ptr, scales_ptr, rows, mask_rows, k0, I, TOP_K_P2 * BLOCK_N, BLOCK_K,
                                       X_DTYPE, FLOAT_W, PACKED_DECODE, INTERPRET)
        acc += (tl.reshape(w_even, (TOP_K_P2, BLOCK_N, BLOCK_K // 2)) * h_even[:, None, :]
                + tl.reshape(w_odd, (TOP_K_P2, BLOCK_N, BLOCK_K // 2)) * h_odd[:, None, :])
    g = _w2_global(g_ptr, e * G_STRIDE, FLOAT_W, ACC_UNIT)                                 # [TOP_K_P2]
    w = to_float32(tl.load(weights_ptr + slots, mask=mask_j, other=0), W_DTYPE, INTERPRET)  # 0 past top_k
    y = tl.sum(tl.sum(acc, axis=2) * (g * w)[:, None], axis=0)          # the combine: a fixed reduction order
    if HAS_SHARED:
        y += tl.load(shared_ptr + t.to(tl.int64) * H + offs_n, mask=mask_n, other=0.0)
    tl.store(out_ptr + t.to(tl.int64) * stride_om + offs_n, cast_output(y, OUT_DTYPE, INTERPRET), mask=mask_n)


MOE_DECODE_DOWN = runtime.Kernel("moe.decode_down", _moe_decode_down_kernel)


@triton.jit
def _moe_packed_gate_up_kernel(
    x_ptr, words_ptr, scales_ptr, g_ptr, ids_ptr, h_ptr,
    H, I, stride_xm, G_STRIDE,
    SLOTS: tl.constexpr, DENSE: tl.constexpr, G_PER_ROW: tl.constexpr, X_DTYPE: tl.constexpr,
    H_DTYPE: tl.constexpr, BLOCK_N: tl.constexpr, TW: tl.constexpr, EVEN: tl.constexpr, EVEN_K: tl.constexpr,
    INTERPRET: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """Decode gate_up on packed experts (the packed GEMV's word decode): program ``(slot, n)`` computes ``h[slot, n
    * BLOCK_N : (n + 1) * BLOCK_N]`` of expert ``ids[slot]`` from token ``slot // SLOTS``, its gate and up rows in
    steps of ``TW`` words, the next step's words loading while this one is multiplied.

    With ``USE_PDL`` it waits first and only then lets the next kernel (the down kernel) launch: by then the
    router has finished, so the down kernel can load the routing and its first weights before its own wait."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    slot = tl.program_id(0)
    pid_n = tl.program_id(1)
    if DENSE:                                                      # the shared expert alone: expert 0
        e = (slot * 0).to(tl.int64)
    else:
        e = tl.load(ids_ptr + slot).to(tl.int64)
    x_row = x_ptr + (slot // SLOTS).to(tl.int64) * stride_xm
    KW = tl.cdiv(H, 128) * 16
    words_e, scales_e = _expert(words_ptr, scales_ptr, e, 2 * I, H, False, True)
    offs = tl.max_contiguous(tl.multiple_of(tl.arange(0, TW), 4), 4)     # words of a step: 16-byte runs
    offs_s = tl.arange(0, TW)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = rows < I
    gate_w = words_e + rows[:, None].to(tl.int64) * KW
    up_w = words_e + (rows + I)[:, None].to(tl.int64) * KW
    qg, vg = load_words(gate_w, scales_e, rows, mask_n[:, None], 0, offs, offs_s, KW, EVEN)
    qu, vu = load_words(up_w, scales_e, rows + I, mask_n[:, None], 0, offs, offs_s, KW, EVEN)
    acc_g = tl.zeros((BLOCK_N, TW), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, TW), dtype=tl.float32)
    for k0 in range(0, KW, TW):
        if EVEN:                                     # the last step reloads its own words (an L2 hit), unmasked
            k1 = tl.minimum(k0 + TW, KW - TW)
        else:
            k1 = k0 + TW
        qg_next, vg_next = load_words(gate_w, scales_e, rows, mask_n[:, None], k1, offs, offs_s, KW, EVEN)
        qu_next, vu_next = load_words(up_w, scales_e, rows + I, mask_n[:, None], k1, offs, offs_s, KW, EVEN)
        e0, e1, e2, e3, e4, e5, e6, e7 = decode_word(qg)                     # [BLOCK_N, TW] each
        sa, sb = fma_scales(vg, INTERPRET)
        acc_g = fma_row_step(acc_g, e0, e1, e2, e3, e4, e5, e6, e7, sa, sb, x_row, 0, 1, H, k0, offs, 0, 1, TW,
                             EVEN_K, X_DTYPE, INTERPRET)
        e0, e1, e2, e3, e4, e5, e6, e7 = decode_word(qu)
        sa, sb = fma_scales(vu, INTERPRET)
        acc_u = fma_row_step(acc_u, e0, e1, e2, e3, e4, e5, e6, e7, sa, sb, x_row, 0, 1, H, k0, offs, 0, 1, TW,
                             EVEN_K, X_DTYPE, INTERPRET)
        qg, vg, qu, vu = qg_next, vg_next, qu_next, vu_next
    g_gate, g_up = _w13_global(g_ptr, e, rows, mask_n, I, G_STRIDE, BLOCK_N, False, G_PER_ROW, FMA_UNIT)
    gate = tl.sum(acc_g, axis=1) * g_gate
    h = gate * tl.sigmoid(gate) * (tl.sum(acc_u, axis=1) * g_up)                 # [BLOCK_N]
    tl.store(h_ptr + slot.to(tl.int64) * I + rows, _round_h(h, X_DTYPE, H_DTYPE, INTERPRET), mask=mask_n)


MOE_PACKED_GATE_UP = runtime.Kernel("moe.packed_gate_up", _moe_packed_gate_up_kernel)


@triton.jit
def _slots_step(acc, q, v, h_rows, mask_j, k0, I, SLOTS_P2: tl.constexpr, BLOCK_N: tl.constexpr,
                TW: tl.constexpr, EVEN_K: tl.constexpr, INTERPRET: tl.constexpr):
    """One step of the down kernel: ``acc [SLOTS_P2, BLOCK_N, TW] +=`` the products of the words ``q`` (rows of
    every slot's expert, ``[SLOTS_P2 * BLOCK_N, TW]``) with each slot's own ``h`` row (``h_rows`` ``[SLOTS_P2]``
    pointers), in the packed GEMV's order: per half word a sum of four products, then one FMA by its block scale."""
    e0, e1, e2, e3, e4, e5, e6, e7 = decode_word(q)
    sa, sb = fma_scales(v, INTERPRET)
    kx = 8 * k0 + tl.arange(0, 8 * TW)                                          # the step's h columns
    if EVEN_K:
        mask_h = mask_j[:, None] & (kx >= 0)[None, :]
    else:
        mask_h = mask_j[:, None] & (kx < I)[None, :]
    ht = tl.load(h_rows[:, None] + kx[None, :], mask=mask_h, other=0).to(tl.float32)   # [SLOTS_P2, 8 TW]
    # K order -> word order, as fma_row_step does for one row (each slot's row is TW / 16 whole chunks)
    ht = tl.reshape(ht, (SLOTS_P2 * TW // 16, 4, 2, 2, 4, 2))
    ht = tl.reshape(tl.permute(ht, (0, 4, 1, 2, 3, 5)), (SLOTS_P2 * TW, 8)) * X_PRESCALE
    x0, x1, x2, x3, x4, x5, x6, x7 = split8(ht, SLOTS_P2 * TW)
    pa = _tile3(e0, SLOTS_P2, BLOCK_N, TW) * _row3(x0, SLOTS_P2, TW)
    pa = tl.fma(_tile3(e1, SLOTS_P2, BLOCK_N, TW), _row3(x1, SLOTS_P2, TW), pa)
    pa = tl.fma(_tile3(e2, SLOTS_P2, BLOCK_N, TW), _row3(x2, SLOTS_P2, TW), pa)
    pa = tl.fma(_tile3(e3, SLOTS_P2, BLOCK_N, TW), _row3(x3, SLOTS_P2, TW), pa)
    pb = _tile3(e4, SLOTS_P2, BLOCK_N, TW) * _row3(x4, SLOTS_P2, TW)
    pb = tl.fma(_tile3(e5, SLOTS_P2, BLOCK_N, TW), _row3(x5, SLOTS_P2, TW), pb)
    pb = tl.fma(_tile3(e6, SLOTS_P2, BLOCK_N, TW), _row3(x6, SLOTS_P2, TW), pb)
    pb = tl.fma(_tile3(e7, SLOTS_P2, BLOCK_N, TW), _row3(x7, SLOTS_P2, TW), pb)
    return tl.fma(pb, _tile3(sb, SLOTS_P2, BLOCK_N, TW), tl.fma(pa, _tile3(sa, SLOTS_P2, BLOCK_N, TW), acc))


@triton.jit
def _tile3(t, SLOTS_P2: tl.constexpr, BLOCK_N: tl.constexpr, TW: tl.constexpr):
    """``[SLOTS_P2 * BLOCK_N, TW]`` -> ``[SLOTS_P2, BLOCK_N, TW]``."""
    return tl.reshape(t, (SLOTS_P2, BLOCK_N, TW))


@triton.jit
def _row3(x, SLOTS_P2: tl.constexpr, TW: tl.constexpr):
    """A slot's x values ``[SLOTS_P2 * TW]`` -> ``[SLOTS_P2, 1, TW]``, broadcast over its rows."""
    return tl.reshape(x, (SLOTS_P2, 1, TW))


@triton.jit
def _slot_group(ids_ptr, weights_ptr, g_ptr, h_ptr, t, offs_n, mask_n, H, I, G_STRIDE, J0: tl.constexpr,
                NJ: tl.constexpr, NJ_P2: tl.constexpr, SLOTS: tl.constexpr, BLOCK_N: tl.constexpr,
                DENSE: tl.constexpr, W_DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """Slots ``J0 .. J0 + NJ`` of token ``t`` (``NJ_P2`` lanes, the last ones masked): the rows of their experts'
    words in the stack ``[E * H, KW]`` (``[NJ_P2 * BLOCK_N]``) and their mask ``[NJ_P2 * BLOCK_N, 1]``, their
    ``h`` rows and slot mask ``[NJ_P2]``, and each slot's coefficient: routing weight times global scale times
    the FMA decode's unit (0 past the group)."""
    offs_j = J0 + tl.arange(0, NJ_P2)
    mask_j = offs_j < J0 + NJ
    slots = t * SLOTS + offs_j
    if DENSE:
        e = (offs_j * 0).to(tl.int64)
    else:                                        # through L2 (.cg): loaded before the PDL wait, see the kernel
        e = tl.load(ids_ptr + slots, mask=mask_j, other=0, cache_modifier=".cg").to(tl.int64)
    rows = tl.reshape(e[:, None] * H + offs_n[None, :], (NJ_P2 * BLOCK_N,))
    mask_rows = tl.reshape(mask_j[:, None] & mask_n[None, :], (NJ_P2 * BLOCK_N,))[:, None]
    w = to_float32(tl.load(weights_ptr + slots, mask=mask_j, other=0, cache_modifier=".cg"), W_DTYPE, INTERPRET)
    coef = _w2_global(g_ptr, e * G_STRIDE, False, FMA_UNIT) * w
    return rows, mask_rows, h_ptr + slots.to(tl.int64) * I, mask_j, coef


@triton.jit
def _moe_packed_down_kernel(
    h_ptr, words_ptr, scales_ptr, g_ptr, ids_ptr, weights_ptr, shared_ptr, out_ptr,
    H, I, stride_om, G_STRIDE,
    SLOTS: tl.constexpr, SLOTS_A: tl.constexpr, SLOTS_B_P2: tl.constexpr, DENSE: tl.constexpr,
    HAS_SHARED: tl.constexpr, W_DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr, BLOCK_N: tl.constexpr,
    TW: tl.constexpr, EVEN_K: tl.constexpr, INTERPRET: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """Decode down + combine on packed experts: program ``(t, n)`` computes ``out[t, n * BLOCK_N : ...]`` from the
    ``SLOTS`` slots of token ``t`` at once, so that every slot's loads are in flight together: the first
    ``SLOTS_A`` (a power of two) as one ``[SLOTS_A * BLOCK_N, TW]`` tile of words per step, the rest (e.g. the
    shared expert's slot: 9 = 8 + 1) as a second tile of ``SLOTS_B_P2`` slots, rather than one tile padded to 16
    slots; each slot's rows from its own expert. Each slot's sum times its routing weight and global scale, added
    in slot order (a fixed order: the same bits on every run).

    With ``USE_PDL`` the program lets the next kernel launch at once, and loads the routing (ids, weights), the
    global scales and every slot's first step of words before it waits: it is launched right after the gate_up
    kernel, which releases it only once its own wait is over, i.e. once the router that wrote the routing has
    finished (those loads go through L2, ``.cg``, never a stale L1 line). ``h``, gate_up's output, loads after the
    wait; nothing is written before it."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    HAS_B: tl.constexpr = SLOTS > SLOTS_A
    KW = tl.cdiv(I, 128) * 16
    offs = tl.max_contiguous(tl.multiple_of(tl.arange(0, TW), 4), 4)
    offs_s = tl.arange(0, TW)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < H
    rows_a, mask_a, h_a, j_a, coef_a = _slot_group(ids_ptr, weights_ptr, g_ptr, h_ptr, t, offs_n, mask_n, H, I,
                                                   G_STRIDE, 0, SLOTS_A, SLOTS_A, SLOTS, BLOCK_N, DENSE, W_DTYPE,
                                                   INTERPRET)
    w_a = words_ptr + rows_a[:, None].to(tl.int64) * KW
    q_a, v_a = load_words(w_a, scales_ptr, rows_a, mask_a, 0, offs, offs_s, KW, False)
    acc_a = tl.zeros((SLOTS_A, BLOCK_N, TW), dtype=tl.float32)
    if HAS_B:
        rows_b, mask_b, h_b, j_b, coef_b = _slot_group(ids_ptr, weights_ptr, g_ptr, h_ptr, t, offs_n, mask_n, H, I,
                                                       G_STRIDE, SLOTS_A, SLOTS - SLOTS_A, SLOTS_B_P2, SLOTS,
                                                       BLOCK_N, DENSE, W_DTYPE, INTERPRET)
        w_b = words_ptr + rows_b[:, None].to(tl.int64) * KW
        q_b, v_b = load_words(w_b, scales_ptr, rows_b, mask_b, 0, offs, offs_s, KW, False)
        acc_b = tl.zeros((SLOTS_B_P2, BLOCK_N, TW), dtype=tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    for k0 in range(0, KW, TW):
        q_a_next, v_a_next = load_words(w_a, scales_ptr, rows_a, mask_a, k0 + TW, offs, offs_s, KW, False)
        if HAS_B:
            q_b_next, v_b_next = load_words(w_b, scales_ptr, rows_b, mask_b, k0 + TW, offs, offs_s, KW, False)
        acc_a = _slots_step(acc_a, q_a, v_a, h_a, j_a, k0, I, SLOTS_A, BLOCK_N, TW, EVEN_K, INTERPRET)
        q_a, v_a = q_a_next, v_a_next
        if HAS_B:
            acc_b = _slots_step(acc_b, q_b, v_b, h_b, j_b, k0, I, SLOTS_B_P2, BLOCK_N, TW, EVEN_K, INTERPRET)
            q_b, v_b = q_b_next, v_b_next
    y = tl.sum(tl.sum(acc_a, axis=2) * coef_a[:, None], axis=0)         # the combine: a fixed reduction order
    if HAS_B:
        y += tl.sum(tl.sum(acc_b, axis=2) * coef_b[:, None], axis=0)
    if HAS_SHARED:
        y += tl.load(shared_ptr + t.to(tl.int64) * H + offs_n, mask=mask_n, other=0.0)
    tl.store(out_ptr + t.to(tl.int64) * stride_om + offs_n, cast_output(y, OUT_DTYPE, INTERPRET), mask=mask_n)


MOE_PACKED_DOWN = runtime.Kernel("moe.packed_down", _moe_packed_down_kernel)


# ---------------------------------------------------------------------------------------------------------------
# host side


def _packed_tiles(n: int, k: int, gpu_config: dict, config: dict | None) -> tuple[dict, int]:
    """(``BLOCK_N`` / ``TW`` constexprs, ``num_warps``) of a packed decode kernel over ``n`` output rows and ``K =
    k``: ``gpu_config`` on the GPU, under the interpreter large tiles (its cost is per program and step);
    ``config`` overrides."""
    kw = runtime.cdiv(k, 128) * 16
    if runtime.INTERPRET:
        meta = {"BLOCK_N": max(4, min(32, runtime.next_power_of_2(n))),
                "TW": max(16, min(64, runtime.next_power_of_2(kw))), "num_warps": 4}
    else:
        meta = dict(gpu_config)
    unknown = set(config or {}) - {"BLOCK_N", "TW", "num_warps"}
    if unknown:
        raise ValueError(f"config keys {sorted(unknown)} are not settings of the packed decode kernels (BLOCK_N, TW, "
                         f"num_warps)")
    meta.update(config or {})
    if meta["TW"] % 16 or meta["TW"] & (meta["TW"] - 1):
        raise ValueError(f"config TW = {meta['TW']}: a packed decode step is a power of two of whole 16-word "
                         f"chunks (TW in 16, 32, 64, ...)")
    return meta, meta.pop("num_warps")


def _launch_packed_decode(x2, weights, ids, slots: int, w13: _Weights, w2: _Weights, h, out, shared_out,
                          dense: bool, config: dict | None = None) -> None:
    """The decode path on packed experts: gate_up over the ``M * slots`` slots, then down + combine over the M
    tokens (``slots`` per token: ``top_k``, or ``top_k + 1`` with the shared expert as the last one) into ``out``,
    adding ``shared_out`` (fp32) if given. ``config`` (``BLOCK_N``, ``TW``, ``num_warps``) replaces both kernels'
    tiles (tests and experiments)."""
    M, H = x2.shape
    I = h.shape[-1]
    f = _flags(x2.dtype, False, runtime.INTERPRET, True)
    batch = runtime.batch_rows(M) > 2                 # as_batch: the tiles of that many rows
    meta, warps = _packed_tiles(I, H, PACKED_UP_CONFIGS[batch], config)
    even_k = H % 128 == 0 and (H // 8) % meta["TW"] == 0
    MOE_PACKED_GATE_UP.current()[(M * slots, runtime.cdiv(I, meta["BLOCK_N"]))](
        kernel_view(x2), w13.codes, w13.scales, w13.g, ids, h, H, I, x2.stride(0), w13.g_stride,
        SLOTS=slots, DENSE=dense, G_PER_ROW=w13.g_per_row, X_DTYPE=f["X_DTYPE"], H_DTYPE=f["DOT_DTYPE"], **meta,
        EVEN=even_k and I % meta["BLOCK_N"] == 0, EVEN_K=even_k, INTERPRET=f["INTERPRET"], num_warps=warps,
        num_stages=1, **runtime.pdl_flags())
    # the down kernel must come right after gate_up: it reads the routing before its PDL wait (see both kernels)
    meta, warps = _packed_tiles(H, I, PACKED_DOWN_CONFIGS[batch], config)
    slots_a = 1 << (slots.bit_length() - 1)                       # the largest power of two <= slots
    MOE_PACKED_DOWN.current()[(M, runtime.cdiv(H, meta["BLOCK_N"]))](
        h, w2.codes, w2.scales, w2.g, ids, kernel_view(weights), out if shared_out is None else shared_out,
        kernel_view(out), H, I, out.stride(0), w2.g_stride,
        SLOTS=slots, SLOTS_A=slots_a, SLOTS_B_P2=runtime.next_power_of_2(max(1, slots - slots_a)), DENSE=dense,
        HAS_SHARED=shared_out is not None,
        W_DTYPE=runtime.TORCH_TO_TL[weights.dtype], OUT_DTYPE=runtime.TORCH_TO_TL[out.dtype], **meta,
        EVEN_K=I % 128 == 0 and (I // 8) % meta["TW"] == 0, INTERPRET=f["INTERPRET"], num_warps=warps,
        num_stages=1, **runtime.pdl_flags())


def _launch_decode(x2, weights, ids, top_k, w13: _Weights, w2: _Weights, float_w: bool, h, out, shared_out,
                   dense: bool, config: dict | None = None) -> None:
    """The decode path: gate_up over the ``M * top_k`` slots (one slot per program), then down + combine over the
    M tokens into ``out`` (x's dtype, or fp32 for the shared expert), adding ``shared_out`` (fp32) if given.
    Packed experts take :func:`_launch_packed_decode`."""
    if w13.packed:
        _launch_packed_decode(x2, weights, ids, top_k, w13, w2, h, out, shared_out, dense, config)
        return
    M, H = x2.shape
    I = h.shape[-1]
    f = _flags(x2.dtype, float_w, runtime.INTERPRET)
    flags = {k: f[k] for k in ("FLOAT_W", "X_DTYPE", "PACKED_DECODE", "ACC_UNIT", "INTERPRET")}
    batch = runtime.batch_rows(M) > 2                 # as_batch: the tiles of that many rows
    meta, warps, stages = _tiles(I, H, DECODE_UP_CONFIGS[batch], config)
    MOE_DECODE_GATE_UP.current()[(M * top_k, runtime.cdiv(I, meta["BLOCK_N"]))](
        kernel_view(x2), w13.codes, w13.scales, w13.g, ids, h,
        H, I, x2.stride(0), w13.g_stride,
        TOP_K=top_k, DENSE=dense, G_PER_ROW=w13.g_per_row, H_DTYPE=f["DOT_DTYPE"], **flags, **meta,
        num_warps=warps, num_stages=stages)
    meta, warps, stages = _tiles(H, I, DECODE_DOWN_CONFIGS[batch], config)
    MOE_DECODE_DOWN.current()[(M, runtime.cdiv(H, meta["BLOCK_N"]))](
        h, w2.codes, w2.scales, w2.g, ids, kernel_view(weights),
        out if shared_out is None else shared_out, kernel_view(out), H, I, out.stride(0), w2.g_stride,
        TOP_K=top_k, TOP_K_P2=runtime.next_power_of_2(top_k), DENSE=dense, HAS_SHARED=shared_out is not None,
        W_DTYPE=runtime.TORCH_TO_TL[weights.dtype],
        OUT_DTYPE=runtime.TORCH_TO_TL[out.dtype], **flags, **meta, num_warps=warps, num_stages=stages)
