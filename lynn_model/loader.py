"""Load a HF model folder into a :class:`~lynn_model.model.Model`: safetensors only, shard by shard.

Every header is read first and checked against the config (:mod:`lynn_model.checkpoint`: the files, names and
formats read), so a missing, unexpected, mis-shaped or wrongly typed tensor is reported (with its file) before any
data is read; then each shard's tensors are converted and moved to the device one by one (damaged values refused:
:class:`WeightCheck`), so host memory stays near one tensor (a module split across shards waits for its last shard).
The model is built on the meta device and its placeholders are replaced (:class:`Assembler`); the NVFP4 projections
and experts are put in the packed kernels' layout. Also here: :func:`random_model` (random weights, no checkpoint)
and :func:`dequantize_model`. Formats and rules: docs/decoder.md.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch

import lynn_kernels
from lynn_kernels import NVFP4Tensor, moe, runtime
from lynn_kernels.matmul import PackedNVFP4, pack

from .checkpoint import (
    _FLOATS,
    NVFP4_SUFFIXES,
    Entry,
    LoadError,
    Module,
    QuantConfig,
    Target,
    check_counts,
    plan,
    read_config,
    read_headers,
    read_json,
    targets,
)
from .config import Config
from .model import Model

WEIGHT_MODES = ("auto", "nvfp4", "bf16")
#: The LM head: ``"checkpoint"`` as the files hold it (tied to the embedding where the config says so), or
#: ``"nvfp4"``: quantised on load, whatever ``weights`` says (a tied embedding stays float for the lookup; the head
#: becomes an NVFP4 copy of it, 0.28x the bytes a decode step reads for it).
LM_HEAD_MODES = ("checkpoint", "nvfp4", "nvfp4-drafts")
#: Projections kept in a float dtype when quantising on load (``weights="nvfp4"``): the LM head, the router, the
#: shared-expert gate and the tiny Gated DeltaNet gate projections (as every published checkpoint keeps them).
DEFAULT_KEEP = (r"(^|\.)lm_head$", r"\.mlp\.gate$", r"\.shared_expert_gate$", r"\.linear_attn\.in_proj_(a|b|ba)$")
#: What published NVFP4 checkpoints keep besides: every Gated DeltaNet projection (``keep=PUBLISHED_KEEP`` loads a
#: bf16 folder the way they are quantised; the default quantises ``in_proj_qkv`` / ``in_proj_z`` / ``out_proj`` too,
#: for the bytes a decode step reads).
PUBLISHED_KEEP = DEFAULT_KEEP + (r"\.linear_attn\.",)


# ---------------------------------------------------------------------------------------------------------------
# putting converted tensors into the model


class Assembler:
    """Receives each module's value (a float tensor or an NVFP4Tensor on the device) and places it in the model:
    permutes Qwen3-Next's head-grouped projections, stacks experts when a layer's set is complete, ties the head."""

    def __init__(self, model: Model, mode: str, keep: tuple, recipe: str):
        self.model, self.mode, self.recipe = model, mode, recipe
        self.keep = [re.compile(k) for k in keep]
        self.dtype, self.c = model.dtype, model.config
        self.experts: dict[int, dict] = {}
        self.shared: dict[int, dict] = {}

    # -- conversions ---------------------------------------------------------------------------------------------
    def convert(self, module: str, value, target: Target):
        """Apply the weight mode: quantise, dequantise or cast."""
        if target.kind == "tensor":
            return value.to(self.dtype)
        if isinstance(value, NVFP4Tensor):
            return lynn_kernels.dequantize(value, self.dtype) if self.mode == "bf16" else value
        if self.mode == "nvfp4" and target.quantizable and target.shape[1] % 16 == 0 \
                and not any(k.search(module) for k in self.keep):
            return lynn_kernels.quantize(value, recipe=self.recipe)
        return value.to(self.dtype)

    def put(self, module: str, value, target: Target) -> None:
        value = self.convert(module, value, target)
        m, c = self.model, self.c
        if module == "model.embed_tokens":
            m.embed_tokens = value
            if c.tie_word_embeddings:
                m.lm_head.weight = value
            return
        if module == "model.norm":
            m.norm.weight = value
            return
        if module == "lm_head":
            m.lm_head.weight = value
            return
        if module == "mtp.fc":
            m.mtp.fc.weight = value
            return
        if module in ("mtp.pre_fc_norm_embedding", "mtp.pre_fc_norm_hidden", "mtp.norm"):
            getattr(m.mtp, module[4:]).weight = value
            return
        parts = module.split(".")
        if parts[0] == "mtp":            # an MTP layer: keyed after the trunk's layers, as its cache index is
            i, layer = c.num_hidden_layers + int(parts[2]), m.mtp.layers[int(parts[2])]
        else:
            i, layer = int(parts[2]), m.layers[int(parts[2])]
        rest = ".".join(parts[3:])
        if rest in ("input_layernorm", "post_attention_layernorm"):
            getattr(layer, rest).weight = value
        elif rest in ("self_attn.q_norm", "self_attn.k_norm"):  # read by qk_norm_rope only, which takes them in
            getattr(layer.self_attn, rest[len("self_attn."):]).weight = value.float()   # fp32: cast once (exact)
        elif rest.startswith("self_attn."):                    # the projections
            getattr(layer.self_attn, rest[len("self_attn."):]).weight = value
        elif rest.startswith("linear_attn."):
            self._put_gdn(layer.linear_attn, rest[len("linear_attn."):], value)
        elif rest.startswith("mlp."):
            self._put_mlp(i, layer.mlp, rest[len("mlp."):], value)
        else:
            raise AssertionError(module)

    def _put_gdn(self, g, name: str, value) -> None:
        if name == "conv1d":
            g.conv_weight = value.squeeze(1).contiguous()
        elif name == "norm":
            g.norm_weight = value
        elif name in ("dt_bias", "A_log"):           # the gates are computed in fp32 from them: cast once, here,
            setattr(g, name, value.float())           # not in every decode step (exact: bf16 -> fp32)
        elif name == "in_proj_qkvz":
            qkv, z = split_qkvz(value, self.c)
            g.in_proj_qkv.weight, g.in_proj_z.weight = qkv, z
        elif name == "in_proj_ba":
            b, a = split_ba(value, self.c)
            g.in_proj_b.weight, g.in_proj_a.weight = b, a
        else:
            getattr(g, name).weight = value

    def _put_mlp(self, i: int, mlp, name: str, value) -> None:
        em = re.match(r"experts\.(\d+)\.(gate_proj|up_proj|down_proj)$", name)
        if em:
            d = self.experts.setdefault(i, {})
            d[(int(em.group(1)), em.group(2))] = value
            if len(d) == 3 * self.c.num_experts:
                e = self.c.num_experts
                d = self._one_kind(d)
                mlp.w13 = moe.stack_w13([d[(j, "gate_proj")] for j in range(e)], [d[(j, "up_proj")] for j in range(e)])
                downs = [d[(j, "down_proj")] for j in range(e)]
                mlp.w2 = NVFP4Tensor.stack(downs) if isinstance(downs[0], NVFP4Tensor) else torch.stack(downs)
                del self.experts[i]
        elif name == "gate":
            mlp.router = value
        elif name.startswith("shared_expert"):
            d = self.shared.setdefault(i, {})
            d[name] = value
            if len(d) == 4:
                gate = d.pop("shared_expert_gate")
                d = self._one_kind(d)
                d["shared_expert_gate"] = gate
                w13 = moe.fuse_w13(d["shared_expert.gate_proj"], d["shared_expert.up_proj"])
                mlp.shared = moe.SharedExpert(w13, d["shared_expert.down_proj"], d["shared_expert_gate"])
                del self.shared[i]
        else:
            getattr(mlp, name).weight = value

    def _one_kind(self, parts: dict) -> dict:
        """The grouped expert kernels take one kind of weight per FFN: where a checkpoint mixes NVFP4 and float
        experts (an ``--ignore``d expert), the NVFP4 ones are dequantised to the run dtype (exact in fp32)."""
        kinds = {isinstance(v, NVFP4Tensor) for v in parts.values()}
        if len(kinds) == 1:
            return parts
        return {k: lynn_kernels.dequantize(v, self.dtype) if isinstance(v, NVFP4Tensor) else v.to(self.dtype)
                for k, v in parts.items()}

    def finish(self) -> None:
        if self.experts or self.shared:
            raise LoadError(f"incomplete experts in layers {sorted(self.experts) + sorted(self.shared)}")
        left = [n for n, t in _tensors(self.model) if t.device.type == "meta"]
        if left:
            raise LoadError(f"never loaded: {left[:4]} (a loader bug: please report it)")


def _tensors(model: Model):
    """``(name, tensor)`` of every weight of the model (an NVFP4Tensor by its codes)."""
    from .model import GatedDeltaNet, SparseMoE

    def one(x):
        return x.codes if isinstance(x, NVFP4Tensor) else x.words if isinstance(x, PackedNVFP4) else x

    yield "embed_tokens", model.embed_tokens
    for name, m in model.named_modules():
        if isinstance(getattr(m, "weight", None), (torch.Tensor, NVFP4Tensor, PackedNVFP4)):
            yield name + ".weight", one(m.weight)
        if isinstance(m, GatedDeltaNet):
            for a in ("conv_weight", "dt_bias", "A_log", "norm_weight"):
                yield f"{name}.{a}", getattr(m, a)
        if isinstance(m, SparseMoE):
            for a in ("router", "w13", "w2"):
                yield f"{name}.{a}", one(getattr(m, a))


# -- Qwen3-Next's head-grouped projections -> the Qwen3.5 layout --------------------------------------------------


def _rows(value, index: torch.Tensor):
    """Select rows of a float ``[N, K]`` weight or an NVFP4Tensor (codes and block scales move together; the one
    global scale is shared by all rows, so the selection is exact)."""
    if isinstance(value, NVFP4Tensor):
        if value.global_scale.dim() != 0:
            raise LoadError("a head-grouped NVFP4 projection must have one global scale")
        idx = index.to(value.codes.device)
        return NVFP4Tensor(value.codes[idx], value.scales[idx], value.global_scale, value.recip_global_scale)
    return value[index.to(value.device)].contiguous()


def qkvz_order(config: Config) -> tuple[torch.Tensor, torch.Tensor]:
    """Row indices of ``in_proj_qkvz`` (grouped by key head: per group ``q_g, k_g, v_g, z_g``) that give the
    contiguous ``[q | k | v]`` and ``z`` rows of Qwen3.5's ``in_proj_qkv`` / ``in_proj_z``."""
    c = config
    nk, dk, r, dv = c.linear_num_key_heads, c.linear_key_head_dim, c.linear_num_value_heads // \
        c.linear_num_key_heads, c.linear_value_head_dim
    group = 2 * dk + 2 * r * dv
    base = torch.arange(nk)[:, None] * group
    q = (base + torch.arange(dk)).reshape(-1)
    k = (base + dk + torch.arange(dk)).reshape(-1)
    v = (base + 2 * dk + torch.arange(r * dv)).reshape(-1)
    z = (base + 2 * dk + r * dv + torch.arange(r * dv)).reshape(-1)
    return torch.cat([q, k, v]), z


def split_qkvz(value, config: Config):
    qkv, z = qkvz_order(config)
    return _rows(value, qkv), _rows(value, z)


def split_ba(value, config: Config):
    """``in_proj_ba`` (per key head ``b`` of its ``r`` value heads, then ``a``) -> ``(in_proj_b, in_proj_a)``."""
    nk, r = config.linear_num_key_heads, config.linear_num_value_heads // config.linear_num_key_heads
    base = torch.arange(nk)[:, None] * 2 * r
    return _rows(value, (base + torch.arange(r)).reshape(-1)), _rows(value, (base + r + torch.arange(r)).reshape(-1))


# ---------------------------------------------------------------------------------------------------------------
# the entry point


def from_pretrained(path, *, weights: str = "auto", device=None, dtype: torch.dtype | None = None,
                    keep: tuple = DEFAULT_KEEP, recipe: str = "modelopt", progress: bool = False,
                    layout: str = "packed", check_weights: bool = True, lm_head: str = "checkpoint",
                    fuse: bool | None = None) -> Model:
    """Load a HF model folder (the contract of :func:`lynn_model.from_pretrained`).

    Args:
        path: the folder (``config.json`` + safetensors).
        weights: ``"auto"`` (as stored: NVFP4 stays NVFP4, float stays float), ``"nvfp4"`` (quantise float
            projections on load, except those matching ``keep``) or ``"bf16"`` (dequantise NVFP4, cast the rest).
        device: where the model runs; default the runtime's device (the GPU, or the CPU for the interpreter).
        dtype: the activation dtype; default bf16 for ``weights="bf16"``, else the checkpoint's float dtype.
        keep: regexes of module names kept in a float dtype by ``weights="nvfp4"`` (:data:`DEFAULT_KEEP`).
        recipe: the NVFP4 recipe for quantising on load (``"modelopt"`` or ``"compressed-tensors"``).
        layout: ``"packed"`` (NVFP4 projections and expert stacks in the packed kernels' layout, made once here,
            the shared expert joined to the routed stacks where its shape allows: the fast path) or
            ``"checkpoint"`` (kept as stored, for comparing the two).
        check_weights: refuse a tensor holding NaN or Inf, or an NVFP4 scale that is negative, zero (a global
            scale) or NaN, naming it (:class:`WeightCheck`: checked on the device, one sync per shard).
        lm_head: ``"checkpoint"``, ``"nvfp4"`` or ``"nvfp4-drafts"`` (:data:`LM_HEAD_MODES`): the head as
            stored, or quantised on load with ``recipe`` (opt-in: its cost in perplexity is in
            docs/quantization.md), or kept as stored with an NVFP4 copy that only the MTP module's drafts read
            (:func:`quantize_draft_head`: the output stays plain decoding's, only acceptance can change).
        fuse: the decode fast path, :meth:`Model.fuse_for_decode` (each mixer's input projections stacked into one
            GEMV, each Gated DeltaNet decode step one kernel): within bf16 rounding of the model as stored, not
            bit-equal. None (default): where the model runs the compiled kernels (a CUDA device, no
            ``use_reference``), so ``generate()`` runs its fastest exact step; False keeps the checkpoint's
            projections apart (comparing with HF module by module); True always.
    """
    folder = Path(path)
    if weights not in WEIGHT_MODES:
        raise ValueError(f"weights = {weights!r}: expected one of {WEIGHT_MODES}")
    _check_lm_head(lm_head)
    _check_fuse(fuse)
    if layout not in ("packed", "checkpoint"):
        raise ValueError(f"layout = {layout!r}: expected 'packed' or 'checkpoint'")
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise LoadError(f"no config.json in {folder}")
    raw = read_json(cfg_path)
    entries = read_headers(folder)
    check_counts(raw, entries, cfg_path)
    config = read_config(raw, cfg_path, entries)
    quant = QuantConfig.read(folder, raw)
    mods, packed = plan(config, entries, quant)
    if dtype is None:
        dtype = torch.bfloat16 if weights == "bf16" else mods["model.embed_tokens"].parts["weight"].dtype
    if dtype not in _FLOATS:
        raise ValueError(f"dtype = {dtype}: expected one of {_FLOATS}")
    device = runtime.DEVICE if device is None else torch.device(device)
    model = Model(config, dtype)
    asm = Assembler(model, weights, keep, recipe)
    # a module is built when the shard holding its last tensor is read; its parts in earlier shards wait in `held`
    order = list(dict.fromkeys(e.file for e in entries))
    rank = {f: n for n, f in enumerate(order)}
    build_in: dict[Path, list[Module]] = {f: [] for f in order}
    hold_in: dict[Path, list[Entry]] = {f: [] for f in order}
    for m in [*mods.values(), *packed.values()]:
        end = max((e.file for e in m.parts.values()), key=rank.get)
        build_in[end].append(m)
        for e in m.parts.values():
            if e.file != end:
                hold_in[e.file].append(e)
    held: dict[str, torch.Tensor] = {}
    checker = WeightCheck(enabled=check_weights)
    from safetensors import safe_open
    for n, f in enumerate(order):
        if progress:
            print(f"\rloading {f.name} [{n + 1}/{len(order)}]", end="", file=sys.stderr, flush=True)
        try:
            with safe_open(str(f), framework="pt") as fh:
                for e in hold_in[f]:
                    held[e.name] = fh.get_tensor(e.name)

                def get(e: Entry) -> torch.Tensor:
                    t = (fh.get_tensor(e.name) if e.file == f else held.pop(e.name)).to(device)
                    checker.add(e, t)
                    return t

                for m in build_in[f]:
                    _build(asm, m, get, config)
            checker.verify()
        except LoadError:
            raise
        except Exception as e:                        # a damaged shard: name it
            if "safetensor" in type(e).__name__.lower():
                raise LoadError(f"{f}: cannot read ({e})") from e
            raise
    if progress:
        print(file=sys.stderr)
    asm.finish()
    _head(model, lm_head, recipe)
    if layout == "packed":
        pack_linears(model)
        pack_moe_experts(model)
    _fuse(model, fuse, device)
    model.eval()
    return model


def _check_fuse(fuse) -> None:
    if fuse is not None and not isinstance(fuse, bool):
        raise ValueError(f"fuse = {fuse!r}: expected None (on a GPU with the compiled kernels), True or False")


def _fuse(model: Model, fuse: bool | None, device: torch.device) -> None:
    """The loaders' ``fuse`` argument (:func:`from_pretrained`)."""
    if fuse or (fuse is None and device.type == "cuda" and runtime.backend() == "triton"):
        model.fuse_for_decode()


def _check_lm_head(lm_head) -> None:
    if lm_head not in LM_HEAD_MODES:
        raise ValueError(f"lm_head = {lm_head!r}: expected one of {LM_HEAD_MODES}")


def _head(model: Model, lm_head: str, recipe: str) -> None:
    if lm_head == "nvfp4":
        quantize_lm_head(model, recipe)
    elif lm_head == "nvfp4-drafts":
        if model.mtp is None:
            raise ValueError(f"lm_head = 'nvfp4-drafts': {model.config.name or model.config.family} has no MTP "
                             f"module to draft with (its checkpoint holds no mtp.* tensors)")
        quantize_draft_head(model, recipe)


def quantize_draft_head(model: Model, recipe: str = "modelopt") -> None:
    """Give ``model``'s MTP drafts an NVFP4 copy of the LM head (:attr:`Model.draft_head`), about a quarter of a
    bf16 head's bytes read per draft; the trunk keeps its head, so every emitted token is still the trunk's (a
    draft only changes how often it is accepted). A head already NVFP4 is used as it is."""
    from .model import Linear

    w = model.lm_head.weight
    if isinstance(w, torch.Tensor):
        head = Linear(model.lm_head.in_features, model.lm_head.out_features)
        head.weight = lynn_kernels.quantize(w, recipe=recipe)
        model.draft_head = head


def quantize_lm_head(model: Model, recipe: str = "modelopt") -> None:
    """Make ``model``'s LM head NVFP4 (from its float weight; an NVFP4 head stays as it is). A head tied to the
    embedding becomes a quantised copy: the embedding lookup keeps the float table."""
    w = model.lm_head.weight
    if isinstance(w, torch.Tensor):
        model.lm_head.weight = lynn_kernels.quantize(w, recipe=recipe)


class WeightCheck:
    """Damaged weights caught at load: a float tensor holding NaN or Inf, an NVFP4 block scale that is negative or
    NaN, a global scale that is not a positive finite number.

    A checkpoint holds tens of thousands of small tensors (one per expert and projection), so a check per tensor
    would cost more in launches than in bytes: small tensors of one kind are joined (``torch.cat``, a copy of at
    most :attr:`BATCH_BYTES`) and checked together, large ones alone, each with two reductions where it lands; the
    flags are read back once per shard. Only when a flag is set are that batch's tensors read again, one by one, to
    name the first damaged one."""

    _GLOBAL = ("weight_global_scale", "weight_scale_2")
    BATCH_BYTES = 64 * 2**20          #: small tensors of one kind joined up to this many bytes
    ALONE_BYTES = 4 * 2**20           #: larger tensors are checked alone

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.groups: dict[str, tuple[list, list, int]] = {}     # kind -> (entries, tensors, bytes)
        self.flags: list[tuple[list[Entry], torch.Tensor]] = []

    @classmethod
    def _kind(cls, e: Entry, t: torch.Tensor) -> str | None:
        if t.dtype == torch.float8_e4m3fn:
            return "scales"
        if t.dtype in _FLOATS:
            return f"global {t.dtype}" if e.name.endswith(cls._GLOBAL) else f"float {t.dtype}"
        return None                                                 # codes and ints: every bit pattern is a value

    @staticmethod
    def _bad(kind: str, t: torch.Tensor) -> torch.Tensor:
        if kind == "scales":                                        # their bits, no float copy
            bits = t.view(torch.uint8)
            return (bits.amax() > 0x80) | ((bits & 0x7F) == 0x7F).any()       # negative (not -0), or NaN
        lo, hi = torch.aminmax(t)
        bad = ~(torch.isfinite(lo) & torch.isfinite(hi))
        return bad | (lo <= 0) if kind.startswith("global") else bad

    def add(self, e: Entry, t: torch.Tensor) -> None:
        kind = self._kind(e, t) if self.enabled and t.numel() else None
        if kind is None:
            return
        nbytes = t.numel() * t.element_size()
        if nbytes >= self.ALONE_BYTES:
            self.flags.append(([e], self._bad(kind, t)))
            return
        entries, tensors, total = self.groups.get(kind, ([], [], 0))
        entries.append(e)
        tensors.append(t.reshape(-1))
        self.groups[kind] = (entries, tensors, total + nbytes)
        if total + nbytes >= self.BATCH_BYTES:
            self._flush(kind)

    def _flush(self, kind: str) -> None:
        entries, tensors, _ = self.groups.pop(kind)
        joined = tensors[0] if len(tensors) == 1 else torch.cat(tensors)
        self.flags.append((entries, self._bad(kind, joined)))

    def verify(self) -> None:
        """Raise :class:`LoadError` naming the first damaged tensor seen since the last call."""
        for kind in list(self.groups):
            self._flush(kind)
        if not self.flags:
            return
        pending, self.flags = self.flags, []
        bad = torch.stack([flag.reshape(()) for _, flag in pending]).cpu()
        for entries, _ in (pending[i] for i in bad.nonzero().flatten().tolist()):
            for e in entries:
                what = self.describe(e)
                if what:
                    raise LoadError(f"{e.name} in {e.file.name}: {what}: the checkpoint is damaged (a corrupted "
                                    f"download or a bad export); lynn_model.from_pretrained(check_weights=False) "
                                    f"loads it anyway")

    @classmethod
    def describe(cls, e: Entry) -> str:
        """What is wrong with one tensor, read again from its file ('' when nothing is)."""
        from safetensors import safe_open

        with safe_open(str(e.file), framework="pt") as fh:
            t = fh.get_tensor(e.name)
        if t.dtype == torch.float8_e4m3fn:
            bits = t.view(torch.uint8)
            nan, neg = int(((bits & 0x7F) == 0x7F).sum()), int((bits > 0x80).sum())
            return f"{nan} NaN and {neg} negative NVFP4 block scales of {t.numel()}" if nan or neg else ""
        t = t.float()
        nan, inf = int(t.isnan().sum()), int(t.isinf().sum())
        if nan or inf:
            return f"{nan} NaN and {inf} infinite values of {t.numel()}"
        if e.name.endswith(cls._GLOBAL) and not bool((t > 0).all()):
            return f"a global scale of {t.flatten()[0].item()!r} (expected a positive number)"
        return ""


def pack_linears(model: Model) -> int:
    """Put every NVFP4 projection of ``model`` (a :class:`~lynn_model.model.Linear`) in the packed kernels'
    layout (:func:`lynn_kernels.matmul.pack`, exact, once at load); returns how many. The MoE experts:
    :func:`pack_moe_experts`."""
    from .model import Linear

    n = 0
    for m in model.modules():
        if isinstance(m, Linear) and isinstance(m.weight, NVFP4Tensor):
            m.weight = pack(m.weight)
            n += 1
    return n


def pack_moe_experts(model: Model) -> int:
    """Put the NVFP4 experts of every MoE block in the packed layout (:func:`lynn_kernels.moe.pack_experts`,
    exact, once at load), the shared expert into the same stacks where its shape allows (the decode step then runs
    it as one more routed slot); returns how many blocks."""
    from .model import SparseMoE

    n = 0
    for m in model.modules():
        if isinstance(m, SparseMoE) and isinstance(m.w13, NVFP4Tensor) and isinstance(m.w2, NVFP4Tensor):
            m.w13, m.w2, m.shared = moe.pack_experts(m.w13, m.w2, m.shared)
            n += 1
    return n


def _build(asm: Assembler, m: Module, get, config: Config) -> None:
    """Convert one module from its tensors (``get(entry)``: on the device, checked) and hand it to ``asm``."""
    if m.fmt == "packed":
        gu = get(m.parts["gate_up_proj"])
        down = get(m.parts["down_proj"])
        n = config.moe_intermediate_size
        t = Target("linear", (n, config.hidden_size))
        for j in range(config.num_experts):
            asm.put(f"{m.name}.{j}.gate_proj", gu[j, :n].contiguous(), t)
            asm.put(f"{m.name}.{j}.up_proj", gu[j, n:].contiguous(), t)
            asm.put(f"{m.name}.{j}.down_proj", down[j].contiguous(), Target("linear", (config.hidden_size, n)))
        return
    if m.fmt == "float":
        e = m.parts.get("weight", m.parts.get(""))
        value = get(e)
    else:
        names = NVFP4_SUFFIXES[m.fmt]
        codes, scales, g = (get(m.parts[s]) for s in names)
        prefix = m.parts[names[0]].name.rpartition(".")[0] + "."
        if m.fmt == "compressed-tensors":
            value = NVFP4Tensor.from_compressed_tensors(codes, scales, g, prefix=prefix)
        else:
            value = NVFP4Tensor.from_modelopt(codes, scales, g, prefix=prefix)
    asm.put(m.name, value, m.target)


# ---------------------------------------------------------------------------------------------------------------
# models without a checkpoint


def random_model(config: Config, *, weights: str = "nvfp4", dtype: torch.dtype = torch.bfloat16, device=None,
                 seed: int = 0, keep: tuple = DEFAULT_KEEP, recipe: str = "modelopt", layout: str = "packed",
                 lm_head: str = "checkpoint", fuse: bool | None = None) -> Model:
    """A model of ``config`` with random weights drawn on ``device`` (benchmarks, shapes without a checkpoint):
    projections ``N(0, 1 / in_features)`` (those that write into the residual stream also times ``1 / sqrt(2 L)``,
    so the net is stable: bf16 rounding is not amplified layer after layer), norms near their identity, decays as HF
    initialises them; quantised on the device when ``weights="nvfp4"`` (the same rule as loading, ``keep`` stays float),
    the projections in ``layout`` as :func:`from_pretrained` puts them, the LM head as ``lm_head`` says, fused for
    decode as ``fuse`` says (:func:`from_pretrained`)."""
    if weights not in ("nvfp4", "bf16"):
        raise ValueError(f"weights = {weights!r}: expected 'nvfp4' or 'bf16'")
    _check_lm_head(lm_head)
    _check_fuse(fuse)
    if layout not in ("packed", "checkpoint"):
        raise ValueError(f"layout = {layout!r}: expected 'packed' or 'checkpoint'")
    device = runtime.DEVICE if device is None else torch.device(device)
    model = Model(config, dtype)
    asm = Assembler(model, weights, keep, recipe)
    gen = torch.Generator(device=device).manual_seed(seed)
    depth = (2 * config.num_hidden_layers) ** -0.5
    for name, t in targets(config).items():
        if name.endswith(".A_log"):
            value = torch.rand(t.shape, generator=gen, device=device).mul(15).add(1).log()
        elif name.endswith(".dt_bias"):
            value = torch.ones(t.shape, device=device)
        elif t.kind == "tensor" and len(t.shape) == 1:
            value = (torch.randn(t.shape, generator=gen, device=device) * 0.1
                     + (1.0 if name.endswith("linear_attn.norm") else 0))
        else:
            std = t.shape[-1] ** -0.5 if t.kind == "linear" else 1.0
            if name.endswith(("o_proj", "out_proj", "down_proj")):       # what each block adds to the residual
                std *= depth                                              # stays small: a stable, not chaotic, net
            value = torch.randn(t.shape, generator=gen, device=device, dtype=dtype) * std
        asm.put(name, value.to(dtype), t)
    asm.finish()
    _head(model, lm_head, recipe)
    if layout == "packed":
        pack_linears(model)
        pack_moe_experts(model)
    _fuse(model, fuse, device)
    return model.eval()


def dequantize_model(model: Model, dtype: torch.dtype | None = None) -> Model:
    """A copy of ``model`` with every NVFP4 weight dequantised (to ``dtype``, default the model's): the same
    values in a float format, for checking the NVFP4 kernels against the float path."""
    import copy

    dtype = dtype or model.dtype

    def deq(w):
        if isinstance(w, (PackedNVFP4, moe.PackedExperts)):
            w = w.unpack()
        return lynn_kernels.dequantize(w, dtype) if isinstance(w, NVFP4Tensor) else w

    out = copy.deepcopy(model)
    from .model import Linear, SparseMoE

    for m in out.modules():
        if isinstance(m, Linear):
            m.weight = deq(m.weight)
        if isinstance(m, SparseMoE):
            m.w13, m.w2 = deq(m.w13), deq(m.w2)
            if m.shared is not None:
                m.shared = moe.SharedExpert(deq(m.shared.w13), deq(m.shared.w2), m.shared.gate_weight)
    return out
