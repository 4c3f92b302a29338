"""Entry point: ``python -m sglang_disagg.patchtool``."""

from __future__ import annotations

import sys

from sglang_disagg.patchtool.cli import main

if __name__ == "__main__":
    sys.exit(main())
