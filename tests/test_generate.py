"""Generation: sampling, stop ids, streams, varlen batches, the tokenizer and chat template (HF's as the oracle),
and ``lynn generate``. The model runs on the references here (the kernels are covered by test_model.py)."""

from __future__ import annotations

import json

import pytest
import torch

import lynn_kernels
import lynn_model
from lynn_kernels.cli import main

import tiny_hf

CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

#: fixtures that load an oracle package (tests/conftest.py counts the tests that use them)
ORACLE_FIXTURES = {"folder": "transformers"}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny Qwen3.5 checkpoint with a byte-level BPE tokenizer of <= 512 tokens and a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    d = tiny_hf.save("q35", tmp_path_factory.mktemp("gen") / "q35")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = ["It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in "
            "want of a wife."] * 20
    tok.train_from_iterator(text, trainer)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
         "tokenizer_class": "PreTrainedTokenizerFast"}))
    return d


@pytest.fixture(scope="module")
def model(folder):
    with lynn_kernels.use_reference():
        return lynn_model.from_pretrained(folder, device="cpu")


def _greedy(model, ids, n, **kw):
    with lynn_kernels.use_reference():
        return lynn_model.generate(model, ids, n, **kw)


def _draws(logits, n, **kw):
    """``n`` draws from one row of logits: counters 0..n-1 of one seed (each counter an independent draw)."""
    x = logits.expand(n, -1)
    return lynn_model.sample(x, counter=torch.arange(n), **kw)


def test_sample_greedy_top_k_top_p():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.9], [5.0, 0.0, 0.0, 0.0]])
    assert lynn_model.sample(logits).tolist() == [1, 0]
    assert set(_draws(logits[:1], 300, temperature=1.0, top_k=2).tolist()) == {1, 3}      # only the two best
    tie = torch.tensor([[2.0, 1.0, 1.0, 0.5, -3.0]])
    assert set(_draws(tie, 400, temperature=1.0, top_k=2).tolist()) == {0, 1, 2}          # the tie at rank 2 stays
    probs = torch.tensor([[0.6, 0.3, 0.1]]).log()
    assert set(_draws(probs, 100, temperature=1.0, top_p=0.5).tolist()) == {0}
    probs = torch.tensor([[0.4, 0.35, 0.25]]).log()
    assert set(_draws(probs, 300, temperature=1.0, top_p=0.7).tolist()) == {0, 1}
    for bad in ({"temperature": -1.0}, {"top_k": 0}, {"top_p": 0.0}, {"top_p": 1.5}, {"seed": -1}):
        with pytest.raises(ValueError):
            lynn_model.sample(logits, **bad)


def test_sample_draws_follow_the_distribution():
    """40,000 draws (one per counter) from a 5-token softmax, tempered and filtered, against the exact
    probabilities: every frequency within 4 standard errors; top-k and top-p renormalise over what they keep."""
    logits = torch.tensor([[1.0, 0.2, -0.5, 0.9, -2.0]])
    n = 40_000
    for kw, keep in (({"temperature": 1.0}, [0, 1, 2, 3, 4]), ({"temperature": 0.7}, [0, 1, 2, 3, 4]),
                     ({"temperature": 1.0, "top_k": 3}, [0, 1, 3]), ({"temperature": 1.0, "top_p": 0.6}, [0, 3])):
        z = logits[0] / kw["temperature"]
        p = torch.zeros(5)
        p[keep] = z[keep].softmax(-1)
        counts = torch.bincount(_draws(logits, n, seed=5, **kw), minlength=5).double() / n
        se = (p * (1 - p) / n).sqrt()
        assert ((counts - p).abs() <= 4 * se + 1e-12).all(), (kw, counts.tolist(), p.tolist())


def test_sample_rows_depend_on_their_own_seed_and_counter_only():
    """A row's draw is a function of its logits, seed and counter: the same in any batch, at any row."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=gen)
    rows = [lynn_model.Sampling(1.0, top_k=10, seed=s) for s in (3, 4, 5)] + \
        [lynn_model.Sampling(0.8, top_p=0.9, seed=6), lynn_model.Sampling(), lynn_model.Sampling(1.2, seed=8)]
    counter = torch.tensor([7, 7, 9, 2, 4, 11])
    full = lynn_model.sample_rows(logits, lynn_model.SamplingParams.build(rows, "cpu", 50), counter)
    for order in ([5, 0, 3], [2, 4, 1]):
        sub = lynn_model.sample_rows(logits[order], lynn_model.SamplingParams.build([rows[i] for i in order], "cpu",
                                                                                   50), counter[order])
        assert sub.tolist() == full[order].tolist()
    assert full[4] == logits[4].argmax()
    with pytest.raises(ValueError, match="no top_k"):
        lynn_model.SamplingParams.build(rows, "cpu")                # top_p alone ranks the whole vocabulary


def test_decode_step_equals_a_loop_of_model_steps(model):
    """generate's decode (a DecodeStep: static buffers, eager here) gives the tokens of a plain loop of
    ``model.step`` and ``sample`` with the same seed and counters; two prompts of different lengths, sampled."""
    rows, n, kw = [[5, 6, 7, 8], [9, 10]], 6, {"temperature": 1.3, "top_k": 20, "top_p": 0.95, "seed": 17}
    got = _greedy(model, rows, n, **kw)
    with lynn_kernels.use_reference(), torch.no_grad():
        cache = model.new_cache(max_batch=2, max_tokens=64)
        slots = [cache.add(), cache.add()]
        logits = model.step(torch.tensor(rows[0] + rows[1]), cache, slots, [4, 2])
        lens = [4, 2]
        toks = lynn_model.sample(logits, counter=torch.tensor(lens), **kw)
        want = [r + [int(t)] for r, t in zip(rows, toks)]
        for _ in range(n - 1):
            lens = [x + 1 for x in lens]
            logits = model.step(toks, cache, slots, [1, 1])
            toks = lynn_model.sample(logits, counter=torch.tensor(lens), **kw)
            for r, t in zip(want, toks):
                r.append(int(t))
    assert got[0].tolist() == want[0] and got[1, :8].tolist() == want[1]


def test_greedy_equals_top_k_1_and_seeded_sampling_repeats(model):
    ids = torch.tensor([[5, 6, 7, 8]])
    greedy = _greedy(model, ids, 6)
    assert greedy.shape == (1, 10) and greedy[:, :4].tolist() == ids.tolist()
    assert _greedy(model, ids, 6, temperature=1.0, top_k=1, seed=3).tolist() == greedy.tolist()
    a = _greedy(model, ids, 6, temperature=1.5, seed=11)
    assert _greedy(model, ids, 6, temperature=1.5, seed=11).tolist() == a.tolist()
    draws = {tuple(_greedy(model, ids, 6, temperature=1.5, seed=s)[0].tolist()) for s in range(4)}
    assert len(draws) > 1                                           # the seed matters


def test_stop_ids_stream_and_varlen_batch(model):
    ids = torch.tensor([[5, 6, 7, 8]])
    greedy = _greedy(model, ids, 8)[0, 4:].tolist()
    stop = greedy[2]
    first = greedy.index(stop)
    got = _greedy(model, ids, 8, stop_ids=[stop])
    assert got[0, 4:].tolist() == greedy[:first + 1]                 # ends with the stop token
    seen = []
    rows = [[5, 6, 7, 8], [9, 10]]
    out = _greedy(model, rows, 5, stream=lambda t: seen.append(t.tolist()))
    assert len(seen) == 5 and all(len(s) == 2 for s in seen)
    assert out.shape == (2, 9)                                        # right-padded with the last token
    assert out[0, 4:].tolist() == [s[0] for s in seen] == greedy[:5]
    alone = _greedy(model, torch.tensor([rows[1]]), 5)[0].tolist()
    assert out[1, :7].tolist() == alone and out[1, 7:].tolist() == [alone[-1]] * 2


def test_generate_rejects_bad_input(model):
    with pytest.raises(ValueError, match="int64"):
        lynn_model.generate(model, torch.zeros(1, 3, dtype=torch.int32), 2)
    with pytest.raises(ValueError, match="at least one token"):
        lynn_model.generate(model, [[1], []], 2)
    with pytest.raises(ValueError, match="token ids must lie"):
        _greedy(model, [[1, 600]], 2)


def test_chat_template_renders_as_hf_does(folder):
    from transformers import PreTrainedTokenizerFast

    ours = lynn_model.Tokenizer.from_pretrained(folder)
    hf = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), chat_template=CHAT_TEMPLATE,
                                 eos_token="<|im_end|>")
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who is Mr. Darcy?"}]
    for kw in ({}, {"enable_thinking": False}):
        want = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **kw)
        assert ours.apply_chat_template(msgs, add_generation_prompt=True, **kw) == want
    text = "a single man in possession"
    assert ours.encode(text) == hf.encode(text, add_special_tokens=False)
    assert ours.decode(ours.encode(text)) == text
    assert ours.stop_ids == [ours.token_id("<|im_end|>")]


def test_lynn_generate_streams_text_and_reports_speed(folder, model, capsys):
    tok = lynn_model.Tokenizer.from_pretrained(folder)
    prompt = "a single man"
    assert main(["generate", "--model", str(folder), "--backend", "reference", "--temperature", "0",
                 "--max-new-tokens", "6", "--ignore-eos", prompt]) == 0
    cap = capsys.readouterr()
    want = _greedy(model, torch.tensor([tok.encode(prompt)]), 6)[0, len(tok.encode(prompt)):].tolist()
    assert cap.out == prompt + tok.decode(want, skip_special_tokens=True) + "\n"
    assert "on the torch reference path" in cap.err and "prompt 3 tokens" in cap.err and "6 new tokens" in cap.err
    assert "tok/s" in cap.err and "peak" in cap.err
    assert main(["generate", "--model", str(folder / "missing"), "x"]) == 2


def test_a_stopped_sequence_leaves_the_batch(model):
    """Row 0 stops at its first token (its row idles from then on); row 1 goes on (the same tokens as run alone),
    the stream shows -1 for the finished row, and the statistics count real tokens only."""
    rows = [[5, 6, 7, 8], [9, 10]]
    first0 = _greedy(model, [rows[0]], 1)[0, -1].item()
    alone1 = _greedy(model, [rows[1]], 5)[0, 2:].tolist()
    assert first0 not in alone1
    seen, stats = [], lynn_model.Stats()
    out = _greedy(model, rows, 5, stop_ids=[first0], stream=lambda t: seen.append(t.tolist()), stats=stats)
    assert out[0].tolist() == rows[0] + [first0] * 3 and out[1, 2:].tolist() == alone1      # padded to 7
    assert seen[0] == [first0, alone1[0]] and all(s[0] == -1 for s in seen[1:])
    assert stats.new_tokens == 1 + 5 and stats.batch == 2 and stats.decode_steps == 4


def test_generate_checks_the_tensor_first(model):
    with pytest.raises(ValueError, match=r"int64 \[B, T\]"):
        lynn_model.generate(model, torch.tensor([1, 2, 3]), 2)
