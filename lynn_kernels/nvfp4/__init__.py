"""NVFP4: FP4 E2M1 codes with an E4M3 scale per 16 elements and an fp32 global scale.

Public ops (names and argument order are a contract):

* ``quantize(w, global_scale=None, recipe="modelopt") -> NVFP4Tensor``
* ``dequantize(q, dtype=torch.bfloat16) -> Tensor``
* ``NVFP4Tensor`` with ``from_modelopt`` / ``to_modelopt`` / ``from_compressed_tensors`` / ``to_compressed_tensors``

Each op has a same-signature torch reference in :mod:`.reference`; the format's constants and the input checks are
in :mod:`.spec`, the kernels in :mod:`.triton_quant`, the ``lynn check`` rows in :mod:`.check`.
"""

from .. import runtime
from . import reference, spec
from .spec import BLOCK, E2M1_MAGNITUDES, E4M3_MAX, RECIPES, e2m1_table
from .tensor import NVFP4Tensor
from .triton_quant import dequantize_triton, quantize_triton

quantize = runtime.op(reference=reference.quantize, docs="reference")(quantize_triton)
dequantize = runtime.op(reference=reference.dequantize, docs="reference")(dequantize_triton)

__all__ = ["NVFP4Tensor", "quantize", "dequantize", "reference", "spec", "BLOCK", "E2M1_MAGNITUDES", "E4M3_MAX",
           "RECIPES", "e2m1_table"]
