"""Registry, entry points, availability reporting and the pure-Python pieces."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from sglang_disagg import backends
from sglang_disagg.backends import (BackendUnavailable, DeadlineExceeded, DescriptorError, PeerLostError,
                                    TransferError, UnknownBackendError,
                                    get_backend, list_backends, register_backend)
from sglang_disagg.backends.expect import ExpectTracker
from sglang_disagg.backends.mooncake import split
from sglang_disagg.backends.regions import PageWrite


def test_builtins_listed_lazily() -> None:
    names = list_backends()
    assert {"libfabric", "nixl", "mooncake"} <= set(names)
    assert all(":" in target for target in names.values())


def test_unknown_backend_lists_known_ones() -> None:
    with pytest.raises(UnknownBackendError) as e:
        get_backend("carrier-pigeon")
    assert "carrier-pigeon" in str(e.value) and "libfabric" in str(e.value) and "nixl" in str(e.value)


def test_register_backend_validates_and_refuses_silent_override() -> None:
    with pytest.raises(ValueError):
        register_backend("broken", "no_colon_here")
    register_backend("alias-libfabric", "sglang_disagg.backends.libfabric.backend:LibfabricBackend")
    assert get_backend("alias-libfabric").name == "libfabric"
    with pytest.raises(ValueError):
        register_backend("alias-libfabric", "elsewhere:Other")


@pytest.mark.parametrize("name,module,hint", [("nixl", "nixl", "pip install nixl"),
                                              ("mooncake", "mooncake", "pip install mooncake-transfer-engine")])
def test_missing_library_names_what_to_install(monkeypatch, name: str, module: str, hint: str) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` raise ImportError
    monkeypatch.setitem(sys.modules, f"{module}._api", None)
    monkeypatch.setitem(sys.modules, f"{module}.engine", None)
    ok, why = backends.available(name)
    assert not ok and hint in why
    with pytest.raises(BackendUnavailable, match=hint):
        backends.create_backend(name)


def test_entry_point_plugin_and_cli_listing(tmp_path: Path) -> None:
    (tmp_path / "fake_transfer_plugin.py").write_text(textwrap.dedent("""
        from sglang_disagg.backends.base import TransferBackend
        class FakeBackend(TransferBackend):
            name = "fake"
            @classmethod
            def availability(cls):
                return False, "fake: needs a carrier pigeon"
    """))
    dist = tmp_path / "fake_transfer_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-transfer-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[sglang_disagg.backends]\nfake = fake_transfer_plugin:FakeBackend\n")
    env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin", "GLOG_minloglevel": "3"}
    out = subprocess.run([sys.executable, "-m", "sglang_disagg.backends"], capture_output=True, text=True,
                         timeout=120, env=env, check=True).stdout
    lines = {line.split()[0]: line for line in out.splitlines()}
    assert {"fake", "libfabric", "nixl", "mooncake"} <= set(lines), out
    assert "unavailable" in lines["fake"] and "carrier pigeon" in lines["fake"]
    assert "usable" in lines["libfabric"] or "unavailable" in lines["libfabric"]
    if backends.available("libfabric")[0]:  # the listing says why libfabric's shm is not offered
        assert "not offered: shm (a thread spinning in fi_cq_read/fi_writedata" in lines["libfabric"], out
        assert "use the shmem backend on one host" in lines["libfabric"], out


def test_libfabric_provider_shm_is_refused_saying_why() -> None:
    """libfabric's shm provider is not offered: the backend refuses it, before opening an endpoint,
    with the reason and what to use instead; the reason is also what availability() reports."""
    from sglang_disagg.backends import BackendConfig, create_backend
    from sglang_disagg.backends.libfabric import SHM_REFUSED, SHM_WHY

    with pytest.raises(TransferError) as e:
        create_backend("libfabric", BackendConfig(provider="shm"))
    assert str(e.value) == SHM_REFUSED
    assert str(e.value).startswith("libfabric provider 'shm' is not offered: a thread spinning in "
                                   "fi_cq_read/fi_writedata on a dead peer's spinlock inside libfabric 1.17's shm "
                                   "region cannot be bounded from outside using libfabric's public API")
    assert "use the shmem backend on one host, libfabric provider tcp across hosts" in str(e.value)
    ok, why = backends.available("libfabric")
    if ok:
        assert f"not offered: shm ({SHM_WHY})" in why and "providers: tcp" in why, why


def test_tracker_fires_once_and_credits_early_arrivals() -> None:
    t = ExpectTracker()
    try:
        t.add(5, 3)
        fut = t.expect(5, 3, 1.0)
        assert fut.done() and fut.wait(0) == 3
        fut = t.expect(6, 2, 1.0)
        t.add(6)
        assert not fut.done()
        t.add(6, 5)
        assert fut.wait(1.0) == 2 and t.arrived(6) == 4   # surplus kept for the next request
        fut = t.expect(7, 1, 0.05)
        with pytest.raises(DeadlineExceeded, match="0 of 1"):
            fut.wait(2.0)
        fut = t.expect(8, 1, 10.0, peer="p1")
        other = t.expect(9, 1, 10.0, peer="p2")
        t0 = time.monotonic()
        t.peer_lost("p1", "test")
        with pytest.raises(PeerLostError):
            fut.wait(1.0)
        assert time.monotonic() - t0 < 0.5 and not other.done()
    finally:
        t.close()


def test_late_writes_of_a_failed_tag_never_count_again() -> None:
    """The tag-reuse hole: writes that land after their request failed (deadline, peer
    loss, cancel) are discarded, and the tag cannot be expected again."""
    t = ExpectTracker()
    try:
        fut = t.expect(11, 4, 0.05, peer="p1")
        t.add(11, 2)
        with pytest.raises(DeadlineExceeded, match="2 of 4"):
            fut.wait(2.0)
        t.add(11, 2)                      # the late half of the failed request
        assert t.arrived(11) == 0 and t.late_writes_dropped == 2 and t.is_retired(11)
        assert t.landed(11) == 4 and t.landed(99) == -1  # before and after it was retired: all counted
        with pytest.raises(DescriptorError, match="retired"):
            t.expect(11, 2, 1.0)
        fut = t.expect(12, 1, 10.0, peer={"p2", "p3"})
        t.peer_lost("p3", "test")         # any of the writing peers
        with pytest.raises(PeerLostError):
            fut.wait(1.0)
        fut = t.expect(13, 1, 10.0)
        t.retire(13, "client aborted")
        with pytest.raises(TransferError, match="client aborted"):
            fut.wait(1.0)
        t.add(13)
        assert t.arrived(13) == 0 and t.pending() == 0
    finally:
        t.close()


def test_mooncake_split_respects_limits() -> None:
    ws = [PageWrite(None, 0, None, 0, 1 << 20) for _ in range(1500)]
    parts = split(ws, max_entries=512, max_bytes=32 << 20)
    assert sum(map(len, parts)) == 1500
    assert all(len(p) <= 32 for p in parts)
    small = [PageWrite(None, 0, None, 0, 4096) for _ in range(1500)]
    assert [len(p) for p in split(small)] == [512, 512, 476]


@pytest.mark.skipif(not backends.available("libfabric")[0], reason="libfabric shim not built")
def test_handshake_refuses_mismatched_peers_and_dead_addresses() -> None:
    from sglang_disagg.backends import BackendConfig, TransferError, create_backend
    other = create_backend("shmem", BackendConfig())
    tcp = create_backend("libfabric", BackendConfig(provider="tcp"))
    try:
        with pytest.raises(TransferError, match="refused.*libfabric/tcp"):
            tcp.connect(other.address, timeout_s=5)
        port = other.address.rsplit(":", 1)[1]
        other.close()
        t0 = time.monotonic()
        with pytest.raises(PeerLostError, match="cannot reach"):
            tcp.connect(f"127.0.0.1:{port}", timeout_s=5)
        assert time.monotonic() - t0 < 2
        with pytest.raises(TransferError, match="host:port"):
            tcp.connect("nonsense", timeout_s=1)
    finally:
        other.close()
        tcp.close()
    assert tcp.stats()["peers"] == 0
