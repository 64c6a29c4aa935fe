"""The MoE align step in Triton: a stable counting sort of the slots by expert, padded per expert to ``block_m``.

Same contract and bits as :func:`lynn_kernels.moe.reference.align`, no host sync, deterministic (no atomics). The
slots are cut into chunks of ``CHUNK`` (1024 on the GPU, 128 under the interpreter, whose sort is slow):

1. ``_align_count_kernel`` (one program per chunk): the chunk's per-expert histogram; also fills ``sorted_slots``
   with the sentinel (grid-stride);
2. ``_align_offsets_kernel`` (one program): expert totals, padded group starts, ``num_padded``, the block where each
   group ends, and per (chunk, expert) ``delta = group start + slots of e in earlier chunks - slots of lower
   experts in this chunk`` (in place of the histogram);
3. ``_align_scatter_kernel`` (one program per chunk): sorts the chunk's keys ``e * CHUNK + i`` (unique, so the sort
   is stable by construction); the slot at sorted position ``p`` goes to ``delta[chunk, e] + p``. It also writes
   ``block_expert`` (grid-stride, a binary search over the group ends).

With a single chunk (``M * top_k <= CHUNK``: decode and small batches) ``_align_one_program_kernel`` does all three in
one launch. Measured on the H200 (``data/experiments/moe-profile/results.txt``): 13.8 us for 32,768 slots over 256
experts (count 2.1, offsets 3.7, scatter 8.0 us).

Ids outside ``[0, E)`` are not checked here (no host sync): their slots are placed nowhere. The public
:func:`lynn_kernels.moe.align` raises on them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import runtime
from . import spec

#: Largest expert count (the histogram and the group ends of one program; Qwen3-Next has 512).
MAX_EXPERTS = 1024
#: Slots per chunk (program): the sort size. The interpreter's ``tl.sort`` costs ~0.3 s at 128 keys, ~2 s at 1024.
CHUNK = 128 if runtime.INTERPRET else 1024


@triton.jit
def _load_chunk(ids_ptr, chunk, S, E, CHUNK: tl.constexpr):
    """Expert ids of slots ``chunk * CHUNK + [0, CHUNK)`` as int32, and which of them are real, in-range slots."""
    slot = chunk * CHUNK + tl.arange(0, CHUNK)
    e = tl.load(ids_ptr + slot, mask=slot < S, other=-1)
    valid = (slot < S) & (e >= 0) & (e < E)                 # compared before the cast: int64 ids do not wrap
    return e.to(tl.int32), valid


@triton.jit
def _fill_sentinel(sorted_ptr, start, step, P_MAX, S, BLOCK_FILL: tl.constexpr):
    sentinel = tl.zeros((BLOCK_FILL,), dtype=tl.int32) + S
    for base in range(start * BLOCK_FILL, P_MAX, step * BLOCK_FILL):
        offs = base + tl.arange(0, BLOCK_FILL)
        tl.store(sorted_ptr + offs, sentinel, mask=offs < P_MAX)


@triton.jit
def _scatter_chunk(ids_ptr, delta_ptr, sorted_ptr, chunk, S, E, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr):
    """Slot ``i`` of the chunk, at position ``p`` once sorted by (expert, slot), goes to ``delta[e] + p``."""
    e, valid = _load_chunk(ids_ptr, chunk, S, E, CHUNK)
    offs = tl.arange(0, CHUNK)
    key = tl.sort(tl.where(valid, e * CHUNK + offs, BLOCK_E * CHUNK + offs))      # invalid slots sort last
    e_s = key // CHUNK                                                            # [CHUNK], expert by position
    ok = e_s < BLOCK_E
    dest = tl.load(delta_ptr + e_s, mask=ok, other=0) + offs
    tl.store(sorted_ptr + dest, chunk * CHUNK + key % CHUNK, mask=ok)


@triton.jit
def _block_experts(block_expert_ptr, ends_ptr, used_blocks, start, step, NUM_BLOCKS, E,
                   BLOCK_E: tl.constexpr, LOG2_BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr):
    """``block_expert[b]`` = the number of groups ending at or before block ``b`` (``ends`` is non-decreasing), by
    binary lifting over the ``E`` group ends; ``-1`` from ``used_blocks`` on."""
    for base in range(start * BLOCK_B, NUM_BLOCKS, step * BLOCK_B):
        b = base + tl.arange(0, BLOCK_B)
        owner = tl.zeros((BLOCK_B,), dtype=tl.int32)
        for k in tl.static_range(LOG2_BLOCK_E + 1):
            cand = owner + (BLOCK_E >> k)
            end = tl.load(ends_ptr + cand - 1, mask=cand <= E, other=NUM_BLOCKS)
            owner = tl.where(end <= b, cand, owner)
        tl.store(block_expert_ptr + b, tl.where(b < used_blocks, owner, -1), mask=b < NUM_BLOCKS)


@triton.jit
def _align_count_kernel(ids_ptr, hist_ptr, sorted_ptr, S, E, P_MAX,
                        CHUNK: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_FILL: tl.constexpr):
    pid = tl.program_id(0)
    e, valid = _load_chunk(ids_ptr, pid, S, E, CHUNK)
    tl.store(hist_ptr + pid * BLOCK_E + tl.arange(0, BLOCK_E), tl.histogram(e, BLOCK_E, mask=valid))
    _fill_sentinel(sorted_ptr, pid, tl.num_programs(0), P_MAX, S, BLOCK_FILL)


ALIGN_COUNT = runtime.Kernel("moe.align_count", _align_count_kernel)


@triton.jit
def _align_offsets_kernel(hist_ptr, ends_ptr, num_padded_ptr, NUM_CHUNKS, E, block_m,
                          BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr):
    offs_e = tl.arange(0, BLOCK_E)
    offs_c = tl.arange(0, BLOCK_C)
    total = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for c0 in range(0, NUM_CHUNKS, BLOCK_C):
        rows = c0 + offs_c
        h = tl.load(hist_ptr + rows[:, None] * BLOCK_E + offs_e[None, :], mask=(rows < NUM_CHUNKS)[:, None], other=0)
        total += tl.sum(h, axis=0)
    padded = (total + block_m - 1) // block_m * block_m                            # [BLOCK_E], 0 past E
    end = tl.cumsum(padded, 0)
    tl.store(ends_ptr + offs_e, end // block_m, mask=offs_e < E)
    tl.store(num_padded_ptr, tl.sum(padded, 0))
    before = end - padded                          # group start + slots of e in the chunks done so far
    for c0 in range(0, NUM_CHUNKS, BLOCK_C):
        rows = c0 + offs_c
        ptrs = hist_ptr + rows[:, None] * BLOCK_E + offs_e[None, :]
        mask = (rows < NUM_CHUNKS)[:, None]
        h = tl.load(ptrs, mask=mask, other=0)                                          # [BLOCK_C, BLOCK_E]
        delta = before[None, :] + (tl.cumsum(h, 0) - h) - (tl.cumsum(h, 1) - h)
        tl.store(ptrs, delta, mask=mask)
        before += tl.sum(h, axis=0)


ALIGN_OFFSETS = runtime.Kernel("moe.align_offsets", _align_offsets_kernel)


@triton.jit
def _align_scatter_kernel(ids_ptr, delta_ptr, ends_ptr, num_padded_ptr, sorted_ptr, block_expert_ptr,
                          S, E, block_m, NUM_BLOCKS,
                          CHUNK: tl.constexpr, BLOCK_E: tl.constexpr, LOG2_BLOCK_E: tl.constexpr,
                          BLOCK_B: tl.constexpr):
    pid = tl.program_id(0)
    _scatter_chunk(ids_ptr, delta_ptr + pid * BLOCK_E, sorted_ptr, pid, S, E, CHUNK, BLOCK_E)
    used = tl.load(num_padded_ptr) // block_m
    _block_experts(block_expert_ptr, ends_ptr, used, pid, tl.num_programs(0), NUM_BLOCKS, E,
                   BLOCK_E, LOG2_BLOCK_E, BLOCK_B)


ALIGN_SCATTER = runtime.Kernel("moe.align_scatter", _align_scatter_kernel)


@triton.jit
def _align_one_program_kernel(ids_ptr, delta_ptr, ends_ptr, num_padded_ptr, sorted_ptr, block_expert_ptr,
                              S, E, block_m, P_MAX, NUM_BLOCKS,
                              CHUNK: tl.constexpr, BLOCK_E: tl.constexpr, LOG2_BLOCK_E: tl.constexpr,
                              BLOCK_FILL: tl.constexpr, BLOCK_B: tl.constexpr):
    offs_e = tl.arange(0, BLOCK_E)
    e, valid = _load_chunk(ids_ptr, 0, S, E, CHUNK)
    count = tl.histogram(e, BLOCK_E, mask=valid)                                       # [BLOCK_E]
    padded = (count + block_m - 1) // block_m * block_m
    end = tl.cumsum(padded, 0)
    num_padded = tl.sum(padded, 0)
    tl.store(delta_ptr + offs_e, end - padded - (tl.cumsum(count, 0) - count))
    tl.store(ends_ptr + offs_e, end // block_m, mask=offs_e < E)
    tl.store(num_padded_ptr, num_padded)
    _fill_sentinel(sorted_ptr, 0, 1, P_MAX, S, BLOCK_FILL)
    tl.debug_barrier()                   # sentinels, delta and ends are in memory before any thread reads or overwrites
    _scatter_chunk(ids_ptr, delta_ptr, sorted_ptr, 0, S, E, CHUNK, BLOCK_E)
    _block_experts(block_expert_ptr, ends_ptr, num_padded // block_m, 0, 1, NUM_BLOCKS, E,
                   BLOCK_E, LOG2_BLOCK_E, BLOCK_B)


ALIGN_ONE_PROGRAM = runtime.Kernel("moe.align_one_program", _align_one_program_kernel)


def align_triton(ids: torch.Tensor, num_experts: int, block_m: int):
    """Host side of :func:`lynn_kernels.moe.align`: checks shapes and dtypes (not values: no host sync), allocates
    ``(sorted_slots [P_max], block_expert [P_max // block_m], num_padded [1])`` int32 and launches."""
    S, p_max = spec.check_align(ids, num_experts, block_m)
    runtime.check_device("ids", ids)
    if num_experts > MAX_EXPERTS:
        raise ValueError(f"num_experts={num_experts}: the align kernels handle at most {MAX_EXPERTS} experts "
                         f"(use the reference backend)")
    dev = ids.device
    sorted_slots = torch.empty(p_max, dtype=torch.int32, device=dev)
    block_expert = torch.empty(p_max // block_m, dtype=torch.int32, device=dev)
    num_padded = torch.empty(1, dtype=torch.int32, device=dev)
    return launch_align(ids, num_experts, block_m, sorted_slots, block_expert, num_padded)


#: The align kernels' tiles on the GPU: sentinel fill, block-expert fill, histogram cells per offsets step (the
#: interpreter takes larger ones, :func:`align_tiles`).
GPU_TILES = {"BLOCK_FILL": 1024, "BLOCK_B": 64, "CELLS": 1 << 13}


def align_tiles(interpret: bool = runtime.INTERPRET) -> dict:
    """The tiles :func:`launch_align` uses on this backend (``interpret=False``: the GPU's, for tests)."""
    return {"BLOCK_FILL": 4096, "BLOCK_B": 1024, "CELLS": 1 << 16} if interpret else dict(GPU_TILES)


def launch_align(ids: torch.Tensor, num_experts: int, block_m: int, sorted_slots: torch.Tensor,
                 block_expert: torch.Tensor, num_padded: torch.Tensor, *, chunk: int | None = None,
                 config: dict | None = None):
    """Launch only (no checks, no host sync), into contiguous int32 outputs sized by ``spec.max_padded``.
    ``chunk`` (a power of two >= 16) overrides :data:`CHUNK`, e.g. to test the multi-chunk path on small inputs;
    ``config`` overrides the tiles of :func:`align_tiles` (the GPU's under the interpreter, in tests)."""
    S = ids.numel()
    if S == 0:
        num_padded.zero_()
        return sorted_slots, block_expert, num_padded
    flat = ids.contiguous().view(-1)
    chunk = chunk or CHUNK
    block_e = max(32, runtime.next_power_of_2(num_experts))            # histogram bins: a power of two >= a warp
    log2_e = block_e.bit_length() - 1
    p_max, n_blocks = sorted_slots.numel(), block_expert.numel()
    tiles = {**align_tiles(), **(config or {})}
    block_fill, block_b = tiles["BLOCK_FILL"], tiles["BLOCK_B"]
    n_chunks = runtime.cdiv(S, chunk)
    if n_chunks == 1:
        ws = torch.empty(2 * block_e, dtype=torch.int32, device=ids.device)           # delta, group ends
        ALIGN_ONE_PROGRAM.current()[(1,)](
            flat, ws, ws[block_e:], num_padded, sorted_slots, block_expert, S, num_experts, block_m, p_max, n_blocks,
            CHUNK=max(16, runtime.next_power_of_2(S)), BLOCK_E=block_e, LOG2_BLOCK_E=log2_e, BLOCK_FILL=block_fill,
            BLOCK_B=block_b, num_warps=4)
        return sorted_slots, block_expert, num_padded
    ws = torch.empty((n_chunks + 1) * block_e, dtype=torch.int32, device=ids.device)  # hist -> delta, group ends
    hist, ends = ws[: n_chunks * block_e], ws[n_chunks * block_e:]
    ALIGN_COUNT.current()[(n_chunks,)](flat, hist, sorted_slots, S, num_experts, p_max,
                                       CHUNK=chunk, BLOCK_E=block_e, BLOCK_FILL=block_fill, num_warps=4)
    ALIGN_OFFSETS.current()[(1,)](hist, ends, num_padded, n_chunks, num_experts, block_m,
                                  BLOCK_E=block_e, BLOCK_C=max(1, tiles["CELLS"] // block_e),
                                  num_warps=4)
    ALIGN_SCATTER.current()[(n_chunks,)](flat, hist, ends, num_padded, sorted_slots, block_expert,
                                         S, num_experts, block_m, n_blocks,
                                         CHUNK=chunk, BLOCK_E=block_e, LOG2_BLOCK_E=log2_e, BLOCK_B=block_b,
                                         num_warps=4)
    return sorted_slots, block_expert, num_padded
