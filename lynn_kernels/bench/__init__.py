"""Benchmarks: one registry, one harness, one schema. ``lynn bench [OP]`` runs them on a GPU.

Each registered benchmark takes the measured ceilings and returns :class:`~.harness.Result` rows; it validates every
provider's output against the reference before timing it, and refuses to time a wrong op.

The kernel families' benchmarks live here and register when :func:`available` or :func:`run` loads them. A package
above this one registers its own by importing :func:`register` (the whole decoder's are in :mod:`lynn_model.bench`,
registered when that module is imported; this package never imports ``lynn_model``), so whatever lists or runs the
whole project's benchmarks (``lynn bench``, the tests) imports those modules first.
"""

from __future__ import annotations

import functools
import inspect

from .harness import Ceilings, Result, load, measure_ceilings, result_table, save
from .registry import BENCHMARKS, register


def _load_families() -> None:
    from . import attention, deltanet, matmul, matmul_graph, moe, nvfp4  # noqa: F401  (each module registers its benchmarks)


def available() -> list[str]:
    _load_families()
    return sorted(BENCHMARKS)


def run(ops: list[str] | None = None, quick: bool = False, command: str | None = None, root=None,
        ceilings: Ceilings | None = None) -> dict[str, str]:
    """Run benchmarks (all, or those whose name starts with one of ``ops``); returns {op: path written}."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("lynn bench needs a CUDA GPU: timings under the interpreter mean nothing (the committed "
                           "H200 results are in data/bench/h200/)")
    _load_families()
    chosen = [name for name in sorted(BENCHMARKS) if not ops or any(name.startswith(o) for o in ops)]
    if not chosen:
        raise KeyError(f"no benchmark matches {ops}; available: {sorted(BENCHMARKS)}")
    ceilings = ceilings or measure_ceilings()
    written = {}
    for name in chosen:
        fn, kw = BENCHMARKS[name], {"quick": quick}
        # a long benchmark saves what it has after each stage: a run cut off (by a time limit) keeps those rows
        if "partial" in inspect.signature(fn).parameters:
            kw["partial"] = functools.partial(_save_partial, name, ceilings, command, root)
        results = fn(ceilings, **kw)
        extra = getattr(BENCHMARKS[name], "extra", None)     # a benchmark's own figures (e.g. build time, memory)
        written[name] = str(save(name, results, ceilings, command=command, root=root,
                                 extra={"info": extra} if extra else None))
    return written


def _save_partial(name, ceilings, command, root, results, extra, stage: str) -> None:
    save(name, results, ceilings, command=command, root=root,
         extra={"info": extra, "partial": f"cut off after {stage}"})


__all__ = ["BENCHMARKS", "register", "available", "run", "Result", "Ceilings", "measure_ceilings", "save", "load",
           "result_table"]
