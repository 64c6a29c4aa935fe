"""The decoder's configuration: one dataclass for Qwen3-Next, Qwen3.5 (dense) and Qwen3.5-MoE / Qwen3.6.

``Config.from_hf(d)`` reads a checkpoint's ``config.json`` (flat, or the VL wrapper's ``text_config``: the text part
only); :data:`PRESETS` holds the real sizes and tiny ones for tests. A config the decoder cannot run is refused with a
:class:`ConfigError` naming the field. The field meanings and where releases put them are in docs/decoder.md.
"""

from __future__ import annotations

import dataclasses
import json
import math
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
#: Most layers a config may declare (the largest published models of the family have 48 to 64): checked before the
#: per-layer lists are built, so a bad count is refused at once rather than expanded until memory runs out.
MAX_LAYERS = 1024
#: Largest vocabulary: token ids must fit an int32.
MAX_VOCAB = 2**31 - 1


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
    #: multi-token prediction layers (``mtp.*``): set by the loader from the tensors a checkpoint holds (configs
    #: announce one whether or not the file carries it), or by hand for a random model
    mtp_layers: int = 0
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

    @property
    def mtp_attention_layers(self) -> tuple[int, ...]:
        """The cache index of each MTP layer's attention: after the trunk's layers, as vLLM numbers them."""
        return tuple(range(self.num_hidden_layers, self.num_hidden_layers + self.mtp_layers))

    @property
    def mtp_ffn(self) -> str:
        """The MTP layer's FFN: the routed experts in a MoE model, the dense MLP in a dense one."""
        return "moe" if self.num_experts else "mlp"

    def replace(self, **changes) -> "Config":
        """A copy with some fields changed, validated again (e.g. ``num_hidden_layers`` for a shorter model)."""
        if "num_hidden_layers" in changes:
            n = _int("num_hidden_layers", changes["num_hidden_layers"], *_INT_FIELDS["num_hidden_layers"])
            changes.setdefault("layer_types", tuple(self.layer_types[i % len(self.layer_types)] for i in range(n)))
            changes.setdefault("ffn_types", tuple(self.ffn_types[i % len(self.ffn_types)] for i in range(n)))
        return _validated(dataclasses.replace(self, **changes))

    # -- from / to config.json ----------------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, d: dict, name: str = "") -> "Config":
        """Build from a parsed ``config.json`` (flat, or with ``text_config``); raises :class:`ConfigError`."""
        if not isinstance(d, dict):
            raise ConfigError(f"config.json: expected a JSON object, found {_kind(d)}")
        top, text = d, d.get("text_config")
        if text is None or text == {}:
            text = d
        elif not isinstance(text, dict):
            raise ConfigError(f"text_config = {_short(text)}: expected an object (the text model's config), found "
                              f"{_kind(text)}")
        model_type = text.get("model_type", top.get("model_type"))
        if not isinstance(model_type, str) or model_type not in MODEL_TYPES:
            raise ConfigError(f"model_type = {_short(model_type)}: the decoder runs {sorted(MODEL_TYPES)}")
        family = MODEL_TYPES[model_type]

        def get(key, default=None, required=False):
            for src in (text, top):
                if key in src and src[key] is not None:
                    return src[key]
            if required:
                if key in text or key in top:
                    raise ConfigError(f"{key} = null: expected a value (needed by a {model_type} decoder)")
                raise ConfigError(f"config.json has no {key!r} (needed by a {model_type} decoder)")
            return default

        # the counts that are expanded into per-layer lists are read, and bounded, before anything is expanded
        n_layers = _int("num_hidden_layers", get("num_hidden_layers", required=True), *_INT_FIELDS["num_hidden_layers"])
        layer_types = get("layer_types")
        if layer_types is None:
            interval = _int("full_attention_interval", get("full_attention_interval", 4), 1)
            layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                           for i in range(n_layers)]
        elif not isinstance(layer_types, list) or len(layer_types) != n_layers or not all(
                isinstance(t, str) for t in layer_types):
            raise ConfigError(f"layer_types = {_short(layer_types)}: expected a list of {n_layers} strings (one per "
                              f"layer: num_hidden_layers = {n_layers}), each {' or '.join(map(repr, LAYER_KINDS))}")
        layer_types = tuple(layer_types)

        num_experts = _int("num_experts", get("num_experts", 0), *_INT_FIELDS["num_experts"]) if family != "qwen3_5" \
            else 0
        if family == "qwen3_5":
            ffn = ("mlp",) * n_layers
        elif family == "qwen3_5_moe":
            ffn = ("moe",) * n_layers
        else:
            step = _int("decoder_sparse_step", get("decoder_sparse_step", 1), 1)
            only = get("mlp_only_layers", [])
            if not isinstance(only, list) or len(only) > n_layers or not all(
                    type(i) is int and 0 <= i < n_layers for i in only):
                raise ConfigError(f"mlp_only_layers = {_short(only)}: expected a list of layer indices (integers in "
                                  f"[0, num_hidden_layers = {n_layers})), at most one per layer")
            only = set(only)
            ffn = tuple("moe" if i not in only and num_experts > 0 and (i + 1) % step == 0 else "mlp"
                        for i in range(n_layers))

        rope_key = "rope_parameters" if get("rope_parameters") else "rope_scaling"
        rope = get(rope_key) or {}
        if not isinstance(rope, dict):
            raise ConfigError(f"{rope_key} = {_short(rope)}: expected an object (rope_type, rope_theta, ...), found "
                              f"{_kind(rope)}")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ConfigError(f"rope_parameters.rope_type = {rope_type!r}: only 'default' RoPE is supported "
                              f"(no YaRN / dynamic scaling)")
        theta = rope.get("rope_theta", get("rope_theta"))
        if theta is None:      # HF's own fallback: a missing theta means 10000, silently; we say so loudly
            raise ConfigError("rope_theta is missing (looked in rope_parameters, rope_scaling and the top level); "
                              "HF would silently use 10000, real checkpoints use 1e7 (Coder-Next 5e6)")
        prf = _float("partial_rotary_factor", rope.get("partial_rotary_factor", get("partial_rotary_factor", 0.25)),
                     hi=1.0)
        head_dim = _int("head_dim", get("head_dim", required=True), *_INT_FIELDS["head_dim"])

        for key, want in (("hidden_act", "silu"), ("attention_bias", False)):
            if get(key, want) != want:
                raise ConfigError(f"{key} = {get(key)!r}: the decoder supports {want!r} only")
        if get("attn_output_gate", True) is not True:
            raise ConfigError("attn_output_gate = false: this decoder's attention always has the output gate "
                              "(q_proj emits query and gate per head), as HF's does")
        eos = get("eos_token_id")
        moe = num_experts > 0
        cfg = cls(
            family=family, vocab_size=get("vocab_size", required=True),
            hidden_size=get("hidden_size", required=True), num_hidden_layers=n_layers,
            layer_types=layer_types, ffn_types=ffn,
            num_attention_heads=get("num_attention_heads", required=True),
            num_key_value_heads=get("num_key_value_heads", required=True),
            head_dim=head_dim, rotary_dim=int(head_dim * prf), rope_theta=_float("rope_theta", theta),
            rms_norm_eps=_float("rms_norm_eps", get("rms_norm_eps", 1e-6)),
            linear_num_key_heads=get("linear_num_key_heads", required=True),
            linear_num_value_heads=get("linear_num_value_heads", required=True),
            linear_key_head_dim=get("linear_key_head_dim", required=True),
            linear_value_head_dim=get("linear_value_head_dim", required=True),
            linear_conv_kernel_dim=get("linear_conv_kernel_dim", 4),
            intermediate_size=get("intermediate_size", 0) if "mlp" in ffn else 0,
            num_experts=num_experts,
            num_experts_per_tok=get("num_experts_per_tok", required=moe) if moe else 0,
            moe_intermediate_size=get("moe_intermediate_size", required=moe) if moe else 0,
            shared_expert_intermediate_size=get("shared_expert_intermediate_size", 0) if moe else 0,
            # Qwen3.5-MoE always renormalises (its config has no such field); Qwen3-Next reads norm_topk_prob
            norm_topk_prob=get("norm_topk_prob", True) if family == "qwen3_next" else True,
            tie_word_embeddings=next((src["tie_word_embeddings"] for src in (top, text)
                                      if src.get("tie_word_embeddings") is not None), False),
            max_position_embeddings=get("max_position_embeddings", 262144),
            bos_token_id=get("bos_token_id"),
            eos_token_ids=() if eos is None else _token_ids("eos_token_id", eos, many=True), name=name)
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


#: Integer fields: (smallest, largest or None, why the bound). Sizes need not be multiples of 16: that is NVFP4's
#: block rule, applied where weights are quantised (a projection whose K is not a multiple of 16 stays in float).
_INT_FIELDS = {
    "num_hidden_layers": (1, MAX_LAYERS, "the largest published models of the family have 48 to 64 layers"),
    "vocab_size": (1, MAX_VOCAB, "token ids must fit an int32"),
    "hidden_size": (1, None, ""),
    "num_attention_heads": (1, None, ""),
    "num_key_value_heads": (1, None, ""),
    "head_dim": (1, None, ""),
    "linear_num_key_heads": (1, None, ""),
    "linear_num_value_heads": (1, None, ""),
    "linear_key_head_dim": (1, None, ""),
    "linear_value_head_dim": (1, None, ""),
    "linear_conv_kernel_dim": (2, 8, "the conv widths the Gated DeltaNet kernels take"),
    "intermediate_size": (0, None, ""),
    "num_experts": (0, MAX_EXPERTS, "the routing and align kernels' limit"),
    "num_experts_per_tok": (0, None, ""),
    "moe_intermediate_size": (0, None, ""),
    "shared_expert_intermediate_size": (0, None, ""),
    "max_position_embeddings": (1, None, ""),
    "mtp_layers": (0, 4, "published checkpoints carry one MTP layer"),
}


def _validated(c: Config) -> Config:
    """Refuse what the kernels cannot run, naming the field."""
    def need(ok: bool, msg: str):
        if not ok:
            raise ConfigError(msg)

    for key, (lo, hi, why) in _INT_FIELDS.items():       # first: every later check divides by or counts with these
        _int(key, getattr(c, key), lo, hi, why)
    _float("rope_theta", c.rope_theta)
    _float("rms_norm_eps", c.rms_norm_eps)
    for key in ("norm_topk_prob", "tie_word_embeddings"):
        v = getattr(c, key)
        need(type(v) is bool, f"{key} = {_short(v)}: expected true or false, found {_kind(v)}")
    families = sorted(set(MODEL_TYPES.values()))
    need(c.family in families, f"family = {_short(c.family)}: expected one of {families}")
    need(isinstance(c.layer_types, tuple) and len(c.layer_types) == c.num_hidden_layers,
         f"layer_types has {len(c.layer_types)} entries; num_hidden_layers = {c.num_hidden_layers}")
    need(isinstance(c.ffn_types, tuple) and len(c.ffn_types) == c.num_hidden_layers
         and all(t in ("moe", "mlp") for t in c.ffn_types),
         f"ffn_types = {_short(c.ffn_types)}: expected 'moe' / 'mlp' for each of the {c.num_hidden_layers} layers")
    bad = sorted({_short(t) for t in c.layer_types if t not in LAYER_KINDS})
    need(not bad, f"layer_types contains {bad}: the decoder runs {list(LAYER_KINDS)}")
    need(c.head_dim in HEAD_DIMS, f"head_dim = {c.head_dim}: the attention kernels take {HEAD_DIMS}")
    need(c.num_attention_heads % c.num_key_value_heads == 0,
         f"num_attention_heads = {c.num_attention_heads} is not a multiple of num_key_value_heads = "
         f"{c.num_key_value_heads}")
    need(type(c.rotary_dim) is int and c.rotary_dim % 2 == 0 and 0 < c.rotary_dim <= c.head_dim,
         f"partial_rotary_factor gives rotary_dim = {c.rotary_dim}; expected an even number in (0, head_dim]")
    need(c.linear_num_value_heads % c.linear_num_key_heads == 0,
         f"linear_num_value_heads = {c.linear_num_value_heads} is not a multiple of linear_num_key_heads = "
         f"{c.linear_num_key_heads}")
    for key in ("linear_key_head_dim", "linear_value_head_dim"):
        v = getattr(c, key)
        need(16 <= v <= MAX_GDN_HEAD_DIM and v % 16 == 0,
             f"{key} = {v}: the Gated DeltaNet kernels take multiples of 16 up to {MAX_GDN_HEAD_DIM}")
    if "moe" in c.ffn_types:
        need(0 < c.num_experts <= MAX_EXPERTS, f"num_experts = {c.num_experts}: expected 1..{MAX_EXPERTS}")
        need(0 < c.num_experts_per_tok <= c.num_experts,
             f"num_experts_per_tok = {c.num_experts_per_tok}: expected 1..num_experts ({c.num_experts})")
        need(c.moe_intermediate_size > 0,
             f"moe_intermediate_size = {c.moe_intermediate_size}: MoE layers need a positive size")
        for key in ("hidden_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
            v = getattr(c, key)              # the same rule as lynn_kernels.moe's argument check (check_ffn)
            need(v % 2 == 0, f"{key} = {v}: MoE layers need an even size (the grouped expert kernels read float "
                             f"expert weights in column pairs)")
    if "mlp" in c.ffn_types:
        need(c.intermediate_size > 0,
             f"intermediate_size = {c.intermediate_size}: dense MLP layers need a positive size")
    if c.bos_token_id is not None:
        _token_ids("bos_token_id", c.bos_token_id, many=False, vocab=c.vocab_size)
    need(isinstance(c.eos_token_ids, tuple), f"eos_token_ids = {_short(c.eos_token_ids)}: expected a tuple of ints")
    eos = list(c.eos_token_ids)
    _token_ids("eos_token_id", eos[0] if len(eos) == 1 else eos, many=True, vocab=c.vocab_size)
    return c


def _kind(v) -> str:
    """What a JSON value is, for messages: ``a string``, ``a float``, ``null``, ..."""
    if v is None:
        return "null"
    name = {bool: "a bool", int: "an integer", float: "a float", str: "a string", list: "a list", tuple: "a list",
            dict: "an object"}.get(type(v))
    return name or f"a {type(v).__name__}"


def _short(v, n: int = 80) -> str:
    """``repr(v)``, cut to ``n`` characters (a hostile value must not flood the message)."""
    r = repr(v)
    return r if len(r) <= n else r[:n - 3] + "..."


def _int(key: str, v, lo: int, hi: int | None = None, why: str = "") -> int:
    """``v`` read strictly as an integer in ``[lo, hi]``: a JSON integer, not a string, float, bool, list or null
    (``int()`` would turn "2048" or 2048.7 into a size without a word)."""
    if type(v) is not int:
        raise ConfigError(f"{key} = {_short(v)}: expected an integer, found {_kind(v)}")
    if v < lo or (hi is not None and v > hi):
        want = f"{lo}..{hi}" if hi is not None else f"an integer >= {lo}"
        raise ConfigError(f"{key} = {v}: expected {want}{f' ({why})' if why else ''}")
    return v


def _float(key: str, v, hi: float | None = None) -> float:
    """``v`` read strictly as a finite number > 0 (and <= ``hi``): the kernels divide by these or raise them to a
    power, where 0, a negative, NaN or inf gives NaN logits."""
    if type(v) not in (int, float):
        raise ConfigError(f"{key} = {_short(v)}: expected a number, found {_kind(v)}")
    if not (math.isfinite(v) and v > 0 and (hi is None or v <= hi)):
        raise ConfigError(f"{key} = {v!r}: expected a finite number > 0{f' and <= {hi:g}' if hi is not None else ''}")
    return float(v)


def _token_ids(key: str, v, many: bool, vocab: int | None = None):
    """A token id (``many=False``: an integer) or ids (``many``: an integer or a list of integers), each in
    ``[0, vocab)`` when ``vocab`` is given; returns the id, or a tuple of the ids."""
    ids = v if many and isinstance(v, list) else [v]
    bad = [i for i in ids if type(i) is not int]
    if bad:
        want = "an integer or a list of integers" if many else "an integer"
        found = f"a list holding {_kind(bad[0])}" if ids is v else _kind(v)
        raise ConfigError(f"{key} = {_short(v)}: expected {want} (token ids), found {found}")
    if vocab is not None and not all(0 <= i < vocab for i in ids):
        raise ConfigError(f"{key} = {_short(v)}: expected token ids in [0, vocab_size = {vocab})")
    return tuple(ids) if many else v


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
