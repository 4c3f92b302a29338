"""``render slurm FILE``: a deployment file (deploy.py) as one Slurm batch script.

One job, one machine per group member plus one for the router; the group -> machine
assignment is made from $SLURM_JOB_NODELIST when the job starts. Every process runs the
launcher with flags computed from the LaunchConfig the launcher builds for ``--config FILE
--node NAME`` (``pods.launcher_argv``). Every value that comes from the deployment file is
single-quoted (shlex.quote), so nothing in it runs or expands; only the script's own variables
(the machines, $SLURM_PROCID) expand, spliced in between the quoted parts. A secret the script
makes for the job (none named in the file) is 0600, in a directory nobody else can rename
entries in, and removed when the job ends (TERM and INT end it).
"""

from __future__ import annotations

import dataclasses
import re
import shlex

from ..backends.auth import SECRET_FILE_ENV
from .config import DrainMode, Role
from .deploy import ROUTER, Deployment
from .pods import dist_port, launcher_argv, multinode_flags

LAUNCH = [".venv/bin/python", "-m", "sglang_disagg.launch"]

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


def _log_dir(name: str) -> str:
    """Each node's logs (and its key files) beside the job's own output, on the shared file
    system: logs/sglang-disagg-<job id>/<node>, not a temporary directory on each machine."""
    return f"logs/sglang-disagg-{_ref('SLURM_JOB_ID')}/{name}"


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
    own = {_var(g.name) for g in dep.groups} | {"ROUTER", "SLURM_PROCID", "SLURM_JOB_ID"}
    slurm_dep = dataclasses.replace(dep, groups=tuple(dataclasses.replace(g, host=_ref(_var(g.name)))
                                                      for g in dep.groups), router_host=_ref("ROUTER"))
    for g in slurm_dep.groups:
        argv = LAUNCH + launcher_argv(slurm_dep.launch_config(g.name))
        v = _var(g.name)
        if g.nodes == 1:
            argv += ["--log-dir", _log_dir(g.name)]
            lines.append(f'srun --nodes=1 --ntasks=1 -w "${v}" {_sh(argv, own)} &')
        else:  # the node rank is the task's rank, expanded on each machine
            argv += multinode_flags(g, g.host, _ref("SLURM_PROCID"), dist_port(dep, g))
            argv += ["--log-dir", _log_dir(f"{g.name}-{_ref('SLURM_PROCID')}")]
            lines.append(f'srun --nodes={g.nodes} --ntasks={g.nodes} -w "${v}_NODES" '
                         f'bash -c {shlex.quote(_sh(argv, own))} &')
    lines.append(f'srun --nodes=1 --ntasks=1 -w "$ROUTER" '
                 f'{_sh(LAUNCH + launcher_argv(slurm_dep.launch_config(ROUTER)) + ["--log-dir", _log_dir(ROUTER)], own)} &')
    if any(slurm_dep.launch_config(g.name).drain_mode is DrainMode.MIGRATE for g in slurm_dep.of(Role.DECODE)):
        lines += ["# Draining one decoder before it stops: scancel --signal=TERM ${SLURM_JOB_ID}.<its step>; its",
                  "# launcher (--drain-mode migrate) moves its running requests to the other decoders, then exits 0."]
    lines += ["while wait -n; do :; done  # a process that fails ends the job (a drained decoder exits 0)",
              "exit 1", ""]
    return "\n".join(lines)
