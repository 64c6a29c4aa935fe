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
# # 03: Grouped MoE: routing, alignment and grouped NVFP4 expert GEMMs
#
# Every layer of Qwen3-Next and Qwen3.5 / 3.6 ends in a **sparse mixture of experts**: a router picks 8 of 256
# small feed-forward networks per token (Qwen3-Next: 10 of 512), and a shared expert runs for every token. This
# notebook builds the block from the math up and then hands over to the package's kernels in `lynn_kernels.moe`:
#
# 1. the block in a few lines of torch, and why decoding it is bound by the bytes of the *active* experts
# 2. routing: softmax top-k, ties to the lowest id; the load of a batch over the experts
# 3. the align step: slots sorted by expert and padded to tiles, step by step on a small example
# 4. the grouped kernel: a toy grouped GEMM built step by step, then the package's `moe_experts` and its decode
#    path
# 5. the validation table: awkward routings, both paths, the whole block, and HF transformers' Qwen3.5 block
# 6. the H200 profile against a `torch._grouped_mm` pipeline, from committed results, and the goals
# 7. an explorer of expert load and padding
#
# Everything runs on a CPU through Triton's interpreter, on small shapes; on a GPU the same cells run compiled.
# The math is also in [`docs/moe.md`](../docs/moe.md); the layouts in `lynn_kernels/moe/spec.py`.

# %%
# %matplotlib inline
import lynn_kernels as lk  # noqa: I001  (first: it picks the backend before triton is imported)
import inspect
from functools import partial

import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from lynn_kernels import compare, moe, notebook, render_table
from lynn_kernels.metrics import bit_mismatches
from lynn_kernels.moe import SharedExpert, reference, spec, triton_experts, triton_experts_decode
from lynn_kernels.nvfp4 import reference as nvfp4_ref
from lynn_kernels.runtime import DEVICE

BF16, FP32 = torch.bfloat16, torch.float32
FLOOR = 1e-5
#: 3 significant digits, below FLOOR shown as '< 1e-05': fp32 round-off depends on the CPU's BLAS (and a bf16
#: rounding can flip with it), and nbval compares the committed output as text, so it must not show
r3 = partial(notebook.r3, floor=FLOOR)
rounded = partial(notebook.rounded, cosine=notebook.decimals6, errors=r3, err_ratio=notebook.r3)


def randn(*shape, seed, scale=1.0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale


def experts(E, H, I, seed=0):
    """NVFP4 expert stacks on DEVICE: w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I], one global scale
    per expert (as checkpoints store experts: one tensor each); w2 scaled so the output has about x's size.
    Quantised by the torch reference (bit-identical to `lk.quantize`, and fast under the interpreter)."""
    def q(w):
        return nvfp4_ref.quantize(w, global_scale=w.abs().amax(dim=(1, 2)) / (6 * 448)).to(DEVICE)

    return q(randn(E, 2 * I, H, seed=seed, scale=0.2)), q(randn(E, H, I, seed=seed + 1, scale=0.5 / I ** 0.5))


def dq(w, dtype=torch.float32):
    """Dequantise with the torch reference (bit-identical to `lk.dequantize`)."""
    return nvfp4_ref.dequantize(w, dtype)


# %%
# NBVAL_IGNORE_OUTPUT
print(lk.device_summary())


# %% [markdown]
# ## 1. The block, and why decode reads bytes
#
# A Qwen3.5 MoE block (HF `Qwen3_5MoeSparseMoeBlock`; Qwen3-Next's is the same with `norm_topk_prob` optional)
# takes a token `x` of hidden size `H = 2048`:
#
# * **router**: logits `z = W_r x` over the `E = 256` experts (`W_r [E, H]`, kept unquantised), probabilities
#   `p = softmax(z)` **in fp32**;
# * **top-k**: the `k = 8` largest `p_e`, best first, **renormalised** to sum to 1: `w_j = p_{e_j} / sum_i p_{e_i}`;
# * **experts**: each is a SwiGLU feed-forward of intermediate size `I = 512`,
#   `f_e(x) = W2_e (silu(Wg_e x) * Wu_e x)` with `Wg_e, Wu_e [I, H]` (stacked as `w13 [E, 2I, H]`, gate rows
#   first) and `W2_e [H, I]`;
# * **shared expert**: one more SwiGLU (intermediate 512) for every token, scaled by a sigmoid gate
#   `sigmoid(w_s . x)`.
#
# $$ y = \sum_{j=1}^{k} w_j\, f_{e_j}(x) \;+\; \sigma(w_s^\top x)\, f_s(x) $$
#
# In a few lines of torch, on dense fp32 weights, checked against the package's reference
# `moe.reference.moe_block` (which takes the same experts as NVFP4 tensors and dequantises them):

# %%
def qwen_moe_block(x, router_w, w13, w2, s13, s2, s_gate, top_k):
    """x [M, H]; router_w [E, H]; w13 [E, 2I, H]; w2 [E, H, I]; s13 [2Is, H]; s2 [H, Is]; s_gate [1, H]."""
    probs = torch.softmax(x @ router_w.T, dim=-1, dtype=torch.float32)       # [M, E], fp32
    top, ids = torch.topk(probs, top_k, dim=-1)                              # [M, k], best first
    top = top / top.sum(-1, keepdim=True)                                    # renormalise (Qwen3.5: always)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(top_k):
            gate, up = (w13[ids[t, j]] @ x[t]).chunk(2)                      # [I], [I]
            out[t] += top[t, j] * (w2[ids[t, j]] @ (F.silu(gate) * up))      # [H]
    gate, up = (x @ s13.T).chunk(2, dim=-1)                                  # the shared expert, every token
    return out + torch.sigmoid(x @ s_gate.T) * ((F.silu(gate) * up) @ s2.T)


E0, K0, H0, I0, IS0 = 8, 2, 64, 32, 48                                        # a tiny block
w13_q, w2_q = experts(E0, H0, I0, seed=1)
s13_q, s2_q = (w[0] for w in experts(1, H0, IS0, seed=3))
s_gate, router0 = randn(1, H0, seed=5, scale=0.1), randn(E0, H0, seed=6, scale=0.3)
x0 = randn(5, H0, seed=7)

dense = lambda w: dq(w).cpu()                                                # noqa: E731
mine = qwen_moe_block(x0, router0, dense(w13_q), dense(w2_q), dense(s13_q), dense(s2_q), s_gate, K0)
ref = reference.moe_block(x0.to(DEVICE), router0.to(DEVICE), w13_q, w2_q,
                          SharedExpert(s13_q, s2_q, s_gate.to(DEVICE)), top_k=K0)
print(f"{len(x0)} tokens, E={E0}, top-{K0}, H={H0}, I={I0}, shared {IS0}: the few lines above vs "
      f"moe.reference.moe_block, max_abs {r3(compare(mine, ref).max_abs)}")

# %% [markdown]
# **What one decode step reads.** A token touches `k = 8` routed experts and the shared one. An expert is
# `3 I H = 3 x 512 x 2048 = 3.1M` weights; in NVFP4 a weight costs half a byte for its 4-bit code plus one E4M3
# scale byte per 16 weights: **0.5625 bytes** (the fp32 global scale is negligible). Its flops are `2 x 3 I H` per
# token: about 3.6 flops per byte read. An H200 streams about 4 TB/s and does about 700 bf16 TFLOP/s, so it needs
# some 175 flops per byte before the arithmetic, not the memory, sets the pace. At batch 1 an MoE block is a pure
# bandwidth problem: its time is the bytes of the **active** experts over the bandwidth.
#
# With a batch of `M` tokens routed uniformly at random, an expert is missed by one token with probability
# `1 - k/E`, so about `E (1 - (1 - k/E)^M)` distinct experts are active. The bytes grow with that number and
# saturate at all 256 experts, while the flops grow with `M`. The table uses the round figures above (section 6
# uses the measured ceilings):

# %%
E, TOP_K, H, I = 256, 8, 2048, 512                  # Qwen3.5-35B-A3B (its config; docs/decoder.md); shared I_s = 512
NVFP4_BYTES = 0.5 + 1 / 16                           # per weight: a 4-bit code + an E4M3 scale per 16 weights
READ_TBS, BF16_TFLOPS = 4.0, 700                     # round H200 figures (measured: section 6)
per_expert = 3 * I * H
print(f"one expert: {per_expert:,} weights = {per_expert * NVFP4_BYTES / 1e6:.2f} MB in NVFP4 "
      f"({per_expert * 2 / 1e6:.2f} MB in bf16); all {E} experts of a layer: "
      f"{E * per_expert * NVFP4_BYTES / 1e6:.0f} MB")
one = TOP_K * per_expert * NVFP4_BYTES
print(f"decode, batch 1: {TOP_K} routed experts = {one / 1e6:.2f} MB -> {one / READ_TBS / 1e6:.1f} us at "
      f"{READ_TBS:g} TB/s (bf16 weights: {TOP_K * per_expert * 2 / READ_TBS / 1e6:.1f} us); with the shared "
      f"expert, over 40 layers: {40 * (TOP_K + 1) * per_expert * NVFP4_BYTES / 1e6:.0f} MB a token\n")

rows = []
for M in (1, 4, 16, 64, 512, 4096):
    active = E * (1 - (1 - TOP_K / E) ** M)          # expected distinct experts, uniform routing
    nbytes, flops = active * per_expert * NVFP4_BYTES, 2 * M * TOP_K * per_expert
    t_bytes, t_flops = nbytes / (READ_TBS * 1e12) * 1e6, flops / (BF16_TFLOPS * 1e12) * 1e6
    rows.append({"M": M, "active experts": round(active, 1), "MB read": round(nbytes / 1e6, 1),
                 "GFLOP": round(flops / 1e9, 3), "flop/byte": round(flops / nbytes, 1),
                 "us at 4 TB/s": round(t_bytes, 1), "us at 700 TFLOP/s": round(t_flops, 1),
                 "bound by": "bytes" if t_bytes > t_flops else "flops"})
print(render_table(rows))

# %% [markdown]
# Two lessons for the kernels. At batch 1 the floor is about 3.5 us for the routed experts: anything above that
# is overhead (launches, too few programs, re-reading). And from M = 64 to 512 the bytes grow by 15% while the
# work grows 8-fold: a batch that hits an expert several times must read that expert **once** and apply it to all
# its tokens, which is what grouping the tokens by expert (sections 3 and 4) buys. Only towards
# M = 4096 (128 tokens per expert) does the block become a matmul problem.

# %% [markdown]
# ## 2. Routing
#
# `moe.route(logits, top_k, renormalize=True)` returns `(weights fp32 [M, k], ids int32 [M, k])`, best first. Its
# reference, `moe.reference.route`, is a stable sort of the fp32 softmax: equal probabilities keep increasing ids,
# so **ties go to the lowest expert id**. (`torch.topk`, which HF uses, does not promise which of two equal values
# it returns; with real logits ties are rare, but a kernel and its spec must agree on every input.) The kernel, one
# program per block of tokens, takes the max `k` times, choosing the lowest id among the lanes equal to it.
#
# A tiny example with ties: token 0 has three experts at the top probability, token 1 has six equal logits.

# %%
logits = torch.tensor([[0.5, 2.0, 2.0, -1.0, 2.0, 1.0],
                       [3.0, 3.0, 3.0, 3.0, 3.0, 3.0],
                       [0.1, -0.4, 1.3, 0.2, 1.3, -2.0]])
w, ids = moe.route(logits.to(DEVICE), top_k=2)
w_ref, ids_ref = reference.route(logits.to(DEVICE), top_k=2)
p = torch.softmax(logits, -1)
for t in range(len(logits)):
    print(f"token {t}: p = [{', '.join(f'{v:.3f}' for v in p[t].tolist())}] -> ids {ids[t].tolist()}, "
          f"weights [{', '.join(f'{v:.4f}' for v in w[t].tolist())}]")
print("\nids equal the reference's:", torch.equal(ids, ids_ref),
      "| weights max_abs:", r3(compare(w, w_ref).max_abs, floor=1e-6))


# %% [markdown]
# **Load.** A batch's routing decides how much work each expert gets. Below, a Qwen3.5-sized router
# (E = 256, top-8) over M = 256 tokens. The logits are drawn as `z[t, e] = n[t, e] + skew * b[e]`: a per-token
# random part `n` and a per-expert popularity `b`, both standard normal. `skew = 0` is a perfectly balanced router
# in expectation; trained routers are pushed towards it by a load-balancing loss but never reach it. Each token
# gives `k` **slots** (token `t`'s `j`-th choice is slot `t * k + j`); the load of an expert is its number of
# slots.

# %%
def routing_batch(M, E, top_k, skew, seed=0):
    """(weights, ids) of M tokens from the package's route, logits n + skew * b (see the text)."""
    g = torch.Generator().manual_seed(seed)
    popularity = torch.randn(E, generator=g)
    logits = torch.randn(M, E, generator=g) + skew * popularity
    return moe.route(logits.to(DEVICE), top_k), logits


def load_stats(ids, E):
    counts = torch.bincount(ids.reshape(-1).long().cpu(), minlength=E)
    mean = ids.numel() / E
    return counts, {"slots": ids.numel(), "mean load": round(mean, 2), "max load": int(counts.max()),
                    "max / mean": round(counts.max().item() / mean, 2), "empty experts": int((counts == 0).sum())}


(w_b, ids_b), logits_b = routing_batch(256, 256, 8, skew=0.2)
print("ids equal the reference's:", torch.equal(ids_b, reference.route(logits_b.to(DEVICE), 8)[1]))
counts_b, stats = load_stats(ids_b, 256)
print(render_table([stats]))

# %%
# NBVAL_IGNORE_OUTPUT
fig, ax = plt.subplots(figsize=(11, 3.2))
ax.bar(range(256), counts_b, width=1.0, color="tab:blue")
ax.axhline(stats["mean load"], c="tab:red", ls=":", lw=1.2, label=f"mean {stats['mean load']:.0f}")
ax.set_xlim(-1, 256)
ax.set_xlabel("expert id")
ax.set_ylabel("slots routed to it")
ax.set_title("expert load of 256 tokens, E = 256, top-8, skew 0.2", fontsize=10)
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# Top-8 of 256 picks the extremes of each row, so even a small popularity spread shows: at skew 0.2 the busiest
# expert gets a few times the mean and some experts get nothing (at skew 0, about twice the mean: chance alone).
# For a grouped kernel that means uneven tiles (section 3) and, on a GPU, a tail of busy experts; the explorer in
# section 7 varies the batch, `k`, the skew and the tile height.

# %% [markdown]
# ## 3. The align step, step by step
#
# A grouped GEMM wants each tile of `BLOCK_M` rows to belong to **one** expert, so that a program loads one
# expert's weight tile and applies it to all its rows. The align step ("moe align block size" in vLLM) gives the
# kernel that layout without moving any activation:
#
# 1. number the slots `s = t * k + j` (`S = M k` of them); the expert of slot `s` is `ids.view(-1)[s]`;
# 2. count the slots of each expert, `c_e`, and pad each count up to a multiple of `BLOCK_M`;
# 3. prefix sums of the padded counts give each expert's group start (a multiple of `BLOCK_M`);
# 4. `sorted_slots`: each expert's slots in increasing order at its group start, the padding filled with the
#    sentinel `S`;
# 5. `block_expert[b]`: the expert of rows `[b BLOCK_M, (b + 1) BLOCK_M)`, `-1` past the used blocks;
#    `num_padded`: the total padded length.
#
# The buffers are sized by a bound known **without reading the ids** (no host sync, so the step can live in a
# CUDA graph): each expert that receives a slot pads by at most `BLOCK_M - 1`, so
# `P_max = round_up(S + min(E, S) (BLOCK_M - 1), BLOCK_M)`.
#
# The example: `M = 5` tokens, `E = 6` experts, `k = 2`, `BLOCK_M = 16`; experts 3 and 4 receive nothing.

# %%
ids_s = torch.tensor([[2, 0], [2, 5], [0, 2], [5, 1], [2, 0]], dtype=torch.int32)
M_S, K_S, E_S, BM = 5, 2, 6, 16
S = M_S * K_S
flat = ids_s.view(-1)
print("1. slots:  ", render_table([{"slot s": s, "token s // k": s // K_S, "choice s % k": s % K_S,
                                    "expert": int(flat[s])} for s in range(S)]).replace("\n", "\n" + " " * 12))
counts = torch.bincount(flat.long(), minlength=E_S)
padded = (counts + BM - 1) // BM * BM
starts = padded.cumsum(0) - padded
print("\n2. counts c_e:         ", counts.tolist())
print("   padded to BLOCK_M:   ", padded.tolist())
print("3. group starts:        ", starts.tolist(), "  (experts 3 and 4 have no group)")
P_MAX = spec.max_padded(S, E_S, BM)
print(f"   P_max = round_up({S} + min({E_S}, {S}) x {BM - 1}, {BM}) = {P_MAX}, i.e. {P_MAX // BM} row blocks")

sorted_slots, block_expert, num_padded = moe.align(ids_s.to(DEVICE), E_S, BM)
print(f"\n4. sorted_slots (rows of {BM}; '.' = the sentinel S = {S}):")
for b in range(P_MAX // BM):
    row = sorted_slots[b * BM:(b + 1) * BM].tolist()
    print(f"   block {b}: " + " ".join(f"{v:>2}" if v < S else " ." for v in row))
print("5. block_expert:", block_expert.tolist(), " num_padded:", num_padded.tolist())


# %% [markdown]
# Row block 0 holds expert 0's three slots (1, 4, 9: tokens 0, 2, 4), block 1 expert 1's one slot, and so on; the
# last three blocks are past `num_padded` and their programs exit at once. Now `moe.align` against its reference
# and against the same construction written plainly here, on this example and on a batch of 37 tokens x 4 over 60
# experts (148 slots: two chunks of the interpreter's 128-slot sort, so the multi-program path runs too):

# %%
def align_by_hand(ids, E, block_m):
    flat, S = ids.reshape(-1).long().cpu(), ids.numel()
    p_max = spec.max_padded(S, E, block_m)
    slots, blocks, pos = torch.full((p_max,), S, dtype=torch.int32), torch.full((p_max // block_m,), -1), 0
    for e in range(E):
        mine = (flat == e).nonzero().flatten()                              # expert e's slots, increasing
        slots[pos:pos + len(mine)] = mine.to(torch.int32)
        n = -(-len(mine) // block_m) * block_m                              # padded to block_m
        blocks[pos // block_m:(pos + n) // block_m] = e
        pos += n
    return slots, blocks.to(torch.int32), torch.tensor([pos], dtype=torch.int32)


ids_37 = routing_batch(37, 60, 4, skew=0.2, seed=3)[0][1]
for name, ids_, E_, bm in (("M5 E6 top2, BLOCK_M 16", ids_s, E_S, 16), ("M37 E60 top4, BLOCK_M 16", ids_37, 60, 16),
                           ("M37 E60 top4, BLOCK_M 32", ids_37, 60, 32)):
    got = [t.cpu() for t in moe.align(ids_.to(DEVICE), E_, bm)]
    for against, want in (("reference.align", reference.align(ids_.to(DEVICE), E_, bm)),
                          ("by hand", align_by_hand(ids_, E_, bm))):
        same = all(torch.equal(a, b.cpu()) for a, b in zip(got, want))
        print(f"{name:<26} moe.align vs {against:<16} bit-identical: {same}")

# %%
# NBVAL_IGNORE_OUTPUT
from matplotlib.colors import ListedColormap


def plot_sorted_slots(ax, sorted_slots, block_expert, S, top_k, block_m, E):
    """One cell per entry of sorted_slots, a row per row block, coloured by the block's expert; grey: padding."""
    blocks = sorted_slots.numel() // block_m
    codes = np.zeros((blocks, block_m), dtype=int)                        # 0: unused block, 1: padding, 2 + e
    for b in range(blocks):
        e = int(block_expert[b])
        if e >= 0:
            codes[b] = np.where(sorted_slots[b * block_m:(b + 1) * block_m].numpy() < S, 2 + e, 1)
    colors = ["white", "0.88"] + [plt.cm.tab10(e % 10) for e in range(E)]
    ax.imshow(codes, cmap=ListedColormap(colors), vmin=-0.5, vmax=len(colors) - 0.5, aspect="auto")
    for b in range(blocks):
        for r in range(block_m):
            s = int(sorted_slots[b * block_m + r])
            if s < S:
                ax.text(r, b, f"{s}\nt{s // top_k}", ha="center", va="center", fontsize=6)
    ax.set_yticks(range(blocks), [f"block {b}: expert {int(block_expert[b])}" if block_expert[b] >= 0
                                  else f"block {b}: -1 (exits)" for b in range(blocks)])
    ax.set_xticks(range(block_m))
    ax.set_xlabel("row in the tile (cell: slot, and its token t = slot // k; grey: sentinel padding)")


fig, ax = plt.subplots(figsize=(11, 3.4))
plot_sorted_slots(ax, sorted_slots.cpu(), block_expert.cpu(), S, K_S, BM, E_S)
ax.set_title("sorted_slots of the example, M = 5, E = 6, k = 2, BLOCK_M = 16", fontsize=10)
plt.tight_layout()
plt.show()


# %% [markdown]
# Padding is the price: here 10 real rows in 64 computed. At Qwen3.5's decode batches it would be worse still
# (8 slots over 8 experts: 8 rows in 128), which is why a decode step skips the align step altogether
# (section 4). With 4096 tokens an expert averages 128 slots and the waste is a few percent.
#
# On the GPU the package's align is three small kernels (count per chunk of 1,024 slots, prefix sums, a stable
# scatter through a sort of `expert * CHUNK + i` keys), one kernel when all slots fit one chunk; no atomics, so
# the same ids always give the same bits (`lynn_kernels/moe/triton_align.py`).

# %% [markdown]
# ## 4. The grouped kernel
#
# ### 4a. A toy grouped GEMM, step by step
#
# Two launches over the align step's row blocks, grid `(row blocks, N tiles)`:
#
# * **gate_up**, program `(pid_m, pid_n)`: reads its expert `e = block_expert[pid_m]` (and exits at `-1`), its
#   rows' slots from `sorted_slots`, and for each real slot the token row `x[slot // k]`; it accumulates **gate
#   and up together** (rows `n` and `I + n` of `w13[e]`, the same x tile feeding two dots), and applies
#   `silu(gate) * up` in the epilogue, so the `[rows, 2I]` product never reaches memory. It stores `h` at its own
#   rows (sorted order: no scatter).
# * **down**, program `(pid_m, pid_n)`: the same rows of `h` against `w2[e]`, times the routing weight of each
#   slot, stored to `out_slots[slot]`: every slot is written by exactly one program.
# * **combine**: `out[t] = sum_j out_slots[t k + j]`, in the order `j = 0 .. k-1`. No float atomics anywhere,
#   so two runs give the same bits (an `atomic_add` combine would add in arrival order).
#
# The toy below does exactly this with fp32 weights already dequantised and plain pointer arithmetic (fp32
# `tl.dot`, `input_precision="ieee"`, which the interpreter and a GPU both run); the combine is done in torch.

# %%
@triton.jit
def _toy_gate_up_kernel(x_ptr, w13_ptr, sorted_ptr, expert_ptr, h_ptr, S, H, I,
                        TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)                                            # a row block of sorted_slots
    pid_n = tl.program_id(1)                                            # a tile of the I intermediate columns
    e = tl.load(expert_ptr + pid_m)
    if e < 0:                                                           # past num_padded: nothing to do
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)                      # [BLOCK_M] rows of sorted_slots and h
    slot = tl.load(sorted_ptr + rows)
    valid = slot < S                                                    # padding rows hold the sentinel S
    token = slot // TOP_K                                               # the x row of each slot
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < I
    w_e = w13_ptr + e * (2 * I) * H                                     # expert e of [E, 2I, H]
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < H
        xt = tl.load(x_ptr + token[:, None] * H + offs_k[None, :],
                     mask=valid[:, None] & mask_k[None, :], other=0.0)      # [BLOCK_M, BLOCK_K] gathered rows
        w_mask = mask_k[:, None] & mask_n[None, :]
        wg = tl.load(w_e + offs_n[None, :] * H + offs_k[:, None], mask=w_mask, other=0.0)        # gate [K, N]
        wu = tl.load(w_e + (I + offs_n[None, :]) * H + offs_k[:, None], mask=w_mask, other=0.0)  # up   [K, N]
        acc_gate = tl.dot(xt, wg, acc_gate, input_precision="ieee")
        acc_up = tl.dot(xt, wu, acc_up, input_precision="ieee")
    h = acc_gate * tl.sigmoid(acc_gate) * acc_up                        # silu(gate) * up, in the epilogue
    tl.store(h_ptr + rows[:, None] * I + offs_n[None, :], h, mask=valid[:, None] & mask_n[None, :])


@triton.jit
def _toy_down_kernel(h_ptr, w2_ptr, sorted_ptr, expert_ptr, weights_ptr, out_ptr, S, H, I,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)                                            # a tile of the H output columns
    e = tl.load(expert_ptr + pid_m)
    if e < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slot = tl.load(sorted_ptr + rows)
    valid = slot < S
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < H
    w_e = w2_ptr + e * H * I                                            # expert e of [E, H, I]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < I
        ht = tl.load(h_ptr + rows[:, None] * I + offs_k[None, :], mask=valid[:, None] & mask_k[None, :],
                     other=0.0)                                         # [BLOCK_M, BLOCK_K]
        wt = tl.load(w_e + offs_n[None, :] * I + offs_k[:, None], mask=mask_k[:, None] & mask_n[None, :],
                     other=0.0)                                         # [BLOCK_K, BLOCK_N]
        acc = tl.dot(ht, wt, acc, input_precision="ieee")
    w = tl.load(weights_ptr + slot, mask=valid, other=0.0)              # routing weight of each slot
    tl.store(out_ptr + slot[:, None] * H + offs_n[None, :], acc * w[:, None],
             mask=valid[:, None] & mask_n[None, :])


def toy_moe_experts(x, weights, ids, w13_f, w2_f, block_m=16, block_n=32, block_k=32):
    """x [M, H] fp32, weights [M, k] fp32, ids [M, k], w13_f [E, 2I, H] and w2_f [E, H, I] fp32 (dequantised)."""
    M, H = x.shape
    top_k, E, I = ids.shape[1], w13_f.shape[0], w2_f.shape[-1]
    S = M * top_k
    sorted_slots, block_expert, num_padded = moe.align(ids, E, block_m)
    h = torch.zeros((sorted_slots.numel(), I), device=x.device)              # sorted order
    out_slots = torch.full((S, H), float("nan"), device=x.device)            # NaN: a slot never written shows
    blocks = block_expert.numel()
    _toy_gate_up_kernel[(blocks, triton.cdiv(I, block_n))](
        x, w13_f, sorted_slots, block_expert, h, S, H, I,
        TOP_K=top_k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    _toy_down_kernel[(blocks, triton.cdiv(H, block_n))](
        h, w2_f, sorted_slots, block_expert, weights.reshape(-1).contiguous(), out_slots, S, H, I,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    out = out_slots[0::top_k].clone()                                        # the ordered combine
    for j in range(1, top_k):
        out += out_slots[j::top_k]
    used = int(num_padded) // block_m
    print(f"grid ({blocks} row blocks x {triton.cdiv(I, block_n)} / {triton.cdiv(H, block_n)} N tiles): "
          f"{used} blocks used, {blocks - used} exit at once; {S} real rows of {used * block_m} computed")
    return out


E_T, K_T, M_T, H_T, I_T = 6, 2, 5, 64, 32
w13_t, w2_t = experts(E_T, H_T, I_T, seed=11)
x_t = randn(M_T, H_T, seed=12).to(DEVICE)
w_t = torch.tensor([[0.7, 0.3], [0.6, 0.4], [0.5, 0.5], [0.8, 0.2], [0.9, 0.1]]).to(DEVICE)
ids_t = ids_s.to(DEVICE)                                                     # the routing of section 3
toy = toy_moe_experts(x_t, w_t, ids_t, dq(w13_t), dq(w2_t))
want_t = reference.moe_experts(x_t, w_t, ids_t, w13_t, w2_t)
print("toy vs moe.reference.moe_experts (fp32): max_abs", r3(compare(toy, want_t).max_abs),
      "| rel_l2", r3(compare(toy, want_t).rel_l2))

# %% [markdown]
# ### 4b. The package's kernels
#
# `moe.moe_experts(x, weights, ids, w13, w2)` is the toy grown up (`lynn_kernels/moe/triton_experts.py`):
#
# * the weights stay **NVFP4**: each program decodes its `[BLOCK_N, BLOCK_K]` weight tile from codes and E4M3
#   scales in registers (the matmul family's `w_tile`, notebook 02) and feeds a bf16 `tl.dot` on the GPU (fp32
#   under the interpreter); the expert's global scale multiplies the fp32 accumulator once, in the epilogue;
# * it computes `x_tile @ W_tile^T`: the token rows are the dot's first operand and the decoded weight tile is
#   transposed into the second, which Hopper's wgmma reads from shared memory, so the kernel can pipeline its loads
#   (a decoded tile as the *first* operand stays in registers, where Triton 3.6 pipelines it unsafely);
# * `h = silu(gate) * up` is rounded once to x's dtype; everything else is fp32 up to the single output rounding;
# * `BLOCK_M` follows the expected rows per expert (16, 64 or 128: `block_m_for`), and the grid is sized by the
#   static bound `P_max`;
# * **decode path** (`M <= 16`): no align step and no combine launch. A slot is one row of x against one expert:
#   on tensor cores it would be 1 row of a 16-row tile, and the work is decoding the weight. So the decode kernels
#   multiply on the FMA units, on the weight tile split into its even and odd columns (`w_halves`: a byte's two
#   nibbles stay in the thread that loaded it). `_moe_decode_gate_up_kernel` runs one program per (slot, block of
#   I); `_moe_decode_down_kernel` one per (token, block of H), with all `top_k` slots of the token in one
#   `[top_k, BLOCK_N, BLOCK_K]` tile per step so their loads overlap, summed in a fixed order: the combine is
#   done in the same program;
# * `moe_block` adds the router (for `M <= 16` the logits GEMM and the routing are **one launch**: programs over
#   expert blocks and H slices write fp32 partial logits, and the last one to take a ticket adds them in order
#   and routes) and the shared expert (the same kernels in a dense mode: token rows, one expert), added before
#   the single rounding.
#
# How a prefill program finds its rows, shared by both prefill GEMM kernels:

# %%
# NBVAL_IGNORE_OUTPUT
print(inspect.getsource(triton_experts._row_block.fn))

# %% [markdown]
# The package's op on the toy's inputs (fp32 x: the same numbers up to the summation order), and twice on the same
# bf16 inputs (the same bits: no atomics):

# %%
got_t = moe.moe_experts(x_t, w_t, ids_t, w13_t, w2_t)
print("moe.moe_experts vs the toy (fp32): max_abs", r3(compare(got_t, toy).max_abs))
for M_ in (5, 40):
    ids_d = routing_batch(M_, E_T, K_T, skew=0.0, seed=M_)[0][1]
    w_d = torch.full((M_, K_T), 1 / K_T, device=DEVICE)
    xb = randn(M_, H_T, seed=M_).to(BF16).to(DEVICE)
    a, b = (moe.moe_experts(xb, w_d, ids_d, w13_t, w2_t) for _ in range(2))
    path = "decode" if M_ <= triton_experts.DECODE_MAX_M else "prefill"
    print(f"M={M_} ({path} path), two runs: {bit_mismatches(a, b)} elements differ in their bits")

# %% [markdown]
# **Grids at the Qwen3.5 shape** (E = 256, top-8, H = 2048, I = 512), from the package's own rules and its GPU
# tile configs: the decode path launches one gate_up program per (slot, block of I) and one down program per
# (token, block of H); the prefill path launches `P_max / BLOCK_M` row blocks, of which those past `num_padded`
# exit at once.

# %%
grid_rows = []
for M_ in (1, 4, 16, 17, 512, 4096):
    S_ = M_ * TOP_K
    if M_ <= triton_experts.DECODE_MAX_M:
        up = triton_experts_decode.DECODE_UP_CONFIGS[M_ > 2]
        down = triton_experts_decode.DECODE_DOWN_CONFIGS[M_ > 2]
        grid_rows.append({"M": M_, "path": "decode (FMA, no align)", "slots": S_, "BLOCK_M": "-",
                          "gate_up programs": S_ * triton.cdiv(I, up["BLOCK_N"]),
                          "down programs": M_ * triton.cdiv(H, down["BLOCK_N"]),
                          "BLOCK_N up / down": f"{up['BLOCK_N']} / {down['BLOCK_N']}"})
    else:
        bm = triton_experts.block_m_for(M_, TOP_K, E)
        cfg = triton_experts.prefill_config(M_, bm)
        blocks = spec.max_padded(S_, E, bm) // bm
        grid_rows.append({"M": M_, "path": "prefill (align, tl.dot)", "slots": S_, "BLOCK_M": bm,
                          "gate_up programs": blocks * triton.cdiv(I, cfg["BLOCK_N"]),
                          "down programs": blocks * triton.cdiv(H, cfg["BLOCK_N"]),
                          "BLOCK_N up / down": f"{cfg['BLOCK_N']} / {cfg['BLOCK_N']}"})
print(render_table(grid_rows))


# %% [markdown]
# The first decode path ran the prefill kernels with one real row per 16-row tile: at M = 1 its gate_up had 64
# programs for the H200's 132 SMs and read its 9.4 MB at 360 GB/s. The FMA kernels launch 512 gate_up programs
# at M = 1; section 6 shows what that bought.

# %% [markdown]
# ## 5. Validation
#
# Every row below compares a kernel output with the fp32 reference (computed from the same dequantised weights)
# using the one comparison helper, `lynn_kernels.compare`. For bf16 x the reference is the exact fp32 answer and
# `err_ratio` divides the kernel's error by that of the **same block computed plainly in bf16** (HF's way: bf16
# weights, bf16 products, a bf16 sum), so below 1 means more accurate than a bf16 model. Gates (those of
# `tests/test_moe.py`): bf16, cosine >= 0.9999, rel_l2 <= 4e-3 and err_ratio < 1; fp32, rel_l2 <= 1e-5. The cases:
# both paths and the boundary between them (M = 16 | 17), an expert with no tokens, every token on one expert,
# top-1, E = 7, and the whole block with its shared expert.

# %%
def bf16_experts(x, weights, ids, w13, w2):
    """The routed experts computed plainly in bf16 (as a bf16 HF model does), from the same dequantised weights."""
    xb, out = x.to(BF16), torch.zeros(x.shape, dtype=BF16, device=x.device)
    w13b, w2b = dq(w13, BF16), dq(w2, BF16)
    for e in range(w13b.shape[0]):
        t, j = torch.where(ids == e)
        if t.numel():
            gate, up = (xb[t] @ w13b[e].T).chunk(2, dim=-1)
            out.index_add_(0, t, (F.silu(gate) * up) @ w2b[e].T * weights[t, j, None].to(BF16))
    return out


def vrow(op, case, got, exact, baseline=None):
    m = compare(got, exact, baseline=baseline)
    if got.dtype == FP32:
        ok = m.rel_l2 <= 1e-5
    else:
        ok = m.cosine >= 0.9999 and m.rel_l2 <= 4e-3 and (m.err_ratio is None or m.err_ratio < 1)
    path = "decode" if got.reshape(-1, got.shape[-1]).shape[0] <= triton_experts.DECODE_MAX_M else "prefill"
    return {"op": op, "case": case, "path": path, "metrics": m, "passed": bool(ok)}


def ids_from(M, top_k, E, seed, pool=None):
    """top_k distinct experts per token, or (pool) drawn with repetition from a list of experts."""
    g = torch.Generator().manual_seed(seed)
    if pool is None:
        ids = torch.rand(M, E, generator=g).argsort(dim=-1)[:, :top_k]
    else:
        ids = torch.tensor(pool)[torch.randint(0, len(pool), (M, top_k), generator=g)]
    w = torch.rand(M, top_k, generator=g) + 0.1
    return (w / w.sum(-1, keepdim=True)).to(DEVICE), ids.to(torch.int32).to(DEVICE)


EXPERT_CASES = [  # (case, M, top_k, E, H, I, expert pool, x dtype)
    ("M1 E7 top2", 1, 2, 7, 64, 48, None, BF16),
    ("M16 E7 top3", 16, 3, 7, 80, 48, None, BF16),
    ("M17 E7 top3", 17, 3, 7, 80, 48, None, BF16),
    ("M40 E6 top4, experts 1 and 4 empty", 40, 4, 6, 128, 64, [0, 2, 3, 5], BF16),
    ("M33 E6 top2, all on expert 4", 33, 2, 6, 64, 32, [4], BF16),
    ("M20 E7 top1", 20, 1, 7, 64, 64, None, BF16),
    ("M40 E7 top2, fp32 x", 40, 2, 7, 64, 48, None, FP32),
]
val_rows = []
for case, M_, k_, E_, H_, I_, pool, dtype in EXPERT_CASES:
    w13_v, w2_v = experts(E_, H_, I_, seed=M_ + E_)
    w_v, ids_v = ids_from(M_, k_, E_, seed=M_, pool=pool)
    x_v = randn(M_, H_, seed=M_ + 1).to(dtype).to(DEVICE)
    exact = reference.moe_experts(x_v.float(), w_v, ids_v, w13_v, w2_v)      # x is exact in fp32: unrounded
    base = bf16_experts(x_v, w_v, ids_v, w13_v, w2_v) if dtype == BF16 else None
    val_rows.append(vrow("moe_experts", case, moe.moe_experts(x_v, w_v, ids_v, w13_v, w2_v), exact, base))


# %% [markdown]
# The block adds the router and the shared expert. Its exact fp32 answer keeps the routing of the reference
# (logits rounded to x's dtype, as HF's bf16 router), then computes the experts and the shared expert in fp32; the
# bf16 baseline computes both in bf16:

# %%
def shared_ffn(H, Is, seed):
    s13, s2 = (w[0] for w in experts(1, H, Is, seed=seed))
    return SharedExpert(s13, s2, randn(1, H, seed=seed + 2, scale=0.1).to(DEVICE))


def block_exact_and_bf16(x, router, w13, w2, shared, top_k):
    """(the exact fp32 block, the block in plain bf16), with the reference's routing (bf16 logits)."""
    x2 = x.reshape(-1, x.shape[-1])
    logits = (x2.float() @ router.float().T).to(x.dtype)
    w, ids = reference.route(logits, top_k)
    exact = reference.moe_experts(x2.float(), w, ids, w13, w2) + reference.shared_expert(x2, shared)
    xb = x2.to(BF16)
    s13, s2 = dq(shared.w13, BF16), dq(shared.w2, BF16)
    gate, up = (xb @ s13.T).chunk(2, dim=-1)
    shared_b = torch.sigmoid(xb @ shared.gate_weight.to(BF16).T) * ((F.silu(gate) * up) @ s2.T)
    return exact.reshape(x.shape), (bf16_experts(x2, w, ids, w13, w2) + shared_b).reshape(x.shape)


for case, shape, E_, k_ in (("M3 E7 top2 + shared", (1, 3, 80), 7, 2),
                            ("M40 (2 x 20) E12 top3 + shared", (2, 20, 64), 12, 3)):
    H_ = shape[-1]
    w13_v, w2_v = experts(E_, H_, 48, seed=21)
    shared = shared_ffn(H_, 32, seed=23)
    router = randn(E_, H_, seed=25, scale=0.3).to(BF16).to(DEVICE)
    x_v = randn(*shape, seed=26).to(BF16).to(DEVICE)
    exact, base = block_exact_and_bf16(x_v, router, w13_v, w2_v, shared, k_)
    val_rows.append(vrow("moe_block", case, moe.moe_block(x_v, router, w13_v, w2_v, shared, top_k=k_), exact,
                         base))

# %% [markdown]
# **Against HF transformers.** HF's own `Qwen3_5MoeSparseMoeBlock` (and Qwen3-Next's, with `norm_topk_prob` off)
# on a tiny config (H 64, 12 experts, top-3, intermediate 32, shared 48), in fp32, its parameters loaded with our
# NVFP4 weights dequantised (`experts.gate_up_proj [E, 2I, H]` gate rows first, as `w13`). Both must agree to fp32
# summation order. Skipped if transformers is not installed.

# %%
try:
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock
    from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()     # not its notice that fla / causal-conv1d are absent (they need a GPU)
    HAVE_HF = True
except ImportError:
    HAVE_HF = False


def hf_row(block_cls, cfg, renormalize, tokens, name):
    E_, H_, I_, Is = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, \
        cfg.shared_expert_intermediate_size
    w13_h, w2_h = experts(E_, H_, I_, seed=31)
    shared = shared_ffn(H_, Is, seed=33)
    router = randn(E_, H_, seed=35)
    block = block_cls(cfg).eval()
    with torch.no_grad():
        block.gate.weight.copy_(router)
        block.experts.gate_up_proj.copy_(dq(w13_h).cpu())
        block.experts.down_proj.copy_(dq(w2_h).cpu())
        s13 = dq(shared.w13).cpu()
        block.shared_expert.gate_proj.weight.copy_(s13[:Is])
        block.shared_expert.up_proj.weight.copy_(s13[Is:])
        block.shared_expert.down_proj.weight.copy_(dq(shared.w2).cpu())
        block.shared_expert_gate.weight.copy_(shared.gate_weight.cpu())
        x = randn(1, tokens, H_, seed=37)
        want = block(x)
    got = moe.moe_block(x.to(DEVICE), router.to(DEVICE), w13_h, w2_h, shared, top_k=cfg.num_experts_per_tok,
                        renormalize=renormalize)
    row = vrow("moe_block", f"M{tokens} E{E_} top{cfg.num_experts_per_tok} + shared, fp32", got, want)
    return {**row, "vs": name}


if HAVE_HF:
    dims = dict(hidden_size=64, num_experts=12, num_experts_per_tok=3, moe_intermediate_size=32,
                shared_expert_intermediate_size=48, num_hidden_layers=1)
    for tokens in (5, 18):
        val_rows.append(hf_row(Qwen3_5MoeSparseMoeBlock, Qwen3_5MoeTextConfig(**dims), True, tokens,
                               "HF Qwen3.5-MoE block"))
    val_rows.append(hf_row(Qwen3NextSparseMoeBlock, Qwen3NextConfig(**dims, norm_topk_prob=False), False, 18,
                           "HF Qwen3-Next block (raw top-k)"))
else:
    print("transformers is not installed: the HF parity rows are skipped")

for r in val_rows:
    r.setdefault("vs", "fp32 reference")
print(render_table(rounded(val_rows), ["op", "case", "path", "vs", "cosine", "max_abs", "rel_l2", "err_ratio",
                                       "passed"]))
print(f"\n{sum(r['passed'] for r in val_rows)}/{len(val_rows)} passed")

# %% [markdown]
# `err_ratio` below 0.5: the kernels are about twice as accurate as a bf16 model, because they keep fp32 from the
# weight decode to the output and round only `h` and the result.
#
# `lynn check moe` runs the small, awkward cases the tests sweep (routing and align exactly, both expert paths, the
# block, and since then the packed block with its norm in the router's launch, `norm_moe_block`) with the same helper;
# on the H200 it passed 11/11 compiled when it had 11 rows (`docs/reliability.md`, GPU test runs). Its `err_ratio`
# divides by the error of the exact answer rounded once to bf16 (the best a bf16 output can be), hence about 1.3 rather
# than 0.4. Here, under this machine's backend:

# %%
from lynn_kernels import check

check_rows, check_seconds = check.run_checks(["moe"])
print(check.table(rounded(check_rows), columns=check.PORTABLE_COLUMNS))

# %%
# NBVAL_IGNORE_OUTPUT
print(f"{sum(r['passed'] for r in check_rows)}/{len(check_rows)} checks passed in {check_seconds:.1f} s "
      f"on backend {lk.backend()!r}")

# %% [markdown]
# ## 6. Profile on the H200
#
# `lynn bench moe.block` (`lynn_kernels/bench/moe.py`) times the routed block (router, routing, experts, combine;
# no shared expert) three ways, in one process, on the same weights (the bf16 ones are the NVFP4 tensors
# dequantised), the same router and the same rotating token sets (enough that the active experts exceed the L2
# three times over), each validated against the fp32 reference before it is timed:
#
# * `lynn moe_block (NVFP4)`: the package's kernels;
# * `torch._grouped_mm bf16 pipeline`: routing in torch, tokens sorted by expert (`argsort`, `bincount`), two
#   `torch._grouped_mm` calls with SiLU x up between them, the routing weights and `index_add_`
#   (`bench.moe.grouped_mm_moe`);
# * `eager per-expert loop bf16 (HF style)`: one `F.linear` pair per expert that received tokens
#   (`bench.moe.eager_moe`).
#
# Each is timed twice: **kernel time** (the sum of its CUDA kernels, from the profiler) and **call time** (the
# Python call, launches included). Bytes count the active experts' weights (0.5625 bytes a weight for NVFP4, 2 for
# bf16) plus x in and out; decode sizes (M <= 64) are held against the measured read ceiling, prefill against the
# bf16 matmul ceiling.
#
# **Goals (issue 6)**: at M = 1, at least **5x faster** than the `torch._grouped_mm` pipeline; at M = 4096, at least
# **0.8x its throughput**; both at the Qwen3.5 and Qwen3-Next shapes, M in {1, 4, 16, 64, 512, 4096}.
#
# On a GPU the next cell runs the quick benchmark live. The cells after it read the committed results,
# `data/bench/h200/moe.block.json` (the full run: both Qwen shapes, M in {1, 4, 16, 64, 512, 4096}) and
# `data/experiments/moe-profile/results.txt`; their output depends on the machine and on what is committed, so nbval does not check it.

# %%
# NBVAL_IGNORE_OUTPUT
from IPython.display import Markdown, display

from lynn_kernels.bench import load, report, result_table

LIVE = None
if torch.cuda.is_available():
    from lynn_kernels.bench import measure_ceilings
    from lynn_kernels.bench.harness import SCHEMA, provenance
    from lynn_kernels.bench.moe import bench_block

    live_ceilings = measure_ceilings()
    LIVE = {"schema": SCHEMA, "op": "moe.block", "provenance": provenance("notebook 03, quick run"),
            "ceilings": live_ceilings.as_dict(),
            "results": [r.as_dict() for r in bench_block(live_ceilings, quick=True)]}
    print(f"live on {LIVE['provenance']['gpu']} (quick)")
    print(result_table(LIVE, ["provider", "shape", "median_ms", "gbps", "tflops", "frac_of_ceiling"]))
else:
    print("no GPU: nothing is timed under the interpreter; below, the committed H200 results")

# %%
# NBVAL_IGNORE_OUTPUT
try:
    DOC = load("moe.block", gpu="h200")
    display(Markdown(report.markdown_timed("moe.block")))
except FileNotFoundError:
    DOC = LIVE
    print("no committed H200 results yet: run `lynn bench moe.block` on a GPU"
          + ("; showing this session's live quick run" if LIVE else ""))


# %% [markdown]
# Kernel time per provider at each batch size measured, with the floor our kernels could reach (dotted):

# %%
# NBVAL_IGNORE_OUTPUT
def by_provider(doc):
    """{M: {provider: {"kernel": row, "call": row}}} from a moe.block results document."""
    out = {}
    for p in report.timed_pairs(doc):
        out.setdefault(p["dims"]["M"], {})[p["provider"]] = p
    return out


SHORT = {"lynn moe_block (NVFP4)": "lynn (NVFP4)", "torch._grouped_mm bf16 pipeline": "_grouped_mm (bf16)",
         "eager per-expert loop bf16 (HF style)": "eager loop (bf16)"}

if DOC is None:
    print("nothing to plot: no results")
else:
    cells = by_provider(DOC)
    ncols = min(2, len(cells))                                 # two panels a row: each as wide as half the page
    nrows = -(-len(cells) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.5 * ncols, 2.9 * nrows), squeeze=False)
    for ax in axes.flat[len(cells):]:
        ax.set_visible(False)
    for k, (ax, (M_, provs)) in enumerate(zip(axes.flat, sorted(cells.items()))):
        names = [n for n in provs if "kernel" in provs[n]]
        kern = [provs[n]["kernel"]["median_ms"] * 1e3 for n in names]
        y = np.arange(len(names))
        ax.barh(y, kern, color=[f"C{i}" for i in range(len(names))])
        for yi, n, k_us in zip(y, names, kern):
            call = provs[n].get("call")
            label = f" {k_us:,.1f} us" + (f" (call {call['median_ms'] * 1e3:,.1f} us)" if call else "")
            ax.text(k_us, yi, label, va="center", fontsize=7)
        ours = provs[next((n for n in names if n.startswith("lynn")), names[0])]["kernel"]
        if ours["ceiling"] == "read_gbps":                                 # the floor of our bytes or flops
            floor_us = ours["bytes"] / (DOC["ceilings"]["read_gbps"] * 1e3)
            what = "NVFP4 bytes at the read ceiling"
        else:
            floor_us = ours["flops"] / (DOC["ceilings"]["bf16_tflops"] * 1e6)
            what = "flops at the bf16 matmul peak"
        ax.axvline(floor_us, c="k", ls=":", lw=1)
        ax.text(floor_us, len(names) - 0.45, f" floor {floor_us:,.1f} us: {what}", fontsize=7)
        ax.set_yticks(y, [SHORT.get(n, n) for n in names])
        ax.set_ylim(len(names) - 0.25, -0.6)                  # top to bottom, with room for the floor's note
        ax.set_xlim(0, max(kern) * 1.6)
        if k + ncols >= len(cells):                            # the bottom panel of each column
            ax.set_xlabel("kernel time, microseconds (median; call time in brackets)")
        ax.set_title(f"{provs[names[0]]['shape']}, M = {M_} ({DOC['provenance']['gpu']})", fontsize=10)
    plt.tight_layout()
    plt.show()

# %% [markdown]
# **Where the kernel time goes.** `data/experiments/moe-profile/results.txt` (written by
# a script since replaced by `experiments/op_profile.py`) lists every CUDA kernel of one `moe_block` call
# with its time, at M = 1, 16 and 4096. Grouped by role, with the read rate of the gate_up kernel at M = 1:

# %%
# NBVAL_IGNORE_OUTPUT
from pathlib import Path

PROFILE = Path(lk.__file__).resolve().parents[1] / "data" / "experiments" / "moe-profile" / "results.txt"


def role(name):
    if name.startswith("_align"):
        return "align (3 kernels)"
    if name == "_router_kernel":
        return "router logits + route (1 launch)"
    if name.startswith("_"):           # the decode and prefill kernels of one role share a column
        return name.removeprefix("_").removesuffix("_kernel").replace("moe_", "").replace("decode_", "")
    if any(s in name for s in ("gem", "nvjet", "cutlass", "cublas", "splitK")):   # names are cut at 60
        return "router logits GEMM (cuBLAS)"
    return "casts, elementwise (torch)"


def parse_profile(path):
    """{M: {role: us}} from lines 'M=1: name us; name us; ...' (kernel names cut at 50 characters)."""
    out = {}
    for line in path.read_text().splitlines():
        if not line.startswith("M="):
            continue
        head, rest = line.split(":", 1)
        acc = out.setdefault(int(head[2:]), {})
        for item in rest.split(";"):
            name, us = item.strip().rsplit(" ", 1)
            acc[role(name)] = acc.get(role(name), 0.0) + float(us)
    return out


PROF = parse_profile(PROFILE) if PROFILE.exists() else {}
if not PROF:
    print("no committed profile yet (data/experiments/moe-profile/results.txt)")
else:
    ORDER = ["gate_up", "down", "combine", "router logits + route (1 launch)", "route", "align (3 kernels)",
             "router logits GEMM (cuBLAS)"]
    roles = sorted(dict.fromkeys(r for per_m in PROF.values() for r in per_m),
                   key=lambda r: ORDER.index(r) if r in ORDER else len(ORDER))
    table = []
    for M_, per_m in sorted(PROF.items()):
        total = sum(per_m.values())
        table.append({"M": M_, **{r: f"{per_m[r]:.1f} ({per_m[r] / total:.0%})" if r in per_m else "-"
                                  for r in roles},
                      "total us": round(total, 1)})
    print(render_table(table))
    gate_up_bytes = TOP_K * 2 * I * H * NVFP4_BYTES
    if 1 in PROF:
        us = PROF[1]["gate_up"]
        print(f"\nM = 1: gate_up reads {TOP_K} experts x {2 * I} rows x {H} = {gate_up_bytes / 1e6:.1f} MB in "
              f"{us:.1f} us = {gate_up_bytes / us / 1e3:,.0f} GB/s, with {grid_rows[0]['gate_up programs']} "
              f"programs on {DOC['provenance'].get('sms', '?') if DOC else '?'} SMs")

    fig, ax = plt.subplots(figsize=(11, 2.8))
    Ms = sorted(PROF)
    for i, M_ in enumerate(Ms):
        total, left = sum(PROF[M_].values()), 0.0
        for j, r in enumerate(roles):
            share = PROF[M_].get(r, 0.0) / total
            ax.barh(i, share, left=left, color=f"C{j}", label=r if i == 0 else None)
            left += share
    ax.set_yticks(range(len(Ms)), [f"M = {m}\n{sum(PROF[m].values()):,.0f} us" for m in Ms])
    ax.set_xlabel("share of the call's kernel time")
    ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.3), frameon=False)
    plt.tight_layout()
    plt.show()

# %% [markdown]
# The goals, judged on whatever results are present (a goal whose cell was not measured says so):

# %%
# NBVAL_IGNORE_OUTPUT
from lynn_kernels.bench.moe import MS as BENCH_MS
from lynn_kernels.bench.moe import SHAPES as BENCH_SHAPES

GOALS = {1: (">= 5x the _grouped_mm pipeline", 5.0), 4096: (">= 0.8x its throughput", 0.8)}
BASE, OURS = "torch._grouped_mm bf16 pipeline", "lynn moe_block (NVFP4)"
measured = {}
for p in report.timed_pairs(DOC) if DOC is not None else []:
    measured.setdefault((p["shape"], p["dims"]["M"]), {})[p["provider"]] = p
goal_rows = []
for label, *_ in BENCH_SHAPES:                        # every cell the full benchmark covers
    for M_ in BENCH_MS:
        goal, need = GOALS.get(M_, ("-", None))
        cell = measured.get((label, M_), {})
        if OURS not in cell or BASE not in cell:
            goal_rows.append({"shape": label, "M": M_, "goal": goal, "measured": "-", "verdict": "not measured"})
            continue
        kernel = cell[BASE]["kernel"]["median_ms"] / cell[OURS]["kernel"]["median_ms"]
        call = cell[BASE]["call"]["median_ms"] / cell[OURS]["call"]["median_ms"]
        verdict = "-" if need is None else ("met" if kernel >= need else "not met")
        goal_rows.append({"shape": label, "M": M_, "goal": goal, "verdict": verdict,
                          "measured": f"{kernel:.2f}x by kernel time, {call:.2f}x by call time"})
print(render_table(goal_rows, ["shape", "M", "goal", "measured", "verdict"]))


# %% [markdown]
# **Where it stands** (the committed full run of 2026-11-29, commit c2c8d10):
#
# * **M = 1, not met at either shape.** Qwen3.5: 22.1 us of kernels against the pipeline's 93.6 us (4.24x; the
#   calls 226.6 against 564.2 us, 2.49x). Qwen3-Next: 34.6 against 108.8 us (3.14x; calls 3.11x). The first
#   version (commit 9373b79) took 47.0 us at the Qwen3.5 shape. Three changes made up the difference. The FMA
#   decode kernels took gate_up from 26.1 to 8.5 us. Down and the combine became one kernel (6.9 + 1.5 to
#   7.1 us). The router logits and the routing became one launch (6.1 + 2.4 + 3.2 to 6.5 us). 22 us is 15.8% of
#   the read ceiling. The decode kernels are bound by the decode arithmetic, not by memory: at M = 16, with
#   programs to spare, gate_up decodes weights at about 1.6 TB/s worth of NVFP4 bytes, and no tile in the sweeps
#   did better.
# * **M = 4096, met at both shapes.** Qwen3.5: 121.0 against 115.7 TFLOP/s (1.05x). Qwen3-Next: 98.5 against
#   108.3 TFLOP/s (0.91x). The goal is 0.8x.
# * **In between** (no goal): by kernel time the block is 1.30-2.80x faster than the pipeline at M = 4 to 512, at
#   both shapes.
#
# `docs/moe.md` section 4 and `docs/history/moe.md` keep the same record, with what was tried.

# %% [markdown]
# ### 6b. Packed experts, and the shared expert as one more slot
#
# The decoder loads its experts in a second layout, made once at load time: `moe.pack_experts(w13, w2, shared)`
# lays every expert out as the packed projections of notebook 02 are laid out (eight codes to an int32 word in the
# tensor cores' operand order, scales re-encoded so a shift decodes them) and stacks them (`PackedExperts`). The
# decode kernels then multiply on the FMA units with the packed GEMV's word decode (13 integer operations for 8
# weights instead of about 26).
#
# The shared expert of every released Qwen3-Next / Qwen3.5 / Qwen3.6 model has the routed experts' size, so
# `pack_experts` appends it to the stacks as **expert E**. Then a decode step needs no launches of its own for it.
# The router writes one more routing column per token, id `E` with weight `sigmoid(x @ gate_weight)` (the gate is
# one more row of the router's product). gate_up and down then run `top_k + 1` slots per token: **three launches
# per MoE block** instead of five. Nothing changes in the math: the shared expert's output is multiplied by its
# gate and added to the routed ones, in fp32, rounded once.
#
# On a small block (fp32 x, so the kernels and the reference differ only in fp32 rounding), the packed block
# against the reference on the original checkpoint-layout weights, and which host functions the decode call took:

# %%
E_P, K_P, H_P, I_P = 6, 2, 128, 64
w13_p, w2_p = experts(E_P, H_P, I_P, seed=70)
s13_p, s2_p = experts(1, H_P, I_P, seed=72)
shared_p = SharedExpert(s13_p[0], s2_p[0], randn(1, H_P, seed=74, scale=0.1).to(DEVICE))
router_p = randn(E_P, H_P, seed=75, scale=0.3).to(DEVICE)
pw13, pw2, pshared = moe.pack_experts(w13_p, w2_p, shared_p)
print("w13:", pw13, "| words", tuple(pw13.words.shape), pw13.words.dtype, "| scales", tuple(pw13.scales.shape))
print("shared expert is expert E of the stacks:", moe.packed.shared_slot(pw13, pw2, pshared))
print("packing is exact:", torch.equal(dq(pw13.unpack()), dq(w13_p)) and torch.equal(dq(pw2.unpack()), dq(w2_p)))

for M_ in (1, 3, 20):
    x_p = randn(M_, H_P, seed=80 + M_).to(DEVICE)
    got_p = moe.moe_block(x_p, router_p, pw13, pw2, pshared, top_k=K_P)
    m_p = compare(got_p, reference.moe_block(x_p, router_p, w13_p, w2_p, shared_p, top_k=K_P))
    path = "decode: 3 launches" if M_ <= triton_experts.DECODE_MAX_M else "prefill: the shared expert on its own"
    print(f"M = {M_:2} ({path}): rel_l2 {r3(m_p.rel_l2)}")

# %% [markdown]
# What the router hands the expert kernels at a decode step: `top_k + 1` columns a token, the last one the shared
# expert (id `E` = 6) weighted by its gate `sigmoid(x @ gate_weight)`:

# %%
from lynn_kernels.moe.triton_route import launch_router

x_p = randn(2, H_P, seed=90).to(DEVICE)
w_slot = torch.empty((2, K_P + 1), device=DEVICE)
ids_slot = torch.empty((2, K_P + 1), dtype=torch.int32, device=DEVICE)
launch_router(x_p, router_p, K_P, True, w_slot, ids_slot, gate_weight=shared_p.gate_weight.reshape(-1),
              shared_slot=True)
print("ids:", ids_slot.tolist())
print("weights:", [[round(v, 4) for v in row] for row in w_slot.tolist()])
print("the last column is the shared gate:",
      torch.allclose(w_slot[:, -1], torch.sigmoid(x_p @ shared_p.gate_weight.reshape(-1)), rtol=1e-6, atol=0))

# %% [markdown]
# On the H200 (committed in `data/experiments/moe-packed-decode/results.json`): the same
# block in its three forms, per block, by CUDA-graph replay of 8 distinct blocks in a row (their experts come from
# HBM, not L2), each checked against the fp32 reference first:

# %%
# NBVAL_IGNORE_OUTPUT
import json

PACKED = Path(lk.__file__).resolve().parents[1] / "data" / "experiments" / "moe-packed-decode" / "results.json"
if PACKED.exists():
    pk = json.loads(PACKED.read_text())
    print(f"git {pk['provenance']['git_sha']}, {pk['provenance']['date'][:10]}, {pk['provenance']['gpu']}, "
          f"triton {pk['provenance']['triton']}")
    print(render_table([{"shape": r["shape"], "M": r["M"], "form": r["form"], "launches": round(r["kernels"]),
                         "us per block": round(r["graph_us"], 1), "cosine": round(r["cosine"], 6)}
                        for r in pk["forms"]]))
    forms = ["checkpoint", "packed", "packed + shared slot"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.2))
    for ax, shape in zip(axes, ("qwen3.5", "qwen3-next")):
        rows_ = [r for r in pk["forms"] if r["shape"] == shape]
        ms = sorted({r["M"] for r in rows_})
        for i, form in enumerate(forms):
            us = [next(r["graph_us"] for r in rows_ if r["M"] == m and r["form"] == form) for m in ms]
            ax.bar(np.arange(len(ms)) + (i - 1) * 0.27, us, 0.27, label=form)
        ax.set_xticks(np.arange(len(ms)), [f"M = {m}" for m in ms])
        ax.set_ylabel("us per MoE block (graph replay)")
        ax.set_title(shape)
    axes[0].legend(fontsize=8)
    plt.tight_layout()
    plt.show()
else:
    print("no committed results at data/experiments/moe-packed-decode/ (docs/history/moe.md says how they were made)")

# %% [markdown]
# At M = 1 the block went from 36.1 to 22.2 us at the Qwen3.5 shape, and from 50.1 to 29.4 us at the Qwen3-Next
# shape. The layout alone (packed, still five launches) gives 58% and 76% of that gain, the shared slot the rest.
# In the decoder (`lynn bench decoder`, notebook 06) the Qwen3.5 decode step went from 3.52 to 2.97 ms. The router
# (6.5 us for a 1 MB product) now takes about as long as either expert kernel (docs/moe.md, section 6).

# %% [markdown]
# ### 6c. Long prefills: `w13` decoded once
#
# In a long prefill every weight tile is read by many row blocks (512 rows an expert at 16,384 tokens of Qwen3.5),
# and the kernel decodes it again in each one: the gate_up kernel spends its time decoding, not multiplying. From
# `DECODED_MIN_ROWS` rows an expert on average, `launch_moe_experts` decodes the packed `w13` stack once into a
# workspace of x's dtype (the matmul's dequantise kernel: each element the exact tile the loop would decode) and
# gate_up loads those tiles. The tensor cores get the same values, so the output keeps its bits. On the block above
# (bf16 x, 40 tokens), both paths forced:

# %%
M_ = 40
x_d = randn(M_, H_P, seed=95).to(BF16).to(DEVICE)
w_d, ids_d = moe.route((x_d.float() @ router_p.t()).to(BF16), K_P)
outs = {}
for decoded in (False, True):
    ws_d = triton_experts.moe_workspace(M_, K_P, E_P, H_P, I_P, BF16, DEVICE)
    outs[decoded] = triton_experts.launch_moe_experts(x_d, w_d, ids_d, pw13, pw2, torch.empty_like(x_d), ws_d,
                                                      decoded=decoded)
print(f"rows an expert: {M_ * K_P / E_P:.1f}; the rule decodes from {triton_experts.DECODED_MIN_ROWS}: "
      f"{triton_experts.use_decoded_experts(M_, K_P, pw13, pw2, BF16)}")
print("decoded w13 vs the loop decode:", bit_mismatches(outs[True], outs[False]), "elements differ in their bits")
print(f"workspace at Qwen3.5-35B-A3B: 256 x {2 * 512} x 2048 bf16 = {256 * 2 * 512 * 2048 * 2 / 1e9:.2f} GB a call")

# %% [markdown]
# On an H100 (`experiments/moe_prefill_decoded.py`, `data/experiments/moe-prefill-decoded/`), in a 16,384-token
# prefill of Qwen3.5-35B-A3B the gate_up kernels took 53.6 ms instead of 87.7 (67% of the bf16 peak instead of 41%)
# for 20.1 ms of decoding: the prefill went from 375.3 to 365.8 ms. At Qwen3-Next-80B-A3B's 16,384 tokens (320 rows
# an expert, 512 experts to decode) the routed experts were slower decoded (5.51 ms against 5.29), which is where
# the rule's 512 rows comes from. docs/moe.md, section 3, has the table.

# %% [markdown]
# ### 6d. The programs' order
#
# Which programs share the GPU at one time decides what L2 can serve. With the row blocks of one column tile side by
# side, every row of x (gate_up) or h (down) comes from memory once per column tile: 16 times for the down kernel
# at H = 2,048, about 2 GB a layer at 16,384 tokens. The prefill GEMMs therefore run on a 1-D grid in which the
# column tiles of one row block are neighbours (`PREFILL_N_FIRST`); each row is read once, and no bit changes. On
# an H100 at 16,384 tokens of Qwen3.5-35B-A3B the routed experts took 3.41 ms instead of 3.71 (down 1.27 ms instead
# of 1.48) and the graph-captured prefill 347 ms instead of 363, with the same logits bit for bit (docs/moe.md,
# section 3).

# %% [markdown]
# ## 7. Explorer: expert load and padding
#
# `explore_load(M, top_k, skew, block_m)` routes `M` tokens over 256 experts with the package's `route` (logits as
# in section 2), and prints the load and what the align step would launch: padded rows `sum_e round_up(c_e,
# BLOCK_M)` against the `M k` real rows, for the chosen `BLOCK_M` and the one the kernel would choose. A fixed
# example first (checked), then the widgets, which draw the load of each expert (the histogram of section 2) and
# the padding for each tile height. The widget cell first draws a static comparison of three skews (loads sorted,
# busiest first), which is what a viewer without a live kernel sees.

# %%
def padded_rows(counts, block_m):
    return int(((counts + block_m - 1) // block_m * block_m).sum())


def explore_load(M, top_k, skew, block_m, E=256, seed=0):
    """(counts, text): the load of one routed batch and the align step's padding."""
    (_, ids), _ = routing_batch(M, E, top_k, skew, seed)
    counts, stats = load_stats(ids, E)
    S = M * top_k
    lines = [render_table([stats])]
    if M <= triton_experts.DECODE_MAX_M:
        lines.append(f"M = {M} <= {triton_experts.DECODE_MAX_M}: the kernel takes the decode path (no align, "
                     f"FMA kernels over the slots); if it aligned:")
    chosen = triton_experts.block_m_for(M, top_k, E)
    for bm in dict.fromkeys((block_m, chosen)):
        rows = padded_rows(counts, bm)
        lines.append(f"BLOCK_M {bm}{' (the kernel choice)' if bm == chosen else ''}: {rows:,} rows computed for "
                     f"{S:,} real ({rows / S:.2f}x), bound P_max {spec.max_padded(S, E, bm):,}")
    return counts, "\n".join(lines)


print(explore_load(512, 8, 0.2, 16)[1])

# %%
# NBVAL_IGNORE_OUTPUT
import ipywidgets as widgets
from IPython.display import display


def draw_load(ax_load, ax_pad, M, top_k, skew, block_m, counts, label=None, by_id=False):
    """Left: the load per expert (bars by expert id, or a line of the loads sorted); right: the padding."""
    if by_id:
        ax_load.bar(range(len(counts)), counts.numpy(), width=1.0)
        ax_load.set_xlabel("expert id")
    else:
        ax_load.plot(counts.sort(descending=True).values.numpy(), label=label)
        ax_load.set_xlabel("experts, busiest first")
    ax_load.axhline(M * top_k / len(counts), c="0.5", ls=":", lw=1)
    ax_load.set_ylabel("slots")
    ax_load.set_title(f"load: M = {M}, top-{top_k} over {len(counts)} experts (dotted: mean)", fontsize=10)
    bms = [16, 32, 64, 128]
    ax_pad.plot(bms, [padded_rows(counts, bm) / (M * top_k) for bm in bms], "o-", label=label)
    ax_pad.axhline(1, c="0.5", ls=":", lw=1)
    ax_pad.set_xscale("log", base=2)
    ax_pad.set_xticks(bms, [str(b) for b in bms])
    ax_pad.set_xlabel("BLOCK_M")
    ax_pad.set_ylabel("rows computed / real rows")
    ax_pad.set_title("padding of the align step", fontsize=10)


def show(M, top_k, skew, block_m):
    counts, text = explore_load(M, top_k, skew, block_m)
    print(text)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 3.6))
    draw_load(ax1, ax2, M, top_k, skew, block_m, counts, by_id=True)
    ax2.axvline(block_m, c="tab:red", lw=1)
    plt.tight_layout()
    plt.show()


# the static view (what a notebook viewer without a kernel shows): three routers at M = 512, top-8
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 3.6))
for skew in (0.0, 0.2, 0.5):
    draw_load(ax1, ax2, 512, 8, skew, 16, explore_load(512, 8, skew, 16)[0], label=f"skew {skew:g}")
ax1.legend(fontsize=8)
ax2.legend(fontsize=8)
plt.tight_layout()
plt.show()

style = {"description_width": "initial"}
controls = {
    "M": widgets.IntSlider(512, min=1, max=2048, description="tokens M", style=style, continuous_update=False),
    "top_k": widgets.IntSlider(8, min=1, max=16, description="top_k", style=style, continuous_update=False),
    "skew": widgets.FloatSlider(0.2, min=0.0, max=1.0, step=0.05, description="router skew", style=style,
                                continuous_update=False),
    "block_m": widgets.ToggleButtons(options=[16, 32, 64, 128], value=16, description="BLOCK_M", style=style),
}
c = list(controls.values())
out = widgets.interactive_output(show, controls)
display(widgets.VBox([widgets.HBox(c[:3]), c[3], out]))

# %% [markdown]
# Things to try: at skew 0, raise M from 16 to 2048 and watch the padding factor fall towards 1 (the reason
# `block_m_for` waits for 32, 64 and 257 rows per expert before choosing the 32-, 64- and 128-row tiles); at skew
# 1, see a handful of experts take most slots (on a GPU, one long row of tiles for them and many idle ones); drop
# to M = 1 and see why the decode path does not align at all.
#
# ## Pointers
#
# * `lynn check moe`: the routing, align, expert and block checks of section 5 on the current device (it exits
#   non-zero if one fails);
# * `lynn bench moe.block [--quick]` (GPU only): the benchmark of section 6, written to
#   `data/bench/<gpu>/moe.block.json`; `python -m lynn_kernels.bench.report moe.block` renders its table;
# * [`docs/moe.md`](../docs/moe.md): the math, the layouts and the performance record; `tests/test_moe.py`: the
#   tests (both paths, every `BLOCK_M`, poisoned outputs, HF parity, the errors a user sees).
