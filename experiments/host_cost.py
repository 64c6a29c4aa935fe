"""H200 host: what one packed GEMV call costs on the CPU side, layer by layer (the issue's item 5), for one
decoder shape at M = 1. Each figure is the wall time of 2,000 back-to-back calls divided by 2,000 (the GPU work,
~5 us, runs behind the host, so the loop is host-bound). Writes JSON to $OUT and prints a table.

    PYTHONPATH=. python3 experiments/host_cost.py
"""

import json
import os

import torch

from lynn_kernels.bench.harness import host_us, provenance
from lynn_kernels.bench.matmul_graph import empty_launch
from lynn_kernels.matmul import nvfp4_linear, pack
from lynn_kernels.matmul.triton_packed import launch_packed_gemv, packed_gemv_kernel
from lynn_kernels.nvfp4 import dequantize, quantize
from lynn_kernels.triton_shared import kernel_constexprs

n, k = 4096, 2048
q = quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16))
p, wb = pack(q), dequantize(q)
x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
y = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
f = kernel_constexprs(x.dtype, None, y.dtype, False, True)
raw_args = (x, p.words, p.scales, p.global_scale, y, y, 1, n, k, p.words.shape[1], x.stride(0), x.stride(1),
            y.stride(0), n)
raw_kw = dict(HAS_BIAS=False, X_DTYPE=f["X_DTYPE"], BIAS_DTYPE=f["BIAS_DTYPE"], OUT_DTYPE=f["OUT_DTYPE"], BLOCK_M=1,
              BLOCK_N=16, TW=128, EVEN_N=True, EVEN_K=True, USE_PDL=False, EARLY_RELEASE=False, INTERPRET=False,
              num_warps=4,
              num_stages=1)
rows = {
    "empty Triton kernel, 1 argument": host_us(lambda: empty_launch(x)),
    "packed_gemv_kernel[grid](...) (14 arguments, 12 constexprs)": host_us(
        lambda: packed_gemv_kernel[(n // 16,)](*raw_args, **raw_kw)),
    "launch_packed_gemv (config, constexprs, launch)": host_us(lambda: launch_packed_gemv(x, p, None, y)),
    "nvfp4_linear (dispatch, checks, output allocation, launch)": host_us(lambda: nvfp4_linear(x, p)),
    "torch.nn.functional.linear (cuBLAS bf16)": host_us(lambda: torch.nn.functional.linear(x, wb)),
}
out = os.environ.get("OUT", "out")
os.makedirs(out, exist_ok=True)
json.dump({"shape": [n, k], "M": 1, "us_per_call": rows, "provenance": provenance("python3 experiments/host_cost.py")},
          open(os.path.join(out, "host_cost.json"), "w"), indent=1)
for name, us in rows.items():
    print(f"{us:8.2f} us  {name}")
