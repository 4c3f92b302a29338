"""The deployment's shared secret: the messenger's control plane (backends/auth.py) proves it,
and the HTTP keys (keys.py) derive from it.

--role all and colocated make a fresh one per stack, in a 0600 file in the log dir
(private_files.py), so nothing needs configuring on one machine (on loopback too: the admin key
derives from it, keys.Scope.ADMIN); the stack removes it when it stops (stack.py), and keeps a
--secret-file it was given. Nodes started one per machine
(--role prefill|decode in messenger mode, and every role whose HTTP ports are reachable from
other machines, the router included) must share one: --secret-file (or the deployment file's
secret_file), or SGLANG_DISAGG_SECRET in the environment; without either the launcher stops
before starting anything.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from sglang_disagg import private_files
from sglang_disagg.backends import auth
from sglang_disagg.launch import keys
from sglang_disagg.launch.config import LaunchConfig, Mode, Role

SAME_MACHINE = (Role.ALL, Role.COLOCATED)  # every process of the stack here: a fresh secret will do
SECRET_FILE = "secret"  # the one with_secret makes, in the log dir


def needs_secret(cfg: LaunchConfig) -> bool:
    """A messenger server proves it; a node reachable beyond this machine derives its keys from
    it; a stack all on this machine derives its admin key from it, even on loopback (keys.py)."""
    messenger = cfg.mode is Mode.MESSENGER and cfg.role in (Role.ALL, Role.PREFILL, Role.DECODE)
    return messenger or cfg.role in SAME_MACHINE or keys.needed(cfg)


def with_secret(cfg: LaunchConfig, log_dir: Path) -> LaunchConfig:
    """`cfg` with the secret it runs with: a fresh file in `log_dir` where every process is
    here and none was given (the only case that writes; the caller owns the file then), else
    `cfg` as it is, refused (ValueError) where it lacks one."""
    if cfg.role in SAME_MACHINE and not cfg.secret_file and needs_secret(cfg):
        path = private_files.write(log_dir / SECRET_FILE, auth.new_secret() + "\n")
        return dataclasses.replace(cfg, secret_file=str(path))
    check(cfg)
    return cfg


def check(cfg: LaunchConfig, read_file: bool = True) -> None:
    """What with_secret refuses, writing nothing: a messenger server started on its own, and any
    node whose HTTP ports reach beyond this machine, needs the deployment's secret (a file, or
    SGLANG_DISAGG_SECRET), long enough. `read_file` False: the file lies on the node's machine,
    not this one (the dry run of another node)."""
    if not needs_secret(cfg):
        return
    if cfg.secret_file:
        if read_file:  # readable and long enough, or say why before any server starts
            try:
                auth.load_secret({auth.SECRET_FILE_ENV: cfg.secret_file})
            except auth.AuthError as e:
                raise ValueError(f"--secret-file: {e}") from None
        return
    if cfg.role in SAME_MACHINE:
        return  # with_secret makes one at start
    try:
        secret = auth.load_secret({k: os.environ.get(k, "") for k in (auth.SECRET_ENV, auth.SECRET_FILE_ENV)})
    except auth.AuthError as e:
        raise ValueError(str(e)) from None
    if secret is None:
        why = ("in messenger mode" if cfg.mode is Mode.MESSENGER and cfg.role is not Role.ROUTER
               else f"on {cfg.host} (its HTTP keys derive from it)")
        raise ValueError(f"--role {cfg.role.value} {why} needs the deployment's shared secret: --secret-file PATH "
                         f"(the same file content on every node of the deployment) or {auth.SECRET_ENV} in the "
                         f"environment")
