"""Worker side of the prefill messenger: post each layer's writes while the forward runs.

Scheduler side (prefill.py): before a forward, ``submit()`` hands over the chunks that
forward computes - per chunk the write groups of every layer, and the groups of pages
that already exist (a cached prefix) - and after it ``wait()`` returns once every layer
was posted. Worker side (this thread): for layer L it blocks until the layer counter
(layers.py) has passed L since the submit, then posts layer L's groups; it never spins.
Completion is unchanged: the decoder counts the same writes by immediate. The counter is
a word the device writes (layers.py, devices/): on CUDA the forward is still running on the
GPU when submit() returns, and the streamer follows the word, not the Python enqueue.

Without a counter (``stream=False``) the same chunks are posted whole after the forward.
A speculative draft's layers (registered after the target's) are computed by the draft's
own forward after the target's, which the counter does not follow: they go in ``tail``.

Other TP ranks' pages (the leader posts for its whole server) run one layer behind: the
counter ticks after the leader's o_proj, and SGLang reduces o_proj's partial sums later
in the layer (fused with the next norm), so only the leader's layer L+1 proves that every
rank finished layer L. Their groups of layer L sit under ``by_layer[L + 1]``, and those
of the last layer in ``tail``, which the scheduler posts once the forward returned.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .layers import LayerCounter
from .planner import WriteGroup
from ..threads import Thread as NamedThread

logger = logging.getLogger("sglang_disagg.messenger")

LAYER_TIMEOUT_S = 60.0  # a forward that never reaches a layer (it died): fail its chunks


@dataclass(slots=True, eq=False)
class Chunk:
    """One order's share of one forward on this rank."""

    rec: Any                                                      # prefill.Record
    ready: list[WriteGroup] = field(default_factory=list)         # pages that already exist
    by_layer: dict[int, list[WriteGroup]] = field(default_factory=dict)
    tail: list[WriteGroup] = field(default_factory=list)          # posted after the forward returned

    def place(self, groups: list[WriteGroup], own_rank: int, num_layers: int) -> None:
        """File freshly computed pages' groups by the layer whose end proves them written:
        this rank's at their own layer, other ranks' one layer later (see above). Layers
        from `num_layers` on are not the counted model's (a speculative draft's, computed
        after the target's forward): the tail."""
        for g in groups:
            if g.layer >= num_layers:
                self.tail.append(g)
            elif g.src_rank == own_rank:
                self.by_layer.setdefault(g.layer, []).append(g)
            elif g.layer + 1 < num_layers:
                self.by_layer.setdefault(g.layer + 1, []).append(g)
            else:
                self.tail.append(g)


@dataclass(slots=True, eq=False)
class Ticket:
    chunks: list[Chunk]
    base: int
    done: threading.Event = field(default_factory=threading.Event)


class Streamer:
    def __init__(self, counter: LayerCounter, num_layers: int, post: Callable[[Chunk, list[WriteGroup]], None],
                 early: bool = False, settle: Callable[[Chunk], None] | None = None) -> None:
        """`post(chunk, groups)` posts and accounts writes (thread-safe); `early` posts
        every layer at submit, before its KV exists, and waits with `settle(chunk)` until
        they completed (a negative control only)."""
        self.counter, self.num_layers, self._post, self.early = counter, num_layers, post, early
        self._settle = settle or (lambda chunk: None)
        self._queue: queue.Queue[Ticket | None] = queue.Queue()
        self._thread = NamedThread(target=self._run, name="messenger-stream", daemon=True)
        self._thread.start()

    def submit(self, chunks: list[Chunk]) -> Ticket:
        ticket = Ticket(chunks, self.counter.arm())
        self._queue.put(ticket)
        if self.early:  # the negative control: everything written before the forward starts
            self.wait(ticket)
            for c in chunks:
                self._settle(c)
        return ticket

    def wait(self, ticket: Ticket, timeout_s: float = LAYER_TIMEOUT_S) -> bool:
        return ticket.done.wait(timeout_s)

    def close(self) -> None:
        self._queue.put(None)
        self.counter.close()
        self._thread.join(timeout=2.0)

    def _run(self) -> None:
        while True:
            ticket = self._queue.get()
            if ticket is None:
                return
            try:
                self._stream(ticket)
            except Exception:  # noqa: BLE001 - a bug here must fail the chunks, not the thread
                logger.exception("messenger: streaming a forward failed")
                for c in ticket.chunks:
                    c.rec.failed = c.rec.failed or "streaming the KV writes failed (see the prefill log)"
            finally:
                ticket.done.set()

    def _stream(self, ticket: Ticket) -> None:
        for c in ticket.chunks:
            if c.ready:
                self._post(c, c.ready)
        for layer in range(self.num_layers):
            if not self.early and not self.counter.wait_past(ticket.base + layer + 1, LAYER_TIMEOUT_S):
                for c in ticket.chunks:
                    c.rec.failed = c.rec.failed or f"the forward never finished layer {layer}"
                return
            now = time.monotonic()
            for c in ticket.chunks:
                groups = c.by_layer.get(layer)
                if groups:
                    c.rec.times.setdefault("layer0_posted" if layer == 0 else "layers_posted", now)
                    c.rec.times["last_layer_posted"] = now
                    self._post(c, groups)
