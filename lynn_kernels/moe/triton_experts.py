"""The routed experts in Triton: grouped W4A16 GEMMs over NVFP4 expert stacks (or float ones), deterministic, no
host sync.

``out[t] = sum_j weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t))``, ``e = ids[t, j]``, on one of two paths
chosen by the batch size alone (never by the routing, which stays on the device): prefill (``M > DECODE_MAX_M``)
aligns the slots by expert and runs a tensor-core gate_up kernel, a down kernel and an ordered combine; decode runs
two FMA kernels on the weight tile's even / odd halves, the combine folded into the down kernel. The weight tiles
are exact, ``h`` is rounded once to x's dtype on every backend, the rest is fp32 until one output rounding, and no
float atomics are used, so two runs give the same bits. Each kernel's grid, inputs and outputs, the bf16-weight
switch (``FLOAT_W``) and the per-shard global scales (``G_PER_ROW``) are described in docs/moe.md, sections 3 and 5.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .. import runtime
from ..matmul.spec import GEMV_MAX_M
from ..runtime import cast_output, kernel_view, round_to_dtype, to_float32
from ..triton_shared import (
    FMA_UNIT,
    X_PRESCALE,
    decode_word,
    fma_row_step,
    fma_scales,
    kernel_constexprs,
    load_words,
    split8,
    w_halves,
    w_tile,
)
from . import spec
from .packed import shared_slot
from .spec import SharedExpert
from .triton_align import MAX_EXPERTS, launch_align
from .triton_route import ROUTER_MAX_M, launch_route, launch_router

#: Largest batch that takes the decode path (FMA kernels, one slot per program, no align): the matmul GEMV's limit.
DECODE_MAX_M = GEMV_MAX_M

#: At M <= ROUTER_MAX_M, compute the shared expert's gate as one more row of the router's product (in its launch)
#: instead of an fp32 GEMV and a sigmoid of their own (four launches). Both paths are exact up to the fp32 sum's
#: order; the switch exists so the benchmark can time both (docs/history/decode.md, issue 16).
FOLD_SHARED_GATE = True

#: GPU tiles of the prefill GEMM kernels (starting points from the matmul's small-M GEMM configs).
PREFILL_CONFIG = {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3}
#: GPU tiles of the two decode kernels (FMA, one slot or token per program), ``(M <= 2, M > 2)``: the best of 16 by
#: kernel time at M = 1, and at M = 4 / 16, on the H200 (``experiments/moe_decode_tiles.py``, docs/moe.md
#: section 4). Fewer, wider programs pay at M = 1; at M >= 4 there are programs enough and smaller tiles win.
DECODE_UP_CONFIGS = ({"BLOCK_N": 16, "BLOCK_K": 512, "num_warps": 8, "num_stages": 3},
                     {"BLOCK_N": 8, "BLOCK_K": 256, "num_warps": 4, "num_stages": 3})
DECODE_DOWN_CONFIGS = ({"BLOCK_N": 8, "BLOCK_K": 256, "num_warps": 8, "num_stages": 3},
                       {"BLOCK_N": 8, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3})
#: GPU tiles of the packed decode kernels (FMA on the packed layout, :mod:`.packed`), ``(M <= 2, M > 2)``:
#: ``BLOCK_N`` rows per program, ``TW`` words of K per step: the best tiles of the GPU sweeps at M = 1 and M = 8
#: (docs/moe.md, section 6; ``experiments/moe_packed_tiles_m8.py``).
PACKED_UP_CONFIGS = ({"BLOCK_N": 8, "TW": 64, "num_warps": 4}, {"BLOCK_N": 8, "TW": 64, "num_warps": 4})
PACKED_DOWN_CONFIGS = ({"BLOCK_N": 8, "TW": 32, "num_warps": 8}, {"BLOCK_N": 4, "TW": 16, "num_warps": 2})
COMBINE_CONFIG = {"BLOCK_T": 4, "BLOCK_H": 512, "num_warps": 4}

# ---------------------------------------------------------------------------------------------------------------
# kernels


@triton.jit
def _row_block(sorted_ptr, expert_ptr, pid_m, S, DENSE: tl.constexpr, BLOCK_M: tl.constexpr):
    """Expert (``-1``: nothing to do), rows of ``h``, their slots and which rows are real, of row block ``pid_m``."""
    offs = tl.arange(0, BLOCK_M)
    if DENSE:                                    # token rows, one expert
        e = (pid_m * 0).to(tl.int64)
        rows = pid_m * BLOCK_M + offs
        slot = rows
        valid = rows < S
    else:                                          # a block of the align step's sorted slots
        e = tl.load(expert_ptr + pid_m).to(tl.int64)
        rows = pid_m * BLOCK_M + offs
        slot = tl.load(sorted_ptr + rows)
        valid = slot < S                           # the sentinel is S
    return e, rows, slot, valid


@triton.jit
def _round_h(h, X_DTYPE: tl.constexpr, H_DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """The intermediate ``h`` (fp32) as stored: rounded to x's dtype. The GPU rounds when it stores the dot dtype;
    the interpreter stores fp32, so it rounds here and the CPU tests see the GPU's values."""
    if INTERPRET:
        h = round_to_dtype(h, X_DTYPE, INTERPRET)
    return h.to(H_DTYPE)


@triton.jit
def _expert(w_ptr, scales_ptr, e, N, K, FLOAT_W: tl.constexpr, PACKED_LAYOUT: tl.constexpr = False):
    """Expert ``e`` of a stack ``[E, N, K]``: the bases of its codes ``[N, K/2]`` and block scales ``[N, K/16]``, of
    its packed words ``[N, Kp/8]`` and scales ``[N, Kp/16]`` (``PACKED_LAYOUT``), or with ``FLOAT_W`` of its float
    rows ``[N, K]`` (the scales pointer is then unused)."""
    if FLOAT_W:
        w_e = w_ptr + e * N * K
        scales_e = scales_ptr
    elif PACKED_LAYOUT:
        KW = tl.cdiv(K, 128) * 16
        w_e = w_ptr + e * N * KW
        scales_e = scales_ptr + e * N * (KW // 2)
    else:
        w_e = w_ptr + e * N * (K // 2)
        scales_e = scales_ptr + e * N * (K // 16)
    return w_e, scales_e


@triton.jit
def _weight_tile(w_ptr, scales_ptr, offs_n, mask_n, k0, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 DOT_DTYPE: tl.constexpr, X_DTYPE: tl.constexpr, FLOAT_W: tl.constexpr, PACKED_DECODE: tl.constexpr,
                 INTERPRET: tl.constexpr, PACKED_LAYOUT: tl.constexpr = False, ACC_UNIT: tl.constexpr = 1.0):
    """W[offs_n, k0:k0+BLOCK_K] of one expert ``[N, K]`` in ``DOT_DTYPE``, the first ``tl.dot`` operand: float
    weights (x's dtype) loaded as they are, or NVFP4 decoded by the matmul's ``w_tile`` (from either layout; the
    tile is ``W / ACC_UNIT``)."""
    if FLOAT_W:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * K + offs_k[None, :],
                    mask=mask_n[:, None] & (offs_k[None, :] < K), other=0)
        return to_float32(w, X_DTYPE, INTERPRET).to(DOT_DTYPE)                        # [BLOCK_N, BLOCK_K]
    else:
        return w_tile(w_ptr, scales_ptr, offs_n, mask_n, k0, K, BLOCK_N, BLOCK_K, DOT_DTYPE, PACKED_DECODE,
                      INTERPRET, PACKED_LAYOUT, ACC_UNIT)


@triton.jit
def _weight_halves(w_ptr, scales_ptr, offs_n, mask_n, k0, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   X_DTYPE: tl.constexpr, FLOAT_W: tl.constexpr, PACKED_DECODE: tl.constexpr,
                   INTERPRET: tl.constexpr):
    """The same tile for the FMA kernels, as its even and odd columns, fp32 ``[BLOCK_N, BLOCK_K/2]`` each: float
    weights loaded as one tile and split, or NVFP4 by the matmul's ``w_halves``."""
    if FLOAT_W:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * K + offs_k[None, :],
                    mask=mask_n[:, None] & (offs_k[None, :] < K), other=0)
        w = to_float32(w, X_DTYPE, INTERPRET)                                         # [BLOCK_N, BLOCK_K]
        return tl.split(tl.reshape(w, (BLOCK_N, BLOCK_K // 2, 2)))
    else:
        return w_halves(w_ptr, scales_ptr, offs_n, mask_n, k0, K, BLOCK_N, BLOCK_K, PACKED_DECODE, INTERPRET)


@triton.jit
def _w13_global(g_ptr, e, offs_n, mask_n, I, G_STRIDE, BLOCK_N: tl.constexpr, FLOAT_W: tl.constexpr,
                G_PER_ROW: tl.constexpr, ACC_UNIT: tl.constexpr):
    """The global scales of expert ``e``'s gate rows ``offs_n`` and up rows ``I + offs_n``, fp32 ``[BLOCK_N]`` each,
    times ``ACC_UNIT`` (undoing the power of two the weight decode leaves): 1 for float weights; one per row
    with ``G_PER_ROW`` (``g[e * 2I + row]``: per-shard gate / up scales); else one, ``g[e * G_STRIDE]``."""
    if FLOAT_W:
        g_gate = tl.full((BLOCK_N,), 1.0, tl.float32)
        g_up = g_gate
    elif G_PER_ROW:
        g_rows = g_ptr + e * (2 * I) + offs_n
        g_gate = tl.load(g_rows, mask=mask_n, other=0.0) * ACC_UNIT
        g_up = tl.load(g_rows + I, mask=mask_n, other=0.0) * ACC_UNIT
    else:
        g_gate = tl.full((BLOCK_N,), 1.0, tl.float32) * (tl.load(g_ptr + e * G_STRIDE) * ACC_UNIT)
        g_up = g_gate
    return g_gate, g_up


@triton.jit
def _w2_global(g_ptr, offs, FLOAT_W: tl.constexpr, ACC_UNIT: tl.constexpr):
    """``g[offs]`` (one expert's, or ``[TOP_K_P2]`` experts') times ``ACC_UNIT``; 1 for float weights (``g_ptr``
    unused)."""
    if FLOAT_W:
        g = (offs * 0).to(tl.float32) + 1.0
    else:
        g = tl.load(g_ptr + offs) * ACC_UNIT
    return g


@triton.jit
def _moe_gate_up_kernel(
    x_ptr, codes_ptr, scales_ptr, g_ptr, sorted_ptr, expert_ptr, h_ptr,
    S, H, I, stride_xm, G_STRIDE,
    TOP_K: tl.constexpr, DENSE: tl.constexpr, FLOAT_W: tl.constexpr, G_PER_ROW: tl.constexpr,
    X_DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, PACKED_DECODE: tl.constexpr,
    PACKED_LAYOUT: tl.constexpr, ACC_UNIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, rows, slot, valid = _row_block(sorted_ptr, expert_ptr, pid_m, S, DENSE, BLOCK_M)
    if e < 0:
        return
    token = slot // TOP_K
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < I
    codes_e, scales_e = _expert(codes_ptr, scales_ptr, e, 2 * I, H, FLOAT_W, PACKED_LAYOUT)   # expert e, [2I, H]
    acc_gate = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        xt = tl.load(x_ptr + token[None, :].to(tl.int64) * stride_xm + offs_k[:, None],
                     mask=(offs_k[:, None] < H) & valid[None, :], other=0)
        xt = to_float32(xt, X_DTYPE, INTERPRET).to(DOT_DTYPE)                      # [BLOCK_K, BLOCK_M]
        wt = _weight_tile(codes_e, scales_e, offs_n, mask_n, k0, H, BLOCK_N, BLOCK_K, DOT_DTYPE, X_DTYPE,
                          FLOAT_W, PACKED_DECODE, INTERPRET, PACKED_LAYOUT, ACC_UNIT)   # gate rows [BN, BK]
        acc_gate = tl.dot(wt, xt, acc_gate, input_precision=PRECISION)
        wt = _weight_tile(codes_e, scales_e, offs_n + I, mask_n, k0, H, BLOCK_N, BLOCK_K, DOT_DTYPE, X_DTYPE,
                          FLOAT_W, PACKED_DECODE, INTERPRET, PACKED_LAYOUT, ACC_UNIT)   # up rows
        acc_up = tl.dot(wt, xt, acc_up, input_precision=PRECISION)
    g_gate, g_up = _w13_global(g_ptr, e, offs_n, mask_n, I, G_STRIDE, BLOCK_N, FLOAT_W, G_PER_ROW,
                               ACC_UNIT)                                           # [BLOCK_N] each
    gate = acc_gate * g_gate[:, None]
    h = gate * tl.sigmoid(gate) * (acc_up * g_up[:, None])                         # [BLOCK_N, BLOCK_M]
    tl.store(h_ptr + rows[None, :].to(tl.int64) * I + offs_n[:, None], _round_h(h, X_DTYPE, DOT_DTYPE, INTERPRET),
             mask=mask_n[:, None] & valid[None, :])


MOE_GATE_UP = runtime.Kernel("moe.gate_up", _moe_gate_up_kernel)


@triton.jit
def _moe_down_kernel(
    h_ptr, codes_ptr, scales_ptr, g_ptr, sorted_ptr, expert_ptr, weights_ptr, out_ptr,
    S, H, I, stride_om, G_STRIDE,
    DENSE: tl.constexpr, FLOAT_W: tl.constexpr, W_DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr,
    X_DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, PACKED_DECODE: tl.constexpr,
    PACKED_LAYOUT: tl.constexpr, ACC_UNIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, rows, slot, valid = _row_block(sorted_ptr, expert_ptr, pid_m, S, DENSE, BLOCK_M)
    if e < 0:
        return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < H
    codes_e, scales_e = _expert(codes_ptr, scales_ptr, e, H, I, FLOAT_W, PACKED_LAYOUT)   # expert e of [E, H, I]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        ht = tl.load(h_ptr + rows[None, :].to(tl.int64) * I + offs_k[:, None],
                     mask=(offs_k[:, None] < I) & valid[None, :], other=0).to(DOT_DTYPE)   # [BLOCK_K, BLOCK_M]
        wt = _weight_tile(codes_e, scales_e, offs_n, mask_n, k0, I, BLOCK_N, BLOCK_K, DOT_DTYPE, X_DTYPE,
                          FLOAT_W, PACKED_DECODE, INTERPRET, PACKED_LAYOUT, ACC_UNIT)   # [BLOCK_N, BLOCK_K]
        acc = tl.dot(wt, ht, acc, input_precision=PRECISION)
    g = _w2_global(g_ptr, e * G_STRIDE, FLOAT_W, ACC_UNIT)
    w = to_float32(tl.load(weights_ptr + slot, mask=valid, other=0), W_DTYPE, INTERPRET)   # routing weight [BLOCK_M]
    y = acc * g * w[None, :]
    tl.store(out_ptr + slot[None, :].to(tl.int64) * stride_om + offs_n[:, None], cast_output(y, OUT_DTYPE, INTERPRET),
             mask=mask_n[:, None] & valid[None, :])


MOE_DOWN = runtime.Kernel("moe.down", _moe_down_kernel)


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


@triton.jit
def _moe_combine_kernel(
    slots_ptr, shared_ptr, out_ptr, M, H, stride_om,
    TOP_K: tl.constexpr, HAS_SHARED: tl.constexpr, OUT_DTYPE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, INTERPRET: tl.constexpr,
):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (offs_t[:, None] < M) & (offs_h[None, :] < H)
    acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    for j in tl.static_range(TOP_K):                  # in choice order: the same sum on every run
        acc += tl.load(slots_ptr + (offs_t[:, None] * TOP_K + j).to(tl.int64) * H + offs_h[None, :],
                       mask=mask, other=0.0)
    if HAS_SHARED:
        acc += tl.load(shared_ptr + offs_t[:, None].to(tl.int64) * H + offs_h[None, :], mask=mask, other=0.0)
    tl.store(out_ptr + offs_t[:, None].to(tl.int64) * stride_om + offs_h[None, :],
             cast_output(acc, OUT_DTYPE, INTERPRET), mask=mask)


MOE_COMBINE = runtime.Kernel("moe.combine", _moe_combine_kernel)


# ---------------------------------------------------------------------------------------------------------------
# host side


class MoEWorkspace(NamedTuple):
    """Buffers of one :func:`launch_moe_experts` call, sized by shapes only (:func:`moe_workspace`); reusable across
    calls of the same shape, e.g. inside a CUDA graph. Unused ones (decode: the align outputs) are empty."""

    sorted_slots: torch.Tensor      #: int32 [P_max] (prefill)
    block_expert: torch.Tensor      #: int32 [P_max // block_m] (prefill)
    num_padded: torch.Tensor        #: int32 [1] (prefill)
    h: torch.Tensor                 #: [P_max or M * top_k, I] in the dot dtype (:func:`intermediate_dtype`)
    out_slots: torch.Tensor         #: fp32 [M * top_k, H] (prefill; unused when top_k = 1 without a shared expert)


def block_m_for(M: int, top_k: int, num_experts: int) -> int:
    """Rows of a prefill tile: 16, 32 or 64, by the expected rows per used expert (``M * top_k`` over at most
    ``min(E, M * top_k)`` experts): padding costs up to ``BLOCK_M - 1`` rows per expert."""
    per_expert = runtime.cdiv(M * top_k, max(1, min(num_experts, M * top_k)))
    return 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64


def intermediate_dtype(x_dtype: torch.dtype) -> torch.dtype:
    """dtype of ``h``: the dot dtype, x's own on the GPU (fp32 for fp32 x), fp32 under the interpreter."""
    return torch.float32 if runtime.INTERPRET else x_dtype


def moe_workspace(M: int, top_k: int, num_experts: int, H: int, I: int, x_dtype: torch.dtype,
                  device) -> MoEWorkspace:
    """Allocate the buffers :func:`launch_moe_experts` needs for ``x [M, H]``, ``ids [M, top_k]``, ``w2 [E, H, I]``."""
    S = M * top_k
    i32 = dict(dtype=torch.int32, device=device)
    if M <= DECODE_MAX_M:                         # no align; the down kernel sums the slots itself
        sorted_slots, block_expert, rows, slot_rows = torch.empty(0, **i32), torch.empty(0, **i32), S, 0
    else:
        block_m = block_m_for(M, top_k, num_experts)
        rows, slot_rows = spec.max_padded(S, num_experts, block_m), S
        sorted_slots, block_expert = torch.empty(rows, **i32), torch.empty(rows // block_m, **i32)
    return MoEWorkspace(sorted_slots, block_expert, torch.empty(1, **i32),
                        torch.empty((rows, I), dtype=intermediate_dtype(x_dtype), device=device),
                        torch.empty((slot_rows, H), dtype=torch.float32, device=device))


@functools.lru_cache(maxsize=None)
def _flags(x_dtype: torch.dtype, float_w: bool, interpret: bool, packed: bool = False) -> dict:
    """Constexprs of the expert kernels, from the matmul's: the dot in x's dtype on the GPU, fp32 for fp32 x and
    under the interpreter; float weights (``FLOAT_W``) or NVFP4 in the checkpoint layout (the bf16x2 decode for
    bf16 x on the GPU) or the packed one (``PACKED_LAYOUT``); ``ACC_UNIT``, the power of two each tile leaves for
    the epilogue."""
    c = kernel_constexprs(x_dtype, None, x_dtype, interpret, packed)
    return {"FLOAT_W": float_w, "X_DTYPE": c["X_DTYPE"], "DOT_DTYPE": c["DOT_DTYPE"], "PRECISION": c["PRECISION"],
            "PACKED_DECODE": c["PACKED_DECODE"] and not float_w, "PACKED_LAYOUT": packed,
            "ACC_UNIT": 1.0 if float_w else c["ACC_UNIT"], "INTERPRET": c["INTERPRET"]}


def _tiles(n: int, k: int, gpu_config: dict, config: dict | None,
           packed: bool = False) -> tuple[dict, int, int]:
    """(``BLOCK_N`` / ``BLOCK_K`` constexprs, ``num_warps``, ``num_stages``): ``gpu_config`` on the GPU, under the
    interpreter the largest tiles the shape can use (its cost is per program and loop step); ``config`` overrides.
    A packed weight's tile covers whole 128-column chunks (``BLOCK_K`` a multiple of 128)."""
    if runtime.INTERPRET:
        meta = {"BLOCK_N": max(16, min(128, runtime.next_power_of_2(n))),
                "BLOCK_K": max(128 if packed else 16, min(256, runtime.next_power_of_2(k))), "num_warps": 4}
    else:
        meta = dict(gpu_config)
    unknown = set(config or {}) - {"BLOCK_N", "BLOCK_K", "num_warps", "num_stages"}
    if unknown:
        raise ValueError(f"config keys {sorted(unknown)} are not settings of these expert kernels (BLOCK_N, BLOCK_K, "
                         f"num_warps, num_stages)")
    meta.update(config or {})
    if packed and "BLOCK_K" in meta and meta["BLOCK_K"] % 128:
        raise ValueError(f"config BLOCK_K = {meta['BLOCK_K']}: a packed expert tile covers whole chunks of 128 "
                         f"columns (BLOCK_K a multiple of 128)")
    return meta, meta.pop("num_warps"), meta.pop("num_stages", 1)


class _Weights(NamedTuple):
    """One weight's kernel arguments: codes (or packed words), block scales and global scale (for float weights the
    tensor itself three times: its rows, and two pointers never read), and how the global scale is laid out."""

    codes: torch.Tensor
    scales: torch.Tensor
    g: torch.Tensor
    g_stride: int                   #: 0: one scale (or none), 1: one per expert
    g_per_row: bool                 #: one per row of w13 (per-shard gate / up scales)
    packed: bool = False            #: the packed kernel layout (PackedExperts / PackedNVFP4)


def _weights(name: str, w, stacked: bool, w13: bool) -> _Weights:
    """The kernel arguments of ``w`` (``stacked``: an ``[E, N, K]`` stack). Every global-scale layout an
    NVFP4Tensor allows is taken for ``w13`` (``()``, ``[E]``, per row); ``w2`` takes ``()`` or ``[E]`` and raises
    on the others."""
    if not spec.is_nvfp4(w):
        v = kernel_view(w if w.is_contiguous() else w.contiguous())
        return _Weights(v, v, v, 0, False)
    packed = spec.is_packed(w)
    g = w.global_scale
    args = (w.words, w.scales, g) if packed else (w.codes, w.scales.view(torch.uint8), g)
    if not stacked and packed:                          # a PackedNVFP4 keeps its scale flat: one, or one per row
        g_rows = w.rows_per_global()
        if g_rows == w.shape[0]:
            return _Weights(*args, 0, False, True)
        if w13 and g_rows == 1:
            return _Weights(*args, 0, True, True)
        raise ValueError(f"{name}.global_scale holds one value per {g_rows} rows; the expert kernels take one per "
                         f"tensor{', or one per row for w13' if w13 else ''}")
    if g.dim() == 0:
        return _Weights(*args, 0, False, packed)
    if stacked and g.dim() == 1:
        return _Weights(*args, 1, False, packed)
    if w13:                                             # [E, 2I] or [2 Is]: one per row
        return _Weights(*args, 0, True, packed)
    want = "() or [E]" if stacked else "()"
    raise ValueError(f"{name}.global_scale has shape {tuple(g.shape)}; the grouped expert kernels take {want} for "
                     f"the down projection (one scale per tensor{' or per expert' if stacked else ''}); per-row "
                     f"global scales are supported for w13 only: requantize with one scale per expert, or use the "
                     f"reference backend")


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
    batch = M > 2
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
    batch = M > 2
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


def _launch_ffn(x2, weights, experts, sorted_slots, n_blocks, S, top_k, w13: _Weights, w2: _Weights, float_w: bool,
                h, dest, dense: bool, block_m: int, config: dict | None = None) -> None:
    """The prefill path: gate_up then down over ``n_blocks`` row blocks, into ``dest`` (fp32 per slot, or ``out``
    itself)."""
    M, H = x2.shape
    I = h.shape[-1]
    flags = _flags(x2.dtype, float_w, runtime.INTERPRET, w13.packed)
    asked = "num_stages" in (config or {})
    meta, warps, stages = _tiles(I, H, PREFILL_CONFIG, config, w13.packed)
    MOE_GATE_UP.current()[(n_blocks, runtime.cdiv(I, meta["BLOCK_N"]))](
        kernel_view(x2), w13.codes, w13.scales, w13.g, sorted_slots, experts, h,
        S, H, I, x2.stride(0), w13.g_stride,
        TOP_K=top_k, DENSE=dense, G_PER_ROW=w13.g_per_row, **flags, BLOCK_M=block_m, **meta,
        num_warps=warps, num_stages=runtime.register_dot_stages(stages, requested=asked))  # tl.dot, decoded tile
    meta, warps, stages = _tiles(H, I, PREFILL_CONFIG, config, w13.packed)
    MOE_DOWN.current()[(n_blocks, runtime.cdiv(H, meta["BLOCK_N"]))](
        h, w2.codes, w2.scales, w2.g, sorted_slots, experts, kernel_view(weights),
        kernel_view(dest), S, H, I, dest.stride(0), w2.g_stride,
        DENSE=dense, W_DTYPE=runtime.TORCH_TO_TL[weights.dtype],
        OUT_DTYPE=runtime.TORCH_TO_TL[dest.dtype], **flags, BLOCK_M=block_m, **meta,
        num_warps=warps, num_stages=runtime.register_dot_stages(stages, requested=asked))


def _launch_combine(out_slots, shared_out, out, top_k: int, config: dict | None = None, *, kernel=None) -> None:
    """Sum each token's ``top_k`` slot rows (and ``shared_out``) into ``out``; ``config`` (``BLOCK_T``, ``BLOCK_H``,
    ``num_warps``) replaces the tiles, e.g. :data:`COMBINE_CONFIG` under the interpreter (tests). ``kernel`` (a
    ``@triton.jit`` function with ``_moe_combine_kernel``'s parameters) replaces the shipped kernel."""
    M, H = out.shape
    if config is not None:
        meta = dict(config)
    elif runtime.INTERPRET:
        meta = {"BLOCK_T": max(1, min(64, runtime.next_power_of_2(M))),
                "BLOCK_H": max(16, min(1024, runtime.next_power_of_2(H))), "num_warps": 4}
    else:
        meta = dict(COMBINE_CONFIG)
    warps = meta.pop("num_warps")
    MOE_COMBINE.current(kernel)[(runtime.cdiv(M, meta["BLOCK_T"]), runtime.cdiv(H, meta["BLOCK_H"]))](
        out_slots, out_slots if shared_out is None else shared_out, kernel_view(out), M, H, out.stride(0),
        TOP_K=top_k, HAS_SHARED=shared_out is not None, OUT_DTYPE=runtime.TORCH_TO_TL[out.dtype], **meta,
        num_warps=warps, **runtime.kernel_flags())


def launch_moe_experts(x2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13, w2, out: torch.Tensor,
                       ws: MoEWorkspace, shared_out: torch.Tensor | None = None,
                       config: dict | None = None) -> torch.Tensor:
    """Launch only (no checks, no host sync; the one allocation is the align step's small int32 workspace, made on
    the stream, so capturing in a CUDA graph works): ``x2 [M, H]`` (unit stride along H) into ``out [M, H]``
    (x's dtype, unit stride along H) with the buffers of :func:`moe_workspace`. ``w13`` / ``w2``: NVFP4, or float
    tensors of x's dtype (contiguous, else copied on every call). ``shared_out`` (fp32 ``[M, H]``, contiguous) is
    added in the combine step (the shared expert's weighted output). ``config`` (``BLOCK_N``, ``BLOCK_K``,
    ``num_warps``, ``num_stages``) replaces both GEMMs' tiles (tests and experiments)."""
    M, H = x2.shape
    top_k = ids.shape[1]
    E = w13.shape[0]
    S = M * top_k
    if M == 0:
        return out
    ids = ids.contiguous()
    weights = weights.contiguous()
    float_w = not spec.is_nvfp4(w13)
    a13, a2 = _weights("w13", w13, True, True), _weights("w2", w2, True, False)
    if M <= DECODE_MAX_M:
        _launch_decode(x2, weights.view(-1), ids.view(-1), top_k, a13, a2, float_w, ws.h, out, shared_out, False,
                       config)
        return out
    block_m = block_m_for(M, top_k, E)
    launch_align(ids, E, block_m, ws.sorted_slots, ws.block_expert, ws.num_padded)
    to_out = top_k == 1 and shared_out is None
    _launch_ffn(x2, weights.view(-1), ws.block_expert, ws.sorted_slots, ws.block_expert.numel(), S, top_k, a13, a2,
                float_w, ws.h, out if to_out else ws.out_slots, False, block_m, config)
    if not to_out:
        _launch_combine(ws.out_slots, shared_out, out, top_k)
    return out


def _check_kernel_args(x, weights, ids, w13, w2) -> tuple[int, int, int]:
    M, top_k, E = spec.check_experts(x, weights, ids, w13, w2)
    for name, t in (("x", x), ("weights", weights), ("ids", ids), spec.weight_data("w13", w13),
                    spec.weight_data("w2", w2)):
        runtime.check_device(name, t)
    if E > MAX_EXPERTS:
        raise ValueError(f"w13 has E={E} experts; the align kernel handles at most {MAX_EXPERTS} "
                         f"(use the reference backend)")
    _weights("w2", w2, True, False)
    return M, top_k, E


def moe_experts_triton(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13, w2) -> torch.Tensor:
    """Host side of :func:`lynn_kernels.moe.moe_experts`: checks shapes, dtypes and devices (not id values: no
    host sync), allocates the workspace and ``out [M, H]`` in x's dtype, launches."""
    M, top_k, E = _check_kernel_args(x, weights, ids, w13, w2)
    H, I = x.shape[1], w2.shape[-1]
    x2 = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty((M, H), dtype=x.dtype, device=x.device)
    ws = moe_workspace(M, top_k, E, H, I, x.dtype, x.device)
    return launch_moe_experts(x2, weights, ids, w13, w2, out, ws)


def launch_shared_expert(x2: torch.Tensor, shared: SharedExpert, gate: torch.Tensor, h: torch.Tensor,
                         dest: torch.Tensor) -> torch.Tensor:
    """Launch only: ``dest [M, H]`` fp32 ``= gate[t] * down(silu(gate_proj(x_t)) * up_proj(x_t))`` with ``gate`` fp32
    ``[M]`` (the sigmoid of the shared expert gate) and ``h [M, Is]`` (:func:`intermediate_dtype`): the two GEMM
    kernels in dense mode (token rows, one expert)."""
    M = x2.shape[0]
    float_w = not spec.is_nvfp4(shared.w13)
    a13, a2 = _weights("shared.w13", shared.w13, False, True), _weights("shared.w2", shared.w2, False, False)
    if M <= DECODE_MAX_M:
        _launch_decode(x2, gate, gate, 1, a13, a2, float_w, h, dest, None, True)
        return dest
    block_m = max(16, min(64, runtime.next_power_of_2(M)))
    _launch_ffn(x2, gate, gate, gate, runtime.cdiv(M, block_m), M, 1, a13, a2, float_w, h, dest, True, block_m)
    return dest


def moe_block_triton(x: torch.Tensor, router_weight: torch.Tensor, w13, w2, shared: SharedExpert | None = None, *,
                     top_k: int, renormalize: bool = True, _norm: tuple | None = None) -> torch.Tensor:
    """Host side of :func:`lynn_kernels.moe.moe_block`: checks shapes, dtypes and devices (no host sync), then the
    router logits (on the GPU, for bf16 / fp16 x and router, HF's own ``F.linear``: cuBLAS accumulates in fp32 and
    rounds once, as the reference's fp32 product rounded to x's dtype, up to the order of the sum; otherwise that
    product), the routing kernel, the shared expert
    (dense mode of the expert kernels) and the routed experts, summed in the combine step and rounded once. For a
    decode batch (``M <= 16``) the router's logits and routing are one launch (its product holds the shared gate as
    one more row), and where the shared expert is expert E of packed stacks (:func:`.packed.shared_slot`) the block
    is three launches: the router writes the shared slot, then gate_up and down over ``top_k + 1`` slots a token.
    ``_norm`` (:func:`norm_moe_block_triton`, that path only): the router's ``norm`` argument; the experts then read
    its normed rows."""
    spec.check_block(x, router_weight, w13, w2, shared, top_k, renormalize)
    tensors = [("x", x), ("router_weight", router_weight), spec.weight_data("w13", w13), spec.weight_data("w2", w2)]
    if shared is not None:
        tensors += [spec.weight_data("shared.w13", shared.w13), spec.weight_data("shared.w2", shared.w2),
                    ("shared.gate_weight", shared.gate_weight)]
        _weights("shared.w2", shared.w2, False, False)
    for name, t in tensors:
        runtime.check_device(name, t)
    E, H, I = w13.shape[0], x.shape[-1], w2.shape[-1]
    if E > MAX_EXPERTS:
        raise ValueError(f"w13 has E={E} experts; the routing and align kernels handle at most {MAX_EXPERTS} "
                         f"(use the reference backend)")
    _weights("w2", w2, True, False)
    x2 = x.reshape(-1, H)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    out = torch.empty((M, H), dtype=x.dtype, device=x.device)
    if M == 0:
        return out.reshape(x.shape)
    if _slot_path(M, x.dtype, router_weight, w13, w2, shared):
        # the shared expert is expert E of the packed stacks: one more slot of the router's and experts' launches
        slots = top_k + 1
        weights = torch.empty((M, slots), dtype=torch.float32, device=x.device)
        ids = torch.empty((M, slots), dtype=torch.int32, device=x.device)
        launch_router(x2, router_weight.contiguous(), top_k, renormalize, weights, ids,
                      gate_weight=shared.gate_weight.reshape(-1).contiguous(), shared_slot=True, norm=_norm)
        if _norm is not None:
            x2 = _norm[3]                                          # the normed rows the router wrote
        h = torch.empty((M * slots, I), dtype=intermediate_dtype(x.dtype), device=x.device)
        _launch_packed_decode(x2, weights.view(-1), ids.view(-1), slots, _weights("w13", w13, True, True),
                              _weights("w2", w2, True, False), h, out, None, False)
        return out.reshape(x.shape)
    if _norm is not None:
        raise ValueError("the norm folds into the router only on the decode path of packed stacks with the shared "
                         "expert as a slot (norm_moe_block_fuses says which)")
    weights = torch.empty((M, top_k), dtype=torch.float32, device=x.device)
    ids = torch.empty((M, top_k), dtype=torch.int32, device=x.device)
    gate = None
    if M <= ROUTER_MAX_M and router_weight.dtype == x.dtype:      # logits and routing in one launch
        fold = FOLD_SHARED_GATE and shared is not None and shared.gate_weight.dtype == x.dtype
        if fold:                                                   # the shared gate: one more row of the product
            gate = torch.empty(M, dtype=torch.float32, device=x.device)
        launch_router(x2, router_weight.contiguous(), top_k, renormalize, weights, ids,
                      gate_weight=shared.gate_weight.reshape(-1).contiguous() if fold else None, gate=gate)
    else:
        if runtime.INTERPRET or x.dtype == torch.float32 or router_weight.dtype != x.dtype:
            logits = (x2.float() @ router_weight.float().t()).to(x.dtype)       # [M, E], the reference's product
        else:    # HF's router itself: one GEMM in x's dtype (fp32 accumulation, one rounding), no fp32 copies
            logits = F.linear(x2, router_weight)
        launch_route(logits, top_k, renormalize, weights, ids)
    shared_out = None
    if shared is not None:
        if gate is None:
            gate = torch.sigmoid(x2.float() @ shared.gate_weight.float().t()).view(-1)   # fp32 [M]
        h = torch.empty((M, shared.w2.shape[-1]), dtype=intermediate_dtype(x.dtype), device=x.device)
        shared_out = torch.empty((M, H), dtype=torch.float32, device=x.device)
        launch_shared_expert(x2, shared, gate, h, shared_out)
    ws = moe_workspace(M, top_k, E, H, I, x.dtype, x.device)
    launch_moe_experts(x2, weights, ids, w13, w2, out, ws, shared_out)
    return out.reshape(x.shape)


def _slot_path(M: int, dtype: torch.dtype, router_weight, w13, w2, shared) -> bool:
    """Whether :func:`moe_block_triton` runs a block of ``M`` tokens in three launches (the router with the shared
    expert as its last slot, gate_up, down)."""
    return (M <= min(ROUTER_MAX_M, DECODE_MAX_M) and router_weight.dtype == dtype and FOLD_SHARED_GATE
            and shared_slot(w13, w2, shared) and shared.gate_weight.dtype == dtype)


def norm_moe_block_fuses(x: torch.Tensor, norm_weight: torch.Tensor, router_weight, w13, w2, shared) -> bool:
    """Whether :func:`norm_moe_block_triton` folds the norm into the router's launch for this call (else it runs
    the norm kernel first)."""
    H = x.shape[-1]
    return (_slot_path(x.numel() // max(H, 1), x.dtype, router_weight, w13, w2, shared) and H <= 8192
            and norm_weight.dtype in runtime.TORCH_TO_TL)


def norm_moe_block_triton(x: torch.Tensor, norm_weight: torch.Tensor, router_weight: torch.Tensor, w13, w2,
                          shared: SharedExpert | None = None, *, top_k: int, renormalize: bool = True,
                          eps: float = 1e-6, residual: torch.Tensor | None = None) -> tuple:
    """Host side of :func:`lynn_kernels.moe.norm_moe_block`: the norm folded into the router's launch where the
    block runs in three launches (:func:`norm_moe_block_fuses`: a decode batch, packed stacks with the shared expert
    as a slot); otherwise the norm kernel, then :func:`moe_block_triton` (the same values either way)."""
    from ..norm import rmsnorm
    from ..norm import spec as norm_spec

    spec.check_block(x, router_weight, w13, w2, shared, top_k, renormalize)
    norm_spec.check_rmsnorm(x, norm_weight, eps, residual, None, None, "norm_weight")
    runtime.check_device("x", x)
    if not norm_moe_block_fuses(x, norm_weight, router_weight, w13, w2, shared):
        return norm_spec.norm_then(rmsnorm, lambda xn: moe_block_triton(
            xn, router_weight, w13, w2, shared, top_k=top_k, renormalize=renormalize), x, norm_weight, eps, residual)
    norm_spec.check_devices(x=x, norm_weight=norm_weight, residual=residual)
    H = x.shape[-1]
    x2 = norm_spec.last_dim_contiguous(x.reshape(-1, H))
    r2 = None if residual is None else norm_spec.last_dim_contiguous(residual.reshape(-1, H))
    xn = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    h = None if residual is None else torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    y = moe_block_triton(x2, router_weight, w13, w2, shared, top_k=top_k, renormalize=renormalize,
                         _norm=(r2, norm_weight.contiguous(), float(eps), xn, h))
    y, xn = y.reshape(x.shape), xn.reshape(x.shape)
    return (y, xn) if residual is None else (y, xn, h.reshape(x.shape))
