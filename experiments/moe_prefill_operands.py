"""The routed experts' prefill GEMMs with the decoded weight tile as ``tl.dot``'s second operand: can they pipeline?

The shipped prefill kernels (``moe.gate_up``, ``moe.down``) compute ``acc[N, M] = W_tile @ x_tile^T``: the weight
tile, decoded in registers, is the first operand, which ``wgmma`` may read from registers, and Triton 3.6's
pipeliner then lets a wgmma read registers the next loop step rewrites (docs/history/compiler-fault.md). So on
Hopper they compile with one stage (``runtime.register_dot_stages``) and run at ~20% of the bf16 peak. ``wgmma``
reads its *second* operand from shared memory only: the variants here swap the operands, ``acc[M, N] = x_tile @
W_tile^T``, so the decoded tile goes through shared memory and x (loaded as it is, no conversion) can be
pipelined. Everything else is the shipped kernels' (a ``lab.edit`` of their source: the same decode, the same
epilogue, the same K order).

For Qwen3.5-35B-A3B's experts (E 256, top-8, H 2048, I 512, random NVFP4, the checkpoint layout) at 2,048 and
16,384 tokens, each tile config of the variants against the shipped op:

* exactness: the variant's output against the shipped op's (bits, and rel_l2);
* the race: 200 calls with memory scribbled between them, every output against the first (a pipelining fault
  shows as changing bits);
* the TTGIR of each compiled variant: register-operand dots and the largest ``pendings`` of their waits (exposed:
  both);
* time: ``triton.testing.do_bench`` (median, L2 flushed between calls); TFLOP/s and the fraction of the
  measured bf16 peak.

    PYTHONPATH=. python3 experiments/moe_prefill_operands.py

Writes ``data/experiments/moe-prefill-operands/<sha>.json`` (``$OUT`` instead when set). GPU only.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import sys
import tempfile

os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="moe-operands-")   # a fresh cache: every kernel compiles

import torch  # noqa: E402

from lynn_kernels import lab, runtime  # noqa: E402
from lynn_kernels.bench.harness import measure_ceilings, provenance, save_experiment, time_fn  # noqa: E402
from lynn_kernels.lab.shapes import BUILDERS, MODELS  # noqa: E402
from lynn_kernels.moe import moe_experts  # noqa: E402
from lynn_kernels.moe import triton_experts as te  # noqa: E402

GATE_UP = {
    "acc_gate = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)":
    "acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)",
    "acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)":
    "acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)",
    "xt = tl.load(x_ptr + token[None, :].to(tl.int64) * stride_xm + offs_k[:, None],\n"
    "                     mask=(offs_k[:, None] < H) & valid[None, :], other=0)\n"
    "        xt = to_float32(xt, X_DTYPE, INTERPRET).to(DOT_DTYPE)":
    "xt = tl.load(x_ptr + token[:, None].to(tl.int64) * stride_xm + offs_k[None, :],\n"
    "                     mask=valid[:, None] & (offs_k[None, :] < H), other=0)\n"
    "        if INTERPRET:\n"
    "            xt = to_float32(xt, X_DTYPE, INTERPRET).to(DOT_DTYPE)\n"
    "        else:\n"
    "            xt = xt.to(DOT_DTYPE)",
    "acc_gate = tl.dot(wt, xt, acc_gate, input_precision=PRECISION)":
    "acc_gate = tl.dot(xt, tl.trans(wt), acc_gate, input_precision=PRECISION)",
    "acc_up = tl.dot(wt, xt, acc_up, input_precision=PRECISION)":
    "acc_up = tl.dot(xt, tl.trans(wt), acc_up, input_precision=PRECISION)",
    "gate = acc_gate * g_gate[:, None]": "gate = acc_gate * g_gate[None, :]",
    "(acc_up * g_up[:, None])": "(acc_up * g_up[None, :])",
    "tl.store(h_ptr + rows[None, :].to(tl.int64) * I + offs_n[:, None]":
    "tl.store(h_ptr + rows[:, None].to(tl.int64) * I + offs_n[None, :]",
    "mask=mask_n[:, None] & valid[None, :])": "mask=valid[:, None] & mask_n[None, :])",
}
DOWN = {
    "acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)": "acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)",
    "ht = tl.load(h_ptr + rows[None, :].to(tl.int64) * I + offs_k[:, None],\n"
    "                     mask=(offs_k[:, None] < I) & valid[None, :], other=0)":
    "ht = tl.load(h_ptr + rows[:, None].to(tl.int64) * I + offs_k[None, :],\n"
    "                     mask=valid[:, None] & (offs_k[None, :] < I), other=0)",
    "acc = tl.dot(wt, ht, acc, input_precision=PRECISION)":
    "acc = tl.dot(ht, tl.trans(wt), acc, input_precision=PRECISION)",
    "y = acc * g * w[None, :]": "y = acc * g * w[:, None]",
    "tl.store(out_ptr + slot[None, :].to(tl.int64) * stride_om + offs_n[:, None]":
    "tl.store(out_ptr + slot[:, None].to(tl.int64) * stride_om + offs_n[None, :]",
    "mask=mask_n[:, None] & valid[None, :])": "mask=valid[:, None] & mask_n[None, :])",
}
#: (BLOCK_N, BLOCK_K, num_warps, num_stages) of both GEMMs
CONFIGS = [(64, 128, 4, 1), (64, 128, 4, 3), (128, 128, 4, 3), (128, 64, 4, 4), (128, 128, 8, 3), (256, 64, 8, 3),
           (128, 64, 8, 4)]
TOKENS = (2048, 16384)


def variants():
    gate_up = lab.edit("moe.gate_up", GATE_UP, name="_moe_gate_up_b_kernel")
    down = lab.edit("moe.down", DOWN, name="_moe_down_b_kernel")
    return (lab.variant("moe.moe_experts", gate_up, kernel="moe.gate_up"),
            lab.variant("moe.moe_experts", down, kernel="moe.down"))


@contextlib.contextmanager
def tiles(n: int, k: int, warps: int, stages: int, pipelined: bool):
    """The prefill GEMMs' tiles for the block; ``pipelined``: the stage count as asked (the hazard switch off)."""
    was_cfg, was_hazard = dict(te.PREFILL_CONFIG), runtime.register_dot_hazard_here
    te.PREFILL_CONFIG.clear()
    te.PREFILL_CONFIG.update(BLOCK_N=n, BLOCK_K=k, num_warps=warps, num_stages=stages)
    if pipelined:
        runtime.register_dot_hazard_here = lambda: False
    try:
        yield
    finally:
        te.PREFILL_CONFIG.clear()
        te.PREFILL_CONFIG.update(was_cfg)
        runtime.register_dot_hazard_here = was_hazard



def churn(fn, first: torch.Tensor, calls: int = 200) -> int:
    """Calls whose output's bits differ from ``first``, memory scribbled on between calls."""
    wrong = 0
    for _ in range(calls):
        junk = torch.full((64 << 20,), float("nan"), device="cuda")
        del junk
        if not torch.equal(fn(), first):
            wrong += 1
    return wrong


def ttgir_scan(seen: set) -> list[dict]:
    """The expert kernels compiled since the last scan (TTGIR files of the cache not in ``seen``, which it updates):
    per kernel its name, stages and warps, the wgmma dots, those with a register operand and the largest pendings of
    their waits (exposed: both)."""
    out = []
    for path in sorted(glob.glob(os.path.join(os.environ["TRITON_CACHE_DIR"], "*", "*.ttgir"))):
        if path in seen:
            continue
        seen.add(path)
        meta_path = path[:-len(".ttgir")] + ".json"
        meta = json.load(open(meta_path)) if os.path.exists(meta_path) else {}
        name = meta.get("name", "")
        if "gate_up" not in name and "down" not in name:
            continue
        text = open(path).read()
        dots = [line for line in text.splitlines() if "ttng.warp_group_dot %" in line]
        rs = sum(1 for d in dots if "#ttg.dot_op<{opIdx = 0" in d.split(" : ", 1)[-1].split(" * ", 1)[0])
        pend = max((int(p) for p in re.findall(r"warp_group_dot_wait .*?pendings = (\d+)", text)), default=0)
        out.append({"kernel": name, "num_stages": meta.get("num_stages"), "num_warps": meta.get("num_warps"),
                    "wgmma_dots": len(dots), "register_a_dots": rs, "max_pendings": pend,
                    "exposed": rs > 0 and pend > 0, "cache_entry": os.path.basename(os.path.dirname(path))})
    return out


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("moe_prefill_operands.py times GPU kernels: no GPU here")
    ceilings = measure_ceilings()
    res = {"provenance": provenance("PYTHONPATH=. python3 experiments/moe_prefill_operands.py"),
           "ceilings": ceilings.as_dict(), "rows": []}
    gate_up, down = variants()
    d = MODELS["qwen3.5-35b-a3b"]
    seen: set = set()
    ttgir_scan(seen)                                           # whatever the cache held before: not ours
    for m in TOKENS:
        shape = BUILDERS["moe.moe_experts"](d, m)[0]
        args, _, _ = shape.make()
        flops = shape.flops
        with torch.inference_mode():
            want = moe_experts(*args)                          # the shipped op as it ships (1 stage on 3.6)
            ms = time_fn(lambda: moe_experts(*args))[0]
            res["rows"].append({"tokens": m, "kernel": "shipped", "ms": ms, "tflops": flops / ms / 1e9,
                                "frac_of_peak": flops / ms / 1e9 / ceilings.bf16_tflops,
                                "ttgir": ttgir_scan(seen)})     # compiled by this row (none: an earlier one's)
            print(f"{m:6d} shipped                      {ms:7.3f} ms {flops / ms / 1e9:6.0f} TFLOP/s", flush=True)
            for n, k, warps, stages in CONFIGS:
                row = {"tokens": m, "kernel": "b-operand", "BLOCK_N": n, "BLOCK_K": k, "num_warps": warps,
                       "num_stages": stages}
                try:
                    with tiles(n, k, warps, stages, pipelined=True), lab.using(gate_up, down, count=False):
                        got = moe_experts(*args)
                        row["ttgir"] = ttgir_scan(seen)    # compiled by this config (none: at an earlier M)
                        row["same_bits"] = bool(torch.equal(got, want))
                        diff = (got.float() - want.float()).norm() / want.float().norm()
                        row["rel_l2"] = diff.item()
                        row["ms"] = time_fn(lambda: moe_experts(*args))[0]
                        row["wrong_calls"] = churn(lambda: moe_experts(*args), got, 200 if m == 2048 else 50)
                    row["tflops"] = flops / row["ms"] / 1e9
                    row["frac_of_peak"] = row["tflops"] / ceilings.bf16_tflops
                    print(f"{m:6d} b-operand N{n} K{k} w{warps} s{stages}  {row['ms']:7.3f} ms {row['tflops']:6.0f} "
                          f"TFLOP/s, same bits {row['same_bits']}, rel_l2 {row['rel_l2']:.1e}, wrong calls "
                          f"{row['wrong_calls']}", flush=True)
                except Exception as err:                   # a config that does not compile (shared memory) is a row
                    row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
                    print(f"{m:6d} b-operand N{n} K{k} w{warps} s{stages}  failed: {row['error'][:120]}", flush=True)
                res["rows"].append(row)
    for row in res["rows"]:
        for t in row.get("ttgir", ()):
            print(f"ttgir {row['kernel']} N{row.get('BLOCK_N', '-')} K{row.get('BLOCK_K', '-')}: {t['kernel']} "
                  f"stages {t['num_stages']} warps {t['num_warps']}: {t['wgmma_dots']} wgmma dots, "
                  f"{t['register_a_dots']} register-operand, max pendings {t['max_pendings']}"
                  f"{', EXPOSED' if t['exposed'] else ''}")
    save_experiment("moe-prefill-operands", res)


if __name__ == "__main__":
    main()
