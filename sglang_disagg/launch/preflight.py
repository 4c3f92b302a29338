"""Checks that turn a confusing failure minutes later into a clear error now."""

from __future__ import annotations

import socket
from pathlib import Path

from sglang_disagg.launch.config import LaunchConfig

PATCH_MARKER = ".sglang_disagg_patches.json"


class PreflightError(RuntimeError):
    pass


def _held(host: str, port: int) -> bool:
    """Someone else has bound (host, port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def check_ports_free(cfg: LaunchConfig) -> None:
    busy = [f"{port} ({what})" for what, port in cfg.ports.all(cfg.role, cfg.mode).items() if _held(cfg.host, port)]
    if busy:
        raise PreflightError(
            f"port(s) in use on {cfg.host}: {', '.join(busy)}; stop what holds them or pick another "
            f"--port (the stack uses --port and the nine ports above it)"
        )


def ephemeral_range() -> tuple[int, int] | None:
    """The kernel's range for outgoing connections' local ports (ip_local_port_range)."""
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return None


def ephemeral_overlap(cfg: LaunchConfig) -> str:
    """A warning when the stack's ports lie where any outgoing connection may take one
    before a server binds it ("" when they do not)."""
    rng = ephemeral_range()
    if rng is None:
        return ""
    hit = sorted(p for p in cfg.ports.all(cfg.role, cfg.mode).values() if rng[0] <= p <= rng[1])
    if not hit:
        return ""
    return (f"ports {hit[0]}-{hit[-1]} lie in the kernel's ephemeral port range {rng[0]}-{rng[1]} "
            f"(net.ipv4.ip_local_port_range): another process's connection may take one before its server "
            f"binds it; a --port below {rng[0] - 10} avoids that")


def bind_failure(log_text: str, ports: tuple[tuple[str, int], ...], host: str) -> str:
    """One line naming the port a process could not bind, from its log ("" if it did not
    fail that way): which of its ports is now held by someone else."""
    if "Address already in use" not in log_text and "Errno 98" not in log_text:
        return ""
    held = [f"{port} ({what})" for what, port in ports if _held(host, port)]
    where = ", ".join(held) if held else " or ".join(f"{p} ({w})" for w, p in ports) or "one of its ports"
    rng = ephemeral_range()
    hint = (f"; it lies in the ephemeral range {rng[0]}-{rng[1]}, where outgoing connections take ports: "
            f"pick a --port below {rng[0] - 10}" if rng and any(rng[0] <= p <= rng[1] for _, p in ports) else
            "; stop what holds it or pick another --port")
    return f"could not bind port {where} on {host}: another process took it after the launcher checked it{hint}"


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
