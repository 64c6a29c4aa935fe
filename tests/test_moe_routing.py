"""MoE routing and align: the Triton kernels against the torch references, the align contract restated from scratch,
the references against HF transformers' own Qwen3-Next / Qwen3.5 MoE code, and errors.

Kernel tests run under Triton's interpreter on the CPU with every fresh allocation poisoned (NaN floats, 0xFF
integers), so an output or workspace entry a kernel forgets to write shows up. Align runs its one-program kernel for
up to 128 slots under the interpreter (1024 on the GPU) and the three-kernel path above; ``chunk=16`` forces many
chunks on small inputs.
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_case_passes, check_cases

from lynn_kernels import runtime, use_reference
from lynn_kernels.metrics import compare
from lynn_kernels.moe import SharedExpert, align, max_padded, reference, route
from lynn_kernels.moe.check import ALIGNS, ROUTES
from lynn_kernels.moe.triton_align import align_triton, launch_align
from lynn_kernels.moe.triton_route import MAX_EXPERTS, launch_router, route_triton
from lynn_kernels.nvfp4 import reference as nvfp4_reference
from lynn_kernels.triton_shared import split_k_counter

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _logits(M, E, dtype=FP32, seed=0, scale=2.0):
    return (torch.randn(M, E, generator=_gen(seed)) * scale).to(dtype).to(runtime.DEVICE)


def _ids(M, top_k, E, seed=0, experts=None, dtype=torch.int32):
    """Random ids in ``[0, E)``, or drawn from the list ``experts`` (to leave some experts without tokens)."""
    pool = torch.arange(E) if experts is None else torch.tensor(experts)
    pick = torch.randint(0, len(pool), (M, top_k), generator=_gen(seed))
    return pool[pick].to(dtype).to(runtime.DEVICE)


# ---------------------------------------------------------------------------------------------------------------
# 1. route: kernel against reference

#: (M, E, top_k): the check matrix's routing shapes (``ROUTES``), without its dtypes and renormalisation
ROUTE_CASES = [pytest.param(M, E, k, id=f"M{M}-E{E}-k{k}") for M, E, k in dict.fromkeys(r[:3] for r in ROUTES)]


@pytest.mark.parametrize("case", check_cases("moe", "moe.route"))
def test_route_matches_reference(case, poison_empty):
    """The check matrix's routings (bf16 and fp32 logits, renormalised or raw): the reference's ids, its weights to
    a few fp32 ulps, renormalised rows summing to 1."""
    assert_case_passes(case)


def _assert_route(got, want, M, top_k, rtol=4e-6):
    (w, ids), (w_ref, ids_ref) = got, want
    assert w.dtype == FP32 and ids.dtype == torch.int32
    assert tuple(w.shape) == tuple(ids.shape) == (M, top_k)
    assert torch.equal(ids.cpu(), ids_ref.cpu())
    torch.testing.assert_close(w.cpu(), w_ref.cpu(), rtol=rtol, atol=1e-8)


def _router_rtol(dtype):
    """The fused router's weights against the reference's: bf16 logits are rounded, so both sides route the same
    values (a few ulps of the softmax); fp32 logits are not, and the kernel sums H in split-K slices where cuBLAS
    uses its own order: 4.7e-6 measured on the H200 (M5-E60-k4-H144, 8c40726), so about twice that (not yet re-run
    there with this bound)."""
    return 1e-5 if dtype == FP32 else 4e-6


def test_route_fp16_and_strided_logits(poison_empty):
    """fp16 logits, read in place from a wider buffer (row stride 80, not E)."""
    wide = _logits(9, 80, FP16, seed=3)
    logits = wide[:, 5:65]
    _assert_route(route(logits, 6), reference.route(logits, 6), 9, 6)


@pytest.mark.parametrize("dtype", [pytest.param(BF16, id="bf16"), pytest.param(FP32, id="fp32")])
@pytest.mark.parametrize("fn", [route, reference.route], ids=["kernel", "reference"])
def test_route_ties_go_to_the_lowest_id(fn, dtype):
    E = 60
    logits = torch.randn(4, E, generator=_gen(1)).clamp(-2, 2)
    logits[0] = 0.0                                          # every expert tied
    logits[1, [41, 7, 23]] = 5.0                             # three tied winners
    logits[2, 50], logits[2, [33, 12, 59]] = 6.0, 4.0        # a clear winner, then a three-way tie
    logits[3] = torch.arange(E) % 3                          # twenty experts tied at the top, then twenty more
    w, ids = fn(logits.to(dtype).to(runtime.DEVICE), 8)
    ids = ids.cpu()
    assert ids[0].tolist() == list(range(8))
    torch.testing.assert_close(w[0].cpu(), torch.full((8,), 1 / 8), rtol=0, atol=1e-7)
    assert ids[1, :3].tolist() == [7, 23, 41]
    assert ids[2, :4].tolist() == [50, 12, 33, 59]
    assert ids[3].tolist() == [2, 5, 8, 11, 14, 17, 20, 23]


@pytest.mark.parametrize("fn", [route, reference.route], ids=["kernel", "reference"])
def test_route_orders_logits_one_ulp_apart(fn):
    """fp32 logits one ulp apart can give equal fp32 probabilities; the larger logit still ranks first (the
    selection is on the logits, as softmax orders them), not the lower id (found in review: 26 of 4096 rows)."""
    logits = torch.randn(256, 16, generator=_gen(3))
    logits[:, 3] = 8.0 + logits[:, 3].abs()                                           # the top two: 3 and 9
    logits[:, 9] = torch.nextafter(logits[:, 3], torch.full_like(logits[:, 3], 1e9))   # just above expert 3
    w, ids = fn(logits.to(runtime.DEVICE), 2)
    assert ids[:, 0].cpu().eq(9).all() and ids[:, 1].cpu().eq(3).all()
    assert bool((w[:, 0] >= w[:, 1]).all())


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")   # numpy, under the interpreter
def test_route_kernel_keeps_ids_valid_on_nan_logits():
    """The launch never reads values back, so NaN logits must still give distinct in-range ids (the grouped GEMM
    indexes memory with them); the public op raises instead (test_errors)."""
    logits = _logits(6, 40, seed=2)
    logits[1, 3] = float("nan")
    logits[2] = float("nan")
    logits[3, 7] = float("inf")
    _, ids = route_triton(logits, 10)
    ids = ids.cpu()
    assert bool(((ids >= 0) & (ids < 40)).all())
    assert all(len(set(row)) == 10 for row in ids.tolist())


@pytest.mark.parametrize("M, H, x_dtype, w_dtype", [(17, 48, torch.bfloat16, torch.bfloat16),
                                                    (70, 2500, torch.bfloat16, torch.float32),
                                                    (33, 200, torch.float32, torch.float32),
                                                    (1, 16, torch.float16, torch.float16)])
def test_shared_gate_is_the_fp32_sigmoid(M, H, x_dtype, w_dtype):
    """The prefill's shared-expert gate ``sigmoid(x @ w)`` in fp32 without an fp32 copy of x (one launch): the
    reference's fp32 product up to the order of its sum, at row counts and widths off the kernel's tiles (H = 2500:
    two column steps under the interpreter's tile of 2048)."""
    from lynn_kernels.moe.triton_route import launch_shared_gate

    gen = torch.Generator().manual_seed(M + H)
    x = torch.randn(M, H, generator=gen).to(x_dtype).to(runtime.DEVICE)
    w = (torch.randn(H, generator=gen) * H ** -0.5).to(w_dtype).to(runtime.DEVICE)
    got = launch_shared_gate(x, w, torch.empty(M, dtype=torch.float32, device=runtime.DEVICE))
    want = torch.sigmoid(x.float() @ w.float())
    assert (got - want).abs().max().item() < 2e-6, (got - want).abs().max().item()


def test_route_empty_batch():
    w, ids = route(_logits(0, 16), 4)
    assert tuple(w.shape) == tuple(ids.shape) == (0, 4)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")   # numpy, under the interpreter
@pytest.mark.parametrize("M, E, top_k", ROUTE_CASES)
def test_route_32_bit_keys_give_the_64_bit_keys_routing(M, E, top_k, monkeypatch, poison_empty):
    """``ROUTER_KEY32`` (bf16 logits: int32 top-k keys, the top half of the logit's order above the id's
    complement) gives the int64 keys' ids and weights bit for bit, on logits full of ties, bf16 neighbours one ulp
    apart, infinities and NaNs; and the reference's ids."""
    from lynn_kernels.moe import triton_route

    g = _gen(M * 31 + E)
    logits = ((torch.randn(M, E, generator=g) * 4).round() / 4).to(BF16)               # many ties
    half = E // 2
    logits[::2, :half] = torch.nextafter(logits[::2, half:2 * half].float(),            # ~ one bf16 ulp above
                                         torch.full((len(logits[::2]), half), 1e9)).to(BF16)
    logits = logits.to(runtime.DEVICE)
    finite_ids = reference.route(logits, top_k)[1]
    if M > 2:
        logits[1, E - 1], logits[2, 0] = float("-inf"), float("inf")
    monkeypatch.setattr(triton_route, "ROUTER_KEY32", False)
    want = route_triton(logits, top_k)
    monkeypatch.setattr(triton_route, "ROUTER_KEY32", True)
    assert triton_route._key32(BF16, 1024) and not triton_route._key32(FP32, 1024)
    got = route_triton(logits, top_k)
    assert torch.equal(got[1].cpu(), want[1].cpu())
    assert torch.equal(got[0].cpu().view(torch.int32), want[0].cpu().view(torch.int32))
    rows = [0] + list(range(3, M))                           # rows without infinities: the reference's ids
    assert torch.equal(got[1].cpu()[rows], finite_ids.cpu()[rows])
    nan = logits.clone()
    nan[0, :3] = float("nan")
    _, ids = route_triton(nan, top_k)
    assert bool(((ids >= 0) & (ids < E)).all()) and all(len(set(r)) == top_k for r in ids.cpu().tolist())


@pytest.mark.parametrize("M, E, top_k, H", [pytest.param(1, 256, 8, 96, id="M1-E256-k8"),
                                             pytest.param(7, 512, 10, 48, id="M7-E512-k10")])
def test_fused_router_32_bit_keys(M, E, top_k, H, monkeypatch, poison_empty):
    """The fused router (bf16, the shared expert's gate as a routed slot) with ``ROUTER_KEY32``: the int64 keys'
    routing and gate, bit for bit."""
    from lynn_kernels.moe import triton_route

    x = (torch.randn(M, H, generator=_gen(M + H)) * 0.5).to(BF16).to(runtime.DEVICE)
    r = (torch.randn(E, H, generator=_gen(E)) * 0.5).to(BF16).to(runtime.DEVICE)
    gw = (torch.randn(H, generator=_gen(E + 1)) * 0.1).to(BF16).to(runtime.DEVICE)

    def run():
        w = torch.full((M, top_k + 1), float("nan"), device=runtime.DEVICE)
        ids = torch.full((M, top_k + 1), -1, dtype=torch.int32, device=runtime.DEVICE)
        return launch_router(x, r, top_k, True, w, ids, gate_weight=gw, shared_slot=True)

    monkeypatch.setattr(triton_route, "ROUTER_KEY32", False)
    want = run()
    monkeypatch.setattr(triton_route, "ROUTER_KEY32", True)
    got = run()
    assert torch.equal(got[1].cpu(), want[1].cpu())
    assert torch.equal(got[0].cpu().view(torch.int32), want[0].cpu().view(torch.int32))


#: (M, E, top_k, H): the decode batches (M <= 16) that take the fused router; E not a power of two, H not a multiple
#: of the H tile, several E tiles and H slices (split order), Qwen3.5 / Qwen3-Next routing widths
ROUTER_CASES = [
    pytest.param(1, 7, 2, 80, id="M1-E7-k2-H80"),
    pytest.param(5, 60, 4, 144, id="M5-E60-k4-H144"),
    pytest.param(16, 256, 8, 64, id="M16-E256-k8-H64"),
    pytest.param(3, 512, 10, 48, id="M3-E512-k10-H48"),
    pytest.param(16, 33, 1, 1040, id="M16-E33-k1-H1040"),
]


@pytest.mark.parametrize("dtype", [pytest.param(BF16, id="bf16"), pytest.param(FP32, id="fp32")])
@pytest.mark.parametrize("M, E, top_k, H", ROUTER_CASES)
def test_fused_router(M, E, top_k, H, dtype, poison_empty):
    """``launch_router`` (logits GEMM + routing in one launch, M <= 16) equals ``reference.route`` of the reference's
    logits (the fp32 product rounded to x's dtype), twice in a row: the last program resets the ticket counter."""
    x = (torch.randn(M, H, generator=_gen(M + H)) * 0.5).to(dtype).to(runtime.DEVICE)
    r = (torch.randn(E, H, generator=_gen(E)) * 0.5).to(dtype).to(runtime.DEVICE)
    want = reference.route((x.float() @ r.float().t()).to(dtype), top_k)
    for _ in range(2):
        w = torch.full((M, top_k), float("nan"), device=runtime.DEVICE)
        ids = torch.full((M, top_k), -1, dtype=torch.int32, device=runtime.DEVICE)
        got = launch_router(x, r, top_k, True, w, ids)
        assert got[0] is w and got[1] is ids
        _assert_route((w, ids), want, M, top_k, _router_rtol(dtype))
    assert int(split_k_counter(x.device, 1)[0]) == 0


@pytest.mark.parametrize("dtype", [pytest.param(BF16, id="bf16"), pytest.param(FP32, id="fp32")])
@pytest.mark.parametrize("M, E, top_k, H", ROUTER_CASES)
def test_fused_router_with_the_shared_gate(M, E, top_k, H, dtype, poison_empty):
    """The shared expert's gate as row E of the router's product: the routing is the same as without it, and
    ``gate`` equals ``sigmoid(x @ g)`` with the fp32 product (the reference's), to a few fp32 ulps."""
    x = (torch.randn(M, H, generator=_gen(M + H)) * 0.5).to(dtype).to(runtime.DEVICE)
    r = (torch.randn(E, H, generator=_gen(E)) * 0.5).to(dtype).to(runtime.DEVICE)
    g = (torch.randn(H, generator=_gen(E + 1)) * 0.1).to(dtype).to(runtime.DEVICE)
    want = reference.route((x.float() @ r.float().t()).to(dtype), top_k)
    want_gate = torch.sigmoid(x.float() @ g.float())
    w = torch.full((M, top_k), float("nan"), device=runtime.DEVICE)
    ids = torch.full((M, top_k), -1, dtype=torch.int32, device=runtime.DEVICE)
    gate = torch.full((M,), float("nan"), device=runtime.DEVICE)
    launch_router(x, r, top_k, True, w, ids, gate_weight=g, gate=gate)
    _assert_route((w, ids), want, M, top_k, _router_rtol(dtype))
    assert (gate - want_gate).abs().max() <= 1e-6, (gate, want_gate)      # interpreter: <= 2.4e-7
    assert int(split_k_counter(x.device, 1)[0]) == 0


# ---------------------------------------------------------------------------------------------------------------
# 2. align: the contract, restated from scratch; kernel == reference, bit for bit


def _assert_contract(ids, E, block_m, out):
    """The docstring of reference.align, in plain Python."""
    sorted_slots, block_expert, num_padded = (t.cpu() for t in out)
    S = ids.numel()
    P = max_padded(S, E, block_m)
    assert all(t.dtype == torch.int32 for t in (sorted_slots, block_expert, num_padded))
    assert tuple(sorted_slots.shape) == (P,) and tuple(block_expert.shape) == (P // block_m,)
    flat = ids.flatten().tolist()
    rows, blocks = [], []
    for e in range(E):
        slots = [s for s in range(S) if flat[s] == e]
        if slots:
            n = -(-len(slots) // block_m) * block_m
            rows += slots + [S] * (n - len(slots))
            blocks += [e] * (n // block_m)
    assert num_padded.tolist() == [len(rows)]
    assert sorted_slots.tolist() == rows + [S] * (P - len(rows))
    assert block_expert.tolist() == blocks + [-1] * (P // block_m - len(blocks))


def _assert_same_bits(got, want):
    for name, g, w in zip(("sorted_slots", "block_expert", "num_padded"), got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert torch.equal(g.cpu(), w.cpu()), f"{name}: {int((g.cpu() != w.cpu()).sum())} entries differ"


@pytest.mark.parametrize("case", check_cases("moe", "moe.align"))
def test_align_matches_reference(case, poison_empty):
    """The check matrix's aligns (``ALIGNS``: the one-program kernel and the three-kernel path, empty and crowded
    experts): the reference's three outputs, bit for bit."""
    assert_case_passes(case)


@pytest.mark.parametrize("M, top_k, E, block_m, experts", ALIGNS)
def test_align_reference_keeps_the_contract(M, top_k, E, block_m, experts):
    ids = _ids(M, top_k, E, seed=M + E, experts=experts)
    _assert_contract(ids, E, block_m, reference.align(ids, E, block_m))


@pytest.mark.parametrize("chunk", [16, 32])
def test_align_many_chunks(chunk, poison_empty):
    """The three-kernel path with many small chunks (its per-chunk offsets), int64 ids, one expert unused."""
    M, top_k, E, block_m = 45, 3, 11, 16
    ids = _ids(M, top_k, E, seed=chunk, experts=[0, 1, 2, 3, 5, 6, 7, 8, 9, 10], dtype=torch.int64)
    want = reference.align(ids, E, block_m)
    got = [torch.empty_like(t) for t in want]
    _assert_same_bits(launch_align(ids, E, block_m, *got, chunk=chunk), want)


def test_align_empty_batch():
    for fn in (align, reference.align):
        sorted_slots, block_expert, num_padded = fn(torch.zeros(0, 8, dtype=torch.int32, device=runtime.DEVICE),
                                                    64, 16)
        assert sorted_slots.numel() == 0 and block_expert.numel() == 0 and num_padded.tolist() == [0]


def test_max_padded():
    assert max_padded(8, 512, 16) == 128                     # a decode step: bounded by the slots, not E
    assert max_padded(4096 * 8, 256, 64) == 32768 + 256 * 63
    assert max_padded(10, 7, 16) == 128                      # round_up(10 + 7 * 15, 16)


def test_route_then_align(poison_empty):
    """The two steps chained as the MoE block does, on Qwen3.5's expert count."""
    weights, ids = route(_logits(20, 256, BF16, seed=5), 8)
    _assert_same_bits(align(ids, 256, 16), reference.align(ids, 256, 16))


# ---------------------------------------------------------------------------------------------------------------
# 3. the references against HF transformers (a dev extra: skipped when absent)


HF_MODELS = ["qwen3_next-renorm", "qwen3_next-raw", "qwen3_5_moe"]


@pytest.mark.parametrize("dtype", [pytest.param(BF16, id="bf16"), pytest.param(FP32, id="fp32")])
@pytest.mark.parametrize("model", HF_MODELS)
def test_route_reference_matches_hf_router(model, dtype, hf_moe_blocks):
    """HF's router (softmax in fp32, topk, renormalise, cast to the logits' dtype) on its own logits: same ids, and
    our fp32 weights rounded to the logits' dtype are HF's weights bit for bit."""
    block_cls, cfg, renormalize = hf_moe_blocks[model]
    torch.manual_seed(0)
    router = block_cls(cfg).gate.to(dtype)
    with torch.no_grad():
        router.weight.normal_()
        logits, hf_weights, hf_ids = router(torch.randn(50, 64).to(dtype))
    weights, ids = reference.route(logits, cfg.num_experts_per_tok, renormalize)
    # torch.topk does not say which of equal probabilities it returns (bf16 logits tie often, and the choice
    # changed between torch 2.11 and 2.13): rows with a tie among the chosen or at the cut compare as sets of values
    probs = torch.softmax(logits.float(), dim=-1)
    k = cfg.num_experts_per_tok
    top = probs.sort(dim=-1, descending=True).values[:, :k + 1]
    tied = (top[:, 1:] == top[:, :-1]).any(dim=-1)
    assert torch.equal(ids.long()[~tied], hf_ids[~tied])
    assert torch.equal(probs.gather(1, ids.long())[tied], probs.gather(1, hf_ids)[tied])
    assert torch.equal(weights.to(dtype)[~tied], hf_weights[~tied])
    assert torch.equal(weights.to(dtype)[tied].sort(dim=-1).values, hf_weights[tied].sort(dim=-1).values)


def _quantized(shape, seed, per_expert=False):
    """An NVFP4 weight (per-expert global scales when ``per_expert``) and its exact fp32 value."""
    w = torch.randn(shape, generator=_gen(seed)) * 0.2
    g = w.abs().amax(dim=(1, 2)) / 2688 if per_expert else None
    q = nvfp4_reference.quantize(w, global_scale=g)
    return q, nvfp4_reference.dequantize(q, FP32)


@pytest.mark.parametrize("model", HF_MODELS)
def test_moe_block_reference_matches_hf(model, hf_moe_blocks):
    """HF's sparse MoE block in fp32, its weights set to our dequantised NVFP4 experts: moe_block agrees to fp32
    summation order (both compute the router, routing, experts and shared expert in fp32 here)."""
    block_cls, cfg, renormalize = hf_moe_blocks[model]
    E, H, inter, inter_s = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, \
        cfg.shared_expert_intermediate_size
    w13, w13_f = _quantized((E, 2 * inter, H), 1, per_expert=True)
    w2, w2_f = _quantized((E, H, inter), 2, per_expert=True)
    s13, s13_f = _quantized((2 * inter_s, H), 3)
    s2, s2_f = _quantized((H, inter_s), 4)
    router_w = torch.randn(E, H, generator=_gen(5))
    gate_w = torch.randn(1, H, generator=_gen(6)) * 0.1
    block = block_cls(cfg).eval()
    with torch.no_grad():
        block.gate.weight.copy_(router_w)
        block.experts.gate_up_proj.copy_(w13_f)
        block.experts.down_proj.copy_(w2_f)
        block.shared_expert.gate_proj.weight.copy_(s13_f[:inter_s])
        block.shared_expert.up_proj.weight.copy_(s13_f[inter_s:])
        block.shared_expert.down_proj.weight.copy_(s2_f)
        block.shared_expert_gate.weight.copy_(gate_w)
        x = torch.randn(2, 9, H, generator=_gen(7))
        want = block(x)
    got = reference.moe_block(x, router_w, w13, w2, SharedExpert(s13, s2, gate_w), top_k=cfg.num_experts_per_tok,
                              renormalize=renormalize)
    assert got.shape == x.shape and got.dtype == FP32
    m = compare(got, want)
    assert m.rel_l2 < 1e-5, m


def test_moe_experts_reference_is_the_per_token_sum():
    """moe_experts (grouped by expert, as the kernels will be) == the definition token by token, choice by choice."""
    M, top_k, E, H, inter = 6, 3, 5, 32, 16
    w13, w13_f = _quantized((E, 2 * inter, H), 1, per_expert=True)
    w2, w2_f = _quantized((E, H, inter), 2)
    x = torch.randn(M, H, generator=_gen(3)).to(BF16)
    ids = _ids(M, top_k, E, seed=4, experts=[0, 1, 3, 4], dtype=torch.int64).cpu()
    weights = torch.rand(M, top_k, generator=_gen(5))
    want = torch.zeros(M, H)
    for t in range(M):
        for j in range(top_k):
            e = int(ids[t, j])
            h = w13_f[e] @ x[t].float()
            want[t] += weights[t, j] * (w2_f[e] @ (torch.nn.functional.silu(h[:inter]) * h[inter:]))
    got = reference.moe_experts(x, weights, ids, w13, w2)
    assert got.dtype == BF16
    assert compare(got, want).rel_l2 < 4e-3                 # one bf16 rounding of the fp32 sum


# ---------------------------------------------------------------------------------------------------------------
# 4. errors a user can act on, on every backend


def _dev(t):
    return t.to(runtime.DEVICE)


_L = lambda *shape, dtype=FP32: _dev(torch.zeros(shape, dtype=dtype))       # noqa: E731
_NAN = _dev(torch.tensor([[0.0, float("nan"), 1.0]]))
_INF = _dev(torch.tensor([[0.0, 1.0], [float("-inf"), 1.0]]))

ROUTE_ERRORS = [
    pytest.param(lambda: (_L(8), 2), ValueError, r"logits must be 2-D \[M, E\]", id="logits-1d"),
    pytest.param(lambda: (_L(2, 8, dtype=torch.int32), 2), TypeError, "logits has dtype int32", id="logits-int"),
    pytest.param(lambda: ([[0.0, 1.0]], 1), TypeError, "logits must be a torch.Tensor, found list", id="logits-list"),
    pytest.param(lambda: (_L(2, 8), 0), ValueError, r"top_k must lie in \[1, E\] = \[1, 8\].*found 0", id="k0"),
    pytest.param(lambda: (_L(2, 8), 9), ValueError, r"top_k must lie in \[1, E\] = \[1, 8\].*found 9", id="k>E"),
    pytest.param(lambda: (_L(2, 8), 2.0), TypeError, "top_k must be a Python int", id="k-float"),
    pytest.param(lambda: (_NAN, 1), ValueError, "logits must be finite: 1 NaN/Inf values in 1 of 1 rows", id="nan"),
    pytest.param(lambda: (_INF, 1), ValueError, r"logits must be finite.*first bad row 1", id="inf"),
]


@pytest.mark.parametrize("backend", ["kernel", "reference"])
@pytest.mark.parametrize("make_args, error, match", ROUTE_ERRORS)
def test_route_errors(make_args, error, match, backend):
    with use_reference(backend == "reference"), pytest.raises(error, match=match):
        route(*make_args())


_IDS = _dev(torch.tensor([[0, 3], [2, 1]], dtype=torch.int32))
ALIGN_ERRORS = [
    pytest.param(lambda: (_IDS.float(), 4, 16), TypeError, "ids has dtype float32; expected an integer",
                 id="ids-float"),
    pytest.param(lambda: (_IDS.flatten(), 4, 16), ValueError, r"ids must be 2-D \[M, top_k\]", id="ids-1d"),
    pytest.param(lambda: (_IDS, 3, 16), ValueError, r"ids must lie in \[0, num_experts\) = \[0, 3\), found min 0, "
                 r"max 3", id="id-too-large"),
    pytest.param(lambda: (_IDS - 1, 4, 16), ValueError, r"found min -1, max 2", id="id-negative"),
    pytest.param(lambda: (_IDS, 0, 16), ValueError, "num_experts must be >= 1", id="E0"),
    pytest.param(lambda: (_IDS, 4, 24), ValueError, "block_m must be a power of two >= 16, found 24", id="bm24"),
    pytest.param(lambda: (_IDS, 4, 8), ValueError, "block_m must be a power of two >= 16, found 8", id="bm8"),
    pytest.param(lambda: (_IDS, 4, 16.0), TypeError, "block_m must be a Python int", id="bm-float"),
]


@pytest.mark.parametrize("backend", ["kernel", "reference"])
@pytest.mark.parametrize("make_args, error, match", ALIGN_ERRORS)
def test_align_errors(make_args, error, match, backend):
    with use_reference(backend == "reference"), pytest.raises(error, match=match):
        align(*make_args())


def test_kernel_limits_and_devices():
    with pytest.raises(ValueError, match=f"at most {MAX_EXPERTS} in registers"):
        route_triton(_L(1, MAX_EXPERTS + 1), 2)
    with pytest.raises(ValueError, match="align kernels handle at most"):
        align_triton(_IDS, MAX_EXPERTS + 1, 16)
    with pytest.raises(ValueError, match="logits is on meta"):
        route_triton(torch.zeros(2, 8, device="meta"), 2)
    with pytest.raises(ValueError, match="ids is on meta"):
        align_triton(torch.zeros(2, 2, dtype=torch.int32, device="meta"), 4, 16)


def test_experts_and_block_errors():
    w13, _ = _quantized((4, 32, 32), 1)
    w2, _ = _quantized((4, 32, 16), 2)
    x = torch.zeros(3, 32)
    ids, weights = torch.zeros(3, 2, dtype=torch.int64), torch.zeros(3, 2)
    with pytest.raises(TypeError, match=r"w13 must be an NVFP4Tensor \[E, 2I, H\]"):
        reference.moe_experts(x, weights, ids, torch.zeros(4, 32, 32), w2)
    with pytest.raises(ValueError, match=r"w2 must have shape \[4, H, I\] = \(4, 32, 16\)"):
        reference.moe_experts(x, weights, ids, w13, w13)
    with pytest.raises(ValueError, match=r"w13 must have shape \[4, 2I, H=48\]"):
        reference.moe_experts(torch.zeros(3, 48), weights, ids, w13, w2)
    with pytest.raises(ValueError, match=r"weights must have the shape of ids"):
        reference.moe_experts(x, weights[:, :1], ids, w13, w2)
    with pytest.raises(ValueError, match=r"ids must lie in \[0, num_experts\) = \[0, 4\)"):
        reference.moe_experts(x, weights, ids + 4, w13, w2)
    with pytest.raises(ValueError, match=r"router_weight must have shape \[E, H\] = \(4, 32\)"):
        reference.moe_block(x, torch.zeros(5, 32), w13, w2, top_k=2)
    with pytest.raises(ValueError, match=r"top_k must lie in \[1, E\] = \[1, 4\]"):
        reference.moe_block(x, torch.zeros(4, 32), w13, w2, top_k=5)
    with pytest.raises(TypeError, match="shared must be a SharedExpert"):
        reference.moe_block(x, torch.zeros(4, 32), w13, w2, (w13[0], w2[0], torch.zeros(1, 32)), top_k=2)
    with pytest.raises(ValueError, match=r"shared.gate_weight must have shape \[1, H\] = \(1, 32\)"):
        reference.moe_block(x, torch.zeros(4, 32), w13, w2, SharedExpert(w13[0], w2[0], torch.zeros(32)), top_k=2)
