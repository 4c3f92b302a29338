"""migration/pacer.py: the token bucket that caps a decoder's outgoing migrations (a fake
clock; the paced writes themselves: tests/backends/test_migration_source.py)."""

from __future__ import annotations

import pytest

from sglang_disagg.messenger.migration.pacer import BURST_S, Pacer


def test_groups_go_out_as_credit_comes_never_faster_than_the_rate():
    clock = [100.0]
    p = Pacer(1000.0, now=lambda: clock[0])
    assert p.burst == 1000.0 * BURST_S == 50.0
    assert p.take([30, 30, 30]) == 2, "a full bucket (50 B): two groups, the second into debt"
    assert p.take([30]) == 0 and p.wait_s() == pytest.approx(0.011)
    sent, t0 = 60, clock[0]
    for _ in range(200):  # 2 s of 10 ms ticks
        clock[0] += 0.01
        sent += 30 * p.take([30] * 10)
    # never more than the rate over the time plus one bucket and one group of debt
    assert sent <= 1000.0 * (clock[0] - t0) + p.burst + 30
    assert sent >= 1000.0 * (clock[0] - t0) - 30, "and the credit is used"
    clock[0] += 60.0  # an idle minute does not bank more than one bucket
    assert p.take([10] * 100) == 5


def test_no_cap_lets_everything_out_and_a_negative_rate_is_refused():
    p = Pacer(0.0)
    assert not p.enabled and p.take([1 << 30] * 3) == 3 and p.wait_s() == 0.0
    with pytest.raises(ValueError, match="negative"):
        Pacer(-1.0)
