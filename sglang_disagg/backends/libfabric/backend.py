"""libfabric backend: RDM endpoint, fi_writedata with the tag as remote CQ data.

The provider comes from BackendConfig.provider: "shm" and "tcp" (tcp;ofi_rxm) here,
"efa" / "verbs" (verbs;ofi_rxm) in production, all on this code path. Memory-registration
modes are handled in the shim: FI_MR_VIRT_ADDR (descriptor base = virtual address, else
offsets), FI_MR_PROV_KEY (provider-chosen keys travel in the descriptor), FI_MR_LOCAL
(local descriptors passed on every write), FI_MR_ENDPOINT, FI_RX_CQ_DATA (posted receives).
"""

from __future__ import annotations

import base64
import glob
import logging
import os
import threading
import weakref
from collections.abc import Sequence
from typing import Any

from ..base import TransferBackend
from ..errors import BackendUnavailable, DescriptorError, PeerLostError, TransferError
from ..peers import Peer
from ..regions import MemoryRegion, NativeRegistration, PageWrite, PeerState, RemoteRegion

PROVIDERS = {"shm": "shm", "tcp": "tcp;ofi_rxm", "net": "net", "efa": "efa", "verbs": "verbs;ofi_rxm",
             "sockets": "sockets"}
_EVENTS = 256
_POLL_US = 2000
_EV_BATCH, _EV_IMM, _EV_ASYNC, _EV_TAG_FAILED = 1, 2, 3, 4
log = logging.getLogger(__name__)

try:
    from ._shim import ffi, lib
except ImportError as _e:  # not built: reported by availability() and the constructor
    ffi = lib = None
    _IMPORT_ERROR = str(_e)


def _need_shim() -> None:
    if lib is None:
        raise BackendUnavailable(
            "libfabric shim not built (" + _IMPORT_ERROR + "): install Debian libfabric-dev and run "
            "`pip install -e . --no-build-isolation --no-deps` (or `pip install .`)")


_swept = {"pid": 0}
_sweep_lock = threading.Lock()


def _sweep_dead_namesakes() -> None:
    """libfabric shm keeps each endpoint's queues in /dev/shm/<pid>:<domain>:<endpoint> and
    leaves the file behind when its process is killed. pids come round again (pid_max is
    often 32768), and a process given a dead one's pid then cannot open an endpoint
    (fi_enable: Device or resource busy; seen in CI). Before this process's first shm
    endpoint, every file named with its pid can only be a dead process's: remove them."""
    with _sweep_lock:
        pid = os.getpid()
        if _swept["pid"] == pid:
            return
        _swept["pid"] = pid
        for path in glob.glob(f"/dev/shm/{pid}:*"):
            try:
                os.unlink(path)
                log.info("libfabric shm: removed %s, left by a killed process that had our pid", path)
            except OSError:
                pass


class _Errbuf:
    def __init__(self) -> None:
        self.buf = ffi.new("char[256]")

    def __str__(self) -> str:
        return ffi.string(self.buf).decode(errors="replace")


def _check(ret: int, err: _Errbuf, what: str) -> None:
    if ret:
        raise TransferError(f"libfabric {what}: {err}")


class LibfabricBackend(TransferBackend):
    name = "libfabric"

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        if lib is None:
            try:
                _need_shim()
            except BackendUnavailable as e:
                return False, str(e)
        found, missing = [], []
        for label in ("shm", "tcp", "efa", "verbs"):
            ep = ffi.new("shim_ep **")
            err = _Errbuf()
            if lib.shim_open(PROVIDERS[label].encode(), cls._node(label, "127.0.0.1") or ffi.NULL, ep, err.buf, 256):
                missing.append(f"{label} ({err})")
            else:
                found.append(label)
                lib.shim_free(ep[0])
        if not found:
            return False, "no provider: " + "; ".join(missing)
        return True, "providers: " + ", ".join(found) + ("; absent: " + ", ".join(m.split(" ")[0] for m in missing) if missing else "")

    @staticmethod
    def _node(label: str, host: str) -> bytes | None:
        # shm names endpoints itself; the TCP providers otherwise bind to eth0 (FI_SOURCE).
        return None if label == "shm" else host.encode()

    def _provider_label(self) -> str:
        label = self.config.provider or "shm"
        if label not in PROVIDERS:
            raise TransferError(f"libfabric provider {label!r} unknown; choose from {', '.join(PROVIDERS)}")
        return label

    def _native_open(self) -> None:
        _need_shim()
        self._ep = self._open_endpoint()
        self._shim_closed = False
        self._ep_lock = threading.RLock()  # registration vs. replacing the endpoint
        self._healing = False
        self.endpoints_replaced = 0
        info = ffi.new("shim_info *")
        lib.shim_get_info(self._ep, info)
        self.fi_info = {k: (ffi.string(getattr(info, k)).decode() if k in ("prov", "fabric", "domain")
                            else int(getattr(info, k)))
                        for k in ("prov", "fabric", "domain", "mr_mode", "mode", "max_msg_size", "tx_size",
                                  "key_size", "virt_addr", "prov_key", "mr_local", "rx_cq_data")}
        self.max_write_bytes = min(self.max_write_bytes, self.fi_info["max_msg_size"])
        self._stop = threading.Event()
        self._async_error = ""
        self._async_errors = 0
        self._stale_addrs = 0
        self._poisoned = ""
        self._start_poller()

    def _open_endpoint(self) -> Any:
        if self.provider == "shm":
            _sweep_dead_namesakes()
        ep, err = ffi.new("shim_ep **"), _Errbuf()
        node = self._node(self.provider, self.config.host)
        if lib.shim_open(PROVIDERS[self.provider].encode(), node or ffi.NULL, ep, err.buf, 256):
            raise BackendUnavailable(f"libfabric provider {PROVIDERS[self.provider]} unusable: {err}")
        # The struct outlives shim_close (a thread still calling in gets -FI_ESHUTDOWN, not
        # freed memory); it is freed once this backend is unreachable, i.e. no thread of ours
        # can call in any more.
        fin = weakref.finalize(self, lib.shim_free, ep[0])
        fin.atexit = False  # at exit daemon threads may still call in: leak instead
        return ep[0]

    def _start_poller(self) -> None:
        self._stop = threading.Event()
        self._poller = threading.Thread(target=self._poll_loop, args=(self._ep, self._stop),
                                        name="libfabric-progress", daemon=True)
        self._poller.start()

    def _replace_endpoint(self) -> None:
        """A poisoned shm endpoint (a peer died with writes in flight) blocks every later
        write: replace it. Peers are closed (they reconnect and learn our new address from a
        fresh HELLO), memory is registered again on the new endpoint under the same region
        ids, and writes are refused until the swap is done."""
        with self._ep_lock:
            try:
                log.warning("libfabric: replacing the endpoint: %s", self._poisoned)
                for peer in self.peers():
                    peer.close()
                old_ep, old_poller = self._ep, self._poller
                self._stop.set()
                if threading.current_thread() is not old_poller:
                    old_poller.join(timeout=2.0)
                lib.shim_close(old_ep)
                if self._closed:  # closed meanwhile: nothing to replace it for
                    self._shim_closed = True
                    return
                new_ep = self._open_endpoint()
                with self._lock:
                    regions = list(self._regions.values())
                fresh = {r.id: (r, self._register_on(new_ep, r.addr, r.length)) for r, _ in regions}
                with self._lock:
                    self._regions.update(fresh)
                    self._ep = new_ep
                self._start_poller()
                self._poisoned = ""
                self.endpoints_replaced += 1
            except Exception:  # noqa: BLE001 - the backend stays poisoned and says why on every write
                log.exception("libfabric: replacing the endpoint failed")
            finally:
                self._healing = False

    def _endpoint_info(self) -> dict[str, Any]:
        buf, n, err = ffi.new("char[512]"), ffi.new("size_t *", 512), _Errbuf()
        _check(lib.shim_getname(self._ep, buf, n, err.buf, 256), err, "fi_getname")
        return {"fi_addr": base64.b64encode(ffi.buffer(buf, n[0])[:]).decode()}

    def _native_connect(self, peer: Peer) -> None:
        try:
            raw = base64.b64decode(peer.endpoint["fi_addr"], validate=True)
        except (KeyError, ValueError) as e:
            raise TransferError(f"peer hello has no valid libfabric address: {e}") from e
        # The shim checks the address against our provider's format (length, terminator,
        # family) before fi_av_insert reads it: the hello comes from the network.
        out, err = ffi.new("uint64_t *"), _Errbuf()
        with self._ep_lock:  # a peer connecting while the endpoint is replaced joins the new one
            _check(lib.shim_av_insert(self._ep, raw, len(raw), out, err.buf, 256), err, "fi_av_insert")
            peer.native = int(out[0])

    def _native_disconnect(self, peer: Peer) -> None:
        if peer.native is None:
            return
        if self._shim_closed or self._healing:
            # The AV went (or goes) with the endpoint. While it is being replaced the old
            # poller may still be reading responses: removing an address now would unmap a
            # region that shm's response handling touches (SIGSEGV, seen in CI).
            peer.native = None
            return
        # In-flight writes to a dead peer may never complete (shm): the shim frees them
        # when they do, or at close. While any are queued the address must stay in the AV:
        # shm unmaps the peer's region on fi_av_remove and its progress then faults on it.
        pending = lib.shim_abandon_peer(self._ep, peer.native)
        if pending:
            self._stale_addrs += 1
            if self.provider == "shm":
                self._poisoned = (
                    f"shm endpoint unusable: peer {peer.address} was lost with {pending} batch(es) in flight; "
                    "libfabric shm consumes write responses in order, so the dead peer's never-answered "
                    "response blocks every later non-inject write (head-of-line); the endpoint is being "
                    "replaced")
                if not self._healing and not self._closed:
                    self._healing = True
                    threading.Thread(target=self._replace_endpoint, name="libfabric-replace", daemon=True).start()
        elif self.provider == "shm" and peer.state is PeerState.LOST:
            # A dead shm sender may still have commands in our queue that point into its
            # region: keep it mapped (one AV slot per lost peer, freed at close).
            self._stale_addrs += 1
        else:
            err = _Errbuf()
            _check(lib.shim_av_remove(self._ep, peer.native, err.buf, 256), err, "fi_av_remove")
        peer.native = None

    def _native_register(self, addr: int, length: int) -> NativeRegistration:
        with self._ep_lock:
            return self._register_on(self._ep, addr, length)

    @staticmethod
    def _register_on(ep: Any, addr: int, length: int) -> NativeRegistration:
        h, key, base, err = ffi.new("uint64_t *"), ffi.new("uint64_t *"), ffi.new("uint64_t *"), _Errbuf()
        _check(lib.shim_mr_reg(ep, ffi.cast("void *", addr), length, h, key, base, err.buf, 256), err, "fi_mr_reg")
        return NativeRegistration(int(h[0]), int(base[0]), int(key[0]))

    def _native_deregister(self, reg: NativeRegistration) -> None:
        err = _Errbuf()
        with self._ep_lock:
            if self._shim_closed:  # registrations went with the endpoint
                return
            _check(lib.shim_mr_close(self._ep, reg.handle, err.buf, 256), err, "fi_close(mr)")

    def _handle(self, region: MemoryRegion) -> int:
        # Checked before posting, but deregister() may run in between (another thread).
        entry = self._regions.get(region.id)
        if entry is None:
            raise DescriptorError(f"source region {region.id} was deregistered")
        return entry[1].handle

    def _arrays(self, writes: Sequence[PageWrite]) -> tuple:
        mr = ffi.new("uint64_t[]", [self._handle(w.src) for w in writes])
        src = ffi.new("uint64_t[]", [w.src_offset for w in writes])
        raddr = ffi.new("uint64_t[]", [w.dst.descriptor.base + w.dst_offset for w in writes])
        rkey = ffi.new("uint64_t[]", [w.dst.descriptor.key for w in writes])
        ln = ffi.new("uint64_t[]", [w.length for w in writes])
        return mr, src, raddr, rkey, ln

    def _native_post(self, peer: Peer, batch_id: int, writes: Sequence[PageWrite], imm: int) -> None:
        self._post_arrays(peer, batch_id, len(writes), self._arrays(writes), imm)

    def _post_arrays(self, peer: Peer, batch_id: int, n: int, arrays: tuple, imm: int) -> None:
        if self._poisoned:
            raise TransferError(self._poisoned)
        fi_addr = peer.native  # None once the peer is dropped; the shim refuses dead ones too
        if fi_addr is None:
            raise PeerLostError(f"peer {peer.address} is {peer.state.value}")
        err = _Errbuf()
        if lib.shim_post(self._ep, batch_id, fi_addr, n, *arrays, imm, err.buf, 256):
            if peer.state is not PeerState.CONNECTED:
                raise PeerLostError(f"libfabric post to {peer.address}: {err}")
            raise TransferError(f"libfabric post: {err}")

    def _native_post_uniform(self, peer: Peer, batch_id: int, src: MemoryRegion, src_offsets: Sequence[int],
                             dst: RemoteRegion, dst_offsets: Sequence[int], length: int, imm: int) -> None:
        n, d = len(src_offsets), dst.descriptor
        arrays = (ffi.new("uint64_t[]", [self._handle(src)] * n), ffi.new("uint64_t[]", src_offsets),
                  ffi.new("uint64_t[]", [d.base + o for o in dst_offsets] if d.base else dst_offsets),
                  ffi.new("uint64_t[]", [d.key] * n), ffi.new("uint64_t[]", [length] * n))
        self._post_arrays(peer, batch_id, n, arrays, imm)

    def raw_c_loop(self, peer: Peer, writes: Sequence[PageWrite], imm: int, iters: int) -> tuple[int, list[int]]:
        """Benchmark hook: post+poll `iters` batches entirely in C. Returns (total ns, per-batch ns)."""
        from ..validate import check_write
        self._check_open()
        checked = [check_write(self, peer, w, i) for i, w in enumerate(writes)]
        lat, err = ffi.new("int64_t[]", iters), _Errbuf()
        ns = lib.shim_bench(self._ep, peer.native, len(checked), *self._arrays(checked), imm, iters, lat, err.buf, 256)
        if ns < 0:
            raise TransferError(f"libfabric raw loop: {err}")
        return int(ns), list(lat)

    def _poll_loop(self, ep: Any, stop: threading.Event) -> None:
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

    def _native_expire(self, batch_id: int) -> None:
        if not self._shim_closed:
            lib.shim_abandon_batch(self._ep, batch_id)

    def _native_stats(self) -> dict[str, int]:
        # after close the shim answers 0 live batches
        return {"native_batches": int(lib.shim_live_batches(self._ep)), "stale_addresses": self._stale_addrs,
                "poisoned": int(bool(self._poisoned)), "async_errors": self._async_errors,
                "endpoints_replaced": self.endpoints_replaced}

    def _native_close(self) -> None:
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
        if threading.current_thread() is not self._poller:
            self._poller.join(timeout=2.0)
        self._shim_closed = True
        lib.shim_close(self._ep)
