"""``lynn check`` rows for Gated DeltaNet: each kernel against the fp32 reference on small, awkward cases.

Rows are ``{"op", "case", "metrics": Metrics, "passed": bool}`` (bit-exact ones ``"mismatches"`` instead).
``err_ratio`` holds the kernel's error over the error of the exact (fp32 reference) answer rounded to the output
dtype: about 1 means "as good as a bf16 output can be". Each row has its own bound, a small multiple of what it
measures (H200 / interpreter, in ``BOUNDS``): only the chunked rule feeds bf16 operands to ``tl.dot`` on the GPU
(fp32 under the interpreter); every other path is fp32, so a 16-bit output is also held element by element to one
rounding of the answer. The cases are the ``*_SHAPES`` tables below; tests/test_deltanet.py sweeps them too.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from .. import runtime
from ..metrics import Case, bit_mismatches, compare

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

#: The op names this family's rows carry, as the table prints them (``lynn check`` accepts them before running).
OPS = (
    "deltanet.chunk", "deltanet.chunk state", "deltanet.recurrent", "deltanet.recurrent state", "deltanet.conv",
    "deltanet.conv state", "deltanet.conv update", "deltanet.gated_rmsnorm", "deltanet.decode step",
    "deltanet.decode step state", "deltanet.decode step conv state",
)

#: Only compiled does the chunked rule take bf16 dot operands (for bf16 inputs); the interpreter computes in fp32.
_BF16_DOTS = not runtime.INTERPRET

#: (row, dtype) -> ("err_ratio" | "rel_l2", bound). err_ratio: over the exact answer rounded once to bf16 (for the
#: fp32 chunk state too: bf16 dot operands put it about where one bf16 rounding of it is). Measured, H200 / interp:
BOUNDS = {
    ("deltanet.chunk", "bf16"): ("err_ratio", 4.0 if _BF16_DOTS else 1.05),                    # 2.54 / 1.0
    ("deltanet.chunk state", "bf16"): ("err_ratio", 4.0) if _BF16_DOTS else ("rel_l2", 2e-6),  # 1.8x / 3.1e-7
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
    # the fused decode step against its reference on the same (16-bit) inputs: the conv output and the delta rule's
    # output are rounded to the input dtype in the middle, as the chain stores them, so a fp32 reference would not be
    # the spec. Interpreter, output bf16 / fp32: 0 / 1.6e-7 (2.4e-7 with the gates projected in the kernel), state
    # 5.6e-8 / 9.3e-8 (8.6e-8 / 1.2e-7); H200: not yet measured (bounds of a few flipped bf16 roundings)
    ("deltanet.decode step", "bf16"): ("rel_l2", 5e-3),
    ("deltanet.decode step state", "bf16"): ("rel_l2", 1e-5),
    ("deltanet.decode step", "fp32"): ("rel_l2", 1e-6),
    ("deltanet.decode step state", "fp32"): ("rel_l2", 1e-6),
}

#: The chunked rule, one sequence (B = 1, K = V = 32): (dtype, T, H, HV, initial state, use_qk_l2norm).
CHUNK_SHAPES = [
    (BF16, 1, 1, 2, True, True),
    (FP32, 63, 2, 2, False, True),
    (FP32, 64, 1, 2, True, False),
    (BF16, 65, 1, 2, True, True),
    (FP32, 65, 2, 2, True, True),
    (BF16, 150, 1, 2, True, True),
]

#: The chunked rule on packed sequences (cu_seqlens, K = V = 16), each also run alone: (dtype, sequence lengths,
#: H, HV, initial states, use_qk_l2norm). Chunk boundaries inside and across sequences, an empty one, one alone.
PACKED_CHUNK_SHAPES = [
    (BF16, [1, 63, 65, 130], 1, 2, True, True),
    (FP32, [5, 0, 70], 2, 4, True, False),
    (BF16, [100], 1, 2, False, False),
]

#: The token-by-token rule (K = V = 32): (dtype, B, T, H, HV, initial state, use_qk_l2norm).
RECURRENT_SHAPES = [
    (BF16, 1, 1, 1, 2, True, True),
    (FP32, 2, 1, 2, 2, True, False),
    (FP32, 1, 2, 2, 2, False, True),
    (BF16, 1, 65, 2, 2, True, True),
]

#: The decode step with the gates in the kernel, from raw ``a`` spread over [-12, 24] (softplus past 20 and far below
#: 0; not below about -16, where ``1 + e^x`` rounds to 1 and the interpreter warns of the 0 / 0 the kernel's log1p
#: discards) and ``b``, with an initial state and the L2 norm (K = V = 32): (dtype, B, T, H, HV).
GATES_SHAPES = [
    (BF16, 2, 3, 1, 2),
    (FP32, 2, 1, 2, 4),
]

#: The causal conv (prefill, then one update step from its final state): (dtype, B, T, C, W, initial state width
#: S or None).
CONV_SHAPES = [
    (BF16, 2, 1, 40, 2, None),
    (FP32, 2, 63, 40, 2, 1),
    (BF16, 3, 130, 40, 2, 2),
    (FP32, 3, 2, 40, 3, None),
    (BF16, 2, 130, 40, 3, 2),
    (FP32, 2, 1, 40, 3, 3),
    (FP32, 3, 63, 40, 4, None),
    (BF16, 2, 37, 96, 4, 3),
    (FP32, 2, 2, 40, 4, 4),
]

#: The causal conv on packed sequences (C = 40, W = 4), each also run alone: (dtype, sequence lengths, initial state
#: width S or None). A sequence shorter than S keeps part of its initial state.
PACKED_CONV_SHAPES = [
    (BF16, [1, 63, 65, 130], 4),
    (FP32, [5, 0, 70], 3),
    (FP32, [100], None),
    (BF16, [2], 3),
]

#: The gated RMSNorm: (x and z dtype, weight dtype, shape).
NORM_SHAPES = [
    (BF16, BF16, (3, 7, 128)),
    (BF16, FP32, (5, 48)),
    (FP32, BF16, (5, 3, 128)),
    (FP32, FP32, (5, 48)),
]

#: The fused decode step, two steps with the states carried: (dtype, B, H, HV, K, V, W, S, HD: the gates projected
#: in the kernel from an input of HD (None: given)).
STEP_SHAPES = [
    (FP32, 1, 2, 2, 32, 32, 4, 3, None),
    (BF16, 2, 2, 4, 32, 48, 4, 3, None),
    (FP16, 3, 1, 4, 24, 40, 4, 4, None),                         # HF keeps S = W
    (BF16, 2, 2, 6, 16, 16, 2, 1, None),
    (BF16, 1, 2, 4, 32, 32, 4, 3, 96),
    (FP32, 3, 1, 3, 24, 40, 4, 3, 1100),                         # the projection in chunks, the last masked
]

_NAMES = {BF16: "bf16", FP16: "fp16", FP32: "fp32"}


def _seeded(label: str) -> torch.Generator:
    """A generator seeded from the case's label: a case draws the same inputs alone as in the whole matrix."""
    return torch.Generator().manual_seed(zlib.crc32(label.encode()))


def _randn(gen: torch.Generator, *shape, dtype=FP32, scale=1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * scale).to(dtype).to(runtime.DEVICE)


def _inputs(gen, B, T, H, HV, K, V, dtype, l2norm=True, N=None):
    """q, k, v, g, beta and an initial state (``N`` rows, default ``B``). Without the in-kernel L2 norm, q and k come
    normalised (the delta rule is only stable for ``beta |k|^2 <= 2``)."""
    q, k = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, K, generator=gen)
    if not l2norm:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    v = _randn(gen, B, T, HV, V, dtype=dtype)
    g = F.logsigmoid(torch.randn(B, T, HV, generator=gen) + 2.0).to(runtime.DEVICE)   # decays in (0, 1), most near 1
    beta = torch.sigmoid(torch.randn(B, T, HV, generator=gen)).to(runtime.DEVICE)
    h0 = _randn(gen, N or B, HV, K, V, scale=0.1)
    return q.to(dtype).to(runtime.DEVICE), k.to(dtype).to(runtime.DEVICE), v, g, beta, h0


def _cu(lens) -> torch.Tensor:
    """int32 ``[N+1]`` offsets of packed sequences of these lengths."""
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=runtime.DEVICE)


def _spans(lens) -> list[tuple[int, int]]:
    """``(start, end)`` of each packed sequence."""
    cu = _cu(lens).tolist()
    return list(zip(cu, cu[1:]))


def _within(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float) -> bool:
    """Every element within ``rtol |want| + atol`` (NaN never is)."""
    return bool(((got.float() - want.float()).abs() <= rtol * want.float().abs() + atol).all())


def _one_rounding(got: torch.Tensor, want: torch.Tensor) -> bool:
    """A 16-bit delta-rule output within one rounding of the fp32 answer: ``2^-8 |want| + 1e-5 max |want|``."""
    return _within(got, want, 2.0**-8, 1e-5 * float(want.abs().max()) if want.numel() else 0.0)


def _row(op: str, case: str, got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, ok: bool = True) -> dict:
    """``got`` against the fp32 ``want`` under the row's bound in ``BOUNDS`` (``dtype``: the inputs') and ``ok``."""
    kind, bound = BOUNDS[(op, "fp32" if dtype == FP32 else "bf16")]
    m = compare(got, want, baseline=want.to(BF16) if kind == "err_ratio" else None)
    return {"op": op, "case": case, "metrics": m,
            "passed": bool(ok and (m.err_ratio if kind == "err_ratio" else m.rel_l2) <= bound)}


def _rule_rows(op: str, case: str, o, ht, want, want_s, dtype, o_ok=True, s_ok=True) -> list[dict]:
    """The output and final-state rows of a delta-rule case; a 16-bit output is also held to one rounding element
    by element, except the chunked rule's where it has bf16 dot operands."""
    if dtype != FP32 and not (op == "deltanet.chunk" and _BF16_DOTS):
        o_ok = o_ok and _one_rounding(o, want)
    return [_row(op, case, o, want, dtype, o_ok and o.dtype == dtype and o.shape == want.shape),
            _row(f"{op} state", case, ht, want_s, dtype, s_ok and ht.dtype == FP32)]


def _chunk(case: str, dtype, lens, H, HV, init, l2norm, packed: bool) -> list[dict]:
    """The chunked rule on one sequence (B = 1) or on packed ones (then also each alone: the same bits under the
    interpreter, within the same bounds compiled)."""
    from . import chunk_gated_delta_rule, reference

    gen = _seeded(case)
    D = 16 if packed else 32
    q, k, v, g, beta, h0 = _inputs(gen, 1, sum(lens), H, HV, D, D, dtype, l2norm, N=len(lens))
    h0 = h0 if init else None
    if not packed:
        o, ht = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                       use_qk_l2norm=l2norm)
        want, want_s = reference.recurrent_gated_delta_rule(q.float(), k.float(), v.float(), g, beta, None, h0, True,
                                                            l2norm)
        return _rule_rows("deltanet.chunk", case, o, ht, want, want_s, dtype)
    cu = _cu(lens)
    o, ht = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                   use_qk_l2norm=l2norm, cu_seqlens=cu)
    want, want_s = reference.chunk_gated_delta_rule(q.float(), k.float(), v.float(), g, beta, None, h0, True, l2norm,
                                                    cu_seqlens=cu)
    alone = [chunk_gated_delta_rule(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b],
                                    initial_state=None if h0 is None else h0[n:n + 1], output_final_state=True,
                                    use_qk_l2norm=l2norm) for n, (a, b) in enumerate(_spans(lens))]
    o_alone, ht_alone = torch.cat([r[0] for r in alone], dim=1), torch.cat([r[1] for r in alone])
    if runtime.INTERPRET:       # the same programs on the same chunks: the same bits
        o_ok, s_ok = torch.equal(o, o_alone), torch.equal(ht, ht_alone)
    else:                       # both within the bounds of the fp32 answer (a bf16 o_alone is no baseline)
        o_ok, s_ok = (r["passed"] for r in _rule_rows("deltanet.chunk", case, o_alone, ht_alone, want, want_s, dtype))
    return _rule_rows("deltanet.chunk", case, o, ht, want, want_s, dtype, o_ok, s_ok)


def _recurrent(case: str, dtype, B, T, H, HV, init, l2norm) -> list[dict]:
    from . import recurrent_gated_delta_rule, reference

    q, k, v, g, beta, h0 = _inputs(_seeded(case), B, T, H, HV, 32, 32, dtype, l2norm)
    h0 = h0 if init else None
    o, ht = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                       use_qk_l2norm=l2norm)
    want, want_s = reference.recurrent_gated_delta_rule(q.float(), k.float(), v.float(), g, beta, None, h0, True,
                                                        l2norm)
    return _rule_rows("deltanet.recurrent", case, o, ht, want, want_s, dtype)


def _recurrent_gates(case: str, dtype, B, T, H, HV) -> list[dict]:
    from . import recurrent_gated_delta_rule_gates, reference

    gen = _seeded(case)
    q, k, v, _, _, h0 = _inputs(gen, B, T, H, HV, 32, 32, dtype)
    n = B * T * HV
    a = torch.linspace(-12, 24, n)[torch.randperm(n, generator=gen)].view(B, T, HV).to(dtype).to(runtime.DEVICE)
    b = _randn(gen, B, T, HV, dtype=dtype)
    A_log, dt_bias = torch.rand(HV, generator=gen).to(runtime.DEVICE), _randn(gen, HV, dtype=dtype)
    o, ht = recurrent_gated_delta_rule_gates(q, k, v, A_log, a, dt_bias, b, initial_state=h0,
                                             output_final_state=True, use_qk_l2norm=True)
    want, want_s = reference.recurrent_gated_delta_rule_gates(q.float(), k.float(), v.float(), A_log, a, dt_bias, b,
                                                              None, h0, True, True)
    return _rule_rows("deltanet.recurrent", case, o, ht, want, want_s, dtype)


def _conv_ok(y: torch.Tensor, want: torch.Tensor, dtype) -> bool:
    """Element by element: fp32 sums in another order within 1e-6 relative; 16-bit within one step of the rounded
    answer (a rounding of nearly equal sums)."""
    if y.dtype != dtype:
        return False
    return _within(y, want, 1e-6, 1e-6) if dtype == FP32 else _within(y, want.to(dtype), 2.0**-7, 1e-6)


def _state_bits(state: torch.Tensor, want: torch.Tensor, dtype) -> int:
    """Elements of a final conv state whose bits differ from the reference's (all of them if its shape or dtype
    is wrong)."""
    if state.shape != want.shape or state.dtype != dtype:
        return want.numel()
    return bit_mismatches(state, want.to(dtype))


def _conv(case: str, dtype, B, T, C, W, S) -> list[dict]:
    """The conv prefill, its final state (the raw last inputs, bit for bit), then one update step from that state,
    which rolls it as the reference does."""
    from . import causal_conv1d, causal_conv1d_update, reference

    gen = _seeded(case)
    x, w = _randn(gen, B, T, C, dtype=dtype), _randn(gen, C, W, dtype=dtype, scale=0.5)
    s0 = None if S is None else _randn(gen, B, C, S, dtype=dtype)
    y, s1 = causal_conv1d(x, w, s0)
    want, s1_ref = reference.causal_conv1d(x.float(), w.float(), None if s0 is None else s0.float())
    state_bits = _state_bits(s1, s1_ref, dtype)
    x1 = _randn(gen, B, C, dtype=dtype)
    rolled = s1_ref.clone()
    want1 = reference.causal_conv1d_update(x1.float(), rolled, w.float())
    y1 = causal_conv1d_update(x1, s1, w)
    return [_row("deltanet.conv", case, y, want, dtype, _conv_ok(y, want, dtype)),
            {"op": "deltanet.conv state", "case": case, "mismatches": state_bits, "passed": state_bits == 0},
            _row("deltanet.conv update", case, y1, want1, dtype,
                 _conv_ok(y1, want1, dtype) and torch.equal(s1.float(), rolled))]


def _packed_conv(case: str, dtype, lens, S) -> list[dict]:
    """The conv on packed sequences (each convolved on its own, its final state row the raw last inputs), also run
    on each sequence alone: the same bits under the interpreter."""
    from . import causal_conv1d, reference

    gen = _seeded(case)
    C, W = 40, 4
    x, w = _randn(gen, 1, sum(lens), C, dtype=dtype), _randn(gen, C, W, dtype=dtype, scale=0.5)
    s0 = None if S is None else _randn(gen, len(lens), C, S, dtype=dtype)
    cu = _cu(lens)
    y, s1 = causal_conv1d(x, w, s0, cu_seqlens=cu)
    want, s1_ref = reference.causal_conv1d(x.float(), w.float(), None if s0 is None else s0.float(), cu_seqlens=cu)
    alone = [causal_conv1d(x[:, a:b], w, None if s0 is None else s0[n:n + 1]) for n, (a, b) in enumerate(_spans(lens))]
    y_alone, s1_alone = torch.cat([r[0] for r in alone], dim=1), torch.cat([r[1] for r in alone])
    y_ok = torch.equal(y, y_alone) if runtime.INTERPRET else _conv_ok(y_alone, want, dtype)
    state_bits = _state_bits(s1, s1_ref, dtype)
    return [_row("deltanet.conv", case, y, want, dtype, y_ok and _conv_ok(y, want, dtype)),
            {"op": "deltanet.conv state", "case": case, "mismatches": state_bits,
             "passed": state_bits == 0 and torch.equal(s1, s1_alone)}]


def _gated_rmsnorm(case: str, dtype, w_dtype, shape) -> list[dict]:
    """Against the spec, which rounds as HF does (in x's dtype): a 16-bit output within one step of it."""
    from . import gated_rmsnorm, reference

    gen = _seeded(case)
    x, z = _randn(gen, *shape, dtype=dtype, scale=3.0), _randn(gen, *shape, dtype=dtype)
    w = (1 + 0.2 * torch.randn(shape[-1], generator=gen)).to(w_dtype).to(runtime.DEVICE)
    y = gated_rmsnorm(x, z, w)
    want = reference.gated_rmsnorm(x, z, w).float()
    ok = y.dtype == dtype and (dtype == FP32 or _within(y, want, 2.0**-7, 1e-6))
    return [_row("deltanet.gated_rmsnorm", case, y, want, dtype, ok)]


def _decode_step(case: str, dtype, B, H, HV, K, V, W, S, HD) -> list[dict]:
    """The fused decode step (conv update, gates, delta rule, gated norm) and its reference, each carrying its own
    copies of the states over two steps of fresh projections: both steps' outputs, the final recurrent state and
    the conv state after each step (bit for bit)."""
    from . import gated_delta_decode, reference

    gen = _seeded(case)
    C = 2 * H * K + HV * V
    conv, state = _randn(gen, B, C, S, dtype=dtype), _randn(gen, B, HV, K, V, scale=0.1)
    weights = dict(conv_weight=_randn(gen, C, W, scale=0.4), A_log=_randn(gen, HV), dt_bias=_randn(gen, HV),
                   norm_weight=(torch.randn(V, generator=gen).abs() + 0.5).to(dtype).to(runtime.DEVICE),
                   num_k_heads=H)
    if HD is not None:          # the float gate weights as views of one fused in_proj_ba
        w_ba = _randn(gen, 2 * HV, HD, dtype=dtype, scale=HD ** -0.5)
        weights.update(b_weight=w_ba[:HV], a_weight=w_ba[HV:])
    mine, theirs = (conv.clone(), state.clone()), (conv.clone(), state.clone())
    outs, wants, conv_bits = [], [], 0
    for _ in range(2):
        step = dict(qkv=_randn(gen, B, C, dtype=dtype), z=_randn(gen, B, HV, V, dtype=dtype))
        if HD is None:
            step.update(a=_randn(gen, B, HV, dtype=dtype), b=_randn(gen, B, HV, dtype=dtype))
        else:
            step.update(a=None, b=None, x=_randn(gen, B, HD, dtype=dtype))
        outs.append(gated_delta_decode(**step, conv_state=mine[0], state=mine[1], **weights))
        wants.append(reference.gated_delta_decode(**step, conv_state=theirs[0], state=theirs[1], **weights).float())
        conv_bits += bit_mismatches(mine[0], theirs[0])
    got, want = torch.stack(outs), torch.stack(wants)
    return [_row("deltanet.decode step", case, got, want, dtype, got.dtype == dtype),
            _row("deltanet.decode step state", case, mine[1], theirs[1], dtype),
            {"op": "deltanet.decode step conv state", "case": case, "mismatches": conv_bits,
             "passed": conv_bits == 0}]


def _heads(T, H, HV, D, init, l2norm) -> str:
    return f"T{T} H{H} HV{HV} K{D} V{D}{' h0' if init else ''}{' l2norm' if l2norm else ''}"


def _slashed(values) -> str:
    return "/".join(map(str, values))


def cases() -> Iterator[Case]:
    """The family's check matrix, each case named before it runs and drawing its inputs from a generator seeded by
    its label."""
    for dtype, T, H, HV, init, l2norm in CHUNK_SHAPES:
        case = f"{_NAMES[dtype]} {_heads(T, H, HV, 32, init, l2norm)}"
        yield Case("deltanet.chunk", case, lambda c=case, s=(dtype, [T], H, HV, init, l2norm): _chunk(c, *s, False))
    for shape in PACKED_CHUNK_SHAPES:
        dtype, lens, H, HV, init, l2norm = shape
        case = f"{_NAMES[dtype]} packed {_heads(_slashed(lens), H, HV, 16, init, l2norm)}"
        yield Case("deltanet.chunk", case, lambda c=case, s=shape: _chunk(c, *s, True))
    for shape in RECURRENT_SHAPES:
        dtype, B, T, H, HV, init, l2norm = shape
        case = f"{_NAMES[dtype]} B{B} {_heads(T, H, HV, 32, init, l2norm)}"
        yield Case("deltanet.recurrent", case, lambda c=case, s=shape: _recurrent(c, *s))
    for shape in GATES_SHAPES:
        dtype, B, T, H, HV = shape
        case = f"{_NAMES[dtype]} B{B} {_heads(T, H, HV, 32, True, True)}, gates fused"
        yield Case("deltanet.recurrent", case, lambda c=case, s=shape: _recurrent_gates(c, *s))
    for shape in CONV_SHAPES:
        dtype, B, T, C, W, S = shape
        case = f"{_NAMES[dtype]} B{B} T{T} C{C} W{W} {'no state' if S is None else f'S{S}'}"
        yield Case("deltanet.conv", case, lambda c=case, s=shape: _conv(c, *s))
    for shape in PACKED_CONV_SHAPES:
        dtype, lens, S = shape
        case = f"{_NAMES[dtype]} packed T {_slashed(lens)} C40 W4 {'no state' if S is None else f'S{S}'}"
        yield Case("deltanet.conv", case, lambda c=case, s=shape: _packed_conv(c, *s))
    for shape in NORM_SHAPES:
        dtype, w_dtype, dims = shape
        case = f"{_NAMES[dtype]} {'x'.join(map(str, dims))}, weight {_NAMES[w_dtype]}"
        yield Case("deltanet.gated_rmsnorm", case, lambda c=case, s=shape: _gated_rmsnorm(c, *s))
    for shape in STEP_SHAPES:
        dtype, B, H, HV, K, V, W, S, HD = shape
        case = (f"{_NAMES[dtype]} B{B} H{H} HV{HV} K{K} V{V} W{W} S{S}, 2 steps"
                f"{'' if HD is None else f', gates projected from HD{HD}'}")
        yield Case("deltanet.decode step", case, lambda c=case, s=shape: _decode_step(c, *s))


def iter_rows() -> Iterator[dict]:
    for case in cases():
        yield from case.run()


def check_deltanet() -> list[dict]:
    """The family's ``lynn check`` rows as a list (:func:`iter_rows` yields each as it finishes)."""
    return list(iter_rows())


__all__ = ["check_deltanet", "cases"]
