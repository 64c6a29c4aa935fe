"""What does a prefill cost the host on its own, with the GPU's work taken away? (CPU, no GPU needed.)

On the H200's host a 2,048-token prefill of the Qwen3.5 model spends more time in Python than its kernels take on
the GPU (docs/history/prefill.md, "The prefill's host time"). This runs the same model code on the CPU with the layer
structure of a real preset (its layers, experts and top-k) but narrow widths, and with Triton's
``InterpretedFunction.run`` replaced by a counter, so what is left is our Python, torch's operations on small tensors
and the launches' argument handling on our side: a proxy for the host's share. Reports the time per prefill (median
of 7), the launches per prefill by kernel and, with ``--profile``, a cProfile of our functions.

    python experiments/prefill_host_cpu.py [preset] [tokens] [--profile]

Figures are this CPU's, not the H200 host's; compare runs on one machine only. Writes
``data/experiments/prefill-host-cpu/<preset>-<tokens>-<sha>.json`` (``$OUT`` instead when set; the profile is
printed only). The run at 44968cf is ``data/bench/cpu/prefill-host-cpu-44968cf.log``.
"""

import collections
import cProfile
import dataclasses
import io
import json
import os
import pstats
import sys
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton.runtime.interpreter as interp  # noqa: E402

import lynn_kernels  # noqa: E402
import lynn_model  # noqa: E402
from lynn_kernels.bench.harness import provenance  # noqa: E402
from lynn_model.loader import random_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def narrow(base):
    """The preset's layer structure at narrow widths."""
    return dataclasses.replace(base, vocab_size=512, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=64, rotary_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                               linear_key_head_dim=32, linear_value_head_dim=32, moe_intermediate_size=32,
                               shared_expert_intermediate_size=32 if base.shared_expert_intermediate_size else 0,
                               intermediate_size=64 if base.intermediate_size else 0)


def main() -> None:
    pos = [a for a in sys.argv[1:] if not a.startswith("-")]
    name = pos[0] if pos else "qwen3.5-35b-a3b"
    tokens = int(pos[1]) if len(pos) > 1 else 2048
    cfg = narrow(lynn_model.preset(name))
    torch.manual_seed(0)
    with lynn_kernels.use_reference():                  # quantise with the torch reference: the interpreter is slow
        model = random_model(cfg, weights="nvfp4", device="cpu", seed=0)
    cache = model.new_cache(max_batch=1, max_tokens=tokens + 64)
    ids = torch.randint(0, cfg.vocab_size, (tokens,), generator=torch.Generator().manual_seed(1))
    launches = collections.Counter()

    def stub(self, *args, grid, warmup, **kwargs):
        launches[self.fn.__name__] += 1

    interp.InterpretedFunction.run = stub

    def prefill():
        s = cache.add()
        with torch.no_grad():
            model.step(ids, cache, [s], [tokens])
        cache.release(s)

    prefill()
    launches.clear()
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        prefill()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    per = {k: v // 7 for k, v in launches.most_common()}
    res = {"provenance": provenance(), "preset": name, "tokens": tokens, "host_ms_median": times[3],
           "host_ms_min": times[0], "launches_per_prefill": sum(per.values()), "launches_by_kernel": per}
    print(f"{name} layout, narrow widths, {tokens} tokens, kernels stubbed: host {times[3]:.1f} ms a prefill "
          f"(min {times[0]:.1f}), {res['launches_per_prefill']} launches a prefill")
    for k, v in per.items():
        print(f"  {v:5d}  {k}")
    out = Path(os.environ.get("OUT") or ROOT / "data" / "experiments" / "prefill-host-cpu")
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}-{tokens}-{res['provenance']['git_sha'][:7]}.json"
    path.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {path}")
    if "--profile" in sys.argv:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(3):
            prefill()
        prof.disable()
        for key, limits in (("tottime", (45,)), ("cumulative", ("lynn_", 60))):     # all; then ours
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(*limits)
            print(buf.getvalue())


if __name__ == "__main__":
    main()
