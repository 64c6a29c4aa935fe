"""A tensor-core GEMV whose x never leaves registers: is ``mma.sync`` with both operands in registers the decode
GEMV that halves the packed GEMV's instructions a weight, and is it faster?

The packed GEMV (``matmul.packed_gemv``) issues about 50 instructions a weight word on the FMA units: 8 FMAs, about 21
to decode the word to fp32 and the rest x and addresses (``sass_census.py``); issuing them takes as long as reading
the bytes. The tensor-core GEMV (``matmul.gemv``) decodes a word to bf16 pairs in 21 and leaves the products to the
MMA (about 30 a word), but plain Triton stages x through shared memory for every step's dot, with barriers, and it
measured no faster. Here each thread issues ``mma.sync.m16n8k16`` itself (inline PTX, one per word): the packed
layout's words already hold a thread's A fragment (rows ``g`` and ``g + 8`` of a 16-row tile, columns ``2q, 2q + 1,
2q + 8, 2q + 9`` of each 16), and each thread loads its own B fragment of x (the bf16 pairs at ``2q`` and ``2q +
8``) straight from global memory into registers: no shared memory, no barrier in the loop. The B operand's 8
columns are up to 8 rows of x, so M = 1..8 cost the same. Every Triton tensor in the loop is one element a thread
(shape ``[W, T, 32]``: the warp's K share, the warp's 16-row tiles, the lane), so the lane an element lives on is
the lane the MMA expects.

Each warp takes ``T`` tiles of 16 rows and a contiguous ``1/W`` of K (``W`` warps a program split K); the loop
loads the next 128-column chunk's words while it multiplies this one; the warps' sums meet once at the end. With
PDL the first chunk's words load before the wait on the kernel before, x after it.

    PYTHONPATH=. python3 experiments/mma_gemv.py --sass          # CPU: the loop's instructions (sm_90, offline)
    PYTHONPATH=. python3 experiments/mma_gemv.py                 # GPU: exactness and the race

GPU: every shape and M checked against the fp32 reference of the packed weight (rel_l2, cosine) and the shipped
dispatch's output; then each decode shape of Qwen3.5-35B-A3B timed as a PDL chain of 16 distinct weights in one CUDA
graph (so each call reads HBM), the shipped packed GEMV against this kernel at a few tiles; M = 1 and 8.
Writes ``data/experiments/mma-gemv/<sha>.json`` (under ``$OUT`` when set); ``--sass``: ``<sha>-sass.json``.
"""

from __future__ import annotations  # noqa: I001  (the environment first: TRITON_INTERPRET is read at import)

import os
import sys

if __name__ == "__main__" and "--sass" in sys.argv:   # compile for sm_90 without a GPU
    os.environ["TRITON_INTERPRET"] = "0"

import argparse
import collections
import types

import torch
import triton
import triton.language as tl

import lynn_kernels
from lynn_kernels import runtime
from lynn_kernels.bench.harness import graph_us, measure_ceilings, provenance, save_experiment
from lynn_kernels.matmul import nvfp4_linear, pack
from lynn_kernels.matmul.triton_matmul import launch_gemv
from lynn_kernels.matmul.triton_packed import launch_packed_gemv
from lynn_kernels.metrics import compare
from lynn_kernels.nvfp4 import quantize
from lynn_kernels.runtime import cast_output

MMA_UNIT = 524288.0        # 2^19: the decoded bf16 is e2m1 * s * 2^-19


@triton.jit
def _decode_pair4(q, s, SEL_A: tl.constexpr, SEL_B: tl.constexpr):
    """One packed word ``q`` and the register ``s`` holding its scale bytes (``SEL_A`` / ``SEL_B``: the byte-permute
    selectors of its two blocks' bytes) -> its four bf16 pairs ``e2m1 * s * 2^-19`` (exact), as uint32: the A
    fragment's ``(row, 2q..)`` and ``(row, 2q + 8..)`` pairs of two 16-column steps."""
    return tl.inline_asm_elementwise(
        asm=f"""
        {{
        .reg .b32 s3, s4, s5, s6, r6, a, b, sa, sb;
        prmt.b32 sa, $5, 0, {SEL_A};
        lop3.b32 sa, sa, 0x0FF00FF0, 0x70007000, 0xEA;
        prmt.b32 sb, $5, 0, {SEL_B};
        lop3.b32 sb, sb, 0x0FF00FF0, 0x70007000, 0xEA;
        shl.b32 s3, $4, 3;
        shl.b32 s4, $4, 4;
        shl.b32 s5, $4, 5;
        shl.b32 s6, $4, 6;
        shr.b32 r6, $4, 6;
        lop3.b32 a, $4, 0x80008000, 0, 0xC0;
        lop3.b32 a, r6, 0x01C001C0, a, 0xEA;
        mul.rn.bf16x2 $0, a, sa;
        lop3.b32 a, s4, 0x80008000, 0, 0xC0;
        lop3.b32 a, $4, 0x01C001C0, a, 0xEA;
        mul.rn.bf16x2 $1, a, sa;
        lop3.b32 a, s5, 0x80008000, 0, 0xC0;
        lop3.b32 a, s3, 0x01C001C0, a, 0xEA;
        mul.rn.bf16x2 $2, a, sb;
        lop3.b32 a, s6, 0x80008000, 0, 0xC0;
        lop3.b32 a, s6, 0x01C001C0, a, 0xEA;
        mul.rn.bf16x2 $3, a, sb;
        }}
        """,
        constraints="=r,=r,=r,=r,r,r",
        args=[q, s], dtype=(tl.uint32,) * 4, is_pure=True, pack=1)


@triton.jit
def _mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """``mma.sync.m16n8k16`` bf16 x bf16 + fp32: every lane of the warp passes its fragment registers."""
    return tl.inline_asm_elementwise(
        asm="mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, "
            "{$10,$11,$12,$13};",
        constraints="=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f",
        args=[a0, a1, a2, a3, b0, b1, c0, c1, c2, c3], dtype=(tl.float32,) * 4, is_pure=True, pack=1)


@triton.jit
def _chunk_words(wrow_g, wrow_h, srow_g, srow_h, c, mask_g, mask_h):
    """A chunk's words of the thread's two rows (``g`` and ``g + 8``: 16 bytes each, words ``4q .. 4q + 3``) and
    the rows' 8 scale bytes (two uint32 each)."""
    four = tl.arange(0, 4)
    two = tl.arange(0, 2)
    qg = tl.load(wrow_g[:, :, :, None] + c[:, :, :, None] * 16 + four, mask=mask_g[:, :, :, None], other=0,
                 eviction_policy="evict_first").to(tl.uint32, bitcast=True)
    qh = tl.load(wrow_h[:, :, :, None] + c[:, :, :, None] * 16 + four, mask=mask_h[:, :, :, None], other=0,
                 eviction_policy="evict_first").to(tl.uint32, bitcast=True)
    sg = tl.load(srow_g[:, :, :, None] + c[:, :, :, None] * 2 + two, mask=mask_g[:, :, :, None], other=0,
                 eviction_policy="evict_first")
    sh = tl.load(srow_h[:, :, :, None] + c[:, :, :, None] * 2 + two, mask=mask_h[:, :, :, None], other=0,
                 eviction_policy="evict_first")
    return qg, qh, sg, sh


@triton.jit
def _split4(t):
    a, b = tl.split(tl.reshape(t, t.shape[:-1] + [2, 2]))
    a0, a1 = tl.split(a)
    b0, b1 = tl.split(b)
    return a0, b0, a1, b1


@triton.jit
def _x_pair(xrow, c, t: tl.constexpr, q, K, EVEN_K: tl.constexpr):
    """The bf16 pair of x at K positions ``128 c + 8 t + 2 q`` (and ``+ 1``) as a uint32."""
    p = c * 64 + 4 * t + q
    if EVEN_K:
        return tl.load(xrow + p)
    return tl.load(xrow + p, mask=2 * p < K, other=0)


@triton.jit
def _chunk_mma(acc0, acc1, acc2, acc3, qg, qh, sg, sh, xrow, c, q, K, EVEN_K: tl.constexpr):
    """One 128-column chunk: four words a row, eight MMAs."""
    g0, g1, g2, g3 = _split4(qg)
    h0, h1, h2, h3 = _split4(qh)
    sg0, sg1 = tl.split(sg)
    sh0, sh1 = tl.split(sh)
    # word i: its scale pair at byte 2i of the chunk's 8 (register i // 2, bytes 2(i % 2) and 2(i % 2) + 1)
    for i in tl.static_range(4):
        if i == 0:
            wg, wh, s_g, s_h = g0, h0, sg0, sh0
        elif i == 1:
            wg, wh, s_g, s_h = g1, h1, sg0, sh0
        elif i == 2:
            wg, wh, s_g, s_h = g2, h2, sg1, sh1
        else:
            wg, wh, s_g, s_h = g3, h3, sg1, sh1
        if i % 2 == 0:
            pg0, pg1, pg2, pg3 = _decode_pair4(wg, s_g, 0x0000, 0x1111)
            ph0, ph1, ph2, ph3 = _decode_pair4(wh, s_h, 0x0000, 0x1111)
        else:
            pg0, pg1, pg2, pg3 = _decode_pair4(wg, s_g, 0x2222, 0x3333)
            ph0, ph1, ph2, ph3 = _decode_pair4(wh, s_h, 0x2222, 0x3333)
        xa = _x_pair(xrow, c, 4 * i, q, K, EVEN_K)
        xb = _x_pair(xrow, c, 4 * i + 1, q, K, EVEN_K)
        acc0, acc1, acc2, acc3 = _mma(pg0, ph0, pg1, ph1, xa, xb, acc0, acc1, acc2, acc3)
        xa = _x_pair(xrow, c, 4 * i + 2, q, K, EVEN_K)
        xb = _x_pair(xrow, c, 4 * i + 3, q, K, EVEN_K)
        acc0, acc1, acc2, acc3 = _mma(pg2, ph2, pg3, ph3, xa, xb, acc0, acc1, acc2, acc3)
    return acc0, acc1, acc2, acc3


@triton.jit
def _tile_rows(words_ptr, scales_ptr, rows_g, q, N, KW):
    """The thread's word pointers (its 16-byte run of each chunk), scale pointers (a chunk's 8 bytes as two uint32)
    and masks for rows ``rows_g`` and ``rows_g + 8`` of a 16-row tile."""
    rows_h = rows_g + 8
    sptr = scales_ptr.to(tl.pointer_type(tl.uint32))
    return (words_ptr + rows_g.to(tl.int64) * KW + q * 4, words_ptr + rows_h.to(tl.int64) * KW + q * 4,
            sptr + rows_g.to(tl.int64) * (KW // 8), sptr + rows_h.to(tl.int64) * (KW // 8), rows_g < N, rows_h < N)


@triton.jit
def _x_row(x_ptr, g, M, stride_xm, like):
    """The start of the x row the thread's B column ``n = g`` holds, as bf16 pairs: row ``g``, or the last row past
    ``M``; shaped as ``like``."""
    m = tl.minimum(g, M - 1)
    return x_ptr.to(tl.pointer_type(tl.uint32)) + (m * (stride_xm // 2)).to(tl.int64) + like * 0


@triton.jit
def mma_gemv_kernel(x_ptr, words_ptr, scales_ptr, g_ptr, y_ptr, M, N, K, KW, stride_xm, stride_ym, ROWS_PER_G,
                    T: tl.constexpr, WARPS: tl.constexpr, EVEN_K: tl.constexpr, USE_PDL: tl.constexpr,
                    OUT_DTYPE: tl.constexpr):
    """``y[:M] = x[:M] @ W^T`` for ``M <= 8`` bf16 rows of x and a packed weight: ``16 T`` rows a program, its
    ``WARPS`` warps each a contiguous share of the ``KW / 16`` chunks."""
    warp = tl.arange(0, WARPS)[:, None, None]
    tile = tl.arange(0, T)[None, :, None]
    lane = tl.arange(0, 32)[None, None, :]
    g = lane // 4
    q = lane % 4
    rows_g = tl.program_id(0) * (16 * T) + tile * 16 + g + warp * 0     # [W, T, 32]
    wrow_g, wrow_h, srow_g, srow_h, mask_g, mask_h = _tile_rows(words_ptr, scales_ptr, rows_g, q, N, KW)
    chunks = KW // 16
    per_warp = tl.cdiv(chunks, WARPS)
    c0 = warp * per_warp                                                  # [W, 1, 1]
    c_end = tl.minimum(c0 + per_warp, chunks)
    c = c0 + tile * 0 + lane * 0                                          # [W, T, 32]: the chunk each loads
    live = c < c_end
    qg, qh, sg, sh = _chunk_words(wrow_g, wrow_h, srow_g, srow_h, c, mask_g & live, mask_h & live)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()                   # the weights are in flight; x comes from the kernel before
    xrow = _x_row(x_ptr, g, M, stride_xm, rows_g)
    acc0 = tl.zeros((WARPS, T, 32), dtype=tl.float32)
    acc1 = tl.zeros((WARPS, T, 32), dtype=tl.float32)
    acc2 = tl.zeros((WARPS, T, 32), dtype=tl.float32)
    acc3 = tl.zeros((WARPS, T, 32), dtype=tl.float32)
    for _ in range(0, per_warp):
        c_next = c + 1
        nxt = c_next < c_end
        qg1, qh1, sg1, sh1 = _chunk_words(wrow_g, wrow_h, srow_g, srow_h, c_next, mask_g & nxt, mask_h & nxt)
        live = c < c_end
        a0, a1, a2, a3 = _chunk_mma(acc0, acc1, acc2, acc3, qg, qh, sg, sh, xrow, tl.where(live, c, 0), q, K,
                                    EVEN_K)
        acc0 = tl.where(live, a0, acc0)
        acc1 = tl.where(live, a1, acc1)
        acc2 = tl.where(live, a2, acc2)
        acc3 = tl.where(live, a3, acc3)
        qg, qh, sg, sh = qg1, qh1, sg1, sh1
        c = c_next
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    _store_tile(tl.sum(acc0, axis=0), tl.sum(acc1, axis=0), tl.sum(acc2, axis=0), tl.sum(acc3, axis=0),
                tl.max(rows_g, axis=0), tl.reshape(q + tile * 0, (T, 32)), g_ptr, y_ptr, M, N, stride_ym,
                ROWS_PER_G, OUT_DTYPE)


@triton.jit
def _store_tile(y0, y1, y2, y3, rg, qq, g_ptr, y_ptr, M, N, stride_ym, ROWS_PER_G, OUT_DTYPE: tl.constexpr):
    """A 16-row tile's sums (each ``[R, 32]``: (row ``rg``, x row ``2 qq``), (``rg``, ``2 qq + 1``), (``rg + 8``,
    ``2 qq``), (``rg + 8``, ``2 qq + 1``), the MMA's C fragment) times the global scale, stored."""
    rh = rg + 8
    ok_g = rg < N
    ok_h = rh < N
    gg = tl.load(g_ptr + rg // ROWS_PER_G, mask=ok_g, other=0.0) * MMA_UNIT_C
    gh = tl.load(g_ptr + rh // ROWS_PER_G, mask=ok_h, other=0.0) * MMA_UNIT_C
    m0 = 2 * qq
    m1 = m0 + 1
    tl.store(y_ptr + m0.to(tl.int64) * stride_ym + rg, cast_output(y0 * gg, OUT_DTYPE, False), mask=ok_g & (m0 < M))
    tl.store(y_ptr + m1.to(tl.int64) * stride_ym + rg, cast_output(y1 * gg, OUT_DTYPE, False), mask=ok_g & (m1 < M))
    tl.store(y_ptr + m0.to(tl.int64) * stride_ym + rh, cast_output(y2 * gh, OUT_DTYPE, False), mask=ok_h & (m0 < M))
    tl.store(y_ptr + m1.to(tl.int64) * stride_ym + rh, cast_output(y3 * gh, OUT_DTYPE, False), mask=ok_h & (m1 < M))


MMA_UNIT_C = tl.constexpr(MMA_UNIT)


@triton.jit
def _chunk_x(xrow, c, q, K, EVEN_K: tl.constexpr):
    """A chunk's 16 x pairs of the thread (``t = 0 .. 15``: K positions ``128 c + 8 t + 2 q``)."""
    return (_x_pair(xrow, c, 0, q, K, EVEN_K), _x_pair(xrow, c, 1, q, K, EVEN_K), _x_pair(xrow, c, 2, q, K, EVEN_K),
            _x_pair(xrow, c, 3, q, K, EVEN_K), _x_pair(xrow, c, 4, q, K, EVEN_K), _x_pair(xrow, c, 5, q, K, EVEN_K),
            _x_pair(xrow, c, 6, q, K, EVEN_K), _x_pair(xrow, c, 7, q, K, EVEN_K), _x_pair(xrow, c, 8, q, K, EVEN_K),
            _x_pair(xrow, c, 9, q, K, EVEN_K), _x_pair(xrow, c, 10, q, K, EVEN_K),
            _x_pair(xrow, c, 11, q, K, EVEN_K), _x_pair(xrow, c, 12, q, K, EVEN_K),
            _x_pair(xrow, c, 13, q, K, EVEN_K), _x_pair(xrow, c, 14, q, K, EVEN_K),
            _x_pair(xrow, c, 15, q, K, EVEN_K))


@triton.jit
def _chunk_mma_x(acc0, acc1, acc2, acc3, qg, qh, sg, sh, xs):
    """:func:`_chunk_mma` with the chunk's x pairs already loaded (``xs``: :func:`_chunk_x`)."""
    g0, g1, g2, g3 = _split4(qg)
    h0, h1, h2, h3 = _split4(qh)
    sg0, sg1 = tl.split(sg)
    sh0, sh1 = tl.split(sh)
    pg0, pg1, pg2, pg3 = _decode_pair4(g0, sg0, 0x0000, 0x1111)
    ph0, ph1, ph2, ph3 = _decode_pair4(h0, sh0, 0x0000, 0x1111)
    acc0, acc1, acc2, acc3 = _mma(pg0, ph0, pg1, ph1, xs[0], xs[1], acc0, acc1, acc2, acc3)
    acc0, acc1, acc2, acc3 = _mma(pg2, ph2, pg3, ph3, xs[2], xs[3], acc0, acc1, acc2, acc3)
    pg0, pg1, pg2, pg3 = _decode_pair4(g1, sg0, 0x2222, 0x3333)
    ph0, ph1, ph2, ph3 = _decode_pair4(h1, sh0, 0x2222, 0x3333)
    acc0, acc1, acc2, acc3 = _mma(pg0, ph0, pg1, ph1, xs[4], xs[5], acc0, acc1, acc2, acc3)
    acc0, acc1, acc2, acc3 = _mma(pg2, ph2, pg3, ph3, xs[6], xs[7], acc0, acc1, acc2, acc3)
    pg0, pg1, pg2, pg3 = _decode_pair4(g2, sg1, 0x0000, 0x1111)
    ph0, ph1, ph2, ph3 = _decode_pair4(h2, sh1, 0x0000, 0x1111)
    acc0, acc1, acc2, acc3 = _mma(pg0, ph0, pg1, ph1, xs[8], xs[9], acc0, acc1, acc2, acc3)
    acc0, acc1, acc2, acc3 = _mma(pg2, ph2, pg3, ph3, xs[10], xs[11], acc0, acc1, acc2, acc3)
    pg0, pg1, pg2, pg3 = _decode_pair4(g3, sg1, 0x2222, 0x3333)
    ph0, ph1, ph2, ph3 = _decode_pair4(h3, sh1, 0x2222, 0x3333)
    acc0, acc1, acc2, acc3 = _mma(pg0, ph0, pg1, ph1, xs[12], xs[13], acc0, acc1, acc2, acc3)
    acc0, acc1, acc2, acc3 = _mma(pg2, ph2, pg3, ph3, xs[14], xs[15], acc0, acc1, acc2, acc3)
    return acc0, acc1, acc2, acc3


@triton.jit
def mma_gemv_ahead_kernel(x_ptr, words_ptr, scales_ptr, g_ptr, y_ptr, M, N, K, KW, stride_xm, stride_ym,
                          ROWS_PER_G, WARPS: tl.constexpr, EVEN_K: tl.constexpr, USE_PDL: tl.constexpr,
                          OUT_DTYPE: tl.constexpr):
    """:func:`mma_gemv_kernel` with each warp's whole share in flight at once: a program is 16 rows, each warp four
    chunks (512 columns; ``WARPS`` = the chunks over 4, the launcher's choice, so one pass), their words all
    loaded before the PDL wait and their x pairs all after it, then 16 MMAs."""
    warp = tl.arange(0, WARPS)[:, None, None]
    lane = tl.arange(0, 32)[None, None, :]
    g = lane // 4
    q = lane % 4
    rows_g = tl.program_id(0) * 16 + g + warp * 0                         # [W, 1, 32]
    wrow_g, wrow_h, srow_g, srow_h, mask_g, mask_h = _tile_rows(words_ptr, scales_ptr, rows_g, q, N, KW)
    chunks = KW // 16
    c0 = warp * 4 + lane * 0
    c1 = c0 + 1
    c2 = c0 + 2
    c3 = c0 + 3
    qg0, qh0, sg0, sh0 = _chunk_words(wrow_g, wrow_h, srow_g, srow_h, c0, mask_g & (c0 < chunks),
                                        mask_h & (c0 < chunks))
    qg1, qh1, sg1, sh1 = _chunk_words(wrow_g, wrow_h, srow_g, srow_h, c1, mask_g & (c1 < chunks),
                                        mask_h & (c1 < chunks))
    qg2, qh2, sg2, sh2 = _chunk_words(wrow_g, wrow_h, srow_g, srow_h, c2, mask_g & (c2 < chunks),
                                        mask_h & (c2 < chunks))
    qg3, qh3, sg3, sh3 = _chunk_words(wrow_g, wrow_h, srow_g, srow_h, c3, mask_g & (c3 < chunks),
                                        mask_h & (c3 < chunks))
    if USE_PDL:
        tl.extra.cuda.gdc_wait()                   # the weights are in flight; x comes from the kernel before
    xrow = _x_row(x_ptr, g, M, stride_xm, rows_g)
    x0 = _chunk_x(xrow, tl.where(c0 < chunks, c0, 0), q, K, EVEN_K)
    x1 = _chunk_x(xrow, tl.where(c1 < chunks, c1, 0), q, K, EVEN_K)
    x2 = _chunk_x(xrow, tl.where(c2 < chunks, c2, 0), q, K, EVEN_K)
    x3 = _chunk_x(xrow, tl.where(c3 < chunks, c3, 0), q, K, EVEN_K)
    acc0 = tl.zeros((WARPS, 1, 32), dtype=tl.float32)
    acc1 = tl.zeros((WARPS, 1, 32), dtype=tl.float32)
    acc2 = tl.zeros((WARPS, 1, 32), dtype=tl.float32)
    acc3 = tl.zeros((WARPS, 1, 32), dtype=tl.float32)
    acc0, acc1, acc2, acc3 = _chunk_mma_x(acc0, acc1, acc2, acc3, qg0, qh0, sg0, sh0, x0)
    acc0, acc1, acc2, acc3 = _chunk_mma_x(acc0, acc1, acc2, acc3, qg1, qh1, sg1, sh1, x1)
    acc0, acc1, acc2, acc3 = _chunk_mma_x(acc0, acc1, acc2, acc3, qg2, qh2, sg2, sh2, x2)
    acc0, acc1, acc2, acc3 = _chunk_mma_x(acc0, acc1, acc2, acc3, qg3, qh3, sg3, sh3, x3)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    _store_tile(tl.sum(acc0, axis=0), tl.sum(acc1, axis=0), tl.sum(acc2, axis=0), tl.sum(acc3, axis=0),
                tl.reshape(tl.max(rows_g, axis=0), (1, 32)), tl.reshape(lane % 4, (1, 32)), g_ptr, y_ptr, M, N,
                stride_ym, ROWS_PER_G, OUT_DTYPE)


@triton.jit
def mma_gemv_rows_kernel(x_ptr, words_ptr, scales_ptr, g_ptr, y_ptr, M, N, K, KW, stride_xm, stride_ym,
                         ROWS_PER_G, WARPS: tl.constexpr, EVEN_K: tl.constexpr, USE_PDL: tl.constexpr,
                         OUT_DTYPE: tl.constexpr):
    """:func:`mma_gemv_kernel` with no split of K and so no barrier: each warp walks the whole of K for its own 16
    rows (a program is ``16 WARPS`` rows), two chunks of words and one of x in flight ahead of the MMAs."""
    warp = tl.arange(0, WARPS)[:, None, None]
    lane = tl.arange(0, 32)[None, None, :]
    g = lane // 4
    q = lane % 4
    rows_g = tl.program_id(0) * (16 * WARPS) + warp * 16 + g             # [W, 1, 32]
    wrow_g, wrow_h, srow_g, srow_h, mask_g, mask_h = _tile_rows(words_ptr, scales_ptr, rows_g, q, N, KW)
    chunks = KW // 16
    zero = rows_g * 0
    qg0, qh0, sg0, sh0 = _chunk_words(wrow_g, wrow_h, srow_g, srow_h, zero, mask_g, mask_h)
    qg1, qh1, sg1, sh1 = _chunk_words(wrow_g, wrow_h, srow_g, srow_h, zero + 1, mask_g & (chunks > 1),
                                      mask_h & (chunks > 1))
    if USE_PDL:
        tl.extra.cuda.gdc_wait()                   # the weights are in flight; x comes from the kernel before
    xrow = _x_row(x_ptr, g, M, stride_xm, rows_g)
    xs = _chunk_x(xrow, zero, q, K, EVEN_K)
    acc0 = tl.zeros((WARPS, 1, 32), dtype=tl.float32)
    acc1 = tl.zeros((WARPS, 1, 32), dtype=tl.float32)
    acc2 = tl.zeros((WARPS, 1, 32), dtype=tl.float32)
    acc3 = tl.zeros((WARPS, 1, 32), dtype=tl.float32)
    for c in range(0, chunks):
        c2 = zero + c + 2
        qg2, qh2, sg2, sh2 = _chunk_words(wrow_g, wrow_h, srow_g, srow_h, c2, mask_g & (c2 < chunks),
                                          mask_h & (c2 < chunks))
        c1 = zero + c + 1
        xs1 = _chunk_x(xrow, tl.where(c1 < chunks, c1, 0), q, K, EVEN_K)
        acc0, acc1, acc2, acc3 = _chunk_mma_x(acc0, acc1, acc2, acc3, qg0, qh0, sg0, sh0, xs)
        qg0, qh0, sg0, sh0 = qg1, qh1, sg1, sh1
        qg1, qh1, sg1, sh1 = qg2, qh2, sg2, sh2
        xs = xs1
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    _rows_out(acc0, acc1, acc2, acc3, rows_g, q + warp * 0, g_ptr, y_ptr, M, N, stride_ym, ROWS_PER_G, WARPS,
              OUT_DTYPE)


@triton.jit
def mma_gemv_rows2_kernel(x_ptr, words_ptr, scales_ptr, g_ptr, y_ptr, M, N, K, KW, stride_xm, stride_ym,
                          ROWS_PER_G, WARPS: tl.constexpr, EVEN_K: tl.constexpr, USE_PDL: tl.constexpr,
                          OUT_DTYPE: tl.constexpr):
    """:func:`mma_gemv_rows_kernel` with two 16-row tiles a warp (32 rows), each with variables of its own, sharing
    each chunk's x pairs: twice the words in flight a warp for the same x loads; one chunk ahead."""
    warp = tl.arange(0, WARPS)[:, None, None]
    lane = tl.arange(0, 32)[None, None, :]
    g = lane // 4
    q = lane % 4
    ra = tl.program_id(0) * (32 * WARPS) + warp * 32 + g                 # [W, 1, 32]: rows g, g + 8 (tile a),
    rb = ra + 16                                                         # g + 16, g + 24 (tile b)
    chunks = KW // 16
    wa_g, wa_h, sa_g, sa_h, ma_g, ma_h = _tile_rows(words_ptr, scales_ptr, ra, q, N, KW)
    wb_g, wb_h, sb_g, sb_h, mb_g, mb_h = _tile_rows(words_ptr, scales_ptr, rb, q, N, KW)
    zero = ra * 0
    qga, qha, sga, sha = _chunk_words(wa_g, wa_h, sa_g, sa_h, zero, ma_g, ma_h)
    qgb, qhb, sgb, shb = _chunk_words(wb_g, wb_h, sb_g, sb_h, zero, mb_g, mb_h)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()                   # the weights are in flight; x comes from the kernel before
    xrow = _x_row(x_ptr, g, M, stride_xm, ra)
    xs = _chunk_x(xrow, zero, q, K, EVEN_K)
    a0 = tl.zeros((WARPS, 1, 32), dtype=tl.float32)
    a1 = tl.zeros((WARPS, 1, 32), dtype=tl.float32)
    a2 = tl.zeros((WARPS, 1, 32), dtype=tl.float32)
    a3 = tl.zeros((WARPS, 1, 32), dtype=tl.float32)
    b0 = tl.zeros((WARPS, 1, 32), dtype=tl.float32)
    b1 = tl.zeros((WARPS, 1, 32), dtype=tl.float32)
    b2 = tl.zeros((WARPS, 1, 32), dtype=tl.float32)
    b3 = tl.zeros((WARPS, 1, 32), dtype=tl.float32)
    for c in range(0, chunks):
        c1 = zero + c + 1
        nxt = c1 < chunks
        qga1, qha1, sga1, sha1 = _chunk_words(wa_g, wa_h, sa_g, sa_h, c1, ma_g & nxt, ma_h & nxt)
        qgb1, qhb1, sgb1, shb1 = _chunk_words(wb_g, wb_h, sb_g, sb_h, c1, mb_g & nxt, mb_h & nxt)
        xs1 = _chunk_x(xrow, tl.where(nxt, c1, 0), q, K, EVEN_K)
        a0, a1, a2, a3 = _chunk_mma_x(a0, a1, a2, a3, qga, qha, sga, sha, xs)
        b0, b1, b2, b3 = _chunk_mma_x(b0, b1, b2, b3, qgb, qhb, sgb, shb, xs)
        qga, qha, sga, sha = qga1, qha1, sga1, sha1
        qgb, qhb, sgb, shb = qgb1, qhb1, sgb1, shb1
        xs = xs1
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    _rows_out(a0, a1, a2, a3, ra, q + warp * 0, g_ptr, y_ptr, M, N, stride_ym, ROWS_PER_G, WARPS, OUT_DTYPE)
    _rows_out(b0, b1, b2, b3, rb, q + warp * 0, g_ptr, y_ptr, M, N, stride_ym, ROWS_PER_G, WARPS, OUT_DTYPE)


@triton.jit
def _rows_out(acc0, acc1, acc2, acc3, rows_g, q, g_ptr, y_ptr, M, N, stride_ym, ROWS_PER_G, WARPS: tl.constexpr,
              OUT_DTYPE: tl.constexpr):
    """A 16-row tile's outputs (rows ``rows_g`` and ``rows_g + 8``; x rows ``2q`` and ``2q + 1``) times the global
    scale, stored (:func:`_store_tile`)."""
    _store_tile(tl.reshape(acc0, (WARPS, 32)), tl.reshape(acc1, (WARPS, 32)), tl.reshape(acc2, (WARPS, 32)),
                tl.reshape(acc3, (WARPS, 32)), tl.reshape(rows_g, (WARPS, 32)), tl.reshape(q, (WARPS, 32)), g_ptr,
                y_ptr, M, N, stride_ym, ROWS_PER_G, OUT_DTYPE)


def launch_mma_gemv_rows(x2: torch.Tensor, w, y: torch.Tensor, warps: int = 4, pdl: bool = False,
                         tiles: int = 1) -> torch.Tensor:
    """:func:`launch_mma_gemv` on :func:`mma_gemv_rows_kernel` (``16 warps`` rows a program), or with ``tiles = 2``
    on :func:`mma_gemv_rows2_kernel` (``32 warps``)."""
    m, k = x2.shape
    n, kw = w.words.shape
    if m > 8 or x2.dtype != torch.bfloat16 or x2.stride(1) != 1 or x2.stride(0) % 2:
        raise ValueError(f"mma_gemv_rows takes at most 8 bf16 rows of x: got {tuple(x2.shape)} {x2.dtype}")
    extra = {"launch_pdl": True} if pdl else {}
    if tiles == 2:
        mma_gemv_rows2_kernel[(runtime.cdiv(n, 32 * warps),)](
            x2, w.words, w.scales, w.global_scale, y, m, n, k, kw, x2.stride(0), y.stride(0), w.rows_per_global(),
            WARPS=warps, EVEN_K=(8 * kw == k), USE_PDL=bool(pdl), OUT_DTYPE=runtime.TORCH_TO_TL[y.dtype],
            num_warps=warps, num_stages=1, **extra)
        return y
    mma_gemv_rows_kernel[(runtime.cdiv(n, 16 * warps),)](
        x2, w.words, w.scales, w.global_scale, y, m, n, k, kw, x2.stride(0), y.stride(0), w.rows_per_global(),
        WARPS=warps, EVEN_K=(8 * kw == k), USE_PDL=bool(pdl), OUT_DTYPE=runtime.TORCH_TO_TL[y.dtype],
        num_warps=warps, num_stages=1, **extra)
    return y


def launch_mma_gemv_ahead(x2: torch.Tensor, w, y: torch.Tensor, tile: dict | None = None,
                          pdl: bool = False) -> torch.Tensor:
    """:func:`launch_mma_gemv` on :func:`mma_gemv_ahead_kernel` (``K <= 8192``: at most 16 warps of 512 columns)."""
    m, k = x2.shape
    n, kw = w.words.shape
    warps = runtime.next_power_of_2(runtime.cdiv(kw // 16, 4))
    if m > 8 or warps > 16 or x2.dtype != torch.bfloat16 or x2.stride(1) != 1 or x2.stride(0) % 2:
        raise ValueError(f"mma_gemv_ahead takes at most 8 bf16 rows of x, K <= 8192: got {tuple(x2.shape)}")
    extra = {"launch_pdl": True} if pdl else {}
    mma_gemv_ahead_kernel[(runtime.cdiv(n, 16),)](
        x2, w.words, w.scales, w.global_scale, y, m, n, k, kw, x2.stride(0), y.stride(0), w.rows_per_global(),
        WARPS=warps, EVEN_K=(8 * kw == k), USE_PDL=bool(pdl), OUT_DTYPE=runtime.TORCH_TO_TL[y.dtype],
        num_warps=warps, num_stages=1, **extra)
    return y


def launch_mma_gemv(x2: torch.Tensor, w, y: torch.Tensor, tile: dict | None = None, pdl: bool = False) -> torch.Tensor:
    """``y [M, N] = x2 [M, K] @ w^T`` (``M <= 8``, bf16 ``x2`` with unit stride along K; ``w`` a
    :class:`~lynn_kernels.matmul.PackedNVFP4`) on :func:`mma_gemv_kernel`; ``tile``: ``T`` (16-row tiles a
    program) and ``WARPS`` (the K split)."""
    m, k = x2.shape
    n, kw = w.words.shape
    if m > 8 or x2.dtype != torch.bfloat16 or x2.stride(1) != 1 or x2.stride(0) % 2:
        raise ValueError(f"mma_gemv takes at most 8 bf16 rows of x, unit stride along K: got {tuple(x2.shape)} "
                         f"{x2.dtype} strides {x2.stride()}")
    t = {"T": 1, "WARPS": 4, **(tile or {})}
    if t["T"] == 0:                       # the form with each warp's whole share in flight
        return launch_mma_gemv_ahead(x2, w, y, None, pdl)
    if t["T"] < 0:                        # no split of K: each warp its own rows, -T warps a program
        return launch_mma_gemv_rows(x2, w, y, -t["T"], pdl, t.get("TILES", 1))
    grid = (runtime.cdiv(n, 16 * t["T"]),)
    extra = {"launch_pdl": True} if pdl else {}
    mma_gemv_kernel[grid](x2, w.words, w.scales, w.global_scale, y, m, n, k, kw, x2.stride(0), y.stride(0),
                          w.rows_per_global(), T=t["T"], WARPS=t["WARPS"], EVEN_K=(8 * kw == k),
                          USE_PDL=bool(pdl), OUT_DTYPE=runtime.TORCH_TO_TL[y.dtype], num_warps=t["WARPS"],
                          num_stages=1, **extra)
    return y


# ---------------------------------------------------------------------------------------------------------------
# off-line: the loop's instructions


def sass(tiles) -> list[dict]:
    sys.path.insert(0, os.path.dirname(__file__))
    import sass_census as sc
    from triton.runtime import driver

    driver.set_active(sc.Sm90Driver())
    out = []
    for n, k in ((12288, 2048), (2048, 4096)):
        with lynn_kernels.use_reference():
            w = pack(quantize(torch.randn(n, k, dtype=torch.bfloat16)))
        x, y = torch.randn(1, k, dtype=torch.bfloat16), torch.empty(1, n, dtype=torch.bfloat16)
        for tile in tiles:
            kern = (mma_gemv_ahead_kernel if tile["T"] == 0 else mma_gemv_kernel if tile["T"] > 0
                    else mma_gemv_rows2_kernel if tile.get("TILES", 1) == 2 else mma_gemv_rows_kernel)
            cubin = sc.compiled_by(kern, lambda: launch_mma_gemv(x, w, y, tile, pdl=True), f"{n}x{k}")
            ins, used = sc.disassemble(cubin)
            if tile["T"] == 0:                                     # no loop: the whole kernel, 32 words a thread
                kinds = collections.Counter(op.split(".")[0] for _, op, _ in ins)
                census = {"body": {"instructions": sum(kinds.values()), "by_kind": dict(kinds.most_common())}}
            else:
                census = sc.loop_census(ins)
            words = (32 if tile["T"] == 0 else 8 * tile.get("TILES", 1) if tile["T"] < 0
                     else tile["T"] * 8)                            # a thread's words a pass of the loop
            body = census["body"]["instructions"]
            row = {"n": n, "k": k, **tile, "registers": used.get("reg"), "shared": used.get("shared"),
                   "local": used.get("local"), "loop_instructions": body, "words_a_thread": words,
                   "per_word": round(body / words, 1), "by_kind": census["body"]["by_kind"]}
            out.append(row)
            print(row)
    return out


#: Qwen3.5-35B-A3B's decode projections (N, K): GDN in_proj (qkvz fused), attention q+gate, GDN out_proj and
#: attention o_proj, the shared expert's gate_up, attention k+v.
SHAPES = ((12288, 2048), (8192, 2048), (2048, 4096), (1024, 2048), (2048, 512))
TILES = ({"T": 1, "WARPS": 4}, {"T": 1, "WARPS": 16}, {"T": 0, "WARPS": 0}, {"T": -1, "WARPS": 1},
         {"T": -1, "WARPS": 1, "TILES": 2}, {"T": -2, "WARPS": 2, "TILES": 2})


def tile_key(tile: dict) -> str:
    """A tile's column: ``T<T>_W<warps>_us``, with ``x2`` for two tiles a warp."""
    return f"T{tile['T']}_W{tile['WARPS']}{'x2' if tile.get('TILES', 1) == 2 else ''}_us"


def check(rows_m=(1, 2, 5, 8)) -> list[dict]:
    """Each tile, awkward shapes and M against the fp32 product of the dequantised weight and the shipped op."""
    out = []
    for n, k, m in [(12288, 2048, 1), (1000, 2048, 3), (2048, 4096, 8), (136, 640, 1), (40, 208, 8), (4096, 2048, 2)]:
        with lynn_kernels.use_reference():
            w = pack(quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16)))
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = x.float() @ w.dequantize(torch.float32).t()
        shipped = nvfp4_linear(x, w)
        for tile in TILES:
            y = launch_mma_gemv(x, w, torch.empty(m, n, device="cuda", dtype=torch.bfloat16), tile)
            again = launch_mma_gemv(x, w, torch.empty(m, n, device="cuda", dtype=torch.bfloat16), tile)
            mt, ms = compare(y, ref), compare(shipped, ref)
            row = {"n": n, "k": k, "m": m, **tile, "rel_l2": mt.rel_l2, "cosine": mt.cosine,
                   "shipped_rel_l2": ms.rel_l2, "repeat_bits_equal": bool(torch.equal(y, again))}
            row["ok"] = bool(mt.rel_l2 < 2 * ms.rel_l2 + 1e-3 and row["repeat_bits_equal"])
            out.append(row)
    return out


def race(reps: int = 16) -> list[dict]:
    """Each shape as a chain of ``reps`` PDL launches on distinct weights in one CUDA graph: microseconds a call."""
    out = []
    for n, k in SHAPES:
        with lynn_kernels.use_reference():
            ws = [pack(quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16))) for _ in range(reps)]
        for m in (1, 8):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ys = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(reps)]

            def shipped_call(i):          # the dispatch's kernel: the packed GEMV (PDL) at M = 1, the tensor-core one
                if m <= 2:
                    return lambda: launch_packed_gemv(x, ws[i], None, ys[i], pdl=True)
                return lambda: launch_gemv(x, ws[i], None, ys[i])
            row = {"n": n, "k": k, "m": m, "mbytes": round(ws[0].nbytes / 1e6, 3)}
            row["shipped_us"] = graph_us([shipped_call(i) for i in range(reps)])
            for tile in TILES:
                key = tile_key(tile)
                row[key] = graph_us([(lambda i=i: launch_mma_gemv(x, ws[i], ys[i], tile, pdl=True))
                                     for i in range(reps)])
            best = min((v, kk) for kk, v in row.items() if kk.startswith("T"))
            row["best"], row["speedup"] = best[1], round(row["shipped_us"] / best[0], 3)
            out.append(row)
            print(row, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sass", action="store_true")
    args = ap.parse_args()
    if args.sass:
        torch.cuda.get_device_properties = lambda device=None: types.SimpleNamespace(multi_processor_count=132)
        rows = sass([{"T": 1, "WARPS": 4}, {"T": 0, "WARPS": 0}, {"T": -1, "WARPS": 1},
                     {"T": -1, "WARPS": 1, "TILES": 2}])
        res = {"provenance": provenance("python3 experiments/mma_gemv.py --sass"), "target": "sm_90", "sass": rows}
        path = save_experiment("mma-gemv", res)
        path.rename(path.with_name(path.stem + "-sass.json"))
        return
    res = {"provenance": provenance("python3 experiments/mma_gemv.py"), "ceilings": measure_ceilings().as_dict()}
    res["check"] = check()
    bad = [r for r in res["check"] if not r["ok"]]
    print(f"check: {len(res['check']) - len(bad)} of {len(res['check'])} rows ok", flush=True)
    for r in bad:
        print("  BAD", r, flush=True)
    res["race"] = race()
    print(save_experiment("mma-gemv", res))
    cols = ["n", "k", "m", "shipped_us"] + [tile_key(t) for t in TILES] + ["speedup"]
    print(" | ".join(cols))
    for r in res["race"]:
        print(" | ".join(str(round(r[c], 2)) if isinstance(r[c], float) else str(r[c]) for c in cols))


if __name__ == "__main__":
    main()
