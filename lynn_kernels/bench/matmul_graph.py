"""Packed W4A16 matmul timed the way a decoder runs it: kernel time from CUDA-graph replay.

For each decoder projection shape and M, in one process: ours on the packed layout (:func:`lynn_kernels.matmul.pack`
weights; the packed GEMV for M <= 2, the tensor-core GEMV to 16, the GEMM above, dequantise-then-cuBLAS from 128 rows;
and the decode kernels each on its own, the packed GEMV for M <= 2 and the tensor-core GEMV for M <= 16, and the two
prefill paths, the packed GEMM kernel and dequantise-then-cuBLAS, from M = 64), ours on the checkpoint layout
(the previous kernels), cuBLAS bf16 ``F.linear`` on the dequantised weights, and a pure-read Triton kernel of the
packed weight's bytes (the per-shape ceiling). Each is captured as one graph of ``S`` consecutive calls on ``S``
rotating weight sets (together past 3x the L2), replayed, and divided by ``S``; the Python call time
(``do_bench`` of one eager call) is reported beside it. Validation: every provider's output against the fp32
reference of the same weights.

``matmul.chain`` replays the projections of decoder layers (the Qwen3.5-35B-A3B Gated DeltaNet layer's
``in_proj_qkv``, ``in_proj_z``, ``out_proj``) as one graph: on the packed GEMV with and without programmatic
dependent launch, and on the tensor-core GEMV, against the copy bandwidth.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..matmul import nvfp4_linear, pack, reference
from ..matmul.triton_matmul import launch_dequant_gemm, launch_gemm, launch_gemv
from ..matmul.triton_packed import launch_packed_gemv
from ..metrics import compare
from ..nvfp4 import dequantize, quantize
from .harness import Result, derive, graph_us, l2_bytes, time_fn, validated
from .registry import register

#: (label, N, K): the decoder's projection shapes (Qwen3.5-35B-A3B and Qwen3-Next-80B-A3B) and two squares.
SHAPES = [
    ("attn q+gate / GDN qkv 2048->8192", 8192, 2048),
    ("GDN z 2048->4096", 4096, 2048),
    ("o / out proj 4096->2048", 2048, 4096),
    ("shared expert down 512->2048", 2048, 512),
    ("Qwen3-Next qkvz 2048->12288", 12288, 2048),
    ("lm head 2048->248320", 248320, 2048),
    ("square 8192", 8192, 8192),
]
MS = [1, 2, 4, 8, 16, 64, 512, 4096]
#: The GEMM rows (M >= 64) run on the first three shapes only (each autotunes per layout: minutes of device time).
GEMM_SHAPES = 3
QUICK = SHAPES[:1], [1, 4, 16]
NAN = float("nan")


@triton.jit
def _read_kernel(src_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """Read ``n`` int32 words once (16-byte loads, evict-first) and write one word per program."""
    pid = tl.program_id(0)
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    for i in range(ITERS):
        offs = (pid * ITERS + i) * BLOCK + tl.arange(0, BLOCK)
        acc ^= tl.load(src_ptr + offs, mask=offs < n, other=0, eviction_policy="evict_first")
    tl.store(out_ptr + pid, tl.xor_sum(acc, 0))


@triton.jit
def _empty_kernel(x_ptr):
    pass


def empty_launch(t: torch.Tensor) -> None:
    """Launch a one-program kernel that does nothing (the host cost of a bare Triton launch)."""
    _empty_kernel[(1,)](t)


def pure_read(buf: torch.Tensor, out: torch.Tensor) -> None:
    n = buf.numel()
    block, iters = 2048, 4
    _read_kernel[(triton.cdiv(n, block * iters),)](buf, out, n, BLOCK=block, ITERS=iters, num_warps=4)


def n_sets(bytes_per_set: int) -> int:
    """How many distinct copies of a ``bytes_per_set`` operand to rotate through so that together they exceed the
    L2 three times over (each call then reads from HBM): 8 to 64."""
    return max(8, min(64, math.ceil(3 * l2_bytes() / bytes_per_set)))


def _row(provider, label, dims, us, nbytes, flops, check, note, ceilings) -> Result:
    r = Result("matmul.graph", provider, label, dims, us / 1e3, us / 1e3, us / 1e3, bytes=nbytes, flops=flops,
               ceiling="read_gbps", validation=check, note=note)
    return derive(r, ceilings)


@register("matmul.graph")
def bench_graph(ceilings, quick: bool = False) -> list[Result]:
    shapes, ms = QUICK if quick else (SHAPES, MS)
    rows = []
    for si, (label, n, k) in enumerate(shapes):
        w_bytes = n * k // 2 + n * k // 16
        sets = []
        for _ in range(n_sets(w_bytes)):
            q = quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16))
            sets.append((q, pack(q)))
        wb = dequantize(sets[0][0])                             # cuBLAS: one bf16 copy, rotated below
        bsets = [wb] + [dequantize(s[0]) for s in sets[1:n_sets(2 * n * k)]]
        flat = [torch.cat([p.words.view(-1), p.scales.view(torch.int32).view(-1)]) for _, p in sets]
        sink = torch.empty(1 << 20, dtype=torch.int32, device="cuda")
        for m in ms:
            if m >= 64 and si >= GEMM_SHAPES:
                continue
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            want = reference.nvfp4_linear(x, sets[0][0])
            dims = {"M": m, "N": n, "K": k}
            act = 2 * m * (k + n)
            y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            providers = [
                ("lynn packed", [lambda p=p: nvfp4_linear(x, p) for _, p in sets], lambda: nvfp4_linear(x, sets[0][1]),
                 w_bytes + act),
                ("lynn checkpoint layout", [lambda q=q: nvfp4_linear(x, q) for q, _ in sets],
                 lambda: nvfp4_linear(x, sets[0][0]), w_bytes + act),
                ("cuBLAS bf16", [lambda b=b: torch.nn.functional.linear(x, b) for b in bsets],
                 lambda: torch.nn.functional.linear(x, wb), 2 * n * k + act),
            ]
            if m <= 2:          # the two decode kernels on their own, whatever the dispatch picks
                providers.append(("lynn packed GEMV", [lambda p=p: launch_packed_gemv(x, p, None, y)
                                                       for _, p in sets],
                                  lambda: launch_packed_gemv(x, sets[0][1], None, y), w_bytes + act))
            if m <= 16:
                providers.append(("lynn packed tensor-core GEMV", [lambda p=p: launch_gemv(x, p, None, y)
                                                                   for _, p in sets],
                                  lambda: launch_gemv(x, sets[0][1], None, y), w_bytes + act))
            if m >= 64:         # the two prefill paths on their own, whatever the dispatch picks
                providers.append(("lynn packed GEMM kernel", [lambda p=p: launch_gemm(x, p, None, y) for _, p in sets],
                                  lambda: launch_gemm(x, sets[0][1], None, y), w_bytes + act))
                providers.append(("lynn dequantise + cuBLAS", [lambda p=p: launch_dequant_gemm(x, p, None, y)
                                                               for _, p in sets],
                                  lambda: launch_dequant_gemm(x, sets[0][1], None, y), w_bytes + act))
            if m == 1:
                providers.append(("pure read (same bytes)", [lambda f=f: pure_read(f, sink) for f in flat], None,
                                  w_bytes))
            for provider, calls, one, nbytes in providers:
                check = validated(compare(one(), want)) if one is not None else None
                us = graph_us(calls)
                note = f"graph of {len(calls)} calls on rotating weights"
                rows.append(_row(f"{provider} (graph)", label, dims, us, nbytes, 2 * m * n * k, check, note,
                                 ceilings))
                if one is not None and m in (1, 16, 4096):
                    med, _, _ = time_fn(one)
                    rows.append(_row(f"{provider} (call)", label, dims, med * 1e3, nbytes, 2 * m * n * k, check,
                                     "do_bench of one eager Python call", ceilings))
            y = None
        sets = bsets = flat = None
        torch.cuda.empty_cache()
    return rows


@register("matmul.chain")
def bench_chain(ceilings, quick: bool = False) -> list[Result]:
    """A Gated DeltaNet layer's three projections (M = 1) for 10 layers in one graph, with and without PDL."""
    shapes = [(8192, 2048), (4096, 2048), (2048, 4096)]
    layers = 4 if quick else 10
    ws = [[pack(quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16))) for n, k in shapes]
          for _ in range(layers)]
    x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    ys = [[torch.empty(1, n, device="cuda", dtype=torch.bfloat16) for n, _ in shapes] for _ in range(layers)]
    h = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    nbytes = layers * sum(n * k // 2 + n * k // 16 for n, k in shapes)
    rows = []
    for kind, pdl in (("GEMV", False), ("GEMV", True), ("tensor-core GEMV", False)):
        calls = []

        def launch(xx, w, y, pdl=pdl, kind=kind):
            return launch_packed_gemv(xx, w, None, y, pdl=pdl) if kind == "GEMV" else launch_gemv(xx, w, None, y)

        for li in range(layers):
            a, b, c = ws[li]
            calls.append(lambda a=a, y=ys[li][0], f=launch: f(x, a, y))
            calls.append(lambda b=b, y=ys[li][1], f=launch: f(x, b, y))
            calls.append(lambda c=c, y=ys[li][2], f=launch: f(h, c, y))
        us = graph_us(calls) * len(calls)
        check = validated(compare(ys[0][2], reference.nvfp4_linear(h, ws[0][2])))
        r = Result("matmul.chain", f"lynn packed {kind} chain{' + PDL' if pdl else ''} (graph)",
                   f"{layers} GDN layers x (qkv, z, out_proj)", {"M": 1, "layers": layers, "kernels": len(calls)},
                   us / 1e3, us / 1e3, us / 1e3, bytes=nbytes, ceiling="copy_gbps", validation=check,
                   note="one graph of all the layers' projections")
        rows.append(derive(r, ceilings))
    return rows


__all__ = ["bench_graph", "bench_chain", "pure_read", "empty_launch", "SHAPES", "MS"]
