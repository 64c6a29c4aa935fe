"""What the routed experts' prefill kernels (:mod:`.triton_experts`) and decode kernels
(:mod:`.triton_experts_decode`) share: the ``@triton.jit`` helpers that find expert ``e``'s weights in a stack
(:func:`_expert`), give its global scales (:func:`_w13_global`, :func:`_w2_global`) and round the intermediate ``h``
as it is stored (:func:`_round_h`); and on the host, a weight's kernel arguments (:class:`_Weights`,
:func:`_weights`), the kernels' constexprs (:func:`_flags`) and tiles (:func:`_tiles`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .. import runtime
from ..runtime import kernel_view, round_to_dtype
from ..triton_shared import kernel_constexprs
from . import spec

# ---------------------------------------------------------------------------------------------------------------
# kernel helpers


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
def _w13_global(g_ptr, e, offs_n, mask_n, I, G_STRIDE, BLOCK_N: tl.constexpr, NO_G: tl.constexpr,
                G_PER_ROW: tl.constexpr, ACC_UNIT: tl.constexpr):
    """The global scales of expert ``e``'s gate rows ``offs_n`` and up rows ``I + offs_n``, fp32 ``[BLOCK_N]`` each,
    times ``ACC_UNIT`` (undoing the power of two the weight decode leaves): 1 with ``NO_G`` (float weights); one per
    row with ``G_PER_ROW`` (``g[e * 2I + row]``: per-shard gate / up scales); else one, ``g[e * G_STRIDE]``."""
    if NO_G:
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
def _w2_global(g_ptr, offs, NO_G: tl.constexpr, ACC_UNIT: tl.constexpr):
    """``g[offs]`` (one expert's, or ``[TOP_K_P2]`` experts') times ``ACC_UNIT``; 1 with ``NO_G`` (float weights:
    ``g_ptr`` unused)."""
    if NO_G:
        g = (offs * 0).to(tl.float32) + 1.0
    else:
        g = tl.load(g_ptr + offs) * ACC_UNIT
    return g


# ---------------------------------------------------------------------------------------------------------------
# host side


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
