"""What a start refuses, split by what each refusal depends on, so that ``--dry-run`` refuses
what a real start would, on any machine.

Depends on the deployment only (the same answer on every machine; the dry run always makes
these, and a deployment file is refused at load for any of them):
- the model's shape against each server's TP size, and in messenger mode each prefill ->
  decode TP pair the planner must map (sharding.py; the shape from model_config.py, so a
  built-in is never generated for it);
- the port plan: two groups of one role on one host would bind the same ports;
- the shared secret: a messenger server started on its own, and any node whose HTTP ports
  reach beyond this machine (its keys derive from it, keys.py), needs --secret-file or
  SGLANG_DISAGG_SECRET, long enough (secret.py).

Depends on the machine the node runs on (made only for a node meant for this one: its
``--host`` is one of this machine's addresses, or the node is ``--role all``/``colocated``):
- one core per rank on CPU (tp * dp ranks with replica DP, parallel.py);
- the secret file readable.

Left to the real start (machine state a dry run does not probe): CUDA and the GPU count
(preflight.check_cuda; the dry run plans for ``--gpus N`` or the fewest the TP sizes need),
ports free now (preflight.check_ports_free), the model generated or converted.
"""

from __future__ import annotations

import os
import socket
from collections import defaultdict
from collections.abc import Sequence
from typing import Protocol

from sglang_disagg.backends.auth import SECRET_ENV, SECRET_FILE_ENV
from sglang_disagg.launch import keys, secret, sharding
from sglang_disagg.launch.config import LaunchConfig, Mode, Ports, Role
from sglang_disagg.launch.model_config import model_config
from sglang_disagg.launch.parallel import Parallel

LOCAL_HOSTS = ("localhost", "0.0.0.0", "::", "::1")


class GroupShape(Protocol):
    """What the deployment checks read of a deploy.Group (deploy.py calls them: no import back)."""

    name: str
    role: Role
    host: str
    tp: int
    attn_dp: int
    dp: int
    prefill: tuple[str, ...]


def meant_for_here(cfg: LaunchConfig) -> bool:
    """Whether the node runs on this machine: a whole stack always does; a single role when
    its --host is an address of this machine (read from its interfaces; nothing resolved)."""
    if cfg.role in (Role.ALL, Role.COLOCATED):
        return True
    host = cfg.host
    if host in LOCAL_HOSTS or host.startswith("127.") or host == socket.gethostname():
        return True
    import psutil

    return any(a.address.split("%")[0] == host for addrs in psutil.net_if_addrs().values() for a in addrs)


def check_cores(cfg: LaunchConfig) -> None:
    """On CPU every rank of a server needs a core of this machine: tp of them, tp * dp with
    replica DP (each replica's ranks are processes of their own; attention DP runs inside
    the TP group)."""
    if cfg.device != "cpu":
        return
    cores = sharding.this_machines_cores()
    for flag, p in sharding.launch_parallel(cfg).items():
        if p.processes > cores:
            ranks = f" ({p.processes} ranks)" if p.processes != p.tp else ""
            raise ValueError(f"{p.label(flag)}{ranks} exceeds the {cores} CPU cores of this machine")


def dry_run(cfg: LaunchConfig) -> list[str]:
    """Make the checks a start of `cfg` makes that do not start, write or probe anything;
    raise ValueError as the launcher would. Returns lines saying what was checked."""
    here = meant_for_here(cfg)
    said = []
    if cfg.role is not Role.ROUTER:
        model_cfg = model_config(cfg.model)
        if model_cfg is None:
            said.append(f"model {cfg.model}: not on this machine (no config.json here), so its shape against "
                        "the TP sizes is checked when its node starts")
        else:
            sharding.check_config(cfg, model_cfg, here)
            sizes = ", ".join(p.label(f) for f, p in sharding.launch_parallel(cfg).items())
            try:
                shape = sharding.Shape.from_config(model_cfg).describe()
            except (KeyError, TypeError, ValueError, ZeroDivisionError):
                shape = "a config the checks cannot read: SGLang decides"  # as sharding.check
            said.append(f"model {cfg.served_model_name} ({shape}) takes {sizes}")
    secret.check(cfg, read_file=here)
    if secret.needs_secret(cfg):
        said.append("shared secret: " + _secret_source(cfg, here))
    said.append("HTTP keys: " + {
        keys.Scope.ALL: "an API key and an admin key derived from the shared secret (its ports reach beyond this "
                        "machine)",
        keys.Scope.ADMIN: "the admin key only, derived from the shared secret (loopback): serving takes no key, "
                          "the admin endpoints and the router's /workers do",
        keys.Scope.NONE: "none (loopback, no secret here: every user of this machine reaches every endpoint)",
    }[keys.scope(cfg)])
    if here:
        check_cores(cfg)
        said.append(f"this machine: {'cores for every rank' if cfg.device == 'cpu' else 'no GPU probed'}")
    else:
        said.append(f"this machine's cores and GPUs not checked: --host {cfg.host} is another machine")
    return said


def _secret_source(cfg: LaunchConfig, here: bool) -> str:
    if cfg.secret_file:
        return f"--secret-file {cfg.secret_file}" + ("" if here else " (on its machine, not read here)")
    if cfg.role in secret.SAME_MACHINE:
        return "made at start"
    return f"{SECRET_FILE_ENV} (set here)" if os.environ.get(SECRET_FILE_ENV) else f"{SECRET_ENV} (set here)"


def _shape(g: GroupShape) -> Parallel:
    return Parallel(g.tp, g.attn_dp, g.dp)


def check_deployment(model: str, mode: Mode, ports: Ports, groups: Sequence[GroupShape]) -> None:
    """Refuse a deployment a start of one of its nodes would refuse on any machine (ValueError
    naming the groups)."""
    by_place: dict[tuple[str, Role], list[str]] = defaultdict(list)
    for g in groups:
        by_place[(g.host, g.role)].append(g.name)
    for (host, role), names in by_place.items():
        if len(names) > 1:
            used = sorted(ports.all(role, mode).values())
            raise ValueError(f"{role.value} groups {', '.join(map(repr, names))} all run on host {host}: each binds "
                             f"the ports {', '.join(map(str, used))} (the port plan from deployment.port), so only "
                             f"one could start; give each its own host")
    model_cfg = model_config(model)
    if model_cfg is None:
        return  # a directory on the nodes, not here: each node checks it when it starts
    name = os.path.basename(model.rstrip("/")) or model
    for g in groups:
        try:
            sharding.check(name, model_cfg, {"tp": _shape(g)}, None, messenger_pair=False)
        except ValueError as e:
            raise ValueError(f"{g.role.value} group {g.name!r}: {e}") from None
    if mode is not Mode.MESSENGER:
        return
    by_name = {g.name: g for g in groups}
    for d in (g for g in groups if g.role is Role.DECODE):
        for p in (by_name[n] for n in d.prefill):
            try:
                sharding.check(name, model_cfg, {"prefill tp": _shape(p), "decode tp": _shape(d)}, None,
                               messenger_pair=True)
            except ValueError as e:
                raise ValueError(f"decode group {d.name!r} with prefill group {p.name!r}: {e}") from None
