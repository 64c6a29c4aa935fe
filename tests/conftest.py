"""Shared test set-up: the backend, the ``gpu`` marker, fixed seeds and poisoned allocations.

``import lynn_kernels`` comes first so that the runtime chooses the backend (and sets ``TRITON_INTERPRET=1`` on a
CPU) before anything else imports triton.
"""

from __future__ import annotations

import importlib
import math
from collections import Counter

import pytest
import torch

import lynn_kernels  # noqa: F401, I001  (must come first: it chooses the Triton backend)
from lynn_kernels import runtime


# -- interpreter speed ----------------------------------------------------------------------------------------------
# Triton's interpreter re-patches triton.language (inspect.getmembers over tl, tl.core, tl.math, tl.tensor) on every
# call of a @triton.jit helper from inside a kernel, not only at each launch: ~0.16 ms a call, hundreds of thousands
# of calls in a run of the suite. Inside a launch the modules are already patched, and a re-patch changes nothing
# (builtins already wrapped are skipped, the rest are set to equivalent functions), so a helper call whose modules
# the running launch has patched skips it. Launches (and any helper seeing another module) patch exactly as before.
def _skip_nested_lang_patches() -> None:
    if not runtime.INTERPRET:
        return
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter

    if not (hasattr(interpreter, "_patch_lang") and hasattr(interpreter, "GridExecutor")):
        return                         # another Triton's interpreter: run it as it is
    real_patch, real_launch = interpreter._patch_lang, interpreter.GridExecutor.__call__
    launches: list[list] = []          # per launch now running: [its modules, whether its own patch has been made]

    def langs(fn) -> set:
        return {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}

    class _Nothing:
        def restore(self):
            pass

    def patch_lang(fn):
        if launches and launches[-1][1] and langs(fn) <= launches[-1][0]:
            return _Nothing()          # a helper call: its modules are patched until the launch restores them
        if launches:
            launches[-1][1] = True     # the launch's own patch (its first), which it restores at its end
        return real_patch(fn)

    def launch(self, *args, **kwargs):
        launches.append([langs(self.fn), False])
        try:
            return real_launch(self, *args, **kwargs)
        finally:
            launches.pop()

    interpreter._patch_lang = patch_lang
    interpreter.GridExecutor.__call__ = launch


_skip_nested_lang_patches()

# -- oracles -------------------------------------------------------------------------------------------------------
# The independent implementations the tests compare with (HF transformers, compressed-tensors, ModelOpt) are test
# extras. A missing one fails its tests: they never skip, so a green run always means the oracles ran. A test names
# its oracles with ``@pytest.mark.oracle("transformers")``, by using a fixture listed in its module's
# ``ORACLE_FIXTURES`` (fixture name -> package) or in :data:`ORACLE_FIXTURES` here; the summary counts them.

#: conftest fixtures that load an oracle.
ORACLE_FIXTURES = {"hf_moe_blocks": "transformers"}
_oracle_tests: dict[str, set] = {}
_oracle_outcome: dict[str, str] = {}


def oracle(module: str):
    """Import an oracle module; if it is missing, fail the test (or the fixture) that needs it, never skip."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        pytest.fail(f"oracle {module!r} cannot be imported ({err}); install the test extras: "
                    f"python -m pip install torch==2.13.0 -e \".[test]\" (oracle tests never skip)", pytrace=False)


def pytest_configure(config):
    config.addinivalue_line("markers", "oracle(package, ...): the test compares against an oracle package")


def _oracles_of(item) -> set:
    found = {p for m in item.iter_markers("oracle") for p in m.args}
    fixtures = {**ORACLE_FIXTURES, **getattr(getattr(item, "module", None), "ORACLE_FIXTURES", {})}
    found |= {fixtures[f] for f in getattr(item, "fixturenames", ()) if f in fixtures}
    return found


def pytest_collection_modifyitems(config, items):
    """Skip ``@pytest.mark.gpu`` tests when no CUDA GPU is visible (compiled Triton only runs there); note which
    tests use an oracle."""
    for item in items:
        pkgs = _oracles_of(item)
        if pkgs:
            _oracle_tests[item.nodeid] = pkgs
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (compiled Triton); this machine runs the interpreter")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    if report.nodeid not in _oracle_tests:
        return
    if (report.when == "call") or (report.when == "setup" and not report.passed):
        _oracle_outcome[report.nodeid] = report.outcome


def pytest_terminal_summary(terminalreporter):
    if not _oracle_outcome:
        return
    ran = Counter(_oracle_outcome.values())
    per = Counter(p for n, o in _oracle_outcome.items() if o == "passed" for p in _oracle_tests[n])
    terminalreporter.write_line(
        f"oracle tests: {ran['passed']} passed, {ran['failed']} failed, {ran['skipped']} skipped "
        f"({', '.join(f'{p} {k}' for p, k in sorted(per.items())) or 'none passed'})")


@pytest.fixture
def device() -> torch.device:
    """The device kernel inputs must live on: the CPU under the interpreter, the GPU when compiled."""
    return runtime.DEVICE


@pytest.fixture
def make_weight(device):
    """``make_weight(shape, dtype, seed=0, scale=1.0)``: Gaussian weights on ``device``, drawn on the CPU from a
    ``torch.Generator`` with a fixed seed (so the same on every backend)."""

    def make(shape, dtype=torch.float32, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return (torch.randn(tuple(shape), generator=g) * scale).to(dtype).to(device)

    return make


def _poison(t: torch.Tensor) -> torch.Tensor:
    """Fill a fresh allocation with garbage: NaN for floats of 2+ bytes, 0xFF bytes otherwise (NaN in E4M3FN)."""
    if t.device.type == "meta" or t.numel() == 0:
        return t
    if t.dtype == torch.bool:
        t.fill_(True)
    elif (t.dtype.is_floating_point or t.dtype.is_complex) and t.element_size() >= 2:
        t.fill_(math.nan)
    else:   # uint8 codes, float8 scales, integers: every byte 0xFF (same-size views keep any layout)
        signed = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
        t.view(signed).fill_(0xFF if signed == torch.uint8 else -1)
    return t


@pytest.fixture
def poison_empty(monkeypatch):
    """Make ``torch.empty`` / ``torch.empty_like`` return garbage-filled tensors, so an output a kernel forgets to
    write shows up as NaN (floats) or 0xFF bytes (uint8 codes, float8 scales) instead of lucky zeros."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def empty(*args, **kwargs):
        return _poison(real_empty(*args, **kwargs))

    def empty_like(*args, **kwargs):
        return _poison(real_empty_like(*args, **kwargs))

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch, "empty_like", empty_like)
    return _poison


@pytest.fixture(scope="session")
def hf_moe_blocks() -> dict:
    """HF's sparse MoE blocks on one tiny config (transformers is a test extra: missing, the tests fail):
    ``{name: (block class, config, renormalize)}`` for Qwen3-Next with and without ``norm_topk_prob`` and
    Qwen3.5-MoE."""
    qn = oracle("transformers.models.qwen3_next.modeling_qwen3_next")
    q35 = oracle("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig

    dims = dict(hidden_size=64, num_experts=12, num_experts_per_tok=3, moe_intermediate_size=32,
                shared_expert_intermediate_size=48, num_hidden_layers=1)
    return {
        "qwen3_next-renorm": (qn.Qwen3NextSparseMoeBlock, Qwen3NextConfig(**dims, norm_topk_prob=True), True),
        "qwen3_next-raw": (qn.Qwen3NextSparseMoeBlock, Qwen3NextConfig(**dims, norm_topk_prob=False), False),
        "qwen3_5_moe": (q35.Qwen3_5MoeSparseMoeBlock, Qwen3_5MoeTextConfig(**dims), True),
    }


# -- the check matrix as tests --------------------------------------------------------------------------------------
# A family's awkward shapes and dtypes live in one place, its ``lynn_kernels/<family>/check.py: cases()``, which
# ``lynn check`` and ``lynn_kernels.lab.check`` run too; a test module sweeps them with these two helpers.

def check_cases(family: str, *ops: str) -> list:
    """The family's check cases (of ``ops``, or all), one ``pytest.param`` each, named ``op: case``."""
    module = importlib.import_module(f"lynn_kernels.{family}.check")
    return [pytest.param(c, id=f"{c.op}: {c.label}") for c in module.cases() if not ops or c.op in ops]


def assert_case_passes(case) -> list[dict]:
    """Run one check case; every row it returns passed (a failure shows the failing rows with their metrics)."""
    rows = case.run()
    failed = [r for r in rows if not r.get("passed")]
    assert rows and not failed, f"{case.op}: {case.label}: " + "; ".join(
        f"{r['op']} {r['case']}: " + ", ".join(f"{k}={v}" for k, v in r.items() if k not in ("op", "case"))
        for r in failed)
    return rows
