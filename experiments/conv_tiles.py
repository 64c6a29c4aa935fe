"""Which GPU tile the Gated DeltaNet prefill conv (``deltanet.causal_conv1d``) should run at.

In a 16,384-token prefill of Qwen3.5-35B-A3B the conv's 30 launches took about 20 ms for 537 MB read and written
(a fifth of the copy bandwidth) until 6ce1f1b; 6.6 ms since (an H100). Each tile of ``TILES`` (``BLOCK_T``
positions x ``BLOCK_C`` channels, warps: the launcher's ``triton_conv.CONV_CONFIG``) is raced through the lab (graph
replay on rotating inputs, against the shipped tile and cuDNN's depthwise conv) at Qwen3.5-35B-A3B's prefill of
2,048 and 16,384 tokens, and its output is compared bit for bit with the shipped tile's (the tile does not change
any sum). Then each of ``EDITS`` (one line of the shipped kernel changed through ``lab.edit``: the output stored
streaming, the programs in flight side by side along the channels) at the shipped tile, the same way.

    PYTHONPATH=. python3 experiments/conv_tiles.py
    PYTHONPATH=. python3 experiments/conv_tiles.py --layouts
    PYTHONPATH=. python3 experiments/conv_tiles.py --edits

``--layouts`` asks why the race's input (the model's: a strided view of the fused ``qkvz`` projection, with an
initial state) cost the shipped tile 2.4x what a contiguous input cost ``lynn bench deltanet.conv`` for the same
bytes: the shipped conv, and its ``channels-first`` edit, on the four combinations of {contiguous, the strided view}
x {no initial state, an initial state} (the final state is written either way), each by graph replay on rotating
inputs, at 2,048 and 16,384 tokens. At 78f9878 the answer was the initial state (531.6 against 224.8 us at 16,384
tokens; the strided view cost nothing): every block ran the state's masked gathers. Since 6ce1f1b only the first
``W - 1`` positions do (docs/deltanet.md, "Conv"). ``--edits`` races only ``EDITS``, not ``TILES``.

Writes ``data/experiments/conv-tiles/<sha>.json`` (``conv-layouts`` with ``--layouts``; under ``$OUT`` when set).
GPU only.
"""

from __future__ import annotations

import contextlib
import sys

import torch

from lynn_kernels import lab
from lynn_kernels.bench.harness import provenance, save_experiment
from lynn_kernels.deltanet import triton_conv
from lynn_kernels.lab.shapes import BUILDERS, MODELS

#: (BLOCK_T, BLOCK_C, num_warps): fewer elements a thread than the shipped tile's 64 (larger tiles spilled: at
#: 1485514, 64 x 256 and up took 11.6-16.9 ms against its 0.66; data/experiments/conv-tiles/1485514-h100.json)
TILES = [(32, 256, 8), (16, 256, 4), (16, 512, 8), (32, 128, 4), (64, 128, 8), (8, 512, 4), (16, 1024, 8)]
TOKENS = (2048, 16384)
#: one-line edits of the shipped kernel, raced at the shipped tile: where its 810 GB/s might go (L2 traffic). The
#: input kept in L2 (``x-evict-last``) was raced at 7ea35e4 (data/experiments/conv-tiles/7ea35e4-h100.json); its load
#: has lived in ``_conv_taps`` since 6ce1f1b, out of reach of an edit of the kernel's body.
EDITS = {
    "y-streamed": {"cast_output(y, X_DTYPE, INTERPRET),\n             mask=mask_y[:, None] & mask_c[None, :])":
                   "cast_output(y, X_DTYPE, INTERPRET),\n             mask=mask_y[:, None] & mask_c[None, :], "
                   "cache_modifier='.cs')"},
    # the programs in flight side by side along C, not T: each reads whole rows of x between them, not 256 bytes of
    # each of 32 rows 16-25 KB apart (the same bijection of the grid, so the same bits)
    "channels-first": {"    pid_t = tl.program_id(0)\n    pid_c = tl.program_id(1)":
                       "    lin = tl.program_id(0) + tl.program_id(1) * tl.num_programs(0)\n"
                       "    pid_c = lin % tl.num_programs(1)\n    pid_t = lin // tl.num_programs(1)"},
}


def tile_variant(bt: int, bc: int, warps: int) -> lab.Variant:
    """``causal_conv1d`` with the launcher's tile set to these for the call."""
    def conv(x, weight, initial_state=None, *, cu_seqlens=None):
        was = dict(triton_conv.CONV_CONFIG)
        triton_conv.CONV_CONFIG.update(BLOCK_T=bt, BLOCK_C=bc, num_warps=warps)
        try:
            return triton_conv.causal_conv1d_triton(x, weight, initial_state, cu_seqlens=cu_seqlens)
        finally:
            triton_conv.CONV_CONFIG.update(was)
    return lab.variant("deltanet.causal_conv1d", conv, name=f"T{bt}-C{bc}-w{warps}")


def edit_variants() -> list[lab.Variant]:
    """The shipped kernel with each of ``EDITS`` (``lab.edit``), launched by the shipped launcher at its tile."""
    return [lab.variant("deltanet.causal_conv1d", lab.edit("deltanet.conv", replace,
                                                           name=f"_conv_{label.replace('-', '_')}"), name=label)
            for label, replace in EDITS.items()]


def layouts() -> None:
    """The shipped conv on contiguous and strided inputs, with and without the states (see the docstring)."""
    from lynn_kernels.bench.harness import graph_us, l2_bytes, measure_ceilings
    from lynn_kernels.deltanet import causal_conv1d

    ceilings = measure_ceilings()
    shape = BUILDERS["deltanet.causal_conv1d"](MODELS["qwen3.5-35b-a3b"], 16)[0]
    (x16, weight, h16), _, _ = shape.make()
    order = next(v for v in edit_variants() if v.name == "channels-first")
    full_width = x16.stride(1)                       # the fused projection's row: qkv's channels, then z's
    C, W = x16.shape[-1], weight.shape[-1]
    res = {"provenance": provenance("PYTHONPATH=. python3 experiments/conv_tiles.py --layouts"),
           "ceilings": ceilings.as_dict(), "shipped": dict(triton_conv.CONV_CONFIG), "channels": C,
           "fused_row": full_width, "rows": []}
    for T in TOKENS:
        nbytes = 2 * T * C * 2                       # x read once, y written once
        sets = max(2, -(-3 * l2_bytes() // nbytes))              # together past 3x the L2
        for strided in (False, True):
            for state in (False, True):
                inputs = []
                for _ in range(sets):
                    buf = torch.randn(T, full_width if strided else C, device="cuda", dtype=torch.bfloat16)
                    h0 = torch.randn(1, C, W - 1, device="cuda", dtype=torch.bfloat16) if state else None
                    inputs.append((buf[None, :, :C], h0))
                calls = [lambda x=x, h0=h0: causal_conv1d(x, weight, h0) for x, h0 in inputs]
                for kernel, v in (("shipped", None), ("channels-first", order)):
                    with lab.using(v) if v else contextlib.nullcontext():
                        us = graph_us(calls)
                    row = {"tokens": T, "x": "strided view" if strided else "contiguous",
                           "initial_state": state, "kernel": kernel, "us": us,
                           "gb_s": nbytes / us / 1e3, "frac_of_read": nbytes / us / 1e3 / ceilings.read_gbps}
                    res["rows"].append(row)
                    print(f"{T:6} tokens  x {row['x']:13} initial state {str(state):5} {kernel:14} {us:8.1f} us  "
                          f"{row['gb_s']:7.1f} GB/s  {row['frac_of_read']:6.1%} of read", flush=True)
                inputs = calls = None
                torch.cuda.empty_cache()
    save_experiment("conv-layouts", res)


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("conv_tiles.py times GPU kernels: no GPU here")
    if "--layouts" in sys.argv[1:]:
        layouts()
        return
    shapes = [s for m in TOKENS for s in BUILDERS["deltanet.causal_conv1d"](MODELS["qwen3.5-35b-a3b"], m)]
    (x, weight, h0), _, _ = shapes[-1].make()
    shipped_y = triton_conv.causal_conv1d_triton(x, weight, h0)[0].clone()
    res = {"provenance": provenance("PYTHONPATH=. python3 experiments/conv_tiles.py " + " ".join(sys.argv[1:])),
           "shipped": dict(triton_conv.CONV_CONFIG), "tiles": []}
    cases = [] if "--edits" in sys.argv[1:] else \
        [(tile_variant(*t), dict(zip(("BLOCK_T", "BLOCK_C", "num_warps"), t))) for t in TILES]
    cases += [(v, {"edit": v.name, **triton_conv.CONV_CONFIG}) for v in edit_variants()]
    for v, row in cases:
        try:
            with lab.using(v) if v.kernel else contextlib.nullcontext():      # a kernel: the shipped launcher
                y = (triton_conv.causal_conv1d_triton if v.kernel else v.fn)(x, weight, h0)[0]
            row["same_bits_as_shipped_16384"] = bool(torch.equal(y, shipped_y))
            report = lab.race(v, shapes=shapes, skip_check=True)
            row["rows"] = [r.as_dict() for r in report.rows]
            print(f"{v.label}: same bits {row['same_bits_as_shipped_16384']}", flush=True)
            print(report.table(), flush=True)
        except Exception as err:
            row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
            print(f"{v.label} failed: {row['error'][:200]}", flush=True)
        res["tiles"].append(row)
    save_experiment("conv-tiles", res)


if __name__ == "__main__":
    main()
