"""The decoder on a kernel variant: ``in_decoder(variant, preset)`` (the model-level half of
:mod:`lynn_kernels.lab`, which cannot import the model).

Greedy tokens of a random-weight model of ``preset`` with the variant routed in (:func:`lynn_kernels.lab.using`)
against the shipped kernels, from the same prompt: equal, or the first position where they part, with each path's
two best tokens and logits there. On a GPU the model runs as ``lynn generate`` runs it there (each mixer's input
projections in one GEMV, each Gated DeltaNet decode step in one kernel: ``fused=True``), and the report adds tokens
per second at batch 1 and 8 (a CUDA graph of the decode step, replayed per token), shipped and variant alternating.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import torch

from lynn_kernels import lab, runtime
from lynn_kernels.lab.race import can_time
from lynn_kernels.metrics import render_table

from .config import preset as get_preset
from .generate import Stats, generate
from .loader import random_model

#: On a CPU a tiny preset (the interpreter runs a step of it in about a second); on a GPU the one the issue names.
DEFAULT_PRESET = "tiny-qwen3.5-moe"


@dataclass
class DecoderReport:
    variant: lab.Variant
    preset: str
    shipped_tokens: list[int]
    variant_tokens: list[int]
    calls: int                                  #: calls of the variant from Python while the decoder made its tokens
    divergence: dict | None = None              #: first differing position, with both paths' top-2 there
    speed: list[dict] = field(default_factory=list)
    fused: bool = False                         #: input projections and Gated DeltaNet decode fused, as on a GPU

    @property
    def equal(self) -> bool:
        return self.shipped_tokens == self.variant_tokens

    def __str__(self) -> str:
        v = self.variant
        ran = (f"the variant was called {self.calls} times from Python (a captured graph's replays not counted)"
               if self.calls else "the variant NEVER RAN: the decoder reaches this op another way (a fused path)")
        form = "fused as lynn generate runs it on a GPU" if self.fused else "as loaded"
        lines = [f"{v.label} in the {self.preset} decoder ({form}; random weights, greedy): {ran}; "
                 + (f"{len(self.shipped_tokens)} tokens, equal to the shipped path" if self.equal else
                    f"the tokens part at position {self.divergence['position']}")]
        if self.divergence:
            d = self.divergence
            lines.append(f"  shipped: top-2 {d['shipped_top2']}, variant: top-2 {d['variant_top2']} "
                         "(token, logit)")
        if self.speed:
            lines.append(render_table(self.speed, digits=4))
        elif not can_time():
            lines.append("  tokens per second need a GPU (this run is on the interpreter)")
        return "\n".join(lines)

    __repr__ = __str__


def _top2(logits: torch.Tensor) -> list[tuple[int, float]]:
    vals, ids = torch.topk(logits.float().flatten(), 2)
    return [(int(i), round(float(x), 4)) for i, x in zip(ids, vals)]


def _logits_after(model, prompt: list[int], made: list[int]) -> torch.Tensor:
    """The logits of the next token after ``prompt`` and the tokens ``made`` from it, on the path that made them:
    one prefill of the prompt, then one decode step per made token (the kernels a decode-only variant replaces)."""
    cache = model.new_cache(max_batch=1, max_tokens=len(prompt) + len(made) + 8)
    s = cache.add()
    dev = model.device
    logits = model.step(torch.tensor(prompt, dtype=torch.int64, device=dev), cache, [s], [len(prompt)])
    for t in made:
        logits = model.step(torch.tensor([t], dtype=torch.int64, device=dev), cache, [s], [1])
    return logits[0]


def in_decoder(v, fn=None, *, preset: str | None = None, new_tokens: int = 8, prompt_len: int = 12,
               batches: tuple[int, ...] = (1, 8), speed_tokens: int = 64, seed: int = 0,
               fused: bool | None = None) -> DecoderReport:
    """Run the decoder of ``preset`` (default: a tiny one on a CPU, ``qwen3.5-35b-a3b`` on a GPU) on the variant and
    on the shipped kernels; see the module docstring. ``v, fn``: as :func:`lynn_kernels.lab.variant`. ``fused``:
    fuse the input projections and the Gated DeltaNet decode step first (default: on a GPU, as ``lynn generate``)."""
    v = lab.variant(v, fn) if fn is not None else lab.variant(v)
    gpu = can_time()
    name = preset or ("qwen3.5-35b-a3b" if gpu else DEFAULT_PRESET)
    cfg = get_preset(name)
    fused = gpu if fused is None else fused
    model = random_model(cfg, weights="nvfp4", device=runtime.DEVICE, seed=seed, fuse=fused)
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, cfg.vocab_size, (1, prompt_len), generator=gen)
    want = generate(model, prompt, new_tokens)[0, prompt_len:].tolist()
    with lab.using(v) as hits:
        got = generate(model, prompt, new_tokens)[0, prompt_len:].tolist()
    report = DecoderReport(v, name, want, got, sum(hits.values()), fused=fused)
    if not report.equal:
        i = next(j for j, (a, b) in enumerate(zip(want, got)) if a != b)
        first = prompt[0].tolist()
        shipped_logits = _logits_after(model, first, want[:i])
        with lab.using(v):
            variant_logits = _logits_after(model, first, want[:i])      # the two paths agree on want[:i]
        report.divergence = {"position": i, "shipped_token": want[i], "variant_token": got[i],
                             "shipped_top2": _top2(shipped_logits), "variant_top2": _top2(variant_logits)}
    if gpu:
        report.speed = _speed(model, v, cfg.vocab_size, batches, speed_tokens, gen)
    return report


def _speed(model, v, vocab: int, batches, tokens: int, gen: torch.Generator, rounds: int = 2) -> list[dict]:
    """Decode tokens per second of each path at each batch size, alternating shipped and variant."""
    rows = []
    for b in batches:
        prompts = torch.randint(0, vocab, (b, 16), generator=gen)
        rates: dict[str, list[float]] = {"shipped": [], v.label: []}
        for r in range(rounds):
            for label in (("shipped", v.label) if r % 2 == 0 else (v.label, "shipped")):
                stats = Stats()
                if label == "shipped":
                    generate(model, prompts, tokens, stats=stats)
                else:
                    with lab.using(v, count=False):
                        generate(model, prompts, tokens, stats=stats)
                rates[label].append(stats.decode_tok_s)
        base = statistics.median(rates["shipped"])
        for label, got in rates.items():
            rate = statistics.median(got)
            rows.append({"batch": b, "path": label, "tok/s": rate, "vs shipped": rate / base if base else None})
    return rows


__all__ = ["in_decoder", "DecoderReport", "DEFAULT_PRESET"]
