"""``lynn``: the workbench's command line.

* ``lynn check [NAME ...]``    validate every kernel (or the families / ops named) against its reference here;
* ``lynn bench [OP ...]``      run the GPU benchmarks and write JSON under data/bench/<gpu>/;
* ``lynn lab``                 open JupyterLab on notebooks/;
* ``lynn info``                what this process runs on;
* ``lynn quantize SRC DST``    write an NVFP4 (W4A16) copy of a Qwen3-Next / Qwen3.5 checkpoint (docs/nvfp4.md);
* ``lynn generate [PROMPT]``  stream a continuation from the demo model, or ``--model DIR`` (docs/decoder.md).

The ``lynn`` script enters at ``lynn_cli.main`` (``lynn_cli.py``, outside this package), which reports a bad start-up
setting such as ``LYNN_BACKEND=bogus`` (raised when ``lynn_kernels`` is imported) as a usage error, then calls
:func:`main`.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

#: What ``lynn check`` says first under the reference backend.
REFERENCE_NOTICE = ("note: the backend is the torch reference (LYNN_BACKEND=reference, or use_reference()): every op "
                    "runs its reference, so these checks compare the reference with itself and say nothing about "
                    "the kernels.")


def _cmd_check(args) -> int:
    import textwrap
    import time

    from . import checks, device_summary

    info = device_summary()
    print(f"lynn check on {info['device']} (backend {info['backend']}, torch {info['torch']}, "
          f"triton {info['triton']})", flush=True)
    if info["backend"] == "reference":
        print(textwrap.fill(REFERENCE_NOTICE, checks.WIDTH), flush=True)
    tty = sys.stderr.isatty()
    t0 = time.perf_counter()
    state = {"table": None, "family": 0, "families": 0, "rows": 0, "progress": False}

    def clear_progress():
        if state["progress"]:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()
            state["progress"] = False

    def on_family(family, i, n):
        if state["table"] is None:
            state["table"] = checks.StreamTable(n)
            print(state["table"].header(), flush=True)
        state["family"], state["families"] = i, n
        if tty:                                        # a line that the next rows overwrite
            clear_progress()
            done = state["rows"]
            sys.stderr.write(f"[{i}/{n}] running the {family} checks ... ({done} row{'' if done == 1 else 's'} "
                             f"so far, {time.perf_counter() - t0:.0f} s)")
            sys.stderr.flush()
            state["progress"] = True

    def on_row(row):
        clear_progress()
        state["rows"] += 1
        print(state["table"].row(row, state["family"], state["families"]), flush=True)

    try:
        rows, seconds = checks.run_checks(args.family or None, on_family=on_family, on_row=on_row)
    except ValueError as err:
        clear_progress()
        print(f"lynn check: error: {err}", file=sys.stderr)
        return 2
    finally:
        clear_progress()
    failed = [r for r in rows if not r["passed"]]
    print(f"\n{len(rows) - len(failed)}/{len(rows)} checks passed in {seconds:.1f} s")
    return 1 if failed else 0


def _cmd_bench(args) -> int:
    import torch

    from . import bench

    if args.list:
        print("\n".join(bench.available()))
        return 0
    if args.make_baseline or args.check_only:
        from .bench import gate

        if args.make_baseline:
            base = gate.make_baseline(args.make_baseline)
            print(f"wrote {gate.BASELINE}: {len(base['rows'])} gated rows from {', '.join(base['made_from'])}")
            return 0
        return _gate_report(gate, args.check_only)
    if not torch.cuda.is_available():
        print("lynn bench needs a CUDA GPU: timings under the interpreter mean nothing. Committed H200 results "
              "are in data/bench/h200/ and the notebooks plot them.", file=sys.stderr)
        return 2
    root = Path(args.out) if args.out else None
    command = "lynn bench " + " ".join(sys.argv[2:])
    written = bench.run(args.op or None, quick=args.quick, command=command, root=root)
    for op, path in written.items():
        print(f"\n== {op}  ->  {path}")
        print(bench.result_table(bench.load(op, root=Path(path).parent.parent, gpu=Path(path).parent.name)))
    if args.check:
        from .bench import gate

        return _gate_report(gate, list(written.values()))
    return 0


def _gate_report(gate, files) -> int:
    """Print the perf gate's verdict on result ``files``: 0 when every gated row is within its tolerance, 1 not."""
    passed, report = gate.check(files)
    print(f"\nperf gate against {gate.BASELINE}:")
    print(gate.format_report(report))
    print("perf gate: " + ("passed" if passed else "FAILED (a gated row is slower than allowed, or missing)"))
    return 0 if passed else 1


def _cmd_lab(args) -> int:
    root = Path(__file__).resolve().parents[1]             # the repository: the notebooks link to ../docs/*.md
    argv = [sys.executable, "-m", "jupyterlab", f"--ServerApp.root_dir={root}",
            "--LabApp.default_url=/lab/tree/notebooks"]
    if hasattr(os, "geteuid") and os.geteuid() == 0 and "--allow-root" not in args.jupyter_args:
        print("lynn lab: running as root (as in many containers): passing --allow-root to JupyterLab",
              file=sys.stderr)
        argv.append("--allow-root")
    argv += args.jupyter_args
    try:
        import jupyterlab  # noqa: F401
    except ImportError:
        print("JupyterLab is not installed: pip install jupyterlab", file=sys.stderr)
        return 2
    os.execv(sys.executable, argv)
    return 0  # not reached


def _cmd_info(args) -> int:
    from . import device_summary

    for k, v in device_summary().items():
        print(f"{k:>10}: {v}")
    return 0


def _cmd_quantize(args) -> int:
    from lynn_model.quantize import format_summary, quantize_checkpoint

    try:
        summary = quantize_checkpoint(args.src, args.dst, format=args.format, recipe=args.recipe,
                                      ignore=args.ignore or (), quantize_linear_attn=args.quantize_linear_attn,
                                      overwrite=args.overwrite, progress=not args.quiet)
    except (ValueError, OSError) as err:
        print(f"lynn quantize: error: {err}", file=sys.stderr)
        return 2
    print(format_summary(summary))
    return 0


#: The model ``lynn generate`` runs without ``--model``: the demo model trained for this workbench (docs/quantization.md).
DEMO_MODEL = Path(__file__).resolve().parents[1] / "data" / "models" / "lynn-demo"
DEMO_PROMPT = "It was a cold morning in the harbour, and the captain"


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


def _cmd_generate(args) -> int:
    import time

    import torch

    import lynn_kernels
    import lynn_model

    if args.backend == "interpreter" and lynn_kernels.backend() != "interpreter":   # chosen when lynn_kernels loaded
        print("lynn generate: error: --backend interpreter: this process compiles the kernels for the GPU; start it "
              "with TRITON_INTERPRET=1 to run them through the interpreter", file=sys.stderr)
        return 2
    backend = args.backend
    if backend == "auto":
        backend = "kernels" if torch.cuda.is_available() else "reference"
    reference = backend == "reference"
    if args.prompt == "-":
        prompt = sys.stdin.read()
    else:
        prompt = DEMO_PROMPT if args.prompt is None else args.prompt
    model_dir = Path(args.model) if args.model else DEMO_MODEL
    if args.model is None and not (model_dir / "config.json").is_file():
        print(f"lynn generate: error: the demo model is not at {model_dir} (it ships with the repository's data/); "
              "pass --model DIR", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    try:
        tok = lynn_model.Tokenizer.from_pretrained(model_dir)
        with lynn_kernels.use_reference(reference):
            model = lynn_model.from_pretrained(model_dir, weights=args.weights)
    except (ValueError, OSError) as err:
        print(f"lynn generate: error: {err}", file=sys.stderr)
        return 2
    fused = {}
    if backend == "kernels" and torch.cuda.is_available() and not args.unfused:
        fused = model.fuse_input_projections()       # the decode fast path: fewer GEMVs a step (docs/performance.md)
        if n_gdn := model.fuse_gdn_decode():         # and each Gated DeltaNet decode step in one kernel
            fused["gdn decode step"] = n_gdn
    load_s = time.perf_counter() - t0
    try:
        text = tok.apply_chat_template([{"role": "user", "content": prompt}]) if args.chat else prompt
    except Exception as err:  # noqa: BLE001  (no template, or one jinja2 cannot render)
        print(f"lynn generate: error: --chat: {err}", file=sys.stderr)
        return 2
    ids = tok.encode(text)
    if not ids:
        print("lynn generate: error: the prompt encodes to no tokens", file=sys.stderr)
        return 2
    where = {"reference": "the torch reference path" + (" (no GPU here; --backend interpreter runs the Triton "
                                                         "kernels through Triton's interpreter)"
                                                         if not torch.cuda.is_available() else ""),
             "kernels": f"the Triton kernels ({lynn_kernels.backend()})",
             "interpreter": "the Triton kernels through Triton's interpreter (slow: for reading, not for speed)"}
    seed = args.seed if args.seed is not None else int(time.time()) % 100000
    fusion = (f", fused: {', '.join(f'{k} x{v}' for k, v in fused.items())}" if fused else "")
    print(f"[{model_dir.name}: {model.config.family}, {args.weights} weights, on {where[backend]}{fusion}; "
          f"seed {seed}]", file=sys.stderr)
    stops = sorted(set(tok.stop_ids) | set(model.config.eos_token_ids)) if not args.ignore_eos else []
    stats = lynn_model.Stats()
    out = sys.stdout
    stream = lynn_model.TextStream(tok, lambda s: (out.write(s), out.flush()))
    if not args.chat:
        out.write(prompt)
        out.flush()
    threads = torch.get_num_threads()
    if model.device.type == "cpu" and args.threads:
        torch.set_num_threads(args.threads)
    try:
        with lynn_kernels.use_reference(reference):
            lynn_model.generate(model, torch.tensor([ids]), args.max_new_tokens, temperature=args.temperature,
                                top_k=args.top_k, top_p=args.top_p, seed=seed, stop_ids=stops, stream=stream,
                                stats=stats, max_tokens=args.max_tokens)
    finally:
        torch.set_num_threads(threads)               # main() may be called in-process (tests, notebooks)
    out.write("\n")
    out.flush()
    decode = f"CUDA graph, captured in {stats.capture_s:.1f} s" if stats.cuda_graph else "eager steps"
    weights = sum(t.nbytes for t in _weights(model))
    print(f"[loaded in {load_s:.1f} s; prompt {stats.prompt_tokens} tokens at {stats.prefill_tok_s:,.1f} tok/s; "
          f"{stats.new_tokens} new tokens at {stats.decode_tok_s:,.1f} tok/s ({decode}); weights "
          f"{weights / 2**20:,.1f} MiB, cache {stats.cache_bytes / 2**20:,.1f} MiB; {_peak_memory(model.device)}]",
          file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lynn", description="Lynn workbench: Triton kernels for LLM inference")
    parser.add_argument("--version", action="version", version=f"lynn {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("check", help="validate every kernel against its reference on this device")
    p.add_argument("family", nargs="*", metavar="NAME",
                   help="families (nvfp4 matmul attention deltanet moe norm) or op names as the table prints them "
                        "(e.g. nvfp4.quantize; quote a name with spaces: 'nvfp4 round trip'); default: all")
    p.set_defaults(func=_cmd_check)
    p = sub.add_parser("bench", help="run GPU benchmarks, write data/bench/<gpu>/<op>.json")
    p.add_argument("op", nargs="*", help="benchmarks to run, by name prefix (default: all)")
    p.add_argument("--quick", action="store_true", help="one shape per benchmark")
    p.add_argument("--out", help="results root (default: data/bench)")
    p.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    p.add_argument("--check", action="store_true",
                   help="after running, compare the gated rows with data/bench/h200/perf_baseline.json; exit 1 on "
                        "a regression beyond noise (decode -3%%, prefill -5%%)")
    p.add_argument("--check-only", nargs="+", metavar="JSON", help="run nothing: check result files against the "
                                                                   "baseline")
    p.add_argument("--make-baseline", nargs="+", metavar="JSON", help="run nothing: write the baseline from result "
                                                                      "files")
    p.set_defaults(func=_cmd_bench)
    p = sub.add_parser("lab", help="open JupyterLab at the repository root, showing notebooks/ (other options go "
                                   "to jupyter lab)")
    p.set_defaults(func=_cmd_lab)
    p = sub.add_parser("info", help="show the device and backend")
    p.set_defaults(func=_cmd_info)
    p = sub.add_parser("quantize", help="write an NVFP4 (W4A16) copy of a bf16/fp16/fp32 HF checkpoint",
                       description="Quantise the Linear weights of a Qwen3-Next / Qwen3.5 / Qwen3.5-MoE HF model "
                                   "folder to NVFP4 (weights only) and write a folder vLLM, SGLang and lynn_model "
                                   "read. SRC is never modified. See docs/nvfp4.md, 'lynn quantize'.")
    p.add_argument("src", metavar="SRC", help="HF model folder (config.json + safetensors)")
    p.add_argument("dst", metavar="DST", help="output folder (new, or empty, or replaced with --overwrite)")
    p.add_argument("--format", choices=["compressed-tensors", "modelopt"], default="compressed-tensors",
                   help="on-disk layout (default: compressed-tensors)")
    p.add_argument("--recipe", choices=["modelopt", "compressed-tensors"], default=None,
                   help="whose rounding to reproduce bit for bit (default: the format's own)")
    p.add_argument("--ignore", metavar="REGEX", action="append",
                   help="keep modules whose name (without .weight) matches REGEX unquantised; repeatable")
    p.add_argument("--quantize-linear-attn", action="store_true",
                   help="also quantise the Gated DeltaNet in_proj_qkv / in_proj_z (in_proj_qkvz) / out_proj")
    p.add_argument("--overwrite", action="store_true", help="replace an existing non-empty DST")
    p.add_argument("--quiet", action="store_true", help="no progress bar or notes on stderr")
    p.set_defaults(func=_cmd_quantize)
    p = sub.add_parser("generate", help="stream a continuation of a prompt from a HF checkpoint folder",
                       description="Load a Qwen3-Next / Qwen3.5 / Qwen3.5-MoE folder (bf16 or NVFP4) with lynn_model "
                                   "and stream text; statistics go to stderr.")
    p.add_argument("prompt", nargs="?", default=None,
                   help=f"the prompt (default: {DEMO_PROMPT!r}; '-' reads it from stdin)")
    p.add_argument("--model", default=None,
                   help="HF model folder (config.json, safetensors, tokenizer.json); default: the demo model, "
                        "data/models/lynn-demo")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=None,
                   help="the cache's token budget (default: the prompt plus --max-new-tokens)")
    p.add_argument("--temperature", type=float, default=0.8, help="0 is greedy")
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: from the clock, printed)")
    p.add_argument("--weights", choices=["auto", "nvfp4", "bf16"], default="auto")
    p.add_argument("--backend", choices=["auto", "kernels", "reference", "interpreter"], default="auto",
                   help="auto (default): the compiled kernels on a GPU, the torch reference on a CPU; kernels: the "
                        "Triton kernels (compiled, or interpreted without a GPU); reference: torch; interpreter: "
                        "the kernels through Triton's interpreter")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads for torch (default 1: a small model's decode step is many tiny ops, and more "
                        "threads mostly wait on each other; 0 keeps torch's default)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the checkpoint's chat template")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the end-of-sequence tokens")
    p.add_argument("--unfused", action="store_true",
                   help="keep each mixer's input projections as separate GEMVs and the Gated DeltaNet decode step as "
                        "three kernels (on a GPU the compiled kernels fuse them by default: attention q|k|v, Gated "
                        "DeltaNet qkv|z and b|a, one GEMV each; conv, gates, delta rule and norm in one kernel)")
    p.set_defaults(func=_cmd_generate)
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "lab":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.jupyter_args = extra
    return args.func(args)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lynn-workbench")
    except PackageNotFoundError:
        return "(not installed)"


if __name__ == "__main__":
    sys.exit(main())
