"""What does the loader's check of damaged weights (``lynn_model.loader.WeightCheck``) cost on a real checkpoint?

A random NVFP4 model of the preset, cut into tensors as a checkpoint stores them (per expert and projection: 92,873
tensors for Qwen3.5-35B-A3B), is checked as ``from_pretrained`` checks a load (``add`` each tensor, ``verify`` every
1/40 of them: a shard), three times; beside it, the host-to-device copy of 2 GiB that a load makes anyway, scaled to
the checkpoint's bytes. Discussed in docs/decoder.md, section 4.

    PYTHONPATH=. python3 experiments/weight_check.py [--preset qwen3.5-35b-a3b]     # GPU
    PYTHONPATH=. python3 experiments/weight_check.py --preset tiny-qwen3.5-moe      # CPU: a quick run of the same

Writes ``data/experiments/weight-check/<preset>-<sha>.json`` (``$OUT`` instead when set); the committed runs are
``2eee0df-per-tensor.json`` (one check per tensor, 6.1 s) and ``cdea5f0.json`` (small tensors joined, 0.33-0.42 s).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

import lynn_model
from lynn_kernels import NVFP4Tensor, runtime
from lynn_kernels.bench.harness import provenance
from lynn_model.checkpoint import Entry
from lynn_model.loader import WeightCheck, random_model
from lynn_model.model import GatedDeltaNet, Linear, SparseMoE

ROOT = Path(__file__).resolve().parents[1]
SHARDS = 40


def sync() -> None:
    if runtime.DEVICE.type == "cuda":
        torch.cuda.synchronize()


def checkpoint_tensors(model) -> list[tuple[Entry, torch.Tensor]]:
    """The model's tensors under the names and cuts of a checkpoint (one entry per expert and projection)."""
    items: list[tuple[Entry, torch.Tensor]] = []
    shard = Path(f"model-00001-of-{SHARDS:05d}.safetensors")

    def add(name: str, t: torch.Tensor) -> None:
        items.append((Entry(name, shard, t.dtype, tuple(t.shape)), t))

    def nvfp4(name: str, codes, scales, g) -> None:
        add(name + ".weight_packed", codes)
        add(name + ".weight_scale", scales)
        add(name + ".weight_global_scale", g.reshape(1))

    add("model.embed_tokens.weight", model.embed_tokens)
    for name, m in model.named_modules():
        if isinstance(m, Linear):
            w = m.weight
            if isinstance(w, NVFP4Tensor):
                nvfp4(name, w.codes, w.scales, w.global_scale)
            else:
                add(name + ".weight", w)
        elif isinstance(m, GatedDeltaNet):
            for a in ("conv_weight", "dt_bias", "A_log", "norm_weight"):
                add(f"{name}.{a}", getattr(m, a))
        elif isinstance(m, SparseMoE):
            add(name + ".gate.weight", m.router)
            w13, w2 = m.w13, m.w2
            n = w13.codes.shape[1] // 2
            for e in range(w13.codes.shape[0]):
                nvfp4(f"{name}.experts.{e}.gate_proj", w13.codes[e, :n], w13.scales[e, :n], w13.global_scale[e, 0])
                nvfp4(f"{name}.experts.{e}.up_proj", w13.codes[e, n:], w13.scales[e, n:], w13.global_scale[e, n])
                nvfp4(f"{name}.experts.{e}.down_proj", w2.codes[e], w2.scales[e], w2.global_scale[e])
        elif isinstance(getattr(m, "weight", None), torch.Tensor):
            add(name + ".weight", m.weight)
    return items


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3.5-35b-a3b")
    args = ap.parse_args()
    cfg = lynn_model.preset(args.preset)
    t0 = time.perf_counter()
    model = random_model(cfg, weights="nvfp4", layout="checkpoint")
    sync()
    build_s = time.perf_counter() - t0
    items = checkpoint_tensors(model)
    per_shard = max(1, len(items) // SHARDS)
    check_s = []
    for _ in range(3):
        sync()
        t0 = time.perf_counter()
        chk = WeightCheck()
        for i, (e, t) in enumerate(items):
            chk.add(e, t)
            if (i + 1) % per_shard == 0:
                chk.verify()
        chk.verify()
        sync()
        check_s.append(time.perf_counter() - t0)
    all_bytes = sum(t.numel() * t.element_size() for _, t in items)
    res = {"provenance": provenance(), "preset": cfg.name, "tensors": len(items),
           "checked": sum(t.dtype != torch.uint8 for _, t in items),
           "checked_bytes": sum(t.numel() * t.element_size() for _, t in items if t.dtype != torch.uint8),
           "all_bytes": all_bytes, "check_s": check_s, "build_random_model_s": build_s}
    if runtime.DEVICE.type == "cuda":                   # the copy a load makes anyway, for scale
        host = torch.empty(2 * 2**30, dtype=torch.uint8)
        sync()
        t0 = time.perf_counter()
        host.to("cuda")
        sync()
        h2d = 2 * 2**30 / (time.perf_counter() - t0)
        res.update(h2d_pageable_GBps=h2d / 1e9, h2d_time_for_all_bytes_s=all_bytes / h2d)
    out = Path(os.environ.get("OUT") or ROOT / "data" / "experiments" / "weight-check")
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{cfg.name}-{res['provenance']['git_sha'][:7]}.json"
    path.write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps({k: v for k, v in res.items() if k != "provenance"}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
