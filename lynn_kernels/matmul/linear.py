"""``NVFP4Linear``: a drop-in ``nn.Linear`` whose weight is an :class:`~lynn_kernels.nvfp4.NVFP4Tensor`, and
``quantize_linears`` to swap every eligible Linear of a model (quantisation as a module swap, as in gpt-fast)."""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn

from ..nvfp4 import BLOCK, NVFP4Tensor, quantize


class NVFP4Linear(nn.Module):
    """``y = x @ W^T + b`` with ``W`` NVFP4 ``[out_features, in_features]`` in the checkpoint layout (4-bit codes two
    a byte, E4M3 block scales, fp32 global scale, registered as buffers so ``state_dict`` and ``.to(device)`` carry
    them) and ``b`` kept in its original dtype. Inputs ``[..., in_features]`` in bf16 / fp16 / fp32; the output has
    the input's dtype.

    Example::

        lin = NVFP4Linear.from_linear(nn.Linear(2048, 512, bias=False, dtype=torch.bfloat16))
        y = lin(x)                                   # x: bf16 [T, 2048] -> bf16 [T, 512]
    """

    def __init__(self, weight: NVFP4Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        if not isinstance(weight, NVFP4Tensor):
            raise TypeError(f"weight must be a 2-D NVFP4Tensor [out, in] (quantise it with lynn_kernels.quantize), "
                            f"got {type(weight).__name__}")
        if weight.dim() != 2:
            raise ValueError(f"weight must be a 2-D NVFP4Tensor [out, in], got shape {tuple(weight.shape)}")
        self.out_features, self.in_features = weight.shape
        self.register_buffer("codes", weight.codes)
        self.register_buffer("scales", weight.scales)
        self.register_buffer("global_scale", weight.global_scale)
        if bias is not None and not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
        if bias is not None and tuple(bias.shape) != (self.out_features,):
            raise ValueError(f"bias has shape {tuple(bias.shape)}; expected [{self.out_features}]")
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def _apply(self, fn, recurse=True):
        """``.to(device)`` moves the quantised weight; ``.to(dtype)`` / ``.half()`` (which cast every floating-point
        buffer, float8 included) leave its format alone: the scales stay E4M3, the global scale fp32."""
        keep = {name: self._buffers[name] for name in ("codes", "scales", "global_scale")}
        super()._apply(fn, recurse)
        for name, old in keep.items():
            new = self._buffers[name]
            if new.dtype != old.dtype:
                self._buffers[name] = old.to(new.device)
        return self

    @property
    def weight(self) -> NVFP4Tensor:
        return NVFP4Tensor(self.codes, self.scales, self.global_scale)

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: str = "modelopt", global_scale=None) -> "NVFP4Linear":
        """Quantise ``linear.weight`` (``in_features % 16 == 0``) with :func:`lynn_kernels.quantize`."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear must be an nn.Linear, got {type(linear).__name__}")
        if linear.in_features % BLOCK:
            raise ValueError(f"in_features = {linear.in_features} is not a multiple of {BLOCK}; NVFP4 needs whole "
                             f"blocks of {BLOCK} along K")
        w = quantize(linear.weight.detach(), global_scale, recipe)
        return cls(w, None if linear.bias is None else linear.bias.detach())

    @classmethod
    def _from_named(cls, name: str, linear: nn.Linear, recipe: str) -> "NVFP4Linear":
        """:meth:`from_linear` with the layer's name in any error (quantize_linears)."""
        try:
            return cls.from_linear(linear, recipe)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{name}.weight: {e}") from e

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from . import nvfp4_linear

        return nvfp4_linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def quantize_linears(module: nn.Module, skip: Iterable[str] | Callable[[str, nn.Linear], bool] = (),
                     recipe: str = "modelopt") -> list[str]:
    """Replace every ``nn.Linear`` of ``module`` (in place) by an :class:`NVFP4Linear`; returns the names swapped.

    A Linear is left alone when its qualified name matches ``skip`` (a name, or a suffix after a dot, e.g.
    ``"lm_head"``; or a predicate ``skip(name, linear)``), or when ``in_features`` is not a multiple of 16.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
    if callable(skip):
        skipped = skip
    else:
        if isinstance(skip, str):
            names = (skip,)
        else:
            try:
                names = tuple(skip)
            except TypeError:
                raise TypeError(f"skip must be names (str or an iterable of str) or a predicate (name, linear) -> "
                                f"bool, got {type(skip).__name__}") from None
            if not all(isinstance(n, str) for n in names):
                raise TypeError(f"skip must hold module names (str), got {[type(n).__name__ for n in names]}")

        def skipped(name, _lin):
            return any(name == s or name.endswith("." + s) for s in names)

    swapped = []
    for name, child in list(module.named_modules()):
        for attr, lin in list(child.named_children()):
            full = f"{name}.{attr}" if name else attr
            if type(lin) is nn.Linear and lin.in_features % BLOCK == 0 and not skipped(full, lin):
                setattr(child, attr, NVFP4Linear._from_named(full, lin, recipe))
                swapped.append(full)
    return swapped
