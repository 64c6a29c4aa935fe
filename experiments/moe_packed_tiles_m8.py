"""Experiment (GPU only): the packed MoE decode kernels' tiles at batch 8, where they were never swept.

``PACKED_UP_CONFIGS[1]`` / ``PACKED_DOWN_CONFIGS[1]`` (the tiles of M > 2) ship as copies of the M = 1 optimum. At
batch 8 the MoE block is 60% of the Qwen3.5 decode step (docs/history/decode.md, the batch-8 census), so its two
kernels' tiles are swept here at M = 8 on the Qwen3.5 shape (256 experts, top 8, the shared expert as a slot): each
tile of one kernel with the other at its shipped tile, by CUDA-graph replay of 8 distinct blocks in a row
(``moe_packed_decode.py``'s harness), each validated against the fp32 reference (cosine) and repeated for
bit-equality. Then the best pair at M = 4, 8 and 16 beside the shipped pair.

Run: ``PYTHONPATH=. python3 experiments/moe_packed_tiles_m8.py`` (JSON under $OUT or out/).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import moe_packed_decode as mpd  # noqa: E402

from lynn_kernels.bench.harness import provenance  # noqa: E402
from lynn_kernels.bench.matmul_graph import graph_us  # noqa: E402
from lynn_kernels.metrics import bit_mismatches, compare  # noqa: E402
from lynn_kernels.moe import moe_block, reference, triton_experts  # noqa: E402

H = mpd.H
UP = [dict(BLOCK_N=n, TW=w, num_warps=nw) for n, w, nw in
      ((8, 64, 4), (4, 64, 2), (4, 64, 4), (8, 32, 4), (16, 32, 4), (8, 128, 4), (16, 64, 8), (8, 64, 8), (4, 32, 2),
       (16, 16, 4))]
DOWN = [dict(BLOCK_N=n, TW=w, num_warps=nw) for n, w, nw in
        ((8, 32, 8), (8, 32, 4), (4, 32, 4), (4, 32, 2), (8, 16, 4), (16, 16, 4), (16, 32, 8), (8, 64, 8), (4, 16, 2),
         (2, 32, 2))]
SHIPPED = (dict(triton_experts.PACKED_UP_CONFIGS[1]), dict(triton_experts.PACKED_DOWN_CONFIGS[1]))


def _set(up: dict, down: dict) -> None:
    triton_experts.PACKED_UP_CONFIGS = (triton_experts.PACKED_UP_CONFIGS[0], up)
    triton_experts.PACKED_DOWN_CONFIGS = (triton_experts.PACKED_DOWN_CONFIGS[0], down)


def _compile(args) -> str:
    kind, i = args
    _set(UP[i] if kind == "up" else SHIPPED[0], DOWN[i] if kind == "down" else SHIPPED[1])
    return mpd.warm_block(i, (4, 8, 16))


def timed(blocks, xs, up, down) -> dict:
    _set(up, down)
    b, x = blocks[0], xs[0]
    row = dict(up=up, down=down)
    try:
        got = moe_block(x, b["router"], *b["packed + shared slot"], top_k=8)
        again = moe_block(x, b["router"], *b["packed + shared slot"], top_k=8)
        want = reference.moe_block(x, b["router"], *b["checkpoint"], top_k=8)
        row["cosine"] = compare(got, want).cosine
        row["repeat_mismatches"] = bit_mismatches(got, again)
        row["us"] = graph_us(mpd._calls(blocks, "packed + shared slot", xs, 8))
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
    print(row, flush=True)
    return row


def main() -> dict:
    jobs = [("up", i) for i in range(len(UP))] + [("down", i) for i in range(len(DOWN))]
    with mp.get_context("spawn").Pool(16) as pool:
        compiled = pool.map(_compile, jobs)
    gen = torch.Generator(device="cuda").manual_seed(0)
    blocks = [mpd._block(256, gen) for _ in range(mpd.LAYERS)]
    xs = {m: [torch.randn(m, H, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in blocks]
          for m in (4, 8, 16)}
    shipped = timed(blocks, xs[8], *SHIPPED)
    ups = [timed(blocks, xs[8], up, SHIPPED[1]) for up in UP]
    downs = [timed(blocks, xs[8], SHIPPED[0], down) for down in DOWN]
    ok = lambda rows: [r for r in rows if r.get("cosine", 0) > 0.9999 and r.get("repeat_mismatches", 1) == 0]
    best = (min(ok(ups), key=lambda r: r["us"])["up"], min(ok(downs), key=lambda r: r["us"])["down"])
    pairs = []
    for m in (4, 8, 16):
        pairs.append(dict(M=m, shipped=timed(blocks, xs[m], *SHIPPED), best=timed(blocks, xs[m], *best)))
    return {"provenance": provenance(" ".join(["python3", *sys.argv])), "layers_chained": mpd.LAYERS,
            "compiled": compiled, "shipped": SHIPPED, "m8_shipped": shipped, "m8_up": ups, "m8_down": downs,
            "best": best, "pairs": pairs}


if __name__ == "__main__":
    res = main()
    out = os.environ.get("OUT", "out")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "moe_packed_tiles_m8.json"), "w") as f:
        json.dump(res, f, indent=1)
    print("shipped up / down:", res["shipped"])
    print("best up / down at M = 8:", res["best"])
    for p in res["pairs"]:
        print(f"M = {p['M']:2d}: shipped {p['shipped'].get('us', float('nan')):7.1f} us, best "
              f"{p['best'].get('us', float('nan')):7.1f} us a block (graph of {mpd.LAYERS})")
