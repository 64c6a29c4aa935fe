"""Softmax top-k routing in Triton: one program per block of tokens, the whole expert row in registers.

Per token: fp32 softmax over the E experts (any E up to :data:`MAX_EXPERTS`, masked to a power of two), then top_k
rounds of "take the largest logit, ties to the lowest id" (one max over int64 keys that pack the logit's order above
the id's complement), each taking its probability as the weight, then the optional renormalisation. Selecting on the
logits rather than on ``p`` gives softmax's order exactly: two fp32 logits one ulp apart can round to the same ``p``.
The ids equal the reference's exactly; the weights agree to a few fp32 ulps (the exponential and the sum order differ).

For a decode batch (``M <= ROUTER_MAX_M``) ``_router_kernel`` also computes the logits: programs over blocks of
experts and slices of H write fp32 partial logits, and the last program to take a ticket adds them in slice order,
rounds them to x's dtype and routes, so the router is one launch.

Non-finite logits are not checked here (no host sync): NaN logits sort below every other, so the ids stay distinct
and in ``[0, E)`` whatever the input; the public :func:`lynn_kernels.moe.route` raises on them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import runtime
from ..runtime import kernel_view, pdl_enter, round_to_dtype, to_float32
from ..triton_shared import kernel_constexprs, norm_row, normed_at, split_k_counter, split_k_for
from . import spec

#: Largest expert count the kernel holds in registers (Qwen3-Next has 512).
MAX_EXPERTS = 1024


@triton.jit
def _route_rows(x, offs_e, mask_e, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, KEY32: tl.constexpr = False):
    """fp32 logits ``[BLOCK_M, BLOCK_E]`` (``-inf`` past E) -> (weights fp32, ids int32), ``[BLOCK_M, BLOCK_K]``.

    Each of the ``TOP_K`` rounds is one reduction: a max over int64 keys ``(order-preserving int of the logit) << 32
    | (BLOCK_E - 1 - id)``, so the largest logit wins and, among equal logits, the lowest id. With ``KEY32`` (the
    logits hold bf16 values, whose fp32 bits end in 16 zeros, and ``BLOCK_E <= 2^16``) the keys are int32: the top
    16 bits of the order, then the id's complement; the same order, half the width. The weight is recomputed from
    the winning logit with the same operations as ``p``, so it has ``p``'s bits."""
    offs_k = tl.arange(0, BLOCK_K)
    row_max = tl.max(x, axis=1)
    denom = tl.sum(tl.exp(x - row_max[:, None]), axis=1)                            # padding lanes: exp(-inf) = 0

    # select on the logits (softmax keeps their order, and fp32 p can tie where the logits do not); NaN sorts last
    bits = tl.where(x == x, x, float("-inf")).to(tl.int32, bitcast=True)
    order = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)                             # fp32 order as int32 order
    if KEY32:
        key = ((order >> 16) << 16) | (BLOCK_E - 1 - offs_e[None, :])
        key = tl.where(mask_e[None, :], key, -2147483647 - 1)                        # padding never wins
    else:
        key = (order.to(tl.int64) << 32) | (BLOCK_E - 1 - offs_e[None, :]).to(tl.int64)
        key = tl.where(mask_e[None, :], key, -9223372036854775807 - 1)               # padding never wins
    w = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    ids = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.int32)
    for j in range(TOP_K):
        best = tl.max(key, axis=1)                                                    # [BLOCK_M]
        if KEY32:
            idx = BLOCK_E - 1 - (best & 0xFFFF)
            top = best >> 16                                                          # the order's top half; its
            top = (top << 16) | tl.where(top < 0, 0xFFFF, 0)                          # low half: all 0 or all 1
        else:
            idx = BLOCK_E - 1 - (best & 0xFFFFFFFF).to(tl.int32)
            top = (best >> 32).to(tl.int32)
        top = tl.where(top >= 0, top, top ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)  # the winning logit
        p = tl.exp(top - row_max) / denom                                             # p[idx], the same bits
        w = tl.where(offs_k[None, :] == j, p[:, None], w)
        ids = tl.where(offs_k[None, :] == j, idx[:, None], ids)
        if KEY32:
            key = tl.where(offs_e[None, :] == idx[:, None], -2147483647 - 1, key)
        else:
            key = tl.where(offs_e[None, :] == idx[:, None], -9223372036854775807 - 1, key)
    if RENORMALIZE:
        w = w / tl.sum(w, axis=1)[:, None]                                            # unused columns hold 0
    return w, ids


@triton.jit
def _store_route(weights_ptr, ids_ptr, w, ids, offs_m, mask_m, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr,
                 STRIDE: tl.constexpr):
    """Token rows ``offs_m`` of the routing into ``weights`` / ``ids``, ``STRIDE`` entries a row."""
    offs_k = tl.arange(0, BLOCK_K)
    out = offs_m[:, None] * STRIDE + offs_k[None, :]
    mask_out = mask_m[:, None] & (offs_k[None, :] < TOP_K)
    tl.store(weights_ptr + out, w, mask=mask_out)
    tl.store(ids_ptr + out, ids, mask=mask_out)


@triton.jit
def _route_kernel(
    logits_ptr, weights_ptr, ids_ptr,
    M, E, stride_lm,
    TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr,
    KEY32: tl.constexpr = False,
):
    pid_m = tl.program_id(0)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_e = tl.arange(0, BLOCK_E)
    mask_m = offs_m < M
    mask_e = offs_e < E
    x = tl.load(logits_ptr + offs_m[:, None].to(tl.int64) * stride_lm + offs_e[None, :],
                mask=mask_m[:, None] & mask_e[None, :], other=0)
    x = tl.where(mask_e[None, :], to_float32(x, DTYPE, INTERPRET), float("-inf"))    # [BLOCK_M, BLOCK_E]
    w, ids = _route_rows(x, offs_e, mask_e, TOP_K, RENORMALIZE, BLOCK_M, BLOCK_E, BLOCK_K, KEY32)
    _store_route(weights_ptr, ids_ptr, w, ids, offs_m, mask_m, TOP_K, BLOCK_K, TOP_K)


ROUTE = runtime.Kernel("moe.route", _route_kernel)


@triton.jit
def _x_tile(x_rows, r_rows, nw_ptr, offs_h, rstd, mask, NORM: tl.constexpr, X_DTYPE: tl.constexpr,
            NW_DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """x ``[BLOCK_H, 16]`` (H along the rows, the tokens along the columns) as loaded: x itself, or with ``NORM``
    its RMSNorm (``rstd [16]`` per token)."""
    if NORM > 0:
        return normed_at(x_rows, r_rows, nw_ptr, offs_h[:, None], rstd[None, :], mask, NORM == 2, X_DTYPE, NW_DTYPE,
                         INTERPRET)
    return tl.load(x_rows + offs_h[:, None], mask=mask, other=0)


@triton.jit
def _router_kernel(
    x_ptr, r_ptr, g_ptr, part_ptr, count_ptr, weights_ptr, ids_ptr, gate_ptr,
    M, E, H, stride_xm, stride_re,
    res_ptr, nw_ptr, xo_ptr, ho_ptr, eps, stride_rm, stride_om,
    TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, X_DTYPE: tl.constexpr,
    DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, ALL_E: tl.constexpr, ROUTE_M: tl.constexpr,
    BLOCK_K: tl.constexpr, HAS_GATE: tl.constexpr, SHARED_SLOT: tl.constexpr, INTERPRET: tl.constexpr,
    USE_PDL: tl.constexpr = False, KEY32: tl.constexpr = False,
    NORM: tl.constexpr = 0, NORM_D: tl.constexpr = 16, NW_DTYPE: tl.constexpr = tl.float32,
):
    """Router logits and routing in one launch, for at most 16 tokens: program ``(i, s)`` computes the fp32 logits
    of experts ``[i * BLOCK_E, (i + 1) * BLOCK_E)`` over H slice ``s`` (``tl.dot``, token rows padded to 16) into
    ``part[s]``; the last program to take a ticket adds the slices in order, rounds the logits to x's dtype (as a
    GEMM in that dtype does) and runs :func:`_route_rows` on them. With ``HAS_GATE`` the shared expert's gate
    ``g [H]`` is row ``E`` of the product, computed by one more row of programs (an fp32 multiply and sum, not a
    tile of its own, to keep the registers of the expert tiles'): its partial logits are summed the same way, not
    rounded, and ``sigmoid(logit)`` goes to ``gate [M]``; with ``SHARED_SLOT`` instead to one more column of the
    routing, ``weights[t, TOP_K]``, its id ``ids[t, TOP_K] = E`` (the shared expert as the stack's expert ``E``;
    the routing's rows are then ``TOP_K + 1`` long).

    ``NORM`` folds the block's RMSNorm in front (as the packed GEMV does, :func:`~lynn_kernels.triton_shared.norm_row`):
    x is ``rmsnorm(x + r) * (1 + nw)`` (2) or ``rmsnorm(x) * (1 + nw)`` (1); every program computes the rows'
    ``rstd`` and normalises the x tiles it loads, and program ``(0, 0)`` writes the normed rows to ``xo`` and
    ``x + r`` to ``ho``, which the expert kernels after it read.

    The first chunk of a program's weights (its router tile, or the gate's slice) loads before the wait on the
    kernel before (PDL): no earlier kernel writes them."""
    pid_e = tl.program_id(0)
    pid_h = tl.program_id(1)
    n_split = tl.num_programs(1)
    if HAS_GATE:                                         # the product's rows: the experts, then the gate
        E_ALL = E + 1
    else:
        E_ALL = E
    offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    mask_e = offs_e < E
    offs_m = tl.arange(0, 16)
    mask_m = offs_m < M
    n_chunks = tl.cdiv(H, BLOCK_H)
    per_split = tl.cdiv(n_chunks, n_split)
    c0 = pid_h * per_split
    c1 = tl.minimum(c0 + per_split, n_chunks)
    is_gate = pid_e < 0
    if HAS_GATE:                                         # the last row of programs computes the gate's row
        is_gate = pid_e == tl.cdiv(E, BLOCK_E)
    offs_h0 = c0 * BLOCK_H + tl.arange(0, BLOCK_H)
    r0 = tl.load(r_ptr + offs_e[:, None].to(tl.int64) * stride_re + offs_h0[None, :],
                 mask=mask_e[:, None] & (offs_h0[None, :] < H) & (c0 < c1), other=0)     # the gate's: none
    g0 = tl.load(g_ptr + offs_h0, mask=(offs_h0 < H) & (c0 < c1) & is_gate, other=0)
    pdl_enter(USE_PDL)
    rstd = tl.full((16,), 1.0, tl.float32)
    if NORM > 0:                                         # each row's rstd; program (0, 0) writes the normed rows
        for mm in range(0, M):
            rs = norm_row(x_ptr, res_ptr, nw_ptr, xo_ptr, ho_ptr, mm, M, H, eps, stride_xm, stride_rm, stride_om,
                          (pid_e == 0) & (pid_h == 0), NORM, NORM_D, X_DTYPE, NW_DTYPE, INTERPRET)
            rstd = tl.where(offs_m == mm, rs, rstd)
    x_rows = x_ptr + offs_m[None, :].to(tl.int64) * stride_xm
    r_rows = res_ptr + offs_m[None, :].to(tl.int64) * stride_rm
    if is_gate:
        acc_g = tl.zeros((16,), dtype=tl.float32)
        for chunk in range(c0, c1):
            offs_h = chunk * BLOCK_H + tl.arange(0, BLOCK_H)
            if chunk == c0:
                g = g0
            else:
                g = tl.load(g_ptr + offs_h, mask=offs_h < H, other=0)
            xt = _x_tile(x_rows, r_rows, nw_ptr, offs_h, rstd, mask_m[None, :] & (offs_h[:, None] < H), NORM,
                         X_DTYPE, NW_DTYPE, INTERPRET)
            acc_g += tl.sum(to_float32(g, X_DTYPE, INTERPRET)[:, None] * to_float32(xt, X_DTYPE, INTERPRET), axis=0)
        tl.store(part_ptr + pid_h * (M * E_ALL) + offs_m * E_ALL + E, acc_g, mask=mask_m)
    else:
        acc = tl.zeros((BLOCK_E, 16), dtype=tl.float32)
        for chunk in range(c0, c1):
            offs_h = chunk * BLOCK_H + tl.arange(0, BLOCK_H)
            if chunk == c0:
                r = r0
            else:
                r = tl.load(r_ptr + offs_e[:, None].to(tl.int64) * stride_re + offs_h[None, :],
                            mask=mask_e[:, None] & (offs_h[None, :] < H), other=0)
            xt = _x_tile(x_rows, r_rows, nw_ptr, offs_h, rstd, mask_m[None, :] & (offs_h[:, None] < H), NORM,
                         X_DTYPE, NW_DTYPE, INTERPRET)
            acc = tl.dot(to_float32(r, X_DTYPE, INTERPRET).to(DOT_DTYPE),
                         to_float32(xt, X_DTYPE, INTERPRET).to(DOT_DTYPE), acc, input_precision=PRECISION)
        tl.store(part_ptr + pid_h * (M * E_ALL) + offs_m[None, :] * E_ALL + offs_e[:, None], acc,
                 mask=mask_e[:, None] & mask_m[None, :])
    tl.debug_barrier()                                   # every thread's partial is written before the ticket
    ticket = tl.atomic_add(count_ptr, 1, sem="acq_rel")
    if ticket == tl.num_programs(0) * n_split - 1:       # the last program: all partial logits are in
        offs_all = tl.arange(0, ALL_E)
        mask_all = offs_all < E
        for m0 in range(0, M, ROUTE_M):
            rows = m0 + tl.arange(0, ROUTE_M)
            mask = (rows[:, None] < M) & mask_all[None, :]
            logits = tl.zeros((ROUTE_M, ALL_E), dtype=tl.float32)
            g = tl.zeros((ROUTE_M,), dtype=tl.float32)
            for s in range(0, n_split):                  # in split order: the same sum on every run
                logits += tl.load(part_ptr + s * (M * E_ALL) + rows[:, None] * E_ALL + offs_all[None, :],
                                  mask=mask, other=0.0, cache_modifier=".cg")
                if HAS_GATE:                             # the gate's partials with the logits', not after the top-k
                    g += tl.load(part_ptr + s * (M * E_ALL) + rows * E_ALL + E, mask=rows < M, other=0.0,
                                 cache_modifier=".cg")
            logits = tl.where(mask_all[None, :], round_to_dtype(logits, X_DTYPE, INTERPRET), float("-inf"))
            w, ids = _route_rows(logits, offs_all, mask_all, TOP_K, RENORMALIZE, ROUTE_M, ALL_E, BLOCK_K, KEY32)
            _store_route(weights_ptr, ids_ptr, w, ids, rows, rows < M, TOP_K, BLOCK_K, TOP_K + SHARED_SLOT)
            if HAS_GATE:
                if SHARED_SLOT:
                    tl.store(weights_ptr + rows * (TOP_K + 1) + TOP_K, 1.0 / (1.0 + tl.exp(-g)), mask=rows < M)
                    tl.store(ids_ptr + rows * (TOP_K + 1) + TOP_K, rows * 0 + E, mask=rows < M)
                else:
                    tl.store(gate_ptr + rows, 1.0 / (1.0 + tl.exp(-g)), mask=rows < M)
        tl.atomic_xchg(count_ptr, 0)                     # ready for the next call


ROUTER = runtime.Kernel("moe.router", _router_kernel)


def _block_m(M: int, block_e: int, interpret: bool = runtime.INTERPRET) -> int:
    """Tokens per program: about 4k fp32 logits in registers on the GPU; as many as fit 64k under the interpreter
    (its cost is per program). ``interpret=False``: the GPU's, for tests."""
    cap = (1 << 16) // block_e if interpret else min(32, (1 << 12) // block_e)
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
                 ids: torch.Tensor, block_m: int | None = None, *, kernel=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch only (no checks, no host sync), into contiguous ``weights`` fp32 and ``ids`` int32 ``[M, top_k]``.
    ``block_m`` (tokens per program, a power of two) overrides :func:`_block_m` (tests). ``kernel`` (a
    ``@triton.jit`` function with ``_route_kernel``'s parameters) replaces the shipped kernel."""
    M, E = logits.shape
    if M == 0:
        return weights, ids
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    block_e = max(16, runtime.next_power_of_2(E))
    block_m = block_m or _block_m(M, block_e)
    ROUTE.current(kernel)[(runtime.cdiv(M, block_m),)](
        kernel_view(logits), weights, ids, M, E, logits.stride(0),
        TOP_K=top_k, RENORMALIZE=renormalize, DTYPE=runtime.TORCH_TO_TL[logits.dtype],
        BLOCK_M=block_m, BLOCK_E=block_e, BLOCK_K=max(2, runtime.next_power_of_2(top_k)),
        KEY32=_key32(logits.dtype, block_e), num_warps=4, **runtime.kernel_flags())
    return weights, ids


#: Top-k keys of 32 bits where the logits are bf16 (``_route_rows``' ``KEY32``: the same ids and weights, half the
#: width of each round's reduction): a faster decode step (docs/history/decode.md); ``lynn bench decoder`` times the
#: 64-bit keys beside it.
ROUTER_KEY32 = True


def _key32(dtype: torch.dtype, block_e: int) -> bool:
    return ROUTER_KEY32 and dtype == torch.bfloat16 and block_e <= 1 << 16


@triton.jit
def _shared_gate_kernel(x_ptr, w_ptr, gate_ptr, M, H, stride_xm, X_DTYPE: tl.constexpr, W_DTYPE: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, INTERPRET: tl.constexpr):
    """``gate[m] = sigmoid(x[m] . w)`` in fp32 for a block of rows: products and sums fp32, x read once as it is."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    acc = tl.zeros((BLOCK_M, BLOCK_H), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        mask_h = offs_h < H
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_h[None, :],
                    mask=mask_m[:, None] & mask_h[None, :], other=0)
        w = tl.load(w_ptr + offs_h, mask=mask_h, other=0)
        acc += to_float32(x, X_DTYPE, INTERPRET) * to_float32(w, W_DTYPE, INTERPRET)[None, :]
    tl.store(gate_ptr + offs_m, tl.sigmoid(tl.sum(acc, axis=1)), mask=mask_m)


SHARED_GATE = runtime.Kernel("moe.shared_gate", _shared_gate_kernel)

#: Rows and columns of H a program of the shared expert's gate takes on the GPU.
SHARED_GATE_CONFIG = {"BLOCK_M": 16, "BLOCK_H": 512, "num_warps": 4}


def launch_shared_gate(x2: torch.Tensor, gate_weight: torch.Tensor, gate: torch.Tensor, *,
                       kernel=None) -> torch.Tensor:
    """Launch only: ``gate [M]`` fp32 ``= sigmoid(x2 @ gate_weight)`` for ``x2 [M, H]`` (unit stride along H) and
    ``gate_weight [H]`` (contiguous), fp32 products and sums: the shared expert's gate of a prefill, without an fp32
    copy of x. ``kernel`` (with ``_shared_gate_kernel``'s parameters) replaces the shipped kernel."""
    M, H = x2.shape
    if M == 0:
        return gate
    meta = dict(SHARED_GATE_CONFIG)
    if runtime.INTERPRET:
        meta = {"BLOCK_M": max(1, min(64, runtime.next_power_of_2(M))),
                "BLOCK_H": max(16, min(2048, runtime.next_power_of_2(H))), "num_warps": 4}
    warps = meta.pop("num_warps")
    SHARED_GATE.current(kernel)[(runtime.cdiv(M, meta["BLOCK_M"]),)](
        kernel_view(x2), kernel_view(gate_weight), gate, M, H, x2.stride(0),
        X_DTYPE=runtime.TORCH_TO_TL[x2.dtype], W_DTYPE=runtime.TORCH_TO_TL[gate_weight.dtype], **meta,
        num_warps=warps, **runtime.kernel_flags())
    return gate


#: Largest token count :func:`launch_router` takes (its GEMM pads the token rows to one 16-row tile).
ROUTER_MAX_M = 16
#: GPU tiles of the router GEMM: 16 experts x 512 of H per program, H split so that E = 256 gives 64 programs.
ROUTER_CONFIG = {"BLOCK_E": 16, "BLOCK_H": 512, "num_warps": 4}


def launch_router(x2: torch.Tensor, router_weight: torch.Tensor, top_k: int, renormalize: bool,
                  weights: torch.Tensor, ids: torch.Tensor, config: dict | None = None,
                  gate_weight: torch.Tensor | None = None, gate: torch.Tensor | None = None,
                  shared_slot: bool = False, norm: tuple | None = None, *,
                  kernel=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch only (no checks, no host sync): the router logits ``x2 @ router_weight^T`` (``x2 [M, H]`` with
    ``M <= ROUTER_MAX_M``, ``router_weight [E, H]`` in x's dtype, both unit stride along H), rounded to x's dtype,
    and their routing, in one launch, into contiguous ``weights`` fp32 and ``ids`` int32 ``[M, top_k]``. The fp32
    partial logits go to a small workspace; the ticket counter is the matmul's shared zeroed buffer (one stream at a
    time). ``config`` (``BLOCK_E``, ``BLOCK_H``, ``num_warps``) replaces the tiles, e.g. :data:`ROUTER_CONFIG` under
    the interpreter (tests). With ``gate_weight`` (the shared expert's gate, ``H`` values of x's dtype, unit
    stride) the same launch also writes ``gate [M]`` fp32: ``sigmoid(x2 @ gate_weight)``, the product in fp32 and
    not rounded, as the reference's. With ``shared_slot`` (and ``gate_weight``, no ``gate``) ``weights`` and ``ids``
    are ``[M, top_k + 1]``: the last column gets the gate and the id ``E``, the shared expert as one more slot.
    ``norm = (residual, norm_weight, eps, x_out, residual_out)`` folds the block's RMSNorm in front: the logits are
    of ``rmsnorm(x2 + residual) * (1 + norm_weight)`` (``residual`` None: of ``rmsnorm(x2)``), written to ``x_out``
    for the expert kernels, and ``x2 + residual`` to ``residual_out`` (contiguous ``[M, H]``, ``H <= 8192``).
    ``kernel`` (a ``@triton.jit`` function with ``_router_kernel``'s parameters) replaces the shipped kernel."""
    M, H = x2.shape
    E = router_weight.shape[0]
    if M == 0:
        return weights, ids
    has_gate = gate_weight is not None
    if shared_slot and (not has_gate or gate is not None or ids.shape[-1] != top_k + 1):
        raise ValueError(f"shared_slot needs gate_weight, no gate, and weights / ids of top_k + 1 = {top_k + 1} "
                         f"columns, got ids {tuple(ids.shape)}")
    if has_gate and gate is None and not shared_slot:
        raise ValueError("gate_weight needs somewhere to write the gate: pass gate (fp32 [M]) or shared_slot=True")
    c = kernel_constexprs(x2.dtype, None, x2.dtype, runtime.INTERPRET)
    all_e = max(16, runtime.next_power_of_2(E))
    if runtime.INTERPRET:
        meta = {"BLOCK_E": max(16, min(128, all_e)), "BLOCK_H": max(16, min(512, runtime.next_power_of_2(H))),
                "num_warps": 4}
    else:
        meta = dict(ROUTER_CONFIG)
    if config is not None:
        meta = dict(config)
    warps = meta.pop("num_warps", 4)
    n_e = runtime.cdiv(E, meta["BLOCK_E"]) + has_gate             # the gate: one more row of programs
    split = split_k_for(n_e, H, meta["BLOCK_H"], 32)               # about 64 programs, no empty H slice
    part = torch.empty((split, M, E + has_gate), dtype=torch.float32, device=x2.device)
    g = kernel_view(gate_weight) if has_gate else x2                # valid pointers when unused
    if norm is None:
        r = nw = xo = ho = x2
        eps, stride_rm, stride_om, norm_meta = 0.0, 0, 0, {}
    else:
        r, nw, eps, xo, ho = norm
        if H > 8192:
            raise ValueError(f"the norm folded into the router holds a row of x in registers: H <= 8192, got {H}")
        if r is None:
            r = ho = x2
        stride_rm, stride_om = r.stride(0), xo.stride(0)
        norm_meta = {"NORM": 1 if norm[0] is None else 2, "NORM_D": runtime.next_power_of_2(H),
                     "NW_DTYPE": runtime.TORCH_TO_TL[nw.dtype]}
    ROUTER.current(kernel)[(n_e, split)](
        kernel_view(x2), kernel_view(router_weight), g, part, split_k_counter(x2.device, 1), weights, ids,
        gate if gate is not None else weights, M, E, H, x2.stride(0), router_weight.stride(0),
        kernel_view(r), kernel_view(nw), kernel_view(xo), kernel_view(ho), float(eps), stride_rm, stride_om,
        TOP_K=top_k, RENORMALIZE=renormalize, X_DTYPE=c["X_DTYPE"], DOT_DTYPE=c["DOT_DTYPE"],
        PRECISION=c["PRECISION"], ALL_E=all_e, ROUTE_M=max(1, min(runtime.next_power_of_2(M), 4096 // all_e)),
        BLOCK_K=max(2, runtime.next_power_of_2(top_k)), HAS_GATE=has_gate, SHARED_SLOT=shared_slot,
        KEY32=_key32(x2.dtype, all_e), **meta, **norm_meta,
        num_warps=warps,
        num_stages=runtime.register_dot_stages(3), INTERPRET=c["INTERPRET"],   # 3: Triton's default
        **runtime.pdl_flags())
    return weights, ids
