"""The control plane against hostile and broken peers (shared by every backend).

A real backend listens; raw sockets play the attacker: random bytes, another protocol,
truncated and oversized frames, wrong or missing secrets, frames before the handshake,
malformed HELLO and NOTIFY, silence, too many connections, and a seeded fuzz of frames
from an admitted peer. Each must close only that connection, promptly; afterwards an
honest peer with the secret still connects and its writes land byte-exact.
"""

from __future__ import annotations

import json
import random
import socket
import struct
import time

import pytest
import torch

from sglang_disagg.backends import BackendConfig, TransferError, create_backend
from sglang_disagg import shm
from sglang_disagg.backends import auth, control

SECRET = b"s" * 32
FRAME = struct.Struct("!IB")
BACKENDS = ["shmem", "libfabric"]


def _config(**kw) -> BackendConfig:
    provider = kw.pop("provider", None)
    return BackendConfig(provider=provider, secret=kw.pop("secret", SECRET), handshake_timeout_s=1.0, **kw)


def _make(name: str, **kw):
    return create_backend(name, _config(provider="tcp" if name == "libfabric" else None, **kw))


@pytest.fixture(params=BACKENDS)
def server(request):
    be = _make(request.param)
    yield be
    be.close()


def _raw(be, authenticate: bool = True, secret: bytes | None = SECRET) -> socket.socket:
    host, port = be.address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=5)
    if authenticate:
        auth.handshake(sock, secret, True, 2.0)
    return sock


def _closed_within(sock: socket.socket, seconds: float) -> float:
    """Seconds until the server closed `sock` (reads until EOF or reset)."""
    start = time.monotonic()
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
    except (ConnectionResetError, BrokenPipeError):
        pass
    except socket.timeout:
        raise AssertionError(f"the server kept the connection open for {seconds} s") from None
    finally:
        sock.close()
    return time.monotonic() - start


def _frame(kind: int, payload: bytes) -> bytes:
    return FRAME.pack(len(payload), kind) + payload


def _hello(be) -> dict:
    # The backend's own endpoint: a shmem peer must name memory the server can reach (its probe).
    return {"v": 1, "backend": be.name, "provider": be.provider, "instance": "f" * 32,
            "address": "127.0.0.1:9", "endpoint": be._endpoint_info()}


def assert_still_serves(be, name: str) -> None:
    """An honest peer with the secret connects to `be` and writes 3 pages into it."""
    buf = shm.shared_zeros((4096,), torch.uint8)  # shmem registers shared memory only
    region, desc = be.register(buf.data_ptr(), 4096)
    with _make(name) as writer:
        src_buf = shm.shared_zeros((4096,), torch.uint8)
        src_buf.fill_(7)
        src, _ = writer.register(src_buf.data_ptr(), 4096)
        peer = writer.connect(be.address, 5)
        remote = peer.add_remote_region(desc)
        expect = be.expect(4242, 3, 10)
        writer.write_pages(peer, src, [0, 1, 2], 1024, remote, [3, 1, 0], 1024, 1024, imm=4242).wait(10)
        expect.wait(10)
    assert buf.numpy().tobytes() == b"\x07" * 1024 * 2 + b"\x00" * 1024 + b"\x07" * 1024
    be.deregister(region)
    be.forget(4242)


HOSTILE = {
    "random bytes": lambda be: random.Random(1).randbytes(4096),
    "http request": lambda be: b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n",
    "truncated challenge": lambda be: b"SGDA\x01" + b"\x00" * 5,
    "challenge of another version": lambda be: b"SGDA\x07" + b"\x00" * 32 + b"\x00" * 32,
}


@pytest.mark.parametrize("case", HOSTILE)
def test_unauthenticated_garbage_closes_only_that_connection(server, case):
    sock = _raw(server, authenticate=False)
    sock.sendall(HOSTILE[case](server))
    assert _closed_within(sock, 3.0) < 2.0
    assert_still_serves(server, server.name)


AFTER_AUTH = {
    "oversized length prefix": lambda be: FRAME.pack(0xFFFFFFF0, control.HELLO),
    "hello larger than the pre-handshake bound": lambda be: FRAME.pack(control.MAX_HELLO + 1, control.HELLO),
    "unknown frame kind": lambda be: _frame(9, b"{}"),
    "message before hello": lambda be: _frame(control.MSG, b"hello?"),
    "notify before hello": lambda be: _frame(control.NOTIFY, b'{"tag": 1, "count": 1}'),
    "hello that is not json": lambda be: _frame(control.HELLO, b"\xff\x00not json"),
    "hello with a missing field": lambda be: _frame(control.HELLO, json.dumps(
        {k: v for k, v in _hello(be).items() if k != "endpoint"}).encode()),
    "hello with a wrong type": lambda be: _frame(control.HELLO, json.dumps(_hello(be) | {"v": "1"}).encode()),
    "hello with a bad address": lambda be: _frame(control.HELLO, json.dumps(
        _hello(be) | {"address": "nowhere"}).encode()),
    "truncated frame then eof": lambda be: FRAME.pack(100, control.HELLO) + b"{",
}


@pytest.mark.parametrize("case", AFTER_AUTH)
def test_authenticated_garbage_closes_only_that_connection(server, case):
    sock = _raw(server)
    sock.sendall(AFTER_AUTH[case](server))
    if case == "truncated frame then eof":
        sock.shutdown(socket.SHUT_WR)
    assert _closed_within(sock, 3.0) < 2.0
    assert_still_serves(server, server.name)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("secret", [b"w" * 32, None], ids=["wrong-secret", "no-secret"])
def test_a_peer_without_the_secret_is_refused(name, secret):
    with _make(name) as be, _make(name, secret=secret) as intruder:
        start = time.monotonic()
        with pytest.raises(TransferError, match="wrong or missing shared secret|refused our proof"):
            intruder.connect(be.address, 5)
        assert time.monotonic() - start < 2.0
        assert be.peers() == [] and intruder.peers() == []
        assert_still_serves(be, name)


def test_a_silent_connection_is_dropped_at_the_handshake_timeout(server):
    for authenticate in (False, True):  # silent before the challenge, and after it without a HELLO
        sock = _raw(server, authenticate=authenticate)
        took = _closed_within(sock, 5.0)
        assert 0.5 < took < 2.0, took
    assert_still_serves(server, server.name)


def test_connections_beyond_the_bound_are_refused_at_accept():
    with _make("shmem", max_connections=3) as be:
        idle = [_raw(be, authenticate=False) for _ in range(3)]
        extra = _raw(be, authenticate=False)
        assert _closed_within(extra, 3.0) < 0.5  # refused at once, not at the handshake timeout
        for s in idle:
            s.close()
        time.sleep(0.2)
        assert_still_serves(be, "shmem")


def test_admitted_peer_sending_bad_notify_or_fuzz_loses_only_its_connection():
    """Frames from a peer that authenticated and said HELLO: invalid NOTIFY tags and
    counts, then 200 seeded random frames (each on a fresh admitted connection)."""
    rng = random.Random(9)
    with _make("shmem") as be:
        def admitted() -> socket.socket:
            sock = _raw(be)
            sock.sendall(_frame(control.HELLO, json.dumps(_hello(be)).encode()))
            length, kind = FRAME.unpack(sock.recv(FRAME.size, socket.MSG_WAITALL))
            assert kind == control.HELLO and "error" not in json.loads(sock.recv(length, socket.MSG_WAITALL))
            return sock

        bad = [{"tag": 1, "count": -5}, {"tag": 2**40, "count": 1}, {"tag": 1, "count": 2**30},
               {"tag": "1", "count": 1}, {"tag": 1}, [1, 2], {"tag": 1, "count": 1, "x": 0}]
        for note in bad:
            sock = admitted()
            sock.sendall(_frame(control.NOTIFY, json.dumps(note).encode()))
            assert _closed_within(sock, 3.0) < 2.0, note
        assert be._tracker.arrived(1) == 0
        sock = admitted()
        for i in range(200):
            kind = rng.choice([control.HELLO, control.NOTIFY, 0, 6, 255])
            sock.sendall(_frame(kind, rng.randbytes(rng.randrange(0, 64))))
            _closed_within(sock, 3.0)
            sock = admitted()
            assert len(be.peers()) <= 1, i
        sock.close()
        assert_still_serves(be, "shmem")


def test_secret_from_the_environment(tmp_path):
    path = tmp_path / "secret"
    path.write_text(auth.new_secret() + "\n")
    assert auth.load_secret({auth.SECRET_FILE_ENV: str(path)}) == path.read_text().strip().encode()
    assert auth.load_secret({auth.SECRET_ENV: "x" * 20}) == b"x" * 20
    assert auth.load_secret({}) is None
    with pytest.raises(auth.AuthError, match="at least 16"):
        auth.load_secret({auth.SECRET_ENV: "short"})
    with pytest.raises(auth.AuthError, match="cannot read"):
        auth.load_secret({auth.SECRET_FILE_ENV: str(tmp_path / "missing")})
