"""The prefill leader's front door in isolation: which orders are refused before anything is
computed, and the cancels a lost decoder's orders get."""

from __future__ import annotations

import collections
import logging
import threading
import types

import pytest

from sglang_disagg.backends import PeerState
from sglang_disagg.backends.regions import RegionDescriptor
from sglang_disagg.messenger import wire
from sglang_disagg.messenger.decoderlinks import PARKED, DecoderLinks
from sglang_disagg.messenger.inputs import CancelTicket, DecoderJoined, DecoderKey, DecoderLeft, OrderTicket
from sglang_disagg.messenger.intake import MAX_DECODERS, Intake
from sglang_disagg.messenger.orders import DecoderLink
from sglang_disagg.messenger.planner import Kind, KVGeometry


class FakePeer:
    def __init__(self, key: str) -> None:
        self.id, self.address, self.state, self.sent = key, "127.0.0.1:1", PeerState.CONNECTED, []

    def send(self, data: bytes) -> None:
        self.sent.append(wire.decode(data))


def intake_with(key: str = "d1", capacity: int = 64) -> tuple[Intake, FakePeer]:
    node = types.SimpleNamespace(page_size=16, wakeup=threading.Event(), group=0,
                                 dp=types.SimpleNamespace(order_done=lambda *a: None))
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


def test_a_migration_order_sent_to_a_prefill_server_is_refused_at_once():
    intake, peer = intake_with()
    intake.on_message(peer, wire.MigrationOrder(rid="r", tag=9, num_tokens=5, dst_pages=(1,)))
    assert [(type(m), m.tag, m.blame, m.posted) for m in peer.sent] == [(wire.OrderFailed, 9, wire.Blame.ORDER, 0)]
    assert "holds no running request to migrate" in peer.sent[0].reason
    assert intake.drain(lambda key: []) == []


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
    assert [type(i) for i in got] == [OrderTicket, CancelTicket, CancelTicket, DecoderLeft]
    assert sorted(i.tag for i in got[1:3]) == [5, 8] and got[3].key == "d1"
    assert not intake.pending() and intake.drain(lambda key: [5]) == []  # handled once per lost connection


# Bounded tables: Hellos through the real intake ------------------------------------------
D1 = DecoderKey("d1", 0)  # the key of decoder "d1"'s group 0

GEOMETRY = KVGeometry(num_layers=1, kv_heads=1, head_dim=8, v_head_dim=8, page_size=16, dtype_bytes=4)
KV = wire.KVSpec(model="m", fingerprint="f", num_layers=1, kv_heads=1, head_dim=8, v_head_dim=8, page_size=16,
                 dtype="float32", layout="hnd", tp=1)
REGION = RegionDescriptor(1, "shmem", "", "d", 0, 64 * GEOMETRY.page_bytes(Kind.K, 1), 0, 0).to_bytes().decode()


def hello(group: int = 0) -> wire.Hello:
    return wire.Hello(decoder="d", backend="shmem", provider="", kv=KV, group=group,
                      ranks=(wire.RankEndpoint(0, "127.0.0.1:1", "d", (REGION, REGION)),))


def real_intake() -> Intake:
    node = types.SimpleNamespace(page_size=16, wakeup=threading.Event(), group=0, dp=types.SimpleNamespace(order_done=lambda *a: None),
                                 spec=KV, view=types.SimpleNamespace(geometry=GEOMETRY), name="p", endpoints=[])
    return Intake(node, tp=1, vocab=4096)


class DataPeer:
    """The leader's data connection to a decoder, as DecoderLinks sees it."""

    def __init__(self) -> None:
        self.state, self.closed = PeerState.CONNECTED, False

    def close(self) -> None:
        self.closed, self.state = True, PeerState.CLOSED


class Scheduler:
    """What the scheduler keeps of the intake's inputs: each decoder's open orders, and the
    links table (the real DecoderLinks, as PrefillMessenger drives it: an order here ends
    when its cancel applies)."""

    def __init__(self, intake: Intake) -> None:
        self.intake, self.open = intake, collections.defaultdict(set)
        self.links, self.data = DecoderLinks(), []

    def step(self) -> list:
        got = self.intake.drain(lambda key: set(self.open.get(key, ())))
        for i in got:
            if isinstance(i, DecoderJoined):
                kept = self.links.join(i.key, DecoderLink(i.hello, plan=None))
                peer = kept if kept is not None and kept.state is PeerState.CONNECTED else DataPeer()
                self.links[i.key].peers[0] = peer
                if peer is not kept:
                    self.data.append(peer)
            elif isinstance(i, OrderTicket):
                self.open[i.key].add(i.order.tag)
            elif isinstance(i, CancelTicket):
                self.open[i.key].discard(i.tag)
                if not self.open[i.key]:
                    del self.open[i.key]
                self.links.settled(i.key, busy=bool(self.open.get(i.key)))
            elif isinstance(i, DecoderLeft):
                self.links.leave(i.key, busy=bool(self.open.get(i.key)))
        return got


def assert_empty(intake: Intake) -> None:
    assert (intake.peers, intake._keys, intake._capacity, intake._replaced, list(intake._inbox)) == ({}, {}, {}, [], [])
    assert not intake.pending()


def test_decoders_that_come_and_go_leave_nothing_behind(caplog):
    caplog.set_level(logging.ERROR, "sglang_disagg.messenger")
    intake = real_intake()
    sched = Scheduler(intake)
    orders = 0
    for i in range(10_000):
        peer = FakePeer(f"decoder-{i}")
        intake.on_message(peer, hello(group=i % 3))
        assert isinstance(peer.sent[-1], wire.Welcome)
        if i % 2:
            intake.on_message(peer, order(tag=i))
            orders += 1
            if i % 4 == 1:
                sched.step()  # the order is open in the scheduler when its decoder goes
        peer.state = PeerState.LOST if i % 5 else PeerState.CLOSED
        if i % 7 == 0:
            sched.step()
    sched.step()
    assert_empty(intake)
    assert sched.open == {}  # every order of every decoder was cancelled
    assert orders == 5_000
    # No link outlives its decoder; live data connections of decoders that left are parked
    # (for a Hello again) at most PARKED at a time, the others closed.
    assert sched.links.sizes() == {"links": 0, "leaving": 0, "parked": PARKED}
    assert len(sched.data) == 10_000 and sum(not p.closed for p in sched.data) == PARKED


def test_hellos_on_one_connection_keep_one_key(caplog):
    caplog.set_level(logging.ERROR, "sglang_disagg.messenger")
    intake = real_intake()
    sched = Scheduler(intake)
    peer = FakePeer("d1")
    intake.on_message(peer, hello(group=0))
    intake.on_message(peer, order(tag=3))
    sched.step()
    assert sched.open == {D1: {3}}
    for g in range(1, 10_001):
        intake.on_message(peer, hello(group=g))
        if g % 1000 == 0:
            sched.step()
    assert list(intake.peers) == [DecoderKey("d1", 10000)] and intake._keys == {peer: DecoderKey("d1", 10000)}
    assert list(intake._capacity) == [DecoderKey("d1", 10000)]
    sched.step()
    assert sched.open == {} and intake._replaced == []  # the first key's order was cancelled
    intake.on_message(peer, order(tag=4))
    assert [i.key for i in sched.step()] == [DecoderKey("d1", 10000)]
    assert all(isinstance(m, wire.Welcome) for m in peer.sent)


def test_a_decoder_beyond_max_decoders_is_refused_with_the_reason():
    intake = real_intake()
    sched = Scheduler(intake)
    peers = [FakePeer(f"decoder-{i}") for i in range(MAX_DECODERS + 1)]
    for p in peers:
        intake.on_message(p, hello())
    assert all(isinstance(p.sent[-1], wire.Welcome) for p in peers[:MAX_DECODERS])
    refused = peers[-1].sent[-1]
    assert isinstance(refused, wire.Refuse) and f"already serves {MAX_DECODERS} decoders (MAX_DECODERS" in refused.reason
    assert len(intake.peers) == MAX_DECODERS and peers[-1] not in intake._keys
    intake.on_message(peers[-1], order())
    assert "no Hello" in peers[-1].sent[-1].reason
    # A known decoder connecting again, or saying Hello again, is not a new one.
    again = FakePeer("decoder-0")
    intake.on_message(again, hello())
    intake.on_message(peers[1], hello())
    assert isinstance(again.sent[-1], wire.Welcome) and isinstance(peers[1].sent[-1], wire.Welcome)
    assert len(intake.peers) == MAX_DECODERS and peers[0] not in intake._keys
    # Once one goes, the next is welcome.
    peers[1].state = PeerState.LOST
    sched.step()
    intake.on_message(peers[-1], hello())
    assert isinstance(peers[-1].sent[-1], wire.Welcome) and len(intake.peers) == MAX_DECODERS


def test_a_decoder_that_says_hello_again_keeps_its_data_connection():
    intake = real_intake()
    sched = Scheduler(intake)
    peer = FakePeer("d1")
    intake.on_message(peer, hello())
    intake.on_message(peer, order(tag=3))
    sched.step()
    data = sched.links[D1].peers[0]
    peer.state = PeerState.LOST  # the control connection only (ss -K): the decoder lives
    sched.step()
    assert sched.links.get(D1) is None and sched.links.sizes()["parked"] == 1 and not data.closed
    again = FakePeer("d1")
    intake.on_message(again, hello())
    sched.step()
    assert sched.links[D1].peers[0] is data and not data.closed
    assert sched.links.sizes() == {"links": 1, "leaving": 0, "parked": 0}


def test_a_link_whose_order_is_still_here_is_dropped_when_that_order_ends():
    links, data = DecoderLinks(), DataPeer()
    links.join(D1, DecoderLink(hello(), plan=None, peers={0: data}))
    links.leave(D1, busy=True)  # a cancelled order still in the forward reads its link
    assert links.get(D1) is not None and links.sizes()["leaving"] == 1
    links.settled(D1, busy=False)
    assert links.sizes() == {"links": 0, "leaving": 0, "parked": 1}
    links.close()
    assert data.closed and links.sizes()["parked"] == 0
