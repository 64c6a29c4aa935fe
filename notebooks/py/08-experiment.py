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
# # 08: Experiment: change a kernel, check it, race it, run the decoder on it
#
# Notebooks 01-07 explain the shipped kernels. This one is the loop for changing them, with `lynn_kernels.lab`:
# copy a kernel, change one thing, and ask three questions, one call each: is it still right (`lab.check`), is it
# faster than the shipped kernel and the vendor library (`lab.race`), and what does it do to the whole decoder
# (`lynn_model.lab.in_decoder`). `lynn race` asks the same from the command line. This notebook:
#
# 1. what a variant is, and the ops that take one
# 2. the RMSNorm kernel copied into a cell, one line moved, checked
# 3. a planted mistake, and how the check names it
# 4. the packed GEMV with one load moved by `lab.edit`, checked
# 5. the race: on a GPU variant vs shipped vs cuBLAS / torch; on a CPU the check and the committed figures
# 6. the decoder on a variant: the same tokens, or where they part
# 7. `lynn race` on the command line, and its exit status
#
# Everything runs on a CPU through Triton's interpreter; on a GPU the same cells run compiled and the race is timed.
# How the lab works inside: [`docs/lab.md`](../docs/lab.md).

# %%
import lynn_kernels  # noqa: I001  (first: it picks the backend before triton is imported)
import dataclasses
import difflib
import re
import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path

import torch
import triton
import triton.language as tl

from lynn_kernels import lab, matmul, norm, notebook, nvfp4, render_table, runtime
from lynn_kernels.metrics import bit_mismatches
from lynn_kernels.notebook import r3
from lynn_kernels.runtime import DEVICE, cast_output, pdl_enter, to_float32
from lynn_kernels.triton_shared import residual_rows, row_rstd
from lynn_model.lab import in_decoder


def below(floor):
    """3 significant digits, and anything under ``floor``, 0 included, as ``'< floor'``: round-off's digits move
    with the CPU's summation order (one CPU's max_abs 3.4e-05 is another's 2.3e-05, and a 16-bit output exact on
    one lands a step off on another), so nbval could not compare them."""
    return lambda v: f"< {floor:g}" if isinstance(v, (int, float)) and abs(v) < floor else r3(v)


# cosines to 6 decimals; errors and error ratios at round-off as '< 0.0001' and '< 0.001'
rounded = partial(notebook.rounded, cosine=notebook.decimals6, errors=below(1e-4), err_ratio=below(1e-3))


def show(report):
    """A check's table, rounded, and its verdict without the seconds it took (nbval compares the text)."""
    print(dataclasses.replace(report, rows=rounded(report.rows)).table())
    print(re.sub(r", [0-9.]+ s$", "", report.summary()))


# %%
# NBVAL_IGNORE_OUTPUT
print(lynn_kernels.device_summary())

# %% [markdown]
# ## 1. What a variant is
#
# A variant stands in for one public op, in one of two forms:
#
# * **a callable with the op's signature** (`rmsnorm(x, weight, eps=1e-6, *, residual=None, out=None,
#   residual_out=None)`): every call of the op goes to it, the decoder's included. Inside it the op is the shipped
#   one again, so a variant may wrap it;
# * **a `@triton.jit` kernel with the shipped kernel's parameters**, by name and in order: the op's own launcher
#   runs it, with the same grid, arguments and constexprs, so only the kernel body is the experiment.
#
# `lab.variant(op, fn)` makes one; `lab.using(v)` routes every call to it inside a `with` block (and counts them).
# The ops, and the kernels their launchers run (a kernel variant replaces the first unless `kernel=` names
# another); `bench` is the op's committed `lynn bench` results, which a race on a CPU shows:

# %%
print(render_table([{"op": op.name, "kernels": ", ".join(op.kernels), "bench": op.bench}
                    for op in lab.OPS.values()]))

# %% [markdown]
# A kernel whose parameters are not the shipped kernel's is refused before anything runs, with the difference named
# (the launcher passes some arguments by position and some by name, so both must match):

# %%
@triton.jit
def not_a_norm(x_ptr, y_ptr, D, BLOCK_D: tl.constexpr):
    """Too few parameters for the RMSNorm's launcher."""


try:
    lab.variant("rmsnorm", not_a_norm)
except TypeError as err:
    print(err)


# %% [markdown]
# ## 2. The RMSNorm, copied and changed
#
# The shipped `_rmsnorm_kernel` (`lynn_kernels/norm/triton_rmsnorm.py`, `docs/norm.md`): each program holds
# `BLOCK_R` whole rows in registers, adds the residual (`h = x + r`, rounded once to x's dtype, and stores `h` for
# the next layer), computes `rstd = 1 / sqrt(mean(h^2) + eps)` and writes `(h * rstd) * (1 + w)`; Qwen3.5 stores the
# norm weight zero-centred, hence `1 + w`. The copy below is the shipped source with its helpers imported by their
# public names; **one change**: the weight is loaded first, before the rows. It does not depend on the rows, so
# issuing its load first may hide its latency behind theirs; the arithmetic is the same, so the bits cannot change.
# Whether it is faster is a question for the race.

# %%
@triton.jit
def my_rmsnorm_kernel(
    x_ptr, r_ptr, w_ptr, y_ptr, h_ptr,
    R, D, eps,
    stride_xr, stride_rr, stride_yr, stride_hr,
    X_DTYPE: tl.constexpr, W_DTYPE: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, INTERPRET: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """``y = rmsnorm(h) * (1 + w)`` with ``h = x`` or ``h = x + r`` (then also stored to ``h_ptr``)."""
    pdl_enter(USE_PDL)
    pid_r = tl.program_id(0)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    mask_r = offs_r < R
    mask_d = offs_d < D
    mask = mask_r[:, None] & mask_d[None, :]
    rows = offs_r[:, None].to(tl.int64)
    # THE CHANGE: the weight's load first (the shipped kernel loads it after the rows)
    w1 = 1.0 + to_float32(tl.load(w_ptr + offs_d, mask=mask_d, other=0), W_DTYPE, INTERPRET)   # [BLOCK_D], fp32
    if HAS_RESIDUAL:
        h = residual_rows(x_ptr + rows * stride_xr, r_ptr + rows * stride_rr, offs_d[None, :], mask, X_DTYPE,
                          True, INTERPRET)                                           # [BLOCK_R, BLOCK_D]
        tl.store(h_ptr + rows * stride_hr + offs_d[None, :], cast_output(h, X_DTYPE, INTERPRET), mask=mask)
    else:
        h = residual_rows(x_ptr + rows * stride_xr, x_ptr, offs_d[None, :], mask, X_DTYPE, False, INTERPRET)
    rstd = row_rstd(h, D, eps)
    y = (h * rstd[:, None]) * w1[None, :]                     # HF: (x * rsqrt(.)) * (1 + w), in fp32, then the cast
    tl.store(y_ptr + rows * stride_yr + offs_d[None, :], cast_output(y, X_DTYPE, INTERPRET), mask=mask)


mine = lab.variant("rmsnorm", my_rmsnorm_kernel)
print(mine.op.name, "-> kernel", mine.kernel)

# %% [markdown]
# `lab.check(v)` runs the op's own `lynn check` matrix (`lynn_kernels/norm/check.py`: x in three dtypes, four rows
# from 1 x 16 to 4 x 2048, two of them with the residual, the weight in one of four dtypes; the same cases the tests
# sweep) with the variant routed in. `err_ratio` is the output's error over the error of the exact answer rounded to
# x's dtype (1: as good as an output of that dtype can be), and a row also needs every output within one step of
# the reference's (eight in fp32); the `residual` rows compare `h` bit for bit:

# %%
show(lab.check(mine))

# %% [markdown]
# What changed in the output: nothing. The same inputs through the shipped op and through the variant
# (`lab.using` counts the calls it routed):

# %%
gen = torch.Generator().manual_seed(0)
x, r = (torch.randn(8, 2048, generator=gen).to(torch.bfloat16).to(DEVICE) for _ in range(2))
w = (0.2 * torch.randn(2048, generator=gen)).to(torch.bfloat16).to(DEVICE)
y_ship, h_ship = norm.rmsnorm(x, w, 1e-6, residual=r)
with lab.using(mine) as calls:
    y_mine, h_mine = norm.rmsnorm(x, w, 1e-6, residual=r)
print(f"routed calls {dict(calls)}; bits that differ: y {bit_mismatches(y_mine, y_ship)}, "
      f"h {bit_mismatches(h_mine, h_ship)}")

# %% [markdown]
# ## 3. A planted mistake
#
# The slip the zero-centred weight invites: multiplying by `w` instead of `1 + w`, as most RMSNorms do.
# `lab.edit(kernel, {old: new})` makes such a copy without pasting the source: the shipped kernel with each `old`
# (text that must occur exactly once) replaced, compiled beside the shipped one so its helpers are in reach:

# %%
no_one = lab.edit("norm.rmsnorm", {"w1 = 1.0 + to_float32(": "w1 = to_float32("}, name="rmsnorm_without_one")
bad = lab.check("rmsnorm", no_one)
show(bad)
print("\nfirst failure:", rounded(bad.failures[:1])[0])

# %% [markdown]
# The check names each case that fails and the metric that fails it: every `y` row has a cosine far from 1 (the
# output is not the op's at all) and, in 16-bit dtypes, an `err_ratio` in the hundreds or thousands, while the
# `residual` rows still pass: `h` never touches the weight. A variant fails if any row fails; a variant that never
# ran in any case fails too (it was not tested).
#
# ## 4. The packed GEMV, one load moved
#
# The decode projections run the packed GEMV (`packed_gemv_kernel` in `lynn_kernels/matmul/triton_packed.py`,
# notebook 02, section 4). Each program streams its weight tiles in steps of `TW` words, and the loop **prefetches**:
# it loads the next step's words (`q_next, v_next = load_words(...)`) before it decodes and multiplies the current
# ones, so the load is in flight during the arithmetic. The experiment: move that load to the end of the step, after
# the FMAs, which is what a kernel without the prefetch would do. The bits cannot change (the same words meet the
# same arithmetic); the time might. `lab.edit` makes the copy, and its source shows the move:

# %%
PREFETCH = """        q_next, v_next = load_words(words_ptr + rows1[:, None].to(tl.int64) * KW, scales_ptr, rows1,
                                     (rows1 < N)[:, None], k1, offs, offs_s, KW, EVEN)
"""
ROTATE = "        q, v = q_next, v_next\n"
late_load = lab.edit("matmul.packed_gemv", {PREFETCH: "", ROTATE: PREFETCH + ROTATE}, name="gemv_late_load")

shipped_src = lab.source_of(runtime.KERNELS["matmul.packed_gemv"].shipped).splitlines()
edited_src = lab.source_of(late_load).splitlines()
diff = difflib.unified_diff(shipped_src[1:], edited_src, "shipped", "edited", n=1, lineterm="")  # [1:]: no decorator
print("\n".join(line for line in diff if not line.startswith("@@")))

# %% [markdown]
# `lab.check("nvfp4_linear", late_load)` names the op; the kernel it replaces is the op's first, `matmul.packed_gemv`.
# The matmul check matrix has eighteen cases; the packed GEMV runs in ten of them (one and two rows of x at several
# widths and dtypes, those with the RMSNorm folded in too); the others have more rows and go to the tensor-core
# kernels. The table keeps every row of those ten cases: a case reports what the kernel did under the names of the ops
# it serves (the `norm_linear` rows are the norm folded into this GEMV), beside rows of the same case that took other
# kernels:

# %%
gemv = lab.variant("nvfp4_linear", late_load)
show(lab.check(gemv))

# %% [markdown]
# Every row is within round-off of the reference (notebook 02, section 1: the decoded weights are exact and the sums
# are fp32; only the order of the sums differs). And against the shipped kernel on a decode shape of the real model
# (a 2048 -> 512 projection), bit for bit:

# %%
gen = torch.Generator().manual_seed(1)
packed = matmul.pack(nvfp4.quantize(torch.randn(512, 2048, generator=gen).to(torch.bfloat16).to(DEVICE)))
x1 = torch.randn(1, 2048, generator=gen).to(torch.bfloat16).to(DEVICE)
y_ship = matmul.nvfp4_linear(x1, packed)
with lab.using(gemv) as calls:
    y_late = matmul.nvfp4_linear(x1, packed)
print(f"routed calls {dict(calls)}; bits that differ: {bit_mismatches(y_late, y_ship)} of {y_ship.numel()}")

# %% [markdown]
# ## 5. The race
#
# `lab.race(v, shapes="qwen3.5-35b-a3b:decode")` checks the variant first (a variant that fails is not raced). Then,
# on a GPU, for each shape the op meets in that model's decode step (the norm's `1 x 2048` row with its residual; the
# six NVFP4 projections of a layer for the GEMV), it compares the variant, the shipped op and the vendor baseline
# (torch's `F.rms_norm`; cuBLAS bf16 on the same weights dequantised) with the torch reference, and times those that
# pass by **CUDA-graph replay**: `S` calls on `S` rotating input sets (enough to pass three times the L2, so that
# the weights come from memory as in the model, but at most 32), captured as one graph and replayed, the median per
# call over rounds that alternate the order (variant, shipped, baseline, then the reverse). Each row carries its
# bytes, GB/s and the fraction of the read ceiling measured in the same process. `save="DIR"` writes the rows as
# benchmark JSON with the variant's source and its hash.
#
# On a CPU there is nothing to time: the race checks, says so, and shows the committed H200 race of this very variant
# where one exists (the same source hash, `data/lab/h200/`), else the shipped op's committed figures. The output depends
# on the machine, so nbval does not compare it:

# %%
# NBVAL_IGNORE_OUTPUT
for v in (mine, gemv):
    race = lab.race(v, shapes="qwen3.5-35b-a3b:decode")
    print(f"== {v.label} ({v.op.name}): check {'passed' if race.check.passed else 'FAILED'}, "
          f"race {'passed' if race.passed else 'FAILED'}")
    if lab.can_time():
        import matplotlib.pyplot as plt

        print(race.table())
        race.plot()
        plt.show()
    else:
        print(race.note)
        print(race.committed, end="\n\n")

# %% [markdown]
# **On the H200** (the committed races above, b684975, 2026-12-05, `data/lab/h200/`): the RMSNorm with its weight
# loaded first runs 1.46 us against the shipped kernel's 1.50 us on the `1 x 2048` row with its residual, within
# the noise of a kernel this short (torch's eager `F.rms_norm` with the add takes 10.5 us). The GEMV with its
# prefetch moved after the FMAs is slower on every projection: 7.85 against 7.39 us on `in_proj_qkv`, 5.55 against
# 4.97 on `in_proj_z`, 7.04 against 5.48 on `out_proj` and `o_proj` (28% slower), 3.62 against 3.21 on the shared
# expert: the early load is what keeps the memory busy while the previous block is decoded. Both still beat cuBLAS
# bf16 on the dequantised weights (7.3 to 12.0 us). On a GPU the same cell races them again and plots the rows.
#
# ## 6. The decoder on a variant
#
# `in_decoder(v)` builds a random-weight model (the tiny preset on a CPU; Qwen3.5-35B-A3B on a GPU, where it also
# measures tokens per second at batch 1 and 8, shipped and variant alternating), makes greedy tokens from one prompt
# on the shipped kernels, then again with the variant routed in, and compares them. The interpreter takes about half
# a minute for each variant here:

# %%
for v in (mine, gemv):
    dec = in_decoder(v, new_tokens=4, prompt_len=6)
    print(dec)
    print(f"  shipped tokens {dec.shipped_tokens}, variant tokens {dec.variant_tokens}\n")


# %% [markdown]
# Both changes leave the decoder's tokens as they were, as the bit comparisons promised. The counts say how often
# each variant ran: the norm nine times a step (before each of the four layers' mixer and MoE, and once at the end),
# in the prefill and the three decode steps; the GEMV in the decode steps' one-row projections.
#
# A variant that is wrong shows where it bites. This one is a callable: it wraps the shipped op and rounds its output
# through fp8 E4M3, a tempting saving ("would 8-bit activations do?"). The check rejects it; the decoder shows the
# consequence. To keep the interpreter's time down it runs under `use_reference()`: routes take precedence over it, so
# the shipped path is the torch reference and only the routed callable differs (the reference's tokens are the
# kernels' above).

# %%
def fp8_rmsnorm(x, weight, eps=1e-6, *, residual=None, out=None, residual_out=None):
    """The shipped op (inside a variant the op is the shipped one), its output rounded through fp8 E4M3."""
    res = norm.rmsnorm(x, weight, eps, residual=residual, out=out, residual_out=residual_out)
    y = res[0] if residual is not None else res
    y.copy_(y.to(torch.float8_e4m3fn).to(y.dtype))
    return res


fp8 = lab.variant("rmsnorm", fp8_rmsnorm)
fp8_check = lab.check(fp8)
worst = max(r["metrics"].err_ratio or 0 for r in fp8_check.rows if "metrics" in r)
print(re.sub(r", [0-9.]+ s$", "", fp8_check.summary()), f"(worst err_ratio {r3(worst)})")
with lynn_kernels.use_reference():
    dec = in_decoder(fp8, new_tokens=4, prompt_len=6)
print(dec)
print(f"  shipped tokens {dec.shipped_tokens}, variant tokens {dec.variant_tokens}")

# %% [markdown]
# The first two tokens agree; at the third the shipped path's two best logits were two bf16 steps apart, and the
# fp8 rounding was enough to put another token first. After that the contexts differ, so the rest differs too. A
# random-weight model's logits are close together, so parting is easy there: equal tokens are strong evidence that a
# change is harmless, but parted tokens alone do not prove a bug (a correct variant that adds in another order can
# part too).
# The check decides; the decoder shows the consequence.
#
# ## 7. On the command line: `lynn race`
#
# The same loop, with the variant in a file:
#
# ```
# lynn race rmsnorm --variant my.py:my_rmsnorm_kernel            # check; on a GPU race on the decode shapes
# lynn race rmsnorm --variant my.py:my_rmsnorm_kernel --decoder  # and, once it passes, the decoder on it
# lynn race nvfp4_linear --base main                             # the working tree against a git revision
# ```
#
# | option | what it does |
# |---|---|
# | `--variant FILE.py:NAME` | runs `FILE.py` as a module and takes `NAME` from it: a callable with the op's signature or a `@triton.jit` kernel with the shipped parameters; checks it, then races it on a GPU (on a CPU: the committed figures, as in section 5) |
# | `--kernel NAME` | which of the op's kernels a kernel variant replaces (default the op's first; `lynn race --list` lists them) |
# | `--shapes MODEL:PHASE` | the inputs to race on: `qwen3.5-35b-a3b:decode` by default; phases `decode`, `decode-b8`, `prefill` |
# | `--decoder [PRESET]` | after a passing check, `in_decoder` as in section 6: tokens against the shipped path, and tokens per second on a GPU |
# | `--base REV` | GPU only: checks REV out into a temporary git worktree and runs the op's own `lynn bench --quick` (or the decoder's, with `--decoder PRESET`) there and in the working tree, alternating; prints both medians and their ratio per row |
# | `--save DIR` | writes the race's rows as benchmark JSON, with the variant's source and its sha256 |
#
# **Exit status**: 0 when the variant passed its check and every raced shape's validation, 1 when it did not, 2
# for a usage error (a missing file or name, an unknown op or shapes, `--base` without a GPU). Tokens that part from
# the shipped path are reported and do not change the status (the previous section says why).
#
# The two RMSNorm kernels of this notebook, written to a file (`lab.source_of` gives a variant's source) and raced
# from the command line:

# %%
HEADER = """import lynn_kernels  # first: it picks the backend before triton is imported
import triton
import triton.language as tl

from lynn_kernels.runtime import cast_output, pdl_enter, to_float32
from lynn_kernels.triton_shared import residual_rows, row_rstd
"""
repo = Path(lynn_kernels.__file__).resolve().parents[1]
with tempfile.TemporaryDirectory() as tmp:
    path = Path(tmp) / "my_norms.py"
    path.write_text(HEADER + "\n\n" + lab.source_of(my_rmsnorm_kernel) + "\n\n@triton.jit\n"
                    + lab.source_of(no_one))
    for name in ("my_rmsnorm_kernel", "rmsnorm_without_one"):
        done = subprocess.run([sys.executable, "-m", "lynn_cli", "race", "rmsnorm", "--variant", f"{path}:{name}"],
                              cwd=repo, capture_output=True, text=True)
        verdict = next(line for line in done.stdout.splitlines() if line.startswith(f"{name} ("))
        print(f"$ lynn race rmsnorm --variant my_norms.py:{name}\n"
              f"  exit status {done.returncode}: {re.sub(r', [0-9.]+ s$', '', verdict)}")

# %% [markdown]
# ## What changed, read back
#
# * **RMSNorm, weight loaded first**: the same bits in every check case and on the model's row, the same decoder
#   tokens, and on the H200 the same speed within noise (1.46 against 1.50 us).
# * **Packed GEMV, prefetch moved after the FMAs**: exact against the reference, bit-identical to the shipped kernel,
#   the same decoder tokens, and 6 to 28% slower on the H200: the prefetch earns its place.
# * **The planted `1 + w` slip**: every output row of the check fails, naming its case, cosine and `err_ratio`;
#   `lynn race` exits 1.
# * **fp8 output rounding**: rejected by the check (`err_ratio` up to 138, in fp16), and in the decoder the
#   tokens part at the third, where the shipped path's two best logits were close.
#
# To try your own: copy a cell of section 2 or 4, change one thing, run `lab.check`, then the race on a GPU. The ops
# that take a variant are in the table of section 1; named race shapes exist for the norm, `nvfp4_linear`, quantise /
# dequantise and the MoE block (others take a list of `lab.Shape`).
