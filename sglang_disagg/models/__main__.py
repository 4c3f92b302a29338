"""``python -m sglang_disagg.models [NAME ...]``: generate built-in models (all if none named) and print their paths."""

from __future__ import annotations

import sys

from sglang_disagg.models import BUILTIN_MODELS, REAL_MODELS, ModelError, ensure_model


def main(argv: list[str]) -> int:
    names = argv or sorted(BUILTIN_MODELS) + sorted(REAL_MODELS)
    for name in names:
        try:
            print(f"{name}\t{ensure_model(name)}")
        except (ValueError, ModelError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
