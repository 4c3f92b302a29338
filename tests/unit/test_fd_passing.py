"""File descriptors between processes over SCM_RIGHTS (fdpass.py) and the TP ranks' KV
handover built on it (handover.py), with memfds standing in for cuMem allocations: both
are shared by a descriptor, and nothing here needs ptrace rights (no pidfd_getfd).

Every test crosses a real process boundary where it claims to: the sender is a separate
Python process, the receiver maps what arrived and reads the bytes the sender wrote at
the offsets its header names.
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from sglang_disagg.ipc import cumem, fdpass, handover

PAGE = 4096


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _python(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(p: subprocess.Popen) -> str:
    out, err = p.communicate(timeout=30)
    assert p.returncode == 0, err
    return out


SENDER = """
    import os, sys
    from sglang_disagg.ipc import fdpass
    fd = os.memfd_create("fdpass-test")
    os.ftruncate(fd, 4 * 4096)
    os.pwrite(fd, b"written at an offset", 2 * 4096 + 100)
    with fdpass.connect(sys.argv[1], 10.0) as conn:
        conn.send("test-memory", {"items": [{"id": 5, "size": 4 * 4096, "offset": 2 * 4096 + 100}]}, [fd])
        assert conn.recv(10.0).kind == "thanks"
"""


def test_a_descriptor_sent_by_another_process_maps_the_same_memory():
    lst = fdpass.Listener("test")
    p = _python(SENDER, lst.name)
    try:
        with lst.accept(10.0) as conn:
            assert (conn.cred.pid, conn.cred.uid) == (p.pid, os.getuid())  # the kernel's word, not the sender's
            msg = conn.recv(10.0)
            assert msg.kind == "test-memory" and len(msg.fds) == 1
            (item,) = msg.body["items"]
            with mmap.mmap(msg.fds[0], item["size"]) as m:
                assert m[item["offset"]:item["offset"] + 20] == b"written at an offset"
            msg.close_fds()
            conn.send("thanks", {})
        _finish(p)
    finally:
        lst.close()


RANK = """
    import json, mmap, os, sys
    from sglang_disagg.ipc import cumem, handover

    class Memfd:  # what the table needs of an allocation: its descriptor
        def __init__(self, size, byte):
            self.f = os.memfd_create("kv")
            os.ftruncate(self.f, size)
            self.m = mmap.mmap(self.f, size)
            self.m[:size // 2] = bytes([byte]) * (size // 2)          # K half
            self.m[size // 2:] = bytes([byte + 1]) * (size // 2)      # V half
        def fd(self):
            return self.f

    import ctypes
    exports = []
    for i, size in enumerate((8 * 4096, 4 * 4096)):
        a = Memfd(size, 10 * (i + 1))
        base = ctypes.addressof(ctypes.c_char.from_buffer(a.m))
        cumem._add(base, size, 0, a)
        exports += [cumem.export_range(base, size // 2), cumem.export_range(base + size // 2, size // 2)]
    print(json.dumps([[e.pid, e.key, e.size, e.offset, e.length, e.device] for e in exports]), flush=True)
    leader = json.loads(sys.stdin.readline())
    handover.give(handover.Address(*leader), 1, exports)
"""


def _rank(inbox: handover.Inbox) -> tuple[subprocess.Popen, list[cumem.Export]]:
    p = _python(RANK)
    exports = [cumem.Export(*e) for e in json.loads(p.stdout.readline())]
    p.stdin.write(json.dumps([inbox.address.pid, inbox.address.name]) + "\n")
    p.stdin.flush()
    return p, exports


def test_a_rank_hands_its_allocations_to_the_leader_and_the_halves_are_found_at_their_offsets():
    inbox = handover.Inbox()
    try:
        p, exports = _rank(inbox)
        assert [e.offset for e in exports] == [0, 4 * PAGE, 0, 2 * PAGE]  # K and V of two allocations
        assert len({e.key for e in exports}) == 2 and {e.pid for e in exports} == {p.pid}
        got = inbox.collect({1: exports}, timeout_s=20.0)
        _finish(p)  # the rank has exited: what arrived is ours, not borrowed from a live process
    finally:
        inbox.close()
    fds = got[1]
    assert set(fds) == {e.key for e in exports}
    for e, byte in zip(exports, (10, 11, 20, 21)):
        with mmap.mmap(fds[e.key], e.size) as m:
            assert m[e.offset:e.offset + e.length] == bytes([byte]) * e.length
    for f in fds.values():
        os.close(f)


def test_the_leader_refuses_a_sender_that_is_not_the_rank_and_keeps_no_descriptor():
    inbox = handover.Inbox()
    try:
        p, exports = _rank(inbox)
        before = _open_fds()
        claimed = [dataclasses.replace(e, pid=p.pid + 1) for e in exports]  # rank 1 is said to be another pid
        with pytest.raises(fdpass.FdPassError, match=f"pid {p.pid}.*expected pid {p.pid + 1}"):
            inbox.collect({1: claimed}, timeout_s=20.0)
        assert _open_fds() == before
        _finish(p)
    finally:
        inbox.close()


def test_a_rank_refuses_to_hand_over_to_a_listener_that_is_not_the_leader():
    lst = fdpass.Listener("impostor")
    try:
        with pytest.raises(fdpass.FdPassError, match="expected pid 1 "):
            handover.give(handover.Address(1, lst.name), 1, [cumem.Export(1, 7, PAGE, 0, PAGE, 0)])
    finally:
        lst.close()


@pytest.mark.parametrize("header,why", [
    ({"v": 2, "kind": "x", "nfds": 1, "body": {}}, "version 2"),
    ({"v": 1, "kind": "x", "nfds": 2, "body": {}}, "announces 2 descriptors, 1 arrived"),
    ({"v": 1, "kind": "x", "body": {}}, "must have fields"),
    ("not json", "not JSON"),
])
def test_a_malformed_message_is_refused_and_its_descriptors_closed(header, why):
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    fd = os.memfd_create("stray")
    try:
        before = _open_fds()
        raw = header.encode() if isinstance(header, str) else json.dumps(header).encode()
        socket.send_fds(a, [raw], [fd])
        with pytest.raises(fdpass.FdPassError, match=why):
            fdpass.Conn(b).recv(5.0)
        assert _open_fds() == before  # the received duplicate was closed
    finally:
        os.close(fd)
        a.close()
        b.close()


def test_nobody_listening_is_a_clear_error():
    with pytest.raises(fdpass.FdPassError, match="nobody listens.*not on this host"):
        fdpass.connect("sglang-disagg-test-nobody-here", 0.1)


def test_closing_a_listener_wakes_the_thread_blocked_in_accept():
    """What a backend's close() relies on to end its descriptor-serving thread."""
    import threading

    lst = fdpass.Listener("test")
    seen: list[str] = []

    def serve() -> None:
        try:
            lst.accept(None)
        except fdpass.FdPassError as e:
            seen.append(str(e))

    t = threading.Thread(target=serve)
    t.start()
    lst.close()
    t.join(5.0)
    assert not t.is_alive() and seen
