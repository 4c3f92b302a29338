"""Prometheus metrics of a server's messenger (the leader's), on their own registry and port.

Scraped at ``http://HOST:PORT/metrics`` (the launcher gives prefill servers ``--port`` + 8,
decode servers ``--port`` + 9). Built with prometheus_client; the scheduler thread and the
backends' threads update them, the HTTP thread only reads.

A request's time to first token, split where each part is known:
  decode  ``memory``      taken -> routed (pages allocated, a prefill server chosen)
          ``prefill``     order sent -> every write landed (the prefill server's queue,
                          compute and the transfer tail, as the decoder sees them)
          ``first_step``  handed to SGLang's batch -> end of the forward that samples
                          its first output token
  prefill ``queue``       order admitted -> its first forward starts
          ``compute``     first forward starts -> last forward ends
          ``tail``        last forward ends -> last write completed (0 when streaming
                          finished the writes before the forward returned)
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("sglang_disagg.messenger")

# Writes take tens of microseconds (shmem) to seconds (a long prompt over TCP).
_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
GAUGES = {  # name -> (help, label)
    "sglang_disagg_kv_pages": ("KV pages of this server: allocated (including the radix cache's), cached "
                               "(held by the radix cache only), locked (radix cache pages in use), free",
                               "state"),
    "sglang_disagg_requests_in_flight": ("Requests the messenger holds, by phase", "phase"),
    "sglang_disagg_queue_depth": ("SGLang's scheduler queues", "queue"),
    "sglang_disagg_peer_outstanding": ("Requests in flight per peer server", "peer"),
    # Counts since start (exported as gauges read from the backend at each scrape).
    "sglang_disagg_control_connections_dropped": ("Control connections the messenger port closed before they "
                                                  "said HELLO: evicted for a newcomer, or refused with every slot "
                                                  "admitted", "why"),
    "sglang_disagg_metrics_connections_dropped": ("Connections this metrics port cut: evicted for a newcomer "
                                                  "at its connection limit, or past its request deadline", "why"),
    "sglang_disagg_notifications_dropped": ("Data-plane notifications dropped unbelieved (NIXL, Mooncake), by "
                                            "reason; unasked: writes credited by an authenticated peer other than "
                                            "the one the order went to (shmem, NIXL, Mooncake)", "reason"),
    "sglang_disagg_late_writes": ("Writes of failed requests that arrived after the failure, discarded (a "
                                  "decoder frees such a request's pages once every write its prefill server "
                                  "posted arrived)", "fate"),
    "sglang_disagg_rail_bytes": ("KV bytes this server posted through each rail (its --rails, in order; rail 0 "
                                 "only without, or with a backend that has no rails)", "rail"),
    "sglang_disagg_rail_writes": ("KV writes this server posted through each rail", "rail"),
    "sglang_disagg_rail_up": ("1 while a rail carries writes, 0 while it is down (stalled, then left out until a "
                              "connection from it reaches the peer again)", "rail"),
}


class Cause(enum.Enum):
    """Why a request failed, as a metric label."""

    NO_PREFILL = "no_prefill_server"     # none reachable or all refused first contact
    SEND = "send"                        # the order could not be sent
    TRANSFER = "transfer"                # the writes failed or timed out
    PREFILL = "prefill_failed"           # the prefill server failed the order
    ABORTED = "aborted"                  # the client went away
    INTAKE = "intake"                    # the order was refused as given (at the prefill server's intake)
    OWNER = "owner_gone"                 # DP: the server's messenger owner (group 0's leader) died


class MessengerMetrics:
    def __init__(self, role: str, host: str, port: int) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        from . import metrics_http

        self.registry = r = CollectorRegistry()
        self.requests = Counter("sglang_disagg_requests", "Requests by outcome", ["outcome"], registry=r)
        self.failures = Counter("sglang_disagg_failures", "Failed requests by cause", ["cause"], registry=r)
        for c in Cause:
            self.failures.labels(c.value)  # present (0) before the first failure
        # When the last failure of each cause happened (Unix time, as Prometheus' *_timestamp_seconds):
        # alerts read how recent it is, and a fault test times the server's reaction from it rather
        # than from its own scrapes, whose latency on a loaded host is the thing under test's noise.
        self.last_failure = Gauge("sglang_disagg_last_failure_timestamp_seconds",
                                  "Unix time of the last failed request, by cause (0: none yet)", ["cause"],
                                  registry=r)
        for c in Cause:
            self.last_failure.labels(c.value)
        self.writes = Counter("sglang_disagg_kv_writes", "KV page writes (sent on prefill, received on decode)",
                              registry=r)
        self.bytes = Counter("sglang_disagg_kv_bytes", "KV bytes moved (sent on prefill, received on decode)",
                             registry=r)
        self.transfer = Histogram("sglang_disagg_request_transfer_seconds",
                                  "Per request: first write posted (prefill) or order sent (decode) until every "
                                  "write completed", buckets=_SECONDS, registry=r)
        self.layer = Histogram("sglang_disagg_layer_write_seconds",
                               "Per streamed layer of a chunk: writes posted until completed", buckets=_SECONDS,
                               registry=r)
        self.ttft = Histogram("sglang_disagg_ttft_phase_seconds", "Time to first token, by phase (see module doc)",
                              ["phase"], buckets=_SECONDS, registry=r)
        self.role = role
        self._state: Callable[[], dict[str, dict[str, float]]] | None = None
        r.register(_StateCollector(self))
        self.server = None
        if port:  # bounded: a connection limit with eviction and a whole-request deadline
            self.server = metrics_http.serve(host, port, r)
            logger.info("messenger %s: Prometheus metrics on http://%s:%d/metrics", role, host, port)

    def observe_ttft(self, phase: str, start: float | None, end: float | None) -> None:
        if start is not None and end is not None:
            self.ttft.labels(phase).observe(max(0.0, end - start))

    def fail(self, cause: Cause) -> None:
        self.last_failure.labels(cause.value).set_to_current_time()
        self.failures.labels(cause.value).inc()
        self.requests.labels("failed").inc()

    def watch(self, state: Callable[[], dict[str, dict[str, float]]]) -> None:
        """`state()` -> {gauge: {label value: value}}, read at each scrape (from the HTTP
        thread: it must only read, and tolerate the scheduler changing things meanwhile)."""
        self._state = state

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


def scheduler_state(sched: Any, page_size: int) -> dict[str, dict[str, float]]:
    """KV pages and queue depths of an SGLang scheduler (plain reads of ints and lengths)."""
    alloc = sched.token_to_kv_pool_allocator
    total = alloc.size // page_size
    free = alloc.available_size() // page_size
    tree = getattr(sched, "tree_cache", None)
    cached = tree.evictable_size() // page_size if tree is not None else 0
    locked = tree.protected_size() // page_size if tree is not None and hasattr(tree, "protected_size") else 0
    running = getattr(sched, "running_batch", None)
    return {"sglang_disagg_kv_pages": {"allocated": max(0, total - free), "cached": cached, "locked": locked,
                                       "free": free},
            "sglang_disagg_queue_depth": {"waiting": len(sched.waiting_queue),
                                          "running": len(running.reqs) if running is not None else 0}}


class _StateCollector:
    def __init__(self, metrics: MessengerMetrics) -> None:
        self.metrics = metrics

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        state: dict[str, dict[str, float]] = {}
        if self.metrics._state is not None:
            for _ in range(3):  # the scheduler may change a dict while we read it: read again
                try:
                    state = self.metrics._state()
                    break
                except RuntimeError:
                    continue
        server = self.metrics.server
        if server is not None:  # the listener's own counts, whatever the scheduler publishes
            state = {**state, "sglang_disagg_metrics_connections_dropped": {
                "evicted": server.evicted, "deadline": server.timed_out}}
        for name, (doc, label) in GAUGES.items():
            family = GaugeMetricFamily(name, doc, labels=[label])
            for key, value in state.get(name, {}).items():
                family.add_metric([key], value)
            yield family
