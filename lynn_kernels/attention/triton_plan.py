"""A decode step's plan for the paged KV cache in one launch: each row's position, the cache slot its new key goes
to, and the sequence length attention reads, from the rows' cached lengths, which rows take part, and the block
table. The same integer operations as :func:`.reference.decode_plan`, so the same values.

In the decoder's captured step this replaces about fifteen small torch operations (a floor division, a clamp, a
gather, casts, products, two selects and three copies), each its own launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import runtime
from ..runtime import pdl_enter
from . import spec


@triton.jit
def _decode_plan_kernel(lengths_ptr, active_ptr, table_ptr, pos_ptr, slot_ptr, seq_ptr, R, W, PAGE, stride_t,
                        BLOCK_R: tl.constexpr, INTERPRET: tl.constexpr, USE_PDL: tl.constexpr = False):
    """One program: rows ``0..R-1``."""
    pdl_enter(USE_PDL)
    r = tl.arange(0, BLOCK_R)
    m = r < R
    pos = tl.load(lengths_ptr + r, mask=m, other=0)                                    # int64
    act = tl.load(active_ptr + r, mask=m, other=0) != 0
    page = tl.minimum(pos // PAGE, W - 1)
    block = tl.load(table_ptr + r.to(tl.int64) * stride_t + page, mask=m, other=0).to(tl.int64)
    tl.store(pos_ptr + r, pos, mask=m)
    tl.store(slot_ptr + r, tl.where(act, block * PAGE + pos % PAGE, -1), mask=m)
    tl.store(seq_ptr + r, tl.where(act, pos + 1, 0).to(seq_ptr.dtype.element_ty), mask=m)


DECODE_PLAN = runtime.Kernel("attention.decode_plan", _decode_plan_kernel)


def decode_plan_triton(lengths, active, block_table, page_size, positions, kv_slots, seq_lens) -> None:
    """Host side of :func:`lynn_kernels.attention.decode_plan`: checks, one launch."""
    spec.check_decode_plan(lengths, active, block_table, page_size, positions, kv_slots, seq_lens)
    spec.check_devices(lengths=lengths, active=active, block_table=block_table, positions=positions,
                       kv_slots=kv_slots, seq_lens=seq_lens)
    launch_decode_plan(lengths, active, block_table, page_size, positions, kv_slots, seq_lens)


def launch_decode_plan(lengths, active, block_table, page_size, positions, kv_slots, seq_lens, *,
                       kernel=None) -> None:
    """Launch only (no checks): the arguments as :func:`.spec.check_decode_plan` accepts them; ``kernel`` (a
    ``@triton.jit`` function with ``_decode_plan_kernel``'s parameters) replaces the shipped kernel."""
    R = lengths.shape[0]
    if R == 0:
        return
    DECODE_PLAN.current(kernel)[(1,)](
        lengths, active.view(torch.uint8), block_table, positions, kv_slots, seq_lens, R, block_table.shape[1],
        int(page_size), block_table.stride(0), BLOCK_R=max(2, runtime.next_power_of_2(R)), num_warps=1,
        **runtime.kernel_flags(), **runtime.pdl_flags())
