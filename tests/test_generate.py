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


def test_sample_greedy_top_k_top_p():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.9], [5.0, 0.0, 0.0, 0.0]])
    assert lynn_model.sample(logits).tolist() == [1, 0]
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([lynn_model.sample(logits, temperature=1.0, top_k=2, generator=g) for _ in range(300)])
    assert set(draws[:, 0].tolist()) == {1, 3}                  # only the two best
    probs = torch.tensor([[0.6, 0.3, 0.1]]).log()
    assert {lynn_model.sample(probs, temperature=1.0, top_p=0.5, generator=g).item() for _ in range(100)} == {0}
    probs = torch.tensor([[0.4, 0.35, 0.25]]).log()
    assert {lynn_model.sample(probs, temperature=1.0, top_p=0.7, generator=g).item() for _ in range(300)} == {0, 1}
    for bad in (dict(temperature=-1.0), dict(top_k=0), dict(top_p=0.0), dict(top_p=1.5)):
        with pytest.raises(ValueError):
            lynn_model.sample(logits, **bad)


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
    """Row 0 stops at its first token; row 1 goes on alone (the same tokens as run alone), the stream shows -1 for
    the finished row, and the statistics count real tokens only."""
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
