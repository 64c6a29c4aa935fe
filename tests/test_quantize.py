"""``lynn quantize`` / ``lynn_model.quantize.quantize_checkpoint`` on tiny random HF checkpoints.

The oracles are the two tools whose layouts we write, called directly (a missing oracle fails, it is not skipped):
compressed-tensors' own checkpoint dequantiser reads our config and tensors back, and its quantiser reproduces our
bytes; ModelOpt's ``NVFP4QTensor`` dequantises and requantises our ModelOpt tensors, and its export helpers rebuild
our config files. Models: Qwen3-Next (one dense MLP layer with K = 40, so one module stays unquantised), Qwen3.5-MoE
text-only in fp32, and the Qwen3.5-MoE VL wrapper (``model.language_model.*`` + ``model.visual.*``) in two shards,
plus a copy of it rewritten with packed experts and ``mtp.*`` tensors the way releases ship them.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from lynn_cli import main
from lynn_kernels import nvfp4, runtime
from lynn_kernels.metrics import bit_mismatches
from lynn_kernels.nvfp4 import NVFP4Tensor
from lynn_model import Config, checkpoint
from lynn_model import quantize as lq
from lynn_model.quantize import quantize_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:transformers .* is not tested with current version of modelopt")

BF16, FP32 = torch.bfloat16, torch.float32
FORMATS = ["compressed-tensors", "modelopt"]
LAYOUT = {"compressed-tensors": ("weight_packed", "weight_scale", "weight_global_scale"),
          "modelopt": ("weight", "weight_scale", "weight_scale_2")}
MODELS = ["next", "q35", "q35moe", "vl", "vl_packed"]

#: fixtures that load an oracle package (tests/conftest.py counts the tests that use them)
ORACLE_FIXTURES = {"tiny": "transformers", "ct": "compressed_tensors", "modelopt": "modelopt"}


# ---------------------------------------------------------------------------------------------------------------
# tiny checkpoints


def _build(root: Path) -> dict:
    from tiny_hf import COMMON as common
    from tiny_hf import MM_IDS as mm_ids
    from tiny_hf import MOE as moe
    from tiny_hf import MROPE as mrope
    from tiny_hf import ROPE as rope
    from tiny_hf import VISION as vis
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeConfig, Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
        Qwen3_5MoeForCausalLM,
        Qwen3_5MoeForConditionalGeneration,
    )

    torch.manual_seed(0)
    models = {
        # layer 1 is a dense MLP of width 40: its down_proj has K = 40, not a multiple of 16
        "next": Qwen3NextForCausalLM(Qwen3NextConfig(**common, **moe, intermediate_size=40, decoder_sparse_step=1,
                                                     mlp_only_layers=[1], norm_topk_prob=True,
                                                     rope_parameters=rope)).to(BF16),
        "q35": Qwen3_5ForCausalLM(Qwen3_5TextConfig(**common, intermediate_size=96,
                                                    rope_parameters=mrope)).to(torch.float16),      # dense, fp16
        "q35moe": Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**common, **moe, rope_parameters=mrope)),   # fp32
        "vl": Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(
            text_config=dict(common, **moe, rope_parameters=mrope), vision_config=vis, **mm_ids)).to(BF16),
    }
    dirs = {}
    with torch.no_grad():
        for name, model in models.items():
            for p in model.parameters():                    # a few weights far from the rest: amax varies a lot
                if p.dim() >= 2:
                    f = torch.exp(torch.randn(()) * 1.5)
                    # fp16: stay above amax = 2688 / 65504, below which compressed-tensors' fp16 G overflows to 1.0
                    p.mul_(f.clamp(min=1.0) if p.dtype == torch.float16 else f)
            d = root / name
            kw = {"max_shard_size": "550KB"} if name == "vl" else {}   # splits gate/up pairs
            model.save_pretrained(d, **kw)
            dirs[name] = d
    vl = dirs["vl"]
    assert len(json.loads((vl / "model.safetensors.index.json").read_text())["weight_map"]) > 0
    assert len(set(json.loads((vl / "model.safetensors.index.json").read_text())["weight_map"].values())) == 2
    # the other files a release has, one in a sub-folder
    (vl / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE"}}\n')
    (vl / "tokenizer_config.json").write_text('{"eos_token": "<|im_end|>"}\n')
    (vl / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}\n")
    (vl / "extra").mkdir()
    (vl / "extra" / "README.txt").write_bytes(bytes(range(256)))
    dirs["vl_packed"] = _packed_copy(vl, root / "vl_packed")
    return dirs


def _packed_copy(src: Path, dst: Path) -> Path:
    """The VL checkpoint as Qwen3.5 releases store it: packed experts, plus ``mtp.*`` (packed too), two shards."""
    tensors = {}
    for shard in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(shard))
    out = {}
    pat = re.compile(r"^(.+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
    experts: dict = {}
    for name, t in tensors.items():
        m = pat.match(name)
        if m:
            experts.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = t
        else:
            out[name] = t
    for prefix, parts in experts.items():
        n = 1 + max(e for e, _ in parts)
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([parts[e, "gate"], parts[e, "up"]]) for e in range(n)])
        out[f"{prefix}.down_proj"] = torch.stack([parts[e, "down"] for e in range(n)])
    g = torch.Generator().manual_seed(1)
    config = Config.from_pretrained(src).replace(mtp_layers=1)
    mtp = {name + ".weight": t.shape for name, t in checkpoint.targets(config).items() if name.startswith("mtp.")}
    x = "mtp.layers.0.mlp.experts."           # packed, as the releases store them
    mtp = {k: v for k, v in mtp.items() if not k.startswith(x)}
    e, n, h = config.num_experts, config.moe_intermediate_size, config.hidden_size
    mtp.update({x + "gate_up_proj": (e, 2 * n, h), x + "down_proj": (e, h, n)})
    for name, shape in mtp.items():
        out[name] = (torch.randn(shape, generator=g) * 0.02).to(BF16)
    dst.mkdir()
    names = sorted(out)
    first = set(names[: len(names) // 2])
    q = "model.language_model.layers.3.self_attn.q_proj.weight"      # q in one shard, k and v in the other
    first ^= {q} if (q in first) == ("model.language_model.layers.3.self_attn.k_proj.weight" in first) else set()
    halves = {"model-00001-of-00002.safetensors": [n for n in names if n in first],
              "model-00002-of-00002.safetensors": [n for n in names if n not in first]}
    weight_map = {}
    for shard, part in halves.items():
        save_file({k: out[k].contiguous() for k in part}, str(dst / shard), metadata={"format": "pt"})
        weight_map.update({k: shard for k in part})
    total = sum(t.numel() * t.element_size() for t in out.values())
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}, indent=2))
    for f in ("config.json", "generation_config.json"):
        (dst / f).write_bytes((src / f).read_bytes())
    return dst


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    """The source folders; after the module's last test, each must hash as it did when it was written."""
    dirs = _build(tmp_path_factory.mktemp("tiny"))
    before = {name: tree_hash(d) for name, d in dirs.items()}
    yield dirs
    assert {name: tree_hash(d) for name, d in dirs.items()} == before, "a source checkpoint was modified"


def tree_hash(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(str(p.relative_to(root)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


def read_all(folder: Path) -> dict:
    out = {}
    for shard in sorted(folder.glob("*.safetensors")):
        out.update(load_file(shard))
    return out


def source_modules(tensors: dict) -> dict:
    """``{module: [N, K] weight}`` for every Linear-like weight of a source checkpoint, packed experts per expert."""
    mods = {}
    for name, t in tensors.items():
        m = re.match(r"^(.+\.mlp\.experts)\.(gate_up_proj|down_proj)$", name)
        if m and t.dim() == 3:
            for e in range(t.shape[0]):
                if m.group(2) == "gate_up_proj":
                    half = t.shape[1] // 2
                    mods[f"{m.group(1)}.{e}.gate_proj"] = t[e, :half]
                    mods[f"{m.group(1)}.{e}.up_proj"] = t[e, half:]
                else:
                    mods[f"{m.group(1)}.{e}.down_proj"] = t[e]
        elif name.endswith(".weight") and t.dim() == 2 and not name.endswith(("embed_tokens.weight",
                                                                               "pos_embed.weight")):
            mods[name[:-7]] = t
    return mods


def expected_quantized(mods: dict, linear_attn: bool = False) -> set:
    """The published recipes' choice, restated: attention q/k/v/o and every MLP / expert projection of the
    decoder layers (and, on request, the GDN in/out projections other than a/b), when K % 16 == 0."""
    out = set()
    for name, w in mods.items():
        if not re.match(r"^model\.(language_model\.)?layers\.\d+\.", name) or w.shape[-1] % 16:
            continue
        last, parent = name.rsplit(".", 1)[1], name.rsplit(".", 2)[1]
        if parent == "self_attn" and last in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out.add(name)
        elif ".mlp." in name and last in ("gate_proj", "up_proj", "down_proj"):
            out.add(name)
        elif linear_attn and parent == "linear_attn" and last in ("in_proj_qkv", "in_proj_z", "in_proj_qkvz",
                                                                  "out_proj"):
            out.add(name)
    return out


def partners(module: str) -> str:
    """The fused matmul vLLM builds a module into: q/k/v -> qkv, gate/up -> gate_up (dense, shared, per expert),
    Qwen3.5's in_proj_qkv / in_proj_z -> in_proj_qkvz."""
    module = re.sub(r"\.self_attn\.[qkv]_proj$", ".self_attn.qkv", module)
    module = re.sub(r"\.(gate|up)_proj$", ".gate_up", module)
    return re.sub(r"\.linear_attn\.in_proj_(qkv|z)$", ".linear_attn.in_proj_qkvz", module)


#: Round-trip error of NVFP4 on these (Gaussian) weights is about 0.10; a wrong layout or scale gives O(1).
NVFP4_REL_L2 = 0.13


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm())


def load_nvfp4(out: dict, module: str) -> NVFP4Tensor:
    return NVFP4Tensor.from_state_dict(out, module)


def deq(q: NVFP4Tensor, dtype) -> torch.Tensor:
    with runtime.use_reference():
        return nvfp4.dequantize(q, dtype)


def run(tiny, model, fmt, tmp_path, **kw) -> tuple[Path, dict]:
    dst = tmp_path / f"{model}-{fmt}"
    summary = quantize_checkpoint(tiny[model], dst, format=fmt, progress=False, **kw)
    return dst, summary


# ---------------------------------------------------------------------------------------------------------------
# 1. compressed-tensors reads our output back


@pytest.fixture(scope="module")
def ct():
    from compressed_tensors.compressors.nvfp4.helpers import quantize_and_pack_fp4
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer
    from compressed_tensors.quantization import QuantizationArgs, QuantizationStrategy, QuantizationType
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    args = QuantizationArgs(num_bits=4, type=QuantizationType.FLOAT, strategy=QuantizationStrategy.TENSOR_GROUP,
                            group_size=16, symmetric=True, dynamic=False, scale_dtype=torch.float8_e4m3fn)

    def quant(w, gs):
        blocks = w.unflatten(-1, (-1, 16))
        scale, _ = calculate_qparams(blocks.amin(-1), blocks.amax(-1), args, global_scale=gs)
        return quantize_and_pack_fp4(w, scale, global_scale=gs), scale.to(torch.float8_e4m3fn)

    return type("CT", (), {"Dequantizer": CompressedTensorsDequantizer, "quant": staticmethod(quant),
                           "gparam": staticmethod(generate_gparam)})


@pytest.mark.parametrize("model,recipe", [*((m, None) for m in MODELS), ("vl", "modelopt")])
def test_compressed_tensors_reads_it_back(model, recipe, tiny, tmp_path, ct):
    """compressed-tensors' checkpoint dequantiser (config.json + every shard, with its residual-qparam check, which
    fails on a quantised module listed in ``ignore`` or a tensor it cannot place) decodes every quantised module to
    what our ``dequantize`` gives, and passes every other tensor through unchanged. With the compressed-tensors
    recipe (the default) they agree bit for bit; a ModelOpt-recipe tensor in this layout stores ``G = 1/g``, and
    CT's ``scale / G`` then lands one fp32 ulp from our ``scale * g`` in some blocks (one bf16 ulp in 0.1 % of
    elements here): allowed only there. What CT reads is the source weight to NVFP4 accuracy."""
    dst, summary = run(tiny, model, "compressed-tensors", tmp_path, recipe=recipe)
    dequantizer = ct.Dequantizer(dst, dtype=BF16)
    out, src = read_all(dst), source_modules(read_all(tiny[model]))
    theirs = {}
    for shard in sorted(dst.glob("*.safetensors")):
        theirs.update(dequantizer.validate(load_file(shard)))
    layout = {f"{m}.{k}" for m in summary["quantized"] for k in LAYOUT["compressed-tensors"]}
    assert layout <= set(out)
    assert set(theirs) == (set(out) - layout) | {m + ".weight" for m in summary["quantized"]}
    one_ulp = 0
    for m in summary["quantized"]:
        q = load_nvfp4(out, m)
        ours, got = deq(q, BF16), theirs[m + ".weight"]
        assert rel_l2(got, src[m]) < NVFP4_REL_L2, m
        differ = ours.view(torch.int16) != got.view(torch.int16)
        if differ.any():
            # CT forms scale / G, we form scale * (1/G): one fp32 ulp apart in some blocks, then one bf16 ulp at most
            s = q.scales.float()
            blocks = (s / q.recip_global_scale) != (s * q.global_scale)
            assert bool((differ <= blocks.repeat_interleave(16, -1)).all()), m
            steps = (ours.view(torch.int16).int() - got.view(torch.int16).int()).abs()[differ]
            assert int(steps.max()) == 1, m
            one_ulp += int(differ.sum())
    total = sum(out[m + ".weight_packed"].numel() * 2 for m in summary["quantized"])
    allowed = 0 if recipe is None else total // 100
    assert one_ulp <= allowed, f"{one_ulp} of {total} elements one bf16 ulp apart"
    for name in set(out) - layout:
        assert bit_mismatches(theirs[name], out[name]) == 0, name


@pytest.mark.parametrize("model", ["vl", "next"])
def test_compressed_tensors_bytes_and_fused_scales(model, tiny, tmp_path, ct):
    """With the compressed-tensors recipe, CT's own quantiser given the fused group's G (llm-compressor's rule: the
    smallest of the members' own G) reproduces our codes and block scales byte for byte."""
    dst, summary = run(tiny, model, "compressed-tensors", tmp_path)
    out, src = read_all(dst), source_modules(read_all(tiny[model]))
    groups: dict = {}
    for m in summary["quantized"]:
        groups.setdefault(partners(m), []).append(m)
    sizes = {lq.fused_group(v[0]): len(v) for v in groups.values()}
    assert sorted(set(sizes.values())) == [1, 2, 3]                           # down / o, gate+up, q+k+v
    assert all(lq.fused_group(m) == lq.fused_group(v[0]) for v in groups.values() for m in v)
    for group, members in groups.items():
        gs = torch.min(torch.cat([ct.gparam(src[m].amin(), src[m].amax(), dtype=src[m].dtype).float()
                                  for m in members]))
        for m in members:
            assert bit_mismatches(out[m + ".weight_global_scale"], gs.reshape(1)) == 0, m
            codes, scales = ct.quant(src[m], gs.reshape(1))
            assert bit_mismatches(out[m + ".weight_packed"], codes) == 0, m
            assert bit_mismatches(out[m + ".weight_scale"].view(torch.uint8), scales.view(torch.uint8)) == 0, m


def test_transformers_loads_it(tiny, tmp_path):
    """Transformers' compressed-tensors integration loads the dense model's folder: every quantised Linear holds
    our dequantised weight, and the logits equal the source model's with those weights swapped in. (Its MoE classes
    keep experts in fused parameters that this integration does not decompress, so only the dense model is used.)"""
    from transformers import AutoModelForCausalLM

    dst, summary = run(tiny, "q35", "compressed-tensors", tmp_path)
    out = read_all(dst)
    theirs = AutoModelForCausalLM.from_pretrained(dst, dtype=BF16).eval()
    ref = AutoModelForCausalLM.from_pretrained(tiny["q35"], dtype=BF16).eval()
    ids = torch.randint(0, 500, (1, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = theirs(input_ids=ids).logits                 # the first forward decompresses the weights
        for m in summary["quantized"]:
            w = deq(load_nvfp4(out, m), BF16)
            assert bit_mismatches(theirs.get_submodule(m).weight.detach(), w) == 0, m
            ref.get_submodule(m).weight.copy_(w)
        assert torch.equal(logits, ref(input_ids=ids).logits)


@pytest.mark.oracle("compressed_tensors")
def test_compressed_tensors_config_is_cts_own(tiny, tmp_path):
    """Our ``quantization_config`` is what compressed-tensors' ``ModelCompressor.update_config`` writes for its
    NVFP4A16 preset scheme with the same ignore list, and it parses as a ``QuantizationConfig``."""
    import compressed_tensors
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    dst, summary = run(tiny, "vl", "compressed-tensors", tmp_path)
    ours = json.loads((dst / "config.json").read_text())["quantization_config"]
    scheme = preset_name_to_scheme("NVFP4A16", ["Linear"])
    scheme.format = "nvfp4-pack-quantized"
    qc = QuantizationConfig(config_groups={"group_0": scheme}, format="nvfp4-pack-quantized",
                            quantization_status="compressed", ignore=summary["kept"])
    ref = tmp_path / "ref"
    ref.mkdir()
    (ref / "config.json").write_text((tiny["vl"] / "config.json").read_text())
    ModelCompressor(quantization_config=qc).update_config(str(ref))
    theirs = json.loads((ref / "config.json").read_text())["quantization_config"]
    assert theirs["version"] == compressed_tensors.__version__ == lq.CT_VERSION
    assert ours == theirs
    parsed = QuantizationConfig.model_validate(ours)
    assert parsed.config_groups["group_0"].input_activations is None
    assert parsed.config_groups["group_0"].weights.group_size == 16
    # the rest of config.json is the source's, unchanged
    src_cfg = json.loads((tiny["vl"] / "config.json").read_text())
    got = json.loads((dst / "config.json").read_text())
    assert {k: v for k, v in got.items() if k != "quantization_config"} == src_cfg


# ---------------------------------------------------------------------------------------------------------------
# 2. ModelOpt reads our output back


@pytest.fixture(scope="module")
def modelopt():
    from modelopt.torch.export.convert_hf_config import convert_hf_quant_config_format
    from modelopt.torch.export.quant_utils import _prefix_wildcard_summarize_exclude_modules
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    return type("MO", (), {"QT": NVFP4QTensor, "convert": staticmethod(convert_hf_quant_config_format),
                           "summarize": staticmethod(_prefix_wildcard_summarize_exclude_modules)})


@pytest.mark.parametrize("model", MODELS)
def test_modelopt_reads_it_back(model, tiny, tmp_path, modelopt):
    """ModelOpt's ``NVFP4QTensor.dequantize`` of our ``weight`` / ``weight_scale`` / ``weight_scale_2`` equals our
    dequantize value for value in fp32 (only the sign of zero may differ: ModelOpt decodes code 0x8 as +0) and bit
    for bit in bf16; and ModelOpt's quantiser, given the fused group's ``weight_scale_2`` (ModelOpt's rule: the max
    amax of the group / 2688), writes our bytes."""
    dst, summary = run(tiny, model, "modelopt", tmp_path)
    out, src = read_all(dst), source_modules(read_all(tiny[model]))
    groups: dict = {}
    for m in summary["quantized"]:
        groups.setdefault(partners(m), []).append(m)
    for group, members in groups.items():
        g = torch.max(torch.stack([modelopt.QT.get_weights_scaling_factor_2(src[m]).float().reshape(())
                                   for m in members]))
        for m in members:
            w, ws, ws2 = (out[f"{m}.{k}"] for k in LAYOUT["modelopt"])
            assert w.dtype == torch.uint8 and ws.dtype == torch.float8_e4m3fn and ws2.dtype == FP32
            assert ws2.shape == () and bit_mismatches(ws2, g) == 0, m
            qt = modelopt.QT(src[m].shape, src[m].dtype, w)
            q = load_nvfp4(out, m)
            for dtype in (FP32, BF16):
                theirs = qt.dequantize(dtype=dtype, scale=ws, double_scale=ws2, block_sizes={-1: 16})
                assert rel_l2(theirs, src[m]) < NVFP4_REL_L2, m
                ours = deq(q, dtype)
                assert torch.equal(ours, theirs), m
                if dtype == BF16:
                    assert bit_mismatches(ours.abs(), theirs.abs()) == 0, m
            qt2, s2, g2 = modelopt.QT.quantize(src[m].clone(), 16, weights_scaling_factor_2=g)
            assert bit_mismatches(qt2._quantized_data, w) == 0, m
            assert bit_mismatches(s2.view(torch.uint8), ws.view(torch.uint8)) == 0, m


def test_modelopt_config_files_are_modelopts_own(tiny, tmp_path, modelopt):
    """``hf_quant_config.json`` has ModelOpt's keys (weight-only ``W4A16_NVFP4``), its ``exclude_modules`` is what
    ModelOpt's export summariser makes of the kept / quantised modules, covers every kept module and no quantised
    one (fnmatch, as vLLM matches them), and config.json's ``quantization_config`` is ModelOpt's conversion of it."""
    for model in ("vl_packed", "next"):
        dst, summary = run(tiny, model, "modelopt", tmp_path)
        hf = json.loads((dst / "hf_quant_config.json").read_text())
        assert hf["producer"] == {"name": "modelopt", "version": lq.MODELOPT_VERSION}
        q = hf["quantization"]
        assert list(q) == ["quant_algo", "kv_cache_quant_algo", "group_size", "exclude_modules"]
        assert q["quant_algo"] == "W4A16_NVFP4" and q["kv_cache_quant_algo"] is None and q["group_size"] == 16
        assert sorted(q["exclude_modules"]) == sorted(modelopt.summarize(summary["kept"], summary["quantized"]))
        for m in summary["kept"]:
            assert any(fnmatch.fnmatchcase(m, p) for p in q["exclude_modules"]), m
        for m in summary["quantized"]:
            assert not any(fnmatch.fnmatchcase(m, p) for p in q["exclude_modules"]), m
        cfg = json.loads((dst / "config.json").read_text())["quantization_config"]
        assert cfg == modelopt.convert(hf) and cfg["quant_method"] == "modelopt"
        if model == "vl_packed":
            assert {"lm_head", "model.visual*", "mtp*"} <= set(q["exclude_modules"])


# ---------------------------------------------------------------------------------------------------------------
# 3. what is quantised, what is kept, fused scales, copies


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("model", MODELS)
def test_modules_tensors_and_copies(model, fmt, tiny, tmp_path):
    source = read_all(tiny[model])
    mods = source_modules(source)
    want_q = expected_quantized(mods)
    dst, summary = run(tiny, model, fmt, tmp_path)
    out = read_all(dst)
    assert set(summary["quantized"]) == want_q
    assert summary["n_quantized"] == len(want_q) and summary["n_kept"] == len(summary["kept"])
    kept = set(summary["kept"])
    assert kept.isdisjoint(want_q)
    assert {m for m in mods if m not in want_q} <= kept
    P = "model.language_model." if model.startswith("vl") else "model."
    assert {"lm_head", f"{P}layers.0.linear_attn.out_proj", f"{P}layers.0.linear_attn.conv1d"} <= kept
    if model != "q35":
        assert {f"{P}layers.0.mlp.gate", f"{P}layers.0.mlp.shared_expert_gate"} <= kept
    if model.startswith("vl"):
        assert {"model.visual.blocks.0.attn.qkv", "model.visual.merger.linear_fc1",
                "model.visual.patch_embed.proj"} <= kept
        assert not any(m.startswith(("model.visual.", "mtp.")) for m in summary["quantized"])
    # each quantised module: exactly its three layout tensors, with the layout's dtypes and shapes
    names = set()
    for m in want_q:
        n, k = mods[m].shape
        t = {suffix: out[f"{m}.{suffix}"] for suffix in LAYOUT[fmt]}
        assert t[LAYOUT[fmt][0]].dtype == torch.uint8 and tuple(t[LAYOUT[fmt][0]].shape) == (n, k // 2)
        assert t["weight_scale"].dtype == torch.float8_e4m3fn and tuple(t["weight_scale"].shape) == (n, k // 16)
        g = t[LAYOUT[fmt][2]]
        assert g.dtype == FP32 and tuple(g.shape) == ((1,) if fmt == "compressed-tensors" else ())
        names.update(f"{m}.{s}" for s in LAYOUT[fmt])
    assert not any(f"{m}.input_scale" in out or f"{m}.input_global_scale" in out for m in want_q)
    # everything else is the source's tensor, bit for bit (packed experts of quantised layers come back per expert)
    split = {n for n in source if re.search(r"\.mlp\.experts\.(gate_up|down)_proj$", n) and
             n.startswith("model.")}
    for name, t in source.items():
        if name in split or name[:-7] in want_q and name.endswith(".weight"):
            continue
        assert name in out and out[name].dtype == t.dtype and bit_mismatches(out[name], t) == 0, name
        names.add(name)
    assert set(out) == names, sorted(set(out) ^ names)[:10]
    # fused partners share one global scale: the one their recipe gives the member with the largest amax
    groups: dict = {}
    for m in want_q:
        groups.setdefault(partners(m), []).append(m)
    for members in groups.values():
        scales = [out[f"{m}.{LAYOUT[fmt][2]}"] for m in members]
        assert all(bit_mismatches(s, scales[0]) == 0 for s in scales), members
        amax = [mods[m].float().abs().amax() for m in members]
        top = members[max(range(len(members)), key=lambda i: amax[i])]
        alone = nvfp4.reference.quantize(mods[top], recipe=lq.DEFAULT_RECIPE[fmt])
        assert bit_mismatches(load_nvfp4(out, top).global_scale, alone.global_scale) == 0, top
    if model == "next":
        assert "model.layers.1.mlp.down_proj" in kept
        assert any("K = 40" in n for n in summary["notes"])
    if model in ("vl", "vl_packed"):   # fused partners in different shards still get one scale (checked above)
        wm = json.loads((tiny[model] / "model.safetensors.index.json").read_text())["weight_map"]
        where = {m: wm.get(m + ".weight") or wm[m.rsplit(".", 2)[0] + (".down_proj" if m.endswith("down_proj")
                                                                       else ".gate_up_proj")] for m in want_q}
        cross = {g for g, v in groups.items() if len({where[m] for m in v}) > 1}
        assert cross and all(g.endswith(("gate_up", "qkv")) for g in cross), cross
        if model == "vl_packed":
            assert "model.language_model.layers.3.self_attn.qkv" in cross
    if model == "vl_packed":
        assert "mtp.layers.0.mlp.experts.gate_up_proj" in out and "mtp.layers.0.mlp.experts.3.gate_proj" in kept
        assert "model.language_model.layers.0.mlp.experts.gate_up_proj" not in out
    assert summary["bytes_before"] == sum(t.numel() * t.element_size() for t in source.values())
    assert summary["bytes_after"] == sum(t.numel() * t.element_size() for t in out.values())


@pytest.mark.parametrize("fmt", FORMATS)
def test_packed_experts_give_the_per_expert_output(fmt, tiny, tmp_path):
    """The same weights stored packed (release layout) or per expert (HF's save) quantise to the same tensors."""
    a = read_all(run(tiny, "vl", fmt, tmp_path)[0])
    b = read_all(run(tiny, "vl_packed", fmt, tmp_path)[0])
    common = {n for n in b if not n.startswith("mtp.")}
    assert common == set(a)
    for n in common:
        assert bit_mismatches(a[n], b[n]) == 0, n


def test_files_index_and_config(tiny, tmp_path):
    dst, summary = run(tiny, "vl", "compressed-tensors", tmp_path)
    src = tiny["vl"]
    for rel in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                "extra/README.txt"):
        assert (dst / rel).read_bytes() == (src / rel).read_bytes(), rel
    assert sorted(summary["files_copied"]) == sorted(["chat_template.jinja", "extra/README.txt",
                                                      "generation_config.json", "tokenizer.json",
                                                      "tokenizer_config.json"])
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in dst.glob("*.safetensors"))
    assert shards == sorted(set(json.loads((src / "model.safetensors.index.json").read_text())["weight_map"].values()))
    seen = {}
    for shard in shards:
        with safe_open(dst / shard, framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            seen.update({k: shard for k in f.keys()})
    assert index["weight_map"] == seen
    assert index["metadata"]["total_size"] == summary["bytes_after"]
    single, _ = run(tiny, "q35moe", "modelopt", tmp_path)
    assert not (single / "model.safetensors.index.json").exists() and (single / "model.safetensors").is_file()


def test_src_never_modified_and_path_errors(tiny, tmp_path):
    src = tiny["vl"]
    before = tree_hash(src)
    dst = tmp_path / "out"
    quantize_checkpoint(src, dst, progress=False)
    with pytest.raises(ValueError, match="DST is SRC"):
        quantize_checkpoint(src, src, progress=False)
    with pytest.raises(ValueError, match="is inside SRC"):
        quantize_checkpoint(src, src / "nvfp4", progress=False)
    with pytest.raises(ValueError, match="contains SRC"):
        quantize_checkpoint(src, src.parent, overwrite=True, progress=False)
    with pytest.raises(FileExistsError, match="exists and is not empty; pass overwrite=True"):
        quantize_checkpoint(src, dst, format="modelopt", progress=False)
    (dst / "stale.safetensors").write_bytes(b"old")
    quantize_checkpoint(src, dst, format="modelopt", overwrite=True, progress=False)
    assert not (dst / "stale.safetensors").exists() and (dst / "hf_quant_config.json").is_file()
    (tmp_path / "empty").mkdir()
    quantize_checkpoint(src, tmp_path / "empty", progress=False)          # an empty DST is fine
    with pytest.raises(ValueError, match="already quantised"):
        quantize_checkpoint(dst, tmp_path / "twice", progress=False)
    with pytest.raises(ValueError, match="format='gguf'"):
        quantize_checkpoint(src, tmp_path / "x", format="gguf", progress=False)
    with pytest.raises(ValueError, match="recipe='nvidia'"):
        quantize_checkpoint(src, tmp_path / "x", recipe="nvidia", progress=False)
    with pytest.raises(ValueError, match="not a valid regular expression"):
        quantize_checkpoint(src, tmp_path / "x", ignore=["(("], progress=False)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        quantize_checkpoint(tmp_path / "empty" / "extra", tmp_path / "x", progress=False)
    other = tmp_path / "llama"
    other.mkdir()
    (other / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ValueError, match=r"model_type \['llama'\] is not one of"):
        quantize_checkpoint(other, tmp_path / "x", progress=False)
    assert not (tmp_path / "x").exists() and not list(tmp_path.glob(".x.lynn-quantize-*"))
    assert tree_hash(src) == before


# ---------------------------------------------------------------------------------------------------------------
# 4. options


def test_ignore_keeps_partners_and_linear_attn_option(tiny, tmp_path):
    dst, s = run(tiny, "vl", "compressed-tensors", tmp_path,
                 ignore=[r"layers\.3\.self_attn\.q_proj", r"experts\.5\.down"], quantize_linear_attn=True)
    P = "model.language_model.layers."
    for p in ("q_proj", "k_proj", "v_proj"):
        assert f"{P}3.self_attn.{p}" in s["kept"]             # k / v follow q: vLLM fuses them into qkv_proj
    assert f"{P}3.self_attn.o_proj" in s["quantized"]
    assert f"{P}0.mlp.experts.5.down_proj" in s["kept"] and f"{P}0.mlp.experts.5.gate_proj" in s["quantized"]
    assert any("fused partners" in n for n in s["notes"])
    out = read_all(dst)
    for i in range(3):
        la = f"{P}{i}.linear_attn"
        assert {f"{la}.in_proj_qkv", f"{la}.in_proj_z", f"{la}.out_proj"} <= set(s["quantized"])
        assert {f"{la}.in_proj_a", f"{la}.in_proj_b", f"{la}.conv1d"} <= set(s["kept"])
        # in_proj_qkv and in_proj_z become one in_proj_qkvz matmul in vLLM: one global scale
        assert bit_mismatches(out[f"{la}.in_proj_qkv.weight_global_scale"],
                              out[f"{la}.in_proj_z.weight_global_scale"]) == 0
    s2 = run(tiny, "next", "modelopt", tmp_path, quantize_linear_attn=True)[1]
    assert set(s2["quantized"]) == expected_quantized(source_modules(read_all(tiny["next"])), linear_attn=True)
    assert "model.layers.0.linear_attn.in_proj_qkvz" in s2["quantized"]
    assert {"model.layers.0.linear_attn.in_proj_ba", "model.layers.0.linear_attn.conv1d"} <= set(s2["kept"])


@pytest.mark.parametrize("fmt", FORMATS)
def test_kernels_write_the_same_bytes(fmt, tiny, tmp_path, monkeypatch):
    """Without a GPU the writer quantises through the torch reference; forced onto the Triton kernels (here the
    interpreter, on a subset of modules to stay quick) it writes the same files' tensors byte for byte."""
    subset = [r"layers\.[012]\.", r"experts\.[1-7]\."]                  # layer 3: q/k/v/o, expert 0, shared
    ref = read_all(run(tiny, "vl", fmt, tmp_path, ignore=subset)[0])
    monkeypatch.setattr(lq, "REFERENCE_ON_CPU", False)
    dst, s = run(tiny, "vl", fmt, tmp_path / "kernels", ignore=subset)
    assert s["n_quantized"] == 4 + 3 + 3
    got = read_all(dst)
    assert set(got) == set(ref)
    for n in got:
        assert bit_mismatches(got[n], ref[n]) == 0, n


# ---------------------------------------------------------------------------------------------------------------
# 5. the command line


def test_cli(tiny, tmp_path, capsys):
    dst = tmp_path / "cli"
    assert main(["quantize", str(tiny["vl_packed"]), str(dst), "--format", "modelopt", "--ignore", r"layers\.0\.",
                 "--ignore", r"experts\.7\."]) == 0
    captured = capsys.readouterr()
    assert "quantize [" in captured.err and "shard 2/2" in captured.err
    assert f"wrote {dst}" in captured.out and "quantised to NVFP4:" in captured.out and "MiB ->" in captured.out
    excl = json.loads((dst / "hf_quant_config.json").read_text())["quantization"]["exclude_modules"]
    assert "model.language_model.layers.0*" in excl
    out = read_all(dst)
    # layer 0 wholly kept: its packed experts are copied as they are; layer 1 keeps expert 7 only: split per expert
    assert out["model.language_model.layers.0.mlp.experts.gate_up_proj"].dtype == BF16
    assert "model.language_model.layers.1.mlp.experts.gate_up_proj" not in out
    kept7 = out["model.language_model.layers.1.mlp.experts.7.down_proj.weight"]
    packed = read_all(tiny["vl_packed"])["model.language_model.layers.1.mlp.experts.down_proj"]
    assert kept7.dtype == BF16 and bit_mismatches(kept7, packed[7]) == 0
    assert out["model.language_model.layers.1.mlp.experts.6.down_proj.weight"].dtype == torch.uint8
    assert main(["quantize", str(tiny["vl_packed"]), str(dst), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "lynn quantize: error:" in err and "--overwrite" in err
    assert main(["quantize", str(tiny["vl_packed"]), str(dst), "--quiet", "--overwrite"]) == 0
    assert capsys.readouterr().err == ""
    assert "quant_method" in json.loads((dst / "config.json").read_text())["quantization_config"]
