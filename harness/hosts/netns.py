"""Separate "hosts" on one machine: Linux namespaces joined by veth links through a bridge.

``Network.create(run, names)`` makes one host per name, each its own network, PID, IPC, UTS
and mount namespace with a private tmpfs on /dev/shm, and a bridge in a network namespace of
its own; host i gets ``eth0`` with 10.77.0.<i+1>/24 (and loopback up). With ``rails=N`` each
host also gets ``rail1`` .. ``rail<N-1>``, one more NIC per rail on a bridge and subnet of its
own (10.77.<k>.<i+1>/24), as a multi-rail node has one network per NIC. Nothing is added to
the root namespace: every veth is created inside the bridge namespace with its peer placed
straight into the host's, and the addresses exist only inside.

What makes a host a host here: a process in it sees only its own host's processes in /proc
(so /proc/<pid>/fd of a peer elsewhere is not there), its own /dev/shm, and its own links.
The rest of the file system is shared (the repository, the venv and the model cache stay
where they are), as on machines that mount the same software.

Lifetime: each namespace is held by a keeper, PID 1 of its PID namespace, that reaps
orphans; killing it makes the kernel kill every process of that host, and the namespaces,
tmpfs and links go with their last process. Keepers carry ``MARK-<owner pid>-<run>-<name>``
on their command line, so ``sweep()`` finds and kills what a run killed outright left behind:
the keepers whose owner process is gone (a live run's hosts are left alone).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

MARK = "sgdh"  # every keeper's command line carries MARK-<run>-<name>
SUBNET = "10.77.0"
SHM_SIZE = "4g"  # a tmpfs takes memory only for what is written

# PID 1 of a host: reaps whatever is re-parented to it, until it is killed from outside.
_INIT = ("import os, time\n"
         "while True:\n"
         "    try:\n"
         "        os.wait()\n"
         "    except ChildProcessError:\n"
         "        time.sleep(0.5)\n")


class HostsUnavailable(RuntimeError):
    """This machine (or user) cannot make the namespaces: the reason says which step failed."""


def can_create() -> str:
    """Why namespaces, a tmpfs and veth links cannot be made here ("" when they can)."""
    if not sys.platform.startswith("linux"):
        return f"separate hosts need Linux namespaces (this is {sys.platform})"
    probe = ["unshare", "--net", "--pid", "--ipc", "--uts", "--mount", "--fork", "--mount-proc", "--",
             "sh", "-c", f"mount -t tmpfs -o size=1m {MARK}-probe /dev/shm && "
                         "ip link add name p0 type veth peer name p1"]
    try:
        r = subprocess.run(probe, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"cannot run unshare/ip: {e}"
    if r.returncode:
        return (f"cannot create network/PID/mount namespaces with a tmpfs and veth links (needs root or "
                f"CAP_SYS_ADMIN + CAP_NET_ADMIN): {(r.stderr or r.stdout).strip()[:300]}")
    return ""


def _cmdline(pid: str) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _marks() -> dict[int, str]:
    """Keepers (and their unshare parents) of every run: pid -> mark."""
    out = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != os.getpid():
            mark = next((a for a in _cmdline(pid) if re.match(rf"^{MARK}-[0-9]+-", a)), None)
            if mark:
                out[int(pid)] = mark
    return out


def _alive(pid: int) -> bool:
    """Running (a zombie is not: it only waits for its parent to reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def keepers(owner: int | None = None) -> list[int]:
    """PIDs of the keepers this process (or `owner`) made and has not closed."""
    prefix = f"{MARK}-{os.getpid() if owner is None else owner}-"
    return [pid for pid, mark in _marks().items() if mark.startswith(prefix)]


def orphans() -> list[int]:
    """Keepers whose owner process is gone: what a run killed outright left."""
    return [pid for pid, mark in _marks().items() if not _alive(int(mark.split("-")[1]))]


def sweep(found: list[int] | None = None) -> int:
    """Kill `found` (default: the orphans); their hosts go with them. How many there were."""
    found = orphans() if found is None else found
    for pid in found:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in found) and time.monotonic() < deadline:
        time.sleep(0.05)
    return len(found)


def _ip(keeper: int, *args: str) -> None:
    r = subprocess.run(["nsenter", "-t", str(keeper), "-n", "ip", *args], capture_output=True, text=True, timeout=10)
    if r.returncode:
        raise HostsUnavailable(f"ip {' '.join(args)} (in namespace of {keeper}): {r.stderr.strip()}")


@dataclass
class Namespace:
    """One keeper and the namespaces it holds."""

    mark: str
    proc: subprocess.Popen
    pid: int  # the keeper, as the root namespace sees it

    @classmethod
    def start(cls, mark: str, flags: list[str], setup: str) -> Namespace:
        script = f"{setup} && echo ready && exec {sys.executable} -c '{_INIT}' {mark}"
        proc = subprocess.Popen(["unshare", *flags, "--fork", "--", "sh", "-c", script, mark],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        line = proc.stdout.readline().strip()
        if line != "ready":
            proc.kill()
            raise HostsUnavailable(f"namespace {mark} did not start: {proc.stderr.read().strip()[:500]}")
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        if len(children) != 1:
            proc.kill()
            raise HostsUnavailable(f"namespace {mark}: unshare has children {children}, expected its keeper")
        return cls(mark, proc, int(children[0]))

    def close(self) -> None:
        for pid in (self.pid, self.proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)


@dataclass
class Host:
    name: str
    address: str
    ns: Namespace
    port: str  # its veth's other end, in the bridge's namespace: the switch port this host is plugged into
    interface: str = "eth0"
    rails: list[tuple[str, str, str]] = field(default_factory=list)  # (interface, address, switch port), rail 1 up

    def rail_address(self, k: int) -> str:
        """The host's address on rail k (0: eth0's)."""
        return self.address if k == 0 else self.rails[k - 1][1]

    def argv(self, argv: list[str], cwd: str | None = None) -> list[str]:
        """`argv` run inside this host (every namespace of it)."""
        return ["nsenter", "-t", str(self.ns.pid), "-n", "-p", "-i", "-u", "-m", f"--wd={cwd or os.getcwd()}", "--",
                *argv]

    def run(self, argv: list[str], timeout: float = 120.0, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(argv), capture_output=True, text=True, timeout=timeout, **kw)

    def popen(self, argv: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
        with open(log, "ab") as f:
            return subprocess.Popen(self.argv(argv), stdout=f, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)

    def counters(self, interface: str | None = None) -> dict[str, int]:
        """rx/tx bytes of this host's link (or of `interface`, a rail), read from its own network
        namespace (/proc/<pid>/net/dev is the namespace of <pid>, as /sys/class/net/<if>/statistics
        is inside the host)."""
        interface = interface or self.interface
        for line in Path(f"/proc/{self.ns.pid}/net/dev").read_text().splitlines():
            name, _, rest = line.partition(":")
            if name.strip() == interface:
                f = rest.split()
                return {"rx_bytes": int(f[0]), "rx_packets": int(f[1]), "tx_bytes": int(f[8]),
                        "tx_packets": int(f[9])}
        raise HostsUnavailable(f"host {self.name} has no interface {interface}")

    def netns_file(self) -> str:
        return f"/proc/{self.ns.pid}/ns/net"

    def processes(self) -> list[int]:
        """Every process of this host (its PID namespace, the keeper included), by the PIDs
        this machine's root namespace gives them."""
        ns, out = os.readlink(f"/proc/{self.ns.pid}/ns/pid"), []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if os.readlink(f"/proc/{pid}/ns/pid") == ns:
                    out.append(int(pid))
            except OSError:  # gone meanwhile
                continue
        return out


@dataclass
class Network:
    run: str  # the marks' common part: MARK-<owner pid>-<run>
    bridge: Namespace
    hosts: dict[str, Host] = field(default_factory=dict)
    shaping: dict[str, object] = field(default_factory=dict)  # shaping.py's state of each switch port

    @classmethod
    def create(cls, run: str, names: list[str], rails: int = 1) -> Network:
        """Hosts `names` (in order: 10.77.0.1, .2, ...) on one bridge, and on `rails - 1` more
        bridges (rail k: 10.77.k.1, ...); on any failure nothing is left."""
        if not run.replace("-", "").isalnum():
            raise ValueError(f"run {run!r}: letters, digits and '-' only (it marks the keepers)")
        if not 1 <= rails <= 8:
            raise ValueError(f"rails must be 1 to 8, got {rails}")
        mark = f"{MARK}-{os.getpid()}-{run}"
        bridges = " && ".join(f"ip link add br{k} type bridge && ip link set br{k} up" for k in range(rails))
        bridge = Namespace.start(f"{mark}-bridge", ["--net"], f"ip link set lo up && {bridges}")
        net = cls(mark, bridge)
        try:
            for i, name in enumerate(names):
                net._add(i, name, rails)
        except BaseException:
            net.close()
            raise
        return net

    def _add(self, i: int, name: str, rails: int = 1) -> None:
        every = ["--net", "--pid", "--ipc", "--uts", "--mount", "--mount-proc", "--propagation", "private"]
        ns = Namespace.start(f"{self.run}-{name}", every,
                             f"mount -t tmpfs -o size={SHM_SIZE},mode=1777 {MARK}-shm /dev/shm && "
                             f"hostname {name} && ip link set lo up")
        br = f"v{i}"
        host = Host(name, f"{SUBNET}.{i + 1}", ns, br)
        self.hosts[name] = host
        _ip(self.bridge.pid, "link", "add", br, "type", "veth", "peer", "name", host.interface, "netns", str(ns.pid))
        _ip(self.bridge.pid, "link", "set", br, "master", "br0", "up")
        _ip(ns.pid, "addr", "add", f"{host.address}/24", "dev", host.interface)
        _ip(ns.pid, "link", "set", host.interface, "up")
        for k in range(1, rails):
            port, interface, address = f"v{i}r{k}", f"rail{k}", f"{SUBNET.rsplit('.', 1)[0]}.{k}.{i + 1}"
            _ip(self.bridge.pid, "link", "add", port, "type", "veth", "peer", "name", interface, "netns", str(ns.pid))
            _ip(self.bridge.pid, "link", "set", port, "master", f"br{k}", "up")
            _ip(ns.pid, "addr", "add", f"{address}/24", "dev", interface)
            _ip(ns.pid, "link", "set", interface, "up")
            host.rails.append((interface, address, port))

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def link(self, name: str, up: bool, rail: int = 0) -> None:
        """Cut (or restore) host `name`'s cable at the bridge (rail k's with `rail`): its interface
        loses carrier, its addresses and routes stay, and nothing it sends or is sent arrives, as
        with a pulled cable."""
        port = self[name].port if rail == 0 else self[name].rails[rail - 1][2]
        _ip(self.bridge.pid, "link", "set", port, "up" if up else "down")

    def tc(self, *args: str) -> None:
        """`tc ARGS` in the bridge's namespace (where every host's switch port is)."""
        r = subprocess.run(["nsenter", "-t", str(self.bridge.pid), "-n", "tc", *args], capture_output=True, text=True,
                           timeout=10)
        if r.returncode:
            raise HostsUnavailable(f"tc {' '.join(args)}: {r.stderr.strip()}")

    def close(self) -> None:
        for host in self.hosts.values():
            host.ns.close()
        self.bridge.close()
        self.hosts = {}

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
