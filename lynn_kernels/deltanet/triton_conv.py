"""Depthwise causal conv1d + SiLU in Triton: a prefill kernel over ``[B, T, C]`` (or packed sequences, ``cu_seqlens``)
and a one-token update that rolls the conv state in place.

The conv state ``[B, C, S]`` (``S >= W - 1``) holds the last ``S`` raw inputs, oldest first, in x's dtype: HF's
cache keeps ``S = W``, causal-conv1d and vLLM keep ``S = W - 1``; both work. The state is copied as raw bits, never
rounded, and the sum runs in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import runtime
from ..runtime import cast_output, kernel_view, pdl_enter, to_float32
from . import spec


@triton.jit
def _conv_taps(x_base, h0_base, w_ptr, offs_l, offs_c, mask_t, mask_c, bos, S0, stride_xt, stride_wc,
               stride_ww, stride_h0c, stride_h0s, W: tl.constexpr, X_DTYPE: tl.constexpr, W_DTYPE: tl.constexpr,
               WITH_STATE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, INTERPRET: tl.constexpr):
    """The conv's fp32 sum over its ``W`` taps, oldest first, for a block of positions: a position before the
    sequence reads 0 from x, and with ``WITH_STATE`` the initial state's column instead (the two loads' sum)."""
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for j in tl.static_range(W):
        src = offs_l - (W - 1) + j                                   # input position; < 0 reads the initial state
        in_x = mask_t & (src >= 0)
        xs = tl.load(x_base + (bos + src)[:, None].to(tl.int64) * stride_xt + offs_c[None, :],
                     mask=in_x[:, None] & mask_c[None, :], other=0)
        xs = to_float32(xs, X_DTYPE, INTERPRET)                                       # [BLOCK_T, BLOCK_C]
        if WITH_STATE:
            in_h = mask_t & (src < 0)
            hs = tl.load(h0_base + offs_c[None, :] * stride_h0c + (S0 + src)[:, None] * stride_h0s,
                         mask=in_h[:, None] & mask_c[None, :], other=0)
            xs += to_float32(hs, X_DTYPE, INTERPRET)
        wj = to_float32(tl.load(w_ptr + offs_c * stride_wc + j * stride_ww, mask=mask_c, other=0),
                        W_DTYPE, INTERPRET)                                           # [BLOCK_C]
        acc += xs * wj[None, :]
    return acc


@triton.jit
def _causal_conv1d_kernel(
    x_ptr, w_ptr, h0_ptr, y_ptr, ht_ptr, cu_ptr, idx_ptr,
    T, C, S0, S1,
    stride_xb, stride_xt, stride_wc, stride_ww, stride_h0b, stride_h0c, stride_h0s,
    W: tl.constexpr, X_DTYPE: tl.constexpr, W_DTYPE: tl.constexpr, HAS_INIT: tl.constexpr,
    STORE_FINAL: tl.constexpr, IS_VARLEN: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_W: tl.constexpr, INTERPRET: tl.constexpr,
):
    """``S0``: columns of the initial state; ``S1``: columns of the final state (``[B, C, S1]``, contiguous);
    ``BLOCK_W``: ``W - 1`` rounded up to a power of two (the rows that read the initial state).

    ``IS_VARLEN`` (B = 1, packed sequences): program ``pid_t`` takes row ``pid_t`` of the block table ``idx [NB, 2]``
    (sequence ``n``, block ``j`` of it; :func:`.spec.packed_blocks`); sequence ``n`` is rows ``cu[n]:cu[n+1]`` of x
    and y and row ``n`` of both states. Otherwise block ``pid_t`` of batch row ``pid_b``, state row ``pid_b``."""
    pid_t = tl.program_id(0)
    pid_c = tl.program_id(1)
    pid_b = tl.program_id(2)
    if IS_VARLEN:
        i_n = tl.load(idx_ptr + 2 * pid_t)                   # the sequence: its row of the states
        i_blk = tl.load(idx_ptr + 2 * pid_t + 1)             # the block within it
        bos = tl.load(cu_ptr + i_n)
        eos = tl.load(cu_ptr + i_n + 1)
    else:
        i_n = pid_b
        i_blk = pid_t
        bos = 0
        eos = T
    offs_l = i_blk * BLOCK_T + tl.arange(0, BLOCK_T)         # positions in the sequence
    offs_t = bos + offs_l                                    # rows of x and y
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_t = offs_t < eos
    mask_c = offs_c < C
    x_base = x_ptr + pid_b.to(tl.int64) * stride_xb
    h0_base = h0_ptr + i_n.to(tl.int64) * stride_h0b
    y_base = y_ptr + pid_b.to(tl.int64) * T * C
    # every block sums x alone; the first W - 1 positions of a sequence, which reach into the initial state, are a
    # tile of BLOCK_W rows of their own, so the masked state gathers cost the other blocks neither instructions
    # nor registers (2.4x at 16,384 positions)
    acc = _conv_taps(x_base, h0_base, w_ptr, offs_l, offs_c, mask_t, mask_c, bos, S0, stride_xt, stride_wc,
                     stride_ww, stride_h0c, stride_h0s, W, X_DTYPE, W_DTYPE, False, BLOCK_T, BLOCK_C, INTERPRET)
    mask_y = mask_t
    if HAS_INIT:
        mask_y = mask_t & (offs_l >= W - 1)
    y = acc * tl.sigmoid(acc)                                                         # SiLU
    tl.store(y_base + offs_t[:, None].to(tl.int64) * C + offs_c[None, :], cast_output(y, X_DTYPE, INTERPRET),
             mask=mask_y[:, None] & mask_c[None, :])
    if HAS_INIT:
        if i_blk * BLOCK_T < W - 1:
            offs_w = i_blk * BLOCK_T + tl.arange(0, BLOCK_W)
            mask_w = (offs_w < W - 1) & (offs_w < (i_blk + 1) * BLOCK_T) & (bos + offs_w < eos)
            acc_w = _conv_taps(x_base, h0_base, w_ptr, offs_w, offs_c, mask_w, mask_c, bos, S0, stride_xt,
                               stride_wc, stride_ww, stride_h0c, stride_h0s, W, X_DTYPE, W_DTYPE, True, BLOCK_W,
                               BLOCK_C, INTERPRET)
            y_w = acc_w * tl.sigmoid(acc_w)
            tl.store(y_base + (bos + offs_w)[:, None].to(tl.int64) * C + offs_c[None, :],
                     cast_output(y_w, X_DTYPE, INTERPRET), mask=mask_w[:, None] & mask_c[None, :])

    if STORE_FINAL:
        if i_blk == 0:                      # the first block of each sequence and channel block: the last S1 inputs
            offs_s = tl.arange(0, BLOCK_S)
            mask_s = offs_s < S1
            pos = (eos - bos) - S1 + offs_s                  # [BLOCK_S]: position in the sequence, < 0 in the state
            from_x = mask_s & (pos >= 0)
            vals = tl.load(x_base + (bos + pos)[None, :].to(tl.int64) * stride_xt + offs_c[:, None],
                           mask=mask_c[:, None] & from_x[None, :], other=0)         # [BLOCK_C, BLOCK_S], raw bits
            if HAS_INIT:
                from_h = mask_s & (pos < 0)
                h_vals = tl.load(h0_base + offs_c[:, None] * stride_h0c + (S0 + pos)[None, :] * stride_h0s,
                                 mask=mask_c[:, None] & from_h[None, :], other=0)
                vals = tl.where(from_h[None, :], h_vals, vals)   # a select, not a sum: -0.0 and NaN bits survive
            tl.store(ht_ptr + (i_n.to(tl.int64) * C + offs_c[:, None]) * S1 + offs_s[None, :], vals,
                     mask=mask_c[:, None] & mask_s[None, :])


CONV = runtime.Kernel("deltanet.conv", _causal_conv1d_kernel)


@triton.jit
def conv_state_sum(state_row, w_ptr, chan, mask, stride_sc, stride_ss, stride_wc, stride_ww, S,
                   W: tl.constexpr, X_DTYPE: tl.constexpr, W_DTYPE: tl.constexpr, INTERPRET: tl.constexpr,
                   L2_ONLY: tl.constexpr = False):
    """The part of one conv decode step that reads no new input: ``(the fp32 sum of the newest W - 1 state columns
    of channels chan against weights 0..W-2, oldest first; weight W-1 as fp32)``. :func:`conv_finish` adds the
    new input; the two together are the prefill kernel's order of operations (the same bits). ``L2_ONLY``: the
    state loads go through L2 only (``.cg``)."""
    base = state_row + chan * stride_sc
    acc = tl.zeros(chan.shape, dtype=tl.float32)
    for j in tl.static_range(W - 1):        # the newest W - 1 state columns meet weights 0..W-2, oldest first
        if L2_ONLY:
            xs = tl.load(base + (S - (W - 1) + j) * stride_ss, mask=mask, other=0, cache_modifier=".cg")
        else:
            xs = tl.load(base + (S - (W - 1) + j) * stride_ss, mask=mask, other=0)
        xs = to_float32(xs, X_DTYPE, INTERPRET)
        wj = to_float32(tl.load(w_ptr + chan * stride_wc + j * stride_ww, mask=mask, other=0), W_DTYPE, INTERPRET)
        acc += xs * wj
    w_last = to_float32(tl.load(w_ptr + chan * stride_wc + (W - 1) * stride_ww, mask=mask, other=0),
                        W_DTYPE, INTERPRET)
    return acc, w_last


@triton.jit
def conv_finish(acc, w_last, x_raw, X_DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """The conv's last term, the new input ``x_raw`` (x's dtype) against the last weight, then SiLU (fp32)."""
    acc += to_float32(x_raw, X_DTYPE, INTERPRET) * w_last      # same order as the prefill kernel: same bits
    return acc * tl.sigmoid(acc)


@triton.jit
def conv_update_channels(x_row, state_row, w_ptr, chan, mask, stride_sc, stride_ss, stride_wc, stride_ww, S,
                         W: tl.constexpr, X_DTYPE: tl.constexpr, W_DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """One decode step of the conv on channels ``chan`` of one row: ``(silu(sum) fp32, the raw new inputs)``, the
    sum over the newest ``W - 1`` state columns and the new input in the prefill kernel's order (the same bits)."""
    x_raw = tl.load(x_row + chan, mask=mask, other=0)
    acc, w_last = conv_state_sum(state_row, w_ptr, chan, mask, stride_sc, stride_ss, stride_wc, stride_ww, S, W,
                                 X_DTYPE, W_DTYPE, INTERPRET)
    return conv_finish(acc, w_last, x_raw, X_DTYPE, INTERPRET), x_raw


@triton.jit
def _causal_conv1d_update_kernel(
    x_ptr, state_ptr, w_ptr, y_ptr,
    C, S,
    stride_xb, stride_sb, stride_sc, stride_ss, stride_wc, stride_ww,
    W: tl.constexpr, X_DTYPE: tl.constexpr, W_DTYPE: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr,
    INTERPRET: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_enter(USE_PDL)
    pid_c = tl.program_id(0)
    pid_b = tl.program_id(1)
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_c = offs_c < C
    state_base = state_ptr + pid_b.to(tl.int64) * stride_sb + offs_c * stride_sc
    y, x_raw = conv_update_channels(x_ptr + pid_b.to(tl.int64) * stride_xb, state_ptr + pid_b.to(tl.int64) * stride_sb,
                                    w_ptr, offs_c, mask_c, stride_sc, stride_ss, stride_wc, stride_ww, S, W, X_DTYPE,
                                    W_DTYPE, INTERPRET)
    tl.store(y_ptr + pid_b.to(tl.int64) * C + offs_c, cast_output(y, X_DTYPE, INTERPRET), mask=mask_c)

    # roll: column s takes column s + 1, the last column takes x (raw bits)
    offs_s = tl.arange(0, BLOCK_S)
    keep = (offs_s + 1) < S
    shifted = tl.load(state_base[:, None] + (offs_s + 1)[None, :] * stride_ss,
                      mask=mask_c[:, None] & keep[None, :], other=0)                 # [BLOCK_C, BLOCK_S]
    tl.debug_barrier()                                      # every thread has read the old state before any writes
    tl.store(state_base[:, None] + offs_s[None, :] * stride_ss, shifted, mask=mask_c[:, None] & keep[None, :])
    tl.store(state_base + (S - 1) * stride_ss, x_raw, mask=mask_c)


CONV_UPDATE = runtime.Kernel("deltanet.conv_update", _causal_conv1d_update_kernel)


#: The prefill kernel's GPU tile: ``BLOCK_T`` positions x up to ``BLOCK_C`` channels, ``num_warps``.
CONV_CONFIG = {"BLOCK_T": 32, "BLOCK_C": 128, "num_warps": 4}


def _conv_blocks(C: int, most: int = 256) -> int:
    return min(most, max(16, runtime.next_power_of_2(C)))


def causal_conv1d_triton(x, weight, initial_state=None, *, cu_seqlens=None):
    """Host side of :func:`lynn_kernels.deltanet.causal_conv1d` (reads ``cu_seqlens`` to the host once)."""
    spec.check_devices(x=x)             # first: check_conv reads cu_seqlens once it is on x's device
    B, T, C, W, S, cu = spec.check_conv(x, weight, initial_state, cu_seqlens)
    spec.check_devices(x=x, weight=weight, initial_state=initial_state, cu_seqlens=cu_seqlens)
    N = B if cu is None else len(cu) - 1
    y = torch.empty((B, T, C), dtype=x.dtype, device=x.device)
    final = torch.empty((N, C, S), dtype=x.dtype, device=x.device)
    return launch_causal_conv1d(x, weight, initial_state, y, final, cu), final


def launch_causal_conv1d(x, weight, initial_state, y: torch.Tensor, final: torch.Tensor | None,
                         cu: tuple[int, ...] | None = None, *, kernel=None) -> torch.Tensor:
    """Launch only, into contiguous ``y [B, T, C]`` and ``final [B, C, S]`` (or none). ``cu``: the offsets of packed
    sequences as host ints (x ``[1, T, C]``, states ``[N, C, S]``), or None; their block table is built once per
    layout (:func:`.spec.packed_blocks`). ``kernel`` (a ``@triton.jit`` function with ``_causal_conv1d_kernel``'s
    parameters) replaces the shipped kernel."""
    B, T, C = x.shape
    W = weight.shape[1]
    x = spec.last_dim_contiguous(x)
    S0 = initial_state.shape[2] if initial_state is not None else W - 1
    S1 = final.shape[2] if final is not None else 0
    h0 = initial_state if initial_state is not None else x
    BLOCK_T = 64 if runtime.INTERPRET else CONV_CONFIG["BLOCK_T"]
    BLOCK_C = _conv_blocks(C) if runtime.INTERPRET else _conv_blocks(C, CONV_CONFIG["BLOCK_C"])
    xv = kernel_view(x)
    if cu is None:
        cu_t = index = xv                                    # never read
        grid = (max(1, runtime.cdiv(T, BLOCK_T)), runtime.cdiv(C, BLOCK_C), B)
    else:                                                    # every sequence, even an empty one, gets a block
        cu_t, index, _ = spec.packed_blocks(cu, BLOCK_T, x.device, empty_block=True)
        grid = (index.shape[0], runtime.cdiv(C, BLOCK_C), 1)
    CONV.current(kernel)[grid](
        xv, kernel_view(weight), kernel_view(h0), kernel_view(y), kernel_view(final) if final is not None else xv,
        cu_t, index, T, C, S0, S1,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), h0.stride(0), h0.stride(1), h0.stride(2),
        W=W, X_DTYPE=runtime.TORCH_TO_TL[x.dtype], W_DTYPE=runtime.TORCH_TO_TL[weight.dtype],
        HAS_INIT=initial_state is not None, STORE_FINAL=final is not None, IS_VARLEN=cu is not None,
        BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C, BLOCK_S=max(2, runtime.next_power_of_2(max(S1, 1))),
        BLOCK_W=max(2, runtime.next_power_of_2(W - 1)), num_warps=CONV_CONFIG["num_warps"], **runtime.kernel_flags())
    return y


def causal_conv1d_update_triton(x, conv_state, weight):
    """Host side of :func:`lynn_kernels.deltanet.causal_conv1d_update`."""
    B, C, W, S = spec.check_conv_update(x, conv_state, weight)
    spec.check_devices(x=x, conv_state=conv_state, weight=weight)
    y = torch.empty((B, C), dtype=x.dtype, device=x.device)
    return launch_causal_conv1d_update(x, conv_state, weight, y)


def launch_causal_conv1d_update(x, conv_state, weight, y: torch.Tensor, *, kernel=None) -> torch.Tensor:
    """Launch only, into a contiguous ``y [B, C]``; ``conv_state`` is rolled in place. ``kernel`` (a ``@triton.jit``
    function with ``_causal_conv1d_update_kernel``'s parameters) replaces the shipped kernel."""
    B, C = x.shape
    S = conv_state.shape[2]
    x = spec.last_dim_contiguous(x)
    BLOCK_C = _conv_blocks(C)
    CONV_UPDATE.current(kernel)[(runtime.cdiv(C, BLOCK_C), B)](
        kernel_view(x), kernel_view(conv_state), kernel_view(weight), kernel_view(y), C, S,
        x.stride(0), conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        weight.stride(0), weight.stride(1),
        W=weight.shape[1], X_DTYPE=runtime.TORCH_TO_TL[x.dtype], W_DTYPE=runtime.TORCH_TO_TL[weight.dtype],
        BLOCK_C=BLOCK_C, BLOCK_S=max(2, runtime.next_power_of_2(S)), **runtime.kernel_flags(),
        **runtime.pdl_flags())
    return y
