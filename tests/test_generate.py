"""Generation: sampling, stop ids, streams, varlen batches, the tokenizer and chat template (HF's as the oracle),
and ``lynn generate``. The model runs on the references here (the kernels are covered by test_model.py)."""

from __future__ import annotations

import dataclasses
import json
import random
import re
import shutil
import time
import warnings
from pathlib import Path

import pytest
import tiny_hf
import torch

import lynn_kernels
import lynn_model
from lynn_cli import main
from lynn_model.loader import random_model

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
    for bad in ({"temperature": -1.0}, {"top_k": -1}, {"top_p": 0.0}, {"top_p": 1.5}, {"seed": -1}):
        with pytest.raises(ValueError):
            lynn_model.sample(logits, **bad)
    assert lynn_model.sample(logits, temperature=1.0, top_k=0, seed=4).tolist() == \
        lynn_model.sample(logits, temperature=1.0, seed=4).tolist()                          # 0: no top-k limit


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
    both = _greedy(model, torch.cat([ids, ids]), 6, temperature=1.5, seed=[11, 2])    # a seed per prompt
    assert both[0].tolist() == a[0].tolist()
    assert both[1].tolist() == _greedy(model, ids, 6, temperature=1.5, seed=2)[0].tolist()
    with pytest.raises(ValueError, match="^seed: 1 seeds for 2 prompts"):
        _greedy(model, torch.cat([ids, ids]), 2, seed=[1])
    for bad in (-1, None):
        with pytest.raises(ValueError, match=rf"^seed\[1\]: seed = {bad}: expected an int"):
            lynn_model.check_generate_args(2, seed=[1, bad])
    with pytest.raises(ValueError, match=r"^temperature = -1: "):          # named as itself beside a seed list
        lynn_model.check_generate_args(2, temperature=-1, seed=[1, 2])


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


def test_a_chunked_prefill_continues_each_prompt(model):
    from lynn_model.generate import _prefill
    """Prompts of 70, 23 and 9 tokens prefilled in calls of at most 16 tokens (the long one in five, continuing its
    cached prefix; the last piece of one packed with the next prompt where they fit): each prompt's logits equal a
    single call's to rounding (fp32), so the greedy tokens are the same."""
    g = torch.Generator().manual_seed(2)
    rows = [torch.randint(0, 400, (n,), generator=g).tolist() for n in (70, 23, 9)]
    calls = []
    step = lynn_model.Model.step

    def counted(self, tokens, cache, slots, new_lens, **kw):
        calls.append(list(new_lens))
        return step(self, tokens, cache, slots, new_lens, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lynn_model.Model, "step", counted)
        chunked = _greedy(model, rows, 6, prefill_chunk=16)
    assert calls == [[16], [16], [16], [16], [6], [16], [7, 9]]        # then the decode steps (no model.step)
    assert torch.equal(chunked, _greedy(model, rows, 6))
    with lynn_kernels.use_reference(), torch.inference_mode():
        cache, whole = model.new_cache(1, 128), model.new_cache(1, 128)
        a, b = cache.add(), whole.add()
        logits, _ = _prefill(model, cache, [a], rows[:1], 16)
        want = model.step(torch.tensor(rows[0]), whole, [b], [70])
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)


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
    assert 0 <= stats.wait_s <= stats.decode_s and 0 < stats.launch_s <= stats.decode_s
    _greedy(model, rows[1:], 3, stats=stats)                       # reused: it describes the last call alone
    assert (stats.new_tokens, stats.batch, stats.decode_steps) == (3, 1, 2)


def test_generate_checks_the_tensor_first(model):
    with pytest.raises(ValueError, match=r"int64 \[B, T\]"):
        lynn_model.generate(model, torch.tensor([1, 2, 3]), 2)


# ---------------------------------------------------------------------------------------------------------------
# hostile inputs: damaged tokenizer files, chat templates that never end, the model's context, bad arguments,
# damaged weights. Every error is a ValueError (CacheFull: a RuntimeError) whose message names what is wrong.

DEMO = Path(__file__).resolve().parents[1] / "data" / "models" / "lynn-demo"
MSGS = [{"role": "user", "content": "Hi"}]


def _config(**fields):
    """The demo tokenizer_config.json with ``fields`` changed."""
    return lambda old: json.dumps({**json.loads(old), **fields})


def _tokenizer_copy(tmp_path, **files) -> Path:
    """The demo model's tokenizer files in ``tmp_path``, with ``files`` written over them: bytes or a str, or a
    function of the demo file's bytes (``chat_template_jinja`` names chat_template.jinja)."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO / name, tmp_path / name)
    for key, new in files.items():
        f = tmp_path / (key.replace("_json", ".json").replace("_jinja", ".jinja"))
        if callable(new):
            new = new(f.read_bytes())
        f.write_bytes(new.encode() if isinstance(new, str) else new)
    return tmp_path


TOKENIZER_FILES = [          # (id, files written over the demo's, what the message says)
    ("tokenizer-truncated", {"tokenizer_json": lambda b: b[:len(b) // 2]},
     r"tokenizer\.json: not a tokenizer: not valid JSON \(.* at line \d+ column \d+\); .*truncated"),
    ("tokenizer-random-bytes", {"tokenizer_json": random.Random(0).randbytes(4096)},
     r"tokenizer\.json: not a tokenizer: not UTF-8 text"),
    ("tokenizer-empty", {"tokenizer_json": b""}, r"tokenizer\.json: not a tokenizer: not valid JSON"),
    ("tokenizer-json-not-a-tokenizer", {"tokenizer_json": '{"weights": [1, 2]}'},
     r"tokenizer\.json: not a tokenizer: expected a JSON object with a 'model' object .*found an object"),
    ("tokenizer-json-list", {"tokenizer_json": "[1, 2]"}, r"tokenizer\.json: not a tokenizer: .*found a list"),
    ("tokenizer-unknown-model", {"tokenizer_json": '{"model": {"type": "Nope"}}'},
     r"tokenizer\.json: the tokenizers library cannot read it: "),
    ("config-not-json", {"tokenizer_config_json": '{"chat_template": '},
     r"tokenizer_config\.json: not valid JSON .*truncated"),
    ("config-random-bytes", {"tokenizer_config_json": random.Random(1).randbytes(512)},
     r"tokenizer_config\.json: not UTF-8 text"),
    ("config-a-list", {"tokenizer_config_json": "[1, 2]"},
     r"tokenizer_config\.json: expected a JSON object, found a list \(\[1, 2\]\)"),
    ("config-template-a-number", {"tokenizer_config_json": _config(chat_template=7)},
     r"tokenizer_config\.json: chat_template must be a string or a list of .*found a number \(7\)"),
    ("config-template-entry-without-template", {"tokenizer_config_json": _config(chat_template=[{"name": "x"}])},
     r"tokenizer_config\.json: chat_template\[0\] must be an object with a string 'name' and a string 'template'"),
    ("config-eos-a-number", {"tokenizer_config_json": _config(eos_token=5)},
     r"tokenizer_config\.json: eos_token must be a string.*found a number \(5\)"),
    ("jinja-not-utf8", {"chat_template_jinja": b"\xff\xfe{{ messages }}"}, r"chat_template\.jinja: not UTF-8 text"),
]


@pytest.mark.parametrize("files, says", [c[1:] for c in TOKENIZER_FILES], ids=[c[0] for c in TOKENIZER_FILES])
def test_damaged_tokenizer_files_are_refused_by_name(tmp_path, files, says):
    with pytest.raises(ValueError, match=says) as err:
        lynn_model.Tokenizer.from_pretrained(_tokenizer_copy(tmp_path, **files))
    assert str(tmp_path) in str(err.value)                          # the whole path, to the file


def test_missing_tokenizer_folder_and_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nowhere: the model folder does not exist"):
        lynn_model.Tokenizer.from_pretrained(tmp_path / "nowhere")
    with pytest.raises(NotADirectoryError, match=r"config\.json: expected a model folder, found a file"):
        lynn_model.Tokenizer.from_pretrained(DEMO / "config.json")
    with pytest.raises(FileNotFoundError, match=r"no tokenizer\.json in"):
        lynn_model.Tokenizer.from_pretrained(tmp_path)


@pytest.fixture(scope="module")
def demo_tokenizer():
    return lynn_model.Tokenizer.from_pretrained(DEMO)


TEMPLATES = [                # (id, template, what the message says after "(chat_template): the chat template ")
    ("syntax-error", "{% for m in messages %}\n{{ m.content }\n{% endfor %}",
     r"does not compile: .* \(template line 2\)"),
    ("undefined-attribute", "{{ messages[0].content }}\n{{ nobody.name }}",
     r"failed \(template line 2\): UndefinedError: 'nobody' is undefined"),
    ("type-error", "{{ 'a' + 1 }}", r"failed \(template line 1\): TypeError: "),
    ("raise-exception", "{{ raise_exception('Conversation roles must alternate user/assistant') }}",
     r"refused the messages: Conversation roles must alternate user/assistant"),
    ("range-too-long", "{% for i in range(10**6 + 1) %}{% endfor %}",
     r"asks for range\(1000001\): 1,000,001 items \(the limit is 100,000\)"),
    ("range-past-maxsize", "{% for i in range(10**30) %}{% endfor %}", r"asks for range\(10+\): more than "),
    ("output-flood", "{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}",
     r"renders more than 1,048,576 characters"),
    ("string-times-1e10", "{{ 'x' * 10**10 }}", r"builds a string of 10,000,000,000 characters by '\*'"),
    ("list-of-big-strings", "{{ ['x' * 1000] * 10000 }}", r"builds a list of 10,000 items holding 10,000,000 "),
    ("power", "{{ 7 ** 123456789 }}", r"builds an integer of about [\d,]+ bits by '\*\*'"),
    ("percent-width", "{{ '%0999999999d' % 1 }}", r"asks for a width in a '%' format of 999,999,999 characters"),
    ("format-width", "{{ '{:>999999999}'.format(1) }}", r"asks for a width in str\.format of 999,999,999"),
    ("center", "{{ 'x' | center(999999999) }}", r"asks for center of 999,999,999 characters"),
    ("replace-empty", "{% set s = 'x' * 2000 %}{{ s.replace('', s) }}", r"builds a string of 4,004,000 characters "
                                                                         r"by replace"),
    ("namespace-doubling", "{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}"
                           "{% endfor %}", r"builds namespace attribute 's' of 2,097,152 characters"),
    ("macro-doubling", "{% macro f(s, n) %}{{ f(s ~ s, n - 1) if n else s|length }}{% endmacro %}{{ f('x', 60) }}",
     r"builds an argument of 2,097,152 characters"),
]


@pytest.mark.parametrize("template, says", [c[1:] for c in TEMPLATES], ids=[c[0] for c in TEMPLATES])
def test_a_chat_template_that_fails_or_overreaches_is_a_value_error_naming_its_file(demo_tokenizer, template, says):
    tok = lynn_model.Tokenizer(demo_tokenizer.tok, {**demo_tokenizer.config, "chat_template": template}, DEMO)
    with pytest.raises(ValueError, match=re.escape(f"{DEMO / 'tokenizer_config.json'} (chat_template): the chat "
                                                   f"template ") + says):
        tok.apply_chat_template(MSGS)


@pytest.mark.parametrize("template, timeout", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", None),   # the default
    ("{% set s = 'abcdefghij' * 10000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}", 0.3),
], ids=["range", "string"])
def test_a_chat_template_that_loops_without_output_stops_in_time(demo_tokenizer, template, timeout):
    """Nested loops that render nothing (10^10 turns) end at the deadline, whatever they iterate."""
    tok = lynn_model.Tokenizer(demo_tokenizer.tok, {**demo_tokenizer.config, "chat_template": template}, DEMO)
    if timeout is not None:
        tok.template_timeout_s = timeout
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"tokenizer_config\.json \(chat_template\): the chat template ran past its "
                                         r"time limit of [\d.]+ s \(template line 1\)"):
        tok.apply_chat_template(MSGS)
    assert time.monotonic() - t0 < tok.template_timeout_s + 2 <= 4                   # a few seconds at most


def test_named_chat_templates_and_none(demo_tokenizer):
    """HF's list of named templates: ``default``, or ``tool_use`` when tools are passed; a list without a default,
    and a config without a template, say so naming the file."""
    named = [{"name": "default", "template": "D{{ messages | length }}"}, {"name": "tool_use", "template": "T"}]
    tok = lynn_model.Tokenizer(demo_tokenizer.tok, {"chat_template": named}, DEMO)
    assert tok.apply_chat_template(MSGS) == "D1" and tok.apply_chat_template(MSGS, tools=[{"name": "f"}]) == "T"
    tok = lynn_model.Tokenizer(demo_tokenizer.tok, {"chat_template": [{"name": "rag", "template": "R"}]}, DEMO)
    with pytest.raises(ValueError, match=r"tokenizer_config\.json: chat_template names the templates \['rag'\]; "
                                         r"none is 'default'"):
        tok.apply_chat_template(MSGS)
    with pytest.raises(ValueError, match=r"tokenizer_config\.json: no chat_template"):
        lynn_model.Tokenizer(demo_tokenizer.tok, {}, DEMO).apply_chat_template(MSGS)
    assert demo_tokenizer.apply_chat_template(MSGS) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


BAD_ARGS = [                 # (arguments, the name the message starts with (as an argument; as a flag), expected)
    ({"max_new_tokens": -1}, "max_new_tokens", "an int >= 0"),
    ({"max_new_tokens": 2.5}, "max_new_tokens", "an int >= 0"),
    ({"max_new_tokens": True}, "max_new_tokens", "an int >= 0"),
    ({"max_tokens": 0}, "max_tokens", "an int >= 1"),
    ({"temperature": -0.5}, "temperature", "a finite number >= 0"),
    ({"temperature": float("nan")}, "temperature", "a finite number >= 0"),
    ({"temperature": float("inf")}, "temperature", "a finite number >= 0"),
    ({"temperature": "0.7"}, "temperature", "a finite number >= 0"),
    ({"top_k": -1}, "top_k", r"an int in \[1, 2\*\*63\), or 0 for no top-k limit"),
    ({"top_k": 2.0}, "top_k", "an int in"),
    ({"top_p": 0.0}, "top_p", r"a number in \(0, 1\]"),
    ({"top_p": 1.5}, "top_p", r"a number in \(0, 1\]"),
    ({"top_p": float("nan")}, "top_p", r"a number in \(0, 1\]"),
    ({"seed": -1}, "seed", r"an int in \[0, 2\*\*63\)"),
    ({"seed": 2**63}, "seed", r"an int in \[0, 2\*\*63\)"),
    ({"seed": 10**23}, "seed", r"an int in \[0, 2\*\*63\)"),
    ({"seed": 1e23}, "seed", r"an int in \[0, 2\*\*63\)"),
    ({"prefill_chunk": 0}, "prefill_chunk", "an int >= 1"),
]


@pytest.mark.parametrize("kw, name, expected", BAD_ARGS, ids=[f"{k}={v!r}" for kw, *_ in BAD_ARGS
                                                                 for k, v in kw.items()])
def test_generate_arguments_are_checked_by_name(kw, name, expected):
    """check_generate_args names the argument, what it expected and what it got; generate calls it before touching
    the model."""
    args = {"max_new_tokens": 4, **kw}
    value = repr(next(iter(kw.values())))
    with pytest.raises(ValueError, match=rf"^{name} = {re.escape(value)}: expected {expected}"):
        lynn_model.check_generate_args(**args)
    with pytest.raises(ValueError, match=rf"^{name} = "):
        lynn_model.generate(None, [[1, 2]], **args)                   # no model needed to refuse it
    lynn_model.check_generate_args(0, temperature=0.7, top_k=0, top_p=1.0, seed=2**63 - 1, max_tokens=1)


@pytest.fixture(scope="module")
def short():
    """A tiny Qwen3.5 whose context is 16 tokens."""
    config = dataclasses.replace(lynn_model.preset("tiny-qwen3.5"), max_position_embeddings=16)
    return random_model(config, weights="bf16", dtype=torch.float32, device="cpu", seed=0)


def test_the_context_bounds_the_prompt_the_new_tokens_and_the_cache(short):
    """A prompt longer than the context is refused; max_new_tokens past it is cut to fit, said once (a note in
    the stats, else a warning); the cache holds what the call needs whatever max_tokens allows, and a max_tokens
    too small for it is a CacheFull saying what to raise."""
    ten = list(range(1, 11))
    with pytest.raises(ValueError, match=r"^the prompt has 17 tokens; the model's context is 16"):
        _greedy(short, [list(range(17))], 1)
    with pytest.raises(ValueError, match=r"^prompt 1 of the batch has 17 tokens; the model's context is 16"):
        _greedy(short, [[1, 2], list(range(17))], 1)
    stats, small = lynn_model.Stats(), lynn_model.Stats()
    out = _greedy(short, [ten], 10_000_000, stats=stats)
    assert out.shape == (1, 16) and stats.new_tokens == 6
    assert stats.notes == ["max_new_tokens = 10,000,000 cut to 6: the model's context is 16 tokens and the prompt "
                           "has 10"]
    assert _greedy(short, [ten], 6, stats=small).tolist() == out.tolist() and small.notes == []
    assert stats.cache_bytes == small.cache_bytes
    _greedy(short, [ten], 6, stats=stats, max_tokens=10**12)
    assert stats.cache_bytes == small.cache_bytes
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _greedy(short, [ten], 100)
    assert [str(w.message) for w in seen] == ["max_new_tokens = 100 cut to 6: the model's context is 16 tokens and "
                                              "the prompt has 10"]
    with pytest.raises(lynn_model.CacheFull, match=r"^max_tokens = 12 is too small: the prompt's 10 tokens and "
                                                   r"max_new_tokens = 4 need a cache of 14 tokens; raise max_tokens "
                                                   r"\(--max-tokens\)"):
        _greedy(short, [ten], 4, max_tokens=12)
    assert issubclass(lynn_model.CacheFull, RuntimeError)


def test_non_finite_logits_stop_generation(short):
    """NaN weights: at the prompt (an embedding row of the prompt), or at a decode step (the final norm damaged
    once the first token is out), greedy and sampled: a NonFiniteError (a ValueError) saying where."""
    emb, norm = short.embed_tokens.clone(), short.norm.weight.clone()
    try:
        short.embed_tokens[7] = float("nan")
        with pytest.raises(lynn_model.NonFiniteError, match=r"^the logits of sequence 1 are not finite \(NaN or "
                                                            r"inf\) at the prompt \(prefill\): the model's weights "
                                                            r"or its inputs are likely damaged"):
            _greedy(short, [[1, 2, 3], [5, 7, 9]], 4)
        short.embed_tokens.copy_(emb)
        for kw in ({}, {"temperature": 1.0, "top_k": 5, "seed": 3}):
            seen = []

            def damage(tokens):
                seen.append(tokens.tolist())
                short.norm.weight.fill_(float("nan"))

            with pytest.raises(lynn_model.NonFiniteError, match=r"^the logits are not finite \(NaN or inf\) at new "
                                                                r"token 2: "):
                _greedy(short, [[1, 2, 3]], 5, stream=damage, **kw)
            assert len(seen) == 1                                   # the damaged step's token never came out
            short.norm.weight.copy_(norm)
    finally:
        short.embed_tokens.copy_(emb)
        short.norm.weight.copy_(norm)
    assert issubclass(lynn_model.NonFiniteError, ValueError)
    assert _greedy(short, [[1, 2, 3]], 3).shape == (1, 6)
