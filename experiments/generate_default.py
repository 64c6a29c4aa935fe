"""What ``lynn_model.generate()`` with its default arguments gives at batch 1 on a GPU, on the model as the loaders
give it there (``fuse=None``: fused for decode) against the same weights as stored (``fuse=False``).

Random NVFP4 weights of ``--model`` (Qwen3.5-35B-A3B), a 4,096-token prompt, 128 new tokens greedy, in one
process: each form is built from the same seed, ``generate`` runs once to compile and capture, then once timed
(``Stats``: decode tok/s, the host reading tokens one step behind). Also recorded: that the default form came fused
(nothing left for ``fuse_input_projections``), the bytes a step reads and the fraction of the measured read
ceiling, and whether the two forms chose the same tokens (they are within bf16 rounding of each other, not
bit-equal, so random weights may part somewhere).

    PYTHONPATH=. python3 experiments/generate_default.py [--model PRESET]

Writes ``data/experiments/generate-default/<sha>.json`` (under ``$OUT`` when set). GPU only.
"""

from __future__ import annotations

import argparse
import sys

import torch

import lynn_model
from lynn_kernels.bench.harness import measure_ceilings, provenance, save_experiment
from lynn_model.bench import CONTEXT, decode_bytes
from lynn_model.loader import random_model

NEW_TOKENS = 128


def timed(model, prompt: torch.Tensor) -> tuple[dict, list[int]]:
    lynn_model.generate(model, prompt, 16)                       # compile, autotune, capture
    stats = lynn_model.Stats()
    out = lynn_model.generate(model, prompt, NEW_TOKENS, stats=stats)
    return ({"decode_tok_s": stats.decode_tok_s, "ms_per_step": stats.decode_s * 1e3 / max(1, stats.decode_steps),
             "decode_steps": stats.decode_steps, "prefill_tok_s": stats.prefill_tok_s, "capture_s": stats.capture_s,
             "cuda_graph": stats.cuda_graph, "launch_us_per_step": stats.launch_s * 1e6 / max(1, stats.decode_steps),
             "wait_frac": stats.wait_s / stats.decode_s if stats.decode_s else 0.0}, out[0, prompt.shape[1]:].tolist())


def fused(model) -> bool:
    """Every mixer's input projections stacked (the originals gone) and every Gated DeltaNet layer on the one-kernel
    decode step: ``fuse_for_decode()``'s form, read without changing the model."""
    return all(not hasattr(layer.mixer, "q_proj" if layer.kind == "full_attention" else "in_proj_qkv")
               and (layer.kind == "full_attention" or layer.mixer.fused_decode) for layer in model.layers)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3.5-35b-a3b", help="the preset")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("generate_default.py times the GPU decode: no GPU here")
    ceilings = measure_ceilings()
    cfg = lynn_model.preset(args.model)
    prompt = torch.randint(0, cfg.vocab_size, (1, CONTEXT), generator=torch.Generator().manual_seed(1))
    res = {"provenance": provenance(f"PYTHONPATH=. python3 experiments/generate_default.py --model {args.model}"),
           "ceilings": ceilings.as_dict(), "model": cfg.name, "context": CONTEXT, "new_tokens": NEW_TOKENS}
    tokens = {}
    for label, fuse in (("default (fuse=None)", None), ("as stored (fuse=False)", False)):
        model = random_model(cfg, weights="nvfp4", device="cuda", seed=0, fuse=fuse)
        row, tokens[label] = timed(model, prompt)
        row.update(fuse=fuse, fused=fused(model), bytes_per_step=decode_bytes(model, CONTEXT))
        row["frac_of_read"] = row["bytes_per_step"] / (row["ms_per_step"] * 1e-3) / 1e9 / ceilings.read_gbps
        res[label] = row
        print(f"{label}: {row['decode_tok_s']:.1f} tok/s ({row['ms_per_step']:.3f} ms/step, "
              f"{row['frac_of_read']:.1%} of read), fused {row['fused']}", flush=True)
        del model
        torch.cuda.empty_cache()
    a, b = tokens.values()
    res["same_tokens"] = a == b
    res["first_differing_token"] = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    print(f"same tokens: {res['same_tokens']} (first difference at {res['first_differing_token']})", flush=True)
    save_experiment("generate-default", res)


if __name__ == "__main__":
    main()
