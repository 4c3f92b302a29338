"""The control plane against hostile and broken peers (shared by every backend).

A real backend listens; raw sockets play the attacker: random bytes, another protocol,
truncated and oversized frames, wrong or missing secrets, frames before the handshake,
malformed HELLO and NOTIFY, silence, bytes trickled under the handshake deadline, too many
connections (evicted oldest first while not admitted, refused once every slot is admitted,
with a bounded number of log lines), and a seeded fuzz of frames from an admitted peer. Each must close only that connection, promptly; afterwards an
honest peer with the secret still connects and its writes land byte-exact.
"""

from __future__ import annotations

import json
import logging
import random
import socket
import struct
import time

import pytest
import torch

from sglang_disagg.backends import BackendConfig, TransferError, create_backend
from sglang_disagg.ipc import shm
from sglang_disagg.backends import auth, control, frames
from sglang_disagg.backends.regions import PeerState

SECRET = b"s" * 32
FRAME = struct.Struct("!IB")
BACKENDS = ["shmem", "libfabric"]


def _config(**kw) -> BackendConfig:
    provider = kw.pop("provider", None)
    kw.setdefault("handshake_timeout_s", 1.0)
    return BackendConfig(provider=provider, secret=kw.pop("secret", SECRET), **kw)


def _make(name: str, **kw):
    return create_backend(name, _config(provider="tcp" if name == "libfabric" else None, **kw))


@pytest.fixture(params=BACKENDS)
def server(request):
    be = _make(request.param)
    yield be
    be.close()


class Link:
    """A raw socket that authenticated as a dialer and seals what it sends, as ControlConn
    does (frames.py), so the frames below reach the server's parser; everything else
    (recv, settimeout, close...) is the socket's."""

    def __init__(self, sock: socket.socket, keys) -> None:
        self.sock, self.keys = sock, keys

    def __getattr__(self, name):
        return getattr(self.sock, name)

    def frame(self, kind: int, payload: bytes = b"") -> bytes:
        header = FRAME.pack(len(payload), kind)
        tag = self.keys.seal(header, payload)
        self.keys.commit()
        return header + payload + tag

    def read(self) -> tuple[int, bytes]:
        header = self.sock.recv(FRAME.size, socket.MSG_WAITALL)
        length, kind = FRAME.unpack(header)
        payload = self.sock.recv(length, socket.MSG_WAITALL) if length else b""
        self.keys.open(header, payload, self.sock.recv(frames.TAG_BYTES, socket.MSG_WAITALL))
        return kind, payload


def _raw(be, authenticate: bool = True, secret: bytes | None = SECRET):
    """A connection to `be`: a plain socket, or a Link once authenticated."""
    host, port = be.address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=5)
    if authenticate:
        return Link(sock, auth.handshake(sock, secret, True, 2.0))
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


def _hello(be, instance: str = "f" * 32) -> dict:
    # The backend's own endpoint: a shmem peer must name memory the server can reach (its probe).
    return {"v": 1, "backend": be.name, "provider": be.provider, "instance": instance,
            "address": "127.0.0.1:9", "endpoint": be._endpoint_info()}


def _admitted(be, instance: str = "f" * 32) -> Link:
    """A raw socket that authenticated and said HELLO: an admitted peer of `be`."""
    sock = _raw(be)
    sock.sendall(sock.frame(control.HELLO, json.dumps(_hello(be, instance)).encode()))
    kind, payload = sock.read()
    while kind == control.PING:  # the server may beat before its reply
        kind, payload = sock.read()
    assert kind == control.HELLO and "error" not in json.loads(payload)
    return sock


def _accepted(be) -> socket.socket:
    """An unauthenticated socket that the server has accepted (its challenge arrived), so
    sockets opened one after another take their slots in that order."""
    sock = _raw(be, authenticate=False)
    assert len(sock.recv(auth._CHALLENGE.size, socket.MSG_WAITALL)) == auth._CHALLENGE.size
    return sock


def _still_open(sock: socket.socket, wait_s: float = 0.1) -> bool:
    sock.settimeout(wait_s)
    try:
        while sock.recv(4096):
            pass
    except socket.timeout:
        return True
    except ConnectionResetError:
        pass
    return False


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
    "oversized length prefix": lambda be, link: FRAME.pack(0xFFFFFFF0, control.HELLO),
    "hello larger than the pre-handshake bound": lambda be, link: FRAME.pack(control.MAX_HELLO + 1, control.HELLO),
    "unknown frame kind": lambda be, link: link.frame(9, b"{}"),
    "message before hello": lambda be, link: link.frame(control.MSG, b"hello?"),
    "notify before hello": lambda be, link: link.frame(control.NOTIFY, b'{"tag": 1, "count": 1}'),
    "hello that is not json": lambda be, link: link.frame(control.HELLO, b"\xff\x00not json"),
    "hello with a missing field": lambda be, link: link.frame(control.HELLO, json.dumps(
        {k: v for k, v in _hello(be).items() if k != "endpoint"}).encode()),
    "hello with a wrong type": lambda be, link: link.frame(control.HELLO, json.dumps(_hello(be) | {"v": "1"}).encode()),
    "hello with a bad address": lambda be, link: link.frame(control.HELLO, json.dumps(
        _hello(be) | {"address": "nowhere"}).encode()),
    "truncated frame then eof": lambda be, link: FRAME.pack(100, control.HELLO) + b"{",
    # What a relay that passed the handshake through could send: no valid tag.
    "hello without its tag": lambda be, link: FRAME.pack(len(b := json.dumps(_hello(be)).encode()), control.HELLO) + b
    + bytes(frames.TAG_BYTES),
    "hello sealed with another session's keys": lambda be, link: Link(None, frames.FrameKeys.derive(
        SECRET, b"a" * 32, b"b" * 32, True)).frame(control.HELLO, json.dumps(_hello(be)).encode()),
    "a well-formed ping, replayed": lambda be, link: (p := link.frame(control.PING)) + p,
}


@pytest.mark.parametrize("case", AFTER_AUTH)
def test_authenticated_garbage_closes_only_that_connection(server, case):
    sock = _raw(server)
    sock.sendall(AFTER_AUTH[case](server, sock))
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


def _trickle(sock: socket.socket, data: bytes, start: float, every_s: float = 0.3, cap_s: float = 5.0) -> float:
    """Send `data` one byte every `every_s` until the server closes `sock`; the seconds from
    `start` to that close (AssertionError if it stays open `cap_s`)."""
    sock.settimeout(every_s)
    sent = 0
    try:
        while time.monotonic() - start < cap_s:
            try:
                if not sock.recv(4096):
                    return time.monotonic() - start
            except socket.timeout:
                sock.send(data[sent % len(data):][:1])
                sent += 1
    except (ConnectionResetError, BrokenPipeError):
        return time.monotonic() - start
    finally:
        sock.close()
    raise AssertionError(f"a peer trickling one byte every {every_s} s ({sent} sent) held its connection {cap_s} s")


def test_a_ping_before_the_hello_is_no_protocol_error_and_does_not_stretch_the_deadline(server):
    """The accepting side admits its dialer before its HELLO reply leaves, so the dialer can see
    the acceptor's heartbeat first (a CI run failed a conformance setup on "PING before the
    handshake"). An authenticated peer's PINGs before its HELLO are ignored, and the pre-HELLO
    deadline (1 s here) still closes the connection however many of them arrive."""
    sock = _raw(server)
    start = time.monotonic()
    closed = None
    while time.monotonic() - start < 5.0:  # without the deadline, the PINGs would keep it open
        try:
            sock.sendall(sock.frame(control.PING))
        except OSError:
            closed = time.monotonic() - start
            break
        if not _still_open(sock, 0.1):
            closed = time.monotonic() - start
            break
    # 1 s deadline; the upper bound leaves a loaded machine room to schedule the reader thread
    assert closed is not None and 0.7 < closed < 3.5, f"closed {closed} s after the handshake (deadline 1 s)"
    assert_still_serves(server, server.name)


@pytest.mark.parametrize("phase", ["challenge", "hello"])
def test_a_peer_trickling_bytes_is_cut_at_the_handshake_deadline(phase):
    """Each byte resets a timeout per recv(), never a deadline: the challenge (unauthenticated)
    and the HELLO after it must both be done within handshake_timeout_s (1 s) of the accept."""
    deadline = 1.0
    with _make("shmem", handshake_timeout_s=deadline) as be:
        start = time.monotonic()
        if phase == "challenge":
            sock, data = _raw(be, authenticate=False), auth._CHALLENGE.pack(auth._MAGIC, auth._VERSION, b"n" * 32)
        else:
            sock = _raw(be)
            data = sock.frame(control.HELLO, json.dumps(_hello(be)).encode())
        took = _trickle(sock, data, start)
        assert deadline - 0.1 < took < deadline + 0.5, f"{phase}: closed {took:.3f} s after connecting"
        assert_still_serves(be, "shmem")


def test_a_full_server_evicts_the_oldest_unadmitted_connection_for_a_real_peer():
    # A 30 s deadline: only eviction can make room within the test.
    with _make("shmem", max_connections=8, handshake_timeout_s=30.0, peer_timeout_s=60.0) as be:
        silent = [_accepted(be) for _ in range(8)]
        with _make("shmem") as writer:
            start = time.monotonic()
            peer = writer.connect(be.address, 5)
            took = time.monotonic() - start
            assert took < 0.5, f"a real peer took {took:.3f} s to connect to a server full of silent sockets"
            assert be._server.evicted == 1, be._server.evicted
            assert _closed_within(silent[0], 1.0) < 0.5 and all(_still_open(s) for s in silent[1:])
            newcomers = [_accepted(be) for _ in range(3)]  # evict silent[1..3], not the admitted peer
            open_now = [i for i, s in enumerate(silent[1:], 1) if _still_open(s)]
            assert open_now == [4, 5, 6, 7], f"still open after 3 more newcomers: {open_now}"
            assert (be._server.evicted, be._server.refused) == (4, 0)
            assert len(be.peers()) == 1 and _still_open(newcomers[-1]) and peer.state is PeerState.CONNECTED
        for s in silent + newcomers:
            s.close()


def test_admitted_connections_are_never_evicted():
    with _make("shmem", max_connections=3, peer_timeout_s=60.0) as be:
        held = [_admitted(be, f"{i:032x}") for i in range(3)]
        took = _closed_within(_raw(be, authenticate=False), 3.0)
        assert took < 0.5, f"a newcomer to a server full of admitted peers was closed after {took:.3f} s"
        assert (be._server.refused, be._server.evicted) == (1, 0)
        assert all(_still_open(s) for s in held) and len(be.peers()) == 3
        held[0].close()  # a freed slot takes a new peer again
        deadline = time.monotonic() + 2.0
        while len(be.peers()) > 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert_still_serves(be, "shmem")
        for s in held[1:]:
            s.close()


@pytest.mark.parametrize("full_of", ["silent", "admitted"])
def test_a_connection_flood_writes_a_handful_of_log_lines(caplog, full_of):
    """1000 newcomers to a full server: each evicts the oldest silent socket, or is refused
    when every slot is admitted. The counters are exact; the log gets a line per 5 s."""
    n = 1000
    caplog.set_level(logging.WARNING, logger="sglang_disagg")
    with _make("shmem", max_connections=4, handshake_timeout_s=30.0, peer_timeout_s=60.0) as be:
        held = [_accepted(be) if full_of == "silent" else _admitted(be, f"{i:032x}") for i in range(4)]
        caplog.clear()
        start = time.monotonic()
        for _ in range(n):
            if full_of == "silent":
                held.append(_accepted(be))
                _closed_within(held.pop(0), 2.0)  # the oldest was evicted for it
            else:
                _closed_within(_raw(be, authenticate=False), 2.0)
        took = time.monotonic() - start
        lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        counts = (be._server.evicted, be._server.refused)
        assert counts == ((n, 0) if full_of == "silent" else (0, n)), f"(evicted, refused) = {counts}"
        assert 1 <= len(lines) <= 3, f"{len(lines)} log lines for {n} connections in {took:.2f} s: {lines}"
        for s in held:
            s.close()


def test_throttled_warnings_report_what_they_skipped(caplog):
    caplog.set_level(logging.WARNING, logger="sglang_disagg")
    throttle = control._Throttle(0.05)
    for i in range(5):
        throttle.warn("k", "line %d", i)
    time.sleep(0.06)
    throttle.warn("k", "line %d", 5)
    assert [r.getMessage() for r in caplog.records] == ["line 0", "line 5 (and 4 more since the last such line)"]


def test_admitted_peer_sending_bad_notify_or_fuzz_loses_only_its_connection():
    """Frames from a peer that authenticated and said HELLO: invalid NOTIFY tags and
    counts, then 200 seeded random frames (each on a fresh admitted connection)."""
    rng = random.Random(9)
    with _make("shmem") as be:
        bad = [{"tag": 1, "count": -5}, {"tag": 2**40, "count": 1}, {"tag": 1, "count": 2**30},
               {"tag": "1", "count": 1}, {"tag": 1}, [1, 2], {"tag": 1, "count": 1, "x": 0}]
        for note in bad:
            sock = _admitted(be)
            sock.sendall(sock.frame(control.NOTIFY, json.dumps(note).encode()))
            assert _closed_within(sock, 3.0) < 2.0, note
        assert be._tracker.arrived(1) == 0
        sock = _admitted(be)
        for i in range(200):
            kind = rng.choice([control.HELLO, control.NOTIFY, 0, 6, 255])
            sock.sendall(sock.frame(kind, rng.randbytes(rng.randrange(0, 64))))
            _closed_within(sock, 3.0)
            sock = _admitted(be)
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
