"""MoE experts and block: the grouped NVFP4 kernels (``moe_experts``, ``moe_block``, the launch functions) against the
torch references, against a plain bf16 computation, and against HF transformers' own Qwen3-Next / Qwen3.5 MoE blocks;
the same kernels over float (bf16 / fp32) expert weights (section 4) and with per-shard gate / up global scales
(section 5, one scale per row of w13, built by ``stack_w13`` / ``fuse_w13``). The sweeps of awkward shapes and
dtypes are the ``lynn check`` matrix's (``lynn_kernels/moe/check.py``), run here case by case with these tolerances; the
packed experts' cases among them (``PACKED_EXPERTS``), test_moe_packed.py's subject, run here too.

Tolerances (the reference is fp32 from the dequantised weights, rounded once to x's dtype):

* fp32 x: ``rel_l2 < 1e-5`` (the kernels add the same fp32 products in another order);
* bf16 / fp16 x: the kernels round the intermediate ``silu(gate) * up`` and the output to x's dtype, so
  ``cosine > 0.9999``, ``rel_l2 < 4e-3`` and, against the fp32 reference, an error below a plain bf16 computation's
  (``err_ratio < 1``).

Kernel tests run under Triton's interpreter on the CPU (small shapes, large tiles) with every fresh allocation
poisoned (NaN floats, -1 integers), so a row a kernel forgets to write shows up. M <= 16 takes the decode path
(one program per slot, no align), M > 16 the prefill path (align, then row blocks of 16 / 32 / 64).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_case_passes, check_cases

from lynn_kernels import runtime, use_reference
from lynn_kernels.metrics import bit_mismatches, compare
from lynn_kernels.moe import SharedExpert, fuse_w13, moe_block, moe_experts, reference, route, stack_w13, triton_experts
from lynn_kernels.moe import check as moe_check
from lynn_kernels.moe.triton_experts import (
    block_m_for,
    launch_moe_experts,
    moe_block_triton,
    moe_experts_triton,
    moe_workspace,
)
from lynn_kernels.nvfp4 import NVFP4Tensor
from lynn_kernels.nvfp4 import reference as nvfp4_reference

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
DEV = runtime.DEVICE


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _quantized(shape, seed, per_expert=False, scale=0.2):
    """An NVFP4 weight on the kernels' device, with one global scale per expert when ``per_expert``."""
    w = (torch.randn(shape, generator=_gen(seed)) * scale).to(DEV)          # quantised where the kernels run
    g = w.abs().amax(dim=tuple(range(1, w.dim()))) / 2688 if per_expert else None
    return nvfp4_reference.quantize(w, global_scale=g)


def _experts(E, H, inter, seed=0, per_expert=True):
    """``w13 [E, 2I, H]`` and ``w2 [E, H, I]``; w2 scaled so that the output has about x's magnitude."""
    return (_quantized((E, 2 * inter, H), seed + 1, per_expert),
            _quantized((E, H, inter), seed + 2, per_expert, scale=0.5 / inter ** 0.5))


def _routing(M, top_k, E, seed=0, experts=None):
    """The check's routing (:func:`lynn_kernels.moe.check.routing`) from a seed."""
    return moe_check.routing(M, top_k, E, _gen(seed), experts)


def _x(M, H, dtype, seed=0):
    return torch.randn(M, H, generator=_gen(seed)).to(dtype).to(DEV)


def _dense(w, dtype):
    """An expert weight as a ``dtype`` tensor: NVFP4 dequantised, a float one cast."""
    return nvfp4_reference.dequantize(w, dtype) if isinstance(w, NVFP4Tensor) else w.to(dtype)


def _plain_baseline(x, weights, ids, w13, w2):
    """The experts computed plainly in x's 16-bit dtype (as HF does in a bf16 / fp16 model), from the same
    dequantised (or float) weights."""
    dt = x.dtype
    xb, out = x, torch.zeros(x.shape, dtype=dt, device=x.device)
    w13b, w2b = _dense(w13, dt), _dense(w2, dt)
    for e in range(w13b.shape[0]):
        t, j = torch.where(ids == e)
        if t.numel():
            gate, up = (xb[t] @ w13b[e].t()).chunk(2, dim=-1)
            out.index_add_(0, t, (F.silu(gate) * up) @ w2b[e].t() * weights[t, j, None].to(dt))
    return out


def _plain_shared(x, shared):
    """The shared expert computed plainly in x's 16-bit dtype, from the same dequantised weights."""
    dt = x.dtype
    gate, up = (x @ _dense(shared.w13, dt).t()).chunk(2, dim=-1)
    return torch.sigmoid(x @ shared.gate_weight.to(dt).t()) * ((F.silu(gate) * up) @ _dense(shared.w2, dt).t())


def assert_experts_close(got, x, weights, ids, w13, w2, what=""):
    """``got`` against the reference in x's dtype, and (bf16 / fp16) against the fp32 reference next to a plain
    computation in x's dtype; returns the metrics against the fp32 reference."""
    assert got.dtype == x.dtype and tuple(got.shape) == tuple(x.shape), what
    assert bool(torch.isfinite(got).all()), f"{what}: non-finite output (a row left unwritten?)"
    want = reference.moe_experts(x, weights, ids, w13, w2)
    m = compare(got, want)
    if x.dtype == FP32:
        assert m.rel_l2 < 1e-5 and m.cosine > 0.99999, f"{what}: {m}"
        return m
    assert m.cosine > 0.9999 and m.rel_l2 < 4e-3, f"{what}: {m}"
    exact = reference.moe_experts(x.float(), weights, ids, *(w if isinstance(w, NVFP4Tensor) else w.float()
                                                             for w in (w13, w2)))
    m = compare(got, exact, baseline=_plain_baseline(x, weights, ids, w13, w2))
    assert m.cosine > 0.9999 and m.err_ratio < 1.0, f"{what} vs fp32: {m}"
    return m


# ---------------------------------------------------------------------------------------------------------------
# 1. moe_experts against the reference


@pytest.mark.parametrize("case", check_cases("moe", "moe.moe_experts"))
def test_moe_experts_matches_reference(case, poison_empty):
    """The check matrix's experts (``EXPERTS``, ``FLOAT_EXPERTS``, ``PACKED_EXPERTS`` of lynn_kernels/moe/check.py):
    NVFP4 in the checkpoint layout (one global scale or one per expert), float weights of x's dtype, and packed
    stacks (per-row scales, zero / negative block scales) against the reference on the checkpoint weights; both paths,
    every prefill BLOCK_M, experts without tokens and every token on one expert; within the module's tolerances."""
    assert_case_passes(case)


def test_moe_experts_fp16_int64_ids_strided_x(poison_empty):
    """fp16 x read in place from a wider buffer (row stride 96, not H), int64 ids, bf16 routing weights."""
    M, top_k, E, H, inter = 20, 2, 5, 80, 48
    w13, w2 = _experts(E, H, inter, seed=3)
    weights, ids = _routing(M, top_k, E, seed=4)
    x = _x(M, 96, FP16, seed=5)[:, 8:88]
    assert x.stride(0) == 96
    weights = weights.to(BF16).float().to(BF16)
    got = moe_experts(x, weights, ids.long(), w13, w2)
    assert_experts_close(got, x, weights, ids.long(), w13, w2)


def test_moe_experts_empty_batch():
    w13, w2 = _experts(4, 64, 32)
    weights, ids = _routing(0, 2, 4)
    out = moe_experts(_x(0, 64, BF16), weights, ids, w13, w2)
    assert tuple(out.shape) == (0, 64) and out.dtype == BF16


@pytest.mark.parametrize("M", [pytest.param(3, id="decode-M3"), pytest.param(50, id="prefill-M50")])
def test_moe_experts_deterministic(M):
    """Two runs give the same bits (no atomics: every slot row is written once, tokens summed in choice order)."""
    E, top_k, H, inter = 6, 3, 64, 64
    w13, w2 = _experts(E, H, inter, seed=7)
    weights, ids = _routing(M, top_k, E, seed=8)
    x = _x(M, H, BF16, seed=9)
    a, b = moe_experts(x, weights, ids, w13, w2), moe_experts(x, weights, ids, w13, w2)
    assert bit_mismatches(a, b) == 0


@pytest.mark.parametrize("M", [pytest.param(4, id="decode-M4"), pytest.param(30, id="prefill-M30")])
def test_launch_moe_experts_reuses_a_poisoned_workspace(M, poison_empty):
    """The launch layer writes everything it reads: one NaN / -1 workspace and output serve two calls with different
    routings (the second must not see the first's sorted slots or intermediate rows)."""
    E, top_k, H, inter = 7, 2, 80, 48
    w13, w2 = _experts(E, H, inter, seed=11)
    x = _x(M, H, BF16, seed=12)
    ws = moe_workspace(M, top_k, E, H, inter, BF16, DEV)
    out = torch.full((M, H), float("nan"), dtype=BF16, device=DEV)
    for seed, experts in ((13, None), (14, [2, 6])):
        weights, ids = _routing(M, top_k, E, seed=seed, experts=experts)
        assert launch_moe_experts(x, weights, ids, w13, w2, out, ws) is out
        assert_experts_close(out, x, weights, ids, w13, w2, what=f"seed {seed}")


@pytest.mark.parametrize("M", [pytest.param(2, id="decode-M2"), pytest.param(40, id="prefill-M40")])
def test_launch_moe_experts_small_tiles(M, poison_empty):
    """Tiles of 16 x 32: several N tiles per GEMM and several K steps, the last one partial (H = 80, I = 48)."""
    E, top_k, H, inter = 5, 2, 80, 48
    w13, w2 = _experts(E, H, inter, seed=15)
    weights, ids = _routing(M, top_k, E, seed=16)
    x = _x(M, H, BF16, seed=17)
    out = torch.empty((M, H), dtype=BF16, device=DEV)
    launch_moe_experts(x, weights, ids, w13, w2, out, moe_workspace(M, top_k, E, H, inter, BF16, DEV),
                       config={"BLOCK_N": 16, "BLOCK_K": 32})
    assert_experts_close(out, x, weights, ids, w13, w2)


def test_paths_and_block_m(monkeypatch):
    """M <= 16 never calls align; M > 16 does, with BLOCK_M from the expected rows per expert."""
    calls = []
    real = triton_experts.launch_align
    monkeypatch.setattr(triton_experts, "launch_align", lambda ids, E, bm, *a: calls.append(bm) or real(ids, E, bm, *a))
    w13, w2 = _experts(4, 64, 32)
    for M in (16, 17):
        weights, ids = _routing(M, 2, 4, seed=M)
        moe_experts_triton(_x(M, 64, FP32), weights, ids, w13, w2)
    assert calls == [16]
    assert [block_m_for(M, 8, 256) for M in (64, 512, 1024, 4096, 8192, 8256)] == [16, 16, 64, 64, 64, 128]
    assert block_m_for(20, 2, 512) == 16                      # bounded by the slots, not E


def test_as_batch_runs_a_block_as_calls_of_that_many_rows(monkeypatch):
    """Inside ``as_batch(1)`` a block of 20 tokens (past the decode path's 16) runs in pieces on the decode path, each
    token getting the bits of a block of one token; outside, it takes the prefill path (align); inside ``as_batch(17)``
    it runs as blocks of exactly 17 tokens, the last padded."""
    calls = []
    real = triton_experts.launch_align
    monkeypatch.setattr(triton_experts, "launch_align", lambda *a: calls.append(1) or real(*a))
    w13, w2 = _experts(6, 64, 32, seed=1)
    router = (torch.randn(6, 64, generator=_gen(3)) * 0.1).to(BF16).to(DEV)
    x, shared = _x(20, 64, BF16, seed=4), _shared(64, 32, seed=5)
    with runtime.as_batch(1):
        got = moe_block(x, router, w13, w2, shared, top_k=2)
    assert calls == []
    alone = torch.cat([moe_block(x[i:i + 1], router, w13, w2, shared, top_k=2) for i in range(20)])
    assert torch.equal(got, alone), bit_mismatches(got, alone)
    moe_block(x, router, w13, w2, shared, top_k=2)
    assert calls == [1]                                         # the routed experts' align
    with runtime.as_batch(17):                                  # prefill tiles: calls of exactly 17 tokens
        got = moe_block(x, router, w13, w2, shared, top_k=2)
    padded = torch.cat([x, x.new_zeros(14, 64)])
    alone = torch.cat([moe_block(padded[r:r + 17], router, w13, w2, shared, top_k=2) for r in (0, 17)])[:20]
    assert torch.equal(got, alone), bit_mismatches(got, alone)


@pytest.mark.parametrize("dtype, per_row, down", [(BF16, False, False), (FP16, True, True)],
                         ids=["bf16", "fp16-per-row-scales-decoded-down"])
def test_decoded_experts_give_the_loop_decode_bits(dtype, per_row, down, monkeypatch):
    """The prefill path that decodes packed ``w13`` once (``DECODED_MIN_ROWS`` rows an expert on), and with
    ``DECODED_DOWN`` the routed ``w2`` too, multiplies the same tiles as the kernels that decode in their loop: a
    block (routed experts and the shared expert) gets the same bits either way; ``decoded=True`` on unpacked stacks
    is an error naming what it takes."""
    from lynn_kernels.moe import pack_experts

    E, H, inter, M = 6, 256, 128, 40
    w13, w2 = _experts(E, H, inter, seed=7)
    shared = _shared(H, inter, seed=8)
    if per_row:                                                 # w13's gate and up rows under their own scales
        ratio = torch.cat([torch.ones(inter), torch.full((inter,), 3.0)]).to(DEV)
        w13 = NVFP4Tensor(w13.codes, w13.scales, (w13.global_scale[:, None] * ratio).contiguous())
    p13, p2, pshared = pack_experts(w13, w2, shared)
    router = (torch.randn(E, H, generator=_gen(9)) * 0.1).to(dtype).to(DEV)
    x = _x(M, H, dtype, seed=10)
    pshared = pshared._replace(gate_weight=pshared.gate_weight.to(dtype))
    launches = []
    real = triton_experts.decode_experts
    monkeypatch.setattr(triton_experts, "decode_experts", lambda w, *a: launches.append(
        "shared.w13" if w is pshared.w13 else "w13" if w is p13 else "w2" if w is p2 else w) or real(w, *a))
    monkeypatch.setattr(triton_experts, "DECODED_DOWN", down)
    looped = moe_block(x, router, p13, p2, pshared, top_k=2)
    assert launches == []
    monkeypatch.setattr(triton_experts, "DECODED_MIN_ROWS", 13)      # 40 tokens x top-2 over 6 experts: 13.3
    decoded = moe_block(x, router, p13, p2, pshared, top_k=2)
    assert launches == ["shared.w13", "w13"] + ["w2"] * down
    assert torch.equal(decoded, looped), bit_mismatches(decoded, looped)
    weights, ids = _routing(M, 2, E, seed=11)
    with pytest.raises(ValueError, match="decoded=True decodes packed expert stacks"):
        triton_experts.launch_moe_experts(x, weights, ids, w13, w2, torch.empty_like(x),
                                          triton_experts.moe_workspace(M, 2, E, H, inter, dtype, DEV), decoded=True)


@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_gate_up_ahead_gives_the_same_bits(dtype, monkeypatch, poison_empty):
    """``GATE_UP_AHEAD``: in 64-row blocks the gate_up kernel on packed ``w13`` loads each step's words and x rows a
    step ahead, in registers; the same tiles in the same order, so the same bits as the loop that loads them in
    their own step (two k steps and four column tiles here, the last step's look-ahead loading nothing)."""
    from lynn_kernels.moe import pack_experts

    E, H, inter, M, top_k = 8, 256, 128, 64, 4                    # 32 rows an expert: 64-row blocks
    w13, w2, _ = pack_experts(*_experts(E, H, inter, seed=15))
    weights, ids = _routing(M, top_k, E, seed=16)
    x = _x(M, H, dtype, seed=17)
    assert block_m_for(M, top_k, E) == 64
    ahead = []
    kernel = triton_experts.MOE_GATE_UP

    class Seen:                                                    # records the AHEAD each launch is given
        def current(self, *a):
            launch = kernel.current(*a)
            return type("Grid", (), {"__getitem__": lambda _, grid: lambda *args, **kw: (
                ahead.append(kw["AHEAD"]), launch[grid](*args, **kw))})()

    monkeypatch.setattr(triton_experts, "MOE_GATE_UP", Seen())

    def run(on):
        monkeypatch.setattr(triton_experts, "GATE_UP_AHEAD", on)
        ws = moe_workspace(M, top_k, E, H, inter, dtype, DEV)
        return launch_moe_experts(x, weights, ids, w13, w2, torch.empty_like(x), ws,
                                  config={"BLOCK_N": 32, "BLOCK_K": 128})   # 2 k steps, 4 column tiles

    plain, got = run(False), run(True)
    assert ahead == [False, True]
    assert torch.equal(got, plain), bit_mismatches(got, plain)


# ---------------------------------------------------------------------------------------------------------------
# 2. moe_block against the reference and against HF transformers


def _shared(H, inter_s, seed):
    s13 = _quantized((2 * inter_s, H), seed)
    s2 = _quantized((H, inter_s), seed + 1, scale=0.5 / inter_s ** 0.5)
    return SharedExpert(s13, s2, (torch.randn(1, H, generator=_gen(seed + 2)) * 0.1).to(DEV))


@pytest.mark.parametrize("case", check_cases("moe", "moe.moe_block", "moe.norm_moe_block"))
def test_moe_block_matches_reference(case, poison_empty):
    """The check matrix's blocks (``BLOCKS`` and the fixed E 10 cases of lynn_kernels/moe/check.py): NVFP4 or float
    routed experts with no, an NVFP4 or a float shared expert, per-shard gate / up scales, the packed experts with the
    shared expert as a routed slot, and the norm in the router's launch, on both paths, against the reference."""
    assert_case_passes(case)


def assert_block_close(got, x, router, w13, w2, shared, top_k, bf16_rel_l2=4e-3):
    """``moe_block``'s output against the reference block (``renormalize=False``), and (bf16 / fp16) against the
    unrounded fp32 block on the same routing, next to a plain block in x's dtype: an error below the plain one's."""
    H, dtype = x.shape[-1], x.dtype
    m = compare(got, reference.moe_block(x, router, w13, w2, shared, top_k=top_k, renormalize=False))
    assert (m.rel_l2 < 1e-5) if dtype == FP32 else (m.cosine > 0.9999 and m.rel_l2 < bf16_rel_l2), m
    if dtype != FP32:          # against the unrounded fp32 block (the same routing), next to a plain bf16 block
        x2 = x.reshape(-1, H)
        weights, ids = reference.route((x2.float() @ router.float().t()).to(dtype), top_k, False)
        exact = reference.moe_experts(x2.float(), weights, ids, w13, w2)
        plain = _plain_baseline(x2, weights, ids, w13, w2)
        if shared is not None:
            exact, plain = exact + reference.shared_expert(x2, shared), plain + _plain_shared(x2, shared)
        m = compare(got.reshape(-1, H), exact, baseline=plain)
        assert m.err_ratio < 1.0, f"vs fp32: {m}"


def _dequantized(q):
    return nvfp4_reference.dequantize(q.to("cpu"), FP32)


@pytest.mark.parametrize("tokens", [pytest.param(5, id="decode-M5"), pytest.param(18, id="prefill-M18")])
@pytest.mark.parametrize("model", ["qwen3_next-raw", "qwen3_5_moe"])
def test_moe_block_matches_hf(model, tokens, hf_moe_blocks):
    """HF's sparse MoE block in fp32 with our dequantised NVFP4 weights (per-expert global scales) == moe_block on
    fp32 x, to fp32 summation order."""
    block_cls, cfg, renormalize = hf_moe_blocks[model]
    E, H, inter, inter_s = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, \
        cfg.shared_expert_intermediate_size
    w13, w2 = _experts(E, H, inter, seed=31)
    shared = _shared(H, inter_s, seed=33)
    router = torch.randn(E, H, generator=_gen(35))
    block = block_cls(cfg).eval()
    with torch.no_grad():
        block.gate.weight.copy_(router)
        block.experts.gate_up_proj.copy_(_dequantized(w13))
        block.experts.down_proj.copy_(_dequantized(w2))
        s13 = _dequantized(shared.w13)
        block.shared_expert.gate_proj.weight.copy_(s13[:inter_s])
        block.shared_expert.up_proj.weight.copy_(s13[inter_s:])
        block.shared_expert.down_proj.weight.copy_(_dequantized(shared.w2))
        block.shared_expert_gate.weight.copy_(shared.gate_weight.cpu())
        x = torch.randn(1, tokens, H, generator=_gen(37))
        want = block(x)
    got = moe_block(x.to(DEV), router.to(DEV), w13, w2, shared, top_k=cfg.num_experts_per_tok,
                    renormalize=renormalize)
    m = compare(got, want)
    assert got.shape == x.shape and m.rel_l2 < 1e-5, m


# ---------------------------------------------------------------------------------------------------------------
# 3. errors a user can act on


_W13, _W2 = _experts(4, 32, 16, seed=41)
_WEIGHTS, _IDS = _routing(3, 2, 4, seed=42)
_X = _x(3, 32, FP32)
_ARGS = (_X, _WEIGHTS, _IDS, _W13, _W2)


def _with(**kw):
    names = ("x", "weights", "ids", "w13", "w2")
    return lambda: tuple(kw.get(n, a) for n, a in zip(names, _ARGS))


EXPERT_ERRORS = [
    pytest.param(_with(x=_X[None]), ValueError, r"x must be 2-D \[M, H\], found shape \(1, 3, 32\)", id="x-3d"),
    pytest.param(_with(x=_X.to(torch.int32)), TypeError, "x has dtype int32", id="x-int"),
    pytest.param(_with(x=_x(3, 48, FP32)), ValueError, r"w13 must have shape \[4, 2I, H=48\]", id="H-mismatch"),
    pytest.param(_with(ids=_IDS.float()), TypeError, "ids has dtype float32; expected an integer", id="ids-float"),
    pytest.param(_with(ids=_IDS[:2]), ValueError, r"ids must have shape \[M, top_k\] with M=3", id="ids-rows"),
    pytest.param(_with(weights=_WEIGHTS[:, :1]), ValueError, "weights must have the shape of ids", id="weights-shape"),
    pytest.param(_with(weights=_IDS), TypeError, "weights has dtype int32", id="weights-int"),
    pytest.param(_with(w13=_W13.dequantize(FP32)), TypeError, r"w13 must be an NVFP4Tensor \[E, 2I, H\]",
                 id="w13-dense"),
    pytest.param(_with(w2=_experts(5, 32, 16)[1]), ValueError, r"w2 must have shape \[4, H, I\] = \(4, 32, 16\)",
                 id="w2-E-mismatch"),
    pytest.param(_with(w2=_experts(4, 32, 32)[1]), ValueError, r"w2 must have shape \[4, H, I\] = \(4, 32, 16\)",
                 id="w2-I-mismatch"),
    pytest.param(_with(w13=_W13[0]), ValueError, r"w13 must be a 3-D NVFP4Tensor", id="w13-2d"),
    pytest.param(_with(ids=_IDS + 2), ValueError, r"ids must lie in \[0, num_experts\) = \[0, 4\), found min 2, "
                 r"max 5", id="id-out-of-range"),
    pytest.param(lambda: (_X, torch.rand(3, 5), torch.zeros(3, 5, dtype=torch.int32), _W13, _W2), ValueError,
                 r"ids has top_k=5 columns but w13 has E=4 experts", id="topk>E"),
]


@pytest.mark.parametrize("backend", ["kernel", "reference"])
@pytest.mark.parametrize("make_args, error, match", EXPERT_ERRORS)
def test_moe_experts_errors(make_args, error, match, backend):
    with use_reference(backend == "reference"), pytest.raises(error, match=match):
        moe_experts(*make_args())


def test_kernel_only_errors():
    """Limits of the kernels (the reference takes any global-scale layout; the kernels take per-row scales for w13,
    section 5, but not for w2)."""
    per_row = nvfp4_reference.quantize(torch.randn(4, 32, 16), global_scale=torch.full((4, 32), 1e-3)).to(DEV)
    with pytest.raises(ValueError, match=r"w2.global_scale has shape \(4, 32\); the grouped expert kernels take "
                                         r"\(\) or \[E\] for the down projection.*per-row global scales are "
                                         r"supported for w13 only"):
        moe_experts(_X, _WEIGHTS, _IDS, _W13, per_row)
    reference.moe_experts(_X, _WEIGHTS, _IDS, _W13, per_row)                  # fine there
    router = torch.randn(4, 32).to(DEV)
    s = _shared(32, 16, seed=43)
    s2 = nvfp4_reference.quantize(torch.randn(32, 16), global_scale=torch.full((32,), 1e-3)).to(DEV)
    with pytest.raises(ValueError, match=r"shared.w2.global_scale has shape \(32,\).*take \(\) for the down"):
        moe_block(_X, router, _W13, _W2, SharedExpert(s.w13, s2, s.gate_weight), top_k=2)
    with pytest.raises(ValueError, match="x is on meta"):
        moe_experts_triton(_X.to("meta"), _WEIGHTS, _IDS, _W13, _W2)
    with pytest.raises(ValueError, match="router_weight is on meta"):
        moe_block_triton(_X, router.to("meta"), _W13, _W2, top_k=2)
    with pytest.raises(ValueError, match=r"top_k must lie in \[1, E\] = \[1, 4\]"):
        moe_block(_X, router, _W13, _W2, top_k=5)


# ---------------------------------------------------------------------------------------------------------------
# 4. float (bf16 / fp32) expert weights: the same kernels, weight tiles loaded as they are


def _float_experts(E, H, inter, dtype, seed=0):
    """Plain float ``w13 [E, 2I, H]`` and ``w2 [E, H, I]`` in ``dtype`` (the scales of :func:`_experts`)."""
    w13 = torch.randn(E, 2 * inter, H, generator=_gen(seed + 1)) * 0.2
    w2 = torch.randn(E, H, inter, generator=_gen(seed + 2)) * (0.5 / inter ** 0.5)
    return w13.to(dtype).to(DEV), w2.to(dtype).to(DEV)


def _float_shared(H, inter_s, dtype, seed):
    s13, s2 = _float_experts(1, H, inter_s, dtype, seed)
    return SharedExpert(s13[0], s2[0], (torch.randn(1, H, generator=_gen(seed + 3)) * 0.1).to(DEV))


@pytest.mark.parametrize("dtype", [pytest.param(BF16, id="bf16"), pytest.param(FP32, id="fp32")])
@pytest.mark.parametrize("tokens", [pytest.param(5, id="decode-M5"), pytest.param(18, id="prefill-M18")])
@pytest.mark.parametrize("model", ["qwen3_next-raw", "qwen3_5_moe"])
def test_moe_block_float_weights_match_hf(model, tokens, dtype, hf_moe_blocks):
    """HF's sparse MoE block holding our float weights (the bf16 baseline a decoder checks parity with). fp32: equal
    to fp32 summation order. bf16: against HF's block in fp32 on the same bf16 weights and x, closer than HF's own
    bf16 block (which rounds every intermediate to bf16; ours rounds ``h`` and the output only)."""
    block_cls, cfg, renormalize = hf_moe_blocks[model]
    E, H, inter, inter_s = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, \
        cfg.shared_expert_intermediate_size
    w13, w2 = _float_experts(E, H, inter, dtype, seed=81)
    shared = _float_shared(H, inter_s, dtype, seed=83)
    router = torch.randn(E, H, generator=_gen(85)).to(dtype)
    block = block_cls(cfg).eval()
    with torch.no_grad():
        block.gate.weight.copy_(router.float())
        block.experts.gate_up_proj.copy_(w13.cpu().float())
        block.experts.down_proj.copy_(w2.cpu().float())
        block.shared_expert.gate_proj.weight.copy_(shared.w13[:inter_s].cpu().float())
        block.shared_expert.up_proj.weight.copy_(shared.w13[inter_s:].cpu().float())
        block.shared_expert.down_proj.weight.copy_(shared.w2.cpu().float())
        block.shared_expert_gate.weight.copy_(shared.gate_weight.cpu())
        x = torch.randn(1, tokens, H, generator=_gen(87)).to(dtype)
        exact = block(x.float())                                # HF in fp32 on the dtype-exact values
        hf = block.to(dtype)(x) if dtype != FP32 else exact      # HF in x's dtype
    got = moe_block(x.to(DEV), router.to(DEV), w13, w2, shared, top_k=cfg.num_experts_per_tok,
                    renormalize=renormalize)
    assert got.shape == x.shape and got.dtype == dtype
    if dtype == FP32:
        m = compare(got, exact)
        assert m.rel_l2 < 1e-5, m
    else:
        m = compare(got, exact, baseline=hf)
        assert m.cosine > 0.9999 and m.err_ratio < 1.0, m
        m = compare(got, hf)
        assert m.cosine > 0.999, m


# ---------------------------------------------------------------------------------------------------------------
# 5. per-shard global scales: an expert's gate_proj and up_proj with their own global scales (ModelOpt)

#: up's global scale over gate's: not a power of two, so no exponent shift could hide a merged scale.
SHARD_RATIO = 2.7


def _shards(E, H, inter, seed):
    """Per-expert gate_proj / up_proj ``[I, H]`` NVFP4, each with its own global scale, up's ``SHARD_RATIO`` times
    gate's (and the up weights that much larger, so both use their E4M3 range)."""
    gates, ups = [], []
    for e in range(E):
        w = torch.randn(2, inter, H, generator=_gen(seed + e)).to(DEV) * 0.2
        g = w[0].abs().amax() / 2688
        gates.append(nvfp4_reference.quantize(w[0], global_scale=g))
        ups.append(nvfp4_reference.quantize(w[1] * SHARD_RATIO, global_scale=g * SHARD_RATIO))
    return gates, ups


def _shard_dense(gates, ups) -> torch.Tensor:
    """fp32 ``[E, 2I, H]``: each shard dequantised with its own global scale, then concatenated (not via w13)."""
    return torch.stack([torch.cat([nvfp4_reference.dequantize(g, FP32), nvfp4_reference.dequantize(u, FP32)])
                        for g, u in zip(gates, ups)])


@pytest.mark.parametrize("M, dtype", [pytest.param(1, FP32, id="decode-M1-fp32"),
                                      pytest.param(3, BF16, id="decode-M3-bf16"),
                                      pytest.param(16, FP32, id="decode-M16-fp32"),
                                      pytest.param(40, FP32, id="prefill-M40-fp32"),
                                      pytest.param(40, BF16, id="prefill-M40-bf16")])
def test_moe_experts_per_shard_scales(M, dtype, poison_empty):
    """``stack_w13`` of gate / up with different global scales (one per row of w13): the kernels against a reference
    that dequantises each shard with its own scale; a merged scale would be far off."""
    E, top_k, H, inter = 5, 2, 64, 48
    gates, ups = _shards(E, H, inter, seed=91)
    w13 = stack_w13(gates, ups)
    _, w2 = _experts(E, H, inter, seed=92)
    assert tuple(w13.global_scale.shape) == (E, 2 * inter)
    ratio = ups[0].global_scale / gates[0].global_scale
    assert not float(torch.log2(ratio)).is_integer()
    weights, ids = _routing(M, top_k, E, seed=M)
    x = _x(M, H, dtype, seed=M + 2)
    got = moe_experts(x, weights, ids, w13, w2)
    assert bool(torch.isfinite(got).all())
    want = reference.moe_experts(x.float(), weights, ids, _shard_dense(gates, ups), _dense(w2, FP32))
    m = compare(got, want.to(dtype))
    assert (m.rel_l2 < 1e-5) if dtype == FP32 else (m.cosine > 0.9999 and m.rel_l2 < 4e-3), m
    assert_experts_close(got, x, weights, ids, w13, w2)          # the reference reads w13's per-row scales too
    merged = NVFP4Tensor(w13.codes, w13.scales, w13.global_scale[:, :1].expand(E, 2 * inter).contiguous())
    assert compare(got, reference.moe_experts(x, weights, ids, merged, w2)).rel_l2 > 0.1


@pytest.mark.parametrize("shape", [pytest.param((1, 3, 64), id="decode-M3"),
                                   pytest.param((2, 9, 64), id="prefill-M18")])
def test_moe_block_per_shard_scales(shape, poison_empty):
    """Routed and shared experts both with per-shard scales (``stack_w13``, ``fuse_w13``), fp32, against the block
    computed from each shard dequantised with its own scale."""
    E, top_k, H, inter, inter_s = 6, 2, shape[-1], 32, 48
    gates, ups = _shards(E, H, inter, seed=101)
    w13, w2 = stack_w13(gates, ups), _experts(E, H, inter, seed=102)[1]
    (s_gate,), (s_up,) = _shards(1, H, inter_s, seed=103)
    s13 = fuse_w13(s_gate, s_up)
    assert tuple(s13.global_scale.shape) == (2 * inter_s,)
    s2 = _quantized((H, inter_s), 104, scale=0.5 / inter_s ** 0.5)
    gate_weight = (torch.randn(1, H, generator=_gen(105)) * 0.1).to(DEV)
    router = (torch.randn(E, H, generator=_gen(106)) * 0.3).to(DEV)
    x = torch.randn(shape, generator=_gen(107)).to(DEV)
    got = moe_block(x, router, w13, w2, SharedExpert(s13, s2, gate_weight), top_k=top_k)
    dense_shared = SharedExpert(_shard_dense([s_gate], [s_up])[0], _dense(s2, FP32), gate_weight)
    want = reference.moe_block(x, router, _shard_dense(gates, ups), _dense(w2, FP32), dense_shared, top_k=top_k)
    m = compare(got, want)
    assert bool(torch.isfinite(got).all()) and m.rel_l2 < 1e-5, m


@pytest.mark.parametrize("M", [pytest.param(4, id="decode-M4"), pytest.param(30, id="prefill-M30")])
@pytest.mark.parametrize("kind", ["bf16-weights", "per-shard"])
def test_launch_float_and_per_shard_reuse_a_poisoned_workspace(kind, M, poison_empty):
    """The launch layer with float weights or per-row w13 scales: a NaN / -1 workspace and output serve two
    routings; ``BLOCK_K`` 32: several K steps, the last one partial (H = 80, I = 48)."""
    E, top_k, H, inter = 5, 2, 80, 48
    if kind == "bf16-weights":
        w13, w2 = _float_experts(E, H, inter, BF16, seed=111)
    else:
        w13, w2 = stack_w13(*_shards(E, H, inter, seed=111)), _experts(E, H, inter, seed=112)[1]
    x = _x(M, H, BF16, seed=113)
    ws = moe_workspace(M, top_k, E, H, inter, BF16, DEV)
    out = torch.full((M, H), float("nan"), dtype=BF16, device=DEV)
    for seed, experts in ((114, None), (115, [1, 4])):
        weights, ids = _routing(M, top_k, E, seed=seed, experts=experts)
        assert launch_moe_experts(x, weights, ids, w13, w2, out, ws, config={"BLOCK_K": 32}) is out
        assert_experts_close(out, x, weights, ids, w13, w2, what=f"seed {seed}")


def test_stack_w13_layouts():
    """The shortest exact global-scale layout: one per tensor, per expert, or per row; codes and block scales
    concatenated untouched; float lists concatenated; compressed-tensors' own G kept per row too."""
    E, inter, H = 3, 16, 32
    gates, ups = _shards(E, H, inter, seed=121)
    w13 = stack_w13(gates, ups)
    for e in range(E):
        assert torch.equal(w13.codes[e], torch.cat([gates[e].codes, ups[e].codes]))
        assert torch.equal(w13.scales[e].view(torch.uint8),
                           torch.cat([gates[e].scales, ups[e].scales]).view(torch.uint8))
        assert torch.equal(w13.global_scale[e, :inter], gates[e].global_scale.expand(inter))
        assert torch.equal(w13.global_scale[e, inter:], ups[e].global_scale.expand(inter))
    same = stack_w13(gates, [NVFP4Tensor(u.codes, u.scales, g.global_scale) for g, u in zip(gates, ups)])
    assert torch.equal(same.global_scale, torch.stack([g.global_scale for g in gates]))        # [E]
    one = torch.tensor(1e-3, device=DEV)
    shared_g = [[NVFP4Tensor(w.codes, w.scales, one) for w in ws] for ws in (gates, ups)]
    assert stack_w13(*shared_g).global_scale.dim() == 0                                         # ()
    s13 = fuse_w13(gates[0], ups[0])
    assert tuple(s13.shape) == (2 * inter, H) and tuple(s13.global_scale.shape) == (2 * inter,)
    ct = [nvfp4_reference.quantize(torch.randn(inter, H, generator=_gen(122 + i)) * (1 + i),
                                   recipe="compressed-tensors") for i in range(2)]
    f = fuse_w13(*ct)
    assert tuple(f.recip_global_scale.shape) == (2 * inter,)
    assert torch.equal(f.recip_global_scale, torch.cat([c.recip_global_scale.expand(inter) for c in ct]))
    fg, fu = _float_experts(2, H, inter // 2, BF16, seed=123)[0].unbind(0)
    assert torch.equal(stack_w13([fg], [fu])[0], torch.cat([fg, fu]))


# ---------------------------------------------------------------------------------------------------------------
# 6. errors for float weights (the w13 helpers' errors are rows of tests/test_bad_inputs.py)

_FW13, _FW2 = _float_experts(4, 32, 16, FP32, seed=131)


MIXED_ERRORS = [
    pytest.param(_with(w13=_FW13), TypeError, r"w13 must be an NVFP4Tensor \[E, 2I, H\], as w2 is \(both weights of "
                 r"an FFN are of one kind.*found a float32 tensor", id="float-w13-nvfp4-w2"),
    pytest.param(_with(w2=_FW2), TypeError, r"w2 must be an NVFP4Tensor \[E, H, I\], as w13 is.*found a float32 tensor",
                 id="nvfp4-w13-float-w2"),
    pytest.param(_with(w13=_FW13.to(BF16), w2=_FW2.to(BF16)), TypeError,
                 r"w13 has dtype bfloat16; float expert weights must have x's dtype \(float32\)",
                 id="float-not-x-dtype"),
    pytest.param(_with(w13=_FW13, w2=_FW2.to(BF16)), TypeError,
                 r"w2 has dtype bfloat16; float expert weights must have x's dtype \(float32\)",
                 id="float-dtypes-differ"),
    pytest.param(_with(w13=_FW13.int(), w2=_FW2.int()), TypeError, "w13 has dtype int32", id="int-weights"),
    pytest.param(_with(w13=[_FW13], w2=_FW2), TypeError, r"w13 must be an NVFP4Tensor \[E, 2I, H\].*or a float "
                 r"torch.Tensor of x's dtype, found list", id="w13-list"),
    pytest.param(_with(w13=_FW13[0], w2=_FW2), ValueError, r"w13 must be a 3-D tensor \[E, 2I, H\]", id="float-w13-2d"),
    pytest.param(lambda: (_X, _WEIGHTS, _IDS, torch.zeros(4, 6, 32), torch.zeros(4, 32, 3)), ValueError,
                 r"need an even H and I.*I=3", id="float-odd-I"),
]


@pytest.mark.parametrize("backend", ["kernel", "reference"])
@pytest.mark.parametrize("make_args, error, match", MIXED_ERRORS)
def test_float_weight_errors(make_args, error, match, backend):
    with use_reference(backend == "reference"), pytest.raises(error, match=match):
        moe_experts(*make_args())


@pytest.mark.parametrize("backend", ["kernel", "reference"])
def test_float_shared_errors(backend):
    router = torch.randn(4, 32).to(DEV)
    s = _float_shared(32, 16, FP32, seed=132)
    q = _shared(32, 16, seed=133)
    with use_reference(backend == "reference"):
        with pytest.raises(TypeError, match=r"shared.w13 must be an NVFP4Tensor \[2I, H\], as shared.w2 is"):
            moe_block(_X, router, _W13, _W2, SharedExpert(s.w13, q.w2, s.gate_weight), top_k=2)
        with pytest.raises(TypeError, match=r"shared.w2 has dtype bfloat16; float expert weights must have x's dtype"):
            moe_block(_X, router, _W13, _W2, SharedExpert(s.w13, s.w2.to(BF16), s.gate_weight), top_k=2)
        with pytest.raises(TypeError, match=r"w2 must be an NVFP4Tensor \[E, H, I\], as w13 is"):
            moe_block(_X, router, _W13, _FW2, s, top_k=2)


# ---------------------------------------------------------------------------------------------------------------
# 7. GPU: a Qwen3.5-35B-A3B layer


@functools.lru_cache(maxsize=1)
def _real_experts(E: int, H: int, inter: int):
    """Real-size expert stacks, drawn on the device (a CPU draw of 800M values takes most of a GPU test's time
    budget on the device's host) and kept across the parametrised cases of one shape."""
    gen = torch.Generator(device=DEV).manual_seed(51)

    def q(shape, scale):
        w = torch.randn(shape, generator=gen, device=DEV) * scale
        return nvfp4_reference.quantize(w, global_scale=w.abs().amax(dim=(1, 2)) / 2688)

    return q((E, 2 * inter, H), 0.2), q((E, H, inter), 0.5 / inter ** 0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("E, top_k, M", [(256, 8, 1), (256, 8, 64), (256, 8, 512), (512, 10, 1), (512, 10, 16),
                                         (512, 10, 512)],
                         ids=["qwen35-M1", "qwen35-M64", "qwen35-M512", "qwen3next-M1", "qwen3next-M16",
                              "qwen3next-M512"])
def test_moe_real_shapes_gpu(E, top_k, M):
    """Qwen3.5 (E=256, top-8) and Qwen3-Next (E=512, top-10) at H=2048, I=512 (shared 512), bf16: the decode and
    prefill paths, vs the reference and a plain bf16 run, deterministic; the block with its shared expert."""
    H, inter = 2048, 512
    w13, w2 = _real_experts(E, H, inter)
    x = _x(M, H, BF16, seed=52)
    router = (torch.randn(E, H, generator=_gen(53)) * 0.05).to(BF16).to(DEV)
    weights, ids = route((x.float() @ router.float().t()).to(BF16), top_k)
    got = moe_experts(x, weights, ids, w13, w2)
    assert_experts_close(got, x, weights, ids, w13, w2, what=f"E={E} M={M}")
    assert bit_mismatches(got, moe_experts(x, weights, ids, w13, w2)) == 0, "not deterministic"
    shared = _shared(H, inter, seed=54)
    got = moe_block(x, router, w13, w2, shared, top_k=top_k)
    m = compare(got, reference.moe_block(x, router, w13, w2, shared, top_k=top_k))
    assert m.cosine > 0.9999 and m.rel_l2 < 4e-3, m


@pytest.mark.gpu
@pytest.mark.parametrize("E, top_k, M", [(256, 8, 1), (256, 8, 8), (256, 8, 16), (256, 8, 64), (512, 10, 1),
                                         (512, 10, 16), (512, 10, 512)],
                         ids=["qwen35-M1", "qwen35-M8", "qwen35-M16", "qwen35-M64", "qwen3next-M1", "qwen3next-M16",
                              "qwen3next-M512"])
def test_moe_packed_real_shapes_gpu(E, top_k, M):
    """The packed experts (``pack_experts``, the shared expert as expert E: 3 launches at M <= 16) at the real
    shapes, bf16, compiled: the block against the reference on the checkpoint weights, deterministic, and the
    routed experts alone against the reference (both paths)."""
    H, inter = 2048, 512
    w13, w2 = _real_experts(E, H, inter)
    shared = _shared(H, inter, seed=54)
    x = _x(M, H, BF16, seed=55)
    router = (torch.randn(E, H, generator=_gen(53)) * 0.05).to(BF16).to(DEV)
    p13, p2 = _packed_block_close(x, router, w13, w2, shared, top_k)
    weights, ids = route((x.float() @ router.float().t()).to(BF16), top_k)
    got = moe_experts(x, weights, ids, p13, p2)
    assert_experts_close(got, x, weights, ids, w13, w2, what=f"packed E={E} M={M}")


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 8, 64], ids=["M1", "M8", "M64"])
@pytest.mark.parametrize("variant", ["per-row-scales", "fp16"])
def test_moe_packed_real_shapes_variants_gpu(variant, M):
    """The packed experts at the Qwen3.5 shape in the two forms the bf16 test above leaves out: w13 with one global
    scale per row (gate and up shards scaled apart, as ModelOpt checkpoints may be; the shared expert too) and fp16
    x (the packed prefill tile is ``e2m1 * s`` itself in fp16). Compiled, against the reference on the checkpoint
    weights, deterministic."""
    E, top_k, H, inter = 256, 8, 2048, 512
    w13, w2 = _real_experts(E, H, inter)
    shared = _shared(H, inter, seed=56)
    dtype = torch.float16 if variant == "fp16" else BF16
    if variant == "per-row-scales":          # the up rows' scale SHARD_RATIO times the gate rows'
        ratio = torch.cat([torch.ones(inter), torch.full((inter,), SHARD_RATIO)]).to(DEV)
        w13 = NVFP4Tensor(w13.codes, w13.scales, (w13.global_scale[:, None] * ratio).contiguous())
        shared = shared._replace(w13=NVFP4Tensor(shared.w13.codes, shared.w13.scales,
                                                 (shared.w13.global_scale * ratio).contiguous()))
    shared = shared._replace(gate_weight=shared.gate_weight.to(dtype))
    x = _x(M, H, dtype, seed=57)
    router = (torch.randn(E, H, generator=_gen(58)) * 0.05).to(dtype).to(DEV)
    _packed_block_close(x, router, w13, w2, shared, top_k)


@pytest.mark.gpu
@pytest.mark.parametrize("down", [False, True], ids=["w13", "w13-and-w2"])
def test_decoded_experts_real_shape_gpu(down, monkeypatch):
    """The decoded prefill path (``w13`` decoded once, gate_up on its tiles; with ``DECODED_DOWN`` ``w2`` too) at
    Qwen3.5-35B-A3B's experts and 4,096 tokens, compiled: the looped path's bits, against the reference, and the
    same bits on a second call."""
    from lynn_kernels.moe import pack_experts

    E, top_k, H, inter, M = 256, 8, 2048, 512, 4096
    w13, w2 = _real_experts(E, H, inter)
    p13, p2, _ = pack_experts(w13, w2)
    monkeypatch.setattr(triton_experts, "DECODED_DOWN", down)
    x = _x(M, H, BF16, seed=59)
    router = (torch.randn(E, H, generator=_gen(60)) * 0.05).to(BF16).to(DEV)
    weights, ids = route((x.float() @ router.float().t()).to(BF16), top_k)

    def run(decoded):
        ws = triton_experts.moe_workspace(M, top_k, E, H, inter, BF16, DEV)
        return triton_experts.launch_moe_experts(x, weights, ids, p13, p2, torch.empty_like(x), ws, decoded=decoded)

    got, looped = run(True), run(False)
    assert bit_mismatches(got, looped) == 0, "the decoded tiles gave other bits than the loop decode"
    assert_experts_close(got, x, weights, ids, w13, w2, what="decoded w13")
    assert bit_mismatches(got, run(True)) == 0, "not deterministic"
    del got, looped
    torch.cuda.empty_cache()                     # the other test workers share the GPU


def _packed_block_close(x, router, w13, w2, shared, top_k):
    """``pack_experts`` with the shared expert joined to the stacks, then the block on them against the reference on
    the checkpoint weights (cosine > 0.9999, rel_l2 < 4e-3) and bit-equal on a second run; returns the packed
    stacks."""
    from lynn_kernels.moe import pack_experts
    from lynn_kernels.moe.packed import shared_slot

    p13, p2, pshared = pack_experts(w13, w2, shared)
    assert shared_slot(p13, p2, pshared)
    got = moe_block(x, router, p13, p2, pshared, top_k=top_k)
    m = compare(got, reference.moe_block(x, router, w13, w2, shared, top_k=top_k))
    assert m.cosine > 0.9999 and m.rel_l2 < 4e-3, m
    assert bit_mismatches(got, moe_block(x, router, p13, p2, pshared, top_k=top_k)) == 0, "not deterministic"
    return p13, p2
