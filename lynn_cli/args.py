"""Argument types for the ``lynn`` command: each refuses a bad value as a usage error, before anything is loaded."""

from __future__ import annotations

import argparse
import math


def integer(lo: int | None = None, hi: int | None = None, what: str = ""):
    """An ``int`` in ``[lo, hi]`` (a bound of None is open); ``what`` says what the number is."""
    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"{text}: expected {_range(lo, hi)}{what}")
        return value
    parse.__name__ = "integer"
    return parse


def number(lo: float, hi: float | None = None, *, lo_open: bool = False, what: str = ""):
    """A finite ``float`` in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``; ``hi=None``: no upper bound)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        low_ok = value > lo if lo_open else value >= lo
        if not math.isfinite(value) or not low_ok or (hi is not None and value > hi):
            span = f"{'(' if lo_open else '['}{lo:g}, {'inf)' if hi is None else f'{hi:g}]'}"
            raise argparse.ArgumentTypeError(f"{text}: expected a finite number in {span}{what}")
        return value
    parse.__name__ = "number"
    return parse


def _range(lo, hi) -> str:
    if lo is not None and hi is not None:
        return f"an integer from {lo} to {hi:,}"
    if lo is not None:
        return f"an integer >= {lo}"
    return f"an integer <= {hi:,}"
