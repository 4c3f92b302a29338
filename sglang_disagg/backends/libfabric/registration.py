"""How the libfabric backend registers memory (a mixin of it): on every rail's endpoint, host
memory as FI_HMEM_SYSTEM, CUDA memory as FI_HMEM_CUDA on an endpoint opened with FI_HMEM (the
first device registration reopens the endpoints with it), and deregisters on every rail.

Contract with the backend: `_eps`, `_ep_lock`, `_hmem`, `_regions`, `peers()`, `_stop`,
`_open_endpoints`, `_release`, `_join_pollers`, `_read_info`, `_start_poller`, `_stuck_on`,
`_shim_closed`, `provider`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

from ..errors import BackendUnavailable, TransferError, UnsupportedMemory
from ..regions import Memory, MemoryKind, NativeRegistration
from .native import PROVIDERS, EndpointStuck, lib, register_on
from .native import Errbuf as _Errbuf
from .native import check as _check


class Registration:
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
