"""Expert stacks in the packed kernel layout: :class:`PackedExperts`, made once at load time by :func:`pack_experts`.

Each expert's ``[N, K]`` weight is laid out as :func:`lynn_kernels.matmul.pack` lays out one projection (code words
in the tensor cores' fragment order, re-encoded scales; docs/matmul.md), and the experts are stacked:
``words [E, N, Kp / 8]``, ``scales [E, N, Kp / 16]``. The global scale keeps the checkpoint's layout: ``()``, one
per expert ``[E]``, or one per row ``[E, N]`` (per-shard gate / up scales).

``pack_experts(w13, w2, shared)`` can also put the shared expert into the same stacks, as expert ``E`` behind the
routed ones, when its intermediate size is the routed experts' (Qwen3.5, Qwen3.6 and Qwen3-Next: 512 both). It
then returns the routed experts as views of the first ``E`` experts and the shared expert as a
:class:`~lynn_kernels.moe.SharedExpert` whose weights are views of expert ``E``: every op computes exactly what it
computed before (the reference dequantises each view on its own), and the decode kernels see that the shared
expert is one more slot of the routed stack, so it runs inside the routed launches (docs/moe.md, section 6).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..matmul.packed import CHUNK, PackedNVFP4, pack, unpack
from ..nvfp4 import BLOCK, NVFP4Tensor


class SharedExpert(NamedTuple):
    """The shared expert of a Qwen3-Next / Qwen3.5 MoE block: ``sigmoid(x @ gate_weight^T) * down(silu(gate(x)) *
    up(x))``.

    * ``w13``: ``[2 Is, H]``, gate rows first, then up rows (HF ``shared_expert.gate_proj`` / ``up_proj`` stacked:
      :func:`~.spec.fuse_w13`); NVFP4 with global scale ``()``, or ``[2 Is]`` (one per row: the gate rows hold
      gate_proj's scale, the up rows up_proj's, when the two differ), or a float tensor of x's dtype;
    * ``w2``: ``[H, Is]`` (HF ``shared_expert.down_proj``), of w13's kind; NVFP4 with global scale ``()``;
    * ``gate_weight``: ``[1, H]`` float, unquantised (HF ``shared_expert_gate.weight``).

    Its kind (NVFP4 or float) need not be the routed experts' (a checkpoint may leave the shared expert unquantised).
    """

    w13: NVFP4Tensor | torch.Tensor
    w2: NVFP4Tensor | torch.Tensor
    gate_weight: torch.Tensor


class PackedExperts:
    """A stack of ``E`` NVFP4 ``[N, K]`` expert weights in the packed kernel layout (module docstring).

    ``words`` int32 ``[E, N, Kp / 8]``, ``scales`` uint8 ``[E, N, Kp / 16]`` (``Kp``: ``K`` rounded up to a multiple
    of 128), ``global_scale`` fp32 ``()``, ``[E]`` or ``[E, N]``; ``k`` the logical ``K``. Indexing gives one
    expert as a :class:`~lynn_kernels.matmul.PackedNVFP4` (a view); :meth:`unpack` the checkpoint layout.
    """

    __slots__ = ("words", "scales", "global_scale", "k")

    def __init__(self, words: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor, k: int):
        if words.dtype != torch.int32 or words.dim() != 3:
            raise ValueError(f"words must be int32 [E, N, Kp/8], got {words.dtype} {tuple(words.shape)}")
        e, n, kw = words.shape
        if k % BLOCK or k <= 0 or kw != -(-k // CHUNK) * (CHUNK // 8):
            raise ValueError(f"k = {k} must be a positive multiple of {BLOCK} with words [E, N, "
                             f"{-(-k // CHUNK) * 16}] (K padded to a multiple of {CHUNK}), got {tuple(words.shape)}")
        if scales.dtype != torch.uint8 or tuple(scales.shape) != (e, n, kw // 2):
            raise ValueError(f"scales must be uint8 [E, N, Kp/16] = [{e}, {n}, {kw // 2}], got {scales.dtype} "
                             f"{tuple(scales.shape)}")
        if global_scale.dtype != torch.float32 or tuple(global_scale.shape) not in ((), (e,), (e, n)):
            raise ValueError(f"global_scale must be fp32 of shape (), [E] = [{e}] or [E, N] = [{e}, {n}], got "
                             f"{global_scale.dtype} {tuple(global_scale.shape)}")
        if not (words.device == scales.device == global_scale.device):
            raise ValueError(f"words, scales and global_scale must share a device, got {words.device}, "
                             f"{scales.device}, {global_scale.device}")
        if not (words.is_contiguous() and scales.is_contiguous() and global_scale.is_contiguous()):
            raise ValueError("words, scales and global_scale must be contiguous")
        self.words, self.scales, self.global_scale, self.k = words, scales, global_scale, int(k)

    @property
    def shape(self) -> torch.Size:
        """The logical (dequantised) shape ``[E, N, K]``."""
        return torch.Size((*self.words.shape[:2], self.k))

    @property
    def device(self) -> torch.device:
        return self.words.device

    def dim(self) -> int:
        return 3

    def __len__(self) -> int:
        return self.words.shape[0]

    @property
    def nbytes(self) -> int:
        return self.words.numel() * 4 + self.scales.numel() + self.global_scale.numel() * 4

    def __getitem__(self, e: int) -> PackedNVFP4:
        """Expert ``e`` as a :class:`PackedNVFP4` ``[N, K]`` (views of this stack's tensors)."""
        if not isinstance(e, int):
            raise TypeError("PackedExperts supports integer indexing (one expert) only")
        n = self.words.shape[1]
        g = self.global_scale
        g, rows_per_g = (g, n) if g.dim() == 0 else (g[e], n) if g.dim() == 1 else (g[e], 1)
        return PackedNVFP4(self.words[e], self.scales[e], g, rows_per_g, self.k)

    def to(self, device) -> "PackedExperts":
        return PackedExperts(self.words.to(device), self.scales.to(device), self.global_scale.to(device), self.k)

    def __repr__(self) -> str:
        return f"PackedExperts(shape={tuple(self.shape)}, device={self.device})"

    def unpack(self) -> NVFP4Tensor:
        """The checkpoint layout: an NVFP4Tensor ``[E, N, K]`` that dequantises to the same values exactly."""
        e, n, kw = self.words.shape
        flat = unpack(PackedNVFP4(self.words.reshape(e * n, kw), self.scales.reshape(e * n, kw // 2),
                                  torch.ones((), dtype=torch.float32, device=self.device), e * n, self.k))
        return NVFP4Tensor(flat.codes.reshape(e, n, -1), flat.scales.reshape(e, n, -1), self.global_scale)

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        from .. import nvfp4

        return nvfp4.dequantize(self.unpack(), dtype)


#: Rows packed at a time: :func:`~lynn_kernels.matmul.pack` holds a few int64 temporaries of its input's size, so
#: a stack is packed in slices of about this many rows (~1 GB of temporaries at K = 2048), not all at once.
PACK_ROWS = 1 << 15


def _packed_stacks(parts: list[tuple[torch.Tensor, torch.Tensor]], n: int, k: int):
    """The packed words ``[E', N, Kp/8]`` and scales ``[E', N, Kp/16]`` of NVFP4 stacks given as ``(codes [e, N,
    K/2], block scales [e, N, K/16])`` parts, one after the other (``E'`` the sum of the parts' ``e``), written into
    one buffer slice by slice (the global scales are laid out apart)."""
    total = sum(c.shape[0] for c, _ in parts)
    device = parts[0][0].device
    kw = -(-k // CHUNK) * (CHUNK // 8)
    words = torch.empty((total, n, kw), dtype=torch.int32, device=device)
    scales = torch.empty((total, n, kw // 2), dtype=torch.uint8, device=device)
    one = torch.ones((), dtype=torch.float32, device=device)
    step = max(1, PACK_ROWS // n)                                   # experts per slice
    e0 = 0
    for codes, block_scales in parts:
        for i in range(0, codes.shape[0], step):
            c, b = codes[i:i + step], block_scales[i:i + step]
            p = pack(NVFP4Tensor(c.reshape(-1, k // 2), b.reshape(-1, k // BLOCK), one))
            words[e0 + i:e0 + i + c.shape[0]] = p.words.reshape(c.shape[0], n, kw)
            scales[e0 + i:e0 + i + c.shape[0]] = p.scales.reshape(c.shape[0], n, kw // 2)
        e0 += codes.shape[0]
    return words, scales


def _per_row(g: torch.Tensor, e: int, n: int) -> torch.Tensor:
    """A stack's global scale ``()`` / ``[E]`` / ``[E, N]`` as one per row ``[E, N]``."""
    return g.reshape(g.shape + (1,) * (2 - g.dim())).expand(e, n)


def _stack_scales(routed: torch.Tensor, shared: torch.Tensor, e: int, n: int) -> torch.Tensor:
    """The global scale of the ``E + 1`` stack: ``[E + 1]`` when the routed one is ``()`` or ``[E]`` and the
    shared one ``()``, else ``[E + 1, N]``."""
    if routed.dim() <= 1 and shared.dim() == 0:
        return torch.cat([routed.reshape(-1).expand(e), shared.reshape(1)]).contiguous()
    return torch.cat([_per_row(routed, e, n), shared.reshape(-1).expand(n)[None]]).contiguous()


def _check_stack(name: str, w, ndim: int) -> None:
    if not isinstance(w, NVFP4Tensor) or w.dim() != ndim:
        raise TypeError(f"{name} must be a {ndim}-D NVFP4Tensor, found "
                        f"{type(w).__name__} {tuple(getattr(w, 'shape', ()))}")


def pack_experts(w13: NVFP4Tensor, w2: NVFP4Tensor, shared=None):
    """The packed layout of a MoE block's experts (exact; module docstring). Runs in torch on the weights' device:
    call it once per block, at load time.

    Args:
        w13: NVFP4 ``[E, 2I, H]``; w2: NVFP4 ``[E, H, I]`` (global scales ``()``, ``[E]``, or per row).
        shared: a :class:`SharedExpert` or None. With NVFP4 weights of the routed shapes (``Is == I``) it joins the
            stacks as expert ``E``; other NVFP4 weights are packed on their own; float ones stay as they are.

    Returns:
        ``(w13, w2, shared)``: two :class:`PackedExperts` of ``E`` experts and the shared expert (its weights
        :class:`PackedNVFP4`: views of expert ``E`` when it joined).

    Example::

        w13p, w2p, shared_p = pack_experts(mlp.w13, mlp.w2, mlp.shared)
        y = moe_block(x, router, w13p, w2p, shared_p, top_k=8)      # 3 launches per decode step
    """
    _check_stack("w13", w13, 3)
    _check_stack("w2", w2, 3)
    e, n13, h = w13.shape
    n2 = w2.shape[1]
    fold = (shared is not None and isinstance(shared.w13, NVFP4Tensor) and isinstance(shared.w2, NVFP4Tensor)
            and tuple(shared.w13.shape) == (n13, h) and tuple(shared.w2.shape) == tuple(w2.shape[1:])
            and shared.w13.device == w13.device and shared.w2.device == w2.device)
    g13, g2 = w13.global_scale.float().contiguous(), w2.global_scale.float().contiguous()
    if not fold:
        if (shared is not None and isinstance(shared.w13, NVFP4Tensor) and isinstance(shared.w2, NVFP4Tensor)
                and shared.w13.dim() == 2 and shared.w2.dim() == 2):                  # packed on its own
            shared = SharedExpert(pack(shared.w13), pack(shared.w2), shared.gate_weight)
        return (PackedExperts(*_packed_stacks([(w13.codes, w13.scales)], n13, h), g13, h),
                PackedExperts(*_packed_stacks([(w2.codes, w2.scales)], n2, w2.shape[2]), g2, w2.shape[2]), shared)
    all13 = PackedExperts(*_packed_stacks([(w13.codes, w13.scales), (shared.w13.codes[None], shared.w13.scales[None])],
                                          n13, h),
                          _stack_scales(g13, shared.w13.global_scale.float(), e, n13), h)
    all2 = PackedExperts(*_packed_stacks([(w2.codes, w2.scales), (shared.w2.codes[None], shared.w2.scales[None])],
                                         n2, w2.shape[2]),
                         _stack_scales(g2, shared.w2.global_scale.float(), e, n2), w2.shape[2])
    routed13 = PackedExperts(all13.words[:e], all13.scales[:e], all13.global_scale[:e], h)
    routed2 = PackedExperts(all2.words[:e], all2.scales[:e], all2.global_scale[:e], w2.shape[2])
    return routed13, routed2, SharedExpert(all13[e], all2[e], shared.gate_weight)


def shared_slot(w13, w2, shared) -> bool:
    """True when ``shared``'s weights are expert ``E`` of the stacks behind ``w13`` and ``w2`` (what
    :func:`pack_experts` makes): the kernels can then run it as one more routed slot, expert id ``E``. It is read
    from where the tensors lie (the shared expert's words, scales and global scales start where the routed ones
    end), so a copy of either side (``clone``, ``.to`` another device) loses it: the block then computes the same
    values, with the shared expert in launches of its own."""
    if shared is None or not isinstance(w13, PackedExperts) or not isinstance(w2, PackedExperts):
        return False
    if not isinstance(shared.w13, PackedNVFP4) or not isinstance(shared.w2, PackedNVFP4):
        return False

    def follows(stack: torch.Tensor, t: torch.Tensor) -> bool:      # t starts where the stack ends
        return (t.dtype == stack.dtype and t.device == stack.device and stack.dim() >= 1
                and t.data_ptr() == stack.data_ptr() + stack.numel() * stack.element_size()
                and t.numel() * stack.shape[0] == stack.numel())

    return all(follows(st, t) for st, t in ((w13.words, shared.w13.words), (w13.scales, shared.w13.scales),
                                            (w13.global_scale, shared.w13.global_scale),
                                            (w2.words, shared.w2.words), (w2.scales, shared.w2.scales),
                                            (w2.global_scale, shared.w2.global_scale)))
