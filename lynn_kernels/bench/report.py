"""Markdown tables for docs/performance.md from committed results: ``python -m lynn_kernels.bench.report OP...``."""

from __future__ import annotations

import sys

from .harness import load


def markdown(op: str, gpu: str = "h200") -> str:
    doc = load(op, gpu)
    p, c = doc["provenance"], doc["ceilings"]
    lines = [
        f"`{op}` on {p['gpu']}, {p['date']}, git {p['git_sha']}, torch {p['torch']}, triton {p['triton']}, "
        f"CUDA {p.get('cuda')}; command `{p['command']}`. Ceilings measured in the same process: copy "
        f"{c['copy_gbps']:,.0f} GB/s, read {c['read_gbps']:,.0f} GB/s, bf16 matmul {c['bf16_tflops']:,.0f} TFLOP/s.",
        "",
        "| shape | provider | median ms (p20-p80) | GB/s | of copy ceiling | validated |",
        "|---|---|---|---|---|---|",
    ]
    for r in doc["results"]:
        v = r.get("validation")
        mism = None if not v else v.get("mismatches", v.get("code_or_scale_mismatches"))
        ok = "-" if not v else ("FAILED" if not v.get("passed") else "exact" if mism == 0 else "passed")
        frac = "-" if r.get("frac_of_ceiling") is None else f"{100 * r['frac_of_ceiling']:.1f}%"
        lines.append(f"| {r['shape']} | {r['provider']} | {r['median_ms']:.4f} ({r['p20_ms']:.4f}-{r['p80_ms']:.4f})"
                     f" | {r['gbps']:,.0f} | {frac} | {ok} |")
    return "\n".join(lines)


if __name__ == "__main__":
    for name in sys.argv[1:] or ["nvfp4.dequantize", "nvfp4.quantize"]:
        print(markdown(name))
        print()
