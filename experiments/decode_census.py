"""Where does a batch-1 decode step's time go, kernel by kernel?

The decode step of a random-weight NVFP4 model of the preset in the forms the decoder can run (as loaded; each
mixer's input projections fused; each Gated DeltaNet decode step fused on top; each layer norm folded into the next
block's first kernel on top of that), each with :func:`lynn_model.bench.census` at batch 1 and 8 (one eager call of
each part of the step under the CUDA profiler, every GPU operation named with its time; beside each part its bytes,
its ideal time at the read ceiling measured first, and the efficiency) and the step's CUDA-graph replay at batch 1
and 8 (:func:`lynn_model.bench.graph_decode`, tokens checked against eager first). GPU only. Discussed in
docs/history/decode.md (issue 16) and docs/performance.md (the decoder).

    PYTHONPATH=. python3 experiments/decode_census.py [preset] [--fused-only]       # qwen3.5-35b-a3b by default

``--fused-only`` times only the two fully fused forms. Writes ``data/experiments/decode-census/<preset>-<sha>.json``
(``$OUT`` instead when set), rewritten after each form, and prints the parts and their kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

import lynn_model
from lynn_kernels.bench import measure_ceilings
from lynn_kernels.bench.harness import provenance
from lynn_model.bench import CONTEXT, STEPS, census, decode_bytes, graph_decode
from lynn_model.loader import random_model

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("preset", nargs="?", default="qwen3.5-35b-a3b")
    ap.add_argument("--fused-only", action="store_true", help="only the forms with the GDN decode step fused")
    args = ap.parse_args()
    cfg = lynn_model.preset(args.preset)
    res = {"provenance": provenance("python3 experiments/decode_census.py " + " ".join(sys.argv[1:])), "forms": {}}
    out = Path(os.environ.get("OUT") or ROOT / "data" / "experiments" / "decode-census")
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{cfg.name}-{res['provenance']['git_sha'][:7]}.json"
    ceilings = measure_ceilings()
    res["ceilings"] = ceilings.as_dict()
    model = random_model(cfg, weights="nvfp4", device="cuda", seed=0, fuse=False)   # as stored; fused below
    ids = torch.randint(0, cfg.vocab_size, (8 * CONTEXT + STEPS + 64,), device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(1))
    nbytes = decode_bytes(model, CONTEXT)

    def form(label: str) -> None:
        entry = {"census": census(model, 1, ceilings), "census_b8": census(model, 8, ceilings)}
        for batch in (1, 8):
            _, entry[f"graph_b{batch}"] = graph_decode(model, ids, batch, ceilings, label, nbytes if batch == 1 else 0)
        res["forms"][label] = entry
        path.write_text(json.dumps(res, indent=1) + "\n")

    if not args.fused_only:
        form("as loaded")
    model.fuse_input_projections()
    if not args.fused_only:
        form("input projections fused")
    model.fuse_gdn_decode()
    form("input projections and GDN decode fused")
    model.fuse_norms()
    form("fused, norms folded")

    for label, entry in res["forms"].items():
        b1, b8 = entry["graph_b1"], entry["graph_b8"]
        print(f"== {label}: batch 1 {b1['ms_per_step']:.3f} ms ({b1['tok_s']:.1f} tok/s), "
              f"batch 8 {b8['ms_per_step']:.3f} ms ({b8['tok_s']:.1f} tok/s)")
        for part, v in entry["census"].items():
            if "detail" in v:
                ideal = (f"; {v['bytes'] / 1e6:.1f} MB, ideal {v['ideal_us']:.1f} us, {v['efficiency']:.0%}"
                         if "bytes" in v else "")
                print(f"  {part}: {v['kernels']} ops, {v['us']:.1f} us x {v['per_step']}{ideal}")
                if len(v["detail"]) > 1:
                    print("     " + ", ".join(f"{k} {t:.1f}" for k, t in v["detail"]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
