"""Tiny random HF transformers models of the five decoder classes, saved as checkpoints: the parity oracles.

Every 1-D parameter is perturbed (HF initialises zero-centred norms to 0, the GDN norm and dt_bias to 1), so a wrong
``(1 + w)`` / ``w`` or gate path shows. The LM head and the routers are scaled up so that greedy and routing choices
are rarely near-ties.
"""

from __future__ import annotations

from pathlib import Path

import torch

ROPE = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}
MROPE = dict(ROPE, mrope_section=[2, 1, 1], mrope_interleaved=True)
COMMON = dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
              linear_value_head_dim=16, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
              max_position_embeddings=512, tie_word_embeddings=False, hidden_act="silu")
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=16,
              spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16)
MM_IDS = dict(image_token_id=500, video_token_id=501, vision_start_token_id=502, vision_end_token_id=503)

#: Router weights are scaled up so that bf16 rounding does not flip expert choices (HF's own bf16 forward flips
#: some at the default init, which then dominates any comparison of logits or greedy tokens).
ROUTER_SCALE = 10.0
#: name -> (family, is_moe); "next" has a dense layer (mlp_only_layers) beside its MoE layers.
NAMES = ("next", "q35", "q35moe", "q35vl", "q35moevl")
MOE_NAMES = ("next", "q35moe", "q35moevl")

#: HF's own tester configs (transformers' tests: CausalLMModelTester's defaults as Qwen3NextModelTester,
#: Qwen3_5TextModelTester and Qwen3_5MoeTextModelTester set them): sizes that are not multiples of 16
#: (intermediate_size 37, moe_intermediate_size 12, shared_expert_intermediate_size 36, vocab_size 99).
TESTER = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
              intermediate_size=37, hidden_act="silu", max_position_embeddings=512, pad_token_id=0, bos_token_id=1,
              eos_token_id=2, linear_conv_kernel_dim=2, linear_key_head_dim=16, linear_value_head_dim=16,
              linear_num_key_heads=4, linear_num_value_heads=8)
TESTER_MOE = dict(moe_intermediate_size=12, shared_expert_intermediate_size=36, num_experts_per_tok=2, num_experts=8)
TESTERS = ("next-tester", "q35-tester", "q35moe-tester")


def build(name: str, seed: int = 0, **next_config):
    """The HF model ``name`` (fp32, eval mode), built from a fixed seed; ``next_config`` replaces fields of the
    Qwen3-Next config (e.g. ``decoder_sparse_step``)."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config, Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeConfig, Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
        Qwen3_5MoeForCausalLM,
        Qwen3_5MoeForConditionalGeneration,
    )

    torch.manual_seed(seed)
    if name == "next":
        cfg = dict(COMMON, **MOE, intermediate_size=96, decoder_sparse_step=1, mlp_only_layers=[1],
                   norm_topk_prob=True, rope_parameters=ROPE)
        m = Qwen3NextForCausalLM(Qwen3NextConfig(**{**cfg, **next_config}))
    elif name == "q35":
        m = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**COMMON, intermediate_size=96, rope_parameters=MROPE))
    elif name == "q35moe":
        m = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**COMMON, **MOE, rope_parameters=MROPE))
    elif name == "q35vl":
        m = Qwen3_5ForConditionalGeneration(Qwen3_5Config(
            text_config=dict(COMMON, intermediate_size=96, rope_parameters=MROPE), vision_config=VISION, **MM_IDS))
    elif name == "q35moevl":
        m = Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(
            text_config=dict(COMMON, **MOE, rope_parameters=MROPE), vision_config=VISION, **MM_IDS))
    elif name == "next-tester":
        m = Qwen3NextForCausalLM(Qwen3NextConfig(**TESTER, **TESTER_MOE, head_dim=16,
                                                 layer_types=["linear_attention", "full_attention"]))
    elif name == "q35-tester":
        m = Qwen3_5ForCausalLM(Qwen3_5TextConfig(
            **TESTER, head_dim=32, layer_types=["full_attention", "linear_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 10_000, "mrope_section": [2, 1, 1],
                             "mrope_interleaved": True}))
    elif name == "q35moe-tester":
        m = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**TESTER, **TESTER_MOE, head_dim=16,
                                                       layer_types=["full_attention", "linear_attention"]))
    else:
        raise KeyError(name)
    if next_config and name != "next":
        raise ValueError(f"config overrides are for the Qwen3-Next model, not {name!r}")
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for _, p in m.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
        m.get_output_embeddings().weight.mul_(8.0)
        for name, p in m.named_parameters():        # decisive routers: top-k choices far from ties
            if name.endswith("mlp.gate.weight"):
                p.mul_(ROUTER_SCALE)
    return m.eval()


def save(name: str, folder: Path, seed: int = 0, **save_kwargs) -> Path:
    """Build and ``save_pretrained`` the model (fp32 safetensors) into ``folder``; returns it."""
    m = build(name, seed)
    m.save_pretrained(folder, **save_kwargs)
    return Path(folder)


def load(folder: Path, dtype: torch.dtype, experts: str = "grouped_mm"):
    """HF's own load of a saved tiny model, with the settings under which HF's bf16 results are bitwise
    reproducible: eager attention and (MoE classes) grouped_mm experts. ``experts="eager"`` for expert sizes
    torch's grouped_mm refuses (it needs 16-byte strides: the testers' bf16 moe_intermediate_size 12)."""
    from transformers import AutoModelForCausalLM

    kw = {}
    cfg = __import__("json").loads((Path(folder) / "config.json").read_text())
    if "num_experts" in cfg or "num_experts" in cfg.get("text_config", {}):
        kw["experts_implementation"] = experts
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="eager", **kw).eval()
