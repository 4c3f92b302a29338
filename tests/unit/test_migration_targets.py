"""Decoder A's answers to the decoders it migrates to, when the asking decoder is already gone:
a Hello, Cancel or order whose answer cannot be sent (B closed the connection between asking and
the answer, e.g. it dropped a link whose heartbeat it lost under load) costs that link, never A's
scheduler (the exception once left the decoder's step and stopped the server)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from sglang_disagg.backends import PeerState
from sglang_disagg.backends.errors import PeerLostError
from sglang_disagg.messenger import wire
from sglang_disagg.messenger.migration.targets import Targets


def _kv(model: str) -> wire.KVSpec:
    return wire.KVSpec(model=model, fingerprint="f", num_layers=1, kv_heads=1, head_dim=64, v_head_dim=64,
                       page_size=16, dtype="f", layout="hnd", tp=1)


class GonePeer:
    id, address = 7, "127.0.0.1:9"

    def __init__(self) -> None:
        self.sent = 0

    def send(self, data: bytes) -> None:
        self.sent += 1
        raise PeerLostError("control channel send failed: [Errno 9] Bad file descriptor")


def _targets() -> Targets:
    node = SimpleNamespace(spec=_kv("ours"), name="a", group=0, wakeup=SimpleNamespace(set=lambda: None))
    out = SimpleNamespace(m=SimpleNamespace(cfg=SimpleNamespace()), node=node, source=SimpleNamespace(held={}),
                          hook=None)
    return Targets(out)


@pytest.mark.parametrize("msg", [
    wire.Hello(decoder="b", backend="shmem", provider="", kv=_kv("another"), ranks=()),  # refused: Refuse lost
    wire.MigrationOrder(rid="r", tag=1, num_tokens=1, dst_pages=(0,)),  # no Hello: its OrderFailed is lost
], ids=["hello", "order"])
def test_an_answer_to_a_decoder_that_went_away_costs_its_link_not_the_scheduler(msg, caplog):
    caplog.set_level(logging.INFO, logger="sglang_disagg.migration")
    targets, peer = _targets(), GonePeer()
    targets.on(peer, msg)  # raised PeerLostError out of the scheduler's step before
    assert peer.sent == 1, "the answer was tried"
    assert peer not in targets.keys and not targets.peers
    assert f"decoder {peer.address} went away before its {type(msg).__name__} was answered" in caplog.text


class LivePeer:
    """One control connection of decoder B (its backend instance `id`): records what it is sent."""

    state = PeerState.CONNECTED

    def __init__(self, instance: str) -> None:
        self.id, self.address, self.got = instance, "127.0.0.1:7", []

    def send(self, data: bytes) -> None:
        self.got.append(wire.decode(data))


def test_each_dp_group_of_a_decoder_keeps_its_own_link_and_its_orders_write_its_own_pages(monkeypatch):
    """A data-parallel B: its groups say Hello on connections of their own from ONE backend
    instance, each naming its own group's pool. Keyed by instance alone, group 0's later Hello
    took group 1's orders, whose KV then went into group 0's pool at group 1's page ids (wrong
    tokens after the cut on B's group 1, seen on tiny-deepseek-v3 with attention DP)."""
    from sglang_disagg.messenger.migration import targets as mod

    monkeypatch.setattr(mod.ShardPlan, "build", staticmethod(lambda *a: "plan"))
    monkeypatch.setattr(mod.compat, "decoder_pages", lambda *a: 1)
    posted = []
    data = SimpleNamespace(add_remote_region=lambda desc: f"remote:{desc}", state=PeerState.CONNECTED)
    t = _targets()
    t.m = SimpleNamespace(cfg=SimpleNamespace(connect_timeout_s=1.0), ranks=SimpleNamespace(size=1),
                          backend=SimpleNamespace(connect=lambda address, timeout: data))
    t.node.view, t.node.endpoints, t.node.regions = SimpleNamespace(geometry=None), (), ()
    t.source = SimpleNamespace(plan=lambda order, tp: (SimpleNamespace(rid=order.rid), ["g"], 1),
                               post=lambda h, tag, groups, backend, peers, regions, remote, *a: posted.append(
                                   (h.rid, remote[0])))
    t.out = SimpleNamespace(away={})
    conns = {g: LivePeer("b-instance") for g in (1, 0)}  # group 1 says Hello first, group 0 last
    for g, conn in conns.items():
        rank = wire.RankEndpoint(0, "127.0.0.1:8", "b-instance", (f"pool-of-group-{g}",))
        t.on(conn, wire.Hello(decoder="b", backend="shmem", provider="", kv=_kv("ours"), ranks=(rank,), group=g))
        assert isinstance(conn.got[-1], wire.Welcome)
    for g in (1, 0):
        t.on(conns[g], wire.MigrationOrder(rid=f"r{g}", tag=g + 1, num_tokens=1, dst_pages=(0,)))
    assert posted == [("r1", ["remote:pool-of-group-1"]), ("r0", ["remote:pool-of-group-0"])]
