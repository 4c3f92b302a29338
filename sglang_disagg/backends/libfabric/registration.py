"""How the libfabric backend registers memory (a mixin of it): on every rail's endpoint, host
memory as FI_HMEM_SYSTEM, CUDA memory as FI_HMEM_CUDA on an endpoint opened with FI_HMEM (the
first device registration reopens the endpoints with it), and deregisters on every rail. With
several rails, a CUDA region's writes prefer the rails nearest its GPU (`_prefer`, by region id;
rails/plan.nearest_rails over the host's PCIe tree), as the rail plan gives its rank.

Contract with the backend: `_eps`, `_nets`, `_prefer`, `_near`, `_ep_lock`, `_hmem`, `_regions`,
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
    def register(self, addr: int, length: int, memory: Memory = HOST) -> tuple[MemoryRegion, bytes]:
        region, desc = super().register(addr, length, memory)
        near = self._device_rails(memory)
        if near is not None:
            self.prefer_rails(region, near)
        return region, desc

    def deregister(self, region: MemoryRegion) -> None:
        super().deregister(region)
        self._prefer.pop(region.id, None)

    def prefer_rails(self, region: MemoryRegion, rails: Sequence[int]) -> None:
        """Writes from `region` leave through these rails while one of them is up for the peer
        (else through any): on a GPU host the rails nearest the region's GPU, set at register."""
        rails = tuple(rails)
        if region.id not in self._regions:
            raise DescriptorError(f"region {region.id} is not registered here")
        if not rails or any(not isinstance(r, int) or not 0 <= r < len(self._eps) for r in rails):
            raise DescriptorError(f"rails {rails!r}: need indices of this backend's {len(self._eps)} rails")
        self._prefer[region.id] = frozenset(rails)

    def _device_rails(self, memory: Memory) -> tuple[int, ...] | None:
        """CUDA memory with several rails: the rails nearest its GPU by the PCIe tree (sysfs);
        None (every rail alike) for host memory, one rail, or a topology that cannot be read."""
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
            log.warning("libfabric: no nearest-rail preference for %s (%s): every rail carries its writes", memory, e)
            return None
        log.info("libfabric: %s writes through rails %s (nearest its GPU at %s)", memory, list(near), address)
        return near

    def _native_register(self, addr: int, length: int, memory: Memory) -> NativeRegistration:
        with self._ep_lock:
            if memory.kind is MemoryKind.HOST:
                return self._register_all(self._eps, addr, length, memory)
            if not self._hmem:
                return self._reopen_with_hmem(addr, length, memory)
            try:
                return self._register_all(self._eps, addr, length, memory)
            except EndpointStuck:
                raise
            except TransferError as e:
                raise self._refusal(memory, e) from e

    def _register_all(self, eps: Sequence[Any], addr: int, length: int, memory: Memory) -> NativeRegistration:
        """Register on every rail (each domain registers separately): handles per rail, rail 0's
        key in the descriptor's `key`, the others' in extra["rails"] (rails.py)."""
        regs: list[tuple[Any, NativeRegistration]] = []
        try:
            for ep in eps:
                with self._stuck_on(ep):
                    regs.append((ep, register_on(ep, addr, length, memory)))
        except BaseException:
            for ep, reg in regs:
                with contextlib.suppress(TransferError):
                    _check(lib.shim_mr_close(ep, reg.handle, (err := _Errbuf()).buf, 256), err, "fi_close(mr)")
            raise
        first = regs[0][1]
        extra = {"rails": [[r.base, r.key] for _, r in regs[1:]]} if len(regs) > 1 else {}
        return NativeRegistration(tuple(r.handle for _, r in regs), first.base, first.key, extra)

    def _refusal(self, memory: Memory, error: Exception) -> UnsupportedMemory:
        why = str(error).removeprefix("libfabric register: ")
        hint = ("the provider does not offer FI_HMEM" if isinstance(error, BackendUnavailable) else
                "fi_info listing FI_HMEM is not enough: this libfabric must be built with CUDA")
        return UnsupportedMemory(f"libfabric provider {PROVIDERS[self.provider]} cannot register {memory}: "
                                 f"{why} ({hint}); use host memory, or nixl (VRAM) for device memory")

    def _reopen_with_hmem(self, addr: int, length: int, memory: Memory) -> NativeRegistration:
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
            reg = self._register_all(eps, addr, length, memory)
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
                with contextlib.suppress(EndpointStuck), self._stuck_on(ep):  # goes with it
                    _check(lib.shim_mr_close(ep, handle, err.buf, 256), err, "fi_close(mr)")
