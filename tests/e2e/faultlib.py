"""Helpers for the fault tests: requests in the background, the servers' messenger metrics,
signals to a server's whole process group, and the fault-matrix rows the tests print
(``pytest -s`` or ``-rP`` shows them; one line per case, tab-separable)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import threading
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from sglang_disagg.launch.client import generate_ids

FAULT_DEADLINE_S = 2.0  # every fault a socket reports is detected, answered and cleaned up within this
# A peer that cannot tell us anything (a cut cable, a partition, a hung host) is lost by its
# silence: the heartbeat timeout (peer_timeout_s, 1.8 s), then the decoder fails what it held.
# Measured 1.64-1.84 s on a quiet 2-core machine; the promise (docs/security.md) is the timeout
# plus 0.7 s, which leaves a loaded machine a 25 % margin over the slowest seen.
SILENT_PEER_DEADLINE_S = 2.5


def long_prompt(n: int, seed: int) -> list[int]:
    """A prompt no other test sends (so no radix cache on either side holds any of it)."""
    rng = random.Random(seed)
    return [1] + [rng.randrange(100, 4000) for _ in range(n - 1)]


class Call(threading.Thread):
    """One greedy request in the background; `done_at` is when its answer (or error) came."""

    def __init__(self, url: str, prompt: list[int], max_new_tokens: int, timeout: float = 60.0,
                 api_key: str | None = None) -> None:
        super().__init__(daemon=True)
        self.args = (url, prompt, max_new_tokens, timeout)
        self.api_key = api_key  # a deployment beyond loopback asks for it (sglang_disagg/launch/keys.py)
        self.out: list[int] | None = None
        self.err: BaseException | None = None
        self.done_at = 0.0
        self.start()

    def run(self) -> None:
        url, prompt, n, timeout = self.args
        try:
            self.out = generate_ids(url, prompt, n, timeout=timeout, api_key=self.api_key)
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            self.err = e
        finally:
            self.done_at = time.monotonic()

    def result(self, timeout: float = 30.0) -> Call:
        self.join(timeout)
        assert not self.is_alive(), f"no answer within {timeout} s"
        return self


def scrape(host: str, port: int, timeout: float = 10.0) -> dict[tuple, float]:
    """One /metrics read. 10 s is Prometheus' own scrape timeout: a scheduler relaying or
    migrating on a shared core may take seconds to answer (metrics_http.py), and a scraper
    that waits that long must get the answer."""
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout) as r:
        text = r.read().decode()
    return {(s.name,) + tuple(sorted(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name,) + tuple(sorted(labels.items())), 0.0)


def total(samples: dict, name: str) -> float:
    return sum(v for k, v in samples.items() if k[0] == name)


def leaked_pages(samples: dict) -> float:
    """KV pages held by nothing: allocated beyond the radix cache's, plus locked ones (run idle)."""
    pages = {k[1][1]: v for k, v in samples.items() if k[0] == "sglang_disagg_kv_pages"}
    return pages["allocated"] - pages["cached"] + pages["locked"]


def wait_released(host: str, port: int, since: float, timeout: float = FAULT_DEADLINE_S) -> tuple[float, float]:
    """Wait until a server's messenger holds no request and no page beyond its cache.
    Returns (seconds from `since` until then, pages still leaked at the deadline)."""
    deadline = time.monotonic() + timeout
    while True:
        s = scrape(host, port)
        busy = total(s, "sglang_disagg_requests_in_flight") + value(s, "sglang_disagg_queue_depth", queue="running")
        leak = leaked_pages(s)
        if (busy == 0 and leak == 0) or time.monotonic() > deadline:
            return time.monotonic() - since, leak + busy
        time.sleep(0.02)


def wait_for(what: str, cond, timeout: float = 10.0, every: float = 0.005):
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(every)


def wait_until(cond, timeout: float, every: float = 0.05) -> bool:
    """Whether `cond` came true within `timeout` (for a test that decides what to do next)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() >= deadline:
            return False
        time.sleep(every)
    return True


def signal_group(proc, sig: int) -> None:
    """A server with its scheduler and detokenizer children (they share its process group)."""
    os.killpg(proc.pid, sig)


def drop_connections(port: int) -> int:
    """Kill every TCP connection to 127.0.0.1:`port` (`ss -K`) and say how many: a drop that
    found no connection is a fault that did not happen, and fails the test here rather than
    letting it judge an outcome nothing caused."""
    out = subprocess.run(["ss", "-K", "-t", "-n", "dst", "127.0.0.1", "dport", "=", f":{port}"],
                         capture_output=True, text=True, check=True).stdout
    killed = sum(1 for line in out.splitlines()[1:] if line.strip())  # ss lists what it closed
    assert killed, f"ss -K closed no connection to port {port}: the fault did not happen"
    return killed


def row(case: str, time_to_error: float | None, pages_leaked: float, next_ok: bool, note: str = "") -> None:
    t = "-" if time_to_error is None else f"{time_to_error:.3f}s"
    print(f"\nfault-matrix | {case} | time to error {t} | pages leaked {pages_leaked:g} | next request ok {next_ok}"
          + (f" | {note}" if note else ""), flush=True)


SIGSTOP, SIGCONT, SIGKILL = signal.SIGSTOP, signal.SIGCONT, signal.SIGKILL


def first_contact(backend, hello, target: str, timeout: float = 10.0):
    """Say `hello` from `backend` (a hand-made decoder) to the prefill messenger at `target`,
    reading answers as a decoder's control thread does, until the link is refused; returns
    (the link, seconds it took). Closes the backend."""
    import types

    from sglang_disagg.messenger import wire
    from sglang_disagg.messenger.links import LinkState, Links

    t0 = time.monotonic()
    links = Links(types.SimpleNamespace(backend=backend), hello, (target,), 5.0)
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            try:
                peer, raw = backend.recv(0.1)
            except Exception:  # noqa: BLE001 - nothing yet, or closed
                continue
            links.on_message(peer, wire.decode(raw))
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        link = links.links[target]
        wait_for("a refusal", lambda: link.state is LinkState.REFUSED, timeout, 0.01)
        return link, time.monotonic() - t0
    finally:
        stop.set()
        reader.join()
        links.close()
        backend.close()
