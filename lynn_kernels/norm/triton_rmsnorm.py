"""Zero-centred RMSNorm in Triton, fused with the residual add before it: a block of rows per program.

It follows HF's ``Qwen3_5RMSNorm`` op by op in fp32: ``h = x + residual`` rounded once to x's dtype (torch's add),
``rstd = 1 / sqrt(mean(h^2) + eps)`` (IEEE square root and division: one row costs one of each), then
``(h * rstd) * (1 + w)`` and one round to nearest even into x's dtype (:func:`~lynn_kernels.runtime.cast_output`).
Only the order of the sum of squares differs from torch's, so outputs agree to within one step of x's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import runtime
from ..runtime import cast_output, kernel_view, pdl_enter, to_float32
from ..triton_shared import residual_rows, row_rstd
from . import spec
from .spec import MAX_D


@triton.jit
def _rmsnorm_kernel(
    x_ptr, r_ptr, w_ptr, y_ptr, h_ptr,
    R, D, eps,
    stride_xr, stride_rr, stride_yr, stride_hr,
    X_DTYPE: tl.constexpr, W_DTYPE: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, INTERPRET: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """``y = rmsnorm(h) * (1 + w)`` with ``h = x`` or ``h = x + r`` (then also stored to ``h_ptr``)."""
    pdl_enter(USE_PDL)
    pid_r = tl.program_id(0)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    mask_r = offs_r < R
    mask_d = offs_d < D
    mask = mask_r[:, None] & mask_d[None, :]
    rows = offs_r[:, None].to(tl.int64)
    if HAS_RESIDUAL:
        h = residual_rows(x_ptr + rows * stride_xr, r_ptr + rows * stride_rr, offs_d[None, :], mask, X_DTYPE,
                          True, INTERPRET)                                           # [BLOCK_R, BLOCK_D]
        tl.store(h_ptr + rows * stride_hr + offs_d[None, :], cast_output(h, X_DTYPE, INTERPRET), mask=mask)
    else:
        h = residual_rows(x_ptr + rows * stride_xr, x_ptr, offs_d[None, :], mask, X_DTYPE, False, INTERPRET)
    w1 = 1.0 + to_float32(tl.load(w_ptr + offs_d, mask=mask_d, other=0), W_DTYPE, INTERPRET)   # [BLOCK_D], fp32
    rstd = row_rstd(h, D, eps)
    y = (h * rstd[:, None]) * w1[None, :]                     # HF: (x * rsqrt(.)) * (1 + w), in fp32, then the cast
    tl.store(y_ptr + rows * stride_yr + offs_d[None, :], cast_output(y, X_DTYPE, INTERPRET), mask=mask)


RMSNORM = runtime.Kernel("norm.rmsnorm", _rmsnorm_kernel)


def rmsnorm_triton(x, weight, eps=1e-6, *, residual=None, out=None, residual_out=None):
    """Host side of :func:`lynn_kernels.norm.rmsnorm`: checks, allocates the missing outputs, launches."""
    spec.check_devices(x=x)             # first: the overlap checks read the others' addresses once on x's device
    D = spec.check_rmsnorm(x, weight, eps, residual, out, residual_out)
    if D > MAX_D:
        raise ValueError(f"x's last dim D={D} is unsupported: the kernel holds a row in registers, D <= {MAX_D}")
    spec.check_devices(x=x, weight=weight, residual=residual, out=out, residual_out=residual_out)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if residual is not None and residual_out is None:
        residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    launch_rmsnorm(x, weight, float(eps), residual, out, residual_out)
    return out if residual is None else (out, residual_out)


def _rows(t: torch.Tensor, d: int) -> torch.Tensor:
    return spec.last_dim_contiguous(t.reshape(-1, d))


def block_sizes(D: int) -> tuple[int, int, int]:
    """``(BLOCK_R, BLOCK_D, num_warps)``: whole rows, a few short rows per program, more warps for long rows."""
    BLOCK_D = max(16, runtime.next_power_of_2(D))
    if runtime.INTERPRET:                                  # fewer, larger programs: the interpreter pays per program
        return max(1, min(64, 4096 // BLOCK_D)), BLOCK_D, 4
    BLOCK_R = max(1, min(16, 2048 // BLOCK_D))
    return BLOCK_R, BLOCK_D, min(16, max(4, BLOCK_R * BLOCK_D // 512))


def launch_rmsnorm(x, weight, eps: float, residual, out: torch.Tensor, residual_out, *, kernel=None) -> None:
    """Launch only, into contiguous ``out`` (and ``residual_out`` when ``residual`` is given) of x's shape; ``kernel``
    (a ``@triton.jit`` function with ``_rmsnorm_kernel``'s parameters) replaces the shipped kernel."""
    D = x.shape[-1]
    xr = _rows(x, D)
    R = xr.shape[0]
    if R == 0:
        return
    if weight.dtype not in runtime.TORCH_TO_TL:        # fp64, fp8: HF reads weight.float() too
        weight = weight.float()
    weight = weight.contiguous()
    yr = out.view(R, D)
    if residual is not None:
        rr, hr = _rows(residual, D), residual_out.view(R, D)
    else:
        rr, hr = xr, yr                                 # not read, not written (HAS_RESIDUAL=False)
    BLOCK_R, BLOCK_D, num_warps = block_sizes(D)
    RMSNORM.current(kernel)[(runtime.cdiv(R, BLOCK_R),)](
        kernel_view(xr), kernel_view(rr), kernel_view(weight), kernel_view(yr), kernel_view(hr), R, D, eps,
        xr.stride(0), rr.stride(0), yr.stride(0), hr.stride(0),
        X_DTYPE=runtime.TORCH_TO_TL[x.dtype], W_DTYPE=runtime.TORCH_TO_TL[weight.dtype],
        HAS_RESIDUAL=residual is not None, BLOCK_R=BLOCK_R, BLOCK_D=BLOCK_D, num_warps=num_warps,
        **runtime.kernel_flags(), **runtime.pdl_flags())
