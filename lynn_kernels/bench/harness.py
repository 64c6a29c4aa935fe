"""The benchmark harness: one result schema, measured ceilings, honest timing, JSON under ``data/bench/<gpu>/``.

A result row (``Result``) holds: op, provider, shape label and dims, median / p20 / p80 in ms, the bytes and flops
the op must move or do, the derived GB/s and TFLOP/s, which ceiling it is held against and the fraction of it, and
the validation metrics of that provider's output. A results file adds the provenance (date, git sha, GPU, versions,
command) and the ceilings measured in the same process.

Timing: ``triton.testing.do_bench`` medians (it also flushes L2 before each run), with inputs rotated across enough
copies to exceed the L2 several times over, and baselines run in the same process on the same inputs.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

from ..metrics import Metrics

SCHEMA = "lynn-bench/1"
REPO_ROOT = Path(__file__).resolve().parents[2]
DATA_DIR = REPO_ROOT / "data" / "bench"


@dataclass
class Result:
    op: str
    provider: str
    shape: str                       #: human label, e.g. "8192x8192"
    dims: dict                       #: named sizes, e.g. {"N": 8192, "K": 8192}
    median_ms: float
    p20_ms: float
    p80_ms: float
    bytes: int = 0                   #: the fewest bytes the op must move (each input read once, output written once)
    flops: int = 0
    gbps: float | None = None
    tflops: float | None = None
    ceiling: str | None = None       #: "copy_gbps", "read_gbps" or "bf16_tflops"
    frac_of_ceiling: float | None = None
    validation: dict | None = None   #: Metrics of this provider's output against the reference
    note: str = ""

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class Ceilings:
    copy_gbps: float                 #: device-to-device copy, bytes read + written
    read_gbps: float                 #: sum of a large bf16 tensor
    bf16_tflops: float               #: 8192^3 bf16 matmul on random data
    sizes: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def gpu_slug(name: str | None = None) -> str:
    """'NVIDIA H200' -> 'h200' (the folder name under data/bench/)."""
    name = name or (torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    name = re.sub(r"^(nvidia|amd)\s+", "", name.strip(), flags=re.I)
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


#: Paths (relative to the repository root) whose changes, tracked or untracked, leave a tree clean: data (the harness
#: itself writes its results under data/bench/, and a run of several ops must not call its own output dirty) and the
#: output folder. ``$OUT`` and the results root of :func:`save`, where inside the tree, are added per call.
CLEAN_PATHS = ("data/", "out/")
_SHA = re.compile(r"[0-9a-f]{7,40}")
_DIRTY_WORDS = {"1": True, "true": True, "yes": True, "dirty": True, "0": False, "false": False, "no": False,
                "clean": False}


def _git(root: Path, *args: str) -> str | None:
    """``git -C root ARGS`` stdout, or None when git is missing or fails (no checkout, an unsafe directory...)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}    # no GIT_DIR from outside
    try:
        run = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10, env=env,
                             check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return run.stdout if run.returncode == 0 else None


def _relative(path, root: Path) -> str | None:
    """``path`` relative to ``root`` as a folder prefix (``"a/b/"``), or None when it lies outside."""
    try:
        rel = Path(path).resolve().relative_to(root.resolve()).as_posix()
    except (ValueError, OSError):
        return None
    return None if rel in ("", ".") else rel.rstrip("/") + "/"


def _dirty_paths(porcelain: str, clean: tuple[str, ...]) -> list[str]:
    """The changed paths of ``git status --porcelain=v1 -z`` output, less those under a ``clean`` prefix."""
    fields, paths = porcelain.split("\0"), []
    i = 0
    while i < len(fields):
        entry = fields[i]
        i += 1
        if len(entry) < 4:
            continue
        xy, path = entry[:2], entry[3:]
        names = [path]
        if "R" in xy or "C" in xy:                  # a rename / copy: the next field is the source path
            names.append(fields[i])
            i += 1
        paths += [n for n in names if not any(n == c.rstrip("/") or n.startswith(c) for c in clean)]
    return paths


def git_state(root: Path | None = None, extra_clean=()) -> dict:
    """The tree's provenance, read by the harness itself (never written by hand).

    * In a git checkout whose top level is ``root`` (the repository): ``git_sha`` is ``git rev-parse HEAD`` (the full
      sha) and ``git_dirty`` whether ``git status --porcelain`` lists any change, tracked or untracked, outside
      :data:`CLEAN_PATHS`, ``$OUT`` and ``extra_clean`` (``git_dirty_paths``: the first few); the environment is not
      consulted (a ``LYNN_GIT_SHA`` that disagrees is kept as ``git_sha_env``, for the record).
    * Without one (the device's copy of the tree has no ``.git``; a tree inside another repository counts as none):
      ``git_sha`` is ``LYNN_GIT_SHA`` (hex, 7 to 40 digits; else ``"unknown"``) and ``git_dirty`` comes from
      ``LYNN_GIT_DIRTY`` (``1`` / ``0``, ``true`` / ``false``, ``dirty`` / ``clean``), else None: unknown.

    ``git_source`` says which: ``"git"``, ``"LYNN_GIT_SHA"`` or None.
    """
    root = Path(root or REPO_ROOT)
    env_sha = os.environ.get("LYNN_GIT_SHA", "").strip().lower()
    top = _git(root, "rev-parse", "--show-toplevel")
    if top is not None and Path(top.strip()).resolve() == root.resolve():
        head = (_git(root, "rev-parse", "HEAD") or "").strip()
        if _SHA.fullmatch(head):
            clean = CLEAN_PATHS + tuple(p for p in (_relative(x, root) for x in (os.environ.get("OUT"), *extra_clean)
                                                    if x) if p)
            status = _git(root, "status", "--porcelain=v1", "-z", "--untracked-files=all")
            dirty = None if status is None else _dirty_paths(status, clean)
            state = {"git_sha": head, "git_dirty": None if dirty is None else bool(dirty), "git_source": "git"}
            if dirty:
                state["git_dirty_paths"] = dirty[:20]
            if env_sha and not head.startswith(env_sha):
                state["git_sha_env"] = env_sha
            return state
    dirty_env = os.environ.get("LYNN_GIT_DIRTY", "").strip().lower()
    if _SHA.fullmatch(env_sha):
        return {"git_sha": env_sha, "git_dirty": _DIRTY_WORDS.get(dirty_env), "git_source": "LYNN_GIT_SHA"}
    state = {"git_sha": "unknown", "git_dirty": _DIRTY_WORDS.get(dirty_env), "git_source": None}
    if env_sha:
        state["git_sha_env"] = env_sha                 # not a sha: kept for the record, never used as one
    return state


def provenance(command: str | None = None, extra_clean=()) -> dict:
    """Date, :func:`git_state` (sha, dirty, source), GPU, versions and the command of this process."""
    import triton

    info = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        **git_state(extra_clean=extra_clean),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "command": command or " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["sms"] = props.multi_processor_count
        info["l2_bytes"] = getattr(props, "L2_cache_size", None)
    return info


def l2_bytes() -> int:
    if torch.cuda.is_available():
        return int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 64 << 20))
    return 64 << 20


# ---------------------------------------------------------------------------------------------------------------
# timing


def time_fn(fn: Callable[[], object], warmup_ms: int = 25, rep_ms: int = 200) -> tuple[float, float, float]:
    """(median, p20, p80) in ms of ``fn`` via ``triton.testing.do_bench`` (CUDA events, L2 flushed between runs)."""
    if not torch.cuda.is_available():
        raise RuntimeError("timing needs a CUDA GPU; under the interpreter there is nothing meaningful to time")
    import triton.testing

    med, p20, p80 = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.5, 0.2, 0.8])
    return float(med), float(p20), float(p80)


def host_us(fn: Callable[[], object], n: int = 2000) -> float:
    """Microseconds per call of ``n`` back-to-back eager calls (after 50 warm-up calls), synchronised at both ends:
    the host's cost of a call when the GPU work behind it is shorter (a launch's host cost)."""
    import time

    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def churn_calls(fn: Callable[[], torch.Tensor], first: torch.Tensor, calls: int = 50) -> int:
    """How many of ``calls`` calls of ``fn`` return other bits than ``first``, 256 MB of freed GPU memory scribbled
    on (NaN) before each: a kernel that reads memory it did not write, or a pipelining fault, shows as changing
    bits."""
    wrong = 0
    for _ in range(calls):
        junk = torch.full((64 << 20,), float("nan"), device="cuda")
        del junk
        if not torch.equal(fn(), first):
            wrong += 1
    return wrong


def kernel_ms(fn: Callable[[], object], n: int = 30) -> float:
    """Median over ``n`` calls of the summed GPU duration of the kernels one call launches (CUDA profiler).

    This is what a CUDA-graph step pays; ``time_fn`` of a short kernel on a slow host measures the Python launch."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                      and "memset" not in e.name.lower() and "memcpy" not in e.name.lower()),
                     key=lambda e: e.time_range.start)
    if not kernels or len(kernels) % n:
        raise RuntimeError(f"profiler saw {len(kernels)} kernels for {n} calls; cannot attribute them to calls")
    per = len(kernels) // n
    return statistics.median(sum(e.time_range.elapsed_us() for e in kernels[i * per:(i + 1) * per])
                             for i in range(n)) / 1e3


def graph_us(calls: list, reps: int = 20) -> float:
    """Median microseconds per call of ``calls`` (zero-argument callables) captured as one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in calls:
            c()                                    # warm-up: compile, autotune, allocate outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    times.sort()
    return times[len(times) // 2]


def timed(result: Result, call: Callable[[], object], ceilings: Ceilings | None) -> list[Result]:
    """Two rows for one provider: ``<provider> (call)``, ``do_bench`` of the Python call, and ``<provider>
    (kernel)``, the profiler's kernel time. ``result`` carries everything but the timings."""
    med, p20, p80 = time_fn(call)
    km = kernel_ms(call)
    note = result.note + ("; " if result.note else "")
    rows = [dataclasses.replace(result, provider=f"{result.provider} (call)", median_ms=med, p20_ms=p20, p80_ms=p80,
                                note=note + "do_bench of the Python call"),
            dataclasses.replace(result, provider=f"{result.provider} (kernel)", median_ms=km, p20_ms=km, p80_ms=km,
                                note=note + "CUDA profiler kernel time, median of 30 calls (p20/p80 not recorded)")]
    return [derive(r, ceilings) for r in rows]


def rotation(make_inputs: Callable[[], tuple], bytes_per_call: int, max_sets: int = 32,
             budget_bytes: int = 8 << 30) -> list[tuple]:
    """Enough input sets that cycling through them touches at least 3x the L2 (capped by ``budget_bytes``)."""
    want = max(1, math.ceil(3 * l2_bytes() / max(1, bytes_per_call)))
    n = max(1, min(want, max_sets, budget_bytes // max(1, bytes_per_call)))
    return [make_inputs() for _ in range(n)]


def rotating(fn: Callable, sets: Sequence[tuple]) -> Callable[[], object]:
    """A zero-argument callable that runs ``fn(*sets[i])`` with ``i`` advancing on every call."""
    state = {"i": 0}

    def call():
        args = sets[state["i"] % len(sets)]
        state["i"] += 1
        return fn(*args)

    return call


def derive(result: Result, ceilings: Ceilings | None) -> Result:
    """Fill GB/s, TFLOP/s and the fraction of the matching ceiling from bytes, flops and the median."""
    s = result.median_ms * 1e-3
    if result.bytes:
        result.gbps = result.bytes / s / 1e9
    if result.flops:
        result.tflops = result.flops / s / 1e12
    if ceilings is not None and result.ceiling:
        value = getattr(ceilings, result.ceiling)
        got = result.tflops if result.ceiling.endswith("tflops") else result.gbps
        result.frac_of_ceiling = None if got is None else got / value
    return result


def measure_ceilings(size_bytes: int = 1 << 30, mm: int = 8192) -> Ceilings:
    """Copy and read bandwidth over ``size_bytes`` of bf16 and a ``mm``^3 bf16 matmul, on random data."""
    n = size_bytes // 2
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy_ms, _, _ = time_fn(lambda: dst.copy_(src))
    read_ms, _, _ = time_fn(lambda: src.sum(dtype=torch.float32))
    dst = None
    a = torch.randn(mm, mm, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(mm, mm, device="cuda", dtype=torch.bfloat16)
    mm_ms, _, _ = time_fn(lambda: a @ b)
    src = a = b = None
    torch.cuda.empty_cache()
    return Ceilings(copy_gbps=2 * size_bytes / (copy_ms * 1e-3) / 1e9,
                    read_gbps=size_bytes / (read_ms * 1e-3) / 1e9,
                    bf16_tflops=2 * mm**3 / (mm_ms * 1e-3) / 1e12,
                    sizes={"copy_read_bytes": size_bytes, "matmul_n": mm})


# ---------------------------------------------------------------------------------------------------------------
# files


def results_path(op: str, gpu: str | None = None, root: Path | None = None) -> Path:
    return (root or DATA_DIR) / gpu_slug(gpu) / f"{op}.json"


def save_experiment(name: str, res: dict) -> Path:
    """Write an experiment's result ``res`` (with ``res["provenance"]`` from :func:`provenance`) as
    ``data/experiments/<name>/<sha7>.json``, or as ``$OUT/<name>/<sha7>.json`` when ``OUT`` is set (a device run:
    several experiments in one call keep their own files); print and return the path."""
    out_dir = (Path(os.environ["OUT"]) if os.environ.get("OUT") else REPO_ROOT / "data" / "experiments") / name
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{(res['provenance'].get('git_sha') or 'nogit')[:7]}.json"
    path.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {path}")
    return path


def save(op: str, results: list[Result], ceilings: Ceilings, command: str | None = None,
         root: Path | None = None, extra: dict | None = None) -> Path:
    """Write one op's results with provenance and ceilings to ``data/bench/<gpu>/<op>.json``."""
    path = results_path(op, root=root)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"schema": SCHEMA, "op": op, "provenance": provenance(command, extra_clean=(path.parent,)),
           "ceilings": ceilings.as_dict(),
           "results": [r.as_dict() for r in results]}
    if extra:
        doc.update(extra)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def load(op: str, gpu: str = "h200", root: Path | None = None) -> dict:
    """Read committed results (used by notebooks and docs when no GPU is present)."""
    path = (root or DATA_DIR) / gpu / f"{op}.json"
    if not path.exists():
        raise FileNotFoundError(f"no committed benchmark results at {path}; run `lynn bench {op}` on a GPU")
    doc = json.loads(path.read_text())
    if doc.get("schema") != SCHEMA:
        raise ValueError(f"{path} has schema {doc.get('schema')!r}, expected {SCHEMA!r}")
    return doc


def result_table(doc: dict, columns: Sequence[str] | None = None) -> str:
    """Render a results document as a text table (the same renderer as validation tables)."""
    from ..metrics import render_table

    columns = columns or ["provider", "shape", "median_ms", "gbps", "tflops", "frac_of_ceiling"]
    rows = [{c: r.get(c) for c in columns} for r in doc["results"]]
    return render_table(rows, columns)


#: The benchmark gate (:func:`validated`), one rule for every op. An output passes when
#:
#: * ``exact=True``: no element differs in its bits from the reference;
#: * the metrics carry a baseline (``err_ratio``, the same computation done plainly in the dtype, or the exact
#:   answer rounded once to it): its error against the fp32 (or better) oracle is at most ``MAX_ERR_RATIO`` times the
#:   baseline's. On the H200 the largest is 2.52 (fla's chunked Gated DeltaNet, bf16 dot operands), lynn's 2.46;
#: * otherwise: its ``rel_l2`` is at most ``MAX_REL_L2[dtype]``, ``dtype`` the precision the op computes in (two unit
#:   roundoffs of bf16 / fp16, 1e-6 for an all-fp32 path), or the ``max_rel_l2`` a caller gives with its measurement.
MAX_ERR_RATIO = 4.0
MAX_REL_L2 = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 1e-6}


def validated(metrics: Metrics, *, exact: bool = False, dtype: torch.dtype = torch.bfloat16,
              max_rel_l2: float | None = None) -> dict:
    """Turn metrics into the ``validation`` field; raise if the op is wrong (no speed is reported for a wrong op).

    The rule is :data:`MAX_ERR_RATIO` / :data:`MAX_REL_L2` (above); ``dtype`` only matters without a baseline.
    """
    if exact:
        ok, rule = metrics.mismatches == 0, "no bit mismatch"
    elif metrics.err_ratio is not None:
        ok, rule = metrics.err_ratio <= MAX_ERR_RATIO, f"err_ratio <= {MAX_ERR_RATIO:g}"
    else:
        if max_rel_l2 is None:
            if dtype not in MAX_REL_L2:
                raise ValueError(f"dtype is {dtype}; the gate knows {sorted(map(str, MAX_REL_L2))}")
            max_rel_l2 = MAX_REL_L2[dtype]
        ok, rule = metrics.rel_l2 <= max_rel_l2, f"rel_l2 <= {max_rel_l2:.3g} ({str(dtype)[6:]})"
    if not ok:
        raise AssertionError(f"validation failed before timing ({rule}): {metrics}")
    d = metrics.as_dict()
    d["passed"] = True
    return d
