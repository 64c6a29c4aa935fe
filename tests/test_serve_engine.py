"""The serving engine (lynn_model.serve): requests join and leave the decode batch between steps, long prompts prefill
in chunks, the cache admits what fits and queues the rest, cancel frees at once; every greedy request gets the
tokens ``generate`` gives it alone, with speculative rounds (``mtp``) too. The demo model on the torch reference, in
fp32: in bf16 a packed or chunked prefill rounds differently from a lone one (a CPU matmul's summation order depends
on its row count), so there the tokens agree to rounding only."""

from __future__ import annotations

import pytest
import torch

import lynn_kernels
import lynn_model
from lynn_cli.generate import DEMO_MODEL
from lynn_model import speculative as spec
from lynn_model.sampling import SamplingParams, sample_rows
from lynn_model.serve import Engine, Refused

CORPUS = DEMO_MODEL.parents[1] / "corpus" / "heldout.txt"


@pytest.fixture(scope="module")
def model():
    with lynn_kernels.use_reference():
        return lynn_model.from_pretrained(DEMO_MODEL, dtype=torch.float32, device="cpu")


@pytest.fixture(scope="module")
def mtp_model(model):
    """The demo model with its trained MTP head (``data/models/lynn-demo/mtp.safetensors``)."""
    assert model.mtp is not None
    return model


@pytest.fixture(scope="module")
def ids():
    return lynn_model.Tokenizer.from_pretrained(DEMO_MODEL).encode(CORPUS.read_text()[:6000])


@pytest.fixture(autouse=True)
def reference_one_thread():
    """The reference backend, on one thread (a small model's step is many tiny ops; threads mostly wait)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with lynn_kernels.use_reference():
        yield
    torch.set_num_threads(threads)


_solo: dict = {}


def solo(model, prompt, n, **kw) -> list[int]:
    """What ``generate`` gives ``prompt`` alone (greedy unless ``kw`` says otherwise), memoised."""
    key = (tuple(prompt), n, tuple(sorted(kw.items())))
    if key not in _solo:
        _solo[key] = lynn_model.generate(model, [prompt], n, temperature=kw.pop("temperature", 0.0), **kw)[
            0, len(prompt):].tolist()
    return _solo[key]


def drive(engine, arrivals: dict[int, list]) -> None:
    """Submit each ``arrivals[k]`` entry (a thunk) before step ``k``, then step until the engine is idle."""
    k = 0
    while k <= max(arrivals, default=0) or engine.busy:
        for submit in arrivals.get(k, []):
            submit()
        engine.step()
        k += 1


def test_requests_of_mixed_lengths_arriving_at_different_steps_get_their_solo_tokens(model, ids):
    """Seven requests, four rows, a prefill budget of 32 tokens a step: a 150-token prompt prefills over five steps
    while the running requests keep decoding; requests wait for a row, join and leave; each ends with its solo
    tokens, its callback saw them in order, and the cache is empty again."""
    engine = Engine(model, rows=4, max_tokens=1024, prefill_tokens=32)
    free = engine.cache.free_tokens
    specs = {"a": (0, 0, 7, 10), "b": (40, 1, 90, 8), "c": (200, 2, 5, 12), "long": (300, 2, 150, 6),
             "d": (500, 5, 33, 9), "e": (600, 9, 70, 7), "f": (700, 3, 20, 25)}
    reqs, seen, depth = {}, [], []

    def submit(name, offset, n, new):
        def go():
            reqs[name] = engine.submit(ids[offset:offset + n], new,
                                       on_token=lambda r, t: seen.append((name, engine.counters.steps, t)))
            depth.append(engine.metrics()["queue_depth"])
        return go

    arrivals: dict[int, list] = {}
    for name, (offset, at, n, new) in specs.items():
        arrivals.setdefault(at, []).append(submit(name, offset, n, new))
    drive(engine, arrivals)
    for name, (offset, _, n, new) in specs.items():
        r = reqs[name]
        assert r.tokens == solo(model, ids[offset:offset + n], new), name
        assert r.finish_reason == "length" and r.done and r.slot is None
        assert [t for who, _, t in seen if who == name] == r.tokens
        assert r.time_to_first_token > 0 and len(r.inter_token_latencies) == new - 1
    long_steps = [s for who, s, _ in seen if who == "long"]
    admitted = min(s for who, s, _ in seen if who == "c")           # "long" arrived with "c", both admitted then
    assert long_steps[0] - admitted >= 4                              # 150 tokens at <= 32 a step
    assert any(who != "long" and admitted < s < long_steps[0] for who, s, _ in seen)   # others kept decoding
    m = engine.metrics()
    assert max(depth) > 0 and m["queue_depth"] == 0                   # some waited for a row
    assert m["slots_in_use"] == 0 and m["cache_tokens_in_use"] == 0 and engine.cache.free_tokens == free
    assert m["requests_length"] == 7 and m["generated_tokens"] == sum(s[3] for s in specs.values())
    assert m["prompt_tokens"] == sum(s[2] for s in specs.values()) and m["decode_rows"] > m["decode_steps"]


def test_cancel_mid_stream_frees_the_row_and_the_cache_at_once(model, ids):
    engine = Engine(model, rows=2, max_tokens=512, prefill_tokens=64)
    free = engine.cache.free_tokens
    a = engine.submit(ids[0:20], 30)
    b = engine.submit(ids[100:140], 12)
    queued = engine.submit(ids[300:310], 5)
    while len(a.tokens) < 3:
        engine.step()
    slot = a.slot
    assert engine.metrics()["cache_tokens_in_use"] == 128              # 20 + 30 and 40 + 12: 4 pages of 16 each
    assert engine.cancel(a) and engine.cancel(queued)
    assert a.finish_reason == queued.finish_reason == "cancelled" and a.slot is None and not queued.tokens
    assert not engine.cache.active[slot] and engine.metrics()["slots_in_use"] == 1
    assert engine.metrics()["cache_tokens_in_use"] == 64                # b's pages only, before any further step
    assert a.tokens == solo(model, ids[0:20], 30)[:3]
    c = engine.submit(ids[200:260], 10)                                # takes the freed row
    engine.run_until_done()
    assert b.tokens == solo(model, ids[100:140], 12) and c.tokens == solo(model, ids[200:260], 10)
    assert len(a.tokens) == 3 and not engine.cancel(a) and not engine.cancel(b)
    assert engine.cache.free_tokens == free and engine.metrics()["requests_cancelled"] == 2


def test_requests_the_cache_cannot_hold_yet_wait_then_complete(model, ids):
    """Three slots but pages for two requests: the third waits in the queue (no eviction) and runs when one ends."""
    engine = Engine(model, rows=3, max_tokens=128, prefill_tokens=256)
    prompts = [ids[0:40], ids[50:90], ids[100:140]]
    reqs = [engine.submit(p, 20) for p in prompts]                   # 60 tokens each: 4 pages of 16
    engine.step()
    m = engine.metrics()
    assert m["queue_depth"] == 1 and m["running"] == 2 and reqs[2].status == "queued"
    engine.run_until_done()
    assert [r.tokens for r in reqs] == [solo(model, p, 20) for p in prompts]
    assert reqs[2].admitted_at >= min(r.finished_at for r in reqs[:2])


def test_a_request_that_can_never_fit_is_refused_naming_the_limit(model, ids):
    engine = Engine(model, rows=2, max_tokens=256)
    with pytest.raises(Refused, match=r"need 2,100 tokens; the model's context is 2,048 tokens "
                                      r"\(max_position_embeddings\)"):
        engine.submit([5] * 2000, 100)
    with pytest.raises(Refused, match=r"need 300 tokens; the engine's cache holds 256 tokens \(max_tokens\)"):
        engine.submit(ids[:200], 100)
    with pytest.raises(ValueError, match="max_new_tokens = 0"):
        engine.submit(ids[:5], 0)
    with pytest.raises(ValueError, match=r"must lie in \[0, 6144\)"):
        engine.submit([1, 6144], 3)
    with pytest.raises(ValueError, match="top_p"):
        engine.submit(ids[:5], 3, temperature=1.0, top_p=0.0)
    m = engine.metrics()
    assert m["requests_refused"] == 2 and m["queue_depth"] == 0 and not engine.busy


def test_stop_ids_end_a_request_early_and_stream_yields_tokens(model, ids):
    want = solo(model, ids[10:30], 12)
    stop = want[4]
    end = want.index(stop)
    engine = Engine(model, rows=2, max_tokens=256)
    r = engine.submit(ids[10:30], 12, stop_ids=[stop])
    other = engine.submit(ids[400:425], 12)
    assert list(engine.stream(r)) == want[:end + 1] == r.tokens
    assert r.finish_reason == "stop" and r.slot is None
    engine.run_until_done()
    assert other.tokens == solo(model, ids[400:425], 12) and other.finish_reason == "length"


def test_seeded_sampling_repeats_exactly_whatever_the_company(model, ids):
    """The same seeded requests in two engines, arriving in another order among other traffic, draw the same
    tokens; and the tokens ``generate`` draws for them alone with the same settings."""
    asks = [(ids[0:12], dict(temperature=0.9, top_k=40, top_p=0.9, seed=5)),
            (ids[50:80], dict(temperature=1.3, seed=6)),
            (ids[90:95], dict(temperature=0.7, top_p=0.8, seed=7))]
    runs = []
    for order, rows in (([0, 1, 2], 4), ([2, 1, 0], 2)):
        engine = Engine(model, rows=rows, max_tokens=512, prefill_tokens=16)
        noise = engine.submit(ids[200:230], 10)                     # greedy company
        reqs = {}
        drive(engine, {k: [lambda i=i: reqs.setdefault(i, engine.submit(asks[i][0], 10, **asks[i][1]))]
                       for k, i in enumerate(order)})
        runs.append([reqs[i].tokens for i in range(3)])
        assert noise.tokens == solo(model, ids[200:230], 10)
    assert runs[0] == runs[1]
    assert runs[0] == [solo(model, p, 10, **kw) for p, kw in asks]
    assert len({tuple(t) for t in runs[0]}) == 3


def test_prompts_prefilling_inside_the_running_bucket_keep_their_states(model, ids):
    """Rows 1 and 2 free up while rows 0 and 3 decode (bucket 4, whose steps write idle rows' states): two prompts
    admitted there, one waiting a step for its first chunk and both prefilling over several steps, still get their
    solo tokens."""
    engine = Engine(model, rows=4, max_tokens=1024, prefill_tokens=16)
    first = [engine.submit(ids[k:k + 3], new) for k, new in ((0, 30), (10, 2), (20, 2), (30, 30))]
    while first[1].status != "finished" or first[2].status != "finished":
        engine.step()
    late = [engine.submit(ids[100:140], 6), engine.submit(ids[200:235], 6)]
    engine.step()
    assert [r.slot for r in first + late] == [0, None, None, 3, 1, 2] and late[1].prefilled == 0
    engine.run_until_done()
    for r, k in zip(first, (0, 10, 20, 30)):
        assert r.tokens == solo(model, ids[k:k + 3], r.max_new_tokens) and r.finish_reason == "length"
    assert late[0].tokens == solo(model, ids[100:140], 6) and late[1].tokens == solo(model, ids[200:235], 6)


def test_a_callback_may_cancel_and_non_finite_logits_end_one_request(model, ids, monkeypatch):
    engine = Engine(model, rows=2, max_tokens=256)
    a = engine.submit(ids[0:9], 10, on_token=lambda r, t: len(r.tokens) == 2 and engine.cancel(r))
    b = engine.submit(ids[20:31], 10)
    c = engine.submit(ids[40:45], 10)                                 # waits for a's row
    engine.step()
    engine.step()
    assert a.finish_reason == "cancelled" and a.tokens == solo(model, ids[0:9], 2)
    assert c.slot == 0 and c.tokens == solo(model, ids[40:45], 2)      # joined a's row: first token, one step
    real = model.lm_head.forward

    def poisoned(x):                                                  # c's row of a decode step only
        out = real(x)
        if out.shape[0] == 2:
            out[c.slot] = float("nan")
        return out

    monkeypatch.setattr(model.lm_head, "forward", poisoned)
    engine.step()
    monkeypatch.undo()
    assert c.finish_reason == "error" and "not finite (NaN or inf) at new token 3" in c.error and c.slot is None
    assert len(c.tokens) == 2 and engine.metrics()["slots_in_use"] == 1
    engine.run_until_done()
    assert b.tokens == solo(model, ids[20:31], 10)


def test_join_and_set_row_refuse_what_the_step_was_not_built_for(model):
    greedy = lynn_model.SamplingParams.build([lynn_model.Sampling()] * 2, "cpu")
    with pytest.raises(ValueError, match="built greedy"):
        greedy.set_row(1, lynn_model.Sampling(0.8, seed=1))
    flat = lynn_model.SamplingParams.build([lynn_model.Sampling(1.0, seed=1)], "cpu")
    with pytest.raises(ValueError, match="rank none"):
        flat.set_row(0, lynn_model.Sampling(1.0, top_k=5))
    wide = lynn_model.SamplingParams.for_any(2, "cpu", vocab=64)
    with pytest.raises(ValueError, match="top_k = 65 is more than the 64 candidates"):
        wide.set_row(0, lynn_model.Sampling(1.0, top_k=65))
    wide.set_row(1, lynn_model.Sampling(0.5, top_k=3, top_p=0.9, seed=4))
    assert wide.temperature.tolist() == [0.0, 0.5] and wide.top_k.tolist() == [0, 3] and wide.seed.tolist() == [0, 4]
    cache = model.new_cache(max_batch=2, max_tokens=64)
    step = lynn_model.DecodeStep(model, cache, 2, lynn_model.SamplingParams.for_any(2, "cpu", 6144))
    with pytest.raises(ValueError, match="is not an active sequence"):
        step.join(1, 5)
    with pytest.raises(ValueError, match=r"expected a row in 0..1"):
        step.join(2, 5)
    s = cache.add()
    cache.reserve([s], [8])
    step.join(s, 7, lynn_model.Sampling(0.9, seed=3))
    assert step.active.tolist() == [True, False] and step.tokens[0] == 7 and step.params.seed[0] == 3


def test_each_request_prefills_in_its_own_call_unless_packed(model, ids):
    """By default a step prefills each request's chunk in a call of its own (a chunk's shape never depends on the
    company); ``pack_prefill`` puts the step's chunks in one call."""
    prompts = [ids[o:o + n] for o, n in ((0, 9), (50, 20), (100, 5))]
    for pack, calls in ((False, 3), (True, 1)):
        engine = Engine(model, rows=4, max_tokens=512, prefill_tokens=64, pack_prefill=pack)
        reqs = [engine.submit(p, 3) for p in prompts]
        engine.step()
        assert engine.counters.prefill_calls == calls and all(len(r.tokens) == 2 for r in reqs), pack
        engine.run_until_done()
        if not pack:
            assert [r.tokens for r in reqs] == [solo(model, p, 3) for p in prompts]


def test_an_all_greedy_batch_runs_the_argmax_step_until_a_sampled_request_joins(model, ids):
    """The step that only takes the argmax while every row is greedy, the sampling one while any row samples, and
    back; the greedy request keeps its solo tokens through the switches. ``arrived`` starts the first-token clock."""
    engine = Engine(model, rows=2, max_tokens=512, prefill_tokens=64)
    g = engine.submit(ids[:12], 10, arrived=1.0)
    assert g.submitted_at == 1.0
    kinds = []
    for k in range(12):
        if k == 3:
            s = engine.submit(ids[40:45], 3, temperature=0.9, seed=3)
        engine.step()
        if engine._step is not None:
            kinds.append(engine._step.params.greedy)
    engine.run_until_done()
    assert kinds[:2] == [True, True] and False in kinds and kinds[-1] is True, kinds
    assert g.tokens == solo(model, ids[:12], 10) and len(s.tokens) == 3


def test_a_step_that_raises_anywhere_ends_every_running_request_and_frees_its_slot(model, ids, monkeypatch):
    """A fault outside the model call (here the first-token sampler) leaves no request half-done: each admitted
    request ends with "error" naming the step, the slots and pages come back, and the engine serves the next one."""
    import lynn_model.serve.engine as engine_module

    engine = Engine(model, rows=2, max_tokens=256, prefill_tokens=64)
    free = engine.cache.free_tokens
    a, b = engine.submit(ids[:6], 4), engine.submit(ids[10:14], 4)

    def broken(*args, **kwargs):
        raise RuntimeError("sampler fault")
    monkeypatch.setattr(engine_module, "sample_rows", broken)
    with pytest.raises(RuntimeError, match="sampler fault"):
        engine.step()
    assert a.finish_reason == b.finish_reason == "error" and "sampler fault" in a.error
    assert engine.cache.free_tokens == free and not any(engine.cache.active) and not engine.busy
    monkeypatch.undo()
    c = engine.submit(ids[:6], 3)
    engine.run_until_done()
    assert c.tokens == solo(model, ids[:6], 3)


# -- speculative rounds (mtp) ----------------------------------------------------------------------------------------

class Planted:
    """A drafter proposing each request's true continuation (``truth[request id]``: its solo tokens), wrong wherever
    ``wrong(n)`` says (``n``: the drafted token's index among the request's new tokens), so rounds keep all, some or
    none of their drafts; token 0 past the truth's end. For the rejection rule its ``q`` is all on the draft."""

    def __init__(self, engine, wrong=lambda n: False):
        self.engine, self.wrong, self.truth = engine, wrong, {}
        self.calls: list[list[int]] = []                     # the slots of each drafting call

    def draft(self, cache, slots, nxt, hidden, lens, starts, settings):
        assert len(nxt) == hidden.shape[0] == sum(lens)
        if settings is None:                                 # a prompt chunk that is not its last: no drafts
            return [], None
        self.calls.append(list(slots))
        by_slot = {r.slot: r for r in self.engine._admitted}
        out = []
        for s, start, n in zip(slots, starts, lens):
            r = by_slot[s]
            truth, first = self.truth[r.id], start + n + 1 - len(r.prompt)     # the first draft's new-token index
            out.append([(truth[j] + self.wrong(j)) % self.engine.vocab if j < len(truth) else 0
                        for j in range(first, first + self.engine.mtp)])
        q = None
        if self.engine.mtp_rule == "rejection":
            q = torch.nn.functional.one_hot(torch.tensor(out), self.engine.vocab).float()
        return out, q


MTP_ASKS = {"a": (0, 9, 12, {}, 0), "sampled": (50, 40, 10, dict(temperature=0.9, top_k=40, seed=5), 0),
            "short": (100, 5, 14, {}, 1), "b": (200, 30, 9, dict(temperature=1.1, top_p=0.9, seed=3), 2),
            "long": (300, 70, 8, {}, 2)}                     # offset, prompt length, new tokens, sampling, arrival


@pytest.mark.parametrize("drafter,rule", [("module", "coupled"), ("planted", "coupled"), ("planted", "rejection")])
def test_speculative_rounds_give_each_request_its_solo_tokens(model, mtp_model, ids, drafter, rule):
    """Five requests, three rows, 32 prompt tokens a step (the 70-token prompt prefills in three chunks), two drafts
    a round: each request gets the tokens ``generate`` gives it alone without ``mtp``, greedy and seeded, with the
    model's trained MTP head and with planted drafts that rounds keep all, some or none of; under the rejection
    rule the greedy ones do, and the sampled ones their full count. The cache is empty at the end."""
    engine = Engine(mtp_model, rows=3, max_tokens=1024, prefill_tokens=32, mtp=2, mtp_rule=rule)
    assert not engine.steps                                  # nothing built or captured for plain decoding
    free = engine.cache.free_tokens
    if drafter == "planted":
        engine.drafter = Planted(engine, wrong=lambda n: n % 4 == 3)
    reqs, seen = {}, {name: [] for name in MTP_ASKS}

    def submit(name, offset, n, new, kw):
        def go():
            reqs[name] = engine.submit(ids[offset:offset + n], new, **kw, on_token=lambda r, t: seen[name].append(t))
            if drafter == "planted":
                engine.drafter.truth[reqs[name].id] = solo(model, ids[offset:offset + n], new, **kw)
        return go

    arrivals: dict[int, list] = {}
    for name, (offset, n, new, kw, at) in MTP_ASKS.items():
        arrivals.setdefault(at, []).append(submit(name, offset, n, new, kw))
    drive(engine, arrivals)
    for name, (offset, n, new, kw, _) in MTP_ASKS.items():
        r = reqs[name]
        assert r.finish_reason == "length" and seen[name] == r.tokens and len(r.tokens) == new, name
        if rule == "coupled" or not kw:
            assert r.tokens == solo(model, ids[offset:offset + n], new, **kw), name
    m = engine.metrics()
    assert m["verify_steps"] == m["decode_steps"] > 0 and m["decode_rows"] > m["decode_steps"]
    assert m["mtp_drafted"] == 2 * m["decode_rows"] and m["generated_tokens"] == sum(a[2] for a in MTP_ASKS.values())
    if drafter == "planted":
        assert 0 < m["mtp_accepted"] < m["mtp_drafted"] and 1 < m["mtp_acceptance_length"] < 3
    assert m["slots_in_use"] == 0 and engine.cache.free_tokens == free


def lone_rounds(model, prompt, n, k, rule, setting) -> list[list[int]]:
    """The drafts of each speculative round of ``prompt`` alone, by hand from the primitives: one prefill of the
    whole prompt, :class:`MTPDrafter` over all of it, then verify, roll back and catch up, until ``n`` tokens."""
    cache = model.new_cache(max_batch=1, max_tokens=256)
    s = cache.add()
    logits, hidden = model.step(torch.tensor(prompt), cache, [s], [len(prompt)], hidden=True)
    pending = sample_rows(logits, SamplingParams.build([setting], "cpu", model.config.vocab_size),
                          torch.tensor([len(prompt)])).item()
    drafter = spec.MTPDrafter(model, k, rule)
    drafts, q = drafter.draft(cache, [s], prompt[1:] + [pending], hidden, [len(prompt)], [0], [setting])
    rounds, made = [], 1
    while made < n:
        rounds.append(drafts[0])
        start = cache.lengths[s]
        (a,), (y,), _, h = spec.verify(model, cache, [s], [pending], drafts, [setting], rule, q)
        cache.rollback([s], [a + 1])
        new = [*drafts[0][:a], y]
        made, pending = made + len(new), y
        drafts, q = drafter.draft(cache, [s], new, h[0, :a + 1], [a + 1], [start], [setting])
    return rounds


def test_the_mtp_layer_runs_over_every_position_of_a_chunked_prompt(mtp_model, ids):
    """A lone request whose 40-token prompt prefills in three chunks drafts, round after round, what the MTP module
    drafts over the whole prompt at once (:func:`lone_rounds`): the MTP layer saw each prompt position with the
    token after it, and caught up on each round's accepted positions; under both rules, seeded. Its tokens are
    ``generate(..., mtp=2)``'s."""
    prompt, kw = ids[50:90], dict(temperature=0.9, top_k=40, seed=5)
    for rule in ("coupled", "rejection"):
        engine = Engine(mtp_model, rows=2, max_tokens=256, prefill_tokens=16, mtp=2, mtp_rule=rule)
        drafts, real = [], engine.drafter.draft
        engine.drafter.draft = lambda *a: (lambda out: (drafts.extend(out[0]), out)[1])(real(*a))
        r = engine.submit(prompt, 10, **kw)
        engine.run_until_done()
        want = lynn_model.generate(mtp_model, [prompt], 10, mtp=2, mtp_rule=rule, **kw)
        assert r.tokens == want[0, len(prompt):].tolist() and engine.counters.prefill_calls == 3
        assert drafts == lone_rounds(mtp_model, prompt, 10, 2, rule, r.sampling), rule


def test_a_stop_id_max_new_tokens_or_a_cancel_mid_round_end_the_request_there(model, mtp_model, ids):
    """Planted drafts all right: a round emits three tokens. A request ends on the token that ends it, inside a
    round (its 6th of 6, its stop id, or the token whose callback cancels it): nothing after it is emitted or
    counted, and the company keeps its solo tokens."""
    engine = Engine(mtp_model, rows=4, max_tokens=1024, prefill_tokens=64, mtp=2)
    planted = engine.drafter = Planted(engine)
    prompts = {"length": ids[0:9], "stop": ids[20:40], "cancel": ids[60:70], "company": ids[90:120]}
    truth = {name: solo(model, p, 16) for name, p in prompts.items()}        # past 14: the last drafts are right
    # the first new token comes from the prefill, then rounds of three: 1-3, 4-6, 7-9; 5 and 8 are mid-round
    at = next(i for i in (5, 8, 4, 7) if truth["stop"].index(truth["stop"][i]) == i)
    seen = {name: [] for name in prompts}

    def on(name):
        def go(r, t):
            seen[name].append(t)
            if name == "cancel" and len(r.tokens) == 5:
                engine.cancel(r)
        return go

    reqs = {"length": engine.submit(prompts["length"], 6, on_token=on("length")),
            "stop": engine.submit(prompts["stop"], 14, stop_ids=[truth["stop"][at]], on_token=on("stop")),
            "cancel": engine.submit(prompts["cancel"], 14, on_token=on("cancel")),
            "company": engine.submit(prompts["company"], 14, on_token=on("company"))}
    for r in reqs.values():
        planted.truth[r.id] = truth[next(n for n in reqs if reqs[n] is r)]
    engine.run_until_done()
    ends = {"length": (6, "length"), "stop": (at + 1, "stop"), "cancel": (5, "cancelled"), "company": (14, "length")}
    for name, (n, reason) in ends.items():
        r = reqs[name]
        assert r.tokens == truth[name][:n] == seen[name] and r.finish_reason == reason, name
    m = engine.metrics()
    assert m["mtp_accepted"] == m["mtp_drafted"] and m["generated_tokens"] == sum(n for n, _ in ends.values())
    assert m["slots_in_use"] == 0 and m["cache_tokens_in_use"] == 0


def test_non_finite_logits_in_a_verify_end_that_request_only(model, mtp_model, ids, monkeypatch):
    engine = Engine(mtp_model, rows=2, max_tokens=256, mtp=2)
    a, b = engine.submit(ids[0:9], 8), engine.submit(ids[20:31], 8)
    real = mtp_model.lm_head.forward

    def poisoned(x):                                         # b's three rows of the verify (a's come first)
        out = real(x)
        if out.shape[0] == 6:
            out[3:] = float("nan")
        return out

    monkeypatch.setattr(mtp_model.lm_head, "forward", poisoned)
    engine.step()                                            # the prefills (a row each), then the first round
    monkeypatch.undo()
    assert b.finish_reason == "error" and "not finite (NaN or inf) at new token 2" in b.error and b.tokens == \
        solo(model, ids[20:31], 1)
    engine.run_until_done()
    assert a.tokens == solo(model, ids[0:9], 8)


def test_mtp_arguments_are_checked(model, mtp_model, ids):
    with pytest.raises(ValueError, match=r"mtp = 4: expected an int in \[0, 3\]"):
        Engine(mtp_model, rows=1, max_tokens=64, mtp=4)
    with pytest.raises(ValueError, match=r"mtp_rule = 'strict': expected one of 'coupled', 'rejection'"):
        Engine(mtp_model, rows=1, max_tokens=64, mtp=1, mtp_rule="strict")
    bare = lynn_model.loader.random_model(lynn_model.preset("tiny-qwen3.5").replace(num_hidden_layers=1),
                                          dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match=r"mtp = 1: .* has no MTP module"):
        Engine(bare, rows=1, max_tokens=64, mtp=1)
    with pytest.raises(ValueError, match=r"cuda_graph = True with mtp = 2: the speculative rounds run eagerly"):
        Engine(mtp_model, rows=1, max_tokens=64, mtp=2, cuda_graph=True)
    engine = Engine(mtp_model, rows=1, max_tokens=64, mtp=2)
    with pytest.raises(Refused, match=r"need 65 tokens \(with the 2 a verify writes past the end\); the engine's "
                                      r"cache holds 64 tokens \(max_tokens\)"):
        engine.submit(ids[:50], 13)
    r = engine.submit(ids[:50], 12)                          # 64 with the verify's 2: admitted, and runs to its end
    engine.run_until_done()
    assert r.tokens == solo(model, ids[:50], 12) and engine.metrics()["requests_refused"] == 1
