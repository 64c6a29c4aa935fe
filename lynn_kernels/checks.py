"""``lynn check``: validate every kernel against its reference on the current device, as one table.

Each family's rows live in its own ``check.py`` (``lynn_kernels/<family>/check.py``: ``check_<family>()``); this
module registers them, in the order of the table, and adds the ``backend`` column. A row is ``{"op", "case",
<Metrics fields>, "passed"}``. Sizes are small enough for the interpreter to finish in seconds; on a GPU the same
cases run compiled.
"""

from __future__ import annotations

import time
from typing import Callable

from . import runtime
from .validate import render_table

CHECKS: dict[str, Callable[[], list[dict]]] = {}


def register(family: str):
    def deco(fn):
        CHECKS[family] = fn
        return fn

    return deco


@register("nvfp4")
def check_nvfp4() -> list[dict]:
    from .nvfp4.check import check_nvfp4 as rows

    return rows()


@register("matmul")
def check_matmul() -> list[dict]:
    from .matmul.check import check_matmul as rows

    return rows()


@register("attention")
def check_attention() -> list[dict]:
    from .attention.check import check_attention as rows

    return rows()


@register("deltanet")
def check_deltanet() -> list[dict]:
    from .deltanet.check import check_deltanet as rows

    return rows()


@register("moe")
def check_moe() -> list[dict]:
    from .moe.check import check_moe as rows

    return rows()


@register("norm")
def check_norm() -> list[dict]:
    from .norm.check import check_norm as rows

    return rows()


def run_checks(families: list[str] | None = None) -> tuple[list[dict], float]:
    """The rows of the named checks: a name is a family (``nvfp4``) or an op the table prints (``nvfp4.quantize``,
    which runs its family and keeps that op's rows); none: every family. An unknown name is a ``ValueError`` that
    lists the families."""
    names = list(families or [])
    fams = {n.split(".")[0] for n in names}
    unknown = sorted(n for n in names if n.split(".")[0] not in CHECKS)
    if unknown:
        raise ValueError(f"unknown check {', '.join(unknown)}: expected a family ({', '.join(CHECKS)}) or an op "
                         "name as the table prints it (e.g. nvfp4.quantize)")
    def picks(name, op):
        return name == op or op.startswith(name + ".")

    t0 = time.perf_counter()
    rows, ops = [], set()
    for fam in [f for f in CHECKS if not names or f in fams]:
        wanted = [n for n in names if n.split(".")[0] == fam]
        for row in CHECKS[fam]():
            ops.add(row["op"])
            if not names or fam in wanted or any(picks(n, row["op"]) for n in wanted):
                rows.append({"backend": runtime.backend(), **row})
    missing = [n for n in names if "." in n and not any(picks(n, op) for op in ops)]
    if missing:
        raise ValueError(f"no check of op {', '.join(missing)}; the ops of {', '.join(sorted(fams))}: "
                         f"{', '.join(sorted(ops))}")
    return rows, time.perf_counter() - t0


COLUMNS = ["op", "case", "backend", "cosine", "max_abs", "rel_l2", "err_ratio", "mismatches", "passed"]
#: The same without ``backend``: what notebooks check under nbval, so one stored output holds on CPU and GPU.
PORTABLE_COLUMNS = [c for c in COLUMNS if c != "backend"]


def table(rows: list[dict], digits: int = 6, columns: list[str] | None = None) -> str:
    """The check table; ``mismatches`` of a quantise row counts codes, scales and the global scale together."""
    return render_table(rows, columns or COLUMNS, digits=digits)
