"""``lynn check`` rows for the RMSNorm: the kernel against the exact answer on small, awkward cases.

Rows are ``{"op", "case", "metrics": Metrics, "passed": bool}``. The exact answer is the reference in fp32 on the
same ``h`` (the residual sum rounded to x's dtype, as the op defines it); ``err_ratio`` is the kernel's error over
that answer's own rounding to x's dtype: 1 means "as good as an output in x's dtype can be". The residual sum ``h``
is checked bit for bit against the reference (``mismatches``).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .. import runtime
from ..metrics import Case, bit_mismatches, compare

#: The op names this family's rows carry, as the table prints them (``lynn check`` accepts them before running).
OPS = ("norm.rmsnorm", "norm.rmsnorm residual")

#: (shape, with a residual): a short odd row under a 3-d batch, and a long row with the residual add.
SHAPES = (((3, 5, 100), False), ((4, 2048), True))


def _rows(shape, with_residual: bool, dtype: torch.dtype, case: str, gen: torch.Generator) -> list[dict]:
    from . import reference, rmsnorm

    dev = runtime.DEVICE
    D = shape[-1]
    x = (torch.randn(shape, generator=gen) * 2).to(dtype).to(dev)
    res = torch.randn(shape, generator=gen).to(dtype).to(dev) if with_residual else None
    w = (0.2 * torch.randn(D, generator=gen)).to(dev)                     # zero-centred, as Qwen stores it
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
    baseline = exact.to(dtype) if dtype != torch.float32 else None
    m = compare(y, exact, baseline=baseline)
    ok = m.cosine >= 0.99999 and (m.err_ratio <= 1.05 if baseline is not None else m.rel_l2 <= 1e-6)
    rows.append({"op": "norm.rmsnorm", "case": case, "metrics": m, "passed": ok})
    return rows


def cases() -> Iterator[Case]:
    """The family's check matrix, each case named before it runs (inputs drawn in order from one seeded
    generator)."""
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        label = str(dtype).replace("torch.", "")
        for shape, with_residual in SHAPES:
            case = f"{label} {'x'.join(map(str, shape))}" + (" + residual" if with_residual else "")
            yield Case("norm.rmsnorm residual" if with_residual else "norm.rmsnorm", case,
                       lambda s=shape, r=with_residual, d=dtype, c=case: _rows(s, r, d, c, gen))


def iter_rows() -> Iterator[dict]:
    for case in cases():
        yield from case.run()


def check_norm() -> list[dict]:
    """The family's ``lynn check`` rows as a list (:func:`iter_rows` yields each as it finishes)."""
    return list(iter_rows())


__all__ = ["check_norm", "cases"]
