"""The executable spec of the Qwen3-Next / Qwen3.5 RMSNorm in plain torch: HF's ``Qwen3_5RMSNorm`` op by op, with
the residual add of a pre-norm decoder in front.

Same arguments, same return values as :func:`lynn_kernels.norm.rmsnorm` (math: docs/norm.md).
"""

from __future__ import annotations

import torch

from . import spec


def rmsnorm(x, weight, eps=1e-6, *, residual=None, out=None, residual_out=None):
    """``y = (x_f * rsqrt(mean(x_f^2) + eps) * (1 + w_f)).to(x.dtype)`` over the last dim, zero-centred weight.

    With ``residual``: ``h = x + residual`` (torch's add in x's dtype: one rounding of the exact sum), then
    ``y = rmsnorm(h)``; returns ``(y, h)``. Without: returns ``y``. ``out`` / ``residual_out`` receive ``y`` / ``h``.
    """
    spec.check_rmsnorm(x, weight, eps, residual, out, residual_out)
    h = x if residual is None else x + residual
    hf = h.float()
    y = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    y = (y * (1.0 + weight.float())).to(x.dtype)                # (1 + w) multiplies in fp32, before the cast
    if out is not None:
        y = out.copy_(y)
    if residual is None:
        return y
    if residual_out is not None:
        h = residual_out.copy_(h)
    return y, h
