"""libfabric backend in one process: hostile peer addresses, close under load, callbacks that raise,
an endpoint found stuck."""

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
    """A peer's HELLO endpoint with address `raw`: the rest is the backend's own, so only the
    address is hostile."""
    endpoint = dict(be._endpoint_info()) if be is not None else {}
    endpoint["fi_addr"] = base64.b64encode(raw).decode()
    return types.SimpleNamespace(endpoint=endpoint, address="hostile:1", native=None)


def test_hostile_peer_address_refused() -> None:
    be = create_backend("libfabric", BackendConfig(provider="tcp"))
    try:
        own = base64.b64decode(be._endpoint_info()["fi_addr"])
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
    tx, rx, peer, src, remote, bufs = _pair("tcp")
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


def test_a_post_to_an_address_outside_the_endpoints_av_fails_at_once() -> None:
    """A writer that read a peer's address just before the endpoint was replaced posts it to
    the new endpoint, whose AV never held it: a provider may answer -FI_EAGAIN for an address it
    cannot use, which would stall the writer for the 10 s post back-off. The shim refuses."""
    from sglang_disagg.backends.libfabric.backend import ffi, lib

    be = create_backend("libfabric", BackendConfig(provider="tcp"))
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


def test_an_endpoint_found_stuck_is_replaced_and_serves_again(monkeypatch) -> None:
    """The shim answers SHIM_ESTUCK (a thread has been inside the provider, holding the endpoint,
    for SHIM_STUCK_MS; made to happen here by a stand-in for shim_post, since no provider offered
    here strands a thread inside): the write fails with EndpointStuck, the backend replaces its
    endpoint by itself (the old one closes: nothing is stuck in it really), the peer reconnects,
    and writes on the new endpoint land."""
    from sglang_disagg.backends.libfabric import backend as lf
    from sglang_disagg.backends.libfabric.native import ESTUCK, EndpointStuck

    real = lf.lib

    class StuckOnce:
        """The real shim, but the next shim_post answers -SHIM_ESTUCK as a stuck endpoint's does."""
        armed = True

        def __getattr__(self, name):
            return getattr(real, name)

        def shim_post(self, ep, *args):
            if self.armed:
                self.armed = False
                err = args[-2]
                lf.ffi.memmove(err, b"endpoint stuck: a thread has been inside the provider for 2 s\0", 63)
                return -ESTUCK
            return real.shim_post(ep, *args)

    tx, rx, peer, src, remote, bufs = _pair("tcp")
    try:
        tx.write(peer, [(src, 0, remote, 0, 4096)], imm=1).wait(5.0)
        rx.expect(1, 1, 5.0).wait(5.0)
        old_ep = tx._ep
        monkeypatch.setattr(lf, "lib", StuckOnce())
        with pytest.raises(EndpointStuck, match="stuck"):
            tx.write(peer, [(src, 0, remote, 0, 4096)], imm=2)
        deadline = time.monotonic() + 10.0
        while tx.stats()["endpoints_replaced"] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        stats = tx.stats()
        assert stats["endpoints_replaced"] == 1 and stats["endpoints_abandoned"] == 0, stats
        assert not stats["poisoned"] and tx._ep is not old_ep, stats
        # the peer was closed with the old endpoint; connecting again learns the new address
        peer2 = tx.connect(rx.address)
        rx.wait_peer(5.0)
        landing = ctypes.create_string_buffer(1 << 20)
        _, desc = rx.register(ctypes.addressof(landing), 1 << 20)
        remote2 = peer2.add_remote_region(desc)
        tx.write(peer2, [(src, 0, remote2, 0, 4096)], imm=3).wait(5.0)  # src: registered again, same id
        rx.expect(3, 1, 5.0).wait(5.0)
    finally:
        tx.close()
        rx.close()
