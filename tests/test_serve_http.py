"""``lynn serve``'s HTTP API as its users meet it: a real uvicorn server on loopback, driven by the official
``openai`` client, by ``curl`` and by raw httpx requests. The demo model on a CPU (fp32, the torch reference), so a
greedy request's text is what ``lynn_model.generate`` gives its prompt alone, decoded; errors answer with OpenAI's
error JSON; loading answers 503, a full queue 429; a client that goes away has its request cancelled; and 32
concurrent clients of mixed lengths (some leaving mid-stream, some refused) each get their solo text."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Callable

import httpx
import openai
import pytest
import torch
from starlette.testclient import TestClient

import lynn_kernels
import lynn_model
from lynn_cli.generate import DEMO_MODEL
from lynn_model.serve import http as serve_http
from lynn_model.serve.http import Server, create_app, serve_in_thread

CORPUS = DEMO_MODEL.parents[1] / "corpus" / "heldout.txt"
NAME = DEMO_MODEL.name                              # the model's name in the API (the folder's)
CONTEXT = 2048                                      # the demo model's max_position_embeddings
STARTUP_S = 60                                      # a server that is not healthy by then fails the test
ERROR_KEYS = {"message", "type", "param", "code"}


# -- helpers -----------------------------------------------------------------------------------------------------------

def wait_for(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.05):
    """Poll ``predicate`` until it returns something true (returned); fail naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"waited {timeout} s for {what}; last value {value!r}")
        time.sleep(interval)


def health(base: str) -> int | None:
    try:
        return httpx.get(f"{base}/health", timeout=5).status_code
    except httpx.TransportError:
        return None


@contextlib.contextmanager
def serving(server: Server):
    """``server``'s app on a real uvicorn in a thread, on a free loopback port, as ``lynn serve`` runs it: yields its
    base URL once the model is loaded, and checks after that uvicorn and the engine thread have stopped."""
    with serve_in_thread(server, timeout=STARTUP_S) as base:
        yield base
    assert not server.thread.is_alive(), "the server did not shut down within 60 s"


def metrics(base: str) -> dict[str, float]:
    """/metrics as {sample name with labels: value}."""
    r = httpx.get(f"{base}/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {name: float(value) for line in r.text.splitlines() if line and not line.startswith("#")
            for name, value in [line.rsplit(" ", 1)]}


IDLE = ("lynn_cache_slots_in_use", "lynn_cache_tokens_in_use", "lynn_queue_depth", "lynn_running_requests")


def idle(base: str) -> dict | None:
    """/metrics when no request holds a slot, a cache token, a queue place or a running place (else None)."""
    m = metrics(base)
    return m if all(m[k] == 0 for k in IDLE) else None


def check_error(r: httpx.Response, status: int, *, param: str | None = None, code: str | None = None) -> dict:
    """``r`` is OpenAI's error JSON with ``status``; its ``error`` object."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == {404: "not_found_error", 429: "rate_limit_error", 503: "service_unavailable"}.get(
        status, "invalid_request_error" if status < 500 else "server_error")
    assert err["param"] == param and err["code"] == code, err
    return err


def sse_data(lines) -> list[str]:
    """The ``data:`` payloads of a server-sent event stream's lines (blank lines between events)."""
    out = []
    for line in lines:
        if line:
            assert line.startswith("data: "), line
            out.append(line[len("data: "):])
    return out


# -- fixtures ----------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model():
    with lynn_kernels.use_reference():
        return lynn_model.from_pretrained(DEMO_MODEL, dtype=torch.float32, device="cpu")


@pytest.fixture(scope="module")
def tok():
    return lynn_model.Tokenizer.from_pretrained(DEMO_MODEL)


@pytest.fixture(scope="module")
def corpus() -> str:
    return CORPUS.read_text()[:20000]


@pytest.fixture(scope="module")
def ids(tok, corpus) -> list[int]:
    return tok.encode(corpus)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The comparison runs on one thread, as the server's engine does (a small model's ops are tiny)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@dataclass
class Live:
    base: str
    server: Server


@pytest.fixture(scope="module")
def served():
    """The demo model served with 8 rows on a real uvicorn, for the module."""
    server = Server(DEMO_MODEL, rows=8)
    with serving(server) as base:
        yield Live(base, server)


@pytest.fixture(scope="module")
def client(served):
    c = openai.OpenAI(base_url=f"{served.base}/v1", api_key="none", max_retries=0, timeout=60)
    yield c
    c.close()


_solo: dict = {}


def solo(model, prompt: list[int], n: int, **kw) -> list[int]:
    """What ``generate`` gives ``prompt`` alone (greedy unless ``kw`` says otherwise; ``stop_ids``), memoised."""
    key = (tuple(prompt), n, tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in sorted(kw.items())))
    if key not in _solo:
        with lynn_kernels.use_reference():
            out = lynn_model.generate(model, [prompt], n, temperature=kw.pop("temperature", 0.0), **kw)
        _solo[key] = out[0, len(prompt):].tolist()
    return _solo[key]


def chat_ids(tok, messages) -> list[int]:
    return tok.encode(tok.apply_chat_template(messages))


def text_of(tok, tokens: list[int], stops=()) -> str:
    """The text a client sees for ``tokens``: the stop ids dropped, special tokens skipped."""
    return tok.decode([t for t in tokens if t not in stops], skip_special_tokens=True)


def first_with(tok, tokens: list[int], stop: str) -> int:
    """The fewest leading ``tokens`` whose text holds ``stop``."""
    return next(k for k in range(1, len(tokens) + 1) if stop in tok.decode(tokens[:k], skip_special_tokens=True))


# -- the API through the openai client ---------------------------------------------------------------------------------

def test_health_models_and_metrics(served, client):
    r = httpx.get(f"{served.base}/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    check_error(httpx.get(f"{served.base}/v1/completions"), 405)           # any error is OpenAI's JSON
    check_error(httpx.get(f"{served.base}/v1/nothing"), 404)
    listed = client.models.list()
    assert [m.id for m in listed.data] == [NAME]
    assert listed.data[0].owned_by == "lynn" and listed.data[0].model_extra["max_model_len"] == CONTEXT
    text = httpx.get(f"{served.base}/metrics").text
    assert "# TYPE lynn_requests_total counter" in text and "# TYPE lynn_queue_depth gauge" in text
    assert "# TYPE lynn_time_to_first_token_seconds histogram" in text
    m = metrics(served.base)
    assert m["lynn_cache_slots"] == 8 and m["lynn_cache_tokens"] == 8 * CONTEXT
    assert m['lynn_time_to_first_token_seconds_bucket{le="+Inf"}'] == m["lynn_time_to_first_token_seconds_count"]


def test_completion_greedy_text_usage_and_stream_agree(served, client, model, tok, corpus):
    """A greedy completion (ignore_eos) is generate's solo text; streamed with the same seed its deltas join to
    the same text; stream_options.include_usage adds a last chunk with no choices and the usage."""
    prompt = corpus[1000:1200]
    ids = tok.encode(prompt)
    want = text_of(tok, solo(model, ids, 20))
    kw = dict(model=NAME, prompt=prompt, max_tokens=20, temperature=0, seed=7, extra_body={"ignore_eos": True})
    r = client.completions.create(**kw)
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == NAME
    assert len(r.choices) == 1 and r.choices[0].index == 0
    assert r.choices[0].text == want and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ids), 20, len(ids) + 20)

    chunks = list(client.completions.create(**kw, stream=True))
    assert all(c.usage is None and len(c.choices) == 1 for c in chunks)
    assert "".join(c.choices[0].text for c in chunks) == want
    assert [c.choices[0].finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert len(chunks) > 3 and len({c.id for c in chunks}) == 1

    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    *body, last = chunks
    assert last.choices == [] and last.usage.model_dump(include={"prompt_tokens", "completion_tokens",
                                                                 "total_tokens"}) == r.usage.model_dump(
        include={"prompt_tokens", "completion_tokens", "total_tokens"})
    assert "".join(c.choices[0].text for c in body) == want and body[-1].choices[0].finish_reason == "length"


def test_chat_completion_greedy_text_usage_and_stream_agree(served, client, model, tok, corpus):
    """A chat completion renders the checkpoint's chat template and stops at the EOS ids as generate does with the
    same stop ids; the stream starts with the assistant's role and its content deltas join to the same message."""
    messages = [{"role": "system", "content": "You tell stories."},
                {"role": "user", "content": corpus[3000:3150]}]
    ids = chat_ids(tok, messages)
    eos = served.server.eos
    tokens = solo(model, ids, 24, stop_ids=eos)
    want, reason = text_of(tok, tokens, eos), "stop" if tokens[-1] in eos else "length"
    kw = dict(model=NAME, messages=messages, max_completion_tokens=24, temperature=0, seed=7)
    r = client.chat.completions.create(**kw)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content == want and r.choices[0].finish_reason == reason
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        len(ids), len(tokens), len(ids) + len(tokens))

    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    *body, last = chunks
    assert body[0].object == "chat.completion.chunk" and body[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in body) == want
    assert [c.choices[0].finish_reason for c in body] == [None] * (len(body) - 1) + [reason]
    assert last.choices == [] and (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(ids), len(tokens))

    plain = list(client.chat.completions.create(**kw, stream=True))          # no usage chunk unless asked
    assert all(c.usage is None and c.choices for c in plain)
    assert "".join(c.choices[0].delta.content or "" for c in plain) == want


def test_prompt_as_token_ids_and_max_tokens_for_chat(served, client, model, tok, ids):
    """A prompt of token ids (alone or as a batch of one) is taken as it is; chat's legacy max_tokens works."""
    prompt = ids[500:540]
    want = text_of(tok, solo(model, prompt, 10))
    for p in (prompt, [prompt]):
        r = client.completions.create(model=NAME, prompt=p, max_tokens=10, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].text == want and r.usage.prompt_tokens == 40
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hello"}], max_tokens=3,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


def test_the_openai_client_raises_its_own_errors(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=NAME, prompt="Hi", n=2)
    assert err.value.status_code == 400 and err.value.body["param"] == "n"
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "Hi"}])
    assert err.value.status_code == 404 and err.value.body["code"] == "model_not_found"


# -- curl --------------------------------------------------------------------------------------------------------------

def curl(url: str, body: dict, *extra: str) -> tuple[str, int, str]:
    """POST ``body`` with curl: (response body, HTTP status, content type)."""
    out = subprocess.run(["curl", "-sS", "--max-time", "60", *extra, "-H", "Content-Type: application/json",
                          "-d", json.dumps(body), "-w", "\n%{http_code} %{content_type}", url],
                         capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr
    text, _, meta = out.stdout.rpartition("\n")
    status, _, ctype = meta.partition(" ")
    return text, int(status), ctype


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed on this machine")
def test_curl_completion_and_streamed_chat(served, model, tok, corpus):
    prompt = corpus[5000:5100]
    ids = tok.encode(prompt)
    text, status, ctype = curl(f"{served.base}/v1/completions",
                               {"model": NAME, "prompt": prompt, "max_tokens": 12, "temperature": 0,
                                "ignore_eos": True})
    assert status == 200 and ctype.startswith("application/json")
    r = json.loads(text)
    assert r["object"] == "text_completion" and r["choices"][0]["text"] == text_of(tok, solo(model, ids, 12))
    assert r["choices"][0]["finish_reason"] == "length"
    assert r["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 12, "total_tokens": len(ids) + 12}

    messages = [{"role": "user", "content": corpus[7000:7100]}]
    cids = chat_ids(tok, messages)
    text, status, ctype = curl(f"{served.base}/v1/chat/completions",
                               {"model": NAME, "messages": messages, "max_tokens": 12, "temperature": 0,
                                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}, "-N")
    assert status == 200 and ctype.startswith("text/event-stream")
    assert text.endswith("\n\n") and "\n\n\n" not in text               # events are separated by one blank line
    data = sse_data(text.splitlines())
    assert data[-1] == "[DONE]" and data.count("[DONE]") == 1
    chunks = [json.loads(d) for d in data[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == NAME for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:-1]) == text_of(
        tok, solo(model, cids, 12))
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12


# -- errors ------------------------------------------------------------------------------------------------------------

HI = [{"role": "user", "content": "Hi"}]
LONG_TEXT = slice(0, 16000)                         # corpus characters: well past 2,048 tokens


@pytest.mark.parametrize("path, body, status, param, code", [
    ("completions", {"model": NAME, "prompt": "Hi", "n": 2}, 400, "n", "unsupported_parameter"),
    ("chat/completions", {"messages": HI, "n": 2}, 400, "n", "unsupported_parameter"),
    ("completions", {"prompt": "Hi", "frobnicate": True}, 400, "frobnicate", "unsupported_parameter"),
    ("chat/completions", {"messages": HI, "functions": []}, 400, "functions", "unsupported_parameter"),
    ("completions", {"prompt": "Hi", "logprobs": 5}, 400, "logprobs", "unsupported_parameter"),
    ("completions", {"prompt": "Hi", "temperature": -1}, 400, "temperature", None),
    ("chat/completions", {"messages": HI, "temperature": "hot"}, 400, "temperature", None),
    ("completions", {"prompt": "LONG"}, 400, "prompt", "context_length_exceeded"),
    ("chat/completions", {"messages": "LONG"}, 400, "messages", "context_length_exceeded"),
    ("completions", {"prompt": [5] * (CONTEXT - 100), "max_tokens": 101}, 400, "max_tokens",
     "context_length_exceeded"),
    ("chat/completions", {"messages": HI, "max_completion_tokens": CONTEXT}, 400, "max_completion_tokens",
     "context_length_exceeded"),
    ("completions", {"model": "gpt-3.5-turbo-instruct", "prompt": "Hi"}, 404, "model", "model_not_found"),
    ("chat/completions", b'{"messages": [{"role": "user", "content": "Hi"}', 400, None, None),
    ("completions", b"", 400, None, None),
    ("chat/completions", {"model": NAME, "max_tokens": 4}, 400, "messages", None),
    ("chat/completions", {"messages": []}, 400, "messages", None),
    ("completions", {"prompt": "Hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", None),
    ("completions", {"prompt": "Hi", "stream_options": {"include_usage": True}}, 400, "stream_options", None),
])
def test_errors_answer_openai_error_json(served, corpus, path, body, status, param, code):
    if isinstance(body, dict) and "LONG" in (body.get("prompt"), body.get("messages")):
        body = dict(body, **({"prompt": corpus[LONG_TEXT]} if "prompt" in body else
                             {"messages": [{"role": "user", "content": corpus[LONG_TEXT]}]}))
    before = metrics(served.base)
    url = f"{served.base}/v1/{path}"
    r = httpx.post(url, content=body, headers={"Content-Type": "application/json"}) if isinstance(body, bytes) \
        else httpx.post(url, json=body)
    err = check_error(r, status, param=param, code=code)
    if code == "context_length_exceeded":
        assert "maximum context length is 2,048 tokens" in err["message"]
    if body == b"":
        assert err["message"].startswith("the request body is not JSON")
    after = metrics(served.base)
    key = f'lynn_http_errors_total{{status="{status}"}}'
    assert after[key] == before.get(key, 0) + 1
    assert after["lynn_requests_submitted_total"] == before["lynn_requests_submitted_total"]   # never reached it


# -- behaviour ---------------------------------------------------------------------------------------------------------

def test_stop_strings_cut_the_text_before_them(served, client, model, tok, corpus):
    prompt = corpus[9000:9200]
    tokens = solo(model, tok.encode(prompt), 32)
    full = text_of(tok, tokens)
    stop = full[12:17]
    assert len(stop) == 5 and stop.strip()
    want = full[:full.index(stop)]
    assert 0 < len(want) <= 12
    k = first_with(tok, tokens, stop)
    kw = dict(model=NAME, prompt=prompt, max_tokens=32, temperature=0, stop=[stop, "never in it: qzqzq"],
              extra_body={"ignore_eos": True})
    before = metrics(served.base)['lynn_requests_total{reason="stop"}']
    r = client.completions.create(**kw)
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == k
    *chunks, last = client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    assert "".join(c.choices[0].text for c in chunks) == want and chunks[-1].choices[0].finish_reason == "stop"
    assert all(stop not in c.choices[0].text for c in chunks) and last.usage.completion_tokens == k
    m = wait_for(lambda: idle(served.base), 10, "the stopped requests to leave the engine")
    assert m['lynn_requests_total{reason="stop"}'] == before + 2


def test_stop_token_ids_end_the_completion_after_the_id(served, client, model, tok, ids):
    prompt = ids[1500:1530]
    tokens = solo(model, prompt, 24)
    t = tokens[6]
    j = tokens.index(t)                                  # its first appearance: where the request ends
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0,
                                  extra_body={"ignore_eos": True, "stop_token_ids": [t]})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == j + 1
    assert r.choices[0].text == text_of(tok, tokens[:j])          # the stop id itself is not text
    assert r.choices[0].text == text_of(tok, solo(model, prompt, 24, stop_ids=[t]), [t])


def test_seeded_sampling_repeats(served, client, model, tok, corpus):
    """temperature 0.8 with seed 7 gives the same text every time, streamed or not, and the text generate draws with
    the same settings; another seed draws another text."""
    prompt = corpus[11000:11200]
    kw = dict(model=NAME, prompt=prompt, max_tokens=24, temperature=0.8, extra_body={"ignore_eos": True})
    texts = [client.completions.create(**kw, seed=7).choices[0].text for _ in range(2)]
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, seed=7, stream=True))
    assert texts[0] == texts[1] == streamed
    assert texts[0] == text_of(tok, solo(model, tok.encode(prompt), 24, temperature=0.8, seed=7))
    assert client.completions.create(**kw, seed=8).choices[0].text != texts[0]


def test_non_ascii_text_streams_intact(served, client, model, tok):
    """Text beyond ASCII (the em dashes the demo model continues a row of em dashes with) comes through JSON and
    SSE intact, and a stop string of it cuts there."""
    prompt = " ".join(["\u2014"] * 7)
    tokens = solo(model, tok.encode(prompt), 12)
    want = text_of(tok, tokens)
    assert "\u2014" in want
    kw = dict(model=NAME, prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    assert client.completions.create(**kw).choices[0].text == want
    assert "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True)) == want
    r = client.completions.create(**kw, stop="\u2014")
    assert r.choices[0].text == want[:want.index("\u2014")] and r.choices[0].finish_reason == "stop"


def test_a_chat_without_max_tokens_gets_the_default():
    """A chat request that names no max_tokens gets the server's default_max_tokens, not the whole context left."""
    server = Server(DEMO_MODEL, rows=1, default_max_tokens=5)
    with TestClient(create_app(server)) as c:
        wait_for(lambda: c.get("/health").status_code == 200, STARTUP_S, "the model to load")
        r = c.post("/v1/chat/completions", json={"messages": HI, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 5 and r.json()["choices"][0]["finish_reason"] == "length"


def test_503_while_the_model_loads_then_200(monkeypatch):
    """/health, the endpoints and /metrics answer 503 (code "loading") until the engine thread has loaded."""
    gate = threading.Event()
    real = lynn_model.from_pretrained

    def held(*args, **kwargs):
        if not gate.wait(STARTUP_S):
            raise TimeoutError("the test never let the load go on")
        return real(*args, **kwargs)

    monkeypatch.setattr(lynn_model, "from_pretrained", held)
    server = Server(DEMO_MODEL, rows=2)
    try:
        with TestClient(create_app(server)) as c:
            assert server.thread.is_alive() and server.state == "loading"
            check_error(c.get("/health"), 503, code="loading")
            check_error(c.post("/v1/completions", json={"model": NAME, "prompt": "Hi", "max_tokens": 2}), 503,
                        code="loading")
            check_error(c.post("/v1/chat/completions", json={"messages": HI}), 503, code="loading")
            check_error(c.get("/v1/models"), 503, code="loading")
            check_error(c.get("/metrics"), 503, code="loading")
            gate.set()
            wait_for(lambda: c.get("/health").status_code == 200, STARTUP_S, "/health to answer 200 after the load")
            r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "temperature": 0,
                                                "ignore_eos": True})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
            assert c.get("/v1/models").json()["data"][0]["id"] == NAME
            errors = [x for x in c.get("/metrics").text.splitlines() if x.startswith("lynn_http_errors_total")]
            assert errors == ['lynn_http_errors_total{status="503"} 4']   # /health's readiness polls not counted
    finally:
        gate.set()
    server.thread.join(timeout=10)
    assert not server.thread.is_alive()                  # the app's shutdown stopped the engine thread


def test_a_failed_load_answers_503_with_the_reason(monkeypatch):
    def broken(*args, **kwargs):
        raise OSError("the weights are unreadable")

    monkeypatch.setattr(lynn_model, "from_pretrained", broken)
    failures: list[str] = []
    server = Server(DEMO_MODEL, rows=1, on_failure=failures.append)
    with TestClient(create_app(server)) as c:
        wait_for(lambda: server.state != "loading", 10, "the load to fail")
        err = check_error(c.get("/health"), 503, code="load_failed")
        assert "OSError: the weights are unreadable" in err["message"] and failures == [err["message"]]
        check_error(c.post("/v1/completions", json={"prompt": "Hi"}), 503, code="load_failed")


def test_mtp_serves_the_same_text_and_counts_its_rounds(model, tok, corpus):
    """``Server(mtp=2)`` (``lynn serve --mtp 2``) on the demo model and its trained MTP head: a greedy completion's
    text, plain and streamed, is ``generate``'s solo text without ``mtp``, and /metrics counts the drafts (some
    accepted) and the verify steps (one a decode step)."""
    server = Server(DEMO_MODEL, rows=2, mtp=2)
    prompt = corpus[2000:2200]
    want = text_of(tok, solo(model, tok.encode(prompt), 12))
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    with serving(server) as base, httpx.Client(base_url=base, timeout=30) as c:
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
        data = sse_data(c.post("/v1/completions", json={**body, "stream": True}).iter_lines())
        assert "".join(json.loads(d)["choices"][0]["text"] for d in data[:-1]) == want
        m = wait_for(lambda: idle(base), 20, "the server to go idle")
    assert m["lynn_verify_steps_total"] == m["lynn_decode_steps_total"] > 0
    assert m["lynn_mtp_drafted_tokens_total"] == 2 * m["lynn_decode_rows_total"] > 0
    assert 0 < m["lynn_mtp_accepted_tokens_total"] <= m["lynn_mtp_drafted_tokens_total"]


def test_lynn_serve_mtp_on_a_model_without_an_mtp_module_fails_naming_it(capsys):
    """``lynn serve --mtp 2`` says so on its startup line; on a model without an MTP module (a random tiny preset)
    the load fails and the command ends with the engine's error."""
    from lynn_cli import main

    assert main(["serve", "--preset", "tiny-qwen3.5", "--mtp", "2", "--port", "0", "--log-level", "warning"]) == 1
    err = capsys.readouterr().err
    assert "8 rows; 2 MTP drafts a round (coupled);" in err
    assert "ValueError: mtp = 2: " in err and "has no MTP module" in err


def send(c: httpx.Client, path: str, body: dict) -> httpx.Response:
    """Send a request and return once its headers have come (the body is read as it streams)."""
    return c.send(c.build_request("POST", path, json=body), stream=True)


LONG_STREAM = {"prompt": "Once upon a time", "max_tokens": 1500, "temperature": 0, "ignore_eos": True,
               "stream": True}


def test_a_full_queue_answers_429():
    """One row and room for one waiting request: a long stream holds the row, a second request waits, a third gets
    429 (queue_full). The waiting client leaves (its place is free at once) and another takes it; when the first
    client leaves, that one runs to its end."""
    server = Server(DEMO_MODEL, rows=1, max_queue=1)
    short = {"messages": HI, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": True}
    with serving(server) as base, httpx.Client(base_url=base, timeout=30) as c, contextlib.ExitStack() as open_:
        first = send(c, "/v1/completions", LONG_STREAM)
        open_.callback(first.close)
        assert first.status_code == 200
        lines = first.iter_lines()                               # one iterator: a dropped one closes the response
        assert json.loads(sse_data([next(lines)])[0])["choices"][0]["finish_reason"] is None
        leaves = send(c, "/v1/chat/completions", short)
        open_.callback(leaves.close)
        assert leaves.status_code == 200                         # submitted: the response has begun
        m = metrics(base)
        assert (m["lynn_queue_depth"], m["lynn_running_requests"], m["lynn_cache_slots_in_use"]) == (1, 1, 1)
        err = check_error(c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}), 429, code="queue_full")
        assert "1 requests are waiting" in err["message"]
        leaves.close()                                           # gone while queued: its place is freed
        wait_for(lambda: metrics(base)["lynn_queue_depth"] == 0, 20, "the queued request to be cancelled")
        waiting = send(c, "/v1/chat/completions", short)
        open_.callback(waiting.close)
        assert waiting.status_code == 200 and metrics(base)["lynn_queue_depth"] == 1
        first.close()                                            # the client goes away: its row is freed
        data = sse_data(waiting.iter_lines())
        assert data[-1] == "[DONE]" and json.loads(data[-2])["choices"][0]["finish_reason"] == "length"
        assert "".join(json.loads(d)["choices"][0]["delta"].get("content", "") for d in data[:-1])
        m = wait_for(lambda: idle(base), 20, "the server to go idle")
        assert m['lynn_requests_total{reason="cancelled"}'] == 2 and m['lynn_requests_total{reason="length"}'] == 1
        assert m['lynn_http_errors_total{status="429"}'] == 1 and m["lynn_requests_submitted_total"] == 3
        r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_max_queue_0_serves_the_free_row_and_refuses_the_next():
    """One row and no waiting room: the first request takes the free row (it waits for nothing), the next gets
    429; once the row is free again a request is served."""
    server = Server(DEMO_MODEL, rows=1, max_queue=0)
    with serving(server) as base, httpx.Client(base_url=base, timeout=30) as c:
        first = send(c, "/v1/completions", LONG_STREAM)
        try:
            assert first.status_code == 200, first.read().decode()
            lines = first.iter_lines()
            assert json.loads(sse_data([next(lines)])[0])["choices"][0]["finish_reason"] is None
            check_error(c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}), 429, code="queue_full")
        finally:
            first.close()
        wait_for(lambda: idle(base), 20, "the row to be free")
        r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_a_burst_is_not_refused_while_rows_are_free():
    """Eight rows, max_queue=1, two requests that arrive while the engine thread is busy (held here until both are
    in its inbox, as a long prefill holds it): both fit in free rows, so neither gets 429 though both are queued
    for a moment."""
    server = Server(DEMO_MODEL, rows=8, max_queue=1)
    with serving(server) as base:
        gate = threading.Event()
        server.call(lambda: gate.wait(STARTUP_S))
        wait_for(lambda: server._inbox.qsize() == 0, 10, "the engine thread to take the held command")
        out: dict[int, httpx.Response] = {}

        def post(k):
            out[k] = httpx.post(f"{base}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)

        threads = [threading.Thread(target=post, args=(k,)) for k in range(2)]
        try:
            for t in threads:
                t.start()
            wait_for(lambda: server._inbox.qsize() == 2, 10, "both requests to reach the engine thread's inbox")
        finally:
            gate.set()
            for t in threads:
                t.join(timeout=30)
        assert sorted(r.status_code for r in out.values()) == [200, 200], [r.text for r in out.values()]


def test_a_client_that_leaves_mid_stream_is_cancelled(served):
    before = metrics(served.base)
    with httpx.Client(base_url=served.base, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json=LONG_STREAM) as r:
            assert r.status_code == 200
            got = []
            for line in r.iter_lines():                         # lazily: the stream has 1,500 tokens
                got += sse_data([line])
                if len(got) == 2:
                    break
    assert all(json.loads(d)["choices"][0]["finish_reason"] is None for d in got)
    cancelled = 'lynn_requests_total{reason="cancelled"}'
    m = wait_for(lambda: (m := idle(served.base)) and m[cancelled] == before[cancelled] + 1 and m, 20,
                 "the abandoned stream to be cancelled and its slot freed")
    assert m["lynn_generation_tokens_total"] - before["lynn_generation_tokens_total"] < 1000   # not run to 1,500
    assert m["lynn_requests_submitted_total"] == before["lynn_requests_submitted_total"] + 1


def test_a_client_that_gives_up_on_a_plain_request_is_cancelled(served):
    """Not streamed: the client times out after 0.5 s waiting for a 200-token completion (about 2.5 s here) and
    closes the connection; the server notices (it polls every 0.25 s) and cancels the request."""
    before = metrics(served.base)
    body = {key: v for key, v in LONG_STREAM.items() if key != "stream"} | {"max_tokens": 200}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{served.base}/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.5))
    m = wait_for(lambda: idle(served.base), 30, "the abandoned request to leave the engine")
    made = m["lynn_generation_tokens_total"] - before["lynn_generation_tokens_total"]
    cancelled = 'lynn_requests_total{reason="cancelled"}'
    assert (m[cancelled] - before[cancelled], made < 200) == (1, True), f"ran on to make {made:.0f} tokens"


def test_usage_of_a_stop_string_counts_only_the_tokens_up_to_it(served, client, model, tok, corpus, monkeypatch):
    """The same request as test_stop_strings_..., while the event loop is slow to act on the stop (as under load:
    here it waits until the engine has made 3 more tokens before the cancel goes out). The usage still counts the k
    tokens up to the one that completed the stop string, not those the engine made before the cancel reached it."""
    prompt = corpus[9000:9200]
    tokens = solo(model, tok.encode(prompt), 32)
    full = text_of(tok, tokens)
    stop = full[12:17]
    k = first_with(tok, tokens, stop)
    engine = served.server.engine
    real = serve_http.Detokenizer.add

    def slow_loop(self, token, final=False):
        out = real(self, token, final)
        if self.stopped:
            made = engine.counters.generated_tokens
            wait_for(lambda: engine.counters.generated_tokens >= made + 3, 10, "the engine to make 3 more tokens")
        return out

    monkeypatch.setattr(serve_http.Detokenizer, "add", slow_loop)
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=32, temperature=0, stop=stop,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == full[:full.index(stop)] and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == k


# -- load --------------------------------------------------------------------------------------------------------------

@dataclass
class Client:
    """One client of the load test: what it sends and what it should get."""

    path: str
    body: dict
    want: str | None = None          # the text (a request that should run to its end)
    prompt_tokens: int = 0
    leaves: bool = False             # goes away after 2 chunks of text
    status: int = 200
    param: str | None = None
    code: str | None = None
    got: object = None


async def run_client(c: httpx.AsyncClient, who: Client) -> None:
    async with c.stream("POST", who.path, json=who.body) as r:
        if r.status_code != 200:
            await r.aread()
            who.got = r
            return
        texts, last = [], None
        async for line in r.aiter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            if line == "data: [DONE]":
                last = "[DONE]"
                continue
            assert last is None, "data after [DONE]"
            chunk = json.loads(line[6:])
            if chunk["choices"]:
                choice = chunk["choices"][0]
                text = choice["text"] if "text" in choice else choice["delta"].get("content", "")
                if text:
                    texts.append(text)
                if choice["finish_reason"] is not None:
                    who.got = {"finish_reason": choice["finish_reason"]}
            else:
                who.got["usage"] = chunk["usage"]
            if who.leaves and len(texts) == 2:
                who.got = texts
                return                                    # leaving the block closes the connection mid-stream
        who.got["text"], who.got["done"] = "".join(texts), last


def test_32_concurrent_streaming_clients(served, model, tok, ids):
    """32 streams at once on 8 rows: 18 run to their end (prompts of 3 to 600 tokens, 4 of them chat), 8 leave after
    two chunks, 3 have prompts past the context and 3 bad parameters (400). Every stream that ran gets its solo text
    and usage, the 8 that left got the start of theirs; the server answers afterwards and its cache, queue and rows
    are empty."""
    t0 = time.monotonic()
    refs: list[tuple[Client, list[int], int]] = []
    lengths = [3, 5, 9, 17, 30, 48, 64, 90, 128, 160, 200, 256, 300, 360, 420, 480, 550, 600]
    news = [8, 24, 12, 16, 20, 9, 24, 11, 14, 8, 18, 22, 10, 13, 24, 15, 8, 17]
    clients = []
    for i, (n, new) in enumerate(zip(lengths, news)):
        prompt = ids[97 * i:97 * i + n]
        if i % 5 == 2:                                    # 4 chat requests: the prompt as the user's text
            messages = [{"role": "user", "content": tok.decode(prompt)}]
            body = {"messages": messages}
            prompt = chat_ids(tok, messages)
        else:
            body = {"prompt": prompt}
        clients.append(Client("/v1/chat/completions" if "messages" in body else "/v1/completions",
                              {**body, "max_tokens": new, "temperature": 0, "ignore_eos": True, "stream": True,
                               "stream_options": {"include_usage": True}}, prompt_tokens=len(prompt)))
        refs.append((clients[-1], prompt, new))
    for i, n in enumerate([3, 40, 150, 7, 333, 512, 90, 20]):
        prompt = ids[3000 + 61 * i:3000 + 61 * i + n]
        clients.append(Client("/v1/completions", {"prompt": prompt, "max_tokens": 64, "temperature": 0,
                                                  "ignore_eos": True, "stream": True}, leaves=True))
        refs.append((clients[-1], prompt, 6))                  # its first 2 chunks: the start of 6 tokens' text
    too_long = "context_length_exceeded"
    for body, param, code in (({"prompt": ids[:CONTEXT + 50]}, "prompt", too_long),
                              ({"prompt": ids[:CONTEXT]}, "prompt", too_long),
                              ({"prompt": ids[:CONTEXT - 8], "max_tokens": 9}, "max_tokens", too_long),
                              ({"prompt": ids[:10], "temperature": -0.5}, "temperature", None),
                              ({"prompt": ids[:10], "n": 3}, "n", "unsupported_parameter"),
                              ({"prompt": ids[:10], "top_p": 0}, "top_p", None)):
        clients.append(Client("/v1/completions", {**body, "stream": True}, status=400, param=param, code=code))
    order = [clients[(7 * k) % len(clients)] for k in range(len(clients))]   # interleave the kinds
    assert len(clients) == 32 and len({id(c) for c in order}) == 32
    before = wait_for(lambda: idle(served.base), 30, "the server to be idle before the load")

    def references() -> float:
        for who, prompt, n in refs:
            who.want = text_of(tok, solo(model, prompt, n))
        return time.monotonic() - t0

    async def main():
        async with httpx.AsyncClient(base_url=served.base, timeout=60,
                                     limits=httpx.Limits(max_connections=64)) as c:
            await asyncio.wait_for(asyncio.gather(*(run_client(c, who) for who in order)), timeout=50)

    t_solo = references()
    asyncio.run(main())
    t_load = time.monotonic() - t0 - t_solo
    for who in clients:
        if who.status != 200:
            check_error(who.got, 400, param=who.param, code=who.code)
        elif who.leaves:
            assert isinstance(who.got, list) and len(who.got) == 2 and who.want.startswith("".join(who.got)), (
                who.got, who.want)
        else:
            assert who.got["done"] == "[DONE]" and who.got["finish_reason"] == "length"
            assert who.got["text"] == who.want, (who.body.get("prompt", who.body.get("messages")), who.got)
            new = who.body["max_tokens"]
            assert who.got["usage"] == {"prompt_tokens": who.prompt_tokens, "completion_tokens": new,
                                        "total_tokens": who.prompt_tokens + new}

    m = wait_for(lambda: idle(served.base), 20, "the cache, queue and rows to empty after the load")
    delta = {k: m[k] - before.get(k, 0) for k in m}
    assert delta["lynn_requests_submitted_total"] == 26 and delta['lynn_http_errors_total{status="400"}'] == 6
    assert delta['lynn_requests_total{reason="length"}'] == 18 and delta['lynn_requests_total{reason="cancelled"}'] == 8
    assert delta["lynn_time_to_first_token_seconds_count"] == 26 and delta["lynn_decode_rows_total"] > 2 * delta[
        "lynn_decode_steps_total"]                       # the streams were batched
    prompt = ids[4000:4033]
    r = httpx.post(f"{served.base}/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0,
                                                          "ignore_eos": True}, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == text_of(tok, solo(model, prompt, 6))
    assert wait_for(lambda: idle(served.base), 10, "the server to go idle again")
    elapsed = time.monotonic() - t0
    print(f"\n[load: solo references {t_solo:.1f} s, 32 clients {t_load:.1f} s, all {elapsed:.1f} s]")
    assert elapsed < 60, f"the load test took {elapsed:.1f} s"


@pytest.mark.parametrize("stops", [[], ["ö 你"], ["🙂"], ["nowhere"]])
def test_the_detokenizer_streams_split_characters_whole_and_cuts_at_a_stop(stops):
    """Characters the demo tokenizer splits over several byte tokens (CJK, an emoji) come out whole, never as
    U+FFFD; the pieces join to the whole decode, cut before the first stop string."""
    from lynn_model.serve.http import Detokenizer

    tok = lynn_model.Tokenizer.from_pretrained(DEMO_MODEL)
    text = "Grüße — ö 你好 🙂 and the end."
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([t]) for t in ids)                  # some tokens are parts of a character
    d, pieces = Detokenizer(tok, stops, set()), []
    for t in ids:
        pieces.append(d.add(t))
        if d.stopped:
            break
    if not d.stopped:
        pieces.append(d.add(None, final=True))
    assert not any("\ufffd" in p for p in pieces)
    cut = min([text.find(s) for s in stops if s in text], default=len(text))
    assert "".join(pieces) == text[:cut] and d.stopped == (cut < len(text))


def test_a_submit_cancelled_while_it_waits_for_the_engine_thread_leaves_it_running(served):
    """A handler cancelled while its submit waits in the engine thread's inbox (a shutdown, a timeout wrapper): the
    command is skipped or its request cancelled, and the engine thread lives on and serves the next request."""
    server = served.server
    gate = threading.Event()
    server.call(lambda: gate.wait(STARTUP_S))
    wait_for(lambda: server._inbox.qsize() == 0, 10, "the engine thread to take the held command")
    loop = asyncio.new_event_loop()
    try:
        async def cancelled_submit():
            task = asyncio.ensure_future(server.submit([5, 6, 7], 50, {"temperature": 0.0}))
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        loop.run_until_complete(cancelled_submit())
    finally:
        gate.set()
        loop.close()
    wait_for(lambda: idle(served.base), 20, "the engine to be idle")
    assert server.thread.is_alive() and not server._jobs
    r = httpx.post(f"{served.base}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("field, value", [("stop", {}), ("stop", 0), ("stop_token_ids", 0), ("n", True),
                                          ("echo", 0), ("user", 5), ("logprobs", 0),
                                          ("stream_options", {"include_usage": "yes"})])
def test_values_that_only_look_neutral_are_refused(served, field, value):
    body = {"prompt": "Hi", "max_tokens": 2, field: value} | ({"stream": True} if field == "stream_options" else {})
    r = httpx.post(f"{served.base}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_every_chunk_of_a_stream_with_include_usage_carries_usage_null_until_the_last(served):
    body = {"prompt": "Hi", "max_tokens": 3, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{served.base}/v1/completions", json=body, timeout=30) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert all("usage" in e for e in events) and all(e["usage"] is None for e in events[:-1])
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 3
