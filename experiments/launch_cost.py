"""H200: the host cost of one kernel launch, through Triton's own path and through the launch cache of
``experiments/fastlaunch_proto.py`` (rejected: docs/history/prefill.md, "The prefill's host time").

Times 2,000 back-to-back launches of a small kernel (the RMSNorm of one 2,048-wide row, ~2 us on the GPU, so the
host sets the pace) four ways: the public op, our launch function alone, each with Triton's path and the fast path;
checks the fast path took the launches (its counters) and that both paths give the same bits, also for a tensor
whose address is not 16-byte aligned after an aligned one (a different specialisation). Writes
``$OUT/launch_cost.json``.

    PYTHONPATH=. python3 experiments/launch_cost.py
"""

import json
import os
import time

import fastlaunch_proto as fastlaunch  # experiments/fastlaunch_proto.py (not part of the package: rejected)
import torch
import triton

from lynn_kernels.bench.harness import provenance
from lynn_kernels.norm import rmsnorm
from lynn_kernels.norm.triton_rmsnorm import _rmsnorm_kernel, launch_rmsnorm

OUT = os.environ.get("OUT", "out")
os.makedirs(OUT, exist_ok=True)
res = {"provenance": provenance("python3 experiments/launch_cost.py")}
res["installed"] = fastlaunch.install()
fr = _rmsnorm_kernel.__dict__.get("run")
res["rmsnorm_run"] = type(fr).__name__
res["launch_hooks_set"] = fastlaunch._launch_hooks_set()
knobs = getattr(triton, "knobs", None)
res["launch_enter_hook"] = repr(getattr(getattr(knobs, "runtime", None), "launch_enter_hook", "n/a"))
D = 2048
x = torch.randn(1, D, device="cuda", dtype=torch.bfloat16)
w = torch.randn(D, device="cuda", dtype=torch.bfloat16)
out = torch.empty_like(x)
big = torch.randn(8 * D + 1, device="cuda", dtype=torch.bfloat16)
x_odd = big[1:D + 1].view(1, D)                       # 2-byte aligned, not 16
res_odd = big[D + 1:2 * D + 1].view(1, D)


def bits(f):
    with fastlaunch.enabled(f):
        a = rmsnorm(x, w)
        b = rmsnorm(x_odd, w)
        c, d = rmsnorm(x_odd, w, residual=res_odd)
        e = rmsnorm(x, w)
    torch.cuda.synchronize()
    return [t.clone() for t in (a, b, c, d, e)]


ref, fast = bits(False), bits(True)
res["bit_equal"] = all(torch.equal(p, q) for p, q in zip(ref, fast))
micro = {}
cases = (("rmsnorm() public op", lambda: rmsnorm(x, w)),
         ("launch_rmsnorm (launch only)", lambda: launch_rmsnorm(x, w, 1e-6, None, out, None)))
times = {}
for _ in range(7):                                    # the two paths interleaved: this host's speed drifts
    for what, f in cases:
        for mode in (False, True):
            with fastlaunch.enabled(mode):
                for _ in range(50):
                    f()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(2000):
                    f()
                times.setdefault(f"{what}, {'fast path' if mode else 'Triton path'}", []).append(
                    (time.perf_counter() - t0) / 2000 * 1e6)
                torch.cuda.synchronize()
micro = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
last = _rmsnorm_kernel.__dict__["run"].last if res["rmsnorm_run"] == "_FastRun" else None
if last is not None:                                  # the floor: the compiled kernel's launcher, arguments ready
    hit, (g0, g1, g2, stream), vals = last
    best = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(2000):
            hit.run(g0, g1, g2, stream, hit.function, hit.packed_metadata, None, None, None, *vals)
        best.append((time.perf_counter() - t0) / 2000 * 1e6)
        torch.cuda.synchronize()
    micro["the compiled kernel's launcher alone"] = sorted(best)[2]
res["micro_us"] = micro
res["fast_stats"] = {k: list(v) for k, v in fastlaunch.stats().items()}
json.dump(res, open(os.path.join(OUT, "launch_cost.json"), "w"), indent=1)
for k in ("installed", "rmsnorm_run", "launch_hooks_set", "launch_enter_hook", "bit_equal", "fast_stats"):
    print(f"{k}: {res[k]}")
for k, v in micro.items():
    print(f"  {k:48s} {v:6.1f} us a call (median of 7 x 2,000)")

# the 2,048-token prefill of the random Qwen3.5 model, the two paths interleaved, its logits compared bit for bit
import lynn_model  # noqa: E402
from lynn_model.loader import random_model  # noqa: E402

T = 2048
model = random_model(lynn_model.preset("qwen3.5-35b-a3b"), weights="nvfp4", device="cuda", seed=0)
cache = model.new_cache(max_batch=1, max_tokens=T + 64)
ids = torch.randint(0, model.config.vocab_size, (T,), generator=torch.Generator().manual_seed(1)).to("cuda")


def prefill():
    s = cache.add()
    with torch.no_grad():
        lg = model.step(ids, cache, [s], [T])
    cache.release(s)
    return lg


logits = {}
for mode in (False, True):
    with fastlaunch.enabled(mode):
        for _ in range(2):
            logits[mode] = prefill()
torch.cuda.synchronize()
res["prefill_logits_bit_equal"] = bool(torch.equal(logits[False], logits[True]))
pt = {False: [], True: []}
for _ in range(9):
    for mode in (False, True):
        with fastlaunch.enabled(mode):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            prefill()
            torch.cuda.synchronize()
            pt[mode].append((time.perf_counter() - t0) * 1e3)
res["prefill_ms"] = {"Triton path": sorted(pt[False]), "fast path": sorted(pt[True])}
res["fast_stats"] = {k: list(v) for k, v in fastlaunch.stats().items()}
json.dump(res, open(os.path.join(OUT, "launch_cost.json"), "w"), indent=1)
print("prefill logits bit-equal:", res["prefill_logits_bit_equal"])
for k, v in res["prefill_ms"].items():
    print(f"  prefill {T} tokens, {k:12s}: median {v[len(v) // 2]:.1f} ms (min {v[0]:.1f}, max {v[-1]:.1f}): "
          f"{T / v[len(v) // 2] * 1e3:,.0f} tok/s")
print("fast launches / misses by kernel:", res["fast_stats"])
