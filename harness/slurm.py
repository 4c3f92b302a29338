"""A real Slurm cluster (Debian's slurmctld/slurmd 22.05 and munge) on namespace hosts (hosts/netns.py).

``Cluster.start(root, net, "ctl", ["n1", "n2", ...])`` runs slurmctld in host "ctl" and one
slurmd per other host, each with its own node name and address (the host's), all sharing one
munge daemon, as machines of a cluster share one munge key. Nothing is installed system-wide
or started as a service: the daemons read ``root/slurm.conf`` (``SLURM_CONF``), munge has its
own key and socket under ``root``, and each host sees the cluster's names in an /etc/hosts of
its own (bound over the real one inside the host's mount namespace only), since a rendered job
addresses its machines by the names Slurm gives them.

What is left out of a production Slurm, and why: cgroups (this machine's hybrid hierarchy is
not what slurmd's cgroup plugins expect; ``proctrack/linuxproc`` tracks a step's processes by
parentage, which is enough to signal and kill them) and accounting (no slurmdbd: ``sacct``
has no database to read; a finished job is in ``root/jobcomp.log``, jobcomp/filetxt).

``run(argv)`` runs a client (sbatch, squeue, scancel, scontrol) inside the controller's host;
``close()`` cancels what runs, stops every daemon and the munge daemon.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from .hosts.netns import Host, HostsUnavailable, Network

PROGRAMS = ("slurmctld", "slurmd", "sbatch", "squeue", "scancel", "scontrol", "sinfo", "munged")
DEBIAN_PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")


def missing() -> str:
    """Why a cluster cannot be made here ("" when it can)."""
    absent = [p for p in PROGRAMS if shutil.which(p) is None]
    if absent:
        return f"not installed: {', '.join(absent)} (Debian: apt-get install {' '.join(DEBIAN_PACKAGES)})"
    if os.geteuid() != 0:
        return "a Slurm cluster of namespace hosts needs root"
    return ""


def _conf(root: Path, ctl: Host, nodes: list[Host], cpus: int) -> str:
    lines = ["ClusterName=sgd", f"SlurmctldHost={ctl.name}({ctl.address})", "SlurmUser=root", "SlurmdUser=root",
             "AuthType=auth/munge", f"AuthInfo=socket={root}/munge/munge.sock", "CredType=cred/munge",
             f"StateSaveLocation={root}/state", f"SlurmdSpoolDir={root}/spool/%n",
             f"SlurmctldPidFile={root}/slurmctld.pid", f"SlurmdPidFile={root}/slurmd-%n.pid",
             f"SlurmctldLogFile={root}/log/slurmctld.log", f"SlurmdLogFile={root}/log/slurmd-%n.log",
             "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SelectType=select/linear",
             "MpiDefault=none", "ReturnToService=2",
             # a node whose slurmd stopped answering is DOWN after this long (the node-failure check)
             "SlurmdTimeout=10", "SlurmctldTimeout=10", "InactiveLimit=0", "KillWait=30",
             "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
             "JobCompType=jobcomp/filetxt", f"JobCompLoc={root}/jobcomp.log",
             # a fresh cluster would number its jobs from 1 again, and a job's logs
             # (logs/sglang-disagg-<id>) would land among an earlier cluster's
             f"FirstJobId={int(time.time()) % 600_000 * 100 + 1}"]
    lines += [f"NodeName={h.name} NodeAddr={h.address} CPUs={cpus} State=UNKNOWN" for h in nodes]
    lines += ["PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP", ""]
    return "\n".join(lines)


@dataclass
class Cluster:
    root: Path
    net: Network
    ctl: Host
    nodes: list[Host]
    daemons: dict[str, subprocess.Popen] = field(default_factory=dict)  # "slurmctld", "slurmd-n1", ...
    munged: int = 0

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.root / "slurm.conf")}

    @classmethod
    def start(cls, root: Path, net: Network, ctl: str, nodes: list[str], cpus: int = 2,
              timeout: float = 60.0) -> Cluster:
        why = missing()
        if why:
            raise HostsUnavailable(why)
        for d in ("munge", "state", "spool", "log"):
            (root / d).mkdir(parents=True, exist_ok=True)
        root.chmod(0o755)  # munged: its socket's directories must be searchable by all
        c = cls(root, net, net[ctl], [net[n] for n in nodes])
        try:
            c._start(cpus, timeout)
        except BaseException:
            c.close()
            raise
        return c

    def _start(self, cpus: int, timeout: float) -> None:
        m = self.root / "munge"
        m.chmod(0o755)
        key = m / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o400)
        r = subprocess.run(["munged", "--force", f"--socket={m}/munge.sock", f"--key-file={key}",
                            f"--pid-file={m}/munged.pid", f"--seed-file={m}/munged.seed",
                            f"--log-file={self.root}/log/munged.log"], capture_output=True, text=True, timeout=30)
        if r.returncode:
            raise HostsUnavailable(f"munged did not start: {(r.stderr or r.stdout).strip()[:500]}")
        self.munged = int((m / "munged.pid").read_text())
        names = "".join(f"{h.address} {h.name}\n" for h in [self.ctl, *self.nodes])
        (self.root / "hosts").write_text("127.0.0.1 localhost\n" + names)
        for h in [self.ctl, *self.nodes]:
            r = h.run(["mount", "--bind", str(self.root / "hosts"), "/etc/hosts"])
            if r.returncode:
                raise HostsUnavailable(f"{h.name}: cannot bind its /etc/hosts: {r.stderr.strip()}")
        conf = self.root / "slurm.conf"
        conf.write_text(_conf(self.root, self.ctl, self.nodes, cpus))
        self.daemons["slurmctld"] = self.ctl.popen(["slurmctld", "-D", "-f", str(conf)],
                                                   self.root / "log/slurmctld.out", self.env)
        for h in self.nodes:
            self.restart_slurmd(h.name)
        self.wait_nodes("idle", [h.name for h in self.nodes], timeout)

    def restart_slurmd(self, name: str) -> None:
        """The machine `name` back (after its slurmd was killed): its slurmd started again."""
        h = self.net[name]
        self.daemons[f"slurmd-{name}"] = h.popen(["slurmd", "-D", "-N", name, "-f", str(self.root / "slurm.conf")],
                                                 self.root / f"log/slurmd-{name}.out", self.env)

    def run(self, argv: list[str], timeout: float = 60.0, cwd: str | None = None) -> subprocess.CompletedProcess:
        """A Slurm client command, run inside the controller's host."""
        return subprocess.run(self.ctl.argv(argv, cwd), capture_output=True, text=True, timeout=timeout,
                              env=self.env)

    def node_states(self) -> dict[str, str]:
        r = self.run(["sinfo", "-h", "-N", "-o", "%N %T"])
        return dict(line.split() for line in r.stdout.splitlines() if line.strip())

    def wait_nodes(self, state: str, names: list[str], timeout: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while True:
            states = self.node_states()
            if all(states.get(n, "").rstrip("*") == state for n in names):
                return states
            if time.monotonic() > deadline:
                raise TimeoutError(f"nodes {names} not {state} within {timeout:.0f} s: {states}")
            time.sleep(0.5)

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job`'s fields (JobState, NodeList, ExitCode, ...); {} once it is forgotten."""
        r = self.run(["scontrol", "-o", "show", "job", job_id])
        return dict(kv.split("=", 1) for kv in r.stdout.split() if "=" in kv) if r.returncode == 0 else {}

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.run(["scancel", "--full", "--user=root"], timeout=20)
            # the jobs' own ends (a batch script's EXIT trap removes its secret) before the daemons go
            deadline = time.monotonic() + 45
            while self.run(["squeue", "-h", "-o", "%i"], timeout=20).stdout.strip() and time.monotonic() < deadline:
                time.sleep(0.5)
        for p in self.daemons.values():
            with contextlib.suppress(OSError):
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.daemons.values():
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)
        self.daemons = {}
        if self.munged:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.munged, signal.SIGTERM)
            self.munged = 0
