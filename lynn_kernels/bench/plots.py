"""Plots that notebooks call on benchmark documents (the dicts :func:`~.harness.load` returns)."""

from __future__ import annotations

from typing import Sequence


def _plt():
    import matplotlib.pyplot as plt

    return plt


def plot_bandwidth(doc: dict, ceiling: str = "copy_gbps", providers: Sequence[str] | None = None, ax=None,
                   title: str | None = None):
    """Grouped bars of GB/s per shape and provider, with the measured ceiling as a dashed line."""
    plt = _plt()
    rows = doc["results"]
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    provs = list(providers or dict.fromkeys(r["provider"] for r in rows))
    if ax is None:
        _, ax = plt.subplots(figsize=(max(6, 1.8 * len(shapes) + 2), 3.6))
    width = 0.8 / max(1, len(provs))
    for i, p in enumerate(provs):
        ys = [next((r["gbps"] for r in rows if r["shape"] == s and r["provider"] == p), 0) or 0 for s in shapes]
        xs = [j + (i - (len(provs) - 1) / 2) * width for j in range(len(shapes))]
        bars = ax.bar(xs, ys, width, label=p)
        for b, y in zip(bars, ys):
            if y:
                ax.annotate(f"{y:,.0f}", (b.get_x() + b.get_width() / 2, y), ha="center", va="bottom", fontsize=7)
    ceil = doc["ceilings"][ceiling]
    ax.axhline(ceil, ls="--", c="k", lw=1)
    ax.text(len(shapes) - 0.5, ceil, f" {ceiling.replace('_gbps', '')} ceiling {ceil:,.0f} GB/s", va="bottom",
            ha="right", fontsize=8)
    ax.set_xticks(range(len(shapes)), shapes, fontsize=8)
    ax.set_ylabel("GB/s")
    ax.set_ylim(0, ceil * 1.15)
    ax.set_title(title or f"{doc['op']} on {doc['provenance']['gpu']}", fontsize=10)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=min(3, len(provs)), frameon=False)
    return ax


def plot_roofline(doc: dict, ax=None, title: str | None = None):
    """Achieved TFLOP/s against arithmetic intensity (flops / byte), under the measured bandwidth and matmul roofs."""
    plt = _plt()
    c = doc["ceilings"]
    bw, peak = c["read_gbps"] * 1e9, c["bf16_tflops"] * 1e12
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 4))
    xs = [10 ** (k / 10) for k in range(-10, 41)]
    ax.loglog(xs, [min(peak, bw * x) / 1e12 for x in xs], "k-", lw=1, label="roofline (measured)")
    for p in dict.fromkeys(r["provider"] for r in doc["results"]):
        pts = [(r["flops"] / r["bytes"], r["tflops"]) for r in doc["results"]
               if r["provider"] == p and r.get("flops") and r.get("bytes") and r.get("tflops")]
        if pts:
            ax.loglog(*zip(*pts), "o", label=p)
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("TFLOP/s")
    ax.set_title(title or f"{doc['op']} on {doc['provenance']['gpu']}", fontsize=10)
    ax.legend(fontsize=7)
    return ax
