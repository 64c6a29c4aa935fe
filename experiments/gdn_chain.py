"""The projection chain several experiments time: ``LAYERS`` Gated DeltaNet layers' ``in_proj_qkv``, ``in_proj_z``
and ``out_proj`` at the Qwen3.5 shape, M = 1, each layer with its own packed NVFP4 weights (so that a replay reads
them from HBM, not the L2). Imported by the experiments beside it (run from the repository root, the script's folder
is on the path)."""

import torch

from lynn_kernels.matmul import pack
from lynn_kernels.nvfp4 import quantize

SHAPES = [(8192, 2048), (4096, 2048), (2048, 4096)]
LAYERS = 10


def gdn_chain(layers: int = LAYERS) -> tuple:
    """``(shapes, layers, ws, x, h, ys, nbytes)``: ``ws[layer][j]`` packed random weights of ``SHAPES[j]``; ``x``
    ``[1, 2048]`` and ``h`` ``[1, 4096]`` bf16 inputs (``h`` feeds ``out_proj``); ``ys[layer][j]`` outputs; ``nbytes``
    the packed bytes (codes and block scales) one pass reads. Drawn from torch's global generator in this order."""
    bf16 = torch.bfloat16
    ws = [[pack(quantize(torch.randn(n, k, device="cuda", dtype=bf16))) for n, k in SHAPES] for _ in range(layers)]
    x = torch.randn(1, 2048, device="cuda", dtype=bf16)
    h = torch.randn(1, 4096, device="cuda", dtype=bf16)
    ys = [[torch.empty(1, n, device="cuda", dtype=bf16) for n, _ in SHAPES] for _ in range(layers)]
    nbytes = layers * sum(n * k // 2 + n * k // 16 for n, k in SHAPES)
    return list(SHAPES), layers, ws, x, h, ys, nbytes
