"""How long the routed experts take at a list of batch sizes, in whatever tree is on ``PYTHONPATH``: run it in two
trees to compare two versions of the kernels (an A/B of a kernel change across every prefill tile size).

For Qwen3.5-35B-A3B's experts (E 256, top-8, H 2048, I 512, random NVFP4 from a fixed seed, the checkpoint layout),
at each M: ``moe_experts``'s time (``triton.testing.do_bench`` median, L2 flushed), TFLOP/s, the fraction of the
measured bf16 peak, and a checksum of the output (the same seed in two trees: equal sums say equal outputs).

    PYTHONPATH=<tree> python3 experiments/moe_experts_times.py --tokens 32 256 1024 2048 4096 16384 --out a.json

GPU only.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from lynn_kernels.bench.harness import measure_ceilings, provenance, time_fn
from lynn_kernels.lab.shapes import BUILDERS, MODELS
from lynn_kernels.moe import moe_experts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[32, 256, 1024, 2048, 4096, 16384])
    ap.add_argument("--out", required=True, help="the JSON to write")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("moe_experts_times.py times GPU kernels: no GPU here")
    peak = measure_ceilings().bf16_tflops
    res = {"provenance": provenance(" ".join(["python3"] + sys.argv)), "bf16_tflops": peak, "rows": []}
    d = MODELS["qwen3.5-35b-a3b"]
    for m in args.tokens:
        torch.manual_seed(0)
        shape = BUILDERS["moe.moe_experts"](d, m)[0]
        a, _, _ = shape.make()
        with torch.inference_mode():
            out = moe_experts(*a)
            ms = time_fn(lambda: moe_experts(*a))[0]
        row = {"tokens": m, "ms": ms, "tflops": shape.flops / ms / 1e9, "frac_of_peak": shape.flops / ms / 1e9 / peak,
               "checksum": float(out.float().abs().sum())}
        res["rows"].append(row)
        print(f"{m:6d} tokens {ms:8.3f} ms {row['tflops']:6.0f} TFLOP/s  sum {row['checksum']:.6e}", flush=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
