"""``lynn serve``: an OpenAI-compatible HTTP server over the demo model or a HF checkpoint folder (``--model``), with
continuous batching (lynn_model.serve). Needs the serve extra: ``pip install -e ".[serve]"``."""

from __future__ import annotations

import sys
from pathlib import Path

from .args import integer


def add(sub):
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API (continuous batching)",
                       description="POST /v1/completions and /v1/chat/completions (streaming or not), GET /v1/models, "
                                   "/health and /metrics; docs/serving.md. Needs: pip install -e \".[serve]\".")
    p.add_argument("--model", default=None, metavar="DIR",
                   help="HF model folder (config.json, safetensors, tokenizer.json); default: the demo model, "
                        "data/models/lynn-demo")
    p.add_argument("--preset", default=None, metavar="NAME",
                   help="serve a random-weight NVFP4 model of a preset instead (qwen3.5-35b-a3b, ...: for speed "
                        "figures; no tokenizer, so prompts are token ids and the text is the ids written <id>)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s: this machine only)")
    p.add_argument("--port", type=integer(0, 65535), default=8000, help="port (default %(default)s; 0: any free one)")
    p.add_argument("--name", default=None, help="the model's name in the API (default: the folder's name)")
    p.add_argument("--weights", choices=["auto", "nvfp4", "bf16"], default="auto",
                   help="auto (default): as the checkpoint holds them (with --preset: nvfp4)")
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                   help="compute dtype; auto (default): float32 on a CPU (a bf16 batch is not bit-invariant there, "
                        "so greedy tokens could depend on the company), the checkpoint's on a GPU")
    p.add_argument("--backend", choices=["auto", "kernels", "reference"], default="auto",
                   help="auto (default): the compiled kernels on a GPU, the torch reference on a CPU")
    p.add_argument("--rows", type=integer(1, 32), default=8,
                   help="requests decoded at once: cache slots and the widest decode batch (default %(default)s)")
    p.add_argument("--max-tokens", type=integer(1, 10**9), default=None, metavar="N",
                   help="the cache's token budget (default: --rows full contexts, at most 65,536)")
    p.add_argument("--prefill-tokens", type=integer(1, 10**6), default=512, metavar="N",
                   help="prompt tokens prefilled per engine step (default %(default)s): smaller keeps running streams "
                        "moving while a long prompt comes in")
    p.add_argument("--mtp", type=integer(0, 3), default=0, metavar="K",
                   help="speculative decoding: K drafts (1-3) of the checkpoint's MTP module per round, verified in "
                        "one step of the model; eager rounds, no graph (default 0: off)")
    p.add_argument("--mtp-rule", choices=("coupled", "rejection"), default="coupled",
                   help="how a draft is accepted: coupled (default) gives the tokens of plain decoding, greedy or "
                        "seeded; rejection is the speculative sampling test (the same tokens when greedy)")
    p.add_argument("--max-queue", type=integer(0, 10**6), default=64, metavar="N",
                   help="requests waiting for a slot (beyond the free slots) after which new ones get 429 (default "
                        "%(default)s)")
    p.add_argument("--default-max-tokens", type=integer(1, 10**9), default=1024, metavar="N",
                   help="a chat request's max_tokens when it gives none (default %(default)s; at most the context "
                        "left): the cache reserves a request's whole length when it admits it")
    p.add_argument("--threads", type=integer(0, 4096), default=1,
                   help="CPU threads for torch (default 1; 0 keeps torch's default)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return p


def run(args) -> int:
    from . import CommandError
    from .generate import DEMO_MODEL

    try:
        import uvicorn

        from lynn_model.serve.http import Server, create_app, preset_model
    except ImportError as err:
        raise CommandError(f"lynn serve needs the serve extra ({err.name} is missing): "
                           f"python -m pip install -e \".[serve]\"") from None
    import torch

    if args.preset and args.model:
        raise CommandError("--model and --preset: give one", code=2)
    dtype = {"auto": None, "bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    if args.preset:
        from lynn_model.config import PRESETS

        if args.preset not in PRESETS:
            raise CommandError(f"--preset: no preset {args.preset!r}; presets: {sorted(PRESETS)}", code=2)
        print(f"[lynn serve: building a random-weight {args.preset} model ...]", file=sys.stderr)
        model = preset_model(args.preset, weights="bf16" if args.weights == "bf16" else "nvfp4", dtype=dtype,
                             backend=args.backend)
        where = f"a random-weight {args.preset}"
    else:
        model = Path(args.model) if args.model else DEMO_MODEL
        if not (model / "config.json").is_file():
            raise CommandError(f"--model {model}: no config.json there (expected a HF model folder)", code=2)
        where = str(model)
    failure: list[str] = []
    server = Server(model, weights=args.weights, dtype=dtype, backend=args.backend, rows=args.rows,
                    max_tokens=args.max_tokens, prefill_tokens=args.prefill_tokens, max_queue=args.max_queue,
                    threads=args.threads, name=args.name or args.preset, default_max_tokens=args.default_max_tokens,
                    mtp=args.mtp, mtp_rule=args.mtp_rule)
    config = uvicorn.Config(create_app(server), host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=5)
    http = uvicorn.Server(config)
    server.on_failure = lambda message: (failure.append(message), setattr(http, "should_exit", True))
    spec = f"{args.mtp} MTP drafts a round ({args.mtp_rule}); " if args.mtp else ""
    print(f"[lynn serve: {where} as '{server.name}' on http://{args.host}:{args.port}; {args.rows} rows; {spec}"
          f"the model loads in the background, /health answers 503 until it is ready]", file=sys.stderr)
    http.run()
    if failure:
        raise CommandError(failure[0])
    return 0
