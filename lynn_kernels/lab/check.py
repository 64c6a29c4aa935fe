"""``check(variant)``: the op's ``lynn check`` matrix with the variant routed in, as one table.

The cases are the family's own (``lynn_kernels/<family>/check.py: cases()``, the ones ``lynn check`` runs), so the
lab, the command and the tests cannot drift apart. A case runs with the variant routed (:func:`.using`); all its rows
are kept when the variant ran in it (a case may report the variant's work under another op's row: a kernel serves
several ops), and the rows of the other cases are dropped. Whatever a case raises, a
Triton compile error of a kernel variant included, becomes a failing row naming the case and the error.
"""

from __future__ import annotations

import importlib
import time
from dataclasses import dataclass, field

from ..metrics import flat_row, render_table
from .variant import Variant, using, variant

#: The columns of a check table (the metrics a row may carry; a row without one shows it empty).
COLUMNS = ("op", "case", "cosine", "max_abs", "rel_l2", "err_ratio", "mismatches", "passed", "error")


def _error_text(err: BaseException, limit: int = 300) -> str:
    """One line: the exception's type and the most telling line of its message (Triton's compile errors put the
    offending source first and the reason last)."""
    lines = [ln.strip() for ln in str(err).strip().splitlines() if ln.strip()]
    text = lines[-1] if lines else ""
    text = f"{type(err).__name__}: {text}" if text else type(err).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."


@dataclass
class CheckReport:
    """The rows of one :func:`check`: ``passed`` when every row passed and at least one case ran the variant."""

    variant: Variant
    rows: list[dict] = field(default_factory=list)
    cases_run: int = 0                  #: cases of the family's matrix that ran
    cases_used: int = 0                 #: of them, the cases in which the variant ran
    seconds: float = 0.0

    @property
    def failures(self) -> list[dict]:
        return [r for r in self.rows if not r.get("passed")]

    @property
    def passed(self) -> bool:
        return self.cases_used > 0 and bool(self.rows) and not self.failures

    @staticmethod
    def _render(rows: list[dict], digits: int) -> str:
        """``rows`` as a table of the :data:`COLUMNS` any of them has ("" when there are none)."""
        cols = [c for c in COLUMNS if any(c in flat_row(r) for r in rows)]
        return render_table(rows, columns=cols, digits=digits) if rows else ""

    def table(self, digits: int = 4) -> str:
        return self._render(self.rows, digits) or "(no rows)"

    def failures_table(self, digits: int = 4) -> str:
        """The failed rows alone, with their case and metrics or error ("" when none failed)."""
        return self._render(self.failures, digits)

    def summary(self) -> str:
        v = self.variant
        what = f"kernel {v.kernel}" if v.kernel else f"op {v.op.name}"
        if self.cases_used == 0:
            return (f"{v.label} ({what}): FAILED: none of the {self.cases_run} cases of the {v.op.family} check "
                    f"matrix ran the variant")
        verdict = "passed" if self.passed else f"FAILED {len(self.failures)} of {len(self.rows)} rows"
        return (f"{v.label} ({what}): {verdict}; {len(self.rows)} rows from {self.cases_used} of "
                f"{self.cases_run} cases, {self.seconds:.1f} s")

    def __str__(self) -> str:
        return self.table() + "\n" + self.summary()

    __repr__ = __str__


def cases_of(family: str):
    """The family's check cases (``lynn_kernels.<family>.check.cases()``)."""
    return importlib.import_module(f"lynn_kernels.{family}.check").cases()


def check(v, fn=None, *, kernel: str | None = None, on_row=None) -> CheckReport:
    """Run the op's check matrix on a variant: ``check(variant("rmsnorm", my_fn))``, or ``check("rmsnorm", my_fn)``
    (the arguments of :func:`.variant`). ``on_row(row)`` sees each row as it is kept. Never raises for a wrong
    variant: its failures are rows."""
    v = variant(v, fn, kernel=kernel) if fn is not None else variant(v)
    report = CheckReport(v)
    t0 = time.perf_counter()
    for case in cases_of(v.op.family):
        report.cases_run += 1
        raised = False
        with using(v) as hits:
            try:
                rows = case.run()
            except Exception as err:                    # reported against its case, whether the variant ran or not
                rows = [{"op": case.op, "case": case.label, "passed": False, "error": _error_text(err)}]
                raised = True
        if not hits and not raised:
            continue
        report.cases_used += 1
        for row in rows:                                # every row of the case: a case reports what the variant did
            report.rows.append(row)                     # under its own row names (the norm folded into a GEMV is
            if on_row is not None:                      # a "matmul.norm_linear" row of an nvfp4_linear variant)
                on_row(row)
    report.seconds = time.perf_counter() - t0
    return report


__all__ = ["check", "CheckReport", "cases_of"]
