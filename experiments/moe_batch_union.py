"""Does the MoE block of a decode batch pay for the experts its tokens share, and would reading the union of the
batch's experts once (expert-grouped) be faster than today's one program per slot?

The block of a decode batch (``M <= 16``, packed experts with the shared expert as slot ``top_k``: three launches)
runs gate_up over every ``(token, slot)`` pair and down per token, so an expert picked by several tokens, and the
shared expert picked by all of them, is loaded and decoded once per slot. Its grid walks the slots fastest, so the
copies of one expert's tile are requested close together and may come from L2 rather than HBM. Two measurements
settle what grouping could win:

* **routing with more or fewer shared experts**: the same block on inputs routed three ways: ``random`` (Qwen3.5's
  E = 256, top-8: at M = 8 about 57 distinct experts of 64 picks), ``distinct`` (every token its own 8 experts:
  ``M x 8`` distinct, the most bytes) and ``same`` (every token the same 8: 8 distinct, the fewest). If the block's
  time follows the slot count and not the distinct experts, the duplicates are not read from HBM twice and grouping
  would save only their decode arithmetic;
* **an expert-grouped path that exists**: the prefill path forced below ``M = 17`` (``DECODE_MAX_M = 0``): the
  router, align (slots grouped by expert), the shared expert in dense mode, tensor-core gate_up and down once per
  expert's row block, the ordered combine; each expert's tile is decoded once for all its tokens.

Random NVFP4 weights of the Qwen3.5-35B-A3B shape, M in 2, 4, 8, 16; each figure is per
block by CUDA-graph replay of 8 blocks with distinct weights in a row, so the experts come from HBM. Each output is
compared with the fp32 reference (cosine, max abs error), and the two paths' outputs with each other.

    PYTHONPATH=. python3 experiments/moe_batch_union.py [--tokens 2 4 8 16] [--blocks 8]

Writes ``data/experiments/moe-batch-union/<sha>.json`` (under ``$OUT`` when set). GPU only.
"""

from __future__ import annotations

import argparse
import contextlib
import sys

import torch

from lynn_kernels.bench.harness import graph_us, measure_ceilings, provenance, save_experiment
from lynn_kernels.lab.shapes import MODELS
from lynn_kernels.metrics import compare
from lynn_kernels.moe import SharedExpert, moe_block, pack_experts, reference
from lynn_kernels.moe import triton_experts as te
from lynn_kernels.nvfp4 import quantize

ROUTINGS = ("random", "distinct", "same")
PATHS = ("slots (shipped)", "expert-grouped (prefill path)")
DEVICE = "cuda"


def build_block(d, seed: int) -> tuple:
    """One block's router, packed experts and shared expert (the decoder's layout), from ``seed``."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    E, H, I = d.experts, d.hidden, d.expert_inter

    def randn(*shape, scale=0.05):
        return (torch.randn(*shape, generator=g, device=DEVICE, dtype=torch.float32) * scale).to(torch.bfloat16)

    w13, w2 = quantize(randn(E, 2 * I, H)), quantize(randn(E, H, I))
    shared = SharedExpert(quantize(randn(2 * I, H)), quantize(randn(H, I)), randn(1, H))
    router = randn(E, H)
    w13p, w2p, sharedp = pack_experts(w13, w2, shared)
    return router, w13p, w2p, sharedp


def routed_inputs(d, router: torch.Tensor, m: int, routing: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x [m, H], router [E, H])`` that route ``routing``: the router as built, or with a bump that sends token t
    to experts ``8t .. 8t + 7`` (``distinct``) or every token to experts 0..7 (``same``)."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(m, d.hidden, generator=g, device=DEVICE).to(torch.bfloat16)
    if routing == "random":
        return x, router
    top_k = d.top_k
    r = router.clone()
    x[:, :m] = 0
    for t in range(m):
        group = t if routing == "distinct" else 0
        x[t, group] = 30.0                  # well above the other logits (std about 2.3): exactly these
        r[group * top_k:(group + 1) * top_k, :m] = 0
        r[group * top_k:(group + 1) * top_k, group] = 1.0
    return x, r


def distinct_experts(x, router, top_k: int) -> int:
    logits = (x.float() @ router.float().t()).to(x.dtype).float()
    return int(torch.unique(logits.topk(top_k, dim=-1).indices).numel())


@contextlib.contextmanager
def path(name: str):
    was = te.DECODE_MAX_M
    te.DECODE_MAX_M = was if name == PATHS[0] else 0
    try:
        yield
    finally:
        te.DECODE_MAX_M = was


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument("--blocks", type=int, default=8, help="distinct blocks replayed in a row (weights from HBM)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("moe_batch_union.py times GPU kernels: no GPU here")
    d = MODELS["qwen3.5-35b-a3b"]
    res = {"provenance": provenance("PYTHONPATH=. python3 experiments/moe_batch_union.py " + " ".join(sys.argv[1:])),
           "ceilings": measure_ceilings().as_dict(), "model": "qwen3.5-35b-a3b", "blocks": args.blocks,
           "expert_bytes": 3 * d.expert_inter * d.hidden * 9 // 16, "rows": []}
    blocks = [build_block(d, seed) for seed in range(args.blocks)]
    rows = []
    with torch.inference_mode():
        for m in args.tokens:
            for routing in ROUTINGS:
                sets = [routed_inputs(d, b[0], m, routing, 100 + i) for i, b in enumerate(blocks)]
                distinct = distinct_experts(*sets[0], d.top_k)
                want = reference.moe_block(sets[0][0], sets[0][1], *blocks[0][1:], top_k=d.top_k)
                outs = {}
                for p in PATHS:
                    row = {"tokens": m, "routing": routing, "path": p, "distinct_routed": distinct,
                           "slots": m * (d.top_k + 1)}
                    try:
                        with path(p):
                            calls = [lambda s=s, b=b: moe_block(s[0], s[1], *b[1:], top_k=d.top_k)
                                     for s, b in zip(sets, blocks)]
                            out = moe_block(sets[0][0], sets[0][1], *blocks[0][1:], top_k=d.top_k)
                            us = graph_us(calls)
                        outs[p] = out
                        met = compare(out, want)
                        row.update(us=us, cosine=met.cosine, max_abs=met.max_abs,
                                   gb_s=(distinct + 1) * res["expert_bytes"] / us / 1e3)
                    except Exception as err:          # a path that fails here is a result, not the end of the run
                        row["error"] = f"{type(err).__name__}: {err}"[:300]
                    rows.append(row)
                if len(outs) == 2:
                    a, b = outs.values()
                    rows[-1]["max_abs_between_paths"] = float((a.float() - b.float()).abs().max())
                    rows[-1]["paths_bit_equal"] = bool(torch.equal(a, b))
    res["rows"] = rows
    save_experiment("moe-batch-union", res)
    print(f"{'M':>3} {'routing':9} {'distinct':>8} {'path':32} {'us':>8} {'GB/s':>7} {'cosine':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['tokens']:3d} {r['routing']:9} {r['distinct_routed']:8d} {r['path']:32} {r['error'][:60]}")
        else:
            print(f"{r['tokens']:3d} {r['routing']:9} {r['distinct_routed']:8d} {r['path']:32} {r['us']:8.1f} "
                  f"{r['gb_s']:7.0f} {r['cosine']:9.6f}")


if __name__ == "__main__":
    main()
