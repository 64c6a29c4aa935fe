"""Load a HF model folder into a :class:`~lynn_model.model.Model`: safetensors only, shard by shard.

* ``config.json`` (flat or with ``text_config``) -> :class:`~lynn_model.config.Config`;
* ``model.safetensors``, or the shards of ``model.safetensors.index.json``;
* names under ``model.`` or ``model.language_model.`` (release VL wrappers); ``model.visual.*`` and ``mtp.*`` are
  skipped; experts per expert (``experts.{e}.gate_proj.weight``) or packed (``experts.gate_up_proj [E, 2I, H]``);
* each projection's format is read off the tensors present: a float ``weight``; compressed-tensors NVFP4
  (``weight_packed``, ``weight_scale``, ``weight_global_scale``); ModelOpt NVFP4 (uint8 ``weight``,
  ``weight_scale``, ``weight_scale_2``). The config's ``ignore`` / ``exclude_modules`` list must agree (an error
  otherwise). FP8 weights are refused by name.

Every header is read first, so a missing, unexpected, mis-shaped or wrongly typed tensor is reported (with its file)
before any data is read; then each shard's tensors are converted and moved to the device one by one, so host memory
stays near one tensor (a module split across shards waits for its last shard). The model is built on the meta
device and its placeholders are replaced. Formats and rules: docs/decoder.md.
"""

from __future__ import annotations

import fnmatch
import json
import re
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

import lynn_kernels
from lynn_kernels import NVFP4Tensor, moe, runtime
from lynn_kernels.matmul import PackedNVFP4, pack

from .config import Config, ConfigError
from .model import Model

WEIGHT_MODES = ("auto", "nvfp4", "bf16")
#: Projections kept in a float dtype when quantising on load (``weights="nvfp4"``): the LM head, the router, the
#: shared-expert gate and the tiny Gated DeltaNet gate projections (as every published checkpoint keeps them).
DEFAULT_KEEP = (r"(^|\.)lm_head$", r"\.mlp\.gate$", r"\.shared_expert_gate$", r"\.linear_attn\.in_proj_(a|b|ba)$")
#: What published NVFP4 checkpoints keep besides: every Gated DeltaNet projection (``keep=PUBLISHED_KEEP`` loads a
#: bf16 folder the way they are quantised; the default quantises ``in_proj_qkv`` / ``in_proj_z`` / ``out_proj`` too,
#: for the bytes a decode step reads).
PUBLISHED_KEEP = DEFAULT_KEEP + (r"\.linear_attn\.",)
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
        p = f"model.layers.{i}."
        t[p + "input_layernorm"] = Target("tensor", (h,))
        t[p + "post_attention_layernorm"] = Target("tensor", (h,))
        if c.layer_types[i] == "full_attention":
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
            if c.family == "qwen3_next":          # head-grouped, permuted at load (see _split_qkvz)
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
        if c.ffn_types[i] == "mlp":
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
    return t


_PACKED_EXPERTS = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_EXPERT = re.compile(r"^(model\.layers\.(\d+)\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)$")


def canonical(name: str) -> str | None:
    """A checkpoint tensor name in the model's terms, or None for what the text decoder skips."""
    if name.startswith("model.language_model."):
        name = "model." + name[len("model.language_model."):]
    elif name.startswith("language_model."):
        name = name[len("language_model."):]
        name = name if name.startswith(("model.", "lm_head")) else "model." + name
    if name.startswith(("model.visual.", "visual.", "mtp.", "model.mtp.")):
        return None
    return name


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


def read_config(raw: dict, path: Path) -> Config:
    """:meth:`Config.from_hf` of the parsed ``config.json`` at ``path``, its errors naming the file."""
    try:
        return Config.from_hf(raw, name=path.parent.name)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None


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
        if quant.method and t.quantizable and not quant.excluded(orig):
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
        parts = module.split(".")
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
                    layout: str = "packed", check_weights: bool = True) -> Model:
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
    """
    folder = Path(path)
    if weights not in WEIGHT_MODES:
        raise ValueError(f"weights = {weights!r}: expected one of {WEIGHT_MODES}")
    if layout not in ("packed", "checkpoint"):
        raise ValueError(f"layout = {layout!r}: expected 'packed' or 'checkpoint'")
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise LoadError(f"no config.json in {folder}")
    raw = read_json(cfg_path)
    entries = read_headers(folder)
    check_counts(raw, entries, cfg_path)
    config = read_config(raw, cfg_path)
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
    if layout == "packed":
        pack_linears(model)
        pack_moe_experts(model)
    model.eval()
    return model


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
                 seed: int = 0, keep: tuple = DEFAULT_KEEP, recipe: str = "modelopt", layout: str = "packed") -> Model:
    """A model of ``config`` with random weights drawn on ``device`` (benchmarks, shapes without a checkpoint):
    projections ``N(0, 1 / in_features)`` (those that write into the residual stream also times ``1 / sqrt(2 L)``,
    so the net is stable: bf16 rounding is not amplified layer after layer), norms near their identity, decays as HF
    initialises them; quantised on the device when ``weights="nvfp4"`` (the same rule as loading, ``keep`` stays float),
    the projections in ``layout`` as :func:`from_pretrained` puts them."""
    if weights not in ("nvfp4", "bf16"):
        raise ValueError(f"weights = {weights!r}: expected 'nvfp4' or 'bf16'")
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
    if layout == "packed":
        pack_linears(model)
        pack_moe_experts(model)
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
