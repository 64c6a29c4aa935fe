"""Write the teaching notebooks from the cell sources in this file, then execute them in place.

    .venv/bin/python notebooks/_build.py              # write and execute every notebook
    .venv/bin/python notebooks/_build.py 01           # only those whose name starts with 01
    .venv/bin/python notebooks/_build.py --no-exec    # write the cells only (no outputs)

Each notebook is a list of cells: ``md(...)`` for prose, ``code(...)`` for code. A code cell whose output depends on
the machine (timings, versions, devices, plots, widgets, committed benchmark data) starts with
``# NBVAL_IGNORE_OUTPUT``; every other output is checked by ``pytest notebooks`` (nbval), so it must be
deterministic and rounded. Execution runs on this machine's backend (the interpreter on a CPU).
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent


def md(text: str):
    return nbformat.v4.new_markdown_cell(textwrap.dedent(text).strip())


def code(text: str):
    return nbformat.v4.new_code_cell(textwrap.dedent(text).strip())


# =================================================================================================================
# 00-start-here
# =================================================================================================================

START_HERE = [
    md(r'''
    # Lynn workbench: start here

    Lynn workbench is a Jupyter-first bench of **Triton kernels for LLM inference**. Each kernel comes with a short
    pure-torch reference that is its executable spec, a validation against that reference, a benchmark on a real GPU
    and a notebook that explains it from first principles.

    | where | what |
    |---|---|
    | `lynn_kernels/<family>/` | one subpackage per kernel family: `reference.py` (pure torch, fp32 math, short), one module per Triton implementation, the public ops in `__init__.py` |
    | `lynn_kernels/runtime.py` | the one place that decides how kernels run (compiled, interpreter, reference) |
    | `lynn_kernels/validate.py` | one comparison helper (`compare`) and one table renderer, shared by tests, notebooks and the CLI |
    | `notebooks/` | the tour, in learning order; outputs are committed and checked in CI by nbval |
    | `data/bench/<gpu>/` | benchmark results with provenance, written by `lynn bench` on a GPU, read by the notebooks |

    **Where it is going.** The kernels add up to a decoder for the hybrid Qwen3-Next / Qwen3.5 family
    (Qwen3.5-35B-A3B: 40 layers = 10 x (3 Gated DeltaNet + 1 gated attention), MoE with 256 experts, top-8, plus a
    shared expert) with NVFP4 weights:

    | piece of the decoder | kernel family | notebook |
    |---|---|---|
    | 4-bit weights, 16-bit activations (NVFP4 W4A16): quantise, dequantise | `nvfp4` | 01 |
    | projections: packed NVFP4 matvec (decode) and GEMM (prefill) | `matmul` | 02 |
    | routed experts: grouped MoE over NVFP4 experts | `moe` | 03 |
    | gated attention (GQA 16/2, head_dim 256, partial RoPE) | `attention` | 04 |
    | Gated DeltaNet (linear attention with a delta-rule state) | `deltanet` | 05 |
    | the whole decoder: HF checkpoints, paged cache, prefill / decode, generation | `lynn_model` | 06 |

    Decoding one token at batch 1 reads every active weight once, so most of these kernels are judged in **bytes
    per second**, against the bandwidth the GPU reaches on a plain copy.
    '''),
    code(r'''
    import dataclasses
    import os
    import subprocess
    import sys
    from pathlib import Path

    import torch

    import lynn_kernels                      # first: it picks the backend before any kernel is defined
    from lynn_kernels import checks, compare, render_table
    from lynn_kernels.bench import load, result_table
    from lynn_kernels.runtime import DEVICE


    def rounded(rows, digits=4):
        """Round the metrics of table rows to `digits` significant digits, so that float noise from another CPU or
        torch build cannot change the committed output (nbval compares it as text)."""
        def r(v):
            return v if v is None else float(f"{v:.{digits}g}")

        return [{k: dataclasses.replace(v, cosine=r(v.cosine), max_abs=r(v.max_abs), rel_l2=r(v.rel_l2),
                                        err_ratio=r(v.err_ratio)) if isinstance(v, lynn_kernels.Metrics) else v
                 for k, v in row.items()} for row in rows]
    '''),
    md(r'''
    ## 1. What am I running on?

    `import lynn_kernels` decides once, before any `@triton.jit` function is defined:

    | backend | when | kernels run as |
    |---|---|---|
    | `triton` | a CUDA GPU is visible | compiled Triton |
    | `interpreter` | no GPU (or `TRITON_INTERPRET=1` set before start-up) | Triton's interpreter on the CPU: the same kernel source, executed with numpy; slow, but bit-faithful enough to test |
    | `reference` | on request only: `LYNN_BACKEND=reference` in the environment, or `with lynn_kernels.use_reference():` | each op's pure-torch reference |

    Kernel inputs live on `lynn_kernels.runtime.DEVICE` (`cuda` when compiled, `cpu` under the interpreter); a tensor
    on the wrong device raises an error that names it. `device_summary()` is what the benchmarks record as
    provenance.
    '''),
    code(r'''
    # NBVAL_IGNORE_OUTPUT
    for key, value in lynn_kernels.device_summary().items():
        print(f"{key:>10}: {value}")
    print(f"{'DEVICE':>10}: {DEVICE}")
    '''),
    md(r'''
    Switching to the reference is a context manager. The ops are bit-exact with their references, so the codes
    agree whichever backend produced them:
    '''),
    code(r'''
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 256, generator=gen).to(DEVICE)

    q_kernel = lynn_kernels.quantize(w)            # this machine's backend: compiled Triton or the interpreter
    with lynn_kernels.use_reference():
        print("inside use_reference():", lynn_kernels.backend())
        q_ref = lynn_kernels.quantize(w)           # the same call, now the pure-torch reference

    print("codes that differ:", compare(q_kernel.codes, q_ref.codes, exact=True).mismatches)
    print("scales that differ:", compare(q_kernel.scales.view(torch.uint8), q_ref.scales.view(torch.uint8),
                                         exact=True).mismatches)
    '''),
    md(r'''
    The environment variable does the same for a whole process (a notebook server, `lynn check`, a test run).
    It is read at import, so set it before Python starts:
    '''),
    code(r'''
    probe = "import lynn_kernels; print(lynn_kernels.backend())"
    env = {**os.environ, "LYNN_BACKEND": "reference"}
    repo = Path(lynn_kernels.__file__).resolve().parents[1]     # works for an installed or a plain checkout
    out = subprocess.run([sys.executable, "-c", probe], env=env, cwd=repo, capture_output=True, text=True,
                         check=True)
    print("LYNN_BACKEND=reference ->", out.stdout.strip())
    '''),
    md(r'''
    ## 2. How to read a validation table

    Every kernel is compared with its reference by one helper, `lynn_kernels.compare(out, ref, baseline=None,
    exact=False)`, so a number means the same in tests, notebooks and `lynn check`. All metrics are computed in
    float64 against the reference:

    | column | meaning | what good looks like |
    |---|---|---|
    | `cosine` | cosine similarity of the flattened tensors | 1 for bit-exact ops; close to 1 for lossy ones |
    | `max_abs` | largest absolute difference | 0 for bit-exact ops |
    | `rel_l2` | `‖out - ref‖ / ‖ref‖` | 0 for bit-exact ops |
    | `err_ratio` | `rel_l2(out) / rel_l2(baseline)`, where the baseline is the same computation done plainly in bf16 | about 1: as accurate as bf16; below 1 better; far above 1 worse. `-` when there is no baseline (or the baseline is exact) |
    | `mismatches` | elements whose **bits** differ (`exact=True`) | 0 for ops that promise bit-exactness, such as quantise and dequantise |
    | `passed` | the family's own gate | `yes` |

    `run_checks(["nvfp4"])` runs the same cases as `lynn check nvfp4` (figures rounded here to 4 significant
    digits, as everywhere in these notebooks):
    '''),
    code(r'''
    rows, seconds = checks.run_checks(["nvfp4"])
    print(checks.table(rounded(rows), columns=checks.PORTABLE_COLUMNS))   # backend: in the cell below
    '''),
    code(r'''
    # NBVAL_IGNORE_OUTPUT
    passed = sum(r["passed"] for r in rows)
    print(f"{passed}/{len(rows)} checks passed in {seconds:.1f} s on backend {lynn_kernels.backend()!r}")
    '''),
    md(r'''
    The quantise and dequantise rows promise bit-exactness: `mismatches` must be 0 (for quantise it counts the
    packed code bytes; the check also requires the scales to match). The round-trip rows are different: they
    measure how much information 4 bits lose, against the fp32 original. `err_ratio` puts that in units of "plain
    bf16 rounding":
    '''),
    code(r'''
    for r in rows:
        if r["op"] != "nvfp4 round trip":
            continue
        m = r["metrics"]
        if m.err_ratio is None:
            ratio = "no err_ratio: the input is bf16, so a bf16 copy is exact and there is nothing to divide by"
        else:
            ratio = f"err_ratio {m.err_ratio:.1f}: {m.err_ratio:.0f}x the error of rounding to bf16"
        print(f"{r['case']:<24} cosine {m.cosine:.4f}  rel_l2 {m.rel_l2:.4f}  {ratio}")
    '''),
    md(r'''
    The same helper on three copies of one fp32 tensor makes `err_ratio` concrete: bf16 is the unit, fp16 has three
    more mantissa bits (about 8x smaller error), NVFP4 has one:
    '''),
    code(r'''
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
    bf16 = x.bfloat16()
    nvfp4_rt = lynn_kernels.dequantize(lynn_kernels.quantize(x.to(DEVICE)), torch.float32)
    demo = [{"copy": "bf16", "m": compare(bf16, x, baseline=bf16)},
            {"copy": "fp16", "m": compare(x.half(), x, baseline=bf16)},
            {"copy": "nvfp4 round trip", "m": compare(nvfp4_rt, x, baseline=bf16)}]
    print(render_table(rounded(demo), ["copy", "cosine", "max_abs", "rel_l2", "err_ratio"]))
    '''),
    md(r'''
    ## 3. How to read a benchmark table

    Timings come only from a GPU (`lynn bench`, on an H200 here); on a CPU nothing is timed and the committed
    results are shown instead. One harness writes one schema (`lynn-bench/1`), one JSON file per op under
    `data/bench/<gpu>/`:

    * **provenance**: date, git sha, GPU, torch / triton / CUDA versions and the command, so a number can be traced;
    * **ceilings**: bandwidth and matmul rates measured in the same process: `copy_gbps` (device-to-device copy,
      bytes read + written), `read_gbps` (sum of a large tensor), `bf16_tflops` (an 8192^3 matmul);
    * **results**, one row per provider and shape:
      * `median_ms`, `p20_ms`, `p80_ms`: the median and the 20th / 80th percentiles of many timed runs (CUDA
        events after warm-up, L2 flushed, inputs rotated over several copies so the L2 cannot hold them; each row's
        `note` says how it was timed); a wide p20-p80 band means a noisy measurement;
      * `bytes`: the fewest bytes the op must move (each input read once, the output written once);
        `gbps = bytes / median`;
      * `frac_of_ceiling`: `gbps` over the matching measured ceiling (the copy ceiling here); where a
        `torch copy of the same bytes` row is present, it shows what a plain copy reaches at that size (small
        problems do not fill the GPU);
      * `validation`: each provider's output is compared with the reference **before** it is timed, and a wrong
        op is never timed.

    The cells below read whatever results are committed, so their output is not checked.
    '''),
    code(r'''
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
    '''),
    md(r'''
    The spread and the derivation for one row, recomputed from the raw fields (bytes for dequantise: read the
    packed codes, `N*K/2`, and the E4M3 scales, `N*K/16`, write bf16, `2*N*K`):
    '''),
    code(r'''
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
    '''),
    md(r'''
    ## 4. Map of the notebooks and the command line

    | notebook | what you learn |
    |---|---|
    | `00-start-here` | this page: backends, validation tables, benchmark tables |
    | `01-nvfp4` | E2M1 and E4M3 from their bits, the NVFP4 block format, quantisation error, a dequantise kernel built step by step, its H200 profile, a block explorer |
    | `02-packed-matvec` | W4A16 matvec and GEMM that decode NVFP4 in registers (Hopper has no FP4 tensor cores) |
    | `03-grouped-moe` | MoE routing (ties to the lowest id), the align step, a toy grouped GEMM then the package's NVFP4 expert kernels, parity with HF's Qwen3.5 block, the H200 profile against `torch._grouped_mm`, a load and padding explorer |
    | `04-attention` | gated attention with GQA and partial RoPE, prefill and decode |
    | `05-deltanet` | Gated DeltaNet: recurrent and chunked forms, fp32 state |
    | `06-decoder` | the hybrid decoder (`lynn_model`): layer pattern and config, a tiny HF checkpoint loaded, each layer against HF's, the paged cache (packed prefill, decode), generation against HF's, the H200 profile (host-bound eager decode) |

    Every notebook follows one order: idea and math, reference, kernel, validation table, profile and plot,
    interactive explorer.

    The command line (installed with the package):

    | command | what it does |
    |---|---|
    | `lynn check [FAMILY ...]` | the validation table above, for every family (or the ones named), on this device; exits non-zero if a check fails |
    | `lynn bench [OP ...] [--quick] [--out DIR]` | GPU only: measures the ceilings, validates then times each provider, writes `data/bench/<gpu>/<op>.json` |
    | `lynn lab` | opens JupyterLab on `notebooks/` |
    | `lynn info` | the device and backend, as in section 1 |

    `pytest notebooks -q` re-runs these notebooks and checks their outputs (nbval). Registered now:
    '''),
    code(r'''
    # NBVAL_IGNORE_OUTPUT
    from lynn_kernels import bench

    print("check families:", ", ".join(checks.CHECKS))
    print("benchmarks:    ", ", ".join(bench.available()))
    '''),
]


# =================================================================================================================
# 01-nvfp4
# =================================================================================================================

NVFP4 = [
    md(r'''
    # 01: NVFP4 from the bits up

    NVFP4 stores a weight in 4 bits: an **E2M1** code per element, an **E4M3** scale per 16 elements and one
    **fp32** scale per tensor. This notebook builds it from first principles, then builds a dequantise kernel step
    by step and hands over to the package's:

    1. E2M1, the 4-bit element, from its bits; its rounding rule
    2. E4M3 (FN), the 8-bit scale, from its bits; why the scale is E4M3 and why there is a global fp32 scale
    3. the block format and the reference: packing, bytes per weight
    4. quantisation error against bf16 and a toy int4 quantiser, on Gaussian and heavy-tailed weights; the two recipes
    5. the dequantise kernel, step by step, then the package's kernel and its bit trick
    6. the validation table
    7. the H200 profile, from committed results
    8. an interactive explorer of one block

    Everything runs on a CPU through Triton's interpreter, on small shapes; on a GPU the same cells run compiled.
    '''),
    code(r'''
    %matplotlib inline
    import dataclasses
    import math

    import lynn_kernels as lk                # first: it picks the backend before any kernel is defined
    import matplotlib.pyplot as plt
    import numpy as np
    import torch
    import triton
    import triton.language as tl

    from lynn_kernels import checks, compare, nvfp4, render_table
    from lynn_kernels.nvfp4 import reference
    from lynn_kernels.runtime import DEVICE


    def r4(v):
        """4 significant digits: enough to read, and float noise from another CPU or torch build cannot change the
        committed output (nbval compares it as text)."""
        return v if v is None else float(f"{v:.4g}")


    def rounded(rows):
        """Table rows with their Metrics rounded by r4."""
        return [{k: dataclasses.replace(v, cosine=r4(v.cosine), max_abs=r4(v.max_abs), rel_l2=r4(v.rel_l2),
                                        err_ratio=r4(v.err_ratio)) if isinstance(v, lk.Metrics) else v
                 for k, v in row.items()} for row in rows]
    '''),
    code(r'''
    # NBVAL_IGNORE_OUTPUT
    print(lk.device_summary())
    '''),
    # ---------------------------------------------------------------------------------------------------------- 1
    md(r'''
    ## 1. E2M1: the 4-bit element

    Four bits: one sign bit `s`, two exponent bits `e`, one mantissa bit `m`, exponent bias 1.

    $$
    \text{value} = (-1)^s \times
    \begin{cases}
    2^{e-1}\,(1 + m/2) & e > 0 \quad\text{(normal)}\\
    2^{1-1}\,(m/2) = m/2 & e = 0 \quad\text{(subnormal: no implicit 1)}
    \end{cases}
    $$

    Code `s e1 e0 m` is bit 3 to bit 0. There is no infinity and no NaN: the largest magnitude is 6. Decoding all
    16 codes in plain Python and checking them against the package's table:
    '''),
    code(r'''
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
    '''),
    md(r'''
    **Rounding.** A value `x` (already divided by its scale) goes to the nearest of
    `{0, 0.5, 1, 1.5, 2, 3, 4, 6}` with its sign. A value exactly halfway between two neighbours is a tie, and a
    tie goes to the neighbour whose mantissa bit is 0 ("ties to even"): 0.25 -> 0, 0.75 -> 1, 1.25 -> 1,
    1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4. There is no infinity to overflow into, so anything past 6 saturates
    to 6. The reference encoder, `reference.encode_e2m1`, counts thresholds:
    '''),
    code(r'''
    xs = [0.1, 0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 2.6, 3.5, 5.0, 5.1, 6.0, 7.0, 1e6, -0.1, -2.5]
    codes = reference.encode_e2m1(torch.tensor(xs)).tolist()
    ties = {0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0}
    for x, c in zip(xs, codes):
        note = "tie -> even mantissa" if abs(x) in ties else ("saturates" if abs(x) > 6 else "")
        print(f"{x:>9g} -> code 0x{c:x} = {e2m1_decode(c):+.1f}   {note}")
    '''),
    md(r'''
    The same rule written as a brute-force search (nearest value; on a tie the even mantissa) agrees with the
    reference on every multiple of 1/64 in [-8, 8], ties included:
    '''),
    code(r'''
    def e2m1_nearest(x: float) -> int:
        best = min(range(8), key=lambda c: (abs(abs(x) - e2m1_decode(c)), c & 1))   # distance, then odd mantissa
        return best | (8 if x < 0 else 0)


    grid = [k / 64 for k in range(-512, 513)]
    enc = reference.encode_e2m1(torch.tensor(grid)).tolist()
    print(f"{len(grid)} points, disagreements: {sum(e2m1_nearest(x) != c for x, c in zip(grid, enc))}")
    '''),
    code(r'''
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
    '''),
    # ---------------------------------------------------------------------------------------------------------- 2
    md(r'''
    ## 2. E4M3 (FN): the 8-bit block scale

    Eight bits: sign, four exponent bits with bias 7, three mantissa bits.

    $$
    \text{value} = (-1)^s \times
    \begin{cases}
    2^{e-7}\,(1 + m/8) & e > 0\\
    2^{-6}\,(m/8) = m \cdot 2^{-9} & e = 0 \quad\text{(subnormals, down to } 2^{-9}\text{)}
    \end{cases}
    $$

    "FN" means finite: there are no infinities, and only `S.1111.111` (0x7F and 0xFF) is NaN. So exponent 15
    still holds numbers, and the largest is `2^8 x 1.75 = 448`. Decoding all 256 codes in plain Python and comparing
    them with `torch.float8_e4m3fn`:
    '''),
    code(r'''
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
    '''),
    md(r'''
    **Why the scale is E4M3.** A block's 16 values are divided by their scale so that the block's largest
    magnitude lands near 6, the top of E2M1. A power-of-two scale (MXFP4's E8M0) can place it only within a factor
    of two, so part of the 4-bit grid goes unused (or the top of the block clips); E4M3's three mantissa bits put it
    within about 1/16 of 6. The price is range: E4M3 spans only about 2^-9 .. 448.

    **Why a global fp32 scale.** Real weights are small (a std of about 0.02), so their block scales,
    `block_amax / 6`, would sit in E4M3's subnormals or underflow to 0; large activations would saturate at 448.
    NVFP4 adds one fp32 scale per tensor, `global = amax / (6 * 448) = amax / 2688`. Then the block holding the
    tensor's amax gets scale exactly `amax / (6 * global) = 448`, and every other block
    `448 * block_amax / amax`: the scales use the top of E4M3's range whatever the tensor's magnitude, and only a
    block some 10^4 times smaller than the largest falls into the subnormals.

    The same 64 x 256 Gaussian at four magnitudes, with the global scale forced to 1.0 and with `amax / 2688`:
    '''),
    code(r'''
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
    '''),
    md(r'''
    With the global scale fixed at 1.0, tiny weights underflow to zero scales (the whole tensor decodes to 0,
    `rel_l2 = 1`), small ones lose precision in the subnormals and large ones clip at 448. With `amax / 2688` the
    error is the same at every magnitude.
    '''),
    # ---------------------------------------------------------------------------------------------------------- 3
    md(r'''
    ## 3. The block format, and the reference

    An NVFP4 tensor of logical shape `[..., K]` (K a multiple of 16) is three tensors
    (`lynn_kernels.NVFP4Tensor`):

    | field | dtype, shape | content |
    |---|---|---|
    | `codes` | uint8 `[..., K/2]` | two E2M1 codes per byte: element `2j` in the **low** nibble of byte `j`, element `2j+1` in the high nibble |
    | `scales` | float8_e4m3fn `[..., K/16]` | one scale per 16 consecutive elements along K |
    | `global_scale` | fp32 `()` (or `[E]` for stacked experts) | multiply convention: `amax / 2688` |

    $$ w_{k} \approx \text{e2m1}(\text{code}_k)\times \text{scale}_{\lfloor k/16 \rfloor}\times\text{global} $$

    Quantising one block (ModelOpt recipe): `s = RN_e4m3(block_amax / (6 * global))`, then every element
    `code = RNE_e2m1(w / (s * global))`. The reference, `lynn_kernels.nvfp4.reference`, is that in a few lines of
    torch. Here is one row of 32 weights (two blocks), quantised by the package and taken apart by hand:
    '''),
    code(r'''
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
    '''),
    code(r'''
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
    '''),
    md(r'''
    **Bytes per weight.** Half a byte per code plus one byte per 16 elements for the scale, against 2 for bf16
    (the 4-byte global scale is per tensor):
    '''),
    code(r'''
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    q = nvfp4.quantize(w.to(DEVICE))
    n = w.numel()
    print(f"codes {q.codes.numel() / n:.4f} + scales {q.scales.numel() / n:.4f} = "
          f"{(q.codes.numel() + q.scales.numel()) / n:.4f} bytes per weight, "
          f"+ {4 * q.global_scale.numel()} bytes per tensor")
    print(f"bf16: 2 bytes per weight, {2 / 0.5625:.2f}x more")
    '''),
    md(r'''
    Shapes NVFP4 cannot represent raise an error that says what was expected:
    '''),
    code(r'''
    for bad in (torch.randn(4, 200), torch.tensor([[1.0, float("nan")] * 8])):
        try:
            nvfp4.quantize(bad.to(DEVICE))
        except ValueError as err:
            print("ValueError:", err)
    '''),
    # ---------------------------------------------------------------------------------------------------------- 4
    md(r'''
    ## 4. Quantisation error

    How much do 4 bits lose? On fp32 weights of two shapes, a Gaussian and a heavy-tailed Student-t (3 degrees of
    freedom: occasional weights many standard deviations out, as real checkpoints have), we compare against the fp32
    weights:

    * **bf16**: plain rounding, the unit of `err_ratio`;
    * **NVFP4**: `quantize` then `dequantize` from the package;
    * **int4 g16**: a toy symmetric int4 quantiser written right here (not a library kernel): groups of 16, scale
      `absmax / 7` stored in fp32 or bf16, integer levels -7..7. Same group size as NVFP4, so the difference is the
      grid: 15 evenly spaced levels against E2M1's 15 levels that are dense near 0.
    '''),
    code(r'''
    def int4_group_roundtrip(w: torch.Tensor, group: int = 16, scale_dtype=torch.float32) -> torch.Tensor:
        """Toy symmetric int4 quantise + dequantise, one absmax scale per `group` elements along the last dim."""
        blocks = w.unflatten(-1, (-1, group))
        scale = (blocks.abs().amax(-1, keepdim=True) / 7).to(scale_dtype).float()
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        return (torch.clamp(torch.round(blocks / scale), -7, 7) * scale).flatten(-2)


    gen = torch.Generator().manual_seed(0)
    N, K, DF = 128, 1024, 3
    gaussian = torch.randn(N, K, generator=gen) * 0.02
    chi2 = (torch.randn(DF, N, K, generator=gen) ** 2).sum(0)
    student_t = torch.randn(N, K, generator=gen) / (chi2 / DF).sqrt() * 0.02

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
    '''),
    code(r'''
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
    '''),
    code(r'''
    def rel(dist, fmt):
        return next(r["m"].rel_l2 for r in err_rows if r["weights"] == dist and r["format"] == fmt)


    for dist in dists:
        ratio = rel(dist, "nvfp4") / rel(dist, "int4 g16, fp32 scale")
        verdict = "lower" if ratio < 1 else "higher"
        print(f"{dist}: NVFP4's error is {ratio:.3f}x the int4 g16 error ({verdict}), "
              f"at 0.5625 against 0.75 bytes per weight")
    '''),
    md(r'''
    On Gaussian weights the evenly spaced int4 grid does a little better; on heavy-tailed weights a block often
    holds one large value and many small ones, and E2M1's levels near 0 win. Both are some 50-70x the error of
    bf16 rounding: 4-bit weights are a trade of accuracy for bandwidth, to be measured at the model level (perplexity
    and greedy agreement of a trained model in bf16 and NVFP4: not done yet), not hidden.

    **Two recipes.** Checkpoints come from two quantisers, ModelOpt and compressed-tensors (llm-compressor). They
    agree on the format and differ in the scale arithmetic: ModelOpt computes the global scale `amax / 2688` in fp32,
    compressed-tensors stores its reciprocal `2688 / amax` computed in the weight's dtype (bf16 for bf16 weights),
    and the block scale is `block_amax / (6 g)` in one and `(1/g) * (block_amax / 6 rounded to bf16)` in the other.
    The results differ in the last bits, which moves some block scales by one E4M3 step. The package reproduces
    both bit for bit (`recipe=`). How many block scales and codes differ on bf16 weights, with each recipe's own
    global scale and with one shared global scale:
    '''),
    code(r'''
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
    '''),
    md(r'''
    Up to a few percent of block scales, depending on where the tensor's amax happens to fall; the error against
    the original is about the same for both. What matters is that a kernel reproducing one checkpoint uses that checkpoint's
    recipe, and that tests compare bits, not tolerances.
    '''),
    # ---------------------------------------------------------------------------------------------------------- 5
    md(r'''
    ## 5. The dequantise kernel, step by step

    Dequantise is a streaming kernel: read 0.5625 bytes per weight, write 2 (bf16), no reuse. Speed is bytes per
    second, and the arithmetic per element must be cheap. We build toy kernels under two rules the interpreter
    imposes (docs/interpreter.md): fp32 arithmetic only (the interpreter's bf16 arithmetic is wrong) and float32
    outputs. Each step must match the reference **bit for bit**.

    **Step 1: one program per row, a lookup table.** Each element loads the byte that holds its code (two elements
    share a byte), shifts out its nibble (even element: low nibble), looks the value up in the 16-entry E2M1 table,
    and multiplies by its block's scale `scales[k // 16]`, read as E4M3 and widened to fp32, times the global scale.
    The product is ordered as in the reference, `value * (scale * global)`, so the rounding is the same.
    '''),
    code(r'''
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
    '''),
    md(r'''
    Step 1 is correct but wasteful: every byte is loaded twice, a row is one program whatever its length, and the
    table lookup is a gather.

    **Step 2: a 2-D tile, each byte loaded once, arithmetic decode, the block scale broadcast.** A program owns a
    `BLOCK_R x BLOCK_K` tile. It loads `BLOCK_K / 2` bytes per row once, splits them into low and high nibbles and
    interleaves them back into element order. It decodes E2M1 with the formula of section 1 instead of a table
    (`2^(e-1)` as an integer shift, so it is exact). The `BLOCK_K / 16` scales of a row are loaded once and
    broadcast over their 16 elements by viewing the tile as `[BLOCK_R, BLOCK_K/16, 16]`. Masks cover the ragged
    edges, such as K = 208 in a 128-wide tile.

    One trap: the sign. On the GPU Triton compiles `-x` as `0 - x`, which turns code 0x8 (-0.0) into +0.0, while
    the interpreter keeps the sign. The kernel applies the sign with a multiply by ±1.0 instead, which keeps it on
    both. `max_abs` cannot see this kind of error (-0.0 equals +0.0); `mismatches` compares bits and does.
    '''),
    code(r'''
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
    '''),
    md(r'''
    **Step 3: hand over to the package.** `lynn_kernels.nvfp4.dequantize` is the same 2-D tile with three more
    ideas (see `_nvfp4_dequantize_kernel` in `lynn_kernels/nvfp4/triton_quant.py`):

    * it reads the scales as raw bytes and decodes E4M3 with integer ops, so the result does not depend on how a
      backend converts fp8;
    * it writes bf16 (or fp16, fp32) with round-to-nearest-even on every backend, handles any leading dims (one
      global scale per expert for stacked `[E, N, K]` weights) and is autotuned over tile shapes on the GPU;
    * it decodes E2M1 with a **bit trick** instead of arithmetic: drop the code's three magnitude bits `e1 e0 m`
      into an fp16 word at bits 11..9 (the two low exponent bits and the top mantissa bit) and its sign bit at
      bit 15. The fp16 word then reads `2^(e-15) (1 + m/2) = value x 2^-14` for `e > 0`, and for `e = 0` it is an
      fp16 subnormal, `2^-14 x (512 m / 1024) = value x 2^-14`, so subnormals come out right too. The factor `2^14`
      is folded into the per-block scale (one multiply per 16 elements; a power of two, so exact). Per element:
      two shifts, two ands, an or and an fp16-to-fp32 convert: no table, no branch.

    The trick, checked on all 16 codes in plain torch/numpy:
    '''),
    code(r'''
    nib = np.arange(16, dtype=np.uint16)
    half_bits = ((nib & 7) << 9) | ((nib & 8) << 12)
    as_half = half_bits.view(np.float16).astype(np.float32)
    print("code  fp16 bits          fp16 value      x 2^14   e2m1")
    for c in range(16):
        print(f" 0x{c:x}  {int(half_bits[c]):016b}  {as_half[c]:+.6e}  {as_half[c] * 2 ** 14:+5.1f}  {table[c]:+5.1f}")
    print("value x 2^-14 for every code:", bool(np.all(as_half * 2 ** 14 == np.array(table, dtype=np.float32))))
    '''),
    code(r'''
    # NBVAL_IGNORE_OUTPUT
    # the lines of the package kernel that do it (read from the source, so this stays true)
    import inspect

    from lynn_kernels.nvfp4 import triton_quant

    src = inspect.getsource(triton_quant).splitlines()
    start = next(i for i, line in enumerate(src) if "E2M1 magnitude bits dropped" in line)
    print("\n".join(src[start:start + 7]))
    '''),
    code(r'''
    rows += [{"kernel": "package: nvfp4.dequantize", "case": name,
              "m": compare(nvfp4.dequantize(q, torch.float32), want, exact=True)} for name, q, want in toy_cases]
    print(render_table(rows, ["kernel", "case", "cosine", "max_abs", "mismatches"]))
    '''),
    # ---------------------------------------------------------------------------------------------------------- 6
    md(r'''
    ## 6. Validation table

    `lynn check nvfp4` (quantise both recipes and dequantise to bf16 and fp32, compared bit for bit with the
    reference, plus the round-trip error), followed by a few harder cases: a single block, a block of zeros next
    to a 10^4 outlier at K = 208, fp16 in and out, and stacked experts `[E, N, K]` with one global scale per expert
    (passed to `quantize`, and built with `NVFP4Tensor.stack`).
    '''),
    code(r'''
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

    base, _ = checks.run_checks(["nvfp4"])
    all_rows = base + [{"backend": lk.backend(), **r} for r in extra]
    print(checks.table(rounded(all_rows), columns=checks.PORTABLE_COLUMNS))
    print(f"\n{sum(r['passed'] for r in all_rows)}/{len(all_rows)} passed")
    '''),
    # ---------------------------------------------------------------------------------------------------------- 7
    md(r'''
    ## 7. Profile on the H200, from committed results

    **Goal**: dequantise at **85% or more of the measured copy bandwidth** on problems that move at least 64 MiB,
    and quantise at **60% or more**. Both are streaming ops, so a copy of the same bytes is the honest ceiling.

    On a CPU nothing is timed: the cells below read `data/bench/h200/` (written by `lynn bench nvfp4` on the
    H200), whatever results are committed there now. Bytes are the fewest the op must move; a provider that moves
    more (for example a separate amax pass over `w` before quantising) is still charged only those, and each row's
    `note` says so.
    '''),
    code(r'''
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
    '''),
    code(r'''
    # NBVAL_IGNORE_OUTPUT
    GOALS = {"nvfp4.dequantize": 0.85, "nvfp4.quantize": 0.60}
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.6))
    for ax, (op, doc) in zip(axes, docs.items()):
        plots.plot_bandwidth(doc, ax=ax)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2)   # below, off the bars
        ax.axhline(GOALS[op] * doc["ceilings"]["copy_gbps"], ls=":", c="tab:red", lw=1)
        ax.text(-0.45, GOALS[op] * doc["ceilings"]["copy_gbps"], f"goal {GOALS[op]:.0%}", va="bottom",
                fontsize=8, color="tab:red")
    plt.tight_layout()
    plt.show()
    '''),
    code(r'''
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
    '''),
    md(r'''
    On a GPU, the cell below also times the package's dequantise live with `triton.testing.do_bench`, next to a
    copy of the same bytes in the same process (a small run, not the full benchmark; `lynn bench nvfp4` is that).
    '''),
    code(r'''
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
    '''),
    # ---------------------------------------------------------------------------------------------------------- 8
    md(r'''
    ## 8. Explorer: one block, taken apart

    `describe_block` quantises one block of 16 values as the first row of a tensor whose amax is
    `block amax / (block/tensor amax)` (a second row stands for the rest of the tensor, so each recipe picks its own
    global scale from it) and prints every intermediate: amax, the global scale, the E4M3 block scale (value and
    hex), the codes, the packed bytes, and per element the scaled value, its code and the error. A fixed example
    first (checked in CI), then the widgets.
    '''),
    code(r'''
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
    '''),
    code(r'''
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
    '''),
    md(r'''
    Things to try: move **block / tensor amax** down towards 10^-4 and watch the E4M3 scale fall into the
    subnormals (codes below 0x08) and the error grow; raise the **outlier** and watch the small values collapse to
    code 0; switch the **recipe** and look for a scale one step apart; type a block of your own, such as 16 equal
    values, or values that sit exactly on the E2M1 ties.

    Next: `02-packed-matvec` decodes these blocks inside a matrix-vector product instead of writing bf16
    out.
    '''),
]

# =================================================================================================================
# 02-packed-matvec
# =================================================================================================================

PACKED_MATVEC = [
    md(r'''
    # 02: Packed W4A16 matvec and GEMM

    A linear layer with NVFP4 weights (notebook 01) and bf16 activations: `y = x W^T`, with `W` read straight from
    its packed codes and scales and never written out in bf16. At batch 1 (decode) this product is limited by how
    fast the weights can be read, so 4-bit weights can make it faster, not only smaller; for long prompts (prefill)
    it is a GEMM limited by the tensor cores. This notebook:

    1. the product and the roofline: why decode is about bytes, and the plan
    2. the reference
    3. the kernel step by step: (a) a naive kernel, (b) a tile of rows, (c) split-K with a deterministic reduce,
       (d) the package's tiled GEMM and its packed bf16x2 decode
    4. the kernel layout (`pack`): 8 codes in a 32-bit word, decoded by shifts and masks; its kernels, and what
       they measured on the H200
    5. the validation table
    6. `NVFP4Linear`: quantisation as a module swap, on a small MLP
    7. the H200 profile against cuBLAS bf16, from committed results
    8. an interactive explorer of those results
    9. what we measured, and what's next

    Everything runs on a CPU through Triton's interpreter, on small shapes; on a GPU the same cells run compiled.
    '''),
    code(r'''
    %matplotlib inline
    import copy
    import dataclasses
    import math

    import lynn_kernels as lk                # first: it picks the backend before any kernel is defined
    import matplotlib.pyplot as plt
    import torch
    import triton
    import triton.language as tl
    from torch import nn

    from lynn_kernels import checks, compare, nvfp4, render_table
    from lynn_kernels.bench import load
    from lynn_kernels.bench.matmul import SHAPES
    from lynn_kernels.matmul import (NVFP4Linear, nvfp4_gemm, nvfp4_gemv, nvfp4_linear, quantize_linears,
                                     reference, triton_matmul)
    from lynn_kernels.runtime import DEVICE


    def r4(v):
        """4 significant digits: enough to read, and float noise cannot change the committed output (nbval compares
        it as text)."""
        return v if v is None else float(f"{v:.4g}")


    def bound(v):
        """The power of ten at or above ``v`` (0 stays 0). The digits of fp32 round-off depend on the order of the
        sums (another CPU's BLAS, the GPU's tensor cores); its order of magnitude does not."""
        if v is None or v == 0 or not math.isfinite(v):
            return v
        return 10.0 ** math.ceil(math.log10(v))


    def rounded(rows):
        """Table rows with their Metrics made portable: cosine to 6 decimals, the error figures by ``bound``."""
        def fix(m):
            return dataclasses.replace(m, cosine=round(m.cosine, 6), max_abs=bound(m.max_abs),
                                       rel_l2=bound(m.rel_l2), err_ratio=bound(m.err_ratio))

        return [{k: fix(v) if isinstance(v, lk.Metrics) else v for k, v in row.items()} for row in rows]
    '''),
    code(r'''
    # NBVAL_IGNORE_OUTPUT
    print(lk.device_summary())
    '''),
    # ---------------------------------------------------------------------------------------------------------- 1
    md(r'''
    ## 1. The product, and why decode is about bytes

    `x [M, K]` holds M tokens of activations (bf16), `W [N, K]` the weights, and `y = x W^T` is `[M, N]`. With `W`
    in NVFP4 every weight is `e2m1(code) x scale x g` (notebook 01, section 3), so the product factors:

    $$
    y_{mn} \;=\; g \sum_{b=0}^{K/16-1} s_{nb} \sum_{k=16b}^{16b+15} \text{e2m1}(c_{nk})\; x_{mk}
    $$

    * the **global scale** `g` leaves the sum: one multiply per output, in the epilogue;
    * the **block scale** `s_nb` changes every 16 elements of K, so it multiplies the decoded weights;
    * `e2m1 x s` has at most 2 + 4 = 6 significant bits, and bf16 holds 8: the decoded, block-scaled weight is
      **exact** in bf16, so bf16 tensor cores multiply the true weights (up to `g`), and the only differences from
      the fp32 reference (which rounds `e2m1 x s x g` per weight) are where `g` is rounded in, the order of the fp32
      additions and the final rounding.

    **Bytes, not flops.** The product does `2MNK` flops and must read every weight once: 2 bytes per weight in
    bf16, `0.5 + 1/16 = 0.5625` in NVFP4 (a nibble, plus one E4M3 scale per 16). Its arithmetic intensity is about
    `2M / (bytes per weight)` flops per byte. A GPU that reads `B` bytes/s and multiplies at `P` flop/s is
    bandwidth-bound below the *ridge* `P / B`. With the H200's ceilings, measured by the benchmark and committed
    with it:
    '''),
    code(r'''
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
    '''),
    md(r'''
    At M = 1 both formats sit far below the ridge: the time is the weight bytes over the bandwidth, and NVFP4 moves
    `2 / 0.5625 = 3.56x` fewer of them. That ratio is the most a packed GEMV can gain over cuBLAS bf16, and only if
    decoding costs nothing; hence the goal of **3x** (and 75% of the read ceiling). Past the ridge (prefill) the
    tensor cores set the time and the packed kernel can at best match cuBLAS, while doing the decode on top; the
    goal there is **0.7x** of cuBLAS bf16.

    **The plan.**

    * **decode in registers**: each program loads packed bytes and scales for a tile of `W`, turns them into
      exact bf16 values with a few integer operations, and feeds them straight to `tl.dot`; no bf16 copy of `W`
      ever exists in memory;
    * **bf16 tensor cores**: since `e2m1 x s` is exact in bf16, the product runs on the same MMA instructions as
      cuBLAS's bf16 GEMM, with fp32 accumulation;
    * **the global scale in the epilogue**: one multiply of the fp32 accumulator per output, then the bias, then one
      rounding to `x`'s dtype.
    '''),
    # ---------------------------------------------------------------------------------------------------------- 2
    md(r'''
    ## 2. The reference

    `lynn_kernels.matmul.reference.nvfp4_linear(x, w, bias=None)` is the executable spec, and every kernel takes the
    same arguments in the same order: `x [..., K]` in bf16, fp16 or fp32, `w` an `NVFP4Tensor [N, K]`, `bias [N]`
    or None; it returns `[..., N]` in `x`'s dtype. It dequantises `W` to fp32 with the nvfp4 reference, does one
    fp32 matmul, adds the bias in fp32 and rounds once (`nvfp4_gemv` and `nvfp4_gemm` share it):
    '''),
    code(r'''
    # NBVAL_IGNORE_OUTPUT
    import inspect

    print(inspect.getsource(reference.nvfp4_linear))
    '''),
    md(r'''
    A small example: 2 tokens, 4 outputs, K = 32 (two blocks). The factored form of section 1, written out in
    float64 from the codes and scales, gives the same bf16 outputs:
    '''),
    code(r'''
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
    '''),
    md(r'''
    Arguments it cannot take raise an error that says what was expected:
    '''),
    code(r'''
    for bad in (torch.randn(2, 48), torch.randint(0, 4, (2, 32))):
        try:
            reference.nvfp4_linear(bad.to(DEVICE), q)
        except (TypeError, ValueError) as err:
            print(f"{type(err).__name__}: {err}")
    '''),
    # ---------------------------------------------------------------------------------------------------------- 3
    md(r'''
    ## 3. The kernel, step by step

    The interpreter's bf16 arithmetic is wrong (docs/interpreter.md), so the toy kernels below take **fp32
    activations** and write **fp32 outputs**; the package's kernels load bf16 and convert on the fly. Each step is
    checked against the reference on two cases:

    * **grid**: weights built directly from random codes, block scales between 1 and 15 and a global scale of
      2^-6, and activations that are multiples of 1/8 in [-1, 1]. Every product `x * e2m1 * s` is then a multiple
      of 2^-7 below 90 in magnitude, so for K up to 1456 (we use at most 1280) every partial sum is a multiple of
      2^-7 below 2^17: 24 significant bits at most, which fp32 holds **exactly, whatever the order of the
      additions**. A correct kernel
      must match the reference **bit for bit** here (`mismatches` = 0), on any CPU or GPU.
    * **randn**: quantised Gaussian weights and activations, K = 208 (13 blocks: not a multiple of any tile). Now
      the order of the additions moves the last bits, so `max_abs` and `rel_l2` sit at fp32 round-off; the tables
      show them as the power of ten at or above them (`bound`), which does not depend on the machine.
    '''),
    code(r'''
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
    '''),
    md(r'''
    **(a) Naive: one program per output.** Program `(m, n)` walks along row `n` of `W`, 64 weights at a time. Each
    weight loads the byte that holds its code (two weights share a byte, so every byte is loaded twice), shifts out
    its nibble (even element: low nibble), looks its value up in the 16-entry E2M1 table and multiplies it by its
    block's scale times the global scale, in the reference's order `e2m1 * (s * g)`. The products with `x[m, k]`
    accumulate in fp32 and are summed at the end.
    '''),
    code(r'''
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
    '''),
    md(r'''
    Correct, and slow in every way that matters on a GPU: each byte is loaded twice, each row of `W` is read once per
    token, a program does one output, and the scale multiply happens per weight.

    **(b) A tile of rows, the scales where they belong.** Program `(pid_n, m)` owns `BLOCK_N` rows of `W` for one
    row of `x`. Each step loads a `[BLOCK_N, BLOCK_K/2]` tile of bytes **once**, splits every byte into its two
    nibbles and interleaves them back into element order, looks up the values, and multiplies each group of 16 by
    its block scale by viewing the tile as `[BLOCK_N, BLOCK_K/16, 16]`. The products with `x` are reduced along K
    into `BLOCK_N` fp32 sums, and the global scale multiplies them **once**, at the end. Masks cover the ragged
    edges (K = 208 in 128-wide steps, N = 40 in 32-row tiles). The association changes from
    `sum(x * (e2m1 * (s * g)))` to `g * sum(x * (e2m1 * s))`: the same number in exact arithmetic (the grid case),
    different last bits on random data.
    '''),
    code(r'''
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
    '''),
    md(r'''
    Step (b) already has the shape of the package's GEMV (`_nvfp4_gemv_kernel`, last rows above), which adds three
    things: a program handles up to 16 rows of `x` at once, as a `tl.dot` on the tensor cores with the rows padded
    to 16 (at decode the MMA is nearly free: the decode is the work); the E2M1 values come from bit operations
    instead of a table (notebook 01, section 5; on the GPU, the packed decode of step (d)); and K can be split
    across programs.

    **(c) Split-K, and a reduce that always gives the same bits.** A GEMV program covers `BLOCK_N` rows of `W` (the
    package's fixed `GEMV_CONFIG`), so a projection with few outputs makes few programs, while the GPU needs
    several per SM to keep enough loads in flight to pull its share of the bandwidth. N alone cannot fill the GPU
    at decode; K can be split as well: program `(pid_n, pid_k)` reduces its rows over one slice of K, and the
    slices' partial sums are added at the end. `split_k_for` aims at about two programs per SM:
    '''),
    code(r'''
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
    '''),
    md(r'''
    How to add the partials? The easy way, `tl.atomic_add` of fp32 partials into `y`, adds them in whatever order
    the programs happen to finish, so `y` changes from run to run in its last bits (and must be zeroed first). The
    package does this instead (`_finish` in `triton_matmul.py`):

    1. each program stores its fp32 partial tile in a workspace `[split, M, N]`;
    2. after a barrier it takes a **ticket**, `atomic_add(counter[tile], 1)` with acquire-release semantics, so the
       partials stored before every ticket are visible to whoever draws the last one;
    3. the program that draws ticket `split - 1` adds the partials **in split order 0, 1, ..., split - 1**, applies
       `g` and the bias, writes `y`, and resets the counter to 0, so one zeroed int32 buffer serves every call.

    The order of the sum is fixed by the split, not by timing: the same inputs and the same split give the same
    bits on every run. Different splits add in different orders, so on random data they may differ in the last
    fp32 bit; on the grid case, where every order is exact, they must agree. `launch_gemv(x2, w, bias, y,
    split_k=...)` forces a split (K = 1280 is five chunks of 256: split 2 makes slices of 3 and 2 chunks, split 3
    of 2, 2 and 1):
    '''),
    code(r'''
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
    print("ticket counters back at zero:", all(int(c.abs().sum()) == 0 for c in triton_matmul._counters.values()))
    '''),
    md(r'''
    On the random case the splits add in different orders; how many fp32 results that moves depends on the machine
    (its BLAS, or the GPU's tensor cores), so this count is not checked:
    '''),
    code(r'''
    # NBVAL_IGNORE_OUTPUT
    name = "randn 2x96x1280 fp32"
    for split in (2, 3):
        a, b = split_out[name, split], split_out[name, 1]
        rel = ((a - b).abs().max() / b.abs().max()).item()
        print(f"{name}: split {split} vs split 1: {compare(a, b, exact=True).mismatches}/{a.numel()} values "
              f"differ, by at most {rel:.1e} of max |y|")
    '''),
    md(r'''
    **(d) The tiled GEMM: hand over to the package.** For prefill, M is large and each decoded weight tile should
    serve many tokens. `nvfp4_gemm` (`_nvfp4_gemm_kernel`) tiles M as well: a program owns a `BLOCK_N x BLOCK_M`
    tile of `y^T` and walks K in steps of `BLOCK_K`. Three ideas:

    * **The transposed product.** It computes `y^T [N, M] = W [N, K] @ x^T [K, M]`, so the decoded weight tile is
      the **first** `tl.dot` operand and the activation tile the second. On Hopper, wgmma's first operand may come
      straight from registers, which is where the decode leaves the weights, while the second must sit in shared
      memory, where a plain load of `x` can put it. It suits decode as well: the MMA's first dimension is 64 per
      warpgroup while its second can be as small as 8, so 64 weight rows times a few tokens wastes little, where
      `x @ W^T` would pad one token to 64 rows. The epilogue writes `acc[n, m]` to `y[m, n]`.
    * **Grouped tile order.** Consecutive programs take `GROUP_N = 8` weight tiles and sweep every token tile over
      them before moving on, so that band of `W` stays in L2 while all of M passes (in plain row-major order every
      token tile would stream all of `W` again).
    * **The same split-K and epilogue** as the GEMV, for shapes whose tiles cannot fill the GPU.

    The launch order, by the kernel's own formula, for 5 weight tiles x 4 token tiles and `GROUP_N = 2`:
    '''),
    code(r'''
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
    '''),
    md(r'''
    Programs 0-7 touch only weight tiles 0 and 1; tile 4, alone in the last group, is swept last. The package's GEMM
    on a grid case in bf16 (bit for bit) and a random case in fp32, M = 40:
    '''),
    code(r'''
    gemm_cases = {"grid 40x96x512 bf16": grid_case(40, 96, 512, seed=2, dtype=torch.bfloat16),
                  "randn 40x100x208 fp32": randn_case(40, 100, 208, seed=2)}
    rows = check_rows("package nvfp4_gemm", nvfp4_gemm, gemm_cases)
    print(render_table(rounded(rows), COLUMNS))
    '''),
    md(r'''
    **The packed bf16x2 decode (GPU, bf16 activations).** The portable decode (`_load_w_tile`: under the interpreter,
    and for fp16 or fp32 activations) turns each nibble into an fp16 word and converts it to fp32. On the GPU with
    bf16 activations, `_e2m1_bf16x2_scaled` instead works on bf16 pairs in inline PTX, two weights per
    instruction:

    1. `prmt` spreads two code bytes into the two 16-bit halves of a 32-bit register;
    2. shifts and masks drop each nibble's magnitude bits `e1 e0 m` onto bf16 bits 8..6 (the two lowest exponent
       bits and the top mantissa bit) and its sign bit onto bit 15. A bf16 with exponent field `e` and top mantissa
       bit `m` is `2^(e-127) (1 + m/2)` for `e > 0`, and the subnormal `(m/2) 2^-126` for `e = 0`: in both cases
       **exactly `e2m1 x 2^-126`**;
    3. one `mul.rn.bf16x2` by the block scale pre-multiplied by `2^119` gives `e2m1 x scale x 2^-7`. The scale times
       `2^119` is exact in bf16 (E4M3 has 4 significant bits, and `448 x 2^119 < 2^128` stays finite); the product
       has at most 6 significant bits and lies between `2^-17` and `2688 x 2^-7 = 21`, a normal bf16: **the
       multiply is exact**, its rounding never rounds;
    4. the epilogue multiplies the fp32 accumulator by `g x 2^7`.

    Why `2^119` and not `2^126`? `448 x 2^126` would overflow bf16; `2^119` keeps every scale finite, and the result
    stays far above bf16's subnormals. The identity in plain torch, first the 16 codes:
    '''),
    code(r'''
    codes = torch.arange(16, dtype=torch.int32)
    bits = ((codes & 7) << 6) | ((codes & 8) << 12)                       # magnitude -> bits 8..6, sign -> bit 15
    as_bf16 = bits.to(torch.int16).view(torch.bfloat16)                   # e2m1 x 2^-126 (0 and 0.5: subnormals)
    e2m1 = nvfp4.e2m1_table()
    print("code  bf16 bits          bf16 value x 2^126   e2m1")
    for c in range(16):
        print(f" 0x{c:x}  {int(bits[c]):016b}   {as_bf16[c].float().item() * 2.0 ** 126:+5.1f}              "
              f"{e2m1[c].item():+.1f}")
    '''),
    md(r'''
    then all 16 codes times every positive finite E4M3 scale, through a bf16 multiply (rounded to nearest, as
    `mul.rn.bf16x2`), and the PTX's exact shifts and masks on all 256 byte values (even element: `shl 6`, `shl 12`;
    odd element: `shl 2`, `shl 8`; masks `0x01C0` and `0x8000` in each half):
    '''),
    code(r'''
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
    '''),
    code(r'''
    # NBVAL_IGNORE_OUTPUT
    # the PTX in the package (read from the source, so this stays true): the even elements of bytes 0 and 1
    src = inspect.getsource(triton_matmul._e2m1_bf16x2_scaled.fn).splitlines()
    start = next(i for i, line in enumerate(src) if "prmt.b32 t01" in line)
    print("\n".join(src[start:start + 8]))
    '''),
    md(r'''
    The interpreter has no inline assembly, so this path runs only on the GPU, where `tests/test_matmul.py` checks
    it (the `gpu` marker); the identity above is what makes it bit-compatible with the portable decode.
    '''),
    # ---------------------------------------------------------------------------------------------------------- 4
    md(r'''
    ## 4. The kernel layout: 8 codes in a 32-bit word

    Section 3's kernels read the checkpoint layout as it is stored: a byte of two codes (the even element in the
    low nibble) and an E4M3 scale byte per 16 elements. At decode, where each weight is used once, the work is the
    decode itself: every instruction spent per weight is time (`docs/matmul.md` counts them). So
    `lynn_kernels.matmul.pack(w)` rewrites a weight **once, at load time**, into a second layout, a `PackedNVFP4`,
    that is cheaper to decode; `unpack` gives the checkpoint layout back. Every op takes either form:

    * **words**: int32 `[N, K/8]`; a word holds the 8 codes of positions `8i .. 8i + 7` of one row, their bits placed
      so that two shifts, two masks and an OR bring a *pair* of them into the bits of two bf16s, each equal to
      `e2m1 x 2^-126` (the identity of section 3 (d), with no byte shuffling first);
    * **scales**: uint8 `[N, K/16]`, each E4M3 scale `s = 2^e (1 + m/8)` re-encoded as the byte `(e + 10) << 3 | m`,
      which a shift and an OR turn into the fp32 `s x 2^75` (for the FMA GEMV) or `s x 2^107` (for the tensor-core
      kernels): no table and no subnormal case;
    * **global scale**: unchanged, applied once per output in the epilogue, with the powers of two folded in.

    A packed weight with M <= 2 rows of `x` goes to a GEMV on the FMA units (`packed_gemv_kernel` in
    `triton_packed.py`), up to M = 16 to the tensor-core GEMV of section 3 and above to the GEMM, both reading
    the packed words through `packed_w_tile`.

    **(a) Pack, unpack.** A small weight, 4 rows of K = 64 (four blocks a row). The layout takes the same bytes,
    and it is exact: `unpack(pack(q))` dequantises to the same values, bit for bit.
    '''),
    code(r'''
    from lynn_kernels.matmul import pack, packed, unpack

    gen = torch.Generator().manual_seed(4)
    q = nvfp4.quantize((torch.randn(4, 64, generator=gen) * 0.02).to(DEVICE))     # N = 4, K = 64
    p = pack(q)
    print(p)
    print(f"checkpoint: codes {list(q.codes.shape)} uint8 (2 codes a byte), scales {list(q.scales.shape)} E4M3, "
          f"{q.nbytes} bytes")
    print(f"packed:     words {list(p.words.shape)} int32 (8 codes a word), scales {list(p.scales.shape)} uint8 "
          f"(re-encoded), {p.nbytes} bytes")

    back = unpack(p)
    same = compare(nvfp4.reference.dequantize(back, torch.float32), nvfp4.reference.dequantize(q, torch.float32),
                   exact=True)
    print(f"unpack(pack(q)) dequantises to the same fp32 values: max_abs = {same.max_abs:g}, "
          f"mismatches = {same.mismatches}")
    print("codes and scales come back as stored:", torch.equal(back.codes, q.codes),
          torch.equal(back.scales.view(torch.uint8), q.scales.view(torch.uint8)))
    '''),
    md(r'''
    (A zero scale or a negative one would come back normalised: `pack` zeroes the codes of a zero-scale block and
    moves a negative scale's sign into the codes, so the values are the same; `quantize` makes neither.)

    **(b) One word, bit by bit.** Each element owns four bits of its word: a sign bit and three magnitude bits
    `e1 e0 m` (notebook 01). The even elements (0, 2, 4, 6) live in the low half, the odd ones in the high half, so
    a pair `(2p, 2p + 1)` sits at the same place in both halves and one 32-bit shift moves both. Pair `p` is
    decoded by two shifts from `PAIR_SHIFTS[p]`: one brings its sign bits to 15 / 31 (the bf16 sign), the other
    its magnitude bits to 8..6 / 24..22. The bits are placed so the four pairs need only five distinct shifts
    (`<< 3, 4, 5, 6` and `>> 6`); pair 0 needs no sign shift and pair 1 no magnitude shift. `packed.SIGN_BIT` and
    `packed.MAG_BIT` hold the places:
    '''),
    code(r'''
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
    '''),
    code(r'''
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
    '''),
    md(r'''
    **(c) Decoding a word by hand.** What `decode_word` does, in torch on int64s holding 32-bit patterns: for pair
    `p` with shifts `(a, b)`, `t = (q << a) & 0x80008000 | (q << b) & 0x01C001C0` keeps only the pair's sign and
    magnitude bits, now where a bf16 keeps them. A bf16 is the top half of an fp32, so `t << 16` (the low half) and
    `t & 0xFFFF0000` (the high half) *are* the two fp32 values `e2m1 x 2^-126`, zeros and the subnormal 0.5 included.
    Five shifts shared by the four pairs, and an AND plus an AND-OR per pair: 13 integer operations for 8 weights.
    Word 0 of row 0, against the E2M1 values the reference reads from the checkpoint codes:
    '''),
    code(r'''
    U32 = 0xFFFFFFFF


    def shift(v, s):
        """``v << s`` (``s < 0``: ``v >> -s``) on 32-bit words held in int64."""
        return (v << s) & U32 if s >= 0 else v >> -s


    def as_fp32(bits):
        """32-bit patterns held in int64 -> the fp32 values they encode."""
        return torch.where(bits >= 2 ** 31, bits - 2 ** 32, bits).to(torch.int32).view(torch.float32)


    def decode_by_hand(words):
        """int32 words ``[...]`` -> their 8 elements ``e2m1 * 2^-126`` as fp32 ``[..., 8]``, in K order."""
        v = words.to(torch.int64) & U32
        out = []
        for a, b in packed.PAIR_SHIFTS:
            t = (shift(v, a) & 0x80008000) | (shift(v, b) & 0x01C001C0)       # a bf16 pair
            out += [as_fp32((t << 16) & U32), as_fp32(t & 0xFFFF0000)]          # low half: element 2p; high: 2p + 1
        return torch.stack(out, dim=-1)


    codes = nvfp4.reference.unpack_nibbles(q.codes.cpu())                       # [N, K], checkpoint order
    want = nvfp4.e2m1_table()[codes.long()]                                     # the reference's E2M1 values
    word = p.words.cpu()[0, 0]
    got = decode_by_hand(word)
    print(f"row 0, word 0 (K = 0..7): 0x{int(word) & U32:08x} = {int(word) & U32:032b}")
    print(render_table([{"element": j, "code": f"0x{int(codes[0, j]):x}",
                         "fp32 bits": f"0x{int(got[j:j + 1].view(torch.int32)) & U32:08x}",
                         "value x 2^126": got[j].item() * 2.0 ** 126, "reference e2m1": want[0, j].item()}
                        for j in range(8)]))
    every = decode_by_hand(p.words.cpu()).reshape(want.shape) * 2.0 ** 126
    print(f"all {p.words.numel()} words ({want.numel()} elements) decode to the reference's E2M1 values:",
          bool((every == want).all()), "| signs of zero too:", bool((every.signbit() == want.signbit()).all()))
    '''),
    md(r'''
    The scales, on every positive finite E4M3 value (one block per row, so `pack` re-encodes each once): the byte
    shifted into an fp32's exponent field and OR-ed with a constant exponent bias is `s x 2^75` or `s x 2^107`,
    E4M3's subnormal scales included (`pack` normalises them):
    '''),
    code(r'''
    e4m3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    pos = e4m3[torch.isfinite(e4m3.float()) & (e4m3.float() > 0)]              # the 126 positive finite E4M3 values
    one_block = lk.NVFP4Tensor(torch.zeros(pos.numel(), 8, dtype=torch.uint8), pos[:, None], torch.tensor(1.0))
    sb = pack(one_block).scales.to(torch.int64)[:, 0]                         # one re-encoded byte per scale
    for kind in ("fma", "mma"):
        dec = as_fp32((sb << 20) | packed.SCALE_OR[kind])
        print(f"{kind}: (byte << 20) | 0x{packed.SCALE_OR[kind]:08x} = s x 2^{packed.SCALE_EXP[kind]} for all "
              f"{pos.numel()} positive E4M3 scales:", bool((dec == pos.float() * 2.0 ** packed.SCALE_EXP[kind]).all()))
    '''),
    md(r'''
    The FMA GEMV multiplies the decoded `e2m1 * 2^-126` by `x * 2^64`, so every product `e2m1 * x * 2^-62` is a
    normal fp32 and exact; a word's 8 products are one FMA chain, scaled by its block's `s * 2^75` with one more
    FMA, and the epilogue multiplies by `g * 2^-13`. The tensor-core tile multiplies by `s * 2^107` instead, giving
    `e2m1 * s * 2^-19`, exact in bf16 (six significant bits), and the epilogue undoes the `2^-19`. Every step is
    exact but the fp32 additions, as in the reference.

    **(d) The three kernels on the packed layout.** `nvfp4_linear(x, pack(w))` at M = 1 and 2 (the FMA GEMV),
    M = 8 (the tensor-core GEMV) and M = 40 (the GEMM), on the grid data of section 3 (bf16: every order of the sums
    is exact, so the output must match the reference bit for bit, and the checkpoint layout's too) and on random
    data in fp32 (round-off, shown against a bound). `traced` watches the three launch functions of
    `triton_matmul` to show which one each call took:
    '''),
    code(r'''
    import contextlib
    from unittest import mock

    LAUNCHES = {"launch_packed_gemv": "FMA GEMV", "launch_gemv": "tensor-core GEMV", "launch_gemm": "GEMM"}


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
    '''),
    md(r'''
    Section 5's `lynn check matmul` runs every one of its rows on both layouts. One path is not run here: on the GPU
    with bf16 activations the packed tile decodes in inline PTX (`_decode_word_bf16`: the two masks of (c) per pair,
    then one `mul.rn.bf16x2` by the scale pair), which the interpreter cannot run; here the tile takes the portable
    decode of (c).

    ### On the H200

    `lynn bench matmul.graph` times each decoder projection shape the way a decoder runs it: captured in a **CUDA
    graph** of 8 to 64 consecutive calls on rotating weight sets (together past 3x the L2), replayed, divided by the
    calls. Four providers in one process: ours on the packed layout, ours on the checkpoint layout (section 3's
    kernels), cuBLAS bf16 `F.linear` on the dequantised weights, and a plain Triton kernel that only **reads the
    packed weight's bytes** (the same bytes: a per-shape floor for a simple kernel, not a hard limit). The
    results are committed in `data/bench/h200/matmul.graph.json` and `matmul.chain.json`, read here. M = 1 first:
    '''),
    code(r'''
    GRAPH, CHAIN = load("matmul.graph", gpu="h200"), load("matmul.chain", gpu="h200")
    PACKED, CKPT = "lynn packed (graph)", "lynn checkpoint layout (graph)"
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


    for d in (GRAPH, CHAIN):
        p = d["provenance"]
        print(f"{d['op']}: {p['gpu']}, {p['date']}, git {p['git_sha']}{' (dirty)' if p['git_dirty'] else ''}, "
              f"torch {p['torch']}, triton {p['triton']}, CUDA {p['cuda']}; `{p['command']}`")
    print(f"ceilings: read {GRAPH['ceilings']['read_gbps']:,.0f} GB/s, copy {GRAPH['ceilings']['copy_gbps']:,.0f} "
          f"GB/s\n")
    print("M = 1, kernel time (us); x cuBLAS = cuBLAS time / packed time; of pure read = pure-read time / packed time")
    print(render_table([{"shape": s, "N": G[s, 1][PACKED]["dims"]["N"], "K": G[s, 1][PACKED]["dims"]["K"],
                         **{col: f"{t_us(s, 1, prov):.1f}" for col, prov in
                            (("packed", PACKED), ("checkpoint", CKPT), ("cuBLAS bf16", CUBLAS_G),
                             ("pure read", READ))},
                         "x cuBLAS": f"{x_cublas(s, 1):.2f}",
                         "of pure read": f"{t_us(s, 1, READ) / t_us(s, 1, PACKED):.0%}",
                         "packed TB/s": f"{G[s, 1][PACKED]['gbps'] / 1e3:.2f}"} for s in G_SHAPES]))
    '''),
    md(r'''
    The same, drawn (log scale; the number over each blue bar is the speed-up over cuBLAS). On the smallest shape
    the packed GEMV beats the simple pure-read kernel, so that floor is loose there; on the large ones it is the
    one to reach.
    '''),
    code(r'''
    # NBVAL_IGNORE_OUTPUT
    SERIES = ((PACKED, "lynn packed", "tab:blue"), (CKPT, "lynn checkpoint layout", "tab:cyan"),
              (CUBLAS_G, "cuBLAS bf16", "tab:orange"), (READ, "pure read, same bytes", "0.6"))
    fig, ax = plt.subplots(figsize=(9, 4))
    for i, (prov, label, color) in enumerate(SERIES):
        xs = [j + (i - 1.5) * 0.2 for j in range(len(G_SHAPES))]
        ax.bar(xs, [t_us(s, 1, prov) for s in G_SHAPES], 0.2, label=label, color=color)
    for j, s in enumerate(G_SHAPES):
        ax.text(j - 0.3, t_us(s, 1, PACKED) * 1.08, f"{x_cublas(s, 1):.2f}x", ha="center", fontsize=6)
    ax.set_yscale("log")
    ax.set_xticks(range(len(G_SHAPES)), [short(s) + ("\n" + s.rsplit(" ", 1)[1] if "->" in s else "")
                                         for s in G_SHAPES], fontsize=7)
    ax.set_ylabel("kernel time at M = 1 (us)")
    ax.set_title(f"{GRAPH['provenance']['gpu']}, CUDA-graph replay, M = 1", fontsize=10)
    ax.legend(fontsize=7)
    plt.tight_layout()
    plt.show()
    '''),
    md(r'''
    From M = 1 to 16, the packed layout's speed-up over cuBLAS bf16. M = 1 and 2 run on the FMA GEMV, whose cost
    grows with the rows (it does each row's FMAs); from M = 4 on the tensor-core GEMV takes over, where the packed
    tile is not always faster than the checkpoint layout's:
    '''),
    code(r'''
    SMALL = [m for m in G_MS if m <= 16]
    print("packed layout: cuBLAS bf16 time / ours")
    print(render_table([{"shape": s, **{f"M={m}": f"{x_cublas(s, m):.2f}" for m in SMALL}} for s in G_SHAPES]))
    ratio = [t_us(s, m, CKPT) / t_us(s, m, PACKED) for s in G_SHAPES for m in SMALL if m > 2]
    print(f"\nM = 4..16, checkpoint-layout time / packed time on the tensor-core GEMV: "
          f"{min(ratio):.2f}-{max(ratio):.2f}x")
    '''),
    md(r'''
    The GEMM rows (prefill; the benchmark runs them on the first three shapes only, each autotunes per layout):
    '''),
    code(r'''
    GEMM_MS = [m for m in G_MS if m > 16]
    print("GEMM: ratio = cuBLAS bf16 time / ours")
    print(render_table([{"shape": s, "M": m, **{f"{col} us": f"{t_us(s, m, prov):.1f}" for col, prov in
                                                (("packed", PACKED), ("checkpoint", CKPT), ("cuBLAS", CUBLAS_G))},
                         "packed ratio": f"{x_cublas(s, m):.2f}", "checkpoint ratio": f"{x_cublas(s, m, CKPT):.2f}",
                         "packed TFLOP/s": f"{G[s, m][PACKED]['tflops']:.0f}"}
                        for s in G_SHAPES for m in GEMM_MS if (s, m) in G]))
    '''),
    md(r'''
    **Programmatic dependent launch** (PDL, Hopper: `launch_packed_gemv(..., pdl=True)`) lets a GEMV start loading
    its weights while the kernel before it finishes, and wait for it only to read `x`. `lynn bench matmul.chain`
    replays the projections of 10 Gated DeltaNet layers (qkv, z, out_proj: 30 FMA GEMVs at M = 1) as one graph,
    with and without it, against the copy bandwidth:
    '''),
    code(r'''
    chain = CHAIN["results"]
    print(f"{chain[0]['shape']}: {chain[0]['dims']['kernels']} kernels in one graph, {chain[0]['bytes'] / 1e6:.1f} MB "
          f"read; copy ceiling {CHAIN['ceilings']['copy_gbps']:,.0f} GB/s")
    print(render_table([{"provider": r["provider"], "us": f"{r['median_ms'] * 1e3:.1f}",
                         "us a projection": f"{r['median_ms'] * 1e3 / r['dims']['kernels']:.2f}",
                         "GB/s": f"{r['gbps']:,.0f}", "of copy bandwidth": f"{r['frac_of_ceiling']:.1%}"}
                        for r in chain]))
    plain, with_pdl = (r["median_ms"] * 1e3 for r in chain)
    saved = plain - with_pdl
    print(f"PDL saves {saved:.1f} us of {plain:.1f} ({saved / chain[0]['dims']['kernels']:.2f} us a projection)")
    '''),
    md(r'''
    **Goals** for the packed layout (graph-replay kernel time against cuBLAS bf16): at least **2.5x** at every
    M = 1..16, **3.2x** on the LM head and 8192 x 8192 (at M = 1, their best M), and **0.8x** for the GEMM.
    (Section 7's goals are those of the first benchmark, of the checkpoint layout.)
    '''),
    code(r'''
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
    '''),
    md(r'''
    **None of the three goals is met.** At M = 1 the packed layout is 1.6-2.1x faster than cuBLAS bf16 and about
    1.6-2.3x faster than the checkpoint layout, but 2.05x on the LM head and 2.02x on 8192 x 8192 fall short of
    3.2x, and the margin shrinks with M: about 1.05-1.27x at M = 2 (the FMA GEMV does each row's work), 0.72-1.25x
    from M = 4 to 16 on the tensor-core GEMV, below the 2.5x goal everywhere. The GEMM reaches 0.39-0.76x of cuBLAS
    (goal 0.8x): the decode is work cuBLAS does not do, and the decoded tile still passes through shared memory on
    its way to the tensor cores. PDL helps a chain of small GEMVs a little (about 0.4 us a projection), and the
    chain still uses under 30% of the copy bandwidth. At M = 1 the FMA GEMV reaches 2.2-2.4 TB/s on the large shapes,
    55-62% of the same-bytes read: `docs/matmul.md` counts about 5 instructions a weight, which caps it near
    3.8 TB/s on the H200 before any memory limit.
    '''),
    # ---------------------------------------------------------------------------------------------------------- 5
    md(r'''
    ## 5. Validation table

    `lynn check matmul` runs the three entry points on awkward shapes (M = 1, 2, 3, 17, 129; K = 208, 400, 1040,
    2064; bf16, fp16 and fp32; with bias) against the reference, each on the checkpoint layout and on the packed one
    of section 4 (the `packed` rows). Its random data puts its error figures at round-off level, where an fp16 or
    bf16 output can flip by one unit in the last place on another machine, so its table is shown but not checked;
    the pass count is:
    '''),
    code(r'''
    # NBVAL_IGNORE_OUTPUT
    check_out, seconds = checks.run_checks(["matmul"])
    print(checks.table(rounded(check_out), columns=checks.PORTABLE_COLUMNS))
    print(f"\n{seconds:.1f} s on backend {lk.backend()!r}")
    '''),
    code(r'''
    print(f"lynn check matmul: {sum(r['passed'] for r in check_out)}/{len(check_out)} passed")
    '''),
    md(r'''
    The harder cases, on grid data so that every backend must match the reference bit for bit: K = 1040 (65
    blocks, a ragged last chunk), the GEMV's largest M (16) and the GEMM's smallest (17), bias, fp16, a 3-D `x`,
    a strided `x` (a column slice of a wider tensor), M = 0:
    '''),
    code(r'''
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
    print(checks.table(rounded(val), columns=checks.PORTABLE_COLUMNS))
    print(f"\n{sum(r['passed'] for r in val)}/{len(val)} passed")
    '''),
    md(r'''
    And the errors the kernels raise where they cannot do what was asked:
    '''),
    code(r'''
    x, w = grid_case(17, 48, 256, seed=8, dtype=torch.bfloat16)
    stacked = lk.NVFP4Tensor.stack([w, w])
    for call in (lambda: nvfp4_gemv(x, w), lambda: nvfp4_linear(x, stacked), lambda: nvfp4_linear(x[:, :128], w),
                 lambda: nvfp4_linear(x, w, torch.zeros(47, device=DEVICE))):
        try:
            call()
        except (TypeError, ValueError) as err:
            print(f"{type(err).__name__}: {err}")
    '''),
    # ---------------------------------------------------------------------------------------------------------- 6
    md(r'''
    ## 6. `NVFP4Linear`: quantisation as a module swap

    `NVFP4Linear.from_linear(linear)` quantises an `nn.Linear`'s weight and keeps the packed codes, E4M3 scales and
    global scale as buffers (so `state_dict` and `.to(device)` carry them); its forward is `nvfp4_linear`, the GEMV
    for up to 16 tokens and the GEMM above. `quantize_linears(model, skip=...)` swaps every eligible Linear in place,
    as gpt-fast does; a name in `skip` (or a predicate) keeps a layer in bf16, as one would an LM head. On a small
    bf16 MLP, keeping its last layer:
    '''),
    code(r'''
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
    '''),
    md(r'''
    Against the bf16 model the quantised one loses what 4 bits lose (notebook 01, section 4); against the same
    quantised model run on the reference ops (`use_reference()`) it should agree to round-off:
    '''),
    code(r'''
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
    '''),
    # ---------------------------------------------------------------------------------------------------------- 7
    md(r'''
    ## 7. Profile on the H200

    What is timed (`lynn_kernels/bench/matmul.py`, `lynn bench matmul.linear`): six shapes (Qwen3.5 / Qwen3-Next
    projections, an LM head and two squares) at M from 1 to 4096, `nvfp4_linear` against cuBLAS bf16 `F.linear` on
    the same weights (dequantised to bf16 for cuBLAS), both validated against the reference before timing, weights
    rotated past L2. Each provider is timed twice:

    * **kernel**: the CUDA profiler's kernel duration, what a decode step captured in a CUDA graph pays;
    * **call**: `do_bench` of the Python call, what an eager loop pays; for short kernels it measures the host's
      launch cost more than the GPU.

    Bytes are what each provider must read (packed codes and scales for ours, bf16 for cuBLAS) plus activations, so
    the fraction of the measured **read** ceiling says how close each comes to its own floor.

    **Goals**: at M = 1, a kernel time 3x below cuBLAS bf16 (the bytes allow 3.56x) at 75% of the read ceiling; at
    M = 4096, 0.7x of cuBLAS bf16's throughput.

    On a GPU the first cell below runs a quick benchmark live (one shape, three M). The tables after it always read
    the committed results, `data/bench/h200/matmul.linear.json`, so they are the same on every machine.
    '''),
    code(r'''
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
    '''),
    code(r'''
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
    '''),
    code(r'''
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
    '''),
    md(r'''
    The plot puts every kernel measurement on two axes: time against M per shape (left; ours solid, cuBLAS dashed),
    and TFLOP/s against arithmetic intensity under the measured roofs (right). Ours sits about 3.5x further right
    than cuBLAS at the same M (fewer bytes for the same flops), so the read roof is higher for it. The bf16 "peak" is one
    8192^3 matmul measured in the same process; cuBLAS can exceed it on other shapes, so read it as a reference
    line, not a hard limit.
    '''),
    code(r'''
    # NBVAL_IGNORE_OUTPUT
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
    ax1.legend(fontsize=6, ncol=2)
    kernel_doc = {**doc, "results": [r for r in doc["results"] if r["provider"].endswith("(kernel)")]}
    plots.plot_roofline(kernel_doc, ax=ax2, title="roofline, kernel time (read ceiling, bf16 matmul)")
    ax2.axhline(ceil["bf16_tflops"], ls=":", c="0.5", lw=1)
    ax2.text(0.12, ceil["bf16_tflops"] * 1.08, f"bf16 8192^3: {ceil['bf16_tflops']:.0f} TFLOP/s", fontsize=7)
    plt.tight_layout()
    plt.show()
    '''),
    md(r'''
    **Host cost.** At decode sizes the kernels take microseconds; the Python call around them (argument checks,
    allocation, Triton's launcher) costs more, and an eager loop pays it on every layer. Call against kernel time,
    M = 1 to 16:
    '''),
    code(r'''
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
    '''),
    md(r'''
    **Goals**, cell by cell:
    '''),
    code(r'''
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
    '''),
    # ---------------------------------------------------------------------------------------------------------- 8
    md(r'''
    ## 8. Explorer: one cell of the benchmark

    `describe(shape, m)` prints the four measurements of one (shape, M) cell (kernel and call time of both
    providers, GB/s, the fraction of the read ceiling, TFLOP/s) next to the floor of section 1. A fixed example
    first (checked), then the widgets.
    '''),
    code(r'''
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
    '''),
    code(r'''
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
    '''),
    md(r'''
    Things to try: walk M up at a fixed shape and watch the kernel time stay flat until the tensor cores take over
    (and our call time stay well above our kernel time); compare the LM head (the largest weight, the most bytes in
    flight) with the small projections at M = 1; at M = 4096 look at TFLOP/s instead of the fraction of the read
    ceiling.
    '''),
    # ---------------------------------------------------------------------------------------------------------- 9
    md(r'''
    ## 9. What we measured, and what's next

    The summary below is computed from the committed results of section 7 (the first benchmark, of the checkpoint
    layout), so it follows them when the benchmark is re-run; section 4 has what the packed layout measured since.
    '''),
    code(r'''
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
    '''),
    md(r'''
    So the packed format's bytes are not yet turned into time. At decode the kernel is bound by its own decode and
    latency, not by the bandwidth; at prefill the decode is work that cuBLAS does not have to do; and in an
    eager loop the host launch costs more than either kernel. `docs/matmul.md` records what was measured and rejected on the way (an
    fp32 multiply-reduce GEMV without tensor cores, the textbook `x @ W^T` orientation, run-time autotuning of the
    GEMV). Next to try, none of it measured yet:

    * for the tensor-core kernels, a weight layout shuffled offline into the MMA's register-fragment order (as
      Marlin does), so a decoded tile lands in registers without a layout conversion (section 4's layout orders the
      bits of a word for the decode, not the tiles for the MMA);
    * a leaner epilogue and fewer masks; persistent programs for the small shapes;
    * a leaner host path (a cached launcher, fewer arguments), and CUDA graphs for the decode loop, which pays the
      kernel time only.

    Next notebook: `03-grouped-moe` runs the same decode over many experts at once, in a grouped GEMM.
    '''),
]

NOTEBOOKS = {"00-start-here.ipynb": START_HERE, "01-nvfp4.ipynb": NVFP4,
             "02-packed-matvec.ipynb": PACKED_MATVEC}


def build(name: str, cells: list, execute: bool = True) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.cells = cells
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    path = HERE / name
    if execute:
        NotebookClient(nb, timeout=600, kernel_name="python3", record_timing=False,
                       resources={"metadata": {"path": str(HERE)}}).execute()
    nbformat.validate(nb)
    nbformat.write(nb, path)
    return path


def _notebook_modules() -> dict:
    """Notebooks whose cells live in their own module, ``_nb<NN>_<topic>.py`` (``NAME`` and ``CELLS``)."""
    import importlib

    found = {}
    sys.path.insert(0, str(HERE))
    for path in sorted(HERE.glob("_nb[0-9]*.py")):
        mod = importlib.import_module(path.stem)
        found[mod.NAME] = mod.CELLS
    return found


def main(argv: list[str]) -> int:
    execute = "--no-exec" not in argv
    prefixes = [a for a in argv if not a.startswith("--")]
    for name, cells in {**NOTEBOOKS, **_notebook_modules()}.items():
        if not prefixes or any(name.startswith(p) for p in prefixes):
            print("wrote", build(name, cells, execute).relative_to(HERE.parent))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
