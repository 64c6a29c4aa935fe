"""``race(variant, shapes=...)``: the variant against the shipped op and the vendor baseline, each checked first.

On a GPU, per shape: every provider's output is compared with the op's torch reference on the same inputs (a
provider that fails is reported, not timed); then each is timed by CUDA-graph replay (``S`` calls on ``S`` rotating
input sets, together past three times the L2, in one graph, replayed; the median per call), in alternating rounds
(variant, shipped, baseline, then the reverse), beside the read ceiling measured in the same process. Results are
rows of the benchmark schema (:class:`lynn_kernels.bench.Result`), saved with provenance and the variant's source
hash when asked.

On a CPU there is nothing to time: the report says so and shows the shipped kernel's committed GPU figures.
"""

from __future__ import annotations

import contextlib
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import runtime
from ..bench.harness import (
    REPO_ROOT,
    Ceilings,
    Result,
    derive,
    graph_us,
    l2_bytes,
    load,
    measure_ceilings,
    provenance,
    result_table,
)
from ..metrics import compare, render_table
from .check import CheckReport, _error_text, check
from .shapes import Shape, default_shapes, parse, shapes_for
from .variant import Variant, shipped, using, variant

#: A provider passes validation with a relative L2 error (against the op's reference on the same inputs) within this
#: factor of the shipped op's own, or within 1e-6, or within a share of one step of the output dtype
#: (``torch.finfo(dtype).eps``): an eighth of it for our kernels (a few roundings flipped by another order of the
#: sum: 1e-3 in bf16, as the matmul checks allow), all of it for the vendor baseline (it also rounds the weights to
#: bf16). ``check`` stays the strict gate; this only keeps a wrong output from being timed.
MAX_ERROR_FACTOR = 1.5


def can_time() -> bool:
    return torch.cuda.is_available() and not runtime.INTERPRET


def _tensor_bytes(obj, seen=None) -> int:
    """Bytes of every distinct tensor reachable from ``obj`` (tuples, lists, dicts, dataclass-like objects)."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        key = (obj.data_ptr(), obj.numel())
        if key in seen:
            return 0
        seen.add(key)
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return sum(_tensor_bytes(o, seen) for o in obj)
    if isinstance(obj, dict):
        return sum(_tensor_bytes(o, seen) for o in obj.values())
    if hasattr(obj, "__dict__") or hasattr(obj, "__slots__"):
        names = list(getattr(obj, "__dict__", {})) + list(getattr(obj, "__slots__", ()))
        return sum(_tensor_bytes(getattr(obj, n, None), seen) for n in names)
    return 0


def _first(out):
    """The tensor a provider's output is validated on: the first of a tuple, an NVFP4 tensor's values in fp32."""
    from ..nvfp4 import NVFP4Tensor, reference

    out = out[0] if isinstance(out, (tuple, list)) else out
    return reference.dequantize(out, torch.float32) if isinstance(out, NVFP4Tensor) else out


@dataclass
class RaceReport:
    variant: Variant
    check: CheckReport
    rows: list[Result] = field(default_factory=list)
    ceilings: Ceilings | None = None
    note: str = ""
    committed: str = ""                 #: on a CPU: the shipped op's committed GPU figures, as a table
    saved: Path | None = None
    checked: bool = True                #: False: race(..., skip_check=True), the check's verdict not asked for

    @property
    def passed(self) -> bool:
        """The variant passed its check and every shape's validation."""
        return (self.check.passed or not self.checked) and all(r.validation is None or r.validation.get("passed", True)
                                         for r in self.rows if r.provider == self.variant.label)

    def table(self) -> str:
        if not self.rows:
            return "(nothing timed)"
        flat = [{"shape": r.shape, "provider": r.provider, "us": r.median_ms * 1e3,
                 "GB/s": r.gbps, "of read ceiling": r.frac_of_ceiling,
                 "validated": "yes" if (r.validation or {}).get("passed") else "NO"} for r in self.rows]
        return render_table(flat, digits=4)

    def plot(self, ax=None):
        """Microseconds per call by shape, one bar per provider (matplotlib)."""
        import matplotlib.pyplot as plt

        shapes = list(dict.fromkeys(r.shape for r in self.rows))
        providers = list(dict.fromkeys(r.provider for r in self.rows))
        if ax is None:
            _, ax = plt.subplots(figsize=(max(6, 1.6 * len(shapes)), 3.5))
        width = 0.8 / max(1, len(providers))
        for i, p in enumerate(providers):
            us = [next((r.median_ms * 1e3 for r in self.rows if r.shape == s and r.provider == p), math.nan)
                  for s in shapes]
            ax.bar([j + i * width for j in range(len(shapes))], us, width, label=p)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))], shapes, rotation=20, ha="right")
        ax.set_ylabel("us per call (graph replay)")
        ax.set_title(f"{self.variant.op.name}: {self.variant.label}")
        ax.legend(fontsize=8)
        return ax

    def text(self, failures: bool = True) -> str:
        """The report: the check's verdict, with its failed rows unless ``failures`` is False (a caller that prints
        the whole check table already), then the timings, the note and the committed figures."""
        parts = [self.check.summary() if self.checked else f"{self.variant.label}: not checked (skip_check)"]
        if failures and self.checked and self.check.failures:
            parts.append("failed rows:\n" + self.check.failures_table())
        if self.rows:
            parts.append(self.table())
        if self.note:
            parts.append(self.note)
        if self.committed:
            parts.append(self.committed)
        if self.saved:
            parts.append(f"saved: {self.saved}")
        return "\n".join(parts)

    def __str__(self) -> str:
        return self.text()

    __repr__ = __str__


def committed_figures(v: Variant, gpu: str = "h200", rows: int | None = 1, limit: int = 12) -> str:
    """The shipped op's committed ``lynn bench`` figures (``data/bench/<gpu>/<bench>.json``) as a short table: its
    rows at ``rows`` rows of x (``M``, where the benchmark has one: the nearest it ran; None: every M), at most
    ``limit``."""
    if not v.op.bench:
        return f"(no committed GPU figures for {v.op.name}: it has no `lynn bench` of its own)"
    try:
        doc = load(v.op.bench, gpu)
    except (FileNotFoundError, ValueError) as err:
        return f"(no committed GPU figures: {err})"
    ours = [r for r in doc["results"] if r["provider"].startswith("lynn")]
    ms = sorted({r["dims"]["M"] for r in ours if "M" in r.get("dims", {})})
    if rows is not None and ms:
        rows = min(ms, key=lambda m: (abs(m - rows), m))           # the benchmark's M nearest the one asked for
    kept = [r for r in ours if rows is None or r.get("dims", {}).get("M", rows) == rows]
    doc = {**doc, "results": [{**r, "shape": _with_m(r)} for r in kept[:limit]]}
    prov = doc["provenance"]
    at = f" at M = {rows}" if rows is not None and any("M" in r.get("dims", {}) for r in kept) else ""
    return (f"committed {gpu} figures of the shipped op (`lynn bench {v.op.bench}`, {prov.get('date', '?')}, "
            f"{prov.get('git_sha', '?')[:7]}){at}, {len(doc['results'])} of {len(kept)} rows:\n" + result_table(doc))


#: Where races of variants are committed (``save=`` a folder of it): ``data/lab/<gpu>/<op>.<variant>.json``.
LAB_DIR = REPO_ROOT / "data" / "lab"


def committed_race(v: Variant, shapes: str, gpu: str = "h200") -> str:
    """A committed race of this very variant (the same op and source hash) on ``shapes``, as a table, or ""."""
    folder = LAB_DIR / gpu
    for path in sorted(folder.glob(f"{v.op.name}.*.json")) if folder.is_dir() else []:
        doc = json.loads(path.read_text())
        if (doc.get("variant", {}).get("source_sha256_12") != v.source_hash
                or f"shapes={shapes!r}" not in doc.get("provenance", {}).get("command", "")):
            continue
        prov = doc["provenance"]
        rows = [{"shape": r["shape"], "provider": r["provider"], "us": round(r["median_ms"] * 1e3, 3),
                 "GB/s": r.get("gbps"), "of ceiling": r.get("frac_of_ceiling"),
                 "validated": "yes" if (r.get("validation") or {}).get("passed") else "no"} for r in doc["results"]]
        rel = path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path
        return (f"committed {gpu} race of this variant (source sha256 {v.source_hash}, {prov.get('date', '?')}, "
                f"{prov.get('git_sha', '?')[:7]}; {rel}):\n" + render_table(rows, digits=4))
    return ""


def _with_m(r: dict) -> str:
    m = r.get("dims", {}).get("M")
    return r["shape"] if m is None or f"M={m}" in r["shape"] else f"{r['shape']} (M={m})"


def _validate(out, want, base_err: float | None, vendor: bool) -> dict:
    """The output against the reference, with the bounds of :data:`MAX_ERROR_FACTOR`."""
    ref = _first(want)
    m = compare(_first(out), ref)
    step = torch.finfo(ref.dtype).eps * (1.0 if vendor else 0.125) if ref.dtype.is_floating_point else 0.0
    bound = max(1e-6, step, MAX_ERROR_FACTOR * base_err if base_err is not None else 0.0)
    return {**m.as_dict(), "passed": bool(m.rel_l2 <= bound)}


def _failed(err: BaseException) -> dict:
    return {"passed": False, "error": _error_text(err)}


#: The most rotating input sets one graph cycles through: tiny ops (a norm's row) stay under three L2s even so, as
#: the activations of a real decode step do (the note of each row says how far its sets reach).
MAX_SETS = 256


def _rows_of(shapes) -> int | None:
    """The rows of x a named shape set runs at (the committed figures shown beside a CPU race)."""
    if not isinstance(shapes, str):
        return None
    try:
        return parse(shapes)[1]
    except ValueError:
        return None


def _set_bytes(shape: Shape, sample: tuple) -> int:
    return shape.bytes(*sample[:2]) if shape.bytes else _tensor_bytes(sample)


def _n_sets(shape: Shape, sample: tuple) -> int:
    return max(2, min(MAX_SETS, math.ceil(3 * l2_bytes() / max(1, _set_bytes(shape, sample)))))


def race(v, fn=None, *, shapes=None, kernel: str | None = None, rounds: int = 2,
         save: str | Path | None = None, skip_check: bool = False) -> RaceReport:
    """Check the variant (:func:`.check`), then on a GPU time it against the shipped op and the vendor baseline on
    ``shapes``: a name (``"qwen3.5-35b-a3b:decode"``, :mod:`.shapes`) or a list of :class:`.Shape` (default:
    Qwen3.5-35B-A3B's decode shapes, its prefill shapes for an op the decoder runs only there). ``save``: a
    folder to write ``<op>.<variant>.json`` into (the benchmark schema, with provenance and the source hash)."""
    v = variant(v, fn, kernel=kernel) if fn is not None else variant(v)
    shapes = default_shapes(v.op.name) if shapes is None else shapes
    todo = shapes_for(v.op.name, shapes) if isinstance(shapes, str) else list(shapes)   # a bad name: before work
    report = RaceReport(v, check(v) if not skip_check else CheckReport(v, cases_used=1), checked=not skip_check)
    if report.checked and not report.check.passed:
        report.note = "not raced: the variant failed its check"
        return report
    if not can_time():
        report.note = ("timing needs a CUDA GPU (this run is on the interpreter): the variant was checked; on a GPU "
                       "the same call races it")
        report.committed = committed_figures(v, rows=_rows_of(shapes))
        if isinstance(shapes, str) and (mine := committed_race(v, shapes)):
            report.committed = mine + "\n\n" + report.committed
        return report
    report.ceilings = measure_ceilings(size_bytes=1 << 30)
    ship = shipped(v.op)
    reference = v.op.fn.reference
    for shape in todo:
        report.rows += _race_shape(v, ship, reference, shape, rounds, report.ceilings)
    if save is not None:
        report.saved = _save(report, Path(save), shapes if isinstance(shapes, str) else "explicit")
    return report


def _race_shape(v: Variant, ship: Variant, reference, shape: Shape, rounds: int, ceilings: Ceilings) -> list[Result]:
    first = shape.make()
    sets = [first] + [shape.make() for _ in range(_n_sets(shape, first) - 1)]
    reach = len(sets) * _set_bytes(shape, first) / l2_bytes()
    args, kwargs, aux = first
    want = reference(*args, **kwargs)
    shipped_out = ship.fn(*args, **kwargs)
    base_err = compare(_first(shipped_out), _first(want)).rel_l2
    providers = [(v.label, lambda a, k, x: v.op.fn(*a, **k), v),
                 ("shipped", lambda a, k, x: ship.fn(*a, **k), None)]
    if shape.baseline is not None:
        label, fn = shape.baseline
        providers.append((label, lambda a, k, x, fn=fn: fn(*a, **k, **x), None))
    results = []
    times: dict[str, list[float]] = {p[0]: [] for p in providers}
    checks = {}
    for label, call, routed in providers:
        try:
            with using(routed) if routed is not None else contextlib.nullcontext({"unrouted": 1}) as hits:
                out = call(args, kwargs, aux)
            checks[label] = _validate(out, want, base_err, vendor=label not in (v.label, "shipped"))
            if routed is not None and not hits:       # the op took another path here: a race of nothing
                checks[label] = {**checks[label], "passed": False,
                                 "error": f"the variant did not run at this shape ({v.kernel or v.op.name})"}
        except Exception as err:                      # reported as its row, never a traceback
            checks[label] = _failed(err)
    order = [p for p in providers if checks[p[0]]["passed"]]
    for r in range(rounds):
        for label, call, routed in (order if r % 2 == 0 else order[::-1]):
            if not checks[label]["passed"]:
                continue
            calls = [lambda s=s, call=call: call(*s) for s in sets]
            try:
                with using(routed, count=False) if routed is not None else contextlib.nullcontext():
                    times[label].append(graph_us(calls))
            except Exception as err:                  # a capture that fails (a host sync inside a variant)
                checks[label] = _failed(err)
    nbytes = shape.bytes(args, kwargs) if shape.bytes else _tensor_bytes((args, kwargs, want))
    for label, _, _ in providers:
        ok = checks[label]["passed"] and bool(times[label])
        us = statistics.median(times[label]) if ok else math.nan
        spread = times[label] or [math.nan]
        res = Result(f"lab.{v.op.name}", label, shape.label, shape.dims, us / 1e3, min(spread) / 1e3, max(spread) / 1e3,
                     bytes=nbytes, flops=shape.flops, ceiling="read_gbps",
                     validation=checks[label],
                     note=f"graph of {len(sets)} calls on rotating inputs ({reach:.1f}x the L2), median of {rounds} "
                          "alternating rounds"
                          + ("" if ok else f"; not timed: {checks[label].get('error', 'failed validation')}"))
        results.append(derive(res, ceilings) if ok else res)
    return results


def _save(report: RaceReport, folder: Path, shapes: str) -> Path:
    from .variant import source_of

    v = report.variant
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{v.op.name}.{v.label}.json"
    doc = {"schema": "lynn-bench/1", "op": f"lab.{v.op.name}",
           "provenance": provenance(f"lynn_kernels.lab.race({v.op.name}, shapes={shapes!r})"),
           "ceilings": report.ceilings.as_dict() if report.ceilings else None,
           "variant": {"name": v.label, "kernel": v.kernel, "source_sha256_12": v.source_hash,
                       "source": source_of(v.fn)},
           "results": [r.as_dict() for r in report.rows]}
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


__all__ = ["race", "RaceReport", "committed_figures", "committed_race", "can_time", "MAX_ERROR_FACTOR"]
