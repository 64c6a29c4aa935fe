"""``lynn check`` rows for the MoE family: routing and align exactly, the experts and the block against the fp32
reference, on small awkward cases (an expert with no tokens, E not a power of two, top-k 1, the decode and the
prefill paths), bf16 expert weights (the unquantised baseline through the same kernels), and NVFP4 experts whose
gate and up halves have their own global scales (per-shard, ``stack_w13`` / ``fuse_w13``), and the experts in the
packed layout with the shared expert as expert E of the stacks (``pack_experts``: decode in three launches).

Rows are ``{"op", "case", "metrics": Metrics, "passed": bool}``; ``err_ratio`` is the kernel's error over the error
of the exact answer rounded to bf16 (about 1: as good as a bf16 output can be).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import torch

from .. import runtime
from ..metrics import Case, compare
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


#: The shared shape of the block cases (experts, top-k, hidden, intermediate).
E, K, H, I = 10, 3, 64, 32


def _routed(E: int, k: int, M: int, gen: torch.Generator):
    """Bf16 router logits and the kernel's routing of them (the align case aligns its expert ids)."""
    from . import route

    logits = torch.randn(M, E, generator=gen).to(torch.bfloat16).to(runtime.DEVICE)
    w, ids = route(logits, k)
    return logits, w, ids


def _route(E: int, k: int, case: str, routed) -> list[dict]:
    from . import reference

    logits, w, ids = routed
    w_ref, ids_ref = reference.route(logits, k)
    m = compare(w, w_ref)
    return [{"op": "moe.route", "case": case, "metrics": m,
             "passed": torch.equal(ids, ids_ref) and m.max_abs <= 1e-6}]


def _align(E: int, case: str, routed) -> list[dict]:
    from . import align, reference

    ids = routed[2]
    got, want = align(ids, E, 16), reference.align(ids, E, 16)
    same = all(torch.equal(a, b) for a, b in zip(got, want))
    return [{"op": "moe.align", "case": case, "metrics": compare(got[0].float(), want[0].float()), "passed": same}]


def _experts(E: int, k: int, M: int, H: int, I: int, case: str, gen: torch.Generator) -> list[dict]:
    """NVFP4 experts, expert E-1 with no token."""
    from . import moe_experts, reference

    dev = runtime.DEVICE
    w13, w2 = _weights(E, H, I, gen)
    x = torch.randn(M, H, generator=gen).to(torch.bfloat16).to(dev)
    ids = torch.stack([torch.randperm(E - 1, generator=gen)[:k] for _ in range(M)]).to(torch.int32).to(dev)
    weights = torch.softmax(torch.randn(M, k, generator=gen), -1).to(dev)    # expert E-1 gets no token
    want = reference.moe_experts(x.float(), weights, ids, w13, w2)       # x is bf16-exact: fp32 unrounded
    m = compare(moe_experts(x, weights, ids, w13, w2), want, baseline=want.to(x.dtype))
    return [{"op": "moe.moe_experts", "case": case, "metrics": m,
             "passed": m.cosine >= 0.9999 and m.rel_l2 <= 5e-3 and m.err_ratio <= 2.0}]


def _block_weights(gen: torch.Generator) -> dict:
    """The block cases' NVFP4 experts, a shared expert of intermediate 48 and the router."""
    dev = runtime.DEVICE
    w13, w2 = _weights(E, H, I, gen)
    sw13, sw2 = _weights(1, H, 48, gen)
    shared = SharedExpert(sw13[0], sw2[0], (torch.randn(1, H, generator=gen) * 0.1).to(torch.bfloat16).to(dev))
    router = (torch.randn(E, H, generator=gen) * 0.1).to(torch.bfloat16).to(dev)
    return {"w13": w13, "w2": w2, "sw2": sw2, "shared": shared, "router": router}


def _block(M: int, case: str, bw: dict, gen: torch.Generator) -> list[dict]:
    """The block: the fused router + routing launch and FMA kernels at decode, align and tl.dot at prefill."""
    from . import moe_block, reference

    x = torch.randn(M, H, generator=gen).to(torch.bfloat16).to(runtime.DEVICE)
    w13, w2, shared, router = bw["w13"], bw["w2"], bw["shared"], bw["router"]
    want = reference.moe_block(x, router, w13, w2, shared, top_k=K)   # the routing needs bf16 logits
    m = compare(moe_block(x, router, w13, w2, shared, top_k=K), want)
    return [{"op": "moe.moe_block", "case": case, "metrics": m, "passed": m.cosine >= 0.9999 and m.rel_l2 <= 5e-3}]


def _experts_bf16(M: int, case: str, gen: torch.Generator) -> list[dict]:
    """Bf16 weights: the same kernels, the tiles loaded as they are."""
    from . import moe_experts, reference

    bf16, dev = torch.bfloat16, runtime.DEVICE
    w13b = (torch.randn(E, 2 * I, H, generator=gen) * 0.1).to(bf16).to(dev)
    w2b = (torch.randn(E, H, I, generator=gen) * 0.1).to(bf16).to(dev)
    x = torch.randn(M, H, generator=gen).to(bf16).to(dev)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(M)]).to(torch.int32).to(dev)
    weights = torch.softmax(torch.randn(M, K, generator=gen), -1).to(dev)
    want = reference.moe_experts(x.float(), weights, ids, w13b.float(), w2b.float())
    m = compare(moe_experts(x, weights, ids, w13b, w2b), want, baseline=want.to(bf16))
    return [{"op": "moe.moe_experts", "case": case, "metrics": m,
             "passed": m.cosine >= 0.9999 and m.rel_l2 <= 5e-3 and m.err_ratio <= 2.0}]


def _per_shard_weights(bw: dict, gen: torch.Generator) -> dict:
    """The block's experts again, with per-shard gate / up global scales, routed and shared."""
    w13s, s13 = _per_shard_w13(E, H, I, gen), _per_shard_w13(1, H, 48, gen)
    return {"w13s": w13s, "shared_s": SharedExpert(s13, bw["sw2"][0], bw["shared"].gate_weight)}


def _block_per_shard(M: int, case: str, bw: dict, ps: dict, gen: torch.Generator) -> list[dict]:
    """Per-shard gate / up global scales, applied per row."""
    from . import moe_block, reference

    x = torch.randn(M, H, generator=gen).to(torch.bfloat16).to(runtime.DEVICE)
    router, w2, w13s, shared_s = bw["router"], bw["w2"], ps["w13s"], ps["shared_s"]
    want = reference.moe_block(x, router, w13s, w2, shared_s, top_k=K)
    m = compare(moe_block(x, router, w13s, w2, shared_s, top_k=K), want)
    return [{"op": "moe.moe_block", "case": case, "metrics": m, "passed": m.cosine >= 0.9999 and m.rel_l2 <= 5e-3}]


def _packed_weights(bw: dict, gen: torch.Generator) -> dict:
    """The block's experts packed (``pack_experts``), a shared expert of the routed size as expert E."""
    sw13p, sw2p = _weights(1, H, I, gen)
    shared_p = SharedExpert(sw13p[0], sw2p[0], bw["shared"].gate_weight)
    p13, p2, pshared = pack_experts(bw["w13"], bw["w2"], shared_p)
    return {"shared_p": shared_p, "p13": p13, "p2": p2, "pshared": pshared}


def _block_packed(M: int, case: str, bw: dict, pw: dict, gen: torch.Generator) -> list[dict]:
    """The packed experts: decode in three launches, the shared expert a routed slot."""
    from . import moe_block, reference

    x = torch.randn(M, H, generator=gen).to(torch.bfloat16).to(runtime.DEVICE)
    router, p13, p2, pshared = bw["router"], pw["p13"], pw["p2"], pw["pshared"]
    want = reference.moe_block(x, router, bw["w13"], bw["w2"], pw["shared_p"], top_k=K)   # on the checkpoint layout
    m = compare(moe_block(x, router, p13, p2, pshared, top_k=K), want)
    return [{"op": "moe.moe_block", "case": case, "metrics": m,
             "passed": m.cosine >= 0.9999 and m.rel_l2 <= 5e-3 and shared_slot(p13, p2, pshared)}]


def _norm_block(M: int, case: str, bw: dict, pw: dict, nw: torch.Tensor, gen: torch.Generator) -> list[dict]:
    """The block's RMSNorm (with the residual add) in the router's launch, on the three-launch decode path."""
    from . import norm_moe_block, reference

    bf16, dev = torch.bfloat16, runtime.DEVICE
    x = torch.randn(M, H, generator=gen).to(bf16).to(dev)
    res = (torch.randn(M, H, generator=gen) * 3).to(bf16).to(dev)
    router = bw["router"]
    y, xn, h = norm_moe_block(x, nw, router, pw["p13"], pw["p2"], pw["pshared"], top_k=K, residual=res)
    ry, rxn, rh = reference.norm_moe_block(x, nw, router, bw["w13"], bw["w2"], pw["shared_p"], top_k=K, residual=res)
    m = compare(y, ry)
    xn_err = ((xn.float() - rxn.float()).abs() / rxn.float().abs().clamp_min(1e-30)).max().item()
    return [{"op": "moe.norm_moe_block", "case": case, "metrics": m,
             "passed": m.cosine >= 0.9999 and m.rel_l2 <= 5e-3 and torch.equal(h, rh) and xn_err <= 2 ** -7}]


def _path(M: int) -> str:
    return "decode" if M <= 16 else "prefill"


def cases() -> Iterator[Case]:
    """The family's check matrix, each case named before it runs (inputs drawn in order from one seeded generator;
    weights that cases share by the first of them to run)."""
    gen = torch.Generator().manual_seed(0)
    for e, k, M in ((60, 4, 37), (7, 1, 5), (256, 8, 3)):
        routed = functools.cache(lambda e=e, k=k, M=M: _routed(e, k, M, gen))
        case = f"M{M} E{e} top{k}"
        yield Case("moe.route", case, lambda e=e, k=k, c=case, r=routed: _route(e, k, c, r()))
        case = f"M{M} E{e} top{k} block 16"
        yield Case("moe.align", case, lambda e=e, c=case, r=routed: _align(e, c, r()))

    for e, k, M, h, i in ((7, 2, 1, 64, 48), (12, 3, 40, 80, 32), (5, 1, 20, 64, 64)):
        case = f"M{M} E{e} top{k} H{h} I{i} ({_path(M)})"
        yield Case("moe.moe_experts", case, lambda e=e, k=k, M=M, h=h, i=i, c=case: _experts(e, k, M, h, i, c, gen))

    block = functools.cache(lambda: _block_weights(gen))
    for M in (3, 33):          # decode (fused router + routing launch, FMA kernels) and prefill (align, tl.dot)
        case = f"M{M} E{E} top{K} + shared expert ({_path(M)})"
        yield Case("moe.moe_block", case, lambda M=M, c=case: _block(M, c, block(), gen))

    for M in (3, 33):          # bf16 weights: the same kernels, the tiles loaded as they are
        case = f"M{M} E{E} top{K} H{H} I{I} bf16 weights ({_path(M)})"
        yield Case("moe.moe_experts", case, lambda M=M, c=case: _experts_bf16(M, c, gen))

    per_shard = functools.cache(lambda: _per_shard_weights(block(), gen))
    for M in (3, 33):          # per-shard gate / up global scales, routed and shared, applied per row
        case = f"M{M} E{E} top{K} per-shard gate/up scales + shared ({_path(M)})"
        yield Case("moe.moe_block", case, lambda M=M, c=case: _block_per_shard(M, c, block(), per_shard(), gen))

    # packed experts (pack_experts), the shared expert of the routed size as expert E: decode in three launches
    packed = functools.cache(lambda: _packed_weights(block(), gen))
    for M in (1, 3, 33):
        path = "decode, shared expert as a routed slot" if M <= 16 else "prefill"
        case = f"M{M} E{E} top{K} packed experts + shared ({path})"
        yield Case("moe.moe_block", case, lambda M=M, c=case: _block_packed(M, c, block(), packed(), gen))

    # the block's RMSNorm (with the residual add) in the router's launch, on the three-launch decode path
    norm_weight = functools.cache(lambda: (torch.randn(H, generator=gen) * 0.2).to(torch.bfloat16).to(runtime.DEVICE))
    for M in (1, 2):
        case = f"M{M} E{E} top{K} packed experts + shared, norm in the router"
        yield Case("moe.norm_moe_block", case,
                   lambda M=M, c=case: _norm_block(M, c, block(), packed(), norm_weight(), gen))


def iter_rows() -> Iterator[dict]:
    for case in cases():
        yield from case.run()


def check_moe() -> list[dict]:
    """The family's ``lynn check`` rows as a list (:func:`iter_rows` yields each as it finishes)."""
    return list(iter_rows())


__all__ = ["check_moe", "cases"]
