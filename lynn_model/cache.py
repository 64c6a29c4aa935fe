"""What the decoder keeps between calls, per sequence: a paged KV cache for the attention layers, and the conv and
fp32 recurrent states of the Gated DeltaNet layers; plus :class:`Batch`, one forward call's positions and offsets.

A sequence holds one *slot* (a row of the state buffers and of the block table) from :meth:`Cache.add` to
:meth:`Cache.release`. Its keys and values live in pages of ``page_size`` tokens drawn from one pool shared by all
sequences; every attention layer has its own pool tensors, indexed by the same block table. Running out of pages or
slots raises :class:`CacheFull` before anything is written.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lynn_kernels.attention import paged_slots
from lynn_kernels.runtime import remember_ints

from .config import Config

MIN_PAGE = 16


class CacheFull(RuntimeError):
    """The cache cannot hold what a call asks for (no free slot, or not enough pages)."""


@dataclass
class Batch:
    """One forward call: ``N`` sequences contributing ``new_lens[b]`` tokens each, packed into ``T`` rows.

    ``positions`` int64 ``[T]``; ``cu_seqlens`` int32 ``[N + 1]`` (None for one sequence); ``prefix_lens`` the tokens
    each sequence already had (host ints and int32 ``[N]``). With a cache: ``kv_slots`` int64 ``[T]`` (where each new
    key goes), ``rows`` the state rows (a ``slice`` when they are consecutive, else an int64 index), and for decode
    ``seq_lens`` int32 ``[N]`` (after this token) and ``block_table`` ``[N, max_blocks]``; for a prefill that
    continues cached sequences, ``kv_gather`` int64: the cache slots of every sequence's keys, prefix first. An
    *unrolled* decode (``unroll`` = U > 1 tokens per sequence: a speculative verify) gives each of its ``N U`` rows
    its own ``seq_lens`` entry and ``block_table`` row, so every token attends exactly as its own decode step would.
    """

    new_lens: list[int]
    prefix_lens: list[int]
    positions: torch.Tensor
    cu_seqlens: torch.Tensor | None
    prefix_lens_t: torch.Tensor | None = None
    decode: bool = False
    kv_slots: torch.Tensor | None = None
    rows: slice | torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    block_table: torch.Tensor | None = None
    kv_gather: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    valid_len: torch.Tensor | None = None
    unroll: int = 1            #: tokens per sequence of an unrolled decode step (rows sequence-major)

    @property
    def num_tokens(self) -> int:
        return sum(self.new_lens)

    @property
    def has_prefix(self) -> bool:
        return any(self.prefix_lens)

    @property
    def last_rows(self) -> torch.Tensor:
        """Row of each sequence's last new token in the packed ``[T, ...]`` activations."""
        ends, acc = [], 0
        for n in self.new_lens:
            acc += n
            ends.append(acc - 1)
        return torch.tensor(ends, dtype=torch.long, device=self.positions.device)

    @staticmethod
    def uncached(lengths: list[int], device) -> "Batch":
        """Fresh sequences run without a cache (a plain full forward)."""
        positions = torch.cat([torch.arange(n, device=device) for n in lengths])
        return Batch(list(lengths), [0] * len(lengths), positions, _cu(lengths, device))


def _cu(lengths: list[int], device) -> torch.Tensor | None:
    if len(lengths) == 1:
        return None
    offs = [0]
    for n in lengths:
        offs.append(offs[-1] + n)
    return remember_ints(torch.tensor(offs, dtype=torch.int32, device=device), offs)   # its layers read no copy back


class Cache:
    """Decoder state for up to ``max_batch`` sequences and ``max_tokens`` cached tokens in all.

    Per attention layer ``i``: ``k[i]``, ``v[i]`` ``[num_blocks, page_size, Hkv, D]`` in the run dtype. Per Gated
    DeltaNet layer ``i``: ``conv[i]`` ``[max_batch, C, K - 1]`` (the last K-1 conv inputs, run dtype) and
    ``state[i]`` ``[max_batch, nv, dk, dv]`` fp32. ``block_table`` int32 ``[max_batch, max_blocks]`` on the device.

    Example::

        cache = Cache(config, max_batch=4, max_tokens=8192, dtype=torch.bfloat16, device="cuda")
        slot = cache.add()                      # a new sequence
        ...                                     # model.step(...) fills it
        cache.release(slot)
    """

    def __init__(self, config: Config, *, max_batch: int, max_tokens: int, page_size: int = MIN_PAGE,
                 dtype: torch.dtype = torch.bfloat16, device=None):
        if page_size < MIN_PAGE:
            raise ValueError(f"page_size = {page_size}: the decode attention kernel needs pages of >= {MIN_PAGE}")
        if max_batch < 1 or max_tokens < 1:
            raise ValueError(f"max_batch = {max_batch} and max_tokens = {max_tokens} must be >= 1")
        c = config
        self.config, self.page_size, self.max_batch, self.dtype = c, page_size, max_batch, dtype
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.num_blocks = -(-max_tokens // page_size)
        self.max_blocks = self.num_blocks
        kv_shape = (self.num_blocks, page_size, c.num_key_value_heads, c.head_dim)
        kv_layers = c.attention_layers + c.mtp_attention_layers
        self.k = {i: torch.zeros(kv_shape, dtype=dtype, device=self.device) for i in kv_layers}
        self.v = {i: torch.zeros(kv_shape, dtype=dtype, device=self.device) for i in kv_layers}
        conv_shape = (max_batch, c.conv_dim, c.linear_conv_kernel_dim - 1)
        state_shape = (max_batch, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim)
        self.conv = {i: torch.zeros(conv_shape, dtype=dtype, device=self.device) for i in c.linear_layers}
        self.state = {i: torch.zeros(state_shape, dtype=torch.float32, device=self.device) for i in c.linear_layers}
        self.block_table = torch.zeros(max_batch, self.max_blocks, dtype=torch.int32, device=self.device)
        self.lengths = [0] * max_batch
        self.active = [False] * max_batch
        self.broken = [False] * max_batch           #: a step failed half-way: the states are undefined
        self._blocks: list[list[int]] = [[] for _ in range(max_batch)]
        self._free = list(range(self.num_blocks - 1, -1, -1))      # a stack: pop() gives block 0 first
        #: per Gated DeltaNet layer, the conv and recurrent states after each token but the last of an unrolled
        #: step (``[U - 1, max_batch, ...]``, made by the first such step): what :meth:`rollback` restores
        self.snap_conv: dict[int, torch.Tensor] = {}
        self.snap_state: dict[int, torch.Tensor] = {}
        self._unrolled: tuple[list[int], int] | None = None      # (slots, U) of the last step, if it was unrolled

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.page_size

    @property
    def free_tokens(self) -> int:
        return len(self._free) * self.page_size

    def nbytes(self) -> int:
        tensors = [*self.k.values(), *self.v.values(), *self.conv.values(), *self.state.values(),
                   *self.snap_conv.values(), *self.snap_state.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    # -- sequences -----------------------------------------------------------------------------------------------
    def add(self) -> int:
        """Start a sequence: a free slot with zeroed states. Raises :class:`CacheFull` when every slot is taken."""
        for slot, used in enumerate(self.active):
            if not used:
                self.active[slot] = True
                self.lengths[slot] = 0
                for t in (*self.conv.values(), *self.state.values()):
                    t[slot].zero_()
                return slot
        raise CacheFull(f"all {self.max_batch} sequence slots are in use (max_batch = {self.max_batch}); release "
                        f"one or build the cache with a larger max_batch")

    def release(self, slot: int) -> None:
        """End a sequence (a broken one too) and return its pages to the pool."""
        if not isinstance(slot, int) or not 0 <= slot < self.max_batch or not self.active[slot]:
            raise ValueError(f"slot {slot!r} is not an active sequence of this cache")
        self._free.extend(reversed(self._blocks[slot]))
        self._blocks[slot] = []
        self.block_table[slot].zero_()            # no stale page numbers: a captured step reads the whole row
        self.active[slot] = self.broken[slot] = False
        self.lengths[slot] = 0

    def mark_broken(self, slots) -> None:
        """A step over ``slots`` failed after some layers had written their states: refuse them until released."""
        for s in slots:
            self.broken[s] = True

    def _check_slot(self, slot) -> None:
        if not isinstance(slot, int) or not 0 <= slot < self.max_batch or not self.active[slot]:
            raise ValueError(f"slot {slot!r} is not an active sequence of this cache (active: "
                             f"{[s for s, a in enumerate(self.active) if a]})")
        if self.broken[slot]:
            raise ValueError(f"slot {slot}: an earlier step over it failed half-way, so its states are undefined; "
                             f"release it (cache.release({slot})) and prefill the sequence again")

    # -- one call ------------------------------------------------------------------------------------------------
    def plan(self, slots: list[int], new_lens: list[int], *, unroll: bool = False,
             starts: list[int] | None = None) -> Batch:
        """Reserve pages for ``new_lens[b]`` more tokens of sequence ``slots[b]`` and describe the call.

        Nothing changes when the pages do not suffice (:class:`CacheFull`). Call :meth:`advance` after the forward.
        ``unroll``: every sequence adds the same number of tokens to a cached past, run as that many decode steps
        (a speculative verify; :meth:`rollback` undoes its last tokens). ``starts``: the tokens each sequence has in
        the layers this call runs, where that is not its length (the MTP layer runs behind or ahead of the trunk; no
        :meth:`advance` then).
        """
        if len(slots) != len(new_lens) or not slots:
            raise ValueError(f"slots ({len(slots)}) and new_lens ({len(new_lens)}) must be non-empty, one per sequence")
        if len(set(slots)) != len(slots):
            raise ValueError(f"slots {slots} name a sequence twice")
        for s in slots:
            self._check_slot(s)
        if any((not isinstance(n, int)) or n < 1 for n in new_lens):
            raise ValueError(f"new_lens must be positive ints, got {new_lens}")
        prefix = [self.lengths[s] for s in slots] if starts is None else list(starts)
        if len(prefix) != len(slots) or any(not isinstance(p, int) or p < 0 for p in prefix):
            raise ValueError(f"starts {prefix} must be one int >= 0 per sequence")
        if unroll and (len(set(new_lens)) != 1 or not all(prefix)):
            raise ValueError(f"an unrolled step adds one number of tokens to every sequence, each with a cached past; "
                             f"got new_lens {new_lens} after {prefix} tokens")
        self._grow(slots, [p + n for p, n in zip(prefix, new_lens)])
        dev = self.device
        slot_t = torch.tensor(slots, dtype=torch.long, device=dev)
        seq_idx = torch.repeat_interleave(slot_t, torch.tensor(new_lens, device=dev))
        positions = torch.cat([torch.arange(p, p + n, device=dev) for p, n in zip(prefix, new_lens)])
        lo = slots[0]
        rows = slice(lo, lo + len(slots)) if slots == list(range(lo, lo + len(slots))) else slot_t
        batch = Batch(list(new_lens), prefix, positions, _cu(new_lens, dev),
                      prefix_lens_t=remember_ints(torch.tensor(prefix, dtype=torch.int32, device=dev), prefix),
                      decode=unroll or (all(n == 1 for n in new_lens) and all(p > 0 for p in prefix)),
                      kv_slots=paged_slots(self.block_table, seq_idx, positions, self.page_size), rows=rows,
                      unroll=new_lens[0] if unroll else 1)
        if batch.unroll > 1:
            batch.seq_lens = (positions + 1).to(torch.int32)
            batch.block_table = self.block_table[seq_idx]
        elif batch.decode:
            batch.seq_lens = torch.tensor([p + 1 for p in prefix], dtype=torch.int32, device=dev)
            batch.block_table = self.block_table[rows]
        elif batch.has_prefix:
            full = [p + n for p, n in zip(prefix, new_lens)]
            idx = torch.repeat_interleave(slot_t, torch.tensor(full, device=dev))
            pos = torch.cat([torch.arange(n, device=dev) for n in full])
            batch.kv_gather = paged_slots(self.block_table, idx, pos, self.page_size)
        return batch

    def _grow(self, slots: list[int], totals: list[int]) -> None:
        """Pages so that sequence ``slots[b]`` can hold ``totals[b]`` tokens; all or nothing (:class:`CacheFull`)."""
        need = [-(-t // self.page_size) - len(self._blocks[s]) for s, t in zip(slots, totals)]
        if sum(max(0, x) for x in need) > len(self._free):
            raise CacheFull(f"the KV cache holds {self.capacity_tokens} tokens ({self.num_blocks} pages of "
                            f"{self.page_size}), {self.free_tokens} free; this call needs "
                            f"{sum(max(0, x) for x in need) * self.page_size} more for sequences of "
                            f"{list(totals)} tokens")
        for s, extra in zip(slots, need):
            if extra > 0:
                new = [self._free.pop() for _ in range(extra)]
                start = len(self._blocks[s])
                self._blocks[s].extend(new)
                self.block_table[s, start:start + extra] = torch.tensor(new, dtype=torch.int32)

    def reserve(self, slots: list[int], totals: list[int]) -> None:
        """Give each sequence ``slots[b]`` its pages for ``totals[b]`` tokens in all now, so the steps up to that
        length take no new page: a captured decode step reads the block table as it stands. All or nothing
        (:class:`CacheFull`)."""
        for s in slots:
            self._check_slot(s)
        if any(not isinstance(t, int) or t > self.capacity_tokens for t in totals):
            raise ValueError(f"totals {list(totals)} must be ints of at most the cache's {self.capacity_tokens} "
                             f"tokens")
        self._grow(list(slots), list(totals))

    def advance(self, slots: list[int], new_lens: list[int], *, unroll: bool = False) -> None:
        """Record that the call planned for ``slots`` ran."""
        for s, n in zip(slots, new_lens):
            self.lengths[s] += n
        self._unrolled = (list(slots), new_lens[0]) if unroll else None

    # -- speculative decoding ------------------------------------------------------------------------------------
    def snapshot(self, layer: int, j: int, rows) -> None:
        """Keep Gated DeltaNet layer ``layer``'s states of ``rows`` after token ``j`` of an unrolled step."""
        if layer not in self.snap_conv or self.snap_conv[layer].shape[0] <= j:
            u = max(j + 1, 3)               # room for up to 3 drafts; a longer step makes them again, once
            self.snap_conv[layer] = torch.empty(u, *self.conv[layer].shape, dtype=self.dtype, device=self.device)
            self.snap_state[layer] = torch.empty(u, *self.state[layer].shape, dtype=torch.float32, device=self.device)
        self.snap_conv[layer][j, rows] = self.conv[layer][rows]
        self.snap_state[layer][j, rows] = self.state[layer][rows]

    def rollback(self, slots: list[int], keep: list[int]) -> None:
        """After an unrolled step over ``slots``, keep only the first ``keep[b]`` of its tokens of sequence
        ``slots[b]`` (the accepted ones): the Gated DeltaNet states go back to those after that token and the
        length shrinks; keys and values written past it are simply overwritten later."""
        if self._unrolled is None or self._unrolled[0] != list(slots):
            raise ValueError(f"rollback of slots {slots}: the last step over them was not an unrolled step")
        u = self._unrolled[1]
        if any(not isinstance(k, int) or not 1 <= k <= u for k in keep):
            raise ValueError(f"keep {keep}: each must be an int in [1, {u}] (the step's tokens per sequence)")
        for s, k in zip(slots, keep):
            if k < u:
                for i in self.conv:
                    self.conv[i][s] = self.snap_conv[i][k - 1, s]
                    self.state[i][s] = self.snap_state[i][k - 1, s]
                self.lengths[s] -= u - k
        self._unrolled = None
