"""The prefill leader's front door in isolation: which orders are refused before anything is
computed, and the cancels a lost decoder's orders get."""

from __future__ import annotations

import threading
import types

import pytest

from sglang_disagg.backends import PeerState
from sglang_disagg.messenger import wire
from sglang_disagg.messenger.inputs import CancelTicket, OrderTicket
from sglang_disagg.messenger.intake import Intake


class FakePeer:
    def __init__(self, key: str) -> None:
        self.id, self.address, self.state, self.sent = key, "127.0.0.1:1", PeerState.CONNECTED, []

    def send(self, data: bytes) -> None:
        self.sent.append(wire.decode(data))


def intake_with(key: str = "d1", capacity: int = 64) -> tuple[Intake, FakePeer]:
    node = types.SimpleNamespace(page_size=16, wakeup=threading.Event(), group=0, order_done=lambda *a: None)
    intake = Intake(node, tp=1, vocab=4096)
    peer = FakePeer(key)
    intake.peers[key], intake._keys[peer] = peer, key  # as its Hello left them
    intake._capacity[key] = capacity
    return intake, peer


def order(tokens=tuple(range(1, 33)), pages=(0, 1), start_page=0, tag=7, last_token=0) -> wire.PrefillOrder:
    return wire.PrefillOrder(rid="r", tag=tag, token_ids=tuple(tokens), dst_pages=tuple(pages), start_page=start_page,
                             last_token=last_token)


@pytest.mark.parametrize("o,reason", [
    (order(tokens=()), "at least one token"),
    (order(pages=(0,)), "need 2 pages"),
    (order(start_page=3), "start_page 3 beyond"),
    (order(tag=1 << 32), "does not fit 32 bits"),
    (order(pages=(0, 64)), "outside the decoder's 64 pages"),
    (order(tokens=(1,) * 31 + (4096,)), "outside the model's vocabulary"),
    (order(last_token=4096), "last token 4096 outside the model's vocabulary of 4096"),
    (order(last_token=(1 << 31) - 1), "last token 2147483647 outside"),
    (order(last_token=-1), "last token -1 outside"),
    (order(last_token="5"), "last token '5' outside"),
    (order(last_token=True), "last token True outside"),
    (order(last_token=5.0), "last token 5.0 outside"),
])
def test_a_bad_order_is_refused_at_once_with_the_reason(o, reason):
    intake, peer = intake_with()
    assert reason in intake.check_order("d1", o)
    intake.on_message(peer, o)
    assert [type(m) for m in peer.sent] == [wire.OrderFailed] and reason in peer.sent[0].reason
    assert intake.drain(lambda key: []) == []


def test_the_last_token_may_be_any_id_of_the_vocabulary():
    intake, _ = intake_with()
    for last in (0, 1, 4095):
        assert intake.check_order("d1", order(last_token=last)) == ""


def test_an_order_before_hello_is_refused():
    intake, _ = intake_with()
    assert "no Hello" in intake.check_order("stranger", order())


def test_a_lost_decoder_gets_one_cancel_per_open_or_queued_order_once():
    intake, peer = intake_with()
    intake.on_message(peer, order(tag=8))
    assert intake.node.wakeup.is_set()
    peer.state = PeerState.LOST
    assert intake.pending()
    got = intake.drain(lambda key: [5] if key == "d1" else [])
    assert [type(i) for i in got] == [OrderTicket, CancelTicket, CancelTicket]
    assert sorted(i.tag for i in got[1:]) == [5, 8]
    assert not intake.pending() and intake.drain(lambda key: [5]) == []  # handled once per lost connection
