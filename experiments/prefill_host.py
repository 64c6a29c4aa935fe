"""H200: where the host's time goes in a 2,048-token prefill. The benchmark measures that prefill at about twice
its kernels' time (144 ms against 72 ms at 1adc9f2), so the host, not the GPU, sets its speed. This runs the same
prefill of the random Qwen3.5 model (``lynn_model.loader.random_model``) three ways:

1. timed from the host, and its kernels by the CUDA profiler (the benchmark's two figures);
2. with ``torch.cuda.set_sync_debug_mode("warn")``: every operation that makes the host wait for the GPU, with the
   line of ours that called it (a wait lets the GPU drain, and the host then launches into an idle GPU);
3. under ``cProfile``: the functions the host spends its time in (own time and with callees), ours and Triton's;
4. each Triton launch's host time, by kernel (``JITFunction.run`` and ``Autotuner.run`` wrapped: the time from the
   call to its return, which includes our launcher's checks only where they sit inside the kernel's call);
5. each module kind's host time against its GPU time (forward hooks; the host's time from entering the module's
   forward to leaving it, the GPU's from CUDA events recorded at the same two points): where the host takes longer
   than the GPU, that part of the prefill cannot keep the GPU busy.

Writes ``$OUT/prefill_host.json`` and prints the tables.

    PYTHONPATH=. python3 experiments/prefill_host.py [preset] [tokens]

Without a GPU it runs on the CPU (the interpreter: a smoke test of the script, its figures meaningless).
"""

import collections
import cProfile
import io
import json
import os
import pstats
import sys
import time
import traceback
import warnings

import torch

import lynn_model
from lynn_kernels.bench.harness import kernel_ms, provenance
from lynn_model.loader import random_model

OUT = os.environ.get("OUT", "out")
os.makedirs(OUT, exist_ok=True)
name = sys.argv[1] if len(sys.argv) > 1 else "qwen3.5-35b-a3b"
T = int(sys.argv[2]) if len(sys.argv) > 2 else 2048
res = {"provenance": provenance(f"python3 experiments/prefill_host.py {name} {T}"), "tokens": T}
DEV = "cuda" if torch.cuda.is_available() else "cpu"
model = random_model(lynn_model.preset(name), weights="nvfp4", device=DEV, seed=0)
cache = model.new_cache(max_batch=1, max_tokens=T + 64)
ids = torch.randint(0, model.config.vocab_size, (T,), generator=torch.Generator().manual_seed(1)).to(DEV)
sync = torch.cuda.synchronize if DEV == "cuda" else (lambda: None)


def prefill():
    s = cache.add()
    with torch.no_grad():
        model.step(ids, cache, [s], [T])
    cache.release(s)


for _ in range(2):                                       # compile and autotune
    prefill()
sync()

# 1. host time and kernel time
host = []
for _ in range(5):
    sync()
    t0 = time.perf_counter()
    prefill()
    sync()
    host.append((time.perf_counter() - t0) * 1e3)
host.sort()
res["host_ms"] = host
res["kernel_ms"] = kernel_ms(prefill, n=3) if DEV == "cuda" else float("nan")
launch = []                                              # the host's own time: the call returns before the GPU ends
for _ in range(5):
    sync()
    t0 = time.perf_counter()
    prefill()
    launch.append((time.perf_counter() - t0) * 1e3)
    sync()
res["host_return_ms"] = sorted(launch)

# 2. synchronising operations, by the line of ours that called them
syncs = collections.Counter()
if DEV == "cuda":
    torch.cuda.set_sync_debug_mode("warn")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    prefill()
if DEV == "cuda":
    torch.cuda.set_sync_debug_mode(0)
for w in caught:
    syncs[str(w.message)[:80]] += 1
res["sync_warnings"] = dict(syncs)
stack_syncs = collections.Counter()


def _where():
    for fr in reversed(traceback.extract_stack()[:-2]):
        if "/lynn_" in fr.filename:
            return f"{fr.filename.split('/')[-2]}/{fr.filename.split('/')[-1]}:{fr.lineno} {fr.name}"
    return "?"


saved = {}
for meth in ("item", "tolist", "cpu", "__bool__", "__int__", "nonzero"):
    f = saved[meth] = getattr(torch.Tensor, meth)

    def wrap(self, *a, _f=f, _m=meth, **k):
        if self.device.type == DEV:
            stack_syncs[f"{_m} at {_where()}"] += 1
        return _f(self, *a, **k)
    setattr(torch.Tensor, meth, wrap)
prefill()
res["host_reads"] = dict(stack_syncs)
for meth, f in saved.items():                            # the plain methods again: the profile below is of them
    setattr(torch.Tensor, meth, f)

# 3. cProfile
prof = cProfile.Profile()
prof.enable()
prefill()
sync()
prof.disable()
for key in ("tottime", "cumulative"):
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(30)
    res[f"cprofile_{key}"] = buf.getvalue()

# 4. each Triton launch's host time, by kernel
from triton.runtime.autotuner import Autotuner  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

_depth = [0]


def launch_table():
    """Wrap every kernel's ``run`` with a timer; returns the table and an undo."""
    table = collections.defaultdict(lambda: [0, 0.0])
    undo = []
    seen = set()
    for mname, mod in list(sys.modules.items()):
        if not mname.startswith("lynn_kernels") or mod is None:
            continue
        for obj in list(vars(mod).values()):
            if not isinstance(obj, (JITFunction, Autotuner)) or id(obj) in seen:
                continue
            seen.add(id(obj))
            label = " (autotuned)" if isinstance(obj, Autotuner) else ""
            name = getattr(getattr(obj, "fn", obj), "__name__", "?")
            had = "run" in obj.__dict__
            inner = obj.run

            def run(*a, _inner=inner, _key=name + label, **k):
                _depth[0] += 1
                t0 = time.perf_counter()
                try:
                    return _inner(*a, **k)
                finally:
                    _depth[0] -= 1
                    if _depth[0] == 0:                   # the outermost call: an autotuner's own run counts once
                        e = table[_key]
                        e[0] += 1
                        e[1] += (time.perf_counter() - t0) * 1e3
            obj.run = run
            undo.append((obj, had, inner))

    def restore():
        for obj, had, inner in undo:
            if had:
                obj.run = inner
            else:
                del obj.run
    return table, restore


sync()
table, restore = launch_table()
t0 = time.perf_counter()
prefill()
res["launch_pass_ms"] = (time.perf_counter() - t0) * 1e3
sync()
restore()
res["launches"] = {k: v for k, v in sorted(table.items(), key=lambda kv: -kv[1][1])}

# a microbenchmark: the host cost of one small launch, through the public op and through the launch function alone
if DEV == "cuda":
    from lynn_kernels.norm import rmsnorm
    from lynn_kernels.norm.triton_rmsnorm import launch_rmsnorm
    xs = torch.randn(1, model.config.hidden_size, device=DEV, dtype=torch.bfloat16)
    ws = torch.randn(model.config.hidden_size, device=DEV, dtype=torch.bfloat16)
    outs = torch.empty_like(xs)
    micro = {}
    for what, f in (("rmsnorm() public op", lambda: rmsnorm(xs, ws)),
                    ("launch_rmsnorm (launch only)", lambda: launch_rmsnorm(xs, ws, 1e-6, None, outs, None)),
                    ("torch.empty_like", lambda: torch.empty_like(xs))):
        for _ in range(50):
            f()
        sync()
        t0 = time.perf_counter()
        for _ in range(2000):
            f()
        micro[what] = (time.perf_counter() - t0) / 2000 * 1e6
        sync()
    res["micro_us"] = micro

# 5. each module kind's host time against its GPU time
kinds = collections.defaultdict(lambda: [0, 0.0, []])
hooks = []
if DEV == "cuda":
    def pre(mod, _a, _kw=None):
        mod._lynn_t = (time.perf_counter(), torch.cuda.Event(enable_timing=True))
        mod._lynn_t[1].record()

    def post(mod, _a, _o, _kw=None):
        t_host = (time.perf_counter() - mod._lynn_t[0]) * 1e3
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        e = kinds[type(mod).__name__]
        e[0] += 1
        e[1] += t_host
        e[2].append((mod._lynn_t[1], end))

    for layer in model.layers:
        for m in (layer.mixer, layer.mlp, layer.input_layernorm, layer.post_attention_layernorm):
            hooks.append(m.register_forward_pre_hook(pre))
            hooks.append(m.register_forward_hook(post))
    sync()
    t0 = time.perf_counter()
    prefill()
    sync()
    res["hooked_pass_ms"] = (time.perf_counter() - t0) * 1e3
    for h in hooks:
        h.remove()
    res["module_host_gpu_ms"] = {k: {"calls": n, "host_ms": h, "gpu_ms": sum(a.elapsed_time(b) for a, b in ev)}
                                 for k, (n, h, ev) in kinds.items()}
json.dump(res, open(os.path.join(OUT, "prefill_host.json"), "w"), indent=1)

print(f"{name}, {T} tokens: host {host[len(host) // 2]:.1f} ms (returns after {launch[len(launch) // 2]:.1f} ms), "
      f"kernels {res['kernel_ms']:.1f} ms")
print("synchronising operations:", dict(syncs) or "none")
print("host reads of device values, by caller:")
for k, v in stack_syncs.most_common(20):
    print(f"  {v:4d}  {k}")
print(res["cprofile_tottime"][:3000])
tab = res["launches"]
print(f"launches by kernel (a pass of {res['launch_pass_ms']:.1f} ms host): calls, host ms, us a call")
for k, (n, ms) in list(tab.items())[:12]:
    print(f"  {k:56s} {n:5d} {ms:8.2f} {1e3 * ms / n:8.1f}")
tot_n = sum(n for n, _ in tab.values())
tot_ms = sum(ms for _, ms in tab.values())
print(f"  {'all':56s} {tot_n:5d} {tot_ms:8.2f} {1e3 * tot_ms / max(tot_n, 1):8.1f}")
for k, v in res.get("micro_us", {}).items():
    print(f"  micro: {k:40s} {v:7.1f} us a call")
if "module_host_gpu_ms" in res:
    print(f"module kinds (a hooked pass of {res['hooked_pass_ms']:.1f} ms): calls, host ms, GPU ms")
    for k, v in res["module_host_gpu_ms"].items():
        print(f"  {k:24s} {v['calls']:4d} {v['host_ms']:8.2f} {v['gpu_ms']:8.2f}")
