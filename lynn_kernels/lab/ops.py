"""The ops a variant may stand in for: each public op of :mod:`lynn_kernels`, its ``lynn check`` family and rows, and
the kernels its launchers run (the names of :data:`lynn_kernels.runtime.KERNELS`).

An op is named ``<family>.<function>`` as it is imported (``norm.rmsnorm`` is ``lynn_kernels.norm.rmsnorm``); the
function's own name alone (``rmsnorm``) finds it too when no other family has one of that name.
"""

from __future__ import annotations

import difflib
import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Op:
    name: str                   #: ``family.function``
    family: str                 #: its ``lynn check`` family (``lynn_kernels/<family>/check.py``)
    kernels: tuple[str, ...]    #: the kernels its launchers run, the one a kernel variant replaces by default first
    bench: str | None = None    #: its committed ``lynn bench`` results (``data/bench/<gpu>/<bench>.json``), if any

    @property
    def fn(self):
        """The public op (a :func:`lynn_kernels.runtime.op`: ``.host`` runs the kernels, ``.reference`` the torch)."""
        family, attr = self.name.split(".")
        return getattr(importlib.import_module(f"lynn_kernels.{family}"), attr)


OPS: dict[str, Op] = {op.name: op for op in (
    Op("nvfp4.quantize", "nvfp4", ("nvfp4.quantize",), "nvfp4.quantize"),
    Op("nvfp4.dequantize", "nvfp4", ("nvfp4.dequantize",), "nvfp4.dequantize"),
    Op("matmul.nvfp4_linear", "matmul", ("matmul.packed_gemv", "matmul.gemv", "matmul.gemm", "matmul.dequantize"),
       "matmul.graph"),
    Op("matmul.nvfp4_gemv", "matmul", ("matmul.gemv",)),
    Op("matmul.nvfp4_gemm", "matmul", ("matmul.gemm",)),
    Op("matmul.norm_linear", "matmul", ("matmul.packed_gemv", "matmul.gemv")),
    Op("moe.route", "moe", ("moe.route",)),
    Op("moe.align", "moe", ("moe.align_count", "moe.align_offsets", "moe.align_scatter", "moe.align_one_program")),
    Op("moe.moe_experts", "moe", ("moe.gate_up", "moe.down", "moe.combine")),
    Op("moe.moe_block", "moe", ("moe.decode_gate_up", "moe.decode_down", "moe.packed_gate_up", "moe.packed_down",
                                "moe.gate_up", "moe.down", "moe.combine", "moe.router", "moe.shared_gate"),
       "moe.block"),
    Op("moe.norm_moe_block", "moe", ("moe.router", "moe.decode_gate_up", "moe.decode_down")),
    Op("attention.flash_attention", "attention", ("attention.prefill",), "attention.prefill"),
    Op("attention.decode_attention", "attention", ("attention.decode", "attention.decode_merge"), "attention.decode"),
    Op("attention.qk_norm_rope", "attention", ("attention.qk_norm_rope",)),
    Op("deltanet.chunk_gated_delta_rule", "deltanet", ("deltanet.chunk_wy", "deltanet.chunk_state",
                                                       "deltanet.chunk_output"), "deltanet.chunk"),
    Op("deltanet.recurrent_gated_delta_rule", "deltanet", ("deltanet.recurrent",), "deltanet.recurrent"),
    Op("deltanet.causal_conv1d", "deltanet", ("deltanet.conv",), "deltanet.conv"),
    Op("deltanet.causal_conv1d_update", "deltanet", ("deltanet.conv_update",)),
    Op("deltanet.gated_rmsnorm", "deltanet", ("deltanet.gated_rmsnorm",)),
    Op("deltanet.gated_delta_decode", "deltanet", ("deltanet.decode_step",)),
    Op("norm.rmsnorm", "norm", ("norm.rmsnorm",)),
)}


def find(name: str) -> Op:
    """The op called ``name`` (``norm.rmsnorm``, or ``rmsnorm`` where only one family has it); a ``ValueError``
    listing the ops otherwise."""
    if name in OPS:
        return OPS[name]
    short = [op for op in OPS.values() if op.name.split(".")[1] == name]
    if len(short) == 1:
        return short[0]
    close = difflib.get_close_matches(name, [*OPS, *(n.split(".")[1] for n in OPS)], n=3)
    hint = f" (did you mean {' or '.join(close)}?)" if close else ""
    raise ValueError(f"unknown op {name!r}{hint}; the ops: {', '.join(OPS)}")


def kernel_op(kernel_name: str) -> Op:
    """The first op whose launchers run the kernel called ``kernel_name``."""
    for op in OPS.values():
        if kernel_name in op.kernels:
            return op
    raise ValueError(f"no op runs a kernel called {kernel_name!r}")


__all__ = ["Op", "OPS", "find", "kernel_op"]
