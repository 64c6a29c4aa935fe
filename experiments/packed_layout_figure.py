"""The packed NVFP4 layout, drawn: one 128-column chunk of one weight row, which word (``w = 4q + i``), which thread
``q`` of the tensor cores' A operand and which element ``j`` of its word holds each K column, and which scale block
(and scale byte) it takes; below, the chunk's 16 words and 8 scale bytes in memory order. The mapping is
:func:`lynn_kernels.matmul.packed.word_k`'s (docs/matmul.md, "The kernel layout"). No GPU; writes
docs/figures/packed_layout.png (1,300 x 780 px).

    PYTHONPATH=. python3 experiments/packed_layout_figure.py
"""

from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # (after the backend choice)
from matplotlib.colors import to_rgb
from matplotlib.patches import Patch, Rectangle

from lynn_kernels.matmul import packed

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "figures", "packed_layout.png")
THREAD = ("tab:blue", "tab:orange", "tab:green", "tab:red")      # a colour per thread q of a row's four


def shade(colour, i):
    """The colour of thread ``q``'s word ``4q + i``: lighter as ``i`` grows, so the four words of a thread differ."""
    r, g, b = to_rgb(colour)
    t = (0.0, 0.28, 0.5, 0.66)[i]
    return r + (1 - r) * t, g + (1 - g) * t, b + (1 - b) * t


def draw(path: str = OUT) -> tuple[int, int]:
    wk = packed.word_k(16)                                      # [16 words, 8 elements] -> K column of chunk 0
    holder = {int(wk[w, j]): (w, j) for w in range(16) for j in range(8)}
    assert sorted(holder) == list(range(packed.CHUNK))          # every column held once

    fig = plt.figure(figsize=(13, 7.8), dpi=100)
    grid = fig.add_axes((0.115, 0.33, 0.75, 0.53))
    mem = fig.add_axes((0.115, 0.04, 0.75, 0.19))

    # the chunk: row s = MMA step s = scale block s (K 16 s .. 16 s + 15), column c = K mod 16
    for k, (w, j) in holder.items():
        s, c = divmod(k, 16)
        q, i = divmod(w, 4)
        grid.add_patch(Rectangle((c, s), 1, 1, facecolor=shade(THREAD[q], i), edgecolor="white", lw=1.5))
        grid.text(c + 0.5, s + 0.36, f"w{w}", ha="center", va="center", fontsize=10, weight="bold")
        grid.text(c + 0.5, s + 0.72, f"j{j}", ha="center", va="center", fontsize=8, color="0.15")
    for s in (2, 4, 6):                                         # word boundaries: word 4q + i spans steps 2i, 2i + 1
        grid.plot([0, 16], [s, s], c="k", lw=1.6)
    grid.plot([8, 8], [0, 8], c="k", lw=0.8, ls="--")           # the second 8 columns of each step
    grid.set_xlim(0, 16)
    grid.set_ylim(8, 0)
    grid.set_xticks([c + 0.5 for c in range(16)], [str(c) for c in range(16)], fontsize=9)
    grid.xaxis.tick_top()
    grid.set_xlabel("column within the 16-column MMA step (K mod 16)", fontsize=10)
    grid.xaxis.set_label_position("top")
    grid.set_yticks([s + 0.5 for s in range(8)],
                    [f"block {s}: K {16 * s}-{16 * s + 15}" for s in range(8)], fontsize=9)
    grid.tick_params(length=0)
    for side in grid.spines.values():
        side.set_visible(False)
    for i in range(4):
        grid.text(16.25, 2 * i + 1, f"i = {i}: words\n{i}, {4 + i}, {8 + i}, {12 + i};\nelements 0-3\nabove, 4-7 below",
                  ha="left", va="center", fontsize=8.5)
    grid.set_title("one 128-column chunk of a weight row: the word w = 4q + i and element j that hold each K "
                   "column\n(colour: thread q of the row's four in mma.m16n8k16's A operand, holding columns "
                   "2q, 2q+1, 2q+8, 2q+9 of every 16; lighter: larger i)", fontsize=10.5, pad=30)

    # memory order: the 16 words (a thread's four are one 16-byte load) and the 8 scale bytes (block s; word
    # 4q + i reads the 16-bit pair at byte 2i)
    for w in range(16):
        q, i = divmod(w, 4)
        mem.add_patch(Rectangle((w, 1.2), 1, 1, facecolor=shade(THREAD[q], i), edgecolor="white", lw=1.5))
        mem.text(w + 0.5, 1.7, f"w{w}", ha="center", va="center", fontsize=10, weight="bold")
    for q in range(4):
        mem.annotate("", xy=(4 * q + 0.05, 2.45), xytext=(4 * q + 3.95, 2.45),
                     arrowprops={"arrowstyle": "|-|", "lw": 1, "shrinkA": 0, "shrinkB": 0})
        mem.text(4 * q + 2, 2.75, f"thread {q}: one 16-byte load", ha="center", va="bottom", fontsize=9)
    for b in range(8):
        mem.add_patch(Rectangle((2 * b, 0), 2, 0.8, facecolor="0.88", edgecolor="white", lw=1.5))
        mem.text(2 * b + 1, 0.4, f"byte {b}: block {b}", ha="center", va="center", fontsize=8.5)
    mem.text(-0.2, 1.7, "words", ha="right", va="center", fontsize=10)
    mem.text(-0.2, 0.4, "scales", ha="right", va="center", fontsize=10)
    mem.text(8, -0.45, "memory order; word 4q + i takes the 16-bit scale pair at bytes 2i, 2i + 1 (blocks 2i, 2i + 1)",
             ha="center", va="center", fontsize=9, color="0.25")
    mem.set_xlim(0, 16)
    mem.set_ylim(-0.7, 3.3)
    mem.axis("off")
    fig.legend(handles=[Patch(facecolor=c, label=f"thread q = {q}") for q, c in enumerate(THREAD)],
               loc="lower right", bbox_to_anchor=(0.995, 0.05), fontsize=9, frameon=False)

    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=100)
    size = tuple(int(v) for v in fig.get_size_inches() * fig.dpi)
    plt.close(fig)
    return size


if __name__ == "__main__":
    w, h = draw()
    print(f"wrote {os.path.relpath(OUT)} ({w} x {h} px)")
