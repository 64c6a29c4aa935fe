"""H200: which words a thread of the packed GEMV owns, timed at M = 1, 2 on the decoder's shapes by CUDA-graph
replay: ``STRIDED`` (four words at a stride of 4, whose x is 32 contiguous elements) against 16-byte runs (whose x
is exchanged between threads), each over a few tiles, beside the tensor-core GEMV and cuBLAS bf16; exactness of
both on awkward shapes first. Writes $OUT/packed_fma_order.json and prints a table.

    PYTHONPATH=. python3 experiments/packed_fma_order.py

It ran at git 4825ed7, where the packed GEMV took the ``STRIDED`` flag; the flag went once it had measured (the
stride-4 form lost everywhere), so run it at that commit to repeat it.
"""

import json
import os
import sys
import time

import torch
import torch.nn.functional as F

from lynn_kernels.bench.harness import provenance
from lynn_kernels.bench.matmul_graph import graph_us, n_sets
from lynn_kernels.matmul import pack, reference
from lynn_kernels.matmul.triton_matmul import launch_gemv
from lynn_kernels.matmul.triton_packed import launch_packed_gemv
from lynn_kernels.metrics import compare
from lynn_kernels.nvfp4 import dequantize, quantize

out_dir = os.environ.get("OUT", "out")
os.makedirs(out_dir, exist_ok=True)
path = os.path.join(out_dir, "packed_fma_order.json")
res = {"exact": [], "timing": [], "provenance": provenance("python3 experiments/packed_fma_order.py")}
T0 = time.time()
torch.manual_seed(0)
EPS = {torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11, torch.float32: 1e-5}
bad = 0
for (n, k) in [(37, 208), (4097, 2064), (2048, 4096)]:
    q = quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16))
    p = pack(q)
    for m in (1, 2, 3, 4):
        for dt in EPS:
            x = torch.randn(m, k, device="cuda", dtype=dt)
            ref = reference.nvfp4_linear(x, q)
            for strided in (True, False):
                y = launch_packed_gemv(x, p, None, torch.empty(m, n, device="cuda", dtype=dt), {"STRIDED": strided})
                mt = compare(y, ref)
                ok = bool(torch.isfinite(y).all()) and mt.rel_l2 <= EPS[dt]
                bad += not ok
                res["exact"].append({"N": n, "K": k, "M": m, "dtype": str(dt), "strided": strided,
                                     "rel_l2": mt.rel_l2, "ok": ok})
print(f"exactness: {len(res['exact']) - bad}/{len(res['exact'])} within bounds", flush=True)

SHAPES = [(8192, 2048), (4096, 2048), (2048, 4096), (2048, 512), (12288, 2048), (248320, 2048), (8192, 8192)]
for (n, k) in SHAPES:
    wb = n * k // 2 + n * k // 16
    qs = [quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16)) for _ in range(n_sets(wb))]
    sets = [pack(q) for q in qs]
    dense = [dequantize(q, torch.bfloat16) for q in qs[:n_sets(2 * n * k)]]
    del qs
    for m in (1, 2):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        cub = graph_us([lambda d=d, x=x: F.linear(x, d) for d in dense])
        rows = [("cublas bf16", None, False, cub),
                ("tensor-core", None, False, graph_us([lambda p=p, x=x, y=y: launch_gemv(x, p, None, y)
                                                       for p in sets]))]
        for strided in (True, False):
            for cfg in (None, {"BLOCK_N": 8}, {"BLOCK_N": 32}, {"num_warps": 2}):
                c = {**(cfg or {}), "STRIDED": strided}
                for pdl in ((False, True) if cfg is None else (False,)):
                    us = graph_us([lambda p=p, c=c, pdl=pdl, x=x, y=y: launch_packed_gemv(x, p, None, y, c, pdl=pdl)
                                   for p in sets])
                    rows.append(("fma strided" if strided else "fma runs", cfg, pdl, us))
        for prov, cfg, pdl, us in rows:
            res["timing"].append({"N": n, "K": k, "M": m, "provider": prov, "config": cfg or "default", "pdl": pdl,
                                  "us": us, "tbps": wb / us / 1e6, "vs_cublas": cub / us})
            print(f"{n:>6} x {k:<5} M={m} {prov:<12} {str(cfg or 'default'):<18} pdl={pdl!s:<5} {us:8.2f} us "
                  f"{wb / us / 1e6:5.2f} TB/s {cub / us:5.2f}x", flush=True)
        json.dump(res, open(path, "w"), indent=1)
    del sets, dense
    torch.cuda.empty_cache()
print(f"done in {time.time() - T0:.0f} s")
sys.exit(1 if bad else 0)
