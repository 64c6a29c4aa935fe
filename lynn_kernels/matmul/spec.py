"""Argument checks and dispatch limits shared by the reference and the kernels (and, for ``GEMV_MAX_M``, the MoE
experts' decode path): errors name the tensor, what was expected and found."""

from __future__ import annotations

import torch

from ..nvfp4 import NVFP4Tensor
from .packed import PackedNVFP4

X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: The GEMV kernel's row limit (decode batches); larger M goes to the GEMM.
GEMV_MAX_M = 16
#: The most x rows the dispatch sends the packed GEMV (``use_packed_gemv`` decides by N too); up to
#: GEMV_MAX_M rows go to the tensor-core GEMV.
PACKED_GEMV_MAX_M = 2


def check_linear_args(x, w, bias=None) -> None:
    if not isinstance(w, (NVFP4Tensor, PackedNVFP4)):
        raise TypeError(f"w must be an NVFP4Tensor (quantise it with lynn_kernels.quantize) or a PackedNVFP4 "
                        f"(lynn_kernels.matmul.pack), got {type(w).__name__}")
    if w.dim() != 2:
        raise ValueError(f"w must be a 2-D NVFP4Tensor [N, K], got shape {tuple(w.shape)} "
                         f"(index a stacked tensor, e.g. w[e], for one expert)")
    n, k = w.shape
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in X_DTYPES:
        raise TypeError(f"x has dtype {x.dtype}; expected one of {[str(d)[6:] for d in X_DTYPES]}")
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(f"x has shape {tuple(x.shape)}; expected [..., K] with K = {k} to match w [N, K] = "
                         f"[{n}, {k}]")
    if x.device != w.device:
        raise ValueError(f"x is on {x.device} but w is on {w.device}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
        if tuple(bias.shape) != (n,):
            raise ValueError(f"bias has shape {tuple(bias.shape)}; expected [N] = [{n}]")
        if bias.dtype not in X_DTYPES:
            raise TypeError(f"bias has dtype {bias.dtype}; expected one of {[str(d)[6:] for d in X_DTYPES]}")
        if bias.device != w.device:
            raise ValueError(f"bias is on {bias.device} but w is on {w.device}")
