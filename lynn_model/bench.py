"""The whole decoder (``lynn_model``) at real shapes, random weights: decode at a long context and a prefill.

* ``lynn nvfp4 (eager)``: ``lynn_model.loader.random_model(preset, weights="nvfp4")`` quantised on the GPU (the LM
  head, router and gates stay bf16), run step by step from Python (``model.step``);
* ``lynn nvfp4 (graph)``: the same model's decode step captured as a CUDA graph (:class:`lynn_model.DecodeStep`),
  batch 1 and 8, its tokens checked against the same step run eagerly (the model loaded with ``fuse=False``, as
  stored); ``generate()``: what a user's call gives on the model as the loaders give it on a GPU (fused for decode);
  the census of GPU operations per part of a step (each part's bytes, its ideal time at the read ceiling and the
  efficiency beside it); ``lynn bf16 weights, cuBLAS (graph)``: the same decoder with bf16
  weights, graph-replayed (what 4-bit weights buy); graph rows at contexts of 1k, 4k and 32k (batch 1) and 4k
  (batch 8), one with the shared expert's gate unfolded and one with each mixer's input projections in one GEMV
  (``model.fuse_input_projections()``, measured last: the fusions' figures either way), then the fused step at
  batch 8 with its census (how ``lynn generate`` runs a batch of 8), then the fused step with each layer norm folded
  into the next block's first kernel (``model.fuse_norms()``), batch 1 and 8, each with its census; the fused step
  with the opt-in NVFP4 LM head (``lm_head="nvfp4"``; not token-exact with the bf16 head), batch 1 and 8; prefill
  of 2,048 and 16,384 tokens, each with the profiler's kernel time beside it and a census of the prefill's kernels by
  part (time, share, TFLOP/s and fraction of the bf16 peak: :func:`prefill_census`);
* ``lynn nvfp4 (prefill graph)``: the same prefills through a :class:`lynn_model.PrefillStep` captured for their
  length, and a 1,536-token prompt in the 2,048-row graph (padding), each checked against the eager prefill first;
* ``HF transformers bf16 (eager)``: the HF class of the same config, random bf16 weights, its own cache, in the
  same process (Qwen3.5-35B-A3B only: the 80B model in bf16 does not fit beside ours).

Decode: the context is prefilled once, then each step is timed from the host (CUDA events around one
``model.step`` / one HF forward): what a user of the eager decoder waits for. ``(kernel)`` rows add the GPU time of
one step's kernels from the CUDA profiler: what a CUDA-graph replay of the same step would pay. Bytes per decode
token: every weight a step reads (all non-expert weights, the ``top_k`` routed experts and the shared expert of each
layer, the LM head; one embedding row), the KV cache read and the Gated DeltaNet states read and written; held
against the read ceiling. Prefill: tokens per second of one call; FLOPs ``2 x active parameters x tokens`` (our
step computes the last token's logits only, HF's forward every token's: the LM head is counted accordingly).
The first ``lynn_model`` forward is validated against the reference path on the same weights (a short prompt),
so no speed is reported for a wrong decoder.

Importing this module registers ``decoder.qwen3.5-35b-a3b`` and ``decoder.qwen3-next-80b-a3b`` in
:mod:`lynn_kernels.bench` (which never imports ``lynn_model``): whatever lists or runs the whole project's benchmarks
(``lynn bench``) imports it first.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time

import torch

from lynn_kernels.bench import register
from lynn_kernels.bench.harness import Ceilings, Result, derive, kernel_ms, validated

CONTEXT, PREFILL, STEPS = 4096, 2048, 24
#: the prefill lengths timed, and the (batch, context) pairs of the graph decode rows
PREFILLS = (PREFILL, 16384)
GRAPH_CASES = ((1, 1024), (1, CONTEXT), (1, 32768), (8, CONTEXT))
#: (prompt tokens, rows of the captured prefill): each prefill length exactly, and a prompt padded up to its graph
GRAPH_PREFILLS = ((PREFILL, PREFILL), (16384, 16384), (1536, PREFILL))


def _log(msg: str) -> None:
    print(f"[decoder] {time.strftime('%H:%M:%S')} {msg}", file=sys.stderr, flush=True)


def _nbytes(w) -> int:
    from lynn_kernels.matmul import PackedNVFP4
    from lynn_kernels.moe import PackedExperts
    from lynn_kernels.nvfp4 import NVFP4Tensor

    if isinstance(w, (NVFP4Tensor, PackedNVFP4, PackedExperts)):
        return w.nbytes
    return w.numel() * w.element_size() if isinstance(w, torch.Tensor) else 0


def decode_bytes(model, context: int) -> int:
    """Bytes one batch-1 decode step reads (weights, KV cache, Gated DeltaNet states) and writes (states)."""
    from lynn_model.model import Linear, SparseMoE

    c, total = model.config, model.embed_tokens.shape[1] * model.embed_tokens.element_size()
    for m in model.modules():
        if isinstance(m, Linear):
            total += _nbytes(m.weight)
        elif isinstance(m, SparseMoE):
            total += _nbytes(m.router) + (_nbytes(m.w13) + _nbytes(m.w2)) * c.num_experts_per_tok // c.num_experts
            if m.shared is not None:
                total += _nbytes(m.shared.w13) + _nbytes(m.shared.w2) + _nbytes(m.shared.gate_weight)
    kv = 2 * context * c.num_key_value_heads * c.head_dim * 2 * len(c.attention_layers)
    state = 2 * 4 * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * len(c.linear_layers)
    return total + kv + state


def part_bytes(model, batch: int = 1, context: int = CONTEXT) -> dict[str, int]:
    """Bytes one decode step of ``batch`` sequences at ``context`` tokens each moves per part of :func:`census`, for
    one layer of each kind (the census's names): every weight the part reads once a step, the routed experts
    counted as the distinct experts ``batch`` tokens are expected to pick under uniform routing (``E (1 - (1 - k /
    E)^batch)``), the KV cache an attention layer reads, the Gated DeltaNet recurrent and conv states read and
    written. The ideal time of a part is these bytes at the read ceiling."""
    from lynn_model.model import GatedDeltaNet, Linear

    c, dt = model.config, model.dtype.itemsize

    def weights(module) -> int:
        total = sum(_nbytes(m.weight) for m in module.modules() if isinstance(m, Linear))
        if isinstance(module, GatedDeltaNet):
            total += sum(_nbytes(t) for t in (module.conv_weight, module.dt_bias, module.A_log, module.norm_weight))
        return total

    gdn = next(m for m in model.layers if m.kind != "full_attention").mixer
    attn = next(m for m in model.layers if m.kind == "full_attention").mixer
    moe = model.layers[0].mlp
    e, k = c.num_experts, c.num_experts_per_tok
    distinct = e * (1 - (1 - k / e) ** batch)
    experts = (_nbytes(moe.w13) + _nbytes(moe.w2)) * distinct / e
    shared = _nbytes(moe.shared.w13) + _nbytes(moe.shared.w2) + _nbytes(moe.shared.gate_weight) \
        if moe.shared is not None else 0
    state = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4
    conv = c.conv_dim * (c.linear_conv_kernel_dim - 1) * dt
    kv = context * c.num_key_value_heads * c.head_dim * 2 * dt
    return {"embedding": batch * c.hidden_size * dt,
            "Gated DeltaNet mixer": weights(gdn) + batch * 2 * (state + conv),
            "gated attention mixer": weights(attn) + batch * kv,
            "MoE block (router, experts, shared expert)": int(_nbytes(moe.router) + experts + shared),
            "LM head": _nbytes(model.lm_head.weight)}


def active_params(model) -> int:
    """Parameters one token multiplies by (routed experts counted ``top_k / E``), for prefill FLOPs."""
    from lynn_model.model import Linear, SparseMoE

    c, n = model.config, 0
    for m in model.modules():
        if isinstance(m, Linear):
            n += m.in_features * m.out_features
        elif isinstance(m, SparseMoE):
            n += c.num_experts * c.hidden_size + 3 * c.moe_intermediate_size * c.hidden_size * c.num_experts_per_tok
            n += 3 * c.shared_expert_intermediate_size * c.hidden_size
    return n


def _events_ms(fn, n: int) -> list[float]:
    return _timed(fn, n)[0]


def _timed(fn, n: int, inner: int = 1) -> tuple[list[float], list[float]]:
    """``n`` rounds of ``inner`` calls of ``fn`` from an idle GPU: per call, the GPU time between CUDA events
    around the round (ms) and the host's time to issue it (s)."""
    times, host = [], []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        host.append((time.perf_counter() - t0) / inner)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / inner)
    return times, host


def _row(op, provider, shape, dims, times, ceilings, bytes_=0, flops=0, ceiling=None, note="", validation=None):
    times = sorted(times)
    med = statistics.median(times)
    q = lambda f: times[min(len(times) - 1, int(f * len(times)))]  # noqa: E731
    return derive(Result(op, provider, shape, dims, med, q(0.2), q(0.8), bytes=bytes_, flops=flops, ceiling=ceiling,
                         note=note, validation=validation), ceilings)


def _ours(name: str, ceilings: Ceilings, partial=None) -> tuple[list[Result], dict]:
    import lynn_kernels
    import lynn_model
    from lynn_kernels.metrics import compare
    from lynn_model.loader import random_model

    cfg = lynn_model.preset(name)
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    model = random_model(cfg, weights="nvfp4", device="cuda", seed=0, fuse=False)   # fused below, row by row
    torch.cuda.synchronize()
    build_s = time.perf_counter() - t0
    weights_gb = torch.cuda.memory_allocated() / 1e9
    _log(f"{name}: random NVFP4 model built in {build_s:.1f} s, {weights_gb:.1f} GB")
    gen = torch.Generator(device="cuda").manual_seed(1)
    longest = max(max(PREFILLS), max(c for _, c in GRAPH_CASES) + 8)
    ids = torch.randint(0, cfg.vocab_size, (longest + STEPS + 8,), device="cuda", generator=gen)

    # validate the kernel path against the reference path on the same weights before timing anything: the first
    # 4 layers (every layer kind) and the head, as a model of its own; a random net 40 layers deep amplifies bf16
    # rounding (the full depth's agreement is recorded, not gated)
    import copy

    shallow = copy.copy(model)
    shallow._modules = dict(model._modules)            # its own module table: the model keeps all its layers
    shallow.layers = model.layers[:4]
    with torch.no_grad():
        got, full_got = shallow.forward(ids[None, :80]), model.forward(ids[None, :80])
        with lynn_kernels.use_reference():
            want, full_want = shallow.forward(ids[None, :80]), model.forward(ids[None, :80])
    val = validated(compare(got, want), max_rel_l2=1.3e-2)       # H200: rel_l2 4.4e-3 (Qwen3-Next), 4.1e-3 (3.5)
    val["full_depth_cosine"] = compare(full_got, full_want).cosine
    assert len(model.layers) == cfg.num_hidden_layers
    _log(f"{name}: kernel vs reference path, 80 tokens: cosine {val['cosine']:.6f} over 4 layers, "
         f"{val['full_depth_cosine']:.6f} over all {cfg.num_hidden_layers}")

    rows, info = [], {"build_s": build_s, "weights_gb": weights_gb}

    def done(stage: str) -> None:                # the rows so far, saved (`lynn_kernels.bench.run` passes ``partial``)
        if partial:
            partial(list(rows), {name: info}, stage)

    cache = model.new_cache(max_batch=1, max_tokens=max(max(PREFILLS), CONTEXT + STEPS) + 64)
    head = cfg.hidden_size * cfg.vocab_size                  # logits of the last token only (model.step)
    for n in PREFILLS:
        with torch.no_grad():
            def prefill():
                s = cache.add()
                model.step(ids[:n], cache, [s], [n])
                cache.release(s)

            prefill()                                            # compile + autotune
            times = _events_ms(prefill, 5)
            k_ms = kernel_ms(prefill, n=3)
        flops = 2 * (active_params(model) - head) * n + 2 * head
        rows.append(_row("decoder.prefill", "lynn nvfp4 (eager)", cfg.name, {"B": 1, "T": n}, times, ceilings,
                         flops=flops, ceiling="bf16_tflops",
                         note=f"{n * 1e3 / statistics.median(times):,.0f} tok/s; its kernels {k_ms:.1f} ms "
                              f"({n * 1e3 / k_ms:,.0f} tok/s if launches cost nothing)", validation=val))
        _log(f"{name}: prefill {n}: {statistics.median(times):.1f} ms, kernels {k_ms:.1f} ms")
    done("the eager prefills")
    for n in PREFILLS:                           # where a prefill's time goes
        try:
            info[f"prefill_census_{n}"] = prefill_census(model, ids[:n], cache, ceilings)
        except Exception as err:                 # recorded; the rows above stand
            info[f"prefill_census_{n}"] = {"error": f"{type(err).__name__}: {err}"}
            _log(f"prefill census {n} failed: {err!r}")
    done("the prefill censuses")
    for n, size in GRAPH_PREFILLS:
        try:
            row, info[f"prefill_graph_{n}_in_{size}"] = graph_prefill(model, ids, n, size, ceilings, val)
            rows.append(row)
        except Exception as err:                 # recorded; the rows above stand
            info[f"prefill_graph_{n}_in_{size}"] = {"error": f"{type(err).__name__}: {err}"}
            _log(f"prefill graph {n} in {size} failed: {err!r}")
    done("the graph prefills")

    with torch.no_grad():
        s = cache.add()
        model.step(ids[:CONTEXT], cache, [s], [CONTEXT])
        pos = {"i": CONTEXT}

        def step():
            model.step(ids[pos["i"]:pos["i"] + 1], cache, [s], [1])
            pos["i"] += 1

        step()
        times = _events_ms(step, STEPS // 2)
        k_ms = kernel_ms(step, n=STEPS // 4)
    nbytes = decode_bytes(model, CONTEXT)
    dims = {"B": 1, "context": CONTEXT}
    med = statistics.median(times)
    rows.append(_row("decoder.decode", "lynn nvfp4 (eager)", cfg.name, dims, times, ceilings, bytes_=nbytes,
                     ceiling="read_gbps", note=f"{1e3 / med:.1f} tok/s; host-timed step", validation=val))
    rows.append(_row("decoder.decode", "lynn nvfp4 (kernel)", cfg.name, dims, [k_ms], ceilings, bytes_=nbytes,
                     ceiling="read_gbps", note=f"{1e3 / k_ms:.1f} tok/s if replayed as a graph; CUDA profiler "
                                              f"kernel time of one step, median of {STEPS // 4}", validation=val))
    info.update(peak_gb=torch.cuda.max_memory_allocated() / 1e9, bytes_per_token=nbytes,
                cache_gb=cache.nbytes() / 1e9)
    _log(f"{name}: decode at {CONTEXT}: {med:.2f} ms/token host, {k_ms:.2f} ms kernels")
    done("the eager decode")
    cache = None
    torch.cuda.empty_cache()
    for batch, context in GRAPH_CASES:
        grows, ginfo = graph_decode(model, ids, batch, ceilings, "lynn nvfp4 (graph)",
                                    decode_bytes(model, context) if batch == 1 else 0, context=context)
        rows += grows
        info[f"graph_b{batch}" + ("" if context == CONTEXT else f"_ctx{context}")] = ginfo
    done("the graph decodes")
    with _gate_unfolded():                       # the fusion's figure either way: the shared gate on its own
        grows, info["graph_b1_gate_unfolded"] = graph_decode(model, ids, 1, ceilings,
                                                             "lynn nvfp4 (graph, shared gate unfolded)", nbytes)
    rows += grows
    grows, info["graph_b1_plain_launches"] = graph_decode(model, ids, 1, ceilings,   # what PDL buys
                                                          "lynn nvfp4 (graph, plain launches)", nbytes, pdl=False)
    rows += grows
    for key, batch in (("census", 1), ("census_b8", 8)):
        try:
            info[key] = census(model, batch, ceilings)
        except Exception as err:                 # the timed rows above stand; the census's failure is recorded
            info[key] = {"error": f"{type(err).__name__}: {err}"}
            _log(f"census at batch {batch} failed: {err!r}")
    done("the unfused censuses")
    try:                                         # in place, so after every row of the default model; a failure
        fused = model.fuse_input_projections()   # here is recorded and keeps the rows above
        _log(f"{name}: input projections fused: {fused}")
        grows, info["graph_b1_inputs_fused"] = graph_decode(model, ids, 1, ceilings,
                                                            "lynn nvfp4 (graph, input projections fused)",
                                                            decode_bytes(model, CONTEXT))
        info["graph_b1_inputs_fused"]["fused"] = fused
        rows += grows
    except Exception as err:
        info["graph_b1_inputs_fused"] = {"error": f"{type(err).__name__}: {err}"}
        _log(f"fused input projections failed: {err!r}")
    try:                                         # and each Gated DeltaNet decode step as one kernel
        model.fuse_gdn_decode()
        what = "GDN decode fused" if "error" in info["graph_b1_inputs_fused"] else \
            "input projections and GDN decode fused"
        grows, info["graph_b1_gdn_decode_fused"] = graph_decode(model, ids, 1, ceilings, f"lynn nvfp4 (graph, {what})",
                                                                decode_bytes(model, CONTEXT))
        rows += grows
    except Exception as err:
        info["graph_b1_gdn_decode_fused"] = {"error": f"{type(err).__name__}: {err}"}
        _log(f"fused Gated DeltaNet decode failed: {err!r}")
    done("the fused decodes")
    rows.append(generate_row(model, ids, ceilings, nbytes))   # the form the loaders give on a GPU (fuse=None)
    try:                                         # the fused step with the router's 64-bit top-k keys (the default
        with _router_key64():                    # is 32: the figure either way)
            grows, info["graph_b1_fused_key64"] = graph_decode(
                model, ids, 1, ceilings, "lynn nvfp4 (graph, fused, 64-bit top-k keys)", decode_bytes(model, CONTEXT))
        rows += grows
    except Exception as err:
        info["graph_b1_fused_key64"] = {"error": f"{type(err).__name__}: {err}"}
        _log(f"64-bit top-k keys failed: {err!r}")
    try:                                         # the census of the step as fused
        info["census_fused"] = census(model, 1, ceilings)
    except Exception as err:
        info["census_fused"] = {"error": f"{type(err).__name__}: {err}"}
        _log(f"census of the fused step failed: {err!r}")
    try:                                         # batch 8 as `lynn generate` runs it (the fused forms)
        grows, info["graph_b8_fused"] = graph_decode(model, ids, 8, ceilings, "lynn nvfp4 (graph, fused)", 0)
        rows += grows
        info["census_b8_fused"] = census(model, 8, ceilings)
    except Exception as err:
        info.setdefault("graph_b8_fused", {"error": f"{type(err).__name__}: {err}"})
        info["census_b8_fused"] = {"error": f"{type(err).__name__}: {err}"}
        _log(f"batch 8, fused: {err!r}")
    done("the fused censuses")
    for key, batch in (("graph_b1_norms_folded", 1), ("graph_b8_norms_folded", 8)):
        try:                                     # and each layer norm inside the next block's first kernel
            model.fuse_norms()
            grows, info[key] = graph_decode(model, ids, batch, ceilings, "lynn nvfp4 (graph, fused, norms folded)",
                                            decode_bytes(model, CONTEXT) if batch == 1 else 0)
            rows += grows
            info[key.replace("graph", "census")] = census(model, batch, ceilings)
        except Exception as err:
            info.setdefault(key, {"error": f"{type(err).__name__}: {err}"})
            _log(f"norms folded, batch {batch}: {err!r}")
        finally:
            model.fuse_norms(False)
    done("the folded norms")
    head = model.lm_head.weight
    try:                                         # the opt-in NVFP4 LM head (from_pretrained(lm_head="nvfp4"))
        from lynn_model.loader import pack_linears, quantize_lm_head

        quantize_lm_head(model)
        pack_linears(model)
        for batch in (1, 8):
            grows, info[f"graph_b{batch}_nvfp4_head"] = graph_decode(
                model, ids, batch, ceilings, "lynn nvfp4 (graph, fused, NVFP4 LM head)",
                decode_bytes(model, CONTEXT) if batch == 1 else 0)
            rows += grows
    except Exception as err:
        info.setdefault("graph_b1_nvfp4_head", {"error": f"{type(err).__name__}: {err}"})
        _log(f"NVFP4 LM head: {err!r}")
    finally:
        model.lm_head.weight = head
    done("the NVFP4 LM head")
    model = None
    torch.cuda.empty_cache()
    return rows, info


GRAPH_STEPS = 64


def graph_prefill(model, ids, n: int, size: int, ceilings: Ceilings, val: dict) -> tuple[Result, dict]:
    """The prefill of an ``n``-token prompt by replay of a :class:`lynn_model.PrefillStep` captured for ``size``
    rows (``n < size``: the rest padding): CUDA events around one ``run()`` call (the host's copies, the page
    reservation and the replay: what a caller waits for), median of 5, the host's time per call beside it. Checked
    first: its logits against the eager ``model.step`` of the same prompt (cosine; bit-equality recorded), and a
    second prompt through the same graph against its eager prefill."""
    from lynn_kernels.metrics import compare
    from lynn_model import PrefillStep

    cfg = model.config
    cache = model.new_cache(max_batch=1, max_tokens=size + 64)
    t0 = time.perf_counter()
    step = PrefillStep(model, cache, size)
    capture_s = time.perf_counter() - t0
    checks = {}
    with torch.no_grad():
        for k, prompt in enumerate((ids[:n], ids[-n:])):
            s = cache.add()
            want = model.step(prompt, cache, [s], [n]).float()
            cache.release(s)
            s = cache.add()
            got = step.run(prompt, s).float()
            cache.release(s)
            m = compare(got, want)
            checks[f"prompt{k}"] = {"cosine": m.cosine, "max_abs": m.max_abs, "bit_equal": bool(torch.equal(got, want))}
            floor = 0.999 if n == size else 0.995     # padded: other row counts, other cuBLAS kernels; 40 random
            if m.cosine < floor:                      # layers amplify their rounding (H200: 0.9996-0.9998)
                raise AssertionError(f"prefill graph {n} in {size}: logits cosine {m.cosine:.6f} against eager")

    def run():
        s = cache.add()
        step.run(ids[:n], s)
        cache.release(s)

    run()
    times, host = _timed(run, 5)
    med = statistics.median(times)
    head = cfg.hidden_size * cfg.vocab_size
    flops = 2 * (active_params(model) - head) * n + 2 * head
    dims = {"B": 1, "T": n} if n == size else {"B": 1, "T": n, "rows": size}
    note = (f"{n * 1e3 / med:,.0f} tok/s; replay of a prefill captured for {size} rows"
            + (f" ({size - n} of them padding)" if n < size else "")
            + f", CUDA events around one run() call, median of 5; host {statistics.median(host) * 1e3:.2f} ms per "
              f"call; capture {capture_s:.1f} s; logits against eager model.step: "
            + ", ".join(f"cosine {c['cosine']:.6f}{' (bit-equal)' if c['bit_equal'] else ''}" for c in checks.values()))
    row = _row("decoder.prefill", "lynn nvfp4 (prefill graph)", cfg.name, dims, times, ceilings, flops=flops,
               ceiling="bf16_tflops", note=note, validation={**val, "graph_vs_eager": checks})
    _log(f"{cfg.name}: prefill graph {n} in {size}: {med:.1f} ms ({n * 1e3 / med:,.0f} tok/s), capture "
         f"{capture_s:.1f} s, {checks}")
    info = {"ms": med, "tok_s": n * 1e3 / med, "capture_s": capture_s,
            "host_ms_per_call": statistics.median(host) * 1e3, "checks": checks}
    step = cache = None
    torch.cuda.empty_cache()
    return row, info


def graph_decode(model, ids, batch: int, ceilings: Ceilings, provider: str, nbytes: int,
                 context: int = CONTEXT, pdl: bool = True) -> tuple[list[Result], dict]:
    """Decode of ``batch`` sequences at ``context`` tokens each by CUDA-graph replay of one
    :class:`lynn_model.DecodeStep` (greedy; ``pdl``: its kernels with programmatic dependent launch): GPU time per
    step from CUDA events around ``GRAPH_STEPS`` replays, the host's time per ``replay()`` call beside it. Checked
    first: the graph's tokens equal those of the same step run eagerly with plain launches on a second cache, 8
    steps from the same prefill."""
    from lynn_model import DecodeStep, Sampling, SamplingParams

    cfg, dev = model.config, ids.device
    runs = {}
    for graph in (False, True):
        cache = model.new_cache(max_batch=batch, max_tokens=batch * (context + GRAPH_STEPS + 64))
        t0 = time.perf_counter()
        step = DecodeStep(model, cache, batch, SamplingParams.build([Sampling()] * batch, dev, cfg.vocab_size),
                          graph=graph, pdl=pdl and graph)
        capture_s = time.perf_counter() - t0
        slots = [cache.add() for _ in range(batch)]
        with torch.no_grad():
            first = torch.cat([model.step(ids[b:b + context], cache, [s], [context]).argmax(-1)
                               for b, s in enumerate(slots)])
        cache.reserve(slots, [context + GRAPH_STEPS + 16] * batch)
        step.begin(first, slots)
        toks = []
        for _ in range(8):
            step.replay()
            toks.append(step.tokens.tolist())
        runs[graph] = (toks, step, cache, capture_s)
    exact = runs[True][0] == runs[False][0]
    if not exact:
        raise AssertionError(f"batch {batch}: graph tokens {runs[True][0]} differ from eager {runs[False][0]}")
    step, capture_s = runs[True][1], runs[True][3]
    del runs[False]
    times, host = _timed(step.replay, 5, inner=GRAPH_STEPS // 5)
    med = statistics.median(times)
    val = {"passed": True, "graph_tokens_equal_eager": exact, "steps_compared": 8}
    dims = {"B": batch, "context": context}
    row = _row("decoder.decode", provider, cfg.name, dims, times, ceilings, bytes_=nbytes,
               ceiling="read_gbps" if nbytes else None,
               note=f"{batch * 1e3 / med:,.1f} tok/s{' aggregate' if batch > 1 else ''}; replay of a captured step, "
                    f"CUDA events over {GRAPH_STEPS // 5} replays, median of 5; host "
                    f"{statistics.median(host) * 1e6:.0f} us per replay() call; graph tokens = eager tokens over 8 "
                    f"steps; {'PDL launches' if pdl else 'plain launches'}", validation=val)
    _log(f"{cfg.name}: graph decode, batch {batch}, context {context}: {med:.3f} ms/step "
         f"({batch * 1e3 / med:,.1f} tok/s), capture {capture_s:.1f} s")
    info = {"ms_per_step": med, "tok_s": batch * 1e3 / med, "capture_s": capture_s,
            "host_us_per_replay": statistics.median(host) * 1e6}
    step = runs = None
    torch.cuda.empty_cache()
    return [row], info


def generate_row(model, ids, ceilings: Ceilings, nbytes: int) -> Result:
    """What ``lynn_model.generate`` gives a user on the GPU (``model`` fused for decode, as ``from_pretrained``
    loads it there): a ``CONTEXT``-token prompt, 128 new tokens (greedy), the decode step captured and replayed, the
    host reading tokens one step behind."""
    import lynn_model

    stats = lynn_model.Stats()
    prompt = ids[None, :CONTEXT].cpu()
    lynn_model.generate(model, prompt, 16)                            # compile / autotune the prefill shapes
    lynn_model.generate(model, prompt, 128, stats=stats)
    ms = stats.decode_s * 1e3 / max(1, stats.decode_steps)
    _log(f"{model.config.name}: generate(): prefill {stats.prefill_tok_s:,.0f} tok/s, decode {stats.decode_tok_s:.1f}"
         f" tok/s, capture {stats.capture_s:.1f} s")
    return _row("decoder.decode", "lynn nvfp4 generate() (graph)", model.config.name, {"B": 1, "context": CONTEXT},
                [ms], ceilings, bytes_=nbytes, ceiling="read_gbps",
                note=f"{stats.decode_tok_s:.1f} tok/s over {stats.decode_steps} steps, host-timed loop; capture "
                     f"{stats.capture_s:.1f} s, prefill {stats.prefill_tok_s:,.0f} tok/s; host "
                     f"{stats.launch_s * 1e6 / max(1, stats.decode_steps):.0f} us a step in replay(), waiting for "
                     f"tokens {stats.wait_s / max(stats.decode_s, 1e-9):.0%} of the decode")


def census(model, batch: int = 1, ceilings: Ceilings | None = None) -> dict:
    """Kernels (GPU operations: kernels, copies, memsets) and their GPU time in one decode step of ``batch``
    sequences at ``CONTEXT`` tokens each, by part, from the CUDA profiler over one eager run of each part on a
    :class:`lynn_model.DecodeStep`'s static buffers, the L2 flushed first (a step finds each layer's weights cold);
    ``per_step`` adds them up by the layer counts, ``whole_step`` profiles the whole step as a check. Beside each
    part with a byte count (:func:`part_bytes`): its bytes, its ideal time at ``ceilings``' read bandwidth and the
    efficiency (ideal / measured)."""
    import torch.nn.functional as F

    import lynn_kernels
    from lynn_model import DecodeStep, Sampling, SamplingParams
    from lynn_model.model import PreNorm

    cfg = model.config
    cache = model.new_cache(max_batch=batch, max_tokens=batch * (CONTEXT + 64))
    step = DecodeStep(model, cache, batch, SamplingParams.build([Sampling()] * batch, "cuda", cfg.vocab_size),
                      graph=False)
    slots = [cache.add() for _ in range(batch)]
    with torch.no_grad():
        first = torch.cat([model.step(torch.randint(0, cfg.vocab_size, (CONTEXT,), device="cuda"), cache, [s],
                                      [CONTEXT]).argmax(-1) for s in slots])
    cache.reserve(slots, [CONTEXT + 64] * batch)
    step.begin(first, slots)
    step.prologue()
    x = torch.randn(batch, cfg.hidden_size, device="cuda", dtype=model.dtype)
    logits = torch.randn(batch, cfg.vocab_size, device="cuda", dtype=model.dtype)
    gdn = next(m for m in model.layers if m.kind != "full_attention")
    attn = next(m for m in model.layers if m.kind == "full_attention")
    folded = model.fused_norms      # each part then takes its input un-normed (a PreNorm): the norm in its launch
    pre = (lambda layer_norm: PreNorm(x, x, layer_norm)) if folded else (lambda _: x)
    parts = {
        "embedding": (lambda: F.embedding(step.tokens, model.embed_tokens), 1),
        "step prologue (positions, slots, lengths)": (step.prologue, 1),
        "norm + residual add": (lambda: model.norm(x, residual=x), 1 if folded else 2 * cfg.num_hidden_layers + 1),
        "Gated DeltaNet mixer": (lambda: gdn.mixer(pre(gdn.input_layernorm), step.batch, cache),
                                 len(cfg.linear_layers)),
        "gated attention mixer": (lambda: attn.mixer(pre(attn.input_layernorm), step.batch, cache),
                                  len(cfg.attention_layers)),
        "MoE block (router, experts, shared expert)": (lambda: model.layers[0].mlp(
            pre(model.layers[0].post_attention_layernorm)), cfg.num_hidden_layers),
        "MoE block, shared gate unfolded (not in the sum)": (lambda: _unfolded_moe(model.layers[0].mlp, x), 0),
        "MoE block, 64-bit top-k keys (not in the sum)": (lambda: _key64_moe(model.layers[0].mlp, x), 0),
        "Gated DeltaNet mixer, decode fused (not in the sum)": (lambda: _fused_gdn(gdn.mixer, x, step.batch, cache),
                                                                0),
        "LM head": (lambda: model.lm_head(x), 1),
        "sampler + epilogue": (lambda: step.epilogue(logits), 1),
    }
    out = {}
    with torch.inference_mode(), lynn_kernels.trusted():
        for name, (fn, times) in parts.items():
            try:
                n, us, detail = _profile(fn)
            except Exception as err:             # a comparison part (not in the sum) may fail alone, recorded
                if times:
                    raise
                out[name] = {"kernels": 0, "us": 0.0, "per_step": 0, "error": f"{type(err).__name__}: {err}"}
                continue
            out[name] = {"kernels": n, "us": us, "per_step": times, "detail": detail}
        n, us, _ = _profile(step._forward)
    if ceilings is not None:
        for name, nbytes in part_bytes(model, batch).items():
            if name in out and out[name]["us"]:
                ideal = nbytes / (ceilings.read_gbps * 1e3)
                out[name].update(bytes=nbytes, ideal_us=ideal, efficiency=ideal / out[name]["us"])
    total = sum(v["kernels"] * v["per_step"] for v in out.values())
    out["per_step"] = {"kernels": total, "us": sum(v["us"] * v["per_step"] for v in out.values() if "us" in v)}
    out["whole_step"] = {"kernels": n, "us": us}
    for name, v in out.items():
        _log(f"census {name}: {v['kernels']} kernels, {v['us']:.1f} us" + (f" x {v['per_step']}" if "per_step" in v
                                                                             and name != "per_step" else "")
             + (f"; {v['bytes'] / 1e6:.2f} MB, ideal {v['ideal_us']:.1f} us, {v['efficiency']:.0%}"
                if "bytes" in v else ""))
        if len(v.get("detail", ())) > 1:
            _log("    " + ", ".join(f"{k} {t:.1f}" for k, t in v["detail"]))
    step = cache = None
    return out


#: the parts of a prefill, by kernel name (first match wins): what :func:`prefill_census` groups the profile into
PREFILL_PARTS = (
    ("experts (routed + shared): gate_up", r"_moe_(packed_)?gate_up_kernel"),
    ("experts (routed + shared): down", r"_moe_(packed_)?down_kernel"),
    ("MoE combine", r"_moe_combine_kernel"),
    ("MoE routing (router, top-k, align)", r"_route|_router|_align_"),
    ("weights' dequantise (dense projections; experts' w13 in long prefills)", r"dequantize_kernel"),
    ("dense projections: GEMM", r"gemm|nvjet|cutlass|xmma|sm90_"),
    ("attention: flash prefill", r"_flash_prefill_kernel"),
    ("attention: q/k norm, RoPE", r"_qk_norm_rope_kernel"),
    ("Gated DeltaNet: conv", r"_causal_conv1d_kernel"),
    ("Gated DeltaNet: chunk kernels", r"_chunk_|_gated_rmsnorm"),
    ("norms", r"rmsnorm"),
    ("other (copies, casts, elementwise)", r""),
)


def prefill_flops(model, n: int) -> dict[str, float]:
    """FLOPs of a fresh ``n``-token prefill per part of :data:`PREFILL_PARTS` that has a count: the experts' rows
    (the routed experts' ``top_k`` per token and the shared expert's one, which a prefill runs through the same two
    kernels: gate_up ``2 n (k I + Is) 2H``, down ``2 n (k I + Is) H`` a layer), causal attention (``2 n^2 heads
    head_dim`` a layer: QK^T and PV over half the square), and the dense projections: every other multiply of
    :func:`active_params` (router and gates included), the LM head for the last token only."""
    from lynn_model.model import SparseMoE

    c = model.config
    moe_layers = sum(1 for m in model.layers if isinstance(m.mlp, SparseMoE))
    rows = c.num_experts_per_tok * c.moe_intermediate_size + c.shared_expert_intermediate_size   # per token
    H = c.hidden_size
    gate_up, down = 2 * n * rows * 2 * H * moe_layers, 2 * n * rows * H * moe_layers
    head = c.hidden_size * c.vocab_size
    dense = 2 * n * (active_params(model) - 3 * rows * H * moe_layers - head) + 2 * head
    attention = 2 * n * n * c.num_attention_heads * c.head_dim * len(c.attention_layers)
    return {"experts (routed + shared): gate_up": gate_up, "experts (routed + shared): down": down,
            "dense projections: GEMM": dense, "attention: flash prefill": attention}


def group_prefill(detail: list[tuple[str, float]], flops: dict[str, float], ceilings: Ceilings | None) -> dict:
    """Kernels ``(name, us)`` summed per part of :data:`PREFILL_PARTS`, each with its share of the whole and, where
    ``flops`` counts it, its TFLOP/s and the fraction of the bf16 peak."""
    import re

    out = {name: {"kernels": 0, "us": 0.0, "names": {}} for name, _ in PREFILL_PARTS}
    for kernel, us in detail:
        part = next(name for name, pattern in PREFILL_PARTS if re.search(pattern, kernel))
        out[part]["kernels"] += 1
        out[part]["us"] += us
        out[part]["names"][kernel] = out[part]["names"].get(kernel, 0.0) + us
    total = sum(v["us"] for v in out.values())
    for name, v in out.items():
        v["share"] = v["us"] / total if total else 0.0
        if name in flops and v["us"]:
            v["tflops"] = flops[name] / (v["us"] * 1e6)
            if ceilings is not None:
                v["frac_of_bf16_peak"] = v["tflops"] / ceilings.bf16_tflops
    out = {k: v for k, v in out.items() if v["kernels"]}
    out["total"] = {"kernels": sum(v["kernels"] for v in out.values()), "us": total}
    return out


def prefill_census(model, ids: torch.Tensor, cache, ceilings: Ceilings | None = None) -> dict:
    """The GPU operations of one fresh prefill of ``ids`` (``model.step``, the profile whose sum is the median of 5)
    grouped into the parts of :data:`PREFILL_PARTS`, with their time, share, TFLOP/s and fraction of the bf16 peak
    (:func:`prefill_flops`; the dense projections' TFLOP/s is their GEMMs' alone, their weights' dequantise a part
    beside it). Logged largest first."""
    n = len(ids)

    def prefill():
        s = cache.add()
        model.step(ids, cache, [s], [n])
        cache.release(s)

    with torch.no_grad():
        _, _, detail = _profile(prefill)
    out = group_prefill(detail, prefill_flops(model, n), ceilings)
    _log(f"prefill census, {n} tokens: {out['total']['us'] / 1e3:.1f} ms of kernels")
    for name, v in sorted(out.items(), key=lambda kv: -kv[1]["us"]):
        if name != "total":
            _log(f"  {name}: {v['kernels']} kernels, {v['us'] / 1e3:.1f} ms ({v['share']:.1%})"
                 + (f", {v['tflops']:.0f} TFLOP/s" if "tflops" in v else "")
                 + (f" ({v['frac_of_bf16_peak']:.0%} of peak)" if "frac_of_bf16_peak" in v else ""))
    return out


@contextlib.contextmanager
def _flag(module: str, name: str, value):
    """``lynn_kernels.moe.<module>.<name> = value`` for the block, then as it was."""
    import importlib

    mod = importlib.import_module(f"lynn_kernels.moe.{module}")
    was = getattr(mod, name)
    setattr(mod, name, value)
    try:
        yield
    finally:
        setattr(mod, name, was)


def _gate_unfolded():
    """The MoE blocks with the shared expert's gate as its own fp32 GEMV and sigmoid (``FOLD_SHARED_GATE=False``)."""
    return _flag("triton_experts", "FOLD_SHARED_GATE", False)


def _router_key64():
    """The router's top-k on 64-bit keys (``triton_route.ROUTER_KEY32`` off)."""
    return _flag("triton_route", "ROUTER_KEY32", False)


def _fused_gdn(mixer, x, batch, cache):
    """The Gated DeltaNet mixer with its decode step as one kernel (``fused_decode``), then as it was."""
    was = mixer.fused_decode
    mixer.fused_decode = True
    try:
        return mixer(x, batch, cache)
    finally:
        mixer.fused_decode = was


def _key64_moe(mlp, x):
    with _router_key64():
        return mlp(x)


def _unfolded_moe(mlp, x):
    with _gate_unfolded():
        return mlp(x)


def _profile(fn) -> tuple[int, float, list[tuple[str, float]]]:
    """GPU operations one call of ``fn`` launches, their summed GPU time (us), median of 5 profiled calls, and each
    operation's name (shortened) and time (us) in launch order, from the run whose sum is that median. The L2 is
    flushed before each profiled call: a part run alone would otherwise find its layer's weights (17-24 MB at the
    35B shape) still in the L2 from the call before, where in a step every layer's are cold."""
    from lynn_kernels.bench.harness import l2_bytes

    fn()
    scrub = torch.empty(2 * l2_bytes(), dtype=torch.int8, device="cuda")
    torch.cuda.synchronize()
    runs = []
    for _ in range(5):
        scrub.zero_()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        ev = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
        runs.append([(_short(e.name), float(e.time_range.elapsed_us())) for e in ev])
    runs.sort(key=lambda r: sum(t for _, t in r))
    mid = runs[len(runs) // 2]
    return int(statistics.median(len(r) for r in runs)), sum(t for _, t in mid), mid


def _short(name: str) -> str:
    """A kernel's name without template arguments or parameter lists, at most 48 characters."""
    for cut in ("<", "("):
        name = name.split(cut)[0]
    return name.strip()[:48]


def _bf16_graph(name: str, ceilings: Ceilings) -> list[Result]:
    """The same decoder with bf16 weights (cuBLAS projections, the bf16-weight MoE kernels), graph-replayed at
    batch 1: what 4-bit weights buy, on the same shapes and the same random draw."""
    import lynn_model
    from lynn_model.loader import random_model

    cfg = lynn_model.preset(name)
    t0 = time.perf_counter()
    model = random_model(cfg, weights="bf16", device="cuda", seed=0)
    torch.cuda.synchronize()
    _log(f"{name}: random bf16 model built in {time.perf_counter() - t0:.1f} s, "
         f"{torch.cuda.memory_allocated() / 1e9:.1f} GB")
    gen = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (CONTEXT + STEPS + 8,), device="cuda", generator=gen)
    rows, _ = graph_decode(model, ids, 1, ceilings, "lynn bf16 weights, cuBLAS (graph)", decode_bytes(model, CONTEXT))
    model = None
    torch.cuda.empty_cache()
    return rows


def _hf(name: str, ceilings: Ceilings) -> list[Result]:
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeForCausalLM

    import lynn_model

    cfg = lynn_model.preset(name)
    hf_cfg = Qwen3_5MoeTextConfig(**{k: v for k, v in cfg.to_hf().items() if k != "model_type"})
    t0 = time.perf_counter()
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = Qwen3_5MoeForCausalLM(hf_cfg).eval()
    finally:
        torch.set_default_dtype(default)
    _log(f"HF {name}: bf16 model built in {time.perf_counter() - t0:.1f} s")
    gen = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (1, CONTEXT + STEPS + 8), device="cuda", generator=gen)
    rows = []
    with torch.no_grad():
        def prefill():
            model(input_ids=ids[:, :PREFILL], use_cache=True)

        prefill()
        times = _events_ms(prefill, 3)
        rows.append(_row("decoder.prefill", "HF transformers bf16 (eager)", cfg.name, {"B": 1, "T": PREFILL}, times,
                         ceilings, flops=2 * _hf_active(cfg) * PREFILL, ceiling="bf16_tflops",
                         note=f"{PREFILL * 1e3 / statistics.median(times):,.0f} tok/s; attn "
                              f"{model.config._attn_implementation}"))
        out = model(input_ids=ids[:, :CONTEXT], use_cache=True)
        cache, pos = getattr(out, "cache", None) or out.past_key_values, {"i": CONTEXT}

        def step():
            model(input_ids=ids[:, pos["i"]:pos["i"] + 1], past_key_values=cache, use_cache=True)
            pos["i"] += 1

        step()
        times = _events_ms(step, 8)
    weights = sum(p.numel() for n, p in model.named_parameters() if ".experts." not in n) * 2
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n) * 2
    nbytes = weights + experts * cfg.num_experts_per_tok // cfg.num_experts \
        - (cfg.vocab_size - 1) * cfg.hidden_size * 2 \
        + 2 * CONTEXT * cfg.num_key_value_heads * cfg.head_dim * 2 * len(cfg.attention_layers) \
        + 2 * 4 * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * \
        len(cfg.linear_layers)
    rows.append(_row("decoder.decode", "HF transformers bf16 (eager)", cfg.name, {"B": 1, "context": CONTEXT},
                     times, ceilings, bytes_=nbytes, ceiling="read_gbps",
                     note=f"{1e3 / statistics.median(times):.1f} tok/s; host-timed step"))
    _log(f"HF {name}: decode {statistics.median(times):.1f} ms/token")
    model = cache = None
    torch.cuda.empty_cache()
    return rows


def _hf_active(cfg) -> int:
    h = cfg.hidden_size
    attn = h * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim + \
        cfg.num_attention_heads * cfg.head_dim * h
    gdn = h * (cfg.conv_dim + cfg.linear_num_value_heads * (cfg.linear_value_head_dim + 2)) + \
        cfg.linear_num_value_heads * cfg.linear_value_head_dim * h
    moe = cfg.num_experts * h + 3 * h * (cfg.moe_intermediate_size * cfg.num_experts_per_tok +
                                         cfg.shared_expert_intermediate_size) + h
    return attn * len(cfg.attention_layers) + gdn * len(cfg.linear_layers) + moe * cfg.num_hidden_layers + \
        cfg.vocab_size * h


def _bench(name: str, with_hf: bool):
    def run(ceilings: Ceilings, quick: bool = False, partial=None) -> list[Result]:
        rows, info = _ours(name, ceilings, partial)
        run.extra = {name: info}          # build time, GB of weights, peak memory, bytes per token, census ("info")
        if with_hf:
            rows += _bf16_graph(name, ceilings)
            if partial:
                partial(list(rows), run.extra, "the bf16 graph baseline")
            rows += _hf(name, ceilings)
        return rows

    run.extra = {}
    return run


# `lynn bench decoder` runs both; each shape is also its own benchmark (the 80B model alone needs ~45 GB)
register("decoder.qwen3.5-35b-a3b")(_bench("qwen3.5-35b-a3b", True))
register("decoder.qwen3-next-80b-a3b")(_bench("qwen3-next-80b-a3b", False))
