"""The deployment's membership: which decoders serve it, read from and written to its router.

One process owns the list of a deployment's decoders: the router (smg), whose worker list the
router node's launcher fills (``--decode-url``, or ``POST /workers`` for ``--role all``) and a
decoder started with ``--router URL`` joins and leaves itself. Draining a decoder asks it for
the other decoders (the migration targets, least loaded first) and removes the drained one, so
the router sends it nothing new while its streams are still relayed (smg keeps a removed
worker's in-flight streams: measured with smg 1.13, after ``DELETE /workers/{id}`` the worker is
listed at once as ``status: draining, is_healthy: false`` while a 1500-token stream through it
ran to its end, and a new request was answered 503 with no other worker left).
Every call takes the admin key (smg's control plane, keys.py). Prefill servers are not on this
list in messenger mode (decoders find them through ``--prefill-messenger``); the elastic issue
adds roles.

Data in, data out: ``members()`` parses an untrusted reply into frozen ``Member`` records,
bounded in size and count; nothing here decides what to drain.
"""

from __future__ import annotations

import enum
import json
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

from sglang_disagg.launch.client import headers

MAX_WORKERS = 1024
MAX_REPLY = 4 << 20   # bytes of a /workers reply read at most
TIMEOUT_S = 5.0


class MembershipError(RuntimeError):
    """The router could not be asked or did not do what it was asked, with the reason (and
    the router's HTTP status, when it answered one)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class MemberRole(enum.Enum):
    DECODE = "decode"    # smg "regular" workers in messenger mode, "decode" in PD mode
    PREFILL = "prefill"


@dataclass(frozen=True, slots=True)
class Member:
    url: str
    worker_id: str
    role: MemberRole
    healthy: bool
    running: int     # the engine's running + waiting requests, as smg last saw them (its load poll)
    leaving: bool = False  # removed, listed until its in-flight streams end (smg: status "draining")

    @classmethod
    def of(cls, w: object) -> Member | None:
        """One entry of smg's worker list (untrusted JSON), or None when it is not one."""
        if not isinstance(w, dict) or not isinstance(w.get("url"), str) or not isinstance(w.get("id"), str):
            return None
        role = MemberRole.PREFILL if w.get("worker_type") == "prefill" else MemberRole.DECODE
        loads = (w.get("engine_load") or {}).get("loads") if isinstance(w.get("engine_load"), dict) else None
        running = 0
        for x in loads if isinstance(loads, list) else []:
            if isinstance(x, dict):
                running += sum(int(x.get(k) or 0) for k in ("num_running_reqs", "num_waiting_reqs")
                               if isinstance(x.get(k), int))
        healthy = w.get("is_healthy") is True and w.get("status", "ready") == "ready"
        return cls(normal(w["url"]), w["id"][:64], role, healthy, running, w.get("status") == "draining")


def normal(url: str) -> str:
    """http://host:port, as the router names a worker (no path, no trailing slash)."""
    u = urllib.parse.urlsplit(url.strip())
    if u.scheme not in ("http", "https") or not u.hostname or u.port is None:
        raise ValueError(f"not a worker URL (http://host:port): {url[:120]!r}")
    return f"{u.scheme}://{u.netloc}"


class Membership:
    """The router's worker list, through its admin API."""

    def __init__(self, router_url: str, admin_key: str, tls: ssl.SSLContext | None = None) -> None:
        self.router = router_url.rstrip("/")
        self.key, self.tls = admin_key, tls

    def _call(self, method: str, path: str, body: dict | None = None) -> bytes:
        req = urllib.request.Request(self.router + path, method=method, headers=headers(self.key),
                                     data=json.dumps(body).encode() if body is not None else None)
        try:
            with urllib.request.urlopen(req, timeout=TIMEOUT_S, context=self.tls) as r:
                return r.read(MAX_REPLY + 1)
        except urllib.error.HTTPError as e:
            raise MembershipError(f"{method} {self.router}{path}: HTTP {e.code}: "
                                  f"{e.read(500).decode(errors='replace')}", e.code) from None
        except (urllib.error.URLError, OSError) as e:
            raise MembershipError(f"{method} {self.router}{path}: {getattr(e, 'reason', e)}") from None

    def members(self) -> list[Member]:
        raw = self._call("GET", "/workers")
        if len(raw) > MAX_REPLY:
            raise MembershipError(f"the router's worker list is over {MAX_REPLY} bytes")
        try:
            workers = json.loads(raw).get("workers")
        except (ValueError, AttributeError):
            raise MembershipError("the router's worker list is not JSON with a \"workers\" list") from None
        if not isinstance(workers, list) or len(workers) > MAX_WORKERS:
            raise MembershipError(f"the router's worker list is not a list of at most {MAX_WORKERS} workers")
        return [m for m in map(Member.of, workers) if m is not None]

    def find(self, url: str) -> Member | None:
        url = normal(url)
        return next((m for m in self.members() if m.url == url), None)

    def others(self, url: str) -> list[Member]:
        """The healthy decoders other than `url`, least loaded first (the drain's targets)."""
        url = normal(url)
        return sorted((m for m in self.members() if m.role is MemberRole.DECODE and m.healthy and m.url != url),
                      key=lambda m: (m.running, m.url))

    def join(self, url: str, api_key: str = "", wait_s: float = 30.0) -> bool:
        """Adds decoder `url` to the router unless it is listed, and waits until the router
        routes to it (smg adds a worker in the background and checks its health first); True
        when it was added. A worker's API key goes in the body (smg presents it to that worker
        only, keys.py)."""
        if self.find(url) is not None:
            return False
        try:
            self._call("POST", "/workers", {"url": normal(url)} | ({"api_key": api_key} if api_key else {}))
            added = True
        except MembershipError as e:
            # 409: the router is adding this URL already (named on its command line too, as a
            # rendered deployment does, and not listed until its first health check passed)
            if e.status != 409:
                raise
            added = False
        self._until(url, True, wait_s, f"the router took {normal(url)} but does not route to it after {wait_s:g}s")
        return added

    def leave(self, url: str, wait_s: float = TIMEOUT_S) -> bool:
        """Removes decoder `url` from the router (its in-flight streams go on) and waits until
        the router routes nothing new to it: smg queues a removal, marks the worker draining
        (not healthy) and lists it until its streams end. False when it was not listed."""
        m = self.find(url)
        if m is None or m.leaving:  # a preStop hook's drain, then the launcher's own on SIGTERM
            return False
        self._call("DELETE", "/workers/" + urllib.parse.quote(m.worker_id, safe=""))
        self._until(url, False, wait_s, f"the router still routes to {m.url} {wait_s:g}s after removing it")
        return True

    def _until(self, url: str, routed: bool, wait_s: float, why: str) -> None:
        """Polls the list until the router routes to `url` (listed and healthy) or does not."""
        deadline = time.monotonic() + wait_s
        while ((now := self.find(url)) is not None and now.healthy) is not routed:
            if time.monotonic() > deadline:
                raise MembershipError(why)
            time.sleep(0.05)
