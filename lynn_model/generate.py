"""Generation: a packed prefill, then batched decode steps over the cache (a CUDA graph on a GPU); the checkpoint's
tokenizer.

``generate(model, input_ids, max_new_tokens, ...)`` is the contract; :class:`Tokenizer` wraps HF ``tokenizers``
(``tokenizer.json``) and renders the checkpoint's own chat template with jinja2, as HF does.
"""

from __future__ import annotations

import functools
import json
import operator
import re
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

import lynn_kernels

from .cache import CacheFull
from .graphs import DecodeStep, bucket_for
from .model import Model
from .sampling import Sampling, SamplingParams, _is_int, check_sampling_args, sample_rows
from .speculative import MAX_DRAFTS, RULES, MTPDrafter, SpeculativeStep, spare_tokens


@dataclass
class Stats:
    """Timings of one :func:`generate` call (seconds, tokens)."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0
    capture_s: float = 0.0           #: building the decode step (its warm-up and graph capture, on a GPU)
    cuda_graph: bool = False         #: the decode steps replayed a captured graph
    cache_bytes: int = 0             #: the KV cache and the Gated DeltaNet states
    #: of ``decode_s``, the host's time launching steps (``DecodeStep.replay``) and waiting for their tokens: a wait
    #: near ``decode_s`` says the GPU bounds the loop, near 0 that the host does (plain decode steps only)
    launch_s: float = 0.0
    wait_s: float = 0.0

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    batch: int = 0                   #: sequences in the call
    notes: list[str] = field(default_factory=list)   #: what the call changed of its arguments (one line each)
    mtp: int = 0                     #: speculative decoding: drafts per step (0: off)
    drafted: int = 0                 #: drafts proposed, over all sequences and steps
    accepted: int = 0                #: of them, the drafts the trunk agreed with
    verify_steps: int = 0            #: unrolled verify steps run
    #: each speculative round of each sequence, in order: ``(sequence, drafts, how many were kept, the trunk's
    #: token after them)``
    rounds: list[tuple[int, list[int], int, int]] = field(default_factory=list)

    @property
    def acceptance_length(self) -> float:
        """Tokens a sequence gains per verify step (its accepted drafts, plus the trunk's own token), averaged."""
        return 1 + self.mtp * self.accepted / self.drafted if self.drafted else 0.0

    @property
    def decode_tok_s(self) -> float:
        """Tokens made by decode steps (all but each sequence's first) per second of decoding."""
        return (self.new_tokens - self.batch) / self.decode_s if self.decode_s else 0.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class NonFiniteError(ValueError):
    """:func:`generate` met logits that are not finite (NaN or inf): the weights or the inputs are likely damaged."""


#: The most prompt tokens one prefill call of :func:`generate` takes (``prefill_chunk``): at the Qwen3.5-35B-A3B
#: shape a call's activations grow with it (the routed experts' rows, the Gated DeltaNet chunk states).
PREFILL_CHUNK = 16384


def check_generate_args(max_new_tokens, *, temperature=0.0, top_k=None, top_p=None, seed=None,
                        max_tokens=None, mtp=0, mtp_rule="coupled", prefill_chunk=PREFILL_CHUNK) -> None:
    """Raise a ValueError naming the first bad argument of :func:`generate`, what it expects and what it got; needs
    no model, so it runs before the model is touched.

    ``max_new_tokens``: an int >= 0; ``max_tokens``: None or an int >= 1; the sampling settings as
    :func:`lynn_model.sampling.check_sampling_args` takes them (``top_k`` 0 or None: no limit), ``seed`` also a
    list of such seeds (one per prompt: :func:`generate` checks their number).
    """
    if not _is_int(max_new_tokens) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens = {max_new_tokens!r}: expected an int >= 0")
    if max_tokens is not None and (not _is_int(max_tokens) or max_tokens < 1):
        raise ValueError(f"max_tokens = {max_tokens!r}: expected an int >= 1 (the cache's token budget)")
    seeds = isinstance(seed, (list, tuple))
    check_sampling_args(temperature, top_k, top_p, None if seeds else seed)
    if seeds and not seed:
        raise ValueError("seed = []: expected an int, or one int per prompt")
    for i, s in enumerate(seed if seeds else ()):      # each element a seed of its own (None is not one)
        try:
            check_sampling_args(seed=s if s is not None else -1)
        except ValueError:
            raise ValueError(f"seed[{i}]: seed = {s!r}: expected an int in [0, 2**63)") from None
    if not _is_int(mtp) or not 0 <= mtp <= MAX_DRAFTS:
        raise ValueError(f"mtp = {mtp!r}: expected an int in [0, {MAX_DRAFTS}] (drafts per step; 0: off)")
    if not _is_int(prefill_chunk) or prefill_chunk < 1:
        raise ValueError(f"prefill_chunk = {prefill_chunk!r}: expected an int >= 1 (prompt tokens per prefill call)")
    if mtp_rule not in RULES:
        raise ValueError(f"mtp_rule = {mtp_rule!r}: expected one of {', '.join(map(repr, RULES))}")


def _prompts(input_ids) -> list[list[int]]:
    """``input_ids`` as lists of ints, checked: int64 ``[B, T]``, or ``B`` non-empty sequences of ints."""
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() != 2 or input_ids.dtype != torch.int64:
            raise ValueError(f"input_ids must be int64 [B, T], got {input_ids.dtype} {tuple(input_ids.shape)}")
        rows = input_ids.tolist()
    else:
        try:
            rows = [list(r) for r in input_ids]
        except TypeError:
            raise ValueError(f"input_ids must be an int64 [B, T] tensor or a list of token lists, got "
                             f"{type(input_ids).__name__}") from None
    if not rows or any(len(r) == 0 for r in rows):
        raise ValueError("input_ids needs at least one prompt, each of at least one token")
    out = []
    for b, r in enumerate(rows):
        try:
            out.append([operator.index(t) for t in r])          # ints, numpy ints, 0-d integer tensors
        except TypeError:
            bad = next(t for t in r if not hasattr(type(t), "__index__"))
            raise ValueError(f"input_ids[{b}] holds {bad!r} ({type(bad).__name__}): expected token ids (ints)") \
                from None
    return out


def generate(model: Model, input_ids, max_new_tokens: int, *, temperature: float = 0.0, top_k: int | None = None,
             top_p: float | None = None, seed: int | Sequence[int] | None = None, stop_ids: Sequence[int] | None = None,
             stream: Callable[[torch.Tensor], None] | None = None, stats: Stats | None = None,
             max_tokens: int | None = None, cuda_graph: bool | None = None, mtp: int = 0,
             mtp_rule: str = "coupled", prefill_chunk: int = PREFILL_CHUNK) -> torch.Tensor:
    """Continue ``B`` prompts by up to ``max_new_tokens`` tokens each.

    A packed prefill of the prompts (in calls of at most ``prefill_chunk`` tokens), then decode steps of the whole batch
    through a :class:`DecodeStep`: on a GPU with the compiled kernels a CUDA graph captured once (the batch padded to
    its bucket, 1, 2, 4, ..., 32) and replayed per token, the host reading each step's tokens while the next step runs;
    elsewhere the same step eagerly.

    The model's context (``model.config.max_position_embeddings`` tokens) bounds every sequence: a prompt longer
    than it is refused; ``max_new_tokens`` beyond what fits after the longest prompt is cut to fit, and the call
    says so once: a line in ``stats.notes`` when ``stats`` is given, else a :func:`warnings.warn`.

    Args:
        input_ids: int64 ``[B, T]`` (or a list of ``B`` token lists of any lengths: a varlen batch).
        max_new_tokens: an int >= 0 (cut to the context, above).
        temperature, top_k, top_p: sampling (see :func:`lynn_model.sample`); ``temperature=0.0`` is greedy;
            ``top_k`` 0 or None is no limit.
        seed: the requests' stream of draws (:mod:`lynn_model.sampling`): a seeded call repeats exactly, on the
            graph and the eager path alike. One int: every prompt draws from that stream (identical prompts give
            identical tokens); a list: a seed per prompt. None: a seed drawn from torch's host generator.
        stop_ids: a sequence ends after emitting one of these; the others go on.
        stream: called after each step with ``[B]`` tokens: the new one of each live sequence, ``-1`` for one that
            has finished. A finished sequence stops writing its cache; its row idles in the batch.
        stats: filled with the prefill / decode timings, and :attr:`Stats.notes`.
        max_tokens: a ceiling on the cache: the call needs every prompt plus ``max_new_tokens`` (after the context
            cut) and raises :class:`CacheFull` before any work when that is more; the cache holds what the call
            needs, never more (default: no ceiling).
        cuda_graph: capture the decode step (default: on a GPU with the compiled kernels); False runs it eagerly.
        mtp: speculative decoding with ``mtp`` drafts (1-3) of the checkpoint's MTP module per step
            (:mod:`lynn_model.speculative`), each round one :class:`SpeculativeStep` (captured like the plain step); 0:
            off.
        prefill_chunk: the most prompt tokens one prefill call takes: longer prompts run in several calls, each
            continuing the cached prefix (bounded memory for a long prompt; the logits equal a single call's to
            rounding).
        mtp_rule: how a draft is accepted. ``"coupled"``: the same tokens as without ``mtp``, greedy or seeded.
            ``"rejection"``: the speculative sampling test, each token distributed as plain sampling's but not the
            same draws (greedy: the same tokens under both).

    Returns:
        int64 ``[B, T + n]`` with ``n <= max_new_tokens`` the steps run (fewer when every sequence stopped); rows of
        a list input are right-padded with their last token.

    Raises:
        ValueError: a bad argument (:func:`check_generate_args`), bad ``input_ids``, or a prompt longer than the
            context.
        NonFiniteError: the logits of a sequence are not finite, at the prompt or at a new token (the message says
            which); checked on what each step already copies to the host.
        CacheFull: ``max_tokens`` cannot hold the prompts and the new tokens.
    """
    check_generate_args(max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                        max_tokens=max_tokens, mtp=mtp, mtp_rule=mtp_rule, prefill_chunk=prefill_chunk)
    if mtp and model.mtp is None:
        raise ValueError(f"mtp = {mtp}: {model.config.name or model.config.family} has no MTP module (its checkpoint "
                         f"holds no mtp.* tensors)")
    rows = _prompts(input_ids)
    warn, stats = stats is None, stats if stats is not None else Stats()
    vars(stats).update(vars(Stats()))           # a reused Stats describes this call alone
    context, longest = model.config.max_position_embeddings, max(map(len, rows))
    if longest > context:
        which = f"prompt {max(range(len(rows)), key=lambda b: len(rows[b]))} of the batch" if len(rows) > 1 else \
            "the prompt"
        raise ValueError(f"{which} has {longest:,} tokens; the model's context is {context:,} "
                         f"(max_position_embeddings)")
    if max_new_tokens > context - longest:
        stats.notes.append(f"max_new_tokens = {max_new_tokens:,} cut to {context - longest:,}: the model's context "
                           f"is {context:,} tokens and the {'longest ' if len(rows) > 1 else ''}prompt has "
                           f"{longest:,}")
        max_new_tokens = context - longest
    spare = spare_tokens(mtp)                                   # speculative rounds write past the end
    need = sum(len(r) + max_new_tokens + spare for r in rows)
    if max_tokens is not None and max_tokens < need:
        prompts = f"the prompt's {len(rows[0]):,} tokens" if len(rows) == 1 else \
            f"the {len(rows)} prompts' {sum(map(len, rows)):,} tokens"
        raise CacheFull(f"max_tokens = {max_tokens:,} is too small: {prompts} and max_new_tokens = "
                        f"{max_new_tokens:,}{' each' if len(rows) > 1 else ''} need a cache of {need:,} tokens; "
                        f"raise max_tokens (--max-tokens) or lower max_new_tokens (--max-new-tokens)")
    if warn:
        for note in stats.notes:
            warnings.warn(note, stacklevel=2)
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,)).item())
    seeds = list(seed) if isinstance(seed, (list, tuple)) else [seed] * len(rows)
    if len(seeds) != len(rows):
        raise ValueError(f"seed: {len(seeds)} seeds for {len(rows)} prompts: expected one per prompt (or one int "
                         f"for all)")
    settings = [Sampling(temperature, top_k, top_p, s) for s in seeds]      # row b: prompt b (its slot, below)
    dev, vocab, nseq = model.device, model.config.vocab_size, len(rows)
    if cuda_graph is None:
        cuda_graph = dev.type == "cuda" and lynn_kernels.backend() == "triton"
    # on a GPU the batch runs in its bucket's rows, captured or not (so the two give the same bits)
    width = bucket_for(nseq) if dev.type == "cuda" else nseq
    stops = set(int(t) for t in (stop_ids or []))
    stats.prompt_tokens, stats.batch, stats.mtp = sum(map(len, rows)), nseq, mtp
    cache = model.new_cache(max_batch=width, max_tokens=need + 16 * nseq)     # a page of slack per sequence
    stats.cache_bytes, stats.cuda_graph = cache.nbytes(), bool(cuda_graph) and max_new_tokens > 1
    out = [list(r) for r in rows]
    if max_new_tokens == 0:
        return _pack(out)
    with torch.inference_mode():
        step = None
        if max_new_tokens > 1:
            t0 = time.perf_counter()
            params = SamplingParams.build(settings + settings[:1] * (width - nseq), dev, vocab)
            step = SpeculativeStep(model, cache, width, mtp, params, mtp_rule, graph=cuda_graph) if mtp else \
                DecodeStep(model, cache, width, params, graph=cuda_graph)
            stats.capture_s = time.perf_counter() - t0
        slots = [cache.add() for _ in rows]
        assert slots == list(range(nseq))          # a fresh cache: prompt b's slot is the params' row b
        cache.reserve(slots, [len(r) + max_new_tokens + spare for r in rows])   # every page now: no CacheFull later
        _sync(dev)
        t0 = time.perf_counter()
        drafter = MTPDrafter(model, mtp, mtp_rule) if mtp else None
        logits, finals = _prefill(model, cache, slots, rows, prefill_chunk, drafter)
        counter = torch.tensor([len(r) for r in rows], dtype=torch.int64, device=dev)
        nxt = sample_rows(logits, SamplingParams.build(settings, dev, vocab), counter)
        # the finite check rides on the copy of the tokens (max propagates NaN: one reduction per row)
        first, finite = torch.stack([nxt, torch.isfinite(logits.amax(-1)).long()]).tolist()
        _sync(dev)
        stats.prefill_s = time.perf_counter() - t0
        _check_finite(range(nseq), finite, nseq, "the prompt (prefill)")
        live = _emit(out, list(range(nseq)), first, stops, stream)   # rows still generating
        stats.new_tokens = nseq
        if mtp and live and max_new_tokens > 1:
            t0 = time.perf_counter()
            _speculative(step, drafter, slots, out, first, finals, max_new_tokens - 1, stops, stream, stats, live,
                         settings)
            _sync(dev)
            stats.decode_s = time.perf_counter() - t0
            return _pack(out)
        if step is None or not live:
            return _pack(out)
        step.begin(nxt, slots)
        t0 = time.perf_counter()
        reader = _Reader(step, dev)
        launched, pending = 0, None
        while True:              # launch step k + 1, then read step k's tokens while it runs
            done = None
            if live and launched < max_new_tokens - 1:
                t1 = time.perf_counter()
                step.replay()
                stats.launch_s += time.perf_counter() - t1
                done = reader.copy(launched)
                launched += 1
            if pending is not None:
                t1 = time.perf_counter()
                new, finite = reader.read(pending)
                stats.wait_s += time.perf_counter() - t1
                _check_finite(live, [finite[slots[b]] for b in live], nseq, f"new token {pending + 2}")
                before = live
                live = _emit(out, live, [new[slots[b]] for b in live], stops, stream)
                cache.advance([slots[b] for b in before], [1] * len(before))
                step.stop([slots[b] for b in before if b not in live])
                stats.new_tokens += len(before)
                stats.decode_steps += 1
            if done is None:
                break
            pending = done
        _sync(dev)
        stats.decode_s = time.perf_counter() - t0
    return _pack(out)


def _prefill(model: Model, cache, slots: list[int], rows: list[list[int]], chunk: int, drafter=None):
    """The prompts through :meth:`Model.step` in calls of at most ``chunk`` tokens, in order (a prompt longer than
    ``chunk`` in several calls, each continuing its cached prefix; short ones packed together). Returns the logits of
    each prompt's last token ``[B, vocab]``, and, with an MTP ``drafter``, each prompt's last piece ``(start, length,
    the trunk's hidden rows)``: the MTP layer has run over the pieces before it, call by call (the token after a
    piece's last position is the next prompt token), and runs over the last once the first new token is known."""
    dev = model.device
    pieces = [(b, s, min(chunk, len(r) - s)) for b, r in enumerate(rows) for s in range(0, len(r), chunk)]
    calls, size = [[]], 0
    for piece in pieces:                      # a full chunk fills a call: a prompt's pieces never share one
        if size + piece[2] > chunk:
            calls.append([])
            size = 0
        calls[-1].append(piece)
        size += piece[2]
    last, finals = [None] * len(rows), [None] * len(rows)
    for call in calls:
        ids = torch.tensor([t for b, s, n in call for t in rows[b][s:s + n]], dtype=torch.long, device=dev)
        out = model.step(ids, cache, [slots[b] for b, _, _ in call], [n for _, _, n in call],
                         hidden=drafter is not None)
        logits, h = out if drafter is not None else (out, None)
        early = []
        for i, (b, s, n) in enumerate(call):
            if s + n == len(rows[b]):
                last[b] = logits[i]
        if drafter is None:
            continue
        parts = h.split([n for _, _, n in call])
        for (b, s, n), part in zip(call, parts):
            if s + n == len(rows[b]):
                finals[b] = (s, n, part)
            else:
                early.append((b, s, n, part))
        if early:                             # the MTP layer's keys over these positions; no drafts yet
            drafter.draft(cache, [slots[b] for b, _, _, _ in early],
                          [t for b, s, n, _ in early for t in rows[b][s + 1:s + n + 1]],
                          torch.cat([p for *_, p in early]), [n for _, _, n, _ in early],
                          [s for _, s, _, _ in early], None)
    return torch.stack(last), finals


def _speculative(step: SpeculativeStep, drafter: MTPDrafter, slots, out, first, finals, budget, stops, stream,
                 stats, live, settings) -> None:
    """:func:`generate`'s decode phase by speculative rounds of ``step`` (:mod:`lynn_model.speculative`): the MTP
    layer over each prompt's last piece (``finals``, from :func:`_prefill`) and the first drafts, then the rounds;
    ``stream`` gets a ``[B]`` tensor per token a sequence emits (``-1`` for the others)."""
    k, n = step.k, len(out)
    prompt_lens = [len(o) - 1 for o in out]
    drafts, q = drafter.draft(step.cache, [slots[b] for b in live],
                              [t for b in live for t in out[b][finals[b][0] + 1:]],
                              torch.cat([finals[b][2] for b in live]), [finals[b][1] for b in live],
                              [finals[b][0] for b in live], [settings[b] for b in live])
    step.begin([slots[b] for b in live], [first[b] for b in live], drafts, q)
    left = {b: budget for b in live}
    while live:
        res = step.replay()
        stats.verify_steps += 1
        flags = [res[slots[b]][2] for b in live]
        bad = next((b for b, f in zip(live, flags) if not f), None)
        if bad is not None:                   # as plain decoding words it, at the first token the round would emit
            _check_finite(live, flags, n, f"new token {len(out[bad]) - prompt_lens[bad] + 1}")
        still = []
        for b in live:
            a, y, _, *verified = res[slots[b]][:3 + k]
            stats.drafted += k
            stats.accepted += a
            stats.rounds.append((b, verified, a, y))
            going = True
            for t in [*verified[:a], y][:left[b]]:
                out[b].append(t)
                stats.new_tokens += 1
                left[b] -= 1
                if stream is not None:
                    row = [-1] * n
                    row[b] = t
                    stream(torch.tensor(row, dtype=torch.long))
                if t in stops:
                    going = False
                    break
            if going and left[b] > 0:
                still.append(b)
        step.stop([slots[b] for b in live if b not in still])
        live = still


def _check_finite(rows, finite: list[int], batch: int, where: str) -> None:
    """A :class:`NonFiniteError` when a flag of ``rows`` is 0, saying at which step (``where``) and, in a batch,
    which sequences."""
    bad = [b for b, f in zip(rows, finite) if not f]
    if bad:
        whose = "" if batch == 1 else f" of sequence {bad[0]}" if len(bad) == 1 else f" of sequences {bad}"
        raise NonFiniteError(f"the logits{whose} are not finite (NaN or inf) at {where}: the model's weights or its "
                             f"inputs are likely damaged")


class _Reader:
    """Two host buffers (pinned on a GPU) that take turns receiving a step's tokens and finite flags, each with its
    event."""

    def __init__(self, step: DecodeStep, device: torch.device):
        cuda = device.type == "cuda"
        self.step, self.cuda = step, cuda
        self.bufs = [torch.empty(2, step.rows, dtype=torch.int64, pin_memory=cuda) for _ in range(2)]
        self.events = [torch.cuda.Event() if cuda else None for _ in range(2)]

    def copy(self, k: int) -> int:
        """Queue step ``k``'s tokens and finite flags (:attr:`DecodeStep.out`) into buffer ``k % 2``; returns
        ``k``."""
        self.bufs[k % 2].copy_(self.step.out, non_blocking=self.cuda)
        if self.cuda:
            self.events[k % 2].record()
        return k

    def read(self, k: int) -> tuple[list[int], list[int]]:
        """Step ``k``'s tokens and finite flags (1: finite), one per row."""
        if self.cuda:
            self.events[k % 2].synchronize()
        tokens, finite = self.bufs[k % 2].tolist()
        return tokens, finite


def _emit(out: list[list[int]], live: list[int], new: list[int], stops: set, stream) -> list[int]:
    """Append each live row's new token; returns the rows still live. ``stream`` gets ``[B]`` tokens, ``-1`` for a
    row that had already finished."""
    step = [-1] * len(out)
    for b, t in zip(live, new):
        out[b].append(int(t))
        step[b] = int(t)
    if stream is not None:
        stream(torch.tensor(step, dtype=torch.long))
    return [b for b, t in zip(live, new) if int(t) not in stops]


def _pack(out: list[list[int]]) -> torch.Tensor:
    """Rows right-padded with their last token (a stop id, or the prompt's last for a shorter prompt)."""
    n = max(map(len, out))
    return torch.tensor([r + [r[-1]] * (n - len(r)) for r in out], dtype=torch.long)


# ---------------------------------------------------------------------------------------------------------------
# tokenizer and chat template


#: The most characters a chat template may render; no string or list it builds may be longer either.
TEMPLATE_MAX_CHARS = 1 << 20
#: The most seconds a chat template may take to render.
TEMPLATE_TIMEOUT_S = 2.0
#: The most items a chat template's ``range()`` may give (jinja2's sandbox has the same limit).
TEMPLATE_MAX_RANGE = 100_000
#: The largest integer (in bits) a chat template's ``*`` or ``**`` may make.
TEMPLATE_MAX_BITS = 1 << 16


class Tokenizer:
    """A checkpoint's ``tokenizer.json`` (HF ``tokenizers``) and its chat template (jinja2, as HF renders it).

    :meth:`from_pretrained` refuses a damaged or foreign file with a ValueError naming it (a missing one:
    FileNotFoundError). The chat template is ``chat_template.jinja`` if the folder has one, else the config's
    ``chat_template``: a string, or HF's list of named templates (``[{"name": "default", "template": ...}, ...]``:
    ``default`` is used, ``tool_use`` when ``tools`` are passed). It compiles when first applied (so a template that
    does not compile stops ``--chat`` only, not plain text) and renders in jinja2's immutable sandbox within
    bounds: ``template_max_chars`` characters of output, ``template_timeout_s`` seconds, ``range()`` of at most
    :data:`TEMPLATE_MAX_RANGE` items, no string, list or integer built past its limit by one operation (``*``,
    ``**``, ``%``, a width or a replacement). Past a bound, or on any error of the template (a syntax error, an
    undefined name used, its own ``raise_exception``), :meth:`apply_chat_template` raises a ValueError naming the
    template's file.

    Example::

        tok = Tokenizer.from_pretrained("path/to/model")
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True))
        text = tok.decode(ids)
    """

    template_max_chars: int = TEMPLATE_MAX_CHARS
    template_timeout_s: float = TEMPLATE_TIMEOUT_S

    def __init__(self, tokenizer, config: dict, folder: Path | None = None):
        folder = Path(folder) if folder is not None else None
        where = str(folder / "tokenizer_config.json") if folder is not None else "the tokenizer config"
        if not isinstance(config, dict):
            raise ValueError(f"{where}: expected a JSON object, found {_kind(config)}")
        self.tok, self.config, self._config_file = tokenizer, config, where
        #: name -> template text, and the file (and key) each came from, for messages
        self.chat_templates, self._template_files = _chat_templates(config.get("chat_template"), where)
        if folder is not None and (folder / "chat_template.jinja").is_file():
            f = folder / "chat_template.jinja"
            self.chat_templates, self._template_files = {"default": _read_text(f)}, {"default": str(f)}
        self.chat_template = self.chat_templates.get("default")        #: the template applied (None: none)
        self.eos_token = _token_text(config.get("eos_token"), "eos_token", where)
        self.bos_token = _token_text(config.get("bos_token"), "bos_token", where)
        self._compiled: dict[tuple, object] = {}

    @classmethod
    def from_pretrained(cls, path) -> "Tokenizer":
        """The tokenizer of the model folder ``path`` (``tokenizer.json``, optional ``tokenizer_config.json`` and
        ``chat_template.jinja``)."""
        from tokenizers import Tokenizer as HFTokenizer

        folder = Path(path)
        if not folder.exists():
            raise FileNotFoundError(f"{folder}: the model folder does not exist")
        if not folder.is_dir():
            raise NotADirectoryError(f"{folder}: expected a model folder, found a file")
        f = folder / "tokenizer.json"
        if not f.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {folder}")
        try:
            tok = HFTokenizer.from_file(str(f))
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as err:        # the library raises bare Exceptions, and a Rust panic is a BaseException
            problem = _json_problem(f)
            raise ValueError(f"{f}: not a tokenizer: {problem}" if problem else
                             f"{f}: the tokenizers library cannot read it: {err}") from None
        cfg_file = folder / "tokenizer_config.json"
        cfg = _read_json(cfg_file) if cfg_file.is_file() else {}
        return cls(tok, cfg, folder)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_id(self, text: str) -> int | None:
        return self.tok.token_to_id(text)

    @property
    def stop_ids(self) -> list[int]:
        """Ids of the end-of-sequence tokens the tokenizer config names (e.g. ``<|im_end|>``)."""
        ids = [self.token_id(t) for t in (self.eos_token,) if t]
        return [i for i in ids if i is not None]

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True, **kwargs) -> str:
        """Render ``messages`` with the checkpoint's own template (jinja2's sandbox, HF's settings, the bounds of
        the class docstring). Raises a ValueError naming the template's file when it has none, does not compile,
        fails, or passes a bound."""
        name = "tool_use" if kwargs.get("tools") is not None and "tool_use" in self.chat_templates else "default"
        text = self.chat_template if name == "default" else self.chat_templates[name]
        source = self._template_files.get(name, "the chat template")
        if not text:
            if self.chat_templates:
                raise ValueError(f"{self._config_file}: chat_template names the templates "
                                 f"{sorted(self.chat_templates)}; none is 'default', the one applied")
            raise ValueError(f"{self._config_file}: no chat_template (nor a chat_template.jinja beside it), so "
                             f"this tokenizer has no chat template to apply")
        if not isinstance(text, str):
            raise ValueError(f"{source}: the chat template must be a string, found {_kind(text)}")
        key = (text, self.template_max_chars)
        template = self._compiled.get(key)
        if template is None:
            template = self._compiled[key] = _compile_template(text, source, self.template_max_chars)
        return _render(template, source, self.template_max_chars, self.template_timeout_s, dict(
            messages=messages, add_generation_prompt=add_generation_prompt, eos_token=self.eos_token or "",
            bos_token=self.bos_token or "", **kwargs))


def _kind(x) -> str:
    """What a JSON value is, for messages: ``a list ([1, 2])``."""
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
             float: "a number", type(None): "null"}
    text = repr(x)
    return f"{names.get(type(x), type(x).__name__)} ({text[:60] + '...' if len(text) > 60 else text})"


def _read_text(f: Path) -> str:
    try:
        return f.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{f}: not UTF-8 text (byte {err.start}); the file is damaged") from None


def _read_json(f: Path):
    try:
        return json.loads(_read_text(f))
    except json.JSONDecodeError as err:
        raise ValueError(f"{f}: not valid JSON ({err.msg} at line {err.lineno} column {err.colno}); the file is "
                         f"damaged or truncated") from None


def _json_problem(f: Path) -> str | None:
    """Why ``tokenizer.json`` ``f`` is not a tokenizer, when it is not one at the JSON level; None when it is JSON
    of a tokenizer's shape (the library's own message says more then)."""
    try:
        d = _read_json(f)
    except ValueError as err:
        return str(err).removeprefix(f"{f}: ")
    if not isinstance(d, dict) or not isinstance(d.get("model"), dict):
        return f"expected a JSON object with a 'model' object (a tokenizers library file), found {_kind(d)}"
    return None


def _chat_templates(value, where: str) -> tuple[dict[str, str], dict[str, str]]:
    """The config's ``chat_template`` as ``{name: template}`` and ``{name: where it came from}``: a string is the
    ``default``; HF's list of ``{"name", "template"}`` objects (or a name -> template object) names each."""
    if value is None:
        return {}, {}
    if isinstance(value, str):
        return {"default": value}, {"default": f"{where} (chat_template)"}
    if isinstance(value, dict):
        value = [{"name": k, "template": v} for k, v in value.items()]
    if not isinstance(value, list):
        raise ValueError(f"{where}: chat_template must be a string or a list of {{\"name\", \"template\"}} "
                         f"objects, found {_kind(value)}")
    out, files = {}, {}
    for i, entry in enumerate(value):
        if not (isinstance(entry, dict) and isinstance(entry.get("name"), str)
                and isinstance(entry.get("template"), str)):
            raise ValueError(f"{where}: chat_template[{i}] must be an object with a string 'name' and a string "
                             f"'template', found {_kind(entry)}")
        out[entry["name"]], files[entry["name"]] = entry["template"], f"{where} (chat_template {entry['name']!r})"
    return out, files


def _token_text(t, key: str, where: str) -> str | None:
    """A special token of the config: a string, HF's ``{"content": ...}`` object, or null."""
    if isinstance(t, dict):
        t = t.get("content")
    if t is not None and not isinstance(t, str):
        raise ValueError(f"{where}: {key} must be a string, an object with a string 'content', or null; found "
                         f"{_kind(t)}")
    return t


# ---------------------------------------------------------------------------------------------------------------
# the chat template's sandbox


class _TemplateLimit(Exception):
    """A chat template passed one of its bounds (the message says which)."""


class _TemplateRaised(Exception):
    """The template's own ``raise_exception(message)``, which HF gives templates to refuse their input."""


def _raise_exception(message):
    raise _TemplateRaised(message if isinstance(message, str) else repr(message))


def _compile_template(text: str, source: str, max_chars: int):
    from jinja2.exceptions import TemplateSyntaxError

    try:
        return _environment(max_chars).from_string(text)
    except TemplateSyntaxError as err:
        raise ValueError(f"{source}: the chat template does not compile: {err.message} (template line "
                         f"{err.lineno})") from None
    except Exception as err:                 # e.g. a RecursionError from a deeply nested expression
        raise ValueError(f"{source}: the chat template does not compile: {type(err).__name__}: {err}") from None


def _render(template, source: str, max_chars: int, timeout_s: float, context: dict) -> str:
    """``template`` rendered in chunks, each counted against ``max_chars``, under a deadline ``timeout_s`` away
    that every line of the template's code checks (:class:`_Deadline`); any failure a ValueError naming
    ``source``."""
    parts, n = [], 0
    try:
        with _Deadline(timeout_s):
            for chunk in template.generate(**context):
                n += len(chunk)
                if n > max_chars:
                    raise _TemplateLimit(f"renders more than {max_chars:,} characters (the limit)")
                parts.append(chunk)
    except _TemplateLimit as err:
        raise ValueError(f"{source}: the chat template {err}{_at_line(err)}") from None
    except _TemplateRaised as err:
        raise ValueError(f"{source}: the chat template refused the messages: {err}") from None
    except Exception as err:                 # the template is data: whatever it does wrong is a bad input
        raise ValueError(f"{source}: the chat template failed{_at_line(err)}: {type(err).__name__}: {err}") \
            from None
    return "".join(parts)


def _at_line(err: BaseException) -> str:
    """`` (template line N)`` from the traceback jinja2 rewrites to the template's lines, or ''."""
    line, tb = None, err.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return f" (template line {line})" if line else ""


class _Deadline:
    """Within this block, every line the template's own code runs (every turn of its loops, every macro call)
    checks the clock: a loop that renders nothing stops too. A trace function on the template's frames only
    (jinja2 compiles them from ``<template>``); the thread's previous one comes back after."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def __enter__(self):
        self.deadline = time.monotonic() + self.seconds
        self.previous = sys.gettrace()
        sys.settrace(self._call)
        return self

    def __exit__(self, *exc):
        sys.settrace(self.previous)

    def _call(self, frame, event, arg):
        return self._line(frame, event, arg) if frame.f_code.co_filename == "<template>" else None

    def _line(self, frame, event, arg):
        if time.monotonic() > self.deadline:
            raise _TemplateLimit(f"ran past its time limit of {self.seconds:g} s")
        return self._line


_WIDTH = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")      # a %-format's width and precision
_FIELD = re.compile(r"\{[^{}]*\}|\{[^{}]*\{")                               # a str.format field, or one nesting


@functools.lru_cache(maxsize=4)
def _environment(max_chars: int):
    """A jinja2 ``ImmutableSandboxedEnvironment`` with HF's settings and globals (``raise_exception``,
    ``tojson``), whose operations cannot build a value past the bounds at once."""
    from jinja2 import pass_eval_context
    from jinja2.filters import do_center, do_format, do_indent, do_replace
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.utils import Namespace

    def size(value, what: str) -> None:
        if isinstance(value, (str, list, tuple)) and len(value) > max_chars:
            unit = "characters" if isinstance(value, str) else "items"
            raise _TemplateLimit(f"builds {what} of {len(value):,} {unit} (the limit is {max_chars:,})")

    def width(w, what: str) -> None:
        if isinstance(w, int) and w > max_chars:
            raise _TemplateLimit(f"asks for {what} of {w:,} characters (the limit is {max_chars:,})")

    def percent(fmt: str, what: str) -> None:
        for m in _WIDTH.finditer(fmt):
            for g in m.groups():
                if g == "*":
                    raise _TemplateLimit(f"uses a '*' width in {what}, which the sandbox refuses")
                width(int(g) if g else 0, f"a width in {what}")

    def replaced(s: str, old: str, new: str, count=None) -> None:
        n = s.count(old) if count is None or count < 0 else min(count, s.count(old))
        size_ = len(s) + n * (len(new) - len(old))
        if size_ > max_chars:
            raise _TemplateLimit(f"builds a string of {size_:,} characters by replace (the limit is {max_chars:,})")

    def repeat(seq, n) -> None:
        if isinstance(seq, str) and _is_int(n) and len(seq) * n > max_chars:
            raise _TemplateLimit(f"builds a string of {len(seq) * n:,} characters by '*' (the limit is "
                                 f"{max_chars:,})")
        if isinstance(seq, (list, tuple)) and _is_int(n):          # its items count too: str() of it holds them
            weight = n * sum(len(x) if isinstance(x, (str, list, tuple)) else 1 for x in seq)
            if weight > max_chars:
                raise _TemplateLimit(f"builds a list of {len(seq) * n:,} items holding {weight:,} characters and "
                                     f"items by '*' (the limit is {max_chars:,})")

    def bits(value: int, what: str) -> None:
        if value > TEMPLATE_MAX_BITS:
            raise _TemplateLimit(f"builds an integer of about {value:,} bits by {what} (the limit is "
                                 f"{TEMPLATE_MAX_BITS:,})")

    class BoundedNamespace(Namespace):
        def __setitem__(self, name, value):
            size(value, f"namespace attribute {name!r}")
            super().__setitem__(name, value)

    class Environment(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "%", "+"})

        def call_binop(self, context, op, left, right):
            if op == "*":
                repeat(left, right)
                repeat(right, left)
                if _is_int(left) and _is_int(right):
                    bits(abs(left).bit_length() + abs(right).bit_length(), "'*'")
            elif op == "**" and _is_int(left) and _is_int(right) and abs(left) > 1 and right > 0:
                bits(abs(left).bit_length() * right, "'**'")
            elif op == "%" and isinstance(left, str):
                percent(left, "a '%' format")
            elif op == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
                if len(left) + len(right) > max_chars:
                    unit = "characters" if isinstance(left, str) else "items"
                    raise _TemplateLimit(f"builds a value of {len(left) + len(right):,} {unit} by '+' (the limit "
                                         f"is {max_chars:,})")
            return super().call_binop(context, op, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805  (jinja2's own names)
            for a in (*args, *kwargs.values()):
                size(a, "an argument")
            owner = getattr(__obj, "__self__", None)
            if isinstance(owner, str):
                name = getattr(__obj, "__name__", "")
                if name in ("center", "ljust", "rjust", "zfill") and args:
                    width(args[0], f"str.{name}")
                elif name == "replace" and len(args) >= 2 and all(isinstance(a, str) for a in args[:2]):
                    replaced(owner, *args[:2], *(a for a in args[2:3] if isinstance(a, int)))
                elif name == "expandtabs":
                    width(owner.count("\t") * (args[0] if args and isinstance(args[0], int) else 8), "expandtabs")
                elif name == "join" and args and isinstance(args[0], (list, tuple)):
                    width(len(owner) * len(args[0]) + sum(len(x) for x in args[0] if isinstance(x, str)),
                          "str.join")
            return super().call(__context, __obj, *args, **kwargs)

        def wrap_str_format(self, value):
            wrapped = super().wrap_str_format(value)
            if wrapped is not None:
                for field in _FIELD.findall(value.__self__):
                    if field.count("{") > 1:
                        raise _TemplateLimit("uses a nested field in a str.format spec, which the sandbox refuses")
                    for digits in re.findall(r"\d+", field.partition(":")[2]):
                        width(int(digits), "a width in str.format")
            return wrapped

    def center(value, width_=80):
        width(width_, "center")
        return do_center(value, width_)

    def indent(s, width_=4, first=False, blank=False):
        width(str(s).count("\n") * (width_ if isinstance(width_, int) else len(str(width_))), "indent")
        return do_indent(s, width_, first, blank)

    def format_(value, *args, **kwargs):
        percent(str(value), "the format filter")
        return do_format(value, *args, **kwargs)

    @pass_eval_context
    def replace(eval_ctx, s, old, new, count=None):
        replaced(str(s), str(old), str(new), count)
        return do_replace(eval_ctx, s, old, new, count)

    def tojson(x, indent=None, **kw):
        width(indent if isinstance(indent, int) else 0, "tojson's indent")
        return json.dumps(x, indent=indent, ensure_ascii=False)

    def range_(*args):
        r = range(*args)
        try:
            n = f"{len(r):,}" if len(r) > TEMPLATE_MAX_RANGE else None
        except OverflowError:                     # len() past sys.maxsize
            n = f"more than {sys.maxsize:,}"
        if n is not None:
            raise _TemplateLimit(f"asks for range({', '.join(map(repr, args))}): {n} items (the limit is "
                                 f"{TEMPLATE_MAX_RANGE:,})")
        return r

    env = Environment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters.update(center=center, indent=indent, format=format_, replace=replace, tojson=tojson)
    env.globals.update(raise_exception=_raise_exception, range=range_, namespace=BoundedNamespace)
    env.globals.pop("lipsum", None)                       # n paragraphs at once: no chat template needs it
    return env


class TextStream:
    """A ``stream=`` callback that decodes one sequence's new tokens incrementally and writes the text as it
    grows (a token may end mid-character; the text is only written once it decodes cleanly)."""

    def __init__(self, tokenizer: Tokenizer, write: Callable[[str], None], row: int = 0):
        self.tok, self.write, self.row = tokenizer, write, row
        self.ids: list[int] = []
        self.shown = 0

    def __call__(self, nxt: torch.Tensor) -> None:
        t = int(nxt[self.row])
        if t < 0:                                     # this sequence has finished
            return
        self.ids.append(t)
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return
        self.write(text[self.shown:])
        self.shown = len(text)
