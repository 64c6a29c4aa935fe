"""The routed experts in Triton: grouped W4A16 GEMMs over NVFP4 expert stacks (or float ones), deterministic, no
host sync.

``out[t] = sum_j weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t))``, ``e = ids[t, j]``, on one of two paths
chosen by the batch size alone (never by the routing, which stays on the device): prefill (``M > DECODE_MAX_M``)
aligns the slots by expert and runs a tensor-core gate_up kernel, a down kernel and an ordered combine (here);
decode runs two FMA kernels on the weight tile's even / odd halves, the combine folded into the down kernel
(:mod:`.triton_experts_decode`; what both paths' kernels share: :mod:`.triton_experts_common`). The weight tiles
are exact, ``h`` is rounded once to x's dtype on every backend, the rest is fp32 until one output rounding, and no
float atomics are used, so two runs give the same bits. Each kernel's grid, inputs and outputs, the bf16-weight
switch (``FLOAT_W``) and the per-shard global scales (``G_PER_ROW``) are described in docs/moe.md, sections 3 and 5.
The host side of both paths is here: the workspace, the path taken per call, the shared expert, ``moe_block`` and
``norm_moe_block``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .. import runtime
from ..matmul.spec import GEMV_MAX_M
from ..runtime import cast_output, kernel_view, to_float32
from ..triton_shared import MMA_UNIT, launch_packed_dequantize, packed_w_decode, packed_w_words, w_tile
from . import spec
from .packed import shared_slot
from .spec import SharedExpert
from .triton_align import MAX_EXPERTS, launch_align
from .triton_experts_common import _expert, _flags, _round_h, _tiles, _w2_global, _w13_global, _Weights, _weights
from .triton_experts_decode import _launch_decode, _launch_packed_decode
from .triton_route import ROUTER_MAX_M, launch_route, launch_router, launch_shared_gate

#: Largest batch that takes the decode path (FMA kernels, one slot per program, no align): the matmul GEMV's limit.
DECODE_MAX_M = GEMV_MAX_M

#: At M <= ROUTER_MAX_M, compute the shared expert's gate as one more row of the router's product (in its launch)
#: instead of an fp32 GEMV and a sigmoid of their own (four launches). Both paths are exact up to the fp32 sum's
#: order; the switch exists so the benchmark can time both (docs/history/decode.md, issue 16).
FOLD_SHARED_GATE = True

#: GPU tiles of the prefill GEMM kernels: ``(up to M tokens, config)``, the first that fits (the last: any M); a
#: 128-row tile (:func:`block_m_for`) takes ``warps_128`` warps. Swept at 1,024, 2,048 and 16,384 tokens of
#: Qwen3.5-35B-A3B's experts on an H100 (data/experiments/moe-prefill-tiles/).
PREFILL_CONFIGS = ((8191, {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 1}),
                   (None, {"BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3, "warps_128": 8}))
#: The down kernel's tiles in 128-row blocks: its K (I) is short, and two stages of four warps beat the gate_up
#: tiles (Qwen3.5-35B-A3B's experts at 16,384 tokens on an H100: 3.17 ms a call against 3.38).
DOWN_CONFIG_128 = {"BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 2}
#: ... and in 64-row blocks: below 8,192 tokens gate_up keeps one stage of 64 columns, and down is 4% faster at
#: three stages of 128 (an H100: 0.209 ms a call against 0.217 at 2,048 tokens of Qwen3.5-35B-A3B's experts).
DOWN_CONFIG_64 = {"BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3}
#: One token a program, the whole row of H (2.07 TB/s at 16,384 tokens against 1.95 for 4 tokens of 512 columns).
COMBINE_CONFIG = {"BLOCK_T": 1, "BLOCK_H": 2048, "num_warps": 8}
#: The prefill GEMMs run a row block's column tiles side by side (one row of x / h read from memory once, not once
#: per column tile): the program order only, the same bits.
PREFILL_N_FIRST = True

#: In 64-row blocks at one stage, the gate_up kernel on packed ``w13`` (decoded in its loop) loads a step's words
#: and x rows into registers while the step before is decoded and multiplied (``AHEAD``); the same tiles in the same
#: order, the same bits. On an H100 it took 7-13% off gate_up at 2,048 and 4,096 tokens; the down kernel was
#: slower that way, and 128-row blocks much slower (docs/moe.md, section 3).
GATE_UP_AHEAD = True

#: From this many rows an expert on average (``M * top_k / E``) with a 16-bit x, the prefill decodes packed ``w13``
#: once per call (:func:`decode_experts`): a fixed cost a layer that fewer rows do not win back (docs/moe.md, sec. 3).
DECODED_MIN_ROWS = 512
#: The dequantise kernel's tile on an expert stack (2.12 TB/s written against 1.98 at the dense projections' tile).
DECODE_EXPERTS_CONFIG = {"BLOCK_N": 16, "BLOCK_K": 512, "num_warps": 4}
#: The gate_up kernel's tiles on decoded weights (``block_m_for`` rows).
DECODED_CONFIG = {"BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4}
#: On the decoded path, decode packed ``w2`` once too and run the down kernel on it at :data:`DECODED_DOWN_CONFIG`
#: (a workspace of ``E x H x I`` elements beside ``w13``'s); the same tiles multiplied, so the same products.
DECODED_DOWN = False
#: The down kernel's tiles on decoded weights.
DECODED_DOWN_CONFIG = {"BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4}

# ---------------------------------------------------------------------------------------------------------------
# kernels


@triton.jit
def _tile(N, BLOCK_N: tl.constexpr, N_FIRST: tl.constexpr):
    """``(row block, column tile)`` of this program. ``N_FIRST`` (a 1-D grid): the column tiles of a row block run
    side by side, so its rows of x / h come from memory once and serve all of them from L2; else the row blocks of
    one column tile (a 2-D grid), which re-reads every row once per column tile."""
    if N_FIRST:
        num_n = tl.cdiv(N, BLOCK_N)
        pid = tl.program_id(0)
        return pid // num_n, pid % num_n
    return tl.program_id(0), tl.program_id(1)


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
def _weight_tile(w_ptr, scales_ptr, offs_n, mask_n, k0, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 DOT_DTYPE: tl.constexpr, X_DTYPE: tl.constexpr, FLOAT_W: tl.constexpr, PACKED_DECODE: tl.constexpr,
                 INTERPRET: tl.constexpr, PACKED_LAYOUT: tl.constexpr = False, ACC_UNIT: tl.constexpr = 1.0):
    """W[offs_n, k0:k0+BLOCK_K] of one expert ``[N, K]`` in ``DOT_DTYPE``, which the kernels transpose into
    ``tl.dot``'s second operand (wgmma reads that one from shared memory, so they pipeline safely;
    docs/history/compiler-fault.md): float weights (x's dtype) loaded as they are, or NVFP4 decoded by the
    matmul's ``w_tile`` (from either layout; the tile is ``W / ACC_UNIT``)."""
    if FLOAT_W:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * K + offs_k[None, :],
                    mask=mask_n[:, None] & (offs_k[None, :] < K), other=0)
        if INTERPRET:                                                                 # bf16 arrives as its bits
            return to_float32(w, X_DTYPE, INTERPRET).to(DOT_DTYPE)                    # [BLOCK_N, BLOCK_K]
        return w.to(DOT_DTYPE)         # x's dtype already on the GPU: straight from shared memory to the MMA
    else:
        return w_tile(w_ptr, scales_ptr, offs_n, mask_n, k0, K, BLOCK_N, BLOCK_K, DOT_DTYPE, PACKED_DECODE,
                      INTERPRET, PACKED_LAYOUT, ACC_UNIT)


@triton.jit
def _moe_gate_up_kernel(
    x_ptr, codes_ptr, scales_ptr, g_ptr, sorted_ptr, expert_ptr, h_ptr,
    S, H, I, stride_xm, G_STRIDE,
    TOP_K: tl.constexpr, DENSE: tl.constexpr, FLOAT_W: tl.constexpr, NO_G: tl.constexpr, G_PER_ROW: tl.constexpr,
    X_DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, PACKED_DECODE: tl.constexpr,
    PACKED_LAYOUT: tl.constexpr, ACC_UNIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr,
    N_FIRST: tl.constexpr = False, AHEAD: tl.constexpr = False,
):
    pid_m, pid_n = _tile(I, BLOCK_N, N_FIRST)
    e, rows, slot, valid = _row_block(sorted_ptr, expert_ptr, pid_m, S, DENSE, BLOCK_M)
    if e < 0:
        return
    token = slot // TOP_K
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < I
    codes_e, scales_e = _expert(codes_ptr, scales_ptr, e, 2 * I, H, FLOAT_W, PACKED_LAYOUT)   # expert e, [2I, H]
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if AHEAD:           # packed weights, one stage: a step's words and x load while the step before is multiplied
        KW = tl.cdiv(H, 128) * 16
        x_rows = x_ptr + token[:, None].to(tl.int64) * stride_xm
        offs_k = tl.arange(0, BLOCK_K)
        x_n = tl.load(x_rows + offs_k[None, :], mask=valid[:, None] & (offs_k[None, :] < H), other=0)
        qg_n, vg_n = packed_w_words(codes_e, scales_e, offs_n, mask_n, 0, KW, BLOCK_K)
        qu_n, vu_n = packed_w_words(codes_e, scales_e, offs_n + I, mask_n, 0, KW, BLOCK_K)
        for k0 in range(0, H, BLOCK_K):
            xt, qg, vg, qu, vu = x_n, qg_n, vg_n, qu_n, vu_n
            offs_k = k0 + BLOCK_K + tl.arange(0, BLOCK_K)
            x_n = tl.load(x_rows + offs_k[None, :], mask=valid[:, None] & (offs_k[None, :] < H), other=0)
            qg_n, vg_n = packed_w_words(codes_e, scales_e, offs_n, mask_n, k0 + BLOCK_K, KW, BLOCK_K)
            qu_n, vu_n = packed_w_words(codes_e, scales_e, offs_n + I, mask_n, k0 + BLOCK_K, KW, BLOCK_K)
            if INTERPRET:
                xt = to_float32(xt, X_DTYPE, INTERPRET).to(DOT_DTYPE)                 # [BLOCK_M, BLOCK_K]
            else:
                xt = xt.to(DOT_DTYPE)
            wt = packed_w_decode(qg, vg, BLOCK_N, BLOCK_K, DOT_DTYPE, PACKED_DECODE, ACC_UNIT == 1.0)
            acc_gate = tl.dot(xt, tl.trans(wt), acc_gate, input_precision=PRECISION)
            wt = packed_w_decode(qu, vu, BLOCK_N, BLOCK_K, DOT_DTYPE, PACKED_DECODE, ACC_UNIT == 1.0)
            acc_up = tl.dot(xt, tl.trans(wt), acc_up, input_precision=PRECISION)
    else:
        for k0 in range(0, H, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            xt = tl.load(x_ptr + token[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                         mask=valid[:, None] & (offs_k[None, :] < H), other=0)
            if INTERPRET:
                xt = to_float32(xt, X_DTYPE, INTERPRET).to(DOT_DTYPE)                  # [BLOCK_M, BLOCK_K]
            else:
                xt = xt.to(DOT_DTYPE)
            wt = _weight_tile(codes_e, scales_e, offs_n, mask_n, k0, H, BLOCK_N, BLOCK_K, DOT_DTYPE, X_DTYPE,
                              FLOAT_W, PACKED_DECODE, INTERPRET, PACKED_LAYOUT, ACC_UNIT)   # gate rows [BN, BK]
            acc_gate = tl.dot(xt, tl.trans(wt), acc_gate, input_precision=PRECISION)   # the tile via shared memory
            wt = _weight_tile(codes_e, scales_e, offs_n + I, mask_n, k0, H, BLOCK_N, BLOCK_K, DOT_DTYPE, X_DTYPE,
                              FLOAT_W, PACKED_DECODE, INTERPRET, PACKED_LAYOUT, ACC_UNIT)   # up rows
            acc_up = tl.dot(xt, tl.trans(wt), acc_up, input_precision=PRECISION)
    g_gate, g_up = _w13_global(g_ptr, e, offs_n, mask_n, I, G_STRIDE, BLOCK_N, NO_G, G_PER_ROW,
                               ACC_UNIT)                                           # [BLOCK_N] each
    gate = acc_gate * g_gate[None, :]
    h = gate * tl.sigmoid(gate) * (acc_up * g_up[None, :])                         # [BLOCK_M, BLOCK_N]
    tl.store(h_ptr + rows[:, None].to(tl.int64) * I + offs_n[None, :], _round_h(h, X_DTYPE, DOT_DTYPE, INTERPRET),
             mask=valid[:, None] & mask_n[None, :])


MOE_GATE_UP = runtime.Kernel("moe.gate_up", _moe_gate_up_kernel)


@triton.jit
def _moe_down_kernel(
    h_ptr, codes_ptr, scales_ptr, g_ptr, sorted_ptr, expert_ptr, weights_ptr, out_ptr,
    S, H, I, stride_om, G_STRIDE,
    DENSE: tl.constexpr, FLOAT_W: tl.constexpr, NO_G: tl.constexpr, W_DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr,
    X_DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, PACKED_DECODE: tl.constexpr,
    PACKED_LAYOUT: tl.constexpr, ACC_UNIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr, N_FIRST: tl.constexpr = False,
):
    pid_m, pid_n = _tile(H, BLOCK_N, N_FIRST)
    e, rows, slot, valid = _row_block(sorted_ptr, expert_ptr, pid_m, S, DENSE, BLOCK_M)
    if e < 0:
        return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < H
    codes_e, scales_e = _expert(codes_ptr, scales_ptr, e, H, I, FLOAT_W, PACKED_LAYOUT)   # expert e of [E, H, I]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        ht = tl.load(h_ptr + rows[:, None].to(tl.int64) * I + offs_k[None, :],
                     mask=valid[:, None] & (offs_k[None, :] < I), other=0).to(DOT_DTYPE)   # [BLOCK_M, BLOCK_K]
        wt = _weight_tile(codes_e, scales_e, offs_n, mask_n, k0, I, BLOCK_N, BLOCK_K, DOT_DTYPE, X_DTYPE,
                          FLOAT_W, PACKED_DECODE, INTERPRET, PACKED_LAYOUT, ACC_UNIT)   # [BLOCK_N, BLOCK_K]
        acc = tl.dot(ht, tl.trans(wt), acc, input_precision=PRECISION)
    g = _w2_global(g_ptr, e * G_STRIDE, NO_G, ACC_UNIT)
    w = to_float32(tl.load(weights_ptr + slot, mask=valid, other=0), W_DTYPE, INTERPRET)   # routing weight [BLOCK_M]
    y = acc * g * w[:, None]
    tl.store(out_ptr + slot[:, None].to(tl.int64) * stride_om + offs_n[None, :], cast_output(y, OUT_DTYPE, INTERPRET),
             mask=valid[:, None] & mask_n[None, :])


MOE_DOWN = runtime.Kernel("moe.down", _moe_down_kernel)


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


def prefill_config(M: int, block_m: int = 64) -> dict:
    """The prefill GEMMs' GPU tiles for a batch of ``M`` tokens in tiles of ``block_m`` rows
    (:data:`PREFILL_CONFIGS`)."""
    config = dict(next(c for m, c in PREFILL_CONFIGS if m is None or M <= m))
    warps_128 = config.pop("warps_128", config["num_warps"])
    if block_m >= 128:
        config["num_warps"] = warps_128
    return config


def block_m_for(M: int, top_k: int, num_experts: int) -> int:
    """Rows of a prefill tile: 16, 64 or 128, by the expected rows per used expert (``M * top_k`` over at most
    ``min(E, M * top_k)`` experts): padding costs up to ``BLOCK_M - 1`` rows per expert, and a taller tile decodes
    each weight tile for more rows (128 from 257 rows an expert: 512 at 16,384 tokens of top-8 of 256). 64 rows
    from 17 an expert: at 32 (1,024 tokens of Qwen3.5-35B-A3B) it beat the 32-row tile, 0.91 ms against 1.04."""
    per_expert = runtime.cdiv(M * top_k, max(1, min(num_experts, M * top_k)))
    return 16 if per_expert <= 16 else 64 if per_expert <= 256 else 128


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


def use_decoded_experts(M: int, top_k: int, w13, w2, x_dtype: torch.dtype) -> bool:
    """The prefill dispatch: decode ``w13`` once (:func:`decode_experts`) for packed stacks
    (:class:`~.packed.PackedExperts`, the decoder's layout) and a 16-bit x from :data:`DECODED_MIN_ROWS` rows an
    expert on average."""
    return (x_dtype in (torch.bfloat16, torch.float16) and spec.is_packed(w13) and spec.is_packed(w2)
            and M * top_k >= DECODED_MIN_ROWS * w13.shape[0])


def decode_experts(w, a: _Weights, x_dtype: torch.dtype) -> _Weights:
    """``a`` (the kernel arguments of the packed weight ``w``, a stack ``[E, N, K]`` or one expert ``[N, K]``) with
    ``w`` decoded into a new workspace of x's dtype: each element the tile the GEMM kernels would decode in their
    loop (``e2m1 * s`` times the power of two :func:`_flags` gives as ``ACC_UNIT``, exact); the global scales stay
    the epilogue's. The workspace is ``E x N x K`` elements, freed with the returned arguments."""
    ws = torch.empty(tuple(w.shape), dtype=x_dtype, device=w.device)
    ws = kernel_view(launch_packed_dequantize(w, ws, None if runtime.INTERPRET else DECODE_EXPERTS_CONFIG))
    return a._replace(codes=ws, scales=ws, packed=False)


def _launch_ffn(x2, weights, experts, sorted_slots, n_blocks, S, top_k, w13: _Weights, w2: _Weights, float_w: bool,
                h, dest, dense: bool, block_m: int, config: dict | None = None, decoded: bool = False,
                decoded_down: bool = False) -> None:
    """The prefill path: gate_up then down over ``n_blocks`` row blocks, into ``dest`` (fp32 per slot, or ``out``
    itself). ``decoded``: ``w13`` is a packed weight decoded by :func:`decode_experts` (float tiles, the packed
    path's global scales and ``ACC_UNIT``), which gate_up runs at :data:`DECODED_CONFIG` (``config`` then replaces
    that, and down keeps its shipped tiles); ``decoded_down``: ``w2`` is decoded too, and down runs at
    :data:`DECODED_DOWN_CONFIG`."""
    M, H = x2.shape
    I = h.shape[-1]
    flags = _flags(x2.dtype, float_w, runtime.INTERPRET, w2.packed)
    tiles = prefill_config(M, block_m)
    if decoded:
        up_flags = dict(_flags(x2.dtype, False, runtime.INTERPRET, True), FLOAT_W=True, PACKED_DECODE=False,
                        ACC_UNIT=1.0 if x2.dtype == torch.float16 else MMA_UNIT.value)   # as the decode left it
        meta, warps, stages = _tiles(I, H, DECODED_CONFIG, config)
        config = None
    else:
        up_flags = flags
        meta, warps, stages = _tiles(I, H, tiles, config, w13.packed)
    MOE_GATE_UP.current()[_grid(n_blocks, I, meta["BLOCK_N"])](
        kernel_view(x2), w13.codes, w13.scales, w13.g, sorted_slots, experts, h,
        S, H, I, x2.stride(0), w13.g_stride,
        TOP_K=top_k, DENSE=dense, NO_G=float_w, G_PER_ROW=w13.g_per_row, **up_flags, BLOCK_M=block_m, **meta,
        N_FIRST=PREFILL_N_FIRST, AHEAD=GATE_UP_AHEAD and block_m == 64 and stages == 1 and up_flags["PACKED_LAYOUT"]
        and not up_flags["FLOAT_W"], num_warps=warps, num_stages=stages)   # weights: the 2nd operand, safe to pipeline
    if decoded_down:
        flags = up_flags
        meta, warps, stages = _tiles(H, I, DECODED_DOWN_CONFIG, None)
    else:
        down = DOWN_CONFIG_128 if block_m >= 128 else DOWN_CONFIG_64 if block_m == 64 else tiles
        meta, warps, stages = _tiles(H, I, down, config, w2.packed)
    MOE_DOWN.current()[_grid(n_blocks, H, meta["BLOCK_N"])](
        h, w2.codes, w2.scales, w2.g, sorted_slots, experts, kernel_view(weights),
        kernel_view(dest), S, H, I, dest.stride(0), w2.g_stride,
        DENSE=dense, NO_G=float_w, W_DTYPE=runtime.TORCH_TO_TL[weights.dtype],
        OUT_DTYPE=runtime.TORCH_TO_TL[dest.dtype], **flags, BLOCK_M=block_m, **meta, N_FIRST=PREFILL_N_FIRST,
        num_warps=warps, num_stages=stages)


def _grid(n_blocks: int, N: int, block_n: int) -> tuple:
    """The prefill GEMMs' grid over ``n_blocks`` row blocks and ``N`` columns (:data:`PREFILL_N_FIRST`)."""
    num_n = runtime.cdiv(N, block_n)
    return (n_blocks * num_n,) if PREFILL_N_FIRST else (n_blocks, num_n)


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
                       config: dict | None = None, decoded: bool | None = None) -> torch.Tensor:
    """Launch only (no checks, no host sync; the allocations are the align step's small int32 workspace and, on
    the decoded path, the decoded stacks, made on the stream, so capturing in a CUDA graph works): ``x2 [M, H]``
    (unit stride along H) into ``out [M, H]`` (x's dtype, unit stride along H) with the buffers of
    :func:`moe_workspace`. ``w13`` / ``w2``: NVFP4, or float tensors of x's dtype (contiguous, else copied on every
    call). ``shared_out`` (fp32 ``[M, H]``, contiguous) is added in the combine step (the shared expert's weighted
    output). ``config`` (``BLOCK_N``, ``BLOCK_K``, ``num_warps``, ``num_stages``) replaces both GEMMs' tiles (tests
    and experiments; on the decoded path gate_up's only). ``decoded`` forces the prefill path to decode a packed
    ``w13`` once (True) or in the loop (False); None: :func:`use_decoded_experts`."""
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
    if decoded is None:
        decoded = use_decoded_experts(M, top_k, w13, w2, x2.dtype)
    elif decoded and not (spec.is_packed(w13) and spec.is_packed(w2)):
        raise ValueError("decoded=True decodes packed expert stacks (PackedExperts: pack_experts); these are "
                         f"{type(w13).__name__} / {type(w2).__name__}")
    if decoded:
        a13 = decode_experts(w13, a13, x2.dtype)
        if DECODED_DOWN:
            a2 = decode_experts(w2, a2, x2.dtype)
    _launch_ffn(x2, weights.view(-1), ws.block_expert, ws.sorted_slots, ws.block_expert.numel(), S, top_k, a13, a2,
                float_w, ws.h, out if to_out else ws.out_slots, False, block_m, config, decoded,
                decoded and DECODED_DOWN)
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
                         dest: torch.Tensor, decoded: bool = False) -> torch.Tensor:
    """Launch only: ``dest [M, H]`` fp32 ``= gate[t] * down(silu(gate_proj(x_t)) * up_proj(x_t))`` with ``gate`` fp32
    ``[M]`` (the sigmoid of the shared expert gate) and ``h [M, Is]`` (:func:`intermediate_dtype`): the two GEMM
    kernels in dense mode (token rows, one expert); ``decoded``: a packed ``w13`` decoded once
    (:func:`decode_experts`, past the decode path's ``M``)."""
    M = x2.shape[0]
    float_w = not spec.is_nvfp4(shared.w13)
    a13, a2 = _weights("shared.w13", shared.w13, False, True), _weights("shared.w2", shared.w2, False, False)
    if M <= DECODE_MAX_M:
        _launch_decode(x2, gate, gate, 1, a13, a2, float_w, h, dest, None, True)
        return dest
    block_m = max(16, min(64, runtime.next_power_of_2(M)))
    if decoded:
        a13 = decode_experts(shared.w13, a13, x2.dtype)
    _launch_ffn(x2, gate, gate, gate, runtime.cdiv(M, block_m), M, 1, a13, a2, float_w, h, dest, True, block_m,
                decoded=decoded)
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
    like = runtime.batch_rows(M)
    if like != M and max(like, M) > DECODE_MAX_M:     # as_batch: pieces that each take the path of `like` rows
        def block(p):
            return moe_block_triton(p, router_weight, w13, w2, shared, top_k=top_k, renormalize=renormalize)
        if like > DECODE_MAX_M:                      # the prefill path's tiles follow M: exactly `like` rows a call
            return runtime.in_calls_of(block, x2, like).reshape(x.shape)
        return torch.cat([block(p) for p in x2.split(DECODE_MAX_M)]).reshape(x.shape)   # decode path: by rows
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
    decoded = M > DECODE_MAX_M and use_decoded_experts(M, top_k, w13, w2, x.dtype)
    if shared is not None:
        if gate is None:                                           # fp32 [M]
            gate = launch_shared_gate(x2, shared.gate_weight.reshape(-1).contiguous(),
                                      torch.empty(M, dtype=torch.float32, device=x.device))
        h = torch.empty((M, shared.w2.shape[-1]), dtype=intermediate_dtype(x.dtype), device=x.device)
        shared_out = torch.empty((M, H), dtype=torch.float32, device=x.device)
        launch_shared_expert(x2, shared, gate, h, shared_out, decoded and spec.is_packed(shared.w13))
    ws = moe_workspace(M, top_k, E, H, I, x.dtype, x.device)
    launch_moe_experts(x2, weights, ids, w13, w2, out, ws, shared_out, decoded=decoded)
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
