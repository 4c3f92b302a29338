"""smg's router with its keys set in-process instead of on its command line.

    python -m sglang_disagg.launch.smg_router [--scope all|admin] SMG-ARGUMENTS...

The launcher's router command where HTTP keys are on (keys.py). smg takes its keys from its
command line only, and any user of the machine reads /proc/PID/cmdline; so this parses smg's
own arguments with smg's own parser, derives the keys from the deployment's shared secret in
the environment (SGLANG_DISAGG_SECRET_FILE or SGLANG_DISAGG_SECRET, as the servers hold it),
puts them into smg's RouterArgs and starts the router as ``python -m smg.launch_router`` does:
the admin key as the only control-plane key (``--control-plane-api-keys``: /workers,
/flush_cache, /get_loads), and with ``--scope all`` (the default; keys.Scope) ``--api-key`` too
(asked of clients, presented to the workers). ``--scope admin`` (loopback) leaves serving
keyless: smg 1.13 with a control-plane key and no --api-key asks the key on its control plane
only (measured: /workers 401 without it, 200 and 202 with it; /generate served keyless).
"""

from __future__ import annotations

import sys

from sglang_disagg.launch import keys

_KEY_FLAGS = ("--api-key", "--control-plane-api-keys", "--tenant-api-key")
SCOPE_FLAG = "--scope"  # ours, first: which keys (keys.Scope), before smg's own arguments


def main(argv: list[str]) -> int:
    scope = keys.Scope.ALL
    if argv[:1] == [SCOPE_FLAG]:
        try:
            scope = keys.Scope(argv[1] if len(argv) > 1 else "")
        except ValueError:
            print(f"error: {SCOPE_FLAG}: expected all or admin", file=sys.stderr)
            return 2
        argv = argv[2:]
    if scope is keys.Scope.NONE:
        print(f"error: {SCOPE_FLAG} none: start smg.launch_router itself", file=sys.stderr)
        return 2
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
    args.api_key = http.api if scope.api else None
    args.control_plane_api_keys = [http.router_admin_entry()]
    launch_router(args)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
