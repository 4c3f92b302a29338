"""A failed request's pages wait for every write its prefill server posted (entry.settle)."""

from __future__ import annotations

import pytest

from sglang_disagg.messenger.entry import LATE_WRITES_S, Entry, Phase, Settle, settle


def failed(posted: int | None, writes: int = 10, first_landed: bool = True) -> Entry:
    e = Entry(seq=0, req=None, n_tokens=16, phase=Phase.RELEASE, since=0.0, tag=5, writes=writes)
    e.answered, e.posted, e.first_landed = 100.0, posted, first_landed
    return e


@pytest.mark.parametrize("posted, landed, first, now, verdict", [
    (10, 9, True, 101.0, Settle.FREE),       # the first write was taken by the first expectation
    (10, 9, False, 101.0, Settle.WAIT),      # one posted write is still on its way
    (10, 8, True, 100 + LATE_WRITES_S + 1, Settle.GIVE_UP),
    (6, 6, False, 101.0, Settle.FREE),       # the prefill stopped posting early (cancelled)
    (0, 0, False, 101.0, Settle.FREE),       # refused at intake: nothing was posted
    (99, 10, False, 101.0, Settle.FREE),     # a count above what the order can take is clamped
    (None, 0, False, 101.0, Settle.FREE),    # the prefill had forgotten the order: as before
    (10, -1, False, 101.0, Settle.FREE),     # the backend forgot the tag (bounded table)
])
def test_pages_go_once_every_posted_write_is_accounted_for(posted, landed, first, now, verdict):
    assert settle(failed(posted, first_landed=first), landed, now) is verdict


def test_a_server_known_gone_since_its_answer_frees_at_once():
    assert settle(failed(10, first_landed=False), 3, 101.0) is Settle.WAIT
    assert settle(failed(10, first_landed=False), 3, 101.0, gone=True) is Settle.FREE


def test_a_waiting_request_is_counted_at_most_every_settle_poll():
    """Each count of a DP group's late writes is a round trip to its owner: a request waiting
    for them (up to LATE_WRITES_S) is looked at every SETTLE_POLL_S, not every scheduler step."""
    from sglang_disagg.messenger.entry import SETTLE_POLL_S, settle_due

    e = failed(10)
    assert settle_due(e, 200.0)
    assert not settle_due(e, 200.0 + SETTLE_POLL_S / 2)
    assert settle_due(e, 200.0 + SETTLE_POLL_S)
