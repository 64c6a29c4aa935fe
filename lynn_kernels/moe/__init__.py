"""Mixture of experts (Qwen3-Next, Qwen3.5 / 3.6 sparse MoE blocks): routing, the align step, the experts, the block.

Public ops (names, argument order and return values are a contract; each has a torch reference of the same
signature in :mod:`.reference`; layouts and checks in :mod:`.spec`):

* ``route(logits, top_k, renormalize=True) -> (weights fp32 [M, top_k], ids int32 [M, top_k])``: softmax top-k
  routing, best first, ties to the lowest expert id;
* ``align(ids, num_experts, block_m) -> (sorted_slots, block_expert, num_padded)``: the slots grouped by expert and
  padded to ``block_m`` for a grouped GEMM (contract: :func:`.reference.align`);
* ``moe_experts(x, weights, ids, w13, w2) -> out [M, H]``: the routed experts, grouped NVFP4 GEMMs
  (:mod:`.triton_experts`), or the same kernels over plain float weights (the bf16 baseline);
* ``moe_block(x, router_weight, w13, w2, shared=None, *, top_k, renormalize=True) -> [..., H]``: router, routing,
  experts and the :class:`SharedExpert`, summed and rounded once;
* ``norm_moe_block(x, norm_weight, router_weight, w13, w2, shared=None, *, top_k, renormalize=True, eps=1e-6,
  residual=None) -> (y, xn)`` / ``(y, xn, h)``: the block's RMSNorm (with the residual add) in front, folded into
  the router's launch on the three-launch decode path.

The kernel layout (:mod:`.packed`): ``pack_experts(w13, w2, shared=None) -> (w13, w2, shared)`` puts the expert
stacks into the packed layout of :func:`lynn_kernels.matmul.pack` (:class:`PackedExperts`), once at load time, and
the shared expert into the same stacks as expert ``E`` where its shape allows: every op takes the result, and
``moe_block``'s decode step then runs in three launches (router, gate_up, down), the shared expert one more slot.

Loader helpers (:mod:`.spec`): ``stack_w13(gates, ups) -> w13 [E, 2I, H]`` and ``fuse_w13(gate, up) -> [2I, H]``
build ``w13`` from a checkpoint's separate gate_proj / up_proj weights (NVFP4 or float), each keeping its own global
scale (per-shard scales become one global scale per row, which the kernels apply exactly).

Bad arguments raise ``TypeError`` (wrong type or dtype) or ``ValueError`` (wrong shape, value or device), naming the
tensor, on every backend. The public ops ``route``, ``align`` and ``moe_experts`` also check values (finite logits,
ids in ``[0, E)``) with one host sync, skipped while a CUDA graph is being captured; ``moe_block`` (which makes its
own ids), the ``*_triton`` host functions and the ``launch_*`` functions never synchronise.

Example (a decode batch of 4 tokens over Qwen3.5's 256 experts)::

    from lynn_kernels import moe
    logits = x @ router_weight.t()                                  # [4, 256] bf16
    weights, ids = moe.route(logits, top_k=8)                       # [4, 8] fp32, [4, 8] int32
    sorted_slots, block_expert, num_padded = moe.align(ids, 256, block_m=16)
"""

from .. import runtime
from . import reference, spec
from .packed import PackedExperts, SharedExpert, pack_experts
from .spec import fuse_w13, max_padded, stack_w13
from .triton_align import align_triton
from .triton_experts import moe_block_triton, moe_experts_triton, norm_moe_block_triton
from .triton_route import route_triton


@runtime.op(reference=reference.route)
def route(logits, top_k, renormalize=True):
    """Softmax top-k routing, one Triton program per block of tokens.

    ``p = softmax(logits)`` in fp32 over the experts; the ``top_k`` largest probabilities in descending order
    (chosen on the logits, which order them exactly), ties to the lowest expert id; with ``renormalize`` (Qwen3.5
    always, Qwen3-Next ``norm_topk_prob``) the k weights divided by their sum. As HF's router up to the weights' dtype:
    HF then casts them to x's dtype, this keeps fp32.

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
    runtime.check_device("logits", logits)          # before the value check reads it
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
    runtime.check_device("ids", ids)                # before the value check reads it
    spec.check_ids_in_range(ids, num_experts)
    return align_triton(ids, num_experts, block_m)


@runtime.op(reference=reference.moe_experts)
def moe_experts(x, weights, ids, w13, w2):
    """The routed experts: ``out[t] = sum_j weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t))``, ``e = ids[t, j]``,
    W4A16: NVFP4 expert weights decoded in registers, x's dtype on the tensor cores (an IEEE fp32 dot for fp32
    x), fp32 accumulation. With float weights (x's dtype) the same kernels load the weight tiles as they are: the
    unquantised baseline (an HF bf16 checkpoint), to show what NVFP4 buys and to check parity.

    Prefill (M > 16): :func:`align` groups the slots by expert, then one grouped GEMM for gate and up (with
    ``silu(gate) * up`` in its epilogue) and one for down (times the routing weight), one row per slot; a decode step
    (M <= 16) skips the align step (one program per slot). A last kernel adds each token's ``top_k`` rows in order:
    no atomics, so the result is deterministic. The intermediate ``silu(gate) * up`` is rounded to x's dtype (bf16 /
    fp16; kept fp32 for fp32 x); everything else is fp32 until the single output rounding.

    Args:
        x: ``[M, H]`` bf16 / fp16 / fp32 activations.
        weights: ``[M, top_k]`` routing weights (fp32 from :func:`route`; any float dtype).
        ids: ``[M, top_k]`` int32 / int64 expert ids in ``[0, E)`` (checked here with one host sync, skipped while a
            CUDA graph is being captured).
        w13: ``[E, 2I, H]``: gate rows ``0..I-1``, then up rows. NVFP4 with global scale ``()``, per expert ``[E]``
            or per row ``[E, 2I]``: the form of per-shard scales (an expert's gate_proj and up_proj quantised with
            different global scales, as ModelOpt checkpoints may be): every gate row holds the gate's scale, every
            up row the up's, and the kernels multiply the gate and the up accumulators each by its own, exactly.
            :func:`stack_w13` builds it from per-expert gate / up weights. Or a float tensor of x's dtype.
        w2: ``[E, H, I]``, of w13's kind (both NVFP4 or both float: mixing raises ``TypeError``); NVFP4 with global
            scale ``()`` or ``[E]``. Float weights are read in place when contiguous (else copied on every call).

    Returns:
        ``[M, H]`` in x's dtype.

    Example::

        weights, ids = route(x @ router_weight.t(), top_k=8)
        y = moe_experts(x, weights, ids, w13, w2)                        # x [4, 2048] bf16 -> y [4, 2048] bf16
    """
    spec.check_experts(x, weights, ids, w13, w2)     # every input on x's device
    runtime.check_device("x", x)                    # and that one where the kernels run, before ids are read
    spec.check_ids_in_range(ids, w13.shape[0])
    return moe_experts_triton(x, weights, ids, w13, w2)


@runtime.op(reference=reference.moe_block)
def moe_block(x, router_weight, w13, w2, shared=None, *, top_k, renormalize=True):
    """A Qwen3-Next / Qwen3.5 sparse MoE block: router logits, :func:`route`, :func:`moe_experts`, plus the shared
    expert ``sigmoid(x @ gate_weight^T) * down(silu(gate(x)) * up(x))``; all summed in fp32, rounded once.

    The logits are rounded to x's dtype (HF's router is a linear in x's dtype): the fp32 product rounded once in the
    reference and under the interpreter; on the GPU, for bf16 / fp16 x and router weight, HF's ``F.linear`` itself
    (fp32 accumulation, one rounding; the sum's order is cuBLAS's).
    No host sync: the router cannot produce out-of-range ids, and non-finite x gives a non-finite output where the
    reference raises.

    Args:
        x: ``[..., H]`` bf16 / fp16 / fp32.
        router_weight: ``[E, H]`` float, unquantised (HF ``mlp.gate.weight``).
        w13, w2: the experts, as :func:`moe_experts`.
        shared: a :class:`SharedExpert` (``w13 [2 Is, H]`` and ``w2 [H, Is]``, both NVFP4 or both float of x's dtype,
            not necessarily of the routed experts' kind; NVFP4 global scales ``()``, and for ``w13`` also per row
            ``[2 Is]``, the per-shard form :func:`fuse_w13` builds; and ``gate_weight [1, H]``) or None.
        top_k: experts per token; ``renormalize``: Qwen3.5 always, Qwen3-Next ``config.norm_topk_prob``.

    Returns:
        ``[..., H]`` in x's dtype.

    Example::

        y = moe_block(x, router_weight, w13, w2, SharedExpert(s13, s2, gate_weight), top_k=8)   # x [1, 5, 2048]
    """
    return moe_block_triton(x, router_weight, w13, w2, shared, top_k=top_k, renormalize=renormalize)


norm_moe_block = runtime.op(reference=reference.norm_moe_block, docs="reference")(norm_moe_block_triton)

__all__ = ["route", "align", "moe_experts", "moe_block", "norm_moe_block", "SharedExpert", "PackedExperts",
           "pack_experts", "stack_w13", "fuse_w13", "max_padded", "reference", "spec"]
