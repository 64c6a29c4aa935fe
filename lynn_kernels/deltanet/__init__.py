"""Gated DeltaNet (Qwen3-Next, Qwen3.5 / 3.6 linear-attention layers): the delta rule, its conv and its norm.

Public ops (names, argument order and return values are a contract; each has a torch reference of the same
signature in :mod:`.reference`; layouts in :mod:`.spec`, math in docs/deltanet.md):

* ``chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
  use_qk_l2norm=False, *, out_state=None) -> (o, final_state)``: prefill, chunks of 64 (WY / UT form);
* ``recurrent_gated_delta_rule(...)``, same arguments: token by token (decode; any T);
* ``recurrent_gated_delta_rule_gates(q, k, v, A_log, a, dt_bias, b, scale=None, initial_state=None,
  output_final_state=False, use_qk_l2norm=False, *, out_state=None)``: the decode step with the gates
  ``g = -exp(A_log) softplus(a + dt_bias)``, ``beta = sigmoid(b)`` computed in the same kernel (one launch);
* ``gates(A_log, a, dt_bias, b) -> (g, beta)``: those gates in torch, for the chunked path;
* ``causal_conv1d(x, weight, initial_state=None) -> (y, final_state)`` and
  ``causal_conv1d_update(x, conv_state, weight) -> y`` (rolls ``conv_state`` in place);
* ``gated_rmsnorm(x, z, weight, eps=1e-6)``.

Shapes: q, k ``[B, T, H, K]``; v ``[B, T, HV, V]`` (HV a multiple of H); g, beta ``[B, T, HV]``; the recurrent state
``[B, HV, K, V]`` is always fp32; o ``[B, T, HV, V]`` in v's dtype. ``final_state`` is ``None`` unless
``output_final_state`` (or ``out_state``, which receives it; it may be ``initial_state`` for an in-place step).

Example (a Qwen3.5 layer's core on the CPU interpreter)::

    import torch, torch.nn.functional as F
    from lynn_kernels import deltanet
    B, T, H, HV, D = 1, 100, 2, 4, 64
    q, k = torch.randn(B, T, H, D), torch.randn(B, T, H, D)
    v = torch.randn(B, T, HV, D)
    g, beta = F.logsigmoid(torch.randn(B, T, HV)), torch.rand(B, T, HV)
    o, state = deltanet.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, use_qk_l2norm=True)
    o1, state = deltanet.recurrent_gated_delta_rule(q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1],
                                                    initial_state=state, output_final_state=True,
                                                    use_qk_l2norm=True)
"""

from .. import runtime
from . import reference, spec
from .reference import gates
from .spec import CHUNK
from .triton_chunk import chunk_gated_delta_rule_triton
from .triton_conv import causal_conv1d_triton, causal_conv1d_update_triton
from .triton_norm import gated_rmsnorm_triton
from .triton_recurrent import recurrent_gated_delta_rule_gates_triton, recurrent_gated_delta_rule_triton

chunk_gated_delta_rule = runtime.op(reference=reference.chunk_gated_delta_rule)(chunk_gated_delta_rule_triton)
recurrent_gated_delta_rule = runtime.op(reference=reference.recurrent_gated_delta_rule)(
    recurrent_gated_delta_rule_triton)
recurrent_gated_delta_rule_gates = runtime.op(reference=reference.recurrent_gated_delta_rule_gates)(
    recurrent_gated_delta_rule_gates_triton)
causal_conv1d = runtime.op(reference=reference.causal_conv1d)(causal_conv1d_triton)
causal_conv1d_update = runtime.op(reference=reference.causal_conv1d_update)(causal_conv1d_update_triton)
gated_rmsnorm = runtime.op(reference=reference.gated_rmsnorm)(gated_rmsnorm_triton)

__all__ = ["chunk_gated_delta_rule", "recurrent_gated_delta_rule", "recurrent_gated_delta_rule_gates", "gates",
           "causal_conv1d", "causal_conv1d_update", "gated_rmsnorm", "reference", "spec", "CHUNK"]
