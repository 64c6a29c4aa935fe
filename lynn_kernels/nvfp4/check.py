"""``lynn check`` rows for NVFP4: quantise (both recipes) and dequantise against the reference, bit for bit, and the
round trip's quantisation error.

Rows are ``{"op", "case", "mismatches" or "metrics": Metrics, "passed": bool}``. A quantise row's ``mismatches``
counts the differing code bytes, scale bytes and global-scale bits together (codes are bits: only that count means
anything); a dequantise row must match exactly; the round trip is scored by cosine against the fp32 original, with
a plain bf16 copy of an fp32 input as the baseline.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import torch

from .. import runtime
from ..metrics import Case, bit_mismatches, compare

#: The op names this family's rows carry, as the table prints them (``lynn check`` accepts them before running).
OPS = ("nvfp4.quantize", "nvfp4.dequantize", "nvfp4 round trip")


def _quantize_row(w: torch.Tensor, recipe: str, case: str) -> dict:
    from . import quantize, reference

    got, want = quantize(w, recipe=recipe), reference.quantize(w, recipe=recipe)
    m = compare(got.codes, want.codes, exact=True)
    ms = compare(got.scales.view(torch.uint8), want.scales.view(torch.uint8), exact=True)
    mism = m.mismatches + ms.mismatches + bit_mismatches(got.global_scale, want.global_scale)
    return {"op": "nvfp4.quantize", "case": case, "mismatches": mism,
            "passed": mism == 0}                     # codes are bits: only the count of differing bytes means anything


def _dequantize_row(w: torch.Tensor, out_dtype: torch.dtype, case: str) -> dict:
    from . import dequantize, reference

    q = reference.quantize(w)
    m = compare(dequantize(q, out_dtype), reference.dequantize(q, out_dtype), exact=True)
    return {"op": "nvfp4.dequantize", "case": case, "metrics": m, "passed": m.mismatches == 0}


def _round_trip_row(w: torch.Tensor, case: str) -> dict:
    """The quantisation error of the round trip, against the fp32 original and a plain bf16 copy."""
    from . import dequantize, reference

    q = reference.quantize(w)
    w32 = w.float()
    baseline = w32.to(torch.bfloat16) if w.dtype == torch.float32 else None   # bf16 input: bf16 is exact
    m = compare(dequantize(q, torch.float32), w32, baseline=baseline)
    return {"op": "nvfp4 round trip", "case": case, "metrics": m, "passed": m.cosine > 0.99}


def cases() -> Iterator[Case]:
    """The family's check matrix, each case named before it runs (each shape's weight drawn in order from one seeded
    generator, by the first of its cases to run)."""
    gen = torch.Generator().manual_seed(0)
    for label, shape, dtype in (("bf16 48x208", (48, 208), torch.bfloat16),
                                ("fp32 3x5x64", (3, 5, 64), torch.float32)):
        weight = functools.cache(lambda s=shape, d=dtype: (torch.randn(s, generator=gen) * 2).to(d).to(runtime.DEVICE))
        for recipe in ("modelopt", "compressed-tensors"):
            case = f"{label} {recipe}"
            yield Case("nvfp4.quantize", case, lambda w=weight, r=recipe, c=case: [_quantize_row(w(), r, c)])
        for out_dtype in (torch.bfloat16, torch.float32):
            case = f"{label} -> {str(out_dtype)[6:]}"
            yield Case("nvfp4.dequantize", case, lambda w=weight, d=out_dtype, c=case: [_dequantize_row(w(), d, c)])
        case = f"{label} vs fp32"
        yield Case("nvfp4 round trip", case, lambda w=weight, c=case: [_round_trip_row(w(), c)])


def iter_rows() -> Iterator[dict]:
    for case in cases():
        yield from case.run()


def check_nvfp4() -> list[dict]:
    """The family's ``lynn check`` rows as a list (:func:`iter_rows` yields each as it finishes)."""
    return list(iter_rows())


__all__ = ["check_nvfp4", "cases"]
