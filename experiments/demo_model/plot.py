"""Plot the demo model's training curves and its quantisation table (PNG files beside the data they show).

    python experiments/demo_model/plot.py
    # -> data/models/lynn-demo/training/loss_curve.png, docs/figures/demo_quantization.png
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "data" / "models" / "lynn-demo"


def _log(path: Path) -> tuple[list, list]:
    rows = [json.loads(ln) for ln in path.read_text().splitlines()]
    return [r for r in rows if r["kind"] == "train"], [r for r in rows if r["kind"] == "eval"]


def loss_curve(out: Path) -> None:
    fig, ax = plt.subplots(figsize=(6.4, 3.4), dpi=100)
    for name, style, label in (("run1_train_log.jsonl", ":", "run 1 (10 epochs)"),
                               ("train_log.jsonl", "-", "shipped run (6 epochs)")):
        train, ev = _log(MODEL / "training" / name)
        ax.plot([r["tokens"] / 1e6 for r in train], [r["loss"] for r in train], style, color="tab:blue", lw=1,
                label=f"train, {label}")
        ax.plot([r["tokens"] / 1e6 for r in ev], [r["heldout_loss"] for r in ev], style, color="tab:red", lw=1.5,
                label=f"held-out, {label}")
    rec = json.loads((MODEL / "training" / "train_record.json").read_text())
    ax.axvline(rec["train_tokens"] / 1e6, color="grey", lw=0.5)
    ax.text(rec["train_tokens"] / 1e6, 7.5, " 1 epoch", fontsize=8, color="grey")
    ax.set_ylim(2.3, 8.0)
    ax.set_xlabel("tokens seen (M)")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title(f"lynn-demo: {rec['parameters'] / 1e6:.1f}M parameters, {rec['gpu']}, "
                 f"{rec['train_seconds']:.0f} s", fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def quantization(out: Path) -> None:
    q = json.loads((MODEL / "quality.json").read_text())
    names = list(q["variants"])
    v = q["variants"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(8.0, 3.2), dpi=100)
    colors = ["tab:grey" if n == "bf16" else "tab:green" if "nvfp4" in n else "tab:orange" for n in names]
    a.barh(names, [v[n]["perplexity"] for n in names], color=colors)
    a.set_xlim(min(v[n]["perplexity"] for n in names) * 0.95, max(v[n]["perplexity"] for n in names) * 1.02)
    a.set_xlabel("held-out perplexity")
    a.invert_yaxis()
    b.barh(names, [v[n]["greedy_match"] for n in names], color=colors)
    gpu = MODEL / "quality.h200.json"
    if gpu.is_file():           # the floor set by rounding alone: bf16 on the CPU reference vs the H200's kernels
        g = json.loads(gpu.read_text())["greedy_tokens"]["bf16"]
        c = q["greedy_tokens"]["bf16"]
        same = sum(x == y for r, s in zip(c, g) for x, y in zip(r, s)) / sum(len(r) for r in c)
        b.axvline(same, color="black", ls="--", lw=1)
        b.text(same, len(names) - 0.6, " bf16: CPU ref\n vs H200 kernels", fontsize=7, va="bottom")
    b.set_xlim(0, 1)
    b.set_xlabel(f"greedy tokens equal to bf16 ({q['prompts']} prompts x {q['new_tokens']})")
    b.invert_yaxis()
    b.set_yticklabels([])
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


if __name__ == "__main__":
    loss_curve(MODEL / "training" / "loss_curve.png")
    if (MODEL / "quality.json").is_file():
        (ROOT / "docs" / "figures").mkdir(exist_ok=True)
        quantization(ROOT / "docs" / "figures" / "demo_quantization.png")
