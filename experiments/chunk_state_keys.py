"""Whether the Gated DeltaNet state scan should load its keys decayed (``triton_chunk.STATE_KEYS_STORED``).

The sequential state scan multiplies each chunk's keys, normalised and decayed to the chunk's end, into the state.
With the switch on, ``_chunk_wy_kernel`` (parallel over chunks) stores those keys in the dot operand dtype and the
scan loads them; off, the scan loads the raw keys and normalises and decays them inside its loop. At Qwen3.5-35B-A3B's
linear-attention shape (16 key and 32 value heads of 128, the lab's ``deltanet.chunk_gated_delta_rule`` inputs;
Qwen3-Next-80B-A3B's heads are the same) and 2,048, 8,192 and 16,384 tokens: the switch off is raced through the
lab against the shipped op (graph replay on rotating inputs), both forms' outputs and final states are compared
with the op's reference and each other, and each form's kernels are timed one by one by the CUDA profiler.

    PYTHONPATH=. python3 experiments/chunk_state_keys.py

Writes ``data/experiments/chunk-state-keys/<sha>.json`` (under ``$OUT`` when set). GPU only. At c286803 the same
script, then ``chunk_wy.py``, raced the one wy kernel against fla's split into kkt, solve and wu
(``data/experiments/chunk-wy/c286803-h100.json``).
"""

from __future__ import annotations

import collections
import contextlib
import sys

import torch

from lynn_kernels import lab
from lynn_kernels.bench.harness import provenance, save_experiment
from lynn_kernels.deltanet import triton_chunk
from lynn_kernels.lab.shapes import BUILDERS, MODELS
from lynn_kernels.metrics import compare

TOKENS = (2048, 8192, 16384)
OP = "deltanet.chunk_gated_delta_rule"


@contextlib.contextmanager
def stored(on: bool):
    was = triton_chunk.STATE_KEYS_STORED
    triton_chunk.STATE_KEYS_STORED = on
    try:
        yield
    finally:
        triton_chunk.STATE_KEYS_STORED = was


def raw_keys() -> lab.Variant:
    """The op with the scan normalising and decaying raw keys in its loop, for the call."""
    def rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, use_qk_l2norm=False, *,
             out_state=None, cu_seqlens=None):
        with stored(False):
            return triton_chunk.chunk_gated_delta_rule_triton(q, k, v, g, beta, scale, initial_state,
                                                              output_final_state, use_qk_l2norm,
                                                              out_state=out_state, cu_seqlens=cu_seqlens)
    return lab.variant(OP, rule, name="raw-keys")


def kernel_us(args, kwargs, calls: int = 10) -> dict:
    """GPU microseconds a call of the op by kernel name (the CUDA profiler, after a warm-up)."""
    op = lab.find(OP).fn
    for _ in range(3):
        op(*args, **kwargs)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            op(*args, **kwargs)
        torch.cuda.synchronize()
    us = collections.defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            us[e.name[:60]] += e.time_range.elapsed_us() / calls
    return dict(sorted(us.items(), key=lambda kv: -kv[1]))


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("chunk_wy.py times GPU kernels: no GPU here")
    res = {"provenance": provenance("PYTHONPATH=. python3 experiments/chunk_state_keys.py"), "shapes": []}
    raw = raw_keys()
    for T in TOKENS:
        shape = BUILDERS[OP](MODELS["qwen3.5-35b-a3b"], T)[0]
        args, kwargs, _ = shape.make()
        want = lab.find(OP).fn.reference(*args, **kwargs)
        outs = {}
        row = {"tokens": T, "shape": shape.label, "kernels_us": {}}
        for label, on in (("stored", True), ("raw", False)):
            with stored(on):
                o, state = lab.find(OP).fn(*args, **kwargs)
                outs[label] = (o.clone(), state.clone())
                row["kernels_us"][label] = kernel_us(args, kwargs)
            row[f"{label}: output vs reference"] = compare(o, want[0]).as_dict()
            row[f"{label}: final state vs reference"] = compare(state, want[1]).as_dict()
        row["output stored vs raw"] = compare(outs["stored"][0], outs["raw"][0]).as_dict()
        row["state stored vs raw"] = compare(outs["stored"][1], outs["raw"][1]).as_dict()
        row["bit_equal"] = bool(torch.equal(outs["stored"][0], outs["raw"][0])
                                and torch.equal(outs["stored"][1], outs["raw"][1]))
        report = lab.race(raw, shapes=[shape], skip_check=True)
        row["race"] = [r.as_dict() for r in report.rows]
        print(report.table(), flush=True)
        for label, us in row["kernels_us"].items():
            print(f"{T:6} tokens {label:7} {sum(us.values()):9.1f} us: "
                  + ", ".join(f"{k} {u:.1f}" for k, u in us.items()), flush=True)
        print(f"{T:6} tokens rel_l2 against the reference: output stored "
              f"{row['stored: output vs reference']['rel_l2']:.2e}, raw "
              f"{row['raw: output vs reference']['rel_l2']:.2e}; state stored "
              f"{row['stored: final state vs reference']['rel_l2']:.2e}, raw "
              f"{row['raw: final state vs reference']['rel_l2']:.2e}; bit-equal {row['bit_equal']}", flush=True)
        res["shapes"].append(row)
        args = kwargs = want = outs = None
        torch.cuda.empty_cache()
    save_experiment("chunk-state-keys", res)


if __name__ == "__main__":
    main()
