"""How the libfabric backend registers memory (a mixin of it): host memory as FI_HMEM_SYSTEM,
CUDA memory as FI_HMEM_CUDA on an endpoint opened with FI_HMEM (the first device registration
reopens the endpoints with it).

Each rail registers only the regions it carries (each libfabric domain registers separately, and
EFA bounds how many registrations a device holds): a CUDA region on a host with several rails is
carried by the rails nearest its GPU (rails/plan.nearest_rails over the host's PCIe tree, as the
rail plan gives its rank), host memory by every rail; `register_on_rails(..., rails=[...])` says
it explicitly. The handle is a tuple over the rails (None where a rail does not carry the region);
the descriptor lists the carriers in `extra["carriers"]` when they are not every rail (rails.py),
so a peer writes into it only through rails that hold its key. Writes from a region leave only
through its carriers.

Contract with the backend: `_eps`, `_nets`, `_near`, `_asked`, `_ep_lock`, `_hmem`, `_regions`,
`peers()`, `_stop`, `_open_endpoints`, `_release`, `_join_pollers`, `_read_info`,
`_start_poller`, `_stuck_on`, `_shim_closed`, `provider`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from typing import Any

from ..errors import BackendUnavailable, DescriptorError, TransferError, UnsupportedMemory
from ..regions import HOST, Memory, MemoryKind, MemoryRegion, NativeRegistration
from .native import PROVIDERS, EndpointStuck, lib, register_on
from .native import Errbuf as _Errbuf
from .native import check as _check

log = logging.getLogger("sglang_disagg.backends.libfabric.backend")


class Registration:
    def register_on_rails(self, addr: int, length: int, memory: Memory = HOST, *,
                          rails: Sequence[int]) -> tuple[MemoryRegion, bytes]:
        """register() with the rails that carry the region named (default: CUDA memory the rails
        nearest its GPU, host memory every rail): only they register it, its writes leave
        through them."""
        self._asked.rails = self._check_rails(rails)
        try:
            return self.register(addr, length, memory)
        finally:
            self._asked.rails = None

    def _check_rails(self, rails: Sequence[int]) -> tuple[int, ...]:
        out = tuple(sorted(set(rails)))
        if not out or any(not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < len(self._eps) for r in out):
            raise DescriptorError(f"rails {tuple(rails)!r}: need indices of this backend's {len(self._eps)} rails")
        return out

    def carriers(self, region: MemoryRegion) -> tuple[int, ...]:
        """The rails that registered `region` (its writes leave through them only)."""
        entry = self._regions.get(region.id)
        if entry is None:
            raise DescriptorError(f"region {region.id} is not registered here")
        return carried_by(entry[1])

    def _device_rails(self, memory: Memory) -> tuple[int, ...] | None:
        """CUDA memory with several rails: the rails nearest its GPU by the PCIe tree (sysfs);
        None (every rail carries it) for host memory, one rail, or a topology that cannot be read."""
        if memory.kind is not MemoryKind.CUDA or len(self._eps) < 2:
            return None
        if memory.device not in self._near:  # a rank registers a region per layer and kind: read sysfs once
            self._near[memory.device] = self._nearest_of(memory)
        return self._near[memory.device]

    def _nearest_of(self, memory: Memory) -> tuple[int, ...] | None:
        try:
            import torch

            from ...rails.choose import interface_names
            from ...rails.plan import nearest_rails
            from ...rails.topology import read_topology

            p = torch.cuda.get_device_properties(memory.device)
            address = f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
            near = nearest_rails(address, interface_names([str(n) for n in self._nets]), read_topology())
        except Exception as e:  # noqa: BLE001 - a preference, not a requirement: say why it is off
            log.warning("libfabric: no nearest rails for %s (%s): every rail carries it", memory, e)
            return None
        log.info("libfabric: %s is carried by rails %s (nearest its GPU at %s; registered there only)", memory,
                 list(near), address)
        return near

    def _native_register(self, addr: int, length: int, memory: Memory) -> NativeRegistration:
        carriers = getattr(self._asked, "rails", None) or self._device_rails(memory) or tuple(range(len(self._eps)))
        with self._ep_lock:
            if memory.kind is MemoryKind.HOST:
                return self._register_all(self._eps, addr, length, memory, carriers)
            if not self._hmem:
                return self._reopen_with_hmem(addr, length, memory, carriers)
            try:
                return self._register_all(self._eps, addr, length, memory, carriers)
            except EndpointStuck:
                raise
            except TransferError as e:
                raise self._refusal(memory, e) from e

    def _register_all(self, eps: Sequence[Any], addr: int, length: int, memory: Memory,
                      carriers: Sequence[int]) -> NativeRegistration:
        """Register on each carrying rail (each domain registers separately): a handle per rail
        (None where it does not carry), rail 0's key in the descriptor's `key` (the first
        carrier's when rail 0 is not one), the others' in extra["rails"] ([0, 0] where a rail
        does not carry), extra["carriers"] when not every rail does (rails.py)."""
        regs: list[NativeRegistration | None] = [None] * len(eps)
        try:
            for i in carriers:
                with self._stuck_on(eps[i]):
                    regs[i] = register_on(eps[i], addr, length, memory)
        except BaseException:
            for ep, reg in zip(eps, regs):
                if reg is not None:
                    with contextlib.suppress(TransferError):
                        _check(lib.shim_mr_close(ep, reg.handle, (err := _Errbuf()).buf, 256), err, "fi_close(mr)")
            raise
        first = regs[0] or regs[carriers[0]]
        extra: dict[str, Any] = {}
        if len(regs) > 1:
            extra["rails"] = [[r.base, r.key] if r else [0, 0] for r in regs[1:]]
        if len(carriers) < len(regs):
            extra["carriers"] = list(carriers)
        return NativeRegistration(tuple(r.handle if r else None for r in regs), first.base, first.key, extra)

    def _refusal(self, memory: Memory, error: Exception) -> UnsupportedMemory:
        why = str(error).removeprefix("libfabric register: ")
        hint = ("the provider does not offer FI_HMEM" if isinstance(error, BackendUnavailable) else
                "fi_info listing FI_HMEM is not enough: this libfabric must be built with CUDA")
        return UnsupportedMemory(f"libfabric provider {PROVIDERS[self.provider]} cannot register {memory}: "
                                 f"{why} ({hint}); use host memory, or nixl (VRAM) for device memory")

    def _reopen_with_hmem(self, addr: int, length: int, memory: Memory,
                          carriers: Sequence[int]) -> NativeRegistration:
        """The first device registration (the KV pool, at start-up): open an FI_HMEM endpoint
        and register there; only if that succeeds does it replace the host-only endpoint."""
        if self._regions or self.peers():
            raise UnsupportedMemory(
                f"libfabric {self.provider}: register {memory} before any other region or peer (the endpoint is "
                "reopened with FI_HMEM then), or open the backend with options {'hmem': True}")
        try:
            eps = self._open_endpoints(hmem=True)
        except BackendUnavailable as e:
            raise self._refusal(memory, e) from e
        try:
            reg = self._register_all(eps, addr, length, memory, carriers)
        except TransferError as e:
            for ep in eps:
                self._release(ep)
            raise self._refusal(memory, e) from e
        old_eps = self._eps
        self._stop.set()
        self._join_pollers(2.0)
        for ep in old_eps:
            self._release(ep)
        self._eps, self._hmem = eps, True
        self._read_info()
        self._start_poller()
        return reg

    def _native_deregister(self, reg: NativeRegistration) -> None:
        err = _Errbuf()
        with self._ep_lock:
            if self._shim_closed:  # registrations went with the endpoint
                return
            for ep, handle in zip(self._eps, reg.handle):
                if handle is None:  # this rail does not carry it
                    continue
                with contextlib.suppress(EndpointStuck), self._stuck_on(ep):  # goes with it
                    _check(lib.shim_mr_close(ep, handle, err.buf, 256), err, "fi_close(mr)")


def carried_by(reg: NativeRegistration) -> tuple[int, ...]:
    """The rails a registration was made on."""
    return tuple(i for i, h in enumerate(reg.handle) if h is not None)
