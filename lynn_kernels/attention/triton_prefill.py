"""Prefill flash attention: causal, GQA, variable-length batches, chunked prefill, fused sigmoid output gate.

One program owns one tile of ``BLOCK_M`` rows, where the rows are (token, query head) pairs of **one** KV head: the
tile folds ``BLOCK_M // HEADS`` consecutive tokens times the ``HEADS`` query heads that share that KV head. Each
K / V block is loaded once and serves every query head of its group. The key loop runs in two parts: blocks that
every row may fully see (no mask), then the few blocks on the causal diagonal (masked). Blocks above the diagonal
are never visited. docs/attention.md derives the bounds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import runtime
from ..runtime import cast_output, kernel_view, to_float32
from .spec import check_devices, check_prefill, last_dim_contiguous
from .triton_common import LOG2E, M_INIT, dot_dtype, load_operand, softmax_step


def _smem_bytes(cfg, head_dim: int) -> int:
    """Shared memory a config needs with bf16 operands: the Q tile plus ``num_stages`` buffers of K and V."""
    bm, bn = cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"]
    return 2 * head_dim * (bm + 2 * bn * cfg.num_stages)


def _prune(configs, named_args, **kwargs):
    """Drop configs whose tiles exceed the H200's 227 KB of shared memory per block at this head dim."""
    d = kwargs.get("HEAD_DIM", named_args.get("HEAD_DIM"))
    fit = [c for c in configs if _smem_bytes(c, d) <= 220 * 1024]
    return fit or configs[-1:]


# sm_90 candidates. The first one is what the interpreter runs (one config there). At d=256 a 128 x 256 bf16 Q tile
# is 64 KB and each K+V stage 64 KB, so only two stages fit; the fp32 accumulator (128 x 256) needs 8 warps.
PREFILL_CONFIGS = [
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8, num_stages=2),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 32}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=2),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128}, num_warps=8, num_stages=2),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 32}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=4, num_stages=2),
]


@runtime.autotune(configs=PREFILL_CONFIGS,
                  key=["HEAD_DIM", "GROUP", "CAUSAL", "HAS_GATE", "IN_DTYPE", "LEN_BUCKET"],
                  prune_configs_by={"early_config_prune": _prune})
@triton.heuristics({"HEADS": lambda a: min(a["GROUP"], a["BLOCK_M"])})
@triton.jit
def _flash_prefill_kernel(
    q_ptr, k_ptr, v_ptr, gate_ptr, out_ptr, cu_q_ptr, cu_k_ptr,
    qk_scale, HKV, LEN_BUCKET,                            # LEN_BUCKET: the autotuner's key only (size_bucket)
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_gh, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, HAS_GATE: tl.constexpr,
    IN_DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr, DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEADS: tl.constexpr, INTERPRET: tl.constexpr,
):
    TOKENS: tl.constexpr = BLOCK_M // HEADS               # tokens per tile; HEADS query heads each
    CHUNKS: tl.constexpr = (GROUP + HEADS - 1) // HEADS   # > 1 only when a group has more heads than BLOCK_M rows
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)     # longest (latest) tiles first: better tail balance
    pid_z = tl.program_id(1)
    pid_c = pid_z % CHUNKS
    pid_hk = (pid_z // CHUNKS) % HKV
    pid_b = pid_z // (CHUNKS * HKV)

    q_start = tl.load(cu_q_ptr + pid_b)
    q_len = tl.load(cu_q_ptr + pid_b + 1) - q_start
    k_start = tl.load(cu_k_ptr + pid_b)
    k_len = tl.load(cu_k_ptr + pid_b + 1) - k_start
    prefix = k_len - q_len                                # cached keys before this chunk's first new token
    m_start = pid_m * TOKENS
    if m_start >= q_len:
        return

    # rows: (token, head) pairs, heads fastest, so a token's G heads are adjacent in memory as well
    offs_r = tl.arange(0, BLOCK_M)
    offs_t = m_start + offs_r // HEADS                                  # [BLOCK_M] token within the sequence
    offs_g = pid_c * HEADS + offs_r % HEADS                             # [BLOCK_M] head within the group
    mask_r = (offs_r < TOKENS * HEADS) & (offs_t < q_len) & (offs_g < GROUP)
    offs_h = pid_hk * GROUP + offs_g                                    # [BLOCK_M] query head
    offs_d = tl.arange(0, HEAD_DIM)
    rows_q = (q_start + offs_t).to(tl.int64) * stride_qt + offs_h * stride_qh
    q = tl.load(q_ptr + rows_q[:, None] + offs_d[None, :], mask=mask_r[:, None], other=0)
    q = load_operand(q, IN_DTYPE, DOT, INTERPRET)                       # [BLOCK_M, HEAD_DIM]

    m_i = tl.full((BLOCK_M,), M_INIT, dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)

    offs_n = tl.arange(0, BLOCK_N)
    k_base = k_ptr + pid_hk * stride_kh + offs_d[None, :]
    v_base = v_ptr + pid_hk * stride_vh + offs_d[None, :]
    pos_q = prefix + offs_t                                             # [BLOCK_M] absolute query positions
    if CAUSAL:
        pos_lo = prefix + m_start
        pos_hi = prefix + tl.minimum(m_start + TOKENS, q_len) - 1
        n_full = ((pos_lo + 1) // BLOCK_N) * BLOCK_N    # keys below this are visible to every row
        n_end = pos_hi + 1                              # keys past the last row's position: skipped
    else:
        n_full = (k_len // BLOCK_N) * BLOCK_N
        n_end = k_len

    # 1) blocks below the diagonal: every key visible to every row, in bounds, no mask
    for n in range(0, n_full, BLOCK_N):
        rows_k = (k_start + n + offs_n).to(tl.int64)                    # [BLOCK_N]
        k = load_operand(tl.load(k_base + rows_k[:, None] * stride_kt), IN_DTYPE, DOT, INTERPRET)
        v = load_operand(tl.load(v_base + rows_k[:, None] * stride_vt), IN_DTYPE, DOT, INTERPRET)
        acc, m_i, l_i = softmax_step(q, k, v, acc, m_i, l_i, qk_scale, None, False, DOT)

    # 2) the diagonal (or the ragged tail without causality): mask keys past the end and past each row's position
    for n in range(n_full, n_end, BLOCK_N):
        keys = n + offs_n                                               # [BLOCK_N]
        mask_n = keys < n_end
        rows_k = (k_start + keys).to(tl.int64)
        k = load_operand(tl.load(k_base + rows_k[:, None] * stride_kt, mask=mask_n[:, None], other=0),
                         IN_DTYPE, DOT, INTERPRET)
        v = load_operand(tl.load(v_base + rows_k[:, None] * stride_vt, mask=mask_n[:, None], other=0),
                         IN_DTYPE, DOT, INTERPRET)
        keep = mask_n[None, :]
        if CAUSAL:
            keep = keep & (keys[None, :] <= pos_q[:, None])             # [BLOCK_M, BLOCK_N]
        acc, m_i, l_i = softmax_step(q, k, v, acc, m_i, l_i, qk_scale, keep, True, DOT)

    # epilogue: normalise, gate, store (every stored row saw at least key 0, so l_i > 0)
    out = acc / l_i[:, None]
    row_ok = mask_r[:, None]
    if HAS_GATE:
        rows_g = (q_start + offs_t).to(tl.int64) * stride_gt + offs_h * stride_gh
        g = to_float32(tl.load(gate_ptr + rows_g[:, None] + offs_d[None, :], mask=row_ok, other=0), IN_DTYPE,
                       INTERPRET)
        out = out * tl.sigmoid(g)
    rows_o = (q_start + offs_t).to(tl.int64) * stride_ot + offs_h * stride_oh
    tl.store(out_ptr + rows_o[:, None] + offs_d[None, :], cast_output(out, OUT_DTYPE, INTERPRET), mask=row_ok)


PREFILL = runtime.Kernel("attention.prefill", _flash_prefill_kernel)


def flash_attention_triton(q, k, v, causal=True, scale=None, gate=None, cu_seqlens=None, prefix_lens=None):
    """Host side of :func:`lynn_kernels.attention.flash_attention`: check, allocate, launch."""
    check_devices(q=q, k=k, v=v, gate=gate, cu_seqlens=cu_seqlens, prefix_lens=prefix_lens)
    lay = check_prefill(q, k, v, gate, cu_seqlens, prefix_lens, causal=causal, scale=scale)
    q, k, v, gate = (last_dim_contiguous(t) for t in (q, k, v, gate))
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if q.shape[0] == 0:
        return out
    return launch_prefill(q, k, v, gate, out, lay.cu_q_t, lay.cu_k_t, lay.max_q, causal,
                          q.shape[-1] ** -0.5 if scale is None else scale)


def launch_prefill(q, k, v, gate, out, cu_q, cu_k, max_q: int, causal: bool, scale: float,
                   config: dict | None = None, *, kernel=None) -> torch.Tensor:
    """Launch only (no checks, no host sync): ``cu_q`` / ``cu_k`` int32 ``[B+1]`` on the device, ``max_q`` the
    longest query run (it sizes the grid). ``config`` (``{"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"}``)
    bypasses the autotuner, for tests of one tiling. ``kernel`` (a ``@triton.jit`` function with
    ``_flash_prefill_kernel``'s parameters) replaces the shipped kernel."""
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    group, batch = hq // hkv, cu_q.numel() - 1
    g = gate if gate is not None else q                   # a valid pointer; never read without HAS_GATE

    def grid(meta):
        heads = meta["HEADS"]
        tokens = meta["BLOCK_M"] // heads
        return (runtime.cdiv(max_q, tokens), batch * hkv * runtime.cdiv(group, heads))

    launched = PREFILL.current(kernel)
    if config is not None and hasattr(launched, "configs"):
        launched = launched.fn                            # past the autotuner; the shipped one's .fn: the heuristics
    launched[grid](
        kernel_view(q), kernel_view(k), kernel_view(v), kernel_view(g), kernel_view(out), cu_q, cu_k,
        float(scale) * LOG2E, hkv, runtime.size_bucket(max_q),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), g.stride(1),
        out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=d, CAUSAL=bool(causal), HAS_GATE=gate is not None,
        IN_DTYPE=runtime.TORCH_TO_TL[q.dtype], OUT_DTYPE=runtime.TORCH_TO_TL[out.dtype], DOT=dot_dtype(q.dtype),
        **runtime.kernel_flags(), **(config or {}),
    )
    return out
