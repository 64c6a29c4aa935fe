"""Experiment (GPU only): per-kernel CUDA time of one ``moe_block`` call (Qwen3.5 shape: 256 experts, top-8,
2048 -> 512; M = 1, 16, 4096), to see where the block's time goes.

Recorded run: commit c2c8d10 (the FMA decode kernels and the fused router; the first run, commit 9373b79, is in
``docs/moe.md`` section 4), H200, torch 2.11 / triton 3.6, 2026-11-29, output in
``data/experiments/moe-profile/results.txt`` (us per call, by kernel). Run: ``PYTHONPATH=. python3 experiments/moe_profile.py``.
"""
import collections

import torch

from lynn_kernels.moe import moe_block
from lynn_kernels.nvfp4 import quantize

E,k,H,I=256,8,2048,512
g=torch.Generator(device="cuda").manual_seed(0)
w13=quantize(torch.randn(E,2*I,H,device="cuda",dtype=torch.bfloat16,generator=g)*0.05)
w2=quantize(torch.randn(E,H,I,device="cuda",dtype=torch.bfloat16,generator=g)*0.05)
r=torch.randn(E,H,device="cuda",dtype=torch.bfloat16,generator=g)*0.05
for M in (1,16,4096):
    xs=[torch.randn(M,H,device="cuda",dtype=torch.bfloat16,generator=g) for _ in range(16)]
    i=[0]
    def f():
        i[0]+=1; return moe_block(xs[i[0]%16],r,w13,w2,top_k=k)
    for _ in range(3): f()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
        for _ in range(20): f()
        torch.cuda.synchronize()
    acc=collections.defaultdict(float)
    for e in p.events():
        if e.device_type==torch.autograd.DeviceType.CUDA: acc[e.name[:50]]+=e.time_range.elapsed_us()/20
    print(f"M={M}: " + "; ".join(f"{n} {u:.1f}" for n,u in sorted(acc.items(), key=lambda kv:-kv[1])))
