"""Packed-layout W4A16 kernels: the decode GEMV on the FMA units, and the packed weight tile for the tensor-core
kernels of :mod:`.triton_matmul`. The layout is :mod:`.packed`'s; the design and its measurements are in
docs/matmul.md.

The decode of one int32 word (8 codes) is 13 integer operations in all: five shifts shared by the four bf16 pairs,
an AND and an AND-OR per pair (:func:`decode_word`). Each pair becomes two fp32 values ``e2m1 * 2^-126`` by a
shift and a mask (a bf16 is the top half of an fp32). The GEMV multiplies them by ``x * 2^64`` (so the products
are normal fp32: ``e2m1 * x * 2^-62``, exact), adds the products of each half word (a half word lies in one block),
and scales each half's sum by its block scale ``s * 2^75`` with one more FMA; the epilogue multiplies by
``global_scale * 2^-13`` once per output. Every step is exact but the fp32 additions, as in the reference.

The tensor-core tile (:func:`packed_w_tile`) decodes the same words to bf16 and only relabels them: the layout puts
in each word the eight elements one thread holds of the ``mma`` A operand, so the compiled kernel feeds the decoded
registers to the tensor cores with no shared-memory round trip (docs/matmul.md).

Public helpers the MoE decode kernels (:mod:`lynn_kernels.moe.triton_experts`) reuse: :func:`decode_word`,
:func:`fma_scales` (a word's two block scales for the FMA path), :func:`load_words` (a step's words and scale pairs),
:func:`fma_row_step` (one x row's FMAs over a step) and :func:`split8` (x in word order, by element), with
:data:`FMA_UNIT`.

The range this buys: ``|x|`` below ``2^64`` (``x * 2^64`` stays finite) and products above ``2^-64`` stay normal;
beyond, fp32 itself would be the limit of the reference too (``e2m1 * scale * x`` near fp32's ends).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..norm.triton_rmsnorm import normed_at, norm_row
from ..runtime import cast_output, to_float32

X_PRESCALE = tl.constexpr(18446744073709551616.0)     # 2^64
FMA_UNIT = tl.constexpr(1.0 / 8192.0)                 # 2^-13: undoes 2^64 * 2^-126 * 2^75
MMA_UNIT = tl.constexpr(524288.0)                     # 2^19: undoes 2^-126 * 2^107


@triton.jit
def _shift(q, S: tl.constexpr):
    if S > 0:
        return q << S
    elif S < 0:
        return q >> (-S)
    else:
        return q


@triton.jit
def _pair(q, SIGN: tl.constexpr, MAG: tl.constexpr):
    """One bf16 pair of a packed word: sign bits to 15 / 31, magnitude bits to 8..6 / 24..22."""
    return (_shift(q, SIGN) & 0x80008000) | (_shift(q, MAG) & 0x01C001C0)


@triton.jit
def _halves(t):
    """A bf16 pair -> (low, high) as fp32 (a bf16 is the top half of an fp32)."""
    return (t << 16).to(tl.float32, bitcast=True), (t & 0xFFFF0000).to(tl.float32, bitcast=True)


@triton.jit
def decode_word(q):
    """Packed words (uint32, any shape) -> the 8 elements ``e2m1 * 2^-126`` as fp32, in element order ``j = 0 .. 7``
    (:func:`lynn_kernels.matmul.packed.word_k` gives each element's K position)."""
    e0, e1 = _halves(_pair(q, 0, -6))
    e2, e3 = _halves(_pair(q, 4, 0))
    e4, e5 = _halves(_pair(q, 5, 3))
    e6, e7 = _halves(_pair(q, 6, 6))
    return e0, e1, e2, e3, e4, e5, e6, e7


@triton.jit
def decode_scales(v, OR: tl.constexpr):
    """A word's two re-encoded scale bytes (``v``: 16 bits, the block of elements 0..3 in the low byte) -> two fp32
    ``s * 2^75`` (``OR = 0x60000000``) or ``s * 2^107`` (``0x70000000``): each byte's nibbles swapped back into
    bits 20..27 of an fp32 (``(b << 20) | OR``)."""
    v = v.to(tl.uint32)
    sa = ((v & 0x0F) << 24) | ((v & 0xF0) << 16) | OR
    sb = ((v & 0x0F00) << 16) | ((v & 0xF000) << 8) | OR
    return sa.to(tl.float32, bitcast=True), sb.to(tl.float32, bitcast=True)


@triton.jit
def _decode_scales_asm(v, OR: tl.constexpr):
    """GPU only: :func:`decode_scales` in four instructions: a byte-permute puts a scale byte into the top two
    bytes (its swapped nibbles land on bits 20..27), one ``lop3`` AND-OR keeps them under the exponent's constant
    bits."""
    return tl.inline_asm_elementwise(
        asm=f"""
        {{
        prmt.b32 $0, $2, 0, 0x0000;
        lop3.b32 $0, $0, 0x0FF00000, {OR}, 0xEA;
        prmt.b32 $1, $2, 0, 0x1111;
        lop3.b32 $1, $1, 0x0FF00000, {OR}, 0xEA;
        }}
        """,
        constraints="=r,=r,r", args=[v.to(tl.uint32)], dtype=(tl.float32, tl.float32), is_pure=True, pack=1)


@triton.jit
def fma_scales(v, INTERPRET: tl.constexpr):
    """A word's two re-encoded scale bytes -> the two fp32 block scales ``s * 2^75`` of the FMA kernels: inline PTX
    on the GPU (:func:`_decode_scales_asm`), :func:`decode_scales` under the interpreter."""
    if INTERPRET:
        return decode_scales(v, 0x60000000)
    else:
        return _decode_scales_asm(v, 0x60000000)


@triton.jit
def _word_scales(scales_ptr, rows, mask_rows, w, KW, EVEN: tl.constexpr):
    """The 16-bit scale pair of each word ``w`` (word indices of a row, any shape broadcasting with ``rows``): word
    ``16 c + 4 q + i`` spans the blocks ``8 c + 2 i`` and ``8 c + 2 i + 1``, adjacent bytes of the row's scales."""
    ptr = scales_ptr.to(tl.pointer_type(tl.uint16)) + rows.to(tl.int64) * (KW // 4) + (w // 16) * 4 + (w % 4)
    if EVEN:
        return tl.load(ptr, eviction_policy="evict_first")
    return tl.load(ptr, mask=mask_rows & (w < KW), other=0, eviction_policy="evict_first")


@triton.jit
def _fragment_tile(e0, e1, e2, e3, e4, e5, e6, e7, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The 8 elements of each word (``[BLOCK_N, BLOCK_K / 8]`` each) -> the tile ``[BLOCK_N, BLOCK_K]`` in ``K`` order:
    element ``j`` of word ``16 c + 4 q + i`` is column ``128 c + 32 i + 16 (j >> 2) + 8 ((j >> 1) & 1) + 2 q +
    (j & 1)`` (:func:`lynn_kernels.matmul.packed.word_k`). Joins, a reshape and a permute only: each thread keeps
    the elements it decoded, which are the ones the tensor cores' A operand wants from it."""
    t = tl.join(tl.join(tl.join(e0, e1), tl.join(e2, e3)), tl.join(tl.join(e4, e5), tl.join(e6, e7)))
    t = tl.reshape(t, (BLOCK_N, BLOCK_K // 128, 4, 4, 2, 2, 2))             # [n, c, q, i, j0, j1, j2]
    t = tl.permute(t, (0, 1, 3, 6, 5, 2, 4))                                # [n, c, i, j2, j1, q, j0]
    return tl.reshape(t, (BLOCK_N, BLOCK_K))


@triton.jit
def split8(x, TW: tl.constexpr):
    """``x [TW, 8]`` -> its 8 columns ``x[:, j]`` in order (``[TW]`` each)."""
    even, odd = tl.split(tl.reshape(x, (TW, 4, 2)))        # j = 2u + c
    e_lo, e_hi = tl.split(tl.reshape(even, (TW, 2, 2)))     # u = 2a + b: b = 0 -> j = 0, 4; b = 1 -> j = 2, 6
    o_lo, o_hi = tl.split(tl.reshape(odd, (TW, 2, 2)))
    x0, x4 = tl.split(e_lo)
    x2, x6 = tl.split(e_hi)
    x1, x5 = tl.split(o_lo)
    x3, x7 = tl.split(o_hi)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _halves_bf16(p):
    """A bf16 pair in a uint32 -> (low, high) bf16 (the compiler keeps them in the one register)."""
    return ((p & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True),
            (p >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True))


@triton.jit
def _decode_word_bf16(q, v):
    """GPU only: packed words ``q`` (uint32) and their two re-encoded scale bytes ``v`` (the low 16 bits) -> the 8
    elements ``e2m1 * s * 2^-19`` as bf16, in element order: per pair the two masks of :func:`_pair`, then one
    ``mul.rn.bf16x2`` by its block's scale (exact: six significant bits, a normal number). A scale byte becomes a
    bf16 pair ``s * 2^107`` by one byte-permute (the byte into all four bytes) and one AND-OR (its swapped nibbles
    land on bits 4..11 of each half under the exponent's constant top bits): 21 instructions a word."""
    p0, p1, p2, p3 = tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 s3, s4, s5, s6, r6, a, b, sa, sb;
        prmt.b32 sa, $5, 0, 0x0000;
        lop3.b32 sa, sa, 0x0FF00FF0, 0x70007000, 0xEA;
        prmt.b32 sb, $5, 0, 0x1111;
        lop3.b32 sb, sb, 0x0FF00FF0, 0x70007000, 0xEA;
        shl.b32 s3, $4, 3;
        shl.b32 s4, $4, 4;
        shl.b32 s5, $4, 5;
        shl.b32 s6, $4, 6;
        shr.b32 r6, $4, 6;
        and.b32 a, $4, 0x80008000;
        and.b32 b, r6, 0x01C001C0;
        or.b32 a, a, b;
        mul.rn.bf16x2 $0, a, sa;
        and.b32 a, s4, 0x80008000;
        and.b32 b, $4, 0x01C001C0;
        or.b32 a, a, b;
        mul.rn.bf16x2 $1, a, sa;
        and.b32 a, s5, 0x80008000;
        and.b32 b, s3, 0x01C001C0;
        or.b32 a, a, b;
        mul.rn.bf16x2 $2, a, sb;
        and.b32 a, s6, 0x80008000;
        and.b32 b, s6, 0x01C001C0;
        or.b32 a, a, b;
        mul.rn.bf16x2 $3, a, sb;
        }
        """,
        constraints="=r,=r,=r,=r,r,r",
        args=[q, v.to(tl.uint32)], dtype=(tl.uint32,) * 4, is_pure=True, pack=1)
    return _halves_bf16(p0) + _halves_bf16(p1) + _halves_bf16(p2) + _halves_bf16(p3)


@triton.jit
def packed_w_tile(words_ptr, scales_ptr, offs_n, mask_n, k0, KW, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  DOT_DTYPE: tl.constexpr, BF16_ASM: tl.constexpr = False, UNSCALED: tl.constexpr = False):
    """The packed weight ``W[offs_n, k0 : k0 + BLOCK_K]`` (``BLOCK_K`` and ``k0`` multiples of 128; ``KW`` words a
    row, padded) as a ``DOT_DTYPE`` tile equal to ``e2m1 * s * 2^-19`` (exact: six significant bits, a normal
    number), for ``tl.dot``; the epilogue multiplies by ``2^19``. ``UNSCALED`` (fp16 tiles: fp16's range is
    narrower) makes it ``e2m1 * s``, the epilogue's unit 1. With ``BF16_ASM`` (bf16 on the GPU) the decode is
    :func:`_decode_word_bf16`; otherwise portable fp32 integer ops. Either way the elements are put in place by
    :func:`_fragment_tile`."""
    offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    mask = mask_n[:, None] & (offs_w[None, :] < KW)
    q = tl.load(words_ptr + offs_n[:, None].to(tl.int64) * KW + offs_w[None, :], mask=mask, other=0,
                eviction_policy="evict_first").to(tl.uint32, bitcast=True)
    v = _word_scales(scales_ptr, offs_n[:, None], mask_n[:, None], offs_w[None, :], KW, False)
    if BF16_ASM:
        e0, e1, e2, e3, e4, e5, e6, e7 = _decode_word_bf16(q, v)
        return _fragment_tile(e0, e1, e2, e3, e4, e5, e6, e7, BLOCK_N, BLOCK_K)
    else:
        e0, e1, e2, e3, e4, e5, e6, e7 = decode_word(q)
        sa, sb = decode_scales(v, 0x70000000)
        w = _fragment_tile(e0 * sa, e1 * sa, e2 * sa, e3 * sa, e4 * sb, e5 * sb, e6 * sb, e7 * sb, BLOCK_N, BLOCK_K)
        if UNSCALED:        # fp16 cannot hold e2m1 * s * 2^-19: the fp16 tile is e2m1 * s itself (the scale alone
            w = w * MMA_UNIT  # cannot take the 2^19 first: s * 2^126 overflows fp32)
        return w.to(DOT_DTYPE)


@triton.jit
def load_words(wrow, scales_ptr, rows, mask_w, k0, offs, offs_s, KW, EVEN: tl.constexpr):
    """A step's words ``[BLOCK_N, TW]`` (16-byte runs: ``offs`` says 4 contiguous) and each word's 16-bit scale
    pair (``offs_s``: the same word indices, with no hint, so the four pairs of a run load as 8 bytes)."""
    if EVEN:
        q = tl.load(wrow + (k0 + offs)[None, :], eviction_policy="evict_first")
    else:
        q = tl.load(wrow + (k0 + offs)[None, :], mask=mask_w & ((k0 + offs)[None, :] < KW), other=0,
                    eviction_policy="evict_first")
    v = _word_scales(scales_ptr, rows[:, None], mask_w, (k0 + offs_s)[None, :], KW, EVEN)
    return q.to(tl.uint32, bitcast=True), v


@triton.jit
def fma_row_step(acc, e0, e1, e2, e3, e4, e5, e6, e7, sa, sb, x_ptr, m, M, K, k0, offs, stride_xm, stride_xk,
                 TW: tl.constexpr, EVEN_K: tl.constexpr, X_DTYPE: tl.constexpr, INTERPRET: tl.constexpr,
                 r_ptr=None, nw_ptr=None, rstd=None, stride_rm=0, NORM: tl.constexpr = 0,
                 NW_DTYPE: tl.constexpr = tl.float32):
    """One x row's share of a step: ``acc [BLOCK_N, TW] += sa * sum_{j<4} e_j x_j + sb * sum_{j>=4} e_j x_j`` (fp32
    FMAs), ``x_j`` the x element at the ``K`` position of word element ``j`` (the layout's order). With ``NORM``
    the row is the RMSNorm of ``x`` (and ``r``; unit stride along K: :func:`~lynn_kernels.norm.triton_rmsnorm.normed_at`),
    not ``x`` itself."""
    kx = 8 * k0 + tl.arange(0, 8 * TW)                                       # the step's x, contiguous
    if EVEN_K:
        mask = (kx >= 0) & (m < M)
    else:
        mask = (kx < K) & (m < M)
    if NORM > 0:
        mm = tl.full((), m, tl.int64)
        xt = normed_at(x_ptr + mm * stride_xm, r_ptr + mm * stride_rm, nw_ptr, kx, rstd, mask, NORM == 2, X_DTYPE,
                       NW_DTYPE, INTERPRET)
    else:
        xt = tl.load(x_ptr + (tl.full((), m, tl.int64) * stride_xm) + kx * stride_xk, mask=mask, other=0)
    # K order -> word order: k = 128 c + 32 i + 16 j2 + 8 j1 + 2 q + j0 is element j0 + 2 j1 + 4 j2 of word 16 c + 4 q + i
    xt = tl.reshape(xt, (TW // 16, 4, 2, 2, 4, 2))                           # [c, i, j2, j1, q, j0]
    xt = tl.reshape(tl.permute(xt, (0, 4, 1, 2, 3, 5)), (TW, 8))              # [c, q, i, j2, j1, j0]: the words
    xt = to_float32(xt, X_DTYPE, INTERPRET) * X_PRESCALE
    x0, x1, x2, x3, x4, x5, x6, x7 = split8(xt, TW)
    pa = e0 * x0[None, :]
    pa = tl.fma(e1, x1[None, :], pa)
    pa = tl.fma(e2, x2[None, :], pa)
    pa = tl.fma(e3, x3[None, :], pa)
    pb = e4 * x4[None, :]
    pb = tl.fma(e5, x5[None, :], pb)
    pb = tl.fma(e6, x6[None, :], pb)
    pb = tl.fma(e7, x7[None, :], pb)
    return tl.fma(pb, sb, tl.fma(pa, sa, acc))


@triton.jit
def _row_out(acc, m, M, rows, mask_n, g, bias_ptr, y_ptr, stride_ym, HAS_BIAS: tl.constexpr,
             BIAS_DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    out = tl.sum(acc, axis=1) * g
    if HAS_BIAS:
        out += to_float32(tl.load(bias_ptr + rows, mask=mask_n, other=0), BIAS_DTYPE, INTERPRET)
    tl.store(y_ptr + (tl.full((), m, tl.int64) * stride_ym) + rows, cast_output(out, OUT_DTYPE, INTERPRET), mask=mask_n & (m < M))


@triton.jit
def _step_coords(i, pid, nprog, steps, TW: tl.constexpr, BLOCK_N: tl.constexpr):
    """Step ``i`` of a program's stream -> (first row of its tile, its first word): tiles ``pid``, ``pid + nprog``,
    ... in turn, ``steps`` steps of ``TW`` words each."""
    t = i // steps
    return (pid + t * nprog) * BLOCK_N, (i - t * steps) * TW


@triton.jit
def packed_gemv_kernel(
    x_ptr, words_ptr, scales_ptr, g_ptr, bias_ptr, y_ptr,
    M, N, K, KW, stride_xm, stride_xk, stride_ym, ROWS_PER_G,
    r_ptr, nw_ptr, xo_ptr, ho_ptr, eps, stride_rm, stride_om,
    HAS_BIAS: tl.constexpr, X_DTYPE: tl.constexpr, BIAS_DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TW: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
    USE_PDL: tl.constexpr, EARLY_RELEASE: tl.constexpr, INTERPRET: tl.constexpr,
    NORM: tl.constexpr = 0, NORM_D: tl.constexpr = 16, NW_DTYPE: tl.constexpr = tl.float32,
):
    """``y[:M] = x[:M] @ W^T`` for ``M <= BLOCK_M <= 4`` (a few decode rows; the dispatch, ``use_fma_gemv``, sends
    it M = 1 and 2 where it beats the tensor-core GEMV; more rows spill registers) on the FMA units, no split of K:
    the ``BLOCK_N``-row tiles go to the programs in turn (tile ``pid``, ``pid + num_programs``, ...; a grid of one
    program per tile gives each one tile), each tile in steps of ``TW`` words (``8 TW`` weights, ``TW`` a multiple
    of 16), ``KW`` words a row (``K`` padded to a multiple of 128). A program's steps are one stream: the next
    step's weights, of this tile or the next, load while this one is multiplied. Each thread owns 16-byte runs (4
    words, 32 weights) of its rows; one accumulator per x row, each in the weight tile's own layout. ``EVEN_K``:
    ``KW`` a multiple of ``TW`` and ``K`` not padded.

    ``USE_PDL`` (programmatic dependent launch): the first step's weights load before the wait on the kernel
    before; ``EARLY_RELEASE`` lets the next kernel launch as soon as every program has started (otherwise when
    every program has finished its main loop). Nothing is written before the wait.

    ``NORM`` (the RMSNorm folded into the product, :func:`norm_row`): x is ``rmsnorm(x + r) * (1 + nw)`` (2) or
    ``rmsnorm(x) * (1 + nw)`` (1), ``x`` and ``r`` unit stride along K; each program computes its rows' ``rstd``
    after the wait and normalises each step's x as it loads it; program 0 also writes the normed rows to ``xo``
    and ``x + r`` to ``ho`` for the kernels after (one launch instead of the norm's and the GEMV's)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    steps = tl.cdiv(KW, TW)
    total = tl.cdiv(tl.cdiv(N, BLOCK_N) - pid, nprog) * steps         # this program's steps, all its tiles
    offs = tl.max_contiguous(tl.multiple_of(tl.arange(0, TW), 4), 4)            # words of a step: 16-byte runs
    offs_s = tl.arange(0, TW)                                                  # the same, no hint: 8-byte scale loads
    lane_n = tl.arange(0, BLOCK_N)
    EVEN: tl.constexpr = EVEN_N and EVEN_K
    n0, w0 = _step_coords(0, pid, nprog, steps, TW, BLOCK_N)
    rows = n0 + lane_n
    q, v = load_words(words_ptr + rows[:, None].to(tl.int64) * KW, scales_ptr, rows, (rows < N)[:, None], w0,
                       offs, offs_s, KW, EVEN)
    if USE_PDL:
        if EARLY_RELEASE:
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()                     # the weights are in flight; x comes from the kernel before
    rstd0, rstd1, rstd2, rstd3 = 1.0, 1.0, 1.0, 1.0
    if NORM > 0:                                     # after the wait: x and r come from the kernels before
        rstd0 = norm_row(x_ptr, r_ptr, nw_ptr, xo_ptr, ho_ptr, 0, M, K, eps, stride_xm, stride_rm, stride_om,
                         pid == 0, NORM, NORM_D, X_DTYPE, NW_DTYPE, INTERPRET)
        if BLOCK_M > 1:
            rstd1 = norm_row(x_ptr, r_ptr, nw_ptr, xo_ptr, ho_ptr, 1, M, K, eps, stride_xm, stride_rm, stride_om,
                             pid == 0, NORM, NORM_D, X_DTYPE, NW_DTYPE, INTERPRET)
        if BLOCK_M > 2:
            rstd2 = norm_row(x_ptr, r_ptr, nw_ptr, xo_ptr, ho_ptr, 2, M, K, eps, stride_xm, stride_rm, stride_om,
                             pid == 0, NORM, NORM_D, X_DTYPE, NW_DTYPE, INTERPRET)
            rstd3 = norm_row(x_ptr, r_ptr, nw_ptr, xo_ptr, ho_ptr, 3, M, K, eps, stride_xm, stride_rm, stride_om,
                             pid == 0, NORM, NORM_D, X_DTYPE, NW_DTYPE, INTERPRET)
    acc0 = tl.zeros((BLOCK_N, TW), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, TW), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, TW), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N, TW), dtype=tl.float32)
    for i in range(0, total):
        n0, k0 = _step_coords(i, pid, nprog, steps, TW, BLOCK_N)
        if EVEN:        # the last step reloads its own words (an L2 hit) instead of a masked load
            n1, k1 = _step_coords(tl.minimum(i + 1, total - 1), pid, nprog, steps, TW, BLOCK_N)
        else:
            n1, k1 = _step_coords(i + 1, pid, nprog, steps, TW, BLOCK_N)
        rows1 = n1 + lane_n
        q_next, v_next = load_words(words_ptr + rows1[:, None].to(tl.int64) * KW, scales_ptr, rows1,
                                     (rows1 < N)[:, None], k1, offs, offs_s, KW, EVEN)
        e0, e1, e2, e3, e4, e5, e6, e7 = decode_word(q)                        # [BLOCK_N, TW] each
        sa, sb = fma_scales(v, INTERPRET)                                      # the two blocks of each word
        acc0 = fma_row_step(acc0, e0, e1, e2, e3, e4, e5, e6, e7, sa, sb, x_ptr, 0, M, K, k0, offs, stride_xm,
                            stride_xk, TW, EVEN_K, X_DTYPE, INTERPRET, r_ptr, nw_ptr, rstd0, stride_rm, NORM,
                            NW_DTYPE)
        if BLOCK_M > 1:
            acc1 = fma_row_step(acc1, e0, e1, e2, e3, e4, e5, e6, e7, sa, sb, x_ptr, 1, M, K, k0, offs, stride_xm,
                                stride_xk, TW, EVEN_K, X_DTYPE, INTERPRET, r_ptr, nw_ptr, rstd1, stride_rm, NORM,
                                NW_DTYPE)
        if BLOCK_M > 2:
            acc2 = fma_row_step(acc2, e0, e1, e2, e3, e4, e5, e6, e7, sa, sb, x_ptr, 2, M, K, k0, offs, stride_xm,
                                stride_xk, TW, EVEN_K, X_DTYPE, INTERPRET, r_ptr, nw_ptr, rstd2, stride_rm, NORM,
                                NW_DTYPE)
            acc3 = fma_row_step(acc3, e0, e1, e2, e3, e4, e5, e6, e7, sa, sb, x_ptr, 3, M, K, k0, offs, stride_xm,
                                stride_xk, TW, EVEN_K, X_DTYPE, INTERPRET, r_ptr, nw_ptr, rstd3, stride_rm, NORM,
                                NW_DTYPE)
        q, v = q_next, v_next
        if k0 + TW >= KW:                            # the tile's last step: write its rows, start the next tile
            if USE_PDL and not EARLY_RELEASE:
                if i == total - 1:
                    tl.extra.cuda.gdc_launch_dependents()
            rows = n0 + lane_n
            mask_n = rows < N
            g = tl.load(g_ptr + rows // ROWS_PER_G, mask=mask_n, other=0.0) * FMA_UNIT
            _row_out(acc0, 0, M, rows, mask_n, g, bias_ptr, y_ptr, stride_ym, HAS_BIAS, BIAS_DTYPE, OUT_DTYPE,
                     INTERPRET)
            acc0 = tl.zeros((BLOCK_N, TW), dtype=tl.float32)
            if BLOCK_M > 1:
                _row_out(acc1, 1, M, rows, mask_n, g, bias_ptr, y_ptr, stride_ym, HAS_BIAS, BIAS_DTYPE, OUT_DTYPE,
                         INTERPRET)
                acc1 = tl.zeros((BLOCK_N, TW), dtype=tl.float32)
            if BLOCK_M > 2:
                _row_out(acc2, 2, M, rows, mask_n, g, bias_ptr, y_ptr, stride_ym, HAS_BIAS, BIAS_DTYPE, OUT_DTYPE,
                         INTERPRET)
                _row_out(acc3, 3, M, rows, mask_n, g, bias_ptr, y_ptr, stride_ym, HAS_BIAS, BIAS_DTYPE, OUT_DTYPE,
                         INTERPRET)
                acc2 = tl.zeros((BLOCK_N, TW), dtype=tl.float32)
                acc3 = tl.zeros((BLOCK_N, TW), dtype=tl.float32)
