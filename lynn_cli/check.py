"""``lynn check [NAME ...]``: validate every kernel (or the families / ops named) against its reference here."""

from __future__ import annotations

import sys

#: What ``lynn check`` says first under the reference backend.
REFERENCE_NOTICE = ("note: the backend is the torch reference (LYNN_BACKEND=reference, or use_reference()): every op "
                    "runs its reference, so these checks compare the reference with itself and say nothing about "
                    "the kernels.")


def add(sub):
    p = sub.add_parser("check", help="validate every kernel against its reference on this device")
    p.add_argument("family", nargs="*", metavar="NAME",
                   help="families (nvfp4 matmul attention deltanet moe norm) or op names as the table prints them "
                        "(e.g. nvfp4.quantize; quote a name with spaces: 'nvfp4 round trip'); default: all")
    return p


def run(args) -> int:
    import textwrap
    import time

    from lynn_kernels import check, device_summary

    from . import CommandError

    info = device_summary()
    print(f"lynn check on {info['device']} (backend {info['backend']}, torch {info['torch']}, "
          f"triton {info['triton']})", flush=True)
    if info["backend"] == "reference":
        print(textwrap.fill(REFERENCE_NOTICE, check.WIDTH), flush=True)
    tty = sys.stderr.isatty()
    t0 = time.perf_counter()
    state = {"table": None, "family": 0, "families": 0, "rows": 0, "progress": False}

    def clear_progress():
        if state["progress"]:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()
            state["progress"] = False

    def on_family(family, i, n):
        if state["table"] is None:
            state["table"] = check.StreamTable(n)
            print(state["table"].header(), flush=True)
        state["family"], state["families"] = i, n
        if tty:                                        # a line that the next rows overwrite
            clear_progress()
            done = state["rows"]
            sys.stderr.write(f"[{i}/{n}] running the {family} checks ... ({done} row{'' if done == 1 else 's'} "
                             f"so far, {time.perf_counter() - t0:.0f} s)")
            sys.stderr.flush()
            state["progress"] = True

    def on_row(row):
        clear_progress()
        state["rows"] += 1
        print(state["table"].row(row, state["family"], state["families"]), flush=True)

    try:
        rows, seconds = check.run_checks(args.family or None, on_family=on_family, on_row=on_row)
    except ValueError as err:
        raise CommandError(str(err), code=2) from None
    finally:
        clear_progress()
    failed = [r for r in rows if not r["passed"]]
    print(f"\n{len(rows) - len(failed)}/{len(rows)} checks passed in {seconds:.1f} s")
    return 1 if failed else 0
