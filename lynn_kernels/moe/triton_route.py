"""Softmax top-k routing in Triton: one program per block of tokens, the whole expert row in registers.

Per token: fp32 softmax over the E experts (any E up to :data:`MAX_EXPERTS`, masked to a power of two), then top_k
rounds of "take the largest logit, ties to the lowest id" (a max, then the min id among the lanes equal to it),
each taking its probability as the weight, then the optional renormalisation. Selecting on the logits rather than
on ``p`` gives softmax's order exactly: two fp32 logits one ulp apart can round to the same ``p``. The ids equal the
reference's exactly; the weights agree to a few fp32 ulps (the exponential and the sum order differ).

Non-finite logits are not checked here (no host sync): NaN logits sort below every other, so the ids stay distinct
and in ``[0, E)`` whatever the input; the public :func:`lynn_kernels.moe.route` raises on them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import runtime
from ..runtime import kernel_view, to_float32
from . import spec

#: Largest expert count the kernel holds in registers (Qwen3-Next has 512).
MAX_EXPERTS = 1024


@triton.jit
def _route_kernel(
    logits_ptr, weights_ptr, ids_ptr,
    M, E, stride_lm,
    TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr,
):
    pid_m = tl.program_id(0)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_e = tl.arange(0, BLOCK_E)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_e = offs_e < E
    x = tl.load(logits_ptr + offs_m[:, None].to(tl.int64) * stride_lm + offs_e[None, :],
                mask=mask_m[:, None] & mask_e[None, :], other=0)
    x = tl.where(mask_e[None, :], to_float32(x, DTYPE, INTERPRET), float("-inf"))    # [BLOCK_M, BLOCK_E]
    p = tl.exp(x - tl.max(x, axis=1)[:, None])                                       # padding lanes: exp(-inf) = 0
    p = p / tl.sum(p, axis=1)[:, None]

    # select on the logits (softmax keeps their order, and fp32 p can tie where the logits do not); NaN sorts last
    score = tl.where(x == x, x, float("-inf"))                                       # [BLOCK_M, BLOCK_E]
    avail = tl.broadcast_to(mask_e[None, :], (BLOCK_M, BLOCK_E))     # rows past M select too (never stored)
    w = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    ids = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.int32)
    for j in range(TOP_K):
        s = tl.where(avail, score, float("-inf"))
        best = tl.max(s, axis=1)                                                      # [BLOCK_M]
        idx = tl.min(tl.where(avail & (s == best[:, None]), offs_e[None, :], BLOCK_E), axis=1)  # lowest id of equals
        pick = offs_e[None, :] == idx[:, None]
        w = tl.where(offs_k[None, :] == j, tl.sum(tl.where(pick, p, 0.0), axis=1)[:, None], w)
        ids = tl.where(offs_k[None, :] == j, idx[:, None], ids)
        avail = avail & (offs_e[None, :] != idx[:, None])
    if RENORMALIZE:
        w = w / tl.sum(w, axis=1)[:, None]                                            # unused columns hold 0
    out = offs_m[:, None] * TOP_K + offs_k[None, :]
    mask_out = mask_m[:, None] & (offs_k[None, :] < TOP_K)
    tl.store(weights_ptr + out, w, mask=mask_out)
    tl.store(ids_ptr + out, ids, mask=mask_out)


def _block_m(M: int, block_e: int) -> int:
    """Tokens per program: about 4k fp32 logits in registers on the GPU; as many as fit 64k under the interpreter
    (its cost is per program)."""
    cap = (1 << 16) // block_e if runtime.INTERPRET else min(32, (1 << 12) // block_e)
    return max(1, min(cap, runtime.next_power_of_2(M)))


def route_triton(logits: torch.Tensor, top_k: int, renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Host side of :func:`lynn_kernels.moe.route`: checks shapes (no host sync), allocates, launches."""
    M, E = spec.check_route(logits, top_k, renormalize)
    runtime.check_device("logits", logits)
    if E > MAX_EXPERTS:
        raise ValueError(f"logits has E={E} experts; the routing kernel holds at most {MAX_EXPERTS} in registers "
                         f"(use the reference backend)")
    weights = torch.empty((M, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((M, top_k), dtype=torch.int32, device=logits.device)
    return launch_route(logits, top_k, renormalize, weights, ids)


def launch_route(logits: torch.Tensor, top_k: int, renormalize: bool, weights: torch.Tensor,
                 ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch only (no checks, no host sync), into contiguous ``weights`` fp32 and ``ids`` int32 ``[M, top_k]``."""
    M, E = logits.shape
    if M == 0:
        return weights, ids
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    block_e = max(16, runtime.next_power_of_2(E))
    block_m = _block_m(M, block_e)
    _route_kernel[(runtime.cdiv(M, block_m),)](
        kernel_view(logits), weights, ids, M, E, logits.stride(0),
        TOP_K=top_k, RENORMALIZE=renormalize, DTYPE=runtime.TORCH_TO_TL[logits.dtype],
        BLOCK_M=block_m, BLOCK_E=block_e, BLOCK_K=max(2, runtime.next_power_of_2(top_k)),
        num_warps=4, **runtime.kernel_flags())
    return weights, ids
