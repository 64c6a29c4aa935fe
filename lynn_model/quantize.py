"""``lynn quantize``: a bf16 / fp16 / fp32 Hugging Face checkpoint of Qwen3-Next, Qwen3.5 or Qwen3.5-MoE -> NVFP4
weights with activations left in 16 bits (W4A16), in either on-disk layout that vLLM, SGLang and ``lynn_model`` read.

Example::

    from lynn_model.quantize import quantize_checkpoint
    summary = quantize_checkpoint("Qwen3.5-35B-A3B", "Qwen3.5-35B-A3B-NVFP4")              # compressed-tensors
    summary = quantize_checkpoint("Qwen3.5-35B-A3B", "Qwen3.5-35B-A3B-NVFP4-mo", format="modelopt")
    print(summary["n_quantized"], summary["n_kept"], summary["bytes_before"], summary["bytes_after"])

Per quantised Linear ``X`` (weight ``[N, K]``, ``K % 16 == 0``):

* ``format="compressed-tensors"``: ``X.weight_packed`` uint8 ``[N, K/2]``, ``X.weight_scale`` float8_e4m3fn
  ``[N, K/16]``, ``X.weight_global_scale`` fp32 ``[1]`` (divide convention, ``2688 / amax``), and a
  ``quantization_config`` (``nvfp4-pack-quantized``, weights only) in ``config.json``;
* ``format="modelopt"``: ``X.weight`` uint8, ``X.weight_scale`` float8_e4m3fn, ``X.weight_scale_2`` fp32 ``()``
  (multiply convention, ``amax / 2688``), ``hf_quant_config.json`` and a ``quant_method: modelopt``
  ``quantization_config`` in ``config.json`` (``quant_algo: W4A16_NVFP4``, ModelOpt's name for weight-only NVFP4).

Fused partners (q/k/v of one attention layer; gate/up of one MLP, shared expert or routed expert; with
``quantize_linear_attn``, Qwen3.5's ``in_proj_qkv``/``in_proj_z``) share one global scale, taken from the largest
``amax`` of the group, because the serving engines fuse them into one matmul with one scale. Packed experts
(``mlp.experts.gate_up_proj [E, 2I, H]``, ``mlp.experts.down_proj [E, H, I]``) are written per expert. Which modules
are quantised and which keep the source dtype, and why: docs/nvfp4.md, section "lynn quantize".

The checkpoint is streamed: one shard is read (``safetensors.safe_open``), quantised and written before the next,
so memory peaks at about one shard. SRC is only read; the result is built in a temporary folder next to DST and
moved into place at the end, so a failed run leaves no half-written DST.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import torch

import lynn_kernels  # noqa: F401  (first: it picks the Triton backend before triton is imported)
from lynn_kernels import nvfp4, runtime
from lynn_kernels.nvfp4.spec import BLOCK, check_recipe, default_global_scale

from . import checkpoint

FORMATS = ("compressed-tensors", "modelopt")
#: The recipe each layout's own tool uses; ``recipe=None`` picks it.
DEFAULT_RECIPE = {"compressed-tensors": "compressed-tensors", "modelopt": "modelopt"}
#: ``model_type`` of the checkpoints this knows the tensor names of (top level or ``text_config``).
FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")

CT_FORMAT = "nvfp4-pack-quantized"
CT_VERSION = "0.20.1"           #: the compressed-tensors release whose config and tensors this reproduces
MODELOPT_VERSION = "0.47.0"     #: the ModelOpt release whose export files this reproduces
MODELOPT_QUANT_ALGO = "W4A16_NVFP4"   #: ModelOpt's weight-only NVFP4 ("NVFP4" means W4A4, with input scales)
#: Without a GPU, quantise through the torch reference (bit-exact with the kernels, and far faster than Triton's
#: interpreter); with one, the Triton kernels run.
REFERENCE_ON_CPU = True

_FLOAT_DTYPES = {"BF16": "bf16", "F16": "fp16", "F32": "fp32"}

# -- which modules --------------------------------------------------------------------------------------------------
_LAYER = r"^model\.(?:language_model\.)?layers\.\d+\."       # decoder layers only: never mtp.* or model.visual.*
_DEFAULT_TARGETS = re.compile(
    _LAYER + r"(?:self_attn\.[qkvo]_proj|mlp\.(?:shared_expert\.|experts\.\d+\.)?(?:gate|up|down)_proj)$")
_LINEAR_ATTN_TARGETS = re.compile(_LAYER + r"linear_attn\.(?:in_proj_qkvz|in_proj_qkv|in_proj_z|out_proj)$")
_PACKED = re.compile(r"^(?P<experts>.+\.mlp\.experts)\.(?P<proj>gate_up_proj|down_proj)$")
_EMBEDDINGS = ("embed_tokens", "pos_embed", "embeddings", "word_embeddings", "wte")
_FUSED = (   # module -> the fused matmul the serving engines build from it (one global scale per fused matmul)
    (re.compile(r"^(.+\.self_attn)\.[qkv]_proj$"), "{}.qkv_proj"),
    (re.compile(r"^(.+\.mlp(?:\.shared_expert|\.experts\.\d+)?)\.(?:gate|up)_proj$"), "{}.gate_up_proj"),
    (re.compile(r"^(.+\.linear_attn)\.in_proj_(?:qkv|z)$"), "{}.in_proj_qkvz"),
)
_WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".msgpack", ".h5", ".gguf")


def fused_group(module: str) -> str:
    """The fused matmul a module belongs to (``...self_attn.q_proj`` -> ``...self_attn.qkv_proj``), or itself."""
    for pattern, fmt in _FUSED:
        m = pattern.match(module)
        if m:
            return fmt.format(m.group(1))
    return module


def is_default_target(module: str, quantize_linear_attn: bool = False) -> bool:
    """Whether ``lynn quantize`` quantises this module by default (the published recipes' choice)."""
    return bool(_DEFAULT_TARGETS.match(module) or (quantize_linear_attn and _LINEAR_ATTN_TARGETS.match(module)))


# -- the plan -------------------------------------------------------------------------------------------------------
@dataclass
class _Module:
    """One Linear-like module: where its ``[N, K]`` weight lives and what happens to it."""
    name: str
    tensor: str                       # the checkpoint tensor holding the weight
    shard: str
    shape: tuple
    dtype: str                        # safetensors dtype string
    rows: tuple | None = None         # (expert, row0, row1) into a packed [E, R, K] tensor; None for ``X.weight``
    quantize: bool = False
    group: str = ""

    def label(self) -> str:
        if self.rows is None:
            return self.tensor
        e, r0, r1 = self.rows
        return f"{self.tensor}[{e}, {r0}:{r1}]"


@dataclass
class _Plan:
    modules: dict = field(default_factory=dict)        # module name -> _Module (quantised or kept, in order)
    of_tensor: dict = field(default_factory=dict)      # tensor name -> [module names] it holds
    packed: set = field(default_factory=set)           # packed expert tensors [E, R, K]
    split: set = field(default_factory=set)            # ... of which written per expert
    extra_kept: list = field(default_factory=list)     # conv-like modules (3-D+ weights) listed as unquantised
    groups: dict = field(default_factory=dict)         # fused group -> its quantised members
    notes: list = field(default_factory=list)


def _natural(name: str):
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _plan(headers: dict, ignore: list, quantize_linear_attn: bool) -> _Plan:
    """Decide, from tensor names and shapes alone, which modules to quantise."""
    plan = _Plan()
    for name, (shard, shape, dtype) in headers.items():
        packed = _PACKED.match(name)
        if packed and len(shape) == 3:
            n_exp, rows, _ = shape
            if packed.group("proj") == "gate_up_proj":
                if rows % 2:
                    raise ValueError(f"{name} has shape {list(shape)}: a packed gate_up_proj needs [E, 2I, H]")
                half = rows // 2
                parts = (("gate_proj", 0, half), ("up_proj", half, rows))
            else:
                parts = (("down_proj", 0, rows),)
            names = []
            for e in range(n_exp):
                for proj, r0, r1 in parts:
                    mod = f"{packed.group('experts')}.{e}.{proj}"
                    plan.modules[mod] = _Module(mod, name, shard, (r1 - r0, shape[2]), dtype, rows=(e, r0, r1))
                    names.append(mod)
            plan.of_tensor[name] = names
            plan.packed.add(name)
        elif name.endswith(".weight") and len(shape) == 2:
            mod = name[: -len(".weight")]
            if mod.rsplit(".", 1)[-1] in _EMBEDDINGS:
                continue                                   # an embedding, not a Linear: copied, not listed
            plan.modules[mod] = _Module(mod, name, shard, tuple(shape), dtype)
            plan.of_tensor[name] = [mod]
        elif name.endswith(".weight") and len(shape) >= 3:
            plan.extra_kept.append(name[: -len(".weight")])   # conv1d, patch embeddings: never quantised

    for mod in plan.modules.values():
        mod.group = fused_group(mod.name)
        if not is_default_target(mod.name, quantize_linear_attn):
            continue
        if any(p.search(mod.name) for p in ignore):
            continue
        if mod.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{mod.label()} has dtype {mod.dtype}; lynn quantize reads bf16, fp16 or fp32 weights "
                             f"(is SRC already quantised?)")
        if mod.shape[-1] % BLOCK:
            plan.notes.append(f"{mod.name}: K = {mod.shape[-1]} is not a multiple of {BLOCK}, kept in "
                              f"{_FLOAT_DTYPES[mod.dtype]}")
            continue
        mod.quantize = True

    groups: dict[str, list] = {}
    for mod in plan.modules.values():
        if is_default_target(mod.name, quantize_linear_attn):
            groups.setdefault(mod.group, []).append(mod)
    for group, members in groups.items():
        flags = {m.quantize for m in members}
        if len(flags) == 2:   # vLLM / SGLang fuse the partners into one matmul: one format for all of them
            kept = ", ".join(m.name.rsplit(".", 1)[-1] for m in members if not m.quantize)
            partners = ", ".join(m.name.rsplit(".", 1)[-1] for m in members if m.quantize)
            plan.notes.append(f"{group}: {kept} kept unquantised, and with it its fused partners {partners} "
                              f"(one fused matmul, one format)")
            for m in members:
                m.quantize = False
        elif members[0].quantize:
            plan.groups[group] = [m.name for m in members]

    plan.split = {t for t in plan.packed if any(plan.modules[m].quantize for m in plan.of_tensor[t])}
    return plan


# -- config files ---------------------------------------------------------------------------------------------------
def compressed_tensors_config(ignore: Iterable[str]) -> dict:
    """The ``quantization_config`` compressed-tensors writes for its NVFP4A16 preset (weights only)."""
    weights = {"dynamic": False, "group_size": BLOCK, "num_bits": 4, "scale_dtype": "torch.float8_e4m3fn",
               "strategy": "tensor_group", "symmetric": True, "type": "float"}
    return {
        "config_groups": {"group_0": {"format": CT_FORMAT, "input_activations": None, "output_activations": None,
                                      "targets": ["Linear"], "weights": weights}},
        "format": CT_FORMAT,
        "global_compression_ratio": None,
        "ignore": list(ignore),
        "kv_cache_scheme": None,
        "moe_sparsity_config": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": CT_VERSION,
    }


def modelopt_hf_quant_config(exclude_modules: Iterable[str]) -> dict:
    """``hf_quant_config.json`` as ModelOpt's HF export writes it for weight-only NVFP4."""
    return {"producer": {"name": "modelopt", "version": MODELOPT_VERSION},
            "quantization": {"quant_algo": MODELOPT_QUANT_ALGO, "kv_cache_quant_algo": None, "group_size": BLOCK,
                             "exclude_modules": list(exclude_modules)}}


def modelopt_quantization_config(hf_quant_config: dict) -> dict:
    """The ``quantization_config`` ModelOpt puts in ``config.json`` next to ``hf_quant_config.json``."""
    q = hf_quant_config["quantization"]
    return {"config_groups": {"group_0": {"weights": {"dynamic": False, "num_bits": 4, "type": "float",
                                                      "group_size": q["group_size"]},
                                          "targets": ["Linear"]}},
            "ignore": list(q["exclude_modules"]),
            "quant_algo": q["quant_algo"],
            "producer": dict(hf_quant_config["producer"]),
            "quant_method": "modelopt"}


def summarize_exclude_modules(kept: Iterable[str], quantized: Iterable[str]) -> list[str]:
    """ModelOpt's ``exclude_modules`` style: each kept module is covered by the shortest dotted prefix wildcard
    (``a.b*``, else ``a.b.*``) that matches no quantised module, else by its own name."""
    blocked = set()
    for name in quantized:
        blocked.add(name)
        blocked.update(name[:i] + "*" for i in range(len(name) + 1))
    chosen: set = set()
    for name in kept:
        options = []
        for i, ch in enumerate(name):
            if ch == ".":
                options += [[name[:i] + "*"], [name[:i], name[:i] + ".*"]]
        options.append([name])
        pick: list = []
        for option in options:
            if any(w in blocked for w in option):
                continue
            if not all(w in chosen for w in option):
                pick = option
            break
        chosen.update(pick[1:] if len(pick) == 2 else pick)   # the pair {a, a.*} is written as a.*
    return sorted(chosen, key=_natural)


# -- paths ----------------------------------------------------------------------------------------------------------
def _check_paths(src: Path, dst: Path, overwrite: bool) -> None:
    if not src.is_dir():
        raise FileNotFoundError(f"SRC {src} is not a folder")
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"SRC {src} has no config.json: expected a Hugging Face model folder")
    if dst == src:
        raise ValueError(f"DST is SRC ({src}): lynn quantize never modifies SRC; choose another folder")
    if src in dst.parents:
        raise ValueError(f"DST {dst} is inside SRC {src}: lynn quantize never writes into SRC")
    if dst in src.parents:
        raise ValueError(f"DST {dst} contains SRC {src}; choose a folder outside it")
    if dst.exists():
        if not dst.is_dir():
            raise FileExistsError(f"DST {dst} exists and is not a folder")
        if any(dst.iterdir()) and not overwrite:
            raise FileExistsError(f"DST {dst} exists and is not empty; pass overwrite=True (--overwrite) to "
                                  f"replace it")
        if overwrite:
            _check_replaceable(src, dst)


#: Files of DST besides its shards that this command writes.
_OUTPUT_FILES = ("config.json", "model.safetensors.index.json", "hf_quant_config.json")


def _check_replaceable(src: Path, dst: Path) -> None:
    """``--overwrite`` replaces a model, not any folder: DST must hold a model (``config.json`` and safetensors)
    and nothing this command could not have written (its outputs, or files named as in SRC)."""
    if not any(dst.iterdir()):
        return
    unexpected = []
    for root, dirs, files in os.walk(dst):
        rel_root = Path(root).relative_to(dst)
        for d in list(dirs):
            if not (src / rel_root / d).is_dir() or (Path(root) / d).is_symlink():
                unexpected.append(f"{rel_root / d}/")
                dirs.remove(d)
        for name in files:
            rel = rel_root / name
            if not (str(rel) in _OUTPUT_FILES or (rel_root == Path(".") and name.endswith(".safetensors"))
                    or (src / rel).is_file()):
                unexpected.append(str(rel))
    is_model = (dst / "config.json").is_file() and any(dst.glob("*.safetensors"))
    if unexpected or not is_model:
        listing = sorted(p.name + ("/" if p.is_dir() else "") for p in dst.iterdir())
        why = (f"it holds files lynn quantize does not write: {', '.join(sorted(unexpected)[:8])}"
               + (f" and {len(unexpected) - 8} more" if len(unexpected) > 8 else "")) if unexpected else \
            "it holds no model (config.json and *.safetensors)"
        raise FileExistsError(f"DST {dst} is not replaced by --overwrite: {why}. Its contents: "
                              f"{', '.join(listing[:12])}{' ...' if len(listing) > 12 else ''}. Choose a new "
                              f"folder, or empty this one yourself")


def _tmp_prefix(dst: Path) -> str:
    return f".{dst.name}.lynn-quantize-"


def _clean_leftovers(dst: Path, notes: list) -> None:
    """Remove the temporary folders of earlier runs on DST that were killed; refuse while another run is alive."""
    for old in sorted(dst.parent.glob(_tmp_prefix(dst) + "*")):
        pid = old.name[len(_tmp_prefix(dst)):].partition("-")[0]
        if not pid.isdigit() or not old.is_dir() or old.is_symlink():
            continue
        if int(pid) != os.getpid() and _alive(int(pid)):
            raise FileExistsError(f"{old} belongs to another lynn quantize writing {dst} (process {pid} is "
                                  f"running); wait for it to finish, or stop it and run again")
        shutil.rmtree(old)
        notes.append(f"removed {old.name}, left in {dst.parent} by an interrupted run (process {pid})")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:          # someone else's process: alive
        return True
    return True


def _read_config(src: Path) -> dict:
    config = checkpoint.read_json(src / "config.json")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    types = {config.get("model_type"), text.get("model_type")} - {None}
    if not types & set(FAMILIES):
        raise ValueError(f"{src / 'config.json'}: model_type {sorted(types) or None} is not one of {FAMILIES}")
    if config.get("quantization_config") or text.get("quantization_config") or (src / "hf_quant_config.json").exists():
        raise ValueError(f"SRC {src} is already quantised (quantization_config / hf_quant_config.json); "
                         f"lynn quantize starts from bf16, fp16 or fp32 weights")
    return config


def _weight_files(src: Path) -> tuple[list, bool]:
    """Shard file names in order, and whether SRC has an index: the shards the loader reads
    (:func:`lynn_model.checkpoint.shard_files`: each a plain file inside SRC)."""
    return sorted(f.name for f in checkpoint.shard_files(src)), (src / "model.safetensors.index.json").is_file()


def _read_headers(src: Path, shards: list) -> tuple[dict, dict, list]:
    """``{tensor: (shard, shape, dtype)}`` shard by shard, each shard's metadata, and the loader's entries, without
    reading any data (each header checked as the loader checks it)."""
    headers, metadata, entries = {}, {}, []
    for shard in shards:
        header, _ = checkpoint.read_header(src / shard)
        meta = header.get("__metadata__")
        if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
            raise ValueError(f"{src / shard}: corrupt safetensors header (__metadata__ must map names to strings)")
        metadata[shard] = meta or {"format": "pt"}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if name in headers:
                raise ValueError(f"tensor {name} is in both {headers[name][0]} and {shard}")
            headers[name] = (shard, tuple(info["shape"]), info["dtype"])
            entries.append(checkpoint.Entry(name, src / shard, checkpoint.SAFETENSORS_DTYPES[info["dtype"]],
                                        tuple(info["shape"])))
    return headers, metadata, entries


def _tensor_bytes(shape, dtype: str) -> int:
    return math.prod(shape) * checkpoint.SAFETENSORS_DTYPES[dtype].itemsize


# -- the writer -----------------------------------------------------------------------------------------------------
class _Progress:
    """A one-line bar on stderr: bytes of SRC done, the shard being written, elapsed time."""

    def __init__(self, total: int, n_shards: int, enabled: bool):
        self.total, self.n_shards, self.enabled = max(total, 1), n_shards, enabled
        self.t0 = time.perf_counter()
        self.last = 0.0

    def show(self, done: int, shard_index: int, shard: str, force: bool = False) -> None:
        now = time.perf_counter()
        if not self.enabled or (not force and now - self.last < 0.25):
            return
        self.last = now
        frac = min(done / self.total, 1.0)
        bar = "#" * int(30 * frac)
        sys.stderr.write(f"\rquantize [{bar:<30}] {100 * frac:5.1f}%  shard {shard_index}/{self.n_shards} "
                         f"{shard}  {now - self.t0:.0f} s ")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


class _Writer:
    """Turns one source shard at a time into its output tensors, sharing global scales across fused partners."""

    def __init__(self, src: Path, plan: _Plan, fmt: str, recipe: str):
        self.src, self.plan, self.format, self.recipe = src, plan, fmt, recipe
        self.handles: dict = {}
        self.scales: dict = {}          # fused group -> its global scale (the recipe's convention)
        self.pending: dict = {}         # module -> weight already read for its group's scale
        self.current: dict = {}         # packed tensor being split -> its data
        self.copied = 0                 # tensors written as they are

    def handle(self, shard: str):
        from safetensors import safe_open

        if shard not in self.handles:
            self.handles[shard] = safe_open(self.src / shard, framework="pt")
        return self.handles[shard]

    def weight(self, mod: _Module) -> torch.Tensor:
        if mod.name in self.pending:
            return self.pending.pop(mod.name)
        if mod.rows is None:
            return self.handle(mod.shard).get_tensor(mod.tensor)
        e, r0, r1 = mod.rows
        if mod.tensor in self.current:
            return self.current[mod.tensor][e, r0:r1]
        return self.handle(mod.shard).get_slice(mod.tensor)[e, r0:r1]

    def group_scale(self, mod: _Module, shard: str) -> torch.Tensor:
        """The group's global scale: the recipe's own choice for the member with the largest amax (for ModelOpt
        ``max(amax) / 2688``, for compressed-tensors ``2688 / max(amax)`` in the weights' dtype)."""
        if mod.group in self.scales:
            return self.scales[mod.group]
        best = None
        for name in self.plan.groups[mod.group]:
            other = self.plan.modules[name]
            w = self.weight(other)
            if other.shard == shard and other.rows is None:
                self.pending[other.name] = w          # read once: quantised when its turn comes in this shard
            amax = float(w.abs().amax())
            if best is None or amax > best[0]:
                best = (amax, w, other)
        _, w, other = best
        scale = default_global_scale(w, self.recipe, name=other.label())
        self.scales[mod.group] = scale
        return scale

    def quantize(self, mod: _Module, w: torch.Tensor, scale: torch.Tensor) -> dict:
        if self.recipe == "compressed-tensors":
            kwargs = dict(recipe="compressed-tensors", recip_global_scale=scale)
        else:
            kwargs = dict(global_scale=scale, recipe="modelopt")
        try:
            if runtime.INTERPRET and REFERENCE_ON_CPU:
                with runtime.use_reference():
                    q = nvfp4.quantize(w, **kwargs)
            else:
                dev = runtime.DEVICE
                kwargs = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
                q = nvfp4.quantize(w.to(dev), **kwargs).to("cpu")
        except (ValueError, TypeError) as err:
            raise type(err)(f"{mod.label()}: {err}") from err
        parts = q.to_compressed_tensors() if self.format == "compressed-tensors" else q.to_modelopt()
        return {f"{mod.name}.{k}": v.contiguous().clone() for k, v in parts.items()}

    def shard(self, shard: str, names: list, on_tensor) -> dict:
        """Read, quantise and return one output shard ``{name: tensor}`` (source order)."""
        f = self.handle(shard)
        out: dict = {}
        for name in names:
            mods = self.plan.of_tensor.get(name)
            if name in self.plan.split:
                self.current[name] = f.get_tensor(name)
                for m in mods:
                    mod = self.plan.modules[m]
                    if mod.quantize:
                        scale = self.group_scale(mod, shard)
                        out.update(self.quantize(mod, self.weight(mod), scale))
                    else:
                        out[f"{m}.weight"] = self.weight(mod).clone()
                del self.current[name]
            elif mods and name not in self.plan.packed and self.plan.modules[mods[0]].quantize:
                mod = self.plan.modules[mods[0]]
                scale = self.group_scale(mod, shard)            # first: it may read this weight already
                out.update(self.quantize(mod, self.weight(mod), scale))
            else:
                out[name] = f.get_tensor(name)
                self.copied += 1
            on_tensor(name)
        self.pending.clear()
        return out

    def close(self) -> None:
        self.handles.clear()


def _copy_others(src: Path, dst: Path, skip: set, notes: list) -> list:
    """Copy every file of SRC except the weights, the index and config.json; returns the copied relative paths."""
    copied = []
    for root, dirs, files in os.walk(src):
        dirs[:] = sorted(d for d in dirs if d != ".git")
        rel_root = Path(root).relative_to(src)
        for name in sorted(files):
            rel = rel_root / name
            if str(rel) in skip:
                continue
            if name.endswith(_WEIGHT_FILES) or name.endswith((".bin.index.json", ".safetensors.index.json")):
                notes.append(f"{rel}: a weight file outside the safetensors checkpoint, not copied")
                continue
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src / rel, dst / rel)
            copied.append(str(rel))
    return copied


def quantize_checkpoint(src, dst, *, format: str = "compressed-tensors", recipe: str | None = None,
                        ignore: Iterable[str] = (), quantize_linear_attn: bool = False, overwrite: bool = False,
                        progress: bool = True) -> dict:
    """Quantise the Linear weights of the HF model folder ``src`` to NVFP4 (W4A16) and write the model to ``dst``.

    * ``format``: ``"compressed-tensors"`` (llm-compressor's ``nvfp4-pack-quantized``) or ``"modelopt"``;
    * ``recipe``: whose fp32 arithmetic to reproduce bit for bit (``"modelopt"`` or ``"compressed-tensors"``);
      default: the format's own tool;
    * ``ignore``: regular expressions, searched in module names without ``.weight``
      (``model.layers.3.self_attn.q_proj``); a match keeps the module (and its fused partners) unquantised;
    * ``quantize_linear_attn``: also quantise the Gated DeltaNet projections ``in_proj_qkv``, ``in_proj_z``
      (Qwen3-Next: ``in_proj_qkvz``) and ``out_proj``; ``in_proj_a``/``in_proj_b``/``in_proj_ba`` and ``conv1d``
      never are;
    * ``overwrite``: replace an existing non-empty ``dst``;
    * ``progress``: a progress bar and notes on stderr.

    Returns a summary: ``format``, ``recipe``, ``src``, ``dst``, ``shards``, ``quantized`` / ``kept`` (module names),
    ``n_quantized``, ``n_kept``, ``tensors_copied``, ``bytes_before`` / ``bytes_after`` (tensor bytes),
    ``files_copied``, ``notes`` and ``seconds``. Raises ``ValueError`` / ``FileExistsError`` / ``FileNotFoundError``
    naming the path or tensor at fault (DST equal to, inside or containing SRC, an existing DST, an unknown model, a
    quantised SRC).
    """
    t0 = time.perf_counter()
    if format not in FORMATS:
        raise ValueError(f"format={format!r}: expected one of {FORMATS}")
    recipe = DEFAULT_RECIPE[format] if recipe is None else recipe
    check_recipe(recipe)
    if isinstance(ignore, str):
        ignore = (ignore,)
    patterns = []
    for p in ignore:
        try:
            patterns.append(re.compile(p))
        except re.error as err:
            raise ValueError(f"ignore pattern {p!r} is not a valid regular expression: {err}") from err
    src, dst = Path(src).expanduser().resolve(), Path(dst).expanduser().resolve()
    _check_paths(src, dst, overwrite)
    config = _read_config(src)
    shards, has_index = _weight_files(src)
    headers, metadata, entries = _read_headers(src, shards)
    _check_loadable(src, config, entries)
    plan = _plan(headers, patterns, quantize_linear_attn)
    if progress:
        for note in plan.notes:
            print(f"note: {note}", file=sys.stderr)

    quantized = [m.name for m in plan.modules.values() if m.quantize]
    kept = sorted([m.name for m in plan.modules.values() if not m.quantize] + plan.extra_kept, key=_natural)
    if not quantized:
        raise ValueError(f"nothing to quantise in {src}: no module matched the targets (see docs/nvfp4.md)")

    by_shard: dict[str, list] = {s: [] for s in shards}
    for name, (shard, _, _) in headers.items():
        by_shard[shard].append(name)
    bytes_before = sum(_tensor_bytes(shape, dtype) for _, shape, dtype in headers.values())

    dst.parent.mkdir(parents=True, exist_ok=True)
    n_notes = len(plan.notes)
    _clean_leftovers(dst, plan.notes)
    if progress:
        for note in plan.notes[n_notes:]:
            print(f"note: {note}", file=sys.stderr)
    tmp = dst.parent / f"{_tmp_prefix(dst)}{os.getpid()}"
    tmp.mkdir()
    mode = 0o666 & ~_umask()                        # safetensors writes 0600; the other files get the usual mode
    writer = _Writer(src, plan, format, recipe)
    bar = _Progress(bytes_before, len(shards), progress)
    done = 0
    weight_map, bytes_after = {}, 0
    try:
        from safetensors.torch import save_file

        for i, shard in enumerate(shards, 1):
            bar.show(done, i, shard, force=True)

            def on_tensor(name, i=i, shard=shard):
                nonlocal done
                done += _tensor_bytes(headers[name][1], headers[name][2])
                bar.show(done, i, shard)

            out = writer.shard(shard, by_shard[shard], on_tensor)
            try:
                save_file(out, str(tmp / shard), metadata=metadata[shard])
            except Exception as err:  # noqa: BLE001  (safetensors raises its own error for a full disk)
                if isinstance(err, OSError) or "safetensor" in type(err).__name__.lower():
                    raise OSError(f"cannot write {dst / shard} (in the temporary {tmp}): {err}") from err
                raise
            os.chmod(tmp / shard, mode)
            for name, t in out.items():
                weight_map[name] = shard
                bytes_after += t.numel() * t.element_size()
            del out
        bar.show(done, len(shards), shards[-1], force=True)
        bar.close()
        writer.close()

        if has_index or len(shards) > 1:
            index = {"metadata": {"total_size": bytes_after},
                     "weight_map": {k: weight_map[k] for k in sorted(weight_map)}}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        if format == "compressed-tensors":
            config["quantization_config"] = compressed_tensors_config(kept)
        else:
            hf_quant = modelopt_hf_quant_config(summarize_exclude_modules(kept, quantized))
            (tmp / "hf_quant_config.json").write_text(json.dumps(hf_quant, indent=4) + "\n")
            config["quantization_config"] = modelopt_quantization_config(hf_quant)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        skip = set(shards) | {"config.json", "model.safetensors.index.json"}
        files = _copy_others(src, tmp, skip, plan.notes)

        if dst.exists():                            # checked by _check_replaceable: set aside, then removed
            old = dst.parent / f"{_tmp_prefix(dst)}{os.getpid()}-old"
            os.replace(dst, old)
            os.replace(tmp, dst)
            shutil.rmtree(old)
        else:
            os.replace(tmp, dst)
    except BaseException:
        if done:
            bar.close()
        writer.close()
        shutil.rmtree(tmp, ignore_errors=True)
        raise

    return {
        "format": format, "recipe": recipe, "src": str(src), "dst": str(dst), "shards": len(shards),
        "quantized": quantized, "kept": kept, "n_quantized": len(quantized), "n_kept": len(kept),
        "tensors_copied": writer.copied, "bytes_before": bytes_before, "bytes_after": bytes_after,
        "files_copied": files, "notes": list(plan.notes), "seconds": time.perf_counter() - t0,
    }


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _check_loadable(src: Path, raw: dict, entries: list) -> None:
    """Refuse, before anything is written, a SRC that ``lynn_model.from_pretrained`` would refuse (its config
    and its headers' ``entries``; no data is read)."""
    checkpoint.check_counts(raw, entries, src / "config.json")
    checkpoint.plan(checkpoint.read_config(raw, src / "config.json", entries), entries, checkpoint.QuantConfig())


def format_summary(summary: dict) -> str:
    """The summary as a few lines of text (what ``lynn quantize`` prints)."""
    mb = 1024 * 1024
    before, after = summary["bytes_before"], summary["bytes_after"]
    lines = [
        f"wrote {summary['dst']} ({summary['format']} layout, {summary['recipe']} recipe, {summary['shards']} "
        f"shard{'s' if summary['shards'] != 1 else ''}) in {summary['seconds']:.1f} s",
        f"  quantised to NVFP4: {summary['n_quantized']} modules",
        f"  kept unquantised:   {summary['n_kept']} modules; {summary['tensors_copied']} tensors copied as they are "
        f"(those, embeddings, norms, ...)",
        f"  tensor bytes:       {before / mb:.1f} MiB -> {after / mb:.1f} MiB ({after / max(before, 1):.2f}x)",
    ]
    lines += [f"  note: {n}" for n in summary["notes"]]
    return "\n".join(lines)


__all__ = ["quantize_checkpoint", "format_summary", "fused_group", "is_default_target", "compressed_tensors_config",
           "modelopt_hf_quant_config", "modelopt_quantization_config", "summarize_exclude_modules", "FORMATS",
           "FAMILIES"]
