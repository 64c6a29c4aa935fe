"""Generation: a packed prefill, then batched decode steps over the cache; sampling; the checkpoint's tokenizer.

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

from .model import Model


def sample(logits: torch.Tensor, *, temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """Next tokens ``[N]`` (int64) from ``logits [N, vocab]``: greedy (``temperature == 0``: argmax, ties to the
    lowest id) or a draw from ``softmax(logits / temperature)`` restricted to the ``top_k`` best and to the smallest
    set whose probability reaches ``top_p`` (the best token always stays)."""
    if temperature < 0:
        raise ValueError(f"temperature = {temperature}: expected >= 0")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k = {top_k}: expected >= 1 or None")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p = {top_p}: expected in (0, 1] or None")
    x = logits.float()
    if temperature == 0:
        return x.argmax(-1)
    x = x / temperature
    if top_k is not None and top_k < x.shape[-1]:
        kth = x.topk(top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        srt, idx = x.sort(-1, descending=True)
        probs = srt.softmax(-1)
        drop = probs.cumsum(-1) - probs >= top_p          # mass before this token already reaches top_p
        drop[:, 0] = False
        x = x.scatter(-1, idx, srt.masked_fill(drop, float("-inf")))
    probs = x.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


@dataclass
class Stats:
    """Timings of one :func:`generate` call (seconds, tokens)."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0

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
             max_tokens: int | None = None) -> torch.Tensor:
    """Continue ``B`` prompts by up to ``max_new_tokens`` tokens each.

    Args:
        input_ids: int64 ``[B, T]`` (or a list of ``B`` token lists of any lengths: a varlen batch).
        temperature, top_k, top_p: sampling (see :func:`sample`); ``temperature=0.0`` is greedy.
        seed: seeds the sampler (a generator on the model's device), so a seeded call repeats exactly.
        stop_ids: a sequence ends after emitting one of these; the others go on.
        stream: called after each step with ``[B]`` tokens: the new one of each live sequence, ``-1`` for one that
            has finished. Finished sequences leave the batch: the next steps run the others only.
        stats: filled with the prefill / decode timings.
        max_tokens: the cache's token budget (default: every prompt plus ``max_new_tokens``).

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
    dev = model.device
    stops = set(int(t) for t in (stop_ids or []))
    gen = None
    if seed is not None:
        gen = torch.Generator(device=dev)
        gen.manual_seed(seed)
    stats = stats if stats is not None else Stats()
    stats.prompt_tokens, stats.batch = sum(map(len, rows)), len(rows)
    budget = max_tokens or sum(len(r) + max_new_tokens for r in rows)
    cache = model.new_cache(max_batch=len(rows), max_tokens=budget + 16 * len(rows))
    slots = [cache.add() for _ in rows]
    out = [list(r) for r in rows]
    if max_new_tokens == 0:
        return _pack(out)
    with torch.inference_mode():
        _sync(dev)
        t0 = time.perf_counter()
        logits = model.step(torch.tensor([t for r in rows for t in r], dtype=torch.long, device=dev), cache, slots,
                            [len(r) for r in rows])
        nxt = sample(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=gen)
        _sync(dev)
        stats.prefill_s = time.perf_counter() - t0
        live = list(range(len(rows)))                 # rows still generating: only they run the next step
        live = _emit(out, live, nxt, stops, stream)
        stats.new_tokens = len(rows)
        steps = 1
        t0 = time.perf_counter()
        while steps < max_new_tokens and live:
            last = torch.tensor([out[b][-1] for b in live], dtype=torch.long, device=dev)
            logits = model.step(last, cache, [slots[b] for b in live], [1] * len(live))
            nxt = sample(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=gen)
            stats.new_tokens += len(live)
            live = _emit(out, live, nxt, stops, stream)
            steps += 1
        _sync(dev)
        stats.decode_s = time.perf_counter() - t0
        stats.decode_steps = steps - 1
    return _pack(out)


def _emit(out: list[list[int]], live: list[int], nxt: torch.Tensor, stops: set, stream) -> list[int]:
    """Append each live row's new token; returns the rows still live. ``stream`` gets ``[B]`` tokens, ``-1`` for a
    row that had already finished."""
    new = nxt.tolist()
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
