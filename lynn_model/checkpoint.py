"""A HF model folder read and checked before any tensor data is read (then :mod:`lynn_model.loader` loads it).

* ``config.json`` (flat or with ``text_config``) -> :class:`~lynn_model.config.Config` (:func:`read_config`, its
  layer and expert counts first checked against the tensors, :func:`check_counts`), its quantisation config
  (:class:`QuantConfig`);
* ``model.safetensors``, or the shards of ``model.safetensors.index.json`` (:func:`shard_files`), each header
  checked entry by entry (:func:`read_header`; :func:`read_headers` -> an :class:`Entry` per tensor);
* names under ``model.`` or ``model.language_model.`` (release VL wrappers), and the MTP module's ``mtp.*``;
  ``model.visual.*`` is skipped (:func:`canonical`); experts per expert (``experts.{e}.gate_proj.weight``) or packed
  (``experts.gate_up_proj [E, 2I, H]``);
* each projection's format is read off the tensors present: a float ``weight``; compressed-tensors NVFP4
  (``weight_packed``, ``weight_scale``, ``weight_global_scale``); ModelOpt NVFP4 (uint8 ``weight``,
  ``weight_scale``, ``weight_scale_2``). The config's ``ignore`` / ``exclude_modules`` list must agree (an error
  otherwise). FP8 weights are refused by name.

:func:`plan` groups the entries into the modules a model of the config holds (:func:`targets`) and checks their
names, shapes, dtypes and formats, so a missing, unexpected, mis-shaped or wrongly typed tensor is reported (with its
file) before any data is read. Formats and rules: docs/decoder.md.
"""

from __future__ import annotations

import fnmatch
import json
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .config import Config, ConfigError

NVFP4_SUFFIXES = {"compressed-tensors": ("weight_packed", "weight_scale", "weight_global_scale"),
                  "modelopt": ("weight", "weight_scale", "weight_scale_2")}
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)
SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
              "U8": torch.uint8, "I8": torch.int8, "I32": torch.int32, "I64": torch.int64,
              "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "BOOL": torch.bool}


class LoadError(ValueError):
    """A checkpoint the loader cannot read into the model (the message names the tensor and its file)."""


# ---------------------------------------------------------------------------------------------------------------
# what the model expects


@dataclass
class Target:
    """One checkpoint module: ``kind`` ``"tensor"`` (a plain parameter) or ``"linear"`` (a projection, float or
    NVFP4); ``shape`` the logical float shape; ``quantizable``: may hold / be quantised to NVFP4."""

    kind: str
    shape: tuple
    quantizable: bool = True


def targets(config: Config) -> dict[str, Target]:
    """Every module name a checkpoint of ``config`` holds (HF names after the ``model.`` prefix rule)."""
    c, t = config, {}
    h = c.hidden_size
    t["model.embed_tokens"] = Target("tensor", (c.vocab_size, h))
    t["model.norm"] = Target("tensor", (h,))
    if not c.tie_word_embeddings:
        t["lm_head"] = Target("linear", (c.vocab_size, h))
    for i in range(c.num_hidden_layers):
        _layer_targets(t, c, f"model.layers.{i}.", c.layer_types[i], c.ffn_types[i])
    if c.mtp_layers:                 # the MTP module: fc joins [embedding | hidden], then full-attention layers
        t["mtp.fc"] = Target("linear", (h, 2 * h))
        for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            t["mtp." + n] = Target("tensor", (h,))
        for j in range(c.mtp_layers):
            _layer_targets(t, c, f"mtp.layers.{j}.", "full_attention", c.mtp_ffn)
    return t


def _layer_targets(t: dict, c: Config, p: str, kind: str, ffn: str) -> None:
    """The modules of one decoder layer under prefix ``p`` (a trunk layer, or an MTP layer)."""
    h = c.hidden_size
    t[p + "input_layernorm"] = Target("tensor", (h,))
    t[p + "post_attention_layernorm"] = Target("tensor", (h,))
    if kind == "full_attention":
        hq, hkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        a = p + "self_attn."
        t[a + "q_proj"] = Target("linear", (2 * hq * d, h))
        t[a + "k_proj"] = Target("linear", (hkv * d, h))
        t[a + "v_proj"] = Target("linear", (hkv * d, h))
        t[a + "o_proj"] = Target("linear", (h, hq * d))
        t[a + "q_norm"] = Target("tensor", (d,))
        t[a + "k_norm"] = Target("tensor", (d,))
    else:
        nk, nv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, \
            c.linear_value_head_dim
        g = p + "linear_attn."
        if c.family == "qwen3_next":          # head-grouped, permuted at load (loader.split_qkvz)
            t[g + "in_proj_qkvz"] = Target("linear", (2 * nk * dk + 2 * nv * dv, h))
            t[g + "in_proj_ba"] = Target("linear", (2 * nv, h))
        else:
            t[g + "in_proj_qkv"] = Target("linear", (c.conv_dim, h))
            t[g + "in_proj_z"] = Target("linear", (nv * dv, h))
            t[g + "in_proj_b"] = Target("linear", (nv, h))
            t[g + "in_proj_a"] = Target("linear", (nv, h))
        t[g + "conv1d"] = Target("tensor", (c.conv_dim, 1, c.linear_conv_kernel_dim))
        t[g + "dt_bias"] = Target("tensor", (nv,))
        t[g + "A_log"] = Target("tensor", (nv,))
        t[g + "norm"] = Target("tensor", (dv,))
        t[g + "out_proj"] = Target("linear", (h, nv * dv))
    m = p + "mlp."
    if ffn == "mlp":
        n = c.intermediate_size
        t[m + "gate_proj"], t[m + "up_proj"] = Target("linear", (n, h)), Target("linear", (n, h))
        t[m + "down_proj"] = Target("linear", (h, n))
    else:
        e, n, s = c.num_experts, c.moe_intermediate_size, c.shared_expert_intermediate_size
        t[m + "gate"] = Target("linear", (e, h), quantizable=False)
        for j in range(e):
            t[m + f"experts.{j}.gate_proj"] = Target("linear", (n, h))
            t[m + f"experts.{j}.up_proj"] = Target("linear", (n, h))
            t[m + f"experts.{j}.down_proj"] = Target("linear", (h, n))
        if s:
            t[m + "shared_expert.gate_proj"] = Target("linear", (s, h))
            t[m + "shared_expert.up_proj"] = Target("linear", (s, h))
            t[m + "shared_expert.down_proj"] = Target("linear", (h, s))
            t[m + "shared_expert_gate"] = Target("linear", (1, h), quantizable=False)


_PACKED_EXPERTS = re.compile(r"^((?:model|mtp)\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_EXPERT = re.compile(r"^((?:model|mtp)\.layers\.(\d+)\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)$")


def canonical(name: str) -> str | None:
    """A checkpoint tensor name in the model's terms, or None for what the text decoder skips."""
    if name.startswith("model.language_model."):
        name = "model." + name[len("model.language_model."):]
    elif name.startswith("language_model."):
        name = name[len("language_model."):]
        name = name if name.startswith(("model.", "lm_head")) else "model." + name
    if name.startswith("model.mtp."):
        name = name[len("model."):]
    if name.startswith(("model.visual.", "visual.")):
        return None
    return name


def mtp_layers_in(entries: list["Entry"]) -> int:
    """How many MTP layers the checkpoint holds (``mtp.layers.{j}.*``; 0 without an MTP module)."""
    found = {int(m.group(1)) for e in entries if (m := re.match(r"mtp\.layers\.(\d+)\.", canonical(e.name) or ""))}
    return max(found) + 1 if found else 0


# ---------------------------------------------------------------------------------------------------------------
# the quantisation config's exclusion lists (a cross-check only)


@dataclass
class QuantConfig:
    method: str | None = None                     #: "compressed-tensors", "modelopt" or None
    patterns: list = field(default_factory=list)  #: (kind, pattern): kind "exact" | "re" | "glob"

    def excluded(self, module: str) -> bool:
        for kind, pat in self.patterns:
            if (kind == "exact" and module == pat) or (kind == "re" and re.match(pat, module)) or \
                    (kind == "glob" and fnmatch.fnmatchcase(module, pat)):
                return True
        return False

    @staticmethod
    def read(folder: Path, cfg: dict) -> "QuantConfig":
        qc = cfg.get("quantization_config") or (cfg.get("text_config") or {}).get("quantization_config")
        hf_quant = folder / "hf_quant_config.json"
        if hf_quant.is_file():
            q = read_json(hf_quant).get("quantization", {})
            _check_modelopt_algo(q, hf_quant.name)
            return QuantConfig("modelopt", [("glob", p) for p in q.get("exclude_modules") or []])
        if not qc:
            return QuantConfig()
        method = qc.get("quant_method")
        if method == "compressed-tensors":
            fmt = qc.get("format")
            if fmt not in ("nvfp4-pack-quantized", "dense", None):
                raise LoadError(f"config.json quantization_config.format = {fmt!r}: the loader reads "
                                f"compressed-tensors 'nvfp4-pack-quantized' (NVFP4) checkpoints")
            pats = [("re", p[3:]) if p.startswith("re:") else ("exact", p) for p in qc.get("ignore") or []]
            return QuantConfig("compressed-tensors", pats)
        if method == "modelopt":
            _check_modelopt_algo(qc.get("quantization", qc), "config.json quantization_config")
            excl = qc.get("exclude_modules") or qc.get("ignore") or qc.get("quantization", {}).get("exclude_modules") \
                or []                                  # ModelOpt's config.json form names the list "ignore"
            return QuantConfig("modelopt", [("glob", p) for p in excl])
        raise LoadError(f"config.json quantization_config.quant_method = {method!r}: the loader reads "
                        f"'compressed-tensors' and 'modelopt' NVFP4 checkpoints")


def _check_modelopt_algo(q: dict, where: str) -> None:
    algo = q.get("quant_algo")
    if algo not in (None, "NVFP4", "W4A16_NVFP4", "MIXED_PRECISION"):
        raise LoadError(f"{where}: quant_algo = {algo!r}; the loader reads NVFP4 (and MIXED_PRECISION whose "
                        f"layers are NVFP4 or unquantised)")


# ---------------------------------------------------------------------------------------------------------------
# headers


@dataclass
class Entry:
    name: str          #: as in the file
    file: Path
    dtype: torch.dtype
    shape: tuple


def read_json(path: Path) -> dict:
    try:
        d = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise LoadError(f"{path}: not valid JSON ({e or 'nested too deep'})") from e
    if not isinstance(d, dict):
        raise LoadError(f"{path}: expected a JSON object, found a {type(d).__name__}")
    return d


#: Largest safetensors header read (the format's own reader refuses more than 100 MB).
MAX_HEADER_BYTES = 100 * 2**20


def shard_path(folder: Path, name, where: str) -> Path:
    """``folder / name`` for a shard ``name`` read from ``where`` (the index entry), refused unless it is a plain file
    name that stays inside ``folder``: no separator, no ``..``, not absolute, and no symlink that leaves the folder,
    except into the ``blobs/`` beside a Hugging Face cache's ``snapshots/<rev>/`` folder (how the hub stores files)."""
    if not isinstance(name, str) or not name:
        raise LoadError(f"{where}: a shard must be a file name (a string), found {name!r}")
    if name in (".", "..") or "/" in name or "\\" in name or "\0" in name or Path(name).is_absolute():
        raise LoadError(f"{where} names the shard {name!r}: a shard must be a plain file name inside {folder} (no "
                        f"folder separator, no '..', not an absolute path)")
    path = folder / name
    if path.is_symlink():
        real, home = path.resolve(), folder.resolve()
        blobs = home.parent.parent / "blobs" if home.parent.name == "snapshots" else None
        if home not in real.parents and not (blobs and blobs in real.parents):
            raise LoadError(f"{where} names the shard {name!r}, a symlink to {real}, outside {folder}: a shard must "
                            f"be a file inside the model folder")
    return path


def shard_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise LoadError(f"{index}: no weight_map (expected an object of tensor name -> shard file name)")
        files = {}
        for tensor, f in weight_map.items():
            if f not in files:
                files[f] = shard_path(folder, f, f"{index.name}, weight_map[{tensor!r}]")
        for f, path in files.items():
            if not path.is_file():
                names = [n for n, v in weight_map.items() if v == f]
                raise LoadError(f"{index.name} names {f} (for {names[0]} and {len(names) - 1} more tensors), but "
                                f"{path} does not exist")
        return list(files.values())
    single = folder / "model.safetensors"
    if single.is_file():
        return [shard_path(folder, single.name, str(folder))]
    found = sorted(folder.glob("*.safetensors"))
    if found:
        return [shard_path(folder, f.name, str(folder)) for f in found]
    pickles = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
    hint = f" (found {pickles}: only safetensors is read, never pickle)" if pickles else ""
    raise LoadError(f"no model.safetensors or model.safetensors.index.json in {folder}{hint}")


def read_header(f: Path) -> tuple[dict, int]:
    """One shard's safetensors header, checked entry by entry, and where its data starts (no data read)."""
    size = f.stat().st_size
    try:
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            if n <= 0 or 8 + n > size or n > MAX_HEADER_BYTES:
                raise LoadError(f"{f}: not a safetensors file, or truncated (header of {n} bytes, file of {size})")
            header = json.loads(fh.read(n))
    except LoadError:
        raise
    except RecursionError as e:
        raise LoadError(f"{f}: corrupt safetensors header (JSON nested too deep)") from e
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise LoadError(f"{f}: cannot read the safetensors header ({e})") from e
    if not isinstance(header, dict):
        raise LoadError(f"{f}: corrupt safetensors header (a JSON {type(header).__name__}, not an object)")
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
            raise LoadError(f"{name} in {f.name}: corrupt safetensors header (an entry needs dtype, shape and "
                            f"data_offsets)")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(dtype, str) or dtype not in SAFETENSORS_DTYPES:
            raise LoadError(f"{name} in {f.name} has dtype {dtype!r}, which the loader does not read (it reads "
                            f"{', '.join(SAFETENSORS_DTYPES)})")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise LoadError(f"{name} in {f.name}: corrupt safetensors header (shape {shape!r}: expected a list of "
                            f"non-negative ints)")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            raise LoadError(f"{name} in {f.name}: corrupt safetensors header (data_offsets {offsets!r}: expected "
                            f"[begin, end] with 0 <= begin <= end)")
        need = _numel(shape) * SAFETENSORS_DTYPES[dtype].itemsize
        if offsets[1] - offsets[0] != need:
            raise LoadError(f"{name} in {f.name}: corrupt safetensors header ({dtype} {shape} needs {need} bytes, "
                            f"data_offsets span {offsets[1] - offsets[0]})")
        spans.append((offsets[1], name))
    end, last = max(spans, default=(0, ""))
    if 8 + n + end > size:
        raise LoadError(f"{f} is truncated: its header describes {8 + n + end} bytes, the file has {size} (the data "
                        f"of {last} is cut)")
    return header, 8 + n


def read_headers(folder: Path) -> list[Entry]:
    """Name, dtype and shape of every tensor of every shard, from the safetensors headers (no data read)."""
    entries = []
    for f in shard_files(Path(folder)):
        header, _ = read_header(f)
        entries += [Entry(name, f, SAFETENSORS_DTYPES[info["dtype"]], tuple(info["shape"]))
                    for name, info in header.items() if name != "__metadata__"]
    return entries


def read_config(raw: dict, path: Path, entries: list[Entry] | None = None) -> Config:
    """:meth:`Config.from_hf` of the parsed ``config.json`` at ``path``, its errors naming the file; with the
    checkpoint's ``entries``, ``mtp_layers`` as the files hold them (:func:`mtp_layers_in`)."""
    try:
        config = Config.from_hf(raw, name=path.parent.name)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None
    n_mtp = mtp_layers_in(entries) if entries is not None else 0
    return config.replace(mtp_layers=n_mtp) if n_mtp else config


def check_counts(raw: dict, entries: list[Entry], where: Path) -> None:
    """Refuse a ``config.json`` that asks for more layers or experts than the checkpoint holds, before the config
    is expanded into per-layer and per-expert lists (a hostile count would otherwise exhaust memory)."""
    layers, experts = {-1}, {-1}
    for e in entries:
        name = canonical(e.name) or ""
        m = re.match(r"model\.layers\.(\d+)\.(mlp\.experts\.(\d+)\.)?", name)
        if m:
            layers.add(int(m.group(1)))
            if m.group(3):
                experts.add(int(m.group(3)))
            elif _PACKED_EXPERTS.match(name) and e.shape:
                experts.add(e.shape[0] - 1)
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    for key, found, what in (("num_hidden_layers", max(layers) + 1, "layers"),
                             ("num_experts", max(experts) + 1, "routed experts per layer")):
        value = text.get(key, raw.get(key))
        if type(value) is int and found and value > found:
            raise LoadError(f"{where}: {key} = {value}, but the checkpoint's safetensors hold {found} {what}")
        if type(value) is int and key == "num_hidden_layers" and value > 0 and max(layers) < 0:
            raise LoadError(f"{where}: {key} = {value}, but the checkpoint's safetensors hold no model.layers.* "
                            f"tensors")


# ---------------------------------------------------------------------------------------------------------------
# the plan: which tensors make each module, in which format


@dataclass
class Module:
    name: str                                   #: canonical module name
    target: Target
    parts: dict = field(default_factory=dict)   #: suffix -> Entry
    fmt: str = ""                               #: "float", "compressed-tensors", "modelopt", "packed"


#: The scales of an FP8 KV cache (ModelOpt ``kv_cache_quant_algo: "FP8"``, llm-compressor ``kv_cache_scheme``) on an
#: attention layer: ``self_attn.k_proj.k_scale``, ``self_attn.v_proj.v_scale`` or ``self_attn.{k,v}_scale``.
_KV_SCALE = re.compile(r"\.self_attn\.(?:k_proj\.k|v_proj\.v|[kv])_scale$")
#: Most values an FP8 KV-cache scale may hold (per tensor, per KV head or per channel of one head).
_KV_SCALE_MAX = 4096


def _err_shape(e: Entry, want, what="") -> LoadError:
    return LoadError(f"{e.name} in {e.file.name} has shape {list(e.shape)}; expected {list(want)}{what}")


def plan(config: Config, entries: list[Entry], quant: QuantConfig) -> tuple[dict[str, Module], dict[str, Module]]:
    """Group the entries by module and check names, shapes and dtypes; returns ``(modules, packed_experts)``."""
    want = targets(config)
    mods: dict[str, Module] = {}
    packed: dict[str, Module] = {}
    kv_scales: list[str] = []
    for e in entries:
        name = canonical(e.name)
        if name is None:
            continue
        if name.endswith((".input_scale", ".input_global_scale")):       # W4A4 activation scales: unused
            if e.dtype != torch.float32:
                raise LoadError(f"{e.name} in {e.file.name} has dtype {e.dtype}; expected torch.float32")
            continue
        if _KV_SCALE.search(name):                     # an FP8 KV cache's scales: the cache stays bf16, said once
            if e.dtype not in _FLOATS or _numel(e.shape) > _KV_SCALE_MAX:
                raise LoadError(f"{e.name} in {e.file.name} has dtype {e.dtype} {list(e.shape)}; an FP8 KV-cache "
                                f"scale is a float tensor of at most {_KV_SCALE_MAX} values")
            kv_scales.append(e.name)
            continue
        pm = _PACKED_EXPERTS.match(name)
        if pm:
            m = packed.setdefault(pm.group(1), Module(pm.group(1), Target("packed", ()), fmt="packed"))
            m.parts[pm.group(2)] = e
            continue
        if name in want:
            module, suffix = name, ""
        else:
            module, _, suffix = name.rpartition(".")
            if module not in want:
                if config.tie_word_embeddings and name == "lm_head.weight":
                    continue                           # a tied head stored anyway: the embedding is used
                raise LoadError(f"unexpected tensor {e.name} in {e.file.name}: no module {module!r} in a "
                                f"{config.family} model of this config")
        m = mods.setdefault(module, Module(module, want[module]))
        if suffix in m.parts:
            raise LoadError(f"{e.name} appears twice ({m.parts[suffix].file.name} and {e.file.name})")
        m.parts[suffix] = e
    # packed experts stand for the per-expert modules of their layer
    for prefix, pm in packed.items():
        if set(pm.parts) != {"gate_up_proj", "down_proj"}:
            raise LoadError(f"{prefix}: packed experts need gate_up_proj and down_proj, found {sorted(pm.parts)}")
        e_, n, h = config.num_experts, config.moe_intermediate_size, config.hidden_size
        for part, shape in (("gate_up_proj", (e_, 2 * n, h)), ("down_proj", (e_, h, n))):
            ent = pm.parts[part]
            if ent.shape != shape:
                raise _err_shape(ent, shape)
            if ent.dtype not in _FLOATS:
                raise LoadError(f"{ent.name} in {ent.file.name} has dtype {ent.dtype}; packed experts must be float")
        for j in range(e_):
            for part in ("gate_proj", "up_proj", "down_proj"):
                key = f"{prefix}.{j}.{part}"
                if key in mods:
                    raise LoadError(f"{prefix} has both packed experts and per-expert tensors ({key})")
                if key not in want:
                    ent = pm.parts["gate_up_proj"]
                    raise LoadError(f"unexpected tensor {ent.name} in {ent.file.name}: layer {prefix.split('.')[2]} "
                                    f"of this config has no routed experts")
                want.pop(key)
    if kv_scales:
        warnings.warn(f"{len(kv_scales)} FP8 KV-cache scales (e.g. {kv_scales[0]}) are not used: the decoder keeps "
                      f"its KV cache in the activations' dtype, not FP8", stacklevel=3)
    missing = [n for n in want if n not in mods]
    if missing:
        folder = entries[0].file.parent if entries else "?"
        raise LoadError(f"missing tensors in {folder}: {', '.join(_tensor_name(n, want[n]) for n in missing[:6])}"
                        + (f" and {len(missing) - 6} more" if len(missing) > 6 else ""))
    for m in mods.values():
        _decide_format(m, quant)
    return mods, packed


def _tensor_name(module: str, t: Target) -> str:
    bare = module.endswith((".dt_bias", ".A_log"))
    return module if bare else module + ".weight"


def _decide_format(m: Module, quant: QuantConfig) -> None:
    p, t = m.parts, m.target
    first = next(iter(p.values()))
    orig = first.name.rpartition(".")[0] if not m.name.endswith((".dt_bias", ".A_log")) else first.name
    if t.kind == "tensor":
        key = "" if m.name.endswith((".dt_bias", ".A_log")) else "weight"
        _only(m, {key})
        e = p[key]
        if e.shape != t.shape:
            raise _err_shape(e, t.shape)
        if e.dtype not in _FLOATS:
            raise LoadError(f"{e.name} in {e.file.name} has dtype {e.dtype}; expected a float dtype")
        m.fmt = "float"
        return
    rows, cols = t.shape
    if "weight_packed" in p:
        m.fmt = "compressed-tensors"
    elif "weight_scale_2" in p or ("weight" in p and p["weight"].dtype == torch.uint8):
        m.fmt = "modelopt"
    elif "weight" in p and p["weight"].dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise LoadError(f"{p['weight'].name} in {p['weight'].file.name} is an FP8 weight ({p['weight'].dtype}): "
                        f"FP8 linears (e.g. a MIXED_PRECISION ModelOpt export's attention) are not supported by "
                        f"this decoder; use an NVFP4 or bf16 checkpoint")
    else:
        m.fmt = "float"
    if m.fmt == "float":
        _only(m, {"weight"})
        e = p["weight"]
        if e.shape != t.shape:
            raise _err_shape(e, t.shape)
        if e.dtype not in _FLOATS:
            raise LoadError(f"{e.name} in {e.file.name} has dtype {e.dtype}; expected a float dtype")
        # published NVFP4 exports keep the MTP module in bf16 whether or not their lists exclude it (vLLM reads it so)
        if quant.method and t.quantizable and not quant.excluded(orig) and not m.name.startswith("mtp."):
            raise LoadError(f"{e.name} in {e.file.name} is {e.dtype}, but the checkpoint's {quant.method} config "
                            f"does not exclude {orig!r} from quantisation: the tensors and the config disagree")
        return
    if not t.quantizable:
        raise LoadError(f"{orig} in {first.file.name} is stored as NVFP4, but the decoder keeps it in a float "
                        f"dtype (routers and gates are never quantised)")
    names = NVFP4_SUFFIXES[m.fmt]
    _only(m, set(names))
    codes, scales, gscale = (p[n] for n in names)
    if cols % 16:
        raise LoadError(f"{codes.name}: in_features = {cols} is not a multiple of 16")
    for e, shape, dtype in ((codes, (rows, cols // 2), torch.uint8), (scales, (rows, cols // 16), torch.float8_e4m3fn)):
        if e.shape != shape:
            raise _err_shape(e, shape, f" (NVFP4 of a [{rows}, {cols}] weight)")
        if e.dtype != dtype:
            raise LoadError(f"{e.name} in {e.file.name} has dtype {e.dtype}; expected {dtype}")
    if gscale.dtype != torch.float32 or _numel(gscale.shape) != 1:
        raise LoadError(f"{gscale.name} in {gscale.file.name} must be one fp32 value, found {gscale.dtype} "
                        f"{list(gscale.shape)}")
    if quant.method and quant.excluded(orig):
        raise LoadError(f"{orig} in {first.file.name} is stored as NVFP4, but the checkpoint's {quant.method} "
                        f"config excludes it from quantisation: the tensors and the config disagree")


def _only(m: Module, allowed: set) -> None:
    extra = sorted(set(m.parts) - allowed)
    missing = sorted(allowed - set(m.parts))
    first = next(iter(m.parts.values()))
    base = first.name.rpartition(".")[0] if "" not in allowed else first.name
    if missing:
        raise LoadError(f"{base}: missing {', '.join(base + '.' + s for s in missing)} (the {m.fmt or 'float'} "
                        f"layout; found {sorted(m.parts)} in {first.file.name})")
    if extra:
        raise LoadError(f"unexpected tensor {base}.{extra[0]} in {m.parts[extra[0]].file.name} (a {m.fmt} "
                        f"module holds {sorted(allowed)})")


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
