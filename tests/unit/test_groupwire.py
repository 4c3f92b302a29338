"""The DP group channel (messenger/dp/wire.py) refuses what this build does not send, every
field's type and value included, as GroupWireError; a control message's payload crosses as its
own bytes (no JSON inside JSON); and each end of the channel (the owner's per-group thread, the
group's proxy reader) drops only that channel on a bad message, never hangs."""

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
from sglang_disagg.backends.regions import PeerState
from sglang_disagg.ipc import fdpass
from sglang_disagg.messenger.config import MessengerRole
from sglang_disagg.messenger.dp import wire as gw
from sglang_disagg.messenger.dp.owner import Owner
from sglang_disagg.messenger.dp.proxy import ProxyBackend

DEEP = 10_000
CONTROL = b'{"type":"cancel","v":7,"rid":"r","tag":3}'
GOOD = [gw.Join(1), gw.Register(2, "/dev/shm/x", 0, 5, 6, "/dev/shm/x", 4096), gw.Connect(3, "h:1", None),
        gw.Connect(3, "h:1", 2.5), gw.Send(1, CONTROL), gw.AddRemote(4, 1, "desc"),
        gw.WritePages(5, 1, 0, (1, 2), 64, 7, (3, 4), 64, 32, 9, 0, 0), gw.Expect(6, 9, 2, 5.0, None),
        gw.Expect(6, 9, 2, 5.0, ("i1", "i2")), gw.Retire(9, "cancelled"), gw.Forget(9), gw.IsRetired(7, 9), gw.Landed(8, 9),
        gw.Stats(8), gw.ClosePeer(1), gw.OrderDone("i1", 9),
        gw.Joined("shmem", "", "h:1", "i"), gw.Registered(2, 0, "desc"), gw.Connected(3, 1, "i", "h:1"),
        gw.Added(4, 1), gw.Answer(7, True), gw.Counters(8, {"a": 1}), gw.Failed(4, "boom", "TransferError",
                                                                                "ConnectionRefusedError"),
        gw.Done(5), gw.Done(6, "x", "y"), gw.Delivery(1, "i", "h:1", CONTROL), gw.PeerState(1, PeerState.LOST)]


def _body(msg: gw.Message) -> dict:
    return json.loads(gw.CODEC.encode_parts(msg)[0])


def _framed(header: bytes, payload: bytes = b"") -> bytes:
    """One group-wire frame (header length, header, payload) from its parts."""
    return gw.HEADER.pack(len(header)) + header + payload


def test_every_message_round_trips():
    assert {m.TYPE for m in GOOD} == set(gw.MESSAGES)
    for msg in GOOD:
        assert gw.decode(gw.encode(msg)) == msg


def test_a_control_message_crosses_as_its_own_bytes():
    """Send and Delivery carry the control message beside the header, byte for byte: not a
    JSON string inside the JSON header (decoded twice, escaped once)."""
    for msg in (gw.Send(1, CONTROL), gw.Delivery(1, "i", "h:1", CONTROL)):
        header, payload = gw.CODEC.encode_parts(msg)
        assert payload == CONTROL and b"cancel" not in header
        assert gw.encode(msg).endswith(CONTROL)
    with pytest.raises(gw.GroupWireError, match="carries no payload"):
        gw.decode(_framed(json.dumps(_body(gw.Forget(1))).encode(), b"extra"))


@pytest.mark.parametrize("msg, field, value, why", [
    (gw.Join(1), "group", "1", "join.group: expected a non-negative integer"),
    (gw.Join(1), "group", True, "join.group: expected a non-negative integer"),
    (gw.Join(1), "group", -1, "join.group: expected a non-negative integer"),
    (gw.Join(1), "group", 1.0, "join.group: expected a non-negative integer"),
    (gw.Joined("a", "b", "c", "d"), "address", 5, "joined.address: expected a string"),
    (gw.Stats(3), "id", 2**64, "stats.id: expected a non-negative integer"),
    (gw.Stats(3), "args", {}, "stats: fields differ"),
    (gw.Connect(3, "h:1", None), "timeout_s", "5", "connect.timeout_s: expected a finite number"),
    (gw.Expect(6, 9, 2, 5.0, None), "timeout_s", float("nan"), "expect.timeout_s: expected a finite number"),
    (gw.Expect(6, 9, 2, 5.0, None), "peers", "i1", "expect.peers: expected a list"),
    (gw.Expect(6, 9, 2, 5.0, None), "peers", [1], r"expect.peers\[0\]: expected a string"),
    (gw.WritePages(5, 1, 0, (1,), 64, 7, (3,), 64, 32, 9, 0, 0), "src_pages", [-1], "write_pages.src_pages"),
    (gw.Failed(3, "e", "T"), "error", {"e": 1}, "failed.error: expected a string"),
    (gw.Counters(3, {}), "counters", {"a": "1"}, "counters.counters"),
    (gw.Counters(3, {}), "counters", [], "counters.counters: expected an object"),
    (gw.Done(5), "future", "5", "done.future: expected a non-negative integer"),
    (gw.Delivery(1, "i", "h:1", b"{}"), "peer", None, "delivery.peer: expected a non-negative integer"),
    (gw.PeerState(1, PeerState.LOST), "state", "zombie", "peer_state.state: 'zombie' is not one of"),
])
def test_a_field_of_the_wrong_type_or_value_is_refused(msg, field, value, why):
    header, payload = gw.CODEC.encode_parts(msg)
    with pytest.raises(gw.GroupWireError, match=why):
        gw.decode(_framed(json.dumps(json.loads(header) | {field: value}).encode(), payload))


@pytest.mark.parametrize("raw, why", [
    (_framed(b"[" * DEEP + b"]" * DEEP), "nest deeper"),
    (_framed(json.dumps(_body(gw.Failed(3, "e", "T"))).replace('"e"', "[" * DEEP + "]" * DEEP).encode()),
     "nest deeper"),
    (_framed(json.dumps(_body(gw.Counters(3, {}))).replace("{}", '{"a":' * DEEP + "1" + "}" * DEEP).encode()),
     "nest"),
    (_framed(b'{"type": ["join"], "v": 3, "group": 1}'), "unknown message type"),
    (_framed(b'{"type": {}, "v": 3}'), "unknown message type"),
    (_framed(b'{"type": "join", "v": [2], "group": 1}'), "version"),
    (_framed(b'{"type": "join", "v": 1, "group": 1}'), "group wire version 1, this build speaks 3"),
    (_framed(b"\xff"), "unreadable message: not UTF-8"),
    (_framed(b"7"), "must be a JSON object"),
    (b"\x00\x00", "has no header"),
    (b"\x00\x00\x10\x00{}", "a header of 4096 bytes in a frame of 6"),
])
def test_hostile_frames_are_group_wire_errors(raw, why):
    t = time.monotonic()
    with pytest.raises(gw.GroupWireError, match=why):
        gw.decode(raw)
    assert time.monotonic() - t < 1.0


def test_a_channel_reads_a_deep_frame_as_an_error_and_the_next_frame_intact():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        deep = _framed(b"[" * DEEP + b"]" * DEEP)
        a.sendall(struct.pack(">I", len(deep)) + deep + _frame(gw.encode(gw.Done(9))))
        chan = gw.Channel(b)
        with pytest.raises(gw.GroupWireError, match="nest deeper"):
            chan.read()
        assert chan.read() == gw.Done(9)
    finally:
        a.close()
        b.close()


def _name() -> str:
    return gw.socket_name(f"test-{os.getpid()}-{secrets.token_hex(4)}")


def _frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def test_the_owner_drops_a_group_that_sends_a_bad_frame_and_serves_the_next():
    backend = create_backend("shmem", BackendConfig(host="127.0.0.1", port=0, secret=secrets.token_bytes(32)))
    name = _name()
    owner = Owner(backend, name, MessengerRole.DECODE, groups=2)
    try:
        bad = fdpass.connect(name, 5.0, stream=True).sock
        chan = gw.Channel(bad)
        chan.send(gw.Join(1))
        assert isinstance(chan.read(), gw.Joined)
        bad.sendall(_frame(_framed(b"[" * DEEP + b"]" * DEEP)))
        bad.settimeout(5.0)
        with pytest.raises(EOFError):  # the owner closed this group's connection
            while True:
                chan.read()
        bad.close()
        group = ProxyBackend(name, 1, deadline_s=5.0)  # the owner still serves a group that behaves
        try:
            assert isinstance(group.stats(), dict)
        finally:
            group.close()
    finally:
        owner.close()
        backend.close()


@pytest.mark.parametrize("bad", [
    _framed(b"[" * DEEP + b"]" * DEEP),                                  # does not decode
    _framed(json.dumps(_body(gw.PeerState(1, PeerState.LOST)) | {"state": "zombie"}).encode()),
    gw.encode(gw.Join(2)),                                               # not a message the owner sends
])
def test_a_group_fails_at_once_when_the_owner_sends_a_bad_frame(bad):
    name = _name()
    listener = fdpass.Listener("test", name=name, stream=True)
    try:
        group_side = None

        def fake_owner():
            nonlocal group_side
            group_side = listener.accept(5.0).sock
            chan = gw.Channel(group_side)
            assert chan.read() == gw.Join(1)
            chan.send(gw.Joined("shmem", "", "h:1", "i"))

        t = threading.Thread(target=fake_owner)
        t.start()
        group = ProxyBackend(name, 1, deadline_s=5.0)
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
