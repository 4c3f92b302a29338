"""Entry point: ``python -m sglang_disagg.patches``."""

from __future__ import annotations

import sys

from sglang_disagg.patches.cli import main

if __name__ == "__main__":
    sys.exit(main())
