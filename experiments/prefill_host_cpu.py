"""CPU: the host's own cost of a prefill, with every Triton kernel launch stubbed out (no interpreter run).

On the H200's host a 2,048-token prefill of the Qwen3.5 model spends more time in Python than its kernels take on
the GPU (``prefill_host.py``, docs/history/prefill.md). This runs the same model code on the CPU with the layer
structure of a real preset (its 40 layers, 256 experts, top 8) but narrow widths, and with
``InterpretedFunction.run`` replaced by a counter, so what is left is our Python, torch's operations on small
tensors and the launches' argument handling on our side: a proxy for the host's share that needs no GPU. Prints the
time per prefill, launches per prefill, and a cProfile of our functions (own time).

    python experiments/prefill_host_cpu.py [preset] [tokens] [--profile]

Figures are this CPU's, not the H200 host's; compare runs on one machine only.
"""

import collections
import cProfile
import dataclasses
import io
import os
import pstats
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton.runtime.interpreter as interp  # noqa: E402

import lynn_kernels  # noqa: E402
import lynn_model  # noqa: E402
from lynn_model.loader import random_model  # noqa: E402

name = sys.argv[1] if len(sys.argv) > 1 and not sys.argv[1].startswith("-") else "qwen3.5-35b-a3b"
T = int(sys.argv[2]) if len(sys.argv) > 2 and not sys.argv[2].startswith("-") else 2048
base = lynn_model.preset(name)
cfg = dataclasses.replace(base, vocab_size=512, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=64, rotary_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                          linear_key_head_dim=32, linear_value_head_dim=32, moe_intermediate_size=32,
                          shared_expert_intermediate_size=32 if base.shared_expert_intermediate_size else 0,
                          intermediate_size=64 if base.intermediate_size else 0)
torch.manual_seed(0)
with lynn_kernels.use_reference():                      # quantise with the torch reference: the interpreter is slow
    model = random_model(cfg, weights="nvfp4", device="cpu", seed=0)
cache = model.new_cache(max_batch=1, max_tokens=T + 64)
ids = torch.randint(0, cfg.vocab_size, (T,), generator=torch.Generator().manual_seed(1))
launches = collections.Counter()


def stub(self, *args, grid, warmup, **kwargs):
    launches[self.fn.__name__] += 1


interp.InterpretedFunction.run = stub


def prefill():
    s = cache.add()
    with torch.no_grad():
        model.step(ids, cache, [s], [T])
    cache.release(s)


prefill()
launches.clear()
times = []
for _ in range(7):
    t0 = time.perf_counter()
    prefill()
    times.append((time.perf_counter() - t0) * 1e3)
times.sort()
n = sum(launches.values()) // 7
print(f"{name} layout, narrow widths, {T} tokens, kernels stubbed: host {times[3]:.1f} ms a prefill "
      f"(min {times[0]:.1f}), {n} launches a prefill")
for k, v in launches.most_common():
    print(f"  {v // 7:5d}  {k}")
if "--profile" in sys.argv:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(3):
        prefill()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(45)
    print(buf.getvalue())
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats("lynn_", 60)
    print(buf.getvalue())
