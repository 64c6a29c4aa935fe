"""Experiment (GPU only): tiles of the MoE decode kernels (``M <= 16``, FMA on the weight halves) by per-kernel CUDA
time, at the Qwen3.5 shape (256 experts, top-8, 2048 -> 512), M = 1, 4, 16.

The first decode path (a 16-row ``tl.dot`` tile holding one real row per slot) ran its gate_up at 360 GB/s at M = 1
(``docs/moe.md`` section 4). The FMA kernels replaced it; this sweeps their ``BLOCK_N`` (how many programs),
``BLOCK_K`` (bytes in flight per step) and warps. Config ``i`` of each kernel's list runs in the same call (the
module's ``DECODE_UP_CONFIGS`` / ``DECODE_DOWN_CONFIGS`` are set to ``UP[i]`` / ``DOWN[i]``); the profiler times each
kernel alone, so each list is ranked on its own. Every config is validated against the fp32 reference first. The
kernels are compiled by worker processes in parallel first (the device's host takes 10-20 s per compile).

It also records two facts the M = 1 block depends on: how often the GPU's bf16 router GEMM (``F.linear``, what
``moe_block`` now runs) differs from the fp32 product rounded to bf16, and whether the top-k ids differ; and the
per-kernel profile of ``moe_block`` at M = 1 for both Qwen shapes with the best tiles.

Run: ``PYTHONPATH=. python3 experiments/moe_decode_tiles.py [--profile-only]`` (JSON under $OUT
or out/; ``--profile-only``: just the M = 1 block profile with the shipped tiles).
"""

from __future__ import annotations

import collections
import itertools
import json
import multiprocessing as mp
import os
import sys

import torch
import torch.nn.functional as F

from lynn_kernels.bench.harness import kernel_ms
from lynn_kernels.metrics import compare
from lynn_kernels.moe import moe_block, reference, triton_experts
from lynn_kernels.moe.triton_experts import launch_moe_experts, moe_workspace
from lynn_kernels.nvfp4 import quantize

H, I = 2048, 512
#: run 1 (commit c08e11a) swept configs 0-9 at M = 1, 4, 16; run 2 adds 10-15 (fewer warps, taller tiles: each
#: thread holds more weight rows per x value it converts)
UP = [dict(BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=3) for n, k, w in
      ((4, 512, 4), (8, 256, 4), (8, 512, 4), (8, 1024, 8), (16, 256, 4), (16, 512, 4), (16, 512, 8), (32, 256, 4),
       (32, 512, 8), (8, 512, 2), (32, 256, 2), (32, 512, 4), (64, 256, 4), (16, 256, 1), (32, 256, 1),
       (16, 512, 2))]
DOWN = [dict(BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=3) for n, k, w in
        ((4, 128, 4), (4, 256, 4), (4, 512, 4), (8, 128, 4), (8, 256, 4), (8, 512, 8), (16, 128, 4), (16, 256, 8),
         (2, 512, 4), (8, 256, 8), (8, 128, 2), (16, 128, 2), (4, 128, 2), (8, 64, 4), (4, 64, 2), (16, 64, 4))]
MS = (1, 16)


def _set(i: int) -> None:
    triton_experts.DECODE_UP_CONFIGS, triton_experts.DECODE_DOWN_CONFIGS = (UP[i], UP[i]), (DOWN[i], DOWN[i])


def _experts(E: int, gen):
    w13 = quantize(torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.05)
    w2 = quantize(torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.05)
    return w13, w2


def _compile(i: int) -> str:
    """Worker: compile config i of both kernels at the real H, I and top-8 (E does not reach the kernels)."""
    _set(i)
    gen = torch.Generator(device="cuda").manual_seed(i)
    w13, w2 = _experts(8, gen)
    x = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
    ids = torch.arange(8, device="cuda", dtype=torch.int32)[None]
    w = torch.full((1, 8), 0.125, device="cuda")
    out = torch.empty(1, H, device="cuda", dtype=torch.bfloat16)
    try:
        launch_moe_experts(x, w, ids, w13, w2, out, moe_workspace(1, 8, 8, H, I, torch.bfloat16, x.device))
        torch.cuda.synchronize()
        return "ok"
    except Exception as exc:                                   # reported again, per config, by the timing pass
        return f"{type(exc).__name__}: {str(exc)[:120]}"


def per_kernel_us(fn, n: int = 30) -> dict[str, float]:
    """Mean CUDA time per call of each kernel ``fn`` launches, by kernel name."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    acc = collections.defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            acc[e.name[:60]] += e.time_range.elapsed_us() / n
    return dict(acc)


def _pick(times: dict[str, float], key: str) -> float:
    return sum(v for k, v in times.items() if key in k)


def sweep(gen) -> list[dict]:
    rows = []
    E, top_k = 256, 8
    w13, w2 = _experts(E, gen)
    for m in MS:
        sets = []
        for _ in range(16):                                      # different experts per call: past the L2
            x = torch.randn(m, H, device="cuda", dtype=torch.bfloat16, generator=gen)
            ids = torch.stack([torch.randperm(E, device="cuda", generator=gen)[:top_k] for _ in range(m)])
            w = torch.softmax(torch.randn(m, top_k, device="cuda", generator=gen), -1)
            sets.append((x, w, ids.to(torch.int32)))
        x0, w0, ids0 = sets[0]
        want = reference.moe_experts(x0, w0, ids0, w13, w2)
        slots = m * top_k
        up_bytes, down_bytes = slots * 2 * I * H * 9 // 16, slots * H * I * 9 // 16   # per slot (duplicates count)
        out = torch.empty(m, H, device="cuda", dtype=torch.bfloat16)
        ws = moe_workspace(m, top_k, E, H, I, torch.bfloat16, x0.device)
        for i in range(len(UP)):
            _set(i)
            row = dict(M=m, config=i, up=str(UP[i]), down=str(DOWN[i]))
            try:
                out.fill_(float("nan"))
                launch_moe_experts(x0, w0, ids0, w13, w2, out, ws)
                row["cosine"] = compare(out, want).cosine
                it = itertools.cycle(sets)

                def call():
                    x, w, ids = next(it)
                    return launch_moe_experts(x, w, ids, w13, w2, out, ws)

                t = per_kernel_us(call)
                row["up_us"], row["down_us"] = _pick(t, "decode_gate_up"), _pick(t, "decode_down")
                row["up_gbps"], row["down_gbps"] = up_bytes / row["up_us"] / 1e3, down_bytes / row["down_us"] / 1e3
            except Exception as exc:                           # a config that fails is a result too
                row["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
            rows.append(row)
            print(row, flush=True)
    return rows


def router_check(gen) -> list[dict]:
    """F.linear (bf16, cuBLAS) vs the fp32 product rounded to bf16: differing logits and differing top-k ids."""
    rows = []
    for E, top_k in ((256, 8), (512, 10)):
        r = torch.randn(E, H, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.05
        for m in (1, 4, 16, 64, 512, 4096):
            x = torch.randn(m, H, device="cuda", dtype=torch.bfloat16, generator=gen)
            a = F.linear(x, r)
            b = (x.float() @ r.float().t()).to(torch.bfloat16)
            ia = torch.sort(a.float(), dim=-1, descending=True, stable=True).indices[:, :top_k]
            ib = torch.sort(b.float(), dim=-1, descending=True, stable=True).indices[:, :top_k]
            rows.append(dict(E=E, M=m, logits_differ=int((a != b).sum()), logits=a.numel(),
                             tokens_with_other_ids=int((ia != ib).any(-1).sum())))
            print(rows[-1], flush=True)
    return rows


def block_profile(gen, best: dict[int, int]) -> list[dict]:
    """moe_block at M = 1 (the shipped tiles, or the best at M = 1 of this sweep): per-kernel time and total kernel
    time, both shapes."""
    if best:
        _set(best["up"])
        triton_experts.DECODE_DOWN_CONFIGS = (DOWN[best["down"]],) * 2
    rows = []
    for E, top_k in ((256, 8), (512, 10)):
        w13, w2 = _experts(E, gen)
        r = torch.randn(E, H, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.05
        xs = [torch.randn(1, H, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(16)]
        it = itertools.cycle(xs)
        call = lambda: moe_block(next(it), r, w13, w2, top_k=top_k)   # noqa: E731
        m = compare(moe_block(xs[0], r, w13, w2, top_k=top_k), reference.moe_block(xs[0], r, w13, w2, top_k=top_k))
        rows.append(dict(E=E, top_k=top_k, cosine=m.cosine, kernel_us=kernel_ms(call) * 1e3,
                         per_kernel_us=per_kernel_us(call)))
        print(rows[-1], flush=True)
        del w13, w2
    return rows


def kernel_info() -> list[dict]:
    """Registers, spills and PTX instruction counts of every compiled decode kernel (from Triton's in-process
    cache), to see what the FMA loop costs per weight."""
    rows = []
    for kern in (triton_experts._moe_decode_gate_up_kernel, triton_experts._moe_decode_down_kernel):
        for cache in getattr(kern, "device_caches", {}).values():
            for key, ck in cache[0].items():
                ptx = ck.asm.get("ptx", "")
                ops = collections.Counter(line.split()[0].split(".")[0] for line in ptx.splitlines()
                                          if line.startswith("\t") and line.strip() and line.strip()[0].isalpha())
                rows.append(dict(kernel=kern.fn.__name__, key=str(key)[-200:], n_regs=getattr(ck, "n_regs", None),
                                 n_spills=getattr(ck, "n_spills", None), shared=ck.metadata.shared,
                                 num_warps=ck.metadata.num_warps, ptx_ops=dict(ops.most_common(25))))
    return rows


def main() -> dict:
    if "--profile-only" in sys.argv:            # the shipped tiles: moe_block at M = 1, per kernel
        return {"block_m1": block_profile(torch.Generator(device="cuda").manual_seed(0), {}), "best": {}}
    with mp.get_context("spawn").Pool(min(16, len(UP))) as pool:
        compiled = pool.map(_compile, range(len(UP)))
    print("compiled:", compiled, flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = sweep(gen)
    ok = [r for r in rows if "up_us" in r and r["cosine"] > 0.9999]
    best = {}
    for m in MS:
        cand = [r for r in ok if r["M"] == m]
        if cand:
            best[m] = {"up": min(cand, key=lambda r: r["up_us"])["config"],
                       "down": min(cand, key=lambda r: r["down_us"])["config"]}
    result = {"compiled": compiled, "sweep": rows, "best": best, "router": router_check(gen)}
    try:
        result["kernels"] = kernel_info()
    except Exception as exc:                                   # introspection of Triton internals: best effort
        result["kernels"] = f"{type(exc).__name__}: {exc}"
    if 1 in best:
        result["block_m1"] = block_profile(gen, best[1])
    return result


if __name__ == "__main__":
    res = main()
    path = os.path.join(os.environ.get("OUT", "out"), "moe_decode_tiles.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    json.dump(res, open(path, "w"), indent=1)
    print("\nM  best up (us, GB/s)                    best down (us, GB/s)")
    for m, b in res["best"].items():
        u = next(r for r in res["sweep"] if r["M"] == m and r["config"] == b["up"])
        d = next(r for r in res["sweep"] if r["M"] == m and r["config"] == b["down"])
        print(f"{m:<3}{UP[b['up']]} {u['up_us']:.1f} {u['up_gbps']:.0f}   {DOWN[b['down']]} {d['down_us']:.1f} "
              f"{d['down_gbps']:.0f}")
    for r in res.get("block_m1", []):
        print(f"moe_block M=1 E={r['E']}: {r['kernel_us']:.1f} us kernel, cos {r['cosine']:.6f}")
