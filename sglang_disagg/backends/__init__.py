"""Transfer-backend registry.

Backends are registered by name as "module:Class" strings and imported only when asked
for, so listing them never drags in NIXL, Mooncake or the native shim. Other packages add
backends through the entry-point group `sglang_disagg.backends` (name = "module:Class").
"""

from __future__ import annotations

import importlib
import threading
from importlib.metadata import entry_points
from typing import TYPE_CHECKING

from .errors import (BackendUnavailable, DeadlineExceeded, DescriptorError, PeerLostError, TransferError,
                     UnknownBackendError)
from .config import BackendConfig
from .regions import MemoryRegion, PageWrite, PeerState, RegionDescriptor, RemoteRegion

if TYPE_CHECKING:
    from .base import TransferBackend

ENTRY_POINT_GROUP = "sglang_disagg.backends"

__all__ = ["ENTRY_POINT_GROUP", "BackendConfig", "BackendUnavailable", "DeadlineExceeded", "DescriptorError",
           "MemoryRegion", "PageWrite", "PeerLostError", "PeerState", "RegionDescriptor", "RemoteRegion",
           "TransferError", "UnknownBackendError", "available", "create_backend", "get_backend", "list_backends",
           "register_backend"]

_BUILTIN = {
    "libfabric": "sglang_disagg.backends.libfabric.backend:LibfabricBackend",
    "nixl": "sglang_disagg.backends.nixl:NixlBackend",
    "mooncake": "sglang_disagg.backends.mooncake:MooncakeBackend",
    "shmem": "sglang_disagg.backends.shmem:ShmemBackend",
    "cudaipc": "sglang_disagg.backends.cudaipc:CudaIpcBackend",
}
_registry: dict[str, str] = dict(_BUILTIN)
_lock = threading.Lock()
_entry_points_loaded = False


def register_backend(name: str, target: str, *, replace: bool = False) -> None:
    """Register `target` ("package.module:Class") under `name`; imported on first use."""
    module, sep, attr = target.partition(":")
    if not name or not module or not sep or not attr:
        raise ValueError(f"backend target must look like 'package.module:Class', got {target!r}")
    with _lock:
        if name in _registry and _registry[name] != target and not replace:
            raise ValueError(f"backend {name!r} is already registered as {_registry[name]!r}")
        _registry[name] = target


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        with _lock:
            _registry.setdefault(ep.name, ep.value)


def list_backends() -> dict[str, str]:
    """Name -> "module:Class" of every registered backend (built-in and entry points)."""
    _load_entry_points()
    with _lock:
        return dict(sorted(_registry.items()))


def get_backend(name: str) -> type[TransferBackend]:
    """The backend class; UnknownBackendError lists known names, BackendUnavailable says what to install."""
    known = list_backends()
    if name not in known:
        raise UnknownBackendError(f"unknown transfer backend {name!r}; known: {', '.join(known)}")
    module, _, attr = known[name].partition(":")
    try:
        mod = importlib.import_module(module)
    except BackendUnavailable:
        raise
    except ImportError as e:
        raise BackendUnavailable(f"backend {name!r} cannot be imported ({module}): {e}") from e
    try:
        return getattr(mod, attr)
    except AttributeError:
        raise UnknownBackendError(f"backend {name!r}: {module} has no attribute {attr!r}") from None


def create_backend(name: str, config: BackendConfig | None = None) -> TransferBackend:
    return get_backend(name)(config or BackendConfig())


def available(name: str) -> tuple[bool, str]:
    """(usable on this machine, reason if not), without raising."""
    try:
        cls = get_backend(name)
    except TransferError as e:
        return False, str(e)
    try:
        return cls.availability()
    except Exception as e:  # noqa: BLE001 - a probe must never crash the listing
        return False, f"availability check failed: {e}"
