"""The kernel lab (``lynn_kernels.lab``, ``lynn_model.lab.in_decoder``, ``lynn race``) on the CPU, under the
interpreter: a correct variant of each op family passes ``check`` and a planted wrong one fails naming its case;
kernel variants (``lab.edit``) pass, fail, or fail to compile as rows; ``using`` routes every call, the decoder's
included; ``lynn race`` answers with its exit statuses; the named shapes agree with the model's presets. One GPU test
races a bit-identical copy of the packed GEMV against the shipped one.

(That each kernel slot routes with identical bits is tests/test_lab_kernels.py's.)"""

from __future__ import annotations

import collections
import importlib
import json
import math
import re
import subprocess

import pytest
import torch
import triton

import lynn_cli
import lynn_kernels
from lynn_kernels import lab, norm, runtime
from lynn_kernels.lab import shapes
from lynn_kernels.lab.check import cases_of
from lynn_kernels.norm import triton_rmsnorm

DEV = runtime.DEVICE
BF16 = torch.bfloat16
cpu_only = pytest.mark.skipif(lab.can_time(), reason="on a GPU the race times instead (the CPU's answer is tested)")

#: One op of each family, with cheap check cases, and how its correct variant reaches the shipped op: through
#: ``lab.shipped(op).fn`` (the host function) or the public op (the shipped one again inside a routed call).
FAMILY_OPS = (
    ("nvfp4", "nvfp4.dequantize", "shipped"),
    ("matmul", "matmul.nvfp4_linear", "public"),
    ("attention", "attention.decode_attention", "shipped"),
    ("deltanet", "deltanet.gated_rmsnorm", "public"),
    ("moe", "moe.route", "shipped"),
    ("norm", "norm.rmsnorm", "public"),
)
FAMILY_IDS = [f for f, _, _ in FAMILY_OPS]

#: A small edit of the RMSNorm kernel that makes it wrong (``1 + 2w`` instead of ``1 + w``), and one that cannot run.
RMSNORM_WRONG = {"w1 = 1.0 + ": "w1 = 1.0 + 2.0 * "}
RMSNORM_UNDEFINED = {"rstd = row_rstd(h, D, eps)": "rstd = row_rstd(h, D, eps) + no_such_name"}


def _calling(name: str, how: str, calls: list | None = None):
    """A correct callable variant of ``name``: the shipped op, counting its calls in ``calls``."""
    target = lab.shipped(name).fn if how == "shipped" else lab.find(name).fn

    def fn(*args, **kwargs):
        if calls is not None:
            calls.append(1)
        return target(*args, **kwargs)

    return fn


def _perturbed(name: str):
    """A planted wrong variant of ``name``: the shipped op's main output (the first of a tuple) times 1.01, in place
    (so an ``out=`` the caller passed carries it too)."""
    target = lab.find(name).fn

    def fn(*args, **kwargs):
        out = target(*args, **kwargs)
        main = out[0] if isinstance(out, (tuple, list)) else out
        assert main.dtype.is_floating_point, (name, main.dtype)
        main.mul_(1.01)
        return out

    return fn


def _labels(family: str) -> set[str]:
    return {case.label for case in cases_of(family)}


def _x_w(rows=3, d=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, d, generator=gen).to(BF16).to(DEV)
    w = (0.2 * torch.randn(d, generator=gen)).to(DEV)
    return x, w


# -- check: a correct variant of each family passes, a planted wrong one fails naming its case ---------------------

@pytest.mark.parametrize("family, name, how", FAMILY_OPS, ids=FAMILY_IDS)
def test_check_passes_a_correct_variant_of_each_family(family, name, how):
    calls: list = []
    report = lab.check(lab.variant(name, _calling(name, how, calls), name="correct"))
    assert report.variant.op.family == family
    assert report.passed, report
    assert report.cases_used > 0 and calls, report
    family_ops = importlib.import_module(f"lynn_kernels.{family}.check").OPS
    assert report.rows and all(r["op"] in family_ops for r in report.rows)
    assert all(r["case"] in _labels(family) and "error" not in r for r in report.rows)


@pytest.mark.parametrize("family, name, how", FAMILY_OPS, ids=FAMILY_IDS)
def test_check_fails_a_planted_wrong_variant_of_each_family_naming_the_case(family, name, how):
    report = lab.check(name, _perturbed(name))
    assert not report.passed and report.failures, report
    labels = _labels(family)
    for row in report.failures:                                 # failed on its numbers (it raised nothing)
        assert row["case"] in labels, (row, labels)
        assert ("metrics" in row or "mismatches" in row) and "error" not in row, row
    assert "FAILED" in report.summary()
    assert any(row["case"] in str(report) for row in report.failures)


# -- kernel variants ------------------------------------------------------------------------------------------------

def test_an_exact_copy_of_a_kernel_passes_and_a_broken_edit_fails():
    copy = lab.variant("norm.rmsnorm", lab.edit("norm.rmsnorm", {}))
    assert copy.kernel == "norm.rmsnorm"
    report = lab.check(copy)
    assert report.passed and report.cases_used == len(_labels("norm")), report

    broken = lab.check("norm.rmsnorm", lab.edit("norm.rmsnorm", RMSNORM_WRONG))
    assert not broken.passed and broken.failures, broken
    assert {r["case"] for r in broken.failures} <= _labels("norm")
    assert any(r["op"] == "norm.rmsnorm" and "metrics" in r for r in broken.failures)


@triton.jit
def _halved(x):
    return x * 0.5


def test_an_edit_may_call_a_helper_of_its_own():
    halved = lab.edit("norm.rmsnorm", {"w1 = 1.0 + ": "w1 = _halved(1.0) + "}, helpers={"_halved": _halved})
    report = lab.check("norm.rmsnorm", halved)
    assert not report.passed and report.failures, report                      # the helper ran: 1 + w became 0.5 + w
    assert all("metrics" in r and "error" not in r for r in report.failures), report.failures
    with pytest.raises(ValueError, match="hide names"):
        lab.edit("norm.rmsnorm", {}, helpers={"tl": _halved})


#: Every kernel a variant may replace (each op's launchers' kernels), with the first op that runs it.
KERNEL_OPS = {k: op.name for op in reversed(lab.OPS.values()) for k in op.kernels}


@pytest.mark.parametrize("kernel", sorted(KERNEL_OPS))
def test_edit_copies_every_kernel_a_variant_may_replace(kernel):
    """Whatever wraps the shipped kernel (a decorator over several lines, an autotuner, heuristics), its exact copy
    is a kernel with the shipped parameters, wrapped as the launcher needs it."""
    shipped = runtime.KERNELS[kernel].shipped
    copy = lab.edit(kernel, {})
    assert copy.arg_names == shipped.arg_names and lab.source_of(copy).lstrip().startswith("def ")
    v = lab.variant(KERNEL_OPS[kernel], copy, kernel=kernel)
    assert v.kernel == kernel
    for attr in ("configs", "values"):                          # autotuned / heuristics as the shipped kernel is
        assert hasattr(v._routed, attr) == hasattr(shipped, attr)
        assert hasattr(getattr(v._routed, "fn", None), attr) == hasattr(getattr(shipped, "fn", None), attr)


@pytest.mark.parametrize("kernel", ["nvfp4.dequantize", "attention.prefill"], ids=["autotuned", "heuristics"])
def test_an_exact_copy_of_a_wrapped_kernel_passes(kernel):
    report = lab.check(KERNEL_OPS[kernel], lab.edit(kernel, {}), kernel=kernel)
    assert report.passed, report


def test_check_keeps_what_a_kernel_reports_under_another_ops_rows():
    """A wrong packed GEMV fails an nvfp4_linear check on every row that runs it, the norm_linear rows included
    (the norm folded into the GEMV reports under its own op's name), and a norm_linear check of it fails too."""
    wrong = lab.edit("matmul.packed_gemv", {"* FMA_UNIT": "* FMA_UNIT * 1.25"}, name="scaled_gemv")
    report = lab.check("nvfp4_linear", wrong)
    failed = {r["op"] for r in report.failures}
    assert not report.passed and "matmul.norm_linear packed" in failed and "matmul.packed gemv" in failed, failed
    assert not lab.check("matmul.norm_linear", wrong).passed


def test_in_decoder_reads_the_divergence_on_the_decode_path():
    """A variant that is wrong only in decode (one row of x) parts the tokens after the first; the top-2 reported
    for it are those of the decode step that made its token, not of a prefill that never runs it."""
    from lynn_model.lab import in_decoder

    def decode_only(x, w, bias=None):
        y = lynn_kernels.matmul.nvfp4_linear(x, w, bias)
        return y * 1.5 if x.reshape(-1, x.shape[-1]).shape[0] == 1 else y

    with lynn_kernels.use_reference():
        report = in_decoder(lab.variant("nvfp4_linear", decode_only), new_tokens=6, prompt_len=4)
    assert not report.equal and report.divergence["position"] >= 1, report
    d = report.divergence
    assert d["variant_top2"][0][0] == d["variant_token"] and d["shipped_top2"][0][0] == d["shipped_token"]


def test_a_kernel_that_cannot_compile_fails_as_rows_with_the_error():
    report = lab.check("norm.rmsnorm", lab.edit("norm.rmsnorm", RMSNORM_UNDEFINED))      # never raises
    assert not report.passed and report.cases_used == len(_labels("norm")), report
    assert report.failures and all("error" in r for r in report.failures)
    for row in report.failures:
        assert row["case"] in _labels("norm") and row["passed"] is False
        err = row["error"]
        assert re.match(r"\w+(Error|Exception)\b", err), err          # the exception's type first
        assert "\n" not in err and "Traceback" not in err and len(err) <= 300, err
        if runtime.INTERPRET:
            assert "NameError" in err and "no_such_name" in err, err     # InterpreterError: NameError(...)
    assert "error" in report.table()


def test_a_kernel_with_other_parameters_is_refused():
    missing_h = lab.edit("norm.rmsnorm", {"y_ptr, h_ptr,": "y_ptr,"}, name="_rmsnorm_without_h")
    with pytest.raises(TypeError, match=r"missing \['h_ptr'\]") as err:
        lab.variant("norm.rmsnorm", missing_h)
    assert "_rmsnorm_without_h" in str(err.value) and "norm.rmsnorm" in str(err.value)
    with pytest.raises(ValueError, match="kernel='matmul.gemv' is not one"):
        lab.variant("norm.rmsnorm", lab.edit("norm.rmsnorm", {}), kernel="matmul.gemv")


def test_an_unknown_op_is_refused_with_a_suggestion():
    with pytest.raises(ValueError, match=r"unknown op 'rmsnrom' \(did you mean .*rmsnorm"):
        lab.find("rmsnrom")
    with pytest.raises(ValueError, match="did you mean"):
        lab.variant("norm.rmsnrom", lambda *a, **k: None)
    with pytest.raises(ValueError, match="no launcher runs a kernel called 'norm.rmsnrom'"):
        lab.edit("norm.rmsnrom", {})
    with pytest.raises(ValueError, match="occurs 0 times"):
        lab.edit("norm.rmsnorm", {"no such text": ""})


# -- using: routes every call ---------------------------------------------------------------------------------------

def test_using_counts_calls_by_the_public_op():
    x, w = _x_w()
    want = norm.rmsnorm(x, w)
    calls: list = []
    with lab.using(lab.variant("norm.rmsnorm", _calling("norm.rmsnorm", "public", calls))) as hits:
        got = norm.rmsnorm(x, w)
        norm.rmsnorm(x, w, residual=x)
    assert hits == collections.Counter({norm.rmsnorm: 2}) and len(calls) == 2
    assert torch.equal(got, want)                   # inside the variant, the op is the shipped one: no recursion
    norm.rmsnorm(x, w)
    assert len(calls) == 2                          # the route is gone after the block
    with lab.using(lab.variant("norm.rmsnorm", _calling("norm.rmsnorm", "public", calls)), count=False) as hits:
        norm.rmsnorm(x, w)
    assert hits == collections.Counter() and len(calls) == 3


def test_nested_using_restores_the_outer_routes():
    x, w = _x_w()
    seen: list[str] = []

    def tagged(tag):
        def fn(*args, **kwargs):
            seen.append(tag)
            return norm.rmsnorm(*args, **kwargs)
        return fn

    outer, inner = lab.variant("rmsnorm", tagged("outer")), lab.variant("rmsnorm", tagged("inner"))
    with lab.using(outer) as outer_hits:
        norm.rmsnorm(x, w)
        with lab.using(inner) as inner_hits:
            norm.rmsnorm(x, w)
        norm.rmsnorm(x, w)
    norm.rmsnorm(x, w)
    assert seen == ["outer", "inner", "outer"]
    assert outer_hits[norm.rmsnorm] == 3 and inner_hits[norm.rmsnorm] == 1      # the outer block counts the inner's


def test_a_routed_variant_runs_under_the_reference_backend():
    """Routes win over use_reference() (runtime.op's wrapper asks for a route first); inside the variant the op is
    the shipped one, which then runs its reference."""
    x, w = _x_w()
    seen: list[str] = []

    def fn(*args, **kwargs):
        seen.append(runtime.backend())
        return norm.rmsnorm(*args, **kwargs)

    with lynn_kernels.use_reference(), lab.using(lab.variant("rmsnorm", fn)) as hits:
        got = norm.rmsnorm(x, w)
    assert seen == ["reference"] and hits[norm.rmsnorm] == 1
    assert torch.equal(got, norm.rmsnorm.reference(x, w))


def test_a_kernel_route_reaches_a_launcher_called_without_kernel():
    x, w = _x_w()
    want = norm.rmsnorm(x, w)
    wrong = lab.variant("norm.rmsnorm", lab.edit("norm.rmsnorm", RMSNORM_WRONG))
    out, out_shipped = torch.empty_like(x), torch.empty_like(x)
    with lab.using(wrong) as hits:
        triton_rmsnorm.launch_rmsnorm(x, w, 1e-6, None, out, None)                 # no kernel=: the route's
        assert hits == collections.Counter({"norm.rmsnorm": 1})
        triton_rmsnorm.launch_rmsnorm(x, w, 1e-6, None, out_shipped, None, kernel=triton_rmsnorm.RMSNORM.shipped)
        assert hits == collections.Counter({"norm.rmsnorm": 1})                    # kernel= wins, uncounted
        via_op = norm.rmsnorm(x, w)
        assert hits["norm.rmsnorm"] == 2
    assert not torch.equal(out, want) and torch.equal(via_op, out)
    assert torch.equal(out_shipped, want)
    assert torch.equal(norm.rmsnorm(x, w), want)                                   # gone after the block


# -- the decoder ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fused", [False, True], ids=["as-loaded", "fused"])
def test_in_decoder_counts_a_correct_variant_and_keeps_the_tokens(fused):
    """As loaded, and fused as ``lynn generate`` runs the model on a GPU (the default there)."""
    from lynn_model.lab import in_decoder

    calls: list = []
    with lynn_kernels.use_reference():
        report = in_decoder(lab.variant("norm.rmsnorm", _calling("norm.rmsnorm", "public", calls)),
                            new_tokens=4, prompt_len=4, fused=fused)
    assert report.calls > 0 and report.calls == len(calls) and report.fused == fused
    assert report.equal and report.divergence is None and len(report.variant_tokens) == 4
    assert "equal to the shipped path" in str(report)
    assert ("fused as lynn generate runs it" in str(report)) == fused


def test_in_decoder_shows_where_a_wrong_variant_parts():
    from lynn_model.lab import in_decoder

    def wrong(x, weight, *args, **kwargs):
        return norm.rmsnorm(x, weight * 3, *args, **kwargs)

    with lynn_kernels.use_reference():
        report = in_decoder(lab.variant("norm.rmsnorm", wrong), new_tokens=4, prompt_len=4)
    assert report.calls > 0 and not report.equal
    d = report.divergence
    i = d["position"]
    assert report.shipped_tokens[:i] == report.variant_tokens[:i]
    assert d["shipped_token"] == report.shipped_tokens[i] != d["variant_token"] == report.variant_tokens[i]
    for key, token in (("shipped_top2", d["shipped_token"]), ("variant_top2", d["variant_token"])):
        top2 = d[key]
        assert len(top2) == 2 and top2[0][0] == token and top2[0][1] >= top2[1][1], (key, top2)
    assert f"part at position {i}" in str(report)


# -- lynn race ------------------------------------------------------------------------------------------------------

@pytest.fixture
def variant_file(tmp_path):
    path = tmp_path / "my_variants.py"
    path.write_text("from lynn_kernels import lab\n\n"
                    "k = lab.edit('norm.rmsnorm', {})\n"
                    f"bad = lab.edit('norm.rmsnorm', {RMSNORM_WRONG!r})\n")
    return path


def _race(capsys, *argv) -> tuple[int, str, str]:
    code = lynn_cli.main(["race", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _usage_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lynn race: error: "), err
    return lines[0]


@cpu_only
def test_race_command_passes_a_correct_variant(capsys, variant_file):
    code, out, err = _race(capsys, "norm.rmsnorm", "--variant", f"{variant_file}:k")
    assert code == 0, out + err
    assert out.startswith("lynn race norm.rmsnorm: _rmsnorm_kernel_edited (kernel norm.rmsnorm)")
    assert re.search(r"^ *op +case .*passed", out, re.MULTILINE), out                     # the check table
    assert all(label in out for label in _labels("norm")), out
    n = len(_labels("norm"))
    assert "passed; " in out and f"rows from {n} of {n} cases" in out and "timing needs a CUDA GPU" in out
    assert "no committed GPU figures for norm.rmsnorm" in out


def test_race_command_fails_a_wrong_variant(capsys, variant_file):
    code, out, err = _race(capsys, "rmsnorm", "--variant", f"{variant_file}:bad")
    assert code == 1, out + err
    assert "FAILED" in out and "not raced: the variant failed its check" in out


@pytest.mark.parametrize("argv, says", [
    (["norm.rmsnorm", "--variant", "{dir}/nowhere.py:k"], "is not a Python file"),
    (["norm.rmsnorm", "--variant", "{file}"], "expected FILE.py:NAME"),
    (["norm.rmsnorm", "--variant", "{file}:nosuch"], "defines no 'nosuch' (its callables: bad, k)"),
    (["rmsnrom", "--variant", "{file}:k"], "unknown op 'rmsnrom' (did you mean"),
    (["norm.rmsnorm", "--variant", "{file}:k", "--kernel", "matmul.gemv"], "kernel='matmul.gemv' is not one"),
    (["norm.rmsnorm", "--variant", "{file}:k", "--shapes", "qwen9:decode"], "unknown shapes 'qwen9:decode'"),
    (["flash_attention", "--variant", "{file}:k", "--shapes", "qwen3.5-35b-a3b:decode"],
     "attention.flash_attention has no decode shapes: the decoder runs it at prefill only"),
    (["norm.rmsnorm", "--variant", "{file}:k", "--rounds", "0"], "--rounds 0: expected at least 1"),
    (["norm.rmsnorm"], "nothing to race: give --variant FILE.py:NAME, --base REV, or both"),
    ([], "which op?"),
    (["norm.rmsnorm", "--base", "nosuchrev"], "--base nosuchrev: not a git revision"),
    (["norm.rmsnorm", "--base", "HEAD"], "norm.rmsnorm has no benchmark of its own"),
], ids=["missing-file", "no-name", "missing-name", "unknown-op", "bad-kernel", "bad-shapes", "no-such-phase",
        "no-rounds", "nothing-to-race", "no-op", "bad-base", "base-without-bench"])
def test_race_command_usage_errors(capsys, variant_file, argv, says):
    argv = [a.format(dir=variant_file.parent, file=variant_file) for a in argv]
    code, out, err = _race(capsys, *argv)
    assert code == 2, out + err
    assert says in _usage_error(err), err


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU --base runs the benchmark in both trees")
def test_race_command_base_needs_a_gpu(capsys):
    from lynn_kernels.bench.harness import REPO_ROOT

    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True).returncode:
        pytest.skip("not a git checkout")
    code, out, err = _race(capsys, "matmul.nvfp4_linear", "--base", "HEAD")
    assert code == 2, out + err
    assert err.strip().splitlines() == ["lynn race: error: --base: timing matmul.graph in both trees needs a CUDA "
                                        "GPU; nothing was run"], err


# -- lab.race on a CPU ----------------------------------------------------------------------------------------------

@cpu_only
def test_race_on_a_cpu_checks_and_shows_the_committed_figures():
    name = "matmul.nvfp4_linear"
    report = lab.race(lab.variant(name, _calling(name, "shipped"), name="mine"))
    assert report.passed and report.check.passed and not report.rows and report.table() == "(nothing timed)"
    assert "timing needs a CUDA GPU" in report.note
    op = lab.find(name)
    assert op.bench == "matmul.graph"
    first = report.committed.splitlines()[0]
    assert first.startswith(f"committed h200 figures of the shipped op (`lynn bench {op.bench}`"), first
    assert len(report.committed.splitlines()) > 3 and "lynn" in report.committed      # rows of the lynn providers
    assert report.committed in str(report) and report.note in str(report)


def test_race_does_not_race_a_wrong_variant():
    report = lab.race("norm.rmsnorm", _perturbed("norm.rmsnorm"))
    assert not report.passed and not report.rows and not report.committed
    assert report.note == "not raced: the variant failed its check"
    text = str(report)
    assert "FAILED" in text and "failed rows:" in text
    assert all(row["case"] in text for row in report.check.failures), text       # which rows, not only how many


@pytest.fixture
def faked_gpu_timing(monkeypatch):
    """race()'s GPU path on the CPU: timing says yes, a graph replay calls each call once and takes 5 us, the
    ceilings are made up, the L2 is one byte (two rotating input sets)."""
    from lynn_kernels.bench.harness import Ceilings

    race_module = importlib.import_module("lynn_kernels.lab.race")     # lab.race is the function
    replays: list[int] = []

    def graph_us(calls, reps=20):
        for call in calls:
            call()
        replays.append(len(calls))
        return 5.0

    monkeypatch.setattr(race_module, "can_time", lambda: True)
    monkeypatch.setattr(race_module, "graph_us", graph_us)
    monkeypatch.setattr(race_module, "measure_ceilings", lambda size_bytes: Ceilings(4000.0, 3000.0, 800.0))
    monkeypatch.setattr(race_module, "l2_bytes", lambda: 1)                # two input sets a shape
    return replays


@pytest.mark.parametrize("op_name", list(shapes.BUILDERS))
def test_race_validates_and_times_every_provider(faked_gpu_timing, tmp_path, op_name):
    """Each provider (the variant, the shipped op, the vendor baseline) is validated against the reference and then
    timed: an exact copy and a vendor baseline that rounds its weights to bf16 both pass, whatever the op returns (a
    tensor, a tuple, an NVFP4 tensor), the ops that update a state in place included (each provider runs on the
    state the one before it left)."""
    todo = _tiny_shapes(op_name)[:2]
    v = lab.variant(op_name, _calling(op_name, "public"), name="mine")
    report = lab.race(v, shapes=todo, rounds=2, skip_check=True, save=tmp_path)
    providers = ["mine", "shipped"] + [s.baseline[0] for s in todo[:1] if s.baseline]
    assert [r.provider for r in report.rows[:len(providers)]] == providers
    assert len(report.rows) == len(todo) * len(providers) and faked_gpu_timing, report
    for r in report.rows:
        assert r.validation["passed"], (r.shape, r.provider, r.validation)
        assert r.median_ms == 5e-3 and r.gbps and r.frac_of_ceiling, r
    assert report.passed and report.saved == tmp_path / f"{op_name}.mine.json"
    doc = json.loads(report.saved.read_text())
    assert doc["variant"]["source_sha256_12"] == v.source_hash and len(doc["results"]) == len(report.rows)


def test_race_does_not_time_a_provider_that_fails_validation(faked_gpu_timing):
    todo = shapes.shapes_for("norm.rmsnorm", "tiny-qwen3.5-moe:decode")
    wrong = lab.variant("norm.rmsnorm", _perturbed("norm.rmsnorm"), name="wrong")
    report = lab.race(wrong, shapes=todo, skip_check=True)
    by = {r.provider: r for r in report.rows}
    assert not by["wrong"].validation["passed"] and math.isnan(by["wrong"].median_ms), report.table()
    assert by["shipped"].validation["passed"] and by["shipped"].median_ms == 5e-3
    assert not report.passed and "NO" in report.table()


def test_race_reports_a_variant_the_shape_never_reaches_and_a_provider_that_raises(faked_gpu_timing):
    """A packed-GEMV variant at 8 rows of x (the dispatch takes another kernel there) is a failed row saying so, not
    the shipped kernel timed under its name; a provider that raises is a failed row with the error."""
    todo = shapes.shapes_for("matmul.nvfp4_linear", "tiny-qwen3.5-moe:decode-b8")[:1]
    copy = lab.variant("nvfp4_linear", lab.edit("matmul.packed_gemv", {}), name="copy")
    row = {r.provider: r for r in lab.race(copy, shapes=todo, skip_check=True).rows}["copy"]
    assert not row.validation["passed"] and "did not run at this shape" in row.validation["error"], row
    assert math.isnan(row.median_ms)

    def boom(*args, **kwargs):
        raise RuntimeError("out of resources")

    report = lab.race(lab.variant("nvfp4_linear", boom, name="boom"), shapes=todo, skip_check=True)
    row = {r.provider: r for r in report.rows}["boom"]
    assert row.validation == {"passed": False, "error": "RuntimeError: out of resources"} and not report.passed


# -- named shapes ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("model", list(shapes.MODELS))
def test_shapes_models_agree_with_the_presets(model):
    from lynn_model.cache import MIN_PAGE
    from lynn_model.config import PRESETS

    d, c = shapes.MODELS[model], PRESETS[model]
    assert (d.hidden, d.heads, d.kv_heads, d.head_dim) == (c.hidden_size, c.num_attention_heads,
                                                           c.num_key_value_heads, c.head_dim)
    assert (d.gdn_k_heads, d.gdn_v_heads) == (c.linear_num_key_heads, c.linear_num_value_heads)
    assert d.gdn_head_dim == c.linear_key_head_dim == c.linear_value_head_dim
    assert (d.experts, d.top_k, d.expert_inter, d.shared_inter) == (
        c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.shared_expert_intermediate_size)
    assert (d.head_dim // shapes.ROTARY_DIV, shapes.ROPE_THETA, shapes.CONV_WIDTH) == (
        c.rotary_dim, c.rope_theta, c.linear_conv_kernel_dim)                 # what the builders add to Dims
    assert (shapes.PAGE, shapes.EPS) == (MIN_PAGE, c.rms_norm_eps) and c.conv_dim == shapes._gdn_widths(d)[0]


@pytest.mark.parametrize("name", ["qwen3.5-35b-a3b", "qwen3.5-35b-a3b:decod", "qwen9:decode", ":prefill", ""])
def test_shapes_parse_refuses_bad_names_listing_the_choices(name):
    with pytest.raises(ValueError) as err:
        shapes.parse(name)
    msg = str(err.value)
    assert f"unknown shapes {name!r}" in msg
    assert all(m in msg for m in shapes.MODELS) and all(p in msg for p in shapes.PHASES), msg


def test_shapes_parse_and_an_op_or_a_phase_without_shapes():
    d, rows, model, phase = shapes.parse("qwen3.5-35b-a3b:decode-b8")
    assert (d, rows, model, phase) == (shapes.MODELS["qwen3.5-35b-a3b"], 8, "qwen3.5-35b-a3b", "decode-b8")
    assert set(shapes.BUILDERS) == set(lab.OPS)                     # every public op has named shapes
    with pytest.raises(ValueError, match="no named shapes for norm.layernorm"):
        shapes.shapes_for("norm.layernorm", "qwen3.5-35b-a3b:decode")
    assert shapes.phases_of("norm.layernorm") == ()
    with pytest.raises(ValueError, match=r"deltanet.causal_conv1d_update has no prefill shapes: the decoder runs it "
                                         r"at decode and decode-b8 only \(a prefill runs causal_conv1d\)"):
        shapes.shapes_for("deltanet.causal_conv1d_update", "qwen3.5-35b-a3b:prefill")
    with pytest.raises(ValueError, match="chunk_gated_delta_rule has no decode-b8 shapes: .* at prefill only"):
        shapes.shapes_for("deltanet.chunk_gated_delta_rule", "tiny-qwen3.5-moe:decode-b8")


@pytest.mark.parametrize("op_name", list(shapes.BUILDERS))
def test_shapes_refuse_the_phases_an_op_does_not_have_naming_those_it_has(op_name):
    has = shapes.phases_of(op_name)
    assert has and set(has) <= set(shapes.PHASES)
    for phase in shapes.PHASES:
        if phase in has:
            continue
        with pytest.raises(ValueError, match=f"{op_name} has no {phase} shapes") as err:
            shapes.shapes_for(op_name, f"qwen3.5-35b-a3b:{phase}")
        assert all(p in str(err.value) for p in has), str(err.value)


#: The tiny model's phase an op is run at on the CPU: decode where it has one, else prefill on a shorter prompt of
#: the same builder (at 2,048 tokens a prefill-only op takes 1 to 7 s through the interpreter; its 2,048-token inputs
#: are checked on the torch reference).
TINY = "tiny-qwen3.5-moe"
SHORT_PREFILL = 128


def _tiny_phase(op_name: str) -> str:
    return "decode" if "decode" in shapes.phases_of(op_name) else "prefill"


def _tiny_shapes(op_name: str) -> list:
    if _tiny_phase(op_name) == "prefill":
        return shapes.BUILDERS[op_name](shapes.MODELS[TINY], SHORT_PREFILL)
    return shapes.shapes_for(op_name, f"{TINY}:decode")


def _checked_inputs(shape, fn, run_op: bool):
    """``shape``'s inputs on the device, its bytes, the op (``run_op``: through the kernels) and the baseline each
    against the op's reference on the same inputs (a loose agreement: the baseline rounds differently)."""
    from lynn_kernels.lab.race import _first
    from lynn_kernels.metrics import compare

    args, kwargs, aux = shape.make()
    devices = [t.device for t in (*args, *kwargs.values(), *aux.values()) if hasattr(t, "device")]  # NVFP4 too
    assert devices and all(torch.device(dv).type == DEV.type for dv in devices), shape.label
    if shape.bytes is not None:
        assert shape.bytes(args, kwargs) > 0, shape.label
    want = _first(fn.reference(*args, **kwargs))
    got = {"op": fn(*args, **kwargs)} if run_op else {}
    if shape.baseline is not None:
        got[shape.baseline[0]] = shape.baseline[1](*args, **kwargs, **aux)
    for who, out in got.items():
        out = _first(out)
        assert out.shape == want.shape, (shape.label, who, out.shape, want.shape)
        cosine = compare(out, want).cosine
        assert cosine > 0.99, (shape.label, who, cosine)


@pytest.mark.parametrize("op_name", list(shapes.BUILDERS))
def test_shapes_for_builds_inputs_the_op_runs_on(op_name):
    """The tiny model's decode shapes run through the kernels and agree with the reference, as the baseline does;
    a prefill-only op's 2,048-token inputs agree on the reference and its baseline, and a shorter prompt of the same
    builder runs through the kernels."""
    phase = _tiny_phase(op_name)
    todo = shapes.shapes_for(op_name, f"{TINY}:{phase}")
    assert todo and len({s.label for s in todo}) == len(todo)
    fn = lab.find(op_name).fn
    for shape in todo[:2]:
        _checked_inputs(shape, fn, run_op=phase == "decode")
    if phase == "prefill":
        for shape in _tiny_shapes(op_name)[:2]:
            _checked_inputs(shape, fn, run_op=True)


@pytest.mark.parametrize("model", ["qwen3.5-35b-a3b", "qwen3-next-80b-a3b"])
@pytest.mark.parametrize("op_name", list(shapes.BUILDERS))
def test_shapes_of_the_published_models_build_without_inputs(op_name, model):
    """Every phase an op has, at the published sizes: Shapes with positive dims and, for the prefill, the flops where
    compute matters, built without making any input (that is make()'s, on the GPU)."""
    for phase in shapes.phases_of(op_name):
        todo = shapes.shapes_for(op_name, f"{model}:{phase}")
        assert todo and len({s.label for s in todo}) == len(todo), (op_name, phase)
        for s in todo:
            assert isinstance(s, shapes.Shape) and callable(s.make) and s.flops >= 0
            assert s.dims and all(isinstance(v, int) and v > 0 for v in s.dims.values()), (s.label, s.dims)
    if op_name in ("attention.flash_attention", "deltanet.chunk_gated_delta_rule", "matmul.nvfp4_gemm",
                   "moe.moe_experts", "moe.moe_block"):
        assert all(s.flops > 0 for s in shapes.shapes_for(op_name, f"{model}:prefill"))


# -- on a GPU: a bit-identical copy races as fast as the shipped kernel ---------------------------------------------

@pytest.mark.gpu
def test_race_a_copy_of_the_packed_gemv_matches_the_shipped_speed():
    v = lab.variant("matmul.nvfp4_linear", lab.edit("matmul.packed_gemv", {}), kernel="matmul.packed_gemv")
    report = lab.race(v, shapes="qwen3.5-35b-a3b:decode", rounds=4)
    assert report.passed and report.rows, report
    by_shape: dict[str, dict] = {}
    for r in report.rows:
        assert r.validation is not None, (r.shape, r.provider)
        by_shape.setdefault(r.shape, {})[r.provider] = r
    assert len(by_shape) == len(shapes.shapes_for("matmul.nvfp4_linear", "qwen3.5-35b-a3b:decode"))
    for shape, rows in by_shape.items():
        mine, ship = rows[v.label], rows["shipped"]
        assert mine.validation["passed"] and ship.validation["passed"], (shape, mine.validation, ship.validation)
        assert mine.validation["rel_l2"] == ship.validation["rel_l2"], shape        # the same bits
        assert abs(mine.median_ms / ship.median_ms - 1) <= 0.10, (shape, report.table())
        for r in rows.values():                          # a validated provider is timed, one that failed is not
            assert math.isfinite(r.median_ms) == bool(r.validation["passed"]), (shape, r.provider, r.validation)


def test_an_op_the_decoder_runs_only_in_prefill_races_on_prefill_shapes_by_default():
    assert shapes.default_shapes("attention.flash_attention") == "qwen3.5-35b-a3b:prefill"
    assert shapes.default_shapes("norm.rmsnorm") == "qwen3.5-35b-a3b:decode"
    assert shapes.default_shapes("deltanet.causal_conv1d_update", "tiny-qwen3.5-moe") == "tiny-qwen3.5-moe:decode"
