"""Multi-token prediction: the MTP module's forward, the unrolled verify step and its rollback, and speculative
decoding that emits exactly the tokens of plain greedy decoding (tiny random models on the interpreter)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import lynn_kernels
import lynn_model
from lynn_kernels import dequantize
from lynn_kernels.matmul import PackedNVFP4
from lynn_model import Batch, generate, preset
from lynn_model import speculative as spec
from lynn_model.generate import Stats
from lynn_model.loader import random_model

BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def model():
    """Qwen3.5-MoE, four layers (three Gated DeltaNet, one attention) and one MTP layer with routed experts."""
    c = preset("tiny-qwen3.5-moe").replace(num_hidden_layers=4, mtp_layers=1)
    return random_model(c, dtype=BF16, seed=3)


@pytest.fixture(scope="module")
def prompts(model):
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in (9, 14)]


SAMPLED = dict(temperature=0.9, top_k=40, seed=11)


@pytest.fixture(scope="module")
def plain(model, prompts):
    """Plain greedy decoding of both prompts: 7 new tokens each."""
    return generate(model, prompts, 7)


@pytest.fixture(scope="module")
def plain_sampled(model, prompts):
    """Plain seeded sampling of both prompts: 7 new tokens each."""
    return generate(model, prompts, 7, **SAMPLED)


def _prefilled(model, ids):
    cache = model.new_cache(2, 64)
    slot = cache.add()
    model.step(torch.tensor(ids), cache, [slot], [len(ids)])
    return cache, slot


def _states(cache, slot):
    return [t[slot].clone() for t in (*cache.conv.values(), *cache.state.values())]


def test_an_unrolled_step_is_its_decode_steps_and_rolls_back(model, prompts):
    """Three tokens in one unrolled step give the three decode steps' logits bit for bit; rolled back to two, the
    states are those after two decode steps, and the next step continues as if the last one never ran."""
    extra = torch.tensor([7, 100, 3])
    cache, s = _prefilled(model, prompts[0])
    steps = []
    for j, t in enumerate(extra):
        steps.append(model.step(t.view(1), cache, [s], [1]))
        if j == 1:
            after_two = _states(cache, s)
    steps = torch.cat(steps)

    cache2, s2 = _prefilled(model, prompts[0])
    logits, hidden = model.step(extra, cache2, [s2], [3], all_logits=True, unroll=True, hidden=True)
    assert torch.equal(logits, steps)
    assert hidden.shape == (3, model.config.hidden_size)
    cache2.rollback([s2], [2])
    assert cache2.lengths[s2] == len(prompts[0]) + 2
    assert all(torch.equal(a, b) for a, b in zip(_states(cache2, s2), after_two))
    assert torch.equal(model.step(extra[2:3], cache2, [s2], [1]), steps[2:3])
    with pytest.raises(ValueError, match="not an unrolled step"):
        cache2.rollback([s2], [1])


def test_an_unrolled_step_of_two_sequences_is_their_decode_steps(model):
    """``unrolled_and_steps`` (the GPU test's check, below) at batch 2: the verify's rows, sequence-major, are the
    decode steps' bit for bit."""
    unrolled, steps = spec.unrolled_and_steps(model, 2, 3, torch.Generator().manual_seed(2), prompt=8)
    assert unrolled.shape == (6, model.config.vocab_size) and torch.equal(unrolled, steps)


def test_the_mtp_module_computes_its_formula(model, prompts):
    """``mtp_step`` over a prompt, then one position more from its cache, against the formula written out: the
    zero-centred norms of the next token's embedding and of the hidden state, joined in that order, ``fc``, the
    MTP layer over the whole sequence without a cache, the MTP norm, the shared LM head."""
    c, m = model.config, model.mtp
    ids = prompts[1]
    cache, s = _prefilled(model, ids)
    g = torch.Generator().manual_seed(9)
    hidden = torch.randn(len(ids), c.hidden_size, generator=g).to(BF16)
    nxt = torch.tensor(ids[1:] + [17])
    logits, _ = model.mtp_step(nxt[:-1], hidden[:-1], cache, [s], [len(ids) - 1], [0])
    last, h = model.mtp_step(nxt[-1:], hidden[-1:], cache, [s], [1], [len(ids) - 1])

    def norm(x, w):
        x = x.float()
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps) * (1 + w.float())).to(BF16)

    fc = m.fc.weight
    fc = dequantize(fc.unpack() if isinstance(fc, PackedNVFP4) else fc, BF16)
    joined = torch.cat([norm(F.embedding(nxt, model.embed_tokens), m.pre_fc_norm_embedding.weight),
                        norm(hidden, m.pre_fc_norm_hidden.weight)], -1)
    x = (joined.float() @ fc.float().t()).to(BF16)
    layer = m.layers[0]
    y, _ = layer(layer.input_layernorm(x), x, Batch.uncached([len(ids)], x.device), None, m.norm)
    want = model.lm_head(y)
    for got, ref in ((logits[0], want[-2]), (last[0], want[-1])):
        cos = F.cosine_similarity(got.float(), ref.float(), dim=0)
        assert cos > 0.999, cos
    assert h.shape == (1, c.hidden_size)


def plant(monkeypatch, truth: list[list[int]], vocab: int, wrong) -> None:
    """Make every round of :class:`SpeculativeStep` verify chosen drafts: the true continuation (plain decoding's,
    ``truth``: a row per slot), off by one wherever ``wrong(b, n)`` says (``n``: the index of the drafted token in
    its sequence), so rounds keep all, some or none of them. For the rejection rule each draft is said to have been
    drawn for sure (``q`` all on it)."""
    replay = spec.SpeculativeStep.replay

    def planted(step):
        for s in step._live:
            n = step.cache.lengths[s] + 1                 # the index of the first draft's token
            row = truth[s]
            d = [(row[j] + (1 if wrong(s, j) else 0)) % vocab if j < len(row) else 0 for j in range(n, n + step.k)]
            step.drafts[s] = torch.tensor(d)
            if step.q is not None:
                step.q[s] = F.one_hot(torch.tensor(d), vocab).float()
        return replay(step)

    monkeypatch.setattr(spec.SpeculativeStep, "replay", planted)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_speculative_decoding_emits_plain_decodings_tokens(model, prompts, plain, plain_sampled, monkeypatch,
                                                           sampled, k=3):
    """Drafts right, partly right and wrong (planted): the output is plain decoding's token for token, greedy or
    seeded sampling (the coupled rule: the verify draws with the same noise); the counts show every kind of round.
    (The rejection rule's acceptance is tested on its own below, and end to end by ``lynn generate``.)"""
    want = plain_sampled if sampled else plain
    plant(monkeypatch, want.tolist(), model.config.vocab_size, lambda b, j: (j + b) % 4 == 0)
    stats = Stats()
    got = generate(model, prompts, 7, mtp=k, stats=stats, **(SAMPLED if sampled else {}))
    assert torch.equal(got, want)
    assert 0 < stats.accepted < stats.drafted
    assert stats.verify_steps < 6                     # fewer steps than plain decoding's
    assert 1 < stats.acceptance_length <= k + 1
    for b, prompt in enumerate(prompts):                # the rounds' record rebuilds each sequence's tokens
        rebuilt = [t for i, d, a, y in stats.rounds if i == b for t in [*d[:a], y]]
        assert rebuilt[:6] == want[b, len(prompt) + 1:len(prompt) + 7].tolist()
    assert sum(a for _, _, a, _ in stats.rounds) == stats.accepted


def test_an_nvfp4_draft_head_changes_the_drafts_not_the_tokens(model, prompts, plain):
    """``lm_head="nvfp4-drafts"``: the trunk keeps its bf16 head, the MTP module's logits come from an NVFP4 copy
    (its dequantised weight is the quantised head's), and greedy speculative decoding still emits plain decoding's
    tokens; a model without an MTP module refuses the mode, naming it."""
    c = model.config
    drafting = random_model(c, dtype=BF16, seed=3, lm_head="nvfp4-drafts")     # the fixture's weights
    assert torch.equal(drafting.lm_head.weight, model.lm_head.weight) and model.draft_head is None
    assert isinstance(drafting.draft_head.weight, PackedNVFP4)
    assert torch.equal(drafting.draft_head.weight.dequantize(),
                       dequantize(lynn_kernels.quantize(model.lm_head.weight)))
    cache, s = _prefilled(drafting, prompts[0])
    hidden = torch.randn(1, c.hidden_size, generator=torch.Generator().manual_seed(2)).to(BF16)
    logits, h = drafting.mtp_step(torch.tensor([5]), hidden, cache, [s], [1], [len(prompts[0]) - 1])
    assert torch.equal(logits, drafting.draft_head(h))
    assert not torch.equal(logits, drafting.lm_head(h))
    stats = Stats()
    assert torch.equal(generate(drafting, prompts, 7, mtp=2, stats=stats), plain)
    assert stats.drafted > 0
    with pytest.raises(ValueError, match=r"lm_head = 'nvfp4-drafts': .* has no MTP module"):
        random_model(c.replace(mtp_layers=0), dtype=BF16, lm_head="nvfp4-drafts")


def test_a_sequence_that_stops_leaves_the_round_and_the_others_go_on(model, prompts, plain):
    """A stop id the first sequence emits at its 4th new token (the second goes on): the speculative run stops it
    there too (its row idles in the step), and the second sequence's tokens are unchanged."""
    end = len(prompts[0]) + 4
    stop = plain[0, end - 1].item()
    assert stop not in plain[0, len(prompts[0]):end - 1].tolist() + plain[1, len(prompts[1]):].tolist()
    want = plain.clone()
    want[0, end:] = stop                             # plain decoding with the stop id: the row ends there, padded
    assert torch.equal(generate(model, prompts, 7, stop_ids=[stop], mtp=2), want)


def test_speculative_step_arguments_are_checked(model):
    from lynn_model.sampling import Sampling, SamplingParams

    cache = model.new_cache(2, 64)
    params = SamplingParams.build([Sampling()] * 2, "cpu", model.config.vocab_size)
    with pytest.raises(ValueError, match=r"k = 4: expected an int in \[1, 3\] \(drafts a round\)"):
        spec.SpeculativeStep(model, cache, 2, 4, params)
    with pytest.raises(ValueError, match=r"rule = 'greedy': expected one of 'coupled', 'rejection'"):
        spec.SpeculativeStep(model, cache, 2, 2, params, "greedy")
    with pytest.raises(ValueError, match=r"params has \(2,\) rows of settings; expected \(1,\)"):
        spec.SpeculativeStep(model, cache, 1, 2, params)
    step = spec.SpeculativeStep(model, cache, 2, 2, params)
    with pytest.raises(ValueError, match="q: the drafts' distributions go with the rejection rule"):
        step.begin([0], [1], [[2, 3]], torch.zeros(1, 2, model.config.vocab_size))


def test_the_rejection_rule_keeps_the_trunks_distribution(n=40000, k=2, vocab=6):
    """The speculative sampling test on 40,000 seeded rounds with fixed trunk rows ``p`` (temperature and top-k
    applied) and a draft distribution ``q`` unlike them: the first token a round emits is distributed as ``p``'s
    first row, the token after an accepted first draft as its second, each frequency within 5 standard errors;
    the first draft is kept at the rate ``sum min(p, q)``, the most any rule keeps; the same seeds repeat."""
    from lynn_model.sampling import Sampling, probabilities, sample_rows

    g = torch.Generator().manual_seed(4)
    trunk = torch.randn(k + 1, vocab, generator=g) * 1.5
    logits = trunk.repeat(n, 1)                                                     # [n * (k + 1), vocab]
    draft_logits = (trunk[:k] + torch.randn(k, vocab, generator=g)).repeat(n, 1)   # [n * k], near the trunk's
    settings = [Sampling(0.8, top_k=5, seed=s) for s in range(n)]
    params = spec.Params("cpu", vocab)
    rows, drows = params(settings, k + 1), params(settings, k)
    start = torch.randint(3, 50, (n,), generator=g)
    counter = (start[:, None] + 1 + torch.arange(k + 1)).reshape(-1)
    dcounter = (start[:, None] + 1 + torch.arange(k)).reshape(-1)
    drafts = sample_rows(draft_logits, drows, dcounter).view(n, k)
    q = probabilities(draft_logits, drows).view(n, k, vocab)
    a, y = spec.accept_rejection(logits, rows, counter, drafts, q)
    p = probabilities(logits[:k + 1], params(settings[:1], k + 1))

    def close(tokens, want):
        freq = torch.bincount(tokens, minlength=vocab).double() / tokens.numel()
        err = (want.double() * (1 - want.double()) / tokens.numel()).sqrt()
        assert ((freq - want.double()).abs() <= 5 * err + 1e-9).all(), (freq, want)

    first = torch.where(a >= 1, drafts[:, 0], y)
    close(first, p[0])
    kept = a >= 1
    close(torch.where(a[kept] >= 2, drafts[kept, 1], y[kept]), p[1])
    rate, best = kept.double().mean(), torch.minimum(p[0], q[0, 0]).sum().double()
    assert abs(rate - best) < 5 * (best * (1 - best) / n).sqrt(), (rate, best)
    assert 0.2 < best < 0.9                             # a test with something to reject and something to keep
    a2, y2 = spec.accept_rejection(logits, rows, counter, drafts, q)
    assert torch.equal(a, a2) and torch.equal(y, y2)


def test_non_finite_logits_stop_speculative_decoding(model):
    """The final norm damaged once the first token is out: the verify's logits are NaN, and the run stops with
    plain decoding's NonFiniteError naming the token, before emitting anything from them (reference path)."""
    norm, seen = model.norm.weight.clone(), []

    def damage(tokens):
        seen.append(tokens.tolist())
        model.norm.weight.fill_(float("nan"))

    try:
        with lynn_kernels.use_reference(), pytest.raises(lynn_model.NonFiniteError,
                                                          match=r"^the logits are not finite \(NaN or inf\) at new "
                                                                r"token 2: "):
            generate(model, [[1, 2, 3]], 5, mtp=2, stream=damage)
    finally:
        model.norm.weight.copy_(norm)
    assert len(seen) == 1


def test_mtp_arguments_are_checked(model):
    with pytest.raises(ValueError, match=r"mtp = 4: expected an int in \[0, 3\]"):
        generate(model, [[1, 2]], 3, mtp=4)
    bare = random_model(preset("tiny-qwen3.5").replace(num_hidden_layers=1), dtype=BF16)
    with pytest.raises(ValueError, match="no MTP module"):
        generate(bare, [[1, 2]], 3, mtp=1)
    with pytest.raises(ValueError, match=r"mtp_rule = 'strict': expected one of 'coupled', 'rejection'"):
        generate(model, [[1, 2]], 3, mtp=1, mtp_rule="strict")


def test_lynn_generate_mtp_prints_the_same_text(capsys):
    """``lynn generate --mtp 2`` on the demo model with its trained MTP head (``data/models/lynn-demo``): the same
    text as without it, greedy and seeded, drafts accepted, and the acceptance in the summary line."""
    import re

    from lynn_cli import main

    args = ["generate", "--temperature", "0", "--max-new-tokens", "8", "--ignore-eos", "--backend", "reference",
            "Once upon a time"]
    plain_greedy = None
    for extra in ([], ["--temperature", "0.8", "--seed", "5"]):
        assert main(args + extra) == 0
        plain = capsys.readouterr()
        assert main(args + extra + ["--mtp", "2"]) == 0
        spec_run = capsys.readouterr()
        plain_greedy = plain_greedy if extra else plain.out
        assert spec_run.out == plain.out
        assert "2 MTP drafts a step (coupled)" in spec_run.err and "tokens per verify step" in spec_run.err
        assert int(re.search(r"(\d+) of \d+ accepted", spec_run.err).group(1)) > 0
    # the rejection rule: greedy, the same text; seeded, its own draws, the same on a second run
    assert main(args + ["--mtp", "2", "--mtp-rule", "rejection"]) == 0
    assert capsys.readouterr().out == plain_greedy
    seeded = args + ["--temperature", "0.8", "--seed", "5", "--mtp", "2", "--mtp-rule", "rejection"]
    runs = []
    for _ in range(2):
        assert main(seeded) == 0
        runs.append(capsys.readouterr())
    assert runs[0].out == runs[1].out and "2 MTP drafts a step (rejection)" in runs[0].err


@pytest.mark.gpu
@pytest.mark.parametrize("preset_name", ["tiny-qwen3.5-moe", "tiny-qwen3-next"])
@pytest.mark.parametrize("rule", ["coupled", "rejection"])
def test_gpu_captured_rounds_give_the_eager_rounds_tokens(preset_name, rule):
    """The whole round captured as one CUDA graph (SpeculativeStep on the compiled kernels, fused as ``lynn
    generate`` runs it) and the same round run eagerly give the same tokens over 24 new tokens of a batch of 3
    (bucket 4: an idle row), greedy and sampled; greedy and coupled-sampled, plain decoding's tokens."""
    config = preset(preset_name).replace(num_hidden_layers=4, mtp_layers=1)
    model = random_model(config, weights="nvfp4", device="cuda", seed=4)   # fused for decode, as loaded on a GPU
    gen = torch.Generator().manual_seed(7)
    rows = [torch.randint(0, config.vocab_size, (4 + 6 * b,), generator=gen).tolist() for b in range(3)]
    for kw in ({}, {"temperature": 0.9, "top_k": 40, "seed": 5}):
        runs = [generate(model, rows, 24, mtp=3, mtp_rule=rule, cuda_graph=graph, **kw) for graph in (False, True)]
        assert torch.equal(runs[0], runs[1])
        if rule == "coupled" or not kw:
            assert torch.equal(runs[1], generate(model, rows, 24, **kw))


@pytest.mark.gpu
def test_gpu_an_unrolled_step_is_its_decode_steps_at_qwen35_widths():
    """Qwen3.5-35B-A3B's widths cut to four layers (three Gated DeltaNet, one attention) and 64 experts (random
    NVFP4, fused as ``lynn generate`` runs it): one unrolled step of 2, 3 and 4 tokens a sequence gives its decode
    steps' logits bit for bit, at batch 1 and 8. Its kernels pick tiles by row count (the packed GEMV's tile, the MoE
    decode tiles, the KV splits, cuBLAS's kernel for the bf16 LM head): the verify picks the decode step's
    (``as_batch``). 64 experts, not 256, and the memory given back: the other test workers share the GPU."""
    config = preset("qwen3.5-35b-a3b").replace(num_hidden_layers=4, num_experts=64)
    model = random_model(config, device="cuda")                            # fused for decode, as loaded
    torch.cuda.empty_cache()
    gen = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for batch, u in ((1, 2), (1, 3), (1, 4), (8, 2), (8, 4)):
            runs = spec.unrolled_and_steps(model, batch, u, gen)
            assert torch.equal(runs[0], runs[1]), \
                f"batch {batch}, {u} tokens: largest logit difference {(runs[0] - runs[1]).abs().max().item():.3g}"
    del model, runs
    torch.cuda.empty_cache()


def test_rounds_write_only_into_their_own_pages(model, monkeypatch, k=3):
    """Drafts always right (planted), so every round keeps all three: a 15-token prompt and 14 new tokens (the
    first from the prefill, then rounds of 4, 4, 4 and a last one with one token left, whose next drafts reach
    2k - 1 = 5 positions past its start, the 17th past the prompt: the first of a page the sequence would not own
    with k spare tokens only). Every key a round writes (the verify's, the MTP catch-up's and the drafts') lands in a
    page of its own sequence, none in another's (page 0 is slot 0's first page: an unassigned block-table entry
    points there)."""
    g = torch.Generator().manual_seed(11)
    rows = [torch.randint(0, model.config.vocab_size, (15,), generator=g).tolist() for _ in range(2)]
    truth = generate(model, rows, 20).tolist()                # past the end too: the last drafts are right
    plant(monkeypatch, truth, model.config.vocab_size, lambda b, j: False)
    writes = []
    plan, draft_plan = spec.SpeculativeStep._plan_verify, spec.decode_plan

    def record_verify(step):
        plan(step)
        writes.append((step, step.batch_v.kv_slots.view(step.rows, -1).clone()))

    def record_draft(lengths, active, block_table, page, positions, kv_slots, seq_lens):
        draft_plan(lengths, active, block_table, page, positions, kv_slots, seq_lens)
        writes.append((None, kv_slots.view(-1, 1).clone()))

    monkeypatch.setattr(spec.SpeculativeStep, "_plan_verify", record_verify)
    monkeypatch.setattr(spec, "decode_plan", record_draft)
    stats = Stats()
    assert torch.equal(generate(model, rows, 14, mtp=k, stats=stats), torch.tensor(truth)[:, :15 + 14])
    assert stats.accepted == stats.drafted                 # every round kept all its drafts
    cache = next(s for s, _ in writes if s is not None).cache
    for _, slots in writes:
        for row, got in enumerate(slots.tolist()):
            pages = {s // cache.page_size for s in got if s >= 0}
            assert pages <= set(cache._blocks[row]), (row, sorted(pages), cache._blocks[row])


def test_rejection_rule_samples_as_plain_sampling_does(model, prompts, monkeypatch, n=256, k=2, new=4):
    """Model level, the rejection rule: ``n`` copies of one prompt, a seed each (T 1, top-k 2), drafts planted as
    the greedy continuation with ``q`` all on them (some kept, most not); each new token's histogram against plain
    sampling's with other seeds passes a two-sample chi-square test at p = 1e-4 (the Wilson-Hilferty quantile).
    Checked by hand at 512 copies to fail, with chi-square 6 to 25 times the threshold, for a rule that redraws a
    rejection from ``p`` instead of ``max(0, p - q)`` and for one that keeps every draft."""
    greedy = generate(model, [prompts[0]], new + k)[0].tolist()
    opts = dict(temperature=1.0, top_k=2)
    with lynn_kernels.use_reference():
        want = generate(model, [prompts[0]] * n, new, seed=list(range(n, 2 * n)), **opts)
        plant(monkeypatch, [greedy] * n, model.config.vocab_size, lambda b, j: False)
        stats = Stats()
        got = generate(model, [prompts[0]] * n, new, seed=list(range(n)), mtp=k, mtp_rule="rejection", stats=stats,
                       **opts)
    assert 0.05 < stats.accepted / stats.drafted < 0.9         # both branches of the rule ran, often
    vocab = model.config.vocab_size
    for t in range(len(prompts[0]), len(prompts[0]) + new):
        a, b = (torch.bincount(x[:, t], minlength=vocab).double() for x in (got, want))
        cells = (a + b) > 0
        chi2 = ((a - b)[cells] ** 2 / (a + b)[cells]).sum().item()
        dof = int(cells.sum()) - 1
        limit = dof * (1 - 2 / (9 * dof) + 3.719 * (2 / (9 * dof)) ** 0.5) ** 3      # chi2 quantile, p = 1e-4
        assert dof >= 1 and chi2 < limit, (t, chi2, dof, a[cells], b[cells])
