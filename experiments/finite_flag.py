"""What does a finite-logits flag add to the decode step's epilogue (``lynn_model.DecodeStep``)?

CUDA-graph replay (100 calls in one graph, median of 20 replays) on Qwen3.5-35B-A3B's logits (vocabulary 248,320,
bf16) at batch 1 and 8 of: the argmax alone; the argmax and a flag from a reduction over the vocabulary
(``isfinite(amax)``); the argmax and a flag from the chosen token's logit (a gather: what the decode step does now).
GPU only. Discussed in docs/reliability.md (damaged and hostile inputs).

    PYTHONPATH=. python3 experiments/finite_flag.py

Writes ``data/experiments/finite-flag/<sha>.json`` (under ``$OUT`` when set); ``cdea5f0.json`` measured the reduction
(+15 us a step); ``ce403bc.json`` all three: the gather adds 8.6 us at batch 1 and 8.3 us at batch 8 (three small
kernels: gather, isfinite, copy), the reduction 14.4 and 15.5 us, against a 2.08 ms fused step.
"""

from __future__ import annotations

import torch

from lynn_kernels.bench.harness import graph_us, provenance, save_experiment

VOCAB = 248_320


def forms(logits: torch.Tensor, out: torch.Tensor) -> dict:
    def argmax():
        torch.argmax(logits, -1, out=out[0])

    def amax_flag():
        argmax()
        out[1].copy_(torch.isfinite(logits.amax(-1)))

    def gather_flag():
        argmax()
        out[1].copy_(torch.isfinite(logits.gather(-1, out[0][:, None])).squeeze(-1))

    return {"argmax": argmax, "argmax+amax": amax_flag, "argmax+gather": gather_flag}


def main() -> None:
    res = {"provenance": provenance(), "us_per_call": {}}
    for rows in (1, 8):
        logits = torch.randn(rows, VOCAB, device="cuda", dtype=torch.bfloat16)
        out = torch.zeros(2, rows, dtype=torch.int64, device="cuda")
        for name, fn in forms(logits, out).items():
            res["us_per_call"][f"{name} rows={rows}"] = us = graph_us([fn] * 100)
            print(f"{name:>14} rows={rows}: {us:6.2f} us")
    save_experiment("finite-flag", res)


if __name__ == "__main__":
    main()
