"""``lynn check`` rows for the RMSNorm: the kernel against the exact answer on small, awkward cases.

Rows are ``{"op", "case", "metrics": Metrics, "passed": bool}``. The exact answer is the reference in fp32 on the
same ``h`` (the residual sum rounded to x's dtype, as the op defines it); ``err_ratio`` is the kernel's error over
that answer's own rounding to x's dtype: 1 means "as good as an output in x's dtype can be". A row also passes only
within :data:`MAX_ULPS` of that rounding (the reference's output) everywhere. The residual sum ``h`` is checked bit
for bit against the reference (``mismatches``). The cases are x's dtypes times :data:`SHAPES`; tests/test_norm.py
sweeps them too.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator

import torch

from .. import runtime
from ..metrics import Case, bit_mismatches, compare

#: The op names this family's rows carry, as the table prints them (``lynn check`` accepts them before running).
OPS = ("norm.rmsnorm", "norm.rmsnorm residual")

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
_NAMES = {BF16: "bf16", FP16: "fp16", FP32: "fp32", torch.float64: "fp64"}

#: (shape, with a residual, the weight's dtype), each in every dtype of x: one row of the narrowest block, a 3-d batch
#: of power-of-two rows, a short odd row, a long row; the weight in each dtype the op takes (fp32, bf16 and fp16 as
#: checkpoints store it, fp64).
SHAPES = (((1, 16), False, FP32), ((3, 5, 64), True, BF16), ((3, 5, 100), False, FP16),
          ((4, 2048), True, torch.float64))

#: The most an output may differ from the reference's (the exact answer rounded to x's dtype), in steps of x's dtype:
#: the row statistic differs in its last bits (another summation order), and in fp32 torch's CPU ``rsqrt`` is not
#: the correctly rounded ``1 / sqrt`` the kernel computes.
MAX_ULPS = {BF16: 1, FP16: 1, FP32: 8}


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance between ``a`` and ``b`` (same 16- or 32-bit float dtype and shape) in units in the last
    place (steps of the dtype)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        raise ValueError(f"ulps needs one dtype and shape: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}")
    bits = {2: torch.int16, 4: torch.int32}[a.element_size()]
    magnitude = torch.iinfo(bits).max

    def ordered(t):                       # sign-magnitude bits -> integers in the order of the values
        v = t.detach().cpu().contiguous().view(bits).long()
        return torch.where(v < 0, -(v & magnitude), v)

    return int((ordered(a) - ordered(b)).abs().max()) if a.numel() else 0


def _rows(shape, with_residual: bool, w_dtype: torch.dtype, dtype: torch.dtype, case: str) -> list[dict]:
    from . import reference, rmsnorm

    gen = torch.Generator().manual_seed(zlib.crc32(case.encode()))     # the same inputs alone as in the matrix
    dev = runtime.DEVICE
    D = shape[-1]
    x = (torch.randn(shape, generator=gen) * 2).to(dtype).to(dev)
    res = torch.randn(shape, generator=gen).to(dtype).to(dev) if with_residual else None
    w = (0.2 * torch.randn(D, generator=gen)).to(w_dtype).to(dev)      # zero-centred, as Qwen stores it
    rows = []
    if with_residual:
        y, h = rmsnorm(x, w, 1e-6, residual=res)
        h_ref = reference.rmsnorm(x, w, 1e-6, residual=res)[1]
        mism = bit_mismatches(h, h_ref)
        rows.append({"op": "norm.rmsnorm residual", "case": case, "mismatches": mism, "passed": mism == 0})
        base_in = h_ref
    else:
        y = rmsnorm(x, w, 1e-6)
        base_in = x
    exact = reference.rmsnorm(base_in.float(), w, 1e-6)                   # fp32 answer on the same (rounded) input
    baseline = exact.to(dtype) if dtype != FP32 else None
    m = compare(y, exact, baseline=baseline)
    ok = m.cosine >= 0.99999 and (m.err_ratio <= 1.05 if baseline is not None else m.rel_l2 <= 1e-6)
    ok = ok and y.dtype == dtype and ulps(y, exact.to(dtype)) <= MAX_ULPS[dtype]
    rows.append({"op": "norm.rmsnorm", "case": case, "metrics": m, "passed": ok})
    return rows


def cases() -> Iterator[Case]:
    """The family's check matrix, each case named before it runs and drawing its inputs from a generator seeded by
    its name."""
    for dtype in (BF16, FP16, FP32):
        for shape, with_residual, w_dtype in SHAPES:
            case = (f"{_NAMES[dtype]} {'x'.join(map(str, shape))}" + (" + residual" if with_residual else "")
                    + (f", w {_NAMES[w_dtype]}" if w_dtype != FP32 else ""))
            yield Case("norm.rmsnorm residual" if with_residual else "norm.rmsnorm", case,
                       lambda s=shape, r=with_residual, wd=w_dtype, d=dtype, c=case: _rows(s, r, wd, d, c))


def iter_rows() -> Iterator[dict]:
    for case in cases():
        yield from case.run()


def check_norm() -> list[dict]:
    """The family's ``lynn check`` rows as a list (:func:`iter_rows` yields each as it finishes)."""
    return list(iter_rows())


__all__ = ["check_norm", "cases", "ulps", "MAX_ULPS", "SHAPES"]
