"""H200: does asking L2 for the next kernel's weights ahead of time make a chain of decode GEMVs faster?

A decode GEMV reads 5-15 MB: 40-110 KB an SM, about two round trips of DRAM latency, so its first loads wait as long
as the rest take. The weights are static: any kernel before it may ask L2 for them. Here a second stream in the same
CUDA graph issues ``cp.async.bulk.prefetch.L2`` (one instruction a chunk; sm_90) for kernel ``i + d``'s weights when
kernel ``i`` starts (an event recorded on the main stream before it), while the main stream runs the GEMVs with
programmatic dependent launch as the decoder does.

1. One GEMV shape at a time (M = 1, packed GEMV + PDL) on rotating weight sets past 3x the L2: plain, prefetched one call
   ahead (two chunk sizes), and "warm" (the same weight every call: it stays in L2, the upper bound of the idea);
   a pure read of the same bytes beside them. Every variant's output compared bit for bit with the plain launch.
2. ``matmul.chain``'s 30 GEMVs (10 Gated DeltaNet layers' qkv, z, out_proj, M = 1, PDL): prefetch 1, 2 and 3
   kernels ahead, a whole layer ahead, and warm (one layer's weights for all ten).

Writes ``$OUT/l2_prefetch.json`` and prints a table.

    PYTHONPATH=. python3 experiments/l2_prefetch.py
"""

import json
import os

import torch
import triton
import triton.language as tl
from gdn_chain import gdn_chain  # noqa: E402  (experiments/, on the path when run as a script)

from lynn_kernels.bench.harness import l2_bytes, provenance
from lynn_kernels.bench.matmul_graph import n_sets, pure_read
from lynn_kernels.matmul import pack
from lynn_kernels.matmul.triton_packed import launch_packed_gemv
from lynn_kernels.metrics import bit_mismatches
from lynn_kernels.nvfp4 import quantize

OUT = os.environ.get("OUT", "out")
os.makedirs(OUT, exist_ok=True)
BF16 = torch.bfloat16
res = {"provenance": provenance("python3 experiments/l2_prefetch.py"), "l2_bytes": l2_bytes(), "single": [],
       "chain": []}


def save():
    json.dump(res, open(os.path.join(OUT, "l2_prefetch.json"), "w"), indent=1)


@triton.jit
def _bulk_prefetch_kernel(base_ptr, nbytes, CHUNK: tl.constexpr, PER_PROG: tl.constexpr):
    """Ask L2 for ``nbytes`` from ``base_ptr`` (16-byte aligned, a multiple of 16): each lane one ``CHUNK``."""
    idx = tl.program_id(0) * PER_PROG + tl.arange(0, PER_PROG)
    off = idx.to(tl.int64) * CHUNK
    size = tl.where(off < nbytes, tl.minimum(nbytes - off, CHUNK), 0).to(tl.int32)
    ptrs = base_ptr.to(tl.pointer_type(tl.uint8)) + off
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ptrs, size], dtype=tl.int32, is_pure=False, pack=1)


def prefetch(tensors, chunk=16384, per_prog=32):
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        grid = triton.cdiv(nbytes, chunk * per_prog)
        _bulk_prefetch_kernel[(grid,)](t, nbytes, CHUNK=chunk, PER_PROG=per_prog, num_warps=1)


def wbufs(p):
    return [p.words, p.scales]


def graph_us(calls, reps=20, side_calls=None, ahead=1):
    """Median us per call of ``calls`` in one graph; with ``side_calls`` (one a call), a second stream runs
    ``side_calls[i + ahead]`` when call ``i`` starts."""
    main = torch.cuda.Stream()
    side = torch.cuda.Stream()
    main.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(main):
        for c in calls:
            c()
        if side_calls:
            for c in side_calls:
                c()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=main):
        if side_calls:
            ev = torch.cuda.Event()
            ev.record(main)
            side.wait_event(ev)
            with torch.cuda.stream(side):
                for j in range(min(ahead, len(side_calls))):
                    side_calls[j]()
        for i, c in enumerate(calls):
            if side_calls and i + ahead < len(side_calls):
                ev = torch.cuda.Event()
                ev.record(main)
                side.wait_event(ev)
                with torch.cuda.stream(side):
                    side_calls[i + ahead]()
            c()
        if side_calls:
            main.wait_stream(side)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / len(calls))
    times.sort()
    return times[len(times) // 2]



torch.manual_seed(0)
# 1. one shape at a time
SHAPES = [("GDN qkv|z fused 2048->12288", 12288, 2048), ("GDN qkv 2048->8192", 8192, 2048),
          ("o / out proj 4096->2048", 2048, 4096), ("shared expert down 512->2048", 2048, 512)]
lines = []
for label, n, k in SHAPES:
    wbytes = n * k // 2 + n * k // 16
    sets = [pack(quantize(torch.randn(n, k, device="cuda", dtype=BF16))) for _ in range(n_sets(wbytes))]
    x = torch.randn(1, k, device="cuda", dtype=BF16)
    ys = [torch.empty(1, n, device="cuda", dtype=BF16) for _ in sets]
    want = launch_packed_gemv(x, sets[0], None, torch.empty(1, n, device="cuda", dtype=BF16))
    gemv = [lambda p=p, y=y: launch_packed_gemv(x, p, None, y, pdl=True) for p, y in zip(sets, ys)]
    row = {"shape": label, "N": n, "K": k, "bytes": wbytes, "sets": len(sets)}
    row["plain_us"] = graph_us(gemv)
    row["bit_mismatches_plain"] = int(bit_mismatches(ys[0], want))
    for chunk in (16384, 4096):
        pf = [lambda p=p, c=chunk: prefetch(wbufs(p), c) for p in sets]
        for y in ys:
            y.zero_()
        row[f"prefetch1_chunk{chunk}_us"] = graph_us(gemv, side_calls=pf, ahead=1)
        row[f"bit_mismatches_prefetch_chunk{chunk}"] = int(bit_mismatches(ys[0], want))
    row["warm_us"] = graph_us([lambda y=y: launch_packed_gemv(x, sets[0], None, y, pdl=True) for y in ys])
    flat = [torch.cat([p.words.view(-1), p.scales.view(torch.int32).view(-1)]) for p in sets]
    sink = torch.empty(1 << 20, dtype=torch.int32, device="cuda")
    row["pure_read_us"] = graph_us([lambda f=f: pure_read(f, sink) for f in flat])
    res["single"].append(row)
    save()
    del sets, flat
    torch.cuda.empty_cache()

# 2. the chain
shapes, layers, ws, x, h, ys, nbytes = gdn_chain()            # experiments/gdn_chain.py


def chain(wsets):
    calls, flat_w = [], []
    for li in range(layers):
        for j in range(3):
            calls.append(lambda w=wsets[li][j], y=ys[li][j], xx=(h if j == 2 else x):
                         launch_packed_gemv(xx, w, None, y, pdl=True))
            flat_w.append(wsets[li][j])
    return calls, flat_w


want = [[launch_packed_gemv(h if j == 2 else x, ws[li][j], None, torch.empty_like(ys[li][j]))
         for j in range(3)] for li in range(layers)]


def mismatches():
    return int(sum(bit_mismatches(ys[li][j], want[li][j]) for li in range(layers) for j in range(3)))


calls, flat_w = chain(ws)
crow = {"kernels": len(calls), "bytes": nbytes}
crow["plain_us"] = graph_us(calls) * len(calls)
crow["bit_mismatches_plain"] = mismatches()
for ahead in (1, 2, 3):
    for yl in ys:
        for y in yl:
            y.zero_()
    pf = [lambda w=w: prefetch(wbufs(w)) for w in flat_w]
    crow[f"prefetch{ahead}_us"] = graph_us(calls, side_calls=pf, ahead=ahead) * len(calls)
    crow[f"bit_mismatches_prefetch{ahead}"] = mismatches()
# a whole layer ahead: when a layer's first GEMV starts, ask for the next layer's three weights
pf_layer = []
for i in range(len(calls)):
    li, j = divmod(i, 3)
    pf_layer.append((lambda li=li: prefetch([b for w in ws[li] for b in wbufs(w)])) if j == 0 else (lambda: None))
crow["prefetch_layer_us"] = graph_us(calls, side_calls=pf_layer, ahead=3) * len(calls)
warm_calls, _ = chain([ws[0]] * layers)
crow["warm_us"] = graph_us(warm_calls) * len(warm_calls)
res["chain"].append(crow)
save()

print(f"\n{'shape':32s} {'plain':>7s} {'pf16K':>7s} {'pf4K':>7s} {'warm':>7s} {'read':>7s}  us, M = 1, packed GEMV + PDL")
for r in res["single"]:
    print(f"{r['shape']:32s} {r['plain_us']:7.2f} {r['prefetch1_chunk16384_us']:7.2f} {r['prefetch1_chunk4096_us']:7.2f}"
          f" {r['warm_us']:7.2f} {r['pure_read_us']:7.2f}  mism {r['bit_mismatches_plain']}"
          f"/{r['bit_mismatches_prefetch_chunk16384']}/{r['bit_mismatches_prefetch_chunk4096']}")
c = res["chain"][0]
print(f"chain of {c['kernels']} ({c['bytes'] / 1e6:.1f} MB): " + ", ".join(
    f"{k[:-3]} {v:.1f} us ({c['bytes'] / v / 1e3:,.0f} GB/s)" for k, v in c.items() if k.endswith("_us")))
print("mismatches", {k: v for k, v in c.items() if k.startswith("bit_")})
