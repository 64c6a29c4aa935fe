"""``lynn race OP --variant FILE.py:NAME``: check a variant of an op (or of one of its kernels), race it against the
shipped op and the vendor baseline on a GPU, and run the decoder on it; ``--base REV`` races the working tree
against another git revision of it instead (the op's own benchmark in both trees, alternating).

Exit status: 0 when the variant passed its check (and every raced shape's validation), 1 when it did not, 2 for a
usage error. The decoder's tokens are reported (equal, or where they part) without changing the status: a correct
variant that rounds differently may part from the shipped path on a random-weight model.
"""

from __future__ import annotations

import sys
from pathlib import Path


def add(sub):
    p = sub.add_parser("race", help="check a kernel variant, race it against the shipped kernel, run the decoder on it")
    p.add_argument("op", metavar="OP", nargs="?",
                   help="the op, as lynn_kernels names it (rmsnorm, nvfp4_linear, moe.moe_block, ...; `lynn race "
                        "--list` lists them)")
    p.add_argument("--variant", metavar="FILE.py:NAME",
                   help="a Python file and the name in it of the variant: a function with the op's signature, or a "
                        "@triton.jit kernel with the shipped kernel's parameters")
    p.add_argument("--kernel", metavar="NAME", help="which of the op's kernels a kernel variant replaces (default: "
                                                    "the op's first; see --list)")
    p.add_argument("--shapes", default=None, metavar="MODEL:PHASE",
                   help="the inputs to race on (default qwen3.5-35b-a3b:decode, or :prefill for an op the decoder "
                        "runs only in prefill; phases: decode, decode-b8, prefill)")
    p.add_argument("--decoder", metavar="PRESET", nargs="?", const="",
                   help="also run the decoder of PRESET on the variant: tokens against the shipped path, and tok/s "
                        "on a GPU (default preset: a tiny one on a CPU, qwen3.5-35b-a3b on a GPU)")
    p.add_argument("--base", metavar="REV", help="race the working tree against git revision REV: the op's own "
                                                 "benchmark (`lynn bench`) in both trees, alternating (GPU only)")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds per comparison (default %(default)s)")
    p.add_argument("--save", metavar="DIR", help="write the race's JSON (benchmark schema, with the variant's "
                                                 "source hash) into DIR")
    p.add_argument("--list", action="store_true", help="list the ops and their kernels, then exit")
    return p


def load_variant(spec: str):
    """The object ``NAME`` of ``FILE.py`` for ``FILE.py:NAME``, the file run as a module of its own."""
    import importlib.util

    from . import CommandError

    path, sep, name = spec.rpartition(":")
    if not sep or not path or not name:
        raise CommandError(f"--variant {spec!r}: expected FILE.py:NAME (a file, a colon, the name in it)", code=2)
    file = Path(path)
    if file.suffix != ".py" or not file.is_file():
        raise CommandError(f"--variant: {file} is not a Python file (expected FILE.py:NAME)", code=2)
    module_spec = importlib.util.spec_from_file_location(f"lynn_variant_{file.stem}", file)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as err:
        raise CommandError(f"--variant: running {file} raised {type(err).__name__}: {err}") from None
    if not hasattr(module, name):
        names = sorted(n for n in vars(module) if not n.startswith("_") and callable(getattr(module, n)))
        raise CommandError(f"--variant: {file} defines no {name!r} (its callables: {', '.join(names) or 'none'})",
                           code=2)
    return getattr(module, name)


def run(args) -> int:
    from lynn_kernels import lab

    from . import CommandError

    if args.list:
        for op in lab.OPS.values():
            bench = f"; bench {op.bench}" if op.bench else ""
            print(f"{op.name:38s} kernels: {', '.join(op.kernels)}{bench}")
        return 0
    if not args.op:
        raise CommandError("which op? (`lynn race --list` lists them)", code=2)
    try:
        op = lab.find(args.op)
        args.shapes = args.shapes or lab.shapes.default_shapes(op.name)
        if args.variant:
            lab.shapes_for(op.name, args.shapes)          # the named shapes exist for this op (nothing is built)
    except ValueError as err:
        raise CommandError(f"{err}{' (--shapes)' if args.variant and 'shapes' in str(err) else ''}", code=2) from None
    if args.decoder:
        from lynn_model.config import PRESETS

        if args.decoder not in PRESETS:
            raise CommandError(f"--decoder {args.decoder}: no such preset; presets: {', '.join(sorted(PRESETS))}",
                               code=2)
    if args.rounds < 1:
        raise CommandError(f"--rounds {args.rounds}: expected at least 1", code=2)
    if not args.variant and not args.base:
        raise CommandError("nothing to race: give --variant FILE.py:NAME, --base REV, or both", code=2)
    base = _check_base(op, args) if args.base else None         # every --base problem before any work
    status = 0
    if args.variant:
        try:
            v = lab.variant(op, load_variant(args.variant), kernel=args.kernel)
        except (TypeError, ValueError) as err:
            raise CommandError(f"--variant {args.variant}: {err}", code=2) from None
        status = _race_variant(v, args)
    if args.base:
        status = max(status, _race_base(base, args))
    return status


def _race_variant(v, args) -> int:
    from lynn_kernels import lab

    print(f"lynn race {v.op.name}: {v.label}" + (f" (kernel {v.kernel})" if v.kernel else " (the whole op)")
          + f", source sha256 {v.source_hash}", flush=True)
    report = lab.race(v, shapes=args.shapes, rounds=args.rounds, save=args.save)
    print(report.check.table())
    print(report.text(failures=False))             # the table above holds the failed rows
    if not report.passed:
        return 1
    if args.decoder is not None:
        from lynn_model.lab import in_decoder

        print(in_decoder(v, preset=args.decoder or None), flush=True)
    return 0


def _git(*args: str):
    """``git ARGS`` in the tree lynn_kernels was imported from, its output captured."""
    import subprocess

    from lynn_kernels.bench.harness import REPO_ROOT

    return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True)


def _check_base(op, args) -> tuple[str, str]:
    """``(revision sha, benchmark)`` of ``--base``, or the usage error: a git checkout, a revision, a benchmark
    the op has (or the decoder's), a GPU to run it on."""

    import torch

    import lynn_model.bench  # noqa: F401  (registers the decoder's benchmarks)
    from lynn_kernels import bench
    from lynn_kernels.bench.harness import REPO_ROOT

    from . import CommandError

    git = _git
    if git("rev-parse", "--show-toplevel").returncode:
        raise CommandError(f"--base: lynn_kernels was imported from {REPO_ROOT}, which is not a git checkout", code=2)
    rev = git("rev-parse", "--verify", "--quiet", f"{args.base}^{{commit}}")
    if rev.returncode:
        raise CommandError(f"--base {args.base}: not a git revision of {REPO_ROOT}", code=2)
    if args.decoder is not None:
        bench_op = f"decoder.{args.decoder or 'qwen3.5-35b-a3b'}"
    elif op.bench:
        bench_op = op.bench
    else:
        raise CommandError(f"--base: {op.name} has no benchmark of its own to race in both trees (`lynn race --list` "
                           "shows each op's; or add --decoder PRESET)", code=2)
    if bench_op not in bench.available():
        raise CommandError(f"--base: no benchmark {bench_op}; the decoder's: "
                           f"{', '.join(b for b in bench.available() if b.startswith('decoder.'))}", code=2)
    if not torch.cuda.is_available():
        raise CommandError(f"--base: timing {bench_op} in both trees needs a CUDA GPU; nothing was run", code=2)
    return rev.stdout.strip(), bench_op


def _race_base(base: tuple[str, str], args) -> int:
    """The op's ``lynn bench`` in a worktree of REV and in this tree, alternating; a table of both."""
    import json
    import os
    import shutil
    import statistics
    import subprocess
    import tempfile

    from lynn_kernels.bench.harness import REPO_ROOT

    from . import CommandError

    git = _git
    sha, bench_op = base
    tmp = Path(tempfile.mkdtemp(prefix="lynn-race-base-"))
    base_tree = tmp / "base"
    try:
        added = git("worktree", "add", "--detach", str(base_tree), sha)
        if added.returncode:
            raise CommandError(f"--base: git worktree add failed: {added.stderr.strip()}")
        trees = {"working tree": REPO_ROOT, f"base {args.base}": base_tree}
        runs: dict[str, list[dict]] = {k: [] for k in trees}
        for r in range(args.rounds):
            for label in (list(trees) if r % 2 == 0 else list(trees)[::-1]):
                tree = trees[label]
                out = tmp / f"{label.split()[0]}-{r}"
                module = "lynn_cli" if (tree / "lynn_cli").is_dir() else "lynn_kernels.cli"
                env = {**os.environ, "PYTHONPATH": str(tree)}
                print(f"[round {r + 1}/{args.rounds}] {label}: lynn bench {bench_op} --quick", flush=True)
                done = subprocess.run([sys.executable, "-m", module, "bench", bench_op, "--quick", "--out", str(out)],
                                      cwd=tree, env=env, capture_output=True, text=True)
                if done.returncode:
                    raise CommandError(f"--base: lynn bench in the {label} failed:\n{done.stderr[-2000:]}")
                for f in out.rglob("*.json"):
                    runs[label].append(json.loads(f.read_text()))
        rows: dict[tuple, dict[str, list[float]]] = {}
        for label, docs in runs.items():
            for doc in docs:
                for res in doc["results"]:
                    rows.setdefault((res["shape"], res["provider"]), {}).setdefault(label, []).append(
                        res["median_ms"] * 1e3)
        a, b = list(trees)
        print(f"\n{'shape':40s} {'provider':34s} {a:>14s} {b:>14s}  ratio")
        for (shape, provider), by in rows.items():
            ua = statistics.median(by[a]) if a in by else float("nan")
            ub = statistics.median(by[b]) if b in by else float("nan")
            print(f"{shape[:40]:40s} {provider[:34]:34s} {ua:12.2f}us {ub:12.2f}us  {ua / ub:5.3f}")
        return 0
    finally:
        git("worktree", "remove", "--force", str(base_tree))
        shutil.rmtree(tmp, ignore_errors=True)
        git("worktree", "prune")
