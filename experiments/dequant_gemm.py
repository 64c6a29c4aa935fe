"""H200: the prefill GEMM as "dequantise the packed weight once, then cuBLAS" against the packed GEMM kernel.

Three parts, one process (torch / triton of the device image), every output first compared with the fp32 reference:

1. the dequantise kernel's tile (``BLOCK_N`` x ``BLOCK_K``, warps) on three decoder shapes, by CUDA-graph replay on
   rotating weight sets; GB/s counts the packed bytes read and the bf16 bytes written;
2. the crossover: for the decoder's projection shapes and M = 64 .. 4096, the packed GEMM kernel (autotuned),
   the dequantise-then-cuBLAS path (its two launches in one graph), the dequantise kernel alone and cuBLAS bf16 on
   bf16 weights, all by graph replay on rotating weights;
3. the 2,048-token prefill of a random Qwen3.5-35B-A3B or another preset (as loaded, then with its input projections fused) with the
   dequantise path on (``DEQUANT_MIN_M`` as shipped) and off (the packed GEMM for every M), interleaved: the host-timed
   call and the kernels' summed time, and the two paths' last-token logits compared.

    PYTHONPATH=. python3 experiments/dequant_gemm.py [parts, default 123] [preset of part 3, default qwen3.5-35b-a3b]

Writes ``$OUT/dequant_gemm.json`` and prints tables.
"""

import json
import os
import statistics
import sys

import torch

from lynn_kernels.bench.harness import kernel_ms, l2_bytes, provenance
from lynn_kernels.bench.matmul_graph import graph_us, n_sets
from lynn_kernels.matmul import pack, reference, triton_matmul
from lynn_kernels.matmul.triton_matmul import launch_dequant_gemm, launch_gemm, launch_packed_dequantize
from lynn_kernels.metrics import compare
from lynn_kernels.nvfp4 import NVFP4Tensor, dequantize, quantize

OUT = os.environ.get("OUT", "out")
os.makedirs(OUT, exist_ok=True)
PARTS = sys.argv[1] if len(sys.argv) > 1 else "123"
PRESET = sys.argv[2] if len(sys.argv) > 2 else "qwen3.5-35b-a3b"
res = {"provenance": provenance(f"python3 experiments/dequant_gemm.py {PARTS} {PRESET}"), "l2_bytes": l2_bytes(),
       "preset": PRESET}


def save():
    json.dump(res, open(os.path.join(OUT, "dequant_gemm.json"), "w"), indent=1)


def weight_sets(n, k, extra_bytes=0):
    sets = []
    for _ in range(n_sets(n * k // 2 + n * k // 16 + extra_bytes)):
        q = quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16))
        sets.append((q, pack(q)))
    return sets


# ---------------------------------------------------------------------------------------------------------------
# 1. the dequantise kernel's tile
if "1" in PARTS:
    configs = [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w) for bn in (16, 32, 64) for bk in (128, 256, 512)
               for w in (4, 8) if bn * bk <= 16384]
    res["dequant_tiles"] = []
    for label, n, k in [("2048->8192", 8192, 2048), ("4096->2048", 2048, 4096), ("2048->12288", 12288, 2048)]:
        sets = weight_sets(n, k, 2 * n * k)
        outs = [torch.empty(n, k, device="cuda", dtype=torch.bfloat16) for _ in sets]
        q0 = sets[0][0]
        ones = NVFP4Tensor(q0.codes, q0.scales, torch.ones((), device="cuda"))
        want = (dequantize(ones, torch.float32) * 2.0 ** -19).to(torch.bfloat16)     # exact: 6 significant bits
        best = None
        for cfg in configs:
            launch_packed_dequantize(sets[0][1], outs[0], cfg)
            ok = torch.equal(outs[0], want)
            us = graph_us([lambda p=p, o=o, c=cfg: launch_packed_dequantize(p, o, c) for (_, p), o in zip(sets, outs)])
            gbs = (n * k // 2 + n * k // 16 + 2 * n * k) / us / 1e3
            res["dequant_tiles"].append({"shape": label, **cfg, "us": us, "gbps": gbs, "exact": ok})
            if best is None or us < best[0]:
                best = (us, cfg)
            print(f"dequant {label} {cfg}: {us:.2f} us {gbs:,.0f} GB/s exact={ok}", flush=True)
        print(f"== dequant {label}: best {best[1]} {best[0]:.2f} us; shipped {triton_matmul.DEQUANT_CONFIG}")
        del sets, outs
        torch.cuda.empty_cache()
        save()

# ---------------------------------------------------------------------------------------------------------------
# 2. the crossover
if "2" in PARTS:
    res["crossover"] = []
    shapes = [("attn q+gate / GDN qkv 2048->8192", 8192, 2048), ("GDN z 2048->4096", 4096, 2048),
              ("o / out proj 4096->2048", 2048, 4096), ("GDN qkv|z 2048->12288", 12288, 2048)]
    for label, n, k in shapes:
        sets = weight_sets(n, k)
        bsets = [dequantize(q) for q, _ in sets[:n_sets(2 * n * k)]]
        for m in (64, 128, 256, 512, 1024, 2048, 4096):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            want = reference.nvfp4_linear(x, sets[0][0])
            ws = [torch.empty(n, k, device="cuda", dtype=torch.bfloat16) for _ in sets]
            provs = {
                "packed GEMM kernel": [lambda p=p: launch_gemm(x, p, None, y) for _, p in sets],
                "dequantise + cuBLAS": [lambda p=p: launch_dequant_gemm(x, p, None, y) for _, p in sets],
                "dequantise alone": [lambda p=p, o=o: launch_packed_dequantize(p, o) for (_, p), o in zip(sets, ws)],
                "cuBLAS bf16": [lambda b=b: torch.nn.functional.linear(x, b) for b in bsets],
            }
            row = {"shape": label, "M": m, "N": n, "K": k}
            for name, calls in provs.items():
                if name in ("packed GEMM kernel", "dequantise + cuBLAS"):
                    calls[0]()
                    row[f"{name} cosine"] = compare(y, want).cosine
                row[name] = graph_us(calls)
            row["dequant+cuBLAS vs cuBLAS"] = row["cuBLAS bf16"] / row["dequantise + cuBLAS"]
            row["packed GEMM vs cuBLAS"] = row["cuBLAS bf16"] / row["packed GEMM kernel"]
            res["crossover"].append(row)
            print(f"{label} M={m}: packed GEMM {row['packed GEMM kernel']:.1f} us, dequant+cuBLAS "
                  f"{row['dequantise + cuBLAS']:.1f} (dequant {row['dequantise alone']:.1f}), cuBLAS "
                  f"{row['cuBLAS bf16']:.1f}; vs cuBLAS {row['packed GEMM vs cuBLAS']:.2f}x / "
                  f"{row['dequant+cuBLAS vs cuBLAS']:.2f}x; cos {row['packed GEMM kernel cosine']:.6f} / "
                  f"{row['dequantise + cuBLAS cosine']:.6f}", flush=True)
            del ws
            save()
        del sets, bsets
        torch.cuda.empty_cache()

# ---------------------------------------------------------------------------------------------------------------
# 3. the 2,048-token prefill, dequantise path on and off
if "3" in PARTS:
    import lynn_model
    from lynn_model.loader import random_model

    cfg = lynn_model.preset(PRESET)
    model = random_model(cfg, weights="nvfp4", device="cuda", seed=0)
    ids = torch.randint(0, cfg.vocab_size, (2048,), device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    cache = model.new_cache(max_batch=1, max_tokens=2048 + 64)
    shipped = triton_matmul.DEQUANT_MIN_M
    res["prefill"] = {}

    def prefill():
        s = cache.add()
        logits = model.step(ids, cache, [s], [2048])
        cache.release(s)
        return logits

    for form in ("as loaded", "input projections fused"):
        if form == "input projections fused":
            model.fuse_input_projections()
        entry = {"wall_ms": {"on": [], "off": []}, "kernel_ms": {}}
        logits = {}
        with torch.no_grad():
            for mode, v in (("on", shipped), ("off", 1 << 30)):
                triton_matmul.DEQUANT_MIN_M = v
                logits[mode] = prefill().float()          # compile / autotune / read the scales back
                prefill()
            for _ in range(5):                              # interleaved: the host's speed drifts
                for mode, v in (("on", shipped), ("off", 1 << 30)):
                    triton_matmul.DEQUANT_MIN_M = v
                    torch.cuda.synchronize()
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    prefill()
                    b.record()
                    b.synchronize()
                    entry["wall_ms"][mode].append(a.elapsed_time(b))
            for mode, v in (("on", shipped), ("off", 1 << 30)):
                triton_matmul.DEQUANT_MIN_M = v
                entry["kernel_ms"][mode] = kernel_ms(prefill, n=3)
        triton_matmul.DEQUANT_MIN_M = shipped
        m = compare(logits["on"], logits["off"])
        entry["logits_on_vs_off"] = {"cosine": m.cosine, "rel_l2": m.rel_l2,
                                     "argmax_equal": bool(torch.equal(logits["on"].argmax(-1), logits["off"].argmax(-1)))}
        res["prefill"][form] = entry
        save()
        for mode in ("on", "off"):
            w = statistics.median(entry["wall_ms"][mode])
            print(f"== prefill 2048, {form}, dequant path {mode}: {w:.1f} ms ({2048e3 / w:,.0f} tok/s), kernels "
                  f"{entry['kernel_ms'][mode]:.1f} ms ({2048e3 / entry['kernel_ms'][mode]:,.0f} tok/s)")
        print(f"   logits on vs off: {entry['logits_on_vs_off']}")

save()
if "crossover" in res:
    print("\n| shape | M | packed GEMM us | dequant + cuBLAS us | dequant alone us | cuBLAS bf16 us | "
          "packed / dequant+cuBLAS vs cuBLAS |")
    for r in res["crossover"]:
        print(f"| {r['shape']} | {r['M']} | {r['packed GEMM kernel']:.1f} | {r['dequantise + cuBLAS']:.1f} | "
              f"{r['dequantise alone']:.1f} | {r['cuBLAS bf16']:.1f} | {r['packed GEMM vs cuBLAS']:.2f}x / "
              f"{r['dequant+cuBLAS vs cuBLAS']:.2f}x |")
