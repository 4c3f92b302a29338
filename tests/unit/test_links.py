"""A decoder's links: a prefill server that keeps failing valid orders is taken out of use,
connected again after a backoff, and trusted again after one success (issue 19). The
connection is a fake here (the logic in isolation); tests/e2e/test_failing_link.py runs it
on real servers."""

from __future__ import annotations

import threading
import time
import types

import pytest

from sglang_disagg.backends import PeerState
from sglang_disagg.messenger import decode_endings, wire
from sglang_disagg.messenger.links import FAIL_STRIKES, Link, Links, LinkState
from sglang_disagg.messenger.metrics import Cause

KV = wire.KVSpec(model="m", fingerprint="f", num_layers=2, kv_heads=1, head_dim=8, v_head_dim=8, page_size=16,
                 dtype="float32", layout="hnd", tp=1)
HELLO = wire.Hello(decoder="d", backend="shmem", provider="", kv=KV, ranks=())


class FakePeer:
    """A control connection whose prefill server answers Hello with Welcome at once."""

    def __init__(self, links: Links, n: int) -> None:
        self.id, self.links, self.state, self.closed = f"peer-{n}", links, PeerState.CONNECTED, False

    def send(self, raw: bytes) -> None:
        if isinstance(wire.decode(raw), wire.Hello):
            self.links.on_message(self, wire.Welcome(prefill="p", kv=KV, ranks=()))

    def close(self) -> None:
        self.state, self.closed = PeerState.CLOSED, True


class FakeBackend:
    def __init__(self) -> None:
        self.links: Links | None = None
        self.peers: list[FakePeer] = []

    def connect(self, address: str, timeout: float) -> FakePeer:
        while self.links is None:
            time.sleep(0.001)
        self.peers.append(FakePeer(self.links, len(self.peers)))
        return self.peers[-1]


@pytest.fixture
def linked():
    backend = FakeBackend()
    changes = threading.Event()
    ls = Links(types.SimpleNamespace(backend=backend), HELLO, ("p1", "p2"), 2.0, on_change=changes.set, recheck_s=0.1)
    backend.links = ls
    deadline = time.monotonic() + 5
    while not all(link.alive() for link in ls.links.values()):
        assert time.monotonic() < deadline, [link.describe() for link in ls.links.values()]
        time.sleep(0.005)
    yield ls, backend, changes
    ls.close()


def test_a_link_whose_server_fails_valid_orders_in_a_row_is_taken_out_of_use(linked):
    ls, _, changes = linked
    p1 = ls.links["p1"]
    for _ in range(FAIL_STRIKES - 1):
        ls.outcome("p1", "posting KV writes failed: boom")
    ls.outcome("p1")  # one success in between: the count starts again
    for _ in range(FAIL_STRIKES - 1):
        ls.outcome("p1", "posting KV writes failed: boom")
    assert p1.state is LinkState.READY
    changes.clear()
    ls.outcome("p1", "posting KV writes failed: boom")
    assert p1.state is LinkState.FAILING and changes.is_set()
    assert "posting KV writes failed: boom" in p1.reason and f"last {FAIL_STRIKES} requests failed" in p1.reason
    assert ls.choose() is ls.links["p2"]
    assert "p1: failing" in ls.why()
    assert not ls.connecting() or ls.links["p2"].alive()  # a failing link is not waited for


def test_a_failing_link_is_connected_again_then_on_probation(linked):
    ls, backend, _ = linked
    p1 = ls.links["p1"]
    first = p1.peer
    for _ in range(FAIL_STRIKES):
        ls.outcome("p1", "boom")
    assert p1.state is LinkState.FAILING
    deadline = time.monotonic() + 5
    while not p1.alive():
        assert time.monotonic() < deadline, p1.describe()
        time.sleep(0.005)
    assert first.closed and p1.peer is not first  # a new connection and Hello: regions read again
    ls.outcome("p1", "boom")  # on probation: one failure is enough
    assert p1.state is LinkState.FAILING and "connected again in 0.2 s" in p1.reason  # backoff doubled
    while not p1.alive():
        assert time.monotonic() < deadline, p1.describe()
        time.sleep(0.005)
    ls.outcome("p1")  # one success: trusted again
    for _ in range(FAIL_STRIKES - 1):
        ls.outcome("p1", "boom")
    assert p1.state is LinkState.READY and p1.backoff == 0.1


def test_only_the_servers_failures_count_against_its_link():
    assert set(decode_endings.LINK_FAULTS) == {Cause.PREFILL, Cause.TRANSFER}  # not INTAKE (the order's), not ABORTED


def test_an_unknown_link_or_a_link_not_ready_is_left_alone():
    ls = Links(types.SimpleNamespace(backend=None), HELLO, (), 1.0)
    ls.outcome("nowhere", "boom")
    ls.links["p"] = link = Link("p", 1.0)
    for _ in range(FAIL_STRIKES + 1):
        ls.outcome("p", "boom")
    assert link.state is LinkState.CONNECTING  # only a READY link is taken out of use


def test_a_request_waits_for_a_ready_link_whose_connection_was_just_lost():
    """Between a connection's loss and its link thread marking it DOWN (POLL_S), the link still
    says READY: a request routed then must wait for the link to come back, not fail with "no
    usable prefill server: ...: ready" (seen through the relay of tests/e2e/test_relay.py)."""
    ls = Links(types.SimpleNamespace(backend=None), HELLO, (), 1.0)
    ls.links["p"] = link = Link("p", 1.0)
    link.state, link.peer = LinkState.READY, types.SimpleNamespace(state=PeerState.LOST)
    assert ls.choose() is None and ls.connecting()
    assert "p: connection just lost" in ls.why()
    link.state = LinkState.GONE
    assert not ls.connecting()  # a gone server is not waited for
