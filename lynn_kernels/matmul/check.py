"""``lynn check`` rows for the W4A16 matmul: the GEMV, the GEMM and ``nvfp4_linear``'s dispatch, on the
checkpoint layout and on the packed one, and the packed layout's two decode kernels (the packed GEMV, the tensor-core
GEMV) and its prefill path (dequantise, then cuBLAS) each on its own, against the fp32 reference.

Rows are ``{"op", "case", "metrics": Metrics, "passed": bool}``; the baseline of ``err_ratio`` is the same product
rounded through a bf16 weight (the copy cuBLAS would multiply). A row passes when its rel_l2 is within
:data:`MATMUL_MAX_REL_L2` of its output dtype and every 16-bit output element is within one flipped last rounding
of the reference.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import torch

from .. import runtime
from ..metrics import Case, compare

#: The matmul rows' bound per output dtype: the kernels add the same fp32 products as the reference in another
#: order, so an output element differs at most by a flipped last rounding, and only a few do. Measured rel_l2:
#: fp32 3.7e-7 (H200) / 3.3e-7 (interpreter); fp16 9.1e-6 / 1.2e-5; bf16 3.4e-7 / 0 (one flip on the H200, of a
#: small element; one flip of a typical element of the 37-wide M=1 case would be 4e-4).
MATMUL_MAX_REL_L2 = {torch.float32: 2e-6, torch.float16: 5e-5, torch.bfloat16: 1e-3}


#: The op names this family's rows carry, as the table prints them (``lynn check`` accepts them before running).
OPS = (
    "matmul.nvfp4_gemv", "matmul.nvfp4_gemv packed", "matmul.nvfp4_gemm", "matmul.nvfp4_gemm packed",
    "matmul.nvfp4_linear", "matmul.nvfp4_linear packed", "matmul.tensor-core gemv packed", "matmul.packed gemv",
    "matmul.dequantise + cuBLAS packed", "matmul.norm_linear packed",
)


#: The matrix: (case, M, N, K, activation dtype).
SHAPES = (("M=1 bf16 37x208", 1, 37, 208, torch.bfloat16),
          ("M=2 bf16 65x2064", 2, 65, 2064, torch.bfloat16),
          ("M=3 fp32 70x1040", 3, 70, 1040, torch.float32),
          ("M=17 bf16 100x208", 17, 100, 208, torch.bfloat16),
          ("M=129 fp16 65x400", 129, 65, 400, torch.float16))


def _inputs(m: int, n: int, k: int, dtype, gen: torch.Generator):
    """The case's weight (NVFP4), activations and bias, drawn in that order."""
    from ..nvfp4 import quantize

    w = quantize(torch.randn(n, k, generator=gen).to(runtime.DEVICE))
    x = torch.randn(m, k, generator=gen).to(dtype).to(runtime.DEVICE)
    bias = torch.randn(n, generator=gen).to(dtype).to(runtime.DEVICE)
    return w, x, bias


def _rows(label: str, m: int, n: int, dtype, w, x: torch.Tensor, bias: torch.Tensor) -> list[dict]:
    """The GEMV (up to 16 rows), the GEMM and ``nvfp4_linear`` on both layouts, then the packed layout's decode kernels
    (up to 16 rows) or its prefill path on their own (not on the reference backend)."""
    from . import nvfp4_gemm, nvfp4_gemv, nvfp4_linear, pack, reference

    rows = []
    want = reference.nvfp4_linear(x, w, bias)
    for name, fn in (("nvfp4_gemv", nvfp4_gemv), ("nvfp4_gemm", nvfp4_gemm), ("nvfp4_linear", nvfp4_linear)):
        if name == "nvfp4_gemv" and m > 16:
            continue
        # baseline: the same product rounded through a bf16 weight, the copy cuBLAS would multiply
        base = (x.float() @ reference.nvfp4_reference.dequantize(w, torch.bfloat16).float().t()
                + bias.float()).to(dtype)
        for layout, weight in (("", w), (" packed", pack(w))):
            got = fn(x, weight, bias)
            rows.append(_row(f"matmul.{name}{layout}", label, got, want, base, dtype))
    if m <= 16 and runtime.backend() != "reference":
        # the two decode kernels of the packed layout on their own, whichever the dispatch picks
        from .triton_matmul import launch_gemv
        from .triton_packed import launch_packed_gemv

        p = pack(w)
        got = launch_gemv(x, p, bias, torch.empty(m, n, dtype=dtype, device=x.device))
        rows.append(_row("matmul.tensor-core gemv packed", label, got, want, base, dtype))
        if m <= 2:
            got = launch_packed_gemv(x, p, bias, torch.empty(m, n, dtype=dtype, device=x.device))
            rows.append(_row("matmul.packed gemv", label, got, want, base, dtype))
    if m > 16 and runtime.backend() != "reference":
        # the prefill path (nvfp4_linear's from DEQUANT_MIN_M rows) on its own: dequantise once, then cuBLAS
        from .triton_matmul import launch_dequant_gemm

        got = launch_dequant_gemm(x, pack(w), bias, torch.empty(m, n, dtype=dtype, device=x.device))
        rows.append(_row("matmul.dequantise + cuBLAS packed", label, got, want, base, dtype))
    return rows


def _norm_rows(label: str, x: torch.Tensor, w, gen: torch.Generator, dtype) -> list[dict]:
    """:func:`_norm_row` on the packed layout (not on the reference backend)."""
    from . import pack

    if runtime.backend() == "reference":
        return []
    return [_norm_row(label, x, pack(w), gen, dtype)]


def cases() -> Iterator[Case]:
    """The family's check matrix, each case named before it runs (inputs drawn in order from one seeded generator,
    a shape's by the first of its cases to run)."""
    gen = torch.Generator().manual_seed(0)
    for label, m, n, k, dtype in SHAPES:
        inputs = functools.cache(lambda m=m, n=n, k=k, d=dtype: _inputs(m, n, k, d, gen))
        yield Case("matmul.nvfp4_gemv" if m <= 16 else "matmul.nvfp4_gemm", label,
                   lambda a=inputs, c=label, m=m, n=n, d=dtype: _rows(c, m, n, d, *a()))
        if m <= 2:                      # norm_linear: the packed GEMV's launch, with the norm in front
            yield Case("matmul.norm_linear packed", label + " + norm",
                       lambda a=inputs, c=label, d=dtype: _norm_rows(c, a()[1], a()[0], gen, d))


def iter_rows() -> Iterator[dict]:
    for case in cases():
        yield from case.run()


def _norm_row(label: str, x: torch.Tensor, w, gen: torch.Generator, dtype) -> dict:
    """``norm_linear`` (the norm with the residual add in the packed GEMV's launch): its product against the reference
    product of its own normed rows (the product's bound), its normed rows within one rounding of the norm's
    reference, its residual sum exact."""
    from ..norm import reference as norm_reference
    from . import norm_linear, reference
    from .packed import unpack

    k = x.shape[1]
    nw = (torch.randn(k, generator=gen) * 0.2).to(torch.bfloat16).to(x.device)
    res = (torch.randn(x.shape, generator=gen) * 3).to(dtype).to(x.device)
    y, xn, h = norm_linear(x, nw, w, 1e-6, residual=res)
    want_xn, want_h = norm_reference.rmsnorm(x, nw, 1e-6, residual=res)
    base = (xn.float() @ reference.nvfp4_reference.dequantize(unpack(w), torch.bfloat16).float().t()).to(dtype)
    row = _row("matmul.norm_linear packed", label + " + norm", y, reference.nvfp4_linear(xn, w), base, dtype)
    row["passed"] = row["passed"] and torch.equal(h, want_h) and _within_one_flip(xn, want_xn.to(xn.dtype))
    return row


def check_matmul() -> list[dict]:
    """The family's ``lynn check`` rows as a list (:func:`iter_rows` yields each as it finishes)."""
    return list(iter_rows())


def _row(op: str, case: str, got: torch.Tensor, want: torch.Tensor, base: torch.Tensor, dtype) -> dict:
    metrics = compare(got, want, baseline=base)
    return {"op": op, "case": case, "metrics": metrics,
            "passed": metrics.rel_l2 <= MATMUL_MAX_REL_L2[dtype] and _within_one_flip(got, want)}


def _within_one_flip(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Every element of a 16-bit ``got`` within one ulp of ``want`` (``eps * |want|``), plus ``1e-5 * max|want|``
    for the fp32 summation-order noise where the output is near zero; fp32 outputs are bounded by rel_l2 alone."""
    if got.dtype == torch.float32:
        return True
    g, w = got.double(), want.double()
    tol = torch.finfo(got.dtype).eps * w.abs() + 1e-5 * w.abs().max()
    return bool(((g - w).abs() <= tol).all())


__all__ = ["check_matmul", "cases"]
