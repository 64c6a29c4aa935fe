"""The tensor-core W4A16 kernels: ``y = x @ W^T`` with ``W`` read as NVFP4 codes and scales, never expanded in memory,
from the checkpoint layout (an :class:`~lynn_kernels.nvfp4.NVFP4Tensor`) or the packed one (a :class:`PackedNVFP4`,
``PACKED_LAYOUT``); and the dispatch of :func:`lynn_kernels.matmul.nvfp4_linear` over them, the packed GEMV
(:mod:`.triton_packed`) and dequantise-then-cuBLAS.

Both kernels compute the transposed product ``y^T [N, M] = W [N, K] @ x^T [K, M]``, so the weight, decoded in
registers, is the first ``tl.dot`` operand (Hopper's wgmma can take that one straight from registers) and the small
activation tile is the second (docs/matmul.md derives the decode, its exactness and the split-K reduce; what
follows is the map of this file). Each weight tile is decoded the same way (:func:`~lynn_kernels.triton_shared.w_tile`;
a packed-layout weight's tile is :func:`~lynn_kernels.triton_shared.packed_w_tile`'s):

* the checkpoint layout's bytes hold two 4-bit E2M1 codes each; each nibble's 3 magnitude bits dropped into an fp16
  exponent/mantissa (and its sign bit into the fp16 sign) give the exact value times ``2^-14`` (subnormals
  included), one integer op chain per element and one conversion, no table;
* the E4M3 block scale is decoded once per 16 elements, times ``2^14`` to undo the factor above; both products are
  exact (6 significant bits), so the weight tile in bf16 equals ``e2m1 * scale`` exactly;
* the global scale multiplies the fp32 accumulator once per output, in the epilogue.

On the GPU with bf16 activations the decode takes two elements per instruction (``PACKED_DECODE``, the bf16x2
decode: ``_e2m1_bf16x2_scaled``, inline PTX); elsewhere (fp16 / fp32 activations, the interpreter) it is the
portable integer decode above.

``_nvfp4_gemv_kernel`` (M <= 16, decode) streams the weight once: one program per ``BLOCK_N`` rows and K slice
(split-K when N alone cannot fill the GPU), a ``tl.dot`` on the M rows padded to 16. ``_nvfp4_gemm_kernel``
(prefill) tiles M as well, with grouped tile order so a band of weight tiles stays in L2 while every M tile passes
over it.

Split-K is deterministic: each program writes its fp32 partial tile, takes a ticket from a per-tile counter, and the
last one adds the partials in split order and writes ``y``; it also resets the counter, so one zeroed buffer per
stream serves every call, fixed in size and never replaced (a CUDA graph keeps the buffer it captured). The partial
sums go to a workspace allocated per call (from the graph's pool inside a capture).

The weight-tile decode (:func:`~lynn_kernels.triton_shared.w_tile`), the split-K tickets
(:func:`~lynn_kernels.triton_shared.split_k_counter`, :func:`~lynn_kernels.triton_shared.split_k_for`) and the launch
constexprs (:func:`~lynn_kernels.triton_shared.kernel_constexprs`) are shared with the MoE and Gated DeltaNet kernels,
so they live in :mod:`lynn_kernels.triton_shared`; every helper here is private to matmul.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .. import runtime
from ..nvfp4 import NVFP4Tensor
from ..runtime import cast_output, kernel_view, to_float32
from ..triton_shared import (
    MMA_UNIT,
    kernel_constexprs,
    launch_packed_dequantize,
    split_k_counter,
    split_k_for,
    w_tile,
)
from .packed import CHUNK, PackedNVFP4
from .spec import GEMV_MAX_M, check_linear_args
from .triton_packed import NORM_MAX_K, _bias_arg, _sm_count, launch_packed_gemv, packed_gemv_config

# ---------------------------------------------------------------------------------------------------------------
# the split-K epilogue


@triton.jit
def _finish(acc, pid_tile, pid_k, n_split, offs_n, mask_n, offs_m, mask_m,
            g_ptr, bias_ptr, y_ptr, part_ptr, count_ptr, N, stride_ym, ROWS_PER_G, SPLIT_STRIDE,
            HAS_BIAS: tl.constexpr, BIAS_DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr, ACC_UNIT: tl.constexpr,
            INTERPRET: tl.constexpr):
    """Reduce split-K partials deterministically, then ``y[m, n] = acc[n, m] * g[n] + bias[n]``, rounded once."""
    mask = mask_n[:, None] & mask_m[None, :]
    offs_t = offs_m[None, :].to(tl.int64) * N + offs_n[:, None]                     # [BLOCK_N, BLOCK_M] in [M, N]
    write = pid_k == 0
    if n_split > 1:
        tl.store(part_ptr + pid_k.to(tl.int64) * SPLIT_STRIDE + offs_t, acc, mask=mask)
        tl.debug_barrier()                                   # every thread's partial is written before the ticket
        ticket = tl.atomic_add(count_ptr + pid_tile, 1, sem="acq_rel")
        write = ticket == n_split - 1
        if write:                                            # the last program adds partials in split order
            acc = tl.zeros_like(acc)
            part = part_ptr + offs_t
            for _ in range(0, n_split):
                acc += tl.load(part, mask=mask, other=0.0, cache_modifier=".cg")
                part += SPLIT_STRIDE
            tl.atomic_xchg(count_ptr + pid_tile, 0)          # ready for the next call
    g = tl.load(g_ptr + offs_n // ROWS_PER_G, mask=mask_n, other=0.0)
    out = acc * (g * ACC_UNIT)[:, None]           # ACC_UNIT undoes the decode's 2^-7 (bf16x2) or 2^-19 (packed layout)
    if HAS_BIAS:
        out += to_float32(tl.load(bias_ptr + offs_n, mask=mask_n, other=0), BIAS_DTYPE, INTERPRET)[:, None]
    tl.store(y_ptr + offs_m[None, :].to(tl.int64) * stride_ym + offs_n[:, None],
             cast_output(out, OUT_DTYPE, INTERPRET), mask=mask & write)


# ---------------------------------------------------------------------------------------------------------------
# GEMV: M <= 16

#: One config for every decode shape: the best of twelve at 4096^2, 8192^2 and 2048x4096, M = 1 and 16, on the H200
#: by kernel time (docs/matmul.md). Not autotuned at run time: the host cost of a launch (~100 us on the device's
#: CPU) dwarfs these 10-40 us kernels, so the autotuner's timings would only rank noise.
GEMV_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256, "num_warps": 4}


@triton.jit
def _nvfp4_gemv_kernel(
    x_ptr, codes_ptr, scales_ptr, g_ptr, bias_ptr, y_ptr, part_ptr, count_ptr,
    M, N, K, stride_xm, stride_xk, stride_ym, ROWS_PER_G,
    HAS_BIAS: tl.constexpr, X_DTYPE: tl.constexpr, BIAS_DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr,
    DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, PACKED_DECODE: tl.constexpr, PACKED_LAYOUT: tl.constexpr,
    ACC_UNIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n_split = tl.num_programs(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    n_chunks = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(n_chunks, n_split)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for chunk in range(pid_k * per_split, tl.minimum(pid_k * per_split + per_split, n_chunks)):
        k0 = chunk * BLOCK_K
        offs_k = k0 + tl.arange(0, BLOCK_K)
        # the M rows padded to 16 on the tensor cores: the decode is the work, the MMA is nearly free; x loads
        # along its rows (contiguous in K), transposed in registers
        xt = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :] * stride_xk,
                     mask=(offs_k[None, :] < K) & mask_m[:, None], other=0)
        xt = tl.trans(to_float32(xt, X_DTYPE, INTERPRET).to(DOT_DTYPE))            # [BLOCK_K, BLOCK_M]
        wt = w_tile(codes_ptr, scales_ptr, offs_n, mask_n, k0, K, BLOCK_N, BLOCK_K, DOT_DTYPE,
                    PACKED_DECODE, INTERPRET, PACKED_LAYOUT, ACC_UNIT)             # [BLOCK_N, BLOCK_K]
        acc = tl.dot(wt, xt, acc, input_precision=PRECISION)
    _finish(acc, pid_n, pid_k, n_split, offs_n, mask_n, offs_m, mask_m,
            g_ptr, bias_ptr, y_ptr, part_ptr, count_ptr, N, stride_ym, ROWS_PER_G, M * N,
            HAS_BIAS, BIAS_DTYPE, OUT_DTYPE, ACC_UNIT, INTERPRET)


NVFP4_GEMV = runtime.Kernel("matmul.gemv", _nvfp4_gemv_kernel)


# ---------------------------------------------------------------------------------------------------------------
# GEMM: M > 16


#: The GEMM's autotune tiles: BLOCK_N (MMA rows: weight), BLOCK_M (MMA cols: tokens), BLOCK_K, warps, stages.
_GEMM_SHAPES = [
    (128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 128, 8, 3), (64, 128, 128, 4, 3),
    (128, 64, 128, 8, 3), (64, 64, 128, 4, 4), (128, 32, 128, 8, 3), (64, 32, 256, 4, 3),
    (128, 16, 256, 8, 3), (64, 16, 256, 4, 3),
]


def _gemm_configs():
    return [triton.Config({"BLOCK_N": bn, "BLOCK_M": bm, "BLOCK_K": bk, "GROUP_N": 8}, num_warps=w, num_stages=st)
            for bn, bm, bk, w, st in _GEMM_SHAPES]


def _staged(c: triton.Config) -> triton.Config:
    """``c`` with :func:`lynn_kernels.runtime.register_dot_stages` applied (at launch time, not at import)."""
    st = runtime.register_dot_stages(c.num_stages)
    return c if st == c.num_stages else triton.Config(dict(c.kwargs), num_warps=c.num_warps, num_stages=st)


#: Token buckets below 256 get one config each (kernels of 10-100 us: autotuning would rank host noise); from 256 up
#: the autotuner picks among the configs whose token tile fits the bucket.
GEMM_SMALL_M = {16: (64, 16, 256, 4, 3), 32: (64, 32, 256, 4, 3), 64: (64, 64, 128, 4, 4),
                128: (64, 128, 128, 4, 3)}


def _prune_gemm(configs, named_args, **kwargs):
    bucket = max(16, named_args["M_BUCKET"])          # M <= 16 reaches the GEMM only when nvfp4_gemm is called
    if bucket in GEMM_SMALL_M:
        bn, bm, bk, w, st = GEMM_SMALL_M[bucket]
        return [triton.Config({"BLOCK_N": bn, "BLOCK_M": bm, "BLOCK_K": bk, "GROUP_N": 8}, num_warps=w,
                              num_stages=runtime.register_dot_stages(st))]
    packed_layout = kwargs.get("PACKED_LAYOUT", False)      # a packed-layout tile covers whole 128-column chunks
    kept = [_staged(c) for c in configs if c.kwargs["BLOCK_M"] <= max(16, bucket)
            and (not packed_layout or c.kwargs["BLOCK_K"] % CHUNK == 0)]
    return sorted(kept, key=lambda c: -c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"])   # the interpreter runs the first


@runtime.autotune(configs=_gemm_configs(), key=["M_BUCKET", "N", "K", "PACKED_LAYOUT"],
                  prune_configs_by={"early_config_prune": _prune_gemm})
@triton.jit
def _nvfp4_gemm_kernel(
    x_ptr, codes_ptr, scales_ptr, g_ptr, bias_ptr, y_ptr, part_ptr, count_ptr,
    M, N, K, stride_xm, stride_xk, stride_ym, ROWS_PER_G, M_BUCKET,
    HAS_BIAS: tl.constexpr, X_DTYPE: tl.constexpr, BIAS_DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr,
    DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, PACKED_DECODE: tl.constexpr, PACKED_LAYOUT: tl.constexpr,
    ACC_UNIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_N: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    n_split = tl.num_programs(1)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles_m = tl.cdiv(M, BLOCK_M)
    # grouped order: GROUP_N weight tiles stay in L2 while every token tile passes over them
    per_group = GROUP_N * tiles_m
    first_n = (pid // per_group) * GROUP_N
    group_n = tl.minimum(tiles_n - first_n, GROUP_N)
    pid_n = first_n + (pid % per_group) % group_n
    pid_m = (pid % per_group) // group_n
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    n_chunks = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(n_chunks, n_split)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for chunk in range(pid_k * per_split, tl.minimum(pid_k * per_split + per_split, n_chunks)):
        k0 = chunk * BLOCK_K
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        xt = tl.load(x_ptr + offs_m[None, :].to(tl.int64) * stride_xm + offs_k[:, None] * stride_xk,
                     mask=mask_k[:, None] & mask_m[None, :], other=0)
        xt = to_float32(xt, X_DTYPE, INTERPRET).to(DOT_DTYPE)                      # [BLOCK_K, BLOCK_M]
        wt = w_tile(codes_ptr, scales_ptr, offs_n, mask_n, k0, K, BLOCK_N, BLOCK_K, DOT_DTYPE,
                    PACKED_DECODE, INTERPRET, PACKED_LAYOUT, ACC_UNIT)             # [BLOCK_N, BLOCK_K]
        acc = tl.dot(wt, xt, acc, input_precision=PRECISION)
    _finish(acc, pid_m * tiles_n + pid_n, pid_k, n_split, offs_n, mask_n, offs_m, mask_m,
            g_ptr, bias_ptr, y_ptr, part_ptr, count_ptr, N, stride_ym, ROWS_PER_G, M * N,
            HAS_BIAS, BIAS_DTYPE, OUT_DTYPE, ACC_UNIT, INTERPRET)


NVFP4_GEMM = runtime.Kernel("matmul.gemm", _nvfp4_gemm_kernel)


# ---------------------------------------------------------------------------------------------------------------
# host side


@functools.lru_cache(maxsize=4096)
def _max_split(m: int, n: int, k: int, sms: int) -> int:
    """The largest split any GEMM config can choose for this shape: sizes the partial-sum workspace."""
    return max(_gemm_split(c.kwargs, m, n, k, sms) for c in _gemm_configs())


def _gemm_split(meta, m: int, n: int, k: int, sms: int) -> int:
    tiles = runtime.cdiv(n, meta["BLOCK_N"]) * runtime.cdiv(m, meta["BLOCK_M"])
    return split_k_for(tiles, k, meta["BLOCK_K"], sms) if tiles < sms else 1


def _prepare(x: torch.Tensor, w, bias):
    check_linear_args(x, w, bias)                            # x, w and bias on one device
    runtime.check_device("x", x)
    n, k = w.shape
    x2 = x if x.dim() == 2 else x.reshape(-1, k)             # a view where possible; strides go to the kernel
    y = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
    return x2, y


def _common_args(x2, bias, y, w) -> dict:
    """The GEMV's and GEMM's constexprs; ``PACKED_LAYOUT`` when ``w`` is a PackedNVFP4."""
    return kernel_constexprs(x2.dtype, None if bias is None else bias.dtype, y.dtype, runtime.INTERPRET,
                             isinstance(w, PackedNVFP4))


def _weight_args(w) -> tuple:
    """The weight's kernel arguments: the checkpoint layout's code and scale bytes, or a PackedNVFP4's words and
    re-encoded scales."""
    if isinstance(w, PackedNVFP4):
        return w.words, w.scales, w.global_scale
    return w.codes, w.scales.view(torch.uint8), w.global_scale


def _check_packed_block_k(w, meta: dict) -> None:
    """A config's ``BLOCK_K`` for ``w``: a PackedNVFP4's tile covers whole chunks of the packed layout."""
    if isinstance(w, PackedNVFP4) and meta["BLOCK_K"] % CHUNK:
        raise ValueError(f"config BLOCK_K = {meta['BLOCK_K']}: a packed weight's tile covers whole chunks of "
                         f"{CHUNK} columns (BLOCK_K a multiple of {CHUNK})")


def launch_gemv(x2: torch.Tensor, w: NVFP4Tensor, bias, y: torch.Tensor, config: dict | None = None,
                split_k: int | None = None, *, kernel=None) -> torch.Tensor:
    """Launch only: ``x2 [M, K]`` (M <= 16, any strides) into ``y [M, N]``. ``config`` (``BLOCK_N``, ``BLOCK_K``,
    ``BLOCK_M`` (8 or 16, at least M), ``num_warps``, ``num_stages``) replaces :data:`GEMV_CONFIG`, ``split_k`` the
    heuristic (tests and experiments). ``kernel`` (a ``@triton.jit`` function with ``_nvfp4_gemv_kernel``'s
    parameters) replaces the shipped kernel."""
    m, k = x2.shape
    n = w.shape[0]
    meta = {**GEMV_CONFIG, **(config or {})}
    _check_packed_block_k(w, meta)
    if m > meta["BLOCK_M"] or meta["BLOCK_M"] not in (8, 16):
        raise ValueError(f"config BLOCK_M = {meta['BLOCK_M']}: the GEMV pads M = {m} to BLOCK_M, 8 or 16")
    warps = meta.pop("num_warps")
    extra = {"num_stages": runtime.register_dot_stages(meta.pop("num_stages", 3),         # 3: Triton's default
                                                       requested="num_stages" in (config or {}))}
    tiles = runtime.cdiv(n, meta["BLOCK_N"])
    split = split_k or split_k_for(tiles, k, meta["BLOCK_K"], _sm_count(x2.device))
    part = torch.empty(split * m * n, dtype=torch.float32, device=x2.device) if split > 1 else y
    NVFP4_GEMV.current(kernel)[(tiles, split)](
        kernel_view(x2), *_weight_args(w), _bias_arg(bias, y), kernel_view(y),
        part, split_k_counter(x2.device, tiles if split > 1 else 0), m, n, k, x2.stride(0), x2.stride(1), y.stride(0),
        w.rows_per_global(),
        **_common_args(x2, bias, y, w), **meta, num_warps=warps, **extra)
    return y


def m_bucket(m: int) -> int:
    """The autotuning key for M: the next power of two, capped at 4096 (prefill lengths vary call to call)."""
    return min(runtime.next_power_of_2(m), 4096)


def launch_gemm(x2: torch.Tensor, w: NVFP4Tensor, bias, y: torch.Tensor, config: dict | None = None,
                split_k: int | None = None, *, kernel=None) -> torch.Tensor:
    """Launch only: ``x2 [M, K]`` (any M, any strides) into ``y [M, N]``; ``config`` / ``split_k`` as
    :func:`launch_gemv`. ``kernel`` (a ``@triton.jit`` function with ``_nvfp4_gemm_kernel``'s parameters, autotuned
    or not: a ``config`` launches an autotuned one's ``.fn``) replaces the shipped kernel."""
    m, k = x2.shape
    n = w.shape[0]
    sms = _sm_count(x2.device)

    def split_of(meta):
        return split_k or _gemm_split(meta, m, n, k, sms)

    if config is None:      # the autotuner may pick any config: size for the largest split and the most tiles
        max_split = split_k or _max_split(m, n, k, sms)
        tiles = runtime.cdiv(n, 64) * runtime.cdiv(m, 16)
    else:
        _check_packed_block_k(w, config)
        max_split = split_of(config)
        tiles = runtime.cdiv(n, config["BLOCK_N"]) * runtime.cdiv(m, config["BLOCK_M"])
    part = torch.empty(max_split * m * n, dtype=torch.float32, device=x2.device) if max_split > 1 else y
    count = split_k_counter(x2.device, tiles if max_split > 1 else 0)

    def grid(meta):
        return (runtime.cdiv(n, meta["BLOCK_N"]) * runtime.cdiv(m, meta["BLOCK_M"]), split_of(meta))

    args = (kernel_view(x2), *_weight_args(w), _bias_arg(bias, y),
            kernel_view(y), part, count, m, n, k, x2.stride(0), x2.stride(1), y.stride(0), w.rows_per_global(),
            m_bucket(m))
    flags = _common_args(x2, bias, y, w)
    fn = NVFP4_GEMM.current(kernel)
    if config is None:
        fn[grid](*args, **flags)
    else:
        meta = {"GROUP_N": 8, **config}
        warps = meta.pop("num_warps", 4)
        stages = runtime.register_dot_stages(meta.pop("num_stages", 3), requested="num_stages" in config)
        fn = fn.fn if hasattr(fn, "configs") else fn       # an autotuned kernel: its jitted one, no autotuning
        fn[grid(meta)](*args, **flags, **meta, num_warps=warps, num_stages=stages)
    return y


# ---------------------------------------------------------------------------------------------------------------
# prefill: dequantise the packed weight once (triton_shared.launch_packed_dequantize), then cuBLAS

#: From this many rows of a 16-bit x on, ``nvfp4_linear`` multiplies a packed weight by dequantising it to x's dtype
#: (one kernel, a workspace of ``N x K`` elements) and calling cuBLAS, instead of the packed GEMM kernel: faster from
#: M = 128 on three of the four decoder shapes and from 256 on all (docs/history/matmul.md). Weights with more runs of
#: rows under one global scale than DEQUANT_MAX_SHARDS stay on the packed GEMM (one cuBLAS call per run: a stack of
#: projections is one run each).
DEQUANT_MIN_M = 128
DEQUANT_MAX_SHARDS = 4


def use_dequant_gemm(m: int, w, x_dtype: torch.dtype, bias=None) -> bool:
    """The prefill dispatch: dequantise-then-cuBLAS for a packed weight and a 16-bit x from DEQUANT_MIN_M rows on,
    with at most DEQUANT_MAX_SHARDS runs of one global scale (:meth:`PackedNVFP4.scale_runs`: read back once per
    weight) and a bias (if any) of x's dtype (cuBLAS adds it in that dtype). fp32 x stays on the GEMM kernel, whose
    fp32 product is IEEE whatever torch's TF32 switches say."""
    return (isinstance(w, PackedNVFP4) and m >= DEQUANT_MIN_M and x_dtype in (torch.bfloat16, torch.float16)
            and (bias is None or bias.dtype == x_dtype) and len(w.scale_runs()) <= DEQUANT_MAX_SHARDS)


def launch_dequant_gemm(x2: torch.Tensor, w: PackedNVFP4, bias, y: torch.Tensor,
                        config: dict | None = None) -> torch.Tensor:
    """Launch only: ``x2 [M, K]`` times the packed ``w`` into ``y [M, N]`` by dequantising ``w`` to x's dtype in a
    workspace (exact: ``e2m1 * s`` times a power of two) and one cuBLAS ``addmm`` per run of rows under one global
    scale (:meth:`PackedNVFP4.scale_runs`), which applies the scale and the power of two as its fp32 ``alpha`` and
    adds the bias (x's dtype) before the one rounding: the reference's arithmetic, in cuBLAS's summation order (and
    with torch's cuBLAS settings: reduced-precision
    split-K reductions for 16-bit x where torch allows them, TF32 for fp32 x where it is switched on, as ``F.linear``
    has them). No autograd (as every kernel here): the product is computed under ``no_grad``. ``config`` replaces
    ``triton_shared.DEQUANT_CONFIG``."""
    if bias is not None and bias.dtype != x2.dtype:
        raise ValueError(f"bias has dtype {bias.dtype}; the dequantise-then-cuBLAS GEMM adds it in x's dtype "
                         f"({x2.dtype})")
    n, k = w.shape
    wd = launch_packed_dequantize(w, torch.empty((n, k), dtype=x2.dtype, device=x2.device), config)
    unit = 1.0 if x2.dtype == torch.float16 else MMA_UNIT.value
    with torch.no_grad():                                  # out= refuses inputs that require grad
        for r0, r1, s in w.scale_runs():
            r = slice(r0, r1)
            out = y[:, r]
            if bias is None:
                torch.addmm(out, x2, wd[r].t(), beta=0, alpha=s * unit, out=out)
            else:
                torch.addmm(bias[r], x2, wd[r].t(), alpha=s * unit, out=out)
    return y


def use_packed_gemv(m: int, n: int) -> bool:
    """The decode dispatch for a packed weight, from the H200 sweeps in docs/history/matmul.md: the packed GEMV for one
    row of x up to 65,536 output rows (faster than the tensor-core GEMV by up to 1.6x on the decoder's projections,
    slower on the LM head), and for two rows below 8,192 output rows; the tensor-core GEMV otherwise (its time is
    flat in M to 16)."""
    return (m == 1 and n <= 65536) or (m == 2 and n < 8192)


def _launch_small(x2, w, bias, y):
    """M <= GEMV_MAX_M: the packed GEMV or the tensor-core GEMV for a packed weight (:func:`use_packed_gemv`), the
    tensor-core GEMV for the checkpoint layout."""
    if isinstance(w, PackedNVFP4) and use_packed_gemv(x2.shape[0], w.shape[0]):
        return launch_packed_gemv(x2, w, bias, y, pdl=runtime.pdl())
    return launch_gemv(x2, w, bias, y)


def nvfp4_gemv_triton(x: torch.Tensor, w: NVFP4Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Host side of :func:`lynn_kernels.matmul.nvfp4_gemv` (M = prod(x.shape[:-1]) <= 16)."""
    x2, y = _prepare(x, w, bias)
    if x2.shape[0] > GEMV_MAX_M:
        raise ValueError(f"nvfp4_gemv takes at most {GEMV_MAX_M} rows of x, got M = {x2.shape[0]} "
                         f"(x {tuple(x.shape)}); use nvfp4_gemm or nvfp4_linear")
    if x2.shape[0] > 0:
        _launch_small(x2, w, bias, y)
    return y.reshape(*x.shape[:-1], w.shape[0])


def nvfp4_gemm_triton(x: torch.Tensor, w: NVFP4Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Host side of :func:`lynn_kernels.matmul.nvfp4_gemm` (any M)."""
    x2, y = _prepare(x, w, bias)
    if x2.shape[0] > 0:
        launch_gemm(x2, w, bias, y)
    return y.reshape(*x.shape[:-1], w.shape[0])


def _launch_large(x2, w, bias, y):
    """M > GEMV_MAX_M: dequantise-then-cuBLAS where :func:`use_dequant_gemm` says, the packed GEMM otherwise."""
    if use_dequant_gemm(x2.shape[0], w, x2.dtype, bias):
        return launch_dequant_gemm(x2, w, bias, y)
    return launch_gemm(x2, w, bias, y)


def nvfp4_linear_triton(x: torch.Tensor, w: NVFP4Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Host side of :func:`lynn_kernels.matmul.nvfp4_linear`: the GEMV for M <= 16; above, the GEMM kernel or, for
    a packed weight and a 16-bit x from DEQUANT_MIN_M rows on, the weight dequantised once and cuBLAS."""
    x2, y = _prepare(x, w, bias)
    m = x2.shape[0]
    like = runtime.batch_rows(m)
    if m > 0 and like != m:
        _launch_as_batch(x2, w, bias, y, like)
    elif m > 0:
        (_launch_small if m <= GEMV_MAX_M else _launch_large)(x2, w, bias, y)
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], w.shape[0])


def _launch_as_batch(x2, w, bias, y, like: int):
    """Inside :func:`runtime.as_batch`: each row of ``x2`` summed as a call of ``like`` rows sums it, in as few
    launches as the kernels allow: the packed GEMV with ``like`` rows' tile takes 4 rows a launch, the tensor-core
    GEMV (its sums do not depend on M) 16, the GEMM paths ``like`` rows a launch (the last padded to ``like``)."""
    m, (n, k) = x2.shape[0], w.shape
    if like <= GEMV_MAX_M and isinstance(w, PackedNVFP4) and use_packed_gemv(like, n):
        step, cfg = 4, packed_gemv_config(n, k, _sm_count(x2.device), like)

        def launch(xs, ys):
            launch_packed_gemv(xs, w, bias, ys, config=cfg, pdl=runtime.pdl())
    elif like <= GEMV_MAX_M:
        step = GEMV_MAX_M

        def launch(xs, ys):
            launch_gemv(xs, w, bias, ys)
    else:
        def piece(xs):
            ys = torch.empty((xs.shape[0], n), dtype=y.dtype, device=y.device)
            _launch_large(xs, w, bias, ys)
            return ys
        y.copy_(runtime.in_calls_of(piece, x2, like))
        return
    for r in range(0, m, step):
        launch(x2[r:r + step], y[r:r + step])


def norm_linear_triton(x: torch.Tensor, norm_weight: torch.Tensor, w, eps: float = 1e-6, *,
                       residual: torch.Tensor | None = None) -> tuple:
    """Host side of :func:`lynn_kernels.matmul.norm_linear`: one launch of the packed GEMV with the norm folded in
    where the packed GEMV takes the product (a packed ``w``, :func:`use_packed_gemv`, ``K <= NORM_MAX_K``, a norm weight
    the kernels read); otherwise the norm kernel, then :func:`nvfp4_linear`'s dispatch (two launches, the same
    values)."""
    from ..norm import rmsnorm
    from ..norm import spec as norm_spec

    check_linear_args(x, w, None)
    norm_spec.check_rmsnorm(x, norm_weight, eps, residual, None, None, "norm_weight")
    runtime.check_device("x", x)
    n, k = w.shape
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    like = runtime.batch_rows(m)                  # as_batch: the tile of a call of `like` rows
    if not (isinstance(w, PackedNVFP4) and 0 < m <= 4 and use_packed_gemv(like, n) and k <= NORM_MAX_K
            and norm_weight.dtype in runtime.TORCH_TO_TL):
        return norm_spec.norm_then(rmsnorm, lambda xn: nvfp4_linear_triton(xn, w), x, norm_weight, eps, residual)
    norm_spec.check_devices(x=x, norm_weight=norm_weight, residual=residual)
    x2 = norm_spec.last_dim_contiguous(x2)
    r2 = None if residual is None else norm_spec.last_dim_contiguous(residual.reshape(-1, k))
    xn = torch.empty((m, k), dtype=x.dtype, device=x.device)
    h = None if residual is None else torch.empty((m, k), dtype=x.dtype, device=x.device)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    config = None if like == m else packed_gemv_config(n, k, _sm_count(x2.device), like)
    launch_packed_gemv(x2, w, None, y, config=config, pdl=runtime.pdl(),
                       norm=(r2, norm_weight.contiguous(), float(eps), xn, h))
    lead = x.shape[:-1]
    y, xn = y.reshape(*lead, n), xn.reshape(*lead, k)
    return (y, xn) if residual is None else (y, xn, h.reshape(*lead, k))
