"""The one comparison helper and table renderer (lynn_kernels.metrics), on tensors whose answers are known."""

from __future__ import annotations

import math

import pytest
import torch

from lynn_kernels.metrics import Metrics, bit_mismatches, compare, render_table

# ---------------------------------------------------------------------------------------------------------------
# compare


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_identical(dtype):
    a = torch.randn(257, generator=torch.Generator().manual_seed(0)).to(dtype)
    m = compare(a, a.clone())
    assert m.cosine == pytest.approx(1.0, abs=1e-12)
    assert m.max_abs == 0.0 and m.rel_l2 == 0.0
    assert m.err_ratio is None and m.mismatches is None and m.numel == 257


def test_known_perturbation():
    ref = torch.tensor([3.0, 4.0])          # norm 5
    out = torch.tensor([3.0, 5.0])          # error (0, 1): norm 1
    m = compare(out, ref)
    assert m.rel_l2 == pytest.approx(0.2, rel=1e-12)
    assert m.max_abs == 1.0
    assert m.cosine == pytest.approx(29.0 / (5.0 * math.sqrt(34.0)), rel=1e-12)


def test_metrics_are_computed_in_float64():
    # metrics of bf16 tensors are taken on their exact values (in float64), not in bf16 arithmetic
    ref = torch.tensor([1.0, 1.0 + 2.0**-7], dtype=torch.bfloat16)
    out = torch.tensor([1.0, 1.0], dtype=torch.bfloat16)
    m = compare(out, ref)
    assert m.max_abs == 2.0**-7
    assert m.rel_l2 == pytest.approx(2.0**-7 / math.hypot(1.0, 1.0 + 2.0**-7), rel=1e-12)


def test_err_ratio_against_a_baseline():
    ref = torch.tensor([3.0, 4.0])
    out = torch.tensor([3.0, 4.5])          # rel_l2 0.1
    baseline = torch.tensor([3.0, 5.0])     # rel_l2 0.2
    assert compare(out, ref, baseline=baseline).err_ratio == pytest.approx(0.5, rel=1e-12)
    assert compare(baseline, ref, baseline=out).err_ratio == pytest.approx(2.0, rel=1e-12)
    # an exact baseline: a perfect output scores 0, an imperfect one infinitely worse
    assert compare(ref.clone(), ref, baseline=ref.clone()).err_ratio == 0.0
    assert compare(out, ref, baseline=ref.clone()).err_ratio == math.inf


def test_exact_counts_mismatches():
    ref = torch.tensor([1.0, 2.0, 3.0, 4.0])
    m = compare(torch.tensor([1.0, 2.0, 3.5, 4.0]), ref, exact=True)
    assert m.mismatches == 1 and m.max_abs == 0.5
    assert compare(ref.clone(), ref, exact=True).mismatches == 0
    # 1 ulp is a mismatch even though every float metric rounds it away
    bumped = ref.clone()
    bumped[0] = torch.nextafter(bumped[0], torch.tensor(2.0))
    assert compare(bumped, ref, exact=True).mismatches == 1
    with pytest.raises(ValueError, match="exact comparison needs one dtype, got torch.float16 and torch.float32"):
        compare(ref.half(), ref, exact=True)


def test_shape_mismatch_raises():
    with pytest.raises(ValueError, match=r"out has shape \(3,\) but ref has shape \(4,\)"):
        compare(torch.zeros(3), torch.zeros(4))
    with pytest.raises(ValueError, match=r"out has shape \(2, 2\) but ref has shape \(4,\)"):
        compare(torch.zeros(2, 2), torch.zeros(4))


def test_non_finite_output():
    ref = torch.ones(4)
    m = compare(torch.tensor([1.0, math.nan, 1.0, 1.0]), ref, exact=True)
    assert math.isnan(m.cosine) and m.max_abs == math.inf and m.rel_l2 == math.inf and m.mismatches == 4
    assert compare(torch.tensor([1.0, math.inf, 1.0, 1.0]), ref).rel_l2 == math.inf


def test_zero_tensors():
    z = torch.zeros(5)
    m = compare(z, z.clone())
    assert m.cosine == 1.0 and m.rel_l2 == 0.0 and m.max_abs == 0.0
    m = compare(torch.ones(5), z)
    assert m.cosine == 0.0 and m.rel_l2 == math.inf and m.max_abs == 1.0


def test_metrics_as_dict():
    m = compare(torch.tensor([3.0, 5.0]), torch.tensor([3.0, 4.0]), exact=True)
    d = m.as_dict()
    assert set(d) == {"cosine", "max_abs", "rel_l2", "err_ratio", "mismatches", "numel"}
    assert d["mismatches"] == 1 and d["numel"] == 2


# ---------------------------------------------------------------------------------------------------------------
# bit_mismatches


def test_bit_mismatches_sees_the_sign_of_zero():
    a, b = torch.tensor([0.0, 1.0]), torch.tensor([-0.0, 1.0])
    assert torch.equal(a, b)                          # equal as numbers...
    assert bit_mismatches(a, b) == 1                  # ...but not as bits
    m = compare(a, b, exact=True)
    assert m.mismatches == 1 and m.max_abs == 0.0


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float8_e4m3fn, torch.bfloat16, torch.float32, torch.float64],
                         ids=["uint8", "fp8", "bf16", "fp32", "fp64"])
def test_bit_mismatches_dtypes(dtype):
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[torch.empty(0, dtype=dtype).element_size()]
    a = torch.arange(6, dtype=torch.int64).to(bits).view(dtype).reshape(2, 3)
    b = a.clone()
    assert bit_mismatches(a, b) == 0
    b.view(bits)[1, 2] += 1
    assert bit_mismatches(a, b) == 1
    assert bit_mismatches(a.t(), b.t()) == 1          # non-contiguous views compare too


def test_bit_mismatches_same_nan_bits_match():
    nan = torch.tensor([math.nan, 1.0])
    assert bit_mismatches(nan, nan.clone()) == 0


def test_bit_mismatches_needs_same_dtype_and_shape():
    with pytest.raises(ValueError, match=r"same dtype and shape: torch.float32\(3,\) vs torch.float16\(3,\)"):
        bit_mismatches(torch.zeros(3), torch.zeros(3, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"torch.float32\(3,\) vs torch.float32\(1, 3\)"):
        bit_mismatches(torch.zeros(3), torch.zeros(1, 3))


# ---------------------------------------------------------------------------------------------------------------
# render_table


def test_render_table_headers_values_none_and_metrics():
    m = Metrics(cosine=0.999912345, max_abs=0.0, rel_l2=1.5e-05, err_ratio=None, mismatches=3, numel=10)
    rows = [{"op": "x", "shape": (4, 5), "m": m, "passed": True},
            {"op": "longer name", "shape": (1,), "m": m, "passed": False, "gbps": 1234.56}]
    text = render_table(rows, title="T")
    lines = text.splitlines()
    assert lines[0] == "T"
    assert lines[1].split() == ["op", "shape", "cosine", "max_abs", "rel_l2", "err_ratio", "mismatches", "passed",
                                "gbps"]
    assert set(lines[2].replace(" ", "")) == {"-"}
    assert lines[3].split() == ["x", "4x5", "0.999912", "0", "1.50e-05", "-", "3", "yes", "-"]
    assert lines[4].split() == ["longer", "name", "1", "0.999912", "0", "1.50e-05", "-", "3", "NO", "1,234.6"]
    assert "numel" not in text                         # Metrics spread without its element count
    # columns line up: every row is as wide as its header, numbers right-aligned
    assert lines[3].index("0.999912") == lines[4].index("0.999912")
    assert lines[4].endswith("1,234.6") and lines[3].rstrip().endswith("-")


def test_render_table_columns_pick_and_order():
    text = render_table([{"a": 1.0, "b": None, "c": "skip"}], columns=["b", "a"])
    assert text == "b  a\n-  -\n-  1"


@pytest.mark.parametrize("value,shown", [
    (0.0, "0"), (1.0, "1"), (0.123456789, "0.123457"), (123456.0, "1.23e+05"), (0.0001234, "1.23e-04"),
    (4069.67, "4,069.7"), (math.inf, "inf"), (math.nan, "nan"), (None, "-"), (True, "yes"), (False, "NO"),
    ((16, 208), "16x208"), ("bf16 48x208", "bf16 48x208"), (7, "7"),
], ids=lambda v: repr(v))
def test_render_table_formats(value, shown):
    text = render_table([{"v": value}])
    assert text.splitlines()[2].strip() == shown


def test_render_table_empty():
    assert render_table([]) == "(no rows)"
