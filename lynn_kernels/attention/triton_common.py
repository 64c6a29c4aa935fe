"""Small Triton pieces the attention kernels share (:mod:`.triton_prefill`, :mod:`.triton_decode`): the ``tl.dot``
operand dtype, operand loading, the matmul, one online-softmax step."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .. import runtime
from ..runtime import to_float32

LOG2E = math.log2(math.e)


def dot_dtype(dtype: torch.dtype):
    """``tl.dot`` operand dtype for inputs of ``dtype``: fp32 under the interpreter (its bf16 dot is garbage);
    on the GPU the input dtype itself (bf16 / fp16 tensor cores, fp32 as exact IEEE products)."""
    return tl.float32 if runtime.INTERPRET else runtime.TORCH_TO_TL[dtype]


@triton.jit
def load_operand(x, IN_DTYPE: tl.constexpr, DOT: tl.constexpr, INTERPRET: tl.constexpr):
    """A loaded tile -> ``tl.dot`` operand: bf16 bits -> fp32 under the interpreter, a no-op cast on the GPU."""
    if INTERPRET:
        return to_float32(x, IN_DTYPE, INTERPRET)
    else:
        return x.to(DOT)


@triton.jit
def mma(a, b, acc, DOT: tl.constexpr):
    """``acc + a @ b`` with fp32 accumulation; fp32 operands multiply exactly (no TF32 rounding)."""
    if DOT == tl.float32:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a.to(DOT), b.to(DOT), acc)


@triton.jit
def softmax_step(q, k, v, acc, m_i, l_i, qk_scale, keep, MASKED: tl.constexpr, DOT: tl.constexpr):
    """One key block of the online softmax (base 2): ``q [M, D]``, ``k, v [N, D]``, ``keep [M, N]`` (if MASKED).

    Running max ``m_i`` and sum ``l_i`` are per row in log2 units; the accumulator is rescaled by
    ``2^(m_old - m_new)`` before the new block's ``p @ v`` is added.
    """
    zero = tl.zeros((q.shape[0], k.shape[0]), dtype=tl.float32)
    qk = mma(q, tl.trans(k), zero, DOT) * qk_scale                      # [M, N], log2 units
    if MASKED:
        qk = tl.where(keep, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))                              # [M]
    alpha = tl.exp2(m_i - m_new)                                        # rescales what came before
    p = tl.exp2(qk - m_new[:, None])                                    # [M, N]
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = mma(p.to(DOT), v, acc * alpha[:, None], DOT)                  # [M, D]
    return acc, m_new, l_i


#: Initial running max: finite, so a row whose first block is fully masked gives exp2(-inf - m) = 0, never NaN.
M_INIT = tl.constexpr(-1.0e30)
