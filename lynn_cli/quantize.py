"""``lynn quantize SRC DST``: an NVFP4 (W4A16) copy of a Qwen3-Next / Qwen3.5 / Qwen3.5-MoE checkpoint."""

from __future__ import annotations

import re
from pathlib import Path


def add(sub):
    p = sub.add_parser("quantize", help="write an NVFP4 (W4A16) copy of a bf16/fp16/fp32 HF checkpoint",
                       description="Quantise the Linear weights of a Qwen3-Next / Qwen3.5 / Qwen3.5-MoE HF model "
                                   "folder to NVFP4 (weights only) and write a folder vLLM, SGLang and lynn_model "
                                   "read. SRC is never modified; nothing is written outside DST and a temporary "
                                   "folder beside it. See docs/nvfp4.md, 'lynn quantize'.")
    p.add_argument("src", metavar="SRC", help="HF model folder (config.json + safetensors)")
    p.add_argument("dst", metavar="DST", help="output folder (new, or empty, or a model replaced with --overwrite)")
    p.add_argument("--format", choices=["compressed-tensors", "modelopt"], default="compressed-tensors",
                   help="on-disk layout (default: compressed-tensors)")
    p.add_argument("--recipe", choices=["modelopt", "compressed-tensors"], default=None,
                   help="whose rounding to reproduce bit for bit (default: the format's own)")
    p.add_argument("--ignore", metavar="REGEX", action="append", type=_regex,
                   help="keep modules whose name (without .weight) matches REGEX unquantised; repeatable")
    p.add_argument("--quantize-linear-attn", action="store_true",
                   help="also quantise the Gated DeltaNet in_proj_qkv / in_proj_z (in_proj_qkvz) / out_proj")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing DST that holds a model (config.json, safetensors and files named as "
                        "in SRC); any other folder is refused")
    p.add_argument("--quiet", action="store_true", help="no progress bar or notes on stderr")
    return p


def _regex(text: str) -> str:
    import argparse

    try:
        re.compile(text)
    except re.error as err:
        raise argparse.ArgumentTypeError(f"{text!r} is not a valid regular expression: {err}") from None
    return text


def run(args) -> int:
    from . import CommandError

    src = Path(args.src).expanduser()
    if not src.is_dir():
        raise CommandError(f"SRC {src} {'is not a folder' if src.exists() else 'does not exist'}", code=2)
    from lynn_model.quantize import format_summary, quantize_checkpoint

    try:
        summary = quantize_checkpoint(args.src, args.dst, format=args.format, recipe=args.recipe,
                                      ignore=args.ignore or (), quantize_linear_attn=args.quantize_linear_attn,
                                      overwrite=args.overwrite, progress=not args.quiet)
    except (ValueError, OSError) as err:
        raise CommandError(str(err)) from None
    print(format_summary(summary))
    return 0
