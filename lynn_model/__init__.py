"""lynn_model: the Qwen3-Next / Qwen3.5 / Qwen3.5-MoE (Qwen3.6) hybrid decoder on the ops of ``lynn_kernels``.

A few short files, read in this order: :mod:`.config` (the dataclass, presets), :mod:`.model` (the modules),
:mod:`.cache` (paged KV cache, Gated DeltaNet states), :mod:`.checkpoint` (HF folders read and checked),
:mod:`.loader` (their tensors into the model, bf16 and NVFP4), :mod:`.sampling` (reproducible draws on the device),
:mod:`.graphs` (the decode step as a CUDA graph), :mod:`.generate` (the loop, the tokenizer), :mod:`.quantize`
(``lynn quantize``).

Example::

    import lynn_model
    model = lynn_model.from_pretrained("path/to/Qwen3.5-35B-A3B-NVFP4")          # NVFP4 stays NVFP4
    out = lynn_model.generate(model, input_ids, 64, temperature=0.7, top_p=0.9, seed=0)
    with lynn_kernels.use_reference():                                             # every op on its reference
        logits = model.forward(input_ids)
"""

import lynn_kernels  # noqa: F401, I001  (chooses the Triton backend before any kernel module is imported)

from .cache import Batch, Cache, CacheFull
from .checkpoint import LoadError
from .config import PRESETS, Config, ConfigError, preset
from .generate import NonFiniteError, Stats, TextStream, Tokenizer, check_generate_args, generate
from .graphs import BUCKETS, DecodeStep, PrefillStep
from .loader import from_pretrained
from .model import Model
from .sampling import Sampling, SamplingParams, check_sampling_args, sample, sample_rows

__all__ = ["Batch", "Cache", "CacheFull", "Config", "ConfigError", "PRESETS", "preset", "Model", "from_pretrained",
           "LoadError", "generate", "sample", "sample_rows", "Sampling", "SamplingParams", "DecodeStep", "PrefillStep",
           "BUCKETS", "Stats", "Tokenizer", "TextStream", "NonFiniteError", "check_generate_args",
           "check_sampling_args"]
