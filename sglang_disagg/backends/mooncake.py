"""Mooncake transfer-engine adapter (TCP transport, P2P handshake, no metadata server).

Mapping onto the contract:
- Mooncake's Python API is synchronous per batch, so each peer has its own worker thread:
  that peer's batches run in order and complete their future when the call returns, and a
  stalled peer (a decoder that stopped reading) holds up only its own batches.
- immediates: the last sub-batch carries a TransferNotify ("sgd3 <sender> <seq> <tag> <count> <mac>"), which
  the target reads from get_notifies() after the data; the poller credits the tag. Anyone who
  reaches the transport can send one, naming any session: one without the secret's MAC is
  dropped and counted, and never fails the peer it names (messages.py).
- limits: the TCP transport rejects batches over ~1024 entries ("lane queue-full"), so
  batches are split into sub-batches of at most MAX_ENTRIES entries / MAX_BYTES bytes.
- failures: Mooncake returns bare integers (details go to its glog); they become
  TransferError naming the code. A dead peer gives -1 (connection reset) on the next
  write; the control channel notices it first.
- memory: host memory registers with Mooncake's default location ("*": found from NUMA);
  CUDA memory with location "cuda:N", only when a CUDA build of the wheel is installed
  (the non-CUDA wheel would treat a device pointer as host memory): else UnsupportedMemory.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

from .base import TransferBackend
from .errors import BackendUnavailable, DescriptorError, TransferError, UnsupportedMemory
from .peers import Peer
from .regions import Memory, MemoryKind, NativeRegistration, PageWrite, RegionDescriptor
from ..threads import Thread as NamedThread
from .idle import IdleGate

MAX_ENTRIES = 512
MAX_BYTES = 32 << 20
log = logging.getLogger(__name__)
_CODES = {-1: "ERR_INVALID_ARGUMENT or transport failure", -2: "ERR_TOO_MANY_REQUESTS",
          -3: "ERR_ADDRESS_NOT_REGISTERED", -4: "ERR_BATCH_BUSY", -6: "ERR_DEVICE_NOT_FOUND",
          -7: "ERR_ADDRESS_OVERLAPPED"}


def _import_mooncake() -> Any:
    try:
        from mooncake import engine
    except Exception as e:  # noqa: BLE001 - missing libibverbs/libnuma surface as OSError
        raise BackendUnavailable(
            f"Mooncake not importable ({e}): pip install mooncake-transfer-engine-non-cuda==0.3.13.post1 "
            "and apt install libibverbs1 libnuma1") from e
    return engine


# Mooncake's wheels (one `mooncake` package each): which were built with CUDA.
CUDA_WHEELS = ("mooncake-transfer-engine-cuda13", "mooncake-transfer-engine", "mooncake-transfer-engine-efa-cuda13",
               "mooncake-transfer-engine-efa")
HOST_WHEELS = ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine-efa-non-cuda")


@functools.cache
def installed_wheels() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(CUDA wheels, non-CUDA wheels) installed here."""
    def have(name: str) -> bool:
        try:
            importlib.metadata.distribution(name)
            return True
        except importlib.metadata.PackageNotFoundError:
            return False
    return tuple(filter(have, CUDA_WHEELS)), tuple(filter(have, HOST_WHEELS))


def cuda_location(memory: Memory) -> str:
    """Mooncake's location for CUDA memory, or UnsupportedMemory if this install has no CUDA."""
    with_cuda, without = installed_wheels()
    if not with_cuda or without:
        have = ", ".join(with_cuda + without) or "no known Mooncake wheel"
        raise UnsupportedMemory(
            f"mooncake: cannot register {memory}: the installed Mooncake ({have}) "
            f"{'has no CUDA support' if not with_cuda else 'mixes CUDA and non-CUDA wheels'}; "
            "install exactly one CUDA build: mooncake-transfer-engine-cuda13 (CUDA 13) or "
            "mooncake-transfer-engine (CUDA 12)")
    return f"cuda:{memory.device}"


def _rc(what: str, rc: int) -> TransferError:
    return TransferError(f"Mooncake {what} returned {rc} ({_CODES.get(rc, 'see Mooncake log')})")


def split(writes: Sequence[Any], max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES) -> list[list[Any]]:
    """Cut a batch into sub-batches the TCP transport accepts."""
    out: list[list[Any]] = [[]]
    size = 0
    for w in writes:
        if out[-1] and (len(out[-1]) >= max_entries or size + w.length > max_bytes):
            out.append([])
            size = 0
        out[-1].append(w)
        size += w.length
    return out


class MooncakeBackend(TransferBackend):
    name = "mooncake"

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        try:
            _import_mooncake()
        except BackendUnavailable as e:
            return False, str(e)
        with_cuda, without = installed_wheels()
        return True, f"TCP transport, P2P handshake, {'host and CUDA' if with_cuda and not without else 'host'} memory"

    def _provider_label(self) -> str:
        return "tcp"

    def _native_open(self) -> None:
        engine = _import_mooncake()
        self._mc = engine
        self._te = engine.TransferEngine()
        rc = self._te.initialize(self.config.host, "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise BackendUnavailable(str(_rc("initialize", rc)))
        self._session = f"{self.config.host}:{self._te.get_rpc_port()}"
        self._inflight: dict[int, str] = {}  # batch id -> peer id, for stats
        self._stop = threading.Event()
        # peer id -> its job queue; every worker ever started, so close can join them all
        self._queues: dict[str, queue.Queue] = {}
        self._workers: list[threading.Thread] = []
        self._wlock = threading.Lock()
        # only the receiving side's notifications are read here: work = a pending expectation
        self._gate = IdleGate(self._tracker.pending)
        self._notifier = NamedThread(target=self._notify_loop, name="mooncake-notifies", daemon=True)
        self._notifier.start()

    def _endpoint_info(self) -> dict[str, Any]:
        return {"session": self._session}

    def _native_connect(self, peer: Peer) -> None:
        if not isinstance(peer.endpoint.get("session"), str):
            raise TransferError("peer hello lacks a Mooncake session id")
        peer.native = peer.endpoint["session"]

    def _check_remote(self, peer: Peer, d: RegionDescriptor) -> None:
        if d.extra.get("session") != peer.native:
            raise DescriptorError(f"Mooncake descriptor names session {d.extra.get('session')!r}, peer is {peer.native!r}")

    def _native_disconnect(self, peer: Peer) -> None:
        peer.native = None  # queued jobs for it fail fast in its worker, which then exits
        with self._wlock:
            q = self._queues.pop(peer.id, None)
        if q is not None:
            q.put(None)

    def _queue_for(self, peer: Peer) -> queue.Queue:
        with self._wlock:
            if self._stop.is_set():
                raise TransferError("Mooncake backend is closed")
            q = self._queues.get(peer.id)
            if q is None:
                q = self._queues[peer.id] = queue.Queue()
                t = NamedThread(target=self._work_loop, args=(q,), daemon=True,
                                     name=f"mooncake-worker-{peer.id[:8]}")
                self._workers = [w for w in self._workers if w.is_alive()] + [t]
                t.start()
            return q

    def _native_register(self, addr: int, length: int, memory: Memory) -> NativeRegistration:
        if memory.kind is MemoryKind.HOST:
            rc = self._te.register_memory(addr, length)
        else:
            rc = self._te.register_memory(addr, length, cuda_location(memory))
        if rc != 0:
            raise _rc(f"register_memory ({memory})", rc)
        return NativeRegistration(addr, addr, 0, {"session": self._session})

    def _native_deregister(self, reg: NativeRegistration) -> None:
        rc = self._te.unregister_memory(reg.handle)
        if rc != 0:
            raise _rc("unregister_memory", rc)

    def _native_post(self, peer: Peer, batch_id: int, writes: Sequence[PageWrite], imm: int) -> None:
        regs = self._regions
        parts = [([regs[w.src.id][0].addr + w.src_offset for w in part],
                  [w.dst.descriptor.base + w.dst_offset for w in part],
                  [w.length for w in part]) for part in split(writes)]
        q = self._queue_for(peer)
        self._inflight[batch_id] = peer.id
        q.put((batch_id, peer, parts, peer.seal_notification(imm, len(writes))))

    def _work_loop(self, jobs: queue.Queue) -> None:
        while True:
            job = jobs.get()
            if job is None:
                return
            batch_id = job[0]
            try:
                error = self._run_job(*job)
            except Exception as e:  # noqa: BLE001 - fail this batch, keep serving the peer
                log.exception("Mooncake batch %d failed unexpectedly", batch_id)
                error = f"Mooncake batch failed: {e!r}"
            self._inflight.pop(batch_id, None)
            self._complete_batch(batch_id, error)

    def _run_job(self, batch_id: int, peer: Peer, parts: list, note: str) -> str | None:
        with self._lock:
            if batch_id not in self._batches:  # expired or failed while queued: do not send
                return None
        session = peer.native
        for i, (srcs, dsts, lens) in enumerate(parts):
            if session is None or peer.native is None or self._stop.is_set():
                return "peer lost before the batch ran"
            if i == len(parts) - 1:
                notify = self._mc.TransferNotify(self._session, note)
                rc = self._te.batch_transfer_sync(session, srcs, dsts, lens, self._mc.TransferOpcode.Write, notify)
            else:
                rc = self._te.batch_transfer_sync_write(session, srcs, dsts, lens)
            if rc != 0:
                return str(_rc(f"batch transfer to {session}", rc))
        return None

    def _native_expire(self, batch_id: int) -> None:
        # A synchronous Mooncake call cannot be interrupted; its result is ignored when it returns.
        self._inflight.pop(batch_id, None)

    def _kick(self) -> None:
        self._gate.kick()

    def _notify_loop(self) -> None:
        while not self._stop.is_set():
            got = False
            try:
                notes = self._te.get_notifies()
            except Exception as e:  # noqa: BLE001 - the thread must outlive one bad call
                log.warning("Mooncake get_notifies failed: %s", e)
                notes = []
            # A notification's session name (n.name) is the sender's to choose: nothing here uses it.
            for n in notes:
                got |= self._on_notification(getattr(n, "msg", None))
            self._gate.after(got)

    def _native_stats(self) -> dict[str, int]:
        return {"native_batches": len(self._inflight)}

    def _native_close(self) -> None:
        with self._wlock:
            self._stop.set()
            queues, self._queues = list(self._queues.values()), {}
            workers = list(self._workers)
        self._gate.kick()
        for q in queues:
            q.put(None)
        # One budget for all of them; never join the calling thread (close from a callback).
        end = time.monotonic() + 5.0
        me = threading.current_thread()
        for t in workers + [self._notifier]:
            if t is not me:
                t.join(timeout=max(0.0, end - time.monotonic()))
