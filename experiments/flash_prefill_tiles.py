"""Which tiling the prefill flash attention should run at a given length, and which one its autotuner picks.

The prefill kernel is autotuned over ``triton_prefill.PREFILL_CONFIGS``, keyed on the longest query run in powers
of 4 (``runtime.size_bucket``). This times every config at Qwen3.5's attention shape (16 query heads, 2 KV
heads, d 256, causal, the sigmoid gate fused, bf16) at each length of ``--tokens`` (one sequence; configs that do
not fit the shared memory are recorded with their error), and calls ``flash_attention`` at those lengths in that
order first, recording the config the autotuner chose for each key and the time it then gives. Before the length
was in the key, the first length a process met fixed the tiling for every later one (docs/attention.md, "GPU
configurations").

    PYTHONPATH=. python3 experiments/flash_prefill_tiles.py
    PYTHONPATH=. python3 experiments/flash_prefill_tiles.py --tokens 256 2048 16384

Writes ``data/experiments/flash-prefill-tiles/<sha>.json`` (under ``$OUT`` when set). GPU only.
"""

from __future__ import annotations  # noqa: I001  (lynn_kernels before triton: it picks the backend)

import argparse
import sys

from lynn_kernels import runtime
from lynn_kernels.attention import flash_attention, triton_prefill
import torch
import triton.testing

from lynn_kernels.bench.harness import provenance, save_experiment

HQ, HKV, D = 16, 2, 256


def inputs(t: int):
    gen = torch.Generator(device="cuda").manual_seed(t)
    q, k, v, g = (torch.randn(t, h, D, device="cuda", dtype=torch.bfloat16, generator=gen) for h in (HQ, HKV, HKV, HQ))
    return q, k, v, g


def causal_flops(t: int) -> float:
    return 4 * t * t / 2 * HQ * D              # QK^T and PV over the causal half


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 16384], help="prompt lengths, in this order")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("flash_prefill_tiles.py times kernels: it needs a CUDA GPU", file=sys.stderr)
        return 2
    res = {"provenance": provenance(), "shape": {"hq": HQ, "hkv": HKV, "d": D, "causal": True, "gate": True},
           "tokens": args.tokens}
    for t in args.tokens:
        q, k, v, g = inputs(t)
        flash_attention(q, k, v, gate=g)                                        # the autotuner times this length
        ms = triton.testing.do_bench(lambda: flash_attention(q, k, v, gate=g), warmup=5, rep=100)
        res[f"autotuned_{t}"] = {"ms": ms, "tflops": causal_flops(t) / ms / 1e9,
                                 "bucket": runtime.size_bucket(t)}
    res["chosen"] = {str(key): str(cfg) for key, cfg in triton_prefill.PREFILL.shipped.cache.items()}
    rows = []
    for cfg in triton_prefill.PREFILL_CONFIGS:
        c = {**cfg.kwargs, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
        row = {"config": c}
        for t in args.tokens:
            q, k, v, g = inputs(t)
            out = torch.empty_like(q)
            cu = torch.tensor([0, t], dtype=torch.int32, device="cuda")
            try:
                row[str(t)] = triton.testing.do_bench(
                    lambda: triton_prefill.launch_prefill(q, k, v, g, out, cu, cu, t, True, D ** -0.5, c),
                    warmup=5, rep=100)
            except Exception as err:  # noqa: BLE001  (a config past the shared memory: recorded, not fatal)
                row[str(t)] = f"{type(err).__name__}: {err}"[:200]
        rows.append(row)
    res["configs"] = rows
    save_experiment("flash-prefill-tiles", res)
    for row in rows:
        cells = [f"{t}: {row[str(t)]:.3f} ms ({causal_flops(t) / row[str(t)] / 1e9:.0f} TFLOP/s)"
                 if isinstance(row[str(t)], float) else f"{t}: {row[str(t)][:40]}" for t in args.tokens]
        print(row["config"], *cells)
    print({k: v for k, v in res.items() if k.startswith("autotuned")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
