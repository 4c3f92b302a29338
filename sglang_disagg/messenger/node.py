"""One TP rank's messenger endpoint: its transfer backend, its registered KV pool, its
rank group, and (on the leader) the thread that reads control messages."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from ..backends import BackendConfig, DeadlineExceeded, create_backend
from ..backends.base import TransferBackend
from . import compat, wire
from .config import MessengerConfig, MessengerRole
from .kvpool import KVPoolView
from .ranks import RankGroup
from .wakeup import Wakeup

logger = logging.getLogger("sglang_disagg.messenger")


class Node:
    def __init__(self, cfg: MessengerConfig, scheduler: Any) -> None:
        from sglang.srt.runtime_context import get_parallel

        par = get_parallel()
        self.cfg = cfg
        self.ranks = RankGroup(par.tp_rank, par.tp_size, scheduler.tp_cpu_group)
        pool = scheduler.token_to_kv_pool_allocator.get_kvcache()
        self.view = KVPoolView.from_pool(pool, scheduler.model_config.get_total_num_kv_heads())
        self.page_size = self.view.geometry.page_size
        listen = cfg.port if (self.ranks.is_leader and cfg.role is MessengerRole.PREFILL) else 0
        self.backend: TransferBackend = create_backend(
            cfg.backend, BackendConfig(provider=cfg.provider, host=cfg.host, port=listen))
        self.regions, descriptors = self.view.register(self.backend)
        me = wire.RankEndpoint(self.ranks.rank, self.backend.address, self.backend.instance, tuple(descriptors))
        self.endpoints: tuple[wire.RankEndpoint, ...] = tuple(self.ranks.gather(me))
        args = scheduler.server_args
        model_path = str(args.model_path)
        name = args.served_model_name or model_path
        self.name = cfg.name or f"{cfg.role.value}@{self.backend.address}"
        self.spec = self.view.spec(os.path.basename(str(name).rstrip("/")), compat.fingerprint(model_path),
                                   self.ranks.size)
        self.wakeup = Wakeup()
        self.stats_file = StatsFile(cfg.stats_file if self.ranks.is_leader else "")
        self._stop = threading.Event()
        self._reader: threading.Thread | None = None
        logger.info("messenger %s rank %d/%d: %s/%s on %s, %d KV regions (%s, page %d)", cfg.role.value,
                    self.ranks.rank, self.ranks.size, self.backend.name, self.backend.provider or "-",
                    self.backend.address, len(self.regions), self.view.geometry.layout.value, self.page_size)

    def start_reader(self, handle: Callable[[Any, wire.Message], None]) -> None:
        """Leader only: read control messages from peers and hand decoded ones to `handle`."""
        def loop() -> None:
            while not self._stop.is_set():
                try:
                    peer, raw = self.backend.recv(0.5)
                except DeadlineExceeded:
                    continue
                except Exception:  # noqa: BLE001 - closed backend
                    return
                try:
                    msg = wire.decode(raw)
                except wire.WireError as e:
                    logger.warning("messenger: bad control message from %s: %s", peer.address, e)
                    continue
                try:
                    handle(peer, msg)
                except Exception:  # noqa: BLE001 - one bad message must not stop the reader
                    logger.exception("messenger: handling %s from %s failed", type(msg).__name__, peer.address)
        self._reader = threading.Thread(target=loop, name="messenger-control", daemon=True)
        self._reader.start()

    def describe(self, scheduler: Any) -> dict:
        grammar = getattr(scheduler.grammar_manager, "grammar_backend", None)
        return {"role": self.cfg.role.value, "name": self.name, "backend": self.backend.name,
                "provider": self.backend.provider, "address": self.backend.address, "tp": self.ranks.size,
                "page_size": self.page_size, "layout": self.view.geometry.layout.value,
                # Structured output lives on decoders only: a prefill server compiles none.
                "grammars_compiled": len(getattr(grammar, "cache", ()) or ())}

    def close(self) -> None:
        self._stop.set()
        self.backend.close()
        if self._reader is not None:
            self._reader.join(timeout=2.0)
        self.wakeup.close()


class StatsFile:
    """The leader's counters as a JSON file, rewritten atomically at most every `every_s`
    (read by the launcher's --smoke and by tests; Prometheus is a separate concern).
    Building the snapshot is deferred until a write is due, so the scheduler pays nothing
    in the iterations between two writes."""

    def __init__(self, path: str, every_s: float = 0.2) -> None:
        self.path, self.every_s = path, every_s
        self._last = 0.0
        self._written: dict | None = None

    def publish(self, snapshot: Callable[[], dict]) -> None:
        if not self.path:
            return
        now = time.monotonic()
        if now - self._last < self.every_s:
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
