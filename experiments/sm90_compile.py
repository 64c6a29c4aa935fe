"""Compile a Triton kernel for the H200 (sm_90) on a machine without a GPU, and report what matters for a
memory-bound kernel: registers and spills (``ptxas -v``), shared memory, the SASS instruction mix, and whether the
TTGIR stages a tile through shared memory (``local_alloc`` / ``local_load``).

Used to design the packed GEMV variants of issue 13 off-line (docs/history/matmul.md cites its figures). Run::

    python experiments/sm90_compile.py            # the packed GEMV at the decoder's shapes, M = 1..8

The numbers are for the local Triton (its version is printed); the H200's image may run an older one.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "0"          # compile, do not interpret (set before triton is imported)

import collections  # noqa: E402
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
TARGET = GPUTarget("cuda", 90, 32)


def compile_sm90(fn, signature: dict, constexprs: dict, num_warps: int = 4, num_stages: int = 1,
                 divisible: tuple = ()) -> dict:
    """Compile ``fn`` (a ``@triton.jit`` function) for sm_90; ``signature`` maps argument names to Triton types
    (``"*bf16"``, ``"i32"``), ``constexprs`` the rest. As a real launch does, every pointer is taken as 16-byte
    aligned, and the integers named in ``divisible`` as multiples of 16 (Triton specialises on both). Returns the
    IR texts and the ptxas / SASS summary."""
    sig = dict(signature)
    for name in constexprs:
        sig[name] = "constexpr"
    attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k, t in signature.items()
             if t.startswith("*") or k in divisible}
    src = ASTSource(fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()},
                    attrs=attrs)
    k = triton.compile(src, target=TARGET, options={"num_warps": num_warps, "num_stages": num_stages})
    ptx = k.asm["ptx"]
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "k.ptx")
        open(p, "w").write(ptx)
        out = subprocess.run([os.path.join(BIN, "ptxas"), "-v", "-arch=sm_90a", p, "-o", os.path.join(d, "k.cubin")],
                             capture_output=True, text=True)
        info = out.stderr
        sass = subprocess.run([os.path.join(BIN, "nvdisasm"), "-c", os.path.join(d, "k.cubin")],
                              capture_output=True, text=True).stdout
    regs = int(re.search(r"Used (\d+) registers", info).group(1))
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info)
    ops = collections.Counter()
    for line in sass.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", line)
        if m:
            ops[m.group(1).split(".")[0]] += 1
    ttgir = k.asm["ttgir"]
    return {"regs": regs, "spill_stores": int(spill.group(1)), "spill_loads": int(spill.group(2)),
            "local_alloc": ttgir.count("local_alloc"), "local_load": ttgir.count("local_load"),
            "convert_layout": ttgir.count("convert_layout"), "sass_ops": ops, "sass_total": sum(ops.values()),
            "ttgir": ttgir, "ptx": ptx, "sass": sass}


def _packed_gemv(m: int, n: int, k: int, block_n: int, tw: int, warps: int) -> dict:
    from lynn_kernels.matmul.triton_packed import packed_gemv_kernel
    from lynn_kernels.runtime import kernel_flags  # noqa: F401  (imports the runtime's dtype constants)

    sig = {"x_ptr": "*bf16", "words_ptr": "*i32", "scales_ptr": "*u8", "g_ptr": "*fp32", "bias_ptr": "*bf16",
           "y_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32", "KW": "i32", "stride_xm": "i32", "stride_ym": "i32",
           "ROWS_PER_G": "i32"}
    import torch

    from lynn_kernels.triton_shared import kernel_constexprs
    f = kernel_constexprs(torch.bfloat16, None, torch.bfloat16, False, True)
    ce = {"stride_xk": 1, "HAS_BIAS": False, "X_DTYPE": f["X_DTYPE"], "BIAS_DTYPE": f["BIAS_DTYPE"], "OUT_DTYPE": f["OUT_DTYPE"],
          "BLOCK_M": triton.next_power_of_2(m), "BLOCK_N": block_n, "TW": tw, "EVEN_N": n % block_n == 0,
          "EVEN_K": (k // 8) % tw == 0, "USE_PDL": False, "EARLY_RELEASE": False, "INTERPRET": False}
    return compile_sm90(packed_gemv_kernel, sig, ce, warps, divisible=("N", "K", "KW", "stride_xm", "stride_ym"))


if __name__ == "__main__":
    print(f"triton {triton.__version__}, target sm_90")
    print(f"{'M':>2} {'BLOCK_N':>7} {'TW':>4} {'warps':>5} {'regs':>4} {'spill':>5} {'local_alloc':>11} {'SASS':>6}")
    for m in [int(a) for a in sys.argv[1:]] or [1, 2, 4]:
        for bn, tw, w in [(16, 128, 4), (8, 128, 4), (16, 64, 4), (8, 64, 4)]:
            r = _packed_gemv(m, 8192, 2048, bn, tw, w)
            print(f"{m:>2} {bn:>7} {tw:>4} {w:>5} {r['regs']:>4} {r['spill_stores']:>5} {r['local_alloc']:>11} "
                  f"{r['sass_total']:>6}")
