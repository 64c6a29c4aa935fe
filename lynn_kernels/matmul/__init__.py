"""W4A16 matmul: ``y = x @ W^T`` with ``W`` an NVFP4 weight read straight from its 4-bit codes, never expanded.

Public ops (names and argument order are a contract):

* ``nvfp4_linear(x, w, bias=None)``: ``x [..., K]`` bf16/fp16/fp32, ``w`` NVFP4 ``[N, K]``, ``bias [N]`` ->
  ``[..., N]`` in x's dtype; the GEMV for M = prod(x.shape[:-1]) <= 16, the GEMM above;
* ``nvfp4_gemv`` / ``nvfp4_gemm``: the same product through one kernel (the GEMV takes M <= 16);
* ``norm_linear(x, norm_weight, w, eps=1e-6, *, residual=None)`` -> ``(y, xn)`` / ``(y, xn, h)``: the RMSNorm (with
  the residual add) in front of the product, folded into the packed GEMV's launch where that kernel takes the shape;
* ``NVFP4Linear`` (``from_linear``), ``quantize_linears(module, skip=...)``;
* ``pack(w) -> PackedNVFP4`` (the kernel layout, made once per weight at load time) and ``unpack``: every op takes
  either form of ``w``; the packed one reaches the packed GEMV for ``M = 1, 2`` where ``use_packed_gemv`` says, the
  tensor-core GEMV for the rest of ``M <= 16``, and from ``DEQUANT_MIN_M`` rows of a 16-bit x a
  dequantise-once-then-cuBLAS product (``use_dequant_gemm``; docs/matmul.md); ``concat_rows(ws)`` stacks packed weights
  of one ``K`` along N, each row keeping its global scale (one GEMV for several projections of the same input).

Each op has a same-signature torch reference in :mod:`.reference`; argument checks and the dispatch limits
(``GEMV_MAX_M``, ``PACKED_GEMV_MAX_M``) are in :mod:`.spec`, the kernels in :mod:`.triton_matmul` (the tensor-core
GEMV and GEMM on either layout, the dequantise kernel, the dispatch) and :mod:`.triton_packed` (the packed GEMV,
packed layout only), the ``lynn check`` rows in :mod:`.check`. "Packed" names the kernel layout
(:class:`PackedNVFP4`) and nothing else; an NVFP4Tensor is in the checkpoint layout (two 4-bit codes a byte).
"""

from .. import runtime
from . import reference, spec
from .linear import NVFP4Linear, quantize_linears
from .packed import PackedNVFP4, concat_rows, pack, unpack
from .triton_matmul import norm_linear_triton, nvfp4_gemm_triton, nvfp4_gemv_triton, nvfp4_linear_triton

nvfp4_linear = runtime.op(reference=reference.nvfp4_linear, docs="reference")(nvfp4_linear_triton)
nvfp4_gemv = runtime.op(reference=reference.nvfp4_gemv, docs="reference")(nvfp4_gemv_triton)
nvfp4_gemm = runtime.op(reference=reference.nvfp4_gemm, docs="reference")(nvfp4_gemm_triton)
norm_linear = runtime.op(reference=reference.norm_linear, docs="reference")(norm_linear_triton)

__all__ = ["nvfp4_linear", "nvfp4_gemv", "nvfp4_gemm", "norm_linear", "NVFP4Linear", "quantize_linears", "reference",
           "spec", "PackedNVFP4", "pack", "unpack", "concat_rows"]
