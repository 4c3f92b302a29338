"""Buffers a same-host peer can map, and the backend that writes them, per device."""

from __future__ import annotations

from typing import Any

BACKENDS = {"cpu": "shmem", "cuda": "cudaipc"}


def kind(device: str) -> str:
    return device.partition(":")[0]


def zeros(device: str, nbytes: int) -> Any:
    """A uint8 tensor of `nbytes` in memory the device's same-host backend can register."""
    import torch

    if kind(device) == "cpu":
        from ..ipc.shm import shared_zeros

        return shared_zeros((nbytes,), torch.uint8, name="sglang-disagg-devcheck")
    from ..ipc.cumem import exportable_zeros

    return exportable_zeros((nbytes,), torch.uint8, torch.device(device))


def synchronize(device: str) -> None:
    if kind(device) == "cuda":
        import torch

        torch.cuda.synchronize(torch.device(device))


def backend(device: str, secret: bytes) -> Any:
    from ..backends import BackendConfig, create_backend

    return create_backend(BACKENDS[kind(device)], BackendConfig(secret=secret))
