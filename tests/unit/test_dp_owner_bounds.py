"""What one DP group, or another local user, can do to a server's owner (dp/owner.py): the
owner's socket named after the deployment's secret, a taken name stopping the owner, a
group refusing a listener of another user, and a stopped group dropped within
SEND_TIMEOUT_S with the rest of the server going on (real backends, a real ProxyBackend in
a process of its own, SIGSTOPped).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import select
import signal
import socket
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import pytest

from sglang_disagg.backends import BackendConfig, TransferError, create_backend
from sglang_disagg.ipc import stream
from sglang_disagg.messenger import wire
from sglang_disagg.messenger.config import MessengerRole
from sglang_disagg.messenger.dp import wire as gw
from sglang_disagg.messenger.dp.owner import SEND_TIMEOUT_S, Owner
from sglang_disagg.messenger.dp.place import Place
from sglang_disagg.messenger.dp.proxy import ProxyBackend

from .test_dp_owner import _recv  # the same wait for a message

SECRET = secrets.token_bytes(32)
BACKENDS = [("shmem", None), ("libfabric", "tcp")]
ROOT = Path(__file__).resolve().parents[2]
NOBODY = 65534
# A group's leader in a process of its own: it joins, says so, and reports its owner gone.
GROUP = r"""
import sys, time
from sglang_disagg.messenger.dp.proxy import ProxyBackend
group = ProxyBackend(sys.argv[1], int(sys.argv[2]), deadline_s=20.0)
print("joined", flush=True)
while not group.gone:
    time.sleep(0.05)
print("gone:", group.gone, flush=True)
"""


def _backend(name, provider):
    return create_backend(name, BackendConfig(provider=provider, host="127.0.0.1", port=0, secret=SECRET))


def _name() -> str:
    return gw.socket_name(f"test-{os.getpid()}-{secrets.token_hex(4)}", SECRET)


def _readable(f, timeout: float) -> bool:
    """Whether `f` has something to read within `timeout` s. poll, not select: select() fails
    outright on a descriptor numbered 1,024 or more, which a long test process reaches."""
    p = select.poll()
    p.register(f, select.POLLIN)
    return bool(p.poll(timeout * 1000))


def _line(proc: subprocess.Popen, timeout: float) -> str:
    ready = _readable(proc.stdout, timeout)
    return proc.stdout.readline().decode() if ready else ""


def _queued(sock: socket.socket) -> int:
    """Bytes sent on `sock` that its other end has not read yet."""
    return int.from_bytes(fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, bytes(4)), sys.byteorder, signed=True)


def _until(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _hello(pad: int) -> wire.Hello:
    kv = wire.KVSpec(model="m", fingerprint="f", num_layers=1, kv_heads=1, head_dim=64, v_head_dim=64,
                     page_size=1, dtype="f", layout="hnd", tp=1)
    return wire.Hello(decoder="d" + "x" * pad, backend="shmem", provider="", kv=kv, ranks=())


def _order(tag: int, tokens: int = 1) -> wire.PrefillOrder:
    return wire.PrefillOrder(rid=f"r{tag}", tag=tag, token_ids=(1,) * tokens, dst_pages=(0,), start_page=0)


@pytest.mark.parametrize("name,provider", BACKENDS, ids=[b[0] for b in BACKENDS])
def test_a_stopped_group_is_dropped_within_the_send_timeout_and_the_server_goes_on(name, provider, caplog,
                                                                                    record_property):
    caplog.set_level(logging.INFO, logger="sglang_disagg.messenger")
    owner_backend, decoder = _backend(name, provider), _backend(name, provider)
    path = _name()
    local = []
    owner = Owner(owner_backend, path, MessengerRole.PREFILL, groups=3, local=lambda p, m: local.append(m))
    stopped = subprocess.Popen([sys.executable, "-c", GROUP, path, "1"], cwd=ROOT, stdout=subprocess.PIPE)
    live = None
    try:
        assert _line(stopped, 60.0) == "joined\n"
        live = ProxyBackend(path, 2, deadline_s=5.0)
        _until(lambda: {1, 2} <= owner._conns.keys())
        link = decoder.connect(owner_backend.address, 5.0)  # the decoder's link; its peer at the owner:
        link.send(wire.encode(_hello(0)))
        dec, raw = _recv(owner_backend)
        owner.dispatch(dec, raw, wire.decode(raw))
        to_live = [raw]

        def give(msg):
            raw = wire.encode(msg)
            t = time.monotonic()
            owner.dispatch(dec, raw, msg)
            return raw, time.monotonic() - t

        os.kill(stopped.pid, signal.SIGSTOP)
        _until(lambda: Path(f"/proc/{stopped.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T")
        # Large Hellos to every group until the stopped one's socket is full (group 1 takes
        # none of them, group 2 all): none of these dispatches waits.
        chan = owner._conns[1]
        full = chan.sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        quick = []
        while _queued(chan.sock) + 2 * 32_768 < full:
            raw, took = give(_hello(32_000))
            to_live.append(raw)
            quick.append(took)
        assert len(quick) >= 2 and max(quick) < 1.0, quick
        # An order to group 0, then one to group 1 (fewest outstanding, lowest): it cannot take
        # it, and the dispatch gives up after SEND_TIMEOUT_S.
        give(_order(1))
        _, slowest = give(_order(2, tokens=600_000))
        record_property("send_deadline_s", round(slowest, 3))
        print(f"\nslowest dispatch ({name}): {slowest:.3f} s; SEND_TIMEOUT_S {SEND_TIMEOUT_S}")
        assert SEND_TIMEOUT_S - 0.1 <= slowest <= SEND_TIMEOUT_S + 1.0, slowest
        assert 1 not in owner._conns and 2 in owner._conns
        # ... and fails that order back to its decoder at once, forgotten here.
        _, back = _recv(decoder)
        failed = wire.decode(back)
        assert isinstance(failed, wire.OrderFailed) and (failed.rid, failed.tag) == ("r2", 2), failed
        assert failed.blame is wire.Blame.SERVER and "DP group 1" in failed.reason and "took" in failed.reason
        assert (dec.id, 2) not in owner._orders and owner.outstanding == [1, 0, 0]
        # The server goes on: Hellos and orders at once, orders to the live groups only.
        for tag in range(3, 7):
            raw, took = give(_hello(32_000))
            to_live.append(raw)
            assert took < 1.0
            raw, took = give(_order(tag))
            assert took < 1.0
            if owner._orders[(dec.id, tag)] == 2:
                to_live.append(raw)
        assert set(owner._orders.values()) == {0, 2} and owner.outstanding[1] == 0
        got = [live.recv(5.0)[1] for _ in to_live]
        assert got == to_live  # group 2 got every message, in order
        assert [m.tag for m in local if isinstance(m, wire.PrefillOrder)] == sorted(
            t for (_, t), g in owner._orders.items() if g == 0)
        drops = [r for r in caplog.records if "DP group 1" in r.getMessage() and r.levelno >= logging.WARNING]
        assert len(drops) == 1 and "dropped" in drops[0].getMessage(), [r.getMessage() for r in drops]
        # Woken up, group 1 finds its owner gone and stops.
        os.kill(stopped.pid, signal.SIGCONT)
        said = _line(stopped, 10.0)
        assert said.startswith("gone:") and "owner" in said, said
        assert stopped.wait(10.0) == 0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(stopped.pid, signal.SIGCONT)
        stopped.kill()
        stopped.wait()
        if live is not None:
            live.close()
        owner.close()
        owner_backend.close()
        decoder.close()


def test_the_owner_socket_is_named_after_the_secret():
    a, b = secrets.token_bytes(32), secrets.token_bytes(32)
    name = gw.socket_name("prefill-30000", a)
    assert name == gw.socket_name("prefill-30000", a)
    assert name != gw.socket_name("prefill-30000", b) and name != gw.socket_name("decode-30000", a)
    assert name != gw.socket_name("prefill-30001", a)
    assert name.startswith("sglang-disagg-dp/") and "30000" not in name and "prefill" not in name
    assert gw.socket_name("prefill-30000") == "sglang-disagg-dp/prefill-30000"  # no secret: as before
    # Every group of the server derives it from the secret its node required.
    place = Place(1, 2, 0, 1, None, "prefill-30000")
    assert place.owner_socket(a) == name


def test_a_taken_name_stops_the_owner():
    backend = _backend("shmem", None)
    path = _name()
    squatter = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    squatter.bind("\0" + path)
    squatter.listen(1)
    try:
        t = time.monotonic()
        with pytest.raises(TransferError, match="is taken"):
            Owner(backend, path, MessengerRole.DECODE, groups=2)
        assert time.monotonic() - t < 1.0
    finally:
        squatter.close()
        backend.close()


class Nobody:
    """`work` run in a forked child as uid nobody (stdlib calls only in it, then _exit): it may call
    `ready()` to tell the test it is set up, and returns a report string; an exception's repr
    is reported instead. Killed and reaped on exit, whatever happened."""

    def __init__(self, work) -> None:
        self._ready_r, ready_w = os.pipe()
        self._out_r, out_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            code = 0
            try:
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                os.write(out_w, work(lambda: os.write(ready_w, b"1")).encode())
            except BaseException as e:  # noqa: BLE001 - reported to the test, never raised in the fork
                os.write(out_w, f"error {e!r}".encode())
                code = 1
            finally:
                os._exit(code)
        os.close(ready_w)
        os.close(out_w)

    def ready(self, timeout: float = 20.0) -> bool:
        return bool(_readable(self._ready_r, timeout)) and os.read(self._ready_r, 1) == b"1"

    def report(self, timeout: float = 30.0) -> str:
        assert _readable(self._out_r, timeout), f"the child said nothing in {timeout} s"
        return os.read(self._out_r, 200).decode()

    def __enter__(self) -> Nobody:
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self._ready_r)
        os.close(self._out_r)
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)


def test_a_group_refuses_a_listener_of_another_user():
    """Another user bound the owner's name first (here uid nobody, in a forked child): the
    group refuses it on its credentials, naming its uid, and sends it nothing."""
    path = _name()

    def squat(ready) -> str:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind("\0" + path)
        s.listen(1)
        ready()
        s.settimeout(20.0)
        c, _ = s.accept()
        c.settimeout(20.0)
        n = 0
        while chunk := c.recv(65536):
            n += len(chunk)
        return f"{os.getuid()} {n}"

    with Nobody(squat) as squatter:
        assert squatter.ready()
        with pytest.raises(TransferError, match=f"runs as uid {NOBODY}, this one as uid {os.getuid()}"):
            ProxyBackend(path, 1, deadline_s=5.0)
        assert squatter.report(20.0) == f"{NOBODY} 0"  # the listener got 0 bytes


def test_a_reader_taking_a_little_at_a_time_cannot_stretch_a_send():
    """The send timeout bounds the whole send, not each syscall; the channel is of no further
    use after it (the frame was cut), and reads on it stay blocking."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    stop = threading.Event()

    def trickle():
        while not stop.wait(0.05):
            b.recv(4096)

    reader = threading.Thread(target=trickle, daemon=True)
    reader.start()
    chan = gw.Channel(a, 0.3)
    try:
        t = time.monotonic()
        with pytest.raises(stream.SendTimeout, match="took"):
            chan.send(gw.Delivery(1, "i", "h:1", b"x" * (2 << 20)))
        assert 0.25 <= time.monotonic() - t < 2.0  # 0.3 s deadline; room for a loaded machine
        t = time.monotonic()
        with pytest.raises(stream.SendTimeout, match="earlier"):
            chan.send(gw.Done(1))
        assert time.monotonic() - t < 0.5  # no syscall: fails at once
        assert a.gettimeout() is None  # blocking reads
    finally:
        stop.set()
        reader.join(2.0)
        a.close()
        b.close()


def test_the_owner_refuses_another_user_at_accept_and_goes_on_serving(caplog):
    """A process of another user (uid nobody, in a forked child) connects to the owner's real
    socket 50 times, each time sending a Join: every connection is closed at accept before a
    byte is read or sent, counted, and logged at a bounded rate; a group of the server's own
    user joins afterwards and is served."""
    caplog.set_level(logging.WARNING, logger="sglang_disagg.messenger")
    backend = _backend("shmem", None)
    path = _name()
    owner = Owner(backend, path, MessengerRole.DECODE, groups=2)

    def connect_50_times(ready) -> str:
        got = 0
        for _ in range(50):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(10.0)
            s.connect("\0" + path)
            with contextlib.suppress(OSError):  # the owner may have closed it already
                s.sendall(gw.encode(gw.Join(1)))
            with contextlib.suppress(ConnectionResetError):
                while chunk := s.recv(65536):
                    got += len(chunk)
            s.close()
        return f"{os.getuid()} {got}"

    group = None
    try:
        with Nobody(connect_50_times) as other:
            assert other.report(30.0) == f"{NOBODY} 0"  # 50 connections, not a byte back
        assert owner.refused == 50
        lines = [r.getMessage() for r in caplog.records if "refused a connection to the DP owner" in r.getMessage()]
        assert 1 <= len(lines) <= 2 and f"runs as uid {NOBODY}" in lines[0], lines
        group = ProxyBackend(path, 1, deadline_s=5.0)  # the server's own user: joins and is served
        assert group.address == backend.address
    finally:
        if group is not None:
            group.close()
        owner.close()
        backend.close()


def test_a_connection_that_never_joins_is_closed_at_the_join_deadline(monkeypatch, caplog):
    """A process of the server's own user connects to the owner and sends nothing: the owner
    closes it at JOIN_S (its serving thread ends) and a real group joins and is served meanwhile."""
    from sglang_disagg.messenger.dp import owner as owner_mod

    caplog.set_level(logging.ERROR, logger="sglang_disagg.messenger")
    monkeypatch.setattr(owner_mod, "JOIN_S", 0.5)
    backend = _backend("shmem", None)
    path = _name()
    owner = Owner(backend, path, MessengerRole.DECODE, groups=2)
    silent, group = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM), None
    try:
        silent.settimeout(10.0)
        silent.connect("\0" + path)
        t0 = time.monotonic()
        group = ProxyBackend(path, 1, deadline_s=5.0)  # joins beside the silent one
        assert group.address == backend.address
        assert silent.recv(1) == b""                   # closed by the owner, not by us
        took = time.monotonic() - t0
        assert 0.4 < took < 3.0, f"closed after {took:.2f} s (JOIN_S 0.5)"
        assert any("sent no Join within 0.5 s" in r.getMessage() for r in caplog.records)
    finally:
        silent.close()
        if group is not None:
            group.close()
        owner.close()
        backend.close()
