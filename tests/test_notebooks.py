"""The notebooks and their jupytext scripts: paired, equal cell by cell, committed with the outputs nbval checks.

Each ``notebooks/NN-name.ipynb`` has a percent-format script ``notebooks/py/NN-name.py`` (in a folder of their own,
out of the way of JupyterLab's file browser, where each notebook shows once). Editing either one
(JupyterLab with jupytext saves both) and then ``python notebooks/_build.py NN`` (sync, execute, store outputs; add
``--no-exec`` to sync only) keeps them equal. Nothing is executed here: ``pytest notebooks`` (nbval) does that.
"""

from __future__ import annotations

from pathlib import Path

import jupytext
import nbformat
import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
SCRIPTS = NOTEBOOKS / "py"
NAMES = sorted({p.stem for p in [*NOTEBOOKS.glob("[0-9]*.ipynb"), *SCRIPTS.glob("[0-9]*.py")]})
IPYNB = [n for n in NAMES if (NOTEBOOKS / f"{n}.ipynb").exists()]
PAIRS = [n for n in IPYNB if (SCRIPTS / f"{n}.py").exists()]
REBUILD = "python notebooks/_build.py {prefix} --no-exec syncs the pair (without --no-exec it also executes)"


def cells(nb) -> list[tuple[str, str]]:
    return [(c.cell_type, c.source) for c in nb.cells]


def first_difference(a: tuple[str, str], b: tuple[str, str]) -> str:
    if a[0] != b[0]:
        return f"a {a[0]} cell in the .ipynb, a {b[0]} cell in the .py"
    la, lb = a[1].splitlines(), b[1].splitlines()
    i = next((i for i, (x, y) in enumerate(zip(la, lb)) if x != y), min(len(la), len(lb)))
    return (f"line {i + 1} of the {a[0]} cell: {la[i] if i < len(la) else '(end)'!r} in the .ipynb, "
            f"{lb[i] if i < len(lb) else '(end)'!r} in the .py")


def test_there_are_notebooks():
    assert len(NAMES) >= 7, NAMES


@pytest.mark.parametrize("name", NAMES)
def test_notebook_and_script_come_in_pairs(name):
    pair = (NOTEBOOKS / f"{name}.ipynb", SCRIPTS / f"{name}.py")
    missing = [str(p.relative_to(NOTEBOOKS)) for p in pair if not p.exists()]
    assert not missing, f"notebooks/{missing[0]} is missing; {REBUILD.format(prefix=name[:2])}"


@pytest.mark.parametrize("name", PAIRS)
def test_notebook_and_script_have_the_same_cells(name):
    nb = cells(nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4))
    text = cells(jupytext.read(SCRIPTS / f"{name}.py", fmt="py:percent"))
    differ = [i for i, (a, b) in enumerate(zip(nb, text)) if a != b]
    where = (f"cell {differ[0]} differs, {first_difference(nb[differ[0]], text[differ[0]])}" if differ
             else f"{len(nb)} cells in the .ipynb, {len(text)} in the .py")
    assert nb == text, f"{name}: {where}; {REBUILD.format(prefix=name[:2])}"


@pytest.mark.parametrize("name", IPYNB)
def test_notebook_records_its_pairing(name):
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    assert nb.metadata.get("jupytext", {}).get("formats") == "ipynb,py//py:percent"


def test_scripts_stay_out_of_the_notebook_folder():
    """Only the notebooks (and the build script) in notebooks/: a script beside its notebook would show the
    notebook twice in JupyterLab's file browser; jupytext.toml pairs new notebooks the same way."""
    assert not list(NOTEBOOKS.glob("[0-9]*.py")), "the pairs live in notebooks/py/"
    assert 'formats = "ipynb,py//py:percent"' in (NOTEBOOKS / "jupytext.toml").read_text()


@pytest.mark.parametrize("name", IPYNB)
def test_notebook_is_committed_executed(name):
    """The stored outputs are one clean run from top to bottom (what nbval compares a fresh run with): every code
    cell executed in order, none failed, and the checked cells have their outputs."""
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), (
        f"{name}: execution counts are not 1..{len(code)}; rebuild it: python notebooks/_build.py {name[:2]}")
    errors = [i for i, c in enumerate(code) if any(o.output_type == "error" for o in c.outputs)]
    assert not errors, f"{name}: code cells {errors} stored an error"
    checked = [c for c in code if not c.source.startswith(("# NBVAL_IGNORE_OUTPUT", "# NBVAL_SKIP"))]
    assert any(c.outputs for c in checked), f"{name}: no checked cell has an output"


@pytest.mark.parametrize("name", IPYNB)
def test_notebook_has_no_volatile_metadata(name):
    """Widget state and timings change on every run; ``_build.py`` drops them so a rebuild diffs small."""
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    fix = f"python notebooks/_build.py {name[:2]} --no-exec drops it"
    assert "widgets" not in nb.metadata, f"{name}: widget state stored; {fix}"
    timed = [i for i, c in enumerate(nb.cells) if "execution" in c.metadata]
    assert not timed, f"{name}: cells {timed} store execution timings; {fix}"
