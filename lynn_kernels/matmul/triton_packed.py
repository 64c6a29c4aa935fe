"""Packed-layout W4A16 kernels: the packed GEMV (decode rows on the FMA units) and its launch (the packed weight
tile for the tensor-core kernels of :mod:`.triton_matmul` is in :mod:`lynn_kernels.triton_shared`). The layout is
:mod:`.packed`'s; the design and its measurements are in docs/matmul.md.

The decode of one int32 word (8 codes) is 13 integer operations in all: five shifts shared by the four bf16 pairs,
an AND and an AND-OR per pair (``triton_shared.decode_word``). Each pair becomes two fp32 values ``e2m1 * 2^-126`` by a
shift and a mask (a bf16 is the top half of an fp32). The GEMV multiplies them by ``x * 2^64`` (so the products
are normal fp32: ``e2m1 * x * 2^-62``, exact), adds the products of each half word (a half word lies in one block),
and scales each half's sum by its block scale ``s * 2^75`` with one more FMA; the epilogue multiplies by
``global_scale * 2^-13`` once per output. Every step is exact but the fp32 additions, as in the reference.

The tensor-core tile (``triton_shared.packed_w_tile``) decodes the same words to bf16 and only relabels them: the
layout puts in each word the eight elements one thread holds of the ``mma`` A operand, so the compiled kernel feeds the
decoded registers to the tensor cores with no shared-memory round trip (docs/matmul.md).

The word decode (:func:`~lynn_kernels.triton_shared.decode_word`, :func:`~lynn_kernels.triton_shared.fma_scales`,
:func:`~lynn_kernels.triton_shared.load_words`, :func:`~lynn_kernels.triton_shared.fma_row_step`), the tensor-core
tile (:func:`~lynn_kernels.triton_shared.packed_w_tile`) and the folded norm's rows are shared with the MoE decode
kernels, so they live in :mod:`lynn_kernels.triton_shared`; this file keeps the packed GEMV kernel and its host side
(:func:`launch_packed_gemv`, :func:`packed_gemv_config`).

The range this buys: ``|x|`` below ``2^64`` (``x * 2^64`` stays finite) and products above ``2^-64`` stay normal;
beyond, fp32 itself would be the limit of the reference too (``e2m1 * scale * x`` near fp32's ends).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .. import runtime
from ..runtime import cast_output, kernel_view, to_float32
from ..triton_shared import FMA_UNIT, decode_word, fma_row_step, fma_scales, kernel_constexprs, load_words, norm_row
from .packed import PackedNVFP4


@triton.jit
def _row_out(acc, m, M, rows, mask_n, g, bias_ptr, y_ptr, stride_ym, HAS_BIAS: tl.constexpr,
             BIAS_DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    out = tl.sum(acc, axis=1) * g
    if HAS_BIAS:
        out += to_float32(tl.load(bias_ptr + rows, mask=mask_n, other=0), BIAS_DTYPE, INTERPRET)
    tl.store(y_ptr + (tl.full((), m, tl.int64) * stride_ym) + rows, cast_output(out, OUT_DTYPE, INTERPRET),
             mask=mask_n & (m < M))


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
    """``y[:M] = x[:M] @ W^T`` for ``M <= BLOCK_M <= 4`` (a few decode rows; the dispatch, ``use_packed_gemv``, sends
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


PACKED_GEMV = runtime.Kernel("matmul.packed_gemv", packed_gemv_kernel)


# ---------------------------------------------------------------------------------------------------------------
# host side


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors to fill; the interpreter pretends to have 4 so small tests exercise split-K."""
    if runtime.INTERPRET:
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def _bias_arg(bias, y):
    return y if bias is None else kernel_view(bias.contiguous())     # y is never read when HAS_BIAS=False


@functools.lru_cache(maxsize=4096)
def packed_gemv_config(n: int, k: int, sms: int, m: int = 1) -> dict:
    """The packed GEMV's tile for an ``[N, K]`` weight and ``m`` rows of x: ``TW`` words of K per step (all 32 lanes
    of a warp along K, 4 words each, fewer when K is short) and the most rows per program that still gives every SM
    a program, at most 16 (32 from K = 8192 on for one x row; two rows spill registers there); one x row on 8,192
    rows or more at K = 2048 takes 32 rows of 64 words, four steps. ``PROGRAMS`` 0 (one program per tile) and
    ``EARLY_RELEASE`` off. Each choice is the fastest of the GPU sweeps in docs/history/matmul.md."""
    if m == 1 and n >= 8192 and k == 2048:
        return {"BLOCK_N": 32, "TW": 64, "num_warps": 4, "PROGRAMS": 0, "EARLY_RELEASE": False}
    tw = min(128, runtime.next_power_of_2(max(k // 8, 16)))    # words of the padded row: a multiple of 16
    block_n, most = 4, 16 if m > 1 or k < 8192 else 32
    while block_n < most and runtime.cdiv(n, 2 * block_n) >= sms:
        block_n *= 2
    return {"BLOCK_N": block_n, "TW": tw, "num_warps": 4, "PROGRAMS": 0, "EARLY_RELEASE": False}


def launch_packed_gemv(x2: torch.Tensor, w: PackedNVFP4, bias, y: torch.Tensor, config: dict | None = None,
                       pdl: bool = False, norm: tuple | None = None, *, kernel=None) -> torch.Tensor:
    """Launch only: ``x2 [M, K]`` (``M <= 4``, any strides; the dispatch sends at most ``PACKED_GEMV_MAX_M``) times a
    packed weight into ``y [M, N]`` on the packed GEMV. ``config`` replaces keys of :func:`packed_gemv_config`:
    ``BLOCK_N``, ``TW``, ``num_warps``, ``PROGRAMS`` (the grid: 0 for one program per ``BLOCK_N``-row tile, else at
    most that many programs taking the tiles in turn) and ``EARLY_RELEASE`` (with ``pdl``: the next kernel may launch
    once every program has started). ``pdl`` launches it with programmatic dependent launch (Hopper: the weights load
    before the wait on the kernel before). ``norm = (residual, norm_weight, eps, x_out, residual_out)`` folds the
    RMSNorm in front (:func:`lynn_kernels.matmul.norm_linear`): the product is of ``rmsnorm(x2 + residual) * (1 +
    norm_weight)`` (``residual`` None: of ``rmsnorm(x2)``), whose rows go to ``x_out`` and ``x2 + residual`` to
    ``residual_out`` (contiguous ``[M, K]``); ``x2`` and ``residual`` unit stride along K, ``K <= NORM_MAX_K``.
    ``kernel`` (a ``@triton.jit`` function with ``packed_gemv_kernel``'s parameters) replaces the shipped kernel."""
    m, k = x2.shape
    n = w.shape[0]
    kw = w.words.shape[1]
    if m > 4:
        raise ValueError(f"the packed GEMV takes at most 4 rows of x, got M = {m}")
    meta = packed_gemv_config(n, k, _sm_count(x2.device), m)            # cached: read, never changed
    if config:
        meta = {**meta, **config}
        unknown = set(meta) - {"BLOCK_N", "TW", "num_warps", "PROGRAMS", "EARLY_RELEASE"}
        if unknown:
            raise ValueError(f"config keys {sorted(unknown)} are not packed GEMV settings (BLOCK_N, TW, num_warps, "
                             f"PROGRAMS, EARLY_RELEASE)")
    block_n, tw, warps = meta["BLOCK_N"], meta["TW"], meta["num_warps"]
    tiles = runtime.cdiv(n, block_n)
    programs = min(tiles, meta["PROGRAMS"]) if meta["PROGRAMS"] > 0 else tiles
    if norm is None:
        r = nw = xo = ho = y
        eps, stride_rm, stride_om, norm_spec = 0.0, 0, 0, (0, 16, None)
    else:
        r, nw, eps, xo, ho = norm
        if k > NORM_MAX_K:
            raise ValueError(f"the norm folded into the packed GEMV holds a row of x in registers: K <= {NORM_MAX_K}, "
                             f"got K = {k}")
        if r is None:
            r = ho = x2
        stride_rm, stride_om = r.stride(0), xo.stride(0)
        norm_spec = (1 if norm[0] is None else 2, runtime.next_power_of_2(k), nw.dtype)
    spec = (x2.dtype, None if bias is None else bias.dtype, y.dtype, runtime.next_power_of_2(m), block_n, tw,
            n % block_n == 0, kw % tw == 0 and 8 * kw == k, bool(pdl) and not runtime.INTERPRET,
            bool(meta["EARLY_RELEASE"])) + norm_spec
    args = (kernel_view(x2), w.words, w.scales, w.global_scale, _bias_arg(bias, y), kernel_view(y),
            m, n, k, kw, x2.stride(0), x2.stride(1), y.stride(0), w.rows_per_global(),
            kernel_view(r), kernel_view(nw), kernel_view(xo), kernel_view(ho), eps, stride_rm, stride_om)
    key = (spec, warps, m, n, k, kw, args[10], args[11], args[12], args[13], args[0].data_ptr() & 15,
           w.words.data_ptr() & 15, w.scales.data_ptr() & 15, w.global_scale.data_ptr() & 15,
           args[4].data_ptr() & 15, args[5].data_ptr() & 15, stride_rm, stride_om, args[14].data_ptr() & 15,
           args[15].data_ptr() & 15, args[16].data_ptr() & 15, args[17].data_ptr() & 15)
    PACKED_GEMV.launch(kernel)((programs,), key, args, _packed_gemv_constexprs(*spec), warps, 1, spec[8])
    return y


#: Largest K the norm folded into the packed GEMV takes (it reduces a row of x at once, as the norm kernel does).
NORM_MAX_K = 8192


@functools.lru_cache(maxsize=1024)
def _packed_gemv_constexprs(x_dtype, bias_dtype, y_dtype, block_m, block_n, tw, even_n, even_k, use_pdl, early,
                    norm=0, norm_d=16, nw_dtype=None) -> dict:
    """The packed GEMV's constexprs for one specialisation (cached: built once, not per call)."""
    flags = kernel_constexprs(x_dtype, bias_dtype, y_dtype, runtime.INTERPRET, True)
    return dict(HAS_BIAS=flags["HAS_BIAS"], X_DTYPE=flags["X_DTYPE"], BIAS_DTYPE=flags["BIAS_DTYPE"],
                OUT_DTYPE=flags["OUT_DTYPE"], BLOCK_M=block_m, BLOCK_N=block_n, TW=tw, EVEN_N=even_n, EVEN_K=even_k,
                USE_PDL=use_pdl, EARLY_RELEASE=early, INTERPRET=runtime.INTERPRET, NORM=norm, NORM_D=norm_d,
                NW_DTYPE=runtime.TORCH_TO_TL[nw_dtype] if nw_dtype is not None else tl.float32)
