"""What a prefill rank keeps per decoder and per order."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from . import wire
from .inputs import DecoderKey
from .planner import ShardPlan


@dataclass(slots=True, eq=False)
class DecoderLink:
    """This rank's view of one decoder: peers and regions of the decode ranks it writes."""

    hello: wire.Hello
    plan: ShardPlan
    peers: dict[int, Any] = field(default_factory=dict)
    remote: dict[int, list[Any]] = field(default_factory=dict)
    error: str = ""


@dataclass(slots=True, eq=False)
class Record:
    """One order on one prefill rank. `posted`/`completed` count write batches; the
    scheduler thread and the streamer post, backend threads complete (all under _lock)."""

    seq: int
    rid: str
    key: DecoderKey
    order: wire.PrefillOrder
    req: Any = None
    sent: int = 0            # pages planned for writing so far
    posted: int = 0
    writes: int = 0          # single writes in the posted batches: what the decoder counts
    completed: int = 0
    failed: str = ""         # this rank: why its writes failed
    refused: bool = False    # SGLang refused the order as given (too long, ...): the order's fault
    held: bool = False       # finished; waiting for its writes before release
    checkpoint: bool = False
    cancelled: bool = False
    done: bool = False       # released (or never admitted): answer the decoder, forget
    times: dict = field(default_factory=dict)  # monotonic timestamps, for traces and benchmarks
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def posted_one(self, writes: int) -> None:
        with self._lock:
            self.posted += 1
            self.writes += writes

    def on_write_done(self, fut: Any, layer: int | None, last_layer: int, wakeup: Any) -> None:  # backend thread
        err = fut.exception()
        with self._lock:
            if err is not None and not self.failed:
                self.failed = f"KV write failed: {err}"
            self.completed += 1
            self.times["last_write"] = time.monotonic()
        if layer in (0, last_layer):  # the last of the layer's batches wins
            self.times["layer0_written" if layer == 0 else "last_layer_written"] = time.monotonic()
        wakeup.set()

    @property
    def writes_done(self) -> bool:
        with self._lock:
            return self.completed == self.posted
