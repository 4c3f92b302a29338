"""Client side of fault_worker.py: a Proc that can pass backend options, and a Pair of them."""

from __future__ import annotations

import os
import signal

from transfer_harness import Pair, Proc


class FaultProc(Proc):
    def __init__(self, backend: str, provider: str | None, options: dict | None = None) -> None:
        super().__init__(backend, provider, worker="fault_worker.py", options=options or {})

    def pause(self) -> None:
        os.kill(self.p.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.p.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.p.poll() is None:
            self.resume()  # a stopped process cannot read its exit request
        super().stop()


class FaultPair(Pair):
    """Pair of FaultProcs; `options` go to both backends."""

    def __init__(self, backend: str, provider: str | None, size: int = 16 << 20, options: dict | None = None) -> None:
        self.backend, self.provider, self.size = backend, provider, size
        self.tx = FaultProc(backend, provider, options)
        self.rx = FaultProc(backend, provider, options)
        self.tx_peer = self.tx.call("connect", address=self.rx.address)["peer"]
        self.rx_peer = self.rx.call("accept")["peer"]
        self.seed = 1234
        self.src = self.tx.call("alloc", size=size, seed=self.seed)["region"]
        got = self.rx.call("alloc", size=size)
        self.dst_desc = got["desc"]
        self.dst = got["region"]
        self.remote = self.tx.call("add_remote", peer=self.tx_peer, desc=self.dst_desc)["remote"]
