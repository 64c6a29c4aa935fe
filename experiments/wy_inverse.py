"""Is the Gated DeltaNet chunk's wy kernel faster with its 16 x 16 triangular inverses in log depth?

``_chunk_wy_kernel`` inverts the four diagonal blocks ``I + a`` of each 64-token chunk (``a`` strictly lower
triangular) by forward substitution: 14 row steps, each two cross-thread reductions per block, one after another.
Because ``a^16 = 0``, the inverse is also the finite product ``(I - a)(I + a^2)(I + a^4)(I + a^8)``: three squarings
and three multiplications, six 16 x 16 products in fp32 a block, with no dependence between rows. The two agree in
exact arithmetic and differ in fp32 rounding, so the variant is held to the op's check matrix (its tolerances
against the fp32 reference), not to the shipped kernel's bits; the script prints how far its outputs are from the
shipped kernel's as well.

    PYTHONPATH=. python3 experiments/wy_inverse.py --check     # CPU or GPU: the op's check matrix, the variant in
    PYTHONPATH=. python3 experiments/wy_inverse.py --sass      # CPU: both kernels compiled for sm_90, counted
    PYTHONPATH=. python3 experiments/wy_inverse.py             # GPU: the check, then raced at Qwen3.5-35B-A3B

The race is the lab's (``lab.race``: graph replay on rotating inputs, the shipped op and fla beside it where fla is
installed) of ``deltanet.chunk_gated_delta_rule`` at Qwen3.5-35B-A3B's prefill of 2,048 and 16,384 tokens; only the
wy kernel differs. ``--sass`` compiles the shipped and the variant wy kernel at every autotune config as a
2,048-token launch would specialise them (``kernel_resources.py``'s stand-in sm_90 driver) and counts their machine
instructions: in all (static) and as executed, the forward substitution's loop body counted once per row step.
Writes ``data/experiments/wy-inverse/<sha>.json`` (``check/<sha>.json``, ``sass/<sha>.json``; under ``$OUT`` when
set).
"""

from __future__ import annotations  # noqa: I001  (the environment first: TRITON_INTERPRET is read at import)

import os
import sys

if __name__ == "__main__" and "--sass" in sys.argv:   # compile for sm_90 without a GPU
    os.environ["TRITON_INTERPRET"] = "0"
    os.environ["LYNN_DIRECT_LAUNCH"] = "0"          # through Triton's own launch path, which compiles first

import contextlib  # noqa: I001  (lynn_kernels before triton: on a CPU it turns the interpreter on)

import torch

from lynn_kernels import deltanet, lab, runtime
import triton
import triton.language as tl
from lynn_kernels.bench.harness import provenance, save_experiment
from lynn_kernels.lab.shapes import BUILDERS, MODELS
from lynn_kernels.metrics import compare, flat_row

TOKENS = (2048, 16384)


@triton.jit
def _tri_inverse(a, eye):
    """``(I + a)^-1`` of a strictly lower triangular 16 x 16 fp32 ``a``: ``(I - a)(I + a^2)(I + a^4)(I + a^8)``."""
    a2 = tl.dot(a, a, input_precision="ieee")
    a4 = tl.dot(a2, a2, input_precision="ieee")
    a8 = tl.dot(a4, a4, input_precision="ieee")
    p = eye - a
    p = p + tl.dot(p, a2, input_precision="ieee")
    p = p + tl.dot(p, a4, input_precision="ieee")
    return p + tl.dot(p, a8, input_precision="ieee")


def substitution() -> str:
    """The shipped kernel's forward substitution as its source has it: from ``x0 = -a00`` to ``ai33``, which
    :data:`LOG_DEPTH` replaces."""
    src = lab.source_of(runtime.KERNELS["deltanet.chunk_wy"].shipped)
    last = "    ai33 = x3 + eye\n"
    return src[src.index("    x0 = -a00\n"):src.index(last) + len(last)]


#: four calls of ``_tri_inverse`` in place of the substitution
LOG_DEPTH = """    eye = tl.where(offs[:, None] == offs[None, :], 1.0, 0.0)
    ai00 = _tri_inverse(a00, eye)
    ai11 = _tri_inverse(a11, eye)
    ai22 = _tri_inverse(a22, eye)
    ai33 = _tri_inverse(a33, eye)
"""


def variant() -> lab.Variant:
    kernel = lab.edit("deltanet.chunk_wy", {substitution(): LOG_DEPTH}, name="_chunk_wy_log_depth_kernel",
                      helpers={"_tri_inverse": _tri_inverse})
    return lab.variant("deltanet.chunk_gated_delta_rule", kernel, name="wy-log-depth")


def against_shipped(v: lab.Variant, shape) -> dict:
    """The variant's output and final state against the shipped kernel's on one shape's inputs."""
    args, kwargs, _ = shape.make()
    shipped = deltanet.chunk_gated_delta_rule(*args, **kwargs)
    with lab.using(v):
        got = deltanet.chunk_gated_delta_rule(*args, **kwargs)
    row = {"shape": shape.label}
    for name, a, b in zip(("output", "final_state"), got, shipped):
        if a is not None:
            m = compare(a.float(), b.float())
            row[name] = {"rel_l2": m.rel_l2, "cosine": m.cosine, "bit_equal": bool(torch.equal(a, b))}
    return row


def sass() -> dict:
    """Both wy kernels compiled for sm_90 at each autotune config (a 2,048-token launch at Qwen3.5-35B-A3B's heads)."""
    import kernel_resources as kr
    import sass_census as sc
    from triton.runtime import driver

    import lynn_kernels

    driver.set_active(kr.CompileDriver())
    torch.cuda.get_device_properties = lambda device=None: type("Props", (), {"multi_processor_count": 132})()
    v = variant()
    with lynn_kernels.use_reference():
        args, kwargs, _ = BUILDERS["deltanet.chunk_gated_delta_rule"](MODELS["qwen3.5-35b-a3b"], TOKENS[0])[0].make()
    rows = []
    for label, route, jit in (("shipped", None, runtime.KERNELS["deltanet.chunk_wy"].shipped),
                              ("log-depth", v, v._routed)):
        with kr.compile_only(), torch.no_grad(), lab.using(route) if route else contextlib.nullcontext():
            with contextlib.suppress(Exception):          # the launch after the compile fails on CPU tensors
                deltanet.chunk_gated_delta_rule(*args, **kwargs)
        while not hasattr(jit, "device_caches"):          # the autotuner around the kernel
            jit = jit.fn
        for kern in (k for cache in jit.device_caches.values() for k in cache[0].values()):
            ins, _ = sc.disassemble(kern.asm["cubin"])
            loops = [(t, a) for a, op, ops in ins if op.startswith("BRA") and (t := sc._target(ops)) is not None
                     and t < a]
            body = sum(1 for a, _, _ in ins if any(h <= a <= b for h, b in loops))
            row = {"kernel": label, **kr.census(kern), "loop_body": body,
                   "executed": len(ins) + 13 * body}      # the substitution's loop runs 14 times (rows 2..15)
            rows.append(row)
            print(f"{label:9} w{row['num_warps']} s{row['num_stages']}: {row['registers']} registers, local "
                  f"{row['local_bytes']}, {row['instructions']} instructions, loop body {body}, executed "
                  f"{row['executed']}", flush=True)
    return {"provenance": provenance("python3 experiments/wy_inverse.py --sass"), "target": "sm_90",
            "triton_here": triton.__version__, "rows": rows}


def main() -> None:
    if "--sass" in sys.argv[1:]:
        save_experiment("wy-inverse/sass", sass())
        return
    check_only = "--check" in sys.argv[1:]
    if not check_only and not torch.cuda.is_available():
        sys.exit("wy_inverse.py races GPU kernels: no GPU here (--check runs on a CPU)")
    v = variant()
    report = lab.check(v)
    print(report.table(), report.summary(), sep="\n", flush=True)
    res = {"provenance": provenance("PYTHONPATH=. python3 experiments/wy_inverse.py " + " ".join(sys.argv[1:])),
           "check": {"passed": report.passed, "summary": report.summary(), "rows": [flat_row(r) for r in report.rows]}}
    if not check_only:
        shapes = [s for t in TOKENS for s in BUILDERS["deltanet.chunk_gated_delta_rule"](MODELS["qwen3.5-35b-a3b"], t)]
        res["against_shipped"] = [against_shipped(v, s) for s in shapes]
        for row in res["against_shipped"]:
            print(row, flush=True)
        race = lab.race(v, shapes=shapes, skip_check=True)
        res["race"] = [r.as_dict() for r in race.rows]
        print(race.table(), flush=True)
    save_experiment("wy-inverse" + ("/check" if check_only else ""), res)


if __name__ == "__main__":
    main()
