"""The README's set-up commands are the ones CI runs, and the package metadata does not pull a CUDA torch by itself."""

import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Set up", 1)[1].split("\n## ", 1)[0]
    return [line.strip() for line in section.splitlines() if line.startswith("    ") and line.strip()]


def test_readme_has_exactly_two_setup_commands():
    cmds = readme_commands()
    assert len(cmds) == 2, cmds
    assert cmds[0].endswith("&& lynn check && lynn generate")   # ends by writing text from the demo model
    assert cmds[1].endswith("&& pytest") and '".[test]"' in cmds[1]


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert readme_commands()[1] in [line.strip() for line in ci]


def test_dependencies_never_pin_a_cuda_torch():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = meta["dependencies"] + [d for extra in meta["optional-dependencies"].values() for d in extra]
    torch_reqs = [d for d in deps if re.match(r"torch\b", d)]
    assert torch_reqs and all(">=" in d and "==" not in d for d in torch_reqs), torch_reqs
    assert any(d.startswith("triton") and "<" in d for d in deps)


def test_performance_tables_are_the_committed_results():
    """Each generated block of docs/performance.md is what ``python -m lynn_kernels.bench.report`` renders from
    data/bench/ now, and every op with a renderer has one: the doc cannot drift from the data."""
    from lynn_kernels.bench import report

    blocks = report.blocks((ROOT / "docs" / "performance.md").read_text())
    fix = "python -m lynn_kernels.bench.report --update docs/performance.md"
    for ops, body in blocks:
        assert body == report.render_block(ops), f"docs/performance.md is out of date for {ops}: {fix}"
    named = [op for ops, _ in blocks for op in ops.split()]
    assert sorted(named) == sorted(report.ALL_OPS), f"generated blocks name {named}, the report has {report.ALL_OPS}"


def test_the_code_passes_the_linter():
    """ruff, as pyproject.toml configures it (120 columns; pyflakes, pycodestyle, import order), over the whole
    tree: CI runs it through this test."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)], capture_output=True,
                          text=True, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_missing_oracle_fails_instead_of_skipping():
    """tests/conftest.py's ``oracle`` import: a missing oracle package is a failure, never a skip."""
    import pytest
    from conftest import oracle

    with pytest.raises(pytest.fail.Exception, match="never skip"):
        oracle("lynn_no_such_oracle_package")
    assert oracle("json").dumps([1]) == "[1]"
