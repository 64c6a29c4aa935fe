"""The hybrid decoder (Qwen3-Next, Qwen3.5, Qwen3.5-MoE / Qwen3.6) on the kernels of :mod:`lynn_kernels`.

Every layer runs on packed tokens ``[T, H]``: the new tokens of ``N`` sequences one after another, described by a
:class:`~lynn_model.cache.Batch` (positions, offsets, cache slots). A call is a *prefill* (any number of new tokens
per sequence, fresh or continuing) or a *decode* step (one new token per sequence, each with a cached past)::

    embed -> [ norm -> Gated DeltaNet | gated attention -> + -> norm -> MoE | MLP -> + ] x L -> norm -> lm_head

Module and tensor names follow HF's (``layers.3.self_attn.q_proj``), so the loader maps a checkpoint one to one.
``with lynn_kernels.use_reference():`` runs every op on its torch reference. Math and dtypes: docs/decoder.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import lynn_kernels
from lynn_kernels import NVFP4Tensor, deltanet, moe, nvfp4_linear, rmsnorm
from lynn_kernels.attention import decode_attention, flash_attention, qk_norm_rope, split_q_gate
from lynn_kernels.matmul import PackedNVFP4, concat_rows, norm_linear

from .cache import Batch, Cache
from .config import Config


def _placeholder(*shape) -> torch.Tensor:
    """An unloaded tensor: shape only (the loader replaces it)."""
    return torch.empty(shape, device="meta")


class Linear(nn.Module):
    """``y = x @ W^T``, no bias: ``W`` float (``F.linear``, cuBLAS on a GPU), or NVFP4 through
    :func:`lynn_kernels.nvfp4_linear` (decoded in registers): a :class:`~lynn_kernels.matmul.PackedNVFP4` (the
    kernel layout the loader makes) or an :class:`NVFP4Tensor` (the checkpoint layout).
    ``x [..., in]`` -> ``[..., out]`` in x's dtype."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight: torch.Tensor | NVFP4Tensor | PackedNVFP4 = _placeholder(out_features, in_features)

    @property
    def quantized(self) -> bool:
        return isinstance(self.weight, (NVFP4Tensor, PackedNVFP4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized:
            return nvfp4_linear(x, self.weight)
        rows = x.numel() // max(1, x.shape[-1])
        like = lynn_kernels.runtime.batch_rows(rows)
        if like != rows and rows:        # as_batch: cuBLAS picks its kernel by M, so exactly `like` rows a call
            return lynn_kernels.runtime.in_calls_of(lambda p: F.linear(p, self.weight), x.reshape(rows, -1),
                                                    like).view(*x.shape[:-1], -1)
        return F.linear(x, self.weight)

    def extra_repr(self) -> str:
        kind = ("nvfp4 (packed)" if isinstance(self.weight, PackedNVFP4) else "nvfp4") if self.quantized \
            else str(self.weight.dtype).replace("torch.", "")
        return f"{self.in_features} -> {self.out_features}, {kind}"


def fuse_linears(parts: list[Linear]) -> Linear | None:
    """One :class:`Linear` whose weight stacks ``parts``' along N (projections of the same input): packed NVFP4
    parts through :func:`~lynn_kernels.matmul.concat_rows` (each row keeps its global scale: exact), float parts of
    one dtype through ``torch.cat``. None when the parts are not all of one of those kinds (a checkpoint may keep one
    of them in bf16): they then stay apart."""
    ws = [p.weight for p in parts]
    if all(isinstance(w, PackedNVFP4) for w in ws):
        weight = concat_rows(ws)
    elif all(isinstance(w, torch.Tensor) and w.dtype == ws[0].dtype and w.device.type != "meta" for w in ws):
        weight = torch.cat(ws)
    else:
        return None
    fused = Linear(parts[0].in_features, sum(p.out_features for p in parts))
    fused.weight = weight
    return fused


class Norm(nn.Module):
    """HF's zero-centred RMSNorm: ``rmsnorm(x) * (1 + w)`` in fp32, one rounding (``lynn_kernels.rmsnorm``)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight, self.eps = _placeholder(dim), eps

    def forward(self, x, residual=None):
        """``x [..., D]``; with ``residual``: returns ``(rmsnorm(x + residual), x + residual)``."""
        return rmsnorm(x, self.weight, self.eps, residual=residual)


#: Decode steps of at most this many sequences fold their norms (``Model.fuse_norms``): from three rows on the
#: router's prologue costs more than the launch it saves, and measured at batch 1 folding is within noise of the
#: unfolded step, so it is off by default and ``lynn generate`` does not turn it on (docs/history/decode.md).
FOLD_NORMS_MAX_ROWS = 2


class PreNorm:
    """A block's input whose RMSNorm has not run yet: ``norm(delta + residual)`` (``residual`` None: ``norm(delta)``),
    handed to the block so that its first kernel runs the norm in its own launch (``Model.fuse_norms``).

    :meth:`project` runs the first projection with the norm folded in (:func:`lynn_kernels.matmul.norm_linear`) and
    keeps the normed rows ``x`` and the residual stream ``h`` it wrote; later projections read ``x``. The MoE block
    folds it into its router (:func:`lynn_kernels.moe.norm_moe_block`). ``h`` is the residual after the add (the
    delta itself without a residual)."""

    __slots__ = ("delta", "residual", "norm", "x", "h")

    def __init__(self, delta: torch.Tensor, residual: torch.Tensor | None, norm: "Norm"):
        self.delta, self.residual, self.norm = delta, residual, norm
        self.x: torch.Tensor | None = None
        self.h: torch.Tensor | None = delta if residual is None else None

    @property
    def shape(self) -> torch.Size:
        return self.delta.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.delta.dtype

    def take(self, got: tuple) -> torch.Tensor:
        """Keep ``(y, xn[, h])`` from a fused op; returns ``y``."""
        self.x = got[1]
        if self.residual is not None:
            self.h = got[2]
        return got[0]

    def tensor(self) -> torch.Tensor:
        """The normed input, running the norm kernel where no fused op has run it yet."""
        if self.x is None:
            got = self.norm(self.delta, residual=self.residual)
            if self.residual is None:
                self.x = got
            else:
                self.x, self.h = got
        return self.x

    def project(self, proj: "Linear") -> torch.Tensor:
        """``proj(x)``, the norm in the projection's launch where it is the first to read ``x`` and NVFP4."""
        if self.x is None and proj.quantized:
            return self.take(norm_linear(self.delta, self.norm.weight, proj.weight, self.norm.eps,
                                         residual=self.residual))
        return proj(self.tensor())


def _project(proj: "Linear", x) -> torch.Tensor:
    """``proj(x)`` for a tensor or a :class:`PreNorm`."""
    return x.project(proj) if isinstance(x, PreNorm) else proj(x)


def _tensor(x) -> torch.Tensor:
    return x.tensor() if isinstance(x, PreNorm) else x


class Attention(nn.Module):
    """Gated full attention: q / k / v projections, q / k norm + partial RoPE (+ the cache write), flash prefill or
    split-KV decode over the paged cache, the output gate ``sigmoid(gate)`` fused, then ``o_proj``."""

    def __init__(self, c: Config, layer: int):
        super().__init__()
        self.layer, self.hq, self.hkv, self.d = layer, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.rotary_dim, self.theta, self.eps = c.rotary_dim, c.rope_theta, c.rms_norm_eps
        h = c.hidden_size
        self.q_proj = Linear(h, 2 * self.hq * self.d)         # per head [query | gate]
        self.k_proj = Linear(h, self.hkv * self.d)
        self.v_proj = Linear(h, self.hkv * self.d)
        self.o_proj = Linear(self.hq * self.d, h)
        self.q_norm, self.k_norm = Norm(self.d, self.eps), Norm(self.d, self.eps)
        self.qkv_proj: Linear | None = None                   # [q | k | v] in one GEMV (fuse_input_projections)

    def fuse_input_projections(self) -> list[str]:
        """Replace q_proj, k_proj, v_proj by one ``qkv_proj`` where their weights are of one kind (one launch
        instead of three); returns the fused group's name, or nothing."""
        fused = fuse_linears([self.q_proj, self.k_proj, self.v_proj]) if self.qkv_proj is None else None
        if fused is None:
            return []
        self.qkv_proj = fused
        del self.q_proj, self.k_proj, self.v_proj
        return ["q_proj|k_proj|v_proj"]

    def forward(self, x: torch.Tensor, batch: Batch, cache: Cache | None) -> torch.Tensor:
        t = x.shape[0]
        nq, nk = 2 * self.hq * self.d, self.hkv * self.d
        if self.qkv_proj is not None:                          # strided views of one output, no copy
            qkv = _project(self.qkv_proj, x)
            qg, k, v = qkv[:, :nq], qkv[:, nq:nq + nk], qkv[:, nq + nk:]
        else:
            qg = _project(self.q_proj, x)
            x = _tensor(x)
            k, v = self.k_proj(x), self.v_proj(x)
        q, gate = split_q_gate(qg, self.hq, self.d)                            # views [T, Hq, D]
        k, v = k.view(t, self.hkv, self.d), v.view(t, self.hkv, self.d)
        kc = vc = None
        if cache is not None:
            kc, vc = cache.k[self.layer], cache.v[self.layer]
        q, k = qk_norm_rope(q, k, self.q_norm.weight, self.k_norm.weight, batch.positions,
                            v=v if cache is not None else None, rotary_dim=self.rotary_dim, rope_theta=self.theta,
                            eps=self.eps, k_cache=kc, v_cache=vc,
                            slot_mapping=batch.kv_slots if cache is not None else None)
        if batch.decode:
            o = decode_attention(q, kc, vc, batch.seq_lens, batch.block_table, gate=gate)
        elif batch.has_prefix:              # continue cached sequences: keys = the cached prefix + the new ones
            ka = kc.view(-1, self.hkv, self.d)[batch.kv_gather]
            va = vc.view(-1, self.hkv, self.d)[batch.kv_gather]
            o = flash_attention(q, ka, va, gate=gate, cu_seqlens=batch.cu_seqlens, prefix_lens=batch.prefix_lens_t)
        else:
            o = flash_attention(q, k, v, gate=gate, cu_seqlens=batch.cu_seqlens)
        return self.o_proj(o.view(t, self.hq * self.d))


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet: projections, causal conv + SiLU over ``[q | k | v]``, the gated delta rule (chunked for a
    prefill, recurrent with fused gates for a decode step) on an fp32 state, gated RMSNorm, ``out_proj``."""

    def __init__(self, c: Config, layer: int):
        super().__init__()
        self.layer, self.eps = layer, c.rms_norm_eps
        self.nk, self.nv = c.linear_num_key_heads, c.linear_num_value_heads
        self.dk, self.dv = c.linear_key_head_dim, c.linear_value_head_dim
        h, kw = c.hidden_size, c.linear_conv_kernel_dim
        self.in_proj_qkv = Linear(h, c.conv_dim)
        self.in_proj_z = Linear(h, self.nv * self.dv)
        self.in_proj_b = Linear(h, self.nv)
        self.in_proj_a = Linear(h, self.nv)
        self.conv_weight = _placeholder(c.conv_dim, kw)      # HF conv1d.weight [C, 1, K], squeezed at load
        self.dt_bias, self.A_log = _placeholder(self.nv), _placeholder(self.nv)
        self.norm_weight = _placeholder(self.dv)              # plain w (not 1 + w)
        self.out_proj = Linear(self.nv * self.dv, h)
        self.in_proj_qkvz: Linear | None = None               # [qkv | z] and [b | a] in one GEMV each
        self.in_proj_ba: Linear | None = None                 # (fuse_input_projections)
        self.fused_decode = False                             # decode: deltanet.gated_delta_decode (one launch)

    def fuse_input_projections(self) -> list[str]:
        """Replace in_proj_qkv and in_proj_z by one ``in_proj_qkvz``, in_proj_b and in_proj_a by one
        ``in_proj_ba``, each pair where its weights are of one kind (a checkpoint keeps b / a in bf16, qkv / z in
        NVFP4: two launches instead of four); returns the fused groups' names."""
        done = []
        if self.in_proj_qkvz is None and (fused := fuse_linears([self.in_proj_qkv, self.in_proj_z])) is not None:
            self.in_proj_qkvz = fused
            del self.in_proj_qkv, self.in_proj_z
            done.append("in_proj_qkv|in_proj_z")
        if self.in_proj_ba is None and (fused := fuse_linears([self.in_proj_b, self.in_proj_a])) is not None:
            self.in_proj_ba = fused
            del self.in_proj_b, self.in_proj_a
            done.append("in_proj_b|in_proj_a")
        return done

    def _projections(self, x: torch.Tensor, gates: bool = True) -> tuple:
        """``(qkv [T, C], z [T, nv dv], b [T, nv], a [T, nv])``: strided views where the projections are fused;
        ``b`` and ``a`` None without ``gates``."""
        if self.in_proj_qkvz is not None:
            qkvz = _project(self.in_proj_qkvz, x)
            c = qkvz.shape[-1] - self.nv * self.dv
            qkv, z = qkvz[:, :c], qkvz[:, c:]
        else:
            qkv = _project(self.in_proj_qkv, x)
            z = self.in_proj_z(_tensor(x))
        x = _tensor(x)
        if not gates:
            return qkv, z, None, None
        if self.in_proj_ba is not None:
            ba = self.in_proj_ba(x)
            b, a = ba[:, :self.nv], ba[:, self.nv:]
        else:
            b, a = self.in_proj_b(x), self.in_proj_a(x)
        return qkv, z, b, a

    def _split(self, y: torch.Tensor) -> tuple:
        """Views q, k ``[..., nk, dk]`` and v ``[..., nv, dv]`` of the conv output ``y [..., C]`` (no copy)."""
        nq = self.nk * self.dk
        return (y[..., :nq].unflatten(-1, (self.nk, self.dk)), y[..., nq:2 * nq].unflatten(-1, (self.nk, self.dk)),
                y[..., 2 * nq:].unflatten(-1, (self.nv, self.dv)))

    def _gate_weights(self, dtype: torch.dtype) -> tuple | None:
        """``(a_weight, b_weight)`` ``[nv, H]`` where both are float tensors of ``dtype`` (views of ``in_proj_ba``
        when fused), for the fused decode step to project the gates itself; None otherwise (NVFP4 weights)."""
        if self.in_proj_ba is not None:
            w = self.in_proj_ba.weight
            ws = (w[self.nv:], w[:self.nv]) if isinstance(w, torch.Tensor) else None
        else:
            ws = (self.in_proj_a.weight, self.in_proj_b.weight)
        if ws is None or not all(isinstance(w, torch.Tensor) and w.dtype == dtype for w in ws):
            return None
        return ws

    def forward(self, x: torch.Tensor, batch: Batch, cache: Cache | None) -> torch.Tensor:
        t = x.shape[0]
        if batch.decode:
            gw = self._gate_weights(x.dtype) if self.fused_decode else None
            qkv, z, b, a = self._projections(x, gates=gw is None)
            x = _tensor(x)                                     # a PreNorm's normed rows, written by the GEMV
            if batch.unroll == 1:
                o = self._decode(qkv, z, b, a, x, gw, batch, cache)
            else:                                              # each sequence's T tokens as T decode steps
                n, u = t // batch.unroll, batch.unroll         # rows b-major: sequence i's token j is i * T + j
                o = torch.empty(n, u, self.nv * self.dv, dtype=x.dtype, device=x.device)
                for j in range(u):
                    pick = [None if v is None else v.view(n, u, -1)[:, j].contiguous() for v in (qkv, z, b, a, x)]
                    o[:, j] = self._decode(*pick, gw, batch, cache)
                    if j + 1 < u:
                        cache.snapshot(self.layer, j, batch.rows)
                o = o.view(t, -1)
            return self.out_proj(o)
        qkv, z, b, a = self._projections(x)                   # [1, T, ...]: the packed sequences
        conv0 = state0 = None
        if cache is not None:
            conv0, state0 = cache.conv[self.layer][batch.rows], cache.state[self.layer][batch.rows]
        y, conv1 = deltanet.causal_conv1d(qkv[None], self.conv_weight, conv0, cu_seqlens=batch.cu_seqlens)
        q, k, v = self._split(y)                                       # [1, T, heads, d]
        g, beta = deltanet.gates(self.A_log, a[None], self.dt_bias, b[None])        # fp32 [1, T, nv]
        if batch.valid is not None:           # padding rows: decay 1 (g = 0) and no write (beta = 0), so the
            m = batch.valid[None, :, None]    # state after them is the state after the last real token
            g, beta = g * m, beta * m
        o, state1 = deltanet.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state0,
                                                    output_final_state=cache is not None, use_qk_l2norm=True,
                                                    cu_seqlens=batch.cu_seqlens)
        if cache is not None:
            if batch.valid_len is not None:       # the last conv inputs of the real tokens, not the padding's
                conv1 = _last_inputs(qkv, conv0, batch.valid_len)
            cache.conv[self.layer][batch.rows] = conv1
            cache.state[self.layer][batch.rows] = state1
        z = z.view(1, t, self.nv, self.dv)
        o = deltanet.gated_rmsnorm(o, z, self.norm_weight, eps=self.eps)
        return self.out_proj(o.reshape(t, self.nv * self.dv))

    def _decode(self, qkv, z, b, a, x, gw, batch: Batch, cache: Cache) -> torch.Tensor:
        """One decode step of the sequences ``batch.rows`` (one row each): conv update, gates, delta rule, gated
        norm, in place on the cache's states; returns the rows before ``out_proj`` ``[N, nv dv]``."""
        n = qkv.shape[0]
        conv, state = cache.conv[self.layer][batch.rows], cache.state[self.layer][batch.rows]
        if self.fused_decode:                                  # the gates' projections (float weights), conv,
            proj = {} if gw is None else dict(x=x, a_weight=gw[0], b_weight=gw[1])   # gates, delta rule, gated
            o = deltanet.gated_delta_decode(qkv, z.view(n, self.nv, self.dv), a, b, conv, self.conv_weight,
                                            self.A_log, self.dt_bias, state, self.norm_weight, self.nk, eps=self.eps,
                                            states_early=True, **proj)   # norm: one launch; the projection just
            # before it is the packed GEMV (releases after its wait) or a launch without PDL, and this layer's
            # last step came before it: the kernel may load its states before its PDL wait
        else:
            y = deltanet.causal_conv1d_update(qkv, conv, self.conv_weight)            # rolls conv in place
            q, k, v = self._split(y[:, None])                              # [N, 1, heads, d]
            o, _ = deltanet.recurrent_gated_delta_rule_gates(
                q, k, v, self.A_log, a.view(n, 1, self.nv), self.dt_bias, b.view(n, 1, self.nv),
                initial_state=state, use_qk_l2norm=True, out_state=state)
            o = deltanet.gated_rmsnorm(o, z.view(n, 1, self.nv, self.dv), self.norm_weight, eps=self.eps)
        if not isinstance(batch.rows, slice):                 # gathered rows: write the new states back
            cache.conv[self.layer][batch.rows], cache.state[self.layer][batch.rows] = conv, state
        return o.reshape(n, self.nv * self.dv)


def _last_inputs(x: torch.Tensor, state0: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """The conv state after the first ``n`` rows of ``x [T, C]`` (``n`` int64 ``[1]`` on the device): the last ``S``
    raw inputs ``[1, C, S]``, taken from ``state0 [1, C, S]`` where ``n < S``. No value is read back."""
    s = state0.shape[-1]
    j = n + torch.arange(s, device=x.device)              # positions in [state0 | x]
    from_x = x.index_select(0, (j - s).clamp(min=0)).t()  # [C, S]
    from_state = state0[0].index_select(1, j.clamp(max=s - 1))
    return torch.where(j >= s, from_x, from_state)[None]


class MLP(nn.Module):
    """Dense SwiGLU ``down(silu(gate(x)) * up(x))`` (Qwen3.5 dense layers, Qwen3-Next ``mlp_only_layers``)."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj, self.up_proj = Linear(hidden, inter), Linear(hidden, inter)
        self.down_proj = Linear(inter, hidden)

    def forward(self, x):
        g = _project(self.gate_proj, x)
        return self.down_proj(F.silu(g) * self.up_proj(_tensor(x)))


class SparseMoE(nn.Module):
    """Router (run dtype), softmax top-k, the routed experts and the gated shared expert: one ``moe.moe_block``
    call.

    ``w13`` ``[E, 2I, H]`` (gate rows, then up rows) and ``w2`` ``[E, H, I]``: NVFP4 (a global scale per expert and
    shard) or float; ``shared`` a :class:`lynn_kernels.moe.SharedExpert` or None."""

    def __init__(self, c: Config):
        super().__init__()
        self.top_k, self.renormalize = c.num_experts_per_tok, c.norm_topk_prob
        e, i, h = c.num_experts, c.moe_intermediate_size, c.hidden_size
        self.router = _placeholder(e, h)
        self.w13, self.w2 = _placeholder(e, 2 * i, h), _placeholder(e, h, i)
        self.shared: moe.SharedExpert | None = None

    def forward(self, x):
        if isinstance(x, PreNorm) and x.x is None:            # the norm in the router's launch
            return x.take(moe.norm_moe_block(x.delta, x.norm.weight, self.router, self.w13, self.w2, self.shared,
                                             top_k=self.top_k, renormalize=self.renormalize, eps=x.norm.eps,
                                             residual=x.residual))
        return moe.moe_block(_tensor(x), self.router, self.w13, self.w2, self.shared, top_k=self.top_k,
                             renormalize=self.renormalize)


class DecoderLayer(nn.Module):
    def __init__(self, c: Config, i: int):
        super().__init__()
        mtp = i >= c.num_hidden_layers                        # an MTP layer: full attention, the model's FFN kind
        self.kind = "full_attention" if mtp else c.layer_types[i]
        if self.kind == "full_attention":
            self.self_attn = Attention(c, i)
        else:
            self.linear_attn = GatedDeltaNet(c, i)
        ffn = c.mtp_ffn if mtp else c.ffn_types[i]
        self.mlp = SparseMoE(c) if ffn == "moe" else MLP(c.hidden_size, c.intermediate_size)
        self.input_layernorm = Norm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = Norm(c.hidden_size, c.rms_norm_eps)

    @property
    def mixer(self) -> nn.Module:
        return self.self_attn if self.kind == "full_attention" else self.linear_attn

    def forward(self, x, h, batch: Batch, cache: Cache | None, next_norm: Norm):
        """``x = norm(h)`` in, ``(next_norm(h'), h')`` out: mixer and FFN, each added to the residual stream."""
        x, h = self.post_attention_layernorm(self.mixer(x, batch, cache), residual=h)
        return next_norm(self.mlp(x), residual=h)


class MTP(nn.Module):
    """The multi-token prediction module (``mtp.*``): from the trunk's final-normed hidden state at position ``p``
    and the embedding of token ``p + 1``, a guess of token ``p + 2``::

        x = fc([norm_e(embed(t[p+1])) | norm_h(hidden[p])]) -> full-attention layer -> norm -> the model's lm_head

    Its layer keeps keys and values in the cache under index ``num_hidden_layers + j``; it shares the embedding and
    the LM head with the trunk (vLLM's Qwen3-Next and Qwen3.5 MTP models)."""

    def __init__(self, c: Config):
        super().__init__()
        h = c.hidden_size
        self.fc = Linear(2 * h, h)
        self.pre_fc_norm_embedding, self.pre_fc_norm_hidden = Norm(h, c.rms_norm_eps), Norm(h, c.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(c, i) for i in c.mtp_attention_layers)
        self.norm = Norm(h, c.rms_norm_eps)


class Model(nn.Module):
    """The decoder. Build it with :func:`lynn_model.from_pretrained` (or :func:`lynn_model.loader.random_model`).

    * ``forward(input_ids [B, T]) -> logits [B, T, vocab]``: a full forward of B fresh sequences, no cache (the
      parity path);
    * ``step(tokens, cache, slots, new_lens)``: prefill or decode ``N`` cached sequences in one packed call.
    """

    def __init__(self, config: Config, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.config, self.dtype = config, dtype
        c = config
        self.embed_tokens = _placeholder(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c, i) for i in range(c.num_hidden_layers))
        self.norm = Norm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = Linear(c.hidden_size, c.vocab_size)
        self.mtp = MTP(c) if c.mtp_layers else None
        #: the head the MTP module's drafts read (None: ``lm_head``); :func:`lynn_model.loader.quantize_draft_head`
        self.draft_head: Linear | None = None
        self.fused_norms = False                               # decode: each norm in the next block's first launch

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.device

    def fuse_input_projections(self) -> dict[str, int]:
        """Stack each mixer's projections of its input into one GEMV where their weights are of one kind
        (attention ``q | k | v``; Gated DeltaNet ``qkv | z`` and ``b | a``), exactly (per-row global scales kept).
        In place, once, after loading; returns how many layers each group was fused in. Fewer launches per step;
        the products are the same per row, but a kernel picks its split-K or its step width from the output's
        width and may sum a row's partials in another grouping, so a fused model is not bit-equal to the unfused
        one (docs/decoder.md)."""
        counts: dict[str, int] = {}
        for layer in self.layers:
            for name in layer.mixer.fuse_input_projections():
                counts[name] = counts.get(name, 0) + 1
        return counts

    def fuse_for_decode(self) -> dict[str, int]:
        """The form the loaders give on a GPU (``fuse``) and ``lynn generate`` runs: :meth:`fuse_input_projections`,
        then :meth:`fuse_gdn_decode`; how many layers each fusion took (the Gated DeltaNet step's under "gdn decode
        step"; nothing where the model is fused already)."""
        counts = self.fuse_input_projections()
        if n := self.fuse_gdn_decode():
            counts["gdn decode step"] = n
        return counts

    def fuse_gdn_decode(self, enabled: bool = True) -> int:
        """Run each Gated DeltaNet layer's decode step (conv update, gates, delta rule, gated norm) as one kernel,
        :func:`lynn_kernels.deltanet.gated_delta_decode`, instead of three; returns how many layers. The same
        operations and roundings; its sums run over a wider tile, so on a GPU the result may differ from the
        three-kernel chain's in the last bit (docs/decoder.md); where the gates' weights are float, the kernel
        projects them itself (one launch fewer). The loaders turn it on with the input projections on a GPU
        (their ``fuse`` argument), where it measured faster (docs/history/decode.md); ``fuse=False`` leaves it off."""
        n = 0
        for layer in self.layers:
            if layer.kind != "full_attention":
                layer.linear_attn.fused_decode = bool(enabled)
                n += 1
        return n

    def fuse_norms(self, enabled: bool = True) -> int:
        """In a decode step, run each layer norm (and its residual add) inside the launch of the first kernel of
        the block after it: the mixer's first input projection where it is a packed NVFP4 GEMV on the FMA units
        (one or two rows), the MoE block's router (:class:`PreNorm`); elsewhere the norm kernel runs as before.
        The same operations and roundings as the norm kernel (bit-equal under the interpreter; docs/decoder.md);
        returns how many norms can fold (two a layer; the final norm stays). Only steps of at most
        :data:`FOLD_NORMS_MAX_ROWS` sequences fold. Off by default: on the H200 it measured no faster than the norm
        kernels under PDL (docs/history/decode.md, "The norms folded")."""
        self.fused_norms = bool(enabled)
        return 2 * len(self.layers) if enabled else 0

    def _trunk(self, ids: torch.Tensor, batch: Batch, cache: Cache | None) -> torch.Tensor:
        """``ids [T]`` -> the final-normed hidden states ``[T, H]``; residual adds fused into the norms."""
        h = F.embedding(ids, self.embed_tokens)
        if self.fused_norms and batch.decode and ids.shape[0] <= FOLD_NORMS_MAX_ROWS:
            return self._trunk_prenorm(h, batch, cache)
        x = self.layers[0].input_layernorm(h)
        for i, layer in enumerate(self.layers):
            x, h = layer(x, h, batch, cache, self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else
                         self.norm)
        return x

    def _trunk_prenorm(self, h: torch.Tensor, batch: Batch, cache: Cache | None) -> torch.Tensor:
        """:meth:`_trunk` with each norm handed to the block after it (:meth:`fuse_norms`)."""
        pending = PreNorm(h, None, self.layers[0].input_layernorm)
        for i, layer in enumerate(self.layers):
            out = layer.mixer(pending, batch, cache)
            pending = PreNorm(out, pending.h, layer.post_attention_layernorm)
            out = layer.mlp(pending)
            if i + 1 < len(self.layers):
                pending = PreNorm(out, pending.h, self.layers[i + 1].input_layernorm)
            else:
                x, _ = self.norm(out, residual=pending.h)
        return x

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, T, vocab]`` (run dtype) of ``B`` fresh sequences of ``T`` tokens, without a cache."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.int64:
            raise ValueError(f"input_ids must be an int64 [B, T] tensor, got "
                             f"{getattr(input_ids, 'dtype', type(input_ids))} {tuple(getattr(input_ids, 'shape', ()))}")
        bsz, t = input_ids.shape
        _check_ids(input_ids, self.config.vocab_size)
        batch = Batch.uncached([t] * bsz, self.device)
        x = self._trunk(input_ids.reshape(-1).to(self.device), batch, None)
        return self.lm_head(x).view(bsz, t, -1)

    def new_cache(self, max_batch: int, max_tokens: int, page_size: int = 16) -> Cache:
        """A :class:`Cache` for this model (its dtype and device)."""
        return Cache(self.config, max_batch=max_batch, max_tokens=max_tokens, page_size=page_size,
                     dtype=self.dtype, device=self.device)

    def step(self, tokens: torch.Tensor, cache: Cache, slots: list[int], new_lens: list[int], *,
             all_logits: bool = False, unroll: bool = False, hidden: bool = False):
        """Run ``new_lens[b]`` new tokens of each sequence ``slots[b]`` (packed in ``tokens``, int64 ``[T]``) and
        advance the cache. Returns the logits of each sequence's last token ``[N, vocab]`` (``all_logits``: every
        row, ``[T, vocab]``); with ``hidden``, ``(logits, final-normed hidden states [T, H])`` (what the MTP module
        reads). A decode step when every sequence adds one token to a non-empty past; ``unroll``: each sequence's
        ``U`` tokens run as ``U`` decode steps in one call (the same arithmetic per token; a speculative verify,
        which :meth:`Cache.rollback` can cut short), each row summed as a decode step of ``len(slots)`` rows sums
        it, or of an outer :func:`lynn_kernels.as_batch`'s rows (a batch that decodes in a larger bucket)."""
        self._check_step(tokens, cache, new_lens)
        batch = cache.plan(list(slots), list(new_lens), unroll=unroll)
        as_rows = lynn_kernels.runtime.batch_rows(len(slots)) if unroll else None
        try:
            # trusted: the token ids are checked above; every other value the layers could check by reading it back
            # (cache slots, positions, offsets, routing) the model makes itself, and each read-back is a host sync
            # that lets the GPU drain (docs/decoder.md, "Host syncs")
            # unrolled: each row computed as the decode step of len(slots) rows (or an outer as_batch's) computes it
            with lynn_kernels.trusted(), lynn_kernels.as_batch(as_rows):
                x = self._trunk(tokens.to(self.device), batch, cache)
        except BaseException:
            cache.mark_broken(list(slots))            # some layers already wrote their states
            raise
        cache.advance(list(slots), list(new_lens), unroll=unroll)
        with lynn_kernels.as_batch(as_rows):
            logits = self.lm_head(x if all_logits else x[batch.last_rows])
        return (logits, x) if hidden else logits

    def mtp_step(self, tokens: torch.Tensor, hidden: torch.Tensor, cache: Cache, slots: list[int],
                 new_lens: list[int], starts: list[int], *, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP module on ``new_lens[b]`` positions of each sequence from ``starts[b]``: ``tokens [T]`` the token
        after each position, ``hidden [T, H]`` the hidden state at it (the trunk's, or this module's own for a
        draft after a draft). Writes the MTP layer's keys and values; the trunk's states and lengths stay.
        Returns ``(logits of each sequence's last position [N, vocab], hidden states [T, H])``."""
        if self.mtp is None:
            raise ValueError(f"{self.config.name or self.config.family}: this model has no MTP module (its checkpoint "
                             f"holds no mtp.* tensors)")
        self._check_step(tokens, cache, new_lens)
        if hidden.shape != (tokens.numel(), self.config.hidden_size):
            raise ValueError(f"hidden has shape {list(hidden.shape)}; expected [{tokens.numel()}, "
                             f"{self.config.hidden_size}] (one row per token)")
        batch = cache.plan(list(slots), list(new_lens), starts=list(starts))
        with lynn_kernels.trusted():
            x = self._mtp(tokens.to(self.device), hidden, batch, cache, layer)
        return self.draft_logits(x[batch.last_rows]), x

    def draft_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The MTP module's logits of rows ``x``: through :attr:`draft_head` where there is one, else the LM head."""
        return (self.lm_head if self.draft_head is None else self.draft_head)(x)

    def _mtp(self, tokens: torch.Tensor, hidden: torch.Tensor, batch: Batch, cache: Cache, layer: int = 0):
        """The MTP module's rows ``[T, H]`` before the LM head (:meth:`mtp_step`)."""
        m = self.mtp
        e = m.pre_fc_norm_embedding(F.embedding(tokens, self.embed_tokens))
        h = m.fc(torch.cat([e, m.pre_fc_norm_hidden(hidden)], dim=-1))      # [embedding | hidden], in that order
        mtp_layer = m.layers[layer]
        x, _ = mtp_layer(mtp_layer.input_layernorm(h), h, batch, cache, m.norm)
        return x

    def _check_step(self, tokens: torch.Tensor, cache: Cache, new_lens: list[int]) -> None:
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1 or tokens.dtype != torch.int64:
            raise ValueError(f"tokens must be an int64 [T] tensor, got {getattr(tokens, 'dtype', type(tokens))}")
        if tokens.numel() != sum(new_lens):
            raise ValueError(f"tokens has {tokens.numel()} entries; new_lens {new_lens} sum to {sum(new_lens)}")
        _check_ids(tokens, self.config.vocab_size)
        if cache.config != self.config or cache.dtype != self.dtype or cache.device != self.device:
            raise ValueError(f"cache was built for another model ({cache.config.name or cache.config.family}, "
                             f"{cache.dtype}, {cache.device}); this model is {self.config.name or self.config.family}"
                             f", {self.dtype}, {self.device}: use model.new_cache(...)")


def _check_ids(ids: torch.Tensor, vocab: int) -> None:
    if ids.numel() and lynn_kernels.runtime.values_checkable():
        lo, hi = (int(v) for v in torch.aminmax(ids))
        if lo < 0 or hi >= vocab:
            raise ValueError(f"token ids must lie in [0, {vocab}), found min {lo}, max {hi}")
