"""Qwen3-Next-80B-A3B shape, random NVFP4 weights: each module of layers 0 (Gated DeltaNet) and 3 (attention), every
projection, the MoE block (with and without the shared expert), moe_experts, route and the LM head, kernel path against
the reference path on the same input, at M = 80 (prefill) and M = 1 (GPU machine only).

    PYTHONPATH=. python3 experiments/qwen3_next_validation_diag.py

Written when `lynn bench decoder.qwen3-next-80b-a3b` stopped at its validation gate at 3182a39 (the 4-layer model's
logits: cosine 0.707, rel_l2 0.707): this looks for the module that disagrees. Its output at 3182a39 is
`data/experiments/qwen3-next-validation-diag/results.txt`.
"""
import torch

import lynn_kernels
import lynn_model
from lynn_kernels import moe
from lynn_kernels.metrics import compare
from lynn_model.cache import Batch
from lynn_model.loader import random_model

torch.manual_seed(0)
cfg = lynn_model.preset("qwen3-next-80b-a3b")
m = random_model(cfg, weights="nvfp4", device="cuda", seed=0)
print("built", flush=True)
ids = torch.randint(0, cfg.vocab_size, (80,), device="cuda")
h = torch.nn.functional.embedding(ids, m.embed_tokens)
def cmp(tag, fn):
    with torch.no_grad():
        got = fn()
        with lynn_kernels.use_reference():
            want = fn()
    got = got[0] if isinstance(got, tuple) else got
    want = want[0] if isinstance(want, tuple) else want
    c = compare(got.float(), want.float())
    print(f"{tag:60s} cos {c.cosine:.6f} rel_l2 {c.rel_l2:.3e}", flush=True)
for M in (80, 1):
    batch = Batch.uncached([M], "cuda")
    x = m.layers[0].input_layernorm(h[:M])
    for i in (0, 3):
        L = m.layers[i]
        cmp(f"M={M} layer {i} {L.kind} mixer", lambda: L.mixer(x, batch, None))
        mix = L.mixer
        for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj"):
            if hasattr(mix, name):
                lin = getattr(mix, name)
                xin = x if name not in ("out_proj", "o_proj") else torch.randn(M, lin.in_features, device="cuda", dtype=torch.bfloat16)
                cmp(f"M={M} layer {i} {name} {lin.out_features}x{lin.in_features}", lambda: lin(xin))
    mlp = m.layers[0].mlp
    cmp(f"M={M} moe_block full", lambda: mlp(x))
    cmp(f"M={M} moe_block no shared", lambda: moe.moe_block(x, mlp.router, mlp.w13, mlp.w2, None, top_k=mlp.top_k, renormalize=mlp.renormalize))
    logits = (x.float() @ mlp.router.float().t()).to(x.dtype)
    w, e = moe.route(logits, mlp.top_k, mlp.renormalize)
    cmp(f"M={M} moe_experts", lambda: moe.moe_experts(x, w, e, mlp.w13, mlp.w2))
    cmp(f"M={M} route weights", lambda: moe.route(logits, mlp.top_k, mlp.renormalize)[0])
    cmp(f"M={M} lm_head", lambda: m.lm_head(x))
