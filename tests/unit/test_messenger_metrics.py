"""The messenger's Prometheus registry on its own (no server, no scrape): what a failure records."""

from __future__ import annotations

import time

from sglang_disagg.messenger.metrics import Cause, MessengerMetrics


def _sample(metrics: MessengerMetrics, name: str, **labels) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    assert value is not None, (name, labels)
    return value


def test_a_failure_is_counted_and_timed_by_cause():
    m = MessengerMetrics("decode", "127.0.0.1", 0)  # port 0: no HTTP server
    for c in Cause:  # every cause present before its first failure, at 0
        assert _sample(m, "sglang_disagg_failures_total", cause=c.value) == 0
        assert _sample(m, "sglang_disagg_last_failure_timestamp_seconds", cause=c.value) == 0
    before = time.time()
    m.fail(Cause.TRANSFER)
    after = time.time()
    assert _sample(m, "sglang_disagg_failures_total", cause="transfer") == 1
    assert _sample(m, "sglang_disagg_requests_total", outcome="failed") == 1
    assert before <= _sample(m, "sglang_disagg_last_failure_timestamp_seconds", cause="transfer") <= after
    assert _sample(m, "sglang_disagg_last_failure_timestamp_seconds", cause="send") == 0
