"""Where does the NVFP4 quantise kernel spend its time? Variants that leave one stage out or change it.

Run on a GPU: ``python3 experiments/nvfp4_quantize_variants.py [--out DIR]``. Each variant is the
shipped kernel with one change; timings are medians over the same 16384 x 16384 bf16 input. Only ``exact`` variants
can replace the shipped kernel; the others bound what a stage costs. Results go to docs/history/nvfp4.md.
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
from lynn_kernels.runtime import div_rn_by


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
        q = div_rn_by(blocks, dv, tl.broadcast_to(r[:, :, None], (BLOCK_R, BLOCK_K // 16, 16)), False)
    if ENCODE == 1:
        nib = _e2m1_encode(q, False)
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
        (0, 1, "v3: div_rn + bit-rounding encode (fma for codes 0-2)", True),
        (2, 1, "v3 + RN reciprocal per block, Markstein FMA per element (shipped)", True),
        (1, 1, "v3 with multiply by reciprocal (inexact)", False),
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
    rows += layout_sweep(n)
    best = {}
    for r in rows:
        if r["variant"] not in best or r["gbps"] > best[r["variant"]]["gbps"]:
            best[r["variant"]] = r
    mark = markstein_exhaustive()
    print("Markstein vs div_rn:", mark)
    doc = {"experiment": "nvfp4.quantize variants", "shape": [n, n], "bytes": nbytes, "provenance": provenance(),
           "rows": rows, "best": list(best.values()), "markstein_vs_div_rn": mark}
    if args.out:
        with open(f"{args.out}/nvfp4_quantize_variants.json", "w") as f:
            json.dump(doc, f, indent=1)
    for r in best.values():
        print(f"{r['variant']:<55} {r['block']:>9} w{r['num_warps']}  {r['median_ms']:.3f} ms  "
              f"{r['gbps']:7.0f} GB/s  mismatches {r['mismatches']}")
    return 0



@triton.jit
def _variant3d_kernel(w_ptr, codes_ptr, scales_ptr, g_ptr, R, K, stride_wr,
                      DIV: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """Tile loaded straight as [rows, blocks, 16] so the block reduction and the scale broadcast need no reshape."""
    pid_r = tl.program_id(0)
    pid_k = tl.program_id(1)
    NB: tl.constexpr = BLOCK_K // 16
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_b = pid_k * NB + tl.arange(0, NB)
    offs_e = tl.arange(0, 16)
    mask_r = offs_r < R
    mask_b = mask_r[:, None] & (offs_b[None, :] < K // 16)                       # [BR, NB]
    ptrs = (w_ptr + offs_r[:, None, None].to(tl.int64) * stride_wr + offs_b[None, :, None] * 16
            + offs_e[None, None, :])
    w = tl.load(ptrs, mask=mask_b[:, :, None], other=0.0).to(tl.float32)        # [BR, NB, 16]
    g = tl.load(g_ptr)
    bam_bits = tl.max(w.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=2)
    bam = bam_bits.to(tl.float32, bitcast=True)
    s = tl.div_rn(bam, 6.0 * g)
    s = tl.where(s == 0, 1.0, tl.minimum(s, 448.0))
    s_val, s_code = _e4m3_round(s)
    divisor = (s_val * g)[:, :, None]
    if DIV == 0:
        q = tl.div_rn(w, divisor)
    else:
        r = tl.div_rn(tl.full(divisor.shape, 1.0, tl.float32), divisor)
        q = div_rn_by(w, divisor, r, False)
    nib = tl.reshape(_e2m1_encode(q, False), (BLOCK_R, NB, 8, 2))
    lo, hi = tl.split(nib)
    packed = lo | (hi << 4)                                                        # [BR, NB, 8]
    offs_c = offs_b[None, :, None] * 8 + tl.arange(0, 8)[None, None, :]
    tl.store(codes_ptr + offs_r[:, None, None].to(tl.int64) * (K // 2) + offs_c, packed, mask=mask_b[:, :, None])
    tl.store(scales_ptr + offs_r[:, None].to(tl.int64) * (K // 16) + offs_b[None, :], s_code, mask=mask_b)


def layout_sweep(n: int = 16384) -> list[dict]:
    w = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    g = (w.abs().amax().float() / 2688.0).reshape(1)
    want = reference.quantize(w, g)
    nbytes = 2 * w.numel() + w.numel() // 2 + w.numel() // 16
    rows = []
    for div, name in ((1, "3-D tile, Markstein, v3 encode"),):
        for br, bk, nw in ((4, 1024, 4), (8, 512, 4), (16, 256, 4), (8, 1024, 8), (16, 512, 8), (2, 2048, 4),
                           (32, 256, 8), (4, 512, 2)):
            codes = torch.empty(n, n // 2, dtype=torch.uint8, device="cuda")
            scales = torch.empty(n, n // 16, dtype=torch.uint8, device="cuda")
            grid = (triton.cdiv(n, br), triton.cdiv(n, bk))

            def fn():
                _variant3d_kernel[grid](w, codes, scales, g, n, n, w.stride(0), DIV=div, BLOCK_R=br, BLOCK_K=bk,
                                        num_warps=nw)

            fn()
            mism = int((codes != want.codes).sum().item()) + int((scales != want.scales.view(torch.uint8))
                                                                   .sum().item())
            med, _, _ = time_fn(fn)
            rows.append({"variant": name, "exact_expected": True, "mismatches": mism, "block": f"{br}x{bk}",
                         "num_warps": nw, "median_ms": med, "gbps": nbytes / med / 1e6})
    return rows


def markstein_exhaustive(count: int = 1 << 26) -> dict:
    """Markstein against div_rn on random x and divisors, all-ones significands included."""
    x = torch.randn(count, device="cuda") * 100
    d = torch.rand(count, device="cuda") * 1000 + 1e-3
    d[: count // 8] = (torch.full((count // 8,), 0x3FFFFFFF, dtype=torch.int32, device="cuda")
                       .view(torch.float32) * torch.exp2(torch.randint(-20, 20, (count // 8,), device="cuda")))
    out_a = torch.empty_like(x)
    out_b = torch.empty_like(x)
    _markstein_check_kernel[(triton.cdiv(count, 1024),)](x, d, out_a, out_b, count, BLOCK=1024)
    return {"pairs": count, "mismatches": int((out_a.view(torch.int32) != out_b.view(torch.int32)).sum().item())}


@triton.jit
def _markstein_check_kernel(x_ptr, d_ptr, a_ptr, b_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=1.0)
    d = tl.load(d_ptr + offs, mask=m, other=1.0)
    r = tl.div_rn(tl.full(d.shape, 1.0, tl.float32), d)
    tl.store(a_ptr + offs, tl.div_rn(x, d), mask=m)
    tl.store(b_ptr + offs, div_rn_by(x, d, r, False), mask=m)


if __name__ == "__main__":
    sys.exit(main())
