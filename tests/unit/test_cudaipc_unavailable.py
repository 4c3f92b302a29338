"""The cudaipc backend on a machine without a CUDA driver: it is listed and importable, says
it is unavailable and why, and refuses construction with BackendUnavailable naming what is
missing and its host-memory twin. (With a driver it must report itself available; the
backend itself is tested in tests/gpu/test_cudaipc.py.)"""

from __future__ import annotations

import pytest

from sglang_disagg import backends
from sglang_disagg.ipc import cuda_driver as cu
from sglang_disagg.backends import BackendUnavailable


def _gpu_here() -> bool:
    try:
        return cu.device_count() > 0
    except (cu.CudaUnavailable, cu.CudaError):
        return False


def test_listed_and_importable_everywhere():
    assert backends.list_backends()["cudaipc"] == "sglang_disagg.backends.cudaipc:CudaIpcBackend"
    assert backends.get_backend("cudaipc").name == "cudaipc"


def test_without_a_gpu_it_is_unavailable_with_the_reason():
    ok, why = backends.available("cudaipc")
    if _gpu_here():
        assert ok, why
        return
    assert not ok and "CUDA GPU and its driver" in why and "shmem" in why
    with pytest.raises(BackendUnavailable, match=r"cudaipc needs a CUDA GPU and its driver .*shmem.*: "
                                                 r"(no CUDA driver library|cuInit failed|the CUDA driver sees no)"):
        backends.create_backend("cudaipc")
