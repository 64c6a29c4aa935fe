"""The ``lynn`` command's entry point: :func:`lynn_kernels.cli.main`, with start-up configuration errors reported as
usage errors.

``import lynn_kernels`` reads the environment before any of the package runs, and a bad setting (``LYNN_BACKEND=bogus``,
or ``LYNN_BACKEND=triton`` with no GPU) raises there, as it should for a Python user. The command imports
``lynn_kernels.cli`` here, outside the package, so that it can report such an error as one line on stderr and exit
with status 2 (argparse's status for a usage error) instead of a traceback. ``python -m lynn_cli ...`` is the same
command.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    try:
        from lynn_kernels import cli
    except (ValueError, RuntimeError) as err:
        if not getattr(err, "lynn_startup_error", False):           # marked by lynn_kernels.runtime: anything else
            raise                                                   # is a bug, and keeps its traceback
        print(f"lynn: error: {err}", file=sys.stderr)
        return 2
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
