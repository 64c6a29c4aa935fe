"""What does ``lynn serve`` deliver under load, in vLLM's serving-benchmark terms, at 1, 8 and 32 concurrent clients?

The server runs in this process as a user runs ``lynn serve`` (``lynn_model.serve.http.Server`` and ``create_app`` on
uvicorn, in a thread, on a free loopback port, the same defaults: 8 rows, fp32 on the torch reference on a CPU, the
compiled kernels fused on a GPU); once ``/health`` answers, each concurrency level sends its requests from a client
in a process of its own (so the client never holds the server's GIL), at most ``c`` in flight, every one a streaming
``POST /v1/completions`` of a random-token prompt (token ids from a seeded generator), ``temperature`` 0,
``ignore_eos``, ``stream_options.include_usage``. Per level, as vLLM's ``benchmark_serving`` reports them:

* request throughput (req/s) and output tokens/s: requests and their ``usage.completion_tokens`` over the level's
  wall time, first request sent to last stream closed;
* TTFT: request sent to its first streamed chunk;
* ITL per request, vLLM's TPOT: (last chunk - first chunk) / (completion_tokens - 1);
* the gaps between streamed chunks (vLLM's ITL): a chunk may carry several tokens (the server holds back text that
  ends mid-character), so tokens are counted from the usage chunk, never from the chunks;
* the mean decode batch: ``lynn_decode_rows_total / lynn_decode_steps_total`` of ``/metrics`` over the level, and the
  server's own mean TTFT and inter-token gap (its histograms, which start at ``Engine.submit``): the difference from
  the client's is what they do not see (HTTP, the event loop, a request's wait for the engine thread's current step).

Then, with the server stopped, the same model (the engine's) runs ``lynn_model.generate`` on the same kind of prompts
at batch 1 and 8 (each level's ``min(c, rows)``), ``stats=lynn_model.Stats()``: each level's output tokens/s over
``generate``'s ``decode_tok_s`` says what the scheduler, the prefills among the decode steps and HTTP cost against
the decode step alone (on a GPU, a captured graph replayed per token).

    PYTHONPATH=. python3 experiments/serve_load.py                  # the demo model: about 2 minutes on a CPU
    PYTHONPATH=. python3 experiments/serve_load.py --model DIR --rows 32 --concurrency 1 8 32 --requests 64 128 256

    PYTHONPATH=. python3 experiments/serve_load.py --preset qwen3.5-35b-a3b      # GPU: the real shapes

``--requests``: one count per level, or one for all (default: 32 at c=1, 64 at c=8, 128 at c=32: 8 waves of 8 rows
at c=8). ``--preset NAME`` serves a random-weight NVFP4 model of a preset as ``lynn serve --preset`` does (built
here, fused on a GPU, fp32 on a CPU; no tokenizer: the prompts are token ids anyway, the text is the ids as ``<id>``).

Writes ``data/experiments/serve-load/<sha>.json`` (``<preset>-<sha>.json`` with a preset, ``-cpu`` before
``.json`` on a CPU; ``$OUT`` instead of the folder when
set, ``--out FILE`` for the file; on the device machine, whose copy has no ``.git``, set ``LYNN_GIT_SHA``) with
``lynn_kernels.bench.harness.provenance()`` and the load average (a CPU run shares its cores), every request's
timings, and the table it prints last. ``97e2b0b-cpu.json``: the demo model on a 2-core CPU (fp32 on the torch
reference, 8 rows, 128 in / 64 out, 85 s in all): 83 output tok/s at c=1 (TTFT p50 50 ms, ITL p50 11.2 ms), 272 at
c=8 (mean decode batch 7.88, TTFT p50 236 ms, ITL p50 26.1 ms), 271 at c=32 (queued behind 8 rows: TTFT p50 5.8 s);
0.83, 0.73 and 0.72 of ``generate``'s decode tok/s at batch 1, 8 and 8.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]

# -- the client (run in a process of its own) --------------------------------------------------------------------------

async def _request(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    """One streaming completion: when it was sent, when each chunk with choices came, the usage, any error."""
    chunks: list[float] = []
    usage, error = None, None
    sent = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}"
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    now = time.perf_counter()
                    data = line[6:]
                    if data == "[DONE]":
                        break
                    obj = json.loads(data)
                    if "error" in obj:
                        error = f"error chunk: {obj['error']}"
                    elif obj.get("choices"):
                        chunks.append(now)
                    if obj.get("usage"):
                        usage = obj["usage"]
    except httpx.HTTPError as err:
        error = f"{type(err).__name__}: {err}"
    done = time.perf_counter()
    if error is None and usage is None:
        error = "no usage chunk in the stream"
    return {"sent": sent, "chunks": chunks, "done": done, "usage": usage, "error": error}


async def _level(base: str, bodies: list[dict], concurrency: int) -> dict:
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(None), limits=limits) as client:
        async def one(body):
            async with gate:
                return await _request(client, "/v1/completions", body)
        start = time.perf_counter()
        results = await asyncio.gather(*(one(b) for b in bodies))
        end = time.perf_counter()
    return {"start": start, "end": end, "requests": list(results)}


def client_level(base: str, bodies: list[dict], concurrency: int) -> dict:
    """Send ``bodies``, at most ``concurrency`` at once; every request's timings (perf_counter of this process)."""
    return asyncio.run(_level(base, bodies, concurrency))


# -- figures -----------------------------------------------------------------------------------------------------------

def percentile(xs: list[float], q: float) -> float | None:
    """The ``q``-th percentile, linearly interpolated (numpy's default)."""
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def spread_ms(xs: list[float]) -> dict:
    """Mean, p50, p99 of seconds, in ms."""
    if not xs:
        return {"mean": None, "p50": None, "p99": None, "n": 0}
    return {"mean": 1e3 * statistics.fmean(xs), "p50": 1e3 * percentile(xs, 50), "p99": 1e3 * percentile(xs, 99),
            "n": len(xs)}


def summarise(run: dict, concurrency: int, input_len: int) -> dict:
    reqs = run["requests"]
    ok = [r for r in reqs if r["error"] is None and r["chunks"]]
    out_tokens = sum(r["usage"]["completion_tokens"] for r in ok)
    in_tokens = sum(r["usage"]["prompt_tokens"] for r in ok)
    duration = run["end"] - run["start"]
    ttft = [r["chunks"][0] - r["sent"] for r in ok]
    tpot = [(r["chunks"][-1] - r["chunks"][0]) / (r["usage"]["completion_tokens"] - 1) for r in ok
            if r["usage"]["completion_tokens"] > 1]
    gaps = [b - a for r in ok for a, b in zip(r["chunks"], r["chunks"][1:])]
    e2e = [r["done"] - r["sent"] for r in ok]
    return {"concurrency": concurrency, "requests": len(reqs), "completed": len(ok),
            "failed": len(reqs) - len(ok), "errors": sorted({r["error"] for r in reqs if r["error"]})[:5],
            "duration_s": duration, "input_tokens": in_tokens, "output_tokens": out_tokens,
            "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
            "total_token_throughput": (in_tokens + out_tokens) / duration,
            "ttft_ms": spread_ms(ttft), "itl_per_request_ms": spread_ms(tpot), "chunk_gap_ms": spread_ms(gaps),
            "e2e_latency_ms": spread_ms(e2e),
            "chunks_per_token": sum(len(r["chunks"]) for r in ok) / max(1, out_tokens),
            "short_requests": sum(r["usage"]["completion_tokens"] != r["want"] for r in ok)}


def scrape(text: str) -> dict[str, float]:
    """Prometheus text: every unlabelled sample (and the labelled ones under their full name)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def server_delta(before: dict, after: dict) -> dict:
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    steps, rows = d["lynn_decode_steps_total"], d["lynn_decode_rows_total"]
    mean = lambda name: (1e3 * d[f"{name}_sum"] / d[f"{name}_count"] if d.get(f"{name}_count") else None)  # noqa: E731
    return {"decode_steps": int(steps), "decode_rows": int(rows), "mean_decode_batch": rows / steps if steps else None,
            "generated_tokens": int(d["lynn_generation_tokens_total"]),
            "prompt_tokens": int(d["lynn_prompt_tokens_total"]),
            "ttft_mean_ms": mean("lynn_time_to_first_token_seconds"),
            "inter_token_mean_ms": mean("lynn_inter_token_latency_seconds")}


# -- the server -----------------------------------------------------------------------------------------------------

class InProcessServer:
    """``lynn serve``'s server and app on uvicorn in a thread, on a free loopback port
    (:func:`lynn_model.serve.http.serve_in_thread`); ``model``: a HF folder or a built model, as
    :class:`~lynn_model.serve.http.Server` takes it."""

    def __init__(self, model, rows: int, threads: int, name: str | None = None):
        from lynn_model.serve.http import Server

        self.server = Server(model, rows=rows, threads=threads, name=name)
        self.running = contextlib.ExitStack()
        self.base = ""

    def start(self, timeout: float = 600.0) -> float:
        """Start it and wait for the model; the seconds it took."""
        from lynn_model.serve.http import serve_in_thread

        t0 = time.perf_counter()
        try:
            self.base = self.running.enter_context(serve_in_thread(self.server, timeout=timeout))
        except RuntimeError as err:
            raise SystemExit(f"the server did not start: {err}") from None
        return time.perf_counter() - t0

    def metrics(self) -> dict[str, float]:
        return scrape(httpx.get(self.base + "/metrics", timeout=30).text)

    def stop(self) -> None:
        """Stop uvicorn (its lifespan stops the engine thread) and wait for both threads."""
        self.running.close()


# -- generate on the same model ----------------------------------------------------------------------------------------

def generate_rates(model, batches: list[int], input_len: int, output_len: int, vocab: int, seed: int,
                   repeats: int, threads: int) -> list[dict]:
    """``lynn_model.generate`` on ``model`` at each batch: the median of ``repeats`` timed calls after one warm-up,
    on the backend the server ran (the compiled kernels on a GPU, the torch reference on a CPU) and, on a CPU, its
    torch threads (the server sets them in its engine thread only)."""
    import torch

    import lynn_kernels
    import lynn_model

    if threads and not torch.cuda.is_available():
        torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(seed + 1)
    rows = []
    with lynn_kernels.use_reference(not torch.cuda.is_available()):
        for b in batches:
            prompts = torch.randint(0, vocab, (b, input_len), generator=gen)
            lynn_model.generate(model, prompts, output_len, temperature=0)
            runs = []
            for _ in range(repeats):
                stats = lynn_model.Stats()
                lynn_model.generate(model, prompts, output_len, temperature=0, stats=stats)
                runs.append(stats)
            decode = statistics.median(s.decode_tok_s for s in runs)
            whole = statistics.median(s.new_tokens / (s.prefill_s + s.decode_s) for s in runs)
            rows.append({"batch": b, "decode_tok_s": decode, "end_to_end_tok_s": whole,
                         "cuda_graph": runs[0].cuda_graph, "decode_steps": runs[0].decode_steps,
                         "runs_decode_tok_s": [s.decode_tok_s for s in runs]})
    return rows


# -- main --------------------------------------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    from lynn_cli.generate import DEMO_MODEL

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, metavar="DIR",
                   help=f"HF model folder (default: the demo model, {DEMO_MODEL})")
    p.add_argument("--preset", default=None, metavar="NAME",
                   help="a random-weight NVFP4 model of a preset instead (as lynn serve --preset)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32], metavar="C")
    p.add_argument("--requests", type=int, nargs="+", default=None, metavar="N",
                   help="requests per level: one count per --concurrency level, or one for all "
                        "(default: 32 at c=1, else 8 per client, at most 128)")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (default %(default)s)")
    p.add_argument("--output-len", type=int, default=64, help="max_tokens, with ignore_eos (default %(default)s)")
    p.add_argument("--rows", type=int, default=8, help="the server's rows, as lynn serve --rows (default %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="the server's torch CPU threads, as lynn serve --threads "
                   "(default %(default)s)")
    p.add_argument("--warmup", type=int, default=None, metavar="N",
                   help="requests sent (min(rows, max c) at once) before the levels, not measured (default: that)")
    p.add_argument("--generate-repeats", type=int, default=3, metavar="N",
                   help="timed generate calls per batch, the median kept (default %(default)s; 0: skip)")
    p.add_argument("--client", choices=["process", "thread"], default="process",
                   help="where the load generator runs: a process of its own (default) or this one (sharing the "
                        "server's GIL)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, metavar="FILE", help="the JSON file (default: see above)")
    args = p.parse_args(argv)
    if args.requests is None:
        args.requests = [32 if c == 1 else min(128, 8 * c) for c in args.concurrency]
    elif len(args.requests) == 1:
        args.requests = args.requests * len(args.concurrency)
    if len(args.requests) != len(args.concurrency):
        p.error(f"--requests takes one count or one per level ({len(args.concurrency)}), got {len(args.requests)}")
    for name in ("concurrency", "requests"):
        if min(getattr(args, name)) < 1:
            p.error(f"--{name} must be >= 1")
    if min(args.input_len, args.output_len, args.rows) < 1:
        p.error("--input-len, --output-len and --rows must be >= 1")
    if args.model is not None and args.preset is not None:
        p.error("--model and --preset: give one")
    if args.preset is None and args.model is None:
        args.model = DEMO_MODEL
    if args.warmup is None:
        args.warmup = min(args.rows, max(args.concurrency))
    return args


def table(levels: list[dict]) -> str:
    from lynn_kernels.metrics import render_table

    def r(x, nd=1):
        return None if x is None else round(x, nd)
    rows = [{"c": lv["concurrency"], "reqs": lv["completed"], "req/s": r(lv["request_throughput"], 2),
             "out tok/s": r(lv["output_throughput"]), "TTFT p50": r(lv["ttft_ms"]["p50"]),
             "TTFT p99": r(lv["ttft_ms"]["p99"]), "ITL p50": r(lv["itl_per_request_ms"]["p50"], 2),
             "ITL p99": r(lv["itl_per_request_ms"]["p99"], 2), "gap p50": r(lv["chunk_gap_ms"]["p50"], 2),
             "gap p99": r(lv["chunk_gap_ms"]["p99"], 2), "batch": r(lv["server"]["mean_decode_batch"], 2),
             "/ generate": r(lv.get("vs_generate_decode"), 3)} for lv in levels]
    return render_table(rows, digits=8)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.model is not None and not (args.model / "config.json").is_file():
        raise SystemExit(f"--model {args.model}: no config.json there (expected a HF model folder)")

    import torch

    from lynn_kernels.bench.harness import provenance

    t_all = time.perf_counter()
    prov = provenance()
    load_before = os.getloadavg()
    on_gpu = torch.cuda.is_available()
    build_s = 0.0
    if args.preset is not None:
        from lynn_model.serve.http import preset_model

        t0 = time.perf_counter()
        try:
            model = preset_model(args.preset, seed=args.seed)             # as lynn serve --preset builds it
        except KeyError as err:
            raise SystemExit(f"--preset: {err.args[0]}") from None
        build_s = time.perf_counter() - t0
        srv = InProcessServer(model, args.rows, args.threads, name=args.preset)
        what = f"a random-weight {args.preset}"
    else:
        srv = InProcessServer(args.model, args.rows, args.threads)
        what = str(args.model)
    load_s = srv.start()
    engine = srv.server.engine
    vocab, name = engine.vocab, srv.server.name
    print(f"[serve_load: {what} as '{name}' on {srv.base}, {args.rows} rows, "
          f"{'GPU ' + torch.cuda.get_device_name() if on_gpu else 'CPU'}; ready in {load_s:.1f} s]", file=sys.stderr)

    gen = torch.Generator().manual_seed(args.seed)

    def bodies(n: int, max_tokens: int) -> list[dict]:
        ids = torch.randint(0, vocab, (n, args.input_len), generator=gen).tolist()
        return [{"model": name, "prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                 "stream": True, "stream_options": {"include_usage": True}} for p in ids]

    pool = (ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) if args.client == "process"
            else None)

    def send(batch: list[dict], c: int) -> dict:
        if pool is None:
            return client_level(srv.base, batch, c)
        return pool.submit(client_level, srv.base, batch, c).result()

    levels = []
    try:
        if pool is not None:
            pool.submit(percentile, [0.0], 50).result()            # start the client process before timing
        if args.warmup:
            send(bodies(args.warmup, args.output_len), min(args.rows, max(args.concurrency)))
        for c, n in zip(args.concurrency, args.requests):
            batch = bodies(n, args.output_len)
            before = srv.metrics()
            run = send(batch, c)
            after = srv.metrics()
            for r in run["requests"]:
                r["want"] = args.output_len
            lv = summarise(run, c, args.input_len)
            lv["server"] = server_delta(before, after)
            lv["per_request"] = [{"ttft_s": r["chunks"][0] - r["sent"] if r["chunks"] else None,
                                  "e2e_s": r["done"] - r["sent"], "chunks": len(r["chunks"]),
                                  "completion_tokens": (r["usage"] or {}).get("completion_tokens"),
                                  "error": r["error"]} for r in run["requests"]]
            levels.append(lv)
            print(f"[c={c}: {lv['completed']}/{n} requests in {lv['duration_s']:.1f} s, "
                  f"{lv['output_throughput']:.1f} out tok/s, mean decode batch "
                  f"{lv['server']['mean_decode_batch'] or 0:.2f}]", file=sys.stderr)
    finally:
        if pool is not None:
            pool.shutdown()
        srv.stop()

    batches = sorted({min(c, args.rows) for c in args.concurrency})
    gen_rows = []
    if args.generate_repeats:
        gen_rows = generate_rates(engine.model, batches, args.input_len, args.output_len, vocab, args.seed,
                                  args.generate_repeats, args.threads)
        by_batch = {g["batch"]: g for g in gen_rows}
        for lv in levels:
            g = by_batch[min(lv["concurrency"], args.rows)]
            lv["vs_generate_decode"] = lv["output_throughput"] / g["decode_tok_s"]
            lv["vs_generate_end_to_end"] = lv["output_throughput"] / g["end_to_end_tok_s"]

    res = {"provenance": prov,
           "setup": {"model": None if args.model is None else (os.path.relpath(args.model.resolve(), ROOT)
                                                                 if args.model.resolve().is_relative_to(ROOT)
                                                                 else str(args.model)),
                     "preset": args.preset, "served_name": name, "rows": args.rows, "threads": args.threads,
                     "torch_threads": torch.get_num_threads(), "device": "gpu" if on_gpu else "cpu",
                     "dtype": str(engine.model.dtype), "backend": "kernels (fused)" if on_gpu else "reference",
                     "cuda_graph": any(s.graph is not None for s in engine.steps.values())
                     if on_gpu else False,
                     "input_len": args.input_len, "output_len": args.output_len, "concurrency": args.concurrency,
                     "requests": args.requests, "warmup": args.warmup, "client": args.client, "seed": args.seed,
                     "build_s": build_s, "load_s": load_s, "vocab": vocab, "cpus": os.cpu_count(),
                     "loadavg_1m_before_after": [load_before[0], os.getloadavg()[0]]},
           "definitions": {
               "request_throughput": "completed requests / (first sent .. last stream closed), req/s",
               "output_throughput": "sum of usage.completion_tokens / the same time, tok/s",
               "ttft_ms": "request sent to its first chunk with choices",
               "itl_per_request_ms": "(last chunk - first chunk) / (completion_tokens - 1) per request: vLLM's TPOT",
               "chunk_gap_ms": "gaps between consecutive chunks of a request, all requests: vLLM's ITL",
               "server.mean_decode_batch": "delta lynn_decode_rows_total / delta lynn_decode_steps_total, the level",
               "vs_generate_decode": "output_throughput / generate's decode_tok_s at batch min(c, rows)"},
           "levels": levels, "generate": gen_rows}
    res["table"] = table(levels)
    res["runtime_s"] = time.perf_counter() - t_all
    if args.out is not None:
        path = args.out
    else:
        folder = Path(os.environ.get("OUT") or ROOT / "data" / "experiments" / "serve-load")
        stem = f"{args.preset}-{prov['git_sha'][:7]}" if args.preset else prov["git_sha"][:7]
        path = folder / f"{stem}{'' if on_gpu else '-cpu'}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {path} ({res['runtime_s']:.0f} s)")
    for g in gen_rows:
        print(f"generate batch {g['batch']}: {g['decode_tok_s']:.1f} decode tok/s, {g['end_to_end_tok_s']:.1f} "
              f"end to end ({'graph' if g['cuda_graph'] else 'eager'})")
    print(f"{args.input_len} in / {args.output_len} out, {args.rows} rows; ms; ITL = per request (last - first chunk) "
          f"/ (tokens - 1) (vLLM's TPOT); gap = between chunks (vLLM's ITL); batch = mean decode batch; "
          f"/ generate = out tok/s over generate's decode tok/s")
    print(res["table"])


if __name__ == "__main__":
    main()
