"""transfer_worker.Worker plus the operations the fault tests need: backend options,
deregistration, callbacks that block or close the backend, a stoppable writer.

Run as a process by fault_harness.FaultProc, like transfer_worker.py.
"""

from __future__ import annotations

import threading
import time
import traceback

from transfer_worker import Worker  # puts benchmarks/ (jsonl_worker) on sys.path
from jsonl_worker import serve

from sglang_disagg.backends import BackendConfig, TransferError, create_backend


class FaultWorker(Worker):
    def __init__(self) -> None:
        super().__init__()
        self.cb = {"started": 0, "finished": 0, "errors": []}
        self.cb_lock = threading.Lock()
        self.writer: dict | None = None

    def init(self, backend: str, provider: str | None = None, options: dict | None = None) -> dict:
        self.be = create_backend(backend, BackendConfig(provider=provider, **(options or {})))
        return {"address": self.be.address}

    def ping(self) -> dict:
        return {"pid_alive": True}

    def dealloc(self, region: int) -> dict:
        """Deregister, keeping the memory mapped: writes still in flight land in valid memory."""
        self.be.deregister(self.regions[region])
        return {}

    # ----- callbacks ---------------------------------------------------------------
    def _callback(self, block_s: float, close: bool):
        def cb(_fut) -> None:
            with self.cb_lock:
                self.cb["started"] += 1
            try:
                if close:
                    self.be.close()
                time.sleep(block_s)
            except Exception as e:  # noqa: BLE001 - reported through cb_state
                with self.cb_lock:
                    self.cb["errors"].append(f"{type(e).__name__}: {e}")
            with self.cb_lock:
                self.cb["finished"] += 1
        return cb

    def write_cb(self, peer: str, region: int, remote: int, writes: list, imm: int, block_s: float = 0.0,
                 close: bool = False) -> dict:
        """Post a batch whose done-callback blocks `block_s` (or closes the backend) on the
        thread that completes it."""
        fut = self.be.write(self.peers[peer], self._writes(region, remote, writes), imm)
        fut.add_done_callback(self._callback(block_s, close))
        fid = self._id()
        self.futs[fid] = fut
        return {"future": fid}

    def expect_cb(self, tag: int, count: int, timeout: float, block_s: float = 0.0, close: bool = False) -> dict:
        fut = self.be.expect(tag, count, timeout)
        fut.add_done_callback(self._callback(block_s, close))
        fid = self._id()
        self.futs[fid] = fut
        return {"future": fid}

    def cb_state(self) -> dict:
        with self.cb_lock:
            return {**self.cb, "errors": list(self.cb["errors"])}

    def threads(self) -> dict:
        return {"threads": sorted(t.name for t in threading.enumerate() if t is not threading.main_thread())}

    # ----- a writer that can be stopped -------------------------------------------------
    def writer_start(self, peer: str, region: int, remote: int, writes: list, imm: int) -> dict:
        """Write the batch back to back; record completions and the first error."""
        batch = self._writes(region, remote, writes)
        p = self.peers[peer]
        state = self.writer = {"done": 0, "error": None, "stop": False}

        def run() -> None:
            while not state["stop"]:
                try:
                    self.be.write(p, batch, imm).wait(30)
                    state["done"] += 1
                except TransferError as e:
                    state["error"] = {"type": type(e).__name__, "msg": str(e)}
                    return
        state["thread"] = threading.Thread(target=run, daemon=True)
        state["thread"].start()
        return {}

    def writer_stop(self, timeout: float = 30.0) -> dict:
        state = self.writer
        state["stop"] = True
        state["thread"].join(timeout)
        return {"done": state["done"], "error": state["error"], "alive": state["thread"].is_alive()}

    def writer_done(self) -> dict:
        return {"done": self.writer["done"], "error": self.writer["error"]}


def main() -> None:
    serve(FaultWorker(), lambda e: {"type": type(e).__name__, "msg": str(e), "tb": traceback.format_exc()})


if __name__ == "__main__":
    main()
