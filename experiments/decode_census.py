"""H200: where a batch-1 decode step's time goes, kernel by kernel, in the three forms the decoder can run (as
loaded; each mixer's input projections fused; and each Gated DeltaNet decode step fused on top), with the graph
replay of each at batch 1 and 8 beside it. The census is ``lynn_kernels.bench.decoder.census``: one eager call of
each part of the step under the CUDA profiler, every GPU operation named with its time.

Writes ``$OUT/decode_census.json`` and prints the parts and their kernels.

    PYTHONPATH=. python3 experiments/decode_census.py [preset]
"""

import json
import os
import sys

import torch

import lynn_model
from lynn_kernels.bench.decoder import CONTEXT, STEPS, census, decode_bytes, graph_decode
from lynn_kernels.bench.harness import measure_ceilings, provenance
from lynn_model.loader import random_model

OUT = os.environ.get("OUT", "out")
os.makedirs(OUT, exist_ok=True)
name = sys.argv[1] if len(sys.argv) > 1 else "qwen3.5-35b-a3b"
res = {"provenance": provenance(f"python3 experiments/decode_census.py {name}"), "forms": {}}
ceilings = measure_ceilings()
cfg = lynn_model.preset(name)
model = random_model(cfg, weights="nvfp4", device="cuda", seed=0)
ids = torch.randint(0, cfg.vocab_size, (8 * CONTEXT + STEPS + 64,), device="cuda",
                    generator=torch.Generator(device="cuda").manual_seed(1))
nbytes = decode_bytes(model, CONTEXT)


def form(label):
    entry = {"census": census(model)}
    for batch in (1, 8):
        _, info = graph_decode(model, ids, batch, ceilings, label, nbytes if batch == 1 else 0)
        entry[f"graph_b{batch}"] = info
    res["forms"][label] = entry
    json.dump(res, open(os.path.join(OUT, "decode_census.json"), "w"), indent=1)


form("as loaded")
model.fuse_input_projections()
form("input projections fused")
model.fuse_gdn_decode()
form("input projections and GDN decode fused")

for label, entry in res["forms"].items():
    print(f"== {label}: batch 1 {entry['graph_b1']['ms_per_step']:.3f} ms ({entry['graph_b1']['tok_s']:.1f} tok/s), "
          f"batch 8 {entry['graph_b8']['ms_per_step']:.3f} ms ({entry['graph_b8']['tok_s']:.1f} tok/s)")
    for part, v in entry["census"].items():
        if "detail" not in v:
            continue
        print(f"  {part}: {v['kernels']} ops, {v['us']:.1f} us x {v['per_step']}")
        if len(v["detail"]) > 1:
            print("     " + ", ".join(f"{k} {t:.1f}" for k, t in v["detail"]))
