"""``lynn check`` rows for the attention family: each kernel against its fp32 reference on small cases.

Metrics come from :func:`lynn_kernels.metrics.compare` against the reference run on fp32 copies of the inputs;
the baseline is that same result rounded to the input dtype, so ``err_ratio`` about 1 means "as accurate as rounding
the exact answer once" (bf16 tensor-core products of the probabilities add a little on the GPU).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import torch

from .. import runtime
from ..metrics import Case, compare
from . import decode_attention, flash_attention, qk_norm_rope, reference
from .spec import paged_slots

#: Pass marks, from the measured errors: a 16-bit output within 2x the error of one rounding to its dtype (H200 at
#: most 1.17, the bf16 products of the probabilities; interpreter 1.0), an fp32 one within rel_l2 1e-6 (H200 1.4e-7
#: prefill, 5.1e-8 rope; interpreter 1.4e-7, 5.5e-8).
CHECK_MAX_ERR_RATIO = 2.0
CHECK_MAX_REL_L2_FP32 = 1e-6

#: The looser marks notebook 04 prints with its committed output (cosine and 4x one rounding); `lynn check` and the
#: tests use the measured bounds above.
MIN_COSINE = 0.9999
MAX_ERR_RATIO = 4.0


#: The op names this family's rows carry, as the table prints them (``lynn check`` accepts them before running).
OPS = ("attention.prefill", "attention.decode", "attention.qk_norm_rope")


def _row(op: str, case: str, got: torch.Tensor, want32: torch.Tensor) -> dict:
    baseline = want32.to(got.dtype) if got.dtype != torch.float32 else None
    m = compare(got, want32, baseline=baseline)
    ok = m.err_ratio <= CHECK_MAX_ERR_RATIO if baseline is not None else m.rel_l2 <= CHECK_MAX_REL_L2_FP32
    return {"op": op, "case": case, "metrics": m, "passed": bool(ok)}


_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _f32(*ts):
    return [None if t is None else (t.float() if t.is_floating_point() else t) for t in ts]


def _randn(gen: torch.Generator, *shape, dtype=torch.bfloat16, scale=1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * scale).to(dtype).to(runtime.DEVICE)


def _prefill_varlen(dtype: torch.dtype, case: str, gen: torch.Generator) -> list[dict]:
    """Varlen 1 / 63 / 65 tokens, GQA 4, d 64, gate."""
    cu = torch.tensor([0, 1, 64, 129], dtype=torch.int32, device=runtime.DEVICE)
    q, k, v, g = (_randn(gen, 129, 4, 64, dtype=dtype), _randn(gen, 129, 1, 64, dtype=dtype),
                  _randn(gen, 129, 1, 64, dtype=dtype), _randn(gen, 129, 4, 64, dtype=dtype))
    want = reference.flash_attention(*_f32(q, k, v), gate=g.float(), cu_seqlens=cu)
    return [_row("attention.prefill", case, flash_attention(q, k, v, gate=g, cu_seqlens=cu), want)]


def _prefill_chunked(case: str, gen: torch.Generator) -> list[dict]:
    """Chunked prefill with prefixes 17 / 0, d 128."""
    dev = runtime.DEVICE
    prefix = torch.tensor([17, 0], dtype=torch.int32, device=dev)
    cu = torch.tensor([0, 40, 73], dtype=torch.int32, device=dev)
    q, k, v = _randn(gen, 73, 2, 128), _randn(gen, 90, 2, 128), _randn(gen, 90, 2, 128)
    want = reference.flash_attention(*_f32(q, k, v), cu_seqlens=cu, prefix_lens=prefix)
    return [_row("attention.prefill", case, flash_attention(q, k, v, cu_seqlens=cu, prefix_lens=prefix), want)]


def _decode_inputs(gen: torch.Generator):
    """Lengths 0 / 1 / 100 / 300, GQA 8, d 256, a gate: the contiguous cache and the reference answer."""
    lens = torch.tensor([0, 1, 100, 300], dtype=torch.int32, device=runtime.DEVICE)
    q, g = _randn(gen, 4, 16, 256), _randn(gen, 4, 16, 256)
    kc, vc = _randn(gen, 4, 320, 2, 256), _randn(gen, 4, 320, 2, 256)
    want = reference.decode_attention(*_f32(q, kc, vc), lens, gate=g.float())
    return lens, q, g, kc, vc, want


def _decode_contiguous(case: str, inputs) -> list[dict]:
    lens, q, g, kc, vc, want = inputs
    return [_row("attention.decode", case, decode_attention(q, kc, vc, lens, gate=g, num_splits=3), want)]


def _decode_paged(case: str, inputs, gen: torch.Generator) -> list[dict]:
    """The same cache in pages of 16, through a shuffled block table."""
    dev = runtime.DEVICE
    lens, q, g, kc, vc, want = inputs
    table = torch.randperm(4 * 20, generator=gen).view(4, 20).to(torch.int32).to(dev)
    kp, vp = (torch.empty((80, 16, 2, 256), dtype=torch.bfloat16, device=dev) for _ in range(2))
    seq = torch.arange(4, device=dev).repeat_interleave(320)
    slots = paged_slots(table, seq, torch.arange(320, device=dev).repeat(4), 16)
    kp.view(-1, 2, 256)[slots] = kc.reshape(-1, 2, 256)
    vp.view(-1, 2, 256)[slots] = vc.reshape(-1, 2, 256)
    return [_row("attention.decode", case, decode_attention(q, kp, vp, lens, table, gate=g, num_splits=3), want)]


def _rope_inputs(dtype: torch.dtype, gen: torch.Generator):
    """Qwen3-Next's shape: 16 / 2 heads, d 256, their norm weights and five positions."""
    q, k = _randn(gen, 5, 16, 256, dtype=dtype, scale=3.0), _randn(gen, 5, 2, 256, dtype=dtype, scale=3.0)
    qw, kw = _randn(gen, 256, dtype=torch.float32, scale=0.1), _randn(gen, 256, dtype=torch.float32, scale=0.1)
    pos = torch.tensor([0, 1, 1000, 40000, 262143], device=runtime.DEVICE)
    return q, k, qw, kw, pos


def _rope(i: int, case: str, inputs) -> list[dict]:
    """Output ``i`` (0: q, 1: k) of the fused q/k norm + partial RoPE (in-kernel cos/sin, rotary 64)."""
    q, k, qw, kw, pos = inputs
    got = qk_norm_rope(q, k, qw, kw, pos, rotary_dim=64, rope_theta=1e7)
    want = reference.qk_norm_rope(q.float(), k.float(), qw, kw, pos, rotary_dim=64, rope_theta=1e7)
    return [_row("attention.qk_norm_rope", case, got[i], want[i])]


def cases() -> Iterator[Case]:
    """The family's check matrix, each case named before it runs (inputs drawn in order from one seeded generator;
    inputs that cases share by the first of them to run)."""
    gen = torch.Generator().manual_seed(0)

    # prefill: varlen 1 / 63 / 65 tokens, GQA 4, d 64, gate; then chunked prefill with prefixes, d 128
    for dtype in (torch.bfloat16, torch.float32):
        case = f"{_NAMES[dtype]} varlen 1/63/65 Hq4/Hkv1 d64 gate"
        yield Case("attention.prefill", case, lambda d=dtype, c=case: _prefill_varlen(d, c, gen))
    case = "bf16 chunked prefix 17/0 Hq2/Hkv2 d128"
    yield Case("attention.prefill", case, lambda c=case: _prefill_chunked(c, gen))

    # decode: lengths 0 / 1 / 100 / 300, GQA 8, d 256, contiguous and paged (page 16), gate, 3 splits
    decode = functools.cache(lambda: _decode_inputs(gen))
    case = "bf16 contiguous len 0/1/100/300 Hq16/Hkv2 d256 gate 3 splits"
    yield Case("attention.decode", case, lambda c=case: _decode_contiguous(c, decode()))
    case = "bf16 paged(16) same cache, 3 splits"
    yield Case("attention.decode", case, lambda c=case: _decode_paged(c, decode(), gen))

    # fused q/k norm + partial RoPE (in-kernel cos/sin), Qwen3-Next shape: 16/2 heads, d 256, rotary 64; q and k
    # are two cases of one launch (each runs it)
    for dtype in (torch.bfloat16, torch.float32):
        rope = functools.cache(lambda d=dtype: _rope_inputs(d, gen))
        for i, which in enumerate(("q", "k")):
            case = f"{_NAMES[dtype]} {which} 16/2 heads d256 rot64"
            yield Case("attention.qk_norm_rope", case, lambda i=i, c=case, r=rope: _rope(i, c, r()))


def iter_rows() -> Iterator[dict]:
    for case in cases():
        yield from case.run()


def check_attention() -> list[dict]:
    """The family's ``lynn check`` rows as a list (:func:`iter_rows` yields each as it finishes)."""
    return list(iter_rows())


__all__ = ["check_attention", "cases"]
