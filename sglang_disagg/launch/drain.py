"""Draining a decoder from outside it: ``python -m sglang_disagg.launch drain``, and the
launcher's own SIGTERM path with ``--drain-mode migrate``.

    python -m sglang_disagg.launch drain --port P [--host H] [--router URL] [--member-url URL]
                                         [--to URL ...] [--timeout S] [--secret-file FILE]

In order: the targets are the decoders named with ``--to``, else the router's other healthy
decoders, least loaded first (membership.py); the router stops sending this decoder anything
(its worker list drops it; its streams go on); the decoder's drain door (``POST /drain`` on its
messenger metrics port, messenger/migration/drain.py) migrates every running request; this
waits until the door reports nothing left running or migrating, printing progress, for at most
``--timeout`` seconds. What is still running then (a request in a state that cannot move, a
target that refused) finishes on this decoder: a launcher stopping on SIGTERM waits for it
within ``--drain-timeout``, as without migration. Relayed streams outlive the drain on this
decoder's HTTP front end until they end (docs/launcher.md).

Exit status: 0 drained (nothing runs here but relays), 1 something still runs here at the
deadline or the drain could not start, 2 bad arguments or no secret.
"""

from __future__ import annotations

import json
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

from sglang_disagg.launch.client import headers
from sglang_disagg.launch.membership import Membership, MembershipError, normal

POLL_S = 0.2
# A door that does not answer for a moment is not a door saying "done" or "nothing relayed":
# only this long without an answer ends a drain's progress poll or a stop's wait for relays
# (a process that exited ends them at once: Stack.stop sees it).
UNREACHABLE_S = 10.0
# How long a stopping decoder's front end may keep relaying migrated streams after --drain-timeout
# (they hold no KV here; a Kubernetes pod's termination grace covers it: render_k8s.py).
RELAYS_MAX_S = 600.0
Say = Callable[[str], None]


class DrainFailed(RuntimeError):
    """The drain could not start (no target, the door refused), with the reason."""


@dataclass(frozen=True, slots=True)
class DrainTarget:
    """Where a decoder is reached: its serving URL as the router names it, its drain door."""

    url: str         # http://host:port, as the router lists the decoder
    door: str        # http://host:metrics_port/drain

    @classmethod
    def local(cls, host: str, port: int, member_url: str | None = None) -> DrainTarget:
        """The decoder a launcher started with ``--port port`` (config.Ports: decode = port+2,
        its messenger metrics port = port+9)."""
        from sglang_disagg.launch.config import Ports

        p = Ports(port)
        return cls(normal(member_url or f"http://{host}:{p.decode}"), f"http://{host}:{p.decode_metrics}/drain")


def _door(method: str, url: str, key: str, body: dict | None = None) -> dict:
    req = urllib.request.Request(url, method=method, headers=headers(key),
                                 data=json.dumps(body).encode() if body is not None else None)
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return json.loads(r.read(1 << 16))
    except urllib.error.HTTPError as e:
        raise DrainFailed(f"{method} {url}: HTTP {e.code}: {e.read(500).decode(errors='replace')}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise DrainFailed(f"{method} {url}: {getattr(e, 'reason', e)}") from None


def drain(target: DrainTarget, admin_key: str, *, router: str | None = None, to: tuple[str, ...] = (),
          timeout_s: float = 60.0, say: Say = print, tls: ssl.SSLContext | None = None) -> dict:
    """Drains `target`; returns the door's last status (``done`` says whether it drained)."""
    members = Membership(router, admin_key, tls) if router else None
    targets = tuple(normal(u) for u in to)
    try:
        if not targets and members is not None:
            targets = tuple(m.url for m in members.others(target.url))
        if not targets:
            raise DrainFailed("no other decoder to migrate to: name them with --to, or --router lists none "
                              "healthy besides this one")
        if members is not None and members.leave(target.url):
            say(f"the router at {router} sends {target.url} nothing new")
    except MembershipError as e:
        raise DrainFailed(str(e)) from None
    _door("POST", target.door, admin_key, {"to": list(targets)})
    say(f"draining {target.url}: running requests move to {', '.join(targets)}")
    deadline = time.monotonic() + timeout_s
    last, poll = None, _Poll(target, admin_key)
    while True:
        status = poll()
        shown = {k: status.get(k) for k in ("running", "migrating", "migrated", "failed", "refused", "relaying",
                                            "waiting")}
        if shown != last and "running" in status:  # the scheduler publishes from its next iteration
            say("drain: " + ", ".join(f"{k} {v}" for k, v in shown.items()))
            last = shown
        if status.get("done") or time.monotonic() > deadline:
            return status
        time.sleep(POLL_S)


class _Poll:
    """GET of the door that rides out a short silence: the last answer (`first` before any)
    while it has not answered for less than UNREACHABLE_S, DrainFailed past that."""

    def __init__(self, target: DrainTarget, admin_key: str, first: dict | None = None) -> None:
        self.target, self.key, self.last, self.silent_since = target, admin_key, first or {}, 0.0

    def __call__(self) -> dict:
        try:
            self.last = _door("GET", self.target.door, self.key)
        except DrainFailed:
            now = time.monotonic()
            self.silent_since = self.silent_since or now
            if now - self.silent_since >= UNREACHABLE_S:
                raise
            return self.last
        self.silent_since = 0.0
        return self.last


def relaying(target: DrainTarget, admin_key: str) -> Callable[[], bool]:
    """What tells Stack.stop whether the drained decoder still relays migrated streams (and
    runs nothing else); a door silent for less than UNREACHABLE_S says yes."""
    poll = _Poll(target, admin_key, first={"relaying": 1})

    def still() -> bool:
        try:
            status = poll()
        except DrainFailed:
            return False
        return bool(status.get("relaying")) and not status.get("running") and not status.get("waiting")
    return still


def main(argv: list[str]) -> int:
    import argparse
    import sys

    from sglang_disagg.launch import keys

    ap = argparse.ArgumentParser(prog="python -m sglang_disagg.launch drain",
                                 description="Migrate every running request of a decoder to the others.")
    ap.add_argument("--port", type=int, required=True, help="the decoder launcher's --port")
    ap.add_argument("--host", default="127.0.0.1", help="the decoder launcher's --host")
    ap.add_argument("--router", default=None, help="the deployment's router URL (its worker list)")
    ap.add_argument("--member-url", default=None, help="the decoder's URL as the router lists it")
    ap.add_argument("--to", nargs="+", default=(), help="target decoder URLs (default: the router's others)")
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--secret-file", default=None)
    args = ap.parse_args(argv)
    try:
        key = keys.from_secret(args.secret_file).admin
        target = DrainTarget.local(args.host, args.port, args.member_url)
        status = drain(target, key, router=args.router, to=tuple(args.to), timeout_s=args.timeout,
                       say=lambda s: print(s, flush=True))
    except (keys.KeysError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except DrainFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if not status.get("done"):
        print(f"drain: {status.get('running', '?')} request(s) still run here after {args.timeout:g}s",
              file=sys.stderr)
        return 1
    return 0
