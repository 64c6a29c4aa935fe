"""``lynn serve``'s HTTP layer: an OpenAI-compatible API (FastAPI on uvicorn) over one :class:`~.engine.Engine`.

Two threads: the server's event loop answers HTTP, and one engine thread owns the model, the cache and the engine
(none of them is thread-safe). The loop hands the engine thread commands (submit, cancel, read the metrics) through a
queue; the engine thread steps while any request is queued or running, sleeps on the queue otherwise, and passes
each new token back to the loop (``call_soon_threadsafe``), where the request's handler turns tokens into text and
the text into a response or a stream of server-sent events.

* ``POST /v1/completions``, ``POST /v1/chat/completions`` (the checkpoint's chat template): OpenAI's request and
  response JSON, streaming (``"stream": true``, chunks as OpenAI sends them, then ``data: [DONE]``) or not;
  ``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop`` (strings), ``stop_token_ids`` (ids),
  ``ignore_eos``, ``stream_options.include_usage``. A parameter the engine cannot honour (``n`` > 1, ``logprobs``,
  penalties, tools, ...) or does not know is refused with OpenAI's error JSON (400), never ignored.
* ``GET /v1/models``, ``GET /health`` (503 while the model loads), ``GET /metrics`` (Prometheus text).
* A prompt that cannot fit the context gets 400; a full queue 429; a client that goes away has its request
  cancelled, and its cache slot is free before the engine's next step.

Example::

    server = Server("data/models/lynn-demo")
    uvicorn.run(create_app(server), host="127.0.0.1", port=8000)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import queue
import threading
import time
import traceback
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import lynn_kernels

from ..generate import Tokenizer
from .engine import FINISH_REASONS, Engine, Refused, Request

#: The buckets (seconds) of the latency histograms in ``/metrics``.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

_SAMPLING = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "stream",
             "stream_options", "ignore_eos", "user", "n"}
#: parameters an OpenAI client may send that change nothing at this value, and are refused at any other
_NEUTRAL = {"n": (None, 1), "logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (False,),
            "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "best_of": (None, 1), "logit_bias": (None, {}),
            "suffix": (None, ""), "tools": (None, []), "tool_choice": (None, "none"), "parallel_tool_calls": (None,),
            "response_format": (None, {"type": "text"}), "stream_options": (None,)}
COMPLETION_FIELDS = _SAMPLING | {"prompt", "logprobs", "echo", "presence_penalty", "frequency_penalty", "best_of",
                                 "logit_bias", "suffix"}
CHAT_FIELDS = _SAMPLING | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "presence_penalty",
                           "frequency_penalty", "logit_bias", "tools", "tool_choice", "parallel_tool_calls",
                           "response_format"}


class APIError(Exception):
    """An error answered as OpenAI's JSON: ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or {404: "not_found_error", 429: "rate_limit_error", 503: "service_unavailable"}.get(
            status, "invalid_request_error" if 400 <= status < 500 else "server_error")

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status)


# -- metrics -----------------------------------------------------------------------------------------------------------

@dataclass
class Histogram:
    """A Prometheus histogram: cumulative bucket counts, the sum and the count."""

    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    total: float = 0.0
    n: int = 0

    def observe(self, x: float) -> None:
        i = next((i for i, b in enumerate(self.buckets) if x <= b), len(self.buckets))
        self.counts[i] += 1
        self.total += x
        self.n += 1

    def lines(self, name: str) -> list[str]:
        out, run = [], 0
        for b, c in zip((*self.buckets, math.inf), self.counts):
            run += c
            out.append(f'{name}_bucket{{le="{"+Inf" if b == math.inf else b}"}} {run}')
        return out + [f"{name}_sum {self.total:.6f}", f"{name}_count {self.n}"]


#: ``/metrics``'s scalar series: (name, kind, help, :meth:`Engine.metrics` key).
_SCALARS = (
    ("lynn_requests_submitted_total", "counter", "Requests the engine accepted.", "requests_submitted"),
    ("lynn_requests_refused_total", "counter", "Requests the engine refused: more than its cache holds (a prompt past "
     "the context is refused before, as an HTTP 400).", "requests_refused"),
    ("lynn_prompt_tokens_total", "counter", "Prompt tokens prefilled.", "prompt_tokens"),
    ("lynn_generation_tokens_total", "counter", "Tokens generated.", "generated_tokens"),
    ("lynn_decode_steps_total", "counter", "Decode steps run.", "decode_steps"),
    ("lynn_decode_rows_total", "counter", "Requests summed over decode steps (mean batch: rows / steps).",
     "decode_rows"),
    ("lynn_mtp_drafted_tokens_total", "counter", "MTP drafts verified (--mtp; tokens per round: 1 + K * accepted / "
     "drafted).", "mtp_drafted"),
    ("lynn_mtp_accepted_tokens_total", "counter", "MTP drafts the model kept.", "mtp_accepted"),
    ("lynn_verify_steps_total", "counter", "Speculative verify steps run (--mtp; each is an engine step's decode "
     "step).", "verify_steps"),
    ("lynn_queue_depth", "gauge", "Requests waiting for a cache slot.", "queue_depth"),
    ("lynn_running_requests", "gauge", "Requests admitted (prefilling or decoding).", "running"),
    ("lynn_cache_slots_in_use", "gauge", "Cache slots held by requests.", "slots_in_use"),
    ("lynn_cache_slots", "gauge", "Cache slots (the widest decode batch).", "slots"),
    ("lynn_cache_tokens_in_use", "gauge", "Cache tokens reserved by requests.", "cache_tokens_in_use"),
    ("lynn_cache_tokens", "gauge", "Cache tokens in all.", "cache_tokens"),
)


def prometheus_text(m: dict, ttft: Histogram, itl: Histogram, http: dict) -> str:
    """The engine's gauges and counters (:meth:`Engine.metrics`), the latency histograms and the HTTP errors."""
    lines: list[str] = []

    def metric(name, kind, help_, samples):
        lines.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}", *samples])

    metric("lynn_requests_total", "counter", "Requests that ended, by finish reason.",
           [f'lynn_requests_total{{reason="{r}"}} {m["requests_" + r]}' for r in FINISH_REASONS])
    metric("lynn_http_errors_total", "counter", "Error responses, by HTTP status.",
           [f'lynn_http_errors_total{{status="{s}"}} {n}' for s, n in sorted(http.items())])
    for name, kind, help_, key in _SCALARS:
        metric(name, kind, help_, [f"{name} {m[key]}"])
    metric("lynn_cache_usage_ratio", "gauge", "Share of the cache's tokens reserved.",
           [f"lynn_cache_usage_ratio {m['cache_tokens_in_use'] / max(1, m['cache_tokens']):.6f}"])
    metric("lynn_time_to_first_token_seconds", "histogram", "From the request's arrival at the HTTP layer to its "
           "first token.", ttft.lines("lynn_time_to_first_token_seconds"))
    metric("lynn_inter_token_latency_seconds", "histogram", "Between consecutive tokens of a request.",
           itl.lines("lynn_inter_token_latency_seconds"))
    return "\n".join(lines) + "\n"


# -- the engine thread -------------------------------------------------------------------------------------------------

@dataclass(eq=False)
class Job:
    """One HTTP request's view of its engine request: the tokens arrive on ``events`` in the server's loop."""

    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    request: Request | None = None


class Server:
    """The model, its tokenizer and an :class:`Engine`, loaded in a thread of their own and stepped there.

    Args:
        model: a HF model folder (``lynn_model.from_pretrained``); or a loaded :class:`~lynn_model.Model`
            (a random-weight preset, say), served as it is, with no tokenizer: its prompts are token ids, its text
            the ids written ``<id>``, and chat requests are refused.
        weights, dtype: as ``from_pretrained``; ``dtype`` None: float32 on a CPU (there a batch is not bit-invariant
            in bf16: engine.py), the checkpoint's on a GPU.
        backend: "auto" (the compiled kernels on a GPU, fused as ``lynn generate`` runs them; the torch reference on
            a CPU), "kernels" or "reference".
        rows, max_tokens, prefill_tokens, mtp, mtp_rule: the engine's (:class:`Engine`): ``mtp`` drafts of the
            checkpoint's MTP module per speculative round (0: off).
        max_queue: requests waiting for a slot (beyond the free slots the next step admits into) after which a new
            one gets 429.
        default_max_tokens: a chat request's ``max_tokens`` when it gives none (at most the context left): the
            engine reserves a request's whole length in the cache when it admits it.
        threads: torch's CPU threads in the engine thread (0: torch's default).
    """

    def __init__(self, model, *, weights: str = "auto", dtype: torch.dtype | None = None, backend: str = "auto",
                 rows: int = 8, max_tokens: int | None = None, prefill_tokens: int = 512, max_queue: int = 64,
                 threads: int = 1, name: str | None = None, on_failure: Callable[[str], None] | None = None,
                 default_max_tokens: int = 1024, mtp: int = 0, mtp_rule: str = "coupled"):
        self.model = None if isinstance(model, (str, Path)) else model           # built by the caller, or loaded here
        self.model_dir = Path(model) if self.model is None else None
        self.name = name or (self.model_dir.name if self.model is None else self.model.config.family)
        self.weights, self.dtype, self.backend = weights, dtype, backend
        self.rows, self.max_tokens, self.prefill_tokens = rows, max_tokens, prefill_tokens
        self.mtp, self.mtp_rule = mtp, mtp_rule
        self.max_queue, self.threads, self.on_failure = max_queue, threads, on_failure
        self.default_max_tokens = default_max_tokens
        self.state, self.error = "loading", None            # loading -> ready | failed
        self.created = int(time.time())
        self.engine: Engine | None = None
        self.tokenizer: Tokenizer | IdTokenizer | None = None
        self.eos: list[int] = []
        self.context = 0
        self.ttft, self.itl, self.http_errors = Histogram(), Histogram(), {}
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._jobs: dict[int, Job] = {}
        self._stop = False
        self.thread = threading.Thread(target=self._main, name="lynn-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop = True
        self._inbox.put(lambda: None)

    # -- the engine thread: load, then step while busy -------------------------------------------------------------
    def _main(self) -> None:
        import lynn_model

        on_gpu = torch.cuda.is_available()
        backend = self.backend if self.backend != "auto" else ("kernels" if on_gpu else "reference")
        if self.threads and not on_gpu:
            torch.set_num_threads(self.threads)
        with lynn_kernels.use_reference(backend == "reference"):
            try:
                if self.model is None:
                    dtype = self.dtype if self.dtype is not None else (None if on_gpu else torch.float32)
                    model = lynn_model.from_pretrained(self.model_dir, weights=self.weights, dtype=dtype,
                                                       fuse=backend == "kernels" and on_gpu)
                    self.tokenizer = Tokenizer.from_pretrained(self.model_dir)
                else:
                    model, self.tokenizer = self.model, IdTokenizer()
                self.eos = sorted(set(self.tokenizer.stop_ids) | set(model.config.eos_token_ids))
                self.context = model.config.max_position_embeddings
                self.engine = Engine(model, rows=self.rows, max_tokens=self.max_tokens,
                                     prefill_tokens=self.prefill_tokens, mtp=self.mtp, mtp_rule=self.mtp_rule)
            except Exception as err:                        # shown by /health and the command, not a traceback page
                what = self.model_dir or f"the {self.name} model"
                self.state, self.error = "failed", f"loading {what} failed: {type(err).__name__}: {err}"
                if self.on_failure is not None:
                    self.on_failure(self.error)
                return
            self.state = "ready"
            self._loop()

    def _loop(self) -> None:
        engine = self.engine
        while not self._stop:
            try:
                cmd = self._inbox.get(block=not engine.busy)
            except queue.Empty:
                cmd = None
            while cmd is not None:
                try:
                    cmd()
                except Exception:                           # a command never ends the thread (call() hands errors on)
                    traceback.print_exc()
                try:
                    cmd = self._inbox.get_nowait()
                except queue.Empty:
                    cmd = None
            if engine.busy:
                try:
                    engine.step()
                except Exception:                           # the engine ended the step's requests with "error"
                    traceback.print_exc()
                self._settle()

    def _settle(self) -> None:
        """Tell the loop about every request that finished (its last event)."""
        for rid, job in list(self._jobs.items()):
            r = job.request
            if r.done:
                del self._jobs[rid]
                if r.time_to_first_token is not None:
                    self.ttft.observe(r.time_to_first_token)
                for gap in r.inter_token_latencies:
                    self.itl.observe(gap)
                job.loop.call_soon_threadsafe(job.events.put_nowait, ("done", r.finish_reason, r.error))

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` in the engine thread; a future of its result."""
        fut: Future = Future()

        def run():
            if not fut.set_running_or_notify_cancel():      # its caller went away before it ran
                return
            try:
                fut.set_result(fn())
            except BaseException as err:                    # handed to the caller
                fut.set_exception(err)
        self._inbox.put(run)
        return fut

    # -- what the handlers call (from the loop) ---------------------------------------------------------------------
    async def submit(self, prompt: list[int], max_new_tokens: int, params: dict, arrived: float | None = None) -> Job:
        loop = asyncio.get_running_loop()
        job = Job(loop, asyncio.Queue())

        def on_token(r: Request, token: int) -> None:
            loop.call_soon_threadsafe(job.events.put_nowait, ("token", token))

        def go() -> Job:
            free = self.engine.rows - sum(self.engine.cache.active)    # slots the next step admits into
            if self.engine.waiting - free >= self.max_queue:
                raise APIError(429, f"the server is full: {self.max_queue} requests are waiting for a cache slot; "
                                    "try again shortly", code="queue_full")
            job.request = self.engine.submit(prompt, max_new_tokens, on_token=on_token, arrived=arrived, **params)
            self._jobs[job.request.id] = job
            return job
        try:
            return await asyncio.wrap_future(self.call(go))
        except asyncio.CancelledError:                      # the handler was cancelled: so is what go() submitted
            self.call(lambda: job.request is not None and (self.engine.cancel(job.request), self._settle()))
            raise

    def cancel(self, job: Job, reason: str = "cancelled") -> None:
        """End ``job``'s request at the engine's next command ("stop": a stop string ended it)."""
        if job.request is not None:
            self.call(lambda: (self.engine.cancel(job.request, reason), self._settle()))

    async def metrics_text(self) -> str:
        """``/metrics``, put together in the engine thread (which owns the counters and histograms)."""
        http = dict(self.http_errors)
        return await asyncio.wrap_future(self.call(lambda: prometheus_text(self.engine.metrics(), self.ttft, self.itl,
                                                                            http)))


def preset_model(name: str, *, weights: str = "nvfp4", dtype: torch.dtype | None = None, backend: str = "auto",
                 seed: int = 0):
    """A random-weight model of preset ``name`` as ``lynn serve --preset`` serves it: ``dtype`` None is bf16 on a GPU,
    float32 on a CPU; ``backend`` as :class:`Server`'s, the kernels' model fused as ``lynn generate`` runs it. A
    ``KeyError`` names the presets."""
    from ..config import preset
    from ..loader import random_model

    cfg = preset(name)
    on_gpu = torch.cuda.is_available()
    reference = backend == "reference" or (backend == "auto" and not on_gpu)
    with lynn_kernels.use_reference(reference):
        model = random_model(cfg, weights=weights, device="cuda" if on_gpu else "cpu", seed=seed,
                             dtype=dtype or (torch.bfloat16 if on_gpu else torch.float32), fuse=not reference)
    return model


@contextlib.contextmanager
def serve_in_thread(server: Server, *, host: str = "127.0.0.1", port: int = 0, timeout: float = 600.0,
                    log_level: str = "warning"):
    """``server``'s app on uvicorn in a background thread (``port`` 0: a free one, as the system picks it); yields
    the base URL once the model is loaded, and stops uvicorn (and with it the engine thread) after. A failed load, a
    uvicorn that exits, or no model within ``timeout`` seconds raises a ``RuntimeError`` saying which."""
    import uvicorn

    http = uvicorn.Server(uvicorn.Config(create_app(server), host=host, port=port, log_level=log_level,
                                         timeout_graceful_shutdown=5))
    thread = threading.Thread(target=http.run, name="lynn-uvicorn", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + timeout
        while not (http.started and server.state == "ready"):
            if server.state == "failed":
                raise RuntimeError(server.error)
            if not thread.is_alive():
                raise RuntimeError(f"uvicorn on {host}:{port} exited before it served (server {server.state!r})")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server was not ready within {timeout:.0f} s (server {server.state!r})")
            time.sleep(0.02)
        yield f"http://{host}:{http.servers[0].sockets[0].getsockname()[1]}"
    finally:
        http.should_exit = True
        thread.join(timeout=60)
        server.thread.join(timeout=60)


# -- requests ----------------------------------------------------------------------------------------------------------

def _number(body: dict, key: str, default, lo: float, hi: float, *, integer: bool = False, lo_open=False):
    v = body.get(key, default)
    if v is None:
        return default
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok or not (lo < v if lo_open else lo <= v) or v > hi:
        kind = "an integer" if integer else "a number"
        bounds = f"{'(' if lo_open else '['}{lo}, {hi}]"
        raise APIError(400, f"'{key}' must be {kind} in {bounds}, got {v!r}", param=key)
    return v


@dataclass
class Ask:
    """A parsed completion or chat request."""

    prompt: list[int]
    max_tokens: int
    params: dict                     # Engine.submit's sampling and stop ids
    stop: list[str]
    stream: bool
    usage_in_stream: bool


def parse(server: Server, body: Any, chat: bool) -> Ask:
    """Check ``body`` against what the engine can do; the prompt as token ids. Raises :class:`APIError`."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    allowed = CHAT_FIELDS if chat else COMPLETION_FIELDS
    for key in body:
        if key not in allowed:
            raise APIError(400, f"unsupported parameter '{key}'", param=key, code="unsupported_parameter")
    for key, ok in _NEUTRAL.items():
        if key == "logprobs" and not chat:
            ok = (None,)                                    # on /v1/completions, 0 asks for the chosen token's
        if key in body and key != "stream_options" and not any(type(body[key]) is type(v) and body[key] == v
                                                                 for v in ok):
            raise APIError(400, f"'{key}' = {body[key]!r} is not supported by this server (only {ok[-1]!r})",
                           param=key, code="unsupported_parameter")
    model = body.get("model")
    if model is not None and model != server.name:
        raise APIError(404, f"the model '{model}' does not exist; this server serves '{server.name}'", param="model",
                       code="model_not_found")
    tok = server.tokenizer
    if chat and isinstance(tok, IdTokenizer):
        raise APIError(400, "this model is served without a tokenizer (no chat template): send 'prompt' as a list "
                            "of token ids to /v1/completions", param="messages")
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise APIError(400, "'messages' must be a non-empty list of {'role': str, 'content': str}",
                           param="messages")
        try:
            ids = tok.encode(tok.apply_chat_template(messages))
        except (ValueError, TypeError) as err:
            raise APIError(400, f"the chat template could not render 'messages': {err}", param="messages") from None
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]                              # a batch of one
        if isinstance(prompt, str) and isinstance(tok, IdTokenizer):
            raise APIError(400, "this model is served without a tokenizer: send 'prompt' as a list of token ids",
                           param="prompt")
        if isinstance(prompt, str):
            ids = tok.encode(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                          for t in prompt):
            ids = list(prompt)
            bad = [t for t in ids if not 0 <= t < server.engine.vocab]
            if bad:
                raise APIError(400, f"'prompt' token ids must lie in [0, {server.engine.vocab}), found {bad[0]}",
                               param="prompt")
        else:
            raise APIError(400, "'prompt' must be a string or a list of token ids (one prompt per request)",
                           param="prompt")
    if not ids:
        raise APIError(400, "the prompt encodes to no tokens", param="messages" if chat else "prompt")
    room = server.context - len(ids)
    if room < 1:
        raise APIError(400, f"the prompt has {len(ids):,} tokens; this model's maximum context length is "
                            f"{server.context:,} tokens, and at least one is needed for the completion",
                       param="messages" if chat else "prompt", code="context_length_exceeded")
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _number(body, key, min(room, server.default_max_tokens) if chat else 16, 1, 10**9, integer=True)
    if len(ids) + max_tokens > server.context:
        raise APIError(400, f"this model's maximum context length is {server.context:,} tokens; the request needs "
                            f"{len(ids) + max_tokens:,} ({len(ids):,} in the prompt, {max_tokens:,} for the "
                            f"completion)", param=key, code="context_length_exceeded")
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    top_k = _number(body, "top_k", -1, -1, 2**31 - 1, integer=True)
    seed = _number(body, "seed", None, 0, 2**63 - 1, integer=True)
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else ([] if stop is None else stop)
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise APIError(400, "'stop' must be a string or a list of up to 4 non-empty strings", param="stop")
    stop_ids = body.get("stop_token_ids")
    stop_ids = [] if stop_ids is None else stop_ids
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and
                                                 0 <= t < server.engine.vocab for t in stop_ids):
        raise APIError(400, f"'stop_token_ids' must be a list of token ids in [0, {server.engine.vocab})",
                       param="stop_token_ids")
    ignore_eos = body.get("ignore_eos", False)
    stream = body.get("stream", False)
    for key, v in (("ignore_eos", ignore_eos), ("stream", stream)):
        if not isinstance(v, bool) and v is not None:
            raise APIError(400, f"'{key}' must be true or false, got {v!r}", param=key)
    opts = body.get("stream_options")
    if opts is not None and (not isinstance(opts, dict) or set(opts) - {"include_usage"}
                             or not isinstance(opts.get("include_usage", False), bool)):
        raise APIError(400, "'stream_options' may only hold 'include_usage': true or false", param="stream_options")
    if not isinstance(body.get("user", ""), str):
        raise APIError(400, "'user' must be a string", param="user")
    if opts and not stream:
        raise APIError(400, "'stream_options' needs 'stream': true", param="stream_options")
    stops = set(stop_ids) | (set() if ignore_eos else set(server.eos))
    params = {"temperature": float(temperature), "top_p": None if top_p == 1.0 else float(top_p),
              "top_k": None if top_k in (-1, 0) else top_k, "seed": seed, "stop_ids": sorted(stops)}
    return Ask(ids, max_tokens, params, stop, bool(stream), bool(opts and opts.get("include_usage")))


class IdTokenizer:
    """The text of a model served without a tokenizer: each token id written ``<id>``."""

    stop_ids: list[int] = []

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(f"<{int(t)}>" for t in ids)


class Detokenizer:
    """The completion's text as tokens arrive: held back while it ends mid-character, or while its end could be
    the start of a stop string; cut before the first stop string found. Each token decodes a window of the last
    few tokens, not the whole completion (a byte-level BPE decodes a run of tokens to the concatenation of their
    bytes)."""

    def __init__(self, tok: Tokenizer, stop: list[str], skip: set[int]):
        self.tok, self.stop, self.skip = tok, stop, skip
        self.ids: list[int] = []
        self.text = ""                                      # the text of ids[:self.read], once it decoded cleanly
        self.prefix = 0                                     # ids[prefix:read] decode to the end of self.text
        self.read = 0
        self.sent = 0                                       # characters handed out
        self.stopped = False

    def add(self, token: int | None, final: bool = False) -> str:
        """The new text that can be sent after ``token`` (``final``: nothing more will come)."""
        if token is not None and token not in self.skip:
            self.ids.append(token)
        if self.read < len(self.ids):
            before = self.tok.decode(self.ids[self.prefix:self.read], skip_special_tokens=True)
            after = self.tok.decode(self.ids[self.prefix:], skip_special_tokens=True)
            if final or not after.endswith("\ufffd"):
                self.text += after[len(before):]
                self.prefix, self.read = self.read, len(self.ids)
        text = self.text
        for s in self.stop:
            i = text.find(s, max(0, self.sent - len(s) + 1))
            if i >= 0:
                self.stopped = True
                text = text[:i]
        if not (final or self.stopped):
            hold = max((k for s in self.stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
            text = text[:len(text) - hold]
        out = text[self.sent:]
        self.sent = max(self.sent, len(text))
        return out


# -- the app -----------------------------------------------------------------------------------------------------------

def create_app(server: Server) -> FastAPI:
    """The API over ``server`` (started with the app: the model loads while ``/health`` answers 503)."""

    @contextlib.asynccontextmanager
    async def lifespan(_):
        if not server.thread.is_alive() and server.state == "loading":
            server.start()
        yield
        server.stop()

    app = FastAPI(title="lynn serve", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)

    def count(status: int) -> None:
        server.http_errors[status] = server.http_errors.get(status, 0) + 1

    @app.exception_handler(APIError)
    async def _api_error(request: HTTPRequest, err: APIError):
        if not (err.status == 503 and request.url.path == "/health"):     # a readiness poll is not an error
            count(err.status)
        return err.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_, err: StarletteHTTPException):
        count(err.status_code)
        return APIError(err.status_code, str(err.detail)).response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_, err: RequestValidationError):
        count(400)
        return APIError(400, f"invalid request: {err}").response()

    @app.exception_handler(Exception)
    async def _internal(_, err: Exception):
        count(500)
        traceback.print_exception(err)
        return APIError(500, f"internal error: {type(err).__name__}: {err}").response()

    def ready() -> None:
        if server.state == "ready" and not server.thread.is_alive():
            raise APIError(503, "the engine thread has stopped (see the server's log)", code="engine_stopped")
        if server.state == "loading":
            raise APIError(503, "the model is loading; try again shortly", code="loading")
        if server.state == "failed":
            raise APIError(503, server.error, code="load_failed")

    @app.get("/health")
    async def health():
        ready()
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        ready()
        return {"object": "list", "data": [{"id": server.name, "object": "model", "created": server.created,
                                            "owned_by": "lynn", "max_model_len": server.context}]}

    @app.get("/metrics")
    async def metrics():
        ready()
        return PlainTextResponse(await server.metrics_text(), media_type="text/plain; version=0.0.4")

    async def body_of(request: HTTPRequest):
        try:
            return json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise APIError(400, f"the request body is not JSON: {err}") from None

    async def complete(request: HTTPRequest, chat: bool):
        arrived = time.perf_counter()                       # the time to first token starts here
        ready()
        ask = parse(server, await body_of(request), chat)
        try:
            job = await server.submit(ask.prompt, ask.max_tokens, ask.params, arrived)
        except Refused as err:
            raise APIError(400, str(err), code="context_length_exceeded") from None
        except ValueError as err:
            raise APIError(400, str(err)) from None
        kind = "chatcmpl" if chat else "cmpl"
        rid, created = f"{kind}-{uuid.uuid4().hex[:24]}", int(time.time())
        detok = Detokenizer(server.tokenizer, ask.stop, set(ask.params["stop_ids"]))
        made = [0]                                          # tokens the response accounts for

        def usage() -> dict:
            return {"prompt_tokens": len(ask.prompt), "completion_tokens": made[0],
                    "total_tokens": len(ask.prompt) + made[0]}

        async def events():
            """(text, finish_reason) pairs: finish_reason None until the last. A stop string ends the response at
            the token that completed it (any the engine made before the cancel reached it are not counted)."""
            while True:
                kind_, *rest = await job.events.get()
                if kind_ == "token":
                    made[0] += 1
                    text = detok.add(rest[0])
                    if detok.stopped:
                        server.cancel(job, "stop")
                        yield text, "stop"
                        return
                    if text:
                        yield text, None
                else:
                    reason, error = rest
                    if reason == "error":
                        raise APIError(500, error or "the engine failed", kind="server_error")
                    text = detok.add(None, final=True)
                    yield text, ("length" if reason == "length" and not detok.stopped else "stop")
                    return

        def chunk(text: str | None, reason: str | None, first: bool = False) -> dict:
            if chat:
                delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
                obj = "chat.completion.chunk"
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
                obj = "text_completion"
            out = {"id": rid, "object": obj, "created": created, "model": server.name, "choices": [choice]}
            return {**out, "usage": None} if ask.usage_in_stream else out      # as OpenAI: null until the last

        if ask.stream:
            async def sse():
                done = False
                try:
                    if chat:
                        yield f"data: {json.dumps(chunk(None, None, first=True))}\n\n"
                    try:
                        async for text, reason in events():
                            yield f"data: {json.dumps(chunk(text, reason))}\n\n"
                    except APIError as err:
                        event = {"error": {"message": err.message, "type": err.kind, "param": err.param,
                                           "code": err.code}}
                        yield f"data: {json.dumps(event)}\n\n"
                    done = True
                    if ask.usage_in_stream:
                        last = {**chunk(None, None), "choices": [], "usage": usage()}
                        yield f"data: {json.dumps(last)}\n\n"
                    yield "data: [DONE]\n\n"
                finally:
                    if not done:                            # the client went away: free its slot
                        server.cancel(job)
            return StreamingResponse(sse(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

        parts, reason, gone = [], None, []

        async def watch():                                  # a client that goes away: cancel, whatever the pace
            while True:
                await asyncio.sleep(0.25)
                if await request.is_disconnected():
                    gone.append(True)
                    server.cancel(job)
                    return
        watcher = asyncio.ensure_future(watch())
        try:
            async for text, reason in events():
                parts.append(text)
        except BaseException:
            server.cancel(job)
            raise
        finally:
            watcher.cancel()
        if gone:
            return PlainTextResponse("", status_code=499)
        text = "".join(parts)
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                   "finish_reason": reason} if chat else
                  {"index": 0, "text": text, "logprobs": None, "finish_reason": reason})
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": server.name, "choices": [choice], "usage": usage()}

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        return await complete(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest):
        return await complete(request, chat=True)

    return app


__all__ = ["Server", "create_app", "serve_in_thread", "preset_model", "APIError", "Detokenizer", "IdTokenizer",
           "Histogram", "prometheus_text", "parse"]
