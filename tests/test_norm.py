"""RMSNorm (Qwen3-Next / Qwen3.5, zero-centred weight) with the fused residual add: the Triton kernel against the
torch reference (over the family's check matrix, ``lynn_kernels/norm/check.py``, and on in-place, strided and widest
inputs), the reference against HF transformers' own ``Qwen3_5RMSNorm`` (bit for bit), the kernel against HF (within
one bf16 step), and errors.

Kernel tests run under Triton's interpreter on the CPU with every fresh allocation poisoned with NaN; each case is one
launch of a few programs (milliseconds).
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_case_passes, check_cases
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm

from lynn_kernels import norm, rmsnorm, runtime, use_reference
from lynn_kernels.metrics import bit_mismatches
from lynn_kernels.norm import reference
from lynn_kernels.norm.check import MAX_ULPS, ulps

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
DTYPES = [pytest.param(BF16, id="bf16"), pytest.param(FP16, id="fp16"), pytest.param(FP32, id="fp32")]


def assert_close_to_reference(y: torch.Tensor, want: torch.Tensor) -> None:
    """Within the check matrix's ``MAX_ULPS`` of the reference: one step of bf16 / fp16, a few of fp32."""
    assert y.dtype == want.dtype and y.shape == want.shape
    assert torch.isfinite(y.float()).all()
    assert ulps(y, want) <= MAX_ULPS[y.dtype]


def equal_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and ulps(a, b) == 0


def make_inputs(shape, dtype, make_weight, seed=0):
    x = make_weight(shape, dtype, seed=seed, scale=3.0)
    res = make_weight(shape, dtype, seed=seed + 1)
    w = make_weight(shape[-1:], FP32, seed=seed + 2, scale=0.3)     # zero-centred, as Qwen stores it
    return x, res, w


# ---------------------------------------------------------------------------------------------------------------
# 1. kernel vs reference


@pytest.mark.parametrize("case", check_cases("norm"))
def test_kernel_matches_reference(case, poison_empty):
    """Every dtype of x times the check matrix's shapes (residual or not, each weight dtype), an output never
    written showing up as NaN."""
    assert_case_passes(case)


def mismatch_fraction(a: torch.Tensor, b: torch.Tensor) -> float:
    return bit_mismatches(a, b) / a.numel()


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
def test_kernel_rounds_where_the_reference_does(dtype, poison_empty, make_weight):
    """Off by one step only where the row statistic's last bit differs: ~1e-5 of the outputs. A kernel that rounds
    once more (the normalised h before ``* (1 + w)``, or the sum ``x + residual`` not before the norm) is off in
    ~20% of them while staying within one step."""
    x, res, w = make_inputs((16, 2048), dtype, make_weight, seed=11)
    y, h = rmsnorm(x, w, residual=res)
    y_ref, h_ref = reference.rmsnorm(x, w, residual=res)
    assert mismatch_fraction(y, y_ref) <= 1e-3
    assert mismatch_fraction(rmsnorm(x, w), reference.rmsnorm(x, w)) <= 1e-3


@pytest.mark.parametrize("dtype", DTYPES)
def test_outputs_in_place(dtype, poison_empty, make_weight):
    """``out`` and ``residual_out = residual`` (the decode step's in-place residual stream) are written and
    returned; the reference backend does the same."""
    x, res, w = make_inputs((2, 3, 64), dtype, make_weight)
    y_ref, h_ref = reference.rmsnorm(x, w, 1e-6, residual=res)
    for ref_backend in (False, True):
        r = res.clone()
        out = poison_empty(torch.empty_like(x))
        with use_reference(ref_backend):
            y, h = rmsnorm(x, w, 1e-6, residual=r, out=out, residual_out=r)
        assert y is out and h is r
        assert equal_bits(h, h_ref)
        assert_close_to_reference(y, y_ref)
    out, h_out = torch.empty_like(x), torch.empty_like(x)      # separate preallocated outputs, no residual: out only
    y, h = rmsnorm(x, w, residual=res, out=out, residual_out=h_out)
    assert y is out and h is h_out and equal_bits(h, h_ref)
    assert rmsnorm(x, w, out=out) is out
    assert_close_to_reference(out, reference.rmsnorm(x, w))


def test_residual_out_may_be_x(poison_empty, make_weight):
    x, res, w = make_inputs((4, 32), BF16, make_weight)
    y_ref, h_ref = reference.rmsnorm(x, w, residual=res)
    xi = x.clone()
    y, h = rmsnorm(xi, w, residual=res, residual_out=xi)
    assert h is xi and equal_bits(h, h_ref)
    assert_close_to_reference(y, y_ref)


def test_strided_inputs(poison_empty, make_weight):
    """Rows with a stride (a slice of a wider buffer) are read in place; a strided last dim is copied first."""
    big = make_weight((6, 2, 160), BF16, seed=4, scale=2.0)
    x = big[:, 0, 16:116]                                            # [6, 100], row stride 320
    res = make_weight((6, 100, 2), BF16, seed=5)[..., 1]             # last-dim stride 2
    w = make_weight((2, 100), FP32, seed=6, scale=0.3)[1]
    y, h = rmsnorm(x, w, residual=res)
    y_ref, h_ref = reference.rmsnorm(x, w, residual=res)
    assert y.is_contiguous() and h.is_contiguous()
    assert equal_bits(h, h_ref)
    assert_close_to_reference(y, y_ref)


def test_widest_row(poison_empty, make_weight):
    x, res, w = make_inputs((2, norm.MAX_D), BF16, make_weight, seed=7)
    y, h = rmsnorm(x, w, residual=res)
    y_ref, h_ref = reference.rmsnorm(x, w, residual=res)
    assert equal_bits(h, h_ref)
    assert_close_to_reference(y, y_ref)


def test_zero_rows_and_zero_input(device):
    """No rows: empty outputs, no launch. An all-zero row normalises to 0 (eps > 0 keeps it finite)."""
    w = torch.zeros(8, device=device)
    y, h = rmsnorm(torch.zeros(0, 8, device=device), w, residual=torch.zeros(0, 8, device=device))
    assert y.shape == h.shape == (0, 8)
    assert (rmsnorm(torch.zeros(2, 8, device=device, dtype=BF16), w) == 0).all()


def test_reference_backend_runs_the_reference(make_weight):
    x, _, w = make_inputs((3, 5, 100), FP32, make_weight, seed=8)
    with use_reference():
        assert runtime.backend() == "reference"
        assert equal_bits(rmsnorm(x, w), reference.rmsnorm(x, w))
    assert rmsnorm.reference is reference.rmsnorm


# ---------------------------------------------------------------------------------------------------------------
# 2. against HF transformers


def _hf_norm(cls, D, w_dtype, seed=0):
    mod = cls(D, eps=1e-6).to(w_dtype)
    with torch.no_grad():                            # HF initialises the weight to 0: perturb it, or (1 + w) is 1
        mod.weight.copy_(torch.randn(D, generator=torch.Generator().manual_seed(seed)) * 0.3)
    return mod


@pytest.mark.oracle("transformers")
@pytest.mark.parametrize("cls", [Qwen3_5RMSNorm, Qwen3NextRMSNorm], ids=["qwen3_5", "qwen3_next"])
@pytest.mark.parametrize("w_dtype", [BF16, FP32], ids=["w_bf16", "w_fp32"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_equals_hf(dtype, w_dtype, cls, make_weight):
    """HF's math op for op: bit for bit, with and without the residual add of HF's decoder layer."""
    D = 256
    hf = _hf_norm(cls, D, w_dtype)
    x, res, _ = make_inputs((3, 5, D), dtype, make_weight, seed=9)
    x, res, w = x.cpu(), res.cpu(), hf.weight.detach()
    with torch.no_grad():
        want = hf(x)
        h_want = res + x                                          # Qwen3_5DecoderLayer: residual + hidden_states
        y_want = hf(h_want)
    assert equal_bits(reference.rmsnorm(x, w, hf.eps), want)
    y, h = reference.rmsnorm(x, w, hf.eps, residual=res)
    assert equal_bits(h, h_want) and equal_bits(y, y_want)


@pytest.mark.oracle("transformers")
@pytest.mark.parametrize("D", [100, 2048])
def test_kernel_within_one_bf16_ulp_of_hf(D, poison_empty, make_weight):
    hf = _hf_norm(Qwen3_5RMSNorm, D, BF16, seed=1)
    x, res, _ = make_inputs((3, 5, D), BF16, make_weight, seed=10)
    w = hf.weight.detach().to(x.device)
    with torch.no_grad():
        want = hf(x.cpu())
        y_want = hf((res + x).cpu())
    y = rmsnorm(x, w, hf.eps)
    assert ulps(y, want) <= 1 and mismatch_fraction(y, want) <= 1e-3
    y, h = rmsnorm(x, w, hf.eps, residual=res)
    assert equal_bits(h.cpu(), (res + x).cpu())
    assert ulps(y, y_want) <= 1 and mismatch_fraction(y, y_want) <= 1e-3


# ---------------------------------------------------------------------------------------------------------------
# 3. errors, the same on both backends


def _bad_cases(device):
    x = torch.zeros(2, 8, device=device)
    w = torch.zeros(8, device=device)
    r = torch.zeros(2, 8, device=device)
    return [
        ("x int", lambda f: f(x.to(torch.int32), w), TypeError, "x has dtype torch.int32"),
        ("x fp64", lambda f: f(x.double(), w), TypeError, "x has dtype torch.float64"),
        ("x list", lambda f: f([[1.0]], w), TypeError, "x must be a torch.Tensor"),
        ("weight int", lambda f: f(x, w.to(torch.int64)), TypeError, "weight has dtype torch.int64"),
        ("weight length", lambda f: f(x, w[:7]), ValueError, r"weight must have shape \[D\] = \(8,\)"),
        ("weight 2-D", lambda f: f(x, w[None]), ValueError, r"weight must have shape \[D\] = \(8,\)"),
        ("x 0-D", lambda f: f(x[0, 0], w), ValueError, r"x must be \[\.\.\., D\] with D >= 1"),
        ("D = 0", lambda f: f(x[:, :0], w[:0]), ValueError, r"x must be \[\.\.\., D\] with D >= 1"),
        ("eps 0", lambda f: f(x, w, 0), ValueError, "eps must be a positive finite Python number .* got 0"),
        ("eps < 0", lambda f: f(x, w, -1e-6), ValueError, "eps must be a positive finite Python number"),
        ("eps nan", lambda f: f(x, w, float("nan")), ValueError, "eps must be a positive finite Python number"),
        ("eps str", lambda f: f(x, w, "1e-6"), TypeError, "eps must be a positive finite Python number"),
        ("residual dtype", lambda f: f(x, w, residual=r.to(BF16)), TypeError,
         "residual has dtype torch.bfloat16 but x has torch.float32"),
        ("residual shape", lambda f: f(x, w, residual=r[:1]), ValueError, r"residual must have the shape of x"),
        ("out dtype", lambda f: f(x, w, out=r.to(FP16)), TypeError, "out has dtype torch.float16 but x has"),
        ("out shape", lambda f: f(x, w, out=r[:, :4]), ValueError, "out must have the shape of x"),
        ("out strided", lambda f: f(x, w, out=torch.zeros(8, 2, device=device).t()), ValueError,
         "out must be contiguous"),
        ("out is x", lambda f: f(x, w, out=x), ValueError, "out shares memory with x"),
        ("out is residual", lambda f: f(x, w, residual=r, out=r), ValueError, "out shares memory with residual"),
        ("out is residual_out", lambda f: f(x, w, residual=r, out=(o := torch.zeros_like(x)), residual_out=o),
         ValueError, "out shares memory with residual_out"),
        ("residual_out alone", lambda f: f(x, w, residual_out=r), ValueError, "residual_out is given without residual"),
        ("residual_out dtype", lambda f: f(x, w, residual=r, residual_out=r.to(BF16)), TypeError,
         "residual_out has dtype torch.bfloat16"),
        ("residual_out shifted", lambda f: f(x, w, residual=(b := torch.zeros(24, device=device))[:16].view(2, 8),
                                             residual_out=b[1:17].view(2, 8)), ValueError,
         "residual_out overlaps residual without being the same view"),
    ]


@pytest.mark.parametrize("backend", ["kernel", "reference"])
def test_bad_arguments_name_the_tensor(backend, device):
    fn = rmsnorm if backend == "kernel" else reference.rmsnorm
    for what, call, error, match in _bad_cases(device):
        with pytest.raises(error, match=match):
            call(fn)
            pytest.fail(f"{what}: no error")


def test_kernel_only_limits():
    """The row width the kernel holds in registers, and tensors it cannot reach (here on the meta device)."""
    x = torch.zeros(1, norm.MAX_D + 1, device=runtime.DEVICE)
    with pytest.raises(ValueError, match=r"D=16385 is unsupported"):
        rmsnorm(x, torch.zeros(norm.MAX_D + 1, device=runtime.DEVICE))
    with pytest.raises(ValueError, match="x is on meta"):
        rmsnorm(torch.zeros(2, 8, device="meta"), torch.zeros(8, device="meta"))
    with pytest.raises(ValueError, match="weight is on .* but x is on"):
        rmsnorm(torch.zeros(2, 8, device=runtime.DEVICE), torch.zeros(8, device="meta"))
