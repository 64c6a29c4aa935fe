"""NVFP4 constants and the input checks shared by the reference and the kernels.

The format (docs/nvfp4.md): FP4 E2M1 elements, a block of 16 consecutive elements along K shares one FP8 E4M3
scale, one FP32 global scale per tensor multiplies everything. Two elements per byte, the even element in the
low nibble.
"""

from __future__ import annotations

import warnings

import torch

BLOCK = 16                     #: elements per block scale
E2M1_MAX = 6.0                 #: largest E2M1 magnitude
E4M3_MAX = 448.0               #: largest FP8 E4M3FN magnitude (no inf; 0x7F / 0xFF are NaN)
E4M3_MIN = 2.0**-9             #: smallest FP8 E4M3FN magnitude; ModelOpt clamps block scales into [E4M3_MIN, E4M3_MAX]
GLOBAL_DIVISOR = E2M1_MAX * E4M3_MAX   #: 2688: ``global = amax / 2688`` puts the largest block scale at 448

#: Magnitudes of the 8 positive E2M1 codes; code | 0x8 is the negative.
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

#: The two quantiser recipes in the wild. They agree on the format and differ in the last fp32 bit of the scale
#: arithmetic, which moves a few percent of block scales on bf16 weights (docs/nvfp4.md, "Two recipes").
RECIPES = ("modelopt", "compressed-tensors")

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def e2m1_table(device=None) -> torch.Tensor:
    """fp32 ``[16]``: the value of each 4-bit code (0x8 is -0.0)."""
    pos = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=device)
    return torch.cat([pos, -pos])


def check_weight(w: torch.Tensor, name: str = "w") -> None:
    """Raise a clear error unless ``w`` is a non-empty float ``[..., K]`` tensor with ``K % 16 == 0``."""
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(w).__name__}")
    if w.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} has dtype {w.dtype}; NVFP4 quantises bfloat16, float16 or float32 tensors")
    if w.dim() < 1:
        raise ValueError(f"{name} must have at least one dimension [..., K], got a 0-d tensor")
    if w.numel() == 0:
        raise ValueError(f"{name} is empty (shape {tuple(w.shape)}); there is nothing to quantise")
    k = w.shape[-1]
    if k % BLOCK != 0:
        raise ValueError(f"{name} has K = {k} (shape {tuple(w.shape)}); NVFP4 needs K to be a multiple of "
                         f"{BLOCK}, one E4M3 scale per {BLOCK} elements")


def check_recipe(recipe: str) -> None:
    if recipe not in RECIPES:
        raise ValueError(f"recipe={recipe!r}: expected one of {RECIPES}")


def check_out_dtype(dtype: torch.dtype) -> None:
    if dtype not in OUT_DTYPES:
        raise TypeError(f"dtype={dtype}: dequantize writes one of {OUT_DTYPES}")


def global_scale_tensor(global_scale, lead_shape: tuple, device, name: str = "global_scale") -> torch.Tensor:
    """Normalise a user global scale (ModelOpt convention: multiply) to an fp32 tensor.

    Accepts a Python number, a 0-d or ``[1]`` tensor (one scale for the tensor) or a tensor whose shape is a prefix
    of the leading dims ``lead_shape`` (e.g. ``[E]`` for stacked experts). Must be finite and positive.
    """
    if isinstance(global_scale, (int, float)) and not isinstance(global_scale, bool):
        global_scale = float(global_scale)
    g = torch.as_tensor(global_scale, device=device)
    if not g.dtype.is_floating_point:
        raise TypeError(f"{name} has dtype {g.dtype}; expected a float (fp32) scale")
    g = g.to(torch.float32)
    if g.dim() == 1 and g.numel() == 1 and (len(lead_shape) == 0 or lead_shape[0] != 1):
        g = g.reshape(())
    if tuple(g.shape) != tuple(lead_shape[: g.dim()]):
        raise ValueError(f"{name} has shape {tuple(g.shape)}; expected () or a prefix of the leading dims "
                         f"{tuple(lead_shape)}")
    g = g.to(device)
    if not bool(torch.isfinite(g).all()) or not bool((g > 0).all()):
        raise ValueError(f"{name} must be finite and > 0, got {g.flatten()[:8].tolist()}")
    return g.contiguous()


def default_global_scale(w: torch.Tensor, recipe: str, name: str = "w") -> torch.Tensor:
    """The global scale each recipe picks from ``amax(|w|)``, after a finiteness check, in the recipe's convention.

    * ModelOpt: ``g = amax.float() / 2688`` in fp32 (multiply).
    * compressed-tensors: ``G = 2688 / amax`` computed in ``w``'s own dtype (bf16 for bf16 weights), as fp32
      (divide); the tensor keeps ``G`` itself so that ``to_compressed_tensors`` writes it back unchanged.

    An all-zero tensor gets 1.0 (both recipes then write zero codes).
    """
    amax = w.abs().amax()
    if not bool(torch.isfinite(amax)):
        raise ValueError(f"{name} contains NaN or Inf; NVFP4 cannot represent them (found amax = {amax.item()})")
    if amax.item() == 0:
        return torch.ones((), dtype=torch.float32, device=w.device)
    if recipe == "modelopt":
        # tensor / tensor: CUDA divides by a Python number through its reciprocal, which is not correctly rounded
        return amax.float() / torch.tensor(GLOBAL_DIVISOR, dtype=torch.float32, device=w.device)
    gs_ct = (GLOBAL_DIVISOR / amax.clamp(min=torch.finfo(w.dtype).tiny)).float()   # compressed-tensors' own line
    if not bool(torch.isfinite(gs_ct)):
        warnings.warn(f"{name}: 2688 / amax overflows {w.dtype} (amax = {amax.item():.3g}), so the compressed-tensors "
                      f"recipe falls back to a global scale of 1.0 as compressed-tensors does; most block scales will "
                      f"underflow. Quantise a float32 copy, or use recipe='modelopt'", stacklevel=3)
        gs_ct = torch.ones((), dtype=torch.float32, device=w.device)
    return gs_ct


def recipe_globals(w: torch.Tensor, global_scale, recipe: str, recip_global_scale=None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(g, G)``: the multiply-convention global scale every NVFP4Tensor holds, and for compressed-tensors the
    divide-convention ``G`` its arithmetic uses (``None`` for ModelOpt). ``global_scale`` is the caller's ``g``;
    ``recip_global_scale`` is a compressed-tensors ``G`` given as is (exclusive with ``global_scale``)."""
    if recip_global_scale is not None:
        if global_scale is not None:
            raise ValueError("pass global_scale (multiply) or recip_global_scale (compressed-tensors' divide), "
                             "not both")
        if recipe != "compressed-tensors":
            raise ValueError("recip_global_scale is compressed-tensors' convention: use recipe='compressed-tensors' "
                             "or pass global_scale")
        big_g = global_scale_tensor(recip_global_scale, tuple(w.shape[:-1]), w.device, "recip_global_scale")
        return reciprocal(big_g), big_g
    if global_scale is None:
        chosen = default_global_scale(w, recipe)
        if recipe == "modelopt":
            return chosen, None
        return reciprocal(chosen), chosen
    g = global_scale_tensor(global_scale, tuple(w.shape[:-1]), w.device)
    return g, (reciprocal(g) if recipe == "compressed-tensors" else None)


def reciprocal(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 ``1 / x`` on every device (a tensor-by-tensor division)."""
    return torch.ones_like(x, dtype=torch.float32) / x.float()
