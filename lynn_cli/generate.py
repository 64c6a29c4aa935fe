"""``lynn generate [PROMPT]``: stream a continuation from the demo model or a HF checkpoint folder (``--model``)."""

from __future__ import annotations

import sys
from pathlib import Path

from .args import integer, number

#: The model ``lynn generate`` runs without ``--model``: the demo model trained for this workbench
#: (docs/quantization.md), shipped in the repository's data/.
DEMO_MODEL = Path(__file__).resolve().parents[1] / "data" / "models" / "lynn-demo"
DEMO_PROMPT = "It was a cold morning in the harbour, and the captain"


def add(sub):
    p = sub.add_parser("generate", help="stream a continuation of a prompt from a HF checkpoint folder",
                       description="Load a Qwen3-Next / Qwen3.5 / Qwen3.5-MoE folder (bf16 or NVFP4) with lynn_model "
                                   "and stream text; statistics go to stderr.")
    p.add_argument("prompt", nargs="?", default=None,
                   help=f"the prompt (default: {DEMO_PROMPT!r}; '-' reads it from stdin)")
    p.add_argument("--model", default=None, metavar="DIR",
                   help="HF model folder (config.json, safetensors, tokenizer.json); default: the demo model, "
                        "data/models/lynn-demo")
    p.add_argument("--max-new-tokens", type=integer(0, 10**9), default=200, metavar="N",
                   help="most tokens to generate (default 200; cut to what the model's context leaves)")
    p.add_argument("--max-tokens", type=integer(1, 10**9), default=None, metavar="N",
                   help="the cache's token budget (default: the prompt plus --max-new-tokens, at most the model's "
                        "context)")
    p.add_argument("--prefill-chunk", type=integer(1, 10**9), default=16384, metavar="N",
                   help="the most prompt tokens one prefill call takes; a longer prompt runs in several, each "
                        "continuing the cached prefix (default %(default)s)")
    p.add_argument("--temperature", type=number(0.0, 100.0), default=0.8, help="0 is greedy (default 0.8)")
    p.add_argument("--top-k", type=integer(0, 2**31 - 1), default=40, help="keep the k likeliest tokens; 0: all "
                                                                           "(default 40)")
    p.add_argument("--top-p", type=number(0.0, 1.0, lo_open=True), default=0.95,
                   help="keep the likeliest tokens up to this probability, in (0, 1]; 1: all (default 0.95)")
    p.add_argument("--seed", type=integer(0, 2**63 - 1), default=None,
                   help="sampling seed, 0 to 2^63-1 (default: from the clock, printed)")
    p.add_argument("--weights", choices=["auto", "nvfp4", "bf16"], default="auto")
    p.add_argument("--lm-head", choices=["checkpoint", "nvfp4", "nvfp4-drafts"], default="checkpoint",
                   help="the LM head as the checkpoint holds it (default), or quantised to NVFP4 on load: a decode "
                        "step reads 0.28x its bytes, at a perplexity cost (docs/quantization.md); nvfp4-drafts: "
                        "the checkpoint's head, and an NVFP4 copy for the --mtp drafts only (the same tokens)")
    p.add_argument("--backend", choices=["auto", "kernels", "reference", "interpreter"], default="auto",
                   help="auto (default): the compiled kernels on a GPU, the torch reference on a CPU; kernels: the "
                        "Triton kernels (compiled, or interpreted without a GPU); reference: torch; interpreter: "
                        "the kernels through Triton's interpreter")
    p.add_argument("--threads", type=integer(0, 4096), default=1,
                   help="CPU threads for torch (default 1: a small model's decode step is many tiny ops, and more "
                        "threads mostly wait on each other; 0 keeps torch's default)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the checkpoint's chat template")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the end-of-sequence tokens")
    p.add_argument("--mtp", type=integer(0, 3), default=0, metavar="K",
                   help="speculative decoding: K drafts (1-3) of the checkpoint's MTP module per step, verified in one "
                        "step of the model (default 0: off)")
    p.add_argument("--mtp-rule", choices=("coupled", "rejection"), default="coupled",
                   help="how a draft is accepted: coupled (default) keeps a draft when it is the token plain decoding "
                        "picks there, so the text is the same as without --mtp, greedy or seeded; rejection is the "
                        "speculative sampling test, each token distributed as plain sampling's (the same text when "
                        "greedy)")
    p.add_argument("--unfused", action="store_true",
                   help="keep each mixer's input projections as separate GEMVs and the Gated DeltaNet decode step as "
                        "three kernels (on a GPU the compiled kernels fuse them by default: attention q|k|v, Gated "
                        "DeltaNet qkv|z and b|a, one GEMV each; conv, gates, delta rule and norm in one kernel)")
    return p


def _weights(model):
    """Every weight tensor of ``model`` once (NVFP4 ones as their objects)."""
    import torch

    from lynn_model.model import Linear, SparseMoE

    seen = [model.embed_tokens]
    for m in model.modules():
        if isinstance(m, Linear):
            seen.append(m.weight)
        elif isinstance(m, SparseMoE):
            seen += [m.router, m.w13, m.w2]
            if m.shared is not None:
                seen += [m.shared.w13, m.shared.w2, m.shared.gate_weight]
        else:
            seen += [t for name, t in vars(m).items() if isinstance(t, torch.Tensor) and not name.startswith("_")]
    return {id(t): t for t in seen}.values()


def _peak_memory(device) -> str:
    import resource

    import torch

    if device.type == "cuda":
        return f"GPU peak {torch.cuda.max_memory_allocated(device) / 2**20:,.0f} MiB"
    return f"host peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:,.0f} MiB"


def _model_dir(args) -> Path:
    """The checkpoint folder, checked before anything is loaded (a usage error when it is not there)."""
    from . import CommandError

    if args.model is None:
        if not (DEMO_MODEL / "config.json").is_file():
            raise CommandError(f"the demo model is not at {DEMO_MODEL} (it ships with the repository's data/); "
                               "pass --model DIR", code=2)
        return DEMO_MODEL
    folder = Path(args.model).expanduser()
    if not folder.exists():
        raise CommandError(f"--model {args.model}: the folder does not exist", code=2)
    if not folder.is_dir():
        raise CommandError(f"--model {args.model}: not a folder (expected a HF model folder with config.json, "
                           f"safetensors and tokenizer.json)", code=2)
    return folder


def _prompt(args) -> str:
    from . import CommandError

    if args.prompt != "-":
        return DEMO_PROMPT if args.prompt is None else args.prompt
    try:
        return sys.stdin.read()
    except UnicodeDecodeError as err:
        raise CommandError(f"the prompt on stdin is not valid text ({err})", code=2) from None


def run(args) -> int:
    import time

    import torch

    import lynn_kernels
    import lynn_model

    from . import CommandError

    if args.backend == "interpreter" and lynn_kernels.backend() != "interpreter":   # chosen when lynn_kernels loaded
        raise CommandError("--backend interpreter: this process compiles the kernels for the GPU; start it with "
                           "TRITON_INTERPRET=1 to run them through the interpreter", code=2)
    model_dir = _model_dir(args)
    prompt = _prompt(args)
    backend = args.backend
    if backend == "auto":
        backend = "kernels" if torch.cuda.is_available() else "reference"
    reference = backend == "reference"
    t0 = time.perf_counter()
    try:
        tok = lynn_model.Tokenizer.from_pretrained(model_dir)
        with lynn_kernels.use_reference(reference):
            model = lynn_model.from_pretrained(model_dir, weights=args.weights, lm_head=args.lm_head, fuse=False)
    except (ValueError, OSError) as err:
        raise CommandError(str(err)) from None
    fused = {}
    if backend == "kernels" and torch.cuda.is_available() and not args.unfused:
        fused = model.fuse_for_decode()              # the decode fast path (docs/history/decode.md)
    load_s = time.perf_counter() - t0
    try:
        text = tok.apply_chat_template([{"role": "user", "content": prompt}]) if args.chat else prompt
    except (ValueError, OSError) as err:
        raise CommandError(f"--chat: {err}") from None
    ids = tok.encode(text)
    if not ids:
        raise CommandError("the prompt encodes to no tokens", code=2)
    context = model.config.max_position_embeddings
    if len(ids) > context:
        raise CommandError(f"the prompt has {len(ids):,} tokens; the model's context is {context:,} "
                           f"(max_position_embeddings in {model_dir / 'config.json'})")
    where = {"reference": "the torch reference path" + (" (no GPU here; --backend interpreter runs the Triton "
                                                         "kernels through Triton's interpreter)"
                                                         if not torch.cuda.is_available() else ""),
             "kernels": f"the Triton kernels ({lynn_kernels.backend()})",
             "interpreter": "the Triton kernels through Triton's interpreter (slow: for reading, not for speed)"}
    seed = args.seed if args.seed is not None else int(time.time()) % 100000
    head = {"nvfp4": ", NVFP4 LM head", "nvfp4-drafts": ", NVFP4 draft head"}.get(args.lm_head, "")
    fusion = (f", fused: {', '.join(f'{k} x{v}' for k, v in fused.items())}" if fused else "")
    print(f"[{model_dir.name}: {model.config.family}, {args.weights} weights{head}, on {where[backend]}{fusion}; "
          f"seed {seed}]", file=sys.stderr)
    stops = sorted(set(tok.stop_ids) | set(model.config.eos_token_ids)) if not args.ignore_eos else []
    stats = lynn_model.Stats()
    out = sys.stdout
    echoed = args.chat                               # the prompt is echoed with the first text, so a refusal
                                                     # before any token leaves stdout empty

    def write(text: str) -> None:
        nonlocal echoed
        if not echoed:
            out.write(prompt)
            echoed = True
        out.write(text)
        out.flush()

    stream = lynn_model.TextStream(tok, write)
    threads = torch.get_num_threads()
    if model.device.type == "cpu" and args.threads:
        torch.set_num_threads(args.threads)
    try:
        with lynn_kernels.use_reference(reference):
            lynn_model.generate(model, torch.tensor([ids]), args.max_new_tokens, temperature=args.temperature,
                                top_k=args.top_k or None, top_p=args.top_p, seed=seed, stop_ids=stops,
                                stream=stream, stats=stats, max_tokens=args.max_tokens, mtp=args.mtp,
                                prefill_chunk=args.prefill_chunk,
                                mtp_rule=args.mtp_rule)
    except (ValueError, lynn_model.CacheFull) as err:
        if echoed and not args.chat:
            out.write("\n")
            out.flush()
        raise CommandError(str(err)) from None
    finally:
        torch.set_num_threads(threads)               # main() may be called in-process (tests, notebooks)
    write("\n")
    for note in stats.notes:
        print(f"note: {note}", file=sys.stderr)
    decode = f"CUDA graph, captured in {stats.capture_s:.1f} s" if stats.cuda_graph else "eager steps"
    if args.mtp:
        decode += (f"; {args.mtp} MTP drafts a step ({args.mtp_rule}), {stats.accepted} of {stats.drafted} accepted, "
                   f"{stats.acceptance_length:.2f} tokens per verify step")
    weights = sum(t.nbytes for t in _weights(model))
    print(f"[loaded in {load_s:.1f} s; prompt {stats.prompt_tokens} tokens at {stats.prefill_tok_s:,.1f} tok/s; "
          f"{stats.new_tokens} new tokens at {stats.decode_tok_s:,.1f} tok/s ({decode}); weights "
          f"{weights / 2**20:,.1f} MiB, cache {stats.cache_bytes / 2**20:,.1f} MiB; {_peak_memory(model.device)}]",
          file=sys.stderr)
    return 0
