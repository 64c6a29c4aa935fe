"""The routed MoE block (router, top-k routing, experts, combine; no shared expert) at Qwen shapes, three ways:

* ``lynn moe_block``: router logits in torch, then our routing, align (prefill only) and grouped NVFP4 expert
  kernels (W4A16, weights decoded in registers, bf16 tensor cores), no host sync;
* ``torch._grouped_mm``: a bf16 pipeline as a PyTorch user would write it: routing in torch (softmax, topk,
  renormalise), tokens sorted by expert (``argsort``, ``bincount``), two ``torch._grouped_mm`` calls with SiLU x up
  between them, the routing weights, and ``index_add_``;
* ``eager per-expert loop``: HF transformers' way: one ``F.linear`` pair per expert that received tokens (a host sync
  to find them).

All three use the same weights (the bf16 ones are the dequantised NVFP4 tensor), the same router and the same
inputs, and each is validated against the fp32 reference (:func:`lynn_kernels.moe.reference.moe_block`) before it
is timed. Inputs rotate across enough token sets that the experts they route to exceed the L2 three times over
(a decode step's 8 experts would otherwise sit in L2).

Bytes: the active experts' weights (``3 I H`` elements each, at 0.5625 bytes for NVFP4 and 2 for bf16; active = the
distinct experts of the first input set) plus x in and out; FLOPs ``2 * M * top_k * 3 I H``. Decode sizes (M <= 64)
are held against the read ceiling, prefill sizes against the bf16 matmul ceiling.
"""

from __future__ import annotations

import itertools
import sys
import time

import torch
import torch.nn.functional as F

from ..metrics import compare
from ..moe import moe_block, reference
from ..nvfp4 import dequantize, quantize
from .harness import Ceilings, Result, derive, rotating, rotation, time_fn, timed, validated
from .registry import register

#: (label, experts, top_k, hidden, expert intermediate): the published configs (lynn_model presets, docs/decoder.md)
SHAPES = [("Qwen3.5-35B-A3B", 256, 8, 2048, 512), ("Qwen3-Next-80B-A3B", 512, 10, 2048, 512)]
MS = [1, 4, 16, 64, 512, 4096]
QUICK = [SHAPES[0]], [1, 4096]
NAN = float("nan")
BF16 = torch.bfloat16


def torch_routing(x, router_weight, top_k: int):
    """Qwen3.5's router in torch: softmax in fp32, top-k, renormalised."""
    probs = torch.softmax((x @ router_weight.t()).float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), ids


def grouped_mm_moe(x, router_weight, w13_t, w2_t, top_k: int):
    """bf16 MoE with ``torch._grouped_mm``: ``w13_t [E, H, 2I]``, ``w2_t [E, I, H]`` (column-major views)."""
    E, I = w13_t.shape[0], w2_t.shape[1]
    weights, ids = torch_routing(x, router_weight, top_k)
    flat = ids.view(-1)
    order = flat.argsort(stable=True)
    token = order // top_k
    offs = torch.bincount(flat, minlength=E).cumsum(0).to(torch.int32)
    h = torch._grouped_mm(x[token], w13_t, offs=offs)                               # [S, 2I]
    y = torch._grouped_mm(F.silu(h[:, :I]) * h[:, I:], w2_t, offs=offs)            # [S, H]
    y = y * weights.view(-1)[order, None].to(y.dtype)
    return torch.zeros_like(x).index_add_(0, token, y)


def eager_moe(x, router_weight, w13_b, w2_b, top_k: int):
    """HF-style loop over the experts that received tokens (``w13_b [E, 2I, H]``, ``w2_b [E, H, I]``, bf16)."""
    I = w2_b.shape[-1]
    weights, ids = torch_routing(x, router_weight, top_k)
    out = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():                                            # host sync, as HF's loop
        t, j = torch.where(ids == e)
        gate, up = F.linear(x[t], w13_b[e]).split(I, dim=-1)
        out.index_add_(0, t, F.linear(F.silu(gate) * up, w2_b[e]) * weights[t, j, None].to(x.dtype))
    return out


@register("moe.block")
def bench_block(ceilings: Ceilings, quick: bool = False) -> list[Result]:
    shapes, ms = QUICK if quick else (SHAPES, MS)
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for label, E, top_k, H, I in shapes:
        w13 = quantize(torch.randn(E, 2 * I, H, device="cuda", dtype=BF16, generator=gen) * 0.05)
        w2 = quantize(torch.randn(E, H, I, device="cuda", dtype=BF16, generator=gen) * 0.05)
        w13_b, w2_b = dequantize(w13), dequantize(w2)                              # the same weights in bf16
        w13_t, w2_t = w13_b.transpose(1, 2), w2_b.transpose(1, 2)
        router = torch.randn(E, H, device="cuda", dtype=BF16, generator=gen) * 0.05
        expert_elems = 3 * I * H                                                   # weights of one expert
        for m in ms:
            t0 = time.perf_counter()
            print(f"moe.block: {label} M={m} ...", end="", file=sys.stderr, flush=True)   # where a slow run stands
            dims = {"M": m, "E": E, "top_k": top_k, "H": H, "I": I}
            seeds = itertools.count(1000 * m)

            def make():
                g = torch.Generator(device="cuda").manual_seed(next(seeds))
                return (torch.randn(m, H, device="cuda", dtype=BF16, generator=g),)

            per_call = min(E, m * top_k) * expert_elems * 9 // 16
            sets = rotation(make, per_call, max_sets=32)
            x0 = sets[0][0]
            want = reference.moe_block(x0, router, w13, w2, top_k=top_k)
            active = int(torch.unique(torch_routing(x0, router, top_k)[1]).numel())
            act = 2 * 2 * m * H
            flops = 2 * m * top_k * expert_elems
            ceiling = "read_gbps" if m <= 64 else "bf16_tflops"
            providers = [
                ("lynn moe_block (NVFP4)", lambda x: moe_block(x, router, w13, w2, top_k=top_k),
                 active * expert_elems * 9 // 16 + act),
                ("torch._grouped_mm bf16 pipeline", lambda x: grouped_mm_moe(x, router, w13_t, w2_t, top_k),
                 active * expert_elems * 2 + act),
                ("eager per-expert loop bf16 (HF style)", lambda x: eager_moe(x, router, w13_b, w2_b, top_k),
                 active * expert_elems * 2 + act),
            ]
            # baseline: the plain bf16 pipeline (torch._grouped_mm); H200 err_ratio lynn 0.37-0.46, torch 1
            plain = grouped_mm_moe(x0, router, w13_t, w2_t, top_k)
            checks = {name: validated(compare(fn(x0), want, baseline=plain)) for name, fn, _ in providers}
            for name, fn, nbytes in providers:
                base = Result("moe.block", name, label, dims, NAN, NAN, NAN, bytes=nbytes, flops=flops,
                              ceiling=ceiling, validation=checks[name],
                              note=f"{len(sets)} rotating token sets; {active} active experts in set 0")
                try:
                    rows += timed(base, rotating(fn, sets), ceilings)
                except RuntimeError as exc:                   # the loop's kernel count changes with the routing
                    med, p20, p80 = time_fn(rotating(fn, sets))
                    base.provider, base.note = f"{name} (call)", f"{base.note}; no kernel time: {exc}"
                    base.median_ms, base.p20_ms, base.p80_ms = med, p20, p80
                    rows.append(derive(base, ceilings))
            sets = None
            print(f" {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        w13 = w2 = w13_b = w2_b = w13_t = w2_t = None
        torch.cuda.empty_cache()
    return rows


__all__ = ["bench_block", "grouped_mm_moe", "eager_moe", "torch_routing", "SHAPES", "MS"]
