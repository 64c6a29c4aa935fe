"""``lynn bench [OP ...]``: run the GPU benchmarks and write JSON under data/bench/<gpu>/; gate them against the
baseline."""

from __future__ import annotations

import sys
from pathlib import Path


def add(sub):
    p = sub.add_parser("bench", help="run GPU benchmarks, write data/bench/<gpu>/<op>.json")
    p.add_argument("op", nargs="*", help="benchmarks to run, by name prefix (default: all)")
    p.add_argument("--quick", action="store_true", help="one shape per benchmark")
    p.add_argument("--out", help="results root (default: data/bench)")
    p.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    p.add_argument("--check", action="store_true",
                   help="after running, compare the gated rows with the card's data/bench/<gpu>/perf_baseline.json; "
                        "exit 1 on a regression beyond noise (decode -3%%, prefill -5%%)")
    p.add_argument("--check-only", nargs="+", metavar="JSON", help="run nothing: check result files against "
                                                                   "their card's baseline")
    p.add_argument("--make-baseline", nargs="+", metavar="JSON", help="run nothing: write their card's baseline "
                                                                      "from whole result files")
    return p


def run(args) -> int:
    import torch

    import lynn_model.bench  # noqa: F401  (registers the whole decoder's benchmarks)
    from lynn_kernels import bench

    if args.list:
        print("\n".join(bench.available()))
        return 0
    if args.make_baseline or args.check_only:
        from lynn_kernels.bench import gate

        from . import CommandError

        try:
            if args.make_baseline:
                base = gate.make_baseline(args.make_baseline)
                print(f"wrote {gate.baseline_path(base['gpu'])}: {len(base['rows'])} gated rows of the {base['gpu']} "
                      f"from {', '.join(base['made_from'])}")
                return 0
            return _gate_report(gate, args.check_only)
        except (ValueError, OSError) as err:
            raise CommandError(str(err)) from None
    if not torch.cuda.is_available():
        print("lynn bench needs a CUDA GPU: timings under the interpreter mean nothing. Committed H200 results "
              "are in data/bench/h200/ and the notebooks plot them.", file=sys.stderr)
        return 2
    root = Path(args.out) if args.out else None
    command = "lynn bench " + " ".join(sys.argv[2:])
    written = bench.run(args.op or None, quick=args.quick, command=command, root=root)
    for op, path in written.items():
        print(f"\n== {op}  ->  {path}")
        print(bench.result_table(bench.load(op, root=Path(path).parent.parent, gpu=Path(path).parent.name)))
    if args.check:
        from lynn_kernels.bench import gate

        from . import CommandError

        try:
            return _gate_report(gate, list(written.values()))
        except (ValueError, OSError) as err:
            raise CommandError(str(err)) from None
    return 0


def _gate_report(gate, files) -> int:
    """Print the perf gate's verdict on result ``files``: 0 when every gated row is within its tolerance, 1 not."""
    passed, report = gate.check(files)
    print(f"\nperf gate against {gate.baseline_path(gate.card(files))}:")
    print(gate.format_report(report))
    print("perf gate: " + ("passed" if passed else "FAILED (a gated row is slower than allowed, or missing)"))
    return 0 if passed else 1
