"""Argument checks shared by the RMSNorm reference and kernel, so a bad argument raises the same error, naming the
tensor, on every backend: ``TypeError`` for a wrong type or dtype, ``ValueError`` for a wrong shape, value, layout or
device (as in the rest of the project).

Layout: ``x [..., D]`` (any leading dims; the last dim contiguous, any row stride, or it is copied), ``weight [D]``,
``residual`` the shape and dtype of ``x``. The outputs ``out`` / ``residual_out``, when given, are contiguous tensors
of x's shape and dtype; ``residual_out`` may be ``residual`` (or ``x``) itself for an in-place update of the residual
stream, ``out`` must share no memory with any input or with ``residual_out``.
"""

from __future__ import annotations

import math

import torch
from torch._subclasses.fake_tensor import FakeTensor

from .. import runtime

#: dtypes of ``x``, ``residual`` and the outputs.
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: Widest row the kernel holds in registers (Qwen3-Next / Qwen3.5 hidden sizes are 1024..8192).
MAX_D = 16384


def _need_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def _dtype_names(dtypes) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def _need_like_x(name: str, t: torch.Tensor, x: torch.Tensor) -> None:
    """Shape, dtype and device of ``x``."""
    _need_tensor(name, t)
    if tuple(t.shape) != tuple(x.shape):
        raise ValueError(f"{name} must have the shape of x [..., D] = {tuple(x.shape)}, found {tuple(t.shape)}")
    if t.dtype != x.dtype:
        raise TypeError(f"{name} has dtype {t.dtype} but x has {x.dtype}; {name} must have x's dtype")
    if t.device != x.device:
        raise ValueError(f"{name} is on {t.device} but x is on {x.device}; all tensors must share a device")


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The byte range ``[start, end)`` that ``t``'s elements occupy (empty for an empty tensor)."""
    start = t.data_ptr()
    if t.numel() == 0:
        return start, start
    extent = 1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))
    return start, start + extent * t.element_size()


def _has_memory(t: torch.Tensor) -> bool:
    """Meta and fake tensors hold no elements (every one reports address 0), so they alias nothing."""
    return t.device.type != "meta" and not isinstance(t, FakeTensor)


def _interleaved(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b``, whose byte ranges intersect, still share no element: two views of one layout (shape,
    strides, element size) at an offset no difference of indices reaches, such as K and V caches interleaved page by
    page in one buffer. Decided only for layouts whose strides nest (each larger than the span of the smaller ones);
    anything else counts as sharing."""
    size = a.element_size()
    if tuple(a.shape) != tuple(b.shape) or a.stride() != b.stride() or b.element_size() != size:
        return False
    delta, misaligned = divmod(abs(a.data_ptr() - b.data_ptr()), size)
    if misaligned or delta == 0:
        return False
    dims = sorted((s, n) for n, s in zip(a.shape, a.stride()) if n > 1 and s != 0)
    reach = 0
    for s, n in dims:
        if s <= reach:
            return False
        reach += (n - 1) * s

    def hits(rest: int, i: int) -> bool:               # rest = sum of (index difference * stride) over dims[:i + 1]
        if i < 0:
            return rest == 0
        s, n = dims[i]                                 # nested: this dim's difference is rest // s or one more
        return any(abs(c) < n and hits(rest - c * s, i - 1) for c in (rest // s, rest // s + 1))

    return not hits(delta, len(dims) - 1)


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` may share an element (the same view included: see :func:`same_view`). The aliasing
    checks of every family use it."""
    if not (_has_memory(a) and _has_memory(b)) or a.device != b.device:
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a0 < b1 and b0 < a1 and not _interleaved(a, b)


def same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same elements in the same order: an in-place update through ``b`` reads and writes ``a`` one to one."""
    return (a.data_ptr() == b.data_ptr() and tuple(a.shape) == tuple(b.shape) and a.stride() == b.stride()
            and a.dtype == b.dtype)


def check_rmsnorm(x, weight, eps, residual=None, out=None, residual_out=None, weight_name: str = "weight") -> int:
    """All arguments of :func:`lynn_kernels.norm.rmsnorm`; returns D. ``weight_name``: the weight's name in the
    messages (an op that takes the norm's weight under another name says that one)."""
    _need_tensor("x", x)
    _need_tensor(weight_name, weight)
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"x has dtype {x.dtype}; expected one of {_dtype_names(FLOAT_DTYPES)}")
    if not weight.dtype.is_floating_point:
        raise TypeError(f"{weight_name} has dtype {weight.dtype}; expected a floating-point dtype")
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"x must be [..., D] with D >= 1, found shape {tuple(x.shape)}")
    D = x.shape[-1]
    if tuple(weight.shape) != (D,):
        raise ValueError(f"{weight_name} must have shape [D] = ({D},) (x's last dim), found {tuple(weight.shape)}")
    if weight.device != x.device:
        raise ValueError(f"{weight_name} is on {weight.device} but x is on {x.device}; all tensors must share a device")
    if isinstance(eps, (torch.Tensor, bool)) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps must be a positive finite Python number, got {type(eps).__name__} {eps!r}")
    if not (math.isfinite(eps) and eps > 0):                        # eps = 0 gives NaN on an all-zero row
        raise ValueError(f"eps must be a positive finite Python number (an all-zero row of x divides by "
                         f"sqrt(eps)), got {eps!r}")
    if residual is not None:
        _need_like_x("residual", residual, x)
    if residual_out is not None:
        if residual is None:
            raise ValueError("residual_out is given without residual: there is no sum x + residual to write")
        _need_like_x("residual_out", residual_out, x)
        if not residual_out.is_contiguous():
            raise ValueError(f"residual_out must be contiguous (it is written in place), found strides "
                             f"{tuple(residual_out.stride())}")
        for name, t in (("residual", residual), ("x", x)):   # the same elements in place are fine, a shift is not
            if overlaps(residual_out, t) and not same_view(residual_out, t):
                raise ValueError(f"residual_out overlaps {name} without being the same view of it; pass {name} "
                                 f"itself for an in-place update, or a separate tensor")
        if overlaps(residual_out, weight):
            raise ValueError("residual_out shares memory with weight; it must be residual, x or a separate tensor")
    if out is not None:
        _need_like_x("out", out, x)
        if not out.is_contiguous():
            raise ValueError(f"out must be contiguous (it is written in place), found strides {tuple(out.stride())}")
        for name, t in (("x", x), ("residual", residual), ("weight", weight), ("residual_out", residual_out)):
            if t is not None and overlaps(out, t):
                raise ValueError(f"out shares memory with {name}; out must be a separate tensor")
    return D


def check_devices(**tensors) -> None:
    """Every given tensor is on the device the kernels run on (the reference backend skips this); anything that is not
    a tensor is left to :func:`check_rmsnorm`."""
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor):
            runtime.check_device(name, t)


def last_dim_contiguous(t: torch.Tensor | None) -> torch.Tensor | None:
    """The kernel takes any row stride but needs the last dim contiguous."""
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


def norm_then(norm, consumer, x, weight, eps, residual):
    """A pre-norm op run as two ops: ``xn = norm(x, weight, eps, residual=residual)`` (an ``rmsnorm``), then ``y =
    consumer(xn)``; returns ``(y, xn)``, or ``(y, xn, h)`` with ``residual`` (the return of ``norm_linear`` and
    ``norm_moe_block``, whose references and unfused paths this is)."""
    got = norm(x, weight, eps, residual=residual)
    if residual is None:
        return consumer(got), got
    xn, h = got
    return consumer(xn), xn, h

