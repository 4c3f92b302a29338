"""The leader's control thread: reads every peer's control messages from the transfer backend
and hands the decoded ones on. One peer's message costs at most that peer's connection, never
the thread.

Peers prove the deployment's secret, but a reader that dies on one message leaves a server that
heartbeats (another thread) keep looking alive while it hears nothing more: no Hello, order or
cancel from anyone. So each message is taken under one rule:

- one that does not decode (wire.WireError: not JSON, nested too deep, a field of the wrong type
  or past its bound) had no effect: it is dropped with the reason and the connection stays
  (tests/e2e/test_fuzz.py holds this). First contact between builds of different wire versions
  still ends in a clear refusal (`across_versions`);
- anything else raised while decoding it (what the bounds rule out today, e.g. RecursionError
  out of json, should a future path let it through) drops that peer's connection;
- a handler that raises (a bug on our side, or a check we lack) is logged and the connection
  stays, as it always did: closing a link fails every request it carries, which a bug in one
  message's handling must not turn into.

Both are logged at most once every LOG_EVERY_S per kind, with the count of those in between:
a peer that repeats itself must not flood the log.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from .. import untrusted
from ..ratelog import RateLog
from ..backends import DeadlineExceeded
from ..threads import Thread as NamedThread
from . import wire

logger = logging.getLogger("sglang_disagg.messenger")
LOG_EVERY_S = 5.0

# (peer, the raw message, the message) -> None; may raise: the reader drops that peer then.
Dispatch = Callable[[Any, bytes, wire.Message], None]


class ControlReader:
    def __init__(self, backend: Any, dispatch: Dispatch, name: str, stop: threading.Event | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.backend, self.dispatch, self.name = backend, dispatch, name
        self.stop = stop or threading.Event()
        self.log = Throttled(LOG_EVERY_S, clock)
        self.dropped = 0  # connections dropped for what their messages did
        self.failed = 0   # messages whose handling raised
        self._thread = NamedThread(target=self._loop, name="messenger-control", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout: float) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _loop(self) -> None:
        while not self.stop.is_set():
            try:
                peer, raw = self.backend.recv(0.5)
            except DeadlineExceeded:
                continue
            except Exception:  # noqa: BLE001 - the backend is closed (or the DP owner gone): nothing more comes
                return
            self.take(peer, raw)

    def take(self, peer: Any, raw: bytes) -> None:
        """One message of `peer`; raises nothing."""
        try:
            try:
                msg = wire.decode(raw)
            except wire.WireError as e:
                msg = self.across_versions(peer, raw, e)
                if msg is None:
                    return
        except Exception as e:  # noqa: BLE001 - one peer's message must not stop the reader
            self.drop(peer, e)
            return
        try:
            self.dispatch(peer, raw, msg)
        except Exception as e:  # noqa: BLE001 - logged; the connection and the thread go on
            # Logged before counted: whoever sees the count (a scrape, a test) then finds the line.
            self.log.warn("handler", "messenger: handling %s from %s failed: %s: %s", type(msg).__name__,
                          getattr(peer, "address", "?"), type(e).__name__, str(e)[:200], exc_info=e)
            self.failed += 1

    def drop(self, peer: Any, error: BaseException) -> None:
        """Close `peer`'s connection for what its message did (its loss fails what it held)."""
        self.log.warn("dropped", "messenger: closed the connection of %s: its message raised %s: %s",
                      getattr(peer, "address", "?"), type(error).__name__, str(error)[:200],
                      exc_info=error)
        self.dropped += 1  # after the line, as in take()
        with contextlib.suppress(Exception):
            peer.close()

    def across_versions(self, peer: Any, raw: bytes, error: wire.WireError) -> wire.Message | None:
        """A message `wire.decode` refused. First contact between builds of different wire versions
        still ends in a clear refusal on both sides: a Hello we cannot read is refused with the
        reason, and a Refuse we cannot read is still a refusal (its reason is plain text in any
        version). Anything else is dropped with the reason logged."""
        try:
            obj = untrusted.loads(raw, wire.MAX_MESSAGE_BYTES)
        except untrusted.MalformedJSON:
            obj = None
        kind = obj.get("type") if isinstance(obj, dict) else None
        if kind == wire.Hello.TYPE:
            self.log.warn("hello", "messenger: refused a Hello from %s: %s", peer.address, error)
            with contextlib.suppress(Exception):
                peer.send(wire.encode(wire.Refuse(prefill=self.name, reason=str(error))))
        elif kind == wire.Refuse.TYPE and isinstance(obj.get("reason"), str):
            return wire.Refuse(prefill=str(obj.get("prefill", "?"))[:200], reason=obj["reason"][:2000])
        else:
            self.log.warn("bad", "messenger: bad control message from %s: %s", peer.address, str(error)[:500])
        return None


class Throttled(RateLog):
    """The reader's rate-bounded warnings (ratelog.py), on the messenger's logger."""

    def __init__(self, every_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(every_s, logger, clock, suffix=" (and {n} more like it in the last {every:.0f} s)")
