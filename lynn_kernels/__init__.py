"""Lynn workbench kernels: Triton kernels for LLM inference, each with a torch reference.

``import lynn_kernels`` first sets up the runtime (compiled Triton on a GPU, the interpreter on a CPU), so every
kernel module below is defined under the right backend.
"""

from . import runtime  # noqa: I001  (must come first: it chooses the Triton backend)
from .runtime import as_batch, backend, device_summary, programmatic_launches, trusted, use_reference
from .metrics import Metrics, compare, render_table
from . import nvfp4
from .nvfp4 import NVFP4Tensor, dequantize, quantize
from . import matmul
from .matmul import NVFP4Linear, PackedNVFP4, nvfp4_linear, pack, quantize_linears
from . import attention
from .attention import decode_attention, flash_attention, qk_norm_rope
from . import deltanet
from . import moe
from . import norm
from .norm import rmsnorm

__version__ = "0.1.0"

__all__ = ["runtime", "as_batch", "backend", "device_summary", "programmatic_launches", "trusted", "use_reference",
           "Metrics", "compare", "render_table",
           "nvfp4", "NVFP4Tensor", "quantize", "dequantize",
           "matmul", "NVFP4Linear", "PackedNVFP4", "nvfp4_linear", "pack", "quantize_linears",
           "attention", "flash_attention", "decode_attention", "qk_norm_rope",
           "deltanet", "moe", "norm", "rmsnorm"]
