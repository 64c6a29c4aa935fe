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
# # 04: Fused attention: flash prefill and split-KV decode
#
# One layer in four of the Qwen3-Next / Qwen3.5 decoder is full softmax attention, with a gate. This notebook
# builds its kernels from the math up, then hands over to the package's:
#
# 1. the model's gated attention, and the math of softmax attention
# 2. the reference; the online softmax, derived and checked (running max and sum, base 2)
# 3. flash attention step by step: a toy kernel, causal block skipping, GQA packing; then the package's
#    `flash_attention` (varlen, prefix, gate) and its validation table
# 4. decode: why split-KV at batch 1, the log-sum-exp merge, the package's `decode_attention` on contiguous and
#    paged caches, its validation table
# 5. the fused QK norm + partial RoPE, against the reference and HF transformers
# 6. the H200 profile (TFLOP/s and GB/s against torch SDPA), from committed results
# 7. an interactive explorer: lengths, heads per KV head, causal or not
#
# Everything runs on a CPU through Triton's interpreter, on small shapes; on a GPU the same cells run compiled.

# %%
# %matplotlib inline
import lynn_kernels as lk  # noqa: I001  (first: it picks the backend before triton is imported)
import inspect
import math
from functools import partial

import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from matplotlib.colors import ListedColormap

from lynn_kernels import compare, notebook, render_table
from lynn_kernels.attention import decode_attention, flash_attention, paged_slots, qk_norm_rope, reference, split_q_gate
from lynn_kernels.attention.check import MAX_ERR_RATIO, MIN_COSINE
from lynn_kernels.metrics import bit_mismatches
from lynn_kernels.runtime import DEVICE

LOG2E = math.log2(math.e)
HQ, HKV, D = 16, 2, 256                  # Qwen3-Next / Qwen3.5 gated attention: 16 query heads, 2 KV heads
FLOOR = 1e-5
#: 4 significant digits, below FLOOR shown as '< 1e-05': fp32 rounding noise depends on the CPU's BLAS, and nbval
#: compares the committed output as text, so it must not show; the tables' cosine and err_ratio without the floor
r4 = partial(notebook.r4, floor=FLOOR)
rounded = partial(notebook.rounded, cosine=notebook.r4, errors=r4, err_ratio=notebook.r4)


def vrow(op, case, got, want32, vs="reference"):
    """One validation row: `got` against the fp32 answer `want32`. The baseline is that answer rounded once to
    got's dtype, so err_ratio about 1 means "as accurate as one rounding"; the gates are `lynn check`'s."""
    base = want32.to(got.dtype) if got.dtype != torch.float32 else None
    m = compare(got, want32, baseline=base)
    ok = m.cosine >= MIN_COSINE and (m.err_ratio is None or m.err_ratio <= MAX_ERR_RATIO)
    return {"op": op, "case": case, "vs": vs, "metrics": m, "passed": bool(ok)}


COLS = ["op", "case", "vs", "cosine", "max_abs", "rel_l2", "err_ratio", "passed"]
gen = torch.Generator().manual_seed(0)


def randn(*shape, dtype=torch.bfloat16, scale=1.0):
    return (torch.randn(shape, generator=gen) * scale).to(dtype).to(DEVICE)


# %%
# NBVAL_IGNORE_OUTPUT
print(lk.device_summary())


# %% [markdown]
# ## 1. The model's gated attention, and the math
#
# A full-attention layer of Qwen3-Next / Qwen3.5 (HF `Qwen3NextAttention`) works on **16 query heads and 2 KV
# heads of head dim 256**. `q_proj` emits, per token and head, a query and a gate of 256 each; `k_proj` and
# `v_proj` one key and one value per KV head, so 8 query heads share each KV head (grouped-query attention, GQA).
# Queries and keys are RMS-normalised over the head dim in fp32 with the weight applied as **`(1 + w)`**, then
# rotated by RoPE on their **first 64 dims only** (partial RoPE, rotate_half convention, theta from the
# checkpoint). Causal softmax attention with scale `1/sqrt(256)` follows, query head `h` reading KV head
# `h // 8`, and its output is multiplied elementwise by **`sigmoid(gate)`** before `o_proj`.
#
# Per query head, with `Q [T, D]`, `K, V [T, D]` of its KV head and the gate `G [T, D]`:
#
# $$
# S = \frac{Q K^\top}{\sqrt{D}}, \qquad
# P_{ij} = \frac{e^{S_{ij}}}{\sum_{j' \le i} e^{S_{ij'}}}\ \ (j \le i,\ \text{else } 0), \qquad
# O = P V, \qquad y = O \odot \sigma(G)
# $$
#
# Two matrix products of `2 T^2 D` flops each, of which the causal mask keeps half: `2 T^2 Hq D` flops a layer,
# the convention every provider is measured with below. The catch is `S`: a `T x T` matrix per head. Written to
# memory it costs far more than the inputs; flash attention never writes it.

# %%
def gib(n):
    return f"{n / 2**30:,.2f} GiB"


print("prefill, one sequence, one layer (bf16 inputs and output):")
print(render_table([{"T": t, "Q, K, V, gate, O": gib(2 * t * D * (3 * HQ + 2 * HKV)),
                     "scores S, fp32, 16 heads": gib(4 * HQ * t * t),
                     "TFLOP (causal)": round(2 * t * t * HQ * D / 1e12, 3)} for t in (4096, 16384)]))
kv_per_token = 2 * HKV * D * 2
print(f"\ndecode: the KV cache holds {kv_per_token} bytes per token per layer (K and V, 2 heads x 256, bf16); "
      f"a step over 32768 cached tokens reads {32768 * kv_per_token / 2**20:.0f} MiB per sequence and layer, "
      f"for {2 * 2 * HQ * D * 32768 / 1e6:.0f} MFLOP")

# %% [markdown]
# At T = 16384 the scores alone would be 16 GiB per layer, against 0.4 GiB of inputs and output. Decode is the
# opposite extreme: one query token reads the whole cache for about one flop per byte, so it is judged in bytes
# per second.

# %% [markdown]
# ## 2. The reference, and the online softmax
#
# The package's reference, `lynn_kernels.attention.reference.flash_attention`, is the executable spec: the math
# above in fp32 einsums, one sequence at a time, with the same arguments as the kernel. Its core:

# %%
# NBVAL_IGNORE_OUTPUT
print(inspect.getsource(reference._attend))

# %% [markdown]
# It agrees with a three-line softmax written here and with torch's `scaled_dot_product_attention` (fp32, 50
# tokens, 4 query heads on 1 KV head, head dim 32):

# %%
q, k, v = randn(50, 4, 32, dtype=torch.float32), randn(50, 1, 32, dtype=torch.float32), \
    randn(50, 1, 32, dtype=torch.float32)
want = reference.flash_attention(q, k, v)                                   # causal by default

s = torch.einsum("thd,sd->hts", q, k[:, 0]) / math.sqrt(32)                 # [H, T, T]
s = s.masked_fill(torch.ones(50, 50, dtype=torch.bool).triu(1), float("-inf"))
naive = torch.einsum("hts,sd->thd", s.softmax(-1), v[:, 0])
sdpa = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                      is_causal=True, enable_gqa=True)[0].transpose(0, 1)
for name, other in (("three-line softmax", naive), ("torch SDPA", sdpa)):
    print(f"reference vs {name}: max_abs {r4(compare(other, want).max_abs)}")

# %% [markdown]
# **The online softmax.** A kernel that never holds a whole row of `S` must normalise as it goes. Take one query
# row, its scores `s_1..s_L` and values `v_1..v_L`, cut into blocks. Keep three running quantities: the max `m`
# of the scores seen so far, the sum `l` of `e^(s - m)` over them, and the unnormalised output
# `acc = sum e^(s - m) v`. A new block `B` with block max `m_B`:
#
# $$
# m' = \max(m, m_B), \qquad \alpha = e^{m - m'}, \qquad
# l' = \alpha\, l + \sum_{j \in B} e^{s_j - m'}, \qquad
# acc' = \alpha\, acc + \sum_{j \in B} e^{s_j - m'} v_j
# $$
#
# By induction `l = sum_{j seen} e^(s_j - m)` and `acc = sum_{j seen} e^(s_j - m) v_j` after every block (the
# factor `alpha` moves the old terms from the old max to the new one), so after the last block
# `o = acc / l = sum_j softmax(s)_j v_j` exactly, in one pass. Subtracting the running max keeps every exponent
# `<= 0`: nothing overflows, whatever the scores.
#
# **Base 2.** `e^x = 2^(x log2 e)`. Fold `log2(e)` into the softmax scale once (`qk_scale = scale * log2(e)`)
# and every `exp` becomes an `exp2`, one fast instruction on the GPU; `m`, `alpha` and the exponents are then in
# log2 units. The result is the same softmax.
#
# Checked on one row of 200 scores in blocks of 64, in float64, with scores around 80: plain `exp` overflows fp32
# above 88.7, and the running max makes that harmless.

# %%
g64 = torch.Generator().manual_seed(1)
scores = torch.randn(200, generator=g64, dtype=torch.float64) * 4 + 80
vals = torch.randn(200, 8, generator=g64, dtype=torch.float64)


def online_softmax(s, v, block, exp):
    """o = softmax(s) @ v one block at a time; `exp` is torch.exp (s in nats) or torch.exp2 (s in log2 units)."""
    m, l, acc, trace = -math.inf, 0.0, torch.zeros(v.shape[1], dtype=v.dtype), []
    for j in range(0, len(s), block):
        sb, vb = s[j:j + block], v[j:j + block]
        m_new = max(m, sb.max().item())
        alpha = exp(torch.tensor(m - m_new, dtype=s.dtype)).item()          # rescales what came before
        p = exp(sb - m_new)
        l = alpha * l + p.sum().item()
        acc = alpha * acc + p @ vb
        trace.append({"keys": f"{j}..{j + len(sb) - 1}", "block max": r4(sb.max().item()),
                      "running max m": r4(m_new), "alpha": r4(alpha), "l": r4(l)})
        m = m_new
    return acc / l, trace


o_e, trace = online_softmax(scores, vals, 64, torch.exp)
o_2, _ = online_softmax(scores * LOG2E, vals, 64, torch.exp2)             # log2(e) folded into the scores
exact = torch.softmax(scores, 0) @ vals
print(render_table(trace))
print("\nonline (exp)  vs softmax(s) @ v, max_abs:", r4((o_e - exact).abs().max().item(), floor=1e-12))
print("online (exp2) vs softmax(s) @ v, max_abs:", r4((o_2 - exact).abs().max().item(), floor=1e-12))
p32 = torch.exp(scores.float())
print(f"plain exp in fp32: {int(p32.isinf().sum())} of 200 scores overflow to inf, and softmax without the max "
      f"gives {int((p32 / p32.sum()).isnan().sum())} NaN")


# %% [markdown]
# ## 3. Flash attention, step by step
#
# ### 3a. A toy kernel: one tile of queries per program
#
# Program `pid_m` owns `BLOCK_M` query rows. It loads its `Q` tile once, then walks the keys in blocks of
# `BLOCK_N`: one `tl.dot` for the `[BLOCK_M, BLOCK_N]` scores, the online-softmax step of section 2 in base 2,
# one `tl.dot` to add `P V`. The scores live in registers for one block and are gone: memory traffic is `Q`,
# `K`, `V` and `O`, never `S`. Causality is a mask `key <= position(row)`.
#
# The toy follows the interpreter's rules (fp32 in and out, fp32 `tl.dot` with `input_precision="ieee"`), and has
# two switches used later: `SKIP` (3b) and `GROUP` (3c: a row is a (token, head) pair with `GROUP` heads per
# token; for one head `GROUP = 1` and a row is a token). `visits` records which (row tile, key block) pairs a
# program visited, for the pictures only.

# %%
@triton.jit
def _toy_flash_kernel(q_ptr, k_ptr, v_ptr, o_ptr, visits_ptr, T, ROWS, qk_scale,
                      HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, CAUSAL: tl.constexpr, SKIP: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)                   # [BLOCK_M] query rows
    mask_m = offs_m < ROWS
    pos_m = offs_m // GROUP                                             # token (position) of each row
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + offs_m[:, None] * HEAD_DIM + offs_d[None, :], mask=mask_m[:, None], other=0.0)
    m_i = tl.full((BLOCK_M,), -1.0e30, dtype=tl.float32)                # running max, log2 units
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)                        # running sum
    acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)               # unnormalised output
    n_end = T
    if SKIP:                                                            # causal: no key past the tile's last token
        n_end = tl.minimum((pid_m * BLOCK_M + BLOCK_M - 1) // GROUP + 1, T)
    for n in range(0, n_end, BLOCK_N):
        keys = n + offs_n                                               # [BLOCK_N]
        mask_n = keys < T
        k = tl.load(k_ptr + keys[:, None] * HEAD_DIM + offs_d[None, :], mask=mask_n[:, None], other=0.0)
        v = tl.load(v_ptr + keys[:, None] * HEAD_DIM + offs_d[None, :], mask=mask_n[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale   # [BLOCK_M, BLOCK_N], log2 units
        keep = mask_n[None, :]
        if CAUSAL:
            keep = keep & (keys[None, :] <= pos_m[:, None])
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)                                    # rescales what came before
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new
        tl.store(visits_ptr + pid_m * tl.cdiv(T, BLOCK_N) + n // BLOCK_N, 1)    # for the pictures only
    tl.store(o_ptr + offs_m[:, None] * HEAD_DIM + offs_d[None, :], acc / l_i[:, None], mask=mask_m[:, None])


def toy_flash(q, k, v, causal=True, skip=True, BLOCK_M=16, BLOCK_N=16):
    """q [T, G, D] (the G query heads of one KV head), k, v [T, D], fp32.
    Returns (out [T, G, D], visits [row tiles, key blocks])."""
    t, group, d = q.shape
    rows = t * group
    out = torch.full(q.shape, float("nan"), device=q.device)           # poisoned: an unwritten row shows as NaN
    visits = torch.zeros(triton.cdiv(rows, BLOCK_M), triton.cdiv(t, BLOCK_N), dtype=torch.int32, device=q.device)
    _toy_flash_kernel[(triton.cdiv(rows, BLOCK_M),)](
        q.contiguous(), k.contiguous(), v.contiguous(), out, visits, t, rows, d ** -0.5 * LOG2E,
        HEAD_DIM=d, GROUP=group, CAUSAL=causal, SKIP=causal and skip, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    return out, visits.cpu()


toy_rows = []
for t in (1, 63, 100):
    q, k, v = (randn(t, h, 32, dtype=torch.float32) for h in (1, 1, 1))
    for causal in (True, False):
        out, visits = toy_flash(q, k[:, 0], v[:, 0], causal=causal, skip=False)
        toy_rows.append({"kernel": "toy, every key block", "case": f"T={t} {'causal' if causal else 'full'}",
                         "tiles visited": f"{int(visits.sum())} of {visits.numel()}",
                         "m": compare(out, reference.flash_attention(q, k, v, causal=causal))})
print(render_table(rounded(toy_rows), ["kernel", "case", "tiles visited", "cosine", "max_abs", "rel_l2"]))

# %% [markdown]
# Equal to the reference to fp32 rounding, on a single token and on lengths that leave the last tile ragged.
# But the causal rows visit every tile, and above the diagonal every score of a tile is masked: that work is
# thrown away.
#
# ### 3b. Causal block skipping
#
# Row tile `m` covers tokens up to `last = (m + 1) BLOCK_M - 1`. No row of the tile may see a key past `last`,
# so the key loop can stop at `last + 1`: one changed bound (`SKIP` in the toy). Relative to the diagonal a key
# block is
#
# * **below** it, every key visible to every row of the tile: no mask needed;
# * **on** it: the mask `key <= position(row)` decides;
# * **above** it: never visited.
#
# The package's kernel runs the two visited kinds as two loops, the first with no mask and no bounds check at all.
# The same toy, with the bound:

# %%
q, k, v = (randn(100, 1, 32, dtype=torch.float32) for _ in range(3))
want = reference.flash_attention(q, k, v)
dense_out, dense_visits = toy_flash(q, k[:, 0], v[:, 0], skip=False)
skip_out, skip_visits = toy_flash(q, k[:, 0], v[:, 0], skip=True)
print(render_table(rounded([
    {"kernel": "toy, every key block", "tiles visited": int(dense_visits.sum()), "m": compare(dense_out, want)},
    {"kernel": "toy, causal skip", "tiles visited": int(skip_visits.sum()), "m": compare(skip_out, want)}]),
    ["kernel", "tiles visited", "cosine", "max_abs", "rel_l2"]))
print("outputs bit for bit equal:", bit_mismatches(dense_out, skip_out) == 0)


def tile_kinds(t, tile_tokens, block_n, group=1, visits=None):
    """Per (row tile, key block) of one sequence: 0 skipped, 1 below the diagonal (no mask), 2 on it (masked),
    3 visited although fully masked (only without skipping: pass the kernel's `visits`)."""
    n_tiles, n_blocks = triton.cdiv(t * group, tile_tokens * group), triton.cdiv(t, block_n)
    kinds = np.zeros((n_tiles, n_blocks), dtype=int)
    for i in range(n_tiles):
        lo, hi = i * tile_tokens, min((i + 1) * tile_tokens, t) - 1        # first and last token of the tile
        for j in range(n_blocks):
            first_key = j * block_n
            last_key = min((j + 1) * block_n, t) - 1
            kinds[i, j] = 1 if last_key <= lo else 2 if first_key <= hi else 0
    if visits is not None:
        kinds[(kinds == 0) & (visits.numpy() > 0)] = 3
    return kinds


kinds_dense = tile_kinds(100, 16, 16, visits=dense_visits)
kinds_skip = tile_kinds(100, 16, 16)
print("the toy's visits match the bound:", bool(((kinds_skip > 0) == (skip_visits.numpy() > 0)).all()))

# %%
# NBVAL_IGNORE_OUTPUT
TILE_COLORS = ListedColormap(["white", "tab:green", "tab:orange", "tab:red"])
TILE_LABELS = ["skipped", "every key visible (no mask needed)", "masked (diagonal, ragged end)",
               "visited, fully masked"]


def plot_tiles(ax, kinds, title):
    ax.imshow(kinds, cmap=TILE_COLORS, vmin=-0.5, vmax=3.5)
    ax.set_xticks(np.arange(-0.5, kinds.shape[1], 1), minor=True)
    ax.set_yticks(np.arange(-0.5, kinds.shape[0], 1), minor=True)
    ax.grid(which="minor", c="0.6", lw=0.5)
    ax.tick_params(which="both", length=0, labelsize=7)
    ax.set_xlabel("key block")
    ax.set_ylabel("row tile (program)")
    ax.set_title(title, fontsize=9)


fig, axes = plt.subplots(1, 2, figsize=(9, 4))
plot_tiles(axes[0], kinds_dense, f"every key block: {int((kinds_dense > 0).sum())} tiles")
plot_tiles(axes[1], kinds_skip, f"causal skip: {int((kinds_skip > 0).sum())} tiles")
fig.legend(handles=[plt.Rectangle((0, 0), 1, 1, fc=TILE_COLORS(i), ec="0.6") for i in range(4)],
           labels=TILE_LABELS, loc="lower center", ncol=4, fontsize=7, frameon=False)
fig.suptitle("T = 100, 16 x 16 tiles, one head", fontsize=10)
plt.tight_layout(rect=(0, 0.06, 1, 1))
plt.show()


# %% [markdown]
# At the package's tile sizes on the Qwen shape (16 tokens x 8 heads a tile, 64-key blocks: see 3c), the share of
# tiles visited tends to one half, and the masked diagonal becomes a small fraction of the work:

# %%
def tile_steps(t, tile_tokens, block_n, causal=True):
    """(unmasked, masked) key-block steps over the row tiles of one (sequence, KV head), with the package's
    bounds (docs/attention.md): unmasked below n_full, masked from n_full to the tile's last position."""
    full = diag = 0
    for lo in range(0, t, tile_tokens):
        hi = min(lo + tile_tokens, t) - 1
        n_full, n_end = ((lo + 1) // block_n * block_n, hi + 1) if causal else (t // block_n * block_n, t)
        full += n_full // block_n
        diag += triton.cdiv(n_end - n_full, block_n)
    return full, diag


print("toy check: tile_steps(100, 16, 16) =", tile_steps(100, 16, 16), "-> total", sum(tile_steps(100, 16, 16)),
      "= the toy's", int(skip_visits.sum()))
skip_rows = []
for t in (100, 1000, 4096, 16384):
    dense = triton.cdiv(t, 16) * triton.cdiv(t, 64)
    full, diag = tile_steps(t, 16, 64)
    skip_rows.append({"T": t, "row tiles": triton.cdiv(t, 16), "every block": dense, "causal skip": full + diag,
                      "visited": f"{(full + diag) / dense:.1%}", "masked": f"{diag / (full + diag):.1%}"})
print(render_table(skip_rows))

# %% [markdown]
# ### 3c. GQA packing
#
# Qwen3-Next has `G = Hq / Hkv = 8` query heads per KV head. If a program held the rows of one query head, the
# eight heads of a group would each load the same K and V blocks in eight programs. The package's tile instead
# holds rows that are **(token, query head) pairs of one KV head**, heads fastest: a 128-row tile is 16 tokens x
# 8 heads, and every K / V block it loads serves all eight heads at once. The only change to the kernel is that
# a row's position is `row // G` (the toy's `GROUP`); `q [T, 8, D]` viewed as `[8 T, D]` is already in that
# order.
#
# A 16-row tile with `G = 4`, and the toy run on packed rows against the reference with 2, 4 and 8 query heads on
# one KV head:

# %%
print("row ->  (token, head), G = 4, rows 0..15 of one tile:")
print("  ".join(f"{r}:({r // 4},{r % 4})" for r in range(16)))

gqa_rows = []
for group, t in ((2, 63), (4, 40), (8, 33)):
    q, k, v = randn(t, group, 32, dtype=torch.float32), randn(t, 1, 32, dtype=torch.float32), \
        randn(t, 1, 32, dtype=torch.float32)
    out, visits = toy_flash(q, k[:, 0], v[:, 0], BLOCK_M=16 * group)         # 16 tokens x G heads a tile
    gqa_rows.append({"kernel": "toy, packed rows", "case": f"T={t}, {group} query heads on 1 KV head",
                     "tiles visited": int(visits.sum()), "m": compare(out, reference.flash_attention(q, k, v))})
print(render_table(rounded(gqa_rows), ["kernel", "case", "tiles visited", "cosine", "max_abs", "rel_l2"]))

# %% [markdown]
# How much it saves depends on how full the tile would be otherwise. Counting K/V block loads (tile steps) on the
# Qwen shape (16 query heads, 2 KV heads, 64-key blocks, causal skip), for a 128-row tile holding either 128
# tokens of one query head or 16 tokens x 8 heads:

# %%
pack_rows = []
for t in (1, 16, 100, 4096):
    per_head = HQ * sum(tile_steps(t, 128, 64))
    packed = HKV * sum(tile_steps(t, 16, 64))
    used = lambda n_programs: f"{t * HQ / (n_programs * 128):.1%}"            # noqa: E731  rows holding a query
    pack_rows.append({"T": t, "per-head programs": HQ * triton.cdiv(t, 128), "per-head K/V loads": per_head,
                      "per-head rows used": used(HQ * triton.cdiv(t, 128)),
                      "packed programs": HKV * triton.cdiv(t, 16), "packed K/V loads": packed,
                      "packed rows used": used(HKV * triton.cdiv(t, 16)),
                      "loads saved": f"{per_head / packed:.2f}x"})
print(render_table(pack_rows))


# %% [markdown]
# For short sequences (a decode step, a short prompt, the short members of a varlen batch) packing loads each K/V
# block once instead of eight times and fills the tile that a single head leaves mostly empty. For a long prompt
# both tilings take about as many steps (a 128-row tile is a 128-row tile); packing's gain there is the finer
# causal diagonal of a 16-token tile. Decode (section 4) is the extreme case: one token, so the group's 8 heads
# are the whole tile.
#
# ### 3d. The package's kernel
#
# `lynn_kernels.attention.flash_attention(q, k, v, causal=True, scale=None, gate=None, cu_seqlens=None,
# prefix_lens=None)` is the toy grown up (`_flash_prefill_kernel` in `lynn_kernels/attention/triton_prefill.py`):
#
# * **varlen**: a packed batch `q [T, Hq, D]` with `cu_seqlens [B+1]`, one launch, grid (tiles of the longest
#   sequence) x (B x Hkv); latest tiles first, so the longest programs start early;
# * **chunked prefill**: `prefix_lens [B]` cached keys before each sequence's new tokens (`k, v` hold prefix and
#   new tokens, packed per sequence); the causal bound uses absolute positions;
# * **GQA packing** (3c), **causal skipping** in two loops (3b), the **gate** applied in the epilogue while the
#   tile is in registers;
# * bf16 / fp16 / fp32 in and out, any row and head strides (so `q` and `gate` are read in place from the
#   `q_proj` output through `split_q_gate`), autotuned tiles on the GPU (`BLOCK_M 128, BLOCK_N 64` first).
#
# Validation on the real head shape (16 / 2 heads, head dim 256) in bf16, against the reference on fp32 copies of
# the inputs and against torch SDPA in fp32 (one sequence at a time, `enable_gqa=True`; with a prefix the causal
# mask is written out, aligned bottom-right):

# %%
def sdpa_prefill(q, k, v, causal=True, gate=None, cu_seqlens=None, prefix_lens=None):
    """torch SDPA in fp32, one sequence at a time, as a second oracle for flash_attention."""
    cu = [0, q.shape[0]] if cu_seqlens is None else cu_seqlens.tolist()
    pre = [0] * (len(cu) - 1) if prefix_lens is None else prefix_lens.tolist()
    out, k0 = torch.zeros(q.shape, dtype=torch.float32), 0
    for b in range(len(cu) - 1):
        n, length = cu[b + 1] - cu[b], pre[b] + cu[b + 1] - cu[b]
        qs = q[cu[b]:cu[b + 1]].float().cpu().transpose(0, 1)[None]                     # [1, Hq, n, D]
        ks, vs = (x[k0:k0 + length].float().cpu().transpose(0, 1)[None] for x in (k, v))  # [1, Hkv, L, D]
        mask = (torch.arange(length)[None, :] <= pre[b] + torch.arange(n)[:, None]) if causal else None
        if n:
            out[cu[b]:cu[b + 1]] = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask,
                                                                  enable_gqa=True)[0].transpose(0, 1)
        k0 += length
    return out if gate is None else out * torch.sigmoid(gate.float().cpu())


def f32(*ts):
    return [None if t is None else t.float() for t in ts]


prefill_rows = []

# 1) three sequences of 1, 63 and 65 tokens; q and gate are strided views of one q_proj output
cu = torch.tensor([0, 1, 64, 129], dtype=torch.int32, device=DEVICE)
q_proj_out = randn(129, HQ * 2 * D)
q, g = split_q_gate(q_proj_out, HQ, D)                                        # views [129, 16, 256], no copy
k, v = randn(129, HKV, D), randn(129, HKV, D)
got = flash_attention(q, k, v, gate=g, cu_seqlens=cu)
case = "bf16 varlen 1/63/65, gate, q/gate views"
prefill_rows.append(vrow("flash_attention", case, got,
                         reference.flash_attention(*f32(q, k, v), gate=g.float(), cu_seqlens=cu)))
prefill_rows.append(vrow("flash_attention", case, got, sdpa_prefill(q, k, v, gate=g, cu_seqlens=cu), "SDPA fp32"))

# 2) chunked prefill: 17, 0 and 50 cached tokens before 40, 33 and 27 new ones
cu = torch.tensor([0, 40, 73, 100], dtype=torch.int32, device=DEVICE)
prefix = torch.tensor([17, 0, 50], dtype=torch.int32, device=DEVICE)
q, k, v = randn(100, HQ, D), randn(167, HKV, D), randn(167, HKV, D)
got = flash_attention(q, k, v, cu_seqlens=cu, prefix_lens=prefix)
case = "bf16 chunked, prefix 17/0/50 + 40/33/27 new"
prefill_rows.append(vrow("flash_attention", case, got,
                         reference.flash_attention(*f32(q, k, v), cu_seqlens=cu, prefix_lens=prefix)))
prefill_rows.append(vrow("flash_attention", case, got,
                         sdpa_prefill(q, k, v, cu_seqlens=cu, prefix_lens=prefix), "SDPA fp32"))

# 3) fp32, not causal, GQA 3 (6 query heads on 2 KV heads), head dim 64
q, k, v, g = randn(70, 6, 64, dtype=torch.float32), randn(70, 2, 64, dtype=torch.float32), \
    randn(70, 2, 64, dtype=torch.float32), randn(70, 6, 64, dtype=torch.float32)
got = flash_attention(q, k, v, causal=False, gate=g)
case = "fp32 T=70, not causal, 6/2 heads d64, gate"
prefill_rows.append(vrow("flash_attention", case, got, reference.flash_attention(q, k, v, causal=False, gate=g)))
prefill_rows.append(vrow("flash_attention", case, got, sdpa_prefill(q, k, v, causal=False, gate=g), "SDPA fp32"))

print(render_table(rounded(prefill_rows), COLS))
print(f"\n{sum(r['passed'] for r in prefill_rows)}/{len(prefill_rows)} passed (cosine >= {MIN_COSINE}, "
      f"err_ratio <= {MAX_ERR_RATIO})")

# %% [markdown]
# In bf16 the kernel's error is that of rounding the exact answer once (`err_ratio` 1): scores, softmax and
# accumulation are fp32 and the output is rounded once, to nearest even. Under the interpreter the `tl.dot`
# operands are fp32; on the GPU they are bf16, so `P` is rounded to bf16 before `P V` as in every flash attention,
# and the GPU tests allow for that.

# %% [markdown]
# ## 4. Decode: split-KV and a log-sum-exp merge
#
# A decode step has **one query token per sequence**. With GQA packing, a (sequence, KV head) is one program whose
# tile holds the group's 8 query heads (padded to 16 rows, the smallest `tl.dot`) and which streams that KV head's
# whole cache. At batch 1 that is **2 programs for the H200's 132 SMs**: 130 SMs idle while two stream the cache
# one block after another. The bytes are fixed (`2 x L x 2 x 256 x 2`); the only way to read them faster is to
# read them from more SMs at once. So each sequence's keys are cut into `S` **splits**, each a program of its own,
# and a second small kernel merges the partial results (flash-decoding).
#
# `S` is chosen from shapes alone (`default_num_splits`, no read of `seq_lens`, so no host sync):
# `min(ceil(2 x SMs / (B x Hkv)), ceil(capacity / 64), 256)` rounded down to a power of two, so that
# `B x Hkv x S` programs fill the GPU one to two times over and no split is shorter than 64 keys (a power of two
# because `S` is a compile-time constant of the kernel: few values, few compilations). `splits_for` is that rule
# for a given SM count; for the benchmark's cases on the H200's 132 SMs:

# %%
from lynn_kernels.attention.triton_decode import splits_for  # default_num_splits' rule, for a given SM count

split_rows = []
for b, length in ((1, 4096), (8, 4096), (1, 32768), (8, 32768)):
    s = splits_for(b, HKV, length, sms=132)
    cache = 2 * b * length * HKV * D * 2
    partials = b * HQ * s * (D + 1) * 4
    split_rows.append({"B": b, "cached tokens": length, "programs, no split": b * HKV, "splits S": s,
                       "programs": b * HKV * s, "keys a split": triton.cdiv(length, s),
                       "cache MiB": round(cache / 2**20, 1), "partials MiB": round(partials / 2**20, 2),
                       "extra traffic": f"{2 * partials / cache:.1%}"})
print(render_table(split_rows))

# %% [markdown]
# The partial results (`[B, Hq, S, D]` outputs and `[B, Hq, S]` log-sum-exps, fp32) are written once and read
# once by the merge: the last column is that traffic against the cache's. It is largest for a short cache at batch
# 1, where the split count is bounded by the 64-key minimum rather than by the SMs.
#
# **The merge.** Split `s` runs the online softmax over its keys and keeps, in log2 units, its normalised output
# `o_s = acc_s / l_s` and its log-sum-exp `lse_s = m_s + log2(l_s)`, so that `2^(lse_s) = sum_{j in s} 2^(x_j)`
# with `x_j` the row's scores in log2 units. Then `2^(lse_s) o_s = sum_{j in s} 2^(x_j) v_j` is split `s`'s share
# of the unnormalised output, and
#
# $$
# o = \frac{\sum_s 2^{lse_s}\, o_s}{\sum_s 2^{lse_s}}
#   = \frac{\sum_s w_s\, o_s}{\sum_s w_s}, \qquad w_s = 2^{lse_s - M},\ M = \max_s lse_s
# $$
#
# exactly (the common factor `2^M` cancels and keeps every weight `<= 1`). An empty split has `l_s = 0`: it writes
# `lse_s = -inf`, weight 0. Checked in float64 on one row of 300 keys cut into four splits of 128 keys, the last
# one empty:

# %%
x = (torch.randn(300, generator=g64, dtype=torch.float64) * 3 + 20) * LOG2E      # scores, log2 units
vals = torch.randn(300, 8, generator=g64, dtype=torch.float64)
parts = []
for lo in range(0, 4 * 128, 128):
    xs, vs = x[lo:lo + 128], vals[lo:lo + 128]
    if len(xs) == 0:
        parts.append((torch.zeros(8, dtype=torch.float64), -math.inf, "empty"))
        continue
    m = xs.max().item()
    p = torch.exp2(xs - m)
    parts.append(((p @ vs) / p.sum(), m + math.log2(p.sum().item()), f"{lo}..{lo + len(xs) - 1}"))
big_m = max(lse for _, lse, _ in parts)
w = [2.0 ** (lse - big_m) for _, lse, _ in parts]
merged = sum(wi * o for wi, (o, _, _) in zip(w, parts)) / sum(w)
print(render_table([{"split": s, "keys": keys, "lse (log2)": r4(lse),
                     "weight": r4(wi), "share": f"{wi / sum(w):.1%}"}
                    for s, ((_, lse, keys), wi) in enumerate(zip(parts, w))]))
exact = torch.softmax(x / LOG2E, 0) @ vals
print("\nmerged vs softmax over all 300 keys, max_abs:", r4((merged - exact).abs().max().item(), floor=1e-12))

# %% [markdown]
# **The package's kernel**: `decode_attention(q, k_cache, v_cache, seq_lens, block_table=None, scale=None,
# gate=None, *, num_splits=None)` (`lynn_kernels/attention/triton_decode.py`). The cache is contiguous
# `[B, S_max, Hkv, D]` or paged `[num_blocks, PAGE, Hkv, D]` with a `block_table [B, max_blocks]`. Key `pos` of
# sequence `b` lives at `(b, pos)` or at `(block_table[b, pos // PAGE], pos % PAGE)`: the kernel computes one
# address `i0 * stride0 + i1 * stride1` either way, so one kernel serves both and the same keys in the same order
# give the **same bits**. Four sequences of 0, 1, 100 and 300 cached tokens on the Qwen shape, the cache copied
# into shuffled 16-token pages:

# %%
lens = torch.tensor([0, 1, 100, 300], dtype=torch.int32, device=DEVICE)
q, g = randn(4, HQ, D), randn(4, HQ, D)
kc, vc = randn(4, 320, HKV, D), randn(4, 320, HKV, D)

table = torch.randperm(4 * 20, generator=gen).view(4, 20).to(torch.int32).to(DEVICE)     # 20 pages of 16 each
kp, vp = (torch.zeros(80, 16, HKV, D, dtype=torch.bfloat16, device=DEVICE) for _ in range(2))
seq = torch.arange(4, device=DEVICE).repeat_interleave(320)
slots = paged_slots(table, seq, torch.arange(320, device=DEVICE).repeat(4), 16)
kp.view(-1, HKV, D)[slots] = kc.reshape(-1, HKV, D)
vp.view(-1, HKV, D)[slots] = vc.reshape(-1, HKV, D)

decoded = {}
for splits in (1, 3):
    decoded["contiguous", splits] = decode_attention(q, kc, vc, lens, gate=g, num_splits=splits)
    decoded["paged", splits] = decode_attention(q, kp, vp, lens, table, gate=g, num_splits=splits)
    print(f"num_splits={splits}: paged vs contiguous, elements whose bits differ: "
          f"{bit_mismatches(decoded['paged', splits], decoded['contiguous', splits])}")
print("sequence of length 0 -> output all zeros:", bool((decoded["paged", 3][0] == 0).all()))


# %% [markdown]
# The validation table: both layouts and split counts against the reference (fp32 copies) and against torch SDPA
# in fp32 (SDPA gives NaN for a sequence with no keys, where the kernel and the reference give 0, so SDPA's
# oracle sets that row to 0):

# %%
def sdpa_decode(q, k_cache, v_cache, seq_lens, gate=None):
    """torch SDPA in fp32 on a contiguous cache, one sequence at a time; no keys -> zeros."""
    out = torch.zeros(q.shape, dtype=torch.float32)
    for b, n in enumerate(seq_lens.tolist()):
        if n:
            ks, vs = (x[b, :n].float().cpu().transpose(0, 1)[None] for x in (k_cache, v_cache))
            out[b] = F.scaled_dot_product_attention(q[b].float().cpu()[None, :, None], ks, vs,
                                                    enable_gqa=True)[0, :, 0]
    return out if gate is None else out * torch.sigmoid(gate.float().cpu())


want = reference.decode_attention(*f32(q, kc, vc), lens, gate=g.float())
want_sdpa = sdpa_decode(q, kc, vc, lens, gate=g)
decode_rows = []
for (layout, splits), got in decoded.items():
    case = f"bf16 {layout} len 0/1/100/300, 16/2 heads d256, gate, {splits} split{'s' * (splits > 1)}"
    decode_rows.append(vrow("decode_attention", case, got, want))
    decode_rows.append(vrow("decode_attention", case, got, want_sdpa, "SDPA fp32"))

# one sequence of 300 keys: the split count changes the summation order, not the result beyond rounding
# (with the interpreter's 64-key blocks, 8 splits of 64 keys leave the last three empty)
q1, k1, v1 = randn(1, HQ, D), randn(1, 300, HKV, D), randn(1, 300, HKV, D)
len1 = torch.tensor([300], dtype=torch.int32, device=DEVICE)
want1 = reference.decode_attention(*f32(q1, k1, v1), len1)
for splits in (2, 5, 8):
    decode_rows.append(vrow("decode_attention", f"bf16 B=1 len 300, {splits} splits",
                            decode_attention(q1, k1, v1, len1, num_splits=splits), want1))
print(render_table(rounded(decode_rows), COLS))
print(f"\n{sum(r['passed'] for r in decode_rows)}/{len(decode_rows)} passed")

# %% [markdown]
# ## 5. QK norm + partial RoPE, fused
#
# Before attention, `qk_norm_rope(q, k, q_weight, k_weight, positions, *, v=None, rotary_dim=64,
# rope_theta=None, ...)` does, per row `x [256]` of every query and key head, in fp32:
#
# $$
# y = \frac{x}{\sqrt{\tfrac{1}{D}\sum x^2 + \epsilon}} \odot (1 + w), \qquad
# y_{0..63} \leftarrow y_{0..63} \cos\theta + \mathrm{rotate\_half}(y_{0..63}) \sin\theta, \qquad
# \mathrm{rotate\_half}(a, b) = (-b, a)
# $$
#
# with `theta_i = position * theta^(-2i/64)` and dims 64..255 passed through, and can write the new keys and
# values into a KV cache at given slots. cos / sin come from tables or are computed in-kernel from `rope_theta`
# (with a three-part `2 pi` range reduction, so that large positions stay accurate on the GPU's fast sine; past
# the range where that reduction is exact, pass tables).
#
# Against the reference, and against HF transformers' own `Qwen3NextRMSNorm` + `apply_rotary_pos_emb` with the
# cos / sin of `Qwen3NextRotaryEmbedding` (theta 1e7, partial factor 0.25), at positions 0 to 262,143:

# %%
pos = torch.tensor([0, 1, 1000, 40000, 262143], device=DEVICE)
qw, kw = randn(D, dtype=torch.float32, scale=0.1), randn(D, dtype=torch.float32, scale=0.1)
cos, sin = reference.rope_cos_sin(torch.arange(262144, device=DEVICE), 64, 1e7)     # tables, HF's numbers
rope_rows, inputs = [], {}
for dtype in (torch.bfloat16, torch.float32):
    q, k = randn(5, HQ, D, dtype=dtype, scale=3.0), randn(5, HKV, D, dtype=dtype, scale=3.0)
    inputs[dtype] = (q, k)
    want = reference.qk_norm_rope(q.float(), k.float(), qw, kw, pos, rotary_dim=64, rope_theta=1e7)
    name = str(dtype)[6:]
    got = qk_norm_rope(q, k, qw, kw, pos, rotary_dim=64, rope_theta=1e7)
    for i, which in enumerate("qk"):
        rope_rows.append(vrow("qk_norm_rope", f"{name} {which} 16/2 heads d256 rot64, cos/sin in-kernel",
                              got[i], want[i]))
    got = qk_norm_rope(q, k, qw, kw, pos, rotary_dim=64, cos=cos, sin=sin)
    rope_rows.append(vrow("qk_norm_rope", f"{name} q, cos/sin tables", got[0], want[0]))
print(render_table(rounded(rope_rows), COLS))

# %%
try:
    from transformers.models.qwen3_next import modeling_qwen3_next as hf
except Exception as err:                                                # noqa: BLE001  (any import failure)
    hf = None
    print(f"transformers' Qwen3-Next is not importable here ({type(err).__name__}): HF comparison skipped")

if hf is not None:
    cfg = hf.Qwen3NextConfig(head_dim=D, rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                                          "partial_rotary_factor": 0.25})
    hf_rows = []
    for dtype in (torch.float32, torch.bfloat16):
        q, k = (x.cpu() for x in inputs[dtype])
        cos, sin = hf.Qwen3NextRotaryEmbedding(cfg)(torch.zeros(1, dtype=dtype), pos.cpu()[None])
        q_norm, k_norm = hf.Qwen3NextRMSNorm(D, eps=1e-6), hf.Qwen3NextRMSNorm(D, eps=1e-6)
        q_norm.weight.data, k_norm.weight.data = qw.cpu().clone(), kw.cpu().clone()
        with torch.no_grad():                                           # HF's layout: [H, T, D], cos [T, R]
            q_hf, _ = hf.apply_rotary_pos_emb(q_norm(q).transpose(0, 1), k_norm(k).transpose(0, 1), cos[0],
                                              sin[0], unsqueeze_dim=0)
        q_hf = q_hf.transpose(0, 1)
        q_ref = reference.qk_norm_rope(q, k, qw.cpu(), kw.cpu(), pos.cpu(), rotary_dim=64, rope_theta=1e7)[0]
        q_ours = qk_norm_rope(*inputs[dtype], qw, kw, pos, rotary_dim=64, rope_theta=1e7)[0].cpu()
        name = str(dtype)[6:]
        if dtype == torch.float32:
            hf_rows.append({"case": f"{name} q", "who": "reference", "vs": "HF",
                            "m": compare(q_ref, q_hf, exact=True)})
            hf_rows.append({"case": f"{name} q", "who": "qk_norm_rope", "vs": "HF", "m": compare(q_ours, q_hf)})
        else:
            exact32 = reference.qk_norm_rope(q.float(), k.float(), qw.cpu(), kw.cpu(), pos.cpu(), rotary_dim=64,
                                             rope_theta=1e7)[0]
            for who, out in (("qk_norm_rope", q_ours), ("HF", q_hf)):
                hf_rows.append({"case": f"{name} q", "who": who, "vs": "fp32 reference",
                                "m": compare(out, exact32, baseline=exact32.to(dtype))})
    print(render_table(rounded(hf_rows), ["case", "who", "vs", "cosine", "max_abs", "rel_l2", "err_ratio",
                                          "mismatches"]))

# %% [markdown]
# In fp32 the reference is HF's computation bit for bit, and the kernel differs from it by fp32 rounding (the
# order of the sum of squares, `rsqrt`, cos at the reduced angle). In bf16, HF rounds after the norm, rounds the
# cos / sin tables, and rounds every product and sum of the rotation to bf16; the kernel rounds once at the end, so
# its error is that of one rounding (`err_ratio` 1) and HF's somewhat more.
#
# **`lynn check attention`.** The command line runs its own small cases of all three ops (prefill varlen and
# chunked, decode contiguous and paged with three splits, QK norm + RoPE) with the same comparison helper and the
# same gates; its table, rounded as everywhere in this notebook:

# %%
from lynn_kernels import check

check_rows, check_seconds = check.run_checks(["attention"])
print(check.table(rounded(check_rows), columns=check.PORTABLE_COLUMNS))

# %%
# NBVAL_IGNORE_OUTPUT
print(f"{sum(r['passed'] for r in check_rows)}/{len(check_rows)} checks passed in {check_seconds:.1f} s "
      f"on backend {lk.backend()!r}")

# %% [markdown]
# ## 6. Profile on the H200
#
# `lynn bench attention` measures on the Qwen shape (16 / 2 heads, head dim 256, bf16), every provider validated
# against an fp32 oracle before it is timed (`lynn_kernels/bench/attention.py`):
#
# * `attention.prefill`: causal, one sequence of T = 4096 and 16384 tokens; TFLOP/s with `2 T^2 Hq D` flops for
#   every provider, against the measured bf16 matmul peak. Providers: `lynn flash_attention` (with and without the
#   fused gate), `torch SDPA (enable_gqa)` and `torch SDPA + eager gate`;
# * `attention.decode`: one token over 4096 and 32768 cached tokens, batch 1 and 8; GB/s of the K and V bytes the
#   step must read, against the measured read ceiling. Providers: our launch on a contiguous and on a paged cache
#   (64-token pages, shuffled), our eager `decode_attention()` call (it reads `seq_lens` back to check it: one
#   host sync), and `torch SDPA (enable_gqa)` on its preferred `[B, Hkv, L, D]` cache.
#
# Each provider is timed twice, and the results file has a row for each (`<provider> (kernel)`,
# `<provider> (call)`):
#
# * **kernel**: the CUDA profiler's kernel time, what a step captured in a CUDA graph pays;
# * **call**: `do_bench` of the Python call, what an eager loop pays. It includes the host's launch cost, and the
#   device's host CPU is slow: a Triton launch costs tens of microseconds there, more than a short decode kernel.
#
# **Goals**, judged on kernel time: prefill at least 0.7x SDPA's TFLOP/s at T = 4096 and 16384; decode no slower
# than SDPA at all four cells, and at 70% or more of the read ceiling at 32768 cached tokens.
#
# On a GPU the next cell runs the quick benchmark live (one shape of each). The cells after it read the committed
# results, `data/bench/h200/attention.prefill.json` and `attention.decode.json`, with both timings of a provider
# side by side (`lynn_kernels.bench.report.timed_pairs`).

# %%
from lynn_kernels.bench import load
from lynn_kernels.bench.report import timed_pairs


def us(r):
    """A result row's median in microseconds, or None (not taken, or not timed)."""
    return None if r is None or not math.isfinite(r["median_ms"]) else round(r["median_ms"] * 1e3, 1)


def us_text(r):
    """For tables: one decimal always (the table renderer drops a trailing .0 from a float)."""
    return f"{r['median_ms'] * 1e3:,.1f}" if us(r) is not None else None


def dims_of(p):
    return p["row"]["dims"]


def pair(doc, name, **dims):
    """The kernel and call rows of the provider called `name` (else the first whose name starts with it) at
    the given dims: {"provider", "kernel", "call", ...} as timed_pairs gives them, or None."""
    found = [p for p in timed_pairs(doc) if p["provider"].startswith(name)
             and all(dims_of(p).get(k) == v for k, v in dims.items())]
    return next((p for p in found if p["provider"] == name), found[0] if found else None)


def perf_rows(doc):
    """One row per (shape, provider): kernel and call time; the rate and the share of the ceiling from the
    kernel time."""
    prefill = doc["op"] == "attention.prefill"
    rows = []
    for p in timed_pairs(doc):
        k, c = p.get("kernel"), p.get("call")
        row = {"shape": p["shape"], "provider": p["provider"], "kernel us": us_text(k), "call us": us_text(c),
               "call / kernel": f"{c['median_ms'] / k['median_ms']:.2f}x" if us(k) and us(c) else None}
        if us(k):
            row["TFLOP/s" if prefill else "GB/s"] = f"{k['tflops']:.1f}" if prefill else round(k["gbps"])
            row["of ceiling"] = f"{k['frac_of_ceiling']:.1%}"
        rows.append(row)
    return rows


# %%
# NBVAL_IGNORE_OUTPUT
live = {}
if torch.cuda.is_available():
    from lynn_kernels.bench import measure_ceilings
    from lynn_kernels.bench.attention import bench_decode, bench_prefill
    from lynn_kernels.bench.harness import SCHEMA, provenance

    ceilings = measure_ceilings()
    for op, fn in (("attention.prefill", bench_prefill), ("attention.decode", bench_decode)):
        live[op] = {"schema": SCHEMA, "op": op, "provenance": provenance("notebook 04, quick run"),
                    "ceilings": ceilings.as_dict(), "results": [r.as_dict() for r in fn(ceilings, quick=True)]}
        print(f"== {op}, live on {live[op]['provenance']['gpu']} (quick)")
        print(render_table(perf_rows(live[op])))
else:
    print("no GPU: nothing is timed under the interpreter; below, the committed H200 results")

# %%
# NBVAL_IGNORE_OUTPUT
docs = {}
for op in ("attention.prefill", "attention.decode"):
    try:
        docs[op] = load(op, gpu="h200")
    except FileNotFoundError:
        print(f"{op}: no committed H200 results: run `lynn bench attention` on a GPU")
        if op in live:
            docs[op] = live[op]
            print("  (showing this session's live quick run instead)")
for op, doc in docs.items():
    p, c = doc["provenance"], doc["ceilings"]
    print(f"\n== {op}: {p['gpu']}, {p['date']}, git {p['git_sha']}, torch {p['torch']}, triton {p['triton']}, "
          f"CUDA {p.get('cuda')}; command `{p['command']}`")
    print(f"ceilings: read {c['read_gbps']:,.0f} GB/s, copy {c['copy_gbps']:,.0f} GB/s, "
          f"bf16 matmul {c['bf16_tflops']:.0f} TFLOP/s; rates and ceiling shares from the kernel time")
    print(render_table(perf_rows(doc)))

# %% [markdown]
# The plots, all from the same rows: prefill TFLOP/s against T under the bf16 matmul peak (left), decode GB/s
# against cached tokens under the read ceiling (middle; circles batch 1, squares batch 8), ours solid and SDPA
# dashed, one colour per provider, lines from the kernel time. Hollow markers on the left are the same rate from
# the call time; on the right, each decode provider's call time (light bar) stands over its kernel time (solid
# bar), per cell, on a log scale.

# %%
# NBVAL_IGNORE_OUTPUT
from matplotlib.lines import Line2D
from matplotlib.patches import Patch


def plot_kernel_lines(ax, doc, x_key, value, ceiling, ceiling_label, xlabel, ylabel, with_call=False):
    """One line per (provider, batch) from the kernel rows: ours solid, SDPA dashed, batch 8 with square markers,
    one legend entry per provider; with `with_call`, the same rate from the call time as hollow markers."""
    ps = [p for p in timed_pairs(doc) if us(p.get("kernel"))]
    provs = list(dict.fromkeys(p["provider"] for p in ps))
    groups = {}
    for p in ps:
        groups.setdefault((p["provider"], dims_of(p).get("B")), []).append(p)
    xs, labelled = set(), set()
    for (prov, b), group in groups.items():
        group.sort(key=lambda p: dims_of(p)[x_key])
        x = [dims_of(p)[x_key] for p in group]
        xs.update(x)
        c, marker = f"C{provs.index(prov)}", "s" if b not in (None, 1) else "o"
        ax.plot(x, [p["kernel"][value] for p in group], "--" if "SDPA" in prov else "-", marker=marker, c=c,
                label=None if prov in labelled else prov)
        labelled.add(prov)
        if with_call:
            pts = [(dims_of(p)[x_key], p["call"][value]) for p in group if us(p.get("call"))]
            ax.plot(*zip(*pts), ls="none", marker=marker, mfc="none", ms=9, c=c)
    top = doc["ceilings"][ceiling]
    ax.axhline(top, ls=":", c="k", lw=1)
    ax.text(0.01, top, f" {ceiling_label}", transform=ax.get_yaxis_transform(), va="bottom", fontsize=7)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(xs), [str(x) for x in sorted(xs)])
    ax.minorticks_off()
    ax.set_ylim(0, top * 1.15)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(f"{doc['op']} on {doc['provenance']['gpu']}, kernel time", fontsize=10)
    handles = ax.get_legend_handles_labels()[0]
    if with_call:
        handles.append(Line2D([], [], ls="none", marker="o", mfc="none", c="0.4",
                              label="hollow: from the call time"))
    ax.legend(handles=handles, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), frameon=False)


def note_above_read_ceiling(ax, doc):
    """Say on the plot why decode rates can pass the marked read ceiling (docs/performance.md, "Fused attention")."""
    c = doc["ceilings"]
    over = [p for p in timed_pairs(doc) if us(p.get("kernel")) and p["kernel"]["gbps"] > c["read_gbps"]]
    if not over:
        return
    top = max(over, key=lambda p: p["kernel"]["gbps"])
    where = "; ".join(f"batch {b}, {length} tokens" for b, length in
                      dict.fromkeys((dims_of(p)["B"], dims_of(p)["L"]) for p in over))
    size = c.get("sizes", {}).get("copy_read_bytes", 2**30)
    ax.set_ylim(0, c["read_gbps"] * 1.45)                           # room above the ceiling for the note
    ax.annotate(f"{where}: {len(over)} rates above the read ceiling, up to {top['kernel']['gbps']:,.0f} GB/s "
                f"({top['kernel']['gbps'] / c['read_gbps']:.1%}).\nThat ceiling is torch's sum over a "
                f"{size / 2**30:g} GiB bf16 tensor, measured in the\nsame process, not the hardware peak; the copy "
                f"ceiling of the same\nrun was {c['copy_gbps']:,.0f} GB/s (docs/performance.md, \"Fused attention\").",
                xy=(dims_of(top)["L"], top["kernel"]["gbps"]), xytext=(0.03, 0.97), textcoords="axes fraction",
                va="top", fontsize=7, arrowprops={"arrowstyle": "->", "color": "0.4", "lw": 0.8},
                bbox={"boxstyle": "round", "fc": "white", "ec": "0.7"})


def plot_call_vs_kernel(ax, doc):
    """Per decode cell: each provider's call time (light bar) over its kernel time (solid bar), microseconds."""
    ps = [p for p in timed_pairs(doc) if us(p.get("kernel")) and us(p.get("call"))]
    provs = list(dict.fromkeys(p["provider"] for p in ps))
    cells = sorted({(dims_of(p)["L"], dims_of(p)["B"]) for p in ps})
    width = 0.8 / len(provs)
    for p in ps:
        i, j = provs.index(p["provider"]), cells.index((dims_of(p)["L"], dims_of(p)["B"]))
        x = j + (i - (len(provs) - 1) / 2) * width
        ax.bar(x, us(p["call"]), width, color=f"C{i}", alpha=0.3)
        ax.bar(x, us(p["kernel"]), width, color=f"C{i}")
    ax.set_yscale("log")
    ax.set_ylim(1, 2 * max(us(p["call"]) for p in ps))
    ax.set_xticks(range(len(cells)), [f"B={b}, L={length}" for length, b in cells], fontsize=8)
    ax.set_ylabel("microseconds (log scale)")
    ax.set_title("decode: call time (light) over kernel time (solid)", fontsize=10)
    ax.legend(handles=[Patch(color="0.3", label="kernel time (CUDA profiler)"),
                       Patch(color="0.3", alpha=0.3, label="call time (do_bench of the Python call)")],
              fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), frameon=False)


if not docs:
    print("nothing to plot: no committed H200 results (run `lynn bench attention` on a GPU)")
else:
    fig, axes = plt.subplots(1, 3, figsize=(19, 6.6))
    if "attention.prefill" in docs:
        doc = docs["attention.prefill"]
        plot_kernel_lines(axes[0], doc, "T", "tflops", "bf16_tflops",
                          f"bf16 matmul peak {doc['ceilings']['bf16_tflops']:.0f} TFLOP/s",
                          "T (tokens, one causal sequence)", "TFLOP/s (2 T^2 Hq D flops)", with_call=True)
    else:
        axes[0].text(0.5, 0.5, "no prefill results", ha="center", transform=axes[0].transAxes)
    if "attention.decode" in docs:
        doc = docs["attention.decode"]
        plot_kernel_lines(axes[1], doc, "L", "gbps", "read_gbps",
                          f"read ceiling {doc['ceilings']['read_gbps']:,.0f} GB/s",
                          "cached tokens L (o: batch 1, s: batch 8)", "GB/s (K and V bytes read once)")
        note_above_read_ceiling(axes[1], doc)
        plot_call_vs_kernel(axes[2], doc)
    else:
        for ax in axes[1:]:
            ax.text(0.5, 0.5, "no decode results", ha="center", transform=ax.transAxes)
    plt.tight_layout()
    plt.show()


# %% [markdown]
# **The goals**, cell by cell, judged on the kernel time, with the call time beside it; then a verdict per goal
# and the figures the prose below refers to, all computed from the committed rows:

# %%
# NBVAL_IGNORE_OUTPUT
def ratio(a, b):
    """a / b of two rows' medians."""
    return a["median_ms"] / b["median_ms"]


def span_us(rows):
    vals = [us(r) for r in rows if us(r)]
    return f"{min(vals):,.0f}-{max(vals):,.0f} us" if vals else "-"


PLAIN, GATED = "lynn flash_attention", "lynn flash_attention, gate fused"
SDPA, SDPA_GATE = "torch SDPA (enable_gqa)", "torch SDPA + eager gate"
OURS_DEC = "lynn launch_decode, contiguous"
goal_rows, bw_rows, notes = [], [], []
pre, dec = docs.get("attention.prefill"), docs.get("attention.decode")
if pre is not None:
    for t in sorted({dims_of(p)["T"] for p in timed_pairs(pre)}):
        o, s = pair(pre, PLAIN, T=t), pair(pre, SDPA, T=t)
        if o and s and us(o.get("kernel")) and us(s.get("kernel")):
            k = o["kernel"]["tflops"] / s["kernel"]["tflops"]
            goal_rows.append({"goal": "prefill >= 0.7x SDPA TFLOP/s", "cell": f"T={t}",
                              "kernel time": f"{k:.2f}x ({o['kernel']['tflops']:.1f} vs "
                                             f"{s['kernel']['tflops']:.1f} TFLOP/s)",
                              "call time": f"{ratio(s['call'], o['call']):.2f}x ({us(o['call']):,} vs "
                                           f"{us(s['call']):,} us)", "met": k >= 0.7})
            notes.append(f"prefill T={t}: our call over our kernel time {ratio(o['call'], o['kernel']):.2f}x "
                         f"({us(o['call']):,} vs {us(o['kernel']):,} us)")
        g, sg = pair(pre, GATED, T=t), pair(pre, SDPA_GATE, T=t)
        if o and s and g and sg:
            notes.append(f"prefill T={t}: the gate costs {ratio(g['kernel'], o['kernel']) - 1:.1%} fused into "
                         f"our epilogue, {ratio(sg['kernel'], s['kernel']) - 1:.1%} as an eager sigmoid * o after "
                         f"SDPA; gated, ours {g['kernel']['tflops']:.1f} vs SDPA + eager gate "
                         f"{sg['kernel']['tflops']:.1f} TFLOP/s")
if dec is not None:
    ours_calls, sdpa_calls, slower_calls = [], [], []
    for length, b in sorted({(dims_of(p)["L"], dims_of(p)["B"]) for p in timed_pairs(dec)}):
        o, s = pair(dec, OURS_DEC, B=b, L=length), pair(dec, "torch SDPA", B=b, L=length)
        if not (o and s and us(o.get("kernel")) and us(s.get("kernel"))):
            continue
        k = ratio(s["kernel"], o["kernel"])
        goal_rows.append({"goal": "decode no slower than SDPA", "cell": f"B={b}, L={length}",
                          "kernel time": f"{k:.2f}x SDPA's speed ({us(o['kernel'])} vs {us(s['kernel'])} us)",
                          "call time": f"{ratio(s['call'], o['call']):.2f}x ({us(o['call'])} vs "
                                       f"{us(s['call'])} us)", "met": k >= 1.0})
        ours_calls.append(o["call"])
        sdpa_calls.append(s["call"])
        if o["call"]["median_ms"] > s["call"]["median_ms"]:
            slower_calls.append(f"B={b}, L={length}")
        if length == 32768:
            f = o["kernel"]["frac_of_ceiling"]
            bw_rows.append({"goal": "decode >= 70% of read at L=32768", "cell": f"B={b}, L={length}",
                            "kernel time": f"{f:.1%} of read ({o['kernel']['gbps']:,.0f} GB/s)",
                            "call time": f"{o['call']['frac_of_ceiling']:.1%} of read", "met": f >= 0.7})
            if f > 1:
                notes.append(f"decode B={b}, L={length}: {f:.1%} of the read ceiling, which is torch's sum over "
                             f"a 1 GiB bf16 tensor ({dec['ceilings']['read_gbps']:,.0f} GB/s in this run), not "
                             f"the hardware peak; the copy ceiling of the same run: "
                             f"{dec['ceilings']['copy_gbps']:,.0f} GB/s")
    notes.append(f"decode call time: launch_decode {span_us(ours_calls)} against SDPA's {span_us(sdpa_calls)}; "
                 f"slower than SDPA's call at {len(slower_calls)} of {len(ours_calls)} cells"
                 + (f" ({'; '.join(slower_calls)})" if slower_calls else ""))
    eager = [p["call"] for p in timed_pairs(dec) if p["provider"].startswith("lynn decode_attention()")]
    notes.append(f"decode_attention() eager call (one host sync to check seq_lens): {span_us(eager)} a call")
    paged = [p for p in timed_pairs(dec) if p["provider"].startswith("lynn launch_decode, paged")]
    faster = sum(us(p["kernel"]) < us(pair(dec, "torch SDPA", **{k: dims_of(p)[k] for k in "BL"})["kernel"])
                 for p in paged)
    goal_rows += bw_rows
    kernel_us = ", ".join(str(us(p["kernel"])) for p in paged)
    notes.append(f"paged cache: {kernel_us} us of kernel time, "
                 f"{min(p['kernel']['frac_of_ceiling'] for p in paged):.0%}-"
                 f"{max(p['kernel']['frac_of_ceiling'] for p in paged):.0%} of read; faster than SDPA on a "
                 f"contiguous cache at {faster} of {len(paged)} cells")

if not goal_rows:
    print("goals: no committed results, nothing to judge")
else:
    print(render_table(goal_rows))
    print()
    for goal in dict.fromkeys(r["goal"] for r in goal_rows):
        cells = [r for r in goal_rows if r["goal"] == goal]
        met = [r["cell"] for r in cells if r["met"]]
        verdict = ("met" if len(met) == len(cells) else "not met" if not met
                   else f"met at {'; '.join(met)} only")
        print(f"{goal}: {verdict} (kernel time, {len(met)} of {len(cells)} cells)")
    print()
    print("\n".join(notes))


# %% [markdown]
# How to read it (`docs/history/attention.md` keeps the full record and what was tried):
#
# * **Kernel time** is what the goals are judged on: a decoder captures its step in a CUDA graph, which replays
#   the kernels without the Python around them. SDPA's prefill is still ahead of ours in TFLOP/s; the goal asks
#   for 0.7x of it. The fused gate costs a few percent where an eager `sigmoid * o` after SDPA costs far more,
#   since that is another full pass over the output.
# * **Above 100% of read**: at batch 8 and 32768 tokens the decode kernel passes the "read ceiling". That ceiling
#   is torch's sum over one large tensor, measured in the same process; it is not the hardware peak, and a kernel
#   that streams better can beat it.
# * **Call time, decode**: on the device's slow host a Triton launch costs tens of microseconds, so the call of a
#   kernel of a few microseconds costs several times its kernel time, and SDPA's call can come out as fast or
#   faster in some cells even where its kernel is slower. The public `decode_attention()`
#   adds a host sync to check `seq_lens`; `launch_decode` is the entry point for a graph-captured step.
# * **Call time, prefill: the host stall that was fixed.** The first H200 run measured 497 us per call against
#   303 us of kernel time at T = 4096: the wrapper built its two `cu_seqlens` tensors from Python lists on every
#   call, and a pageable host-to-device copy waits for the stream, so the GPU idled between back-to-back calls.
#   The offsets are now built once per (offsets, device), and call and kernel time agree (the ratios printed
#   above).

# %% [markdown]
# ## 7. Explorer: tiles and errors for one setting
#
# `explore_setting(t, group, causal)` runs the toy kernel of section 3 on one KV head with `group` query heads packed as
# in 3c (16 tokens x `group` heads a tile, 16-key blocks) and the package's `flash_attention` on the same fp32
# inputs (head dim 32), prints the tile counts and both errors against the reference, and draws the tile grid the
# toy visited. A fixed example first (checked), then the widgets (each setting runs in about a second on a CPU).

# %%
def explore_setting(t, group, causal, seed=0):
    """(kinds, text) for one setting: the toy's tile grid, its and the package's errors against the reference."""
    g_ = torch.Generator().manual_seed(seed)
    q = torch.randn(t, group, 32, generator=g_).to(DEVICE)
    k, v = (torch.randn(t, 1, 32, generator=g_).to(DEVICE) for _ in range(2))
    want = reference.flash_attention(q, k, v, causal=causal)
    toy_out, visits = toy_flash(q, k[:, 0], v[:, 0], causal=causal, BLOCK_M=16 * group)
    pkg_out = flash_attention(q, k, v, causal=causal)
    if causal:
        kinds = tile_kinds(t, 16, 16, group)
    else:                                                               # every block; a ragged last one masked
        kinds = np.ones(visits.shape, dtype=int)
        kinds[:, -1] = 2 if t % 16 else 1
    visited, dense = int(visits.sum()), visits.numel()
    rows = [{"kernel": "toy (16 tokens x G heads, 16-key blocks)", "m": compare(toy_out, want)},
            {"kernel": "package flash_attention", "m": compare(pkg_out, want)}]
    text = (f"T={t}, {group} query head{'s' * (group > 1)} per KV head, {'causal' if causal else 'not causal'}: "
            f"the toy visits {visited} of {dense} tiles, each K/V block load serving all {group} heads (one head "
            f"per program, with the same 16-token tiles, would take {group * visited} loads)\n"
            + render_table(rounded(rows), ["kernel", "cosine", "max_abs", "rel_l2"]))
    return kinds, text


print(explore_setting(40, 4, True)[1])

# %%
# NBVAL_IGNORE_OUTPUT
import time

import ipywidgets as widgets
from IPython.display import display


def show(t, group, causal):
    t0 = time.perf_counter()
    kinds, text = explore_setting(t, group, causal)
    print(text)
    print(f"({time.perf_counter() - t0:.1f} s on {lk.backend()})")
    fig, ax = plt.subplots(figsize=(5.5, 5.5))
    plot_tiles(ax, kinds, f"tiles of 16 tokens x {group} head{'s' * (group > 1)}, 16-key blocks")
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, fc=TILE_COLORS(i), ec="0.6") for i in range(3)],
              labels=TILE_LABELS[:3], fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=3,
              frameon=False)
    plt.tight_layout()
    plt.show()


style = {"description_width": "initial"}
t_w = widgets.IntSlider(40, min=1, max=128, description="sequence length T", style=style, continuous_update=False)
g_w = widgets.ToggleButtons(options=[1, 2, 4, 8], value=4, description="query heads per KV head", style=style)
c_w = widgets.Checkbox(True, description="causal")
out = widgets.interactive_output(show, {"t": t_w, "group": g_w, "causal": c_w})
display(widgets.VBox([widgets.HBox([t_w, c_w]), g_w, out]))

# %% [markdown]
# Things to try: switch causal off and watch the grid fill; raise T and watch the visited share fall towards one
# half; change the heads per KV head at a fixed T and see that the grid stays the same while the loads an unpacked
# kernel would need grow with it; take T = 1 (a decode step) and T = 17 (one token past a tile).
#
# ## What's next
#
# The kernels are validated here and in `tests/test_attention.py` on the CPU, and `lynn check` has passed with
# them compiled on the H200 (`docs/reliability.md`, GPU test runs); section 6 judges the goals on their
# H200 benchmark (`data/bench/h200/attention.*.json`). One step left open there: the decode merge is a second
# launch (1.3-2.0 us at batch 1 on the H200); folding it into the split kernel, with a last-program ticket as in
# the matmul's split-K, would save it. Next notebook: `05`, Gated DeltaNet, the linear attention that fills the
# other three layers in four.
