"""How the libfabric backend replaces an endpoint that is of no use any more (a mixin of it).

The cause: stuck (a thread has been inside the provider, holding the endpoint, for
SHIM_STUCK_MS). Then writes are refused with the reason, the pending batches fail with it, peers
are closed (they reconnect and learn the new address from a fresh HELLO), the old endpoint is
closed, memory is registered again on a new one under the same region ids, and a new poller
starts. An endpoint that cannot be closed (a thread stuck inside) is abandoned: never freed, one
error line in the log.
Stuck is found by the next call into the shim (it waits SHIM_STUCK_MS at most), or, when nobody
calls in (a poller stuck inside fi_cq_read while the writers wait on their futures), by a
watchdog thread that asks the shim ten times a second without waiting (shim_check).

Contract with the backend: `_eps` (one endpoint per rail; a stuck rail replaces them all),
`_stop`, `_ep_lock` (held for the whole swap, never longer than the shim's bound on a stuck
endpoint), `_fins` (each endpoint's finalizer), and `_open_endpoints` / `_start_poller` /
`_join_pollers` / `_register_all`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Any

from .native import ESTUCK, EndpointStuck, ffi, lib, stuck_text
from .registration import carried_by
from ...threads import Thread as NamedThread

log = logging.getLogger("sglang_disagg.backends.libfabric.backend")
# A stuck endpoint is declared after SHIM_STUCK_MS (2 s) without progress; looking 4 times a
# second finds it within an eighth of that, without waking an idle server 10 times a second.
_WATCH_S = 0.25


class Healing:
    def _init_healing(self) -> None:
        self._heal_lock = threading.Lock()
        self._healing = self._stuck = False
        self._poisoned = ""
        self.endpoints_replaced = self.endpoints_abandoned = 0
        self._watch_stop = threading.Event()

    def _start_watchdog(self) -> None:
        self._watchdog = NamedThread(target=self._watch_loop, name="libfabric-watchdog", daemon=True)
        self._watchdog.start()

    def _stop_watchdog(self) -> None:
        self._watch_stop.set()
        if threading.current_thread() is not self._watchdog:
            self._watchdog.join(timeout=1.0)

    def _watch_loop(self) -> None:
        while not self._watch_stop.wait(_WATCH_S):
            if self._shim_closed:
                continue
            for ep in self._eps:
                if lib.shim_check(ep) == -ESTUCK:
                    self._on_stuck(ep, stuck_text())
                    break
            try:
                self._rail_tick()  # railwatch.py: a stalled rail, a down rail's probe
            except Exception:  # noqa: BLE001 - the watchdog must outlive a bug there
                log.exception("libfabric: watching the rails failed")

    @staticmethod
    def _key(ep: Any) -> int:
        return int(ffi.cast("uintptr_t", ep))

    def _release(self, ep: Any) -> None:
        """Close `ep`; one that a thread is stuck inside cannot be closed: abandon (leak) it."""
        fin = self._fins.pop(self._key(ep), None)
        if lib.shim_close(ep) == 0:
            return
        if fin is not None:
            fin.detach()  # freeing it would pull the struct from under the stuck thread
        self.endpoints_abandoned += 1
        log.error("libfabric %s: abandoning an endpoint that cannot be closed (%s); its memory and the thread "
                  "stuck in it stay until the process exits", self.provider, self._poisoned or stuck_text())

    def _on_stuck(self, ep: Any, why: str) -> None:
        """`ep` is stuck inside the provider (EndpointStuck): poison the backend and replace it.
        Not for an endpoint replaced already (a thread that still held the old one)."""
        if any(ep is e for e in self._eps):
            self._stuck = True
            why = why[why.find("endpoint stuck: "):] if "endpoint stuck: " in why else f"endpoint stuck: {why}"
            self._poison(f"{self.fi_info['prov']} {why}; the endpoint is being replaced")

    @contextlib.contextmanager
    def _stuck_on(self, ep: Any) -> Iterator[None]:
        """Shim calls on `ep` inside: EndpointStuck starts the replacement, and goes on up."""
        try:
            yield
        except EndpointStuck as e:
            self._on_stuck(ep, str(e))
            raise

    def _poison(self, why: str) -> None:
        """Refuse writes with `why` and replace the endpoint (once at a time)."""
        with self._heal_lock:
            self._poisoned = why
            if self._healing or self._closed:
                return
            self._healing = True
        NamedThread(target=self._replace_endpoint, name="libfabric-replace", daemon=True).start()

    def _replace_endpoint(self) -> None:
        replaced = False
        with self._ep_lock:
            try:
                log.warning("libfabric: replacing the endpoint: %s", self._poisoned)
                with self._lock:
                    pending = list(self._batches)
                for batch_id in pending:  # their writes went with the old endpoint: say why
                    self._book.forget(batch_id)
                    self._complete_batch(batch_id, f"libfabric: {self._poisoned}", lost=True)
                for peer in self.peers():
                    peer.close()
                self._stop.set()
                self._join_pollers(0.2 if self._stuck else 2.0)  # a stuck one never returns
                for old in self._eps:
                    self._release(old)
                if self._closed:  # closed meanwhile: nothing to replace it for
                    self._shim_closed = True
                    return
                new_eps = self._open_endpoints()
                with self._lock:
                    regions = list(self._regions.values())
                fresh = {r.id: (r, self._register_all(new_eps, r.addr, r.length, r.memory, carried_by(reg)))
                         for r, reg in regions}
                with self._lock:
                    self._regions.update(fresh)
                    self._eps = new_eps
                with self._heal_lock:
                    self._poisoned, self._stuck = "", False
                self._start_poller()
                self.endpoints_replaced += 1
                replaced = True
            except Exception:  # noqa: BLE001 - the backend stays poisoned and says why on every write
                log.exception("libfabric: replacing the endpoint failed")
            finally:
                with self._heal_lock:
                    self._healing = False
                    again = replaced and bool(self._poisoned) and not self._closed
        if again:  # the new endpoint was poisoned while we finished: replace that one too
            self._poison(self._poisoned)
