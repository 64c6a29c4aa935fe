"""``lynn``: the workbench's command line, at the top of the stack (it imports ``lynn_model`` and ``lynn_kernels``;
neither imports it).

* ``lynn check [NAME ...]``    validate every kernel (or the families / ops named) against its reference here;
* ``lynn race OP --variant FILE.py:NAME``  check a kernel variant, race it, run the decoder on it (``--base REV``:
  the working tree against a git revision);
* ``lynn bench [OP ...]``      run the GPU benchmarks and write JSON under data/bench/<gpu>/;
* ``lynn lab``                 open JupyterLab on notebooks/00-start-here.ipynb (other options go to jupyter lab);
* ``lynn info``                what this process runs on;
* ``lynn quantize SRC DST``    write an NVFP4 (W4A16) copy of a Qwen3-Next / Qwen3.5 checkpoint (docs/nvfp4.md);
* ``lynn generate [PROMPT]``   stream a continuation from the demo model, or ``--model DIR`` (docs/decoder.md).
* ``lynn serve``               an OpenAI-compatible HTTP server with continuous batching (docs/serving.md).

Each command is a module of this package: ``add(subparsers)`` declares its arguments, ``run(args)`` does its work and
imports what it needs. Parsing imports no torch, so ``--help``, ``--version`` and usage errors answer at once, and
every argument is checked before a model is loaded. A command answers a problem with one line,
``lynn <command>: error: ...``, and exit status 2 for a usage error (argparse's), 1 for a failure; a bad start-up
setting such as ``LYNN_BACKEND=bogus`` (raised when ``lynn_kernels`` is imported) is a usage error. ``python -m
lynn_cli ...`` is the same command.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import sys

COMMANDS = ("check", "race", "bench", "lab", "info", "quantize", "generate", "serve")


class CommandError(Exception):
    """A problem to report as ``lynn <command>: error: <message>`` with exit status ``code`` (1: a failure)."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The ``lynn`` parser and each command's own parser (for its usage line in errors)."""
    parser = argparse.ArgumentParser(prog="lynn", description="Lynn workbench: Triton kernels for LLM inference")
    parser.add_argument("--version", action="version", version=f"lynn {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    return parser, {name: importlib.import_module(f"{__name__}.{name}").add(sub) for name in COMMANDS}


def main(argv: list[str] | None = None) -> int:
    """Run one ``lynn`` command line; returns its exit status (a usage error raises ``SystemExit(2)``)."""
    parser, commands = build_parser()
    args, extra = parser.parse_known_args(sys.argv[1:] if argv is None else list(argv))
    if extra and args.command != "lab":                       # `lynn lab` hands the rest to jupyter lab
        _unrecognized(commands[args.command], extra)
    args.jupyter_args = extra
    command = importlib.import_module(f"{__name__}.{args.command}")
    try:
        if args.command != "lab":
            _import_kernels()
        return command.run(args)
    except CommandError as err:
        where = "lynn" if getattr(err, "startup", False) else f"lynn {args.command}"
        print(f"{where}: error: {err}", file=sys.stderr)
        return err.code
    except KeyboardInterrupt:
        print(f"\nlynn {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:                                   # `lynn generate | head`: the reader left
        sys.stderr.close()
        return 1


def _import_kernels() -> None:
    """Import ``lynn_kernels`` (it reads ``LYNN_BACKEND`` / ``TRITON_INTERPRET`` and picks the backend), reporting
    a bad setting as a usage error; any other error there is a bug and keeps its traceback."""
    try:
        import lynn_kernels  # noqa: F401
    except (ValueError, RuntimeError) as err:
        if not getattr(err, "lynn_startup_error", False):      # marked by lynn_kernels.runtime
            raise
        error = CommandError(str(err), code=2)
        error.startup = True
        raise error from None


def _unrecognized(parser: argparse.ArgumentParser, extra: list[str]) -> None:
    """A usage error from the command's own parser, naming the unknown options (and the nearest known one)."""
    options = [o for a in parser._actions for o in a.option_strings]
    unknown = [x.split("=")[0] for x in extra if x.startswith("-") and x != "-"]
    if not unknown:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    hints = []
    for opt in unknown:
        near = difflib.get_close_matches(opt, options, n=1)
        hints.append(f"{opt} (did you mean {near[0]}?)" if near else opt)
    parser.error(f"unrecognized option{'s' if len(unknown) > 1 else ''}: {', '.join(hints)}")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lynn-workbench")
    except PackageNotFoundError:
        return "(not installed)"
