"""``lynn lab``: JupyterLab at the repository root, opened on ``notebooks/00-start-here.ipynb``; ``--no-browser``,
``--port`` and any other option go on to ``jupyter lab``."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

#: The repository: the notebooks link to ../docs/*.md.
ROOT = Path(__file__).resolve().parents[1]
#: The notebook JupyterLab opens first.
START = "notebooks/00-start-here.ipynb"


def add(sub):
    p = sub.add_parser(
        "lab", help=f"open JupyterLab on {START} (other options go to jupyter lab)",
        description=f"Open JupyterLab at the repository root on {START}.",
        epilog="Any other option goes on to `jupyter lab` unchanged (`jupyter lab --help` lists them), e.g.\n"
               "  lynn lab --no-browser --port 8899 --ip 0.0.0.0\n"
               "  lynn lab --ServerApp.token=TOKEN",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--no-browser", action="store_true",
                   help="do not open a browser; JupyterLab prints the URL to open (passed to jupyter lab)")
    p.add_argument("--port", type=int, metavar="PORT", help="the port to serve on (passed to jupyter lab; "
                                                             "its default 8888, or the next free one)")
    return p


def run(args) -> int:
    from . import CommandError

    argv = [sys.executable, "-m", "jupyterlab", f"--ServerApp.root_dir={ROOT}",
            f"--LabApp.default_url=/lab/tree/{START}"]
    if hasattr(os, "geteuid") and os.geteuid() == 0 and "--allow-root" not in args.jupyter_args:
        print("lynn lab: running as root (as in many containers): passing --allow-root to JupyterLab",
              file=sys.stderr)
        argv.append("--allow-root")
    if args.no_browser:
        argv.append("--no-browser")
    if args.port is not None:
        argv += ["--port", str(args.port)]
    argv += args.jupyter_args
    try:
        import jupyterlab  # noqa: F401
    except ImportError:
        raise CommandError("JupyterLab is not installed: pip install jupyterlab", code=2) from None
    os.execv(sys.executable, argv)
    return 0  # not reached
