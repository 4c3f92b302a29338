"""Control frames are sealed after the handshake (backends/frames.py): an on-path relay that
passed both handshakes through untouched, then alters, injects, replays, reorders or drops one
frame, resets the link; nothing it touched is believed, nothing is left behind, and the peers
serve again on a fresh link. Real backends (shmem, libfabric tcp) and real sockets; the relay
is the attacker, the only fake."""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import struct
import threading
import time

import pytest
from test_control_plane import FRAME, _admitted, _make, assert_still_serves
from transfer_harness import until

from sglang_disagg.backends import DeadlineExceeded, auth, control, frames
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


class Relay:
    """A TCP relay between a dialer and `target`: both handshakes pass untouched, then the
    dialer's frames are parsed and, once armed, one is tampered with by `mode`."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.armed = threading.Event()
        self.mode = ""
        self.done = threading.Event()
        self.threads = [threading.Thread(target=self._serve, daemon=True)]
        self.threads[0].start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            client, _ = self.listener.accept()
            host, port = self.target.rsplit(":", 1)
            server = socket.create_connection((host, int(port)), timeout=5)
            server.settimeout(None)
            self.socks = (client, server)
            back = threading.Thread(target=self._copy, args=(server, client), daemon=True)
            back.start()
            self._frames(client, server)

    @staticmethod
    def _copy(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    @staticmethod
    def _exactly(sock: socket.socket, n: int) -> bytes:
        return sock.recv(n, socket.MSG_WAITALL) if n else b""

    def _frames(self, src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError, struct.error):
            dst.sendall(self._exactly(src, auth._CHALLENGE.size))  # the dialer's challenge,
            dst.sendall(self._exactly(src, 32))                      # then its proof, untouched
            held: bytes | None = None
            first_msg = b""
            while True:
                header = self._exactly(src, FRAME.size)
                length, kind = FRAME.unpack(header)
                frame = header + self._exactly(src, length + frames.TAG_BYTES)
                if kind == control.MSG and not first_msg:
                    first_msg = frame
                if held is not None:  # "swap": the frame after the held one goes first
                    dst.sendall(frame + held)
                    held = None
                    self.done.set()
                    continue
                if kind == control.MSG and self.armed.is_set() and not self.done.is_set():
                    if self.mode == "alter":  # an in-range edit that still parses
                        frame = frame.replace(b'"pages": [3, 1, 0]', b'"pages": [3, 1, 2]')
                    elif self.mode == "replay":
                        frame = frame + frame
                    elif self.mode == "inject":  # a frame sealed earlier in this very session
                        frame = first_msg + frame
                    elif self.mode == "drop":
                        frame = b""
                    elif self.mode == "swap":
                        held = frame
                        continue
                    self.done.set()
                dst.sendall(frame)

    def close(self) -> None:
        self.listener.close()
        for s in getattr(self, "socks", ()):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()


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
        relay = Relay(server.address)
        try:
            peer = client.connect(relay.address, 5)
            peer.send(b"before")  # the relay passes honest frames: the link works through it
            assert server.recv(2.0)[1] == b"before"
            relay.mode = mode
            relay.armed.set()
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
