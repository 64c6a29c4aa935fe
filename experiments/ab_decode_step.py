"""H200: the decode step as ``lynn generate`` runs it (each mixer's input projections fused, each Gated DeltaNet
decode step fused), by CUDA-graph replay at batch 1 and 8 on a 4k context, random NVFP4 weights (seed 0), each
graph's tokens first checked against the same step run eagerly (``lynn_kernels.bench.decoder.graph_decode``).

Made for A/B runs of two source trees in one device call: run it once per tree, each in its own process and from
its own tree's root, alternating (A, B, A, B), so both meet the same machine state; every run appends its figures
under ``LABEL`` to ``$OUT/ab_decode_step.json``.

    PYTHONPATH=. python3 experiments/ab_decode_step.py LABEL [preset]
"""

import json
import os
import sys
import time

import torch

import lynn_model
from lynn_kernels.bench.harness import measure_ceilings, provenance
from lynn_model.bench import CONTEXT, STEPS, decode_bytes, graph_decode
from lynn_model.loader import random_model

OUT = os.environ.get("OUT", "out")
os.makedirs(OUT, exist_ok=True)
label = sys.argv[1]
name = sys.argv[2] if len(sys.argv) > 2 else "qwen3.5-35b-a3b"
t0 = time.perf_counter()
ceilings = measure_ceilings()
cfg = lynn_model.preset(name)
model = random_model(cfg, weights="nvfp4", device="cuda", seed=0)
model.fuse_input_projections()
model.fuse_gdn_decode()
ids = torch.randint(0, cfg.vocab_size, (8 * CONTEXT + STEPS + 64,), device="cuda",
                    generator=torch.Generator(device="cuda").manual_seed(1))
nbytes = decode_bytes(model, CONTEXT)
entry = {"provenance": provenance("python3 experiments/ab_decode_step.py " + " ".join(sys.argv[1:])),
         "preset": name, "cwd": os.getcwd()}
for batch in (1, 8):
    _, info = graph_decode(model, ids, batch, ceilings, label, nbytes if batch == 1 else 0)
    entry[f"graph_b{batch}"] = info
entry["wall_s"] = time.perf_counter() - t0
path = os.path.join(OUT, "ab_decode_step.json")
runs = json.load(open(path)) if os.path.exists(path) else []
runs.append({"label": label, **entry})
json.dump(runs, open(path, "w"), indent=1)
for r in runs:
    print(f"{r['label']:>8}: batch 1 {r['graph_b1']['ms_per_step']:.3f} ms ({r['graph_b1']['tok_s']:.1f} tok/s), "
          f"batch 8 {r['graph_b8']['ms_per_step']:.3f} ms ({r['graph_b8']['tok_s']:.1f} tok/s), "
          f"{r['wall_s']:.0f} s")
