"""The benchmark harness on the CPU: naming, derived figures, the results file, and the committed H200 results."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import lynn_kernels
from lynn_kernels import bench
from lynn_kernels.bench import harness
from lynn_kernels.bench.harness import Ceilings, Result
from lynn_kernels.metrics import compare

ON_GPU = torch.cuda.is_available()
PROVENANCE_KEYS = {"date", "git_sha", "gpu", "torch", "triton", "cuda", "python", "command"}
RESULT_KEYS = {"op", "provider", "shape", "dims", "median_ms", "p20_ms", "p80_ms", "bytes", "flops", "gbps",
               "tflops", "ceiling", "frac_of_ceiling", "validation", "note"}


@pytest.mark.parametrize("name,slug", [
    ("NVIDIA H200", "h200"),
    ("NVIDIA GeForce RTX 5090", "geforce-rtx-5090"),
    ("nvidia  H100 80GB HBM3", "h100-80gb-hbm3"),
    ("AMD Instinct MI300X", "instinct-mi300x"),
    ("  NVIDIA GB10 ", "gb10"),
])
def test_gpu_slug(name, slug):
    assert harness.gpu_slug(name) == slug


@pytest.mark.skipif(ON_GPU, reason="the default name is the GPU's on a GPU")
def test_gpu_slug_default_on_cpu():
    assert harness.gpu_slug() == "cpu"


CEILINGS = Ceilings(copy_gbps=4000.0, read_gbps=3500.0, bf16_tflops=800.0)


def test_derive_bandwidth():
    r = Result("op", "lynn", "8x8", {"N": 8}, median_ms=2.0, p20_ms=1.9, p80_ms=2.1, bytes=6_000_000_000,
               ceiling="copy_gbps")
    out = harness.derive(r, CEILINGS)
    assert out is r
    assert r.gbps == pytest.approx(3000.0)             # 6e9 B / 2e-3 s = 3e12 B/s
    assert r.tflops is None
    assert r.frac_of_ceiling == pytest.approx(0.75)


def test_derive_flops_and_read_ceiling():
    r = Result("mm", "lynn", "s", {}, median_ms=4.0, p20_ms=4.0, p80_ms=4.0, flops=2_000_000_000_000,
               bytes=7_000_000_000, ceiling="bf16_tflops")
    harness.derive(r, CEILINGS)
    assert r.tflops == pytest.approx(500.0)            # 2e12 / 4e-3 s = 5e14 FLOP/s
    assert r.gbps == pytest.approx(1750.0)
    assert r.frac_of_ceiling == pytest.approx(500.0 / 800.0)
    r2 = harness.derive(Result("sum", "torch", "s", {}, 1.0, 1.0, 1.0, bytes=1_750_000_000, ceiling="read_gbps"),
                        CEILINGS)
    assert r2.frac_of_ceiling == pytest.approx(0.5)


def test_derive_without_ceiling():
    r = harness.derive(Result("op", "p", "s", {}, 1.0, 1.0, 1.0, bytes=10**9), None)
    assert r.gbps == pytest.approx(1000.0) and r.frac_of_ceiling is None
    r = harness.derive(Result("op", "p", "s", {}, 1.0, 1.0, 1.0, bytes=10**9), CEILINGS)   # no ceiling named
    assert r.frac_of_ceiling is None
    r = harness.derive(Result("op", "p", "s", {}, 1.0, 1.0, 1.0, flops=10**12, ceiling="copy_gbps"), CEILINGS)
    assert r.gbps is None and r.frac_of_ceiling is None  # nothing to hold against a bandwidth ceiling


def test_save_then_load_round_trip(tmp_path):
    results = [harness.derive(Result("toy.op", "lynn", "4x4", {"N": 4, "K": 4}, 0.5, 0.4, 0.6, bytes=10**6,
                                     ceiling="copy_gbps", validation={"cosine": 1.0, "passed": True},
                                     note="a note"), CEILINGS)]
    path = harness.save("toy.op", results, CEILINGS, command="lynn bench toy", root=tmp_path,
                        extra={"comment": "kept"})
    assert path == tmp_path / harness.gpu_slug() / "toy.op.json"
    assert json.loads(path.read_text())["schema"] == harness.SCHEMA
    doc = harness.load("toy.op", gpu=harness.gpu_slug(), root=tmp_path)
    assert doc["schema"] == "lynn-bench/1" and doc["op"] == "toy.op" and doc["comment"] == "kept"
    assert PROVENANCE_KEYS <= set(doc["provenance"])
    assert doc["provenance"]["command"] == "lynn bench toy"
    assert doc["provenance"]["torch"] == torch.__version__
    assert doc["ceilings"] == CEILINGS.as_dict()
    assert doc["results"] == [r.as_dict() for r in results]
    assert set(doc["results"][0]) == RESULT_KEYS
    table = harness.result_table(doc)
    assert "provider" in table.splitlines()[0] and "lynn" in table


def test_load_missing_file_says_what_to_do(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no committed benchmark results at .*h200.*nvfp4\.nothing\.json; "
                                                r"run `lynn bench nvfp4\.nothing` on a GPU"):
        harness.load("nvfp4.nothing", root=tmp_path)


def test_load_rejects_another_schema(tmp_path):
    (tmp_path / "h200").mkdir()
    (tmp_path / "h200" / "old.json").write_text(json.dumps({"schema": "lynn-bench/0", "results": []}))
    with pytest.raises(ValueError, match="has schema 'lynn-bench/0', expected 'lynn-bench/1'"):
        harness.load("old", root=tmp_path)


@pytest.mark.parametrize("op", ["nvfp4.dequantize", "nvfp4.quantize"])
def test_committed_h200_results(op):
    doc = bench.load(op)                                    # data/bench/h200/<op>.json
    assert doc["op"] == op and doc["schema"] == harness.SCHEMA
    prov = doc["provenance"]
    for key in ("date", "gpu", "torch", "triton", "command"):
        assert prov.get(key), f"provenance lacks {key}"
    assert prov["gpu"] == "NVIDIA H200" and harness.gpu_slug(prov["gpu"]) == "h200"
    assert prov["command"].startswith("lynn bench")
    ceil = doc["ceilings"]
    assert all(ceil[k] > 0 for k in ("copy_gbps", "read_gbps", "bf16_tflops"))
    assert doc["results"], "no result rows"
    for row in doc["results"]:
        assert set(row) == RESULT_KEYS and row["op"] == op
        if row["provider"].startswith("torch copy"):
            # the same-size copy baseline computes nothing, so there is nothing to validate
            assert row["validation"] is None and row["ceiling"] == "copy_gbps"
        else:
            assert row["validation"] and row["validation"]["passed"] is True, row["provider"]
        assert row["p20_ms"] <= row["median_ms"] <= row["p80_ms"]
        # the derived figures follow from the raw ones
        assert row["gbps"] == pytest.approx(row["bytes"] / (row["median_ms"] * 1e-3) / 1e9, rel=1e-9)
        assert row["frac_of_ceiling"] == pytest.approx(row["gbps"] / ceil[row["ceiling"]], rel=1e-9)
    # every shape has a validated lynn row
    shapes = {row["shape"] for row in doc["results"]}
    lynn_shapes = {row["shape"] for row in doc["results"]
                   if row["provider"].startswith("lynn") and row["validation"]["passed"] is True}
    assert lynn_shapes == shapes
    assert "lynn" in bench.result_table(doc)


@pytest.mark.skipif(ON_GPU, reason="time_fn works on a GPU")
def test_time_fn_needs_cuda():
    with pytest.raises(RuntimeError, match="timing needs a CUDA GPU"):
        harness.time_fn(lambda: None)


@pytest.mark.parametrize("l2_mib,bytes_per_call,kwargs,expected", [
    pytest.param(60, 10 << 20, {}, 18, id="3xL2-over-10MiB"),
    pytest.param(60, 1 << 20, {}, 32, id="capped-by-max_sets"),
    pytest.param(60, 1 << 20, {"max_sets": 5}, 5, id="max_sets-5"),
    pytest.param(60, 4 << 30, {}, 1, id="bigger-than-L2"),
    pytest.param(600, 100 << 20, {"budget_bytes": 500 << 20}, 5, id="capped-by-budget"),
    pytest.param(600, 1 << 40, {"budget_bytes": 1 << 30}, 1, id="over-budget-still-one"),
    pytest.param(60, 0, {}, 32, id="zero-bytes"),
])
def test_rotation_count(monkeypatch, l2_mib, bytes_per_call, kwargs, expected):
    monkeypatch.setattr(harness, "l2_bytes", lambda: l2_mib << 20)
    made = []

    def make():
        made.append(len(made))
        return (len(made),)

    sets = harness.rotation(make, bytes_per_call, **kwargs)
    assert len(sets) == expected == len(made)
    assert sets == [(i + 1,) for i in range(expected)]       # each set freshly made


def test_rotating_cycles_through_the_sets():
    call = harness.rotating(lambda a, b: a + b, [(1, 2), (10, 20), (100, 200)])
    assert [call() for _ in range(7)] == [3, 30, 300, 3, 30, 300, 3]


def test_validated_refuses_a_wrong_op():
    ref = torch.tensor([1.0, 2.0, 3.0])
    good = harness.validated(compare(ref.clone(), ref, exact=True), exact=True)
    assert good["passed"] is True and good["mismatches"] == 0
    with pytest.raises(AssertionError, match="validation failed before timing"):
        harness.validated(compare(torch.tensor([1.0, 2.0, 3.5]), ref, exact=True), exact=True)
    with pytest.raises(AssertionError, match="validation failed before timing"):
        harness.validated(compare(-ref, ref))                  # rel_l2 2 > 2^-7
    assert harness.validated(compare(ref * 1.000001, ref))["passed"] is True


def test_validated_bounds_per_dtype_and_by_error_ratio():
    """Without a baseline the bound is the dtype's (two bf16 / fp16 unit roundoffs, 1e-6 for fp32); with one it is
    MAX_ERR_RATIO times the baseline's error, whatever the dtype."""
    ref = torch.linspace(1.0, 2.0, 64, dtype=torch.float64)
    off = ref * (1 + 3e-3)                                     # rel_l2 3e-3: a bf16 result, not an fp16 / fp32 one
    assert harness.validated(compare(off, ref), dtype=torch.bfloat16)["passed"]
    for dtype in (torch.float16, torch.float32):
        with pytest.raises(AssertionError, match=r"rel_l2 <= .*\(" + str(dtype)[6:]):
            harness.validated(compare(off, ref), dtype=dtype)
    with pytest.raises(AssertionError, match="rel_l2 <= 0.001"):
        harness.validated(compare(off, ref), max_rel_l2=1e-3)
    plain = ref * (1 + 1e-3)                                   # a baseline 3x better: ratio 3 passes, 5 does not
    assert harness.validated(compare(off, ref, baseline=plain), dtype=torch.float32)["err_ratio"] == pytest.approx(3)
    with pytest.raises(AssertionError, match="err_ratio <= 4"):
        harness.validated(compare(ref * (1 + 5e-3), ref, baseline=plain))
    with pytest.raises(AssertionError, match="validation failed"):
        harness.validated(compare(torch.full_like(ref, float("nan")), ref, baseline=plain))
    with pytest.raises(ValueError, match="dtype is torch.int8"):
        harness.validated(compare(off, ref), dtype=torch.int8)


def test_bench_registry_lists_every_family():
    import lynn_model.bench  # noqa: F401  (the whole decoder's benchmarks register on import)

    assert bench.available() == ["attention.decode", "attention.prefill", "decoder.qwen3-next-80b-a3b",
                                 "decoder.qwen3.5-35b-a3b", "deltanet.chunk", "deltanet.conv",
                                 "deltanet.recurrent", "matmul.chain", "matmul.graph", "matmul.linear", "moe.block",
                                 "nvfp4.dequantize", "nvfp4.quantize"]


def test_plots_draw_the_committed_results():
    import matplotlib

    matplotlib.use("Agg")
    from lynn_kernels.bench import load, plots

    doc = load("nvfp4.dequantize")
    ax = plots.plot_bandwidth(doc)
    shapes = {r["shape"] for r in doc["results"]}
    providers = {r["provider"] for r in doc["results"]}
    assert len(ax.patches) == len(shapes) * len(providers)
    assert any(abs(line.get_ydata()[0] - doc["ceilings"]["copy_gbps"]) < 1e-6 for line in ax.lines)
    synthetic = dict(doc, results=[dict(r, flops=2 * r["bytes"], tflops=2 * r["gbps"] / 1e3) for r in doc["results"]])
    ax = plots.plot_roofline(synthetic)
    assert len(ax.lines) == 1 + len(providers)                 # the roof, then one marker series per provider


# ---------------------------------------------------------------------------------------------------------------
# provenance: the sha and the tree state the harness reads itself (git, or LYNN_GIT_SHA / LYNN_GIT_DIRTY without it)


def _run_git(root, *args) -> str:
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    return subprocess.run(["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True,
                          capture_output=True, text=True, env=env).stdout.strip()


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A git repository with one commit (kernel.py, data/bench/x.json), and none of the provenance variables set."""
    for var in ("LYNN_GIT_SHA", "LYNN_GIT_DIRTY", "OUT"):
        monkeypatch.delenv(var, raising=False)
    root = tmp_path / "repo"
    (root / "data" / "bench").mkdir(parents=True)
    (root / "kernel.py").write_text("x = 1\n")
    (root / "data" / "bench" / "x.json").write_text("{}\n")
    _run_git(root, "init", "-q")
    _run_git(root, "add", ".")
    _run_git(root, "commit", "-q", "-m", "first")
    return root


def test_git_state_reads_the_sha_and_a_clean_tree(repo):
    state = harness.git_state(repo)
    assert state == {"git_sha": _run_git(repo, "rev-parse", "HEAD"), "git_dirty": False, "git_source": "git"}
    assert len(state["git_sha"]) == 40


@pytest.mark.parametrize("change,dirty", [
    pytest.param(lambda r: (r / "kernel.py").write_text("x = 2\n"), ["kernel.py"], id="tracked-modified"),
    pytest.param(lambda r: (r / "new_kernel.py").write_text(""), ["new_kernel.py"], id="untracked-file"),
    pytest.param(lambda r: (r / "pkg").mkdir() or (r / "pkg" / "a.py").write_text(""), ["pkg/a.py"],
                 id="untracked-in-new-folder"),
    pytest.param(lambda r: _run_git(r, "rm", "-q", "kernel.py"), ["kernel.py"], id="tracked-deleted"),
    pytest.param(lambda r: _run_git(r, "mv", "kernel.py", "kernels.py"), ["kernels.py", "kernel.py"],
                 id="renamed"),
    pytest.param(lambda r: (r / "data" / "bench" / "y.json").write_text("{}"), [], id="untracked-under-data"),
    pytest.param(lambda r: (r / "data" / "bench" / "x.json").write_text("[]"), [], id="results-rewritten"),
    pytest.param(lambda r: (r / "out").mkdir() or (r / "out" / "log.txt").write_text(""), [], id="untracked-out"),
])
def test_git_state_dirty_tree(repo, change, dirty):
    """Any change outside data/ and the output folder makes the tree dirty, untracked files included."""
    change(repo)
    state = harness.git_state(repo)
    assert state["git_source"] == "git" and state["git_sha"] == _run_git(repo, "rev-parse", "HEAD")
    assert state["git_dirty"] is bool(dirty)
    assert state.get("git_dirty_paths", []) == dirty


def test_git_state_ignores_the_output_folders(repo, monkeypatch):
    """``$OUT`` and the results root of ``save`` (``extra_clean``) inside the tree are outputs, not changes."""
    for folder in ("results", "bench-out"):
        (repo / folder).mkdir()
        (repo / folder / "op.json").write_text("{}")
    assert harness.git_state(repo)["git_dirty_paths"] == ["bench-out/op.json", "results/op.json"]
    monkeypatch.setenv("OUT", str(repo / "results"))
    assert harness.git_state(repo)["git_dirty_paths"] == ["bench-out/op.json"]
    assert harness.git_state(repo, extra_clean=(repo / "bench-out",))["git_dirty"] is False
    monkeypatch.setenv("OUT", str(repo.parent))                 # outside the tree (or the tree itself): no effect
    assert harness.git_state(repo, extra_clean=(repo,))["git_dirty"] is True


def test_experiments_in_one_device_call_keep_their_own_files(tmp_path, monkeypatch, capsys):
    """Under ``$OUT`` each experiment writes ``<name>/<sha7>.json``: two of them in one call at one commit do not
    overwrite each other."""
    monkeypatch.setenv("OUT", str(tmp_path))
    res = {"provenance": {"git_sha": "0123456789ab"}}
    paths = [harness.save_experiment(name, {**res, "name": name}) for name in ("unroll-bits", "moe-prefill-tiles")]
    assert paths == [tmp_path / "unroll-bits" / "0123456.json", tmp_path / "moe-prefill-tiles" / "0123456.json"]
    assert [json.loads(p.read_text())["name"] for p in paths] == ["unroll-bits", "moe-prefill-tiles"]
    capsys.readouterr()


def test_git_state_prefers_git_to_the_environment(repo, monkeypatch):
    """In a checkout the environment cannot override what git says; a disagreeing LYNN_GIT_SHA is only recorded."""
    head = _run_git(repo, "rev-parse", "HEAD")
    monkeypatch.setenv("LYNN_GIT_SHA", "0123456789ab")
    monkeypatch.setenv("LYNN_GIT_DIRTY", "0")
    (repo / "kernel.py").write_text("x = 3\n")
    state = harness.git_state(repo)
    assert (state["git_sha"], state["git_dirty"], state["git_source"]) == (head, True, "git")
    assert state["git_sha_env"] == "0123456789ab"
    monkeypatch.setenv("LYNN_GIT_SHA", head[:12])               # agreeing: nothing extra recorded
    assert "git_sha_env" not in harness.git_state(repo)


@pytest.mark.parametrize("sha,dirty,want", [
    pytest.param("0123456789ABcdef", "1", ("0123456789abcdef", True, "LYNN_GIT_SHA"), id="sha-dirty"),
    pytest.param("0123456", "clean", ("0123456", False, "LYNN_GIT_SHA"), id="short-sha-clean"),
    pytest.param("a" * 40, "false", ("a" * 40, False, "LYNN_GIT_SHA"), id="full-sha"),
    pytest.param("0123456789ab", None, ("0123456789ab", None, "LYNN_GIT_SHA"), id="dirty-unknown"),
    pytest.param("0123456789ab", "maybe", ("0123456789ab", None, "LYNN_GIT_SHA"), id="dirty-unreadable"),
    pytest.param(None, None, ("unknown", None, None), id="nothing"),
    pytest.param(None, "0", ("unknown", False, None), id="dirty-only"),
])
def test_git_state_without_a_checkout(tmp_path, monkeypatch, sha, dirty, want):
    """The device's copy of the tree has no .git: the launcher's LYNN_GIT_SHA / LYNN_GIT_DIRTY, else unknown."""
    for var, value in (("LYNN_GIT_SHA", sha), ("LYNN_GIT_DIRTY", dirty)):
        monkeypatch.delenv(var, raising=False) if value is None else monkeypatch.setenv(var, value)
    state = harness.git_state(tmp_path)
    assert (state["git_sha"], state["git_dirty"], state["git_source"]) == want
    assert "git_sha_env" not in state


def test_git_state_refuses_what_is_not_its_own_checkout(repo, monkeypatch):
    """A tree copied inside another repository is no checkout of its own (the outer sha would be a lie); a
    LYNN_GIT_SHA that is not a sha is kept for the record, never used as one; no git on PATH: the environment."""
    inner = repo / "copy"
    inner.mkdir()
    assert harness.git_state(inner) == {"git_sha": "unknown", "git_dirty": None, "git_source": None}
    monkeypatch.setenv("LYNN_GIT_SHA", "f554bfd+local edits")
    assert harness.git_state(inner) == {"git_sha": "unknown", "git_dirty": None, "git_source": None,
                                        "git_sha_env": "f554bfd+local edits"}
    monkeypatch.setenv("LYNN_GIT_SHA", "f554bfd530a0")
    monkeypatch.setenv("PATH", str(repo / "no-git-here"))
    assert harness.git_state(repo) == {"git_sha": "f554bfd530a0", "git_dirty": None, "git_source": "LYNN_GIT_SHA"}


def test_save_records_the_tree_state(repo, monkeypatch, tmp_path):
    monkeypatch.setattr(harness, "REPO_ROOT", repo)
    results = [harness.derive(Result("toy.op", "lynn", "4x4", {}, 0.5, 0.4, 0.6, bytes=10**6), None)]
    path = harness.save("toy.op", results, CEILINGS, command="lynn bench toy", root=repo / "results")
    prov = json.loads(path.read_text())["provenance"]
    assert prov["git_sha"] == _run_git(repo, "rev-parse", "HEAD") and prov["git_source"] == "git"
    assert prov["git_dirty"] is False                           # its own results file is not a change
    (repo / "kernel.py").write_text("x = 4\n")
    prov = json.loads(harness.save("toy.op", results, CEILINGS, root=repo / "results").read_text())["provenance"]
    assert prov["git_dirty"] is True and prov["git_dirty_paths"] == ["kernel.py"]


@pytest.mark.parametrize("prov,label", [
    ({"git_sha": "a" * 40, "git_dirty": False, "git_source": "git"}, "git aaaaaaaaaaaa"),
    ({"git_sha": "a" * 40, "git_dirty": True, "git_source": "git", "git_dirty_paths": ["k.py"]},
     "git aaaaaaaaaaaa (dirty tree: uncommitted changes in k.py)"),
    ({"git_sha": "a" * 40, "git_dirty": True, "git_source": "git", "git_dirty_paths": list("abcd")},
     "git aaaaaaaaaaaa (dirty tree: uncommitted changes in a, b, c, ...)"),
    ({"git_sha": "0123456", "git_dirty": None, "git_source": "LYNN_GIT_SHA"},
     "git 0123456 (tree state unknown; sha from LYNN_GIT_SHA)"),
    ({"git_sha": "0123456", "git_dirty": False, "git_source": "LYNN_GIT_SHA"}, "git 0123456 (sha from LYNN_GIT_SHA)"),
    ({"git_sha": "unknown", "git_dirty": None, "git_source": None}, "git unknown (tree state unknown)"),
    ({"git_sha": "9f92a56f37f9-dirty"}, "git 9f92a56f37f9 (dirty tree: uncommitted changes)"),
    ({"git_sha": "818909b701c3"}, "git 818909b701c3 (tree state not recorded)"),
    ({"git_sha": "818909b701c3", "git_sha_note": "filled in after the run"},
     "git 818909b701c3 (tree state not recorded; sha filled in by hand)"),
    ({"git_sha": "a" * 40, "git_dirty": True, "git_source": "git", "git_dirty_paths": ["k.py"],
      "git_sha_env": "b" * 40},
     "git aaaaaaaaaaaa (dirty tree: uncommitted changes in k.py; LYNN_GIT_SHA said bbbbbbbbbbbb)"),
])
def test_docs_tables_label_the_tree_state(prov, label):
    """report.py renders the provenance of each table: a figure from a dirty, unknown or hand-edited tree says so."""
    from lynn_kernels.bench import report

    assert report.git_label(prov) == label
    doc = {"provenance": {"gpu": "g", "date": "d", "torch": "t", "triton": "tr", "command": "c", **prov},
           "ceilings": CEILINGS.as_dict()}
    assert f", {label}, torch t" in report._head("op", doc)


# ---------------------------------------------------------------------------------------------------------------
# the decoder's perf gate (lynn_kernels/bench/gate.py)


def _bench_file(tmp_path, name, rows, sha="abc1234", gpu="NVIDIA H200", **extra):
    f = tmp_path / f"{name}.json"
    prov = {"git_sha": sha, "date": "2026-12-01", "gpu": gpu}
    f.write_text(json.dumps({"op": name, "provenance": prov, "results": [
        {"op": op, "provider": prov, "shape": "s", "dims": dims, "median_ms": ms} for op, prov, dims, ms in rows],
        **extra}))
    return f


def test_perf_gate_fails_a_regression_beyond_noise_and_a_missing_row(tmp_path):
    from lynn_kernels.bench import gate

    rows = [("decoder.decode", "lynn nvfp4 (graph)", {"B": 1}, 4.0),
            ("decoder.decode", "lynn nvfp4 (graph)", {"B": 8}, 8.0),
            ("decoder.prefill", "lynn nvfp4 (eager)", {"T": 16384}, 500.0),
            ("decoder.decode", "lynn nvfp4 (eager)", {"B": 1}, 90.0),           # host-timed: not gated
            ("decoder.prefill", "lynn nvfp4 (eager)", {"T": 2048}, 100.0),      # host-bound: not gated
            ("decoder.prefill", "lynn nvfp4 (prefill graph)", {"T": 2048}, 60.0)]   # captured: gated
    base = tmp_path / "baseline.json"
    made = gate.make_baseline([_bench_file(tmp_path, "decoder.x", rows)], base)
    assert len(made["rows"]) == 4
    ok = [(o, p, d, ms * f) for (o, p, d, ms), f in zip(rows, (1.029, 0.9, 1.049, 3.0, 2.0, 1.04))]
    passed, report = gate.check([_bench_file(tmp_path, "decoder.x", ok)], base)
    assert passed and [r["verdict"] for r in report] == ["ok"] * 4
    slow = [(o, p, d, ms * f) for (o, p, d, ms), f in zip(rows, (1.031, 1.0, 1.0, 1.0, 1.0, 1.0))]   # decode +3.1%
    passed, report = gate.check([_bench_file(tmp_path, "decoder.x", slow)], base)
    assert not passed and report[0]["verdict"] == "REGRESSION"
    slow = [(o, p, d, ms * f) for (o, p, d, ms), f in zip(rows, (1.0, 1.0, 1.051, 1.0, 1.0, 1.0))]   # prefill +5.1%
    assert not gate.check([_bench_file(tmp_path, "decoder.x", slow)], base)[0]
    slow = [(o, p, d, ms * f) for (o, p, d, ms), f in zip(rows, (1.0, 1.0, 1.0, 1.0, 1.0, 1.06))]    # graph prefill
    assert not gate.check([_bench_file(tmp_path, "decoder.x", slow)], base)[0]
    passed, report = gate.check([_bench_file(tmp_path, "decoder.x", rows[1:])], base)     # a gated row dropped
    assert not passed and report[0]["verdict"] == "MISSING"
    with pytest.raises(ValueError, match="gates none"):
        gate.check([_bench_file(tmp_path, "decoder.other", rows)], base)
    cut = _bench_file(tmp_path, "decoder.x", rows, partial="cut off after the graph decodes")   # a time limit hit
    with pytest.raises(ValueError, match="partial run .cut off after the graph decodes.; a baseline needs a whole"):
        gate.make_baseline([cut], base)


def test_perf_gate_compares_one_card_with_its_own_baseline(tmp_path):
    """Each card has its own baseline: results from another card, from several, or from none named are refused
    with the reason, and a card without a baseline says how to make one."""
    from lynn_kernels.bench import gate

    assert gate.baseline_path("NVIDIA H100 80GB HBM3") == gate.DATA_DIR / "h100-80gb-hbm3" / "perf_baseline.json"
    rows = [("decoder.decode", "lynn nvfp4 (graph)", {"B": 1}, 4.0)]
    base = tmp_path / "baseline.json"
    assert gate.make_baseline([_bench_file(tmp_path, "decoder.x", rows)], base)["gpu"] == "NVIDIA H200"
    (tmp_path / "h100").mkdir()
    h100 = _bench_file(tmp_path / "h100", "decoder.x", rows, gpu="NVIDIA H100 80GB HBM3")
    with pytest.raises(ValueError, match="made on the NVIDIA H200, the results ran on the NVIDIA H100 80GB HBM3"):
        gate.check([h100], base)
    with pytest.raises(ValueError, match="no result files"):
        gate.check([], base)
    with pytest.raises(ValueError, match="results from several cards"):
        gate.check([_bench_file(tmp_path, "decoder.x", rows), h100], base)
    with pytest.raises(ValueError, match="no provenance.gpu"):
        gate.make_baseline([_bench_file(tmp_path, "decoder.x", rows, gpu=None)], base)
    with pytest.raises(ValueError, match="no perf baseline for the NVIDIA A0 at .*a0.perf_baseline.json: make one"):
        gate.check([_bench_file(tmp_path, "decoder.x", rows, gpu="NVIDIA A0")])


@pytest.mark.parametrize("card", ["h200", "h100-80gb-hbm3"])
def test_perf_gate_committed_baseline_matches_its_results(card):
    """Each card's committed baseline was made from its committed decoder results: they pass it exactly."""
    from lynn_kernels.bench import gate

    passed, report = gate.check([gate.DATA_DIR / card / "decoder.qwen3.5-35b-a3b.json"])
    assert passed and all(r["slowdown"] == 0 for r in report)
    gated = {r["row"].split(" | ", 2)[2] for r in report}
    assert gated == {"lynn nvfp4 (eager) | qwen3.5-35b-a3b | B=1,T=16384",       # not the host-bound 2,048
                     *(f"lynn nvfp4 (graph) | qwen3.5-35b-a3b | B=1,context={c}" for c in (1024, 4096, 32768)),
                     "lynn nvfp4 (graph) | qwen3.5-35b-a3b | B=8,context=4096",
                     "lynn nvfp4 generate() (graph) | qwen3.5-35b-a3b | B=1,context=4096",
                     "lynn bf16 weights, cuBLAS (graph) | qwen3.5-35b-a3b | B=1,context=4096",   # not the unfolded row
                     *(f"lynn nvfp4 (prefill graph) | qwen3.5-35b-a3b | B=1,T={t}" for t in (2048, 16384)),
                     "lynn nvfp4 (prefill graph) | qwen3.5-35b-a3b | B=1,T=1536,rows=2048"}


def test_decode_bytes_counts_every_weight_kind():
    """``lynn_model.bench.decode_bytes`` counts the packed experts (the stacks, and the shared expert's views of expert
    E: hidden and expert sizes 128, so the shared expert joins the stacks) as it counts the checkpoint layout: the
    packed model reads at least as many bytes (K padded to 128 where a projection's is 64) and at most 3% more; a
    weight kind it did not know used to count as 0 bytes."""
    import dataclasses

    import lynn_model
    from lynn_kernels.moe.packed import shared_slot
    from lynn_model.bench import _nbytes, decode_bytes
    from lynn_model.model import SparseMoE

    config = dataclasses.replace(lynn_model.preset("tiny-qwen3.5-moe"), hidden_size=128, moe_intermediate_size=128,
                                 shared_expert_intermediate_size=128)
    with lynn_kernels.use_reference():          # quantised on the reference (the kernel's bits, 30x faster under the
        packed = lynn_model.loader.random_model(config, device="cpu")       # interpreter): only bytes are counted
        plain = lynn_model.loader.random_model(config, device="cpu", layout="checkpoint")
    blocks = [m for m in packed.modules() if isinstance(m, SparseMoE)]
    assert blocks and all(shared_slot(m.w13, m.w2, m.shared) for m in blocks)
    assert all(_nbytes(w) > 0 for m in blocks for w in (m.w13, m.w2, m.shared.w13, m.shared.w2))
    assert decode_bytes(plain, 64) <= decode_bytes(packed, 64) <= 1.03 * decode_bytes(plain, 64)


def test_part_bytes_add_up_to_the_steps_bytes():
    """``lynn_model.bench.part_bytes`` (the census's ideal times): over a step's layer counts the parts add up to
    :func:`decode_bytes` plus what only the parts count (the Gated DeltaNet conv states and its small tensors); the
    routed experts are the batch's expected distinct picks: ``top_k / E`` of the stacks for one token, nearly all of
    them for a batch of 512."""
    import lynn_model
    from lynn_model.bench import _nbytes, decode_bytes, part_bytes

    config = lynn_model.preset("tiny-qwen3.5-moe")
    with lynn_kernels.use_reference():
        model = lynn_model.loader.random_model(config, device="cpu")
    c, parts = model.config, part_bytes(model, 1, 64)
    gdn = next(m for m in model.layers if m.kind != "full_attention").mixer
    extra = sum(_nbytes(t) for t in (gdn.conv_weight, gdn.dt_bias, gdn.A_log, gdn.norm_weight)) \
        + 2 * c.conv_dim * (c.linear_conv_kernel_dim - 1) * model.dtype.itemsize
    counts = {"embedding": 1, "Gated DeltaNet mixer": len(c.linear_layers),
              "gated attention mixer": len(c.attention_layers),
              "MoE block (router, experts, shared expert)": c.num_hidden_layers, "LM head": 1}
    total = sum(parts[name] * n for name, n in counts.items())
    assert abs(total - (decode_bytes(model, 64) + len(c.linear_layers) * extra)) <= c.num_hidden_layers
    moe = model.layers[0].mlp
    stacks = _nbytes(moe.w13) + _nbytes(moe.w2)
    one, many = (part_bytes(model, b, 64)["MoE block (router, experts, shared expert)"] for b in (1, 512))
    assert many - one == pytest.approx(stacks * (1 - c.num_experts_per_tok / c.num_experts), rel=1e-3)


def test_prefill_census_groups_kernels_into_parts():
    """``lynn_model.bench.group_prefill``: each kernel lands in its part (the first pattern that matches; what
    matches none is "other"), times add up, and a part with FLOPs gets TFLOP/s and its fraction of the peak; the
    experts' FLOPs are ``top_k`` routed rows and the shared expert's per token, the dense ones the rest of
    :func:`active_params`."""
    import lynn_model
    from lynn_model.bench import active_params, group_prefill, prefill_flops

    detail = [("_moe_gate_up_kernel", 100.0), ("sm90_xmma_gemm_bf16bf16", 50.0), ("_moe_gate_up_kernel", 100.0),
              ("_chunk_kkt_kernel", 5.0), ("_gated_rmsnorm_kernel", 3.0), ("_rmsnorm_kernel", 2.0),
              ("elementwise_kernel", 10.0)]
    gate_up = "experts (routed + shared): gate_up"
    out = group_prefill(detail, {gate_up: 4e8}, harness.Ceilings(1.0, 1.0, 1000.0))
    assert out[gate_up]["kernels"] == 2 and out[gate_up]["us"] == 200.0
    assert out[gate_up]["tflops"] == pytest.approx(2.0) and out[gate_up]["frac_of_bf16_peak"] == pytest.approx(0.002)
    assert out["Gated DeltaNet: chunk kernels"]["us"] == 8.0 and out["norms"]["us"] == 2.0
    assert out["other (copies, casts, elementwise)"]["us"] == 10.0
    assert out["total"] == {"kernels": 7, "us": 270.0}
    assert "tflops" not in out["dense projections: GEMM"]

    with lynn_kernels.use_reference():
        model = lynn_model.loader.random_model(lynn_model.preset("tiny-qwen3.5-moe"), device="cpu")
    c, n = model.config, 10
    f = prefill_flops(model, n)
    head = c.hidden_size * c.vocab_size
    experts = f["experts (routed + shared): gate_up"] + f["experts (routed + shared): down"]
    assert f["experts (routed + shared): gate_up"] == 2 * f["experts (routed + shared): down"]
    rows = c.num_experts_per_tok * c.moe_intermediate_size + c.shared_expert_intermediate_size
    assert c.shared_expert_intermediate_size and experts == 2 * n * 3 * rows * c.hidden_size * c.num_hidden_layers
    assert experts + f["dense projections: GEMM"] == 2 * n * (active_params(model) - head) + 2 * head


def test_report_renders_the_censuses():
    """docs/performance.md's census tables: a decode census with its bytes gets the ideal and efficiency columns
    (and without them, none), parts not in the sum show no step time; a prefill census is sorted by time with its
    TFLOP/s where counted."""
    from lynn_kernels.bench import report

    part = {"kernels": 3, "us": 20.0, "per_step": 40, "bytes": 17e6, "ideal_us": 4.2, "efficiency": 0.21}
    c = {"MoE block": part, "MoE block, other form (not in the sum)": {"kernels": 1, "us": 9.0, "per_step": 0},
         "LM head": {"kernels": 2, "us": 200.0, "per_step": 1}, "per_step": {"kernels": 122, "us": 1000.0},
         "whole_step": {"kernels": 122, "us": 1050.0}}
    lines = report._census_table(c)
    assert lines[0].endswith("| MB | ideal us | efficiency |")
    assert "| MoE block | 3 | 20.0 | 40 | 800.0 | 80.0% | 17.00 | 4.2 | 21% |" in lines
    assert "| MoE block, other form (not in the sum) | 1 | 9.0 | 0 | - | - | - | - | - |" in lines
    assert "| LM head | 2 | 200.0 | 1 | 200.0 | 20.0% | - | - | - |" in lines
    plain = report._census_table({k: {x: y for x, y in v.items() if x not in ("bytes", "ideal_us", "efficiency")}
                                  for k, v in c.items()})
    assert "efficiency" not in plain[0] and "| MoE block | 3 | 20.0 | 40 | 800.0 | 80.0% |" in plain
    p = report._prefill_census_table({"norms": {"kernels": 4, "us": 500.0, "share": 0.1},
                                      "gate_up": {"kernels": 2, "us": 4000.0, "share": 0.8, "tflops": 150.0,
                                                  "frac_of_bf16_peak": 0.22},
                                      "total": {"kernels": 6, "us": 5000.0}})
    assert p[2] == "| gate_up | 2 | 4.00 | 80.0% | 150 | 22% |" and p[3] == "| norms | 4 | 0.50 | 10.0% | - | - |"


def test_a_benchmark_cut_off_keeps_the_stages_it_finished(tmp_path, monkeypatch):
    """A benchmark that takes ``partial`` saves its rows after each stage: when the run dies (a device call's time
    limit), the file holds those rows, marked partial; a whole run's file is not marked."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(harness, "provenance", lambda *a, **k: {"gpu": "test"})
    monkeypatch.setattr(harness, "gpu_slug", lambda gpu=None: "test")
    row = Result("x.op", "lynn", "s", {"N": 1}, 1.0, 0.9, 1.1)

    def stages(ceilings, quick=False, partial=None):
        partial([row], {"stage": 1}, "the first stage")
        if stages.die:
            raise TimeoutError("the device call's limit")
        return [row, row]

    monkeypatch.setitem(bench.BENCHMARKS, "zz.stages", stages)
    stages.die = True
    with pytest.raises(TimeoutError):
        bench.run(["zz.stages"], ceilings=CEILINGS, root=tmp_path)
    doc = json.loads((tmp_path / "test" / "zz.stages.json").read_text())
    assert doc["partial"] == "cut off after the first stage" and len(doc["results"]) == 1
    assert doc["info"] == {"stage": 1}
    stages.die = False
    doc = json.loads(Path(bench.run(["zz.stages"], ceilings=CEILINGS, root=tmp_path)["zz.stages"]).read_text())
    assert "partial" not in doc and len(doc["results"]) == 2
