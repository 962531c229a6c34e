"""``python -m piecewise_backend inspect MODULE:FACTORY [--tokens N] [--dump DIR] [--context MODULE:FUNC]``."""

import sys

from .inspect_cli import main

if __name__ == "__main__":
    sys.exit(main())
