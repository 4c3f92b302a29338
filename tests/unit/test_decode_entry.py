"""The decoder's leader decisions for a failed request, in isolation: re-route or fail, and
when its pages may be freed or must be quarantined."""

from __future__ import annotations

import types

import pytest

from sglang_disagg.messenger.entry import (CANCEL_RESEND_S, CANCEL_TIMEOUT_S, LOST_VERDICT_S, Cancel, Entry, Lost, Phase, Release,
                                           lost_verdict, release_step)
from sglang_disagg.messenger.links import LinkState
from sglang_disagg.messenger.metrics import Cause


class FakeLink:
    """A link as the decisions see it: a state and the connection it runs on."""

    def __init__(self, state: LinkState, peer: object | None = None) -> None:
        self.state, self.peer = state, peer

    def alive(self) -> bool:
        return self.state is LinkState.READY and self.peer is not None


def lost_entry(**kw) -> Entry:
    fields = dict(seq=0, req=types.SimpleNamespace(rid="r"), n_tokens=10, phase=Phase.TRANSFER, since=0.0,
                  link="p1", failed="lost", cause=Cause.TRANSFER, lost=100.0, route_peer="conn-1")
    return Entry(**(fields | kw))


def test_a_request_lost_before_any_write_is_rerouted_once_its_server_is_gone():
    links = {"p1": FakeLink(LinkState.GONE), "p2": FakeLink(LinkState.READY, "c")}
    assert lost_verdict(lost_entry(), links, 100.1) is Lost.REROUTE
    assert lost_verdict(lost_entry(rerouted=True), links, 100.1) is Lost.FAIL       # once only
    assert lost_verdict(lost_entry(first_landed=True), links, 100.1) is Lost.FAIL   # a write landed
    assert lost_verdict(lost_entry(cause=Cause.PREFILL), links, 100.1) is Lost.FAIL
    links["p2"] = FakeLink(LinkState.GONE)
    assert lost_verdict(lost_entry(), links, 100.1) is Lost.FAIL                    # nowhere to go


def test_a_live_server_is_not_rerouted_around():
    # Reconnected on a new connection: the server lives and may still write into the pages.
    assert lost_verdict(lost_entry(), {"p1": FakeLink(LinkState.READY, "conn-2")}, 100.1) is Lost.FAIL
    # No verdict yet: wait, but not past LOST_VERDICT_S.
    connecting = {"p1": FakeLink(LinkState.CONNECTING)}
    assert lost_verdict(lost_entry(), connecting, 100.0 + LOST_VERDICT_S / 2) is Lost.WAIT
    assert lost_verdict(lost_entry(), connecting, 100.0 + 2 * LOST_VERDICT_S) is Lost.FAIL


@pytest.mark.parametrize("state", [None, LinkState.GONE])
def test_pages_are_freed_when_no_write_can_land(state):
    e = lost_entry(phase=Phase.RELEASE)
    assert release_step(e, None if state is None else FakeLink(state), 101.0) is Cancel.NOTHING
    assert e.release is Release.FREE


def test_the_cancel_goes_out_per_connection_and_again_until_answered_then_the_pages_are_quarantined():
    e = lost_entry(phase=Phase.RELEASE, since=100.0)
    link = FakeLink(LinkState.READY, "conn-1")
    assert release_step(e, link, 101.0) is Cancel.SEND and e.cancel_sent == 101.0
    assert release_step(e, link, 101.5) is Cancel.NOTHING and e.release is Release.UNDECIDED
    # Unanswered after CANCEL_RESEND_S: asked again on the same connection (its Released may
    # have gone to the connection the link replaced); the clock keeps running.
    assert release_step(e, link, 101.0 + CANCEL_RESEND_S) is Cancel.SEND and e.cancel_sent == 101.0
    link.peer = "conn-2"  # the link came back: the cancel goes out again at once
    assert release_step(e, link, 102.2) is Cancel.SEND and e.cancel_sent == 101.0
    assert release_step(e, link, 101.0 + CANCEL_TIMEOUT_S + 0.1) is Cancel.NOTHING
    assert e.release is Release.QUARANTINE
    q = lost_entry(phase=Phase.QUARANTINE, cancel_peer="conn-2", cancel_sent=1.0)
    assert release_step(q, link, 1e9) is Cancel.NOTHING and q.release is Release.UNDECIDED  # waits for an answer
