"""Packed W4A16 matmul: every entry point (``nvfp4_linear``, ``nvfp4_gemv``, ``nvfp4_gemm``, the launch functions,
``NVFP4Linear``, ``quantize_linears``) against the reference (dequantise, then one fp32 matmul). The sweep of awkward
shapes, dtypes and bias forms is the ``lynn check`` matrix (``lynn_kernels/matmul/check.py: SHAPES``), run here case by
case; the rest of the module tests layouts, dispatch, split-K, weight forms and errors.

Tolerances (the kernel and the reference add the same fp32 products in a different order, then round once):

* fp32 output: ``rel_l2 < 1e-5``;
* bf16 / fp16 output: one output rounding per element, ``|y - ref| <= eps(dtype) * |ref| + 1e-6 * max|ref|``, and
  ``cosine > 0.99999``.

Kernel tests run under Triton's interpreter on the CPU (small shapes) with every fresh allocation poisoned, so an
output element a kernel forgets to write shows up as NaN.
"""

from __future__ import annotations

import copy

import pytest
import torch
import triton
import triton.language as tl
from conftest import assert_case_passes, check_cases
from torch import nn

import lynn_kernels
from lynn_kernels import triton_shared
from lynn_kernels.matmul import (
    NVFP4Linear,
    PackedNVFP4,
    nvfp4_gemm,
    nvfp4_gemv,
    nvfp4_linear,
    pack,
    packed,
    quantize_linears,
    reference,
    triton_matmul,
    unpack,
)
from lynn_kernels.matmul.triton_matmul import launch_gemm, launch_gemv
from lynn_kernels.matmul.triton_packed import launch_packed_gemv
from lynn_kernels.metrics import bit_mismatches, compare
from lynn_kernels.nvfp4 import NVFP4Tensor
from lynn_kernels.nvfp4 import reference as nvfp4_reference
from lynn_kernels.triton_shared import _counters, packed_w_tile, split_k_for

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

DTYPES = [pytest.param(BF16, id="bf16"), pytest.param(FP16, id="fp16"), pytest.param(FP32, id="fp32")]
OPS = [pytest.param(nvfp4_linear, id="linear"), pytest.param(nvfp4_gemv, id="gemv"),
       pytest.param(nvfp4_gemm, id="gemm")]


def _mnk(m, n, k):
    return pytest.param((m, n, k), id=f"M{m}-N{n}-K{k}")


ONE_ROUNDING_ABS = 1e-6     # the abs part of the bf16 / fp16 bound, times max|ref|


# ---------------------------------------------------------------------------------------------------------------
# helpers


@pytest.fixture
def make_nvfp4(make_weight):
    """``make_nvfp4(n, k, seed=0, recipe="modelopt", scale=0.05)``: a Gaussian ``[n, k]`` weight quantised by the
    torch reference (the quantise kernel is tested in test_nvfp4.py; here it would only cost interpreter time)."""

    def make(n, k, seed=0, recipe="modelopt", scale=0.05) -> NVFP4Tensor:
        return nvfp4_reference.quantize(make_weight((n, k), FP32, seed=seed, scale=scale), recipe=recipe)

    return make


def make_bias(n, dtype, device, seed=99):
    if dtype is None:
        return None
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)


def assert_close_to_reference(y: torch.Tensor, ref: torch.Tensor, what: str = "") -> None:
    """``y`` within the tolerance of the module docstring of ``ref`` (same dtype and shape, finite)."""
    assert y.dtype == ref.dtype, f"{what}: dtype {y.dtype}, expected {ref.dtype}"
    assert tuple(y.shape) == tuple(ref.shape), f"{what}: shape {tuple(y.shape)}, expected {tuple(ref.shape)}"
    if y.numel() == 0:
        return
    m = compare(y, ref)
    assert bool(torch.isfinite(y).all()), f"{what}: non-finite output (unwritten or poisoned): {m}"
    if y.dtype == FP32:
        assert m.rel_l2 < 1e-5, f"{what}: {m}"
        return
    r = ref.detach().double().cpu()
    err = (y.detach().double().cpu() - r).abs()
    bound = torch.finfo(y.dtype).eps * r.abs() + ONE_ROUNDING_ABS * r.abs().max()
    over = int((err > bound).sum())
    assert over == 0, (f"{what}: {over} of {y.numel()} elements differ by more than one {y.dtype} rounding "
                       f"(worst {float((err - bound).max()):.3g} over the bound): {m}")
    assert m.cosine > 0.99999, f"{what}: {m}"


def assert_bit_equal(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    assert got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape), what
    m = compare(got, want, exact=True)
    assert m.mismatches == 0, f"{m.mismatches} of {m.numel} elements differ in bits {what}: {m}"


def assert_counters_zeroed(what: str = "") -> None:
    for dev, buf in _counters.items():
        assert int(buf.count_nonzero()) == 0, f"split-K counters on {dev} left non-zero {what}: " \
                                              f"{buf.nonzero().flatten()[:8].tolist()}"


# ---------------------------------------------------------------------------------------------------------------
# 0. the poison really reaches the kernels' outputs


class _NoLaunch:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](...)`` does nothing, so no output gets written."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@pytest.mark.parametrize("m", [pytest.param(3, id="gemv-M3"), pytest.param(17, id="gemm-M17")])
def test_poison_catches_an_unwritten_output(m, monkeypatch, make_weight, make_nvfp4, poison_empty):
    monkeypatch.setattr(triton_matmul.NVFP4_GEMV, "shipped", _NoLaunch())
    monkeypatch.setattr(triton_matmul.NVFP4_GEMM, "shipped", _NoLaunch())
    y = nvfp4_linear(make_weight((m, 48), BF16, seed=1), make_nvfp4(37, 48))
    assert torch.isnan(y).all()


# ---------------------------------------------------------------------------------------------------------------
# 1. nvfp4_linear against the reference


@pytest.mark.parametrize("case", check_cases("matmul", "matmul.nvfp4_gemv", "matmul.nvfp4_gemm"))
def test_nvfp4_linear_matches_reference(case, poison_empty):
    """Each shape of the check matrix through ``nvfp4_gemv`` (M <= 16), ``nvfp4_gemm`` and ``nvfp4_linear`` on both
    layouts, and the packed layout's kernels on their own (the packed GEMV, the tensor-core GEMV, the
    dequantise-then-cuBLAS path): every output of x's dtype within one rounding of the reference."""
    assert_case_passes(case)


@pytest.mark.parametrize("m,kernel", [(1, "gemv"), (16, "gemv"), (17, "gemm"), (129, "gemm")])
def test_linear_picks_gemv_up_to_16_rows(m, kernel, monkeypatch, make_weight, make_nvfp4, poison_empty):
    calls = []
    for name in ("launch_gemv", "launch_gemm"):
        real = getattr(triton_matmul, name)
        monkeypatch.setattr(triton_matmul, name,
                            lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw))
    x = make_weight((m, 48), FP32, seed=3)
    w = make_nvfp4(37, 48)
    assert_close_to_reference(nvfp4_linear(x, w), reference.nvfp4_linear(x, w))
    assert calls == [f"launch_{kernel}"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lead", [pytest.param((1, 1), id="1x1"), pytest.param((2, 5), id="2x5-gemv"),
                                  pytest.param((2, 8), id="2x8-gemv"), pytest.param((3, 7), id="3x7-gemm")])
def test_linear_3d_input(lead, dtype, make_weight, make_nvfp4, device, poison_empty):
    x = make_weight((*lead, 208), dtype, seed=sum(lead))
    w = make_nvfp4(37, 208, seed=1)
    bias = make_bias(37, FP32, device)
    y = nvfp4_linear(x, w, bias)
    assert tuple(y.shape) == (*lead, 37)
    assert_close_to_reference(y, reference.nvfp4_linear(x, w, bias), f"x {tuple(x.shape)}")
    assert_bit_equal(y.reshape(-1, 37), nvfp4_linear(x.reshape(-1, 208), w, bias), "3-D vs flattened")


def test_linear_1d_input(make_weight, make_nvfp4, poison_empty):
    x = make_weight((48,), BF16, seed=5)
    w = make_nvfp4(37, 48)
    y = nvfp4_linear(x, w)
    assert tuple(y.shape) == (37,)
    assert_close_to_reference(y, reference.nvfp4_linear(x, w))


def _strided_x(view: str, m: int, k: int, dtype, make_weight) -> torch.Tensor:
    if view == "transposed":                                    # strides (1, M)
        return make_weight((k, m), dtype, seed=11).t()
    if view == "k-stride-2":                                    # x[:, ::2] of a wider tensor: stride 2 along K
        return make_weight((m, 2 * k), dtype, seed=12)[:, ::2]
    if view == "row-slice":                                     # the first K columns of a wider tensor
        return make_weight((m, k + 32), dtype, seed=13)[:, 16:16 + k]
    if view == "expanded":                                      # one row broadcast: stride 0 along M
        return make_weight((1, k), dtype, seed=14).expand(m, k)
    if view == "3d-transposed":                                 # [T, B, K] -> [B, T, K]
        return make_weight((m, 2, k), dtype, seed=15).transpose(0, 1)
    raise ValueError(view)


@pytest.mark.parametrize("dtype", [pytest.param(BF16, id="bf16"), pytest.param(FP32, id="fp32")])
@pytest.mark.parametrize("m", [pytest.param(3, id="gemv-M3"), pytest.param(17, id="gemm-M17")])
@pytest.mark.parametrize("view", ["transposed", "k-stride-2", "row-slice", "expanded", "3d-transposed"])
def test_linear_non_contiguous_x(view, m, dtype, make_weight, make_nvfp4, poison_empty):
    x = _strided_x(view, m, 208, dtype, make_weight)
    assert not x.is_contiguous()
    w = make_nvfp4(65, 208, seed=2)
    y = nvfp4_linear(x, w)
    assert_close_to_reference(y, reference.nvfp4_linear(x, w), view)
    assert_bit_equal(y, nvfp4_linear(x.contiguous(), w), f"{view} vs contiguous copy")


@pytest.mark.parametrize("bias_dtype", [pytest.param(None, id="nobias"), pytest.param(FP32, id="bias")])
@pytest.mark.parametrize("lead", [pytest.param((0,), id="0"), pytest.param((2, 0), id="2x0")])
@pytest.mark.parametrize("op", OPS)
def test_empty_input_gives_empty_output(op, lead, bias_dtype, make_nvfp4, device, poison_empty):
    x = torch.zeros((*lead, 48), dtype=BF16, device=device)
    y = op(x, make_nvfp4(37, 48), make_bias(37, bias_dtype, device))
    assert tuple(y.shape) == (*lead, 37) and y.dtype == BF16 and y.device == x.device


# ---------------------------------------------------------------------------------------------------------------
# 2. nvfp4_gemv and nvfp4_gemm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3, 16])
def test_gemv_and_gemm_agree(m, dtype, make_weight, make_nvfp4, device, poison_empty):
    x = make_weight((m, 400), dtype, seed=m + 40)
    w = make_nvfp4(37, 400, seed=5)
    bias = make_bias(37, BF16, device)
    assert_close_to_reference(nvfp4_gemv(x, w, bias), nvfp4_gemm(x, w, bias), f"gemv vs gemm, M={m}")


@pytest.mark.parametrize("lead", [pytest.param((17,), id="17"), pytest.param((2, 9), id="2x9")])
def test_gemv_rejects_more_than_16_rows(lead, make_weight, make_nvfp4):
    x = make_weight((*lead, 48), BF16)
    with pytest.raises(ValueError, match=r"nvfp4_gemv takes at most 16 rows of x, got M = 1[78]"):
        nvfp4_gemv(x, make_nvfp4(37, 48))


# ---------------------------------------------------------------------------------------------------------------
# 3. split-K: the heuristic, forced splits, the counters, determinism


def test_split_k_for_never_leaves_an_empty_slice():
    for sms in (1, 4, 132):
        for tiles in (1, 2, 3, 5, 8, 63, 200, 300):
            for block_k in (16, 64, 128, 256):
                for k in range(16, 4097, 16 * 7):
                    chunks = -(-k // block_k)
                    split = split_k_for(tiles, k, block_k, sms)
                    case = f"tiles={tiles} K={k} BLOCK_K={block_k} sms={sms}: split {split}, {chunks} chunks"
                    assert 1 <= split <= min(chunks, triton_shared.MAX_SPLIT_K), case
                    per = -(-chunks // split)
                    assert (split - 1) * per < chunks, f"the last slice is empty; {case}"
                    if tiles >= 2 * sms:
                        assert split == 1, f"enough tiles to fill the SMs but still split; {case}"


# K = 48 in chunks of 16: 2 splits take 2 + 1 chunks, 3 splits one each (the interpreter pays per chunk)
GEMV_CONFIG = {"BLOCK_N": 64, "BLOCK_K": 16, "num_warps": 4}
GEMM_CONFIG = {"BLOCK_N": 64, "BLOCK_M": 32, "BLOCK_K": 16, "num_warps": 4, "num_stages": 3}


@pytest.mark.parametrize("split", [1, 2, 3])
@pytest.mark.parametrize("m,n,launch,config", [
    pytest.param(3, 37, launch_gemv, GEMV_CONFIG, id="gemv-M3-N37"),
    pytest.param(16, 65, launch_gemv, GEMV_CONFIG, id="gemv-M16-N65"),
    pytest.param(20, 37, launch_gemm, GEMM_CONFIG, id="gemm-M20-N37"),
    pytest.param(33, 65, launch_gemm, GEMM_CONFIG, id="gemm-M33-N65"),          # 2 x 2 tiles, 1-row tails
])
def test_launch_forced_split_k(m, n, launch, config, split, make_weight, make_nvfp4, device, poison_empty):
    """bf16 x (its int16-bits path under the interpreter); the partials and their sum are fp32 whatever x is."""
    dtype = BF16
    x = make_weight((m, 48), dtype, seed=m)
    w = make_nvfp4(n, 48, seed=n)
    bias = make_bias(n, BF16, device)
    ys = []
    for _ in range(2):
        y = torch.empty((m, n), dtype=dtype, device=device)                   # poisoned
        assert launch(x, w, bias, y, config=config, split_k=split) is y
        assert_counters_zeroed(f"after split_k={split}")
        ys.append(y)
    assert_close_to_reference(ys[0], reference.nvfp4_linear(x, w, bias), f"split_k={split}")
    assert_bit_equal(ys[1], ys[0], "second call")


@pytest.mark.parametrize("m,n,k", [pytest.param(1, 37, 1040, id="gemv-M1"), pytest.param(17, 37, 1040, id="gemm-M17")])
def test_default_split_k_is_deterministic(m, n, k, make_weight, make_nvfp4, device, poison_empty):
    """The interpreter pretends to have 4 SMs, so these shapes split K by default (checked here, not assumed)."""
    sms = triton_matmul._sm_count(device)
    if m <= triton_matmul.GEMV_MAX_M:
        cfg = triton_matmul.GEMV_CONFIG
        split = split_k_for(-(-n // cfg["BLOCK_N"]), k, cfg["BLOCK_K"], sms)
    else:                                                   # below M = 256 the bucket has one config
        bn, bm, bk, *_ = triton_matmul.GEMM_SMALL_M[triton_matmul.m_bucket(m)]
        split = triton_matmul._gemm_split({"BLOCK_N": bn, "BLOCK_M": bm, "BLOCK_K": bk}, m, n, k, sms)
    assert split > 1, "the shape no longer splits K: pick another"
    x = make_weight((m, k), BF16, seed=6)
    w = make_nvfp4(n, k, seed=6)
    y1 = nvfp4_linear(x, w)
    assert_counters_zeroed()
    y2 = nvfp4_linear(x, w)
    assert_counters_zeroed()
    assert_bit_equal(y2, y1, "second call")
    assert_close_to_reference(y1, reference.nvfp4_linear(x, w))


@pytest.mark.parametrize("config", [
    pytest.param({"BLOCK_N": 16, "BLOCK_K": 32, "num_warps": 2}, id="N16-K32"),
    pytest.param({"BLOCK_N": 128, "BLOCK_K": 512, "num_warps": 8}, id="N128-K512"),
])
def test_launch_gemv_config_override(config, make_weight, make_nvfp4, device, poison_empty):
    x = make_weight((5, 208), BF16, seed=7)
    w = make_nvfp4(65, 208, seed=7)
    y = launch_gemv(x, w, None, torch.empty((5, 65), dtype=BF16, device=device), config=config)
    assert_counters_zeroed()
    assert_close_to_reference(y, reference.nvfp4_linear(x, w), str(config))


class _Recorder:
    """Stands in for the GEMM kernel's ``.fn``: records the grid and the workspace instead of launching."""

    def __init__(self):
        self.calls = []

    @property
    def fn(self):
        return self

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append((grid, args[6], args[7]))                          # grid, part, count
        return launch


def test_launch_gemm_config_workspace_fits_its_split(monkeypatch, make_weight, make_nvfp4, device):
    """A config with a smaller BLOCK_K than any built-in one splits K more; its workspace must hold every partial.
    (Launched for real, this case writes past the end of ``y`` and crashes the interpreter.)"""
    rec = _Recorder()
    monkeypatch.setattr(triton_matmul.NVFP4_GEMM, "shipped", rec)
    m, n = 20, 37
    x = make_weight((m, 48), BF16)
    launch_gemm(x, make_nvfp4(n, 48), None, torch.empty((m, n), dtype=BF16, device=device),
                config={"BLOCK_N": 64, "BLOCK_M": 32, "BLOCK_K": 16})
    (grid, part, count), = rec.calls
    split = grid[1]
    assert split == 1 or (part.dtype == FP32 and part.numel() >= split * m * n), \
        f"split {split} needs {split * m * n} fp32 partials; the workspace is {part.dtype} x {part.numel()}"


# ---------------------------------------------------------------------------------------------------------------
# 4. weights: a global scale per row, the compressed-tensors recipe


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [pytest.param(3, id="gemv-M3"), pytest.param(17, id="gemm-M17")])
def test_global_scale_per_row(m, dtype, make_weight, make_nvfp4, device, poison_empty):
    q = make_nvfp4(65, 208, seed=8)
    g = torch.rand(65, generator=torch.Generator().manual_seed(8)).to(device) + 0.5
    w = NVFP4Tensor(q.codes, q.scales, g)
    assert w.rows_per_global() == 1
    x = make_weight((m, 208), dtype, seed=m)
    bias = make_bias(65, FP32, device)
    assert_close_to_reference(nvfp4_linear(x, w, bias), reference.nvfp4_linear(x, w, bias), "g [N]")


@pytest.mark.parametrize("dtype", [pytest.param(BF16, id="bf16"), pytest.param(FP32, id="fp32")])
@pytest.mark.parametrize("m", [pytest.param(3, id="gemv-M3"), pytest.param(17, id="gemm-M17")])
def test_global_scale_per_row_groups(m, dtype, make_weight, device, poison_empty):
    """Three row groups of very different magnitude, each quantised with its own global scale, then concatenated
    with the scale repeated per row: each group's columns of y match the product with that group alone."""
    sizes, mags = (5, 37, 23), (1e-3, 1.0, 300.0)
    groups = [nvfp4_reference.quantize(make_weight((r, 208), FP32, seed=i, scale=s))
              for i, (r, s) in enumerate(zip(sizes, mags))]
    w = NVFP4Tensor(torch.cat([q.codes for q in groups]), torch.cat([q.scales for q in groups]),
                    torch.cat([q.global_scale.reshape(1).expand(r) for q, r in zip(groups, sizes)]))
    x = make_weight((m, 208), dtype, seed=m)
    y = nvfp4_linear(x, w)
    assert_close_to_reference(y, reference.nvfp4_linear(x, w), "row groups")
    for i, (q, part) in enumerate(zip(groups, y.split(sizes, dim=-1))):
        assert_close_to_reference(part, reference.nvfp4_linear(x, q), f"row group {i} (x {mags[i]})")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [pytest.param(1, id="gemv-M1"), pytest.param(129, id="gemm-M129")])
def test_compressed_tensors_weight(m, dtype, make_weight, make_nvfp4, device, poison_empty):
    q = make_nvfp4(37, 400, seed=9, recipe="compressed-tensors")
    loaded = NVFP4Tensor.from_compressed_tensors(**q.to_compressed_tensors())
    x = make_weight((m, 400), dtype, seed=m)
    bias = make_bias(37, BF16, device)
    for w, what in ((q, "quantised"), (loaded, "loaded")):
        assert_close_to_reference(nvfp4_linear(x, w, bias), reference.nvfp4_linear(x, w, bias), what)


# ---------------------------------------------------------------------------------------------------------------
# 5. the reference backend


@pytest.mark.parametrize("op", OPS)
def test_reference_backend_returns_the_reference(op, make_weight, make_nvfp4, device, monkeypatch):
    def no_kernel(*args, **kwargs):
        raise AssertionError("a kernel was launched under use_reference()")

    monkeypatch.setattr(triton_matmul, "launch_gemv", no_kernel)
    monkeypatch.setattr(triton_matmul, "launch_gemm", no_kernel)
    x = make_weight((2, 3, 208), BF16, seed=10)
    w = make_nvfp4(37, 208)
    bias = make_bias(37, FP32, device)
    with lynn_kernels.use_reference():
        assert lynn_kernels.backend() == "reference"
        got = op(x, w, bias)
    assert_bit_equal(got, reference.nvfp4_linear(x, w, bias))


# ---------------------------------------------------------------------------------------------------------------
# 6. NVFP4Linear


def _blank_linear(n: int, k: int, bias_dtype, device) -> NVFP4Linear:
    """An NVFP4Linear of the given shape with placeholder contents (zero codes and scales, global scale 1)."""
    w = NVFP4Tensor(torch.zeros(n, k // 2, dtype=torch.uint8, device=device),
                    torch.zeros(n, k // 16, dtype=torch.float8_e4m3fn, device=device),
                    torch.ones((), device=device))
    return NVFP4Linear(w, None if bias_dtype is None else torch.zeros(n, dtype=bias_dtype, device=device))


@pytest.mark.parametrize("recipe", ["modelopt", "compressed-tensors"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("m", [pytest.param(5, id="gemv-M5"), pytest.param(20, id="gemm-M20")])
def test_nvfp4_linear_module_matches_reference(m, bias, recipe, make_weight, device, poison_empty):
    torch.manual_seed(0)
    dense = nn.Linear(208, 37, bias=bias, dtype=BF16, device=device)
    lin = NVFP4Linear.from_linear(dense, recipe=recipe)
    assert (lin.in_features, lin.out_features) == (208, 37)
    assert (lin.bias is None) == (not bias)
    if bias:
        assert lin.bias.dtype == BF16 and not lin.bias.requires_grad
        assert_bit_equal(lin.bias.data, dense.bias.data, "bias kept as is")
    want_w = nvfp4_reference.quantize(dense.weight.detach(), recipe=recipe)
    assert bit_mismatches(lin.codes, want_w.codes) == 0 and bit_mismatches(lin.global_scale, want_w.global_scale) == 0
    x = make_weight((m, 208), BF16, seed=m)
    y = lin(x)
    assert_close_to_reference(y, reference.nvfp4_linear(x, lin.weight, lin.bias), "module")
    # and close to the dense layer: NVFP4 keeps the direction
    assert compare(y, dense(x).float()).cosine > 0.99


def test_nvfp4_linear_module_state_dict_round_trip(make_weight, device, poison_empty):
    torch.manual_seed(1)
    lin = NVFP4Linear.from_linear(nn.Linear(48, 37, dtype=BF16, device=device))
    sd = lin.state_dict()
    assert set(sd) == {"codes", "scales", "global_scale", "bias"}
    x = make_weight((3, 48), BF16, seed=3)
    want = lin(x)
    fresh = _blank_linear(37, 48, BF16, device)
    fresh.load_state_dict(sd)
    for key, t in fresh.state_dict().items():
        assert bit_mismatches(t, sd[key]) == 0, key
    assert_bit_equal(fresh(x), want, "loaded into a fresh module")
    # gpt-fast style: build on the meta device, then assign the loaded tensors
    with torch.device("meta"):
        on_meta = _blank_linear(37, 48, BF16, "meta")
    on_meta.load_state_dict(sd, assign=True)
    assert on_meta.codes.device == device
    assert_bit_equal(on_meta(x), want, "assigned onto a meta module")


def test_nvfp4_linear_module_to_device_and_repr(make_weight, device, poison_empty):
    torch.manual_seed(2)
    lin = NVFP4Linear.from_linear(nn.Linear(48, 37, bias=False, dtype=BF16, device=device))
    x = make_weight((3, 48), BF16, seed=4)
    want = lin(x)
    assert lin.to("cpu") is lin
    assert {t.device.type for t in lin.state_dict().values()} == {"cpu"} and lin.weight.device.type == "cpu"
    assert (lin.codes.dtype, lin.scales.dtype, lin.global_scale.dtype) == (torch.uint8, torch.float8_e4m3fn, FP32)
    assert_bit_equal(lin.to(device)(x), want, "after .to('cpu') and back")
    assert lin.extra_repr() == "in_features=48, out_features=37, bias=False"
    assert repr(lin) == "NVFP4Linear(in_features=48, out_features=37, bias=False)"
    assert "bias=True" in repr(NVFP4Linear.from_linear(nn.Linear(16, 1, device=device)))


def test_nvfp4_linear_module_survives_to_dtype(make_weight, device):
    lin = NVFP4Linear.from_linear(nn.Linear(48, 37, dtype=BF16, device=device))
    lin.to(BF16)
    assert lin.scales.dtype == torch.float8_e4m3fn and lin.global_scale.dtype == FP32
    lin(make_weight((3, 48), BF16))


def test_nvfp4_linear_module_errors(make_nvfp4):
    with pytest.raises(ValueError, match=r"in_features = 40 is not a multiple of 16"):
        NVFP4Linear.from_linear(nn.Linear(40, 8))
    with pytest.raises(TypeError, match=r"linear must be an nn.Linear, got Conv1d"):
        NVFP4Linear.from_linear(nn.Conv1d(16, 16, 1))
    with pytest.raises(TypeError, match=r"weight must be a 2-D NVFP4Tensor .*got Tensor"):
        NVFP4Linear(torch.zeros(8, 16))
    with pytest.raises(ValueError, match=r"weight must be a 2-D NVFP4Tensor"):
        NVFP4Linear(NVFP4Tensor.stack([make_nvfp4(8, 16), make_nvfp4(8, 16)]))
    with pytest.raises(ValueError, match=r"bias has shape \(9,\); expected \[8\]"):
        NVFP4Linear(make_nvfp4(8, 16), torch.zeros(9))


# ---------------------------------------------------------------------------------------------------------------
# 7. quantize_linears


class _Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(64, 96)
        self.act = nn.GELU()
        self.down = nn.Linear(96, 64)

    def forward(self, x):
        return x + self.down(self.act(self.up(x)))


class _Tiny(nn.Module):
    """Linears at the top, nested two deep, with in_features % 16 != 0, and an lm_head one level down."""

    def __init__(self):
        super().__init__()
        self.embed_proj = nn.Linear(64, 64)
        self.blocks = nn.ModuleList([_Mlp(), _Mlp()])
        self.narrow = nn.Linear(64, 40)
        self.widen = nn.Linear(40, 64)                      # in_features = 40: never swapped
        self.head = nn.ModuleDict({"lm_head": nn.Linear(64, 37, bias=False)})

    def forward(self, x):
        x = self.embed_proj(x)
        for b in self.blocks:
            x = b(x)
        x = x + self.widen(torch.relu(self.narrow(x)))
        return self.head["lm_head"](x)


def _tiny(device) -> _Tiny:
    torch.manual_seed(0)
    return _Tiny().to(device=device, dtype=BF16)


@pytest.mark.parametrize("skip,swapped", [
    pytest.param((), {"embed_proj", "blocks.0.up", "blocks.0.down", "blocks.1.up", "blocks.1.down", "narrow",
                      "head.lm_head"}, id="no-skip"),
    pytest.param(("embed_proj", "lm_head", "blocks.1.down"), {"blocks.0.up", "blocks.0.down", "blocks.1.up",
                                                              "narrow"}, id="names-and-suffix"),
    pytest.param(("down",), {"embed_proj", "blocks.0.up", "blocks.1.up", "narrow", "head.lm_head"},
                 id="suffix-everywhere"),
    pytest.param(("head", "proj", "1.up"), {"embed_proj", "blocks.0.up", "blocks.0.down", "blocks.1.down",
                                            "narrow", "head.lm_head"}, id="whole-name-parts-only"),
    pytest.param(lambda name, lin: lin.out_features == 96, {"embed_proj", "blocks.0.down", "blocks.1.down",
                                                            "narrow", "head.lm_head"}, id="predicate"),
])
def test_quantize_linears_swaps_the_eligible(skip, swapped, device, poison_empty):
    model = _tiny(device)
    with lynn_kernels.use_reference():                    # only the names matter here: quantise in plain torch
        names = quantize_linears(model, skip=skip)
    assert len(names) == len(set(names)) and set(names) == swapped
    for name, mod in model.named_modules():
        if name in swapped:
            assert isinstance(mod, NVFP4Linear), name
        elif isinstance(mod, (nn.Linear, NVFP4Linear)):
            assert type(mod) is nn.Linear, f"{name} should have been skipped"
    assert type(model.widen) is nn.Linear


@pytest.mark.parametrize("t", [pytest.param(5, id="gemv-T5"), pytest.param(33, id="gemm-T33")])
def test_quantize_linears_model_output_stays_close(t, make_weight, device, poison_empty):
    model = _tiny(device)
    dense = copy.deepcopy(model)
    quantize_linears(model, skip=("lm_head",))
    x = make_weight((2, t, 64), BF16, seed=t)
    with torch.no_grad():
        got, want = model(x), dense(x)
    assert got.dtype == BF16 and tuple(got.shape) == (2, t, 37)
    m = compare(got, want.float())
    assert m.cosine > 0.99, m


# ---------------------------------------------------------------------------------------------------------------
# 8. errors name the tensor, what was expected and what was found


def _error_cases():
    """(id, (x, w, bias) builder, exception, message regex) for every argument check. Built on the CPU: every case
    fails in check_linear_args, before the kernels' own device check."""
    def x(*shape, dtype=BF16):
        return torch.zeros(shape, dtype=dtype)

    def q(n=37, k=48):
        return nvfp4_reference.quantize(torch.ones(n, k))

    return [
        ("w-dense", lambda: (x(3, 48), torch.zeros(37, 48), None), TypeError,
         r"w must be an NVFP4Tensor .*got Tensor"),
        ("w-3d", lambda: (x(3, 48), NVFP4Tensor.stack([q(), q()]), None), ValueError,
         r"w must be a 2-D NVFP4Tensor \[N, K\], got shape \(2, 37, 48\)"),
        ("x-list", lambda: ([[0.0] * 48], q(), None), TypeError, r"x must be a torch.Tensor, got list"),
        ("x-int", lambda: (x(3, 48, dtype=torch.int32), q(), None), TypeError, r"x has dtype torch.int32; expected"),
        ("x-fp64", lambda: (x(3, 48, dtype=torch.float64), q(), None), TypeError, r"x has dtype torch.float64"),
        ("x-K", lambda: (x(3, 32), q(), None), ValueError,
         r"x has shape \(3, 32\); expected \[\.\.\., K\] with K = 48 to match w \[N, K\] = \[37, 48\]"),
        ("x-0d", lambda: (x(), q(), None), ValueError, r"x has shape \(\); expected \[\.\.\., K\]"),
        ("x-meta", lambda: (x(3, 48).to("meta"), q(), None), ValueError, r"x is on meta but w is on cpu"),
        ("bias-shape", lambda: (x(3, 48), q(), torch.zeros(36)), ValueError,
         r"bias has shape \(36,\); expected \[N\] = \[37\]"),
        ("bias-2d", lambda: (x(3, 48), q(), torch.zeros(1, 37)), ValueError, r"bias has shape \(1, 37\)"),
        ("bias-int", lambda: (x(3, 48), q(), torch.zeros(37, dtype=torch.int64)), TypeError,
         r"bias has dtype torch.int64; expected one of \['bfloat16', 'float16', 'float32'\]"),
        ("bias-list", lambda: (x(3, 48), q(), [0.0] * 37), TypeError, r"bias must be a torch.Tensor or None, got list"),
        ("bias-meta", lambda: (x(3, 48), q(), torch.zeros(37, device="meta")), ValueError,
         r"bias is on meta but w is on cpu"),
    ]


@pytest.mark.parametrize("op", OPS + [pytest.param(reference.nvfp4_linear, id="reference")])
@pytest.mark.parametrize("build,exc,match", [pytest.param(*c[1:], id=c[0]) for c in _error_cases()])
def test_argument_errors(op, build, exc, match):
    x, w, bias = build()
    with pytest.raises(exc, match=match):
        op(x, w, bias)


@pytest.mark.parametrize("op", OPS)
def test_kernels_refuse_a_foreign_device(op):
    """Under the interpreter the kernels want CPU tensors; 'meta' stands in for a foreign device (x and w agree)."""
    w = nvfp4_reference.quantize(torch.ones(37, 48)).to("meta")
    where = "the CPU" if lynn_kernels.runtime.INTERPRET else "a CUDA GPU"
    with pytest.raises(ValueError, match=rf"x is on meta, but kernels run on {where}"):
        op(torch.zeros(3, 48, device="meta"), w)


def test_fp64_bias_works_or_is_named(make_weight, make_nvfp4, device):
    """The reference takes an fp64 bias; the kernel must match it or refuse with an error naming the bias."""
    x, w, bias = make_weight((3, 48), FP32), make_nvfp4(37, 48), make_bias(37, torch.float64, device)
    try:
        y = nvfp4_linear(x, w, bias)
    except (TypeError, ValueError) as e:
        assert "bias" in str(e)
    else:
        assert_close_to_reference(y, reference.nvfp4_linear(x, w, bias))


# ---------------------------------------------------------------------------------------------------------------
# 9. the decode, exactly: every E2M1 code, tiny and huge block scales, global scales per row


def _every_code_weight(device) -> tuple[NVFP4Tensor, list[tuple[str, slice]]]:
    """128 rows x 16 columns (one block): row r holds the 16 codes in order (rotated by r) with E4M3 scale byte
    ``r`` (0: zero, 1..7: subnormal from 2^-9, 0x7E: 448; 0x7F, NaN, replaced by 0x7E) and a power-of-two global
    scale per row (2^-4 .. 2^4, so every value is a normal fp16 too): every product is exact, and the kernel must
    equal the reference bit for bit."""
    base = torch.arange(16, dtype=torch.uint8)
    rows = torch.stack([base.roll(r) for r in range(128)])                    # [128, 16] codes
    codes = (rows[:, 0::2] | (rows[:, 1::2] << 4)).to(device)
    scale_bytes = torch.arange(128, dtype=torch.uint8).clamp(max=0x7E).reshape(128, 1)
    scales = scale_bytes.view(torch.float8_e4m3fn).to(device)
    g = torch.tensor([2.0 ** ((r * 5) % 9 - 4) for r in range(128)], dtype=FP32, device=device)
    groups = [("zero scale", slice(0, 1)), ("subnormal scales", slice(1, 8)), ("small scales", slice(8, 48)),
              ("mid scales", slice(48, 96)), ("huge scales", slice(96, 128))]
    return NVFP4Tensor(codes, scales, g), groups


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS[1:])
def test_every_code_and_scale_decodes_exactly(op, dtype, device, poison_empty):
    """x = identity rows reads the weight back through the product: y[m, n] = w[n, m], one rounding each."""
    w, groups = _every_code_weight(device)
    m = 16 if op is nvfp4_gemv else 32
    x = torch.eye(16, dtype=dtype, device=device).repeat(m // 16, 1)             # [M, 16]
    y, want = op(x, w), reference.nvfp4_linear(x, w)
    for name, rows in groups:
        assert_bit_equal(y[:, rows], want[:, rows], f"rows of {name}")


# ---------------------------------------------------------------------------------------------------------------
# 10. the real thing, on a GPU


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [pytest.param(1, 4096, 4096, id="gemv-M1-4096x4096"),
                                   pytest.param(16, 4096, 4096, id="gemv-M16-4096x4096"),
                                   pytest.param(4096, 1024, 2048, id="gemm-M4096-1024x2048"),
                                   pytest.param(300, 1000, 2064, id="gemm-M300-1000x2064")])
def test_gpu_large_shape_matches_reference(m, n, k, make_weight, make_nvfp4, device):
    assert device.type == "cuda"
    x = make_weight((m, k), BF16, seed=1)
    w = make_nvfp4(n, k, seed=2, scale=0.02)
    bias = make_bias(n, BF16, device)
    want = reference.nvfp4_linear(x, w, bias)
    y1 = nvfp4_linear(x, w, bias)
    assert_close_to_reference(y1, want, f"M={m} N={n} K={k}")
    assert_counters_zeroed()
    assert_bit_equal(nvfp4_linear(x, w, bias), y1, "second call")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_every_gemm_config_compiles_and_agrees(dtype, make_weight, make_nvfp4, device):
    m, n, k = 300, 1000, 2064
    x = make_weight((m, k), dtype, seed=3)
    w = make_nvfp4(n, k, seed=3, scale=0.02)
    want = reference.nvfp4_linear(x, w)
    for cfg in triton_matmul._gemm_configs():
        config = {**cfg.kwargs, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
        for split in (None, 3):
            y = torch.full((m, n), float("nan"), dtype=dtype, device=device)
            launch_gemm(x, w, None, y, config=config, split_k=split)
            assert_close_to_reference(y, want, f"{config} split_k={split}")
            assert_counters_zeroed(str(config))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS[1:])
def test_gpu_packed_decode_every_code_and_scale_exact(op, dtype, device):
    """On the GPU a bf16 x takes the packed (inline PTX) decode: every code with every scale byte, tiny and huge,
    read back exactly through identity rows of x, and a random x within tolerance, per row group."""
    assert device.type == "cuda"
    w, groups = _every_code_weight(device)
    m = 16 if op is nvfp4_gemv else 4096
    x = torch.eye(16, dtype=dtype, device=device).repeat(m // 16, 1)
    y, want = op(x, w), reference.nvfp4_linear(x, w)
    for name, rows in groups:
        assert_bit_equal(y[:, rows], want[:, rows], f"rows of {name}")
    xr = torch.randn(m, 16, generator=torch.Generator().manual_seed(0)).mul(2.0 ** -6)   # huge rows fit fp16
    xr = xr.to(dtype).to(device)
    y, want = op(xr, w), reference.nvfp4_linear(xr, w)
    for name, rows in groups[1:]:
        assert_close_to_reference(y[:, rows], want[:, rows], f"random x, rows of {name}")


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [pytest.param(4096, 2048, id="in_proj_z-4096x2048"),
                                 pytest.param(2048, 4096, id="out_proj-2048x4096"),
                                 pytest.param(8192, 2048, id="in_proj_qkv-8192x2048")])
def test_gpu_split_k_gemm_repeats_bit_for_bit_under_memory_churn(n, k, make_weight, make_nvfp4, device):
    """The prefill GEMM at M = 80 (split-K: its tiles cannot fill the GPU) on the packed layout, as the Gated DeltaNet
    mixer runs it, 60 times on one input with the allocator's freed memory scribbled on between calls: every output
    bit-equal to the first and the tickets back at zero. Written for the fault the decoder benchmark found on the H200
    at 83e42ff (a Qwen3-Next mixer at 80 tokens differing in ~2% of calls). On the H200 with Triton 3.6 it failed at
    28ed237 (two of the three shapes: the register-operand wgmma hazard of runtime.register_dot_hazard) and
    passed at 88f5896, where those kernels compile with one stage (docs/history/compiler-fault.md)."""
    m = 80
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    assert triton_matmul._max_split(m, n, k, sms) > 1, "this shape no longer splits K: the test tests nothing"
    x = make_weight((m, k), BF16, seed=4)
    w = pack(make_nvfp4(n, k, seed=5, scale=0.02))
    gen = torch.Generator(device=device).manual_seed(0)
    runs = {"as dispatched": lambda: nvfp4_linear(x, w),
            "split_k=4": lambda: launch_gemm(x, w, None, torch.empty(m, n, dtype=BF16, device=device), split_k=4)}
    for name, run in runs.items():
        first = run().clone()
        assert_close_to_reference(first, reference.nvfp4_linear(x, w.unpack()), f"M={m} N={n} K={k} {name}")
        unequal = 0
        for _ in range(60):
            # blocks above 1 MiB: the caching allocator's large pool, where the workspace and y come from
            junk = [torch.empty(12 << 20, dtype=torch.uint8, device=device).random_(0, 256, generator=gen)
                    for _ in range(16)]
            del junk
            unequal += not torch.equal(run(), first)
            assert_counters_zeroed(f"after a repeat ({name})")
        assert unequal == 0, f"{name}: {unequal} of 60 repeats differ from the first call"


# ---------------------------------------------------------------------------------------------------------------
# 11. the packed kernel layout (lynn_kernels.matmul.pack): exact, and every kernel that reads it


def test_packed_word_bits_partition_the_word():
    """Every element of a word owns four distinct bits (sign + three magnitude bits) and the eight cover 0..31."""
    bits = [b for j in range(8) for b in (packed.SIGN_BIT[j], *(packed.MAG_BIT[j] + i for i in range(3)))]
    assert sorted(bits) == list(range(32))


def test_packed_word_order_is_the_mma_fragment_order():
    """Word 4q + i of a 128-column chunk holds, for its elements j, the columns thread q of an mma.m16n8k16 A
    fragment owns (pairs 2q, 2q + 1 and 2q + 8, 2q + 9 of each 16 columns), i selecting two of the chunk's eight
    16-column steps; each column once."""
    k = packed.word_k(32)
    assert sorted(k.flatten().tolist()) == list(range(256))
    for w in range(32):
        c, q, i = w // 16, (w % 16) // 4, w % 4
        cols = k[w].tolist()
        assert cols == [128 * c + 16 * s + h + 2 * q + b for s in (2 * i, 2 * i + 1) for h in (0, 8) for b in (0, 1)]


@pytest.mark.parametrize("m", [1, 2, 5, 17, 40])
def test_concat_rows_is_the_stacked_product(m, make_nvfp4, device):
    """Three weights of one K (37, 64 and 5 rows, each its own global scale) stacked by concat_rows: the stacked
    weight dequantises to the three stacked bit for bit, and one product through it equals the three products
    side by side, bit for bit where the kernel's per-row reduction does not depend on N (the packed GEMV, M = 1, 2)
    and within the one-rounding bound where a split-K GEMV / GEMM may group a row's partials otherwise."""
    k = 208
    parts = [pack(make_nvfp4(n, k, seed=s, scale=sc)).to(device) for n, s, sc in ((37, 1, 0.05), (64, 2, 0.5),
                                                                                   (5, 3, 0.002))]
    cat = packed.concat_rows(parts)
    assert cat.shape == (106, k) and cat.rows_per_global() == 1
    want_w = torch.cat([p.dequantize(FP32) for p in parts])
    assert_bit_equal(cat.dequantize(FP32), want_w, "dequantised")
    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 0.5).to(BF16).to(device)
    got = nvfp4_linear(x, cat)
    want = torch.cat([nvfp4_linear(x, p) for p in parts], dim=-1)
    if m <= 2 and triton_matmul.use_packed_gemv(m, 106) and all(triton_matmul.use_packed_gemv(m, p.shape[0])
                                                                for p in parts):
        assert_bit_equal(got, want, f"M={m}")
    assert_close_to_reference(got, reference.nvfp4_linear(x, cat.unpack()), f"M={m}")
    assert_close_to_reference(torch.cat([reference.nvfp4_linear(x, p.unpack()) for p in parts], -1),
                              reference.nvfp4_linear(x, cat.unpack()), f"M={m}, references")


def test_concat_rows_keeps_one_shared_scalar_scale_and_refuses_mismatches(make_nvfp4):
    w = make_nvfp4(48, 64, seed=4)
    a, b = NVFP4Tensor(w.codes[:16], w.scales[:16], w.global_scale), NVFP4Tensor(w.codes[16:], w.scales[16:],
                                                                                 w.global_scale)
    cat = packed.concat_rows([pack(a), pack(b)])
    assert cat.rows_per_global() == 48 and cat.global_scale.numel() == 1
    assert torch.equal(cat.words, pack(w).words) and torch.equal(cat.scales, pack(w).scales)
    # a part whose global scale covers groups of rows (two halves): repeated to one scale per row, values kept
    halves = PackedNVFP4(pack(w).words, pack(w).scales, torch.stack([w.global_scale, 2 * w.global_scale]).float(),
                         24, 64)
    mixed = packed.concat_rows([halves, pack(a)])
    assert mixed.rows_per_global() == 1 and mixed.global_scale.numel() == 64
    whole = pack(w).dequantize(FP32)                      # (unpack itself takes only a scalar or per-row scale)
    assert_bit_equal(mixed.dequantize(FP32), torch.cat([whole[:24], 2 * whole[24:], pack(a).dequantize(FP32)]),
                     "a grouped global scale")
    with pytest.raises(ValueError, match=r"weights\[1\].*K and device must match"):
        packed.concat_rows([pack(a), pack(make_nvfp4(16, 80))])
    with pytest.raises(TypeError, match=r"weights\[0\] must be a PackedNVFP4"):
        packed.concat_rows([a, pack(b)])
    with pytest.raises(ValueError, match="at least one"):
        packed.concat_rows([])


@pytest.mark.parametrize("recipe", ["modelopt", "compressed-tensors"])
@pytest.mark.parametrize("n,k", [(1, 16), (37, 208), (130, 1040)])
def test_pack_unpack_round_trip(n, k, recipe, make_nvfp4):
    w = make_nvfp4(n, k, seed=n + k, recipe=recipe)
    p = pack(w)
    kp = -(-k // packed.CHUNK) * packed.CHUNK                           # K padded to whole 128-column chunks
    assert isinstance(p, PackedNVFP4) and tuple(p.shape) == (n, k)
    assert p.words.shape == (n, kp // 8) and p.scales.shape == (n, kp // 16)
    assert not bool(p.scales[:, k // 16:].any())                        # the padding's blocks are zero
    u = unpack(p)
    assert torch.equal(u.codes, w.codes)
    assert torch.equal(u.scales.view(torch.uint8), w.scales.view(torch.uint8))
    assert_bit_equal(nvfp4_reference.dequantize(u, FP32), nvfp4_reference.dequantize(w, FP32))


def test_pack_every_code_and_scale_byte(device):
    """All 16 codes with every finite E4M3 scale byte (zero, subnormal, normal, 448): the packed weight dequantises
    to the same values (bit for bit but the sign of the zero-scale row's zeros); codes and scales come back as stored
    except that row's codes (zeroed)."""
    w, _ = _every_code_weight(device)
    u = unpack(pack(w))
    a, b = nvfp4_reference.dequantize(u, FP32), nvfp4_reference.dequantize(w, FP32)
    assert torch.equal(a, b) and torch.equal(a[1:].view(torch.int32), b[1:].view(torch.int32))
    assert torch.equal(u.codes[1:], w.codes[1:]) and not bool(u.codes[0].any())
    assert torch.equal(u.scales.view(torch.uint8), w.scales.view(torch.uint8))


def test_pack_folds_a_negative_scale_and_refuses_nan(make_nvfp4):
    w = make_nvfp4(8, 32, seed=5)
    bits = w.scales.view(torch.uint8).clone()
    bits[3, 1] |= 0x80                                                     # a negative block scale
    neg = NVFP4Tensor(w.codes, bits.view(torch.float8_e4m3fn), w.global_scale)
    assert_bit_equal(nvfp4_reference.dequantize(unpack(pack(neg)), FP32), nvfp4_reference.dequantize(neg, FP32))
    bits[2, 0] = 0x7F
    with pytest.raises(ValueError, match="w.scales holds NaN"):
        pack(NVFP4Tensor(w.codes, bits.view(torch.float8_e4m3fn), w.global_scale))


@pytest.mark.parametrize("build,exc,match", [
    pytest.param(lambda w: pack(w.codes), TypeError, "pack takes an NVFP4Tensor", id="not-nvfp4"),
    pytest.param(lambda w: pack(NVFP4Tensor.stack([w, w])), ValueError, "2-D", id="3-d"),
    pytest.param(lambda w: unpack(w), TypeError, "unpack takes a PackedNVFP4", id="unpack-not-packed"),
])
def test_pack_argument_errors(build, exc, match, make_nvfp4):
    with pytest.raises(exc, match=match):
        build(make_nvfp4(8, 32))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [pytest.param(1, id="fma-M1"), pytest.param(2, id="fma-M2"),
                               pytest.param(16, id="gemv-M16"), pytest.param(32, id="gemm-M32")])
def test_packed_every_code_and_scale_exact(m, dtype, device, poison_empty):
    """Identity rows of x read the packed weight back through each kernel: y[m, n] = w[n, m], bit for bit."""
    w, groups = _every_code_weight(device)
    x = torch.eye(16, dtype=dtype, device=device).repeat(2, 1)[:m]
    p = pack(w)
    want = reference.nvfp4_linear(x, w)
    outs = {"dispatch": nvfp4_linear(x, p)}
    if m <= 16:                                     # both decode kernels, whichever the dispatch picks
        outs["tensor-core GEMV"] = launch_gemv(x, p, None, torch.empty_like(want))
    if m <= 2:
        outs["packed GEMV"] = launch_packed_gemv(x, p, None, torch.empty_like(want))
    for kernel, y in outs.items():
        for name, rows in groups:
            assert_bit_equal(y[:, rows], want[:, rows], f"{kernel}, rows of {name}")


@pytest.mark.parametrize("case", check_cases("matmul", "matmul.norm_linear packed"))
def test_norm_linear_matches_reference(case, poison_empty):
    """The check matrix's shapes of one and two rows through ``norm_linear`` on the packed layout (the norm in the
    packed GEMV's launch): the product within one rounding, the normed rows too, the residual sum exact."""
    assert_case_passes(case)


@pytest.mark.parametrize("config", [pytest.param({"BLOCK_N": 16, "TW": 128, "num_warps": 4}, id="gpu-16x128"),
                                    pytest.param({"BLOCK_N": 32, "TW": 128, "num_warps": 4}, id="gpu-32x128"),
                                    pytest.param({"BLOCK_N": 8, "TW": 64, "num_warps": 2}, id="8x64"),
                                    pytest.param({"BLOCK_N": 8, "TW": 64, "num_warps": 2, "PROGRAMS": 2},
                                                 id="8x64-2-programs")])
@pytest.mark.parametrize("m", [1, 2, 4])
def test_packed_fma_gemv_configs(config, m, make_weight, make_nvfp4, device, poison_empty):
    """The packed GEMV under the GPU's tiles: 2064 = 2 x 1024 + 16, so a full unmasked step, a masked tail, and rows
    that do not fill the last program; x a strided view."""
    n, k = 37, 2064
    w = make_nvfp4(n, k, seed=9)
    x = make_weight((m, 2 * k), BF16, seed=m)[:, ::2]
    y = torch.empty(m, n, dtype=BF16, device=device)
    launch_packed_gemv(x, pack(w), None, y, config)
    assert_close_to_reference(y, reference.nvfp4_linear(x, w), str(config))


@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("n,k,programs", [(64, 1024, 3), (37, 208, 2), (130, 2064, 5)])
def test_packed_fma_gemv_programs_take_tiles_in_turn(n, k, programs, pdl, make_weight, make_nvfp4, device,
                                                     poison_empty):
    """A grid smaller than the tiles: each program streams several tiles (4 tiles over 3 programs on an even shape,
    uneven shares and a partial last tile on odd ones), bit-equal to one program per tile; with PDL (and its early
    release) the same bits."""
    w = pack(make_nvfp4(n, k, seed=n + k))
    x = make_weight((2, k), BF16, seed=k)
    base = {"BLOCK_N": 16, "TW": 64, "num_warps": 4}
    want = launch_packed_gemv(x, w, None, torch.empty(2, n, dtype=BF16, device=device), base)
    assert_close_to_reference(want, reference.nvfp4_linear(x, unpack(w)), "one program per tile")
    for early in (False, True):
        got = launch_packed_gemv(x, w, None, torch.empty(2, n, dtype=BF16, device=device),
                                 {**base, "PROGRAMS": programs, "EARLY_RELEASE": early}, pdl=pdl)
        assert_bit_equal(got, want, f"{programs} programs, early release {early}")


def test_packed_gemv_config_takes_the_measured_tiles():
    """packed_gemv_config's choices from the H200 sweeps (docs/history/matmul.md): 32 x 64 for one x row on 8,192+ rows
    at K = 2048 (the only K that tile was measured at), the rows-per-SM rule elsewhere; never a streaming grid or an
    early PDL release by default."""
    from lynn_kernels.matmul.triton_packed import packed_gemv_config

    assert packed_gemv_config(8192, 2048, 132) == {"BLOCK_N": 32, "TW": 64, "num_warps": 4, "PROGRAMS": 0,
                                           "EARLY_RELEASE": False}
    assert packed_gemv_config(12288, 2048, 132)["BLOCK_N"] == 32
    assert (packed_gemv_config(8192, 8192, 132)["BLOCK_N"], packed_gemv_config(8192, 8192, 132)["TW"]) == (32, 128)
    assert (packed_gemv_config(8192, 2048, 132, m=2)["BLOCK_N"],
            packed_gemv_config(8192, 2048, 132, m=2)["TW"]) == (16, 128)
    assert (packed_gemv_config(4096, 2048, 132)["BLOCK_N"], packed_gemv_config(2048, 4096, 132)["BLOCK_N"]) == (16, 8)
    assert all(packed_gemv_config(n, k, 132, m)["PROGRAMS"] == 0
               and not packed_gemv_config(n, k, 132, m)["EARLY_RELEASE"]
               for n, k, m in [(8192, 2048, 1), (37, 208, 2), (248320, 2048, 1)])


def test_packed_fma_gemv_refuses_unknown_config_keys(make_weight, make_nvfp4, device):
    w = pack(make_nvfp4(8, 32))
    with pytest.raises(ValueError, match="not packed GEMV settings"):
        launch_packed_gemv(make_weight((1, 32), BF16), w, None, torch.empty(1, 8, dtype=BF16, device=device),
                           {"BLOCK_K": 64})


def test_packed_fma_gemv_refuses_more_than_4_rows(make_weight, make_nvfp4, device):
    w = pack(make_nvfp4(8, 32))
    with pytest.raises(ValueError, match="at most 4 rows"):
        launch_packed_gemv(make_weight((5, 32), BF16), w, None, torch.empty(5, 8, dtype=BF16, device=device))


def test_packed_x_range(make_nvfp4, device, poison_empty):
    """The packed GEMV scales x by 2^64 internally: inputs from 1e-15 to 1e15 keep fp32 precision (docs/matmul.md)."""
    w = make_nvfp4(33, 64, seed=4)
    for scale in (1e-15, 1.0, 1e15):
        x = (torch.randn(1, 64, generator=torch.Generator().manual_seed(1)) * scale).to(device)
        y = nvfp4_linear(x, pack(w))
        assert_close_to_reference(y, reference.nvfp4_linear(x, w), f"|x| ~ {scale:g}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 2, 3, 16, 300])
def test_gpu_packed_matches_reference_with_pdl_and_graphs(m, dtype, make_weight, make_nvfp4, device):
    """The H200: the packed kernels on decoder-sized shapes; the packed GEMV with programmatic dependent launch gives
    the same bits, and so does a CUDA-graph replay (captured, then replayed after a larger call)."""
    n, k = 4096, 2064
    w = make_nvfp4(n, k, seed=2, scale=0.02)
    p = pack(w)
    x = make_weight((m, k), dtype, seed=1)
    want = reference.nvfp4_linear(x, w)
    y = nvfp4_linear(x, p)
    assert_close_to_reference(y, want, f"packed M={m}")
    if m <= 2:
        y2 = torch.empty_like(y)
        launch_packed_gemv(x, p, None, y2, pdl=True)
        assert_bit_equal(y2, y, "with PDL")
    out = torch.empty_like(y)
    g = torch.cuda.CUDAGraph()
    nvfp4_linear(x, p)
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        out.copy_(nvfp4_linear(x, p))
    nvfp4_linear(make_weight((m, k), dtype, seed=7).repeat(4, 1), p)          # a larger call in between
    g.replay()
    torch.cuda.synchronize()
    assert_bit_equal(out, y, "graph replay")


@pytest.mark.gpu
def test_gpu_fma_gemv_direct_launch(make_weight, make_nvfp4, device):
    """The H200: the packed GEMV's direct launch (runtime.DirectLaunch) gives the bits of Triton's own launch path,
    eager and in a CUDA graph; an x view that is not 16-byte aligned gets its own compiled kernel (the alignment is
    part of the key), and so do a bias, PDL and two x rows, each then launched directly with the same bits."""
    from lynn_kernels import runtime
    from lynn_kernels.matmul.triton_packed import PACKED_GEMV

    n, k = 4096, 2048
    w = make_nvfp4(n, k, seed=5, scale=0.02)
    p = pack(w)
    big = make_weight((1, k + 8), BF16, seed=3)
    xs = {"aligned": big[:, :k], "x 2 bytes off 16": big[:, 1:k + 1]}
    runtime.DIRECT_LAUNCH = False
    try:
        PACKED_GEMV.launch().compiled.clear()
        want = {name: nvfp4_linear(x, p) for name, x in xs.items()}
    finally:
        runtime.DIRECT_LAUNCH = True
    assert not PACKED_GEMV.launch().compiled, "nothing is kept with the direct launch off"
    for name, x in xs.items():
        nvfp4_linear(x, p)                                      # the first call of a key goes through Triton
        assert_bit_equal(nvfp4_linear(x, p), want[name], f"direct launch, {name}")
    assert len(PACKED_GEMV.launch().compiled) == 2, "the misaligned view must not reuse the aligned kernel"
    # kept kernels with a bias, with PDL, and with two x rows: each key's second call runs directly
    bias = make_weight((n,), BF16, seed=6)
    x2 = make_weight((2, k), BF16, seed=8)
    cases = {"bias": (xs["aligned"], bias, False), "PDL": (xs["aligned"], None, True), "M = 2": (x2, None, False)}
    runtime.DIRECT_LAUNCH = False
    try:
        slow = {name: launch_packed_gemv(x, p, b, torch.empty(x.shape[0], n, dtype=BF16, device=device), pdl=pdl)
                for name, (x, b, pdl) in cases.items()}
    finally:
        runtime.DIRECT_LAUNCH = True
    for name, (x, b, pdl) in cases.items():
        for _ in range(2):
            y = launch_packed_gemv(x, p, b, torch.empty(x.shape[0], n, dtype=BF16, device=device), pdl=pdl)
            assert_bit_equal(y, slow[name], f"direct launch, {name}")
    assert len(PACKED_GEMV.launch().compiled) == 5, "bias, PDL and M = 2 each keep their own kernel"
    x = xs["aligned"]
    out = torch.empty_like(want["aligned"])
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out.copy_(nvfp4_linear(x, p))
    g.replay()
    torch.cuda.synchronize()
    assert_bit_equal(out, want["aligned"], "direct launch captured in a graph")


@triton.jit
def _tile_kernel(words, scales, out, N, KW, UNSCALED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 DOT: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    t = packed_w_tile(words, scales, offs_n, offs_n < N, 0, KW, BLOCK_N, BLOCK_K, DOT, False, UNSCALED)
    tl.store(out + offs_n[:, None] * BLOCK_K + tl.arange(0, BLOCK_K)[None, :], t.to(tl.float32))


@pytest.mark.parametrize("unscaled", [pytest.param(False, id="bf16-fp32-tile"), pytest.param(True, id="fp16-tile")])
def test_packed_tile_values(unscaled, device, poison_empty):
    """The tensor cores' packed tile, read back: ``e2m1 * s * 2^-19`` (fp32 / bf16 dots) or ``e2m1 * s`` (fp16
    dots, ``UNSCALED``) for every code and scale byte, exactly. (The H200 found the fp16 tile overflowing once:
    its 2^19 must come after the product.)"""
    w, _ = _every_code_weight(device)
    p = pack(w)
    out = torch.empty(128, 128, dtype=FP32, device=device)
    _tile_kernel[(128 // 32,)](p.words, p.scales, out, 128, p.words.shape[1], UNSCALED=unscaled, BLOCK_N=32,
                               BLOCK_K=128, DOT=tl.float16 if unscaled else tl.float32)
    ones = NVFP4Tensor(w.codes, w.scales, torch.ones(128, dtype=FP32, device=device))
    want = nvfp4_reference.dequantize(ones, FP32) * (1.0 if unscaled else 2.0 ** -19)
    assert torch.equal(out[:, :16], want) and not bool(out[:, 16:].any())      # K = 16, padded to 128


def test_split_k_tickets_are_fixed_per_stream(make_weight, make_nvfp4, device, poison_empty):
    """The ticket buffer is made once per (device, stream) and never replaced, whatever the call's size, so a graph
    captured before a larger call still replays on live memory; a split-K call that could need more tickets than
    it holds is refused by name."""
    w = make_nvfp4(37, 48)
    x = make_weight((3, 48), BF16, seed=2)
    y = torch.empty(3, 37, dtype=BF16, device=device)
    launch_gemv(x, w, None, y, config=GEMV_CONFIG, split_k=3)
    before = {k: v.data_ptr() for k, v in _counters.items()}
    triton_shared.split_k_counter(device, 5000)   # more tickets than any earlier call: the old buffer was replaced
    big = make_nvfp4(257, 48, seed=3)
    launch_gemm(make_weight((40, 48), BF16, seed=4), big, None, torch.empty(40, 257, dtype=BF16, device=device))
    assert {k: v.data_ptr() for k, v in _counters.items() if k in before} == before
    assert all(v.numel() == triton_shared.COUNTER_SLOTS for v in _counters.values())
    assert_counters_zeroed()
    with pytest.raises(ValueError, match="split-K over"):
        triton_shared.split_k_counter(device, triton_shared.COUNTER_SLOTS + 1)


@pytest.mark.gpu
def test_gpu_split_k_graph_survives_a_larger_call_and_streams(make_weight, make_nvfp4, device):
    """A split-K GEMV captured in a CUDA graph, then a larger split-K call eagerly, then the replay: the same bits;
    and the same call on two streams at once gives the same bits on both."""
    w, big = make_nvfp4(256, 4096, seed=1), make_nvfp4(2048, 4096, seed=2)
    x = make_weight((4, 4096), BF16, seed=3)
    want = nvfp4_linear(x, w)
    out = torch.empty_like(want)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out.copy_(nvfp4_linear(x, w))
    nvfp4_linear(make_weight((4096, 4096), BF16, seed=4), big)      # a GEMM of 8192 tiles (the old buffer grew here)
    g.replay()
    torch.cuda.synchronize()
    assert_bit_equal(out, want, "graph replay after a larger call")
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    outs = []
    for s in streams:
        with torch.cuda.stream(s):
            outs.append(nvfp4_linear(x, w))
    torch.cuda.synchronize()
    for o in outs:
        assert_bit_equal(o, want, "on a second stream")
    assert_counters_zeroed()


# ---------------------------------------------------------------------------------------------------------------
# the prefill path: dequantise the packed weight once, then cuBLAS (nvfp4_linear from DEQUANT_MIN_M rows of x on)


def _every_code_four_shards(device) -> tuple[NVFP4Tensor, list[tuple[str, slice]]]:
    """The every-code weight of :func:`_every_code_weight` with one power-of-two global scale per 32 rows, held per
    row (four runs: the dequantise-then-cuBLAS path takes at most DEQUANT_MAX_SHARDS)."""
    w, groups = _every_code_weight(device)
    g = torch.tensor([2.0 ** -4, 1.0, 2.0 ** 3, 2.0 ** -1], dtype=FP32, device=device).repeat_interleave(32)
    return NVFP4Tensor(w.codes, w.scales, g), groups


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_dequantize_every_code_and_scale_exact(dtype, device, poison_empty):
    """The dequantise kernel writes ``e2m1 * s * 2^-19`` (``e2m1 * s`` for fp16) for every code and scale byte,
    exactly (the zero-scale row's zeros all +0: the layout zeroes that block's codes), and only the weight's own K
    columns (16 here, of a chunk padded to 128)."""
    w, _ = _every_code_weight(device)
    out = torch.full((128, 16), float("nan"), dtype=dtype, device=device)
    triton_matmul.launch_packed_dequantize(pack(w), out)
    ones = NVFP4Tensor(w.codes, w.scales, torch.ones(128, dtype=FP32, device=device))
    want = nvfp4_reference.dequantize(ones, FP32) * (1.0 if dtype == FP16 else 2.0 ** -19)
    assert_bit_equal(out[1:], want[1:].to(dtype), "dequantised weight")
    assert torch.equal(out[0], want[0].to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_dequant_gemm_every_code_and_scale_exact(dtype, device, poison_empty):
    """Identity rows of x through ``launch_dequant_gemm`` at M = DEQUANT_MIN_M (four runs of one global scale: one
    ``addmm`` each) read the weight back bit for bit; ``nvfp4_linear`` takes that path for 16-bit x (fp32 x stays
    on the GEMM kernel, IEEE whatever torch's TF32 switches say)."""
    w, groups = _every_code_four_shards(device)
    m = triton_matmul.DEQUANT_MIN_M
    x = torch.eye(16, dtype=dtype, device=device).repeat(m // 16, 1)
    p = pack(w)
    assert triton_matmul.use_dequant_gemm(m, p, dtype) == (dtype != FP32)
    y = triton_matmul.launch_dequant_gemm(x, p, None, torch.empty(m, 128, dtype=dtype, device=device))
    want = reference.nvfp4_linear(x, w)
    for name, rows in groups:
        assert_bit_equal(y[:, rows], want[:, rows], f"rows of {name}")


@pytest.mark.parametrize("dtype,bias", [pytest.param(BF16, False, id="bf16-nobias"),
                                        pytest.param(BF16, True, id="bf16-bias"),
                                        pytest.param(FP16, True, id="fp16-bias"),
                                        pytest.param(FP32, False, id="fp32-nobias")])
@pytest.mark.parametrize("mnk", [_mnk(17, 37, 208), _mnk(40, 130, 1040), _mnk(3, 65, 48)])
def test_dequant_gemm_matches_reference(mnk, dtype, bias, make_weight, make_nvfp4, device, poison_empty):
    """``launch_dequant_gemm`` on its own at awkward shapes (odd N, K a multiple of 16 but not of 64, x a strided
    view), with and without a bias of x's dtype, against the fp32 reference within one rounding."""
    m, n, k = mnk
    x = make_weight((k, m), dtype, seed=m + k).t()                        # strides (1, m)
    w = make_nvfp4(n, k, seed=n)
    b = make_bias(n, dtype if bias else None, device)
    y = triton_matmul.launch_dequant_gemm(x, pack(w), b, torch.full((m, n), float("nan"), dtype=dtype, device=device))
    assert_close_to_reference(y, reference.nvfp4_linear(x, w, b), f"dequant GEMM M={m} N={n} K={k}")


def test_dequant_gemm_per_shard_global_scales(make_weight, device, poison_empty):
    """Projections of very different magnitude stacked by ``concat_rows`` (one global scale per shard): each shard's
    columns match the product with that projection alone; a bias of another dtype than x is refused by name."""
    sizes, mags = (64, 32, 96), (1e-3, 1.0, 300.0)
    qs = [nvfp4_reference.quantize(make_weight((r, 208), FP32, seed=i, scale=s))
          for i, (r, s) in enumerate(zip(sizes, mags))]
    p = packed.concat_rows([pack(q) for q in qs])
    assert [r[:2] for r in p.scale_runs()] == [(0, 64), (64, 96), (96, 192)]
    x = make_weight((20, 208), BF16, seed=5)
    y = triton_matmul.launch_dequant_gemm(x, p, None, torch.empty(20, sum(sizes), dtype=BF16, device=device))
    for i, (q, part) in enumerate(zip(qs, y.split(sizes, dim=-1))):
        assert_close_to_reference(part, reference.nvfp4_linear(x, q), f"shard {i} (x {mags[i]})")
    with pytest.raises(ValueError, match="bias has dtype torch.float32"):
        triton_matmul.launch_dequant_gemm(x, p, torch.zeros(sum(sizes), device=device), torch.empty_like(y))


DMIN = triton_matmul.DEQUANT_MIN_M


@pytest.mark.parametrize("case,want", [
    pytest.param(dict(m=DMIN - 1), "launch_gemm", id="below-DEQUANT_MIN_M"),
    pytest.param(dict(m=DMIN), "launch_dequant_gemm", id="at-DEQUANT_MIN_M"),
    pytest.param(dict(m=DMIN, bias=FP32), "launch_gemm", id="fp32-bias-with-bf16-x"),
    pytest.param(dict(m=DMIN, layout="checkpoint"), "launch_gemm", id="checkpoint-layout"),
    pytest.param(dict(m=DMIN, per_row=1), "launch_dequant_gemm", id="one-scale-held-per-row"),
    pytest.param(dict(m=DMIN, per_row=37), "launch_gemm", id="37-distinct-scales"),
    pytest.param(dict(m=DMIN, dtype=FP32), "launch_gemm", id="fp32-x"),
    pytest.param(dict(m=DMIN, grad=True), "launch_dequant_gemm", id="x-requires-grad"),
])
def test_linear_dispatch_to_dequant_gemm(case, want, monkeypatch, make_weight, make_nvfp4, poison_empty):
    """``nvfp4_linear`` above 16 rows: the dequantise-then-cuBLAS path for a packed weight and a 16-bit x from
    DEQUANT_MIN_M rows on, with at most DEQUANT_MAX_SHARDS runs of one global scale and a bias (if any) of x's dtype
    (x may require grad: no autograd either way); the packed GEMM otherwise.
    Either way the product matches the reference."""
    calls = []
    for name in ("launch_gemm", "launch_dequant_gemm"):
        real = getattr(triton_matmul, name)
        monkeypatch.setattr(triton_matmul, name,
                            lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw))
    w = make_nvfp4(37, 48)
    if case.get("per_row"):                              # per-row scales: 1 or 37 distinct values
        g = w.global_scale.reshape(1) * torch.arange(1, 38, device=w.codes.device) ** (case["per_row"] > 1)
        w = NVFP4Tensor(w.codes, w.scales, g.float())
    wl = w if case.get("layout") == "checkpoint" else pack(w)
    x = make_weight((case["m"], 48), case.get("dtype", BF16), seed=3).requires_grad_(case.get("grad", False))
    b = make_bias(37, case.get("bias"), x.device)
    assert_close_to_reference(nvfp4_linear(x, wl, b).detach(), reference.nvfp4_linear(x, w, b).detach())
    assert calls == [want]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", [pytest.param(256, 1000, 2064, id="M256-1000x2064"),
                                   pytest.param(2048, 12288, 2048, id="M2048-12288x2048")])
def test_gpu_dequant_gemm_matches_reference(m, n, k, dtype, make_weight, make_nvfp4, device):
    """On the GPU (the bf16 tile by inline PTX; cuBLAS): the dispatch at prefill sizes within one rounding of the
    reference, the same bits on a second call, and the every-code weight read back exactly (fp32 x: the GEMM
    kernel, the dispatch's choice for it)."""
    x = make_weight((m, k), dtype, seed=1)
    w = make_nvfp4(n, k, seed=2, scale=0.02)
    b = make_bias(n, dtype, device)
    p = pack(w)
    assert triton_matmul.use_dequant_gemm(m, p, dtype, b) == (dtype != FP32)      # fp32 x: the GEMM kernel
    y = nvfp4_linear(x, p, b)
    assert_close_to_reference(y, reference.nvfp4_linear(x, w, b), f"M={m} N={n} K={k}")
    assert_bit_equal(nvfp4_linear(x, p, b), y, "second call")
    we, groups = _every_code_four_shards(device)
    xe = torch.eye(16, dtype=dtype, device=device).repeat(m // 16, 1)
    ye, want = nvfp4_linear(xe, pack(we)), reference.nvfp4_linear(xe, we)
    for name, rows in groups:
        assert_bit_equal(ye[:, rows], want[:, rows], f"rows of {name}")


def test_as_batch_sums_each_row_as_a_call_of_that_many_rows(make_weight, make_nvfp4, device, monkeypatch):
    """Inside ``as_batch(rows)`` a call of more rows gives each row the bits a call of ``rows`` rows gives it (a
    speculative verify against its decode steps), in few launches: the packed GEMV with one row's tile takes four rows
    a launch, the tensor-core GEMV sixteen, the GEMM exactly ``rows`` a launch (the last padded); a bad ``rows`` is
    refused."""
    n, k = 48, 256
    w = pack(make_nvfp4(n, k, seed=2, scale=0.05)).to(device)
    x = make_weight((40, k), BF16, seed=3)
    launches = []
    for name in ("launch_packed_gemv", "launch_gemv", "_launch_large"):
        real = getattr(triton_matmul, name)
        monkeypatch.setattr(triton_matmul, name,
                            lambda x2, *a, real=real, name=name, **kw: launches.append((name, x2.shape[0])) or
                            real(x2, *a, **kw))
    for like, m, want in ((1, 6, [("launch_packed_gemv", 4), ("launch_packed_gemv", 2)]),
                          (8, 24, [("launch_gemv", 16), ("launch_gemv", 8)]),
                          (20, 30, [("_launch_large", 20), ("_launch_large", 20)])):
        launches.clear()
        with lynn_kernels.as_batch(like):
            got = nvfp4_linear(x[:m], w)
        assert launches == want, f"as_batch({like}), M = {m}"
        padded = torch.cat([x[:m], x.new_zeros(-m % like, k)])            # calls of exactly `like` rows
        alone = torch.cat([nvfp4_linear(padded[r:r + like], w) for r in range(0, m, like)])[:m]
        assert_bit_equal(got, alone, f"as_batch({like}), M = {m}")
    with pytest.raises(ValueError, match="positive int"):
        with lynn_kernels.as_batch(0):
            pass
