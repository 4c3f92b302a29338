"""reach.py: a peer is on this host only if the memory its probe names can be mapped here and
holds the bytes it wrote (the cross-host cases run in tests/hosts, in separate namespaces)."""

from __future__ import annotations

import pytest

from sglang_disagg.backends.errors import TransferError
from sglang_disagg.backends.reach import NOT_HERE, Probe, check


@pytest.fixture
def probe():
    p = Probe()
    yield p
    p.close()


def test_a_probe_of_this_process_is_reachable(probe):
    check("shmem", "127.0.0.1:1", probe.info)


def test_other_bytes_behind_the_path_are_not_this_peer(probe):
    with pytest.raises(TransferError, match=f"{NOT_HERE}: .* holds other bytes"):
        check("shmem", "10.0.0.2:1", probe.info | {"nonce": "00" * 16})


def test_a_path_this_host_does_not_have_is_not_this_host(probe):
    other = probe.info | {"path": "/proc/999999999/fd/3"}
    with pytest.raises(TransferError, match=f"peer 10.0.0.2:1 {NOT_HERE}: its memory cannot be reached"):
        check("shmem", "10.0.0.2:1", other)


@pytest.mark.parametrize("bad", [None, {}, {"path": "/etc/passwd"}, {"path": 1, "dev": 1, "inode": 1}])
def test_a_malformed_probe_is_refused(bad):
    with pytest.raises(TransferError, match="no valid memory probe"):
        check("shmem", "10.0.0.2:1", bad)


def test_a_probe_cannot_point_at_an_ordinary_file(probe):
    with pytest.raises(TransferError, match=NOT_HERE):
        check("shmem", "10.0.0.2:1", probe.info | {"path": "/etc/passwd"})
