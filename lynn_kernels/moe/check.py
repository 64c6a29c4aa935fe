"""``lynn check`` rows for the MoE family: routing and align exactly, the experts and the block against the fp32
reference, on small awkward cases (an expert with no tokens, E not a power of two, top-k 1, the decode and the
prefill paths), bf16 expert weights (the unquantised baseline through the same kernels), and NVFP4 experts whose
gate and up halves have their own global scales (per-shard, ``stack_w13`` / ``fuse_w13``), and the experts in the
packed layout with the shared expert as expert E of the stacks (``pack_experts``: decode in three launches).

Rows are ``{"op", "case", "metrics": Metrics, "passed": bool}``; ``err_ratio`` is the kernel's error over the error
of the exact answer rounded to bf16 (about 1: as good as a bf16 output can be).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .. import runtime
from ..metrics import compare
from ..nvfp4 import quantize
from .packed import SharedExpert, pack_experts, shared_slot
from .spec import fuse_w13, stack_w13

#: The op names this family's rows carry, as the table prints them (``lynn check`` accepts them before running).
OPS = ("moe.route", "moe.align", "moe.moe_experts", "moe.moe_block", "moe.norm_moe_block")


def _weights(E: int, H: int, I: int, gen: torch.Generator):
    dev = runtime.DEVICE

    def q(*shape):
        return quantize((torch.randn(shape, generator=gen) * 0.1).to(dev))

    return q(E, 2 * I, H), q(E, H, I)


def _per_shard_w13(E: int, H: int, I: int, gen: torch.Generator):
    """``w13`` from per-expert gate / up NVFP4 weights with their own global scales (up's 2.7x gate's)."""
    dev = runtime.DEVICE
    gates, ups = [], []
    for _ in range(E):
        w = (torch.randn(2, I, H, generator=gen) * 0.1).to(dev)
        g = w[0].abs().amax() / 2688
        gates.append(quantize(w[0], global_scale=g))
        ups.append(quantize(w[1] * 2.7, global_scale=g * 2.7))
    return stack_w13(gates, ups) if E > 1 else fuse_w13(gates[0], ups[0])


def iter_rows() -> Iterator[dict]:
    from . import align, moe_block, moe_experts, reference, route

    dev = runtime.DEVICE
    gen = torch.Generator().manual_seed(0)
    for E, k, M in ((60, 4, 37), (7, 1, 5), (256, 8, 3)):
        logits = torch.randn(M, E, generator=gen).to(torch.bfloat16).to(dev)
        w, ids = route(logits, k)
        w_ref, ids_ref = reference.route(logits, k)
        m = compare(w, w_ref)
        yield {"op": "moe.route", "case": f"M{M} E{E} top{k}", "metrics": m,
               "passed": torch.equal(ids, ids_ref) and m.max_abs <= 1e-6}
        got, want = align(ids, E, 16), reference.align(ids, E, 16)
        same = all(torch.equal(a, b) for a, b in zip(got, want))
        yield {"op": "moe.align", "case": f"M{M} E{E} top{k} block 16",
               "metrics": compare(got[0].float(), want[0].float()), "passed": same}

    for E, k, M, H, I in ((7, 2, 1, 64, 48), (12, 3, 40, 80, 32), (5, 1, 20, 64, 64)):
        w13, w2 = _weights(E, H, I, gen)
        x = torch.randn(M, H, generator=gen).to(torch.bfloat16).to(dev)
        ids = torch.stack([torch.randperm(E - 1, generator=gen)[:k] for _ in range(M)]).to(torch.int32).to(dev)
        weights = torch.softmax(torch.randn(M, k, generator=gen), -1).to(dev)    # expert E-1 gets no token
        want = reference.moe_experts(x.float(), weights, ids, w13, w2)       # x is bf16-exact: fp32 unrounded
        m = compare(moe_experts(x, weights, ids, w13, w2), want, baseline=want.to(x.dtype))
        path = "decode" if M <= 16 else "prefill"
        yield {"op": "moe.moe_experts", "case": f"M{M} E{E} top{k} H{H} I{I} ({path})", "metrics": m,
               "passed": m.cosine >= 0.9999 and m.rel_l2 <= 5e-3 and m.err_ratio <= 2.0}

    E, k, H, I = 10, 3, 64, 32
    w13, w2 = _weights(E, H, I, gen)
    sw13, sw2 = _weights(1, H, 48, gen)
    shared = SharedExpert(sw13[0], sw2[0], (torch.randn(1, H, generator=gen) * 0.1).to(torch.bfloat16).to(dev))
    router = (torch.randn(E, H, generator=gen) * 0.1).to(torch.bfloat16).to(dev)
    for M in (3, 33):          # decode (fused router + routing launch, FMA kernels) and prefill (align, tl.dot)
        x = torch.randn(M, H, generator=gen).to(torch.bfloat16).to(dev)
        want = reference.moe_block(x, router, w13, w2, shared, top_k=k)   # the routing needs bf16 logits
        m = compare(moe_block(x, router, w13, w2, shared, top_k=k), want)
        path = "decode" if M <= 16 else "prefill"
        yield {"op": "moe.moe_block", "case": f"M{M} E{E} top{k} + shared expert ({path})", "metrics": m,
               "passed": m.cosine >= 0.9999 and m.rel_l2 <= 5e-3}

    bf16 = torch.bfloat16
    for M in (3, 33):          # bf16 weights: the same kernels, the tiles loaded as they are
        w13b = (torch.randn(E, 2 * I, H, generator=gen) * 0.1).to(bf16).to(dev)
        w2b = (torch.randn(E, H, I, generator=gen) * 0.1).to(bf16).to(dev)
        x = torch.randn(M, H, generator=gen).to(bf16).to(dev)
        ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(M)]).to(torch.int32).to(dev)
        weights = torch.softmax(torch.randn(M, k, generator=gen), -1).to(dev)
        want = reference.moe_experts(x.float(), weights, ids, w13b.float(), w2b.float())
        m = compare(moe_experts(x, weights, ids, w13b, w2b), want, baseline=want.to(bf16))
        path = "decode" if M <= 16 else "prefill"
        yield {"op": "moe.moe_experts", "case": f"M{M} E{E} top{k} H{H} I{I} bf16 weights ({path})",
               "metrics": m, "passed": m.cosine >= 0.9999 and m.rel_l2 <= 5e-3 and m.err_ratio <= 2.0}

    w13s, s13 = _per_shard_w13(E, H, I, gen), _per_shard_w13(1, H, 48, gen)
    shared_s = SharedExpert(s13, sw2[0], shared.gate_weight)
    for M in (3, 33):          # per-shard gate / up global scales, routed and shared, applied per row
        x = torch.randn(M, H, generator=gen).to(bf16).to(dev)
        want = reference.moe_block(x, router, w13s, w2, shared_s, top_k=k)
        m = compare(moe_block(x, router, w13s, w2, shared_s, top_k=k), want)
        path = "decode" if M <= 16 else "prefill"
        yield {"op": "moe.moe_block", "case": f"M{M} E{E} top{k} per-shard gate/up scales + shared ({path})",
               "metrics": m, "passed": m.cosine >= 0.9999 and m.rel_l2 <= 5e-3}

    # packed experts (pack_experts), the shared expert of the routed size as expert E: decode in three launches
    sw13p, sw2p = _weights(1, H, I, gen)
    shared_p = SharedExpert(sw13p[0], sw2p[0], shared.gate_weight)
    p13, p2, pshared = pack_experts(w13, w2, shared_p)
    for M in (1, 3, 33):
        x = torch.randn(M, H, generator=gen).to(bf16).to(dev)
        want = reference.moe_block(x, router, w13, w2, shared_p, top_k=k)       # on the checkpoint layout
        m = compare(moe_block(x, router, p13, p2, pshared, top_k=k), want)
        path = "decode, shared expert as a routed slot" if M <= 16 else "prefill"
        yield {"op": "moe.moe_block", "case": f"M{M} E{E} top{k} packed experts + shared ({path})", "metrics": m,
               "passed": m.cosine >= 0.9999 and m.rel_l2 <= 5e-3 and shared_slot(p13, p2, pshared)}

    # the block's RMSNorm (with the residual add) in the router's launch, on the three-launch decode path
    from . import norm_moe_block

    nw = (torch.randn(H, generator=gen) * 0.2).to(bf16).to(dev)
    for M in (1, 2):
        x = torch.randn(M, H, generator=gen).to(bf16).to(dev)
        res = (torch.randn(M, H, generator=gen) * 3).to(bf16).to(dev)
        y, xn, h = norm_moe_block(x, nw, router, p13, p2, pshared, top_k=k, residual=res)
        ry, rxn, rh = reference.norm_moe_block(x, nw, router, w13, w2, shared_p, top_k=k, residual=res)
        m = compare(y, ry)
        xn_err = ((xn.float() - rxn.float()).abs() / rxn.float().abs().clamp_min(1e-30)).max().item()
        yield {"op": "moe.norm_moe_block", "case": f"M{M} E{E} top{k} packed experts + shared, norm in the router",
               "metrics": m, "passed": m.cosine >= 0.9999 and m.rel_l2 <= 5e-3 and torch.equal(h, rh)
               and xn_err <= 2 ** -7}


def check_moe() -> list[dict]:
    """The family's ``lynn check`` rows as a list (:func:`iter_rows` yields each as it finishes)."""
    return list(iter_rows())
