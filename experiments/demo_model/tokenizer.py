"""Train the demo model's tokenizer (byte-level BPE with Qwen's pre-tokenizer) and tokenise the corpus.

    python experiments/demo_model/tokenizer.py     # after corpus.py: -> .cache/demo/tokenizer/ and .cache/demo/tokens/

The tokenizer has a real Qwen checkpoint's shape: ``tokenizer.json`` (the pre-tokenizer's split regex, byte-level
mapping and decoder as Qwen2/3 ship them), ``tokenizer_config.json`` with the special tokens and a ChatML chat
template. Token ids are written as little-endian uint16 (``train.bin``, ``heldout.bin``), documents separated by
``<|endoftext|>``, for the training script on the GPU machine (which has no network).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache" / "demo"
VOCAB_SIZE = 6144
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
#: Qwen2/3's pre-tokenizer split: contractions, letter runs with one leading non-letter, single digits,
#: punctuation runs, newlines, spaces.
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
              r"|\s+(?!\S)|\s+")
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def train(corpus: Path, out: Path, vocab_size: int = VOCAB_SIZE):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    # the separator lines are not text to learn merges from
    lines = (ln for ln in corpus.read_text().splitlines(keepends=True) if ln.strip() != SPECIALS[0])
    tok.train_from_iterator(lines, trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    added = {str(tok.token_to_id(s)): {"content": s, "lstrip": False, "rstrip": False, "normalized": False,
                                             "single_word": False, "special": True} for s in SPECIALS}
    cfg = {"tokenizer_class": "Qwen2Tokenizer", "model_max_length": 2048, "bos_token": None, "eos_token": SPECIALS[0],
               "pad_token": SPECIALS[0], "unk_token": None, "add_prefix_space": False,
               "clean_up_tokenization_spaces": False, "errors": "replace", "added_tokens_decoder": added,
               "additional_special_tokens": SPECIALS[1:], "chat_template": CHAT_TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return tok


def encode_file(tok, src: Path, dst: Path) -> int:
    """Token ids of ``src`` as uint16, one document at a time (the separator encodes to its special id)."""
    text = src.read_text()
    eot = tok.token_to_id(SPECIALS[0])
    ids: list[int] = []
    docs = [d for d in text.split(f"\n{SPECIALS[0]}\n") if d.strip()]
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        ids += enc.ids + [eot]
    arr = np.asarray(ids, dtype=np.uint16)
    dst.parent.mkdir(parents=True, exist_ok=True)
    arr.tofile(dst)
    return arr.size


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    args = ap.parse_args()
    tok = train(CACHE / "corpus" / "train.txt", CACHE / "tokenizer", args.vocab_size)
    stats = {}
    for split in ("train", "heldout"):
        n = encode_file(tok, CACHE / "corpus" / f"{split}.txt", CACHE / "tokens" / f"{split}.bin")
        chars = len((CACHE / "corpus" / f"{split}.txt").read_text())
        stats[split] = {"tokens": n, "characters": chars, "chars_per_token": round(chars / n, 3)}
        print(f"{split:>8}: {n:,} tokens, {chars / n:.2f} characters per token")
    (CACHE / "tokens" / "stats.json").write_text(json.dumps(dict(vocab_size=tok.get_vocab_size(), **stats),
                                                            indent=1) + "\n")
