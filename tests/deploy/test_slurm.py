"""The Slurm job ``render slurm`` writes, submitted with sbatch to a real Slurm (harness/slurm.py:
slurmctld, a slurmd per namespace host, munge) as an operator would, from the repository root.

The deployment: one prefill server, two decoders (so each decoder drains by migration on
SIGTERM: deploy.py), the router; tiny-llama in float32 over libfabric tcp, on four machines
n1..n4 (the job's node list, in order: prefill-0, decode-0, decode-1, router). Checked: the
stack serves the e2e prompts through the router token-exact against a colocated server; a
decoder's step stopped with ``scancel --signal=TERM JOB.STEP`` (what the script's comment tells
an operator) hands its running streams to the other decoder, each ending exact, and the job
keeps running; ``scancel JOB`` stops every process on every machine and removes the job's
secret, leaving its logs; a machine that dies (its slurmd and every process on it killed) is
marked DOWN by Slurm, which requeues the job (nothing of it is left on the other machines) and
starts it again whole once the machine is back, serving exact again.
"""

from __future__ import annotations

import functools
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from e2e.conftest import COMMON_ARGS, run_sequential
from e2e.faultlib import wait_for
from harness import slurm
from harness.hosts import inside, netns
from sglang_disagg.launch.client import greedy

from .conftest import DRAIN_TOKENS, MODEL

REPO = Path(__file__).resolve().parents[2]
MACHINES = ["n1", "n2", "n3", "n4"]  # prefill-0, decode-0, decode-1, router: the node list's order
SERVERS = 4  # launchers that say "up in": prefill-0, decode-0, decode-1, router
PORT = 30000  # the deployment's: router 30000, prefill 30001, decode 30002 (launch/config.py Ports)
UP = re.compile(r"\[sglang-disagg\] up in ([0-9.]+)s")


@pytest.fixture(scope="module")
def cluster(engines, tmp_path_factory):
    root = tmp_path_factory.mktemp("slurm")
    with netns.Network.create("slurm", ["ctl", *MACHINES]) as net:
        c = slurm.Cluster.start(root / "cluster", net, "ctl", MACHINES)
        try:
            yield c
        finally:
            c.close()


@pytest.fixture(scope="module")
def script(cluster) -> Path:
    """The example's shape with this test's model and flags, rendered by the public CLI."""
    root = cluster.root.parent
    extra = ", ".join(f'"{a}"' for a in COMMON_ARGS)
    (root / "deployment.toml").write_text("\n".join([
        "[deployment]", f'model = "{MODEL}"', 'backend = "libfabric"', 'provider = "tcp"', f"port = {PORT}",
        "max_total_tokens = 4096", f"extra_args = [{extra}]",
        '[[prefill]]', 'name = "prefill-0"', 'host = "machine-0"',
        '[[decode]]', 'name = "decode-0"', 'host = "machine-1"',
        '[[decode]]', 'name = "decode-1"', 'host = "machine-2"',
        '[router]', 'host = "machine-3"', ""]))
    r = subprocess.run([sys.executable, "-m", "sglang_disagg.launch", "render", "slurm", str(root / "deployment.toml")],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr
    out = root / "job.sbatch"
    out.write_text(r.stdout)
    return out


class Job:
    def __init__(self, cluster: slurm.Cluster, script: Path) -> None:
        self.cluster = cluster
        r = cluster.run(["sbatch", f"--chdir={REPO}", f"--output={cluster.root.parent}/slurm-%j.out", str(script)],
                        cwd=str(REPO))
        assert r.returncode == 0, r.stderr
        self.id = r.stdout.split()[-1]
        self.out = cluster.root.parent / f"slurm-{self.id}.out"
        self.logs = REPO / "logs" / f"sglang-disagg-{self.id}"

    def output(self) -> str:
        return self.out.read_text(errors="replace") if self.out.exists() else "(no output yet)"

    def wait_up(self, timeout: float = 300.0) -> float:
        t0 = time.monotonic()

        def up() -> bool:
            state = self.cluster.job(self.id).get("JobState", "?")
            assert state in ("PENDING", "RUNNING"), f"job {self.id} is {state}:\n{self.output()[-4000:]}"
            return len(UP.findall(self.output())) >= SERVERS

        wait_for(f"job {self.id} up (its output: {self.out})", up, timeout, 0.5)
        return time.monotonic() - t0

    @property
    def api_key(self) -> str:
        return (self.logs / "router" / "api-key").read_text().strip()

    def wait_state(self, states: tuple[str, ...], timeout: float) -> dict[str, str]:
        return wait_for(f"job {self.id} {states}", lambda: (i := self.cluster.job(self.id)).get("JobState") in states
                        and i, timeout, 0.5)

    def step_on(self, machine: str) -> str:
        r = self.cluster.run(["squeue", "-h", "-s", "-j", self.id, "-o", "%i %N"])
        steps = [line.split() for line in r.stdout.splitlines() if line.strip()]
        found = [s for s, nodes in steps if nodes == machine and not s.endswith(".batch")]
        assert len(found) == 1, f"the step on {machine}: {steps}"
        return found[0]


def _in_host(host: netns.Host) -> list[int]:
    return [pid for pid in host.processes() if pid != host.ns.pid]  # its keeper is the machine's


def _ours(host: netns.Host) -> list[str]:
    """The job's processes left in `host` (slurmd is the machine's, not the job's)."""
    left = []
    for pid in _in_host(host):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if cmd and not cmd.startswith(("slurmd", "nsenter")):
            left.append(f"{pid}: {cmd[:160]}")
    return left


def _stream(url: str, key: str, prompt: list[int], n: int, got: dict) -> None:
    """One streaming greedy request, read to its end (run inside a host's network)."""
    try:
        host, port = url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=120)
        conn.request("POST", "/generate", json.dumps({"input_ids": prompt, "stream": True,
                                                      "sampling_params": greedy(n)}),
                     {"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
        r = conn.getresponse()
        assert r.status == 200, f"{r.status}: {r.read()[:300]!r}"
        for line in r:
            if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                ev = json.loads(line[5:])
                if "error" in ev:
                    raise RuntimeError(ev["error"])
                got["out"], got["events"] = ev["output_ids"], got.get("events", 0) + 1
    except Exception as e:  # noqa: BLE001 - the test reports it
        got["err"] = e


def test_the_rendered_job_serves_exact_drains_a_decoder_on_its_step_signal_and_scancel_leaves_nothing(
        cluster, script, colocated):
    job = Job(cluster, script)
    up = job.wait_up()
    ctl = cluster.net["ctl"]
    # by address: the client threads join the hosts' network, not their /etc/hosts
    router, decode_1 = f"http://{cluster.net['n4'].address}:{PORT}", f"http://{cluster.net['n3'].address}:{PORT + 2}"
    squeue = cluster.run(["squeue", "-h", "-j", job.id, "-o", "%i %j %T %D %N"]).stdout.strip()
    assert squeue.split()[2] == "RUNNING", squeue
    key = job.api_key
    prompts, expected = colocated["short"]
    assert inside.call(ctl, functools.partial(run_sequential, router, prompts, api_key=key), timeout=300) == expected

    # A decoder stopped alone, as the script's comment says: its streams move to decode-0
    drains, drain_expected = colocated["drain"]
    got = [{} for _ in drains]
    threads = [inside.Thread(ctl, _stream, decode_1, key, p, DRAIN_TOKENS, g) for p, g in zip(drains, got)]
    for t in threads:
        t.start()
    wait_for("every stream decoding on decode-1", lambda: all(g.get("events", 0) >= 5 or "err" in g for g in got),
             60, 0.05)
    step = job.step_on("n3")
    # Slurm 22.05 delivers it and still prints "Kill job error on job step id ...: Invalid job id
    # specified" (exit 225; seen here with any step): judged by what the decoder says instead
    cluster.run(["scancel", "--signal=TERM", step])
    wait_for(f"decode-1 draining on its step's SIGTERM (output: {job.out})",
             lambda: f"draining http://n3:{PORT + 2}" in job.output(), 30, 0.2)
    for t in threads:
        t.join(300)
    assert [g.get("err") for g in got] == [None] * len(drains)
    assert [g["out"] for g in got] == drain_expected, "streams drained by the step's signal != colocated"
    drained = re.findall(r"drain: running (\d+), migrating (\d+), migrated (\d+), failed (\d+)", job.output())
    assert drained and int(drained[-1][2]) >= 1, job.output()[-3000:]
    wait_for("the drained decoder's step ended",
             lambda: step not in cluster.run(["squeue", "-h", "-s", "-j", job.id, "-o", "%i"]).stdout.split(), 60, 0.5)
    assert cluster.job(job.id)["JobState"] == "RUNNING", "the job ended with one decoder drained"
    assert inside.call(ctl, functools.partial(run_sequential, router, prompts[:2], api_key=key), timeout=120) == expected[:2]

    # The whole job cancelled: nothing of it stays on any machine
    secrets_made = list(REPO.glob(f".sglang-disagg-secret.{job.id}.*"))
    assert len(secrets_made) == 1, "the job made its secret in the submit directory"
    t0 = time.monotonic()
    assert cluster.run(["scancel", job.id]).returncode == 0
    info = job.wait_state(("CANCELLED", "COMPLETED", "FAILED"), 90)
    left = {m: _ours(cluster.net[m]) for m in MACHINES}
    assert left == {m: [] for m in MACHINES}, left
    stopped = time.monotonic() - t0
    assert not secrets_made[0].exists(), "the job's secret outlived it"
    shm = {m: cluster.net[m].run(["ls", "-A", "/dev/shm"]).stdout.split() for m in MACHINES}
    assert shm == {m: [] for m in MACHINES}, shm
    assert (job.logs / "router" / "router.log").exists() and (job.logs / "decode-0").is_dir()
    print(f"\nslurm | job {job.id} up in {up:.1f}s on {squeue.split()[-1]}: {squeue!r}; e2e prompts exact "
          f"through the router; decode-1's step {step} drained by SIGTERM ({drained[-1][2]} migrated), "
          f"streams exact; scancel: {info['JobState']} and no process left in {stopped:.1f}s, secret removed, "
          f"logs kept in {job.logs.relative_to(REPO)}")


def test_a_machine_that_dies_is_marked_down_the_job_is_requeued_and_serves_again_once_it_is_back(
        cluster, script, colocated):
    """Slurm's own answer to a lost machine: the node DOWN, the batch job requeued (JobRequeue's
    default; `#SBATCH --no-requeue` would end it NODE_FAIL instead), its processes on the other
    machines stopped, and the job started again whole once enough machines are up."""
    job = Job(cluster, script)
    job.wait_up()
    victim = cluster.net["n2"]  # decode-0's machine
    t0 = time.monotonic()
    for pid in _in_host(victim):  # slurmd, its step daemons and the decoder: the machine is gone
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    states = cluster.wait_nodes("down", ["n2"], 60)
    t_down = time.monotonic() - t0
    reason = cluster.run(["sinfo", "-h", "-R", "-n", "n2", "-o", "%E"]).stdout.strip()
    wait_for(f"job {job.id} requeued", lambda: (i := cluster.job(job.id)).get("Restarts", "0") != "0"
             and i.get("JobState") == "PENDING", 90, 0.5)
    t_requeued = time.monotonic() - t0
    others = [m for m in MACHINES if m != "n2"]
    wait_for("nothing of the job left on the other machines", lambda: not any(_ours(cluster.net[m]) for m in others),
             60, 0.5)
    assert not list(REPO.glob(f".sglang-disagg-secret.{job.id}.*")), "the first run's secret outlived it"
    # the machine comes back (its slurmd again): back in service (ReturnToService=2), and the job
    # starts again; Slurm holds a requeued job ~2 minutes first, which the operator may skip
    first_run = job.output()
    job.out.unlink()  # the second run writes it anew (sbatch's default --open-mode=truncate)
    cluster.restart_slurmd("n2")
    cluster.wait_nodes("idle", ["n2"], 60)
    assert cluster.run(["scontrol", "update", f"JobId={job.id}", "StartTime=now"]).returncode == 0
    t_again = job.wait_up()
    assert len(UP.findall(first_run)) == SERVERS
    prompts, expected = colocated["short"]
    router = f"http://{cluster.net['n4'].address}:{PORT}"
    got = inside.call(cluster.net["ctl"], functools.partial(run_sequential, router, prompts[:3], api_key=job.api_key),
                      timeout=180)
    assert got == expected[:3], "the requeued job's answers != colocated"
    restarts = cluster.job(job.id).get("Restarts", "?")
    assert cluster.run(["scancel", job.id]).returncode == 0
    job.wait_state(("CANCELLED",), 90)
    print(f"\nslurm | machine n2 killed: Slurm marked it {states['n2']} after {t_down:.1f}s ({reason!r}); job "
          f"{job.id} requeued after {t_requeued:.1f}s, nothing of it left on n1, n3, n4; n2 back, the job up "
          f"again in {t_again:.1f}s (restarts {restarts}) and answered exact")
