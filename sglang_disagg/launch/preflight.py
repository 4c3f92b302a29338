"""Checks that turn a confusing failure minutes later into a clear error now."""

from __future__ import annotations

import socket
from pathlib import Path

from sglang_disagg.launch.config import LaunchConfig

PATCH_MARKER = ".sglang_disagg_patches.json"


class PreflightError(RuntimeError):
    pass


def check_ports_free(cfg: LaunchConfig) -> None:
    busy = []
    for what, port in cfg.ports.all(cfg.role, cfg.mode).items():
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((cfg.host, port))
            except OSError:
                busy.append(f"{port} ({what})")
    if busy:
        raise PreflightError(
            f"port(s) in use on {cfg.host}: {', '.join(busy)}; stop what holds them or pick another "
            f"--port (the stack uses --port and the nine ports above it)"
        )


def check_patches_applied() -> Path:
    """The installed SGLang must carry our patch series (``make setup`` applies it)."""
    import importlib.util

    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise PreflightError("SGLang is not installed in this environment: run `make setup`")
    pkg = Path(next(iter(spec.submodule_search_locations)))
    if not (pkg / PATCH_MARKER).exists():
        raise PreflightError(
            f"the SGLang at {pkg} does not carry the sglang-disagg patch series; run `make setup` "
            "or `python -m sglang_disagg.patches apply` from the repository"
        )
    return pkg
