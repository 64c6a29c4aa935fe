"""Speculative decoding with the checkpoint's own multi-token prediction (MTP) module: draft ``k`` tokens, verify
them in one step of the trunk, keep the prefix the trunk accepts, roll the rest back.

One round for a sequence whose cache holds ``L`` tokens and whose next token ``x`` is known (not yet run)::

    drafts d1..dk               the MTP module, one token after another (its own keys and values, its own hidden)
    verify [x, d1, .., dk]      one unrolled step of the trunk: each token as its own decode step would run it
    accept a                    by the rule (below): the drafts d1..da are kept
    emit d1..da, y              y = the trunk's token after the last accepted one (a correction, or a bonus token
                                when all k were accepted)
    roll back                   the cache keeps x, d1..da (the Gated DeltaNet states saved after each token)
    MTP catch-up                the MTP module reruns positions L..L+a on the trunk's hidden states, then drafts

Two acceptance rules (``rule``); a greedy request gets the same tokens under both:

``"coupled"`` (the default)
    A draft is kept when it is the token plain decoding would pick there: the argmax, or for a sampled request the
    same Gumbel-max draw plain sampling makes (its noise is a function of the request's seed, the token's index and
    the token id: :mod:`lynn_model.sampling`). The drafts are drawn with that same noise from the MTP module's
    logits, so a module that agrees with the trunk is accepted under sampling too. The output equals plain
    decoding's token for token, greedy or seeded, wherever the kernels give a row the same bits whatever the number
    of rows beside it (docs/decoder.md, "Speculative decoding").
``"rejection"``
    The speculative sampling test (Leviathan et al. 2023; Chen et al. 2023): draft ``d`` drawn from the module's
    distribution ``q`` is kept with probability ``min(1, p(d) / q(d))`` (``p``: the trunk's distribution, both
    after the request's temperature, top-k and top-p); the first rejected one is replaced by a draw from
    ``max(0, p - q)`` normalised, and a bonus token is drawn from ``p``. Every token is distributed as plain
    sampling's, but the tokens differ from a plain run with the same seed. It keeps at least as many drafts as the
    coupled rule on average (the chance a draft is kept is ``sum min(p, q)``, the most any rule can keep); its
    uniforms are counter-based hashes too, so a seeded run repeats.
"""

from __future__ import annotations

from typing import Callable

import torch

from .cache import Cache
from .model import Model
from .sampling import Sampling, SamplingParams, probabilities, sample_rows, uniform

#: The acceptance rules (module docstring).
RULES = ("coupled", "rejection")

# the rejection rule's two streams of uniforms (its acceptance tests, its residual draws) are the request's seed
# mixed with these, so they stay apart from each other and from the stream the drafts and plain sampling draw from
_ACCEPT_SALT, _RESIDUAL_SALT = 0x2545F4914F6CDD1D, 0x5851F42D4C957F2D


class Params:
    """:class:`SamplingParams` for rows that repeat each sequence's :class:`Sampling` ``repeat`` times, built once
    per distinct set (a speculative round samples ``k + 1`` rows of each sequence)."""

    def __init__(self, device, vocab: int):
        self.device, self.vocab, self._built = device, vocab, {}

    def __call__(self, settings: list[Sampling], repeat: int = 1) -> SamplingParams:
        key = (tuple(settings), repeat)
        if key not in self._built:
            rows = [s for s in settings for _ in range(repeat)]
            self._built[key] = SamplingParams.build(rows, self.device, self.vocab)
        return self._built[key]


def _check_rule(rule: str) -> None:
    if rule not in RULES:
        raise ValueError(f"rule = {rule!r}: expected one of {', '.join(map(repr, RULES))}")


class MTPDrafter:
    """Drafts with the model's MTP module, keeping its keys and values in the trunk's cache; each draft is drawn
    from the module's logits by the request's own sampling (its argmax when greedy)."""

    def __init__(self, model: Model, k: int, rule: str = "coupled"):
        if model.mtp is None:
            raise ValueError(f"{model.config.name or model.config.family}: this model has no MTP module (its "
                             f"checkpoint holds no mtp.* tensors); run without --mtp")
        _check_rule(rule)
        self.model, self.k, self.rule = model, k, rule
        self.params = Params(model.device, model.config.vocab_size)

    def draft(self, cache: Cache, slots: list[int], nxt: list[int], hidden: torch.Tensor, lens: list[int],
              starts: list[int], settings: list[Sampling] | None) -> tuple[list[list[int]], torch.Tensor | None]:
        """The MTP layer over ``lens[b]`` positions of sequence ``slots[b]`` from ``starts[b]`` (``nxt``: the token
        after each position, ``hidden``: the trunk's rows there, packed), then ``k`` drafts after the last of them
        under ``settings`` (one per sequence). ``settings`` None: no drafts (a prompt chunk that is not its last).
        Returns the drafts ``[B][k]`` and, for the rejection rule, the distributions they were drawn from, fp32
        ``[B, k, vocab]`` (else None)."""
        m, dev = self.model, self.model.device
        logits, h = m.mtp_step(torch.tensor(nxt, dtype=torch.long, device=dev), hidden, cache, slots, lens, starts)
        if settings is None:
            return [], None
        params = self.params(settings)
        ends = torch.tensor(lens, device=dev).cumsum(0) - 1
        pos = [s + n for s, n in zip(starts, lens)]            # the next position; its token has index pos + 1
        h, drafts, dists = h[ends], [], []
        for i in range(self.k):
            if i:                               # a draft after a draft: its own hidden state, one position on
                logits, h = m.mtp_step(drafts[-1], h, cache, slots, [1] * len(slots), pos)
                pos = [p + 1 for p in pos]
            tok = sample_rows(logits, params, torch.tensor([p + 1 for p in pos], dtype=torch.int64, device=dev))
            drafts.append(tok)
            if self.rule == "rejection":
                dists.append(probabilities(logits, params))
        return torch.stack(drafts, 1).tolist(), torch.stack(dists, 1) if dists else None


def verify(model: Model, cache: Cache, slots: list[int], pending: list[int], drafts: list[list[int]],
           settings: list[Sampling], rule: str = "coupled", q: torch.Tensor | None = None,
           params: Params | None = None) -> tuple[list[int], list[int], list[int], torch.Tensor]:
    """One verify step of sequences ``slots``: their pending tokens and ``k`` drafts each, in one unrolled step of
    the trunk. ``q``: the drafts' distributions (the rejection rule). Returns per sequence the number of drafts
    kept ``a``, the trunk's token after them ``y``, whether the logits of rows ``0..a`` (those the round emits
    from) are all finite (1) or not (0), and the trunk's hidden states ``[B, k + 1, H]``. The cache is left
    holding all ``k + 1`` tokens: the caller rolls back to ``a + 1``."""
    dev, n, k = model.device, len(slots), len(drafts[0])
    params = params or Params(dev, model.config.vocab_size)
    starts = [cache.lengths[s] for s in slots]
    tokens = torch.tensor([t for x, d in zip(pending, drafts) for t in [x, *d]], dtype=torch.long, device=dev)
    logits, h = model.step(tokens, cache, slots, [k + 1] * n, all_logits=True, unroll=True, hidden=True)
    rows = params(settings, k + 1)
    counter = torch.tensor([p + j + 1 for p in starts for j in range(k + 1)], dtype=torch.int64, device=dev)
    d = torch.tensor(drafts, dtype=torch.long, device=dev).view(n, k)
    if rule == "coupled":
        want = sample_rows(logits, rows, counter).view(n, k + 1)
        a = (want[:, :k] == d).long().cumprod(-1).sum(-1)
        y = want.gather(1, a[:, None])[:, 0]
    else:
        _check_rule(rule)
        a, y = accept_rejection(logits, rows, counter, d, q)
    ok = torch.isfinite(logits.amax(-1)).view(n, k + 1)
    ok = (ok.long().cumprod(-1).gather(1, a[:, None])[:, 0])      # rows 0..a all finite
    a, y, ok = torch.stack([a, y, ok]).tolist()                   # one host read
    return a, y, ok, h.view(n, k + 1, -1)


def accept_rejection(logits: torch.Tensor, params: SamplingParams, counter: torch.Tensor, drafts: torch.Tensor,
                     q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The speculative sampling test on ``n`` sequences of ``k`` drafts: ``logits [n * (k + 1), vocab]`` the
    trunk's rows (row ``j`` of a sequence after its ``j``-th draft), ``params`` and ``counter`` theirs (the index of
    the token each row predicts), ``drafts [n, k]`` drawn from ``q [n, k, vocab]``. Returns ``a [n]`` (drafts
    kept) and ``y [n]`` (the token after them: from ``max(0, p - q)`` normalised at the first rejection, from ``p``
    when all are kept)."""
    n, k = drafts.shape
    vocab = logits.shape[-1]
    p = probabilities(logits, params).view(n, k + 1, vocab)
    seed, cnt = params.seed.view(n, k + 1), counter.view(n, k + 1)
    pd = p[:, :k].gather(-1, drafts[..., None])[..., 0]
    qd = q.gather(-1, drafts[..., None])[..., 0]
    zero = torch.zeros(n * k, 1, dtype=torch.int64, device=drafts.device)
    u = uniform(seed[:, :k].reshape(-1) ^ _ACCEPT_SALT, cnt[:, :k].reshape(-1), zero).view(n, k)
    a = (u * qd < pd).long().cumprod(-1).sum(-1)                  # kept while u < p(d) / q(d)
    at = torch.arange(n, device=drafts.device)
    pa = p[at, a]
    rest = (pa - torch.cat([q, q.new_zeros(n, 1, vocab)], 1)[at, a]).clamp_min(0)
    rest = torch.where(rest.sum(-1, keepdim=True) > 0, rest, pa)   # p == q to the last bit: nothing to correct
    ids = torch.arange(vocab, device=drafts.device).expand(n, vocab)
    g = -torch.log(-torch.log(uniform(seed[at, a] ^ _RESIDUAL_SALT, cnt[at, a], ids)))
    return a, (rest.log() + g).argmax(-1)


def speculative_decode(model: Model, cache: Cache, slots: list[int], out: list[list[int]], first: list[int],
                       hidden: torch.Tensor, k: int, budget: int, emit: Callable, stats,
                       settings: list[Sampling], rule: str = "coupled", drafter=None,
                       check_finite: Callable | None = None) -> None:
    """Continue sequences ``slots`` (``out[b]``: prompt and first token; ``hidden``: the prefill's rows) by
    speculative rounds until each stops or has ``budget`` more tokens. ``emit(b, token)`` takes each new token in
    order and returns whether sequence ``b`` goes on. ``settings``: each sequence's sampling. ``drafter``:
    :class:`MTPDrafter` by default (tests pass one that proposes chosen tokens). ``check_finite(live, flags)`` sees,
    before a round emits anything, whether the logits of each live sequence's rows it would emit from are finite
    (1) or not (0), and may raise."""
    _check_rule(rule)
    drafter = drafter or MTPDrafter(model, k, rule)
    params = Params(model.device, model.config.vocab_size)
    live = list(range(len(slots)))
    nxt = [t for o in out for t in o[1:]]                     # after each prompt position: the next prompt token
    drafts, q = drafter.draft(cache, slots, nxt, hidden, [len(o) - 1 for o in out], [0] * len(slots), settings)
    pending, left = list(first), [budget] * len(slots)
    while live:
        run = [slots[b] for b in live]
        starts = [cache.lengths[s] for s in run]
        took, fix, finite, h = verify(model, cache, run, [pending[b] for b in live], [drafts[b] for b in live],
                                      [settings[b] for b in live], rule, q, params)
        if check_finite is not None:
            check_finite(live, finite)
        accepted, rows, still, at = [], [], [], []
        for i, (b, a) in enumerate(zip(live, took)):
            stats.drafted += k
            stats.accepted += a
            stats.rounds.append((b, list(drafts[b]), a, fix[i]))
            new = [*drafts[b][:a], fix[i]]
            going = True
            for t in new[:left[b]]:
                going = emit(b, t)
                left[b] -= 1
                if not going:
                    break
            if going and left[b] > 0:
                still.append(b)
                at.append(i)
                accepted.append(new)
                rows.append(h[i, :a + 1])
                pending[b] = new[-1]
        stats.verify_steps += 1
        cache.rollback(run, [a + 1 for a in took])
        live = still
        if live:
            new_drafts, q_new = drafter.draft(cache, [run[i] for i in at], [t for a in accepted for t in a],
                                              torch.cat(rows), [len(a) for a in accepted], [starts[i] for i in at],
                                              [settings[b] for b in live])
            for b, d in zip(live, new_drafts):
                drafts[b] = d
            q = q_new


__all__ = ["MTPDrafter", "Params", "RULES", "accept_rejection", "speculative_decode", "verify"]
