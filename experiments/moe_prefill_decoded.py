"""The routed experts' prefill with the packed ``w13`` decoded once per call (``decoded=True``) against the kernels
that decode each weight tile in their loop, then what that does to a whole prefill.

1. **The op** (``launch_moe_experts`` on packed stacks, the decoder's layout; random NVFP4, routing from the lab's
   shapes) for Qwen3.5-35B-A3B and Qwen3-Next-80B-A3B at ``--tokens``: the looped path at its shipped tiles; the
   decode of ``w13`` alone at each of ``DECODE_TILES``; the decoded path (gate_up on the decoded tiles) at each
   gate_up tile config of ``CONFIGS`` (``BLOCK_N``, ``BLOCK_K``, warps, stages), then at each down tile config of
   ``DOWN_CONFIGS`` (the down kernel is 28% of the bf16 peak in a 16,384-token prefill): bits against the looped
   path, rel_l2 against the fp32 reference, 20 calls with freed memory
   scribbled on between them (a pipelining fault shows as changing bits), time (``do_bench`` median, L2 flushed),
   TFLOP/s and the fraction of the measured bf16 peak, with and without the decode counted. Then the combine's
   tiles (``COMBINE_CONFIGS``, timed alone on the shipped path's slot rows: its bytes over time) and the shipped
   call's GPU time kernel by kernel (CUDA profiler), also with the slot rows in x's dtype instead of fp32: a probe of
   what the fp32 rows cost the down kernel and the combine (not the shipped numerics, so not its bits). Then the
   shipped call with the GEMMs' programs in either order (``PREFILL_N_FIRST``): time, kernels, bits. ``down_decoded``:
   ``w2`` decoded once as well (``DECODED_DOWN``) at each of ``DECODED_DOWN_CONFIGS``. ``small``: the looped path's
   tiles below 8,192 tokens, both GEMMs at each of ``SMALL_CONFIGS``, with each kernel's time. ``block_m``: the call
   in 64- and 128-row blocks, ``w13`` decoded in the loop and once (Qwen3-Next-80B-A3B's 320 rows an expert at
   16,384 tokens pad to 384 in 128-row blocks).
2. **The prefill** of ``--model`` (Qwen3.5-35B-A3B; random NVFP4 weights, ``lynn_model.bench``'s measures) with
   one switch off and on (``--model-ab``: the decoded path, ``DECODED_MIN_ROWS``; the programs' order,
   ``PREFILL_N_FIRST``; ``w2`` decoded once too, ``DECODED_DOWN``; ``decoded_from_256``: the decoded path from 256
   rows an expert, as Qwen3-Next-80B-A3B's 320 at 16,384 tokens; ``ahead``: gate_up loading a step ahead in 64-row
   blocks, ``GATE_UP_AHEAD``; ``none``: the shipped switches alone, one arm):
   the kernel census of a 16,384-token prefill by part, the graph-captured prefill of 2,048, 8,192 and 16,384
   tokens, and the last token's logits of the two against each other.

    PYTHONPATH=. python3 experiments/moe_prefill_decoded.py [--tokens 8192 16384] [--skip-model]
        [--parts gate_up down down_decoded combine split order small block_m]
        [--model-ab decoded|order|decoded_down|decoded_from_256|ahead|none] [--model PRESET]

Writes ``data/experiments/moe-prefill-decoded/<sha>.json`` (under ``$OUT`` when set). GPU only.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys

import torch
import triton

from lynn_kernels import runtime
from lynn_kernels.bench.harness import churn_calls, measure_ceilings, provenance, save_experiment, time_fn
from lynn_kernels.lab.shapes import BUILDERS, MODELS
from lynn_kernels.moe import pack_experts, reference
from lynn_kernels.moe import triton_experts as te
from lynn_kernels.triton_shared import launch_packed_dequantize

#: (BLOCK_N, BLOCK_K, num_warps, num_stages) of gate_up on the decoded tiles
CONFIGS = [(128, 64, 8, 4), (128, 64, 8, 3), (256, 64, 8, 3), (128, 32, 8, 4), (64, 64, 4, 4)]
#: the down kernel's tiles (it decodes w2 in its loop: BLOCK_K a multiple of 128) with gate_up on decoded w13
DOWN_CONFIGS = [(128, 128, 8, 3), (128, 128, 8, 2), (128, 128, 4, 2), (64, 128, 4, 2), (64, 128, 4, 3),
                (256, 128, 8, 2), (64, 256, 4, 2)]
#: the down kernel's tiles on a decoded w2 (``DECODED_DOWN``; its K is only I = 512 at these models)
DECODED_DOWN_CONFIGS = [(128, 64, 8, 4), (128, 64, 8, 3), (128, 128, 8, 3), (256, 64, 8, 3), (128, 64, 4, 4),
                        (128, 128, 4, 2), (64, 64, 4, 4)]
#: both GEMMs' tiles on the looped path below 8,192 tokens (``PREFILL_CONFIGS``' first entry; 64-row blocks), each
#: with ``GATE_UP_AHEAD`` off or on
SMALL_CONFIGS = [((64, 128, 4, 1), False), ((64, 128, 4, 1), True), ((128, 128, 4, 1), True),
                 ((64, 256, 4, 1), True), ((128, 128, 8, 1), True), ((128, 128, 4, 3), False),
                 ((128, 128, 4, 3), True), ((128, 128, 4, 2), True)]
#: the combine's (BLOCK_T, BLOCK_H, num_warps)
COMBINE_CONFIGS = [(4, 512, 4), (1, 2048, 4), (1, 2048, 8), (2, 1024, 4), (2, 2048, 8), (4, 1024, 8), (8, 512, 8),
                   (8, 256, 4), (16, 256, 8), (1, 1024, 4)]
#: the dequantise kernel's (BLOCK_N, BLOCK_K, num_warps) on a w13 stack
DECODE_TILES = [(32, 256, 4), (16, 512, 4), (64, 256, 8), (32, 512, 8), (64, 128, 4), (128, 128, 8)]
MODELS_RUN = ("qwen3.5-35b-a3b", "qwen3-next-80b-a3b")
PARTS = ("gate_up", "down", "down_decoded", "combine", "split", "order", "small", "block_m")
#: the switches ``--model-ab`` turns off then on: (label, te's attribute, its value) twice
MODEL_AB = {"decoded": (("looped", "DECODED_MIN_ROWS", 1 << 40), ("decoded", "DECODED_MIN_ROWS", te.DECODED_MIN_ROWS)),
            "order": (("row blocks first", "PREFILL_N_FIRST", False), ("column tiles first", "PREFILL_N_FIRST", True)),
            "decoded_down": (("w2 decoded in the loop", "DECODED_DOWN", False),
                             ("w2 decoded once", "DECODED_DOWN", True)),
            "decoded_from_256": (("looped", "DECODED_MIN_ROWS", 1 << 40),
                                 ("decoded from 256 rows", "DECODED_MIN_ROWS", 256)),
            "ahead": (("gate_up: each step loads its own", "GATE_UP_AHEAD", False),
                      ("gate_up: a step ahead", "GATE_UP_AHEAD", True)),
            "none": (("shipped", None, None),)}


@contextlib.contextmanager
def down_tiles(config: dict):
    """The down kernel's prefill tiles (``PREFILL_CONFIGS``, ``DOWN_CONFIG_128``, ``DOWN_CONFIG_64``) are ``config``
    inside the block; on the decoded path gate_up keeps ``DECODED_CONFIG``."""
    was = te.PREFILL_CONFIGS, te.DOWN_CONFIG_128, te.DOWN_CONFIG_64
    te.PREFILL_CONFIGS, te.DOWN_CONFIG_128, te.DOWN_CONFIG_64 = ((None, config),), config, config
    try:
        yield
    finally:
        te.PREFILL_CONFIGS, te.DOWN_CONFIG_128, te.DOWN_CONFIG_64 = was


def measured(row: dict, call, looped: torch.Tensor, want: torch.Tensor, flops: float, peak: float,
             dq: float) -> dict:
    """``row`` with ``call``'s bits against the looped path, rel_l2 against the reference, time, churn and TFLOP/s
    (also without the ``dq`` ms of the decode); a config that does not compile (shared memory) is a row with its
    error."""
    label = f"{row['model']} {row['tokens']:6d} {row['path']} {row.get('config') or row.get('down_config')}"
    try:
        got = call().clone()
        row["same_bits_as_looped"] = bool(torch.equal(got, looped))
        row["rel_l2_vs_reference"] = rel_l2(got, want)
        row["ms"] = time_fn(call)[0]
        row["wrong_calls"] = churn_calls(call, got, 20)
        row["without_decode_ms"] = row["ms"] - dq                # align, GEMMs, combine
        row["tflops"] = flops / row["ms"] / 1e9
        row["frac_of_peak"] = row["tflops"] / peak
        row["frac_of_peak_without_decode"] = flops / row["without_decode_ms"] / 1e9 / peak
        print(f"{label} {row['ms']:7.3f} ms {row['tflops']:6.0f} TFLOP/s ({row['frac_of_peak']:.1%}; without the "
              f"decode {row['frac_of_peak_without_decode']:.1%}), same bits {row['same_bits_as_looped']}, wrong "
              f"calls {row['wrong_calls']}", flush=True)
    except Exception as err:
        row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
        print(f"{label} failed: {row['error'][:120]}", flush=True)
    return row


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def kernel_split(fn, n: int = 5) -> dict[str, float]:
    """GPU time (ms) of each kernel ``fn`` launches, by kernel name, median of ``n`` profiled calls."""
    fn()
    torch.cuda.synchronize()
    runs = []
    for _ in range(n):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        per = {}
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                name = e.name.split("(")[0][:60]
                per[name] = per.get(name, 0.0) + e.time_range.elapsed_us() / 1e3
        runs.append(per)
    return {k: sorted(r.get(k, 0.0) for r in runs)[n // 2] for k in runs[0]}


def op_rows(peak: float, tokens, parts) -> list[dict]:
    rows = []
    for model in MODELS_RUN:
        for m in tokens:
            rows += case_rows(model, m, peak, parts)
            torch.cuda.empty_cache()
    return rows


def case_rows(model: str, m: int, peak: float, parts) -> list[dict]:
    """The op's rows for ``m`` tokens of ``model``'s experts (section 1 of the module docstring)."""
    rows = []
    d = MODELS[model]
    shape = BUILDERS["moe.moe_experts"](d, m)[0]
    (x, weights, ids, w13, w2), _, _ = shape.make()
    p13, p2, _ = pack_experts(w13, w2)
    E, H, inter, top_k = w13.shape[0], x.shape[1], w2.shape[-1], ids.shape[1]
    flops = shape.flops
    out = torch.empty_like(x)

    def run(decoded, config=None, ws=None):
        te.launch_moe_experts(x, weights, ids, p13, p2, out, ws, config=config, decoded=decoded)
        return out

    with torch.inference_mode():
        want = reference.moe_experts(x, weights, ids, w13, w2)
        ws = te.moe_workspace(m, top_k, E, H, inter, x.dtype, x.device)
        looped = run(False, ws=ws).clone()
        ms = time_fn(lambda: run(False, ws=ws))[0]
        base = {"model": model, "tokens": m, "E": E, "top_k": top_k}
        bm = te.block_m_for(m, top_k, E)
        rows.append({**base, "path": "looped (shipped)", "config": te.prefill_config(m, bm), "block_m": bm,
                     "ms": ms, "rel_l2_vs_reference": rel_l2(looped, want),
                     "tflops": flops / ms / 1e9, "frac_of_peak": flops / ms / 1e9 / peak})
        print(f"{model} {m:6d} looped  {ms:7.3f} ms {flops / ms / 1e9:6.0f} TFLOP/s", flush=True)
        nbytes = 2 * E * 2 * inter * H
        dest = torch.empty(tuple(p13.shape), dtype=x.dtype, device=x.device)
        for n, k, warps in DECODE_TILES if "gate_up" in parts else ():
            cfg = {"BLOCK_N": n, "BLOCK_K": k, "num_warps": warps}
            t = time_fn(lambda: launch_packed_dequantize(p13, dest, cfg))[0]
            rows.append({**base, "path": "decode w13", "config": cfg, "ms": t, "workspace_bytes": nbytes,
                         "gbps_written": nbytes / t / 1e6})
            print(f"{model} {m:6d} decode w13 N{n} K{k} w{warps} {t:7.3f} ms ({nbytes / 1e9:.2f} GB, "
                  f"{nbytes / t / 1e6:,.0f} GB/s written)", flush=True)
        dest = None                                   # the workspace back before the rest
        dq = time_fn(lambda: launch_packed_dequantize(p13, torch.empty(tuple(p13.shape), dtype=x.dtype,
                                                                       device=x.device), te.DECODE_EXPERTS_CONFIG))[0]
        rows.append({**base, "path": "decode w13 (shipped tile)", "ms": dq, "workspace_bytes": nbytes})
        for n, k, warps, stages in CONFIGS if "gate_up" in parts else ():
            cfg = {"BLOCK_N": n, "BLOCK_K": k, "num_warps": warps, "num_stages": stages}
            row = {**base, "path": "decoded w13", "config": cfg, "block_m": bm}
            rows.append(measured(row, lambda: run(True, cfg, ws), looped, want, flops, peak, dq))
        for n, k, warps, stages in DOWN_CONFIGS if "down" in parts else ():   # gate_up decoded: DECODED_CONFIG
            cfg = {"BLOCK_N": n, "BLOCK_K": k, "num_warps": warps, "num_stages": stages}
            row = {**base, "path": "decoded w13, down tiles", "down_config": cfg, "block_m": bm}
            with down_tiles(cfg):
                rows.append(measured(row, lambda: run(True, None, ws), looped, want, flops, peak, dq))
        if "down_decoded" in parts:
            rows += decoded_down_rows(base, run, ws, p2, looped, want, flops, peak, dq, bm)
        if "combine" in parts:
            rows += combine_rows(base, run, ws, out, m, top_k, H)
        if "split" in parts:
            row = {**base, "path": "shipped, by kernel", "block_m": bm,
                   "kernels_ms": kernel_split(lambda: run(None, ws=ws))}
            slots16 = torch.empty(ws.out_slots.shape, dtype=x.dtype, device=x.device)
            probe = te.MoEWorkspace(ws.sorted_slots, ws.block_expert, ws.num_padded, ws.h, slots16)
            row["kernels_ms_slots_in_x_dtype"] = kernel_split(lambda: run(None, ws=probe))
            slots16 = probe = None
            rows.append(row)
            print(f"{model} {m:6d} by kernel (fp32 slots | {x.dtype} slots): " + ", ".join(
                f"{k.replace('_moe_', '').replace('_kernel', '')} {v:.3f} | "
                f"{row['kernels_ms_slots_in_x_dtype'].get(k, float('nan')):.3f}" for k, v in row["kernels_ms"].items()),
                flush=True)
        if "order" in parts:
            rows += order_rows(base, run, ws, bm, m, flops, peak)
        if "small" in parts:
            rows += small_rows(base, run, ws, looped, want, flops, peak, bm)
        if "block_m" in parts:
            rows += block_m_rows(base, run, looped, want, flops, peak, dq, m, top_k, E, H, inter, x)
    return rows


@contextlib.contextmanager
def row_blocks(block_m: int):
    """Every prefill call inside the block runs ``block_m``-row blocks (``block_m_for``), its workspace too."""
    was = te.block_m_for
    te.block_m_for = lambda M, top_k, num_experts: block_m
    try:
        yield
    finally:
        te.block_m_for = was


def block_m_rows(base: dict, run, looped, want, flops: float, peak: float, dq: float, m: int, top_k: int, E: int,
                 H: int, inter: int, x: torch.Tensor) -> list[dict]:
    """The call with 64- and 128-row blocks, `w13` decoded in the loop and once: at Qwen3-Next-80B-A3B's 320 rows
    an expert (16,384 tokens) 128-row blocks pad each expert to 384 rows, 64-row ones decode each tile twice as often
    on the looped path (bits against the shipped call, rel_l2, time)."""
    rows = []
    for block_m in (64, 128):
        with row_blocks(block_m):
            ws = te.moe_workspace(m, top_k, E, H, inter, x.dtype, x.device)
            padded = int(ws.block_expert.numel()) * block_m
            for decoded in (False, True):
                row = {**base, "path": f"{block_m}-row blocks, w13 {'decoded once' if decoded else 'in the loop'}",
                       "block_m": block_m, "decoded": decoded, "max_padded_rows": padded}
                rows.append(measured(row, lambda: run(decoded, ws=ws), looped, want, flops, peak,
                                     dq if decoded else 0.0))
            ws = None
    return rows


def small_rows(base: dict, run, ws, looped, want, flops: float, peak: float, bm: int) -> list[dict]:
    """The looped path (``w13`` decoded in the loop) with both GEMMs at each of ``SMALL_CONFIGS``, the tiles
    ``PREFILL_CONFIGS`` gives below 8,192 tokens: bits against the shipped tiles, time, churn and the call's kernels
    (so gate_up's and down's best tiles show apart)."""
    rows = []
    was = te.GATE_UP_AHEAD
    for (n, k, warps, stages), ahead in SMALL_CONFIGS:
        cfg = {"BLOCK_N": n, "BLOCK_K": k, "num_warps": warps, "num_stages": stages}
        row = {**base, "path": "looped, both GEMMs at", "config": cfg, "block_m": bm, "ahead": ahead}
        te.GATE_UP_AHEAD = ahead
        with down_tiles(cfg):
            row = measured(row, lambda: run(False, None, ws), looped, want, flops, peak, 0.0)
            if "error" not in row:
                row["kernels_ms"] = kernel_split(lambda: run(False, None, ws))
                print("    " + ", ".join(f"{k_.replace('_moe_', '').replace('_kernel', '')} {v:.3f}"
                                         for k_, v in row["kernels_ms"].items() if "align" not in k_), flush=True)
        rows.append(row)
    te.GATE_UP_AHEAD = was
    return rows


def order_rows(base: dict, run, ws, bm: int, m: int, flops: float, peak: float) -> list[dict]:
    """The shipped call with the prefill GEMMs' programs row blocks first, then column tiles first."""
    rows, first, shipped = [], None, te.PREFILL_N_FIRST
    try:
        for n_first in (False, True):
            te.PREFILL_N_FIRST = n_first
            got = run(None, ws=ws).clone()
            first = got if first is None else first
            row = {**base, "path": "shipped", "n_first": n_first, "block_m": bm,
                   "ms": time_fn(lambda: run(None, ws=ws))[0],
                   "same_bits_as_row_blocks_first": bool(torch.equal(got, first)),
                   "wrong_calls": churn_calls(lambda: run(None, ws=ws), got, 20),
                   "kernels_ms": kernel_split(lambda: run(None, ws=ws))}
            row["tflops"] = flops / row["ms"] / 1e9
            row["frac_of_peak"] = row["tflops"] / peak
            rows.append(row)
            print(f"{base['model']} {m:6d} {'column tiles' if n_first else 'row blocks'} first {row['ms']:7.3f} ms "
                  f"{row['tflops']:6.0f} TFLOP/s ({row['frac_of_peak']:.1%}), same bits "
                  f"{row['same_bits_as_row_blocks_first']}, wrong calls {row['wrong_calls']}; " + ", ".join(
                      f"{k.replace('_moe_', '').replace('_kernel', '')} {v:.3f}" for k, v in row["kernels_ms"].items()),
                  flush=True)
    finally:
        te.PREFILL_N_FIRST = shipped
    return rows


def decoded_down_rows(base: dict, run, ws, p2, looped, want, flops: float, peak: float, dq: float,
                      bm: int) -> list[dict]:
    """The decoded path with ``w2`` decoded once too (``DECODED_DOWN``) at each of ``DECODED_DOWN_CONFIGS``: the
    decode of ``w2`` alone, then the call (its time counts both decodes; "without the decode" takes off ``w13``'s
    only), its bits against the looped path and its kernels."""
    x_dtype = looped.dtype
    dw2 = time_fn(lambda: launch_packed_dequantize(p2, torch.empty(tuple(p2.shape), dtype=x_dtype,
                                                                   device=looped.device), te.DECODE_EXPERTS_CONFIG))[0]
    rows = [{**base, "path": "decode w2 (shipped tile)", "ms": dw2,
             "workspace_bytes": math.prod(tuple(p2.shape)) * looped.element_size()}]
    print(f"{base['model']} {base['tokens']:6d} decode w2 {dw2:.3f} ms", flush=True)
    was = te.DECODED_DOWN, te.DECODED_DOWN_CONFIG
    try:
        te.DECODED_DOWN = True
        for n, k, warps, stages in DECODED_DOWN_CONFIGS:
            te.DECODED_DOWN_CONFIG = {"BLOCK_N": n, "BLOCK_K": k, "num_warps": warps, "num_stages": stages}
            row = {**base, "path": "decoded w13 and w2", "down_config": dict(te.DECODED_DOWN_CONFIG), "block_m": bm}
            row = measured(row, lambda: run(True, None, ws), looped, want, flops, peak, dq)
            if "error" not in row:
                row["kernels_ms"] = kernel_split(lambda: run(True, None, ws))
            rows.append(row)
    finally:
        te.DECODED_DOWN, te.DECODED_DOWN_CONFIG = was
    return rows


def combine_rows(base: dict, run, ws, out: torch.Tensor, m: int, top_k: int, H: int) -> list[dict]:
    """The combine alone at each of ``COMBINE_CONFIGS`` on the slot rows of one shipped call (no shared expert):
    time, bytes over time, and whether its output has the shipped tiles' bits (the sum's order is fixed)."""
    rows = []
    run(None, ws=ws)
    shipped = out.clone()
    nbytes = ws.out_slots.numel() * 4 + out.numel() * out.element_size()
    for bt, bh, warps in COMBINE_CONFIGS:
        grid = (triton.cdiv(m, bt), triton.cdiv(H, bh))

        def combine():
            te.MOE_COMBINE.current()[grid](ws.out_slots, ws.out_slots, out, m, H, out.stride(0), TOP_K=top_k,
                                           HAS_SHARED=False, OUT_DTYPE=runtime.TORCH_TO_TL[out.dtype], BLOCK_T=bt,
                                           BLOCK_H=bh, num_warps=warps, **runtime.kernel_flags())
            return out

        cfg = {"BLOCK_T": bt, "BLOCK_H": bh, "num_warps": warps}
        combine()
        row = {**base, "path": "combine alone", "combine_config": cfg,
               "same_bits_as_shipped": bool(torch.equal(out, shipped)), "ms": time_fn(combine)[0], "bytes": nbytes}
        row["gbps"] = nbytes / row["ms"] / 1e6
        rows.append(row)
        print(f"{base['model']} {m:6d} combine T{bt} H{bh} w{warps} {row['ms']:.3f} ms ({row['gbps']:,.0f} GB/s), "
              f"same bits {row['same_bits_as_shipped']}", flush=True)
    return rows


def model_rows(ceilings, ab, preset: str) -> dict:
    import lynn_model
    from lynn_kernels.metrics import compare
    from lynn_model.bench import graph_prefill, prefill_census
    from lynn_model.loader import random_model

    cfg = lynn_model.preset(preset)
    model = random_model(cfg, weights="nvfp4", device="cuda", seed=0)
    gen = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (16384 + 64,), device="cuda", generator=gen)
    cache = model.new_cache(max_batch=1, max_tokens=16384 + 64)
    res, logits = {"model": preset}, {}
    name = ab[0][1]
    shipped = getattr(te, name) if name else None
    for label, _, value in ab:
        if name:
            setattr(te, name, value)
        torch.cuda.reset_peak_memory_stats()
        with torch.no_grad():
            s = cache.add()
            logits[label] = model.step(ids[:16384], cache, [s], [16384]).float()
            cache.release(s)
        part = {"peak_gb_16384_eager": torch.cuda.max_memory_allocated() / 1e9,
                "census_16384": prefill_census(model, ids[:16384], cache, ceilings)}
        for n in (2048, 8192, 16384):
            try:
                _, part[f"graph_{n}"] = graph_prefill(model, ids, n, n, ceilings, {})
            except Exception as err:
                part[f"graph_{n}"] = {"error": f"{type(err).__name__}: {err}"}
        res[label] = part
        print(f"{label}: " + ", ".join(f"{n}: {part[f'graph_{n}'].get('tok_s', float('nan')):,.0f} tok/s"
                                       for n in (2048, 8192, 16384)), flush=True)
    if not name:                                   # one arm, the shipped switches: nothing to compare
        return res
    setattr(te, name, shipped)
    (off, _, _), (on, _, _) = ab
    m = compare(logits[on], logits[off])
    res["switch"] = name
    res[f"logits_{on}_vs_{off}".replace(" ", "_")] = {"cosine": m.cosine, "max_abs": m.max_abs,
                                                      "bit_equal": bool(torch.equal(logits[on], logits[off]))}
    print(f"16,384-token prefill, last logits {on} vs {off}: cosine {m.cosine}, bit-equal "
          f"{torch.equal(logits[on], logits[off])}", flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="*", default=[8192, 16384], help="the op's token counts (none: "
                    "no op rows)")
    ap.add_argument("--skip-model", action="store_true", help="the op's rows only")
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="the op's sections to run")
    ap.add_argument("--model-ab", choices=sorted(MODEL_AB), default="order", help="the prefill's switch")
    ap.add_argument("--model", default="qwen3.5-35b-a3b", help="the prefill's preset")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("moe_prefill_decoded.py times GPU kernels: no GPU here")
    ceilings = measure_ceilings()
    command = ("PYTHONPATH=. python3 experiments/moe_prefill_decoded.py --tokens " + " ".join(map(str, args.tokens))
               + (" --skip-model" if args.skip_model else "") + " --parts " + " ".join(args.parts)
               + ("" if args.skip_model else f" --model-ab {args.model_ab} --model {args.model}"))
    res = {"provenance": provenance(command), "ceilings": ceilings.as_dict(),
           "shipped": {"DECODED_MIN_ROWS": te.DECODED_MIN_ROWS, "DECODED_CONFIG": te.DECODED_CONFIG,
                       "DECODE_EXPERTS_CONFIG": te.DECODE_EXPERTS_CONFIG}}
    res["rows"] = op_rows(ceilings.bf16_tflops, args.tokens, args.parts)
    save_experiment("moe-prefill-decoded", res)
    if not args.skip_model:
        res["prefill"] = model_rows(ceilings, MODEL_AB[args.model_ab], args.model)
        save_experiment("moe-prefill-decoded", res)


if __name__ == "__main__":
    main()
