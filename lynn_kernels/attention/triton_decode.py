"""Decode attention over a KV cache: split-KV (flash-decoding) and a log-sum-exp merge.

Kernel 1 (``_decode_split_kernel``), one program per (sequence, KV head, split): the ``GROUP`` query heads of that KV
head form the rows of one tile (padded to 16, the smallest ``tl.dot``), so each cached key and value is read once for
the whole group. The program walks its split of the sequence in ``BLOCK_N`` blocks with an online softmax and
writes its normalised partial output and log-sum-exp. Kernel 2 (``_decode_merge_kernel``) weighs the splits by
``2^(lse_s - max lse)`` and applies the sigmoid gate. With one split the first kernel finishes the job itself.

The cache is contiguous ``[B, S_max, Hkv, D]`` or paged ``[num_blocks, PAGE, Hkv, D]`` + ``block_table``; a key's
address is ``i0 * stride0 + i1 * stride1`` with ``(i0, i1) = (b, pos)`` or ``(block_table[b, pos // PAGE],
pos % PAGE)``, so both share one kernel (``PAGED`` picks).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import runtime
from ..runtime import cast_output, kernel_view, pdl_enter, to_float32
from .spec import MAX_SPLITS, check_decode, check_devices, last_dim_contiguous
from .triton_common import LOG2E, M_INIT, dot_dtype, load_operand, softmax_step

#: A split covers at least this many keys (fewer and the partials cost more traffic than they save).
MIN_SPLIT_TOKENS = 64


def _prune(configs, named_args, **kwargs):
    d = kwargs.get("HEAD_DIM", named_args.get("HEAD_DIM"))
    fit = [c for c in configs if 2 * 2 * d * c.kwargs["BLOCK_N"] * c.num_stages <= 200 * 1024]
    return fit or configs[-1:]


# sm_90 candidates (the first is the interpreter's). Decode is a stream over K and V: enough bytes in flight per SM
# matters, not the tile's arithmetic, so deep pipelines of moderate tiles.
DECODE_CONFIGS = [
    triton.Config({"BLOCK_N": 64}, num_warps=4, num_stages=2),
    triton.Config({"BLOCK_N": 32}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_N": 64}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_N": 32}, num_warps=2, num_stages=4),
    triton.Config({"BLOCK_N": 128}, num_warps=8, num_stages=2),
    triton.Config({"BLOCK_N": 64}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_N": 16}, num_warps=2, num_stages=4),
]


@runtime.autotune(configs=DECODE_CONFIGS,
                  key=["HEAD_DIM", "GROUP", "PAGED", "NUM_SPLITS", "HAS_GATE", "IN_DTYPE", "PAGE_SIZE"],
                  prune_configs_by={"early_config_prune": _prune})
@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, seq_lens_ptr, table_ptr, gate_ptr, out_ptr, part_o_ptr, part_lse_ptr,
    qk_scale, HKV,
    stride_qb, stride_qh, stride_k0, stride_k1, stride_kh, stride_v0, stride_v1, stride_vh, stride_tb,
    stride_gb, stride_gh, stride_ob, stride_oh,
    GROUP: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, PAGED: tl.constexpr,
    PAGE_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr, HAS_GATE: tl.constexpr,
    IN_DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr, DOT: tl.constexpr,
    BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_enter(USE_PDL)
    pid_b = tl.program_id(0)
    pid_hk = tl.program_id(1)
    pid_s = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + pid_b).to(tl.int32)
    # splits of whole BLOCK_N blocks; the last may be partial and the trailing ones empty
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = pid_s * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_g = tl.arange(0, HEADS_PAD)
    mask_g = offs_g < GROUP
    offs_h = pid_hk * GROUP + offs_g                                    # [HEADS_PAD] query heads of this KV head
    offs_d = tl.arange(0, HEAD_DIM)
    rows_q = pid_b.to(tl.int64) * stride_qb + offs_h * stride_qh
    q = tl.load(q_ptr + rows_q[:, None] + offs_d[None, :], mask=mask_g[:, None], other=0)
    q = load_operand(q, IN_DTYPE, DOT, INTERPRET)                       # [HEADS_PAD, HEAD_DIM]

    m_i = tl.full((HEADS_PAD,), M_INIT, dtype=tl.float32)
    l_i = tl.zeros((HEADS_PAD,), dtype=tl.float32)
    acc = tl.zeros((HEADS_PAD, HEAD_DIM), dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    k_base = k_ptr + pid_hk * stride_kh + offs_d[None, :]
    v_base = v_ptr + pid_hk * stride_vh + offs_d[None, :]
    for n in range(start, end, BLOCK_N):
        pos = n + offs_n                                                # [BLOCK_N] key positions
        mask_n = pos < end
        if PAGED:
            block = tl.load(table_ptr + pid_b * stride_tb + pos // PAGE_SIZE, mask=mask_n, other=0)
            i0 = block.to(tl.int64)
            i1 = (pos % PAGE_SIZE).to(tl.int64)
        else:
            i0 = pid_b.to(tl.int64)
            i1 = pos.to(tl.int64)
        k = tl.load(k_base + (i0 * stride_k0 + i1 * stride_k1)[:, None], mask=mask_n[:, None], other=0)
        v = tl.load(v_base + (i0 * stride_v0 + i1 * stride_v1)[:, None], mask=mask_n[:, None], other=0)
        k = load_operand(k, IN_DTYPE, DOT, INTERPRET)                   # [BLOCK_N, HEAD_DIM]
        v = load_operand(v, IN_DTYPE, DOT, INTERPRET)
        acc, m_i, l_i = softmax_step(q, k, v, acc, m_i, l_i, qk_scale, mask_n[None, :], True, DOT)

    # an empty split (or sequence) has l_i = 0: output 0 with lse = -inf, so the merge gives it no weight
    has = l_i > 0
    o = acc / tl.where(has, l_i, 1.0)[:, None]                          # [HEADS_PAD, HEAD_DIM]
    if NUM_SPLITS == 1:
        if HAS_GATE:
            rows_g = pid_b.to(tl.int64) * stride_gb + offs_h * stride_gh
            g = tl.load(gate_ptr + rows_g[:, None] + offs_d[None, :], mask=mask_g[:, None], other=0)
            o = o * tl.sigmoid(to_float32(g, IN_DTYPE, INTERPRET))
        rows_o = pid_b.to(tl.int64) * stride_ob + offs_h * stride_oh
        tl.store(out_ptr + rows_o[:, None] + offs_d[None, :], cast_output(o, OUT_DTYPE, INTERPRET),
                 mask=mask_g[:, None])
    else:
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))     # [HEADS_PAD], log2 units
        # partials are [B, Hq, NUM_SPLITS, (D)] fp32
        rows_p = (pid_b.to(tl.int64) * (HKV * GROUP) + offs_h) * NUM_SPLITS + pid_s
        tl.store(part_lse_ptr + rows_p, lse, mask=mask_g)
        tl.store(part_o_ptr + rows_p[:, None] * HEAD_DIM + offs_d[None, :], o, mask=mask_g[:, None])


DECODE = runtime.Kernel("attention.decode", _decode_split_kernel)


@triton.jit
def _decode_merge_kernel(
    part_o_ptr, part_lse_ptr, gate_ptr, out_ptr, HQ,
    stride_gb, stride_gh, stride_ob, stride_oh,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_GATE: tl.constexpr, IN_DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr, INTERPRET: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_enter(USE_PDL)
    pid_b = tl.program_id(0)
    pid_h = tl.program_id(1)
    pid_d = tl.program_id(2)                                            # a slice of D: more programs at batch 1
    offs_s = tl.arange(0, SPLITS_PAD)
    mask_s = offs_s < NUM_SPLITS
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    rows_p = (pid_b.to(tl.int64) * HQ + pid_h) * NUM_SPLITS + offs_s  # [SPLITS_PAD]
    lse = tl.load(part_lse_ptr + rows_p, mask=mask_s, other=float("-inf"))
    o = tl.load(part_o_ptr + rows_p[:, None] * HEAD_DIM + offs_d[None, :], mask=mask_s[:, None], other=0)
    lse_max = tl.maximum(tl.max(lse, 0), M_INIT)                        # finite even when every split is empty
    w = tl.exp2(lse - lse_max)                                          # [SPLITS_PAD] weight of each split
    w_sum = tl.sum(w, 0)
    out = tl.sum(o * w[:, None], 0) / tl.where(w_sum > 0, w_sum, 1.0)   # [BLOCK_D]
    if HAS_GATE:
        g = tl.load(gate_ptr + pid_b.to(tl.int64) * stride_gb + pid_h * stride_gh + offs_d)
        out = out * tl.sigmoid(to_float32(g, IN_DTYPE, INTERPRET))
    tl.store(out_ptr + pid_b.to(tl.int64) * stride_ob + pid_h * stride_oh + offs_d,
             cast_output(out, OUT_DTYPE, INTERPRET))


DECODE_MERGE = runtime.Kernel("attention.decode_merge", _decode_merge_kernel)


def _floor_pow2(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def splits_for(batch: int, hkv: int, capacity: int, sms: int) -> int:
    """The rule of :func:`default_num_splits` for a GPU of ``sms`` SMs (pure: no device query)."""
    want = runtime.cdiv(2 * sms, max(1, batch * hkv))
    return _floor_pow2(min(want, runtime.cdiv(capacity, MIN_SPLIT_TOKENS), MAX_SPLITS))


def default_num_splits(batch: int, hkv: int, capacity: int) -> int:
    """Splits per sequence: ``min(ceil(2 * SMs / (batch * hkv)), ceil(capacity / MIN_SPLIT_TOKENS), MAX_SPLITS)``
    rounded **down to a power of two**, so ``batch * hkv * splits`` programs fill the GPU one to two times over and
    no split is shorter than ``MIN_SPLIT_TOKENS`` keys of the cache's capacity.

    Chosen from shapes alone, without reading ``seq_lens`` (no host sync). A power of two because ``NUM_SPLITS`` is
    a compile-time constant and an autotune key of the split kernel: only 1, 2, 4, ..., 256 occur (Qwen's 2 KV heads
    on an H200, 32k cache: 8 values over batch 1..256, instead of 22), so a new batch size seldom compiles or autotunes
    anything, and warming up one batch size per split count lets CUDA graphs be captured for any batch size.
    Under the interpreter: 1, 2 or 4.
    """
    if runtime.INTERPRET:
        return _floor_pow2(min(4, runtime.cdiv(capacity, 1024)))         # few programs: the interpreter is serial
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return splits_for(batch, hkv, capacity, sms)


def decode_attention_triton(q, k_cache, v_cache, seq_lens, block_table=None, scale=None, gate=None, *,
                            num_splits=None):
    """Host side of :func:`lynn_kernels.attention.decode_attention`: check, allocate, launch."""
    check_devices(q=q, k_cache=k_cache, v_cache=v_cache, seq_lens=seq_lens, block_table=block_table, gate=gate)
    cache = check_decode(q, k_cache, v_cache, seq_lens, block_table, gate, scale=scale, num_splits=num_splits)
    # the kernels read index tensors with unit stride along their last dim (block_table: any row stride)
    q, gate, seq_lens, block_table = (last_dim_contiguous(t) for t in (q, gate, seq_lens, block_table))
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if q.shape[0] == 0:
        return out
    splits = num_splits or default_num_splits(runtime.batch_rows(q.shape[0]), k_cache.shape[2], cache.capacity)
    return launch_decode(q, k_cache, v_cache, seq_lens, block_table, gate, out, splits,
                         q.shape[-1] ** -0.5 if scale is None else scale)


def launch_decode(q, k_cache, v_cache, seq_lens, block_table, gate, out, num_splits: int, scale: float,
                  workspace: tuple[torch.Tensor, torch.Tensor] | None = None, config: dict | None = None
                  ) -> torch.Tensor:
    """Launch only (no checks, no host sync; CUDA-graph safe given a preallocated ``workspace``
    ``(part_o [B, Hq, S, D] fp32, part_lse [B, Hq, S] fp32)``). ``config`` (``{"BLOCK_N", "num_warps",
    "num_stages"}``) bypasses the autotuner, for tests of one tiling."""
    b, hq, d = q.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    paged = block_table is not None
    if num_splits > 1:
        part_o, part_lse = workspace if workspace is not None else (
            torch.empty((b, hq, num_splits, d), dtype=torch.float32, device=q.device),
            torch.empty((b, hq, num_splits), dtype=torch.float32, device=q.device))
    else:
        part_o = part_lse = out                            # unused: the split kernel writes `out` itself
    table = block_table if paged else seq_lens             # a valid pointer; never read without PAGED
    g = gate if gate is not None else q
    in_dtype, out_dtype = runtime.TORCH_TO_TL[q.dtype], runtime.TORCH_TO_TL[out.dtype]
    split = DECODE.current()
    if config is not None and hasattr(split, "configs"):
        split = split.fn                                   # past the autotuner
    split[(b, hkv, num_splits)](
        kernel_view(q), kernel_view(k_cache), kernel_view(v_cache), seq_lens, table, kernel_view(g),
        kernel_view(out), part_o, part_lse,
        float(scale) * LOG2E, hkv,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), table.stride(0),
        g.stride(0), g.stride(1), out.stride(0), out.stride(1),
        GROUP=group, HEADS_PAD=max(16, runtime.next_power_of_2(group)), HEAD_DIM=d, PAGED=paged,
        PAGE_SIZE=k_cache.shape[1] if paged else 1, NUM_SPLITS=num_splits, HAS_GATE=gate is not None,
        IN_DTYPE=in_dtype, OUT_DTYPE=out_dtype, DOT=dot_dtype(q.dtype), **runtime.kernel_flags(), **runtime.pdl_flags(),
        **(config or {}),
    )
    if num_splits > 1:
        block_d = min(d, 64)
        DECODE_MERGE.current()[(b, hq, d // block_d)](
            part_o, part_lse, kernel_view(g), kernel_view(out), hq,
            g.stride(0), g.stride(1), out.stride(0), out.stride(1),
            NUM_SPLITS=num_splits, SPLITS_PAD=runtime.next_power_of_2(num_splits), HEAD_DIM=d, BLOCK_D=block_d,
            HAS_GATE=gate is not None, IN_DTYPE=in_dtype, OUT_DTYPE=out_dtype, **runtime.kernel_flags(),
            **runtime.pdl_flags(), num_warps=4,
        )
    return out
