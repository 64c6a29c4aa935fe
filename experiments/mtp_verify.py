"""What speculative decoding costs at the Qwen3.5-35B-A3B shape, and whether it changes a token there.

Random NVFP4 weights with a random MTP layer, fused as ``lynn generate`` runs the model on a GPU, a 4,096-token
prompt per sequence, batch 1 and 8. For k = 1..3 drafts:

* the GPU kernel time (CUDA profiler, median of 5) of a plain decode step, of the unrolled verify step of k + 1
  tokens (``Model.step(unroll=True)``, with its rollback), and of the drafts (the MTP module over 2 positions, then
  k - 1 single positions): eager steps, so this is the device's work, not what a captured graph would take end to
  end;
* the time of one whole round captured as a CUDA graph (:class:`lynn_model.speculative.SpeculativeStep`: verify,
  acceptance, rollback, MTP catch-up, k drafts) against the captured plain step (:class:`lynn_model.DecodeStep`),
  CUDA events over 40 replays, median of 5, each round's inputs those the last one left (the tokens move on);
* whether the verify's logits equal those of k + 1 decode steps bit for bit, and whether ``generate(mtp=k)`` (its
  rounds captured) gives plain decoding's 32 tokens, greedy and seeded (the random MTP layer's drafts are nearly
  always rejected: this tests the verify and the rollback, not the drafts);
* a **projection**, labelled as one: tokens/s per sequence = acceptance length / round, at the acceptance lengths
  SGLang reports for Qwen3.5 (k = 3: ~3.4), against the plain step's 1 / step; from the captured times, and from the
  eager kernel times (verify + drafts) beside them.

    PYTHONPATH=. python3 experiments/mtp_verify.py

Writes ``data/experiments/mtp-verify/<sha>.json`` (``$OUT`` instead when set). GPU only.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import torch

import lynn_model
from lynn_kernels.bench.harness import provenance
from lynn_model.generate import Stats
from lynn_model.loader import random_model
from lynn_model.speculative import unrolled_and_steps

ROOT = Path(__file__).resolve().parents[1]
PROMPT = 4096
#: Acceptance lengths to project at (tokens per verify step): SGLang's reported ~3.4 for k = 3 on Qwen3.5, and
#: lower guesses for fewer drafts; labelled as assumptions in the output.
ASSUMED_ACCEPTANCE = {1: 1.8, 2: 2.6, 3: 3.4}


def kernel_us(fn, reps: int = 5) -> float:
    """Median over ``reps`` runs of the summed CUDA kernel time of one call of ``fn`` (us)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        times.append(sum(e.self_device_time_total for e in prof.key_averages()))
    return statistics.median(times)


def replay_ms(replay, reps: int = 5, inner: int = 40) -> float:
    """Median over ``reps`` of the GPU time per call of ``replay`` (CUDA events around ``inner`` calls), in ms."""
    replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(inner):
            replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / inner)
    return statistics.median(times)


def graph_rounds(model, config, batch: int, g) -> dict:
    """Captured plain step and captured round of k = 1..3 drafts, ``batch`` sequences at ``PROMPT`` tokens: ms per
    replay (greedy)."""
    from lynn_model import DecodeStep, Sampling, SamplingParams
    from lynn_model.speculative import MTPDrafter, SpeculativeStep

    ids = torch.randint(0, config.vocab_size, (batch * PROMPT,), generator=g).cuda()
    params = SamplingParams.build([Sampling()] * batch, "cuda", config.vocab_size)
    out = {}
    for k in (0, 1, 2, 3):
        cache = model.new_cache(batch, batch * (PROMPT + 1024))
        step = SpeculativeStep(model, cache, batch, k, params) if k else DecodeStep(model, cache, batch, params)
        slots = [cache.add() for _ in range(batch)]
        cache.reserve(slots, [PROMPT + 960] * batch)
        logits, hidden = model.step(ids, cache, slots, [PROMPT] * batch, hidden=True)
        first = logits.argmax(-1)
        if k:
            nxt = torch.cat([ids.view(batch, PROMPT)[:, 1:], first[:, None]], 1).reshape(-1).tolist()
            drafts, q = MTPDrafter(model, k).draft(cache, slots, nxt, hidden, [PROMPT] * batch, [0] * batch,
                                                   [Sampling()] * batch)
            step.begin(slots, first.tolist(), drafts, q)
            out[f"round_k{k}_ms"] = replay_ms(step.graph.replay)      # the device's time; no host read between
        else:
            step.begin(first, slots)
            out["decode_ms"] = replay_ms(step.replay)
        step = cache = None
        torch.cuda.empty_cache()
    return out


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="batch sizes to time (one device call "
                    "may not hold both: batch 1 took ~3 minutes on an H100)")
    ap.add_argument("--skip-generate", action="store_true", help="skip the generate(mtp=k) token checks")
    ap.add_argument("--lm-head", default="checkpoint", choices=["checkpoint", "nvfp4", "nvfp4-drafts"],
                    help="nvfp4: the trunk and the drafts read an NVFP4 head (the verify's rows then share one read "
                         "of it: the tensor-core GEMV sums a row alike at any row count); nvfp4-drafts: only the "
                         "drafts do")
    args = ap.parse_args()
    config = lynn_model.preset("qwen3.5-35b-a3b").replace(mtp_layers=1)
    model = random_model(config, device="cuda", lm_head=args.lm_head)   # fused for decode, as loaded on a GPU
    res: dict = {"provenance": provenance(), "setup": {"preset": config.name, "prompt": PROMPT, "fused": True,
                                                       "lm_head": args.lm_head},
                 "rows": [], "exact": {}, "projection": {}}
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for batch in args.batches:
            cache = model.new_cache(batch, batch * (PROMPT + 512))
            slots = [cache.add() for _ in range(batch)]
            ids = torch.randint(0, config.vocab_size, (batch * PROMPT,), generator=g).cuda()
            _, hidden = model.step(ids, cache, slots, [PROMPT] * batch, hidden=True)
            tok = torch.randint(0, config.vocab_size, (batch * 4,), generator=g).cuda()

            def decode():
                model.step(tok[:batch], cache, slots, [1] * batch)

            row = {"batch": batch, "decode_us": kernel_us(decode)}
            del cache
            torch.cuda.empty_cache()
            row.update(graph_rounds(model, config, batch, g))
            cache = model.new_cache(batch, batch * (PROMPT + 512))
            slots = [cache.add() for _ in range(batch)]
            _, hidden = model.step(ids, cache, slots, [PROMPT] * batch, hidden=True)
            for k in (1, 2, 3):
                mine = tok[:batch * (k + 1)]

                def verify(k=k, mine=mine):
                    model.step(mine, cache, slots, [k + 1] * batch, all_logits=True, unroll=True)
                    cache.rollback(slots, [1] * batch)

                def draft(k=k):
                    start = [cache.lengths[s] for s in slots]
                    _, h = model.mtp_step(tok[:2 * batch], hidden[:2 * batch], cache, slots, [2] * batch,
                                          [p - 2 for p in start])
                    h = h.view(batch, 2, -1)[:, -1]
                    for j in range(k - 1):
                        _, h = model.mtp_step(tok[:batch], h, cache, slots, [1] * batch, [p + j for p in start])

                row[f"verify_k{k}_us"], row[f"draft_k{k}_us"] = kernel_us(verify), kernel_us(draft)
            res["rows"].append(row)
            key = f"unrolled step of 3 = 3 decode steps, batch {batch}"
            res["exact"][key] = bool(torch.equal(*unrolled_and_steps(model, batch, 3, g)))
            print(row, res["exact"], flush=True)
            torch.cuda.empty_cache()
        if not args.skip_generate:
            _generate_checks(model, torch.randint(0, config.vocab_size, (1, 256), generator=g).cuda(), res)
    _finish(res)


def _generate_checks(model, prompts, res: dict) -> None:
    """``generate(mtp=k)`` against plain decoding, 32 tokens of one 256-token prompt, greedy and seeded."""
    plain = lynn_model.generate(model, prompts, 32)
    sampled = dict(temperature=0.8, top_k=50, seed=3)
    plain_sampled = lynn_model.generate(model, prompts, 32, **sampled)
    for k in (1, 3):
        stats = Stats()
        got = lynn_model.generate(model, prompts, 32, mtp=k, stats=stats)
        res["exact"][f"generate mtp={k}, 32 tokens"] = bool(torch.equal(got.cpu(), plain.cpu()))
        res["exact"][f"generate mtp={k} verify steps"] = stats.verify_steps
    got = lynn_model.generate(model, prompts, 32, mtp=3, **sampled)
    res["exact"]["generate mtp=3 sampled (seeded), 32 tokens"] = bool(torch.equal(got.cpu(), plain_sampled.cpu()))


def _finish(res: dict) -> None:
    """The projections from the timed rows, the JSON, the table."""
    for row in res["rows"]:
        for k, acc in ASSUMED_ACCEPTANCE.items():
            t = row[f"verify_k{k}_us"] + row[f"draft_k{k}_us"]
            res["projection"][f"batch {row['batch']} k={k}"] = {
                "assumed_acceptance_length": acc, "round_us": t, "speedup_over_decode": acc * row["decode_us"] / t,
                "captured_round_ms": row[f"round_k{k}_ms"], "captured_decode_ms": row["decode_ms"],
                "captured_speedup_over_decode": acc * row["decode_ms"] / row[f"round_k{k}_ms"]}
    out_dir = Path(os.environ.get("OUT") or ROOT / "data" / "experiments" / "mtp-verify")
    out_dir.mkdir(parents=True, exist_ok=True)
    head = res["setup"]["lm_head"]
    path = out_dir / f"{res['provenance']['git_sha'][:7]}{'' if head == 'checkpoint' else '-' + head}.json"
    path.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {path}")
    print("batch  decode us  " + "  ".join(f"verify k={k}  draft k={k}" for k in (1, 2, 3))
          + "  graph: step ms  " + "  ".join(f"round k={k}" for k in (1, 2, 3)))
    for row in res["rows"]:
        print(f"{row['batch']:5d}  {row['decode_us']:9.0f}  " + "  ".join(
            f"{row[f'verify_k{k}_us']:10.0f}  {row[f'draft_k{k}_us']:9.0f}" for k in (1, 2, 3))
            + f"  {row['decode_ms']:14.3f}  " + "  ".join(f"{row[f'round_k{k}_ms']:9.3f}" for k in (1, 2, 3)))
    for name, p in res["projection"].items():
        print(f"projection {name}: at acceptance {p['assumed_acceptance_length']}, "
              f"{p['captured_speedup_over_decode']:.2f}x the captured plain step ({p['speedup_over_decode']:.2f}x "
              f"from eager kernel times)")
    print("exact:", res["exact"])


if __name__ == "__main__":
    main()
