"""Train the demo model: a HF transformers ``Qwen3_5MoeForCausalLM`` of ~12M parameters, in one time-budgeted run.

    PYTHONPATH=. python3 experiments/demo_model/train.py --minutes 7 --out $OUT/lynn-demo

Reads the token files and tokenizer that ``corpus.py`` and ``tokenizer.py`` wrote under ``.cache/demo/`` (carried to
the GPU machine, which has no network). The architecture is the real one at a small size: 8 layers in Qwen3.5's 3:1
pattern (three Gated DeltaNet layers, then one gated-attention layer), 8 routed experts top-2 and a shared expert with
its sigmoid gate in every layer, tied embeddings. Training: AdamW, bf16 autocast over fp32 weights, linear warm-up
then a cosine decay over the *time* budget or ``--max-epochs``, whichever ends first (the schedule reads the
clock, so the run ends on time whatever the step rate), the router's load-balancing loss through HF's
``output_router_logits``, held-out loss every ``--eval-every`` seconds. The weights written are those of the best
held-out evaluation (early stopping), in bf16.

Writes into ``--out``: the HF folder (config.json, model.safetensors, generation_config.json, tokenizer files),
``train_log.jsonl`` (one line per logged step and evaluation) and ``train_record.json`` (provenance and totals).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import shutil
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache" / "demo"

ARCH = {
    "vocab_size": 6144, "hidden_size": 256, "num_hidden_layers": 8, "full_attention_interval": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 64, "linear_value_head_dim": 64,
    "linear_conv_kernel_dim": 4, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 256, "rms_norm_eps": 1e-6, "max_position_embeddings": 2048,
    "tie_word_embeddings": True, "hidden_act": "silu", "router_aux_loss_coef": 0.01, "output_router_logits": True,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [3, 3, 2], "mrope_interleaved": True},
    "bos_token_id": None, "eos_token_id": 0, "pad_token_id": 0}


def build_model(vocab_size: int, experts: str):
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import (
        Qwen3_5MoeTextConfig,
    )
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
        Qwen3_5MoeForCausalLM,
    )

    cfg = Qwen3_5MoeTextConfig(**dict(ARCH, vocab_size=vocab_size))
    cfg._attn_implementation = "sdpa"
    cfg._experts_implementation = experts
    return Qwen3_5MoeForCausalLM(cfg)


def batches(tokens: np.ndarray, batch: int, seq: int, gen: np.random.Generator, device):
    """Random windows of ``seq + 1`` tokens (inputs and their shifted labels)."""
    starts = gen.integers(0, tokens.size - seq - 1, size=batch)
    x = np.stack([tokens[s:s + seq + 1] for s in starts]).astype(np.int64)
    x = torch.from_numpy(x).to(device, non_blocking=True)
    return x[:, :-1], x[:, 1:]


@torch.no_grad()
def heldout_loss(model, windows: torch.Tensor, chunk: int) -> float:
    """Mean next-token cross-entropy (nats) over fixed held-out windows, no router loss."""
    model.eval()
    tot, n = 0.0, 0
    for i in range(0, windows.shape[0], chunk):
        w = windows[i:i + chunk]
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=w.is_cuda):
            logits = model(input_ids=w[:, :-1]).logits.float()
        tot += torch.nn.functional.cross_entropy(logits.flatten(0, 1), w[:, 1:].flatten(), reduction="sum").item()
        n += w[:, 1:].numel()
    model.train()
    return tot / n


def lr_at(frac: float, step: int, peak: float, warmup: int, floor: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return floor * peak + (1 - floor) * peak * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))


def write_folder(model, state: dict, out: Path, tokenizer: Path | None) -> None:
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    model.load_state_dict(state)
    model.config.output_router_logits = False
    # shards of at most 12 MB: the GPU machine returns files of up to 16 MiB
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True, max_shard_size="12MB")
    model.float()
    GenerationConfig(do_sample=True, temperature=0.8, top_k=40, top_p=0.95, eos_token_id=0, pad_token_id=0,
                     max_new_tokens=200).save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json") if tokenizer is not None else ():
        shutil.copy(tokenizer / f, out / f)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(CACHE / "tokens"))
    ap.add_argument("--tokenizer", default=str(CACHE / "tokenizer"))
    ap.add_argument("--out", default=os.environ.get("OUT", "out") + "/lynn-demo")
    ap.add_argument("--minutes", type=float, default=7.0, help="training time budget (the schedule follows it)")
    ap.add_argument("--max-epochs", type=float, default=10.0,
                    help="the schedule also ends after this many passes over the training tokens")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=150)
    ap.add_argument("--eval-every", type=float, default=20.0, help="seconds between held-out evaluations")
    ap.add_argument("--eval-windows", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--experts", default="grouped_mm", help="HF experts implementation (grouped_mm or eager)")
    ap.add_argument("--skip-tokenizer", action="store_true",
                    help="do not copy the tokenizer into --out (the GPU machine returns at most 8 files)")
    ap.add_argument("--tiny", action="store_true", help="a CPU smoke run: 2 layers, a few steps")
    args = ap.parse_args()

    t_start = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(args.seed)
    gen = np.random.default_rng(args.seed)
    data = Path(args.data)
    train = np.fromfile(data / "train.bin", dtype=np.uint16)
    held = np.fromfile(data / "heldout.bin", dtype=np.uint16)
    vocab = json.loads((data / "stats.json").read_text())["vocab_size"]
    if args.tiny:
        ARCH.update(num_hidden_layers=4, hidden_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=64)
    experts = args.experts
    model = build_model(vocab, experts).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    eg = np.random.default_rng(1234)             # the same held-out windows every evaluation
    starts = eg.integers(0, held.size - args.seq - 1, size=args.eval_windows)
    windows = torch.from_numpy(np.stack([held[s:s + args.seq + 1] for s in starts]).astype(np.int64)).to(device)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    other = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = open(out.parent / "train_log.jsonl", "w")  # noqa: SIM115 (written line by line through the run)

    def record(**kw):
        log.write(json.dumps(kw) + "\n")
        log.flush()

    budget = args.minutes * 60.0
    if args.tiny:
        budget = 20.0
    step, tokens_seen, best = 0, 0, (float("inf"), None, -1)
    t0 = time.perf_counter()
    last_eval, last_print = -1e9, t0
    model.train()
    while True:
        elapsed = time.perf_counter() - t0
        frac = max(elapsed / budget, tokens_seen / (args.max_epochs * train.size))
        if elapsed - last_eval >= args.eval_every or frac >= 1.0:
            h = heldout_loss(model, windows, 16)
            last_eval = time.perf_counter() - t0
            record(kind="eval", step=step, tokens=tokens_seen, seconds=round(elapsed, 2), heldout_loss=h)
            print(f"[{elapsed:6.1f} s] step {step:5d}  tokens {tokens_seen / 1e6:7.2f} M  held-out {h:.4f}", flush=True)
            if h < best[0]:
                best = (h, {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}, step)
            if frac >= 1.0:
                break
        lr = lr_at(frac, step, args.lr, args.warmup, 0.05)
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = batches(train, args.batch, args.seq, gen, device)
        try:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                res = model(input_ids=x)
                ce = torch.nn.functional.cross_entropy(res.logits.float().flatten(0, 1), y.flatten())
                loss = ce + ARCH["router_aux_loss_coef"] * res.aux_loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
        except Exception as err:                   # grouped_mm without autograd on this build: say so, use eager
            if step == 0 and experts != "eager":
                print(f"experts_implementation={experts!r} failed ({type(err).__name__}: {err}); using 'eager'")
                experts = "eager"
                model.config._experts_implementation = "eager"
                for m in model.modules():
                    if hasattr(m, "config"):
                        m.config._experts_implementation = "eager"
                continue
            raise
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens_seen += x.numel()
        if step % 25 == 0 or step == 1:
            aux = res.aux_loss.item() if getattr(res, "aux_loss", None) is not None else None
            record(kind="train", step=step, tokens=tokens_seen, seconds=round(time.perf_counter() - t0, 2),
                   loss=ce.item(), aux_loss=aux, lr=lr, grad_norm=gnorm.item())
        if time.perf_counter() - last_print > 30:
            last_print = time.perf_counter()
            print(f"   step {step:5d}  loss {ce.item():.4f}  lr {lr:.2e}  "
                  f"{tokens_seen / (last_print - t0) / 1e3:.0f}k tok/s", flush=True)
    train_s = time.perf_counter() - t0
    write_folder(model, best[1], out, None if args.skip_tokenizer else Path(args.tokenizer))
    log.close()
    lines = (out.parent / "train_log.jsonl").read_text().splitlines()
    final_train = [json.loads(ln) for ln in lines if '"train"' in ln][-1]
    rec = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "git_sha": os.environ.get("LYNN_GIT_SHA"),
        "gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "transformers": __import__("transformers").__version__,
        "command": "PYTHONPATH=. python3 experiments/demo_model/train.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
            if k not in ("data", "tokenizer", "out", "tiny", "skip_tokenizer")),
        "parameters": n_params, "architecture": ARCH, "experts_implementation": experts, "steps": step,
        "tokens_seen": tokens_seen,
        "train_tokens": int(train.size), "epochs": round(tokens_seen / train.size, 3), "heldout_tokens": int(held.size),
        "batch": args.batch, "seq": args.seq, "train_seconds": round(train_s, 1),
        "wall_seconds": round(time.perf_counter() - t_start, 1), "final_train_loss": final_train["loss"],
        "final_heldout_loss": best[0], "best_step": best[2],
        "note": "the saved weights are those of the best held-out evaluation (best_step); heldout loss over "
             f"{args.eval_windows} fixed windows of {args.seq} tokens"}
    (out.parent / "train_record.json").write_text(json.dumps(rec, indent=1) + "\n")
    print(json.dumps({k: v for k, v in rec.items() if k != "architecture"}, indent=1))


if __name__ == "__main__":
    main()
