"""H200: the packed GEMV with its weights in L2 and loads that let them stay there: its compute floor.

``experiments/l2_prefetch.py``'s "warm" GEMV (the same weight every call) read its weights with ``evict_first``, which
may keep them out of L2 (``experiments/l2_read_warm.py`` checks that on a pure read). Here the shipped kernel is
compiled a second time with the default eviction policy on its weight loads (a copy of its module with that one
keyword changed; the library is untouched) and both are timed cold (rotating weight sets past 3x the L2) and warm
(one weight), M = 1, PDL launches, CUDA-graph replay; outputs compared bit for bit with the shipped launch.

If the default-policy warm GEMV is much faster than the cold one, the GEMV waits on DRAM and asking L2 for the
weights ahead of time is worth building; if not, it is bound by its own instructions.

Writes ``$OUT/gemv_l2_floor.json``; prints a table.

    PYTHONPATH=. python3 experiments/gemv_l2_floor.py
"""

import importlib.util
import json
import os
import tempfile

import torch

import lynn_kernels.matmul.triton_packed as shipped_mod
from lynn_kernels import runtime
from lynn_kernels.bench.harness import l2_bytes, provenance
from lynn_kernels.bench.matmul_graph import graph_us
from lynn_kernels.matmul import pack
from lynn_kernels.matmul.triton_packed import _packed_gemv_constexprs, launch_packed_gemv, packed_gemv_config
from lynn_kernels.metrics import bit_mismatches
from lynn_kernels.nvfp4 import quantize

OUT = os.environ.get("OUT", "out")
os.makedirs(OUT, exist_ok=True)
BF16 = torch.bfloat16
SMS = torch.cuda.get_device_properties(0).multi_processor_count

src = open(shipped_mod.__file__).read()
src = src.replace("from ..runtime import", "from lynn_kernels.runtime import")
assert src.count('eviction_policy="evict_first"') >= 2
src = src.replace('eviction_policy="evict_first"', 'eviction_policy=""')
tmp = tempfile.mkdtemp()
path = os.path.join(tmp, "triton_packed_normal.py")
open(path, "w").write(src)
spec = importlib.util.spec_from_file_location("triton_packed_normal", path)
normal = importlib.util.module_from_spec(spec)
spec.loader.exec_module(normal)


def launch_normal(x2, w, y):
    m, k = x2.shape
    n = w.shape[0]
    kw = w.words.shape[1]
    meta = packed_gemv_config(n, k, SMS, m)
    spec_ = (x2.dtype, None, y.dtype, runtime.next_power_of_2(m), meta["BLOCK_N"], meta["TW"], n % meta["BLOCK_N"] == 0,
             kw % meta["TW"] == 0 and 8 * kw == k, True, False)
    grid = (runtime.cdiv(n, meta["BLOCK_N"]),)
    normal.packed_gemv_kernel[grid](x2, w.words, w.scales, w.global_scale, y, y, m, n, k, kw, x2.stride(0),
                                    x2.stride(1), y.stride(0), w.rows_per_global(), **_packed_gemv_constexprs(*spec_),
                                    num_warps=meta["num_warps"], num_stages=1, launch_pdl=True)
    return y


res = {"provenance": provenance("python3 experiments/gemv_l2_floor.py"), "rows": []}
print(f"{'shape':30s} {'cold EF':>8s} {'warm EF':>8s} {'cold':>8s} {'warm':>8s}  us (EF: evict_first, shipped)")
for label, n, k in [("GDN qkv|z fused 2048->12288", 12288, 2048), ("GDN qkv 2048->8192", 8192, 2048),
                    ("o / out proj 4096->2048", 2048, 4096)]:
    wbytes = n * k // 2 + n * k // 16
    sets = [pack(quantize(torch.randn(n, k, device="cuda", dtype=BF16)))
            for _ in range(max(8, -(-3 * l2_bytes() // wbytes)))]
    x = torch.randn(1, k, device="cuda", dtype=BF16)
    ys = [torch.empty(1, n, device="cuda", dtype=BF16) for _ in sets]
    want = launch_packed_gemv(x, sets[0], None, torch.empty(1, n, device="cuda", dtype=BF16))
    row = {"shape": label, "N": n, "K": k, "bytes": wbytes,
           "mismatches_normal": bit_mismatches(launch_normal(x, sets[0], torch.empty_like(ys[0])), want)}
    row["cold_ef_us"] = graph_us([lambda p=p, y=y: launch_packed_gemv(x, p, None, y, pdl=True) for p, y in zip(sets, ys)])
    row["warm_ef_us"] = graph_us([lambda y=y: launch_packed_gemv(x, sets[0], None, y, pdl=True) for y in ys])
    row["cold_normal_us"] = graph_us([lambda p=p, y=y: launch_normal(x, p, y) for p, y in zip(sets, ys)])
    row["warm_normal_us"] = graph_us([lambda y=y: launch_normal(x, sets[0], y) for y in ys])
    res["rows"].append(row)
    print(f"{label:30s} {row['cold_ef_us']:8.2f} {row['warm_ef_us']:8.2f} {row['cold_normal_us']:8.2f} "
          f"{row['warm_normal_us']:8.2f}  mism {row['mismatches_normal']}", flush=True)
    del sets
json.dump(res, open(os.path.join(OUT, "gemv_l2_floor.json"), "w"), indent=1)
