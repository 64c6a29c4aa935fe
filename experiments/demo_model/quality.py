"""What 4-bit weights cost on the demo model: held-out perplexity and greedy agreement, through our decoder.

    python experiments/demo_model/quality.py        # CPU, torch reference path, about 10 minutes
                                                     # -> data/models/lynn-demo/quality.json

Every variant is a checkpoint folder written the way a user would get it and loaded by ``lynn_model`` as stored:

* ``bf16``: the shipped checkpoint;
* ``nvfp4-ct`` / ``nvfp4-modelopt``: ``lynn quantize`` in the compressed-tensors layout and recipe, and in the
  ModelOpt layout and recipe: attention, shared-expert and routed-expert projections (the Gated DeltaNet projections,
  routers, gates and the tied embedding / LM head stay bf16, as published NVFP4 checkpoints keep them);
* ``nvfp4-all``: also the Gated DeltaNet ``in_proj_qkv`` / ``in_proj_z`` / ``out_proj`` (``--quantize-linear-attn``);
* ``nvfp4-experts``: the routed experts only;
* ``bf16+nvfp4-head`` / ``nvfp4-ct+nvfp4-head``: those two with the (tied) LM head quantised to NVFP4 on load
  (``lynn_model.from_pretrained(lm_head="nvfp4")``, the modelopt recipe; the embedding lookup keeps the bf16 table);
* ``int4-g32`` / ``int4-g128``: plain symmetric round-to-nearest int4 with one bf16 scale (``absmax / 7``) per group of
  32 or 128 weights along K, on the same modules as ``nvfp4-ct``, stored dequantised in bf16 (a reference point:
  int4 g32 spends the same 4.5 bits per weight as NVFP4's 4 bits + one 8-bit scale per 16).

Perplexity: exp of the mean next-token cross-entropy over the committed held-out slice (``data/corpus/heldout.txt``)
cut into non-overlapping windows of ``--window`` tokens, each scored from its second token, logits from a bf16
forward. Greedy agreement: ``--prompts`` prompts (the first ``--prompt-len`` tokens of as many held-out windows),
``--new`` greedy tokens each, compared with the bf16 model's: the fraction of positions equal, and the mean number of
tokens before the first difference.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

import lynn_kernels
import lynn_model
from lynn_model.quantize import is_default_target, quantize_checkpoint

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "data" / "models" / "lynn-demo"
HELDOUT = ROOT / "data" / "corpus" / "heldout.txt"


def int4_folder(src: Path, dst: Path, group: int) -> dict:
    """Copy of ``src`` whose default NVFP4 targets hold int4-RTN-dequantised bf16 weights."""
    shutil.copytree(src, dst)
    n = 0
    for f in sorted(dst.glob("*.safetensors")):
        sd = load_file(f)
        for name, w in sd.items():
            if name.endswith(".weight") and is_default_target(name[: -len(".weight")]):
                g = w.float().reshape(w.shape[0], -1, group)
                scale = (g.abs().amax(-1, keepdim=True) / 7).to(torch.bfloat16).float()
                q = torch.where(scale > 0, (g / scale).round().clamp(-8, 7), 0.0)
                sd[name] = (q * scale).reshape(w.shape).to(w.dtype)
                n += 1
        save_file(sd, f, metadata={"format": "pt"})
    return {"n_quantized": n, "bits_per_weight": 4 + 16 / group}


def variants(tmp: Path) -> dict[str, tuple[Path, dict]]:
    out = {"bf16": (MODEL, {"what": "the shipped bf16 checkpoint"})}
    specs = {
        "nvfp4-ct": {"format": "compressed-tensors"},
        "nvfp4-modelopt": {"format": "modelopt"},
        "nvfp4-all": {"format": "modelopt", "quantize_linear_attn": True},
        "nvfp4-experts": {"format": "modelopt", "ignore": (r"\.self_attn\.", r"\.shared_expert\.")},
    }
    for name, kw in specs.items():
        s = quantize_checkpoint(MODEL, tmp / name, progress=False, **kw)
        out[name] = (tmp / name, {"lynn_quantize": kw | {"ignore": list(kw.get("ignore", ()))},
                                  "n_quantized": s["n_quantized"], "n_kept": s["n_kept"],
                                  "bytes_before": s["bytes_before"], "bytes_after": s["bytes_after"]})
    for group in (32, 128):
        out[f"int4-g{group}"] = (tmp / f"int4-g{group}", int4_folder(MODEL, tmp / f"int4-g{group}", group))
    # the tied LM head quantised on load (lynn_model.from_pretrained(lm_head="nvfp4")), the embedding kept
    out["bf16+nvfp4-head"] = (MODEL, {"what": "the shipped checkpoint, its LM head NVFP4 on load",
                                      "load": {"lm_head": "nvfp4"}})
    out["nvfp4-ct+nvfp4-head"] = (tmp / "nvfp4-ct", dict(out["nvfp4-ct"][1], load={"lm_head": "nvfp4"}))
    return out


@torch.no_grad()
def perplexity(model, ids: torch.Tensor, window: int, batch: int) -> tuple[float, int]:
    w = ids[: ids.numel() // window * window].view(-1, window)
    tot, n = 0.0, 0
    for i in range(0, w.shape[0], batch):
        x = w[i:i + batch]
        logits = model.forward(x)[:, :-1].float()
        tot += torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), reduction="sum").item()
        n += x[:, 1:].numel()
    return float(torch.tensor(tot / n).exp()), n


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--kernels", action="store_true",
                    help="run on the Triton kernels on the runtime's device (compiled on a GPU) instead of the "
                         "torch reference on the CPU")
    ap.add_argument("--out", default=str(MODEL / "quality.json"))
    args = ap.parse_args()
    # the commit the measured code is at: read before the run (a long run may see later commits land)
    sha = os.environ.get("LYNN_GIT_SHA") or subprocess.run(["git", "rev-parse", "HEAD"], check=True, cwd=ROOT,
                                                            capture_output=True, text=True).stdout.strip()
    tok = lynn_model.Tokenizer.from_pretrained(MODEL)
    ids = torch.tensor(tok.encode(HELDOUT.read_text()))
    starts = torch.arange(args.prompts) * (ids.numel() // args.prompts)
    prompts = torch.stack([ids[s:s + args.prompt_len] for s in starts.tolist()])
    rows, greedy = {}, {}
    t_all = time.perf_counter()
    where = (contextlib.nullcontext() if args.kernels else lynn_kernels.use_reference())
    device = None if args.kernels else "cpu"
    with tempfile.TemporaryDirectory() as tmp, where:
        for name, (folder, meta) in variants(Path(tmp)).items():
            t0 = time.perf_counter()
            model = lynn_model.from_pretrained(folder, weights="auto", device=device, **meta.get("load", {}))
            ppl, n = perplexity(model, ids.to(model.device), args.window, args.batch)
            out = lynn_model.generate(model, prompts.to(model.device), args.new, temperature=0.0)
            greedy[name] = out[:, args.prompt_len:].cpu()
            rows[name] = dict(meta, perplexity=ppl, tokens_scored=n, seconds=round(time.perf_counter() - t0, 1))
            print(f"{name:>15}: perplexity {ppl:7.3f}  ({rows[name]['seconds']} s)", flush=True)
    base = greedy["bf16"]
    for name, out in greedy.items():
        same = out == base
        first = torch.where(same.all(1), args.new, (~same).int().argmax(1))
        rows[name]["greedy_match"] = same.float().mean().item()
        rows[name]["greedy_tokens_before_first_difference"] = first.float().mean().item()
        rows[name]["perplexity_vs_bf16"] = rows[name]["perplexity"] / rows["bf16"]["perplexity"]
    record = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "git_sha": sha,
        "torch": torch.__version__, "backend": "torch reference (lynn_kernels.use_reference), CPU, bf16 activations",
        "command": "python experiments/demo_model/quality.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
        "heldout": str(HELDOUT.relative_to(ROOT)), "heldout_tokens": int(ids.numel()), "window": args.window,
        "prompts": args.prompts, "prompt_len": args.prompt_len, "new_tokens": args.new,
        "seconds": round(time.perf_counter() - t_all, 1), "variants": rows,
        "greedy_tokens": {k: v.tolist() for k, v in greedy.items()}, "prompt_tokens": prompts.tolist()}
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(f"-> {args.out}")
    for name, r in rows.items():
        print(f"{name:>15}  ppl {r['perplexity']:7.3f}  x{r['perplexity_vs_bf16']:.4f}  greedy match "
              f"{r['greedy_match']:.3f}  first diff {r['greedy_tokens_before_first_difference']:.1f}")


if __name__ == "__main__":
    main()
