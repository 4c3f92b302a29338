"""NIXL adapter (UCX plugin; host DRAM and CUDA VRAM, see nixl_memory.py).

Mapping onto the contract:
- immediates: NIXL has no counters; each batch is one NIXL transfer whose notification
  ("sgd3 <sender> <seq> <tag> <count> <mac>", delivered after the data) credits `count` writes to `tag`.
  UCX delivers notifications from anyone, under the agent name the sender chose: one without
  the secret's MAC is dropped and counted, and never fails the peer it names (messages.py).
- metadata: agent metadata travels in the hello and, refreshed after each registration,
  in every region descriptor, so regions registered after connecting are reachable.
- failures: "ERR" states and NIXL exceptions become TransferError with NIXL's text;
  peer loss comes from the control channel (UCX error mode "none" never reports it).
- UCX: error-handling mode "none" (the default "peer" mode excludes shared-memory
  transports and loses target->initiator notifications); UCX_NET_DEVICES=lo on loopback.
- a refused VRAM registration leaves NIXL 1.5.1's agent metadata with an empty VRAM section
  that peers cannot load (loadRemoteMD: NIXL_ERR_NOT_FOUND, seen here): the backend then
  refuses peers and registrations naming why (the messenger exits at start-up anyway).
"""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from . import nixl_memory
from .base import TransferBackend
from .errors import BackendUnavailable, DescriptorError, PeerLostError, TransferError, UnsupportedMemory
from .peers import Peer
from .regions import Memory, NativeRegistration, PageWrite, RegionDescriptor
from ..threads import Thread as NamedThread
from .idle import IdleGate

log = logging.getLogger(__name__)


def _import_nixl() -> Any:
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except Exception as e:  # noqa: BLE001 - nixl raises more than ImportError when half-installed
        raise BackendUnavailable(
            f"NIXL not importable ({e}): pip install nixl==1.5.1 nixl-cu13==1.5.1 --no-deps") from e
    return nixl_agent, nixl_agent_config


_AGENT_LOCK = threading.Lock()


def _make_agent(nixl_agent: Any, nixl_agent_config: Any, name: str, delay_us: int) -> Any:
    # No NIXL progress thread: ours (_poll_loop) drives UCX through get_new_notifs and
    # check_xfer_state, fast while a transfer is in flight or expected, and sleeps when
    # nothing is (NIXL's thread polls every `delay_us` forever: ~2 % of a core per idle
    # agent). Measured on this 2-core VM (64 MiB in 64 KiB writes over UCX tcp, 6 runs):
    # 3.2-3.7 GB/s without it, 2.9-3.6 GB/s with it.
    with progress_delay(delay_us):
        return nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[]))


@contextlib.contextmanager
def progress_delay(delay_us: int) -> Iterator[None]:
    """nixl_agents built inside this block have a progress thread that sleeps `delay_us`
    between polls (SGLang's NIXL connector on CPU uses it too, through hooks.py).

    The Python wrapper hard-codes pthrDelay=0: its progress thread then spins a whole core
    even when idle (measured ~40% of a 2-vCPU VM per agent; 2% with 100 us). The wrapper
    offers no knob, so while constructing we hand it a config subclass that turns that 0
    into `delay_us`. If this NIXL build is laid out differently we keep the default.
    """
    import nixl._api as api

    real = getattr(api, "nixlBind", None)
    if delay_us <= 0 or real is None or not hasattr(real, "nixlAgentConfig"):
        yield
        return

    class _Config(real.nixlAgentConfig):
        def __setattr__(self, key: str, value: Any) -> None:
            super().__setattr__(key, delay_us if key == "pthrDelay" and value == 0 else value)

    class _Bind:
        def __getattr__(self, key: str) -> Any:
            return _Config if key == "nixlAgentConfig" else getattr(real, key)

    with _AGENT_LOCK:
        api.nixlBind = _Bind()
        try:
            yield
        finally:
            api.nixlBind = real


class _Serialized:
    """Forwards every call to the NIXL agent under one lock: concurrent calls from the
    poller and the posting thread crash the agent (observed SIGSEGV)."""

    def __init__(self, target: Any) -> None:
        self._target, self._lock = target, threading.RLock()

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._target, name)

        def call(*args: Any, **kw: Any) -> Any:
            with self._lock:
                return fn(*args, **kw)
        return call


class NixlBackend(TransferBackend):
    name = "nixl"

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        try:
            _import_nixl()
        except BackendUnavailable as e:
            return False, str(e)
        return True, "UCX plugin, DRAM and VRAM"

    def _provider_label(self) -> str:
        return "ucx"

    def _native_open(self) -> None:
        nixl_agent, nixl_agent_config = _import_nixl()
        if self.config.host.startswith("127."):
            os.environ.setdefault("UCX_NET_DEVICES", "lo")
        self._agent_name = f"sgd-{self.instance}"
        try:
            delay = int(self.config.options.get("progress_delay_us", 100))
            self._agent = _Serialized(_make_agent(nixl_agent, nixl_agent_config, self._agent_name, delay))
            mode = str(self.config.options.get("ucx_error_handling_mode", "none"))
            self._agent.create_backend("UCX", {"ucx_error_handling_mode": mode})
        except Exception as e:  # noqa: BLE001 - NIXL raises its own exception types
            raise BackendUnavailable(f"NIXL agent/UCX backend creation failed: {e}") from e
        self._xfers: dict[int, tuple[Any, str]] = {}   # batch id -> (handle, peer id)
        self._zombies: list[Any] = []                   # handles NIXL would not release yet
        self._xlock = threading.Lock()
        self._unusable = ""  # why peers could no longer load our metadata
        self._stop = threading.Event()
        self._gate = IdleGate(self._has_work)
        self._poller = NamedThread(target=self._poll_loop, name="nixl-progress", daemon=True)
        self._poller.start()

    def _metadata(self) -> str:
        return base64.b64encode(self._agent.get_agent_metadata()).decode()

    def _check_usable(self) -> None:
        if self._unusable:
            raise TransferError(self._unusable)

    def _endpoint_info(self) -> dict[str, Any]:
        self._check_usable()
        return {"agent": self._agent_name, "md": self._metadata()}

    def _load_remote(self, md_b64: str) -> str:
        try:
            name = self._agent.add_remote_agent(base64.b64decode(md_b64))
        except Exception as e:  # noqa: BLE001
            raise TransferError(f"NIXL add_remote_agent: {e}") from e
        return name.decode() if isinstance(name, bytes) else str(name)

    def _native_connect(self, peer: Peer) -> None:
        self._check_usable()
        if "agent" not in peer.endpoint or "md" not in peer.endpoint:
            raise TransferError("peer hello lacks NIXL agent metadata")
        peer.native = self._load_remote(peer.endpoint["md"])

    def _check_remote(self, peer: Peer, d: RegionDescriptor) -> None:
        if d.extra.get("agent") != peer.native or not isinstance(d.extra.get("md"), str):
            raise DescriptorError(f"NIXL descriptor names agent {d.extra.get('agent')!r}, peer is {peer.native!r}")
        nixl_memory.remote_segment(d.extra)
        # Load the agent metadata carried by the descriptor (it knows this region); NIXL
        # updates a known agent in place, so transfers in flight are untouched.
        self._load_remote(d.extra["md"])

    def _native_disconnect(self, peer: Peer) -> None:
        with self._xlock:  # under the posting lock: no transfer to it is added after this
            agent, peer.native = peer.native, None
            dead = [bid for bid, (_, pid) in self._xfers.items() if pid == peer.id]
            for bid in dead:
                self._zombies.append(self._xfers.pop(bid)[0])
        self._reap()
        if agent is not None:
            with contextlib.suppress(Exception):
                self._agent.remove_remote_agent(agent)

    def _native_register(self, addr: int, length: int, memory: Memory) -> NativeRegistration:
        self._check_usable()
        mem, dev = nixl_memory.segment(memory)
        try:
            descs = self._agent.register_memory([(addr, length, dev, "")], mem)
            why = "" if descs is not None else "failed"
        except Exception as e:  # noqa: BLE001
            why = str(e)
        if why:
            what = f"NIXL register_memory({mem}, device {dev}) for {memory}: {why} (see NIXL's log)"
            if mem == nixl_memory.DRAM:
                raise TransferError(what)
            # Device memory UCX cannot take (no CUDA transport, or a pointer it sees as host
            # memory) is a kind we cannot register here, not a transient error.
            self._unusable = f"NIXL backend unusable after a refused VRAM registration ({what})"
            raise UnsupportedMemory(what + "; this backend now refuses peers: NIXL keeps an empty VRAM "
                                    "section in its metadata that peers cannot load")
        return NativeRegistration(descs, addr, 0, {"agent": self._agent_name, "md": self._metadata(),
                                                   **nixl_memory.descriptor_fields(memory)})

    def _native_deregister(self, reg: NativeRegistration) -> None:
        try:
            self._agent.deregister_memory(reg.handle)
        except Exception as e:  # noqa: BLE001
            raise TransferError(f"NIXL deregister_memory: {e}") from e

    def _native_post(self, peer: Peer, batch_id: int, writes: Sequence[PageWrite], imm: int) -> None:
        regs = self._regions
        local, local_mem, remote, remote_mem = nixl_memory.transfer_lists(
            writes, {w.src.id: regs[w.src.id][0].addr for w in writes})
        note = peer.seal_notification(imm, len(writes)).encode()
        agent = peer.native  # None once the peer is dropped
        if agent is None:
            raise PeerLostError(f"peer {peer.address} is {peer.state.value}")
        # The poller only sees the handle once posted: checking an unposted handle is an error.
        with self._xlock:
            try:
                handle = self._agent.initialize_xfer("WRITE", self._agent.get_xfer_descs(local, local_mem),
                                                     self._agent.get_xfer_descs(remote, remote_mem), agent, note)
                if handle is None:
                    raise TransferError("initialize_xfer returned no handle")
                state = self._agent.transfer(handle)
            except Exception as e:  # noqa: BLE001
                raise TransferError(f"NIXL transfer to {agent}: {e}") from e
            if state != "ERR":
                if peer.native is None:  # lost while posting, after _native_disconnect swept
                    self._zombies.append(handle)
                else:
                    self._xfers[batch_id] = (handle, peer.id)
        if state == "ERR":
            self._release(handle)
            raise TransferError(f"NIXL transfer to {agent}: posting failed (state ERR)")

    def _release(self, handle: Any) -> bool:
        try:
            self._agent.release_xfer_handle(handle)
            return True
        except Exception:  # noqa: BLE001 - still in flight: retried by _reap
            return False

    def _reap(self) -> None:
        with self._xlock:
            zombies, self._zombies = self._zombies, []
        keep = [h for h in zombies if not self._release(h)]
        with self._xlock:
            self._zombies.extend(keep)

    def _poll_loop(self) -> None:
        while not self._stop.is_set():
            try:
                busy = self._poll_once()
            except Exception:  # noqa: BLE001 - the thread completes every transfer: keep it alive
                log.exception("NIXL progress iteration failed")
                busy = False
            # Spinning would starve UCX's progress thread on small machines; idle, it sleeps.
            self._gate.after(busy)

    def _kick(self) -> None:
        self._gate.kick()

    def _has_work(self) -> bool:
        return bool(self._xfers or self._zombies) or self._tracker.pending()

    def _poll_once(self) -> bool:
        busy = False
        try:
            notifs = self._agent.get_new_notifs()
        except Exception as e:  # noqa: BLE001
            log.warning("NIXL get_new_notifs failed: %s", e)
            notifs = {}
        # The sender's agent name (the keys) is the sender's to choose: nothing here uses it.
        for msgs in notifs.values():
            for m in msgs:
                busy |= self._on_notification(m)
        with self._xlock:
            items = list(self._xfers.items())
        for bid, (handle, _) in items:
            try:
                busy |= self._check_xfer(bid, handle)
            except Exception as e:  # noqa: BLE001 - fail that batch, keep polling the others
                log.exception("NIXL: checking batch %d failed", bid)
                with self._xlock:
                    if self._xfers.pop(bid, None) is not None:
                        self._zombies.append(handle)
                self._complete_batch(bid, f"NIXL: checking the transfer failed: {e!r}")
        if self._zombies:
            self._reap()
        return busy

    def _check_xfer(self, bid: int, handle: Any) -> bool:
        try:
            state, err = self._agent.check_xfer_state(handle), None
        except Exception as e:  # noqa: BLE001 - e.g. nixlRemoteDisconnectError
            state, err = "ERR", f"NIXL: {type(e).__name__}: {e}"
        if state == "PROC":
            return False
        with self._xlock:
            if self._xfers.pop(bid, None) is None:
                return False
        self._release(handle)
        self._complete_batch(bid, None if state == "DONE" else (err or "NIXL transfer failed (state ERR)"))
        return True

    def _native_expire(self, batch_id: int) -> None:
        # NIXL cannot cancel a posted transfer: release its handle when NIXL lets us.
        with self._xlock:
            entry = self._xfers.pop(batch_id, None)
            if entry is not None:
                self._zombies.append(entry[0])

    def _native_stats(self) -> dict[str, int]:
        with self._xlock:
            return {"native_batches": len(self._xfers), "native_zombies": len(self._zombies)}

    def _native_close(self) -> None:
        self._stop.set()
        self._gate.kick()
        # Bounded, and never from the poller itself (close called from a callback): the agent
        # outlives close, and every call into it is serialised, so a late poll is harmless.
        if threading.current_thread() is not self._poller:
            self._poller.join(timeout=2.0)
        with self._xlock:
            handles = [h for h, _ in self._xfers.values()] + self._zombies
            self._xfers, self._zombies = {}, []
        for h in handles:
            self._release(h)
