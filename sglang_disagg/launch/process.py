"""One child process of a stack: started in its own process group, logged to a
file, health-checked over HTTP, and stopped together with all its children
(SGLang servers fork scheduler and detokenizer processes)."""

from __future__ import annotations

import contextlib
import ctypes
import http.client
import os
import signal
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from sglang_disagg.env import IGNORE_SIGTERM_ENV
from sglang_disagg.launch.client import tls_context
from sglang_disagg.launch.commands import ProcessSpec


# What SIGTERM buys before SIGKILL, when nothing is left to drain (Stack.stop drains first when
# asked): a server group's schedulers die at once (no handler), after which SGLang's front
# process sleeps 5 s "before crash diagnostics", and an idle smg waits 5 s before exiting;
# neither has anything to save. Measured on a default stack: 14.7 s to stop with a 10 s grace,
# router, decode and prefill one after the other.
STOP_GRACE_S = 1.0


class StartupError(RuntimeError):
    """A process died or did not become healthy in time; the message carries its log tail."""


def log_tail(path: Path, lines: int = 25, width: int = 400) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    # SGLang prints all server args on one enormous line: clip long lines.
    keep = [ln if len(ln) <= width else ln[:width] + " ..." for ln in text[-lines:]]
    return "\n".join("    " + ln for ln in keep)


def stop_on_sigterm() -> None:
    """Make SIGTERM unwind this process instead of killing it outright.

    Our servers run in sessions of their own (so that a stop reaches their schedulers), so a
    script that starts a stack and dies of SIGTERM (a CI timeout, `kill`, a benchmark stopped
    midway) without running its `finally`/`with` blocks leaves them serving, holding their
    ports, cores and memory. Where nothing else handles SIGTERM (SIG_DFL) and this is the main
    thread, it raises SystemExit(143), so every stack stops on the way out. The launcher
    installs its own handler (drain first), which this leaves alone."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _exit_on_sigterm)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


_libc_signal = ctypes.CDLL(None).signal  # resolved here: a forked child must not dlopen


def in_slurm_step() -> bool:
    """Whether this launcher is a task of a Slurm job step (srun sets SLURM_STEP_ID for each)."""
    return "SLURM_STEP_ID" in os.environ


def _preexec(cpus: tuple[int, ...] | None, shield: bool):
    """What a server's child runs before exec: its cores and, in a Slurm step, SIGTERM ignored.

    A signal to a Slurm step (`scancel --signal=TERM JOB.STEP`, `scancel JOB`) reaches every
    process of the step, not only the launcher (slurmstepd signals all it tracks): SGLang's
    schedulers died at once (exit code 1), so a decoder told to drain had nothing left to
    migrate from (seen on the first real Slurm run). Ignored in the child, SIGTERM stays
    ignored through exec and in the children it forks or spawns, unless a process installs a
    handler of its own: SGLang's front process does (its graceful stop, which the launcher
    uses too), and something in a scheduler's start does too (seen: SIGTERM caught, not
    ignored, after it), so schedulers are also told IGNORE_SIGTERM_ENV and ignore it again at
    the end of their start (hooks.scheduler_ready). The launcher alone then decides when its
    servers stop; a stop still ends with SIGKILL to the group (`reap`), and Slurm's own SIGKILL
    after KillWait reaches them all."""
    if not cpus and not shield:
        return None

    def run() -> None:
        if cpus:
            os.sched_setaffinity(0, cpus)
        if shield:  # libc's signal(): the fork's thread may not be Python's main thread
            _libc_signal(signal.SIGTERM, ctypes.c_void_p(1))  # SIG_IGN

    return run


# SGLang's shared-memory files (its load snapshots, its pid-stamped segments): a server group
# stopped with SIGKILL (reap) never unlinks them, and every start makes new ones (16 KiB each
# per server; ~3,500 had piled up in this machine's /dev/shm).
SHM_FILES = ("/dev/shm/sglang_loads_", "/dev/shm/sgl_shm_")


def shm_held(pgid: int) -> set[str]:
    """SGLang's /dev/shm files mapped or open in process group `pgid` (read from /proc)."""
    held: set[str] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                if int(f.read().rsplit(b")", 1)[1].split()[2]) != pgid:
                    continue
            with open(f"/proc/{pid}/maps") as f:
                held |= {ln.split(None, 5)[-1].strip() for ln in f if "/dev/shm/" in ln}
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    held.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile, or not ours to read
    return {p for p in held if p.startswith(SHM_FILES)}


class ManagedProcess:
    def __init__(self, spec: ProcessSpec, log_dir: Path) -> None:
        self.spec = spec
        self.log_path = log_dir / f"{spec.name}.log"
        self._proc: subprocess.Popen | None = None
        self._shm: set[str] = set()
        self.started_at = 0.0

    @property
    def url(self) -> str:
        # Where it listens: a server bound to a host's address (a deployment file) is not on loopback.
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"{'https' if self.tls_cert else 'http'}://{host}:{self.spec.port}"

    @property
    def host(self) -> str:
        """The address it binds (its --host)."""
        return self._flag("--host") or "127.0.0.1"

    @property
    def tls_cert(self) -> str | None:
        """The certificate a router serving HTTPS presents (its --tls-cert-path)."""
        return self._flag("--tls-cert-path")

    @property
    def tls(self) -> ssl.SSLContext | None:
        """What the launcher's own requests to it trust: its certificate, when it serves HTTPS."""
        return tls_context(self.tls_cert) if self.tls_cert else None

    def _flag(self, name: str) -> str | None:
        argv = list(self.spec.argv)
        return argv[argv.index(name) + 1] if name in argv[:-1] else None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child; a restart appends to the log
        self.started_at = time.monotonic()
        store = dict(self.spec.env).get("SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE", "")
        if store.startswith("file://"):  # a previous run's rendezvous file would confuse this one
            Path(store.removeprefix("file://")).unlink(missing_ok=True)
        shield = in_slurm_step()
        self._proc = subprocess.Popen(
            list(self.spec.argv),
            env=self.spec.environ() | ({IGNORE_SIGTERM_ENV: "1"} if shield else {}),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_preexec(self.spec.cpus, shield),
        )
        log.close()

    def poll(self) -> int | None:
        return self._proc.poll() if self._proc else None

    def healthy(self, path: str = "/health", timeout: float = 2.0) -> bool:
        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout, context=self.tls) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError, http.client.HTTPException):
            # HTTPException: a probe of a port nobody listens on yet can connect to itself
            # (the port is in the ephemeral range) and read its own request back.
            return False

    def check_alive(self) -> None:
        code = self.poll()
        if code is not None:
            from sglang_disagg.launch.preflight import bind_failure

            why = bind_failure(self.log_path.read_text(errors="replace") if self.log_path.exists() else "",
                               self.spec.ports, self.host)
            if why:
                raise StartupError(f"{self.spec.name} exited during start-up: {why} (log: {self.log_path})")
            raise StartupError(
                f"{self.spec.name} exited with code {code} during start-up; last lines of {self.log_path}:\n"
                + log_tail(self.log_path)
            )

    def drain(self) -> None:
        """SIGTERM to the server process alone (not its group): SGLang refuses new requests,
        finishes those in flight and exits; its schedulers keep running until then."""
        if self._proc and self._proc.poll() is None:
            self._shm |= shm_held(self._proc.pid)  # while they live: reap() removes them once all are gone
            try:
                self._proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass

    def wait_exit(self, timeout_s: float) -> bool:
        if not self._proc:
            return True
        try:
            self._proc.wait(max(0.0, timeout_s))
            return True
        except subprocess.TimeoutExpired:
            return False

    def terminate(self) -> None:
        """SIGTERM to the whole process group; `reap()` finishes the stop."""
        if self._proc and self._proc.poll() is None:
            self._shm |= shm_held(self._proc.pid)  # while they live: reap() removes them once all are gone
            try:
                os.killpg(self._proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def reap(self, deadline: float) -> None:
        """Wait for the leader until `deadline` (monotonic), then SIGKILL what is left of the
        group and wait until all of it is gone."""
        if not self._proc:
            return
        try:
            self._proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        # Children (schedulers, detokenizer) may outlive the leader: kill the group.
        try:
            os.killpg(self._proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self._proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
        # Until the last of them is gone it holds its ports (a scheduler unmapping a large
        # KV pool takes a moment): a stack started right after must find them free.
        until = time.monotonic() + 10
        while time.monotonic() < until:
            try:
                os.killpg(self._proc.pid, 0)
            except (ProcessLookupError, PermissionError):
                break
            time.sleep(0.05)
        else:
            return  # something of it still runs: what it maps stays
        for path in self._shm:
            with contextlib.suppress(OSError):
                os.unlink(path)
        self._shm = set()

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        if not self._proc or self._proc.poll() is not None:
            return
        self.terminate()
        self.reap(time.monotonic() + grace_s)
