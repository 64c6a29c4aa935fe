"""``lynn_model.loader`` and ``.checkpoint``: the formats they read and the errors they give, on tiny HF checkpoints.

1. Formats: the NVFP4 folders ``quantize_checkpoint`` writes (compressed-tensors and ModelOpt) load with NVFP4
   weights exactly where the writer quantised and float weights elsewhere, holding the files' codes, block scales
   and global scales; ``dequantize_model`` of the result is ``nvfp4.dequantize`` of the files; both layouts written
   with one recipe give one model; ``weights="bf16"`` dequantises, ``weights="nvfp4"`` quantises all but
   ``DEFAULT_KEEP``.
2. Layouts: shards (also a module whose tensors straddle two shards), packed experts (HF's own in-memory
   ``experts.gate_up_proj`` / ``down_proj``), ``mtp.*`` skipped, the VL wrapper, tied embeddings, and Qwen3-Next's
   ``in_proj_qkvz`` / ``in_proj_ba`` permutation against HF's own ``fix_query_key_value_ordering``.
3. Errors: each a ``LoadError`` naming the tensor and its file (or the folder / config file at fault), raised from
   the headers before any tensor data is read; the folder is never modified.

Everything runs on the loader alone (no forward pass); quantise / dequantise calls go through the torch references
(``use_reference``), which the kernels match bit for bit (tests/test_nvfp4.py).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest
import tiny_hf
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import lynn_kernels
import lynn_model
from lynn_kernels import NVFP4Tensor, nvfp4
from lynn_kernels.matmul import PackedNVFP4, unpack
from lynn_kernels.moe import PackedExperts
from lynn_kernels.moe.packed import shared_slot
from lynn_kernels.moe.spec import as_nvfp4
from lynn_kernels.nvfp4 import reference as nvfp4_reference
from lynn_kernels.nvfp4.spec import reciprocal
from lynn_model import LoadError, checkpoint, loader
from lynn_model.checkpoint import targets
from lynn_model.model import SparseMoE
from lynn_model.quantize import quantize_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:transformers .* is not tested with current version of modelopt")

FP32, BF16 = torch.float32, torch.bfloat16
FORMATS = ("compressed-tensors", "modelopt")
SHORT = {"compressed-tensors": "ct", "modelopt": "mo"}
#: The projections published checkpoints (and ``weights="nvfp4"``) keep in a float dtype, in checkpoint names
#: (Qwen3-Next's fused ``in_proj_ba`` included) and in the model's names (after the split).
KEPT_HF = r"(^lm_head|\.mlp\.gate|\.shared_expert_gate|\.linear_attn\.in_proj_(a|b|ba))$"
KEPT_MODEL = r"(^lm_head|\.mlp\.gate|\.shared_expert_gate|\.linear_attn\.in_proj_[ab])$"

#: fixtures that load an oracle package (tests/conftest.py counts the tests that use them)
ORACLE_FIXTURES = {"ckpt": "transformers"}


# ---------------------------------------------------------------------------------------------------------------
# checkpoints, built once per session on first use


def _make(key: str, root: Path) -> Path:
    d = root / key
    if key in tiny_hf.NAMES:
        return tiny_hf.save(key, d)
    if key == "q35-2shards":                                  # HF's own sharding: 2 files and an index
        return tiny_hf.save("q35", d, max_shard_size="600KB")
    if key.endswith("-bf16"):
        tiny_hf.build(key[:-5]).to(BF16).save_pretrained(d)
        return d
    if key.endswith("-packed"):                               # HF's in-memory layout: experts.gate_up_proj [E, 2I, H]
        name = key[:-7]
        sd = {k: v.detach().contiguous().clone() for k, v in tiny_hf.build(name).state_dict().items()}
        assert any(k.endswith("experts.gate_up_proj") for k in sd) and not any(".experts.0." in k for k in sd)
        return write(d, sd, config_from=_CACHE[name])
    # "{name}-{ct|mo}[-{recipe}][-la]": quantize_checkpoint's output
    m = re.fullmatch(r"(\w+)-(ct|mo)(?:-(compressed-tensors|modelopt))?(-la)?", key)
    name, fmt, recipe, la = m.group(1), {v: k for k, v in SHORT.items()}[m.group(2)], m.group(3), m.group(4)
    summary = quantize_checkpoint(_CACHE[name], d, format=fmt, recipe=recipe, quantize_linear_attn=bool(la),
                                  progress=False)
    (d / "summary.json").write_text(json.dumps(summary["quantized"]))
    return d


_CACHE: dict = {}


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory):
    """``ckpt(key)``: the folder of a tiny checkpoint, made on first use: a ``tiny_hf`` name (fp32 safetensors),
    ``q35-2shards``, ``{name}-bf16``, ``{name}-packed`` (packed experts), or ``{name}-ct`` / ``{name}-mo``
    (``quantize_checkpoint`` in either layout; ``-{recipe}`` forces the recipe, ``-la`` quantises the GDN
    projections too). Tests must not modify them (copy with ``clone``)."""
    root = tmp_path_factory.mktemp("loader")
    _CACHE.clear()

    def get(key: str) -> Path:
        if key not in tiny_hf.NAMES and not key.endswith("-bf16"):
            get(key.split("-")[0])                             # the fp32 source it is made from
        if key not in _CACHE:
            _CACHE[key] = _make(key, root)
        return _CACHE[key]

    return get


def clone(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def read_all(folder: Path) -> dict:
    out = {}
    for shard in sorted(Path(folder).glob("*.safetensors")):
        out.update(load_file(shard))
    return out


def write(folder: Path, tensors: dict, *, config_from: Path | None = None, shards: dict | None = None,
          order: list | None = None) -> Path:
    """Write ``tensors`` as ``model.safetensors`` or, with ``shards`` (``{name: file}``), as those files plus an
    index whose weight_map lists the names in ``order`` (default sorted, as HF writes it)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if config_from is not None:
        shutil.copy(Path(config_from) / "config.json", folder / "config.json")
    for f in folder.glob("*.safetensors*"):
        f.unlink()
    if shards is None:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"),
                  metadata={"format": "pt"})
        return folder
    for file in sorted(set(shards.values())):
        save_file({k: v.contiguous() for k, v in tensors.items() if shards[k] == file}, str(folder / file),
                  metadata={"format": "pt"})
    weight_map = {k: shards[k] for k in (order or sorted(tensors))}
    total = sum(v.numel() * v.element_size() for v in tensors.values())
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                     "weight_map": weight_map}, indent=2))
    return folder


def edit_tensors(folder: Path, fn, file: str = "model.safetensors") -> None:
    t = load_file(folder / file)
    fn(t)
    save_file({k: v.contiguous() for k, v in t.items()}, str(folder / file), metadata={"format": "pt"})


def edit_json(folder: Path, fn, file: str = "config.json") -> None:
    d = json.loads((folder / file).read_text())
    fn(d)
    (folder / file).write_text(json.dumps(d, indent=2))


def tree_hash(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(Path(root).rglob("*")):
        h.update(str(p.relative_to(root)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


def load(folder, **kw) -> lynn_model.Model:
    with lynn_kernels.use_reference():
        return lynn_model.from_pretrained(folder, device="cpu", **kw)


# ---------------------------------------------------------------------------------------------------------------
# what a model holds, and what the files hold, under one set of names


def _rows(w, r0: int, r1: int):
    """Rows ``r0:r1`` of a float ``[N, K]`` weight or an NVFP4Tensor (global scale ``()`` or one per row)."""
    if not isinstance(w, NVFP4Tensor):
        return w[r0:r1]

    def pick(g):
        return None if g is None else (g if g.dim() == 0 else g[r0:r1])

    return NVFP4Tensor(w.codes[r0:r1], w.scales[r0:r1], pick(w.global_scale), pick(w.recip_global_scale))


def model_weights(model) -> dict:
    """``{module: weight}`` of a loaded model in HF's Qwen3.5 names (``model.layers.0.mlp.experts.3.up_proj``,
    ``...linear_attn.in_proj_qkv``; ``conv1d`` as HF's ``[C, 1, K]``): float tensors or NVFP4Tensors, the routed
    and shared experts cut back out of their stacks exactly; a projection the loader packed
    (:func:`lynn_kernels.matmul.pack`) is unpacked, which recovers the checkpoint's bytes exactly."""
    c, out = model.config, {}
    out["model.embed_tokens"], out["model.norm"], out["lm_head"] = model.embed_tokens, model.norm.weight, \
        model.lm_head.weight
    for i, layer in enumerate(model.layers):
        _layer_weights(out, f"model.layers.{i}.", layer, c)
    if model.mtp is not None:
        out["mtp.fc"] = model.mtp.fc.weight
        for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            out["mtp." + n] = getattr(model.mtp, n).weight
        for j, layer in enumerate(model.mtp.layers):
            _layer_weights(out, f"mtp.layers.{j}.", layer, c)
    return {k: unpack(v) if isinstance(v, PackedNVFP4) else v for k, v in out.items()}   # exact (test below)


def _layer_weights(out: dict, p: str, layer, c) -> None:
    """One decoder layer's weights under prefix ``p`` (a trunk layer or an MTP layer)."""
    out[p + "input_layernorm"] = layer.input_layernorm.weight
    out[p + "post_attention_layernorm"] = layer.post_attention_layernorm.weight
    if layer.kind == "full_attention":
        for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
            out[p + "self_attn." + n] = getattr(layer.self_attn, n).weight
    else:
        g = layer.linear_attn
        for n in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"):
            out[p + "linear_attn." + n] = getattr(g, n).weight
        out[p + "linear_attn.conv1d"] = g.conv_weight.unsqueeze(1)
        out[p + "linear_attn.dt_bias"], out[p + "linear_attn.A_log"] = g.dt_bias, g.A_log
        out[p + "linear_attn.norm"] = g.norm_weight
    m = p + "mlp."
    if isinstance(layer.mlp, SparseMoE):
        mlp, n = layer.mlp, c.moe_intermediate_size
        out[m + "gate"] = mlp.router
        w13s, w2s = as_nvfp4(mlp.w13), as_nvfp4(mlp.w2)                  # packed experts: unpacked, exact
        for e in range(c.num_experts):
            w13 = w13s[e]
            out[m + f"experts.{e}.gate_proj"], out[m + f"experts.{e}.up_proj"] = _rows(w13, 0, n), \
                _rows(w13, n, 2 * n)
            out[m + f"experts.{e}.down_proj"] = w2s[e]
        if mlp.shared is not None:
            s = c.shared_expert_intermediate_size
            out[m + "shared_expert.gate_proj"] = _rows(as_nvfp4(mlp.shared.w13), 0, s)
            out[m + "shared_expert.up_proj"] = _rows(as_nvfp4(mlp.shared.w13), s, 2 * s)
            out[m + "shared_expert.down_proj"] = as_nvfp4(mlp.shared.w2)
            out[m + "shared_expert_gate"] = mlp.shared.gate_weight
    else:
        for n in ("gate_proj", "up_proj", "down_proj"):
            out[m + n] = getattr(layer.mlp, n).weight


def file_weights(folder: Path, config, quantize_all_but: str | None = None) -> dict:
    """``{module: weight}`` as the files hold it, in :func:`model_weights`'s names: VL prefixes dropped, vision and
    ``mtp.*`` skipped, NVFP4 modules as NVFP4Tensors of their three tensors, packed experts cut per expert,
    ``in_proj_qkvz`` / ``in_proj_ba`` split. ``quantize_all_but`` (a regex): quantise every float projection whose
    checkpoint name does not match it, as ``weights="nvfp4"`` should (before the split)."""
    groups: dict = {}
    for name, t in read_all(folder).items():
        c = checkpoint.canonical(name)
        if c is None:
            continue
        pm = re.fullmatch(r"(.+\.experts)\.(gate_up_proj|down_proj)", c)
        if pm:
            for e in range(t.shape[0]):
                if pm.group(2) == "gate_up_proj":
                    n = t.shape[1] // 2
                    groups[f"{pm.group(1)}.{e}.gate_proj"] = {"weight": t[e, :n]}
                    groups[f"{pm.group(1)}.{e}.up_proj"] = {"weight": t[e, n:]}
                else:
                    groups[f"{pm.group(1)}.{e}.down_proj"] = {"weight": t[e]}
        elif c.endswith((".dt_bias", ".A_log")):
            groups[c] = {"": t}
        else:
            mod, _, suffix = c.rpartition(".")
            groups.setdefault(mod, {})[suffix] = t
    out = {}
    for mod, parts in groups.items():
        if set(parts) in ({"weight"}, {""}) and parts.get("weight", parts.get("")).dtype != torch.uint8:
            v = parts.get("weight", parts.get(""))
            if quantize_all_but is not None and v.dim() == 2 and mod != "model.embed_tokens" \
                    and not re.search(quantize_all_but, mod):
                with lynn_kernels.use_reference():
                    v = nvfp4.quantize(v, recipe="modelopt")
        else:
            v = NVFP4Tensor.from_state_dict(parts, "")
        if mod.endswith(".in_proj_qkvz"):
            base = mod[: -len("qkvz")]
            out[base + "qkv"], out[base + "z"] = loader.split_qkvz(v, config)
        elif mod.endswith(".in_proj_ba"):
            base = mod[: -len("ba")]
            out[base + "b"], out[base + "a"] = loader.split_ba(v, config)
        else:
            out[mod] = v
    return out


def deq(q: NVFP4Tensor, dtype=FP32) -> torch.Tensor:
    with lynn_kernels.use_reference():
        return nvfp4.dequantize(q, dtype)


def compare(got: dict, want: dict, dtype: torch.dtype) -> None:
    """Same modules, same kinds; NVFP4: the same codes, block scales and global scale(s) and the same dequantised
    values; float: ``want`` cast to ``dtype``, bit for bit (``A_log``, ``dt_bias``, ``q_norm``, ``k_norm``: that,
    held in fp32)."""
    assert sorted(got) == sorted(want)
    for k, w in want.items():
        g = got[k]
        assert isinstance(g, NVFP4Tensor) == isinstance(w, NVFP4Tensor), (k, type(g), type(w))
        if isinstance(w, NVFP4Tensor):
            assert torch.equal(g.codes, w.codes), k
            assert torch.equal(g.scales.view(torch.uint8), w.scales.view(torch.uint8)), k
            assert bool((g.global_scale == w.global_scale).all()), k
            assert torch.equal(deq(g), deq(w)), k
        elif k.endswith((".A_log", ".dt_bias", ".q_norm", ".k_norm")):   # fp32 copies of the run-dtype values
            assert g.dtype == FP32 and tuple(g.shape) == tuple(w.shape), (k, g.dtype, g.shape, w.shape)
            assert torch.equal(g, w.to(dtype).float()), k
        else:
            assert g.dtype == dtype and tuple(g.shape) == tuple(w.shape), (k, g.dtype, g.shape, w.shape)
            assert torch.equal(g, w.to(dtype)), k


def nvfp4_names(model_w: dict) -> set:
    return {k for k, v in model_w.items() if isinstance(v, NVFP4Tensor)}


def written_nvfp4(folder: Path) -> set:
    """The modules quantize_checkpoint reported quantised, in model names (qkvz -> qkv + z)."""
    out = set()
    for m in json.loads((folder / "summary.json").read_text()):
        c = checkpoint.canonical(m)
        out |= {c[:-1], c[:-4] + "z"} if c.endswith(".in_proj_qkvz") else {c}
    return out


# ---------------------------------------------------------------------------------------------------------------
# 1. formats read back to the same model


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("key", ["q35", "q35moe", "q35moevl", "next-la"])
def test_nvfp4_folder_loads_what_the_files_hold(ckpt, key, fmt):
    """``from_pretrained`` (``weights="auto"``) of ``quantize_checkpoint``'s output: NVFP4 exactly where the writer
    quantised (the summary's list), float elsewhere; each NVFP4 module holds its files' codes / block scales /
    global scale, each float tensor its file's values; and ``dequantize_model(model, fp32)``, module by module,
    is ``nvfp4.dequantize`` of the files' tensors. (``next-la``: Qwen3-Next with its GDN projections quantised
    too, so an NVFP4 ``in_proj_qkvz`` is split on load.)"""
    name, la = key.removesuffix("-la"), "-la" if key.endswith("-la") else ""
    folder = ckpt(f"{name}-{SHORT[fmt]}{la}")
    model = load(folder)
    assert model.dtype == FP32
    got, want = model_weights(model), file_weights(folder, model.config)
    assert nvfp4_names(got) == written_nvfp4(folder)
    assert not any(k.endswith(("lm_head", "mlp.gate", "shared_expert_gate")) for k in nvfp4_names(got))
    compare(got, want, FP32)
    with lynn_kernels.use_reference():
        twin = loader.dequantize_model(model, FP32)
    flat = model_weights(twin)
    assert not nvfp4_names(flat)
    for k, w in want.items():
        expect = deq(w, FP32) if isinstance(w, NVFP4Tensor) else w.float()
        assert flat[k].dtype == FP32 and torch.equal(flat[k], expect), k
    if la:
        assert {"model.layers.0.linear_attn.in_proj_qkv", "model.layers.0.linear_attn.in_proj_z"} <= nvfp4_names(got)


def test_projections_load_packed_and_match_the_checkpoint_layout(ckpt):
    """``layout="packed"`` (the default) puts every NVFP4 projection and expert stack in the packed kernels' layout,
    the shared expert joined to the routed stacks (one more slot of the decode kernels); ``layout="checkpoint"``
    keeps them as stored. The two hold the same bytes (packed, unpacked) and give the same logits bit for bit on the
    references."""
    folder = ckpt("q35moe-ct")
    packed, plain = load(folder), load(folder, layout="checkpoint")
    pairs = [(a.weight, b.weight) for a, b in zip(packed.modules(), plain.modules())
             if isinstance(getattr(b, "weight", None), NVFP4Tensor)]
    assert pairs and all(isinstance(p, PackedNVFP4) for p, _ in pairs)
    for p, w in pairs:
        u = unpack(p)
        assert torch.equal(u.codes, w.codes) and torch.equal(u.scales.view(torch.uint8), w.scales.view(torch.uint8))
    blocks = [(a, b) for a, b in zip(packed.modules(), plain.modules()) if isinstance(b, SparseMoE)]
    assert blocks
    for a, b in blocks:
        assert isinstance(a.w13, PackedExperts) and isinstance(a.w2, PackedExperts)
        joins = b.shared is not None and tuple(b.shared.w13.shape) == tuple(b.w13.shape[1:])   # Is == I
        assert shared_slot(a.w13, a.w2, a.shared) == joins
        assert b.shared is None or isinstance(a.shared.w13, PackedNVFP4)
        for p, w in ((a.w13, b.w13), (a.w2, b.w2)) + (((a.shared.w13, b.shared.w13), (a.shared.w2, b.shared.w2))
                                                       if b.shared is not None else ()):
            u = p.unpack()
            assert torch.equal(u.codes, w.codes) and torch.equal(u.scales.view(torch.uint8), w.scales.view(torch.uint8))
            assert torch.equal(nvfp4_reference.dequantize(u, FP32), nvfp4_reference.dequantize(w, FP32))
    ids = torch.randint(0, packed.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(3))
    with lynn_kernels.use_reference():
        assert torch.equal(packed.forward(ids), plain.forward(ids))
    with pytest.raises(ValueError, match="layout"):
        load(folder, layout="kernel")


@pytest.mark.parametrize("recipe", ["compressed-tensors", "modelopt"])
def test_both_layouts_of_one_recipe_give_one_model(ckpt, recipe):
    """The same weights written with the same recipe in the compressed-tensors and the ModelOpt layout hold the
    same codes and block scales. With the compressed-tensors recipe the two load (and dequantise) to the same model
    bit for bit. With the ModelOpt recipe they do not, always: ModelOpt's multiplier ``g`` is the recipe's number,
    and the compressed-tensors layout can only store the divisor ``G = fl(1/g)`` (the writer's choice); reading it
    back gives ``fl(1/G)``, which is ``g`` for most tensors but one fp32 ulp off for some. Checked exactly: the
    files differ by that reciprocal and nothing else, and the models agree wherever the round trip is exact."""
    a = load(ckpt(f"q35moe-ct-{recipe}"))
    b = load(ckpt(f"q35moe-mo-{recipe}"))
    wa, wb = model_weights(a), model_weights(b)
    assert nvfp4_names(wa) == nvfp4_names(wb) != set()
    with lynn_kernels.use_reference():
        da, db = model_weights(loader.dequantize_model(a, FP32)), model_weights(loader.dequantize_model(b, FP32))
    off = set()
    for k in wa:
        x, y = wa[k], wb[k]
        if not isinstance(x, NVFP4Tensor):
            assert torch.equal(x, y), k
            continue
        assert torch.equal(x.codes, y.codes), k
        assert torch.equal(x.scales.view(torch.uint8), y.scales.view(torch.uint8)), k
        if recipe == "compressed-tensors":
            assert torch.equal(x.global_scale, y.global_scale), k
            assert torch.equal(da[k], db[k]), k
        else:
            assert torch.equal(x.global_scale, reciprocal(reciprocal(y.global_scale))), k
            if torch.equal(x.global_scale, y.global_scale):
                assert torch.equal(da[k], db[k]), k
            else:
                off.add(k)
    # on disk: the compressed-tensors files hold exactly fl(1 / ModelOpt's weight_scale_2), or, for the
    # compressed-tensors recipe, a G whose reciprocal ModelOpt's file holds
    fa, fb = read_all(ckpt(f"q35moe-ct-{recipe}")), read_all(ckpt(f"q35moe-mo-{recipe}"))
    for n, G in fa.items():
        if n.endswith(".weight_global_scale"):
            g = fb[n.replace("weight_global_scale", "weight_scale_2")]
            if recipe == "modelopt":
                assert torch.equal(G.reshape(()), reciprocal(g)), n
            else:
                assert torch.equal(g, reciprocal(G).reshape(())), n
    if recipe == "modelopt":
        print(f"modelopt recipe: {len(off)} of {len(nvfp4_names(wa))} NVFP4 modules read back from the "
              f"compressed-tensors layout with a global scale one ulp from ModelOpt's")


def test_modelopt_folder_without_hf_quant_config(ckpt, tmp_path):
    """A ModelOpt folder with only config.json's ``quantization_config`` (whose list ModelOpt names ``ignore``, not
    ``exclude_modules``) loads like the one with ``hf_quant_config.json``."""
    src = ckpt("q35-mo")
    d = clone(src, tmp_path / "mo")
    (d / "hf_quant_config.json").unlink()
    assert json.loads((d / "config.json").read_text())["quantization_config"]["ignore"]
    compare(model_weights(load(d)), model_weights(load(src)), FP32)


def test_fp8_kv_cache_scales_are_named_and_left_unused(ckpt, tmp_path):
    """A ModelOpt export made with ``kv_cache_quant_algo: "FP8"`` carries one fp32 scale per attention layer's k and v
    (``self_attn.k_proj.k_scale``, ``self_attn.v_proj.v_scale``; other tools write ``self_attn.k_scale``, per
    tensor or per KV head): the model loads with the same weights, saying once that its KV cache stays in the
    activations' dtype. A name that pairs k with v is not one of them (an unexpected tensor); an integer scale is
    an error naming it."""
    src = ckpt("q35-mo")
    d = clone(src, tmp_path / "kv")
    edit_tensors(d, lambda t: t.update({"model.layers.3.self_attn.k_proj.k_scale": torch.tensor(0.02),
                                        "model.layers.3.self_attn.v_proj.v_scale": torch.tensor(0.03)}))
    edit_json(d, lambda c: c["quantization"].update(kv_cache_quant_algo="FP8"), "hf_quant_config.json")
    with pytest.warns(UserWarning, match=r"2 FP8 KV-cache scales \(e.g. model.layers.3.self_attn.[kv]_proj.[kv]_scale"
                                         r"\) are not used"):
        model = load(d)
    want = model_weights(load(src))
    compare(model_weights(model), want, FP32)
    d2 = clone(src, tmp_path / "kv-heads")                         # the other spelling, one scale per KV head
    edit_tensors(d2, lambda t: t.update({"model.layers.3.self_attn.k_scale": torch.full((2,), 0.02, dtype=BF16),
                                         "model.layers.3.self_attn.v_scale": torch.full((2,), 0.03, dtype=BF16)}))
    with pytest.warns(UserWarning, match="2 FP8 KV-cache scales"):
        compare(model_weights(load(d2)), want, FP32)
    edit_tensors(d2, lambda t: t.update({"model.layers.3.self_attn.k_proj.v_scale": torch.tensor(0.02)}))
    with pytest.raises(LoadError, match=r"unexpected tensor model.layers.3.self_attn.k_proj.v_scale"), \
            pytest.warns(UserWarning, match="2 FP8 KV-cache scales"):   # said before the module checks refuse it
        load(d2)
    edit_tensors(d, lambda t: t.update({"model.layers.3.self_attn.k_scale": torch.ones(2, dtype=torch.int32)}))
    with pytest.raises(LoadError, match=r"model.layers.3.self_attn.k_scale in model.safetensors .* float tensor"):
        load(d)


@pytest.mark.parametrize("key", ["q35-ct", "q35moe-mo"])
def test_bf16_mode_dequantises(ckpt, key):
    """``weights="bf16"`` of an NVFP4 folder: every weight float (bf16 by default), the NVFP4 ones equal to
    ``nvfp4.dequantize(files, bf16)`` (one rounding of the fp32 products), the rest cast."""
    folder = ckpt(key)
    model = load(folder, weights="bf16")
    assert model.dtype == BF16
    got = model_weights(model)
    assert not nvfp4_names(got)
    want = {k: deq(v, BF16) if isinstance(v, NVFP4Tensor) else v.to(BF16)
            for k, v in file_weights(folder, model.config).items()}
    compare(got, want, BF16)
    # the same as dequantising the "auto" model
    with lynn_kernels.use_reference():
        twin = model_weights(loader.dequantize_model(load(folder, dtype=BF16), BF16))
    compare(got, twin, BF16)


def test_bf16_mode_and_dtype_of_a_float_folder(ckpt):
    folder = ckpt("q35")
    want = file_weights(folder, load(folder).config)
    compare(model_weights(load(folder, weights="bf16")), want, BF16)
    compare(model_weights(load(folder, dtype=torch.float16)), want, torch.float16)
    compare(model_weights(load(folder)), want, FP32)


@pytest.mark.parametrize("name", ["q35", "q35moe", "next"])
def test_nvfp4_mode_quantises_all_but_default_keep(ckpt, name):
    """``weights="nvfp4"`` of a bf16 folder: every projection NVFP4 (ModelOpt recipe, Qwen3-Next's ``in_proj_qkvz``
    quantised whole, then split: one global scale), except the LM head, the router, the shared-expert gate and the
    GDN ``in_proj_a`` / ``in_proj_b`` (Qwen3-Next: ``in_proj_ba``), which stay bf16, as do embeddings and norms."""
    folder = ckpt(f"{name}-bf16")
    model = load(folder, weights="nvfp4")
    assert model.dtype == BF16
    got = model_weights(model)
    for p in ("lm_head", "model.layers.0.mlp.gate", "model.layers.0.mlp.shared_expert_gate",
              "model.layers.0.linear_attn.in_proj_a", "model.layers.0.linear_attn.in_proj_b",
              "model.layers.0.linear_attn.in_proj_ba"):
        assert re.search(KEPT_HF, p) and any(re.search(k, p) for k in loader.DEFAULT_KEEP), p
    linears = {k for k, v in got.items() if v.dim() == 2 and k != "model.embed_tokens"}
    assert nvfp4_names(got) == {k for k in linears if not re.search(KEPT_MODEL, k)}
    assert {k for k in linears if re.search(KEPT_MODEL, k)} >= {"lm_head", "model.layers.0.linear_attn.in_proj_b"}
    compare(got, file_weights(folder, model.config, quantize_all_but=KEPT_HF), BF16)
    if name == "next":
        g = model.layers[0].linear_attn
        assert torch.equal(g.in_proj_qkv.weight.global_scale, g.in_proj_z.weight.global_scale)
        assert not g.in_proj_b.quantized and not g.in_proj_a.quantized


def test_nvfp4_mode_keep_and_recipe(ckpt):
    """``keep=`` replaces the default list; ``recipe=`` picks the quantiser's arithmetic."""
    folder = ckpt("q35-bf16")
    model = load(folder, weights="nvfp4", keep=(r"\.mlp\.",), recipe="compressed-tensors")
    got = model_weights(model)
    assert isinstance(got["lm_head"], NVFP4Tensor) and isinstance(got["model.layers.0.linear_attn.in_proj_a"],
                                                                  NVFP4Tensor)
    assert not any(".mlp." in k for k in nvfp4_names(got))
    src = read_all(folder)["model.layers.3.self_attn.o_proj.weight"]
    with lynn_kernels.use_reference():
        want = nvfp4.quantize(src, recipe="compressed-tensors")
    compare({"o": got["model.layers.3.self_attn.o_proj"]}, {"o": want}, BF16)


# ---------------------------------------------------------------------------------------------------------------
# 2. layout variants


def test_two_shards_load_like_one(ckpt):
    sharded, single = ckpt("q35-2shards"), ckpt("q35")
    assert sorted(p.name for p in sharded.glob("*.safetensors")) == ["model-00001-of-00002.safetensors",
                                                                      "model-00002-of-00002.safetensors"]
    assert (sharded / "model.safetensors.index.json").is_file()
    compare(model_weights(load(sharded)), model_weights(load(single)), FP32)


def test_a_hub_cache_snapshot_loads_through_its_links(ckpt, tmp_path):
    """A Hugging Face cache stores files in ``blobs/`` and links them from ``snapshots/<rev>/``: those links leave
    the model folder, yet are the hub's own layout and load; a link anywhere else is refused."""
    sharded = ckpt("q35-2shards")
    snap, blobs = tmp_path / "models--x" / "snapshots" / "abc123", tmp_path / "models--x" / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for f in sharded.iterdir():
        shutil.copy(f, blobs / f.name)
        (snap / f.name).symlink_to(Path("../../blobs") / f.name)
    compare(model_weights(load(snap)), model_weights(load(sharded)), FP32)
    other = tmp_path / "copy"
    other.mkdir()
    for f in sharded.iterdir():
        (other / f.name).symlink_to(blobs / f.name)
    with pytest.raises(LoadError, match=r"a symlink to .*blobs/model-0000\d-of-00002\.safetensors, outside "):
        load(other)


@pytest.mark.parametrize("first", ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_module_straddling_two_shards(ckpt, tmp_path, fmt, first):
    """An NVFP4 folder rewritten in two shards with two modules' tensors split between them (q_proj's codes in
    shard 1 and its scales in shard 2; down_proj the other way round), read in either order (the index's first
    file is read first): the same model as the single file."""
    src = ckpt(f"q35-{SHORT[fmt]}")
    tensors = read_all(src)
    names = sorted(tensors)
    codes = "weight_packed" if fmt == "compressed-tensors" else "weight"
    s1, s2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    shards = {n: (s1 if i < len(names) // 2 else s2) for i, n in enumerate(names)}
    q, d = "model.layers.3.self_attn.q_proj.", "model.layers.0.mlp.down_proj."
    for suffix in ("weight_scale", "weight_global_scale" if fmt == "compressed-tensors" else "weight_scale_2"):
        shards[q + suffix], shards[d + suffix] = s2, s1
    shards[q + codes], shards[d + codes] = s1, s2
    order = sorted(names, key=lambda n: shards[n] != first)
    folder = write(tmp_path / "two", tensors, shards=shards, order=order)
    for f in ("config.json", "hf_quant_config.json"):
        if (src / f).is_file():
            shutil.copy(src / f, folder / f)
    entries = checkpoint.read_headers(folder)
    assert entries[0].file.name == first
    mods, _ = checkpoint.plan(load(src).config, entries, checkpoint.QuantConfig.read(folder, json.loads(
        (folder / "config.json").read_text())))
    for m in (q[:-1], d[:-1]):
        assert {e.file.name for e in mods[m].parts.values()} == {s1, s2}, m
    model = load(folder)
    compare(model_weights(model), model_weights(load(src)), FP32)
    compare(model_weights(model), file_weights(src, model.config), FP32)


@pytest.mark.parametrize("name", ["q35moe", "q35moevl"])
def test_packed_experts_load_like_per_expert(ckpt, tmp_path, name):
    """HF's in-memory state dict (``experts.gate_up_proj [E, 2I, H]``, gate rows first, ``experts.down_proj
    [E, H, I]``: the layout releases ship) and HF's per-expert save load to the same model, also with one layer's
    gate_up_proj and down_proj in different shards."""
    packed, per_expert = ckpt(f"{name}-packed"), ckpt(name)
    assert not any(".experts.0." in k for k in read_all(packed))
    want = model_weights(load(per_expert))
    compare(model_weights(load(packed)), want, FP32)
    tensors = read_all(packed)
    s1, s2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    shards = {n: s2 if n.endswith("layers.1.mlp.experts.down_proj") or "layers.3." in n else s1 for n in tensors}
    folder = write(tmp_path / "two", tensors, config_from=packed, shards=shards)
    compare(model_weights(load(folder)), want, FP32)


def _mtp_files(config, seed: int = 3, packed: bool = False, prefix: str = "mtp.") -> dict:
    """A whole MTP module's tensors for ``config`` (bf16, the released names under ``prefix``); ``packed``: its
    experts as ``experts.gate_up_proj [E, 2I, H]`` / ``experts.down_proj``."""
    g = torch.Generator().manual_seed(seed)
    out = {prefix + name[4:] + ".weight": (torch.randn(t.shape, generator=g) * 0.1).to(BF16)
           for name, t in targets(config.replace(mtp_layers=1)).items() if name.startswith("mtp.")}
    if packed:
        e = config.num_experts
        x = prefix + "layers.0.mlp.experts."
        gu = [torch.cat([out.pop(f"{x}{j}.gate_proj.weight"), out.pop(f"{x}{j}.up_proj.weight")]) for j in range(e)]
        out[x + "gate_up_proj"] = torch.stack(gu)
        out[x + "down_proj"] = torch.stack([out.pop(f"{x}{j}.down_proj.weight") for j in range(e)])
    return out


@pytest.mark.parametrize("name, packed, prefix", [("q35", False, "mtp."), ("q35moe", False, "model.mtp."),
                                                  ("q35moe", True, "mtp.")], ids=["dense", "moe", "moe-packed"])
def test_the_mtp_module_loads_what_the_files_hold(ckpt, tmp_path, name, packed, prefix):
    """``mtp.*`` (or ``model.mtp.*``): the MTP module (its layer with the model's FFN kind, per-expert or packed
    experts) loads as the files hold it, and the trunk is the one without it."""
    folder = clone(ckpt(name), tmp_path / "mtp")
    base = model_weights(load(ckpt(name)))
    extra = _mtp_files(lynn_model.Config.from_pretrained(folder), packed=packed, prefix=prefix)
    edit_tensors(folder, lambda t: t.update(extra))
    model = load(folder)
    assert model.config.mtp_layers == 1
    got = model_weights(model)
    compare({k: v for k, v in got.items() if not k.startswith("mtp.")}, base, FP32)
    want = {}
    for k, v in extra.items():
        k = k.removeprefix("model.").removesuffix(".weight")
        if k.endswith("experts.gate_up_proj"):
            n = v.shape[1] // 2
            for j in range(v.shape[0]):
                want[k[:-12] + f"{j}.gate_proj"], want[k[:-12] + f"{j}.up_proj"] = v[j, :n], v[j, n:]
        elif k.endswith("experts.down_proj"):
            want.update({k[:-9] + f"{j}.down_proj": v[j] for j in range(v.shape[0])})
        else:
            want[k] = v.view(-1, 1, v.shape[-1]) if k.endswith("conv1d") else v
    compare({k: v for k, v in got.items() if k.startswith("mtp.")}, {k: v.float() for k, v in want.items()}, FP32)


def test_an_nvfp4_checkpoints_bf16_mtp_module_loads_and_a_partial_one_is_refused(ckpt, tmp_path):
    """Published NVFP4 exports keep the MTP module in bf16 without listing it all as excluded: it loads, in float.
    A module with a tensor missing is refused, naming it."""
    folder = clone(ckpt("q35moe-ct"), tmp_path / "ct")
    extra = _mtp_files(lynn_model.Config.from_pretrained(folder))
    edit_tensors(folder, lambda t: t.update(extra))
    model = load(folder)
    assert all(type(w) is torch.Tensor for w in (model.mtp.fc.weight, model.mtp.layers[0].mlp.w13))
    edit_tensors(folder, lambda t: t.pop("mtp.norm.weight"))
    with pytest.raises(LoadError, match=r"missing tensors .*mtp\.norm\.weight"):
        load(folder)


@pytest.mark.parametrize("name", ["q35vl", "q35moevl"])
def test_vl_wrapper_loads_its_text_weights(ckpt, tmp_path, name):
    """The VL classes' save (``model.language_model.*``, ``model.visual.*``, ``lm_head``, config with
    ``text_config``) loads the text decoder: every module equals its ``model.language_model.`` tensor. The older
    spelling (``language_model.model.*`` / ``language_model.lm_head`` / ``visual.*``) loads the same."""
    folder = ckpt(name)
    names = set(read_all(folder))
    assert any(n.startswith("model.visual.") for n in names) and any(n.startswith("model.language_model.layers.")
                                                                     for n in names)
    assert "text_config" in json.loads((folder / "config.json").read_text())
    model = load(folder)
    assert model.config.family == ("qwen3_5_moe" if "moe" in name else "qwen3_5")
    got = model_weights(model)
    want = {}
    for n, t in read_all(folder).items():
        if n.startswith("model.language_model.") or n == "lm_head.weight":
            mod = "model." + n[len("model.language_model."):] if n.startswith("model.") else n
            want[mod.removesuffix(".weight")] = t
    assert set(want) == set(got)
    for k, w in want.items():
        assert torch.equal(got[k], w), k
    compare(got, file_weights(folder, model.config), FP32)
    old = {}
    for n, t in read_all(folder).items():
        n = "language_model." + n[len("model.language_model."):] if n.startswith("model.language_model.") else n
        n = "language_model.model." + n[len("language_model."):] if n.startswith("language_model.") else n
        n = "language_model.lm_head.weight" if n == "lm_head.weight" else n
        old[n.replace("model.visual.", "visual.")] = t
    assert any(k.startswith("language_model.model.layers.") for k in old) and any(k.startswith("visual.") for k in old)
    compare(model_weights(load(write(tmp_path / "old", old, config_from=folder))), got, FP32)


def test_tied_embeddings_use_the_embedding(ckpt, tmp_path):
    """``tie_word_embeddings: true`` and no ``lm_head.weight``: the head is the embedding (one tensor); a stored
    ``lm_head.weight`` is then ignored; ``weights="nvfp4"`` keeps the tied head float; the VL wrapper's top-level
    flag counts; an untied config without ``lm_head.weight`` is a missing tensor."""
    folder = clone(ckpt("q35"), tmp_path / "tied")
    edit_json(folder, lambda c: c.update(tie_word_embeddings=True))
    edit_tensors(folder, lambda t: t.pop("lm_head.weight"))
    embed = read_all(folder)["model.embed_tokens.weight"]
    for kw in ({}, {"weights": "nvfp4"}, {"weights": "bf16"}):
        model = load(folder, **kw)
        assert model.config.tie_word_embeddings
        assert model.lm_head.weight is model.embed_tokens and not model.lm_head.quantized
        assert torch.equal(model.lm_head.weight, embed.to(model.dtype))
    edit_tensors(folder, lambda t: t.update({"lm_head.weight": torch.zeros(512, 64)}))
    assert torch.equal(load(folder).lm_head.weight, embed)
    vl = clone(ckpt("q35vl"), tmp_path / "vl")
    edit_json(vl, lambda c: (c.update(tie_word_embeddings=True), c["text_config"].update(tie_word_embeddings=True)))
    edit_tensors(vl, lambda t: t.pop("lm_head.weight"))
    m = load(vl)
    assert m.lm_head.weight is m.embed_tokens
    # lm_head="nvfp4": the head becomes an NVFP4 copy of the float table the embedding keeps
    model = load(folder, lm_head="nvfp4")
    assert isinstance(model.lm_head.weight, PackedNVFP4) and torch.equal(model.embed_tokens, embed)
    assert torch.equal(lynn_kernels.dequantize(model.lm_head.weight.unpack(), torch.float32),
                       lynn_kernels.dequantize(lynn_kernels.quantize(embed, recipe="modelopt"), torch.float32))
    edit_json(folder, lambda c: c.update(tie_word_embeddings=False))
    edit_tensors(folder, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(LoadError, match=r"missing tensors in \S+tied: lm_head\.weight"):
        load(folder)


def _hf_gdn():
    """HF's Qwen3-Next Gated DeltaNet of layer 0 (from the tiny ``next`` model) and our config of it."""
    hf = tiny_hf.build("next")
    return hf.model.layers[0].linear_attn, lynn_model.Config.from_hf(hf.config.to_dict())


def _hf_order(gdn, qkvz: torch.Tensor, ba: torch.Tensor):
    """HF's own split of projection outputs ``[1, T, rows]`` -> ``(qkv, z, b, a)`` as ``[1, T, -1]``."""
    q, k, v, z, b, a = gdn.fix_query_key_value_ordering(qkvz, ba)
    flat = [x.reshape(1, x.shape[1], -1) for x in (q, k, v, z, b, a)]
    return torch.cat(flat[:3], -1), flat[3], flat[4], flat[5]


def test_split_qkvz_ba_matches_hf_float(ckpt):
    """``split_qkvz`` / ``split_ba`` give the weights whose outputs are HF's ``fix_query_key_value_ordering`` of the
    fused projections' outputs: checked exactly on the projections of the identity (``F.linear(I, W) = W^T``) and
    of row indices (the permutation itself); and the loaded Qwen3-Next model holds exactly those rows."""
    gdn, cfg = _hf_gdn()
    wqkvz, wba = gdn.in_proj_qkvz.weight.detach(), gdn.in_proj_ba.weight.detach()
    eye = torch.eye(cfg.hidden_size)[None]
    with torch.no_grad():
        hf = _hf_order(gdn, F.linear(eye, wqkvz), F.linear(eye, wba))
    ours = (*loader.split_qkvz(wqkvz, cfg), *loader.split_ba(wba, cfg))
    for name, h, w in zip(("qkv", "z", "b", "a"), hf, ours):
        assert torch.equal(F.linear(eye, w), h), name
        assert torch.equal(w, h[0].T), name
    rows = _hf_order(gdn, torch.arange(wqkvz.shape[0], dtype=FP32)[None, None],
                     torch.arange(wba.shape[0], dtype=FP32)[None, None])
    perm = [r[0, 0].long() for r in rows]
    assert sorted(torch.cat(perm[:2]).tolist()) == list(range(wqkvz.shape[0]))
    qkv_idx, z_idx = loader.qkvz_order(cfg)
    assert torch.equal(qkv_idx, perm[0]) and torch.equal(z_idx, perm[1])
    model = load(ckpt("next"))
    g = model.layers[0].linear_attn
    for w, full, idx in ((g.in_proj_qkv, wqkvz, perm[0]), (g.in_proj_z, wqkvz, perm[1]), (g.in_proj_b, wba, perm[2]),
                         (g.in_proj_a, wba, perm[3])):
        assert torch.equal(w.weight, full[idx])


@pytest.mark.parametrize("recipe", ["modelopt", "compressed-tensors"])
def test_split_qkvz_ba_nvfp4_is_exact(ckpt, recipe):
    """An NVFP4 ``in_proj_qkvz`` / ``in_proj_ba``: codes and block scales move with their rows (HF's permutation),
    the one global scale (and compressed-tensors' ``G``) is shared, so the dequantised split is HF's ordering of
    the dequantised whole, bit for bit. A per-row global scale is refused."""
    gdn, cfg = _hf_gdn()
    eye = torch.eye(cfg.hidden_size)[None]
    with lynn_kernels.use_reference():
        qz = nvfp4.quantize(gdn.in_proj_qkvz.weight.detach(), recipe=recipe)
        qb = nvfp4.quantize(gdn.in_proj_ba.weight.detach(), recipe=recipe)
    rows = _hf_order(gdn, torch.arange(qz.shape[0], dtype=FP32)[None, None],
                     torch.arange(qb.shape[0], dtype=FP32)[None, None])
    perm = [r[0, 0].long() for r in rows]
    hf = _hf_order(gdn, F.linear(eye, deq(qz)), F.linear(eye, deq(qb)))
    parts = (*loader.split_qkvz(qz, cfg), *loader.split_ba(qb, cfg))
    for name, part, whole, idx, h in zip(("qkv", "z", "b", "a"), parts, (qz, qz, qb, qb), perm, hf):
        assert isinstance(part, NVFP4Tensor), name
        assert torch.equal(part.codes, whole.codes[idx]), name
        assert torch.equal(part.scales.view(torch.uint8), whole.scales[idx].view(torch.uint8)), name
        assert part.global_scale.dim() == 0 and torch.equal(part.global_scale, whole.global_scale), name
        if recipe == "compressed-tensors":
            assert torch.equal(part.recip_global_scale, whole.recip_global_scale), name
        assert torch.equal(F.linear(eye, deq(part)), h), name
    per_row = NVFP4Tensor(qz.codes, qz.scales, qz.global_scale.expand(qz.shape[0]).contiguous())
    with pytest.raises(LoadError, match="one global scale"):
        loader.split_qkvz(per_row, cfg)


# ---------------------------------------------------------------------------------------------------------------
# 3. errors


def _drop(name):
    return lambda d: edit_tensors(d, lambda t: t.pop(name))


def _add(name, value):
    return lambda d: edit_tensors(d, lambda t: t.update({name: value}))


def _set(name, fn, file="model.safetensors"):
    return lambda d: edit_tensors(d, lambda t: t.update({name: fn(t[name])}), file)


def _header(fn, file="model.safetensors"):
    """Rewrite a shard's JSON header in place (same length, space-padded, as safetensors pads it)."""
    def edit(d):
        b = bytearray((d / file).read_bytes())
        n = int.from_bytes(b[:8], "little")
        h = fn(json.loads(b[8:8 + n]))
        s = json.dumps(h, separators=(",", ":")).encode()
        assert len(s) <= n
        b[8:8 + n] = s + b" " * (n - len(s))
        (d / file).write_bytes(bytes(b))
    return edit


def _bytes(fn, file="model.safetensors"):
    def edit(d):
        b = bytearray((d / file).read_bytes())
        (d / file).write_bytes(bytes(fn(b, int.from_bytes(b[:8], "little"))))
    return edit


def _garbage(b, n):
    b[8:40] = b"\xff" * 32
    return b


def _pop_key(key):
    def fn(h):
        h["model.norm.weight"].pop(key)
        return h
    return fn


def _entry(name, **changes):
    def fn(h):
        h[name].update(changes)
        return h
    return fn


def _shrink_offsets(h):
    h["model.norm.weight"]["data_offsets"][1] -= 4
    return h


def _replace_by_nvfp4(module, shape, layout):
    def edit(d):
        def fn(t):
            t.pop(module + ".weight")
            w = torch.randn(shape, generator=torch.Generator().manual_seed(0))
            with lynn_kernels.use_reference():
                q = nvfp4.quantize(w)
            parts = q.to_compressed_tensors() if layout == "compressed-tensors" else q.to_modelopt()
            t.update({f"{module}.{k}": v.contiguous() for k, v in parts.items()})
        edit_tensors(d, fn)
    return edit


def _fp8(module):
    def fn(t):
        w = t.pop(module + ".weight")
        t[module + ".weight"] = (w / w.abs().amax() * 448).to(torch.float8_e4m3fn)
        t[module + ".weight_scale"] = (w.abs().amax() / 448).reshape(())
        t[module + ".input_scale"] = torch.tensor(1.0)
    return lambda d: edit_tensors(d, fn)


def _index_drop_file(d):
    (d / "model-00002-of-00002.safetensors").unlink()


def _to_pickle(d):
    torch.save(load_file(d / "model.safetensors"), d / "pytorch_model.bin")
    (d / "model.safetensors").unlink()


def _ct_ignore(fn):
    return lambda d: edit_json(d, lambda c: fn(c["quantization_config"]["ignore"]))


def _mo_exclude(fn):
    return lambda d: edit_json(d, lambda c: fn(c["quantization"]["exclude_modules"]), "hf_quant_config.json")


def _mo_config_json_only(fn):
    def edit(d):
        (d / "hf_quant_config.json").unlink()
        edit_json(d, lambda c: fn(c["quantization_config"]["ignore"]))
    return edit


def _packed_both(d):
    t = load_file(d / "model.safetensors")
    edit_tensors(d, lambda x: x.update({"model.layers.0.mlp.experts.0.gate_proj.weight": t[
        "model.layers.0.mlp.experts.gate_up_proj"][0, :32].clone()}))


def _cut_a_norm(file):
    def fn(t):
        name = next(k for k in sorted(t) if t[k].dim() == 1 and k.endswith(".weight"))
        t[name] = t[name][:-1]
    return lambda d: edit_tensors(d, fn, file)


def _duplicate(d):
    t = load_file(d / "model-00001-of-00002.safetensors")
    name = sorted(t)[0]
    edit_tensors(d, lambda x: x.update({name: t[name]}), "model-00002-of-00002.safetensors")


_S2 = "model-00002-of-00002.safetensors"
Q = "model.layers.3.self_attn.q_proj"
ERRORS = [
    # (id, base, edit, match): every message names the tensor (or module) and its file (or the folder / config)
    ("missing", "q35", _drop("model.layers.1.mlp.down_proj.weight"),
     r"missing tensors in \S+/folder: model\.layers\.1\.mlp\.down_proj\.weight$"),
    ("missing_bare", "q35", _drop("model.layers.0.linear_attn.A_log"),
     r"missing tensors in \S+/folder: model\.layers\.0\.linear_attn\.A_log$"),
    ("missing_expert", "q35moe", _drop("model.layers.2.mlp.experts.5.up_proj.weight"),
     r"missing tensors in \S+/folder: model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight$"),
    ("missing_in_shard_2", "q35-2shards", lambda d: edit_tensors(d, lambda t: t.pop(sorted(t)[-1]), _S2),
     r"missing tensors in \S+/folder: model\.[\w.]+$"),
    ("missing_nvfp4_part", "q35-ct", _drop("model.layers.3.self_attn.k_proj.weight_scale"),
     r"model\.layers\.3\.self_attn\.k_proj: missing model\.layers\.3\.self_attn\.k_proj\.weight_scale \(the "
     r"compressed-tensors layout; found .* in model\.safetensors\)"),
    ("unexpected_module", "q35", _add("model.layers.0.mlp.extra_proj.weight", torch.zeros(8, 64)),
     r"unexpected tensor model\.layers\.0\.mlp\.extra_proj\.weight in model\.safetensors"),
    ("unexpected_layer", "q35", _add("model.layers.4.input_layernorm.weight", torch.zeros(64)),
     r"unexpected tensor model\.layers\.4\.input_layernorm\.weight in model\.safetensors"),
    ("unexpected_suffix", "q35", _add("model.layers.0.mlp.gate_proj.bias", torch.zeros(96)),
     r"unexpected tensor model\.layers\.0\.mlp\.gate_proj\.bias in model\.safetensors"),
    ("unexpected_expert", "q35moe", _add("model.layers.0.mlp.experts.8.gate_proj.weight", torch.zeros(32, 64)),
     r"unexpected tensor model\.layers\.0\.mlp\.experts\.8\.gate_proj\.weight in model\.safetensors"),
    ("unexpected_vl", "q35vl", _add("model.language_model.layers.0.mlp.foo.weight", torch.zeros(8, 64)),
     r"unexpected tensor model\.language_model\.layers\.0\.mlp\.foo\.weight in model\.safetensors"),
    ("unexpected_nvfp4_extra", "q35-mo", _add(Q + ".weight_zero_point", torch.zeros(256)),
     r"unexpected tensor model\.layers\.3\.self_attn\.q_proj\.weight_zero_point in model\.safetensors"),
    ("duplicate", "q35-2shards", _duplicate,
     r"model\.[\w.]+ appears twice \(model-0000[12]-of-00002\.safetensors and model-0000[12]-of-00002\.safetensors\)"),
    ("shape_norm", "q35", _set("model.norm.weight", lambda w: w[:63]),
     r"model\.norm\.weight in model\.safetensors has shape \[63\]; expected \[64\]"),
    ("shape_proj", "q35", _set(Q + ".weight", lambda w: w.T),
     r"model\.layers\.3\.self_attn\.q_proj\.weight in model\.safetensors has shape \[64, 256\]; expected \[256, 64\]"),
    ("shape_conv", "q35", _set("model.layers.1.linear_attn.conv1d.weight", lambda w: w[:, 0]),
     r"model\.layers\.1\.linear_attn\.conv1d\.weight in model\.safetensors has shape \[128, 4\]; expected "
     r"\[128, 1, 4\]"),
    ("shape_in_shard_2", "q35-2shards", _cut_a_norm(_S2),
     r"model\.[\w.]+\.weight in model-00002-of-00002\.safetensors has shape \[\d+\]; expected \[\d+\]"),
    ("shape_nvfp4_scale", "q35-ct", _set("model.layers.0.mlp.up_proj.weight_scale", lambda w: w[:, :3]),
     r"model\.layers\.0\.mlp\.up_proj\.weight_scale in model\.safetensors has shape \[96, 3\]; expected \[96, 4\] "
     r"\(NVFP4 of a \[96, 64\] weight\)"),
    ("shape_nvfp4_codes", "q35-mo", _set(Q + ".weight", lambda w: w[:128]),
     r"model\.layers\.3\.self_attn\.q_proj\.weight in model\.safetensors has shape \[128, 32\]; expected "
     r"\[256, 32\]"),
    ("shape_global", "q35-ct", _set(Q + ".weight_global_scale", lambda g: g.repeat(256)),
     r"model\.layers\.3\.self_attn\.q_proj\.weight_global_scale in model\.safetensors must be one fp32 value, "
     r"found torch\.float32 \[256\]"),
    ("shape_packed", "q35moe-packed", _set("model.layers.1.mlp.experts.gate_up_proj", lambda w: w[:, :62]),
     r"model\.layers\.1\.mlp\.experts\.gate_up_proj in model\.safetensors has shape \[8, 62, 64\]; expected "
     r"\[8, 64, 64\]"),
    ("dtype_int32_norm", "q35", _set("model.layers.0.input_layernorm.weight", lambda w: w.to(torch.int32)),
     r"model\.layers\.0\.input_layernorm\.weight in model\.safetensors has dtype torch\.int32; expected a float "
     r"dtype"),
    ("dtype_int8_proj", "q35", _set("model.layers.0.mlp.gate_proj.weight", lambda w: w.to(torch.int8)),
     r"model\.layers\.0\.mlp\.gate_proj\.weight in model\.safetensors has dtype torch\.int8; expected a float"),
    ("dtype_fp16_block_scale", "q35-mo", _set(Q + ".weight_scale", lambda s: s.to(torch.float16)),
     r"model\.layers\.3\.self_attn\.q_proj\.weight_scale in model\.safetensors has dtype torch\.float16; expected "
     r"torch\.float8_e4m3fn"),
    ("dtype_int8_codes", "q35-ct", _set(Q + ".weight_packed", lambda c: c.view(torch.int8)),
     r"model\.layers\.3\.self_attn\.q_proj\.weight_packed in model\.safetensors has dtype torch\.int8; expected "
     r"torch\.uint8"),
    ("dtype_fp16_global", "q35-ct", _set(Q + ".weight_global_scale", lambda g: g.to(torch.float16)),
     r"model\.layers\.3\.self_attn\.q_proj\.weight_global_scale in model\.safetensors must be one fp32 value, "
     r"found torch\.float16"),
    ("dtype_packed", "q35moe-packed", _set("model.layers.0.mlp.experts.down_proj", lambda w: w.to(torch.int8)),
     r"model\.layers\.0\.mlp\.experts\.down_proj in model\.safetensors has dtype torch\.int8; packed experts must be "
     r"float"),
    ("dtype_unreadable", "q35", _header(_entry("model.norm.weight", dtype="I16")),
     r"model\.norm\.weight in model\.safetensors has dtype 'I16', which the loader does not read"),
    ("packed_and_per_expert", "q35moe-packed", _packed_both,
     r"model\.layers\.0\.mlp\.experts has both packed experts and per-expert tensors "
     r"\(model\.layers\.0\.mlp\.experts\.0\.gate_proj\)"),
    ("packed_half", "q35moe-packed", _drop("model.layers.2.mlp.experts.down_proj"),
     r"model\.layers\.2\.mlp\.experts: packed experts need gate_up_proj and down_proj, found \['gate_up_proj'\]"),
    ("truncated", "q35", _bytes(lambda b, n: b[:-100]),
     r"\S+/model\.safetensors is truncated: its header describes \d+ bytes, the file has \d+ \(the data of "
     r"model\.[\w.]+ is cut\)"),
    ("truncated_shard_2", "q35-2shards", _bytes(lambda b, n: b[: 8 + n + 10], _S2),
     r"\S+/model-00002-of-00002\.safetensors is truncated: .* \(the data of model\.[\w.]+ is cut\)"),
    ("truncated_header", "q35", _bytes(lambda b, n: b[: 8 + n // 2]),
     r"\S+/model\.safetensors: not a safetensors file, or truncated \(header of \d+ bytes, file of \d+\)"),
    ("corrupt_header_bytes", "q35", _bytes(_garbage),
     r"\S+/model\.safetensors: cannot read the safetensors header"),
    ("corrupt_header_length", "q35", _bytes(lambda b, n: (10 ** 12).to_bytes(8, "little") + b[8:]),
     r"\S+/model\.safetensors: not a safetensors file, or truncated \(header of 1000000000000 bytes"),
    ("corrupt_header_entry", "q35", _header(_pop_key("shape")),
     r"model\.norm\.weight in model\.safetensors: corrupt safetensors header"),
    ("corrupt_header_list", "q35", _header(lambda h: list(h)),
     r"\S+/model\.safetensors: corrupt safetensors header \(a JSON list"),
    ("corrupt_offsets", "q35", _header(_shrink_offsets),
     r"model\.norm\.weight in model\.safetensors: corrupt safetensors header \(F32 \[64\] needs 256 bytes, "
     r"data_offsets span 252\)"),
    ("index_absent_file", "q35-2shards", _index_drop_file,
     r"model\.safetensors\.index\.json names model-00002-of-00002\.safetensors \(for [\w.]+ and \d+ more "
     r"tensors\), but \S+/model-00002-of-00002\.safetensors does not exist"),
    ("index_without_map", "q35-2shards", lambda d: edit_json(d, lambda i: i.pop("weight_map"),
                                                             "model.safetensors.index.json"),
     r"\S+/model\.safetensors\.index\.json: no weight_map"),
    ("pickle_only", "q35", _to_pickle,
     r"no model\.safetensors or model\.safetensors\.index\.json in \S+/folder \(found \['pytorch_model\.bin'\]: "
     r"only safetensors is read, never pickle\)"),
    ("no_safetensors", "q35", lambda d: (d / "model.safetensors").unlink(),
     r"no model\.safetensors or model\.safetensors\.index\.json in \S+/folder$"),
    ("no_config", "q35", lambda d: (d / "config.json").unlink(), r"no config\.json in \S+/folder"),
    ("fp8_weight", "q35", _fp8("model.layers.3.self_attn.o_proj"),
     r"model\.layers\.3\.self_attn\.o_proj\.weight in model\.safetensors is an FP8 weight \(torch\.float8_e4m3fn\)"),
    ("fp8_quant_algo", "q35-mo", lambda d: edit_json(d, lambda c: c["quantization"].update(quant_algo="FP8"),
                                                     "hf_quant_config.json"),
     r"hf_quant_config\.json: quant_algo = 'FP8'"),
    ("ct_ignores_nvfp4", "q35-ct", _ct_ignore(lambda ig: ig.append(Q)),
     r"model\.layers\.3\.self_attn\.q_proj in model\.safetensors is stored as NVFP4, but the checkpoint's "
     r"compressed-tensors config excludes it"),
    ("ct_ignore_regex", "q35-ct", _ct_ignore(lambda ig: ig.append(r"re:.*layers\.2\.mlp\.down_proj$")),
     r"model\.layers\.2\.mlp\.down_proj in model\.safetensors is stored as NVFP4, but the checkpoint's "
     r"compressed-tensors config excludes it"),
    ("mo_excludes_nvfp4", "q35-mo", _mo_exclude(lambda ex: ex.append("model.layers.3.self_attn*")),
     r"model\.layers\.3\.self_attn\.[qkvo]_proj in model\.safetensors is stored as NVFP4, but the checkpoint's "
     r"modelopt config excludes it"),
    ("ct_float_not_excluded", "q35-ct", _ct_ignore(lambda ig: ig.remove("lm_head")),
     r"lm_head\.weight in model\.safetensors is torch\.float32, but the checkpoint's compressed-tensors config "
     r"does not exclude 'lm_head'"),
    ("mo_float_not_excluded", "q35-mo", _mo_exclude(lambda ex: ex.remove("model.layers.1.linear_attn*")),
     r"model\.layers\.1\.linear_attn\.\w+\.weight in model\.safetensors is torch\.float32, but the checkpoint's "
     r"modelopt config does not exclude 'model\.layers\.1\.linear_attn\.\w+'"),
    ("mo_config_json_not_excluded", "q35-mo", _mo_config_json_only(lambda ig: ig.remove("lm_head")),
     r"lm_head\.weight in model\.safetensors is torch\.float32, but the checkpoint's modelopt config does not "
     r"exclude 'lm_head'"),
    ("nvfp4_router", "q35moe", _replace_by_nvfp4("model.layers.0.mlp.gate", (8, 64), "compressed-tensors"),
     r"model\.layers\.0\.mlp\.gate in model\.safetensors is stored as NVFP4, but the decoder keeps it in a float "
     r"dtype"),
    ("nvfp4_shared_expert_gate", "q35moe", _replace_by_nvfp4("model.layers.1.mlp.shared_expert_gate", (1, 64),
                                                             "modelopt"),
     r"model\.layers\.1\.mlp\.shared_expert_gate in model\.safetensors is stored as NVFP4, but the decoder keeps it"),
    ("quant_method", "q35", lambda d: edit_json(d, lambda c: c.update(quantization_config={
        "quant_method": "gptq", "bits": 4})),
     r"config\.json quantization_config\.quant_method = 'gptq'"),
    ("ct_fp8_format", "q35-ct", lambda d: edit_json(d, lambda c: c["quantization_config"].update(
        format="float-quantized")),
     r"config\.json quantization_config\.format = 'float-quantized'"),
]


#: errors only safetensors itself finds, on opening the shard for its data (none: the headers are checked first)
DATA_ERRORS: set = set()


@pytest.mark.parametrize("case, base, edit, match", ERRORS, ids=[e[0] for e in ERRORS])
def test_errors_name_the_tensor_and_the_file(ckpt, tmp_path, monkeypatch, case, base, edit, match):
    """Each broken folder raises a LoadError whose message names what is wrong and where. Every error but a
    damaged data region is found from the headers alone: no tensor data is read (safe_open is never called)
    and pickle files are never unpickled."""
    folder = clone(ckpt(base), tmp_path / "folder")
    edit(folder)
    import safetensors

    def no_data(*a, **k):
        raise AssertionError("tensor data read before the checks")

    if case not in DATA_ERRORS:
        monkeypatch.setattr(safetensors, "safe_open", no_data)
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("the loader unpickled a file"))
    with pytest.raises(LoadError, match=match):
        lynn_model.from_pretrained(folder, device="cpu")


def test_error_ids_are_unique():
    assert len({e[0] for e in ERRORS}) == len(ERRORS)


def test_bad_arguments_are_value_errors(ckpt):
    """``weights="int4"`` (and a non-float dtype) is a ValueError before anything is read (here: no such folder)."""
    with pytest.raises(ValueError, match=r"weights = 'int4': expected one of \('auto', 'nvfp4', 'bf16'\)") as e:
        lynn_model.from_pretrained("/nonexistent/folder", weights="int4")
    assert type(e.value) is ValueError
    with pytest.raises(ValueError, match=r"dtype = torch\.int8"):
        lynn_model.from_pretrained(ckpt("q35"), dtype=torch.int8)
    with pytest.raises(ValueError, match=r"lm_head = 'fp8': expected one of \('checkpoint', 'nvfp4', 'nvfp4-drafts'\)"):
        lynn_model.from_pretrained("/nonexistent/folder", lm_head="fp8")
    with pytest.raises(LoadError, match=r"no config\.json in /nonexistent/folder"):
        lynn_model.from_pretrained("/nonexistent/folder")


def test_from_pretrained_never_modifies_the_folder(ckpt, tmp_path):
    """Loading (every weight mode, and a failing load) leaves the folder byte for byte as it was, with no new file."""
    folder = clone(ckpt("q35moe-mo"), tmp_path / "mo")
    before = tree_hash(folder)
    for weights in ("auto", "bf16", "nvfp4"):
        load(folder, weights=weights)
    edit_json(folder, lambda c: c["quantization"]["exclude_modules"].remove("lm_head"), "hf_quant_config.json")
    before_bad = tree_hash(folder)
    with pytest.raises(LoadError):
        load(folder)
    assert tree_hash(folder) == before_bad and before_bad != before
    session = ckpt("q35-2shards")
    h = tree_hash(session)
    load(session)
    assert tree_hash(session) == h


@pytest.mark.parametrize("file, text", [("config.json", "{not json"), ("config.json", "[1, 2]"),
                                        ("model.safetensors.index.json", "{\"weight_map\": ")])
def test_corrupt_json_names_the_file(ckpt, tmp_path, file, text):
    folder = clone(ckpt("q35"), tmp_path / "bad")
    (folder / file).write_text(text)
    with pytest.raises(lynn_model.LoadError, match=file.replace(".", r"\.")):
        load(folder)


@pytest.mark.parametrize("ignore", [r"experts\.5\.down", r"experts\.7\.", r"shared_expert\.down"])
def test_mixed_nvfp4_and_float_experts_load(ckpt, tmp_path, ignore):
    """``lynn quantize --ignore`` can leave some experts (or a shared-expert part) in bf16: that FFN is dequantised
    to one kind on load (exact), and the model runs."""
    from lynn_model.quantize import quantize_checkpoint

    with lynn_kernels.use_reference():
        quantize_checkpoint(ckpt("q35moe"), tmp_path / "mixed", ignore=[ignore], progress=False)
        model = load(tmp_path / "mixed")
        want = load(tmp_path / "mixed", weights="bf16", dtype=FP32)         # every weight dequantised
        ids = torch.randint(0, 500, (1, 9), generator=torch.Generator().manual_seed(0))
        got = model.forward(ids)
        assert torch.isfinite(got).all()
        assert lynn_kernels.compare(got, want.forward(ids)).rel_l2 < 1e-5


def test_packed_experts_on_a_dense_layer_are_unexpected(ckpt, tmp_path):
    folder = clone(ckpt("next"), tmp_path / "bad")
    edit_tensors(folder, lambda t: t.update({"model.layers.1.mlp.experts.gate_up_proj": torch.zeros(8, 64, 64),
                                             "model.layers.1.mlp.experts.down_proj": torch.zeros(8, 64, 32)}))
    with pytest.raises(lynn_model.LoadError, match="unexpected tensor model.layers.1.mlp.experts.gate_up_proj"):
        load(folder)
