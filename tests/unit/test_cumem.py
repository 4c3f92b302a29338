"""cumem.py, the GPU path of one messenger per server: the driver structs match the CUDA
12 ABI, and an exported KV buffer imported again (through pidfd_getfd, as the leader
does) is the same memory. Without a GPU driver the first call says so clearly."""

from __future__ import annotations

import ctypes

import pytest
import torch

from sglang_disagg import cumem


def test_driver_structs_have_the_cuda_12_layout():
    assert ctypes.sizeof(cumem.AllocationProp) == 32  # int, int, CUmemLocation, void*, allocFlags
    assert cumem.AllocationProp.win32HandleMetaData.offset == 16
    assert ctypes.sizeof(cumem.AccessDesc) == 12


def _driver_present() -> bool:
    try:
        cumem._driver()
        return torch.cuda.is_available()
    except cumem.CuMemUnavailable:
        return False


def test_an_exported_buffer_imported_again_is_the_same_memory_or_a_clear_error():
    if not _driver_present():
        with pytest.raises(cumem.CuMemUnavailable, match="CUDA driver|cuInit"):
            cumem.exportable_zeros((4, 256), torch.bfloat16, "cuda:0")
        return
    t = cumem.exportable_zeros((4, 256), torch.bfloat16, "cuda:0")
    assert t.is_cuda and int(t.abs().sum()) == 0
    t.fill_(3)
    imported = cumem.Imported(cumem.export(t))
    try:
        view = torch.as_tensor(cumem._CudaArray(imported.ptr, (t.numel() * 2,), "|u1"), device=t.device)
        view = view.view(torch.bfloat16).view(t.shape)
        assert torch.equal(view, t)
        view[1].fill_(5)
        torch.cuda.synchronize()
        assert int(t[1, 0]) == 5 and int(t[0, 0]) == 3
    finally:
        imported.close()


def test_a_tensor_not_allocated_here_cannot_be_exported():
    with pytest.raises(cumem.CuMemError, match="not allocated by cumem"):
        cumem.export(torch.zeros(4))
