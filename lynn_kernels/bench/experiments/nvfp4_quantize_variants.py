"""Where does the NVFP4 quantise kernel spend its time? Variants that leave one stage out or change it.

Run on a GPU: ``python -m lynn_kernels.bench.experiments.nvfp4_quantize_variants [--out DIR]``. Each variant is the
shipped kernel with one change; timings are medians over the same 16384 x 16384 bf16 input. Only ``exact`` variants
can replace the shipped kernel; the others bound what a stage costs. Results go to docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
import triton.language as tl

from lynn_kernels.bench.harness import provenance, time_fn
from lynn_kernels.nvfp4 import reference
from lynn_kernels.nvfp4.triton_quant import _e2m1_encode, _e4m3_round


@triton.jit
def _e2m1_encode_thresholds(q):
    """First version: count the thresholds passed, in uint8 (exact, but about 2x the instructions)."""
    a = tl.abs(q)
    mag = ((a > 0.25).to(tl.uint8) + (a >= 0.75).to(tl.uint8) + (a > 1.25).to(tl.uint8)
           + (a >= 1.75).to(tl.uint8) + (a > 2.5).to(tl.uint8) + (a >= 3.5).to(tl.uint8)
           + (a > 5.0).to(tl.uint8))
    mag = tl.where(a != a, 7, mag).to(tl.uint8)
    return mag | ((q < 0).to(tl.uint8) << 3)


@triton.jit
def _div_markstein(x, d, r):
    """Correctly rounded x / d from r = RN(1/d): q0 = RN(x r), residual exact by FMA, one corrected step."""
    q0 = x * r
    e = tl.fma(-q0, d, x)
    return tl.fma(e, r, q0)


@triton.jit
def _variant_kernel(w_ptr, codes_ptr, scales_ptr, g_ptr, R, K, stride_wr,
                    DIV: tl.constexpr, ENCODE: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_r = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_r = offs_r < R
    mask = mask_r[:, None] & (offs_k[None, :] < K)
    w = tl.load(w_ptr + offs_r[:, None].to(tl.int64) * stride_wr + offs_k[None, :], mask=mask, other=0.0)
    w = w.to(tl.float32)
    g = tl.load(g_ptr)
    blocks = tl.reshape(w, (BLOCK_R, BLOCK_K // 16, 16))
    bam = tl.max(tl.abs(blocks), axis=2)
    s = tl.div_rn(bam, 6.0 * g)
    s = tl.where(s == 0, 1.0, tl.minimum(s, 448.0))
    s_val, s_code = _e4m3_round(s)
    divisor = s_val * g
    dv = tl.broadcast_to(divisor[:, :, None], (BLOCK_R, BLOCK_K // 16, 16))
    if DIV == 0:      # shipped: IEEE division per element
        q = tl.div_rn(blocks, dv)
    elif DIV == 1:    # approximate: multiply by a reciprocal (NOT exact, a lower bound on division cost)
        q = blocks * tl.broadcast_to((1.0 / divisor)[:, :, None], (BLOCK_R, BLOCK_K // 16, 16))
    else:             # exact: per-block RN reciprocal, then a Markstein correction per element
        r = tl.div_rn(tl.full(divisor.shape, 1.0, tl.float32), divisor)
        q = _div_markstein(blocks, dv, tl.broadcast_to(r[:, :, None], (BLOCK_R, BLOCK_K // 16, 16)))
    if ENCODE == 1:
        nib = _e2m1_encode(q)
    elif ENCODE == 2:
        nib = _e2m1_encode_thresholds(q)
    else:
        nib = (q > 0).to(tl.uint8)
    nib = tl.reshape(nib, (BLOCK_R, BLOCK_K // 2, 2))
    lo, hi = tl.split(nib)
    packed = lo | (hi << 4)
    offs_c = pid_k * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
    tl.store(codes_ptr + offs_r[:, None].to(tl.int64) * (K // 2) + offs_c[None, :], packed,
             mask=mask_r[:, None] & (offs_c[None, :] < K // 2))
    offs_s = pid_k * (BLOCK_K // 16) + tl.arange(0, BLOCK_K // 16)
    tl.store(scales_ptr + offs_r[:, None].to(tl.int64) * (K // 16) + offs_s[None, :], s_code,
             mask=mask_r[:, None] & (offs_s[None, :] < K // 16))


def dequant_sweep() -> list[dict]:
    """Tile shapes for the dequantise kernel at two sizes (the autotuned list is a subset)."""
    from lynn_kernels.nvfp4 import quantize
    from lynn_kernels.nvfp4.triton_quant import _nvfp4_dequantize_kernel

    kernel = _nvfp4_dequantize_kernel.fn
    rows = []
    for n in (8192, 16384):
        q = quantize(torch.randn(n, n, device="cuda", dtype=torch.bfloat16))
        want = reference.dequantize(q)
        nbytes = q.codes.numel() + q.scales.numel() + 2 * n * n
        for br, bk, nw in ((16, 256, 4), (16, 512, 8), (32, 512, 8), (64, 512, 8), (32, 1024, 8), (16, 1024, 8),
                           (64, 256, 8), (128, 256, 8), (8, 2048, 8), (64, 1024, 16)):
            out = torch.empty(n, n, dtype=torch.bfloat16, device="cuda")
            grid = (triton.cdiv(n, br), triton.cdiv(n, bk))

            def fn():
                kernel[grid](q.codes, q.scales.view(torch.uint8), q.global_scale, out, n, n, n,
                             OUT_DTYPE=tl.bfloat16, BLOCK_R=br, BLOCK_K=bk, INTERPRET=False, num_warps=nw)

            fn()
            mism = int((out.view(torch.int16) != want.view(torch.int16)).sum().item())
            med, _, _ = time_fn(fn)
            rows.append({"variant": f"dequantize {n}x{n}", "exact_expected": True, "mismatches": mism,
                         "block": f"{br}x{bk}", "num_warps": nw, "median_ms": med, "gbps": nbytes / med / 1e6})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--n", type=int, default=16384)
    args = ap.parse_args(argv)
    n = args.n
    w = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    g = (w.abs().amax().float() / 2688.0).reshape(1)
    want = reference.quantize(w, g)
    nbytes = 2 * w.numel() + w.numel() // 2 + w.numel() // 16
    rows = []
    for div, enc, name, exact in (
        (0, 2, "v1: div_rn + threshold-count encode (uint8)", True),
        (0, 1, "v2: div_rn + bit-rounding encode", True),
        (2, 1, "v2 + RN reciprocal per block, Markstein FMA per element", True),
        (1, 1, "v2 with multiply by reciprocal (inexact)", False),
        (0, 0, "no E2M1 encode (inexact)", False),
        (1, 0, "neither division nor encode (inexact)", False),
    ):
        for br, bk, nw in ((16, 256, 4), (8, 512, 4), (32, 256, 8), (16, 512, 8), (4, 1024, 4), (64, 128, 8),
                           (8, 256, 2), (32, 128, 4)):
            codes = torch.empty(n, n // 2, dtype=torch.uint8, device="cuda")
            scales = torch.empty(n, n // 16, dtype=torch.uint8, device="cuda")
            grid = (triton.cdiv(n, br), triton.cdiv(n, bk))

            def fn():
                _variant_kernel[grid](w, codes, scales, g, n, n, w.stride(0), DIV=div, ENCODE=enc,
                                      BLOCK_R=br, BLOCK_K=bk, num_warps=nw)

            fn()
            mism = int((codes != want.codes).sum().item()) + int((scales != want.scales.view(torch.uint8))
                                                                   .sum().item())
            med, p20, p80 = time_fn(fn)
            rows.append({"variant": name, "exact_expected": exact, "mismatches": mism, "block": f"{br}x{bk}",
                         "num_warps": nw, "median_ms": med, "gbps": nbytes / med / 1e6})
    rows += dequant_sweep()
    best = {}
    for r in rows:
        if r["variant"] not in best or r["gbps"] > best[r["variant"]]["gbps"]:
            best[r["variant"]] = r
    doc = {"experiment": "nvfp4.quantize variants", "shape": [n, n], "bytes": nbytes, "provenance": provenance(),
           "rows": rows, "best": list(best.values())}
    if args.out:
        with open(f"{args.out}/nvfp4_quantize_variants.json", "w") as f:
            json.dump(doc, f, indent=1)
    for r in best.values():
        print(f"{r['variant']:<55} {r['block']:>9} w{r['num_warps']}  {r['median_ms']:.3f} ms  "
              f"{r['gbps']:7.0f} GB/s  mismatches {r['mismatches']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
