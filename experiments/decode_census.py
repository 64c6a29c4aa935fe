"""H200: where a batch-1 decode step's time goes, kernel by kernel, in the four forms the decoder can run (as
loaded; each mixer's input projections fused; each Gated DeltaNet decode step fused on top; and each layer norm
folded into the next block's first kernel on top of that), with the graph
replay of each at batch 1 and 8 beside it. The census is ``lynn_kernels.bench.decoder.census``: one eager call of
each part of the step under the CUDA profiler, every GPU operation named with its time.

Writes ``$OUT/decode_census.json`` and prints the parts and their kernels.

    PYTHONPATH=. python3 experiments/decode_census.py [preset] [--fused-only]

``--fused-only`` skips the first two forms (their figures are in earlier runs).
"""

import json
import os
import sys

import torch

import lynn_model
from lynn_kernels.bench.harness import measure_ceilings, provenance
from lynn_model.bench import CONTEXT, STEPS, census, decode_bytes, graph_decode
from lynn_model.loader import random_model

OUT = os.environ.get("OUT", "out")
os.makedirs(OUT, exist_ok=True)
args = [a for a in sys.argv[1:] if not a.startswith("--")]
fused_only = "--fused-only" in sys.argv
name = args[0] if args else "qwen3.5-35b-a3b"
res = {"provenance": provenance("python3 experiments/decode_census.py " + " ".join(sys.argv[1:])), "forms": {}}
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


if not fused_only:
    form("as loaded")
model.fuse_input_projections()
if not fused_only:
    form("input projections fused")
model.fuse_gdn_decode()
form("input projections and GDN decode fused")
model.fuse_norms()
form("fused, norms folded")

for label, entry in res["forms"].items():
    print(f"== {label}: batch 1 {entry['graph_b1']['ms_per_step']:.3f} ms ({entry['graph_b1']['tok_s']:.1f} tok/s), "
          f"batch 8 {entry['graph_b8']['ms_per_step']:.3f} ms ({entry['graph_b8']['tok_s']:.1f} tok/s)")
    for part, v in entry["census"].items():
        if "detail" not in v:
            continue
        print(f"  {part}: {v['kernels']} ops, {v['us']:.1f} us x {v['per_step']}")
        if len(v["detail"]) > 1:
            print("     " + ", ".join(f"{k} {t:.1f}" for k, t in v["detail"]))
