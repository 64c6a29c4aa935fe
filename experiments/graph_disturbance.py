"""Does CUDA-graph timing disturb later work? The procedure that failed on 2026-11-29, replayed (GPU machine only).

    PYTHONPATH=. python3 experiments/graph_disturbance.py [--repeats 3] [--out $OUT/graph_disturbance.json]

The NVFP4 benchmark of 4622a6b timed its kernels by CUDA-graph replay (``time_graph``: a side stream, one warm-up
call, ``n`` calls captured into one graph, replays timed with events) and then checked a fresh ``dequantize`` against
the reference; twice that check found 30% of the output wrong (8192^2 and 16384^2) and graph timing was removed
(3bb5096). This script runs that procedure again on today's kernels, as it was (``as_in_4622a6b``: the side stream
starts without waiting for the current one) and with the stream ordering a capture needs (``ordered``: the side
stream waits for the current stream before the warm-up and the current stream for it after), ``--repeats`` times
per shape, and records every post-timing check: mismatching elements of ``dequantize`` against the reference.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys

import torch

from lynn_kernels.bench.harness import rotating, rotation
from lynn_kernels.nvfp4 import dequantize, quantize, reference
from lynn_kernels.nvfp4.triton_quant import launch_dequantize


def time_graph(fn, ordered: bool, max_calls: int = 50, replays: int = 20, target_ms: float = 20.0) -> float:
    """The harness's ``time_graph`` of 4622a6b (``ordered=False``), or with the side stream ordered against the
    current one (``ordered=True``). Returns the median ms per call."""
    stream = torch.cuda.Stream()
    if ordered:
        stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            fn()
        end.record()
        torch.cuda.synchronize()
        n = int(max(1, min(max_calls, target_ms / max(start.elapsed_time(end) / 3, 1e-3))))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(n):
                fn()
        graph.replay()
        torch.cuda.synchronize()
        samples = []
        for _ in range(replays):
            start.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) / n)
    if ordered:
        torch.cuda.current_stream().wait_stream(stream)
    del graph
    return float(torch.tensor(samples).median())


def one(shape, ordered: bool) -> dict:
    """The dequantise benchmark's body of 4622a6b for one shape: rotating input sets, a copy timed by graph, the
    launch into preallocated outputs timed by graph, then the check that failed."""
    numel = torch.Size(shape).numel()
    nbytes = numel // 2 + numel // 16 + 2 * numel
    sets = rotation(lambda: (quantize(torch.randn(shape, device="cuda", dtype=torch.bfloat16)),), nbytes)
    q0 = sets[0][0]
    want = reference.dequantize(q0)
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = time_graph(lambda: dst.copy_(src), ordered)
    del src, dst
    outs = [torch.empty(shape, dtype=torch.bfloat16, device="cuda") for _ in sets]
    graph_sets = [(q, o) for (q,), o in zip(sets, outs)]
    pre = int((launch_dequantize(*graph_sets[0]) != want).sum())
    kernel_ms = time_graph(rotating(launch_dequantize, graph_sets), ordered)
    post = int((dequantize(q0) != want).sum())
    n_sets = len(sets)
    del sets, outs, graph_sets
    torch.cuda.empty_cache()
    return {"shape": list(shape), "ordered": ordered, "sets": n_sets, "copy_ms": copy_ms,
            "kernel_ms": kernel_ms, "mismatches_before": pre, "mismatches_after": post, "numel": numel}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "out"), "graph_disturbance.json"))
    args = ap.parse_args()
    rec = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "git_sha": os.environ.get("LYNN_GIT_SHA"), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": __import__("triton").__version__,
           "command": "PYTHONPATH=. python3 experiments/graph_disturbance.py " + " ".join(sys.argv[1:]), "runs": []}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    for _ in range(args.repeats):
        for ordered in (False, True):
            for shape in ((8192, 8192), (16384, 16384)):
                r = one(shape, ordered)
                rec["runs"].append(r)
                print(f"{'ordered' if ordered else 'as in 4622a6b':>14} {shape}: kernel {r['kernel_ms']:.3f} ms, "
                      f"mismatches before {r['mismatches_before']}, after {r['mismatches_after']} of {r['numel']}",
                      flush=True)
                with open(args.out, "w") as f:
                    json.dump(rec, f, indent=1)
    bad = [r for r in rec["runs"] if r["mismatches_after"] or r["mismatches_before"]]
    print(f"{len(bad)} of {len(rec['runs'])} runs found wrong outputs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
