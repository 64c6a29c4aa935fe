"""``lynn check`` rows for the W4A16 matmul: the GEMV, the GEMM and ``nvfp4_linear``'s dispatch, on the
checkpoint layout and on the packed one, and the packed layout's two decode kernels (the packed GEMV, the tensor-core
GEMV) and its prefill path (dequantise, then cuBLAS) each on its own, against the fp32 reference.

Rows are ``{"op", "case", "metrics": Metrics, "passed": bool}``; the baseline of ``err_ratio`` is the same product
rounded through a bf16 weight (the copy cuBLAS would multiply). A row passes when its output has x's dtype, its rel_l2
is within :data:`MATMUL_MAX_REL_L2` of that dtype, its cosine above 0.99999, and every 16-bit output element is within
one flipped last rounding of the reference. The cases are :data:`SHAPES`; tests/test_matmul.py sweeps them too.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator

import torch

from .. import runtime
from ..metrics import Case, compare

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
_NAMES = {BF16: "bf16", FP16: "fp16", FP32: "fp32"}

#: The matmul rows' bound per output dtype: the kernels add the same fp32 products as the reference in another
#: order, so an output element differs at most by a flipped last rounding, and only a few do. Measured rel_l2:
#: fp32 3.7e-7 (H200) / 3.3e-7 (interpreter); fp16 9.1e-6 / 1.2e-5; bf16 3.4e-7 / 0 (one flip on the H200, of a
#: small element; one flip of a typical element of the 37-wide M=1 case would be 4e-4).
MATMUL_MAX_REL_L2 = {FP32: 2e-6, FP16: 5e-5, BF16: 1e-3}

#: The absolute part of a 16-bit element's one-rounding bound, times ``max|reference|``: the fp32 summation-order
#: noise of an output near zero.
ONE_ROUNDING_ABS = 1e-6


#: The op names this family's rows carry, as the table prints them (``lynn check`` accepts them before running).
OPS = (
    "matmul.nvfp4_gemv", "matmul.nvfp4_gemv packed", "matmul.nvfp4_gemm", "matmul.nvfp4_gemm packed",
    "matmul.nvfp4_linear", "matmul.nvfp4_linear packed", "matmul.tensor-core gemv packed", "matmul.packed gemv",
    "matmul.dequantise + cuBLAS packed", "matmul.norm_linear packed",
)


#: The matrix: (M, N, K, x dtype, bias dtype or None for no bias). K is 16 x odd (16, 48, 208, 400, 1040) or 2064
#: (two steps of 1024 and a tail); N a multiple of no block (1, 37, 65, 130); M on both sides of each switch: the
#: packed GEMV (1, 2), the tensor-core GEMV (3 .. 16), the GEMM and the dequantise-then-cuBLAS path (17, 129). Each
#: x dtype meets each bias form somewhere; the rows of M <= 2 also run with the RMSNorm folded in.
SHAPES = (
    (1, 1, 16, BF16, None),
    (1, 37, 208, BF16, BF16),
    (1, 65, 400, FP32, BF16),
    (2, 65, 2064, BF16, FP32),
    (2, 130, 48, FP16, FP16),
    (3, 37, 1040, FP32, None),
    (3, 65, 48, BF16, FP32),
    (9, 37, 208, FP16, BF16),
    (16, 1, 400, FP16, FP32),
    (17, 37, 1040, BF16, None),
    (17, 130, 48, FP16, FP32),
    (129, 65, 208, FP16, FP16),
    (129, 1, 48, FP32, FP32),
)


def _shape(m: int, n: int, k: int, dtype) -> str:
    return f"M={m} {_NAMES[dtype]} {n}x{k}"


def _gen(label: str) -> torch.Generator:
    """A generator seeded by the case's label: a case draws the same inputs alone as in the whole matrix."""
    return torch.Generator().manual_seed(zlib.crc32(label.encode()))


def _inputs(m: int, n: int, k: int, dtype, bias_dtype, gen: torch.Generator):
    """The case's weight (NVFP4, quantised by the reference: the quantise kernel is nvfp4's check), activations and
    bias, drawn in that order."""
    from ..nvfp4 import reference as nvfp4_reference

    dev = runtime.DEVICE
    w = nvfp4_reference.quantize(torch.randn(n, k, generator=gen).to(dev))
    x = torch.randn(m, k, generator=gen).to(dtype).to(dev)
    bias = None if bias_dtype is None else torch.randn(n, generator=gen).to(bias_dtype).to(dev)
    return w, x, bias


def _rows(label: str, m: int, n: int, k: int, dtype, bias_dtype) -> list[dict]:
    """The GEMV (up to 16 rows), the GEMM and ``nvfp4_linear`` on both layouts, then the packed layout's decode kernels
    (up to 16 rows) or its prefill path on their own (not on the reference backend; the prefill path takes a bias of
    x's dtype only)."""
    from . import nvfp4_gemm, nvfp4_gemv, nvfp4_linear, pack, reference

    w, x, bias = _inputs(m, n, k, dtype, bias_dtype, _gen(label))
    rows = []
    want = reference.nvfp4_linear(x, w, bias)
    # baseline: the same product rounded through a bf16 weight, the copy cuBLAS would multiply
    base = x.float() @ reference.nvfp4_reference.dequantize(w, BF16).float().t()
    base = (base if bias is None else base + bias.float()).to(dtype)
    for name, fn in (("nvfp4_gemv", nvfp4_gemv), ("nvfp4_gemm", nvfp4_gemm), ("nvfp4_linear", nvfp4_linear)):
        if name == "nvfp4_gemv" and m > 16:
            continue
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
    if m > 16 and runtime.backend() != "reference" and bias_dtype in (None, dtype):
        # the prefill path (nvfp4_linear's from DEQUANT_MIN_M rows) on its own: dequantise once, then cuBLAS
        from .triton_matmul import launch_dequant_gemm

        got = launch_dequant_gemm(x, pack(w), bias, torch.empty(m, n, dtype=dtype, device=x.device))
        rows.append(_row("matmul.dequantise + cuBLAS packed", label, got, want, base, dtype))
    return rows


def _norm_rows(label: str, m: int, n: int, k: int, dtype) -> list[dict]:
    """``norm_linear`` (the norm with the residual add in the packed GEMV's launch): its product against the reference
    product of its own normed rows (the product's bound), its normed rows within one rounding of the norm's
    reference, its residual sum exact (not on the reference backend)."""
    from ..norm import reference as norm_reference
    from . import norm_linear, pack, reference
    from .packed import unpack

    if runtime.backend() == "reference":
        return []
    gen = _gen(label)
    w, x, _ = _inputs(m, n, k, dtype, None, gen)
    w = pack(w)
    nw = (torch.randn(k, generator=gen) * 0.2).to(BF16).to(x.device)
    res = (torch.randn(x.shape, generator=gen) * 3).to(dtype).to(x.device)
    y, xn, h = norm_linear(x, nw, w, 1e-6, residual=res)
    want_xn, want_h = norm_reference.rmsnorm(x, nw, 1e-6, residual=res)
    base = (xn.float() @ reference.nvfp4_reference.dequantize(unpack(w), BF16).float().t()).to(dtype)
    row = _row("matmul.norm_linear packed", label, y, reference.nvfp4_linear(xn, w), base, dtype)
    row["passed"] = row["passed"] and torch.equal(h, want_h) and _within_one_flip(xn, want_xn.to(xn.dtype))
    return [row]


def cases() -> Iterator[Case]:
    """The family's check matrix, each case named before it runs."""
    for m, n, k, dtype, bias_dtype in SHAPES:
        label = _shape(m, n, k, dtype) + (" no bias" if bias_dtype is None else f" bias {_NAMES[bias_dtype]}")
        yield Case("matmul.nvfp4_gemv" if m <= 16 else "matmul.nvfp4_gemm", label,
                   lambda c=label, s=(m, n, k, dtype, bias_dtype): _rows(c, *s))
        if m <= 2:                      # norm_linear: the packed GEMV's launch, with the norm in front
            label = _shape(m, n, k, dtype) + " + norm"
            yield Case("matmul.norm_linear packed", label, lambda c=label, s=(m, n, k, dtype): _norm_rows(c, *s))


def iter_rows() -> Iterator[dict]:
    for case in cases():
        yield from case.run()


def check_matmul() -> list[dict]:
    """The family's ``lynn check`` rows as a list (:func:`iter_rows` yields each as it finishes)."""
    return list(iter_rows())


def _row(op: str, case: str, got: torch.Tensor, want: torch.Tensor, base: torch.Tensor, dtype) -> dict:
    metrics = compare(got, want, baseline=base)
    return {"op": op, "case": case, "metrics": metrics,
            "passed": (got.dtype == want.dtype and metrics.rel_l2 <= MATMUL_MAX_REL_L2[dtype]
                       and metrics.cosine > 0.99999 and _within_one_flip(got, want))}


def _within_one_flip(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Every element of a 16-bit ``got`` within one ulp of ``want`` (``eps * |want|``), plus
    :data:`ONE_ROUNDING_ABS` ``* max|want|``; fp32 outputs are bounded by rel_l2 alone."""
    if got.dtype == FP32:
        return True
    g, w = got.double(), want.double()
    tol = torch.finfo(got.dtype).eps * w.abs() + ONE_ROUNDING_ABS * w.abs().max()
    return bool(((g - w).abs() <= tol).all())


__all__ = ["check_matmul", "cases", "SHAPES"]
