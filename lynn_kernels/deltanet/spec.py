"""Shapes, limits, argument checks and small helpers shared by the Gated DeltaNet references and kernels.

Both the torch reference and the Triton host functions call these checks, so a bad argument raises the same error,
naming the tensor, what was expected and what was found, on every backend. As in the rest of the project
(``nvfp4``, ``matmul``, ``attention``): ``TypeError`` for a wrong type or dtype, ``ValueError`` for a wrong shape,
value or device.

Layouts (as HF transformers and fla, "head last"):

* ``q, k``  ``[B, T, H, K]``    query / key, ``H`` query-key heads;
* ``v``     ``[B, T, HV, V]``   values, ``HV`` value heads, a multiple of ``H`` (value head ``h`` reads QK head
  ``h // (HV // H)``, as ``repeat_interleave`` would, but without the copy);
* ``g, beta`` ``[B, T, HV]``    log-decay (``<= 0``) and the delta-rule step size;
* state     ``[B, HV, K, V]``   fp32, ``S^T q`` is the output (``K`` rows, ``V`` columns);
* conv: ``x [B, T, C]``, ``weight [C, W]``, conv state ``[B, C, S]`` with ``S >= W - 1`` (oldest input first).

Packed sequences (``cu_seqlens``, int32 ``[N+1]``, ``0 = cu[0] <= ... <= cu[N] = T``): the inputs hold ``B = 1`` row
of ``T`` tokens, sequence ``n`` is tokens ``cu[n]:cu[n+1]`` (it may be empty), and every state has one row per
sequence: ``[N, HV, K, V]``, conv ``[N, C, S]``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch
import triton.language as tl

from .. import runtime
from ..norm.spec import overlaps, same_view

#: Chunk length of the chunked (WY / UT) prefill.
CHUNK = 64
#: Largest head dim the kernels hold in registers (Qwen3-Next / Qwen3.5 use 128).
MAX_HEAD_DIM = 256
#: Conv kernel widths the kernels support (Qwen3-Next / Qwen3.5 use 4).
MIN_CONV_WIDTH, MAX_CONV_WIDTH = 2, 8
#: L2-norm epsilon of q and k (HF ``l2norm``, fla): ``x * rsqrt(sum(x^2) + eps)``.
L2NORM_EPS = 1e-6

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# --- for the kernels ------------------------------------------------------------------------------------------

#: :data:`L2NORM_EPS` as a kernel constant.
TL_L2NORM_EPS = tl.constexpr(L2NORM_EPS)
#: ``tl.sum``'s own combine function: ``tl.reduce(x, axis, TL_SUM)`` compiles to the same reduction, and the
#: interpreter maps it straight to ``np.sum``, while ``tl.sum`` (itself a @jit function) costs ~2 ms a call there
#: (in the token loop and the forward substitution).
TL_SUM = tl.standard._sum_combine


def last_dim_contiguous(t: torch.Tensor | None) -> torch.Tensor | None:
    """Kernels take any strides but need the last dim contiguous (a split of a fused projection already is)."""
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


@functools.lru_cache(maxsize=256)
def packed_blocks(cu: tuple[int, ...], block: int, device: torch.device, empty_block: bool = False):
    """The block table of packed sequences at offsets ``cu`` (host ints), for kernels that give each program
    ``block`` tokens of one sequence. Returns int32 tensors on ``device``, built once per layout (a host-to-device
    copy of a fresh tensor waits for the stream; the kernels only read them):

    * ``cu`` ``[N+1]``: the offsets;
    * ``index`` ``[NB, 2]``: row ``i`` is (sequence ``n``, block ``j`` of it, tokens ``cu[n] + j * block`` up to
      ``min(cu[n] + (j + 1) * block, cu[n+1])``), sequences in order;
    * ``first`` ``[N+1]``: the row of ``index`` where sequence ``n``'s blocks start (``first[N] = NB``).

    A sequence of ``L`` tokens has ``cdiv(L, block)`` blocks; with ``empty_block`` an empty one still gets one
    block, holding no token (the conv kernel writes each sequence's final state from its first block).
    """
    index, first = [], [0]
    for n, (a, b) in enumerate(zip(cu, cu[1:])):
        blocks = -(-(b - a) // block)
        index.extend((n, j) for j in range(max(blocks, 1) if empty_block else blocks))
        first.append(len(index))
    as_int32 = functools.partial(torch.tensor, dtype=torch.int32, device=device)
    return as_int32(cu), as_int32(index).reshape(-1, 2), as_int32(first)


def check_devices(**tensors) -> None:
    """Every given tensor is on the device the kernels run on (the reference backend skips this). Anything that is not
    a tensor is left to the argument checks, so the host functions may run this first, before any value is read."""
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor):
            runtime.check_device(name, t)


# --- argument checks --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Dims:
    B: int
    T: int
    H: int
    HV: int
    K: int
    V: int
    #: ``cu_seqlens`` read to the host (``N+1`` offsets of the packed sequences), or None (``B`` sequences).
    cu: tuple[int, ...] | None = None

    @property
    def group(self) -> int:
        """Value heads per query/key head."""
        return self.HV // self.H

    @property
    def N(self) -> int:
        """Rows of the recurrent state: one per sequence (``B``, or the packed sequences of ``cu_seqlens``)."""
        return self.B if self.cu is None else len(self.cu) - 1


def _need_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def _need_float(name: str, t: torch.Tensor, allowed=FLOAT_DTYPES) -> None:
    if t.dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        raise TypeError(f"{name} has dtype {t.dtype}; expected one of {names}")


def _need_shape(name: str, t: torch.Tensor, shape: tuple, layout: str) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {layout} = {tuple(shape)}, found {tuple(t.shape)}")


def _need_same_device(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device} but {ref_name} is on {ref.device}; all inputs must share a device")


def _need_head_dim(tensor: str, what: str, name: str, d: int) -> None:
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"{tensor}: {what} head dim {name}={d} is unsupported: the kernels support "
                         f"1..{MAX_HEAD_DIM}")


def check_state(name: str, s, dims: Dims, ref: torch.Tensor) -> None:
    """A recurrent state: fp32 ``[B, HV, K, V]`` (``[N, HV, K, V]`` with ``cu_seqlens``) on ``ref``'s device."""
    if s is None:
        return
    _need_tensor(name, s)
    layout = "[B, HV, K, V]" if dims.cu is None else "[N, HV, K, V] (one row per sequence of cu_seqlens)"
    _need_shape(name, s, (dims.N, dims.HV, dims.K, dims.V), layout)
    if s.dtype != torch.float32:
        raise TypeError(f"{name} has dtype {s.dtype}; the recurrent state is always float32 "
                        f"(a bf16/fp16 state measurably hurts accuracy)")
    _need_same_device(name, s, "q", ref)
    if name == "out_state" and not s.is_contiguous():
        raise ValueError(f"out_state must be contiguous (it is written in place), found strides {tuple(s.stride())}")


def _need_number(name: str, x, what: str) -> None:
    if isinstance(x, (torch.Tensor, bool)) or not isinstance(x, (int, float)):
        raise TypeError(f"{name} must be {what}, got {type(x).__name__} {x!r}")


def check_scale(scale) -> None:
    if scale is None:
        return
    _need_number("scale", scale, "a positive finite Python number or None (1/sqrt(K))")
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a positive finite Python number or None (1/sqrt(K)), got {scale!r}")


def check_qkv(q, k, v) -> Dims:
    """``q, k [B, T, H, K]``, ``v [B, T, HV, V]``, one float dtype, ``HV`` a multiple of ``H``."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _need_tensor(name, t)
        if t.dim() != 4:
            layout = "[B, T, HV, V]" if name == "v" else "[B, T, H, K]"
            raise ValueError(f"{name} must be 4-D {layout}, found shape {tuple(t.shape)}")
    _need_float("q", q)
    B, T, H, K = q.shape
    _need_shape("k", k, tuple(q.shape), "[B, T, H, K] (the shape of q)")
    if v.shape[:2] != q.shape[:2]:
        raise ValueError(f"v must have shape [B, T, HV, V] with B, T = {B}, {T} as q, found {tuple(v.shape)}")
    HV, V = v.shape[2], v.shape[3]
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but q has {q.dtype}; q, k and v must share one dtype")
        _need_same_device(name, t, "q", q)
    if H == 0 or HV % H != 0:
        raise ValueError(f"v has HV={HV} value heads, which is not a multiple of the H={H} query/key heads of q")
    _need_head_dim("q", "query/key", "K", K)
    _need_head_dim("v", "value", "V", V)
    return Dims(B, T, H, HV, K, V)


def _show_offsets(cu: list[int]) -> str:
    return str(cu if len(cu) <= 12 else cu[:6] + ["..."] + cu[-3:])


def check_cu_seqlens(cu_seqlens, B: int, T: int, name: str, ref: torch.Tensor) -> tuple[int, ...]:
    """``cu_seqlens``: int32 ``[N+1]`` offsets of ``N >= 1`` packed sequences, ``0 = cu[0] <= ... <= cu[N] = T``
    (empty sequences allowed), on ``ref``'s device, with the inputs' ``B = 1``. Reads the offsets to the host
    (:func:`lynn_kernels.runtime.host_ints`: one sync per tensor, none if its maker remembered them) and returns
    them."""
    _need_tensor("cu_seqlens", cu_seqlens)
    if cu_seqlens.dtype != torch.int32:
        raise TypeError(f"cu_seqlens has dtype {cu_seqlens.dtype}; expected torch.int32 sequence offsets [N+1]")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D [N+1] offsets of N >= 1 sequences, found shape "
                         f"{tuple(cu_seqlens.shape)}")
    _need_same_device("cu_seqlens", cu_seqlens, name, ref)
    if B != 1:
        raise ValueError(f"with cu_seqlens, {name} must hold the packed sequences as one row (B = 1, "
                         f"[1, T, ...]), found B={B}")
    cu = list(runtime.host_ints(cu_seqlens))
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, found {_show_offsets(cu)}")
    drop = next((i for i in range(1, len(cu)) if cu[i] < cu[i - 1]), None)
    if drop is not None:
        raise ValueError(f"cu_seqlens must never decrease (sequence n is tokens cu[n]:cu[n+1]), found "
                         f"cu[{drop}]={cu[drop]} < cu[{drop - 1}]={cu[drop - 1]} in {_show_offsets(cu)}")
    if cu[-1] != T:
        raise ValueError(f"cu_seqlens must end at T = {name}.shape[1] = {T}, found cu[-1]={cu[-1]} in "
                         f"{_show_offsets(cu)}")
    return tuple(cu)


def check_delta_rule(q, k, v, g, beta, scale, initial_state, out_state=None, cu_seqlens=None) -> Dims:
    """All arguments of ``chunk_gated_delta_rule`` / ``recurrent_gated_delta_rule``; returns the sizes (with
    ``cu_seqlens`` read to the host, ``dims.cu``)."""
    dims = check_qkv(q, k, v)
    for name, t in (("g", g), ("beta", beta)):
        _need_tensor(name, t)
        _need_shape(name, t, (dims.B, dims.T, dims.HV), "[B, T, HV]")
        _need_float(name, t)
        _need_same_device(name, t, "q", q)
    check_scale(scale)
    if cu_seqlens is not None:
        dims = replace(dims, cu=check_cu_seqlens(cu_seqlens, dims.B, dims.T, "q", q))
    check_state("initial_state", initial_state, dims, q)
    check_state("out_state", out_state, dims, q)
    check_out_state_alias(out_state, initial_state, q=q, k=k, v=v, g=g, beta=beta)
    return dims


def check_delta_rule_gates(q, k, v, A_log, a, dt_bias, b, scale, initial_state, out_state=None) -> Dims:
    """All arguments of ``recurrent_gated_delta_rule_gates``; returns the sizes."""
    dims = check_qkv(q, k, v)
    check_gates(A_log, a, dt_bias, b, dims, q)
    check_scale(scale)
    check_state("initial_state", initial_state, dims, q)
    check_state("out_state", out_state, dims, q)
    check_out_state_alias(out_state, initial_state, q=q, k=k, v=v, A_log=A_log, a=a, dt_bias=dt_bias, b=b)
    return dims


def check_out_state_alias(out_state, initial_state, **inputs) -> None:
    """``out_state`` is written while the kernels still read the inputs: it may be ``initial_state`` itself (each
    program reads its slice before writing it), but must share no memory with it otherwise, nor with any input."""
    if out_state is None:
        return
    if initial_state is not None and overlaps(out_state, initial_state) and not same_view(out_state, initial_state):
        raise ValueError("out_state overlaps initial_state without being the same view of it; pass initial_state "
                         "itself for an in-place update, or a separate tensor")
    for name, t in inputs.items():
        if overlaps(out_state, t):
            raise ValueError(f"out_state shares memory with {name}; out_state must be initial_state or a tensor of "
                             f"its own")


def check_gates(A_log, a, dt_bias, b, dims: Dims, ref: torch.Tensor) -> None:
    """``A_log, dt_bias [HV]`` and ``a, b [B, T, HV]``: the raw gate inputs of a Qwen3-Next / Qwen3.5 layer."""
    for name, t, shape, layout in (("A_log", A_log, (dims.HV,), "[HV]"), ("dt_bias", dt_bias, (dims.HV,), "[HV]"),
                                   ("a", a, (dims.B, dims.T, dims.HV), "[B, T, HV]"),
                                   ("b", b, (dims.B, dims.T, dims.HV), "[B, T, HV]")):
        _need_tensor(name, t)
        _need_shape(name, t, shape, layout)
        _need_float(name, t)
        _need_same_device(name, t, "q", ref)


def check_gate_inputs(A_log, a, dt_bias, b) -> None:
    """:func:`.reference.gates`' arguments: ``A_log, dt_bias [HV]`` and ``a, b [..., HV]`` (one shape), float, on
    ``a``'s device."""
    for name, t in (("A_log", A_log), ("a", a), ("dt_bias", dt_bias), ("b", b)):
        _need_tensor(name, t)
        _need_float(name, t)
    if a.dim() == 0:
        raise ValueError("a must be [..., HV] (e.g. [B, T, HV]), found a 0-d tensor")
    HV = a.shape[-1]
    _need_shape("b", b, tuple(a.shape), "[..., HV] (the shape of a)")
    _need_shape("A_log", A_log, (HV,), "[HV]")
    _need_shape("dt_bias", dt_bias, (HV,), "[HV]")
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias), ("b", b)):
        _need_same_device(name, t, "a", a)


def check_conv(x, weight, initial_state, cu_seqlens=None) -> tuple[int, int, int, int, int, tuple[int, ...] | None]:
    """``x [B, T, C]``, ``weight [C, W]``, ``initial_state [B, C, S]`` (``S >= W - 1``; ``[N, C, S]`` with
    ``cu_seqlens``); returns B, T, C, W, S and the offsets read to the host (or None)."""
    _need_tensor("x", x)
    _need_tensor("weight", weight)
    if x.dim() != 3:
        raise ValueError(f"x must be 3-D [B, T, C], found shape {tuple(x.shape)}")
    _need_float("x", x)
    B, T, C = x.shape
    _check_conv_weight(weight, C, x)
    W = weight.shape[1]
    S = W - 1
    cu = None if cu_seqlens is None else check_cu_seqlens(cu_seqlens, B, T, "x", x)
    if initial_state is not None:
        _need_tensor("initial_state", initial_state)
        N, rows = (B, "B") if cu is None else (len(cu) - 1, "N")
        if initial_state.dim() != 3 or tuple(initial_state.shape[:2]) != (N, C) or initial_state.shape[2] < W - 1:
            per = "" if cu is None else f" over the N={N} sequences of cu_seqlens"
            raise ValueError(f"initial_state must have shape [{rows}, C, S] = ({N}, {C}, S >= {W - 1}) for a "
                             f"width-{W} conv{per}, found {tuple(initial_state.shape)}")
        if initial_state.dtype != x.dtype:
            raise TypeError(f"initial_state has dtype {initial_state.dtype} but x has {x.dtype}; the conv state "
                            f"holds raw inputs in x's dtype")
        _need_same_device("initial_state", initial_state, "x", x)
        S = initial_state.shape[2]
    return B, T, C, W, S, cu


def check_conv_update(x, conv_state, weight) -> tuple[int, int, int, int]:
    """``x [B, C]``, ``conv_state [B, C, S]`` (``S >= W - 1``, updated in place), ``weight [C, W]``."""
    for name, t in (("x", x), ("conv_state", conv_state), ("weight", weight)):
        _need_tensor(name, t)
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [B, C] (one token), found shape {tuple(x.shape)}")
    _need_float("x", x)
    B, C = x.shape
    _check_conv_weight(weight, C, x)
    W = weight.shape[1]
    if conv_state.dim() != 3 or tuple(conv_state.shape[:2]) != (B, C) or conv_state.shape[2] < W - 1:
        raise ValueError(f"conv_state must have shape [B, C, S] = ({B}, {C}, S >= {W - 1}) for a width-{W} conv, "
                         f"found {tuple(conv_state.shape)}")
    if conv_state.dtype != x.dtype:
        raise TypeError(f"conv_state has dtype {conv_state.dtype} but x has {x.dtype}; the conv state holds raw "
                        f"inputs in x's dtype")
    _need_same_device("conv_state", conv_state, "x", x)
    return B, C, W, conv_state.shape[2]


def _check_conv_weight(weight, C: int, x, name: str = "weight", x_name: str = "x") -> None:
    if weight.dim() != 2 or weight.shape[0] != C:
        raise ValueError(f"{name} must be 2-D [C, W] with C={C} ({x_name}'s channels), found shape "
                         f"{tuple(weight.shape)}; an nn.Conv1d weight [C, 1, W] needs .squeeze(1)")
    W = weight.shape[1]
    if not MIN_CONV_WIDTH <= W <= MAX_CONV_WIDTH:
        raise ValueError(f"conv width W={W} ({name}.shape[1]) is unsupported: expected "
                         f"{MIN_CONV_WIDTH}..{MAX_CONV_WIDTH}")
    _need_float(name, weight)
    _need_same_device(name, weight, x_name, x)


def check_gated_rmsnorm(x, z, weight, eps) -> int:
    """``x, z [..., D]``, ``weight [D]``; returns D."""
    for name, t in (("x", x), ("z", z), ("weight", weight)):
        _need_tensor(name, t)
        _need_float(name, t)
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"x must be [..., D] with D >= 1, found shape {tuple(x.shape)}")
    D = x.shape[-1]
    _need_shape("z", z, tuple(x.shape), "[..., D] (the shape of x)")
    _need_shape("weight", weight, (D,), "[D]")
    for name, t in (("z", z), ("weight", weight)):
        _need_same_device(name, t, "x", x)
    _need_number("eps", eps, "a positive finite Python number")
    if not (math.isfinite(eps) and eps > 0):                        # eps = 0 gives NaN on an all-zero row
        raise ValueError(f"eps must be a positive finite Python number (an all-zero row of x divides by "
                         f"sqrt(eps)), got {eps!r}")
    return D


def check_decode_step(qkv, z, a, b, conv_state, conv_weight, A_log, dt_bias, state, norm_weight, num_k_heads,
                      eps, x=None, a_weight=None, b_weight=None) -> Dims:
    """:func:`lynn_kernels.deltanet.gated_delta_decode`'s arguments: ``qkv [B, C]`` with ``C = 2 H K + HV V``,
    ``z [B, HV, V]`` in qkv's dtype, ``a, b [B, HV]``, ``conv_state [B, C, S]`` in qkv's dtype (``S >= W - 1``),
    ``conv_weight [C, W]``, ``A_log, dt_bias [HV]``, ``state`` fp32 ``[B, HV, K, V]`` (contiguous: updated in
    place), ``norm_weight [V]``; ``H = num_k_heads``. Or, instead of ``a`` and ``b`` (both None), the layer input
    ``x [B, HD]`` and ``a_weight, b_weight [HV, HD]`` in x's dtype. Each message names the argument. Returns the
    sizes (``T = 1``)."""
    proj = x is not None or a_weight is not None or b_weight is not None
    if proj and (a is not None or b is not None):
        raise ValueError("pass either a and b (the gates' projections) or x, a_weight and b_weight (the layer input "
                         "and the projections' weights), not both")
    gate_args = (("x", x), ("a_weight", a_weight), ("b_weight", b_weight)) if proj else (("a", a), ("b", b))
    for name, t in (("qkv", qkv), ("z", z), *gate_args, ("conv_state", conv_state),
                    ("conv_weight", conv_weight), ("A_log", A_log), ("dt_bias", dt_bias), ("state", state),
                    ("norm_weight", norm_weight)):
        _need_tensor(name, t)
        if name != "state":
            _need_float(name, t)
        if name != "qkv":
            _need_same_device(name, t, "qkv", qkv)
    if qkv.dim() != 2:
        raise ValueError(f"qkv must be 2-D [B, C] (one token a row), found shape {tuple(qkv.shape)}")
    B, C = qkv.shape
    if state.dim() != 4:
        raise ValueError(f"state must be 4-D [B, HV, K, V] fp32, found shape {tuple(state.shape)}")
    if state.dtype != torch.float32:
        raise TypeError(f"state has dtype {state.dtype}; the recurrent state is always float32")
    if state.shape[0] != B:
        raise ValueError(f"state must have B={B} rows (qkv's), found shape {tuple(state.shape)}")
    HV, K, V = state.shape[1:]
    _need_head_dim("state", "key", "K", K)
    _need_head_dim("state", "value", "V", V)
    if not state.is_contiguous():
        raise ValueError(f"state must be contiguous (it is updated in place), found strides {tuple(state.stride())}")
    if isinstance(num_k_heads, bool) or not isinstance(num_k_heads, int):
        raise TypeError(f"num_k_heads must be a positive int (the query / key heads), got {num_k_heads!r}")
    if num_k_heads < 1:
        raise ValueError(f"num_k_heads must be a positive int (the query / key heads), got {num_k_heads}")
    H = num_k_heads
    if HV % H:
        raise ValueError(f"the state's HV={HV} value heads are not a multiple of num_k_heads={H}")
    if C != 2 * H * K + HV * V:
        raise ValueError(f"qkv has C={C} channels; expected 2 H K + HV V = 2 * {H} * {K} + {HV} * {V} = "
                         f"{2 * H * K + HV * V} ([q | k | v] of num_k_heads={H} and the state's {HV} value heads)")
    _check_conv_weight(conv_weight, C, qkv, "conv_weight", "qkv")
    W = conv_weight.shape[1]
    if conv_state.dim() != 3 or tuple(conv_state.shape[:2]) != (B, C) or conv_state.shape[2] < W - 1:
        raise ValueError(f"conv_state must have shape [B, C, S] = ({B}, {C}, S >= {W - 1}) for a width-{W} conv, "
                         f"found {tuple(conv_state.shape)}")
    for name, t in (("conv_state", conv_state), ("z", z)):
        if t.dtype != qkv.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but qkv has {qkv.dtype}; expected qkv's dtype")
    _need_shape("z", z, (B, HV, V), "[B, HV, V]")
    if proj:
        if x.dim() != 2 or x.shape[0] != B:
            raise ValueError(f"x must have shape [B, HD] with B={B} (qkv's rows), found {tuple(x.shape)}")
        for name, t in (("a_weight", a_weight), ("b_weight", b_weight)):
            _need_shape(name, t, (HV, x.shape[1]), "[HV, HD]")
            if t.dtype != x.dtype:
                raise TypeError(f"{name} has dtype {t.dtype} but x has {x.dtype}; expected x's dtype (as F.linear)")
    else:
        for name, t in (("a", a), ("b", b)):
            _need_shape(name, t, (B, HV), "[B, HV]")
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        _need_shape(name, t, (HV,), "[HV]")
    _need_shape("norm_weight", norm_weight, (V,), "[V]")
    _need_number("eps", eps, "a positive finite Python number")
    if not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps must be a positive finite Python number, got {eps!r}")
    return Dims(B, 1, H, HV, K, V)
