"""Whether decoding the routed experts' weights on a second stream hides behind a layer's mixer in a long prefill.

At 16,384 tokens of Qwen3.5-35B-A3B the prefill decodes each MoE layer's packed ``w13`` stack into a bf16
workspace before its gate_up GEMM (``DECODED_MIN_ROWS``): about 0.5 ms a layer on an H100, 20 ms of a 308 ms
prefill, and Qwen3-Next-80B-A3B leaves the decoded path off because its decode costs what its GEMM wins. The decode
reads only weights, so it could run while the layer's mixer runs. This asks, at the op level, whether the GPU
overlaps the two: a Gated DeltaNet mixer's kernels at 16,384 tokens (input projection ``2048 -> 12,288``, the chunked
delta rule at 16 / 32 heads of 128, output projection ``4096 -> 2048``; packed NVFP4 weights through
``nvfp4_linear``) and an attention mixer's (input projection ``2048 -> 9,216``, causal flash attention at 16 / 2
heads of 256, output projection), each alone, the decode of ``w13`` (and of ``w13`` and ``w2``) alone, the two one
after the other on one stream, and the decode forked onto a second stream and joined after the mixer. Each form
is one CUDA graph, replayed; the figure is the median replay.

    PYTHONPATH=. python3 experiments/decode_overlap.py [--model qwen3.5-35b-a3b] [--tokens 16384]

Writes ``data/experiments/decode-overlap/<sha>.json`` (under ``$OUT`` when set). GPU only.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from lynn_kernels import attention, deltanet
from lynn_kernels.bench.harness import provenance, save_experiment
from lynn_kernels.lab.shapes import BUILDERS, MODELS
from lynn_kernels.matmul import nvfp4_linear, pack
from lynn_kernels.moe import pack_experts
from lynn_kernels.moe import triton_experts as te
from lynn_kernels.nvfp4 import quantize
from lynn_kernels.triton_shared import launch_packed_dequantize


def packed(n: int, k: int) -> object:
    return pack(quantize(torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.05))


def replay_ms(graph: torch.cuda.CUDAGraph, reps: int = 15) -> float:
    """Median ms of one replay of ``graph`` (events around each)."""
    times = []
    for _ in range(reps + 3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times[3:])


def captured(fn) -> torch.cuda.CUDAGraph:
    fn()                                             # compile and warm up outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3.5-35b-a3b")
    ap.add_argument("--tokens", type=int, default=16384)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("decode_overlap.py times GPU kernels: no GPU here")
    torch.manual_seed(0)
    T, H = args.tokens, 2048
    shape = BUILDERS["moe.moe_experts"](MODELS[args.model], 256)[0]
    (_, _, _, w13, w2), _, _ = shape.make()
    p13, p2, _ = pack_experts(w13, w2)
    w13 = w2 = None
    ws13 = torch.empty(tuple(p13.shape), dtype=torch.bfloat16, device="cuda")
    ws2 = torch.empty(tuple(p2.shape), dtype=torch.bfloat16, device="cuda")
    cfg = te.DECODE_EXPERTS_CONFIG

    x = torch.randn(T, H, dtype=torch.bfloat16, device="cuda")
    gdn_in, gdn_out = packed(12288, H), packed(H, 4096)
    q = torch.randn(1, T, 16, 128, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(1, T, 16, 128, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(1, T, 32, 128, dtype=torch.bfloat16, device="cuda")
    g = -torch.rand(1, T, 32, device="cuda") * 0.1
    beta = torch.rand(1, T, 32, dtype=torch.bfloat16, device="cuda")
    att_in, att_out = packed(9216, H), packed(H, 4096)
    qa = torch.randn(T, 16, 256, dtype=torch.bfloat16, device="cuda")
    ka = torch.randn(T, 2, 256, dtype=torch.bfloat16, device="cuda")
    va = torch.randn(T, 2, 256, dtype=torch.bfloat16, device="cuda")

    def gdn():
        nvfp4_linear(x, gdn_in)
        o, _ = deltanet.chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True)
        nvfp4_linear(o.reshape(T, 4096), gdn_out)

    def att():
        nvfp4_linear(x, att_in)
        o = attention.flash_attention(qa, ka, va, causal=True)
        nvfp4_linear(o.reshape(T, 4096), att_out)

    def dec13():
        launch_packed_dequantize(p13, ws13, cfg)

    def dec_both():
        launch_packed_dequantize(p13, ws13, cfg)
        launch_packed_dequantize(p2, ws2, cfg)

    side = torch.cuda.Stream()

    def forked(mixer, dec):
        def run():
            main = torch.cuda.current_stream()
            side.wait_stream(main)
            with torch.cuda.stream(side):
                dec()
            mixer()
            main.wait_stream(side)
        return run

    def serial(mixer, dec):
        def run():
            dec()
            mixer()
        return run

    rows = []
    alone = {}
    for name, fn in (("gdn mixer", gdn), ("attention mixer", att), ("decode w13", dec13),
                     ("decode w13 + w2", dec_both)):
        alone[name] = replay_ms(captured(fn))
        rows.append({"form": f"{name} alone", "ms": alone[name]})
        print(f"{name:18} alone      {alone[name]:7.3f} ms", flush=True)
    for mixer_name, mixer in (("gdn mixer", gdn), ("attention mixer", att)):
        for dec_name, dec in (("decode w13", dec13), ("decode w13 + w2", dec_both)):
            one = replay_ms(captured(serial(mixer, dec)))
            two = replay_ms(captured(forked(mixer, dec)))
            hidden = (one - two) / alone[dec_name]
            rows.append({"mixer": mixer_name, "decode": dec_name, "one_stream_ms": one, "two_streams_ms": two,
                         "decode_alone_ms": alone[dec_name], "mixer_alone_ms": alone[mixer_name],
                         "fraction_of_decode_hidden": hidden})
            print(f"{mixer_name:16} + {dec_name:16}: one stream {one:7.3f} ms, two streams {two:7.3f} ms "
                  f"({hidden:.0%} of the decode's {alone[dec_name]:.3f} ms hidden)", flush=True)
    res = {"provenance": provenance(f"PYTHONPATH=. python3 experiments/decode_overlap.py --model {args.model} "
                                    f"--tokens {T}"), "model": args.model, "tokens": T, "rows": rows}
    save_experiment("decode-overlap", res)


if __name__ == "__main__":
    main()
