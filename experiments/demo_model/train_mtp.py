"""Train a multi-token prediction (MTP) head for the demo model, its trunk frozen, and measure what it buys.

The question: how many drafts of a small MTP head does ``lynn_model.generate(mtp=k)`` get accepted on the demo model
(``data/models/lynn-demo``, its trunk as first trained), and is what the training script measures the same thing
the decoder sees? The head is Qwen3.5's (vLLM's Qwen3.5 / Qwen3-Next MTP model), built from HF transformers parts so
that it trains with autograd: for position ``p``::

    e  = norm_e(embed(tok[p + 1]))          hd = norm_h(trunk's final-normed hidden state at p)
    x  = fc([e | hd])  ->  one full-attention decoder layer (MoE + shared expert; RoPE at p)  ->  norm
    logits = x @ embed.T                    (the trunk's tied LM head)  ->  a guess of tok[p + 2]

Frozen: the shipped trunk (HF ``AutoModelForCausalLM``), its embedding and LM head. Trained: ``fc``, the three norms
and the layer. Warm start: the layer is a copy of the trunk's last full-attention layer (layer 7), the final norm
the trunk's; ``fc = [0 | I]``, so the untrained head is that working layer applied to the trunk's own hidden state
at its known scale, and the embedding half grows from zero (its gradient is not zero). Loss: cross-entropy of the
head's logits at ``p`` against ``tok[p + 2]`` plus 0.01 x the router's load-balancing loss; AdamW, bf16 autocast on
CUDA (fp32 on the CPU), linear warm-up then a cosine over the ``--minutes`` budget or ``--max-epochs`` passes over
the training tokens, whichever ends first (the schedule reads the clock, as ``train.py``'s does). Every
``--eval-every`` seconds, on fixed held-out windows: the head's top-1 agreement with the *trunk's own greedy token*
at ``p + 2`` (what a draft is verified against: it predicts speculative acceptance), its cross-entropy against the
text, and its top-1 accuracy. The best agreement's weights are kept.

Data: the demo model's own corpus (``corpus.py`` into ``.cache/demo/corpus/``, byte-identical to the demo's: its
SHA-256 is in ``data/corpus/SOURCES.json``), tokenised with the SHIPPED tokenizer
(``data/models/lynn-demo/tokenizer.json``; not retrained), train split only (4,750,953 tokens, as the demo's
``train_record.json`` counts); the held-out windows come from ``data/corpus/heldout.txt`` (the held-out split, never
trained on)::

    python experiments/demo_model/corpus.py                                  # needs apt-get, npm, rdata, pysword
    PYTHONPATH=. python3 experiments/demo_model/train_mtp.py --tokenize      # -> .cache/demo/tokens/train.bin, 9.5 MB

Train. On the CPU a smoke run of 3 minutes (the trunk's HF forward, Gated DeltaNet on torch's fallback, is most of
a step; on a 2-core machine that others share, one thread runs several times faster than two), then the check
below::

    PYTHONPATH=. python3 experiments/demo_model/train_mtp.py --minutes 3 --device cpu --threads 1 --batch 8 \\
        --seq 128 --warmup 10 --lr 2e-3 --eval-windows 16 --eval-seq 256 --eval-every 30 --verify-reps 2 \\
        --out /tmp/mtp-run

On the GPU machine (no network: carry ``.cache/demo/tokens``, 9.9 MB; nothing else is needed beyond the tree)::

    PYTHONPATH=. python3 experiments/demo_model/train_mtp.py --minutes 8 --device cuda --out $OUT/mtp

(the device allows 600 s a command: with the check on the GPU after training, ``--minutes 7`` leaves room for its
Triton compiles; or ``--no-verify`` there and ``--verify-only DIR --device cpu`` here on the returned files).

Writes into ``--out``: ``mtp.safetensors`` (bf16, 2.8 MB; exactly the ``mtp.*`` tensors
``lynn_model.checkpoint.targets(config.replace(mtp_layers=1))`` lists, the routed experts one tensor per expert and
projection as the shipped trunk stores them), ``train_mtp_log.jsonl`` (a line per logged step and evaluation),
``train_mtp_record.json`` (provenance, steps, tokens, the best held-out agreement and cross-entropy) and, unless
``--no-verify``, ``verify.json``: the demo folder with ``mtp.safetensors`` added to it and to its index's
``weight_map`` (in ``--verify-dir``, else a temporary ``OUT/demo-mtp``), loaded by ``lynn_model.from_pretrained``
(on the CPU under ``lynn_kernels.use_reference()``); the head's logits through HF and through
``Model.mtp_step`` on one prompt (they must agree: a difference is a forward that differs, not training); then
``generate`` on held-out prompts with ``mtp=0`` and ``mtp=1..3``: the same tokens or not, drafts accepted, tokens per
verify step (``Stats.acceptance_length``), wall and CPU time; and sampled at ``--verify-temperature`` under both
acceptance rules (drafts kept; the coupled rule's tokens against plain sampling's). ``--verify-only DIR`` runs that
check alone on ``DIR/mtp.safetensors``, writing ``verify.json`` into ``--out`` (``--threads 1 --verify-reps 2`` for CPU
timings on a shared machine).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import shutil
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache" / "demo"
DEMO = ROOT / "data" / "models" / "lynn-demo"
HELDOUT = ROOT / "data" / "corpus" / "heldout.txt"
EOT = "<|endoftext|>"
AUX_COEF = 0.01


# ----------------------------------------------------------------------------------------------------------- data


def encode_documents(tok, text: str) -> np.ndarray:
    """Token ids of a corpus file's text, one document at a time, each followed by ``<|endoftext|>`` (as
    ``tokenizer.py`` writes ``train.bin``)."""
    eot = tok.token_to_id(EOT)
    ids: list[int] = []
    docs = [d for d in text.split(f"\n{EOT}\n") if d.strip()]
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        ids += enc.ids + [eot]
    return np.asarray(ids, dtype=np.uint16)


def shipped_tokenizer(model: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model / "tokenizer.json"))


def tokenize(model: Path, corpus: Path, dest: Path) -> dict:
    """``corpus/train.txt`` (and, for the record, ``heldout.txt``) with the shipped tokenizer -> ``dest/*.bin``."""
    tok = shipped_tokenizer(model)
    dest.mkdir(parents=True, exist_ok=True)
    stats = {"tokenizer": str(model / "tokenizer.json"), "vocab_size": tok.get_vocab_size()}
    for split in ("train", "heldout"):
        text = (corpus / f"{split}.txt").read_text()
        arr = encode_documents(tok, text)
        arr.tofile(dest / f"{split}.bin")
        size = (dest / f"{split}.bin").stat().st_size
        stats[split] = {"tokens": int(arr.size), "characters": len(text), "bytes": size}
        print(f"{split:>8}: {arr.size:,} tokens -> {dest / f'{split}.bin'} ({stats[split]['bytes'] / 1e6:.1f} MB)")
    (dest / "stats.json").write_text(json.dumps(stats, indent=1) + "\n")
    return stats


def batch_windows(tokens: np.ndarray, batch: int, seq: int, gen: np.random.Generator, device) -> torch.Tensor:
    starts = gen.integers(0, tokens.size - seq, size=batch)
    x = np.stack([tokens[s:s + seq] for s in starts]).astype(np.int64)
    return torch.from_numpy(x).to(device, non_blocking=True)


# ---------------------------------------------------------------------------------------------------------- model


def load_trunk(path: Path, device: torch.device, experts: str):
    """The shipped model in fp32 (bf16 autocast on CUDA), frozen, in eval mode."""
    from transformers import AutoModelForCausalLM

    trunk = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="sdpa",
                                                 experts_implementation=experts)
    for mod in trunk.modules():                   # (a transformers that ignores the keyword still gets it)
        if getattr(mod, "config", None) is not None and hasattr(mod.config, "_experts_implementation"):
            mod.config._experts_implementation = experts
    trunk.to(device).eval().requires_grad_(False)
    return trunk


class MTPHead(nn.Module):
    """Qwen3.5's MTP module from HF parts; parameter names are the checkpoint's after ``mtp.`` (the routed experts
    packed as HF holds them in memory: ``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj [E, H, I]``)."""

    def __init__(self, trunk_config, experts: str):
        super().__init__()
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
            Qwen3_5MoeDecoderLayer,
            Qwen3_5MoeRMSNorm,
            Qwen3_5MoeTextRotaryEmbedding,
        )

        cfg = copy.deepcopy(trunk_config)
        n = cfg.num_hidden_layers
        cfg.layer_types = [*cfg.layer_types[:n], "full_attention"]       # the MTP layer: index n, full attention
        cfg._attn_implementation = "sdpa"                                  # causal when no mask is passed
        cfg._experts_implementation = experts
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.config, self.layer_index = cfg, n
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = Qwen3_5MoeRMSNorm(h, eps)
        self.pre_fc_norm_hidden = Qwen3_5MoeRMSNorm(h, eps)
        self.layers = nn.ModuleList([Qwen3_5MoeDecoderLayer(cfg, n)])
        self.norm = Qwen3_5MoeRMSNorm(h, eps)
        self.rotary_emb = Qwen3_5MoeTextRotaryEmbedding(cfg)
        self._router_logits: list[torch.Tensor] = []
        self.layers[0].mlp.gate.register_forward_hook(lambda mod, inp, out: self._router_logits.append(out[0]))

    @torch.no_grad()
    def warm_start(self, trunk) -> int:
        """Layer <- the trunk's last full-attention layer; final norm <- the trunk's; fc <- [0 | I]; the pre-fc
        norms at zero (scale 1). Returns the trunk layer's index."""
        src = max(i for i, t in enumerate(trunk.config.layer_types) if t == "full_attention")
        self.layers[0].load_state_dict(trunk.model.layers[src].state_dict())
        self.norm.weight.copy_(trunk.model.norm.weight)
        h = self.fc.weight.shape[0]
        self.fc.weight.zero_()
        self.fc.weight[:, h:].copy_(torch.eye(h))
        self.pre_fc_norm_embedding.weight.zero_()
        self.pre_fc_norm_hidden.weight.zero_()
        return src

    def forward(self, next_embeds: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``next_embeds [B, T, H]`` the embeddings of tok[p + 1], ``hidden [B, T, H]`` the trunk's final-normed
        hidden states at p, for p = 0..T-1 -> (the head's final-normed output ``[B, T, H]``, router logits)."""
        self._router_logits = []
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)], -1))
        pos = torch.arange(x.shape[1], device=x.device).unsqueeze(0).expand(x.shape[0], -1)
        rope = self.rotary_emb(x, pos[None].expand(3, -1, -1))   # the 3 rope sections' positions (text: all equal)
        x = self.layers[0](x, position_embeddings=rope, attention_mask=None, position_ids=pos)
        return self.norm(x), self._router_logits

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """The head's tensors under the checkpoint's names (``mtp.*``), bf16, experts one tensor per expert and
        projection (``experts.{j}.gate_proj`` = the first ``I`` rows of ``gate_up_proj[j]``, ``up_proj`` the rest)."""
        out = {}
        for name, t in self.state_dict().items():
            if name.startswith("rotary_emb."):
                continue
            t = t.detach().to("cpu", torch.bfloat16)
            if name.endswith("mlp.experts.gate_up_proj"):
                base, inter = name[:-len("gate_up_proj")], t.shape[1] // 2
                for j in range(t.shape[0]):
                    out[f"mtp.{base}{j}.gate_proj.weight"] = t[j, :inter].contiguous()
                    out[f"mtp.{base}{j}.up_proj.weight"] = t[j, inter:].contiguous()
            elif name.endswith("mlp.experts.down_proj"):
                base = name[:-len("down_proj")]
                for j in range(t.shape[0]):
                    out[f"mtp.{base}{j}.down_proj.weight"] = t[j].contiguous()
            else:
                out["mtp." + name] = t.contiguous()
        return out

    @torch.no_grad()
    def load_checkpoint_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """The inverse of :meth:`checkpoint_tensors` (per-expert tensors packed back into HF's stacks)."""
        state = {}
        for name, t in self.state_dict().items():
            if name.startswith("rotary_emb."):
                state[name] = t
            elif name.endswith("mlp.experts.gate_up_proj"):
                base = "mtp." + name[:-len("gate_up_proj")]
                state[name] = torch.stack([torch.cat([tensors[f"{base}{j}.gate_proj.weight"],
                                                      tensors[f"{base}{j}.up_proj.weight"]])
                                           for j in range(t.shape[0])])
            elif name.endswith("mlp.experts.down_proj"):
                base = "mtp." + name[:-len("down_proj")]
                state[name] = torch.stack([tensors[f"{base}{j}.down_proj.weight"] for j in range(t.shape[0])])
            else:
                state[name] = tensors["mtp." + name]
        self.load_state_dict({k: v.to(torch.float32) for k, v in state.items()})


def mtp_inputs(trunk, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For windows ``x [B, T]``: (embeddings of tok[p + 1], the trunk's final-normed hidden at p, targets tok[p + 2])
    for p = 0..T-3, and the trunk's full hidden states (no grad)."""
    with torch.no_grad():
        hidden = trunk.model(input_ids=x).last_hidden_state
        emb = trunk.model.embed_tokens(x[:, 1:-1])
    return emb, hidden[:, :-2], x[:, 2:], hidden


def head_logits(trunk, out: torch.Tensor) -> torch.Tensor:
    return trunk.lm_head(out).float()


# ----------------------------------------------------------------------------------------------------- evaluation


class HeldOut:
    """Fixed held-out windows with what the frozen trunk gives on them, computed once: its final-normed hidden
    states and its greedy token at every position."""

    def __init__(self, trunk, tokens: np.ndarray, windows: int, seq: int, device, chunk: int):
        gen = np.random.default_rng(1234)
        starts = gen.integers(0, tokens.size - seq, size=windows)
        self.x = torch.from_numpy(np.stack([tokens[s:s + seq] for s in starts]).astype(np.int64)).to(device)
        self.chunk, self.hidden, self.greedy = chunk, [], []
        with torch.no_grad():
            for i in range(0, windows, chunk):
                w = self.x[i:i + chunk]
                with _autocast(device):
                    h = trunk.model(input_ids=w).last_hidden_state
                    self.greedy.append(head_logits(trunk, h).argmax(-1))
                self.hidden.append(h)
        g = torch.cat(self.greedy)
        # the trunk's own top-1 accuracy on the text at p + 2, for scale
        self.trunk_accuracy = (g[:, 1:-1] == self.x[:, 2:]).float().mean().item()

    @torch.no_grad()
    def evaluate(self, trunk, head: MTPHead) -> dict:
        head.eval()
        ce, agree, acc, n = 0.0, 0, 0, 0
        for i, (h, g) in enumerate(zip(self.hidden, self.greedy)):
            w = self.x[i * self.chunk:(i + 1) * self.chunk]
            emb = trunk.model.embed_tokens(w[:, 1:-1])
            with _autocast(w.device):
                out, _ = head(emb, h[:, :-2])
                logits = head_logits(trunk, out)
            top = logits.argmax(-1)
            ce += torch.nn.functional.cross_entropy(logits.flatten(0, 1), w[:, 2:].flatten(), reduction="sum").item()
            agree += (top == g[:, 1:-1]).sum().item()        # the trunk's greedy token after tok[p + 1]
            acc += (top == w[:, 2:]).sum().item()
            n += top.numel()
        head.train()
        return {"agreement": agree / n, "ce": ce / n, "accuracy": acc / n, "positions": n}


def _autocast(device):
    device = torch.device(device)
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def lr_at(frac: float, step: int, peak: float, warmup: int, floor: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return floor * peak + (1 - floor) * peak * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))


# ------------------------------------------------------------------------------------------- lynn_model's view


def mtp_names(model_dir: Path) -> dict[str, tuple]:
    """What lynn_model expects of an MTP module for this checkpoint: tensor name -> shape."""
    import lynn_model
    from lynn_model.checkpoint import targets

    config = lynn_model.Config.from_hf(json.loads((model_dir / "config.json").read_text()))
    return {name + ".weight": tuple(t.shape) for name, t in targets(config.replace(mtp_layers=1)).items()
            if name.startswith("mtp.")}


def assemble(model_dir: Path, mtp_file: Path, dest: Path) -> Path:
    """A copy of ``model_dir`` with ``mtp_file`` added as a shard (and to the index's weight_map)."""
    from safetensors import safe_open

    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(model_dir, dest, ignore=shutil.ignore_patterns("training", "*.txt", "quality*.json"))
    shutil.copy(mtp_file, dest / "mtp.safetensors")
    index = json.loads((dest / "model.safetensors.index.json").read_text())
    with safe_open(str(mtp_file), "pt") as f:
        for name in f.keys():                     # noqa: SIM118 (safe_open has no __iter__)
            index["weight_map"][name] = "mtp.safetensors"
    (dest / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return dest


def heldout_prompts(tok, prompts: int, prompt_tokens: int) -> list[list[int]]:
    """The first ``prompt_tokens`` tokens of ``prompts`` held-out documents spread over the file."""
    docs = [d.strip() for d in HELDOUT.read_text().split(f"\n{EOT}\n") if len(d.strip()) > 400]
    step = max(1, len(docs) // prompts)
    return [tok.encode(d)[:prompt_tokens] for d in docs[::step][:prompts]]


def forward_check(folder: Path, mtp_file: Path, ids: list[int]) -> dict:
    """The head's logits through HF (this script's training forward) and through lynn_model's ``mtp_step`` (the
    decoder's draft), on the CPU in fp32 from the same bf16 tensors, over every position of one prompt: a difference
    here would be a forward that differs (concat order, which hidden state, positions, norms), not training."""
    from safetensors.torch import load_file

    import lynn_kernels
    import lynn_model

    trunk = load_trunk(folder, torch.device("cpu"), "eager")
    head = MTPHead(trunk.config, "eager")
    head.load_checkpoint_tensors(load_file(str(mtp_file)))
    head.eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        emb, hid, _, _ = mtp_inputs(trunk, x)
        ref = head_logits(trunk, head(emb, hid)[0])[0]
    with lynn_kernels.use_reference(), torch.inference_mode():
        model = lynn_model.from_pretrained(folder, device="cpu", dtype=torch.float32)
        cache = model.new_cache(max_batch=1, max_tokens=len(ids) + 16)
        slot = cache.add()
        t = torch.tensor(ids, dtype=torch.long)
        _, hidden = model.step(t, cache, [slot], [len(ids)], all_logits=True, hidden=True)
        n = len(ids) - 2
        _, out = model.mtp_step(t[1:n + 1].contiguous(), hidden[:n].contiguous(), cache, [slot], [n], [0])
        got = model.lm_head(out).float()
    return {"positions": n, "max_abs_logit_diff": (got - ref).abs().max().item(),
            "max_abs_logit": ref.abs().max().item(),
            "top1_same": (got.argmax(-1) == ref.argmax(-1)).float().mean().item()}


def verify(folder: Path, drafts: list[int], prompts: int, prompt_tokens: int, new_tokens: int, device: str,
           reps: int = 1, temperature: float = 0.0, lm_head: str = "checkpoint") -> dict:
    """Load ``folder`` with lynn_model and compare ``generate`` with and without MTP on held-out prompts: for each
    prompt every ``mtp`` in turn (so a load that comes and goes on a shared machine falls on all of them alike),
    ``reps`` times, after one untimed warm-up call of each; a prompt's time is the least of its repeats, wall clock
    (``seconds``) and this process's CPU time (``cpu_seconds``, which other processes' load barely moves). With a
    ``temperature``, also sampled runs (seed = the prompt's number), once each, under both acceptance rules: how
    many drafts each keeps, and whether the coupled rule gives plain sampling's tokens. ``lm_head``: the
    loader's mode (``"nvfp4-drafts"``: the drafts read an NVFP4 copy of the head)."""
    import lynn_kernels
    import lynn_model

    ref = device == "cpu"
    tok = lynn_model.Tokenizer.from_pretrained(folder)
    rows = heldout_prompts(tok, prompts, prompt_tokens)
    result = {"folder": str(folder), "device": device,
              "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else None, "reference_ops": ref,
              "lm_head": lm_head, "prompts": len(rows),
              "prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "reps": reps,
              "torch_threads": torch.get_num_threads(),
              "forward_check": forward_check(folder, folder / "mtp.safetensors", rows[0]),
              "load_average_before": os.getloadavg()[0], "runs": {}}
    print(f"  forward check (HF head vs lynn_model mtp_step, fp32): {result['forward_check']}", flush=True)
    ks = [0, *drafts]
    runs = {k: {"seconds": 0.0, "cpu_seconds": 0.0, "new_tokens": 0, "drafted": 0, "accepted": 0,
                "verify_steps": 0, "same_as_mtp0": True, "per_prompt": []} for k in ks}
    with lynn_kernels.use_reference() if ref else contextlib.nullcontext():
        model = lynn_model.from_pretrained(folder, device=device, lm_head=lm_head)
        result["mtp_layers"] = model.config.mtp_layers
        for k in ks:                                   # warm-up
            lynn_model.generate(model, [rows[0]], 8, mtp=k)
        plain = []
        for row in rows:
            best, last = {k: (math.inf, math.inf) for k in ks}, {}
            for _ in range(reps):
                for k in ks:
                    stats = lynn_model.Stats()
                    t0, c0 = time.perf_counter(), time.process_time()
                    out = lynn_model.generate(model, [row], new_tokens, mtp=k, stats=stats)[0].tolist()
                    if device != "cpu":
                        torch.cuda.synchronize()
                    best[k] = (min(best[k][0], time.perf_counter() - t0), min(best[k][1], time.process_time() - c0))
                    last[k] = (out, stats)             # greedy: every repeat gives the same tokens and drafts
            plain.append(last[0][0])
            for k in ks:
                r, (out, stats) = runs[k], last[k]
                r["seconds"] += best[k][0]
                r["cpu_seconds"] += best[k][1]
                r["new_tokens"] += len(out) - len(row)
                if k:
                    r["same_as_mtp0"] &= out == plain[-1]
                    r["drafted"] += stats.drafted
                    r["accepted"] += stats.accepted
                    r["verify_steps"] += stats.verify_steps
                    r["per_prompt"].append(round(stats.acceptance_length, 3))
        if temperature:
            result["sampled"] = sampled_acceptance(model, rows, drafts, new_tokens, temperature)
    result["load_average_after"] = os.getloadavg()[0]
    for k in ks:
        r = runs[k]
        if k == 0:
            for key in ("drafted", "accepted", "verify_steps", "per_prompt", "same_as_mtp0"):
                del r[key]
        else:
            r["acceptance_length"] = round(1 + k * r["accepted"] / r["drafted"], 3) if r["drafted"] else 0.0
            r["draft_acceptance"] = round(r["accepted"] / max(1, r["drafted"]), 4)
        r["tok_s"] = round(r["new_tokens"] / r["seconds"], 2)
        r["tok_per_cpu_s"] = round(r["new_tokens"] / r["cpu_seconds"], 2)
        r["seconds"], r["cpu_seconds"] = round(r["seconds"], 2), round(r["cpu_seconds"], 2)
        result["runs"][f"mtp={k}"] = r
        print(f"  generate mtp={k}: {r['new_tokens']} tokens in {r['seconds']:.1f} s ({r['tok_s']:.1f} tok/s; "
              f"{r['cpu_seconds']:.1f} s of CPU time, {r['tok_per_cpu_s']:.1f} tok per CPU s)" + (
            f", same tokens as mtp=0: {r['same_as_mtp0']}, drafts accepted {r['accepted']}/{r['drafted']}, "
            f"acceptance length {r['acceptance_length']}" if k else ""), flush=True)
    result["example"] = tok.decode(plain[0][len(rows[0]):])[:300]
    return result


def sampled_acceptance(model, rows: list[list[int]], drafts: list[int], new_tokens: int, temperature: float) -> dict:
    """Sampled generation of every prompt (seed: its number) with ``mtp = k`` under each acceptance rule: the drafts
    kept and tokens per verify step, and for the coupled rule whether the tokens are plain sampling's."""
    import lynn_model
    from lynn_model.speculative import RULES

    plain = [lynn_model.generate(model, [row], new_tokens, temperature=temperature, seed=i)[0].tolist()
             for i, row in enumerate(rows)]
    out = {"temperature": temperature}
    for rule in RULES:
        for k in drafts:
            r = {"drafted": 0, "accepted": 0, "verify_steps": 0, "new_tokens": 0}
            same = True
            for i, row in enumerate(rows):
                stats = lynn_model.Stats()
                got = lynn_model.generate(model, [row], new_tokens, temperature=temperature, seed=i, mtp=k,
                                          mtp_rule=rule, stats=stats)[0].tolist()
                same &= got == plain[i]
                for key in ("drafted", "accepted", "verify_steps"):
                    r[key] += getattr(stats, key)
                r["new_tokens"] += len(got) - len(row)
            r["draft_acceptance"] = round(r["accepted"] / max(1, r["drafted"]), 4)
            r["acceptance_length"] = round(1 + k * r["accepted"] / r["drafted"], 3) if r["drafted"] else 0.0
            if rule == "coupled":
                r["same_as_plain_sampling"] = same
            out[f"{rule} mtp={k}"] = r
            print(f"  sampled T={temperature} {rule} mtp={k}: drafts accepted {r['accepted']}/{r['drafted']}, "
                  f"acceptance length {r['acceptance_length']}"
                  + (f", same tokens as plain sampling: {same}" if rule == "coupled" else ""), flush=True)
    return out


# ----------------------------------------------------------------------------------------------------------- main


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEMO), help="the frozen trunk (a HF folder)")
    ap.add_argument("--data", default=str(CACHE / "tokens"), help="the folder of train.bin (uint16)")
    ap.add_argument("--tokenize", action="store_true",
                    help="only write DATA/train.bin (and heldout.bin) from .cache/demo/corpus/ with the shipped "
                         "tokenizer")
    ap.add_argument("--out", default=os.environ.get("OUT", "out") + "/mtp")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--minutes", type=float, default=8.0, help="training time budget (the schedule follows it)")
    ap.add_argument("--max-epochs", type=float, default=10.0,
                    help="the schedule also ends after this many passes over the training tokens")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--eval-every", type=float, default=20.0, help="seconds between held-out evaluations")
    ap.add_argument("--eval-windows", type=int, default=64)
    ap.add_argument("--eval-seq", type=int, default=None, help="held-out window length (default: --seq)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--experts", default=None,
                    help="HF experts implementation (default: grouped_mm on CUDA, eager on the CPU)")
    ap.add_argument("--no-verify", action="store_true", help="skip the lynn_model check after training")
    ap.add_argument("--verify-only", default=None, metavar="DIR",
                    help="only run the check on DIR/mtp.safetensors (verify.json goes to --out)")
    ap.add_argument("--verify-dir", default=None, help="where to assemble the demo folder with the head "
                    "(default: OUT/demo-mtp, removed after the check unless given)")
    ap.add_argument("--verify-drafts", default="1,2,3")
    ap.add_argument("--verify-prompts", type=int, default=6)
    ap.add_argument("--verify-prompt-tokens", type=int, default=64)
    ap.add_argument("--verify-new-tokens", type=int, default=64)
    ap.add_argument("--verify-temperature", type=float, default=0.8,
                    help="also sample at this temperature under both acceptance rules (0: greedy only)")
    ap.add_argument("--verify-reps", type=int, default=1, help="timed repeats per prompt and k (the least counts)")
    ap.add_argument("--verify-lm-head", default="checkpoint", choices=["checkpoint", "nvfp4", "nvfp4-drafts"],
                    help="the loader's LM head mode for the check (nvfp4-drafts: drafts read an NVFP4 copy)")
    ap.add_argument("--verify-name", default="verify.json", help="the result's file name in --out")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    args = ap.parse_args()
    model_dir = Path(args.model)

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.tokenize:
        tokenize(model_dir, CACHE / "corpus", Path(args.data))
        return
    drafts = [int(k) for k in args.verify_drafts.split(",") if k]

    from lynn_kernels.bench.harness import provenance

    def run_verify(src: Path, out: Path) -> dict:
        out.mkdir(parents=True, exist_ok=True)
        dest = Path(args.verify_dir) if args.verify_dir else out / "demo-mtp"
        folder = assemble(model_dir, src / "mtp.safetensors", dest)
        prov = provenance()                       # the commit the check runs at (it may differ from the training's)
        res = verify(folder, drafts, args.verify_prompts, args.verify_prompt_tokens, args.verify_new_tokens,
                     args.device, args.verify_reps, args.verify_temperature, args.verify_lm_head)
        res = {**{k: prov[k] for k in ("date", "git_sha", "git_dirty", "torch", "python")},
               "command": "PYTHONPATH=. python3 experiments/demo_model/train_mtp.py --verify-only DIR " + " ".join(
                   f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                   if k in ("device", "threads", "verify_reps", "verify_temperature", "verify_drafts",
                            "verify_prompts", "verify_new_tokens", "verify_lm_head") and v is not None), **res}
        if not args.verify_dir:
            shutil.rmtree(dest)
        (out / args.verify_name).write_text(json.dumps(res, indent=1) + "\n")
        return res

    if args.verify_only:                          # DIR may be read-only (a device run's files): write into --out
        run_verify(Path(args.verify_only), Path(args.out))
        return

    t_start = time.perf_counter()
    device = torch.device(args.device)
    experts = args.experts or ("grouped_mm" if device.type == "cuda" else "eager")
    torch.manual_seed(args.seed)
    gen = np.random.default_rng(args.seed)
    train = np.fromfile(Path(args.data) / "train.bin", dtype=np.uint16)
    held = encode_documents(shipped_tokenizer(model_dir), HELDOUT.read_text())
    trunk = load_trunk(model_dir, device, experts)
    if int(train.max()) >= trunk.config.vocab_size:
        raise SystemExit(f"{args.data}/train.bin holds token id {int(train.max())}, past the vocabulary "
                         f"({trunk.config.vocab_size}): not tokenised with this model's tokenizer")
    head = MTPHead(trunk.config, experts).to(device)
    src_layer = head.warm_start(trunk)
    head.train()
    expected = mtp_names(model_dir)
    got = {k: tuple(v.shape) for k, v in head.checkpoint_tensors().items()}
    if got != expected:
        raise SystemExit(f"the head's tensors differ from what lynn_model expects: missing "
                         f"{sorted(set(expected) - set(got))[:5]}, extra {sorted(set(got) - set(expected))[:5]}, "
                         f"shapes {[(k, got[k], expected[k]) for k in got if expected.get(k, got[k]) != got[k]][:5]}")
    n_params = sum(p.numel() for p in head.parameters())
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import load_balancing_loss_func

    eval_seq = args.eval_seq or args.seq
    t_eval0 = time.perf_counter()
    heldout = HeldOut(trunk, held, args.eval_windows, eval_seq, device, chunk=16)
    print(f"held-out: {held.size:,} tokens, {args.eval_windows} windows of {eval_seq}; the trunk's own top-1 "
          f"accuracy at p + 2: {heldout.trunk_accuracy:.4f} ({time.perf_counter() - t_eval0:.1f} s)", flush=True)

    decay = [p for p in head.parameters() if p.dim() >= 2]
    other = [p for p in head.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "train_mtp_log.jsonl", "w")  # noqa: SIM115 (written line by line through the run)

    def record(**kw):
        log.write(json.dumps(kw) + "\n")
        log.flush()

    budget = args.minutes * 60.0
    step, tokens_seen = 0, 0
    best = {"agreement": -1.0}
    best_state = None
    evals = []
    t0 = time.perf_counter()
    last_eval, last_print = -1e9, t0
    while True:
        elapsed = time.perf_counter() - t0
        frac = max(elapsed / budget, tokens_seen / (args.max_epochs * train.size))
        if elapsed - last_eval >= args.eval_every or frac >= 1.0:
            ev = heldout.evaluate(trunk, head)
            last_eval = time.perf_counter() - t0
            ev.update(step=step, tokens=tokens_seen, seconds=round(elapsed, 2))
            evals.append(ev)
            record(kind="eval", **ev)
            print(f"[{elapsed:6.1f} s] step {step:5d}  tokens {tokens_seen / 1e6:6.2f} M  held-out: agreement "
                  f"{ev['agreement']:.4f}  ce {ev['ce']:.4f}  accuracy {ev['accuracy']:.4f}", flush=True)
            if ev["agreement"] > best["agreement"]:
                best = dict(ev)
                best_state = {k: v.detach().to("cpu", copy=True) for k, v in head.state_dict().items()}
            if frac >= 1.0:
                break
        lr = lr_at(frac, step, args.lr, args.warmup, 0.05)
        for g in opt.param_groups:
            g["lr"] = lr
        x = batch_windows(train, args.batch, args.seq, gen, device)
        try:
            with _autocast(device):
                emb, hid, y, _ = mtp_inputs(trunk, x)
                o, router = head(emb, hid)
                logits = head_logits(trunk, o)
                ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
                aux = load_balancing_loss_func(tuple(router), head.config.num_experts,
                                               head.config.num_experts_per_tok)
                loss = ce + AUX_COEF * aux
            opt.zero_grad(set_to_none=True)
            loss.backward()
        except Exception as err:                   # grouped_mm without autograd on this build: say so, use eager
            if step == 0 and experts != "eager":
                print(f"experts_implementation={experts!r} failed ({type(err).__name__}: {err}); using 'eager'")
                experts = "eager"
                for m in (trunk, head):
                    for mod in m.modules():
                        if hasattr(mod, "config"):
                            mod.config._experts_implementation = "eager"
                continue
            raise
        gnorm = torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        step += 1
        tokens_seen += x.numel()
        if step % 25 == 0 or step == 1:
            record(kind="train", step=step, tokens=tokens_seen, seconds=round(time.perf_counter() - t0, 2),
                   loss=ce.item(), aux_loss=aux.item(), lr=lr, grad_norm=gnorm.item())
        if time.perf_counter() - last_print > 30:
            last_print = time.perf_counter()
            print(f"   step {step:5d}  loss {ce.item():.4f}  aux {aux.item():.3f}  lr {lr:.2e}  "
                  f"{tokens_seen / (last_print - t0) / 1e3:.1f}k tok/s", flush=True)
    train_s = time.perf_counter() - t0
    log.close()
    head.load_state_dict(best_state)
    from safetensors.torch import save_file

    tensors = head.checkpoint_tensors()
    save_file(tensors, str(out / "mtp.safetensors"), metadata={"format": "pt"})
    prov = provenance()
    rec = {
        **{k: prov[k] for k in ("date", "git_sha", "git_dirty", "gpu", "torch", "python")},
        "device": str(device), "transformers": __import__("transformers").__version__,
        "command": "PYTHONPATH=. python3 experiments/demo_model/train_mtp.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
            if k in ("minutes", "max_epochs", "device", "batch", "seq", "lr", "warmup", "eval_every", "eval_windows",
                     "eval_seq", "seed", "experts") and v is not None),
        "trunk": str(model_dir.relative_to(ROOT) if model_dir.is_relative_to(ROOT) else model_dir),
        "warm_start": f"layer <- trunk layer {src_layer}; norm <- trunk norm; fc <- [0 | I]",
        "head_parameters": n_params, "experts_implementation": experts, "minutes": args.minutes, "steps": step,
        "tokens_seen": tokens_seen, "train_tokens": int(train.size), "epochs": round(tokens_seen / train.size, 4),
        "heldout_tokens": int(held.size), "batch": args.batch, "seq": args.seq, "train_seconds": round(train_s, 1),
        "trunk_heldout_accuracy_p2": round(heldout.trunk_accuracy, 4),
        "initial": {k: evals[0][k] for k in ("agreement", "ce", "accuracy")},
        "best": {k: best[k] for k in ("agreement", "ce", "accuracy", "step", "tokens", "seconds")},
        "final": {k: evals[-1][k] for k in ("agreement", "ce", "accuracy", "step")},
        "note": "agreement: the head's top-1 at p against the frozen trunk's greedy token at p + 2 (after the true "
                f"tok[p + 1]) over {args.eval_windows} fixed held-out windows of {eval_seq} tokens from "
                "data/corpus/heldout.txt; ce and accuracy against the text's tok[p + 2]; the weights saved are the "
                "best agreement's"}
    if not args.no_verify:
        print("lynn_model check:", flush=True)
        rec["verify"] = {k: v for k, v in run_verify(out, out).items() if k != "example"}
    rec["wall_seconds"] = round(time.perf_counter() - t_start, 1)
    (out / "train_mtp_record.json").write_text(json.dumps(rec, indent=1) + "\n")
    print(json.dumps({k: v for k, v in rec.items() if k != "verify"}, indent=1))


if __name__ == "__main__":
    main()
