"""Gated attention on the Qwen3-Next / Qwen3.5 shape (16 query heads, 2 KV heads, head dim 256), against torch SDPA.

* ``attention.prefill``: causal, one sequence of T = 4096 and 16384 tokens, bf16. TFLOP/s with the causal
  convention of FlashAttention's benchmarks, used for every provider alike: two matmuls (QK^T, PV) of
  ``2 * T * T * D`` flops per head, halved for causality: ``flops = 2 * T * T * Hq * D``. The gated providers add
  ``sigmoid(gate) * o``, not counted.
* ``attention.decode``: one query token per sequence over 4096 and 32768 cached tokens, batch 1 and 8, contiguous
  and paged (64-token pages, shuffled) caches. GB/s from the K and V bytes the step must read
  (``2 * B * L * Hkv * D * 2``), against the read ceiling.

SDPA runs with ``enable_gqa=True`` in its preferred layout (``[B, H, T, D]`` contiguous, prepared outside the timed
region). Every provider is validated against an fp32 oracle before it is timed: the reference where it fits,
fp32 SDPA (with repeated KV heads) for the 16k prefill, whose fp32 reference scores alone would take 17 GB.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..attention import decode_attention, flash_attention, paged_slots, reference
from ..attention.triton_decode import default_num_splits, launch_decode
from ..metrics import compare
from .harness import Ceilings, Result, rotating, rotation, timed, validated
from .registry import register

HQ, HKV, D = 16, 2, 256
PREFILL_T = [4096, 16384]
DECODE_CASES = [(1, 4096), (8, 4096), (1, 32768), (8, 32768)]      # (batch, cached tokens)
PAGE = 64
BF16 = torch.bfloat16
NAN = float("nan")


def causal_flops(t: int, hq: int = HQ, d: int = D) -> int:
    """QK^T and PV, 2 flops per multiply-add, half the T x T square under the causal mask."""
    return 2 * 2 * t * t * hq * d // 2


def _sdpa(q, k, v, causal: bool):
    """SDPA on ``[B, H, T, D]`` tensors, GQA by ``enable_gqa``."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)


def _bhtd(x: torch.Tensor) -> torch.Tensor:
    """``[T, H, D]`` -> contiguous ``[1, H, T, D]`` (SDPA's layout)."""
    return x.transpose(0, 1).unsqueeze(0).contiguous()


def _prefill_oracle(q, k, v, gate):
    t = q.shape[0]
    if t <= 4096:
        return reference.flash_attention(q.float(), k.float(), v.float(), gate=None if gate is None else gate.float())
    kr, vr = (x.float().repeat_interleave(HQ // HKV, dim=1) for x in (k, v))
    o = _sdpa(_bhtd(q.float()), _bhtd(kr), _bhtd(vr), True)[0].transpose(0, 1)
    return o if gate is None else o * torch.sigmoid(gate.float())


@register("attention.prefill")
def bench_prefill(ceilings: Ceilings, quick: bool = False) -> list[Result]:
    rows = []
    for t in (PREFILL_T[:1] if quick else PREFILL_T):
        dims = {"T": t, "Hq": HQ, "Hkv": HKV, "D": D}
        label = f"T{t} {HQ}/{HKV} heads d{D} causal"
        io_bytes = 2 * t * D * (2 * HQ + 2 * HKV)                           # read q, k, v, write o (bf16)

        def make():
            return tuple(torch.randn(t, h, D, device="cuda", dtype=BF16) for h in (HQ, HKV, HKV, HQ))

        sets = rotation(make, io_bytes + 2 * t * HQ * D, max_sets=8)
        sdpa_sets = [tuple(_bhtd(x) for x in s[:3]) + (s[3],) for s in sets]
        q0, k0, v0, g0 = sets[0]
        want = _prefill_oracle(q0, k0, v0, None)
        want_gated = want * torch.sigmoid(g0.float())
        providers = (
            ("lynn flash_attention", lambda q, k, v, g: flash_attention(q, k, v), sets, want, io_bytes),
            ("lynn flash_attention, gate fused", lambda q, k, v, g: flash_attention(q, k, v, gate=g), sets,
             want_gated, io_bytes + 2 * t * HQ * D),
            ("torch SDPA (enable_gqa)", lambda q, k, v, g: _sdpa(q, k, v, True), sdpa_sets, want, io_bytes),
            ("torch SDPA + eager gate", lambda q, k, v, g: _sdpa(q, k, v, True).squeeze(0).transpose(0, 1)
             * torch.sigmoid(g), sdpa_sets, want_gated, io_bytes + 2 * t * HQ * D),
        )
        checks = {}
        for name, fn, inputs, oracle, _ in providers:                     # validate every provider before timing any
            got = fn(*inputs[0])
            if got.dim() == 4:
                got = got[0].transpose(0, 1)
            checks[name] = validated(compare(got, oracle, baseline=oracle.to(BF16)))
        del want, want_gated
        for name, fn, inputs, _, nbytes in providers:
            rows += timed(Result("attention.prefill", name, label, dims, NAN, NAN, NAN, bytes=nbytes,
                                 flops=causal_flops(t), ceiling="bf16_tflops", validation=checks[name],
                                 note=f"{len(inputs)} rotating input sets; flops = 2*T*T*Hq*D (causal half)"),
                          rotating(fn, inputs), ceilings)
        del sets, sdpa_sets
        torch.cuda.empty_cache()
    return rows


def _paged_copy(k: torch.Tensor, v: torch.Tensor, gen: torch.Generator):
    """The same cache ``[B, L, Hkv, D]`` as shuffled ``PAGE``-token blocks: ``(k_pages, v_pages, block_table)``."""
    b, length = k.shape[:2]
    n_pages = length // PAGE
    table = torch.randperm(b * n_pages, generator=gen).view(b, n_pages).to(torch.int32).cuda()
    slots = paged_slots(table, torch.arange(b, device="cuda").repeat_interleave(length),
                        torch.arange(length, device="cuda").repeat(b), PAGE)
    kp, vp = (torch.empty(b * n_pages, PAGE, HKV, D, device="cuda", dtype=BF16) for _ in range(2))
    kp.view(-1, HKV, D)[slots] = k.reshape(-1, HKV, D)
    vp.view(-1, HKV, D)[slots] = v.reshape(-1, HKV, D)
    return kp, vp, table


@register("attention.decode")
def bench_decode(ceilings: Ceilings, quick: bool = False) -> list[Result]:
    rows = []
    gen = torch.Generator().manual_seed(0)
    for b, length in (DECODE_CASES[2:3] if quick else DECODE_CASES):
        dims = {"B": b, "L": length, "Hq": HQ, "Hkv": HKV, "D": D}
        label = f"B{b} L{length} {HQ}/{HKV} heads d{D}"
        kv_bytes = 2 * b * length * HKV * D * 2                              # K and V, bf16, read once

        def make():
            q = torch.randn(b, HQ, D, device="cuda", dtype=BF16)
            k, v = (torch.randn(b, length, HKV, D, device="cuda", dtype=BF16) for _ in range(2))
            return (q, k, v, torch.full((b,), length, dtype=torch.int32, device="cuda"))

        sets = rotation(make, kv_bytes)
        paged_sets = [(q, *_paged_copy(k, v, gen), lens) for q, k, v, lens in sets]
        sdpa_sets = [(q[:, :, None], k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous())
                     for q, k, v, _ in sets]
        q0, k0, v0, lens0 = sets[0]
        want = reference.decode_attention(q0.float(), k0.float(), v0.float(), lens0)
        splits = default_num_splits(b, HKV, length)
        out = torch.empty(b, HQ, D, device="cuda", dtype=BF16)
        work = (torch.empty(b, HQ, splits, D, device="cuda", dtype=torch.float32),
                torch.empty(b, HQ, splits, device="cuda", dtype=torch.float32))

        poison = {"on": True}

        def launch(q, k, v, lens, table=None):
            if poison["on"]:                         # validation starts from NaN: an unwritten element fails it
                out.fill_(float("nan"))
            return launch_decode(q, k, v, lens, table, None, out, splits, D ** -0.5, workspace=work)

        providers = (
            ("lynn launch_decode, contiguous cache (preallocated, no host sync)", launch, sets),
            (f"lynn launch_decode, paged cache ({PAGE}-token pages)",
             lambda q, kp, vp, table, lens: launch(q, kp, vp, lens, table), paged_sets),
            ("lynn decode_attention() eager call, contiguous (checks read seq_lens back)",
             lambda q, k, v, lens: decode_attention(q, k, v, lens), sets),
            ("torch SDPA (enable_gqa), [B, Hkv, L, D] cache",
             lambda q, k, v: _sdpa(q, k, v, False)[:, :, 0], sdpa_sets),
        )
        checks = {}
        for name, fn, inputs in providers:                                # validate every provider before timing any
            checks[name] = validated(compare(fn(*inputs[0]), want, baseline=want.to(BF16)))
        poison["on"] = False
        for name, fn, inputs in providers:
            rows += timed(Result("attention.decode", name, label, dims, NAN, NAN, NAN, bytes=kv_bytes,
                                 ceiling="read_gbps", validation=checks[name],
                                 note=f"{len(inputs)} rotating input sets; bytes = K + V read once; "
                                      f"lynn uses {splits} KV splits per sequence"), rotating(fn, inputs), ceilings)
        del sets, paged_sets, sdpa_sets
        torch.cuda.empty_cache()
    return rows


__all__ = ["bench_prefill", "bench_decode", "causal_flops"]
