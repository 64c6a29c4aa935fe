"""The decoder against HF transformers on tiny random models of all five classes, and against itself (cache,
chunked prefill, batching, NVFP4 vs its dequantised weights).

* reference path (every op on its torch reference), fp32, vs HF fp32: logits within 1e-4 relative;
* kernel path (the interpreter on a CPU, compiled on a GPU), bf16, vs HF eager bf16: the logits' error against HF
  fp32 no larger than HF bf16's own (error ratio), greedy tokens equal over 32 steps;
* prefill + decode = one full forward; chunked prefill = one-shot; a batch of 3 different lengths = each alone.
"""

from __future__ import annotations

import collections
import copy
import re
import shutil
import time

import pytest
import tiny_hf
import torch

import lynn_kernels
import lynn_model
from lynn_kernels import metrics
from lynn_model import loader
from lynn_model.config import MAX_EXPERTS

ON_GPU = torch.cuda.is_available()
PROMPT = 70                      # more than one 64-token chunk of the Gated DeltaNet prefill
FAMILY_OF = {"next": "qwen3_next", "q35": "qwen3_5", "q35moe": "qwen3_5_moe", "q35vl": "qwen3_5",
             "q35moevl": "qwen3_5_moe"}
ONE_PER_FAMILY = ("next", "q35", "q35moe")

#: fixtures that load an oracle package (tests/conftest.py counts the tests that use them)
ORACLE_FIXTURES = {"ckpts": "transformers", "hf_logits": "transformers", "testers": "transformers"}


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory) -> dict:
    """The five tiny HF checkpoints (fp32 safetensors), built once per session."""
    root = tmp_path_factory.mktemp("tiny_hf")
    return {name: tiny_hf.save(name, root / name) for name in tiny_hf.NAMES}


@pytest.fixture(scope="session")
def hf_logits(ckpts) -> dict:
    """HF's logits on the shared prompt: ``{(name, dtype): [1, T, V]}``."""
    out = {}
    for name, d in ckpts.items():
        for dtype in (torch.float32, torch.bfloat16):
            with torch.no_grad():
                out[name, dtype] = tiny_hf.load(d, dtype)(input_ids=_ids(), use_cache=False).logits.float()
    return out


def _ids(n: int = PROMPT, seed: int = 0, batch: int = 1) -> torch.Tensor:
    return torch.randint(0, 500, (batch, n), generator=torch.Generator().manual_seed(seed))


def _load(folder, weights: str = "auto", **kw):
    """``from_pretrained``; quantising on load (``weights="nvfp4"``) goes through the torch reference, which gives
    the quantiser kernel's bits (tests/test_nvfp4.py) 30x faster under the interpreter. Only the load: what the
    tests then run is on the kernels. The projections stay as stored (``fuse=False``) unless ``kw`` says."""
    kw.setdefault("fuse", False)
    with lynn_kernels.use_reference(weights == "nvfp4"):
        return lynn_model.from_pretrained(folder, weights=weights, **kw)


@pytest.mark.parametrize("name", tiny_hf.NAMES)
def test_reference_path_matches_hf_fp32(ckpts, hf_logits, name):
    with lynn_kernels.use_reference(), torch.no_grad():
        model = lynn_model.from_pretrained(ckpts[name], device="cpu")
        assert model.dtype == torch.float32 and model.config.family == FAMILY_OF[name]
        got = model.forward(_ids()).float()
    want = hf_logits[name, torch.float32]
    m = metrics.compare(got, want)
    assert m.max_abs <= 1e-4 * want.abs().max().item() and m.rel_l2 < 1e-5, m     # measured: rel_l2 ~2e-7


@pytest.mark.oracle("transformers")
def test_decoder_sparse_step_places_moe_layers_as_hf(tmp_path):
    """Qwen3-Next with ``decoder_sparse_step = 2`` and a dense layer listed in ``mlp_only_layers``: a layer is MoE
    where HF builds one ((i + 1) % step == 0 and i not listed), dense elsewhere, and the logits equal HF's
    (reference path, fp32)."""
    hf = tiny_hf.build("next", decoder_sparse_step=2, mlp_only_layers=[3])
    kinds = tuple("moe" if type(layer.mlp).__name__.endswith("SparseMoeBlock") else "mlp" for layer in hf.model.layers)
    assert kinds == ("mlp", "moe", "mlp", "mlp")                  # what HF itself built from the config
    hf.save_pretrained(tmp_path)
    with lynn_kernels.use_reference(), torch.no_grad():
        model = lynn_model.from_pretrained(tmp_path, device="cpu")
        assert model.config.ffn_types == kinds
        got = model.forward(_ids()).float()
        want = hf(input_ids=_ids(), use_cache=False).logits.float()
    m = metrics.compare(got, want)
    assert m.max_abs <= 1e-4 * want.abs().max().item() and m.rel_l2 < 1e-5, m


@pytest.mark.parametrize("name", tiny_hf.NAMES)
def test_kernel_path_matches_hf_bf16(ckpts, hf_logits, name):
    """bf16 on the kernels: as close to HF fp32 as HF's own bf16 forward is (measured on the CPU: error ratios
    0.94-1.12, cosines 0.99992-0.99998, HF bf16's own 0.99993-0.99998)."""
    model = lynn_model.from_pretrained(ckpts[name], weights="bf16")
    with torch.no_grad():
        got = model.forward(_ids().to(model.device))
    assert got.dtype == torch.bfloat16
    m = metrics.compare(got, hf_logits[name, torch.float32], baseline=hf_logits[name, torch.bfloat16])
    assert m.cosine > 0.9998 and m.err_ratio < 1.5, m


@pytest.mark.parametrize("name", ONE_PER_FAMILY)
def test_greedy_tokens_match_hf_bf16(ckpts, name):
    ids = _ids(9, seed=1)
    with torch.no_grad():
        want = tiny_hf.load(ckpts[name], torch.bfloat16).generate(ids, max_new_tokens=32, do_sample=False)
    model = lynn_model.from_pretrained(ckpts[name], weights="bf16")
    got = lynn_model.generate(model, ids, 32)
    assert got.shape == want.shape
    assert got.tolist() == want.tolist()


# -- the cache ----------------------------------------------------------------------------------------------------


def _fp32_kernel_model(ckpts, name):
    return lynn_model.from_pretrained(ckpts[name], dtype=torch.float32)


@pytest.mark.parametrize("name", ONE_PER_FAMILY)
def test_chunked_prefill_and_decode_equal_one_full_forward(ckpts, name):
    """fp32 on the kernels: a prefill in two chunks (40 + 27 tokens) then three decode steps give the logits of one
    full forward of the 70 tokens (chunk vs recurrent rule, flash vs split-KV attention: fp32 rounding only)."""
    model, ids = _fp32_kernel_model(ckpts, name), _ids()[0].to(lynn_kernels.runtime.DEVICE)
    with torch.no_grad():
        full = model.forward(ids[None])[0]
        cache = model.new_cache(max_batch=1, max_tokens=96)
        s = cache.add()
        parts = [model.step(ids[:40], cache, [s], [40], all_logits=True),
                 model.step(ids[40:67], cache, [s], [27], all_logits=True)]
        parts += [model.step(ids[j:j + 1], cache, [s], [1]) for j in range(67, 70)]
    assert cache.lengths[s] == 70
    m = metrics.compare(torch.cat(parts), full)
    assert m.rel_l2 < 1e-5, m                                                 # measured ~1e-7


@pytest.mark.parametrize("name", ONE_PER_FAMILY)
def test_batch_of_three_lengths_equals_each_alone(ckpts, name):
    """One packed prefill of 70 / 33 / 5 tokens (varlen: no padding), then two batched decode steps, against each
    sequence run alone (fp32 on the kernels)."""
    model = _fp32_kernel_model(ckpts, name)
    ids = _ids()[0].to(model.device)
    lens, nxt = [70, 33, 5], torch.tensor([[7, 8, 9], [17, 18, 19]], device=model.device)
    with torch.no_grad():
        cache = model.new_cache(max_batch=4, max_tokens=160)
        slots = [cache.add() for _ in lens]
        got = [model.step(torch.cat([ids[:n] for n in lens]), cache, slots, lens, all_logits=True)]
        got += [model.step(nxt[j], cache, slots, [1, 1, 1]) for j in range(2)]
        alone = []
        for b, n in enumerate(lens):
            seq = torch.cat([ids[:n], nxt[:, b]])
            alone.append(model.forward(seq[None])[0])
    want = torch.cat([a[:n] for a, n in zip(alone, lens)] + [torch.stack([a[n + j] for a, n in zip(alone, lens)])
                                                                 for j in range(2)])
    m = metrics.compare(torch.cat(got), want)
    assert m.rel_l2 < 1e-5, m


def test_decode_on_non_consecutive_slots(ckpts):
    """Sequences in slots 0 and 2 (slot 1 released): the states are gathered and scattered back."""
    model = _fp32_kernel_model(ckpts, "q35")
    ids = _ids(12)[0].to(model.device)
    with torch.no_grad():
        cache = model.new_cache(max_batch=3, max_tokens=96)
        a, b, c = cache.add(), cache.add(), cache.add()
        cache.release(b)
        model.step(torch.cat([ids[:5], ids[:9]]), cache, [a, c], [5, 9])
        got = model.step(torch.tensor([3, 4], device=model.device), cache, [c, a], [1, 1])
        want = torch.stack([model.forward(torch.cat([ids[:9], ids.new_tensor([3])])[None])[0, -1],
                            model.forward(torch.cat([ids[:5], ids.new_tensor([4])])[None])[0, -1]])
    assert metrics.compare(got, want).rel_l2 < 1e-5


def test_cache_full_and_batch_too_large_raise_before_writing(ckpts):
    model = _fp32_kernel_model(ckpts, "q35")
    cache = model.new_cache(max_batch=2, max_tokens=32)             # two pages of 16
    s = cache.add()
    cache.add()
    with pytest.raises(lynn_model.CacheFull, match="sequence slots"):
        cache.add()
    before = [t.clone() for t in cache.k.values()]
    with pytest.raises(lynn_model.CacheFull, match="holds 32 tokens"):
        model.step(torch.zeros(33, dtype=torch.long, device=model.device), cache, [s], [33])
    assert cache.lengths[s] == 0 and all(torch.equal(x, y) for x, y in zip(before, cache.k.values()))
    with pytest.raises(ValueError, match="token ids must lie in"):
        model.step(torch.tensor([512], device=model.device), cache, [s], [1])


# -- NVFP4 --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ONE_PER_FAMILY)
def test_nvfp4_model_equals_its_dequantised_weights_on_the_references(ckpts, name):
    """Quantised on load (kernels: packed GEMV / GEMM, grouped NVFP4 experts) against the same NVFP4 values
    dequantised to fp32 and run on the references (fp32 activations: the products differ only in fp32 rounding)."""
    model = _load(ckpts[name], weights="nvfp4", dtype=torch.float32)
    linears = [m for m in model.modules() if isinstance(m, lynn_model.model.Linear)]
    assert any(m.quantized for m in linears) and not model.lm_head.quantized
    twin = loader.dequantize_model(model)
    ids = _ids().to(model.device)
    with torch.no_grad():
        got = model.forward(ids)
        with lynn_kernels.use_reference():
            want = twin.forward(ids)
    assert metrics.compare(got, want).rel_l2 < 1e-5


def test_shared_expert_as_a_routed_slot(tmp_path, monkeypatch):
    """A MoE model whose shared expert has the routed experts' size (as every released Qwen3-Next / Qwen3.5 /
    Qwen3.6 has; the tiny models' is larger): the loader joins it to the packed expert stacks as expert E, a decode
    step runs each MoE block as router + gate_up + down over top_k + 1 slots (the shared expert's own launches
    never run), and the model equals its dequantised weights on the references: the logits of a prefill on the
    prefill path and of 5 tokens on the decode path (fp32), and greedy tokens (bf16)."""
    from lynn_kernels.moe import PackedExperts, triton_experts
    from lynn_kernels.moe.packed import shared_slot

    folder = tmp_path / "next-shared-32"
    tiny_hf.build("next", shared_expert_intermediate_size=tiny_hf.MOE["moe_intermediate_size"]).save_pretrained(
        folder)
    model = _load(folder, weights="nvfp4", dtype=torch.float32)
    blocks = [m for m in model.modules() if isinstance(m, lynn_model.model.SparseMoE)]
    assert blocks and all(isinstance(m.w13, PackedExperts) and shared_slot(m.w13, m.w2, m.shared) for m in blocks)
    twin = loader.dequantize_model(model)
    for n in (20, 5):                                          # prefill path (M > 16), decode path
        ids = _ids(n, seed=n).to(model.device)
        with torch.no_grad():
            got = model.forward(ids)
            with lynn_kernels.use_reference():
                want = twin.forward(ids)
        assert metrics.compare(got, want).rel_l2 < 1e-5, n
    calls = collections.Counter()
    real_decode, real_shared = triton_experts._launch_packed_decode, triton_experts.launch_shared_expert
    monkeypatch.setattr(triton_experts, "_launch_packed_decode",
                        lambda *a, **k: calls.update([f"slots={a[3]}"]) or real_decode(*a, **k))
    monkeypatch.setattr(triton_experts, "launch_shared_expert",
                        lambda *a, **k: calls.update(["shared"]) or real_shared(*a, **k))
    bf16 = _load(folder, weights="nvfp4")
    ids = _ids(9, seed=3).to(bf16.device)
    with torch.no_grad():
        got = lynn_model.generate(bf16, ids, 6)
        with lynn_kernels.use_reference():
            want = lynn_model.generate(loader.dequantize_model(bf16), ids, 6)
    assert got.tolist() == want.tolist()
    top_k = model.config.num_experts_per_tok
    assert calls[f"slots={top_k + 1}"] > 0 and calls["shared"] == 0, calls


@pytest.mark.parametrize("name, weights", [("next", "nvfp4"), ("q35moe", "bf16")])   # both mixers, both kinds
def test_fused_input_projections_give_the_same_model(ckpts, name, weights):
    """``model.fuse_input_projections()`` (one GEMV for attention's q | k | v and for the Gated DeltaNet's qkv | z
    and b | a): every group whose weights are of one kind is fused in every layer (b / a stay bf16 in an NVFP4
    model, so they pair with each other), the originals are gone, a second call fuses nothing, and the model gives
    the unfused one's logits (prefill and decode; a split-K product may group a row's partials otherwise, so within
    bf16 rounding) and greedy tokens."""
    model = _load(ckpts[name], weights=weights)
    c = model.config
    ids = _ids(9, seed=2).to(model.device)
    with torch.no_grad():
        want_logits = model.forward(ids)
        want_tokens = lynn_model.generate(model, ids, 3)
    counts = model.fuse_input_projections()
    expect = {"q_proj|k_proj|v_proj": len(c.attention_layers)}
    if c.linear_layers:
        expect.update({"in_proj_qkv|in_proj_z": len(c.linear_layers), "in_proj_b|in_proj_a": len(c.linear_layers)})
    assert counts == expect
    assert model.fuse_input_projections() == {}
    for layer in model.layers:
        m = layer.mixer
        gone = ("q_proj", "k_proj", "v_proj") if layer.kind == "full_attention" else \
            ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
        assert not any(hasattr(m, g) for g in gone), gone
    with torch.no_grad():
        got_logits = model.forward(ids)
        got_tokens = lynn_model.generate(model, ids, 3)
    m = metrics.compare(got_logits, want_logits)
    assert m.cosine > 0.9999 and m.rel_l2 < 1e-2, m
    assert got_tokens.tolist() == want_tokens.tolist()


def test_loaders_fuse_for_decode_where_the_kernels_run(ckpts):
    """The loaders' ``fuse``: None (default) fuses for decode only where the compiled kernels run (a CUDA device;
    tests/test_graphs.py checks it there), so here the model comes as stored; True gives
    ``fuse_for_decode()``'s form (nothing left to fuse, every Gated DeltaNet layer on the one-kernel step); another
    value is refused before anything is read."""
    stored = lynn_model.from_pretrained(ckpts["next"], device="cpu")
    assert not any(layer.mixer.fused_decode for layer in stored.layers if layer.kind != "full_attention")
    assert stored.fuse_input_projections()                         # there was something to fuse
    fused = lynn_model.loader.random_model(stored.config, device="cpu", fuse=True)
    assert fused.fuse_input_projections() == {}
    assert all(layer.mixer.fused_decode for layer in fused.layers if layer.kind != "full_attention")
    with pytest.raises(ValueError, match="fuse = 'yes': expected None"):
        lynn_model.from_pretrained(ckpts["next"] / "missing", fuse="yes")


def _prefilled(model, ids):
    """A cache holding the prefill of a batch of 2 (the prompt and its reverse), and its slots."""
    cache = model.new_cache(max_batch=2, max_tokens=64)
    slots = [cache.add(), cache.add()]
    rows = [ids[0], ids[0].flip(0)]
    with torch.no_grad():
        model.step(torch.cat(rows).to(model.device), cache, slots, [len(r) for r in rows])
    return cache, slots


def _decode_logits(model, prefilled, steps: int) -> torch.Tensor:
    """Logits of ``steps`` decode steps of both rows on the cache path, over a copy of the ``prefilled`` cache."""
    cache, slots = copy.deepcopy(prefilled)
    out = []
    with torch.no_grad():
        for i in range(steps):
            out.append(model.step(torch.tensor([i + 1, i + 7], device=model.device), cache, slots, [1, 1]))
    return torch.stack(out)


@pytest.mark.parametrize("name, weights, fuse_inputs", [("next", "nvfp4", False), ("q35moe", "bf16", True)])
def test_fused_gdn_decode_gives_the_same_model(ckpts, name, weights, fuse_inputs):
    """``model.fuse_gdn_decode()`` (each Gated DeltaNet layer's decode step in one kernel, the gates' float
    projections in it too): every linear-attention layer switches, and the decode logits (batch 2, 4 steps over
    the cache) and greedy tokens are those of the three-kernel chain within bf16 rounding (the kernel sums the
    gates' dot products itself, in another order than ``F.linear``); with the input projections fused too, its
    inputs are strided views of one projection."""
    model = _load(ckpts[name], weights=weights)
    if fuse_inputs:
        model.fuse_input_projections()
    ids = _ids(7, seed=4).to(model.device)
    # one prefill for both chains (the switch is for decode batches only): each decodes from a copy of its states;
    # generate prefills with each, so the fused model's own prefill still decides the first token
    prefilled = _prefilled(model, ids)
    want_logits, want_tokens = _decode_logits(model, prefilled, 4), lynn_model.generate(model, ids, 4)
    assert model.fuse_gdn_decode() == len(model.config.linear_layers) > 0
    got_logits, got_tokens = _decode_logits(model, prefilled, 4), lynn_model.generate(model, ids, 4)
    m = metrics.compare(got_logits, want_logits)
    assert m.cosine > 0.9999 and m.rel_l2 < 1e-2, m
    assert got_tokens.tolist() == want_tokens.tolist()
    assert model.fuse_gdn_decode(False) == len(model.config.linear_layers)
    assert not any(layer.linear_attn.fused_decode for layer in model.layers if layer.kind != "full_attention")


@pytest.mark.parametrize("fuse", [pytest.param(False, id="as-loaded"), pytest.param(True, id="inputs-fused")])
def test_nvfp4_prefill_takes_the_dequantise_then_cublas_path(ckpts, fuse, monkeypatch):
    """A bf16 prefill of DEQUANT_MIN_M tokens or more multiplies its packed projections by dequantising each weight
    once and calling cuBLAS (fused input projections too: a stack of projections is one run of rows per global
    scale). Its logits, and the next decode step's, match the same model with that path off (the packed GEMM
    kernel) within bf16 rounding, and the dequantised twin on the references."""
    from lynn_kernels.matmul import triton_matmul

    model = _load(ckpts["q35moe"], weights="nvfp4", dtype=torch.bfloat16)
    if fuse:
        assert model.fuse_input_projections()
    twin = loader.dequantize_model(model)
    calls = []
    real = triton_matmul.launch_dequant_gemm
    monkeypatch.setattr(triton_matmul, "launch_dequant_gemm", lambda *a, **k: calls.append(a[1].shape) or real(*a, **k))
    n = triton_matmul.DEQUANT_MIN_M + 3
    ids = _ids(n + 1)[0].to(model.device)
    runs = {}
    for label, m, min_m in (("on", model, n), ("off", model, 1 << 30), ("reference", twin, n)):
        monkeypatch.setattr(triton_matmul, "DEQUANT_MIN_M", min_m)
        cache = m.new_cache(max_batch=1, max_tokens=n + 16)
        s = cache.add()
        with torch.no_grad(), lynn_kernels.use_reference(label == "reference"):
            runs[label] = [m.step(ids[:n], cache, [s], [n]).float(), m.step(ids[n:], cache, [s], [1]).float()]
        if label == "on":        # each packed projection once, in the prefill only (the decode step: M = 1)
            n_on = len(calls)
            assert n_on == sum(1 for x in model.modules() if isinstance(x, lynn_model.model.Linear) and x.quantized)
    assert len(calls) == n_on                                          # the path off: the GEMM kernel only
    for i, what in enumerate(("prefill", "decode step")):
        assert metrics.compare(runs["on"][i], runs["off"][i]).rel_l2 < 1e-2, what
        assert metrics.compare(runs["on"][i], runs["reference"][i]).cosine > 0.999, what


@pytest.mark.parametrize("name, fmt", [("next", "compressed-tensors"), ("q35", "modelopt"),
                                       ("q35moevl", "compressed-tensors"), ("q35moe", "modelopt")])
def test_nvfp4_checkpoints_run_on_the_kernels(ckpts, tmp_path, name, fmt):
    """An NVFP4 folder written by ``lynn quantize`` (both layouts), loaded as stored: on the kernels it equals its
    dequantised weights on the references (fp32 activations), and stays close to HF's fp32 model of the original
    weights (the quantisation error only: cosine > 0.99)."""
    from lynn_model.quantize import quantize_checkpoint

    with lynn_kernels.use_reference():
        quantize_checkpoint(ckpts[name], tmp_path / "nvfp4", format=fmt, progress=False)
    model = lynn_model.from_pretrained(tmp_path / "nvfp4", dtype=torch.float32)
    assert any(m.quantized for m in model.modules() if isinstance(m, lynn_model.model.Linear))
    ids = _ids(20).to(model.device)
    with torch.no_grad():
        got = model.forward(ids)
        with lynn_kernels.use_reference():
            want = loader.dequantize_model(model).forward(ids)
            hf = tiny_hf.load(ckpts[name], torch.float32)(input_ids=ids.cpu(), use_cache=False).logits
    assert metrics.compare(got, want).rel_l2 < 1e-5
    assert metrics.compare(got, hf).cosine > 0.99


# -- HF's own tester configs: sizes that are not multiples of 16 ---------------------------------------------------


@pytest.fixture(scope="module")
def testers(tmp_path_factory) -> dict:
    """HF's tester configs (tests/tiny_hf.py, TESTERS) as fp32 checkpoints."""
    root = tmp_path_factory.mktemp("hf_testers")
    return {name: tiny_hf.save(name, root / name) for name in tiny_hf.TESTERS}


@pytest.mark.parametrize("name", tiny_hf.TESTERS)
def test_hf_tester_configs_load_and_match_hf(testers, name):
    """HF's own tester configs (intermediate_size 37, expert sizes 12 and 36, vocab 99) load and match HF: fp32 on
    the references and on the kernels (measured: rel_l2 ~1e-7), bf16 on the kernels as close to HF fp32 as HF's own
    bf16 (measured: error ratios 0.98-1.09)."""
    folder = testers[name]
    ids = torch.randint(0, tiny_hf.TESTER["vocab_size"], (1, PROMPT), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = tiny_hf.load(folder, torch.float32)(input_ids=ids, use_cache=False).logits.float()
        hf16 = tiny_hf.load(folder, torch.bfloat16, experts="eager")(input_ids=ids, use_cache=False).logits.float()
        with lynn_kernels.use_reference():
            model = lynn_model.from_pretrained(folder, device="cpu")
            c = model.config
            assert any(v % 16 for v in (c.intermediate_size, c.moe_intermediate_size,
                                        c.shared_expert_intermediate_size))
            ref = model.forward(ids).float()
        fp32 = lynn_model.from_pretrained(folder, dtype=torch.float32)
        got32 = fp32.forward(ids.to(fp32.device)).float().cpu()
        bf16 = lynn_model.from_pretrained(folder, weights="bf16")
        got16 = bf16.forward(ids.to(bf16.device)).float().cpu()
    for what, got in (("reference fp32", ref), ("kernels fp32", got32)):
        m = metrics.compare(got, want)
        assert m.max_abs <= 1e-4 * want.abs().max().item() and m.rel_l2 < 1e-5, (what, m)
    m = metrics.compare(got16, want, baseline=hf16)
    assert m.cosine > 0.9998 and m.err_ratio < 1.5, m


def test_nvfp4_on_a_tester_config_keeps_k_not_a_multiple_of_16_in_float(testers, tmp_path):
    """NVFP4's blocks of 16 along K are the one rule sizes must meet, and the NVFP4 paths apply it: quantising a
    K = 37 weight (the tester's down_proj: K = intermediate_size) is refused with the reason; quantising on load keeps
    it in float and quantises the K = 32 projections, and that model equals its dequantised weights on the
    references; an NVFP4 checkpoint that stores a K = 37 projection as NVFP4 is refused by the loader."""
    from safetensors.torch import load_file, save_file

    folder = testers["q35-tester"]
    down = load_file(folder / "model.safetensors")["model.layers.0.mlp.down_proj.weight"]
    assert down.shape[1] == 37
    with pytest.raises(ValueError, match=r"K = 37 .*multiple of 16"):
        lynn_kernels.quantize(down)

    model = _load(folder, weights="nvfp4", dtype=torch.float32)
    mlps = [layer.mlp for layer in model.layers]
    assert all(m.gate_proj.quantized and m.up_proj.quantized and not m.down_proj.quantized for m in mlps)
    ids = torch.randint(0, 99, (1, 20), generator=torch.Generator().manual_seed(1)).to(model.device)
    with torch.no_grad():
        got = model.forward(ids)
        with lynn_kernels.use_reference():
            want = loader.dequantize_model(model).forward(ids)
    assert metrics.compare(got, want).rel_l2 < 1e-5

    bad = tmp_path / "nvfp4-k37"
    shutil.copytree(folder, bad)
    tensors = load_file(bad / "model.safetensors")
    w = tensors.pop("model.layers.0.mlp.down_proj.weight")                # a ModelOpt NVFP4 entry of K = 37
    tensors["model.layers.0.mlp.down_proj.weight"] = torch.zeros(w.shape[0], 18, dtype=torch.uint8)
    tensors["model.layers.0.mlp.down_proj.weight_scale"] = torch.zeros(w.shape[0], 2).to(torch.float8_e4m3fn)
    tensors["model.layers.0.mlp.down_proj.weight_scale_2"] = torch.ones(())
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(lynn_model.LoadError, match="in_features = 37 is not a multiple of 16"):
        lynn_model.from_pretrained(bad)


# -- config -------------------------------------------------------------------------------------------------------


def _hf_dict(**changes):
    d = lynn_model.preset("tiny-qwen3.5-moe").to_hf()
    d.update(changes)
    return d


@pytest.mark.parametrize("spelling", ["rope_parameters", "top_level", "rope_scaling"])
def test_config_reads_rope_theta_wherever_releases_put_it(spelling):
    d = _hf_dict()
    rp = d.pop("rope_parameters")
    if spelling == "rope_parameters":
        d["rope_parameters"] = {**rp, "rope_theta": 5e6}
    elif spelling == "top_level":
        d.update(rope_theta=5e6, partial_rotary_factor=0.5, rope_scaling=None)
    else:
        d["rope_scaling"] = {"rope_type": "default", "rope_theta": 5e6}
    c = lynn_model.Config.from_hf(d)
    assert c.rope_theta == 5e6
    assert c.rotary_dim == (16 if spelling == "top_level" else 8)


def test_config_text_config_and_layer_types_derivation():
    text = _hf_dict(model_type="qwen3_5_moe_text")
    del text["layer_types"]
    text["full_attention_interval"] = 2
    c = lynn_model.Config.from_hf({"model_type": "qwen3_5_moe", "text_config": text, "vision_config": {}})
    assert c.family == "qwen3_5_moe" and c.layer_types == ("linear_attention", "full_attention") * 2
    assert c.ffn_types == ("moe",) * 4 and c.norm_topk_prob


@pytest.mark.parametrize("change, field", [
    (dict(model_type="llama"), "model_type"),
    (dict(head_dim=48), "head_dim"),
    (dict(layer_types=["linear_attention", "sliding_attention", "linear_attention", "full_attention"]),
     "layer_types"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e7}), "rope_type"),
    (dict(rope_parameters={"rope_type": "default"}), "rope_theta"),
    (dict(linear_key_head_dim=512), "linear_key_head_dim"),
    (dict(attn_output_gate=False), "attn_output_gate"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok"),
    (dict(hidden_act="gelu"), "hidden_act"),
], ids=lambda x: x if isinstance(x, str) else None)
def test_config_refuses_what_the_kernels_cannot_run(change, field):
    with pytest.raises(lynn_model.ConfigError, match=field):
        lynn_model.Config.from_hf(_hf_dict(**change))


def _cfg(base: str = "moe", rope: dict | None = None, drop: tuple = (), **changes):
    """A tiny preset's HF dict (``base``: moe / next / q35) with top-level ``changes``, ``rope`` merged into its
    ``rope_parameters`` and the keys in ``drop`` left out."""
    d = lynn_model.preset({"moe": "tiny-qwen3.5-moe", "next": "tiny-qwen3-next", "q35": "tiny-qwen3.5"}[base]).to_hf()
    d.update(changes)
    if rope:
        d["rope_parameters"] = {**d["rope_parameters"], **rope}
    for k in drop:
        del d[k]
    return d


NAN, INF = float("nan"), float("inf")
#: (the field the message must name, a config.json that is wrong in that field only); the tiny presets have
#: vocab_size 512 and 4 layers.
BAD_CONFIGS = [
    ("rms_norm_eps", _cfg(rms_norm_eps=0.0)), ("rms_norm_eps", _cfg(rms_norm_eps=-1e-6)),
    ("rms_norm_eps", _cfg(rms_norm_eps=NAN)), ("rms_norm_eps", _cfg(rms_norm_eps=INF)),
    ("rms_norm_eps", _cfg(rms_norm_eps="1e-6")), ("rms_norm_eps", _cfg(rms_norm_eps=True)),
    ("rope_theta", _cfg(rope={"rope_theta": 0})), ("rope_theta", _cfg(rope={"rope_theta": -1e7})),
    ("rope_theta", _cfg(rope={"rope_theta": NAN})), ("rope_theta", _cfg(rope={"rope_theta": INF})),
    ("rope_theta", _cfg(rope={"rope_theta": "1e7"})),
    ("num_key_value_heads", _cfg(num_key_value_heads=0)), ("num_attention_heads", _cfg(num_attention_heads=0)),
    ("linear_num_key_heads", _cfg(linear_num_key_heads=0)),
    ("linear_num_value_heads", _cfg(linear_num_value_heads=0)),
    ("num_hidden_layers", _cfg(num_hidden_layers=0)), ("num_hidden_layers", _cfg(num_hidden_layers=-4)),
    ("num_hidden_layers", _cfg(num_hidden_layers="4")), ("num_hidden_layers", _cfg(num_hidden_layers=4.0)),
    ("vocab_size", _cfg(vocab_size=0)), ("vocab_size", _cfg(vocab_size=-512)), ("vocab_size", _cfg(vocab_size=2**31)),
    ("hidden_size", _cfg(hidden_size=0)), ("hidden_size", _cfg(hidden_size=-64)),
    ("hidden_size", _cfg(hidden_size="64")), ("hidden_size", _cfg(hidden_size=64.5)),
    ("hidden_size", _cfg(hidden_size=True)), ("hidden_size", _cfg(hidden_size=[64])),
    ("hidden_size", _cfg(hidden_size=None)), ("hidden_size", _cfg(drop=("hidden_size",))),
    ("head_dim", _cfg(head_dim="32")), ("head_dim", _cfg(head_dim=32.5)),
    ("intermediate_size", _cfg("q35", intermediate_size="96")), ("intermediate_size", _cfg("q35", intermediate_size=0)),
    ("num_experts", _cfg(num_experts=8.0)), ("num_experts", _cfg(num_experts=MAX_EXPERTS + 1)),
    ("num_experts_per_tok", _cfg(num_experts_per_tok="2")),
    ("moe_intermediate_size", _cfg(moe_intermediate_size=32.7)),
    ("shared_expert_intermediate_size", _cfg(shared_expert_intermediate_size=[48])),
    ("linear_conv_kernel_dim", _cfg(linear_conv_kernel_dim=9)),
    ("max_position_embeddings", _cfg(max_position_embeddings=0)),
    ("max_position_embeddings", _cfg(max_position_embeddings="512")),
    ("eos_token_id", _cfg(eos_token_id="2")), ("eos_token_id", _cfg(eos_token_id=2.0)),
    ("eos_token_id", _cfg(eos_token_id={"id": 2})), ("eos_token_id", _cfg(eos_token_id=[1, "2"])),
    ("eos_token_id", _cfg(eos_token_id=True)), ("eos_token_id", _cfg(eos_token_id=[1, False])),
    ("eos_token_id", _cfg(eos_token_id=512)), ("eos_token_id", _cfg(eos_token_id=[2, -1])),
    ("bos_token_id", _cfg(bos_token_id="1")), ("bos_token_id", _cfg(bos_token_id=1.0)),
    ("bos_token_id", _cfg(bos_token_id=[1])), ("bos_token_id", _cfg(bos_token_id=False)),
    ("bos_token_id", _cfg(bos_token_id=512)), ("bos_token_id", _cfg(bos_token_id=-1)),
    ("layer_types", _cfg(layer_types="full_attention")), ("layer_types", _cfg(layer_types=[0, 1, 2, 3])),
    ("layer_types", _cfg(layer_types=["full_attention"] * 3)),
    ("mlp_only_layers", _cfg("next", mlp_only_layers=["1"])), ("mlp_only_layers", _cfg("next", mlp_only_layers=1)),
    ("mlp_only_layers", _cfg("next", mlp_only_layers=[4])), ("mlp_only_layers", _cfg("next", mlp_only_layers=[True])),
    ("partial_rotary_factor", _cfg(rope={"partial_rotary_factor": 0})),
    ("partial_rotary_factor", _cfg(rope={"partial_rotary_factor": 1.5})),
    ("partial_rotary_factor", _cfg(rope={"partial_rotary_factor": NAN})),
    ("partial_rotary_factor", _cfg(rope={"partial_rotary_factor": "0.25"})),
    ("full_attention_interval", _cfg(drop=("layer_types",), full_attention_interval=0)),
    ("full_attention_interval", _cfg(drop=("layer_types",), full_attention_interval="4")),
    ("decoder_sparse_step", _cfg("next", decoder_sparse_step=0)),
    ("decoder_sparse_step", _cfg("next", decoder_sparse_step=-1)),
    ("tie_word_embeddings", _cfg(tie_word_embeddings="false")), ("tie_word_embeddings", _cfg(tie_word_embeddings=0)),
    ("norm_topk_prob", _cfg("next", norm_topk_prob="true")),
    ("rope_parameters", _cfg(rope_parameters=[1e7])),
    ("model_type", _cfg(model_type=["qwen3_5_moe_text"])),
    ("text_config", {"model_type": "qwen3_5_moe", "text_config": [_cfg()]}),
    ("text_config", {"model_type": "qwen3_5_moe", "text_config": "qwen3_5_moe_text"}),
    ("config.json", [_cfg()]), ("config.json", "qwen3_5_moe"),
    # the grouped MoE kernels read float expert weights in column pairs: MoE sizes must be even
    ("hidden_size", _cfg(hidden_size=65)), ("moe_intermediate_size", _cfg(moe_intermediate_size=33)),
    ("shared_expert_intermediate_size", _cfg(shared_expert_intermediate_size=35)),
]


@pytest.mark.parametrize("field, d", BAD_CONFIGS, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD_CONFIGS)])
def test_config_refuses_a_bad_field_naming_it(field, d):
    """Each row is wrong in one field only: a ConfigError (never a TypeError, a ZeroDivisionError or a silent
    ``int("2048")``), whose message names the field."""
    with pytest.raises(lynn_model.ConfigError, match=re.escape(field)):
        lynn_model.Config.from_hf(d)


def test_config_takes_sizes_that_are_not_multiples_of_16():
    """Only NVFP4 needs K % 16 == 0 (it keeps such a projection in float); the float kernels take any size, the
    grouped MoE kernels even ones. Numbers are read as HF writes them: an integer rope_theta is a number."""
    c = lynn_model.Config.from_hf(_cfg("next", hidden_size=40, intermediate_size=37, moe_intermediate_size=12,
                                       shared_expert_intermediate_size=36, rope={"rope_theta": 10000}))
    assert (c.hidden_size, c.intermediate_size, c.moe_intermediate_size) == (40, 37, 12)
    assert c.rope_theta == 10000.0 and isinstance(c.rope_theta, float)
    assert lynn_model.Config.from_hf(_cfg("q35", hidden_size=33, intermediate_size=37)).hidden_size == 33
    c = lynn_model.Config.from_hf(_cfg(eos_token_id=[1, 511], bos_token_id=0, tie_word_embeddings=True))
    assert c.eos_token_ids == (1, 511) and c.bos_token_id == 0 and c.tie_word_embeddings
    assert lynn_model.Config.from_hf(_cfg(eos_token_id=None, bos_token_id=None)).eos_token_ids == ()


def test_config_refuses_a_huge_layer_count_at_once():
    """A layer count is bounded before the per-layer lists are built: ``num_hidden_layers: 10**9`` without
    ``layer_types`` is refused in microseconds, not expanded until memory runs out (as are ``Config.replace`` and a
    huge ``mlp_only_layers``)."""
    from lynn_model.config import MAX_LAYERS

    t0 = time.perf_counter()
    with pytest.raises(lynn_model.ConfigError, match=f"num_hidden_layers = {10**9}: expected 1..{MAX_LAYERS}"):
        lynn_model.Config.from_hf(_cfg(drop=("layer_types",), num_hidden_layers=10**9))
    with pytest.raises(lynn_model.ConfigError, match="num_hidden_layers"):
        lynn_model.Config.from_hf(_cfg("next", drop=("layer_types", "mlp_only_layers"), num_hidden_layers=10**9))
    with pytest.raises(lynn_model.ConfigError, match="num_hidden_layers"):
        lynn_model.preset("tiny-qwen3.5").replace(num_hidden_layers=10**9)
    with pytest.raises(lynn_model.ConfigError, match="mlp_only_layers"):
        lynn_model.Config.from_hf(_cfg("next", mlp_only_layers=[0] * 10**6))
    assert time.perf_counter() - t0 < 1.0
    assert lynn_model.preset("tiny-qwen3.5").replace(num_hidden_layers=MAX_LAYERS).num_hidden_layers == MAX_LAYERS


def test_presets_have_the_published_shapes():
    nxt, q35 = lynn_model.preset("qwen3-next-80b-a3b"), lynn_model.preset("qwen3.5-35b-a3b")
    assert (nxt.num_hidden_layers, nxt.num_experts, nxt.num_experts_per_tok, nxt.vocab_size) == (48, 512, 10, 151936)
    assert (q35.num_hidden_layers, q35.num_experts, q35.num_experts_per_tok, q35.vocab_size) == (40, 256, 8, 248320)
    assert nxt.attention_layers == tuple(range(3, 48, 4)) and q35.rotary_dim == 64 and q35.conv_dim == 8192
    assert lynn_model.preset("qwen3.5-9b").ffn_types == ("mlp",) * 32
    for name, cfg in lynn_model.PRESETS.items():                       # each round-trips through HF's dict
        assert lynn_model.Config.from_hf(cfg.to_hf(), name=name) == cfg


def test_a_failed_step_marks_its_sequences_broken(ckpts, monkeypatch):
    """A step that raises after some layers wrote their states leaves those sequences refused until released."""
    model = _fp32_kernel_model(ckpts, "q35")
    cache = model.new_cache(max_batch=2, max_tokens=64)
    a, b = cache.add(), cache.add()
    with torch.no_grad():
        model.step(torch.arange(5, device=model.device), cache, [a, b], [3, 2])

        def boom(*args, **kw):
            raise RuntimeError("injected")

        monkeypatch.setattr(model.layers[3].mlp, "forward", boom)
        with pytest.raises(RuntimeError, match="injected"):
            model.step(torch.tensor([1, 2], device=model.device), cache, [a, b], [1, 1])
        monkeypatch.undo()
        with pytest.raises(ValueError, match="failed half-way"):
            model.step(torch.tensor([1], device=model.device), cache, [a], [1])
        cache.release(a)
        s = cache.add()
        assert s == a and cache.lengths[s] == 0
        model.step(torch.tensor([1, 2], device=model.device), cache, [s], [2])


def test_a_cache_of_another_model_is_refused(ckpts):
    model = _fp32_kernel_model(ckpts, "q35")
    other = lynn_model.Cache(model.config.replace(num_hidden_layers=2), max_batch=1, max_tokens=32,
                             dtype=torch.float32, device=model.device)
    other.add()
    with pytest.raises(ValueError, match="another model"):
        model.step(torch.tensor([1], device=model.device), other, [0], [1])
    bf16 = lynn_model.Cache(model.config, max_batch=1, max_tokens=32, dtype=torch.bfloat16, device=model.device)
    bf16.add()
    with pytest.raises(ValueError, match="another model"):
        model.step(torch.tensor([1], device=model.device), bf16, [0], [1])


def test_config_checks_ffn_types_length():
    c = lynn_model.preset("tiny-qwen3.5-moe")
    assert c.replace(num_hidden_layers=8).ffn_types == ("moe",) * 8
    with pytest.raises(lynn_model.ConfigError, match="ffn_types"):
        c.replace(num_hidden_layers=8, layer_types=c.layer_types * 2, ffn_types=c.ffn_types)


def test_step_reads_no_value_back_after_its_token_check(ckpts, monkeypatch):
    """``Model.step`` checks its token ids, then runs its layers trusted: no layer reads a value back to the host (on
    a GPU each read-back lets the queue drain; the prefill's offsets come remembered from ``Cache.plan``), and the
    ids check still refuses an id out of range."""
    model = _fp32_kernel_model(ckpts, "q35")
    cache = model.new_cache(max_batch=2, max_tokens=64)
    a, b = cache.add(), cache.add()
    reads, seen = [], []
    real_tolist, real_item = torch.Tensor.tolist, torch.Tensor.item

    def tolist(t):
        reads.append("tolist")
        return real_tolist(t)

    def item(t):
        reads.append("item")
        return real_item(t)

    real_mlp = model.layers[0].mlp.forward

    def mlp(x):
        seen.append(lynn_kernels.runtime.values_checkable())
        return real_mlp(x)

    monkeypatch.setattr(model.layers[0].mlp, "forward", mlp)
    with torch.no_grad():
        ids = torch.arange(5, device=model.device)
        monkeypatch.setattr(torch.Tensor, "tolist", tolist)
        monkeypatch.setattr(torch.Tensor, "item", item)
        model.step(ids, cache, [a, b], [3, 2])                  # a packed prefill of two sequences
        model.step(ids[:2], cache, [a, b], [1, 1])              # then a decode step
        monkeypatch.setattr(torch.Tensor, "tolist", real_tolist)
        monkeypatch.setattr(torch.Tensor, "item", real_item)
        assert seen == [False, False] and "tolist" not in reads
        assert reads.count("item") <= 4                         # the ids' min and max, once a step
        with pytest.raises(ValueError, match="token ids must lie in"):
            model.step(torch.tensor([10 ** 6], device=model.device), cache, [a], [1])
