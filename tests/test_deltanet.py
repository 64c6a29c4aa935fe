"""Gated DeltaNet: the Triton kernels against the torch references, the references against HF transformers'
own Qwen3-Next functions, a whole Qwen3.5 linear-attention layer (prefill and decode) against HF's, and errors.

Kernel tests run under Triton's interpreter on the CPU (heads of 32, one or two value heads per sequence, so
each case takes about a second) with every fresh allocation poisoned with NaN. On the GPU the chunked kernel feeds
bf16 operands to ``tl.dot`` for bf16 inputs, so its bf16 tolerance there is looser (``_assert_output``). The sweeps of
each kernel against the reference are the family's check matrix (lynn_kernels/deltanet/check.py, what ``lynn check``
and the lab run).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_case_passes, check_cases, oracle

from lynn_kernels import deltanet, runtime, use_reference
from lynn_kernels.deltanet import reference, triton_chunk, triton_recurrent
from lynn_kernels.metrics import compare

BF16, FP32 = torch.bfloat16, torch.float32
DTYPES = [pytest.param(BF16, id="bf16"), pytest.param(FP32, id="fp32")]


# ---------------------------------------------------------------------------------------------------------------
# inputs and tolerances


def make_inputs(B, T, H, HV, K, V, dtype=FP32, seed=0, l2norm=True, device=None):
    """Random q, k, v, g, beta and an initial state. Without the in-kernel L2 norm, q and k come normalised (the
    delta rule is only stable for ``beta |k|^2 <= 2``)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(shape, generator=gen)

    q, k, v = randn(B, T, H, K), randn(B, T, H, K), randn(B, T, HV, V)
    if not l2norm:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    g = F.logsigmoid(randn(B, T, HV) + 2.0)                 # decays in (0, 1), most near 1: a long memory
    beta = torch.sigmoid(randn(B, T, HV))
    h0 = randn(B, HV, K, V) * 0.1
    dev = device or runtime.DEVICE
    return (q.to(dtype).to(dev), k.to(dtype).to(dev), v.to(dtype).to(dev), g.to(dev), beta.to(dev), h0.to(dev))


def spec_output(q, k, v, g, beta, h0, l2norm, scale=None):
    """The fp32 answer for these (possibly bf16) inputs: the step-by-step reference on their exact fp32 values."""
    return reference.recurrent_gated_delta_rule(q.float(), k.float(), v.float(), g, beta, scale, h0, True, l2norm)


def _assert_output(got, want, what="", chunk_dots=False):
    """fp32: rel_l2 <= 2e-6 (interpreter at most 4.4e-7; H200 lynn check 3.6e-7). bf16: within one bf16 rounding of
    the fp32 answer (|err| <= 2^-8 |ref| + 1e-5 max|ref|). On the GPU a bf16 chunked prefill uses bf16 dot operands:
    at most 4x the error of the fp32 answer rounded once to bf16 there (H200: 2.54 lynn check T65, 2.46 T4096)."""
    assert got.dtype != FP32 or want.dtype == FP32
    assert torch.isfinite(got.float()).all(), f"non-finite output {what}"
    m = compare(got, want)
    if got.dtype == FP32:
        assert m.rel_l2 <= 2e-6, f"{what}: {m}"
    elif chunk_dots and not runtime.INTERPRET:
        m = compare(got, want, baseline=want.to(got.dtype))
        assert m.err_ratio <= 4.0, f"{what}: {m}"
    else:
        err = (got.float() - want).abs()
        tol = want.abs() * 2.0**-8 + 1e-5 * want.abs().max()
        assert bool((err <= tol).all()), f"{what}: {int((err > tol).sum())} elements beyond one bf16 rounding; {m}"


def _assert_state(got, want, what="", bf16_dots=False):
    """The fp32 state: rel_l2 <= 2e-6 where its path is all fp32 (interpreter at most 6.4e-7; H200 lynn check:
    recurrent 5.9e-8, chunk from fp32 inputs 2.6e-7). ``bf16_dots``: it came through the chunked rule from bf16 inputs,
    whose dot operands are bf16 on the GPU: there at most 4x the error of one bf16 rounding of it (H200 T65: 1.8x)."""
    assert got.dtype == FP32, f"the state must stay fp32, got {got.dtype} {what}"
    m = compare(got, want)
    if bf16_dots and not runtime.INTERPRET:
        m = compare(got, want, baseline=want.to(BF16))
        assert m.err_ratio <= 4.0, f"state {what}: {m}"
    else:
        assert m.rel_l2 <= 2e-6, f"state {what}: {m}"


# ---------------------------------------------------------------------------------------------------------------
# 1. the references: chunked == step by step == HF transformers


@pytest.mark.parametrize("T", [1, 63, 64, 65, 200])
def test_chunk_reference_equals_recurrent_reference(T):
    q, k, v, g, beta, h0 = make_inputs(2, T, 2, 4, 32, 48, device="cpu")
    o1, s1 = reference.recurrent_gated_delta_rule(q, k, v, g, beta, None, h0, True, True)
    o2, s2 = reference.chunk_gated_delta_rule(q, k, v, g, beta, None, h0, True, True)
    assert compare(o2, o1).rel_l2 < 1e-5
    assert compare(s2, s1).rel_l2 < 1e-5


@pytest.mark.oracle("transformers")
@pytest.mark.parametrize("l2norm", [True, False], ids=["l2norm", "prenormed"])
@pytest.mark.parametrize("group", [1, 2], ids=["HV=H", "HV=2H"])
def test_references_match_hf(group, l2norm):
    """HF's own torch functions (they repeat q/k to the value heads themselves and take ``use_qk_l2norm_in_kernel``)."""
    hf = oracle("transformers.models.qwen3_next.modeling_qwen3_next")
    q, k, v, g, beta, h0 = make_inputs(2, 130, 2, 2 * group, 32, 32, l2norm=l2norm, device="cpu")
    o_hf_c, s_hf_c = hf.torch_chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                     use_qk_l2norm_in_kernel=l2norm)
    o_hf_r, s_hf_r = hf.torch_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                                         output_final_state=True, use_qk_l2norm_in_kernel=l2norm)
    for fn in (reference.recurrent_gated_delta_rule, reference.chunk_gated_delta_rule):
        o, s = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm=l2norm)
        for o_hf, s_hf in ((o_hf_c, s_hf_c), (o_hf_r, s_hf_r)):
            assert compare(o, o_hf).rel_l2 < 1e-5, fn.__name__
            assert compare(s, s_hf).rel_l2 < 1e-5, fn.__name__


def test_gates_match_hf_formula():
    gen = torch.Generator().manual_seed(0)
    A_log, dt_bias = torch.rand(4, generator=gen) * 3, torch.randn(4, generator=gen)
    a, b = torch.randn(2, 5, 4, generator=gen) * 10, torch.randn(2, 5, 4, generator=gen)   # softplus past 20 too
    g, beta = reference.gates(A_log, a, dt_bias, b)
    assert torch.equal(g, -A_log.float().exp() * F.softplus(a.float() + dt_bias))
    assert torch.equal(beta, b.sigmoid())


# ---------------------------------------------------------------------------------------------------------------
# 2. the kernels against the references


@pytest.mark.parametrize("case", check_cases("deltanet", "deltanet.chunk"))
def test_chunk_kernel(case, poison_empty):
    """One sequence, or packed ones (each also run alone: the same bits under the interpreter)."""
    assert_case_passes(case)


@pytest.mark.parametrize("case", check_cases("deltanet", "deltanet.recurrent"))
def test_recurrent_kernel(case, poison_empty):
    """With g and beta given, and with them computed in the kernel from the layer's raw a, b."""
    assert_case_passes(case)


def test_state_in_place(poison_empty):
    """``out_state=initial_state``: one decode step updates the cache's state tensor itself."""
    q, k, v, g, beta, h0 = make_inputs(2, 1, 1, 2, 32, 32)
    want_o, want_s = spec_output(q, k, v, g, beta, h0, True)
    state = h0.clone()
    o, s = deltanet.recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=state, use_qk_l2norm=True,
                                               out_state=state)
    assert s is state
    _assert_output(o, want_o)
    _assert_state(state, want_s)
    o2, s2 = deltanet.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0.clone(), use_qk_l2norm=True,
                                             out_state=state)
    assert s2 is state
    _assert_output(o2, want_o)
    _assert_state(state, want_s)


def test_gpu_tiling_under_the_interpreter(monkeypatch, poison_empty):
    """The GPU's narrow value blocks (several programs per head, masked tails) on odd head dims K=48, V=80."""
    monkeypatch.setattr(triton_chunk, "block_v", lambda V: (32, 64))
    monkeypatch.setattr(triton_recurrent, "recurrent_config", lambda K, V: (16, 1))
    q, k, v, g, beta, h0 = make_inputs(1, 70, 1, 2, 48, 80)
    o_ref, ht_ref = spec_output(q, k, v, g, beta, h0, True)
    for fn in (deltanet.chunk_gated_delta_rule, deltanet.recurrent_gated_delta_rule):
        o, ht = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm=True)
        _assert_output(o, o_ref, fn.__name__, chunk_dots=True)
        _assert_state(ht, ht_ref, fn.__name__)


def test_head_dim_128(poison_empty):
    """The real head dim, one head: a prefill of 65 tokens then one decode step."""
    q, k, v, g, beta, h0 = make_inputs(1, 66, 1, 1, 128, 128, BF16)
    o_ref, ht_ref = spec_output(q, k, v, g, beta, h0, True)
    o, s = deltanet.chunk_gated_delta_rule(q[:, :65], k[:, :65], v[:, :65], g[:, :65], beta[:, :65],
                                           initial_state=h0, output_final_state=True, use_qk_l2norm=True)
    o1, s = deltanet.recurrent_gated_delta_rule(q[:, 65:], k[:, 65:], v[:, 65:], g[:, 65:], beta[:, 65:],
                                                initial_state=s, output_final_state=True, use_qk_l2norm=True)
    _assert_output(torch.cat([o, o1], dim=1), o_ref, "d=128", chunk_dots=True)
    _assert_state(s, ht_ref, "d=128", bf16_dots=True)


def test_strided_inputs_from_a_fused_projection(poison_empty):
    """q, k, v as views of one ``[B, T, C]`` projection (how a layer splits ``in_proj_qkv``): no copies needed."""
    B, T, H, HV, D = 1, 40, 1, 2, 32
    q0, k0, v0, g, beta, h0 = make_inputs(B, T, H, HV, D, D)
    mixed = torch.cat([q0.flatten(2), k0.flatten(2), v0.flatten(2)], dim=-1)        # [B, T, C]
    q, k, v = torch.split(mixed, [H * D, H * D, HV * D], dim=-1)
    q, k, v = q.unflatten(-1, (H, D)), k.unflatten(-1, (H, D)), v.unflatten(-1, (HV, D))
    assert not q.is_contiguous()
    want = spec_output(q0, k0, v0, g, beta, h0, True)[0]
    for fn in (deltanet.chunk_gated_delta_rule, deltanet.recurrent_gated_delta_rule):
        _assert_output(fn(q, k, v, g, beta, initial_state=h0, use_qk_l2norm=True)[0], want, fn.__name__)


def test_final_state_only_when_asked_and_empty_sequence():
    q, k, v, g, beta, h0 = make_inputs(1, 3, 1, 2, 32, 32)
    for fn in (deltanet.chunk_gated_delta_rule, deltanet.recurrent_gated_delta_rule):
        assert fn(q, k, v, g, beta, initial_state=h0)[1] is None
        o, s = fn(q[:, :0], k[:, :0], v[:, :0], g[:, :0], beta[:, :0], initial_state=h0, output_final_state=True)
        assert o.shape == (1, 0, 2, 32) and torch.equal(s, h0)


def test_prefill_then_decode_equals_one_long_prefill(poison_empty, device):
    """Chunked prefill of 66 tokens, then two decode steps with the gates in the kernel, equals a 68-token prefill."""
    T0, T = 66, 68
    q, k, v, _, _, h0 = make_inputs(1, T, 1, 2, 32, 32, BF16)
    gen = torch.Generator().manual_seed(7)
    a, b = torch.randn(1, T, 2, generator=gen).to(device), torch.randn(1, T, 2, generator=gen).to(device)
    A_log, dt_bias = torch.rand(2, generator=gen).to(device), torch.randn(2, generator=gen).to(device)
    g, beta = deltanet.gates(A_log, a, dt_bias, b)
    o_long, s_long = deltanet.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                     use_qk_l2norm=True)
    o, s = deltanet.chunk_gated_delta_rule(q[:, :T0], k[:, :T0], v[:, :T0], g[:, :T0], beta[:, :T0],
                                           initial_state=h0, output_final_state=True, use_qk_l2norm=True)
    outs = [o]
    for t in range(T0, T):
        o_t, s = deltanet.recurrent_gated_delta_rule_gates(
            q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], A_log, a[:, t:t + 1], dt_bias, b[:, t:t + 1],
            initial_state=s, use_qk_l2norm=True, out_state=s)
        outs.append(o_t)
    want, want_s = spec_output(q, k, v, g, beta, h0, True)
    _assert_output(torch.cat(outs, dim=1), want, "prefill + decode", chunk_dots=True)
    _assert_output(o_long, want, "long prefill", chunk_dots=True)
    _assert_state(s, want_s, "prefill + decode", bf16_dots=True)
    _assert_state(s_long, want_s, "long prefill", bf16_dots=True)


def test_reference_backend_runs_the_reference():
    q, k, v, g, beta, h0 = make_inputs(1, 5, 1, 2, 32, 32, device="cpu")
    with use_reference():
        o, s = deltanet.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o_ref, s_ref = reference.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert torch.equal(o, o_ref) and torch.equal(s, s_ref)


class _NoLaunch:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](...)`` does nothing, so no output gets written."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def test_poison_reaches_the_outputs(monkeypatch, poison_empty):
    """If the output kernel wrote nothing, the poisoned allocation would show: the tests above would catch it."""
    monkeypatch.setattr(triton_chunk.CHUNK_OUTPUT, "shipped", _NoLaunch())
    q, k, v, g, beta, _ = make_inputs(1, 3, 1, 2, 32, 32)
    o, _ = deltanet.chunk_gated_delta_rule(q, k, v, g, beta)
    assert torch.isnan(o).all()


# ---------------------------------------------------------------------------------------------------------------
# 3. causal conv1d


def _conv_inputs(B, T, C, W, dtype, state_width, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, C, generator=gen).to(dtype).to(runtime.DEVICE)
    w = (torch.randn(C, W, generator=gen) * 0.5).to(dtype).to(runtime.DEVICE)
    s0 = None if state_width is None else torch.randn(B, C, state_width, generator=gen).to(dtype).to(runtime.DEVICE)
    return x, w, s0


def _assert_conv(y, want, what="", steps=1):
    """fp32 sums in another order: 1e-6 relative; bf16: roundings of nearly equal sums, ``steps`` bf16 steps apart."""
    tol = want.float().abs() * (steps * 2.0**-7 if y.dtype == BF16 else 1e-6) + 1e-6
    assert bool(((y.float() - want.float()).abs() <= tol).all()), f"{what}: {compare(y, want.float())}"


@pytest.mark.parametrize("case", check_cases("deltanet", "deltanet.conv"))
def test_causal_conv1d(case, poison_empty):
    """The prefill (batched, or packed and each sequence alone), its final state bit for bit, an update step."""
    assert_case_passes(case)


@pytest.mark.parametrize("dtype", DTYPES)
def test_conv_prefill_then_updates_equals_one_long_prefill(dtype, poison_empty):
    x, w, _ = _conv_inputs(2, 9, 40, 4, dtype, None)
    y_long, s_long = deltanet.causal_conv1d(x, w)
    y, state = deltanet.causal_conv1d(x[:, :2], w)                      # shorter than W - 1: zeros padded in
    ys = [y] + [deltanet.causal_conv1d_update(x[:, t], state, w)[:, None] for t in range(2, 9)]
    if runtime.INTERPRET:       # the two kernels sum in the same order; compiled, FMA contraction may differ
        assert torch.equal(torch.cat(ys, dim=1), y_long)
    else:
        _assert_conv(torch.cat(ys, dim=1), y_long)
    assert torch.equal(state, s_long)


@pytest.mark.oracle("transformers")
@pytest.mark.parametrize("dtype", DTYPES)
def test_conv_matches_hf(dtype):
    """HF keeps ``x`` as ``[B, C, T]`` and a conv state ``[B, C, W]``; the same numbers in our layout. In bf16 HF
    rounds twice (the conv output, then SiLU in bf16), so two bf16 steps apart at most."""
    hf = oracle("transformers.models.qwen3_next.modeling_qwen3_next")
    x, w, _ = _conv_inputs(2, 20, 40, 4, dtype, None)
    want = hf.causal_conv1d_fn(x.transpose(1, 2).cpu(), w.cpu(), None, activation="silu").transpose(1, 2)
    y, _ = deltanet.causal_conv1d(x, w)
    _assert_conv(y.cpu(), want, "prefill vs HF", steps=2)
    state_hf = torch.randn(2, 40, 4).to(dtype)
    state = state_hf.clone().to(runtime.DEVICE)
    want = hf.causal_conv1d_update(x[:, :1].transpose(1, 2).cpu(), state_hf, w.cpu(), None, "silu")[:, :, 0]
    y = deltanet.causal_conv1d_update(x[:, 0], state, w)
    _assert_conv(y.cpu(), want, "update vs HF", steps=2)
    assert torch.equal(state.cpu(), state_hf)


# ---------------------------------------------------------------------------------------------------------------
# 4. gated RMSNorm


@pytest.mark.parametrize("case", check_cases("deltanet", "deltanet.gated_rmsnorm"))
def test_gated_rmsnorm(case, poison_empty):
    assert_case_passes(case)


@pytest.mark.parametrize("lead", ["prefill", "decode"])
def test_gated_rmsnorm_reads_a_fused_projections_z_in_place(lead, make_weight, device):
    """z as the model's fused ``in_proj_qkvz`` gives it: heads of a strided slice of a wider row (``[1, T, nv, dv]``
    in a prefill, ``[T, 1, nv, dv]`` in a decode step). The kernel reads it through its strides, with no copy, and
    gives what it gives on a contiguous z."""
    from lynn_kernels.deltanet import triton_norm

    t, nv, dv, c = 5, 3, 32, 80
    qkvz = make_weight((t, c + nv * dv), BF16, seed=4)
    z = qkvz[:, c:].view(1, t, nv, dv) if lead == "prefill" else qkvz[:, c:].view(t, 1, nv, dv)
    x = make_weight(tuple(z.shape), BF16, seed=5) * 3
    w = (1 + make_weight((dv,), FP32, seed=6, scale=0.2)).to(BF16)
    assert triton_norm._rows(z, dv).data_ptr() == z.data_ptr()          # a view of the fused output: no copy
    got = deltanet.gated_rmsnorm(x, z, w)
    assert compare(got, deltanet.gated_rmsnorm(x, z.contiguous(), w), exact=True).mismatches == 0


@pytest.mark.oracle("transformers")
@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_rmsnorm_matches_hf(dtype, make_weight):
    hf = oracle("transformers.models.qwen3_next.modeling_qwen3_next")
    x, z = make_weight((4, 64), dtype, seed=1), make_weight((4, 64), dtype, seed=2)
    norm = hf.Qwen3NextRMSNormGated(64, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + torch.randn(64) * 0.2)
        want = norm(x.cpu(), z.cpu())
    assert compare(reference.gated_rmsnorm(x.cpu(), z.cpu(), norm.weight.detach()), want, exact=True).mismatches == 0
    y = deltanet.gated_rmsnorm(x, z, norm.weight.detach().to(x.device))
    assert ((y.cpu().float() - want.float()).abs() <= want.float().abs() * 2.0**-7 + 1e-6).all()


# ---------------------------------------------------------------------------------------------------------------
# 5. a whole Qwen3.5 Gated DeltaNet layer against HF's, prefill then decode


@pytest.mark.oracle("transformers")
def test_qwen3_5_layer_matches_hf(device):
    """HF's ``Qwen3_5GatedDeltaNet`` on 68 tokens == our ops: conv + chunked rule on 66, then two decode steps
    (conv update + fused-gate recurrent step) from the carried states, then the gated norm and out_proj."""
    m = oracle("transformers.models.qwen3_5.modeling_qwen3_5")
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(hidden_size=64, linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=32,
                            linear_value_head_dim=32, linear_conv_kernel_dim=4, num_hidden_layers=1,
                            layer_types=["linear_attention"])
    torch.manual_seed(0)
    layer = m.Qwen3_5GatedDeltaNet(cfg, 0).eval()
    with torch.no_grad():
        layer.dt_bias.normal_()
        layer.norm.weight.copy_(1 + 0.2 * torch.randn(32))
    B, T, T0, H, HV, D = 1, 68, 66, 1, 2, 32
    hidden = torch.randn(B, T, 64)
    with torch.no_grad():
        want = layer(hidden)
        mixed = layer.in_proj_qkv(hidden).to(device)                           # [B, T, C]
        z = layer.in_proj_z(hidden).reshape(B, T, HV, D).to(device)
        b, a = layer.in_proj_b(hidden).to(device), layer.in_proj_a(hidden).to(device)
        conv_w = layer.conv1d.weight.squeeze(1).to(device)
        A_log, dt_bias = layer.A_log.to(device), layer.dt_bias.to(device)

        def split(x):
            q, k, v = torch.split(x, [H * D, H * D, HV * D], dim=-1)
            return q.unflatten(-1, (H, D)), k.unflatten(-1, (H, D)), v.unflatten(-1, (HV, D))

        x, conv_state = deltanet.causal_conv1d(mixed[:, :T0], conv_w)
        q, k, v = split(x)
        g, beta = deltanet.gates(A_log, a[:, :T0], dt_bias, b[:, :T0])
        o, state = deltanet.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, use_qk_l2norm=True)
        outs = [o]
        for t in range(T0, T):
            q, k, v = split(deltanet.causal_conv1d_update(mixed[:, t], conv_state, conv_w)[:, None])
            o, state = deltanet.recurrent_gated_delta_rule_gates(q, k, v, A_log, a[:, t:t + 1], dt_bias,
                                                                 b[:, t:t + 1], initial_state=state,
                                                                 use_qk_l2norm=True, out_state=state)
            outs.append(o)
        o = deltanet.gated_rmsnorm(torch.cat(outs, dim=1), z, layer.norm.weight.to(device), layer.norm.variance_epsilon)
        got = layer.out_proj(o.reshape(B, T, HV * D).cpu())
    m_ = compare(got, want)
    assert m_.rel_l2 < (1e-5 if runtime.INTERPRET else 1e-4), m_


# ---------------------------------------------------------------------------------------------------------------
# 6. packed sequences (cu_seqlens): one prefill of several prompts, no padding

def _cu(lens, device=None):
    """int32 ``[N+1]`` offsets of sequences of these lengths."""
    offsets = [0]
    for n in lens:
        offsets.append(offsets[-1] + n)
    return torch.tensor(offsets, dtype=torch.int32, device=device or runtime.DEVICE)


def _spans(lens):
    """``(n, start, end)`` of each packed sequence."""
    cu = _cu(lens, "cpu").tolist()
    return [(n, a, b) for n, (a, b) in enumerate(zip(cu, cu[1:]))]


def _packed_rule_inputs(lens, dtype, l2norm, H=2, HV=4, K=16, V=16, seed=0):
    """q, k, v, g, beta of the packed sequences ``[1, T, ...]``, an initial state ``[N, HV, K, V]`` and cu_seqlens."""
    q, k, v, g, beta, _ = make_inputs(1, sum(lens), H, HV, K, V, dtype, seed=seed, l2norm=l2norm)
    h0 = make_inputs(len(lens), 1, H, HV, K, V, seed=seed + 1)[5]
    return q, k, v, g, beta, h0, _cu(lens)


def test_chunk_packed_state_in_place(poison_empty):
    """``out_state=initial_state`` with packed sequences: the ``[N, HV, K, V]`` cache rows are updated in place, an
    empty sequence's row kept; without ``output_final_state`` nothing is returned."""
    q, k, v, g, beta, h0, cu = _packed_rule_inputs([3, 0, 66], FP32, True, H=1, HV=2)
    _, want = reference.chunk_gated_delta_rule(q, k, v, g, beta, None, h0, True, True, cu_seqlens=cu)
    assert deltanet.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu)[1] is None
    state = h0.clone()
    _, s = deltanet.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state, use_qk_l2norm=True,
                                           out_state=state, cu_seqlens=cu)
    assert s is state and torch.equal(state[1], h0[1])
    _assert_state(state, want, "in place")


def test_chunk_packed_all_empty():
    """No tokens at all (``cu = [0, 0, 0]``): each state row passes through, zeros without an initial state."""
    q, k, v, g, beta, h0, cu = _packed_rule_inputs([0, 0], FP32, True)
    o, s = deltanet.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    assert o.shape == (1, 0, 4, 16) and torch.equal(s, h0)
    _, s = deltanet.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu)
    assert s.shape == (2, 4, 16, 16) and not s.any()


def test_packed_prefill_then_batched_decode(poison_empty, device):
    """A decoder's step: one packed prefill of three prompts (one empty) through the conv and the chunked rule, then
    one decode step of all three as a batch of B = N from the returned state rows (conv update + fused-gate
    recurrent step), equals each prompt plus its next token run alone through the references."""
    lens, H, HV, D, W = [5, 0, 70], 1, 2, 16, 4
    N, T, C = len(lens), sum(lens), (2 * H + HV) * D
    gen = torch.Generator().manual_seed(3)
    mixed, mixed1 = torch.randn(1, T, C, generator=gen).to(device), torch.randn(N, C, generator=gen).to(device)
    a, b = torch.randn(1, T, HV, generator=gen).to(device), torch.randn(1, T, HV, generator=gen).to(device)
    a1, b1 = torch.randn(N, 1, HV, generator=gen).to(device), torch.randn(N, 1, HV, generator=gen).to(device)
    A_log, dt_bias = torch.rand(HV, generator=gen).to(device), torch.randn(HV, generator=gen).to(device)
    conv_w = (torch.randn(C, W, generator=gen) * 0.5).to(device)
    cu = _cu(lens)

    def split(x):
        q, k, v = torch.split(x, [H * D, H * D, HV * D], dim=-1)
        return q.unflatten(-1, (H, D)), k.unflatten(-1, (H, D)), v.unflatten(-1, (HV, D))

    x, conv_state = deltanet.causal_conv1d(mixed, conv_w, cu_seqlens=cu)                 # conv_state [N, C, W - 1]
    g, beta = deltanet.gates(A_log, a, dt_bias, b)
    o, state = deltanet.chunk_gated_delta_rule(*split(x), g, beta, output_final_state=True, use_qk_l2norm=True,
                                               cu_seqlens=cu)                            # state [N, HV, D, D]
    x1 = deltanet.causal_conv1d_update(mixed1, conv_state, conv_w)                        # [N, C]
    o1, _ = deltanet.recurrent_gated_delta_rule_gates(*split(x1[:, None]), A_log, a1, dt_bias, b1,
                                                      initial_state=state, use_qk_l2norm=True, out_state=state)
    for n, start, end in _spans(lens):
        xs, _ = reference.causal_conv1d(torch.cat([mixed[:, start:end], mixed1[None, n:n + 1]], dim=1), conv_w)
        want, want_s = reference.recurrent_gated_delta_rule_gates(
            *split(xs), A_log, torch.cat([a[:, start:end], a1[n:n + 1]], dim=1), dt_bias,
            torch.cat([b[:, start:end], b1[n:n + 1]], dim=1), None, None, True, True)
        _assert_output(torch.cat([o[:, start:end], o1[n:n + 1]], dim=1), want, f"sequence {n}", chunk_dots=True)
        _assert_state(state[n:n + 1], want_s, f"sequence {n}")


def _cu_bad(values, dtype=torch.int32, device="cpu"):
    return torch.tensor(values, dtype=dtype, device=device)


#: (cu_seqlens for T = 4 tokens, rows of the initial state, batch rows of the inputs, message, error)
CU_SEQLENS_ERRORS = [
    pytest.param([0, 1, 4], 2, 1, "cu_seqlens must be a torch.Tensor, got list", TypeError, id="list"),
    pytest.param(_cu_bad([0, 1, 4], torch.int64), 2, 1, "cu_seqlens has dtype torch.int64; expected torch.int32",
                 TypeError, id="int64"),
    pytest.param(_cu_bad([0, 1, 4], FP32), 2, 1, "cu_seqlens has dtype torch.float32", TypeError, id="float"),
    pytest.param(_cu_bad([[0, 1, 4]]), 2, 1, r"cu_seqlens must be 1-D \[N\+1\]", ValueError, id="2d"),
    pytest.param(_cu_bad([0]), 2, 1, r"cu_seqlens must be 1-D \[N\+1\] offsets of N >= 1 sequences, found shape "
                 r"\(1,\)", ValueError, id="one-entry"),
    pytest.param(_cu_bad([1, 2, 4]), 2, 1, r"cu_seqlens must start at 0, found \[1, 2, 4\]", ValueError,
                 id="not-from-0"),
    pytest.param(_cu_bad([0, 3, 1, 4]), 3, 1, r"cu_seqlens must never decrease .* cu\[2\]=1 < cu\[1\]=3", ValueError,
                 id="decreasing"),
    pytest.param(_cu_bad([0, 1, 3]), 2, 1, r"cu_seqlens must end at T = \w\.shape\[1\] = 4, found cu\[-1\]=3",
                 ValueError, id="short"),
    pytest.param(_cu_bad([0, 1, 5]), 2, 1, r"cu_seqlens must end at T = \w\.shape\[1\] = 4, found cu\[-1\]=5",
                 ValueError, id="long"),
    pytest.param(_cu_bad([0, 1, 4]), 2, 2, r"with cu_seqlens, \w must hold the packed sequences as one row "
                 r"\(B = 1, \[1, T, \.\.\.\]\), found B=2", ValueError, id="batch-2"),
    pytest.param(_cu_bad([0, 1, 4]), 3, 1, r"initial_state must have shape \[N, .*\(2, ", ValueError,
                 id="state-rows"),
    pytest.param(_cu_bad([0, 1, 4], device="meta"), 2, 1, r"cu_seqlens is on meta but \w is on", ValueError,
                 id="device"),
]


@pytest.mark.parametrize("op", ["chunk", "chunk-reference", "conv", "conv-reference"])
@pytest.mark.parametrize("cu, rows, B, match, error", CU_SEQLENS_ERRORS)
def test_cu_seqlens_errors(op, cu, rows, B, match, error):
    """The same checks, naming cu_seqlens (or the state), on both ops and both backends."""
    if isinstance(cu, torch.Tensor) and cu.device.type != "meta":
        cu = cu.to(runtime.DEVICE)
    if op.startswith("chunk"):
        q, k, v, g, beta, _ = make_inputs(B, 4, 2, 4, 16, 16)
        h0 = torch.zeros(rows, 4, 16, 16, device=runtime.DEVICE)
        fn = deltanet.chunk_gated_delta_rule if op == "chunk" else reference.chunk_gated_delta_rule
        args = (q, k, v, g, beta, None, h0)
    else:
        x, w = torch.zeros(B, 4, 8, device=runtime.DEVICE), torch.zeros(8, 4, device=runtime.DEVICE)
        fn = deltanet.causal_conv1d if op == "conv" else reference.causal_conv1d
        args = (x, w, torch.zeros(rows, 8, 3, device=runtime.DEVICE))
    with pytest.raises(error, match=match):
        fn(*args, cu_seqlens=cu)


def test_cu_seqlens_out_state_rows():
    q, k, v, g, beta, h0, cu = _packed_rule_inputs([1, 3], FP32, True)
    with pytest.raises(ValueError, match=r"out_state must have shape \[N, HV, K, V\] \(one row per sequence of "
                                         r"cu_seqlens\) = \(2, 4, 16, 16\), found \(1, 4, 16, 16\)"):
        deltanet.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, out_state=h0[:1].clone(), cu_seqlens=cu)


# ---------------------------------------------------------------------------------------------------------------
# 7. errors a user can act on


def _rule_args(**over):
    q, k, v, g, beta, h0 = make_inputs(1, 4, 2, 4, 32, 32)
    args = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0)
    args.update(over)
    return args


def _bad(**over):
    return lambda: _rule_args(**over)


RULE_ERRORS = [
    pytest.param(_bad(q=torch.zeros(4, 2, 32)), "q must be 4-D", id="q-3d"),
    pytest.param(_bad(k=torch.zeros(1, 4, 2, 16)), r"k must have shape", id="k-shape"),
    pytest.param(_bad(v=torch.zeros(1, 5, 4, 32)), r"v must have shape \[B, T, HV, V\]", id="v-length"),
    pytest.param(_bad(v=torch.zeros(1, 4, 3, 32)), "HV=3 value heads, which is not a multiple of the H=2",
                 id="hv-not-multiple"),
    pytest.param(_bad(q=torch.zeros(1, 4, 2, 512), k=torch.zeros(1, 4, 2, 512)), "head dim K=512 is unsupported",
                 id="k-dim"),
    pytest.param(_bad(v=torch.zeros(1, 4, 4, 320)), "head dim V=320 is unsupported", id="v-dim"),
    pytest.param(_bad(q=torch.zeros(1, 4, 2, 32, dtype=torch.int32)), "q has dtype torch.int32", id="q-int"),
    pytest.param(_bad(q=[[0.0]]), "q must be a torch.Tensor, got list", id="q-list"),
    pytest.param(_bad(v=torch.zeros(1, 4, 4, 32, dtype=torch.float16)), "v has dtype torch.float16 but q has",
                 id="v-dtype"),
    pytest.param(_bad(g=torch.zeros(1, 4, 4, dtype=torch.int64)), "g has dtype torch.int64", id="g-int"),
    pytest.param(_bad(g=torch.zeros(1, 4, 2)), r"g must have shape \[B, T, HV\] = \(1, 4, 4\), found \(1, 4, 2\)",
                 id="g-shape"),
    pytest.param(_bad(beta=torch.zeros(4, 4)), r"beta must have shape \[B, T, HV\]", id="beta-shape"),
    pytest.param(_bad(initial_state=torch.zeros(1, 4, 32, 32, dtype=BF16)), "the recurrent state is always float32",
                 id="state-bf16"),
    pytest.param(_bad(initial_state=torch.zeros(1, 2, 32, 32)), r"initial_state must have shape \[B, HV, K, V\]",
                 id="state-shape"),
    pytest.param(_bad(out_state=torch.zeros(1, 4, 32, 32).transpose(2, 3)), "out_state must be contiguous",
                 id="out-state-strided"),
]


#: Wrong types and dtypes raise TypeError, wrong shapes, values and devices ValueError (the project's convention).
TYPE_ERRORS = {"q-int", "q-list", "v-dtype", "g-int", "state-bf16"}


@pytest.mark.parametrize("fn", [deltanet.chunk_gated_delta_rule, deltanet.recurrent_gated_delta_rule,
                                reference.chunk_gated_delta_rule], ids=["chunk", "recurrent", "reference"])
@pytest.mark.parametrize("make_args, match, error",
                         [pytest.param(*p.values, TypeError if p.id in TYPE_ERRORS else ValueError, id=p.id)
                          for p in RULE_ERRORS])
def test_delta_rule_errors(fn, make_args, match, error):
    args = make_args()
    args = {n: (t.to(runtime.DEVICE) if isinstance(t, torch.Tensor) else t) for n, t in args.items()}
    with pytest.raises(error, match=match):
        fn(**args)


def test_scale_and_gate_errors():
    args = _rule_args()
    with pytest.raises(ValueError, match="scale must be a positive"):
        deltanet.chunk_gated_delta_rule(**args, scale=-1.0)
    with pytest.raises(TypeError, match="scale must be a positive finite Python number or None .* got Tensor"):
        deltanet.chunk_gated_delta_rule(**args, scale=torch.tensor(0.1))
    q, k, v = args["q"], args["k"], args["v"]
    a = torch.zeros(1, 4, 4, device=runtime.DEVICE)
    with pytest.raises(ValueError, match=r"A_log must have shape \[HV\] = \(4,\), found \(2,\)"):
        deltanet.recurrent_gated_delta_rule_gates(q, k, v, torch.zeros(2, device=runtime.DEVICE), a,
                                                  torch.zeros(4, device=runtime.DEVICE), a)


def test_wrong_device():
    """Tensors the kernels cannot reach (here on the meta device) are refused by name before any launch."""
    args = {n: t.to("meta") for n, t in _rule_args().items()}
    with pytest.raises(ValueError, match="q is on meta"):
        deltanet.chunk_gated_delta_rule(**args)
    args["k"] = torch.zeros(args["k"].shape, device=runtime.DEVICE)
    with pytest.raises(ValueError, match="k is on .* but q is on meta"):
        deltanet.recurrent_gated_delta_rule(**args)
    with pytest.raises(ValueError, match="x is on meta"):
        deltanet.causal_conv1d(torch.zeros(1, 4, 8, device="meta"), torch.zeros(8, 4, device="meta"))


def test_conv_and_norm_errors(device):
    x, w = torch.zeros(1, 4, 8, device=device), torch.zeros(8, 4, device=device)
    cases = [
        (lambda: deltanet.causal_conv1d(x[0], w), r"x must be 3-D \[B, T, C\]"),
        (lambda: deltanet.causal_conv1d(x, w[:, None]), r"weight must be 2-D \[C, W\].*squeeze\(1\)"),
        (lambda: deltanet.causal_conv1d(x, w[:, :1]), "conv width W=1"),
        (lambda: deltanet.causal_conv1d(x, w, torch.zeros(1, 8, 2, device=device)), r"S >= 3"),
        (lambda: deltanet.causal_conv1d(x, w, torch.zeros(1, 8, 3, device=device, dtype=BF16)),
         "initial_state has dtype torch.bfloat16 but x has torch.float32", TypeError),
        (lambda: deltanet.causal_conv1d(x.to(torch.int32), w), "x has dtype torch.int32", TypeError),
        (lambda: deltanet.causal_conv1d_update(x[:, 0], torch.zeros(1, 8, 3, device=device, dtype=BF16), w),
         "conv_state has dtype torch.bfloat16 but x has torch.float32", TypeError),
        (lambda: deltanet.causal_conv1d_update(x, torch.zeros(1, 8, 3, device=device), w), r"x must be 2-D \[B, C\]"),
        (lambda: deltanet.causal_conv1d_update(x[:, 0], torch.zeros(1, 8, 2, device=device), w),
         r"conv_state must have shape \[B, C, S\]"),
        (lambda: deltanet.gated_rmsnorm(x, x[:, :2], w[:, 0]), r"z must have shape"),
        (lambda: deltanet.gated_rmsnorm(x, x, w), r"weight must have shape \[D\] = \(8,\)"),
        (lambda: deltanet.gated_rmsnorm(x, x, w[:, 0], eps="1e-6"), "eps must be a positive finite Python number",
         TypeError),
    ]
    for call, match, *error in cases:
        with pytest.raises(error[0] if error else ValueError, match=match):
            call()


@pytest.mark.parametrize("fn", [deltanet.gated_rmsnorm, reference.gated_rmsnorm], ids=["kernel", "reference"])
def test_gated_rmsnorm_needs_positive_eps(fn, device):
    """eps = 0 divides an all-zero row by sqrt(0): NaN. Both backends refuse it; a positive eps keeps such a row 0."""
    x = torch.zeros(2, 16, device=device)
    z, w = torch.ones(2, 16, device=device), torch.ones(16, device=device)
    for eps in (0, 0.0, -1e-6, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"eps must be a positive finite Python number .* got "):
            fn(x, z, w, eps)
    assert (fn(x, z, w, 1e-6) == 0).all()


# ---------------------------------------------------------------------------------------------------------------
# 8. GPU-only checks


@pytest.mark.gpu
def test_gpu_qwen35_prefill_accuracy():
    """Qwen3.5 shapes compiled: B=1, 16 QK heads, 32 V heads, d 128, T=4096, bf16 in, fp32 reference."""
    q, k, v, g, beta, h0 = make_inputs(1, 4096, 16, 32, 128, 128, BF16)
    o, ht = deltanet.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                            use_qk_l2norm=True)
    o_ref, ht_ref = reference.chunk_gated_delta_rule(q.float(), k.float(), v.float(), g, beta, None, h0, True, True)
    m = compare(o, o_ref, baseline=o_ref.to(BF16))
    assert m.err_ratio <= 4.0, m                                   # bf16 dot operands; H200 bench T4096: 2.46
    m = compare(ht, ht_ref, baseline=ht_ref.to(BF16))
    assert m.err_ratio <= 4.0, m                                   # the state, against one bf16 rounding of it


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 8, 32])
def test_gpu_decode_step(B):
    q, k, v, _, _, h0 = make_inputs(B, 1, 16, 32, 128, 128, BF16)
    a, b = torch.randn(B, 1, 32, device="cuda"), torch.randn(B, 1, 32, device="cuda")
    A_log, dt_bias = torch.rand(32, device="cuda"), torch.randn(32, device="cuda")
    state = h0.clone()
    o, _ = deltanet.recurrent_gated_delta_rule_gates(q, k, v, A_log, a, dt_bias, b, initial_state=state,
                                                     use_qk_l2norm=True, out_state=state)
    o_ref, s_ref = reference.recurrent_gated_delta_rule_gates(q.float(), k.float(), v.float(), A_log, a, dt_bias,
                                                              b, None, h0, True, True)
    m = compare(o, o_ref, baseline=o_ref.to(BF16))                 # all fp32, one rounding: H200 bench 1.00000001
    assert m.err_ratio <= 1.05, m
    m = compare(state, s_ref)
    assert m.rel_l2 <= 2e-6, m                                      # H200 lynn check (d 32): 5.9e-8


@pytest.mark.parametrize("op", ["chunk_gated_delta_rule", "recurrent_gated_delta_rule"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_reference_output_has_v_dtype(op, dtype):
    """The references return o in v's dtype, as the kernels do (they once returned fp32 for 16-bit inputs)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 9, 2, 16, generator=g).to(dtype)
    v = torch.randn(1, 9, 4, 16, generator=g).to(dtype)
    decay, beta = -torch.rand(1, 9, 4, generator=g), torch.rand(1, 9, 4, generator=g)
    o, _ = getattr(reference, op)(q, q, v, decay, beta)
    assert o.dtype == dtype and o.shape == v.shape
