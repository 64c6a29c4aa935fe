"""What each kernel of a phase compiles to on Hopper, without a GPU: registers, spills, local memory and machine
instructions by kind, per kernel specialisation the decoder's shapes launch.

Two kernels of the prefill turned out to spend their time issuing instructions nobody needed (the conv's state
gathers in every block: 255 registers with a spill against 108; the q/k norm's cos and sin for every dim of a head:
6,600 instructions against 1,744): both showed in the compiled code before any GPU timed them. This script looks at
every op the lab knows at once: each op of :data:`lynn_kernels.lab.shapes.BUILDERS` is called through its public
host function on the lab's shapes of ``--shapes`` (CPU tensors), with Triton told it targets an sm_90 GPU
(:class:`sass_census.Sm90Driver`) and every launch turned into a compile (``warmup``), so each kernel is specialised
as a launch on the GPU would specialise it (alignments, divisibilities, constexprs). ``cuobjdump -sass`` disassembles
each cubin. An autotuned kernel compiles every config it may pick (a row each); the GPU runs one. An op whose host
reads a kernel's output to decide what to launch next (the MoE alignment's counts,
for one) compiles only its kernels up to that point: the row says so.

    python3 experiments/kernel_resources.py [--shapes qwen3.5-35b-a3b:prefill] [--ops OP ...]

Writes ``data/experiments/kernel-resources/<model>-<phase>/<sha>.json`` and prints one line a kernel: the op, the
kernel, its launch config, registers a thread, stack and local bytes (spills), static shared memory, machine
instructions and the ones that move memory or go to the tensor cores and special function units. Static counts of
the compiled code, not executed ones: a loop's body counts once. Runs on a CPU; the Triton here may differ from the
GPU machine's.
"""

from __future__ import annotations  # noqa: I001  (the environment first: TRITON_INTERPRET is read at import)

import os
import sys

if __name__ == "__main__":                    # before triton is imported: it reads TRITON_INTERPRET then
    os.environ["TRITON_INTERPRET"] = "0"      # compile for the GPU even without one
    os.environ["LYNN_DIRECT_LAUNCH"] = "0"    # through Triton's own launch path, which compiles first

import argparse
import collections
import contextlib

import torch
import triton
from sass_census import Sm90Driver, disassemble
from triton.runtime import driver
from triton.runtime.jit import JITFunction

import lynn_kernels
from lynn_kernels import runtime
from lynn_kernels.bench.harness import provenance, save_experiment
from lynn_kernels.lab import find
from lynn_kernels.lab.shapes import BUILDERS, parse, shapes_for

#: machine instructions counted by name (the first part of the opcode)
KINDS = ("LDG", "STG", "LDS", "STS", "LDL", "STL", "BAR", "HGMMA", "HMMA", "FFMA", "MUFU", "SHFL", "BRA")


@contextlib.contextmanager
def compile_only():
    """Every Triton launch inside the block compiles its kernel for the stand-in GPU and returns without running."""
    run = JITFunction.run

    def compile_run(self, *args, grid, warmup, **kwargs):
        return run(self, *args, grid=grid, warmup=True, **kwargs)

    JITFunction.run = compile_run
    checks = runtime.check_device
    runtime.check_device = lambda *a, **k: None            # the tensors are on the CPU: nothing will run on them
    try:
        yield
    finally:
        JITFunction.run = run
        runtime.check_device = checks


class CompileDriver(Sm90Driver):
    """The stand-in GPU, with a benchmarker for autotuned kernels: each config is "run" once (so it compiles) and
    takes the same time, so every config of an autotuned kernel is compiled and counted."""

    def get_benchmarker(self):
        def bench(kernel_call, quantiles=None, **kwargs):
            kernel_call()
            return [1.0] * len(quantiles) if quantiles else 1.0
        return bench


def compiled() -> dict:
    """``(kernel name, cache key) -> compiled kernel`` of every registered kernel, shipped ones only."""
    out = {}
    for name, k in runtime.KERNELS.items():
        jit = k.shipped
        while not hasattr(jit, "device_caches") and hasattr(jit, "fn"):     # an autotuner (or heuristics) around it
            jit = jit.fn
        for cache in getattr(jit, "device_caches", {}).values():
            for key, kern in cache[0].items():
                out[(name, key)] = kern
    return out


def census(kern) -> dict:
    """Resources and instruction counts of one compiled kernel."""
    ins, used = disassemble(kern.asm["cubin"])
    kinds = collections.Counter(op.split(".")[0] for _, op, _ in ins)
    meta = kern.metadata
    return {"num_warps": meta.num_warps, "num_stages": meta.num_stages, "registers": used.get("reg"),
            "stack_bytes": used.get("stack"), "local_bytes": used.get("local"), "shared_bytes": used.get("shared"),
            "instructions": len(ins), "by_kind": {k: kinds.get(k, 0) for k in KINDS},
            "constexprs": {str(k): str(v) for k, v in getattr(kern.src, "constants", {}).items()}}


def op_rows(op_name: str, shapes: str) -> list[dict]:
    """Compile the kernels op ``op_name`` launches on the lab's ``shapes``; one row a new specialisation."""
    op = find(op_name)
    try:
        cases = shapes_for(op.name, shapes)
    except ValueError as err:
        return [{"op": op.name, "skipped": str(err)}]
    rows = []
    for shape in cases:
        before = set(compiled())
        with lynn_kernels.use_reference():                 # the inputs' own making (quantised weights) runs in torch
            args, kwargs, _ = shape.make()
        note = ""
        try:
            with compile_only(), torch.no_grad():
                op.fn.host(*args, **kwargs)
        except Exception as err:                            # recorded: what compiled before it still counts
            note = f"stopped at {type(err).__name__}: {str(err)[:160]}"
        new = {key: kern for key, kern in compiled().items() if key not in before}
        if not new:
            rows.append({"op": op.name, "shape": shape.label, "note": note or "no new specialisation"})
        for (name, _), kern in new.items():
            rows.append({"op": op.name, "shape": shape.label, "kernel": name, **census(kern), "note": note})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="qwen3.5-35b-a3b:prefill", help="the lab's shapes, model:phase")
    ap.add_argument("--ops", nargs="*", default=None, help="the ops (default: every op with lab shapes)")
    args = ap.parse_args()
    parse(args.shapes)                                      # a bad name fails before any work
    driver.set_active(CompileDriver())
    # launchers size grids and tiles by the GPU's SM count: the stand-in answers for torch too (an H100 / H200)
    torch.cuda.get_device_properties = lambda device=None: type("Props", (), {"multi_processor_count": 132})()
    res = {"provenance": provenance("python3 experiments/kernel_resources.py --shapes " + args.shapes
                                    + ("" if args.ops is None else " --ops " + " ".join(args.ops))),
           "target": "sm_90", "triton_here": triton.__version__, "shapes": args.shapes, "rows": []}
    for name in (args.ops if args.ops is not None else list(BUILDERS)):
        res["rows"] += op_rows(name, args.shapes)
    save_experiment("kernel-resources/" + args.shapes.replace(":", "-"), res)
    print(f"sm_90 code of each kernel at {args.shapes} (Triton {triton.__version__} here); static counts")
    for r in res["rows"]:
        if "kernel" not in r:
            print(f"{r['op']:34} {r.get('shape', ''):40} {r.get('skipped') or r.get('note')}")
            continue
        k = r["by_kind"]
        print(f"{r['op']:34} {r['shape'][:40]:40} {r['kernel']:26} w{r['num_warps']} s{r['num_stages']} "
              f"{r['registers']:3} reg, stack {r['stack_bytes']:4}, local {r['local_bytes']:4}, "
              f"smem {r['shared_bytes']:6}, {r['instructions']:5} instr (LDG {k['LDG']}, STG {k['STG']}, "
              f"LDL {k['LDL']}, STL {k['STL']}, MMA {k['HGMMA'] + k['HMMA']}, MUFU {k['MUFU']})"
              + (f"  [{r['note']}]" if r["note"] else ""))


if __name__ == "__main__":
    sys.exit(main())
