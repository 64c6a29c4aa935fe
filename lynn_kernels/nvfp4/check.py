"""``lynn check`` rows for NVFP4: quantise (both recipes) and dequantise against the reference, bit for bit, and the
round trip's quantisation error, on small, awkward weights.

Rows are ``{"op", "case", "mismatches" or "metrics": Metrics, "passed": bool}``. A quantise row's ``mismatches``
counts the differing code bytes, scale bytes and global-scale bits together (codes are bits: only that count means
anything; a part of another shape or dtype than the reference's counts as all different); a dequantise row must
match exactly; the round trip is scored by cosine against the fp32 original, with a plain bf16 copy of an fp32 input
as the baseline. The cases are :data:`SHAPES`; tests/test_nvfp4.py sweeps them too.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Iterator

import torch

from .. import runtime
from ..metrics import Case, bit_mismatches, compare
from .spec import RECIPES

#: The op names this family's rows carry, as the table prints them (``lynn check`` accepts them before running).
OPS = ("nvfp4.quantize", "nvfp4.dequantize", "nvfp4 round trip")

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
_NAMES = {BF16: "bf16", FP16: "fp16", FP32: "fp32"}

#: The weights, (dtype, shape), each dequantised back to its dtype: K = 16, 48, 80, 208 (16 x 13) and 1040 (16 x 65,
#: past a 1024 tile); rows 1, 3, 37 and 65 (past every row tile, 64 the largest); a 3-d stack; 17x272 past a row tile
#: and a K tile at once (the interpreter's 16 x 256 tile included). The dtypes take turns: a dtype changes the load
#: and the store, a shape the tiling.
SHAPES = ((BF16, (1, 16)), (FP16, (3, 48)), (FP32, (2, 5, 80)), (BF16, (37, 208)), (FP16, (65, 16)),
          (FP32, (1, 1040)), (BF16, (17, 272)))

#: A given global scale (half the recipe's own, so the top block scales clamp at 448), in each form quantize takes,
#: one on each of the first weights.
GLOBAL_FORMS = ("tensor", "[1]", "float")

#: The weights whose round trip is scored.
ROUND_TRIPS = ("fp32 2x5x80", "bf16 37x208")


def _weight(label: str, shape, dtype: torch.dtype) -> torch.Tensor:
    """The weight ``label`` names, from a generator seeded by that name: every case of it sees the same weight,
    alone or in the whole matrix."""
    gen = torch.Generator().manual_seed(zlib.crc32(label.encode()))
    return (torch.randn(shape, generator=gen) * 2).to(dtype).to(runtime.DEVICE)


def _given_global(w: torch.Tensor, form: str):
    value = (w.float().abs().amax() / 2688.0 * 0.5).item()
    return {"tensor": torch.tensor(value, dtype=FP32), "[1]": torch.tensor([value], dtype=FP32), "float": value}[form]


def _mismatches(got, want) -> int:
    """Differing code bytes, scale bytes and global-scale bits; a part of another shape or dtype than the
    reference's counts whole."""
    pairs = ((got.codes, want.codes), (got.scales, want.scales), (got.global_scale, want.global_scale))
    return sum(bit_mismatches(a, b) if (a.dtype, a.shape) == (b.dtype, b.shape) else b.numel() for a, b in pairs)


def _quantize_row(w: torch.Tensor, recipe: str, form: str | None, case: str) -> dict:
    """Quantise with the recipe's own global scale, or one given in ``form``."""
    from . import quantize, reference

    gs = None if form is None else _given_global(w, form)
    mism = _mismatches(quantize(w, gs, recipe=recipe), reference.quantize(w, gs, recipe=recipe))
    return {"op": "nvfp4.quantize", "case": case, "mismatches": mism, "passed": mism == 0}


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
    baseline = w32.to(BF16) if w.dtype == FP32 else None                  # bf16 input: bf16 is exact
    m = compare(dequantize(q, FP32), w32, baseline=baseline)
    return {"op": "nvfp4 round trip", "case": case, "metrics": m, "passed": m.cosine > 0.99}


def cases() -> Iterator[Case]:
    """The family's check matrix, each case named before it runs."""
    for i, (dtype, shape) in enumerate(SHAPES):
        label = f"{_NAMES[dtype]} {'x'.join(map(str, shape))}"
        weight = functools.partial(_weight, label, shape, dtype)
        for form in (None, *GLOBAL_FORMS[i:i + 1]):
            for recipe in RECIPES:
                case = f"{label} {recipe}" + (f" g={form}" if form else "")
                yield Case("nvfp4.quantize", case,
                           lambda w=weight, r=recipe, f=form, c=case: [_quantize_row(w(), r, f, c)])
        case = f"{label} -> {str(dtype)[6:]}"
        yield Case("nvfp4.dequantize", case, lambda w=weight, d=dtype, c=case: [_dequantize_row(w(), d, c)])
        if label in ROUND_TRIPS:
            case = f"{label} vs fp32"
            yield Case("nvfp4 round trip", case, lambda w=weight, c=case: [_round_trip_row(w(), c)])


def iter_rows() -> Iterator[dict]:
    for case in cases():
        yield from case.run()


def check_nvfp4() -> list[dict]:
    """The family's ``lynn check`` rows as a list (:func:`iter_rows` yields each as it finishes)."""
    return list(iter_rows())


__all__ = ["check_nvfp4", "cases", "SHAPES"]
