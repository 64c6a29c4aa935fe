"""Gated RMSNorm in Triton: ``weight * rmsnorm(x) * silu(z)`` over the last dim, rows in parallel.

It follows HF's ``Qwen3NextRMSNormGated`` op by op: the statistics and the normalisation in fp32, the normalised
``x`` rounded to x's dtype, the product with ``weight`` rounded to the promoted dtype of the two, the gate in fp32,
the result in x's dtype. Each rounding is one :func:`~lynn_kernels.runtime.cast_output`-style round to nearest even.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import runtime
from ..runtime import cast_output, kernel_view, pdl_enter, round_to_dtype, to_float32
from . import spec

#: Widest row held in registers.
MAX_D = 16384


@triton.jit
def _gated_rmsnorm_kernel(
    x_ptr, z_ptr, w_ptr, y_ptr,
    R, D, H, eps,
    stride_xo, stride_xh, stride_zo, stride_zh,
    X_DTYPE: tl.constexpr, Z_DTYPE: tl.constexpr, W_DTYPE: tl.constexpr, WX_DTYPE: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, INTERPRET: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """``WX_DTYPE``: the promoted dtype of weight and x, in which HF rounds ``weight * normed``. Row ``r`` of x and z
    is head ``r % H`` of token ``r // H``, each at its own strides (a strided view of a fused projection, no copy)."""
    pdl_enter(USE_PDL)
    pid_r = tl.program_id(0)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    mask_r = offs_r < R
    mask_d = offs_d < D
    mask = mask_r[:, None] & mask_d[None, :]
    tok, head = (offs_r // H).to(tl.int64), (offs_r % H).to(tl.int64)
    x = to_float32(tl.load(x_ptr + (tok * stride_xo + head * stride_xh)[:, None] + offs_d[None, :], mask=mask,
                           other=0), X_DTYPE, INTERPRET)                              # [BLOCK_R, BLOCK_D]
    z = to_float32(tl.load(z_ptr + (tok * stride_zo + head * stride_zh)[:, None] + offs_d[None, :], mask=mask,
                           other=0), Z_DTYPE, INTERPRET)
    w = to_float32(tl.load(w_ptr + offs_d, mask=mask_d, other=0), W_DTYPE, INTERPRET)   # [BLOCK_D]
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)                           # [BLOCK_R]
    normed = round_to_dtype(x * rstd[:, None], X_DTYPE, INTERPRET)                         # HF: .to(input_dtype)
    h = round_to_dtype(w[None, :] * normed, WX_DTYPE, INTERPRET)                           # weight * normed
    y = h * (z * tl.sigmoid(z))                                                       # gate in fp32
    tl.store(y_ptr + offs_r[:, None].to(tl.int64) * D + offs_d[None, :], cast_output(y, X_DTYPE, INTERPRET),
             mask=mask)


GATED_RMSNORM = runtime.Kernel("deltanet.gated_rmsnorm", _gated_rmsnorm_kernel)


def gated_rmsnorm_triton(x, z, weight, eps=1e-6):
    """Host side of :func:`lynn_kernels.deltanet.gated_rmsnorm`."""
    D = spec.check_gated_rmsnorm(x, z, weight, eps)
    if D > MAX_D:
        raise ValueError(f"x's last dim D={D} is unsupported: the kernel holds a row in registers, D <= {MAX_D}")
    spec.check_devices(x=x, z=z, weight=weight)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return launch_gated_rmsnorm(x, z, weight, float(eps), y)


def _rows(t: torch.Tensor, d: int) -> torch.Tensor:
    """``t [..., H, D]`` as ``[tokens, H, D]``: a view for a contiguous tensor and for the strided head views of a
    fused projection's output (``z`` of ``in_proj_qkvz``), a copy only for other layouts."""
    h = t.shape[-2] if t.dim() >= 2 else 1
    return spec.last_dim_contiguous(t.reshape(-1, h, d))


def launch_gated_rmsnorm(x, z, weight, eps: float, y: torch.Tensor, *, kernel=None) -> torch.Tensor:
    """Launch only, into a contiguous ``y`` of x's shape; ``kernel`` (a ``@triton.jit`` function with
    ``_gated_rmsnorm_kernel``'s parameters) replaces the shipped kernel."""
    D = x.shape[-1]
    xr, zr = _rows(x, D), _rows(z, D)
    R, H = xr.shape[0] * xr.shape[1], xr.shape[1]
    BLOCK_D = max(16, runtime.next_power_of_2(D))
    BLOCK_R = max(1, min(64, 4096 // BLOCK_D)) if runtime.INTERPRET else max(1, min(16, 2048 // BLOCK_D))
    wx_dtype = torch.promote_types(weight.dtype, x.dtype)
    GATED_RMSNORM.current(kernel)[(runtime.cdiv(R, BLOCK_R),)](
        kernel_view(xr), kernel_view(zr), kernel_view(weight.contiguous()), kernel_view(y), R, D, H, eps,
        xr.stride(0), xr.stride(1), zr.stride(0), zr.stride(1),
        X_DTYPE=runtime.TORCH_TO_TL[x.dtype], Z_DTYPE=runtime.TORCH_TO_TL[z.dtype],
        W_DTYPE=runtime.TORCH_TO_TL[weight.dtype], WX_DTYPE=runtime.TORCH_TO_TL[wx_dtype],
        BLOCK_R=BLOCK_R, BLOCK_D=BLOCK_D, **runtime.kernel_flags(), **runtime.pdl_flags())
    return y
