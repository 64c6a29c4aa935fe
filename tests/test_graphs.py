"""The decode step on static buffers (``lynn_model.graphs``): its contract on the CPU (eager, as the interpreter
runs it), and on the H200 the captured CUDA graph against the same step run eagerly, token for token, plus the
regression test for graphs disturbing later work."""

from __future__ import annotations

import pytest
import torch

import lynn_kernels
import lynn_model
from lynn_model.loader import random_model

DEV = lynn_kernels.runtime.DEVICE


@pytest.fixture(scope="module")
def tiny():
    with lynn_kernels.use_reference():
        return random_model(lynn_model.preset("tiny-qwen3.5-moe"), weights="bf16", device="cpu", seed=1)


def _params(n, **kw):
    return lynn_model.SamplingParams.build([lynn_model.Sampling(**kw)] * n, "cpu", 512)


def test_bucket_for():
    from lynn_model.graphs import bucket_for

    assert [bucket_for(n) for n in (1, 2, 3, 5, 8, 9, 32)] == [1, 2, 4, 8, 8, 16, 32]
    assert bucket_for(3, None) == 3
    with pytest.raises(ValueError, match="largest decode bucket"):
        bucket_for(33)


def test_decode_step_refuses_a_busy_cache_and_bad_rows(tiny):
    cache = tiny.new_cache(max_batch=4, max_tokens=64)
    with pytest.raises(ValueError, match="rows = 5"):
        lynn_model.DecodeStep(tiny, cache, 5, _params(5))
    with pytest.raises(ValueError, match=r"rows of settings"):
        lynn_model.DecodeStep(tiny, cache, 2, _params(3))
    step = lynn_model.DecodeStep(tiny, cache, 2, _params(2), graph=False)
    slot = cache.add()
    with pytest.raises(ValueError, match="holds no sequence"):
        lynn_model.DecodeStep(tiny, cache, 2, _params(2), graph=False)
    with pytest.raises(ValueError, match="must be 1 rows in 0..1"):
        step.begin(torch.tensor([3]), [2])
    with pytest.raises(ValueError, match="not an active sequence"):
        step.begin(torch.tensor([3]), [1])
    step.begin(torch.tensor([3]), [slot])
    assert step.active.tolist() == [True, False] and step.tokens.tolist() == [3, 0]
    with pytest.raises(ValueError, match="graph=True needs"):
        lynn_model.DecodeStep(tiny, tiny.new_cache(max_batch=1, max_tokens=16), 1, _params(1), graph=True)


def test_an_idle_row_writes_nothing(tiny):
    """Row 1 idles (padding): its cache pages, its length and row 0's tokens are what they are without it."""
    with lynn_kernels.use_reference(), torch.no_grad():
        runs = []
        for rows in (1, 2):
            cache = tiny.new_cache(max_batch=2, max_tokens=64)
            step = lynn_model.DecodeStep(tiny, cache, rows, _params(rows), graph=False)
            s = cache.add()
            logits = tiny.step(torch.tensor([5, 6, 7]), cache, [s], [3])
            cache.reserve([s], [8])
            step.begin(logits.argmax(-1), [s])
            toks = []
            for _ in range(4):
                step.replay()
                toks.append(int(step.tokens[0]))
            layer = tiny.config.attention_layers[0]
            runs.append((toks, step.lengths.tolist(), cache.k[layer].clone()))
        (t1, l1, k1), (t2, l2, k2) = runs
        assert t1 == t2 and l1 == [7] and l2 == [7, 0]
        assert torch.equal(k1, k2)


def test_the_step_flags_non_finite_logits(tiny):
    """``finite`` (the second row of ``out``, which the host reads with the tokens) is 1 where the row's logits are
    finite, 0 once they are not (the final norm's weight NaN)."""
    norm = tiny.norm.weight.clone()
    with lynn_kernels.use_reference(), torch.no_grad():
        cache = tiny.new_cache(max_batch=2, max_tokens=64)
        step = lynn_model.DecodeStep(tiny, cache, 2, _params(2), graph=False)
        s = cache.add()
        logits = tiny.step(torch.tensor([5, 6, 7]), cache, [s], [3])
        cache.reserve([s], [8])
        step.begin(logits.argmax(-1), [s])
        step.replay()
        assert step.finite[s] == 1 and torch.equal(step.out[0], step.tokens)
        try:
            tiny.norm.weight.fill_(float("nan"))
            step.replay()
            assert step.finite[s] == 0
        finally:
            tiny.norm.weight.copy_(norm)


def test_reserve_and_release_keep_the_block_table_honest(tiny):
    cache = tiny.new_cache(max_batch=2, max_tokens=64)
    s = cache.add()
    cache.reserve([s], [40])                       # 3 pages of 16
    assert len(cache._blocks[s]) == 3 and cache.block_table[s, :3].tolist() == [0, 1, 2]
    with pytest.raises(lynn_model.CacheFull):
        t = cache.add()
        cache.reserve([t], [64])
    cache.release(s)
    assert cache.block_table[s].abs().sum() == 0   # no stale page numbers left for a captured step to read
    with pytest.raises(ValueError, match="at most"):
        cache.reserve([t], [1000])


# ---------------------------------------------------------------------------------------------------------------
# the captured prefill (its eager form: what the graph replays)


@pytest.mark.parametrize("preset", ["tiny-qwen3.5-moe", "tiny-qwen3-next"])
def test_padded_prefill_equals_the_plain_one(preset):
    """A prompt of n tokens in a PrefillStep of 40 rows (40 - n of them padding) leaves what model.step(n) leaves:
    the same last-token logits, the same conv states and KV pools, the recurrent states within 1e-6 (the chunked
    scan's tiles see the padding's zeros), and the next decode step gives the same logits; one step serves prompts
    of several lengths in turn. NVFP4 weights, the kernels (the interpreter on a CPU)."""
    with lynn_kernels.use_reference():          # quantised on the reference: the kernel's bits, 30x faster here
        model = random_model(lynn_model.preset(preset), weights="nvfp4", device=DEV, seed=2)
    c = model.config
    ids = torch.randint(0, c.vocab_size, (40,), generator=torch.Generator().manual_seed(3)).to(DEV)
    plain, padded = model.new_cache(max_batch=2, max_tokens=128), model.new_cache(max_batch=2, max_tokens=128)
    step = lynn_model.PrefillStep(model, padded, 40, graph=False)
    with torch.no_grad():
        for n in (37, 5):
            a, b = plain.add(), padded.add()
            want, got = model.step(ids[:n], plain, [a], [n]), step.run(ids[:n], b)
            assert torch.equal(got, want), n
            assert padded.lengths[b] == n
            for i in c.linear_layers:
                assert torch.equal(padded.conv[i][b], plain.conv[i][a]), (n, i)
                torch.testing.assert_close(padded.state[i][b], plain.state[i][a], rtol=0, atol=1e-6)
            for i in c.attention_layers:
                # the whole pools: the padding wrote no key (the same history went into both caches)
                assert torch.equal(plain.k[i], padded.k[i]) and torch.equal(plain.v[i], padded.v[i]), (n, i)
            nxt = want.argmax(-1)
            torch.testing.assert_close(model.step(nxt, padded, [b], [1]), model.step(nxt, plain, [a], [1]),
                                       rtol=0, atol=1e-2)
            plain.release(a)
            padded.release(b)


def test_prefill_step_refuses_what_it_cannot_run(tiny):
    cache = tiny.new_cache(max_batch=2, max_tokens=64)
    with pytest.raises(ValueError, match="exceeds the cache"):
        lynn_model.PrefillStep(tiny, cache, 128, graph=False)
    with pytest.raises(ValueError, match="positive int"):
        lynn_model.PrefillStep(tiny, cache, 0, graph=False)
    step = lynn_model.PrefillStep(tiny, cache, 16, graph=False)
    s = cache.add()
    with pytest.raises(ValueError, match="holds no sequence"):
        lynn_model.PrefillStep(tiny, cache, 16, graph=False)
    with pytest.raises(ValueError, match="17 tokens; this PrefillStep takes 1..16"):
        step.run(torch.zeros(17, dtype=torch.long), s)
    with pytest.raises(ValueError, match="int64"):
        step.run(torch.zeros(4, dtype=torch.int32), s)
    with pytest.raises(ValueError, match="not an active sequence"):
        step.run(torch.zeros(4, dtype=torch.long), 1)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 512\)"):
        step.run(torch.tensor([3, 512]), s)
    assert cache.lengths[s] == 0 and not cache.broken[s]
    with lynn_kernels.use_reference(), torch.no_grad():
        step.run(torch.tensor([3, 4, 5]), s)
    assert cache.lengths[s] == 3
    with pytest.raises(ValueError, match="already holds 3 tokens"):
        step.run(torch.tensor([6]), s)
    with pytest.raises(ValueError, match="graph=True needs"):
        lynn_model.PrefillStep(tiny, tiny.new_cache(max_batch=1, max_tokens=16), 8, graph=True)


# ---------------------------------------------------------------------------------------------------------------
# H200


def _gen(model, prompts, n, graph, **kw):
    stats = lynn_model.Stats()
    out = lynn_model.generate(model, prompts, n, cuda_graph=graph, stats=stats, **kw)
    return out, stats


def _graph_equals_eager(model, prompts, settings):
    """24 tokens of each prompt, eager and captured, under each of ``settings``: the same tokens."""
    for kw in settings:
        eager, _ = _gen(model, prompts, 24, False, **kw)
        graph, stats = _gen(model, prompts, 24, True, **kw)
        assert graph.tolist() == eager.tolist(), kw
        assert stats.decode_steps == 23


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["tiny-qwen3.5-moe", "tiny-qwen3-next"])
@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("weights", ["nvfp4", "bf16"])
def test_gpu_graph_decode_equals_eager_bit_for_bit(preset, batch, weights):
    """The captured step and the same step run eagerly give the same tokens, greedy and sampled, for a batch of
    prompts of different lengths (batch 3 runs in bucket 4: one idle row)."""
    model = random_model(lynn_model.preset(preset), weights=weights, device="cuda", seed=3)
    gen = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(0, model.config.vocab_size, (5 + 7 * b,), generator=gen).tolist() for b in range(batch)]
    _graph_equals_eager(model, prompts, ({}, {"temperature": 0.9, "top_k": 40, "top_p": 0.95, "seed": 5},
                                         {"temperature": 1.0, "seed": 9}))


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["tiny-qwen3.5-moe", "tiny-qwen3-next"])
@pytest.mark.parametrize("batch", [1, 8])
def test_gpu_fused_graph_decode_equals_eager(preset, batch):
    """The step as the loaders give it on a GPU (``fuse=None``) and ``lynn generate`` runs it (each mixer's input
    projections in one GEMV, each Gated DeltaNet decode step in one kernel with its gates' projections): the model
    comes fused, and captured and eager give the same tokens,
    greedy and sampled, over 24 steps (the fused model against the unfused one is tests/test_model.py's)."""
    model = random_model(lynn_model.preset(preset), weights="nvfp4", device="cuda", seed=6)   # fused as loaded
    assert model.fuse_input_projections() == {} and len(model.config.linear_layers) > 0
    assert all(layer.mixer.fused_decode for layer in model.layers if layer.kind != "full_attention")
    gen = torch.Generator().manual_seed(batch + 20)
    prompts = [torch.randint(0, model.config.vocab_size, (4 + 5 * b,), generator=gen).tolist() for b in range(batch)]
    _graph_equals_eager(model, prompts, ({}, {"temperature": 0.9, "top_k": 40, "top_p": 0.95, "seed": 5}))


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["tiny-qwen3.5-moe", "tiny-qwen3-next"])
def test_gpu_pdl_step_equals_plain_launches(preset, monkeypatch):
    """The captured step with programmatic dependent launch (each kernel starting while the one before it
    finishes) gives the tokens of the same step with plain launches, greedy and sampled, over 40 steps of a batch
    of 3; and the GPU does support it (else the first run would have been plain too)."""
    from lynn_kernels import runtime

    assert runtime.pdl_supported(), "the GPU tests run on Hopper: PDL should be on"
    model = random_model(lynn_model.preset(preset), weights="nvfp4", device="cuda", seed=8)
    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, model.config.vocab_size, (3 + 9 * b,), generator=gen).tolist() for b in range(3)]
    for kw in ({}, {"temperature": 0.8, "top_k": 20, "seed": 2}):
        pdl, _ = _gen(model, prompts, 40, True, **kw)
        with monkeypatch.context() as m:
            m.setattr(runtime, "pdl_supported", lambda: False)
            plain, _ = _gen(model, prompts, 40, True, **kw)
        assert pdl.tolist() == plain.tolist(), kw


@pytest.mark.gpu
def test_gpu_graph_step_stops_at_non_finite_logits():
    """The captured step computes its finite flags inside the graph: weights damaged once the first token is out
    stop generate at the first decode step, greedy and sampled, batch 1 and 3."""
    model = random_model(lynn_model.preset("tiny-qwen3.5-moe"), weights="bf16", device="cuda", seed=3)
    norm = model.norm.weight.clone()
    for prompts, kw in (([[1, 2, 3]], {}), ([[1, 2, 3], [4, 5], [6]], {"temperature": 0.9, "top_k": 20, "seed": 1})):
        with pytest.raises(lynn_model.NonFiniteError, match=r"not finite \(NaN or inf\) at new token 2"):
            lynn_model.generate(model, prompts, 8, cuda_graph=True, stream=lambda t: model.norm.weight.fill_(
                float("nan")), **kw)
        model.norm.weight.copy_(norm)
        _gen(model, prompts, 8, True, **kw)                     # and the same model, mended, runs to the end


@pytest.mark.gpu
def test_gpu_graph_replays_leave_later_kernels_exact():
    """The regression test for the disturbance issue 2 saw (a later dequantise wrong after graph timing): capture
    and replay decode steps and launch graphs of the NVFP4 kernels into outputs of their own, free them, then
    quantise and dequantise fresh tensors of 8192^2 and compare them bit for bit with the reference."""
    from lynn_kernels import nvfp4
    from lynn_kernels.nvfp4.triton_quant import launch_dequantize

    model = random_model(lynn_model.preset("tiny-qwen3.5-moe"), weights="nvfp4", device="cuda", seed=4)
    for _ in range(3):
        _gen(model, [[1, 2, 3], [4, 5]], 16, True)
    w = nvfp4.quantize(torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16))
    outs = [torch.empty(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        launch_dequantize(w, outs[0])
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(g):
        for o in outs:
            launch_dequantize(w, o)
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    del g, outs
    torch.cuda.empty_cache()
    for seed in range(3):
        gen = torch.Generator("cuda").manual_seed(seed)
        x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16, generator=gen)
        q, want = nvfp4.quantize(x), nvfp4.reference.quantize(x)
        assert torch.equal(q.codes, want.codes) and torch.equal(q.scales, want.scales)
        assert torch.equal(nvfp4.dequantize(q), nvfp4.reference.dequantize(q))


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["tiny-qwen3.5-moe", "tiny-qwen3-next"])
@pytest.mark.parametrize("weights", ["nvfp4", "bf16"])
def test_gpu_prefill_graph_equals_eager(preset, weights):
    """The captured prefill and the same step run eagerly leave the same bits (logits, states, KV pages) for
    prompts of 200 (padding 56), 256 and 7 tokens through one 256-row graph; against model.step of each prompt
    alone: logits within bf16 rounding (cuBLAS may pick another kernel for another row count), and so are those of
    the decode step after it."""
    model = random_model(lynn_model.preset(preset), weights=weights, device="cuda", seed=5)
    c = model.config
    ids = torch.randint(0, c.vocab_size, (256,), generator=torch.Generator().manual_seed(7)).cuda()
    caches = [model.new_cache(max_batch=1, max_tokens=512) for _ in range(2)]
    steps = [lynn_model.PrefillStep(model, cache, 256, graph=g) for cache, g in zip(caches, (False, True))]
    assert steps[1].graph is not None
    with torch.no_grad():
        for n in (200, 256, 7):
            outs = []
            for cache, step in zip(caches, steps):
                s = cache.add()
                outs.append(step.run(ids[:n], s).clone())
            assert torch.equal(outs[0], outs[1]), n
            for i in c.linear_layers:
                assert torch.equal(caches[0].conv[i][0], caches[1].conv[i][0])
                assert torch.equal(caches[0].state[i][0], caches[1].state[i][0])
            for i in c.attention_layers:
                assert torch.equal(caches[0].k[i], caches[1].k[i]) and torch.equal(caches[0].v[i], caches[1].v[i])
            plain = model.new_cache(max_batch=1, max_tokens=512)
            s = plain.add()
            want = model.step(ids[:n], plain, [s], [n])
            torch.testing.assert_close(outs[1].float(), want.float(), rtol=0.05, atol=0.05)
            nxt = want.argmax(-1)                 # the next decode step from each cache (the two graph-step
            after = [model.step(nxt, cache, [0], [1]) for cache in caches]      # caches stay twins)
            assert torch.equal(after[0], after[1])
            torch.testing.assert_close(after[1].float(), model.step(nxt, plain, [s], [1]).float(), rtol=0.05,
                                       atol=0.05)
            for cache in caches:
                cache.release(0)
