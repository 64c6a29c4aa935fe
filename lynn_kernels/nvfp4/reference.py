"""The executable spec of NVFP4 in plain torch: quantise and dequantise, both recipes, bit for bit.

Every rounding step below is one IEEE fp32 operation (or a cast) in the order the recipe's own code performs it,
because that order decides the last bit; docs/nvfp4.md walks through it. Divisions are tensor by tensor: CUDA
divides by a Python number through its reciprocal, which is not correctly rounded.
"""

from __future__ import annotations

import torch

from .spec import (
    BLOCK,
    E2M1_MAX,
    E4M3_MAX,
    E4M3_MIN,
    check_out_dtype,
    check_recipe,
    check_weight,
    e2m1_table,
    recipe_globals,
)
from .tensor import NVFP4Tensor


def encode_e2m1(q: torch.Tensor) -> torch.Tensor:
    """fp32 values (already divided by their scale) -> 4-bit codes, round to nearest, ties to even.

    Thresholds 0.25 | 0.75 | 1.25 | 1.75 | 2.5 | 3.5 | 5: a tie goes to the code with an even mantissa
    (0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4). Beyond 6 saturates to 6; NaN gives 6 as ModelOpt's
    searchsorted does. The sign bit is ``q < 0``, so -0.1 gives 0x8 and -0.0 gives 0x0.
    """
    a = q.abs()
    mag = ((a > 0.25).to(torch.uint8) + (a >= 0.75).to(torch.uint8) + (a > 1.25).to(torch.uint8)
           + (a >= 1.75).to(torch.uint8) + (a > 2.5).to(torch.uint8) + (a >= 3.5).to(torch.uint8)
           + (a > 5.0).to(torch.uint8))
    mag = torch.where(torch.isnan(a), torch.full_like(mag, 7), mag)
    return mag | ((q < 0).to(torch.uint8) << 3)


def pack_nibbles(nib: torch.Tensor) -> torch.Tensor:
    """``[..., K]`` codes -> ``[..., K/2]`` bytes, even element in the low nibble."""
    return nib[..., 0::2] | (nib[..., 1::2] << 4)


def unpack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """``[..., K/2]`` bytes -> ``[..., K]`` codes (inverse of :func:`pack_nibbles`)."""
    return torch.stack([codes & 0xF, codes >> 4], dim=-1).flatten(-2)


def _round_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype).to(torch.float32)


def _per_block(g: torch.Tensor, n_lead: int) -> torch.Tensor:
    """A global scale of shape ``()`` or a prefix of the leading dims, shaped to broadcast over ``[..., K/16]``."""
    return g.reshape(g.shape + (1,) * (n_lead - g.dim()) + (1,))


def quantize(w: torch.Tensor, global_scale=None, recipe: str = "modelopt", *,
             recip_global_scale=None) -> NVFP4Tensor:
    """Quantise a float ``[..., K]`` tensor (``K % 16 == 0``) to NVFP4.

    ``global_scale`` (ModelOpt convention, multiply) defaults to the recipe's choice from ``amax(|w|)``; pass one to
    share a scale across tensors, or ``recip_global_scale`` to give compressed-tensors' own ``G`` exactly (``1/(1/G)``
    is not always ``G`` in fp32). ``recipe`` picks whose fp32 arithmetic to reproduce bit for bit:

    * ``"modelopt"`` (0.47): ``s = bam / (6 g)``, zero -> 1.0, clamped to [2^-9, 448], to E4M3; ``q = w / (s g)``;
    * ``"compressed-tensors"``: with ``G = 1/g`` (or its own ``2688/amax``): ``s = G * (bam/6 in w.dtype)``, to
      E4M3, zero -> 0.125; ``q = w / (s / G)``.
    """
    check_weight(w)
    check_recipe(recipe)
    lead = tuple(w.shape[:-1])
    g, big_g = recipe_globals(w, global_scale, recipe, recip_global_scale)
    if (global_scale is not None or recip_global_scale is not None) and not bool(torch.isfinite(w).all()):
        raise ValueError("w contains NaN or Inf; NVFP4 cannot represent them")

    blocks = w.unflatten(-1, (-1, BLOCK))                              # [..., K/16, 16] in w.dtype
    bam = blocks.abs().amax(-1)                                        # [..., K/16], exact in w.dtype
    if recipe == "modelopt":
        g_b = _per_block(g, len(lead))
        s = bam.float() / (6.0 * g_b)
        s = torch.where(s == 0, torch.ones_like(s), s)
        s8 = s.clamp(E4M3_MIN, E4M3_MAX).to(torch.float8_e4m3fn)
        divisor = s8.float() * g_b
    else:
        big_g_b = _per_block(big_g, len(lead))                         # the stored weight_global_scale
        six = torch.tensor(E2M1_MAX, dtype=torch.float32, device=w.device)
        s = big_g_b * _round_to(bam.float() / six, w.dtype)
        s8 = s.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        s8 = torch.where(s8.float() == 0, torch.full_like(s8, 0.125), s8)
        divisor = s8.float() / big_g_b
    q = blocks.float() / divisor.unsqueeze(-1)                         # [..., K/16, 16]
    codes = pack_nibbles(encode_e2m1(q).flatten(-2))
    return NVFP4Tensor(codes, s8, g, recip_global_scale=big_g)


def dequantize(q: NVFP4Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """NVFP4 -> ``dtype`` ``[..., K]``: ``e2m1(code) * (float(scale) * global)``, one fp32 rounding per product,
    then a round-to-nearest-even cast to ``dtype``."""
    if not isinstance(q, NVFP4Tensor):
        raise TypeError(f"q must be an NVFP4Tensor, got {type(q).__name__}")
    check_out_dtype(dtype)
    block_scale = q.scales.float() * _per_block(q.global_scale, q.codes.dim() - 1)   # [..., K/16]
    values = e2m1_table(q.device)[unpack_nibbles(q.codes).long()]      # [..., K]
    out = values.unflatten(-1, (-1, BLOCK)) * block_scale.unsqueeze(-1)
    return out.flatten(-2).to(dtype)
