"""``python -m lynn_cli ...``: the ``lynn`` command."""

import sys

from lynn_cli import main

sys.exit(main())
