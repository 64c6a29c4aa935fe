"""Helpers for the teaching notebooks (``notebooks/``): figures rounded so that their committed output holds anywhere.

``pytest notebooks`` (nbval) runs each notebook afresh and compares every checked cell's output with the committed
one as text. A figure that carries float noise (another CPU's BLAS, another torch build, the GPU's tensor cores)
would differ in its last digits, so the notebooks print it rounded, with these::

    from lynn_kernels.notebook import r4, rounded

    print(render_table(rounded(rows)))          # each Metrics of the rows with 4 significant digits
    print("max_abs", r4(compare(got, want).max_abs))

* ``r4`` / ``r3``: 4 or 3 significant digits; with ``floor``, a value smaller than it reads ``'< 1e-05'`` (round-off
  that small is noise whose digits move with the machine);
* ``bound``: the power of ten at or above a value (its order of magnitude, which does not move);
* ``decimals6``: 6 decimals (a cosine close to 1);
* ``rounded(rows, cosine=..., errors=..., err_ratio=...)``: table rows with the fields of their ``Metrics`` rounded
  by those functions (``r4`` unless told; ``err_ratio`` as ``errors`` unless told).

Nothing here is a kernel or a reference: only what the notebooks print. ``lynn_model.notebook`` has the decoder
notebook's own helpers.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable

from . import Metrics

__all__ = ["bound", "decimals6", "r3", "r4", "rounded", "significant"]


def significant(v, digits: int = 4, floor: float = 0.0):
    """``v`` to ``digits`` significant digits; a value below ``floor`` in magnitude as the string ``'< floor'``.
    ``None``, strings, 0 and values that are not finite come back as they are."""
    if v is None or isinstance(v, str) or v == 0 or not math.isfinite(v):
        return v
    return f"< {floor:g}" if abs(v) < floor else float(f"{v:.{digits}g}")


def r4(v, floor: float = 0.0):
    """4 significant digits (``significant(v, 4, floor)``): enough to read, and float noise cannot show."""
    return significant(v, 4, floor)


def r3(v, floor: float = 0.0):
    """3 significant digits (``significant(v, 3, floor)``)."""
    return significant(v, 3, floor)


def bound(v):
    """The power of ten at or above ``v`` (0 stays 0). The digits of fp32 round-off depend on the order of the
    sums (another CPU's BLAS, the GPU's tensor cores); its order of magnitude does not."""
    if v is None or v == 0 or not math.isfinite(v):
        return v
    return 10.0 ** math.ceil(math.log10(v))


def decimals6(v):
    """``v`` to 6 decimals (a cosine: 0.999998)."""
    return v if v is None else round(v, 6)


def rounded(rows: Iterable[dict], *, cosine: Callable = r4, errors: Callable = r4,
            err_ratio: Callable | None = None) -> list[dict]:
    """Table rows (dicts) with each ``Metrics`` value rounded: ``cosine`` by ``cosine``, ``max_abs`` and ``rel_l2``
    by ``errors``, ``err_ratio`` by ``err_ratio`` (``errors`` if not given); other values unchanged."""
    ratio = errors if err_ratio is None else err_ratio

    def fix(m: Metrics) -> Metrics:
        return dataclasses.replace(m, cosine=cosine(m.cosine), max_abs=errors(m.max_abs), rel_l2=errors(m.rel_l2),
                                   err_ratio=ratio(m.err_ratio))

    return [{k: fix(v) if isinstance(v, Metrics) else v for k, v in row.items()} for row in rows]
