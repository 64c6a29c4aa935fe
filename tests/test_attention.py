"""Gated attention: the kernels against the fp32 references, the references against torch SDPA and HF transformers'
Qwen3-Next functions, one whole HF attention layer rebuilt from the public ops, layouts and errors.

Kernel tests run under Triton's interpreter on the CPU with small head counts and dims (the three real head dims
each appear once at small T) and every fresh output poisoned with NaN, so an element a kernel forgets to write fails.
The sweeps of each kernel against its reference are the family's check matrix (lynn_kernels/attention/check.py, what
``lynn check`` and the lab run).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_case_passes, check_cases, oracle

import lynn_kernels
from lynn_kernels import runtime
from lynn_kernels.attention import (
    contiguous_slots,
    decode_attention,
    flash_attention,
    paged_slots,
    qk_norm_rope,
    reference,
    split_q_gate,
)
from lynn_kernels.attention import triton_decode as decode_mod
from lynn_kernels.attention import triton_prefill as prefill_mod
from lynn_kernels.attention import triton_rope as rope_mod
from lynn_kernels.attention.spec import check_prefill
from lynn_kernels.metrics import bit_mismatches

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
I32 = torch.int32


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(shape, dtype=FP32, seed=0, scale=1.0, device=None) -> torch.Tensor:
    return (torch.randn(tuple(shape), generator=gen(seed)) * scale).to(dtype).to(device or runtime.DEVICE)


def ints(values, dtype=I32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=runtime.DEVICE)


#: A 16-bit output's error over that of the fp32 answer rounded once to its dtype (``exact=`` of assert_close):
#: the interpreter computes in fp32 and rounds once (measured 1.0); compiled, the 16-bit tensor-core products of
#: the probabilities add a little (H200: lynn check 1.17, Qwen shapes 1.26-1.35 in the benchmark, SDPA 1.35).
MAX_ERR_RATIO = 1.05 if runtime.INTERPRET else 3.0


def f32(*ts):
    """fp32 copies of the floating tensors (None and integer tensors as they are): the inputs of the exact answer."""
    return [None if t is None else (t.float() if t.is_floating_point() else t) for t in ts]


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str = "", exact: torch.Tensor | None = None) -> None:
    """Kernel (fp32 math, one rounding) against the reference (the same). Interpreter: fp32 within summation-order
    noise, 16-bit outputs within one ulp. A 16-bit output is also bounded by ``MAX_ERR_RATIO`` against ``exact``,
    the reference on fp32 copies of the inputs; compiled, that ratio is its only bound, and ``exact`` is required."""
    assert got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape), what
    assert not torch.isnan(got).any(), f"NaN in the output (an element left unwritten?) {what}"
    if got.dtype != FP32 and exact is not None:
        m = lynn_kernels.compare(got, exact, baseline=exact.to(got.dtype))
        assert m.err_ratio <= MAX_ERR_RATIO, f"{what}: {m}"
    if got.dtype == FP32:
        tol = dict(atol=2e-5, rtol=2e-5)
    elif runtime.INTERPRET:
        tol = dict(atol=1e-5, rtol=2**-7)
    else:
        assert exact is not None, f"a compiled 16-bit output is bounded by its error ratio: pass exact= {what}"
        return
    torch.testing.assert_close(got.float(), want.float(), **tol, msg=lambda m: f"{what}\n{m}")


# ---------------------------------------------------------------------------------------------------------------
# 0. the poison reaches the kernels' outputs


class _NoLaunch:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](...)`` does nothing, so no output gets written."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def test_poison_catches_an_unwritten_output(monkeypatch, poison_empty):
    monkeypatch.setattr(prefill_mod.PREFILL, "shipped", _NoLaunch())
    monkeypatch.setattr(decode_mod.DECODE, "shipped", _NoLaunch())
    monkeypatch.setattr(rope_mod.QK_NORM_ROPE, "shipped", _NoLaunch())
    q, k = randn((5, 2, 16)), randn((5, 1, 16))
    assert torch.isnan(flash_attention(q, k, k)).all()
    kc = randn((1, 8, 1, 16))
    assert torch.isnan(decode_attention(q[:1], kc, kc, ints([3]), num_splits=1)).all()
    q_out, k_out = qk_norm_rope(q, k, q[0, 0], q[0, 0], ints([0] * 5), rotary_dim=8, rope_theta=1e4)
    assert torch.isnan(q_out).all() and torch.isnan(k_out).all()


# ---------------------------------------------------------------------------------------------------------------
# 1. the references against torch SDPA and HF transformers


def _sdpa(q, k, v, mask=None):
    """torch SDPA on ``[n, Hq, D]`` / ``[L, Hkv, D]`` with GQA; ``mask [n, L]`` boolean (True = attend)."""
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         attn_mask=mask, enable_gqa=True)
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_reference_prefill_matches_sdpa(causal):
    cu, prefix = [0, 1, 64, 64, 129], [0, 7, 3, 64]
    q, k, v = randn((129, 8, 32), seed=1), randn((129 + 74, 2, 32), seed=2), randn((129 + 74, 2, 32), seed=3)
    got = reference.flash_attention(q, k, v, causal=causal, cu_seqlens=ints(cu), prefix_lens=ints(prefix))
    k0 = 0
    for b in range(4):
        n, p = cu[b + 1] - cu[b], prefix[b]
        qs, ks = slice(cu[b], cu[b + 1]), slice(k0, k0 + p + n)
        k0 += p + n
        mask = None
        if causal:
            mask = torch.arange(p + n, device=q.device)[None, :] <= p + torch.arange(n, device=q.device)[:, None]
        torch.testing.assert_close(got[qs], _sdpa(q[qs], k[ks], v[ks], mask), atol=1e-5, rtol=1e-5)


def test_reference_decode_matches_sdpa():
    q, kc, vc = randn((3, 8, 64), seed=1), randn((3, 50, 1, 64), seed=2), randn((3, 50, 1, 64), seed=3)
    lens = [1, 17, 50]
    got = reference.decode_attention(q, kc, vc, ints(lens))
    for b, n in enumerate(lens):
        torch.testing.assert_close(got[b], _sdpa(q[b:b + 1], kc[b, :n], vc[b, :n])[0], atol=1e-5, rtol=1e-5)
    assert (reference.decode_attention(q, kc, vc, ints([0, 1, 2]))[0] == 0).all()     # no keys: zeros


def test_reference_decode_reads_a_paged_cache():
    """The same tokens in a shuffled paged cache (a few blocks nobody uses): the same bits as the contiguous one."""
    q, kc, vc, g, seq_lens, (kp, vp, table) = _decode_inputs([0, 1, 63, 65, 200], 4, 1, 32, BF16, 208, page=16)
    want = reference.decode_attention(q, kc, vc, seq_lens, gate=g)
    assert bit_mismatches(reference.decode_attention(q, kp, vp, seq_lens, table, gate=g), want) == 0


ORACLE_FIXTURES = {"hf": "transformers"}


@pytest.fixture(scope="module")
def hf():
    return oracle("transformers.models.qwen3_next.modeling_qwen3_next")


def _hf_norm_rope(hf, q, k, qw, kw, cos, sin):
    """HF's own q_norm / k_norm and apply_rotary_pos_emb on ``[T, H, D]`` tensors (cos, sin ``[T, R]``)."""
    qn, kn = hf.Qwen3NextRMSNorm(q.shape[-1], eps=1e-6), hf.Qwen3NextRMSNorm(q.shape[-1], eps=1e-6)
    qn.weight.data, kn.weight.data = qw.clone(), kw.clone()
    with torch.no_grad():
        q_hf, k_hf = hf.apply_rotary_pos_emb(qn(q).transpose(0, 1), kn(k).transpose(0, 1), cos.to(q.dtype),
                                             sin.to(q.dtype), unsqueeze_dim=0)
    return q_hf.transpose(0, 1), k_hf.transpose(0, 1)


def test_reference_rope_tables_match_hf_rotary_embedding(hf):
    cfg = hf.Qwen3NextConfig(head_dim=256, rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                                            "partial_rotary_factor": 0.25})
    pos = torch.tensor([[0, 1, 2, 1000, 65535, 262143]])
    cos_hf, sin_hf = hf.Qwen3NextRotaryEmbedding(cfg)(torch.zeros(1, dtype=FP32), pos)
    cos, sin = reference.rope_cos_sin(pos[0], 64, 1e7)
    assert bit_mismatches(cos, cos_hf[0]) == 0 and bit_mismatches(sin, sin_hf[0]) == 0


@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
def test_reference_qk_norm_rope_matches_hf(hf, dtype):
    """fp32: bit for bit. bf16: HF rounds after the norm, the cos/sin tables and every RoPE product to bf16; the
    reference rounds once at the end, so they agree to a few bf16 ulps."""
    q, k = randn((9, 4, 64), dtype, seed=1, scale=2, device="cpu"), randn((9, 2, 64), dtype, seed=2, device="cpu")
    qw, kw = randn((64,), seed=3, scale=0.2, device="cpu"), randn((64,), seed=4, scale=0.2, device="cpu")
    pos = torch.tensor([0, 1, 5, 99, 1000, 4095, 30000, 131071, 262143])
    cos, sin = reference.rope_cos_sin(pos, 16, 1e7)
    q_hf, k_hf = _hf_norm_rope(hf, q, k, qw, kw, cos, sin)
    q_ref, k_ref = reference.qk_norm_rope(q, k, qw, kw, pos, rotary_dim=16, rope_theta=1e7)
    if dtype == FP32:
        assert bit_mismatches(q_ref, q_hf) == 0 and bit_mismatches(k_ref, k_hf) == 0
    else:
        for got, want in ((q_ref, q_hf), (k_ref, k_hf)):
            torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=3 * 2**-8)


def test_one_gated_attention_layer_matches_hf(hf):
    """HF's Qwen3NextAttention (tiny config, sdpa, causal) rebuilt from split_q_gate + qk_norm_rope +
    flash_attention(gate=...) + o_proj, fp32, on two packed sequences."""
    torch.manual_seed(0)
    cfg = hf.Qwen3NextConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                             rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25})
    cfg._attn_implementation = "sdpa"
    attn = hf.Qwen3NextAttention(cfg, layer_idx=3).eval()
    with torch.no_grad():
        attn.q_norm.weight.normal_(0, 0.1)
        attn.k_norm.weight.normal_(0, 0.1)
    rotary = hf.Qwen3NextRotaryEmbedding(cfg)
    lens = [5, 11]
    xs = [torch.randn(1, n, 64) for n in lens]
    want = []
    with torch.no_grad():
        for x in xs:
            pos_emb = rotary(x, torch.arange(x.shape[1])[None])
            want.append(attn(x, pos_emb, attention_mask=None)[0][0])
    want = torch.cat(want)

    dev = runtime.DEVICE
    x = torch.cat([x[0] for x in xs]).to(dev)
    pos = torch.cat([torch.arange(n) for n in lens]).to(dev)
    w = {name: p.detach().to(dev) for name, p in attn.named_parameters()}
    q, gate = split_q_gate(x @ w["q_proj.weight"].T, 4, 32)
    k, v = (x @ w["k_proj.weight"].T).view(-1, 2, 32), (x @ w["v_proj.weight"].T).view(-1, 2, 32)
    q, k = qk_norm_rope(q, k, w["q_norm.weight"], w["k_norm.weight"], pos, rotary_dim=8, rope_theta=1e4)
    o = flash_attention(q, k, v, gate=gate, cu_seqlens=ints([0, 5, 16]))
    got = o.reshape(16, -1) @ w["o_proj.weight"].T
    torch.testing.assert_close(got.cpu(), want, atol=2e-5, rtol=2e-5)


# ---------------------------------------------------------------------------------------------------------------
# 2. prefill kernel == reference


def _prefill_inputs(lens, hq, hkv, d, dtype, prefix=None, gate=True, seed=0):
    t = sum(lens)
    nk = t + (sum(prefix) if prefix else 0)
    q = randn((t, hq, d), dtype, seed)
    k, v = randn((nk, hkv, d), dtype, seed + 1), randn((nk, hkv, d), dtype, seed + 2)
    g = randn((t, hq, d), dtype, seed + 3, scale=2.0) if gate else None
    cu = ints([0] + list(torch.tensor(lens).cumsum(0).tolist()))
    return q, k, v, g, cu, (ints(prefix) if prefix else None)


@pytest.mark.parametrize("case", check_cases("attention", "attention.prefill"))
def test_flash_attention_matches_reference(case, poison_empty):
    assert_case_passes(case)


@pytest.mark.parametrize("config,hq", [
    pytest.param({"BLOCK_M": 16, "BLOCK_N": 16}, 32, id="M16N16-group32-two-head-chunks"),
    pytest.param({"BLOCK_M": 32, "BLOCK_N": 16}, 4, id="M32N16-group4"),
    pytest.param({"BLOCK_M": 16, "BLOCK_N": 32}, 1, id="M16N32-group1"),
])
def test_flash_attention_small_tiles(config, hq, poison_empty):
    """Small tiles: many unmasked blocks before the diagonal, several diagonal blocks per tile, and a GQA group
    larger than the tile (its heads split over programs)."""
    q, k, v, g, cu, pre = _prefill_inputs([20, 1, 37], hq, 1, 16, FP32, prefix=[3, 40, 0])
    lay = check_prefill(q, k, v, g, cu, pre)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    prefill_mod.launch_prefill(q, k, v, g, out, lay.cu_q_t, lay.cu_k_t, lay.max_q, True, 0.3, config=config)
    assert_close(out, reference.flash_attention(q, k, v, scale=0.3, gate=g, cu_seqlens=cu, prefix_lens=pre))


def test_prefill_autotuners_key_on_the_size_of_their_grid():
    """The flash prefill's autotuner keys on the longest query run, the Gated DeltaNet chunk's per-chunk kernels on
    their programs, each in powers of 4: a 16,384-token prefill is not run at the tiling a short first prompt was
    timed at (on an H100 the attention's cost 7.3 ms a layer against 4.4)."""
    from lynn_kernels.deltanet import triton_chunk

    assert "LEN_BUCKET" in prefill_mod.PREFILL.shipped.keys
    assert all("GRID_BUCKET" in k.shipped.keys for k in (triton_chunk.CHUNK_WY, triton_chunk.CHUNK_OUTPUT))
    buckets = [runtime.size_bucket(n) for n in (1, 2, 3, 8, 9, 512, 513, 2048, 2049, 8192, 8193, 131072)]
    assert buckets == [0, 0, 1, 1, 2, 4, 5, 5, 6, 6, 7, 7]


def test_flash_attention_reads_strided_q_and_gate_views(poison_empty):
    """q and gate straight from a gated q_proj output ([T, Hq * 2D], query then gate per head): no copies."""
    qg = randn((21, 4 * 2 * 32), BF16, seed=5)
    q, gate = split_q_gate(qg, 4, 32)
    assert q.stride(1) == 64 and gate.data_ptr() == q.data_ptr() + 32 * qg.element_size()
    k, v = randn((21, 2, 32), BF16, 6), randn((21, 2, 32), BF16, 7)
    assert_close(flash_attention(q, k, v, gate=gate), reference.flash_attention(q.contiguous(), k, v,
                                                                                gate=gate.contiguous()),
                 exact=reference.flash_attention(*f32(q, k, v), gate=gate.float()))


def test_flash_attention_empty_batch_and_scale(poison_empty):
    q, k, v = randn((0, 2, 16)), randn((0, 1, 16)), randn((0, 1, 16))
    assert flash_attention(q, k, v).shape == (0, 2, 16)
    q, k, v, *_ = _prefill_inputs([30], 2, 1, 16, FP32)
    assert_close(flash_attention(q, k, v, scale=0.05), reference.flash_attention(q, k, v, scale=0.05))


def test_flash_attention_uses_reference_backend_on_request():
    q, k, v, *_ = _prefill_inputs([7], 2, 1, 16, BF16)
    with lynn_kernels.use_reference():
        got = flash_attention(q, k, v)
    assert bit_mismatches(got, reference.flash_attention(q, k, v)) == 0


# ---------------------------------------------------------------------------------------------------------------
# 3. decode kernel == reference; paged == contiguous


def _decode_inputs(lens, hq, hkv, d, dtype, s_max, page=None, gate=True, seed=0):
    """q, a contiguous cache ``[B, S_max, Hkv, D]`` and (if ``page``) the same tokens in a shuffled paged cache."""
    b = len(lens)
    q = randn((b, hq, d), dtype, seed)
    kc, vc = randn((b, s_max, hkv, d), dtype, seed + 1), randn((b, s_max, hkv, d), dtype, seed + 2)
    g = randn((b, hq, d), dtype, seed + 3, scale=2.0) if gate else None
    paged = None
    if page is not None:
        n_pages = s_max // page
        n_blocks = b * n_pages + 3                                         # a few blocks nobody uses
        table = torch.randperm(n_blocks, generator=gen(seed + 4))[: b * n_pages].view(b, n_pages).to(I32)
        table = table.to(runtime.DEVICE)
        kp = randn((n_blocks, page, hkv, d), dtype, seed + 5)             # garbage where no sequence lives
        vp = randn((n_blocks, page, hkv, d), dtype, seed + 6)
        seq = torch.arange(b, device=runtime.DEVICE).repeat_interleave(s_max)
        slots = paged_slots(table, seq, torch.arange(s_max, device=runtime.DEVICE).repeat(b), page)
        kp.view(-1, hkv, d)[slots] = kc.reshape(-1, hkv, d)
        vp.view(-1, hkv, d)[slots] = vc.reshape(-1, hkv, d)
        paged = (kp, vp, table)
    return q, kc, vc, g, ints(lens), paged


@pytest.mark.parametrize("case", check_cases("attention", "attention.decode"))
def test_decode_attention_matches_reference_paged_and_contiguous(case, poison_empty):
    assert_case_passes(case)


@pytest.mark.parametrize("splits", [1, 2, 3, 7], ids=lambda s: f"{s}splits")
def test_decode_split_count_does_not_change_the_result(splits, poison_empty):
    """200 keys in 16-key blocks: 3 splits of 80 + 80 + 40, 7 splits of 32 (the last partial at 8), one empty."""
    q, kc, vc, g, seq_lens, _ = _decode_inputs([200, 31], 4, 1, 16, FP32, 208, gate=True)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    decode_mod.launch_decode(q, kc, vc, seq_lens, None, g, out, splits, 0.25, config={"BLOCK_N": 16})
    assert_close(out, reference.decode_attention(q, kc, vc, seq_lens, scale=0.25, gate=g))


def test_default_num_splits_is_a_power_of_two():
    """NUM_SPLITS is a compile-time constant and autotune key: the default must take only a few values over batch
    sizes (powers of two, 8 for Qwen's 2 KV heads on an H200), each within its bounds, filling the GPU 1-2x."""
    for sms in (132, 108, 78):
        for hkv in (1, 2, 8):
            for capacity in (16, 1000, 4096, 32768, 1 << 20):
                seen = set()
                for b in range(1, 257):
                    s = decode_mod.splits_for(b, hkv, capacity, sms)
                    bound = min(math.ceil(2 * sms / (b * hkv)), math.ceil(capacity / decode_mod.MIN_SPLIT_TOKENS),
                                decode_mod.MAX_SPLITS)
                    assert s & (s - 1) == 0 and s <= bound < 2 * s, (b, hkv, capacity, sms, s)   # 2^floor(log2)
                    seen.add(s)
                assert len(seen) <= 9
    assert {decode_mod.splits_for(b, 2, 32768, 132) for b in range(1, 257)} == {1, 2, 4, 8, 16, 32, 64, 128}
    assert decode_mod.splits_for(1, 2, 32768, 132) == 128                # was 132: rounded down
    assert decode_mod.splits_for(3, 2, 32768, 132) == 32                 # ceil(264 / 6) = 44 -> 32
    if runtime.INTERPRET:
        assert [decode_mod.default_num_splits(1, 2, c) for c in (100, 1025, 2049, 3073, 5000)] == [1, 2, 2, 4, 4]


def test_decode_page_smaller_than_key_block(poison_empty):
    """Page 16 with 64-key blocks: one block gathers four pages."""
    q, kc, vc, g, seq_lens, (kp, vp, table) = _decode_inputs([150, 64], 8, 2, 32, BF16, 192, page=16)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    decode_mod.launch_decode(q, kp, vp, seq_lens, table, g, out, 2, 0.2, config={"BLOCK_N": 64})
    assert_close(out, reference.decode_attention(q, kc, vc, seq_lens, scale=0.2, gate=g),
                 exact=reference.decode_attention(*f32(q, kc, vc), seq_lens, scale=0.2, gate=g.float()))


# ---------------------------------------------------------------------------------------------------------------
# 4. qk_norm_rope kernel == reference, with cache writes


@pytest.mark.parametrize("case", check_cases("attention", "attention.qk_norm_rope"))
def test_qk_norm_rope_matches_reference(case, poison_empty):
    assert_case_passes(case)


@pytest.mark.parametrize("layout", ["paged", "contiguous", "paged-interleaved"])
def test_qk_norm_rope_writes_the_cache(layout, poison_empty):
    """Writes k_out and v at their slots, skips slot -1 (any number of times), leaves every other slot alone; the K
    and V caches may interleave page by page in one buffer (their byte ranges overlap, their elements do not)."""
    t, hkv, d = 11, 2, 32
    qg = randn((t, 4 * 2 * d), BF16, 1)
    q, _ = split_q_gate(qg, 4, d)                                       # a strided view, as in the model
    k, v = randn((t, hkv, d), BF16, 2), randn((t, hkv, d), BF16, 3)
    qw, kw = randn((d,), BF16, 4, scale=0.1), randn((d,), BF16, 5, scale=0.1)
    seq = ints([0] * 6 + [1] * 5, torch.int64)
    pos = ints([0, 1, 2, 3, 4, 5, 17, 18, 19, 20, 21], torch.int64)
    if layout.startswith("paged"):
        table = ints([[3, 0], [1, 2]])
        cache_shape, slots = (4, 16, hkv, d), paged_slots(table, seq, pos, 16)
    else:
        cache_shape, slots = (2, 24, hkv, d), contiguous_slots(seq, pos, 24)
    slots[4] = slots[7] = -1                                            # padding tokens
    kc, vc = randn(cache_shape, BF16, 6), randn(cache_shape, BF16, 7)     # old contents, to be kept
    if layout == "paged-interleaved":                                   # [blocks, K | V, PAGE, Hkv, D]
        kv = torch.stack([kc, vc], dim=1)
        kc, vc = kv[:, 0], kv[:, 1]
    kc_ref, vc_ref = kc.clone(), vc.clone()
    got = qk_norm_rope(q, k, qw, kw, pos, v=v, rotary_dim=8, rope_theta=1e6, k_cache=kc, v_cache=vc,
                       slot_mapping=slots)
    want = reference.qk_norm_rope(q, k, qw, kw, pos, v=v, rotary_dim=8, rope_theta=1e6, k_cache=kc_ref,
                                  v_cache=vc_ref, slot_mapping=slots)
    exact = reference.qk_norm_rope(q.float(), k.float(), qw, kw, pos, rotary_dim=8, rope_theta=1e6)
    assert_close(got[0], want[0], "q_out", exact=exact[0])
    assert_close(got[1], want[1], "k_out", exact=exact[1])
    flat_k, flat_v = kc.reshape(-1, hkv, d), vc.reshape(-1, hkv, d)
    kept = slots[slots >= 0]
    assert bit_mismatches(flat_k[kept], got[1][slots >= 0]) == 0
    assert bit_mismatches(flat_v[kept], v[slots >= 0]) == 0
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool, device=kc.device)
    untouched[kept] = False
    assert bit_mismatches(flat_k[untouched], kc_ref.reshape(-1, hkv, d)[untouched]) == 0
    assert bit_mismatches(flat_v[untouched], vc_ref.reshape(-1, hkv, d)[untouched]) == 0


@pytest.mark.parametrize("q_wdtype,k_wdtype", [(BF16, FP32), (FP32, BF16), (FP16, BF16)],
                         ids=["q_w-bf16-k_w-fp32", "q_w-fp32-k_w-bf16", "q_w-fp16-k_w-bf16"])
def test_qk_norm_rope_mixed_weight_dtypes(q_wdtype, k_wdtype, poison_empty):
    """Each RMSNorm weight is used at its own precision: an fp32 k_weight is not rounded to a bf16 q_weight's dtype
    (that rounding put k_out 2.4e-3 off in fp32)."""
    q, k = randn((9, 4, 32), FP32, 1), randn((9, 2, 32), FP32, 2)
    qw = randn((32,), FP32, 3, scale=0.2).to(q_wdtype)
    kw = randn((32,), FP32, 4, scale=0.2).to(k_wdtype)
    pos = ints([0, 1, 2, 3, 100, 1000, 5000, 40000, 411768])
    got = qk_norm_rope(q, k, qw, kw, pos, rotary_dim=16, rope_theta=1e6)
    want = reference.qk_norm_rope(q, k, qw, kw, pos, rotary_dim=16, rope_theta=1e6)
    assert_close(got[0], want[0], "q_out")
    assert_close(got[1], want[1], "k_out")


def test_prefill_then_decode_through_the_cache(poison_empty):
    """qk_norm_rope writes a paged cache during a 2-sequence prefill and one decode step; decode_attention over the
    cache equals reference attention of the last token over the whole sequence."""
    hq, hkv, d, rot = 4, 1, 32, 8
    lens = [9, 20]
    table = ints([[2, 0], [1, 3]])
    kc, vc = torch.zeros((4, 16, hkv, d), dtype=FP32, device=runtime.DEVICE), \
        torch.zeros((4, 16, hkv, d), dtype=FP32, device=runtime.DEVICE)
    qw, kw = randn((d,), seed=1, scale=0.1), randn((d,), seed=2, scale=0.1)
    t = sum(lens) + 2
    q, k, v = randn((t, hq, d), seed=3), randn((t, hkv, d), seed=4), randn((t, hkv, d), seed=5)
    seq = ints([0] * 10 + [1] * 21, torch.int64)
    pos = torch.cat([torch.arange(10), torch.arange(21)]).to(runtime.DEVICE)
    order = torch.cat([torch.arange(0, 9), torch.arange(10, 30), torch.tensor([9, 30])]).to(runtime.DEVICE)
    q, k, v, seq, pos = q[order], k[order], v[order], seq[order], pos[order]   # prefill tokens, then the 2 decodes
    q_r, k_r = qk_norm_rope(q, k, qw, kw, pos, v=v, rotary_dim=rot, rope_theta=1e4, k_cache=kc, v_cache=vc,
                            slot_mapping=paged_slots(table, seq, pos, 16))
    o = decode_attention(q_r[-2:], kc, vc, ints([10, 21]), table)
    for b in range(2):
        mine = seq == b                                                 # the sequence's tokens in position order
        want = reference.flash_attention(q_r[mine], k_r[mine], v[mine])[-1]
        assert_close(o[b], want, f"sequence {b}")


# ---------------------------------------------------------------------------------------------------------------
# 5. errors a user can act on


def _good_prefill():
    q, k, v, g, cu, _ = _prefill_inputs([3, 4], 4, 2, 16, FP32)
    return dict(q=q, k=k, v=v, gate=g, cu_seqlens=cu)


def _error_params(table):
    """``(id, mutate, match[, error])`` rows -> pytest params; the error is a ValueError unless the row says."""
    return [pytest.param(row[1], row[2], row[3] if len(row) > 3 else ValueError, id=row[0]) for row in table]


PREFILL_ERRORS = [
    ("q-2d", lambda a: a.update(q=a["q"][:, 0]), r"q must have 3 dims, found shape \(7, 16\)"),
    ("q-int", lambda a: a.update(q=a["q"].to(torch.int32)), r"q must have dtype in", TypeError),
    ("q-not-a-tensor", lambda a: a.update(q=a["q"].tolist()), r"q must be a torch.Tensor, found list", TypeError),
    ("k-dtype", lambda a: a.update(k=a["k"].to(BF16)), r"v must have the dtype of k|k must have the dtype of q",
     TypeError),
    ("v-shape", lambda a: a.update(v=a["v"][:, :1]), r"v must match k in shape: expected \(7, 2, 16\), found "),
    ("heads", lambda a: a.update(k=a["k"].repeat(1, 3, 1)[:, :3], v=a["v"].repeat(1, 3, 1)[:, :3]),
     r"q has 4 heads, which is not a multiple of the 3 heads of k"),
    ("head-dim", lambda a: a.update(q=a["q"][..., :12], k=a["k"][..., :12], v=a["v"][..., :12],
                                    gate=a["gate"][..., :12]), r"q has head dim 12; supported head dims are"),
    ("k-head-dim", lambda a: a.update(k=torch.zeros(7, 2, 32), v=torch.zeros(7, 2, 32)),
     r"k must match q in dims \(2,\): expected \(16,\), found \(32,\)"),
    ("gate-shape", lambda a: a.update(gate=a["gate"][:, :2]), r"gate must match q in shape"),
    ("cu-end", lambda a: a.update(cu_seqlens=ints([0, 3, 6])), r"cu_seqlens must .* end at T = q.shape\[0\] = 7"),
    ("cu-decreasing", lambda a: a.update(cu_seqlens=ints([0, 5, 3, 7])), r"never decrease"),
    ("cu-float", lambda a: a.update(cu_seqlens=a["cu_seqlens"].float()), r"cu_seqlens must have dtype in",
     TypeError),
    ("prefix-count", lambda a: a.update(prefix_lens=ints([1])), r"prefix_lens must have one entry per sequence"),
    ("prefix-rows", lambda a: a.update(prefix_lens=ints([1, 2])), r"k must have 10 rows .* found shape \(7, 2, 16\)"),
]


@pytest.mark.parametrize("impl", [flash_attention, reference.flash_attention], ids=["kernel", "reference"])
@pytest.mark.parametrize("mutate,match,error", _error_params(PREFILL_ERRORS))
def test_flash_attention_errors(mutate, match, error, impl):
    args = _good_prefill()
    mutate(args)
    with pytest.raises(error, match=match):
        impl(**args)


def _good_decode():
    q, kc, vc, g, seq_lens, (kp, vp, table) = _decode_inputs([3, 20], 4, 2, 16, FP32, 32, page=16)
    return dict(q=q, k_cache=kp, v_cache=vp, seq_lens=seq_lens, block_table=table, gate=g)


DECODE_ERRORS = [
    ("cache-3d", lambda a: a.update(k_cache=a["k_cache"][0]), r"k_cache must have 4 dims"),
    ("cache-dtype", lambda a: a.update(k_cache=a["k_cache"].to(BF16), v_cache=a["v_cache"].to(BF16)),
     r"k_cache must have the dtype of q", TypeError),
    ("v-cache-shape", lambda a: a.update(v_cache=a["v_cache"][:2]), r"v_cache must match k_cache in shape"),
    ("heads", lambda a: a.update(q=a["q"][:, :3], gate=a["gate"][:, :3]), r"q has 3 heads, which is not a multiple"),
    ("seq-lens-count", lambda a: a.update(seq_lens=ints([3])), r"seq_lens must have one entry per sequence"),
    ("seq-lens-too-long", lambda a: a.update(seq_lens=ints([3, 33])), r"seq_lens must lie in \[0, 32\]"),
    ("table-dtype", lambda a: a.update(block_table=a["block_table"].long()), r"block_table must have dtype in",
     TypeError),
    ("table-rows", lambda a: a.update(block_table=a["block_table"][:1]), r"block_table must have B = 2 rows"),
    ("table-entry", lambda a: a["block_table"].fill_(99), r"block_table entries in use must lie in \[0, 7\)"),
    ("small-page", lambda a: a.update(k_cache=a["k_cache"][:, :8], v_cache=a["v_cache"][:, :8]),
     r"needs PAGE >= 16"),
    ("contiguous-rows", lambda a: a.update(k_cache=a["k_cache"][:1], v_cache=a["v_cache"][:1], block_table=None),
     r"at least B = 2 rows"),
]


@pytest.mark.parametrize("impl", [decode_attention, reference.decode_attention], ids=["kernel", "reference"])
@pytest.mark.parametrize("mutate,match,error", _error_params(DECODE_ERRORS))
def test_decode_attention_errors(mutate, match, error, impl):
    args = _good_decode()
    mutate(args)
    with pytest.raises(error, match=match):
        impl(**args)


def test_decode_num_splits_must_be_in_range():
    with pytest.raises(ValueError, match=r"num_splits must be an int in \[1, 256\], found 0"):
        decode_attention(**_good_decode(), num_splits=0)
    with pytest.raises(TypeError, match=r"num_splits must be an int in \[1, 256\] or None, found float"):
        decode_attention(**_good_decode(), num_splits=2.0)


def _good_rope():
    q, k, v = randn((5, 4, 32)), randn((5, 2, 32)), randn((5, 2, 32))
    return dict(q=q, k=k, q_weight=randn((32,)), k_weight=randn((32,)), positions=ints([0, 1, 2, 3, 4]), v=v,
                rotary_dim=8, rope_theta=1e4, k_cache=torch.zeros((2, 16, 2, 32), device=runtime.DEVICE),
                v_cache=torch.zeros((2, 16, 2, 32), device=runtime.DEVICE), slot_mapping=ints([0, 1, 2, 3, 4]))


def _zeros(*shape):
    return torch.zeros(shape, device=runtime.DEVICE)


ROPE_ERRORS = [
    ("k-tokens", lambda a: a.update(k=a["k"][:4]), r"k must match q in dims \(0, 2\)"),
    ("weight-shape", lambda a: a.update(k_weight=a["k_weight"][:16]), r"k_weight must have shape \(32,\)"),
    ("positions-count", lambda a: a.update(positions=ints([0, 1])), r"positions must have one entry per token"),
    ("rotary-odd", lambda a: a.update(rotary_dim=7), r"rotary_dim must be an even int in \(0, 32\], found 7"),
    ("rotary-float", lambda a: a.update(rotary_dim=8.0), r"rotary_dim must be an even int .* found float", TypeError),
    ("k-dtype", lambda a: a.update(k=a["k"].to(BF16)), r"k must have the dtype of q \(float32\), found bfloat16",
     TypeError),
    ("weight-int", lambda a: a.update(q_weight=a["q_weight"].to(torch.int32)), r"q_weight must have dtype in",
     TypeError),
    ("positions-past-table", lambda a: a.update(rope_theta=None, cos=_zeros(4, 8), sin=_zeros(4, 8),
                                                positions=ints([0, 1, 2, 3, 100])),
     r"positions must lie in \[0, 4\) \(the rows of the cos / sin tables\), found min 0, max 100"),
    ("positions-negative-table", lambda a: a.update(rope_theta=None, cos=_zeros(8, 8), sin=_zeros(8, 8),
                                                    positions=ints([0, -1, 2, 3, 4])),
     r"positions must lie in \[0, 8\) .* found min -1, max 4"),
    ("positions-negative-theta", lambda a: a.update(positions=ints([0, 1, -5, 3, 4])),
     r"positions must lie in \[0, 411768\] with rope_theta .* found min -5, max 4"),
    ("positions-past-theta-limit", lambda a: a.update(positions=ints([0, 1, 2, 3, 411769])),
     r"positions must lie in \[0, 411768\] with rope_theta .*pass cos / sin tables.* found min 0, max 411769"),
    ("no-theta", lambda a: a.update(rope_theta=None), r"rope_theta must be a positive float"),
    ("cos-only", lambda a: a.update(cos=_zeros(8, 8)), r"give both cos and sin tables"),
    ("table-width", lambda a: a.update(cos=_zeros(8, 4), sin=_zeros(8, 4)),
     r"cos must have shape \[max_position, rotary_dim = 8\]"),
    ("cache-without-slots", lambda a: a.update(slot_mapping=None), r"a cache write needs all of"),
    ("slot-range", lambda a: a.update(slot_mapping=ints([0, 1, 2, 3, 32])), r"slot_mapping must lie in \[-1, 32\)"),
    ("cache-heads", lambda a: a.update(k_cache=_zeros(2, 16, 1, 32), v_cache=_zeros(2, 16, 1, 32)),
     r"k_cache must be \[\*, \*, 2, 32\]"),
]


@pytest.mark.parametrize("impl", [qk_norm_rope, reference.qk_norm_rope], ids=["kernel", "reference"])
@pytest.mark.parametrize("mutate,match,error", _error_params(ROPE_ERRORS))
def test_qk_norm_rope_errors(mutate, match, error, impl):
    args = _good_rope()
    mutate(args)
    q, k, qw, kw, pos = (args.pop(n) for n in ("q", "k", "q_weight", "k_weight", "positions"))
    with pytest.raises(error, match=match):
        impl(q, k, qw, kw, pos, **args)


@pytest.mark.skipif(runtime.DEVICE.type != "cpu", reason="on a GPU the CPU is the wrong device")
def test_wrong_device_is_named():
    """Under the interpreter the kernels want CPU tensors; a 'meta' tensor stands in for a foreign device."""
    args = _good_prefill()
    args["gate"] = args["gate"].to("meta")
    with pytest.raises(ValueError, match=r"gate is on meta, but kernels run on the CPU"):
        flash_attention(**args)
    args = _good_decode()
    args["block_table"] = args["block_table"].to("meta")
    with pytest.raises(ValueError, match=r"block_table is on meta"):
        decode_attention(**args)


# ---------------------------------------------------------------------------------------------------------------
# 6. GPU only: the real shapes, compiled, against SDPA; every autotune config


@pytest.mark.gpu
@pytest.mark.parametrize("t", [4096, 1000])
def test_gpu_prefill_qwen_shape_matches_sdpa(t):
    q, k, v = (torch.randn(t, h, 256, device="cuda", dtype=BF16) for h in (16, 2, 2))
    gate = torch.randn(t, 16, 256, device="cuda", dtype=BF16)
    got = flash_attention(q, k, v, gate=gate)
    want = _sdpa(q.float(), k.float(), v.float(), torch.ones(t, t, device="cuda").tril().bool())
    want = want * torch.sigmoid(gate.float())
    m = lynn_kernels.compare(got, want, baseline=want.to(BF16))
    assert m.cosine > 0.9999 and m.err_ratio < 3, m


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_gpu_decode_long_context(paged):
    b, s = 2, 32768
    q = torch.randn(b, 16, 256, device="cuda", dtype=BF16)
    kc, vc = (torch.randn(b, s, 2, 256, device="cuda", dtype=BF16) for _ in range(2))
    lens = torch.tensor([s, 12345], dtype=I32, device="cuda")
    table = None
    if paged:
        table = torch.randperm(b * s // 64, device="cuda").view(b, -1).to(I32)
        kp, vp = (torch.empty(b * s // 64, 64, 2, 256, device="cuda", dtype=BF16) for _ in range(2))
        slots = paged_slots(table, torch.arange(b, device="cuda").repeat_interleave(s),
                            torch.arange(s, device="cuda").repeat(b), 64)
        kp.view(-1, 2, 256)[slots], vp.view(-1, 2, 256)[slots] = kc.view(-1, 2, 256), vc.view(-1, 2, 256)
        kc, vc = kp, vp
    got = decode_attention(q, kc, vc, lens, table)
    want = reference.decode_attention(q.float(), kc.float(), vc.float(), lens, table)
    m = lynn_kernels.compare(got, want, baseline=want.to(BF16))
    assert m.cosine > 0.9999 and m.err_ratio < 3, m


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
def test_gpu_every_prefill_config_compiles_and_agrees(d):
    q, k, v, g, cu, pre = _prefill_inputs([300, 1, 77], 16, 2, d, BF16, prefix=[0, 5, 129])
    lay = check_prefill(q, k, v, g, cu, pre)
    want = reference.flash_attention(q, k, v, gate=g, cu_seqlens=cu, prefix_lens=pre)
    exact = reference.flash_attention(*f32(q, k, v), gate=g.float(), cu_seqlens=cu, prefix_lens=pre)
    for cfg in prefill_mod._prune(prefill_mod.PREFILL_CONFIGS, {"HEAD_DIM": d}):
        out = torch.full_like(q, math.nan)
        config = {**cfg.kwargs, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
        prefill_mod.launch_prefill(q, k, v, g, out, lay.cu_q_t, lay.cu_k_t, lay.max_q, True, d ** -0.5, config)
        assert_close(out, want, str(config), exact=exact)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 256])
def test_gpu_every_decode_config_compiles_and_agrees(d):
    q, kc, vc, g, seq_lens, (kp, vp, table) = _decode_inputs([0, 1, 700, 1024], 16, 2, d, BF16, 1024, page=16)
    want = reference.decode_attention(q, kc, vc, seq_lens, gate=g)
    exact = reference.decode_attention(*f32(q, kc, vc), seq_lens, gate=g.float())
    for cfg in decode_mod._prune(decode_mod.DECODE_CONFIGS, {"HEAD_DIM": d}):
        config = {**cfg.kwargs, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
        for splits in (1, 5):
            out = torch.full_like(q, math.nan)
            decode_mod.launch_decode(q, kp, vp, seq_lens, table, g, out, splits, d ** -0.5, config=config)
            assert_close(out, want, f"{config} {splits} splits", exact=exact)
