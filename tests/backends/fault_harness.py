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
        self.options = options
        super().__init__(backend, provider, size)

    def _proc(self) -> FaultProc:
        return FaultProc(self.backend, self.provider, self.options)
