"""Which compiled kernels are exposed to Triton's register-operand wgmma hazard (triton-lang/triton#9433)?

On Hopper, ``tl.dot`` lowers to ``wgmma.mma_async``. When its first operand is a register tensor (our decoded
weight tiles, a converted router tile, attention's probabilities), the PTX rules say those registers must not be
written until a ``wgmma.wait_group`` covers that wgmma. Triton 3.6's software pipeliner keeps up to N - 1 of a
loop's wgmmas in flight (``warp_group_dot_wait {pendings = N - 1}``) while the next iteration's prologue already
rewrites their input registers: now and then a wgmma multiplies garbage. On the H200 this is what corrupted the
packed prefill GEMM at M = 80 (8 weight rows x all tokens near 1e31 in ~0.7% of calls; docs/history/compiler-fault.md).
Re-ask it after a Triton upgrade or a kernel change (``runtime.register_dot_hazard`` decides where the workaround
is on).

This script compiles what the decoder runs (``lynn check`` of every family, then a one-layer model of each
family through prefill at several lengths and a few decode steps) into a fresh Triton cache, then reads every
kernel's TTGIR there and lists, per kernel and launch config: the register-operand dots and the largest
``pendings`` their waits allow. A kernel is exposed when it has a register-operand dot and a wait with
``pendings > 0``. GPU only (``--cache DIR`` scans a Triton cache anywhere). tests/test_runtime.py runs it with
``--skip-checks`` as a gpu test.

    PYTHONPATH=. python3 experiments/rs_wgmma_scan.py [--out FILE] [--skip-checks] [--cache DIR]

Writes ``data/experiments/rs-wgmma-scan/<sha>.json`` (``$OUT/rs_wgmma_scan.json`` when ``$OUT`` is set; ``--out``
names the file).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def scan(cache_dir: str) -> list[dict]:
    rows = []
    for path in sorted(glob.glob(os.path.join(cache_dir, "*", "*.ttgir"))):
        text = open(path).read()
        meta_path = path[:-len(".ttgir")] + ".json"
        meta = json.load(open(meta_path)) if os.path.exists(meta_path) else {}
        dots = [line for line in text.splitlines() if "ttng.warp_group_dot %" in line]
        n_dots = len(dots)
        rs = sum(1 for d in dots if "#ttg.dot_op<{opIdx = 0" in d.split(" : ", 1)[-1].split(" * ", 1)[0])
        pend = [int(p) for p in re.findall(r"warp_group_dot_wait .*?pendings = (\d+)", text)]
        rows.append({"kernel": meta.get("name", os.path.basename(path)), "num_warps": meta.get("num_warps"),
                     "num_stages": meta.get("num_stages"), "wgmma_dots": n_dots, "register_a_dots": rs,
                     "max_pendings": max(pend, default=0),
                     "exposed": rs > 0 and max(pend, default=0) > 0, "file": os.path.relpath(path, cache_dir)})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="the JSON to write (default: see the docstring)")
    ap.add_argument("--skip-checks", action="store_true", help="only the decoder workloads, not lynn check")
    ap.add_argument("--cache", default=None, help="scan this Triton cache instead of compiling into a fresh one")
    args = ap.parse_args()
    cache = args.cache
    if cache is None:
        cache = tempfile.mkdtemp(prefix="lynn-triton-cache-")
        os.environ["TRITON_CACHE_DIR"] = cache          # before triton compiles anything
        import dataclasses

        import torch

        import lynn_model
        from lynn_kernels import check, runtime
        from lynn_model.loader import random_model
        if not args.skip_checks:
            rows, secs = check.run_checks()
            bad = [r for r in rows if not r.get("passed")]
            print(f"lynn check: {len(rows)} rows in {secs:.0f} s, {len(bad)} not ok", flush=True)
        dev = runtime.DEVICE
        for preset in ("qwen3.5-35b-a3b", "qwen3-next-80b-a3b"):
            cfg = lynn_model.preset(preset)
            kinds = cfg.layer_types
            keep = [kinds.index("linear_attention"), kinds.index("full_attention")]
            types = [kinds[i] for i in sorted(keep)]
            cfg = dataclasses.replace(cfg, num_hidden_layers=len(types), layer_types=types)
            model = random_model(cfg, weights="nvfp4", device=dev, seed=0)
            gen = torch.Generator(device=dev).manual_seed(0)
            for t in (1, 3, 8, 17, 80, 300, 2048):
                ids = torch.randint(0, cfg.vocab_size, (1, t), device=dev, generator=gen)
                with torch.no_grad():
                    model.forward(ids)
            ids = torch.randint(0, cfg.vocab_size, (2, 40), device=dev, generator=gen)
            lynn_model.generate(model, ids, 4)
            print(f"{preset}: prefill and decode compiled", flush=True)
            del model
            torch.cuda.empty_cache()
    rows = scan(cache)
    # after the compile (TRITON_CACHE_DIR is set before anything imports triton)
    from lynn_kernels.bench.harness import git_state

    sha = git_state()["git_sha"]
    if args.out is None:
        args.out = (os.path.join(os.environ["OUT"], "rs_wgmma_scan.json") if os.environ.get("OUT") else
                    os.path.join(ROOT, "data", "experiments", "rs-wgmma-scan", f"{sha[:7]}.json"))
    exposed = [r for r in rows if r["exposed"]]
    rec = {"git_sha": sha, "kernels": rows, "exposed": len(exposed)}
    try:
        import torch
        import triton
        rec["triton"], rec["torch"] = triton.__version__, torch.__version__
    except ImportError:
        pass
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(rec, f, indent=1)
    print(f"{'kernel':44s} {'warps':>5} {'stages':>6} {'dots':>4} {'RS':>3} {'pend':>4}  exposed")
    for r in sorted(rows, key=lambda r: (not r["exposed"], r["kernel"])):
        if r["wgmma_dots"]:
            print(f"{r['kernel'][:44]:44s} {r['num_warps']!s:>5} {r['num_stages']!s:>6} {r['wgmma_dots']:>4} "
                  f"{r['register_a_dots']:>3} {r['max_pendings']:>4}  {'EXPOSED' if r['exposed'] else ''}")
    print(f"{len(rows)} compiled kernels, {sum(1 for r in rows if r['wgmma_dots'])} with wgmma, {len(exposed)} exposed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
