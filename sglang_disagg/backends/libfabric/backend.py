"""libfabric backend: RDM endpoint, fi_writedata with the tag as remote CQ data.

The provider comes from BackendConfig.provider: "tcp" (tcp;ofi_rxm, the default) here,
"efa" / "verbs" (verbs;ofi_rxm) in production, all on this code path. libfabric's "shm" is
refused (SHM_REFUSED in __init__.py says why): on one host the shmem backend moves the pages.
Memory-registration modes are handled in the shim: FI_MR_VIRT_ADDR (descriptor base = virtual
address, else offsets), FI_MR_PROV_KEY (provider-chosen keys travel in the descriptor),
FI_MR_LOCAL (local descriptors passed on every write), FI_MR_ENDPOINT, FI_RX_CQ_DATA (posted
receives).

Memory kinds: host memory registers with fi_mr_regattr(FI_HMEM_SYSTEM); CUDA memory with
FI_HMEM_CUDA and its device, on an endpoint opened with FI_HMEM (+FI_MR_HMEM). A provider
"offers" CUDA when such a registration succeeds, not when fi_info lists FI_HMEM (Debian's
1.17 lists it without CUDA support); otherwise register() raises UnsupportedMemory
naming the provider and libfabric's error, i.e. the messenger refuses at start-up. Host-only
endpoints keep FI_HMEM off (a provider may answer it with other attributes); the first CUDA
registration, before any other region or peer, reopens with it (options hmem=True: from the start).

Stuck endpoints: a thread that never comes back out of the provider would hold the endpoint for
good. No shim call but the poller's waits for it longer than SHIM_STUCK_MS: then EndpointStuck,
and the backend is poisoned and replaces the endpoint (healing.py); an endpoint that cannot be
closed is abandoned (leaked, logged).

Rails (rails.py): with `BackendConfig.rails` the backend opens one endpoint per interface, each
with its own poller; rail 0 is `_ep`. A stuck rail poisons the whole backend and every rail is
replaced together (peers reconnect and learn every new address from a fresh HELLO).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

from ..base import TransferBackend
from ..errors import BackendUnavailable, DescriptorError, PeerLostError, TransferError
from ..peers import Peer
from ..regions import MemoryRegion, PageWrite, PeerState, RemoteRegion
from . import SHM_REFUSED, SHM_WHY
from . import rails as railmod
from .healing import Healing
from .native import PROVIDERS, ESTUCK, EndpointStuck, address_of, endpoint_info, ffi, lib, stuck_text
from ...rails.choose import interface_names
from ...rails.numa import place_thread
from .railwatch import RailWatch
from .registration import Registration
from .native import Errbuf as _Errbuf
from .native import check as _check
from .native import need_shim as _need_shim
from ...threads import Thread as NamedThread

_EVENTS = 256
# How long one shim_poll call may wait when nothing happens. An idle endpoint sleeps in the
# kernel inside it (the CQ's wait fd; a post or close wakes it), so this only bounds how
# often the thread retakes the GIL to look at `stop`: rarely, so it never competes with
# the scheduler for the GIL between decode steps.
_POLL_US = 250_000
_EV_BATCH, _EV_IMM, _EV_ASYNC, _EV_TAG_FAILED = 1, 2, 3, 4
log = logging.getLogger(__name__)


class LibfabricBackend(RailWatch, Registration, Healing, TransferBackend):
    name = "libfabric"

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        if lib is None:
            try:
                _need_shim()
            except BackendUnavailable as e:
                return False, str(e)
        found, missing = [], []
        for label in ("tcp", "efa", "verbs"):
            ep = ffi.new("shim_ep **")
            err = _Errbuf()
            # a node: the TCP providers otherwise bind to eth0 (FI_SOURCE)
            if lib.shim_open(PROVIDERS[label].encode(), b"127.0.0.1", 0, ep, err.buf, 256):
                missing.append(f"{label} ({err})")
            else:
                found.append(label)
                lib.shim_free(ep[0])
        not_offered = f"; not offered: shm ({SHM_WHY})"
        if not found:
            return False, "no provider: " + "; ".join(missing) + not_offered
        return True, ("providers: " + ", ".join(found) + ("; absent: " + ", ".join(m.split(" ")[0] for m in missing)
                                                          if missing else "") + not_offered)

    def _provider_label(self) -> str:
        label = self.config.provider or "tcp"
        if label == "shm":
            raise TransferError(SHM_REFUSED)
        if label not in PROVIDERS:
            raise TransferError(f"libfabric provider {label!r} unknown; choose from {', '.join(PROVIDERS)}")
        return label

    def _native_open(self) -> None:
        _need_shim()
        # hmem=True: open with FI_HMEM from the start; otherwise the first device-memory
        # registration reopens the endpoint with it (host-only endpoints keep today's attributes).
        self._hmem = self.config.options.get("hmem", False)
        if not isinstance(self._hmem, bool):
            raise TransferError(f"libfabric option hmem must be a bool, got {self._hmem!r}")
        self._fins: dict[int, weakref.finalize] = {}
        self._init_healing()
        self._nets = railmod.parse(self.config.rails)
        self._init_rails(max(1, len(self._nets)))
        self._asked = threading.local()  # register_on_rails(rails=...) -> _native_register, per thread
        self._near: dict[int, tuple[int, ...] | None] = {}  # CUDA device -> its nearest rails (read once)
        self._eps = self._open_endpoints()
        self._pollers: list[NamedThread] = []
        self._shim_closed = False
        self._ep_lock = threading.RLock()  # registration vs. replacing the endpoint
        self._read_info()
        self._stop = threading.Event()
        self._async_error = ""
        self._async_errors = 0
        self._stale_addrs = 0
        self._start_poller()
        self._start_watchdog()

    @property
    def _ep(self) -> Any:
        """Rail 0's endpoint (the only one without rails): what fi_info and tests read."""
        return self._eps[0]

    @property
    def _poller(self) -> NamedThread:
        return self._pollers[0]

    def _read_info(self) -> None:
        self.fi_info = endpoint_info(self._ep)
        self.max_write_bytes = min([type(self).max_write_bytes] + [endpoint_info(e)["max_msg_size"] for e in self._eps])

    def _open_endpoints(self, hmem: bool | None = None) -> list[Any]:
        """One endpoint per rail (none configured: one on the control host); all or none."""
        eps: list[Any] = []
        try:
            for node in [str(n.ip) for n in self._nets] or [self.config.host]:
                eps.append(self._open_endpoint(hmem, node))
        except BaseException:
            for ep in eps:
                self._release(ep)
            raise
        return eps

    def _open_endpoint(self, hmem: bool | None = None, node: str | None = None) -> Any:
        ep, err = ffi.new("shim_ep **"), _Errbuf()
        hmem = self._hmem if hmem is None else hmem
        # FI_SOURCE: the TCP providers otherwise bind to eth0; a rail binds to its interface's address
        where = node or self.config.host
        if lib.shim_open(PROVIDERS[self.provider].encode(), where.encode(), int(hmem), ep, err.buf, 256):
            raise BackendUnavailable(f"libfabric provider {PROVIDERS[self.provider]} unusable"
                                     f"{' with FI_HMEM' if hmem else ''}"
                                     f"{f' on rail {where}' if self._nets else ''}: {err}")
        # The struct outlives shim_close (a thread still calling in gets -FI_ESHUTDOWN, not
        # freed memory); it is freed once this backend is unreachable, i.e. no thread of ours
        # can call in any more.
        fin = weakref.finalize(self, lib.shim_free, ep[0])
        fin.atexit = False  # at exit daemon threads may still call in: leak instead
        self._fins[self._key(ep[0])] = fin
        return ep[0]

    def _start_poller(self) -> None:
        """One progress thread per rail, all stopped by one event (replaced together); with
        rails, each placed on its NIC's NUMA node where the host says (rails/numa.py)."""
        self._stop = threading.Event()
        names = interface_names([str(n) for n in self._nets]) if len(self._nets) > 1 else []
        self._pollers = [NamedThread(target=self._poll_loop, args=(ep, self._stop, names[i] if names else ""),
                                     daemon=True, name="libfabric-progress" + (f"-r{i}" if i else ""))
                         for i, ep in enumerate(self._eps)]
        for t in self._pollers:
            t.start()

    def _join_pollers(self, timeout_s: float) -> None:
        for t in self._pollers:
            if threading.current_thread() is not t:
                t.join(timeout=timeout_s)

    def _endpoint_info(self) -> dict[str, Any]:
        return railmod.hello([address_of(ep) for ep in self._eps], self._nets)

    def _native_connect(self, peer: Peer) -> None:
        primary, theirs = railmod.peer_rails(peer.endpoint)
        targets = railmod.pairing(self._nets, theirs)
        # The shim checks each address against our provider's format (length, terminator,
        # family) before fi_av_insert reads it: the hello comes from the network.
        out, err = ffi.new("uint64_t *"), _Errbuf()
        routes = []
        # a peer connecting while the endpoint is replaced joins the new one
        with self._ep_lock:
            try:
                for i, reach in enumerate(targets):
                    for j in reach:  # the paired rail first: with equal weights it is the one taken
                        raw = theirs[j].address if theirs and self._nets else primary
                        with self._stuck_on(ep := self._eps[i]):
                            _check(lib.shim_av_insert(ep, raw, len(raw), out, err.buf, 256), err, "fi_av_insert")
                        routes.append(railmod.RailRoute(i, int(out[0]), j if theirs and self._nets else 0, raw))
            except BaseException:
                self._forget_routes(routes)
                raise
            peer.native = tuple(routes)

    def _native_disconnect(self, peer: Peer) -> None:
        self._book.forget_peer(peer.id)  # its batches fail with it: no rail of ours stalled
        if peer.native is None:
            return
        if self._shim_closed or self._healing:
            # The AV went (or goes) with the endpoint. While it is being replaced the old
            # poller may still be reading completions that name the address: leave it.
            peer.native = None
            return
        routes, peer.native = peer.native, None
        self._forget_routes(routes)

    def _forget_routes(self, routes: Sequence[railmod.RailRoute]) -> None:
        # In-flight writes to a lost peer complete (with an error) later: the shim frees them
        # when they do, or at close. While any are queued the address stays in the AV: their
        # completions may still name it.
        for r in routes:
            ep = self._eps[r.local]
            pending = lib.shim_abandon_peer(ep, r.fi_addr)
            if pending == -ESTUCK:  # return now: the caller fails the peer's futures next
                self._on_stuck(ep, stuck_text())
                return
            if pending:
                self._stale_addrs += 1
            else:
                err = _Errbuf()
                with contextlib.suppress(EndpointStuck), self._stuck_on(ep):  # it goes with the endpoint
                    _check(lib.shim_av_remove(ep, r.fi_addr, err.buf, 256), err, "fi_av_remove")

    def _check_remote(self, peer: Peer, d: Any) -> None:
        railmod.check_descriptor(d)

    def _handle(self, region: MemoryRegion, rail: int = 0) -> int:
        # Checked before posting, but deregister() may run in between (another thread).
        entry = self._regions.get(region.id)
        if entry is None:
            raise DescriptorError(f"source region {region.id} was deregistered")
        if entry[1].handle[rail] is None:  # the route was chosen among its carriers: a bug if reached
            raise DescriptorError(f"source region {region.id} is not registered on rail {rail}")
        return entry[1].handle[rail]

    def _arrays(self, writes: Sequence[PageWrite], route: railmod.RailRoute | None = None) -> tuple:
        rail, theirs = (route.local, route.remote) if route else (0, 0)
        keys = [railmod.remote_key(w.dst.descriptor, theirs) for w in writes]
        mr = ffi.new("uint64_t[]", [self._handle(w.src, rail) for w in writes])
        src = ffi.new("uint64_t[]", [w.src_offset for w in writes])
        raddr = ffi.new("uint64_t[]", [b + w.dst_offset for w, (b, _) in zip(writes, keys)])
        rkey = ffi.new("uint64_t[]", [k for _, k in keys])
        ln = ffi.new("uint64_t[]", [w.length for w in writes])
        return mr, src, raddr, rkey, ln

    def _route(self, peer: Peer, n: int, nbytes: int, src: Sequence[MemoryRegion],
               dst: Sequence[RemoteRegion]) -> railmod.RailRoute:
        """Among the routes from a rail carrying every `src` to a peer rail carrying every `dst`."""
        routes = peer.native  # None once the peer is dropped; the shim refuses dead ones too
        if routes is None:
            raise PeerLostError(f"peer {peer.address} is {peer.state.value}")
        ours = railmod.common([frozenset(self.carriers(r)) for r in src])
        theirs = railmod.common([railmod.carriers(d.descriptor) for d in dst])
        return self._book.pick(peer.id, routes, n, nbytes, ours, theirs)

    def _native_post(self, peer: Peer, batch_id: int, writes: Sequence[PageWrite], imm: int) -> None:
        route = self._route(peer, len(writes), sum(w.length for w in writes),
                            list({w.src.id: w.src for w in writes}.values()),
                            list({w.dst.descriptor.region: w.dst for w in writes}.values()))
        self._post_arrays(peer, route, batch_id, len(writes), self._arrays(writes, route), imm)

    def _post_arrays(self, peer: Peer, route: railmod.RailRoute, batch_id: int, n: int, arrays: tuple,
                     imm: int) -> None:
        if self._poisoned:
            raise TransferError(self._poisoned)
        ep, err = self._eps[route.local], _Errbuf()
        self._book.posted(batch_id, route.local, peer.id, time.monotonic())  # before: its completion may come at once
        ret = lib.shim_post(ep, batch_id, route.fi_addr, n, *arrays, imm, err.buf, 256)
        if ret:
            self._book.forget(batch_id)
        if ret == -ESTUCK:
            self._on_stuck(ep, str(err))
            raise EndpointStuck(f"libfabric post: {err}")
        if ret == -errno.ECONNRESET and peer.state is PeerState.CONNECTED:  # the provider saw it go
            self._lose_peer(peer, f"the transport reset its connection ({err})")
            raise PeerLostError(f"libfabric post to {peer.address}: {err}")
        if ret:
            if peer.state is not PeerState.CONNECTED:
                raise PeerLostError(f"libfabric post to {peer.address}: {err}")
            raise TransferError(f"libfabric post: {err}")

    def _native_post_uniform(self, peer: Peer, batch_id: int, src: MemoryRegion, src_offsets: Sequence[int],
                             dst: RemoteRegion, dst_offsets: Sequence[int], length: int, imm: int) -> None:
        n = len(src_offsets)
        route = self._route(peer, n, n * length, [src], [dst])
        base, key = railmod.remote_key(dst.descriptor, route.remote)
        arrays = (ffi.new("uint64_t[]", [self._handle(src, route.local)] * n), ffi.new("uint64_t[]", src_offsets),
                  ffi.new("uint64_t[]", [base + o for o in dst_offsets] if base else dst_offsets),
                  ffi.new("uint64_t[]", [key] * n), ffi.new("uint64_t[]", [length] * n))
        self._post_arrays(peer, route, batch_id, n, arrays, imm)

    def raw_c_loop(self, peer: Peer, writes: Sequence[PageWrite], imm: int, iters: int) -> tuple[int, list[int]]:
        """Benchmark hook: post+poll `iters` batches entirely in C. Returns (total ns, per-batch ns)."""
        from ..validate import check_write
        self._check_open()
        checked = [check_write(self._regions, peer.id, self.max_write_bytes, w, i) for i, w in enumerate(writes)]
        lat, err = ffi.new("int64_t[]", iters), _Errbuf()
        route = peer.native[0]  # rail 0 only: the benchmark measures one endpoint's loop
        ns = lib.shim_bench(self._eps[route.local], route.fi_addr, len(checked), *self._arrays(checked, route), imm,
                            iters, lat, err.buf, 256)
        if ns < 0:
            raise TransferError(f"libfabric raw loop: {err}")
        return int(ns), list(lat)

    def _poll_loop(self, ep: Any, stop: threading.Event, interface: str = "") -> None:
        if interface:
            try:
                cpus = place_thread(interface)
                if cpus is not None:
                    log.info("libfabric: rail %s's progress thread on CPUs %s (its NUMA node)", interface, sorted(cpus))
            except OSError as e:
                log.warning("libfabric: rail %s's progress thread left unplaced: %s", interface, e)
        events = ffi.new("shim_event[]", _EVENTS)
        while not stop.is_set():
            n = lib.shim_poll(ep, events, _EVENTS, _POLL_US)
            if n < 0:  # the endpoint was closed under us (close from a callback, or racing)
                return
            for i in range(n):
                # Whatever one event does (a user callback, a bug of ours), the thread must
                # survive it: it is the only one that completes this backend's transfers.
                try:
                    self._handle_event(events[i])
                except Exception as e:  # noqa: BLE001
                    log.exception("libfabric progress: handling event kind %d failed", events[i].kind)
                    if events[i].kind == _EV_BATCH:  # fail it rather than leave it pending
                        self._complete_batch(int(events[i].id), f"libfabric completion handling failed: {e!r}")

    def _handle_event(self, ev: Any) -> None:
        if ev.kind == _EV_BATCH:
            self._book.finished(int(ev.id), time.monotonic())
            msg = None if ev.status == 0 else f"{ffi.string(ev.msg).decode(errors='replace')} ({ev.count} writes failed)"
            self._complete_batch(int(ev.id), msg)
        elif ev.kind == _EV_IMM:
            self._tracker.add(int(ev.tag), int(ev.count))
        elif ev.kind == _EV_TAG_FAILED:
            # A write carrying this immediate failed on our side: its request cannot complete.
            text = ffi.string(ev.msg).decode(errors="replace")
            log.warning("libfabric: %s (tag %d)", text, ev.tag)
            self._tracker.retire(int(ev.tag), f"libfabric {self.provider}: {text}")
        else:
            # An error completion that names no batch or tag of ours (provider-internal or
            # target-side): logged, counted, and quoted by expectations that then time out.
            text = f"libfabric {self.provider}: {ffi.string(ev.msg).decode(errors='replace')}"
            log.warning("%s", text)
            self._async_error = text
            self._async_errors += 1
            self._tracker.transport_error(text)

    def _abandon(self, rail: int, batch_id: int) -> None:
        """Fail a batch here while its writes stay the provider's (freed unreported when done)."""
        ep = self._eps[rail]
        if not self._shim_closed and lib.shim_abandon_batch(ep, batch_id) == -ESTUCK:
            self._on_stuck(ep, stuck_text())

    def _native_expire(self, batch_id: int) -> None:
        self._book.forget(batch_id)
        for rail in range(len(self._eps)):  # a batch lives on one rail; the others do not know its id
            self._abandon(rail, batch_id)

    def _native_stats(self) -> dict[str, int]:
        live = 0
        for ep in self._eps:
            n = int(lib.shim_live_batches(ep))  # after close the shim answers 0
            if n == -ESTUCK:
                self._on_stuck(ep, stuck_text())
                live = -1
                break
            live += n
        return {"native_batches": live, "stale_addresses": self._stale_addrs,
                "poisoned": int(bool(self._poisoned)), "async_errors": self._async_errors,
                "endpoints_replaced": self.endpoints_replaced, "endpoints_abandoned": self.endpoints_abandoned,
                "rails": len(self._eps)} | self._book.stats()

    def _native_close(self) -> None:
        self._stop_watchdog()
        with self._ep_lock:  # never while the endpoint is being replaced
            if self._shim_closed:
                return
            self._close_endpoint()

    def _close_endpoint(self) -> None:
        self._stop.set()
        # The poller may be inside a completion callback that blocks, or be the very thread
        # closing us (close from a callback): never wait for it unboundedly. That is safe
        # because shim_close waits for every thread inside the shim (poller, writers parked
        # in shim_post) to leave, and the struct stays valid until the finalizer frees it.
        self._join_pollers(0.2 if self._stuck else 2.0)
        self._shim_closed = True
        for ep in self._eps:
            self._release(ep)
