"""Experiment (GPU only): the decode split count, the prefill host path, and where the deltanet chunk's time goes.

* ``launch_decode`` kernel time (profiler) for 8..256 KV splits at B in {1, 8}, L in {4096, 32768}, contiguous and
  paged, split kernel and merge kernel apart (the shipped rule's choice is starred);
* ``flash_attention`` call time against kernel time at T = 4096 (a host stall shows as a gap);
* ``chunk_gated_delta_rule`` per-kernel times next to fla's at T = 4096 and 16384.

Recorded run: commit 4c21c1d5b8c5, H200, torch 2.11 / triton 3.6, fla 0.6.0, 2026-11-29, result in
``data/experiments/h200-profile-decode-prefill-chunk/results.json``. Run: ``PYTHONPATH=. python3 experiments/h200_profile_decode_prefill_chunk.py`` (fla importable for its rows; JSON under $OUT).
"""
import collections
import json
import os

import torch
import triton.testing

from lynn_kernels.attention import flash_attention
from lynn_kernels.attention import reference as aref
from lynn_kernels.attention.triton_decode import default_num_splits, launch_decode
from lynn_kernels.bench.attention import _paged_copy
from lynn_kernels.bench.deltanet import _prefill_inputs
from lynn_kernels.bench.harness import kernel_ms
from lynn_kernels.deltanet import chunk_gated_delta_rule
from lynn_kernels.deltanet import reference as dref
from lynn_kernels.metrics import compare

out = {}
def per_kernel(fn, n=20):
    fn(); torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(n): fn()
        torch.cuda.synchronize()
    acc = collections.defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            acc[e.name[:60]] += e.time_range.elapsed_us() / n
    return dict(sorted(acc.items(), key=lambda kv: -kv[1]))

# 1. decode splits
HQ, HKV, D = 16, 2, 256
bf = torch.bfloat16
res = []
for b, L in [(1, 4096), (1, 32768), (8, 4096), (8, 32768)]:
    sets = []
    for _ in range(max(1, (3 * 60 << 20) // (2 * b * L * HKV * D * 2) + 1)):
        sets.append((torch.randn(b, HQ, D, device="cuda", dtype=bf), torch.randn(b, L, HKV, D, device="cuda", dtype=bf),
                     torch.randn(b, L, HKV, D, device="cuda", dtype=bf)))
    lens = torch.full((b,), L, dtype=torch.int32, device="cuda")
    want = aref.decode_attention(sets[0][0].float(), sets[0][1].float(), sets[0][2].float(), lens)
    gen = torch.Generator().manual_seed(0)
    kp, vp, table = _paged_copy(sets[0][1], sets[0][2], gen)
    default = default_num_splits(b, HKV, L)
    for splits in [8, 16, 32, 64, 128, 256]:
        outb = torch.empty(b, HQ, D, device="cuda", dtype=bf)
        work = (torch.empty(b, HQ, splits, D, device="cuda", dtype=torch.float32), torch.empty(b, HQ, splits, device="cuda", dtype=torch.float32))
        i = [0]
        def call():
            q, k, v = sets[i[0] % len(sets)]; i[0] += 1
            return launch_decode(q, k, v, lens, None, None, outb, splits, D ** -0.5, workspace=work)
        cos = compare(launch_decode(*sets[0], lens, None, None, outb, splits, D ** -0.5, workspace=work), want).cosine
        km = kernel_ms(call)
        pk = per_kernel(call)
        paged = kernel_ms(lambda: launch_decode(sets[0][0], kp, vp, lens, table, None, outb, splits, D ** -0.5, workspace=work))
        gbps = 2 * b * L * HKV * D * 2 / km / 1e6
        res.append(dict(B=b, L=L, splits=splits, default=default, kernel_us=km * 1e3, gbps=gbps, paged_us_same_set=paged * 1e3, cos=cos, per_kernel=pk))
        print(f"decode B{b} L{L} splits {splits:4d}{'*' if splits == default else ' '} {km*1e3:8.1f} us {gbps:7.0f} GB/s paged {paged*1e3:8.1f} us cos {cos:.6f} {list(pk.values())[:2]}", flush=True)
    del sets, kp, vp
out["decode_splits"] = res

# 2. prefill host path after the cached offsets
for t in [4096]:
    q = torch.randn(t, HQ, D, device="cuda", dtype=bf); k = torch.randn(t, HKV, D, device="cuda", dtype=bf); v = torch.randn(t, HKV, D, device="cuda", dtype=bf)
    f = lambda: flash_attention(q, k, v)
    call = triton.testing.do_bench(f, quantiles=[0.5])
    km = kernel_ms(f)
    out["prefill_host"] = dict(T=t, call_us=call * 1e3, kernel_us=km * 1e3)
    print(f"prefill T{t} call {call*1e3:.1f} us kernel {km*1e3:.1f} us", flush=True)
    del q, k, v
torch.cuda.empty_cache()

# 3. deltanet chunk per kernel, lynn vs fla
try:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
except Exception as e:
    fla_chunk = None; print("no fla", e)
dn = {}
for T in [4096, 16384]:
    q, k, v, g, beta = _prefill_inputs(T)
    o_ref, s_ref = dref.chunk_gated_delta_rule(q.float(), k.float(), v.float(), g, beta, None, None, True, True)
    lynn = lambda: chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, use_qk_l2norm=True)
    o, s = lynn()
    co, cs = compare(o, o_ref, baseline=o_ref.bfloat16()), compare(s, s_ref)
    row = dict(T=T, lynn_cos_o=co.cosine, lynn_err_ratio=co.err_ratio, lynn_cos_state=cs.cosine,
               lynn_kernel_us=kernel_ms(lynn) * 1e3, lynn_per_kernel=per_kernel(lynn))
    if fla_chunk is not None:
        flaf = lambda: fla_chunk(q, k, v, g=g, beta=beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
        fo, fs = flaf()
        row.update(fla_cos_o=compare(fo, o_ref).cosine, fla_kernel_us=kernel_ms(flaf) * 1e3, fla_per_kernel=per_kernel(flaf))
    dn[T] = row
    print(f"deltanet T{T}: lynn {row['lynn_kernel_us']:.1f} us (cos {co.cosine:.6f}, err_ratio {co.err_ratio:.3f}, state {cs.cosine:.7f}); fla {row.get('fla_kernel_us', float('nan')):.1f} us", flush=True)
    for who in ("lynn_per_kernel", "fla_per_kernel"):
        for name, us in row.get(who, {}).items():
            print(f"   {who[:4]} {us:8.1f} us  {name}")
out["deltanet_chunk"] = dn
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "explore7.json"), "w"), indent=1, default=str)
