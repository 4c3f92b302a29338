"""Draining a decoder: every running request migrates to the other decoders named, so this one
holds nothing within seconds instead of waiting for its longest stream to end.

``POST /drain`` on the decoder's messenger metrics port (``--port``+9; SGLang's own HTTP front end
is untouched), with the deployment's admin key (``Authorization: Bearer KEY``, compared in
constant time; a decoder configured without one refuses every drain), body
``{"to": ["http://decoder-b:port", ...]}``: the decoders to move requests to (the caller, e.g.
the router node's launcher, knows them). ``GET /drain`` (same key) reports progress: running,
waiting (no output token yet), migrating, migrated, failed, refused, relaying, and whether it is
done. Each running request with at least one output token migrates to the target with the
fewest migrations from here in flight, at most MAX_IN_FLIGHT at once (a drain must not starve
the decoders' own traffic); a request in a state that cannot move yet stays and finishes here
(`refused` counts it). A waiting request (its KV still arriving, or queued for its first step)
and one arriving while draining migrate after their first token (not handed over as new
requests: their KV is here or on its way). Telling the router to stop sending is the caller's
(its worker list).

Threads: the HTTP thread only validates and posts the request (under the lock) and reads the
status the scheduler thread publishes; the scheduler thread does everything else (away.py).
"""

from __future__ import annotations

import hmac
import json
import threading
import urllib.parse
from typing import Any

MAX_TARGETS = 64
MAX_BODY = 16 << 10
MAX_IN_FLIGHT = 4


class DrainError(ValueError):
    """A drain request that is not valid, with the reason."""


def targets_of(body: bytes) -> tuple[str, ...]:
    """The target URLs of a POST /drain body (untrusted)."""
    try:
        obj = json.loads(body or b"{}")
    except ValueError as e:
        raise DrainError(f"the body is not JSON: {e}") from None
    to = obj.get("to") if isinstance(obj, dict) else None
    if not isinstance(to, list) or not to or len(to) > MAX_TARGETS:
        raise DrainError(f'"to" must list 1 to {MAX_TARGETS} decoder URLs')
    out = []
    for url in to:
        u = urllib.parse.urlsplit(url) if isinstance(url, str) and len(url) < 512 else None
        if u is None or u.scheme != "http" or not u.hostname or u.path not in ("", "/"):
            raise DrainError(f"not a decoder URL (http://host:port): {str(url)[:80]!r}")
        out.append(f"http://{u.netloc}")
    return tuple(dict.fromkeys(out))


class DrainDoor:
    """The HTTP side: key check, the posted targets, the published status."""

    def __init__(self, admin_key: str | None, wake: Any) -> None:
        self._key, self._wake = admin_key or "", wake
        self._lock = threading.Lock()
        self._asked: tuple[str, ...] | None = None
        self.status: dict = {"draining": False}

    def take(self) -> tuple[str, ...] | None:
        """(scheduler thread) Targets posted since the last look, or None."""
        with self._lock:
            asked, self._asked = self._asked, None
            return asked

    def publish(self, status: dict) -> None:
        with self._lock:
            self.status = status

    def __call__(self, environ: dict) -> tuple[str, dict]:
        """WSGI-ish: (HTTP status, JSON body) for /drain."""
        if not self._key:
            return "403 Forbidden", {"error": "this decoder has no admin key configured: it cannot be drained"}
        given = environ.get("HTTP_AUTHORIZATION", "").removeprefix("Bearer ").encode()
        if not hmac.compare_digest(given, self._key.encode()):
            return "401 Unauthorized", {"error": "the admin key is required"}
        if environ.get("REQUEST_METHOD") == "GET":
            with self._lock:
                return "200 OK", dict(self.status)
        if environ.get("REQUEST_METHOD") != "POST":
            return "405 Method Not Allowed", {"error": "GET or POST"}
        try:
            n = int(environ.get("CONTENT_LENGTH") or 0)
            if not 0 <= n <= MAX_BODY:
                raise DrainError(f"a body of at most {MAX_BODY} bytes")
            targets = targets_of(environ["wsgi.input"].read(n))
        except (DrainError, ValueError) as e:
            return "400 Bad Request", {"error": str(e)}
        with self._lock:
            self._asked = targets
            self.status = {**self.status, "draining": True, "to": list(targets)}
        self._wake()
        return "202 Accepted", {"draining": True, "to": list(targets)}
