"""The RMSNorm folded into the launch of the kernel after it: ``matmul.norm_linear`` (the packed GEMV),
``moe.norm_moe_block`` (the router) and ``Model.fuse_norms`` (a decode step without the norm kernels).

* each op against its torch reference (fresh random inputs, awkward shapes: odd N, K a multiple of 16 but not of
  64, one and two rows, every x dtype; with and without the residual), and against the two launches it replaces
  (the norm kernel, then the product): bit-equal under the interpreter, where both reduce a row the same way;
* the paths that do not fold (three rows for the GEMV, no shared slot for the MoE block) give the same values;
* a tiny model's decode logits and greedy tokens with the norms folded equal those without; on the GPU a CUDA-graph
  decode step with them equals the eager step token for token;
* bad arguments raise, naming the tensor.
"""

from __future__ import annotations

import copy

import pytest
import tiny_hf
import torch

import lynn_kernels
import lynn_model
from lynn_kernels import metrics, moe, rmsnorm
from lynn_kernels.matmul import norm_linear, nvfp4_linear, pack, triton_matmul
from lynn_kernels.moe import SharedExpert, pack_experts, triton_experts
from lynn_kernels.nvfp4 import quantize

ON_GPU = torch.cuda.is_available()
ORACLE_FIXTURES = {"ckpts": "transformers"}


def _randn(shape, dtype, device, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(tuple(shape), generator=g) * scale).to(dtype).to(device)


def _unfused_linear(x, nw, w, eps, residual):
    got = rmsnorm(x, nw, eps, residual=residual)
    xn = got if residual is None else got[0]
    return (nvfp4_linear(xn, w), xn) + (() if residual is None else (got[1],))


@pytest.mark.parametrize("m, n, k", [(1, 37, 208), (2, 72, 192), (1, 40, 2048), (2, 9, 80)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "no-residual"])
def test_norm_linear_equals_the_norm_then_the_product(m, n, k, dtype, with_residual, device, poison_empty,
                                                      monkeypatch):
    """One launch (counted) with the norm in the packed GEMV: the product, the normed rows and the residual sum are
    the two kernels' bits, and the reference's within the product's rounding."""
    w = pack(quantize(_randn((n, k), torch.float32, device, 1)))
    nw = _randn((k,), torch.bfloat16, device, 2, 0.2)
    x = _randn((m, k), dtype, device, 3)
    res = _randn((m, k), dtype, device, 4, 4.0) if with_residual else None
    launches = []
    real = triton_matmul.launch_packed_gemv
    monkeypatch.setattr(triton_matmul, "launch_packed_gemv", lambda *a, **kw: launches.append(kw.get("norm"))
                        or real(*a, **kw))
    got = norm_linear(x, nw, w, 1e-6, residual=res)
    assert len(launches) == 1 and launches[0] is not None, "the norm did not fold into the packed GEMV"
    assert len(got) == (3 if with_residual else 2)
    monkeypatch.setattr(triton_matmul, "launch_packed_gemv", real)
    want = _unfused_linear(x, nw, w, 1e-6, res)
    for name, g, u in zip(("y", "xn", "h"), got, want):
        if not ON_GPU:                       # the same reduction of a row under the interpreter: the same bits
            assert metrics.bit_mismatches(g, u) == 0, name
        else:
            m_ = metrics.compare(g.float(), u.float())
            assert m_.cosine > 0.99999, (name, m_)
    with lynn_kernels.use_reference():
        ref = norm_linear(x, nw, w, 1e-6, residual=res)
    m_ = metrics.compare(got[0].float(), ref[0].float())
    assert m_.cosine > 0.9999 and m_.rel_l2 < 1e-2, m_
    assert metrics.compare(got[1].float(), ref[1].float()).max_abs <= 2 ** -6 * ref[1].float().abs().max()


def test_norm_linear_three_rows_runs_the_two_kernels(device, poison_empty, monkeypatch):
    """M = 3 is not the packed GEMV's: the norm kernel runs, then the product's own dispatch; the same values."""
    w = pack(quantize(_randn((24, 128), torch.float32, device, 1)))
    nw = _randn((128,), torch.bfloat16, device, 2, 0.2)
    x, res = _randn((3, 128), torch.bfloat16, device, 3), _randn((3, 128), torch.bfloat16, device, 4)
    calls = []
    real = triton_matmul.launch_packed_gemv
    monkeypatch.setattr(triton_matmul, "launch_packed_gemv", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    got = norm_linear(x, nw, w, 1e-5, residual=res)
    assert not calls
    for g, u in zip(got, _unfused_linear(x, nw, w, 1e-5, res)):
        assert torch.equal(g, u)


def _experts(device, E=8, H=192, I=48):
    bf = torch.bfloat16
    w13 = quantize(_randn((E, 2 * I, H), torch.float32, device, 5, 0.05))
    w2 = quantize(_randn((E, H, I), torch.float32, device, 6, 0.05))
    shared = SharedExpert(quantize(_randn((2 * I, H), torch.float32, device, 7, 0.05)),
                          quantize(_randn((H, I), torch.float32, device, 8, 0.05)),
                          _randn((1, H), bf, device, 9, 0.05))
    return _randn((E, H), bf, device, 10, 0.05), w13, w2, shared


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "no-residual"])
def test_norm_moe_block_equals_the_norm_then_the_block(m, with_residual, device, poison_empty):
    """The norm in the router's launch (the three-launch decode path of packed stacks with the shared slot): the
    block's output, the normed rows and the residual sum are the two ops' bits; the reference agrees."""
    router, w13, w2, shared = _experts(device)
    w13, w2, shared = pack_experts(w13, w2, shared)
    H = router.shape[1]
    nw = _randn((H,), torch.bfloat16, device, 11, 0.2)
    x = _randn((m, H), torch.bfloat16, device, 12)
    res = _randn((m, H), torch.bfloat16, device, 13, 3.0) if with_residual else None
    assert triton_experts.norm_moe_block_fuses(x, nw, router, w13, w2, shared)
    got = moe.norm_moe_block(x, nw, router, w13, w2, shared, top_k=2, residual=res)
    pre = rmsnorm(x, nw, 1e-6, residual=res)
    xn = pre if res is None else pre[0]
    want = (moe.moe_block(xn, router, w13, w2, shared, top_k=2), xn) + (() if res is None else (pre[1],))
    assert len(got) == len(want)
    for name, g, u in zip(("y", "xn", "h"), got, want):
        if not ON_GPU:
            assert metrics.bit_mismatches(g, u) == 0, name
        else:
            m_ = metrics.compare(g.float(), u.float())
            assert m_.cosine > 0.99999, (name, m_)
    with lynn_kernels.use_reference():
        ref = moe.norm_moe_block(x, nw, router, w13, w2, shared, top_k=2, residual=res)
    m_ = metrics.compare(got[0].float(), ref[0].float())
    assert m_.cosine > 0.9999 and m_.rel_l2 < 1e-2, m_


def test_norm_moe_block_without_the_shared_slot_runs_the_norm_kernel(device, poison_empty):
    """Unpacked stacks do not take the three-launch path: the norm runs as its own kernel, the same values."""
    router, w13, w2, shared = _experts(device)
    H = router.shape[1]
    nw = _randn((H,), torch.bfloat16, device, 11, 0.2)
    x, res = _randn((2, H), torch.bfloat16, device, 12), _randn((2, H), torch.bfloat16, device, 13)
    assert not triton_experts.norm_moe_block_fuses(x, nw, router, w13, w2, shared)
    y, xn, h = moe.norm_moe_block(x, nw, router, w13, w2, shared, top_k=2, residual=res)
    xn2, h2 = rmsnorm(x, nw, 1e-6, residual=res)
    assert torch.equal(xn, xn2) and torch.equal(h, h2)
    assert torch.equal(y, moe.moe_block(xn2, router, w13, w2, shared, top_k=2))


def test_bad_arguments_name_the_tensor(device):
    w = pack(quantize(_randn((16, 64), torch.float32, device, 1)))
    x = _randn((1, 64), torch.bfloat16, device, 2)
    with pytest.raises(ValueError, match="weight"):
        norm_linear(x, _randn((32,), torch.bfloat16, device, 3), w)           # norm weight of the wrong length
    with pytest.raises(ValueError, match="residual"):
        norm_linear(x, _randn((64,), torch.bfloat16, device, 3), w, residual=_randn((2, 64), torch.bfloat16,
                                                                                      device, 4))
    with pytest.raises(ValueError, match="x"):
        norm_linear(_randn((1, 32), torch.bfloat16, device, 2), _randn((32,), torch.bfloat16, device, 3), w)
    router, w13, w2, shared = _experts(device)
    w13, w2, shared = pack_experts(w13, w2, shared)
    with pytest.raises(ValueError, match="residual"):
        moe.norm_moe_block(_randn((1, 192), torch.bfloat16, device, 2), _randn((192,), torch.bfloat16, device, 3),
                           router, w13, w2, shared, top_k=2, residual=_randn((1, 96), torch.bfloat16, device, 4))


# -- the model ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("tiny_hf_norms")
    return {name: tiny_hf.save(name, root / name) for name in ("next", "q35moe")}


def _prefilled(model):
    """A cache holding two prompts (batch 2), for decode steps to start from."""
    cache = model.new_cache(max_batch=2, max_tokens=32)
    slots = [cache.add(), cache.add()]
    g = torch.Generator().manual_seed(5)
    rows = [torch.randint(0, 500, (5,), generator=g), torch.randint(0, 500, (3,), generator=g)]
    with torch.no_grad():
        model.step(torch.cat(rows).to(model.device), cache, slots, [len(r) for r in rows])
    return cache, slots


def _decode(model, cache, slots, steps: int):
    """Logits of ``steps`` decode steps of both sequences."""
    with torch.no_grad():
        return torch.stack([model.step(torch.tensor([i + 3, i + 11], device=model.device), cache, slots, [1, 1])
                            for i in range(steps)])


@pytest.mark.parametrize("name, fast", [("q35moe", True), ("next", False)], ids=["q35moe-fused", "next-as-loaded"])
def test_model_with_norms_folded_decodes_the_same(ckpts, name, fast):
    """``model.fuse_norms()``: each decode step's layer norms run inside the next block's first kernel (the fused
    input projection or, as loaded, q_proj / in_proj_qkv / a dense MLP's gate_proj; the router); the decode logits
    are the norm kernels' bits under the interpreter (close on a GPU) and the greedy tokens equal. The prefill
    keeps its norm kernels."""
    model = lynn_model.from_pretrained(ckpts[name], weights="nvfp4")
    if fast:
        model.fuse_input_projections()
        model.fuse_gdn_decode()
    cache, slots = _prefilled(model)
    twin = copy.deepcopy(cache)                   # the same past for both runs: one prefill
    want = _decode(model, cache, slots, 2)
    assert model.fuse_norms() == 2 * model.config.num_hidden_layers
    got = _decode(model, twin, slots, 2)
    if ON_GPU:
        m = metrics.compare(got.float(), want.float())
        assert m.cosine > 0.9999 and m.rel_l2 < 1e-2, m
    else:
        assert metrics.bit_mismatches(got, want) == 0
    assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
    model.fuse_norms(False)
    assert not model.fused_norms


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["tiny-qwen3.5-moe", "tiny-qwen3-next"])
@pytest.mark.parametrize("batch", [1, 2, 8])
def test_gpu_graph_decode_with_norms_folded_equals_eager(preset, batch):
    """The step as ``lynn generate`` runs it with the norms folded too: captured and eager give the same tokens,
    greedy and sampled, over 24 steps (batch 8: more rows than ``FOLD_NORMS_MAX_ROWS``, the norm kernels run);
    and the greedy tokens are those of the same model with the norm kernels."""
    from test_graphs import _gen, _graph_equals_eager

    from lynn_model.loader import random_model

    model = random_model(lynn_model.preset(preset), weights="nvfp4", device="cuda", seed=6)
    model.fuse_input_projections()
    model.fuse_gdn_decode()
    gen = torch.Generator().manual_seed(batch + 40)
    prompts = [torch.randint(0, model.config.vocab_size, (4 + 5 * b,), generator=gen).tolist() for b in range(batch)]
    plain, _ = _gen(model, prompts, 24, True)
    model.fuse_norms()
    _graph_equals_eager(model, prompts, ({}, {"temperature": 0.9, "top_k": 40, "top_p": 0.95, "seed": 5}))
    folded, _ = _gen(model, prompts, 24, True)
    assert folded.tolist() == plain.tolist()
