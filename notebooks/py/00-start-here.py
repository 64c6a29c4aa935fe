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
# # Lynn workbench: start here
#
# Lynn workbench is a Jupyter-first bench of **Triton kernels for LLM inference**. Each kernel comes with a short
# pure-torch reference that is its executable spec, a validation against that reference, a benchmark on a real GPU
# and a notebook that explains it from first principles.
#
# | where | what |
# |---|---|
# | `lynn_kernels/<family>/` | one subpackage per kernel family: `reference.py` (pure torch, fp32 math, short), one module per Triton implementation, the public ops in `__init__.py` |
# | `lynn_kernels/runtime.py` | the one place that decides how kernels run (compiled, interpreter, reference) |
# | `lynn_kernels/metrics.py` | one comparison helper (`compare`) and one table renderer, shared by tests, notebooks and the CLI |
# | `notebooks/` | the tour, in learning order; outputs are committed and checked in CI by nbval |
# | `data/bench/<gpu>/` | benchmark results with provenance, written by `lynn bench` on a GPU, read by the notebooks |
#
# **Where it is going.** The kernels add up to a decoder for the hybrid Qwen3-Next / Qwen3.5 family
# (Qwen3.5-35B-A3B: 40 layers = 10 x (3 Gated DeltaNet + 1 gated attention), MoE with 256 experts, top-8, plus a
# shared expert) with NVFP4 weights:
#
# | piece of the decoder | kernel family | notebook |
# |---|---|---|
# | 4-bit weights, 16-bit activations (NVFP4 W4A16): quantise, dequantise | `nvfp4` | 01 |
# | projections: packed NVFP4 matvec (decode) and GEMM (prefill) | `matmul` | 02 |
# | routed experts: grouped MoE over NVFP4 experts | `moe` | 03 |
# | gated attention (GQA 16/2, head_dim 256, partial RoPE) | `attention` | 04 |
# | Gated DeltaNet (linear attention with a delta-rule state) | `deltanet` | 05 |
# | the whole decoder: HF checkpoints, paged cache, prefill / decode, generation | `lynn_model` | 06 |
#
# Decoding one token at batch 1 reads every active weight once, so most of these kernels are judged in **bytes
# per second**, against the bandwidth the GPU reaches on a plain copy.

# %%
import lynn_kernels  # noqa: I001  (first: it picks the backend before triton is imported)
import os
import subprocess
import sys
from pathlib import Path

import torch

from lynn_kernels import check, compare, render_table
from lynn_kernels.bench import load, result_table
from lynn_kernels.notebook import rounded  # metrics to 4 significant digits, so nbval's text comparison holds
from lynn_kernels.runtime import DEVICE

# %% [markdown]
# ## 1. What am I running on?
#
# `import lynn_kernels` decides once, before any `@triton.jit` function is defined:
#
# | backend | when | kernels run as |
# |---|---|---|
# | `triton` | a CUDA GPU is visible | compiled Triton |
# | `interpreter` | no GPU (or `TRITON_INTERPRET=1` set before start-up) | Triton's interpreter on the CPU: the same kernel source, executed with numpy; slow, but bit-faithful enough to test |
# | `reference` | on request only: `LYNN_BACKEND=reference` in the environment, or `with lynn_kernels.use_reference():` | each op's pure-torch reference |
#
# Kernel inputs live on `lynn_kernels.runtime.DEVICE` (`cuda` when compiled, `cpu` under the interpreter); a tensor
# on the wrong device raises an error that names it. `device_summary()` is what the benchmarks record as
# provenance.

# %%
# NBVAL_IGNORE_OUTPUT
for key, value in lynn_kernels.device_summary().items():
    print(f"{key:>10}: {value}")
print(f"{'DEVICE':>10}: {DEVICE}")

# %% [markdown]
# Switching to the reference is a context manager. The ops are bit-exact with their references, so the codes
# agree whichever backend produced them:

# %%
gen = torch.Generator().manual_seed(0)
w = torch.randn(64, 256, generator=gen).to(DEVICE)

q_kernel = lynn_kernels.quantize(w)            # this machine's backend: compiled Triton or the interpreter
with lynn_kernels.use_reference():
    print("inside use_reference():", lynn_kernels.backend())
    q_ref = lynn_kernels.quantize(w)           # the same call, now the pure-torch reference

print("codes that differ:", compare(q_kernel.codes, q_ref.codes, exact=True).mismatches)
print("scales that differ:", compare(q_kernel.scales.view(torch.uint8), q_ref.scales.view(torch.uint8),
                                     exact=True).mismatches)

# %% [markdown]
# The environment variable does the same for a whole process (a notebook server, `lynn check`, a test run).
# It is read at import, so set it before Python starts:

# %%
probe = "import lynn_kernels; print(lynn_kernels.backend())"
env = {**os.environ, "LYNN_BACKEND": "reference"}
repo = Path(lynn_kernels.__file__).resolve().parents[1]     # works for an installed or a plain checkout
out = subprocess.run([sys.executable, "-c", probe], env=env, cwd=repo, capture_output=True, text=True,
                     check=True)
print("LYNN_BACKEND=reference ->", out.stdout.strip())

# %% [markdown]
# ## 2. How to read a validation table
#
# Every kernel is compared with its reference by one helper, `lynn_kernels.compare(out, ref, baseline=None,
# exact=False)`, so a number means the same in tests, notebooks and `lynn check`. All metrics are computed in
# float64 against the reference:
#
# | column | meaning | what good looks like |
# |---|---|---|
# | `cosine` | cosine similarity of the flattened tensors | 1 for bit-exact ops; close to 1 for lossy ones |
# | `max_abs` | largest absolute difference | 0 for bit-exact ops |
# | `rel_l2` | `‖out - ref‖ / ‖ref‖` | 0 for bit-exact ops |
# | `err_ratio` | `rel_l2(out) / rel_l2(baseline)`, where the baseline is the same computation done plainly in bf16 | about 1: as accurate as bf16; below 1 better; far above 1 worse. `-` when there is no baseline (or the baseline is exact) |
# | `mismatches` | elements whose **bits** differ (`exact=True`) | 0 for ops that promise bit-exactness, such as quantise and dequantise |
# | `passed` | the family's own gate | `yes` |
#
# `run_checks(["nvfp4"])` runs the same cases as `lynn check nvfp4` (figures rounded here to 4 significant
# digits, as everywhere in these notebooks):

# %%
rows, seconds = check.run_checks(["nvfp4"])
print(check.table(rounded(rows), columns=check.PORTABLE_COLUMNS))   # backend: in the cell below

# %%
# NBVAL_IGNORE_OUTPUT
passed = sum(r["passed"] for r in rows)
print(f"{passed}/{len(rows)} checks passed in {seconds:.1f} s on backend {lynn_kernels.backend()!r}")

# %% [markdown]
# The quantise and dequantise rows promise bit-exactness: `mismatches` must be 0 (for quantise it counts the
# packed code bytes; the check also requires the scales to match). The round-trip rows are different: they
# measure how much information 4 bits lose, against the fp32 original. `err_ratio` puts that in units of "plain
# bf16 rounding":

# %%
for r in rows:
    if r["op"] != "nvfp4 round trip":
        continue
    m = r["metrics"]
    if m.err_ratio is None:
        ratio = "no err_ratio: the input is bf16, so a bf16 copy is exact and there is nothing to divide by"
    else:
        ratio = f"err_ratio {m.err_ratio:.1f}: {m.err_ratio:.0f}x the error of rounding to bf16"
    print(f"{r['case']:<24} cosine {m.cosine:.4f}  rel_l2 {m.rel_l2:.4f}  {ratio}")

# %% [markdown]
# The same helper on three copies of one fp32 tensor makes `err_ratio` concrete: bf16 is the unit, fp16 has three
# more mantissa bits (about 8x smaller error), NVFP4 has one:

# %%
x = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
bf16 = x.bfloat16()
nvfp4_rt = lynn_kernels.dequantize(lynn_kernels.quantize(x.to(DEVICE)), torch.float32)
demo = [{"copy": "bf16", "m": compare(bf16, x, baseline=bf16)},
        {"copy": "fp16", "m": compare(x.half(), x, baseline=bf16)},
        {"copy": "nvfp4 round trip", "m": compare(nvfp4_rt, x, baseline=bf16)}]
print(render_table(rounded(demo), ["copy", "cosine", "max_abs", "rel_l2", "err_ratio"]))

# %% [markdown]
# ## 3. How to read a benchmark table
#
# Timings come only from a GPU (`lynn bench`, on an H200 here); on a CPU nothing is timed and the committed
# results are shown instead. One harness writes one schema (`lynn-bench/1`), one JSON file per op under
# `data/bench/<gpu>/`:
#
# * **provenance**: date, git sha, GPU, torch / triton / CUDA versions and the command, so a number can be traced;
# * **ceilings**: bandwidth and matmul rates measured in the same process: `copy_gbps` (device-to-device copy,
#   bytes read + written), `read_gbps` (sum of a large tensor), `bf16_tflops` (an 8192^3 matmul);
# * **results**, one row per provider and shape:
#   * `median_ms`, `p20_ms`, `p80_ms`: the median and the 20th / 80th percentiles of many timed runs (CUDA
#     events after warm-up, L2 flushed, inputs rotated over several copies so the L2 cannot hold them; each row's
#     `note` says how it was timed); a wide p20-p80 band means a noisy measurement;
#   * `bytes`: the fewest bytes the op must move (each input read once, the output written once);
#     `gbps = bytes / median`;
#   * `frac_of_ceiling`: `gbps` over the matching measured ceiling (the copy ceiling here); where a
#     `torch copy of the same bytes` row is present, it shows what a plain copy reaches at that size (small
#     problems do not fill the GPU);
#   * `validation`: each provider's output is compared with the reference **before** it is timed, and a wrong
#     op is never timed.
#
# The cells below read whatever results are committed, so their output is not checked.

# %%
# NBVAL_IGNORE_OUTPUT
doc = load("nvfp4.dequantize", gpu="h200")
prov = doc["provenance"]
print(f"{doc['op']} on {prov['gpu']}, {prov['date']}, git {prov['git_sha']}, torch {prov['torch']}, "
      f"triton {prov['triton']}, CUDA {prov['cuda']}")
print(f"command: {prov['command']}")
print("ceilings: " + ", ".join(f"{k} {v:,.0f}" for k, v in doc["ceilings"].items() if k != "sizes") + "\n")
print(result_table(doc))
notes = {}
for r in doc["results"]:
    notes.setdefault(r["provider"], r.get("note") or "-")                   # the first note of each provider
print("\nnotes:", *(f"{p}: {n}" for p, n in notes.items()), sep="\n  ")

# %% [markdown]
# The spread and the derivation for one row, recomputed from the raw fields (bytes for dequantise: read the
# packed codes, `N*K/2`, and the E4M3 scales, `N*K/16`, write bf16, `2*N*K`):

# %%
# NBVAL_IGNORE_OUTPUT
cols = ["provider", "shape", "median_ms", "p20_ms", "p80_ms", "gbps", "frac_of_ceiling"]
print(result_table(doc, cols) + "\n")

row = next((r for r in doc["results"] if r["provider"].startswith("lynn")), doc["results"][0])
numel = 1
for v in row["dims"].values():
    numel *= v
must_move = numel // 2 + numel // 16 + 2 * numel
gbps = row["bytes"] / (row["median_ms"] * 1e-3) / 1e9
frac = gbps / doc["ceilings"][row["ceiling"]]
print(f"{row['provider']} {row['shape']}: bytes {row['bytes']:,} (N*K*(1/2 + 1/16 + 2) = {must_move:,})")
print(f"  {row['bytes']:,} B / {row['median_ms'] * 1e3:.1f} us = {gbps:,.0f} GB/s "
      f"= {frac:.1%} of the {row['ceiling']} ceiling (stored: {row['gbps']:,.0f} GB/s, "
      f"{row['frac_of_ceiling']:.1%})")

# %% [markdown]
# ## 4. Triton in ten lines
#
# The kernels are written in [Triton](https://triton-lang.org): Python functions that run as many **programs** in
# parallel on the GPU, each working on a block of elements at once. Notebook 01 builds its first kernel with these
# words, so here they are on a toy, `out = x + alpha * y`:
#
# | word | what it means |
# |---|---|
# | `@triton.jit` | the function is a kernel: compiled for the GPU (here: run by Triton's interpreter with numpy) |
# | `kernel[grid](args)` | the **launch grid**: how many programs to start, e.g. `(cdiv(n, BLOCK),)`; tensors arrive as pointers |
# | `tl.program_id(0)` | which program this is, 0 .. grid[0] - 1: it picks the block of the data this program owns |
# | `tl.arange(0, BLOCK)` | a vector of indices 0 .. BLOCK - 1; pointer + vector = a vector of addresses, loaded in one `tl.load` |
# | `mask=offs < n` | lanes past the end are switched off: a masked load gives `other=` there (undefined without it), a masked store skips them |
# | `BLOCK: tl.constexpr` | a compile-time constant: each value compiles its own kernel, and block shapes (`tl.arange`) must be constant powers of 2 |

# %%
import triton
import triton.language as tl


@triton.jit
def scaled_add_kernel(x_ptr, y_ptr, out_ptr, alpha, n, BLOCK: tl.constexpr):   # a toy, not a library kernel
    pid = tl.program_id(0)                          # this program's number along grid axis 0
    offs = pid * BLOCK + tl.arange(0, BLOCK)        # the BLOCK indices it owns
    mask = offs < n                                 # the last block runs past n: those lanes do nothing
    x = tl.load(x_ptr + offs, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, x + alpha * y, mask=mask)


gen = torch.Generator().manual_seed(2)
x, y = torch.randn(1000, generator=gen).to(DEVICE), torch.randn(1000, generator=gen).to(DEVICE)
out = torch.full_like(x, float("nan"))             # so an element no program wrote would show
BLOCK = 256
grid = (triton.cdiv(x.numel(), BLOCK),)             # 4 programs: 3 full blocks, and 232 of the last block's 256
scaled_add_kernel[grid](x, y, out, 0.5, x.numel(), BLOCK=BLOCK)
print(f"n {x.numel()}, BLOCK {BLOCK}, grid {grid}: vs torch's x + 0.5 * y, "
      f"max_abs {compare(out, x + 0.5 * y).max_abs}, elements not written {int(out.isnan().sum())}")

# %% [markdown]
# On a GPU the first launch compiles the kernel for this `BLOCK` (and for the argument dtypes), later launches
# reuse it. The library's kernels add a second grid axis, loops over blocks (`for k in range(0, K, BLOCK_K)`),
# `tl.dot` on tiles and autotuned `constexpr`s, but they are read the same way: find `program_id`, then what each
# program owns. The [Triton tutorials](https://triton-lang.org/main/getting-started/tutorials/index.html) go
# further; [`docs/interpreter.md`](../docs/interpreter.md) says what the interpreter gets right and wrong.
#
# ## 5. Map of the notebooks and the command line
#
# | notebook | what you learn |
# |---|---|
# | `00-start-here` | this page: backends, validation tables, benchmark tables |
# | `01-nvfp4` | E2M1 and E4M3 from their bits, the NVFP4 block format, quantisation error, a dequantise kernel built step by step, its H200 profile, a block explorer |
# | `02-packed-matvec` | W4A16 matvec and GEMM that decode NVFP4 in registers (Hopper has no FP4 tensor cores) |
# | `03-grouped-moe` | MoE routing (ties to the lowest id), the align step, a toy grouped GEMM then the package's NVFP4 expert kernels, parity with HF's Qwen3.5 block, the H200 profile against `torch._grouped_mm`, a load and padding explorer |
# | `04-attention` | gated attention with GQA and partial RoPE, prefill and decode |
# | `05-deltanet` | Gated DeltaNet: recurrent and chunked forms, fp32 state |
# | `06-decoder` | the hybrid decoder (`lynn_model`): layer pattern and config, a tiny HF checkpoint loaded, each layer against HF's, the paged cache (packed prefill, decode), generation against HF's, the H200 profile (host-bound eager decode) |
# | `07-generate` | the shipped demo model (11.6M parameters, trained here): tokens, greedy and sampling (temperature, top-k, top-p, seed), the token stream with per-token probabilities and an explorer, held-out perplexity live and the committed bf16 / NVFP4 / int4 table, the training run, `lynn generate` on the H200 |
# | `08-experiment` | changing a kernel with `lynn_kernels.lab`: the RMSNorm and the packed GEMV copied with one change each, checked, raced (on a GPU), run in the decoder; a planted mistake the check catches; `lynn race` |
#
# Every notebook follows one order: idea and math, reference, kernel, validation table, profile and plot,
# interactive explorer.
#
# The command line (installed with the package):
#
# | command | what it does |
# |---|---|
# | `lynn check [NAME ...]` | the validation table above, for every family (or the families / ops named), on this device; exits non-zero if a check fails |
# | `lynn bench [OP ...] [--quick] [--out DIR] [--list] [--check]` | GPU only: measures the ceilings, validates then times each provider, writes `data/bench/<gpu>/<op>.json`; `--check` compares with the committed perf baseline |
# | `lynn lab [--no-browser] [--port PORT]` | opens JupyterLab on this notebook; any other option goes to `jupyter lab` |
# | `lynn info` | the device and backend, as in section 1 |
# | `lynn quantize SRC DST` | writes an NVFP4 (W4A16) copy of a bf16 / fp16 / fp32 Qwen3-Next / Qwen3.5 HF checkpoint folder, read by vLLM, SGLang and `lynn_model` (`docs/nvfp4.md`) |
# | `lynn generate [PROMPT] [--model DIR]` | streams a continuation of the prompt from the shipped demo model or a checkpoint folder (greedy, or `--temperature` / `--top-k` / `--top-p` / `--seed`; notebook 07) |
# | `lynn race OP --variant FILE.py:NAME [--decoder] [--base REV]` | checks a variant of an op or of one of its kernels, races it against the shipped op and the vendor library on a GPU, runs the decoder on it; `--base` races the working tree against a git revision (notebook 08) |
#
# `lynn COMMAND --help` gives each command's options.
#
# `pytest notebooks -q` re-runs these notebooks and checks their outputs (nbval). Registered now:

# %%
# NBVAL_IGNORE_OUTPUT
import lynn_model.bench  # noqa: F401  (registers the whole decoder's benchmarks)
from lynn_kernels import bench

print("check families:", ", ".join(check.CHECKS))
print("benchmarks:    ", ", ".join(bench.available()))
