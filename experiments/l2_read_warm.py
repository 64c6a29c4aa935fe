"""H200: is a warm-L2 measurement of a decode-sized read valid when the loads carry ``evict_first``?

``experiments/l2_prefetch.py`` timed the packed GEMV on the same weight every call ("warm": 14 MB stays in the 50 MB
L2) and found it no faster than on rotating weights. Its weight loads are ``evict_first``. This checks the premise on
the simplest kernel: a pure read of 4.7 / 9.4 / 14.2 MB (the decoder's projection sizes), cold (rotating buffers past
3x the L2) and warm (one buffer), with ``evict_first`` and with the default policy, by CUDA-graph replay.

Writes ``$OUT/l2_read_warm.json``; prints a table.

    PYTHONPATH=. python3 experiments/l2_read_warm.py
"""

import json
import os

import torch
import triton
import triton.language as tl

from lynn_kernels.bench.harness import l2_bytes, provenance
from lynn_kernels.bench.matmul_graph import graph_us

OUT = os.environ.get("OUT", "out")
os.makedirs(OUT, exist_ok=True)


@triton.jit
def _read(src_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr, EF: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    for i in range(ITERS):
        offs = (pid * ITERS + i) * BLOCK + tl.arange(0, BLOCK)
        if EF:
            acc ^= tl.load(src_ptr + offs, mask=offs < n, other=0, eviction_policy="evict_first")
        else:
            acc ^= tl.load(src_ptr + offs, mask=offs < n, other=0)
    tl.store(out_ptr + pid, tl.xor_sum(acc, 0))


def read(buf, sink, ef):
    n = buf.numel()
    _read[(triton.cdiv(n, 2048 * 4),)](buf, sink, n, BLOCK=2048, ITERS=4, EF=ef, num_warps=4)


res = {"provenance": provenance("python3 experiments/l2_read_warm.py"), "rows": []}
sink = torch.empty(1 << 20, dtype=torch.int32, device="cuda")
print(f"{'MB':>6} {'cold EF':>8} {'cold':>8} {'warm EF':>8} {'warm':>8}  us a read")
for mb in (4.72, 9.44, 14.2):
    n = int(mb * 1e6) // 4
    sets = [torch.randint(0, 1 << 30, (n,), dtype=torch.int32, device="cuda")
            for _ in range(max(8, -(-3 * l2_bytes() // (4 * n))))]
    row = {"MB": mb}
    for ef in (True, False):
        row[f"cold_{'ef' if ef else 'normal'}_us"] = graph_us([lambda b=b, e=ef: read(b, sink, e) for b in sets])
        row[f"warm_{'ef' if ef else 'normal'}_us"] = graph_us([lambda e=ef: read(sets[0], sink, e) for _ in sets])
    res["rows"].append(row)
    print(f"{mb:6.2f} {row['cold_ef_us']:8.2f} {row['cold_normal_us']:8.2f} {row['warm_ef_us']:8.2f} "
          f"{row['warm_normal_us']:8.2f}", flush=True)
    del sets
json.dump(res, open(os.path.join(OUT, "l2_read_warm.json"), "w"), indent=1)
