"""H200: the packed GEMV's warps per program, swept with its tile (``BLOCK_N`` rows x ``TW`` words).

``experiments/l2_prefetch.py`` found the packed GEMV as fast with its weights in L2 as from DRAM (2048->8192, M = 1:
6.70 against 6.90 us): it is bound by its own instruction stream, not by the bytes. Its SASS (``sm90_compile.py``,
32 x 64 tile, 4 warps) has four ``BAR.SYNC`` a step (x is reordered through shared memory) and 168 registers, and
the grid puts about two 4-warp programs on an SM: two warps a scheduler to hide every latency. Earlier sweeps varied
the tile and the grid at 4 warps only. Here: 1, 2, 4 and 8 warps, tiles of 4..64 rows and 32..128 words (4..32
words a thread), M = 1 (and the best few at M = 2), on the decoder's projection shapes; CUDA-graph replay with
programmatic dependent launch (as the decoder runs them) on rotating weight sets past 3x the L2; every config's
output compared bit for bit with the shipped launch (the same sums in the same order per lane are not guaranteed
across tiles: a mismatch is reported, not fatal, and the rel_l2 against the shipped output beside it). Then the
30-GEMV chain of ``matmul.chain`` with the shipped and the best tiles.

Writes ``$OUT/gemv_warps.json`` and prints a table.

    PYTHONPATH=. python3 experiments/gemv_warps.py
"""

import json
import os

import torch
from gdn_chain import gdn_chain  # noqa: E402  (experiments/, on the path when run as a script)

from lynn_kernels.bench.harness import provenance
from lynn_kernels.bench.matmul_graph import graph_us, n_sets, pure_read
from lynn_kernels.matmul import pack
from lynn_kernels.matmul.triton_packed import launch_packed_gemv, packed_gemv_config
from lynn_kernels.metrics import bit_mismatches, compare
from lynn_kernels.nvfp4 import quantize

OUT = os.environ.get("OUT", "out")
os.makedirs(OUT, exist_ok=True)
BF16 = torch.bfloat16
SMS = torch.cuda.get_device_properties(0).multi_processor_count
res = {"provenance": provenance("python3 experiments/gemv_warps.py"), "sweep": [], "chain": []}


def save():
    json.dump(res, open(os.path.join(OUT, "gemv_warps.json"), "w"), indent=1)



SHAPES = [("GDN qkv|z fused 2048->12288", 12288, 2048), ("attention q|k|v fused 2048->9216", 9216, 2048),
          ("GDN qkv 2048->8192", 8192, 2048), ("GDN z 2048->4096", 4096, 2048),
          ("o / out proj 4096->2048", 2048, 4096), ("shared expert down 512->2048", 2048, 512)]
CONFIGS = [{"BLOCK_N": bn, "TW": tw, "num_warps": w} for w in (1, 2, 4, 8) for bn in (4, 8, 16, 32, 64)
           for tw in (32, 64, 128) if 4 <= bn * tw // (32 * w) <= 32]
torch.manual_seed(0)
best_cfg = {}
for label, n, k in SHAPES:
    wbytes = n * k // 2 + n * k // 16
    sets = [pack(quantize(torch.randn(n, k, device="cuda", dtype=BF16))) for _ in range(n_sets(wbytes))]
    flat = [torch.cat([p.words.view(-1), p.scales.view(torch.int32).view(-1)]) for p in sets]
    sink = torch.empty(1 << 20, dtype=torch.int32, device="cuda")
    read_us = graph_us([lambda f=f: pure_read(f, sink) for f in flat])
    for m in (1, 2):
        x = torch.randn(m, k, device="cuda", dtype=BF16)
        ys = [torch.empty(m, n, device="cuda", dtype=BF16) for _ in sets]
        want = launch_packed_gemv(x, sets[0], None, torch.empty(m, n, device="cuda", dtype=BF16))
        ship = packed_gemv_config(n, k, SMS, m)
        base = graph_us([lambda p=p, y=y: launch_packed_gemv(x, p, None, y, pdl=True) for p, y in zip(sets, ys)])
        cfgs = CONFIGS if m == 1 else sorted(
            [r for r in res["sweep"] if r["N"] == n and r["M"] == 1 and r["config"]], key=lambda r: r["us"])[:6]
        cfgs = cfgs if m == 1 else [r["config"] for r in cfgs]
        rows = [{"shape": label, "N": n, "K": k, "M": m, "config": None, "shipped": ship, "us": base,
                 "read_us": read_us}]
        for cfg in cfgs:
            if cfg["TW"] > max(16, k // 8) * 2:
                continue
            try:
                got = launch_packed_gemv(x, sets[0], None, torch.empty_like(ys[0]), cfg)
                mism = bit_mismatches(got, want)
                rel = compare(got, want).rel_l2
                if rel > 2 ** -8:
                    raise AssertionError(f"wrong: rel_l2 {rel}")
                us = graph_us([lambda p=p, y=y, c=cfg: launch_packed_gemv(x, p, None, y, c, pdl=True)
                               for p, y in zip(sets, ys)])
            except Exception as e:                                           # noqa: BLE001
                print("fail", label, m, cfg, repr(e)[:160], flush=True)
                continue
            rows.append({"shape": label, "N": n, "K": k, "M": m, "config": cfg, "us": us, "read_us": read_us,
                         "mismatches_vs_shipped": mism, "rel_l2_vs_shipped": rel})
        res["sweep"] += rows
        best = min(rows, key=lambda r: r["us"])
        if m == 1:
            best_cfg[(n, k)] = best["config"]
        top = sorted(rows, key=lambda r: r["us"])[:4]
        print(f"{label:34s} M={m} shipped {ship['BLOCK_N']}x{ship['TW']}/{ship['num_warps']}w {base:6.2f} us | "
              + " | ".join(f"{r['config'] and (str(r['config']['BLOCK_N']) + 'x' + str(r['config']['TW']) + '/' + str(r['config']['num_warps']) + 'w')} {r['us']:.2f}"
                           for r in top) + f" | read {read_us:.2f}", flush=True)
        save()
    del sets, flat
    torch.cuda.empty_cache()

# the chain: 10 GDN layers' qkv, z, out_proj with the shipped and the best tiles, PDL
shapes, layers, ws, x, h, ys, nbytes = gdn_chain()            # experiments/gdn_chain.py
for name, cfgs in (("shipped", {}), ("best", best_cfg)):
    calls = [lambda w=ws[li][j], y=ys[li][j], xx=(h if j == 2 else x), c=cfgs.get(shapes[j]):
             launch_packed_gemv(xx, w, None, y, c, pdl=True) for li in range(layers) for j in range(3)]
    us = graph_us(calls) * len(calls)
    res["chain"].append({"variant": name, "configs": {f"{n}x{k}": cfgs.get((n, k)) for n, k in shapes}, "us": us,
                         "gbps": nbytes / us / 1e3})
    print(f"chain of 30, {name}: {us:.1f} us ({nbytes / us / 1e3:,.0f} GB/s)", flush=True)
save()
