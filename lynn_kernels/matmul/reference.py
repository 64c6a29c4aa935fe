"""The executable spec of the packed W4A16 product: dequantise the weight, then one fp32 matmul.

``y = x @ W^T (+ bias)`` with ``W`` an :class:`~lynn_kernels.nvfp4.NVFP4Tensor` ``[N, K]``: every weight is
``e2m1(code) * float(scale) * global_scale`` (docs/nvfp4.md), the product and the bias are fp32, and the result is
rounded once to ``x``'s dtype. The kernels never build ``W`` in memory; this reference does, which is why it is the
spec and not the fast path.
"""

from __future__ import annotations

import torch

from ..nvfp4 import reference as nvfp4_reference
from .checks import check_linear_args


def nvfp4_linear(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K]`` (bf16 / fp16 / fp32) times NVFP4 ``w [N, K]`` transposed, plus ``bias [N]`` -> ``[..., N]``
    in ``x.dtype``, computed in fp32 from the dequantised weight."""
    check_linear_args(x, w, bias)
    w32 = nvfp4_reference.dequantize(w, torch.float32)                # [N, K]
    y = x.reshape(-1, x.shape[-1]).float() @ w32.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], w32.shape[0])


#: The two kernels compute the same product; their references are the same spec.
nvfp4_gemv = nvfp4_linear
nvfp4_gemm = nvfp4_linear
