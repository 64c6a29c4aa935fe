"""What a finite flag adds to a decode step's epilogue (``lynn_model.graphs.DecodeStep``): CUDA-graph replay of the
argmax alone, with a flag from a reduction over the vocabulary, and with a flag from the chosen token's logit, on
Qwen3.5-35B-A3B's logits (vocab 248,320, bf16), batch 1 and 8. Results: ``data/experiments/finite-flag/``."""
import json
import os
from pathlib import Path

import torch

res = {}
for rows in (1, 8):
    logits = torch.randn(rows, 248320, device="cuda", dtype=torch.bfloat16)
    out = torch.zeros(2, rows, dtype=torch.int64, device="cuda")
    def plain():
        torch.argmax(logits, -1, out=out[0])
    def flagged():
        torch.argmax(logits, -1, out=out[0]); out[1].copy_(torch.isfinite(logits.amax(-1)))
    def gathered():
        torch.argmax(logits, -1, out=out[0]); out[1].copy_(torch.isfinite(logits.gather(-1, out[0][:, None])).squeeze(-1))
    for name, fn in (("argmax", plain), ("argmax+amax", flagged), ("argmax+gather", gathered)):
        s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3): fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(100): fn()
        for _ in range(5): g.replay()
        torch.cuda.synchronize()
        ts = []
        for _ in range(20):
            a, b = torch.cuda.Event(True), torch.cuda.Event(True)
            a.record(); g.replay(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b) * 1000 / 100)
        ts.sort(); res[f"{name} rows={rows}"] = ts[len(ts) // 2]
Path(os.environ["OUT"], "finite_flag_h200.json").write_text(json.dumps(res, indent=1))
for k, v in res.items(): print(f"{k:>24}: {v:.2f} us")
