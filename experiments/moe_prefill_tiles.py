"""The routed experts' prefill GEMMs: the shipped kernels' tiles, and a dequantise-then-grouped-GEMM candidate.

For Qwen3.5-35B-A3B's experts (E 256, top-8, H 2048, I 512, random NVFP4, the checkpoint layout) at 1,024, 2,048
and 16,384 tokens (1,024 picks 32-row tiles, where the operand swap measured slower: docs/history/compiler-fault.md):

* the shipped op (``moe_experts``, the tiles ``PREFILL_CONFIGS`` picks for M), then each tile config below
  (``BLOCK_N``, ``BLOCK_K``, warps, stages) at the shipped ``BLOCK_M``, at 128 rows and (1,024 tokens) at 64 rows:
  exactness against the shipped op (bits, rel_l2), 50 calls with memory scribbled on between them (a pipelining
  fault shows as changing bits), time (``triton.testing.do_bench`` median, L2 flushed), TFLOP/s and the fraction
  of the measured bf16 peak;
* **dequantise once, then ``torch._grouped_mm``** (what the dense projections do, with the experts): both stacks
  decoded to bf16 (a 1.6 GB workspace at this shape: 256 x 3 x 512 x 2048 x 2 bytes), the slots sorted by expert,
  x gathered, two grouped GEMMs with the SwiGLU between them, each slot scaled by its routing weight and the
  ``top_k`` slots of a token summed in order. Timed whole and by part; its output against the shipped op's (rel_l2:
  another order of the sums, so not the same bits).

    PYTHONPATH=. python3 experiments/moe_prefill_tiles.py

Writes ``data/experiments/moe-prefill-tiles/<sha>.json`` (under ``$OUT`` when set). GPU only.
"""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.nn.functional as F

from lynn_kernels.bench.harness import churn_calls, measure_ceilings, provenance, save_experiment, time_fn
from lynn_kernels.lab.shapes import BUILDERS, MODELS
from lynn_kernels.moe import moe_experts
from lynn_kernels.moe import triton_experts as te

#: (BLOCK_N, BLOCK_K, num_warps, num_stages) of both GEMMs
CONFIGS = [(64, 128, 4, 1), (128, 128, 4, 3), (128, 128, 8, 3), (128, 128, 8, 4), (256, 128, 8, 3)]
TOKENS = (1024, 2048, 16384)


@contextlib.contextmanager
def tiles(n: int, k: int, warps: int, stages: int, block_m: int | None):
    """Every M takes this tile config (and ``block_m`` rows a tile, if given) inside the block."""
    was_cfg, was_bm = te.PREFILL_CONFIGS, te.block_m_for
    te.PREFILL_CONFIGS = ((None, {"BLOCK_N": n, "BLOCK_K": k, "num_warps": warps, "num_stages": stages}),)
    if block_m is not None:
        te.block_m_for = lambda M, top_k, E: block_m
    try:
        yield
    finally:
        te.PREFILL_CONFIGS, te.block_m_for = was_cfg, was_bm


def grouped_parts(x, weights, ids, w13, w2):
    """The dequantise-then-grouped-GEMM candidate as parts: ``(dequantise, route, gemms, combine)`` closures and
    the output of one pass."""
    M, H = x.shape
    top_k, E, I = ids.shape[1], w13.shape[0], w2.shape[-1]
    st: dict = {}

    def dequantise():
        st["w13"] = w13.dequantize(torch.bfloat16)          # [E, 2I, H]
        st["w2"] = w2.dequantize(torch.bfloat16)            # [E, H, I]

    def route():
        flat = ids.reshape(-1).long()
        order = torch.sort(flat, stable=True).indices       # slots grouped by expert
        st["order"] = order
        st["offs"] = torch.cumsum(torch.bincount(flat, minlength=E), 0).to(torch.int32)
        st["xs"] = x.index_select(0, order // top_k)        # [S, H]

    def gemms():
        gu = torch._grouped_mm(st["xs"], st["w13"].transpose(-2, -1), offs=st["offs"])     # [S, 2I]
        h = F.silu(gu[:, :I].float()).mul_(gu[:, I:].float()).to(torch.bfloat16)
        st["y"] = torch._grouped_mm(h, st["w2"].transpose(-2, -1), offs=st["offs"])        # [S, H]

    def combine():
        slots = torch.empty((M * top_k, H), dtype=torch.float32, device=x.device)
        w = weights.reshape(-1)[st["order"]].float()
        slots[st["order"]] = st["y"].float() * w[:, None]
        st["out"] = slots.view(M, top_k, H).sum(1).to(x.dtype)

    return (dequantise, route, gemms, combine), st


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("moe_prefill_tiles.py times GPU kernels: no GPU here")
    ceilings = measure_ceilings()
    peak = ceilings.bf16_tflops
    res = {"provenance": provenance("PYTHONPATH=. python3 experiments/moe_prefill_tiles.py"),
           "ceilings": ceilings.as_dict(), "rows": []}
    d = MODELS["qwen3.5-35b-a3b"]
    for m in TOKENS:
        shape = BUILDERS["moe.moe_experts"](d, m)[0]
        args, _, _ = shape.make()
        flops = shape.flops
        with torch.inference_mode():
            want = moe_experts(*args)
            ms = time_fn(lambda: moe_experts(*args))[0]
            res["rows"].append({"tokens": m, "kernel": "shipped", "config": te.prefill_config(m),
                                "block_m": te.block_m_for(m, args[2].shape[1], args[3].shape[0]), "ms": ms,
                                "tflops": flops / ms / 1e9, "frac_of_peak": flops / ms / 1e9 / peak})
            print(f"{m:6d} shipped {te.prefill_config(m)}  {ms:7.3f} ms {flops / ms / 1e9:6.0f} TFLOP/s", flush=True)
            for block_m in (None, 64, 128) if m < 2048 else (None, 128):    # 1,024 tokens picks 32 rows
                for n, k, warps, stages in CONFIGS:
                    row = {"tokens": m, "kernel": "tiles", "BLOCK_N": n, "BLOCK_K": k, "num_warps": warps,
                           "num_stages": stages, "block_m": block_m or "shipped"}
                    try:
                        with tiles(n, k, warps, stages, block_m):
                            got = moe_experts(*args)
                            row["same_bits"] = bool(torch.equal(got, want))
                            row["rel_l2"] = ((got.float() - want.float()).norm() / want.float().norm()).item()
                            row["ms"] = time_fn(lambda: moe_experts(*args))[0]
                            row["wrong_calls"] = churn_calls(lambda: moe_experts(*args), got)
                        row["tflops"] = flops / row["ms"] / 1e9
                        row["frac_of_peak"] = row["tflops"] / peak
                        print(f"{m:6d} BM{block_m or '-'} N{n} K{k} w{warps} s{stages}  {row['ms']:7.3f} ms "
                              f"{row['tflops']:6.0f} TFLOP/s, same bits {row['same_bits']}, rel_l2 "
                              f"{row['rel_l2']:.1e}, wrong calls {row['wrong_calls']}", flush=True)
                    except Exception as err:               # a tile that does not compile (shared memory) is a row
                        row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
                        print(f"{m:6d} BM{block_m or '-'} N{n} K{k} w{warps} s{stages}  failed: "
                              f"{row['error'][:120]}", flush=True)
                    res["rows"].append(row)
            row = {"tokens": m, "kernel": "dequantise + torch._grouped_mm",
                   "workspace_bytes": 2 * (args[3].shape[0] * 3 * args[4].shape[-1] * args[0].shape[1])}
            try:
                parts, st = grouped_parts(*args)
                for p in parts:
                    p()
                row["rel_l2_vs_shipped"] = ((st["out"].float() - want.float()).norm() / want.float().norm()).item()

                def whole():
                    for p in parts:
                        p()

                row["ms"] = time_fn(whole)[0]
                for p in parts:
                    row[f"{p.__name__}_ms"] = time_fn(p)[0]
                row["gemm_tflops"] = flops / row["gemms_ms"] / 1e9
                row["tflops"] = flops / row["ms"] / 1e9
                row["frac_of_peak"] = row["tflops"] / peak
                print(f"{m:6d} dequantise + grouped_mm  {row['ms']:7.3f} ms {row['tflops']:6.0f} TFLOP/s (GEMMs "
                      f"{row['gemms_ms']:.3f} ms, {row['gemm_tflops']:.0f} TFLOP/s; dequantise "
                      f"{row['dequantise_ms']:.3f}, route {row['route_ms']:.3f}, combine {row['combine_ms']:.3f}), "
                      f"rel_l2 {row['rel_l2_vs_shipped']:.1e}", flush=True)
            except Exception as err:
                row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
                print(f"{m:6d} dequantise + grouped_mm failed: {row['error'][:200]}", flush=True)
            res["rows"].append(row)
    save_experiment("moe-prefill-tiles", res)


if __name__ == "__main__":
    main()
