"""NVFP4 quantise / dequantise bandwidth against the copy ceiling, with the eager torch reference alongside."""

from __future__ import annotations

import torch

from ..metrics import compare
from ..nvfp4 import NVFP4Tensor, dequantize, quantize, reference
from ..nvfp4.triton_quant import launch_dequantize, launch_quantize, quantize_triton
from .harness import Ceilings, Result, derive, rotating, rotation, time_fn, validated
from .registry import register

#: (label, shape): plain projections, a square 16k, and a stacked MoE gate_up [E, 2I, H] (Qwen3.5-35B-A3B)
SHAPES = [
    ("4096x4096", (4096, 4096)),
    ("8192x8192", (8192, 8192)),
    ("16384x16384", (16384, 16384)),
    ("moe 256x1024x2048", (256, 1024, 2048)),
]
QUICK_SHAPES = SHAPES[1:2]


def _dims(shape) -> dict:
    names = ["E", "N", "K"][-len(shape):]
    return dict(zip(names, shape))


def _packed_bytes(numel: int) -> int:
    return numel // 2 + numel // 16


def _poisoned_like(q: NVFP4Tensor) -> NVFP4Tensor:
    """An output NVFP4Tensor whose codes are 0xFF and scales NaN (0xFF), so a launch that writes nothing fails."""
    codes = torch.full_like(q.codes, 0xFF)
    scales = torch.full(q.scales.shape, 0xFF, dtype=torch.uint8, device=q.device).view(torch.float8_e4m3fn)
    return NVFP4Tensor(codes, scales, q.global_scale.clone())


@register("nvfp4.dequantize")
def bench_dequantize(ceilings: Ceilings, quick: bool = False) -> list[Result]:
    rows = []
    for label, shape in (QUICK_SHAPES if quick else SHAPES):
        numel = torch.Size(shape).numel()
        nbytes = _packed_bytes(numel) + 2 * numel                    # read codes + scales, write bf16

        def make():
            return (quantize(torch.randn(shape, device="cuda", dtype=torch.bfloat16)),)

        sets = rotation(make, nbytes)
        q0 = sets[0][0]
        want = reference.dequantize(q0)
        src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        med, p20, p80 = time_fn(lambda: dst.copy_(src))
        rows.append(derive(Result("nvfp4.dequantize", "torch copy of the same bytes", label, _dims(shape), med, p20,
                                  p80, bytes=nbytes, ceiling="copy_gbps",
                                  note="what a plain copy reaches at this size"), ceilings))
        src = dst = None
        outs = [torch.full(shape, float("nan"), dtype=torch.bfloat16, device="cuda") for _ in sets]
        prealloc_sets = [(q, o) for (q,), o in zip(sets, outs)]
        providers = (("lynn kernel launch (preallocated output)", launch_dequantize, True),
                     ("lynn dequantize() eager call", dequantize, False),
                     ("torch eager (reference)", reference.dequantize, False))
        checks = {}
        for provider, fn, prealloc in providers:                  # validate every provider before timing any
            got = fn(*prealloc_sets[0]) if prealloc else fn(q0)
            checks[provider] = validated(compare(got, want, exact=True), exact=True)
        for provider, fn, prealloc in providers:
            check = checks[provider]
            med, p20, p80 = time_fn(rotating(fn, prealloc_sets if prealloc else sets))
            rows.append(derive(Result("nvfp4.dequantize", provider, label, _dims(shape), med, p20, p80,
                                      bytes=nbytes, ceiling="copy_gbps", validation=check,
                                      note=f"{len(sets)} rotating input sets"), ceilings))
        post = compare(dequantize(q0), want, exact=True)          # timing must not have disturbed anything
        if post.mismatches:
            raise AssertionError(f"dequantize differs from the reference after timing {label}: {post}")
        sets = outs = prealloc_sets = None
        torch.cuda.empty_cache()
    return rows


@register("nvfp4.quantize")
def bench_quantize(ceilings: Ceilings, quick: bool = False) -> list[Result]:
    rows = []
    for label, shape in (QUICK_SHAPES if quick else SHAPES):
        numel = torch.Size(shape).numel()
        nbytes = 2 * numel + _packed_bytes(numel)                    # read bf16, write codes + scales

        def make():
            return (torch.randn(shape, device="cuda", dtype=torch.bfloat16),)

        sets = rotation(make, nbytes)
        w0 = sets[0][0]
        g0 = w0.abs().amax().float() / 2688.0
        want = reference.quantize(w0, g0)
        outs = [_poisoned_like(want) for _ in sets]                # preallocated outputs for the launch-only provider
        flag = torch.zeros(1, dtype=torch.int32, device="cuda")
        prealloc_sets = [(w, o) for (w,), o in zip(sets, outs)]
        providers = (
            ("lynn kernel launch (preallocated output, no sync)",
             lambda w, o: launch_quantize(w, g0, "modelopt", o, flag)[0], True),
            ("lynn quantize(w, g) eager (kernel + NaN-check sync)", lambda w: quantize_triton(w, g0), False),
            ("lynn quantize(w) eager (amax pass + kernel)", quantize, False),
            ("torch eager (reference)", lambda w: reference.quantize(w, g0), False),
        )
        checks = {}
        for provider, fn, prealloc in providers:                  # validate every provider before timing any
            got = fn(*prealloc_sets[0]) if prealloc else fn(w0)
            if provider.startswith("lynn quantize(w) eager"):
                ref_q = reference.quantize(w0)
            else:
                ref_q = want
            mism = compare(got.codes, ref_q.codes, exact=True).mismatches + \
                compare(got.scales.view(torch.uint8), ref_q.scales.view(torch.uint8), exact=True).mismatches
            check = {"mismatches": mism, "passed": mism == 0}     # codes + scale bytes that differ
            if mism:
                raise AssertionError(f"{provider}: {mism} codes/scales differ from the reference; not timing it")
            checks[provider] = check
        for provider, fn, prealloc in providers:
            check = checks[provider]
            med, p20, p80 = time_fn(rotating(fn, prealloc_sets if prealloc else sets))
            rows.append(derive(Result("nvfp4.quantize", provider, label, _dims(shape), med, p20, p80,
                                      bytes=nbytes, ceiling="copy_gbps", validation=check,
                                      note=f"{len(sets)} rotating input sets; bytes = one read of w + codes + "
                                           f"scales (the amax pass reads w again, uncounted)"), ceilings))
        sets = outs = prealloc_sets = None
        torch.cuda.empty_cache()
    return rows


__all__ = ["bench_dequantize", "bench_quantize"]
