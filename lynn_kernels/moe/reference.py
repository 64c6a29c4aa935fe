"""The executable spec of the MoE block in plain torch (fp32 math): routing, the align step, the experts, the block.

Each function takes the same arguments in the same order as its kernel in :mod:`lynn_kernels.moe` and returns the
same thing. Layouts and checks are in :mod:`.spec`.

What HF transformers does (``Qwen3NextSparseMoeBlock``, ``Qwen3_5MoeSparseMoeBlock``, transformers 5.x), and what
this spec keeps:

* router logits ``F.linear(x, router.weight)`` in x's dtype (bf16): **kept** (:func:`moe_block` rounds the fp32
  product to x's dtype once, as a bf16 GEMM does, because the routing decision depends on it);
* ``softmax(logits, dtype=float32)``, ``torch.topk`` of the fp32 probabilities, then (Qwen3.5 always, Qwen3-Next when
  ``norm_topk_prob``) ``top /= top.sum(-1)`` in fp32: **kept**, bit for bit, except that ties go to the lowest
  expert id here (``torch.topk`` does not say which of two equal probabilities it returns);
* HF then casts the routing weights to x's dtype, runs each expert's linears in x's dtype and accumulates the
  experts into a bf16 buffer (``index_add_``); the shared expert and its sigmoid gate run in x's dtype too. **Not
  kept**: here the weights stay fp32, every product and sum is fp32, and the output is rounded once to x's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..nvfp4 import reference as nvfp4_reference
from . import spec
from .packed import SharedExpert


def route(logits: torch.Tensor, top_k: int, renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax routing: ``logits [M, E]`` -> ``(weights fp32 [M, top_k], ids int32 [M, top_k])``.

    ``p = softmax(logits)`` in fp32 over the E experts; the ``top_k`` experts of largest logit (softmax's order,
    exactly: fp32 ``p`` can tie where the logits do not), ties to the lowest expert id (a stable sort), each weighted
    by its ``p``; with ``renormalize`` the k weights are divided by their sum.
    """
    spec.check_route(logits, top_k, renormalize)
    spec.check_logits_finite(logits)
    p = torch.softmax(logits, dim=-1, dtype=torch.float32)
    order = torch.sort(logits.float(), dim=-1, descending=True, stable=True).indices   # equal logits: increasing ids
    ids = order[:, :top_k]
    weights = p.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.contiguous(), ids.to(torch.int32).contiguous()


def align(ids: torch.Tensor, num_experts: int, block_m: int):
    """The "moe align block size" step: group the slots by expert, each group padded to a multiple of ``block_m``.

    Args:
        ids: ``[M, top_k]`` int32 / int64 expert ids in ``[0, E)`` (from :func:`route`). Slot ``s = t * top_k + j``
            is ``ids.view(-1)[s]``; ``S = M * top_k`` slots.
        num_experts: ``E``.
        block_m: rows of one tile of the grouped GEMM, a power of two ``>= 16``.

    Returns ``(sorted_slots, block_expert, num_padded)``, all int32, sized without reading ``ids`` (no host sync):

    * ``sorted_slots [P_max]``, ``P_max = spec.max_padded(S, E, block_m) = round_up(S + min(E, S) * (block_m - 1),
      block_m)``: for each expert ``e`` in increasing id that has ``c_e > 0`` slots, its slots in increasing slot
      order, then ``round_up(c_e, block_m) - c_e`` sentinels; every entry from ``num_padded`` on is a sentinel too.
      The sentinel is ``S`` (one past the last slot). Expert ``e``'s group starts at ``sum_{e' < e}
      round_up(c_e', block_m)``, a multiple of ``block_m``; an expert without slots has no group.
    * ``block_expert [P_max // block_m]``: the expert of rows ``[b * block_m, (b + 1) * block_m)`` of
      ``sorted_slots`` for ``b < num_padded // block_m``, and ``-1`` for every block after.
    * ``num_padded [1]``: ``sum_e round_up(c_e, block_m)``, a multiple of ``block_m``.

    A GEMM program for block ``b`` reads expert ``block_expert[b]`` (it exits at ``-1``) and token rows
    ``sorted_slots[...] // top_k`` of x, skipping sentinels (``>= S``); its row ``r`` writes slot ``sorted_slots[r]``.
    """
    S, p_max = spec.check_align(ids, num_experts, block_m)
    spec.check_ids_in_range(ids, num_experts)
    dev = ids.device
    flat = ids.reshape(-1).long()
    order = torch.sort(flat, stable=True).indices                    # slots grouped by expert, in slot order
    counts = torch.bincount(flat, minlength=num_experts)             # [E]
    padded = (counts + block_m - 1) // block_m * block_m
    starts = torch.cumsum(padded, 0) - padded                        # where each expert's group begins
    rank = torch.arange(S, device=dev) - (torch.cumsum(counts, 0) - counts)[flat[order]]
    sorted_slots = torch.full((p_max,), S, dtype=torch.int32, device=dev)
    sorted_slots[starts[flat[order]] + rank] = order.to(torch.int32)
    blocks = padded // block_m
    block_expert = torch.full((p_max // block_m,), -1, dtype=torch.int32, device=dev)
    used = int(blocks.sum())
    block_expert[:used] = torch.repeat_interleave(torch.arange(num_experts, device=dev), blocks).to(torch.int32)
    return sorted_slots, block_expert, padded.sum().reshape(1).to(torch.int32)


def _fp32(w) -> torch.Tensor:
    """An expert weight in fp32: NVFP4 dequantised (every row with its own global scale, so per-shard gate / up
    scales apply exactly), a float tensor as it is."""
    return nvfp4_reference.dequantize(spec.as_nvfp4(w), torch.float32) if spec.is_nvfp4(w) else w.float()


def _ffn(xf: torch.Tensor, w13, w2) -> torch.Tensor:
    """``down(silu(gate(x)) * up(x))`` in fp32; ``w13 [2I, H]`` (gate rows first), ``w2 [H, I]``, NVFP4 or float."""
    h = xf @ _fp32(w13).t()                                           # [T, 2I]
    gate, up = h.chunk(2, dim=-1)
    return (F.silu(gate) * up) @ _fp32(w2).t()


def _experts_fp32(xf, weights, ids, w13, w2) -> torch.Tensor:
    out = torch.zeros_like(xf)                                        # [M, H] fp32
    for e in range(w13.shape[0]):
        t, j = torch.where(ids == e)
        if t.numel():
            out.index_add_(0, t, _ffn(xf[t], w13[e], w2[e]) * weights[t, j, None].float())
    return out


def moe_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13, w2) -> torch.Tensor:
    """The routed experts: ``out[t] = sum_j weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t))``,
    ``e = ids[t, j]``, in fp32 from the dequantised (or float) weights, rounded once to x's dtype.

    Shapes: ``x [M, H]`` bf16 / fp16 / fp32; ``weights [M, top_k]`` (fp32 from :func:`route`); ``ids [M, top_k]``
    int32 / int64 in ``[0, E)``; ``w13 [E, 2I, H]`` (gate rows, then up rows) and ``w2 [E, H, I]``, both NVFP4 (any
    global-scale layout: ``()``, ``[E]``, per row ``[E, 2I]`` / ``[E, H]``) or both float tensors of x's dtype.
    Returns ``[M, H]`` in x's dtype.
    """
    _, _, E = spec.check_experts(x, weights, ids, w13, w2)
    spec.check_ids_in_range(ids, E)
    return _experts_fp32(x.float(), weights, ids, w13, w2).to(x.dtype)


def shared_expert(x: torch.Tensor, shared: SharedExpert) -> torch.Tensor:
    """``sigmoid(x @ gate_weight^T) * down(silu(gate(x)) * up(x))`` in fp32, ``x [T, H]`` -> fp32 ``[T, H]``."""
    xf = x.float()
    return torch.sigmoid(xf @ shared.gate_weight.float().t()) * _ffn(xf, shared.w13, shared.w2)


def moe_block(x: torch.Tensor, router_weight: torch.Tensor, w13, w2, shared: SharedExpert | None = None, *,
              top_k: int, renormalize: bool = True) -> torch.Tensor:
    """A Qwen3-Next / Qwen3.5 sparse MoE block: router, :func:`route`, :func:`moe_experts`, plus the shared expert.

    Shapes: ``x [..., H]``; ``router_weight [E, H]`` unquantised; ``w13``, ``w2`` as :func:`moe_experts`;
    ``shared`` a :class:`~.spec.SharedExpert` or None. ``renormalize``: Qwen3.5 always, Qwen3-Next
    ``config.norm_topk_prob``. Returns ``[..., H]`` in x's dtype. The logits are rounded to x's dtype (HF's router is
    a linear in x's dtype); everything after is fp32, summed, and rounded once.
    """
    spec.check_block(x, router_weight, w13, w2, shared, top_k, renormalize)
    x2 = x.reshape(-1, x.shape[-1])
    logits = (x2.float() @ router_weight.float().t()).to(x.dtype)   # [M, E]
    weights, ids = route(logits, top_k, renormalize)
    out = _experts_fp32(x2.float(), weights, ids, w13, w2)
    if shared is not None:
        out = out + shared_expert(x2, shared)
    return out.to(x.dtype).reshape(x.shape)


def norm_moe_block(x: torch.Tensor, norm_weight: torch.Tensor, router_weight: torch.Tensor, w13, w2,
                   shared: SharedExpert | None = None, *, top_k: int, renormalize: bool = True, eps: float = 1e-6,
                   residual: torch.Tensor | None = None) -> tuple:
    """A pre-norm MoE block: ``xn = rmsnorm(x (+ residual), norm_weight, eps)`` (:func:`lynn_kernels.rmsnorm`),
    then ``y = moe_block(xn, ...)``. Returns ``(y, xn)``, or ``(y, xn, h)`` with ``residual`` (``h = x +
    residual``)."""
    from ..norm import reference as norm_reference
    from ..norm import spec as norm_spec

    spec.check_block(x, router_weight, w13, w2, shared, top_k, renormalize)
    norm_spec.check_rmsnorm(x, norm_weight, eps, residual, None, None, "norm_weight")
    return norm_spec.norm_then(norm_reference.rmsnorm, lambda xn: moe_block(
        xn, router_weight, w13, w2, shared, top_k=top_k, renormalize=renormalize), x, norm_weight, eps, residual)
