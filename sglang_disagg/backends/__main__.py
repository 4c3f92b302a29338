"""`python -m sglang_disagg.backends`: every registered backend and whether it works here."""

from __future__ import annotations

import sys

from . import available, list_backends


def main() -> int:
    rows = []
    for name, target in list_backends().items():
        ok, why = available(name)
        rows.append((name, "usable" if ok else "unavailable", why or target))
    width = max(len(r[0]) for r in rows)
    for name, state, detail in rows:
        sys.stdout.write(f"{name:<{width}}  {state:<11}  {detail}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
