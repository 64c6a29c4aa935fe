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
# # 01: NVFP4 from the bits up
#
# NVFP4 stores a weight in 4 bits: an **E2M1** code per element, an **E4M3** scale per 16 elements and one
# **fp32** scale per tensor. This notebook builds it from first principles, then builds a dequantise kernel step
# by step and hands over to the package's:
#
# 1. E2M1, the 4-bit element, from its bits; its rounding rule
# 2. E4M3 (FN), the 8-bit scale, from its bits; why the scale is E4M3 and why there is a global fp32 scale
# 3. the block format and the reference: packing, bytes per weight
# 4. quantisation error against bf16 and a toy int4 quantiser, on Gaussian and heavy-tailed weights; the two recipes
# 5. the dequantise kernel, step by step, then the package's kernel and its bit trick
# 6. the validation table
# 7. the H200 profile, from committed results
# 8. an interactive explorer of one block
#
# Everything runs on a CPU through Triton's interpreter, on small shapes; on a GPU the same cells run compiled.

# %%
# %matplotlib inline
import lynn_kernels as lk  # noqa: I001  (first: it picks the backend before triton is imported)
import math

import matplotlib.pyplot as plt
import numpy as np
import torch
import triton
import triton.language as tl

from lynn_kernels import check, compare, nvfp4, render_table
from lynn_kernels.notebook import r4, rounded  # 4 significant digits, so nbval's text comparison holds
from lynn_kernels.nvfp4 import reference
from lynn_kernels.runtime import DEVICE

# %%
# NBVAL_IGNORE_OUTPUT
print(lk.device_summary())


# %% [markdown]
# ## 1. E2M1: the 4-bit element
#
# Four bits: one sign bit `s`, two exponent bits `e`, one mantissa bit `m`, exponent bias 1.
#
# $$
# \text{value} = (-1)^s \times
# \begin{cases}
# 2^{e-1}\,(1 + m/2) & e > 0 \quad\text{(normal)}\\
# 2^{1-1}\,(m/2) = m/2 & e = 0 \quad\text{(subnormal: no implicit 1)}
# \end{cases}
# $$
#
# Code `s e1 e0 m` is bit 3 to bit 0. There is no infinity and no NaN: the largest magnitude is 6. Decoding all
# 16 codes in plain Python and checking them against the package's table:

# %%
def e2m1_decode(code: int) -> float:
    s, e, m = code >> 3, (code >> 1) & 0b11, code & 1
    mag = m / 2 if e == 0 else 2.0 ** (e - 1) * (1 + m / 2)
    return -mag if s else mag


table = nvfp4.e2m1_table().tolist()
print("code  bits   s  e  m   value   e2m1_table()")
for c in range(16):
    v = e2m1_decode(c)
    print(f" 0x{c:x}  {c:04b}   {c >> 3}  {(c >> 1) & 3}  {c & 1}   {v:+.1f}    {table[c]:+.1f}")

same = all(e2m1_decode(c) == table[c] and math.copysign(1, e2m1_decode(c)) == math.copysign(1, table[c])
           for c in range(16))
print("all 16 codes match, signs of zero included:", same)

# %% [markdown]
# **Rounding.** A value `x` (already divided by its scale) goes to the nearest of
# `{0, 0.5, 1, 1.5, 2, 3, 4, 6}` with its sign. A value exactly halfway between two neighbours is a tie, and a
# tie goes to the neighbour whose mantissa bit is 0 ("ties to even"): 0.25 -> 0, 0.75 -> 1, 1.25 -> 1,
# 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4. There is no infinity to overflow into, so anything past 6 saturates
# to 6. The reference encoder, `reference.encode_e2m1`, counts thresholds:

# %%
xs = [0.1, 0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 2.6, 3.5, 5.0, 5.1, 6.0, 7.0, 1e6, -0.1, -2.5]
codes = reference.encode_e2m1(torch.tensor(xs)).tolist()
ties = {0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0}
for x, c in zip(xs, codes):
    note = "tie -> even mantissa" if abs(x) in ties else ("saturates" if abs(x) > 6 else "")
    print(f"{x:>9g} -> code 0x{c:x} = {e2m1_decode(c):+.1f}   {note}")


# %% [markdown]
# The same rule written as a brute-force search (nearest value; on a tie the even mantissa) agrees with the
# reference on every multiple of 1/64 in [-8, 8], ties included:

# %%
def e2m1_nearest(x: float) -> int:
    best = min(range(8), key=lambda c: (abs(abs(x) - e2m1_decode(c)), c & 1))   # distance, then odd mantissa
    return best | (8 if x < 0 else 0)


grid = [k / 64 for k in range(-512, 513)]
enc = reference.encode_e2m1(torch.tensor(grid)).tolist()
print(f"{len(grid)} points, disagreements: {sum(e2m1_nearest(x) != c for x, c in zip(grid, enc))}")

# %%
# NBVAL_IGNORE_OUTPUT
x = torch.linspace(-7, 7, 2801)
y = nvfp4.e2m1_table()[reference.encode_e2m1(x).long()]
fig, ax = plt.subplots(figsize=(6.5, 3.2))
ax.plot(x, x, c="0.8", lw=1, label="x")
ax.plot(x, y, lw=1.5, label="e2m1(round(x))")
t = torch.tensor(sorted(ties | {-v for v in ties}))
ax.plot(t, nvfp4.e2m1_table()[reference.encode_e2m1(t).long()], "o", ms=4, label="ties (to even)")
ax.set_xlabel("x (already divided by the scale)")
ax.set_ylabel("decoded value")
ax.set_title("E2M1 rounding: steps of 0.5, 1 and 2; saturates at 6", fontsize=10)
ax.legend(fontsize=8)
plt.show()


# %% [markdown]
# ## 2. E4M3 (FN): the 8-bit block scale
#
# Eight bits: sign, four exponent bits with bias 7, three mantissa bits.
#
# $$
# \text{value} = (-1)^s \times
# \begin{cases}
# 2^{e-7}\,(1 + m/8) & e > 0\\
# 2^{-6}\,(m/8) = m \cdot 2^{-9} & e = 0 \quad\text{(subnormals, down to } 2^{-9}\text{)}
# \end{cases}
# $$
#
# "FN" means finite: there are no infinities, and only `S.1111.111` (0x7F and 0xFF) is NaN. So exponent 15
# still holds numbers, and the largest is `2^8 x 1.75 = 448`. Decoding all 256 codes in plain Python and comparing
# them with `torch.float8_e4m3fn`:

# %%
def e4m3_decode(code: int) -> float:
    s, e, m = code >> 7, (code >> 3) & 0xF, code & 0b111
    if e == 15 and m == 7:
        return math.nan
    mag = m * 2.0 ** -9 if e == 0 else 2.0 ** (e - 7) * (1 + m / 8)
    return -mag if s else mag


mine = [e4m3_decode(c) for c in range(256)]
theirs = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().tolist()
agree = sum((math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
            for a, b in zip(mine, theirs))
finite = [v for v in mine if not math.isnan(v)]
pos = sorted(v for v in finite if v > 0)
print(f"codes that agree with torch.float8_e4m3fn: {agree}/256")
print(f"NaN codes: {[f'0x{c:02X}' for c in range(256) if math.isnan(mine[c])]}")
print(f"largest {max(finite)}, smallest normal {2.0 ** -6} = 2^-6, smallest subnormal {pos[0]} = 2^-9")
print(f"distinct positive values: {len(pos)}, spanning 2^{math.log2(pos[0]):.0f} .. 2^{math.log2(pos[-1]):.2f}")

# %% [markdown]
# **Why the scale is E4M3.** A block's 16 values are divided by their scale so that the block's largest
# magnitude lands near 6, the top of E2M1. A power-of-two scale (MXFP4's E8M0) can place it only within a factor
# of two, so part of the 4-bit grid goes unused (or the top of the block clips); E4M3's three mantissa bits put it
# within about 1/16 of 6. The price is range: E4M3 spans only about 2^-9 .. 448.
#
# **Why a global fp32 scale.** Real weights are small (a std of about 0.02), so their block scales,
# `block_amax / 6`, would sit in E4M3's subnormals or underflow to 0; large activations would saturate at 448.
# NVFP4 adds one fp32 scale per tensor, `global = amax / (6 * 448) = amax / 2688`. Then the block holding the
# tensor's amax gets scale exactly `amax / (6 * global) = 448`, and every other block
# `448 * block_amax / amax`: the scales use the top of E4M3's range whatever the tensor's magnitude, and only a
# block some 10^4 times smaller than the largest falls into the subnormals.
#
# The same 64 x 256 Gaussian at four magnitudes, with the global scale forced to 1.0 and with `amax / 2688`:

# %%
w0 = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
rows = []
for mult in (1e-4, 0.02, 1.0, 1e3):
    w = w0 * mult
    for label, g in (("1.0", 1.0), ("amax/2688", None)):
        with np.errstate(divide="ignore"):           # a scale that underflows to 0 divides by 0 on purpose
            q = nvfp4.quantize(w.to(DEVICE), g)
        s = q.scales.float().cpu()
        err = compare(nvfp4.dequantize(q, torch.float32), w)
        rows.append({"weights": f"randn x {mult:g}", "global scale": label,
                     "scale min": s.min().item(), "scale max": s.max().item(),
                     "subnormal": f"{(s < 2 ** -6).float().mean().item():.1%}",
                     "at 448": f"{(s == 448).float().mean().item():.1%}", "rel_l2": r4(err.rel_l2)})
print(render_table(rows))

# %% [markdown]
# With the global scale fixed at 1.0, tiny weights underflow to zero scales (the whole tensor decodes to 0,
# `rel_l2 = 1`), small ones lose precision in the subnormals and large ones clip at 448. With `amax / 2688` the
# error is the same at every magnitude.

# %% [markdown]
# ## 3. The block format, and the reference
#
# An NVFP4 tensor of logical shape `[..., K]` (K a multiple of 16) is three tensors
# (`lynn_kernels.NVFP4Tensor`):
#
# | field | dtype, shape | content |
# |---|---|---|
# | `codes` | uint8 `[..., K/2]` | two E2M1 codes per byte: element `2j` in the **low** nibble of byte `j`, element `2j+1` in the high nibble |
# | `scales` | float8_e4m3fn `[..., K/16]` | one scale per 16 consecutive elements along K |
# | `global_scale` | fp32 `()` (or `[E]` for stacked experts) | multiply convention: `amax / 2688` |
#
# $$ w_{k} \approx \text{e2m1}(\text{code}_k)\times \text{scale}_{\lfloor k/16 \rfloor}\times\text{global} $$
#
# Quantising one block (ModelOpt recipe): `s = RN_e4m3(block_amax / (6 * global))`, then every element
# `code = RNE_e2m1(w / (s * global))`. The reference, `lynn_kernels.nvfp4.reference`, is that in a few lines of
# torch. Here is one row of 32 weights (two blocks), quantised by the package and taken apart by hand:

# %%
gen = torch.Generator().manual_seed(3)
w = (torch.randn(1, 32, generator=gen) * 0.02)
q = nvfp4.quantize(w.to(DEVICE))

g = q.global_scale.item()
s8 = q.scales[0].cpu()
print(f"global scale = amax / 2688 = {w.abs().max().item():.6f} / 2688 = {g:.6e}")
for b in range(2):
    bam = w[0, 16 * b:16 * (b + 1)].abs().max().item()
    print(f"block {b}: amax {bam:.6f} -> amax / (6 g) = {bam / (6 * g):.4f} -> E4M3 "
          f"0x{s8.view(torch.uint8)[b].item():02x} = {s8[b].float().item():g}")
print("codes (bytes, hex):", " ".join(f"{x:02x}" for x in q.codes[0].tolist()))

# %%
byte = q.codes[0].tolist()
nib = reference.unpack_nibbles(q.codes[0].cpu()).tolist()
deq = nvfp4.dequantize(q, torch.float32)[0].cpu()
scale = s8.float()
print(" k   byte  nibble  code  e2m1   x scale x global = value      original")
for k in range(8):
    half = "low " if k % 2 == 0 else "high"
    v = e2m1_decode(nib[k]) * scale[k // 16].item() * g
    print(f"{k:2d}   0x{byte[k // 2]:02x}  {half}    0x{nib[k]:x}  {e2m1_decode(nib[k]):+.1f}  "
          f"x {scale[k // 16].item():g} x {g:.4e} = {v:+.6f}   {w[0, k].item():+.6f}")
print("...")
by_hand = torch.tensor([e2m1_decode(c) for c in nib]) * (scale.repeat_interleave(16) * g)
print("dequantize(q) equals the hand decoding, bit for bit:",
      compare(deq, by_hand, exact=True).mismatches == 0)

# %% [markdown]
# **Bytes per weight.** Half a byte per code plus one byte per 16 elements for the scale, against 2 for bf16
# (the 4-byte global scale is per tensor):

# %%
w = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
q = nvfp4.quantize(w.to(DEVICE))
n = w.numel()
print(f"codes {q.codes.numel() / n:.4f} + scales {q.scales.numel() / n:.4f} = "
      f"{(q.codes.numel() + q.scales.numel()) / n:.4f} bytes per weight, "
      f"+ {4 * q.global_scale.numel()} bytes per tensor")
print(f"bf16: 2 bytes per weight, {2 / 0.5625:.2f}x more")

# %% [markdown]
# Shapes NVFP4 cannot represent raise an error that says what was expected:

# %%
for bad in (torch.randn(4, 200), torch.tensor([[1.0, float("nan")] * 8])):
    try:
        nvfp4.quantize(bad.to(DEVICE))
    except ValueError as err:
        print("ValueError:", err)


# %% [markdown]
# ## 4. Quantisation error
#
# How much do 4 bits lose? On fp32 weights of two shapes, a Gaussian and a heavy-tailed Student-t (3 degrees of
# freedom: occasional weights many standard deviations out, as real checkpoints have), we compare against the fp32
# weights:
#
# * **bf16**: plain rounding, the unit of `err_ratio`;
# * **NVFP4**: `quantize` then `dequantize` from the package;
# * **int4 g16**: a toy symmetric int4 quantiser written right here (not a library kernel): groups of 16, scale
#   `absmax / 7` stored in fp32 or bf16, integer levels -7..7. Same group size as NVFP4, so the difference is the
#   grid: 15 evenly spaced levels against E2M1's 15 levels that are dense near 0.

# %%
def int4_group_roundtrip(w: torch.Tensor, group: int = 16, scale_dtype=torch.float32) -> torch.Tensor:
    """Toy symmetric int4 quantise + dequantise, one absmax scale per `group` elements along the last dim."""
    blocks = w.unflatten(-1, (-1, group))
    scale = (blocks.abs().amax(-1, keepdim=True) / 7).to(scale_dtype).float()
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return (torch.clamp(torch.round(blocks / scale), -7, 7) * scale).flatten(-2)


# numpy's generator: the same numbers on every CPU (torch's CPU normal sampler differs with the vector ISA)
rng = np.random.default_rng(0)
N, K, DF = 128, 1024, 3
gaussian = torch.from_numpy(rng.standard_normal((N, K), dtype=np.float32)) * 0.02
student_t = torch.from_numpy(rng.standard_t(DF, (N, K)).astype(np.float32)) * 0.02

err_rows = []
for dist, w in (("gaussian", gaussian), ("student-t, 3 dof", student_t)):
    bf16 = w.bfloat16()
    candidates = {
        "bf16": (2.0, bf16),
        "nvfp4": (0.5625, nvfp4.dequantize(nvfp4.quantize(w.to(DEVICE)), torch.float32)),
        "int4 g16, fp32 scale": (0.75, int4_group_roundtrip(w)),
        "int4 g16, bf16 scale": (0.625, int4_group_roundtrip(w, scale_dtype=torch.bfloat16)),
    }
    for fmt, (bpw, out) in candidates.items():
        err_rows.append({"weights": dist, "format": fmt, "bytes/weight": bpw,
                         "m": compare(out, w, baseline=bf16)})
print(render_table(rounded(err_rows),
                   ["weights", "format", "bytes/weight", "cosine", "max_abs", "rel_l2", "err_ratio"]))
dists = list(dict.fromkeys(r["weights"] for r in err_rows))
fmts = list(dict.fromkeys(r["format"] for r in err_rows))

# %%
# NBVAL_IGNORE_OUTPUT
fig, ax = plt.subplots(figsize=(7.5, 3.2))
width = 0.8 / len(fmts)
for i, f in enumerate(fmts):
    ys = [next(r["m"].rel_l2 for r in err_rows if r["weights"] == d and r["format"] == f) for d in dists]
    ax.bar([j + (i - (len(fmts) - 1) / 2) * width for j in range(len(dists))], ys, width, label=f)
ax.set_xticks(range(len(dists)), dists)
ax.set_yscale("log")
ax.set_ylabel("rel_l2 against fp32 (log)")
ax.set_title("Quantisation error, 128 x 1024 weights", fontsize=10)
ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
plt.show()


# %%
def rel(dist, fmt):
    return next(r["m"].rel_l2 for r in err_rows if r["weights"] == dist and r["format"] == fmt)


for dist in dists:
    ratio = rel(dist, "nvfp4") / rel(dist, "int4 g16, fp32 scale")
    verdict = "lower" if ratio < 1 else "higher"
    print(f"{dist}: NVFP4's error is {ratio:.3f}x the int4 g16 error ({verdict}), "
          f"at 0.5625 against 0.75 bytes per weight")

# %% [markdown]
# On Gaussian weights the evenly spaced int4 grid does a little better; on heavy-tailed weights a block often
# holds one large value and many small ones, and E2M1's levels near 0 win. Both are some 50-70x the error of
# bf16 rounding: 4-bit weights are a trade of accuracy for bandwidth, measured at the model level, not hidden. On the
# shipped demo model (notebook 07) NVFP4 costs 1.6% of held-out perplexity (39.32 in bf16, 39.96 in NVFP4; the
# H200's compiled kernels give the same to within 0.03%), and plain int4 with a scale per 32 weights, at the same
# 4.5 bits, 1.3% ([`docs/quantization.md`](../docs/quantization.md)).
#
# **Two recipes.** Checkpoints come from two quantisers, ModelOpt and compressed-tensors (llm-compressor). They
# agree on the format and differ in the scale arithmetic: ModelOpt computes the global scale `amax / 2688` in fp32,
# compressed-tensors stores its reciprocal `2688 / amax` computed in the weight's dtype (bf16 for bf16 weights),
# and the block scale is `block_amax / (6 g)` in one and `(1/g) * (block_amax / 6 rounded to bf16)` in the other.
# The results differ in the last bits, which moves some block scales by one E4M3 step. The package reproduces
# both bit for bit (`recipe=`). How many block scales and codes differ on bf16 weights, with each recipe's own
# global scale and with one shared global scale:

# %%
recipe_rows = []
for seed, std in ((0, 0.02), (1, 0.02), (0, 1.0), (1, 1.0)):
    w = (torch.randn(128, 1024, generator=torch.Generator().manual_seed(seed)) * std).bfloat16().to(DEVICE)
    mo = nvfp4.quantize(w, recipe="modelopt")
    ct = nvfp4.quantize(w, recipe="compressed-tensors")
    mo_s = nvfp4.quantize(w, mo.global_scale, recipe="modelopt")
    ct_s = nvfp4.quantize(w, mo.global_scale, recipe="compressed-tensors")

    def frac(a, b):
        return f"{(a.cpu() != b.cpu()).float().mean().item():.2%}"

    recipe_rows.append({
        "weights": f"bf16 randn x {std:g}, seed {seed}",
        "global mo / ct - 1": f"{mo.global_scale.item() / ct.global_scale.item() - 1:+.2e}",
        "scales differ": frac(mo.scales.view(torch.uint8), ct.scales.view(torch.uint8)),
        "codes differ": frac(mo.codes, ct.codes),
        "scales differ (shared g)": frac(mo_s.scales.view(torch.uint8), ct_s.scales.view(torch.uint8)),
        "codes differ (shared g)": frac(mo_s.codes, ct_s.codes)})
print(render_table(recipe_rows))


# %% [markdown]
# Up to a few percent of block scales, depending on where the tensor's amax happens to fall; the error against
# the original is about the same for both. What matters is that a kernel reproducing one checkpoint uses that checkpoint's
# recipe, and that tests compare bits, not tolerances.

# %% [markdown]
# ## 5. The dequantise kernel, step by step
#
# Dequantise is a streaming kernel: read 0.5625 bytes per weight, write 2 (bf16), no reuse. Speed is bytes per
# second, and the arithmetic per element must be cheap. We build toy kernels under two rules the interpreter
# imposes (docs/interpreter.md): fp32 arithmetic only (the interpreter's bf16 arithmetic is wrong) and float32
# outputs. Each step must match the reference **bit for bit**.
#
# **Step 1: one program per row, a lookup table.** Each element loads the byte that holds its code (two elements
# share a byte), shifts out its nibble (even element: low nibble), looks the value up in the 16-entry E2M1 table,
# and multiplies by its block's scale `scales[k // 16]`, read as E4M3 and widened to fp32, times the global scale.
# The product is ordered as in the reference, `value * (scale * global)`, so the rounding is the same.

# %%
@triton.jit
def _toy_dequant_row_kernel(codes_ptr, scales_ptr, g_ptr, lut_ptr, out_ptr, K, BLOCK_K: tl.constexpr):
    pid_r = tl.program_id(0)                                               # one program per row
    offs_k = tl.arange(0, BLOCK_K)                                         # [BLOCK_K] element index
    mask_k = offs_k < K
    byte = tl.load(codes_ptr + pid_r * (K // 2) + offs_k // 2, mask=mask_k, other=0)
    nib = (byte >> ((offs_k % 2) * 4).to(tl.uint8)) & 0xF                 # even element: low nibble
    val = tl.load(lut_ptr + nib)                                           # [BLOCK_K] E2M1 value, fp32
    s = tl.load(scales_ptr + pid_r * (K // 16) + offs_k // 16, mask=mask_k, other=0.0).to(tl.float32)
    g = tl.load(g_ptr)
    tl.store(out_ptr + pid_r * K + offs_k, val * (s * g), mask=mask_k)


def toy_dequant_row(q: lk.NVFP4Tensor) -> torch.Tensor:
    n, k = q.shape
    out = torch.full((n, k), float("nan"), device=q.device)               # poisoned: unwritten shows as NaN
    lut = nvfp4.e2m1_table(q.device)
    _toy_dequant_row_kernel[(n,)](q.codes, q.scales, q.global_scale, lut, out, k,
                                  BLOCK_K=triton.next_power_of_2(k))
    return out


toy_cases = []
gen = torch.Generator().manual_seed(0)
for shape in ((64, 256), (48, 208), (1, 16)):
    q = nvfp4.quantize((torch.randn(shape, generator=gen) * 0.02).to(DEVICE))
    toy_cases.append((f"{shape[0]}x{shape[1]}", q, reference.dequantize(q, torch.float32)))

rows = [{"kernel": "step 1: row + lookup", "case": name, "m": compare(toy_dequant_row(q), want, exact=True)}
        for name, q, want in toy_cases]
print(render_table(rows, ["kernel", "case", "cosine", "max_abs", "mismatches"]))


# %% [markdown]
# Step 1 is correct but wasteful: every byte is loaded twice, a row is one program whatever its length, and the
# table lookup is a gather.
#
# **Step 2: a 2-D tile, each byte loaded once, arithmetic decode, the block scale broadcast.** A program owns a
# `BLOCK_R x BLOCK_K` tile. It loads `BLOCK_K / 2` bytes per row once, splits them into low and high nibbles and
# interleaves them back into element order. It decodes E2M1 with the formula of section 1 instead of a table
# (`2^(e-1)` as an integer shift, so it is exact). The `BLOCK_K / 16` scales of a row are loaded once and
# broadcast over their 16 elements by viewing the tile as `[BLOCK_R, BLOCK_K/16, 16]`. Masks cover the ragged
# edges, such as K = 208 in a 128-wide tile.
#
# One trap: the sign. On the GPU Triton compiles `-x` as `0 - x`, which turns code 0x8 (-0.0) into +0.0, while
# the interpreter keeps the sign. The kernel applies the sign with a multiply by ±1.0 instead, which keeps it on
# both. `max_abs` cannot see this kind of error (-0.0 equals +0.0); `mismatches` compares bits and does.

# %%
@triton.jit
def _toy_dequant_tile_kernel(codes_ptr, scales_ptr, g_ptr, out_ptr, R, K,
                             BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_r = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    offs_c = pid_k * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)                     # byte columns
    c = tl.load(codes_ptr + offs_r[:, None] * (K // 2) + offs_c[None, :],
                mask=mask_r[:, None] & (offs_c[None, :] < K // 2), other=0)           # [BLOCK_R, BLOCK_K/2]
    nib = tl.interleave(c & 0xF, c >> 4)                                              # [BLOCK_R, BLOCK_K]
    e = (nib >> 1) & 3
    m = (nib & 1).to(tl.float32)
    pow2 = (1 << e).to(tl.float32) * 0.5                                              # 2^(e-1), exact
    mag = tl.where(e == 0, 0.5 * m, pow2 * (1.0 + 0.5 * m))
    val = mag * tl.where((nib & 8) != 0, -1.0, 1.0)                                  # sign by multiply: keeps -0.0
    offs_s = pid_k * (BLOCK_K // 16) + tl.arange(0, BLOCK_K // 16)
    s = tl.load(scales_ptr + offs_r[:, None] * (K // 16) + offs_s[None, :],
                mask=mask_r[:, None] & (offs_s[None, :] < K // 16), other=0.0)        # [BLOCK_R, BLOCK_K/16]
    block_scale = s.to(tl.float32) * tl.load(g_ptr)
    v = tl.reshape(val, (BLOCK_R, BLOCK_K // 16, 16)) * block_scale[:, :, None]     # broadcast over 16
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + offs_r[:, None] * K + offs_k[None, :], tl.reshape(v, (BLOCK_R, BLOCK_K)),
             mask=mask_r[:, None] & (offs_k[None, :] < K))


def toy_dequant_tiled(q: lk.NVFP4Tensor, BLOCK_R: int = 16, BLOCK_K: int = 128) -> torch.Tensor:
    n, k = q.shape
    out = torch.full((n, k), float("nan"), device=q.device)
    grid = (triton.cdiv(n, BLOCK_R), triton.cdiv(k, BLOCK_K))
    _toy_dequant_tile_kernel[grid](q.codes, q.scales, q.global_scale, out, n, k,
                                   BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K)
    return out


rows += [{"kernel": "step 2: 2-D tile, arithmetic", "case": name,
          "m": compare(toy_dequant_tiled(q), want, exact=True)} for name, q, want in toy_cases]
print(render_table(rows, ["kernel", "case", "cosine", "max_abs", "mismatches"]))

# %% [markdown]
# **Step 3: hand over to the package.** `lynn_kernels.nvfp4.dequantize` is the same 2-D tile with three more
# ideas (see `_nvfp4_dequantize_kernel` in `lynn_kernels/nvfp4/triton_quant.py`):
#
# * it reads the scales as raw bytes and decodes E4M3 with integer ops, so the result does not depend on how a
#   backend converts fp8;
# * it writes bf16 (or fp16, fp32) with round-to-nearest-even on every backend, handles any leading dims (one
#   global scale per expert for stacked `[E, N, K]` weights) and is autotuned over tile shapes on the GPU;
# * it decodes E2M1 with a **bit trick** instead of arithmetic: drop the code's three magnitude bits `e1 e0 m`
#   into an fp16 word at bits 11..9 (the two low exponent bits and the top mantissa bit) and its sign bit at
#   bit 15. The fp16 word then reads `2^(e-15) (1 + m/2) = value x 2^-14` for `e > 0`, and for `e = 0` it is an
#   fp16 subnormal, `2^-14 x (512 m / 1024) = value x 2^-14`, so subnormals come out right too. The factor `2^14`
#   is folded into the per-block scale (one multiply per 16 elements; a power of two, so exact). Per element:
#   two shifts, two ands, an or and an fp16-to-fp32 convert: no table, no branch.
#
# The trick, checked on all 16 codes in plain torch/numpy:

# %%
nib = np.arange(16, dtype=np.uint16)
half_bits = ((nib & 7) << 9) | ((nib & 8) << 12)
as_half = half_bits.view(np.float16).astype(np.float32)
print("code  fp16 bits          fp16 value      x 2^14   e2m1")
for c in range(16):
    print(f" 0x{c:x}  {int(half_bits[c]):016b}  {as_half[c]:+.6e}  {as_half[c] * 2 ** 14:+5.1f}  {table[c]:+5.1f}")
print("value x 2^-14 for every code:", bool(np.all(as_half * 2 ** 14 == np.array(table, dtype=np.float32))))

# %%
# NBVAL_IGNORE_OUTPUT
# the lines of the package kernel that do it (read from the source, so this stays true)
import inspect

from lynn_kernels.nvfp4 import triton_quant

src = inspect.getsource(triton_quant).splitlines()
start = next(i for i, line in enumerate(src) if "E2M1 magnitude bits dropped" in line)
print("\n".join(src[start:start + 7]))

# %%
rows += [{"kernel": "package: nvfp4.dequantize", "case": name,
          "m": compare(nvfp4.dequantize(q, torch.float32), want, exact=True)} for name, q, want in toy_cases]
print(render_table(rows, ["kernel", "case", "cosine", "max_abs", "mismatches"]))


# %% [markdown]
# ## 6. Validation table
#
# `lynn check nvfp4` (quantise both recipes and dequantise to bf16 and fp32, compared bit for bit with the
# reference, plus the round-trip error), followed by a few harder cases: a single block, a block of zeros next
# to a 10^4 outlier at K = 208, fp16 in and out, and stacked experts `[E, N, K]` with one global scale per expert
# (passed to `quantize`, and built with `NVFP4Tensor.stack`).

# %%
def exact_rows(label, w, global_scale=None, out_dtypes=(torch.bfloat16,)):
    """Package against reference, bit for bit: quantise (both recipes; codes and scales) and dequantise."""
    out = []
    for recipe in nvfp4.RECIPES:
        got = nvfp4.quantize(w, global_scale, recipe=recipe)
        want = reference.quantize(w, global_scale, recipe=recipe)
        m = compare(got.codes, want.codes, exact=True)
        ms = compare(got.scales.view(torch.uint8), want.scales.view(torch.uint8), exact=True)
        out.append({"op": "nvfp4.quantize", "case": f"{label} {recipe}", "metrics": m,
                    "passed": m.mismatches == 0 and ms.mismatches == 0})
    q = reference.quantize(w, global_scale)
    for dt in out_dtypes:
        m = compare(nvfp4.dequantize(q, dt), reference.dequantize(q, dt), exact=True)
        out.append({"op": "nvfp4.dequantize", "case": f"{label} -> {str(dt)[6:]}", "metrics": m,
                    "passed": m.mismatches == 0})
    return out


gen = torch.Generator().manual_seed(7)
extra = []
extra += exact_rows("bf16 1x16", torch.randn(1, 16, generator=gen).bfloat16().to(DEVICE))
w = torch.randn(16, 208, generator=gen).bfloat16()
w[3, 16:32] = 0.0                                     # a block of zeros: its scale is replaced, codes are 0
w[5, 100] = 1e4                                       # one outlier sets the global scale
extra += exact_rows("bf16 16x208 zeros+outlier", w.to(DEVICE))
extra += exact_rows("fp16 8x128", torch.randn(8, 128, generator=gen).half().to(DEVICE),
                    out_dtypes=(torch.float16,))
experts = torch.randn(4, 32, 64, generator=gen) * torch.tensor([0.01, 0.1, 1.0, 10.0]).view(4, 1, 1)
g_e = experts.abs().amax(dim=(1, 2)) / 2688
extra += exact_rows("fp32 4x32x64 experts", experts.to(DEVICE), g_e.to(DEVICE),
                    out_dtypes=(torch.bfloat16, torch.float32))
stacked = lk.NVFP4Tensor.stack([reference.quantize(e.to(DEVICE)) for e in experts])
m = compare(nvfp4.dequantize(stacked), reference.dequantize(stacked), exact=True)
extra.append({"op": "nvfp4.dequantize", "case": "NVFP4Tensor.stack 4x32x64 -> bfloat16", "metrics": m,
              "passed": m.mismatches == 0})

base, _ = check.run_checks(["nvfp4"])
all_rows = base + [{"backend": lk.backend(), **r} for r in extra]
print(check.table(rounded(all_rows), columns=check.PORTABLE_COLUMNS))
print(f"\n{sum(r['passed'] for r in all_rows)}/{len(all_rows)} passed")

# %% [markdown]
# ## 7. Profile on the H200, from committed results
#
# **Goal**: dequantise at **85% or more of the measured copy bandwidth** on problems that move at least 64 MiB,
# and quantise at **60% or more**. Both are streaming ops, so a copy of the same bytes is the honest ceiling.
#
# On a CPU nothing is timed: the cells below read `data/bench/h200/` (written by `lynn bench nvfp4` on the
# H200), whatever results are committed there now. Bytes are the fewest the op must move; a provider that moves
# more (for example a separate amax pass over `w` before quantising) is still charged only those, and each row's
# `note` says so.

# %%
# NBVAL_IGNORE_OUTPUT
from lynn_kernels.bench import load, plots, result_table

docs = {op: load(op, gpu="h200") for op in ("nvfp4.dequantize", "nvfp4.quantize")}
for op, doc in docs.items():
    p = doc["provenance"]
    print(f"== {op}: {p['gpu']}, {p['date']}, git {p['git_sha']}, torch {p['torch']}, triton {p['triton']}; "
          f"copy ceiling {doc['ceilings']['copy_gbps']:,.0f} GB/s")
    print(result_table(doc, ["provider", "shape", "median_ms", "p20_ms", "p80_ms", "gbps", "frac_of_ceiling"]))
    notes = {}
    for r in doc["results"]:
        notes.setdefault(r["provider"], r.get("note") or "-")
    print("notes:", *(f"{p}: {n}" for p, n in notes.items()), sep="\n  ")
    print()

# %%
# NBVAL_IGNORE_OUTPUT
from matplotlib.text import Annotation

GOALS = {"nvfp4.dequantize": 0.85, "nvfp4.quantize": 0.60}


def values_inside(ax):
    """Each bar's GB/s upright inside the top of the bar (above a bar too short to hold it), in place of the labels
    plot_bandwidth writes above the bars, where neighbours of a similar height and the ceiling's label collide."""
    for text in [t for t in ax.texts if isinstance(t, Annotation)]:
        text.remove()
    top = ax.get_ylim()[1]
    for bars in ax.containers:
        for bar in bars:
            h = bar.get_height()
            if h:
                inside = h > 0.2 * top
                ax.annotate(f"{h:,.0f}", (bar.get_x() + bar.get_width() / 2, h), xytext=(0, -3 if inside else 3),
                            textcoords="offset points", rotation=90, ha="center", va="top" if inside else "bottom",
                            fontsize=7, color="white" if inside else "black")


fig, axes = plt.subplots(1, 2, figsize=(13, 4.6))
for ax, (op, doc) in zip(axes, docs.items()):
    plots.plot_bandwidth(doc, ax=ax)
    values_inside(ax)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2)   # below, off the bars
    ax.axhline(GOALS[op] * doc["ceilings"]["copy_gbps"], ls=":", c="tab:red", lw=1, zorder=0.5)   # behind the bars
    ax.text(-0.45, GOALS[op] * doc["ceilings"]["copy_gbps"], f"goal {GOALS[op]:.0%}", va="bottom",
            fontsize=8, color="tab:red")
plt.tight_layout()
plt.show()

# %%
# NBVAL_IGNORE_OUTPUT
MIB = 2 ** 20
for op, doc in docs.items():
    goal = GOALS[op]
    print(f"== {op}: goal {goal:.0%} of copy on >= 64 MiB")
    summary = []
    for r in doc["results"]:
        if not r["provider"].startswith("lynn"):
            continue
        big = r["bytes"] >= 64 * MIB
        same_size_copy = next((c for c in doc["results"] if c["shape"] == r["shape"]
                               and c["provider"].startswith("torch copy")), None)
        summary.append({"provider": r["provider"], "shape": r["shape"], "MiB": round(r["bytes"] / MIB),
                        "frac_of_ceiling": round(r["frac_of_ceiling"], 3),
                        "vs same-size copy": (round(r["gbps"] / same_size_copy["gbps"], 3)
                                              if same_size_copy else None),
                        "goal met": (r["frac_of_ceiling"] >= goal) if big else "n/a (< 64 MiB)"})
    print(render_table(summary))
    judged = [s for s in summary if s["goal met"] in (True, False)]
    best = max(judged, key=lambda s: s["frac_of_ceiling"]) if judged else None
    if best:
        print(f"met on {sum(s['goal met'] is True for s in judged)}/{len(judged)} rows >= 64 MiB; best "
              f"{best['frac_of_ceiling']:.1%} ({best['provider']}, {best['shape']}); worst "
              f"{min(s['frac_of_ceiling'] for s in judged):.1%}\n")

# %% [markdown]
# On a GPU, the cell below also times the package's dequantise live with `triton.testing.do_bench`, next to a
# copy of the same bytes in the same process (a small run, not the full benchmark; `lynn bench nvfp4` is that).

# %%
# NBVAL_IGNORE_OUTPUT
if torch.cuda.is_available():
    import triton.testing

    n, k = 8192, 8192
    q_big = nvfp4.quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16))
    nbytes = n * k // 2 + n * k // 16 + 2 * n * k
    assert compare(nvfp4.dequantize(q_big), reference.dequantize(q_big), exact=True).mismatches == 0
    src = torch.empty(nbytes // 2, device="cuda", dtype=torch.uint8)      # read + write = nbytes
    dst = torch.empty_like(src)
    ms_deq = triton.testing.do_bench(lambda: nvfp4.dequantize(q_big), warmup=25, rep=200)
    ms_copy = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200)
    for name, ms in (("nvfp4.dequantize", ms_deq), ("copy of the same bytes", ms_copy)):
        print(f"{name:<24} {n}x{k}: {ms * 1e3:7.1f} us  {nbytes / (ms * 1e-3) / 1e9:7,.0f} GB/s")
    print(f"dequantize / copy: {ms_copy / ms_deq:.1%}  ({lk.device_summary()['device']})")
    del q_big, src, dst
else:
    print("no GPU: showing committed H200 results (above); nothing is timed under the interpreter")


# %% [markdown]
# ## 8. Explorer: one block, taken apart
#
# `describe_block` quantises one block of 16 values as the first row of a tensor whose amax is
# `block amax / (block/tensor amax)` (a second row stands for the rest of the tensor, so each recipe picks its own
# global scale from it) and prints every intermediate: amax, the global scale, the E4M3 block scale (value and
# hex), the codes, the packed bytes, and per element the scaled value, its code and the error. A fixed example
# first (checked in CI), then the widgets.

# %%
def quantize_block(values, block_to_tensor=1.0, recipe="modelopt"):
    block = torch.tensor(values, dtype=torch.float32).bfloat16()            # weights arrive in bf16
    amax = block.float().abs().max().item()
    rest = torch.zeros(16, dtype=torch.bfloat16)
    rest[0] = amax / block_to_tensor if amax > 0 else 1.0                   # the tensor's amax lives here
    q = nvfp4.quantize(torch.stack([block, rest]).to(DEVICE), recipe=recipe)
    return block.float(), rest[0].item(), q, nvfp4.dequantize(q, torch.float32)[0].cpu()


def describe_block(values, block_to_tensor=1.0, recipe="modelopt") -> str:
    w, tensor_amax, q, deq = quantize_block(values, block_to_tensor, recipe)
    g = q.global_scale.item()
    s8 = q.scales[0, 0].cpu()
    s = s8.float().item()
    step = s * g
    codes = reference.unpack_nibbles(q.codes[0].cpu()).tolist()
    lines = [f"recipe {recipe}: block amax {w.abs().max().item():.6g}, "
             f"tensor amax {tensor_amax:.6g}, global scale {g:.4e}",
             f"E4M3 block scale 0x{s8.view(torch.uint8).item():02x} = {s:g}  ->  unit s*g = {step:.4e}",
             "codes  " + " ".join(f"{c:x}" for c in codes),
             "bytes  " + " ".join(f"{b:02x}" for b in q.codes[0].tolist()) + "   (even element: low nibble)",
             ""]
    elems = [{"k": k, "w": r4(w[k].item()), "w/(s*g)": r4(w[k].item() / step), "code": f"0x{codes[k]:x}",
              "e2m1": e2m1_decode(codes[k]), "dequant": r4(deq[k].item()),
              "error": r4(deq[k].item() - w[k].item())} for k in range(16)]
    return "\n".join(lines) + render_table(elems)


example = [0.012, -0.031, 0.004, 0.0, -0.0007, 0.09, 0.021, -0.018,
           0.0305, 0.0075, -0.0449, 0.015, 0.026, -0.006, 0.0011, -0.022]
print(describe_block(example, block_to_tensor=0.3, recipe="modelopt"))
print("\nthe same block, compressed-tensors recipe:")
print("\n".join(describe_block(example, block_to_tensor=0.3, recipe="compressed-tensors").splitlines()[:4]))

# %%
# NBVAL_IGNORE_OUTPUT
import ipywidgets as widgets
from IPython.display import display


def plot_block(values, block_to_tensor, recipe):
    w, _, q, deq = quantize_block(values, block_to_tensor, recipe)
    step = q.scales[0, 0].float().item() * q.global_scale.item()
    fig, ax = plt.subplots(figsize=(7, 3))
    for level in nvfp4.e2m1_table().tolist():
        ax.axhline(level * step, c="0.9", lw=0.8, zorder=0)
    ax.plot(range(16), w, "o", label="original (bf16)")
    ax.plot(range(16), deq, "x", ms=8, label="dequantised")
    ax.vlines(range(16), w, deq, colors="tab:red", lw=1, label="error")
    ax.set_xticks(range(16))
    ax.set_xlabel("element k (grey lines: the 15 values the block can hold)")
    ax.legend(fontsize=7, loc="upper right")
    plt.show()


style = {"description_width": "initial"}
controls = {
    "seed": widgets.IntSlider(0, min=0, max=50, description="seed", style=style),
    "std": widgets.FloatLogSlider(0.02, base=10, min=-3, max=1, description="std", style=style),
    "outlier": widgets.FloatSlider(4.0, min=0, max=12, step=0.5, description="outlier at k=5 (x std)",
                                   style=style),
    "block_to_tensor": widgets.FloatLogSlider(0.3, base=10, min=-5, max=0, description="block / tensor amax",
                                              style=style),
    "recipe": widgets.Dropdown(options=nvfp4.RECIPES, value="modelopt", description="recipe", style=style),
    "typed": widgets.Text("", placeholder="or type 16 comma-separated values", description="values",
                          style=style, layout=widgets.Layout(width="60%")),
}


def show(seed, std, outlier, block_to_tensor, recipe, typed):
    values = torch.randn(16, generator=torch.Generator().manual_seed(seed)) * std
    if outlier > 0:
        values[5] = outlier * std
    values = values.tolist()
    if typed.strip():
        try:
            values = [float(v) for v in typed.replace(";", ",").split(",") if v.strip()]
        except ValueError:
            values = []
        if len(values) != 16:
            print(f"need 16 numbers, got {len(values)}: using the seed instead")
            values = (torch.randn(16, generator=torch.Generator().manual_seed(seed)) * std).tolist()
    print(describe_block(values, block_to_tensor, recipe))
    plot_block(values, block_to_tensor, recipe)


c = list(controls.values())
out = widgets.interactive_output(show, controls)
display(widgets.VBox([widgets.HBox(c[:3]), widgets.HBox(c[3:5]), c[5], out]))

# %% [markdown]
# Things to try: move **block / tensor amax** down towards 10^-4 and watch the E4M3 scale fall into the
# subnormals (codes below 0x08) and the error grow; raise the **outlier** and watch the small values collapse to
# code 0; switch the **recipe** and look for a scale one step apart; type a block of your own, such as 16 equal
# values, or values that sit exactly on the E2M1 ties.
#
# Next: `02-packed-matvec` decodes these blocks inside a matrix-vector product instead of writing bf16
# out.
