"""One comparison helper and one table renderer, used by tests, notebooks, benchmarks and ``lynn check``.

All metrics are measured against an fp32 (or better) reference, in float64:

* ``cosine``   cosine similarity of the flattened tensors (1.0 is identical direction);
* ``max_abs``  largest absolute difference;
* ``rel_l2``   ``||out - ref|| / ||ref||``;
* ``err_ratio`` ``rel_l2(out) / rel_l2(baseline)``, where ``baseline`` is the same computation done plainly in bf16:
  about 1 means "as accurate as bf16", below 1 better, far above 1 worse.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class Case:
    """One case of a family's check matrix: ``run()`` computes it and returns its rows (``{"op", "case", ...,
    "passed"}``). ``lynn check``, the tests and :func:`lynn_kernels.lab.check` all run the same cases; a case is
    named before it runs, so whatever it raises can be reported against it."""

    op: str                              #: the op its rows carry (the first, where it yields several)
    label: str                           #: the case, as the table prints it
    run: Callable[[], list[dict]]


@dataclass(frozen=True)
class Metrics:
    cosine: float
    max_abs: float
    rel_l2: float
    err_ratio: float | None = None
    mismatches: int | None = None   #: elements whose bits differ (only for bit-exact comparisons)
    numel: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


def _f64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(device="cpu", dtype=torch.float64).flatten()


def _rel_l2(a: torch.Tensor, ref: torch.Tensor) -> float:
    den = torch.linalg.vector_norm(ref).item()
    num = torch.linalg.vector_norm(a - ref).item()
    if den == 0:
        return 0.0 if num == 0 else math.inf
    return num / den


def compare(out: torch.Tensor, ref: torch.Tensor, baseline: torch.Tensor | None = None,
            exact: bool = False) -> Metrics:
    """Compare ``out`` with the fp32 reference ``ref`` (same shape); ``baseline`` is the plain-bf16 result.

    ``exact=True`` also counts elements whose bits differ (``out`` and ``ref`` must then share a dtype).
    """
    if tuple(out.shape) != tuple(ref.shape):
        raise ValueError(f"out has shape {tuple(out.shape)} but ref has shape {tuple(ref.shape)}")
    a, r = _f64(out), _f64(ref)
    if not torch.isfinite(a).all():
        return Metrics(cosine=math.nan, max_abs=math.inf, rel_l2=math.inf, numel=a.numel(),
                       mismatches=a.numel() if exact else None)
    na, nr = torch.linalg.vector_norm(a).item(), torch.linalg.vector_norm(r).item()
    if na == 0 and nr == 0:
        cosine = 1.0
    elif na == 0 or nr == 0:
        cosine = 0.0
    else:
        cosine = float(torch.dot(a, r).item() / (na * nr))
    max_abs = float((a - r).abs().max().item()) if a.numel() else 0.0
    rel = _rel_l2(a, r)
    ratio = None
    if baseline is not None:
        base_err = _rel_l2(_f64(baseline), r)
        ratio = (0.0 if rel == 0 else math.inf) if base_err == 0 else rel / base_err
    mism = None
    if exact:
        if out.dtype != ref.dtype:
            raise ValueError(f"exact comparison needs one dtype, got {out.dtype} and {ref.dtype}")
        mism = bit_mismatches(out, ref)
    return Metrics(cosine=cosine, max_abs=max_abs, rel_l2=rel, err_ratio=ratio, mismatches=mism, numel=a.numel())


def bit_mismatches(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many elements of ``a`` and ``b`` (same shape and dtype) differ in their bits."""
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        raise ValueError(f"bit comparison needs the same dtype and shape: {a.dtype}{tuple(a.shape)} vs "
                         f"{b.dtype}{tuple(b.shape)}")
    size = a.element_size()
    int_dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
    return int((a.detach().cpu().contiguous().view(int_dtype) != b.detach().cpu().contiguous().view(int_dtype))
               .sum().item())


# ---------------------------------------------------------------------------------------------------------------
# tables


def format_value(v, digits: int = 6) -> str:
    """A table cell: a float to ``digits`` significant digits (scientific below 1e-3 and from 1e5), ``None`` as
    ``-``, a bool as ``yes`` / ``NO``, a shape as ``AxB``."""
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return str(v)
        if v == 0:
            return "0"
        if abs(v) >= 1e5 or abs(v) < 1e-3:
            return f"{v:.2e}"
        return f"{v:,.1f}" if abs(v) >= 1000 else f"{v:.{digits}g}"
    if isinstance(v, (tuple, list)):
        return "x".join(str(x) for x in v)
    return str(v)


def render_table(rows: Iterable[Mapping], columns: Sequence[str] | None = None, title: str | None = None,
                 digits: int = 6) -> str:
    """Render dicts as a fixed-width text table (floats to ``digits`` significant digits, ``None`` as ``-``).

    ``columns`` picks and orders the keys; by default every key of the first row. A :class:`Metrics` value in a row
    is spread into its fields.
    """
    flat = [flat_row(row) for row in rows]
    if not flat:
        return "(no rows)"
    if columns is None:
        columns = []
        for d in flat:
            columns += [k for k in d if k not in columns]
    cells = [[format_value(d.get(c), digits) for c in columns] for d in flat]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = []
    if title:
        lines.append(title)
    lines.append("  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip())
    lines.append("  ".join("-" * w for w in widths))
    for r in cells:
        lines.append("  ".join(v.rjust(w) if is_number(v) else v.ljust(w) for v, w in zip(r, widths)).rstrip())
    return "\n".join(lines)


def flat_row(row: Mapping) -> dict:
    """``row`` with a :class:`Metrics` value spread into its fields (``numel`` left out), as the tables show it."""
    d = {}
    for key, val in dict(row).items():
        if isinstance(val, Metrics):
            d.update({k: v for k, v in val.as_dict().items() if k != "numel"})
        else:
            d[key] = val
    return d


def is_number(s: str) -> bool:
    """Whether a cell reads as a number (the tables right-align those)."""
    try:
        float(s.replace(",", ""))
        return True
    except ValueError:
        return False
