"""Experiment (GPU only): the MoE decode path's tiles, by kernel time, at the Qwen shapes.

The decode path (``M <= 16``: one program per slot, no align) ran at 360 GB/s at M = 1 on the first H200 run
(``docs/moe.md`` section 4): 8 slots x 8 tiles = 64 programs on 132 SMs. This sweeps ``BLOCK_N`` (more programs),
``BLOCK_K``, warps and stages of both expert GEMMs through ``launch_moe_experts(config=...)``, validates every
config against the fp32 reference, and reports the gate_up + down + combine kernel time and the active experts'
weight bytes per second.

Run: ``PYTHONPATH=. python -m lynn_kernels.bench.experiments.moe_decode_tiles`` (JSON under $OUT or out/).
Not yet run: written after the first H200 session's device time was spent.
"""

from __future__ import annotations

import itertools
import json
import os

import torch

from ..harness import kernel_ms
from ...moe import reference
from ...moe.triton_experts import launch_moe_experts, moe_workspace
from ...nvfp4 import quantize
from ...validate import compare

SHAPES = [("Qwen3.5-35B-A3B", 256, 8), ("Qwen3-Next-80B-A3B", 512, 10)]
H, I = 2048, 512
#: 10 configs (each compile costs 10-20 s on the device's host): BLOCK_N x BLOCK_K at 4 warps, then warps and depth
CONFIGS = [dict(BLOCK_N=n, BLOCK_K=k, num_warps=4, num_stages=3) for n, k in itertools.product((16, 32, 64), (128, 256))]
CONFIGS += [dict(BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=3) for n, k, w in
            ((32, 256, 2), (32, 256, 8), (32, 512, 4), (16, 256, 2))]


def main() -> list[dict]:
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for label, E, top_k in SHAPES:
        w13 = quantize(torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.05)
        w2 = quantize(torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.05)
        for m in (1, 4, 16):
            sets = []
            for _ in range(16):                                  # different experts per call: past the L2
                x = torch.randn(m, H, device="cuda", dtype=torch.bfloat16, generator=gen)
                ids = torch.stack([torch.randperm(E, device="cuda", generator=gen)[:top_k] for _ in range(m)])
                w = torch.softmax(torch.randn(m, top_k, device="cuda", generator=gen), -1)
                sets.append((x, w, ids.to(torch.int32)))
            x0, w0, ids0 = sets[0]
            want = reference.moe_experts(x0, w0, ids0, w13, w2)
            active = m * top_k * 3 * I * H * 9 // 16                 # weight bytes the step must read (distinct)
            out = torch.empty(m, H, device="cuda", dtype=torch.bfloat16)
            ws = moe_workspace(m, top_k, E, H, I, torch.bfloat16, x0.device)
            for cfg in CONFIGS:
                row = dict(shape=label, M=m, **cfg)
                try:
                    out.fill_(float("nan"))
                    launch_moe_experts(x0, w0, ids0, w13, w2, out, ws, config=cfg)
                    row["cosine"] = compare(out, want).cosine
                    i = iter(itertools.cycle(sets))

                    def call():
                        x, w, ids = next(i)
                        return launch_moe_experts(x, w, ids, w13, w2, out, ws, config=cfg)

                    row["kernel_us"] = kernel_ms(call) * 1e3
                    row["gbps"] = active / row["kernel_us"] / 1e3
                except Exception as exc:                       # a config that does not compile is a result too
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
                rows.append(row)
                print(row, flush=True)
        del w13, w2
        torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    results = main()
    path = os.path.join(os.environ.get("OUT", "out"), "moe_decode_tiles.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    json.dump(results, open(path, "w"), indent=1)
    ok = [r for r in results if "kernel_us" in r and r["cosine"] > 0.9999]
    for key in sorted({(r["shape"], r["M"]) for r in ok}):
        best = min((r for r in ok if (r["shape"], r["M"]) == key), key=lambda r: r["kernel_us"])
        print(key, best)
