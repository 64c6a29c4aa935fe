"""H200: where the host's time goes in a 2,048-token prefill. The benchmark measures that prefill at about twice
its kernels' time (144 ms against 72 ms at 1adc9f2), so the host, not the GPU, sets its speed. This runs the same
prefill of the random Qwen3.5 model (``lynn_model.loader.random_model``) three ways:

1. timed from the host, and its kernels by the CUDA profiler (the benchmark's two figures);
2. with ``torch.cuda.set_sync_debug_mode("warn")``: every operation that makes the host wait for the GPU, with the
   line of ours that called it (a wait lets the GPU drain, and the host then launches into an idle GPU);
3. under ``cProfile``: the functions the host spends its time in (own time and with callees), ours and Triton's.

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
json.dump(res, open(os.path.join(OUT, "prefill_host.json"), "w"), indent=1)

print(f"{name}, {T} tokens: host {host[len(host) // 2]:.1f} ms (returns after {launch[len(launch) // 2]:.1f} ms), "
      f"kernels {res['kernel_ms']:.1f} ms")
print("synchronising operations:", dict(syncs) or "none")
print("host reads of device values, by caller:")
for k, v in stack_syncs.most_common(20):
    print(f"  {v:4d}  {k}")
print(res["cprofile_tottime"][:6000])
