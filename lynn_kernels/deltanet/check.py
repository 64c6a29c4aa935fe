"""``lynn check`` rows for Gated DeltaNet: each kernel against the fp32 reference on small, awkward cases.

Rows are ``{"op", "case", "metrics": Metrics, "passed": bool}``. ``err_ratio`` holds the kernel's error over the
error of the exact (fp32 reference) answer rounded to the output dtype: about 1 means "as good as a bf16 output can
be". Each row has its own bound, a small multiple of what it measures (H200 / interpreter, in ``BOUNDS``): only the
chunked rule feeds bf16 operands to ``tl.dot`` on the GPU (fp32 under the interpreter); every other path is fp32.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from .. import runtime
from ..metrics import Case, compare

#: The op names this family's rows carry, as the table prints them (``lynn check`` accepts them before running).
OPS = (
    "deltanet.chunk", "deltanet.chunk state", "deltanet.recurrent", "deltanet.recurrent state", "deltanet.conv",
    "deltanet.conv state", "deltanet.conv update", "deltanet.gated_rmsnorm", "deltanet.decode step",
    "deltanet.decode step state",
)


def _inputs(B, T, H, HV, K, V, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(shape, generator=gen)

    dev = runtime.DEVICE
    q, k = randn(B, T, H, K).to(dtype).to(dev), randn(B, T, H, K).to(dtype).to(dev)
    v = randn(B, T, HV, V).to(dtype).to(dev)
    g = F.logsigmoid(randn(B, T, HV) + 2.0).to(dev)                     # decays in (0, 1), most near 1
    beta = torch.sigmoid(randn(B, T, HV)).to(dev)
    h0 = (randn(B, HV, K, V) * 0.1).to(dev)
    return q, k, v, g, beta, h0


#: (row, dtype) -> ("err_ratio" | "rel_l2", bound). err_ratio: over the exact answer rounded once to bf16 (for the
#: fp32 chunk state too: bf16 dot operands put it about where one bf16 rounding of it is). Measured, H200 / interp:
BOUNDS = {
    ("deltanet.chunk", "bf16"): ("err_ratio", 4.0),              # 2.54 / 1.0
    ("deltanet.chunk state", "bf16"): ("err_ratio", 4.0),        # 2.9e-3 = 1.8x / 3.1e-7
    ("deltanet.recurrent", "bf16"): ("err_ratio", 1.05),         # 1.0 / 1.0
    ("deltanet.recurrent state", "bf16"): ("rel_l2", 1e-6),      # 5.9e-8 / 5.8e-8
    ("deltanet.conv", "bf16"): ("err_ratio", 1.05),              # 1.0 / 1.0
    ("deltanet.conv update", "bf16"): ("err_ratio", 1.05),       # 1.0 / 1.0
    ("deltanet.gated_rmsnorm", "bf16"): ("rel_l2", 2e-4),        # 0 / 0 (one flipped rounding would be ~1e-4)
    ("deltanet.chunk", "fp32"): ("rel_l2", 2e-6),                # 3.6e-7 / 3.2e-7
    ("deltanet.chunk state", "fp32"): ("rel_l2", 2e-6),          # 2.6e-7 / 2.9e-7
    ("deltanet.recurrent", "fp32"): ("rel_l2", 1e-6),            # 1.1e-7 / 1.5e-7
    ("deltanet.recurrent state", "fp32"): ("rel_l2", 1e-6),      # 7.1e-8 / 8.3e-8
    ("deltanet.conv", "fp32"): ("rel_l2", 1e-6),                 # 7.0e-8 / 3.8e-8
    ("deltanet.conv update", "fp32"): ("rel_l2", 1e-6),          # 7.7e-8 / 3.8e-8
    ("deltanet.gated_rmsnorm", "fp32"): ("rel_l2", 1e-6),        # 8.0e-8 / 8.7e-8
    # the fused decode step against its reference on the same (bf16) inputs: the conv output and the delta rule's
    # output are rounded to bf16 in the middle, as the chain stores them, so a fp32 reference would not be the
    # spec. Interpreter, output bf16 / fp32: 0 / 1.6e-7 (2.4e-7 with the gates projected in the kernel), state
    # 5.6e-8 / 9.3e-8 (8.6e-8 / 1.2e-7); H200: not yet measured (bounds of a few flipped bf16 roundings)
    ("deltanet.decode step", "bf16"): ("rel_l2", 5e-3),
    ("deltanet.decode step state", "bf16"): ("rel_l2", 1e-5),
    ("deltanet.decode step", "fp32"): ("rel_l2", 1e-6),
    ("deltanet.decode step state", "fp32"): ("rel_l2", 1e-6),
}


def _row(op: str, case: str, got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> dict:
    """``got`` against the fp32 ``want`` under the row's bound in ``BOUNDS`` (``dtype``: the inputs')."""
    kind, bound = BOUNDS[(op, "fp32" if dtype == torch.float32 else "bf16")]
    m = compare(got, want, baseline=want.to(torch.bfloat16) if kind == "err_ratio" else None)
    return {"op": op, "case": case, "metrics": m, "passed": (m.err_ratio if kind == "err_ratio" else m.rel_l2) <= bound}


def _chunk(dtype: torch.dtype, case: str) -> list[dict]:
    """Prefill: T=65 (a chunk and one token), GQA 2, l2norm, an initial state."""
    from . import chunk_gated_delta_rule, reference

    q, k, v, g, beta, h0 = _inputs(1, 65, 1, 2, 32, 32, dtype)
    o, ht = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm=True)
    o_ref, ht_ref = reference.recurrent_gated_delta_rule(q.float(), k.float(), v.float(), g, beta,
                                                         initial_state=h0, output_final_state=True,
                                                         use_qk_l2norm=True)
    return [_row("deltanet.chunk", case, o, o_ref, dtype), _row("deltanet.chunk state", case, ht, ht_ref, dtype)]


def _recurrent(dtype: torch.dtype, case: str) -> list[dict]:
    """A decode step with the gates in the kernel: B=2, T=1."""
    from . import recurrent_gated_delta_rule_gates, reference

    q, k, v, _, _, h0 = _inputs(2, 1, 2, 4, 32, 32, dtype, seed=1)
    gen = torch.Generator().manual_seed(2)
    a = torch.randn(2, 1, 4, generator=gen).to(runtime.DEVICE)
    b = torch.randn(2, 1, 4, generator=gen).to(runtime.DEVICE)
    A_log = torch.rand(4, generator=gen).to(runtime.DEVICE)
    dt_bias = torch.randn(4, generator=gen).to(runtime.DEVICE)
    o, ht = recurrent_gated_delta_rule_gates(q, k, v, A_log, a, dt_bias, b, initial_state=h0,
                                             output_final_state=True, use_qk_l2norm=True)
    o_ref, ht_ref = reference.recurrent_gated_delta_rule_gates(
        q.float(), k.float(), v.float(), A_log, a, dt_bias, b, initial_state=h0, output_final_state=True,
        use_qk_l2norm=True)
    return [_row("deltanet.recurrent", case, o, o_ref, dtype),
            _row("deltanet.recurrent state", case, ht, ht_ref, dtype)]


def _conv(dtype: torch.dtype, case: str, gen: torch.Generator) -> list[dict]:
    """The conv prefill (with a state), then one decode step."""
    from . import causal_conv1d, causal_conv1d_update, reference

    x = torch.randn(2, 37, 96, generator=gen).to(dtype).to(runtime.DEVICE)
    w = torch.randn(96, 4, generator=gen).to(dtype).to(runtime.DEVICE)
    s0 = torch.randn(2, 96, 3, generator=gen).to(dtype).to(runtime.DEVICE)
    y, s1 = causal_conv1d(x, w, s0)
    y_ref, s1_ref = reference.causal_conv1d(x.float(), w.float(), s0.float())
    rows = [_row("deltanet.conv", case, y, y_ref, dtype)]
    state_same = bool(torch.equal(s1.float(), s1_ref))
    rows.append({"op": "deltanet.conv state", "case": case, "mismatches": int((s1.float() != s1_ref).sum()),
                 "passed": state_same})
    x1 = torch.randn(2, 96, generator=gen).to(dtype).to(runtime.DEVICE)
    s_ref = s1.float().clone()
    y1 = causal_conv1d_update(x1, s1, w)
    rows.append(_row("deltanet.conv update", case, y1, reference.causal_conv1d_update(x1.float(), s_ref, w.float()),
                     dtype))
    return rows


def _gated_rmsnorm(dtype: torch.dtype, case: str, gen: torch.Generator) -> list[dict]:
    """The gated RMSNorm over head_dim 128."""
    from . import gated_rmsnorm, reference

    xn = torch.randn(5, 3, 128, generator=gen).to(dtype).to(runtime.DEVICE)
    zn = torch.randn(5, 3, 128, generator=gen).to(dtype).to(runtime.DEVICE)
    wn = (1 + 0.1 * torch.randn(128, generator=gen)).to(runtime.DEVICE)
    want = reference.gated_rmsnorm(xn, zn, wn).float()              # the spec rounds as HF does, in x's dtype
    return [_row("deltanet.gated_rmsnorm", case, gated_rmsnorm(xn, zn, wn), want, dtype)]


#: The fused decode step's shape: B=2, H=2, HV=4, K=V=32.
_STEP = (2, 2, 4, 32, 32)


def _step_setup(dtype: torch.dtype, gen: torch.Generator) -> dict:
    """The fused decode step's weights and its starting conv / recurrent states: ``mine`` (the kernel's) and
    ``theirs`` (the reference's) are the same copies, both carried from one case to the next."""
    B, H, HV, K, V = _STEP
    C = 2 * H * K + HV * V
    dev = runtime.DEVICE
    conv = torch.randn(B, C, 3, generator=gen).to(dtype).to(dev)
    state = (0.1 * torch.randn(B, HV, K, V, generator=gen)).to(dev)
    cw = (0.4 * torch.randn(C, 4, generator=gen)).to(dev)
    A_log, dt_bias = torch.randn(HV, generator=gen).to(dev), torch.randn(HV, generator=gen).to(dev)
    nw = (1 + 0.1 * torch.randn(V, generator=gen)).to(dev)
    return {"C": C, "cw": cw, "A_log": A_log, "dt_bias": dt_bias, "nw": nw,
            "mine": (conv.clone(), state.clone()), "theirs": (conv.clone(), state.clone())}


def _decode_step(dtype: torch.dtype, case: str, st: dict, gen: torch.Generator) -> list[dict]:
    """The fused decode step (conv update, gates, delta rule, gated norm), two steps."""
    from . import gated_delta_decode, reference

    B, H, HV, K, V = _STEP
    dev = runtime.DEVICE
    C, cw, A_log, dt_bias, nw, mine, theirs = (st[n] for n in ("C", "cw", "A_log", "dt_bias", "nw", "mine", "theirs"))
    for _ in range(2):
        qkv = torch.randn(B, C, generator=gen).to(dtype).to(dev)
        z = torch.randn(B, HV, V, generator=gen).to(dtype).to(dev)
        a = torch.randn(B, HV, generator=gen).to(dtype).to(dev)
        b = torch.randn(B, HV, generator=gen).to(dtype).to(dev)
        o = gated_delta_decode(qkv, z, a, b, mine[0], cw, A_log, dt_bias, mine[1], nw, H)
        o_ref = reference.gated_delta_decode(qkv, z, a, b, theirs[0], cw, A_log, dt_bias, theirs[1], nw, H)
    return [_row("deltanet.decode step", case, o, o_ref.float(), dtype),
            _row("deltanet.decode step state", case, mine[1], theirs[1], dtype)]


def _decode_step_projected(dtype: torch.dtype, case: str, st: dict, gen: torch.Generator) -> list[dict]:
    """The same step with the gates' projections in the kernel (the layer input, in_proj_a / in_proj_b of 64), two
    more steps from the states :func:`_decode_step` left."""
    from . import gated_delta_decode, reference

    B, H, HV, K, V = _STEP
    dev = runtime.DEVICE
    C, cw, A_log, dt_bias, nw, mine, theirs = (st[n] for n in ("C", "cw", "A_log", "dt_bias", "nw", "mine", "theirs"))
    w_a, w_b = ((0.125 * torch.randn(HV, 64, generator=gen)).to(dtype).to(dev) for _ in range(2))
    for _ in range(2):
        qkv = torch.randn(B, C, generator=gen).to(dtype).to(dev)
        z = torch.randn(B, HV, V, generator=gen).to(dtype).to(dev)
        x = torch.randn(B, 64, generator=gen).to(dtype).to(dev)
        o = gated_delta_decode(qkv, z, None, None, mine[0], cw, A_log, dt_bias, mine[1], nw, H, x=x,
                               a_weight=w_a, b_weight=w_b)
        o_ref = reference.gated_delta_decode(qkv, z, None, None, theirs[0], cw, A_log, dt_bias, theirs[1], nw, H,
                                             x=x, a_weight=w_a, b_weight=w_b)
    return [_row("deltanet.decode step", case, o, o_ref.float(), dtype),
            _row("deltanet.decode step state", case, mine[1], theirs[1], dtype)]


def cases() -> Iterator[Case]:
    """The family's check matrix, each case named before it runs. Per dtype, the chunk and the recurrent cases draw
    from their own seeded generators; the conv case and the ones after it draw in order from one more (the fused
    decode step's weights and states by its first case, which the second continues from)."""
    for dtype in (torch.bfloat16, torch.float32):
        label = str(dtype).replace("torch.", "")
        case = f"{label} B1 T65 H1 HV2 K32 V32"
        yield Case("deltanet.chunk", case, lambda d=dtype, c=case: _chunk(d, c))
        case = f"{label} decode B2 H2 HV4 K32 V32, gates fused"
        yield Case("deltanet.recurrent", case, lambda d=dtype, c=case: _recurrent(d, c))
        gen = torch.Generator().manual_seed(3)
        case = f"{label} B2 T37 C96 W4"
        yield Case("deltanet.conv", case, lambda d=dtype, c=case, g=gen: _conv(d, c, g))
        case = f"{label} 5x3x128"
        yield Case("deltanet.gated_rmsnorm", case, lambda d=dtype, c=case, g=gen: _gated_rmsnorm(d, c, g))
        step = functools.cache(lambda d=dtype, g=gen: _step_setup(d, g))
        case = f"{label} B2 H2 HV4 K32 V32 W4, 2 steps"
        yield Case("deltanet.decode step", case, lambda d=dtype, c=case, s=step, g=gen: _decode_step(d, c, s(), g))
        case = f"{label} B2 H2 HV4 K32 V32 W4 HD64, gates projected, 2 more steps"
        yield Case("deltanet.decode step", case,
                   lambda d=dtype, c=case, s=step, g=gen: _decode_step_projected(d, c, s(), g))


def iter_rows() -> Iterator[dict]:
    for case in cases():
        yield from case.run()


def check_deltanet() -> list[dict]:
    """The family's ``lynn check`` rows as a list (:func:`iter_rows` yields each as it finishes)."""
    return list(iter_rows())


__all__ = ["check_deltanet", "cases"]
