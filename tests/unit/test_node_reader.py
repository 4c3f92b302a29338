"""The leader's control thread (reader.py, what Node.start_reader runs) over real backends and
sockets: no message of a peer stops it. One that does not decode (10,000 nested brackets, a count
past its bound) is dropped and that peer's connection stays; one whose handling raises is logged and
the connection stays too; one whose decoding raises anything else drops that peer's connection;
in every case the thread goes on and serves the next message, from anyone."""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time

import pytest

from sglang_disagg.backends import BackendConfig, PeerState, create_backend
from sglang_disagg.messenger import wire
from sglang_disagg.messenger.reader import ControlReader, Throttled

SECRET = secrets.token_bytes(32)
DEEP = 10_000


def _backend():
    return create_backend("shmem", BackendConfig(host="127.0.0.1", port=0, secret=SECRET))


@pytest.fixture
def served():
    """A server backend read by a ControlReader whose handler records (peer id, message) and
    raises for an order named "boom"; and two clients connected to it."""
    server, a, b = _backend(), _backend(), _backend()
    got: queue.Queue = queue.Queue()

    def dispatch(peer, raw, msg):
        if isinstance(msg, wire.PrefillOrder) and msg.rid == "boom":
            raise RuntimeError("a check the handler lacks")
        got.put((peer.id, msg))

    reader = ControlReader(server, dispatch, "test-prefill")
    reader.start()
    try:
        yield reader, got, a.connect(server.address, 5.0), b.connect(server.address, 5.0), a, b
    finally:
        reader.stop.set()
        for be in (a, b, server):
            be.close()
        reader.join(2.0)
        assert not reader.is_alive()


def _cancel(tag: int) -> bytes:
    return wire.encode(wire.Cancel(rid="r", tag=tag))


@pytest.mark.parametrize("bad", [
    b"[" * DEEP + b"]" * DEEP,
    b'{"type":"cancel","v":6,"rid":' + b"[" * DEEP + b"]" * DEEP + b',"tag":1}',
    b'{"type":"prefill","v":6,"rid":"r","tag":1,"token_ids":[1],"dst_pages":' + b"{\"a\":" * DEEP + b"0" +
    b"}" * DEEP + b',"start_page":0,"last_token":0}',
    wire.encode(wire.Hello(decoder="d", backend="shmem", provider="", ranks=(), kv=wire.KVSpec(
        model="m", fingerprint="f", num_layers=1, kv_heads=1, head_dim=8, v_head_dim=8, page_size=1, dtype="f",
        layout="hnd", tp=1))).replace(b'"tp":1', b'"tp":1000000000'),
    b"\xff\xfe not even UTF-8",
], ids=["deep-array", "deep-field", "deep-object", "tp-1e9", "not-utf8"])
def test_a_malicious_message_is_dropped_and_the_thread_serves_the_next(served, bad):
    reader, got, to_server_a, to_server_b, a, _ = served
    to_server_a.send(bad)
    to_server_a.send(_cancel(1))  # the same peer: its connection stays (a message that does not decode did nothing)
    to_server_b.send(_cancel(2))
    seen = {got.get(timeout=5.0) for _ in range(2)}
    assert {tag for _, m in seen for tag in [m.tag]} == {1, 2}
    assert reader.is_alive() and reader.dropped == 0
    assert to_server_a.state is PeerState.CONNECTED


def test_a_bad_hello_of_another_version_is_refused_on_the_same_connection(served):
    reader, got, to_server_a, _, a, _ = served
    hello = wire.Hello(decoder="d", backend="shmem", provider="", ranks=(), kv=wire.KVSpec(
        model="m", fingerprint="f", num_layers=1, kv_heads=1, head_dim=8, v_head_dim=8, page_size=1, dtype="f",
        layout="hnd", tp=1))
    to_server_a.send(wire.encode(hello).replace(f'"v":{wire.WIRE_VERSION}'.encode(), b'"v":99'))
    _, raw = a.recv(5.0)
    answer = wire.decode(raw)
    assert isinstance(answer, wire.Refuse) and "wire version 99" in answer.reason
    to_server_a.send(wire.encode(hello))
    assert got.get(timeout=5.0)[1] == hello


def test_a_message_whose_handling_raises_is_logged_and_everyone_is_served_on(served, caplog):
    reader, got, to_server_a, to_server_b, a, _ = served
    boom = wire.PrefillOrder(rid="boom", tag=3, token_ids=(1,), dst_pages=(0,), start_page=0)
    with caplog.at_level(logging.WARNING, logger="sglang_disagg.messenger"):
        to_server_a.send(wire.encode(boom))
        to_server_b.send(_cancel(4))
        assert got.get(timeout=5.0)[1] == wire.Cancel(rid="r", tag=4)
        deadline = time.monotonic() + 5.0  # a's and b's messages come on two connections, in either order
        while (reader.failed < 1 or "a check the handler lacks" not in caplog.text) and time.monotonic() < deadline:
            time.sleep(0.01)  # the reader logs, then counts: CI once read the count between the two
    assert reader.failed == 1 and reader.dropped == 0 and "RuntimeError: a check the handler lacks" in caplog.text
    to_server_a.send(_cancel(6))  # a's connection stays
    assert got.get(timeout=5.0)[1] == wire.Cancel(rid="r", tag=6)
    assert to_server_a.state is PeerState.CONNECTED and reader.is_alive()


def test_any_exception_out_of_decoding_drops_the_peer_not_the_thread(served, monkeypatch):
    """What the bounds now rule out (RecursionError, MemoryError out of json) must still not
    kill the thread if a future path lets one through."""
    from sglang_disagg.messenger import reader as reader_module

    reader, got, to_server_a, to_server_b, a, _ = served
    real = wire.decode

    def decode(raw):
        if raw == b"poison":
            raise RecursionError("maximum recursion depth exceeded")
        return real(raw)

    monkeypatch.setattr(reader_module.wire, "decode", decode)
    to_server_a.send(b"poison")
    to_server_b.send(_cancel(5))
    assert got.get(timeout=5.0)[1] == wire.Cancel(rid="r", tag=5)
    deadline = time.monotonic() + 5.0
    while to_server_a.state is PeerState.CONNECTED and time.monotonic() < deadline:
        time.sleep(0.01)
    assert to_server_a.state is not PeerState.CONNECTED and reader.dropped == 1 and reader.is_alive()


def test_the_log_is_rate_bounded_and_counts_what_it_held_back(caplog):
    now = [0.0]
    log = Throttled(5.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="sglang_disagg.messenger"):
        assert log.warn("bad", "bad message %d", 1)
        assert not any(log.warn("bad", "bad message %d", i) for i in range(2, 1000))
        assert log.warn("other", "another kind")  # kinds are bounded apart
        now[0] = 5.0
        assert log.warn("bad", "bad message %d", 1000)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["bad message 1", "another kind", "bad message 1000 (and 998 more like it in the last 5 s)"]


def test_node_start_reader_runs_this_reader_and_hands_messages_to_the_handler():
    """Node.start_reader's wiring, on a Node holding only what its reader uses."""
    from sglang_disagg.messenger.dp.groups import Groups
    from sglang_disagg.messenger.node import Node

    server, client = _backend(), _backend()
    node = Node.__new__(Node)
    node.dp, node.backend, node.name, node._stop = Groups(server), server, "test-prefill", threading.Event()
    got: queue.Queue = queue.Queue()
    node.start_reader(lambda peer, msg: got.put(msg))
    try:
        peer = client.connect(server.address, 5.0)
        peer.send(b"[" * DEEP + b"]" * DEEP)
        peer.send(_cancel(6))
        assert got.get(timeout=5.0) == wire.Cancel(rid="r", tag=6)
        assert isinstance(node._reader, ControlReader) and node._reader.is_alive()
    finally:
        node._stop.set()
        client.close()
        server.close()
        node._reader.join(2.0)
