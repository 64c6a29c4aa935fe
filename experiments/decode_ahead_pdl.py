"""H200: more weight bytes in flight per program (``AHEAD`` = 2) in the packed GEMV and the MoE gate_up kernel, and
what programmatic dependent launch saves at each kernel boundary of a decode step. Each part against today's
default in one process, by CUDA-graph replay (the way the decoder runs them).

1. packed GEMV, M = 1 and 2, on the decoder's projection shapes (Qwen3.5 fused and unfused, Qwen3-Next): the shipped
   tile with one and two steps ahead, and four other tiles with two; every variant's output first compared bit for
   bit with the shipped launch; a pure read of the same bytes beside them. Rotating weight sets past 3x the L2.
2. MoE decode (router, gate_up, down; the shared expert as a slot) at M = 1, 2, 4, 8 on both Qwen shapes, with
   gate_up one and two steps ahead (and a 16-row tile with two), 8 distinct blocks per graph; bit-equal checked.
3. Kernel boundaries: a chain of 240 small kernels (read 2,048 bf16, write 2,048: a norm's traffic) in one graph,
   plain launches against PDL launches (``gdc_wait`` first; the next kernel released at the start or at the end),
   and the same with 132 programs a kernel (one per SM); microseconds per kernel.
4. The projection chain of 10 Gated DeltaNet layers (``matmul.chain``'s 30 GEMVs) with one and two steps ahead,
   with and without PDL.

Writes ``$OUT/decode_ahead_pdl.json`` (rewritten after every part) and prints tables.

    PYTHONPATH=. python3 experiments/decode_ahead_pdl.py

Run once, at git 5e06e96 (``data/experiments/decode-ahead-pdl/5e06e96.json``). Two steps ahead lost on 20 of 22
cells (docs/history/matmul.md), and the ``AHEAD`` option was taken out of the kernels after it: parts 1, 2 and 4 run
at that commit (``git checkout 5e06e96``), part 3 on any.
"""

import importlib.util
import json
import os
import sys

import torch
import triton
import triton.language as tl
from gdn_chain import gdn_chain  # noqa: E402  (experiments/, on the path when run as a script)

from lynn_kernels.bench.harness import provenance
from lynn_kernels.bench.matmul_graph import graph_us, n_sets, pure_read
from lynn_kernels.matmul import pack, reference
from lynn_kernels.matmul.triton_packed import launch_packed_gemv, packed_gemv_config
from lynn_kernels.metrics import bit_mismatches, compare
from lynn_kernels.moe import moe_block, triton_experts
from lynn_kernels.nvfp4 import quantize

OUT = os.environ.get("OUT", "out")
os.makedirs(OUT, exist_ok=True)
SMS = torch.cuda.get_device_properties(0).multi_processor_count
res = {"provenance": provenance("python3 experiments/decode_ahead_pdl.py"), "gemv": [], "moe": [], "boundary": [],
       "chain": []}
BF16 = torch.bfloat16


def save():
    json.dump(res, open(os.path.join(OUT, "decode_ahead_pdl.json"), "w"), indent=1)



# 1. the packed GEMV
SHAPES = [("GDN qkv|z fused / Qwen3-Next qkvz 2048->12288", 12288, 2048),
          ("attention q|k|v fused 2048->9216", 9216, 2048),
          ("attn q+gate / GDN qkv 2048->8192", 8192, 2048),
          ("GDN z 2048->4096", 4096, 2048),
          ("o / out proj 4096->2048", 2048, 4096),
          ("shared expert down 512->2048", 2048, 512),
          ("GDN b|a fused 2048->64", 64, 2048)]
OTHER = [(16, 64), (16, 128), (32, 64), (8, 128)]
torch.manual_seed(0)
for label, n, k in SHAPES:
    wbytes = n * k // 2 + n * k // 16
    qs = [quantize(torch.randn(n, k, device="cuda", dtype=BF16)) for _ in range(n_sets(wbytes))]
    sets = [pack(q) for q in qs]
    flat = [torch.cat([p.words.view(-1), p.scales.view(torch.int32).view(-1)]) for p in sets]
    sink = torch.empty(1 << 20, dtype=torch.int32, device="cuda")
    read_us = graph_us([lambda f=f: pure_read(f, sink) for f in flat])
    for m in (1, 2):
        x = torch.randn(m, k, device="cuda", dtype=BF16)
        y = torch.empty(m, n, device="cuda", dtype=BF16)
        ship = packed_gemv_config(n, k, SMS, m)
        want = launch_packed_gemv(x, sets[0], None, torch.empty_like(y))
        rel = compare(want, reference.nvfp4_linear(x, qs[0])).rel_l2
        variants = [("shipped", {}), ("shipped, AHEAD 2", {"AHEAD": 2})]
        variants += [(f"{bn}x{tw} AHEAD {a}", {"BLOCK_N": bn, "TW": tw, "AHEAD": a}) for bn, tw in OTHER
                     for a in (1, 2) if (bn, tw) != (ship["BLOCK_N"], ship["TW"]) and not (m == 2 and bn > 16)]
        rows = []
        for name, cfg in variants:
            try:
                got = launch_packed_gemv(x, sets[0], None, torch.empty_like(y), cfg)
                mism = bit_mismatches(got, want) if "BLOCK_N" not in cfg else None
                if "BLOCK_N" in cfg and compare(got, want).rel_l2 > 2 ** -8:
                    raise AssertionError(f"wrong: rel_l2 {compare(got, want).rel_l2}")
                us = graph_us([lambda p=p, cfg=cfg: launch_packed_gemv(x, p, None, y, cfg) for p in sets])
            except Exception as e:                                           # noqa: BLE001
                print("fail", label, m, cfg, repr(e)[:160], flush=True)
                continue
            rows.append(name)
            res["gemv"].append({"shape": label, "N": n, "K": k, "M": m, "variant": name, "config": cfg,
                                "shipped": ship, "us": us, "read_us": read_us, "of_read": read_us / us,
                                "gbps": wbytes / us / 1e3, "mismatches_vs_shipped": mism, "rel_l2_shipped": rel})
        mine = [r for r in res["gemv"] if r["shape"] == label and r["M"] == m]
        base = next(r["us"] for r in mine if r["variant"] == "shipped")
        a2 = next((r["us"] for r in mine if r["variant"] == "shipped, AHEAD 2"), float("nan"))
        best = min(mine, key=lambda r: r["us"])
        print(f"{label:46s} M={m} shipped {base:7.2f} us  AHEAD 2 {a2:7.2f}  best {best['variant']:16s} "
              f"{best['us']:7.2f}  read {read_us:6.2f}", flush=True)
    del qs, sets, flat
    torch.cuda.empty_cache()
    save()

# 2. MoE decode
spec = importlib.util.spec_from_file_location("moe_packed_decode", os.path.join(os.path.dirname(__file__),
                                                                                  "moe_packed_decode.py"))
mpd = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mpd)
up0 = dict(triton_experts.PACKED_UP_CONFIGS[0])
gen = torch.Generator(device="cuda").manual_seed(1)
for shape, (E, top_k) in mpd.SHAPES.items():
    blocks = [mpd._block(E, gen) for _ in range(mpd.LAYERS)]
    for m in (1, 2, 4, 8):
        xs = [torch.randn(m, mpd.H, device="cuda", dtype=BF16, generator=gen) for _ in blocks]
        mpd._set(up=up0)
        b = blocks[0]
        want = moe_block(xs[0], b["router"], *b["packed + shared slot"], top_k=top_k)
        ref = mpd.reference.moe_block(xs[0], b["router"], *b["checkpoint"], top_k=top_k)
        for name, up in [("shipped", up0), ("AHEAD 2", {**up0, "AHEAD": 2}),
                         ("16 rows, AHEAD 2", {**up0, "BLOCK_N": 16, "AHEAD": 2})]:
            mpd._set(up=up)
            try:
                got = moe_block(xs[0], b["router"], *b["packed + shared slot"], top_k=top_k)
                us = graph_us(mpd._calls(blocks, "packed + shared slot", xs, top_k))
            except Exception as e:                                           # noqa: BLE001
                print("fail", shape, m, name, repr(e)[:160], flush=True)
                continue
            row = {"shape": shape, "M": m, "variant": name, "up": up, "us_per_block": us,
                   "mismatches_vs_shipped": bit_mismatches(got, want) if name != "16 rows, AHEAD 2" else None,
                   "cosine_vs_reference": compare(got, ref).cosine}
            res["moe"].append(row)
            print(f"moe {shape:11s} M={m} {name:18s} {us:7.2f} us/block  mism {row['mismatches_vs_shipped']}  "
                  f"cos {row['cosine_vs_reference']:.6f}", flush=True)
        mpd._set(up=up0)
    del blocks
    torch.cuda.empty_cache()
    save()


# 3. kernel boundaries
@triton.jit
def _small_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr):
    if PDL:
        if EARLY:
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + offs, mask=offs < n, other=0).to(tl.float32)
    tl.store(y_ptr + offs, (v * 1.0001 + 1.0).to(tl.bfloat16), mask=offs < n)
    if PDL:
        if not EARLY:
            tl.extra.cuda.gdc_launch_dependents()


CHAIN = 240
for programs in (1, SMS):
    n = 2048 * programs
    bufs = [torch.randn(n, device="cuda", dtype=BF16) for _ in range(2)]
    for name, pdl, early in (("plain", False, False), ("PDL, release at the end", True, False),
                             ("PDL, release at the start", True, True)):
        extra = {"launch_pdl": True} if pdl else {}
        calls = [lambda i=i: _small_kernel[(programs,)](bufs[i % 2], bufs[(i + 1) % 2], n, BLOCK=2048, PDL=pdl,
                                                         EARLY=early, num_warps=4, **extra) for i in range(CHAIN)]
        us = graph_us(calls)
        res["boundary"].append({"programs": programs, "variant": name, "us_per_kernel": us, "kernels": CHAIN})
        print(f"boundary {programs:4d} programs  {name:28s} {us:6.3f} us a kernel", flush=True)
save()

# 4. the GDN projection chain
shapes, layers, ws, x, h, ys, nbytes = gdn_chain()            # experiments/gdn_chain.py
for name, cfg, pdl in [("shipped", None, False), ("shipped + PDL", None, True), ("AHEAD 2", {"AHEAD": 2}, False),
                       ("AHEAD 2 + PDL", {"AHEAD": 2}, True)]:
    calls = [lambda w=ws[li][si], y=ys[li][si], xx=(h if k == 4096 else x): launch_packed_gemv(xx, w, None, y, cfg,
                                                                                             pdl=pdl)
             for li in range(layers) for si, (n, k) in enumerate(shapes)]
    us = graph_us(calls) * len(calls)
    res["chain"].append({"variant": name, "pdl": pdl, "config": cfg, "us": us, "kernels": len(calls),
                         "gbps": nbytes / us / 1e3})
    print(f"chain {name:20s} {us:8.1f} us  {nbytes / us / 1e3:7.0f} GB/s", flush=True)
save()

print("\npacked GEMV (us, graph replay)")
print(f"{'shape':46s} {'M':>2} {'shipped':>8} {'AHEAD 2':>8} {'best':>8}  best variant      read")
for label, n, k in SHAPES:
    for m in (1, 2):
        mine = [r for r in res["gemv"] if r["shape"] == label and r["M"] == m]
        if not mine:
            continue
        base = next(r["us"] for r in mine if r["variant"] == "shipped")
        a2 = next((r["us"] for r in mine if r["variant"] == "shipped, AHEAD 2"), float("nan"))
        best = min(mine, key=lambda r: r["us"])
        print(f"{label:46s} {m:>2} {base:8.2f} {a2:8.2f} {best['us']:8.2f}  {best['variant']:16s} "
              f"{mine[0]['read_us']:6.2f}")
bad = sum(1 for r in res["gemv"] + res["moe"] if r["mismatches_vs_shipped"])
print(f"bit mismatches against the shipped launch: {bad} variants")
sys.exit(0)
