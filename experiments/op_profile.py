"""Which kernels does one call of an op launch, and where does its time go, at the shapes a model gives it?

For each named shape (``lynn_kernels.lab.shapes_for``: ``<model>:<phase>``), on fresh inputs: the launches of one
call by kernel (every launcher's kernel routed to itself through ``lab.using``, which counts the routes taken), and
on a GPU the CUDA profiler's time per call of every GPU operation (our kernels, cuBLAS, torch's own), over
``--calls`` calls on rotating inputs. On a CPU only the launches (the interpreter's times mean nothing).

    PYTHONPATH=. python3 experiments/op_profile.py [OP] [--shapes MODEL:PHASE ...] [--calls 20]
    PYTHONPATH=. python3 experiments/op_profile.py moe.moe_block --shapes tiny-qwen3.5-moe:decode    # CPU, seconds

OP defaults to ``moe.moe_block``, the shapes to Qwen3.5-35B-A3B's decode, batch-8 decode and prefill on a GPU and
the tiny preset's decode on a CPU. Writes ``data/experiments/op-profile/<op>-<sha>.json`` (``$OUT`` instead when
set). It replaces ``experiments/moe_profile.py``, whose run at c2c8d10 (M = 1, 16, 4096) is
``data/experiments/moe-profile/results.txt`` (docs/moe.md, section 4).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
from pathlib import Path

import torch

from lynn_kernels import lab, runtime
from lynn_kernels.bench.harness import provenance

ROOT = Path(__file__).resolve().parents[1]


def every_kernel() -> list[lab.Variant]:
    """Each kernel that an op of the lab runs, as a variant of itself: routed, it changes nothing and is counted."""
    return [lab.variant(op, runtime.KERNELS[k].shipped, kernel=k, name=k)
            for op in lab.OPS.values() for k in op.kernels]


def profile(op: lab.Op, shape: lab.Shape, calls: int) -> dict:
    sets = [shape.make() for _ in range(4 if lab.can_time() else 1)]

    def call(i: int):
        args, kwargs, _ = sets[i % len(sets)]
        return op.fn(*args, **kwargs)

    call(0)                                             # compile and autotune outside what is counted
    with lab.using(*every_kernel()) as hits:
        call(0)
    row = {"shape": shape.label, "dims": shape.dims,
           "launches": {k: n for k, n in sorted(hits.items(), key=lambda kv: -kv[1]) if isinstance(k, str)}}
    if lab.can_time():
        for i in range(3):
            call(i)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for i in range(calls):
                call(i)
            torch.cuda.synchronize()
        us = collections.defaultdict(float)
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                us[e.name[:60]] += e.time_range.elapsed_us() / calls
        row["gpu_us_per_call"] = dict(sorted(us.items(), key=lambda kv: -kv[1]))
        row["gpu_us_total"] = sum(us.values())
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("op", nargs="?", default="moe.moe_block", help="an op of lynn_kernels.lab.OPS with named shapes")
    ap.add_argument("--shapes", nargs="*", help="MODEL:PHASE names (lynn_kernels.lab.MODELS, PHASES)")
    ap.add_argument("--calls", type=int, default=20, help="calls profiled per shape (GPU)")
    args = ap.parse_args()
    op = lab.find(args.op)
    names = args.shapes or ([f"qwen3.5-35b-a3b:{p}" for p in lab.PHASES] if lab.can_time()
                            else ["tiny-qwen3.5-moe:decode"])
    res = {"provenance": provenance(), "op": op.name, "shapes": {}}
    for name in names:
        for shape in lab.shapes_for(op.name, name):
            row = res["shapes"][f"{name} {shape.label}"] = profile(op, shape, args.calls)
            print(f"== {op.name}, {name}, {shape.label}")
            print("   launches: " + ", ".join(f"{k} x{n}" for k, n in row["launches"].items()))
            if "gpu_us_per_call" in row:
                print(f"   GPU {row['gpu_us_total']:.1f} us a call: "
                      + "; ".join(f"{k} {u:.1f}" for k, u in row["gpu_us_per_call"].items()))
    out = Path(os.environ.get("OUT") or ROOT / "data" / "experiments" / "op-profile")
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{op.name}-{res['provenance']['git_sha'][:7]}.json"
    path.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
