"""``lynn check`` rows for the MoE family: routing and align exactly, the experts and the block against the fp32
reference, on small awkward cases (experts with no tokens, every token on one expert, E not a power of two, top-k 1,
the decode and the prefill paths, every prefill BLOCK_M), NVFP4 experts with one global scale, one per expert or (gate
and up apart) one per row of w13, float expert weights (the unquantised baseline through the same kernels), the
experts in the packed layout (``pack_experts``; zero and negative block scales), the block with and without a shared
expert of either kind, and the packed block with the shared expert as expert E of the stacks (decode in three
launches), its RMSNorm folded into the router's launch.

Rows are ``{"op", "case", "metrics": Metrics, "passed": bool}``; ``err_ratio`` is the kernel's error over the error
of the exact answer rounded to x's dtype (about 1: as good as a 16-bit output can be). The bounds are the tests':
fp32 x to summation order; 16-bit x within a rounding of the reference in x's dtype and, for the experts and the
NVFP4 block, closer to the exact answer than a plain computation in x's dtype. The cases are the tables below;
tests/test_moe*.py sweep them too.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from .. import runtime
from ..metrics import Case, compare
from ..nvfp4 import NVFP4Tensor
from ..nvfp4 import reference as nvfp4_reference
from .packed import SharedExpert, pack_experts, shared_slot
from .spec import fuse_w13, stack_w13

#: The op names this family's rows carry, as the table prints them (``lynn check`` accepts them before running).
OPS = ("moe.route", "moe.align", "moe.moe_experts", "moe.moe_block", "moe.norm_moe_block")

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
_NAMES = {BF16: "bf16", FP16: "fp16", FP32: "fp32"}

#: ``route``: (M, E, top_k, logits dtype, renormalize). Qwen3.5's (256, top-8) and Qwen3-Next's (512, top-10)
#: widths, E not a power of two, top-1.
ROUTES = ((33, 4, 1, FP32, False), (33, 4, 2, BF16, True), (65, 60, 2, FP32, True), (65, 60, 8, BF16, False),
          (65, 60, 10, FP32, False), (5, 7, 1, BF16, True), (3, 256, 8, BF16, True), (17, 256, 8, FP32, False),
          (1, 512, 10, BF16, False), (5, 512, 10, FP32, True))

#: ``align``: (M, top_k, E, block_m, the experts ids are drawn from; None: all). The one-program kernel (up to 128
#: slots under the interpreter) and the three-kernel path (several chunks), empty and crowded experts.
ALIGNS = ((1, 8, 256, 16, None), (1, 10, 512, 64, None), (7, 1, 5, 16, None), (16, 8, 60, 16, None),
          (13, 4, 8, 32, (0, 1, 2, 4, 5, 6, 7)), (40, 2, 6, 16, (5,)), (37, 8, 60, 16, None),
          (150, 2, 7, 64, (0, 3, 6)), (24, 10, 512, 32, None))

#: ``moe_experts`` on NVFP4 experts: (M, top_k, E, H, I, global scales "g1" (one) or "gE" (one per expert), the
#: experts ids are drawn from (None: top_k distinct of all), x dtype). Both paths and the boundary between them
#: (M = 16 | 17), the prefill BLOCK_Ms up to 64 (16, 64), H and I multiples of 16 but not of 64 (80, 48).
EXPERTS = ((1, 1, 7, 80, 48, "g1", None, FP32), (5, 8, 16, 64, 32, "gE", None, BF16),
           (16, 3, 7, 80, 48, "gE", None, FP32), (17, 3, 7, 80, 48, "g1", None, BF16),
           (33, 2, 6, 64, 32, "gE", (4,), FP32), (40, 4, 6, 128, 64, "gE", (0, 2, 3, 5), BF16),
           (64, 1, 5, 64, 128, "gE", (1, 3), FP32), (100, 2, 4, 80, 48, "g1", None, BF16))

#: ``moe_experts`` on float weights of x's dtype: (M, top_k, E, H, I, experts drawn from, dtype).
FLOAT_EXPERTS = ((1, 2, 4, 64, 32, None, FP32), (3, 3, 7, 80, 48, None, BF16), (40, 2, 6, 80, 48, (0, 2, 5), BF16),
                 (64, 2, 3, 64, 32, None, FP32), (20, 2, 5, 64, 32, None, FP16))

#: ``moe_experts`` on packed stacks (the reference reads the checkpoint weights): (M, top_k, E, H, I, global scales
#: ("per-row": w13 from gate / up shards with their own), experts drawn from, zero and negative block scales, x
#: dtype). The packed decode kernels (the down kernel takes a token's slots in a power of two and the rest: top_k
#: 3 = 2 + 1, 7 = 4 + 3 with a masked lane) and the prefill ones on packed tiles; H / I of 80 / 48 leave a partial
#: chunk of 128.
PACKED_EXPERTS = ((1, 3, 5, 80, 48, "per-row", None, False, BF16), (2, 7, 7, 80, 48, "g1", None, False, FP32),
                  (3, 2, 6, 128, 64, "gE", (4,), True, BF16), (40, 4, 6, 128, 64, "per-row", (0, 2, 3, 5), False, FP32),
                  (40, 2, 5, 80, 48, "gE", None, True, BF16))

#: ``moe_block`` (E 7, top-2, I 48, a shared expert of intermediate 32): (x shape, routed experts "nvfp4" or
#: "float", shared expert (None, "nvfp4", "float"), dtype, renormalize). Each FFN of one kind, the two not
#: necessarily of the same.
BLOCKS = (((1, 3, 80), "nvfp4", "nvfp4", BF16, False), ((2, 9, 80), "nvfp4", None, FP32, False),
          ((2, 9, 80), "nvfp4", "nvfp4", BF16, False), ((1, 3, 80), "float", "float", BF16, True),
          ((2, 9, 80), "float", None, FP32, True), ((1, 3, 80), "float", "nvfp4", FP32, True),
          ((2, 9, 80), "nvfp4", "float", BF16, True))

#: The shape of the per-shard, packed and norm block cases (experts, top-k, hidden, intermediate).
E, K, H, I = 10, 3, 64, 32

#: up's global scale over gate's in per-shard weights: not a power of two, so no exponent shift could hide a merged
#: scale.
SHARD_RATIO = 2.7


def _gen(label: str) -> torch.Generator:
    """A generator seeded by the case's label: a case draws the same inputs alone as in the whole matrix."""
    return torch.Generator().manual_seed(zlib.crc32(label.encode()))


def _path(M: int) -> str:
    return "decode" if M <= 16 else "prefill"


def _randn(shape, gen: torch.Generator, scale: float = 1.0, dtype=FP32) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * scale).to(dtype).to(runtime.DEVICE)


def _nvfp4(shape, gen: torch.Generator, scale: float, per_expert: bool = False) -> NVFP4Tensor:
    """A Gaussian NVFP4 weight, with one global scale per expert (the leading dim) when ``per_expert``."""
    w = _randn(shape, gen, scale)
    g = w.abs().amax(dim=tuple(range(1, w.dim()))) / 2688 if per_expert else None
    return nvfp4_reference.quantize(w, global_scale=g)


def _shards(E: int, H: int, I: int, gen: torch.Generator):
    """Per-expert gate / up ``[I, H]`` NVFP4 weights, each with its own global scale, up's :data:`SHARD_RATIO` times
    gate's (and the up weights that much larger)."""
    gates, ups = [], []
    for _ in range(E):
        w = _randn((2, I, H), gen, 0.2)
        g = w[0].abs().amax() / 2688
        gates.append(nvfp4_reference.quantize(w[0], global_scale=g))
        ups.append(nvfp4_reference.quantize(w[1] * SHARD_RATIO, global_scale=g * SHARD_RATIO))
    return gates, ups


def _experts_weights(E: int, H: int, I: int, gen: torch.Generator, scales: str = "gE"):
    """NVFP4 ``w13 [E, 2I, H]`` and ``w2 [E, H, I]`` with global scales ``"g1"``, ``"gE"`` or ``"per-row"`` (w13 from
    :func:`_shards` by ``stack_w13``, w2 per expert); w2 scaled so that the output has about x's magnitude."""
    w13 = stack_w13(*_shards(E, H, I, gen)) if scales == "per-row" else _nvfp4((E, 2 * I, H), gen, 0.2, scales == "gE")
    return w13, _nvfp4((E, H, I), gen, 0.5 / I ** 0.5, scales != "g1")


def _float_weights(E: int, H: int, I: int, dtype, gen: torch.Generator):
    """Float ``w13`` and ``w2`` in ``dtype``, scaled as :func:`_experts_weights`."""
    return _randn((E, 2 * I, H), gen, 0.2, dtype), _randn((E, H, I), gen, 0.5 / I ** 0.5, dtype)


def _shared(kind: str | None, H: int, Is: int, gen: torch.Generator, dtype=FP32, gate_dtype=FP32):
    """A shared expert of intermediate ``Is``: NVFP4 (``"nvfp4"``; ``"per-row"``: w13 from gate / up with their own
    global scales, ``fuse_w13``), float in ``dtype`` (``"float"``), or none."""
    if kind is None:
        return None
    if kind == "float":
        s13, s2 = (w[0] for w in _float_weights(1, H, Is, dtype, gen))
    elif kind == "per-row":
        (gate,), (up,) = _shards(1, H, Is, gen)
        s13, s2 = fuse_w13(gate, up), _nvfp4((H, Is), gen, 0.5 / Is ** 0.5)
    else:
        s13, s2 = _nvfp4((2 * Is, H), gen, 0.2), _nvfp4((H, Is), gen, 0.5 / Is ** 0.5)
    return SharedExpert(s13, s2, _randn((1, H), gen, 0.1, gate_dtype))


def routing(M: int, top_k: int, E: int, gen: torch.Generator, experts=None):
    """fp32 weights (rows sum to 1) and int32 ids: ``top_k`` distinct experts per token, or drawn from ``experts``
    with repetition (to leave experts without tokens, or to pile every token onto one)."""
    if experts is None:
        ids = torch.rand(M, E, generator=gen).argsort(dim=-1)[:, :top_k]
    else:
        pool = torch.tensor(experts)
        ids = pool[torch.randint(0, len(pool), (M, top_k), generator=gen)]
    weights = torch.rand(M, top_k, generator=gen) + 0.1
    weights = weights / weights.sum(-1, keepdim=True)
    return weights.to(runtime.DEVICE), ids.to(torch.int32).to(runtime.DEVICE)


def _odd_blocks(w: NVFP4Tensor, gen: torch.Generator) -> NVFP4Tensor:
    """``w`` with about one block scale in eight set to zero and one in eight negated (E4M3 allows both; no quantiser
    writes them): the packing zeroes a zero-scale block's codes and moves a negative scale's sign into the codes."""
    s = w.scales.view(torch.uint8).clone()
    r = torch.randint(0, 8, tuple(s.shape), generator=gen).to(s.device)
    s = torch.where(r == 0, torch.zeros_like(s), torch.where(r == 1, s | 0x80, s))
    return NVFP4Tensor(w.codes, s.view(w.scales.dtype), w.global_scale)


def _dense(w, dtype):
    """An expert weight as a ``dtype`` tensor: NVFP4 dequantised, a float one cast."""
    return nvfp4_reference.dequantize(w, dtype) if isinstance(w, NVFP4Tensor) else w.to(dtype)


def _plain_experts(x, weights, ids, w13, w2) -> torch.Tensor:
    """The experts computed plainly in x's 16-bit dtype (as HF does in a bf16 / fp16 model), from the same
    dequantised (or float) weights."""
    dt = x.dtype
    out = torch.zeros(x.shape, dtype=dt, device=x.device)
    w13d, w2d = _dense(w13, dt), _dense(w2, dt)
    for e in range(w13d.shape[0]):
        t, j = torch.where(ids == e)
        if t.numel():
            gate, up = (x[t] @ w13d[e].t()).chunk(2, dim=-1)
            out.index_add_(0, t, (F.silu(gate) * up) @ w2d[e].t() * weights[t, j, None].to(dt))
    return out


def _plain_shared(x, shared: SharedExpert) -> torch.Tensor:
    """The shared expert computed plainly in x's 16-bit dtype."""
    dt = x.dtype
    gate, up = (x @ _dense(shared.w13, dt).t()).chunk(2, dim=-1)
    return torch.sigmoid(x @ shared.gate_weight.to(dt).t()) * ((F.silu(gate) * up) @ _dense(shared.w2, dt).t())


def _exact_experts(x, weights, ids, w13, w2) -> torch.Tensor:
    """The experts in fp32 on x's exact values (float weights widened)."""
    from . import reference

    w13, w2 = (w if isinstance(w, NVFP4Tensor) else w.float() for w in (w13, w2))
    return reference.moe_experts(x.float(), weights, ids, w13, w2)


def _close(m, dtype, rel_l2: float = 4e-3) -> bool:
    """fp32 x: rel_l2 below 1e-5 (the same sums in another order); 16-bit x: cosine above 0.9999 and rel_l2 below
    ``rel_l2`` (the kernels round ``h`` and the output to x's dtype)."""
    return m.rel_l2 < 1e-5 if dtype == FP32 else m.cosine > 0.9999 and m.rel_l2 < rel_l2


def _shaped(got: torch.Tensor, x: torch.Tensor) -> bool:
    """``got`` has x's dtype and shape."""
    return got.dtype == x.dtype and tuple(got.shape) == tuple(x.shape)


def _experts_row(case: str, got, x, weights, ids, w13, w2) -> dict:
    """The experts' output against the reference on ``w13``, ``w2`` (checkpoint or float weights); 16-bit x also
    closer to the exact answer than the plain computation."""
    from . import reference

    exact = _exact_experts(x, weights, ids, w13, w2)
    if x.dtype == FP32:
        m = compare(got, exact)
        return {"op": "moe.moe_experts", "case": case, "metrics": m,
                "passed": _shaped(got, x) and _close(m, FP32) and m.cosine > 0.99999}
    m = compare(got, exact, baseline=exact.to(x.dtype))
    rounded = compare(got, reference.moe_experts(x, weights, ids, w13, w2))
    plain = compare(got, exact, baseline=_plain_experts(x, weights, ids, w13, w2))
    return {"op": "moe.moe_experts", "case": case, "metrics": m,
            "passed": (_shaped(got, x) and _close(rounded, x.dtype) and m.cosine > 0.9999 and m.rel_l2 <= 5e-3
                       and m.err_ratio <= 2.0 and plain.err_ratio < 1.0)}


def _route(case: str, M: int, E: int, k: int, dtype, renormalize: bool) -> list[dict]:
    from . import reference, route

    logits = _randn((M, E), _gen(case), 2.0, dtype)
    w, ids = route(logits, k, renormalize)
    w_ref, ids_ref = reference.route(logits, k, renormalize)
    m = compare(w, w_ref)
    ok = (w.dtype == FP32 and ids.dtype == torch.int32 and torch.equal(ids, ids_ref) and m.max_abs <= 1e-6
          and bool(((w - w_ref).abs() <= 4e-6 * w_ref.abs() + 1e-8).all()))
    if renormalize:
        ok = ok and bool(((w.sum(-1) - 1).abs() <= 1e-6).all())
    return [{"op": "moe.route", "case": case, "metrics": m, "passed": ok}]


def _align(case: str, M: int, k: int, E: int, block_m: int, experts) -> list[dict]:
    from . import align, reference

    gen = _gen(case)
    pool = torch.arange(E) if experts is None else torch.tensor(experts)
    ids = pool[torch.randint(0, len(pool), (M, k), generator=gen)].to(torch.int32).to(runtime.DEVICE)
    got, want = align(ids, E, block_m), reference.align(ids, E, block_m)
    same = all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, want))
    return [{"op": "moe.align", "case": case, "metrics": compare(got[0].float(), want[0].float()), "passed": same}]


def _experts(case: str, M, k, E, H, I, scales, experts, dtype) -> list[dict]:
    """NVFP4 experts in the checkpoint layout."""
    from . import moe_experts

    gen = _gen(case)
    w13, w2 = _experts_weights(E, H, I, gen, scales)
    weights, ids = routing(M, k, E, gen, experts)
    x = _randn((M, H), gen, dtype=dtype)
    return [_experts_row(case, moe_experts(x, weights, ids, w13, w2), x, weights, ids, w13, w2)]


def _float_experts(case: str, M, k, E, H, I, experts, dtype) -> list[dict]:
    """Float weights: the same kernels, the tiles loaded as they are."""
    from . import moe_experts

    gen = _gen(case)
    w13, w2 = _float_weights(E, H, I, dtype, gen)
    weights, ids = routing(M, k, E, gen, experts)
    x = _randn((M, H), gen, dtype=dtype)
    return [_experts_row(case, moe_experts(x, weights, ids, w13, w2), x, weights, ids, w13, w2)]


def _packed_experts(case: str, M, k, E, H, I, scales, experts, odd, dtype) -> list[dict]:
    """Packed stacks against the reference on the checkpoint weights (a packing error cannot hide in both sides)."""
    from . import moe_experts

    gen = _gen(case)
    w13, w2 = _experts_weights(E, H, I, gen, scales)
    if odd:
        w13, w2 = _odd_blocks(w13, gen), _odd_blocks(w2, gen)
    p13, p2, _ = pack_experts(w13, w2)
    weights, ids = routing(M, k, E, gen, experts)
    x = _randn((M, H), gen, dtype=dtype)
    return [_experts_row(case, moe_experts(x, weights, ids, p13, p2), x, weights, ids, w13, w2)]


def _block(case: str, shape, routed: str, shared_kind, dtype, renormalize: bool) -> list[dict]:
    """The block (E 7, top-2): the fused router + routing launch and FMA kernels at decode, align and tl.dot at
    prefill; the NVFP4 block with 16-bit x also closer to the exact block (on the same routing) than a plain one."""
    from . import moe_block, reference

    gen, e, top_k, h, i = _gen(case), 7, 2, shape[-1], 48
    w13, w2 = _experts_weights(e, h, i, gen) if routed == "nvfp4" else _float_weights(e, h, i, dtype, gen)
    shared = _shared(shared_kind, h, 32, gen, dtype)
    router = _randn((e, h), gen, 0.3, dtype)
    x = _randn(shape, gen, dtype=dtype)
    got = moe_block(x, router, w13, w2, shared, top_k=top_k, renormalize=renormalize)
    m = compare(got, reference.moe_block(x, router, w13, w2, shared, top_k=top_k, renormalize=renormalize))
    ok = _shaped(got, x) and _close(m, dtype)
    if routed == "nvfp4" and dtype != FP32:
        x2 = x.reshape(-1, h)
        weights, ids = reference.route((x2.float() @ router.float().t()).to(dtype), top_k, renormalize)
        exact, plain = _exact_experts(x2, weights, ids, w13, w2), _plain_experts(x2, weights, ids, w13, w2)
        if shared is not None:
            exact, plain = exact + reference.shared_expert(x2, shared), plain + _plain_shared(x2, shared)
        ok = ok and compare(got.reshape(-1, h), exact, baseline=plain).err_ratio < 1.0
    return [{"op": "moe.moe_block", "case": case, "metrics": m, "passed": ok}]


def _block_per_shard(case: str, M: int) -> list[dict]:
    """Per-shard gate / up global scales, routed and shared, applied per row."""
    from . import moe_block, reference

    gen = _gen(case)
    w13, w2 = _experts_weights(E, H, I, gen, "per-row")
    shared = _shared("per-row", H, 48, gen, gate_dtype=BF16)
    router = _randn((E, H), gen, 0.1, BF16)
    x = _randn((M, H), gen, dtype=BF16)
    got = moe_block(x, router, w13, w2, shared, top_k=K)
    m = compare(got, reference.moe_block(x, router, w13, w2, shared, top_k=K))
    return [{"op": "moe.moe_block", "case": case, "metrics": m, "passed": _shaped(got, x) and _close(m, BF16, 5e-3)}]


def _packed_block_weights(gen: torch.Generator) -> dict:
    """The packed block's experts, checkpoint and packed (``pack_experts``), a shared expert of the routed size as
    expert E, and the router."""
    w13, w2 = _experts_weights(E, H, I, gen)
    shared = _shared("nvfp4", H, I, gen, gate_dtype=BF16)
    p13, p2, pshared = pack_experts(w13, w2, shared)
    return {"w13": w13, "w2": w2, "shared": shared, "p13": p13, "p2": p2, "pshared": pshared,
            "router": _randn((E, H), gen, 0.1, BF16)}


def _block_packed(case: str, M: int) -> list[dict]:
    """The packed experts: decode in three launches, the shared expert a routed slot."""
    from . import moe_block, reference

    gen = _gen(case)
    b = _packed_block_weights(gen)
    x = _randn((M, H), gen, dtype=BF16)
    got = moe_block(x, b["router"], b["p13"], b["p2"], b["pshared"], top_k=K)
    m = compare(got, reference.moe_block(x, b["router"], b["w13"], b["w2"], b["shared"], top_k=K))   # checkpoint
    return [{"op": "moe.moe_block", "case": case, "metrics": m,
             "passed": _shaped(got, x) and _close(m, BF16, 5e-3) and shared_slot(b["p13"], b["p2"], b["pshared"])}]


def _norm_block(case: str, M: int) -> list[dict]:
    """The block's RMSNorm (with the residual add) in the router's launch, on the three-launch decode path."""
    from . import norm_moe_block, reference

    gen = _gen(case)
    b = _packed_block_weights(gen)
    nw = _randn(H, gen, 0.2, BF16)
    x, res = _randn((M, H), gen, dtype=BF16), _randn((M, H), gen, 3.0, BF16)
    y, xn, h = norm_moe_block(x, nw, b["router"], b["p13"], b["p2"], b["pshared"], top_k=K, residual=res)
    ry, rxn, rh = reference.norm_moe_block(x, nw, b["router"], b["w13"], b["w2"], b["shared"], top_k=K, residual=res)
    m = compare(y, ry)
    xn_err = ((xn.float() - rxn.float()).abs() / rxn.float().abs().clamp_min(1e-30)).max().item()
    return [{"op": "moe.norm_moe_block", "case": case, "metrics": m,
             "passed": _shaped(y, x) and _close(m, BF16, 5e-3) and torch.equal(h, rh) and xn_err <= 2 ** -7}]


def _label(*parts: str) -> str:
    return " ".join(p for p in parts if p)


def _drawn_from(experts) -> str:
    return "" if experts is None else f"ids in {{{','.join(map(str, experts))}}}"


def cases() -> Iterator[Case]:
    """The family's check matrix, each case named before it runs."""
    for M, e, k, dtype, renorm in ROUTES:
        case = _label(f"M{M} E{e} top{k} {_NAMES[dtype]} logits", "" if renorm else "raw")
        yield Case("moe.route", case, lambda c=case, s=(M, e, k, dtype, renorm): _route(c, *s))
    for M, k, e, bm, experts in ALIGNS:
        case = _label(f"M{M} top{k} E{e} block {bm}", _drawn_from(experts))
        yield Case("moe.align", case, lambda c=case, s=(M, k, e, bm, experts): _align(c, *s))
    for M, k, e, h, i, scales, experts, dtype in EXPERTS:
        case = _label(f"M{M} E{e} top{k} H{h} I{i} {scales}", _drawn_from(experts), f"{_NAMES[dtype]} ({_path(M)})")
        yield Case("moe.moe_experts", case, lambda c=case, s=(M, k, e, h, i, scales, experts, dtype): _experts(c, *s))
    for M, k, e, h, i, experts, dtype in FLOAT_EXPERTS:
        case = _label(f"M{M} E{e} top{k} H{h} I{i} {_NAMES[dtype]} weights", _drawn_from(experts), f"({_path(M)})")
        yield Case("moe.moe_experts", case, lambda c=case, s=(M, k, e, h, i, experts, dtype): _float_experts(c, *s))
    for M, k, e, h, i, scales, experts, odd, dtype in PACKED_EXPERTS:
        case = _label(f"M{M} E{e} top{k} H{h} I{i} packed {scales}", _drawn_from(experts),
                      "odd block scales" if odd else "", f"{_NAMES[dtype]} ({_path(M)})")
        yield Case("moe.moe_experts", case,
                   lambda c=case, s=(M, k, e, h, i, scales, experts, odd, dtype): _packed_experts(c, *s))
    for shape, routed, shared, dtype, renorm in BLOCKS:
        case = _label(f"x {'x'.join(map(str, shape))} {routed} experts + {shared or 'no'} shared {_NAMES[dtype]}",
                      "" if renorm else "raw", f"({_path(shape[0] * shape[1])})")
        yield Case("moe.moe_block", case, lambda c=case, s=(shape, routed, shared, dtype, renorm): _block(c, *s))
    for M in (3, 33):          # per-shard gate / up global scales, routed and shared, applied per row
        case = f"M{M} E{E} top{K} per-shard gate/up scales + shared ({_path(M)})"
        yield Case("moe.moe_block", case, lambda M=M, c=case: _block_per_shard(c, M))
    # packed experts (pack_experts), the shared expert of the routed size as expert E: decode in three launches
    for M in (1, 3, 33):
        path = "decode, shared expert as a routed slot" if M <= 16 else "prefill"
        case = f"M{M} E{E} top{K} packed experts + shared ({path})"
        yield Case("moe.moe_block", case, lambda M=M, c=case: _block_packed(c, M))
    # the block's RMSNorm (with the residual add) in the router's launch, on the three-launch decode path
    for M in (1, 2):
        case = f"M{M} E{E} top{K} packed experts + shared, norm in the router"
        yield Case("moe.norm_moe_block", case, lambda M=M, c=case: _norm_block(c, M))


def iter_rows() -> Iterator[dict]:
    for case in cases():
        yield from case.run()


def check_moe() -> list[dict]:
    """The family's ``lynn check`` rows as a list (:func:`iter_rows` yields each as it finishes)."""
    return list(iter_rows())


__all__ = ["check_moe", "cases", "routing", "ROUTES", "ALIGNS", "EXPERTS", "FLOAT_EXPERTS", "PACKED_EXPERTS", "BLOCKS"]
