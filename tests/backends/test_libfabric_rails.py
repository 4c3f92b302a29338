"""libfabric rails in one process, on loopback addresses (127.0.0.0/8 holds as many as we like,
all one network): one endpoint per rail, each rail registers the regions it carries, writes spread by
bytes over the rails and exact, completion counted over every rail's queue, different rail
counts on the two sides, and a peer's rail list read as untrusted. Across real interfaces
(one subnet per rail, the kernel's counters) see tests/hosts/test_rails_e2e.py."""

from __future__ import annotations

import base64
import ctypes
import os
import types

import pytest

from sglang_disagg.backends import BackendConfig, DescriptorError, TransferError, available, create_backend
from sglang_disagg.backends.libfabric import rails
from sglang_disagg.backends.regions import RegionDescriptor

pytestmark = [pytest.mark.backend,
              pytest.mark.skipif(not available("libfabric")[0], reason="libfabric shim not built")]

PAGE, PAGES = 4096, 256


def _backend(addrs: tuple[str, ...]):
    return create_backend("libfabric", BackendConfig(provider="tcp", rails=tuple(f"{a}/8" for a in addrs)))


def _exchange(tx_rails: tuple[str, ...], rx_rails: tuple[str, ...], batches: int = 16) -> tuple[dict, dict, bool]:
    tx, rx = _backend(tx_rails), _backend(rx_rails)
    try:
        data = os.urandom(PAGE * PAGES)
        src_buf, dst_buf = ctypes.create_string_buffer(data, len(data)), ctypes.create_string_buffer(len(data))
        src, _ = tx.register(ctypes.addressof(src_buf), len(data))
        _, desc = rx.register(ctypes.addressof(dst_buf), len(data))
        peer = tx.connect(rx.address)
        remote = peer.add_remote_region(desc)
        per = PAGES // batches
        for b in range(batches):
            tag = 1000 + b
            landed = rx.expect(tag, per, 10.0)
            pages = list(range(b * per, (b + 1) * per))
            tx.write_pages(peer, src, pages, PAGE, remote, pages, PAGE, PAGE, tag).wait(10.0)
            assert landed.wait(10.0) == per  # counted over whichever rail's queue they arrived on
        return tx.stats(), rx.stats(), dst_buf.raw == data
    finally:
        tx.close()
        rx.close()


def test_two_rails_each_carry_half_and_the_bytes_are_exact() -> None:
    tx, rx, exact = _exchange(("127.0.0.1", "127.0.0.2"), ("127.0.0.3", "127.0.0.4"))
    assert exact
    assert tx["rails"] == rx["rails"] == 2
    total = PAGE * PAGES
    assert tx["rail0_bytes"] + tx["rail1_bytes"] == total
    assert tx["rail0_bytes"] == tx["rail1_bytes"] == total // 2, tx  # equal batches alternate
    assert tx["native_batches"] == 0 and rx["late_writes_dropped"] == 0


def test_different_rail_counts_link_and_stay_exact() -> None:
    # 3 rails to 1: every local rail reaches the peer's one network, all write to its one rail
    tx, _, exact = _exchange(("127.0.0.1", "127.0.0.2", "127.0.0.5"), ("127.0.0.3",))
    assert exact and tx["rails"] == 3
    assert all(tx[f"rail{i}_bytes"] > 0 for i in range(3)), tx
    # 1 rail to 2 (the peer's second rail is unused by us)
    tx, rx, exact = _exchange(("127.0.0.1",), ("127.0.0.3", "127.0.0.4"))
    assert exact and tx["rails"] == 1 and rx["rails"] == 2


def test_rails_pair_by_network_and_unpaired_rails_are_left_out() -> None:
    nets = rails.parse(["10.77.0.1/24", "10.77.1.1/24", "10.77.2.1/24"])
    theirs = [rails.PeerRail(b"", n) for n in rails.parse(["10.77.1.2/24", "10.77.0.2/24"])]
    # by network, not by index: our rail 0 (10.77.0) writes to their rail 1 (10.77.0); rail 2 reaches nothing
    assert rails.pairing(nets, theirs) == [[1], [0], []]
    with pytest.raises(TransferError, match="no local rail shares a network"):
        rails.pairing(rails.parse(["10.9.0.1/24"]), theirs)
    assert rails.pairing([], theirs) == [[0]]  # we have no rails: our one endpoint to their primary address
    assert rails.pairing(nets, []) == [[0], [], []]  # they have none: rail 0 only, to their one endpoint
    # one network for all: every peer rail is reachable, the same index first (equal counts pair 1:1)
    one = [rails.PeerRail(b"", n) for n in rails.parse(["10.5.0.2/16", "10.5.0.3/16", "10.5.0.4/16"])]
    assert rails.pairing(rails.parse(["10.5.1.1/16", "10.5.1.2/16"]), one) == [[0, 1, 2], [1, 0, 2]]


def test_a_peers_rail_list_is_untrusted() -> None:
    be = _backend(("127.0.0.1", "127.0.0.2"))
    try:
        info = be._endpoint_info()
        assert [r["net"] for r in info["rails"]] == ["127.0.0.1/8", "127.0.0.2/8"]
        good = info["rails"][0]
        bad = [[], [good] * (rails.MAX_RAILS + 1), "x", [{"fi_addr": good["fi_addr"]}],
               [{"fi_addr": good["fi_addr"], "net": "not-an-address"}],
               [{"fi_addr": "!!", "net": "127.0.0.9/8"}], [dict(good, extra=1)]]
        for value in bad:
            peer = types.SimpleNamespace(endpoint=dict(info, rails=value), address="hostile:1", native=None)
            with pytest.raises(TransferError, match="rails|rail \\d"):
                be._native_connect(peer)
            assert peer.native is None
        # a well-formed list whose address is not one of this provider's: the shim refuses it
        forged = dict(good, fi_addr=base64.b64encode(b"\xff" * 8).decode())
        peer = types.SimpleNamespace(endpoint=dict(info, rails=[forged, good]), address="hostile:1", native=None)
        with pytest.raises(TransferError, match="peer address"):
            be._native_connect(peer)
        for extra in ({"rails": "x"}, {"rails": [[1]]}, {"rails": [[1, -1]]}, {"rails": [[0, 0]] * rails.MAX_RAILS},
                      {"rails": [[0, 6]], "carriers": [2]}, {"carriers": []}, {"rails": [[0, 6]], "carriers": [1, 1]},
                      {"carriers": [True]}, {"carriers": "0"}):
            d = RegionDescriptor(1, "libfabric", "tcp", "o", 1, 10, 0, 5, extra)
            with pytest.raises(DescriptorError, match="rail"):
                rails.check_descriptor(d)
        with pytest.raises(DescriptorError, match="no key for its rail 2"):
            rails.remote_key(RegionDescriptor(1, "libfabric", "tcp", "o", 1, 10, 0, 5, {"rails": [[0, 6]]}), 2)
        with pytest.raises(DescriptorError, match="not registered on its rail 0 \\(carried by \\[1\\]\\)"):
            rails.remote_key(RegionDescriptor(1, "libfabric", "tcp", "o", 1, 10, 0, 5,
                                              {"rails": [[0, 6]], "carriers": [1]}), 0)
    finally:
        be.close()


def test_a_rail_on_an_address_this_host_lacks_is_refused_at_open() -> None:
    with pytest.raises(Exception, match="rail 198.51.100.77"):
        _backend(("127.0.0.1", "198.51.100.77"))  # TEST-NET-2: documentation only, not this host's
    with pytest.raises(ValueError, match="named twice"):
        BackendConfig(rails=("127.0.0.1/8", "127.0.0.1/8"))
    with pytest.raises(ValueError, match="not an IPv4"):
        BackendConfig(rails=("eth0",))


def test_each_rail_registers_only_the_regions_it_carries() -> None:
    """What a CUDA region gets on a GPU host (carried by the rails nearest its GPU,
    registration.py), asked for by hand here on host memory: only those rails register it, its
    writes leave through them and land through the peer rails that registered the destination;
    other regions still spread over every rail."""
    tx, rx = _backend(("127.0.0.1", "127.0.0.2")), _backend(("127.0.0.3", "127.0.0.4"))
    try:
        size = PAGE * 32
        bufs = [ctypes.create_string_buffer(os.urandom(size), size) for _ in range(2)]
        dst_buf, only0_buf = ctypes.create_string_buffer(2 * size), ctypes.create_string_buffer(size)
        near, ndesc = tx.register_on_rails(ctypes.addressof(bufs[0]), size, rails=[1])
        spread, _ = tx.register(ctypes.addressof(bufs[1]), size)
        with pytest.raises(DescriptorError, match="indices of this backend's 2 rails"):
            tx.register_on_rails(ctypes.addressof(bufs[1]), size, rails=[2])
        assert tx.carriers(near) == (1,) and tx.carriers(spread) == (0, 1)
        assert tx._regions[near.id][1].handle[0] is None  # rail 0 never registered it
        d = RegionDescriptor.from_bytes(ndesc)
        assert d.extra["carriers"] == [1] and d.extra["rails"][0][1] == d.key  # the key is its carrier's
        _, desc = rx.register(ctypes.addressof(dst_buf), 2 * size)
        _, only0 = rx.register_on_rails(ctypes.addressof(only0_buf), size, rails=[0])
        peer = tx.connect(rx.address)
        remote, remote0 = peer.add_remote_region(desc), peer.add_remote_region(only0)
        pages = list(range(32))
        # A write's completion at the sender does not say its bytes are in the receiver's memory
        # (tcp: transmit completion): the receiver's count does (CI once read page 60 still zero)
        landed7, landed8 = rx.expect(7, 32, 10.0), rx.expect(8, 32, 10.0)
        for i in range(8):
            tx.write_pages(peer, near, pages[i * 4:(i + 1) * 4], PAGE, remote, pages[i * 4:(i + 1) * 4], PAGE,
                           PAGE, 7).wait(10.0)
        s = tx.stats()
        assert (s["rail0_bytes"], s["rail1_bytes"]) == (0, size), s
        for i in range(8):
            tx.write_pages(peer, spread, pages[i * 4:(i + 1) * 4], PAGE, remote, [32 + p for p in pages[i * 4:(i + 1) * 4]],
                           PAGE, PAGE, 8).wait(10.0)
        s = tx.stats()
        assert s["rail0_bytes"] == size and s["rail1_bytes"] == size, s  # the other region balanced the rails
        assert landed7.wait(10.0) == 32 and landed8.wait(10.0) == 32
        assert dst_buf.raw == bufs[0].raw + bufs[1].raw
        # our rail 1 to their rail 0 (not its paired rail 1, which does not hold the destination)
        landed = rx.expect(9, 32, 10.0)
        tx.write_pages(peer, near, pages, PAGE, remote0, pages, PAGE, PAGE, 9).wait(10.0)
        assert landed.wait(10.0) == 32 and only0_buf.raw == bufs[0].raw
        assert tx.stats()["rail1_bytes"] == 2 * size
    finally:
        tx.close()
        rx.close()
