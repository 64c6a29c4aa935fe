"""H200: L2 prefetch of a GEMV's weights by a small kernel in the same stream, overlapped through PDL.

``experiments/l2_prefetch.py`` asked L2 for the next GEMV's weights from a second stream of the graph, and the chain
got 70% slower. Here the request is a node of the chain itself: before each GEMV a one-warp-per-chunk kernel issues
``cp.async.bulk.prefetch.L2`` for that GEMV's words and scales, lets the next kernel launch, and only then waits for
the kernel before it (programmatic dependent launch: it starts while the GEMV before it still runs, so the weights
stream in during that GEMV's tail). Nothing is read before the wait but the (static) weights' addresses.

The 30-GEMV chain of ``matmul.chain`` (10 Gated DeltaNet layers' qkv, z, out_proj, M = 1, packed GEMV + PDL): shipped,
with a prefetch node before every GEMV (16 KB and 64 KB chunks), and with one before every layer's first GEMV for
the whole layer; outputs compared bit for bit with the shipped chain.

Writes ``$OUT/l2_prefetch_inline.json``; prints a table.

    PYTHONPATH=. python3 experiments/l2_prefetch_inline.py
"""

import json
import os

import torch
import triton
import triton.language as tl
from gdn_chain import gdn_chain  # noqa: E402  (experiments/, on the path when run as a script)

from lynn_kernels.bench.harness import provenance
from lynn_kernels.bench.matmul_graph import graph_us
from lynn_kernels.matmul.triton_packed import launch_packed_gemv
from lynn_kernels.metrics import bit_mismatches

OUT = os.environ.get("OUT", "out")
os.makedirs(OUT, exist_ok=True)
BF16 = torch.bfloat16


@triton.jit
def _prefetch_node(a_ptr, a_bytes, b_ptr, b_bytes, CHUNK: tl.constexpr, PER_PROG: tl.constexpr):
    """Ask L2 for ``a_bytes`` at ``a_ptr`` and ``b_bytes`` at ``b_ptr`` (program ``p`` takes chunks ``p * PER_PROG``
    on of the two runs laid end to end), then release the next kernel and wait for the one before (PDL)."""
    idx = tl.program_id(0) * PER_PROG + tl.arange(0, PER_PROG)
    off = idx.to(tl.int64) * CHUNK
    in_a = off < a_bytes
    off_b = off - a_bytes
    size = tl.where(in_a, tl.minimum(a_bytes - off, CHUNK), tl.where(off_b < b_bytes, tl.minimum(b_bytes - off_b, CHUNK), 0))
    ptr = tl.where(in_a, a_ptr.to(tl.pointer_type(tl.uint8)) + off, b_ptr.to(tl.pointer_type(tl.uint8)) + off_b)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ptr, size.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
    tl.extra.cuda.gdc_launch_dependents()
    tl.extra.cuda.gdc_wait()


def prefetch_node(ws, chunk):
    """One node asking L2 for the words and scales of the packed weights ``ws`` (one or more; a node per pair)."""
    for w in ws:
        a, b = w.words, w.scales
        na, nb = a.numel() * 4, b.numel()
        grid = triton.cdiv(na + nb, chunk * 32)
        _prefetch_node[(grid,)](a, na, b, nb, CHUNK=chunk, PER_PROG=32, num_warps=1, launch_pdl=True)


res = {"provenance": provenance("python3 experiments/l2_prefetch_inline.py"), "chain": []}
torch.manual_seed(0)
shapes, layers, ws, x, h, ys, nbytes = gdn_chain()            # experiments/gdn_chain.py


def gemv(li, j):
    return launch_packed_gemv(h if j == 2 else x, ws[li][j], None, ys[li][j], pdl=True)


want = [[gemv(li, j).clone() for j in range(3)] for li in range(layers)]


def mismatches():
    return int(sum(bit_mismatches(ys[li][j], want[li][j]) for li in range(layers) for j in range(3)))


variants = {"shipped": [lambda li=li, j=j: gemv(li, j) for li in range(layers) for j in range(3)]}
for chunk in (16384, 65536):
    calls = []
    for li in range(layers):
        for j in range(3):
            calls.append(lambda li=li, j=j, c=chunk: (prefetch_node([ws[li][j]], c), gemv(li, j)))
    variants[f"a node before each GEMV, {chunk // 1024} KB chunks"] = calls
calls = []
for li in range(layers):
    for j in range(3):
        if j == 0:
            calls.append(lambda li=li: (prefetch_node(ws[li], 16384), gemv(li, 0)))
        else:
            calls.append(lambda li=li, j=j: gemv(li, j))
variants["a node (3 launches) before each layer"] = calls
calls = []
for li in range(layers):
    for j in range(3):
        nxt = (li, j + 1) if j < 2 else (li + 1, 0)
        if nxt[0] < layers:
            calls.append(lambda li=li, j=j, n=nxt: (prefetch_node([ws[n[0]][n[1]]], 16384), gemv(li, j)))
        else:
            calls.append(lambda li=li, j=j: gemv(li, j))
variants["a node before each GEMV for the next GEMV"] = calls
for name, calls in variants.items():
    for yl in ys:
        for y in yl:
            y.zero_()
    us = graph_us(calls) * len(calls)
    res["chain"].append({"variant": name, "us": us, "gbps": nbytes / us / 1e3, "mismatches": mismatches()})
    print(f"{name:48s} {us:7.1f} us  {nbytes / us / 1e3:6,.0f} GB/s  mism {res['chain'][-1]['mismatches']}",
          flush=True)
json.dump(res, open(os.path.join(OUT, "l2_prefetch_inline.json"), "w"), indent=1)
