"""Decode side, how a request leaves the messenger: handed to SGLang once its KV landed, failed
with its reason, re-routed once, its pages released or quarantined.

A mixin of DecodeMessenger (decode.py), split out as the one concept of a request's end: all
of it runs in the scheduler thread, on every TP rank alike except where it says leader
(cancels are sent by the leader, whose links they use).
"""

from __future__ import annotations

from http import HTTPStatus

import logging
import os
import time

from . import wire
from .entry import (CANCEL_TIMEOUT_S, LATE_WRITES_S, Cancel, Entry, Phase, Release, Settle, release_step, settle,
                    settle_due)
from .links import LinkState
from .metrics import Cause
from .requests import HANDOFF_ATTR, LOCK_ATTR, fail_request, release

logger = logging.getLogger("sglang_disagg.messenger")

TRACE = os.environ.get("SGLANG_DISAGG_TRACE") == "1"  # one timing line per request, for profiling
# Failures that count against the request's prefill link (Links.outcome): its server failed
# a valid order, or its writes never came. Not the order's own (INTAKE) nor the client's.
LINK_FAULTS = (Cause.PREFILL, Cause.TRANSFER)


class RequestEndings:
    """What DecodeMessenger supplies: node, sched, entries, links, backend, fault, stats,
    recent and _first_step."""

    def _reroute(self, e: Entry) -> None:
        """Back to ROUTE with a fresh tag; the old one stays retired (nothing of it landed)."""
        old, link = e.tag, e.link
        logger.warning("messenger: %s: prefill server %s is gone before any write landed; asking another",
                       e.req.rid, link)
        self._settle_link(e)
        e.tag, e.link, e.phase, e.since, e.routed, e.rerouted = -1, "", Phase.ROUTE, time.monotonic(), False, True
        e.landed, e.failed, e.cause, e.lost, e.first_landed = False, "", None, 0.0, False
        if self.backend is not None and old >= 0:
            self.backend.retire(old, "re-routed")
        self.stats["requests_rerouted"] += 1
        self.node.metrics.requests.labels("rerouted").inc()
        self.node.wakeup.set()

    def _leader_release_decisions(self) -> None:
        now = time.monotonic()
        for e in self.entries.values():
            if e.phase not in (Phase.RELEASE, Phase.QUARANTINE) or e.release:
                continue
            link = self.links.links.get(e.link) if e.link else None
            if e.answered:
                gone = link is None or link.state is LinkState.GONE
                if not gone and not settle_due(e, now):
                    continue
                landed = -1 if gone else self.backend.landed(e.tag)  # a DP group asks its owner: once
                verdict = settle(e, landed, now, gone)
                if verdict is Settle.GIVE_UP:
                    self.stats["late_writes_given_up"] += 1
                    logger.error("messenger: %s: %s posted %d writes, %d arrived in %.0f s after its answer; freeing "
                                 "the pages (a write arriving later would land in reused pages)", e.req.rid, e.link,
                                 e.posted, landed + int(e.first_landed), LATE_WRITES_S)
                if verdict is not Settle.WAIT:
                    e.release = Release.FREE
                continue
            if release_step(e, link, now) is Cancel.SEND:
                try:
                    link.send(wire.Cancel(rid=e.req.rid, tag=e.tag))
                except Exception:  # noqa: BLE001 - the link died: wait for it to come back or be gone
                    pass

    def _hand_off(self, e: Entry) -> None:
        req, sched = e.req, self.sched
        del self.entries[e.seq]
        self._settle_link(e)
        if self.links is not None and e.link:
            self.links.outcome(e.link)
        if self.fault is not None and e.start_page < len(e.pages):
            self.fault.apply(self.node.view, e.pages[e.start_page:])  # never the tree's shared pages
        req.prefix_len = e.n_tokens
        setattr(req, HANDOFF_ATTR, e.n_tokens)
        # Our lock on the reused prefix must hold until SGLang admits the request, whose
        # admission takes a lock of its own and overwrites req.lock: ours is released then.
        setattr(req, LOCK_ATTR, req.lock)
        sched.waiting_queue.append(req)
        req.time_stats.set_wait_queue_entry_time()
        req.arrival_processed_tokens = sched.processed_tokens_counter
        self.stats["requests_carried"] += 1
        self.stats["writes_received"] += e.writes
        m, now = self.node.metrics, time.monotonic()
        m.requests.labels("carried").inc()
        m.writes.inc(e.writes)
        m.bytes.inc(e.bytes)
        t = e.times
        m.observe_ttft("memory", t.get("take"), t.get("route"))
        m.observe_ttft("prefill", t.get("sent"), t.get("landed"))
        if "sent" in t and "landed" in t:
            m.transfer.observe(max(0.0, t["landed"] - t["sent"]))
        if len(self._first_step) < 4096:  # bounded: entries of requests that never decode are dropped
            self._first_step[req.rid] = now
        self.recent.append({"rid": req.rid, "tokens": e.n_tokens, "pages": len(e.pages), "reused": e.start_page,
                            "writes": e.writes} | e.times | {"handoff": time.monotonic()})
        if TRACE:
            t = e.times | {"handoff": time.monotonic()}
            logger.info("messenger trace %s: take at %.4f (monotonic), %d tokens, %d pages, %d writes; "
                        "ms since take: %s", req.rid[:8], e.times["take"], e.n_tokens, len(e.pages), e.expected,
                        ", ".join(f"{k} {1000 * (v - t['take']):.1f}" for k, v in t.items()))

    def _fail(self, e: Entry, reason: str, cause: Cause) -> None:
        if self.links is not None and e.link and cause in LINK_FAULTS and not e.lost:
            self.links.outcome(e.link, reason)  # a lost connection is the link thread's concern
        self.stats["requests_failed"] += 1
        self.node.metrics.fail(cause)
        logger.warning("messenger: request %s failed: %s", e.req.rid, reason)
        fail_request(self.sched, e.req, reason)
        if e.tag >= 0 and self.backend is not None:
            self.backend.retire(e.tag, reason)
        e.phase, e.failed, e.since = Phase.RELEASE, reason, time.monotonic()

    def _finish_failed(self, e: Entry, reason: str, cause: Cause, status: HTTPStatus | None = None) -> None:
        """Fail a request no write was ever asked for: free its pages now."""
        self.stats["requests_failed"] += 1
        self.node.metrics.fail(cause)
        fail_request(self.sched, e.req, reason, *(() if status is None else (status,)))
        del self.entries[e.seq]
        release(self.sched, e.req)

    def _release(self, e: Entry, quarantine: bool) -> None:
        if quarantine:
            # The prefill server did not confirm the cancel: a write may still land in these
            # pages, so nobody gets them until it answers after all or is gone.
            e.phase, e.release = Phase.QUARANTINE, Release.UNDECIDED
            self.stats["pages_quarantined"] += len(e.pages)
            logger.error("messenger: %d pages of %s quarantined: %s did not confirm the cancel in %.0f s",
                         len(e.pages), e.req.rid, e.link, CANCEL_TIMEOUT_S)
            return
        del self.entries[e.seq]
        self._settle_link(e)
        release(self.sched, e.req)

    def _settle_link(self, e: Entry) -> None:
        if self.links is not None and e.link:
            self.links.links[e.link].outstanding -= 1

