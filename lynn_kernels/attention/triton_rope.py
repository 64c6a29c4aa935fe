"""Fused QK RMSNorm ((1 + w), fp32) + partial rotate_half RoPE + KV-cache write, for prefill and decode alike.

One program handles ``BLOCK_T`` tokens of one head: heads ``0..Hq-1`` are query heads, ``Hq..Hq+Hkv-1`` key heads
(which also copy ``v`` into the cache). RoPE pairs dim ``d < R/2`` with its rotate_half partner ``d + R/2``: the
kernel loads the two halves of the rotated dims again as tiles of their own (L1 hits) instead of shuffling
registers, so cos and sin are computed for ``R/2`` columns, not for the whole head.

cos / sin come from tables (``cos, sin [P, R]``, gathered by position: bit-for-bit whatever the caller built, e.g.
:func:`.reference.rope_cos_sin`, HF's own numbers) or are computed in-kernel from ``rope_theta``: the angle
``position * inv_freq`` is the same fp32 product HF forms, reduced into [-pi, pi] with a three-part 2 pi
(Cody-Waite, exact while the angle is under 2^16 - 1 turns) so that the GPU's fast ``sin`` / ``cos`` stay accurate.
``inv_freq[0] = 1``, so the angle is at most the position: positions past
:data:`.spec.ROPE_THETA_MAX_POSITION` (411,768) are refused on this path; tables have no such limit.

The RMSNorm weights enter the kernel as fp32 (each its own dtype converted exactly; they are only ``[D]`` long).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import runtime
from ..runtime import cast_output, kernel_view, pdl_enter, to_float32
from .reference import rope_inv_freq
from .spec import check_devices, check_rope, last_dim_contiguous

# 2 pi = C1 + C2 + C3, with C1 and C2 8-bit so that k * C1 and k * C2 are exact for k < 2^16
_TWO_PI_1 = tl.constexpr(6.28125)
_TWO_PI_2 = tl.constexpr(0.0019378662109375)
_TWO_PI_3 = tl.constexpr(-2.5590314e-06)
_INV_TWO_PI = tl.constexpr(0.15915494309189535)


@triton.jit
def _cos_sin(x):
    """cos and sin of fp32 angles ``x``, after reducing them into [-pi, pi]."""
    k = tl.floor(x * _INV_TWO_PI + 0.5)
    r = ((x - k * _TWO_PI_1) - k * _TWO_PI_2) - k * _TWO_PI_3
    return tl.cos(r), tl.sin(r)


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, pos_ptr, inv_freq_ptr, cos_ptr, sin_ptr,
    q_out_ptr, k_out_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    T, HQ, HKV, eps,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cos, stride_sin,
    stride_kc0, stride_kc1, stride_kch, stride_vc0, stride_vc1, stride_vch, CACHE_ROWS,
    HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr, TABLE: tl.constexpr, WRITE_CACHE: tl.constexpr,
    IN_DTYPE: tl.constexpr, TABLE_DTYPE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, INTERPRET: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_enter(USE_PDL)
    HALF: tl.constexpr = ROT_DIM // 2
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < T
    offs_d = tl.arange(0, HEAD_DIM)
    rows_t = offs_t.to(tl.int64)
    if pid_h < HQ:                                                      # a query head
        x_row = q_ptr + rows_t * stride_qt + pid_h * stride_qh
        w_ptr = qw_ptr
        o_row = q_out_ptr + (rows_t * HQ + pid_h) * HEAD_DIM
    else:                                                               # a key head
        x_row = k_ptr + rows_t * stride_kt + (pid_h - HQ) * stride_kh
        w_ptr = kw_ptr
        o_row = k_out_ptr + (rows_t * HKV + pid_h - HQ) * HEAD_DIM
    m2 = mask_t[:, None]
    # the rotated dims as two [BLOCK_T, BLOCK_H] halves (d and its partner d + R/2), loaded again (L1 hits): cos and
    # sin for R/2 columns, not for the whole head (8x fewer at R = 64 of 256), and no gather of the partners
    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < HALF
    mh = m2 & mask_h[None, :]
    x = to_float32(tl.load(x_row[:, None] + offs_d[None, :], mask=m2, other=0), IN_DTYPE, INTERPRET)
    x_a = to_float32(tl.load(x_row[:, None] + offs_h[None, :], mask=mh, other=0), IN_DTYPE, INTERPRET)
    x_b = to_float32(tl.load(x_row[:, None] + (HALF + offs_h)[None, :], mask=mh, other=0), IN_DTYPE, INTERPRET)
    w1 = 1.0 + tl.load(w_ptr + offs_d)                                  # [HEAD_DIM] the (1 + w) weight, fp32
    w1_a = 1.0 + tl.load(w_ptr + offs_h, mask=mask_h, other=0)
    w1_b = 1.0 + tl.load(w_ptr + HALF + offs_h, mask=mask_h, other=0)

    # RMSNorm in fp32, in HF's order: x * rsqrt(mean(x^2) + eps), then * (1 + w)
    rstd = tl.rsqrt(tl.sum(x * x, 1) / HEAD_DIM + eps)                  # [BLOCK_T]
    y = (x * rstd[:, None]) * w1[None, :]                               # [BLOCK_T, HEAD_DIM]
    y_a = (x_a * rstd[:, None]) * w1_a[None, :]                         # the same values at dims d < R/2
    y_b = (x_b * rstd[:, None]) * w1_b[None, :]                         # and at R/2 <= d < R

    # RoPE on the first ROT_DIM dims: y * cos + rotate_half(y) * sin, rotate_half = (-y2, y1)
    pos = tl.load(pos_ptr + offs_t, mask=mask_t, other=0)               # [BLOCK_T]
    if TABLE:                                                           # each column as the caller's table has it
        rows_c = pos.to(tl.int64)[:, None]
        cos_a = to_float32(tl.load(cos_ptr + rows_c * stride_cos + offs_h[None, :], mask=mh, other=1),
                           TABLE_DTYPE, INTERPRET)
        sin_a = to_float32(tl.load(sin_ptr + rows_c * stride_sin + offs_h[None, :], mask=mh, other=0),
                           TABLE_DTYPE, INTERPRET)
        cos_b = to_float32(tl.load(cos_ptr + rows_c * stride_cos + (HALF + offs_h)[None, :], mask=mh, other=1),
                           TABLE_DTYPE, INTERPRET)
        sin_b = to_float32(tl.load(sin_ptr + rows_c * stride_sin + (HALF + offs_h)[None, :], mask=mh, other=0),
                           TABLE_DTYPE, INTERPRET)
    else:                                                               # cat(freqs, freqs): one angle for both
        inv_freq = tl.load(inv_freq_ptr + offs_h, mask=mask_h, other=0)
        cos_a, sin_a = _cos_sin(pos.to(tl.float32)[:, None] * inv_freq[None, :])
        cos_b, sin_b = cos_a, sin_a
    out_a = cast_output(y_a * cos_a + (-y_b) * sin_a, IN_DTYPE, INTERPRET)
    out_b = cast_output(y_b * cos_b + y_a * sin_b, IN_DTYPE, INTERPRET)
    y_out = cast_output(y, IN_DTYPE, INTERPRET)
    keep = m2 & (offs_d >= ROT_DIM)[None, :]                            # the dims RoPE leaves alone
    tl.store(o_row[:, None] + offs_d[None, :], y_out, mask=keep)
    tl.store(o_row[:, None] + offs_h[None, :], out_a, mask=mh)
    tl.store(o_row[:, None] + (HALF + offs_h)[None, :], out_b, mask=mh)

    if WRITE_CACHE:
        if pid_h >= HQ:
            hk = pid_h - HQ
            slot = tl.load(slot_ptr + offs_t, mask=mask_t, other=-1).to(tl.int64)    # -1: padding, skip
            ok = slot >= 0
            i0 = slot // CACHE_ROWS
            i1 = slot % CACHE_ROWS
            kc_row = k_cache_ptr + i0 * stride_kc0 + i1 * stride_kc1 + hk * stride_kch
            tl.store(kc_row[:, None] + offs_d[None, :], y_out, mask=ok[:, None] & (offs_d >= ROT_DIM)[None, :])
            tl.store(kc_row[:, None] + offs_h[None, :], out_a, mask=ok[:, None] & mask_h[None, :])
            tl.store(kc_row[:, None] + (HALF + offs_h)[None, :], out_b, mask=ok[:, None] & mask_h[None, :])
            v = tl.load(v_ptr + (rows_t * stride_vt + hk * stride_vh)[:, None] + offs_d[None, :], mask=m2)
            tl.store(v_cache_ptr + (i0 * stride_vc0 + i1 * stride_vc1 + hk * stride_vch)[:, None] + offs_d[None, :],
                     v, mask=ok[:, None])


QK_NORM_ROPE = runtime.Kernel("attention.qk_norm_rope", _qk_norm_rope_kernel)


_INV_FREQ: dict = {}


def _inv_freq(rotary_dim: int, theta: float, device) -> torch.Tensor:
    key = (rotary_dim, float(theta), str(device))
    if key not in _INV_FREQ:
        _INV_FREQ[key] = rope_inv_freq(rotary_dim, theta).to(device)
    return _INV_FREQ[key]


def qk_norm_rope_triton(q, k, q_weight, k_weight, positions, *, v=None, rotary_dim=64, rope_theta=None, eps=1e-6,
                        cos=None, sin=None, k_cache=None, v_cache=None, slot_mapping=None, kernel=None):
    """Host side of :func:`lynn_kernels.attention.qk_norm_rope`: check, allocate, launch; ``kernel`` (a
    ``@triton.jit`` function with ``_qk_norm_rope_kernel``'s parameters) replaces the shipped kernel."""
    check_devices(q=q, k=k, v=v, q_weight=q_weight, k_weight=k_weight, positions=positions, cos=cos, sin=sin,
                  k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    check_rope(q, k, q_weight, k_weight, positions, v, rotary_dim, rope_theta, cos, sin, k_cache, v_cache,
               slot_mapping, eps=eps)
    # fp32 weights, each converted exactly from its own dtype (a bf16 q_weight must not round an fp32 k_weight)
    q_weight, k_weight = (w.to(torch.float32).contiguous() for w in (q_weight, k_weight))
    # positions and slot_mapping are read with unit stride, like the last dim of everything else
    q, k, v, cos, sin, positions, slot_mapping = (last_dim_contiguous(t)
                                                  for t in (q, k, v, cos, sin, positions, slot_mapping))
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    t, hq, d = q.shape
    hkv = k.shape[1]
    if t == 0:
        return q_out, k_out
    table = cos is not None
    inv_freq = q_weight if table else _inv_freq(rotary_dim, rope_theta, q.device)   # a valid pointer if unused
    cos_t, sin_t = (cos, sin) if table else (inv_freq, inv_freq)
    write = k_cache is not None
    kc, vc = (k_cache, v_cache) if write else (k_out, k_out)
    vv = v if v is not None else k
    slots = slot_mapping if write else positions
    # tokens a program: at most 4096 values of a tile on the GPU, and never past the tokens there are (a decode
    # step has one a sequence, and 15 masked rows a program cost time: docs/history/decode.md, the census)
    block_t = min(max(1, min(16, 4096 // d)) if not runtime.INTERPRET else 64, runtime.next_power_of_2(t))
    QK_NORM_ROPE.current(kernel)[(runtime.cdiv(t, block_t), hq + hkv)](
        kernel_view(q), kernel_view(k), kernel_view(vv), q_weight, k_weight, positions,
        inv_freq, kernel_view(cos_t), kernel_view(sin_t), kernel_view(q_out), kernel_view(k_out),
        kernel_view(kc), kernel_view(vc), slots,
        t, hq, hkv, float(eps),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), vv.stride(0), vv.stride(1),
        cos_t.stride(0), sin_t.stride(0),
        kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0), vc.stride(1), vc.stride(2), kc.shape[1],
        HEAD_DIM=d, ROT_DIM=rotary_dim, TABLE=table, WRITE_CACHE=write,
        IN_DTYPE=runtime.TORCH_TO_TL[q.dtype], TABLE_DTYPE=runtime.TORCH_TO_TL[cos_t.dtype], BLOCK_T=block_t,
        BLOCK_H=runtime.next_power_of_2(rotary_dim // 2),
        **runtime.kernel_flags(), **runtime.pdl_flags(), num_warps=4,
    )
    return q_out, k_out
