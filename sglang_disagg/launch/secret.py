"""The deployment's shared secret for the messenger's control plane (backends/auth.py).

--role all makes a fresh one per stack, in a 0600 file in the log dir, so nothing needs
configuring on one machine. Servers started one per machine (--role prefill|decode) must
share one: --secret-file (or the deployment file's secret_file), or SGLANG_DISAGG_SECRET
in the environment; without either the launcher stops before starting anything.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from sglang_disagg.backends import auth
from sglang_disagg.launch.config import LaunchConfig, Mode, Role


def with_secret(cfg: LaunchConfig, log_dir: Path) -> LaunchConfig:
    if cfg.mode is not Mode.MESSENGER or cfg.role not in (Role.ALL, Role.PREFILL, Role.DECODE):
        return cfg
    if cfg.secret_file:
        try:  # readable and long enough, or say why before any server starts
            auth.load_secret({auth.SECRET_FILE_ENV: cfg.secret_file})
        except auth.AuthError as e:
            raise ValueError(f"--secret-file: {e}") from None
        return cfg
    if cfg.role is Role.ALL:
        path = log_dir / "secret"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(auth.new_secret() + "\n")
        return dataclasses.replace(cfg, secret_file=str(path))
    try:
        secret = auth.load_secret({auth.SECRET_ENV: os.environ.get(auth.SECRET_ENV, "")})
    except auth.AuthError as e:
        raise ValueError(str(e)) from None
    if secret is None:
        raise ValueError(f"--role {cfg.role.value} in messenger mode needs the deployment's shared secret: "
                         f"--secret-file PATH (the same file content on every prefill and decode node) or "
                         f"{auth.SECRET_ENV} in the environment")
    return cfg
