"""``python -m sglang_disagg.patches``: the old entry point, one release long (see __init__)."""

from __future__ import annotations

import sys

from sglang_disagg.patches import NOTICE
from sglang_disagg.patchtool.cli import main

if __name__ == "__main__":
    print(f"note: {NOTICE}", file=sys.stderr)
    sys.exit(main())
