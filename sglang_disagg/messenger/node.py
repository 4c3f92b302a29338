"""One TP rank's messenger endpoint: its transfer backend, its registered KV pool, its
rank group, and (on the leader) the thread that reads control messages."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from ..backends import BackendConfig, PeerLostError, auth, create_backend
from ..backends.notifications import NotifDrops
from ..backends.regions import HOST, cuda
from ..ipc import cumem, handover, shm
from . import compat, speculative, wire
from .config import MessengerConfig, MessengerRole
from .dp.groups import Groups, open_groups
from .dp.place import Place
from .kvpool import KVPoolView
from .metrics import MessengerMetrics
from .ranks import RankGroup
from .reader import ControlReader
from .transport import Transport
from .wakeup import Wakeup

logger = logging.getLogger("sglang_disagg.messenger")


class Node:
    """The server's messenger endpoint: ONE transfer backend, on TP rank 0 (the leader),
    drives the KV memory of every rank. Every rank's pool lives in shared memory (kv_zeros:
    a memfd on CPU, a cuMem allocation on GPU); the other ranks tell the leader where
    (shm.locate / cumem.export), the leader maps their buffers and
    registers all of them, so pages of every rank move through one backend instance and one
    connection per peer server. Non-leader ranks keep no backend: they follow the leader's
    decisions through the scheduler's broadcast and ranks.agree().
    With data parallelism (dp/) the ranks are a DP group's and each group has a Node of its
    own: group 0's leader holds the server's one backend and serves the other groups, whose
    leaders reach it through a proxy; Node sees either through `self.dp` (dp/groups.py), the
    same way as without DP."""

    def __init__(self, cfg: MessengerConfig, scheduler: Any) -> None:
        self.cfg = cfg
        place = Place.of(scheduler, cfg.role.value)
        self.group, self.groups = place.group, place.groups
        self.ranks = RankGroup(place.rank, place.size, place.cpu_group)
        pool = scheduler.token_to_kv_pool_allocator.get_kvcache()
        self.view = KVPoolView.from_pool(pool, scheduler.model_config.get_total_num_kv_heads(),
                                         speculative.draft_pool(scheduler))
        self.page_size = self.view.geometry.page_size
        # Where this rank's buffers live, for the leader to map (its own need no mapping). On
        # GPU the leader gathers the address of its inbox instead, where the ranks then send
        # their cuMem allocations' descriptors (handover.py: SCM_RIGHTS, no ptrace rights).
        on_gpu = bool(self.view.tensors) and self.view.tensors[0].is_cuda
        inbox = handover.Inbox() if on_gpu and self.ranks.is_leader and self.ranks.size > 1 else None
        if self.ranks.is_leader:
            mine = inbox.address if inbox is not None else None
        else:
            mine = [_backing(t) for t in self.view.tensors]
        backings = self.ranks.gather(mine)
        fds: dict[int, dict[int, int]] = {}
        if on_gpu and not self.ranks.is_leader:
            handover.give(backings[0], self.ranks.rank, mine)
        if inbox is not None:
            try:
                fds = inbox.collect({r: backings[r] for r in range(1, self.ranks.size)})
            finally:
                inbox.close()
        self.regions: dict[int, list[Any]] = {}  # rank -> its (layer, kind) regions, leader only
        self.addresses: dict[int, list[int]] = {}  # rank -> where those regions are mapped here (leader)
        self._mappings: list[shm.Mapping | cumem.Imported] = []
        endpoints: list[wire.RankEndpoint] = []
        secret = _require_secret() if self.ranks.is_leader else None

        def make_backend() -> Transport:
            listen = cfg.port if cfg.role is MessengerRole.PREFILL else 0
            return create_backend(cfg.backend, BackendConfig(
                provider=cfg.provider, host=cfg.host, port=listen, secret=secret, rails=cfg.rails,
                handshake_timeout_s=min(2.0, cfg.connect_timeout_s)))

        # One backend per server, on the leader of its (first) group; dp/groups.py.
        self.dp: Groups = open_groups(place, self.ranks.is_leader, cfg.role, secret, make_backend)
        self.backend: Transport | None = self.dp.backend
        if self.ranks.is_leader:
            for rank in range(self.ranks.size):
                if rank == 0:
                    regions, descriptors = self.view.register(self.backend)
                    self.addresses[rank] = [t.data_ptr() for t in self.view.tensors]
                else:
                    regions, descriptors = self._register_peer_rank(rank, backings[rank], fds.get(rank, {}))
                self.regions[rank] = regions
                endpoints.append(wire.RankEndpoint(rank, self.backend.address, self.backend.instance,
                                                   tuple(descriptors)))
        self.endpoints: tuple[wire.RankEndpoint, ...] = tuple(endpoints)
        self.backends_in_server = self.ranks.agree([int(self.backend is not None)])[0]
        args = scheduler.server_args
        model_path = str(args.model_path)
        name = args.served_model_name or model_path
        self.name = cfg.name or f"{cfg.role.value}@{self.backend.address if self.backend else '?'}"
        self.spec = self.view.spec(os.path.basename(str(name).rstrip("/")), compat.fingerprint(model_path),
                                   self.ranks.size, *speculative.draft_identity(args))
        self.wakeup = Wakeup()
        self.stats_file = StatsFile(group_stats_file(cfg.stats_file, self.group) if self.ranks.is_leader else "")
        # Every rank updates its own registry; only the owner's is served (one port per server).
        self.metrics = MessengerMetrics(cfg.role.value, cfg.host,
                                        cfg.metrics_port if self.ranks.is_leader and self.group == 0 else 0)
        self._stop = threading.Event()
        self._reader: ControlReader | None = None
        self._owner_lost_at = 0.0
        if self.backend is not None:
            logger.info("messenger %s: %s/%s on %s drives the KV of %d rank(s), %d regions each (%s, page %d)%s",
                        cfg.role.value, self.backend.name, self.backend.provider or "-", self.backend.address,
                        self.ranks.size, len(self.regions[0]), self.view.geometry.layout.value, self.page_size,
                        f"; DP group {self.group} of {self.groups}" if self.groups > 1 else "")

    def _register_peer_rank(self, rank: int, backings: list[Any], fds: dict[int, int]) -> tuple[list[Any], list[str]]:
        """Map one rank's buffers here and register them. GPU: each cuMem allocation is
        imported once (`fds`: key -> its descriptor, owned from here on) and its tensors
        (K and V halves of one allocation) are registered at their offsets in it."""
        regions, descriptors, addresses = [], [], []
        imported: dict[int, cumem.Imported] = {}
        try:
            for backing in backings:
                if isinstance(backing, cumem.Export):  # GPU: the rank's cuMem allocation
                    m = imported.get(backing.key)
                    if m is None:
                        m = imported[backing.key] = cumem.Imported(backing, fds.pop(backing.key))
                        self._mappings.append(m)
                    addr, length, memory = m.base + backing.offset, backing.length, cuda(backing.device)
                else:
                    *where, length = backing
                    m = shm.Mapping(shm.Backing(*where), length)
                    self._mappings.append(m)
                    addr, memory = m.addr, HOST
                region, desc = self.backend.register(addr, length, memory)
                regions.append(region)
                descriptors.append(desc.decode())
                addresses.append(addr)
        finally:
            for f in fds.values():  # descriptors of allocations no buffer named
                os.close(f)
        self.addresses[rank] = addresses
        return regions, descriptors

    def start_reader(self, handle: Callable[[Any, wire.Message], None]) -> None:
        """Leader only: read control messages from peers and hand decoded ones to `handle`
        (a DP server's owner hands each to the group it is for, dp/owner.py). One peer's bad
        message costs at most that peer's connection, never the thread (reader.py)."""
        self._reader = ControlReader(self.backend, self.dp.dispatcher(handle), self.name, self._stop)
        self._reader.start()

    def wakeup_fd(self) -> int | None:
        """What the leader's scheduler polls for messenger events; None on other ranks."""
        return self.wakeup.fd if self.ranks.is_leader else None

    def describe(self, scheduler: Any) -> dict:
        grammar = getattr(scheduler.grammar_manager, "grammar_backend", None)
        return {"role": self.cfg.role.value, "name": self.name, "pid": os.getpid(), "backend": self.backend.name,
                "provider": self.backend.provider, "address": self.backend.address, "tp": self.ranks.size,
                # One backend instance in the whole server drives every rank's KV.
                "backends": self.backends_in_server, "ranks_driven": len(self.regions),
                "page_size": self.page_size, "layout": self.view.geometry.layout.value,
                # One page of every layer, each KV head once (a migration's or transfer's floor).
                "kv_page_bytes": self.view.geometry.num_layers * sum(
                    self.view.geometry.page_bytes(k, self.view.geometry.kv_heads) for k in self.view.geometry.kinds),
                "dp_group": self.group, "dp_groups": self.groups,
                # Structured output lives on decoders only: a prefill server compiles none.
                "grammars_compiled": len(getattr(grammar, "cache", ()) or ())}

    def backend_gauges(self) -> dict[str, dict[str, float]]:
        """What hostile or broken peers cost this node's backend, for the metrics (HTTP thread).
        Only where the backend lives: a DP group's proxy would ask its owner, which reports its own."""
        if self.backend is None or not self.dp.local:
            return {}
        try:
            stats = self.backend.stats()
        except Exception:  # noqa: BLE001 - a backend closing under a scrape: these gauges are left out once
            return {}
        return {"sglang_disagg_control_connections_dropped": {
                    why: stats.get(f"connections_{why}", 0) for why in ("evicted", "refused")},
                "sglang_disagg_notifications_dropped": {
                    reason: stats.get(f"{reason}_notifications_dropped", 0) for reason in NotifDrops.REASONS}
                | {"unasked": stats.get("foreign_credits_dropped", 0)},
                "sglang_disagg_late_writes": {"discarded": stats.get("late_writes_dropped", 0)},
                # one rail (0) for backends without rails: all they posted
                "sglang_disagg_rail_bytes": {str(i): stats.get(f"rail{i}_bytes", stats.get("bytes_posted", 0))
                                             for i in range(stats.get("rails", 1))},
                "sglang_disagg_rail_writes": {str(i): stats.get(f"rail{i}_writes", stats.get("writes_posted", 0))
                                              for i in range(stats.get("rails", 1))},
                "sglang_disagg_rail_up": {str(i): stats.get(f"rail{i}_up", 1) for i in range(stats.get("rails", 1))}}

    def owner_gone(self) -> str:
        """DP group > 0: why the server's backend is out of reach ("" while the owner lives)."""
        return self.dp.gone

    def stop_if_owner_gone(self, fail_all: Callable[[str], None]) -> None:
        """DP group > 0, each step: the owner (group 0's leader) died. Fail what this group
        holds, with the reason, then stop the scheduler (SGLang takes the whole server down
        then): a server that lost its one backend must not serve half-alive. The grace lets
        the failures reach their clients first."""
        why = self.owner_gone()
        if not why:
            return
        if self._owner_lost_at == 0.0:
            self._owner_lost_at = time.monotonic()
            fail_all(f"this server's messenger is gone ({why})")
        elif time.monotonic() - self._owner_lost_at > OWNER_GRACE_S:
            raise RuntimeError(f"messenger: DP group {self.group}: {why}; stopping this server, which lost its "
                               "transfer backend (it would serve half-alive)")
        self.wakeup.set()  # come back for the deadline

    @contextlib.contextmanager
    def owner_may_go(self, fail_all: Callable[[str], None]):
        """DP group > 0, around a step: the owner can die after stop_if_owner_gone looked, and
        a call to it then raises PeerLostError. That ends the step and the group fails what it
        holds, as the next step would; the scheduler does not die of the exception with its
        clients unanswered (seen: a request being routed asked the owner for a tag)."""
        try:
            yield
        except PeerLostError:
            if not self.owner_gone():
                raise
            self.stop_if_owner_gone(fail_all)

    def close(self) -> None:
        self._stop.set()
        self.metrics.close()
        self.dp.close()
        if self._reader is not None:
            self._reader.join(timeout=2.0)
        for m in self._mappings:
            m.close()
        self.wakeup.close()


OWNER_GRACE_S = 1.0   # a group that lost the owner fails its requests, then stops its server this much later


def group_stats_file(path: str, group: int) -> str:
    """Group 0 publishes at `path`; group g at x.groupG.json next to it."""
    if not path or group == 0:
        return path
    stem, dot, ext = path.rpartition(".")
    return f"{stem}.group{group}.{ext}" if dot else f"{path}.group{group}"


def _require_secret() -> bytes:
    """Messenger ports accept only peers that prove the deployment's shared secret."""
    secret = auth.load_secret()
    if secret is None:
        raise RuntimeError(f"messenger mode needs the deployment's shared secret: set {auth.SECRET_FILE_ENV} "
                           f"(a file holding it) or {auth.SECRET_ENV}; every prefill and decode server of the "
                           "deployment must use the same one (python -m sglang_disagg.launch does this for a local "
                           "stack and takes --secret-file across machines)")
    return secret


def _backing(t: Any) -> Any:
    """How the leader maps this rank's KV buffer `t`: a cuMem export on GPU, else the
    shared file behind it (shm.Backing's fields, then the length)."""
    if t.is_cuda:
        return cumem.export(t)
    n = t.numel() * t.element_size()
    return dataclasses.astuple(shm.locate(t.data_ptr(), n)) + (n,)


class StatsFile:
    """The leader's counters as a JSON file, rewritten atomically at most every `every_s`
    (read by the launcher's --smoke and by tests; Prometheus is a separate concern).
    Building the snapshot is deferred until a write is due, so the scheduler pays nothing
    in the iterations between two writes."""

    def __init__(self, path: str, every_s: float = 0.2) -> None:
        self.path, self.every_s = path, every_s
        self._last = 0.0
        self._written: dict | None = None

    def publish(self, snapshot: Callable[[], dict], force: bool = False) -> None:
        """`force`: write now whatever the last write's age (an event a reader waits for, after
        which the scheduler may go idle and write nothing more)."""
        if not self.path:
            return
        now = time.monotonic()
        if now - self._last < self.every_s and not force:
            return
        self._last = now
        stats = snapshot()
        if stats == self._written:
            return
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump(stats, f, sort_keys=True)
        os.replace(tmp, self.path)
        self._written = stats
