"""H200: the packed tensor-core GEMV (fragment-order layout, decoded in registers) against the packed GEMV and cuBLAS
bf16, M = 1..16 on the decoder's projection shapes, by CUDA-graph replay of rotating weight sets; tile configs
swept; the GEMM at M = 512 and 4096 on three shapes (autotuned) against cuBLAS; exactness first on awkward shapes
for every dtype. Writes $OUT/packed_mma_sweep.json as it goes (a timeout keeps what was measured) and prints a
table.

    PYTHONPATH=. python3 experiments/packed_mma_sweep.py
"""

import json
import os
import sys
import time

import torch
import torch.nn.functional as F

from lynn_kernels.bench.harness import provenance
from lynn_kernels.bench.matmul_graph import graph_us, n_sets
from lynn_kernels.matmul import nvfp4_linear, pack, reference
from lynn_kernels.matmul.triton_matmul import launch_gemm, launch_gemv
from lynn_kernels.matmul.triton_packed import launch_packed_gemv
from lynn_kernels.metrics import compare
from lynn_kernels.nvfp4 import dequantize, quantize

out_dir = os.environ.get("OUT", "out")
os.makedirs(out_dir, exist_ok=True)
path = os.path.join(out_dir, "packed_mma_sweep.json")
res = {"exact": [], "gemv": [], "gemm": [], "provenance": provenance("python3 experiments/packed_mma_sweep.py")}
T0 = time.time()


def save():
    json.dump(res, open(path, "w"), indent=1)


torch.manual_seed(0)
EPS = {torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11, torch.float32: 1e-5}

# 1. exactness: awkward shapes, M = 1..17 and up, every dtype, the default dispatch and the tensor-core GEMV forced
bad = 0
for (n, k) in [(1, 16), (37, 208), (65, 1040), (130, 48), (4097, 2064), (2048, 4096)]:
    q = quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16))
    p = pack(q)
    for m in (1, 2, 3, 5, 8, 16, 17, 64, 300):
        for dt in (torch.bfloat16, torch.float16, torch.float32):
            x = torch.randn(m, k, device="cuda", dtype=dt)
            ref = reference.nvfp4_linear(x, q)
            outs = {"dispatch": nvfp4_linear(x, p)}
            if m <= 16:
                y = torch.empty(m, n, device="cuda", dtype=dt)
                outs["mma-gemv"] = launch_gemv(x, p, None, y).clone()
                if m <= 8:
                    outs["mma-gemv-bm8"] = launch_gemv(x, p, None, y, {"BLOCK_M": 8}).clone()
            for name, y in outs.items():
                mt = compare(y, ref)
                ok = bool(torch.isfinite(y).all()) and mt.rel_l2 <= EPS[dt]
                bad += not ok
                res["exact"].append({"N": n, "K": k, "M": m, "dtype": str(dt), "path": name, "rel_l2": mt.rel_l2,
                                     "max_abs": mt.max_abs, "ok": ok})
save()
print(f"exactness: {len(res['exact']) - bad}/{len(res['exact'])} within bounds ({time.time() - T0:.0f} s)", flush=True)

# 2. GEMV M = 1..16: tensor-core configs, packed GEMV (M <= 2), cuBLAS
SHAPES = [(8192, 2048), (4096, 2048), (2048, 4096), (2048, 512), (12288, 2048), (248320, 2048), (8192, 8192)]
CFGS = [None, {"BLOCK_M": 8}, {"num_stages": 2}, {"num_stages": 4}, {"BLOCK_K": 512},
        {"BLOCK_N": 128, "num_warps": 8}, {"BLOCK_N": 128, "num_warps": 4}, {"BLOCK_N": 32, "num_warps": 2},
        {"BLOCK_M": 8, "BLOCK_K": 512, "num_stages": 3}]
for (n, k) in SHAPES:
    wb = n * k // 2 + n * k // 16
    qs = [quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16)) for _ in range(n_sets(wb))]
    sets = [pack(q) for q in qs]
    dense = [dequantize(q, torch.bfloat16) for q in qs[:n_sets(2 * n * k)]]
    del qs
    for m in (1, 2, 4, 8, 16):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        rows = []
        cub = graph_us([lambda d=d, x=x: F.linear(x, d) for d in dense])
        rows.append(("cublas bf16", None, cub))
        if m <= 2:
            rows.append(("fma", None, graph_us([lambda p=p, x=x, y=y: launch_packed_gemv(x, p, None, y) for p in sets])))
            rows.append(("fma+pdl", None, graph_us([lambda p=p, x=x, y=y: launch_packed_gemv(x, p, None, y, pdl=True)
                                                    for p in sets])))
        for cfg in CFGS:
            if cfg and cfg.get("BLOCK_M") == 8 and m > 8:
                continue
            try:
                us = graph_us([lambda p=p, cfg=cfg, x=x, y=y: launch_gemv(x, p, None, y, cfg) for p in sets])
            except Exception as e:                                               # noqa: BLE001
                print("fail", n, k, m, cfg, repr(e)[:300], flush=True)
                continue
            rows.append(("mma", cfg, us))
        for prov, cfg, us in rows:
            res["gemv"].append({"N": n, "K": k, "M": m, "provider": prov, "config": cfg or "default", "us": us,
                                "tbps": wb / us / 1e6, "vs_cublas": cub / us})
            print(f"{n:>6} x {k:<5} M={m:<2} {prov:<11} {str(cfg or 'default'):<52} {us:8.2f} us "
                  f"{wb / us / 1e6:5.2f} TB/s {cub / us:5.2f}x", flush=True)
        save()
    del sets, dense
    torch.cuda.empty_cache()
    print(f"-- {time.time() - T0:.0f} s", flush=True)

# 3. GEMM M = 512, 4096 (autotuned on the packed layout) against cuBLAS, first three shapes
for (n, k) in SHAPES[:3]:
    q = quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16))
    p, d = pack(q), dequantize(q, torch.bfloat16)
    for m in (512, 4096):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        ok = compare(launch_gemm(x, p, None, y), reference.nvfp4_linear(x, q)).rel_l2 <= EPS[torch.bfloat16]
        ours = graph_us([lambda x=x, p=p, y=y: launch_gemm(x, p, None, y)] * 8)
        cub = graph_us([lambda x=x, d=d: F.linear(x, d)] * 8)
        tf = 2 * m * n * k / 1e6
        res["gemm"].append({"N": n, "K": k, "M": m, "ours_us": ours, "cublas_us": cub, "ratio": cub / ours,
                            "ours_tflops": tf / ours, "cublas_tflops": tf / cub, "ok": ok})
        print(f"GEMM {n} x {k} M={m}: ours {ours:.1f} us ({tf / ours:.0f} TFLOP/s), cuBLAS {cub:.1f} us, "
              f"{cub / ours:.2f}x, exact {ok}", flush=True)
        save()
save()
print(f"done in {time.time() - T0:.0f} s")
sys.exit(1 if bad else 0)
