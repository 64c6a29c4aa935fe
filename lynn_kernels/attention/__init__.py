"""Gated full attention of the Qwen3-Next / Qwen3.5 hybrid decoder: prefill, decode, fused QK norm + RoPE.

Public ops (names and argument order are a contract; each has a same-signature reference in :mod:`.reference`):

* ``flash_attention(q, k, v, causal=True, scale=None, gate=None, cu_seqlens=None, prefix_lens=None)``
* ``decode_attention(q, k_cache, v_cache, seq_lens, block_table=None, scale=None, gate=None, *, num_splits=None)``
* ``qk_norm_rope(q, k, q_weight, k_weight, positions, *, v=None, rotary_dim=64, rope_theta=None, eps=1e-6,
  cos=None, sin=None, k_cache=None, v_cache=None, slot_mapping=None) -> (q_out, k_out)``
* ``decode_plan(lengths, active, block_table, page_size, positions, kv_slots, seq_lens)``: a decode step's
  positions, cache slots and sequence lengths, in place

One gated-attention layer, prefill of a packed batch (see docs/attention.md)::

    q, gate = split_q_gate(q_proj(x), 16, 256)                     # views [T, 16, 256], no copy
    k, v = k_proj(x).view(T, 2, 256), v_proj(x).view(T, 2, 256)
    q, k = qk_norm_rope(q, k, q_norm_w, k_norm_w, positions, v=v, rotary_dim=64, rope_theta=1e7,
                        k_cache=kc, v_cache=vc, slot_mapping=slots)
    o = flash_attention(q, k, v, gate=gate, cu_seqlens=cu)         # [T, 16, 256], already * sigmoid(gate)
    y = o_proj(o.view(T, -1))

Bad arguments raise ``TypeError`` (wrong type or dtype) or ``ValueError`` (wrong shape, value or device), naming the
tensor, what was expected and what was found, on every backend (the checks live in :mod:`.spec`).
"""

from .. import runtime
from . import reference, spec
from .spec import HEAD_DIMS, contiguous_slots, paged_slots, split_q_gate
from .triton_decode import decode_attention_triton, default_num_splits
from .triton_plan import decode_plan_triton
from .triton_prefill import flash_attention_triton
from .triton_rope import qk_norm_rope_triton


@runtime.op(reference=reference.flash_attention)
def flash_attention(q, k, v, causal=True, scale=None, gate=None, cu_seqlens=None, prefix_lens=None):
    """Softmax attention of a packed variable-length batch, causal by default, with the gate fused in.

    Args:
        q: ``[T, Hq, D]`` bf16 / fp16 / fp32, the new tokens of every sequence, packed. Any row and head strides
            (e.g. a view of the ``q_proj`` output); unit stride along D.
        k, v: ``[T + sum(prefix_lens), Hkv, D]``, q's dtype. Per sequence: its ``prefix_lens[b]`` cached tokens,
            then its new tokens, sequences one after another. Without ``prefix_lens`` simply ``[T, Hkv, D]``.
            ``Hq % Hkv == 0``: query head ``h`` reads KV head ``h // (Hq // Hkv)``. ``D`` in ``HEAD_DIMS``.
        causal: new token ``i`` of sequence ``b`` (position ``prefix_lens[b] + i``) sees keys ``0..prefix + i``;
            ``False``: every key of its sequence.
        scale: softmax scale, default ``D ** -0.5``.
        gate: ``[T, Hq, D]`` or None: the output is multiplied by ``sigmoid(gate)`` (Qwen3-Next's output gate).
        cu_seqlens: int32 ``[B+1]`` query offsets (``0 ... T``), or None for one sequence. Read to the host once
            (it sizes the grid); the launch-only :func:`.triton_prefill.launch_prefill` avoids that sync.
        prefix_lens: int32 ``[B]`` cached tokens per sequence (chunked prefill), or None.

    Returns:
        ``[T, Hq, D]`` in q's dtype, contiguous.

    Example::

        cu = torch.tensor([0, 5, 12], dtype=torch.int32)                    # two sequences: 5 and 7 tokens
        o = flash_attention(q, k, v, gate=gate, cu_seqlens=cu)              # q, gate [12, 16, 256]; k, v [12, 2, 256]
    """
    return flash_attention_triton(q, k, v, causal, scale, gate, cu_seqlens, prefix_lens)


@runtime.op(reference=reference.decode_attention)
def decode_attention(q, k_cache, v_cache, seq_lens, block_table=None, scale=None, gate=None, *, num_splits=None):
    """One query token per sequence against its cached keys (flash-decoding: split-KV + log-sum-exp merge).

    Args:
        q: ``[B, Hq, D]`` bf16 / fp16 / fp32 (any row / head strides).
        k_cache, v_cache: q's dtype; contiguous ``[B', S_max, Hkv, D]`` (sequence ``b`` is row ``b``, ``B' >= B``)
            or, with ``block_table``, paged ``[num_blocks, PAGE, Hkv, D]`` with ``PAGE >= 16`` (any page size
            works in the kernel, which gathers keys one at a time; 16 is the documented and tested floor).
        seq_lens: int32 ``[B]`` cached tokens per sequence, the current token's included (write it first, e.g.
            with :func:`qk_norm_rope`). A length of 0 gives an output of zeros.
        block_table: int32 ``[B, max_blocks]``: page ``i`` of sequence ``b`` is block ``block_table[b, i]``.
        scale: softmax scale, default ``D ** -0.5``.
        gate: ``[B, Hq, D]`` or None: the output is multiplied by ``sigmoid(gate)``.
        num_splits: splits of each sequence (``1..256``); default :func:`default_num_splits`: from the cache
            capacity and the GPU's SM count, without reading ``seq_lens`` back, always a power of two (each distinct
            count compiles and autotunes its own kernel variant, so pass powers of two too).

    Returns:
        ``[B, Hq, D]`` in q's dtype.

    Example::

        o = decode_attention(q, k_cache, v_cache, seq_lens, block_table, gate=gate)   # q [8, 16, 256]
    """
    return decode_attention_triton(q, k_cache, v_cache, seq_lens, block_table, scale, gate, num_splits=num_splits)


@runtime.op(reference=reference.qk_norm_rope)
def qk_norm_rope(q, k, q_weight, k_weight, positions, *, v=None, rotary_dim=64, rope_theta=None, eps=1e-6,
                 cos=None, sin=None, k_cache=None, v_cache=None, slot_mapping=None):
    """Qwen3-Next's q_norm / k_norm ((1 + w) RMSNorm in fp32) then partial rotate_half RoPE, fused; optionally
    writes the new keys and values into a KV cache. Prefill and decode alike (decode: ``T = B``).

    Args:
        q: ``[T, Hq, D]`` bf16 / fp16 / fp32 (any row / head strides, e.g. :func:`split_q_gate`'s view).
        k: ``[T, Hkv, D]``, q's dtype.
        q_weight, k_weight: ``[D]`` the RMSNorm weights ``w`` (applied as ``1 + w``), bf16 / fp16 / fp32, each
            its own (both are used in fp32).
        positions: int32 / int64 ``[T]`` position of each token: in ``[0, cos.shape[0])`` with tables, in
            ``[0, 411768]`` with ``rope_theta`` (:data:`.spec.ROPE_THETA_MAX_POSITION`: the in-kernel angle
            reduction is exact below 2^16 turns; use tables beyond). Checked with one host read, skipped while a
            CUDA graph is being captured.
        v: ``[T, Hkv, D]``, needed for a cache write (copied, not transformed).
        rotary_dim: RoPE on dims ``0..rotary_dim-1`` (Qwen3-Next: 64 of 256), rotate_half convention.
        rope_theta: RoPE base from the checkpoint's config (Qwen3-Next-80B-A3B: 1e7): cos / sin are then
            computed in-kernel. Or give ``cos``, ``sin`` ``[max_position, rotary_dim]`` tables (HF layout
            ``cat(freqs, freqs)``, any float dtype; :func:`.reference.rope_cos_sin` builds them as HF does).
        eps: RMSNorm epsilon.
        k_cache, v_cache, slot_mapping: write ``k_out`` and ``v`` at flat slot ``slot_mapping[t]`` over the cache's
            first two dims (paged ``block * PAGE + offset``, contiguous ``b * S_max + pos``; ``-1`` skips); see
            :func:`paged_slots` / :func:`contiguous_slots`. Two caches sharing no element with each other or with
            an input (they may interleave in one buffer); each slot named at most once, checked with the range in
            the same host read.

    Returns:
        ``(q_out [T, Hq, D], k_out [T, Hkv, D])`` contiguous, in q's dtype, rounded once from fp32.

    Example::

        q, k = qk_norm_rope(q, k, attn.q_norm.weight, attn.k_norm.weight, positions, rotary_dim=64, rope_theta=1e7)
    """
    return qk_norm_rope_triton(q, k, q_weight, k_weight, positions, v=v, rotary_dim=rotary_dim,
                               rope_theta=rope_theta, eps=eps, cos=cos, sin=sin, k_cache=k_cache, v_cache=v_cache,
                               slot_mapping=slot_mapping)


@runtime.op(reference=reference.decode_plan)
def decode_plan(lengths, active, block_table, page_size, positions, kv_slots, seq_lens):
    """A decode step's plan for the paged KV cache, written in place, in one launch (the decoder's captured step
    computes it on the device, from its static buffers).

    Args:
        lengths: int64 ``[R]``, tokens cached per row before this step.
        active: bool ``[R]``, the rows that take part.
        block_table: int32 / int64 ``[>= R, W]``: page ``i`` of row ``r`` is block ``block_table[r, i]``.
        page_size: tokens a page.
        positions: int64 ``[R]`` out: ``lengths``, the new token's position.
        kv_slots: int64 ``[R]`` out: where the new key goes (``block * page_size + offset``), -1 for an
            inactive row.
        seq_lens: int32 / int64 ``[R]`` out: ``lengths + 1`` (the keys attention reads), 0 for an inactive row.

    Example::

        decode_plan(step.lengths, step.active, cache.block_table, cache.page_size, step.positions,
                    step.kv_slots, step.seq_lens)
    """
    decode_plan_triton(lengths, active, block_table, page_size, positions, kv_slots, seq_lens)


__all__ = ["flash_attention", "decode_attention", "qk_norm_rope", "decode_plan", "reference", "spec", "split_q_gate",
           "paged_slots", "contiguous_slots", "default_num_splits", "HEAD_DIMS"]
