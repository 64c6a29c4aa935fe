"""The serving engine: continuous batching of requests over one model, one cache and its decode steps (no HTTP).

Each :meth:`Engine.step` does one iteration, single-threaded and synchronous (a server drives it from one task):

1. **admit** queued requests in arrival order while the head fits: a free cache slot and the pages for its whole
   prompt plus ``max_new_tokens``, reserved at once (a captured decode step reads the block table as it stands, and
   a running request never waits for pages). A request that does not fit waits; the queue never skips its head
   (no starvation) and never evicts another request's cache. One that can never fit is refused at :meth:`submit`.
2. **prefill** the admitted requests' next chunks in admission order, about ``prefill_tokens`` prompt tokens in
   all. A chunk is the request's own next ``prefill_tokens`` tokens (a long prompt takes several iterations,
   continuing its cached prefix), so where its chunks begin never depends on the other requests; each chunk is one
   :meth:`Model.step` call of its own (``pack_prefill=True`` packs them into one). A request whose prompt is done
   samples its first token from the chunk's logits and joins the decode batch.
3. **decode** one token of every joined request through a :class:`~lynn_model.graphs.DecodeStep`: the slot is the
   row, the batch runs in the smallest bucket (1, 2, 4, ... up to ``rows``) that holds the highest busy row. Each
   bucket has two steps built up front (on a GPU, captured graphs sharing one memory pool): one that only takes the
   argmax, run while every row is greedy, and one that samples any settings (it sorts the vocabulary every step).
   A request joins its row in place (:meth:`DecodeStep.join`) and leaves it (:meth:`DecodeStep.stop`) between
   steps; a change of step loads the new step's buffers from the host's copy of every row (last token, cached
   length, sampling settings).

**Speculative decoding** (``mtp=K``, :mod:`lynn_model.speculative`): no decode steps are built; each prefill chunk
also runs the model's MTP layer over its positions, and a prompt's last chunk drafts ``K`` tokens after the first
token. Phase 3 is then one speculative round of every decoding request: one unrolled verify step of the trunk over
each request's last token and its ``K`` drafts, the cache rolled back to the accepted prefix (before anything is
emitted: a request that ends frees its slot), the accepted drafts and the trunk's own next token emitted one by one
(a stop id or ``max_new_tokens`` ends the request there, and nothing after it is emitted), then the MTP layer over the
accepted positions and ``K`` new drafts for the requests still running. A request reserves ``K`` cache tokens more
(a verify writes up to ``K`` past its end). The rounds run eagerly (no graph yet). Under the coupled rule a request
gets the tokens it gets without ``mtp``, greedy or seeded.

A decode step writes the recurrent states of its idle rows (they are scratch, graphs.py): a request whose prompt
is still prefilling keeps a copy of its Gated DeltaNet states between chunks, put back before its next chunk, and
its first chunk starts from zeroed states.

A request's tokens depend on its own logits alone: a greedy row is the argmax of its own logits, a sampled one draws
from its own seed and positions (:mod:`lynn_model.sampling`), and its prefill chunks do not depend on the company it
keeps. Its decode rows are computed in a batch whose width does, and a batch is not bit-invariant everywhere: on a
CPU an elementwise exp or SiLU rounds by an ulp differently in a vectorised loop than in its scalar tail, so a row's
fp32 intermediates can move by an ulp with the batch's size. In fp32 that stays far below the gaps between logits:
a greedy request gets the tokens ``lynn_model.generate(model, [prompt], n, temperature=0)`` gives it alone
(tests/test_serve_engine.py, the demo model on the torch reference). In bf16 an intermediate rounded to bf16 can
land on the other side of a rounding step, and greedy tokens can part (1 request in 10 of a mixed batch on the demo
model): ``lynn serve`` computes in fp32 on a CPU for that reason. ``pack_prefill`` rounds differently too (a
matmul's summation order depends on its row count).

Example::

    engine = Engine(model, rows=8)
    a = engine.submit(prompt_ids, 64, on_token=lambda req, tok: print(tok))
    b = engine.submit(other_ids, 16, temperature=0.8, top_p=0.95, seed=7)
    engine.run_until_done()
    a.tokens, a.finish_reason              # [...], "length" (or "stop", "cancelled", "error")
"""

from __future__ import annotations

import itertools
import operator
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch

import lynn_kernels

from .. import speculative
from ..graphs import BUCKETS, DecodeStep, bucket_for
from ..model import Model
from ..sampling import Sampling, SamplingParams, _is_int, check_sampling_args, sample_rows
from ..speculative import MAX_DRAFTS, RULES

#: Why a request ended: a stop id ("stop", the id is its last token), ``max_new_tokens`` ("length"),
#: :meth:`Engine.cancel` ("cancelled"), or logits that were not finite or a step that raised ("error",
#: :attr:`Request.error` says which).
FINISH_REASONS = ("stop", "length", "cancelled", "error")

#: The cache's default budget: ``rows`` full contexts, at most this many tokens.
DEFAULT_MAX_TOKENS = 65536


class Refused(ValueError):
    """A request that can never run on this engine (its prompt plus ``max_new_tokens`` exceed the model's context
    or the cache); the message names the limit. A request that only has to wait is queued instead."""


@dataclass(eq=False)
class Request:
    """One request: what was asked, the tokens as they come, and its timings (``time.perf_counter()`` seconds).

    ``status`` goes queued -> prefill -> decode -> finished (or straight to finished when cancelled);
    ``on_token(request, token)`` is called for every new token, after it is appended to ``tokens``."""

    id: int
    prompt: list[int]
    max_new_tokens: int
    sampling: Sampling
    stop_ids: frozenset[int]
    on_token: Callable[[Request, int], None] | None = None
    tokens: list[int] = field(default_factory=list)     #: the new tokens so far (a stop id included)
    status: str = "queued"
    finish_reason: str | None = None                     #: one of :data:`FINISH_REASONS` once finished
    error: str | None = None
    slot: int | None = None                              #: the cache slot (and decode row) while admitted
    prefilled: int = 0                                   #: prompt tokens in the cache
    submitted_at: float = 0.0
    admitted_at: float | None = None
    token_times: list[float] = field(default_factory=list)   #: when each token was handed out
    finished_at: float | None = None
    _states: list[torch.Tensor] | None = field(default=None, repr=False)   # Gated DeltaNet states between chunks
    _drafts: list[int] | None = field(default=None, repr=False)           # with mtp: the next round's drafts
    _q: torch.Tensor | None = field(default=None, repr=False)             # and, the rejection rule, their q [1, K, V]

    @property
    def done(self) -> bool:
        return self.status == "finished"

    @property
    def time_to_first_token(self) -> float | None:
        """Seconds from :meth:`Engine.submit` to the first token (None before it)."""
        return self.token_times[0] - self.submitted_at if self.token_times else None

    @property
    def inter_token_latencies(self) -> list[float]:
        """Seconds between consecutive tokens."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


@dataclass
class Counters:
    """Running totals since the engine was built (what a server exports as counters)."""

    submitted: int = 0
    refused: int = 0
    finished: Counter = field(default_factory=Counter)   #: by finish reason
    prompt_tokens: int = 0                               #: prompt tokens prefilled
    generated_tokens: int = 0
    steps: int = 0                                       #: :meth:`Engine.step` calls that did work
    prefill_calls: int = 0
    decode_steps: int = 0
    decode_rows: int = 0                                 #: requests summed over decode steps (mean batch: / steps)
    drafted: int = 0                                     #: with mtp: drafts verified, over requests and rounds
    accepted: int = 0                                    #: of them, the drafts the trunk kept
    verify_steps: int = 0                                #: with mtp: verify steps (each is the iteration's decode step)


class Engine:
    """Continuous batching over ``model`` (see the module docstring).

    Args:
        rows: the most requests admitted at once (the cache's slots and the widest decode step).
        max_tokens: the cache's token budget (default: ``rows`` full contexts, at most :data:`DEFAULT_MAX_TOKENS`).
        prefill_tokens: the prompt tokens one iteration prefills at most (the chunk budget): smaller keeps the
            running streams' inter-token latency down while a long prompt comes in, larger prefills faster.
        cuda_graph: capture the decode steps (default: on a GPU with the compiled kernels).
        page_size: the cache's page (tokens).
        pack_prefill: prefill the iteration's chunks of several requests in one :meth:`Model.step` call (fewer
            launches, faster on a GPU) instead of one call per request. Off by default: a packed prefill rounds
            differently from a lone one, so greedy tokens could part from what the request gets alone.
        mtp: speculative decoding with ``mtp`` drafts (1 to 3) of the model's MTP module per round, eager rounds
            instead of the decode steps (module docstring); 0: off.
        mtp_rule: how a draft is accepted (:data:`lynn_model.speculative.RULES`): "coupled" gives the tokens of
            plain decoding, greedy or seeded; "rejection" the speculative sampling test (the same when greedy).

    Build it with no other user of ``model``'s kernels in flight: on a GPU the decode steps are warmed up and
    captured here, one per bucket.
    """

    def __init__(self, model: Model, *, rows: int = 8, max_tokens: int | None = None, prefill_tokens: int = 512,
                 cuda_graph: bool | None = None, page_size: int = 16, pack_prefill: bool = False, mtp: int = 0,
                 mtp_rule: str = "coupled"):
        if not _is_int(rows) or rows < 1:
            raise ValueError(f"rows = {rows!r}: expected an int >= 1")
        if not _is_int(prefill_tokens) or prefill_tokens < 1:
            raise ValueError(f"prefill_tokens = {prefill_tokens!r}: expected an int >= 1")
        if max_tokens is not None and (not _is_int(max_tokens) or max_tokens < 1):
            raise ValueError(f"max_tokens = {max_tokens!r}: expected an int >= 1 (the cache's token budget)")
        if not _is_int(mtp) or not 0 <= mtp <= MAX_DRAFTS:
            raise ValueError(f"mtp = {mtp!r}: expected an int in [0, {MAX_DRAFTS}] (drafts per round; 0: off)")
        if mtp_rule not in RULES:
            raise ValueError(f"mtp_rule = {mtp_rule!r}: expected one of {', '.join(map(repr, RULES))}")
        if mtp and model.mtp is None:
            raise ValueError(f"mtp = {mtp}: {model.config.name or model.config.family} has no MTP module (its "
                             f"checkpoint holds no mtp.* tensors)")
        if mtp and cuda_graph:
            raise ValueError(f"cuda_graph = True with mtp = {mtp}: the speculative rounds run eagerly (no graph "
                             f"yet); leave cuda_graph None")
        self.model, self.rows, self.prefill_tokens, self.pack_prefill = model, rows, prefill_tokens, pack_prefill
        self.mtp, self.mtp_rule = mtp, mtp_rule
        self.context = model.config.max_position_embeddings
        self.vocab = model.config.vocab_size
        if max_tokens is None:
            max_tokens = min(rows * (self.context + mtp), DEFAULT_MAX_TOKENS)
        self.cache = model.new_cache(max_batch=rows, max_tokens=max_tokens, page_size=page_size)
        dev = model.device
        if cuda_graph is None:
            cuda_graph = dev.type == "cuda" and lynn_kernels.backend() == "triton" and not mtp
        # the steps replay one at a time and keep no output in the pool: one pool serves them all
        pool = torch.cuda.graph_pool_handle() if cuda_graph else None
        self.widths = sorted({b for b in BUCKETS if b < rows} | {rows})
        # per bucket two steps: one that samples (any settings, the vocabulary sorted every step) and one that only
        # takes the argmax, run while every row in the batch is greedy
        self.steps = {(w, greedy): DecodeStep(model, self.cache, w,
                                              SamplingParams.build([Sampling()] * w, dev, self.vocab) if greedy else
                                              SamplingParams.for_any(w, dev, self.vocab), graph=cuda_graph, pool=pool)
                      for w in self.widths for greedy in (True, False)} if not mtp else {}
        if mtp:
            self.drafter = speculative.MTPDrafter(model, mtp, mtp_rule)
            self._params = self.drafter.params
        self.counters = Counters()
        self._queue: deque[Request] = deque()
        self._admitted: list[Request] = []                  # prefilling or decoding, in admission order
        self._step: DecodeStep | None = None                # the step whose buffers hold the running rows
        self._joined: set[int] = set()                      # the slots active in it
        self._ids = itertools.count()

    # -- requests ------------------------------------------------------------------------------------------------
    def submit(self, prompt: Sequence[int], max_new_tokens: int, *, temperature: float = 0.0,
               top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
               stop_ids: Sequence[int] | None = None,
               on_token: Callable[[Request, int], None] | None = None, arrived: float | None = None) -> Request:
        """Queue a request for up to ``max_new_tokens`` tokens after ``prompt`` (token ids); it is admitted at the
        next :meth:`step` where it fits. Sampling as in :func:`lynn_model.generate` (``seed`` None: drawn from
        torch's host generator); ``stop_ids`` end it after emitting one of them. ``arrived``: when the request
        reached the caller (``time.perf_counter()``; default now), where its time to first token starts.

        Raises:
            ValueError: a bad argument, naming it.
            Refused: the prompt plus ``max_new_tokens`` exceed the model's context or the cache.
        """
        try:
            ids = [operator.index(t) for t in prompt]
        except TypeError:
            raise ValueError("prompt must be a sequence of token ids (ints)") from None
        if not ids:
            raise ValueError("prompt must hold at least one token")
        if min(ids) < 0 or max(ids) >= self.vocab:
            raise ValueError(f"prompt token ids must lie in [0, {self.vocab}), found min {min(ids)}, max {max(ids)}")
        if not _is_int(max_new_tokens) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens = {max_new_tokens!r}: expected an int >= 1")
        check_sampling_args(temperature, top_k, top_p, seed)
        if top_k is not None and top_k >= self.vocab:
            top_k = None                                    # every token: no limit
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,)).item())
        try:
            stops = frozenset(operator.index(t) for t in (stop_ids or ()))
        except TypeError:
            raise ValueError("stop_ids must be token ids (ints)") from None
        need, page = len(ids) + max_new_tokens, self.cache.page_size
        limit = None
        if need > self.context:
            limit = f"need {need:,} tokens; the model's context is {self.context:,} tokens (max_position_embeddings)"
        elif -(-(need + self.mtp) // page) * page > self.cache.capacity_tokens:
            verify = f" (with the {self.mtp} a verify writes past the end)" if self.mtp else ""
            limit = (f"need {need + self.mtp:,} tokens{verify}; the engine's cache holds "
                     f"{self.cache.capacity_tokens:,} tokens (max_tokens)")
        if limit is not None:
            self.counters.refused += 1
            raise Refused(f"the prompt's {len(ids):,} tokens and max_new_tokens = {max_new_tokens:,} {limit}")
        r = Request(next(self._ids), ids, max_new_tokens, Sampling(temperature, top_k, top_p, seed), stops,
                    on_token, submitted_at=time.perf_counter() if arrived is None else arrived)
        self._queue.append(r)
        self.counters.submitted += 1
        return r

    def cancel(self, request: Request, reason: str = "cancelled") -> bool:
        """End ``request`` now: its decode row and cache slot (with its pages) are free before the next step.
        ``reason``: "cancelled", or "stop" where the caller found a stop of its own (a server's stop string). False
        when it had already finished."""
        if reason not in ("cancelled", "stop"):
            raise ValueError(f"reason = {reason!r}: expected 'cancelled' or 'stop'")
        if request.done:
            return False
        if request.status == "queued":
            self._queue.remove(request)
        self._finish(request, reason)
        return True

    def stream(self, request: Request) -> Iterator[int]:
        """``request``'s tokens as they come, stepping the engine (and so every other request) while it waits."""
        seen = 0
        while True:
            while seen < len(request.tokens):
                seen += 1
                yield request.tokens[seen - 1]
            if request.done:
                return
            self.step()

    # -- the loop ------------------------------------------------------------------------------------------------
    @property
    def waiting(self) -> int:
        """Requests queued for a cache slot."""
        return len(self._queue)

    @property
    def busy(self) -> bool:
        """Whether any request is queued or admitted."""
        return bool(self._queue or self._admitted)

    def step(self) -> bool:
        """One iteration: admit, prefill, one decode step (module docstring). Returns :attr:`busy`. When any part
        raises, every admitted request ends with "error" (its slot freed) and the exception propagates."""
        if not self.busy:
            return False
        with torch.inference_mode():
            try:
                self._admit()
                self._prefill()
                self._decode()
            except Exception as err:                        # a step half-done: end every running request with it
                self._fail(list(self._admitted), "an engine step", err)
                raise
        self.counters.steps += 1
        return self.busy

    def run_until_done(self) -> None:
        """Step until no request is queued or admitted."""
        while self.step():
            pass

    def metrics(self) -> dict:
        """The gauges (now) and the counters (totals) a server exports."""
        c = self.counters
        return {"queue_depth": len(self._queue),
                "running": len(self._admitted),
                "decoding": sum(r.status == "decode" for r in self._admitted),
                "slots_in_use": sum(self.cache.active), "slots": self.cache.max_batch,
                "cache_tokens_in_use": self.cache.capacity_tokens - self.cache.free_tokens,
                "cache_tokens": self.cache.capacity_tokens,
                "requests_submitted": c.submitted, "requests_refused": c.refused,
                **{f"requests_{reason}": c.finished[reason] for reason in FINISH_REASONS},
                "prompt_tokens": c.prompt_tokens, "generated_tokens": c.generated_tokens,
                "steps": c.steps, "prefill_calls": c.prefill_calls, "decode_steps": c.decode_steps,
                "decode_rows": c.decode_rows,
                "mtp_drafted": c.drafted, "mtp_accepted": c.accepted, "verify_steps": c.verify_steps,
                # tokens a request gains per round (its accepted drafts and the trunk's token), as generate's Stats
                "mtp_acceptance_length": 1 + self.mtp * c.accepted / c.drafted if c.drafted else 0.0}

    # -- the three phases ----------------------------------------------------------------------------------------
    def _admit(self) -> None:
        page = self.cache.page_size
        while self._queue and not all(self.cache.active):
            r = self._queue[0]
            need = len(r.prompt) + r.max_new_tokens + self.mtp   # a verify writes up to mtp tokens past the end
            if -(-need // page) * page > self.cache.free_tokens:
                break                                       # the head waits for pages; nothing overtakes it
            self._queue.popleft()
            r.slot = self.cache.add()
            self.cache.reserve([r.slot], [need])            # every page now: a running request never waits
            r.status, r.admitted_at = "prefill", time.perf_counter()
            self._admitted.append(r)

    def _prefill(self) -> None:
        budget, chunks = self.prefill_tokens, []
        for r in self._admitted:
            if r.status != "prefill":
                continue
            # a chunk is the request's own next prefill_tokens: its boundaries never depend on the company it keeps
            n = min(len(r.prompt) - r.prefilled, self.prefill_tokens)
            if chunks and n > budget:
                break
            chunks.append((r, n))
            budget -= n
        groups = [chunks] if self.pack_prefill else [[c] for c in chunks]
        for group in groups:
            self._prefill_call(group)

    def _prefill_call(self, chunks: list[tuple[Request, int]]) -> None:
        """One :meth:`Model.step` over ``chunks`` (request, tokens); the requests whose prompt is done sample their
        first token."""
        chunks = [(r, n) for r, n in chunks if not r.done]    # a callback of an earlier call may have cancelled one
        if not chunks:
            return
        for r, _ in chunks:                                 # decode steps may have written these idle rows' states
            if r.prefilled == 0:
                self._put_states(r.slot, None)
            elif r._states is not None:
                self._put_states(r.slot, r._states)
                r._states = None
        dev = self.model.device
        ids = torch.tensor([t for r, n in chunks for t in r.prompt[r.prefilled:r.prefilled + n]], dtype=torch.long,
                           device=dev)
        try:
            logits = self.model.step(ids, self.cache, [r.slot for r, _ in chunks], [n for _, n in chunks],
                                     hidden=bool(self.mtp))
        except Exception as err:
            self._fail([r for r, _ in chunks], "the prefill", err)
            raise
        self.counters.prefill_calls += 1
        self.counters.prompt_tokens += ids.numel()
        if self.mtp:
            logits, hidden = logits
            hidden = hidden.split([n for _, n in chunks])
        ready, starts = [], [r.prefilled for r, _ in chunks]
        for i, (r, n) in enumerate(chunks):
            r.prefilled += n
            if r.prefilled < len(r.prompt):
                r._states = self._take_states(r.slot)
                if self.mtp:                                # the MTP layer over the chunk: its keys and values
                    self._draft([r], [r.prompt[starts[i] + 1:r.prefilled + 1]], hidden[i], [n], [starts[i]],
                                drafts=False)
            else:
                ready.append(i)
        if not ready:
            return
        done = [chunks[i][0] for i in ready]
        rows = logits[torch.tensor(ready, device=dev)]
        params = SamplingParams.build([r.sampling for r in done], dev, self.vocab)
        counter = torch.tensor([len(r.prompt) for r in done], dtype=torch.int64, device=dev)
        first, finite = torch.stack([sample_rows(rows, params, counter),
                                     torch.isfinite(rows.amax(-1)).long()]).tolist()
        for r, t, ok in zip(done, first, finite):
            if not r.done:                                  # a callback may have cancelled it
                r.status = "decode"
                self._emit(r, t, ok, "the prompt (prefill)")
        if self.mtp:
            # one request a call, as its chunks: its drafts (and the rejection rule's q) never depend on the company
            for i, t in zip(ready, first):
                r, n = chunks[i]
                if not r.done:
                    self._draft([r], [[*r.prompt[starts[i] + 1:], t]], hidden[i], [n], [starts[i]])

    def _decode(self) -> None:
        rows = [r for r in self._admitted if r.status == "decode"]
        if not rows:
            return
        if self.mtp:
            self._round(rows)
            return
        greedy = all(r.sampling.greedy for r in rows)
        step = self.steps[bucket_for(max(r.slot for r in rows) + 1, self.widths), greedy]
        if step is not self._step:                          # another bucket: load its buffers from the host
            step.begin(torch.tensor([r.tokens[-1] for r in rows], dtype=torch.long),
                       [r.slot for r in rows])
            for r in rows:
                step.params.set_row(r.slot, r.sampling)
            self._step, self._joined = step, {r.slot for r in rows}
        for r in rows:
            if r.slot not in self._joined:
                step.join(r.slot, r.tokens[-1], r.sampling)
                self._joined.add(r.slot)
        try:
            step.replay()
            tokens, finite = step.out.tolist()
        except Exception as err:
            self._fail(rows, "a decode step", err)
            raise
        self.cache.advance([r.slot for r in rows], [1] * len(rows))
        self.counters.decode_steps += 1
        self.counters.decode_rows += len(rows)
        for r in rows:
            if not r.done:                                  # a callback may have cancelled it
                self._emit(r, tokens[r.slot], finite[r.slot], f"new token {len(r.tokens) + 1}")

    def _round(self, rows: list[Request]) -> None:
        """One speculative round of ``rows`` (module docstring)."""
        slots = [r.slot for r in rows]
        starts = [self.cache.lengths[s] for s in slots]
        q = torch.cat([r._q for r in rows]) if self.mtp_rule == "rejection" else None
        try:
            # summed as the plain step of this batch's bucket would sum each row: the tokens of a run without mtp
            with lynn_kernels.as_batch(bucket_for(max(slots) + 1, self.widths)):
                took, fix, finite, h = speculative.verify(self.model, self.cache, slots, [r.tokens[-1] for r in rows],
                                                          [r._drafts for r in rows], [r.sampling for r in rows],
                                                          self.mtp_rule, q, self._params)
            # before emitting: a request that ends releases its slot
            self.cache.rollback(slots, [a + 1 for a in took])
        except Exception as err:
            self._fail(rows, "a verify step", err)
            raise
        c = self.counters
        c.decode_steps += 1
        c.verify_steps += 1
        c.decode_rows += len(rows)
        c.drafted += self.mtp * len(rows)
        c.accepted += sum(took)
        new = [[*r._drafts[:a], y] for r, a, y in zip(rows, took, fix)]
        for r, tokens, ok in zip(rows, new, finite):
            for t in tokens:
                if r.done:                                  # a stop id, max_new_tokens or a callback ended it
                    break
                self._emit(r, t, ok, f"new token {len(r.tokens) + 1}")
        going = [i for i, r in enumerate(rows) if not r.done]
        if going:                                           # the MTP layer catches up on the accepted positions
            self._draft([rows[i] for i in going], [new[i] for i in going],
                        torch.cat([h[i, :took[i] + 1] for i in going]), [took[i] + 1 for i in going],
                        [starts[i] for i in going])

    def _draft(self, rows: list[Request], nxt: list[list[int]], hidden: torch.Tensor, lens: list[int],
               starts: list[int], drafts: bool = True) -> None:
        """The MTP layer over ``lens[b]`` positions of ``rows[b]`` from ``starts[b]`` (``nxt[b]``: the token after
        each, ``hidden``: the trunk's rows there, packed), then each request's next drafts unless ``drafts`` is
        False."""
        try:
            out, q = self.drafter.draft(self.cache, [r.slot for r in rows], [t for x in nxt for t in x], hidden, lens,
                                        starts, [r.sampling for r in rows] if drafts else None)
        except Exception as err:
            self._fail(rows, "the MTP drafts", err)
            raise
        for b, (r, d) in enumerate(zip(rows, out)):
            r._drafts, r._q = d, None if q is None else q[b:b + 1]

    # -- helpers -------------------------------------------------------------------------------------------------
    def _emit(self, r: Request, token: int, finite: int, where: str) -> None:
        """Hand out ``r``'s new token, or end ``r`` when its logits were not finite or the token ends it."""
        if not finite:
            r.error = (f"the logits are not finite (NaN or inf) at {where}: the model's weights or its inputs are "
                       f"likely damaged")
            self._finish(r, "error")
            return
        r.tokens.append(token)
        r.token_times.append(time.perf_counter())
        self.counters.generated_tokens += 1
        if r.on_token is not None:
            r.on_token(r, token)
        if r.done:                                          # the callback cancelled it
            return
        if token in r.stop_ids:
            self._finish(r, "stop")
        elif len(r.tokens) >= r.max_new_tokens:
            self._finish(r, "length")

    def _finish(self, r: Request, reason: str) -> None:
        """End ``r``: out of the decode batch and its slot (with its pages) back to the cache."""
        if r.slot is not None:
            if r.slot in self._joined:
                self._step.stop([r.slot])
                self._joined.discard(r.slot)
            self.cache.release(r.slot)
            self._admitted.remove(r)
            r.slot, r._states, r._drafts, r._q = None, None, None, None
        r.status, r.finish_reason, r.finished_at = "finished", reason, time.perf_counter()
        self.counters.finished[reason] += 1

    def _fail(self, requests: list[Request], what: str, err: Exception) -> None:
        """End ``requests`` with "error" after ``what`` raised (their slots, perhaps broken half-way, are released),
        so the engine stays usable; the caller re-raises."""
        for r in requests:
            if not r.done:
                r.error = f"{what} failed: {type(err).__name__}: {err}"
                self._finish(r, "error")

    def _take_states(self, slot: int) -> list[torch.Tensor]:
        return [t[slot].clone() for t in (*self.cache.conv.values(), *self.cache.state.values())]

    def _put_states(self, slot: int, states: list[torch.Tensor] | None) -> None:
        """Put back what :meth:`_take_states` took (None: zeros, a fresh sequence's states)."""
        for i, t in enumerate((*self.cache.conv.values(), *self.cache.state.values())):
            t[slot].zero_() if states is None else t[slot].copy_(states[i])
