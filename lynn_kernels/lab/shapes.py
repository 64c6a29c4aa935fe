"""The inputs an op meets in a model's decode step or prefill, by name: ``"qwen3.5-35b-a3b:decode"``.

A name is ``<model>:<phase>``: the model one of :data:`MODELS` (the published sizes, as ``lynn_model``'s presets
hold them; a test keeps the two equal), the phase ``decode`` (batch 1), ``decode-b8`` (batch 8) or ``prefill``
(2,048 tokens). Each :class:`Shape` makes fresh random inputs on the GPU (``make()``, called once per rotating set)
and knows the bytes the op must move at the least and, where there is one, the vendor baseline on the same inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass(frozen=True)
class Dims:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    gdn_k_heads: int
    gdn_v_heads: int
    gdn_head_dim: int
    experts: int
    top_k: int
    expert_inter: int
    shared_inter: int


#: The published sizes (their release configs; lynn_model.config.PRESETS holds the same numbers).
MODELS = {
    "qwen3.5-35b-a3b": Dims(2048, 16, 2, 256, 16, 32, 128, 256, 8, 512, 512),
    "qwen3-next-80b-a3b": Dims(2048, 16, 2, 256, 16, 32, 128, 512, 10, 512, 512),
    "tiny-qwen3.5-moe": Dims(64, 4, 2, 32, 2, 4, 16, 8, 2, 32, 48),
}
PHASES = {"decode": 1, "decode-b8": 8, "prefill": 2048}


@dataclass
class Shape:
    label: str
    dims: dict
    make: Callable[[], tuple[tuple, dict, dict]]    #: fresh ``(args, kwargs, aux)``: the op's, and the baseline's extra
    bytes: Callable[[tuple, dict], int] | None = None   #: least bytes moved; None: every tensor in and out once
    baseline: tuple[str, Callable] | None = None    #: (provider, fn(*args, **kwargs, **aux)) on the same inputs
    flops: int = 0
    extra: dict = field(default_factory=dict)


def parse(name: str) -> tuple[Dims, int, str, str]:
    """``(dims, rows, model, phase)`` of ``model:phase``; a ``ValueError`` listing the choices otherwise."""
    model, _, phase = name.partition(":")
    if model not in MODELS or phase not in PHASES:
        raise ValueError(f"unknown shapes {name!r}: expected <model>:<phase> with model one of {', '.join(MODELS)} "
                         f"and phase one of {', '.join(PHASES)} (e.g. qwen3.5-35b-a3b:decode)")
    return MODELS[model], PHASES[phase], model, phase


def _dev() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _projections(d: Dims) -> list[tuple[str, int, int]]:
    """(label, N, K) of the NVFP4 projections of one layer of each kind (the packed GEMV's decode shapes)."""
    gdn_qkv = 2 * d.gdn_k_heads * d.gdn_head_dim + d.gdn_v_heads * d.gdn_head_dim
    return [("GDN in_proj_qkv", gdn_qkv, d.hidden),
            ("GDN in_proj_z", d.gdn_v_heads * d.gdn_head_dim, d.hidden),
            ("GDN out_proj", d.hidden, d.gdn_v_heads * d.gdn_head_dim),
            ("attn q+gate", 2 * d.heads * d.head_dim, d.hidden),
            ("attn o_proj", d.hidden, d.heads * d.head_dim),
            ("shared expert gate_up", 2 * d.shared_inter, d.hidden)]


def rmsnorm_shapes(d: Dims, m: int) -> list[Shape]:
    def make():
        x = torch.randn(m, d.hidden, device=_dev(), dtype=torch.bfloat16)
        r = torch.randn(m, d.hidden, device=_dev(), dtype=torch.bfloat16)
        w = 0.1 * torch.randn(d.hidden, device=_dev(), dtype=torch.bfloat16)
        return (x, w, 1e-6), {"residual": r}, {}

    def torch_rmsnorm(x, w, eps, residual):
        h = x + residual
        return torch.nn.functional.rms_norm(h.float(), (h.shape[-1],), 1.0 + w.float(), eps).to(h.dtype), h

    return [Shape(f"{m}x{d.hidden} + residual", {"M": m, "D": d.hidden}, make,
                  baseline=("torch F.rms_norm (eager)", torch_rmsnorm))]


def linear_shapes(d: Dims, m: int) -> list[Shape]:
    from ..matmul import pack
    from ..nvfp4 import dequantize, quantize

    out = []
    for label, n, k in _projections(d):
        def make(n=n, k=k):
            q = quantize(torch.randn(n, k, device=_dev(), dtype=torch.bfloat16))
            x = torch.randn(m, k, device=_dev(), dtype=torch.bfloat16)
            return (x, pack(q)), {}, {"w_bf16": dequantize(q)}        # the same weights in bf16

        out.append(Shape(f"{label} {k}->{n}", {"M": m, "N": n, "K": k}, make,
                         bytes=lambda a, kw, n=n, k=k: n * k // 2 + n * k // 16 + 2 * a[0].shape[0] * (n + k),
                         baseline=("cuBLAS bf16 F.linear", lambda x, w, w_bf16: torch.nn.functional.linear(x, w_bf16)),
                         flops=2 * m * n * k))
    return out


def quantize_shapes(d: Dims, m: int) -> list[Shape]:
    out = []
    for label, n, k in _projections(d)[:3]:
        def make(n=n, k=k):
            return (torch.randn(n, k, device=_dev(), dtype=torch.bfloat16),), {}, {}

        out.append(Shape(f"{label} {n}x{k}", {"N": n, "K": k}, make))
    return out


def dequantize_shapes(d: Dims, m: int) -> list[Shape]:
    from ..nvfp4 import quantize

    out = []
    for label, n, k in _projections(d)[:3]:
        def make(n=n, k=k):
            return (quantize(torch.randn(n, k, device=_dev(), dtype=torch.bfloat16)),), {}, {}

        out.append(Shape(f"{label} {n}x{k}", {"N": n, "K": k}, make))
    return out


def moe_block_shapes(d: Dims, m: int) -> list[Shape]:
    from ..nvfp4 import quantize

    E, top_k, H, inter = d.experts, d.top_k, d.hidden, d.expert_inter
    weights: dict = {}

    def make():
        if not weights:                                # the experts once (hundreds of MB); x rotates the routing
            dev = _dev()
            weights["w13"] = quantize(torch.randn(E, 2 * inter, H, device=dev, dtype=torch.bfloat16) * 0.05)
            weights["w2"] = quantize(torch.randn(E, H, inter, device=dev, dtype=torch.bfloat16) * 0.05)
            weights["router"] = torch.randn(E, H, device=dev, dtype=torch.bfloat16) * 0.05
        x = torch.randn(m, H, device=_dev(), dtype=torch.bfloat16)
        return (x, weights["router"], weights["w13"], weights["w2"]), {"top_k": top_k}, {}

    expert = 3 * inter * H * 9 // 16                     # one expert's NVFP4 bytes (codes + scales)
    return [Shape(f"{m} tokens, {E} experts top-{top_k}, {H}->{inter}", {"M": m, "E": E, "top_k": top_k, "H": H,
                                                                            "I": inter}, make,
                  bytes=lambda a, kw: min(E, m * top_k) * expert + 4 * m * H,
                  flops=2 * m * top_k * 3 * inter * H)]


#: op name -> shape builder(dims, rows)
BUILDERS: dict[str, Callable[[Dims, int], list[Shape]]] = {
    "norm.rmsnorm": rmsnorm_shapes,
    "matmul.nvfp4_linear": linear_shapes,
    "nvfp4.quantize": quantize_shapes,
    "nvfp4.dequantize": dequantize_shapes,
    "moe.moe_block": moe_block_shapes,
}


def shapes_for(op: str, name: str) -> list[Shape]:
    """The shapes op ``op`` meets in ``name`` (``model:phase``)."""
    d, m, _, _ = parse(name)
    if op not in BUILDERS:
        raise ValueError(f"no named shapes for {op} yet (they exist for {', '.join(BUILDERS)}); pass "
                         "race(..., shapes=[Shape(label, dims, make)]) with inputs of your own")
    return BUILDERS[op](d, m)


__all__ = ["Dims", "MODELS", "PHASES", "Shape", "BUILDERS", "parse", "shapes_for"]
