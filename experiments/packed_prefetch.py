"""H200: the packed GEMM and tensor-core GEMV asking L2 for their weight rows ``PREFETCH`` steps ahead, against the
plain loop, at one stage (``runtime.register_dot_stages`` on Triton 3.6) and in one process with cuBLAS bf16.

For the decoder's three GEMM shapes at M = 512 and 4096 every packed GEMM tile at PREFETCH 0, 1 and 2
(explicit configs, one stage), the autotuned dispatch (``nvfp4_linear``) and cuBLAS; for the tensor-core GEMV
(M = 1 on the LM head, 4 and 16 on every shape) its config at PREFETCH 0, 1 and 2. Every output is checked
against the same tile's plain loop (bit-equal: the prefetch changes no arithmetic) and the reference. CUDA-graph replay
on rotating weight sets (``graph_us``). Writes ``$OUT/packed_prefetch.json`` and prints tables.

    PYTHONPATH=. python3 experiments/packed_prefetch.py

Run it at git 286151a: the ``PREFETCH`` option measured slower in 27 of 34 cells (GEMV config; the GEMM by its
best tile)
(``data/experiments/packed-prefetch/286151a.json``) and was removed after that run.
"""

import json
import os

import torch

from lynn_kernels.bench.harness import l2_bytes, provenance
from lynn_kernels.bench.matmul_graph import graph_us
from lynn_kernels.matmul import nvfp4_linear, pack, reference
from lynn_kernels.matmul.triton_matmul import _GEMM_SHAPES, launch_gemm, launch_gemv
from lynn_kernels.metrics import bit_mismatches, compare
from lynn_kernels.nvfp4 import dequantize, quantize

OUT = os.environ.get("OUT", "out")
os.makedirs(OUT, exist_ok=True)
res = {"provenance": provenance("python3 experiments/packed_prefetch.py"), "gemm": [], "gemv": [], "bad": 0}
torch.manual_seed(0)


def n_sets(nbytes):
    return max(4, min(64, -(-3 * l2_bytes() // nbytes)))


def save():
    json.dump(res, open(os.path.join(OUT, "packed_prefetch.json"), "w"), indent=1)


GEMM = [("qkv 2048->8192", 8192, 2048), ("z 2048->4096", 4096, 2048), ("out 4096->2048", 2048, 4096)]
GEMV = GEMM + [("square 8192", 8192, 8192), ("lm head 2048->248320", 248320, 2048)]
TILES = [s for s in _GEMM_SHAPES if s[2] % 128 == 0]

for label, n, k in GEMV:
    wbytes = n * k // 2 + n * k // 16
    qs = [quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16)) for _ in range(n_sets(wbytes))]
    sets = [pack(q) for q in qs]
    bsets = [dequantize(q) for q in qs[:n_sets(2 * n * k)]]
    for m in ((1, 4, 16) if n > 65536 else (4, 16)) + ((512, 4096) if (label, n, k) in GEMM else ()):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        want = reference.nvfp4_linear(x, qs[0])
        cublas = graph_us([lambda b=b: torch.nn.functional.linear(x, b) for b in bsets])
        if m <= 16:
            first = None
            for pf in (0, 1, 2):
                cfg = {"PREFETCH": pf}
                got = launch_gemv(x, sets[0], None, torch.empty_like(y), cfg)
                first = got if first is None else first
                mism = bit_mismatches(got, first)
                rel = compare(got, want).rel_l2
                res["bad"] += mism > 0 or rel > 2 ** -8
                us = graph_us([lambda p=p, cfg=cfg: launch_gemv(x, p, None, y, cfg) for p in sets])
                res["gemv"].append({"shape": label, "M": m, "PREFETCH": pf, "us": us, "cublas_us": cublas,
                                    "mismatches": mism, "rel_l2": rel})
                print(f"gemv {label:24s} M={m:5d} PREFETCH={pf}  {us:8.2f} us  cuBLAS {cublas:8.2f}  "
                      f"{cublas / us:5.2f}x  mism {mism}", flush=True)
            continue
        disp = graph_us([lambda p=p: nvfp4_linear(x, p) for p in sets])
        res["gemm"].append({"shape": label, "M": m, "config": "dispatch (autotuned, PREFETCH 0)", "us": disp,
                            "cublas_us": cublas})
        best = {}
        for bn, bm, bk, w, _ in TILES:
            if bm > max(16, m):
                continue
            first = None                                      # this tile's plain loop: the bits to match
            for pf in (0, 1, 2):
                cfg = {"BLOCK_N": bn, "BLOCK_M": bm, "BLOCK_K": bk, "num_warps": w, "num_stages": 1, "PREFETCH": pf}
                try:
                    got = launch_gemm(x, sets[0], None, torch.empty_like(y), config=cfg)
                    first = got if first is None else first
                    mism = bit_mismatches(got, first)
                    rel = compare(got, want).rel_l2
                    us = graph_us([lambda p=p, cfg=cfg: launch_gemm(x, p, None, y, config=cfg) for p in sets])
                except Exception as e:                                               # noqa: BLE001
                    print("fail", label, m, cfg, repr(e)[:160], flush=True)
                    continue
                res["bad"] += mism > 0 or rel > 2 ** -8
                res["gemm"].append({"shape": label, "M": m, "config": cfg, "us": us, "cublas_us": cublas,
                                    "mismatches_vs_plain": mism, "rel_l2": rel})
                if pf not in best or us < best[pf][1]:
                    best[pf] = (f"{bn}x{bm}x{bk}/{w}w", us)
        print(f"gemm {label:24s} M={m:5d} dispatch {disp:8.2f}  cuBLAS {cublas:8.2f}  " +
              "  ".join(f"PF{pf} {b[0]} {b[1]:8.2f} ({cublas / b[1]:.2f}x)" for pf, b in sorted(best.items())),
              flush=True)
    del qs, sets, bsets
    torch.cuda.empty_cache()
    save()
print(f"outputs off the reference (rel_l2 > 2^-8) or off the plain loop's bits: {res['bad']}")
save()
