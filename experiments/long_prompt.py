"""A 131,072-token prompt at the Qwen3.5-35B-A3B shape: does it run, in how much memory, how fast.

Random NVFP4 weights, fused for decode (as loaded on a GPU). ``generate`` prefills a long prompt in calls
of at most ``prefill_chunk`` tokens (each continuing the cached prefix), so the activations are bounded by the chunk
and the cache grows with the prompt. For each chunk size it records the prefill's tok/s, the peak GPU memory above
the weights, and the cache's bytes. Before that, where one call still fits (32,768 tokens), it checks that the last
token's logits of a chunked prefill equal an unchunked one's within rounding.

    PYTHONPATH=. python3 experiments/long_prompt.py

Writes ``data/experiments/long-prompt/<sha>.json`` (under ``$OUT`` when set). GPU only.
"""

from __future__ import annotations

import torch

import lynn_model
from lynn_kernels.bench.harness import provenance, save_experiment
from lynn_kernels.metrics import compare
from lynn_model.loader import random_model

PROMPT = 131_072
CHECK = 32_768
CHUNKS = (16_384, 8_192)


def last_logits(model, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    """The last token's logits after prefilling ``ids`` in calls of ``chunk`` tokens."""
    cache = model.new_cache(max_batch=1, max_tokens=len(ids) + 64)
    s = cache.add()
    for start in range(0, len(ids), chunk):
        piece = ids[start:start + chunk]
        out = model.step(piece, cache, [s], [len(piece)])
    return out.float()


def main() -> None:
    cfg = lynn_model.preset("qwen3.5-35b-a3b")
    model = random_model(cfg, weights="nvfp4", device="cuda", seed=0)   # fused for decode, as loaded on a GPU
    torch.cuda.synchronize()
    weights_gb = torch.cuda.memory_allocated() / 1e9
    gen = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (PROMPT,), device="cuda", generator=gen)
    res = {"provenance": provenance("PYTHONPATH=. python3 experiments/long_prompt.py"), "model": cfg.name,
           "weights_gb": weights_gb, "prompt_tokens": PROMPT}

    with torch.no_grad():
        whole = last_logits(model, ids[:CHECK], CHECK)
        chunked = last_logits(model, ids[:CHECK], CHECK // 4)
    m = compare(chunked, whole)
    res["chunked_vs_whole"] = {"tokens": CHECK, "chunk": CHECK // 4, "cosine": m.cosine, "rel_l2": m.rel_l2,
                               "same_argmax": bool(chunked.argmax() == whole.argmax())}
    print(f"{CHECK} tokens, chunks of {CHECK // 4} vs one call: cosine {m.cosine:.6f}, rel_l2 {m.rel_l2:.2e}",
          flush=True)
    whole = chunked = None

    res["runs"] = []
    lynn_model.generate(model, [ids[:4096].tolist()], 2)                 # compile the shapes
    for chunk in CHUNKS:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        stats = lynn_model.Stats()
        out = lynn_model.generate(model, ids[None], 8, prefill_chunk=chunk, stats=stats)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        run = {"prefill_chunk": chunk, "prefill_s": stats.prefill_s, "prefill_tok_s": stats.prefill_tok_s,
               "decode_tok_s": stats.decode_tok_s,
               "cache_gb": stats.cache_bytes / 1e9, "peak_gb": peak / 1e9, "peak_above_weights_gb": (peak - base) / 1e9,
               "new_tokens": out.shape[-1] - PROMPT if out.dim() > 1 else len(out)}
        res["runs"].append(run)
        print(f"chunk {chunk}: prefill {stats.prefill_s:.2f} s ({stats.prefill_tok_s:,.0f} tok/s), peak "
              f"{peak / 1e9:.1f} GB ({(peak - base) / 1e9:.1f} above the weights), "
              f"cache {stats.cache_bytes / 1e9:.2f} GB", flush=True)

    save_experiment("long-prompt", res)


if __name__ == "__main__":
    main()
