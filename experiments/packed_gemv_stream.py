"""H200: the packed GEMV's programs streaming several row tiles (``PROGRAMS``), programmatic dependent launch with the
early release (``EARLY_RELEASE``), and the direct launch's host cost, all against today's default in one process.

1. exactness: every variant bit-equal to the default launch on decoder shapes (M = 1, 2), the direct launch
   bit-equal to Triton's own launch path, also inside a CUDA graph;
2. M = 1 and 2 on the decoder's shapes: tiles (BLOCK_N, TW) x grids (one program per tile, or 1-4 programs per SM
   taking the tiles in turn), by CUDA-graph replay (``graph_us``), with the tensor-core GEMV and a pure read of the
   same bytes beside them;
3. the chain of 10 Gated DeltaNet layers' projections (``matmul.chain``'s): the default, with PDL (late and early
   release), and the best streaming grid per shape with and without PDL;
4. host cost: back-to-back eager calls of the packed GEMV launch and ``nvfp4_linear``, through the direct launch and
   through Triton's ``kernel[grid](...)`` path, beside an empty kernel and cuBLAS.

Writes ``$OUT/packed_gemv_stream.json`` (rewritten after every part) and prints tables.

    PYTHONPATH=. python3 experiments/packed_gemv_stream.py
"""

import json
import os

import torch

from lynn_kernels import runtime
from lynn_kernels.bench.harness import host_us, provenance
from lynn_kernels.bench.matmul_graph import empty_launch, graph_us, n_sets, pure_read
from lynn_kernels.matmul import nvfp4_linear, pack, reference
from lynn_kernels.matmul.triton_matmul import launch_gemv
from lynn_kernels.matmul.triton_packed import _PACKED_GEMV, launch_packed_gemv, packed_gemv_config
from lynn_kernels.metrics import bit_mismatches, compare
from lynn_kernels.nvfp4 import dequantize, quantize

OUT = os.environ.get("OUT", "out")
os.makedirs(OUT, exist_ok=True)
SMS = torch.cuda.get_device_properties(0).multi_processor_count
res = {"provenance": provenance("python3 experiments/packed_gemv_stream.py"), "exact": [], "sweep": [],
       "chain": [], "host_us": {}}


def save():
    json.dump(res, open(os.path.join(OUT, "packed_gemv_stream.json"), "w"), indent=1)



SHAPES = [("qkv 2048->8192", 8192, 2048), ("z 2048->4096", 4096, 2048), ("out 4096->2048", 2048, 4096),
          ("shared down 512->2048", 2048, 512), ("Qwen3-Next qkvz 2048->12288", 12288, 2048),
          ("square 8192", 8192, 8192), ("lm head 2048->248320", 248320, 2048)]
TILES = [(4, 128), (8, 128), (16, 128), (8, 64), (16, 64), (32, 64)]
GRIDS = [0, SMS, 2 * SMS, 3 * SMS, 4 * SMS]
torch.manual_seed(0)

# 1. exactness
bad = 0
for n, k in [(8192, 2048), (2048, 4096), (4097, 2064), (37, 208)]:
    q = quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16))
    p = pack(q)
    for m in (1, 2):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        base = launch_packed_gemv(x, p, None, torch.empty(m, n, device="cuda", dtype=torch.bfloat16))
        ok_ref = compare(base, reference.nvfp4_linear(x, q)).rel_l2 < 2 ** -8
        variants = {f"PROGRAMS={g}, BLOCK_N={bn}, TW={tw}, pdl={pdl}, early={early}":
                    ({"BLOCK_N": bn, "TW": tw, "PROGRAMS": g, "EARLY_RELEASE": early}, pdl)
                    for bn, tw in [(8, 64), (16, 128)] for g in (0, SMS, 3 * SMS)
                    for pdl, early in [(False, False), (True, False), (True, True)]}
        for name, (cfg, pdl) in variants.items():
            ref_cfg = {"BLOCK_N": cfg["BLOCK_N"], "TW": cfg["TW"]}
            want = launch_packed_gemv(x, p, None, torch.empty(m, n, device="cuda", dtype=torch.bfloat16), ref_cfg)
            got = launch_packed_gemv(x, p, None, torch.empty(m, n, device="cuda", dtype=torch.bfloat16), cfg, pdl=pdl)
            mism = bit_mismatches(got, want)
            bad += mism > 0
            res["exact"].append({"N": n, "K": k, "M": m, "variant": name, "mismatches": mism})
        # the direct launch against Triton's path, eager and in a graph
        runtime.DIRECT_LAUNCH = False
        _PACKED_GEMV.compiled.clear()
        slow = nvfp4_linear(x, p)
        runtime.DIRECT_LAUNCH = True
        nvfp4_linear(x, p)                                          # first call: compiles, keeps the kernel
        fast = nvfp4_linear(x, p)
        yg = torch.empty_like(fast)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            yg.copy_(nvfp4_linear(x, p))
        g.replay()
        torch.cuda.synchronize()
        for name, t in (("direct launch", fast), ("direct launch, graph", yg), ("default vs reference", None)):
            mism = (0 if ok_ref else 1) if t is None else bit_mismatches(t, slow)
            bad += mism > 0
            res["exact"].append({"N": n, "K": k, "M": m, "variant": name, "mismatches": mism})
print(f"exactness: {len(res['exact']) - bad}/{len(res['exact'])} bit-equal", flush=True)
save()

# 2. the sweep
for label, n, k in SHAPES:
    wbytes = n * k // 2 + n * k // 16
    qs = [quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16)) for _ in range(n_sets(wbytes))]
    sets = [pack(q) for q in qs]
    flat = [torch.cat([p.words.view(-1), p.scales.view(torch.int32).view(-1)]) for p in sets]
    sink = torch.empty(1 << 20, dtype=torch.int32, device="cuda")
    read_us = graph_us([lambda f=f: pure_read(f, sink) for f in flat])
    for m in (1, 2):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        want = reference.nvfp4_linear(x, qs[0])
        rows = [("default", None, graph_us([lambda p=p: launch_packed_gemv(x, p, None, y) for p in sets])),
                ("tensor-core GEMV", None, graph_us([lambda p=p: launch_gemv(x, p, None, y) for p in sets]))]
        for bn, tw in TILES:
            if m == 2 and bn > 16:
                continue
            for grid in GRIDS:
                cfg = {"BLOCK_N": bn, "TW": tw, "PROGRAMS": grid}
                try:
                    yy = launch_packed_gemv(x, sets[0], None, torch.empty_like(y), cfg)
                    if compare(yy, want).rel_l2 > 2 ** -8:
                        raise AssertionError(f"wrong: rel_l2 {compare(yy, want).rel_l2}")
                    us = graph_us([lambda p=p, cfg=cfg: launch_packed_gemv(x, p, None, y, cfg) for p in sets])
                except Exception as e:                                           # noqa: BLE001
                    print("fail", label, m, cfg, repr(e)[:160], flush=True)
                    continue
                rows.append((f"{bn}x{tw} grid {grid or 'tiles'}", cfg, us))
        best = min((r for r in rows if r[1] is not None), key=lambda r: r[2])
        for name, cfg, us in rows:
            res["sweep"].append({"shape": label, "N": n, "K": k, "M": m, "variant": name, "config": cfg, "us": us,
                                 "gbps": wbytes / us / 1e3, "of_read": read_us / us, "read_us": read_us})
        d = next(r[2] for r in rows if r[0] == "default")
        tc = next(r[2] for r in rows if r[0] == "tensor-core GEMV")
        print(f"{label:30s} M={m} default {d:7.2f} us  tensor-core {tc:7.2f}  best {best[0]:22s} {best[2]:7.2f} us  "
              f"read {read_us:6.2f}", flush=True)
    del qs, sets, flat
    torch.cuda.empty_cache()
    save()


def best_cfg(n, k, m=1):
    rs = [r for r in res["sweep"] if r["N"] == n and r["K"] == k and r["M"] == m and r["config"]]
    return min(rs, key=lambda r: r["us"])["config"]


# 3. the chain
shapes = [(8192, 2048), (4096, 2048), (2048, 4096)]
layers = 10
ws = [[pack(quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16))) for n, k in shapes]
      for _ in range(layers)]
x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
h = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
ys = [[torch.empty(1, n, device="cuda", dtype=torch.bfloat16) for n, _ in shapes] for _ in range(layers)]
nbytes = layers * sum(n * k // 2 + n * k // 16 for n, k in shapes)
copy_gbps = None
best = {s: best_cfg(*s) for s in shapes}
for name, cfgs, pdl in [("default", {s: None for s in shapes}, False),
                        ("default + PDL", {s: None for s in shapes}, True),
                        ("default + PDL early release", {s: {"EARLY_RELEASE": True} for s in shapes}, True),
                        ("best grid", best, False),
                        ("best grid + PDL", best, True),
                        ("best grid + PDL early release",
                         {s: {**best[s], "EARLY_RELEASE": True} for s in shapes}, True),
                        *[(f"{g // SMS} programs per SM + PDL early release",
                           {s: {"PROGRAMS": g, "EARLY_RELEASE": True} for s in shapes}, True) for g in GRIDS[1:]]]:
    calls = []
    for li in range(layers):
        for si, (n, k) in enumerate(shapes):
            calls.append(lambda w=ws[li][si], y=ys[li][si], xx=(h if k == 4096 else x), c=cfgs[(n, k)]:
                         launch_packed_gemv(xx, w, None, y, c, pdl=pdl))
    us = graph_us(calls) * len(calls)
    check = compare(ys[3][2], reference.nvfp4_linear(h, ws[3][2].unpack())).rel_l2
    res["chain"].append({"variant": name, "configs": {f"{n}x{k}": c for (n, k), c in cfgs.items()}, "pdl": pdl,
                         "us": us, "kernels": len(calls), "gbps": nbytes / us / 1e3, "rel_l2": check})
    print(f"chain {name:45s} {us:8.1f} us  {nbytes / us / 1e3:7.0f} GB/s  rel_l2 {check:.2e}", flush=True)
save()


# 4. host cost
n, k = 4096, 2048
q = quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16))
p, wb = pack(q), dequantize(q)
x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
y = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
hc = res["host_us"]
hc["empty Triton kernel, 1 argument"] = host_us(lambda: empty_launch(x))
for direct in (False, True):
    runtime.DIRECT_LAUNCH = direct
    _PACKED_GEMV.compiled.clear()
    tag = "direct launch" if direct else "Triton's launch path"
    hc[f"launch_packed_gemv, {tag}"] = host_us(lambda: launch_packed_gemv(x, p, None, y))
    hc[f"nvfp4_linear, {tag}"] = host_us(lambda: nvfp4_linear(x, p))
hc["torch.nn.functional.linear (cuBLAS bf16)"] = host_us(lambda: torch.nn.functional.linear(x, wb))
hc["torch.empty(1, 4096)"] = host_us(lambda: torch.empty(1, n, device="cuda", dtype=torch.bfloat16))
save()
for name, us in hc.items():
    print(f"host {us:8.2f} us  {name}")
print("default packed_gemv_config for the chain:", {f"{n}x{k}": packed_gemv_config(n, k, SMS) for n, k in shapes})
