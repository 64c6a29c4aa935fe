"""The notebooks' helper modules: ``lynn_kernels.notebook`` (rounding for nbval) and ``lynn_model.notebook`` (notebook
06's op counting and benchmark lookup)."""

from __future__ import annotations

import math

import torch

import lynn_model
from lynn_kernels import Metrics, use_reference
from lynn_kernels.notebook import bound, decimals6, r3, r4, rounded, significant
from lynn_model import loader
from lynn_model.notebook import OPS, count_ops, pick


def test_significant_digits_floor_and_pass_through():
    assert r4(0.123456) == 0.1235 and r3(123456.0) == 123000.0 and r4(-2.5e-7) == -2.5e-7
    assert r4(3e-6, floor=1e-5) == "< 1e-05" and r3(2e-5, floor=1e-5) == 2e-5
    for v in (None, "-", 0.0, math.inf):
        assert significant(v, 4, 1e-5) == v
    assert math.isnan(r4(math.nan))
    assert bound(3.2e-7) == 1e-6 and bound(0.0) == 0.0 and bound(None) is None
    assert decimals6(0.99999987) == 1.0 and decimals6(None) is None


def test_rounded_rounds_metrics_only():
    m = Metrics(cosine=0.9987654321, max_abs=0.012345678, rel_l2=3.2e-7, err_ratio=1.23456)
    (row,) = rounded([{"op": "x", "n": 1.23456789, "m": m}])
    assert row["op"] == "x" and row["n"] == 1.23456789
    assert (row["m"].cosine, row["m"].max_abs, row["m"].rel_l2, row["m"].err_ratio) == (0.9988, 0.01235, 3.2e-7, 1.235)
    (row,) = rounded([{"m": m}], cosine=decimals6, errors=bound)
    assert (row["m"].cosine, row["m"].max_abs, row["m"].rel_l2, row["m"].err_ratio) == (0.998765, 0.1, 1e-6, 10.0)
    (row,) = rounded([{"m": m}], errors=lambda v: r3(v, floor=1e-5), err_ratio=r3)
    assert (row["m"].max_abs, row["m"].rel_l2, row["m"].err_ratio) == (0.0123, "< 1e-05", 1.23)


def test_count_ops_counts_a_decode_step_and_restores_the_model():
    from lynn_model import model as lm

    before = {name: getattr(lm, name) for name in ("rmsnorm", "nvfp4_linear", "F", "deltanet", "moe")}
    cfg = lynn_model.preset("tiny-qwen3.5-moe")
    with use_reference(), torch.no_grad():
        m = loader.random_model(cfg, weights="nvfp4", device="cpu")
        cache = m.new_cache(max_batch=1, max_tokens=16)
        slot = cache.add()
        with count_ops() as calls:
            m.step(torch.tensor([1, 2, 3]), cache, [slot], [3])
    assert set(calls) <= set(OPS) and calls["flash_attention"] >= 1 and calls["nvfp4_linear"] > 0
    assert calls["rmsnorm"] == 2 * cfg.num_hidden_layers + 1
    assert {name: getattr(lm, name) for name in before} == before


def test_pick_finds_a_row_by_provider_batch_and_context():
    doc = {"results": [{"op": "decoder.decode", "provider": "p", "dims": {"B": 1, "context": 4096}, "median_ms": 1},
                       {"op": "decoder.decode", "provider": "p", "dims": {"B": 8, "context": 4096}, "median_ms": 2}]}
    assert pick(doc, "decoder.decode", "p")["median_ms"] == 1
    assert pick(doc, "decoder.decode", "p", batch=8)["median_ms"] == 2
    assert pick(doc, "decoder.decode", "q") is None
