"""Which op of a Gated DeltaNet prefill repeats unequal on the GPU? Each sub-op of layer 0's mixer (the two packed
projections, the conv, the gates, the chunk scan, the gated norm, the output projection) runs ``--runs`` times on
one fixed input, with the allocator's free memory scribbled on between runs (so an output a kernel forgets to
write, or a read of memory nobody wrote, shows as a difference), and the sub-ops whose outputs differ are listed,
with how often a run left split-K tickets unreset. The packed GEMMs also run with split-K off (``split_k=1``): the
first suspect is the split-K reduce of the prefill GEMM (a mixer output of 5.6e29 cannot pass the gated norm, which
bounds each element by sqrt(128), so it came from ``in_proj_z`` or ``out_proj``).

    PYTHONPATH=. python3 experiments/gdn_determinism.py [--preset qwen3-next-80b-a3b] [--tokens 80] [--runs 30]

Found by ``experiments/qwen3_next_trunk_diag.py --determinism``: on the H200 at 83e42ff, 3 of 36 Gated DeltaNet
mixers at 80 tokens gave a different output in one of five runs (max difference 5.6e29); nothing else did.

Outcome (H200, Triton 3.6): at 28ed237 only the packed GEMMs differed (``in_proj_qkv`` and ``in_proj_z`` once in 39
runs each, up to 1.5e31), never with split-K off, and no run left tickets; ``split_k_race.py`` then showed the
split-K reduce innocent and the cause a compiler fault (docs/history/compiler-fault.md, a compiler fault). At
88f5896, with the fix, no op differed in 19 runs (``data/experiments/gdn-determinism/*.txt``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch

import lynn_kernels
import lynn_model
from lynn_kernels import deltanet
from lynn_kernels.matmul.triton_matmul import launch_gemm
from lynn_kernels.triton_shared import _counters
from lynn_model.cache import Batch
from lynn_model.loader import random_model


def scribble(dev, mb: int, gen) -> None:
    """Fill and free ``mb`` MiB of fresh allocations with random bytes: the next allocations reuse them. Half in
    1 MiB blocks (the caching allocator's small pool), half in 12 MiB ones (the large pool: the GEMMs' split-K
    workspaces and outputs come from there)."""
    bufs = [torch.empty(1 << 20, dtype=torch.uint8, device=dev) for _ in range(mb // 2)]
    bufs += [torch.empty(12 << 20, dtype=torch.uint8, device=dev) for _ in range(max(1, mb // 24))]
    for b in bufs:
        b.random_(0, 256, generator=gen)
    del bufs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-next-80b-a3b")
    ap.add_argument("--tokens", type=int, default=80)
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--scribble-mb", type=int, default=256)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "out"), "gdn_determinism.json"))
    args = ap.parse_args()
    cfg = lynn_model.preset(args.preset)
    first = cfg.layer_types.index("linear_attention")
    cfg = dataclasses.replace(cfg, num_hidden_layers=first + 1, layer_types=cfg.layer_types[:first + 1])
    dev = lynn_kernels.runtime.DEVICE
    model = random_model(cfg, weights="nvfp4", device=dev, seed=0)
    L = model.layers[first].mixer
    gen = torch.Generator(device=dev).manual_seed(1)
    T = args.tokens
    x = (torch.randn(T, cfg.hidden_size, device=dev, generator=gen) * 0.5).to(torch.bfloat16)
    batch = Batch.uncached([T], dev)
    with torch.no_grad():
        qkv, z = L.in_proj_qkv(x), L.in_proj_z(x)
        b, a = L.in_proj_b(x), L.in_proj_a(x)
        y, _ = deltanet.causal_conv1d(qkv[None], L.conv_weight, None, cu_seqlens=batch.cu_seqlens)
        q, k, v = L._split(y)
        g, beta = deltanet.gates(L.A_log, a[None], L.dt_bias, b[None])
        o, _ = deltanet.chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True, cu_seqlens=batch.cu_seqlens)
        zz = z.view(1, T, L.nv, L.dv)
        on = deltanet.gated_rmsnorm(o, zz, L.norm_weight, eps=L.eps)
        ops = {
            "in_proj_qkv (packed GEMM)": lambda: L.in_proj_qkv(x),
            "in_proj_z (packed GEMM)": lambda: L.in_proj_z(x),
            "in_proj_b / a (bf16)": lambda: torch.cat([L.in_proj_b(x), L.in_proj_a(x)], -1),
            "causal_conv1d (packed)": lambda: deltanet.causal_conv1d(qkv[None], L.conv_weight, None,
                                                                     cu_seqlens=batch.cu_seqlens)[0],
            "causal_conv1d (unpacked)": lambda: deltanet.causal_conv1d(qkv[None], L.conv_weight, None)[0],
            "gates": lambda: torch.cat(deltanet.gates(L.A_log, a[None], L.dt_bias, b[None]), -1),
            "chunk_gated_delta_rule (packed)": lambda: deltanet.chunk_gated_delta_rule(
                q, k, v, g, beta, use_qk_l2norm=True, cu_seqlens=batch.cu_seqlens)[0],
            "chunk_gated_delta_rule (unpacked)": lambda: deltanet.chunk_gated_delta_rule(
                q, k, v, g, beta, use_qk_l2norm=True)[0],
            "chunk on contiguous q, k, v": lambda: deltanet.chunk_gated_delta_rule(
                q.contiguous(), k.contiguous(), v.contiguous(), g, beta, use_qk_l2norm=True)[0],
            "gated_rmsnorm": lambda: deltanet.gated_rmsnorm(o, zz, L.norm_weight, eps=L.eps),
            "out_proj (packed GEMM)": lambda: L.out_proj(on.reshape(T, -1)),
            "in_proj_z, split-K off": lambda: gemm(x, L.in_proj_z.weight, 1),
            "out_proj, split-K off": lambda: gemm(on.reshape(T, -1), L.out_proj.weight, 1),
            "in_proj_z, GEMM launch as chosen": lambda: gemm(x, L.in_proj_z.weight, None),
            "whole mixer": lambda: L(x, batch, None),
        }
        def gemm(a, w, split_k):
            """The packed GEMM launched directly (split_k=1: no tickets, no partials)."""
            y = torch.empty(a.shape[0], w.shape[0], dtype=a.dtype, device=dev)
            return launch_gemm(a, w, None, y, split_k=split_k)

        def tickets_left() -> int:
            """Split-K tickets not reset to 0 on any stream (every kernel that takes them resets them)."""
            return sum(int((buf != 0).sum()) for buf in _counters.values())

        rec = {"git_sha": os.environ.get("LYNN_GIT_SHA"), "preset": args.preset, "tokens": T, "runs": args.runs,
               "ops": []}
        for name, fn in ops.items():
            want = fn().clone()
            bad, worst, dirty = 0, 0.0, 0
            for _ in range(args.runs - 1):
                scribble(dev, args.scribble_mb, gen)
                got = fn()
                dirty += tickets_left() > 0
                if not torch.equal(got, want):
                    bad += 1
                    worst = max(worst, float((got.float() - want.float()).abs().nan_to_num(float("inf")).max()))
            rec["ops"].append({"op": name, "unequal_runs": bad, "max_abs_diff": worst, "runs_leaving_tickets": dirty})
            print(f"{name:36s} unequal {bad:3d} / {args.runs - 1}  max diff {worst:.3e}  tickets left after "
                  f"{dirty} runs", flush=True)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(rec, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
