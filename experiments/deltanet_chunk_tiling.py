"""Experiment (GPU only): the chunked deltanet's state-scan tiling (value columns per program, warps, pipeline
stages) and the output kernel's value block, at the Qwen shape (B=1, T=16384, 16/32 heads, d 128), by kernel time.

Recorded run: commit 42d1008f5fbb, H200, torch 2.11 / triton 3.6, 2026-11-29, result in
``data/experiments/deltanet-chunk-tiling/results.json``. The two output-block overrides (32, 128) ended in an illegal memory
access on that run, not investigated (the shipped 64 validates). Run: ``PYTHONPATH=. python3 experiments/deltanet_chunk_tiling.py``.
"""
import collections
import itertools
import json
import os

import torch

from lynn_kernels.bench.deltanet import _prefill_inputs
from lynn_kernels.deltanet import reference as dref
from lynn_kernels.deltanet.spec import Dims
from lynn_kernels.deltanet.triton_chunk import launch_chunk
from lynn_kernels.metrics import compare


def per_kernel(fn, n=10):
    fn(); torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(n): fn()
        torch.cuda.synchronize()
    acc = collections.defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            acc[e.name[:40]] += e.time_range.elapsed_us() / n
    return acc

rows = []
for T in [16384]:
    q, k, v, g, beta = _prefill_inputs(T)
    o_ref, s_ref = dref.chunk_gated_delta_rule(q.float(), k.float(), v.float(), g, beta, None, None, True, True)
    dims = Dims(1, T, 16, 32, 128, 128)
    o = torch.empty(1, T, 32, 128, device="cuda", dtype=torch.bfloat16)
    fin = torch.empty(1, 32, 128, 128, device="cuda")
    configs = [dict(state_block_v=bv, state_warps=w, state_stages=st, out_block_v=ob)
               for bv, w, st in itertools.product([16, 32, 64], [4, 8], [1, 2, 3]) for ob in [64]]
    configs += [dict(out_block_v=ob) for ob in [32, 128]]
    for cfg in configs:
        try:
            fn = lambda: launch_chunk(q, k, v, g, beta, dims, 128 ** -0.5, None, True, o, fin, cfg)
            o.fill_(float("nan")); fn()
            cos = compare(o, o_ref).cosine; scos = compare(fin, s_ref).cosine
            pk = per_kernel(fn)
            r = dict(T=T, cfg=cfg, cos=cos, state_cos=scos, state_us=pk.get("_chunk_state_kernel", 0),
                     out_us=pk.get("_chunk_output_kernel", 0), total_us=sum(pk.values()))
        except Exception as e:
            r = dict(T=T, cfg=cfg, error=f"{type(e).__name__}: {str(e)[:120]}")
        rows.append(r)
        print(r, flush=True)
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "explore8.json"), "w"), indent=1)
ok = sorted((r for r in rows if "error" not in r), key=lambda r: r["state_us"])
print("best state:", ok[:3])
print("best out:", sorted(ok, key=lambda r: r["out_us"])[:2])
