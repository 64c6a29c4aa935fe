"""The executable spec of Gated DeltaNet in plain torch (fp32 math): the delta rule step by step, its chunked
(WY / UT) form, the gates, the causal conv and the gated RMSNorm.

Each function takes the same arguments in the same order as its kernel in :mod:`lynn_kernels.deltanet` and returns
the same thing. Layouts are in :mod:`.spec`; docs/deltanet.md derives the chunked form. With ``cu_seqlens`` (packed
sequences) the spec is a loop: each sequence run on its own, as a batch of one, from its own row of the state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import spec
from .spec import CHUNK, L2NORM_EPS


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """``x * rsqrt(sum(x^2) + 1e-6)`` over the last dim, as HF's ``l2norm`` and fla."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def _heads_first(q, k, v, g, beta, dims: spec.Dims, scale, use_qk_l2norm: bool):
    """fp32 ``[B, HV, T, D]`` copies with q/k repeated onto the value heads, normalised and q scaled."""
    q, k = (x.float().repeat_interleave(dims.group, dim=2) for x in (q, k))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * (dims.K ** -0.5 if scale is None else scale)
    q, k, v = (x.transpose(1, 2).float() for x in (q, k, v))    # [B, HV, T, D]
    g, beta = (x.transpose(1, 2).float() for x in (g, beta))    # [B, HV, T]
    return q, k, v, g, beta


def _start_state(initial_state, dims: spec.Dims, device) -> torch.Tensor:
    if initial_state is None:
        return torch.zeros(dims.B, dims.HV, dims.K, dims.V, dtype=torch.float32, device=device)
    return initial_state.float().clone()


def _finish(o: torch.Tensor, state: torch.Tensor, dtype: torch.dtype, output_final_state: bool, out_state):
    """``o [B, HV, T, V]`` -> ``[B, T, HV, V]`` in ``dtype`` (the input v's); the state returned (and written to
    ``out_state``)."""
    o = o.transpose(1, 2).contiguous().to(dtype)
    if out_state is not None:
        out_state.copy_(state)
        state = out_state
    return o, (state if output_final_state or out_state is not None else None)


def recurrent_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm=False, *, out_state=None):
    """The gated delta rule one token at a time (the spec). Per value head, state ``S [K, V]`` in fp32::

        S   = exp(g_t) * S                       # forget
        d   = beta_t * (v_t - S^T k_t)           # delta: what the memory gets wrong about v_t
        S   = S + k_t d^T                        # write the correction
        o_t = S^T q_t                            # read

    Shapes: q, k ``[B, T, H, K]``; v ``[B, T, HV, V]``; g, beta ``[B, T, HV]``; state ``[B, HV, K, V]`` fp32.
    Returns ``(o [B, T, HV, V] in v's dtype, final_state or None)``; ``out_state`` receives the final state (and is
    then returned even without ``output_final_state``).
    """
    dims = spec.check_delta_rule(q, k, v, g, beta, scale, initial_state, out_state)
    dtype = v.dtype
    q, k, v, g, beta = _heads_first(q, k, v, g, beta, dims, scale, use_qk_l2norm)
    S = _start_state(initial_state, dims, v.device)                    # [B, HV, K, V]
    o = torch.empty_like(v)
    for t in range(dims.T):
        S = S * g[:, :, t, None, None].exp()
        delta = (v[:, :, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, :, t])) * beta[:, :, t, None]
        S = S + k[:, :, t, :, None] * delta[:, :, None, :]
        o[:, :, t] = torch.einsum("bhkv,bhk->bhv", S, q[:, :, t])
    return _finish(o, S, dtype, output_final_state, out_state)


def _per_sequence(fn, dims: spec.Dims, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm,
                  out_state):
    """``fn`` on each packed sequence ``cu[n]:cu[n+1]`` alone (B = 1, state row ``n``): the spec of ``cu_seqlens``."""
    outs, states = [], []
    for n, (a, b) in enumerate(zip(dims.cu, dims.cu[1:])):
        h0 = None if initial_state is None else initial_state[n:n + 1]
        o, s = fn(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], scale, h0, True, use_qk_l2norm)
        outs.append(o)
        states.append(s)
    o, state = torch.cat(outs, dim=1), torch.cat(states)             # [1, T, HV, V], [N, HV, K, V]
    if out_state is not None:
        out_state.copy_(state)
        state = out_state
    return o, (state if output_final_state or out_state is not None else None)


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm=False, *, out_state=None, cu_seqlens=None):
    """The same result as :func:`recurrent_gated_delta_rule`, computed in chunks of 64 (the WY / UT form).

    Inside a chunk, with ``G`` the cumulative sum of ``g`` from the chunk start and ``S0`` the state before it::

        A  = strictly_lower(beta_i k_i.k_j exp(G_i - G_j))        # [64, 64]
        w  = (I + A)^-1 (beta exp(G) k),   u = (I + A)^-1 (beta v)
        v' = u - w S0                                              # the deltas of the chunk
        o  = (exp(G) q) S0 + lower(q_i.k_j exp(G_i - G_j)) v'
        S  = exp(G_last) S0 + (exp(G_last - G) k)^T v'

    Only differences of cumulative sums are exponentiated (every exponent is <= 0 when g <= 0).

    With ``cu_seqlens`` (int32 ``[N+1]``; q ``[1, T, H, K]``, states ``[N, HV, K, V]``) each sequence is run alone,
    its chunks of 64 counted from its own first token (fla's convention).
    """
    dims = spec.check_delta_rule(q, k, v, g, beta, scale, initial_state, out_state, cu_seqlens)
    if dims.cu is not None:
        return _per_sequence(chunk_gated_delta_rule, dims, q, k, v, g, beta, scale, initial_state,
                             output_final_state, use_qk_l2norm, out_state)
    dtype = v.dtype
    q, k, v, g, beta = _heads_first(q, k, v, g, beta, dims, scale, use_qk_l2norm)
    pad = (-dims.T) % CHUNK                                           # zero q/k/v/beta and g=0 past the end
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (dims.T + pad) // CHUNK
    q, k, v = (x.unflatten(2, (n, CHUNK)) for x in (q, k, v))         # [B, HV, N, C, D]
    g, beta = (x.unflatten(2, (n, CHUNK)) for x in (g, beta))         # [B, HV, N, C]

    G = g.cumsum(-1)
    lower = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    diff = (G[..., :, None] - G[..., None, :]).masked_fill(~lower, float("-inf"))
    decay = diff.exp()                                               # exp(G_i - G_j) for i >= j, else 0
    eye = torch.eye(CHUNK, dtype=torch.float32, device=q.device)
    A = (beta[..., :, None] * (k @ k.transpose(-1, -2)) * decay).tril(-1)
    w = torch.linalg.solve_triangular(eye + A, k * (beta * G.exp())[..., None], upper=False)
    u = torch.linalg.solve_triangular(eye + A, v * beta[..., None], upper=False)
    attn = (q @ k.transpose(-1, -2)) * decay                         # [B, HV, N, C, C]

    S = _start_state(initial_state, dims, v.device)
    o = torch.empty_like(v)
    for c in range(n):
        v_new = u[:, :, c] - w[:, :, c] @ S
        o[:, :, c] = (q[:, :, c] * G[:, :, c, :, None].exp()) @ S + attn[:, :, c] @ v_new
        g_last = G[:, :, c, -1, None, None]
        k_decayed = k[:, :, c] * (g_last - G[:, :, c, :, None]).exp()
        S = S * g_last.exp() + k_decayed.transpose(-1, -2) @ v_new
    o = o.flatten(2, 3)[:, :, :dims.T]
    return _finish(o, S, dtype, output_final_state, out_state)


def gates(A_log, a, dt_bias, b):
    """The gates of a Qwen3-Next / Qwen3.5 layer, in fp32: ``g = -exp(A_log) * softplus(a + dt_bias)`` and
    ``beta = sigmoid(b)``. ``A_log, dt_bias [HV]``; ``a, b [B, T, HV]``. Returns ``(g, beta)``, both fp32."""
    spec.check_gate_inputs(A_log, a, dt_bias, b)
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, torch.sigmoid(b.float())


def recurrent_gated_delta_rule_gates(q, k, v, A_log, a, dt_bias, b, scale=None, initial_state=None,
                                     output_final_state=False, use_qk_l2norm=False, *, out_state=None):
    """:func:`recurrent_gated_delta_rule` with the gates computed from the layer's raw inputs (see :func:`gates`)."""
    spec.check_delta_rule_gates(q, k, v, A_log, a, dt_bias, b, scale, initial_state, out_state)
    g, beta = gates(A_log, a, dt_bias, b)
    return recurrent_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm,
                                      out_state=out_state)


def causal_conv1d(x, weight, initial_state=None, *, cu_seqlens=None):
    """Depthwise causal conv1d then SiLU over ``x [B, T, C]`` with ``weight [C, W]`` (no bias), in fp32.

    ``y[t, c] = silu(sum_w weight[c, w] * x[t - W + 1 + w, c])``, the inputs before ``t = 0`` taken from
    ``initial_state [B, C, S]`` (its last column is the newest) or zeros. Returns ``(y [B, T, C]`` in x's dtype,
    ``final_state [B, C, S])``: the last ``S`` inputs (``S = W - 1`` without an initial state), raw, in x's dtype.

    With ``cu_seqlens`` (int32 ``[N+1]``; x ``[1, T, C]``, states ``[N, C, S]``) each sequence is convolved alone.
    """
    B, T, C, W, S, cu = spec.check_conv(x, weight, initial_state, cu_seqlens)
    if cu is not None:
        ys, states = [], []
        for n, (a, b) in enumerate(zip(cu, cu[1:])):
            y, s = causal_conv1d(x[:, a:b], weight, None if initial_state is None else initial_state[n:n + 1])
            ys.append(y)
            states.append(s)
        return torch.cat(ys, dim=1), torch.cat(states)               # [1, T, C], [N, C, S]
    prev = (initial_state if initial_state is not None
            else torch.zeros(B, C, S, dtype=x.dtype, device=x.device))
    if T == 0:                                                       # nothing to convolve: the state passes through
        return x.clone(), prev.clone(memory_format=torch.contiguous_format)
    full = torch.cat([prev.transpose(1, 2), x], dim=1)               # [B, S + T, C], oldest first
    windows = full[:, S - (W - 1):].float().unfold(1, W, 1)           # [B, T, C, W]
    y = F.silu((windows * weight.float()).sum(-1))
    return y.to(x.dtype), full[:, full.shape[1] - S:].transpose(1, 2).contiguous()


def causal_conv1d_update(x, conv_state, weight):
    """One decode step of :func:`causal_conv1d`: ``x [B, C]``; ``conv_state [B, C, S]`` is rolled in place (oldest
    column dropped, ``x`` appended). Returns ``y [B, C]`` in x's dtype."""
    B, C, W, S = spec.check_conv_update(x, conv_state, weight)
    window = torch.cat([conv_state[:, :, S - (W - 1):], x[:, :, None]], dim=-1).float()   # [B, C, W]
    y = F.silu((window * weight.float()).sum(-1))
    conv_state.copy_(torch.cat([conv_state[:, :, 1:], x[:, :, None]], dim=-1))
    return y.to(x.dtype)


def gated_rmsnorm(x, z, weight, eps=1e-6):
    """``weight * rmsnorm(x) * silu(z)`` over the last dim, in HF's order and dtypes (``Qwen3NextRMSNormGated``):
    the normalised ``x`` is rounded to x's dtype before ``weight`` multiplies it (in the promoted dtype of the two),
    the gate is applied in fp32, and the result is x's dtype. ``x, z [..., D]``, ``weight [D]``."""
    spec.check_gated_rmsnorm(x, z, weight, eps)
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * normed.to(x.dtype)
    return (h * F.silu(z.float())).to(x.dtype)


def gated_delta_decode(qkv, z, a, b, conv_state, conv_weight, A_log, dt_bias, state, norm_weight, num_k_heads,
                       eps=1e-6, *, x=None, a_weight=None, b_weight=None, states_early=False):
    """A Gated DeltaNet layer's decode step between its input projections and ``out_proj``, the states updated in
    place: :func:`causal_conv1d_update` of ``qkv [B, C]`` (``C = 2 H K + HV V``, ``H = num_k_heads``), its output
    split into q, k ``[B, 1, H, K]`` and v ``[B, 1, HV, V]``, :func:`recurrent_gated_delta_rule_gates` on them with
    the l2-normed q / k and ``state [B, HV, K, V]`` fp32, then :func:`gated_rmsnorm` of the result with
    ``z [B, HV, V]``. ``a, b [B, HV]``, or ``a = F.linear(x, a_weight)`` and ``b = F.linear(x, b_weight)``.
    ``states_early`` is the kernel's scheduling promise under programmatic launches: nothing to do here.
    Returns ``[B, HV, V]`` in qkv's dtype."""
    dims = spec.check_decode_step(qkv, z, a, b, conv_state, conv_weight, A_log, dt_bias, state, norm_weight,
                                  num_k_heads, eps, x=x, a_weight=a_weight, b_weight=b_weight)
    if x is not None:
        a, b = F.linear(x, a_weight), F.linear(x, b_weight)
    B, H, HV, K, V = dims.B, dims.H, dims.HV, dims.K, dims.V
    y = causal_conv1d_update(qkv, conv_state, conv_weight)
    q = y[:, :H * K].reshape(B, 1, H, K)
    k = y[:, H * K:2 * H * K].reshape(B, 1, H, K)
    v = y[:, 2 * H * K:].reshape(B, 1, HV, V)
    o, _ = recurrent_gated_delta_rule_gates(q, k, v, A_log, a[:, None], dt_bias, b[:, None], initial_state=state,
                                            use_qk_l2norm=True, out_state=state)
    return gated_rmsnorm(o[:, 0], z, norm_weight, eps)
