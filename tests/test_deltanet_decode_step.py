"""The fused Gated DeltaNet decode step (``deltanet.gated_delta_decode``: conv update, gates, delta rule, gated
norm in one kernel) against its reference and against the three-kernel chain it replaces, on awkward shapes, over
consecutive steps, with strided views of fused projections; and its errors. The sweep against the reference is the
family's check matrix (lynn_kernels/deltanet/check.py: ``STEP_SHAPES``).

Under the interpreter the fused kernel gives the chain's bits (output, recurrent state and conv state). On the GPU
its reductions run over a wider tile than the recurrent kernel's, so the output and state are compared with the
shared metrics there; the conv state (raw inputs moved along) is bit-exact everywhere.
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_case_passes, check_cases

from lynn_kernels import deltanet, runtime, use_reference
from lynn_kernels.metrics import bit_mismatches, compare

BF16 = torch.bfloat16
DEV = runtime.DEVICE


def _layer(B, H, HV, K, V, W=4, S=3, dtype=BF16, seed=0, fused=False):
    """A decode step's inputs. ``fused``: qkv, z, a and b are strided views of one projection output
    ``[B, C + HV V + 2 HV]``, as the decoder's fused ``in_proj_qkvz`` / ``in_proj_ba`` give them."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(shape, generator=gen) * scale)

    C = 2 * H * K + HV * V
    if fused:
        big = randn(B, C + HV * V + 2 * HV).to(dtype).to(DEV)
        qkv, z = big[:, :C], big[:, C:C + HV * V].view(B, HV, V)
        a, b = big[:, C + HV * V:C + HV * V + HV], big[:, C + HV * V + HV:]
    else:
        qkv, z = randn(B, C).to(dtype).to(DEV), randn(B, HV, V).to(dtype).to(DEV)
        a, b = randn(B, HV).to(dtype).to(DEV), randn(B, HV).to(dtype).to(DEV)
    return dict(qkv=qkv, z=z, a=a, b=b, conv_state=randn(B, C, S).to(dtype).to(DEV),
                conv_weight=randn(C, W, scale=0.4).to(DEV), A_log=randn(HV).to(DEV), dt_bias=randn(HV).to(DEV),
                state=randn(B, HV, K, V, scale=0.1).to(DEV), norm_weight=(randn(V).abs() + 0.5).to(dtype).to(DEV),
                num_k_heads=H)


def _clone(inp):
    return {k: (v.clone() if k in ("conv_state", "state") else v) for k, v in inp.items()}


def _chain(qkv, z, a, b, conv_state, conv_weight, A_log, dt_bias, state, norm_weight, num_k_heads, eps=1e-6):
    """The three launches the fused kernel replaces, as the decoder ran them."""
    B, H = qkv.shape[0], num_k_heads
    HV, K, V = state.shape[1:]
    y = deltanet.causal_conv1d_update(qkv, conv_state, conv_weight)
    q, k = y[:, :H * K].reshape(B, 1, H, K), y[:, H * K:2 * H * K].reshape(B, 1, H, K)
    v = y[:, 2 * H * K:].reshape(B, 1, HV, V)
    o, _ = deltanet.recurrent_gated_delta_rule_gates(q, k, v, A_log, a[:, None], dt_bias, b[:, None],
                                                     initial_state=state, use_qk_l2norm=True, out_state=state)
    return deltanet.gated_rmsnorm(o[:, 0], z, norm_weight, eps)


@pytest.mark.parametrize("case", check_cases("deltanet", "deltanet.decode step"))
def test_decode_step_matches_reference(case, poison_empty):
    """Two consecutive steps (the states carried), with the gates given or projected in the kernel: the outputs and
    the recurrent state close to the reference's, the conv state bit-exact."""
    assert_case_passes(case)


def test_decode_step_gives_the_chains_bits(poison_empty):
    """Two consecutive steps on odd head dims, a group of 3 value heads and a conv of width 2: the chain's output and
    recurrent state (its bits under the interpreter), its conv state bit for bit."""
    inp = _layer(3, 1, 3, 24, 40, W=2, S=1, seed=21)
    fused, chain = _clone(inp), _clone(inp)
    for step in range(2):
        if step:                                     # a new token's projections, the states as they are
            new = _layer(3, 1, 3, 24, 40, W=2, S=1, seed=22)
            for d in (fused, chain):
                d.update(qkv=new["qkv"], z=new["z"], a=new["a"], b=new["b"])
        got, via = deltanet.gated_delta_decode(**fused), _chain(**chain)
        if runtime.INTERPRET:
            assert bit_mismatches(got, via) == 0 and bit_mismatches(fused["state"], chain["state"]) == 0, step
        else:
            assert compare(got, via).rel_l2 < 1e-2 and compare(fused["state"], chain["state"]).rel_l2 < 1e-5, step
        assert bit_mismatches(fused["conv_state"], chain["conv_state"]) == 0


def test_decode_step_takes_views_of_fused_projections(poison_empty):
    """qkv, z, a and b as strided views of one projection output (no copy in the decoder)."""
    inp = _layer(2, 2, 4, 32, 32, fused=True, seed=5)
    assert not inp["z"].is_contiguous() and inp["a"].stride(0) != inp["a"].shape[1]
    fused, chain = _clone(inp), _clone(inp)
    got, via = deltanet.gated_delta_decode(**fused), _chain(**chain)
    assert compare(got, via).rel_l2 < 1e-2
    if runtime.INTERPRET:
        assert bit_mismatches(got, via) == 0
    assert bit_mismatches(fused["conv_state"], chain["conv_state"]) == 0


def test_decode_step_gates_keep_their_own_dtypes(poison_empty):
    """``a`` bf16 and ``b`` fp32 (any float dtype each): each read at its own precision, as the reference and the
    recurrent kernel do (a cast of ``b`` to ``a``'s dtype moved the state by ~7e-5)."""
    inp = _layer(2, 2, 4, 32, 32, seed=11)
    inp["b"] = torch.randn(2, 4, generator=torch.Generator().manual_seed(12)).to(DEV)          # fp32
    fused, ref, chain = _clone(inp), _clone(inp), _clone(inp)
    got, want, via = deltanet.gated_delta_decode(**fused), deltanet.reference.gated_delta_decode(**ref), _chain(**chain)
    assert compare(fused["state"], ref["state"]).rel_l2 < 1e-5
    assert compare(got, want).rel_l2 < 2e-2
    if runtime.INTERPRET:
        assert bit_mismatches(got, via) == 0 and bit_mismatches(fused["state"], chain["state"]) == 0


def test_decode_step_ticket_limit_is_named(monkeypatch):
    """The kernel keeps one ticket per sequence and key head where value heads share them: past the per-stream
    buffer it says so (and writes nothing) instead of failing in the matmul's split-K words."""
    from lynn_kernels.deltanet import triton_decode_step

    monkeypatch.setattr(triton_decode_step, "COUNTER_SLOTS", 3)
    d = _layer(2, 2, 4, 16, 16, seed=13)
    before = d["state"].clone()
    with pytest.raises(ValueError, match=r"B=2 sequences of 2 key heads .* at most 3 \(B <= 1\)"):
        deltanet.gated_delta_decode(**d)
    assert torch.equal(d["state"], before)
    d1 = _layer(1, 2, 4, 16, 16, seed=14)                     # 1 x 2 tickets: within the (patched) limit
    deltanet.gated_delta_decode(**d1)


def test_decode_step_reference_backend():
    """Under ``use_reference()`` the op is the composition of the three references."""
    inp = _layer(1, 2, 4, 16, 16, seed=9)
    a, b = _clone(inp), _clone(inp)
    with use_reference():
        got = deltanet.gated_delta_decode(**a)
    want = deltanet.reference.gated_delta_decode(**b)
    assert bit_mismatches(got, want) == 0 and bit_mismatches(a["state"], b["state"]) == 0


@pytest.mark.parametrize("change, exc, match", [
    pytest.param(lambda d: d.update(qkv=d["qkv"][:, :-1]), ValueError, r"qkv has C=127 channels", id="C"),
    pytest.param(lambda d: d.update(conv_state=d["conv_state"][:1, :, :2]), ValueError,
                 r"conv_state must have shape \[B, C, S\]", id="conv-state"),
    pytest.param(lambda d: d.update(num_k_heads=4), ValueError, r"qkv has C=128 channels; expected 2 H K \+ HV V",
                 id="heads"),
    pytest.param(lambda d: d.update(num_k_heads=True), TypeError, r"num_k_heads must be a positive int", id="bool"),
    pytest.param(lambda d: d.update(num_k_heads=0), ValueError, r"num_k_heads must be a positive int", id="zero"),
    pytest.param(lambda d: d.update(state=d["state"].transpose(2, 3).contiguous().transpose(2, 3)), ValueError,
                 r"state must be contiguous", id="state-strided"),
    pytest.param(lambda d: d.update(state=d["state"].to(BF16)), TypeError, r"state has dtype .* float32",
                 id="state-bf16"),
    pytest.param(lambda d: d.update(z=d["z"][:, :, :-1]), ValueError, r"z must have shape \[B, HV, V\]", id="z"),
    pytest.param(lambda d: d.update(z=d["z"].float()), TypeError, r"z has dtype torch.float32 but qkv", id="z-dtype"),
    pytest.param(lambda d: d.update(a=d["a"][:, None]), ValueError, r"a must have shape \[B, HV\]", id="a-3d"),
    pytest.param(lambda d: d.update(b=d["b"][:, :-1]), ValueError, r"b must have shape \[B, HV\]", id="b-shape"),
    pytest.param(lambda d: d.update(norm_weight=d["norm_weight"][:-1]), ValueError,
                 r"norm_weight must have shape \[V\]", id="norm-weight"),
    pytest.param(lambda d: d.update(eps=0.0), ValueError, r"eps must be a positive", id="eps"),
    pytest.param(lambda d: d.update(x=torch.zeros(1, 8, device=DEV), a_weight=torch.zeros(4, 8, device=DEV),
                                    b_weight=torch.zeros(4, 8, device=DEV)), ValueError,
                 r"pass either a and b .* or x, a_weight and b_weight", id="gates-twice"),
    pytest.param(lambda d: d.update(a=None, b=None, x=torch.zeros(1, 8, device=DEV),
                                    a_weight=torch.zeros(4, 8, device=DEV)), TypeError,
                 r"b_weight must be a torch.Tensor", id="b-weight-missing"),
    pytest.param(lambda d: d.update(a=None, b=None, x=torch.zeros(2, 8, device=DEV),
                                    a_weight=torch.zeros(4, 8, device=DEV), b_weight=torch.zeros(4, 8, device=DEV)),
                 ValueError, r"x must have shape \[B, HD\] with B=1", id="x-rows"),
    pytest.param(lambda d: d.update(a=None, b=None, x=torch.zeros(1, 8, device=DEV),
                                    a_weight=torch.zeros(4, 9, device=DEV), b_weight=torch.zeros(4, 8, device=DEV)),
                 ValueError, r"a_weight must have shape \[HV, HD\]", id="a-weight-shape"),
    pytest.param(lambda d: d.update(a=None, b=None, x=torch.zeros(1, 8, device=DEV),
                                    a_weight=torch.zeros(4, 8, device=DEV),
                                    b_weight=torch.zeros(4, 8, device=DEV, dtype=BF16)),
                 TypeError, r"b_weight has dtype torch.bfloat16 but x has torch.float32", id="b-weight-dtype"),
])
@pytest.mark.parametrize("backend", ["kernel", "reference"])
def test_decode_step_bad_inputs(change, exc, match, backend):
    """Each bad argument is named, on both backends, and nothing is written."""
    d = _layer(1, 2, 4, 16, 16, seed=3)
    d["eps"] = 1e-6
    change(d)
    before = (d["conv_state"].clone(), d["state"].clone())
    with use_reference(backend == "reference"), pytest.raises(exc, match=match):
        deltanet.gated_delta_decode(**d)
    assert torch.equal(d["conv_state"], before[0]) and torch.equal(d["state"], before[1])


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 8])
@pytest.mark.parametrize("pdl", [False, True])
def test_gpu_decode_step_real_shapes(B, pdl):
    """The Qwen3.5 / Qwen3-Next layer (16 key heads, 32 value heads of 128) on the H200: against the chain over
    4 steps, with and without programmatic dependent launch, and the same bits on a repeat; with PDL the first
    call loads its states before its wait (``states_early``: the launch before it is the chain's, made without
    PDL), the repeat after it."""
    inp = _layer(B, 16, 32, 128, 128, seed=B)
    fused, chain, again = _clone(inp), _clone(inp), _clone(inp)
    for step in range(4):
        with runtime.programmatic_launches(pdl):
            got = deltanet.gated_delta_decode(**fused, states_early=True)
            rep = deltanet.gated_delta_decode(**again)
        via = _chain(**chain)
        assert bit_mismatches(got, rep) == 0 and bit_mismatches(fused["state"], again["state"]) == 0
        assert compare(got, via).rel_l2 < 1e-2, step
        assert compare(fused["state"], chain["state"]).rel_l2 < 1e-5
        assert bit_mismatches(fused["conv_state"], chain["conv_state"]) == 0
