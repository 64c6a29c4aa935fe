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

Two ways to run rounds. :class:`SpeculativeStep` (what :func:`lynn_model.generate` runs) does a whole round on
static buffers, captured as one CUDA graph on a GPU, for a batch that only shrinks. :func:`verify` and
:class:`MTPDrafter` do it eagerly from the host for any set of sequences (the serving engine's batch changes every
step).
"""

from __future__ import annotations

import torch

import lynn_kernels
from lynn_kernels.attention import decode_plan

from .cache import Batch, Cache
from .graphs import _scrub, _use_graph, _warm_up, check_step
from .model import Model
from .sampling import Sampling, SamplingParams, probabilities, sample_rows, uniform

#: The acceptance rules (module docstring).
RULES = ("coupled", "rejection")

#: The most drafts a round takes (``k``; ``generate(mtp=)``, ``Engine(mtp=)``): the cache keeps Gated DeltaNet
#: snapshots for this many tokens of an unrolled step.
MAX_DRAFTS = 3

# the rejection rule's two streams of uniforms (its acceptance tests, its residual draws) are the request's seed
# mixed with these, so they stay apart from each other and from the stream the drafts and plain sampling draw from
_ACCEPT_SALT, _RESIDUAL_SALT = 0x2545F4914F6CDD1D, 0x5851F42D4C957F2D


class Params:
    """:class:`SamplingParams` for rows that repeat each sequence's :class:`Sampling` ``repeat`` times, built once
    per distinct set (a speculative round samples ``k + 1`` rows of each sequence); the last ``keep`` sets are kept
    (a server's sets of requests change without end)."""

    def __init__(self, device, vocab: int, keep: int = 16):
        self.device, self.vocab, self.keep, self._built = device, vocab, keep, {}

    def __call__(self, settings: list[Sampling], repeat: int = 1) -> SamplingParams:
        key = (tuple(settings), repeat)
        built = self._built.pop(key, None)
        if built is None:
            built = SamplingParams.build([s for s in settings for _ in range(repeat)], self.device, self.vocab)
        self._built[key] = built                            # the newest last
        if len(self._built) > self.keep:
            del self._built[next(iter(self._built))]
        return built


def spare_tokens(k: int) -> int:
    """Cache positions a sequence's rounds may write past its last token with ``k`` drafts a round, to reserve with
    it: a last round's verify writes ``k - 1`` past it, and when it kept every draft, :class:`SpeculativeStep`'s next
    drafts ``2k - 2``."""
    return max(0, 2 * k - 2)


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


class SpeculativeStep:
    """One speculative round of rows ``0..rows-1`` of ``cache`` on static buffers, captured once as a CUDA graph
    (on a GPU with the compiled kernels; eagerly elsewhere), as :class:`~lynn_model.graphs.DecodeStep` is for a
    plain step: verify, accept, roll back, the MTP catch-up and the next ``k`` drafts all run on the device, so a
    replay takes nothing from the host and the host reads one small tensor a round (:attr:`out`).

    The buffers: ``pending`` (each row's next token, not yet run), ``drafts [rows, k]`` (and ``q [rows, k, vocab]``,
    the distributions they were drawn from, for the rejection rule), ``lengths`` (tokens cached) and ``active``. A
    replay verifies ``[pending, drafts]`` in one unrolled step, applies the rule, puts back the Gated DeltaNet states
    after the last kept token (``Cache.snapshot``'s), runs the MTP layer over all ``k + 1`` verified positions (the rows
    past the kept ones carry rejected tokens: the keys they write sit past the sequence's end, where the next round
    overwrites them before anything reads them) and drafts ``k`` tokens after the kept ones. It leaves in :attr:`out`
    per row ``[a, y, finite, the k drafts verified, the k next drafts]`` (drafts kept, the trunk's token after them,
    whether the logits of the rows emitted from were finite) and updates ``pending``, ``drafts``, ``lengths`` itself. An
    inactive row writes no key and keeps its length (its recurrent states are scratch).

    ``params``: the rows' sampling, fixed for the step's life (its rows are repeated ``k + 1`` times for the
    verify once, here). Its drafts may differ from :class:`MTPDrafter`'s in rounding (the catch-up runs its rows as
    decode steps here, as a prefill there): under the coupled rule that moves acceptance, never a token; under the
    rejection rule the tokens too (each still distributed as plain sampling's).
    """

    def __init__(self, model: Model, cache: Cache, rows: int, k: int, params: SamplingParams, rule: str = "coupled",
                 *, graph: bool | None = None, pool=None):

        if model.mtp is None:
            raise ValueError(f"{model.config.name or model.config.family}: this model has no MTP module (its "
                             f"checkpoint holds no mtp.* tensors)")
        _check_rule(rule)
        if not isinstance(k, int) or not 1 <= k <= MAX_DRAFTS:
            raise ValueError(f"k = {k!r}: expected an int in [1, {MAX_DRAFTS}] (drafts a round)")
        check_step(model, cache, rows, params, "SpeculativeStep")
        self.model, self.cache, self.rows, self.k, self.rule, self.params = model, cache, rows, k, rule, params
        dev, u, vocab = cache.device, k + 1, model.config.vocab_size
        self.params_u = SamplingParams(*(t.repeat_interleave(u) for t in (params.temperature, params.top_k,
                                                                          params.top_p, params.seed)),
                                       params.candidates, params.greedy)
        self.pending = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.drafts = torch.zeros(rows, k, dtype=torch.int64, device=dev)
        self.q = torch.zeros(rows, k, vocab, dtype=torch.float32, device=dev) if rule == "rejection" else None
        self.lengths = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.active = torch.zeros(rows, dtype=torch.bool, device=dev)
        self.out = torch.zeros(rows, 3 + 2 * k, dtype=torch.int64, device=dev)
        width = cache.block_table.shape[1]
        self._seq = torch.arange(rows, device=dev).repeat_interleave(u)
        self._offset = torch.arange(u, device=dev).repeat(rows)
        # the verify's rows (and the MTP catch-up's, at the same positions): k + 1 per sequence, each its own decode
        pos_v = torch.zeros(rows * u, dtype=torch.int64, device=dev)
        self.batch_v = Batch([u] * rows, [1] * rows, pos_v, None, decode=True,
                             kv_slots=torch.zeros(rows * u, dtype=torch.int64, device=dev), rows=slice(0, rows),
                             seq_lens=torch.zeros(rows * u, dtype=torch.int32, device=dev),
                             block_table=torch.zeros(rows * u, width, dtype=cache.block_table.dtype, device=dev),
                             unroll=u)
        # a draft after a draft: one row per sequence
        self.batch_d = Batch([1] * rows, [1] * rows, torch.zeros(rows, dtype=torch.int64, device=dev), None,
                             decode=True, kv_slots=torch.zeros(rows, dtype=torch.int64, device=dev),
                             rows=slice(0, rows), seq_lens=torch.zeros(rows, dtype=torch.int32, device=dev),
                             block_table=cache.block_table[:rows])
        self._live: list[int] = []                  # the active rows, as the host knows them
        self.graph: torch.cuda.CUDAGraph | None = None
        if _use_graph(graph, dev):
            self._capture(pool)

    def _plan_verify(self) -> None:
        """Positions, cache slots, lengths and block-table rows of the verify's ``rows * (k + 1)`` rows."""
        b, page = self.batch_v, self.cache.page_size
        pos = self.lengths[self._seq] + self._offset
        active = self.active[self._seq]
        b.block_table.copy_(self.cache.block_table[:self.rows].index_select(0, self._seq))
        col = (pos // page).clamp_max(b.block_table.shape[1] - 1)
        block = b.block_table.gather(1, col[:, None])[:, 0].to(torch.int64)
        b.positions.copy_(pos)
        b.kv_slots.copy_(torch.where(active, block * page + pos % page, -1))
        b.seq_lens.copy_(torch.where(active, pos + 1, 0))

    def _forward(self) -> None:
        m, cache, n, k, u = self.model, self.cache, self.rows, self.k, self.k + 1
        self._plan_verify()
        tokens = torch.cat([self.pending[:, None], self.drafts], 1).view(-1)
        with lynn_kernels.as_batch(n):               # each row summed as the decode step of n rows sums it
            x = m._trunk(tokens, self.batch_v, cache)                    # [n u, H]; snapshots the states
            logits = m.lm_head(x)
        counter = self.batch_v.positions + 1
        if self.rule == "coupled":
            want = sample_rows(logits, self.params_u, counter).view(n, u)
            a = (want[:, :k] == self.drafts).long().cumprod(-1).sum(-1)
            y = want.gather(1, a[:, None])[:, 0]
        else:
            a, y = accept_rejection(logits, self.params_u, counter, self.drafts, self.q)
        finite = torch.isfinite(logits.amax(-1)).view(n, u).long().cumprod(-1).gather(1, a[:, None])[:, 0]
        # the states after the last kept token, where a draft was rejected
        at, back = torch.arange(n, device=a.device), a.clamp_max(k - 1)
        for i in cache.snap_conv:
            for live, saved in ((cache.conv[i], cache.snap_conv[i]), (cache.state[i], cache.snap_state[i])):
                keep = (a == k).view(n, *[1] * (live.dim() - 1))
                live[:n] = torch.where(keep, live[:n], saved[back, at])
        new_len = self.lengths + (a + 1) * self.active
        # the MTP catch-up over the verified positions: the token after each is the next draft, or y after the last
        # kept one
        nxt = torch.cat([self.drafts, self.drafts[:, :1]], 1).scatter(1, a[:, None], y[:, None])
        h = m._mtp(nxt.view(-1), x, self.batch_v, cache).view(n, u, -1)[at, a]
        drafts, dists = [], []
        for i in range(k):
            if i:                               # a draft after a draft: at the next position, its own hidden state
                b = self.batch_d
                decode_plan(new_len + i - 1, self.active, cache.block_table, cache.page_size, b.positions,
                            b.kv_slots, b.seq_lens)
                h = m._mtp(drafts[-1], h, b, cache)
            logits = m.draft_logits(h)
            drafts.append(sample_rows(logits, self.params, new_len + i + 1))
            if self.q is not None:
                dists.append(probabilities(logits, self.params))
        nd = torch.stack(drafts, 1)
        self.out.copy_(torch.cat([a[:, None], y[:, None], finite[:, None], self.drafts, nd], 1))
        self.pending.copy_(y)
        self.drafts.copy_(nd)
        if self.q is not None:
            self.q.copy_(torch.stack(dists, 1))
        self.lengths.copy_(new_len)

    def _run(self) -> None:
        with torch.inference_mode(), lynn_kernels.trusted():
            self._forward()

    def _capture(self, pool) -> None:
        # warm-up near the cache's full length (the autotuners time real work), every row active; then the capture
        cap = self.batch_v.block_table.shape[1] * self.cache.page_size
        self.active.fill_(True)

        def warm():
            self.lengths.fill_(cap - 2 * self.k - 2)
            self._run()

        _warm_up(self.cache.device, warm)
        self.active.fill_(False)
        self.lengths.zero_()
        self.graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), lynn_kernels.trusted(), torch.cuda.graph(self.graph, pool=pool):
            self._forward()
        torch.cuda.synchronize(self.cache.device)
        _scrub(self.cache, self.rows)
        for t in (self.pending, self.drafts, self.out):
            t.zero_()

    def begin(self, slots: list[int], pending: list[int], drafts: list[list[int]], q: torch.Tensor | None = None):
        """Load the rounds' inputs: sequence ``slots[b]`` (a row in ``0..rows-1`` with its pages reserved for every
        round to come, :meth:`Cache.reserve`, :func:`spare_tokens` past its last) has next token ``pending[b]`` and
        drafts ``drafts[b]`` (:class:`MTPDrafter`'s after its prefill; ``q`` theirs for the rejection rule); the
        other rows idle."""
        if len(slots) != len(pending) or len(slots) != len(drafts) or any(not 0 <= s < self.rows for s in slots):
            raise ValueError(f"slots {slots} must be rows in 0..{self.rows - 1}, one per pending token and drafts")
        if (q is None) != (self.q is None):
            raise ValueError("q: the drafts' distributions go with the rejection rule, and only with it")
        for s in slots:
            self.cache._check_slot(s)
        dev = self.pending.device
        idx = torch.tensor(slots, dtype=torch.long, device=dev)
        for t in (self.pending, self.drafts, self.lengths):
            t.zero_()
        self.active.fill_(False)
        self.active[idx] = True
        self._live = sorted(slots)
        self.pending[idx] = torch.tensor(pending, dtype=torch.int64, device=dev)
        self.drafts[idx] = torch.tensor(drafts, dtype=torch.int64, device=dev).view(len(slots), self.k)
        self.lengths[idx] = torch.tensor([self.cache.lengths[s] for s in slots], dtype=torch.int64, device=dev)
        if q is not None:
            self.q[idx] = q.to(dev, torch.float32)

    def stop(self, slots: list[int]) -> None:
        """Rows that take no further part (a finished sequence): from the next round on they write nothing."""
        if slots:
            self.active[torch.tensor(slots, dtype=torch.long, device=self.active.device)] = False
            self._live = [s for s in self._live if s not in slots]

    def replay(self) -> list[list[int]]:
        """One round of every active row; returns :attr:`out` on the host (one copy): per row ``[a, y, finite, drafts
        verified, next drafts]``, the tokens it emits being the first ``a`` drafts verified and ``y``; advances
        :attr:`Cache.lengths` of the active rows by ``a + 1``."""
        if self.graph is not None:
            self.graph.replay()
        else:
            self._run()
        out = self.out.tolist()
        self.cache.advance(self._live, [out[r][0] + 1 for r in self._live])
        return out


def unrolled_and_steps(model: Model, batch: int, tokens: int, generator: torch.Generator, *,
                       prompt: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The check behind token-exact speculative decoding: ``batch`` sequences, each a random ``prompt``-token prompt
    then ``tokens`` random tokens run once as one unrolled step (a verify's) and once, from a fresh cache, as
    ``tokens`` decode steps. Returns both logits, ``[batch * tokens, vocab]`` each, sequence-major; the verify keeps
    plain decoding's tokens where they are equal bit for bit."""
    vocab, dev = model.config.vocab_size, model.device
    ids = torch.randint(0, vocab, (batch * prompt,), generator=generator).to(dev)
    extra = torch.randint(0, vocab, (batch, tokens), generator=generator).to(dev)
    runs = []
    for unrolled in (True, False):
        cache = model.new_cache(batch, batch * 2 * max(prompt, tokens))
        slots = [cache.add() for _ in range(batch)]
        model.step(ids, cache, slots, [prompt] * batch)
        if unrolled:
            runs.append(model.step(extra.reshape(-1), cache, slots, [tokens] * batch, all_logits=True, unroll=True))
        else:
            steps = [model.step(extra[:, j].contiguous(), cache, slots, [1] * batch) for j in range(tokens)]
            runs.append(torch.stack(steps, 1).reshape(batch * tokens, -1))
    return runs[0], runs[1]


__all__ = ["MAX_DRAFTS", "MTPDrafter", "Params", "RULES", "SpeculativeStep", "accept_rejection", "spare_tokens",
           "unrolled_and_steps", "verify"]
