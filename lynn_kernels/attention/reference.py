"""The executable spec of Qwen3-Next's gated attention in plain fp32 torch: prefill, decode, QK norm + RoPE.

Each function takes the same arguments as its kernel and returns the same thing (outputs in ``q``'s dtype); the math
is HF transformers' ``Qwen3NextAttention`` (``models/qwen3_next/modeling_qwen3_next.py``) done in fp32 throughout and
rounded once at the end. Layouts are described in :mod:`.spec` and docs/attention.md.
"""

from __future__ import annotations

import torch

from . import spec
from .spec import check_decode, check_prefill, check_rope

# ---------------------------------------------------------------------------------------------------------------
# attention


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, first_pos: int | None) -> torch.Tensor:
    """fp32 softmax attention of ``q [n, Hq, D]`` over ``k, v [L, Hkv, D]``; query ``i`` sits at position
    ``first_pos + i`` and sees keys ``0..first_pos + i`` (``first_pos=None``: every key). No keys gives zeros."""
    n, hq, _ = q.shape
    if k.shape[0] == 0:
        return q.new_zeros(q.shape)
    group = hq // k.shape[1]
    k = k.repeat_interleave(group, dim=1)                      # query head h reads KV head h // group
    v = v.repeat_interleave(group, dim=1)
    s = torch.einsum("nhd,lhd->hnl", q, k) * scale             # [Hq, n, L]
    if first_pos is not None:
        q_pos = first_pos + torch.arange(n, device=q.device)
        s = s.masked_fill(torch.arange(k.shape[0], device=q.device)[None, :] > q_pos[:, None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", s.softmax(-1), v)


def flash_attention(q, k, v, causal=True, scale=None, gate=None, cu_seqlens=None, prefix_lens=None):
    """Reference of :func:`lynn_kernels.attention.flash_attention` (same arguments, same result)."""
    lay = check_prefill(q, k, v, gate, cu_seqlens, prefix_lens, causal=causal, scale=scale)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for b in range(lay.batch):
        qs, ks = slice(lay.cu_q[b], lay.cu_q[b + 1]), slice(lay.cu_k[b], lay.cu_k[b + 1])
        out[qs] = _attend(q[qs].float(), k[ks].float(), v[ks].float(), scale, lay.prefix[b] if causal else None)
    if gate is not None:
        out = out * torch.sigmoid(gate.float())
    return out.to(q.dtype)


def gather_cache(cache: torch.Tensor, b: int, length: int, block_table=None) -> torch.Tensor:
    """The first ``length`` tokens of sequence ``b``, ``[length, Hkv, D]``, from a contiguous or paged cache."""
    if block_table is None:
        return cache[b, :length]
    pos = torch.arange(length, device=cache.device)
    page = cache.shape[1]
    return cache[block_table[b, pos // page].long(), pos % page]


def decode_attention(q, k_cache, v_cache, seq_lens, block_table=None, scale=None, gate=None, *, num_splits=None):
    """Reference of :func:`lynn_kernels.attention.decode_attention` (``num_splits`` does not change the math)."""
    check_decode(q, k_cache, v_cache, seq_lens, block_table, gate, scale=scale, num_splits=num_splits)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for b, length in enumerate(seq_lens.tolist()):
        k = gather_cache(k_cache, b, length, block_table).float()
        v = gather_cache(v_cache, b, length, block_table).float()
        out[b] = _attend(q[b:b + 1].float(), k, v, scale, None)[0]
    if gate is not None:
        out = out * torch.sigmoid(gate.float())
    return out.to(q.dtype)


# ---------------------------------------------------------------------------------------------------------------
# QK norm + partial RoPE + cache write


def rope_inv_freq(rotary_dim: int, theta: float, device=None) -> torch.Tensor:
    """``[rotary_dim / 2]`` fp32 inverse frequencies, computed as HF's ``compute_default_rope_parameters``."""
    return (1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))).to(device)


def rope_cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each ``[len(positions), rotary_dim]`` fp32, as HF's ``Qwen3NextRotaryEmbedding.forward``
    (``cat(freqs, freqs)``). ``rope_cos_sin(torch.arange(P), ...)`` builds the tables :func:`qk_norm_rope` takes."""
    freqs = positions.float()[:, None] * rope_inv_freq(rotary_dim, theta, positions.device)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rms_norm_1p(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3-Next RMSNorm in fp32: ``x * rsqrt(mean(x^2) + eps) * (1 + w)`` over the last dim."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.float())


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """rotate_half RoPE on the first ``cos.shape[-1]`` dims of ``x [T, H, D]`` (``cos, sin [T, R]``), fp32."""
    r = cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    half = torch.cat((-rot[..., r // 2:], rot[..., : r // 2]), dim=-1)
    return torch.cat((rot * cos[:, None, :] + half * sin[:, None, :], rest), dim=-1)


def qk_norm_rope(q, k, q_weight, k_weight, positions, *, v=None, rotary_dim=64, rope_theta=None, eps=1e-6,
                 cos=None, sin=None, k_cache=None, v_cache=None, slot_mapping=None):
    """Reference of :func:`lynn_kernels.attention.qk_norm_rope`: returns ``(q_out, k_out)`` and, given a cache,
    writes ``k_out`` and ``v`` into ``k_cache`` / ``v_cache`` at ``slot_mapping`` (``-1`` skips a token)."""
    check_rope(q, k, q_weight, k_weight, positions, v, rotary_dim, rope_theta, cos, sin, k_cache, v_cache,
               slot_mapping, eps=eps)
    if cos is None:
        cos, sin = rope_cos_sin(positions, rotary_dim, rope_theta)
    else:
        cos, sin = cos[positions.long()].float(), sin[positions.long()].float()
    q_out = apply_rope(rms_norm_1p(q, q_weight, eps), cos, sin).to(q.dtype)
    k_out = apply_rope(rms_norm_1p(k, k_weight, eps), cos, sin).to(k.dtype)
    if k_cache is not None:
        keep = slot_mapping >= 0
        slots = slot_mapping[keep].long()
        page = k_cache.shape[1]
        k_cache[slots // page, slots % page] = k_out[keep]
        v_cache[slots // page, slots % page] = v[keep]
    return q_out, k_out


__all__ = ["flash_attention", "decode_attention", "qk_norm_rope", "gather_cache", "rope_inv_freq", "rope_cos_sin",
           "rms_norm_1p", "apply_rope"]


def decode_plan(lengths, active, block_table, page_size, positions, kv_slots, seq_lens) -> None:
    """A decode step's plan for the paged KV cache, into ``positions``, ``kv_slots`` and ``seq_lens`` ``[R]``: row
    ``r`` with ``lengths[r]`` cached tokens writes its new token at position ``lengths[r]``, into cache slot
    ``block_table[r, page] * page_size + lengths[r] % page_size`` with ``page = min(lengths[r] // page_size, W -
    1)``, and attends over ``lengths[r] + 1`` tokens; an inactive row writes nowhere (slot -1) and attends to
    nothing (length 0)."""
    spec.check_decode_plan(lengths, active, block_table, page_size, positions, kv_slots, seq_lens)
    pos = lengths
    width = block_table.shape[1]
    block = block_table[:lengths.shape[0]].gather(1, (pos // page_size).clamp_max(width - 1)[:, None])[:, 0]
    positions.copy_(pos)
    kv_slots.copy_(torch.where(active, block.to(torch.int64) * page_size + pos % page_size, -1))
    seq_lens.copy_(torch.where(active, pos + 1, 0))
