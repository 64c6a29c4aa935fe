"""MoE experts and block: the grouped NVFP4 kernels (``moe_experts``, ``moe_block``, the launch functions) against the
torch references, against a plain bf16 computation, and against HF transformers' own Qwen3-Next / Qwen3.5 MoE blocks.

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

from lynn_kernels import runtime, use_reference
from lynn_kernels.moe import SharedExpert, moe_block, moe_experts, reference, route
from lynn_kernels.moe import triton_experts
from lynn_kernels.moe.triton_experts import (DECODE_MAX_M, block_m_for, launch_moe_experts, moe_block_triton,
                                             moe_experts_triton, moe_workspace)
from lynn_kernels.nvfp4 import reference as nvfp4_reference
from lynn_kernels.validate import bit_mismatches, compare

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
    """fp32 weights (rows sum to 1) and int32 ids: ``top_k`` distinct experts per token, or drawn from the list
    ``experts`` with repetition (to leave experts without tokens, or to pile every token onto one)."""
    g = _gen(seed)
    if experts is None:
        ids = torch.rand(M, E, generator=g).argsort(dim=-1)[:, :top_k]
    else:
        pool = torch.tensor(experts)
        ids = pool[torch.randint(0, len(pool), (M, top_k), generator=g)]
    weights = torch.rand(M, top_k, generator=g) + 0.1
    weights = weights / weights.sum(-1, keepdim=True)
    return weights.to(DEV), ids.to(torch.int32).to(DEV)


def _x(M, H, dtype, seed=0):
    return torch.randn(M, H, generator=_gen(seed)).to(dtype).to(DEV)


def _plain_baseline(x, weights, ids, w13, w2):
    """The experts computed plainly in x's 16-bit dtype (as HF does in a bf16 / fp16 model), from the same
    dequantised weights."""
    dt = x.dtype
    xb, out = x, torch.zeros(x.shape, dtype=dt, device=x.device)
    w13b, w2b = nvfp4_reference.dequantize(w13, dt), nvfp4_reference.dequantize(w2, dt)
    for e in range(w13b.shape[0]):
        t, j = torch.where(ids == e)
        if t.numel():
            gate, up = (xb[t] @ w13b[e].t()).chunk(2, dim=-1)
            out.index_add_(0, t, (F.silu(gate) * up) @ w2b[e].t() * weights[t, j, None].to(dt))
    return out


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
    exact = reference.moe_experts(x.float(), weights, ids, w13, w2)
    m = compare(got, exact, baseline=_plain_baseline(x, weights, ids, w13, w2))
    assert m.cosine > 0.9999 and m.err_ratio < 1.0, f"{what} vs fp32: {m}"
    return m


# ---------------------------------------------------------------------------------------------------------------
# 1. moe_experts against the reference


def _case(M, top_k, E, H, inter, experts=None, per_expert=True, name=""):
    path = "decode" if M <= DECODE_MAX_M else f"prefill-bm{block_m_for(M, top_k, E)}"
    gs = "gE" if per_expert else "g1"
    return pytest.param(M, top_k, E, H, inter, experts, per_expert,
                        id=f"M{M}-k{top_k}-E{E}-H{H}-I{inter}-{gs}-{path}{'-' + name if name else ''}")


#: Both paths and the boundary between them (M = 16 | 17), every prefill BLOCK_M (16, 32, 64), E not a power of two,
#: H and I multiples of 16 but not of 64 (80, 48) as well as of 64 / 128, scalar and per-expert global scales.
EXPERT_CASES = [
    _case(1, 2, 4, 64, 32),
    _case(1, 1, 7, 80, 48, per_expert=False, name="top1"),
    _case(5, 8, 16, 64, 64),
    _case(16, 3, 7, 80, 48),
    _case(17, 3, 7, 80, 48, per_expert=False),
    _case(33, 2, 6, 64, 32, experts=[4], name="all-on-expert4"),
    _case(40, 4, 6, 128, 64, experts=[0, 2, 3, 5], name="experts-1-4-empty"),
    _case(100, 2, 7, 128, 64),
    _case(100, 2, 4, 80, 48, per_expert=False),
    _case(64, 1, 5, 64, 128, experts=[1, 3], name="top1"),
]


@pytest.mark.parametrize("dtype", [pytest.param(BF16, id="bf16"), pytest.param(FP32, id="fp32")])
@pytest.mark.parametrize("M, top_k, E, H, inter, experts, per_expert", EXPERT_CASES)
def test_moe_experts(M, top_k, E, H, inter, experts, per_expert, dtype, poison_empty):
    w13, w2 = _experts(E, H, inter, seed=M + E, per_expert=per_expert)
    weights, ids = _routing(M, top_k, E, seed=M, experts=experts)
    x = _x(M, H, dtype, seed=M + 1)
    assert_experts_close(moe_experts(x, weights, ids, w13, w2), x, weights, ids, w13, w2)


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
    assert [block_m_for(M, 8, 256) for M in (64, 512, 1024, 4096)] == [16, 16, 32, 64]
    assert block_m_for(20, 2, 512) == 16                      # bounded by the slots, not E


# ---------------------------------------------------------------------------------------------------------------
# 2. moe_block against the reference and against HF transformers


def _shared(H, inter_s, seed, per_row=False):
    s13 = _quantized((2 * inter_s, H), seed)
    if per_row:
        s13 = nvfp4_reference.quantize(torch.randn(2 * inter_s, H, generator=_gen(seed)),
                                       global_scale=torch.full((2 * inter_s,), 1e-3)).to(DEV)
    s2 = _quantized((H, inter_s), seed + 1, scale=0.5 / inter_s ** 0.5)
    return SharedExpert(s13, s2, (torch.randn(1, H, generator=_gen(seed + 2)) * 0.1).to(DEV))


BLOCK_CASES = [  # x shape (decode: 3 tokens; prefill: 2 x 9 = 18), with or without the shared expert
    pytest.param((1, 3, 80), True, id="decode-M3-shared"),
    pytest.param((2, 9, 80), False, id="prefill-M18-noshared"),
    pytest.param((2, 9, 80), True, id="prefill-M18-shared"),
]


@pytest.mark.parametrize("dtype", [pytest.param(BF16, id="bf16"), pytest.param(FP32, id="fp32")])
@pytest.mark.parametrize("shape, with_shared", BLOCK_CASES)
def test_moe_block(shape, with_shared, dtype, poison_empty):
    E, top_k, H, inter = 7, 2, shape[-1], 48
    w13, w2 = _experts(E, H, inter, seed=21)
    shared = _shared(H, 32, seed=22) if with_shared else None
    router = (torch.randn(E, H, generator=_gen(23)) * 0.3).to(dtype).to(DEV)
    x = torch.randn(shape, generator=_gen(24)).to(dtype).to(DEV)
    got = moe_block(x, router, w13, w2, shared, top_k=top_k, renormalize=False)
    want = reference.moe_block(x, router, w13, w2, shared, top_k=top_k, renormalize=False)
    assert got.dtype == dtype and tuple(got.shape) == shape
    m = compare(got, want)
    assert (m.rel_l2 < 1e-5) if dtype == FP32 else (m.cosine > 0.9999 and m.rel_l2 < 4e-3), m
    with use_reference():
        assert torch.equal(moe_block(x, router, w13, w2, shared, top_k=top_k, renormalize=False), want)


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
    """Limits of the kernels (the reference takes any global-scale layout)."""
    per_row = nvfp4_reference.quantize(torch.randn(4, 32, 32), global_scale=torch.full((4, 32), 1e-3)).to(DEV)
    with pytest.raises(ValueError, match=r"w13.global_scale has shape \(4, 32\); the grouped expert kernels take "
                                         r"\(\) or \[E\].*per-shard"):
        moe_experts(_X, _WEIGHTS, _IDS, per_row, _W2)
    reference.moe_experts(_X, _WEIGHTS, _IDS, per_row, _W2)                  # fine there
    router = torch.randn(4, 32).to(DEV)
    with pytest.raises(ValueError, match=r"shared.w13.global_scale has shape \(32,\).*take \(\)"):
        moe_block(_X, router, _W13, _W2, _shared(32, 16, seed=43, per_row=True), top_k=2)
    with pytest.raises(ValueError, match="x is on meta"):
        moe_experts_triton(_X.to("meta"), _WEIGHTS, _IDS, _W13, _W2)
    with pytest.raises(ValueError, match="router_weight is on meta"):
        moe_block_triton(_X, router.to("meta"), _W13, _W2, top_k=2)
    with pytest.raises(ValueError, match=r"top_k must lie in \[1, E\] = \[1, 4\]"):
        moe_block(_X, router, _W13, _W2, top_k=5)


# ---------------------------------------------------------------------------------------------------------------
# 4. GPU: a Qwen3.5-35B-A3B layer


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
