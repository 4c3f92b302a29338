"""A decoder's migration metrics, on its messenger's Prometheus registry (docs/dashboard.md):
migrations by outcome, bytes moved, hand-over time, and the relays running now."""

from __future__ import annotations

from typing import Any

OUTCOMES = ("started", "handed_over", "failed", "refused")


class MigrationMetrics:
    def __init__(self, registry: Any, stats: dict) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        self.migrations = Counter("sglang_disagg_migrations", "Requests migrated away from this decoder, by outcome "
                                  "(refused: a state that cannot move yet; failed: the request stayed here)",
                                  ["outcome"], registry=registry)
        for o in OUTCOMES:
            self.migrations.labels(o)  # present (0) before the first one
        self.bytes = Counter("sglang_disagg_migration_bytes", "KV bytes written to other decoders by migrations",
                             registry=registry)
        self.hand_over = Histogram("sglang_disagg_migration_hand_over_seconds",
                                   "From the cut to every KV write completed (then this decoder's pages are free)",
                                   buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10), registry=registry)
        relays = Gauge("sglang_disagg_migration_relays", "Migrated requests whose tokens this decoder relays now",
                       registry=registry)
        relays.set_function(lambda: stats["relays_active"])

    def outcome(self, name: str) -> None:
        self.migrations.labels(name).inc()

    def handed_over(self, nbytes: int, seconds: float) -> None:
        self.migrations.labels("handed_over").inc()
        self.bytes.inc(nbytes)
        self.hand_over.observe(seconds)
