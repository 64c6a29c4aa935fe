"""The GPU's tile configs, run under the interpreter on small shapes: a tile bug (a mask, a tail, a loop bound) shows
up in CI, not only on the H200.

Under the interpreter the launch functions pick their own tiles (the largest the shape can use: its cost is per
program and loop step) and one autotune config. Here each launch is forced onto every distinct tile of the GPU's
configs through its ``config=`` override (``num_warps`` / ``num_stages`` mean nothing to the interpreter, so configs
that differ only there run once). What stays untested on the CPU: the GPU's bf16 ``tl.dot`` operands
(``runtime.DOT_DTYPE`` is fp32 here, the interpreter's bf16 dot is wrong) and the compiled code itself; the ``gpu``
tests in each family's file cover those on the H200. The matmul kernels' configs are tested in ``test_matmul.py``.

Every fresh output is poisoned (``poison_empty``); results are compared with :func:`lynn_kernels.metrics.compare`
against the torch references: bits where the op is exact, else the error ratio over one rounding of the fp32 answer
(the interpreter computes in fp32 and rounds once: 1.0 measured, 1.05 allowed; the MoE experts round their
intermediate to bf16 as well: 1.33-1.35 measured, 2 allowed, as ``lynn check``).
"""

from __future__ import annotations

import math

import pytest
import torch

from lynn_kernels import runtime
from lynn_kernels.attention import paged_slots
from lynn_kernels.attention import reference as attn_reference
from lynn_kernels.attention import triton_decode as decode_mod
from lynn_kernels.attention import triton_prefill as prefill_mod
from lynn_kernels.attention.spec import check_prefill
from lynn_kernels.deltanet import reference as dn_reference
from lynn_kernels.deltanet import spec as dn_spec
from lynn_kernels.deltanet import triton_chunk, triton_recurrent
from lynn_kernels.metrics import bit_mismatches, compare
from lynn_kernels.moe import reference as moe_reference
from lynn_kernels.moe import triton_align, triton_experts, triton_experts_decode, triton_route
from lynn_kernels.nvfp4 import quantize

pytestmark = pytest.mark.skipif(not runtime.INTERPRET, reason="the GPU runs these configs itself (gpu tests)")

BF16, FP32 = torch.bfloat16, torch.float32
DEV = runtime.DEVICE
ONE_ROUNDING = 1.05          # interpreter: fp32 math, one rounding (err_ratio 1.0 measured)


def randn(*shape, seed=0, dtype=FP32, scale=1.0):
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype).to(DEV)


def distinct(configs, keys):
    """One config per distinct tile (``keys`` of its kwargs), in order, as ``config=`` dicts."""
    seen, out = set(), []
    for c in configs:
        tile = tuple(c.kwargs[k] for k in keys)
        if tile not in seen:
            seen.add(tile)
            out.append({**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages})
    return out


def assert_one_rounding(got, exact, what, bound=ONE_ROUNDING):
    """A 16-bit ``got`` against the unrounded fp32 ``exact``, next to ``exact`` rounded once to got's dtype."""
    assert not torch.isnan(got).any(), f"{what}: NaN in the output (an element left unwritten?)"
    m = compare(got, exact, baseline=exact.to(got.dtype))
    assert m.err_ratio <= bound, f"{what}: {m}"


# ---------------------------------------------------------------------------------------------------------------
# attention


@pytest.mark.parametrize("d", [64, 256])
def test_prefill_gpu_tiles(d, poison_empty):
    """Every prefill tile the H200 may pick at this head dim: varlen, an empty-prefix and two prefixed sequences,
    GQA 4 (the group inside one BLOCK_M tile), the gate."""
    lens, prefix, hq, hkv = [70, 1, 37], [0, 5, 90], 4, 1
    t, nk = sum(lens), sum(lens) + sum(prefix)
    q, k, v = randn(t, hq, d, seed=1, dtype=BF16), randn(nk, hkv, d, seed=2, dtype=BF16), \
        randn(nk, hkv, d, seed=3, dtype=BF16)
    g = randn(t, hq, d, seed=4, dtype=BF16, scale=2.0)
    cu = torch.tensor([0, 70, 71, 108], dtype=torch.int32, device=DEV)
    pre = torch.tensor(prefix, dtype=torch.int32, device=DEV)
    lay = check_prefill(q, k, v, g, cu, pre)
    exact = attn_reference.flash_attention(q.float(), k.float(), v.float(), gate=g.float(), cu_seqlens=cu,
                                           prefix_lens=pre)
    configs = distinct(prefill_mod._prune(prefill_mod.PREFILL_CONFIGS, {"HEAD_DIM": d}), ("BLOCK_M", "BLOCK_N"))
    assert len(configs) >= 2
    for config in configs:
        out = torch.full_like(q, math.nan)
        prefill_mod.launch_prefill(q, k, v, g, out, lay.cu_q_t, lay.cu_k_t, lay.max_q, True, d ** -0.5, config)
        assert_one_rounding(out, exact, f"prefill d{d} {config}")


def test_decode_gpu_tiles(poison_empty):
    """Every decode tile of the H200 (BLOCK_N 16 to 128) over a 16-token paged cache (a key block gathers up to 8
    pages), lengths 0 / 1 / 100 / 200, 1 and 3 splits."""
    lens, b, hq, hkv, d, s_max, page = [0, 1, 100, 200], 4, 4, 1, 64, 208, 16
    q, g = randn(b, hq, d, seed=1, dtype=BF16), randn(b, hq, d, seed=2, dtype=BF16, scale=2.0)
    kc, vc = randn(b, s_max, hkv, d, seed=3, dtype=BF16), randn(b, s_max, hkv, d, seed=4, dtype=BF16)
    n_pages = s_max // page
    table = torch.randperm(b * n_pages + 3, generator=torch.Generator().manual_seed(5))[: b * n_pages]
    table = table.view(b, n_pages).to(torch.int32).to(DEV)
    kp, vp = randn(b * n_pages + 3, page, hkv, d, seed=6, dtype=BF16), randn(b * n_pages + 3, page, hkv, d, seed=7,
                                                                             dtype=BF16)
    slots = paged_slots(table, torch.arange(b, device=DEV).repeat_interleave(s_max),
                        torch.arange(s_max, device=DEV).repeat(b), page)
    kp.view(-1, hkv, d)[slots], vp.view(-1, hkv, d)[slots] = kc.reshape(-1, hkv, d), vc.reshape(-1, hkv, d)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    exact = attn_reference.decode_attention(q.float(), kc.float(), vc.float(), seq_lens, gate=g.float())
    configs = distinct(decode_mod._prune(decode_mod.DECODE_CONFIGS, {"HEAD_DIM": d}), ("BLOCK_N",))
    assert {c["BLOCK_N"] for c in configs} == {16, 32, 64, 128}
    for config in configs:
        for splits in (1, 3):
            out = torch.full_like(q, math.nan)
            decode_mod.launch_decode(q, kp, vp, seq_lens, table, g, out, splits, d ** -0.5, config=config)
            assert (out[0] == 0).all(), "no cached keys: zeros"
            assert_one_rounding(out, exact, f"decode {config} {splits} splits")


# ---------------------------------------------------------------------------------------------------------------
# MoE


def _experts(E, H, I, seed):
    return (quantize(randn(E, 2 * I, H, seed=seed, scale=0.2)),
            quantize(randn(E, H, I, seed=seed + 1, scale=0.5 / I ** 0.5)))


def _routing(M, E, top_k, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E - 1, generator=gen)[:top_k] for _ in range(M)]).to(torch.int32)
    weights = torch.softmax(torch.randn(M, top_k, generator=gen), -1)            # expert E-1 gets no token
    return weights.to(DEV), ids.to(DEV)


def _run_experts(x, weights, ids, w13, w2, config, shared_out=None):
    M, H = x.shape
    ws = triton_experts.moe_workspace(M, ids.shape[1], w13.shape[0], H, w2.shape[-1], x.dtype, DEV)
    out = torch.full_like(x, math.nan)
    return triton_experts.launch_moe_experts(x, weights, ids, w13, w2, out, ws, shared_out, config=config)


@pytest.mark.parametrize("M", [pytest.param(1, id="M1"), pytest.param(3, id="M3-batch")])
def test_moe_decode_gpu_tiles(M, poison_empty):
    """Each decode tile of the H200 for this M (gate_up's and down's; ``config=`` sets both kernels', so each tile
    runs in both), H and I not multiples of BLOCK_K (a partial last step, or one masked step)."""
    E, top_k, H, I = 7, 2, 80, 144
    w13, w2 = _experts(E, H, I, seed=1)
    x = randn(M, H, seed=3, dtype=BF16)
    weights, ids = _routing(M, E, top_k, seed=4)
    exact = moe_reference.moe_experts(x.float(), weights, ids, w13, w2)
    batch = M > 2
    for config in (triton_experts_decode.DECODE_UP_CONFIGS[batch], triton_experts_decode.DECODE_DOWN_CONFIGS[batch]):
        assert_one_rounding(_run_experts(x, weights, ids, w13, w2, config), exact, f"decode M{M} {config}", 2.0)


def test_moe_prefill_gpu_tiles_and_combine(poison_empty, monkeypatch):
    """Each GPU prefill tile (PREFILL_CONFIGS, the large-M one at 64- and 128-row tiles; the down kernel's
    DOWN_CONFIG_128 where its tile differs) over H, I not multiples of its BLOCK_K, then the combine step with the
    GPU's tile (COMBINE_CONFIG) directly, bit for bit against the same sum in torch."""
    E, top_k, H, I, M = 6, 2, 208, 96, 40
    w13, w2 = _experts(E, H, I, seed=5)
    x = randn(M, H, seed=7, dtype=BF16)
    weights, ids = _routing(M, E, top_k, seed=8)
    exact = moe_reference.moe_experts(x.float(), weights, ids, w13, w2)
    shared = randn(M, H, seed=9)
    runs = [(triton_experts.prefill_config(tokens, block_m or 64), block_m)
            for tokens, block_m in ((M, None), (1 << 20, 64), (1 << 20, 128))]   # each tile, whatever M picks it
    tile = ("BLOCK_N", "BLOCK_K")
    if all({k: c[k] for k in tile} != {k: triton_experts.DOWN_CONFIG_128[k] for k in tile} for c, _ in runs):
        runs.append((triton_experts.DOWN_CONFIG_128, 128))
    for config, block_m in runs:
        if block_m:
            monkeypatch.setattr(triton_experts, "block_m_for", lambda *_, b=block_m: b)
        got = _run_experts(x, weights, ids, w13, w2, config, shared_out=shared)
        assert_one_rounding(got, exact + shared, f"prefill + shared {config}, BLOCK_M {block_m}", 2.0)

    cfg = triton_experts.COMBINE_CONFIG
    H2 = 2 * cfg["BLOCK_H"] + 52                          # 3 BLOCK_H tiles, the last partial; M / BLOCK_T tiles
    slots, shared = randn(M * top_k, H2, seed=10), randn(M, H2, seed=11)
    out = torch.full((M, H2), math.nan, dtype=BF16, device=DEV)
    triton_experts._launch_combine(slots, shared, out, top_k, config=triton_experts.COMBINE_CONFIG)
    want = slots.view(M, top_k, H2)[:, 0].clone()
    for j in range(1, top_k):                               # in choice order, then the shared expert: the kernel's
        want += slots.view(M, top_k, H2)[:, j]
    m = compare(out, (want + shared).to(BF16), exact=True)
    assert m.mismatches == 0, m


def test_route_and_router_gpu_tiles(poison_empty):
    """The routing kernel with the GPU's token block (32 rows of 64 expert slots: two programs, the second masked)
    and the fused router with :data:`ROUTER_CONFIG` (16 experts x 512 of H: 4 expert blocks, H split, the last slice
    partial), against ``reference.route`` of the reference logits."""
    M, E, top_k = 37, 60, 4
    logits = randn(M, E, seed=1, dtype=BF16)
    block_m = triton_route._block_m(M, max(16, runtime.next_power_of_2(E)), interpret=False)
    assert block_m == 32
    w, ids = torch.empty(M, top_k, device=DEV), torch.empty(M, top_k, dtype=torch.int32, device=DEV)
    triton_route.launch_route(logits, top_k, True, w, ids, block_m=block_m)
    w_ref, ids_ref = moe_reference.route(logits, top_k)
    assert torch.equal(ids, ids_ref)
    assert compare(w, w_ref).max_abs <= 1e-6                       # lynn check: 7.5e-8

    M, H = 5, 1100
    x, r = randn(M, H, seed=2, dtype=BF16, scale=0.5), randn(E, H, seed=3, dtype=BF16, scale=0.5)
    w, ids = torch.empty(M, top_k, device=DEV), torch.empty(M, top_k, dtype=torch.int32, device=DEV)
    triton_route.launch_router(x, r, top_k, True, w, ids, config=triton_route.ROUTER_CONFIG)
    w_ref, ids_ref = moe_reference.route((x.float() @ r.float().t()).to(BF16), top_k)
    assert torch.equal(ids, ids_ref)
    assert compare(w, w_ref).max_abs <= 1e-6
    g, gate = randn(H, seed=4, dtype=BF16, scale=0.1), torch.empty(M, device=DEV)    # the shared gate, row E
    triton_route.launch_router(x, r, top_k, True, w, ids, config=triton_route.ROUTER_CONFIG, gate_weight=g,
                               gate=gate)
    assert torch.equal(ids, ids_ref) and compare(w, w_ref).max_abs <= 1e-6
    assert (gate - torch.sigmoid(x.float() @ g.float())).abs().max() <= 1e-6


@pytest.mark.parametrize("M, top_k, E", [pytest.param(160, 8, 60, id="S1280-two-chunks-E60"),
                                         pytest.param(40, 4, 256, id="S160-one-chunk-E256")])
def test_align_gpu_tiles(M, top_k, E, poison_empty):
    """align with the GPU's chunk (1024 slots) and fills (1024 sentinels, 64 block experts, 8192 / E histogram
    cells per offsets step), bit for bit against the reference."""
    gen = torch.Generator().manual_seed(M + E)
    ids = torch.randint(0, E - 1, (M, top_k), generator=gen, dtype=torch.int32).to(DEV)   # expert E-1: no slot
    want = moe_reference.align(ids, E, 16)
    got = [torch.empty_like(t) for t in want]
    triton_align.launch_align(ids, E, 16, *got, chunk=1024, config=triton_align.GPU_TILES)
    assert all(bit_mismatches(a, b) == 0 for a, b in zip(got, want))


# ---------------------------------------------------------------------------------------------------------------
# Gated DeltaNet


def test_deltanet_gpu_tiles(monkeypatch, poison_empty):
    """The chunked rule with the GPU's value blocks (32 for the state scan, 64 for the output: V = 80 gives 3 and 2
    programs per head, tails masked) and the recurrent kernels with the GPU's (8 values, 1 warp: 10 programs per
    head), bf16 in, one prefill of 70 tokens (two chunks) and a decode step with the gates in the kernel."""
    B, T, H, HV, K, V = 1, 70, 1, 2, 32, 80
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(B, T + 1, H, K, generator=gen).to(BF16).to(DEV) for _ in range(2))
    v = torch.randn(B, T + 1, HV, V, generator=gen).to(BF16).to(DEV)
    a, b = (torch.randn(B, T + 1, HV, generator=gen).to(DEV) for _ in range(2))
    A_log, dt_bias = torch.rand(HV, generator=gen).to(DEV), torch.randn(HV, generator=gen).to(DEV)
    h0 = (torch.randn(B, HV, K, V, generator=gen) * 0.1).to(DEV)
    g, beta = dn_reference.gates(A_log, a, dt_bias, b)
    o_ref, s_ref = dn_reference.recurrent_gated_delta_rule(q.float(), k.float(), v.float(), g, beta, None, h0, True,
                                                           True)

    state_bv, out_bv = triton_chunk.block_v(V, interpret=False)
    assert (state_bv, out_bv) == (32, 64)
    o = torch.full((B, T, HV, V), math.nan, dtype=BF16, device=DEV)
    s = torch.full((B, HV, K, V), math.nan, device=DEV)
    dims = dn_spec.Dims(B, T, H, HV, K, V)
    triton_chunk.launch_chunk(q[:, :T], k[:, :T], v[:, :T], g[:, :T], beta[:, :T], dims, K ** -0.5, h0, True, o, s,
                              config={"state_block_v": state_bv, "out_block_v": out_bv})
    _, s_mid = dn_reference.recurrent_gated_delta_rule(q[:, :T].float(), k[:, :T].float(), v[:, :T].float(),
                                                       g[:, :T], beta[:, :T], None, h0, True, True)
    assert_one_rounding(o, o_ref[:, :T], "chunk o")
    assert compare(s, s_mid).rel_l2 <= 2e-6, "chunk state"                  # interpreter at most 6.4e-7

    gpu = triton_recurrent.recurrent_config(K, V, interpret=False)
    assert gpu == (8, 1)
    monkeypatch.setattr(triton_recurrent, "recurrent_config", lambda K, V: gpu)
    from lynn_kernels import deltanet

    o1, s1 = deltanet.recurrent_gated_delta_rule_gates(q[:, T:], k[:, T:], v[:, T:], A_log, a[:, T:], dt_bias,
                                                       b[:, T:], initial_state=s_mid, output_final_state=True,
                                                       use_qk_l2norm=True)
    assert_one_rounding(o1, o_ref[:, T:], "recurrent o")
    assert compare(s1, s_ref).rel_l2 <= 2e-6, "recurrent state"
    o2, s2 = deltanet.recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                 use_qk_l2norm=True)
    assert_one_rounding(o2, o_ref, "recurrent prefill o")
    assert compare(s2, s_ref).rel_l2 <= 2e-6, "recurrent prefill state"
