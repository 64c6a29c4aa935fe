"""Gated DeltaNet at Qwen3.5 / Qwen3-Next shapes (16 QK heads, 32 V heads, head dim 128), with fla alongside.

* ``deltanet.chunk``     chunked prefill, B=1, T in {512, 4096, 16384}, bf16 in, fp32 state out, L2 norm in kernel;
* ``deltanet.recurrent`` one decode step, B in {1, 8, 32}: kernel time, and wall-clock per step including the
  Python wrapper (what a Python engine pays without a CUDA graph; fla 0.6.0 measured 36.6 us at B=1);
* ``deltanet.conv``      the causal conv + SiLU over the 8192 q|k|v channels, prefill and decode update.

Every provider is validated against the fp32 torch reference before it is timed. fla runs in the same process on
the same inputs when importable; otherwise a row records why not (never a silent skip).

Derived figures:

* prefill FLOPs, per (chunk of C=64, value head), counting multiply-adds as 2: ``kk^T 2C^2K + w 2C^2K + u 2C^2V +
  v' = u - wS 2CKV + S += k^T v' 2CKV + o = qS 2CKV + qk^T 2C^2K + attn v' 2C^2V`` = ``2C^2(3K + 2V) + 6CKV``
  (the 64x64 triangular inverse, about 0.1% more, is left out). At K=V=128 that is 180 kFLOP per token and head.
* prefill bytes: q, k, v, g, beta read once, o written once, the final state written;
* decode bytes: state read + written (fp32) + q, k, v, a, b read + o written (+ A_log, dt_bias).
"""

from __future__ import annotations

import itertools
import statistics
import time

import torch
import torch.nn.functional as F

from ..deltanet import (
    causal_conv1d,
    causal_conv1d_update,
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule_gates,
    reference,
)
from ..deltanet.spec import CHUNK, Dims
from ..deltanet.triton_conv import launch_causal_conv1d_update
from ..deltanet.triton_recurrent import launch_recurrent
from ..metrics import compare
from .harness import Ceilings, Result, derive, rotating, rotation, timed, validated
from .registry import register

H, HV, D = 16, 32, 128                      #: Qwen3.5-35B-A3B / Qwen3-Next-80B-A3B Gated DeltaNet heads
CONV_C, CONV_W = 2 * H * D + HV * D, 4      #: conv channels q|k|v = 8192, kernel width 4
PREFILL_T, QUICK_PREFILL_T = (512, 4096, 16384), (4096,)
DECODE_B, QUICK_DECODE_B = (1, 8, 32), (1, 8)
NAN = float("nan")


def _fla():
    """(version, chunk fn, fused recurrent fn, None) or (None, None, None, why not)."""
    try:
        import fla
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_recurrent
    except Exception as exc:  # ImportError, or a broken install: either way record it
        return None, None, None, f"fla not installed ({type(exc).__name__}: {exc})"
    return getattr(fla, "__version__", "?"), fla_chunk, fla_recurrent, None


def _note_row(op: str, provider: str, label: str, dims: dict, nbytes: int, why: str) -> Result:
    """A row that says why a provider was not timed (report tables show it; timings are NaN)."""
    return Result(op, provider, label, dims, NAN, NAN, NAN, bytes=nbytes, note=why)


def _repeat_qk(args: tuple) -> tuple:
    """The same inputs with q, k repeated onto the 32 value heads (for an fla that wants H == HV)."""
    q, k = (x.repeat_interleave(HV // H, dim=2) for x in args[:2])
    return (q, k) + tuple(args[2:])


def _validate_fla(fn, sets: list, check) -> tuple[list | None, str, dict | None]:
    """Validate ``fn`` (an fla call) with q/k on the 16 QK heads, else with q/k repeated to 32 heads (the copy made
    before timing). Returns (input sets to time, how, validation) or (None, why not, None): fla's failures become
    a row with a note, never an aborted benchmark."""
    errors = []
    for how, psets in (("native GQA (16 QK heads, 32 V heads)", sets),
                       ("q/k repeated to 32 heads before the call (copy not timed)", None)):
        try:
            psets = psets if psets is not None else [_repeat_qk(s) for s in sets]
            return psets, how, check(*fn(*psets[0]))
        except Exception as exc:
            errors.append(f"{how}: {type(exc).__name__}: {str(exc)[:200]}")
    return None, "not timed: " + " | ".join(errors), None


def _prefill_inputs(T: int, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(shape, generator=gen, device="cuda")

    q, k = randn(1, T, H, D).bfloat16(), randn(1, T, H, D).bfloat16()
    v = randn(1, T, HV, D).bfloat16()
    g = F.logsigmoid(randn(1, T, HV) + 2.0)
    beta = torch.sigmoid(randn(1, T, HV))
    return q, k, v, g, beta


def prefill_flops(T: int, heads: int = HV, K: int = D, V: int = D, C: int = CHUNK) -> int:
    """Estimated FLOPs of a chunked prefill (see the module docstring)."""
    n_chunks = -(-T // C)
    return n_chunks * heads * (2 * C * C * (3 * K + 2 * V) + 6 * C * K * V)


@register("deltanet.chunk")
def bench_chunk(ceilings: Ceilings, quick: bool = False) -> list[Result]:
    rows = []
    version, fla_chunk, _, why_not = _fla()
    for T in (QUICK_PREFILL_T if quick else PREFILL_T):
        label, dims = f"B1 T{T} H{H} HV{HV} d{D}", {"B": 1, "T": T, "H": H, "HV": HV, "K": D, "V": D}
        nbytes = 2 * T * H * D * 2 + T * HV * D * 2 * 2 + T * HV * 4 * 2 + HV * D * D * 4
        flops = prefill_flops(T)
        seeds = itertools.count(1000 * T)                    # every rotating set its own inputs
        sets = rotation(lambda: _prefill_inputs(T, seed=next(seeds)), nbytes, max_sets=4)
        q, k, v, g, beta = sets[0]
        o_ref, s_ref = reference.chunk_gated_delta_rule(q.float(), k.float(), v.float(), g, beta, None, None, True,
                                                        True)

        def lynn(q, k, v, g, beta):
            return chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, use_qk_l2norm=True)

        def check(o, s):           # the fp32 state from bf16 dot operands, against one bf16 rounding of it
            validated(compare(s, s_ref, baseline=s_ref.bfloat16()))      # H200, lynn check T65: 1.8x
            return validated(compare(o, o_ref, baseline=o_ref.bfloat16()))

        providers = [("lynn chunk_gated_delta_rule() (5 kernels + wrapper)", lynn, sets, "",
                      check(*lynn(*sets[0])))]           # every provider validated before any is timed
        if fla_chunk is not None:
            def fla_fn(q, k, v, g, beta):
                return fla_chunk(q, k, v, g=g, beta=beta, output_final_state=True, use_qk_l2norm_in_kernel=True)

            fla_sets, how, validation = _validate_fla(fla_fn, sets, check)
            providers.append((f"fla {version} chunk_gated_delta_rule", fla_fn, fla_sets, how, validation))
        for provider, fn, psets, how, validation in providers:
            if psets is None:
                rows.append(_note_row("deltanet.chunk", provider, label, dims, nbytes, how))
                continue
            rows += timed(Result("deltanet.chunk", provider, label, dims, NAN, NAN, NAN, bytes=nbytes, flops=flops,
                                 ceiling="bf16_tflops", validation=validation,
                                 note=f"{len(psets)} rotating input sets; flops estimated (module docstring). "
                                      f"{how}".strip()), rotating(fn, psets), ceilings)
        if fla_chunk is None:
            rows.append(_note_row("deltanet.chunk", "fla chunk_gated_delta_rule", label, dims, nbytes, why_not))
        del sets
        torch.cuda.empty_cache()
    return rows


def _decode_inputs(B: int, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(shape, generator=gen, device="cuda")

    q, k = randn(B, 1, H, D).bfloat16(), randn(B, 1, H, D).bfloat16()
    v = randn(B, 1, HV, D).bfloat16()
    a, b = randn(B, 1, HV).bfloat16(), randn(B, 1, HV).bfloat16()
    state = randn(B, HV, D, D) * 0.05
    o = torch.full((B, 1, HV, D), NAN, dtype=torch.bfloat16, device="cuda")
    return q, k, v, a, b, state, o


def _wall_clock(fn, calls: int = 200, repeats: int = 15) -> tuple[float, float, float]:
    """(median, p20, p80) ms per call of back-to-back calls, Python included, one sync per ``calls`` calls."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        per_call.append((time.perf_counter() - t0) * 1e3 / calls)
    q = statistics.quantiles(per_call, n=10)
    return statistics.median(per_call), q[1], q[7]


@register("deltanet.recurrent")
def bench_recurrent(ceilings: Ceilings, quick: bool = False) -> list[Result]:
    rows = []
    version, _, fla_recurrent, why_not = _fla()
    gen = torch.Generator(device="cuda").manual_seed(123)
    A_log = torch.rand(HV, generator=gen, device="cuda") * 2.0
    dt_bias = torch.randn(HV, generator=gen, device="cuda")
    for B in (QUICK_DECODE_B if quick else DECODE_B):
        label, dims = f"B{B} H{H} HV{HV} d{D}", {"B": B, "H": H, "HV": HV, "K": D, "V": D}
        nbytes = (2 * B * HV * D * D * 4 + 2 * B * H * D * 2 + 2 * B * HV * D * 2 + 2 * B * HV * 2
                  + 2 * HV * 4)
        scale = D ** -0.5
        dims_rule = Dims(B, 1, H, HV, D, D)
        seeds = itertools.count(1000 * B)                    # every rotating set its own inputs
        sets = rotation(lambda: _decode_inputs(B, seed=next(seeds)), nbytes)
        q, k, v, a, b, state0, _ = sets[0]
        o_ref, s_ref = reference.recurrent_gated_delta_rule_gates(q.float(), k.float(), v.float(), A_log, a,
                                                                  dt_bias, b, None, state0, True, True)

        def launch(q, k, v, a, b, state, o):      # one launch, state updated in place, nothing allocated
            launch_recurrent(q, k, v, a, b, A_log, dt_bias, dims_rule, scale, state, True, o, state)
            return o, state

        def eager(q, k, v, a, b, state, o):       # the public op with its checks, state in place
            return recurrent_gated_delta_rule_gates(q, k, v, A_log, a, dt_bias, b, initial_state=state,
                                                    use_qk_l2norm=True, out_state=state)

        def check(o, s):           # the state path is all fp32: H200, lynn check: rel_l2 5.9e-8
            validated(compare(s, s_ref), dtype=torch.float32)
            return validated(compare(o, o_ref, baseline=o_ref.bfloat16()))

        def fresh(args):                               # validation must not advance a timed state
            return args[:5] + (args[5].clone(),) + args[6:]

        providers = [("lynn kernel launch (gates fused, state in place)", launch, sets, ""),
                     ("lynn recurrent_gated_delta_rule_gates() eager call", eager, sets, "")]
        providers = [(p, fn, ps, how, check(*fn(*fresh(ps[0])))) for p, fn, ps, how in providers]
        if fla_recurrent is not None:
            # fla 0.6.0 takes g, beta: each set's own gates, precomputed untimed, so both see the same inputs
            gated_sets = [(q, k, v, *reference.gates(A_log, a, dt_bias, b), state, o)
                          for q, k, v, a, b, state, o in sets]

            def fla_fn(q, k, v, g, beta, state, o):
                return fla_recurrent(q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True,
                                     use_qk_l2norm_in_kernel=True)

            fla_sets, how, validation = _validate_fla(fla_fn, [fresh(s) for s in gated_sets], check)
            providers.append((f"fla {version} fused_recurrent_gated_delta_rule (g, beta precomputed)", fla_fn,
                              fla_sets, how, validation))
        for provider, fn, psets, how, validation in providers:
            if psets is None:
                rows.append(_note_row("deltanet.recurrent", provider, label, dims, nbytes, how))
                continue
            rows += timed(Result("deltanet.recurrent", provider, label, dims, NAN, NAN, NAN, bytes=nbytes,
                                 ceiling="copy_gbps", validation=validation,
                                 note=f"{len(psets)} rotating input sets; bytes = fp32 state read + written "
                                      f"+ q/k/v/a/b + o. {how}".strip()), rotating(fn, psets), ceilings)
            wmed, wp20, wp80 = _wall_clock(rotating(fn, psets))
            rows.append(derive(Result("deltanet.recurrent", provider + " wall-clock", label, dims, wmed, wp20, wp80,
                                      bytes=nbytes, ceiling="copy_gbps", validation=validation,
                                      note="back-to-back calls timed with perf_counter, Python wrapper included, "
                                           "one sync per 200 calls"), ceilings))
        if fla_recurrent is None:
            rows.append(_note_row("deltanet.recurrent", "fla fused_recurrent_gated_delta_rule", label, dims, nbytes,
                                  why_not))
        del sets
        torch.cuda.empty_cache()
    return rows


@register("deltanet.conv")
def bench_conv(ceilings: Ceilings, quick: bool = False) -> list[Result]:
    rows = []
    weight = (torch.randn(CONV_C, CONV_W, device="cuda") * 0.5).bfloat16()
    for T in (QUICK_PREFILL_T if quick else PREFILL_T):
        label, dims = f"prefill B1 T{T} C{CONV_C} W{CONV_W}", {"B": 1, "T": T, "C": CONV_C, "W": CONV_W}
        nbytes = 2 * T * CONV_C * 2 + CONV_C * CONV_W * 2 + CONV_C * (CONV_W - 1) * 2
        sets = rotation(lambda: (torch.randn(1, T, CONV_C, device="cuda").bfloat16(),
                                 torch.randn(1, CONV_C, CONV_W - 1, device="cuda").bfloat16()), nbytes)
        y_ref, _ = reference.causal_conv1d(sets[0][0].float(), weight.float())
        y_ref0, _ = reference.causal_conv1d(sets[0][0].float(), weight.float(), sets[0][1].float())
        providers = [("lynn causal_conv1d()", lambda x, h0: causal_conv1d(x, weight)),
                     ("lynn causal_conv1d() with an initial state (the decoder's call)",
                      lambda x, h0: causal_conv1d(x, weight, h0)),
                     ("torch eager (reference)", lambda x, h0: reference.causal_conv1d(x, weight))]
        checks = {p: validated(compare(fn(*sets[0])[0], y0, baseline=y0.bfloat16()))
                  for (p, fn), y0 in zip(providers, (y_ref, y_ref0, y_ref))}
        for provider, fn in providers:
            rows += timed(Result("deltanet.conv", provider, label, dims, NAN, NAN, NAN, bytes=nbytes,
                                 ceiling="copy_gbps", validation=checks[provider],
                                 note=f"{len(sets)} rotating input sets; bytes = x read + y written"),
                          rotating(fn, sets), ceilings)
        del sets
    for B in (QUICK_DECODE_B if quick else DECODE_B):
        label, dims = f"update B{B} C{CONV_C} W{CONV_W}", {"B": B, "C": CONV_C, "W": CONV_W}
        nbytes = 2 * B * CONV_C * 2 + 2 * B * CONV_C * (CONV_W - 1) * 2 + CONV_C * CONV_W * 2

        def make():
            return (torch.randn(B, CONV_C, device="cuda").bfloat16(),
                    torch.randn(B, CONV_C, CONV_W - 1, device="cuda").bfloat16(),
                    torch.empty(B, CONV_C, device="cuda", dtype=torch.bfloat16))

        sets = rotation(make, nbytes)
        x0, s0, _ = sets[0]
        y_ref = reference.causal_conv1d_update(x0.float(), s0.float().clone(), weight.float())
        providers = [("lynn kernel launch (preallocated y, state in place)",
                      lambda x, s, y: launch_causal_conv1d_update(x, s, weight, y)),
                     ("lynn causal_conv1d_update() eager call", lambda x, s, y: causal_conv1d_update(x, s, weight)),
                     ("torch eager (reference)", lambda x, s, y: reference.causal_conv1d_update(x, s, weight))]
        checks = {p: validated(compare(fn(x0, s0.clone(), sets[0][2]), y_ref, baseline=y_ref.bfloat16()))
                  for p, fn in providers}
        for provider, fn in providers:
            rows += timed(Result("deltanet.conv", provider, label, dims, NAN, NAN, NAN, bytes=nbytes,
                                 ceiling="copy_gbps", validation=checks[provider],
                                 note=f"{len(sets)} rotating input sets; bytes = x + state read and written + y"),
                          rotating(fn, sets), ceilings)
        del sets
    torch.cuda.empty_cache()
    return rows


__all__ = ["bench_chunk", "bench_recurrent", "bench_conv", "prefill_flops"]
