"""Prefill side, the writes of an order: which pages of a request are complete once the current
forward ends, as write groups (per layer when streaming), and posting them to the decoder.

A mixin of PrefillMessenger (prefill.py), split out as the one concept that turns a forward's
progress into posted writes: `_chunk` runs on every rank in the scheduler thread (page ids
are alike on every rank; only the leader builds groups and posts for all), `_post` on the
scheduler or the streamer thread, `_written` on a backend thread (it only records the
completion and wakes the scheduler).
"""

from __future__ import annotations

import time
from typing import Any

from ..backends import TransferError
from .faults import ENV as FAULT_ENV
from .kvpool import post
from .orders import Record
from .planner import WriteGroup, pages_for
from .requests import ORDER_ATTR
from .stream import Chunk


class ChunkWrites:
    """What PrefillMessenger supplies: node, ranks, sched, decoders, stats, by_source,
    backend, _fail_writes and _corrupt."""

    def _chunk(self, req: Any, by_layer: bool) -> Chunk | None:
        """The pages `req` has complete once the current forward ends, not written yet, as
        write groups: per layer when streaming (pages of a cached prefix exist already)."""
        rec = getattr(req, ORDER_ATTR, None)
        if rec is None or rec.failed or rec.held:
            return None
        ps, o = self.node.page_size, rec.order
        total = len(o.token_ids)
        upto = pages_for(total, ps) if req.extend_end >= total else req.extend_end // ps
        if upto <= rec.sent:
            return None
        plan = self.decoders[rec.key].plan.for_request(o.tag)  # MLA: this request's source replicas
        if rec.sent == 0 and self.ranks.is_leader:
            for src in {p.src_rank for p in plan.pieces}:
                self.by_source[src] = self.by_source.get(src, 0) + 1
        row = self.sched.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
        first, cached = rec.sent, max(rec.sent, min(upto, req.prefix_len // ps))
        chunk = Chunk(rec)
        if not self.ranks.is_leader:  # page ids are alike on every rank; the leader posts for all
            self.stats["pages_sent"] += upto - rec.sent
            rec.sent = upto
            return None
        if cached > first or not by_layer:
            end = cached if by_layer else upto
            chunk.ready = plan.groups((row[first * ps:end * ps:ps] // ps).tolist(), o.dst_pages[first:end])
        if by_layer and upto > cached:
            chunk.place(plan.groups((row[cached * ps:upto * ps:ps] // ps).tolist(), o.dst_pages[cached:upto]),
                        self.ranks.rank, self.node.view.target_layers)
        self.stats["pages_sent"] += upto - rec.sent
        rec.sent = upto
        rec.times.setdefault("forward_start", time.monotonic())
        return chunk

    def _post(self, chunk: Chunk, groups: list[WriteGroup]) -> None:
        """Post write groups of one order (scheduler thread or streamer thread)."""
        rec = chunk.rec
        link = self.decoders[rec.key]
        m = self.node.metrics
        rec.times.setdefault("first_post", time.monotonic())
        try:
            if self._fail_writes:
                raise TransferError(f"injected fault ({FAULT_ENV}=fail_writes): this server cannot write into "
                                    "the decoder's pages")
            if self._corrupt is not None:
                self._corrupt.apply(self.node.addresses[self._corrupt.rank], self.node.view.region, groups,
                                    rec.order.rid)
            for g in groups:
                fut = post(self.backend, link.peers[g.dst_rank], g, self.node.regions[g.src_rank],
                           link.remote[g.dst_rank], rec.order.tag, len(self.node.view.geometry.kinds))
                rec.posted_one(g.writes)
                self.stats["writes_posted"] += g.writes
                m.writes.inc(g.writes)
                m.bytes.inc(g.nbytes)
                layer = None if groups is chunk.ready else g.layer  # streamed groups time the layers
                fut.add_done_callback(lambda f, layer=layer, t=time.monotonic(): self._written(rec, f, layer, t))
        except Exception as e:  # noqa: BLE001 - the order fails; posted writes still drain
            rec.failed = f"posting KV writes failed: {e}"

    def _written(self, rec: Record, fut: Any, layer: int | None, posted_at: float) -> None:  # backend thread
        last = self.node.view.geometry.num_layers - 1
        rec.on_write_done(fut, layer, last, self.node.wakeup)
        if layer is not None:
            self.node.metrics.layer.observe(time.monotonic() - posted_at)

    @staticmethod
    def _settle(chunk: Chunk, timeout_s: float = 10.0) -> None:
        """Wait until every write posted for the chunk's order completed (negative control)."""
        deadline = time.monotonic() + timeout_s
        while not chunk.rec.writes_done and time.monotonic() < deadline:
            time.sleep(0.001)

