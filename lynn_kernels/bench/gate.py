"""The decoder's performance gate: today's benchmark rows against a committed baseline, failing beyond noise.

Each card has its own baseline, ``data/bench/<gpu>/perf_baseline.json`` beside its results (timings from different
cards do not compare): per gated row (benchmark, op, provider, dims), the median time of a reference run and where
it came from (git sha, date, card). ``lynn bench decoder --check`` runs the benchmarks and then :func:`check`
against the baseline of the card they ran on; ``lynn bench --check-only FILE...`` checks result files already
written; ``lynn bench --make-baseline FILE...`` writes the baseline of the files' card from them (after a change
that is meant to move the figures, with the reason in the commit). A gated row slower than its baseline by more than
the tolerance of its op (decode 3%, prefill 5%) fails the gate; a gated row missing from the results fails it too,
so a benchmark cannot quietly drop what it is gated on. Only device-bound rows are gated (graph replays,
``generate()`` on the graph path, the captured prefill, the long eager prefill): host-timed eager decode steps and
short eager prefills move with the host, not the code.
"""

from __future__ import annotations

import json
from pathlib import Path

from .harness import DATA_DIR, gpu_slug

#: slowdown allowed before a row fails, by op
TOLERANCE = {"decoder.decode": 0.03, "decoder.prefill": 0.05}

#: providers whose rows are gated (device-bound figures)
GATED = ("lynn nvfp4 (graph)", "lynn nvfp4 generate() (graph)", "lynn bf16 weights, cuBLAS (graph)",
         "lynn nvfp4 (eager)@decoder.prefill", "lynn nvfp4 (prefill graph)")


def baseline_path(gpu: str) -> Path:
    """Where the baseline of the card named ``gpu`` ('NVIDIA H200') lives: ``data/bench/<gpu>/perf_baseline.json``."""
    return DATA_DIR / gpu_slug(gpu) / "perf_baseline.json"


def card(result_files: list) -> str:
    """The one card (``provenance.gpu``) that ``result_files`` were measured on; a ValueError naming the files when
    they do not say, or name several."""
    cards = {}
    for f in result_files:
        prov = read_result(f).get("provenance")
        gpu = prov.get("gpu") if isinstance(prov, dict) else None
        cards[str(f)] = gpu if isinstance(gpu, str) and gpu.strip() else None
    if None in cards.values():
        raise ValueError(f"{[f for f, g in cards.items() if g is None]}: no provenance.gpu, so no card's baseline "
                         f"applies")
    if not cards:
        raise ValueError("no result files: a gate needs at least one")
    if len(set(cards.values())) != 1:
        raise ValueError(f"results from several cards ({cards}): a gate compares one card's timings")
    return next(iter(cards.values()))


def _key(bench: str, row: dict) -> str:
    dims = ",".join(f"{k}={v}" for k, v in sorted(row.get("dims", {}).items()))
    return f"{bench} | {row['op']} | {row['provider']} | {row.get('shape', '')} | {dims}"


#: Shortest gated prefill: a shorter one is bound by the host's launches and too noisy to gate; a 16,384-token one
#: is bound by the GPU (docs/history/prefill.md).
PREFILL_MIN_TOKENS = 8192


def _gated(row: dict) -> bool:
    if row["op"] == "decoder.prefill" and row["provider"] == "lynn nvfp4 (eager)" \
            and row.get("dims", {}).get("T", 0) < PREFILL_MIN_TOKENS:
        return False
    return row["provider"] in GATED or f"{row['provider']}@{row['op']}" in GATED


def read_result(f) -> dict:
    """A ``lynn bench`` result file, checked: a ValueError (or OSError) naming the file when it is not one."""
    try:
        data = json.loads(Path(f).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as err:
        raise ValueError(f"{f}: not a JSON file ({err})") from None
    rows = data.get("results") if isinstance(data, dict) else None
    if not isinstance(data, dict) or not isinstance(data.get("op"), str) or not isinstance(rows, list) or not all(
            isinstance(r, dict) and isinstance(r.get("op"), str) and isinstance(r.get("provider"), str)
            and isinstance(r.get("median_ms"), (int, float)) for r in rows):
        raise ValueError(f"{f}: not a lynn bench result (expected an object with 'op' and 'results', rows with "
                         f"'op', 'provider' and 'median_ms')")
    return data


def gated_rows(result_files: list) -> dict[str, dict]:
    """``{key: {"median_ms", "git_sha", "date"}}`` for the gated rows of benchmark result files."""
    rows = {}
    for f in result_files:
        data = read_result(f)
        prov = data.get("provenance", {})
        for row in data["results"]:
            if _gated(row):
                rows[_key(data["op"], row)] = {"median_ms": row["median_ms"], "git_sha": prov.get("git_sha"),
                                               "date": prov.get("date"), "note": row.get("note", "")}
    return rows


def make_baseline(result_files: list, path: Path | None = None) -> dict:
    """Write the baseline from ``result_files`` (their gated rows) to ``path``, by default their card's
    :func:`baseline_path`; returns it."""
    gpu = card(result_files)
    path = baseline_path(gpu) if path is None else path
    for f in result_files:
        cut = read_result(f).get("partial")
        if cut:
            raise ValueError(f"{f}: a partial run ({cut}); a baseline needs a whole one")
    rows = gated_rows(result_files)
    if not rows:
        raise ValueError(f"no gated rows ({GATED}) in {[str(f) for f in result_files]}")
    base = {"schema": 1, "gpu": gpu, "tolerance": TOLERANCE,
            "made_from": [str(Path(f).name) for f in result_files], "rows": rows}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(base, indent=1) + "\n")
    return base


def check(result_files: list, path: Path | None = None) -> tuple[bool, list[dict]]:
    """Compare the gated rows of ``result_files`` with the baseline at ``path``, by default their card's
    :func:`baseline_path`. Returns ``(passed, report)``: one entry per baseline row of the benchmarks present
    (missing rows fail), with its ratio and verdict. A ValueError when that card has no baseline, or the baseline
    was made on another card."""
    gpu = card(result_files)
    path = baseline_path(gpu) if path is None else Path(path)
    if not path.is_file():
        raise ValueError(f"no perf baseline for the {gpu} at {path}: make one from a whole run on that card with "
                         f"`lynn bench --make-baseline RESULT.json`")
    base = json.loads(path.read_text())
    if base.get("gpu") != gpu:
        made_on = base.get("gpu", "card it does not name")
        raise ValueError(f"{path} was made on the {made_on}, the results ran on the {gpu}: timings from different "
                         f"cards do not compare")
    now = gated_rows(result_files)
    benches = {read_result(f)["op"] for f in result_files}
    report = []
    for key, ref in base["rows"].items():
        bench, op = key.split(" | ")[:2]
        if bench not in benches:
            continue
        tol = base.get("tolerance", TOLERANCE).get(op, TOLERANCE.get(op, 0.03))
        got = now.get(key)
        if got is None:
            report.append({"row": key, "baseline_ms": ref["median_ms"], "now_ms": None, "slowdown": None,
                           "tolerance": tol, "verdict": "MISSING"})
            continue
        slow = got["median_ms"] / ref["median_ms"] - 1
        report.append({"row": key, "baseline_ms": ref["median_ms"], "now_ms": got["median_ms"], "slowdown": slow,
                       "tolerance": tol, "verdict": "ok" if slow <= tol else "REGRESSION"})
    if not report:
        raise ValueError(f"the baseline {path} gates none of the benchmarks in {sorted(benches)}")
    return all(r["verdict"] == "ok" for r in report), report


def format_report(report: list[dict]) -> str:
    lines = [f"{'verdict':<10} {'baseline ms':>11} {'now ms':>9} {'change':>8}  row"]
    for r in report:
        now = "-" if r["now_ms"] is None else f"{r['now_ms']:.3f}"
        change = "-" if r["slowdown"] is None else f"{r['slowdown']:+.1%}"
        lines.append(f"{r['verdict']:<10} {r['baseline_ms']:>11.3f} {now:>9} {change:>8}  {r['row']}"
                     f" (allowed +{r['tolerance']:.0%})")
    return "\n".join(lines)
