"""Sampling on the device, reproducible per request: greedy, temperature, top-k and top-p, with a seed of its own.

A draw is the Gumbel-max trick with counter-based noise: each candidate token ``v`` of row ``b`` gets
``g = -log(-log(u))`` with ``u`` a hash of ``(seed[b], counter[b], v)``, and the token is the argmax of
``logits / temperature + g`` over the candidates the top-k and top-p filters keep (the argmax of a Gumbel-perturbed
log-probability is an exact draw from the softmax). Nothing reads a generator's state and nothing returns to the
host, so the same function runs inside a captured CUDA graph and eagerly, with the same result bit for bit; and a
request's tokens depend on its own seed and positions only, not on what else shares the batch. ``counter`` is the
index the new token will have in its sequence (the prompt's length for the first one).

Example::

    tok = sample(logits, temperature=0.8, top_k=40, top_p=0.95, seed=7, counter=prompt_len)      # int64 [N]
    params = SamplingParams.build([Sampling(0.8, 40, 0.95, seed=7), Sampling()], device="cuda")   # per row
    tok = sample_rows(logits2, params, counter=lengths)                                           # int64 [2]
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

_M32 = 0xFFFFFFFF

#: seeds and top_k travel as int64: both stay below this
SEED_LIMIT = 2**63


def check_sampling_args(temperature=0.0, top_k=None, top_p=None, seed=None) -> None:
    """Raise a ValueError naming the first bad sampling setting, what it expects and what it got.

    ``temperature``: a finite number >= 0 (0 is greedy); ``top_k``: an int >= 1, or 0 or None for no limit (as HF
    and llama.cpp read 0); ``top_p``: a number in (0, 1] (1 or None: no limit); ``seed``: an int in [0, 2**63) or
    None (a seed drawn at random). Bools are not numbers here.
    """
    if not _is_real(temperature) or not _finite(temperature) or temperature < 0:
        raise ValueError(f"temperature = {temperature!r}: expected a finite number >= 0 (0 is greedy)")
    if top_k is not None and (not _is_int(top_k) or not 0 <= top_k < SEED_LIMIT):
        raise ValueError(f"top_k = {top_k!r}: expected an int in [1, 2**63), or 0 for no top-k limit")
    if top_p is not None and not (_is_real(top_p) and 0 < top_p <= 1):         # NaN fails the comparison too
        raise ValueError(f"top_p = {top_p!r}: expected a number in (0, 1] (1: no top-p limit)")
    if seed is not None and (not _is_int(seed) or not 0 <= seed < SEED_LIMIT):
        raise ValueError(f"seed = {seed!r}: expected an int in [0, 2**63) (the sampler's seeds are int64)")


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _finite(x) -> bool:
    try:
        return math.isfinite(x)
    except OverflowError:                   # an int past the largest float
        return False


@dataclass(frozen=True)
class Sampling:
    """One request's settings: ``temperature == 0`` is greedy (argmax, ties to the lowest id); ``top_k`` keeps the k
    most likely tokens (None or 0: all; stored as None); ``top_p`` keeps the smallest set whose probability reaches
    it, the best token always (None or 1: all); ``seed`` names the request's stream of draws. Bad settings raise a
    ValueError (:func:`check_sampling_args`)."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0

    def __post_init__(self):
        if self.seed is None:
            raise ValueError("seed = None: a Sampling needs an int in [0, 2**63)")
        check_sampling_args(self.temperature, self.top_k, self.top_p, self.seed)
        object.__setattr__(self, "top_k", int(self.top_k) if self.top_k else None)
        object.__setattr__(self, "seed", int(self.seed))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class SamplingParams:
    """Per-row tensors of a batch's :class:`Sampling` settings on the device (the static inputs of a captured step)
    and ``candidates``, the fixed number of best tokens the filters look at: None when no row filters (a draw over
    the whole vocabulary, no sort), else a power of two >= twice every row's ``top_k`` (so ties at the k-th value
    are kept, as HF keeps them, up to that many), or the whole vocabulary when a sampled row has no ``top_k``.
    ``greedy`` when every row is."""

    temperature: torch.Tensor          #: fp32 [B]
    top_k: torch.Tensor                #: int64 [B], 0: no limit
    top_p: torch.Tensor                #: fp32 [B], 1: no limit
    seed: torch.Tensor                 #: int64 [B]
    candidates: int | None
    greedy: bool

    @staticmethod
    def build(rows: list[Sampling], device, vocab: int | None = None) -> "SamplingParams":
        dev = torch.device(device)
        sampled = [r for r in rows if not r.greedy]
        filters = any(r.top_k is not None or (r.top_p is not None and r.top_p < 1) for r in sampled)
        if not filters:
            cand = None                                 # greedy, or draws over the whole vocabulary
        elif any(r.top_k is None for r in sampled):     # a row without top_k needs every token ranked
            if vocab is None:
                raise ValueError("a sampled row has no top_k while others filter: pass vocab (the whole vocabulary "
                                 "is sorted)")
            cand = vocab
        else:                                           # a power of two >= 2 k: ties at the k-th value fit
            cand = 1 << (2 * max(r.top_k for r in sampled) - 1).bit_length()
            cand = min(cand, vocab) if vocab is not None else cand
        return SamplingParams(
            torch.tensor([float(r.temperature) for r in rows], dtype=torch.float32, device=dev),
            torch.tensor([r.top_k or 0 for r in rows], dtype=torch.int64, device=dev),
            torch.tensor([1.0 if r.top_p is None else float(r.top_p) for r in rows], dtype=torch.float32, device=dev),
            torch.tensor([r.seed for r in rows], dtype=torch.int64, device=dev), cand, not sampled)

    @staticmethod
    def for_any(rows: int, device, vocab: int) -> "SamplingParams":
        """``rows`` greedy rows whose settings :meth:`set_row` may later change to any :class:`Sampling`: the
        sampler on, over the whole vocabulary sorted. A captured step fixes ``greedy`` and ``candidates``, so a batch
        that requests join and leave (a server) is built for the widest case; a greedy row still takes the argmax."""
        dev = torch.device(device)
        return SamplingParams(torch.zeros(rows, dtype=torch.float32, device=dev),
                              torch.zeros(rows, dtype=torch.int64, device=dev),
                              torch.ones(rows, dtype=torch.float32, device=dev),
                              torch.zeros(rows, dtype=torch.int64, device=dev), vocab, False)

    def set_row(self, row: int, setting: Sampling) -> None:
        """Write row ``row``'s settings in place (a captured step keeps reading the same tensors). Raises a
        ValueError when ``setting`` needs what these params were built without: the sampler (``greedy`` params), a
        ranking for its top-k / top-p (``candidates`` None), or more than ``candidates`` tokens kept."""
        if not setting.greedy:
            if self.greedy:
                raise ValueError(f"row {row}: temperature = {setting.temperature} needs the sampler; these params "
                                 f"were built greedy")
            filters = setting.top_k is not None or (setting.top_p is not None and setting.top_p < 1)
            if filters and self.candidates is None:
                raise ValueError(f"row {row}: top_k / top_p need ranked candidates; these params rank none "
                                 f"(build them with the filter, or with SamplingParams.for_any)")
            if setting.top_k is not None and self.candidates is not None and setting.top_k > self.candidates:
                raise ValueError(f"row {row}: top_k = {setting.top_k} is more than the {self.candidates} "
                                 f"candidates these params rank")
        self.temperature[row] = float(setting.temperature)
        self.top_k[row] = setting.top_k or 0
        self.top_p[row] = 1.0 if setting.top_p is None else float(setting.top_p)
        self.seed[row] = setting.seed


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer hash (xor-shift-multiply rounds) on int64 values in ``[0, 2^32)``; the odd
    multipliers stay below 2^31, so no product overflows int64."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _M32
    return x ^ (x >> 16)


def uniform(seed: torch.Tensor, counter: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """fp32 ``u`` in ``(0, 1)``, one per ``ids [B, C]`` entry, a hash of ``(seed[b], counter[b], ids[b, c])`` (24
    random bits, offset by half a step so neither 0 nor 1 occurs)."""
    key = _mix32((seed & _M32) ^ _mix32((seed >> 32) & _M32))
    key = _mix32(key ^ _mix32(counter.to(torch.int64) & _M32))
    h = _mix32(_mix32(key[:, None] ^ ids.to(torch.int64)) ^ 0x9E3779B9)
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def sample(logits: torch.Tensor, *, temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
           seed: int = 0, counter=0) -> torch.Tensor:
    """Next tokens int64 ``[N]`` from ``logits [N, vocab]``, one :class:`Sampling` for every row: greedy
    (``temperature == 0``) or a draw from ``softmax(logits / temperature)`` restricted to the ``top_k`` best (ties
    with the k-th kept) and to the smallest set whose probability reaches ``top_p`` (the best token always stays),
    in that order, as HF's warpers. ``counter``: the index the new token takes in its sequence, an int or ``[N]``
    (a different counter or seed is an independent draw; the same ones, the same token)."""
    rows = [Sampling(temperature, top_k, top_p, seed)] * logits.shape[0]
    params = SamplingParams.build(rows, logits.device, vocab=logits.shape[-1])
    if not isinstance(counter, torch.Tensor):
        counter = torch.full((logits.shape[0],), int(counter), dtype=torch.int64, device=logits.device)
    return sample_rows(logits, params, counter.to(logits.device))


def sample_rows(logits: torch.Tensor, params: SamplingParams, counter: torch.Tensor) -> torch.Tensor:
    """Next tokens int64 ``[B]`` from ``logits [B, vocab]`` (any float dtype, computed in fp32) under ``params``;
    ``counter [B]`` is the index of the new token in each sequence. No host sync, no allocation that depends on
    values: safe inside a CUDA-graph capture."""
    x = logits.float()
    best = x.argmax(-1)                                 # greedy rows; the first maximum: ties to the lowest id
    if params.greedy:
        return best
    z, ids = _candidates(x, params)
    g = -torch.log(-torch.log(uniform(params.seed, counter, ids)))
    choice = (z + g).argmax(-1, keepdim=True)
    drawn = ids.gather(-1, choice)[:, 0]
    return torch.where(params.temperature == 0, best, drawn)


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """fp32 ``[B, vocab]``: the distribution :func:`sample_rows` draws each row's token from (its temperature and
    filters applied; a greedy row's is all on its argmax)."""
    x = logits.float()
    p = torch.zeros_like(x).scatter_(1, x.argmax(-1, keepdim=True), 1.0)
    if params.greedy:
        return p
    z, ids = _candidates(x, params)
    drawn = torch.zeros_like(x).scatter_(1, ids, z.softmax(-1))
    return torch.where((params.temperature == 0)[:, None], p, drawn)


def _candidates(x: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """``(z, ids)``: each row's candidate tokens ``ids`` and their logits over the temperature ``z``, ``-inf``
    where top-k or top-p drops one."""
    t = params.temperature.clamp_min(1e-6)[:, None]
    if params.candidates is None:                       # no filter: every token is a candidate
        return x / t, torch.arange(x.shape[-1], device=x.device).expand_as(x)
    vals, ids = x.topk(params.candidates, dim=-1)       # sorted, best first
    z = vals / t
    rank = torch.arange(params.candidates, device=x.device)[None, :]
    k = params.top_k[:, None]
    kth = vals.gather(-1, (k - 1).clamp(0, params.candidates - 1))         # ties with the k-th value stay, as HF
    z = z.masked_fill((k > 0) & (vals < kth), float("-inf"))
    p = z.softmax(-1)
    before = p.cumsum(-1) - p                           # probability of the better tokens
    drop = (before >= params.top_p[:, None]) & (rank > 0)
    return z.masked_fill(drop, float("-inf")), ids
