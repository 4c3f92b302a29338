"""The DP group channel (groupwire.py) refuses what this build does not send, every field's type
and value included, as GroupWireError; and each end of the channel (the owner's per-group
thread, the group's proxy reader) drops only that channel on a bad message, never hangs."""

from __future__ import annotations

import json
import os
import secrets
import socket
import struct
import threading
import time

import pytest

from sglang_disagg.backends import BackendConfig, PeerLostError, TransferError, create_backend
from sglang_disagg.messenger import groupwire as gw
from sglang_disagg.messenger.config import MessengerRole
from sglang_disagg.messenger.dpowner import Owner
from sglang_disagg.messenger.dpproxy import ProxyBackend

DEEP = 10_000
GOOD = [gw.Join(1), gw.Joined("shmem", "", "h:1", "i"), gw.Call(3, "stats", {}), gw.Reply(3, {"a": [1]}),
        gw.Reply(4, None, "boom", "TransferError", "ConnectionRefusedError"), gw.Done(5), gw.Done(6, "x", "y"),
        gw.Delivery(1, "i", "h:1", '{"type":"cancel"}'), gw.PeerState(1, "lost")]


def _body(msg: gw.Message) -> dict:
    return json.loads(gw.encode(msg)[4:])


def test_every_message_round_trips():
    assert {m.TYPE for m in GOOD} == set(gw.MESSAGES)
    for msg in GOOD:
        assert gw.decode(gw.encode(msg)[4:]) == msg


@pytest.mark.parametrize("msg, field, value, why", [
    (gw.Join(1), "group", "1", "join.group: expected int"),
    (gw.Join(1), "group", True, "join.group: expected int"),
    (gw.Join(1), "group", -1, "join.group: expected int"),
    (gw.Join(1), "group", 1.0, "join.group: expected int"),
    (gw.Joined("a", "b", "c", "d"), "address", 5, "joined.address: expected str"),
    (gw.Call(3, "stats", {}), "args", [], "call.args: expected dict"),
    (gw.Call(3, "stats", {}), "args", None, "call.args: expected dict"),
    (gw.Call(3, "stats", {}), "op", "format_disk", "call.op: 'format_disk' is not one of"),
    (gw.Call(3, "stats", {}), "op", ["stats"], "call.op: expected str"),
    (gw.Call(3, "stats", {}), "id", 2**64, "call.id: expected int"),
    (gw.Reply(3, None), "error", {"e": 1}, "reply.error: expected str"),
    (gw.Done(5), "future", "5", "done.future: expected int"),
    (gw.Delivery(1, "i", "h:1", "{}"), "data", {"type": "cancel"}, "delivery.data: expected str"),
    (gw.Delivery(1, "i", "h:1", "{}"), "peer", None, "delivery.peer: expected int"),
    (gw.PeerState(1, "lost"), "state", "zombie", "peer_state.state: 'zombie' is not one of"),
])
def test_a_field_of_the_wrong_type_or_value_is_refused(msg, field, value, why):
    with pytest.raises(gw.GroupWireError, match=why):
        gw.decode(json.dumps(_body(msg) | {field: value}).encode())


@pytest.mark.parametrize("raw, why", [
    (b"[" * DEEP + b"]" * DEEP, "nest deeper"),
    (json.dumps(_body(gw.Reply(3, None))).replace("null", "[" * DEEP + "]" * DEEP).encode(), "nest deeper"),
    (json.dumps(_body(gw.Call(3, "stats", {}))).replace("{}", '{"a":' * DEEP + "1" + "}" * DEEP).encode(), "nest"),
    (b'{"type": ["join"], "v": 1, "group": 1}', "unknown message type"),
    (b'{"type": {}, "v": 1}', "unknown message type"),
    (b'{"type": "join", "v": [1], "group": 1}', "version"),
    (b"\xff", "unreadable message: not UTF-8"),
    (b"7", "version"),
])
def test_hostile_frames_are_group_wire_errors(raw, why):
    t = time.monotonic()
    with pytest.raises(gw.GroupWireError, match=why):
        gw.decode(raw)
    assert time.monotonic() - t < 1.0


def test_a_channel_reads_a_deep_frame_as_an_error_and_the_next_frame_intact():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        deep = b"[" * DEEP + b"]" * DEEP
        a.sendall(struct.pack(">I", len(deep)) + deep + gw.encode(gw.Done(9)))
        chan = gw.Channel(b)
        with pytest.raises(gw.GroupWireError, match="nest deeper"):
            chan.read()
        assert chan.read() == gw.Done(9)
    finally:
        a.close()
        b.close()


def _path() -> str:
    return gw.socket_name(f"test-{os.getpid()}-{secrets.token_hex(4)}")


def _frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def test_the_owner_drops_a_group_that_sends_a_bad_frame_and_serves_the_next():
    backend = create_backend("shmem", BackendConfig(host="127.0.0.1", port=0, secret=secrets.token_bytes(32)))
    path = _path()
    owner = Owner(backend, path, MessengerRole.DECODE, groups=2)
    try:
        bad = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        bad.connect(path)
        bad.sendall(gw.encode(gw.Join(1)))
        chan = gw.Channel(bad)
        assert isinstance(chan.read(), gw.Joined)
        deep = b"[" * DEEP + b"]" * DEEP
        bad.sendall(_frame(deep))
        bad.settimeout(5.0)
        with pytest.raises(EOFError):  # the owner closed this group's connection
            while True:
                chan.read()
        bad.close()
        group = ProxyBackend(path, 1, deadline_s=5.0)  # the owner still serves a group that behaves
        try:
            assert isinstance(group.stats(), dict)
        finally:
            group.close()
    finally:
        owner.close()
        backend.close()


@pytest.mark.parametrize("bad", [
    b"[" * DEEP + b"]" * DEEP,                                  # does not decode
    json.dumps(_body(gw.PeerState(1, "lost")) | {"state": "zombie"}).encode(),
])
def test_a_group_fails_at_once_when_the_owner_sends_a_bad_frame(bad):
    path = _path()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    try:
        group_side = None

        def fake_owner():
            nonlocal group_side
            group_side, _ = listener.accept()
            chan = gw.Channel(group_side)
            assert chan.read() == gw.Join(1)
            chan.send(gw.Joined("shmem", "", "h:1", "i"))

        t = threading.Thread(target=fake_owner)
        t.start()
        group = ProxyBackend(path, 1, deadline_s=5.0)
        t.join(5.0)
        try:
            waiting = group.expect(3, 1, 60.0)
            group_side.sendall(_frame(bad))
            with pytest.raises(PeerLostError, match="owner"):
                waiting.wait(2.0)
            assert group.gone
            with pytest.raises(TransferError):
                group.recv(0.1)
        finally:
            group.close()
            if group_side is not None:
                group_side.close()
    finally:
        listener.close()
