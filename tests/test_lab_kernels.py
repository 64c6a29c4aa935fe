"""Kernel slots (:class:`lynn_kernels.runtime.Kernel`): every launcher asks its named kernel which ``@triton.jit``
function to launch, so a route (what ``lynn_kernels.lab.using`` installs) reaches it. Each family's test routes its
kernels to exact copies of themselves and checks that the ops' outputs keep their bits and that the routes were
taken."""

from __future__ import annotations

import collections

import pytest
import torch
import triton

from lynn_kernels import attention, deltanet, nvfp4, runtime
from lynn_kernels.attention import triton_decode, triton_prefill
from lynn_kernels.metrics import bit_mismatches
from lynn_kernels.nvfp4 import triton_quant

DEV = runtime.DEVICE
BF16, FP32 = torch.bfloat16, torch.float32

# -- nvfp4, attention, deltanet ----------------------------------------------------------------------------------

SLOTS_NVFP4_ATTENTION_DELTANET = (
    "nvfp4.quantize", "nvfp4.dequantize",
    "attention.prefill", "attention.decode", "attention.decode_merge", "attention.qk_norm_rope",
    "attention.decode_plan",
    "deltanet.chunk_wy", "deltanet.chunk_state", "deltanet.chunk_output", "deltanet.recurrent", "deltanet.conv",
    "deltanet.conv_update", "deltanet.gated_rmsnorm", "deltanet.decode_step",
)

#: Bits equal only where the copy runs the shipped kernel's config: the interpreter keeps one; a GPU's autotuner
#: times each kernel on its own and may pick another tiling (another summation order) for the copy.
_interpreter_only = pytest.mark.skipif(not runtime.INTERPRET, reason="the copy may autotune to another config")


def _slots_copy(shipped):
    """An exact copy of a shipped kernel: its Python function jitted again, under the same heuristics and autotuning
    configs (so the launcher passes it what it passes the shipped one)."""
    if hasattr(shipped, "configs"):                                     # an autotuner
        prune = getattr(shipped, "early_config_prune", None)
        return runtime.autotune(configs=list(shipped.configs), key=list(shipped.keys),
                                prune_configs_by={"early_config_prune": prune} if prune else None
                                )(_slots_copy(shipped.fn))
    if hasattr(shipped, "values"):                                      # triton.heuristics
        return triton.heuristics(dict(shipped.values))(_slots_copy(shipped.fn))
    return triton.jit(shipped.fn)


def _slots_routed(names):
    """Routes each kernel of ``names`` to a copy of itself; returns the routes and their hit counter."""
    hits = collections.Counter()
    routes = {name: _slots_copy(runtime.KERNELS[name].shipped) for name in names}
    return {**routes, runtime.HITS: (hits,)}, hits


def _slots_tensors(x) -> list:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for y in x for t in _slots_tensors(y)]
    return []


def _slots_same_bits(got, want):
    got, want = _slots_tensors(got), _slots_tensors(want)
    assert got and len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert bit_mismatches(a, b) == 0, f"output {i}"


def _slots_randn(gen, *shape, dtype=FP32, scale=1.0):
    return (torch.randn(shape, generator=gen) * scale).to(dtype).to(DEV)


def test_slots_nvfp4_attention_deltanet_are_named():
    import lynn_kernels.attention.triton_plan  # noqa: F401  (every launcher module: its kernels register on import)
    import lynn_kernels.deltanet.triton_decode_step  # noqa: F401

    missing = [n for n in SLOTS_NVFP4_ATTENTION_DELTANET if n not in runtime.KERNELS]
    assert not missing, missing
    assert runtime.KERNELS["nvfp4.quantize"].shipped is triton_quant._nvfp4_quantize_kernel
    assert runtime.KERNELS["attention.decode"].shipped is triton_decode._decode_split_kernel


@_interpreter_only
def test_slots_nvfp4_attention_deltanet_nvfp4_routes_keep_the_bits():
    w = _slots_randn(torch.Generator().manual_seed(0), 4, 64, dtype=BF16)

    def run():
        q = nvfp4.quantize(w)
        return q.codes, q.scales, nvfp4.dequantize(q, BF16)

    want = run()
    routes, hits = _slots_routed(("nvfp4.quantize", "nvfp4.dequantize"))
    with runtime.routed(routes):
        got = run()
    _slots_same_bits(got, want)
    assert hits["nvfp4.quantize"] > 0 and hits["nvfp4.dequantize"] > 0, hits
    # a launcher's kernel= runs the kernel it is given, routed or not
    q = nvfp4.quantize(w)
    out = torch.empty(q.shape, dtype=BF16, device=DEV)
    triton_quant.launch_dequantize(q, out, kernel=routes["nvfp4.dequantize"])
    _slots_same_bits(out, want[2])


@_interpreter_only
def test_slots_nvfp4_attention_deltanet_attention_routes_keep_the_bits():
    gen = torch.Generator().manual_seed(1)
    T, HQ, HKV, D = 5, 2, 1, 16
    q, k, v, gate = (_slots_randn(gen, T, h, D, dtype=BF16) for h in (HQ, HKV, HKV, HQ))
    qd, gd = _slots_randn(gen, 2, HQ, D, dtype=BF16), _slots_randn(gen, 2, HQ, D, dtype=BF16)
    kc, vc = (_slots_randn(gen, 2, 40, HKV, D, dtype=BF16) for _ in range(2))
    seq_lens = torch.tensor([33, 7], dtype=torch.int32, device=DEV)
    positions = torch.tensor([0, 1, 2, 5, 9], dtype=torch.int32, device=DEV)
    qw, kw = _slots_randn(gen, D, scale=0.1), _slots_randn(gen, D, scale=0.1)
    lengths = torch.tensor([0, 16, 40], dtype=torch.int64, device=DEV)
    active = torch.tensor([True, False, True], device=DEV)
    table = torch.tensor([[3, 1], [4, 2], [7, 8]], dtype=torch.int32, device=DEV)

    def run():
        pre = attention.flash_attention(q, k, v, gate=gate)
        dec = attention.decode_attention(qd, kc, vc, seq_lens, gate=gd, num_splits=2)          # split + merge
        tiled = torch.empty_like(qd)
        triton_decode.launch_decode(qd, kc, vc, seq_lens, None, gd, tiled, 2, 0.25, config={"BLOCK_N": 16})
        rope = attention.qk_norm_rope(q, k, qw, kw, positions, rotary_dim=8, rope_theta=1e4)
        plan = [torch.full((3,), -7, dtype=torch.int64, device=DEV) for _ in range(3)]
        attention.decode_plan(lengths, active, table, 16, *plan)
        return pre, dec, tiled, rope, plan

    want = run()
    names = ("attention.prefill", "attention.decode", "attention.decode_merge", "attention.qk_norm_rope",
             "attention.decode_plan")
    routes, hits = _slots_routed(names)
    with runtime.routed(routes):
        got = run()
    _slots_same_bits(got, want)
    assert all(hits[n] > 0 for n in names), hits
    assert hits["attention.decode"] == 2, hits                       # the autotuned call and the config= one
    # launch_prefill's config= goes past a routed autotuner to its heuristics, as past the shipped one
    from lynn_kernels.attention.spec import check_prefill

    lay = check_prefill(q, k, v, gate, None, None)
    outs = [torch.empty_like(q) for _ in range(2)]
    for out, kern in zip(outs, (None, routes["attention.prefill"])):
        triton_prefill.launch_prefill(q, k, v, gate, out, lay.cu_q_t, lay.cu_k_t, lay.max_q, True, 0.25,
                                      {"BLOCK_M": 16, "BLOCK_N": 16}, kernel=kern)
    _slots_same_bits(outs[1], outs[0])


@_interpreter_only
def test_slots_nvfp4_attention_deltanet_deltanet_routes_keep_the_bits():
    gen = torch.Generator().manual_seed(2)
    B, T, H, HV, K, V, C, W = 1, 3, 1, 2, 16, 16, 24, 4
    q, k = (_slots_randn(gen, B, T, H, K) for _ in range(2))
    v = _slots_randn(gen, B, T, HV, V)
    g = torch.nn.functional.logsigmoid(_slots_randn(gen, B, T, HV) + 2.0)
    beta = torch.sigmoid(_slots_randn(gen, B, T, HV))
    h0 = _slots_randn(gen, B, HV, K, V, scale=0.1)
    x, cw = _slots_randn(gen, B, T, C, dtype=BF16), _slots_randn(gen, C, W, scale=0.4)
    xs, conv_state = _slots_randn(gen, B, C, dtype=BF16), _slots_randn(gen, B, C, W - 1, dtype=BF16)
    xn, z, nw = (_slots_randn(gen, B, T, HV, V, dtype=BF16), _slots_randn(gen, B, T, HV, V, dtype=BF16),
                 _slots_randn(gen, V, dtype=BF16))
    Cs = 2 * H * K + HV * V                                          # the decode step's qkv channels
    step = dict(qkv=_slots_randn(gen, B, Cs, dtype=BF16), z=_slots_randn(gen, B, HV, V, dtype=BF16),
                a=_slots_randn(gen, B, HV, dtype=BF16), b=_slots_randn(gen, B, HV, dtype=BF16),
                conv_state=_slots_randn(gen, B, Cs, W - 1, dtype=BF16), conv_weight=_slots_randn(gen, Cs, W),
                A_log=_slots_randn(gen, HV), dt_bias=_slots_randn(gen, HV), state=h0.clone(),
                norm_weight=_slots_randn(gen, V, dtype=BF16), num_k_heads=H)

    def run():
        chunk = deltanet.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                use_qk_l2norm=True)
        rec = deltanet.recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                  use_qk_l2norm=True)
        conv = deltanet.causal_conv1d(x, cw)
        cs = conv_state.clone()                                      # rolled in place
        upd = deltanet.causal_conv1d_update(xs, cs, cw)
        norm = deltanet.gated_rmsnorm(xn, z, nw)
        s = {n: (t.clone() if n in ("conv_state", "state") else t) for n, t in step.items()}
        dec = deltanet.gated_delta_decode(**s)
        return chunk, rec, conv, upd, cs, norm, dec, s["conv_state"], s["state"]

    want = run()
    names = ("deltanet.chunk_wy", "deltanet.chunk_state", "deltanet.chunk_output", "deltanet.recurrent",
             "deltanet.conv", "deltanet.conv_update", "deltanet.gated_rmsnorm", "deltanet.decode_step")
    routes, hits = _slots_routed(names)
    with runtime.routed(routes):
        got = run()
    _slots_same_bits(got, want)
    assert all(hits[n] > 0 for n in names), hits


# -- moe, matmul -------------------------------------------------------------------------------------------------

SLOTS_MOE_MATMUL = (
    "matmul.packed_gemv", "matmul.gemv", "matmul.gemm", "matmul.dequantize",
    "moe.route", "moe.router", "moe.align_count", "moe.align_offsets", "moe.align_scatter", "moe.align_one_program",
    "moe.gate_up", "moe.down", "moe.combine", "moe.decode_gate_up", "moe.decode_down", "moe.packed_gate_up",
    "moe.packed_down", "moe.shared_gate",
)


def _slots_moe_matmul_copy(shipped):
    """An exact copy of a shipped kernel: its Python function jitted again; an autotuned one under the same configs,
    keys and pruner (so the interpreter keeps the config the shipped one keeps)."""
    if hasattr(shipped, "configs"):
        prune = getattr(shipped, "early_config_prune", None)
        return runtime.autotune(configs=list(shipped.configs), key=list(shipped.keys),
                                prune_configs_by={"early_config_prune": prune} if prune else None
                                )(triton.jit(shipped.fn.fn))
    return triton.jit(shipped.fn)


def _slots_moe_matmul_routes(names):
    hits = collections.Counter()
    routes = {name: _slots_moe_matmul_copy(runtime.KERNELS[name].shipped) for name in names}
    return {**routes, runtime.HITS: (hits,)}, hits


def _slots_moe_matmul_same_bits(got, want):
    from lynn_kernels.metrics import bit_mismatches

    got = list(got) if isinstance(got, (tuple, list)) else [got]
    want = list(want) if isinstance(want, (tuple, list)) else [want]
    assert got and len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert bit_mismatches(a, b) == 0, f"output {i}"


def _slots_randn_mm(gen, *shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(shape, generator=gen) * scale).to(dtype).to(runtime.DEVICE)


def test_slots_moe_matmul_are_named():
    from lynn_kernels import triton_shared
    from lynn_kernels.matmul import triton_matmul, triton_packed
    from lynn_kernels.moe import triton_align, triton_experts, triton_experts_decode, triton_route

    missing = [n for n in SLOTS_MOE_MATMUL if n not in runtime.KERNELS]
    assert not missing, missing
    shipped = {"matmul.packed_gemv": triton_packed.packed_gemv_kernel,
               "matmul.gemv": triton_matmul._nvfp4_gemv_kernel, "matmul.gemm": triton_matmul._nvfp4_gemm_kernel,
               "matmul.dequantize": triton_shared._packed_dequantize_kernel, "moe.route": triton_route._route_kernel,
               "moe.router": triton_route._router_kernel, "moe.align_count": triton_align._align_count_kernel,
               "moe.align_one_program": triton_align._align_one_program_kernel,
               "moe.decode_gate_up": triton_experts_decode._moe_decode_gate_up_kernel,
               "moe.packed_down": triton_experts_decode._moe_packed_down_kernel,
               "moe.combine": triton_experts._moe_combine_kernel, "moe.shared_gate": triton_route._shared_gate_kernel}
    for name, fn in shipped.items():
        assert runtime.KERNELS[name].shipped is fn, name
    # the packed GEMV keeps one DirectLaunch per kernel object: the shipped one's is the same on every ask
    assert triton_packed.PACKED_GEMV.launch() is triton_packed.PACKED_GEMV.launch()
    assert triton_packed.PACKED_GEMV.launch().fn is triton_packed.packed_gemv_kernel


@pytest.mark.skipif(not runtime.INTERPRET, reason="the copy may autotune to another config")
def test_slots_moe_matmul_matmul_routes_keep_the_bits():
    from lynn_kernels import matmul, nvfp4
    from lynn_kernels.matmul import triton_matmul, triton_packed

    gen = torch.Generator().manual_seed(3)
    n, k = 32, 128
    w = nvfp4.quantize(_slots_randn_mm(gen, n, k, dtype=torch.bfloat16))
    p = matmul.pack(w)
    x1, x3, x17 = (_slots_randn_mm(gen, m, k, dtype=torch.bfloat16) for m in (1, 3, 17))
    x128 = _slots_randn_mm(gen, 128, k, dtype=torch.bfloat16)
    nw = _slots_randn_mm(gen, k, dtype=torch.bfloat16, scale=0.1)
    config = {"BLOCK_N": 32, "BLOCK_M": 32, "BLOCK_K": 128, "num_warps": 4}

    def run():
        packed_gemv = matmul.nvfp4_linear(x1, p)                        # M = 1, packed: the packed GEMV
        normed = matmul.norm_linear(x1, nw, p)                          # the packed GEMV with the norm folded in
        gemv = matmul.nvfp4_linear(x3, w)                               # checkpoint layout, M <= 16: the GEMV
        gemm = matmul.nvfp4_linear(x17, w)                              # M > 16: the autotuned GEMM
        y17 = torch.empty(17, n, dtype=torch.bfloat16, device=runtime.DEVICE)
        gemm_cfg = triton_matmul.launch_gemm(x17, w, None, y17, config=config)   # a config: the autotuner's .fn
        dequant = matmul.nvfp4_linear(x128, p)                          # packed, 16-bit x, M >= 128: dequantise
        return packed_gemv, *normed, gemv, gemm, gemm_cfg, dequant

    want = run()
    names = ("matmul.packed_gemv", "matmul.gemv", "matmul.gemm", "matmul.dequantize")
    routes, hits = _slots_moe_matmul_routes(names)
    with runtime.routed(routes):
        got = run()
    _slots_moe_matmul_same_bits(got, want)
    assert hits["matmul.packed_gemv"] == 2 and hits["matmul.gemm"] == 2, hits
    assert all(hits[n] > 0 for n in names), hits
    # a launcher's kernel= runs the kernel it is given (each kernel object keeps its own DirectLaunch)
    y = torch.empty(1, n, dtype=torch.bfloat16, device=runtime.DEVICE)
    triton_packed.launch_packed_gemv(x1, p, None, y, kernel=routes["matmul.packed_gemv"])
    _slots_moe_matmul_same_bits(y, want[0])
    assert triton_packed.PACKED_GEMV.launch(routes["matmul.packed_gemv"]) is not triton_packed.PACKED_GEMV.launch()
    y = torch.empty(17, n, dtype=torch.bfloat16, device=runtime.DEVICE)
    triton_matmul.launch_gemm(x17, w, None, y, config=config,                   # a plain @triton.jit variant
                              kernel=triton.jit(triton_matmul._nvfp4_gemm_kernel.fn.fn))
    _slots_moe_matmul_same_bits(y, want[5])


@pytest.mark.skipif(not runtime.INTERPRET, reason="the copy may autotune to another config")
def test_slots_moe_matmul_moe_routes_keep_the_bits():
    from lynn_kernels import moe, nvfp4
    from lynn_kernels.moe import triton_align

    gen = torch.Generator().manual_seed(4)
    E, H, inter, top_k = 4, 32, 16, 2
    w13 = nvfp4.quantize(_slots_randn_mm(gen, E, 2 * inter, H, dtype=torch.bfloat16, scale=0.2))
    w2 = nvfp4.quantize(_slots_randn_mm(gen, E, H, inter, dtype=torch.bfloat16, scale=0.1))
    p13, p2, _ = moe.pack_experts(w13, w2)
    rw = _slots_randn_mm(gen, E, H, dtype=torch.bfloat16, scale=0.2)
    x1, x17 = _slots_randn_mm(gen, 1, H, dtype=torch.bfloat16), _slots_randn_mm(gen, 17, H, dtype=torch.bfloat16)
    ids = torch.randint(0, E, (40,), generator=gen, dtype=torch.int32).to(runtime.DEVICE)
    shared = moe.SharedExpert(nvfp4.quantize(_slots_randn_mm(gen, 2 * inter, H, dtype=torch.bfloat16, scale=0.2)),
                              nvfp4.quantize(_slots_randn_mm(gen, H, inter, dtype=torch.bfloat16, scale=0.1)),
                              _slots_randn_mm(gen, 1, H, dtype=torch.bfloat16, scale=0.2))

    def run():
        decode = moe.moe_block(x1, rw, w13, w2, top_k=top_k)          # router, decode gate_up / down
        packed = moe.moe_block(x1, rw, p13, p2, top_k=top_k)          # router, packed gate_up / down
        prefill = moe.moe_block(x17, rw, w13, w2, top_k=top_k)        # route, align, gate_up, down, combine
        prefill_shared = moe.moe_block(x17, rw, w13, w2, shared, top_k=top_k)   # and the shared expert's gate
        p_max = moe.spec.max_padded(ids.numel(), E, 16)
        outs = [torch.empty(n, dtype=torch.int32, device=runtime.DEVICE) for n in (p_max, p_max // 16, 1)]
        triton_align.launch_align(ids, E, 16, *outs, chunk=16)        # the multi-chunk align: count, offsets, scatter
        return decode, packed, prefill, prefill_shared, *outs

    want = run()
    routes, hits = _slots_moe_matmul_routes([n for n in SLOTS_MOE_MATMUL if n.startswith("moe.")])
    with runtime.routed(routes):
        got = run()
    _slots_moe_matmul_same_bits(got, want)
    missing = [n for n in routes if n != runtime.HITS and hits[n] == 0]
    assert not missing, (missing, hits)
    assert hits["moe.decode_gate_up"] > 0, hits
