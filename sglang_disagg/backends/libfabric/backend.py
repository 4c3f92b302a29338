"""libfabric backend: RDM endpoint, fi_writedata with the tag as remote CQ data.

The provider comes from BackendConfig.provider: "shm" and "tcp" (tcp;ofi_rxm) here,
"efa" / "verbs" (verbs;ofi_rxm) in production, all on this code path. Memory-registration
modes are handled in the shim: FI_MR_VIRT_ADDR (descriptor base = virtual address, else
offsets), FI_MR_PROV_KEY (provider-chosen keys travel in the descriptor), FI_MR_LOCAL
(local descriptors passed on every write), FI_MR_ENDPOINT, FI_RX_CQ_DATA (posted receives).
"""

from __future__ import annotations

import base64
import threading
from collections.abc import Sequence
from typing import Any

from ..base import TransferBackend
from ..errors import BackendUnavailable, PeerLostError, TransferError
from ..peer import Peer
from ..regions import MemoryRegion, NativeRegistration, PageWrite, PeerState, RemoteRegion

PROVIDERS = {"shm": "shm", "tcp": "tcp;ofi_rxm", "net": "net", "efa": "efa", "verbs": "verbs;ofi_rxm",
             "sockets": "sockets"}
_EVENTS = 256
_POLL_US = 2000

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
                lib.shim_close(ep[0])
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
        ep, err = ffi.new("shim_ep **"), _Errbuf()
        node = self._node(self.provider, self.config.host)
        if lib.shim_open(PROVIDERS[self.provider].encode(), node or ffi.NULL, ep, err.buf, 256):
            raise BackendUnavailable(f"libfabric provider {PROVIDERS[self.provider]} unusable: {err}")
        self._ep = ep[0]
        info = ffi.new("shim_info *")
        lib.shim_get_info(self._ep, info)
        self.fi_info = {k: (ffi.string(getattr(info, k)).decode() if k in ("prov", "fabric", "domain")
                            else int(getattr(info, k)))
                        for k in ("prov", "fabric", "domain", "mr_mode", "mode", "max_msg_size", "tx_size",
                                  "key_size", "virt_addr", "prov_key", "mr_local", "rx_cq_data")}
        self.max_write_bytes = min(self.max_write_bytes, self.fi_info["max_msg_size"])
        self._stop = threading.Event()
        self._async_error = ""
        self._stale_addrs = 0
        self._poisoned = ""
        self._poller = threading.Thread(target=self._poll_loop, name="libfabric-progress", daemon=True)
        self._poller.start()

    def _endpoint_info(self) -> dict[str, Any]:
        buf, n, err = ffi.new("char[512]"), ffi.new("size_t *", 512), _Errbuf()
        _check(lib.shim_getname(self._ep, buf, n, err.buf, 256), err, "fi_getname")
        return {"fi_addr": base64.b64encode(ffi.buffer(buf, n[0])[:]).decode()}

    def _native_connect(self, peer: Peer) -> None:
        try:
            raw = base64.b64decode(peer.endpoint["fi_addr"], validate=True)
        except (KeyError, ValueError) as e:
            raise TransferError(f"peer hello has no valid libfabric address: {e}") from e
        out, err = ffi.new("uint64_t *"), _Errbuf()
        _check(lib.shim_av_insert(self._ep, raw, out, err.buf, 256), err, "fi_av_insert")
        peer.native = int(out[0])

    def _native_disconnect(self, peer: Peer) -> None:
        if peer.native is None:
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
                    "response blocks every later non-inject write (head-of-line). Close this backend and "
                    "create a new one")
        elif self.provider == "shm" and peer.state is PeerState.LOST:
            # A dead shm sender may still have commands in our queue that point into its
            # region: keep it mapped (one AV slot per lost peer, freed at close).
            self._stale_addrs += 1
        else:
            err = _Errbuf()
            _check(lib.shim_av_remove(self._ep, peer.native, err.buf, 256), err, "fi_av_remove")
        peer.native = None

    def _native_register(self, addr: int, length: int) -> NativeRegistration:
        h, key, base, err = ffi.new("uint64_t *"), ffi.new("uint64_t *"), ffi.new("uint64_t *"), _Errbuf()
        _check(lib.shim_mr_reg(self._ep, ffi.cast("void *", addr), length, h, key, base, err.buf, 256), err, "fi_mr_reg")
        return NativeRegistration(int(h[0]), int(base[0]), int(key[0]))

    def _native_deregister(self, reg: NativeRegistration) -> None:
        err = _Errbuf()
        _check(lib.shim_mr_close(self._ep, reg.handle, err.buf, 256), err, "fi_close(mr)")

    def _arrays(self, writes: Sequence[PageWrite]) -> tuple:
        regs = self._regions
        mr = ffi.new("uint64_t[]", [regs[w.src.id][1].handle for w in writes])
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
        arrays = (ffi.new("uint64_t[]", [self._regions[src.id][1].handle] * n), ffi.new("uint64_t[]", src_offsets),
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

    def _poll_loop(self) -> None:
        events = ffi.new("shim_event[]", _EVENTS)
        while not self._stop.is_set():
            n = lib.shim_poll(self._ep, events, _EVENTS, _POLL_US)
            for i in range(n):
                ev = events[i]
                if ev.kind == 1:
                    msg = None if ev.status == 0 else f"{ffi.string(ev.msg).decode(errors='replace')} ({ev.count} writes failed)"
                    self._complete_batch(int(ev.id), msg)
                elif ev.kind == 2:
                    self._tracker.add(int(ev.tag), int(ev.count))
                else:
                    self._async_error = ffi.string(ev.msg).decode(errors="replace")

    def _native_stats(self) -> dict[str, int]:
        if self._ep == ffi.NULL:  # closed: the shim endpoint is freed
            return {"native_batches": 0, "stale_addresses": 0, "poisoned": 0}
        return {"native_batches": int(lib.shim_live_batches(self._ep)), "stale_addresses": self._stale_addrs,
                "poisoned": int(bool(self._poisoned))}

    def _native_close(self) -> None:
        self._stop.set()
        self._poller.join(timeout=2.0)
        lib.shim_close(self._ep)
        self._ep = ffi.NULL
