"""Helpers for notebook 06 (``notebooks/06-decoder.ipynb``): counting the ops a forward calls, and reading the
committed decoder benchmark. Plumbing, kept out of the notebook so that its cells show the decoder, not the
bookkeeping; nothing here is used by the model itself.

* ``OPS`` and ``count_ops()``: which ``lynn_kernels`` op runs each piece of the decoder, read off a real forward::

      with count_ops() as calls:
          model.step(ids, cache, slots, lengths)
      calls["nvfp4_linear"]        # how many times the step called it

  ``count_ops`` wraps, for the duration of the ``with``, the names ``lynn_model.model`` imported (its functions,
  and the ``F`` / ``deltanet`` / ``moe`` modules it calls through), so it counts what the model really calls.
* ``pick``, ``perf_rows`` and ``print_profile``: the rows of a committed ``lynn bench decoder.<shape>`` result
  (``data/bench/<gpu>/decoder.<shape>.json``, schema ``lynn-bench/1``) by provider, batch, context and prefill
  length, and the notebook's tables of them.

The rounding helpers the notebooks share are in ``lynn_kernels.notebook``.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager

import torch.nn.functional as F

from lynn_kernels import render_table

from . import model as lm

__all__ = ["OPS", "count_ops", "perf_rows", "pick", "print_profile"]


OPS = {  # op as lynn_model.model calls it -> (piece of the decoder, kernel family, notebook)
    "F.embedding": ("token embedding (a row gather)", "torch", "-"),
    "rmsnorm": ("zero-centred RMSNorm, residual add fused", "norm", "-"),
    "nvfp4_linear": ("NVFP4 projections: packed GEMV (<= 16 rows) / GEMM", "matmul", "02"),
    "F.linear": ("float projections: LM head, GDN in_proj_a / in_proj_b", "torch (cuBLAS)", "-"),
    "qk_norm_rope": ("q / k norm + partial RoPE + paged cache write", "attention", "04"),
    "flash_attention": ("attention, prefill (varlen, GQA, gate fused)", "attention", "04"),
    "decode_attention": ("attention, decode (split-KV, paged)", "attention", "04"),
    "deltanet.causal_conv1d": ("GDN causal conv + SiLU, prefill", "deltanet", "05"),
    "deltanet.causal_conv1d_update": ("GDN conv, decode (rolls the state)", "deltanet", "05"),
    "deltanet.gates": ("GDN gates g, beta (prefill)", "deltanet", "05"),
    "deltanet.chunk_gated_delta_rule": ("GDN chunked WY prefill", "deltanet", "05"),
    "deltanet.recurrent_gated_delta_rule_gates": ("GDN decode step, gates fused", "deltanet", "05"),
    "deltanet.gated_rmsnorm": ("GDN gated RMSNorm w * norm(o) * silu(z)", "deltanet", "05"),
    "moe.moe_block": ("MoE: router, top-k, grouped experts, shared expert", "moe", "03"),
}


class _Counted:
    """Stands in for a module (F, deltanet, moe): its functions are counted under the name `prefix.fn`."""

    def __init__(self, mod, prefix, counts):
        self._mod, self._prefix, self._counts = mod, prefix, counts

    def __getattr__(self, name):
        fn = getattr(self._mod, name)
        key = f"{self._prefix}.{name}"
        if key not in OPS:
            return fn

        def wrapped(*a, **kw):
            self._counts[key] += 1
            return fn(*a, **kw)
        return wrapped


@contextmanager
def count_ops():
    """Count the calls lynn_model.model makes to each op of OPS (wrapping the names it imported)."""
    counts, saved = Counter(), {}
    for name in ("rmsnorm", "nvfp4_linear", "qk_norm_rope", "flash_attention", "decode_attention"):
        fn = saved[name] = getattr(lm, name)
        setattr(lm, name, lambda *a, _fn=fn, _n=name, **kw: (counts.update([_n]), _fn(*a, **kw))[1])
    for name, mod in (("F", F), ("deltanet", lm.deltanet), ("moe", lm.moe)):
        saved[name] = getattr(lm, name)
        setattr(lm, name, _Counted(mod, name, counts))
    try:
        yield counts
    finally:
        for name, fn in saved.items():
            setattr(lm, name, fn)


def pick(doc, op, provider, batch=1, context=4096, tokens=2048):
    """The row of ``provider`` at this batch, decode context and prefill length (rows of other contexts exist)."""
    return next((r for r in doc["results"] if r["op"] == op and r["provider"] == provider
                 and r["dims"].get("B", 1) == batch and r["dims"].get("context", context) == context
                 and r["dims"].get("T", tokens) == tokens), None)


def perf_rows(shape, doc):
    read = doc["ceilings"]["read_gbps"]
    out = []
    for who, prov in (("ours NVFP4, eager", "lynn nvfp4 (eager)"),
                      ("ours NVFP4, kernel time of the eager step", "lynn nvfp4 (kernel)"),
                      ("ours NVFP4, CUDA graph", "lynn nvfp4 (graph)"),
                      ("ours NVFP4, CUDA graph, plain launches", "lynn nvfp4 (graph, plain launches)"),
                      ("ours NVFP4, CUDA graph, input projections fused",
                       "lynn nvfp4 (graph, input projections fused)"),
                      ("ours NVFP4, CUDA graph, input projections and GDN decode fused",
                       "lynn nvfp4 (graph, input projections and GDN decode fused)"),
                      ("ours NVFP4, generate() (graph)", "lynn nvfp4 generate() (graph)"),
                      ("ours NVFP4, captured prefill", "lynn nvfp4 (prefill graph)"),
                      ("ours, bf16 weights (cuBLAS), CUDA graph", "lynn bf16 weights, cuBLAS (graph)"),
                      ("HF transformers bf16, eager", "HF transformers bf16 (eager)")):
        pre, dec = pick(doc, "decoder.prefill", prov), pick(doc, "decoder.decode", prov)
        if pre is None and dec is None:
            continue
        out.append({"model": shape, "provider": who,
                    "prefill ms": f"{pre['median_ms']:.1f}" if pre else None,
                    "prefill tok/s": f"{pre['dims']['T'] / pre['median_ms'] * 1e3:,.0f}" if pre else None,
                    "decode ms/token": f"{dec['median_ms']:.2f}" if dec else None,
                    "decode tok/s": f"{1e3 / dec['median_ms']:,.1f}" if dec else None,
                    "GB/token": f"{dec['bytes'] / 1e9:.2f}" if dec else None,
                    "of read BW": f"{dec['frac_of_ceiling']:.1%}" if dec else None})
    ours = pick(doc, "decoder.decode", "lynn nvfp4 (eager)")
    out.append({"model": shape, "provider": "read-bandwidth bound (our bytes)",
                "decode ms/token": f"{ours['bytes'] / read / 1e6:.2f}",
                "decode tok/s": f"{read * 1e9 / ours['bytes']:,.0f}", "GB/token": f"{ours['bytes'] / 1e9:.2f}",
                "of read BW": "100%"})
    return out


def print_profile(shape, doc):
    """Print one committed decoder benchmark (``lynn bench decoder.<shape>``): its provenance, ceilings and
    validation, the table of ``perf_rows``, batch 8, and each launch census the run recorded."""
    p, c, info = doc["provenance"], doc["ceilings"], doc["info"][shape]
    print(f"\n== {doc['op']} on {p['gpu']}, {p['date']}, git {p['git_sha']}, torch {p['torch']}, "
          f"triton {p['triton']}, CUDA {p['cuda']}; `{p['command']}`")
    print(f"read {c['read_gbps']:,.0f} GB/s, bf16 matmul {c['bf16_tflops']:.0f} TFLOP/s; weights "
          f"{info['weights_gb']:.1f} GB (peak {info['peak_gb']:.1f} GB with the cache), built in "
          f"{info['build_s']:.0f} s; prefill of 2,048 tokens, decode at a 4,096-token context, batch 1")
    v = pick(doc, "decoder.decode", "lynn nvfp4 (eager)")["validation"]
    print(f"validated before timing: kernels vs references, cosine {v['cosine']:.6f} over the first 4 layers, "
          f"{v['full_depth_cosine']:.6f} over all layers")
    print(render_table(perf_rows(shape, doc)))
    b8 = pick(doc, "decoder.decode", "lynn nvfp4 (graph)", batch=8)
    if b8:
        print(f"batch 8, CUDA graph: {b8['median_ms']:.2f} ms per step, {8e3 / b8['median_ms']:,.0f} tok/s "
              f"aggregate")
    for key, form in (("census", "batch 1, as loaded"), ("census_fused", "batch 1, input projections and GDN decode "
                      "fused"), ("census_b8", "batch 8, as loaded")):
        census = info.get(key)
        if not census or "error" in census:
            continue
        parts = [{"part": k, "operations": v["kernels"], "us each": f"{v['us']:.1f}", "times per step": v["per_step"],
                  "us per step": f"{v['us'] * v['per_step']:,.0f}"} for k, v in census.items()
                 if k not in ("per_step", "whole_step")]
        print(f"\nlaunch census, one decode step, {form}: {census['whole_step']['kernels']} GPU operations, "
              f"{census['whole_step']['us']:,.0f} us profiled as a whole")
        print(render_table(parts))
        for k, v in census.items():                 # each kernel's time, where the run recorded it
            if len(v.get("detail", ())) > 1 and v.get("per_step"):
                print(f"  {k}: " + ", ".join(f"{name.replace('void ', '')[:32]} {us:.1f}" for name, us in v["detail"]))
