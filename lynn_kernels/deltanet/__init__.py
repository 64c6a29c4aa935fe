"""Gated DeltaNet (Qwen3-Next, Qwen3.5 / 3.6 linear-attention layers): the delta rule, its conv and its norm.

Public ops (names, argument order and return values are a contract; each has a torch reference of the same
signature in :mod:`.reference`; layouts in :mod:`.spec`, math in docs/deltanet.md):

* ``chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
  use_qk_l2norm=False, *, out_state=None, cu_seqlens=None) -> (o, final_state)``: prefill, chunks of 64 (WY / UT
  form), of one sequence per batch row or of ``N`` packed sequences (``cu_seqlens``);
* ``recurrent_gated_delta_rule(...)``, same arguments but ``cu_seqlens``: token by token (decode; any T);
* ``recurrent_gated_delta_rule_gates(q, k, v, A_log, a, dt_bias, b, scale=None, initial_state=None,
  output_final_state=False, use_qk_l2norm=False, *, out_state=None)``: the decode step with the gates
  ``g = -exp(A_log) softplus(a + dt_bias)``, ``beta = sigmoid(b)`` computed in the same kernel (one launch);
* ``gates(A_log, a, dt_bias, b) -> (g, beta)``: those gates in torch, for the chunked path;
* ``causal_conv1d(x, weight, initial_state=None, *, cu_seqlens=None) -> (y, final_state)`` and
  ``causal_conv1d_update(x, conv_state, weight) -> y`` (rolls ``conv_state`` in place);
* ``gated_rmsnorm(x, z, weight, eps=1e-6)``;
* ``gated_delta_decode(qkv, z, a, b, conv_state, conv_weight, A_log, dt_bias, state, norm_weight, num_k_heads,
  eps=1e-6)``: a layer's decode step between its input projections and ``out_proj`` (conv update, gates, delta
  rule, gated norm) in one launch.

Shapes: q, k ``[B, T, H, K]``; v ``[B, T, HV, V]`` (HV a multiple of H); g, beta ``[B, T, HV]``; the recurrent state
``[B, HV, K, V]`` is always fp32; o ``[B, T, HV, V]`` in v's dtype. ``final_state`` is ``None`` unless
``output_final_state`` (or ``out_state``, which receives it; it may be ``initial_state`` for an in-place step).
Packed sequences (``cu_seqlens``, int32 ``[N+1]``, for a prefill of several prompts without padding): the inputs are
one row ``[1, T, ...]`` holding the ``N`` sequences one after another, and every state has one row per sequence
(``[N, HV, K, V]``, conv ``[N, C, S]``), so the decode steps that follow run them as a batch of ``B = N``.
Bad arguments raise ``TypeError`` (wrong type or dtype) or ``ValueError`` (wrong shape, value or device), naming the
tensor, on every backend (the checks live in :mod:`.spec`).

Example (a Qwen3.5 layer's core on the CPU interpreter)::

    import torch, torch.nn.functional as F
    from lynn_kernels import deltanet
    B, T, H, HV, D = 1, 100, 2, 4, 64
    q, k = torch.randn(B, T, H, D), torch.randn(B, T, H, D)
    v = torch.randn(B, T, HV, D)
    g, beta = F.logsigmoid(torch.randn(B, T, HV)), torch.rand(B, T, HV)
    o, state = deltanet.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, use_qk_l2norm=True)
    o1, state = deltanet.recurrent_gated_delta_rule(q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1],
                                                    initial_state=state, output_final_state=True,
                                                    use_qk_l2norm=True)
"""

from .. import runtime
from . import reference, spec
from .reference import gates
from .spec import CHUNK
from .triton_chunk import chunk_gated_delta_rule_triton
from .triton_conv import causal_conv1d_triton, causal_conv1d_update_triton
from .triton_decode_step import gated_delta_decode_triton
from .triton_norm import gated_rmsnorm_triton
from .triton_recurrent import recurrent_gated_delta_rule_gates_triton, recurrent_gated_delta_rule_triton


@runtime.op(reference=reference.chunk_gated_delta_rule)
def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm=False, *, out_state=None, cu_seqlens=None):
    """The gated delta rule over a whole prompt in chunks of 64 tokens (WY / UT form, three kernels): prefill.

    Per value head, with state ``S [K, V]`` (fp32), token by token: ``S = exp(g_t) S``; ``d = beta_t (v_t - S^T
    k_t)``; ``S = S + k_t d^T``; ``o_t = S^T q_t``. Same result as :func:`recurrent_gated_delta_rule` (math:
    docs/deltanet.md). On the GPU, bf16 / fp16 inputs use bf16 ``tl.dot`` operands (the fp32 inverse and state
    included): on the H200 at T=65 the final state is 2.9e-3 off in rel_l2 (the recurrent op: 6e-8); fp32 inputs
    multiply in IEEE fp32.

    Args:
        q, k: ``[B, T, H, K]`` bf16 / fp16 / fp32, any strides with the last dim contiguous (views of a fused
            projection are read in place). ``K <= 256``.
        v: ``[B, T, HV, V]``, q's dtype; ``HV`` a multiple of ``H`` (value head ``h`` reads QK head
            ``h // (HV // H)``, no copy). ``V <= 256``.
        g: ``[B, T, HV]`` log decay per token and value head (``<= 0``), any float dtype (fp32 advised).
        beta: ``[B, T, HV]`` delta-rule step size (in ``(0, 1)`` for Qwen: ``sigmoid(b)``), any float dtype.
        scale: multiplies q (after the L2 norm); default ``K ** -0.5``.
        initial_state: ``[B, HV, K, V]`` **fp32** (``S^T q`` is the output: K rows, V columns), or None (zeros).
            With ``cu_seqlens``: ``[N, HV, K, V]``, one row per sequence.
        output_final_state: return the state after the last token (of each sequence).
        use_qk_l2norm: L2-normalise q and k in the kernel (``x * rsqrt(sum(x^2) + 1e-6)``, HF / fla), as Qwen does.
        out_state: contiguous fp32 ``[B, HV, K, V]`` (``[N, HV, K, V]`` with ``cu_seqlens``) that receives the
            final state (may be ``initial_state`` itself for an in-place update, but no other view sharing its
            memory or an input's); implies a returned final state.
        cu_seqlens: int32 ``[N+1]`` offsets of packed sequences, ``0 = cu[0] <= ... <= cu[N] = T`` (sequence ``n`` is
            tokens ``cu[n]:cu[n+1]``, possibly none), on q's device; or None. Then q, k are ``[1, T, H, K]``, v
            ``[1, T, HV, V]``, g, beta ``[1, T, HV]``, and each sequence runs on its own from its row of
            ``initial_state``, as if called alone: its chunks of 64 start at its first token (fla's convention). Read
            to the host once (the chunk table and the grids depend on it).

    Returns:
        ``(o, final_state)``: o ``[B, T, HV, V]`` in v's dtype; final_state fp32 ``[B, HV, K, V]`` (``[N, HV, K, V]``
        with ``cu_seqlens``; ``out_state`` when given) or None.

    Example::

        q, k = torch.randn(1, 100, 2, 64), torch.randn(1, 100, 2, 64)             # B=1, T=100, H=2, K=64
        v = torch.randn(1, 100, 4, 64)                                             # HV=4, V=64
        g, beta = F.logsigmoid(torch.randn(1, 100, 4)), torch.rand(1, 100, 4)
        o, state = chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, use_qk_l2norm=True)
        # o [1, 100, 4, 64] float32, state [1, 4, 64, 64] float32
        cu = torch.tensor([0, 30, 100], dtype=torch.int32)                         # the same tokens as two prompts
        o, state = chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, use_qk_l2norm=True,
                                          cu_seqlens=cu)                           # state [2, 4, 64, 64]
    """
    return chunk_gated_delta_rule_triton(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm,
                                         out_state=out_state, cu_seqlens=cu_seqlens)


@runtime.op(reference=reference.recurrent_gated_delta_rule)
def recurrent_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm=False, *, out_state=None):
    """The gated delta rule token by token, in one kernel: decode (T = 1) or any T, sequentially.

    Same arguments (but no ``cu_seqlens``) and result as :func:`chunk_gated_delta_rule`. Each program keeps its slice of
    the fp32 state in registers over the tokens (read once, written once per call); all arithmetic is fp32, no
    ``tl.dot``.

    Example (one decode step after a prefill, the state updated in place)::

        o1, _ = recurrent_gated_delta_rule(q[:, -1:], k[:, -1:], v[:, -1:], g[:, -1:], beta[:, -1:],
                                           initial_state=state, use_qk_l2norm=True, out_state=state)
        # q[:, -1:] [B, 1, H, K]; o1 [B, 1, HV, V] in v's dtype; state [B, HV, K, V] fp32, updated
    """
    return recurrent_gated_delta_rule_triton(q, k, v, g, beta, scale, initial_state, output_final_state,
                                             use_qk_l2norm, out_state=out_state)


@runtime.op(reference=reference.recurrent_gated_delta_rule_gates)
def recurrent_gated_delta_rule_gates(q, k, v, A_log, a, dt_bias, b, scale=None, initial_state=None,
                                     output_final_state=False, use_qk_l2norm=False, *, out_state=None):
    """:func:`recurrent_gated_delta_rule` with Qwen's gates computed in the same kernel (a decode step in one
    launch): ``g = -exp(A_log) softplus(a + dt_bias)``, ``beta = sigmoid(b)`` (as :func:`gates`, in fp32).

    Args:
        q, k: ``[B, T, H, K]``; v ``[B, T, HV, V]``: as :func:`chunk_gated_delta_rule`.
        A_log, dt_bias: ``[HV]`` per-head parameters, any float dtype (used in fp32).
        a, b: ``[B, T, HV]`` the raw outputs of ``in_proj_a`` / ``in_proj_b``, any float dtype.
        scale, initial_state, output_final_state, use_qk_l2norm, out_state: as :func:`chunk_gated_delta_rule`
            (the state ``[B, HV, K, V]`` fp32).

    Returns:
        ``(o [B, T, HV, V]`` in v's dtype, ``final_state`` fp32 ``[B, HV, K, V]`` or None).

    Example::

        o, _ = recurrent_gated_delta_rule_gates(q, k, v, layer.A_log, a, layer.dt_bias, b, initial_state=state,
                                                use_qk_l2norm=True, out_state=state)      # q [B, 1, 16, 128]
    """
    return recurrent_gated_delta_rule_gates_triton(q, k, v, A_log, a, dt_bias, b, scale, initial_state,
                                                   output_final_state, use_qk_l2norm, out_state=out_state)


@runtime.op(reference=reference.causal_conv1d)
def causal_conv1d(x, weight, initial_state=None, *, cu_seqlens=None):
    """Depthwise causal conv1d + SiLU over a prompt (no bias), summed in fp32.

    ``y[b, t, c] = silu(sum_j weight[c, j] * x[b, t - W + 1 + j, c])``, inputs before ``t = 0`` from
    ``initial_state`` (or zeros).

    Args:
        x: ``[B, T, C]`` bf16 / fp16 / fp32, last dim contiguous (or it is copied). With ``cu_seqlens``: ``[1, T, C]``,
            the ``N`` sequences one after another.
        weight: ``[C, W]``, any float dtype, ``2 <= W <= 8`` (an ``nn.Conv1d`` weight ``[C, 1, W]`` needs
            ``.squeeze(1)``).
        initial_state: ``[B, C, S]`` in x's dtype, ``S >= W - 1``, the last ``S`` raw inputs, oldest first; or None.
            With ``cu_seqlens``: ``[N, C, S]``, one row per sequence.
        cu_seqlens: int32 ``[N+1]`` offsets of packed sequences, ``0 = cu[0] <= ... <= cu[N] = T`` (sequence ``n`` is
            tokens ``cu[n]:cu[n+1]``, possibly none), on x's device; or None. Each sequence is convolved on its own:
            its window starts from its own row of ``initial_state``, never from the sequence before it. Read to the
            host once (it sizes the grid).

    Returns:
        ``(y [B, T, C]`` in x's dtype, ``final_state [B, C, S]`` (``[N, C, S]`` with ``cu_seqlens``) in x's dtype:
        the last ``S`` raw inputs of each sequence, bit for bit, taken from its initial state where the sequence is
        shorter than ``S``; ``S = W - 1`` without an initial state).

    Example::

        y, conv_state = causal_conv1d(x, conv_weight)              # x [1, 100, 8192] bf16, conv_weight [8192, 4]
        cu = torch.tensor([0, 30, 100], dtype=torch.int32, device=x.device)       # two prompts of 30 and 70 tokens
        y, conv_state = causal_conv1d(x, conv_weight, cu_seqlens=cu)               # conv_state [2, 8192, 3]
    """
    return causal_conv1d_triton(x, weight, initial_state, cu_seqlens=cu_seqlens)


@runtime.op(reference=reference.causal_conv1d_update)
def causal_conv1d_update(x, conv_state, weight):
    """One decode step of :func:`causal_conv1d`: rolls ``conv_state`` in place (oldest column out, ``x`` in).

    Args:
        x: ``[B, C]`` bf16 / fp16 / fp32, the new token.
        conv_state: ``[B, C, S]`` in x's dtype, ``S >= W - 1`` (HF keeps ``S = W``, vLLM ``W - 1``); updated in place.
        weight: ``[C, W]``, any float dtype.

    Returns:
        ``y [B, C]`` in x's dtype.

    Example::

        y1 = causal_conv1d_update(x1, conv_state, conv_weight)    # x1 [B, 8192]; conv_state [B, 8192, 3], rolled
    """
    return causal_conv1d_update_triton(x, conv_state, weight)


@runtime.op(reference=reference.gated_rmsnorm)
def gated_rmsnorm(x, z, weight, eps=1e-6):
    """``weight * rmsnorm(x) * silu(z)`` over the last dim, in HF's order and roundings (``Qwen3NextRMSNormGated``).

    Args:
        x, z: ``[..., D]`` bf16 / fp16 / fp32 (same shape), ``D <= 16384``.
        weight: ``[D]``, any float dtype (the product ``weight * normed`` is rounded to the promoted dtype).
        eps: a positive float (``0`` would give NaN on an all-zero row).

    Returns:
        ``[..., D]`` in x's dtype.

    Example::

        out = gated_rmsnorm(o, z, layer.norm.weight, eps=1e-6)     # o, z [B, T, 32, 128] bf16; weight [128]
    """
    return gated_rmsnorm_triton(x, z, weight, eps)


@runtime.op(reference=reference.gated_delta_decode)
def gated_delta_decode(qkv, z, a, b, conv_state, conv_weight, A_log, dt_bias, state, norm_weight, num_k_heads,
                       eps=1e-6, *, x=None, a_weight=None, b_weight=None, states_early=False):
    """A Gated DeltaNet layer's decode step from its projections to ``out_proj``'s input, in one kernel: the conv
    update (+ SiLU) of ``qkv``, the gates, the l2-normed delta rule on ``state`` and the gated RMSNorm with ``z``;
    the same as :func:`causal_conv1d_update`, :func:`recurrent_gated_delta_rule_gates` (``use_qk_l2norm=True``) and
    :func:`gated_rmsnorm` in turn (three launches), to rounding.

    Args:
        qkv: ``[B, C]`` bf16 / fp16 / fp32, ``C = 2 H K + HV V``: the ``in_proj_qkv`` output ``[q | k | v]`` of one
            token a row (a strided view of a fused projection is fine).
        z: ``[B, HV, V]`` in qkv's dtype (``in_proj_z``).
        a, b: ``[B, HV]`` the raw ``in_proj_a`` / ``in_proj_b`` outputs, any float dtype; or None, with ``x``.
        conv_state: ``[B, C, S]`` in qkv's dtype, ``S >= W - 1``; rolled in place.
        conv_weight: ``[C, W]``, any float dtype.
        A_log, dt_bias: ``[HV]``, any float dtype (used in fp32).
        state: ``[B, HV, K, V]`` fp32, contiguous; updated in place.
        norm_weight: ``[V]``, the gated norm's weight (plain ``w``).
        num_k_heads: ``H``, the query / key heads (``HV`` a multiple of it).
        eps: the norm's epsilon.
        x, a_weight, b_weight: instead of ``a`` and ``b``: the layer's input ``x [B, HD]`` and the float weights
            ``[HV, HD]`` of ``in_proj_a`` / ``in_proj_b`` in x's dtype; the kernel forms ``a = x @ a_weight^T`` and
            ``b = x @ b_weight^T`` itself (fp32 sums rounded to x's dtype, as ``F.linear`` returns them), so the
            gates' projection is not a launch of its own.
        states_early: under :func:`lynn_kernels.programmatic_launches` only: load ``state``, ``conv_state`` and
            the constants before waiting for the kernels ahead (they overlap the kernel before). A promise by the
            caller: the launch right before this one is the layer's input projection through the packed GEMV
            (which releases its dependents only after its own wait) or a launch made without PDL, and no kernel
            since the one before that has written these states. The decoder's step keeps it (docs/deltanet.md).

    Returns:
        ``[B, HV, V]`` in qkv's dtype: the input of ``out_proj`` (reshaped to ``[B, HV V]``).

    Example::

        o = gated_delta_decode(qkv, z, a, b, conv, layer.conv_weight, layer.A_log, layer.dt_bias, state,
                               layer.norm_weight, 16)                     # qkv [B, 8192], z [B, 32, 128]
    """
    return gated_delta_decode_triton(qkv, z, a, b, conv_state, conv_weight, A_log, dt_bias, state, norm_weight,
                                     num_k_heads, eps, x=x, a_weight=a_weight, b_weight=b_weight,
                                     states_early=states_early)


__all__ = ["chunk_gated_delta_rule", "recurrent_gated_delta_rule", "recurrent_gated_delta_rule_gates", "gates",
           "causal_conv1d", "causal_conv1d_update", "gated_rmsnorm", "gated_delta_decode", "reference", "spec", "CHUNK"]
