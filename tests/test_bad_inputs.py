"""Bad input swept, not sampled: every public op of ``lynn_kernels`` over one table of bad arguments.

Each row of :data:`CASES` is one (op, case): a change to a set of valid arguments (tiny shapes), the exception it must
raise (``TypeError`` for a wrong type or dtype, ``ValueError`` for a wrong shape, value, layout or device) and the
tensor the message must name. Every row runs on the native backend (the interpreter on a CPU, compiled Triton on a
GPU) and on the torch references (``use_reference()``), except where a case only means something on one of them
(a CUDA tensor is only wrong for the interpreter; the references run on any device). After the error every tensor
the op was given (outputs, caches and states included) must be unchanged, bit for bit.

Case kinds (the second part of each row's id): ``type`` (not a tensor), ``dtype``, ``rank``, ``shape``, ``device``
(one input on the ``meta`` device, the others on the kernels' device), ``layout`` (not contiguous where the op
writes in place or needs unit stride), ``k16`` (K not a multiple of 16), ``empty``, ``finite`` (NaN / Inf where the
op promises finiteness), ``range`` (ids, lengths, offsets, positions and sizes out of range), ``value`` (other bad
values: a width, a power of two, a flag, a cache slot written twice), ``alias`` (an output the op writes in place
sharing memory with an input or another output: a shifted view of the state it updates, a cache over its own input;
the very same view, an in-place update, stays valid), ``cuda`` (every input a CUDA tensor, on the interpreter
backend). The CUDA tensors are torch fake tensors (``FakeTensorMode``): they carry ``device='cuda:0'`` and real
shapes and strides but no data, so they can be built on a machine without CUDA; an op must refuse them before it
reads a value.

The helpers that build an op's arguments (``attention.split_q_gate`` / ``paged_slots`` / ``contiguous_slots``,
``moe.stack_w13`` / ``fuse_w13``) are swept too, once each (:data:`ONCE`: they have no backend); ``paged_slots``
reads no value back, so an index out of range is an exception on the CPU only (``cpu_only`` rows). Not swept:
``attention.default_num_splits`` and ``moe.max_padded`` (arithmetic on Python ints), and the ``launch_*`` functions
(launch-only by contract: no checks, no host sync).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import lynn_kernels
from lynn_kernels import attention, deltanet, matmul, moe, norm, nvfp4, runtime
from lynn_kernels.moe import SharedExpert
from lynn_kernels.nvfp4 import NVFP4Tensor

DEV = runtime.DEVICE
F32, BF16, I32, I64 = torch.float32, torch.bfloat16, torch.int32, torch.int64
NAN, INF = float("nan"), float("inf")
NATIVE, REFERENCE = "native", "reference"
BOTH = (NATIVE, REFERENCE)


def rand(*shape, dtype=F32, seed=0, scale=1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype).to(DEV)


def ints(values, dtype=I32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=DEV)


def meta(t: torch.Tensor) -> torch.Tensor:
    return t.to("meta")


def strided(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a non-contiguous view (every other element of a doubled last dim)."""
    return torch.stack([t, torch.zeros_like(t)], dim=-1).flatten(-2)[..., 0::2]


def in_place(state: torch.Tensor) -> dict:
    """An in-place state update: ``state`` is both the initial state and ``out_state``."""
    return {"initial_state": state, "out_state": state}


def shifted_residual(buf: torch.Tensor) -> dict:
    """``residual_out`` one row past ``residual`` in the same buffer: overlapping, not the same view."""
    return {"residual": buf[:3], "residual_out": buf[1:]}


def shifted_state(buf: torch.Tensor) -> dict:
    """``out_state`` half a state past ``initial_state`` in one buffer of 48 values: overlapping, not the same view."""
    return {"initial_state": buf[:32].view(1, 2, 4, 4), "out_state": buf[16:].view(1, 2, 4, 4)}


def state_over(name: str, shape: tuple) -> dict:
    """Input ``name`` (fp32, ``shape``) at the start of one buffer and ``out_state [1, 2, 4, 4]`` from its last value
    on."""
    n = torch.Size(shape).numel()
    buf = rand(n + 31, seed=12)
    return {name: buf[:n].view(shape), "out_state": buf[n - 1:].view(1, 2, 4, 4)}


def with_value(t: torch.Tensor, value: float, index=0) -> torch.Tensor:
    t = t.clone()
    t.view(-1)[index] = value
    return t


def q4(w: torch.Tensor) -> NVFP4Tensor:
    """NVFP4 of ``w`` through the reference (no kernel launch while the table is built)."""
    return nvfp4.reference.quantize(w)


# ---------------------------------------------------------------------------------------------------------------
# valid arguments, one set per op (tiny shapes: most checks fire before any kernel launch)


def args_quantize():
    return {"w": rand(4, 32)}


def args_dequantize():
    return {"q": q4(rand(4, 32)), "dtype": BF16}


def args_nvfp4_tensor():
    q = q4(rand(4, 32))
    return {"codes": q.codes.clone(), "scales": q.scales.clone(), "global_scale": q.global_scale.clone()}


def args_from_modelopt():
    return {k: v.clone() for k, v in q4(rand(4, 32)).to_modelopt().items()}


def args_from_compressed_tensors():
    return {k: v.clone() for k, v in q4(rand(4, 32)).to_compressed_tensors().items()}


def args_linear(m: int = 2):
    return {"x": rand(m, 32, seed=1), "w": q4(rand(8, 32)), "bias": rand(8, seed=2)}


def args_flash():
    T, Hq, Hkv, D = 5, 2, 1, 16
    return {"q": rand(T, Hq, D, seed=1), "k": rand(T, Hkv, D, seed=2), "v": rand(T, Hkv, D, seed=3),
                "gate": rand(T, Hq, D, seed=4), "cu_seqlens": ints([0, 2, 5]), "prefix_lens": None}


def args_flash_prefix():
    a = args_flash()
    a.update(k=rand(8, 1, 16, seed=2), v=rand(8, 1, 16, seed=3), prefix_lens=ints([1, 2]))
    return a


def args_decode():
    B, Hq, Hkv, D, S = 2, 2, 1, 16, 16
    return {"q": rand(B, Hq, D, seed=1), "k_cache": rand(B, S, Hkv, D, seed=2), "v_cache": rand(B, S, Hkv, D, seed=3),
                "seq_lens": ints([3, 16]), "gate": rand(B, Hq, D, seed=4)}


def args_decode_paged():
    a = args_decode()
    a.update(k_cache=rand(3, 16, 1, 16, seed=2), v_cache=rand(3, 16, 1, 16, seed=3), seq_lens=ints([3, 20]),
             block_table=ints([[2, 0], [1, 0]]))
    return a


def args_rope():
    T, Hq, Hkv, D = 3, 2, 1, 16
    return {"q": rand(T, Hq, D, seed=1), "k": rand(T, Hkv, D, seed=2), "q_weight": rand(D, seed=3, scale=0.1),
                "k_weight": rand(D, seed=4, scale=0.1), "positions": ints([0, 1, 7]), "v": rand(T, Hkv, D, seed=5),
                "rotary_dim": 8, "rope_theta": 1e4, "k_cache": rand(2, 16, Hkv, D, seed=6),
                "v_cache": rand(2, 16, Hkv, D, seed=7), "slot_mapping": ints([0, -1, 17], I64)}


def args_rope_tables():
    a = args_rope()
    cos, sin = attention.reference.rope_cos_sin(torch.arange(8, device=DEV), 8, 1e4)
    a.update(rope_theta=None, cos=cos, sin=sin)
    return a


def args_delta(T: int = 3):
    B, H, HV, K, V = 1, 1, 2, 4, 4
    return {"q": rand(B, T, H, K, seed=1), "k": rand(B, T, H, K, seed=2), "v": rand(B, T, HV, V, seed=3),
                "g": F.logsigmoid(rand(B, T, HV, seed=4)), "beta": rand(B, T, HV, seed=5).sigmoid(),
                "initial_state": rand(B, HV, K, V, seed=6), "out_state": rand(B, HV, K, V, seed=7)}


def args_chunk():
    return args_delta()


def args_chunk_packed():
    a = args_delta(T=5)
    a.update(initial_state=rand(2, 2, 4, 4, seed=6), out_state=rand(2, 2, 4, 4, seed=7), cu_seqlens=ints([0, 2, 5]))
    return a


def args_delta_gates():
    a = args_delta(T=1)
    del a["g"], a["beta"]
    a.update(A_log=rand(2, seed=8), a=rand(1, 1, 2, seed=9), dt_bias=rand(2, seed=10), b=rand(1, 1, 2, seed=11))
    return a


def args_gates():
    return {"A_log": rand(2, seed=8), "a": rand(1, 3, 2, seed=9), "dt_bias": rand(2, seed=10),
            "b": rand(1, 3, 2, seed=11)}


def args_conv():
    return {"x": rand(1, 5, 4, seed=1), "weight": rand(4, 4, seed=2), "initial_state": rand(2, 4, 3, seed=3),
                "cu_seqlens": ints([0, 2, 5])}


def args_conv_update():
    return {"x": rand(2, 4, seed=1), "conv_state": rand(2, 4, 4, seed=2), "weight": rand(4, 4, seed=3)}


def args_gated_rmsnorm():
    return {"x": rand(2, 3, 8, seed=1), "z": rand(2, 3, 8, seed=2), "weight": rand(8, seed=3), "eps": 1e-6}


def args_decode_step():
    """A Gated DeltaNet decode step: 2 tokens, 1 key head, 2 value heads of 8 (C = 2 * 8 + 2 * 8 = 32), width 4."""
    return {"qkv": rand(2, 32, seed=1), "z": rand(2, 2, 8, seed=2), "a": rand(2, 2, seed=3), "b": rand(2, 2, seed=4),
            "conv_state": rand(2, 32, 3, seed=5), "conv_weight": rand(32, 4, seed=6), "A_log": rand(2, seed=7),
            "dt_bias": rand(2, seed=8), "state": rand(2, 2, 8, 8, seed=9, scale=0.1), "norm_weight": rand(8, seed=10),
            "num_k_heads": 1, "eps": 1e-6}


def args_decode_step_gates():
    """The same step with the gates' projections in the op: the layer input x [2, 16] and in_proj_a / in_proj_b."""
    a = args_decode_step()
    a.update(a=None, b=None, x=rand(2, 16, seed=11), a_weight=rand(2, 16, seed=12), b_weight=rand(2, 16, seed=13))
    return a


def args_decode_plan():
    """A decode step's plan: 3 rows (one inactive), a block table of 4 rows x 2 pages of 16."""
    return {"lengths": ints([0, 17, 5], I64), "active": torch.tensor([True, True, False], device=DEV),
            "block_table": ints([[3, 1], [0, 2], [4, 5], [6, 7]]), "page_size": 16,
            "positions": ints([0, 0, 0], I64), "kv_slots": ints([0, 0, 0], I64), "seq_lens": ints([0, 0, 0])}


def args_rmsnorm():
    return {"x": rand(3, 8, seed=1), "weight": rand(8, seed=2, scale=0.1), "eps": 1e-6, "residual": rand(3, 8, seed=3),
                "out": rand(3, 8, seed=4), "residual_out": rand(3, 8, seed=5)}


E, H, I = 4, 32, 16


def args_route():
    return {"logits": rand(3, E, seed=1), "top_k": 2, "renormalize": True}


def args_align():
    return {"ids": ints([[2, 0], [3, 1], [0, 3]]), "num_experts": E, "block_m": 16}


def _experts(nvfp4_weights: bool):
    w13, w2 = rand(E, 2 * I, H, seed=2, scale=0.1), rand(E, H, I, seed=3, scale=0.1)
    return (q4(w13), q4(w2)) if nvfp4_weights else (w13, w2)


def args_experts(nvfp4_weights: bool = False):
    w13, w2 = _experts(nvfp4_weights)
    return {"x": rand(3, H, seed=1), "weights": rand(3, 2, seed=4).softmax(-1), "ids": ints([[2, 0], [3, 1], [0, 3]]),
                "w13": w13, "w2": w2}


def args_experts_nvfp4():
    return args_experts(True)


def args_block(nvfp4_weights: bool = False):
    w13, w2 = _experts(nvfp4_weights)
    shared = SharedExpert(rand(2 * I, H, seed=5, scale=0.1), rand(H, I, seed=6, scale=0.1), rand(1, H, seed=7))
    return {"x": rand(1, 3, H, seed=1), "router_weight": rand(E, H, seed=4), "w13": w13, "w2": w2, "shared": shared,
            "top_k": 2}


def args_block_nvfp4():
    return args_block(True)


def args_norm_linear():
    return {"x": rand(2, 32, seed=1), "norm_weight": rand(32, seed=2, scale=0.1), "w": matmul.pack(q4(rand(8, 32))),
            "eps": 1e-6, "residual": rand(2, 32, seed=3)}


def args_norm_block():
    a = args_block(True)
    a["w13"], a["w2"], a["shared"] = moe.pack_experts(a["w13"], a["w2"], a["shared"]._replace(
        w13=q4(rand(2 * I, H, seed=5, scale=0.1)), w2=q4(rand(H, I, seed=6, scale=0.1))))
    a.update(norm_weight=rand(H, seed=8, scale=0.1), eps=1e-6, residual=rand(1, 3, H, seed=9))
    return a


def args_split_q_gate():
    return {"q_proj_out": rand(3, 2 * 2 * 16), "num_heads": 2, "head_dim": 16}


def args_paged_slots():
    return {"block_table": ints([[2, 0], [1, 3]]), "seq_idx": ints([0, 1, 1], I64), "positions": ints([3, 17, 5], I64),
            "page": 16}


def args_contiguous_slots():
    return {"seq_idx": ints([0, 1, 1], I64), "positions": ints([3, 17, 5], I64), "max_len": 24}


def args_stack_w13(nvfp4_weights: bool = False):
    ws = [rand(16, 32, seed=s) for s in (1, 2, 3, 4)]
    if nvfp4_weights:
        ws = [q4(w) for w in ws]
    return {"gates": ws[:2], "ups": ws[2:]}


def args_stack_w13_nvfp4():
    return args_stack_w13(True)


def args_fuse_w13():
    return {"gate": rand(16, 32, seed=1), "up": rand(16, 32, seed=2)}


def args_from_linear():
    return {"linear": torch.nn.Linear(32, 8).to(DEV)}


def args_quantize_linears():
    return {"module": torch.nn.Sequential(torch.nn.Linear(32, 8), torch.nn.Linear(8, 4)).to(DEV)}


def call_nvfp4_linear_module(x, w, bias):
    return matmul.NVFP4Linear(w, bias)(x)


def call_gates(A_log, a, dt_bias, b):
    return deltanet.gates(A_log, a, dt_bias, b)


#: op name -> (the public callable, its valid arguments). Names are as a user writes them after ``lynn_kernels.``.
OPS: dict[str, tuple[Callable, Callable[[], dict]]] = {
    "nvfp4.quantize": (nvfp4.quantize, args_quantize),
    "nvfp4.dequantize": (nvfp4.dequantize, args_dequantize),
    "nvfp4.NVFP4Tensor": (NVFP4Tensor, args_nvfp4_tensor),
    "nvfp4.NVFP4Tensor.from_modelopt": (NVFP4Tensor.from_modelopt, args_from_modelopt),
    "nvfp4.NVFP4Tensor.from_compressed_tensors": (NVFP4Tensor.from_compressed_tensors, args_from_compressed_tensors),
    "matmul.nvfp4_linear": (matmul.nvfp4_linear, args_linear),
    "matmul.nvfp4_gemv": (matmul.nvfp4_gemv, args_linear),
    "matmul.nvfp4_gemm": (matmul.nvfp4_gemm, args_linear),
    "matmul.NVFP4Linear": (call_nvfp4_linear_module, args_linear),
    "matmul.NVFP4Linear.from_linear": (matmul.NVFP4Linear.from_linear, args_from_linear),
    "matmul.quantize_linears": (matmul.quantize_linears, args_quantize_linears),
    "matmul.norm_linear": (matmul.norm_linear, args_norm_linear),
    "attention.flash_attention": (attention.flash_attention, args_flash),
    "attention.decode_attention": (attention.decode_attention, args_decode),
    "attention.qk_norm_rope": (attention.qk_norm_rope, args_rope),
    "attention.decode_plan": (attention.decode_plan, args_decode_plan),
    "attention.split_q_gate": (attention.split_q_gate, args_split_q_gate),
    "attention.paged_slots": (attention.paged_slots, args_paged_slots),
    "attention.contiguous_slots": (attention.contiguous_slots, args_contiguous_slots),
    "deltanet.chunk_gated_delta_rule": (deltanet.chunk_gated_delta_rule, args_chunk),
    "deltanet.recurrent_gated_delta_rule": (deltanet.recurrent_gated_delta_rule, args_delta),
    "deltanet.recurrent_gated_delta_rule_gates": (deltanet.recurrent_gated_delta_rule_gates, args_delta_gates),
    "deltanet.gates": (call_gates, args_gates),
    "deltanet.causal_conv1d": (deltanet.causal_conv1d, args_conv),
    "deltanet.causal_conv1d_update": (deltanet.causal_conv1d_update, args_conv_update),
    "deltanet.gated_rmsnorm": (deltanet.gated_rmsnorm, args_gated_rmsnorm),
    "deltanet.gated_delta_decode": (deltanet.gated_delta_decode, args_decode_step),
    "moe.route": (moe.route, args_route),
    "moe.align": (moe.align, args_align),
    "moe.moe_experts": (moe.moe_experts, args_experts),
    "moe.moe_block": (moe.moe_block, args_block),
    "moe.norm_moe_block": (moe.norm_moe_block, args_norm_block),
    "moe.stack_w13": (moe.stack_w13, args_stack_w13),
    "moe.fuse_w13": (moe.fuse_w13, args_fuse_w13),
    "norm.rmsnorm": (norm.rmsnorm, args_rmsnorm),
}

#: variants of an op's valid arguments (another layout of the same op), keyed "op@variant"
VARIANTS: dict[str, Callable[[], dict]] = {
    "attention.flash_attention@prefix": args_flash_prefix,
    "attention.decode_attention@paged": args_decode_paged,
    "attention.qk_norm_rope@tables": args_rope_tables,
    "deltanet.gated_delta_decode@gates": args_decode_step_gates,
    "deltanet.chunk_gated_delta_rule@packed": args_chunk_packed,
    "moe.moe_experts@nvfp4": args_experts_nvfp4,
    "moe.moe_block@nvfp4": args_block_nvfp4,
    "moe.stack_w13@nvfp4": args_stack_w13_nvfp4,
}


# ---------------------------------------------------------------------------------------------------------------
# the table


@dataclass(frozen=True)
class Case:
    op: str                               #: a key of OPS, optionally "@variant" (a key of VARIANTS)
    kind: str                             #: what is wrong (see the module docstring)
    what: str                             #: a few words, for the test id
    error: type                           #: TypeError or ValueError
    name: str                             #: the tensor (argument) the message must name
    edit: Callable[[dict], dict]          #: valid arguments -> the replacements that make them bad
    backends: tuple = BOTH
    match: str | None = None              #: a regex the message must also match (default: the name as a word)
    cpu_only: bool = False                #: the error is an exception on the CPU only (on a GPU a device-side assert)

    @property
    def id(self) -> str:
        return f"{self.op}-{self.kind}-{self.what}"


def c(op, kind, what, error, name, edit, backends=BOTH, match=None, cpu_only=False) -> Case:
    return Case(op, kind, what, error, name, edit, backends, match, cpu_only)


T_, V_ = TypeError, ValueError
N_ONLY, R_ONLY = (NATIVE,), (REFERENCE,)
#: a helper with no backend of its own (no kernel, no reference): one run is all there is to test
ONCE = (NATIVE,)


def cuda(*names) -> Callable[[dict], dict]:
    """Every tensor argument (NVFP4Tensor and SharedExpert parts included) as a fake CUDA tensor; ``names`` only
    documents which one the error is expected to name first."""
    return lambda a: {k: to_fake_cuda(v) for k, v in a.items()}


CASES: list[Case] = [
    # -- nvfp4 -----------------------------------------------------------------------------------------------------
    c("nvfp4.quantize", "type", "w-list", T_, "w", lambda a: {"w": [[1.0] * 16]}),
    c("nvfp4.quantize", "dtype", "w-int", T_, "w", lambda a: {"w": a["w"].int()}),
    c("nvfp4.quantize", "dtype", "w-fp64", T_, "w", lambda a: {"w": a["w"].double()}),
    c("nvfp4.quantize", "rank", "w-0d", V_, "w", lambda a: {"w": a["w"][0, 0]}),
    c("nvfp4.quantize", "k16", "w-K24", V_, "w", lambda a: {"w": a["w"][:, :24]}),
    c("nvfp4.quantize", "k16", "w-K8", V_, "w", lambda a: {"w": a["w"][:, :8]}),
    c("nvfp4.quantize", "empty", "w-no-rows", V_, "w", lambda a: {"w": a["w"][:0]}),
    c("nvfp4.quantize", "empty", "w-K0", V_, "w", lambda a: {"w": a["w"][:, :0]}),
    c("nvfp4.quantize", "finite", "w-nan", V_, "w", lambda a: {"w": with_value(a["w"], NAN)}),
    c("nvfp4.quantize", "finite", "w-inf", V_, "w", lambda a: {"w": with_value(a["w"], -INF, 5)}),
    c("nvfp4.quantize", "finite", "w-nan-given-scale", V_, "w",
      lambda a: {"w": with_value(a["w"], NAN), "global_scale": 0.01}),
    c("nvfp4.quantize", "finite", "global_scale-nan", V_, "global_scale", lambda a: {"global_scale": NAN}),
    c("nvfp4.quantize", "range", "global_scale-zero", V_, "global_scale", lambda a: {"global_scale": 0.0}),
    c("nvfp4.quantize", "shape", "global_scale-5", V_, "global_scale",
      lambda a: {"global_scale": torch.ones(5, device=DEV)}),
    c("nvfp4.quantize", "dtype", "global_scale-int", T_, "global_scale",
      lambda a: {"global_scale": torch.ones((), dtype=I32, device=DEV)}),
    c("nvfp4.quantize", "value", "recipe", V_, "recipe", lambda a: {"recipe": "gptq"}),
    c("nvfp4.quantize", "cuda", "w", V_, "w", cuda("w"), N_ONLY),
    c("nvfp4.quantize", "device", "w-meta", V_, "w", lambda a: {"w": meta(a["w"])}, N_ONLY),
    c("nvfp4.dequantize", "type", "q-tensor", T_, "q", lambda a: {"q": rand(4, 32)}),
    c("nvfp4.dequantize", "dtype", "out-int", T_, "dtype", lambda a: {"dtype": I32}),
    c("nvfp4.dequantize", "dtype", "out-fp8", T_, "dtype", lambda a: {"dtype": torch.float8_e4m3fn}),
    c("nvfp4.dequantize", "cuda", "q", V_, "q.codes", cuda("q"), N_ONLY),
    c("nvfp4.dequantize", "device", "q-meta", V_, "q.codes", lambda a: {"q": a["q"].to("meta")}, N_ONLY),
    c("nvfp4.NVFP4Tensor", "type", "codes-list", T_, "codes", lambda a: {"codes": [1, 2]}),
    c("nvfp4.NVFP4Tensor", "dtype", "codes-int32", T_, "codes", lambda a: {"codes": a["codes"].int()}),
    c("nvfp4.NVFP4Tensor", "dtype", "scales-fp32", T_, "scales", lambda a: {"scales": a["scales"].float()}),
    c("nvfp4.NVFP4Tensor", "dtype", "global_scale-bf16", T_, "global_scale",
      lambda a: {"global_scale": a["global_scale"].bfloat16()}),
    c("nvfp4.NVFP4Tensor", "k16", "codes-K24", V_, "codes",
      lambda a: {"codes": a["codes"][:, :12], "scales": a["scales"][:, :1]}),
    c("nvfp4.NVFP4Tensor", "shape", "scales", V_, "scales", lambda a: {"scales": a["scales"][:, :1]}),
    c("nvfp4.NVFP4Tensor", "shape", "global_scale", V_, "global_scale",
      lambda a: {"global_scale": torch.ones(3, device=DEV)}),
    c("nvfp4.NVFP4Tensor", "empty", "codes", V_, "codes",
      lambda a: {"codes": a["codes"][:0], "scales": a["scales"][:0]}),
    c("nvfp4.NVFP4Tensor", "rank", "codes-0d", V_, "codes", lambda a: {"codes": a["codes"][0, 0]}),
    c("nvfp4.NVFP4Tensor", "device", "scales-meta", V_, "scales", lambda a: {"scales": meta(a["scales"])}),
    c("nvfp4.NVFP4Tensor.from_modelopt", "finite", "weight_scale_2-nan", V_, "weight_scale_2",
      lambda a: {"weight_scale_2": torch.tensor(NAN, device=DEV)}),
    c("nvfp4.NVFP4Tensor.from_modelopt", "finite", "weight_scale_2-inf", V_, "weight_scale_2",
      lambda a: {"weight_scale_2": torch.tensor(INF, device=DEV)}),
    c("nvfp4.NVFP4Tensor.from_modelopt", "range", "weight_scale_2-negative", V_, "weight_scale_2",
      lambda a: {"weight_scale_2": torch.tensor(-1.0, device=DEV)}),
    c("nvfp4.NVFP4Tensor.from_modelopt", "dtype", "weight_scale_2-bf16", T_, "weight_scale_2",
      lambda a: {"weight_scale_2": a["weight_scale_2"].bfloat16()}),
    c("nvfp4.NVFP4Tensor.from_modelopt", "dtype", "weight-int8", T_, "weight",
      lambda a: {"weight": a["weight"].to(torch.int8)}),
    c("nvfp4.NVFP4Tensor.from_modelopt", "shape", "weight_scale", V_, "weight_scale",
      lambda a: {"weight_scale": a["weight_scale"][:2]}),
    c("nvfp4.NVFP4Tensor.from_compressed_tensors", "finite", "weight_global_scale-nan", V_, "weight_global_scale",
      lambda a: {"weight_global_scale": torch.tensor([NAN], device=DEV)}),
    c("nvfp4.NVFP4Tensor.from_compressed_tensors", "range", "weight_global_scale-zero", V_,
      "weight_global_scale", lambda a: {"weight_global_scale": torch.tensor([0.0], device=DEV)}),
    c("nvfp4.NVFP4Tensor.from_compressed_tensors", "dtype", "weight_packed-fp32", T_, "weight_packed",
      lambda a: {"weight_packed": a["weight_packed"].float()}),
    # -- matmul (only the cases that pass today: matmul/ is being rewritten; see the report for the others) --------
    *[row for op in ("matmul.nvfp4_linear", "matmul.nvfp4_gemv", "matmul.nvfp4_gemm", "matmul.NVFP4Linear") for row in (
        *([] if op == "matmul.NVFP4Linear" else [c(op, "type", "w-tensor", T_, "w", lambda a: {"w": rand(8, 32)})]),
        c(op, "type", "x-list", T_, "x", lambda a: {"x": [[1.0] * 32]}),
        c(op, "dtype", "x-int", T_, "x", lambda a: {"x": a["x"].int()}),
        c(op, "dtype", "x-fp64", T_, "x", lambda a: {"x": a["x"].double()}),
        c(op, "shape", "x-K", V_, "x", lambda a: {"x": rand(2, 48)}),
        c(op, "k16", "x-K24", V_, "x", lambda a: {"x": rand(2, 24)}),
        c(op, "rank", "x-0d", V_, "x", lambda a: {"x": a["x"][0, 0]}),
        c(op, "shape", "bias", V_, "bias", lambda a: {"bias": rand(7)}),
        c(op, "device", "x-meta", V_, "x", lambda a: {"x": meta(a["x"])}),
        c(op, "cuda", "x-w", V_, "x", cuda("x"), N_ONLY),
        c(op, "rank", "w-3d", V_, "w" if op != "matmul.NVFP4Linear" else "weight",
          lambda a: {"w": q4(rand(2, 8, 32))}),
    )],
    *[row for op in ("matmul.nvfp4_linear", "matmul.nvfp4_gemv", "matmul.nvfp4_gemm") for row in (
        c(op, "type", "bias-list", T_, "bias", lambda a: {"bias": [0.0] * 8}),
        c(op, "dtype", "bias-int", T_, "bias", lambda a: {"bias": a["bias"].int()}),
        c(op, "dtype", "bias-fp64", T_, "bias", lambda a: {"bias": a["bias"].double()}),
        c(op, "rank", "bias-2d", V_, "bias", lambda a: {"bias": a["bias"][None]}),
        c(op, "empty", "x-K0", V_, "x", lambda a: {"x": a["x"][:, :0]}),
        c(op, "device", "bias-meta", V_, "bias", lambda a: {"bias": meta(a["bias"])}),
        c(op, "device", "w-meta", V_, "w", lambda a: {"w": a["w"].to("meta")}),
    )],
    c("matmul.NVFP4Linear", "dtype", "bias-int", T_, "bias", lambda a: {"bias": a["bias"].int()}),
    c("matmul.NVFP4Linear.from_linear", "k16", "in_features-24", V_, "in_features",
      lambda a: {"linear": torch.nn.Linear(24, 8)}),
    c("matmul.NVFP4Linear.from_linear", "value", "recipe", V_, "recipe", lambda a: {"recipe": "gptq"}),
    c("matmul.NVFP4Linear.from_linear", "finite", "global_scale-nan", V_, "global_scale",
      lambda a: {"global_scale": NAN}),
    c("matmul.quantize_linears", "value", "recipe", V_, "recipe", lambda a: {"recipe": "gptq"}),
    c("matmul.NVFP4Linear", "type", "weight-float", T_, "weight", lambda a: {"w": rand(8, 32)}),
    c("matmul.NVFP4Linear", "type", "bias-list", T_, "bias", lambda a: {"bias": [0.0] * 8}),
    c("matmul.NVFP4Linear.from_linear", "type", "linear-conv", T_, "linear",
      lambda a: {"linear": torch.nn.Conv1d(32, 8, 1)}),
    c("matmul.quantize_linears", "type", "module-str", T_, "module", lambda a: {"module": "model"}),
    c("matmul.quantize_linears", "type", "skip-int", T_, "skip", lambda a: {"skip": 3}),
    c("matmul.quantize_linears", "finite", "weight-nan", V_, "0.weight",
      lambda a: {"module": torch.nn.Sequential(torch.nn.Linear(32, 8)).to(DEV).requires_grad_(False).apply(
          lambda m: m.weight.fill_(float("nan")) if isinstance(m, torch.nn.Linear) else None)}),
    c("matmul.nvfp4_gemv", "range", "x-17-rows", V_, "x", lambda a: {"x": rand(17, 32)}),
    c("matmul.nvfp4_gemv", "range", "x-3x6-rows", V_, "x", lambda a: {"x": rand(3, 6, 32)}),
    # -- attention: flash_attention ----------------------------------------------------------------------------------
    c("attention.flash_attention", "type", "q-list", T_, "q", lambda a: {"q": a["q"].tolist()}),
    c("attention.flash_attention", "dtype", "q-int", T_, "q", lambda a: {"q": a["q"].int()}),
    c("attention.flash_attention", "dtype", "k-bf16", T_, "k", lambda a: {"k": a["k"].bfloat16()}),
    c("attention.flash_attention", "dtype", "v-fp64", T_, "v", lambda a: {"v": a["v"].double()}),
    c("attention.flash_attention", "dtype", "gate-bf16", T_, "gate", lambda a: {"gate": a["gate"].bfloat16()}),
    c("attention.flash_attention", "rank", "q-4d", V_, "q", lambda a: {"q": a["q"][None]}),
    c("attention.flash_attention", "rank", "k-2d", V_, "k", lambda a: {"k": a["k"][:, 0]}),
    c("attention.flash_attention", "shape", "k-head-dim", V_, "k", lambda a: {"k": rand(5, 1, 32)}),
    c("attention.flash_attention", "shape", "v-heads", V_, "v", lambda a: {"v": rand(5, 2, 16)}),
    c("attention.flash_attention", "shape", "k-rows", V_, "k",
      lambda a: {"k": rand(4, 1, 16), "v": rand(4, 1, 16)}),
    c("attention.flash_attention", "shape", "gqa-heads", V_, "q",
      lambda a: {"q": rand(5, 3, 16), "gate": None, "k": rand(5, 2, 16), "v": rand(5, 2, 16)}),
    c("attention.flash_attention", "shape", "gate", V_, "gate", lambda a: {"gate": a["gate"][:4]}),
    c("attention.flash_attention", "k16", "head-dim-24", V_, "q",
      lambda a: {"q": rand(5, 2, 24), "k": rand(5, 1, 24), "v": rand(5, 1, 24), "gate": None}),
    c("attention.flash_attention", "dtype", "cu_seqlens-fp32", T_, "cu_seqlens",
      lambda a: {"cu_seqlens": a["cu_seqlens"].float()}),
    c("attention.flash_attention", "rank", "cu_seqlens-2d", V_, "cu_seqlens",
      lambda a: {"cu_seqlens": a["cu_seqlens"][None]}),
    c("attention.flash_attention", "empty", "cu_seqlens", V_, "cu_seqlens",
      lambda a: {"cu_seqlens": a["cu_seqlens"][:0]}),
    c("attention.flash_attention", "range", "cu_seqlens-end", V_, "cu_seqlens",
      lambda a: {"cu_seqlens": ints([0, 2, 6])}),
    c("attention.flash_attention", "range", "cu_seqlens-start", V_, "cu_seqlens",
      lambda a: {"cu_seqlens": ints([1, 2, 5])}),
    c("attention.flash_attention", "range", "cu_seqlens-decreasing", V_, "cu_seqlens",
      lambda a: {"cu_seqlens": ints([0, 4, 2, 5])}),
    c("attention.flash_attention", "finite", "scale-nan", V_, "scale", lambda a: {"scale": NAN}),
    c("attention.flash_attention", "range", "scale-negative", V_, "scale", lambda a: {"scale": -0.25}),
    c("attention.flash_attention", "type", "scale-tensor", T_, "scale", lambda a: {"scale": torch.tensor(0.25)}),
    c("attention.flash_attention", "type", "causal-str", T_, "causal", lambda a: {"causal": "yes"}),
    c("attention.flash_attention", "device", "k-meta", V_, "k", lambda a: {"k": meta(a["k"])}),
    c("attention.flash_attention", "device", "gate-meta", V_, "gate", lambda a: {"gate": meta(a["gate"])}),
    c("attention.flash_attention", "device", "cu_seqlens-meta", V_, "cu_seqlens",
      lambda a: {"cu_seqlens": meta(a["cu_seqlens"])}),
    c("attention.flash_attention", "cuda", "all", V_, "q", cuda("q"), N_ONLY),
    c("attention.flash_attention", "cuda", "cu_seqlens", V_, "cu_seqlens",
      lambda a: {"cu_seqlens": to_fake_cuda(a["cu_seqlens"])}),
    c("attention.flash_attention@prefix", "range", "prefix_lens-negative", V_, "prefix_lens",
      lambda a: {"prefix_lens": ints([-1, 4]), }),
    c("attention.flash_attention@prefix", "shape", "prefix_lens-count", V_, "prefix_lens",
      lambda a: {"prefix_lens": ints([3])}),
    c("attention.flash_attention@prefix", "dtype", "prefix_lens-fp32", T_, "prefix_lens",
      lambda a: {"prefix_lens": a["prefix_lens"].float()}),
    c("attention.flash_attention@prefix", "shape", "k-rows", V_, "k",
      lambda a: {"prefix_lens": ints([1, 3])}),
    c("attention.flash_attention@prefix", "device", "prefix_lens-meta", V_, "prefix_lens",
      lambda a: {"prefix_lens": meta(a["prefix_lens"])}),
    # -- attention: decode_attention ---------------------------------------------------------------------------------
    c("attention.decode_attention", "type", "k_cache-none", T_, "k_cache", lambda a: {"k_cache": None}),
    c("attention.decode_attention", "dtype", "q-int", T_, "q", lambda a: {"q": a["q"].int()}),
    c("attention.decode_attention", "dtype", "k_cache-bf16", T_, "k_cache",
      lambda a: {"k_cache": a["k_cache"].bfloat16(), "v_cache": a["v_cache"].bfloat16()}),
    c("attention.decode_attention", "dtype", "v_cache-bf16", T_, "v_cache",
      lambda a: {"v_cache": a["v_cache"].bfloat16()}),
    c("attention.decode_attention", "dtype", "seq_lens-fp32", T_, "seq_lens",
      lambda a: {"seq_lens": a["seq_lens"].float()}),
    c("attention.decode_attention", "rank", "q-4d", V_, "q", lambda a: {"q": a["q"][:, None]}),
    c("attention.decode_attention", "rank", "k_cache-3d", V_, "k_cache", lambda a: {"k_cache": a["k_cache"][0]}),
    c("attention.decode_attention", "shape", "v_cache", V_, "v_cache", lambda a: {"v_cache": a["v_cache"][:, :8]}),
    c("attention.decode_attention", "shape", "k_cache-head-dim", V_, "k_cache",
      lambda a: {"k_cache": rand(2, 16, 1, 32), "v_cache": rand(2, 16, 1, 32)}),
    c("attention.decode_attention", "shape", "k_cache-rows", V_, "k_cache",
      lambda a: {"k_cache": a["k_cache"][:1], "v_cache": a["v_cache"][:1]}),
    c("attention.decode_attention", "shape", "seq_lens-count", V_, "seq_lens", lambda a: {"seq_lens": ints([3])}),
    c("attention.decode_attention", "shape", "gate", V_, "gate", lambda a: {"gate": a["gate"][:1]}),
    c("attention.decode_attention", "range", "seq_lens-over-capacity", V_, "seq_lens",
      lambda a: {"seq_lens": ints([3, 17])}),
    c("attention.decode_attention", "range", "seq_lens-negative", V_, "seq_lens",
      lambda a: {"seq_lens": ints([-1, 3])}),
    c("attention.decode_attention", "range", "num_splits-0", V_, "num_splits", lambda a: {"num_splits": 0}),
    c("attention.decode_attention", "type", "num_splits-float", T_, "num_splits", lambda a: {"num_splits": 2.0}),
    c("attention.decode_attention", "finite", "scale-inf", V_, "scale", lambda a: {"scale": INF}),
    c("attention.decode_attention", "layout", "k_cache-head-stride", V_, "k_cache",
      lambda a: {"k_cache": strided(a["k_cache"]), "v_cache": strided(a["v_cache"])}),
    c("attention.decode_attention", "device", "v_cache-meta", V_, "v_cache",
      lambda a: {"v_cache": meta(a["v_cache"])}),
    c("attention.decode_attention", "device", "seq_lens-meta", V_, "seq_lens",
      lambda a: {"seq_lens": meta(a["seq_lens"])}),
    c("attention.decode_attention", "cuda", "all", V_, "q", cuda("q"), N_ONLY),
    c("attention.decode_attention@paged", "range", "block_table-entry", V_, "block_table",
      lambda a: {"block_table": ints([[2, 0], [1, 3]])}),
    c("attention.decode_attention@paged", "range", "block_table-negative", V_, "block_table",
      lambda a: {"block_table": ints([[-1, 0], [1, 0]])}),
    c("attention.decode_attention@paged", "range", "seq_lens-over-pages", V_, "seq_lens",
      lambda a: {"seq_lens": ints([3, 33])}),
    c("attention.decode_attention@paged", "dtype", "block_table-int64", T_, "block_table",
      lambda a: {"block_table": a["block_table"].long()}),
    c("attention.decode_attention@paged", "shape", "block_table-rows", V_, "block_table",
      lambda a: {"block_table": a["block_table"][:1]}),
    c("attention.decode_attention@paged", "range", "page-8", V_, "k_cache",
      lambda a: {"k_cache": a["k_cache"][:, :8], "v_cache": a["v_cache"][:, :8], "seq_lens": ints([3, 9])}),
    c("attention.decode_attention@paged", "rank", "block_table-1d", V_, "block_table",
      lambda a: {"block_table": a["block_table"][:, 0]}),
    c("attention.decode_attention@paged", "device", "block_table-meta", V_, "block_table",
      lambda a: {"block_table": meta(a["block_table"])}),
    # -- attention: qk_norm_rope -------------------------------------------------------------------------------------
    c("attention.qk_norm_rope", "dtype", "q-int", T_, "q", lambda a: {"q": a["q"].int()}),
    c("attention.qk_norm_rope", "dtype", "k-bf16", T_, "k", lambda a: {"k": a["k"].bfloat16()}),
    c("attention.qk_norm_rope", "dtype", "q_weight-int", T_, "q_weight", lambda a: {"q_weight": a["q_weight"].int()}),
    c("attention.qk_norm_rope", "dtype", "positions-fp32", T_, "positions",
      lambda a: {"positions": a["positions"].float()}),
    c("attention.qk_norm_rope", "dtype", "k_cache-bf16", T_, "k_cache",
      lambda a: {"k_cache": a["k_cache"].bfloat16(), "v_cache": a["v_cache"].bfloat16()}),
    c("attention.qk_norm_rope", "dtype", "v_cache-bf16", T_, "v_cache",
      lambda a: {"v_cache": a["v_cache"].bfloat16()}),
    c("attention.qk_norm_rope", "dtype", "slot_mapping-fp32", T_, "slot_mapping",
      lambda a: {"slot_mapping": a["slot_mapping"].float()}),
    c("attention.qk_norm_rope", "dtype", "v-bf16", T_, "v", lambda a: {"v": a["v"].bfloat16()}),
    c("attention.qk_norm_rope", "rank", "positions-2d", V_, "positions",
      lambda a: {"positions": a["positions"][None]}),
    c("attention.qk_norm_rope", "shape", "q_weight", V_, "q_weight", lambda a: {"q_weight": a["q_weight"][:8]}),
    c("attention.qk_norm_rope", "shape", "k_weight", V_, "k_weight", lambda a: {"k_weight": a["k_weight"][:8]}),
    c("attention.qk_norm_rope", "shape", "k-tokens", V_, "k", lambda a: {"k": a["k"][:2]}),
    c("attention.qk_norm_rope", "shape", "positions-count", V_, "positions",
      lambda a: {"positions": a["positions"][:2]}),
    c("attention.qk_norm_rope", "shape", "slot_mapping-count", V_, "slot_mapping",
      lambda a: {"slot_mapping": a["slot_mapping"][:2]}),
    c("attention.qk_norm_rope", "shape", "k_cache-heads", V_, "k_cache",
      lambda a: {"k_cache": rand(2, 16, 2, 16), "v_cache": rand(2, 16, 2, 16)}),
    c("attention.qk_norm_rope", "shape", "v_cache", V_, "v_cache", lambda a: {"v_cache": a["v_cache"][:1]}),
    c("attention.qk_norm_rope", "shape", "v", V_, "v", lambda a: {"v": a["v"][:2]}),
    c("attention.qk_norm_rope", "value", "cache-without-v", V_, "v", lambda a: {"v": None}),
    c("attention.qk_norm_rope", "value", "cache-without-slot_mapping", V_, "slot_mapping",
      lambda a: {"slot_mapping": None}),
    c("attention.qk_norm_rope", "range", "positions-negative", V_, "positions",
      lambda a: {"positions": ints([0, -1, 7])}),
    c("attention.qk_norm_rope", "range", "positions-past-theta-limit", V_, "positions",
      lambda a: {"positions": ints([0, 1, attention.spec.ROPE_THETA_MAX_POSITION + 1])}),
    c("attention.qk_norm_rope", "range", "slot_mapping-past-cache", V_, "slot_mapping",
      lambda a: {"slot_mapping": ints([0, 1, 32], I64)}),
    c("attention.qk_norm_rope", "range", "slot_mapping-below-minus-1", V_, "slot_mapping",
      lambda a: {"slot_mapping": ints([0, -2, 3], I64)}),
    c("attention.qk_norm_rope", "range", "rotary_dim-odd", V_, "rotary_dim", lambda a: {"rotary_dim": 7}),
    c("attention.qk_norm_rope", "range", "rotary_dim-over-head-dim", V_, "rotary_dim",
      lambda a: {"rotary_dim": 32}),
    c("attention.qk_norm_rope", "type", "rotary_dim-float", T_, "rotary_dim", lambda a: {"rotary_dim": 8.0}),
    c("attention.qk_norm_rope", "finite", "rope_theta-nan", V_, "rope_theta", lambda a: {"rope_theta": NAN}),
    c("attention.qk_norm_rope", "finite", "rope_theta-inf", V_, "rope_theta", lambda a: {"rope_theta": INF}),
    c("attention.qk_norm_rope", "range", "rope_theta-missing", V_, "rope_theta", lambda a: {"rope_theta": None}),
    c("attention.qk_norm_rope", "finite", "eps-nan", V_, "eps", lambda a: {"eps": NAN}),
    c("attention.qk_norm_rope", "range", "eps-zero", V_, "eps", lambda a: {"eps": 0.0}),
    c("attention.qk_norm_rope", "layout", "k_cache-head-stride", V_, "k_cache",
      lambda a: {"k_cache": strided(a["k_cache"]), "v_cache": strided(a["v_cache"])}),
    c("attention.qk_norm_rope", "device", "k-meta", V_, "k", lambda a: {"k": meta(a["k"])}),
    c("attention.qk_norm_rope", "device", "k_cache-meta", V_, "k_cache",
      lambda a: {"k_cache": meta(a["k_cache"]), "v_cache": meta(a["v_cache"])}),
    c("attention.qk_norm_rope", "device", "positions-meta", V_, "positions",
      lambda a: {"positions": meta(a["positions"])}),
    c("attention.qk_norm_rope", "device", "slot_mapping-meta", V_, "slot_mapping",
      lambda a: {"slot_mapping": meta(a["slot_mapping"])}),
    c("attention.qk_norm_rope", "cuda", "all", V_, "q", cuda("q"), N_ONLY),
    c("attention.qk_norm_rope@tables", "range", "positions-past-table", V_, "positions",
      lambda a: {"positions": ints([0, 1, 8])}),
    c("attention.qk_norm_rope@tables", "shape", "cos-rotary-dim", V_, "cos", lambda a: {"cos": a["cos"][:, :4]}),
    c("attention.qk_norm_rope@tables", "shape", "sin", V_, "sin", lambda a: {"sin": a["sin"][:4]}),
    c("attention.qk_norm_rope@tables", "value", "sin-missing", V_, "sin", lambda a: {"sin": None}),
    c("attention.qk_norm_rope@tables", "dtype", "cos-int", T_, "cos", lambda a: {"cos": a["cos"].int()}),
    c("attention.qk_norm_rope@tables", "device", "cos-meta", V_, "cos", lambda a: {"cos": meta(a["cos"])}),
    c("attention.qk_norm_rope", "alias", "v_cache-is-k_cache", V_, "v_cache", lambda a: {"v_cache": a["k_cache"]},
      match=r"k_cache and v_cache share memory"),
    c("attention.qk_norm_rope", "alias", "v_cache-shifted-k_cache", V_, "v_cache",
      lambda a: (lambda buf: {"k_cache": buf[:2], "v_cache": buf[1:]})(rand(3, 16, 1, 16, seed=6)),
      match=r"k_cache and v_cache share memory"),
    c("attention.qk_norm_rope", "alias", "k-in-k_cache", V_, "k_cache", lambda a: {"k": a["k_cache"][1, :3]},
      match=r"k_cache shares memory with k\b"),
    c("attention.qk_norm_rope", "value", "slot_mapping-duplicate", V_, "slot_mapping",
      lambda a: {"slot_mapping": ints([17, -1, 17], I64)}, match=r"found slot 17 at tokens \[0, 2\]"),
    # -- attention: the helpers that build its arguments ---------------------------------------------------------------
    c("attention.split_q_gate", "type", "q_proj_out-nvfp4", T_, "q_proj_out",
      lambda a: {"q_proj_out": q4(a["q_proj_out"])}, ONCE),
    c("attention.split_q_gate", "dtype", "q_proj_out-int", T_, "q_proj_out",
      lambda a: {"q_proj_out": a["q_proj_out"].int()}, ONCE),
    c("attention.split_q_gate", "rank", "q_proj_out-3d", V_, "q_proj_out",
      lambda a: {"q_proj_out": a["q_proj_out"][None]}, ONCE),
    c("attention.split_q_gate", "shape", "q_proj_out-width", V_, "q_proj_out", lambda a: {"num_heads": 3}, ONCE,
      match=r"q_proj_out must be \[T, num_heads \* 2 \* head_dim\] = \[T, 3 \* 2 \* 16\] = \[T, 96\]"),
    c("attention.split_q_gate", "type", "num_heads-float", T_, "num_heads", lambda a: {"num_heads": 2.0}, ONCE),
    c("attention.split_q_gate", "range", "head_dim-0", V_, "head_dim",
      lambda a: {"q_proj_out": a["q_proj_out"][:, :0], "head_dim": 0}, ONCE),
    c("attention.paged_slots", "type", "block_table-none", T_, "block_table", lambda a: {"block_table": None}, ONCE),
    c("attention.paged_slots", "dtype", "block_table-fp32", T_, "block_table",
      lambda a: {"block_table": a["block_table"].float()}, ONCE),
    c("attention.paged_slots", "rank", "block_table-1d", V_, "block_table",
      lambda a: {"block_table": a["block_table"][0]}, ONCE),
    c("attention.paged_slots", "dtype", "seq_idx-bool", T_, "seq_idx", lambda a: {"seq_idx": a["seq_idx"].bool()},
      ONCE),
    c("attention.paged_slots", "rank", "seq_idx-2d", V_, "seq_idx",
      lambda a: {"seq_idx": a["seq_idx"][None], "positions": a["positions"][None]}, ONCE),
    c("attention.paged_slots", "shape", "positions-count", V_, "positions",
      lambda a: {"positions": a["positions"][:2]}, ONCE),
    c("attention.paged_slots", "range", "seq_idx-past-table", V_, "seq_idx", lambda a: {"seq_idx": ints([0, 2, 1])},
      ONCE, cpu_only=True),
    c("attention.paged_slots", "range", "seq_idx-negative", V_, "seq_idx", lambda a: {"seq_idx": ints([0, -1, 1])},
      ONCE, cpu_only=True),
    c("attention.paged_slots", "range", "positions-past-table", V_, "positions",
      lambda a: {"positions": ints([3, 40, 5])}, ONCE, cpu_only=True),
    c("attention.paged_slots", "range", "positions-negative", V_, "positions",
      lambda a: {"positions": ints([3, 17, -1])}, ONCE, cpu_only=True),
    c("attention.paged_slots", "range", "page-0", V_, "page", lambda a: {"page": 0}, ONCE),
    c("attention.paged_slots", "type", "page-float", T_, "page", lambda a: {"page": 16.0}, ONCE),
    c("attention.paged_slots", "device", "seq_idx-meta", V_, "seq_idx", lambda a: {"seq_idx": meta(a["seq_idx"])},
      ONCE),
    c("attention.contiguous_slots", "type", "seq_idx-list", T_, "seq_idx", lambda a: {"seq_idx": [0, 1, 1]}, ONCE),
    c("attention.contiguous_slots", "dtype", "positions-fp32", T_, "positions",
      lambda a: {"positions": a["positions"].float()}, ONCE),
    c("attention.contiguous_slots", "shape", "positions-count", V_, "positions",
      lambda a: {"positions": a["positions"][:2]}, ONCE),
    c("attention.contiguous_slots", "range", "seq_idx-negative", V_, "seq_idx",
      lambda a: {"seq_idx": ints([0, -1, 1])}, ONCE),
    c("attention.contiguous_slots", "range", "positions-past-max_len", V_, "positions", lambda a: {"max_len": 16},
      ONCE),
    c("attention.contiguous_slots", "range", "max_len-0", V_, "max_len", lambda a: {"max_len": 0}, ONCE),
    # -- deltanet: the delta rule (chunk and recurrent share the checks) ----------------------------------------------
    *[row for op in ("deltanet.chunk_gated_delta_rule", "deltanet.recurrent_gated_delta_rule") for row in (
        c(op, "type", "q-list", T_, "q", lambda a: {"q": a["q"].tolist()}),
        c(op, "dtype", "q-int", T_, "q", lambda a: {"q": a["q"].int()}),
        c(op, "dtype", "k-bf16", T_, "k", lambda a: {"k": a["k"].bfloat16()}),
        c(op, "dtype", "v-fp64", T_, "v", lambda a: {"v": a["v"].double()}),
        c(op, "dtype", "g-int", T_, "g", lambda a: {"g": a["g"].int()}),
        c(op, "dtype", "beta-fp64", T_, "beta", lambda a: {"beta": a["beta"].double()}),
        c(op, "dtype", "initial_state-bf16", T_, "initial_state",
          lambda a: {"initial_state": a["initial_state"].bfloat16()}),
        c(op, "dtype", "out_state-bf16", T_, "out_state", lambda a: {"out_state": a["out_state"].bfloat16()}),
        c(op, "rank", "q-3d", V_, "q", lambda a: {"q": a["q"][0]}),
        c(op, "rank", "v-5d", V_, "v", lambda a: {"v": a["v"][None]}),
        c(op, "shape", "k", V_, "k", lambda a: {"k": a["k"][:, :2]}),
        c(op, "shape", "v-tokens", V_, "v", lambda a: {"v": a["v"][:, :2]}),
        c(op, "shape", "v-heads", V_, "v", lambda a: {"q": rand(1, 3, 3, 4), "k": rand(1, 3, 3, 4)}),
        c(op, "shape", "g", V_, "g", lambda a: {"g": a["g"][..., :1]}),
        c(op, "shape", "beta", V_, "beta", lambda a: {"beta": a["beta"][:, :2]}),
        c(op, "shape", "initial_state", V_, "initial_state", lambda a: {"initial_state": a["initial_state"][..., :2]}),
        c(op, "shape", "out_state", V_, "out_state", lambda a: {"out_state": a["out_state"][:, :1]}),
        c(op, "range", "head-dim-300", V_, "q",
          lambda a: {"q": rand(1, 3, 1, 300), "k": rand(1, 3, 1, 300), "initial_state": None, "out_state": None}),
        c(op, "range", "v-head-dim-300", V_, "v",
          lambda a: {"v": rand(1, 3, 2, 300), "initial_state": None, "out_state": None}),
        c(op, "empty", "head-dim-0", V_, "q",
          lambda a: {"q": rand(1, 3, 1, 0), "k": rand(1, 3, 1, 0), "initial_state": None, "out_state": None}),
        c(op, "finite", "scale-nan", V_, "scale", lambda a: {"scale": NAN}),
        c(op, "finite", "scale-inf", V_, "scale", lambda a: {"scale": INF}),
        c(op, "range", "scale-zero", V_, "scale", lambda a: {"scale": 0.0}),
        c(op, "type", "scale-tensor", T_, "scale", lambda a: {"scale": torch.tensor(0.5)}),
        c(op, "layout", "out_state-strided", V_, "out_state", lambda a: {"out_state": strided(a["out_state"])}),
        c(op, "layout", "in-place-strided", V_, "out_state",
          lambda a: in_place(strided(a["initial_state"]))),
        c(op, "alias", "out_state-shifted-initial_state", V_, "out_state",
          lambda a: shifted_state(rand(48, seed=12)), match=r"out_state overlaps initial_state without being the same"),
        c(op, "alias", "out_state-over-v", V_, "out_state", lambda a: state_over("v", (1, 3, 2, 4)),
          match=r"out_state shares memory with v\b"),
        c(op, "device", "k-meta", V_, "k", lambda a: {"k": meta(a["k"])}),
        c(op, "device", "g-meta", V_, "g", lambda a: {"g": meta(a["g"])}),
        c(op, "device", "initial_state-meta", V_, "initial_state",
          lambda a: {"initial_state": meta(a["initial_state"])}),
        c(op, "device", "out_state-meta", V_, "out_state", lambda a: {"out_state": meta(a["out_state"])}),
        c(op, "cuda", "all", V_, "q", cuda("q"), N_ONLY),
    )],
    c("deltanet.chunk_gated_delta_rule@packed", "dtype", "cu_seqlens-int64", T_, "cu_seqlens",
      lambda a: {"cu_seqlens": a["cu_seqlens"].long()}),
    c("deltanet.chunk_gated_delta_rule@packed", "rank", "cu_seqlens-2d", V_, "cu_seqlens",
      lambda a: {"cu_seqlens": a["cu_seqlens"][None]}),
    c("deltanet.chunk_gated_delta_rule@packed", "empty", "cu_seqlens-one-entry", V_, "cu_seqlens",
      lambda a: {"cu_seqlens": a["cu_seqlens"][:1]}),
    c("deltanet.chunk_gated_delta_rule@packed", "range", "cu_seqlens-start", V_, "cu_seqlens",
      lambda a: {"cu_seqlens": ints([1, 2, 5])}),
    c("deltanet.chunk_gated_delta_rule@packed", "range", "cu_seqlens-decreasing", V_, "cu_seqlens",
      lambda a: {"cu_seqlens": ints([0, 3, 2, 5]), "initial_state": None, "out_state": None}),
    c("deltanet.chunk_gated_delta_rule@packed", "range", "cu_seqlens-end", V_, "cu_seqlens",
      lambda a: {"cu_seqlens": ints([0, 2, 4])}),
    c("deltanet.chunk_gated_delta_rule@packed", "shape", "batch-2-rows", V_, "q",
      lambda a: {k: (torch.cat([a[k], a[k]]) if k in ("q", "k", "v", "g", "beta") else a[k]) for k in a}),
    c("deltanet.chunk_gated_delta_rule@packed", "shape", "initial_state-rows", V_, "initial_state",
      lambda a: {"initial_state": a["initial_state"][:1]}),
    c("deltanet.chunk_gated_delta_rule@packed", "device", "cu_seqlens-meta", V_, "cu_seqlens",
      lambda a: {"cu_seqlens": meta(a["cu_seqlens"])}),
    # -- deltanet: the fused-gates decode step and the gates -----------------------------------------------------------
    c("deltanet.recurrent_gated_delta_rule_gates", "dtype", "q-int", T_, "q", lambda a: {"q": a["q"].int()}),
    c("deltanet.recurrent_gated_delta_rule_gates", "dtype", "A_log-int", T_, "A_log",
      lambda a: {"A_log": a["A_log"].int()}),
    c("deltanet.recurrent_gated_delta_rule_gates", "dtype", "b-fp64", T_, "b", lambda a: {"b": a["b"].double()}),
    c("deltanet.recurrent_gated_delta_rule_gates", "shape", "A_log", V_, "A_log", lambda a: {"A_log": rand(3)}),
    c("deltanet.recurrent_gated_delta_rule_gates", "shape", "dt_bias", V_, "dt_bias",
      lambda a: {"dt_bias": rand(1, 2)}),
    c("deltanet.recurrent_gated_delta_rule_gates", "shape", "a", V_, "a", lambda a: {"a": rand(1, 2, 2)}),
    c("deltanet.recurrent_gated_delta_rule_gates", "shape", "initial_state", V_, "initial_state",
      lambda a: {"initial_state": a["initial_state"][:, :1]}),
    c("deltanet.recurrent_gated_delta_rule_gates", "finite", "scale-nan", V_, "scale", lambda a: {"scale": NAN}),
    c("deltanet.recurrent_gated_delta_rule_gates", "layout", "out_state-strided", V_, "out_state",
      lambda a: {"out_state": strided(a["out_state"])}),
    c("deltanet.recurrent_gated_delta_rule_gates", "alias", "out_state-shifted-initial_state", V_, "out_state",
      lambda a: shifted_state(rand(48, seed=12)), match=r"out_state overlaps initial_state without being the same"),
    c("deltanet.recurrent_gated_delta_rule_gates", "alias", "out_state-over-a", V_, "out_state",
      lambda a: state_over("a", (1, 1, 2)), match=r"out_state shares memory with a\b"),
    c("deltanet.recurrent_gated_delta_rule_gates", "device", "dt_bias-meta", V_, "dt_bias",
      lambda a: {"dt_bias": meta(a["dt_bias"])}),
    c("deltanet.recurrent_gated_delta_rule_gates", "device", "out_state-meta", V_, "out_state",
      lambda a: {"out_state": meta(a["out_state"])}),
    c("deltanet.recurrent_gated_delta_rule_gates", "cuda", "all", V_, "q", cuda("q"), N_ONLY),
    c("deltanet.gates", "type", "A_log-list", T_, "A_log", lambda a: {"A_log": [0.0, 0.0]}, R_ONLY),
    c("deltanet.gates", "dtype", "a-int", T_, "a", lambda a: {"a": a["a"].int()}, R_ONLY),
    c("deltanet.gates", "shape", "A_log", V_, "A_log", lambda a: {"A_log": rand(3)}, R_ONLY),
    c("deltanet.gates", "shape", "b", V_, "b", lambda a: {"b": a["b"][:, :2]}, R_ONLY),
    c("deltanet.gates", "rank", "a-0d", V_, "a", lambda a: {"a": a["a"][0, 0, 0]}, R_ONLY),
    c("deltanet.gates", "device", "dt_bias-meta", V_, "dt_bias", lambda a: {"dt_bias": meta(a["dt_bias"])}, R_ONLY),
    # -- deltanet: conv ------------------------------------------------------------------------------------------------
    c("deltanet.causal_conv1d", "type", "x-list", T_, "x", lambda a: {"x": a["x"].tolist()}),
    c("deltanet.causal_conv1d", "dtype", "x-int", T_, "x", lambda a: {"x": a["x"].int()}),
    c("deltanet.causal_conv1d", "dtype", "weight-fp64", T_, "weight", lambda a: {"weight": a["weight"].double()}),
    c("deltanet.causal_conv1d", "dtype", "initial_state-bf16", T_, "initial_state",
      lambda a: {"initial_state": a["initial_state"].bfloat16()}),
    c("deltanet.causal_conv1d", "rank", "x-2d", V_, "x", lambda a: {"x": a["x"][0]}),
    c("deltanet.causal_conv1d", "rank", "weight-3d", V_, "weight", lambda a: {"weight": a["weight"][:, None]}),
    c("deltanet.causal_conv1d", "shape", "weight-channels", V_, "weight", lambda a: {"weight": a["weight"][:3]}),
    c("deltanet.causal_conv1d", "range", "weight-width-1", V_, "weight", lambda a: {"weight": a["weight"][:, :1]}),
    c("deltanet.causal_conv1d", "range", "weight-width-9", V_, "weight", lambda a: {"weight": rand(4, 9)}),
    c("deltanet.causal_conv1d", "shape", "initial_state-short", V_, "initial_state",
      lambda a: {"initial_state": a["initial_state"][..., :2]}),
    c("deltanet.causal_conv1d", "shape", "initial_state-rows", V_, "initial_state",
      lambda a: {"initial_state": a["initial_state"][:1]}),
    c("deltanet.causal_conv1d", "range", "cu_seqlens-end", V_, "cu_seqlens", lambda a: {"cu_seqlens": ints([0, 2, 4])}),
    c("deltanet.causal_conv1d", "range", "cu_seqlens-decreasing", V_, "cu_seqlens",
      lambda a: {"cu_seqlens": ints([0, 3, 2, 5]), "initial_state": None}),
    c("deltanet.causal_conv1d", "dtype", "cu_seqlens-int64", T_, "cu_seqlens",
      lambda a: {"cu_seqlens": a["cu_seqlens"].long()}),
    c("deltanet.causal_conv1d", "shape", "batch-2-rows", V_, "x", lambda a: {"x": torch.cat([a["x"], a["x"]])}),
    c("deltanet.causal_conv1d", "device", "weight-meta", V_, "weight", lambda a: {"weight": meta(a["weight"])}),
    c("deltanet.causal_conv1d", "device", "initial_state-meta", V_, "initial_state",
      lambda a: {"initial_state": meta(a["initial_state"])}),
    c("deltanet.causal_conv1d", "device", "cu_seqlens-meta", V_, "cu_seqlens",
      lambda a: {"cu_seqlens": meta(a["cu_seqlens"])}),
    c("deltanet.causal_conv1d", "cuda", "all", V_, "x", cuda("x"), N_ONLY),
    c("deltanet.causal_conv1d_update", "type", "conv_state-none", T_, "conv_state", lambda a: {"conv_state": None}),
    c("deltanet.causal_conv1d_update", "dtype", "x-int", T_, "x", lambda a: {"x": a["x"].int()}),
    c("deltanet.causal_conv1d_update", "dtype", "conv_state-bf16", T_, "conv_state",
      lambda a: {"conv_state": a["conv_state"].bfloat16()}),
    c("deltanet.causal_conv1d_update", "rank", "x-3d", V_, "x", lambda a: {"x": a["x"][:, None]}),
    c("deltanet.causal_conv1d_update", "shape", "conv_state-short", V_, "conv_state",
      lambda a: {"conv_state": a["conv_state"][..., :2]}),
    c("deltanet.causal_conv1d_update", "shape", "conv_state-rows", V_, "conv_state",
      lambda a: {"conv_state": a["conv_state"][:1]}),
    c("deltanet.causal_conv1d_update", "range", "weight-width-9", V_, "weight", lambda a: {"weight": rand(4, 9)}),
    c("deltanet.causal_conv1d_update", "device", "conv_state-meta", V_, "conv_state",
      lambda a: {"conv_state": meta(a["conv_state"])}),
    c("deltanet.causal_conv1d_update", "device", "weight-meta", V_, "weight", lambda a: {"weight": meta(a["weight"])}),
    c("deltanet.causal_conv1d_update", "cuda", "all", V_, "x", cuda("x"), N_ONLY),
    # -- deltanet: gated RMSNorm ---------------------------------------------------------------------------------------
    c("deltanet.gated_rmsnorm", "type", "z-list", T_, "z", lambda a: {"z": a["z"].tolist()}),
    c("deltanet.gated_rmsnorm", "dtype", "x-int", T_, "x", lambda a: {"x": a["x"].int()}),
    c("deltanet.gated_rmsnorm", "dtype", "weight-int", T_, "weight", lambda a: {"weight": a["weight"].int()}),
    c("deltanet.gated_rmsnorm", "rank", "x-0d", V_, "x",
      lambda a: {"x": a["x"][0, 0, 0], "z": a["z"][0, 0, 0], "weight": a["weight"][0]}),
    c("deltanet.gated_rmsnorm", "shape", "z", V_, "z", lambda a: {"z": a["z"][:1]}),
    c("deltanet.gated_rmsnorm", "shape", "weight", V_, "weight", lambda a: {"weight": a["weight"][:4]}),
    c("deltanet.gated_rmsnorm", "empty", "D-0", V_, "x",
      lambda a: {"x": a["x"][..., :0], "z": a["z"][..., :0], "weight": a["weight"][:0]}),
    c("deltanet.gated_rmsnorm", "range", "D-over-max", V_, "x",
      lambda a: {"x": rand(1, 16392), "z": rand(1, 16392), "weight": rand(16392)}, N_ONLY),
    c("deltanet.gated_rmsnorm", "finite", "eps-inf", V_, "eps", lambda a: {"eps": INF}),
    c("deltanet.gated_rmsnorm", "range", "eps-zero", V_, "eps", lambda a: {"eps": 0.0}),
    c("deltanet.gated_rmsnorm", "device", "z-meta", V_, "z", lambda a: {"z": meta(a["z"])}),
    c("deltanet.gated_rmsnorm", "cuda", "all", V_, "x", cuda("x"), N_ONLY),
    # -- deltanet: the fused decode step -------------------------------------------------------------------------------
    c("deltanet.gated_delta_decode", "type", "qkv-list", T_, "qkv", lambda a: {"qkv": a["qkv"].tolist()}),
    c("deltanet.gated_delta_decode", "type", "state-none", T_, "state", lambda a: {"state": None}),
    c("deltanet.gated_delta_decode", "type", "num_k_heads-float", T_, "num_k_heads", lambda a: {"num_k_heads": 1.0}),
    c("deltanet.gated_delta_decode", "dtype", "qkv-int", T_, "qkv", lambda a: {"qkv": a["qkv"].int()}),
    c("deltanet.gated_delta_decode", "dtype", "state-bf16", T_, "state", lambda a: {"state": a["state"].bfloat16()}),
    c("deltanet.gated_delta_decode", "dtype", "conv_state-bf16", T_, "conv_state",
      lambda a: {"conv_state": a["conv_state"].bfloat16()}),
    c("deltanet.gated_delta_decode", "dtype", "z-fp16", T_, "z", lambda a: {"z": a["z"].half()}),
    c("deltanet.gated_delta_decode", "rank", "qkv-3d", V_, "qkv", lambda a: {"qkv": a["qkv"][:, None]}),
    c("deltanet.gated_delta_decode", "shape", "qkv-channels", V_, "qkv", lambda a: {"qkv": a["qkv"][:, :30]}),
    c("deltanet.gated_delta_decode", "shape", "conv_state-short", V_, "conv_state",
      lambda a: {"conv_state": a["conv_state"][..., :2]}),
    c("deltanet.gated_delta_decode", "shape", "conv_weight", V_, "conv_weight",
      lambda a: {"conv_weight": a["conv_weight"][:16]}),
    c("deltanet.gated_delta_decode", "range", "conv_weight-width-9", V_, "conv_weight",
      lambda a: {"conv_weight": rand(32, 9)}),
    c("deltanet.gated_delta_decode", "shape", "state-rows", V_, "state", lambda a: {"state": a["state"][:1]}),
    c("deltanet.gated_delta_decode", "layout", "state-strided", V_, "state",
      lambda a: {"state": a["state"].transpose(2, 3).contiguous().transpose(2, 3)}),
    c("deltanet.gated_delta_decode", "shape", "z", V_, "z", lambda a: {"z": a["z"][:, :1]}),
    c("deltanet.gated_delta_decode", "shape", "a", V_, "a", lambda a: {"a": a["a"][:, :1]}),
    c("deltanet.gated_delta_decode", "shape", "dt_bias", V_, "dt_bias", lambda a: {"dt_bias": a["dt_bias"][:1]}),
    c("deltanet.gated_delta_decode", "shape", "norm_weight", V_, "norm_weight",
      lambda a: {"norm_weight": a["norm_weight"][:4]}),
    c("deltanet.gated_delta_decode", "value", "heads-not-dividing", V_, "num_k_heads", lambda a: {"num_k_heads": 3}),
    c("deltanet.gated_delta_decode", "range", "eps-zero", V_, "eps", lambda a: {"eps": 0.0}),
    c("deltanet.gated_delta_decode", "device", "state-meta", V_, "state", lambda a: {"state": meta(a["state"])}),
    c("deltanet.gated_delta_decode", "cuda", "all", V_, "qkv", cuda("qkv"), N_ONLY),
    c("deltanet.gated_delta_decode@gates", "value", "a-and-x", V_, "x",
      lambda a: {"a": rand(2, 2, seed=3)}, match=r"either a and b .* or x, a_weight and b_weight"),
    c("deltanet.gated_delta_decode@gates", "type", "b_weight-none", T_, "b_weight", lambda a: {"b_weight": None}),
    c("deltanet.gated_delta_decode@gates", "dtype", "a_weight-bf16", T_, "a_weight",
      lambda a: {"a_weight": a["a_weight"].bfloat16()}),
    c("deltanet.gated_delta_decode@gates", "shape", "x-rows", V_, "x", lambda a: {"x": a["x"][:1]}),
    c("deltanet.gated_delta_decode@gates", "shape", "b_weight-width", V_, "b_weight",
      lambda a: {"b_weight": a["b_weight"][:, :8]}),
    c("deltanet.gated_delta_decode@gates", "device", "x-meta", V_, "x", lambda a: {"x": meta(a["x"])}),
    # -- attention: decode_plan ----------------------------------------------------------------------------------------
    c("attention.decode_plan", "type", "positions-list", T_, "positions", lambda a: {"positions": [0, 0, 0]}),
    c("attention.decode_plan", "dtype", "lengths-int32", T_, "lengths", lambda a: {"lengths": a["lengths"].int()}),
    c("attention.decode_plan", "dtype", "active-int", T_, "active", lambda a: {"active": a["active"].int()}),
    c("attention.decode_plan", "dtype", "block_table-fp32", V_, "block_table",
      lambda a: {"block_table": a["block_table"].float()}),
    c("attention.decode_plan", "dtype", "kv_slots-int32", V_, "kv_slots", lambda a: {"kv_slots": a["kv_slots"].int()}),
    c("attention.decode_plan", "rank", "lengths-2d", T_, "lengths", lambda a: {"lengths": a["lengths"][None]}),
    c("attention.decode_plan", "shape", "active-rows", T_, "active", lambda a: {"active": a["active"][:2]}),
    c("attention.decode_plan", "shape", "block_table-rows", V_, "block_table",
      lambda a: {"block_table": a["block_table"][:2]}),
    c("attention.decode_plan", "shape", "seq_lens-rows", V_, "seq_lens", lambda a: {"seq_lens": a["seq_lens"][:2]}),
    c("attention.decode_plan", "layout", "block_table-strided", V_, "block_table",
      lambda a: {"block_table": a["block_table"].t().contiguous().t()}),
    c("attention.decode_plan", "layout", "positions-strided", V_, "positions",
      lambda a: {"positions": strided(a["positions"])}),
    c("attention.decode_plan", "range", "page_size-zero", V_, "page_size", lambda a: {"page_size": 0}),
    c("attention.decode_plan", "device", "kv_slots-meta", V_, "kv_slots", lambda a: {"kv_slots": meta(a["kv_slots"])}),
    c("attention.decode_plan", "cuda", "all", V_, "lengths", cuda("lengths"), N_ONLY),
    # -- moe -----------------------------------------------------------------------------------------------------------
    c("moe.route", "type", "logits-list", T_, "logits", lambda a: {"logits": a["logits"].tolist()}),
    c("moe.route", "dtype", "logits-int", T_, "logits", lambda a: {"logits": a["logits"].int()}),
    c("moe.route", "rank", "logits-3d", V_, "logits", lambda a: {"logits": a["logits"][None]}),
    c("moe.route", "empty", "logits-no-experts", V_, "logits", lambda a: {"logits": a["logits"][:, :0]}),
    c("moe.route", "finite", "logits-nan", V_, "logits", lambda a: {"logits": with_value(a["logits"], NAN)}),
    c("moe.route", "finite", "logits-inf", V_, "logits", lambda a: {"logits": with_value(a["logits"], INF, 6)}),
    c("moe.route", "range", "top_k-0", V_, "top_k", lambda a: {"top_k": 0}),
    c("moe.route", "range", "top_k-over-E", V_, "top_k", lambda a: {"top_k": E + 1}),
    c("moe.route", "type", "top_k-float", T_, "top_k", lambda a: {"top_k": 2.0}),
    c("moe.route", "type", "renormalize-int", T_, "renormalize", lambda a: {"renormalize": 1}),
    c("moe.route", "range", "logits-1025-experts", V_, "logits", lambda a: {"logits": rand(2, 1025)}, N_ONLY),
    c("moe.route", "cuda", "logits", V_, "logits", cuda("logits"), N_ONLY),
    c("moe.route", "device", "logits-meta", V_, "logits", lambda a: {"logits": meta(a["logits"])}, N_ONLY),
    c("moe.align", "type", "ids-list", T_, "ids", lambda a: {"ids": a["ids"].tolist()}),
    c("moe.align", "dtype", "ids-fp32", T_, "ids", lambda a: {"ids": a["ids"].float()}),
    c("moe.align", "rank", "ids-1d", V_, "ids", lambda a: {"ids": a["ids"].flatten()}),
    c("moe.align", "empty", "ids-top_k-0", V_, "ids", lambda a: {"ids": a["ids"][:, :0]}),
    c("moe.align", "range", "ids-over-E", V_, "ids", lambda a: {"ids": ints([[2, 0], [4, 1], [0, 3]])}),
    c("moe.align", "range", "ids-negative", V_, "ids", lambda a: {"ids": ints([[2, 0], [-1, 1], [0, 3]])}),
    c("moe.align", "range", "num_experts-0", V_, "num_experts", lambda a: {"num_experts": 0}),
    c("moe.align", "type", "num_experts-tensor", T_, "num_experts", lambda a: {"num_experts": torch.tensor(4)}),
    c("moe.align", "value", "block_m-24", V_, "block_m", lambda a: {"block_m": 24}),
    c("moe.align", "value", "block_m-8", V_, "block_m", lambda a: {"block_m": 8}),
    c("moe.align", "range", "num_experts-1025", V_, "num_experts", lambda a: {"num_experts": 1025}, N_ONLY),
    c("moe.align", "cuda", "ids", V_, "ids", cuda("ids"), N_ONLY),
    c("moe.align", "device", "ids-meta", V_, "ids", lambda a: {"ids": meta(a["ids"])}, N_ONLY),
    *[row for op in ("moe.moe_experts", "moe.moe_experts@nvfp4") for row in (
        c(op, "type", "x-list", T_, "x", lambda a: {"x": a["x"].tolist()}),
        c(op, "dtype", "x-int", T_, "x", lambda a: {"x": a["x"].int()}),
        c(op, "dtype", "ids-fp32", T_, "ids", lambda a: {"ids": a["ids"].float()}),
        c(op, "dtype", "weights-int", T_, "weights", lambda a: {"weights": a["weights"].int()}),
        c(op, "rank", "x-3d", V_, "x", lambda a: {"x": a["x"][None]}),
        c(op, "shape", "ids-rows", V_, "ids", lambda a: {"ids": a["ids"][:2]}),
        c(op, "shape", "weights", V_, "weights", lambda a: {"weights": a["weights"][:, :1]}),
        c(op, "shape", "x-hidden", V_, "w13", lambda a: {"x": rand(3, 2 * H)}),
        c(op, "range", "ids-over-E", V_, "ids", lambda a: {"ids": ints([[2, 0], [3, 4], [0, 3]])}),
        c(op, "range", "ids-negative", V_, "ids", lambda a: {"ids": ints([[2, 0], [3, 1], [-1, 3]])}),
        c(op, "range", "top_k-over-E", V_, "ids",
          lambda a: {"ids": ints([[0, 1, 2, 3, 0]] * 3), "weights": rand(3, 5)}),
        c(op, "device", "ids-meta", V_, "ids", lambda a: {"ids": meta(a["ids"])}),
        c(op, "device", "weights-meta", V_, "weights", lambda a: {"weights": meta(a["weights"])}),
        c(op, "cuda", "all", V_, "x", cuda("x"), N_ONLY),
    )],
    c("moe.moe_experts", "dtype", "w13-bf16", T_, "w13", lambda a: {"w13": a["w13"].bfloat16()}),
    c("moe.moe_experts", "type", "w13-nvfp4-w2-float", T_, "w13", lambda a: {"w13": q4(a["w13"])}),
    c("moe.moe_experts", "rank", "w2-2d", V_, "w2", lambda a: {"w2": a["w2"][0]}),
    c("moe.moe_experts", "shape", "w2", V_, "w2", lambda a: {"w2": a["w2"][:, :, :8]}),
    c("moe.moe_experts", "shape", "w13-odd-rows", V_, "w13", lambda a: {"w13": a["w13"][:, :31]}),
    c("moe.moe_experts", "shape", "odd-hidden", V_, "w13",
      lambda a: {"x": rand(3, 31), "w13": rand(E, 2 * I, 31), "w2": rand(E, 31, I)}),
    c("moe.moe_experts", "range", "1025-experts", V_, "w13",
      lambda a: {"w13": rand(1025, 2, H), "w2": rand(1025, H, 1)}, N_ONLY),
    c("moe.moe_experts", "device", "w13-meta", V_, "w13", lambda a: {"w13": meta(a["w13"])}),
    c("moe.moe_experts@nvfp4", "type", "w2-float", T_, "w2", lambda a: {"w2": rand(E, H, I)}),
    c("moe.moe_experts@nvfp4", "shape", "w2", V_, "w2", lambda a: {"w2": q4(rand(E, H, 32))}),
    c("moe.moe_experts@nvfp4", "device", "w2-meta", V_, "w2.codes", lambda a: {"w2": a["w2"].to("meta")}),
    *[row for op in ("moe.moe_block", "moe.moe_block@nvfp4") for row in (
        c(op, "type", "x-list", T_, "x", lambda a: {"x": a["x"].tolist()}),
        c(op, "dtype", "x-int", T_, "x", lambda a: {"x": a["x"].int()}),
        c(op, "dtype", "router_weight-int", T_, "router_weight",
          lambda a: {"router_weight": a["router_weight"].int()}),
        c(op, "rank", "x-0d", V_, "x", lambda a: {"x": a["x"][0, 0, 0]}),
        c(op, "shape", "router_weight", V_, "router_weight", lambda a: {"router_weight": a["router_weight"][:3]}),
        c(op, "shape", "x-hidden", V_, "w13", lambda a: {"x": rand(1, 3, 2 * H)}),
        c(op, "range", "top_k-0", V_, "top_k", lambda a: {"top_k": 0}),
        c(op, "range", "top_k-over-E", V_, "top_k", lambda a: {"top_k": E + 1}),
        c(op, "type", "top_k-float", T_, "top_k", lambda a: {"top_k": 2.0}),
        c(op, "type", "renormalize-int", T_, "renormalize", lambda a: {"renormalize": 1}),
        c(op, "type", "shared-tuple", T_, "shared", lambda a: {"shared": tuple(a["shared"])}),
        c(op, "shape", "shared.gate_weight", V_, "shared.gate_weight",
          lambda a: {"shared": a["shared"]._replace(gate_weight=rand(2, H))}),
        c(op, "dtype", "shared.w2-bf16", T_, "shared.w2",
          lambda a: {"shared": a["shared"]._replace(w2=a["shared"].w2.bfloat16())}),
        c(op, "shape", "shared.w2", V_, "shared.w2", lambda a: {"shared": a["shared"]._replace(w2=rand(H, 8))}),
        c(op, "device", "router_weight-meta", V_, "router_weight",
          lambda a: {"router_weight": meta(a["router_weight"])}),
        c(op, "device", "shared.gate_weight-meta", V_, "shared.gate_weight",
          lambda a: {"shared": a["shared"]._replace(gate_weight=meta(a["shared"].gate_weight))}),
        c(op, "cuda", "all", V_, "x", cuda("x"), N_ONLY),
    )],
    c("moe.moe_block", "dtype", "w2-bf16", T_, "w2", lambda a: {"w2": a["w2"].bfloat16()}),
    c("moe.moe_block", "type", "shared.w13-nvfp4-w2-float", T_, "shared.w13",
      lambda a: {"shared": a["shared"]._replace(w13=q4(a["shared"].w13))}),
    c("moe.moe_block", "device", "w13-meta", V_, "w13", lambda a: {"w13": meta(a["w13"])}),
    c("moe.moe_block@nvfp4", "device", "w13-meta", V_, "w13.codes", lambda a: {"w13": a["w13"].to("meta")}),
    # -- moe: w13 from a checkpoint's gate_proj / up_proj --------------------------------------------------------------
    c("moe.stack_w13", "type", "gates-tensor", T_, "gates", lambda a: {"gates": torch.stack(a["gates"])}, ONCE,
      match=r"gates must be a non-empty list"),
    c("moe.stack_w13", "type", "gates-none", T_, "gates", lambda a: {"gates": None}, ONCE),
    c("moe.stack_w13", "empty", "gates", V_, "gates", lambda a: {"gates": [], "ups": []}, ONCE),
    c("moe.stack_w13", "type", "gates-entry-list", T_, "gates[1]",
      lambda a: {"gates": [a["gates"][0], a["gates"][1].tolist()]}, ONCE),
    c("moe.stack_w13", "type", "nvfp4-gates-float-ups", T_, "gates",
      lambda a: {"gates": [q4(w) for w in a["gates"]]}, ONCE,
      match="gates and ups must all be NVFP4Tensors or all float torch.Tensors"),
    c("moe.stack_w13", "value", "ups-count", V_, "ups", lambda a: {"ups": a["ups"][:1]}, ONCE,
      match="gates and ups must list the same experts, found 2 and 1"),
    c("moe.stack_w13", "rank", "gates-3d", V_, "gates[0]", lambda a: {"gates": [w[None] for w in a["gates"]]}, ONCE,
      match=r"gates\[0\] must be 2-D \[I, H\]"),
    c("moe.stack_w13", "shape", "gates-1", V_, "gates[1]", lambda a: {"gates": [a["gates"][0], a["gates"][1][:, :16]]},
      ONCE),
    c("moe.stack_w13", "shape", "ups-rows", V_, "ups[0]", lambda a: {"ups": [w[:8] for w in a["ups"]]}, ONCE),
    c("moe.stack_w13", "dtype", "ups-bf16", T_, "ups", lambda a: {"ups": [w.bfloat16() for w in a["ups"]]}, ONCE,
      match=r"float gates and ups must share one float dtype"),
    c("moe.stack_w13", "dtype", "int", T_, "gates",
      lambda a: {k: [w.int() for w in a[k]] for k in ("gates", "ups")}, ONCE),
    c("moe.stack_w13", "device", "gates-1-meta", V_, "gates[1]",
      lambda a: {"gates": [a["gates"][0], meta(a["gates"][1])]}, ONCE),
    c("moe.stack_w13@nvfp4", "shape", "gates-1", V_, "gates[1]",
      lambda a: {"gates": [a["gates"][0], q4(rand(16, 64))]}, ONCE),
    c("moe.stack_w13@nvfp4", "shape", "gates-1-global_scale", V_, "gates[1].global_scale",
      lambda a: {"gates": [a["gates"][0], NVFP4Tensor(a["gates"][1].codes, a["gates"][1].scales,
                                                      a["gates"][1].global_scale.expand(16).clone())]}, ONCE),
    c("moe.stack_w13@nvfp4", "type", "packed", T_, "gates", lambda a: {"gates": [matmul.pack(w) for w in a["gates"]]},
      ONCE),
    c("moe.fuse_w13", "type", "gate-none", T_, "gate", lambda a: {"gate": None}, ONCE),
    c("moe.fuse_w13", "type", "nvfp4-gate-float-up", T_, "gate", lambda a: {"gate": q4(a["gate"])}, ONCE,
      match="gate and up must both be NVFP4Tensors or both float torch.Tensors"),
    c("moe.fuse_w13", "rank", "1d", V_, "gate", lambda a: {"gate": a["gate"][0], "up": a["up"][0]}, ONCE),
    c("moe.fuse_w13", "shape", "up-rows", V_, "up", lambda a: {"up": a["up"][:8]}, ONCE,
      match=r"gate and up must have one shape \[..., I, H\], found \(16, 32\) and \(8, 32\)"),
    c("moe.fuse_w13", "dtype", "up-bf16", T_, "up", lambda a: {"up": a["up"].bfloat16()}, ONCE),
    c("moe.fuse_w13", "dtype", "int", T_, "gate", lambda a: {"gate": a["gate"].int(), "up": a["up"].int()}, ONCE),
    c("moe.fuse_w13", "device", "up-meta", V_, "up", lambda a: {"up": meta(a["up"])}, ONCE),
    # -- the norm in the next kernel's launch (norm_linear, norm_moe_block) -----------------------------------------
    *[row for op in ("matmul.norm_linear", "moe.norm_moe_block") for row in (
        c(op, "type", "norm_weight-none", T_, "norm_weight", lambda a: {"norm_weight": None}),
        c(op, "dtype", "norm_weight-int", T_, "norm_weight", lambda a: {"norm_weight": a["norm_weight"].int()}),
        c(op, "shape", "norm_weight", V_, "norm_weight", lambda a: {"norm_weight": a["norm_weight"][:16]}),
        c(op, "shape", "residual", V_, "residual", lambda a: {"residual": a["residual"][..., :16]}),
        c(op, "dtype", "residual-bf16", T_, "residual", lambda a: {"residual": a["residual"].bfloat16()}),
        c(op, "value", "eps-0", V_, "eps", lambda a: {"eps": 0.0}),
        c(op, "dtype", "x-int", T_, "x", lambda a: {"x": a["x"].int()}),
        c(op, "device", "norm_weight-meta", V_, "norm_weight", lambda a: {"norm_weight": meta(a["norm_weight"])}),
        c(op, "cuda", "all", V_, "x", cuda("x"), N_ONLY),
    )],
    c("matmul.norm_linear", "type", "w-tensor", T_, "w", lambda a: {"w": rand(8, 32)}),
    c("moe.norm_moe_block", "range", "top_k-0", V_, "top_k", lambda a: {"top_k": 0}),
    # -- norm ----------------------------------------------------------------------------------------------------------
    c("norm.rmsnorm", "type", "x-list", T_, "x", lambda a: {"x": a["x"].tolist()}),
    c("norm.rmsnorm", "type", "weight-none", T_, "weight", lambda a: {"weight": None}),
    c("norm.rmsnorm", "dtype", "x-int", T_, "x", lambda a: {"x": a["x"].int()}),
    c("norm.rmsnorm", "dtype", "x-fp64", T_, "x", lambda a: {"x": a["x"].double()}),
    c("norm.rmsnorm", "dtype", "weight-int", T_, "weight", lambda a: {"weight": a["weight"].int()}),
    c("norm.rmsnorm", "dtype", "residual-bf16", T_, "residual", lambda a: {"residual": a["residual"].bfloat16()}),
    c("norm.rmsnorm", "dtype", "out-bf16", T_, "out", lambda a: {"out": a["out"].bfloat16()}),
    c("norm.rmsnorm", "dtype", "residual_out-bf16", T_, "residual_out",
      lambda a: {"residual_out": a["residual_out"].bfloat16()}),
    c("norm.rmsnorm", "rank", "x-0d", V_, "x", lambda a: {"x": a["x"][0, 0]}),
    c("norm.rmsnorm", "shape", "weight", V_, "weight", lambda a: {"weight": a["weight"][:4]}),
    c("norm.rmsnorm", "shape", "residual", V_, "residual", lambda a: {"residual": a["residual"][:2]}),
    c("norm.rmsnorm", "shape", "out", V_, "out", lambda a: {"out": a["out"][:2]}),
    c("norm.rmsnorm", "shape", "residual_out", V_, "residual_out", lambda a: {"residual_out": a["residual_out"][:2]}),
    c("norm.rmsnorm", "empty", "D-0", V_, "x", lambda a: {"x": a["x"][:, :0], "weight": a["weight"][:0],
                                                         "residual": None, "out": None, "residual_out": None}),
    c("norm.rmsnorm", "range", "D-over-max", V_, "x",
      lambda a: {"x": rand(1, 16392), "weight": rand(16392), "residual": None, "out": None, "residual_out": None},
      N_ONLY),
    c("norm.rmsnorm", "finite", "eps-nan", V_, "eps", lambda a: {"eps": NAN}),
    c("norm.rmsnorm", "finite", "eps-inf", V_, "eps", lambda a: {"eps": INF}),
    c("norm.rmsnorm", "range", "eps-zero", V_, "eps", lambda a: {"eps": 0.0}),
    c("norm.rmsnorm", "type", "eps-tensor", T_, "eps", lambda a: {"eps": torch.tensor(1e-6)}),
    c("norm.rmsnorm", "value", "residual_out-without-residual", V_, "residual_out", lambda a: {"residual": None}),
    c("norm.rmsnorm", "layout", "out-strided", V_, "out", lambda a: {"out": strided(a["out"])}),
    c("norm.rmsnorm", "layout", "residual_out-strided", V_, "residual_out",
      lambda a: {"residual_out": strided(a["residual_out"])}),
    c("norm.rmsnorm", "layout", "out-aliases-x", V_, "out", lambda a: {"out": a["x"]}),
    c("norm.rmsnorm", "layout", "out-aliases-residual_out", V_, "out", lambda a: {"out": a["residual_out"]}),
    c("norm.rmsnorm", "layout", "residual_out-shifted-residual", V_, "residual_out",
      lambda a: shifted_residual(rand(4, 8, seed=9))),
    c("norm.rmsnorm", "device", "weight-meta", V_, "weight", lambda a: {"weight": meta(a["weight"])}),
    c("norm.rmsnorm", "device", "residual-meta", V_, "residual", lambda a: {"residual": meta(a["residual"])}),
    c("norm.rmsnorm", "device", "out-meta", V_, "out", lambda a: {"out": meta(a["out"])}),
    c("norm.rmsnorm", "cuda", "all", V_, "x", cuda("x"), N_ONLY),
]


# ---------------------------------------------------------------------------------------------------------------
# running a case


def to_fake_cuda(v):
    """``v`` (a tensor, NVFP4Tensor, SharedExpert or anything else) with every tensor replaced by a fake CUDA tensor
    of the same dtype, shape and strides."""
    if isinstance(v, torch.Tensor):
        with _FAKE:
            return torch.empty_strided(tuple(v.shape), v.stride(), dtype=v.dtype, device="cuda")
    if isinstance(v, NVFP4Tensor):
        r = v.recip_global_scale
        return NVFP4Tensor(*(to_fake_cuda(t) for t in (v.codes, v.scales, v.global_scale)),
                           None if r is None else to_fake_cuda(r))
    if isinstance(v, SharedExpert):
        return SharedExpert(*(to_fake_cuda(t) for t in v))
    return v


_FAKE = FakeTensorMode()


def _tensors(value, prefix: str):
    """``(name, tensor)`` of every tensor inside an argument."""
    if isinstance(value, torch.Tensor):
        yield prefix, value
    elif isinstance(value, NVFP4Tensor):
        for part in ("codes", "scales", "global_scale", "recip_global_scale"):
            yield from _tensors(getattr(value, part), f"{prefix}.{part}")
    elif isinstance(value, SharedExpert):
        for part, t in value._asdict().items():
            yield from _tensors(t, f"{prefix}.{part}")


def _snapshot(args: dict) -> dict:
    """Bitwise copies of every tensor argument that holds data (not meta or fake)."""
    shots = {}
    for key, value in args.items():
        for name, t in _tensors(value, key):
            if t.device.type != "meta" and not isinstance(t, torch._subclasses.FakeTensor):
                shots[name] = (t, t.detach().clone())
    return shots


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8) if t.numel() else t.detach().reshape(-1)


def bad_arguments(case: Case) -> tuple[Callable, dict]:
    base_op = case.op.split("@")[0]
    fn, make = OPS[base_op]
    valid = VARIANTS.get(case.op, make)()
    return fn, {**valid, **case.edit(valid)}


def _params():
    for case in CASES:
        for backend in case.backends:
            marks = []
            if case.kind == "cuda" and not runtime.INTERPRET:
                marks.append(pytest.mark.skip(reason="a CUDA tensor is only a bad input for the interpreter"))
            if case.cpu_only and DEV.type != "cpu":
                marks.append(pytest.mark.skip(reason="on a GPU this is a device-side assert, which ends the process"))
            yield pytest.param(case, backend, id=f"{case.id}-{backend}", marks=marks)


@pytest.mark.parametrize("case,backend", list(_params()))
def test_bad_input_raises_naming_the_tensor(case: Case, backend: str):
    fn, args = bad_arguments(case)
    before = _snapshot(args)
    pattern = case.match or rf"(?<![\w.]){re.escape(case.name)}(?![\w])"
    with lynn_kernels.use_reference(backend == REFERENCE), pytest.raises(case.error, match=pattern):
        fn(**args)
    for name, (t, copy) in before.items():
        assert t.dtype == copy.dtype and t.shape == copy.shape and torch.equal(_bits(t), _bits(copy)), \
            f"{name} changed although the call raised"


# ---------------------------------------------------------------------------------------------------------------
# the table itself


def _public_ops() -> set[str]:
    """Every ``runtime.op`` of the families' ``__all__`` (plus the listed non-kernel entry points)."""
    found = set()
    for family in (nvfp4, matmul, attention, deltanet, moe, norm):
        for name in family.__all__:
            obj = getattr(family, name)
            if callable(obj) and hasattr(obj, "reference") and hasattr(obj, "host"):
                found.add(f"{family.__name__.split('.')[-1]}.{name}")
    return found


def test_every_public_op_is_swept():
    swept = {case.op.split("@")[0] for case in CASES}
    assert _public_ops() <= swept, f"public ops without bad-input cases: {sorted(_public_ops() - swept)}"
    assert swept <= set(OPS)
    assert {case.op for case in CASES if "@" in case.op} <= set(VARIANTS)
    ids = Counter(case.id for case in CASES)
    assert not [i for i, n in ids.items() if n > 1], "duplicate case ids"


@pytest.mark.parametrize("key", [*OPS, *VARIANTS])
def test_valid_arguments_are_valid(key):
    """The table's starting point is a valid call on both backends, so each case's error comes from its edit."""
    fn, make = OPS[key.split("@")[0]]
    for reference in (False, True):
        with lynn_kernels.use_reference(reference):
            fn(**make() if "@" not in key else VARIANTS[key]())


def _outputs(out) -> list[torch.Tensor]:
    return [out] if isinstance(out, torch.Tensor) else [t for o in out if o is not None for t in _outputs(o)]


@pytest.mark.parametrize("key,names", [
    ("attention.decode_attention", ("seq_lens",)),
    ("attention.decode_attention@paged", ("seq_lens", "block_table")),
    ("attention.qk_norm_rope", ("positions", "slot_mapping")),
    ("attention.qk_norm_rope@tables", ("positions", "slot_mapping")),
])
def test_strided_index_tensors_are_read_as_given(key, names):
    """Index tensors may be any view (the kernels read them with unit stride, so the host copies a strided one):
    the same outputs and cache writes as from contiguous ones (before the fix, a strided ``positions`` /
    ``slot_mapping`` / ``seq_lens`` / ``block_table`` was read as if contiguous)."""
    fn, make = OPS[key.split("@")[0]]
    make = VARIANTS.get(key, make)
    plain, views = make(), make()
    for name in names:
        views[name] = strided(views[name])
        assert not views[name].is_contiguous()
    want, got = _outputs(fn(**plain)), _outputs(fn(**views))
    for w, g in zip(want, got):
        assert torch.equal(_bits(w), _bits(g))
    for name, t in plain.items():
        if isinstance(t, torch.Tensor):
            assert torch.equal(_bits(t), _bits(views[name].contiguous())), name


def test_cuda_tensors_are_fake_and_data_free():
    t = to_fake_cuda(rand(2, 3))
    assert t.device.type == "cuda" and tuple(t.shape) == (2, 3) and isinstance(t, torch._subclasses.FakeTensor)


#: cases per op, for the report (``len(CASES)`` rows; each row runs once per backend it lists)
CASES_PER_OP = Counter(case.op.split("@")[0] for case in CASES)
