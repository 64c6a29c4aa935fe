"""``lynn lab``: JupyterLab at the repository root, showing notebooks/ (other options go to ``jupyter lab``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

#: The repository: the notebooks link to ../docs/*.md.
ROOT = Path(__file__).resolve().parents[1]


def add(sub):
    return sub.add_parser("lab", help="open JupyterLab at the repository root, showing notebooks/ (other options go "
                                      "to jupyter lab)")


def run(args) -> int:
    from . import CommandError

    argv = [sys.executable, "-m", "jupyterlab", f"--ServerApp.root_dir={ROOT}",
            "--LabApp.default_url=/lab/tree/notebooks"]
    if hasattr(os, "geteuid") and os.geteuid() == 0 and "--allow-root" not in args.jupyter_args:
        print("lynn lab: running as root (as in many containers): passing --allow-root to JupyterLab",
              file=sys.stderr)
        argv.append("--allow-root")
    argv += args.jupyter_args
    try:
        import jupyterlab  # noqa: F401
    except ImportError:
        raise CommandError("JupyterLab is not installed: pip install jupyterlab", code=2) from None
    os.execv(sys.executable, argv)
    return 0  # not reached
