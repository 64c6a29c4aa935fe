"""Layouts and argument checks shared by the attention kernels and their references.

Every public op and its reference run the same checks, so a bad call fails the same way on every backend, with an
error naming the tensor, what was expected and what was found. As in the rest of the project
(``nvfp4``, ``matmul``, ``deltanet``): ``TypeError`` for a wrong type or dtype, ``ValueError`` for a wrong shape,
value or device.

Layouts (docs/attention.md has the pictures):

* packed variable-length batch: ``q [T, Hq, D]``, sequence ``b`` is rows ``cu_seqlens[b]:cu_seqlens[b+1]``;
* chunked prefill: ``k, v [T + sum(prefix_lens), Hkv, D]``, sequence ``b`` holds its ``prefix_lens[b]`` cached keys
  followed by its new keys, packed one sequence after another (``cu_seqlens_k = cu_seqlens + cumsum(prefix)``);
* KV cache, contiguous: ``[B, S_max, Hkv, D]``; paged: ``[num_blocks, PAGE, Hkv, D]`` with
  ``block_table [B, max_blocks]`` (int32) mapping logical page ``i`` of sequence ``b`` to a physical block;
* cache slots: a flat index over the cache's first two dims (``block * PAGE + offset`` for a paged cache,
  ``b * S_max + position`` for a contiguous one), ``-1`` meaning "do not write".
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from .. import runtime
from ..norm.spec import overlaps

#: Head dims the kernels are built for (``tl.dot`` needs >= 16; powers of two keep tiles unmasked along D).
HEAD_DIMS = (16, 32, 64, 128, 256)
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)
#: Smallest page of a paged cache: a documented floor, not a kernel limit. The decode kernel computes one address per
#: key (block-table entry, offset in the page), so no tile shape depends on the page size; 16 is what the paged-cache
#: requirement asked for (block sizes of 16 or more, vLLM's default) and the smallest size the tests cover.
MIN_PAGE = 16
#: Largest position the in-kernel RoPE (``rope_theta``, no tables) accepts: its Cody-Waite reduction of the angle
#: ``position * inv_freq`` (``inv_freq[0] = 1``) is exact while the angle is under ``2^16 - 1`` turns of 2 pi.
ROPE_THETA_MAX_POSITION = int((2**16 - 1) * 2 * math.pi)           # 411,768


def _shape(t: torch.Tensor) -> tuple:
    return tuple(t.shape)


def check_tensor(name: str, t, ndim: int, dtypes=FLOAT_DTYPES) -> None:
    """``t`` is a tensor with ``ndim`` dims and one of ``dtypes``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, found {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, found shape {_shape(t)}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {[str(d)[6:] for d in dtypes]}, found {str(t.dtype)[6:]}")


def check_same(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor, dims=None) -> None:
    """``t`` has ``ref``'s dtype and (all, or the listed ``dims`` of) its shape."""
    if t.dtype != ref.dtype:
        raise TypeError(f"{name} must have the dtype of {ref_name} ({str(ref.dtype)[6:]}), found {str(t.dtype)[6:]}")
    got = _shape(t) if dims is None else tuple(t.shape[d] for d in dims)
    want = _shape(ref) if dims is None else tuple(ref.shape[d] for d in dims)
    if got != want:
        which = "shape" if dims is None else f"dims {tuple(dims)}"
        raise ValueError(f"{name} must match {ref_name} in {which}: expected {want}, found {got} "
                         f"(shape {_shape(t)})")


def check_heads(q_name: str, hq: int, k_name: str, hkv: int, d: int) -> None:
    if hkv < 1 or hq % hkv:
        raise ValueError(f"{q_name} has {hq} heads, which is not a multiple of the {hkv} heads of {k_name} (GQA needs "
                         f"Hq % Hkv == 0)")
    if d not in HEAD_DIMS:
        raise ValueError(f"{q_name} has head dim {d}; supported head dims are {HEAD_DIMS}")


def check_devices(**tensors) -> None:
    """Every tensor is on the device the kernels run on (the reference backend skips this)."""
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor):
            runtime.check_device(name, t)


def check_same_device(ref_name: str, ref: torch.Tensor, **tensors) -> None:
    """Every given tensor (None skipped) is on ``ref``'s device: checked on every backend, before any value is read."""
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.device != ref.device:
            raise ValueError(f"{name} is on {t.device} but {ref_name} is on {ref.device}; all tensors must share a "
                             f"device")


def check_scale(scale) -> None:
    """The softmax scale: None (``D ** -0.5``) or a positive finite Python number."""
    if scale is None:
        return
    if isinstance(scale, (torch.Tensor, bool)) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a positive finite Python number or None (D ** -0.5), found "
                        f"{type(scale).__name__} {scale!r}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite Python number or None (D ** -0.5), found {scale!r}")


def check_unit_head_stride(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Caches are written or read in place, never copied: unit stride along the head dim."""
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs unit stride along the head dim (copying a cache is never silent), found "
                             f"strides {tuple(t.stride())}")




def last_dim_contiguous(t: torch.Tensor | None) -> torch.Tensor | None:
    """Kernels take any row / head strides but need unit stride along the head dim."""
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


# ---------------------------------------------------------------------------------------------------------------
# prefill


@dataclass(frozen=True)
class Varlen:
    """A checked variable-length batch: per-sequence query and key offsets on the host and on the device."""

    cu_q: list[int]            #: [B+1] query row offsets
    cu_k: list[int]            #: [B+1] key row offsets (prefix included)
    prefix: list[int]          #: [B] cached keys before each sequence's new tokens
    cu_q_t: torch.Tensor       #: cu_q as int32 on the inputs' device
    cu_k_t: torch.Tensor       #: cu_k as int32 on the inputs' device

    @property
    def batch(self) -> int:
        return len(self.prefix)

    @property
    def max_q(self) -> int:
        return max((b - a for a, b in zip(self.cu_q, self.cu_q[1:])), default=0)


def check_prefill(q, k, v, gate, cu_seqlens, prefix_lens, *, causal=True, scale=None) -> Varlen:
    """Check :func:`flash_attention`'s arguments; return the batch layout (reads ``cu_seqlens`` to the host)."""
    check_tensor("q", q, 3)
    check_tensor("k", k, 3)
    check_tensor("v", v, 3)
    check_same("k", k, "q", q, dims=(2,))
    check_same("v", v, "k", k)
    check_heads("q", q.shape[1], "k", k.shape[1], q.shape[2])
    if gate is not None:
        check_tensor("gate", gate, 3)
        check_same("gate", gate, "q", q)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, found {type(causal).__name__} {causal!r}")
    check_scale(scale)
    check_same_device("q", q, k=k, v=v, gate=gate, cu_seqlens=cu_seqlens, prefix_lens=prefix_lens)
    t = q.shape[0]
    if cu_seqlens is None:
        cu_q = [0, t]
    else:
        check_tensor("cu_seqlens", cu_seqlens, 1, INDEX_DTYPES)
        if cu_seqlens.numel() < 2:
            raise ValueError(f"cu_seqlens must have B+1 >= 2 entries, found shape {_shape(cu_seqlens)}")
        cu_q = list(runtime.host_ints(cu_seqlens))
        if cu_q[0] != 0 or cu_q[-1] != t or any(b < a for a, b in zip(cu_q, cu_q[1:])):
            raise ValueError(f"cu_seqlens must start at 0, never decrease and end at T = q.shape[0] = {t}; "
                             f"found {cu_q if len(cu_q) <= 12 else cu_q[:6] + ['...'] + cu_q[-3:]}")
    batch = len(cu_q) - 1
    if prefix_lens is None:
        prefix = [0] * batch
    else:
        check_tensor("prefix_lens", prefix_lens, 1, INDEX_DTYPES)
        if prefix_lens.numel() != batch:
            raise ValueError(f"prefix_lens must have one entry per sequence: expected shape ({batch},), "
                             f"found {_shape(prefix_lens)}")
        prefix = list(runtime.host_ints(prefix_lens))
        if any(p < 0 for p in prefix):
            raise ValueError(f"prefix_lens must be >= 0, found {prefix}")
    want_k = t + sum(prefix)
    if k.shape[0] != want_k:
        extra = " (q's tokens plus the prefix_lens cached tokens, packed per sequence)" if prefix_lens is not None \
            else " (the same tokens as q)"
        raise ValueError(f"k must have {want_k} rows{extra}, found shape {_shape(k)}")
    cu_k = [0]
    for b in range(batch):
        cu_k.append(cu_k[-1] + prefix[b] + cu_q[b + 1] - cu_q[b])
    return Varlen(cu_q, cu_k, prefix, _offsets(tuple(cu_q), q.device), _offsets(tuple(cu_k), q.device))


@functools.lru_cache(maxsize=256)
def _offsets(values: tuple, device: torch.device) -> torch.Tensor:
    """``values`` as an int32 tensor on ``device``, built once: a host-to-device copy from pageable memory waits for
    the stream, so building it on every call would stall the GPU between back-to-back prefills. Read-only."""
    return torch.tensor(values, dtype=torch.int32, device=device)


# ---------------------------------------------------------------------------------------------------------------
# decode


@dataclass(frozen=True)
class Cache:
    """A checked KV cache: ``capacity`` tokens per sequence; ``page`` rows per block (``S_max`` when contiguous)."""

    paged: bool
    page: int
    capacity: int


def check_cache_pair(k_cache, v_cache) -> None:
    check_tensor("k_cache", k_cache, 4)
    check_tensor("v_cache", v_cache, 4)
    check_same("v_cache", v_cache, "k_cache", k_cache)


#: The most splits of one sequence in :func:`decode_attention` (the merge kernel's tile is [MAX_SPLITS, D]).
MAX_SPLITS = 256


def check_decode(q, k_cache, v_cache, seq_lens, block_table, gate, *, scale=None, num_splits=None) -> Cache:
    """Check :func:`decode_attention`'s arguments; return the cache layout."""
    check_tensor("q", q, 3)
    check_cache_pair(k_cache, v_cache)
    if k_cache.dtype != q.dtype:
        raise TypeError(f"k_cache must have the dtype of q ({str(q.dtype)[6:]}), found {str(k_cache.dtype)[6:]}")
    if k_cache.shape[3] != q.shape[2]:
        raise ValueError(f"k_cache must have q's head dim {q.shape[2]} in dim 3, found shape {_shape(k_cache)}")
    check_heads("q", q.shape[1], "k_cache", k_cache.shape[2], q.shape[2])
    if gate is not None:
        check_tensor("gate", gate, 3)
        check_same("gate", gate, "q", q)
    b = q.shape[0]
    check_tensor("seq_lens", seq_lens, 1, INDEX_DTYPES)
    if seq_lens.numel() != b:
        raise ValueError(f"seq_lens must have one entry per sequence of q: expected shape ({b},), "
                         f"found {_shape(seq_lens)}")
    if block_table is None:
        if k_cache.shape[0] < b:
            raise ValueError(f"k_cache (contiguous [B, S_max, Hkv, D]) must have at least B = {b} rows in dim 0, "
                             f"found shape {_shape(k_cache)}")
        cache = Cache(paged=False, page=k_cache.shape[1], capacity=k_cache.shape[1])
    else:
        check_tensor("block_table", block_table, 2, (torch.int32,))
        if block_table.shape[0] != b:
            raise ValueError(f"block_table must have B = {b} rows, found shape {_shape(block_table)}")
        page = k_cache.shape[1]
        if page < MIN_PAGE:
            raise ValueError(f"k_cache (paged [num_blocks, PAGE, Hkv, D]) needs PAGE >= {MIN_PAGE}, "
                             f"found shape {_shape(k_cache)}")
        cache = Cache(paged=True, page=page, capacity=page * block_table.shape[1])
    check_scale(scale)
    if num_splits is not None and (not isinstance(num_splits, int) or isinstance(num_splits, bool)):
        raise TypeError(f"num_splits must be an int in [1, {MAX_SPLITS}] or None, found {type(num_splits).__name__}")
    if num_splits is not None and not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be an int in [1, {MAX_SPLITS}], found {num_splits!r}")
    check_unit_head_stride(k_cache, v_cache)
    check_same_device("q", q, k_cache=k_cache, v_cache=v_cache, seq_lens=seq_lens, block_table=block_table,
                      gate=gate)
    if runtime.values_checkable() and b:
        lo, hi = int(seq_lens.min()), int(seq_lens.max())
        if lo < 0 or hi > cache.capacity:
            raise ValueError(f"seq_lens must lie in [0, {cache.capacity}] (the cache's capacity per sequence), "
                             f"found min {lo}, max {hi}")
        if block_table is not None and block_table.numel():
            used = torch.arange(block_table.shape[1], device=block_table.device)[None, :] * cache.page \
                < seq_lens.to(block_table.device)[:, None]
            pages = block_table[used]
            if pages.numel() and (int(pages.min()) < 0 or int(pages.max()) >= k_cache.shape[0]):
                raise ValueError(f"block_table entries in use must lie in [0, {k_cache.shape[0]}) (k_cache's "
                                 f"blocks), found min {int(pages.min())}, max {int(pages.max())}")
    return cache


# ---------------------------------------------------------------------------------------------------------------
# qk norm + rope


def check_rope(q, k, q_weight, k_weight, positions, v, rotary_dim, rope_theta, cos, sin, k_cache, v_cache,
               slot_mapping, *, eps=1e-6) -> None:
    """Check :func:`qk_norm_rope`'s arguments."""
    check_tensor("q", q, 3)
    check_tensor("k", k, 3)
    check_same("k", k, "q", q, dims=(0, 2))
    if k.dtype != q.dtype:
        raise TypeError(f"k must have the dtype of q ({str(q.dtype)[6:]}), found {str(k.dtype)[6:]}")
    d = q.shape[2]
    check_heads("q", q.shape[1], "k", k.shape[1], d)
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        check_tensor(name, w, 1)
        if w.shape[0] != d:
            raise ValueError(f"{name} must have shape ({d},) (the head dim), found {_shape(w)}")
    check_tensor("positions", positions, 1, INDEX_DTYPES)
    if positions.shape[0] != q.shape[0]:
        raise ValueError(f"positions must have one entry per token: expected shape ({q.shape[0]},), "
                         f"found {_shape(positions)}")
    if not isinstance(rotary_dim, int) or isinstance(rotary_dim, bool):
        raise TypeError(f"rotary_dim must be an even int in (0, {d}], found {type(rotary_dim).__name__} "
                        f"{rotary_dim!r}")
    if not (0 < rotary_dim <= d and rotary_dim % 2 == 0):
        raise ValueError(f"rotary_dim must be an even int in (0, {d}], found {rotary_dim!r}")
    if (cos is None) != (sin is None):
        raise ValueError("give both cos and sin tables, or neither (then rope_theta)")
    if isinstance(eps, (torch.Tensor, bool)) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps must be a positive finite Python number, found {type(eps).__name__} {eps!r}")
    if not (math.isfinite(eps) and eps > 0):                        # eps = 0 gives NaN on an all-zero row
        raise ValueError(f"eps must be a positive finite Python number (an all-zero row divides by sqrt(eps)), "
                         f"found {eps!r}")
    if cos is None:
        if (isinstance(rope_theta, (torch.Tensor, bool)) or not isinstance(rope_theta, (int, float))
                or not (math.isfinite(rope_theta) and rope_theta > 0)):
            raise ValueError(f"rope_theta must be a positive float, finite (e.g. the checkpoint's rope_theta), when "
                             f"no cos/sin tables are given, found {rope_theta!r}")
    else:
        for name, t in (("cos", cos), ("sin", sin)):
            check_tensor(name, t, 2)
            if t.shape[1] != rotary_dim:
                raise ValueError(f"{name} must have shape [max_position, rotary_dim = {rotary_dim}], "
                                 f"found {_shape(t)}")
        check_same("sin", sin, "cos", cos)
    if v is not None:
        check_tensor("v", v, 3)
        check_same("v", v, "k", k)
    wants_cache = (k_cache, v_cache, slot_mapping)
    if any(x is not None for x in wants_cache):
        if any(x is None for x in wants_cache) or v is None:
            raise ValueError("a cache write needs all of v, k_cache, v_cache and slot_mapping")
        check_cache_pair(k_cache, v_cache)
        if k_cache.dtype != k.dtype:
            raise TypeError(f"k_cache must have the dtype of k ({str(k.dtype)[6:]}), found {str(k_cache.dtype)[6:]}")
        if tuple(k_cache.shape[2:]) != tuple(k.shape[1:]):
            raise ValueError(f"k_cache must be [*, *, {k.shape[1]}, {d}] like k, found {_shape(k_cache)}")
        check_tensor("slot_mapping", slot_mapping, 1, INDEX_DTYPES)
        if slot_mapping.shape[0] != q.shape[0]:
            raise ValueError(f"slot_mapping must have one entry per token: expected shape ({q.shape[0]},), "
                             f"found {_shape(slot_mapping)}")
        check_unit_head_stride(k_cache, v_cache)
        if overlaps(k_cache, v_cache):
            raise ValueError("k_cache and v_cache share memory; pass two separate caches (keys and values written to "
                             "the same memory overwrite each other)")
        for cache_name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
            for name, t in (("q", q), ("k", k), ("v", v), ("q_weight", q_weight), ("k_weight", k_weight),
                            ("positions", positions), ("cos", cos), ("sin", sin), ("slot_mapping", slot_mapping)):
                if t is not None and overlaps(cache, t):
                    raise ValueError(f"{cache_name} shares memory with {name}; the caches are written while the "
                                     f"inputs are read, so they must not alias them")
    check_same_device("q", q, k=k, v=v, q_weight=q_weight, k_weight=k_weight, positions=positions, cos=cos, sin=sin,
                      k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    if slot_mapping is not None:                                    # then the whole cache write was checked above
        n_slots = k_cache.shape[0] * k_cache.shape[1]
        if runtime.values_checkable() and slot_mapping.numel():
            lo, hi, twice = _slot_stats(slot_mapping)
            if lo < -1 or hi >= n_slots:
                raise ValueError(f"slot_mapping must lie in [-1, {n_slots}) (-1 skips a token), "
                                 f"found min {lo}, max {hi}")
            if twice >= 0:                                          # which of two writes lands is unspecified
                tokens = (slot_mapping == twice).nonzero().flatten().tolist()
                raise ValueError(f"slot_mapping must name each cache slot at most once (-1 excepted), found slot "
                                 f"{twice} at tokens {tokens}")
    if runtime.values_checkable() and positions.numel():                        # one host sync, like slot_mapping's
        lo, hi = _min_max(positions)
        if cos is not None and (lo < 0 or hi >= cos.shape[0]):
            raise ValueError(f"positions must lie in [0, {cos.shape[0]}) (the rows of the cos / sin tables), "
                             f"found min {lo}, max {hi}")
        if cos is None and (lo < 0 or hi > ROPE_THETA_MAX_POSITION):
            raise ValueError(f"positions must lie in [0, {ROPE_THETA_MAX_POSITION}] with rope_theta (the in-kernel "
                             f"angle reduction is exact below 2^16 turns); pass cos / sin tables for longer "
                             f"contexts; found min {lo}, max {hi}")


def _min_max(t: torch.Tensor) -> tuple[int, int]:
    """``(min, max)`` of a non-empty integer tensor, read back in one host sync."""
    lo, hi = torch.aminmax(t)
    return tuple(int(x) for x in torch.stack((lo, hi)).tolist())


def _slot_stats(slots: torch.Tensor) -> tuple[int, int, int]:
    """``(min, max, a slot >= 0 that occurs twice or -1)`` of a non-empty slot mapping, read back in one host sync."""
    s = slots.sort().values
    twice = torch.cat((s.new_full((1,), -1), torch.where((s[1:] == s[:-1]) & (s[1:] >= 0), s[1:], -1)))
    return tuple(int(x) for x in torch.stack((s[0], s[-1], twice.max())).tolist())


# ---------------------------------------------------------------------------------------------------------------
# helpers for callers


def _need_positive_int(name: str, n, what: str) -> None:
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"{name} must be a positive Python int ({what}), found {type(n).__name__} {n!r}")
    if n < 1:
        raise ValueError(f"{name} must be a positive Python int ({what}), found {n}")


def split_q_gate(q_proj_out: torch.Tensor, num_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views ``(q, gate)``, each ``[T, Hq, D]``, of a gated-attention ``q_proj`` output ``[T, Hq * 2 * D]``.

    Qwen3-Next emits ``[query | gate]`` per head (HF ``chunk(2, dim=-1)`` on ``view(T, Hq, 2 D)``); the kernels read
    both views in place through their strides, no copy.
    """
    check_tensor("q_proj_out", q_proj_out, 2)
    _need_positive_int("num_heads", num_heads, "Hq")
    _need_positive_int("head_dim", head_dim, "D")
    width = num_heads * 2 * head_dim
    if q_proj_out.shape[1] != width:
        raise ValueError(f"q_proj_out must be [T, num_heads * 2 * head_dim] = [T, {num_heads} * 2 * {head_dim}] = "
                         f"[T, {width}] ([query | gate] per head), found shape {_shape(q_proj_out)}")
    x = q_proj_out.view(q_proj_out.shape[0], num_heads, 2 * head_dim)
    return x[..., :head_dim], x[..., head_dim:]


def _check_slot_indices(seq_idx, positions, ref_name: str, ref: torch.Tensor) -> None:
    """``seq_idx`` and ``positions``: 1-D integer tensors of one length on ``ref``'s device."""
    check_tensor("seq_idx", seq_idx, 1, INDEX_DTYPES)
    check_tensor("positions", positions, 1, INDEX_DTYPES)
    if positions.shape[0] != seq_idx.shape[0]:
        raise ValueError(f"positions must have one entry per entry of seq_idx: expected shape ({seq_idx.shape[0]},), "
                         f"found {_shape(positions)}")
    check_same_device(ref_name, ref, seq_idx=seq_idx, positions=positions)


def contiguous_slots(seq_idx: torch.Tensor, positions: torch.Tensor, max_len: int) -> torch.Tensor:
    """Cache slots for a contiguous ``[B, S_max, Hkv, D]`` cache: ``seq_idx * S_max + positions`` (int64).

    ``seq_idx``, ``positions``: int32 / int64 ``[N]``; ``max_len``: ``S_max``. Outside :func:`lynn_kernels.trusted`
    (and a CUDA graph capture) the values are checked, one host sync: ``seq_idx >= 0``, ``0 <= positions < S_max``.
    """
    _check_slot_indices(seq_idx, positions, "seq_idx", seq_idx)
    _need_positive_int("max_len", max_len, "S_max, the cache's rows per sequence")
    seq, pos = seq_idx.long(), positions.long()
    if runtime.values_checkable() and seq.numel():
        s_lo, p_lo, p_hi = (int(x) for x in torch.stack((seq.min(), pos.min(), pos.max())).tolist())
        if s_lo < 0:
            raise ValueError(f"seq_idx must be >= 0 (a row of the cache), found min {s_lo}")
        if p_lo < 0 or p_hi >= max_len:
            raise ValueError(f"positions must lie in [0, max_len) = [0, {max_len}), found min {p_lo}, max {p_hi}")
    return seq * max_len + pos


def paged_slots(block_table: torch.Tensor, seq_idx: torch.Tensor, positions: torch.Tensor, page: int) -> torch.Tensor:
    """Cache slots for a paged ``[num_blocks, PAGE, Hkv, D]`` cache: ``block * PAGE + position % PAGE`` (int64).

    ``block_table``: int32 / int64 ``[B, max_blocks]``; ``seq_idx``, ``positions``: int32 / int64 ``[N]`` on its
    device; ``page``: ``PAGE``. No value is read back (the model's step plans its slots with it): a ``seq_idx``
    outside ``[0, B)`` or a position outside ``[0, max_blocks * PAGE)`` fails the block-table lookup, which on the CPU
    raises a ``ValueError`` naming it, and on a GPU is a device-side assert.
    """
    check_tensor("block_table", block_table, 2, INDEX_DTYPES)
    _check_slot_indices(seq_idx, positions, "block_table", block_table)
    _need_positive_int("page", page, "PAGE, the cache's rows per block")
    rows, width = block_table.shape
    seq, pos = seq_idx.long(), positions.long()
    # a negative index would wrap around silently: send it past the end, where the lookup refuses it
    row = torch.where(seq < 0, rows, seq)
    col = torch.where(pos < 0, width, pos // page)
    try:
        blocks = block_table[row, col].long()
    except IndexError:
        _refuse_slot_indices(seq, pos, rows, width, page)
        raise
    return blocks * page + pos % page


def _refuse_slot_indices(seq: torch.Tensor, pos: torch.Tensor, rows: int, width: int, page: int) -> None:
    """On the error path of :func:`paged_slots` only (it reads the indices back): name the one out of range."""
    s_lo, s_hi, p_lo, p_hi = (int(x) for x in torch.stack((seq.min(), seq.max(), pos.min(), pos.max())).tolist())
    if s_lo < 0 or s_hi >= rows:
        raise ValueError(f"seq_idx must lie in [0, {rows}) (block_table's rows), found min {s_lo}, max {s_hi}")
    if p_lo < 0 or p_hi >= width * page:
        raise ValueError(f"positions must lie in [0, {width * page}) (block_table's {width} blocks of page {page}), "
                         f"found min {p_lo}, max {p_hi}")


# ---------------------------------------------------------------------------------------------------------------
# the decode step's plan


def check_decode_plan(lengths, active, block_table, page_size, positions, kv_slots, seq_lens) -> int:
    """:func:`lynn_kernels.attention.decode_plan`'s arguments: ``lengths`` int64 ``[R]`` (tokens cached per row,
    >= 0), ``active`` bool ``[R]``, ``block_table`` int32 / int64 ``[R', W]`` (``R' >= R``, unit stride along W),
    ``page_size`` a positive int, and the outputs ``positions`` int64, ``kv_slots`` int64 and ``seq_lens`` int32 /
    int64, each ``[R]`` and contiguous. Returns R. No value is read back (the step runs inside a CUDA graph)."""
    for name, t in (("lengths", lengths), ("active", active), ("block_table", block_table),
                    ("positions", positions), ("kv_slots", kv_slots), ("seq_lens", seq_lens)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device != lengths.device:
            raise ValueError(f"{name} is on {t.device} but lengths is on {lengths.device}")
    if lengths.dim() != 1 or lengths.dtype != torch.int64:
        raise TypeError(f"lengths must be int64 [R], found {lengths.dtype} of shape {tuple(lengths.shape)}")
    R = lengths.shape[0]
    if tuple(active.shape) != (R,) or active.dtype != torch.bool:
        raise TypeError(f"active must be bool [{R}] (lengths' rows), found {active.dtype} of shape "
                        f"{tuple(active.shape)}")
    if block_table.dim() != 2 or block_table.shape[0] < R or block_table.shape[1] < 1 or \
            block_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_table must be int32 / int64 [>= {R}, >= 1], found {block_table.dtype} of shape "
                         f"{tuple(block_table.shape)}")
    if block_table.stride(1) != 1:
        raise ValueError(f"block_table must have unit stride along its pages, found strides "
                         f"{tuple(block_table.stride())}")
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    for name, t, dtypes in (("positions", positions, (torch.int64,)), ("kv_slots", kv_slots, (torch.int64,)),
                            ("seq_lens", seq_lens, (torch.int32, torch.int64))):
        if tuple(t.shape) != (R,) or t.dtype not in dtypes or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous [{R}] tensor of dtype in {list(dtypes)}, found "
                             f"{t.dtype} of shape {tuple(t.shape)}")
    return R
