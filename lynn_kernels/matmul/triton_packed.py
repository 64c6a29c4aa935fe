"""Packed-layout W4A16 kernels: the decode GEMV on the FMA units, and the packed weight tile for the tensor-core
kernels of :mod:`.triton_matmul`. The layout is :mod:`.packed`'s; the design and its measurements are in
docs/matmul.md.

The decode of one int32 word (8 codes) is 13 integer operations in all: five shifts shared by the four bf16 pairs,
an AND and an AND-OR per pair (:func:`decode_word`). Each pair becomes two fp32 values ``e2m1 * 2^-126`` by a
shift and a mask (a bf16 is the top half of an fp32). The GEMV multiplies them by ``x * 2^64`` (so the products
are normal fp32: ``e2m1 * x * 2^-62``, exact), adds each word's 8 products, and scales each word's sum by its block
scale ``s * 2^75`` with one more FMA; the epilogue multiplies by ``global_scale * 2^-13`` once per output. Every
step is exact but the fp32 additions, as in the reference.

The range this buys: ``|x|`` below ``2^64`` (``x * 2^64`` stays finite) and products above ``2^-64`` stay normal;
beyond, fp32 itself would be the limit of the reference too (``e2m1 * scale * x`` near fp32's ends).
"""

from __future__ import annotations

import triton
import triton.language as tl

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
    """Packed words (uint32, any shape) -> the 8 elements ``e2m1 * 2^-126`` as fp32, in K order ``0 .. 7``."""
    e0, e1 = _halves(_pair(q, 0, -6))
    e2, e3 = _halves(_pair(q, 4, 0))
    e4, e5 = _halves(_pair(q, 5, 3))
    e6, e7 = _halves(_pair(q, 6, 6))
    return e0, e1, e2, e3, e4, e5, e6, e7


@triton.jit
def decode_scale(b, OR: tl.constexpr):
    """Re-encoded scale bytes -> fp32 ``s * 2^75`` (``OR = 0x60000000``) or ``s * 2^107`` (``0x70000000``)."""
    return ((b.to(tl.uint32) << 20) | OR).to(tl.float32, bitcast=True)


@triton.jit
def _split8(x, TW: tl.constexpr):
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
def _join8(e0, e1, e2, e3, e4, e5, e6, e7, BLOCK_N: tl.constexpr, TW: tl.constexpr):
    """The inverse of :func:`_split8`: 8 tensors ``[BLOCK_N, TW]`` -> ``[BLOCK_N, TW * 8]`` in K order."""
    even = tl.reshape(tl.join(tl.join(e0, e4), tl.join(e2, e6)), (BLOCK_N, TW, 4))
    odd = tl.reshape(tl.join(tl.join(e1, e5), tl.join(e3, e7)), (BLOCK_N, TW, 4))
    return tl.reshape(tl.join(even, odd), (BLOCK_N, TW * 8))


@triton.jit
def _decode_word_bf16(q, s2):
    """GPU only: packed words ``q`` (uint32) and their block scale as a bf16 pair ``s2`` (``s * 2^107`` twice) ->
    the 8 elements ``e2m1 * s * 2^-19`` as bf16, in K order: per pair the two masks of :func:`_pair`, then one
    ``mul.rn.bf16x2`` (exact: the product has six significant bits and is normal), 17 instructions a word."""
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 s3, s4, s5, s6, r6, a, b;
        shl.b32 s3, $8, 3;
        shl.b32 s4, $8, 4;
        shl.b32 s5, $8, 5;
        shl.b32 s6, $8, 6;
        shr.b32 r6, $8, 6;
        and.b32 a, $8, 0x80008000;
        and.b32 b, r6, 0x01C001C0;
        or.b32 a, a, b;
        mul.rn.bf16x2 a, a, $9;
        mov.b32 {$0, $1}, a;
        and.b32 a, s4, 0x80008000;
        and.b32 b, $8, 0x01C001C0;
        or.b32 a, a, b;
        mul.rn.bf16x2 a, a, $9;
        mov.b32 {$2, $3}, a;
        and.b32 a, s5, 0x80008000;
        and.b32 b, s3, 0x01C001C0;
        or.b32 a, a, b;
        mul.rn.bf16x2 a, a, $9;
        mov.b32 {$4, $5}, a;
        and.b32 a, s6, 0x80008000;
        and.b32 b, s6, 0x01C001C0;
        or.b32 a, a, b;
        mul.rn.bf16x2 a, a, $9;
        mov.b32 {$6, $7}, a;
        }
        """,
        constraints="=h,=h,=h,=h,=h,=h,=h,=h,r,r",
        args=[q, s2], dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)


@triton.jit
def packed_w_tile(words_ptr, scales_ptr, offs_n, mask_n, k0, KW, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  DOT_DTYPE: tl.constexpr, BF16_ASM: tl.constexpr = False, UNSCALED: tl.constexpr = False):
    """The packed weight ``W[offs_n, k0 : k0 + BLOCK_K]`` as a ``DOT_DTYPE`` tile equal to ``e2m1 * s * 2^-19``
    (exact: six significant bits, a normal number), for ``tl.dot``; the epilogue multiplies by ``2^19``.
    ``UNSCALED`` (fp16 tiles: fp16's range is narrower) makes it ``e2m1 * s``, the epilogue's unit 1. With
    ``BF16_ASM`` (bf16 on the GPU) the decode is :func:`_decode_word_bf16`; otherwise portable fp32 integer ops."""
    offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    offs_s = k0 // 16 + tl.arange(0, BLOCK_K // 16)
    q = tl.load(words_ptr + offs_n[:, None].to(tl.int64) * KW + offs_w[None, :],
                mask=mask_n[:, None] & (offs_w[None, :] < KW), other=0).to(tl.uint32, bitcast=True)
    b = tl.load(scales_ptr + offs_n[:, None].to(tl.int64) * (KW // 2) + offs_s[None, :],
                mask=mask_n[:, None] & (offs_s[None, :] < KW // 2), other=0)
    if BF16_ASM:
        s16 = (b.to(tl.uint32) << 4) | 0x7000                                 # bf16 bits of s * 2^107
        s2 = s16 | (s16 << 16)
        s2 = tl.reshape(tl.join(s2, s2), (BLOCK_N, BLOCK_K // 8))             # words 2i, 2i + 1 share scale i
        e0, e1, e2, e3, e4, e5, e6, e7 = _decode_word_bf16(q, s2)
        return _join8(e0, e1, e2, e3, e4, e5, e6, e7, BLOCK_N, BLOCK_K // 8)
    else:
        e0, e1, e2, e3, e4, e5, e6, e7 = decode_word(q)
        w = tl.reshape(_join8(e0, e1, e2, e3, e4, e5, e6, e7, BLOCK_N, BLOCK_K // 8),
                       (BLOCK_N, BLOCK_K // 16, 16))
        w = w * decode_scale(b, 0x70000000)[:, :, None]
        if UNSCALED:        # fp16 cannot hold e2m1 * s * 2^-19: the fp16 tile is e2m1 * s itself (the scale alone
            w = w * MMA_UNIT  # cannot take the 2^19 first: s * 2^126 overflows fp32)
        return tl.reshape(w, (BLOCK_N, BLOCK_K)).to(DOT_DTYPE)


@triton.jit
def _load_words(wrow, srow, k0, offs, offs_s, mask_w, KW, EVEN: tl.constexpr):
    if EVEN:
        q = tl.load(wrow + (k0 + offs)[None, :], eviction_policy="evict_first")
        b = tl.load(srow + (k0 // 2 + offs_s)[None, :], eviction_policy="evict_first")
    else:
        q = tl.load(wrow + (k0 + offs)[None, :], mask=mask_w & ((k0 + offs)[None, :] < KW), other=0,
                    eviction_policy="evict_first")
        b = tl.load(srow + (k0 // 2 + offs_s)[None, :], mask=mask_w & ((k0 // 2 + offs_s)[None, :] < KW // 2),
                    other=0, eviction_policy="evict_first")
    return q.to(tl.uint32, bitcast=True), b


@triton.jit
def _row_step(acc, e0, e1, e2, e3, e4, e5, e6, e7, s, x_ptr, m, M, k0, offs, stride_xm, stride_xk, KW,
              TW: tl.constexpr, EVEN_K: tl.constexpr, X_DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """One x row's share of a step: ``acc [BLOCK_N, TW] += s * sum_j e_j * x[m, 8 w + j]`` (fp32 FMAs)."""
    kx = 8 * (k0 + offs)[:, None] + tl.arange(0, 8)[None, :]                   # [TW, 8]
    ptr = x_ptr + (tl.full((), m, tl.int64) * stride_xm) + kx * stride_xk
    if EVEN_K:
        xt = tl.load(ptr, mask=(kx >= 0) & (m < M), other=0)
    else:
        xt = tl.load(ptr, mask=(kx < 8 * KW) & (m < M), other=0)
    xt = to_float32(xt, X_DTYPE, INTERPRET) * X_PRESCALE
    x0, x1, x2, x3, x4, x5, x6, x7 = _split8(xt, TW)
    p = e0 * x0[None, :]
    p = tl.fma(e1, x1[None, :], p)
    p = tl.fma(e2, x2[None, :], p)
    p = tl.fma(e3, x3[None, :], p)
    p = tl.fma(e4, x4[None, :], p)
    p = tl.fma(e5, x5[None, :], p)
    p = tl.fma(e6, x6[None, :], p)
    p = tl.fma(e7, x7[None, :], p)
    return tl.fma(p, s, acc)


@triton.jit
def _row_out(acc, m, M, rows, mask_n, g, bias_ptr, y_ptr, stride_ym, HAS_BIAS: tl.constexpr,
             BIAS_DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    out = tl.sum(acc, axis=1) * g
    if HAS_BIAS:
        out += to_float32(tl.load(bias_ptr + rows, mask=mask_n, other=0), BIAS_DTYPE, INTERPRET)
    tl.store(y_ptr + (tl.full((), m, tl.int64) * stride_ym) + rows, cast_output(out, OUT_DTYPE, INTERPRET), mask=mask_n & (m < M))


@triton.jit
def packed_gemv_kernel(
    x_ptr, words_ptr, scales_ptr, g_ptr, bias_ptr, y_ptr,
    M, N, KW, stride_xm, stride_xk, stride_ym, ROWS_PER_G,
    HAS_BIAS: tl.constexpr, X_DTYPE: tl.constexpr, BIAS_DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TW: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
    USE_PDL: tl.constexpr, INTERPRET: tl.constexpr,
):
    """``y[:M] = x[:M] @ W^T`` for ``M <= BLOCK_M <= 4`` (a few decode rows; the dispatch sends M <= 2, where it
    is faster than the tensor-core GEMV: more rows spill registers) on the FMA units: one program per
    ``BLOCK_N`` rows and the whole of K, no split; ``TW`` words (``8 TW`` weights) of each row per step. Each
    thread owns 16-byte runs (4 words, 32 weights) of its rows; the next step's weights load while this one is
    multiplied. One accumulator per x row, each in the weight tile's own layout."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = rows < N
    offs = tl.max_contiguous(tl.multiple_of(tl.arange(0, TW), 4), 4)            # words of a step
    offs_s = tl.arange(0, TW // 2)                                              # their block scales
    wrow = words_ptr + rows[:, None].to(tl.int64) * KW
    srow = scales_ptr + rows[:, None].to(tl.int64) * (KW // 2)
    mask_w = mask_n[:, None]
    EVEN: tl.constexpr = EVEN_N and EVEN_K
    q, b = _load_words(wrow, srow, 0, offs, offs_s, mask_w, KW, EVEN)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()                     # the weights are in flight; x comes from the kernel before
    acc0 = tl.zeros((BLOCK_N, TW), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, TW), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, TW), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N, TW), dtype=tl.float32)
    for k0 in range(0, KW, TW):
        if EVEN:        # the last step reloads its own words (an L2 hit) instead of a masked load
            q_next, b_next = _load_words(wrow, srow, tl.minimum(k0 + TW, KW - TW), offs, offs_s, mask_w, KW, EVEN)
        else:
            q_next, b_next = _load_words(wrow, srow, k0 + TW, offs, offs_s, mask_w, KW, EVEN)
        e0, e1, e2, e3, e4, e5, e6, e7 = decode_word(q)                        # [BLOCK_N, TW] each
        s = decode_scale(b, 0x60000000)                                        # [BLOCK_N, TW / 2]
        s = tl.reshape(tl.join(s, s), (BLOCK_N, TW))                           # words 2i, 2i + 1 share scale i
        acc0 = _row_step(acc0, e0, e1, e2, e3, e4, e5, e6, e7, s, x_ptr, 0, M, k0, offs, stride_xm, stride_xk,
                         KW, TW, EVEN_K, X_DTYPE, INTERPRET)
        if BLOCK_M > 1:
            acc1 = _row_step(acc1, e0, e1, e2, e3, e4, e5, e6, e7, s, x_ptr, 1, M, k0, offs, stride_xm,
                             stride_xk, KW, TW, EVEN_K, X_DTYPE, INTERPRET)
        if BLOCK_M > 2:
            acc2 = _row_step(acc2, e0, e1, e2, e3, e4, e5, e6, e7, s, x_ptr, 2, M, k0, offs, stride_xm,
                             stride_xk, KW, TW, EVEN_K, X_DTYPE, INTERPRET)
            acc3 = _row_step(acc3, e0, e1, e2, e3, e4, e5, e6, e7, s, x_ptr, 3, M, k0, offs, stride_xm,
                             stride_xk, KW, TW, EVEN_K, X_DTYPE, INTERPRET)
        q, b = q_next, b_next
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    g = tl.load(g_ptr + rows // ROWS_PER_G, mask=mask_n, other=0.0) * FMA_UNIT
    _row_out(acc0, 0, M, rows, mask_n, g, bias_ptr, y_ptr, stride_ym, HAS_BIAS, BIAS_DTYPE, OUT_DTYPE, INTERPRET)
    if BLOCK_M > 1:
        _row_out(acc1, 1, M, rows, mask_n, g, bias_ptr, y_ptr, stride_ym, HAS_BIAS, BIAS_DTYPE, OUT_DTYPE,
                 INTERPRET)
    if BLOCK_M > 2:
        _row_out(acc2, 2, M, rows, mask_n, g, bias_ptr, y_ptr, stride_ym, HAS_BIAS, BIAS_DTYPE, OUT_DTYPE,
                 INTERPRET)
        _row_out(acc3, 3, M, rows, mask_n, g, bias_ptr, y_ptr, stride_ym, HAS_BIAS, BIAS_DTYPE, OUT_DTYPE,
                 INTERPRET)
