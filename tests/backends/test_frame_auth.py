"""Control frames are sealed after the handshake (backends/frames.py): an on-path relay that
passed both handshakes through untouched, then alters, injects, replays, reorders or drops one
frame, resets the link; nothing it touched is believed, nothing is left behind, and the peers
serve again on a fresh link. Real backends (shmem, libfabric tcp) and real sockets; the relay
is the attacker (harness/relay.py), the only fake."""

from __future__ import annotations

import contextlib
import logging
import queue
import time

import pytest
from test_control_plane import FRAME, _admitted, _make, assert_still_serves
from transfer_harness import until

from harness.relay import Relay
from sglang_disagg.backends import DeadlineExceeded, control, frames
from sglang_disagg.backends.regions import PeerState


def _keys_pair() -> tuple[frames.FrameKeys, frames.FrameKeys]:
    d, a = b"d" * 32, b"a" * 32
    return frames.FrameKeys.derive(b"k" * 32, d, a, True), frames.FrameKeys.derive(b"k" * 32, d, a, False)


def _seal(keys: frames.FrameKeys, kind: int, payload: bytes) -> tuple[bytes, bytes, bytes]:
    header = FRAME.pack(len(payload), kind)
    tag = keys.seal(header, payload)
    keys.commit()
    return header, payload, tag


def test_frames_open_in_order_and_nothing_else_does():
    dialer, acceptor = _keys_pair()
    sent = [_seal(dialer, control.MSG, f"order {i}".encode()) for i in range(3)]
    acceptor.open(*sent[0])
    with pytest.raises(frames.FrameAuthError, match="frame 1 "):
        acceptor.open(*sent[0])                      # replayed
    with pytest.raises(frames.FrameAuthError):
        acceptor.open(*sent[2])                      # reordered (or one dropped)
    h, p, t = sent[1]
    with pytest.raises(frames.FrameAuthError):
        acceptor.open(h, p.replace(b"1", b"2"), t)   # altered
    with pytest.raises(frames.FrameAuthError):
        acceptor.open(FRAME.pack(len(p), control.NOTIFY), p, t)  # its kind changed
    acceptor.open(*sent[1])                          # the real one still opens: nothing moved
    other = frames.FrameKeys.derive(b"k" * 32, b"x" * 32, b"a" * 32, True)
    with pytest.raises(frames.FrameAuthError):
        acceptor.open(*_seal(other, control.MSG, b"from another session"))
    reflected = _seal(acceptor, control.MSG, b"back to its sender")
    with pytest.raises(frames.FrameAuthError):
        acceptor.open(*reflected)


def _received(be, seconds: float) -> list[bytes]:
    got = []
    with contextlib.suppress(DeadlineExceeded, queue.Empty):
        while True:
            got.append(be.recv(seconds)[1])
    return got


ORDER = b'{"rid": "r1", "pages": [3, 1, 0]}'


@pytest.mark.parametrize("name", ["shmem", "libfabric"])
@pytest.mark.parametrize("mode", ["alter", "replay", "inject", "swap", "drop"])
def test_a_relay_that_tampers_with_one_frame_resets_the_link(name, mode, caplog):
    caplog.set_level(logging.WARNING, logger="sglang_disagg")
    with _make(name, peer_timeout_s=60.0) as server, _make(name, peer_timeout_s=60.0) as client:
        # "alter": an in-range page id edited, the JSON still valid
        relay = Relay(server.address, alter=lambda p: p.replace(b'"pages": [3, 1, 0]', b'"pages": [3, 1, 2]'))
        try:
            peer = client.connect(relay.address, 5)
            peer.send(b"before")  # the relay passes honest frames: the link works through it
            assert server.recv(2.0)[1] == b"before"
            relay.arm(mode)
            peer.send(ORDER)
            peer.send(b"after")   # what "swap" puts first, what a "drop" makes fail
            assert relay.done.wait(5.0), "the relay saw no frame to tamper with"
            assert until(lambda: server.peers() == [], 2.0, 0.01), "the server kept the tampered link"
            assert until(lambda: peer.state is PeerState.LOST, 2.0, 0.01), f"the dialer's peer is {peer.state}"
            # Only what came before the tampered frame arrives: never it, nor anything after it.
            assert _received(server, 0.3) == ([ORDER] if mode == "replay" else [])
            assert "frame authentication failed" in caplog.text
            assert client.peers() == [] and server.peers() == []
        finally:
            relay.close()
        assert_still_serves(server, name)  # a fresh link (new keys) serves exactly


def test_an_admitted_peer_is_cut_at_its_first_bad_frame_not_at_a_deadline(caplog):
    """Without frame MACs a frame of the right shape was believed; here an admitted raw peer
    (no handshake deadline left, a 60 s silence limit) is closed at once for a bad tag."""
    caplog.set_level(logging.WARNING, logger="sglang_disagg")
    with _make("shmem", peer_timeout_s=60.0) as be:
        link = _admitted(be)
        header = FRAME.pack(len(ORDER), control.MSG)
        start = time.monotonic()
        link.sendall(header + ORDER + bytes(frames.TAG_BYTES))
        link.settimeout(5.0)
        with contextlib.suppress(ConnectionResetError):
            while link.recv(4096):
                pass
        assert time.monotonic() - start < 1.0
        assert _received(be, 0.2) == [] and be.peers() == []
        assert "frame authentication failed" in caplog.text
        assert_still_serves(be, "shmem")
