"""Where an unrolled verify step first parts from the decode steps it stands for, module by module (GPU).

Greedy speculative decoding is token-exact only if the verify's rows get the decode step's bits (docs/decoder.md,
"On a GPU, the rows are not yet invariant"). This finds which modules break that: a Qwen3.5-35B-A3B-shaped model
cut to 4 layers (3 Gated DeltaNet, 1 attention; random NVFP4 weights, fused as ``lynn generate`` runs it), a
64-token prompt per sequence, then ``U`` tokens as one unrolled step and as ``U`` decode steps, with a forward hook
on every layer's mixer, MoE block and each projection inside the mixer. Per module: whether its input and its output
have the same bits both ways, and the largest difference of the output; the first module whose output differs while
its input does not is the culprit. Batch 1 and 8, U = 2, 3 and 4.

    PYTHONPATH=. python3 experiments/unroll_bits.py

Writes ``data/experiments/unroll-bits/<sha>.json`` (under ``$OUT`` when set). GPU only.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

import lynn_model
from lynn_kernels.bench.harness import provenance, save_experiment
from lynn_model.loader import random_model

CASES = ((1, 2), (1, 3), (1, 4), (8, 2), (8, 3), (8, 4))     # (batch, tokens a sequence): k = 1..3


def watched(model) -> dict[str, nn.Module]:
    """The modules to hook: each layer's mixer and MLP, and the projections inside the mixer."""
    mods = {}
    for i, layer in enumerate(model.layers):
        mods[f"L{i}.{layer.kind}"] = layer.mixer
        for name, m in layer.mixer.named_children():
            if hasattr(m, "weight"):
                mods[f"L{i}.{layer.kind}.{name}"] = m
        mods[f"L{i}.mlp"] = layer.mlp
    return mods


def same(a, b) -> bool | None:
    """Whether ``a`` and ``b`` hold the same bits (None: one is missing, or their sizes differ)."""
    if a is None or b is None or a.numel() != b.numel():
        return None
    return bool(torch.equal(a.reshape(b.shape), b))


def first_tensor(v):
    return v if isinstance(v, torch.Tensor) else None


def run_case(model, config, batch: int, u: int, g, mods) -> dict:
    rec: dict[str, list] = {}
    hooks = [m.register_forward_hook(lambda mod, inp, out, key=k: rec.setdefault(key, []).append(
        (first_tensor(inp[0]) if inp else None, first_tensor(out)))) for k, m in mods.items()]
    ids = torch.randint(0, config.vocab_size, (batch * 64,), generator=g).cuda()
    extra = torch.randint(0, config.vocab_size, (batch, u), generator=g).cuda()
    got = {}
    try:
        for unrolled in (False, True):
            cache = model.new_cache(batch, batch * 128)
            slots = [cache.add() for _ in range(batch)]
            model.step(ids, cache, slots, [64] * batch)
            rec.clear()
            if unrolled:
                logits = model.step(extra.reshape(-1), cache, slots, [u] * batch, all_logits=True, unroll=True)
                got["unrolled"] = ({k: v[0] for k, v in rec.items()}, logits)
            else:
                steps = [model.step(extra[:, j].contiguous(), cache, slots, [1] * batch) for j in range(u)]
                per = {}
                for k, calls in rec.items():      # U calls of N rows -> N U rows, sequence-major as unrolled
                    per[k] = tuple(None if calls[0][i] is None else
                                   torch.stack([c[i].reshape(batch, -1) for c in calls], 1).reshape(batch * u, -1)
                                   for i in (0, 1))
                got["decode"] = (per, torch.stack(steps, 1).reshape(batch * u, -1))
    finally:
        for h in hooks:
            h.remove()
    rows = []
    for k in mods:
        if k not in got["unrolled"][0] or k not in got["decode"][0]:
            continue
        (ui, uo), (di, do) = got["unrolled"][0][k], got["decode"][0][k]
        diff = None if uo is None or do is None or uo.numel() != do.numel() else \
            float((uo.reshape(do.shape).float() - do.float()).abs().max())
        rows.append({"module": k, "same_input": same(ui, di), "same_output": same(uo, do), "max_abs_diff": diff})
    lu, ld = got["unrolled"][1], got["decode"][1]
    return {"batch": batch, "tokens": u, "logits_equal": bool(torch.equal(lu, ld)),
            "argmax_equal": bool(torch.equal(lu.argmax(-1), ld.argmax(-1))),
            "max_logit_diff": float((lu.float() - ld.float()).abs().max()), "modules": rows}


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("unroll_bits.py compares compiled GPU kernels: no GPU here")
    config = lynn_model.preset("qwen3.5-35b-a3b").replace(num_hidden_layers=4)
    model = random_model(config, device="cuda")                  # fused for decode, as loaded on a GPU
    mods = watched(model)
    res = {"provenance": provenance("PYTHONPATH=. python3 experiments/unroll_bits.py"), "cases": []}
    g = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for batch, u in CASES:
            case = run_case(model, config, batch, u, g, mods)
            res["cases"].append(case)
            culprits = [r["module"] for r in case["modules"] if r["same_input"] and r["same_output"] is False]
            print(f"batch {batch}, {u} tokens: logits equal {case['logits_equal']}, argmax equal "
                  f"{case['argmax_equal']}, largest logit difference {case['max_logit_diff']:.3g}; modules whose "
                  f"output differs from the same input: {culprits or 'none'}", flush=True)
    save_experiment("unroll-bits", res)


if __name__ == "__main__":
    main()
