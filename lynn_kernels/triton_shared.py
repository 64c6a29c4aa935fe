"""Triton helpers that more than one kernel family uses: one place, so no family imports another's ``triton_*.py``.

Each family (``nvfp4``, ``matmul``, ``moe``, ``deltanet``, ``norm``, ``attention``) keeps its kernels and their private
helpers; what crosses families lives here, moved unchanged. This module imports only :mod:`lynn_kernels.runtime`.

NVFP4 weight decode in registers, exact (docs/matmul.md derives it):

* :func:`e4m3_decode`: an 8-bit E4M3FN scale code -> its fp32 value, in integer arithmetic. Used by the nvfp4
  dequantise kernel and, under the interpreter, by the weight tiles below.
* :func:`w_tile` / :func:`w_halves`: an ``[N, K]`` weight tile decoded from its E2M1 codes and E4M3 scales
  (checkpoint or packed layout), as one ``tl.dot`` operand or as its even / odd columns for FMA loops. Used by the
  matmul GEMV / GEMM kernels and the MoE expert kernels (``moe/triton_experts.py``, ``moe/triton_experts_decode.py``).
* :func:`packed_w_tile`: the packed layout's tile for the tensor cores (via :func:`w_tile`).
* :func:`launch_packed_dequantize` (:data:`PACKED_DEQUANTIZE`): a packed weight, or a stack of packed experts,
  written out as the tensor-core tile in x's dtype. Used by the matmul's dequantise-then-cuBLAS prefill and the
  MoE prefill's decoded ``w13``.
* :func:`decode_word`, :func:`fma_scales`, :func:`load_words`, :func:`fma_row_step`, :func:`split8`, with
  :data:`X_PRESCALE` and :data:`FMA_UNIT` (:data:`MMA_UNIT` for the tensor-core tile): the packed layout's words
  decoded on the FMA units. Used by the matmul packed GEMV (``packed_gemv_kernel``) and the MoE decode kernels.

RMSNorm rows folded into a kernel's prologue:

* :func:`norm_row` (a row's ``rstd``, and the normed row stored for the kernels after) and :func:`normed_at` (the
  normed input at given columns): used by the matmul packed GEMV with its norm folded in and the MoE router
  (``moe/triton_route.py``). Both stand on :func:`residual_rows` and :func:`row_rstd`, which the norm kernel
  (``norm/triton_rmsnorm.py``) uses too, so the folded norm computes exactly what the norm kernel does.

Host side:

* :func:`split_k_counter` / :data:`COUNTER_SLOTS` and :func:`split_k_for`: the per-stream ticket buffer of the
  deterministic split-K reduce and the split count. Used by the matmul GEMV / GEMM, the MoE router and the Gated
  DeltaNet decode step (``deltanet/triton_decode_step.py``).
* :func:`kernel_constexprs`: the dtype / decode constexprs of a launch, so that every kernel decodes a weight as the
  matmul does. Used by the matmul, MoE expert and MoE router launches.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from . import runtime
from .runtime import cast_output, kernel_view, round_to_dtype, to_float32

# ---------------------------------------------------------------------------------------------------------------
# E4M3 scale decode


@triton.jit
def e4m3_decode(code):
    """8-bit E4M3FN code (any integer tile) -> fp32 value of the same shape (0x7F / 0xFF -> NaN, 0x80 -> -0.0).

    Integer arithmetic only (exponent and mantissa moved into fp32 bits; subnormals ``m * 2^-9``), so the result
    does not depend on a backend's fp8 cast. Used by :func:`launch_dequantize`'s kernel and by the matmul family's
    weight-tile decode (``lynn_kernels.matmul.triton_matmul``: the GEMV / GEMM and, through :func:`w_tile
    <lynn_kernels.triton_shared.w_tile>`, the MoE experts)."""
    c = code.to(tl.uint32)
    e = (c >> 3) & 0xF
    m = c & 7
    normal = ((e + 120) << 23) | (m << 20)
    mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal.to(tl.float32, bitcast=True))
    mag = tl.where((e == 15) & (m == 7), float("nan"), mag)
    # sign by bits, not negation: the GPU compiles -x as 0 - x, which turns 0x80 (-0.0) into +0.0
    return (mag.to(tl.uint32, bitcast=True) | ((c & 0x80) << 24)).to(tl.float32, bitcast=True)


# ---------------------------------------------------------------------------------------------------------------
# the weight tile, checkpoint layout (and the dispatch to the packed layout)


@triton.jit
def _load_codes(codes_ptr, scales_ptr, offs_n, mask_n, k0, K, BLOCK_K: tl.constexpr):
    """The raw bytes of W[offs_n, k0:k0+BLOCK_K]: codes (uint8 [BLOCK_N, BLOCK_K/2], two E2M1 nibbles each, the even
    element in the low nibble) and block scales (E4M3 bits, uint8 [BLOCK_N, BLOCK_K/16])."""
    offs_c = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    offs_s = k0 // 16 + tl.arange(0, BLOCK_K // 16)
    c = tl.load(codes_ptr + offs_n[:, None].to(tl.int64) * (K // 2) + offs_c[None, :],
                mask=mask_n[:, None] & (offs_c[None, :] < K // 2), other=0)
    s = tl.load(scales_ptr + offs_n[:, None].to(tl.int64) * (K // 16) + offs_s[None, :],
                mask=mask_n[:, None] & (offs_s[None, :] < K // 16), other=0)
    return c, s


@triton.jit
def _decode_nibbles(c, s, INTERPRET: tl.constexpr):
    """Code and scale bytes of :func:`_load_codes` -> (even, odd) E2M1 values * 2^-14 (fp32 [BLOCK_N, BLOCK_K/2]) and
    the block scales * 2^14 (fp32 [BLOCK_N, BLOCK_K/16]): any backend."""
    if INTERPRET:
        s = e4m3_decode(s)
    else:
        s = s.to(tl.float8e4nv, bitcast=True).to(tl.float32)                        # hardware E4M3 convert
    c16 = c.to(tl.uint16)
    even = (((c16 & 0x7) << 9) | ((c16 & 0x8) << 12)).to(tl.float16, bitcast=True).to(tl.float32)
    odd = (((c16 & 0x70) << 5) | ((c16 & 0x80) << 8)).to(tl.float16, bitcast=True).to(tl.float32)
    return even, odd, s * 16384.0


@triton.jit
def _load_w_tile(codes_ptr, scales_ptr, offs_n, mask_n, k0, K,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr):
    """W[offs_n, k0:k0+BLOCK_K] as (E2M1 values * 2^-14 [BLOCK_N, BLOCK_K],
    block scales * 2^14 [BLOCK_N, BLOCK_K/16])."""
    c, s = _load_codes(codes_ptr, scales_ptr, offs_n, mask_n, k0, K, BLOCK_K)
    even, odd, s = _decode_nibbles(c, s, INTERPRET)
    return tl.interleave(even, odd), s


@triton.jit
def _scaled(w, s, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Apply the block scales to a decoded tile: exact, ``e2m1 * scale`` has at most 6 significant bits."""
    w = tl.reshape(w, (BLOCK_N, BLOCK_K // 16, 16)) * s[:, :, None]
    return tl.reshape(w, (BLOCK_N, BLOCK_K))


@triton.jit
def _e2m1_bf16x2_scaled(c, s):
    """GPU only: code bytes ``c`` (uint8) and a bf16 scale per byte ``s`` (``scale * 2^119``) -> (even, odd) bf16
    tiles equal to ``e2m1 * scale * 2^-7``, exactly, two elements per 32-bit instruction.

    Each nibble's magnitude bits land on bf16 bits 6..8 (the low exponent bits and the top mantissa bit), its sign
    on bit 15: that bf16 is ``e2m1 * 2^-126`` (a subnormal for 0 and 0.5); one ``mul.bf16x2`` by the pre-scaled
    block scale makes it ``e2m1 * scale * 2^-7``, normal and exact. The epilogue multiplies by ``2^7``.
    """
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 t01, t23, a, b;
        prmt.b32 t01, $4, 0, 0x4140;
        prmt.b32 t23, $4, 0, 0x4342;
        shl.b32 a, t01, 6;
        and.b32 a, a, 0x01C001C0;
        shl.b32 b, t01, 12;
        and.b32 b, b, 0x80008000;
        or.b32 a, a, b;
        mul.rn.bf16x2 $0, a, $5;
        shl.b32 a, t23, 6;
        and.b32 a, a, 0x01C001C0;
        shl.b32 b, t23, 12;
        and.b32 b, b, 0x80008000;
        or.b32 a, a, b;
        mul.rn.bf16x2 $1, a, $6;
        shl.b32 a, t01, 2;
        and.b32 a, a, 0x01C001C0;
        shl.b32 b, t01, 8;
        and.b32 b, b, 0x80008000;
        or.b32 a, a, b;
        mul.rn.bf16x2 $2, a, $5;
        shl.b32 a, t23, 2;
        and.b32 a, a, 0x01C001C0;
        shl.b32 b, t23, 8;
        and.b32 b, b, 0x80008000;
        or.b32 a, a, b;
        mul.rn.bf16x2 $3, a, $6;
        }
        """,
        constraints="=r,=r,=r,=r,r,r,r",
        args=[c, s], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)


@triton.jit
def w_tile(codes_ptr, scales_ptr, offs_n, mask_n, k0, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
           DOT_DTYPE: tl.constexpr, PACKED_DECODE: tl.constexpr, INTERPRET: tl.constexpr,
           PACKED_LAYOUT: tl.constexpr = False, ACC_UNIT: tl.constexpr = 1.0):
    """The scaled weight tile [BLOCK_N, BLOCK_K] in ``DOT_DTYPE`` for ``tl.dot``: ``e2m1 * scale`` exactly, times
    ``2^-7`` with ``PACKED_DECODE`` (bf16 on the GPU, see :func:`_e2m1_bf16x2_scaled`), times ``2^-19`` from the
    packed layout (``PACKED_LAYOUT``: ``codes_ptr`` / ``scales_ptr`` are a PackedNVFP4's words and scales).

    Rows ``offs_n`` (masked by ``mask_n``) and columns ``k0 .. k0 + BLOCK_K`` of an ``[N, K]`` NVFP4 weight, read
    from its code and E4M3 scale bytes; the global scale is left to the caller's epilogue (``ACC_UNIT`` says which
    power of two to undo). Public: the GEMV and GEMM kernels here and the MoE expert kernels
    (:mod:`lynn_kernels.moe.triton_experts`, with the flags of :func:`kernel_constexprs`) call it."""
    if PACKED_LAYOUT:
        return packed_w_tile(codes_ptr, scales_ptr, offs_n, mask_n, k0, tl.cdiv(K, 128) * 16, BLOCK_N,
                             BLOCK_K, DOT_DTYPE, PACKED_DECODE, ACC_UNIT == 1.0)
    elif PACKED_DECODE:
        c, s = _load_codes(codes_ptr, scales_ptr, offs_n, mask_n, k0, K, BLOCK_K)          # [BLOCK_N, BLOCK_K/2]
        even, odd = _e2m1_bf16x2_scaled(c, _per_byte_scales(s, BLOCK_N, BLOCK_K))
        return tl.interleave(even, odd)
    else:
        w, s = _load_w_tile(codes_ptr, scales_ptr, offs_n, mask_n, k0, K, BLOCK_N, BLOCK_K, INTERPRET)
        return _scaled(w, s, BLOCK_N, BLOCK_K).to(DOT_DTYPE)


@triton.jit
def _per_byte_scales(s, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """GPU: E4M3 scale bytes [BLOCK_N, BLOCK_K/16] -> bf16 ``scale * 2^119`` per code byte [BLOCK_N, BLOCK_K/2], the
    operand of :func:`_e2m1_bf16x2_scaled`."""
    s = (s.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 6.646139978924579e35).to(tl.bfloat16)  # * 2^119
    return tl.reshape(tl.broadcast_to(s[:, :, None], (BLOCK_N, BLOCK_K // 16, 8)), (BLOCK_N, BLOCK_K // 2))


@triton.jit
def w_halves(codes_ptr, scales_ptr, offs_n, mask_n, k0, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             PACKED_DECODE: tl.constexpr, INTERPRET: tl.constexpr):
    """The scaled weight tile split into its even and odd columns, fp32 ``[BLOCK_N, BLOCK_K/2]`` each:
    ``W[n, k0 + 2i]`` and ``W[n, k0 + 2i + 1]`` (times ``2^-7`` with ``PACKED_DECODE``), exact. For consumers that
    multiply on the FMA units rather than ``tl.dot``: the two nibbles of a byte stay in the thread that loaded it, with
    no interleave and no change of layout. Public: the MoE decode kernels
    (:mod:`lynn_kernels.moe.triton_experts_decode`) call it; the arguments are :func:`w_tile`'s (checkpoint layout
    only)."""
    c, s = _load_codes(codes_ptr, scales_ptr, offs_n, mask_n, k0, K, BLOCK_K)
    if PACKED_DECODE:
        even, odd = _e2m1_bf16x2_scaled(c, _per_byte_scales(s, BLOCK_N, BLOCK_K))
        return even.to(tl.float32), odd.to(tl.float32)
    else:
        even, odd, s = _decode_nibbles(c, s, INTERPRET)
        s = tl.reshape(tl.broadcast_to(s[:, :, None], (BLOCK_N, BLOCK_K // 16, 8)), (BLOCK_N, BLOCK_K // 2))
        return even * s, odd * s


# ---------------------------------------------------------------------------------------------------------------
# the packed layout: words decoded on the FMA units, and the tensor-core tile


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
    q, v = packed_w_words(words_ptr, scales_ptr, offs_n, mask_n, k0, KW, BLOCK_K)
    return packed_w_decode(q, v, BLOCK_N, BLOCK_K, DOT_DTYPE, BF16_ASM, UNSCALED)


@triton.jit
def packed_w_words(words_ptr, scales_ptr, offs_n, mask_n, k0, KW, BLOCK_K: tl.constexpr):
    """What :func:`packed_w_tile` reads: the tile's words ``[BLOCK_N, BLOCK_K / 8]`` (uint32) and each word's 16-bit
    scale pair; nothing past the row's ``KW`` words (a ``k0`` past the end loads nothing)."""
    offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    mask = mask_n[:, None] & (offs_w[None, :] < KW)
    q = tl.load(words_ptr + offs_n[:, None].to(tl.int64) * KW + offs_w[None, :], mask=mask, other=0,
                eviction_policy="evict_first").to(tl.uint32, bitcast=True)
    v = _word_scales(scales_ptr, offs_n[:, None], mask_n[:, None], offs_w[None, :], KW, False)
    return q, v


@triton.jit
def packed_w_decode(q, v, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr,
                    BF16_ASM: tl.constexpr = False, UNSCALED: tl.constexpr = False):
    """:func:`packed_w_tile` of words and scales already loaded (:func:`packed_w_words`)."""
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
    the row is the RMSNorm of ``x`` (and ``r``; unit stride along K: :func:`~lynn_kernels.triton_shared.normed_at`),
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
    # K order -> word order: k = 128 c + 32 i + 16 j2 + 8 j1 + 2 q + j0
    # is element j0 + 2 j1 + 4 j2 of word 16 c + 4 q + i
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


# ---------------------------------------------------------------------------------------------------------------
# RMSNorm rows, for kernels that fold the norm into their prologue


@triton.jit
def residual_rows(x_ptr, r_ptr, offs, mask, X_DTYPE: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                  INTERPRET: tl.constexpr):
    """``h = x`` or ``h = x + r`` at the offsets ``offs`` (both tensors addressed alike), as fp32 holding values
    of x's dtype: torch's add in that dtype, the exact sum rounded once."""
    h = to_float32(tl.load(x_ptr + offs, mask=mask, other=0), X_DTYPE, INTERPRET)
    if HAS_RESIDUAL:
        r = to_float32(tl.load(r_ptr + offs, mask=mask, other=0), X_DTYPE, INTERPRET)
        h = round_to_dtype(h + r, X_DTYPE, INTERPRET)
    return h


@triton.jit
def row_rstd(h, D, eps):
    """``1 / sqrt(mean(h^2) + eps)`` of each row of ``h [BLOCK_R, BLOCK_D]`` (zeros past ``D``), fp32 ``[BLOCK_R]``:
    IEEE square root and division, the sum of squares in one reduction over the row."""
    ss = tl.sum(h * h, axis=1)
    zero = tl.zeros_like(ss)
    return tl.div_rn(zero + 1.0, tl.sqrt_rn(tl.div_rn(ss, zero + D) + eps))


@triton.jit
def norm_row(x_ptr, r_ptr, nw_ptr, xo_ptr, ho_ptr, m, M, D, eps, stride_xm, stride_rm, stride_om, write,
             NORM: tl.constexpr, NORM_D: tl.constexpr, X_DTYPE: tl.constexpr, NW_DTYPE: tl.constexpr,
             INTERPRET: tl.constexpr):
    """The norm prologue of a kernel whose input is ``rmsnorm(x + r) * (1 + w)`` (``NORM == 2``; ``NORM == 1``:
    ``rmsnorm(x)``), for row ``m`` (zeros past ``M``; ``D`` contiguous values a row): the row's ``rstd`` (fp32
    scalar), computed as :func:`_rmsnorm_kernel` computes it (one ``[1, NORM_D]`` reduction). With ``write`` (one
    program of the grid) it also stores the normed row to ``xo`` and, with a residual, ``h = x + r`` to ``ho``
    (row stride ``stride_om``): what the norm kernel would have written, for the kernels after."""
    offs = tl.arange(0, NORM_D)[None, :]
    mask = (offs < D) & (m < M)
    mm = tl.full((), m, tl.int64)
    h = residual_rows(x_ptr + mm * stride_xm, r_ptr + mm * stride_rm, offs, mask, X_DTYPE, NORM == 2, INTERPRET)
    rstd = row_rstd(h, D, eps)                                                          # [1]
    if write:
        w1 = 1.0 + to_float32(tl.load(nw_ptr + offs, mask=offs < D, other=0), NW_DTYPE, INTERPRET)
        tl.store(xo_ptr + mm * stride_om + offs, cast_output((h * rstd[:, None]) * w1, X_DTYPE, INTERPRET),
                 mask=mask)
        if NORM == 2:
            tl.store(ho_ptr + mm * stride_om + offs, cast_output(h, X_DTYPE, INTERPRET), mask=mask)
    return tl.sum(rstd, axis=0)


@triton.jit
def normed_at(x_ptr, r_ptr, nw_ptr, cols, rstd, mask, HAS_RESIDUAL: tl.constexpr, X_DTYPE: tl.constexpr,
              NW_DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """The normed input at columns ``cols`` (``x_ptr`` / ``r_ptr``: the rows' starts, broadcasting with ``cols``;
    ``rstd`` from :func:`norm_row`, broadcasting likewise) in x's dtype, as a load of it returns it (raw bits under
    the interpreter): the values :func:`_rmsnorm_kernel` would have stored there."""
    h = residual_rows(x_ptr, r_ptr, cols, mask, X_DTYPE, HAS_RESIDUAL, INTERPRET)
    w1 = 1.0 + to_float32(tl.load(nw_ptr + cols, mask=mask, other=0), NW_DTYPE, INTERPRET)
    return cast_output((h * rstd) * w1, X_DTYPE, INTERPRET)


# ---------------------------------------------------------------------------------------------------------------
# split-K tickets (host)


MAX_SPLIT_K = 16


_counters: dict = {}


def split_k_for(tiles: int, k: int, block_k: int, sms: int) -> int:
    """K slices per output tile: enough programs for about two per SM, each slice at least one BLOCK_K chunk, and
    no empty slice (the split is rounded so every slice gets ``ceil(chunks / split)`` chunks but the last)."""
    chunks = runtime.cdiv(k, block_k)
    split = max(1, min(runtime.cdiv(2 * sms, tiles), chunks, MAX_SPLIT_K))
    return runtime.cdiv(chunks, runtime.cdiv(chunks, split))


#: Split-K tickets per (device, stream): split-K only runs when the output tiles cannot fill the GPU (fewer than
#: two per SM for the GEMV, one per SM for any GEMM config, so at most ~32 x the SM count when counted in the GEMM's
#: smallest tile), so one fixed buffer serves every call and is never replaced: a CUDA graph captured earlier keeps
#: replaying its atomics on the buffer it captured.
COUNTER_SLOTS = 8192


def split_k_counter(device: torch.device, n: int) -> torch.Tensor:
    """The zeroed int32 ticket buffer of the current stream on ``device`` (kernels leave it zeroed again); each
    stream has its own, so two streams never share tickets. ``n`` is the number of output tiles of a split-K
    call, 0 for a call without split.

    Public: the GEMV / GEMM launches here and the MoE router kernel
    (:func:`lynn_kernels.moe.triton_route.launch_router`, whose last program to take a ticket adds the partial
    logits) share these buffers."""
    if n == 0:                  # no split: the kernel never touches the tickets, any buffer of the device will do
        stream = None
    elif n > COUNTER_SLOTS:
        raise ValueError(f"split-K over {n} output tiles needs more than the {COUNTER_SLOTS} tickets kept per stream; "
                         f"split-K is for shapes whose tiles cannot fill the GPU (pass split_k=None)")
    else:
        stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, stream)
    buf = _counters.get(key)
    if buf is None:
        buf = torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=device)
        _counters[key] = buf
    return buf


# ---------------------------------------------------------------------------------------------------------------
# kernel constexprs (host)


@functools.lru_cache(maxsize=None)
def kernel_constexprs(x_dtype, bias_dtype, y_dtype, interpret: bool, packed: bool = False) -> dict:
    """Constexprs shared by both kernels (cached: this runs on every call). The dot runs in x's dtype on the GPU
    (the weight tile is exact in bf16 and fp16), in fp32 for fp32 x (IEEE, not TF32) and always in fp32 under the
    interpreter.

    Returns ``HAS_BIAS``, ``X_DTYPE``, ``BIAS_DTYPE``, ``OUT_DTYPE``, ``DOT_DTYPE``, ``PRECISION``, ``PACKED_DECODE``
    (the bf16x2 decode: bf16 x on the GPU), ``PACKED_LAYOUT``, ``ACC_UNIT`` and the runtime's kernel flags
    (``INTERPRET``). Public: the MoE expert and router kernels take their dot dtype and decode flags from it, so
    that they decode weights exactly as the matmul does."""
    fp32_dot = interpret or x_dtype == torch.float32
    return dict(
        HAS_BIAS=bias_dtype is not None, X_DTYPE=runtime.TORCH_TO_TL[x_dtype],
        BIAS_DTYPE=tl.float32 if bias_dtype is None else runtime.TORCH_TO_TL[bias_dtype],
        OUT_DTYPE=runtime.TORCH_TO_TL[y_dtype],
        DOT_DTYPE=tl.float32 if fp32_dot else runtime.TORCH_TO_TL[x_dtype],
        PRECISION="ieee" if fp32_dot else "tf32",
        PACKED_DECODE=not interpret and x_dtype == torch.bfloat16, PACKED_LAYOUT=packed,
        # the power of two the epilogue undoes: 2^-7 of the packed decode, 2^-19 of a packed-layout tile (an fp16
        # tile is e2m1 * s itself: fp16's range is narrower)
        ACC_UNIT=(1.0 if not fp32_dot and x_dtype == torch.float16 else MMA_UNIT.value) if packed
        else (128.0 if not interpret and x_dtype == torch.bfloat16 else 1.0),
        **runtime.kernel_flags(),
    )


# ---------------------------------------------------------------------------------------------------------------
# a packed weight written out in x's dtype (the matmul prefill, the MoE prefill's decoded w13)

@triton.jit
def _packed_dequantize_kernel(
    words_ptr, scales_ptr, out_ptr, N, K, KW,
    OUT_DTYPE: tl.constexpr, BF16_ASM: tl.constexpr, UNSCALED: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr,
):
    """A packed weight -> ``out [N, K]`` in ``OUT_DTYPE``, each element ``e2m1 * s * 2^-19`` (``UNSCALED``:
    ``e2m1 * s``), exact: the GEMM's tile (:func:`packed_w_tile`), stored instead of multiplied."""
    pid_n = tl.program_id(0)
    k0 = tl.program_id(1) * BLOCK_K
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    if INTERPRET:           # the interpreter keeps the tile fp32 and stores bf16 as its bits (runtime.cast_output)
        w = cast_output(packed_w_tile(words_ptr, scales_ptr, offs_n, mask_n, k0, KW, BLOCK_N, BLOCK_K, tl.float32,
                                      False, UNSCALED), OUT_DTYPE, INTERPRET)
    else:
        w = packed_w_tile(words_ptr, scales_ptr, offs_n, mask_n, k0, KW, BLOCK_N, BLOCK_K, OUT_DTYPE, BF16_ASM,
                          UNSCALED)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + offs_n[:, None].to(tl.int64) * K + offs_k[None, :], w,
             mask=mask_n[:, None] & (offs_k[None, :] < K))


PACKED_DEQUANTIZE = runtime.Kernel("matmul.dequantize", _packed_dequantize_kernel)


#: The dequantise kernel's tile (a multiple of a chunk along K): within 3% of the best of 16 tiles on each of three
#: decoder shapes on the GPU (docs/history/matmul.md, "The prefill GEMM: dequantise once, then cuBLAS").
DEQUANT_CONFIG = {"BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 4}


def launch_packed_dequantize(w, out: torch.Tensor, config: dict | None = None, *, kernel=None) -> torch.Tensor:
    """Launch only: ``w`` (a ``PackedNVFP4``) into a contiguous ``out [N, K]`` (bf16 / fp16 / fp32) as
    ``e2m1 * s * 2^-19`` (fp16: ``e2m1 * s``, fp16's range is narrower); the global scales and that power of two are
    the caller's. ``w`` may also be a stack of packed weights (a ``PackedExperts`` ``[E, N, K]``, ``out`` of that
    shape): its rows are decoded one after another. ``kernel`` (a ``@triton.jit`` function with
    ``_packed_dequantize_kernel``'s parameters) replaces the shipped kernel."""
    *rows, k = w.shape
    n = math.prod(rows)
    meta = {**DEQUANT_CONFIG, **(config or {})}
    if meta["BLOCK_K"] % 128:
        raise ValueError(f"config BLOCK_K = {meta['BLOCK_K']}: the dequantise tile covers whole chunks of 128")
    warps = meta.pop("num_warps")
    grid = (runtime.cdiv(n, meta["BLOCK_N"]), runtime.cdiv(k, meta["BLOCK_K"]))
    PACKED_DEQUANTIZE.current(kernel)[grid](
        w.words, w.scales, kernel_view(out), n, k, w.words.shape[-1],
        OUT_DTYPE=runtime.TORCH_TO_TL[out.dtype], BF16_ASM=not runtime.INTERPRET and out.dtype == torch.bfloat16,
        UNSCALED=out.dtype == torch.float16, **meta, **runtime.kernel_flags(), num_warps=warps)
    return out
