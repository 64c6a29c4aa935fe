"""NVFP4: the Triton kernels against the torch reference (over the family's check matrix,
``lynn_kernels/nvfp4/check.py``, and on per-expert scales, tiny blocks and strided inputs), the reference against the
two public quantisers (compressed-tensors and ModelOpt), hand-built rounding cases, layouts and errors.

Kernel tests run under Triton's interpreter on the CPU (shapes stay small) with every fresh output poisoned, so an
element a kernel forgets to write shows up as NaN / 0xFF.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from conftest import assert_case_passes, check_cases, oracle

import lynn_kernels
from lynn_kernels import nvfp4
from lynn_kernels.metrics import bit_mismatches, compare
from lynn_kernels.nvfp4 import NVFP4Tensor, dequantize, quantize, reference

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

DTYPES = [pytest.param(BF16, id="bf16"), pytest.param(FP16, id="fp16"), pytest.param(FP32, id="fp32")]
RECIPES = [pytest.param("modelopt", id="modelopt"), pytest.param("compressed-tensors", id="ct")]
IMPLS = [pytest.param(quantize, id="kernel"), pytest.param(reference.quantize, id="reference")]

ORACLE_SHAPES = [pytest.param((3, 48), id="3x48"), pytest.param((37, 208), id="37x208"),
                 pytest.param((129, 1040), id="129x1040")]

E4M3_ONE = 0x38      # E4M3FN bits of 1.0
E4M3_448 = 0x7E      # ... of 448 (the largest finite)
E4M3_EIGHTH = 0x20   # ... of 0.125 (compressed-tensors' zero-scale replacement)


def scale_bytes(q: NVFP4Tensor) -> torch.Tensor:
    return q.scales.view(torch.uint8)


def assert_same_nvfp4(got: NVFP4Tensor, want: NVFP4Tensor, what: str = "") -> None:
    """Byte-for-byte: codes, block scales (as uint8) and the fp32 global scale."""
    assert tuple(got.shape) == tuple(want.shape), what
    assert tuple(got.scales.shape) == tuple(want.scales.shape), what
    assert tuple(got.global_scale.shape) == tuple(want.global_scale.shape), what
    assert bit_mismatches(got.codes, want.codes) == 0, f"codes differ {what}"
    assert bit_mismatches(scale_bytes(got), scale_bytes(want)) == 0, f"block scales differ {what}"
    assert bit_mismatches(got.global_scale, want.global_scale) == 0, f"global scale differs {what}"


def assert_bit_equal(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    assert got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape), what
    m = compare(got, want, exact=True)
    assert m.mismatches == 0, f"{m.mismatches} of {m.numel} elements differ in bits {what}: {m}"


# ---------------------------------------------------------------------------------------------------------------
# 0. the poison really reaches the kernels' outputs


class _NoLaunch:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](...)`` does nothing, so no output gets written."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def test_poison_catches_an_unwritten_output(monkeypatch, make_weight, poison_empty):
    from lynn_kernels.nvfp4 import triton_quant

    assert torch.isnan(torch.empty(3)).all() and torch.isnan(torch.empty_like(torch.zeros(2, dtype=BF16))).all()
    assert torch.empty(4, dtype=torch.uint8).tolist() == [0xFF] * 4
    assert torch.empty(2, dtype=torch.float8_e4m3fn).view(torch.uint8).tolist() == [0xFF] * 2   # E4M3 NaN
    q = reference.quantize(make_weight((3, 48)))
    monkeypatch.setattr(triton_quant.DEQUANTIZE, "shipped", _NoLaunch())
    monkeypatch.setattr(triton_quant.QUANTIZE, "shipped", _NoLaunch())
    assert torch.isnan(dequantize(q, FP32)).all()
    skipped = triton_quant.launch_quantize(make_weight((3, 48)), q.global_scale, "modelopt")[0]
    assert (skipped.codes == 0xFF).all() and torch.isnan(skipped.scales.float()).all()


# ---------------------------------------------------------------------------------------------------------------
# 1. quantize: kernel == reference, byte for byte


@pytest.mark.parametrize("case", check_cases("nvfp4", "nvfp4.quantize"))
def test_quantize_kernel_matches_reference(case, poison_empty):
    """The check matrix's weights, both recipes, the recipe's own global scale and a given one in each form: codes,
    scales and global scale of the reference's layout and bits (a byte never written shows up as 0xFF)."""
    assert_case_passes(case)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,g_dims", [pytest.param((2, 5, 80), 1, id="2x5x80-g[E]"),
                                          pytest.param((3, 37, 48), 1, id="3x37x48-g[E]"),
                                          pytest.param((2, 5, 80), 2, id="2x5x80-g[E,N]")])
def test_quantize_kernel_matches_reference_per_expert_global(shape, g_dims, dtype, recipe, make_weight,
                                                             poison_empty):
    w = make_weight(shape, FP32, seed=7)
    w = w * torch.tensor([0.01, 1.0, 30.0][: shape[0]], device=w.device).reshape(-1, 1, 1)   # very different ranges
    w = w.to(dtype)
    g = w.float().abs().amax(dim=tuple(range(g_dims, w.dim()))) / 2688.0   # [E] or [E, N]
    got = quantize(w, global_scale=g, recipe=recipe)
    want = reference.quantize(w, global_scale=g, recipe=recipe)
    assert tuple(got.global_scale.shape) == tuple(shape[:g_dims])
    assert_same_nvfp4(got, want)
    # each expert quantised alone with its own scale gives the same bytes as its slice of the stack
    for e in range(shape[0]):
        alone = reference.quantize(w[e], global_scale=g[e], recipe=recipe)
        assert_same_nvfp4(got[e], alone, f"expert {e}")


# ---------------------------------------------------------------------------------------------------------------
# 2. oracle: compressed-tensors


# The global-scale reciprocal: in fp32, 1 / (1 / G) != G for some G (G = 2688 / 3 = 896 gives 895.99994), so a
# compressed-tensors G must be kept as is (NVFP4Tensor.recip_global_scale, quantize(..., recip_global_scale=G)):
# from 1 / g, q = w / (s / G) lands 1 ulp off CT's and an exact E2M1 tie (bf16 weights have many) rounds the other way.


#: fixtures that load an oracle package (the summary counts the tests that use them)
ORACLE_FIXTURES = {"ct": "compressed_tensors", "NVFP4QTensor": "modelopt"}


@pytest.fixture(scope="module")
def ct():
    """compressed-tensors' own NVFP4 pipeline (CPU path): ``quant(w, gs_ct) -> (codes, fp8 scales)``."""
    oracle("compressed_tensors")
    from compressed_tensors.compressors.nvfp4.helpers import quantize_and_pack_fp4
    from compressed_tensors.quantization import QuantizationArgs, QuantizationStrategy, QuantizationType
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    args = QuantizationArgs(num_bits=4, type=QuantizationType.FLOAT, strategy=QuantizationStrategy.TENSOR_GROUP,
                            group_size=16, symmetric=True, dynamic=False, scale_dtype=torch.float8_e4m3fn)

    def quant(w: torch.Tensor, gs_ct: torch.Tensor):
        blocks = w.unflatten(-1, (-1, 16))
        scale, _ = calculate_qparams(blocks.amin(-1), blocks.amax(-1), args, global_scale=gs_ct)
        codes = quantize_and_pack_fp4(w, scale, global_scale=gs_ct)
        return codes, scale.to(torch.float8_e4m3fn)

    return SimpleNamespace(quant=quant, generate_gparam=generate_gparam)


def assert_matches_ct(q: NVFP4Tensor, codes: torch.Tensor, scales: torch.Tensor, what: str = "") -> None:
    assert bit_mismatches(q.codes, codes) == 0, f"codes differ from compressed-tensors {what}"
    assert bit_mismatches(scale_bytes(q), scales.view(torch.uint8)) == 0, f"scales differ {what}"


CT_DTYPES = [pytest.param(BF16, id="bf16"), pytest.param(FP16, id="fp16"), pytest.param(FP32, id="fp32")]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", CT_DTYPES)
@pytest.mark.parametrize("shape", ORACLE_SHAPES)
def test_ct_oracle_given_global_scale(shape, dtype, impl, ct, make_weight, poison_empty):
    w = make_weight(shape, dtype, seed=shape[-1], scale=0.02)        # weight-like magnitudes
    g = 1.0 / ct.generate_gparam(w.amin(), w.amax())                 # our convention: multiply
    big_g = torch.ones_like(g) / g                                   # what our CT recipe uses, and what CT is given
    codes, scales = ct.quant(w, big_g)
    q = impl(w, global_scale=g, recipe="compressed-tensors")
    assert_matches_ct(q, codes, scales)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", CT_DTYPES)
@pytest.mark.parametrize("shape", ORACLE_SHAPES)
def test_ct_oracle_from_scratch(shape, dtype, impl, ct, make_weight, poison_empty):
    w = make_weight(shape, dtype, seed=shape[-1], scale=0.02)
    gs_ct = ct.generate_gparam(w.amin(), w.amax())
    codes, scales = ct.quant(w, gs_ct)
    q = impl(w, recipe="compressed-tensors")
    stored = q.to_compressed_tensors()["weight_global_scale"]
    assert stored.dtype == FP32 and tuple(stored.shape) == (1,)
    assert bit_mismatches(stored, gs_ct) == 0, f"weight_global_scale {stored.item()!r} != CT's {gs_ct.item()!r}"
    assert_matches_ct(q, codes, scales)


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype,std", [
    pytest.param(BF16, 0.02, id="bf16-std0.02"),
    pytest.param(FP32, 0.02, id="fp32-std0.02"),
    pytest.param(FP32, 1.0, id="fp32-std1"),
    # this seed's amax is 2.99.., which bf16 rounds to 3.0: CT's G = 896, the value of the reciprocal bug below
    pytest.param(BF16, 1.0, id="bf16-std1"),
])
def test_ct_oracle_zero_and_tiny_blocks(dtype, std, impl, ct, make_weight, poison_empty):
    """A zero block (CT's scale becomes 0.125) and a tiny block (its E4M3 scale underflows to 0, then 0.125)."""
    w = make_weight((4, 64), FP32, seed=11, scale=std)
    w[1, 16:32] = 0.0
    w[2, 32:48] *= 1e-7 * w.abs().amax()
    w = w.to(dtype)
    gs_ct = ct.generate_gparam(w.amin(), w.amax())
    codes, scales = ct.quant(w, gs_ct)
    q = impl(w, recipe="compressed-tensors", recip_global_scale=gs_ct)
    assert scale_bytes(q)[1, 1].item() == E4M3_EIGHTH and scale_bytes(q)[2, 2].item() == E4M3_EIGHTH
    assert_matches_ct(q, codes, scales)


def _amax3_block(dtype) -> torch.Tensor:
    """One block with amax 3 (so CT's G = 2688 / 3 = 896) and +-1.75, which CT divides onto the exact tie 3.5."""
    w = torch.zeros(1, 16, dtype=dtype)
    w[0, 0], w[0, 2], w[0, 3], w[0, 4] = 3.0, 1.75, -1.75, 1.25
    return w


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [pytest.param(BF16, id="bf16"), pytest.param(FP32, id="fp32")])
def test_ct_oracle_tie_after_global_scale_reciprocal(dtype, impl, ct, device):
    w = _amax3_block(dtype).to(device)
    gs_ct = ct.generate_gparam(w.amin(), w.amax())
    assert gs_ct.item() == 896.0
    codes, scales = ct.quant(w, gs_ct)
    assert codes[0, 1].item() == 0xE6          # CT: 1.75 / 0.5 = 3.5, a tie, -> 4.0 (code 6); -1.75 -> 0xE
    q = impl(w, recipe="compressed-tensors", recip_global_scale=gs_ct)   # G as is: 1 / (1 / 896) != 896 in fp32
    assert_matches_ct(q, codes, scales)
    q = impl(w, recipe="compressed-tensors")                             # from scratch: the same G
    assert_matches_ct(q, codes, scales)


@pytest.mark.parametrize("dtype", [pytest.param(BF16, id="bf16"), pytest.param(FP32, id="fp32")])
def test_ct_from_scratch_global_scale_is_cts(dtype, ct, device):
    w = _amax3_block(dtype).to(device)
    gs_ct = ct.generate_gparam(w.amin(), w.amax())
    stored = quantize(w, recipe="compressed-tensors").to_compressed_tensors()["weight_global_scale"]
    assert bit_mismatches(stored, gs_ct) == 0, f"{stored.item()!r} != {gs_ct.item()!r}"


def test_compressed_tensors_layout_keeps_weight_global_scale(device):
    q = reference.quantize(torch.randn(2, 32, generator=torch.Generator().manual_seed(0)).to(device))
    sd = {"weight_packed": q.codes, "weight_scale": q.scales,
          "weight_global_scale": torch.tensor([896.0], dtype=FP32, device=device)}
    back = NVFP4Tensor.from_compressed_tensors(**sd).to_compressed_tensors()["weight_global_scale"]
    assert bit_mismatches(back, sd["weight_global_scale"]) == 0, f"{back.item()!r} != 896.0"


# ---------------------------------------------------------------------------------------------------------------
# 3. oracle: ModelOpt


@pytest.fixture(scope="module")
def NVFP4QTensor():
    """ModelOpt's quantiser (its import takes several seconds, so once per module)."""
    mod = oracle("modelopt.torch.quantization.qtensor.nvfp4_tensor")
    return mod.NVFP4QTensor


@pytest.mark.parametrize("gs_mode", ["scratch", "given"])
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [pytest.param(BF16, id="bf16"), pytest.param(FP32, id="fp32")])
@pytest.mark.parametrize("shape", ORACLE_SHAPES)
def test_modelopt_oracle(shape, dtype, impl, gs_mode, NVFP4QTensor, make_weight, poison_empty):
    w = make_weight(shape, dtype, seed=shape[0], scale=0.02)
    if gs_mode == "scratch":
        qt, s, g = NVFP4QTensor.quantize(w.clone(), 16)
        q = impl(w)
    else:
        g_given = (w.float().abs().amax() / 2688.0 * 0.75).reshape(())   # top blocks clamp at 448
        qt, s, g = NVFP4QTensor.quantize(w.clone(), 16, weights_scaling_factor_2=g_given)
        q = impl(w, global_scale=g_given)
    codes = qt._quantized_data
    assert codes.dtype == torch.uint8 and tuple(codes.shape) == tuple(q.codes.shape)
    assert bit_mismatches(q.codes, codes) == 0
    assert bit_mismatches(scale_bytes(q), s.view(torch.uint8)) == 0
    assert bit_mismatches(q.global_scale, g.reshape(q.global_scale.shape).float()) == 0


@pytest.mark.parametrize("dtype", [pytest.param(BF16, id="bf16"), pytest.param(FP32, id="fp32")])
def test_modelopt_dequantize_agrees(dtype, NVFP4QTensor, make_weight, poison_empty):
    """Our fp32 dequantize equals ModelOpt's value for value. The only bit difference allowed is the sign of zero:
    ModelOpt decodes code 0x8 as +0, we decode it as -0 (docs/nvfp4.md: 0x8 is -0)."""
    w = make_weight((37, 208), dtype, seed=5)
    qt, s, g = NVFP4QTensor.quantize(w.clone(), 16)
    theirs = qt.dequantize(dtype=FP32, scale=s, double_scale=g, block_sizes={-1: 16})
    q = reference.quantize(w)
    for ours in (dequantize(q, FP32), reference.dequantize(q, FP32)):
        m = compare(ours, theirs, exact=True)
        assert m.max_abs == 0.0 and torch.equal(ours, theirs), m
        differ = ours.view(torch.int32) != theirs.view(torch.int32)
        assert bool((ours[differ] == 0).all()) and bool(torch.signbit(ours[differ]).all())


# ModelOpt 0.47 clamps block scales into [2**-9, 448] before the E4M3 cast, so a tiny block keeps scale 2**-9.
@pytest.mark.parametrize("dtype", [pytest.param(BF16, id="bf16"), pytest.param(FP32, id="fp32")])
def test_modelopt_oracle_tiny_block(dtype, NVFP4QTensor, make_weight):
    w = make_weight((4, 64), FP32, seed=3)
    w[1, 16:32] *= 1e-7 * w.abs().amax()
    w = w.to(dtype)
    qt, s, _ = NVFP4QTensor.quantize(w.clone(), 16)
    q = reference.quantize(w)
    assert bit_mismatches(scale_bytes(q), s.view(torch.uint8)) == 0
    assert bit_mismatches(q.codes, qt._quantized_data) == 0


# ---------------------------------------------------------------------------------------------------------------
# 4. hand-built rounding cases (independent of the reference)

# Block 0: amax 6 with global 1.0, so the block scale is exactly 1.0 and q = w. Every E2M1 tie, both signs.
# Block 1: the non-ties, -6 as the amax, -0.1 (rounds to -0: 0x8), 0.0.
ROUNDING_ROW = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -0.0,
                -0.1, -6.0, 0.1, 0.3, 0.5, 0.7, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 4.5, 5.5, 2.75, 0.0]
# codes:    7 0 | 2 2 | 4 4 | 6 6 | 8 A | A C | C E | E 0  ||  8 F | 0 1 | 1 1 | 2 3 | 4 5 | 6 7 | 6 7 | 5 0
# (0.25->0, 0.75->1.0, 1.25->1.0, 1.75->2.0, 2.5->2.0, 3.5->4.0, 5->4.0; -0.0 -> 0x0; -0.1 -> 0x8)
ROUNDING_BYTES = [0x07, 0x22, 0x44, 0x66, 0xA8, 0xCA, 0xEC, 0x0E,
                  0xF8, 0x10, 0x11, 0x32, 0x54, 0x76, 0x76, 0x05]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rounding_ties_to_even_and_signs(dtype, recipe, impl, device, poison_empty):
    w = torch.tensor([ROUNDING_ROW], dtype=dtype, device=device)
    q = impl(w, global_scale=1.0, recipe=recipe)
    assert scale_bytes(q).tolist() == [[E4M3_ONE, E4M3_ONE]]
    assert q.codes.tolist() == [ROUNDING_BYTES], [hex(b) for b in q.codes[0].tolist()]
    assert q.global_scale.item() == 1.0


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_saturation_clamps_scale_to_448(recipe, impl, device, poison_empty):
    """global 1e-3 and block amax 100 ask for a block scale of ~16667: it clamps to 448 and big values saturate."""
    row = [100.0, -100.0, 50.0, 3.0, -3.0, 2.0, 1.0, 0.5, 0.1] + [0.0] * 7 + [0.0] * 16
    w = torch.tensor([row], dtype=FP32, device=device)
    q = impl(w, global_scale=1e-3, recipe=recipe)
    zero_block_scale = E4M3_ONE if recipe == "modelopt" else E4M3_EIGHTH
    assert scale_bytes(q).tolist() == [[E4M3_448, zero_block_scale]]
    # divisor 0.448: 100 -> 7, -100 -> F, 50 -> 7, 3 (6.7) -> 7, -3 -> F, 2 (4.46) -> 6, 1 (2.23) -> 4,
    # 0.5 (1.12) -> 2, 0.1 (0.22) -> 0
    assert q.codes.tolist() == [[0xF7, 0x77, 0x6F, 0x24, 0x00] + [0x00] * 11]
    assert dequantize(q, FP32)[0, 0].item() == pytest.approx(6 * 448 * 1e-3, rel=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_zero_block_and_zero_tensor_decode_to_zero(recipe, impl, make_weight, device, poison_empty):
    w = make_weight((3, 48), FP32, seed=2)
    w[1, 16:32] = 0.0
    q = impl(w, recipe=recipe)
    assert scale_bytes(q)[1, 1].item() == (E4M3_ONE if recipe == "modelopt" else E4M3_EIGHTH)
    assert q.codes[1, 8:16].tolist() == [0] * 8
    for out in (dequantize(q, FP32), reference.dequantize(q, FP32)):
        assert out[1, 16:32].tolist() == [0.0] * 16

    z = torch.zeros(3, 32, device=device)
    qz = impl(z, recipe=recipe)
    assert qz.global_scale.item() == 1.0
    assert qz.codes.tolist() == [[0] * 16] * 3
    for dtype in (BF16, FP16, FP32):
        assert_bit_equal(dequantize(qz, dtype), torch.zeros(3, 32, dtype=dtype, device=device), f"-> {dtype}")


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning", "ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_tiny_block_kernel_matches_reference(dtype, recipe, make_weight, poison_empty):
    """A block at 1e-7 x the tensor amax: its E4M3 scale underflows (ModelOpt recipe: scale 0, codes saturate;
    compressed-tensors recipe: scale 0.125); the kernel must still agree with the reference."""
    w = make_weight((5, 64), FP32, seed=4)
    w[3, 32:48] *= 1e-7 * w.abs().amax()
    w = w.to(dtype)
    assert_same_nvfp4(quantize(w, recipe=recipe), reference.quantize(w, recipe=recipe))
    q = reference.quantize(w, recipe=recipe)
    assert_bit_equal(dequantize(q, FP32), reference.dequantize(q, FP32))


# ---------------------------------------------------------------------------------------------------------------
# 5. dequantize: kernel == reference, bit for bit


OUT_DTYPES = DTYPES


@pytest.mark.parametrize("case", check_cases("nvfp4", "nvfp4.dequantize"))
def test_dequantize_kernel_matches_reference(case, poison_empty):
    assert_case_passes(case)


def test_dequantize_default_dtype_is_bf16(make_weight, poison_empty):
    q = reference.quantize(make_weight((3, 48), FP32))
    assert dequantize(q).dtype == BF16 and q.dequantize().dtype == BF16
    assert_bit_equal(q.dequantize(FP16), reference.dequantize(q, FP16))


@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_dequantize_stacked_experts(out_dtype, make_weight, poison_empty):
    experts = [make_weight((37, 48), FP32, seed=e, scale=s) for e, s in enumerate([0.001, 1.0, 250.0])]
    parts = [quantize(w) for w in experts]
    q = NVFP4Tensor.stack(parts)
    assert tuple(q.global_scale.shape) == (3,) and tuple(q.shape) == (3, 37, 48)
    got = dequantize(q, out_dtype)
    assert_bit_equal(got, reference.dequantize(q, out_dtype))
    for e, part in enumerate(parts):
        assert_bit_equal(got[e], reference.dequantize(part, out_dtype), f"expert {e}")


@pytest.mark.parametrize("impl", [pytest.param(dequantize, id="kernel"),
                                  pytest.param(reference.dequantize, id="reference")])
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_dequantize_every_code_by_hand(out_dtype, impl, device, poison_empty):
    # row 0: the 16 codes in order (low nibble first), one block, scale 1.5 (E4M3 0x3C), global 0.25 -> x 0.375
    # row 1: the same codes with the smallest subnormal scale 2**-9 (0x01)
    codes = torch.tensor([[0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]] * 2, dtype=torch.uint8, device=device)
    scales = torch.tensor([[0x3C], [0x01]], dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
    q = NVFP4Tensor(codes, scales, torch.tensor(0.25, device=device))
    row0 = [0.0, 0.1875, 0.375, 0.5625, 0.75, 1.125, 1.5, 2.25,
            -0.0, -0.1875, -0.375, -0.5625, -0.75, -1.125, -1.5, -2.25]
    e2m1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    row1 = [v * 2.0**-9 * 0.25 for v in e2m1]
    want = torch.tensor([row0, row1], dtype=out_dtype, device=device)
    assert torch.signbit(want[0, 8]).item()   # the table itself carries -0.0
    assert_bit_equal(impl(q, out_dtype), want)


def test_dequantize_nan_scale_propagates(device, poison_empty):
    """E4M3FN 0x7F is NaN: a block with that scale decodes to NaN in both implementations, nothing else does."""
    codes = torch.full((1, 16), 0x21, dtype=torch.uint8, device=device)
    scales = torch.tensor([[0x38, 0x7F]], dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
    q = NVFP4Tensor(codes, scales, torch.tensor(1.0, device=device))
    for out in (dequantize(q, FP32), reference.dequantize(q, FP32)):
        assert torch.isnan(out[0, 16:]).all() and torch.isfinite(out[0, :16]).all()
        assert out[0, :2].tolist() == [0.5, 1.0]


# bf16 subnormals: the interpreter's own bf16 <-> fp32 conversions mangle them, so bf16 travels as int16 bits there
# (runtime.kernel_view / to_float32 / cast_output); these cases keep that honest.


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning", "ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize("recipe", RECIPES)
def test_quantize_bf16_subnormal_input(recipe, make_weight, poison_empty):
    w = make_weight((2, 32), FP32, seed=0)
    w[1, 16:] *= 1e-39                                    # one block of bf16 subnormals next to normal values
    w = w.to(BF16)
    assert_same_nvfp4(quantize(w, recipe=recipe), reference.quantize(w, recipe=recipe))


def test_dequantize_bf16_subnormal_output(device, poison_empty):
    codes = torch.tensor([[0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]], dtype=torch.uint8, device=device)
    scales = torch.tensor([[E4M3_ONE]], dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
    q = NVFP4Tensor(codes, scales, torch.tensor(2.0**-130, device=device))   # every value a bf16 subnormal
    assert_bit_equal(dequantize(q, BF16), reference.dequantize(q, BF16))


# ---------------------------------------------------------------------------------------------------------------
# 6. round-trip quality


@pytest.mark.parametrize("case", check_cases("nvfp4", "nvfp4 round trip"))
def test_round_trip_check(case, poison_empty):
    assert_case_passes(case)


@pytest.mark.parametrize("recipe", RECIPES)
def test_round_trip_quality(recipe, make_weight, poison_empty):
    w = make_weight((64, 256), FP32, seed=0)
    m = compare(dequantize(quantize(w, recipe=recipe), FP32), w)
    assert m.cosine > 0.99 and m.rel_l2 < 0.12, m
    # no element is off by more than half the top E2M1 gap (4 -> 6) times its block scale, which is at most
    # amax / 6 after rounding the scale up to E4M3 (3 mantissa bits: at most 1/16 up)
    assert m.max_abs <= w.abs().amax().item() / 6.0 * (1 + 1 / 16), m


# ---------------------------------------------------------------------------------------------------------------
# 7. layouts, stacking, sizes


def _q(shape=(8, 64), seed=0, recipe="modelopt") -> NVFP4Tensor:
    w = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(lynn_kernels.runtime.DEVICE)
    return reference.quantize(w, recipe=recipe)


def test_modelopt_layout_round_trip():
    q = _q()
    sd = q.to_modelopt()
    assert set(sd) == {"weight", "weight_scale", "weight_scale_2"}
    assert sd["weight"].dtype == torch.uint8 and tuple(sd["weight"].shape) == (8, 32)
    assert sd["weight_scale"].dtype == torch.float8_e4m3fn and tuple(sd["weight_scale"].shape) == (8, 4)
    assert sd["weight_scale_2"].dtype == FP32 and sd["weight_scale_2"].dim() == 0
    assert_same_nvfp4(NVFP4Tensor.from_modelopt(**sd), q)
    # a [1]-shaped weight_scale_2 (as some exporters write it) loads as the same scalar
    sd1 = dict(sd, weight_scale_2=sd["weight_scale_2"].reshape(1))
    assert_same_nvfp4(NVFP4Tensor.from_modelopt(**sd1), q)


@pytest.mark.parametrize("recipe", RECIPES)
def test_compressed_tensors_layout_round_trip(recipe):
    q = _q(recipe=recipe, seed=1)
    sd = q.to_compressed_tensors()
    assert set(sd) == {"weight_packed", "weight_scale", "weight_global_scale"}
    gs = sd["weight_global_scale"]
    assert gs.dtype == FP32 and tuple(gs.shape) == (1,)
    assert bit_mismatches(gs, (1.0 / q.global_scale).reshape(1)) == 0     # the reciprocal: divide convention
    back = NVFP4Tensor.from_compressed_tensors(**sd)
    assert bit_mismatches(back.codes, q.codes) == 0
    assert bit_mismatches(scale_bytes(back), scale_bytes(q)) == 0
    assert bit_mismatches(back.global_scale, 1.0 / gs.reshape(())) == 0
    assert bit_mismatches(back.to_compressed_tensors()["weight_global_scale"], gs) == 0


def test_compressed_tensors_layout_stacked_global():
    q = NVFP4Tensor.stack([_q(seed=s) for s in range(3)])
    gs = q.to_compressed_tensors()["weight_global_scale"]
    assert tuple(gs.shape) == (3,)
    assert bit_mismatches(gs, 1.0 / q.global_scale) == 0


@pytest.mark.parametrize("layout", ["modelopt", "compressed-tensors"])
def test_safetensors_round_trip(layout, tmp_path):
    from safetensors.torch import load_file, save_file

    prefix = "model.layers.0.mlp.experts.3.down_proj"
    q = _q((16, 208), seed=2, recipe=layout)
    tensors = q.to_modelopt() if layout == "modelopt" else q.to_compressed_tensors()
    sd = {f"{prefix}.{k}": v.contiguous().cpu() for k, v in tensors.items()}
    sd["model.layers.0.mlp.experts.3.up_proj.weight"] = torch.zeros(2, 2)   # a neighbour the loader must ignore
    path = tmp_path / "model.safetensors"
    save_file(sd, str(path))
    loaded = load_file(str(path))
    for name in (prefix, prefix + "."):
        back = NVFP4Tensor.from_state_dict(loaded, name)
        assert bit_mismatches(back.codes, q.codes) == 0
        assert bit_mismatches(scale_bytes(back), scale_bytes(q)) == 0
        if layout == "modelopt":
            assert bit_mismatches(back.global_scale, q.global_scale) == 0
        else:
            want = loaded[f"{prefix}.weight_global_scale"]
            assert bit_mismatches(back.global_scale, 1.0 / want.reshape(())) == 0
        assert torch.equal(reference.dequantize(back, FP32), reference.dequantize(q.to("cpu"), FP32))


def test_stack_and_getitem():
    parts = [_q((5, 32), seed=s) for s in range(3)]
    q = NVFP4Tensor.stack(parts)
    assert tuple(q.shape) == (3, 5, 32) and len(q) == 3 and q.dim() == 3
    assert tuple(q.global_scale.shape) == (3,)
    assert q.rows_per_global() == 5
    for i in (0, 1, 2, -1):
        assert_same_nvfp4(q[i], parts[i], f"index {i}")
    # a scalar-global tensor indexes without touching its global scale
    single = _q((4, 32))
    row = single[2]
    assert tuple(row.shape) == (32,) and row.global_scale.dim() == 0
    assert bit_mismatches(row.codes, single.codes[2]) == 0
    assert single.rows_per_global() == 4
    with pytest.raises(TypeError, match="integer indexing"):
        q[0:2]
    with pytest.raises(IndexError, match="1-D NVFP4Tensor"):
        row[0]
    with pytest.raises(ValueError, match="at least one tensor"):
        NVFP4Tensor.stack([])
    with pytest.raises(ValueError, match="one shape"):
        NVFP4Tensor.stack([_q((5, 32)), _q((5, 48))])
    with pytest.raises(ValueError, match="global scales of one shape"):
        NVFP4Tensor.stack([q, NVFP4Tensor(q.codes, q.scales, q.global_scale[0])])


def test_nbytes_shape_repr_and_to():
    q = _q((8, 64))
    assert q.nbytes == 8 * 32 + 8 * 4 + 4
    assert q.shape == torch.Size((8, 64)) and q.device == lynn_kernels.runtime.DEVICE
    stacked = NVFP4Tensor.stack([q, q])
    assert stacked.nbytes == 2 * (8 * 32 + 8 * 4) + 2 * 4
    assert "shape=(8, 64)" in repr(q) and "[2 scales]" in repr(stacked)
    moved = q.to("cpu")
    assert moved.device.type == "cpu"
    assert bit_mismatches(moved.codes, q.codes.cpu()) == 0


def test_public_exports():
    assert lynn_kernels.quantize is nvfp4.quantize and lynn_kernels.dequantize is nvfp4.dequantize
    assert nvfp4.quantize.reference is reference.quantize
    assert nvfp4.dequantize.reference is reference.dequantize
    assert nvfp4.e2m1_table().tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                                           -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    assert nvfp4.BLOCK == 16 and nvfp4.E4M3_MAX == 448.0 and nvfp4.RECIPES == ("modelopt", "compressed-tensors")


# ---------------------------------------------------------------------------------------------------------------
# 8. errors a user can act on


@pytest.mark.parametrize("impl", IMPLS)
class TestQuantizeErrors:
    def test_k_not_multiple_of_16(self, impl, device):
        with pytest.raises(ValueError, match=r"w has K = 40 \(shape \(4, 40\)\).*multiple of 16"):
            impl(torch.ones(4, 40, device=device))

    @pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
    @pytest.mark.parametrize("gs", [None, 0.01, "tensor"], ids=["no-gs", "float-gs", "tensor-gs"])
    def test_non_finite_w(self, impl, bad, gs, make_weight, poison_empty):
        w = make_weight((37, 208), FP32, seed=9)
        w[36, 207] = bad                     # the last element: the last program of the kernel's grid
        g = torch.tensor(0.01) if gs == "tensor" else gs
        with pytest.raises(ValueError, match="w contains NaN or Inf"):
            impl(w, global_scale=g)

    @pytest.mark.parametrize("dtype", [torch.int32, torch.uint8, torch.float64, torch.float8_e4m3fn],
                             ids=["int32", "uint8", "fp64", "fp8"])
    def test_bad_dtype(self, impl, dtype, device):
        with pytest.raises(TypeError, match=f"w has dtype {dtype}; NVFP4 quantises bfloat16, float16 or float32"):
            impl(torch.zeros(2, 32, device=device).to(dtype))

    def test_not_a_tensor(self, impl):
        with pytest.raises(TypeError, match="w must be a torch.Tensor, got list"):
            impl([[1.0] * 16])

    @pytest.mark.parametrize("shape", [(0, 16), (4, 0), (2, 0, 32)], ids=["0x16", "4x0", "2x0x32"])
    def test_empty(self, impl, shape, device):
        with pytest.raises(ValueError, match="w is empty"):
            impl(torch.zeros(shape, device=device))

    def test_zero_dim(self, impl, device):
        with pytest.raises(ValueError, match="w must have at least one dimension.*0-d"):
            impl(torch.tensor(1.0, device=device))

    def test_bad_recipe(self, impl, device):
        with pytest.raises(ValueError, match=r"recipe='nvidia'.*expected one of \('modelopt', 'compressed-tensors'\)"):
            impl(torch.ones(2, 16, device=device), recipe="nvidia")

    @pytest.mark.parametrize("gs", [0.0, -1.0, math.nan, math.inf, torch.tensor([1.0, -1.0])],
                             ids=["zero", "negative", "nan", "inf", "one-negative-of-[E]"])
    def test_bad_global_scale_value(self, impl, gs, device):
        with pytest.raises(ValueError, match="global_scale must be finite and > 0"):
            impl(torch.ones(2, 3, 16, device=device), global_scale=gs)

    @pytest.mark.parametrize("gs_shape", [(3,), (2, 2), (2, 1), (2, 3, 1), (1, 1)],
                             ids=["[3]", "[2,2]", "[2,1]", "[2,3,1]", "[1,1]"])
    def test_bad_global_scale_shape(self, impl, gs_shape, device):
        w = torch.ones(2, 3, 16, device=device)
        with pytest.raises(ValueError, match=r"global_scale has shape .*prefix of the leading dims \(2, 3\)"):
            impl(w, global_scale=torch.ones(gs_shape))

    def test_integer_global_scale_tensor(self, impl, device):
        with pytest.raises(TypeError, match="global_scale has dtype torch.int64; expected a float"):
            impl(torch.ones(2, 16, device=device), global_scale=torch.tensor(1))


def test_python_int_global_scale_is_a_number(device):
    w = torch.ones(2, 16, device=device)
    assert_same_nvfp4(reference.quantize(w, global_scale=1), reference.quantize(w, global_scale=1.0))


def test_kernel_rejects_wrong_device():
    w = torch.ones(2, 16, device="meta")
    with pytest.raises(ValueError, match="w is on meta, but kernels run on"):
        quantize(w)
    q = NVFP4Tensor(torch.zeros(2, 8, dtype=torch.uint8, device="meta"),
                    torch.zeros(2, 1, dtype=torch.float8_e4m3fn, device="meta"), torch.ones((), device="meta"))
    with pytest.raises(ValueError, match="q.codes is on meta, but kernels run on"):
        dequantize(q)


@pytest.mark.parametrize("impl", [pytest.param(dequantize, id="kernel"),
                                  pytest.param(reference.dequantize, id="reference")])
def test_dequantize_errors(impl, device):
    q = _q((2, 32))
    for bad in (torch.int8, torch.float64, torch.float8_e4m3fn):
        with pytest.raises(TypeError, match=f"dtype={bad}: dequantize writes one of"):
            impl(q, bad)
    with pytest.raises(TypeError, match="q must be an NVFP4Tensor, got Tensor"):
        impl(torch.zeros(2, 32, device=device))


class TestLayoutErrors:
    def parts(self):
        q = _q((4, 32))
        return q.codes, q.scales, q.global_scale

    def test_scales_wrong_shape(self):
        codes, scales, g = self.parts()
        with pytest.raises(ValueError, match=r"scales has shape \(4, 1\); codes \(4, 16\) \(K = 32\) needs "
                                             r"scales of shape \(4, 2\)"):
            NVFP4Tensor(codes, scales[:, :1], g)
        with pytest.raises(ValueError, match="weight_scale has shape"):          # named as in the checkpoint
            NVFP4Tensor.from_modelopt(codes, scales.t(), g)

    def test_codes_wrong_dtype(self):
        codes, scales, g = self.parts()
        with pytest.raises(TypeError, match="codes has dtype torch.int8; expected torch.uint8"):
            NVFP4Tensor(codes.view(torch.int8), scales, g)

    def test_codes_bad_k(self):
        _, _, g = self.parts()
        with pytest.raises(ValueError, match="codes has shape \\(4, 12\\): K = 24 is not a multiple of 16"):
            NVFP4Tensor(torch.zeros(4, 12, dtype=torch.uint8), torch.zeros(4, 1, dtype=torch.float8_e4m3fn), g)
        with pytest.raises(ValueError, match="codes must be a non-empty"):
            NVFP4Tensor(torch.zeros(0, 8, dtype=torch.uint8), torch.zeros(0, 1, dtype=torch.float8_e4m3fn), g)

    @pytest.mark.parametrize("dtype", [torch.uint8, torch.float32, torch.float8_e5m2, torch.bfloat16],
                             ids=["uint8", "fp32", "e5m2", "bf16"])
    def test_scales_not_e4m3(self, dtype):
        codes, scales, g = self.parts()
        with pytest.raises(TypeError, match=f"scales has dtype {dtype}; expected torch.float8_e4m3fn"):
            NVFP4Tensor(codes, scales.float().to(dtype), g)

    def test_global_wrong_shape(self):
        codes, scales, g = self.parts()
        for bad in (torch.ones(3), torch.ones(4, 16), torch.ones(4, 2)):
            with pytest.raises(ValueError, match=r"global_scale has shape .* expected \(\) or a prefix"):
                NVFP4Tensor(codes, scales, bad)
        with pytest.raises(ValueError, match="weight_scale_2 has shape"):
            NVFP4Tensor.from_modelopt(codes, scales, torch.ones(2))

    def test_global_wrong_dtype(self):
        codes, scales, g = self.parts()
        with pytest.raises(TypeError, match="global_scale has dtype torch.float64; expected torch.float32"):
            NVFP4Tensor(codes, scales, g.double())
        with pytest.raises(TypeError, match="weight_scale_2 has dtype torch.float64; expected torch.float32"):
            NVFP4Tensor.from_modelopt(codes, scales, g.double())
        with pytest.raises(TypeError, match="weight_global_scale has dtype torch.bfloat16; expected torch.float32"):
            NVFP4Tensor.from_compressed_tensors(codes, scales, g.reshape(1).bfloat16())

    def test_not_tensors(self):
        codes, scales, g = self.parts()
        with pytest.raises(TypeError, match="scales must be a torch.Tensor, got list"):
            NVFP4Tensor(codes, [1.0], g)

    def test_devices(self):
        codes, scales, g = self.parts()
        with pytest.raises(ValueError, match=r"codes, scales and global_scale are on different devices: "
                                             r"\['cpu', 'meta'\]"):
            NVFP4Tensor(codes.cpu(), scales.to("meta"), g.cpu())

    def test_from_state_dict_missing(self):
        q = _q((4, 32))
        ct_sd = {f"lin.{k}": v for k, v in q.to_compressed_tensors().items()}
        del ct_sd["lin.weight_scale"]
        with pytest.raises(KeyError, match=r"compressed-tensors layout at 'lin' is missing \['lin.weight_scale'\]"):
            NVFP4Tensor.from_state_dict(ct_sd, "lin")
        mo_sd = {f"lin.{k}": v for k, v in q.to_modelopt().items()}
        del mo_sd["lin.weight"]
        with pytest.raises(KeyError, match=r"ModelOpt layout at 'lin' is missing \['lin.weight'\]"):
            NVFP4Tensor.from_state_dict(mo_sd, "lin")
        with pytest.raises(KeyError, match=r"no NVFP4 weight at 'other': expected other.weight_packed"):
            NVFP4Tensor.from_state_dict(mo_sd, "other")


# ---------------------------------------------------------------------------------------------------------------
# 9. non-contiguous inputs


def _view(name: str, dtype, device) -> torch.Tensor:
    """A non-contiguous view (the base is cast first: ``.to(dtype)`` of a sliced view would be contiguous)."""
    g = torch.Generator().manual_seed(21)
    if name == "transposed":                                   # [37, 208], K has stride 37
        return torch.randn(208, 37, generator=g).to(dtype).to(device).t()
    if name == "every-other-row":                              # [37, 208], row stride 416
        return torch.randn(74, 208, generator=g).to(dtype).to(device)[::2]
    if name == "column-slice":                                 # [37, 208], row stride 256
        return torch.randn(37, 256, generator=g).to(dtype).to(device)[:, :208]
    if name == "3d-column-slice":                              # [2, 5, 80] out of [2, 5, 96]
        return torch.randn(2, 5, 96, generator=g).to(dtype).to(device)[..., :80]
    if name == "expanded-row":                                 # [7, 208], row stride 0
        return torch.randn(208, generator=g).to(dtype).to(device).expand(7, 208)
    raise KeyError(name)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("dtype", [pytest.param(BF16, id="bf16"), pytest.param(FP32, id="fp32")])
@pytest.mark.parametrize("view", ["transposed", "every-other-row", "column-slice", "3d-column-slice",
                                  "expanded-row"])
def test_non_contiguous_input(view, dtype, recipe, device, poison_empty):
    w = _view(view, dtype, device)
    assert not w.is_contiguous()
    assert_same_nvfp4(quantize(w, recipe=recipe), quantize(w.contiguous(), recipe=recipe))
    assert_same_nvfp4(reference.quantize(w, recipe=recipe), reference.quantize(w.contiguous(), recipe=recipe))


# ---------------------------------------------------------------------------------------------------------------
# 10. the real thing, on a GPU


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("dtype", [pytest.param(BF16, id="bf16"), pytest.param(FP16, id="fp16")])
def test_gpu_4096x4096_kernel_matches_reference(dtype, recipe, device):
    assert device.type == "cuda"
    w = torch.randn(4096, 4096, generator=torch.Generator().manual_seed(0)).mul(0.02).to(dtype).to(device)
    q = quantize(w, recipe=recipe)
    assert_same_nvfp4(q, reference.quantize(w, recipe=recipe))
    for out_dtype in (BF16, FP32):
        assert_bit_equal(dequantize(q, out_dtype), reference.dequantize(q, out_dtype))


def test_recip_global_scale_is_exclusive_and_ct_only(device):
    w = torch.ones(2, 16, device=device)
    g_ct = torch.tensor([896.0], device=device)
    with pytest.raises(ValueError, match="not both"):
        quantize(w, global_scale=1.0, recipe="compressed-tensors", recip_global_scale=g_ct)
    with pytest.raises(ValueError, match="recip_global_scale is compressed-tensors' convention"):
        quantize(w, recip_global_scale=g_ct)
    q = quantize(w, recipe="compressed-tensors", recip_global_scale=g_ct)
    assert q.to_compressed_tensors()["weight_global_scale"].item() == 896.0


def test_stack_keeps_compressed_tensors_global_scale(device):
    w = torch.zeros(2, 16, device=device)
    w[0, 0], w[0, 2] = 3.0, 1.75                                      # CT's G = 896, which 1 / (1 / G) does not keep
    ct_part = quantize(w, recipe="compressed-tensors")
    mo_part = quantize(w)
    stacked = NVFP4Tensor.stack([ct_part, mo_part])
    written = stacked.to_compressed_tensors()["weight_global_scale"]
    assert written[0].item() == 896.0
    assert bit_mismatches(written[1], torch.ones_like(mo_part.global_scale) / mo_part.global_scale) == 0
    assert stacked[0].to_compressed_tensors()["weight_global_scale"].item() == 896.0


def test_loader_errors_name_the_checkpoint_tensor(device):
    q = reference.quantize(torch.randn(4, 32, generator=torch.Generator().manual_seed(0)).to(device))
    sd = {f"m.{k}": v for k, v in q.to_modelopt().items()}
    sd["m.weight_scale"] = sd["m.weight_scale"][:, :1]
    with pytest.raises(ValueError, match=r"m\.weight_scale has shape \(4, 1\); m\.weight \(4, 16\)"):
        NVFP4Tensor.from_state_dict(sd, "m")
    sd = {f"m.{k}": v for k, v in q.to_compressed_tensors().items()}
    sd["m.weight_packed"] = sd["m.weight_packed"].to(torch.int16)
    with pytest.raises(TypeError, match=r"m\.weight_packed has dtype torch\.int16"):
        NVFP4Tensor.from_state_dict(sd, "m")


def test_ct_recipe_warns_when_its_global_scale_overflows(device):
    w = (torch.randn(4, 32, generator=torch.Generator().manual_seed(0)) * 0.005).to(FP16).to(device)
    with pytest.warns(UserWarning, match="w: 2688 / amax overflows torch.float16"):
        q = reference.quantize(w, recipe="compressed-tensors")
    assert q.global_scale.item() == 1.0


@pytest.mark.parametrize("amax", [1e35, 1e36, 3e38])
def test_dequantize_exact_for_huge_global_scales(amax, device, poison_empty):
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    w = (w / w.abs().max() * amax).to(device)
    q = reference.quantize(w)
    for dtype in (FP32, BF16):
        got, want = dequantize(q, dtype), reference.dequantize(q, dtype)
        assert bool(torch.isfinite(want.float()).all() == torch.isfinite(got.float()).all())
        assert bit_mismatches(got, want) == 0
