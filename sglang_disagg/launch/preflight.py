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
            "or `python -m sglang_disagg.patchtool apply` from the repository"
        )
    return pkg


CUDA_SETUP = "set up the CUDA environment with `make setup DEVICE=cuda` (requirements/cuda.lock)"


def cuda_problems(torch_version: str | None, torch_cuda: str | None, cuda_available: bool,
                  missing_packages: tuple[str, ...]) -> list[str]:
    """What keeps SGLang from running on CUDA here, from what was probed (pure)."""
    problems = []
    if torch_version is None:
        problems.append("torch is not installed")
    elif torch_cuda is None:
        problems.append(f"torch {torch_version} is a CPU-only build (torch.version.cuda is None)")
    elif not cuda_available:
        problems.append(f"no CUDA device is usable (torch {torch_version}: torch.cuda.is_available() is False: "
                        "no NVIDIA driver, no GPU, or CUDA_VISIBLE_DEVICES hides them)")
    for name in missing_packages:
        why = {"sgl_kernel": "SGLang's CUDA kernels, imported by every CUDA server",
               "flashinfer": "the trtllm_mha attention backend's kernels"}.get(name, "needed on CUDA")
        problems.append(f"the {name} package is not installed ({why})")
    return problems


def check_cuda(cfg: LaunchConfig) -> int:
    """--device cuda: refuse now, naming what is missing, when this environment cannot run
    SGLang on CUDA; else the number of GPUs the servers may use (--gpus, checked against
    what is visible, or all of them)."""
    import importlib.util

    packages = ["sgl_kernel"] + (["flashinfer"] if cfg.cuda_attention_backend == "trtllm_mha" else [])
    missing = tuple(p for p in packages if importlib.util.find_spec(p) is None)
    version = cuda = None
    available, count = False, 0
    if importlib.util.find_spec("torch") is not None:
        import torch

        version, cuda = torch.__version__, torch.version.cuda
        available = cuda is not None and torch.cuda.is_available()
        count = torch.cuda.device_count() if available else 0
    problems = cuda_problems(version, cuda, available, missing)
    if problems:
        raise PreflightError(f"--device cuda cannot run here: {'; '.join(problems)}; {CUDA_SETUP}")
    if cfg.gpus is not None and cfg.gpus > count:
        raise PreflightError(f"--gpus {cfg.gpus}: only {count} GPU(s) are visible here")
    return cfg.gpus or count


def visible_gpus() -> int:
    """How many CUDA GPUs this process sees (0 without torch, a CUDA build or a driver)."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return 0
    import torch

    return torch.cuda.device_count() if torch.version.cuda is not None else 0
