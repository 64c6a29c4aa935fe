"""H200: the packed GEMV reading x already in word order (``X_WORDS``: :func:`lynn_kernels.matmul.packed.x_words`).

The shipped GEMV loads x contiguous and reorders it through shared memory every step (four ``BAR.SYNC`` a step,
168 registers at 32 x 64); with x given in the words' order each thread reads its x with 16-byte loads and nothing
is exchanged (no barrier in the loop, 106 registers: ``sm90_compile.py``, triton 3.8). Here, per decoder shape at
M = 1 and 2: the shipped launch against ``xw`` with the shipped tile and with other tiles and warps; CUDA-graph
replay with PDL on rotating weight sets past 3x the L2 (x's word-order copy made once, outside the graph: this
times the GEMV alone; a decoder would have the kernel before it write that copy); outputs compared bit for bit
with the shipped launch. Then ``matmul.chain``'s 30 GEMVs both ways.

Writes ``$OUT/gemv_xwords.json`` and prints a table.

    PYTHONPATH=. python3 experiments/gemv_xwords.py

Run once, at git e374425 (``data/experiments/gemv-xwords/e374425.json``): no faster at M = 1 (the same tile 0.97-1.16x
the shipped time; the chain 176.2 against 166.4 us), so ``X_WORDS`` and ``x_words`` were taken out after it; the
script runs at that commit (``git checkout e374425``).
"""

import json
import os

import torch
from gdn_chain import gdn_chain  # noqa: E402  (experiments/, on the path when run as a script)

from lynn_kernels.bench.harness import provenance
from lynn_kernels.bench.matmul_graph import graph_us, n_sets, pure_read
from lynn_kernels.matmul import pack
from lynn_kernels.matmul.packed import x_words
from lynn_kernels.matmul.triton_packed import launch_packed_gemv, packed_gemv_config
from lynn_kernels.metrics import bit_mismatches
from lynn_kernels.nvfp4 import quantize

OUT = os.environ.get("OUT", "out")
os.makedirs(OUT, exist_ok=True)
BF16 = torch.bfloat16
SMS = torch.cuda.get_device_properties(0).multi_processor_count
res = {"provenance": provenance("python3 experiments/gemv_xwords.py"), "sweep": [], "chain": []}


def save():
    json.dump(res, open(os.path.join(OUT, "gemv_xwords.json"), "w"), indent=1)



def name(c):
    return "shipped tile" if c is None else f"{c['BLOCK_N']}x{c['TW']}/{c['num_warps']}w"


SHAPES = [("GDN qkv|z fused 2048->12288", 12288, 2048), ("attention q|k|v fused 2048->9216", 9216, 2048),
          ("GDN qkv 2048->8192", 8192, 2048), ("GDN z 2048->4096", 4096, 2048),
          ("o / out proj 4096->2048", 2048, 4096), ("shared expert down 512->2048", 2048, 512)]
TILES = [None] + [{"BLOCK_N": bn, "TW": tw, "num_warps": w} for bn, tw, w in
                  [(32, 64, 4), (16, 64, 4), (16, 64, 2), (8, 64, 2), (8, 64, 1), (16, 128, 4), (8, 128, 4),
                   (32, 128, 8), (64, 64, 8), (32, 32, 4), (16, 32, 2), (8, 32, 1)]]
torch.manual_seed(0)
best = {}
for label, n, k in SHAPES:
    wbytes = n * k // 2 + n * k // 16
    sets = [pack(quantize(torch.randn(n, k, device="cuda", dtype=BF16))) for _ in range(n_sets(wbytes))]
    kw = sets[0].words.shape[1]
    flat = [torch.cat([p.words.view(-1), p.scales.view(torch.int32).view(-1)]) for p in sets]
    sink = torch.empty(1 << 20, dtype=torch.int32, device="cuda")
    read_us = graph_us([lambda f=f: pure_read(f, sink) for f in flat])
    for m in (1, 2):
        x = torch.randn(m, k, device="cuda", dtype=BF16)
        xw = x_words(x, kw)
        ys = [torch.empty(m, n, device="cuda", dtype=BF16) for _ in sets]
        want = launch_packed_gemv(x, sets[0], None, torch.empty(m, n, device="cuda", dtype=BF16))
        base = graph_us([lambda p=p, y=y: launch_packed_gemv(x, p, None, y, pdl=True) for p, y in zip(sets, ys)])
        rows = [{"shape": label, "N": n, "K": k, "M": m, "variant": "shipped", "config": None, "us": base,
                 "read_us": read_us, "shipped": packed_gemv_config(n, k, SMS, m)}]
        for cfg in TILES:
            if cfg is not None and cfg["TW"] > max(16, kw):
                continue
            try:
                got = launch_packed_gemv(x, sets[0], None, torch.empty_like(ys[0]), cfg, xw=xw)
                ref = want if cfg is None else launch_packed_gemv(x, sets[0], None, torch.empty_like(ys[0]), cfg)
                mism = bit_mismatches(got, ref)
                us = graph_us([lambda p=p, y=y, c=cfg: launch_packed_gemv(x, p, None, y, c, pdl=True, xw=xw)
                               for p, y in zip(sets, ys)])
            except Exception as e:                                           # noqa: BLE001
                print("fail", label, m, cfg, repr(e)[:200], flush=True)
                continue
            rows.append({"shape": label, "N": n, "K": k, "M": m, "variant": "xw " + name(cfg), "config": cfg,
                         "us": us, "read_us": read_us, "mismatches_vs_same_tile_x": mism})
        res["sweep"] += rows
        top = sorted(rows, key=lambda r: r["us"])
        if m == 1:
            best[(n, k)] = top[0]["config"] if top[0]["variant"] != "shipped" else None
        xs = next(r for r in rows if r["variant"] == "xw shipped tile")
        print(f"{label:34s} M={m} shipped {base:6.2f} | xw same tile {xs['us']:6.2f} (mism {xs['mismatches_vs_same_tile_x']}) | "
              + " | ".join(f"{r['variant']} {r['us']:.2f}" for r in top[:3]) + f" | read {read_us:.2f}"
              + f" | mism max {max(r.get('mismatches_vs_same_tile_x', 0) for r in rows)}", flush=True)
        save()
    del sets, flat
    torch.cuda.empty_cache()

shapes, layers, ws, x, h, ys, nbytes = gdn_chain()            # experiments/gdn_chain.py
xw, hw = x_words(x, 256), x_words(h, 512)
for variant, use_xw, cfgs in (("shipped", False, {}), ("xw, shipped tiles", True, {}), ("xw, best tiles", True, best)):
    calls = [lambda w=ws[li][j], y=ys[li][j], xx=(h if j == 2 else x), xxw=(hw if j == 2 else xw),
             c=cfgs.get(shapes[j]), u=use_xw: launch_packed_gemv(xx, w, None, y, c, pdl=True, xw=xxw if u else None)
             for li in range(layers) for j in range(3)]
    us = graph_us(calls) * len(calls)
    res["chain"].append({"variant": variant, "configs": {f"{n}x{k}": cfgs.get((n, k)) for n, k in shapes},
                         "us": us, "gbps": nbytes / us / 1e3})
    print(f"chain of 30, {variant}: {us:.1f} us ({nbytes / us / 1e3:,.0f} GB/s)", flush=True)
save()
