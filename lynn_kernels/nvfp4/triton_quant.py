"""Triton kernels for NVFP4 quantise and dequantise, bit-exact with :mod:`.reference`.

Both are streaming kernels: one tile of rows x K columns per program, no reuse, so the goal is bytes per second.
Scales are read and written as raw E4M3 bits and rounded with integer arithmetic, so the result does not depend on
how a backend casts to fp8 (the interpreter drops the mantissa carry).

The E4M3 decode the dequantise kernel uses (``e4m3_decode``) is shared with the matmul and MoE weight decode, so it
lives in :mod:`lynn_kernels.triton_shared`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import runtime
from ..runtime import cast_output, div_rn_by, kernel_view, min_nan_to_bound, round_to_bf16, to_float32
from ..triton_shared import e4m3_decode
from .spec import BLOCK, check_out_dtype, check_recipe, check_weight, recipe_globals, reciprocal
from .tensor import NVFP4Tensor

# ---------------------------------------------------------------------------------------------------------------
# E4M3 helpers (per block, so their cost is spread over 16 elements)


@triton.jit
def _e4m3_round(s):
    """fp32 ``s`` in [0, 448] -> (nearest E4M3 value as fp32, its 8-bit code), ties to even."""
    bits = s.to(tl.uint32, bitcast=True)
    # normal range (s >= 2^-6): keep 3 mantissa bits, round half to even on bit 20
    rb = (bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000
    code_n = (((rb >> 23).to(tl.int32) - 120) << 3) | ((rb >> 20) & 7).to(tl.int32)
    # subnormal range: multiples of 2^-9; 8 * 2^-9 is the smallest normal and its code is 0x08, so no special case
    t = s * 512.0
    t_floor = t.to(tl.int32)
    frac = t - t_floor.to(tl.float32)
    up = (frac > 0.5) | ((frac == 0.5) & ((t_floor & 1) == 1))
    code_s = t_floor + up.to(tl.int32)
    is_normal = bits >= 0x3C800000                                  # 2^-6
    value = tl.where(is_normal, rb.to(tl.float32, bitcast=True), code_s.to(tl.float32) * 0.001953125)
    code = tl.where(is_normal, code_n, code_s)
    return value, code.to(tl.uint8)


@triton.jit
def _e2m1_encode(q, INTERPRET: tl.constexpr):
    """fp32 scaled values -> 4-bit codes (uint8), round to nearest even, saturating; NaN -> 7 as ModelOpt.

    From 1 up, E2M1 is fp32 with one mantissa bit: round the fp32 bits at bit 22 (ties to even) and read exponent
    and mantissa off together. Below 1 the codes are 0, 1, 2 = RNE(2a), which one fma against 1.5 * 2^23 rounds.
    """
    a = min_nan_to_bound(tl.abs(q), 6.0, INTERPRET)     # saturate at 6; NaN becomes 6 too
    b = a.to(tl.uint32, bitcast=True)
    # (b + half-ulp - 1 + odd bit) >> 22 is (exponent << 1 | mantissa); the constant also subtracts 126 << 1
    code_n = (b + ((b >> 22) & 1) + 0xC11FFFFF) >> 22     # 0xC11FFFFF = 0x1FFFFF - (252 << 22) mod 2^32
    code_s = tl.fma(a, 2.0, 12582912.0).to(tl.uint32, bitcast=True) - 0x4B400000
    mag = tl.where(a >= 1.0, code_n, code_s)
    return (mag | tl.where(q < 0, 8, 0).to(tl.uint32)).to(tl.uint8)


# ---------------------------------------------------------------------------------------------------------------
# quantise


@runtime.autotune(
    configs=[
        triton.Config({"BLOCK_R": 16, "BLOCK_K": 256}, num_warps=4),
        triton.Config({"BLOCK_R": 8, "BLOCK_K": 512}, num_warps=4),
        triton.Config({"BLOCK_R": 32, "BLOCK_K": 256}, num_warps=8),
        triton.Config({"BLOCK_R": 16, "BLOCK_K": 512}, num_warps=8),
        triton.Config({"BLOCK_R": 4, "BLOCK_K": 1024}, num_warps=4),
        triton.Config({"BLOCK_R": 64, "BLOCK_K": 128}, num_warps=8),
        triton.Config({"BLOCK_R": 2, "BLOCK_K": 2048}, num_warps=4),
        triton.Config({"BLOCK_R": 4, "BLOCK_K": 512}, num_warps=2),
    ],
    key=["R", "K", "RECIPE_CT"],
    reset_to_zero=["flag_ptr"],
)
@triton.jit
def _nvfp4_quantize_kernel(
    w_ptr, codes_ptr, scales_ptr, g_ptr, flag_ptr,
    R, K, stride_wr, ROWS_PER_G,
    RECIPE_CT: tl.constexpr, IN_DTYPE: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr,
):
    pid_r = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_r = offs_r < R
    mask = mask_r[:, None] & (offs_k[None, :] < K)
    w = tl.load(w_ptr + offs_r[:, None].to(tl.int64) * stride_wr + offs_k[None, :], mask=mask, other=0)
    w = to_float32(w, IN_DTYPE, INTERPRET)                                   # [BLOCK_R, BLOCK_K]
    g = tl.load(g_ptr + offs_r // ROWS_PER_G, mask=mask_r, other=1.0)       # [BLOCK_R] g (ModelOpt) or G (CT)

    blocks = tl.reshape(w, (BLOCK_R, BLOCK_K // 16, 16))
    # block amax as an integer max of |w|'s bits: same order as the floats, and NaN / Inf sort above every number
    abs_bits = blocks.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    bam_bits = tl.max(abs_bits, axis=2)                                     # [BLOCK_R, BLOCK_K/16]
    bam = bam_bits.to(tl.float32, bitcast=True)
    if RECIPE_CT:
        big_g = g[:, None]                                                  # compressed-tensors' G (divide)
        bam6 = tl.div_rn(bam, tl.full(bam.shape, 6.0, tl.float32))
        if IN_DTYPE == tl.bfloat16:                                         # recipe divides in w's dtype
            bam6 = round_to_bf16(bam6, INTERPRET)
        elif IN_DTYPE == tl.float16:
            bam6 = bam6.to(tl.float16).to(tl.float32)
        s = tl.minimum(big_g * bam6, 448.0)
        s_val, s_code = _e4m3_round(s)
        s_val = tl.where(s_code == 0, 0.125, s_val)
        s_code = tl.where(s_code == 0, 0x20, s_code).to(tl.uint8)          # 0x20 is E4M3 0.125
        divisor = tl.div_rn(s_val, big_g)
    else:
        s = tl.div_rn(bam, 6.0 * g[:, None])
        s = tl.where(s == 0, 1.0, tl.minimum(tl.maximum(s, 0.001953125), 448.0))   # ModelOpt 0.47: [2^-9, 448]
        s_val, s_code = _e4m3_round(s)
        divisor = s_val * g[:, None]
    recip = tl.div_rn(tl.full(divisor.shape, 1.0, tl.float32), divisor)     # one IEEE division per block
    shape3: tl.constexpr = (BLOCK_R, BLOCK_K // 16, 16)
    q = div_rn_by(blocks, tl.broadcast_to(divisor[:, :, None], shape3), tl.broadcast_to(recip[:, :, None], shape3),
                  INTERPRET)
    nib = tl.reshape(_e2m1_encode(q, INTERPRET), (BLOCK_R, BLOCK_K // 2, 2))
    lo, hi = tl.split(nib)
    packed = lo | (hi << 4)                                                 # [BLOCK_R, BLOCK_K/2]

    offs_c = pid_k * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
    mask_c = mask_r[:, None] & (offs_c[None, :] < K // 2)
    tl.store(codes_ptr + offs_r[:, None].to(tl.int64) * (K // 2) + offs_c[None, :], packed, mask=mask_c)
    offs_s = pid_k * (BLOCK_K // 16) + tl.arange(0, BLOCK_K // 16)
    mask_s = mask_r[:, None] & (offs_s[None, :] < K // 16)
    tl.store(scales_ptr + offs_r[:, None].to(tl.int64) * (K // 16) + offs_s[None, :], s_code, mask=mask_s)

    bad = tl.max(tl.max(bam_bits, axis=1), axis=0) >= 0x7F800000           # NaN or Inf somewhere in the tile
    tl.atomic_max(flag_ptr, bad.to(tl.int32))


QUANTIZE = runtime.Kernel("nvfp4.quantize", _nvfp4_quantize_kernel)


def _as_rows(x: torch.Tensor, k: int) -> torch.Tensor:
    rows = x.reshape(-1, k)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def quantize_triton(w: torch.Tensor, global_scale=None, recipe: str = "modelopt", *,
                    recip_global_scale=None) -> NVFP4Tensor:
    """Host side of :func:`lynn_kernels.nvfp4.quantize`: check, allocate, launch, then check for NaN/Inf."""
    check_weight(w)
    check_recipe(recipe)
    runtime.check_device("w", w)
    g, big_g = recipe_globals(w, global_scale, recipe, recip_global_scale)   # no scale given: NaN/Inf via amax
    q, flag = launch_quantize(w, g, recipe, big_g=big_g)
    if (global_scale is not None or recip_global_scale is not None) and flag.item():
        raise ValueError("w contains NaN or Inf; NVFP4 cannot represent them")
    return q


def launch_quantize(w: torch.Tensor, g: torch.Tensor, recipe: str, out: NVFP4Tensor | None = None,
                    flag: torch.Tensor | None = None, big_g: torch.Tensor | None = None, *, kernel=None
                    ) -> tuple[NVFP4Tensor, torch.Tensor]:
    """Launch only (no checks, no host sync), into ``out`` if given: returns the tensor and the NaN/Inf flag.

    ``g`` is the multiply-convention global scale; compressed-tensors' ``G`` is ``big_g`` (``1/g`` if omitted).
    ``kernel`` (a ``@triton.jit`` function with ``_nvfp4_quantize_kernel``'s parameters) replaces the shipped kernel."""
    if recipe == "compressed-tensors" and big_g is None:
        big_g = reciprocal(g)
    lead, k = tuple(w.shape[:-1]), w.shape[-1]
    rows = _as_rows(w, k)
    n_rows = rows.shape[0]
    if out is None:
        codes = torch.empty((*lead, k // 2), dtype=torch.uint8, device=w.device)
        scales = torch.empty((*lead, k // BLOCK), dtype=torch.float8_e4m3fn, device=w.device)
    else:
        codes, scales = out.codes, out.scales
    flag = torch.zeros(1, dtype=torch.int32, device=w.device) if flag is None else flag

    def grid(meta):
        return (runtime.cdiv(n_rows, meta["BLOCK_R"]), runtime.cdiv(k, meta["BLOCK_K"]))

    QUANTIZE.current(kernel)[grid](
        kernel_view(rows), codes, scales.view(torch.uint8), g if big_g is None else big_g, flag,
        n_rows, k, rows.stride(0), n_rows // max(1, g.numel()),
        RECIPE_CT=recipe == "compressed-tensors", IN_DTYPE=runtime.TORCH_TO_TL[w.dtype],
        **runtime.kernel_flags(),
    )
    return NVFP4Tensor(codes, scales, g, big_g), flag


# ---------------------------------------------------------------------------------------------------------------
# dequantise


@runtime.autotune(
    configs=[
        triton.Config({"BLOCK_R": 16, "BLOCK_K": 256}, num_warps=4),
        triton.Config({"BLOCK_R": 8, "BLOCK_K": 512}, num_warps=4),
        triton.Config({"BLOCK_R": 32, "BLOCK_K": 256}, num_warps=8),
        triton.Config({"BLOCK_R": 16, "BLOCK_K": 512}, num_warps=8),
        triton.Config({"BLOCK_R": 4, "BLOCK_K": 1024}, num_warps=4),
        triton.Config({"BLOCK_R": 32, "BLOCK_K": 512}, num_warps=8),
        triton.Config({"BLOCK_R": 8, "BLOCK_K": 2048}, num_warps=8),
        triton.Config({"BLOCK_R": 16, "BLOCK_K": 1024}, num_warps=8),
    ],
    key=["R", "K", "OUT_DTYPE"],
)
@triton.jit
def _nvfp4_dequantize_kernel(
    codes_ptr, scales_ptr, g_ptr, out_ptr,
    R, K, ROWS_PER_G,
    OUT_DTYPE: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr,
):
    pid_r = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    offs_c = pid_k * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
    mask_c = mask_r[:, None] & (offs_c[None, :] < K // 2)
    c = tl.load(codes_ptr + offs_r[:, None].to(tl.int64) * (K // 2) + offs_c[None, :], mask=mask_c, other=0)
    offs_s = pid_k * (BLOCK_K // 16) + tl.arange(0, BLOCK_K // 16)
    mask_s = mask_r[:, None] & (offs_s[None, :] < K // 16)
    s = tl.load(scales_ptr + offs_r[:, None].to(tl.int64) * (K // 16) + offs_s[None, :], mask=mask_s, other=0)
    g = tl.load(g_ptr + offs_r // ROWS_PER_G, mask=mask_r, other=1.0)
    # E2M1 magnitude bits dropped into an fp16 exponent/mantissa give value * 2^-14 (subnormals included);
    # the fp32 multiply by 2^14 is exact, and keeping it per element (not in the block scale) cannot overflow.
    block_scale = e4m3_decode(s) * g[:, None]                               # [BLOCK_R, BLOCK_K/16]
    nib = tl.interleave(c & 0xF, c >> 4).to(tl.uint16)                      # [BLOCK_R, BLOCK_K]
    half_bits = ((nib & 7) << 9) | ((nib & 8) << 12)
    v = half_bits.to(tl.float16, bitcast=True).to(tl.float32) * 16384.0    # exact E2M1 values
    v = tl.reshape(v, (BLOCK_R, BLOCK_K // 16, 16)) * block_scale[:, :, None]
    out = cast_output(tl.reshape(v, (BLOCK_R, BLOCK_K)), OUT_DTYPE, INTERPRET)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = mask_r[:, None] & (offs_k[None, :] < K)
    tl.store(out_ptr + offs_r[:, None].to(tl.int64) * K + offs_k[None, :], out, mask=mask)


DEQUANTIZE = runtime.Kernel("nvfp4.dequantize", _nvfp4_dequantize_kernel)


def dequantize_triton(q: NVFP4Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Host side of :func:`lynn_kernels.nvfp4.dequantize`."""
    if not isinstance(q, NVFP4Tensor):
        raise TypeError(f"q must be an NVFP4Tensor, got {type(q).__name__}")
    check_out_dtype(dtype)
    runtime.check_device("q.codes", q.codes)
    return launch_dequantize(q, torch.empty(q.shape, dtype=dtype, device=q.device))


def launch_dequantize(q: NVFP4Tensor, out: torch.Tensor, *, kernel=None) -> torch.Tensor:
    """Launch only, into a contiguous ``out`` of ``q.shape`` (no checks); ``kernel`` (a ``@triton.jit`` function with
    ``_nvfp4_dequantize_kernel``'s parameters) replaces the shipped kernel."""
    k = q.shape[-1]
    n_rows = q.codes.numel() // (k // 2)

    def grid(meta):
        return (runtime.cdiv(n_rows, meta["BLOCK_R"]), runtime.cdiv(k, meta["BLOCK_K"]))

    DEQUANTIZE.current(kernel)[grid](
        q.codes, q.scales.view(torch.uint8), q.global_scale, kernel_view(out),
        n_rows, k, q.rows_per_global(),
        OUT_DTYPE=runtime.TORCH_TO_TL[out.dtype], **runtime.kernel_flags(),
    )
    return out
