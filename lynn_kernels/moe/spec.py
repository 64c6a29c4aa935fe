"""Layouts, the align contract's sizes, and the argument checks shared by the MoE references and kernels.

Both the torch references and the Triton host functions call these checks, so a bad argument raises the same error,
naming the tensor, what was expected and what was found, on every backend. As in the rest of the project:
``TypeError`` for a wrong type or dtype, ``ValueError`` for a wrong shape, value or device.

Value checks (ids in ``[0, E)``, finite logits) read the tensor back to the host: one sync, skipped while a CUDA
graph is being captured, as ``attention.layout`` does for slot mappings. The Triton host functions ``route_triton``
and ``align_triton`` (and the ``launch_*`` functions) never run them: they never synchronise.

Layouts:

* router logits ``[M, E]`` (bf16 / fp16 / fp32), one row per token;
* routing ``weights`` fp32 ``[M, top_k]`` and ``ids`` int32 ``[M, top_k]``, best expert first;
* a *slot* is a flat index ``t * top_k + j`` into ``ids.view(-1)``: token ``t``'s ``j``-th choice;
* experts, stacked: ``w13`` NVFP4 ``[E, 2I, H]`` (gate rows ``0..I-1``, then up rows), ``w2`` NVFP4 ``[E, H, I]``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..attention.layout import values_checkable
from ..nvfp4 import NVFP4Tensor

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)
#: Smallest ``block_m`` of the align step (a ``tl.dot`` tile needs 16 rows).
MIN_BLOCK_M = 16
_INT32_MAX = 2**31 - 1


class SharedExpert(NamedTuple):
    """The shared expert of a Qwen3-Next / Qwen3.5 MoE block: ``sigmoid(x @ gate_weight^T) * down(silu(gate(x)) *
    up(x))``.

    * ``w13``: NVFP4 ``[2 Is, H]``, gate rows first, then up rows (HF ``shared_expert.gate_proj`` / ``up_proj``
      stacked);
    * ``w2``: NVFP4 ``[H, Is]`` (HF ``shared_expert.down_proj``);
    * ``gate_weight``: ``[1, H]`` float, unquantised (HF ``shared_expert_gate.weight``).
    """

    w13: NVFP4Tensor
    w2: NVFP4Tensor
    gate_weight: torch.Tensor


def max_padded(num_slots: int, num_experts: int, block_m: int) -> int:
    """``P_max``: the length of ``sorted_slots``, a bound on ``num_padded`` known without reading ``ids``.

    Each expert that receives a slot pads by at most ``block_m - 1``, and at most ``min(E, num_slots)`` experts
    receive one: ``P_max = round_up(num_slots + min(E, num_slots) * (block_m - 1), block_m)`` (vLLM's bound; for a
    decode step of 8 slots over 512 experts and ``block_m`` 16 it is 128, not 7,680).
    """
    bound = num_slots + min(num_experts, num_slots) * (block_m - 1)
    return -(-bound // block_m) * block_m


# --- argument checks --------------------------------------------------------------------------------------------


def _need_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, found {type(t).__name__}")


def _need_dtype(name: str, t: torch.Tensor, allowed, what: str) -> None:
    if t.dtype not in allowed:
        raise TypeError(f"{name} has dtype {str(t.dtype)[6:]}; expected {what} "
                        f"({', '.join(str(d)[6:] for d in allowed)})")


def _need_int(name: str, v, what: str) -> None:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be a Python int ({what}), found {type(v).__name__} {v!r}")


def _need_same_device(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device} but {ref_name} is on {ref.device}; all inputs must share a device")


def check_route(logits, top_k, renormalize) -> tuple[int, int]:
    """``logits [M, E]`` float, ``1 <= top_k <= E``; returns ``(M, E)``. No host sync."""
    _need_tensor("logits", logits)
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D [M, E] (tokens, experts), found shape {tuple(logits.shape)}")
    _need_dtype("logits", logits, FLOAT_DTYPES, "a float dtype")
    M, E = logits.shape
    if E < 1:
        raise ValueError(f"logits must have at least one expert column, found shape {tuple(logits.shape)}")
    _need_int("top_k", top_k, "experts per token")
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k must lie in [1, E] = [1, {E}] (E from logits {tuple(logits.shape)}), found {top_k}")
    if not isinstance(renormalize, bool):
        raise TypeError(f"renormalize must be a bool, found {type(renormalize).__name__} {renormalize!r}")
    return M, E


def check_logits_finite(logits: torch.Tensor) -> None:
    """Raise if ``logits`` holds NaN or Inf (one host sync; skipped while a CUDA graph is being captured)."""
    if not values_checkable() or logits.numel() == 0:
        return
    bad = ~torch.isfinite(logits)
    if bool(bad.any()):
        rows = bad.any(-1).nonzero().flatten()
        raise ValueError(f"logits must be finite: {int(bad.sum())} NaN/Inf values in {rows.numel()} of "
                         f"{logits.shape[0]} rows (first bad row {int(rows[0])}); softmax routing is undefined there")


def check_align(ids, num_experts, block_m) -> tuple[int, int]:
    """``ids [M, top_k]`` int32 / int64, ``num_experts >= 1``, ``block_m`` a power of two ``>= 16``; returns
    ``(num_slots, P_max)``. No host sync (the values are checked by :func:`check_ids_in_range`)."""
    _need_tensor("ids", ids)
    if ids.dim() != 2 or ids.shape[1] < 1:
        raise ValueError(f"ids must be 2-D [M, top_k] with top_k >= 1, found shape {tuple(ids.shape)}")
    _need_dtype("ids", ids, INDEX_DTYPES, "an integer expert index")
    _need_int("num_experts", num_experts, "E")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, found {num_experts}")
    _need_int("block_m", block_m, "rows per GEMM tile")
    if block_m < MIN_BLOCK_M or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two >= {MIN_BLOCK_M}, found {block_m}")
    num_slots = ids.numel()
    p_max = max_padded(num_slots, num_experts, block_m)
    if p_max > _INT32_MAX:
        raise ValueError(f"ids {tuple(ids.shape)} with block_m={block_m} needs {p_max} padded slots, past int32")
    return num_slots, p_max


def check_ids_in_range(ids: torch.Tensor, num_experts: int) -> None:
    """Raise if an id lies outside ``[0, num_experts)`` (one host sync; skipped while a CUDA graph is captured)."""
    if not values_checkable() or ids.numel() == 0:
        return
    lo, hi = (int(v) for v in torch.stack(torch.aminmax(ids)).tolist())
    if lo < 0 or hi >= num_experts:
        raise ValueError(f"ids must lie in [0, num_experts) = [0, {num_experts}), found min {lo}, max {hi}")


def _check_nvfp4(name: str, w, ndim: int, layout: str) -> None:
    if not isinstance(w, NVFP4Tensor):
        raise TypeError(f"{name} must be an NVFP4Tensor {layout} (quantise it with lynn_kernels.quantize), found "
                        f"{type(w).__name__}")
    if w.dim() != ndim:
        raise ValueError(f"{name} must be a {ndim}-D NVFP4Tensor {layout}, found shape {tuple(w.shape)}")


def check_ffn(x_name: str, H: int, w13, w2, lead: tuple, prefix: str) -> int:
    """``w13 [*lead, 2I, H]`` and ``w2 [*lead, H, I]`` NVFP4; returns ``I``."""
    n13, n2 = prefix + "w13", prefix + "w2"
    lead_s = "".join(f"{d}, " for d in lead)
    _check_nvfp4(n13, w13, len(lead) + 2, f"[{'E, ' if lead else ''}2I, H]")
    _check_nvfp4(n2, w2, len(lead) + 2, f"[{'E, ' if lead else ''}H, I]")
    if tuple(w13.shape[:len(lead)]) != lead or w13.shape[-1] != H or w13.shape[-2] % 2:
        raise ValueError(f"{n13} must have shape [{lead_s}2I, H={H}] (H from {x_name}), found {tuple(w13.shape)}")
    inter = w13.shape[-2] // 2
    if tuple(w2.shape) != (*lead, H, inter):
        raise ValueError(f"{n2} must have shape [{lead_s}H, I] = {(*lead, H, inter)} ({n13} is "
                         f"{tuple(w13.shape)}), found {tuple(w2.shape)}")
    return inter


def check_experts(x, weights, ids, w13, w2) -> tuple[int, int, int]:
    """Arguments of ``moe_experts``; returns ``(M, top_k, E)``. No host sync."""
    _need_tensor("x", x)
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [M, H], found shape {tuple(x.shape)}")
    _need_dtype("x", x, FLOAT_DTYPES, "a float dtype")
    M, H = x.shape
    _need_tensor("weights", weights)
    _need_tensor("ids", ids)
    if ids.dim() != 2 or ids.shape[0] != M or ids.shape[1] < 1:
        raise ValueError(f"ids must have shape [M, top_k] with M={M} (from x), found {tuple(ids.shape)}")
    _need_dtype("ids", ids, INDEX_DTYPES, "an integer expert index")
    if tuple(weights.shape) != tuple(ids.shape):
        raise ValueError(f"weights must have the shape of ids [M, top_k] = {tuple(ids.shape)}, found "
                         f"{tuple(weights.shape)}")
    _need_dtype("weights", weights, FLOAT_DTYPES, "a float dtype (fp32 from route)")
    _check_nvfp4("w13", w13, 3, "[E, 2I, H]")
    E = w13.shape[0]
    check_ffn("x", H, w13, w2, (E,), "")
    if ids.shape[1] > E:
        raise ValueError(f"ids has top_k={ids.shape[1]} columns but w13 has E={E} experts; top_k must lie in "
                         f"[1, E]")
    for name, t in (("weights", weights), ("ids", ids), ("w13", w13), ("w2", w2)):
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}; all inputs must share a device")
    return M, ids.shape[1], E


def check_block(x, router_weight, w13, w2, shared, top_k, renormalize) -> None:
    """Arguments of ``moe_block`` (``x [..., H]``). No host sync."""
    _need_tensor("x", x)
    if x.dim() < 1:
        raise ValueError("x must be [..., H], found a 0-d tensor")
    _need_dtype("x", x, FLOAT_DTYPES, "a float dtype")
    H = x.shape[-1]
    _need_tensor("router_weight", router_weight)
    _check_nvfp4("w13", w13, 3, "[E, 2I, H]")
    E = w13.shape[0]
    if tuple(router_weight.shape) != (E, H):
        raise ValueError(f"router_weight must have shape [E, H] = ({E}, {H}) (E from w13, H from x), found "
                         f"{tuple(router_weight.shape)}")
    _need_dtype("router_weight", router_weight, FLOAT_DTYPES, "a float dtype (the router stays unquantised)")
    _need_same_device("router_weight", router_weight, "x", x)
    _need_int("top_k", top_k, "experts per token")
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k must lie in [1, E] = [1, {E}] (E from w13), found {top_k}")
    if not isinstance(renormalize, bool):
        raise TypeError(f"renormalize must be a bool, found {type(renormalize).__name__} {renormalize!r}")
    check_ffn("x", H, w13, w2, (E,), "")
    if shared is not None:
        if not isinstance(shared, SharedExpert):
            raise TypeError(f"shared must be a SharedExpert(w13, w2, gate_weight) or None, found "
                            f"{type(shared).__name__}")
        check_ffn("x", H, shared.w13, shared.w2, (), "shared.")
        _need_tensor("shared.gate_weight", shared.gate_weight)
        if tuple(shared.gate_weight.shape) != (1, H):
            raise ValueError(f"shared.gate_weight must have shape [1, H] = (1, {H}), found "
                             f"{tuple(shared.gate_weight.shape)}")
        _need_dtype("shared.gate_weight", shared.gate_weight, FLOAT_DTYPES, "a float dtype")
        for name, t in (("shared.w13.codes", shared.w13.codes), ("shared.w2.codes", shared.w2.codes),
                        ("shared.gate_weight", shared.gate_weight)):
            _need_same_device(name, t, "x", x)
    for name, t in (("w13.codes", w13.codes), ("w2.codes", w2.codes)):
        _need_same_device(name, t, "x", x)
