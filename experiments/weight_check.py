"""What ``lynn_model.loader.WeightCheck`` costs on a Qwen3.5-35B-A3B-shaped NVFP4 checkpoint on the GPU: a random
model's tensors cut as a checkpoint stores them (per expert and projection: 92,873 tensors), checked with a
verify every 1/40 of them (a shard), beside the host-to-device copy a load makes of the same bytes. Results:
``data/experiments/weight-check/``; discussed in docs/decoder.md, section 4."""
import json
import os
import time
from pathlib import Path

import torch

from lynn_kernels import NVFP4Tensor
from lynn_model import loader, preset
from lynn_model.loader import Entry, WeightCheck

cfg = preset(os.environ.get("PRESET", "qwen3.5-35b-a3b"))
t0 = time.perf_counter()
model = loader.random_model(cfg, weights="nvfp4", layout="checkpoint")
torch.cuda.synchronize()
build_s = time.perf_counter() - t0
f = Path("model-00001-of-00040.safetensors")
items = []          # (Entry, tensor) in checkpoint granularity

def add(name, t):
    items.append((Entry(name, f, t.dtype, tuple(t.shape)), t))

def nvfp4(name, codes, scales, g):
    add(name + ".weight_packed", codes); add(name + ".weight_scale", scales)
    add(name + ".weight_global_scale", g.reshape(1))

from lynn_model.model import GatedDeltaNet, Linear, SparseMoE

add("model.embed_tokens.weight", model.embed_tokens)
for name, m in model.named_modules():
    if isinstance(m, Linear):
        w = m.weight
        nvfp4(name, w.codes, w.scales, w.global_scale) if isinstance(w, NVFP4Tensor) else add(name + ".weight", w)
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
    elif hasattr(m, "weight") and isinstance(m.weight, torch.Tensor):
        add(name + ".weight", m.weight)
n_checked = sum(t.dtype != torch.uint8 for _, t in items)
nbytes = sum(t.numel() * t.element_size() for _, t in items if t.dtype != torch.uint8)
per_shard = max(1, len(items) // 40)
res = []
for rep in range(3):
    torch.cuda.synchronize(); t0 = time.perf_counter()
    chk = WeightCheck()
    for i, (e, t) in enumerate(items):
        chk.add(e, t)
        if (i + 1) % per_shard == 0:
            chk.verify()
    chk.verify(); torch.cuda.synchronize()
    res.append(time.perf_counter() - t0)
# the copy a load makes anyway: host -> device of every tensor's bytes, one shard's worth, for scale
host = torch.empty(2 * 2**30, dtype=torch.uint8, pin_memory=False)
torch.cuda.synchronize(); t0 = time.perf_counter(); dev = host.to("cuda"); torch.cuda.synchronize()
h2d = 2 * 2**30 / (time.perf_counter() - t0)
allbytes = sum(t.numel() * t.element_size() for _, t in items)
out = {"preset": cfg.name, "tensors": len(items), "checked": n_checked, "checked_bytes": nbytes,
       "all_bytes": allbytes, "check_s": res, "build_random_model_s": build_s,
       "h2d_pageable_GBps": h2d / 1e9, "h2d_time_for_all_bytes_s": allbytes / h2d,
       "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
Path(os.environ["OUT"], "weight_check_h200.json").write_text(json.dumps(out, indent=1))
print(json.dumps(out, indent=1))
