"""Qwen3-Next-80B-A3B shape, random NVFP4 weights: the 4-layer trunk stage by stage, kernel path against reference
path, to find where the decoder benchmark's gate failed at 3182a39 (GPU machine only; its runs:
data/experiments/qwen3-next-trunk-diag/*.txt).

    PYTHONPATH=. python3 experiments/qwen3_next_trunk_diag.py [--dirty] [--repeats 3] [--layers 0] [--out $OUT/trunk_diag.json]

`experiments/qwen3_next_validation_diag.py` found every module of layers 0 and 3 in agreement on fresh inputs, while
the benchmark's 4-layer logits disagreed (cosine 0.707). This runs what the benchmark runs, ``Model._trunk``'s chain
(embedding, each layer's mixer, post-attention norm with the residual, MoE, the next norm with the residual, the LM
head), with each stage given the kernel path's own input and computed twice, on the kernels and on the references,
so the first stage that disagrees is the culprit; ``--dirty`` first measures the benchmark's ceilings (large
random tensors written and freed), as ``lynn bench`` does before building the model, in case the fault needs
memory that is not fresh; ``--repeats`` runs the kernel chain again to see whether it is deterministic.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

import lynn_kernels
import lynn_model
from lynn_kernels.metrics import compare
from lynn_model.cache import Batch
from lynn_model.loader import random_model


def stages(model, ids, n_layers):
    """(name, fn(input) -> output) for each stage of the trunk; the inputs chain on the kernel path."""
    batch = Batch.uncached([ids.numel()], ids.device)
    out = [("embedding", lambda _: F.embedding(ids, model.embed_tokens))]
    out.append(("layer 0 input_layernorm", lambda h: (model.layers[0].input_layernorm(h), h)))
    for i in range(n_layers):
        layer = model.layers[i]
        nxt = model.layers[i + 1].input_layernorm if i + 1 < n_layers else model.norm
        out += [(f"layer {i} {layer.kind} mixer", lambda xh, L=layer: (L.mixer(xh[0], batch, None), xh[1])),
                (f"layer {i} post_attention_layernorm + residual",
                 lambda ah, L=layer: L.post_attention_layernorm(ah[0], residual=ah[1])),
                (f"layer {i} mlp", lambda xh, L=layer: (L.mlp(xh[0]), xh[1])),
                (f"layer {i} next norm + residual", lambda mh, N=nxt: N(mh[0], residual=mh[1]))]
    out.append(("lm_head", lambda xh: model.lm_head(xh[0])))
    return out


def first(t):
    return t[0] if isinstance(t, tuple) else t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dirty", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=80)
    ap.add_argument("--layers", type=int, default=4, help="layers of the trunk to chain (0: all of them)")
    ap.add_argument("--determinism", type=int, default=0, metavar="N",
                    help="only run each stage N times on the kernels, on one input, and list the stages whose outputs "
                         "differ between runs")
    ap.add_argument("--preset", default="qwen3-next-80b-a3b", help="e.g. tiny-qwen3-next to try it on a CPU")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "out"), "trunk_diag.json"))
    args = ap.parse_args()
    if args.dirty:
        from lynn_kernels.bench.harness import measure_ceilings

        print("ceilings:", measure_ceilings(), flush=True)
    cfg, dev = lynn_model.preset(args.preset), lynn_kernels.runtime.DEVICE
    model = random_model(cfg, weights="nvfp4", device=dev, seed=0)
    gen = torch.Generator(device=dev).manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (args.tokens,), device=dev, generator=gen)
    rec = {"git_sha": os.environ.get("LYNN_GIT_SHA"), "preset": args.preset, "dirty": args.dirty, "tokens": args.tokens, "stages": [],
           "repeats": []}
    n_layers = args.layers or len(model.layers)
    rec["layers"] = n_layers
    chain = stages(model, ids, n_layers)
    x = None
    if args.determinism:
        rec["unequal_stages"] = []
        with torch.no_grad():
            for name, fn in chain:
                outs = [first(fn(x)).clone() for _ in range(args.determinism)]
                same = [bool(torch.equal(outs[0], o)) for o in outs[1:]]
                if not all(same):
                    d = max(float((outs[0].float() - o.float()).abs().max()) for o in outs[1:])
                    rec["unequal_stages"].append({"stage": name, "equal": same, "max_abs_diff": d})
                    print(f"{name:48s} runs equal {same} max diff {d:.3e}", flush=True)
                x = fn(x)
        print(f"tokens {args.tokens}: {len(rec['unequal_stages'])} of {len(chain)} stages differ between runs")
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(rec, f, indent=1)
        return 0
    with torch.no_grad():
        for name, fn in chain:
            got = fn(x)
            with lynn_kernels.use_reference():
                want = fn(x)
            m = compare(first(got).float(), first(want).float())
            rows = first(got).float().reshape(first(got).shape[0], -1)
            zero_rows = int((rows.abs().sum(-1) == 0).sum())
            rec["stages"].append({"stage": name, "cosine": m.cosine, "rel_l2": m.rel_l2, "max_abs": m.max_abs,
                                  "zero_rows_kernel": zero_rows})
            print(f"{name:48s} cos {m.cosine:.6f} rel_l2 {m.rel_l2:.3e} zero rows {zero_rows}", flush=True)
            x = got
        logits = [first(x).float()]
        for _ in range(args.repeats - 1):
            y = None
            for _, fn in chain:
                y = fn(y)
            logits.append(first(y).float())
        rec["repeats"] = [bool(torch.equal(logits[0], t)) for t in logits[1:]]
        sh = torch.nn.Module.__new__(type(model))
        sh.__dict__.update(model.__dict__)
        sh._modules = dict(model._modules)
        sh.layers = model.layers[:n_layers]
        full_k = sh.forward(ids[None]).float()[0]
        with lynn_kernels.use_reference():
            full_r = sh.forward(ids[None]).float()[0]
        m = compare(full_k, full_r)
        rec["forward"] = {"cosine": m.cosine, "rel_l2": m.rel_l2,
                          "equal_to_chain": bool(torch.equal(full_k, logits[0]))}
    print("kernel chain repeats equal:", rec["repeats"])
    print(f"Model.forward over {n_layers} layers:", rec["forward"])
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(rec, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
