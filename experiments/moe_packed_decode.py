"""Experiment (GPU only): the MoE block's decode step on packed experts, and the shared expert as one more slot.

Three forms of the same block (same weights, same routing), each timed the way the decoder runs it, by CUDA-graph
replay of ``LAYERS`` distinct blocks in a row (each with its own experts, so the weights come from HBM, not L2):

* ``checkpoint``: experts as stored (NVFP4Tensor), the FMA decode kernels on the weight halves, the shared expert in
  launches of its own (5 launches at M <= 16);
* ``packed``: experts in the packed layout (``pack_experts`` without the shared expert; the shared expert packed on
  its own): the FMA decode kernels on packed words, still 5 launches;
* ``packed + shared slot``: ``pack_experts`` with the shared expert as expert E: router, gate_up, down (3 launches).

First the packed kernels' tiles are swept at M = 1 (the Qwen3.5 shape), gate_up and down apart (each list timed
with the other kernel at its shipped tile); then the three forms at M = 1 and 8 on both Qwen shapes with the best
tiles (M = 1, 2, 4, 8), each validated against the fp32 reference on the checkpoint weights, repeated for
bit-equality, and profiled per kernel (launches per call, CUDA time per kernel name); last, the router's parts at
M = 1 (the whole one-launch router against the routing kernel alone on ready logits, top-k and top-1).

Run: ``PYTHONPATH=. python3 experiments/moe_packed_decode.py`` (JSON under $OUT or out/).
"""

from __future__ import annotations

import collections
import json
import multiprocessing as mp
import os
import sys

import torch

from lynn_kernels.bench.harness import provenance
from lynn_kernels.bench.matmul_graph import graph_us
from lynn_kernels.matmul import pack
from lynn_kernels.metrics import bit_mismatches, compare
from lynn_kernels.moe import SharedExpert, moe_block, pack_experts, reference, triton_experts
from lynn_kernels.moe.packed import shared_slot
from lynn_kernels.nvfp4 import quantize

H, I = 2048, 512
LAYERS = 8
#: run 1 (git b032481) swept 10 tiles of each kernel; run 2 (the down kernel's slots in two groups: 9 = 8 + 1, not
#: one tile padded to 16) keeps the three best gate_up tiles and sweeps the down kernel again.
UP = [dict(BLOCK_N=n, TW=w, num_warps=nw) for n, w, nw in ((8, 64, 4), (16, 64, 4), (4, 128, 2))]
DOWN = [dict(BLOCK_N=n, TW=w, num_warps=nw) for n, w, nw in
        ((2, 32, 2), (4, 32, 4), (4, 16, 2), (8, 32, 8), (8, 16, 4), (16, 16, 8), (8, 16, 2), (16, 16, 4),
         (8, 64, 8), (16, 32, 8))]
SHAPES = {"qwen3.5": (256, 8), "qwen3-next": (512, 10)}


def _set(up: dict | None = None, down: dict | None = None) -> None:
    if up is not None:
        triton_experts.PACKED_UP_CONFIGS = (up, up)
    if down is not None:
        triton_experts.PACKED_DOWN_CONFIGS = (down, down)


def _block(E: int, gen, per_expert: bool = True) -> dict:
    """One MoE block's weights in the three forms (bf16 x, NVFP4 experts, a bf16 router and shared gate)."""
    def q(shape, scale):
        w = torch.randn(shape, device="cuda", generator=gen) * scale
        g = w.abs().amax(dim=tuple(range(1, w.dim()))) / 2688 if per_expert and w.dim() == 3 else None
        return quantize(w.to(torch.bfloat16), global_scale=g)

    w13, w2 = q((E, 2 * I, H), 0.05), q((E, H, I), 0.05)
    shared = SharedExpert(q((2 * I, H), 0.05), q((H, I), 0.05),
                          (torch.randn(1, H, device="cuda", generator=gen) * 0.05).to(torch.bfloat16))
    router = (torch.randn(E, H, device="cuda", generator=gen) * 0.05).to(torch.bfloat16)
    f13, f2, fshared = pack_experts(w13, w2, shared)
    assert shared_slot(f13, f2, fshared)
    p13, p2, _ = pack_experts(w13, w2, None)
    pshared = SharedExpert(pack(shared.w13), pack(shared.w2), shared.gate_weight)
    return {"router": router, "checkpoint": (w13, w2, shared), "packed": (p13, p2, pshared),
            "packed + shared slot": (f13, f2, fshared)}


def _compile(args) -> str:
    """Worker: compile one tile of one packed kernel (M = 1 and 8: both tile sets) into Triton's cache, in
    parallel."""
    kind, i = args
    _set(**({"up": UP[i]} if kind == "up" else {"down": DOWN[i]}))
    return warm_block(i, (1, 8))


def warm_block(seed: int, ms) -> str:
    """Run a small block (8 experts) at each M of ``ms`` with the tiles set now: compiles them into Triton's cache.
    "ok", or the error."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    b = _block(8, gen)
    try:
        for m in ms:
            x = torch.randn(m, H, device="cuda", dtype=torch.bfloat16, generator=gen)
            moe_block(x, b["router"], *b["packed + shared slot"], top_k=8)
        torch.cuda.synchronize()
        return "ok"
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc)[:160]}"


def _calls(blocks: list[dict], form: str, xs: list[torch.Tensor], top_k: int) -> list:
    return [lambda b=b, x=x: moe_block(x, b["router"], *b[form], top_k=top_k) for b, x in zip(blocks, xs)]


def profile(fn, n: int = 20) -> tuple[dict[str, float], float]:
    """(mean CUDA time per call of each kernel name ``fn`` launches, GPU operations per call)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    acc, count = collections.defaultdict(float), 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            acc[e.name[:60]] += e.time_range.elapsed_us() / n
            count += 1
    return dict(acc), count / n


def sweep(blocks: list[dict], gen) -> dict:
    xs = [torch.randn(1, H, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in blocks]
    rows = {"up": [], "down": []}
    shipped_up, shipped_down = triton_experts.PACKED_UP_CONFIGS[0], triton_experts.PACKED_DOWN_CONFIGS[0]
    for kind, configs in (("up", UP), ("down", DOWN)):
        for i, cfg in enumerate(configs):
            _set(up=cfg if kind == "up" else shipped_up, down=cfg if kind == "down" else shipped_down)
            row = dict(config=cfg)
            try:
                b = blocks[0]
                got = moe_block(xs[0], b["router"], *b["packed + shared slot"], top_k=8)
                want = reference.moe_block(xs[0], b["router"], *b["checkpoint"], top_k=8)
                row["cosine"] = compare(got, want).cosine
                row["us"] = graph_us(_calls(blocks, "packed + shared slot", xs, 8))
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
            rows[kind].append(row)
            print(kind, row, flush=True)
    ok = {k: [r for r in v if r.get("cosine", 0) > 0.9999] for k, v in rows.items()}
    best = {k: min(v, key=lambda r: r["us"])["config"] for k, v in ok.items() if v}
    rows["best"] = best
    _set(best.get("up", shipped_up), best.get("down", shipped_down))
    return rows


def compare_forms(name: str, E: int, top_k: int, gen) -> list[dict]:
    blocks = [_block(E, gen) for _ in range(LAYERS)]
    rows = []
    for m in (1, 2, 4, 8):
        xs = [torch.randn(m, H, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in blocks]
        b, x = blocks[0], xs[0]
        want = reference.moe_block(x, b["router"], *b["checkpoint"], top_k=top_k)
        for form in ("checkpoint", "packed", "packed + shared slot"):
            got = moe_block(x, b["router"], *b[form], top_k=top_k)
            again = moe_block(x, b["router"], *b[form], top_k=top_k)
            metrics = compare(got, want)
            call = _calls(blocks[:1], form, xs[:1], top_k)[0]
            per_kernel, launches = profile(call)
            row = dict(shape=name, E=E, top_k=top_k, M=m, form=form, cosine=metrics.cosine, rel_l2=metrics.rel_l2,
                       repeat_mismatches=bit_mismatches(got, again), graph_us=graph_us(_calls(blocks, form, xs, top_k)),
                       kernels=launches, per_kernel_us=per_kernel)
            rows.append(row)
            print(row, flush=True)
    del blocks
    torch.cuda.empty_cache()
    return rows


def router_parts(gen) -> list[dict]:
    """Where the router's time goes at M = 1: the whole router launch (logits, ticket, top-k in the last program)
    against the routing kernel alone on ready logits (its top-k), by graph replay over 8 routers."""
    from lynn_kernels.moe.triton_route import launch_route, launch_router

    rows = []
    for E, top_k in SHAPES.values():
        rs = [(torch.randn(E, H, device="cuda", generator=gen) * 0.05).to(torch.bfloat16) for _ in range(LAYERS)]
        gws = [(torch.randn(H, device="cuda", generator=gen) * 0.05).to(torch.bfloat16) for _ in range(LAYERS)]
        x = torch.randn(1, H, device="cuda", dtype=torch.bfloat16, generator=gen)
        logits = (x.float() @ rs[0].float().t()).to(torch.bfloat16)
        w = torch.empty(1, top_k + 1, device="cuda")
        ids = torch.empty(1, top_k + 1, device="cuda", dtype=torch.int32)
        wk, ik = torch.empty(1, top_k, device="cuda"), torch.empty(1, top_k, device="cuda", dtype=torch.int32)
        router = [lambda r=r, gw=gw: launch_router(x, r, top_k, True, w, ids, gate_weight=gw, shared_slot=True)
                  for r, gw in zip(rs, gws)]
        rows.append(dict(E=E, top_k=top_k, router_us=graph_us(router),
                         route_only_us=graph_us([lambda: launch_route(logits, top_k, True, wk, ik)] * LAYERS),
                         route_top1_us=graph_us([lambda: launch_route(logits, 1, True, wk[:, :1], ik[:, :1])] * LAYERS)))
        print(rows[-1], flush=True)
    return rows


def main() -> dict:
    jobs = [("up", i) for i in range(len(UP))] + [("down", i) for i in range(len(DOWN))]
    with mp.get_context("spawn").Pool(16) as pool:
        compiled = pool.map(_compile, jobs)
    print("compiled:", dict(zip(map(str, jobs), compiled)), flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    blocks = [_block(256, gen) for _ in range(LAYERS)]
    tiles = sweep(blocks, gen)
    del blocks
    torch.cuda.empty_cache()
    forms = []
    for name, (E, top_k) in SHAPES.items():
        forms += compare_forms(name, E, top_k, gen)
    return {"provenance": provenance(" ".join(["python3", *sys.argv])), "layers_chained": LAYERS,
            "compiled": compiled, "tiles_m1_qwen3.5": tiles, "forms": forms, "router": router_parts(gen)}


if __name__ == "__main__":
    result = main()
    out = os.environ.get("OUT", "out")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "moe_packed_decode.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"\n{'shape':11} {'M':>2} {'form':22} {'kernels':>7} {'us/block':>9} {'cosine':>9} {'repeat':>6}")
    for r in result["forms"]:
        print(f"{r['shape']:11} {r['M']:>2} {r['form']:22} {r['kernels']:>7.0f} {r['graph_us']:9.2f} "
              f"{r['cosine']:9.6f} {r['repeat_mismatches']:>6}")
    print("best tiles at M = 1:", result["tiles_m1_qwen3.5"]["best"])
