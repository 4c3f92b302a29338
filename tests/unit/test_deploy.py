"""One deployment file (launch/deployment.example.toml): the launcher reads it (flags
override it, a bad file names the field), and the Kubernetes and Slurm renderings run the
launcher with exactly the configuration it builds for each node: same roles, ports and
backend settings."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from sglang_disagg.launch import Role
from sglang_disagg.launch.__main__ import parse
from sglang_disagg.launch.deploy import DeploymentError, load, parse as parse_doc
from sglang_disagg.launch.render import kubernetes, slurm

EXAMPLE = Path(__file__).parents[2] / "launch" / "deployment.example.toml"
NODES = ["prefill-0", "decode-0", "decode-1", "decode-2", "router"]


def test_the_example_is_one_prefill_group_for_three_decode_groups():
    dep = load(EXAMPLE)
    assert [g.role for g in dep.groups] == [Role.PREFILL] + [Role.DECODE] * 3
    assert all(g.prefill == ("prefill-0",) for g in dep.of(Role.DECODE))


@pytest.mark.parametrize("node", NODES)
def test_the_launcher_runs_what_the_file_says_and_flags_override_it(node):
    dep = load(EXAMPLE)
    cfg, _ = parse(["--config", str(EXAMPLE), "--node", node])
    assert cfg == dep.launch_config(node)
    if node.startswith("decode"):
        assert cfg.prefill_messengers == ("10.0.0.1:30003",)
    over, _ = parse(["--config", str(EXAMPLE), "--node", node, "--provider", "verbs", "--port", "31000",
                     "--chunked-prefill-size", "64"])
    assert (over.provider, over.port, over.host, over.role) == ("verbs", 31000, cfg.host, cfg.role)
    assert over.extra_args[-2:] == ("--chunked-prefill-size", "64")


BAD = [
    ("[[prefill]]\nname='p'\nhost='h'\n", "[deployment]: missing"),
    ("[deployment]\nmodel='tiny-llama'\ncolour='red'\n", "deployment: unknown field(s) colour"),
    ("[deployment]\nmodel='tiny-llama'\nport='x'\n[[prefill]]\nname='p'\nhost='h'\n[[decode]]\nname='d'\nhost='h'\n",
     "deployment.port: expected int"),
    ("[deployment]\nmodel='tiny-llama'\nmode='fast'\n", "deployment.mode: 'fast' is not one of"),
    ("[deployment]\nmodel='tiny-llama'\n[[prefill]]\nname='p'\nhost='h'\n", "[[decode]]: the deployment needs"),
    ("[deployment]\nmodel='tiny-llama'\n[[prefill]]\nname='p'\nhost='h'\n[[decode]]\nname='d'\nhost='h'\n"
     "prefill=['q']\n", "decode[0].prefill: 'q' is not a prefill group"),
    ("[deployment]\nmodel='tiny-llama'\n[[prefill]]\nname='p'\nhost='h'\ntp=3\nnodes=2\n[[decode]]\nname='d'\n"
     "host='h'\n", "prefill[0]: tp 3 over nodes 2"),
    ("[deployment]\nmodel='tiny-llama'\n[[prefill]]\nname='p'\nhost='h'\n[[decode]]\nname='p'\nhost='h'\n",
     "the name is used twice"),
    ("[deployment]\nmodel='tiny-llama'\nbackend='carrier-pigeon'\n[[prefill]]\nname='p'\nhost='h'\n[[decode]]\n"
     "name='d'\nhost='h'\n", "node 'p': --backend 'carrier-pigeon'"),
    ("[deployment\n", "not valid TOML"),
    ("[deployment]\nmodel='tiny-llama'\ndevice='cuda'\n[[prefill]]\nname='p'\nhost='h'\ntp=2\ngpus=1\n[[decode]]\n"
     "name='d'\nhost='h'\n", "prefill[0].gpus: 1 GPU(s) per machine cannot hold tp 2 over 1 machine(s)"),
    ("[deployment]\nmodel='tiny-llama'\n[[prefill]]\nname='p'\nhost='h'\ngpus=1\n[[decode]]\nname='d'\nhost='h'\n",
     "prefill 'p': gpus applies to device \"cuda\", not 'cpu'"),
    ("[deployment]\nmodel='tiny-llama'\ndevice='cuda'\n[[prefill]]\nname='p'\nhost='h'\ntp=2\nnodes=2\n[[decode]]\n"
     "name='d'\nhost='h'\n", "nodes 2 on device \"cuda\": the launcher places a TP group on one machine's GPUs only"),
    ("[deployment]\nmodel='tiny-llama'\nmemory='16GB'\n", "deployment.memory: '16GB' is not a Kubernetes quantity"),
    ("[deployment]\nmodel='tiny-llama'\ncpu=0\n", "deployment.cpu: 0 must be > 0"),
]


@pytest.mark.parametrize("text,reason", BAD, ids=[r for _, r in BAD])
def test_a_bad_file_names_the_field_and_the_reason(tmp_path, text, reason):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(DeploymentError) as err:
        load(path)
    assert reason in str(err.value) and str(path) in str(err.value)


def test_an_unknown_node_is_refused_with_the_known_ones():
    with pytest.raises(DeploymentError, match="no node named 'decode-9'.*decode-2, router"):
        load(EXAMPLE).launch_config("decode-9")


def _k8s_args(container: dict, env: dict[str, str]) -> list[str]:
    args = container["args"]
    assert container["command"] + args[:2] == ["python", "-m", "sglang_disagg.launch"]
    out = []
    for a in args[2:]:
        for k, v in env.items():
            a = a.replace(f"$({k})", v)
        out.append(a)
    return out


def test_kubernetes_manifests_run_the_launcher_with_each_nodes_configuration():
    dep = load(EXAMPLE)
    docs = list(yaml.safe_load_all(yaml.safe_dump_all(kubernetes(dep, "serving"), sort_keys=False)))
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    workloads = {d["metadata"]["name"]: d for d in docs if d["kind"] in ("LeaderWorkerSet", "Deployment")}
    assert sorted(workloads) == sorted(NODES) and sorted(services) == sorted(NODES)
    assert all(d["metadata"]["namespace"] == "serving" for d in docs)
    for name, w in workloads.items():
        if w["kind"] == "LeaderWorkerSet":
            template = w["spec"]["leaderWorkerTemplate"]
            assert template["size"] == dep.group(name).nodes
            # one machine: the leader is made from workerTemplate (LWS requires it)
            container = template.get("leaderTemplate", template["workerTemplate"])["spec"]["containers"][0]
            secret = [e for e in container["env"] if e["name"] == "SGLANG_DISAGG_SECRET"]
            assert secret[0]["valueFrom"]["secretKeyRef"] == {"name": "sglang-disagg-secret", "key": "secret"}
        else:
            container = w["spec"]["template"]["spec"]["containers"][0]
        cfg, _ = parse(_k8s_args(container, {"POD_IP": "10.9.9.9"}))
        want = load(EXAMPLE).launch_config(name)
        assert (cfg.role, cfg.mode, cfg.transfer_backend, cfg.transfer_provider, cfg.port, cfg.host) == (
            want.role, want.mode, want.transfer_backend, want.transfer_provider, want.port, "10.9.9.9")
        ports = cfg.ports.all(cfg.role, cfg.mode)
        assert sorted(p["containerPort"] for p in container["ports"]) == sorted(ports.values())
        assert sorted(p["port"] for p in services[name]["spec"]["ports"]) == sorted(ports.values())
        # Peers are named by their Service, on a port that Service exposes.
        for address in cfg.prefill_messengers + tuple(u.split("//")[1] for u in cfg.decode_urls):
            host, port = address.split(":")
            assert int(port) in [p["port"] for p in services[host]["spec"]["ports"]]


def test_a_multi_node_group_is_a_leader_worker_set_with_sglangs_multi_node_flags(tmp_path):
    doc = __import__("tomllib").loads(EXAMPLE.read_text())
    doc["deployment"]["model"] = "tiny-llama"  # 4 heads / 2 KV heads: TP 2 shards it
    doc["prefill"][0] |= {"tp": 2, "nodes": 2}
    dep = parse_doc(doc)
    lws = next(d for d in kubernetes(dep) if d["metadata"]["name"] == "prefill-0")
    template = lws["spec"]["leaderWorkerTemplate"]
    leader = template["leaderTemplate"]["spec"]["containers"][0]["args"]
    worker = template["workerTemplate"]["spec"]["containers"][0]["args"]
    assert template["size"] == 2
    assert leader[leader.index("--node-rank") + 1] == "0"
    assert worker[worker.index("--node-rank") + 1] == "$(LWS_WORKER_INDEX)"
    assert worker[worker.index("--dist-init-addr") + 1] == "$(LWS_LEADER_ADDRESS):30004"


def test_the_slurm_script_starts_each_node_on_its_machine_with_its_configuration(tmp_path):
    dep = load(EXAMPLE)
    script = tmp_path / "stack.sbatch"
    script.write_text(slurm(dep))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # Stand-ins for Slurm's tools (no cluster here): scontrol lists 5 machines, srun records its argv.
    (bin_dir / "scontrol").write_text("#!/bin/sh\nprintf 'n0\\nn1\\nn2\\nn3\\nn4\\n'\n")
    (bin_dir / "srun").write_text('#!/bin/sh\nt=$(mktemp -p "$SRUN_LOG" .partXXXX)\nprintf "%s\\0" "$@" > "$t"\n'
                                  'mv "$t" "$SRUN_LOG/call${t##*.part}"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    log = tmp_path / "srun"
    log.mkdir()
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_NODELIST="n[0-4]", SLURM_JOB_ID="41", SRUN_LOG=str(log))
    # The script ends (exit 1) as soon as one of its processes ends; the others may still be writing.
    subprocess.run(["bash", str(script)], env=env, timeout=30, cwd=tmp_path)
    deadline = time.monotonic() + 10
    while True:
        calls = [f.read_text().rstrip("\0").split("\0") for f in log.glob("call*")]
        if len(calls) >= len(NODES) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert len(calls) == len(NODES)
    # The job's secret is gone once the job ended (while it runs: the test below).
    assert not list(tmp_path.glob(".sglang-disagg-secret.*"))
    machines = {"prefill-0": "n0", "decode-0": "n1", "decode-1": "n2", "decode-2": "n3", "router": "n4"}
    by_host = {}
    for argv in calls:
        host = argv[argv.index("-w") + 1]
        launch = argv.index("sglang_disagg.launch")
        by_host[host], _ = parse(argv[launch + 1:])
    for name, host in machines.items():
        cfg, want = by_host[host], dep.launch_config(name)
        assert (cfg.role, cfg.host, cfg.transfer_backend, cfg.transfer_provider, cfg.ports) == (
            want.role, host, want.transfer_backend, want.transfer_provider, want.ports)
    assert {h: c.log_dir for h, c in by_host.items()} == {h: f"logs/sglang-disagg-41/{n}" for n, h in machines.items()}
    assert by_host["n1"].prefill_messengers == ("n0:30003",)
    assert by_host["n4"].decode_urls == tuple(f"http://n{i}:30002" for i in (1, 2, 3))
    assert shlex.split(script.read_text().splitlines()[0]) == ["#!/usr/bin/env", "bash"]


# Stand-ins that run what the script gives them: srun runs its command once per task with the
# task's SLURM_PROCID; the launcher (.venv/bin/python, relative to the job's directory) records
# the secret file it was given (its mode) and its argv, then waits to be released.
SRUN = """#!/bin/bash
n=1
while [ $# -gt 0 ]; do
  case "$1" in --ntasks=*) n="${1#--ntasks=}"; shift;; --nodes=*) shift;; -w) shift 2;; *) break;; esac
done
for ((i = 0; i < n; i++)); do SLURM_PROCID=$i "$@" & done
wait
"""
LAUNCHER = """#!/bin/bash
t=$(mktemp -p "$CALL_LOG" .partXXXX)
{ stat -c '%a' "$SGLANG_DISAGG_SECRET_FILE"; echo "$SGLANG_DISAGG_SECRET_FILE"; printf '%s\\0' "$@"; } > "$t"
mv "$t" "$CALL_LOG/call${t##*.part}"
for ((i = 0; i < 600; i++)); do [ -e "$RELEASE" ] && exit 0; sleep 0.05; done
"""


@pytest.mark.parametrize("ending", ["a process exits", "scancel (TERM)"])
def test_the_slurm_script_runs_nothing_from_the_file_and_removes_its_secret_when_the_job_ends(tmp_path, ending):
    doc = __import__("tomllib").loads(EXAMPLE.read_text())
    canaries = [tmp_path / f"ran-{i}" for i in range(4)]
    hostile = [f"$(touch {canaries[0]})", f"`touch {canaries[1]}`", f"\"$(touch {canaries[2]})\"",
               f"'; touch {canaries[3]}; '", "$SLURM_PROCID", "${HOME}"]
    doc["deployment"] |= {"model": "tiny-llama", "extra_args": ["--served-model-name", *hostile]}
    doc["prefill"][0] |= {"tp": 2, "nodes": 2}  # a multi-node group: its command runs under bash -c
    doc["decode"] = doc["decode"][:1]
    script = tmp_path / "job.sbatch"
    script.write_text(slurm(parse_doc(doc)))
    bin_dir, venv, log = tmp_path / "bin", tmp_path / ".venv" / "bin", tmp_path / "calls"
    for d in (bin_dir, venv, log):
        d.mkdir(parents=True)
    for path, text in ((bin_dir / "srun", SRUN), (bin_dir / "scontrol", "#!/bin/sh\nprintf 'n0\\nn1\\nn2\\nn3\\n'\n"),
                       (venv / "python", LAUNCHER)):
        path.write_text(text)
        path.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SGLANG_DISAGG_SECRET", "SLURM_"))}
    env |= {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "n[0-3]", "SLURM_JOB_ID": "42",
            "CALL_LOG": str(log), "RELEASE": str(tmp_path / "release")}
    job = subprocess.Popen(["bash", str(script)], env=env, cwd=tmp_path, start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while len(list(log.glob("call*"))) < 4 and time.monotonic() < deadline and job.poll() is None:
            time.sleep(0.05)
        calls = [f.read_text().split("\n", 2) for f in log.glob("call*")]
        assert not [c for c in canaries if c.exists()], "a value from the deployment file ran"
        assert len(calls) == 4, f"{len(calls)} launcher calls (job exit status {job.poll()})"
        secrets = list(tmp_path.glob(".sglang-disagg-secret.42.*"))  # one per job, private, for every server
        assert len(secrets) == 1 and stat_mode(secrets[0]) == 0o600 and len(secrets[0].read_text().strip()) == 64
        assert {(mode, path) for mode, path, _ in calls} == {("600", str(secrets[0]))}
        if ending == "a process exits":
            (tmp_path / "release").touch()
            assert job.wait(20) == 1
        else:
            job.send_signal(signal.SIGTERM)  # the batch shell only, as Slurm signals it
            assert job.wait(20) == 143
        assert not secrets[0].exists() and not list(tmp_path.glob(".sglang-disagg-secret*"))
    finally:
        (tmp_path / "release").touch()
        with contextlib.suppress(ProcessLookupError):  # the whole group may have exited already
            os.killpg(job.pid, signal.SIGKILL)
        job.wait(5)
    argvs = [argv.rstrip("\0").split("\0") for _, _, argv in calls]
    for argv in argvs:  # every value from the file arrives as written, nothing of it ran
        i = argv.index("--served-model-name")
        assert argv[i + 1:i + 1 + len(hostile)] == hostile
    assert not [c for c in canaries if c.exists()]
    # The script's own variables expanded: the machines, and each task's rank.
    prefill = [parse(a)[0] for a in argvs if "--nnodes" in a]
    assert sorted(a[a.index("--node-rank") + 1] for a in argvs if "--nnodes" in a) == ["0", "1"]
    # each node of a multi-node group logs apart, beside the job's output
    assert sorted(c.log_dir for c in prefill) == [f"logs/sglang-disagg-42/prefill-0-{r}" for r in (0, 1)]
    assert {c.host for c in prefill} == {"n0"} and all(
        a[a.index("--dist-init-addr") + 1] == "n0:30004" for a in argvs if "--nnodes" in a)
    by_role = {c.role: c for c in (parse(a)[0] for a in argvs)}
    assert by_role[Role.DECODE].host == "n2" and by_role[Role.DECODE].prefill_messengers == ("n0:30003",)
    assert by_role[Role.ROUTER].host == "n3" and by_role[Role.ROUTER].decode_urls == ("http://n2:30002",)


def stat_mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def test_a_slurm_job_refuses_to_put_its_secret_where_others_could_swap_it(tmp_path):
    job_dir = tmp_path / "shared"
    job_dir.mkdir()
    job_dir.chmod(0o775)
    script = job_dir / "job.sbatch"
    script.write_text(slurm(load(EXAMPLE)))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\nprintf 'n0\\nn1\\nn2\\nn3\\nn4\\n'\n")
    (bin_dir / "srun").write_text("#!/bin/sh\ntouch started\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_NODELIST="n[0-4]", SLURM_JOB_ID="43")
    r = subprocess.run(["bash", str(script)], env=env, cwd=job_dir, timeout=30, capture_output=True, text=True)
    assert r.returncode == 2 and "others could swap the job's secret here" in r.stderr
    assert sorted(p.name for p in job_dir.iterdir()) == ["job.sbatch"]  # no secret, nothing started


def test_a_named_secret_file_is_quoted_and_kept_and_a_bad_time_limit_refused():
    doc = __import__("tomllib").loads(EXAMPLE.read_text())
    doc["deployment"]["secret_file"] = "/shared/$(id)/secret"
    text = slurm(parse_doc(doc))
    assert "--secret-file '/shared/$(id)/secret'" in text and "mktemp" not in text and "rm -f" not in text
    with pytest.raises(ValueError, match="--time"):
        slurm(load(EXAMPLE), "1:00:00\nrm -rf ~")


def test_each_decoder_pod_drains_into_the_other_decoders_before_it_stops():
    """Three decoders: each pod's stop runs `launch drain` (preStop) toward the router's other
    decoders, with a termination grace covering the drain and the relayed streams; its launcher
    migrates on SIGTERM too (--drain-mode migrate), naming itself as the router lists it."""
    from sglang_disagg.launch.config import DrainMode
    from sglang_disagg.launch.drain import RELAYS_MAX_S

    dep = load(EXAMPLE)
    docs = kubernetes(dep)
    router_cfg, _ = parse(_k8s_args(next(d for d in docs if d["metadata"]["name"] == "router")["spec"]["template"]
                                    ["spec"]["containers"][0], {"POD_IP": "10.9.9.9"}))
    for g in dep.of(Role.DECODE):
        spec = next(d for d in docs if d["metadata"]["name"] == g.name)["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]
        container = spec["containers"][0]
        cfg, _ = parse(_k8s_args(container, {"POD_IP": "10.9.9.9"}))
        assert (cfg.drain_mode, cfg.router_url, cfg.member) == (DrainMode.MIGRATE, "http://router:30000",
                                                                f"http://{g.name}:30002")
        assert cfg.member in router_cfg.decode_urls  # the name the router's worker list knows it by
        sh, flag, script = container["lifecycle"]["preStop"]["exec"]["command"]
        argv = shlex.split(script.replace('"$POD_IP"', "10.9.9.9"))
        assert (sh, flag, argv[:5]) == ("sh", "-c", ["exec", "python", "-m", "sglang_disagg.launch", "drain"])
        got = dict(zip(argv[5::2], argv[6::2]))
        assert got == {"--port": "30000", "--router": "http://router:30000", "--member-url": cfg.member,
                       "--timeout": "30", "--host": "10.9.9.9"}
        assert spec["terminationGracePeriodSeconds"] >= cfg.drain_timeout_s + RELAYS_MAX_S
    prefill = next(d for d in docs if d["metadata"]["name"] == "prefill-0")["spec"]["leaderWorkerTemplate"]
    assert "lifecycle" not in prefill["workerTemplate"]["spec"]["containers"][0]
    doc = __import__("tomllib").loads(EXAMPLE.read_text())
    doc["decode"] = doc["decode"][:1]  # one decoder: nowhere to migrate to, it drains by waiting
    one = parse_doc(doc)
    assert one.launch_config("decode-0").drain_mode is DrainMode.WAIT
    lws = next(d for d in kubernetes(one) if d["metadata"]["name"] == "decode-0")["spec"]["leaderWorkerTemplate"]
    assert "lifecycle" not in lws["workerTemplate"]["spec"]["containers"][0]
    script = slurm(dep)
    assert "scancel --signal=TERM" in script and "while wait -n; do :; done" in script
    assert '--drain-mode migrate --router http://"${ROUTER}":30000' in script
