"""Where does the split-K prefill GEMM go wrong on the H200? ``gdn_determinism.py`` showed that the packed GEMM at
M = 80 with split-K gives, in about one call of 40, an output with elements near 1e31, and that the same GEMM
without split-K did not in 39 calls. This runs the library's GEMM kernel directly at several shapes, tiles and
stage counts, many times each with freed memory scribbled on between calls, keeps the fp32 partial tiles each
split-K call wrote, and tells apart:

* ``partials differ``: a program computed a wrong partial tile (a fault in its main loop, before the ticket);
* ``partials equal, y differs``: the partials were right but the last program read some that were not yet visible
  (the hand-off between programs through the ticket).

It also times each variant (``do_bench`` of the launch with its two allocations) and writes the compiled TTGIR /
PTX of the 64 x 128 x 128 tile at each stage count beside the JSON. What it found on the H200 with Triton 3.6
(``data/experiments/split-k-race/d96117f.json``): the partials themselves were wrong (8 weight rows x every token,
the register-operand wgmma hazard that :func:`lynn_kernels.runtime.register_dot_hazard` describes), at three
stages (4 of 1,000 calls at M = 80; with 8 warps at M = 2,048 every call), never at one. Two stages compile the same
overlap but showed no fault in 2,500 calls. The ticket hand-off and the two-pass reduce (``_gemm_variant`` +
``_reduce``) were never wrong.

    PYTHONPATH=. python3 experiments/split_k_race.py [--runs 2000] [--out $OUT/split_k_race.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl
import triton.testing

from lynn_kernels.matmul import nvfp4_linear, pack
from lynn_kernels.matmul import triton_matmul as tm
from lynn_kernels.nvfp4 import quantize
from lynn_kernels.runtime import cast_output, kernel_view

N, K, SPLIT = 4096, 2048, 4
CONFIG = {"BLOCK_N": 64, "BLOCK_M": 128, "BLOCK_K": 128, "GROUP_N": 8}


@triton.jit
def _gemm_variant(x_ptr, codes_ptr, scales_ptr, g_ptr, y_ptr, part_ptr, count_ptr, M, N, K, stride_xm,
                  stride_ym, ROWS_PER_G, X_DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr,
                  PRECISION: tl.constexpr, PACKED_DECODE: tl.constexpr, ACC_UNIT: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_N: tl.constexpr,
                  MODE: tl.constexpr):
    """The library's packed GEMM writing its fp32 partial tile only (MODE 2): :func:`_reduce` adds them."""
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    n_split = tl.num_programs(1)
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
    n_chunks = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(n_chunks, n_split)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for chunk in range(pid_k * per_split, tl.minimum(pid_k * per_split + per_split, n_chunks)):
        k0 = chunk * BLOCK_K
        offs_k = k0 + tl.arange(0, BLOCK_K)
        xt = tl.load(x_ptr + offs_m[None, :].to(tl.int64) * stride_xm + offs_k[:, None],
                     mask=(offs_k[:, None] < K) & mask_m[None, :], other=0)
        wt = tm.w_tile(codes_ptr, scales_ptr, offs_n, mask_n, k0, K, BLOCK_N, BLOCK_K, DOT_DTYPE,
                       PACKED_DECODE, False, True, ACC_UNIT)
        acc = tl.dot(wt, xt.to(DOT_DTYPE), acc, input_precision=PRECISION)
    mask = mask_n[:, None] & mask_m[None, :]
    offs_t = offs_m[None, :].to(tl.int64) * N + offs_n[:, None]
    tl.store(part_ptr + pid_k.to(tl.int64) * M * N + offs_t, acc, mask=mask)


@triton.jit
def _reduce(part_ptr, g_ptr, y_ptr, MN, N, ROWS_PER_G, n_split, OUT_DTYPE: tl.constexpr, ACC_UNIT: tl.constexpr,
            BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, n_split):
        acc += tl.load(part_ptr + s * MN + offs, mask=mask, other=0.0)
    g = tl.load(g_ptr + (offs % N) // ROWS_PER_G, mask=mask, other=0.0)
    tl.store(y_ptr + offs, cast_output(acc * g * ACC_UNIT, OUT_DTYPE, False), mask=mask)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=2000)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "out"), "split_k_race.json"))
    args = ap.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    w = pack(quantize(torch.randn(N, K, device=dev, generator=gen).mul(0.02).to(torch.bfloat16)))
    xs = {m: (torch.randn(m, K, device=dev, generator=gen) * 0.5).to(torch.bfloat16) for m in (80, 128, 2048)}
    codes, scales, gs = tm._weight_args(w)
    flags = tm.kernel_constexprs(torch.bfloat16, None, torch.bfloat16, False, True)
    count = tm.split_k_counter(dev, 64)
    asm = {}

    def library(m, split, stages, cfg=CONFIG, warps=4):
        """The library's GEMM kernel launched directly; returns (y, the fp32 partials or None)."""
        x = xs[m]
        grid = (triton.cdiv(N, cfg["BLOCK_N"]) * triton.cdiv(m, cfg["BLOCK_M"]), split)

        def run():
            part = torch.empty(split * m * N, dtype=torch.float32, device=dev)
            y = torch.empty(m, N, dtype=torch.bfloat16, device=dev)
            k = tm._nvfp4_gemm_kernel.fn[grid](
                kernel_view(x), codes, scales, gs, y, kernel_view(y), part if split > 1 else y, count, m, N, K,
                x.stride(0), 1, y.stride(0), w.rows_per_global(), tm.m_bucket(m), **flags, **cfg,
                num_warps=warps, num_stages=stages)
            asm.setdefault((stages, cfg["BLOCK_M"]), k.asm)
            return y, (part if split > 1 else None)
        return run

    def two_pass(m, stages=3):
        x = xs[m]
        grid = (triton.cdiv(N, CONFIG["BLOCK_N"]) * triton.cdiv(m, CONFIG["BLOCK_M"]), SPLIT)

        def run():
            part = torch.empty(SPLIT * m * N, dtype=torch.float32, device=dev)
            y = torch.empty(m, N, dtype=torch.bfloat16, device=dev)
            _gemm_variant[grid](kernel_view(x), codes, scales, gs, kernel_view(y), part, count, m, N, K,
                                x.stride(0), y.stride(0), w.rows_per_global(), X_DTYPE=flags["X_DTYPE"],
                                OUT_DTYPE=flags["OUT_DTYPE"], DOT_DTYPE=flags["DOT_DTYPE"],
                                PRECISION=flags["PRECISION"], PACKED_DECODE=flags["PACKED_DECODE"],
                                ACC_UNIT=flags["ACC_UNIT"], **CONFIG, MODE=2, num_warps=4, num_stages=stages)
            _reduce[(triton.cdiv(m * N, 1024),)](part, gs, kernel_view(y), m * N, N, w.rows_per_global(), SPLIT,
                                                 OUT_DTYPE=flags["OUT_DTYPE"], ACC_UNIT=flags["ACC_UNIT"],
                                                 BLOCK=1024)
            return y, part
        return run

    big = {"BLOCK_N": 128, "BLOCK_M": 128, "BLOCK_K": 128, "GROUP_N": 8}
    variants = {
        "M=80, split 4, 3 stages (as the decoder runs it)": (library(80, 4, 3), args.runs),
        "M=80, split 4, 2 stages": (library(80, 4, 2), args.runs),
        "M=80, split 4, 1 stage": (library(80, 4, 1), args.runs),
        "M=80, no split, 3 stages": (library(80, 1, 3), args.runs),
        "M=128, split 4, 3 stages": (library(128, 4, 3), args.runs),
        "M=80, two-pass split 4, 3 stages": (two_pass(80), args.runs),
        "M=2048, no split, 128x128x128, 8 warps, 3 stages": (library(2048, 1, 3, big, 8), args.runs // 4),
        "M=2048, no split, 128x128x128, 8 warps, 1 stage": (library(2048, 1, 1, big, 8), args.runs // 4),
        "M=2048, no split, 64x128x128, 4 warps, 3 stages": (library(2048, 1, 3), args.runs // 4),
        "M=2048, no split, 64x128x128, 4 warps, 1 stage": (library(2048, 1, 1), args.runs // 4),
        "nvfp4_linear M=80 as dispatched": (lambda: (nvfp4_linear(xs[80], w), None), args.runs),
    }
    rec = {"git_sha": os.environ.get("LYNN_GIT_SHA"), "weight": [N, K], "config": CONFIG, "runs": args.runs,
           "triton": triton.__version__, "torch": torch.__version__, "variants": []}
    for name, (run, runs) in variants.items():
        y0, p0 = run()
        y0, p0 = y0.clone(), None if p0 is None else p0.clone()
        bad_y = bad_p = 0
        detail = []
        for i in range(runs):
            junk = [torch.empty(12 << 20, dtype=torch.uint8, device=dev).random_(0, 256, generator=gen)
                    for _ in range(16)]
            del junk
            y, p = run()
            if p is not None and not torch.equal(p, p0):
                bad_p += 1
            if not torch.equal(y, y0):
                bad_y += 1
                diff = y != y0
                rows, cols = diff.any(1).nonzero().flatten(), diff.any(0).nonzero().flatten()
                if len(detail) < 8:
                    detail.append({"run": i, "elements": int(diff.sum()), "rows": [int(rows.min()), int(rows.max())],
                                   "cols": [int(c) for c in cols[:32].tolist()],
                                   "max_abs": float((y.float() - y0.float()).abs().nan_to_num(float("inf")).max())})
        ms = triton.testing.do_bench(lambda: run(), warmup=20, rep=200)
        row = {"variant": name, "runs": runs, "y_unequal": bad_y, "partials_unequal": bad_p,
               "tickets_left": int((count != 0).sum()), "call_us": round(ms * 1e3, 1), "detail": detail}
        rec["variants"].append(row)
        print(f"{name:52s} {ms * 1e3:8.1f} us  y unequal {bad_y:4d} / {runs}  partials unequal {bad_p:4d}  "
              f"{[(d['elements'], d['cols'][:1]) for d in detail[:4]]}", flush=True)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(rec, f, indent=1)
    for (stages, bm), a in asm.items():
        for kind in ("ttgir", "ptx"):
            with open(os.path.join(os.path.dirname(args.out) or ".", f"gemm_s{stages}_bm{bm}.{kind}"), "w") as f:
                f.write(a[kind])
    return 0


if __name__ == "__main__":
    sys.exit(main())
