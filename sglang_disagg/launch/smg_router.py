"""smg's router with its keys set in-process instead of on its command line.

    python -m sglang_disagg.launch.smg_router SMG-ARGUMENTS...

The launcher's router command where HTTP keys are on (keys.py). smg takes its keys from its
command line only, and any user of the machine reads /proc/PID/cmdline; so this parses smg's
own arguments with smg's own parser, derives the keys from the deployment's shared secret in
the environment (SGLANG_DISAGG_SECRET_FILE or SGLANG_DISAGG_SECRET, as the servers hold it),
puts them into smg's RouterArgs and starts the router as ``python -m smg.launch_router`` does:
``--api-key`` (asked of clients, presented to the workers) and the admin key as the only
control-plane key (``--control-plane-api-keys``).
"""

from __future__ import annotations

import sys

from sglang_disagg.launch import keys

_KEY_FLAGS = ("--api-key", "--control-plane-api-keys", "--tenant-api-key")


def main(argv: list[str]) -> int:
    given = [a for a in argv if a.split("=", 1)[0] in _KEY_FLAGS]
    if given:  # a key here would be on the command line this module exists to keep them off
        print(f"error: {', '.join(given)}: keys come from the deployment's secret, not arguments", file=sys.stderr)
        return 2
    try:
        http = keys.from_secret(None)
    except keys.KeysError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from smg.launch_router import launch_router, parse_router_args

    args = parse_router_args(argv)
    args.api_key = http.api
    args.control_plane_api_keys = [http.router_admin_entry()]
    launch_router(args)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
