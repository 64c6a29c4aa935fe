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
    from .matmul import nvfp4_gemm, nvfp4_gemv, nvfp4_linear, pack, reference
    from .nvfp4 import quantize

    rows = []
    gen = torch.Generator().manual_seed(0)
    for label, m, n, k, dtype in (("M=1 bf16 37x208", 1, 37, 208, torch.bfloat16),
                                  ("M=2 bf16 65x2064", 2, 65, 2064, torch.bfloat16),
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
            for layout, weight in (("", w), (" packed", pack(w))):
                got = fn(x, weight, bias)
                metrics = compare(got, want, baseline=base)
                rows.append({"op": f"matmul.{name}{layout}", "case": label, "metrics": metrics,
                             "passed": metrics.rel_l2 <= MATMUL_MAX_REL_L2[dtype] and _within_one_flip(got, want)})
    return rows


#: The matmul rows' bound per output dtype: the kernels add the same fp32 products as the reference in another
#: order, so an output element differs at most by a flipped last rounding, and only a few do. Measured rel_l2:
#: fp32 3.7e-7 (H200) / 3.3e-7 (interpreter); fp16 9.1e-6 / 1.2e-5; bf16 3.4e-7 / 0 (one flip on the H200, of a
#: small element; one flip of a typical element of the 37-wide M=1 case would be 4e-4).
MATMUL_MAX_REL_L2 = {torch.float32: 2e-6, torch.float16: 5e-5, torch.bfloat16: 1e-3}


def _within_one_flip(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Every element of a 16-bit ``got`` within one ulp of ``want`` (``eps * |want|``), plus ``1e-5 * max|want|``
    for the fp32 summation-order noise where the output is near zero; fp32 outputs are bounded by rel_l2 alone."""
    if got.dtype == torch.float32:
        return True
    g, w = got.double(), want.double()
    tol = torch.finfo(got.dtype).eps * w.abs() + 1e-5 * w.abs().max()
    return bool(((g - w).abs() <= tol).all())


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
