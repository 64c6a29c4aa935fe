"""The inputs an op meets in a model's decode step or prefill, by name: ``"qwen3.5-35b-a3b:decode"``.

A name is ``<model>:<phase>``: the model one of :data:`MODELS` (the published sizes, as ``lynn_model``'s presets
hold them; a test keeps the two equal), the phase ``decode`` (batch 1), ``decode-b8`` (batch 8: one token a sequence,
each with :data:`CONTEXT` cached tokens in a paged cache) or ``prefill`` (one prompt of 2,048 tokens). Every public
op of :data:`.ops.OPS` has a builder (:data:`BUILDERS`); an op the decoder runs in some phases only
(:data:`ONLY`: ``flash_attention`` at prefill, ``decode_attention`` at decode, ...) refuses the others, naming
the ones it has. Each :class:`Shape` makes fresh random inputs on the GPU (``make()``, called once per rotating set;
weights are made once per builder and shared), laid out as the decoder hands them over (views of fused projections,
packed NVFP4 weights), and knows the bytes the op must move at the least and, where there is one, the vendor
baseline on the same inputs (fla's delta rule only where fla is installed: it is no dependency).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass(frozen=True)
class Dims:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    gdn_k_heads: int
    gdn_v_heads: int
    gdn_head_dim: int
    experts: int
    top_k: int
    expert_inter: int
    shared_inter: int


#: The published sizes (their release configs; lynn_model.config.PRESETS holds the same numbers).
MODELS = {
    "qwen3.5-35b-a3b": Dims(2048, 16, 2, 256, 16, 32, 128, 256, 8, 512, 512),
    "qwen3-next-80b-a3b": Dims(2048, 16, 2, 256, 16, 32, 128, 512, 10, 512, 512),
    "tiny-qwen3.5-moe": Dims(64, 4, 2, 32, 2, 4, 16, 8, 2, 32, 48),
}
PHASES = {"decode": 1, "decode-b8": 8, "prefill": 2048}


@dataclass
class Shape:
    label: str
    dims: dict
    make: Callable[[], tuple[tuple, dict, dict]]    #: fresh ``(args, kwargs, aux)``: the op's, and the baseline's extra
    bytes: Callable[[tuple, dict], int] | None = None   #: least bytes moved; None: every tensor in and out once
    baseline: tuple[str, Callable] | None = None    #: (provider, fn(*args, **kwargs, **aux)) on the same inputs
    flops: int = 0
    extra: dict = field(default_factory=dict)


def parse(name: str) -> tuple[Dims, int, str, str]:
    """``(dims, rows, model, phase)`` of ``model:phase``; a ``ValueError`` listing the choices otherwise."""
    model, _, phase = name.partition(":")
    if model not in MODELS or phase not in PHASES:
        raise ValueError(f"unknown shapes {name!r}: expected <model>:<phase> with model one of {', '.join(MODELS)} "
                         f"and phase one of {', '.join(PHASES)} (e.g. qwen3.5-35b-a3b:decode)")
    return MODELS[model], PHASES[phase], model, phase


def _dev() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _projections(d: Dims) -> list[tuple[str, int, int]]:
    """(label, N, K) of the NVFP4 projections of one layer of each kind (the packed GEMV's decode shapes)."""
    gdn_qkv = 2 * d.gdn_k_heads * d.gdn_head_dim + d.gdn_v_heads * d.gdn_head_dim
    return [("GDN in_proj_qkv", gdn_qkv, d.hidden),
            ("GDN in_proj_z", d.gdn_v_heads * d.gdn_head_dim, d.hidden),
            ("GDN out_proj", d.hidden, d.gdn_v_heads * d.gdn_head_dim),
            ("attn q+gate", 2 * d.heads * d.head_dim, d.hidden),
            ("attn o_proj", d.hidden, d.heads * d.head_dim),
            ("shared expert gate_up", 2 * d.shared_inter, d.hidden)]


def rmsnorm_shapes(d: Dims, m: int) -> list[Shape]:
    def make():
        x = torch.randn(m, d.hidden, device=_dev(), dtype=torch.bfloat16)
        r = torch.randn(m, d.hidden, device=_dev(), dtype=torch.bfloat16)
        w = 0.1 * torch.randn(d.hidden, device=_dev(), dtype=torch.bfloat16)
        return (x, w, 1e-6), {"residual": r}, {}

    def torch_rmsnorm(x, w, eps, residual):
        h = x + residual
        return torch.nn.functional.rms_norm(h.float(), (h.shape[-1],), 1.0 + w.float(), eps).to(h.dtype), h

    return [Shape(f"{m}x{d.hidden} + residual", {"M": m, "D": d.hidden}, make,
                  baseline=("torch F.rms_norm (eager)", torch_rmsnorm))]


def linear_shapes(d: Dims, m: int) -> list[Shape]:
    from ..matmul import pack
    from ..nvfp4 import dequantize, quantize

    out = []
    for label, n, k in _projections(d):
        def make(n=n, k=k):
            q = quantize(torch.randn(n, k, device=_dev(), dtype=torch.bfloat16))
            x = torch.randn(m, k, device=_dev(), dtype=torch.bfloat16)
            return (x, pack(q)), {}, {"w_bf16": dequantize(q)}        # the same weights in bf16

        out.append(Shape(f"{label} {k}->{n}", {"M": m, "N": n, "K": k}, make,
                         bytes=lambda a, kw, n=n, k=k: n * k // 2 + n * k // 16 + 2 * a[0].shape[0] * (n + k),
                         baseline=("cuBLAS bf16 F.linear", lambda x, w, w_bf16: torch.nn.functional.linear(x, w_bf16)),
                         flops=2 * m * n * k))
    return out


def quantize_shapes(d: Dims, m: int) -> list[Shape]:
    out = []
    for label, n, k in _projections(d)[:3]:
        def make(n=n, k=k):
            return (torch.randn(n, k, device=_dev(), dtype=torch.bfloat16),), {}, {}

        out.append(Shape(f"{label} {n}x{k}", {"N": n, "K": k}, make))
    return out


def dequantize_shapes(d: Dims, m: int) -> list[Shape]:
    from ..nvfp4 import quantize

    out = []
    for label, n, k in _projections(d)[:3]:
        def make(n=n, k=k):
            return (quantize(torch.randn(n, k, device=_dev(), dtype=torch.bfloat16)),), {}, {}

        out.append(Shape(f"{label} {n}x{k}", {"N": n, "K": k}, make))
    return out


def moe_block_shapes(d: Dims, m: int) -> list[Shape]:
    from ..nvfp4 import quantize

    E, top_k, H, inter = d.experts, d.top_k, d.hidden, d.expert_inter
    weights: dict = {}

    def make():
        if not weights:                                # the experts once (hundreds of MB); x rotates the routing
            dev = _dev()
            weights["w13"] = quantize(torch.randn(E, 2 * inter, H, device=dev, dtype=torch.bfloat16) * 0.05)
            weights["w2"] = quantize(torch.randn(E, H, inter, device=dev, dtype=torch.bfloat16) * 0.05)
            weights["router"] = torch.randn(E, H, device=dev, dtype=torch.bfloat16) * 0.05
        x = torch.randn(m, H, device=_dev(), dtype=torch.bfloat16)
        return (x, weights["router"], weights["w13"], weights["w2"]), {"top_k": top_k}, {}

    expert = 3 * inter * H * 9 // 16                     # one expert's NVFP4 bytes (codes + scales)
    return [Shape(f"{m} tokens, {E} experts top-{top_k}, {H}->{inter}", {"M": m, "E": E, "top_k": top_k, "H": H,
                                                                            "I": inter}, make,
                  bytes=lambda a, kw: min(E, m * top_k) * expert + 4 * m * H,
                  flops=2 * m * top_k * 3 * inter * H)]


# -- shared pieces of the builders below ----------------------------------------------------------------------------

#: What the decoder's configuration adds to :class:`Dims` (the same in every preset; a test keeps them equal):
PAGE = 16             #: tokens a page of the paged KV cache (lynn_model.cache.Cache's default, its minimum)
CONTEXT = 4096        #: tokens cached per sequence at a decode step (the current one included)
CONV_WIDTH = 4        #: linear_conv_kernel_dim, the Gated DeltaNet conv's width (its state keeps W - 1 inputs)
ROTARY_DIV = 4        #: head_dim // rotary_dim (partial_rotary_factor 0.25)
ROPE_THETA = 1e7
EPS = 1e-6
BF16 = torch.bfloat16


def _randn(*shape, scale: float = 1.0, dtype=BF16) -> torch.Tensor:
    return torch.randn(*shape, device=_dev(), dtype=dtype) * scale


def _once(store: dict, key, build: Callable):
    """``store[key]``, built on the first call: a builder's weights are made once and shared by every input set."""
    if key not in store:
        store[key] = build()
    return store[key]


def _gdn_widths(d: Dims) -> tuple[int, int]:
    """``(C, Z)``: the conv's channels ``[q | k | v]`` (``in_proj_qkv``'s width) and ``in_proj_z``'s width."""
    return 2 * d.gdn_k_heads * d.gdn_head_dim + d.gdn_v_heads * d.gdn_head_dim, d.gdn_v_heads * d.gdn_head_dim


def _qkvz(d: Dims, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(qkv [rows, C], z [rows, Z])``: views of one fused ``in_proj_qkvz`` output, as the decoder reads them."""
    c, z = _gdn_widths(d)
    out = _randn(rows, c + z)
    return out[:, :c], out[:, c:]


def _split_qkv(d: Dims, y: torch.Tensor) -> tuple:
    """Views q, k ``[..., Hk, K]`` and v ``[..., HV, V]`` of a conv output ``y [..., C]`` (GatedDeltaNet._split)."""
    nq = d.gdn_k_heads * d.gdn_head_dim
    return (y[..., :nq].unflatten(-1, (d.gdn_k_heads, d.gdn_head_dim)),
            y[..., nq:2 * nq].unflatten(-1, (d.gdn_k_heads, d.gdn_head_dim)),
            y[..., 2 * nq:].unflatten(-1, (d.gdn_v_heads, d.gdn_head_dim)))


def _attn_qkv(d: Dims, rows: int) -> tuple:
    """Views ``(q, gate, k, v)`` ``[rows, heads, D]`` of one fused ``[q+gate | k | v]`` projection output."""
    from ..attention import split_q_gate

    nq, nk = 2 * d.heads * d.head_dim, d.kv_heads * d.head_dim
    out = _randn(rows, nq + 2 * nk)
    q, gate = split_q_gate(out[:, :nq], d.heads, d.head_dim)
    return (q, gate, out[:, nq:nq + nk].view(rows, d.kv_heads, d.head_dim),
            out[:, nq + nk:].view(rows, d.kv_heads, d.head_dim))


def _pages(rows: int, tokens: int) -> tuple[int, torch.Tensor]:
    """``(num_blocks, block_table)`` of a pool of pages for ``rows`` sequences of ``tokens`` each, as
    ``lynn_model.cache.Cache(max_batch=rows, max_tokens=rows * tokens)`` builds it: int32 ``[rows, num_blocks]``
    (its width the whole pool), row ``b`` listing its pages first; here in a random order of the pool (one that has
    served other sequences), so the kernel gathers pages that do not follow each other."""
    per = -(-tokens // PAGE)
    table = torch.zeros(rows, rows * per, dtype=torch.int32, device=_dev())
    table[:, :per] = torch.randperm(rows * per, dtype=torch.int32, device=_dev()).view(rows, per)
    return rows * per, table


def _route(m: int, d: Dims) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing weights fp32 ``[m, top_k]`` and int32 ids of random router logits (softmax top-k, renormalised)."""
    p, ids = torch.softmax(torch.randn(m, d.experts, device=_dev()), -1).topk(d.top_k, -1)
    return p / p.sum(-1, keepdim=True), ids.int()


def _nvfp4_bytes(n: int, k: int) -> int:
    return n * k // 2 + n * k // 16          # 4-bit codes and one fp8 scale per 16


def _experts(d: Dims, store: dict) -> tuple:
    """The routed experts ``w13 [E, 2I, H]``, ``w2 [E, H, I]`` in NVFP4 (the checkpoint layout), made once."""
    from ..nvfp4 import quantize

    def build():
        E, H, inter = d.experts, d.hidden, d.expert_inter
        return (quantize(_randn(E, 2 * inter, H, scale=0.05)), quantize(_randn(E, H, inter, scale=0.05)))

    return _once(store, "experts", build)


# -- matmul ---------------------------------------------------------------------------------------------------------

def _projection_shapes(d: Dims, m: int, flops: bool) -> list[Shape]:
    """The layer's NVFP4 projections (:func:`_projections`) at ``m`` rows of x: packed weights (the decoder's
    layout), made once per projection, and the cuBLAS bf16 baseline on the same weights."""
    from ..matmul import pack
    from ..nvfp4 import dequantize, quantize

    store: dict = {}
    out = []
    for label, n, k in _projections(d):
        def make(n=n, k=k, label=label):
            def build():
                q = quantize(_randn(n, k))
                return pack(q), dequantize(q)                 # the same weights in bf16 for the baseline

            w, w_bf16 = _once(store, label, build)
            return (_randn(m, k), w), {}, {"w_bf16": w_bf16}

        out.append(Shape(f"{label} {k}->{n}", {"M": m, "N": n, "K": k}, make,
                         bytes=lambda a, kw, n=n, k=k: _nvfp4_bytes(n, k) + 2 * m * (n + k),    # w, x in, y out
                         baseline=("cuBLAS bf16 F.linear", lambda x, w, w_bf16: torch.nn.functional.linear(x, w_bf16)),
                         flops=2 * m * n * k if flops else 0))
    return out


def gemv_shapes(d: Dims, m: int) -> list[Shape]:
    """A decode step's projections. With its packed weight a single row takes the packed GEMV, as ``nvfp4_linear``
    does (``use_packed_gemv``); from 3 rows, the tensor-core GEMV."""
    return _projection_shapes(d, m, flops=False)


def gemm_shapes(d: Dims, m: int) -> list[Shape]:
    """A prompt's projections through the GEMM kernel (``nvfp4_linear`` would dequantise these and call cuBLAS)."""
    return _projection_shapes(d, m, flops=True)


def norm_linear_shapes(d: Dims, m: int) -> list[Shape]:
    """The first projection of each mixer with the layer norm (and the residual add) folded in, as ``lynn
    generate`` fuses the projections: Gated DeltaNet ``in_proj_qkvz``, attention ``[q+gate | k | v]``."""
    from ..matmul import concat_rows, pack
    from ..nvfp4 import dequantize, quantize

    c, z = _gdn_widths(d)
    nk = d.kv_heads * d.head_dim
    firsts = [("GDN in_proj_qkvz", (c, z)), ("attn qkv", (2 * d.heads * d.head_dim, nk, nk))]
    store: dict = {}
    H = d.hidden
    out = []
    for label, parts in firsts:
        n = sum(parts)

        def make(parts=parts, label=label):
            def build():
                qs = [quantize(_randn(p, H)) for p in parts]      # each part its own global scale, kept per row
                return (concat_rows([pack(q) for q in qs]), torch.cat([dequantize(q) for q in qs]),
                        _randn(H, scale=0.1))

            w, w_bf16, norm_w = _once(store, label, build)
            return (_randn(m, H), norm_w, w, EPS), {"residual": _randn(m, H)}, {"w_bf16": w_bf16}

        def torch_norm_linear(x, norm_w, w, eps, residual, w_bf16):
            h = x + residual
            xn = torch.nn.functional.rms_norm(h.float(), (h.shape[-1],), 1.0 + norm_w.float(), eps).to(h.dtype)
            return torch.nn.functional.linear(xn, w_bf16), xn, h

        out.append(Shape(f"{label} {H}->{n} + norm, residual", {"M": m, "N": n, "K": H}, make,
                         # w, the norm's weight; x and the residual in; y, the normed x and the new residual out
                         bytes=lambda a, kw, n=n: _nvfp4_bytes(n, H) + 2 * H + 2 * m * (4 * H + n),
                         baseline=("torch F.rms_norm + cuBLAS bf16 F.linear", torch_norm_linear)))
    return out


# -- moe ------------------------------------------------------------------------------------------------------------

def route_shapes(d: Dims, m: int) -> list[Shape]:
    E, k = d.experts, d.top_k

    def make():
        return (_randn(m, E), k), {}, {}               # the router's logits, x's dtype

    def torch_route(logits, top_k):
        w, ids = torch.softmax(logits.float(), -1).topk(top_k, -1)
        return w / w.sum(-1, keepdim=True), ids.int()

    return [Shape(f"{m} tokens, {E} experts top-{k}", {"M": m, "E": E, "top_k": k}, make,
                  bytes=lambda a, kw: 2 * m * E + 8 * m * k,          # logits in; fp32 weights, int32 ids out
                  baseline=("torch softmax + topk (eager)", torch_route))]


def align_shapes(d: Dims, m: int) -> list[Shape]:
    from ..moe import max_padded
    from ..moe.triton_experts import block_m_for

    E, k = d.experts, d.top_k
    block_m = block_m_for(m, k, E)                     # the tile moe_experts aligns a prefill to
    padded = max_padded(m * k, E, block_m)

    def make():
        return (_route(m, d)[1], E, block_m), {}, {}

    return [Shape(f"{m} tokens, {E} experts top-{k}, block_m {block_m}", {"M": m, "E": E, "top_k": k,
                                                                        "block_m": block_m}, make,
                  # the ids in; every padded slot, the block experts and the count out
                  bytes=lambda a, kw: 4 * (m * k + padded + padded // block_m + 1))]


def moe_experts_shapes(d: Dims, m: int) -> list[Shape]:
    E, k, H, inter = d.experts, d.top_k, d.hidden, d.expert_inter
    store: dict = {}

    def make():
        from ..nvfp4 import dequantize

        w13, w2 = _experts(d, store)
        w13_bf16, w2_bf16 = _once(store, "bf16", lambda: (dequantize(w13), dequantize(w2)))
        weights, ids = _route(m, d)
        return (_randn(m, H), weights, ids, w13, w2), {}, {"w13_bf16": w13_bf16, "w2_bf16": w2_bf16}

    def grouped_mm(x, weights, ids, w13, w2, w13_bf16, w2_bf16):
        """The same experts in bf16 through torch._grouped_mm, the slots sorted by expert on the device (no sync)."""
        flat = ids.reshape(-1).long()
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(E, dtype=torch.int64, device=x.device).index_add_(0, flat, torch.ones_like(flat))
        offs = counts.cumsum(0).to(torch.int32)
        rows = order // k
        h = torch._grouped_mm(x[rows], w13_bf16.transpose(1, 2), offs=offs).float()       # [M k, 2I]
        act = (torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]).to(x.dtype)        # rounded once, as ours
        y = torch._grouped_mm(act, w2_bf16.transpose(1, 2), offs=offs)                    # [M k, H]
        y = y.float() * weights.reshape(-1)[order, None]
        return torch.zeros(x.shape, dtype=torch.float32, device=x.device).index_add_(0, rows, y).to(x.dtype)

    expert = _nvfp4_bytes(3 * inter, H)                # one expert's gate, up and down
    return [Shape(f"{m} tokens, {E} experts top-{k}, {H}->{inter}", {"M": m, "E": E, "top_k": k, "H": H, "I": inter},
                  make,
                  # the experts a batch can touch at the least; x in, y out; the routing in
                  bytes=lambda a, kw: min(E, m * k) * expert + 4 * m * H + 8 * m * k,
                  baseline=("torch._grouped_mm bf16", grouped_mm),
                  flops=2 * m * k * 3 * inter * H)]


def norm_moe_block_shapes(d: Dims, m: int) -> list[Shape]:
    """The block with its norm folded into the router, as the decoder loads it: the experts packed, the shared
    expert one more slot of their stacks (where its shape is the routed experts')."""
    from ..moe import SharedExpert, pack_experts
    from ..nvfp4 import quantize

    E, k, H, inter, si = d.experts, d.top_k, d.hidden, d.expert_inter, d.shared_inter
    store: dict = {}

    def build():
        w13, w2 = _experts(d, store)
        shared = SharedExpert(quantize(_randn(2 * si, H, scale=0.05)), quantize(_randn(H, si, scale=0.05)),
                              _randn(1, H, scale=0.05))
        return (*pack_experts(w13, w2, shared), _randn(E, H, scale=0.05), _randn(H, scale=0.1))

    def make():
        w13, w2, shared, router, norm_w = _once(store, "block", build)
        return ((_randn(m, H), norm_w, router, w13, w2, shared),
                {"top_k": k, "eps": EPS, "residual": _randn(m, H)}, {})

    weights = min(E, m * k) * _nvfp4_bytes(3 * inter, H) + _nvfp4_bytes(3 * si, H) + 2 * (E + 2) * H
    return [Shape(f"{m} tokens, {E} experts top-{k} + shared, {H}->{inter} + norm, residual",
                  {"M": m, "E": E, "top_k": k, "H": H, "I": inter, "Is": si}, make,
                  # the experts touched, the shared one, router, gates, norm; x, residual in; y, xn, h out
                  bytes=lambda a, kw: weights + 2 * 5 * m * H,
                  flops=2 * m * H * (k * 3 * inter + 3 * si + E))]


# -- attention ------------------------------------------------------------------------------------------------------

def _gated(o: torch.Tensor, gate: torch.Tensor, dtype) -> torch.Tensor:
    return (o.float() * torch.sigmoid(gate.float())).to(dtype)


def flash_attention_shapes(d: Dims, m: int) -> list[Shape]:
    """One prompt of ``m`` tokens, causal: q, k after qk_norm_rope, v and the gate views of the projection."""
    Hq, Hkv, D = d.heads, d.kv_heads, d.head_dim

    def make():
        _, gate, _, v = _attn_qkv(d, m)
        return (_randn(m, Hq, D), _randn(m, Hkv, D), v), {"gate": gate}, {}

    def sdpa(q, k, v, gate):
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=True,
            enable_gqa=True)
        return _gated(o[0].transpose(0, 1), gate, q.dtype)

    return [Shape(f"{m} tokens causal, {Hq}/{Hkv} heads x {D}", {"T": m, "Hq": Hq, "Hkv": Hkv, "D": D}, make,
                  bytes=lambda a, kw: 2 * m * D * (3 * Hq + 2 * Hkv),       # q, gate, k, v in once; o out
                  baseline=("torch SDPA (enable_gqa) + sigmoid gate", sdpa),
                  flops=2 * Hq * D * m * (m + 1))]              # QK^T and PV over the causal half


def decode_attention_shapes(d: Dims, m: int) -> list[Shape]:
    """``m`` sequences of :data:`CONTEXT` cached tokens (the current one included) in a paged cache of
    :data:`PAGE`-token pages; the baseline gets the same keys and values gathered into a contiguous cache."""
    Hq, Hkv, D = d.heads, d.kv_heads, d.head_dim
    per = CONTEXT // PAGE

    def make():
        blocks, table = _pages(m, CONTEXT)
        kc, vc = _randn(blocks, PAGE, Hkv, D), _randn(blocks, PAGE, Hkv, D)
        q, gate, _, _ = _attn_qkv(d, m)
        pages = table[:, :per].long()
        dense = {f"{n}_dense": c[pages].reshape(m, CONTEXT, Hkv, D).transpose(1, 2).contiguous()
                 for n, c in (("k", kc), ("v", vc))}                    # [m, Hkv, CONTEXT, D]
        seq_lens = torch.full((m,), CONTEXT, dtype=torch.int32, device=_dev())
        return (q, kc, vc, seq_lens, table), {"gate": gate}, dense

    def sdpa(q, k_cache, v_cache, seq_lens, block_table, gate, k_dense, v_dense):
        o = torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k_dense, v_dense, enable_gqa=True)
        return _gated(o[:, :, 0], gate, q.dtype)

    return [Shape(f"{m} x {CONTEXT} cached tokens, pages of {PAGE}, {Hq}/{Hkv} heads x {D}",
                  {"B": m, "S": CONTEXT, "page": PAGE, "Hq": Hq, "Hkv": Hkv, "D": D}, make,
                  # the cached K and V; q and the gate in, o out; each row's page numbers
                  bytes=lambda a, kw: 2 * m * D * (2 * CONTEXT * Hkv + 3 * Hq) + 4 * m * per,
                  baseline=("torch SDPA (enable_gqa) on the gathered cache + sigmoid gate", sdpa),
                  flops=4 * m * Hq * CONTEXT * D)]


def qk_norm_rope_shapes(d: Dims, m: int) -> list[Shape]:
    """Decode: ``m`` new tokens at position :data:`CONTEXT` - 1, written into a paged cache; prefill: one prompt of
    ``m`` tokens from position 0. q, k, v are views of the fused projection's output."""
    from ..attention import paged_slots

    Hq, Hkv, D = d.heads, d.kv_heads, d.head_dim
    prefill = m == PHASES["prefill"]
    seqs, tokens = (1, m) if prefill else (m, CONTEXT)
    store: dict = {}

    def make():
        blocks, table = _pages(seqs, tokens)                 # the pool once; a fresh page order per input set
        kc, vc = _once(store, "cache", lambda: (_randn(blocks, PAGE, Hkv, D), _randn(blocks, PAGE, Hkv, D)))
        q, _, k, v = _attn_qkv(d, m)
        qn, kn = _once(store, "norms", lambda: (_randn(D, scale=0.1), _randn(D, scale=0.1)))
        seq = torch.zeros(m, dtype=torch.long, device=_dev()) if prefill else torch.arange(m, device=_dev())
        pos = torch.arange(m, device=_dev()) if prefill else torch.full((m,), CONTEXT - 1, device=_dev())
        return (q, k, qn, kn, pos), {"v": v, "rotary_dim": D // ROTARY_DIV, "rope_theta": ROPE_THETA, "eps": EPS,
                                     "k_cache": kc, "v_cache": vc,
                                     "slot_mapping": paged_slots(table, seq, pos, PAGE)}, {}

    return [Shape(f"{m} tokens{'' if prefill else f' at position {CONTEXT - 1}'}, {Hq}/{Hkv} heads x {D}, "
                  f"rotary {D // ROTARY_DIV} + cache write", {"T": m, "Hq": Hq, "Hkv": Hkv, "D": D}, make,
                  # q, k, v in; q, k out and k, v into the cache; positions and slots (int64)
                  bytes=lambda a, kw: 2 * m * D * (2 * Hq + 5 * Hkv) + 16 * m + 4 * D)]


# -- deltanet -------------------------------------------------------------------------------------------------------

def _fla(name: str):
    """fla's op ``name`` on q and k repeated to the value heads (fla's older releases take one head count), as a
    baseline ``fn(q, k, v, g, beta, **kwargs, q_rep=, k_rep=)``; None when fla is not installed."""
    if importlib.util.find_spec("fla") is None:
        return None

    def run(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, use_qk_l2norm=False, *,
            q_rep, k_rep):
        import fla.ops.gated_delta_rule as gdr

        return getattr(gdr, name)(q_rep, k_rep, v, g, beta, scale=scale, initial_state=initial_state,
                                  output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm)

    return (f"fla {name}", run)


def _repeated(d: Dims, q, k) -> dict:
    """The baseline's q and k, each QK head repeated for its value heads (only where fla is installed)."""
    if importlib.util.find_spec("fla") is None:
        return {}
    r = d.gdn_v_heads // d.gdn_k_heads
    return {"q_rep": q.repeat_interleave(r, dim=2), "k_rep": k.repeat_interleave(r, dim=2)}


def _gates(m: int, d: Dims, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 log decays ``g <= 0`` and step sizes ``beta`` in (0, 1), ``[m, t, HV]`` (what ``deltanet.gates``
    returns)."""
    g = torch.nn.functional.logsigmoid(torch.randn(m, t, d.gdn_v_heads, device=_dev()))
    return g, torch.rand(m, t, d.gdn_v_heads, device=_dev())


def _rule_bytes(d: Dims, rows: int, t: int) -> int:
    """q, k, v in (bf16), g and beta (fp32), o out (bf16), the fp32 state in and out."""
    c, z = _gdn_widths(d)
    return rows * t * (2 * c + 8 * d.gdn_v_heads + 2 * z) + 2 * rows * d.gdn_v_heads * d.gdn_head_dim ** 2 * 4


def chunk_rule_shapes(d: Dims, m: int) -> list[Shape]:
    """One prompt of ``m`` tokens (q, k, v views of the conv output), from a state, the final state returned."""
    HV, K = d.gdn_v_heads, d.gdn_head_dim
    c, _ = _gdn_widths(d)

    def make():
        q, k, v = _split_qkv(d, _randn(1, m, c))
        g, beta = _gates(1, d, m)
        state = _randn(1, HV, K, K, scale=0.1, dtype=torch.float32)
        return ((q, k, v, g, beta), {"initial_state": state, "output_final_state": True, "use_qk_l2norm": True},
                _repeated(d, q, k))

    C, V = 64, K                                       # deltanet.CHUNK; the value heads' width is K's
    per_chunk = C * C * (6 * K + 4 * V) + 6 * C * K * V + C ** 3 // 3
    return [Shape(f"{m} tokens, {d.gdn_k_heads}/{HV} heads x {K}", {"T": m, "H": d.gdn_k_heads, "HV": HV, "K": K},
                  make, bytes=lambda a, kw: _rule_bytes(d, 1, m), baseline=_fla("chunk_gated_delta_rule"),
                  # per chunk and value head: KKT, the triangular solve, W and U, the state pass (W S, K^T V',
                  # Q S), the masked Q K^T and its product with V'
                  flops=HV * -(-m // C) * per_chunk)]


def recurrent_rule_shapes(d: Dims, m: int) -> list[Shape]:
    """``m`` sequences, one token each, from their states. The decoder updates the state in place
    (``out_state=state``); here the new state is returned instead (``output_final_state``: the same bytes), so that
    the reference and each provider start from the same state."""
    HV, K = d.gdn_v_heads, d.gdn_head_dim
    c, _ = _gdn_widths(d)

    def make():
        q, k, v = _split_qkv(d, _randn(m, 1, c))
        g, beta = _gates(m, d, 1)
        state = _randn(m, HV, K, K, scale=0.1, dtype=torch.float32)
        return ((q, k, v, g, beta), {"initial_state": state, "output_final_state": True, "use_qk_l2norm": True},
                _repeated(d, q, k))

    return [Shape(f"{m} x 1 token, {d.gdn_k_heads}/{HV} heads x {K}", {"B": m, "H": d.gdn_k_heads, "HV": HV, "K": K},
                  make, bytes=lambda a, kw: _rule_bytes(d, m, 1), baseline=_fla("fused_recurrent_gated_delta_rule"))]


def causal_conv1d_shapes(d: Dims, m: int) -> list[Shape]:
    """One prompt of ``m`` tokens of ``in_proj_qkv`` (a view of the fused ``qkvz``), from a conv state."""
    c, _ = _gdn_widths(d)
    W, S = CONV_WIDTH, CONV_WIDTH - 1
    store: dict = {}

    def make():
        weight = _once(store, "w", lambda: _randn(c, W, scale=0.3))
        return (_qkvz(d, m)[0][None], weight, _randn(1, c, S)), {}, {"w3": weight[:, None, :]}

    def conv1d(x, weight, initial_state, w3):
        full = torch.cat([initial_state, x.transpose(1, 2)], -1)           # [1, C, S + T], oldest first
        y = torch.nn.functional.conv1d(full[..., S - (W - 1):], w3, groups=c)
        return torch.nn.functional.silu(y).transpose(1, 2)

    return [Shape(f"{m} tokens x {c} channels, width {W}", {"T": m, "C": c, "W": W}, make,
                  bytes=lambda a, kw: 4 * m * c + 2 * c * W + 4 * c * S,      # x in, y out; weight; state in, out
                  baseline=("cuDNN F.conv1d (depthwise) + SiLU", conv1d))]


def conv_update_shapes(d: Dims, m: int) -> list[Shape]:
    """``m`` new tokens of ``in_proj_qkv`` (a view of the fused ``qkvz``) into their conv states, rolled in place.
    Each state holds the new token already (a constant window): rolled, it stays as it was, so the reference and
    each provider, run in turn on the same state, give the same output (the work is any step's)."""
    c, _ = _gdn_widths(d)
    W, S = CONV_WIDTH, CONV_WIDTH - 1
    store: dict = {}

    def make():
        weight = _once(store, "w", lambda: _randn(c, W, scale=0.3))
        x = _qkvz(d, m)[0]
        return (x, x[:, :, None].expand(m, c, S).contiguous(), weight), {}, {"w3": weight[:, None, :]}

    def conv1d_update(x, conv_state, weight, w3):
        full = torch.cat([conv_state, x[:, :, None]], -1)                 # [m, C, S + 1]
        y = torch.nn.functional.silu(torch.nn.functional.conv1d(full[..., -W:], w3, groups=c)[..., 0])
        conv_state.copy_(full[..., 1:])
        return y

    return [Shape(f"{m} x {c} channels, width {W}", {"B": m, "C": c, "W": W}, make,
                  bytes=lambda a, kw: 4 * m * c * (1 + S) + 2 * c * W,   # x in, y out; state in and out; weight
                  baseline=("torch F.conv1d + roll (eager)", conv1d_update))]


def gated_rmsnorm_shapes(d: Dims, m: int) -> list[Shape]:
    """The delta rule's output ``[B, T, HV, V]`` (decode: ``m`` x 1 token; prefill: 1 x ``m``) with ``z`` a view of
    the fused ``qkvz``."""
    HV, V = d.gdn_v_heads, d.gdn_head_dim
    b, t = (1, m) if m == PHASES["prefill"] else (m, 1)
    store: dict = {}

    def make():
        w = _once(store, "w", lambda: 1.0 + _randn(V, scale=0.1))
        return (_randn(b, t, HV, V), _qkvz(d, m)[1].view(b, t, HV, V), w, EPS), {}, {}

    def torch_gated_rmsnorm(x, z, weight, eps):                          # in HF's order and roundings
        h = weight * torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)
        return (h * torch.nn.functional.silu(z.float())).to(x.dtype)

    return [Shape(f"{b} x {t} tokens, {HV} heads x {V}", {"M": m, "HV": HV, "V": V}, make,
                  bytes=lambda a, kw: 6 * m * HV * V + 2 * V,             # x, z in; out; weight
                  baseline=("torch F.rms_norm + SiLU (eager)", torch_gated_rmsnorm))]


def gated_delta_decode_shapes(d: Dims, m: int) -> list[Shape]:
    """``m`` sequences' decode step as ``lynn generate`` runs it: ``qkv`` and ``z`` views of the fused ``qkvz``, the
    gates projected in the kernel from the layer's input and the bf16 ``in_proj_ba`` weights, both states updated in
    place. The inputs are chosen so that a step leaves the states as it found them (each conv window holds the new
    token already; decay 1, ``exp(A_log)`` ~ 1e-13; ``beta`` ~ 1e-28, the input and ``in_proj_b`` of opposite
    signs): the reference and each provider, run in turn on the same states, give the same output; the work and the
    bytes are any step's."""
    c, z = _gdn_widths(d)
    H, Hk, HV, K = d.hidden, d.gdn_k_heads, d.gdn_v_heads, d.gdn_head_dim
    S = CONV_WIDTH - 1
    store: dict = {}

    def build():
        ba = torch.cat([-(100.0 / H) * _randn(HV, H).abs(), _randn(HV, H, scale=0.05)])   # [b | a] rows
        return (_randn(c, CONV_WIDTH, scale=0.3), torch.full((HV,), -30.0, device=_dev()),
                _randn(HV, scale=0.5, dtype=torch.float32), 1.0 + _randn(K, scale=0.1), ba)

    def make():
        conv_w, A_log, dt_bias, norm_w, ba = _once(store, "weights", build)
        qkv, zz = _qkvz(d, m)
        conv_state = qkv[:, :, None].expand(m, c, S).contiguous()
        state = _randn(m, HV, K, K, scale=0.1, dtype=torch.float32)
        return ((qkv, zz.view(m, HV, K), None, None, conv_state, conv_w, A_log, dt_bias, state, norm_w, Hk),
                {"eps": EPS, "x": _randn(m, H).abs(), "a_weight": ba[HV:], "b_weight": ba[:HV],
                 "states_early": True}, {})

    return [Shape(f"{m} x 1 token, {Hk}/{HV} heads x {K}, conv {c} x {CONV_WIDTH}, gates from x [{H}]",
                  {"B": m, "H": Hk, "HV": HV, "K": K, "C": c, "HD": H}, make,
                  # the fp32 state and the conv state in and out; qkv, z, x in, o out; in_proj_b|a, conv weights
                  bytes=lambda a, kw: (8 * m * HV * K * K + 4 * m * c * S + 2 * m * (c + z + H + HV * K)
                                       + 4 * HV * H + 2 * c * CONV_WIDTH))]


#: op name -> shape builder(dims, rows)
BUILDERS: dict[str, Callable[[Dims, int], list[Shape]]] = {
    "nvfp4.quantize": quantize_shapes,
    "nvfp4.dequantize": dequantize_shapes,
    "matmul.nvfp4_linear": linear_shapes,
    "matmul.nvfp4_gemv": gemv_shapes,
    "matmul.nvfp4_gemm": gemm_shapes,
    "matmul.norm_linear": norm_linear_shapes,
    "moe.route": route_shapes,
    "moe.align": align_shapes,
    "moe.moe_experts": moe_experts_shapes,
    "moe.moe_block": moe_block_shapes,
    "moe.norm_moe_block": norm_moe_block_shapes,
    "attention.flash_attention": flash_attention_shapes,
    "attention.decode_attention": decode_attention_shapes,
    "attention.qk_norm_rope": qk_norm_rope_shapes,
    "deltanet.chunk_gated_delta_rule": chunk_rule_shapes,
    "deltanet.recurrent_gated_delta_rule": recurrent_rule_shapes,
    "deltanet.causal_conv1d": causal_conv1d_shapes,
    "deltanet.causal_conv1d_update": conv_update_shapes,
    "deltanet.gated_rmsnorm": gated_rmsnorm_shapes,
    "deltanet.gated_delta_decode": gated_delta_decode_shapes,
    "norm.rmsnorm": rmsnorm_shapes,
}

_DECODE, _PREFILL = ("decode", "decode-b8"), ("prefill",)

#: The ops the decoder runs in some phases only: op -> (its phases, what runs in the others). Every other op of
#: :data:`BUILDERS` has shapes at every phase of :data:`PHASES`.
ONLY: dict[str, tuple[tuple[str, ...], str]] = {
    "matmul.nvfp4_gemv": (_DECODE, "the GEMV takes at most 16 rows of x: a prefill's go to the GEMM"),
    "matmul.nvfp4_gemm": (_PREFILL, "a decode step's rows go to the GEMV"),
    "matmul.norm_linear": (_DECODE, "the decoder folds a norm into the projection after it in decode steps only"),
    "moe.align": (_PREFILL, "a decode step (at most 16 tokens) runs the experts without the align step"),
    "moe.norm_moe_block": (_DECODE, "the decoder folds a norm into the MoE router in decode steps only"),
    "attention.flash_attention": (_PREFILL, "a decode step reads the paged cache through decode_attention"),
    "attention.decode_attention": (_DECODE, "a prefill runs flash_attention"),
    "deltanet.chunk_gated_delta_rule": (_PREFILL, "a decode step runs the recurrent rule"),
    "deltanet.recurrent_gated_delta_rule": (_DECODE, "a prefill runs chunk_gated_delta_rule"),
    "deltanet.causal_conv1d": (_PREFILL, "a decode step runs causal_conv1d_update"),
    "deltanet.causal_conv1d_update": (_DECODE, "a prefill runs causal_conv1d"),
    "deltanet.gated_delta_decode": (_DECODE, "a prefill runs causal_conv1d, chunk_gated_delta_rule and "
                                             "gated_rmsnorm"),
}


def phases_of(op: str) -> tuple[str, ...]:
    """The phases op ``op`` has named shapes at (none when it has no builder)."""
    if op not in BUILDERS:
        return ()
    return ONLY[op][0] if op in ONLY else tuple(PHASES)


def default_shapes(op: str, model: str = "qwen3.5-35b-a3b") -> str:
    """``model``'s decode shapes for an op the decoder runs at decode, its prefill shapes for one it runs only there."""
    phases = phases_of(op)
    return f"{model}:{'decode' if 'decode' in phases or not phases else phases[0]}"


def shapes_for(op: str, name: str) -> list[Shape]:
    """The shapes op ``op`` meets in ``name`` (``model:phase``); a ``ValueError`` naming the phases it has where the
    decoder does not run it in that phase."""
    d, m, _, phase = parse(name)
    if op not in BUILDERS:
        raise ValueError(f"no named shapes for {op} (they exist for {', '.join(BUILDERS)}); pass "
                         "race(..., shapes=[Shape(label, dims, make)]) with inputs of your own")
    if phase not in phases_of(op):
        raise ValueError(f"{op} has no {phase} shapes: the decoder runs it at {' and '.join(phases_of(op))} only "
                         f"({ONLY[op][1]})")
    return BUILDERS[op](d, m)


__all__ = ["Dims", "MODELS", "PHASES", "Shape", "BUILDERS", "ONLY", "parse", "phases_of", "default_shapes",
           "shapes_for"]
