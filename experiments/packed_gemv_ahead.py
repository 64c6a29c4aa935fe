"""Whether the packed GEMV should load a program's whole share of the weights before its PDL wait: the decode step
of a model with the shipped tiles against tiles of one step per row (``TW`` = the row's words), more programs of
fewer rows, so everything a program reads is in flight while the kernel before it finishes.

``boundary_cost.py`` found it for a chain of bf16 GEMVs (one block of rows a program, all of it loaded before the
wait: 1.56x the PDL chain's speed). The shipped packed GEMV loads its first step of ``TW`` words before the wait
and streams the rest after it; at ``K = 2048`` that is a half or a quarter of its share. Here, in one process:

1. the packed GEMV calls of one decode step of ``--model`` (random NVFP4 weights, fused as ``generate`` runs it):
   their shapes and shipped tiles, recorded by wrapping ``packed_gemv_config``;
2. each distinct shape as a chain of 30 PDL launches on rotating weights (one graph), under each rule, against its
   fp32 reference;
3. the whole step (``lynn_model.bench.graph_decode``: graph replay, its tokens checked against the eager step of the
   same tiles) under each rule: ms a step, tok/s, and whether the tokens equal the shipped tiles' (a different
   ``TW`` sums in another order, so random weights may part).

Rules (``packed_gemv_config`` replaced for M = 1; M = 2 keeps the shipped tile):

* ``shipped``: :func:`lynn_kernels.matmul.triton_packed.packed_gemv_config`;
* ``row ahead``: ``TW`` = the row's words (at most 512), ``BLOCK_N`` so that a program holds as many words as the
  shipped tile's step (at least 4 rows);
* ``row ahead, half rows``: the same with half the rows (at least 2).

    PYTHONPATH=. python3 experiments/packed_gemv_ahead.py [--model qwen3.5-35b-a3b]

Writes ``data/experiments/packed-gemv-ahead/<sha>.json`` (under ``$OUT`` when set). GPU only.
"""

from __future__ import annotations

import argparse
import contextlib
import sys

import torch

import lynn_model
from lynn_kernels import runtime
from lynn_kernels.bench.harness import graph_us, measure_ceilings, provenance, save_experiment
from lynn_kernels.matmul import pack, reference, triton_matmul, triton_packed
from lynn_kernels.metrics import compare
from lynn_kernels.nvfp4 import quantize
from lynn_model.bench import CONTEXT, decode_bytes, graph_decode
from lynn_model.loader import random_model

SHIPPED = triton_packed.packed_gemv_config


def row_ahead(n: int, k: int, sms: int, m: int = 1, half: bool = False) -> dict:
    meta = dict(SHIPPED(n, k, sms, m))
    if m != 1:
        return meta
    kw = runtime.next_power_of_2(max(k // 8, 16))
    tw = min(512, kw)
    block_n = max(4, meta["BLOCK_N"] * meta["TW"] // tw)
    if half:
        block_n = max(2, block_n // 2)
    return {**meta, "BLOCK_N": block_n, "TW": tw}


RULES = {"shipped": SHIPPED,
         "row ahead": row_ahead,
         "row ahead, half rows": lambda n, k, sms, m=1: row_ahead(n, k, sms, m, half=True)}


@contextlib.contextmanager
def rule(name: str, seen: list | None = None):
    """``packed_gemv_config`` replaced by the rule's in the modules that call it (each reads its own name at each
    launch)."""
    fn = RULES[name]

    def config(n, k, sms, m=1):
        meta = fn(n, k, sms, m)
        if seen is not None:
            seen.append({"n": n, "k": k, "m": m, "BLOCK_N": meta["BLOCK_N"], "TW": meta["TW"]})
        return meta

    triton_packed.packed_gemv_config = triton_matmul.packed_gemv_config = config
    try:
        yield
    finally:
        triton_packed.packed_gemv_config = triton_matmul.packed_gemv_config = SHIPPED


def shape_rows(shapes, ceilings, calls: int = 30) -> list[dict]:
    rows = []
    for n, k in shapes:
        ws = [pack(quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16))) for _ in range(calls)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        ys = [torch.empty(1, n, device="cuda", dtype=torch.bfloat16) for _ in range(calls)]
        want = reference.nvfp4_linear(x, ws[0])
        nbytes = sum(w.words.numel() * 4 + w.scales.numel() for w in ws)
        for name in RULES:
            with rule(name):
                meta = triton_packed.packed_gemv_config(n, k, torch.cuda.get_device_properties(0).multi_processor_count,
                                                        1)
                us = graph_us([lambda w=w, y=y: triton_packed.launch_packed_gemv(x, w, None, y, pdl=True)
                               for w, y in zip(ws, ys)])
            rows.append({"n": n, "k": k, "rule": name, "BLOCK_N": meta["BLOCK_N"], "TW": meta["TW"],
                         "us_per_call": us, "gb_s": nbytes / calls / us / 1e3,
                         "frac_of_read": nbytes / calls / us / 1e3 / ceilings.read_gbps,
                         "vs_fp32": compare(ys[0], want).as_dict()})
        ws = ys = None
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3.5-35b-a3b", help="the preset")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("packed_gemv_ahead.py times the GPU decode: no GPU here")
    ceilings = measure_ceilings()
    cfg = lynn_model.preset(args.model)
    res = {"provenance": provenance(f"PYTHONPATH=. python3 experiments/packed_gemv_ahead.py --model {args.model}"),
           "ceilings": ceilings.as_dict(), "model": cfg.name, "context": CONTEXT}
    model = random_model(cfg, weights="nvfp4", device="cuda", seed=0)
    ids = torch.randint(0, cfg.vocab_size, (CONTEXT,), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    nbytes = decode_bytes(model, CONTEXT)
    steps, tokens = [], {}
    for name in RULES:
        seen = []
        with rule(name, seen):
            _, info = graph_decode(model, ids, 1, ceilings, name, nbytes)
            # the step's tokens from the same prefill, for the comparison across rules
            cache = model.new_cache(max_batch=1, max_tokens=CONTEXT + 64)
            slot = cache.add()
            with torch.no_grad():
                tok = model.step(ids, cache, [slot], [CONTEXT]).argmax(-1)
                toks = [int(tok)]
                for _ in range(7):
                    tok = model.step(tok, cache, [slot], [1]).argmax(-1)
                    toks.append(int(tok))
        tokens[name] = toks
        calls = [s for s in seen if s["m"] == 1]
        steps.append({"rule": name, **info, "frac_of_read": nbytes / (info["ms_per_step"] * 1e-3) / 1e9
                      / ceilings.read_gbps, "gemv_launches_recorded": len(calls),
                      "tiles": sorted({(c["n"], c["k"], c["BLOCK_N"], c["TW"]) for c in calls})})
        print(f"{name:22} {info['ms_per_step']:.4f} ms a step  {info['tok_s']:8.1f} tok/s")
    for s in steps:
        s["eager_tokens_equal_shipped"] = tokens[s["rule"]] == tokens["shipped"]
    res["steps"] = steps
    res["tokens"] = tokens
    shapes = sorted({(t[0], t[1]) for t in steps[0]["tiles"]})
    model = None
    torch.cuda.empty_cache()
    res["shapes"] = shape_rows(shapes, ceilings)
    save_experiment("packed-gemv-ahead", res)
    print(f"{cfg.name}, batch 1, {CONTEXT} context, {nbytes / 1e9:.2f} GB a step, read ceiling "
          f"{ceilings.read_gbps:,.0f} GB/s")
    for s in steps:
        print(f"{s['rule']:22} {s['ms_per_step']:.4f} ms  {s['tok_s']:8.1f} tok/s  {s['frac_of_read']:6.1%} of read  "
              f"same eager tokens as shipped {s['eager_tokens_equal_shipped']}  tiles {s['tiles']}")
    for r in res["shapes"]:
        print(f"{r['n']:6} x {r['k']:5}  {r['rule']:22} BLOCK_N {r['BLOCK_N']:3} TW {r['TW']:4}  "
              f"{r['us_per_call']:7.2f} us  {r['frac_of_read']:6.1%} of read  cos {r['vs_fp32']['cosine']:.6f}")


if __name__ == "__main__":
    main()
