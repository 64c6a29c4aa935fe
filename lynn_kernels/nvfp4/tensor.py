"""``NVFP4Tensor``: packed codes, block scales and a global scale, plus the two checkpoint layouts.

Layout in memory (the same as on disk for both ModelOpt and compressed-tensors):

* ``codes``  uint8 ``[..., K/2]``: element ``2j`` in the low nibble of byte ``j``, element ``2j+1`` in the high one;
* ``scales`` float8_e4m3fn ``[..., K/16]``: one scale per 16 consecutive elements along K;
* ``global_scale`` fp32, ModelOpt convention (**multiply**): shape ``()`` for one tensor, or a prefix of the leading
  dims (``[E]`` once experts are stacked);
* value ``= e2m1(code) * float(scale) * global_scale``.

A tensor quantised with the compressed-tensors recipe, or loaded from that layout, also keeps
``recip_global_scale``, compressed-tensors' own divide-convention ``G``: ``1 / (1 / G)`` is not always ``G`` in fp32,
so ``to_compressed_tensors`` writes the kept value back rather than a reciprocal of a reciprocal.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from .spec import BLOCK, reciprocal


def _shape(t: torch.Tensor) -> tuple:
    return tuple(t.shape)


class NVFP4Tensor:
    """An NVFP4-quantised ``[..., K]`` tensor. Build one with :func:`lynn_kernels.nvfp4.quantize` or a loader.

    Example::

        q = quantize(w)                      # w: bf16 [N, K]
        w_hat = dequantize(q)                # bf16 [N, K]
        sd = q.to_modelopt()                 # {"weight": uint8, "weight_scale": fp8, "weight_scale_2": fp32}
        q2 = NVFP4Tensor.from_modelopt(**sd)
    """

    __slots__ = ("codes", "scales", "global_scale", "recip_global_scale")

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor,
                 recip_global_scale: torch.Tensor | None = None, *, names: tuple = ("codes", "scales", "global_scale")):
        _validate(codes, scales, global_scale, names)
        if recip_global_scale is not None and (tuple(recip_global_scale.shape) != tuple(global_scale.shape)
                                               or recip_global_scale.dtype != torch.float32):
            raise ValueError(f"recip_global_scale must be fp32 of global_scale's shape {tuple(global_scale.shape)}, "
                             f"got {recip_global_scale.dtype} {tuple(recip_global_scale.shape)}")
        self.codes = codes.contiguous()
        self.scales = scales.contiguous()
        self.global_scale = global_scale.contiguous()
        self.recip_global_scale = None if recip_global_scale is None else recip_global_scale.contiguous()

    # -- shape ---------------------------------------------------------------------------------------------------
    @property
    def shape(self) -> torch.Size:
        """The logical (dequantised) shape ``[..., K]``."""
        return torch.Size((*self.codes.shape[:-1], self.codes.shape[-1] * 2))

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def dim(self) -> int:
        return self.codes.dim()

    @property
    def nbytes(self) -> int:
        """Bytes held: codes + block scales + global scale(s)."""
        return self.codes.numel() + self.scales.numel() + 4 * self.global_scale.numel()

    def __repr__(self) -> str:
        g = self.global_scale
        gs = f"{g.item():.6g}" if g.dim() == 0 else f"[{g.numel()} scales]"
        return f"NVFP4Tensor(shape={tuple(self.shape)}, global_scale={gs}, device={self.device})"

    def to(self, device) -> "NVFP4Tensor":
        r = self.recip_global_scale
        return NVFP4Tensor(self.codes.to(device), self.scales.to(device), self.global_scale.to(device),
                           None if r is None else r.to(device))

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """Same as :func:`lynn_kernels.nvfp4.dequantize` (runs on the current backend)."""
        from . import dequantize

        return dequantize(self, dtype)

    # -- experts -------------------------------------------------------------------------------------------------
    def rows_per_global(self) -> int:
        """How many ``[..., K]`` rows share one global scale (all of them when the global scale is a scalar)."""
        lead = self.codes.shape[:-1]
        rows = 1
        for d in lead[self.global_scale.dim():]:
            rows *= d
        return rows

    @classmethod
    def stack(cls, tensors: Sequence["NVFP4Tensor"]) -> "NVFP4Tensor":
        """Stack same-shaped tensors along a new leading (expert) dim; each keeps its own global scale."""
        if len(tensors) == 0:
            raise ValueError("NVFP4Tensor.stack needs at least one tensor")
        shapes = {tuple(t.shape) for t in tensors}
        if len(shapes) != 1:
            raise ValueError(f"NVFP4Tensor.stack needs tensors of one shape, got {sorted(shapes)}")
        g_shapes = {tuple(t.global_scale.shape) for t in tensors}
        if len(g_shapes) != 1:
            raise ValueError(f"NVFP4Tensor.stack needs global scales of one shape, got {sorted(g_shapes)}")
        recips = None                                  # keep compressed-tensors' G where any part has one
        if any(t.recip_global_scale is not None for t in tensors):
            recips = torch.stack([reciprocal(t.global_scale) if t.recip_global_scale is None else t.recip_global_scale
                                  for t in tensors])
        return cls(torch.stack([t.codes for t in tensors]), torch.stack([t.scales for t in tensors]),
                   torch.stack([t.global_scale for t in tensors]), recips)

    def __getitem__(self, index: int) -> "NVFP4Tensor":
        """Select along the leading dim (e.g. one expert of a stack)."""
        if not isinstance(index, int):
            raise TypeError("NVFP4Tensor supports integer indexing along the leading dim only")
        if self.dim() < 2:
            raise IndexError("cannot index a 1-D NVFP4Tensor: its elements are packed in pairs")
        def pick(t):
            return None if t is None else (t[index] if t.dim() > 0 else t)

        return NVFP4Tensor(self.codes[index], self.scales[index], pick(self.global_scale),
                           pick(self.recip_global_scale))

    def __len__(self) -> int:
        return self.codes.shape[0]

    # -- checkpoint layouts ----------------------------------------------------------------------------------------
    @classmethod
    def from_modelopt(cls, weight: torch.Tensor, weight_scale: torch.Tensor,
                      weight_scale_2: torch.Tensor, *, prefix: str = "") -> "NVFP4Tensor":
        """From ModelOpt tensors: ``weight`` uint8 ``[N, K/2]``, ``weight_scale`` fp8 ``[N, K/16]``,
        ``weight_scale_2`` fp32 (``amax / 2688``, multiply). ``prefix`` only names the tensors in errors."""
        names = tuple(prefix + n for n in ("weight", "weight_scale", "weight_scale_2"))
        return cls(weight, weight_scale, _checkpoint_global(weight_scale_2, names[2], weight), names=names)

    def to_modelopt(self) -> dict:
        """ModelOpt tensors for one layer: ``{"weight", "weight_scale", "weight_scale_2"}``."""
        return {"weight": self.codes, "weight_scale": self.scales, "weight_scale_2": self.global_scale}

    @classmethod
    def from_compressed_tensors(cls, weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                                weight_global_scale: torch.Tensor, *, prefix: str = "") -> "NVFP4Tensor":
        """From compressed-tensors tensors; ``weight_global_scale`` is the reciprocal (``2688 / amax``, divide)."""
        names = tuple(prefix + n for n in ("weight_packed", "weight_scale", "weight_global_scale"))
        gs = _checkpoint_global(weight_global_scale, names[2], weight_packed)
        return cls(weight_packed, weight_scale, reciprocal(gs), gs, names=names)

    def to_compressed_tensors(self) -> dict:
        """compressed-tensors tensors: ``{"weight_packed", "weight_scale", "weight_global_scale"}`` (reciprocal,
        shape ``[1]`` for one tensor as llm-compressor writes it)."""
        gs = reciprocal(self.global_scale) if self.recip_global_scale is None else self.recip_global_scale.clone()
        return {"weight_packed": self.codes, "weight_scale": self.scales,
                "weight_global_scale": gs.reshape(1) if gs.dim() == 0 else gs}

    @classmethod
    def from_state_dict(cls, state_dict: Mapping[str, torch.Tensor], prefix: str) -> "NVFP4Tensor":
        """Load ``<prefix>.weight*`` from a safetensors state dict, detecting the layout by its tensor names."""
        p = prefix + "." if prefix and not prefix.endswith(".") else prefix
        if p + "weight_packed" in state_dict:
            need = ("weight_packed", "weight_scale", "weight_global_scale")
            missing = [p + n for n in need if p + n not in state_dict]
            if missing:
                raise KeyError(f"compressed-tensors layout at {prefix!r} is missing {missing}")
            return cls.from_compressed_tensors(*(state_dict[p + n] for n in need), prefix=p)
        if p + "weight_scale_2" in state_dict:
            need = ("weight", "weight_scale", "weight_scale_2")
            missing = [p + n for n in need if p + n not in state_dict]
            if missing:
                raise KeyError(f"ModelOpt layout at {prefix!r} is missing {missing}")
            return cls.from_modelopt(*(state_dict[p + n] for n in need), prefix=p)
        raise KeyError(f"no NVFP4 weight at {prefix!r}: expected {p}weight_packed (compressed-tensors) or "
                       f"{p}weight_scale_2 (ModelOpt)")


def _checkpoint_global(g: torch.Tensor, name: str, like: torch.Tensor) -> torch.Tensor:
    """A checkpoint's global scale: fp32, finite, > 0; a one-element tensor becomes 0-d."""
    if not isinstance(g, torch.Tensor):
        g = torch.tensor(g)
    if g.dtype != torch.float32:
        raise TypeError(f"{name} has dtype {g.dtype}; expected torch.float32")
    if g.numel() == 1:
        g = g.reshape(())
    if not bool(torch.isfinite(g).all()) or not bool((g > 0).all()):
        raise ValueError(f"{name} must be finite and > 0, got {g.flatten()[:8].tolist()}")
    return g.to(like.device)


def _validate(codes, scales, global_scale, names=("codes", "scales", "global_scale")) -> None:
    n_codes, n_scales, n_global = names
    for name, t in zip(names, (codes, scales, global_scale)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if codes.dtype != torch.uint8:
        raise TypeError(f"{n_codes} has dtype {codes.dtype}; expected torch.uint8 (two E2M1 codes per byte)")
    if scales.dtype != torch.float8_e4m3fn:
        raise TypeError(f"{n_scales} has dtype {scales.dtype}; expected torch.float8_e4m3fn (one per {BLOCK} "
                        f"elements)")
    if global_scale.dtype != torch.float32:
        raise TypeError(f"{n_global} has dtype {global_scale.dtype}; expected torch.float32")
    if codes.dim() < 1 or codes.numel() == 0:
        raise ValueError(f"{n_codes} must be a non-empty [..., K/2] tensor, got shape {_shape(codes)}")
    half_k = codes.shape[-1]
    if (2 * half_k) % BLOCK != 0:
        raise ValueError(f"{n_codes} has shape {_shape(codes)}: K = {2 * half_k} is not a multiple of {BLOCK}")
    want = (*codes.shape[:-1], 2 * half_k // BLOCK)
    if _shape(scales) != want:
        raise ValueError(f"{n_scales} has shape {_shape(scales)}; {n_codes} {_shape(codes)} (K = {2 * half_k}) "
                         f"needs scales of shape {want}")
    if _shape(global_scale) != _shape(codes)[: global_scale.dim()] or global_scale.dim() >= codes.dim():
        raise ValueError(f"{n_global} has shape {_shape(global_scale)}; expected () or a prefix of the leading "
                         f"dims {_shape(codes)[:-1]}")
    devices = {codes.device, scales.device, global_scale.device}
    if len(devices) != 1:
        raise ValueError(f"{n_codes}, {n_scales} and {n_global} are on different devices: "
                         f"{sorted(map(str, devices))}")
