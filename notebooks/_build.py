"""Rebuild the teaching notebooks: sync each ``NN-name.ipynb`` with its jupytext script ``py/NN-name.py``, execute it,
store outputs.

    python notebooks/_build.py              # sync, execute and store every notebook
    python notebooks/_build.py 03           # only those whose name starts with 03
    python notebooks/_build.py --no-exec    # sync the pair and normalise, keep the stored outputs

Each notebook is paired with a percent-format script in ``notebooks/py/`` (``py/NN-name.py``, ``# %%`` cells,
pairing recorded in the notebook's ``jupytext`` metadata and in ``jupytext.toml``; in their own folder the scripts
keep out of JupyterLab's file browser, where each notebook shows once), so either one can be edited: in
JupyterLab (jupytext is a dependency of the package) saving the notebook writes both, and
``tests/test_notebooks.py`` fails while the two differ. The build takes the cells from whichever of the pair was
modified last (as ``jupytext --sync`` does) and writes both; an ``.ipynb`` without a script gets one, and a script
without an ``.ipynb`` becomes a notebook. It executes on this
machine's backend (Triton's interpreter on a CPU), in ``notebooks/``, top to bottom, and stores the notebook with
its volatile parts normalised so that a rebuild diffs small: no widget state, no timing or kernel-version metadata,
PNG figures re-encoded as 256-colour palette PNGs (the same size in pixels, about a third of the bytes).

A code cell whose output depends on the machine (timings, versions, devices, plots, widgets, committed benchmark
data) starts with ``# NBVAL_IGNORE_OUTPUT``; every other output is checked by ``pytest notebooks`` (nbval), so it
must be deterministic and rounded.
"""

from __future__ import annotations

import base64
import io
import sys
from pathlib import Path

import jupytext
import nbformat
from jupytext.combine import combine_inputs_with_outputs

HERE = Path(__file__).resolve().parent
SCRIPTS = HERE / "py"                              # the paired scripts: py/NN-name.py
FORMAT = "py:percent"
#: The notebook metadata kept; ``jupytext`` pairs the notebook with its script (without the jupytext version in the
#: script's header, which would change with whoever saved it last).
JUPYTEXT = {"formats": "ipynb,py//py:percent",
            "notebook_metadata_filter": "-jupytext.text_representation.jupytext_version"}
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
LANGUAGE_INFO = {"name": "python", "pygments_lexer": "ipython3"}


def cells(nb) -> list[tuple[str, str]]:
    """What the pair must agree on: each cell's type and source."""
    return [(c.cell_type, c.source) for c in nb.cells]


def script_of(ipynb: Path) -> Path:
    """The notebook's paired script: ``notebooks/NN-name.ipynb`` -> ``notebooks/py/NN-name.py``."""
    return SCRIPTS / ipynb.with_suffix(".py").name


def sync(ipynb: Path) -> nbformat.NotebookNode:
    """The notebook with the cells of the newer of the pair and the stored outputs of the ``.ipynb``."""
    script = script_of(ipynb)
    if not ipynb.exists():                         # a new notebook, written as a script
        return jupytext.read(script, fmt=FORMAT)
    nb = nbformat.read(ipynb, as_version=4)
    if script.exists():
        text = jupytext.read(script, fmt=FORMAT)
        if cells(text) != cells(nb) and script.stat().st_mtime >= ipynb.stat().st_mtime:
            print(f"  cells from {script.name} (newer than {ipynb.name})")
            nb = combine_inputs_with_outputs(text, nb, FORMAT)
        elif cells(text) != cells(nb):
            print(f"  cells from {ipynb.name} (newer than {script.name})")
    return nb


def execute(nb: nbformat.NotebookNode) -> None:
    from nbclient import NotebookClient

    for cell in nb.cells:                          # a fresh run: no stale output survives a failing cell
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    NotebookClient(nb, timeout=600, kernel_name="python3", record_timing=False,
                   resources={"metadata": {"path": str(HERE)}}).execute()


def small_png(data: str) -> str:
    """A PNG as a 256-colour palette PNG of the same size (matplotlib's plots have few colours beyond their
    anti-aliasing); one already with a palette is left as it is, so normalising twice changes nothing."""
    from PIL import Image

    im = Image.open(io.BytesIO(base64.b64decode(data)))
    if im.mode == "P":
        return data
    if im.mode == "RGBA" and im.getextrema()[3][0] < 255:        # transparency: keep it
        return data
    out = io.BytesIO()
    im.convert("RGB").quantize(256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(
        out, "PNG", optimize=True)
    return base64.b64encode(out.getvalue()).decode()


def normalise(nb: nbformat.NotebookNode) -> None:
    nb.metadata = nbformat.from_dict({"jupytext": JUPYTEXT, "kernelspec": KERNELSPEC, "language_info": LANGUAGE_INFO})
    for cell in nb.cells:
        cell.metadata.pop("execution", None)                 # timings (JupyterLab's recordTiming)
        for out in cell.get("outputs", []):
            if "image/png" in out.get("data", {}):
                out.data["image/png"] = small_png(out.data["image/png"])


def build(ipynb: Path, execute_it: bool = True) -> None:
    nb = sync(ipynb)
    if execute_it:
        execute(nb)
    normalise(nb)
    nbformat.validate(nb)
    nbformat.write(nb, ipynb)
    jupytext.write(nb, script_of(ipynb), fmt=FORMAT)


def main(argv: list[str]) -> int:
    execute_it = "--no-exec" not in argv
    prefixes = [a for a in argv if not a.startswith("--")]
    pairs = sorted({HERE / f"{p.stem}.ipynb" for p in [*HERE.glob("[0-9]*.ipynb"), *SCRIPTS.glob("[0-9]*.py")]})
    for ipynb in pairs:
        if not prefixes or any(ipynb.name.startswith(p) for p in prefixes):
            print("building" if execute_it else "syncing", ipynb.relative_to(HERE.parent))
            build(ipynb, execute_it)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
