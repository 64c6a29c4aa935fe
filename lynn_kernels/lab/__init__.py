"""Kernel experiments: write a variant of an op or of one of its kernels, check it, race it, route the decoder
through it.

A variant is a callable with the op's signature, or a ``@triton.jit`` kernel with the shipped kernel's parameters
that the op's own launcher runs (copy the shipped kernel's source into a cell, edit a line)::

    from lynn_kernels import lab
    v = lab.variant("rmsnorm", my_rmsnorm_kernel)      # or a plain function rmsnorm(x, weight, eps, ...)
    k = lab.edit("norm.rmsnorm", {"old text": "new text"})  # or: the shipped kernel with one edit
    print(lab.check(v))                                 # the op's lynn check matrix, the variant routed in
    print(lab.race(v, shapes="qwen3.5-35b-a3b:decode")) # GPU: variant vs shipped vs vendor, graph replay
    with lab.using(v):                                  # every call of the op, the decoder's included
        ...

``lynn_model.lab.in_decoder(v, preset)`` runs the decoder on it (tokens against the shipped path, and speed);
``lynn race OP --variant FILE.py:NAME`` does all of it from the command line. The ops: :data:`OPS`.
"""

from .check import CheckReport, check
from .ops import OPS, Op, find
from .race import RaceReport, can_time, committed_figures, race
from .shapes import MODELS, PHASES, Shape, shapes_for
from .variant import Variant, edit, shipped, source_of, using, variant

__all__ = ["variant", "edit", "check", "race", "using", "shipped", "can_time", "Variant", "CheckReport",
           "RaceReport", "OPS", "Op", "find", "Shape", "shapes_for", "MODELS", "PHASES", "committed_figures",
           "source_of"]
