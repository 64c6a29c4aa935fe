"""The kernel layout of an NVFP4 weight: :class:`PackedNVFP4`, made once at load time by :func:`pack`.

A checkpoint stores an NVFP4 ``[N, K]`` weight as bytes of two E2M1 codes (the even element in the low nibble) and
one E4M3 scale byte per 16 elements. That layout is kept on disk and in :class:`~lynn_kernels.nvfp4.NVFP4Tensor`.
The packed matmul kernels read a second layout, made from it once (docs/matmul.md has the picture):

* **codes**: each int32 word holds 8 codes of one row, their bits placed so that four shift-and-mask pairs turn the
  word into four bf16 pairs, each equal to ``e2m1 * 2^-126`` (the sign on bit 15 / 31, the three magnitude bits on
  8..6 / 24..22). The five shifts it needs (``<< 3, 4, 5, 6`` and ``>> 6``) are shared by the four pairs
  (:data:`PAIR_SHIFTS`). Which 8 codes: a row is cut in chunks of 128 along ``K`` (16 words, the last chunk
  padded with zero codes); word ``w = 4 q + i`` of a chunk holds the ``K`` positions
  ``32 i + 16 (j >> 2) + 8 ((j >> 1) & 1) + 2 q + (j & 1)`` for its elements ``j = 0 .. 7`` (:func:`word_k`).
  That is the order of the tensor cores' A operand (``mma.m16n8k16``: thread ``q`` of a row's four holds the
  pairs ``2q, 2q + 1`` and ``2q + 8, 2q + 9`` of each 16 columns), so a thread's 16-byte load of four words decodes
  into its fragment registers with no exchange between threads (docs/matmul.md has the picture);
* **scales**: each E4M3 block scale ``s = 2^e (1 + m/8)`` is re-encoded as the byte ``b = (e + 10) << 3 | m`` with
  its two nibbles swapped, in ``K`` order (the padding's scales are zero). One byte-permute and one AND-OR turn it
  into a pair of bf16 ``s * 2^107`` (tensor-core kernels) or an fp32 ``s * 2^75`` (FMA kernel): no table, no
  subnormal case. Word ``4 q + i`` of a chunk spans the blocks ``2 i`` and ``2 i + 1``: the 16-bit scale pair at
  byte ``2 i`` of the chunk's 8. A block whose scale is zero has its codes zeroed and a negative scale moves its
  sign into the codes, so the product is unchanged (the reference dequantises either way to the same values);
* **global scale**: unchanged, fp32 (per row group, as in the NVFP4Tensor); each kernel folds its powers of two
  into the one epilogue multiply by it.

The layout is exact: :func:`unpack` recovers an NVFP4Tensor that dequantises to the same values bit for bit (but
for the sign of a zero-scale block's zeros); the codes and scales themselves come back as stored, except the
normalisations above (zeroed codes of a zero-scale block, folded signs).
"""

from __future__ import annotations

import torch

from ..nvfp4 import BLOCK, NVFP4Tensor

#: ``K`` positions per chunk of the code layout (16 words); a row's codes and scales are padded to whole chunks.
CHUNK = 128

#: Per bf16 pair ``p`` of a word (elements ``2p`` and ``2p + 1``): the left shift (negative: right) that brings its
#: sign bits to 15 / 31, and the one that brings its magnitude bits to 8..6 / 24..22. Five distinct shifts in all.
PAIR_SHIFTS = ((0, -6), (4, 0), (5, 3), (6, 6))

#: Bit position of each element's sign, and of the lowest of its three magnitude bits, in the packed word.
SIGN_BIT = tuple(pos for s, _ in PAIR_SHIFTS for pos in (15 - s, 31 - s))
MAG_BIT = tuple(pos for _, m in PAIR_SHIFTS for pos in (6 - m, 22 - m))

#: The re-encoded scale byte ``b`` (its nibbles swapped back) decodes as ``float32 bits (b << 20) | SCALE_OR[kind]``:
#: ``s * 2^75`` (packed GEMV) or ``s * 2^107`` (tensor-core kernels).
SCALE_OR = {"fma": 0x60000000, "mma": 0x70000000}
SCALE_EXP = {"fma": 75, "mma": 107}
SCALE_BIAS = 10          # the byte's exponent field is e + 10, 1..18 for E4M3's 2^-9 .. 2^8


def word_k(kw: int, device=None) -> torch.Tensor:
    """The ``K`` position of each element of the packed words: int64 ``[kw, 8]`` for ``kw`` words of a row (a
    multiple of 16): element ``j`` of word ``16 c + 4 q + i`` holds ``128 c + 32 i + 16 (j >> 2) + 8 ((j >> 1) & 1)
    + 2 q + (j & 1)``."""
    w = torch.arange(kw, device=device)[:, None]
    j = torch.arange(8, device=device)[None, :]
    c, q, i = w // 16, (w % 16) // 4, w % 4
    return CHUNK * c + 32 * i + 16 * (j >> 2) + 8 * ((j >> 1) & 1) + 2 * q + (j & 1)


def _swap_nibbles(b: torch.Tensor) -> torch.Tensor:
    return ((b << 4) | (b >> 4)) & 0xFF


class PackedNVFP4:
    """An NVFP4 ``[N, K]`` weight in the packed kernels' layout (see the module docstring). Build it with
    :func:`pack` (or :meth:`from_nvfp4`); :meth:`unpack` returns the checkpoint layout.

    ``words`` int32 ``[N, Kp / 8]``, ``scales`` uint8 ``[N, Kp / 16]`` (re-encoded), with ``Kp`` the logical ``k``
    rounded up to a multiple of :data:`CHUNK`; ``global_scale`` fp32 (a scalar or one per group of rows, as in
    :class:`~lynn_kernels.nvfp4.NVFP4Tensor`).
    """

    __slots__ = ("words", "scales", "global_scale", "rows_per_g", "k", "_runs")

    def __init__(self, words: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor, rows_per_g: int,
                 k: int):
        if words.dtype != torch.int32 or words.dim() != 2:
            raise ValueError(f"words must be int32 [N, Kp/8], got {words.dtype} {tuple(words.shape)}")
        n, kw = words.shape
        if k % BLOCK or k <= 0 or kw != -(-k // CHUNK) * (CHUNK // 8):
            raise ValueError(f"k = {k} must be a positive multiple of {BLOCK} with words [N, {-(-k // CHUNK) * 16}] "
                             f"(K padded to a multiple of {CHUNK}), got words {tuple(words.shape)}")
        if scales.dtype != torch.uint8 or tuple(scales.shape) != (n, kw // 2):
            raise ValueError(f"scales must be uint8 [N, Kp/16] = [{n}, {kw // 2}], got {scales.dtype} "
                             f"{tuple(scales.shape)}")
        if global_scale.dtype != torch.float32 or global_scale.numel() * rows_per_g != n:
            raise ValueError(f"global_scale must be fp32 with one value per {rows_per_g} rows of {n}, got "
                             f"{global_scale.dtype} {tuple(global_scale.shape)}")
        if not (words.device == scales.device == global_scale.device):
            raise ValueError(f"words, scales and global_scale must share a device, got {words.device}, "
                             f"{scales.device}, {global_scale.device}")
        self.words = words.contiguous()
        self.scales = scales.contiguous()
        self.global_scale = global_scale.reshape(-1).contiguous()
        self.rows_per_g = int(rows_per_g)
        self.k = int(k)
        self._runs: tuple[tuple[int, int, float], ...] | None = None

    def scale_runs(self) -> tuple[tuple[int, int, float], ...]:
        """``(first_row, end_row, global_scale)`` for each run of consecutive rows sharing one global scale, the
        scale a Python float (a stack of projections from :func:`concat_rows` holds one scale per row but one run
        per projection). Read back from the device once (a host sync), then kept; the dequantise-then-cuBLAS GEMM
        gives each run's scale to cuBLAS as its ``alpha``. Call it once before capturing a CUDA graph that reaches
        that path."""
        if self._runs is None:
            if self.global_scale.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("PackedNVFP4.scale_runs() was first called inside a CUDA graph capture (it reads "
                                   "the global scales back): call it once before capturing")
            runs, g = [], self.global_scale.tolist()
            for i, v in enumerate(g):
                if runs and runs[-1][2] == v:
                    runs[-1][1] = (i + 1) * self.rows_per_g
                else:
                    runs.append([i * self.rows_per_g, (i + 1) * self.rows_per_g, float(v)])
            self._runs = tuple(tuple(r) for r in runs)
        return self._runs

    @property
    def shape(self) -> torch.Size:
        """The logical (dequantised) shape ``[N, K]``."""
        return torch.Size((self.words.shape[0], self.k))

    @property
    def device(self) -> torch.device:
        return self.words.device

    def dim(self) -> int:
        return 2

    @property
    def nbytes(self) -> int:
        return self.words.numel() * 4 + self.scales.numel() + self.global_scale.numel() * 4

    def rows_per_global(self) -> int:
        return self.rows_per_g

    def to(self, device) -> "PackedNVFP4":
        return PackedNVFP4(self.words.to(device), self.scales.to(device), self.global_scale.to(device),
                           self.rows_per_g, self.k)

    def __repr__(self) -> str:
        return f"PackedNVFP4(shape={tuple(self.shape)}, device={self.device})"

    @classmethod
    def from_nvfp4(cls, w: NVFP4Tensor) -> "PackedNVFP4":
        return pack(w)

    def unpack(self) -> NVFP4Tensor:
        return unpack(self)

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        from .. import nvfp4

        return nvfp4.dequantize(self.unpack(), dtype)


def _check_packable(w) -> None:
    if not isinstance(w, NVFP4Tensor):
        raise TypeError(f"pack takes an NVFP4Tensor, got {type(w).__name__}")
    if w.dim() != 2:
        raise ValueError(f"pack takes a 2-D NVFP4Tensor [N, K], got shape {tuple(w.shape)}")
    k = w.shape[1]
    if k % BLOCK:
        raise ValueError(f"w has K = {k}; the packed layout needs K a multiple of {BLOCK}")


def _scale_bytes(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """E4M3 scales -> (re-encoded bytes, is-zero mask, is-negative mask); NaN scales are refused."""
    bits = scales.view(torch.uint8)
    if bool(((bits & 0x7F) == 0x7F).any()):
        raise ValueError("w.scales holds NaN (E4M3 0x7f / 0xff); a packed weight needs finite block scales")
    mag = bits & 0x7F
    e, m = (mag >> 3).to(torch.int32), (mag & 7).to(torch.int32)
    # normal: 2^(e - 7) (1 + m/8); subnormal (e = 0): m/8 * 2^-6, normalised below
    exp = e - 7
    sub = e == 0
    top = torch.where(m >= 4, 2, torch.where(m >= 2, 1, 0))          # floor(log2 m) for m = 1..7
    sub_exp = top - 9                                               # m/8 * 2^-6 = 2^(top - 9) * (m / 2^top)
    sub_m = ((m << (3 - top)) & 7)                                  # the bits below m's leading one, as eighths
    exp = torch.where(sub, sub_exp, exp)
    m = torch.where(sub, sub_m, m)
    zero = mag == 0
    byte = torch.where(zero, 0, ((exp + SCALE_BIAS) << 3) | m).to(torch.uint8)
    return byte, zero, (bits & 0x80) != 0


def pack(w: NVFP4Tensor) -> PackedNVFP4:
    """The kernel layout of a 2-D NVFP4 weight (exact; see the module docstring). Runs in torch on ``w``'s device:
    call it once per weight, at load time."""
    _check_packable(w)
    n, k = w.shape
    kp = -(-k // CHUNK) * CHUNK
    sbyte, zero, neg = _scale_bytes(w.scales)
    codes = w.codes.view(torch.uint8).reshape(n, k // BLOCK, BLOCK // 2)
    codes = torch.where(zero[..., None], 0, codes)                           # a zero scale: the block is zero
    codes = torch.where(neg[..., None], codes ^ 0x88, codes)                 # a negative scale: flip the signs
    nib = torch.zeros((n, kp), dtype=torch.int64, device=w.device)
    nib[:, :k] = torch.stack((codes & 0xF, codes >> 4), dim=-1).reshape(n, k).to(torch.int64)
    nib = nib[:, word_k(kp // 8, w.device)]                                  # [n, kp / 8, 8] in word order
    word = torch.zeros((n, kp // 8), dtype=torch.int64, device=w.device)
    for j in range(8):
        word |= (nib[..., j] >> 3) << SIGN_BIT[j]
        word |= (nib[..., j] & 7) << MAG_BIT[j]
    word = torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(torch.int32)
    scales = torch.zeros((n, kp // BLOCK), dtype=torch.uint8, device=w.device)
    scales[:, :k // BLOCK] = _swap_nibbles(sbyte)
    return PackedNVFP4(word, scales, w.global_scale.to(torch.float32), w.rows_per_global(), k)


def concat_rows(weights) -> PackedNVFP4:
    """Packed weights ``[N_i, K]`` stacked along N into one ``[sum N_i, K]`` (one GEMV reads several projections of
    the same input): exact, each row keeps its own global scale. Parts that share one scalar global scale keep it;
    otherwise the result has one global scale per row (``rows_per_g = 1``, as a per-row NVFP4Tensor; 4 bytes a row).
    Every part must be a :class:`PackedNVFP4` of the same ``K`` on the same device."""
    weights = list(weights)
    if not weights:
        raise ValueError("concat_rows needs at least one weight")
    for i, w in enumerate(weights):
        if not isinstance(w, PackedNVFP4):
            raise TypeError(f"weights[{i}] must be a PackedNVFP4 (pack() it first), got {type(w).__name__}")
        if w.k != weights[0].k or w.device != weights[0].device:
            raise ValueError(f"weights[{i}] is [{w.shape[0]}, {w.k}] on {w.device}; weights[0] is "
                             f"[{weights[0].shape[0]}, {weights[0].k}] on {weights[0].device}: K and device must match")
    n = sum(w.shape[0] for w in weights)
    g0 = weights[0].global_scale
    if all(w.rows_per_g == w.shape[0] and torch.equal(w.global_scale, g0) for w in weights):
        g, grain = g0.clone(), n                                   # one scalar scale for every part
    else:
        g, grain = torch.cat([w.global_scale.repeat_interleave(w.rows_per_g) for w in weights]), 1
    return PackedNVFP4(torch.cat([w.words for w in weights]), torch.cat([w.scales for w in weights]), g, grain,
                       weights[0].k)


def unpack(p: PackedNVFP4) -> NVFP4Tensor:
    """The checkpoint layout of a packed weight: an NVFP4Tensor that dequantises to the same values exactly."""
    if not isinstance(p, PackedNVFP4):
        raise TypeError(f"unpack takes a PackedNVFP4, got {type(p).__name__}")
    n, k = p.shape
    word = p.words.to(torch.int64) & 0xFFFFFFFF
    nib = torch.stack([((word >> SIGN_BIT[j]) & 1) << 3 | ((word >> MAG_BIT[j]) & 7) for j in range(8)], dim=-1)
    flat = torch.empty((n, word.shape[1] * 8), dtype=torch.int64, device=word.device)
    flat[:, word_k(word.shape[1], word.device)] = nib                     # back to K order
    nib = flat[:, :k].reshape(n, k // 2, 2)
    codes = (nib[..., 0] | (nib[..., 1] << 4)).to(torch.uint8)
    b = _swap_nibbles(p.scales[:, :k // BLOCK].to(torch.int32))
    exp, m = (b >> 3) - SCALE_BIAS, b & 7
    value = torch.where(b == 0, 0.0, torch.ldexp(1.0 + m.to(torch.float32) / 8, exp.to(torch.float32)))
    scales = value.to(torch.float8_e4m3fn)                                   # exact: every value is an E4M3
    g = p.global_scale
    if p.rows_per_g != n:
        g = g.reshape(-1)
    else:
        g = g.reshape(())
    return NVFP4Tensor(codes, scales, g)
