"""Generation: a packed prefill, then batched decode steps over the cache (a CUDA graph on a GPU); the checkpoint's
tokenizer.

``generate(model, input_ids, max_new_tokens, ...)`` is the contract; :class:`Tokenizer` wraps HF ``tokenizers``
(``tokenizer.json``) and renders the checkpoint's own chat template with jinja2, as HF does.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

import lynn_kernels

from .graphs import DecodeStep, bucket_for
from .model import Model
from .sampling import Sampling, SamplingParams, sample_rows


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

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    batch: int = 0                   #: sequences in the call

    @property
    def decode_tok_s(self) -> float:
        """Tokens made by decode steps (all but each sequence's first) per second of decoding."""
        return (self.new_tokens - self.batch) / self.decode_s if self.decode_s else 0.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def generate(model: Model, input_ids, max_new_tokens: int, *, temperature: float = 0.0, top_k: int | None = None,
             top_p: float | None = None, seed: int | None = None, stop_ids: Sequence[int] | None = None,
             stream: Callable[[torch.Tensor], None] | None = None, stats: Stats | None = None,
             max_tokens: int | None = None, cuda_graph: bool | None = None) -> torch.Tensor:
    """Continue ``B`` prompts by up to ``max_new_tokens`` tokens each.

    One packed prefill of the prompts, then decode steps of the whole batch through a :class:`DecodeStep`: on a GPU
    with the compiled kernels a CUDA graph captured once (the batch padded to its bucket, 1, 2, 4, ..., 32) and
    replayed per token, the host reading each step's tokens while the next step runs; elsewhere the same step
    eagerly.

    Args:
        input_ids: int64 ``[B, T]`` (or a list of ``B`` token lists of any lengths: a varlen batch).
        temperature, top_k, top_p: sampling (see :func:`lynn_model.sample`); ``temperature=0.0`` is greedy.
        seed: the requests' stream of draws (:mod:`lynn_model.sampling`): a seeded call repeats exactly, on the
            graph and the eager path alike. None: a seed drawn from torch's host generator.
        stop_ids: a sequence ends after emitting one of these; the others go on.
        stream: called after each step with ``[B]`` tokens: the new one of each live sequence, ``-1`` for one that
            has finished. A finished sequence stops writing its cache; its row idles in the batch.
        stats: filled with the prefill / decode timings.
        max_tokens: the cache's token budget (default: every prompt plus ``max_new_tokens``).
        cuda_graph: capture the decode step (default: on a GPU with the compiled kernels); False runs it eagerly.

    Returns:
        int64 ``[B, T + n]`` with ``n <= max_new_tokens`` the steps run (fewer when every sequence stopped); rows of
        a list input are right-padded with their last token.
    """
    if isinstance(input_ids, torch.Tensor) and (input_ids.dim() != 2 or input_ids.dtype != torch.int64):
        raise ValueError(f"input_ids must be int64 [B, T], got {input_ids.dtype} {tuple(input_ids.shape)}")
    rows = [list(map(int, r)) for r in (input_ids.tolist() if isinstance(input_ids, torch.Tensor) else input_ids)]
    if not rows or any(len(r) == 0 for r in rows):
        raise ValueError("input_ids needs at least one prompt, each of at least one token")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens = {max_new_tokens}: expected >= 0")
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,)).item())
    setting = Sampling(temperature, top_k, top_p, seed)              # checks the settings
    dev, vocab, nseq = model.device, model.config.vocab_size, len(rows)
    if cuda_graph is None:
        cuda_graph = dev.type == "cuda" and lynn_kernels.backend() == "triton"
    # on a GPU the batch runs in its bucket's rows, captured or not (so the two give the same bits)
    width = bucket_for(nseq) if dev.type == "cuda" else nseq
    stops = set(int(t) for t in (stop_ids or []))
    stats = stats if stats is not None else Stats()
    stats.prompt_tokens, stats.batch = sum(map(len, rows)), nseq
    budget = max_tokens or sum(len(r) + max_new_tokens for r in rows)
    cache = model.new_cache(max_batch=width, max_tokens=budget + 16 * nseq)
    stats.cache_bytes, stats.cuda_graph = cache.nbytes(), bool(cuda_graph) and max_new_tokens > 1
    out = [list(r) for r in rows]
    if max_new_tokens == 0:
        return _pack(out)
    with torch.inference_mode():
        step = None
        if max_new_tokens > 1:
            t0 = time.perf_counter()
            step = DecodeStep(model, cache, width, SamplingParams.build([setting] * width, dev, vocab),
                              graph=cuda_graph)
            stats.capture_s = time.perf_counter() - t0
        slots = [cache.add() for _ in rows]
        _sync(dev)
        t0 = time.perf_counter()
        logits = model.step(torch.tensor([t for r in rows for t in r], dtype=torch.long, device=dev), cache, slots,
                            [len(r) for r in rows])
        counter = torch.tensor([len(r) for r in rows], dtype=torch.int64, device=dev)
        nxt = sample_rows(logits, SamplingParams.build([setting] * nseq, dev, vocab), counter)
        _sync(dev)
        stats.prefill_s = time.perf_counter() - t0
        live = _emit(out, list(range(nseq)), nxt.tolist(), stops, stream)   # rows still generating
        stats.new_tokens = nseq
        if step is None or not live:
            return _pack(out)
        cache.reserve(slots, [len(r) + max_new_tokens for r in rows])
        step.begin(nxt, slots)
        t0 = time.perf_counter()
        reader = _Reader(step, dev)
        launched, pending = 0, None
        while True:              # launch step k + 1, then read step k's tokens while it runs
            done = None
            if live and launched < max_new_tokens - 1:
                step.replay()
                done = reader.copy(launched)
                launched += 1
            if pending is not None:
                new = reader.read(pending)
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


class _Reader:
    """Two host buffers (pinned on a GPU) that take turns receiving a step's tokens, each with its event."""

    def __init__(self, step: DecodeStep, device: torch.device):
        cuda = device.type == "cuda"
        self.step, self.cuda = step, cuda
        self.bufs = [torch.empty(step.rows, dtype=torch.int64, pin_memory=cuda) for _ in range(2)]
        self.events = [torch.cuda.Event() if cuda else None for _ in range(2)]

    def copy(self, k: int) -> int:
        """Queue step ``k``'s tokens into buffer ``k % 2``; returns ``k``."""
        self.bufs[k % 2].copy_(self.step.tokens, non_blocking=self.cuda)
        if self.cuda:
            self.events[k % 2].record()
        return k

    def read(self, k: int) -> list[int]:
        if self.cuda:
            self.events[k % 2].synchronize()
        return self.bufs[k % 2].tolist()


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


class Tokenizer:
    """A checkpoint's ``tokenizer.json`` (HF ``tokenizers``) and its chat template (jinja2, as HF renders it).

    Example::

        tok = Tokenizer.from_pretrained("path/to/model")
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True))
        text = tok.decode(ids)
    """

    def __init__(self, tokenizer, config: dict, folder: Path | None = None):
        self.tok, self.config = tokenizer, config
        self.chat_template = config.get("chat_template")
        if folder is not None and (folder / "chat_template.jinja").is_file():
            self.chat_template = (folder / "chat_template.jinja").read_text()
        self.eos_token = _token_text(config.get("eos_token"))
        self.bos_token = _token_text(config.get("bos_token"))

    @classmethod
    def from_pretrained(cls, path) -> "Tokenizer":
        from tokenizers import Tokenizer as HFTokenizer

        folder = Path(path)
        f = folder / "tokenizer.json"
        if not f.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {folder}")
        cfg_file = folder / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        return cls(HFTokenizer.from_file(str(f)), cfg, folder)

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
        """Render ``messages`` with the checkpoint's own template (jinja2's sandbox, HF's settings)."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat_template (tokenizer_config.json or chat_template.jinja)")
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, indent=indent, ensure_ascii=False)
        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, eos_token=self.eos_token or "",
            bos_token=self.bos_token or "", **kwargs)


def _token_text(t) -> str | None:
    if isinstance(t, dict):
        return t.get("content")
    return t


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
