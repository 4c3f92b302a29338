"""The transfer tail across hosts: one request's TTFT and its "prefill forward end -> decoder
ready", and what a link's rate predicts for them (shared by benchmarks/hosts.py and
tests/hosts/test_capped_link.py, so the benchmark's figures and the test's assertion are
one measurement).

How the tail is read: messenger rows from the two messengers' own timestamps, the prefill's
``forward_end`` (its forward returned) and the decoder's ``handoff`` (the request entered its
batch), both CLOCK_MONOTONIC. The hosts of netns.py share one kernel and no time namespace,
so one host's monotonic clock is every host's, and the difference is exact; on separate
machines it would not be. Upstream SGLang PD has no such hook: its tail is SGLang's own
``sglang:kv_transfer_latency_ms`` on the prefill server (forward end until the prefill saw
the transfer done; it stops before the decoder polled, so it understates upstream's tail).

The link's prediction: ``kv_bytes * 8 / rate`` for the whole transfer, and one layer's share
of it (the KV of a layer is 1/layers of the request's, every layer being alike). Beside
them: the TCP goodput a link really gives (``goodput_mbit``, to keep caps below what veth
carries) and the CPU a host used during a request (``host_cpu_s``: these hosts share one
machine's cores, so one host's busy-waiting is another's slower forward).
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from sglang_disagg.launch.client import generate_ids
from sglang_disagg.launch.config import Ports

from . import inside
from .deployment import Deployment
from .netns import Host, Network

KV_BYTES = re.compile(r"^sglang_disagg_kv_bytes_total ([0-9.e+]+)$", re.M)
UPSTREAM_LATENCY = r"^sglang:kv_transfer_latency_ms_{}\{{[^}}]*\}} ([0-9.e+]+)$"
GOODPUT_PORT = 5201
FLOAT32 = 4


@dataclass(frozen=True)
class Geometry:
    """What one token's KV weighs: layers x (K and V) x KV heads x head dim x bytes."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = FLOAT32

    @classmethod
    def of(cls, model: str) -> Geometry:
        from sglang_disagg.models import resolve_model_path

        cfg = json.loads((resolve_model_path(model) / "config.json").read_text())
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        return cls(cfg["num_hidden_layers"], cfg["num_key_value_heads"], head_dim)

    @property
    def bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * self.dtype_bytes


def transfer_ms(kv_bytes: float, rate_mbit: float) -> float:
    """What the link's rate predicts for moving `kv_bytes` (no protocol overhead)."""
    return kv_bytes * 8 / (rate_mbit * 1e6) * 1000


def goodput_mbit(net: Network, src: str, dst: str, seconds: float = 1.5) -> float:
    """TCP goodput from host `src` to host `dst` (a small iperf: one stream, counted at the receiver,
    from its first byte to the sender's close). Python's sendall caps it: a lower bound on the link."""
    got: dict = {}
    listening = threading.Event()

    def serve() -> None:
        with socket.create_server((net[dst].address, GOODPUT_PORT)) as srv:
            listening.set()
            srv.settimeout(seconds + 10)
            conn, _ = srv.accept()
            with conn:
                n, first = 0, None
                while chunk := conn.recv(1 << 20):
                    first = first or time.perf_counter()
                    n += len(chunk)
                got["bytes"], got["s"] = n, time.perf_counter() - (first or time.perf_counter())

    def send() -> None:
        buf = b"\0" * (1 << 20)
        with socket.create_connection((net[dst].address, GOODPUT_PORT), timeout=10) as s:
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                s.sendall(buf)

    server = inside.Thread(net[dst], serve)
    server.start()
    if not listening.wait(10):
        raise RuntimeError(f"goodput: no listener on {dst}")
    inside.call(net[src], send, timeout=seconds + 30)
    server.join(seconds + 15)
    if not got.get("s"):
        raise RuntimeError(f"goodput {src} -> {dst}: nothing received")
    return got["bytes"] * 8 / got["s"] / 1e6


def host_cpu_s(host: Host) -> float:
    """CPU seconds the live processes of `host` (its PID namespace) used so far. The hosts
    share this machine's cores: a host that spins while it waits slows the others' compute,
    which on separate machines it would not."""
    total, tick = 0.0, os.sysconf("SC_CLK_TCK")
    for pid in host.processes():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        except OSError:  # gone meanwhile
            continue
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


class Probe:
    """Requests to a deployment from inside its router's host, each read back as one row."""

    def __init__(self, dep: Deployment, upstream: bool = False) -> None:
        self.dep, self.upstream = dep, upstream
        self.router = dep.net[dep.layout.router]
        ports = Ports(dep.port)
        self.decode_metrics = f"http://{dep.net[dep.layout.decode].address}:{ports.decode_metrics}/metrics"
        self.prefill_metrics = f"http://{dep.net[dep.layout.prefill[0]].address}:{ports.prefill}/metrics"

    def _inside(self, fn, *args, timeout: float = 60.0):
        return inside.call(self.router, fn, *args, timeout=timeout)

    def kv_bytes_counter(self) -> float:
        m = KV_BYTES.search(self._inside(_get, self.decode_metrics))
        return float(m.group(1)) if m else 0.0

    def upstream_latency(self) -> tuple[float, float]:
        """SGLang's kv_transfer_latency_ms (sum, count) on the upstream prefill server."""
        text = self._inside(_get, self.prefill_metrics)
        out = []
        for part in ("sum", "count"):
            m = re.search(UPSTREAM_LATENCY.format(part), text, re.M)
            out.append(float(m.group(1)) if m else 0.0)
        return out[0], out[1]

    def generate(self, prompt: list[int], rid: str | None = None, timeout: float = 300.0) -> float:
        """Seconds until the answer (max_new_tokens 1: the TTFT), measured inside the router's host."""
        def run() -> float:
            t0 = time.perf_counter()
            generate_ids(self.dep.url, prompt, 1, timeout=timeout, api_key=self.dep.keys.api,
                         **({"rid": rid} if rid else {}))
            return time.perf_counter() - t0
        return self._inside(run, timeout=timeout + 10)

    def warm_up(self, prompt: list[int], deadline: float) -> None:
        """One request that must succeed before `deadline`: retried while a restarted prefill
        server's link comes back (a request sent while the link is gone fails at once)."""
        while True:
            try:
                self.generate(prompt)
                return
            except Exception:  # noqa: BLE001 - retried until the deadline, then raised
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def _recent(self, node: str, role: str, rid: str, timeout: float = 15.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                for r in self.dep.messenger_stats(node, role).get("recent", []):
                    if r.get("rid") == rid:
                        return r
            except (OSError, ValueError):  # not written yet, or caught mid-write
                pass
            time.sleep(0.05)
        raise RuntimeError(f"{node}'s messenger never published request {rid}")

    def measure(self, prompt: list[int], rid: str) -> dict:
        """One request: ttft_ms, tail_ms, kv_bytes (decoder's counter; upstream: None), the CPU
        seconds the prefill and decode hosts used meanwhile and, when the prefill streamed (its
        forward's start is known then), forward_ms."""
        hosts = {"prefill": self.dep.net[self.dep.layout.prefill[0]], "decode": self.dep.net[self.dep.layout.decode]}
        cpu0 = {k: host_cpu_s(h) for k, h in hosts.items()}
        row = self._measure(prompt, rid)
        return row | {"cpu_s": {k: round(host_cpu_s(h) - cpu0[k], 2) for k, h in hosts.items()}}

    def _measure(self, prompt: list[int], rid: str) -> dict:
        if self.upstream:
            before = self.upstream_latency()
            ttft = self.generate(prompt)
            deadline, after = time.monotonic() + 10, before
            while after[1] <= before[1] and time.monotonic() < deadline:  # the metric lands after the answer
                time.sleep(0.1)
                after = self.upstream_latency()
            tail = (after[0] - before[0]) / (after[1] - before[1]) if after[1] > before[1] else None
            return {"ttft_ms": 1000 * ttft, "tail_ms": tail, "kv_bytes": None, "forward_ms": None}
        kv0 = self.kv_bytes_counter()
        ttft = self.generate(prompt, rid)
        dec = self._recent("decode-0", "decode", rid)
        pre = self._recent(self.dep.layout.prefill_node(0), "prefill", rid)
        streamed = "last_layer_written" in pre  # only a streaming prefill times its layers
        return {"ttft_ms": 1000 * ttft, "tail_ms": 1000 * (dec["handoff"] - pre["forward_end"]),
                "kv_bytes": self.kv_bytes_counter() - kv0,
                "forward_ms": 1000 * (pre["forward_end"] - pre["forward_start"]) if streamed else None}

