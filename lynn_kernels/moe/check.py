"""``lynn check`` rows for the MoE family: routing and align exactly, the experts and the block against the fp32
reference, on small awkward cases (an expert with no tokens, E not a power of two, top-k 1, the decode and the
prefill paths).

Rows are ``{"op", "case", "metrics": Metrics, "passed": bool}``; ``err_ratio`` is the kernel's error over the error
of the exact answer rounded to bf16 (about 1: as good as a bf16 output can be).
"""

from __future__ import annotations

import torch

from .. import runtime
from ..nvfp4 import quantize
from ..validate import compare
from .spec import SharedExpert


def _weights(E: int, H: int, I: int, gen: torch.Generator):
    dev = runtime.DEVICE

    def q(*shape):
        return quantize((torch.randn(shape, generator=gen) * 0.1).to(dev))

    return q(E, 2 * I, H), q(E, H, I)


def check_moe() -> list[dict]:
    from . import align, moe_block, moe_experts, reference, route

    dev = runtime.DEVICE
    rows = []
    gen = torch.Generator().manual_seed(0)
    for E, k, M in ((60, 4, 37), (7, 1, 5), (256, 8, 3)):
        logits = torch.randn(M, E, generator=gen).to(torch.bfloat16).to(dev)
        w, ids = route(logits, k)
        w_ref, ids_ref = reference.route(logits, k)
        m = compare(w, w_ref)
        rows.append({"op": "moe.route", "case": f"M{M} E{E} top{k}", "metrics": m,
                     "passed": torch.equal(ids, ids_ref) and m.max_abs <= 1e-6})
        got, want = align(ids, E, 16), reference.align(ids, E, 16)
        same = all(torch.equal(a, b) for a, b in zip(got, want))
        rows.append({"op": "moe.align", "case": f"M{M} E{E} top{k} block 16",
                     "metrics": compare(got[0].float(), want[0].float()), "passed": same})

    for E, k, M, H, I in ((7, 2, 1, 64, 48), (12, 3, 40, 80, 32), (5, 1, 20, 64, 64)):
        w13, w2 = _weights(E, H, I, gen)
        x = torch.randn(M, H, generator=gen).to(torch.bfloat16).to(dev)
        ids = torch.stack([torch.randperm(E - 1, generator=gen)[:k] for _ in range(M)]).to(torch.int32).to(dev)
        weights = torch.softmax(torch.randn(M, k, generator=gen), -1).to(dev)    # expert E-1 gets no token
        want = reference.moe_experts(x.float(), weights, ids, w13, w2)       # x is bf16-exact: fp32 unrounded
        m = compare(moe_experts(x, weights, ids, w13, w2), want, baseline=want.to(x.dtype))
        path = "decode" if M <= 16 else "prefill"
        rows.append({"op": "moe.moe_experts", "case": f"M{M} E{E} top{k} H{H} I{I} ({path})", "metrics": m,
                     "passed": m.cosine >= 0.9999 and m.rel_l2 <= 5e-3 and m.err_ratio <= 2.0})

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
        rows.append({"op": "moe.moe_block", "case": f"M{M} E{E} top{k} + shared expert ({path})", "metrics": m,
                     "passed": m.cosine >= 0.9999 and m.rel_l2 <= 5e-3})
    return rows
