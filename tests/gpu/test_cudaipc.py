"""The cudaipc backend held to the conformance suite, with CUDA memory, two real processes.

The tests are tests/backends/test_conformance.py's own functions, imported unchanged; only
the processes differ: their worker (cudaipc_worker.py) allocates cuMem memory on cuda:0
and registers it as cuda(0). The suite's helpers make their extra processes through the
names Proc and FaultProc of test_conformance, which point at the CUDA worker here. Then
a few cudaipc-specific checks: what it refuses, and that its descriptor socket answers
connected peers only. GPU only (tests/gpu/conftest.py); run with
``SGLANG_DISAGG_GPU_TESTS=1 python -m pytest tests/gpu``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backends"))

import test_conformance as conformance  # noqa: E402
from fault_harness import FaultPair, FaultProc  # noqa: E402
from test_conformance import (test_close_from_a_callback, test_close_releases_everything,  # noqa: E402,F401
                              test_close_while_callbacks_run, test_control_messages, test_deadline_expires,
                              test_deregister_while_writes_in_flight, test_malformed_descriptor_rejected,
                              test_out_of_bounds_rejected_before_posting, test_receiver_killed_mid_transfer,
                              test_scattered_pages_byte_exact, test_sender_killed_mid_transfer,
                              test_tag_reuse_after_failed_request, test_tags_interleaved,
                              test_uniform_fast_path_byte_exact, test_uniform_fast_path_rejects_bad_offsets)
from transfer_harness import Proc  # noqa: E402

WORKER = str(Path(__file__).resolve().parent / "cudaipc_worker.py")
CASE = ("cudaipc", None)


class CudaProc(FaultProc):
    """A worker process with CUDA buffers; takes Proc's and FaultProc's arguments."""

    def __init__(self, backend: str, provider: str | None, options: dict | None = None) -> None:
        Proc.__init__(self, backend, provider, worker=WORKER, options=options or {})


class CudaPair(FaultPair):
    def _proc(self) -> CudaProc:
        return CudaProc(self.backend, self.provider, self.options)


@pytest.fixture(autouse=True)
def _cuda_workers(monkeypatch):
    monkeypatch.setattr(conformance, "Proc", CudaProc)
    monkeypatch.setattr(conformance, "FaultProc", CudaProc)


@pytest.fixture
def procs():
    started: list = []
    yield started
    for p in started:
        p.stop()


@pytest.fixture(scope="module")
def pair():
    p = CudaPair(*CASE)
    yield p
    p.stop()


@pytest.fixture
def fresh(procs):
    p = CudaPair(*CASE)
    procs.extend([p.tx, p.rx])
    return p


@pytest.fixture
def faulty(procs):
    p = CudaPair(*CASE, options={"batch_timeout_s": 3.0})
    procs.extend([p.tx, p.rx])
    return p


def test_stalled_peer_isolated_and_batch_deadline(procs):
    conformance.test_stalled_peer_isolated_and_batch_deadline(CASE, procs)


def test_a_stopped_peer_is_lost_by_its_silence(procs):
    conformance.test_a_stopped_peer_is_lost_by_its_silence(CASE, procs)


def test_its_threads_end_at_close(pair):
    p = CudaProc(*CASE)
    try:
        p.call("connect", address=pair.rx.address)
        pair.rx.call("accept")
        p.call("alloc", size=1 << 20)
        threads = p.call("close")["threads"]
        assert not [t for t in threads if t.startswith("cudaipc")], threads
    finally:
        p.stop()


# ----- in this process: refusals, and the descriptor socket's gate ----------------------
def test_it_refuses_host_memory_naming_shmem_and_foreign_cuda_memory():
    import torch

    from sglang_disagg.backends import create_backend
    from sglang_disagg.backends.errors import DescriptorError, UnsupportedMemory
    from sglang_disagg.backends.regions import cuda

    be = create_backend("cudaipc")
    try:
        host = torch.zeros(4096, dtype=torch.uint8)
        with pytest.raises(UnsupportedMemory, match="shmem"):
            be.register(host.data_ptr(), 4096)
        plain = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda:0")  # torch's allocator, not cumem
        with pytest.raises(DescriptorError, match="not allocated by cumem.exportable_zeros"):
            be.register(plain.data_ptr(), 1 << 20, cuda(0))
    finally:
        be.close()


def test_the_descriptor_socket_answers_connected_peers_only():
    import torch

    from sglang_disagg.ipc import cumem, fdpass
    from sglang_disagg.backends import create_backend
    from sglang_disagg.backends.regions import cuda

    owner = create_backend("cudaipc")
    try:
        t = cumem.exportable_zeros((1 << 20,), torch.uint8, "cuda:0")
        region, desc = owner.register(t.data_ptr(), 1 << 20, cuda(0))
        alloc = cumem.export(t).key
        name = owner._endpoint_info()["fds"]
        with fdpass.connect(name, 5.0) as conn:  # this process is no peer of `owner`
            conn.send("cudaipc-request", {"instance": "x", "alloc": alloc})
            msg = conn.recv(5.0)
        assert msg.kind == "cudaipc-refuse" and "not a peer connected" in msg.body["reason"] and not msg.fds
        importer = create_backend("cudaipc")
        try:
            peer = importer.connect(owner.address, 5.0)
            owner.wait_peer(5.0)
            remote = peer.add_remote_region(desc)  # imports: now this pid is a connected peer
            assert remote.length == 1 << 20
        finally:
            importer.close()
    finally:
        owner.close()
