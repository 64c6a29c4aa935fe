"""Mixture of experts (Qwen3-Next, Qwen3.5 / 3.6 sparse MoE blocks): routing and the align step.

Public ops (names, argument order and return values are a contract; each has a torch reference of the same
signature in :mod:`.reference`; layouts and checks in :mod:`.spec`):

* ``route(logits, top_k, renormalize=True) -> (weights fp32 [M, top_k], ids int32 [M, top_k])``: softmax top-k
  routing, best first, ties to the lowest expert id;
* ``align(ids, num_experts, block_m) -> (sorted_slots, block_expert, num_padded)``: the slots grouped by expert and
  padded to ``block_m`` for a grouped GEMM (contract: :func:`.reference.align`).

The experts and the whole block are specified in :mod:`.reference` (``moe_experts``, ``moe_block``, with
:class:`SharedExpert`); their kernels come with the grouped GEMM.

Bad arguments raise ``TypeError`` (wrong type or dtype) or ``ValueError`` (wrong shape, value or device), naming the
tensor, on every backend. The public ops also check values (finite logits, ids in ``[0, E)``) with one host sync,
skipped while a CUDA graph is being captured; ``route_triton`` / ``align_triton`` and the ``launch_*`` functions in
:mod:`.triton_route` / :mod:`.triton_align` never synchronise.

Example (a decode batch of 4 tokens over Qwen3.5's 256 experts)::

    from lynn_kernels import moe
    logits = x @ router_weight.t()                                  # [4, 256] bf16
    weights, ids = moe.route(logits, top_k=8)                       # [4, 8] fp32, [4, 8] int32
    sorted_slots, block_expert, num_padded = moe.align(ids, 256, block_m=16)
"""

from .. import runtime
from . import reference, spec
from .spec import SharedExpert, max_padded
from .triton_align import align_triton
from .triton_route import route_triton


@runtime.op(reference=reference.route)
def route(logits, top_k, renormalize=True):
    """Softmax top-k routing, one Triton program per block of tokens.

    ``p = softmax(logits)`` in fp32 over the experts; the ``top_k`` largest probabilities in descending order, ties
    to the lowest expert id; with ``renormalize`` (Qwen3.5 always, Qwen3-Next ``norm_topk_prob``) the k weights
    divided by their sum. As HF's router up to the weights' dtype: HF then casts them to x's dtype, this keeps fp32.

    Args:
        logits: ``[M, E]`` bf16 / fp16 / fp32 router logits (unit stride along E), finite; ``E <= 1024``.
        top_k: experts per token, ``1 <= top_k <= E``.
        renormalize: divide the k weights by their sum.

    Returns:
        ``(weights, ids)``: fp32 ``[M, top_k]`` and int32 ``[M, top_k]``, contiguous. Ids equal the reference's;
        weights agree to a few fp32 ulps.

    Example::

        weights, ids = route(torch.randn(3, 60), top_k=4)           # weights [3, 4] fp32 (rows sum to 1), ids int32
    """
    spec.check_route(logits, top_k, renormalize)
    spec.check_logits_finite(logits)
    return route_triton(logits, top_k, renormalize)


@runtime.op(reference=reference.align)
def align(ids, num_experts, block_m):
    """Group the slots ``t * top_k + j`` by expert, each expert's group padded to a multiple of ``block_m``.

    Bit-identical to :func:`.reference.align`, deterministic, without host sync in the kernels.

    Args:
        ids: ``[M, top_k]`` int32 / int64 expert ids in ``[0, num_experts)``.
        num_experts: ``E`` (``<= 1024``).
        block_m: rows of one grouped-GEMM tile, a power of two ``>= 16``.

    Returns:
        ``(sorted_slots [P_max], block_expert [P_max // block_m], num_padded [1])``, int32, with ``P_max =
        max_padded(M * top_k, E, block_m)``; the sentinel in ``sorted_slots`` is ``M * top_k`` and ``block_expert``
        is ``-1`` past the used blocks (the full contract: :func:`.reference.align`).

    Example::

        ids = torch.tensor([[2, 0], [2, 1]], dtype=torch.int32)     # M=2, top_k=2: slots 0..3
        sorted_slots, block_expert, num_padded = align(ids, 4, 16)
        # P_max = 64: sorted_slots = [1, 4 x15 | 3, 4 x15 | 0, 2, 4 x14 | 4 x16]; block_expert = [0, 1, 2, -1];
        # num_padded = [48]
    """
    spec.check_align(ids, num_experts, block_m)
    spec.check_ids_in_range(ids, num_experts)
    return align_triton(ids, num_experts, block_m)


__all__ = ["route", "align", "SharedExpert", "max_padded", "reference", "spec"]
