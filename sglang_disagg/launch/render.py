"""Render a deployment file (deploy.py) for an orchestrator:

    python -m sglang_disagg.launch render k8s   FILE [--namespace NS] [--validate] > stack.yaml
    python -m sglang_disagg.launch render ome   FILE [--name NAME] [--validate]   > ome.yaml
    python -m sglang_disagg.launch render slurm FILE [--time 04:00:00] > stack.sbatch

Every process runs the same launcher with flags computed from the same LaunchConfig the
launcher builds for ``--config FILE --node NAME`` (``pods.launcher_argv`` is the inverse of
the launcher's parser, and the tests hold it to that), so ports, roles and backend settings
cannot drift between the launcher and the manifests.

Kubernetes: one LeaderWorkerSet per group (size = the group's machines; the leader is the
TP group's node rank 0 and serves), a Service per group in front of its leader (peers
reach it by the group's name), and the router as a Deployment + Service. Pods bind their
own pod IP; containers, resources, probes and the secret: pods.py. OME: render_ome.py.
``--validate`` checks what is rendered against the pinned schemas (validate_manifests.py).
Slurm: one job, one machine per group member plus one for the router; the group -> machine
assignment is made from $SLURM_JOB_NODELIST when the job starts. Every value that comes from
the deployment file is single-quoted (shlex.quote), so nothing in it runs or expands; only the
script's own variables (the machines, $SLURM_PROCID) expand, spliced in between the quoted
parts. A secret the script makes for the job (none named in the file) is 0600, in a directory
nobody else can rename entries in, and removed when the job ends (TERM and INT end it).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import shlex
import sys

from ..backends.auth import SECRET_FILE_ENV
from . import pods
from .config import LaunchConfig
from .deploy import ROUTER, Deployment, load
from .pods import dist_port, launcher_argv, multinode_flags

LAUNCH = [".venv/bin/python", "-m", "sglang_disagg.launch"]


# ----------------------------------------------------------------------------- Kubernetes

def _service(name: str, selector: dict, cfg: LaunchConfig, namespace: str) -> dict:
    ports = [{"name": p["name"], "port": p["containerPort"], "targetPort": p["containerPort"], "protocol": "TCP"}
             for p in pods.container_ports(cfg, serving=True)]
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": namespace},
            "spec": {"selector": selector, "ports": ports}}


def for_cluster(dep: Deployment) -> Deployment:
    """The deployment as pods see it: peers named by their Services, the secret from a Secret."""
    return dataclasses.replace(dep, groups=tuple(dataclasses.replace(g, host=g.name) for g in dep.groups),
                               router_host=ROUTER, secret_file=None)


def kubernetes(dep: Deployment, namespace: str = "default") -> list[dict]:
    k8s = for_cluster(dep)
    docs: list[dict] = []
    for g in k8s.groups:
        cfg = k8s.launch_config(g.name, host="$(POD_IP)")
        base, dist = launcher_argv(cfg), dist_port(k8s, g)
        resources = pods.server_resources(dep, g)
        leader = pods.container(g.role.value, dep.image, cfg,
                                base + multinode_flags(g, "$(LWS_LEADER_ADDRESS)", "0", dist), resources)
        labels = {"app.kubernetes.io/part-of": "sglang-disagg", "sglang-disagg/role": g.role.value}
        pod = {"tolerations": [pods.GPU_TOLERATION]} if dep.device == "cuda" else {}
        # LWS v1 requires workerTemplate; a one-machine group is its leader alone, made from it.
        template = {"size": g.nodes, "workerTemplate": {"metadata": {"labels": labels},
                                                        "spec": pod | {"containers": [leader]}}}
        if g.nodes > 1:
            worker = pods.container(g.role.value, dep.image, cfg, base + multinode_flags(
                g, "$(LWS_LEADER_ADDRESS)", "$(LWS_WORKER_INDEX)", dist), resources, serving=False)
            template["leaderTemplate"] = template["workerTemplate"]
            template["workerTemplate"] = {"metadata": {"labels": labels}, "spec": pod | {"containers": [worker]}}
        docs.append({"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet",
                     "metadata": {"name": g.name, "namespace": namespace},
                     "spec": {"replicas": 1, "leaderWorkerTemplate": template}})
        docs.append(_service(g.name, {"leaderworkerset.sigs.k8s.io/name": g.name,
                                      "leaderworkerset.sigs.k8s.io/worker-index": "0"}, cfg, namespace))
    cfg, volumes = pods.with_tls_secret(k8s.launch_config(ROUTER, host="$(POD_IP)"))
    labels = {"app.kubernetes.io/part-of": "sglang-disagg", "sglang-disagg/role": ROUTER}
    router = pods.container(ROUTER, dep.image, cfg, launcher_argv(cfg), pods.router_resources())
    pod = {"containers": [router]} | ({"volumes": volumes} if volumes else {})
    docs.append({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": ROUTER, "namespace": namespace},
                 "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                          "template": {"metadata": {"labels": labels}, "spec": pod}}})
    docs.append(_service(ROUTER, labels, cfg, namespace))
    return docs


# ----------------------------------------------------------------------------- Slurm

_MARK = "\0"  # brackets one of the script's own variables inside a value (no TOML string holds one: checked)
_TIME = re.compile(r"^([0-9]+(-[0-9]+)?(:[0-9]+){0,2}|UNLIMITED|INFINITE)$")  # sbatch --time's forms


def _var(name: str) -> str:
    return name.upper().replace("-", "_")


def _ref(name: str) -> str:
    """The script's own variable `name`, to expand where it stands inside a value."""
    return f"{_MARK}{name}{_MARK}"


def _word(arg: str, own: set[str]) -> str:
    """One shell word: the literal parts single-quoted, the script's own variables (`_ref`, one
    of `own`) as "${NAME}" between them: 'http://'"${DECODE_0}"':30002'."""
    parts = arg.split(_MARK)
    if len(parts) % 2 == 0 or any(name not in own for name in parts[1::2]):
        raise ValueError(f"a value holds a NUL character: {arg!r}")
    words = [f'"${{{p}}}"' if i % 2 else shlex.quote(p) for i, p in enumerate(parts) if i % 2 or p]
    return "".join(words) or "''"


def _sh(argv: list[str], own: set[str]) -> str:
    return " ".join(_word(a, own) for a in argv)


def _strings(value: object) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, (tuple, list)):
        return [s for v in value for s in _strings(v)]
    return []


# The directory of the job's secret: ours (or root's), and nobody else may rename entries in it
# unless it is sticky (the launcher's rule for its private files, sglang_disagg/private_files.py).
_PRIVATE_DIR = [
    "read -r owner mode < <(stat -Lc '%u %a' .)",
    'if ! [ "$owner" = "$EUID" -o "$owner" = 0 ] || (( (8#$mode & 8#022) && !(8#$mode & 8#1000) )); then',
    '  echo "error: $PWD (owner $owner, mode $mode): others could swap the job\'s secret here; submit from a" \\',
    '       "directory only you can write, or name a secret_file in the deployment file" >&2',
    "  exit 2",
    "fi"]


def slurm(dep: Deployment, time_limit: str = "04:00:00") -> str:
    if not _TIME.match(time_limit):
        raise ValueError(f"--time {time_limit!r}: not one of sbatch's time forms (e.g. 04:00:00, 2-00:00:00)")
    if any(_MARK in s for s in _strings(dataclasses.astuple(dep))):
        raise ValueError("the deployment file holds a NUL character in a value")
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
        lines += ["# The job's secret: 0600 under a name nobody could plant (mktemp), gone when the job ends.",
                  'SECRET_MADE=""', """trap '[ -z "$SECRET_MADE" ] || rm -f -- "$SECRET_MADE"' EXIT""",
                  "trap 'exit 143' TERM  # scancel, the time limit: exit, so the EXIT trap runs",
                  "trap 'exit 130' INT", *_PRIVATE_DIR,
                  'SECRET_MADE="$(mktemp "$PWD/.sglang-disagg-secret.${SLURM_JOB_ID:-$$}.XXXXXXXX")"',
                  f'export {SECRET_FILE_ENV}="$SECRET_MADE"',
                  "python3 -c 'import secrets; print(secrets.token_hex(32))' > \"$SECRET_MADE\""]
    lines.append("")
    own = {_var(g.name) for g in dep.groups} | {"ROUTER", "SLURM_PROCID"}
    slurm_dep = dataclasses.replace(dep, groups=tuple(dataclasses.replace(g, host=_ref(_var(g.name)))
                                                      for g in dep.groups), router_host=_ref("ROUTER"))
    for g in slurm_dep.groups:
        argv = LAUNCH + launcher_argv(slurm_dep.launch_config(g.name))
        v = _var(g.name)
        if g.nodes == 1:
            lines.append(f'srun --nodes=1 --ntasks=1 -w "${v}" {_sh(argv, own)} &')
        else:  # the node rank is the task's rank, expanded on each machine
            argv += multinode_flags(g, g.host, _ref("SLURM_PROCID"), dist_port(dep, g))
            lines.append(f'srun --nodes={g.nodes} --ntasks={g.nodes} -w "${v}_NODES" '
                         f'bash -c {shlex.quote(_sh(argv, own))} &')
    lines.append(f'srun --nodes=1 --ntasks=1 -w "$ROUTER" '
                 f'{_sh(LAUNCH + launcher_argv(slurm_dep.launch_config(ROUTER)), own)} &')
    lines += ["wait -n  # the first process to exit ends the job", "exit 1", ""]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m sglang_disagg.launch render")
    ap.add_argument("target", choices=["k8s", "ome", "slurm"])
    ap.add_argument("config")
    ap.add_argument("--namespace", default="default")
    ap.add_argument("--name", default="sglang-disagg", help="OME: the InferenceService's name")
    ap.add_argument("--time", default="04:00:00", help="Slurm time limit")
    ap.add_argument("--validate", action="store_true",
                    help="k8s/ome: check every object against its pinned schema and the structural rules "
                         "(validate_manifests.py) before printing; exit 1 naming what fails")
    args = ap.parse_args(argv)
    try:
        dep = load(args.config)
        if args.target == "slurm":
            sys.stdout.write(slurm(dep, args.time))
            return 0
        if args.target == "k8s":
            docs = kubernetes(dep, args.namespace)
        else:
            from .render_ome import ome

            docs = ome(dep, args.name, args.namespace)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.validate:
        from .validate_manifests import problems

        found = problems(docs, dep.device)
        if found:
            print("error: the rendered manifests fail validation:\n" + "\n".join(f"  {p}" for p in found),
                  file=sys.stderr)
            return 1
    sys.stdout.write(to_yaml(docs))
    return 0


def to_yaml(docs: list[dict]) -> str:
    """The documents as YAML, each written out in full (no &anchors where a rendering reuses
    a dict: a reader of the manifest should not have to follow them)."""
    import yaml

    class Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data: object) -> bool:
            return True

    return yaml.dump_all(docs, Dumper=Dumper, sort_keys=False)
