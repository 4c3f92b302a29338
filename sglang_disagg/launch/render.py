"""Render a deployment file (deploy.py) for an orchestrator:

    python -m sglang_disagg.launch render k8s   FILE [--namespace NS]  > stack.yaml
    python -m sglang_disagg.launch render slurm FILE [--time 04:00:00] > stack.sbatch

Every process runs the same launcher with flags computed from the same LaunchConfig the
launcher builds for ``--config FILE --node NAME`` (``launcher_argv`` is the inverse of the
launcher's parser, and the tests hold it to that), so ports, roles and backend settings
cannot drift between the launcher and the manifests.

Kubernetes: one LeaderWorkerSet per group (size = the group's machines; the leader is the
TP group's node rank 0 and serves), a Service per group in front of its leader (peers
reach it by the group's name), and the router as a Deployment + Service. Pods bind their
own pod IP. Slurm: one job, one machine per group member plus one for the router; the
group -> machine assignment is made from $SLURM_JOB_NODELIST when the job starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys

from ..backends.auth import SECRET_ENV, SECRET_FILE_ENV
from .config import LaunchConfig, Role
from .deploy import ROUTER, Deployment, Group, load

K8S_SECRET = "sglang-disagg-secret"
LAUNCH = [".venv/bin/python", "-m", "sglang_disagg.launch"]
CONTAINER_LAUNCH = ["python", "-m", "sglang_disagg.launch"]


def launcher_argv(cfg: LaunchConfig) -> list[str]:
    """Launcher flags that rebuild `cfg` (defaults left out)."""
    defaults = {f.name: f.default for f in dataclasses.fields(LaunchConfig)}
    argv = ["--role", cfg.role.value, "--model-path", cfg.model]
    for flag, field in (("--port", "port"), ("--host", "host"), ("--mode", "mode"), ("--backend", "backend"),
                        ("--provider", "provider"), ("--device", "device"), ("--prefill-tp", "prefill_tp"),
                        ("--decode-tp", "decode_tp"), ("--dtype", "dtype"), ("--max-total-tokens", "max_total_tokens"),
                        ("--page-size", "page_size"), ("--transfer-timeout", "transfer_timeout_s"),
                        ("--link-recheck", "link_recheck_s"), ("--sse-keepalive-secs", "sse_keepalive_s"),
                        ("--startup-timeout", "startup_timeout_s"), ("--drain-timeout", "drain_timeout_s"),
                        ("--secret-file", "secret_file"), ("--attention-backend", "attention_backend"),
                        ("--gpus", "gpus"), ("--shared-gpu-fraction", "shared_gpu_fraction")):
        value = getattr(cfg, field)
        if value != defaults[field]:
            argv += [flag, str(getattr(value, "value", value))]
    for flag, field in (("--prefill-url", "prefill_urls"), ("--decode-url", "decode_urls"),
                        ("--prefill-messenger", "prefill_messengers")):
        for v in getattr(cfg, field):
            argv += [flag, v]
    for flag, field in (("--prefill-gpus", "prefill_gpus"), ("--decode-gpus", "decode_gpus")):
        if getattr(cfg, field):
            argv += [flag, ",".join(map(str, getattr(cfg, field)))]
    if cfg.deterministic:
        argv.append("--enable-deterministic-inference")
    if not cfg.stream:
        argv.append("--no-stream")
    if not cfg.reuse_prefix:
        argv.append("--no-decode-prefix-reuse")
    if cfg.pin_cores:
        argv.append("--pin-cores")
    return argv + list(cfg.extra_args)


def _multinode(g: Group, leader: str, rank: str, dist_port: int) -> list[str]:
    """SGLang's own multi-node TP flags, passed through to the server."""
    if g.nodes == 1:
        return []
    return ["--nnodes", str(g.nodes), "--node-rank", rank, "--dist-init-addr", f"{leader}:{dist_port}"]


def _dist_port(dep: Deployment, g: Group) -> int:
    return dep.ports.prefill_dist if g.role is Role.PREFILL else dep.ports.decode_dist


# ----------------------------------------------------------------------------- Kubernetes

def _container(name: str, image: str, argv: list[str], ports: dict[str, int]) -> dict:
    return {"name": name, "image": image, "command": CONTAINER_LAUNCH[:1], "args": CONTAINER_LAUNCH[1:] + argv,
            "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
            "ports": [{"name": _port_name(what), "containerPort": port} for what, port in ports.items()]}


def _port_name(what: str) -> str:  # a Kubernetes port name: <= 15 chars, lowercase, '-'
    words = what.replace("dist-init", "dist").split()
    return "-".join(w[:7] for w in words)[:15]


def _service(name: str, selector: dict, ports: dict[str, int], namespace: str) -> dict:
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": namespace},
            "spec": {"selector": selector,
                     "ports": [{"name": _port_name(w), "port": p, "targetPort": p} for w, p in ports.items()]}}


def kubernetes(dep: Deployment, namespace: str = "default") -> list[dict]:
    k8s = dataclasses.replace(dep, groups=tuple(dataclasses.replace(g, host=g.name) for g in dep.groups),
                              router_host=ROUTER,  # peers find each other through the Services
                              secret_file=None)  # and the secret comes from a Kubernetes Secret
    docs: list[dict] = []
    for g in k8s.groups:
        cfg = k8s.launch_config(g.name, host="$(POD_IP)")
        ports = cfg.ports.all(g.role, cfg.mode)
        base = launcher_argv(cfg)
        dist = _dist_port(k8s, g)
        leader = _container(g.role.value, dep.image, base + _multinode(g, "$(LWS_LEADER_ADDRESS)", "0", dist), ports)
        worker = _container(g.role.value, dep.image,
                            base + _multinode(g, "$(LWS_LEADER_ADDRESS)", "$(LWS_WORKER_INDEX)", dist), ports)
        for c in (leader, worker):  # kubectl create secret generic sglang-disagg-secret --from-literal=secret=...
            c["env"].append({"name": SECRET_ENV, "valueFrom": {"secretKeyRef": {"name": K8S_SECRET, "key": "secret"}}})
        labels = {"app.kubernetes.io/part-of": "sglang-disagg", "sglang-disagg/role": g.role.value}
        template = {"size": g.nodes, "leaderTemplate": {"metadata": {"labels": labels},
                                                        "spec": {"containers": [leader]}}}
        if g.nodes > 1:
            template["workerTemplate"] = {"metadata": {"labels": labels}, "spec": {"containers": [worker]}}
        docs.append({"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet",
                     "metadata": {"name": g.name, "namespace": namespace},
                     "spec": {"replicas": 1, "leaderWorkerTemplate": template}})
        docs.append(_service(g.name, {"leaderworkerset.sigs.k8s.io/name": g.name,
                                      "leaderworkerset.sigs.k8s.io/worker-index": "0"}, ports, namespace))
    cfg = k8s.launch_config(ROUTER, host="$(POD_IP)")
    ports = cfg.ports.all(Role.ROUTER, cfg.mode)
    labels = {"app.kubernetes.io/part-of": "sglang-disagg", "sglang-disagg/role": ROUTER}
    docs.append({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": ROUTER, "namespace": namespace},
                 "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                          "template": {"metadata": {"labels": labels},
                                       "spec": {"containers": [_container(ROUTER, dep.image, launcher_argv(cfg),
                                                                          ports)]}}}})
    docs.append(_service(ROUTER, labels, ports, namespace))
    return docs


# ----------------------------------------------------------------------------- Slurm

def _var(name: str) -> str:
    return name.upper().replace("-", "_")


def _sh(argv: list[str]) -> str:
    """Shell words: literals quoted, "$VAR" references expanded."""
    return " ".join(f'"{a}"' if "$" in a else shlex.quote(a) for a in argv)


def slurm(dep: Deployment, time_limit: str = "04:00:00") -> str:
    machines = sum(g.nodes for g in dep.groups) + 1
    lines = ["#!/usr/bin/env bash", "#SBATCH --job-name=sglang-disagg", f"#SBATCH --nodes={machines}",
             "#SBATCH --ntasks-per-node=1", "#SBATCH --exclusive", f"#SBATCH --time={time_limit}",
             "# Rendered by: python -m sglang_disagg.launch render slurm. Run from the repository root",
             "# (after `make setup` on a shared filesystem).",
             "set -euo pipefail", 'mapfile -t HOSTS < <(scontrol show hostnames "$SLURM_JOB_NODELIST")']
    i = 0
    for g in dep.groups:  # exported: a multi-node group's tasks expand them on their machine
        v = _var(g.name)
        lines.append(f'export {v}="${{HOSTS[{i}]}}" {v}_NODES="$(IFS=,; echo "${{HOSTS[*]:{i}:{g.nodes}}}")"')
        i += g.nodes
    lines += [f'export ROUTER="${{HOSTS[{i}]}}"']
    if not dep.secret_file:  # one fresh secret per job, on the shared filesystem, for every server
        lines += [f'export {SECRET_FILE_ENV}="$PWD/.sglang-disagg-secret.${{SLURM_JOB_ID:-$$}}"',
                  f'(umask 077; python3 -c "import secrets; print(secrets.token_hex(32))" > "${SECRET_FILE_ENV}")']
    lines.append("")
    slurm_dep = dataclasses.replace(dep, groups=tuple(dataclasses.replace(g, host=f"${_var(g.name)}")
                                                      for g in dep.groups), router_host="$ROUTER")
    for g in slurm_dep.groups:
        argv = LAUNCH + launcher_argv(slurm_dep.launch_config(g.name))
        if g.nodes == 1:
            lines.append(f'srun --nodes=1 --ntasks=1 -w "{g.host}" {_sh(argv)} &')
        else:  # the node rank is the task's rank, expanded on each machine
            argv += _multinode(g, g.host, "$SLURM_PROCID", _dist_port(dep, g))
            lines.append(f'srun --nodes={g.nodes} --ntasks={g.nodes} -w "${_var(g.name)}_NODES" '
                         f'bash -c {shlex.quote(_sh(argv))} &')
    lines.append(f'srun --nodes=1 --ntasks=1 -w "$ROUTER" '
                 f'{_sh(LAUNCH + launcher_argv(slurm_dep.launch_config(ROUTER)))} &')
    lines += ["wait -n  # the first process to exit ends the job", "exit 1", ""]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m sglang_disagg.launch render")
    ap.add_argument("target", choices=["k8s", "slurm"])
    ap.add_argument("config")
    ap.add_argument("--namespace", default="default")
    ap.add_argument("--time", default="04:00:00", help="Slurm time limit")
    args = ap.parse_args(argv)
    try:
        dep = load(args.config)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.target == "k8s":
        import yaml

        sys.stdout.write(yaml.safe_dump_all(kubernetes(dep, args.namespace), sort_keys=False))
    else:
        sys.stdout.write(slurm(dep, args.time))
    return 0

