"""The decoder's configuration: one dataclass for Qwen3-Next, Qwen3.5 (dense) and Qwen3.5-MoE / Qwen3.6.

``Config.from_hf(d)`` reads a checkpoint's ``config.json`` (flat, or the VL wrapper's ``text_config``: the text part
only); :data:`PRESETS` holds the real sizes and tiny ones for tests. A config the decoder cannot run is refused with a
:class:`ConfigError` naming the field. The field meanings and where releases put them are in docs/decoder.md.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from lynn_kernels.attention import HEAD_DIMS

#: ``model_type`` (top level or ``text_config``) -> family.
MODEL_TYPES = {
    "qwen3_next": "qwen3_next",
    "qwen3_5": "qwen3_5", "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe": "qwen3_5_moe", "qwen3_5_moe_text": "qwen3_5_moe",
}
LAYER_KINDS = ("linear_attention", "full_attention")
#: Largest Gated DeltaNet head dims the chunk / recurrent kernels take; most experts the router kernel takes.
MAX_GDN_HEAD_DIM = 256
MAX_EXPERTS = 1024


class ConfigError(ValueError):
    """A ``config.json`` the decoder cannot run (the message names the field)."""


@dataclass(frozen=True)
class Config:
    """Every field the decoder reads, in the checkpoint's own names (``config.json``) where one exists.

    ``family`` is ``"qwen3_next"``, ``"qwen3_5"`` (dense) or ``"qwen3_5_moe"`` (Qwen3.5-MoE and Qwen3.6).
    ``ffn_types[i]`` is ``"moe"`` or ``"mlp"`` per layer (derived from the family, ``decoder_sparse_step`` and
    ``mlp_only_layers``); ``rotary_dim = int(head_dim * partial_rotary_factor)``.
    """

    family: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    ffn_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    rms_norm_eps: float
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    intermediate_size: int = 0                    #: dense MLP width (0 when no layer is dense)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 262144
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = field(default="", compare=False)  #: a preset's name, or the checkpoint folder

    # -- derived sizes ------------------------------------------------------------------------------------------
    @property
    def conv_dim(self) -> int:
        """Channels of the Gated DeltaNet conv: ``[q | k | v]`` = ``2 nk dk + nv dv``."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + self.linear_num_value_heads * \
            self.linear_value_head_dim

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    def replace(self, **changes) -> "Config":
        """A copy with some fields changed, validated again (e.g. ``num_hidden_layers`` for a shorter model)."""
        if "num_hidden_layers" in changes:
            n = changes["num_hidden_layers"]
            changes.setdefault("layer_types", tuple(self.layer_types[i % len(self.layer_types)] for i in range(n)))
            changes.setdefault("ffn_types", tuple(self.ffn_types[i % len(self.ffn_types)] for i in range(n)))
        return _validated(dataclasses.replace(self, **changes))

    # -- from / to config.json ----------------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, d: dict, name: str = "") -> "Config":
        """Build from a parsed ``config.json`` (flat, or with ``text_config``); raises :class:`ConfigError`."""
        top = d
        text = d.get("text_config") or d
        model_type = text.get("model_type", top.get("model_type"))
        if model_type not in MODEL_TYPES:
            raise ConfigError(f"model_type = {model_type!r}: the decoder runs {sorted(MODEL_TYPES)}")
        family = MODEL_TYPES[model_type]

        def get(key, default=None, required=False):
            for src in (text, top):
                if key in src and src[key] is not None:
                    return src[key]
            if required:
                raise ConfigError(f"config.json has no {key!r} (needed by a {model_type} decoder)")
            return default

        n_layers = int(get("num_hidden_layers", required=True))
        layer_types = get("layer_types")
        if layer_types is None:
            interval = int(get("full_attention_interval", 4))
            layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                           for i in range(n_layers)]
        layer_types = tuple(layer_types)

        num_experts = int(get("num_experts", 0) or 0) if family != "qwen3_5" else 0
        if family == "qwen3_5":
            ffn = ("mlp",) * n_layers
        elif family == "qwen3_5_moe":
            ffn = ("moe",) * n_layers
        else:
            step = int(get("decoder_sparse_step", 1))
            only = set(get("mlp_only_layers", []) or [])
            ffn = tuple("moe" if i not in only and num_experts > 0 and (i + 1) % step == 0 else "mlp"
                        for i in range(n_layers))

        rope = get("rope_parameters") or get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ConfigError(f"rope_parameters.rope_type = {rope_type!r}: only 'default' RoPE is supported "
                              f"(no YaRN / dynamic scaling)")
        theta = rope.get("rope_theta", get("rope_theta"))
        if theta is None:      # HF's own fallback: a missing theta means 10000, silently; we say so loudly
            raise ConfigError("rope_theta is missing (looked in rope_parameters, rope_scaling and the top level); "
                              "HF would silently use 10000, real checkpoints use 1e7 (Coder-Next 5e6)")
        prf = float(rope.get("partial_rotary_factor", get("partial_rotary_factor", 0.25)))
        head_dim = int(get("head_dim", required=True))

        for key, want in (("hidden_act", "silu"), ("attention_bias", False)):
            if get(key, want) != want:
                raise ConfigError(f"{key} = {get(key)!r}: the decoder supports {want!r} only")
        if get("attn_output_gate", True) is not True:
            raise ConfigError("attn_output_gate = false: this decoder's attention always has the output gate "
                              "(q_proj emits query and gate per head), as HF's does")
        eos = get("eos_token_id")
        eos = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
        moe = num_experts > 0
        cfg = cls(
            family=family, vocab_size=int(get("vocab_size", required=True)),
            hidden_size=int(get("hidden_size", required=True)), num_hidden_layers=n_layers,
            layer_types=layer_types, ffn_types=ffn,
            num_attention_heads=int(get("num_attention_heads", required=True)),
            num_key_value_heads=int(get("num_key_value_heads", required=True)),
            head_dim=head_dim, rotary_dim=int(head_dim * prf), rope_theta=float(theta),
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
            linear_num_key_heads=int(get("linear_num_key_heads", required=True)),
            linear_num_value_heads=int(get("linear_num_value_heads", required=True)),
            linear_key_head_dim=int(get("linear_key_head_dim", required=True)),
            linear_value_head_dim=int(get("linear_value_head_dim", required=True)),
            linear_conv_kernel_dim=int(get("linear_conv_kernel_dim", 4)),
            intermediate_size=int(get("intermediate_size", 0) or 0) if "mlp" in ffn else 0,
            num_experts=num_experts,
            num_experts_per_tok=int(get("num_experts_per_tok", required=moe) or 0) if moe else 0,
            moe_intermediate_size=int(get("moe_intermediate_size", required=moe) or 0) if moe else 0,
            shared_expert_intermediate_size=int(get("shared_expert_intermediate_size", 0) or 0) if moe else 0,
            # Qwen3.5-MoE always renormalises (its config has no such field); Qwen3-Next reads norm_topk_prob
            norm_topk_prob=bool(get("norm_topk_prob", True)) if family == "qwen3_next" else True,
            tie_word_embeddings=bool(top.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            max_position_embeddings=int(get("max_position_embeddings", 262144)),
            bos_token_id=get("bos_token_id"), eos_token_ids=eos, name=name)
        return _validated(cfg)

    @classmethod
    def from_pretrained(cls, path) -> "Config":
        """Read ``<path>/config.json``."""
        p = Path(path)
        f = p / "config.json" if p.is_dir() else p
        if not f.is_file():
            raise FileNotFoundError(f"no config.json at {p}")
        return cls.from_hf(json.loads(f.read_text()), name=p.name if p.is_dir() else p.parent.name)

    def to_hf(self) -> dict:
        """A flat text ``config.json`` dict HF transformers' text classes accept (``Qwen3NextConfig``,
        ``Qwen3_5TextConfig``, ``Qwen3_5MoeTextConfig``): for tests and for HF baselines of the same shape."""
        d = dict(
            model_type={"qwen3_next": "qwen3_next", "qwen3_5": "qwen3_5_text",
                        "qwen3_5_moe": "qwen3_5_moe_text"}[self.family],
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, num_hidden_layers=self.num_hidden_layers,
            layer_types=list(self.layer_types), num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
            linear_num_key_heads=self.linear_num_key_heads, linear_num_value_heads=self.linear_num_value_heads,
            linear_key_head_dim=self.linear_key_head_dim, linear_value_head_dim=self.linear_value_head_dim,
            linear_conv_kernel_dim=self.linear_conv_kernel_dim, rms_norm_eps=self.rms_norm_eps,
            hidden_act="silu", tie_word_embeddings=self.tie_word_embeddings,
            max_position_embeddings=self.max_position_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta,
                             "partial_rotary_factor": self.rotary_dim / self.head_dim})
        if self.family == "qwen3_5" or self.family == "qwen3_5_moe":
            half = self.rotary_dim // 2          # M-RoPE sections (equal rows for text: plain 1-D RoPE)
            sec = [half - 2 * (half // 3), half // 3, half // 3]
            d["rope_parameters"].update(mrope_section=sec, mrope_interleaved=True)
        if self.intermediate_size:
            d["intermediate_size"] = self.intermediate_size
        if self.num_experts:
            d.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                     moe_intermediate_size=self.moe_intermediate_size,
                     shared_expert_intermediate_size=self.shared_expert_intermediate_size)
        if self.family == "qwen3_next":
            d.update(norm_topk_prob=self.norm_topk_prob, decoder_sparse_step=1,
                     mlp_only_layers=[i for i, t in enumerate(self.ffn_types) if t == "mlp"])
        if self.bos_token_id is not None:
            d["bos_token_id"] = self.bos_token_id
        if self.eos_token_ids:
            d["eos_token_id"] = list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else self.eos_token_ids[0]
        return d


def _validated(c: Config) -> Config:
    """Refuse what the kernels cannot run, naming the field."""
    def need(ok: bool, msg: str):
        if not ok:
            raise ConfigError(msg)

    need(len(c.layer_types) == c.num_hidden_layers,
         f"layer_types has {len(c.layer_types)} entries; num_hidden_layers = {c.num_hidden_layers}")
    need(len(c.ffn_types) == c.num_hidden_layers and set(c.ffn_types) <= {"moe", "mlp"},
         f"ffn_types = {c.ffn_types}: expected 'moe' / 'mlp' for each of the {c.num_hidden_layers} layers")
    bad = sorted(set(c.layer_types) - set(LAYER_KINDS))
    need(not bad, f"layer_types contains {bad}: the decoder runs {list(LAYER_KINDS)}")
    need(c.head_dim in HEAD_DIMS, f"head_dim = {c.head_dim}: the attention kernels take {HEAD_DIMS}")
    need(c.num_attention_heads % c.num_key_value_heads == 0,
         f"num_attention_heads = {c.num_attention_heads} is not a multiple of num_key_value_heads = "
         f"{c.num_key_value_heads}")
    need(c.rotary_dim % 2 == 0 and 0 < c.rotary_dim <= c.head_dim,
         f"partial_rotary_factor gives rotary_dim = {c.rotary_dim}; expected an even number in (0, head_dim]")
    need(c.linear_num_value_heads % c.linear_num_key_heads == 0,
         f"linear_num_value_heads = {c.linear_num_value_heads} is not a multiple of linear_num_key_heads = "
         f"{c.linear_num_key_heads}")
    for key in ("linear_key_head_dim", "linear_value_head_dim"):
        v = getattr(c, key)
        need(16 <= v <= MAX_GDN_HEAD_DIM and v % 16 == 0,
             f"{key} = {v}: the Gated DeltaNet kernels take multiples of 16 up to {MAX_GDN_HEAD_DIM}")
    need(2 <= c.linear_conv_kernel_dim <= 8, f"linear_conv_kernel_dim = {c.linear_conv_kernel_dim}: expected 2..8")
    need(c.hidden_size % 16 == 0, f"hidden_size = {c.hidden_size} is not a multiple of 16 (NVFP4 blocks)")
    if "moe" in c.ffn_types:
        need(0 < c.num_experts <= MAX_EXPERTS, f"num_experts = {c.num_experts}: expected 1..{MAX_EXPERTS}")
        need(0 < c.num_experts_per_tok <= c.num_experts,
             f"num_experts_per_tok = {c.num_experts_per_tok}: expected 1..num_experts ({c.num_experts})")
        need(c.moe_intermediate_size > 0 and c.moe_intermediate_size % 16 == 0,
             f"moe_intermediate_size = {c.moe_intermediate_size}: expected a positive multiple of 16")
        need(c.shared_expert_intermediate_size % 16 == 0,
             f"shared_expert_intermediate_size = {c.shared_expert_intermediate_size}: expected a multiple of 16")
    if "mlp" in c.ffn_types:
        need(c.intermediate_size > 0 and c.intermediate_size % 16 == 0,
             f"intermediate_size = {c.intermediate_size}: dense MLP layers need a positive multiple of 16")
    return c


def _preset(_name: str, **kw) -> Config:
    return Config.from_hf(kw, name=_name)


_GDN = dict(linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
            linear_conv_kernel_dim=4)
_TINY = dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
             linear_value_head_dim=16, linear_conv_kernel_dim=4, rms_norm_eps=1e-6, rope_theta=1e7,
             partial_rotary_factor=0.25, max_position_embeddings=512)
_TINY_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)

#: Named configurations: the published sizes (from their release configs) and tiny ones for tests.
PRESETS: dict[str, Config] = {
    "qwen3-next-80b-a3b": _preset(
        _name="qwen3-next-80b-a3b", model_type="qwen3_next", vocab_size=151936, hidden_size=2048,
        num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2, head_dim=256, **_GDN,
        intermediate_size=5120, num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        rope_theta=1e7, partial_rotary_factor=0.25, rms_norm_eps=1e-6, bos_token_id=151643,
        eos_token_id=151645),
    "qwen3.5-35b-a3b": _preset(
        _name="qwen3.5-35b-a3b", model_type="qwen3_5_moe_text", vocab_size=248320, hidden_size=2048,
        num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2, head_dim=256, **_GDN,
        num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        rms_norm_eps=1e-6, bos_token_id=248044, eos_token_id=248044),
    "qwen3.5-9b": _preset(
        _name="qwen3.5-9b", model_type="qwen3_5_text", vocab_size=248320, hidden_size=4096, num_hidden_layers=32,
        num_attention_heads=16, num_key_value_heads=4, head_dim=256, **_GDN, intermediate_size=12288,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        rms_norm_eps=1e-6, bos_token_id=248044, eos_token_id=248044),
    "tiny-qwen3-next": _preset(_name="tiny-qwen3-next", model_type="qwen3_next", **_TINY, **_TINY_MOE,
                               intermediate_size=96, norm_topk_prob=True, mlp_only_layers=[1]),
    "tiny-qwen3.5": _preset(_name="tiny-qwen3.5", model_type="qwen3_5_text", **_TINY, intermediate_size=96),
    "tiny-qwen3.5-moe": _preset(_name="tiny-qwen3.5-moe", model_type="qwen3_5_moe_text", **_TINY, **_TINY_MOE),
}
PRESETS["qwen3.6-35b-a3b"] = dataclasses.replace(PRESETS["qwen3.5-35b-a3b"], name="qwen3.6-35b-a3b")


def preset(name: str) -> Config:
    """A named configuration (:data:`PRESETS`)."""
    if name not in PRESETS:
        raise KeyError(f"no preset {name!r}; presets: {sorted(PRESETS)}")
    return PRESETS[name]
