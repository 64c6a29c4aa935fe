"""MoE experts in the packed kernel layout (``pack_experts``, ``PackedExperts``): the packing is exact, the packed
decode kernels (FMA on the packed words) and the prefill kernels on packed tiles against the references on the
checkpoint weights, the block with the shared expert folded into the stacks as expert E (three launches per decode
step: the router writes the shared slot), the packed decode tiles forced small, and the errors.

The oracle is always the reference on the *checkpoint* weights (NVFP4Tensor), never on the packed ones, so a packing
error cannot hide in both sides. Tolerances are test_moe's: fp32 x ``rel_l2 < 1e-5``; bf16 x ``cosine > 0.9999``,
``rel_l2 < 4e-3`` and an error below a plain bf16 computation's against the fp32 reference.

Kernel tests run under Triton's interpreter on the CPU with every fresh allocation poisoned (``poison_empty``). M <= 16
takes the packed decode kernels (one program per slot and row tile), M > 16 the prefill kernels (align, then row
blocks) on packed tiles.
"""

from __future__ import annotations

import pytest
import torch
from test_moe import (
    BF16,
    DEV,
    FP32,
    _experts,
    _gen,
    _quantized,
    _routing,
    _shards,
    _x,
    assert_block_close,
    assert_experts_close,
)
from test_moe import _shared as _nvfp4_shared

from lynn_kernels import use_reference
from lynn_kernels.matmul import PackedNVFP4, pack
from lynn_kernels.metrics import bit_mismatches, compare
from lynn_kernels.moe import (
    PackedExperts,
    SharedExpert,
    fuse_w13,
    moe_block,
    moe_experts,
    pack_experts,
    reference,
    spec,
    stack_w13,
    triton_experts,
    triton_experts_decode,
)
from lynn_kernels.moe.packed import shared_slot
from lynn_kernels.moe.triton_experts import DECODE_MAX_M, launch_moe_experts, moe_workspace
from lynn_kernels.moe.triton_route import launch_router
from lynn_kernels.nvfp4 import NVFP4Tensor
from lynn_kernels.nvfp4 import reference as nvfp4_reference


def _fp32(w) -> torch.Tensor:
    """An NVFP4Tensor dequantised to fp32 (the values every op computes with)."""
    assert isinstance(w, NVFP4Tensor), type(w)
    return nvfp4_reference.dequantize(w, FP32)


def _odd_blocks(w: NVFP4Tensor, seed: int) -> NVFP4Tensor:
    """``w`` with about one block scale in eight set to zero and one in eight negated (E4M3 allows both; no quantiser
    writes them): the packing zeroes a zero-scale block's codes and moves a negative scale's sign into the codes."""
    s = w.scales.view(torch.uint8).clone()
    r = torch.randint(0, 8, tuple(s.shape), generator=_gen(seed)).to(s.device)
    s = torch.where(r == 0, torch.zeros_like(s), torch.where(r == 1, s | 0x80, s))
    return NVFP4Tensor(w.codes, s.view(w.scales.dtype), w.global_scale)


def _routed(E, H, inter, scales, seed, odd=False):
    """``w13 [E, 2I, H]`` and ``w2 [E, H, I]`` NVFP4 with global scales ``"g1"`` (one per tensor), ``"gE"`` (one
    per expert) or ``"per-row"`` (w13 from per-expert gate / up shards with different scales, ``stack_w13``; w2
    per expert); ``odd``: some zero and negative block scales in both."""
    if scales == "per-row":
        w13, w2 = stack_w13(*_shards(E, H, inter, seed)), _experts(E, H, inter, seed=seed + 50)[1]
    else:
        w13, w2 = _experts(E, H, inter, seed=seed, per_expert=scales == "gE")
    return (_odd_blocks(w13, seed + 7), _odd_blocks(w2, seed + 8)) if odd else (w13, w2)


def _float_shared(H, inter_s, dtype, seed):
    s13 = (torch.randn(2 * inter_s, H, generator=_gen(seed)) * 0.2).to(dtype).to(DEV)
    s2 = (torch.randn(H, inter_s, generator=_gen(seed + 1)) * (0.5 / inter_s ** 0.5)).to(dtype).to(DEV)
    return SharedExpert(s13, s2, (torch.randn(1, H, generator=_gen(seed + 2)) * 0.1).to(DEV))


def _make_shared(kind, H, inter, seed, dtype=FP32):
    """The shared expert of a block whose routed experts have intermediate size ``inter``:

    * ``"none"``; ``"folded-g1"``: NVFP4 ``Is == I`` with one global scale per tensor (joins the stacks);
    * ``"folded-per-row"``: ``Is == I``, w13 from gate / up shards with different scales (``fuse_w13``, ``[2I]``);
    * ``"alone"``: NVFP4 ``Is = 32 != I`` (packed on its own); ``"float"``: unquantised ``Is == I`` (left as is)."""
    if kind == "none":
        return None
    if kind == "folded-g1":
        return _nvfp4_shared(H, inter, seed)
    if kind == "folded-per-row":
        (s_gate,), (s_up,) = _shards(1, H, inter, seed)
        s2 = _quantized((H, inter), seed + 1, scale=0.5 / inter ** 0.5)
        return SharedExpert(fuse_w13(s_gate, s_up), s2, (torch.randn(1, H, generator=_gen(seed + 2)) * 0.1).to(DEV))
    if kind == "alone":
        assert inter != 32
        return _nvfp4_shared(H, 32, seed)
    if kind == "float":
        return _float_shared(H, inter, dtype, seed)
    raise AssertionError(kind)


# ---------------------------------------------------------------------------------------------------------------
# 1. pack_experts: exact, the shared expert folded as expert E where its shape allows


def _assert_packed_stack(p, w: NVFP4Tensor, what: str):
    """A PackedExperts ``p`` of the checkpoint stack ``w``: its shape, layout, and values (whole and per expert)."""
    E, N, K = w.shape
    assert isinstance(p, PackedExperts), f"{what}: {type(p).__name__}"
    assert tuple(p.shape) == (E, N, K) and p.k == K and len(p) == E, f"{what}: {p}"
    kw = -(-K // 128) * 16                                                        # K padded to whole chunks of 128
    assert p.words.dtype == torch.int32 and tuple(p.words.shape) == (E, N, kw), what
    assert p.scales.dtype == torch.uint8 and tuple(p.scales.shape) == (E, N, kw // 2), what
    u = p.unpack()
    assert isinstance(u, NVFP4Tensor) and tuple(u.shape) == (E, N, K), what
    want = _fp32(w)
    assert torch.equal(_fp32(u), want), f"{what}: unpack() does not dequantise to the checkpoint's values"
    for e in range(E):                                                            # indexing: one expert, a view
        pe = p[e]
        assert isinstance(pe, PackedNVFP4) and tuple(pe.shape) == (N, K), what
        assert torch.equal(_fp32(pe.unpack()), want[e]), f"{what}[{e}]"


def _assert_packed_one(p, w: NVFP4Tensor, what: str):
    assert isinstance(p, PackedNVFP4), f"{what}: {type(p).__name__}"
    assert tuple(p.shape) == tuple(w.shape), what
    assert torch.equal(_fp32(p.unpack()), _fp32(w)), f"{what}: unpack() does not dequantise to the checkpoint's values"


PACK_CASES = [  # E, H, I, routed global scales, shared kind, zero / negative block scales
    pytest.param(4, 80, 48, "g1", "none", False, id="E4-H80-I48-g1-noshared"),
    pytest.param(5, 80, 48, "gE", "none", True, id="E5-H80-I48-gE-noshared-odd-block-scales"),
    pytest.param(5, 128, 64, "per-row", "none", False, id="E5-H128-I64-per-row-noshared"),
    pytest.param(6, 80, 48, "g1", "folded-g1", False, id="E6-H80-I48-g1-shared-folded-g1"),
    pytest.param(7, 80, 48, "gE", "folded-g1", True, id="E7-H80-I48-gE-shared-folded-g1-odd-block-scales"),
    pytest.param(5, 128, 64, "gE", "folded-per-row", False, id="E5-H128-I64-gE-shared-folded-per-row"),
    pytest.param(6, 80, 48, "per-row", "folded-g1", False, id="E6-H80-I48-per-row-shared-folded-g1"),
    pytest.param(6, 80, 48, "per-row", "folded-per-row", False, id="E6-H80-I48-per-row-shared-folded-per-row"),
    pytest.param(5, 80, 48, "gE", "alone", False, id="E5-H80-I48-gE-shared-alone-Is32"),
    pytest.param(4, 128, 64, "per-row", "alone", False, id="E4-H128-I64-per-row-shared-alone-Is32"),
    pytest.param(5, 80, 48, "gE", "float", False, id="E5-H80-I48-gE-shared-float"),
]


@pytest.mark.parametrize("E, H, inter, scales, shared_kind, odd", PACK_CASES)
def test_pack_experts_is_exact(E, H, inter, scales, shared_kind, odd):
    """``unpack()`` of every packed stack, expert and shared weight dequantises to the checkpoint's fp32 values bit
    for bit (K = 80 / 48: one partial chunk of 128; zero and negative block scales normalised without changing a
    value); the shared expert joins the stacks (``shared_slot``) exactly when it is NVFP4 with ``Is == I``."""
    w13, w2 = _routed(E, H, inter, scales, seed=E + H, odd=odd)
    shared = _make_shared(shared_kind, H, inter, seed=E + 3)
    w13p, w2p, shared_p = pack_experts(w13, w2, shared)
    _assert_packed_stack(w13p, w13, "w13")
    _assert_packed_stack(w2p, w2, "w2")
    assert spec.is_packed(w13p) and spec.is_nvfp4(w13p) and not spec.is_packed(w13)
    assert isinstance(spec.as_nvfp4(w13p), NVFP4Tensor) and spec.as_nvfp4(w13) is w13
    folded = shared_kind.startswith("folded")
    assert shared_slot(w13p, w2p, shared_p) == folded
    if shared_kind == "none":
        assert shared_p is None
    elif shared_kind == "float":
        assert shared_p.w13 is shared.w13 and shared_p.w2 is shared.w2 and shared_p.gate_weight is shared.gate_weight
    else:
        assert isinstance(shared_p, SharedExpert) and shared_p.gate_weight is shared.gate_weight
        _assert_packed_one(shared_p.w13, shared.w13, "shared.w13")
        _assert_packed_one(shared_p.w2, shared.w2, "shared.w2")
    if folded:    # the routed stacks are views of the first E experts of an E + 1 stack whose last is the shared one
        for p, s in ((w13p, shared_p.w13), (w2p, shared_p.w2)):
            assert s.words.data_ptr() == p.words.data_ptr() + p.words.numel() * 4
            assert s.scales.data_ptr() == p.scales.data_ptr() + p.scales.numel()
    elif shared_kind != "none":                 # packing each on its own never makes a shared slot
        assert not shared_slot(*pack_experts(w13, w2)[:2], shared_p)


def test_pack_experts_without_shared_keeps_the_global_scale_layout():
    """Without a shared expert each stack keeps the checkpoint's global-scale tensor: ``()``, ``[E]`` or ``[E, 2I]``."""
    for scales, want in (("g1", ()), ("gE", (5,)), ("per-row", (5, 96))):
        w13, w2 = _routed(5, 80, 48, scales, seed=3)
        w13p, w2p, _ = pack_experts(w13, w2)
        assert tuple(w13p.global_scale.shape) == want, scales
        assert torch.equal(w13p.global_scale, w13.global_scale.float())
        assert torch.equal(w2p.global_scale, w2.global_scale.float())


def test_references_take_packed_weights():
    """The reference ops unpack packed weights exactly: the same bits as on the checkpoint weights (experts and the
    block with the shared expert folded)."""
    E, top_k, H, inter, M = 5, 2, 80, 48, 4
    w13, w2 = _routed(E, H, inter, "per-row", seed=5)
    shared = _make_shared("folded-g1", H, inter, seed=6)
    w13p, w2p, shared_p = pack_experts(w13, w2, shared)
    weights, ids = _routing(M, top_k, E, seed=7)
    x = _x(M, H, BF16, seed=8)
    assert bit_mismatches(reference.moe_experts(x, weights, ids, w13p, w2p),
                          reference.moe_experts(x, weights, ids, w13, w2)) == 0
    router = (torch.randn(E, H, generator=_gen(9)) * 0.3).to(BF16).to(DEV)
    assert bit_mismatches(reference.moe_block(x, router, w13p, w2p, shared_p, top_k=top_k),
                          reference.moe_block(x, router, w13, w2, shared, top_k=top_k)) == 0


# ---------------------------------------------------------------------------------------------------------------
# 2. moe_experts on packed stacks against the reference on the checkpoint weights: the check matrix's
#    PACKED_EXPERTS (lynn_kernels/moe/check.py), swept by test_moe.py's test_moe_experts_matches_reference


# ---------------------------------------------------------------------------------------------------------------
# 3. moe_block on packed weights: the shared expert folded (3 launches at decode), separate, or absent


@pytest.fixture
def launches(monkeypatch):
    """Count the shared expert's own launches and record the slots per token of each packed decode launch (the
    wrappers forward to the real functions)."""
    calls = {"shared": 0, "packed_slots": []}
    real_shared, real_packed = triton_experts.launch_shared_expert, triton_experts_decode._launch_packed_decode

    def shared(*args, **kwargs):
        calls["shared"] += 1
        return real_shared(*args, **kwargs)

    def packed(x2, weights, ids, slots, *args, **kwargs):
        calls["packed_slots"].append(slots)
        return real_packed(x2, weights, ids, slots, *args, **kwargs)

    monkeypatch.setattr(triton_experts, "launch_shared_expert", shared)
    for module in (triton_experts, triton_experts_decode):     # moe_block's slot path calls it, and _launch_decode
        monkeypatch.setattr(module, "_launch_packed_decode", packed)
    return calls


def _bcase(shape, kind, dtype):
    M = shape[0] * shape[1]
    path = "decode" if M <= DECODE_MAX_M else "prefill"
    return pytest.param(shape, kind, dtype, id=f"{path}-M{M}-{kind}-{str(dtype)[6:]}")


#: x shapes (decode M = 1, 3, 16; prefill 2 x 9 = 18) x shared kinds x dtypes; M = 16 (the most slots of the decode
#: path, the slowest under the interpreter) with the folded shared expert in both dtypes and the separate one in bf16
#: (routed experts alone at M = 16: test_moe_experts_packed); a folded shared expert whose gate weight is not in x's
#: dtype (fp32 under bf16 x) takes the shared expert's own launch.
PACKED_BLOCK_CASES = [
    *(_bcase(s, k, dt) for s in ((1, 1, 80), (1, 3, 80), (2, 9, 80)) for k in ("folded", "separate", "none")
      for dt in (BF16, FP32)),
    _bcase((1, 3, 80), "folded-fp32-gate", BF16),
    _bcase((2, 8, 64), "folded", BF16),
    _bcase((2, 8, 64), "folded", FP32),
    _bcase((2, 8, 64), "separate", BF16),
]


@pytest.mark.parametrize("shape, kind, dtype", PACKED_BLOCK_CASES)
def test_moe_block_packed(shape, kind, dtype, launches, poison_empty):
    """The block on packed weights against the reference block on the checkpoint weights (and, bf16, closer to the
    fp32 block than a plain bf16 block). Folded (``Is == I``, the gate weight in x's dtype as in a model): at M <= 16
    the shared expert is one more slot of the packed decode launches (``slots = top_k + 1``, no launch of its own),
    and the result equals the same block with the shared expert packed on its own (not folded). Separate:
    ``Is = 32 != I``, packed on its own.

    bf16 at M = 1: the kernels round ``h`` to bf16 (test_moe's docstring) and a single token has 80 outputs, so a
    one-ulp difference on half of them gives ``rel_l2`` about 4e-3 against the bf16-rounded reference (the checkpoint
    kernels give the same 4.1e-3 on the separate case's input); the bound there is 6e-3, the quality gate (closer to
    fp32 than a plain bf16 block) unchanged."""
    E, top_k, H, inter = 7, 2, shape[-1], 48
    M = shape[0] * shape[1]
    w13, w2 = _routed(E, H, inter, "gE", seed=21)
    shared = {"folded": _make_shared("folded-g1", H, inter, seed=22),
              "folded-fp32-gate": _make_shared("folded-g1", H, inter, seed=22),
              "separate": _make_shared("alone", H, inter, 22), "none": None}[kind]
    if shared is not None and kind != "folded-fp32-gate":
        shared = shared._replace(gate_weight=shared.gate_weight.to(dtype))
    w13p, w2p, shared_p = pack_experts(w13, w2, shared)
    assert shared_slot(w13p, w2p, shared_p) == kind.startswith("folded")
    router = (torch.randn(E, H, generator=_gen(23)) * 0.3).to(dtype).to(DEV)
    x = torch.randn(shape, generator=_gen(24)).to(dtype).to(DEV)

    got = moe_block(x, router, w13p, w2p, shared_p, top_k=top_k, renormalize=False)
    decode = M <= DECODE_MAX_M
    if kind == "folded" and decode:
        assert launches == {"shared": 0, "packed_slots": [top_k + 1]}, launches
    elif decode:
        assert launches == {"shared": int(shared is not None),
                            "packed_slots": ([1] if shared is not None else []) + [top_k]}, launches
    else:
        assert launches == {"shared": int(shared is not None), "packed_slots": []}, launches

    assert got.dtype == dtype and tuple(got.shape) == shape and bool(torch.isfinite(got).all())
    assert_block_close(got, x, router, w13, w2, shared, top_k, bf16_rel_l2=4e-3 if M > 1 else 6e-3)
    if kind.startswith("folded"):      # the same block, the shared expert packed on its own: no shared slot
        apart = SharedExpert(pack(shared.w13), pack(shared.w2), shared.gate_weight)
        w13a, w2a, _ = pack_experts(w13, w2)
        assert not shared_slot(w13a, w2a, apart)
        unfolded = moe_block(x, router, w13a, w2a, apart, top_k=top_k, renormalize=False)
        m = compare(got, unfolded)
        assert (m.rel_l2 < 1e-5) if dtype == FP32 else (m.cosine > 0.9999 and m.rel_l2 < 4e-3), f"vs unfolded: {m}"


@pytest.mark.parametrize("shared_scales, top_k", [pytest.param("folded-per-row", 3, id="shared-per-row-k3"),
                                                   pytest.param("folded-g1", 6, id="shared-g1-k6")])
def test_moe_block_folded_with_per_row_scales(shared_scales, top_k, launches, poison_empty):
    """Routed w13 with per-shard (per-row) global scales and a shared expert of the same shape (per-row or scalar
    w13 scale) folded: the E + 1 stack holds one scale per row; decode M = 2, fp32, renormalised routing; top_k + 1
    = 4 slots (one group in the down kernel) or 7 (4 + 3, the shared slot in the second group, one lane masked)."""
    E, H, inter = 7, 80, 48
    w13, w2 = _routed(E, H, inter, "per-row", seed=31)
    shared = _make_shared(shared_scales, H, inter, seed=32)
    w13p, w2p, shared_p = pack_experts(w13, w2, shared)
    assert shared_slot(w13p, w2p, shared_p)
    assert tuple(w13p.global_scale.shape) == (E, 2 * inter)
    router = (torch.randn(E, H, generator=_gen(33)) * 0.3).to(DEV)
    x = torch.randn(1, 2, H, generator=_gen(34)).to(DEV)
    got = moe_block(x, router, w13p, w2p, shared_p, top_k=top_k)
    assert launches == {"shared": 0, "packed_slots": [top_k + 1]}, launches
    m = compare(got, reference.moe_block(x, router, w13, w2, shared, top_k=top_k))
    assert bool(torch.isfinite(got).all()) and m.rel_l2 < 1e-5, m


# ---------------------------------------------------------------------------------------------------------------
# 4. the packed decode kernels with forced tiles; determinism


#: ``config`` tiles of both packed decode kernels (M <= 16). BLOCK_N 4: many row tiles; BLOCK_N 32 over I = 48 and
#: H = 80: a half-masked last row tile; top_k 3 / 7: the down kernel's two slot groups (2 + 1; 4 + 3, one lane of
#: the second masked). H = 208 / I = 144
#: and H = 256 / I = 128 (beyond this module's usual H <= 128, needed for a second step of TW = 16 words): two K steps,
#: the last a partial chunk (208 = 128 + 80, 144 = 128 + 16), or whole chunks (the EVEN path, whose last step reloads).
SMALL_TILE_CASES = [
    pytest.param(2, 3, 5, 80, 48, {"BLOCK_N": 4, "TW": 16, "num_warps": 4}, id="BN4-TW16-H80-I48-k3"),
    pytest.param(3, 3, 5, 80, 48, {"BLOCK_N": 32, "TW": 16, "num_warps": 4}, id="BN32-TW16-H80-I48-k3-masked-rows"),
    pytest.param(1, 7, 7, 80, 48, {"BLOCK_N": 32, "TW": 16, "num_warps": 4}, id="BN32-TW16-H80-I48-k7-slot-groups"),
    pytest.param(2, 3, 4, 208, 144, {"BLOCK_N": 32, "TW": 16, "num_warps": 4}, id="BN32-TW16-H208-I144-2-steps"),
    pytest.param(2, 2, 4, 256, 128, {"BLOCK_N": 16, "TW": 16, "num_warps": 4}, id="BN16-TW16-H256-I128-even-2-steps"),
    pytest.param(3, 2, 4, 80, 48, {"BLOCK_N": 4, "TW": 16, "num_warps": 2}, id="BN4-TW16-w2-M3"),  # the GPU's
    # down tile at M > 2 (PACKED_DOWN_CONFIGS[1]), here on both kernels, at a batch past 2
]


@pytest.mark.parametrize("M, top_k, E, H, inter, config", SMALL_TILE_CASES)
def test_launch_packed_decode_small_tiles(M, top_k, E, H, inter, config, poison_empty):
    """``launch_moe_experts`` with forced packed decode tiles writes every row of a NaN output and of a poisoned
    workspace correctly, for two routings through the same buffers."""
    w13, w2 = _routed(E, H, inter, "gE", seed=41)
    w13p, w2p, _ = pack_experts(w13, w2)
    x = _x(M, H, BF16, seed=42)
    ws = moe_workspace(M, top_k, E, H, inter, BF16, DEV)
    out = torch.full((M, H), float("nan"), dtype=BF16, device=DEV)
    for seed, experts in ((43, None), (44, [1, 3])):
        weights, ids = _routing(M, top_k, E, seed=seed, experts=experts)
        assert launch_moe_experts(x, weights, ids, w13p, w2p, out, ws, config=config) is out
        assert_experts_close(out, x, weights, ids, w13, w2, what=f"seed {seed}")


def test_packed_decode_is_deterministic():
    """Two runs give the same bits: the packed decode experts (bf16, M = 3) and the folded 3-launch block (fp32)."""
    E, top_k, H, inter, M = 6, 3, 80, 48, 3
    w13, w2 = _routed(E, H, inter, "gE", seed=51)
    shared = _make_shared("folded-g1", H, inter, seed=52)
    w13p, w2p, shared_p = pack_experts(w13, w2, shared)
    weights, ids = _routing(M, top_k, E, seed=53)
    x = _x(M, H, BF16, seed=54)
    a, b = moe_experts(x, weights, ids, w13p, w2p), moe_experts(x, weights, ids, w13p, w2p)
    assert bool(torch.isfinite(a).all()) and bit_mismatches(a, b) == 0
    router = (torch.randn(E, H, generator=_gen(55)) * 0.3).to(DEV)
    xf = _x(M, H, FP32, seed=56)
    a = moe_block(xf, router, w13p, w2p, shared_p, top_k=top_k)
    b = moe_block(xf, router, w13p, w2p, shared_p, top_k=top_k)
    assert bool(torch.isfinite(a).all()) and bit_mismatches(a, b) == 0


# ---------------------------------------------------------------------------------------------------------------
# 5. errors


_E, _H, _I = 4, 32, 16
_W13, _W2 = _experts(_E, _H, _I, seed=61)
_P13, _P2, _ = pack_experts(_W13, _W2)
_WEIGHTS, _IDS = _routing(3, 2, _E, seed=62)
_X = _x(3, _H, FP32, seed=63)


@pytest.mark.parametrize("backend", ["kernel", "reference"])
def test_mixed_layout_errors(backend):
    """Both weights of an FFN in one layout: packed with checkpoint is a TypeError naming both, on every backend."""
    router = torch.randn(_E, _H).to(DEV)
    s = _nvfp4_shared(_H, 16, seed=64)
    with use_reference(backend == "reference"):
        with pytest.raises(TypeError, match=r"w13 is packed \(PackedExperts\) but w2 is in the checkpoint layout "
                                            r"\(NVFP4Tensor\).*pack_experts"):
            moe_experts(_X, _WEIGHTS, _IDS, _P13, _W2)
        with pytest.raises(TypeError, match=r"w13 is in the checkpoint layout \(NVFP4Tensor\) but w2 is packed "
                                            r"\(PackedExperts\)"):
            moe_experts(_X, _WEIGHTS, _IDS, _W13, _P2)
        with pytest.raises(TypeError, match=r"w13 is packed \(PackedExperts\) but w2 is in the checkpoint layout"):
            moe_block(_X, router, _P13, _W2, top_k=2)
        with pytest.raises(TypeError, match=r"shared.w13 is packed \(PackedNVFP4\) but shared.w2 is in the "
                                            r"checkpoint layout \(NVFP4Tensor\)"):
            moe_block(_X, router, _P13, _P2, SharedExpert(pack(s.w13), s.w2, s.gate_weight), top_k=2)


@pytest.mark.parametrize("M, config, match", [
    pytest.param(2, {"BLOCK_N": 4, "TW": 24, "num_warps": 4}, r"config TW = 24.*16, 32, 64", id="decode-TW24"),
    pytest.param(2, {"BLOCK_N": 4, "TW": 8, "num_warps": 4}, r"config TW = 8", id="decode-TW8"),
    pytest.param(2, {"BLOCK_N": 4, "TW": 48, "num_warps": 4}, r"config TW = 48", id="decode-TW48-not-pow2"),
    pytest.param(20, {"BLOCK_N": 16, "BLOCK_K": 64, "num_warps": 4}, r"config BLOCK_K = 64.*multiple of 128",
                 id="prefill-BLOCK_K64"),
    pytest.param(2, {"BLOCK_N": 4, "BLOCK_K": 128, "num_stages": 3}, r"config keys \['BLOCK_K', 'num_stages'\] are "
                 r"not settings of the packed decode kernels", id="decode-checkpoint-keys"),
    pytest.param(20, {"BLOCK_N": 16, "TW": 64}, r"config keys \['TW'\] are not settings of these expert kernels",
                 id="prefill-TW"),
])
def test_bad_packed_tiles(M, config, match, poison_empty):
    weights, ids = _routing(M, 2, _E, seed=65)
    x = _x(M, _H, FP32, seed=66)
    out = torch.empty((M, _H), dtype=FP32, device=DEV)
    with pytest.raises(ValueError, match=match):
        launch_moe_experts(x, weights, ids, _P13, _P2, out, moe_workspace(M, 2, _E, _H, _I, FP32, DEV), config=config)


def test_pack_experts_in_slices_equals_one_pack(monkeypatch):
    """``pack_experts`` packs a stack a slice of experts at a time into one buffer (``PACK_ROWS`` rows, to bound
    the temporaries at load time): with slices of 3 experts (the last one short) and the shared expert behind them,
    the words and scales equal one ``pack`` of the whole stack."""
    from lynn_kernels.moe import packed as packed_module

    E, H, inter = 7, 80, 48
    w13, w2 = _experts(E, H, inter, seed=201)
    shared = _nvfp4_shared(H, inter, seed=202)
    monkeypatch.setattr(packed_module, "PACK_ROWS", 3 * 2 * inter)
    p13, p2, pshared = pack_experts(w13, w2, shared)
    assert shared_slot(p13, p2, pshared)
    for stack, w, s, ps in ((p13, w13, shared.w13, pshared.w13), (p2, w2, shared.w2, pshared.w2)):
        whole = pack(NVFP4Tensor(torch.cat([w.codes, s.codes[None]]).flatten(0, 1),
                                 torch.cat([w.scales, s.scales[None]]).flatten(0, 1), torch.ones((), device=DEV)))
        assert torch.equal(torch.cat([stack.words, ps.words[None]]).flatten(0, 1), whole.words)
        assert torch.equal(torch.cat([stack.scales, ps.scales[None]]).flatten(0, 1), whole.scales)


def test_packed_weights_are_refused_where_the_checkpoint_layout_is_needed():
    gates, ups = _shards(2, 64, 32, seed=211)
    with pytest.raises(TypeError, match="fuse before packing"):
        fuse_w13(pack(gates[0]), pack(ups[0]))
    with pytest.raises(TypeError, match="stack before packing"):
        stack_w13([pack(g) for g in gates], [pack(u) for u in ups])


def test_pack_experts_errors():
    with pytest.raises(TypeError, match=r"w13 must be a 3-D NVFP4Tensor, found Tensor \(4, 32, 32\)"):
        pack_experts(_fp32(_W13), _W2)
    with pytest.raises(TypeError, match=r"w2 must be a 3-D NVFP4Tensor, found Tensor \(4, 32, 16\)"):
        pack_experts(_W13, _fp32(_W2))
    with pytest.raises(TypeError, match=r"w13 must be a 3-D NVFP4Tensor, found NVFP4Tensor \(32, 32\)"):
        pack_experts(_W13[0], _W2)
    with pytest.raises(TypeError, match=r"w13 must be a 3-D NVFP4Tensor, found PackedExperts"):
        pack_experts(_P13, _P2)                                         # packing twice


def test_launch_router_shared_slot_errors(poison_empty):
    M, top_k = 3, 2
    router = torch.randn(_E, _H).to(DEV)
    gate_weight = torch.randn(_H).to(DEV)
    w, i = torch.empty((M, top_k + 1), device=DEV), torch.empty((M, top_k + 1), dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match=r"shared_slot needs gate_weight"):
        launch_router(_X, router, top_k, True, w, i, shared_slot=True)
    with pytest.raises(ValueError, match=r"shared_slot needs gate_weight, no gate"):
        launch_router(_X, router, top_k, True, w, i, gate_weight=gate_weight, gate=torch.empty(M, device=DEV),
                      shared_slot=True)
    with pytest.raises(ValueError, match=r"top_k \+ 1 = 3 columns, got ids \(3, 2\)"):
        launch_router(_X, router, top_k, True, w[:, :2].contiguous(), i[:, :2].contiguous(), gate_weight=gate_weight,
                      shared_slot=True)
    w2_, i2_ = w[:, :2].contiguous(), i[:, :2].contiguous()
    with pytest.raises(ValueError, match=r"gate_weight needs somewhere to write the gate"):
        launch_router(_X, router, top_k, True, w2_, i2_, gate_weight=gate_weight)     # would overwrite weights


# ---------------------------------------------------------------------------------------------------------------
# 6. the router's shared slot


@pytest.mark.parametrize("M, dtype, renormalize, E, top_k", [
    pytest.param(1, BF16, True, 7, 3, id="M1-bf16-renorm"),
    pytest.param(5, FP32, False, 7, 3, id="M5-fp32-raw"),
    pytest.param(16, BF16, False, 7, 3, id="M16-bf16-raw"),
    pytest.param(16, FP32, True, 7, 3, id="M16-fp32-renorm"),
    pytest.param(16, BF16, True, 300, 8, id="M16-E300-top8-two-row-chunks"),
])
def test_launch_router_shared_slot(M, dtype, renormalize, E, top_k, poison_empty):
    """With ``shared_slot`` the router writes rows of ``top_k + 1``: the routing as without it (bit for bit), then
    the shared expert's id E and its gate ``sigmoid(x @ gate_weight)`` (fp32, not rounded; the gate the ``gate=``
    output gets, bit for bit). E = 300 (512 logits a row) routes 16 tokens in two chunks of rows."""
    H = 80
    x = _x(M, H, dtype, seed=71)
    router = (torch.randn(E, H, generator=_gen(72)) * 0.3).to(dtype).to(DEV)
    gate_weight = (torch.randn(H, generator=_gen(73)) * 0.1).to(dtype).to(DEV)

    w1, i1 = torch.empty((M, top_k + 1), device=DEV), torch.empty((M, top_k + 1), dtype=torch.int32, device=DEV)
    launch_router(x, router, top_k, renormalize, w1, i1, gate_weight=gate_weight, shared_slot=True)
    w0, i0 = torch.empty((M, top_k), device=DEV), torch.empty((M, top_k), dtype=torch.int32, device=DEV)
    launch_router(x, router, top_k, renormalize, w0, i0)
    wg, ig, g = torch.empty((M, top_k), device=DEV), torch.empty((M, top_k), dtype=torch.int32, device=DEV), \
        torch.empty(M, device=DEV)
    launch_router(x, router, top_k, renormalize, wg, ig, gate_weight=gate_weight, gate=g)

    assert torch.equal(i1[:, top_k], torch.full((M,), E, dtype=torch.int32, device=DEV))
    want_gate = torch.sigmoid(x.float() @ gate_weight.float())
    torch.testing.assert_close(w1[:, top_k], want_gate, rtol=1e-6, atol=0)
    assert bit_mismatches(w1[:, top_k], g) == 0
    assert torch.equal(i1[:, :top_k], i0) and bit_mismatches(w1[:, :top_k], w0) == 0
    assert torch.equal(ig, i0) and bit_mismatches(wg, w0) == 0
    _, ids_ref = reference.route((x.float() @ router.float().t()).to(dtype), top_k, renormalize)
    assert torch.equal(i0, ids_ref)


@pytest.mark.parametrize("shape", [pytest.param((1, 3, 80), id="decode-M3"),
                                   pytest.param((2, 9, 80), id="prefill-M18")])
def test_moe_block_packed_fp16(shape, poison_empty):
    """fp16 x (the packed prefill tile is ``e2m1 * s`` itself there, fp16's range being narrower): the folded block
    against the reference on the checkpoint weights."""
    E, top_k, H, inter = 5, 2, shape[-1], 48
    w13, w2 = _experts(E, H, inter, seed=221)
    shared = _nvfp4_shared(H, inter, seed=222)
    shared = shared._replace(gate_weight=shared.gate_weight.to(torch.float16))
    w13p, w2p, shared_p = pack_experts(w13, w2, shared)
    assert shared_slot(w13p, w2p, shared_p)
    router = (torch.randn(E, H, generator=_gen(223)) * 0.3).to(torch.float16).to(DEV)
    x = torch.randn(shape, generator=_gen(224)).to(torch.float16).to(DEV)
    got = moe_block(x, router, w13p, w2p, shared_p, top_k=top_k, renormalize=False)
    assert got.dtype == torch.float16 and tuple(got.shape) == shape
    assert_block_close(got, x, router, w13, w2, shared, top_k)
