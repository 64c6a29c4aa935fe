"""``lynn check``: validate every kernel against its reference on the current device, as one table.

Each family registers a function returning rows ``{"op", "case", "backend", <Metrics fields>, "passed"}``. Sizes are
small enough for the interpreter to finish in seconds; on a GPU the same cases run compiled.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from . import runtime
from .validate import bit_mismatches, compare, render_table

CHECKS: dict[str, Callable[[], list[dict]]] = {}


def register(family: str):
    def deco(fn):
        CHECKS[family] = fn
        return fn

    return deco


@register("nvfp4")
def check_nvfp4() -> list[dict]:
    from .nvfp4 import dequantize, quantize, reference

    rows = []
    gen = torch.Generator().manual_seed(0)
    for label, shape, dtype in (("bf16 48x208", (48, 208), torch.bfloat16),
                                ("fp32 3x5x64", (3, 5, 64), torch.float32)):
        w = (torch.randn(shape, generator=gen) * 2).to(dtype).to(runtime.DEVICE)
        for recipe in ("modelopt", "compressed-tensors"):
            got, want = quantize(w, recipe=recipe), reference.quantize(w, recipe=recipe)
            m = compare(got.codes, want.codes, exact=True)
            ms = compare(got.scales.view(torch.uint8), want.scales.view(torch.uint8), exact=True)
            mism = m.mismatches + ms.mismatches + bit_mismatches(got.global_scale, want.global_scale)
            rows.append({"op": "nvfp4.quantize", "case": f"{label} {recipe}", "mismatches": mism,
                         "passed": mism == 0})             # codes are bits: only the count of differing bytes means anything
        q = reference.quantize(w)
        for out_dtype in (torch.bfloat16, torch.float32):
            m = compare(dequantize(q, out_dtype), reference.dequantize(q, out_dtype), exact=True)
            rows.append({"op": "nvfp4.dequantize", "case": f"{label} -> {str(out_dtype)[6:]}", "metrics": m,
                         "passed": m.mismatches == 0})
        # quantisation error of the round trip, against the fp32 original and a plain bf16 copy
        w32 = w.float()
        baseline = w32.to(torch.bfloat16) if w.dtype == torch.float32 else None   # bf16 input: bf16 is exact
        m = compare(dequantize(q, torch.float32), w32, baseline=baseline)
        rows.append({"op": "nvfp4 round trip", "case": f"{label} vs fp32", "metrics": m,
                     "passed": m.cosine > 0.99})
    return rows


@register("matmul")
def check_matmul() -> list[dict]:
    from .matmul import nvfp4_gemm, nvfp4_gemv, nvfp4_linear, reference
    from .nvfp4 import quantize

    rows = []
    gen = torch.Generator().manual_seed(0)
    for label, m, n, k, dtype in (("M=1 bf16 37x208", 1, 37, 208, torch.bfloat16),
                                  ("M=3 fp32 70x1040", 3, 70, 1040, torch.float32),
                                  ("M=17 bf16 100x208", 17, 100, 208, torch.bfloat16),
                                  ("M=129 fp16 65x400", 129, 65, 400, torch.float16)):
        w = quantize(torch.randn(n, k, generator=gen).to(runtime.DEVICE))
        x = torch.randn(m, k, generator=gen).to(dtype).to(runtime.DEVICE)
        bias = torch.randn(n, generator=gen).to(dtype).to(runtime.DEVICE)
        want = reference.nvfp4_linear(x, w, bias)
        for name, fn in (("nvfp4_gemv", nvfp4_gemv), ("nvfp4_gemm", nvfp4_gemm), ("nvfp4_linear", nvfp4_linear)):
            if name == "nvfp4_gemv" and m > 16:
                continue
            # baseline: the same product rounded through a bf16 weight, the copy cuBLAS would multiply
            base = (x.float() @ reference.nvfp4_reference.dequantize(w, torch.bfloat16).float().t()
                    + bias.float()).to(dtype)
            metrics = compare(fn(x, w, bias), want, baseline=base)
            rows.append({"op": f"matmul.{name}", "case": label, "metrics": metrics,
                         "passed": metrics.cosine > 0.99999 and metrics.rel_l2 < 1e-2})
    return rows


@register("attention")
def check_attention() -> list[dict]:
    from .attention.check import check_attention as rows

    return rows()


@register("deltanet")
def check_deltanet() -> list[dict]:
    from .deltanet.check import check_deltanet as rows

    return rows()


@register("moe")
def check_moe() -> list[dict]:
    from .moe.check import check_moe as rows

    return rows()


@register("norm")
def check_norm() -> list[dict]:
    from .norm.check import check_norm as rows

    return rows()


def run_checks(families: list[str] | None = None) -> tuple[list[dict], float]:
    chosen = [f for f in CHECKS if not families or f in families]
    unknown = set(families or []) - set(CHECKS)
    if unknown:
        raise KeyError(f"unknown kernel family {sorted(unknown)}; available: {sorted(CHECKS)}")
    t0 = time.perf_counter()
    rows = []
    for fam in chosen:
        for row in CHECKS[fam]():
            rows.append({"backend": runtime.backend(), **row})
    return rows, time.perf_counter() - t0


COLUMNS = ["op", "case", "backend", "cosine", "max_abs", "rel_l2", "err_ratio", "mismatches", "passed"]
#: The same without ``backend``: what notebooks check under nbval, so one stored output holds on CPU and GPU.
PORTABLE_COLUMNS = [c for c in COLUMNS if c != "backend"]


def table(rows: list[dict], digits: int = 6, columns: list[str] | None = None) -> str:
    """The check table; ``mismatches`` of a quantise row counts codes, scales and the global scale together."""
    return render_table(rows, columns or COLUMNS, digits=digits)
