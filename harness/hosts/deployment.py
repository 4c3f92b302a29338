"""A deployment file started across separate hosts (netns.py), one node per host, as an operator would.

``Deployment.write(dir, net, ...)`` writes one TOML file naming each host's address and a shared
secret file; ``start()`` runs ``python -m sglang_disagg.launch --config FILE --node NAME`` inside
each node's host (prefill and decode groups together, then the router) and returns once each
launcher said it is up, or raises NodeFailed with that node's output. ``close()`` stops every
node (and ``Network.close()`` kills whatever a node left in its host).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from sglang_disagg.launch.keys import HttpKeys

from .netns import Host, Network

UP = re.compile(r"\[sglang-disagg\] up in ([0-9.]+)s")


class NodeFailed(RuntimeError):
    pass


@dataclass(frozen=True)
class Layout:
    """Which host runs what: prefill groups (one per host, named prefill-0, -1, ...), one decode
    group, the router, and hosts on the same network that are no part of the deployment."""

    prefill: tuple[str, ...] = ("prefill",)
    decode: str = "decode"
    router: str = "router"
    prefill_tp: int = 1
    decode_tp: int = 1
    outside: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.prefill, str) or not self.prefill:
            raise ValueError(f"Layout.prefill: a non-empty tuple of host names, got {self.prefill!r}")
        names = self.names
        if len(set(names)) != len(names):
            raise ValueError(f"Layout: a host name is used twice in {names}")

    @property
    def names(self) -> list[str]:
        """Every host, in address order: prefill hosts, decode, router, then the outside ones."""
        return [*self.prefill, self.decode, self.router, *self.outside]

    def prefill_node(self, i: int) -> str:
        return f"prefill-{i}"


@dataclass
class Node:
    name: str       # the deployment's node name ("prefill-0", "decode-0", "router")
    host: Host
    proc: subprocess.Popen
    log: Path
    offset: int = 0  # where this run's output starts in `log` (a node launched again appends)

    def output(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no output)"

    def wait_up(self, deadline: float) -> float:
        """Seconds the launcher took to come up; NodeFailed if it exited or the deadline passed."""
        while True:
            m = UP.search(self.log.read_bytes()[self.offset:].decode(errors="replace")) if self.log.exists() else None
            if m:
                return float(m.group(1))
            if self.proc.poll() is not None:
                raise NodeFailed(f"{self.name} on {self.host.name} exited with {self.proc.returncode}:\n"
                                 + self.output())
            if time.monotonic() > deadline:
                raise NodeFailed(f"{self.name} on {self.host.name} not up in time:\n" + self.output())
            time.sleep(0.25)

    def wait_exit(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def stop(self) -> None:
        """SIGINT to the launcher inside the host (nsenter's child), then SIGKILL to what is left.
        SIGINT is Ctrl-C, "stop now": SIGTERM would first drain the decoders, and SGLang notices
        a drain request only on its next 5 s tick; a test's teardown has nothing in flight."""
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                for child in Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split():
                    os.kill(int(child), signal.SIGINT)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)


@dataclass
class Deployment:
    net: Network
    layout: Layout
    file: Path
    root: Path
    port: int
    nodes: dict[str, Node] = field(default_factory=dict)

    @classmethod
    def write(cls, root: Path, net: Network, layout: Layout, *, model: str = "tiny-llama", backend: str,
              provider: str | None = None, port: int = 30000, extra_args: tuple[str, ...] = (),
              max_total_tokens: int = 4096, mode: str = "messenger") -> Deployment:
        root.mkdir(parents=True, exist_ok=True)
        secret = root / "secret"
        secret.write_text(secrets.token_hex(32))
        secret.chmod(0o600)
        d, r = net[layout.decode], net[layout.router]
        lines = ["[deployment]", f'model = "{model}"', f'mode = "{mode}"', f'backend = "{backend}"',
                 f"port = {port}", f"max_total_tokens = {max_total_tokens}", f'secret_file = "{secret}"',
                 "extra_args = [" + ", ".join(f'"{a}"' for a in extra_args) + "]"]
        if provider:
            lines.append(f'provider = "{provider}"')
        for i, host in enumerate(layout.prefill):
            lines += ["", "[[prefill]]", f'name = "{layout.prefill_node(i)}"', f'host = "{net[host].address}"',
                      f"tp = {layout.prefill_tp}"]
        lines += ["", "[[decode]]", 'name = "decode-0"', f'host = "{d.address}"', f"tp = {layout.decode_tp}",
                  "", "[router]", f'host = "{r.address}"', ""]
        file = root / "deployment.toml"
        file.write_text("\n".join(lines))
        return cls(net, layout, file, root, port)

    @property
    def keys(self) -> HttpKeys:
        """The HTTP keys every node derives from the deployment's secret file (its hosts are not
        loopback: keys are on, sglang_disagg/launch/keys.py)."""
        return HttpKeys.derive((self.root / "secret").read_text().strip().encode())

    @property
    def url(self) -> str:
        """The router's front door (reachable only from inside the network)."""
        return f"http://{self.net[self.layout.router].address}:{self.port}"

    def launch(self, node: str, host: str, *flags: str) -> Node:
        """Start one node of the file inside `host` with the public launcher."""
        log_dir = self.root / node
        log_dir.mkdir(exist_ok=True)
        argv = [sys.executable, "-m", "sglang_disagg.launch", "--config", str(self.file), "--node", node,
                "--log-dir", str(log_dir), *flags]
        env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_DISAGG_SECRET")}
        for stale in log_dir.glob("*.messenger.json"):  # a previous run's: links() must not read it as this one's
            stale.unlink()
        out = self.root / f"{node}.out"
        offset = out.stat().st_size if out.exists() else 0
        n = Node(node, self.net[host], self.net[host].popen(argv, out, env), out, offset)
        self.nodes[node] = n
        return n

    def start(self, timeout_s: float = 300.0, flags: dict[str, tuple[str, ...]] | None = None) -> dict[str, float]:
        """Prefill and decode groups together, then the router; seconds each took to come up.
        `flags`: extra launcher flags per node name (they override the file, as on the command line)."""
        deadline = time.monotonic() + timeout_s
        lay, flags = self.layout, flags or {}
        servers = [self.launch(lay.prefill_node(i), host, *flags.get(lay.prefill_node(i), ()))
                   for i, host in enumerate(lay.prefill)]
        servers.append(self.launch("decode-0", lay.decode, *flags.get("decode-0", ())))
        try:
            ups = {n.name: n.wait_up(deadline) for n in servers}
            ups["router"] = self.launch("router", lay.router, *flags.get("router", ())).wait_up(deadline)
        except BaseException:
            self.close()
            raise
        return ups

    def messenger_stats(self, node: str, role: str) -> dict:
        return json.loads((self.root / node / f"{role}.messenger.json").read_text())

    def links(self) -> dict:
        """The decoder's links to prefill servers, as its messenger last published them ({} until it did)."""
        try:
            return self.messenger_stats("decode-0", "decode").get("links", {})
        except (OSError, ValueError):  # not written yet, or caught mid-write
            return {}

    def wait_links_ready(self, timeout: float = 15.0) -> float:
        """Until every link of the decoder is ready; the seconds it took (TimeoutError past `timeout`)."""
        t0 = time.monotonic()
        while not ((links := self.links()) and all(v.get("state") == "ready" for v in links.values())):
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"the decoder's links to prefill servers are not ready: {links}")
            time.sleep(0.1)
        return time.monotonic() - t0

    def close(self) -> None:
        for n in reversed(list(self.nodes.values())):
            n.stop()
        self.nodes = {}
