"""The shim's Python face: the cffi module and its error buffers.

Every shim call that can fail fills a caller-owned error buffer with libfabric's own text
(fi_strerror and what failed); `check` turns a non-zero status into TransferError with it, or
into EndpointStuck for the shim's SHIM_ESTUCK: the endpoint is of no use any more (a thread has
been stuck inside the provider, holding it, for SHIM_STUCK_MS), and the backend replaces it.
"""

from __future__ import annotations

from typing import Any

from ..errors import BackendUnavailable, TransferError
from ..regions import Memory, MemoryKind, NativeRegistration

try:
    from ._shim import ffi, lib
except ImportError as _e:  # not built: reported by availability() and the constructor
    ffi = lib = None
    _IMPORT_ERROR = str(_e)

# our provider labels -> libfabric's provider names (RxM over the connected ones)
PROVIDERS = {"tcp": "tcp;ofi_rxm", "net": "net", "efa": "efa", "verbs": "verbs;ofi_rxm",
             "sockets": "sockets"}
# enum fi_hmem_iface (rdma/fi_domain.h), as shim_mr_reg takes it
FI_HMEM_SYSTEM, FI_HMEM_CUDA = 0, 1
# shim.h: what a call answers (negated) once the endpoint is stuck, and after how long
ESTUCK, STUCK_MS = (lib.SHIM_ESTUCK, lib.SHIM_STUCK_MS) if lib is not None else (4000, 2000)


def need_shim() -> None:
    if lib is None:
        raise BackendUnavailable(
            "libfabric shim not built (" + _IMPORT_ERROR + "): install Debian libfabric-dev and run "
            "`pip install -e . --no-build-isolation --no-deps` (or `pip install .`)")


class Errbuf:
    def __init__(self) -> None:
        self.buf = ffi.new("char[256]")

    def __str__(self) -> str:
        return ffi.string(self.buf).decode(errors="replace")


class EndpointStuck(TransferError):
    """The libfabric endpoint is stuck inside the provider (shim.h, SHIM_ESTUCK); the backend
    replaces it, and peers reconnect to the new one."""


def stuck_text() -> str:
    """Why, for a shim call that answers SHIM_ESTUCK without an error buffer."""
    return f"endpoint stuck: a thread has been inside the provider for {STUCK_MS / 1000:g} s, holding the endpoint"


def check(ret: int, err: Errbuf, what: str) -> None:
    if ret:
        raise (EndpointStuck if ret == -ESTUCK else TransferError)(f"libfabric {what}: {err}")


def address_of(ep: Any) -> bytes:
    """The endpoint's own address (fi_getname's, kept by the shim since open)."""
    buf, n, err = ffi.new("char[512]"), ffi.new("size_t *", 512), Errbuf()
    check(lib.shim_getname(ep, buf, n, err.buf, 256), err, "fi_getname")
    return ffi.buffer(buf, n[0])[:]


def endpoint_info(ep: Any) -> dict[str, Any]:
    """What the provider granted (shim_info), as a dict: names as str, the rest as int."""
    info = ffi.new("shim_info *")
    lib.shim_get_info(ep, info)
    return {k: (ffi.string(getattr(info, k)).decode() if k in ("prov", "fabric", "domain") else int(getattr(info, k)))
            for k in ("prov", "fabric", "domain", "mr_mode", "mode", "max_msg_size", "tx_size", "key_size",
                      "virt_addr", "prov_key", "mr_local", "rx_cq_data", "hmem")}


def register_on(ep: Any, addr: int, length: int, memory: Memory) -> NativeRegistration:
    """fi_mr_regattr through the shim: FI_HMEM_SYSTEM for host memory, FI_HMEM_CUDA and the
    device ordinal for CUDA memory. TransferError carries libfabric's text."""
    h, key, base, err = ffi.new("uint64_t *"), ffi.new("uint64_t *"), ffi.new("uint64_t *"), Errbuf()
    iface = FI_HMEM_SYSTEM if memory.kind is MemoryKind.HOST else FI_HMEM_CUDA
    check(lib.shim_mr_reg(ep, ffi.cast("void *", addr), length, iface, max(memory.device, 0), h, key, base,
                          err.buf, 256), err, "register")
    return NativeRegistration(int(h[0]), int(base[0]), int(key[0]))
