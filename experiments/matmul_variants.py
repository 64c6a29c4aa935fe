"""Experiment (GPU only): where the packed matmul's time goes, and one alternative kernel orientation.

* kernel time from the CUDA profiler next to ``do_bench`` (which also sees host launch cost when it exceeds the L2
  flush) and the host cost of one call;
* every GEMV config at M = 1 and 16 and every GEMM config at M = 4096, by kernel time;
* the GEMM in the textbook orientation (``acc[M, N] = x @ W^T``, the decoded weight as the second dot operand,
  staged through shared memory) against the shipped one (weight first, from registers);
* registers, spills and whether each compiled kernel uses wgmma.

Run: ``PYTHONPATH=. python3 experiments/matmul_variants.py`` (writes JSON under $OUT or out/).
"""

from __future__ import annotations

import json
import os
import time

import torch
import triton
import triton.language as tl

from lynn_kernels import quantize, runtime
from lynn_kernels import triton_shared as ts
from lynn_kernels.bench.harness import kernel_ms, measure_ceilings, provenance, rotating, rotation, time_fn
from lynn_kernels.matmul import nvfp4_linear, reference
from lynn_kernels.matmul import triton_matmul as tm
from lynn_kernels.metrics import compare
from lynn_kernels.runtime import cast_output, to_float32

#: The GEMV configs compared (BLOCK_M 1 = an fp32 multiply-reduce path, since removed; 16 = tl.dot on padded rows).
GEMV_SWEEP = ([{"BLOCK_M": 1, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w}
               for bn, bk, w in ((16, 512, 4), (32, 256, 4), (8, 1024, 4), (32, 512, 8), (64, 256, 8), (16, 1024, 8))]
              + [{"BLOCK_M": 16, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w}
                 for bn, bk, w in ((64, 256, 4), (32, 512, 4), (128, 256, 8), (64, 512, 8), (128, 128, 4), (16, 512, 4))])


@triton.jit
def _gemm_textbook_kernel(x_ptr, codes_ptr, scales_ptr, g_ptr, y_ptr, M, N, K, stride_xm, stride_ym,
                          X_DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          GROUP_N: tl.constexpr, INTERPRET: tl.constexpr):
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles_m = tl.cdiv(M, BLOCK_M)
    per_group = GROUP_N * tiles_m
    first_n = (pid // per_group) * GROUP_N
    group_n = tl.minimum(tiles_n - first_n, GROUP_N)
    pid_n = first_n + (pid % per_group) % group_n
    pid_m = (pid % per_group) // group_n
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w, s = ts._load_w_tile(codes_ptr, scales_ptr, offs_n, mask_n, k0, K, BLOCK_N, BLOCK_K, INTERPRET)
        wt = ts._scaled(w, s, BLOCK_N, BLOCK_K).to(DOT_DTYPE)                      # [BLOCK_N, BLOCK_K]
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                    mask=mask_m[:, None] & (offs_k[None, :] < K), other=0)
        x = to_float32(x, X_DTYPE, INTERPRET).to(DOT_DTYPE)                        # [BLOCK_M, BLOCK_K]
        acc = tl.dot(x, tl.trans(wt), acc)
    g = tl.load(g_ptr + offs_n * 0, mask=mask_n, other=0.0)
    out = cast_output(acc * g[None, :], OUT_DTYPE, INTERPRET)
    tl.store(y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :], out,
             mask=mask_m[:, None] & mask_n[None, :])


def textbook(x, w, y, bm, bn, bk, warps, stages):
    m, k = x.shape
    n = w.shape[0]
    grid = (runtime.cdiv(m, bm) * runtime.cdiv(n, bn),)
    _gemm_textbook_kernel[grid](x, w.codes, w.scales.view(torch.uint8), w.global_scale, y, m, n, k, x.stride(0),
                                y.stride(0), X_DTYPE=tl.bfloat16, OUT_DTYPE=tl.bfloat16, DOT_DTYPE=tl.bfloat16,
                                BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_N=8, INTERPRET=False,
                                num_warps=warps, num_stages=stages)
    return y


def kernel_us(fn, n: int = 40) -> float:
    """Median GPU duration of the kernels one ``fn()`` launches (CUDA profiler), host time excluded."""
    return kernel_ms(fn, n) * 1e3


def host_us(fn, n: int = 300) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return host


def compiled_facts(jit_fn) -> list[dict]:
    facts = []
    for cache in getattr(jit_fn, "device_caches", {}).values():
        for kern in cache[0].values():
            ptx = kern.asm.get("ptx", "")
            facts.append({"name": kern.metadata.name, "regs": kern.n_regs, "spills": kern.n_spills,
                          "wgmma": "wgmma" in ptx, "mma_sync": "mma.sync" in ptx,
                          "num_warps": kern.metadata.num_warps, "num_stages": kern.metadata.num_stages,
                          "shared": kern.metadata.shared})
    return facts


def main() -> dict:
    out_dir = os.environ.get("OUT", "out")
    doc = {"provenance": provenance("python3 experiments/matmul_variants.py"), "rows": []}
    ceil = measure_ceilings()
    doc["ceilings"] = ceil.as_dict()

    def add(**row):
        doc["rows"].append(row)
        print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)

    shapes = ((4096, 4096, (1, 16)), (8192, 8192, (1, 16)), (2048, 4096, (1,)), (248320, 2048, (1,)),
              (8192, 8192, (4096,)), (4096, 4096, (4096,)))
    if os.environ.get("LYNN_QUICK"):
        shapes = ((4096, 4096, (1, 16)), (8192, 8192, (1,)), (2048, 4096, (1,)), (8192, 8192, (4096,)))
    textbook_on = not os.environ.get("LYNN_QUICK")
    for n, k, ms in shapes:
        nbytes = n * k // 2 + n * k // 16
        sets = rotation(lambda: (quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16)),), nbytes,
                        max_sets=12)
        wb = [(torch.randn(n, k, device="cuda", dtype=torch.bfloat16),) for _ in range(max(1, min(6, len(sets))))]
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            want = reference.nvfp4_linear(x, sets[0][0])
            assert compare(nvfp4_linear(x, sets[0][0]), want).cosine > 0.9999
            lynn = rotating(lambda W: nvfp4_linear(x, W), sets)
            cub = rotating(lambda W: torch.nn.functional.linear(x, W), wb)
            ku, kc = kernel_us(lynn), kernel_us(cub)
            add(kind="auto", N=n, K=k, M=m, lynn_kernel_us=ku, cublas_kernel_us=kc, speedup_kernel=kc / ku,
                lynn_do_bench_us=time_fn(lynn)[0] * 1e3, cublas_do_bench_us=time_fn(cub)[0] * 1e3,
                lynn_host_us=host_us(lynn), cublas_host_us=host_us(cub),
                read_frac=(nbytes + 2 * m * (k + n)) / (ku * 1e-6) / 1e9 / ceil.read_gbps,
                tflops=2 * m * n * k / (ku * 1e-6) / 1e12)
            if m <= 16 and n * k <= 8192 * 8192:
                for cfg in (c for c in GEMV_SWEEP if c["BLOCK_M"] == 16):   # the shipped kernel has the dot path only
                    add(kind="gemv config", N=n, K=k, M=m, config=str(cfg),
                        kernel_us=kernel_us(rotating(lambda W: tm.launch_gemv(x, W, None, y, config=cfg), sets)))
            if m == 4096:
                for c in tm._prune_gemm(tm._gemm_configs(), {"M_BUCKET": 4096}):  # noqa: B007
                    cfg = {**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages}
                    us = kernel_us(rotating(lambda W: tm.launch_gemm(x, W, None, y, config=cfg), sets))
                    add(kind="gemm config", N=n, K=k, M=m, config=str(cfg), kernel_us=us,
                        tflops=2 * m * n * k / (us * 1e-6) / 1e12)
                for bm, bn, bk, warps, stages in () if not textbook_on else ((128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 128, 8, 3),
                                                  (64, 128, 64, 4, 4), (128, 64, 64, 4, 4), (256, 128, 64, 8, 3)):
                    try:
                        got = textbook(x, sets[0][0], y, bm, bn, bk, warps, stages)
                        ok = compare(got, want).cosine > 0.9999
                        us = kernel_us(rotating(lambda W: textbook(x, W, y, bm, bn, bk, warps, stages), sets))
                        add(kind="textbook gemm", N=n, K=k, M=m, config=str((bm, bn, bk, warps, stages)),
                            valid=ok, kernel_us=us, tflops=2 * m * n * k / (us * 1e-6) / 1e12)
                    except Exception as e:  # noqa: BLE001  (an out-of-resources config is a result too)
                        add(kind="textbook gemm", config=str((bm, bn, bk, warps, stages)), error=str(e)[:200])
        del sets, wb
        torch.cuda.empty_cache()
    doc["compiled"] = {"gemv": compiled_facts(tm._nvfp4_gemv_kernel.fn), "gemm": compiled_facts(tm._nvfp4_gemm_kernel.fn),
                       "textbook": compiled_facts(_gemm_textbook_kernel)}
    for f in doc["compiled"]["gemm"] + doc["compiled"]["textbook"]:
        print(f)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "matmul_variants.json"), "w") as fh:
        json.dump(doc, fh, indent=1)
    return doc


if __name__ == "__main__":
    main()
