"""``lynn check``: validate every kernel against its reference on the current device, as one table.

Each family's rows live in its own ``check.py`` (``lynn_kernels/<family>/check.py``: ``check_<family>()``); this
module registers them, in the order of the table, and adds the ``backend`` column. A row is ``{"op", "case",
<Metrics fields>, "passed"}``. Sizes are small enough for the interpreter to finish in seconds; on a GPU the same
cases run compiled.
"""

from __future__ import annotations

import importlib
import textwrap
import time
from collections.abc import Callable

from . import runtime
from .metrics import flat_row, format_value, is_number, render_table

CHECKS: dict[str, Callable[[], list[dict]]] = {}


def register(family: str):
    def deco(fn):
        CHECKS[family] = fn
        return fn

    return deco


@register("nvfp4")
def check_nvfp4() -> list[dict]:
    from .nvfp4.check import iter_rows as rows

    return rows()


@register("matmul")
def check_matmul() -> list[dict]:
    from .matmul.check import iter_rows as rows

    return rows()


@register("attention")
def check_attention() -> list[dict]:
    from .attention.check import iter_rows as rows

    return rows()


@register("deltanet")
def check_deltanet() -> list[dict]:
    from .deltanet.check import iter_rows as rows

    return rows()


@register("moe")
def check_moe() -> list[dict]:
    from .moe.check import iter_rows as rows

    return rows()


@register("norm")
def check_norm() -> list[dict]:
    from .norm.check import iter_rows as rows

    return rows()


def _family(name: str) -> str:
    """The family a check name belongs to: ``nvfp4`` of ``nvfp4``, ``nvfp4.quantize`` and ``nvfp4 round trip``."""
    return name.split(".")[0].split(" ")[0]


def _picks(name: str, op: str) -> bool:
    return name == op or op.startswith(name + ".")


def family_ops(family: str) -> tuple[str, ...] | None:
    """The op names a family's rows carry (its ``check.OPS``), without running anything; None for a family
    registered from outside the package (tests), whose op names are only known once it has run."""
    module = f"lynn_kernels.{family}.check"
    try:
        return importlib.import_module(module).OPS
    except ModuleNotFoundError as e:
        if e.name not in (module, f"lynn_kernels.{family}"):
            raise                                        # a real check module failing to import is an error
        return None


def run_checks(families: list[str] | None = None, *, on_family: Callable[[str, int, int], None] | None = None,
               on_row: Callable[[dict], None] | None = None) -> tuple[list[dict], float]:
    """The rows of the named checks: a name is a family (``nvfp4``) or an op the table prints (``nvfp4.quantize``,
    which runs its family and keeps that op's rows); none: every family. An unknown family or op is a ``ValueError``
    that lists the choices, raised before anything runs (each family's ``check.OPS`` names its ops; a row whose op
    is not there is a ``RuntimeError``, so the list stays true).

    To show rows as they come (``lynn check``): ``on_family(family, i, n)`` is called before the ``i``-th of the ``n``
    families runs (``i`` from 1), and ``on_row(row)`` with each row kept, as soon as it is computed (each family's
    ``check.iter_rows()`` yields its rows one by one). The return value is the same with or without the
    callbacks."""
    names = list(families or [])
    unknown = sorted(n for n in names if _family(n) not in CHECKS)
    if unknown:
        raise ValueError(f"unknown check {', '.join(unknown)}: expected a family ({', '.join(CHECKS)}) or an op "
                         "name as the table prints it (e.g. nvfp4.quantize)")
    fams = {_family(n) for n in names}
    run = [f for f in CHECKS if not names or f in fams]
    ops = {f: family_ops(f) for f in run}               # None: a family from outside the package (tests)
    missing = [n for n in names if n not in CHECKS and ops[_family(n)] is not None
               and not any(_picks(n, op) for op in ops[_family(n)])]
    if missing:                                          # refused before anything runs
        raise ValueError(f"no check of op {', '.join(missing)}; the ops of {', '.join(sorted(fams))}: "
                         f"{', '.join(op for f in sorted(fams) for op in ops[f] or ())}")
    t0 = time.perf_counter()
    rows = []
    for i, fam in enumerate(run, 1):
        if on_family is not None:
            on_family(fam, i, len(run))
        wanted = [n for n in names if _family(n) == fam]
        for row in CHECKS[fam]():
            if ops[fam] is not None and row["op"] not in ops[fam]:
                raise RuntimeError(f"lynn_kernels/{fam}/check.py yields op {row['op']!r}, not in its OPS")
            if not names or fam in wanted or any(_picks(n, row["op"]) for n in wanted):
                rows.append({"backend": runtime.backend(), **row})
                if on_row is not None:
                    on_row(rows[-1])
    empty = [n for n in names if n not in CHECKS and not any(_picks(n, r["op"]) for r in rows)]
    if empty:           # a GPU-only op's rows under the reference backend, or an unknown op of an outside family
        raise ValueError(f"{', '.join(empty)}: no rows on backend {runtime.backend()} (no such op, or its checks "
                         f"need another backend)")
    return rows, time.perf_counter() - t0


COLUMNS = ["op", "case", "backend", "cosine", "max_abs", "rel_l2", "err_ratio", "mismatches", "passed"]
#: The same without ``backend``: what notebooks check under nbval, so one stored output holds on CPU and GPU.
PORTABLE_COLUMNS = [c for c in COLUMNS if c != "backend"]


def table(rows: list[dict], digits: int = 6, columns: list[str] | None = None) -> str:
    """The check table; ``mismatches`` of a quantise row counts codes, scales and the global scale together."""
    return render_table(rows, columns or COLUMNS, digits=digits)


#: ``lynn check``'s table, printed a row at a time as the checks finish, so its widths are fixed before any row is
#: known: column -> (width, spaces before it). The widest op is 26 characters; the numbers are written with as many
#: of 6 significant digits as fit (:func:`_fit`), one space apart; ``case`` takes what :data:`WIDTH` leaves after the
#: progress marker. A longer op or case wraps onto the next lines of its column.
STREAM_COLUMNS = {"op": (26, 2), "case": (0, 2), "cosine": (8, 2), "max_abs": (8, 1), "rel_l2": (8, 1),
                  "err_ratio": (9, 1), "mismatches": (10, 1), "passed": (6, 2)}
#: The streamed table's line length, at most.
WIDTH = 120
_TEXT = ("op", "case", "passed")                 # left-aligned; the others are numbers (or ``-``)


def _fit(value, width: int) -> str:
    """``value`` as the tables write it (:func:`~lynn_kernels.metrics.format_value`), in at most ``width``
    characters if it is a float: the most significant digits (up to 6) that fit, then scientific notation."""
    text = format_value(value)
    if not isinstance(value, float):
        return text
    for digits in range(5, 0, -1):
        if len(text) <= width:
            return text
        text = format_value(value, digits)
    for digits in range(2, -1, -1):
        if len(text) <= width:
            return text
        text = f"{value:.{digits}e}"
    return text


class StreamTable:
    """The check table a row at a time: :meth:`header` first, then :meth:`row` for each row as its check finishes,
    each line at most :data:`WIDTH` columns and starting with the progress marker ``[i/n]`` (family ``i`` of ``n``,
    under the heading ``fam``); the columns are :data:`PORTABLE_COLUMNS` (the first line of ``lynn check`` names the
    backend)."""

    def __init__(self, families: int):
        self.mark = len(f"[{families}/{families}]")
        used = self.mark + sum(w + gap for w, gap in STREAM_COLUMNS.values())
        self.widths = {c: w or WIDTH - used for c, (w, _) in STREAM_COLUMNS.items()}

    def _line(self, mark: str, cells: dict) -> str:
        parts = [mark.ljust(self.mark)]
        for col, w in self.widths.items():
            text = cells.get(col, "")
            parts.append(" " * STREAM_COLUMNS[col][1])
            parts.append(text.ljust(w) if col in _TEXT or not is_number(text) else text.rjust(w))
        return "".join(parts).rstrip()

    def header(self) -> str:
        return "\n".join([self._line("fam", {c: c for c in self.widths}),
                          self._line("-" * self.mark, {c: "-" * w for c, w in self.widths.items()})])

    def row(self, row: dict, family: int, families: int) -> str:
        """One row, with its progress marker; a long op or case goes on over the next lines of its column."""
        cells = flat_row(row)
        text = {c: _fit(cells.get(c), w) for c, w in self.widths.items() if c not in ("op", "case")}
        wrapped = {c: textwrap.wrap(str(cells.get(c, "")), self.widths[c], break_on_hyphens=False) or [""]
                   for c in ("op", "case")}
        lines = [self._line(f"[{family}/{families}]", {**text, "op": wrapped["op"][0], "case": wrapped["case"][0]})]
        for k in range(1, max(len(v) for v in wrapped.values())):
            lines.append(self._line("", {c: v[k] if k < len(v) else "" for c, v in wrapped.items()}))
        return "\n".join(lines)
