"""H200: a Gated DeltaNet layer's decode step after its projections, as three kernels (conv update, recurrent step
with the gates, gated norm) against one (``deltanet.gated_delta_decode``), by CUDA-graph replay the way the decoder
runs it (10 layers' worth of distinct states in a row, so the states come from HBM), at batch 1, 2, 8 and 32: the
chain with and without PDL, the fused kernel with PDL over a sweep of its V slice (``block_v``: 16 to 128 of a
head's 128 columns a program) and warps (2, 4, 8), and the shipped config (``decode_step_config``) without PDL too.
Each fused variant is first compared with the chain (output and recurrent state by the shared metrics, the conv
state bit for bit) and with itself on a repeat.

The first run (2f040dd: one program a head, BLOCK_V = 128) measured 4 warps best and slower than the PDL chain at
batch 1 (6.71 against 5.95 us a layer), faster from batch 2 (8.71 / 15.04 / 48.57 against 9.12 / 19.71 / 59.87);
8 and 16 warps were 1.8-2.8x slower: ``data/experiments/gdn-decode-fused/2f040dd.json``. The second (b1d3bf9, this
script: ``data/experiments/gdn-decode-fused/b1d3bf9.json``) found no V split faster than whole heads at any batch, and the split was
removed from the kernel after it: ``block_v`` exists only at b1d3bf9, where this script runs.

Writes ``$OUT/gdn_decode_fused.json`` and prints a table.

    PYTHONPATH=. python3 experiments/gdn_decode_fused.py
"""

import json
import os

import torch

from lynn_kernels import deltanet, runtime
from lynn_kernels.bench.harness import provenance
from lynn_kernels.bench.matmul_graph import graph_us
from lynn_kernels.deltanet import spec
from lynn_kernels.deltanet.triton_decode_step import decode_step_config, launch_gated_delta_decode
from lynn_kernels.metrics import bit_mismatches, compare

OUT = os.environ.get("OUT", "out")
os.makedirs(OUT, exist_ok=True)
H, HV, K, V, W = 16, 32, 128, 128, 4                  # Qwen3.5-35B-A3B and Qwen3-Next-80B-A3B
C = 2 * H * K + HV * V
LAYERS = 10
res = {"provenance": provenance("python3 experiments/gdn_decode_fused.py"), "rows": []}


def layer(B, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def r(*shape, scale=1.0, dtype=torch.bfloat16):
        return (torch.randn(shape, device="cuda", generator=g) * scale).to(dtype)

    big = r(B, C + HV * V + 2 * HV)                   # one projection output, as the fused in_proj gives it
    return dict(qkv=big[:, :C], z=big[:, C:C + HV * V].view(B, HV, V), a=big[:, C + HV * V:C + HV * V + HV],
                b=big[:, C + HV * V + HV:], conv_state=r(B, C, W - 1), conv_weight=r(C, W, scale=0.4),
                A_log=r(HV, dtype=torch.float32), dt_bias=r(HV, dtype=torch.float32),
                state=r(B, HV, K, V, scale=0.1, dtype=torch.float32), norm_weight=r(V).abs() + 0.5, num_k_heads=H)


def chain(qkv, z, a, b, conv_state, conv_weight, A_log, dt_bias, state, norm_weight, num_k_heads):
    Bn = qkv.shape[0]
    y = deltanet.causal_conv1d_update(qkv, conv_state, conv_weight)
    q, k = y[:, :H * K].reshape(Bn, 1, H, K), y[:, H * K:2 * H * K].reshape(Bn, 1, H, K)
    v = y[:, 2 * H * K:].reshape(Bn, 1, HV, V)
    o, _ = deltanet.recurrent_gated_delta_rule_gates(q, k, v, A_log, a[:, None], dt_bias, b[:, None],
                                                     initial_state=state, use_qk_l2norm=True, out_state=state)
    return deltanet.gated_rmsnorm(o[:, 0], z, norm_weight)


def fused(d, cfg):
    dims = spec.Dims(d["qkv"].shape[0], 1, H, HV, K, V)
    out = torch.empty(dims.B, HV, V, dtype=torch.bfloat16, device="cuda")
    bv, warps = cfg
    return launch_gated_delta_decode(d["qkv"], d["z"], d["a"], d["b"], d["conv_state"], d["conv_weight"],
                                     d["A_log"], d["dt_bias"], d["state"], d["norm_weight"], dims, 1e-6, out,
                                     num_warps=warps, block_v=bv)


CONFIGS = [(bv, w) for bv in (16, 32, 64, 128) for w in (2, 4, 8)]


def name(cfg):
    return f"fused, V/{cfg[0]}, {cfg[1]}w"


for B in (1, 2, 8, 32):
    layers = [layer(B, 100 * B + i) for i in range(LAYERS)]
    # exactness first, on copies of layer 0
    base = layers[0]
    ref = {k: (v.clone() if k in ("conv_state", "state") else v) for k, v in base.items()}
    want = chain(**ref)
    good = []
    for cfg in CONFIGS:
        a_ = {k: (v.clone() if k in ("conv_state", "state") else v) for k, v in base.items()}
        b_ = {k: (v.clone() if k in ("conv_state", "state") else v) for k, v in base.items()}
        try:
            got, rep = fused(a_, cfg), fused(b_, cfg)
        except Exception as e:                                               # noqa: BLE001
            res["rows"].append({"B": B, "variant": name(cfg), "error": repr(e)[:300]})
            print("fail", B, cfg, repr(e)[:200], flush=True)
            continue
        m, ms = compare(got, want), compare(a_["state"], ref["state"])
        res["rows"].append({"B": B, "variant": name(cfg), "check": True, "rel_l2_out": m.rel_l2,
                            "cosine_out": m.cosine, "rel_l2_state": ms.rel_l2,
                            "conv_state_mismatches": bit_mismatches(a_["conv_state"], ref["conv_state"]),
                            "repeat_mismatches": bit_mismatches(got, rep) + bit_mismatches(a_["state"], b_["state"]),
                            "bit_equal_to_chain": bit_mismatches(got, want) == 0})
        good.append(cfg)
    shipped = decode_step_config(B, V)
    for pdl in (False, True):
        with runtime.programmatic_launches(pdl):
            us = graph_us([lambda d=d: chain(**d) for d in layers])
            res["rows"].append({"B": B, "variant": "chain (3 kernels)", "pdl": pdl, "us_per_layer": us})
            for cfg in (good if pdl else [c for c in good if c == shipped]):
                us = graph_us([lambda d=d, c=cfg: fused(d, c) for d in layers])
                res["rows"].append({"B": B, "variant": name(cfg), "pdl": pdl, "us_per_layer": us,
                                    "shipped": cfg == shipped})
    json.dump(res, open(os.path.join(OUT, "gdn_decode_fused.json"), "w"), indent=1)

print(f"{'B':>3} {'variant':22} {'pdl':>5} {'us/layer':>9}   check")
for r in res["rows"]:
    if "us_per_layer" in r:
        chk = next((c for c in res["rows"] if c.get("check") and c["B"] == r["B"] and c["variant"] == r["variant"]),
                   None)
        note = "" if chk is None else (f"rel_l2 {chk['rel_l2_out']:.1e} state {chk['rel_l2_state']:.1e} conv "
                                       f"{chk['conv_state_mismatches']} repeat {chk['repeat_mismatches']}")
        print(f"{r['B']:>3} {r['variant'] + (' *' if r.get('shipped') else ''):22} {str(r['pdl']):>5} "
              f"{r['us_per_layer']:9.2f}   {note}")
