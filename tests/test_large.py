"""Offsets past 2^31 elements: a kernel that computes an offset in int32 wraps and reads the wrong memory. Each test
runs the op on a tensor (or a strided view into one) larger than 2^31 elements and compares it, bit for bit, with
the same op on a small tensor holding the same values. GPU only: the tensors take gigabytes."""

from __future__ import annotations

import pytest
import torch

from lynn_kernels import moe
from lynn_kernels.matmul import nvfp4_linear, pack
from lynn_kernels.nvfp4 import NVFP4Tensor
from lynn_kernels.nvfp4 import reference as nvfp4_reference

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16
BIG = 2**31


def _strided_rows(rows: int, k: int, seed: int) -> torch.Tensor:
    """``[rows, k]`` bf16 whose rows lie 2^30 + 64 elements apart: the last row starts past element 2^31."""
    stride = 2**30 + 64
    base = torch.empty((rows - 1) * stride + k, dtype=BF16, device="cuda")
    assert base.numel() > BIG or rows < 3
    x = base.as_strided((rows, k), (stride, 1))
    x.copy_(torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)).to(BF16))
    return x


def _equal(got, want, what):
    assert got.dtype == want.dtype and got.shape == want.shape, what
    assert torch.equal(got, want), f"{what}: {(got != want).sum().item()} of {want.numel()} elements differ"


@pytest.mark.parametrize("layout", ["checkpoint", "packed"])
@pytest.mark.parametrize("rows", [3, 16])
def test_gpu_linear_reads_activation_rows_past_2_31(layout, rows):
    k, n = 2048, 1024
    w = nvfp4_reference.quantize(torch.randn(n, k, device="cuda") * 0.05)
    w = pack(w) if layout == "packed" else w
    x = _strided_rows(rows, k, seed=1)
    _equal(nvfp4_linear(x, w), nvfp4_linear(x.contiguous(), w), f"{layout} M={rows}")
    _equal(nvfp4_linear(x[1:3], w), nvfp4_linear(x[1:3].contiguous(), w), f"{layout} M=2 (the FMA path)")


def test_gpu_route_reads_logit_rows_past_2_31():
    e = 256
    logits = _strided_rows(3, e, seed=2)
    for got, want in zip(moe.route(logits, 8), moe.route(logits.contiguous(), 8)):
        _equal(got, want, "route")


def _expert_stack(experts: int, rows: int, k: int, seed: int) -> NVFP4Tensor:
    """A stack of random NVFP4 experts built directly from bytes (no 17 GB fp32 weight to quantise)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    codes = torch.randint(0, 256, (experts, rows, k // 2), dtype=torch.uint8, device="cuda", generator=g)
    scales = (torch.rand(experts, rows, k // 16, device="cuda", generator=g) * 2 + 0.25).to(torch.float8_e4m3fn)
    return NVFP4Tensor(codes, scales, torch.full((experts,), 1e-2, device="cuda"))


def _tail(w: NVFP4Tensor, keep: int) -> NVFP4Tensor:
    return NVFP4Tensor(w.codes[-keep:].clone(), w.scales[-keep:].clone(), w.global_scale[-keep:].clone())


@pytest.mark.parametrize("m", [1, 64])
def test_gpu_experts_past_2_31_bytes_of_codes(m):
    """520 experts of [4096, 2048]: expert 519's codes start past byte 2^31. Routed to the last 8 experts, the full
    stack gives the bits of the same 8 experts alone (the decode kernels at M = 1, the grouped GEMMs at 64)."""
    E, H, inter = 520, 2048, 2048
    w13 = _expert_stack(E, 2 * inter, H, seed=3)
    w2 = _expert_stack(E, H, inter, seed=4)
    assert w13.codes.numel() > BIG
    x = torch.randn(m, H, device="cuda").to(BF16)
    gen = torch.Generator().manual_seed(5)
    ids = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(m)]).to(torch.int32).cuda()
    weights = torch.full((m, 2), 0.5, device="cuda")
    got = moe.moe_experts(x, weights, ids + (E - 8), w13, w2)
    want = moe.moe_experts(x, weights, ids, _tail(w13, 8), _tail(w2, 8))
    _equal(got, want, f"experts M={m}")


def test_gpu_moe_block_router_reads_rows_past_2_31():
    """moe_block's fused router GEMM (M <= 16) on a strided x whose last row starts past element 2^31."""
    E, H, inter = 64, 2048, 256
    x = _strided_rows(3, H, seed=6)
    router = (torch.randn(E, H, device="cuda") * 0.05).to(BF16)
    w13, w2 = _expert_stack(E, 2 * inter, H, seed=7), _expert_stack(E, H, inter, seed=8)
    _equal(moe.moe_block(x, router, w13, w2, top_k=4), moe.moe_block(x.contiguous(), router, w13, w2, top_k=4),
           "moe_block")
