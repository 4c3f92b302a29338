"""``--dry-run``: what the launcher would start, printed, with nothing started, probed or
written (no log directory, no secret file, no model generated, no port checked), after the
checks a real start makes that need none of that (checks.py: the model's shape against the
TP sizes, the secret; this machine's cores only for a node meant for it). The header says
what was checked.

For each process: its name, the GPUs it gets (``--device cuda``), the environment
variables the launcher sets for it (not the rest of the environment, which it inherits)
and its command line, one shell word each quoted. Works on any machine: with ``--gpus N``
no GPU is looked for (a deployment file's node gets its group's GPUs so); without it the
GPUs visible here are counted for a node meant for this machine, and where there are none,
or the node is another machine's, the plan is made for the fewest GPUs the TP sizes need
(times the replicas of replica DP), and says so.
"""

from __future__ import annotations

import dataclasses
import shlex
import tempfile
from pathlib import Path

from sglang_disagg.launch import checks, secret
from sglang_disagg.launch.commands import ProcessSpec, router_spec, server_spec
from sglang_disagg.launch.config import LaunchConfig, Role
from sglang_disagg.launch.preflight import visible_gpus
from sglang_disagg.models import is_builtin


def _model_path(cfg: LaunchConfig) -> str:
    """The directory the servers would load, without generating or converting a built-in model."""
    from sglang_disagg.env import models_dir
    from sglang_disagg.models import BUILTIN_MODELS, REAL_MODELS

    if cfg.model in BUILTIN_MODELS:
        return str(models_dir() / BUILTIN_MODELS[cfg.model].dirname)
    if cfg.model in REAL_MODELS:  # named by its content's hash: the converted copy here, if any (not re-hashed)
        found = sorted(d for d in models_dir().glob(f"{cfg.model}-*") if len(d.name) == len(cfg.model) + 13)
        return str(found[0]) if found else str(models_dir() / f"{cfg.model}-<hash>")
    return cfg.model


def _gpu_count(cfg: LaunchConfig, here: bool) -> tuple[LaunchConfig, str]:
    if cfg.device != "cuda" or cfg.role is Role.ROUTER or cfg.gpus is not None:
        return cfg, f"{cfg.gpus} GPU(s) (--gpus)" if cfg.gpus is not None else ""
    seen = visible_gpus() if here else 0  # another machine's node: this one's GPUs say nothing
    if seen:
        return dataclasses.replace(cfg, gpus=seen), f"{seen} GPU(s) (visible here)"
    ranks = sum(cfg.parallel(r).processes for r in cfg.server_roles)  # one GPU per rank, tp * dp a server
    need = max([ranks] + [g + 1 for g in cfg.prefill_gpus + cfg.decode_gpus])
    return (dataclasses.replace(cfg, gpus=need),
            f"{need} GPU(s) assumed: none visible here; --gpus N plans for a machine with N")


def _describe(spec: ProcessSpec) -> list[str]:
    ports = ", ".join(f"{port} ({what})" for what, port in spec.ports)
    lines = [f"# {spec.name}" + (f": ports {ports}" if ports else "")]
    if spec.cpus:
        lines.append(f"#   pinned to cores {','.join(map(str, spec.cpus))}")
    lines.append("environment (set by the launcher; the rest is inherited):")
    lines += [f"  {k}={shlex.quote(v)}" for k, v in spec.env]
    lines.append("command:")
    lines.append("  " + shlex.join(spec.argv))
    return lines


def render(cfg: LaunchConfig) -> str:
    """The dry run's text. Raises ValueError as the launcher would for a bad configuration."""
    checked = checks.dry_run(cfg)
    cfg, gpus = _gpu_count(cfg, checks.meant_for_here(cfg))
    log_dir = Path(cfg.log_dir) if cfg.log_dir else Path(tempfile.gettempdir()) / f"sglang-disagg-{cfg.role.value}-XXXXXXXX"
    if cfg.role in secret.SAME_MACHINE and secret.needs_secret(cfg) and not cfg.secret_file:
        cfg = dataclasses.replace(cfg, secret_file=str(log_dir / "secret"))  # made at start, mode 0600
    header = [f"# dry run: --role {cfg.role.value}, {cfg.describe_transfer()}, device {cfg.device}"
              + (f", {gpus}" if gpus else "") + "; nothing is started",
              f"# log dir: {log_dir}" + ("" if cfg.log_dir else " (a new temporary directory at start)")]
    header += [f"# checked: {line}" for line in checked]
    specs: list[ProcessSpec] = []
    if cfg.role is not Role.ROUTER:
        model = _model_path(cfg)
        roles = [Role.PREFILL, Role.DECODE] if cfg.role is Role.ALL else [cfg.role]
        specs = [server_spec(cfg, r, model, is_builtin(cfg.model), log_dir) for r in roles]
        if cfg.device == "cuda":
            plan = cfg.gpu_plan()
            for r in roles:
                placed = plan.decode if r is Role.DECODE else plan.prefill
                header.append(f"# {r.value}: {placed.describe()}")
            if len(roles) > 1 and plan.shared:
                header.append(f"# GPU(s) {','.join(map(str, plan.shared))} shared: decode starts once prefill is "
                              f"healthy (each sizes its KV pool from the memory free when it starts)")
    if cfg.role in (Role.ALL, Role.ROUTER):
        specs.append(router_spec(cfg))
    out = header
    for spec in specs:
        out += [""] + _describe(spec)
    return "\n".join(out) + "\n"
