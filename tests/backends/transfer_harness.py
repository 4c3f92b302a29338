"""Test harness for the backend conformance suite: backends in real subprocesses.

Every call to a worker has its own deadline; a worker that does not answer in time is
killed and the test fails, so nothing here can hang. (A uniquely named module rather than
conftest.py, so `from transfer_harness import ...` never picks another directory's conftest.)
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import time
import sys
import tempfile
from pathlib import Path

import pytest

from sglang_disagg.backends import available

HERE = Path(__file__).parent
CASES = [("libfabric", "tcp"), ("nixl", None), ("mooncake", None), ("shmem", None)]
IDS = [f"{b}-{p}" if p else b for b, p in CASES]
ENV = {**os.environ, "UCX_NET_DEVICES": "lo", "GLOG_minloglevel": "2", "NIXL_LOG_LEVEL": "WARN",
       "PYTHONUNBUFFERED": "1"}


def _readable(f, timeout: float) -> bool:
    """Whether `f` has something to read within `timeout` s. poll, not select: select() fails
    outright on a descriptor numbered 1,024 or more, which a long test process reaches."""
    p = select.poll()
    p.register(f, select.POLLIN)
    return bool(p.poll(timeout * 1000))


class WorkerError(AssertionError):
    def __init__(self, reply: dict) -> None:
        super().__init__(f"{reply['type']}: {reply['msg']}")
        self.type, self.msg, self.reply = reply["type"], reply["msg"], reply


class Proc:
    """Client side of tests/backends/transfer_worker.py."""

    def __init__(self, backend: str, provider: str | None, worker: str = "transfer_worker.py", **init) -> None:
        self.log = tempfile.NamedTemporaryFile(prefix=Path(worker).stem.replace("_", "-") + "-", suffix=".log",
                                               delete=False)
        self.p = subprocess.Popen([sys.executable, str(HERE / worker)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=self.log, env=ENV, text=True, bufsize=1)
        self.address = self.call("init", rpc_timeout=30, backend=backend, provider=provider, **init)["address"]

    def call(self, op: str, rpc_timeout: float = 15.0, **kw) -> dict:
        if self.p.poll() is not None:
            raise AssertionError(f"worker exited (rc={self.p.returncode}); log: {self.tail()}")
        self.p.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.p.stdin.flush()
        ready = _readable(self.p.stdout, rpc_timeout)
        if not ready:
            self.kill()
            raise AssertionError(f"worker did not answer {op} within {rpc_timeout} s; log: {self.tail()}")
        line = self.p.stdout.readline()
        if not line:
            raise AssertionError(f"worker died during {op} (rc={self.p.wait(5)}); log: {self.tail()}")
        reply = json.loads(line)
        if not reply.pop("ok"):
            raise WorkerError(reply)
        return reply

    def error(self, op: str, rpc_timeout: float = 15.0, **kw) -> WorkerError:
        """Call `op`, which must fail; return the error."""
        try:
            self.call(op, rpc_timeout, **kw)
        except WorkerError as e:
            return e
        raise AssertionError(f"{op} succeeded but should have failed")

    def tail(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-3000:]

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait(10)

    def stop(self) -> None:
        if self.p.poll() is None:
            try:
                self.p.stdin.write('{"op": "exit"}\n')
                self.p.stdin.flush()
                self.p.wait(5)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()
        os.unlink(self.log.name)


class Pair:
    """A writer and a reader connected to each other, each with one region."""

    def __init__(self, backend: str, provider: str | None, size: int = 16 << 20) -> None:
        self.backend, self.provider, self.size = backend, provider, size
        self.tx = self._proc()
        self.rx = self._proc()
        self.tx_peer = self.tx.call("connect", address=self.rx.address)["peer"]
        self.rx_peer = self.rx.call("accept")["peer"]
        self.seed = 1234
        self.src = self.tx.call("alloc", size=size, seed=self.seed)["region"]
        got = self.rx.call("alloc", size=size)
        self.dst_desc = got["desc"]
        self.dst = got["region"]
        self.remote = self.tx.call("add_remote", peer=self.tx_peer, desc=self.dst_desc)["remote"]

    def _proc(self) -> Proc:
        return Proc(self.backend, self.provider)

    def write(self, writes: list, imm: int, wait: float | None = 20.0) -> dict:
        return self.tx.call("write", rpc_timeout=(wait or 5) + 5, peer=self.tx_peer, region=self.src,
                            remote=self.remote, writes=writes, imm=imm, wait=wait)

    def stop(self) -> None:
        for p in (self.tx, self.rx):
            p.stop()


def until(fn, timeout: float = 5.0, step: float = 0.05):
    """fn() until truthy or timeout; returns its last value."""
    end = time.monotonic() + timeout
    while True:
        v = fn()
        if v or time.monotonic() > end:
            return v
        time.sleep(step)


def case_params() -> list:
    """Every backend; one that is unavailable is skipped on a developer's machine (with the
    reason) but runs, and fails, in CI (CI=true): a suite that ran nothing must not pass."""
    out = []
    in_ci = os.environ.get("CI", "").lower() in ("1", "true", "yes")
    for (backend, provider), ident in zip(CASES, IDS):
        ok, why = available(backend)
        marks = [] if ok or in_ci else [pytest.mark.skip(reason=f"{backend} unavailable here: {why}")]
        out.append(pytest.param((backend, provider), id=ident, marks=marks))
    return out
