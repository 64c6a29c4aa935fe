# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py//py:percent
#     notebook_metadata_filter: -jupytext.text_representation.jupytext_version
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 02: Packed W4A16 matvec and GEMM
#
# A linear layer with NVFP4 weights (notebook 01) and bf16 activations: `y = x W^T`, with `W` read straight from
# its packed codes and scales and never written out in bf16. At batch 1 (decode) this product is limited by how
# fast the weights can be read, so 4-bit weights can make it faster, not only smaller; for long prompts (prefill)
# it is a GEMM limited by the tensor cores. This notebook:
#
# 1. the product and the roofline: why decode is about bytes, and the plan
# 2. the reference
# 3. the kernel step by step: (a) a naive kernel, (b) a tile of rows, (c) split-K with a deterministic reduce,
#    (d) the package's tiled GEMM and its packed bf16x2 decode
# 4. the kernel layout (`pack`): 8 codes in a 32-bit word, decoded by shifts and masks, in the order of the
#    tensor cores' operand; its kernels, and what they measured on the H200
# 5. the validation table
# 6. `NVFP4Linear`: quantisation as a module swap, on a small MLP
# 7. the H200 profile against cuBLAS bf16, from committed results
# 8. an interactive explorer of those results
# 9. what we measured, and what's next
#
# Everything runs on a CPU through Triton's interpreter, on small shapes; on a GPU the same cells run compiled.

# %%
# %matplotlib inline
import lynn_kernels as lk  # noqa: I001  (first: it picks the backend before triton is imported)
import copy
from functools import partial

import matplotlib.pyplot as plt
import torch
import triton
import triton.language as tl
from torch import nn

from lynn_kernels import check, compare, notebook, nvfp4, render_table, triton_shared
from lynn_kernels.bench import load
from lynn_kernels.bench.matmul import SHAPES
from lynn_kernels.matmul import (
    nvfp4_gemm,
    nvfp4_gemv,
    nvfp4_linear,
    quantize_linears,
    reference,
    triton_matmul,
)
from lynn_kernels.notebook import bound, r4
from lynn_kernels.runtime import DEVICE

# cosine to 6 decimals, the error figures as the power of ten at or above them (``bound``): the digits of fp32
# round-off depend on the machine, their order of magnitude does not
rounded = partial(notebook.rounded, cosine=notebook.decimals6, errors=bound)

# %%
# NBVAL_IGNORE_OUTPUT
print(lk.device_summary())

# %% [markdown]
# ## 1. The product, and why decode is about bytes
#
# `x [M, K]` holds M tokens of activations (bf16), `W [N, K]` the weights, and `y = x W^T` is `[M, N]`. With `W`
# in NVFP4 every weight is `e2m1(code) x scale x g` (notebook 01, section 3), so the product factors:
#
# $$
# y_{mn} \;=\; g \sum_{b=0}^{K/16-1} s_{nb} \sum_{k=16b}^{16b+15} \text{e2m1}(c_{nk})\; x_{mk}
# $$
#
# * the **global scale** `g` leaves the sum: one multiply per output, in the epilogue;
# * the **block scale** `s_nb` changes every 16 elements of K, so it multiplies the decoded weights;
# * `e2m1 x s` has at most 2 + 4 = 6 significant bits, and bf16 holds 8: the decoded, block-scaled weight is
#   **exact** in bf16, so bf16 tensor cores multiply the true weights (up to `g`), and the only differences from
#   the fp32 reference (which rounds `e2m1 x s x g` per weight) are where `g` is rounded in, the order of the fp32
#   additions and the final rounding.
#
# **Bytes, not flops.** The product does `2MNK` flops and must read every weight once: 2 bytes per weight in
# bf16, `0.5 + 1/16 = 0.5625` in NVFP4 (a nibble, plus one E4M3 scale per 16). Its arithmetic intensity is about
# `2M / (bytes per weight)` flops per byte. A GPU that reads `B` bytes/s and multiplies at `P` flop/s is
# bandwidth-bound below the *ridge* `P / B`. With the H200's ceilings, measured by the benchmark and committed
# with it:

# %%
doc = load("matmul.linear", gpu="h200")                 # committed H200 results: ceilings and every cell
ceil = doc["ceilings"]
read_bw, peak = ceil["read_gbps"] * 1e9, ceil["bf16_tflops"] * 1e12
ridge = peak / read_bw
print(f"{doc['provenance']['gpu']}, measured: read {ceil['read_gbps']:,.0f} GB/s, bf16 matmul "
      f"{ceil['bf16_tflops']:.0f} TFLOP/s -> ridge at {ridge:.0f} FLOP/byte")
for fmt, bpw in (("bf16", 2.0), ("nvfp4", 0.5625)):
    print(f"{fmt:>6}: {bpw} bytes/weight, {2 / bpw:.2f} x M FLOP/byte: bandwidth-bound up to "
          f"M = {ridge * bpw / 2:.0f} tokens")


def floor_us(n, k, m, bytes_per_weight):
    """The least time the product can take: its bytes at the read ceiling or its flops at the bf16 peak."""
    nbytes = bytes_per_weight * n * k + 2 * m * (k + n)
    return max(nbytes / read_bw, 2 * m * n * k / peak) * 1e6


rows = [{"shape": label, "N": n, "K": k, "bf16 floor us": round(floor_us(n, k, 1, 2.0), 2),
         "nvfp4 floor us": round(floor_us(n, k, 1, 0.5625), 2),
         "ratio": round(floor_us(n, k, 1, 2.0) / floor_us(n, k, 1, 0.5625), 2)} for label, n, k in SHAPES]
print("\nM = 1 (one token of decode), the shapes of the benchmark:")
print(render_table(rows))

# %% [markdown]
# At M = 1 both formats sit far below the ridge: the time is the weight bytes over the bandwidth, and NVFP4 moves
# `2 / 0.5625 = 3.56x` fewer of them. That ratio is the most a packed GEMV can gain over cuBLAS bf16, and only if
# decoding costs nothing; hence the goal of **3x** (and 75% of the read ceiling). Past the ridge (prefill) the
# tensor cores set the time and the packed kernel can at best match cuBLAS, while doing the decode on top; the
# goal there is **0.7x** of cuBLAS bf16.
#
# **The plan.**
#
# * **decode in registers**: each program loads packed bytes and scales for a tile of `W`, turns them into
#   exact bf16 values with a few integer operations, and feeds them straight to `tl.dot`; no bf16 copy of `W`
#   ever exists in memory;
# * **bf16 tensor cores**: since `e2m1 x s` is exact in bf16, the product runs on the same MMA instructions as
#   cuBLAS's bf16 GEMM, with fp32 accumulation;
# * **the global scale in the epilogue**: one multiply of the fp32 accumulator per output, then the bias, then one
#   rounding to `x`'s dtype.

# %% [markdown]
# ## 2. The reference
#
# `lynn_kernels.matmul.reference.nvfp4_linear(x, w, bias=None)` is the executable spec, and every kernel takes the
# same arguments in the same order: `x [..., K]` in bf16, fp16 or fp32, `w` an `NVFP4Tensor [N, K]`, `bias [N]`
# or None; it returns `[..., N]` in `x`'s dtype. It dequantises `W` to fp32 with the nvfp4 reference, does one
# fp32 matmul, adds the bias in fp32 and rounds once (`nvfp4_gemv` and `nvfp4_gemm` share it):

# %%
# NBVAL_IGNORE_OUTPUT
import inspect

print(inspect.getsource(reference.nvfp4_linear))

# %% [markdown]
# A small example: 2 tokens, 4 outputs, K = 32 (two blocks). The factored form of section 1, written out in
# float64 from the codes and scales, gives the same bf16 outputs:

# %%
gen = torch.Generator().manual_seed(0)
w = torch.randn(4, 32, generator=gen) * 0.02                          # N = 4, K = 32
x = torch.randn(2, 32, generator=gen).bfloat16()                       # M = 2
q = nvfp4.quantize(w.to(DEVICE))
y = reference.nvfp4_linear(x.to(DEVICE), q).cpu()
print(f"x {tuple(x.shape)} {x.dtype}; w NVFP4 {tuple(q.shape)}, global scale {q.global_scale.item():.4e}; "
      f"y {tuple(y.shape)} {y.dtype}")

e2m1 = nvfp4.e2m1_table()[nvfp4.reference.unpack_nibbles(q.codes.cpu()).long()].double()    # [N, K]
s = q.scales.cpu().double()                                                                  # [N, K/16]
inner = torch.einsum("nbj,mbj->mnb", e2m1.view(4, 2, 16), x.double().view(2, 2, 16))        # per block
y_fact = q.global_scale.item() * (inner * s).sum(-1)                                         # [M, N]

print(render_table([{"m": m, "n": n, "reference (bf16)": r4(y[m, n].item()),
                     "factored (float64)": r4(y_fact[m, n].item())} for m in range(2) for n in range(4)]))
print("factored form rounded to bf16 equals the reference, bit for bit:",
      compare(y_fact.to(torch.bfloat16), y, exact=True).mismatches == 0)

# %% [markdown]
# Arguments it cannot take raise an error that says what was expected:

# %%
for bad in (torch.randn(2, 48), torch.randint(0, 4, (2, 32))):
    try:
        reference.nvfp4_linear(bad.to(DEVICE), q)
    except (TypeError, ValueError) as err:
        print(f"{type(err).__name__}: {err}")


# %% [markdown]
# ## 3. The kernel, step by step
#
# The interpreter's bf16 arithmetic is wrong (docs/interpreter.md), so the toy kernels below take **fp32
# activations** and write **fp32 outputs**; the package's kernels load bf16 and convert on the fly. Each step is
# checked against the reference on two cases:
#
# * **grid**: weights built directly from random codes, block scales between 1 and 15 and a global scale of
#   2^-6, and activations that are multiples of 1/8 in [-1, 1]. Every product `x * e2m1 * s` is then a multiple
#   of 2^-7 below 90 in magnitude, so for K up to 1456 (we use at most 1280) every partial sum is a multiple of
#   2^-7 below 2^17: 24 significant bits at most, which fp32 holds **exactly, whatever the order of the
#   additions**. A correct kernel
#   must match the reference **bit for bit** here (`mismatches` = 0), on any CPU or GPU.
# * **randn**: quantised Gaussian weights and activations, K = 208 (13 blocks: not a multiple of any tile). Now
#   the order of the additions moves the last bits, so `max_abs` and `rel_l2` sit at fp32 round-off; the tables
#   show them as the power of ten at or above them (`bound`), which does not depend on the machine.

# %%
def grid_case(m, n, k, seed=0, dtype=torch.float32):
    """x [m, k] and NVFP4 w [n, k] on which fp32 sums are exact in any order (see above)."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    scale_bytes = torch.randint(0x38, 0x58, (n, k // 16), generator=gen, dtype=torch.uint8)   # E4M3 1.0 .. 15.0
    w = lk.NVFP4Tensor(codes, scale_bytes.view(torch.float8_e4m3fn), torch.tensor(2.0 ** -6)).to(DEVICE)
    x = (torch.randint(-8, 9, (m, k), generator=gen) / 8).to(dtype).to(DEVICE)
    return x, w


def randn_case(m, n, k, seed=0, dtype=torch.float32):
    """Quantised Gaussian weights (std 0.02) and Gaussian activations."""
    gen = torch.Generator().manual_seed(seed)
    w = nvfp4.quantize((torch.randn(n, k, generator=gen) * 0.02).to(DEVICE))
    x = torch.randn(m, k, generator=gen).to(dtype).to(DEVICE)
    return x, w


def check_rows(kernel, fn, cases):
    """``fn(x, w)`` against the reference on each case; bits are compared where the sums are exact. The fp32
    round-off of the randn case depends on the CPU's summation order, so it is shown against a bound."""
    rows = []
    for name, (x, w) in cases.items():
        m = compare(fn(x, w), reference.nvfp4_linear(x, w), exact=name.startswith("grid"))
        rows.append({"kernel": kernel, "case": name, "cosine": round(m.cosine, 6),
                     "rel_l2 < 1e-5": m.rel_l2 < 1e-5, "mismatches": m.mismatches})
    return rows


CASES = {"grid 1x32x512": grid_case(1, 32, 512), "randn 2x40x208": randn_case(2, 40, 208)}
COLUMNS = ["kernel", "case", "cosine", "rel_l2 < 1e-5", "mismatches"]
print(", ".join(f"{name}: x {tuple(x.shape)}, w {tuple(w.shape)}" for name, (x, w) in CASES.items()))


# %% [markdown]
# **(a) Naive: one program per output.** Program `(m, n)` walks along row `n` of `W`, 64 weights at a time. Each
# weight loads the byte that holds its code (two weights share a byte, so every byte is loaded twice), shifts out
# its nibble (even element: low nibble), looks its value up in the 16-entry E2M1 table and multiplies it by its
# block's scale times the global scale, in the reference's order `e2m1 * (s * g)`. The products with `x[m, k]`
# accumulate in fp32 and are summed at the end.

# %%
@triton.jit
def _toy_matvec_naive_kernel(x_ptr, codes_ptr, scales_ptr, g_ptr, lut_ptr, y_ptr, N, K, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)                                                # one program per y[m, n]
    g = tl.load(g_ptr)
    acc = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        byte = tl.load(codes_ptr + pid_n * (K // 2) + offs_k // 2, mask=mask_k, other=0)     # each byte twice
        nib = (byte >> ((offs_k % 2) * 4).to(tl.uint8)) & 0xF                              # even: low nibble
        s = tl.load(scales_ptr + pid_n * (K // 16) + offs_k // 16, mask=mask_k, other=0.0).to(tl.float32)
        w = tl.load(lut_ptr + nib) * (s * g)                                   # as the reference: e2m1 * (s * g)
        x = tl.load(x_ptr + pid_m * K + offs_k, mask=mask_k, other=0.0)
        acc += x * w
    tl.store(y_ptr + pid_m * N + pid_n, tl.sum(acc, axis=0))


def toy_matvec_naive(x: torch.Tensor, w: lk.NVFP4Tensor, BLOCK_K: int = 64) -> torch.Tensor:
    m, k = x.shape
    n = w.shape[0]
    y = torch.full((m, n), float("nan"), device=x.device)                  # poisoned: unwritten shows as NaN
    _toy_matvec_naive_kernel[(m, n)](x, w.codes, w.scales, w.global_scale, nvfp4.e2m1_table(x.device), y, n, k,
                                     BLOCK_K=BLOCK_K)
    return y


rows = check_rows("(a) naive, one program per y[m, n]", toy_matvec_naive, CASES)
print(render_table(rounded(rows), COLUMNS))


# %% [markdown]
# Correct, and slow in every way that matters on a GPU: each byte is loaded twice, each row of `W` is read once per
# token, a program does one output, and the scale multiply happens per weight.
#
# **(b) A tile of rows, the scales where they belong.** Program `(pid_n, m)` owns `BLOCK_N` rows of `W` for one
# row of `x`. Each step loads a `[BLOCK_N, BLOCK_K/2]` tile of bytes **once**, splits every byte into its two
# nibbles and interleaves them back into element order, looks up the values, and multiplies each group of 16 by
# its block scale by viewing the tile as `[BLOCK_N, BLOCK_K/16, 16]`. The products with `x` are reduced along K
# into `BLOCK_N` fp32 sums, and the global scale multiplies them **once**, at the end. Masks cover the ragged
# edges (K = 208 in 128-wide steps, N = 40 in 32-row tiles). The association changes from
# `sum(x * (e2m1 * (s * g)))` to `g * sum(x * (e2m1 * s))`: the same number in exact arithmetic (the grid case),
# different last bits on random data.

# %%
@triton.jit
def _toy_matvec_tile_kernel(x_ptr, codes_ptr, scales_ptr, g_ptr, lut_ptr, y_ptr, N, K,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_c = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        c = tl.load(codes_ptr + offs_n[:, None] * (K // 2) + offs_c[None, :],
                    mask=mask_n[:, None] & (offs_c[None, :] < K // 2), other=0)       # [BLOCK_N, BLOCK_K/2]
        v = tl.load(lut_ptr + tl.interleave(c & 0xF, c >> 4))                         # [BLOCK_N, BLOCK_K]
        offs_s = k0 // 16 + tl.arange(0, BLOCK_K // 16)
        s = tl.load(scales_ptr + offs_n[:, None] * (K // 16) + offs_s[None, :],
                    mask=mask_n[:, None] & (offs_s[None, :] < K // 16), other=0.0)    # [BLOCK_N, BLOCK_K/16]
        v = tl.reshape(v, (BLOCK_N, BLOCK_K // 16, 16)) * s.to(tl.float32)[:, :, None]  # one scale per 16
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + pid_m * K + offs_k, mask=offs_k < K, other=0.0)             # [BLOCK_K]
        acc += tl.sum(tl.reshape(v, (BLOCK_N, BLOCK_K)) * x[None, :], axis=1)
    g = tl.load(g_ptr)
    tl.store(y_ptr + pid_m * N + offs_n, acc * g, mask=mask_n)                         # global scale once


def toy_matvec_tiled(x: torch.Tensor, w: lk.NVFP4Tensor, BLOCK_N: int = 32, BLOCK_K: int = 128) -> torch.Tensor:
    m, k = x.shape
    n = w.shape[0]
    y = torch.full((m, n), float("nan"), device=x.device)
    _toy_matvec_tile_kernel[(triton.cdiv(n, BLOCK_N), m)](x, w.codes, w.scales, w.global_scale,
                                                          nvfp4.e2m1_table(x.device), y, n, k,
                                                          BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return y


rows += check_rows("(b) BLOCK_N rows x BLOCK_K", toy_matvec_tiled, CASES)
rows += check_rows("package nvfp4_gemv", nvfp4_gemv, CASES)
print(render_table(rounded(rows), COLUMNS))

# %% [markdown]
# Step (b) already has the shape of the package's GEMV (`_nvfp4_gemv_kernel`, last rows above), which adds three
# things: a program handles up to 16 rows of `x` at once, as a `tl.dot` on the tensor cores with the rows padded
# to 16 (at decode the MMA is nearly free: the decode is the work); the E2M1 values come from bit operations
# instead of a table (notebook 01, section 5; on the GPU, the packed decode of step (d)); and K can be split
# across programs.
#
# **(c) Split-K, and a reduce that always gives the same bits.** A GEMV program covers `BLOCK_N` rows of `W` (the
# package's fixed `GEMV_CONFIG`), so a projection with few outputs makes few programs, while the GPU needs
# several per SM to keep enough loads in flight to pull its share of the bandwidth. N alone cannot fill the GPU
# at decode; K can be split as well: program `(pid_n, pid_k)` reduces its rows over one slice of K, and the
# slices' partial sums are added at the end. `split_k_for` aims at about two programs per SM:

# %%
sms = doc["provenance"]["sms"]
cfg = triton_matmul.GEMV_CONFIG
rows = []
for label, n, k in SHAPES:
    tiles = triton.cdiv(n, cfg["BLOCK_N"])
    split = triton_matmul.split_k_for(tiles, k, cfg["BLOCK_K"], sms)
    rows.append({"shape": label, "row tiles": tiles, "K chunks": triton.cdiv(k, cfg["BLOCK_K"]), "split": split,
                 "programs": tiles * split, "per SM": round(tiles * split / sms, 2)})
print(f"GEMV_CONFIG {cfg}; {sms} SMs (the H200 of the benchmark)")
print(render_table(rows))


# %% [markdown]
# How to add the partials? The easy way, `tl.atomic_add` of fp32 partials into `y`, adds them in whatever order
# the programs happen to finish, so `y` changes from run to run in its last bits (and must be zeroed first). The
# package does this instead (`_finish` in `triton_matmul.py`):
#
# 1. each program stores its fp32 partial tile in a workspace `[split, M, N]`;
# 2. after a barrier it takes a **ticket**, `atomic_add(counter[tile], 1)` with acquire-release semantics, so the
#    partials stored before every ticket are visible to whoever draws the last one;
# 3. the program that draws ticket `split - 1` adds the partials **in split order 0, 1, ..., split - 1**, applies
#    `g` and the bias, writes `y`, and resets the counter to 0, so one zeroed int32 buffer serves every call.
#
# The order of the sum is fixed by the split, not by timing: the same inputs and the same split give the same
# bits on every run. Different splits add in different orders, so on random data they may differ in the last
# fp32 bit; on the grid case, where every order is exact, they must agree. `launch_gemv(x2, w, bias, y,
# split_k=...)` forces a split (K = 1280 is five chunks of 256: split 2 makes slices of 3 and 2 chunks, split 3
# of 2, 2 and 1):

# %%
def gemv_split(x, w, split):
    y = torch.full((x.shape[0], w.shape[0]), float("nan"), dtype=x.dtype, device=x.device)   # poisoned
    return triton_matmul.launch_gemv(x, w, None, y, split_k=split)


split_cases = {"grid 2x96x1280 bf16": grid_case(2, 96, 1280, seed=1, dtype=torch.bfloat16),
               "randn 2x96x1280 fp32": randn_case(2, 96, 1280, seed=1)}
split_out, rows = {}, []
for name, (x, w) in split_cases.items():
    want = reference.nvfp4_linear(x, w)
    exact = name.startswith("grid")
    for split in (1, 2, 3):
        y, again = gemv_split(x, w, split), gemv_split(x, w, split)
        split_out[name, split] = y
        rows.append({"case": name, "split": split,
                     "bits differ, run again": compare(again, y, exact=True).mismatches,
                     "bits differ from split 1": (compare(y, split_out[name, 1], exact=True).mismatches
                                                  if exact else None),
                     "bits differ from reference": compare(y, want, exact=True).mismatches if exact else None,
                     "rel_l2 vs reference": bound(compare(y, want).rel_l2)})
print(render_table(rows))
print("ticket counters back at zero:", all(int(c.abs().sum()) == 0 for c in triton_shared._counters.values()))

# %% [markdown]
# On the random case the splits add in different orders; how many fp32 results that moves depends on the machine
# (its BLAS, or the GPU's tensor cores), so this count is not checked:

# %%
# NBVAL_IGNORE_OUTPUT
name = "randn 2x96x1280 fp32"
for split in (2, 3):
    a, b = split_out[name, split], split_out[name, 1]
    rel = ((a - b).abs().max() / b.abs().max()).item()
    print(f"{name}: split {split} vs split 1: {compare(a, b, exact=True).mismatches}/{a.numel()} values "
          f"differ, by at most {rel:.1e} of max |y|")


# %% [markdown]
# **(d) The tiled GEMM: hand over to the package.** For prefill, M is large and each decoded weight tile should
# serve many tokens. `nvfp4_gemm` (`_nvfp4_gemm_kernel`) tiles M as well: a program owns a `BLOCK_N x BLOCK_M`
# tile of `y^T` and walks K in steps of `BLOCK_K`. Three ideas:
#
# * **The transposed product.** It computes `y^T [N, M] = W [N, K] @ x^T [K, M]`, so the decoded weight tile is
#   the **first** `tl.dot` operand and the activation tile the second. On Hopper, wgmma's first operand may come
#   straight from registers, which is where the decode leaves the weights, while the second must sit in shared
#   memory, where a plain load of `x` can put it. It suits decode as well: the MMA's first dimension is 64 per
#   warpgroup while its second can be as small as 8, so 64 weight rows times a few tokens wastes little, where
#   `x @ W^T` would pad one token to 64 rows. The epilogue writes `acc[n, m]` to `y[m, n]`.
# * **Grouped tile order.** Consecutive programs take `GROUP_N = 8` weight tiles and sweep every token tile over
#   them before moving on, so that band of `W` stays in L2 while all of M passes (in plain row-major order every
#   token tile would stream all of `W` again).
# * **The same split-K and epilogue** as the GEMV, for shapes whose tiles cannot fill the GPU.
#
# The launch order, by the kernel's own formula, for 5 weight tiles x 4 token tiles and `GROUP_N = 2`:

# %%
def grouped_order(tiles_n, tiles_m, group_n):
    """order[pid_n][pid_m] = the program id that computes that tile (the formula of _nvfp4_gemm_kernel)."""
    order = [[None] * tiles_m for _ in range(tiles_n)]
    for pid in range(tiles_n * tiles_m):
        per_group = group_n * tiles_m
        first_n = (pid // per_group) * group_n
        size = min(tiles_n - first_n, group_n)
        order[first_n + (pid % per_group) % size][(pid % per_group) // size] = pid
    return order


print(render_table([{"weight tile": f"pid_n={i}", **{f"pid_m={j}": p for j, p in enumerate(r)}}
                    for i, r in enumerate(grouped_order(5, 4, 2))]))

# %% [markdown]
# Programs 0-7 touch only weight tiles 0 and 1; tile 4, alone in the last group, is swept last. The package's GEMM
# on a grid case in bf16 (bit for bit) and a random case in fp32, M = 40:

# %%
gemm_cases = {"grid 40x96x512 bf16": grid_case(40, 96, 512, seed=2, dtype=torch.bfloat16),
              "randn 40x100x208 fp32": randn_case(40, 100, 208, seed=2)}
rows = check_rows("package nvfp4_gemm", nvfp4_gemm, gemm_cases)
print(render_table(rounded(rows), COLUMNS))

# %% [markdown]
# **The packed bf16x2 decode (GPU, bf16 activations).** The portable decode (`_load_w_tile`: under the interpreter,
# and for fp16 or fp32 activations) turns each nibble into an fp16 word and converts it to fp32. On the GPU with
# bf16 activations, `_e2m1_bf16x2_scaled` instead works on bf16 pairs in inline PTX, two weights per
# instruction:
#
# 1. `prmt` spreads two code bytes into the two 16-bit halves of a 32-bit register;
# 2. shifts and masks drop each nibble's magnitude bits `e1 e0 m` onto bf16 bits 8..6 (the two lowest exponent
#    bits and the top mantissa bit) and its sign bit onto bit 15. A bf16 with exponent field `e` and top mantissa
#    bit `m` is `2^(e-127) (1 + m/2)` for `e > 0`, and the subnormal `(m/2) 2^-126` for `e = 0`: in both cases
#    **exactly `e2m1 x 2^-126`**;
# 3. one `mul.rn.bf16x2` by the block scale pre-multiplied by `2^119` gives `e2m1 x scale x 2^-7`. The scale times
#    `2^119` is exact in bf16 (E4M3 has 4 significant bits, and `448 x 2^119 < 2^128` stays finite); the product
#    has at most 6 significant bits and lies between `2^-17` and `2688 x 2^-7 = 21`, a normal bf16: **the
#    multiply is exact**, its rounding never rounds;
# 4. the epilogue multiplies the fp32 accumulator by `g x 2^7`.
#
# Why `2^119` and not `2^126`? `448 x 2^126` would overflow bf16; `2^119` keeps every scale finite, and the result
# stays far above bf16's subnormals. The identity in plain torch, first the 16 codes:

# %%
codes = torch.arange(16, dtype=torch.int32)
bits = ((codes & 7) << 6) | ((codes & 8) << 12)                       # magnitude -> bits 8..6, sign -> bit 15
as_bf16 = bits.to(torch.int16).view(torch.bfloat16)                   # e2m1 x 2^-126 (0 and 0.5: subnormals)
e2m1 = nvfp4.e2m1_table()
print("code  bf16 bits          bf16 value x 2^126   e2m1")
for c in range(16):
    print(f" 0x{c:x}  {int(bits[c]):016b}   {as_bf16[c].float().item() * 2.0 ** 126:+5.1f}              "
          f"{e2m1[c].item():+.1f}")

# %% [markdown]
# then all 16 codes times every positive finite E4M3 scale, through a bf16 multiply (rounded to nearest, as
# `mul.rn.bf16x2`), and the PTX's exact shifts and masks on all 256 byte values (even element: `shl 6`, `shl 12`;
# odd element: `shl 2`, `shl 8`; masks `0x01C0` and `0x8000` in each half):

# %%
scales = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
scales = scales[torch.isfinite(scales) & (scales > 0)]                # the 126 positive finite E4M3 values
s_bf16 = (scales * 2.0 ** 119).to(torch.bfloat16)
prod = as_bf16[:, None] * s_bf16[None, :]                             # bf16 x bf16 -> bf16
want = e2m1[:, None] * scales[None, :] * 2.0 ** -7                    # exact in fp32
print(f"scale x 2^119 exact in bf16 for all {scales.numel()} scales:",
      bool((s_bf16.float() == scales * 2.0 ** 119).all()))
print(f"{prod.numel()} products equal e2m1 x scale x 2^-7 exactly:", bool((prod.float() == want).all()),
      "| signs of zero kept:", bool((prod.float().signbit() == want.signbit()).all()))

byte = torch.arange(256, dtype=torch.int32)
even = (((byte << 6) & 0x01C0) | ((byte << 12) & 0x8000)).to(torch.int16).view(torch.bfloat16).float()
odd = (((byte << 2) & 0x01C0) | ((byte << 8) & 0x8000)).to(torch.int16).view(torch.bfloat16).float()
print("all 256 bytes decode to (low nibble, high nibble) x 2^-126:",
      bool((even * 2.0 ** 126 == e2m1[byte & 15]).all() and (odd * 2.0 ** 126 == e2m1[byte >> 4]).all()))

# %%
# NBVAL_IGNORE_OUTPUT
# the PTX in the package (read from the source, so this stays true): the even elements of bytes 0 and 1
src = inspect.getsource(triton_shared._e2m1_bf16x2_scaled.fn).splitlines()
start = next(i for i, line in enumerate(src) if "prmt.b32 t01" in line)
print("\n".join(src[start:start + 8]))

# %% [markdown]
# The interpreter has no inline assembly, so this path runs only on the GPU, where `tests/test_matmul.py` checks
# it (the `gpu` marker); the identity above is what makes it bit-compatible with the portable decode.

# %% [markdown]
# ## 4. The kernel layout: 8 codes in a 32-bit word, in the tensor cores' order
#
# Section 3's kernels read the checkpoint layout as it is stored: a byte of two codes (the even element in the
# low nibble) and an E4M3 scale byte per 16 elements. At decode, where each weight is used once, the work is the
# decode itself: every instruction spent per weight is time (`docs/matmul.md` counts them). So
# `lynn_kernels.matmul.pack(w)` rewrites a weight **once, at load time**, into a second layout, a `PackedNVFP4`,
# that is cheaper to decode; `unpack` gives the checkpoint layout back. Every op takes either form:
#
# * **words**: int32 `[N, Kp/8]`, with `Kp` the row length K rounded up to a multiple of 128 (`packed.CHUNK`; the
#   padding holds zero codes). A word holds 8 codes of one row, their bits placed so that two shifts, two masks and
#   an OR bring a *pair* of them into the bits of two bf16s, each equal to `e2m1 x 2^-126` (the identity of
#   section 3 (d), with no byte shuffling first). Which 8: not 8 neighbours along K, but the 8 that one thread
#   holds of the tensor cores' operand, so that the decoded pairs already are the registers the MMA reads;
# * **scales**: uint8 `[N, Kp/16]`, each E4M3 scale `s = 2^e (1 + m/8)` re-encoded as the byte `(e + 10) << 3 | m`
#   and stored with its two nibbles swapped (zero in the padding). A byte-permute and an AND-OR turn it into a bf16
#   pair `s x 2^107` (for the tensor-core kernels) or an fp32 `s x 2^75` (for the packed GEMV): no table, no shift
#   and no subnormal case;
# * **global scale**: unchanged, applied once per output in the epilogue, with the powers of two folded in.
#
# Which kernel decodes a packed weight is `triton_matmul.use_packed_gemv(m, n)`'s choice, made from the H200
# measurements at the end of this section: a GEMV on the FMA units (`packed_gemv_kernel` in `triton_packed.py`) for
# one row of `x` up to 65,536 output rows and for two rows below 8,192; otherwise the tensor-core GEMV of section 3
# up to M = 16 and the GEMM above, both of which decode the words through `packed_w_tile`.
#
# **(a) Pack, unpack.** A small weight, 4 rows of K = 192 (twelve blocks a row): one whole chunk of 128 and half of
# a second, so each row is padded to 256 positions. The layout is exact: `unpack(pack(q))` dequantises to the same
# values, bit for bit.

# %%
from lynn_kernels.matmul import pack, packed, unpack

gen = torch.Generator().manual_seed(4)
q = nvfp4.quantize((torch.randn(4, 192, generator=gen) * 0.02).to(DEVICE))    # N = 4, K = 192
p = pack(q)
print(p)
print(f"checkpoint: codes {list(q.codes.shape)} uint8 (2 codes a byte), scales {list(q.scales.shape)} E4M3, "
      f"{q.nbytes} bytes")
print(f"packed:     words {list(p.words.shape)} int32 (8 codes a word), scales {list(p.scales.shape)} uint8 "
      f"(re-encoded), {p.nbytes} bytes: K = {p.k} padded to {p.words.shape[1] * 8}, chunks of {packed.CHUNK}")

back = unpack(p)
same = compare(nvfp4.reference.dequantize(back, torch.float32), nvfp4.reference.dequantize(q, torch.float32),
               exact=True)
print(f"unpack(pack(q)) dequantises to the same fp32 values: max_abs = {same.max_abs:g}, "
      f"mismatches = {same.mismatches}")
print("codes and scales come back as stored:", torch.equal(back.codes, q.codes),
      torch.equal(back.scales.view(torch.uint8), q.scales.view(torch.uint8)))


# %% [markdown]
# (A zero scale or a negative one would come back normalised: `pack` zeroes the codes of a zero-scale block and
# moves a negative scale's sign into the codes, so the values are the same; `quantize` makes neither.)
#
# **(b) One word, bit by bit.** Each element owns four bits of its word: a sign bit and three magnitude bits
# `e1 e0 m` (notebook 01). The even elements (0, 2, 4, 6) live in the low half, the odd ones in the high half, so
# a pair `(2p, 2p + 1)` sits at the same place in both halves and one 32-bit shift moves both. Pair `p` is
# decoded by two shifts from `PAIR_SHIFTS[p]`: one brings its sign bits to 15 / 31 (the bf16 sign), the other
# its magnitude bits to 8..6 / 24..22. The bits are placed so the four pairs need only five distinct shifts
# (`<< 3, 4, 5, 6` and `>> 6`); pair 0 needs no sign shift and pair 1 no magnitude shift. `packed.SIGN_BIT` and
# `packed.MAG_BIT` hold the places:

# %%
def shift_name(s):
    return "none" if s == 0 else f"<< {s}" if s > 0 else f">> {-s}"


print(render_table([{"element": j, "bf16 pair": j // 2, "half": "high" if j % 2 else "low",
                     "sign bit": packed.SIGN_BIT[j],
                     "magnitude bits e1 e0 m": f"{packed.MAG_BIT[j] + 2}..{packed.MAG_BIT[j]}",
                     "sign shift": shift_name(packed.PAIR_SHIFTS[j // 2][0]),
                     "magnitude shift": shift_name(packed.PAIR_SHIFTS[j // 2][1])} for j in range(8)]))
owner = {}                                                           # bit -> (element, role)
for j in range(8):
    owner[packed.SIGN_BIT[j]] = (j, "s")
    for b, role in enumerate(("m", "e0", "e1")):
        owner[packed.MAG_BIT[j] + b] = (j, role)
print("every bit of the word belongs to exactly one element:", sorted(owner) == list(range(32)))

# %%
# NBVAL_IGNORE_OUTPUT
fig, ax = plt.subplots(figsize=(10, 1.6))
for bit, (j, role) in owner.items():
    left = 31 - bit                                                  # bit 31 on the left
    ax.add_patch(plt.Rectangle((left, 0), 1, 1, facecolor=f"C{j}", alpha=1.0 if role == "s" else 0.4,
                               edgecolor="white", lw=1.5))
    ax.text(left + 0.5, 0.65, str(j), ha="center", va="center", fontsize=9,
            weight="bold" if role == "s" else "normal")
    ax.text(left + 0.5, 0.27, role, ha="center", va="center", fontsize=6)
    ax.text(left + 0.5, -0.22, str(bit), ha="center", va="center", fontsize=6, color="0.4")
ax.plot([16, 16], [-0.05, 1.05], c="k", lw=1.5)                     # the two 16-bit halves
ax.text(8, 1.15, "high half: elements 1, 3, 5, 7", ha="center", fontsize=8)
ax.text(24, 1.15, "low half: elements 0, 2, 4, 6", ha="center", fontsize=8)
ax.set_xlim(-0.1, 32.1)
ax.set_ylim(-0.4, 1.4)
ax.axis("off")
ax.set_title("one packed word, bit 31 to bit 0: the element each bit belongs to (s: its sign; e1 e0 m: its "
             "magnitude)", fontsize=9)
fig.subplots_adjust(left=0.01, right=0.99, bottom=0.02, top=0.84)
plt.show()

# %% [markdown]
# **(c) Which 8 codes: the tensor cores' order.** The tensor cores multiply a weight tile held in registers, spread
# over a warp's 32 threads in a fixed pattern. In `mma.m16n8k16` (and Hopper's wgmma with its first operand in
# registers, the same pattern in each warp) that operand is 16 rows of W by 16 positions of K; four threads share
# each row, and thread `q = 0..3` of a row holds two bf16 pairs of its 16 columns: `2q, 2q + 1` and `2q + 8, 2q + 9`.
# A decode that leaves the weights in K order leaves them in the wrong threads, and the tile must be exchanged
# between threads (through shared memory: what Triton does with section 3's tiles) before the MMA. So `pack` puts
# in each word the elements one thread needs. A row is cut into **chunks of 128** positions (8 MMA steps of 16, 16
# words), and element `j` of word `w = 4q + i` of chunk `c` holds the K position
#
# $$
# k \;=\; 128\,c + 32\,i + 16\,(j \gg 2) + 8\,((j \gg 1)\,\&\,1) + 2q + (j\,\&\,1)
# $$
#
# (`packed.word_k(kw)` is this table for `kw` words). The word's bf16 pair `p` (elements `2p, 2p + 1`, neighbours
# along K) is one register of thread `q`: pair 0 is columns `2q, 2q + 1` of MMA step `2i`, pair 1 columns
# `2q + 8, 2q + 9` of the same step, pairs 2 and 3 the same for step `2i + 1`. A thread's four words `4q .. 4q + 3`
# sit side by side, so one 16-byte load brings its share of all 8 steps of the chunk. And each half word lies in one
# block of 16: word `4q + i` takes the scales of blocks `2i` (elements 0..3) and `2i + 1` (elements 4..7), two
# neighbouring scale bytes. The table for one chunk, checked against the operand's layout as the PTX manual
# defines it (element `a` of thread `lane` is row `lane // 4 + 8 ((a >> 1) & 1)`, column
# `2 (lane % 4) + (a & 1) + 8 (a >> 2)` of the tile):

# %%
WK = packed.word_k(16)                                        # [16 words, 8 elements]: K positions of chunk 0
print(render_table([{"word": w, "thread q": w // 4, "i": w % 4, **{f"j={j}": int(WK[w, j]) for j in range(8)},
                     "scale blocks": f"{2 * (w % 4)}, {2 * (w % 4) + 1}"} for w in range(16)]))


def a_fragment(lane, a):
    """mma.m16n8k16's first operand (16 x 16, bf16): element ``a`` (0..7) of thread ``lane`` is (row, column)."""
    return lane // 4 + 8 * ((a >> 1) & 1), 2 * (lane % 4) + (a & 1) + 8 * (a >> 2)


frag = {q: [a_fragment(q, a) for a in (0, 1, 4, 5)] for q in range(4)}      # lanes 0..3: row 0's four threads
want_k = torch.tensor([[16 * (2 * i + h) + col for h in (0, 1) for _, col in frag[q]]
                       for q in range(4) for i in range(4)])                 # [word 4q + i, element]
print("elements 0, 1, 4, 5 of lanes 0..3 are row 0 of the tile:", all(r == 0 for f in frag.values() for r, _ in f))
print("word 4q + i = thread q's columns of MMA steps 2i and 2i + 1, in register order:", torch.equal(WK, want_k))
print("the 16 words hold each of the chunk's 128 positions once:", sorted(WK.flatten().tolist()) == list(range(128)))
print("elements 0..3 of word 4q + i lie in block 2i, elements 4..7 in block 2i + 1:",
      bool((WK // 16 == 2 * (torch.arange(16)[:, None] % 4) + (torch.arange(8)[None, :] >= 4)).all()))

# %% [markdown]
# The same chunk drawn: each square is one K position, in rows of 16 (an MMA step, and a scale block); its colour is
# the thread that holds it, and the label its word and element. Below, the chunk in memory: the words of a thread side
# by side, then the 8 scale bytes. (`docs/figures/packed_layout.png` is this picture, larger.)

# %%
# NBVAL_IGNORE_OUTPUT
from matplotlib.colors import to_rgb
from matplotlib.patches import Patch

THREAD = ("tab:blue", "tab:orange", "tab:green", "tab:red")       # a colour per thread q of a row's four


def shade(colour, i):
    """Thread q's word 4q + i: lighter as i grows."""
    return tuple(v + (1 - v) * (0.0, 0.28, 0.5, 0.66)[i] for v in to_rgb(colour))


fig = plt.figure(figsize=(11, 5.6))
grid, mem = fig.add_axes((0.13, 0.30, 0.74, 0.56)), fig.add_axes((0.13, 0.03, 0.74, 0.17))
for w in range(16):
    th, i = divmod(w, 4)                                             # (q is the weight of (a))
    for j in range(8):
        s, c = divmod(int(WK[w, j]), 16)                             # MMA step (= scale block), column in the step
        grid.add_patch(plt.Rectangle((c, s), 1, 1, facecolor=shade(THREAD[th], i), edgecolor="white", lw=1.2))
        grid.text(c + 0.5, s + 0.36, f"w{w}", ha="center", va="center", fontsize=8, weight="bold")
        grid.text(c + 0.5, s + 0.74, f"j{j}", ha="center", va="center", fontsize=6.5, color="0.15")
    mem.add_patch(plt.Rectangle((w, 1.2), 1, 1, facecolor=shade(THREAD[th], i), edgecolor="white", lw=1.2))
    mem.text(w + 0.5, 1.7, f"w{w}", ha="center", va="center", fontsize=8, weight="bold")
for s in (2, 4, 6):
    grid.plot([0, 16], [s, s], c="k", lw=1.4)                        # word 4q + i spans the steps 2i and 2i + 1
grid.plot([8, 8], [0, 8], c="k", lw=0.8, ls="--")
for i in range(4):
    grid.text(16.2, 2 * i + 1, f"i = {i}: words\n{i}, {4 + i}, {8 + i}, {12 + i}", va="center", fontsize=7.5)
grid.set_xlim(0, 16)
grid.set_ylim(8, 0)
grid.set_xticks([c + 0.5 for c in range(16)], [str(c) for c in range(16)], fontsize=7.5)
grid.xaxis.tick_top()
grid.set_yticks([s + 0.5 for s in range(8)], [f"block {s}: K {16 * s}-{16 * s + 15}" for s in range(8)], fontsize=7.5)
grid.tick_params(length=0)
for side in grid.spines.values():
    side.set_visible(False)
grid.set_title("one chunk of a row: word w = 4q + i and element j of each K position (column: K mod 16);\n"
               "colour: thread q of mma.m16n8k16's A operand (columns 2q, 2q+1, 2q+8, 2q+9 of every 16)",
               fontsize=9, pad=18)
for th in range(4):
    mem.annotate("", xy=(4 * th + 0.05, 2.45), xytext=(4 * th + 3.95, 2.45),
                 arrowprops={"arrowstyle": "|-|", "lw": 0.8, "shrinkA": 0, "shrinkB": 0})
    mem.text(4 * th + 2, 2.7, f"thread {th}: one 16-byte load", ha="center", va="bottom", fontsize=7.5)
for b in range(8):
    mem.add_patch(plt.Rectangle((2 * b, 0), 2, 0.8, facecolor="0.88", edgecolor="white", lw=1.2))
    mem.text(2 * b + 1, 0.4, f"byte {b}: block {b}", ha="center", va="center", fontsize=7)
mem.text(-0.2, 1.7, "words", ha="right", va="center", fontsize=8)
mem.text(-0.2, 0.4, "scales", ha="right", va="center", fontsize=8)
mem.set_xlim(0, 16)
mem.set_ylim(0, 3.3)
mem.axis("off")
fig.legend(handles=[Patch(facecolor=c, label=f"thread q = {q}") for q, c in enumerate(THREAD)],
           loc="lower right", bbox_to_anchor=(0.998, 0.03), fontsize=7.5, frameon=False)
plt.show()

# %% [markdown]
# In the weight of (a) the second chunk is half padding, and its last 64 positions are not its last words: they are
# the words with `i = 2, 3` of every thread, spread through the chunk:

# %%
wk = packed.word_k(p.words.shape[1])                                   # [Kp/8, 8]: K position of each element
pad = (wk >= p.k).all(dim=1)                                           # words that hold only padding
print(f"K = {p.k} of {wk.numel()}: the words that hold only padding are {pad.nonzero().flatten().tolist()} "
      f"(of {p.words.shape[1]}); none holds part of it:", bool(((wk >= p.k).any(dim=1) == pad).all()))
print("they are zero in every row:", bool((p.words[:, pad] == 0).all()),
      "| so are the scale bytes past K / 16:", bool((p.scales[:, p.k // 16:] == 0).all()))

# %% [markdown]
# **(d) Decoding a word by hand.** What `decode_word` does, in torch on int64s holding 32-bit patterns: for pair
# `p` with shifts `(a, b)`, `t = (q << a) & 0x80008000 | (q << b) & 0x01C001C0` keeps only the pair's sign and
# magnitude bits, now where a bf16 keeps them. A bf16 is the top half of an fp32, so `t << 16` (the low half) and
# `t & 0xFFFF0000` (the high half) *are* the two fp32 values `e2m1 x 2^-126`, zeros and the subnormal 0.5 included.
# Five shifts shared by the four pairs, and an AND plus an AND-OR per pair: 13 integer operations for 8 weights.
# They come out in the word's element order, and `word_k` says where along K each one belongs. Word 5 of row 0
# (thread 1, `i = 1`), against the E2M1 values the reference reads from the checkpoint codes at those positions:

# %%
U32 = 0xFFFFFFFF


def shift(v, s):
    """``v << s`` (``s < 0``: ``v >> -s``) on 32-bit words held in int64."""
    return (v << s) & U32 if s >= 0 else v >> -s


def as_fp32(bits):
    """32-bit patterns held in int64 -> the fp32 values they encode."""
    return torch.where(bits >= 2 ** 31, bits - 2 ** 32, bits).to(torch.int32).view(torch.float32)


def decode_by_hand(words):
    """int32 words ``[...]`` -> their 8 elements ``e2m1 * 2^-126`` as fp32 ``[..., 8]``, in element order (their K
    positions: ``packed.word_k``)."""
    v = words.to(torch.int64) & U32
    out = []
    for a, b in packed.PAIR_SHIFTS:
        t = (shift(v, a) & 0x80008000) | (shift(v, b) & 0x01C001C0)       # a bf16 pair
        out += [as_fp32((t << 16) & U32), as_fp32(t & 0xFFFF0000)]          # low half: element 2p; high: 2p + 1
    return torch.stack(out, dim=-1)


codes = nvfp4.reference.unpack_nibbles(q.codes.cpu())                       # [N, K], checkpoint order
want = nvfp4.e2m1_table()[codes.long()]                                     # the reference's E2M1 values
word = p.words.cpu()[0, 5]
got = decode_by_hand(word)
print(f"row 0, word 5 (thread 1, i = 1): 0x{int(word) & U32:08x} = {int(word) & U32:032b}")
print(render_table([{"element": j, "K": int(wk[5, j]), "code": f"0x{int(codes[0, wk[5, j]]):x}",
                     "fp32 bits": f"0x{int(got[j:j + 1].view(torch.int32)) & U32:08x}",
                     "value x 2^126": got[j].item() * 2.0 ** 126, "reference e2m1": want[0, wk[5, j]].item()}
                    for j in range(8)]))
every = torch.zeros(p.words.shape[0], wk.numel())
every[:, wk.flatten()] = decode_by_hand(p.words.cpu()).flatten(1) * 2.0 ** 126    # element order -> K order
print(f"all {p.words.numel()} words ({every.numel()} elements, put back in K order) decode to the reference's "
      f"E2M1 values:", bool((every[:, :p.k] == want).all()),
      "| signs of zero too:", bool((every[:, :p.k].signbit() == want.signbit()).all()),
      "| the padding to +0:", bool((every[:, p.k:] == 0).all() and not every[:, p.k:].signbit().any()))

# %% [markdown]
# **(e) The scales.** A block's scale `s = 2^e (1 + m/8)` (E4M3's subnormals normalised: `e` from -9 to 8) becomes
# the byte `b = (e + 10) << 3 | m`: five exponent bits above three mantissa bits, the lowest exponent bits and the top
# mantissa bits of an fp32 or a bf16. `pack` stores it with its nibbles swapped, for the GPU's byte-permute: `prmt`
# copies one byte into all four bytes of a register, and there the low nibble of each copy sits just above the high
# nibble of the copy below, so bits 20..27 of the register, and bits 4..11 of each of its 16-bit halves, hold `b`
# the right way round. One AND-OR (`lop3`) with the exponent's constant top bits then makes the fp32
# `(b << 20) | 0x60000000 = s x 2^75` (the packed GEMV) or, with `(b << 4) | 0x7000` in each half, the bf16 pair
# `s x 2^107` (the tensor-core tile's operand for `mul.rn.bf16x2`): two instructions a scale, no shift. In torch the
# permute is a multiply by `0x01010101`. Three scales step by step (E4M3's smallest, the subnormal `2^-9`; 1.5; its
# largest, 448), then every positive finite one, each packed as a block of its own:

# %%
e4m3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
pos = e4m3[torch.isfinite(e4m3.float()) & (e4m3.float() > 0)]              # the 126 positive finite E4M3 values
one_block = lk.NVFP4Tensor(torch.zeros(pos.numel(), 8, dtype=torch.uint8), pos[:, None], torch.tensor(1.0))
scale_bytes = pack(one_block).scales.to(torch.int64)                     # [126, 8]: one block, padded to a chunk
stored = scale_bytes[:, 0]

s = pos.float()
e = torch.floor(torch.log2(s)).to(torch.int64)                           # s = 2^e (1 + m/8), from the value
m = ((s / torch.exp2(e.float()) - 1) * 8).to(torch.int64)
b = ((e + 10) << 3) | m                                                  # the re-encoded byte
rep = stored * 0x01010101                                                # prmt: the stored byte in all four bytes
fp32 = as_fp32((rep & 0x0FF00000) | packed.SCALE_OR["fma"])             # lop3: keep bits 20..27, OR the exponent
pair = (rep & 0x0FF00FF0) | 0x70007000                                   # lop3: bits 4..11 of each half
lo, hi = as_fp32((pair << 16) & U32), as_fp32(pair & 0xFFFF0000)         # each bf16 half as the top of an fp32

rows = []
for v in (0x01, 0x3C, 0x7E):
    t = int((pos.view(torch.uint8) == v).nonzero())
    rows.append({"E4M3": f"0x{v:02x}", "s": s[t].item(), "e": int(e[t]), "m": int(m[t]),
                 "b = (e+10)<<3 | m": f"{int(b[t]):08b}", "stored": f"{int(stored[t]):08b}",
                 "prmt": f"0x{int(rep[t]):08x}", "fp32": f"0x{int(fp32[t:t + 1].view(torch.int32)) & U32:08x}",
                 "/ 2^75": fp32[t].item() * 2.0 ** -75, "bf16 pair": f"0x{int(pair[t]):08x}",
                 "/ 2^107": lo[t].item() * 2.0 ** -107})
print(render_table(rows))
print(f"all {pos.numel()} positive E4M3 scales: stored = b with its nibbles swapped:",
      torch.equal(stored, ((b << 4) | (b >> 4)) & 0xFF), "| the padding's bytes zero:",
      bool((scale_bytes[:, 1:] == 0).all()))
print(f"  fp32 = s x 2^{packed.SCALE_EXP['fma']}:", bool((fp32 == s * 2.0 ** packed.SCALE_EXP["fma"]).all()),
      f"| bf16 pair = s x 2^{packed.SCALE_EXP['mma']} in both halves:",
      bool(((lo == s * 2.0 ** packed.SCALE_EXP["mma"]) & (hi == lo)).all()))

# %% [markdown]
# A word reads its two scales as one 16-bit value, the pair at byte `2i` of its chunk's 8: block `2i` in the low
# byte (the permute's selector `0x0000` copies it), block `2i + 1` in the high one (selector `0x1111`). With (d),
# the whole weight of (a) by hand, the way the packed GEMV decodes it: words and scale pairs to `e2m1 x s`, put back in
# K order, against `e2m1 x s` from the checkpoint's codes and E4M3 scales:

# %%
pairs = p.scales.cpu().view(torch.int16).to(torch.int64) & 0xFFFF        # [N, Kp/32]: bytes 2t, 2t + 1 as one value
w_ix = torch.arange(p.words.shape[1])
v = pairs[:, (w_ix // 16) * 4 + w_ix % 4]                                # word 16c + 4q + i: pair i of chunk c
s_lo = as_fp32((((v & 0xFF) * 0x01010101) & 0x0FF00000) | packed.SCALE_OR["fma"])   # block 2i: s x 2^75
s_hi = as_fp32((((v >> 8) * 0x01010101) & 0x0FF00000) | packed.SCALE_OR["fma"])     # block 2i + 1
e8 = decode_by_hand(p.words.cpu())                                       # [N, Kp/8, 8]: e2m1 x 2^-126
ws = torch.cat([e8[..., :4] * s_lo[..., None], e8[..., 4:] * s_hi[..., None]], dim=-1) * 2.0 ** 51   # e2m1 x s
by_hand = torch.zeros_like(every)
by_hand[:, wk.flatten()] = ws.flatten(1)
ckpt = want * q.scales.cpu().float().repeat_interleave(16, dim=1)       # e2m1 x s from the checkpoint
print(f"words + scale pairs -> e2m1 x s, all {p.k * p.words.shape[0]} weights equal the checkpoint's:",
      bool((by_hand[:, :p.k] == ckpt).all()), "| the padding zero:", bool((by_hand[:, p.k:] == 0).all()))

# %% [markdown]
# The packed GEMV multiplies the decoded `e2m1 * 2^-126` by `x * 2^64`, so every product `e2m1 * x * 2^-62` is a
# normal fp32 and exact; each half word's 4 products are one FMA chain, scaled by its block's `s * 2^75` with one
# more FMA, and the epilogue multiplies by `g * 2^-13`. Its `x` must follow the words' order: it loads a step's `x`
# contiguous and reorders it to the words' K positions with a reshape and a permute (on the GPU through shared
# memory: the `x` a thread needs is spread over its warp's loads). The tensor-core tile multiplies each bf16 pair by
# its block's pair `s * 2^107` instead, giving `e2m1 * s * 2^-19`, exact in bf16 (six significant bits), and
# `_fragment_tile` joins, reshapes and permutes the eight decoded elements into the tile in K order; compiled for
# the GPU that is a relabelling of registers, since each thread already holds its part of the operand. The epilogue
# undoes the `2^-19`. Every step is exact but the fp32 additions, as in the reference.
#
# **(f) The three kernels on the packed layout.** `nvfp4_linear(x, pack(w))` at M = 1 and 2 (the packed GEMV, on
# these 48 rows), M = 8 (the tensor-core GEMV) and M = 40 (the GEMM), on the grid data of section 3 (bf16: every
# order of the sums is exact, so the output must match the reference bit for bit, and the checkpoint layout's too)
# and on random data in fp32 (round-off, shown against a bound). `traced` watches the three launch functions of
# `triton_matmul` to show which one each call took:

# %%
import contextlib
from unittest import mock

LAUNCHES = {"launch_packed_gemv": "packed GEMV", "launch_gemv": "tensor-core GEMV", "launch_gemm": "GEMM"}


def traced(fn, *args):
    """``fn(*args)``, and the launches of ``triton_matmul`` it went through (watched, not replaced)."""
    with contextlib.ExitStack() as stack:
        spies = {label: stack.enter_context(mock.patch.object(triton_matmul, name,
                                                              wraps=getattr(triton_matmul, name)))
                 for name, label in LAUNCHES.items()}
        out = fn(*args)
    return out, ", ".join(label for label, spy in spies.items() if spy.called)


rows = []
for m in (1, 2, 8, 40):
    x, w = grid_case(m, 48, 512, seed=20 + m, dtype=torch.bfloat16)
    y, kernel = traced(nvfp4_linear, x, pack(w))
    exact = compare(y, reference.nvfp4_linear(x, w), exact=True)
    rows.append({"M": m, "kernel": kernel, "case": "grid bf16 48x512", "max_abs = 0": exact.max_abs == 0,
                 "mismatches": exact.mismatches,
                 "same bits as checkpoint layout": compare(y, nvfp4_linear(x, w), exact=True).mismatches == 0,
                 "rel_l2 < 1e-6": exact.rel_l2 < 1e-6})
    x, w = randn_case(m, 40, 208, seed=20 + m)
    y, kernel = traced(nvfp4_linear, x, pack(w))
    rows.append({"M": m, "kernel": kernel, "case": "randn fp32 40x208",
                 "rel_l2 < 1e-6": compare(y, reference.nvfp4_linear(x, w)).rel_l2 < 1e-6})
print(render_table(rows, ["M", "kernel", "case", "max_abs = 0", "mismatches", "same bits as checkpoint layout",
                          "rel_l2 < 1e-6"]))


# %% [markdown]
# Which of the two decode kernels takes M = 1 and 2 depends on the number of output rows; both read the same words
# and must give the same bits. Each of them on its own (`launch_packed_gemv`, `launch_gemv`), on grid data with an
# odd N and a K that leaves the last chunk padded, then the dispatch's choice over M and N:

# %%
rows = []
for m in (1, 2):
    x, w = grid_case(m, 37, 208, seed=30 + m, dtype=torch.bfloat16)
    want_y = reference.nvfp4_linear(x, w)
    for label, launch in (("packed GEMV", triton_matmul.launch_packed_gemv),
                          ("tensor-core GEMV", triton_matmul.launch_gemv)):
        y = launch(x, pack(w), None, torch.full((m, 37), float("nan"), dtype=x.dtype, device=x.device))  # poisoned
        rows.append({"M": m, "kernel": label, "case": "grid bf16 37x208",
                     "mismatches vs reference": compare(y, want_y, exact=True).mismatches})
print(render_table(rows))
print("\nuse_packed_gemv(m, n): the decode kernel for a packed weight")
print(render_table([{"M": m, **{f"N={n:,}": "FMA" if triton_matmul.use_packed_gemv(m, n) else "tensor-core"
                                for n in (2048, 8191, 8192, 65536, 65537, 248320)}} for m in (1, 2, 3, 16)]))

# %% [markdown]
# **(g) The prefill path.** From `DEQUANT_MIN_M` rows of x on, `nvfp4_linear` stops decoding in the GEMM's registers:
# it writes the packed weight once to a workspace of x's dtype (`launch_packed_dequantize`: the tensor-core tile
# `e2m1 * s * 2^-19`, stored instead of multiplied) and calls cuBLAS (`torch.addmm` on the CPU too), whose fp32
# `alpha` carries `g * 2^19`. Thousands of rows of x reuse each weight, so the bytes stop mattering and the tensor
# cores' schedule decides, which is cuBLAS's strength (section 7 has the H200's crossover). The workspace, read back
# and undone by `2^19`, is `e2m1 * s` itself; the product on grid data is exact, so it must match the reference bit
# for bit whichever path runs:

# %%
LAUNCHES["launch_dequant_gemm"] = "dequantise + cuBLAS"
x, w = grid_case(triton_matmul.DEQUANT_MIN_M, 37, 208, seed=41, dtype=torch.bfloat16)
p37 = pack(w)
ws = triton_matmul.launch_packed_dequantize(p37, torch.empty(37, 208, dtype=torch.bfloat16, device=DEVICE))
unit_s = nvfp4.reference.dequantize(lk.NVFP4Tensor(w.codes, w.scales, torch.ones((), device=w.codes.device)),
                                    torch.float32)                       # e2m1 x s from the checkpoint's bytes
print("workspace x 2^19 == e2m1 x s for every weight:", bool((ws.float() * 2.0 ** 19 == unit_s).all()))
rows = []
for m in (triton_matmul.DEQUANT_MIN_M - 1, triton_matmul.DEQUANT_MIN_M):
    y, kernel = traced(nvfp4_linear, x[:m], p37)
    rows.append({"M": m, "kernel": kernel, "case": "grid bf16 37x208",
                 "mismatches vs reference": compare(y, reference.nvfp4_linear(x[:m], w), exact=True).mismatches})
print(render_table(rows))

# %% [markdown]
# Section 5's `lynn check matmul` runs every one of its rows on both layouts, and the two decode kernels on their own.
# Two paths are not run here: on the GPU the packed GEMV decodes its scales in inline PTX (`_decode_scales_asm`: the
# `prmt` and `lop3` of (e)), and with bf16 activations the tensor-core tile decodes a word in inline PTX
# (`_decode_word_bf16`: the scale pair by the same two instructions, the two masks of (d) per pair, then one
# `mul.rn.bf16x2` by its block's scale); the interpreter cannot run them, so here both take the portable decode
# (shifts and masks to the same bits).
#
# ### On the H200
#
# `lynn bench matmul.graph` times each decoder projection shape the way a decoder runs it: captured in a **CUDA
# graph** of 8 to 64 consecutive calls on rotating weight sets (together past 3x the L2), replayed, divided by the
# calls. In one process: ours on the packed layout as `nvfp4_linear` dispatches it ("packed"), the packed layout's
# two decode kernels on their own (the packed GEMV at M = 1 and 2, the tensor-core GEMV at M = 1 to 16), ours on the
# checkpoint layout (section 3's kernels), cuBLAS bf16 `F.linear` on the dequantised weights, and a plain Triton
# kernel that only **reads the packed weight's bytes** (the same bytes: a per-shape floor for a simple kernel, not a
# hard limit). The results are committed in `data/bench/h200/matmul.graph.json` and `matmul.chain.json`, read
# here. M = 1 first ("kernel": the one the dispatch takes):

# %%
GRAPH, CHAIN = load("matmul.graph", gpu="h200"), load("matmul.chain", gpu="h200")
PACKED, CKPT = "lynn packed (graph)", "lynn checkpoint layout (graph)"
FMA, TC = "lynn packed GEMV (graph)", "lynn packed tensor-core GEMV (graph)"
CUBLAS_G, READ = "cuBLAS bf16 (graph)", "pure read (same bytes) (graph)"

G = {}                                                    # {(shape, M): {provider: result row}}
for r in GRAPH["results"]:
    G.setdefault((r["shape"], r["dims"]["M"]), {})[r["provider"]] = r
G_SHAPES = list(dict.fromkeys(s for s, _ in G))
G_MS = sorted({m for _, m in G})


def t_us(shape, m, provider):
    return G[shape, m][provider]["median_ms"] * 1e3


def x_cublas(shape, m, provider=PACKED):
    """cuBLAS bf16's graph-replay time over the provider's: above 1, the provider is faster."""
    return t_us(shape, m, CUBLAS_G) / t_us(shape, m, provider)


def short(shape):
    return shape.rsplit(" ", 1)[0] if "->" in shape else shape


def decode_kernel(shape, m):
    """The decode kernel ``nvfp4_linear`` takes for the packed weight of this cell (``use_packed_gemv``)."""
    return "FMA" if triton_matmul.use_packed_gemv(m, G[shape, m][PACKED]["dims"]["N"]) else "tensor-core"


for d in (GRAPH, CHAIN):
    p = d["provenance"]
    print(f"{d['op']}: {p['gpu']}, {p['date']}, git {p['git_sha']}{' (dirty)' if p['git_dirty'] else ''}, "
          f"torch {p['torch']}, triton {p['triton']}, CUDA {p['cuda']}; `{p['command']}`")
print(f"ceilings: read {GRAPH['ceilings']['read_gbps']:,.0f} GB/s, copy {GRAPH['ceilings']['copy_gbps']:,.0f} "
      f"GB/s\n")
print("M = 1, kernel time (us); x cuBLAS = cuBLAS time / packed time; of pure read = pure-read time / packed time")
print(render_table([{"shape": s, "kernel": decode_kernel(s, 1),
                     **{col: f"{t_us(s, 1, prov):.1f}" for col, prov in
                        (("packed", PACKED), ("packed GEMV", FMA), ("tensor-core GEMV", TC), ("checkpoint", CKPT),
                         ("cuBLAS bf16", CUBLAS_G), ("pure read", READ))},
                     "x cuBLAS": f"{x_cublas(s, 1):.2f}",
                     "of pure read": f"{t_us(s, 1, READ) / t_us(s, 1, PACKED):.0%}",
                     "packed TB/s": f"{G[s, 1][PACKED]['gbps'] / 1e3:.2f}"} for s in G_SHAPES]))

# %% [markdown]
# The same, drawn (log scale). The bar of the decode kernel the dispatch takes is outlined, and the number over it
# is `nvfp4_linear`'s speed-up over cuBLAS. On the smallest shape the packed GEMV beats the simple pure-read kernel,
# so that floor is loose there; on the large ones it is the one to reach.

# %%
# NBVAL_IGNORE_OUTPUT
from matplotlib.patches import Patch

SERIES = ((FMA, "lynn packed GEMV", "tab:blue"), (TC, "lynn packed, tensor-core GEMV", "tab:purple"),
          (CKPT, "lynn checkpoint layout", "tab:cyan"), (CUBLAS_G, "cuBLAS bf16", "tab:orange"),
          (READ, "pure read, same bytes", "0.6"))
fig, ax = plt.subplots(figsize=(9.5, 4.2))
for i, (prov, label, color) in enumerate(SERIES):
    xs = [j + (i - 2) * 0.16 for j in range(len(G_SHAPES))]
    bars = ax.bar(xs, [t_us(s, 1, prov) for s in G_SHAPES], 0.16, label=label, color=color)
    for bar, s in zip(bars, G_SHAPES):
        if (prov, decode_kernel(s, 1)) in ((FMA, "FMA"), (TC, "tensor-core")):      # the dispatch's kernel
            bar.set_edgecolor("k")
            bar.set_linewidth(1.2)
            ax.text(bar.get_x() + 0.08, bar.get_height() * 1.08, f"{x_cublas(s, 1):.2f}x", ha="center", fontsize=6)
ax.set_yscale("log")
ax.set_xticks(range(len(G_SHAPES)), [short(s) + ("\n" + s.rsplit(" ", 1)[1] if "->" in s else "")
                                     for s in G_SHAPES], fontsize=7)
ax.set_ylabel("kernel time at M = 1 (us)")
ax.set_title(f"{GRAPH['provenance']['gpu']}, CUDA-graph replay, M = 1", fontsize=10)
ax.legend(handles=[Patch(facecolor=color, label=label) for _, label, color in SERIES]
          + [Patch(facecolor="none", edgecolor="k", label="the kernel nvfp4_linear takes")], fontsize=7)
plt.tight_layout()
plt.show()

# %% [markdown]
# From M = 1 to 16, the packed layout's speed-up over cuBLAS bf16. The tensor-core GEMV's time is flat in M, now
# that its tile no longer passes through shared memory; the packed GEMV does each row's FMAs, so its time grows with
# M. The two decode kernels on their own at M = 1 and 2 say where each wins, and whether the dispatch takes the
# faster one:

# %%
SMALL = [m for m in G_MS if m <= 16]
print("packed layout: cuBLAS bf16 time / ours")
print(render_table([{"shape": s, **{f"M={m}": f"{x_cublas(s, m):.2f}" for m in SMALL}} for s in G_SHAPES]))
rows, faster = [], 0
for s in G_SHAPES:
    row = {"shape": s, "N": G[s, 1][PACKED]["dims"]["N"]}
    for m in (1, 2):
        f, t = t_us(s, m, FMA), t_us(s, m, TC)
        row |= {f"M={m} FMA us": f"{f:.1f}", f"M={m} tensor-core us": f"{t:.1f}",
                f"M={m} dispatch": decode_kernel(s, m)}
        faster += (decode_kernel(s, m) == "FMA") == (f < t)
    rows.append(row)
print("\nthe two decode kernels on their own, and the one the dispatch takes:")
print(render_table(rows))
print(f"the dispatch takes the faster of the two in {faster} of {2 * len(G_SHAPES)} cells")
ratio = [t_us(s, m, CKPT) / t_us(s, m, PACKED) for s in G_SHAPES for m in SMALL if m > 2]
print(f"\nM = 4..16, checkpoint-layout time / packed time on the tensor-core GEMV: "
      f"{min(ratio):.2f}-{max(ratio):.2f}x")

# %% [markdown]
# The GEMM rows (prefill; the benchmark runs them on the first three shapes only, each autotunes per layout):

# %%
GEMM_MS = [m for m in G_MS if m > 16]
print("GEMM: ratio = cuBLAS bf16 time / ours")
print(render_table([{"shape": s, "M": m, **{f"{col} us": f"{t_us(s, m, prov):.1f}" for col, prov in
                                            (("packed", PACKED), ("checkpoint", CKPT), ("cuBLAS", CUBLAS_G))},
                     "packed ratio": f"{x_cublas(s, m):.2f}", "checkpoint ratio": f"{x_cublas(s, m, CKPT):.2f}",
                     "packed TFLOP/s": f"{G[s, m][PACKED]['tflops']:.0f}"}
                    for s in G_SHAPES for m in GEMM_MS if (s, m) in G]))

# %% [markdown]
# **Programmatic dependent launch** (PDL, Hopper: `launch_packed_gemv(..., pdl=True)`, the packed GEMV only) lets a
# GEMV start loading its weights while the kernel before it finishes, and wait for it only to read `x`.
# `lynn bench matmul.chain` replays the projections of 10 Gated DeltaNet layers (qkv, z, out_proj: 30 GEMVs at
# M = 1) as one graph, on the packed GEMV with and without PDL and on the tensor-core GEMV, against the copy bandwidth:

# %%
chain = CHAIN["results"]
print(f"{chain[0]['shape']}: {chain[0]['dims']['kernels']} kernels in one graph, {chain[0]['bytes'] / 1e6:.1f} MB "
      f"read; copy ceiling {CHAIN['ceilings']['copy_gbps']:,.0f} GB/s")
print(render_table([{"provider": r["provider"], "us": f"{r['median_ms'] * 1e3:.1f}",
                     "us a projection": f"{r['median_ms'] * 1e3 / r['dims']['kernels']:.2f}",
                     "GB/s": f"{r['gbps']:,.0f}", "of copy bandwidth": f"{r['frac_of_ceiling']:.1%}"}
                    for r in chain]))
chain_us = {r["provider"]: r["median_ms"] * 1e3 for r in chain}
plain, with_pdl, on_tc = (chain_us[f"lynn packed {name} (graph)"] for name in
                          ("GEMV chain", "GEMV chain + PDL", "tensor-core GEMV chain"))
saved = plain - with_pdl
print(f"PDL saves {saved:.1f} us of {plain:.1f} ({saved / chain[0]['dims']['kernels']:.2f} us a projection); "
      f"on the tensor-core GEMV the chain takes {on_tc / plain:.2f}x as long")

# %% [markdown]
# **Goals** for the packed layout (graph-replay kernel time against cuBLAS bf16): at least **2.5x** at every
# M = 1..16, **3.2x** on the LM head and 8192 x 8192 (at M = 1, their best M), and **0.8x** for the GEMM.
# (Section 7's goals are those of the first benchmark, of the checkpoint layout.)

# %%
BIG = [s for s in G_SHAPES if s.startswith(("lm head", "square 8192"))]
PACKED_GOALS = [  # (goal, cells, target: cuBLAS bf16 time / ours)
    ("M = 1..16: >= 2.5x cuBLAS bf16", [(s, m) for s in G_SHAPES for m in SMALL], 2.5),
    ("LM head and 8192 x 8192, M = 1: >= 3.2x", [(s, 1) for s in BIG], 3.2),
    ("GEMM, M = 64 / 512 / 4096: >= 0.8x", [(s, m) for s in G_SHAPES for m in GEMM_MS if (s, m) in G], 0.8),
]
verdict = []
for goal, where, target in PACKED_GOALS:
    vals = {c: x_cublas(*c) for c in where}
    best, worst = max(vals, key=vals.get), min(vals, key=vals.get)
    met = sum(v >= target for v in vals.values())
    verdict.append({"goal": goal, "cells": len(vals), "meeting it": met,
                    "best": f"{vals[best]:.2f}x ({short(best[0])}, M={best[1]})",
                    "worst": f"{vals[worst]:.2f}x ({short(worst[0])}, M={worst[1]})",
                    "goal met": met == len(vals)})
print(render_table(verdict))

# %% [markdown]
# **None of the three goals is met**, but the fragment order moved the time. The tensor-core GEMV no longer sends
# its decoded tile through shared memory, and its time is flat from M = 1 to 16: from M = 4 it is 0.75-1.82x
# cuBLAS bf16 (below 1 only on the two smallest weights, 2048->4096 and 512->2048) and 1.12-1.94x the checkpoint
# layout, where the first packed layout made 0.72-1.25x of cuBLAS (`docs/matmul.md`: 2048->8192 at M = 4 went from
# 14.5 to 10.1 us, the LM head from 203 to 135). At M = 1 the packed layout is 1.33-1.77x faster than cuBLAS and
# 1.29-2.26x faster than the checkpoint layout; 1.77x on the LM head and 1.45x on 8192 x 8192 fall short of 3.2x.
# There the packed GEMV is 1.04-2.02x faster than the tensor-core GEMV below 65,536 rows, yet slower than the first
# layout's on the large shapes (2048->8192: 6.7 -> 8.3 us): those words held 8 neighbours along K, whose `x` a
# thread loaded itself, and now `x` is exchanged between threads. At M = 2 it wins only below 8,192 rows. The
# GEMM reaches 0.49-0.86x of cuBLAS (0.49-0.57x at M = 512 and 4096; goal 0.8x) and 1.00-1.50x the checkpoint
# layout: the decode is work cuBLAS does not do. PDL helps a chain of small GEMVs a little (0.43 us a projection),
# and the chain still uses about a quarter of the copy bandwidth (on the tensor-core GEMV it takes 1.37x as long).
# On the LM head and 8192 x 8192, M = 1 reads at 1.6-2.2 TB/s, 47-50% of the same-bytes read.

# %% [markdown]
# A round of experiments on the packed GEMV (2026-12-02, H200: tiles and grids, programs streaming several tiles,
# PDL's early release, the host's cost of a call; what it kept and rejected) is recorded, whole, in
# [`docs/history/notebook-02-experiments.md`](../docs/history/notebook-02-experiments.md).

# %% [markdown]
# ## 5. Validation table
#
# `lynn check matmul` runs the three entry points on the awkward shapes the tests sweep (M = 1, 2, 3, 9, 16, 17,
# 129; K = 16 to 2064; bf16, fp16 and fp32; with and without bias) against the reference, each on the checkpoint layout
# and on the packed one of section 4 (the `packed` rows), and up to M = 16 the packed layout's two decode kernels on
# their own (the `gemv packed` rows), and at M = 1 and 2 `norm_linear`, the RMSNorm run inside the packed GEMV's launch
# (its product against the reference product of its own normed rows, the normed rows within one rounding of the norm's
# reference, the residual sum exact). Its random data puts its error figures at round-off level, where an fp16 or bf16
# output can flip by one unit in the last place on another machine, so its table is shown but not checked; the pass
# count is:

# %%
# NBVAL_IGNORE_OUTPUT
check_out, seconds = check.run_checks(["matmul"])
print(check.table(rounded(check_out), columns=check.PORTABLE_COLUMNS))
print(f"\n{seconds:.1f} s on backend {lk.backend()!r}")

# %%
print(f"lynn check matmul: {sum(r['passed'] for r in check_out)}/{len(check_out)} passed")


# %% [markdown]
# The harder cases, on grid data so that every backend must match the reference bit for bit: K = 1040 (65
# blocks, a ragged last chunk), the GEMV's largest M (16) and the GEMM's smallest (17), bias, fp16, a 3-D `x`,
# a strided `x` (a column slice of a wider tensor), M = 0:

# %%
def exact_row(op, fn, label, x, w, bias=None):
    m = compare(fn(x, w, bias), reference.nvfp4_linear(x, w, bias), exact=True)
    return {"op": op, "case": label, "metrics": m, "passed": m.mismatches == 0}


def grid_bias(n, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(-8, 9, (n,), generator=gen) / 8).to(dtype).to(DEVICE)


OPS = {"nvfp4_gemv": nvfp4_gemv, "nvfp4_gemm": nvfp4_gemm, "nvfp4_linear": nvfp4_linear}
val = []
x, w = grid_case(1, 70, 1040, seed=3, dtype=torch.bfloat16)
val += [exact_row(op, fn, "M=1 bf16 70x1040", x, w) for op, fn in OPS.items()]
x, w = grid_case(17, 70, 1040, seed=4, dtype=torch.bfloat16)
b = grid_bias(70, torch.bfloat16)
val += [exact_row("nvfp4_gemv", nvfp4_gemv, "M=16 bf16 70x1040 +bias", x[:16], w, b)]
val += [exact_row(op, nvfp4_linear if op == "nvfp4_linear" else nvfp4_gemm, "M=17 bf16 70x1040 +bias", x, w, b)
        for op in ("nvfp4_gemm", "nvfp4_linear")]
x, w = grid_case(6, 48, 256, seed=5, dtype=torch.float16)
val += [exact_row("nvfp4_linear", nvfp4_linear, "x [2, 3, 256] fp16 +bias", x.view(2, 3, 256), w,
                  grid_bias(48, torch.float16))]
x, w = grid_case(33, 48, 272, seed=6, dtype=torch.bfloat16)
val += [exact_row("nvfp4_linear", nvfp4_linear, f"strided x[:, :256], stride {x.stride(0)}", x[:, :256],
                  lk.NVFP4Tensor(w.codes[:, :128], w.scales[:, :16], w.global_scale))]
x, w = grid_case(33, 48, 256, seed=7)
val += [exact_row("nvfp4_gemm", nvfp4_gemm, "M=33 fp32 48x256 +bias", x, w, grid_bias(48, torch.float32))]
val += [exact_row(op, fn, "M=0", x[:0], w) for op, fn in OPS.items()]
print(check.table(rounded(val), columns=check.PORTABLE_COLUMNS))
print(f"\n{sum(r['passed'] for r in val)}/{len(val)} passed")

# %% [markdown]
# And the errors the kernels raise where they cannot do what was asked:

# %%
x, w = grid_case(17, 48, 256, seed=8, dtype=torch.bfloat16)
stacked = lk.NVFP4Tensor.stack([w, w])
for call in (lambda: nvfp4_gemv(x, w), lambda: nvfp4_linear(x, stacked), lambda: nvfp4_linear(x[:, :128], w),
             lambda: nvfp4_linear(x, w, torch.zeros(47, device=DEVICE))):
    try:
        call()
    except (TypeError, ValueError) as err:
        print(f"{type(err).__name__}: {err}")

# %% [markdown]
# ## 6. `NVFP4Linear`: quantisation as a module swap
#
# `NVFP4Linear.from_linear(linear)` quantises an `nn.Linear`'s weight and keeps the packed codes, E4M3 scales and
# global scale as buffers (so `state_dict` and `.to(device)` carry them); its forward is `nvfp4_linear`, the GEMV
# for up to 16 tokens and the GEMM above. `quantize_linears(model, skip=...)` swaps every eligible Linear in place,
# as gpt-fast does; a name in `skip` (or a predicate) keeps a layer in bf16, as one would an LM head. On a small
# bf16 MLP, keeping its last layer:

# %%
torch.manual_seed(0)
mlp = nn.Sequential(nn.Linear(256, 512), nn.SiLU(), nn.Linear(512, 256), nn.SiLU(), nn.Linear(256, 64))
mlp = mlp.to(torch.bfloat16).to(DEVICE)
mlp_q = copy.deepcopy(mlp)
swapped = quantize_linears(mlp_q, skip=("4",))
print("swapped:", swapped)
print(mlp_q)


def state_bytes(module):
    return sum(t.numel() * t.element_size() for t in module.state_dict().values())


print(f"\nstate_dict: {state_bytes(mlp):,} bytes in bf16 -> {state_bytes(mlp_q):,} bytes")

# %% [markdown]
# Against the bf16 model the quantised one loses what 4 bits lose (notebook 01, section 4); against the same
# quantised model run on the reference ops (`use_reference()`) it should agree to round-off:

# %%
gen = torch.Generator().manual_seed(1)
rows = []
for m in (1, 24):                                                      # decode (GEMV) and a short prompt (GEMM)
    x = torch.randn(m, 256, generator=gen).bfloat16().to(DEVICE)
    with torch.no_grad():
        y_bf16, y_q = mlp(x), mlp_q(x)
        with lk.use_reference():
            y_ref = mlp_q(x)
    vs_bf16 = compare(y_q, y_bf16)
    rows.append({"tokens": m, "kernel": "GEMV" if m <= triton_matmul.GEMV_MAX_M else "GEMM",
                 "cosine vs bf16 model": r4(vs_bf16.cosine), "rel_l2 vs bf16 model": float(f"{vs_bf16.rel_l2:.3g}"),
                 "cosine vs reference ops": round(compare(y_q, y_ref).cosine, 6)})
print(render_table(rows))

# %% [markdown]
# ## 7. Profile on the H200
#
# What is timed (`lynn_kernels/bench/matmul.py`, `lynn bench matmul.linear`): six shapes (Qwen3.5 / Qwen3-Next
# projections, an LM head and two squares) at M from 1 to 4096, `nvfp4_linear` against cuBLAS bf16 `F.linear` on
# the same weights (dequantised to bf16 for cuBLAS), both validated against the reference before timing, weights
# rotated past L2. Each provider is timed twice:
#
# * **kernel**: the CUDA profiler's kernel duration, what a decode step captured in a CUDA graph pays;
# * **call**: `do_bench` of the Python call, what an eager loop pays; for short kernels it measures the host's
#   launch cost more than the GPU.
#
# Bytes are what each provider must read (packed codes and scales for ours, bf16 for cuBLAS) plus activations, so
# the fraction of the measured **read** ceiling says how close each comes to its own floor.
#
# **Goals**: at M = 1, a kernel time 3x below cuBLAS bf16 (the bytes allow 3.56x) at 75% of the read ceiling; at
# M = 4096, 0.7x of cuBLAS bf16's throughput.
#
# On a GPU the first cell below runs a quick benchmark live (one shape, three M). The tables after it always read
# the committed results, `data/bench/h200/matmul.linear.json`, so they are the same on every machine.

# %%
OURS, CUBLAS = "lynn nvfp4_linear", "cuBLAS bf16 F.linear"


def cells(d):
    """{(shape, M): {provider: result row}} of a benchmark document, in the benchmark's order."""
    out = {}
    for r in d["results"]:
        out.setdefault((r["shape"], r["dims"]["M"]), {})[r["provider"]] = r
    return out


def us(r):
    return round(r["median_ms"] * 1e3, 1)


def speedup(p):
    """cuBLAS kernel time / ours: above 1, ours is faster."""
    return p[f"{CUBLAS} (kernel)"]["median_ms"] / p[f"{OURS} (kernel)"]["median_ms"]


def perf_rows(d, ms=None):
    rows = []
    for (shape, m), p in cells(d).items():
        if ms is None or m in ms:
            o, c = p[f"{OURS} (kernel)"], p[f"{CUBLAS} (kernel)"]
            rows.append({"shape": shape, "M": m, "ours us": us(o), "cuBLAS us": us(c),
                         "speedup": round(speedup(p), 2),
                         "ours of read": f"{o['frac_of_ceiling']:.0%}",
                         "cuBLAS of read": f"{c['frac_of_ceiling']:.0%}",
                         "ours TFLOP/s": round(o["tflops"], 1), "cuBLAS TFLOP/s": round(c["tflops"], 1)})
    return rows


CELLS = cells(doc)
SHAPE_NAMES = list(dict.fromkeys(s for s, _ in CELLS))
MS = sorted({m for _, m in CELLS})

# %%
# NBVAL_IGNORE_OUTPUT
if torch.cuda.is_available():
    from lynn_kernels.bench import measure_ceilings
    from lynn_kernels.bench.harness import provenance
    from lynn_kernels.bench.matmul import bench_linear

    live_ceilings = measure_ceilings()
    live = {"op": "matmul.linear", "provenance": provenance("notebook 02, quick run"),
            "ceilings": live_ceilings.as_dict(),
            "results": [r.as_dict() for r in bench_linear(live_ceilings, quick=True)]}
    print(f"live on {live['provenance']['gpu']}: read {live_ceilings.read_gbps:,.0f} GB/s, bf16 matmul "
          f"{live_ceilings.bf16_tflops:.0f} TFLOP/s")
    print(render_table(perf_rows(live)))
else:
    print("no GPU: nothing is timed under the interpreter; below, the committed H200 results")

# %%
p = doc["provenance"]
print(f"{doc['op']} on the {p['gpu']}, {p['date']}, git {p['git_sha']}, torch {p['torch']}, triton {p['triton']}, "
      f"CUDA {p['cuda']}; command `{p['command']}`")
if p.get("git_sha_note"):
    print("provenance note:", p["git_sha_note"])
print(f"ceilings: read {ceil['read_gbps']:,.0f} GB/s, copy {ceil['copy_gbps']:,.0f} GB/s, "
      f"bf16 matmul {ceil['bf16_tflops']:.0f} TFLOP/s\n")
print("kernel time (CUDA profiler); speedup = cuBLAS time / ours:")
print(render_table(perf_rows(doc, ms=(1, 16, 128, 4096))))
print("\nspeedup over cuBLAS bf16 (kernel time), every cell:")
print(render_table([{"shape": s, **{f"M={m}": round(speedup(CELLS[s, m]), 2) for m in MS}} for s in SHAPE_NAMES]))

# %% [markdown]
# The plot puts every kernel measurement on two axes: time against M per shape (left; ours solid, cuBLAS dashed),
# and TFLOP/s against arithmetic intensity under the measured roofs (right). Ours sits about 3.5x further right
# than cuBLAS at the same M (fewer bytes for the same flops), so the read roof is higher for it. The bf16 "peak" is one
# 8192^3 matmul measured in the same process; cuBLAS can exceed it on other shapes, so read it as a reference
# line, not a hard limit.

# %%
# NBVAL_IGNORE_OUTPUT
from matplotlib.lines import Line2D

from lynn_kernels.bench import plots

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
for i, s in enumerate(SHAPE_NAMES):
    ms = [m for m in MS if (s, m) in CELLS]
    for prov, ls, who in ((OURS, "-", "ours"), (CUBLAS, "--", "cuBLAS")):
        ax1.loglog(ms, [CELLS[s, m][f"{prov} (kernel)"]["median_ms"] * 1e3 for m in ms], ls, marker="o", ms=3,
                   c=f"C{i}", label=f"{s} ({who})")
ax1.set_xlabel("M (tokens)")
ax1.set_ylabel("kernel time (us)")
ax1.set_title("kernel time: ours (solid) vs cuBLAS bf16 (dashed)", fontsize=10)
ax1.legend(handles=[Line2D([], [], c=f"C{i}", marker="o", ms=3, label=s) for i, s in enumerate(SHAPE_NAMES)]
           + [Line2D([], [], c="0.3", ls=ls, label=who) for ls, who in (("-", "ours"), ("--", "cuBLAS bf16"))],
           fontsize=8, ncol=2, loc="upper left")                  # a colour per shape, a line style per provider
kernel_doc = {**doc, "results": [r for r in doc["results"] if r["provider"].endswith("(kernel)")]}
plots.plot_roofline(kernel_doc, ax=ax2, title="roofline, kernel time (read ceiling, bf16 matmul)")
ax2.axhline(ceil["bf16_tflops"], ls=":", c="0.5", lw=1)
ax2.text(0.12, ceil["bf16_tflops"] * 1.08, f"bf16 8192^3: {ceil['bf16_tflops']:.0f} TFLOP/s", fontsize=7)
plt.tight_layout()
plt.show()

# %% [markdown]
# **Host cost.** At decode sizes the kernels take microseconds; the Python call around them (argument checks,
# allocation, Triton's launcher) costs more, and an eager loop pays it on every layer. Call against kernel time,
# M = 1 to 16:

# %%
small = [(s, m) for s in SHAPE_NAMES for m in MS if m <= 16]


def span(key, where):
    vals = [CELLS[s, m][key]["median_ms"] * 1e3 for s, m in where]
    return min(vals), max(vals)


print(render_table([{"shape": shape, **{f"{who} {kind} us": "{:.0f}-{:.0f}".format(
    *span(f"{prov} ({kind})", [(s, m) for s, m in small if s == shape]))
    for who, prov in (("ours", OURS), ("cuBLAS", CUBLAS)) for kind in ("call", "kernel")}}
    for shape in SHAPE_NAMES]))
short = [(s, m) for s, m in small if CELLS[s, m][f"{OURS} (kernel)"]["median_ms"] < 0.020]   # kernels < 20 us
oc, ok, cc = span(f"{OURS} (call)", short), span(f"{OURS} (kernel)", short), span(f"{CUBLAS} (call)", short)
print(f"\nkernels under 20 us ({', '.join(dict.fromkeys(s for s, _ in short))}): ours {oc[0]:.0f}-{oc[1]:.0f} "
      f"us per call for {ok[0]:.0f}-{ok[1]:.0f} us of kernel; cuBLAS's call on the same cells: "
      f"{cc[0]:.0f}-{cc[1]:.0f} us")

# %% [markdown]
# **Goals**, cell by cell:

# %%
GOALS = [  # (goal, M, measure, target)
    ("M=1: kernel 3x faster than cuBLAS bf16", 1, "speedup", 3.0),
    ("M=1: 75% of the read ceiling", 1, "read", 0.75),
    ("M=4096: 0.7x cuBLAS bf16 throughput", 4096, "speedup", 0.7),
]


def measure(p, kind):
    return speedup(p) if kind == "speedup" else p[f"{OURS} (kernel)"]["frac_of_ceiling"]


def show(v, kind):
    return f"{v:.2f}x" if kind == "speedup" else f"{v:.0%}"


goal_rows = []
for goal, m, kind, target in GOALS:
    vals = {s: measure(CELLS[s, m], kind) for s in SHAPE_NAMES if (s, m) in CELLS}
    met = [s for s, v in vals.items() if v >= target]
    best, worst = max(vals, key=vals.get), min(vals, key=vals.get)
    goal_rows.append({"goal": goal, "cells": len(vals), "meeting it": len(met), "missing it": len(vals) - len(met),
                      "best": f"{show(vals[best], kind)} ({best})",
                      "worst": f"{show(vals[worst], kind)} ({worst})"})
print(render_table(goal_rows))


# %% [markdown]
# **The prefill path on the H200** (`data/experiments/dequant-gemm/9130a4f.json`, git 9130a4f): the packed GEMM
# kernel against the prefill path (dequantise once, then cuBLAS: both launches timed together), each as a fraction of
# cuBLAS bf16 on bf16 weights, by CUDA-graph replay on rotating weights. The kernel's one-stage compile (the Triton
# 3.6 fault of docs/history/compiler-fault.md) holds it near 0.4x at every M; the two-launch path pays the dequantise kernel's
# 7-20 us once, so it climbs with M and passes the 0.8x goal from 1,024 rows. `nvfp4_linear` switches at 128:

# %%
import json
from pathlib import Path

dq = json.loads(Path(lk.__file__).resolve().parents[1].joinpath(
    "data/experiments/dequant-gemm/9130a4f.json").read_text())
fig, ax = plt.subplots(figsize=(8, 3.4))
for shape in dict.fromkeys(r["shape"] for r in dq["crossover"]):
    cells = [r for r in dq["crossover"] if r["shape"] == shape]
    line, = ax.plot([r["M"] for r in cells], [r["dequant+cuBLAS vs cuBLAS"] for r in cells], "o-", label=shape)
    ax.plot([r["M"] for r in cells], [r["packed GEMM vs cuBLAS"] for r in cells], "x--", c=line.get_color())
ax.axhline(0.8, ls=":", c="0.4")
ax.axvline(triton_matmul.DEQUANT_MIN_M, ls=":", c="0.7")
ax.text(1100, 0.75, "goal 0.8x", fontsize=8)
ax.set_xscale("log", base=2)
ax.set_xlabel("M (rows of x)")
ax.set_ylabel("speed vs cuBLAS bf16")
ax.set_title("o-: dequantise + cuBLAS    x--: packed GEMM kernel", fontsize=9)
ax.legend(fontsize=7, loc="upper left")
plt.tight_layout()
plt.show()
print(render_table([{"shape": r["shape"], "M": r["M"], "GEMM kernel us": r4(r["packed GEMM kernel"]),
                     "dequantise + cuBLAS us": r4(r["dequantise + cuBLAS"]), "cuBLAS bf16 us": r4(r["cuBLAS bf16"]),
                     "vs cuBLAS": f"{r['dequant+cuBLAS vs cuBLAS']:.2f}x"}
                    for r in dq["crossover"] if r["M"] in (512, 4096)]))

# %% [markdown]
# ## 8. Explorer: one cell of the benchmark
#
# `describe(shape, m)` prints the four measurements of one (shape, M) cell (kernel and call time of both
# providers, GB/s, the fraction of the read ceiling, TFLOP/s) next to the floor of section 1. A fixed example
# first (checked), then the widgets.

# %%
def cell_rows(shape, m):
    p = CELLS[shape, m]
    return [{"provider": prov, "us": us(p[prov]), "GB/s": round(p[prov]["gbps"]),
             "of read": f"{p[prov]['frac_of_ceiling']:.1%}", "TFLOP/s": round(p[prov]["tflops"], 1)}
            for prov in (f"{OURS} (kernel)", f"{CUBLAS} (kernel)", f"{OURS} (call)", f"{CUBLAS} (call)")]


def describe(shape, m):
    p = CELLS[shape, m]
    dims = p[f"{OURS} (kernel)"]["dims"]
    ours = p[f"{OURS} (kernel)"]["median_ms"] * 1e3
    floor = floor_us(dims["N"], dims["K"], m, 0.5625)
    head = (f"{shape}, M = {m} (N = {dims['N']}, K = {dims['K']}): ours {ours:.1f} us, cuBLAS "
            f"{p[f'{CUBLAS} (kernel)']['median_ms'] * 1e3:.1f} us -> {speedup(p):.2f}x; "
            f"the floor is {floor:.1f} us, ours takes {ours / floor:.1f}x that")
    return head + "\n" + render_table(cell_rows(shape, m))


print(describe(SHAPE_NAMES[0], MS[0]))

# %%
# NBVAL_IGNORE_OUTPUT
import ipywidgets as widgets
from IPython.display import display


def plot_cell(shape, m):
    rows = cell_rows(shape, m)
    dims = CELLS[shape, m][f"{OURS} (kernel)"]["dims"]
    fig, ax = plt.subplots(figsize=(7, 2.4))
    bars = ax.barh([r["provider"] for r in rows], [r["us"] for r in rows],
                   color=["tab:blue", "tab:orange", "tab:blue", "tab:orange"])
    for b in bars[2:]:
        b.set_alpha(0.45)                                            # call times, lighter
    ax.axvline(floor_us(dims["N"], dims["K"], m, 0.5625), ls="--", c="k", lw=1, label="NVFP4 floor")
    ax.invert_yaxis()
    ax.set_xlabel("microseconds")
    ax.legend(fontsize=7, loc="lower right")
    plt.show()


def show_cell(shape, m):
    print(describe(shape, m))
    plot_cell(shape, m)


style = {"description_width": "initial"}
shape_w = widgets.Dropdown(options=SHAPE_NAMES, value=SHAPE_NAMES[0], description="shape", style=style)
m_w = widgets.SelectionSlider(options=MS, value=MS[0], description="M (tokens)", style=style)
out = widgets.interactive_output(show_cell, {"shape": shape_w, "m": m_w})
display(widgets.VBox([widgets.HBox([shape_w, m_w]), out]))

# %% [markdown]
# Things to try: walk M up at a fixed shape and watch the kernel time stay flat until the tensor cores take over
# (and our call time stay well above our kernel time); compare the LM head (the largest weight, the most bytes in
# flight) with the small projections at M = 1; at M = 4096 look at TFLOP/s instead of the fraction of the read
# ceiling.

# %% [markdown]
# ## 9. What we measured, and what's next
#
# The summary below is computed from the committed results of section 7 (the first benchmark, of the checkpoint
# layout), so it follows them when the benchmark is re-run; section 4 has what the packed layout measured since.

# %%
at = {m: [CELLS[s, m] for s in SHAPE_NAMES if (s, m) in CELLS] for m in (1, 4096)}
sp1 = [speedup(p) for p in at[1]]
rd1 = [p[f"{OURS} (kernel)"]["frac_of_ceiling"] for p in at[1]]
over_floor = [p[f"{OURS} (kernel)"]["median_ms"] * 1e3
              / floor_us(p[f"{OURS} (kernel)"]["dims"]["N"], p[f"{OURS} (kernel)"]["dims"]["K"], 1, 0.5625)
              for p in at[1]]
tf = [p[f"{OURS} (kernel)"]["tflops"] for p in at[4096]]
tf_cublas = [p[f"{CUBLAS} (kernel)"]["tflops"] for p in at[4096]]
sp_big = [speedup(p) for p in at[4096]]
met = sum(r["meeting it"] for r in goal_rows)
total = sum(r["cells"] for r in goal_rows)
print(f"Decode, M = 1 ({len(sp1)} shapes): our kernel runs at {min(sp1):.2f}-{max(sp1):.2f}x cuBLAS bf16's "
      f"speed (goal 3x) and reads at {min(rd1):.0%}-{max(rd1):.0%} of the read ceiling (goal 75%); it takes "
      f"{min(over_floor):.1f}-{max(over_floor):.1f}x the time its bytes need.")
print(f"Prefill, M = 4096: {min(tf):.0f}-{max(tf):.0f} TFLOP/s, {min(sp_big):.2f}-{max(sp_big):.2f}x cuBLAS bf16 "
      f"(goal 0.7x), which reaches {min(tf_cublas):.0f}-{max(tf_cublas):.0f} TFLOP/s.")
print(f"Eager calls where the kernel takes under 20 us (M <= 16, {len(short)} cells): {oc[0]:.0f}-{oc[1]:.0f} us "
      f"per call around {ok[0]:.0f}-{ok[1]:.0f} us of kernel; cuBLAS's call {cc[0]:.0f}-{cc[1]:.0f} us.")
print(f"Goals met in {met} of {total} cells.")

# %% [markdown]
# So the packed format's bytes are not yet turned into time. At decode the kernel is bound by its own decode and
# latency, not by the bandwidth; at prefill the decode is work that cuBLAS does not have to do (which is why a
# prefill now dequantises each weight once and hands the product to cuBLAS: section 7's last figure); and in an
# eager loop the host launch costs more than either kernel. `docs/matmul.md` records what was measured and rejected on the way (an
# fp32 multiply-reduce GEMV without tensor cores, the textbook `x @ W^T` orientation, run-time autotuning of the
# GEMV). Measured since, each with its figure in `docs/history/matmul.md`: packed GEMV tiles and grids, programs that
# stream several tiles (persistent programs), an early PDL release, two steps of weights in registers, `x`
# pre-ordered to the words' order and L2 prefetch, all rejected
# ([`docs/history/notebook-02-experiments.md`](../docs/history/notebook-02-experiments.md) has the first three);
# a launch that skips Triton's launcher after the first call (`runtime.DirectLaunch`: 20.7 us a call instead of
# 71.9) and CUDA graphs for the decode loop (notebook 06), both in use. Not tried yet:
#
# * the tensor-core GEMV with `x` held in registers, and a PDL form of it;
# * a shared-memory ring of weight steps filled by `cp.async` / TMA (more bytes in flight per program);
# * a persistent kernel that runs a layer's projections back to back.
#
# Next notebook: `03-grouped-moe` runs the same decode over many experts at once, in a grouped GEMM.
