"""The decode step on static buffers, captured once as a CUDA graph and replayed for every token; and the prefill of
one fresh sequence the same way (:class:`PrefillStep`).

A :class:`DecodeStep` owns the first ``rows`` slots of a :class:`~lynn_model.cache.Cache` and runs one decode step
of all of them, embedding to sampled token, from tensors that stay in place: ``tokens`` (in: each row's last token;
out: the token sampled), ``lengths`` (tokens cached per row), ``active`` (rows that take part) and the sampling
settings. Everything a step needs besides is derived on the device inside the step: positions (``lengths``),
where each new key goes (the block table), the sequence lengths attention reads, the sampling counter; and the step
ends by writing its tokens back into ``tokens`` (and whether each row's logits were finite into ``finite``: the two
rows of ``out``, so the host reads them in one copy) and advancing ``lengths``. So a replay needs no input from the
host at all, and nothing inside it synchronises. An inactive row (padding up to the bucket size, or a sequence that
has finished) writes no key (slot -1), attends to nothing and keeps its length; its recurrent states are scratch.

On a GPU the step is captured (after a warm-up that compiles and autotunes every kernel it meets, at the cache's
full length) and :meth:`replay` launches the graph; under the interpreter or the reference backend the same step
runs eagerly. Both run the same kernels on the same shapes, so they give the same tokens bit for bit.

Example::

    cache = model.new_cache(max_batch=4, max_tokens=8192)
    step = DecodeStep(model, cache, rows=4, params=SamplingParams.build([Sampling()] * 4, "cuda"))
    ...                                          # cache.add(), prefill with model.step, cache.reserve(...)
    step.begin(first_tokens, slots)              # static inputs from the prefill
    for _ in range(n):
        step.replay()                            # step.tokens: the new token of every row
"""

from __future__ import annotations

import torch

import lynn_kernels
from lynn_kernels.attention import decode_plan, paged_slots

from .cache import Batch, Cache
from .model import Model, _check_ids
from .sampling import Sampling, SamplingParams, sample_rows

#: Batch sizes a decode step is captured for; a batch runs in the smallest bucket that holds it.
BUCKETS = (1, 2, 4, 8, 16, 32)


def bucket_for(n: int, buckets=BUCKETS) -> int:
    """The smallest bucket >= ``n`` (``n`` itself when ``buckets`` is None)."""
    if buckets is None:
        return n
    for b in sorted(buckets):
        if b >= n:
            return b
    raise ValueError(f"a batch of {n} sequences is larger than the largest decode bucket ({max(buckets)})")


def _use_graph(graph: bool | None, device: torch.device) -> bool:
    """Whether a step captures a CUDA graph: ``graph``, or by default on a GPU with the compiled kernels."""
    if graph is None:
        graph = device.type == "cuda" and lynn_kernels.backend() == "triton"
    if graph and device.type != "cuda":
        raise ValueError("graph=True needs the model on a CUDA device")
    return bool(graph)


def _warm_up(device: torch.device, run, times: int = 2) -> None:
    """``run()`` ``times`` times on a side stream ordered after the current one (compile, autotune and first
    allocations happen outside the capture), then the current stream waits for it."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(times):
            run()
    torch.cuda.current_stream(device).wait_stream(side)


def _scrub(cache: Cache, rows: int) -> None:
    """Zero what a warm-up wrote: the conv and recurrent states of slots ``0..rows-1`` and page 0 of every KV
    pool (the pages an empty block table points at)."""
    for t in (*cache.conv.values(), *cache.state.values()):
        t[:rows].zero_()
    for t in (*cache.k.values(), *cache.v.values()):
        t[0].zero_()


def check_step(model: Model, cache: Cache, rows: int, params: SamplingParams, what: str) -> None:
    """The arguments every step on static buffers takes (``what``: its class, for the message)."""
    if rows < 1 or rows > cache.max_batch:
        raise ValueError(f"rows = {rows}: expected 1..{cache.max_batch} (the cache's max_batch)")
    if params.temperature.shape != (rows,):
        raise ValueError(f"params has {tuple(params.temperature.shape)} rows of settings; expected ({rows},)")
    check_cache(model, cache, what)


def check_cache(model: Model, cache: Cache, what: str) -> None:
    """A step on static buffers is built on an empty cache of ``model``'s (``what``: its class, for the message)."""
    if any(cache.active):
        raise ValueError(f"build a {what} while the cache holds no sequence (its warm-up writes states and page 0); "
                         f"active now: {[s for s, a in enumerate(cache.active) if a]}")
    if cache.config != model.config or cache.device != model.device:
        raise ValueError("the cache was built for another model: use model.new_cache(...)")


class DecodeStep:
    """One decode step of rows ``0..rows-1`` of ``cache`` on static buffers (see the module docstring).

    ``graph``: capture a CUDA graph (default: on a GPU with the compiled kernels); ``pool``: a graph memory pool to
    share with other steps (``torch.cuda.graph_pool_handle()``); ``pdl``: launch the step's kernels with
    programmatic dependent launch where the GPU has it (:func:`lynn_kernels.programmatic_launches`: each kernel
    starts while the one before it finishes; the same bits). Build it while the cache holds no sequence: the
    warm-up runs real steps over the rows (their states are zeroed again after)."""

    def __init__(self, model: Model, cache: Cache, rows: int, params: SamplingParams, *, graph: bool | None = None,
                 pool=None, pdl: bool = True):
        check_step(model, cache, rows, params, "DecodeStep")
        self.model, self.cache, self.rows, self.params, self.pdl = model, cache, rows, params, pdl
        dev = cache.device
        self.out = torch.zeros(2, rows, dtype=torch.int64, device=dev)   # one copy brings both to the host
        self.tokens = self.out[0]                      #: the token of each row (in: its last; out: the new one)
        self.finite = self.out[1]                      #: 1 where the step's logits were finite, else 0
        self.lengths = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.active = torch.zeros(rows, dtype=torch.bool, device=dev)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.kv_slots = torch.full((rows,), -1, dtype=torch.int64, device=dev)
        self.seq_lens = torch.zeros(rows, dtype=torch.int32, device=dev)
        self.block_table = cache.block_table[:rows]                   # a view: pages given later are seen
        self.batch = Batch([1] * rows, [1] * rows, self.positions, None, decode=True, kv_slots=self.kv_slots,
                           rows=slice(0, rows), seq_lens=self.seq_lens, block_table=self.block_table)
        self.graph: torch.cuda.CUDAGraph | None = None
        if _use_graph(graph, dev):
            self._capture(pool)

    def _forward(self) -> None:
        """The step itself: everything from the static buffers, the results written back into them."""
        self.prologue()
        x = self.model._trunk(self.tokens, self.batch, self.cache)
        self.epilogue(self.model.lm_head(x))

    def prologue(self) -> None:
        """Positions, cache slots and sequence lengths of this step, from ``lengths``, ``active`` and the pages:
        one launch (:func:`lynn_kernels.attention.decode_plan`)."""
        decode_plan(self.lengths, self.active, self.block_table, self.cache.page_size, self.positions,
                    self.kv_slots, self.seq_lens)

    def epilogue(self, logits: torch.Tensor) -> None:
        """Sample each row's next token into ``tokens``; set ``finite`` (0 where the chosen token's logit is NaN or
        inf, which it is whenever the row holds a NaN or +inf, or only -inf); advance the active rows' ``lengths``. When
        every row is greedy, the argmax goes straight into ``tokens`` (of the logits as they are: the same index as of
        their fp32 copy, which :func:`sample_rows` takes)."""
        if self.params.greedy:
            torch.argmax(logits, -1, out=self.tokens)
        else:
            self.tokens.copy_(sample_rows(logits, self.params, self.lengths + 1))
        # the chosen token's logit: argmax and the sampler's Gumbel argmax pick a NaN or +inf wherever one is, and
        # an all -inf row picks a -inf; one gathered value per row, not a reduction over the vocabulary
        self.finite.copy_(torch.isfinite(logits.gather(-1, self.tokens[:, None])).squeeze(-1))
        self.lengths.add_(self.active)

    def _run(self) -> None:
        with torch.inference_mode(), lynn_kernels.trusted(), lynn_kernels.programmatic_launches(self.pdl):
            self._forward()

    def _capture(self, pool) -> None:
        # warm-up at the cache's full length, so the autotuners time real work: every row active, reading pages
        # the block table gives them (unallocated rows: page 0), writing one key each
        cap = self.block_table.shape[1] * self.cache.page_size
        self.active.fill_(True)

        def warm():
            self.lengths.fill_(cap - 1)
            self._run()

        _warm_up(self.cache.device, warm)
        self.active.fill_(False)
        self.lengths.zero_()
        self.graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), lynn_kernels.trusted(), lynn_kernels.programmatic_launches(self.pdl), \
                torch.cuda.graph(self.graph, pool=pool):
            self._forward()
        torch.cuda.synchronize(self.cache.device)
        _scrub(self.cache, self.rows)
        self.tokens.zero_()

    def begin(self, tokens: torch.Tensor, slots: list[int]) -> None:
        """Load the step's inputs: ``tokens [len(slots)]`` the last token of each sequence ``slots[b]`` (a slot in
        ``0..rows-1`` whose pages :meth:`Cache.reserve` has given for every step to come); the other rows idle."""
        if len(slots) != tokens.shape[0] or any(not 0 <= s < self.rows for s in slots):
            raise ValueError(f"slots {slots} must be {tokens.shape[0]} rows in 0..{self.rows - 1}")
        for s in slots:
            self.cache._check_slot(s)
        idx = torch.tensor(slots, dtype=torch.long, device=self.tokens.device)
        self.tokens.zero_()
        self.tokens[idx] = tokens.to(self.tokens.device, torch.int64)
        self.active.fill_(False)
        self.active[idx] = True
        self.lengths.zero_()
        self.lengths[idx] = torch.tensor([self.cache.lengths[s] for s in slots], dtype=torch.int64,
                                         device=self.tokens.device)

    def join(self, slot: int, token: int, setting: Sampling | None = None) -> None:
        """Add sequence ``slot`` to the running batch between two steps, the other rows untouched: its last token,
        its cached length (:attr:`Cache.lengths`) and, when given, its sampling settings
        (:meth:`SamplingParams.set_row`), written in place so a captured graph stays valid. Its pages must be
        reserved for every step to come (:meth:`Cache.reserve`), as for :meth:`begin`. Where ``slot`` was an idle
        row, a step has written its recurrent states (they are scratch there): prefill the sequence after the last
        step that ran without it, or put its states back."""
        if not isinstance(slot, int) or not 0 <= slot < self.rows:
            raise ValueError(f"slot {slot!r}: expected a row in 0..{self.rows - 1}")
        self.cache._check_slot(slot)
        if setting is not None:
            self.params.set_row(slot, setting)
        self.tokens[slot] = int(token)
        self.lengths[slot] = self.cache.lengths[slot]
        self.active[slot] = True

    def stop(self, slots: list[int]) -> None:
        """Rows that take no further part (a finished sequence): from the next step on they write nothing."""
        if slots:
            self.active[torch.tensor(slots, dtype=torch.long, device=self.active.device)] = False

    def replay(self) -> None:
        """One decode step of every active row (the graph's launch on a GPU, the eager step elsewhere). The host
        keeps :attr:`Cache.lengths` itself (:meth:`Cache.advance`)."""
        if self.graph is not None:
            self.graph.replay()
        else:
            self._run()


class PrefillStep:
    """The prefill of one fresh sequence of up to ``tokens`` tokens on static buffers, captured once as a CUDA graph
    and replayed for every prompt that fits (on a GPU with the compiled kernels; eagerly elsewhere).

    A prefill's kernels depend on its token count alone, except where the sequence ends: a prompt of ``n <= tokens``
    runs in all ``tokens`` rows, the last ``tokens - n`` of them padding (the prompt's tokens again). Causal attention
    keeps the real rows from seeing the padding; padding rows write no key (slot -1); their Gated DeltaNet gates are set
    to decay 1 and write 0, so the recurrent state after them is the state after the last real token, and the conv state
    is taken at the real end (``Batch.valid``). Everything else (projections, norms, MoE) works row by row, so no real
    row's arithmetic changes; a float matmul's library may still pick another kernel for another row count (cuBLAS,
    CPU BLAS) and sum in another order, so a padded prompt matches ``model.step`` of it to rounding, and bit for bit
    where the count is the graph's own or every kernel's tiles are fixed (the NVFP4 ones). What a replay takes from
    the host: the tokens, their count and the cache slot, copied into static buffers; the cache's pages for the
    sequence are reserved before it.

    This is for repeated prefills of one size (a server, a benchmark): building one runs the step twice eagerly
    (compile, autotune) and once under capture, so a single prompt is faster through :meth:`Model.step`. A sequence
    that already holds tokens (a continued prefill) goes through :meth:`Model.step` too.

    Example::

        cache = model.new_cache(max_batch=1, max_tokens=8192)
        prefill = PrefillStep(model, cache, 2048)          # while the cache holds no sequence
        s = cache.add()
        logits = prefill.run(prompt_ids, s)                # [1, vocab]: the last token's; the cache holds the prompt
    """

    def __init__(self, model: Model, cache: Cache, tokens: int, *, graph: bool | None = None, pool=None):
        if not isinstance(tokens, int) or tokens < 1:
            raise ValueError(f"tokens = {tokens!r}: expected a positive int (the rows every prefill runs in)")
        if tokens > cache.capacity_tokens:
            raise ValueError(f"tokens = {tokens} exceeds the cache's {cache.capacity_tokens} tokens")
        check_cache(model, cache, "PrefillStep")
        self.model, self.cache, self.tokens = model, cache, tokens
        dev = cache.device
        self.ids = torch.zeros(tokens, dtype=torch.int64, device=dev)
        self.length = torch.full((1,), tokens, dtype=torch.int64, device=dev)   # real tokens
        self.slot = torch.zeros(1, dtype=torch.int64, device=dev)
        self.positions = torch.arange(tokens, device=dev)
        self.valid = torch.ones(tokens, dtype=torch.float32, device=dev)
        self.kv_slots = torch.full((tokens,), -1, dtype=torch.int64, device=dev)
        self.batch = Batch([tokens], [0], self.positions, None, kv_slots=self.kv_slots, rows=self.slot,
                           valid=self.valid, valid_len=self.length)
        self.logits: torch.Tensor | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        if _use_graph(graph, dev):
            self._capture(pool)

    def _forward(self) -> None:
        """Which rows are real and where their keys go (from ``length``, ``slot`` and the block table), the trunk
        over every row, the logits of the last real one into :attr:`logits`."""
        real = self.positions < self.length
        self.valid.copy_(real)
        slots = paged_slots(self.cache.block_table, self.slot.expand(self.tokens), self.positions,
                            self.cache.page_size)
        self.kv_slots.copy_(torch.where(real, slots, -1))
        x = self.model._trunk(self.ids, self.batch, self.cache)
        self.logits = self.model.lm_head(x.index_select(0, self.length - 1))

    def _run(self) -> None:
        with torch.inference_mode(), lynn_kernels.trusted():
            self._forward()

    def _capture(self, pool) -> None:
        # warm-up with every row real, into slot 0 (its pages: page 0), so the autotuners time the full shape
        dev = self.cache.device
        _warm_up(dev, self._run)
        self.graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), lynn_kernels.trusted(), torch.cuda.graph(self.graph, pool=pool):
            self._forward()
        torch.cuda.synchronize(dev)
        _scrub(self.cache, 1)

    def run(self, ids: torch.Tensor, slot: int) -> torch.Tensor:
        """Prefill sequence ``slot`` (just added, no tokens yet) with ``ids`` (int64 ``[n]``, ``1 <= n <= tokens``):
        reserves its pages, replays the step and advances the cache. Returns the last token's logits ``[1, vocab]``
        (run dtype): a buffer the next :meth:`run` overwrites."""
        if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.dtype != torch.int64:
            raise ValueError(f"ids must be an int64 [n] tensor, got {getattr(ids, 'dtype', type(ids))} "
                             f"{tuple(getattr(ids, 'shape', ()))}")
        n = ids.numel()
        if not 1 <= n <= self.tokens:
            raise ValueError(f"ids has {n} tokens; this PrefillStep takes 1..{self.tokens}")
        self.cache._check_slot(slot)
        if self.cache.lengths[slot]:
            raise ValueError(f"slot {slot} already holds {self.cache.lengths[slot]} tokens: a PrefillStep starts "
                             f"fresh sequences; continue a sequence with model.step(...)")
        _check_ids(ids, self.model.config.vocab_size)
        self.cache.reserve([slot], [n])
        self.ids[:n].copy_(ids)
        if n < self.tokens:                  # padding: the prompt again, so its rows spread over the experts as
            pad = torch.remainder(self.positions[:self.tokens - n], n)      # real ones do (one repeated token
            self.ids[n:].copy_(self.ids.index_select(0, pad))              # would send them all to the same few)
        self.length.fill_(n)
        self.slot.fill_(slot)
        try:
            if self.graph is not None:
                self.graph.replay()
            else:
                self._run()
        except BaseException:
            self.cache.mark_broken([slot])
            raise
        self.cache.advance([slot], [n])
        return self.logits
