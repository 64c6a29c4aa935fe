"""What the packed GEMV compiles to on Hopper, counted without a GPU: the machine instructions of its main loop by
kind, per weight word, and the time the GPU needs just to issue them beside the time its bytes need.

The decode GEMVs run at 30-50% of the read ceiling even with their loads ahead of the PDL wait
(``packed_gemv_ahead.py``). If issuing the loop's instructions takes longer than reading its bytes, the kernel is
bound by its instruction stream, and fewer instructions per word is the lever, not the schedule.

How: Triton is told it targets an sm_90 GPU (a stand-in driver object that answers ``get_current_target``), the
shipped launcher (``launch_packed_gemv`` with the shipped tile, PDL on) is called on CPU tensors, so the kernel is
specialised exactly as on a GPU (the same 16-byte alignments and integer divisibilities) and compiled by the
bundled ``ptxas``; the launch itself then fails, as it must without a GPU. ``cuobjdump -sass`` disassembles the
cubin. The main loop is the longest backward branch; the block inside it that a forward branch skips is the tile's
epilogue (written once a tile), the rest is the per-step body. The issue bound takes one warp instruction per
scheduler per cycle (4 a SM) at the boost clock: a floor, not a prediction.

Beside it, the tensor-core GEMV (``matmul.gemv``, the decode rows padded to 16) at the first shape and a few tiles:
its loop's instructions a weight word, and the barriers and shared-memory loads a step that staging x for the MMA
costs (``TC_TILES``; 4 warps compile to wgmma, fewer to mma.sync).

Beside the shipped kernel, one variant (``lab.edit`` with a helper of its own): each element's x loaded at its own
K position in the words' order, instead of the step's x loaded contiguous and permuted through shared memory; the
same values and FMAs, so the same bits (``--check`` compares the two on the interpreter).

    python3 experiments/sass_census.py [--clock-ghz 1.98] [--sms 132]
    python3 experiments/sass_census.py --check

Writes ``data/experiments/sass-census/<sha>.json``. Runs on a CPU (it needs Triton's bundled ``cuobjdump``); the
Triton here is this machine's, which may differ from the GPU machine's, and the JSON records both.
"""

from __future__ import annotations  # noqa: I001  (the environment first: TRITON_INTERPRET is read at import)

import os
import sys

if __name__ == "__main__":                    # before triton is imported: it reads TRITON_INTERPRET then
    if "--check" in sys.argv:
        os.environ["TRITON_INTERPRET"] = "1"  # the check runs on the interpreter, GPU or not
    else:
        os.environ["TRITON_INTERPRET"] = "0"  # compile for the GPU even without one
        os.environ["LYNN_DIRECT_LAUNCH"] = "0"    # through Triton's own launch path, which compiles first

import argparse
import collections
import json
import re
import subprocess
import tempfile
import types
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.runtime import driver

import lynn_kernels
from lynn_kernels import lab, runtime
from lynn_kernels.bench.harness import REPO_ROOT, provenance, save_experiment
from lynn_kernels.matmul import pack, triton_matmul, triton_packed
from lynn_kernels.nvfp4 import quantize
from lynn_kernels.runtime import to_float32
from lynn_kernels.triton_shared import X_PRESCALE, normed_at

#: (label, N, K, norm folded): the batch-1 decode step's packed GEMV shapes at Qwen3.5-35B-A3B (packed_gemv_ahead.py's
#: record); the input projection also as the fused step runs it, with the RMSNorm and residual add folded in
SHAPES = [("Gated DeltaNet in_proj (fused) 2048->12288", 12288, 2048, False),
          ("the same, norm folded", 12288, 2048, True),
          ("attention q+gate, k, v (fused) 2048->9216", 9216, 2048, False),
          ("out_proj / o_proj 4096->2048", 2048, 4096, False)]
#: (BLOCK_N, TW, num_warps): other tiles counted at the first shape (the shipped one there is 32 x 64, 4 warps)
TILES = [(16, 128, 4), (32, 128, 4), (64, 64, 4), (64, 64, 8), (64, 128, 8), (128, 64, 8)]
#: (BLOCK_N, BLOCK_K, num_warps) of the tensor-core GEMV (``matmul.gemv``, M padded to 16) counted at the first shape
#: on the packed layout: 4 warps make a wgmma (its weight tile from registers, x from shared memory), fewer warps the
#: mma.sync of Ampere (both operands in registers, x loaded there through shared memory)
TC_TILES = [(64, 256, 4), (32, 256, 2), (64, 256, 2), (16, 256, 1)]


@triton.jit
def _x_at(x_ptr, m, M, K, kx, stride_xm, stride_xk, EVEN_K: tl.constexpr, X_DTYPE: tl.constexpr,
          INTERPRET: tl.constexpr, r_ptr, nw_ptr, rstd, stride_rm, NORM: tl.constexpr, NW_DTYPE: tl.constexpr):
    """x (or its norm) at the K positions ``kx`` as fp32 times 2^64: what ``fma_row_step`` makes of its x."""
    if EVEN_K:
        mask = (kx >= 0) & (m < M)
    else:
        mask = (kx < K) & (m < M)
    if NORM > 0:
        mm = tl.full((), m, tl.int64)
        xt = normed_at(x_ptr + mm * stride_xm, r_ptr + mm * stride_rm, nw_ptr, kx, rstd, mask, NORM == 2, X_DTYPE,
                       NW_DTYPE, INTERPRET)
    else:
        xt = tl.load(x_ptr + (tl.full((), m, tl.int64) * stride_xm) + kx * stride_xk, mask=mask, other=0)
    return to_float32(xt, X_DTYPE, INTERPRET) * X_PRESCALE


@triton.jit
def fma_row_step_word_order(acc, e0, e1, e2, e3, e4, e5, e6, e7, sa, sb, x_ptr, m, M, K, k0, offs, stride_xm,
                            stride_xk, TW: tl.constexpr, EVEN_K: tl.constexpr, X_DTYPE: tl.constexpr,
                            INTERPRET: tl.constexpr, r_ptr=None, nw_ptr=None, rstd=None, stride_rm=0,
                            NORM: tl.constexpr = 0, NW_DTYPE: tl.constexpr = tl.float32):
    """``fma_row_step`` with each element's x loaded at its own K position (word ``16 c + 4 q + i``, element
    ``j0 + 2 j1 + 4 j2`` is at ``128 c + 32 i + 16 j2 + 8 j1 + 2 q + j0``) instead of the step's x loaded
    contiguous and permuted: the same values, the same FMAs in the same order."""
    w = tl.arange(0, TW)
    at = 8 * k0 + 128 * (w // 16) + 32 * (w % 4) + 2 * ((w // 4) % 4)
    x0 = _x_at(x_ptr, m, M, K, at, stride_xm, stride_xk, EVEN_K, X_DTYPE, INTERPRET, r_ptr, nw_ptr, rstd,
               stride_rm, NORM, NW_DTYPE)       # element j at at + 16 j2 + 8 j1 + j0
    x1 = _x_at(x_ptr, m, M, K, at + 1, stride_xm, stride_xk, EVEN_K, X_DTYPE, INTERPRET, r_ptr, nw_ptr, rstd,
               stride_rm, NORM, NW_DTYPE)
    x2 = _x_at(x_ptr, m, M, K, at + 8, stride_xm, stride_xk, EVEN_K, X_DTYPE, INTERPRET, r_ptr, nw_ptr, rstd,
               stride_rm, NORM, NW_DTYPE)
    x3 = _x_at(x_ptr, m, M, K, at + 9, stride_xm, stride_xk, EVEN_K, X_DTYPE, INTERPRET, r_ptr, nw_ptr, rstd,
               stride_rm, NORM, NW_DTYPE)
    x4 = _x_at(x_ptr, m, M, K, at + 16, stride_xm, stride_xk, EVEN_K, X_DTYPE, INTERPRET, r_ptr, nw_ptr, rstd,
               stride_rm, NORM, NW_DTYPE)
    x5 = _x_at(x_ptr, m, M, K, at + 17, stride_xm, stride_xk, EVEN_K, X_DTYPE, INTERPRET, r_ptr, nw_ptr, rstd,
               stride_rm, NORM, NW_DTYPE)
    x6 = _x_at(x_ptr, m, M, K, at + 24, stride_xm, stride_xk, EVEN_K, X_DTYPE, INTERPRET, r_ptr, nw_ptr, rstd,
               stride_rm, NORM, NW_DTYPE)
    x7 = _x_at(x_ptr, m, M, K, at + 25, stride_xm, stride_xk, EVEN_K, X_DTYPE, INTERPRET, r_ptr, nw_ptr, rstd,
               stride_rm, NORM, NW_DTYPE)
    pa = e0 * x0[None, :]
    pa = tl.fma(e1, x1[None, :], pa)
    pa = tl.fma(e2, x2[None, :], pa)
    pa = tl.fma(e3, x3[None, :], pa)
    pb = e4 * x4[None, :]
    pb = tl.fma(e5, x5[None, :], pb)
    pb = tl.fma(e6, x6[None, :], pb)
    pb = tl.fma(e7, x7[None, :], pb)
    return tl.fma(pb, sb, tl.fma(pa, sa, acc))


def word_order_kernel():
    """The shipped packed GEMV calling :func:`fma_row_step_word_order` for its (first) x row."""
    return lab.edit("matmul.packed_gemv", {"acc0 = fma_row_step(": "acc0 = fma_row_step_word_order("},
                    name="packed_gemv_x_word_order", helpers={"fma_row_step_word_order": fma_row_step_word_order})


def check() -> None:
    """On the interpreter: the variant against the shipped kernel, bit for bit, plain and with the norm folded."""
    variant = word_order_kernel()
    gen = torch.Generator().manual_seed(0)
    for n, k, cfg in [(64, 2048, {"BLOCK_N": 32, "TW": 64}), (16, 4096, {"BLOCK_N": 8, "TW": 128}), (40, 208, None)]:
        w = pack(quantize(torch.randn(n, k, generator=gen, dtype=torch.bfloat16)))
        x, r = (torch.randn(1, k, generator=gen, dtype=torch.bfloat16) for _ in range(2))
        nw = torch.randn(k, generator=gen, dtype=torch.bfloat16) * 0.1
        for folded in (False, True):
            ys = []
            for kernel in (None, variant):
                y = torch.empty(1, n, dtype=torch.bfloat16)
                norm = (r, nw, 1e-6, torch.empty(1, k, dtype=torch.bfloat16),
                        torch.empty(1, k, dtype=torch.bfloat16)) if folded else None
                triton_packed.launch_packed_gemv(x, w, None, y, config=cfg, norm=norm, kernel=kernel)
                ys.append(y)
            same = torch.equal(*ys)
            print(f"{n} x {k}{', norm folded' if folded else ''}: the same bits as the shipped kernel: {same}")
            if not same:
                sys.exit(1)


class Sm90Driver:
    """Enough of a Triton driver for the compiler: the target is an sm_90 GPU."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")

    def __getattr__(self, name):              # anything a launch needs: there is no GPU
        raise AttributeError(f"no GPU here: the driver has no {name}")


def compile_gemv(n: int, k: int, sms: int, norm: bool, kernel=None, tile: dict | None = None):
    """The packed GEMV for an ``[n, k]`` weight and one x row at the shipped tile (``norm``: the RMSNorm and
    residual add folded in), compiled for sm_90 by the shipped launcher: ``(cubin, config)``. ``kernel``: a variant
    of the shipped kernel; ``tile``: ``BLOCK_N``, ``TW``, ``num_warps`` in place of the shipped tile's."""
    with lynn_kernels.use_reference():
        w = pack(quantize(torch.randn(n, k, dtype=torch.bfloat16)))
    x, y = torch.randn(1, k, dtype=torch.bfloat16), torch.empty(1, n, dtype=torch.bfloat16)
    folded = None
    if norm:
        folded = (torch.randn(1, k, dtype=torch.bfloat16), torch.randn(k, dtype=torch.bfloat16), 1e-6,
                  torch.empty(1, k, dtype=torch.bfloat16), torch.empty(1, k, dtype=torch.bfloat16))
    config = {**triton_packed.packed_gemv_config(n, k, sms, 1), **(tile or {})}
    cubin = compiled_by(kernel or triton_packed.packed_gemv_kernel, lambda: triton_packed.launch_packed_gemv(
        x, w, None, y, config={**(tile or {}), "PROGRAMS": 0}, pdl=True, norm=folded, kernel=kernel), f"{n} x {k}")
    return cubin, config


def compiled_by(jit, launch, what: str) -> bytes:
    """The cubin of the one kernel of ``jit`` that ``launch`` compiles (the launch itself then fails: no GPU)."""
    for cache in jit.device_caches.values():
        cache[0].clear()                      # so the one kernel left after the call is this call's
    try:
        launch()
    except AttributeError as err:
        if "no GPU here" not in str(err):
            raise
    new = [kern for cache in jit.device_caches.values() for kern in cache[0].values()]
    if len(new) != 1:
        raise RuntimeError(f"expected one new compiled kernel for {what}, got {len(new)}")
    return new[0].asm["cubin"]


def compile_tc_gemv(n: int, k: int, tile: dict):
    """The tensor-core GEMV (``matmul.gemv``) for a packed ``[n, k]`` weight and one x row at ``tile``
    (``BLOCK_N``, ``BLOCK_K``, ``num_warps``), compiled for sm_90 by its launcher: the cubin."""
    with lynn_kernels.use_reference():
        w = pack(quantize(torch.randn(n, k, dtype=torch.bfloat16)))
    x, y = torch.randn(1, k, dtype=torch.bfloat16), torch.empty(1, n, dtype=torch.bfloat16)
    return compiled_by(runtime.KERNELS["matmul.gemv"].shipped, lambda: triton_matmul.launch_gemv(
        x, w, None, y, config={**tile, "num_stages": 1}, split_k=1), f"{n} x {k}")


def disassemble(cubin: bytes) -> tuple[list[tuple[int, str, str]], dict]:
    """One ``cuobjdump -sass -res-usage`` of the cubin: ``(address, opcode, operands)`` of each instruction, and the
    registers a thread, stack, local (spilled) and shared bytes."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "-sass", "-res-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    ins = []
    for line in text.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)\s*([^;]*);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(3), m.group(4).strip()))
    return ins, {k.lower(): int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", text)}


def _target(operands: str) -> int | None:
    m = re.match(r"(?:`\()?.*?0x([0-9a-f]+)", operands)
    return int(m.group(1), 16) if m else None


def loop_census(ins) -> dict:
    """The main loop (the longest backward branch), split into the per-step body and the block a forward branch
    inside it skips (the tile's epilogue); instruction counts by opcode family."""
    loops = [(t, a) for a, op, ops in ins if op.startswith("BRA") and (t := _target(ops)) is not None and t < a]
    if not loops:
        raise RuntimeError("no backward branch: no loop found")
    head, back = max(loops, key=lambda ab: ab[1] - ab[0])
    skips = [(a, t) for a, op, ops in ins if op.startswith("BRA") and head <= a < back
             and (t := _target(ops)) is not None and a < t <= back]
    epi = max(skips, key=lambda at: at[1] - at[0]) if skips else None

    def count(pred):
        c = collections.Counter(op.split(".")[0] for a, op, _ in ins if pred(a))
        return {"instructions": sum(c.values()), "by_kind": dict(c.most_common())}

    in_loop = lambda a: head <= a <= back                                       # noqa: E731
    in_epi = (lambda a: epi[0] < a < epi[1]) if epi else (lambda a: False)    # noqa: E731
    return {"loop": [hex(head), hex(back)], "epilogue": [hex(epi[0]), hex(epi[1])] if epi else None,
            "body": count(lambda a: in_loop(a) and not in_epi(a)), "epilogue_block": count(in_epi),
            "whole_kernel": len(ins)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clock-ghz", type=float, default=1.98, help="the SM clock of the issue bound (H100/H200 boost)")
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--check", action="store_true", help="the variant against the shipped kernel on the interpreter")
    args = ap.parse_args()
    if args.check:
        check()
        return
    driver.set_active(Sm90Driver())
    # the launcher sizes its tile by the GPU's SM count: the stand-in GPU answers for torch as well
    torch.cuda.get_device_properties = lambda device=None: types.SimpleNamespace(multi_processor_count=args.sms)
    measured = {}
    for f in sorted((REPO_ROOT / "data" / "experiments" / "packed-gemv-ahead").glob("*.json")):
        run = json.loads(f.read_text())                                # the shipped tiles' GPU time, for comparison
        for r in run.get("shapes", []):
            if r["rule"] == "shipped":
                measured[r["n"], r["k"]] = {"us": r["us_per_call"], "gpu": run["provenance"]["gpu"],
                                            "read_gbps": run["ceilings"]["read_gbps"], "file": f.name}
    res = {"provenance": provenance("python3 experiments/sass_census.py " + " ".join(
               f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "check")),
           "target": "sm_90", "clock_ghz": args.clock_ghz, "sms": args.sms, "rows": []}
    issue_rate = args.sms * 4 * args.clock_ghz * 1e3                   # warp instructions per microsecond
    forms = {"shipped": None, "x in the words' order": word_order_kernel()}
    def row(label, n, k, norm, form, kernel=None, tile=None):
        cubin, cfg = compile_gemv(n, k, args.sms, norm, kernel, tile)
        ins, used = disassemble(cubin)
        census = loop_census(ins)
        kw = k // 8
        words_per_step = cfg["BLOCK_N"] * cfg["TW"]
        steps = (n // cfg["BLOCK_N"]) * (kw // cfg["TW"])
        tiles = n // cfg["BLOCK_N"]
        warp_instr = (steps * census["body"]["instructions"]
                      + tiles * census["epilogue_block"]["instructions"]) * cfg["num_warps"]
        nbytes = n * kw * 4 + n * (k // 16)
        out = {"shape": label, "n": n, "k": k, "norm_folded": norm, "form": form, "config": cfg, **census,
               "resources": used, "words_per_step": words_per_step,
               "words_per_thread_step": words_per_step // (32 * cfg["num_warps"]),
               "body_instructions_per_word_a_thread": census["body"]["instructions"] * cfg["num_warps"] * 32
               / words_per_step,
               "warp_instructions": warp_instr, "issue_bound_us": warp_instr / issue_rate, "weight_bytes": nbytes}
        if (n, k) in measured and form == "shipped" and not norm:
            m = measured[n, k]
            out.update(measured_us=m["us"], measured_on=m["gpu"], measured_file=m["file"],
                       bytes_us=nbytes / m["read_gbps"] / 1e3)
        return out

    for label, n, k, norm in SHAPES:
        for form, kernel in forms.items():
            res["rows"].append(row(label, n, k, norm, form, kernel))
    for bn, tw, warps in TILES:                   # other tiles of the shipped kernel, at the largest shape
        label, n, k, norm = SHAPES[0]
        res["rows"].append(row(label, n, k, norm, f"tile {bn} x {tw}, {warps} warps", None,
                               {"BLOCK_N": bn, "TW": tw, "num_warps": warps}))
    label, n, k, _ = SHAPES[0]
    for bn, bk, warps in TC_TILES:                # the tensor-core GEMV's loop, for comparison
        ins, used = disassemble(compile_tc_gemv(n, k, {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps}))
        census = loop_census(ins)
        words = bn * bk // 8 // (32 * warps)
        kinds = census["body"]["by_kind"]
        res["tensor_core_rows"] = res.get("tensor_core_rows", []) + [{
            "shape": label, "n": n, "k": k, "config": {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps,
                                                      "BLOCK_M": 16, "num_stages": 1},
            **census, "resources": used, "words_per_thread_step": words,
            "body_instructions_per_word_a_thread": census["body"]["instructions"] / words,
            "mma": "wgmma" if kinds.get("HGMMA") else "mma.sync" if kinds.get("HMMA") else "none",
            "barriers_a_step": kinds.get("BAR", 0),
            "shared_memory_loads_a_step": kinds.get("LDS", 0) + kinds.get("LDSM", 0)}]
    save_experiment("sass-census", res)
    print(f"sm_90 SASS of the packed GEMV (Triton {triton.__version__} here), issue floor at "
          f"{args.sms} SMs x 4 x {args.clock_ghz} GHz")
    for r in res["rows"]:
        top = ", ".join(f"{k} {v}" for k, v in list(r["body"]["by_kind"].items())[:8])
        rs = r["resources"]
        print(f"{r['shape']:44} {r['form']:26} {r['config']['BLOCK_N']:3} x {r['config']['TW']:4}: "
              f"{rs.get('reg')} registers, {rs.get('local')} B spilled; "
              f"{r['body']['instructions']:4} a step, {r['words_per_thread_step']} words a thread "
              f"({r['body_instructions_per_word_a_thread']:.1f} a word); issue floor {r['issue_bound_us']:.2f} us"
              + (f", bytes {r['bytes_us']:.2f} us, measured {r['measured_us']:.2f} us ({r['measured_on']})"
                 if "measured_us" in r else ""))
        print(f"{'':44} {top}")
    for r in res["tensor_core_rows"]:
        c, rs = r["config"], r["resources"]
        print(f"{r['shape']:44} tensor-core GEMV ({r['mma']:8}) {c['BLOCK_N']:3} x {c['BLOCK_K']} x {c['num_warps']} "
              f"warps: {rs.get('reg')} registers; {r['body']['instructions']:4} a step, {r['words_per_thread_step']} "
              f"words a thread ({r['body_instructions_per_word_a_thread']:.1f} a word), {r['barriers_a_step']} "
              f"barriers and {r['shared_memory_loads_a_step']} shared-memory loads a step")


if __name__ == "__main__":
    main()
