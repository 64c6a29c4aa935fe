"""``lynn check`` rows for the attention family: each kernel against its fp32 reference on small, awkward cases.

Metrics come from :func:`lynn_kernels.metrics.compare` against the exact answer, the reference run on fp32 copies of
the inputs; the baseline is that answer rounded to the input dtype (which is what the reference gives on the inputs
themselves: it computes in fp32 and rounds once), so ``err_ratio`` about 1 means "as accurate as rounding the exact
answer once" (bf16 tensor-core products of the probabilities add a little on the GPU). The cases are the tables
:data:`PREFILL_SHAPES`, :data:`DECODE_SHAPES` and :data:`ROPE_SHAPES`; tests/test_attention.py sweeps them too.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator

import torch

from .. import runtime
from ..metrics import Case, bit_mismatches, compare
from . import decode_attention, flash_attention, qk_norm_rope, reference
from .spec import paged_slots

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

#: Pass marks, from the measured errors: a 16-bit output within 1.05x (interpreter: fp32 math, one rounding,
#: measured 1.0) or 2x (compiled: H200 at most 1.17, the bf16 products of the probabilities) the error of one
#: rounding to its dtype, and under the interpreter every element within one step of that rounding; an fp32 one
#: within rel_l2 1e-6 (H200 1.4e-7 prefill, 5.1e-8 rope; interpreter 1.4e-7, 5.5e-8) and 2e-5 of each element.
CHECK_MAX_ERR_RATIO = 1.05 if runtime.INTERPRET else 2.0
CHECK_MAX_REL_L2_FP32 = 1e-6

#: The looser marks notebook 04 prints with its committed output (cosine and 4x one rounding); `lynn check` and the
#: tests use the measured bounds above.
MIN_COSINE = 0.9999
MAX_ERR_RATIO = 4.0


#: The op names this family's rows carry, as the table prints them (``lynn check`` accepts them before running).
OPS = ("attention.prefill", "attention.decode", "attention.decode paged", "attention.qk_norm_rope",
       "attention.qk_norm_rope k")

#: Prefill cases: (dtype, sequence lengths, prefix lengths or None, Hq, Hkv, head dim, gate, causal). One sequence
#: without a prefix runs without cu_seqlens.
PREFILL_SHAPES = [
    (FP32, [1], None, 2, 2, 32, False, True),
    (BF16, [63], None, 4, 1, 16, True, True),
    (FP32, [65], None, 8, 1, 16, True, True),
    (FP16, [65], None, 2, 2, 32, False, True),
    (BF16, [1000], None, 2, 1, 16, True, True),
    (BF16, [33], None, 4, 1, 64, True, True),
    (FP32, [17], None, 2, 1, 128, True, True),
    (BF16, [9], None, 8, 1, 256, True, True),
    (FP32, [1, 63, 0, 65, 17], None, 4, 1, 16, True, True),
    (BF16, [20, 7], None, 6, 2, 32, True, True),                 # a group of 3: not a power of two
    (FP32, [9, 1, 70, 3], [0, 5, 64, 130], 4, 1, 32, True, True),
    (BF16, [40], [100], 2, 1, 32, False, True),
    (BF16, [40, 33], [17, 0], 2, 2, 128, False, True),
    (FP32, [1, 63, 65], None, 4, 1, 16, True, False),
    (BF16, [10, 3], [6, 0], 2, 2, 16, False, False),
]

#: Decode cases: (dtype, cached lengths, Hq, Hkv, head dim, cache length, page, num_splits (None: the default), gate);
#: each runs on a contiguous cache and on the same tokens in a shuffled paged one.
DECODE_SHAPES = [
    (FP32, [0, 1, 63, 65, 200], 4, 1, 32, 208, 16, 3, True),
    (BF16, [0, 1, 100], 2, 2, 16, 112, 16, 1, False),
    (FP16, [1, 129], 8, 1, 16, 160, 32, 4, True),
    (BF16, [37, 64], 4, 1, 64, 64, 16, 2, False),
    (FP32, [90], 4, 2, 128, 96, 32, 5, True),
    (BF16, [70], 16, 2, 256, 80, 16, 3, True),                   # Qwen3-Next's heads; a partial and an empty split
    (BF16, [1000, 5], 4, 1, 16, 1024, 64, None, False),
]

#: Fused q/k norm + partial RoPE cases: (dtype, tokens, Hq, Hkv, head dim, rotary dim, cos / sin tables (else
#: rope_theta 1e7 in the kernel)).
ROPE_SHAPES = [
    (FP32, 1, 2, 1, 32, 8, True),
    (BF16, 63, 4, 2, 64, 16, False),
    (FP16, 65, 2, 2, 16, 16, False),                             # the whole head rotated
    (BF16, 5, 16, 2, 256, 64, True),                             # Qwen3-Next's shape
    (FP32, 5, 16, 2, 256, 64, False),
    (FP32, 7, 4, 1, 128, 32, True),
]

_NAMES = {BF16: "bf16", FP16: "fp16", FP32: "fp32"}


def _seeded(label: str) -> torch.Generator:
    """A generator seeded from the case's label: a case draws the same inputs alone as in the whole matrix."""
    return torch.Generator().manual_seed(zlib.crc32(label.encode()))


def _randn(gen: torch.Generator, *shape, dtype=BF16, scale=1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * scale).to(dtype).to(runtime.DEVICE)


def _ints(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=runtime.DEVICE)


def _f32(*ts):
    return [None if t is None else t.float() for t in ts]


def _within(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float) -> bool:
    """Every element within ``rtol |want| + atol`` (NaN never is)."""
    return bool(torch.isclose(got.float(), want.float(), rtol=rtol, atol=atol).all())


def _row(op: str, case: str, got: torch.Tensor, exact: torch.Tensor, dtype: torch.dtype, ok: bool = True) -> dict:
    """``got``, from inputs of ``dtype``, against ``exact`` under the pass marks above (and ``ok``)."""
    if dtype == FP32:
        m = compare(got, exact)
        ok = ok and m.rel_l2 <= CHECK_MAX_REL_L2_FP32 and _within(got, exact, 2e-5, 2e-5)
    else:
        rounded = exact.to(dtype)
        m = compare(got, exact, baseline=rounded)
        ok = ok and m.err_ratio <= CHECK_MAX_ERR_RATIO and (not runtime.INTERPRET or _within(got, rounded, 2**-7, 1e-5))
    return {"op": op, "case": case, "metrics": m, "passed": bool(ok and got.dtype == dtype)}


def _prefill(case: str, dtype, lens, prefix, hq, hkv, d, gate, causal) -> list[dict]:
    gen = _seeded(case)
    t = sum(lens)
    nk = t + sum(prefix or [])
    q = _randn(gen, t, hq, d, dtype=dtype)
    k, v = _randn(gen, nk, hkv, d, dtype=dtype), _randn(gen, nk, hkv, d, dtype=dtype)
    g = _randn(gen, t, hq, d, dtype=dtype, scale=2.0) if gate else None
    cu = _ints([0, *torch.tensor(lens).cumsum(0).tolist()]) if len(lens) > 1 or prefix else None
    pre = _ints(prefix) if prefix else None
    got = flash_attention(q, k, v, causal=causal, gate=g, cu_seqlens=cu, prefix_lens=pre)
    exact = reference.flash_attention(*_f32(q, k, v), causal=causal, gate=_f32(g)[0], cu_seqlens=cu, prefix_lens=pre)
    return [_row("attention.prefill", case, got, exact, dtype)]


def _decode(case: str, dtype, lens, hq, hkv, d, s_max, page, splits, gate) -> list[dict]:
    """The contiguous cache against the exact answer (a sequence with no keys gives zeros), then the same tokens in
    a shuffled paged cache with a few blocks nobody uses (garbage): the same bits."""
    gen = _seeded(case)
    b, dev = len(lens), runtime.DEVICE
    q = _randn(gen, b, hq, d, dtype=dtype)
    kc, vc = _randn(gen, b, s_max, hkv, d, dtype=dtype), _randn(gen, b, s_max, hkv, d, dtype=dtype)
    g = _randn(gen, b, hq, d, dtype=dtype, scale=2.0) if gate else None
    seq_lens = _ints(lens)
    n_pages = s_max // page
    n_blocks = b * n_pages + 3
    table = torch.randperm(n_blocks, generator=gen)[: b * n_pages].view(b, n_pages).to(torch.int32).to(dev)
    kp, vp = _randn(gen, n_blocks, page, hkv, d, dtype=dtype), _randn(gen, n_blocks, page, hkv, d, dtype=dtype)
    slots = paged_slots(table, torch.arange(b, device=dev).repeat_interleave(s_max),
                        torch.arange(s_max, device=dev).repeat(b), page)
    kp.view(-1, hkv, d)[slots] = kc.reshape(-1, hkv, d)
    vp.view(-1, hkv, d)[slots] = vc.reshape(-1, hkv, d)

    got = decode_attention(q, kc, vc, seq_lens, gate=g, num_splits=splits)
    exact = reference.decode_attention(*_f32(q, kc, vc), seq_lens, gate=_f32(g)[0])
    empty_is_zero = bool((got[seq_lens == 0] == 0).all())
    paged = bit_mismatches(decode_attention(q, kp, vp, seq_lens, table, gate=g, num_splits=splits), got)
    return [_row("attention.decode", case, got, exact, dtype, empty_is_zero),
            {"op": "attention.decode paged", "case": case, "mismatches": paged, "passed": paged == 0}]


def _rope(case: str, dtype, t, hq, hkv, d, rot, tables) -> list[dict]:
    """q_out and k_out of one launch, each against the exact answer."""
    gen = _seeded(case)
    q, k = _randn(gen, t, hq, d, dtype=dtype, scale=3.0), _randn(gen, t, hkv, d, dtype=dtype, scale=0.5)
    qw, kw = _randn(gen, d, dtype=FP32, scale=0.2), _randn(gen, d, dtype=FP32, scale=0.2)
    pos = ((torch.arange(t) * 4099 + 3) % 262144).to(runtime.DEVICE)
    rope = {"rope_theta": 1e7}
    if tables:      # only as many rows as the positions reach
        cos, sin = reference.rope_cos_sin(torch.arange(int(pos.max()) + 1, device=runtime.DEVICE), rot, 1e7)
        rope = {"cos": cos.to(dtype), "sin": sin.to(dtype)}
    got = qk_norm_rope(q, k, qw, kw, pos, rotary_dim=rot, **rope)
    exact = reference.qk_norm_rope(q.float(), k.float(), qw, kw, pos, rotary_dim=rot,
                                   **{n: x.float() if torch.is_tensor(x) else x for n, x in rope.items()})
    return [_row("attention.qk_norm_rope", case, got[0], exact[0], dtype),
            _row("attention.qk_norm_rope k", case, got[1], exact[1], dtype)]


def _slashed(values) -> str:
    return "/".join(map(str, values))


def cases() -> Iterator[Case]:
    """The family's check matrix, each case named before it runs and drawing its inputs from a generator seeded by
    its label."""
    for shape in PREFILL_SHAPES:
        dtype, lens, prefix, hq, hkv, d, gate, causal = shape
        case = (f"{_NAMES[dtype]} T {_slashed(lens)}{f' prefix {_slashed(prefix)}' if prefix else ''} Hq{hq}/Hkv{hkv}"
                f" d{d}{' gate' if gate else ''}{'' if causal else ' non-causal'}")
        yield Case("attention.prefill", case, lambda c=case, s=shape: _prefill(c, *s))
    for shape in DECODE_SHAPES:
        dtype, lens, hq, hkv, d, _, page, splits, gate = shape
        case = (f"{_NAMES[dtype]} len {_slashed(lens)} Hq{hq}/Hkv{hkv} d{d} page {page}, "
                f"{splits or 'default'} split{'' if splits == 1 else 's'}{' gate' if gate else ''}")
        yield Case("attention.decode", case, lambda c=case, s=shape: _decode(c, *s))
    for shape in ROPE_SHAPES:
        dtype, t, hq, hkv, d, rot, tables = shape
        case = f"{_NAMES[dtype]} T{t} {hq}/{hkv} heads d{d} rot{rot} {'tables' if tables else 'theta'}"
        yield Case("attention.qk_norm_rope", case, lambda c=case, s=shape: _rope(c, *s))


def iter_rows() -> Iterator[dict]:
    for case in cases():
        yield from case.run()


def check_attention() -> list[dict]:
    """The family's ``lynn check`` rows as a list (:func:`iter_rows` yields each as it finishes)."""
    return list(iter_rows())


__all__ = ["check_attention", "cases"]
