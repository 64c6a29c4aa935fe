"""Packed W4A16 matmul against cuBLAS bf16 (``torch.nn.functional.linear``) on the same weights.

For every (shape, M) cell both providers multiply the same activations by the same weights: ours reads the NVFP4
tensor, cuBLAS its bf16 dequantisation (so both compute the same product and are validated against the same fp32
reference). Weight sets rotate past L2. Each provider is timed twice:

* ``call``: ``do_bench`` medians of the Python call (what an eager loop pays; it includes the host launch cost
  when that exceeds the L2 flush between runs, which it does for short kernels on the device's CPU);
* ``kernel``: the CUDA profiler's median kernel duration (what a CUDA-graph decode step pays).

Bytes are the weight bytes read (packed codes + scales for ours, bf16 for cuBLAS) plus activations in and out; both
are held against the read ceiling. FLOPs are ``2 M N K``.
"""

from __future__ import annotations

import torch

from ..matmul import nvfp4_linear, reference
from ..metrics import compare
from ..nvfp4 import dequantize, quantize
from .harness import MAX_ERR_RATIO, Ceilings, Result, rotating, rotation, timed, validated
from .registry import register

#: (label, N, K): Qwen3.5-35B-A3B / Qwen3-Next projections (lynn_model presets) and two squares.
SHAPES = [
    ("q+gate proj 2048->8192", 8192, 2048),
    ("kv/qkv proj 2048->4096", 4096, 2048),
    ("o proj 4096->2048", 2048, 4096),
    ("lm head 2048->248320", 248320, 2048),
    ("square 4096", 4096, 4096),
    ("square 8192", 8192, 8192),
]
NAN = float("nan")
MS = [1, 2, 4, 8, 16, 32, 64, 128, 512, 4096]
QUICK = [("square 4096", 4096, 4096)], [1, 16, 4096]


@register("matmul.linear")
def bench_linear(ceilings: Ceilings, quick: bool = False) -> list[Result]:
    shapes, ms = QUICK if quick else (SHAPES, MS)
    rows = []
    for label, n, k in shapes:
        w_bytes = n * k // 2 + n * k // 16

        def make():
            q = quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16))
            return q, dequantize(q)                                   # the same weights, packed and in bf16

        sets = rotation(make, w_bytes + 2 * n * k, max_sets=16)
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            want = reference.nvfp4_linear(x, sets[0][0])
            plain = torch.nn.functional.linear(x, sets[0][1])            # the baseline: cuBLAS on the bf16 copy
            dims = {"M": m, "N": n, "K": k}
            act = 2 * m * (k + n)
            providers = (
                ("lynn nvfp4_linear", lambda q, wb: nvfp4_linear(x, q), w_bytes + act),
                ("cuBLAS bf16 F.linear", lambda q, wb: torch.nn.functional.linear(x, wb), 2 * n * k + act),
            )
            for provider, fn, nbytes in providers:
                check = validated(compare(fn(*sets[0]), want, baseline=plain))   # H200 err_ratio lynn <= 0.02
                rows += timed(Result("matmul.linear", provider, label, dims, NAN, NAN, NAN, bytes=nbytes,
                                     flops=2 * m * n * k, ceiling="read_gbps", validation=check,
                                     note=f"{len(sets)} rotating weight sets"), rotating(fn, sets), ceilings)
            post = compare(nvfp4_linear(x, sets[0][0]), want, baseline=plain)
            if not post.err_ratio <= MAX_ERR_RATIO:
                raise AssertionError(f"nvfp4_linear drifted after timing {label} M={m}: {post}")
        del sets
        torch.cuda.empty_cache()
    return rows


__all__ = ["bench_linear", "SHAPES", "MS"]
