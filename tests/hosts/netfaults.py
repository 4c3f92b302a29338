"""The deployment the network-fault tests share, and how they look at it from inside the hosts.

Two prefill hosts, a decode host, the router's host and one host outside the deployment,
libfabric tcp, tiny-llama, the link into the decode host capped at RATE_MBIT (so a long
prompt's KV takes seconds to cross and a fault lands while it is in flight) and a transfer
deadline of TRANSFER_TIMEOUT_S. The test process is in no host's network: every request is
sent from the router's host and every server's /metrics is read from that server's own host
(reachable even while its cable is cut), on threads that joined those namespaces (inside.py).
"""

from __future__ import annotations

from pathlib import Path

from e2e.conftest import COMMON_ARGS
from e2e.faultlib import Call, scrape, value, wait_for, wait_released
from harness.hosts import inside, netns, shaping
from harness.hosts.deployment import Deployment, Layout
from sglang_disagg.backends import BackendConfig
from sglang_disagg.launch.config import Ports

RATE_MBIT = 40            # the link into the decode host: 1500 tokens of tiny-llama KV (5.9 MiB) take ~1.2 s
TRANSFER_TIMEOUT_S = 5.0  # a request's writes must all land within this
HEARTBEAT_S = BackendConfig().peer_timeout_s  # a peer silent this long is lost
LAYOUT = Layout(prefill=("prefill-a", "prefill-b"), outside=("outside",))


class HostCall(Call):
    """faultlib.Call sent from inside a host (the router's)."""

    def __init__(self, host: netns.Host, *args, **kw) -> None:
        self._netns = host.netns_file()
        super().__init__(*args, **kw)

    def run(self) -> None:
        inside.join(self._netns)
        super().run()


class NetFaults:
    def __init__(self, root: Path, net: netns.Network) -> None:
        self.net = net
        self.dep = Deployment.write(root, net, LAYOUT, backend="libfabric", provider="tcp", extra_args=COMMON_ARGS,
                                    max_total_tokens=8192)
        self.ports = Ports(self.dep.port)

    def start(self) -> None:
        timeout = ("--transfer-timeout", str(TRANSFER_TIMEOUT_S))
        self.dep.start(flags={"prefill-0": timeout, "prefill-1": timeout, "decode-0": timeout})
        shaping.cap(self.net, LAYOUT.decode, RATE_MBIT)
        self.dep.wait_links_ready(30)

    def close(self) -> None:
        self.dep.close()

    # where things are
    def host(self, node: str) -> netns.Host:
        return self.net[LAYOUT.decode if node == "decode-0" else LAYOUT.prefill[int(node.rsplit("-", 1)[1])]]

    def metrics_port(self, node: str) -> int:
        return self.ports.decode_metrics if node == "decode-0" else self.ports.prefill_metrics

    def link_key(self, node: str) -> str:
        return f"{self.host(node).address}:{self.ports.bootstrap}"

    # what the servers say
    def metrics(self, node: str) -> dict:
        return inside.call(self.host(node), scrape, self.host(node).address, self.metrics_port(node))

    def writes(self, node: str) -> float:
        return value(self.metrics(node), "sglang_disagg_kv_writes_total")

    def outcome(self, outcome: str) -> float:
        return value(self.metrics("decode-0"), "sglang_disagg_requests_total", outcome=outcome)

    def causes(self) -> dict[str, float]:
        """The decoder's failed requests by cause (so an unexpected failure says why)."""
        return {dict(k[1:]).get("cause", "?"): v for k, v in self.metrics("decode-0").items()
                if k[0] == "sglang_disagg_failures_total" and v}

    def last_failure(self) -> float:
        """Unix time of the decoder's last failed request (any cause), by its own clock."""
        return max(v for k, v in self.metrics("decode-0").items()
                   if k[0] == "sglang_disagg_last_failure_timestamp_seconds")

    def stats(self) -> dict:
        return self.dep.messenger_stats("decode-0", "decode") or {}

    def links(self) -> dict:
        return self.dep.links()

    def link_state(self, node: str) -> str:
        return self.links().get(self.link_key(node), {}).get("state", "")

    def released(self, node: str, since: float, timeout: float = 2.0) -> tuple[float, float]:
        """(seconds from `since` until `node` held no request and no page beyond its cache, pages left)."""
        h = self.host(node)
        return inside.call(h, wait_released, h.address, self.metrics_port(node), since, timeout, timeout=timeout + 10)

    # requests
    def call(self, prompt: list[int], n: int, timeout: float = 60.0) -> HostCall:
        return HostCall(self.net[LAYOUT.router], self.dep.url, prompt, n, timeout, api_key=self.dep.keys.api)

    def mid_transfer(self, node: str, prompt: list[int], n: int) -> HostCall:
        """A request that prefill `node` is writing when this returns."""
        before = self.writes(node)
        c = self.call(prompt, n)
        wait_for(f"{node} writing", lambda: self.writes(node) > before, 30, 0.02)
        return c

    def wait_links_ready(self, timeout: float = 15.0) -> float:
        return self.dep.wait_links_ready(timeout)
