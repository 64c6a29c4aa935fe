"""H200: the packed GEMV's tile sweep at M = 1 (BLOCK_N, warps, TW) by CUDA-graph replay, and its exactness on
awkward shapes for every M and dtype against the fp32 reference (``SWEEP=0``: the exactness part only). Writes
JSON to $OUT (or ./out) and prints a table.

    PYTHONPATH=. python3 experiments/packed_gemv_sweep.py
"""

import json
import os
import sys

import torch

from lynn_kernels.bench.harness import provenance
from lynn_kernels.bench.matmul_graph import graph_us, n_sets
from lynn_kernels.matmul import nvfp4_linear, pack, reference
from lynn_kernels.matmul.triton_packed import launch_packed_gemv
from lynn_kernels.metrics import compare
from lynn_kernels.nvfp4 import quantize

out_dir = os.environ.get("OUT", "out")
os.makedirs(out_dir, exist_ok=True)
res = {"exact": [], "sweep": [], "provenance": provenance("python3 experiments/packed_gemv_sweep.py")}
torch.manual_seed(0)

# exactness: awkward shapes, M = 1..17, every dtype
bad = 0
for (n, k) in [(1, 16), (37, 208), (65, 1040), (130, 48), (4097, 2064), (2048, 4096)]:
    q = quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16))
    p = pack(q)
    for m in (1, 2, 3, 4, 5, 8, 16, 17, 64):
        for dt in (torch.bfloat16, torch.float16, torch.float32):
            x = torch.randn(m, k, device="cuda", dtype=dt)
            y = nvfp4_linear(x, p)
            ref = reference.nvfp4_linear(x, q)
            mt = compare(y, ref)
            eps = {torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11, torch.float32: 1e-5}[dt]
            ok = bool(torch.isfinite(y).all()) and mt.rel_l2 <= (1e-5 if dt == torch.float32 else eps)
            bad += not ok
            res["exact"].append({"N": n, "K": k, "M": m, "dtype": str(dt), "rel_l2": mt.rel_l2,
                                 "max_abs": mt.max_abs, "ok": ok})
print(f"exactness: {len(res['exact']) - bad}/{len(res['exact'])} within bounds", flush=True)

# the tile sweep at M = 1 (and M = 2 for the default); SWEEP=0 skips it
for (n, k) in [] if os.environ.get("SWEEP") == "0" else [(8192, 2048), (4096, 2048), (2048, 4096), (2048, 512), (248320, 2048), (8192, 8192)]:
    wb = n * k // 2 + n * k // 16
    sets = [pack(quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16))) for _ in range(n_sets(wb))]
    for m in (1, 2):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        cfgs = [None] if m > 1 else [None, *[{"BLOCK_N": bn, "TW": tw, "num_warps": w}
                                            for bn, w in ((8, 2), (8, 4), (16, 2), (16, 4), (32, 4), (32, 8))
                                            for tw in (128,)]]
        for cfg in cfgs:
            for pdl in ((False, True) if cfg is None else (False,)):
                try:
                    us = graph_us([lambda p=p, cfg=cfg, pdl=pdl: launch_packed_gemv(x, p, None, y, cfg, pdl=pdl)
                                   for p in sets])
                except Exception as e:                                           # noqa: BLE001
                    print("fail", n, k, m, cfg, repr(e)[:200], flush=True)
                    continue
                res["sweep"].append({"N": n, "K": k, "M": m, "config": cfg or "default", "pdl": pdl, "us": us,
                                     "tbps": wb / us / 1e6})
                print(f"{n:>6} x {k:<5} M={m} {str(cfg or 'default'):<48} pdl={pdl!s:<5} {us:8.2f} us "
                      f"{wb / us / 1e6:5.2f} TB/s", flush=True)
    del sets
    torch.cuda.empty_cache()

json.dump(res, open(os.path.join(out_dir, "packed_gemv_sweep.json"), "w"), indent=1)
sys.exit(1 if bad else 0)
