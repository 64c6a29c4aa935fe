"""Are the kernels clean under NVIDIA's compute-sanitizer (out-of-bounds and misaligned accesses, shared-memory
races)? Re-ask it after a kernel change. GPU only.

    PYTHONPATH=. python3 experiments/sanitize.py [--families nvfp4 matmul ...] [--racecheck attention moe ...]
        [--timeout 150] [--jobs 9] [--out FILE]
    python3 experiments/sanitize.py --reparse FILE      # recount a summary from its recorded tails, no GPU

Each run is ``compute-sanitizer --tool TOOL python3 -m lynn_cli check FAMILY...``: ``lynn check`` runs each
family's kernels against their references at its awkward shapes (tails, odd sizes, every dtype), so every kernel
launch of those checks goes through the tool. memcheck looks for out-of-bounds and misaligned accesses; racecheck
for shared-memory hazards between threads, on the families whose kernels stage tiles in shared memory. The summary
records, per run: the families, the checks that passed, the sanitizer's ERROR SUMMARY count, its exit status, the
seconds, and whether it hit the timeout (a run that did not finish says so; it is not counted clean).

Writes ``data/experiments/sanitize/<sha>.json`` (``$OUT/sanitizer.json`` when ``$OUT`` is set; ``--out`` names the
file), rewritten after each run. The committed runs: ``results.json`` and ``racecheck-deltanet-norm-nvfp4.json``
(docs/reliability.md, "compute-sanitizer").
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime as dt
import json
import os
import re
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAMILIES = ("nvfp4", "matmul", "attention", "deltanet", "moe", "norm")


def run(tool: str, families: list[str], timeout: float) -> dict:
    exe = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    cmd = [exe, "--tool", tool, "--print-limit", "20", sys.executable, "-m", "lynn_cli", "check", *families]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
        out, rc, timed_out = p.stdout + p.stderr, p.returncode, False
    except subprocess.TimeoutExpired as err:
        out = (err.stdout or b"").decode(errors="replace") + (err.stderr or b"").decode(errors="replace")
        rc, timed_out = None, True
    return summarise({"tool": tool, "families": families, "seconds": round(time.perf_counter() - t0, 1),
                      "timed_out": timed_out, "exit_status": rc, "tail": out[-1500:]})


def summarise(r: dict) -> dict:
    """The counts of one run, parsed from the tool's last lines: memcheck ends with ``ERROR SUMMARY: N errors``,
    racecheck with ``RACECHECK SUMMARY: N hazards displayed (E errors, W warnings)`` (hazards count as errors)."""
    out = r["tail"]
    errors = [int(n) for n in re.findall(r"ERROR SUMMARY: (\d+) error", out)]
    errors += [int(n) for n in re.findall(r"RACECHECK SUMMARY: (\d+) hazard", out)]
    passed = re.search(r"(\d+)/(\d+) checks passed", out)
    r.update(sanitizer_errors=errors[-1] if errors else None,
             checks_passed=int(passed.group(1)) if passed else None, checks=int(passed.group(2)) if passed else None,
             clean=bool(errors) and errors[-1] == 0 and not r["timed_out"] and r["exit_status"] == 0)
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", nargs="*", default=list(FAMILIES))
    ap.add_argument("--racecheck", nargs="*", default=["attention", "moe", "matmul"])
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds per sanitizer run")
    ap.add_argument("--jobs", type=int, default=1, help="sanitizer runs at a time (one family each)")
    ap.add_argument("--out", help="the JSON to write (default: see the docstring)")
    ap.add_argument("--reparse", metavar="JSON", help="recount a summary's runs from their recorded tails, no GPU")
    args = ap.parse_args()
    if args.reparse:
        with open(args.reparse) as f:
            rec = json.load(f)
        rec["runs"] = [summarise(r) for r in rec["runs"]]
        rec["reparsed"] = "counts re-read from each run's recorded tail by --reparse"
        with open(args.reparse, "w") as f:
            json.dump(rec, f, indent=1)
        _table(rec["runs"])
        return 0
    import torch

    from lynn_kernels.bench.harness import git_state

    sha = git_state()["git_sha"]
    if args.out is None:
        args.out = (os.path.join(os.environ["OUT"], "sanitizer.json") if os.environ.get("OUT") else
                    os.path.join(ROOT, "data", "experiments", "sanitize", f"{sha[:7]}.json"))
    runs: list[dict] = []
    rec = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "git_sha": sha, "gpu": torch.cuda.get_device_name(),
           "torch": torch.__version__, "triton": __import__("triton").__version__,
           "command": "PYTHONPATH=. python3 experiments/sanitize.py " + " ".join(sys.argv[1:]), "runs": runs}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    plan = [("memcheck", [f]) for f in args.families] + [("racecheck", [f]) for f in args.racecheck]
    # one family per run, ``--jobs`` runs at a time on the one GPU (the checks are small: compiling dominates); the
    # JSON is rewritten after each run, so a cut-off call keeps what finished
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = [pool.submit(run, tool, families, args.timeout) for tool, families in plan]
        for fut in concurrent.futures.as_completed(futures):
            runs.append(fut.result())
            with open(args.out, "w") as f:
                json.dump(rec, f, indent=1)
    _table(runs)
    return 0


def _table(runs: list[dict]) -> None:
    print(f"{'tool':>10} | {'families':<40} | checks | sanitizer errors | seconds | clean")
    for r in runs:
        print(f"{r['tool']:>10} | {' '.join(r['families']):<40} | {r['checks_passed']}/{r['checks']} | "
              f"{r['sanitizer_errors']} | {r['seconds']}{' (timeout)' if r['timed_out'] else ''} | {r['clean']}")


if __name__ == "__main__":
    sys.exit(main())
