"""libfabric backend in one process: hostile peer addresses, close under load, callbacks that raise."""

from __future__ import annotations

import base64
import ctypes
import socket
import struct
import threading
import time
import types

import pytest

from sglang_disagg.backends import BackendConfig, TransferError, available, create_backend

pytestmark = [pytest.mark.backend,
              pytest.mark.skipif(not available("libfabric")[0], reason="libfabric shim not built")]


def _fake_peer(raw: bytes, be=None) -> types.SimpleNamespace:
    """A peer's HELLO endpoint with address `raw`; shm's same-host probe is the backend's own
    (a real process of this host), so only the address is hostile."""
    endpoint = dict(be._endpoint_info()) if be is not None else {}
    endpoint["fi_addr"] = base64.b64encode(raw).decode()
    return types.SimpleNamespace(endpoint=endpoint, address="hostile:1", native=None)


@pytest.mark.parametrize("provider", ["shm", "tcp"])
def test_hostile_peer_address_refused(provider: str) -> None:
    be = create_backend("libfabric", BackendConfig(provider=provider))
    try:
        own = base64.b64decode(be._endpoint_info()["fi_addr"])
        if provider == "shm":
            bad = [own[:-1], own + b"x" * 300, own[:-1] + b"x", b"fi_xyz://1:0:0\0", b"\0" * len(own)]
        else:
            v6 = struct.pack("=H", socket.AF_INET6) + bytes(26)
            bad = [own[:8], own + bytes(8), b"\xff\xff" + own[2:], v6[:16], b""]
        for raw in bad:
            with pytest.raises(TransferError, match="peer address|no valid"):
                be._native_connect(_fake_peer(raw, be))
        peer = _fake_peer(own, be)  # a well-formed address still goes in
        be._native_connect(peer)
        assert peer.native is not None
    finally:
        be.close()


def _pair(provider: str):
    tx = create_backend("libfabric", BackendConfig(provider=provider))
    rx = create_backend("libfabric", BackendConfig(provider=provider))
    bufs = [ctypes.create_string_buffer(8 << 20) for _ in range(2)]
    src, _ = tx.register(ctypes.addressof(bufs[0]), 8 << 20)
    _, desc = rx.register(ctypes.addressof(bufs[1]), 8 << 20)
    peer = tx.connect(rx.address)
    rx.wait_peer(5.0)
    remote = peer.add_remote_region(desc)
    return tx, rx, peer, src, remote, bufs


# tcp only. With both shm endpoints in ONE process, closing the writer's endpoint with writes in
# flight faults inside libfabric's shm progress (seen 4 of 4 runs), and closing the receiver now
# does exactly that: the writer replaces its head-of-line-blocked endpoint (backend.py,
# _replace_endpoint). Across processes, as deployed, it does not happen: the conformance
# suite's test_receiver_killed_mid_transfer[libfabric-shm] kills the receiver mid-transfer and
# the writer replaces its endpoint and serves a new peer.
@pytest.mark.parametrize("provider,closing", [("tcp", "writer"), ("tcp", "receiver")])
def test_close_while_writers_post(provider: str, closing: str) -> None:
    """Writers in several threads keep posting 1 MiB batches while one side closes: every
    write ends in completion or TransferError, no thread hangs, the process survives."""
    tx, rx, peer, src, remote, bufs = _pair(provider)
    writes = [(src, i << 20, remote, i << 20, 1 << 20) for i in range(8)]
    results: list[str] = []
    stop = threading.Event()

    def writer() -> None:
        while not stop.is_set():
            try:
                tx.write(peer, writes, imm=1).wait(10.0)
            except TransferError as e:
                results.append(type(e).__name__)
                return
        results.append("stopped")

    threads = [threading.Thread(target=writer) for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    (tx if closing == "writer" else rx).close()
    time.sleep(0.3)
    stop.set()
    for t in threads:
        t.join(15.0)
    assert not [t for t in threads if t.is_alive()]
    assert len(results) == 3 and set(results) <= {"TransferError", "PeerLostError", "DeadlineExceeded", "stopped"}, results
    tx.close()
    rx.close()
    with pytest.raises(TransferError, match="closed"):
        tx.write(peer, writes, imm=2)
    assert tx.stats()["native_batches"] == 0


def test_raising_callback_keeps_the_poller_alive() -> None:
    tx, rx, peer, src, remote, bufs = _pair("shm")
    try:
        rx.expect(3, 1, 5.0).add_done_callback(lambda f: 1 / 0)  # pending: runs on rx's poller
        fut = tx.write(peer, [(src, 0, remote, 0, 4096)], imm=3)
        try:  # runs on tx's poller, or here if the batch already completed (then it raises here)
            fut.add_done_callback(lambda f: 1 / 0)
        except ZeroDivisionError:
            pass
        fut.wait(5.0)
        time.sleep(0.1)
        tx.write(peer, [(src, 0, remote, 0, 4096)], imm=4).wait(5.0)  # still completed
        rx.expect(4, 1, 5.0).wait(5.0)
        assert tx._poller.is_alive() and rx._poller.is_alive()
    finally:
        tx.close()
        rx.close()


def test_a_killed_process_region_with_our_pid_does_not_block_the_shm_endpoint(tmp_path) -> None:
    """A SIGKILLed process leaves /dev/shm/<pid>:<domain>:<ep>; a later process given that pid
    could not open its shm endpoint (fi_enable: Device or resource busy)."""
    import subprocess
    import sys

    script = (
        "import os\n"
        "for ep in range(4):\n"
        "    with open(f'/dev/shm/{os.getpid()}:0:{ep}', 'wb') as f: f.write(os.urandom(1 << 16))\n"
        "from sglang_disagg.backends import BackendConfig, create_backend\n"
        "be = create_backend('libfabric', BackendConfig(provider='shm'))\n"
        "print('opened', be.fi_info['prov'])\n"
        "be.close()\n"
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "opened shm" in r.stdout, r.stderr[-2000:]


def test_closing_a_peer_whose_expired_writes_are_in_flight_keeps_its_region_mapped(procs: list) -> None:
    """A batch to a stopped receiver passes its deadline (its writes stay the provider's), then
    the writer closes that peer. shm handles each write's response by locking the receiver's
    region, so removing the address then would unmap it and the writer's progress would fault
    on the late response (SIGSEGV in pthread_spin_trylock, seen in CI with the decoder alive
    and its control connection dropped). The writer must keep the address, replace its
    head-of-line-blocked endpoint, survive the late response and write to a new peer."""
    from fault_harness import FaultProc
    from transfer_harness import Proc, until

    opts = {"batch_timeout_s": 1.0, "peer_timeout_s": 60.0}
    tx, rx = FaultProc("libfabric", "shm", opts), FaultProc("libfabric", "shm", opts)
    procs += [tx, rx]
    peer = tx.call("connect", address=rx.address)["peer"]
    rx.call("accept")
    remote = tx.call("add_remote", peer=peer, desc=rx.call("alloc", size=4 << 20)["desc"])["remote"]
    src = tx.call("alloc", size=4 << 20, seed=3)["region"]
    tx.call("write", peer=peer, region=src, remote=remote, imm=1, writes=[[0, 0, 4096]], wait=10.0)
    rx.pause()
    try:
        late = tx.call("write", peer=peer, region=src, remote=remote, imm=2, wait=None,
                       writes=[[i << 20, i << 20, 1 << 20] for i in range(4)])["future"]
        assert tx.call("failed_at", rpc_timeout=15, future=late, timeout=8.0)["type"] == "DeadlineExceeded"
        tx.call("close_peer", peer=peer)
    finally:
        rx.resume()  # rx now reads the writes and answers into tx's response queue
    time.sleep(0.5)
    assert tx.p.poll() is None, "the writer died handling a late response"
    assert until(lambda: not tx.call("stats")["poisoned"]), tx.call("stats")
    assert tx.call("stats")["endpoints_replaced"] == 1
    other = Proc("libfabric", "shm")
    procs.append(other)
    p2 = tx.call("connect", address=other.address)["peer"]
    other.call("accept")
    r2 = tx.call("add_remote", peer=p2, desc=other.call("alloc", size=1 << 20)["desc"])["remote"]
    tx.call("write", peer=p2, region=src, remote=r2, imm=3, writes=[[0, 0, 65536]], wait=10.0)
    other.call("expect", tag=3, count=1, timeout=5.0)


@pytest.mark.parametrize("provider", ["shm", "tcp"])
def test_a_post_to_an_address_outside_the_endpoints_av_fails_at_once(provider: str) -> None:
    """A writer that read a peer's address just before the endpoint was replaced posts it to
    the new endpoint, whose AV never held it: shm answers -FI_EAGAIN for a peer it cannot map,
    which stalled the writer for the 10 s post back-off (seen once in CI). The shim refuses."""
    from sglang_disagg.backends.libfabric.backend import ffi, lib

    be = create_backend("libfabric", BackendConfig(provider=provider))
    try:
        buf = ctypes.create_string_buffer(4096)
        src, _ = be.register(ctypes.addressof(buf), 4096)
        arrays = [ffi.new("uint64_t[]", [x]) for x in (be._handle(src), 0, 0, 0, 4096)]
        err = ffi.new("char[256]")
        t0 = time.monotonic()
        ret = lib.shim_post(be._ep, 1, 7, 1, *arrays, 5, err, 256)
        assert ret < 0 and "address vector" in ffi.string(err).decode(), (ret, ffi.string(err))
        assert time.monotonic() - t0 < 1.0
        assert be.stats()["native_batches"] == 0
    finally:
        be.close()

