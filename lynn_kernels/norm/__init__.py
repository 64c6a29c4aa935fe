"""RMSNorm of the Qwen3-Next / Qwen3.5 decoder (every layer norm and the final norm), fused with the residual add.

Public op (its torch reference, same signature, is :func:`.reference.rmsnorm`; checks in :mod:`.spec`; math in
docs/norm.md):

* ``rmsnorm(x, weight, eps=1e-6, *, residual=None, out=None, residual_out=None)`` -> ``y``, or ``(y, h)`` with a
  residual.

HF's ``Qwen3NextRMSNorm`` / ``Qwen3_5RMSNorm`` store a zero-centred weight and multiply by ``1 + w``, in fp32, before
the cast to x's dtype. Bad arguments raise ``TypeError`` (wrong type or dtype) or ``ValueError`` (wrong shape, value,
layout or device), naming the tensor, on every backend.

Example (one pre-norm decoder step)::

    from lynn_kernels.norm import rmsnorm
    x = rmsnorm(hidden, layer.input_layernorm.weight, 1e-6)                    # the first layer: no residual yet
    ...
    x, residual = rmsnorm(attn_out, layer.post_attention_layernorm.weight, 1e-6, residual=residual)
"""

from .. import runtime
from . import reference, spec
from .spec import MAX_D
from .triton_rmsnorm import rmsnorm_triton


@runtime.op(reference=reference.rmsnorm)
def rmsnorm(x, weight, eps=1e-6, *, residual=None, out=None, residual_out=None):
    """``(x * rsqrt(mean(x^2) + eps) * (1 + weight)).to(x.dtype)`` over the last dim, optionally after ``x + residual``.

    Args:
        x: ``[..., D]`` bf16 / fp16 / fp32, the last dim contiguous (any row stride; otherwise copied), ``D <= 16384``.
        weight: ``[D]``, any float dtype; zero-centred (HF initialises it to 0): the scale is ``1 + weight``, in fp32.
        eps: a positive float (``0`` would give NaN on an all-zero row).
        residual: ``x``'s shape and dtype, or None. Given, the op first forms ``h = x + residual`` as torch adds in
            that dtype (the exact sum rounded once) and normalises ``h``.
        out: a contiguous tensor of x's shape and dtype that receives ``y``; it must share no memory with the inputs.
        residual_out: likewise for ``h`` (only with ``residual``); it may be ``residual`` itself (in-place update of
            the residual stream, as a CUDA-graph decode step wants).

    Returns:
        ``y`` in x's dtype without ``residual``; ``(y, h)`` with it (``out`` / ``residual_out`` when given).

    Example::

        y, residual = rmsnorm(h, w, 1e-6, residual=residual, residual_out=residual)   # residual updated in place
    """
    return rmsnorm_triton(x, weight, eps, residual=residual, out=out, residual_out=residual_out)


__all__ = ["rmsnorm", "reference", "spec", "MAX_D"]
