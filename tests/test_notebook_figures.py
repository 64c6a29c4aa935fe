"""The notebooks' figures read at notebook width: the stored PNGs' sizes, and the H200 plots redrawn from their cells.

The plotting cells of notebooks 01-04 draw committed H200 results (``data/bench/h200/``), so they run here in a few
seconds: each test executes a notebook's first code cell (its imports), the cells its plot needs (found by a line
they contain) and the plotting cell, under matplotlib's Agg backend, and looks at the figure that ``plt.show()`` got.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path

import jupytext
import matplotlib
import nbformat
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # (after the backend choice)
from matplotlib.text import Annotation

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def stored_pngs():
    """(notebook, code cell index, first line of the cell, (width, height)) of every PNG the notebooks store."""
    from PIL import Image

    out = []
    for path in sorted(NOTEBOOKS.glob("[0-9]*.ipynb")):
        for i, cell in enumerate(nbformat.read(path, as_version=4).cells):
            for o in cell.get("outputs", []):
                png = o.get("data", {}).get("image/png")
                if png:
                    size = Image.open(io.BytesIO(base64.b64decode(png))).size
                    out.append((path.stem, i, cell.source, size))
    return out


def test_stored_figures_fit_a_notebook():
    """No figure is a strip of panels in one row: at most 2,200 px wide and 6 times as wide as tall."""
    pngs = stored_pngs()
    assert pngs
    wide = [(n, i, size) for n, i, _, size in pngs if size[0] > 2200 or size[0] > 6 * size[1]]
    assert not wide, wide


def test_moe_kernel_time_figure_is_a_grid():
    """Notebook 03's kernel time per batch size: panels in rows of two, about 1,000-1,400 px wide (it was six panels
    in one row, 3,890 x 350 px)."""
    (size,) = [s for n, _, src, s in stored_pngs() if n.startswith("03") and "def by_provider(doc):" in src]
    assert 1000 <= size[0] <= 1400 and size[1] >= 0.5 * size[0], size


def draw(notebook: str, *markers: str, monkeypatch) -> plt.Figure:
    """Run the notebook's first code cell, then the code cells containing each marker (in notebook order), and
    return the figure the last ``plt.show()`` drew."""
    nb = jupytext.read(next((NOTEBOOKS / "py").glob(f"{notebook}-*.py")), fmt="py:percent")
    code = [c.source for c in nb.cells if c.cell_type == "code"]
    chosen = [code[0]] + [src for src in code[1:] if any(m in src for m in markers)]
    assert len(chosen) == len(markers) + 1, f"{notebook}: the markers pick {len(chosen) - 1} cells"
    shown = []
    monkeypatch.setattr(plt, "show", lambda *a, **k: shown.append(plt.gcf()))
    monkeypatch.chdir(NOTEBOOKS)
    namespace = {"__name__": "__main__", "display": lambda *a, **k: None}
    for src in chosen:
        source = "\n".join(line for line in src.splitlines() if not line.startswith("%"))    # no IPython magics
        exec(compile(source, notebook, "exec"), namespace)  # noqa: S102  (the notebook's own cells)
    assert shown, f"{notebook}: no figure shown"
    shown[-1].canvas.draw()
    return shown[-1]


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def overlaps(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def test_nvfp4_bandwidth_bars_do_not_hide_their_labels(monkeypatch):
    """Notebook 01: each bar's value sits within its own bar's width, and no two labels overlap (value labels of
    neighbours of a similar height, the ceiling's and the goal's)."""
    fig = draw("01", "docs = {op: load(op", "plots.plot_bandwidth(doc, ax=ax)", monkeypatch=monkeypatch)
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        values = [t for t in ax.texts if isinstance(t, Annotation)]
        bars = [b for c in ax.containers for b in c if b.get_height()]
        assert len(values) == len(bars) > 0
        for t, bar in zip(values, bars):
            box, width = t.get_window_extent(renderer), bar.get_window_extent(renderer)
            assert width.x0 - 0.5 <= box.x0 and box.x1 <= width.x1 + 0.5, t.get_text()
        boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in ax.texts]
        clash = [(a, b) for i, (a, ba) in enumerate(boxes) for b, bb in boxes[i + 1:] if overlaps(ba, bb)]
        assert not clash, clash


def test_matmul_time_legend_is_readable(monkeypatch):
    """Notebook 02: one legend entry per shape (colour) and per provider (line style), not 12 entries at 6 pt."""
    fig = draw("02", 'doc = load("matmul.linear"', "CELLS = cells(doc)", 'ax1.set_xlabel("M (tokens)")',
               monkeypatch=monkeypatch)
    legend = fig.axes[0].get_legend()
    texts = [t.get_text() for t in legend.get_texts()]
    assert len(texts) <= 8 and {"ours", "cuBLAS bf16"} <= set(texts), texts
    assert min(t.get_fontsize() for t in legend.get_texts()) >= 8


def test_attention_decode_plot_says_why_it_passes_the_read_ceiling(monkeypatch):
    """Notebook 04: the decode panel's rates above the dotted read ceiling come with a note on the plot, inside the
    axes, that the ceiling is torch's sum over a 1 GiB tensor and not the hardware peak (docs/performance.md)."""
    fig = draw("04", "from lynn_kernels.bench.report import timed_pairs", 'docs[op] = load(op, gpu="h200")',
               "def plot_kernel_lines(", monkeypatch=monkeypatch)
    decode = next(ax for ax in fig.axes if ax.get_title().startswith("attention.decode"))
    top = max(y for line in decode.get_lines() for y in line.get_ydata() if line.get_linestyle() != ":")
    ceiling = next(line for line in decode.get_lines() if line.get_linestyle() == ":").get_ydata()[0]
    assert top > ceiling                                         # the committed run does pass it
    notes = [t for t in decode.texts if "not the hardware peak" in t.get_text()]
    assert len(notes) == 1 and "1 GiB bf16 tensor" in notes[0].get_text() and "copy ceiling" in notes[0].get_text()
    renderer = fig.canvas.get_renderer()
    box, frame = notes[0].get_window_extent(renderer), decode.get_window_extent(renderer)
    assert frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1
    label = next(t for t in decode.texts if "read ceiling" in t.get_text() and t is not notes[0])
    assert not overlaps(box, label.get_window_extent(renderer))
