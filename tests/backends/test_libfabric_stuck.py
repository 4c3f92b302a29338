"""libfabric shm with a spinlock in shared memory held by a dead process.

libfabric 1.17 shm guards each endpoint's queues with a pthread spinlock inside the region
(/dev/shm/<pid>:<uid>:<ep>): posts take the peer's, progress takes our own. A process killed
inside one of those critical sections leaves the lock held for good, and whoever waits for it
inside the provider spins forever. These tests make exactly that happen, with a helper process
that takes the lock and is SIGKILLed holding it, while writes are going; then they check that the
backend fails what was pending with a clear error, replaces the endpoint, and serves new peers.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from transfer_harness import HERE, Proc, until

from sglang_disagg.backends import PeerLostError, available

pytestmark = [pytest.mark.backend,
              pytest.mark.skipif(not available("libfabric")[0], reason="libfabric shim not built")]

PAGES = [[i << 20, i << 20, 1 << 20] for i in range(4)]


class StuckProc(Proc):
    def __init__(self, options: dict | None = None) -> None:
        super().__init__("libfabric", "shm", worker="stuck_worker.py", options=options or {})


def hold_lock_and_die(region: dict) -> None:
    """Another process takes `region`'s spinlock and is SIGKILLed holding it."""
    r = subprocess.run([sys.executable, str(HERE / "stuck_worker.py"), "lock", region["name"],
                        str(region["lock_offset"])], capture_output=True, text=True, timeout=60)
    assert r.returncode == -signal.SIGKILL and r.stdout.startswith("locked"), (r.returncode, r.stdout, r.stderr[-2000:])


def connected(a: StuckProc, b: StuckProc) -> tuple[str, int, int, str]:
    """a -> b: (a's peer id for b, a's source region, a's handle of b's region, b's peer id for a)."""
    peer = a.call("connect", address=b.address)["peer"]
    back = b.call("accept")["peer"]
    src = a.call("alloc", size=4 << 20, seed=7)["region"]
    remote = a.call("add_remote", peer=peer, desc=b.call("alloc", size=4 << 20)["desc"])["remote"]
    a.call("write", peer=peer, region=src, remote=remote, imm=1, writes=[[0, 0, 65536]], wait=10.0)
    return peer, src, remote, back


def serves_a_new_peer(a: StuckProc, procs: list) -> None:
    """A new process connects to `a`, writes into it, and `a` writes back."""
    c = StuckProc()
    procs.append(c)
    c_peer, c_src, c_remote, a_peer = connected(c, a)
    c.call("write", peer=c_peer, region=c_src, remote=c_remote, imm=40, writes=PAGES, wait=10.0)
    a.call("expect", tag=40, count=len(PAGES), timeout=5.0)
    a_src = a.call("alloc", size=4 << 20, seed=8)["region"]
    a_remote = a.call("add_remote", peer=a_peer, desc=c.call("alloc", size=4 << 20)["desc"])["remote"]
    a.call("write", peer=a_peer, region=a_src, remote=a_remote, imm=41, writes=PAGES, wait=10.0)
    c.call("expect", tag=41, count=len(PAGES), timeout=5.0)


def test_the_region_lock_is_where_this_libfabric_keeps_it(procs: list) -> None:
    """The tests below find the lock from the region (base_addr, then the next field); for
    libfabric 1.17 that is struct smr_region's layout in include/ofi_shm.h: lock at byte 24,
    free (glibc x86-64 spinlocks count down from 1) while nobody holds it."""
    a = StuckProc()
    procs.append(a)
    region = a.call("shm_region")
    assert region["name"].startswith(f"{a.p.pid}:")
    assert (region["base_addr_offset"], region["lock_offset"]) == (16, 24), region
    assert region["lock_word"] == 1, region


@pytest.mark.parametrize("guard", [True, False], ids=["guarded", "unguarded"])
def test_a_dead_process_holding_our_region_lock(procs: list, guard: bool) -> None:
    """Our own region's lock is held by a dead process while we stream writes to a peer.
    guarded: the progress thread sees the lock word held and never waits inside the provider;
    held 2 s, the endpoint is declared stuck and replaced (and closes cleanly).
    unguarded (option shm_lock_guard=False, i.e. how it was before): the progress thread spins
    inside fi_cq_read holding the endpoint; every other call gives up after the bound with
    EndpointStuck, and the endpoint, which cannot be closed, is abandoned.
    Either way the pending writes fail within seconds with a clear error, and a new peer can
    connect and write both ways."""
    a, b = StuckProc({"options": {"shm_lock_guard": guard}}), StuckProc()
    procs += [a, b]
    peer, src, remote, _ = connected(a, b)
    a.call("writer_start", peer=peer, region=src, remote=remote, imm=2, writes=PAGES)
    assert until(lambda: a.call("writer_done")["done"] > 2), a.call("writer_done")
    hold_lock_and_die(a.call("shm_region"))
    t0 = time.monotonic()
    assert until(lambda: a.call("writer_done")["error"], timeout=8.0), a.call("writer_done")
    error = a.call("writer_done")["error"]
    assert time.monotonic() - t0 < 8.0
    assert error["type"] in ("PeerLostError", "TransferError", "EndpointStuck"), error
    assert "stuck" in error["msg"], error
    assert until(lambda: a.call("stats")["endpoints_replaced"] == 1, timeout=8.0), a.call("stats")
    stats = a.call("stats")
    assert not stats["poisoned"] and stats["endpoints_abandoned"] == (0 if guard else 1), stats
    assert "stuck" in a.tail()  # the log says what happened
    serves_a_new_peer(a, procs)
    assert a.call("stats")["endpoints_replaced"] == 1


def test_a_peer_that_died_holding_its_region_lock_does_not_hang_the_writer(procs: list) -> None:
    """The peer we write to has its region lock held by a dead process (as if it had died inside
    its progress), and we post to it; then it dies itself. Before, our writer spun inside
    fi_writedata on that lock for good, holding our endpoint, so that nothing else (a new peer's
    fi_av_insert) could get in: now it waits outside the provider, notices that the peer's
    process is gone, and fails with PeerLostError; a new peer connects and writes both ways."""
    a, b = StuckProc(), StuckProc()
    procs += [a, b]
    peer, src, remote, _ = connected(a, b)
    hold_lock_and_die(b.call("shm_region"))
    a.call("writer_start", peer=peer, region=src, remote=remote, imm=3, writes=PAGES)
    time.sleep(0.5)
    assert a.call("writer_done") == {"done": 0, "error": None}  # waiting for the lock
    b.kill()
    assert until(lambda: a.call("writer_done")["error"], timeout=5.0), a.call("writer_done")
    assert a.call("writer_done")["error"]["type"] == "PeerLostError", a.call("writer_done")
    assert not a.call("writer_stop", timeout=5.0)["alive"]
    serves_a_new_peer(a, procs)
    assert not a.call("stats")["poisoned"], a.call("stats")


def test_a_writer_already_inside_when_the_peer_dies_holding_its_lock_comes_back_out(procs: list) -> None:
    """The race the look before posting cannot close: our writer is past the look and waiting
    inside fi_writedata for the peer's lock when the peer dies holding it (seen in CI: a receiver
    killed mid-transfer, the sender's thread spinning in the provider for good). Made certain
    here: the writer does not look (option shm_lock_look=False), the lock is held by a dead
    helper, and the peer is killed while the writer waits inside. While the peer lives its lock is
    left alone; once it is dead the watchdog releases it: the writer comes out and fails with
    PeerLostError within the stuck bound, no endpoint is abandoned, and a new peer is served."""
    a, b = StuckProc({"options": {"shm_lock_look": False}}), StuckProc()
    procs += [a, b]
    peer, src, remote, _ = connected(a, b)
    hold_lock_and_die(b.call("shm_region"))
    a.call("writer_start", peer=peer, region=src, remote=remote, imm=6, writes=PAGES)
    time.sleep(0.5)
    assert a.call("writer_done") == {"done": 0, "error": None}  # inside, waiting for the lock
    assert a.call("stats")["dead_locks_released"] == 0  # its owner lives: not ours to release
    b.kill()
    t0 = time.monotonic()
    assert until(lambda: a.call("writer_done")["error"], timeout=5.0), a.call("writer_done")
    assert time.monotonic() - t0 < 1.5
    assert a.call("writer_done")["error"]["type"] == "PeerLostError", a.call("writer_done")
    assert not a.call("writer_stop", timeout=5.0)["alive"]
    stats = a.call("stats")
    assert stats["dead_locks_released"] == 1 and stats["endpoints_abandoned"] == 0, stats
    assert "released the spinlock" in a.tail()
    serves_a_new_peer(a, procs)


def test_our_poller_inside_when_a_peer_dies_holding_our_lock_comes_back_out(procs: list) -> None:
    """The mirror case: the peer we stream writes to holds our region's lock and is killed while
    our poller waits for that lock inside fi_cq_read (made certain: the poller does not look,
    option shm_lock_look=False, and the peer takes our lock itself; its answers to our writes
    bring the poller in). Before, the poller spun there for good: the endpoint was declared stuck
    after 2 s and abandoned, the thread left spinning in it. Now the watchdog releases our lock
    (held from about when a peer died, for 0.8 s): the poller comes back out, the writer fails
    with the lost peer, the endpoint is kept (or, if writes to the dead peer were in flight and
    block it head-of-line, replaced and closed), never abandoned, and a new peer is served."""
    a, b = StuckProc({"options": {"shm_lock_look": False}}), StuckProc()
    procs += [a, b]
    peer, src, remote, _ = connected(a, b)
    region = a.call("shm_region")  # before the poller is held up: it asks the shim for our address
    a.call("writer_start", peer=peer, region=src, remote=remote, imm=7, writes=PAGES)
    assert until(lambda: a.call("writer_done")["done"] > 2), a.call("writer_done")
    assert b.call("take_lock", name=region["name"], offset=region["lock_offset"])["word"] <= 0
    time.sleep(0.3)  # our poller is inside now, waiting for the lock (stats would wait for it too)
    b.kill()
    assert until(lambda: a.call("writer_done")["error"], timeout=5.0), a.call("writer_done")
    assert a.call("writer_done")["error"]["type"] in ("PeerLostError", "TransferError"), a.call("writer_done")
    assert until(lambda: a.call("stats")["dead_locks_released"] == 1, timeout=5.0), a.call("stats")
    assert until(lambda: not a.call("stats")["poisoned"], timeout=5.0), a.call("stats")
    stats = a.call("stats")
    assert stats["endpoints_abandoned"] == 0 and stats["endpoints_replaced"] <= 1, stats
    assert "own region lock" in a.tail()
    serves_a_new_peer(a, procs)


def test_a_post_to_a_peer_whose_process_exited_fails_at_once(procs: list) -> None:
    """The peer is SIGKILLed but a child of it keeps its control connection open, so neither EOF
    nor (for a minute) silence says it is gone: only its pid does. A post must fail at once
    with PeerLostError rather than go into a queue nobody reads."""
    a, b = StuckProc({"peer_timeout_s": 60.0}), StuckProc()
    procs += [a, b]
    peer, src, remote, _ = connected(a, b)
    holder = b.call("fork_holder")["pid"]
    try:
        os.kill(b.p.pid, signal.SIGKILL)
        b.p.wait(5)
        t0 = time.monotonic()
        e = a.error("write", rpc_timeout=15, peer=peer, region=src, remote=remote, imm=4, writes=PAGES, wait=5.0)
        assert e.type == "PeerLostError" and "exited" in e.msg, e
        assert time.monotonic() - t0 < 1.0
        e = a.error("write", peer=peer, region=src, remote=remote, imm=5, writes=PAGES, wait=5.0)
        assert e.type == "PeerLostError", e  # the peer was dropped
    finally:
        os.kill(holder, signal.SIGKILL)


def test_a_call_waits_at_most_the_bound_for_an_endpoint_stuck_in_the_provider() -> None:
    """In one process, unguarded: our region's lock is taken (and kept) here, then a write makes
    the peer answer into our region, so that our poller goes into fi_cq_read's progress and spins
    there, holding the endpoint. register() gives up after SHIM_STUCK_MS with EndpointStuck
    instead of waiting for good; the endpoint, which cannot be closed, is abandoned and replaced;
    a registration on the new one succeeds at once."""
    import base64
    import ctypes
    import mmap

    from stuck_worker import shm_region_layout

    from sglang_disagg.backends import BackendConfig, create_backend
    from sglang_disagg.backends.libfabric.native import STUCK_MS, EndpointStuck

    tx = create_backend("libfabric", BackendConfig(provider="shm", options={"shm_lock_guard": False}))
    rx = create_backend("libfabric", BackendConfig(provider="shm"))
    libc = ctypes.CDLL(None)
    bufs = [ctypes.create_string_buffer(1 << 20) for _ in range(3)]
    src, _ = tx.register(ctypes.addressof(bufs[0]), 1 << 20)
    _, desc = rx.register(ctypes.addressof(bufs[1]), 1 << 20)
    peer = tx.connect(rx.address)
    rx.wait_peer(5.0)
    remote = peer.add_remote_region(desc)
    tx.write(peer, [(src, 0, remote, 0, 65536)], imm=1).wait(5.0)
    raw = base64.b64decode(tx._endpoint_info()["fi_addr"])
    region = shm_region_layout(raw.rstrip(b"\0").decode().split("://", 1)[1])
    fd = os.open(f"/dev/shm/{region['name']}", os.O_RDWR)
    m = mmap.mmap(fd, mmap.PAGESIZE)
    os.close(fd)
    word = ctypes.c_void_p(ctypes.addressof(ctypes.c_char.from_buffer(m)) + region["lock_offset"])
    assert libc.pthread_spin_lock(word) == 0
    try:
        pending = tx.write(peer, [(src, 0, remote, 0, 65536)], imm=2)  # its answer signals our region
        time.sleep(0.3)  # the poller is in there now
        t0 = time.monotonic()
        with pytest.raises(EndpointStuck, match="stuck"):
            tx.register(ctypes.addressof(bufs[2]), 1 << 20)
        assert STUCK_MS / 1000 - 0.5 < time.monotonic() - t0 < STUCK_MS / 1000 + 1.5
        with pytest.raises(PeerLostError, match="stuck"):
            pending.wait(5.0)
        assert until(lambda: tx.stats()["endpoints_replaced"] == 1, timeout=5.0), tx.stats()
        assert tx.stats()["endpoints_abandoned"] == 1 and not tx.stats()["poisoned"], tx.stats()
        t0 = time.monotonic()
        tx.register(ctypes.addressof(bufs[2]), 1 << 20)
        assert time.monotonic() - t0 < 0.5
    finally:
        libc.pthread_spin_unlock(word)  # the abandoned poller comes out, sees it was stopped, ends
        tx.close()
        rx.close()
