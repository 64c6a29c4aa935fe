"""The executable spec of the W4A16 product: dequantise the weight, then one fp32 matmul.

``y = x @ W^T (+ bias)`` with ``W`` an :class:`~lynn_kernels.nvfp4.NVFP4Tensor` ``[N, K]``: every weight is
``e2m1(code) * float(scale) * global_scale`` (docs/nvfp4.md), the product and the bias are fp32, and the result is
rounded once to ``x``'s dtype. The kernels never build ``W`` in memory; this reference does, which is why it is the
spec and not the fast path.
"""

from __future__ import annotations

import torch

from ..nvfp4 import reference as nvfp4_reference
from .packed import PackedNVFP4, unpack
from .spec import GEMV_MAX_M, check_linear_args


def nvfp4_linear(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K]`` (bf16 / fp16 / fp32) times NVFP4 ``w [N, K]`` transposed, plus ``bias [N]`` -> ``[..., N]``
    in ``x.dtype``, computed in fp32 from the dequantised weight."""
    check_linear_args(x, w, bias)
    if isinstance(w, PackedNVFP4):
        w = unpack(w)                                                  # exact: the same values
    w32 = nvfp4_reference.dequantize(w, torch.float32)                # [N, K]
    y = x.reshape(-1, x.shape[-1]).float() @ w32.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], w32.shape[0])


def nvfp4_gemv(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`nvfp4_linear` for at most 16 rows of ``x``, as the GEMV kernel takes."""
    check_linear_args(x, w, bias)
    if x.numel() // x.shape[-1] > GEMV_MAX_M:
        raise ValueError(f"nvfp4_gemv takes at most {GEMV_MAX_M} rows of x, got M = {x.numel() // x.shape[-1]} "
                         f"(x {tuple(x.shape)}); use nvfp4_gemm or nvfp4_linear")
    return nvfp4_linear(x, w, bias)


#: The GEMM takes any M: its spec is the product itself.
nvfp4_gemm = nvfp4_linear


def norm_linear(x: torch.Tensor, norm_weight: torch.Tensor, w, eps: float = 1e-6, *,
                residual: torch.Tensor | None = None) -> tuple:
    """A pre-norm projection: ``xn = rmsnorm(x (+ residual), norm_weight, eps)`` (:func:`lynn_kernels.rmsnorm`),
    then ``y = nvfp4_linear(xn, w)``. Returns ``(y, xn)``, or ``(y, xn, h)`` with ``residual`` (``h = x +
    residual``, the residual stream after the add)."""
    from ..norm import reference as norm_reference
    from ..norm import spec as norm_spec

    check_linear_args(x, w, None)
    norm_spec.check_rmsnorm(x, norm_weight, eps, residual, None, None, "norm_weight")
    return norm_spec.norm_then(norm_reference.rmsnorm, lambda xn: nvfp4_linear(xn, w), x, norm_weight, eps,
                               residual)
