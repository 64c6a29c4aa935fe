"""The benchmark registry: op name -> function. Each benchmark module registers into it on import (``register``);
:mod:`lynn_kernels.bench` lists and runs what it holds. A module of its own so that the benchmark modules never
import the package that imports them."""

from __future__ import annotations

from typing import Callable

from .harness import Result

BENCHMARKS: dict[str, Callable[..., list[Result]]] = {}


def register(op: str):
    def deco(fn):
        BENCHMARKS[op] = fn
        return fn

    return deco
