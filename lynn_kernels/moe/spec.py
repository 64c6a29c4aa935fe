"""Layouts, the align contract's sizes, and the argument checks shared by the MoE references and kernels.

Both the torch references and the Triton host functions call these checks, so a bad argument raises the same error,
naming the tensor, what was expected and what was found, on every backend. As in the rest of the project:
``TypeError`` for a wrong type or dtype, ``ValueError`` for a wrong shape, value or device.

Value checks (ids in ``[0, E)``, finite logits) read the tensor back to the host: one sync, skipped while a CUDA
graph is being captured, as ``attention.spec`` does for slot mappings. The Triton host functions ``route_triton``
and ``align_triton`` (and the ``launch_*`` functions) never run them: they never synchronise.

Layouts:

* router logits ``[M, E]`` (bf16 / fp16 / fp32), one row per token;
* routing ``weights`` fp32 ``[M, top_k]`` and ``ids`` int32 ``[M, top_k]``, best expert first;
* a *slot* is a flat index ``t * top_k + j`` into ``ids.view(-1)``: token ``t``'s ``j``-th choice;
* experts, stacked: ``w13 [E, 2I, H]`` (gate rows ``0..I-1``, then up rows) and ``w2 [E, H, I]``, of one kind:
  both NVFP4 (:class:`~lynn_kernels.nvfp4.NVFP4Tensor`, or both in the packed kernel layout:
  :class:`~lynn_kernels.moe.PackedExperts` stacks, :class:`~lynn_kernels.matmul.PackedNVFP4` for the shared expert)
  or both plain float tensors of x's dtype (the unquantised baseline, e.g. an HF bf16 checkpoint);
* NVFP4 global scales: ``()`` (one per tensor) or ``[E]`` (one per expert); for ``w13`` also ``[E, 2I]``, one per
  row, which is how separate gate / up (per-shard) scales are kept exactly: every gate row of expert ``e`` holds its
  gate_proj's scale, every up row its up_proj's. :func:`stack_w13` builds that from per-expert gate / up weights
  (a ``[E, 2]`` scale is not a prefix of the codes' leading dims, which :class:`NVFP4Tensor` requires).
"""

from __future__ import annotations

import torch

from ..matmul.packed import PackedNVFP4
from ..nvfp4 import NVFP4Tensor
from ..nvfp4.spec import reciprocal
from ..runtime import values_checkable
from .packed import PackedExperts, SharedExpert

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)
#: Smallest ``block_m`` of the align step (a ``tl.dot`` tile needs 16 rows).
MIN_BLOCK_M = 16
_INT32_MAX = 2**31 - 1


def max_padded(num_slots: int, num_experts: int, block_m: int) -> int:
    """``P_max``: the length of ``sorted_slots``, a bound on ``num_padded`` known without reading ``ids``.

    Each expert that receives a slot pads by at most ``block_m - 1``, and at most ``min(E, num_slots)`` experts
    receive one: ``P_max = round_up(num_slots + min(E, num_slots) * (block_m - 1), block_m)`` (vLLM's bound; for a
    decode step of 8 slots over 512 experts and ``block_m`` 16 it is 128, not 7,680).
    """
    bound = num_slots + min(num_experts, num_slots) * (block_m - 1)
    return -(-bound // block_m) * block_m


# --- w13 from a checkpoint's gate_proj / up_proj ------------------------------------------------------------


def _row_scales(g: torch.Tensor, lead: tuple) -> torch.Tensor:
    """A global scale of shape ``()`` or a prefix of ``lead`` (the codes' leading dims), one value per row."""
    return g.reshape(tuple(g.shape) + (1,) * (len(lead) - g.dim())).expand(lead)


def _shortest(rows: torch.Tensor) -> int:
    """How many leading dims a per-row scale needs: the fewest ``d`` with ``rows`` constant along dims ``d..``."""
    for d in range(rows.dim()):
        flat = rows.reshape(*rows.shape[:d], -1)
        if bool((flat == flat[..., :1]).all()):
            return d
    return rows.dim()


def fuse_w13(gate, up):
    """One expert's (or a stack's) ``w13``: gate_proj and up_proj ``[..., I, H]`` -> ``[..., 2I, H]``, gate rows
    first, each keeping its own global scale exactly.

    Both NVFP4Tensors, or both float tensors of one dtype (concatenated as they are). For NVFP4 the global scale of
    the result is the shortest exact layout of the per-row scales: ``()`` or ``[E]`` when gate and up share their
    scales (the kernels' fastest form), else one per row, ``[..., 2I]``: each gate row holds gate_proj's scale, each
    up row up_proj's. Nothing is merged or requantised; the codes and block scales are concatenated untouched. A
    compressed-tensors ``recip_global_scale`` is kept the same way. Reads the scales back to compare them (a load-time
    helper, not for a CUDA graph).

    Example (the shared expert of a ModelOpt checkpoint, gate and up scales differing)::

        gate = NVFP4Tensor.from_state_dict(sd, "mlp.shared_expert.gate_proj")      # [Is, H], scale ()
        up = NVFP4Tensor.from_state_dict(sd, "mlp.shared_expert.up_proj")
        w13 = fuse_w13(gate, up)                                                   # [2 Is, H], scale [2 Is]
    """
    if any(is_packed(w) for w in (gate, up)):
        raise TypeError(f"gate and up must be in the checkpoint layout (NVFP4Tensors) or float tensors, found "
                        f"{type(gate).__name__} and {type(up).__name__}: fuse before packing (pack_experts)")
    if is_nvfp4(gate) != is_nvfp4(up) or not all(is_nvfp4(w) or isinstance(w, torch.Tensor) for w in (gate, up)):
        raise TypeError(f"gate and up must both be NVFP4Tensors or both float torch.Tensors, found "
                        f"{type(gate).__name__} and {type(up).__name__}")
    if tuple(gate.shape) != tuple(up.shape) or gate.dim() < 2:
        raise ValueError(f"gate and up must have one shape [..., I, H], found {tuple(gate.shape)} and "
                         f"{tuple(up.shape)}")
    if gate.device != up.device:
        raise ValueError(f"gate is on {gate.device} but up is on {up.device}")
    if not is_nvfp4(gate):
        if gate.dtype != up.dtype or gate.dtype not in FLOAT_DTYPES:
            allowed = ", ".join(str(d)[6:] for d in FLOAT_DTYPES)
            raise TypeError(f"float gate and up must share a float dtype ({allowed}), found {str(gate.dtype)[6:]} and "
                            f"{str(up.dtype)[6:]}")
        return torch.cat([gate, up], dim=-2)
    lead = tuple(gate.codes.shape[:-1])                                    # [..., I]
    rows = torch.cat([_row_scales(gate.global_scale, lead), _row_scales(up.global_scale, lead)], dim=-1)
    recips = None                                                          # [..., 2I] each
    if gate.recip_global_scale is not None or up.recip_global_scale is not None:
        recips = torch.cat([_row_scales(reciprocal(w.global_scale) if w.recip_global_scale is None
                                        else w.recip_global_scale, lead) for w in (gate, up)], dim=-1)
    d = max(_shortest(rows), 0 if recips is None else _shortest(recips))

    def keep(t):
        return None if t is None else t.reshape(*t.shape[:d], -1)[..., 0].contiguous()

    return NVFP4Tensor(torch.cat([gate.codes, up.codes], dim=-2), torch.cat([gate.scales, up.scales], dim=-2),
                       keep(rows), keep(recips))


def stack_w13(gates, ups):
    """The routed experts' ``w13 [E, 2I, H]`` from per-expert gate_proj / up_proj weights ``[I, H]`` (lists of
    NVFP4Tensors, or of float tensors of one dtype), each keeping its own global scale: :func:`fuse_w13` of the
    stacks. The global scale is ``()``, ``[E]`` or, where an expert's gate and up scales differ, ``[E, 2I]``.

    Example::

        w13 = stack_w13([NVFP4Tensor.from_state_dict(sd, f"mlp.experts.{e}.gate_proj") for e in range(E)],
                        [NVFP4Tensor.from_state_dict(sd, f"mlp.experts.{e}.up_proj") for e in range(E)])
        w2 = NVFP4Tensor.stack([NVFP4Tensor.from_state_dict(sd, f"mlp.experts.{e}.down_proj") for e in range(E)])
    """
    for name, ws in (("gates", gates), ("ups", ups)):
        if not isinstance(ws, (list, tuple)):
            raise TypeError(f"{name} must be a non-empty list of per-expert [I, H] weights, found "
                            f"{type(ws).__name__}")
        if len(ws) == 0:
            raise ValueError(f"{name} must be a non-empty list of per-expert [I, H] weights, found an empty "
                             f"{type(ws).__name__}")
    if len(gates) != len(ups):
        raise ValueError(f"gates and ups must list the same experts, found {len(gates)} and {len(ups)}")
    if any(is_packed(w) for w in (*gates, *ups)):
        raise TypeError("gates and ups must be in the checkpoint layout (NVFP4Tensors) or float tensors, found packed "
                        "weights: stack before packing (pack_experts)")
    for name, ws in (("gates", gates), ("ups", ups)):
        bad = [i for i, w in enumerate(ws) if not isinstance(w, (NVFP4Tensor, torch.Tensor))]
        if bad:
            raise TypeError(f"{name}[{bad[0]}] must be an NVFP4Tensor or a float torch.Tensor [I, H], found "
                            f"{type(ws[bad[0]]).__name__}")
    kinds = {is_nvfp4(w) for w in (*gates, *ups)}
    if len(kinds) != 1:
        raise TypeError("gates and ups must all be NVFP4Tensors or all float torch.Tensors, found both kinds")
    first = gates[0]
    for name, ws in (("gates", gates), ("ups", ups)):
        bad = [i for i, w in enumerate(ws) if w.dim() != 2]
        if bad:
            raise ValueError(f"{name}[{bad[0]}] must be 2-D [I, H], found shape {tuple(ws[bad[0]].shape)}")
        for i, w in enumerate(ws):                  # the stacks would fail on these without naming the expert
            if tuple(w.shape) != tuple(first.shape):
                raise ValueError(f"{name}[{i}] has shape {tuple(w.shape)} but gates[0] has {tuple(first.shape)}; "
                                 f"every expert's gate and up weight must have one shape [I, H]")
            if w.device != first.device:
                raise ValueError(f"{name}[{i}] is on {w.device} but gates[0] is on {first.device}; all weights must "
                                 f"share a device")
            if kinds == {True} and w.global_scale.shape != ws[0].global_scale.shape:
                raise ValueError(f"{name}[{i}].global_scale has shape {tuple(w.global_scale.shape)} but "
                                 f"{name}[0].global_scale has {tuple(ws[0].global_scale.shape)}; the {name}' global "
                                 f"scales must have one shape (() or [I])")
    if kinds == {False}:
        dtypes = {w.dtype for w in (*gates, *ups)}
        if len(dtypes) != 1 or not dtypes <= set(FLOAT_DTYPES):
            allowed = ", ".join(str(d)[6:] for d in FLOAT_DTYPES)
            raise TypeError(f"float gates and ups must share one float dtype ({allowed}), found "
                            f"{sorted(str(d)[6:] for d in dtypes)}")
    stack = NVFP4Tensor.stack if kinds == {True} else torch.stack
    return fuse_w13(stack(list(gates)), stack(list(ups)))


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


def is_nvfp4(w) -> bool:
    """True for NVFP4 expert weights (checkpoint layout, or packed: :class:`PackedExperts` stacks and
    :class:`~lynn_kernels.matmul.PackedNVFP4` single experts), False for plain float ones."""
    return isinstance(w, (NVFP4Tensor, PackedExperts, PackedNVFP4))


def is_packed(w) -> bool:
    """True for expert weights in the packed kernel layout."""
    return isinstance(w, (PackedExperts, PackedNVFP4))


def as_nvfp4(w):
    """An NVFP4 expert weight in the checkpoint layout (packed ones unpacked, exactly); others as they are."""
    return w.unpack() if is_packed(w) else w


def weight_data(name: str, w) -> tuple[str, torch.Tensor]:
    """``(name, tensor)`` of what a weight keeps on the device (its codes or words, or the float tensor), for
    device checks."""
    if is_packed(w):
        return name + ".words", w.words
    return (name + ".codes", w.codes) if is_nvfp4(w) else (name, w)


def _kind(w) -> str:
    if is_packed(w):
        return f"a {type(w).__name__} (packed NVFP4)"
    return "an NVFP4Tensor" if is_nvfp4(w) else f"a {str(w.dtype)[6:]} tensor"


def _layout(w) -> str:
    return f"packed ({type(w).__name__})" if is_packed(w) else "in the checkpoint layout (NVFP4Tensor)"


def _check_weight(name: str, w, ndim: int, layout: str, x_dtype: torch.dtype) -> None:
    """An NVFP4Tensor, or a float tensor of x's dtype, of ``ndim`` dims."""
    if not is_nvfp4(w) and not isinstance(w, torch.Tensor):
        raise TypeError(f"{name} must be an NVFP4Tensor {layout} (quantise it with lynn_kernels.quantize) or a float "
                        f"torch.Tensor of x's dtype, found {type(w).__name__}")
    if not is_nvfp4(w) and w.dtype != x_dtype:
        raise TypeError(f"{name} has dtype {str(w.dtype)[6:]}; float expert weights must have x's dtype "
                        f"({str(x_dtype)[6:]}), or be NVFP4Tensors")
    if w.dim() != ndim:
        what = type(w).__name__ if is_nvfp4(w) else "tensor"
        raise ValueError(f"{name} must be a {ndim}-D {what} {layout}, found shape {tuple(w.shape)}")


def check_ffn(x_name: str, x_dtype: torch.dtype, H: int, w13, w2, stacked: bool, prefix: str) -> int:
    """``w13 [E, 2I, H]`` and ``w2 [E, H, I]`` (``stacked``, E from w13) or ``[2I, H]`` and ``[H, I]``, both NVFP4
    or both float of x's dtype; returns ``I``."""
    n13, n2 = prefix + "w13", prefix + "w2"
    l13, l2 = f"[{'E, ' if stacked else ''}2I, H]", f"[{'E, ' if stacked else ''}H, I]"
    if isinstance(w13, torch.Tensor) and is_nvfp4(w2):        # one kind per FFN: the float one is the odd one out
        raise TypeError(f"{n13} must be an NVFP4Tensor {l13}, as {n2} is (both weights of an FFN are of one kind: "
                        f"NVFP4Tensors, or float tensors of x's dtype), found {_kind(w13)}")
    if is_nvfp4(w13) and isinstance(w2, torch.Tensor):
        raise TypeError(f"{n2} must be an NVFP4Tensor {l2}, as {n13} is (both weights of an FFN are of one kind: "
                        f"NVFP4Tensors, or float tensors of x's dtype), found {_kind(w2)}")
    _check_weight(n13, w13, 2 + stacked, l13, x_dtype)
    _check_weight(n2, w2, 2 + stacked, l2, x_dtype)
    if is_packed(w13) != is_packed(w2):
        raise TypeError(f"{n13} is {_layout(w13)} but {n2} is {_layout(w2)}: both weights of an FFN must be in one "
                        f"layout (lynn_kernels.moe.pack_experts packs both)")
    lead = tuple(w13.shape[:1]) if stacked else ()
    lead_s = "".join(f"{d}, " for d in lead)
    if tuple(w13.shape[:len(lead)]) != lead or w13.shape[-1] != H or w13.shape[-2] % 2:
        raise ValueError(f"{n13} must have shape [{lead_s}2I, H={H}] (H from {x_name}), found {tuple(w13.shape)}")
    inter = w13.shape[-2] // 2
    if tuple(w2.shape) != (*lead, H, inter):
        raise ValueError(f"{n2} must have shape [{lead_s}H, I] = {(*lead, H, inter)} ({n13} is "
                         f"{tuple(w13.shape)}), found {tuple(w2.shape)}")
    if not is_nvfp4(w13) and (H % 2 or inter % 2):     # NVFP4 has K % 16 == 0 already
        raise ValueError(f"float {n13} {tuple(w13.shape)} / {n2} {tuple(w2.shape)} need an even H and I (the kernels "
                         f"read column pairs), found H={H}, I={inter}")
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
    check_ffn("x", x.dtype, H, w13, w2, True, "")
    E = w13.shape[0]
    if ids.shape[1] > E:
        raise ValueError(f"ids has top_k={ids.shape[1]} columns but w13 has E={E} experts; top_k must lie in "
                         f"[1, E]")
    for name, t in (("weights", weights), ("ids", ids), weight_data("w13", w13), weight_data("w2", w2)):
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
    check_ffn("x", x.dtype, H, w13, w2, True, "")
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
    if shared is not None:
        if not isinstance(shared, SharedExpert):
            raise TypeError(f"shared must be a SharedExpert(w13, w2, gate_weight) or None, found "
                            f"{type(shared).__name__}")
        check_ffn("x", x.dtype, H, shared.w13, shared.w2, False, "shared.")
        _need_tensor("shared.gate_weight", shared.gate_weight)
        if tuple(shared.gate_weight.shape) != (1, H):
            raise ValueError(f"shared.gate_weight must have shape [1, H] = (1, {H}), found "
                             f"{tuple(shared.gate_weight.shape)}")
        _need_dtype("shared.gate_weight", shared.gate_weight, FLOAT_DTYPES, "a float dtype")
        for name, t in (weight_data("shared.w13", shared.w13), weight_data("shared.w2", shared.w2),
                        ("shared.gate_weight", shared.gate_weight)):
            _need_same_device(name, t, "x", x)
    for name, t in (weight_data("w13", w13), weight_data("w2", w2)):
        _need_same_device(name, t, "x", x)
