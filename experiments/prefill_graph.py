"""The captured prefill (lynn_model.PrefillStep) against the eager one, at the decoder's real shapes on the H200.

    python experiments/prefill_graph.py [preset] [OUT_JSON]

Random NVFP4 weights (lynn_model.loader.random_model); for each (prompt tokens, graph rows) of
lynn_kernels.bench.decoder.GRAPH_PREFILLS the graph row of `lynn bench decoder` (logits checked against eager
model.step first), and beside it the eager model.step prefill of the same prompt: CUDA events around one call,
median of 5, and the profiler's kernel time. Writes the figures as JSON and prints a table.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

sys.path.insert(0, ".")

import lynn_model  # noqa: E402
from lynn_kernels.bench.harness import kernel_ms, measure_ceilings, provenance  # noqa: E402
from lynn_model import bench as bd  # noqa: E402
from lynn_model.loader import random_model  # noqa: E402


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "qwen3.5-35b-a3b"
    out = sys.argv[2] if len(sys.argv) > 2 else None
    cfg = lynn_model.preset(name)
    model = random_model(cfg, weights="nvfp4", device="cuda", seed=0)
    ids = torch.randint(0, cfg.vocab_size, (20000,), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    ceilings = measure_ceilings()
    res = {"preset": name, "provenance": provenance(), "cases": []}
    for n, size in bd.GRAPH_PREFILLS:
        cache = model.new_cache(max_batch=1, max_tokens=size + 64)
        with torch.no_grad():
            def eager():
                s = cache.add()
                model.step(ids[:n], cache, [s], [n])
                cache.release(s)
            eager()
            t = bd._events_ms(eager, 5)
            k = kernel_ms(eager, n=3)
        del cache
        torch.cuda.empty_cache()
        t0 = time.perf_counter()
        row, info = bd.graph_prefill(model, ids, n, size, ceilings, {"passed": True})
        info.update(n=n, rows=size, eager_ms=statistics.median(t), eager_kernel_ms=k,
                    eager_tok_s=n * 1e3 / statistics.median(t), wall_s=time.perf_counter() - t0)
        res["cases"].append(info)
        print(f"[prefill_graph] {n} in {size}: graph {info['ms']:.1f} ms ({info['tok_s']:,.0f} tok/s), eager "
              f"{info['eager_ms']:.1f} ms (kernels {k:.1f} ms), capture {info['capture_s']:.1f} s", flush=True)
    if out:
        with open(out, "w") as f:
            json.dump(res, f, indent=1)
    print(f"{'prompt':>7} {'rows':>6} {'graph ms':>9} {'tok/s':>8} {'eager ms':>9} {'kernels':>8} {'tok/s':>8}  checks")
    for c in res["cases"]:
        print(f"{c['n']:>7} {c['rows']:>6} {c['ms']:>9.1f} {c['tok_s']:>8,.0f} {c['eager_ms']:>9.1f} "
              f"{c['eager_kernel_ms']:>8.1f} {c['eager_tok_s']:>8,.0f}  {c['checks']}")


if __name__ == "__main__":
    main()
