"""The expectation tracker holds credits for tags nobody expects within a bound: a peer
writing with made-up immediates cannot grow it, and a credit that merely comes first
(before its expectation is registered) still completes it."""

from __future__ import annotations

import logging

import pytest

from sglang_disagg.backends.expect import EARLY_MAX, ExpectTracker


@pytest.fixture
def tracker():
    t = ExpectTracker()
    yield t
    t.close()


def held(t: ExpectTracker) -> int:
    return len(t._counts)


def test_credits_for_tags_never_expected_are_bounded(tracker, caplog):
    caplog.set_level(logging.WARNING, "sglang_disagg.backends.expect")
    partial = tracker.expect(1 << 31, 2, 30.0)  # waiting: its credits are never dropped
    tracker.add(1 << 31)
    for tag in range(100_000):
        tracker.add(tag)
    assert held(tracker) <= EARLY_MAX + 1 and len(tracker._early) <= EARLY_MAX
    assert tracker.early_credits_dropped == 100_000 - EARLY_MAX
    assert tracker.arrived(0) == 0 and tracker.arrived(99_999) == 1  # the least recent went first
    assert sum("early_credits_dropped" in r.getMessage() for r in caplog.records) == 1  # said once
    tracker.add(1 << 31)
    assert partial.wait(1.0) == 2
    # A credit just before its expectation still completes it, however many came before.
    tracker.add(200_000, 2)
    assert tracker.expect(200_000, 2, 1.0).wait(0) == 2
    assert held(tracker) <= EARLY_MAX and tracker.arrived(200_000) == 0


def test_a_tag_credited_again_is_kept_as_recent(tracker):
    tracker.add(7)
    for tag in range(1000, 1000 + EARLY_MAX - 1):
        tracker.add(tag)
    tracker.add(7)                       # 7 is now the most recently credited
    tracker.add(5_000_000)               # one over the bound: 1000 goes, not 7
    assert tracker.arrived(7) == 2 and tracker.arrived(1000) == 0 and tracker.early_credits_dropped == 1
    assert tracker.expect(7, 2, 1.0).wait(0) == 2


def test_surplus_left_by_an_expectation_is_an_early_credit(tracker):
    fut = tracker.expect(3, 1, 1.0)
    tracker.add(3, 3)
    assert fut.wait(1.0) == 1 and tracker.arrived(3) == 2 and list(tracker._early) == [3]
    assert tracker.expect(3, 2, 1.0).wait(0) == 2 and not tracker._early and held(tracker) == 0
    tracker.add(4)
    tracker.forget(4)
    tracker.add(5)
    tracker.retire(5)
    assert not tracker._early and held(tracker) == 0


def test_credits_count_only_from_the_peers_an_expectation_names(tracker):
    """A peer holding the secret cannot complete (or, for a failed request, settle) another
    peer's order with credits of its own: where the transport names the sender, credits count
    only for expectations tied to it; a transport that names none (source None) counts."""
    fut = tracker.expect(10, 2, 5.0, "a")
    tracker.add(10, 1, source="b")
    assert tracker.arrived(10) == 0 and tracker.foreign_credits_dropped == 1
    tracker.add(10, 1, source=None)
    tracker.add(10, 1, source="a")
    assert fut.wait(1.0) == 2
    # Early credits: the expectation claims its own peers' only.
    tracker.add(11, 2, source="b")
    tracker.add(11, 1, source="a")
    assert tracker.arrived(11) == 3
    fut = tracker.expect(11, 2, 5.0, {"a", "c"})
    assert tracker.arrived(11) == 1 and tracker.foreign_credits_dropped == 3
    tracker.add(11, 1, source="c")
    assert fut.wait(1.0) == 2 and held(tracker) == 0
    # An expectation that names no peer takes any sender's.
    tracker.add(12, 1, source="b")
    assert tracker.expect(12, 1, 1.0).wait(0) == 1
    # A failed request's landed count (what decides when its pages are free) is its peers' only.
    tracker.expect(13, 5, 5.0, "a")
    tracker.add(13, 1, source="a")
    tracker.add(13, 1, source="b")
    tracker.retire(13)
    tracker.add(13, 2, source="a")
    tracker.add(13, 7, source="b")
    assert tracker.landed(13) == 3 and tracker.foreign_credits_dropped == 3 + 1 + 7


def test_a_tag_retired_between_its_two_expectations_still_counts_only_its_peers(tracker):
    """The decoder expects a request's first write alone, then the rest: a request failing in
    between retires a tag with no expectation waiting. Its `landed` count (which frees the pages)
    still takes only the first expectation's peers' writes."""
    first = tracker.expect(20, 1, 5.0, "a")
    tracker.add(20, 1, source="a")                    # the first write: the first expectation fires
    assert first.wait(1.0) == 1
    tracker.add(20, 2, source="b")                    # early, from a peer that was not asked
    tracker.add(20, 1, source="a")                    # early, from the asked peer
    tracker.retire(20)
    assert tracker.landed(20) == 1 and tracker.foreign_credits_dropped == 2
    tracker.add(20, 3, source="b")
    tracker.add(20, 1, source="a")
    assert tracker.landed(20) == 2 and tracker.foreign_credits_dropped == 5
    assert not tracker._fired_peers  # retired: remembered as the retired tag's peers instead
