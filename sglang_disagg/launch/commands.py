"""Command lines and environments for each process of a stack (pure: no I/O).

Why each CPU flag is there:
- ``--attention-backend torch_native``: the only attention backend without
  CUDA/Triton kernels.
- ``--max-total-tokens``: the default KV pool is sized from device memory and
  on CPU comes out at millions of tokens (tens of GB).
- ``--skip-server-warmup``: the warm-up request is routed through the PD
  handshake before a router exists, and times out.
- ``--sleep-on-idle``: in PD mode an idle scheduler otherwise spins at 100 %
  of a core; on a small machine the prefill server's spinning starves the
  decode server (one request measured 7 tok/s without, ~130 tok/s with, on
  2 cores). The sleep is a zmq poll, so a new request still wakes it at once.
- prefill ``--disable-overlap-schedule``: the overlap path records a CUDA event.
- decode ``--disaggregation-decode-retraction-backup cpu_tensor``: the default
  host backup pool calls cudaHostRegister.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from sglang_disagg.env import CPU_SERVER_ENV
from sglang_disagg.launch.config import LaunchConfig, Role, TransferBackend


@dataclass(frozen=True)
class ProcessSpec:
    name: str
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    port: int  # the HTTP port to health-check

    def environ(self) -> dict[str, str]:
        return os.environ.copy() | dict(self.env)


def _cpu_bind(tp: int) -> str:
    """SGLang's CPU engine binds one OpenMP pool per TP rank: spread the ranks
    over the cores, one core set per rank ("0|1" for TP 2 on 2 cores)."""
    cores = os.cpu_count() or 1
    per = max(1, cores // tp)
    return "|".join(
        f"{r * per}-{r * per + per - 1}" if per > 1 else str(r * per) for r in range(tp)
    )


def _server_base(cfg: LaunchConfig, model_path: str, builtin: bool, port: int, dist_port: int, tp: int) -> list[str]:
    argv = [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", model_path,
        "--host", cfg.host,
        "--port", str(port),
        "--device", cfg.device,
        "--tp", str(tp),
        "--nccl-port", str(dist_port),
    ]
    dtype = cfg.dtype or ("float32" if builtin else None)
    if dtype:
        argv += ["--dtype", dtype]
    if cfg.device == "cpu":
        argv += [
            "--attention-backend", "torch_native",
            "--max-total-tokens", str(cfg.max_total_tokens),
            "--skip-server-warmup",
            "--sleep-on-idle",
        ]
    return argv


def _env(cfg: LaunchConfig, tp: int) -> tuple[tuple[str, str], ...]:
    env = dict(CPU_SERVER_ENV) if cfg.device == "cpu" else {}
    if cfg.host not in ("0.0.0.0", "::"):
        # Bootstrap and transfer engines advertise this address to peers.
        env["SGLANG_HOST_IP"] = cfg.host
    if cfg.device == "cpu" and tp > 1:
        env["SGLANG_CPU_OMP_THREADS_BIND"] = _cpu_bind(tp)
    env.update(dict(cfg.env))
    return tuple(sorted(env.items()))


def server_spec(cfg: LaunchConfig, role: Role, model_path: str, builtin: bool) -> ProcessSpec:
    ports = cfg.ports
    if role is Role.COLOCATED:
        argv = _server_base(cfg, model_path, builtin, ports.front, ports.colocated_dist, cfg.prefill_tp)
        return ProcessSpec("colocated", tuple(argv + list(cfg.extra_args)), _env(cfg, cfg.prefill_tp), ports.front)
    if role is Role.PREFILL:
        argv = _server_base(cfg, model_path, builtin, ports.prefill, ports.prefill_dist, cfg.prefill_tp)
        argv += [
            "--disaggregation-mode", "prefill",
            "--disaggregation-transfer-backend", cfg.backend.value,
            "--disaggregation-bootstrap-port", str(ports.bootstrap),
        ]
        if cfg.device == "cpu":
            argv += ["--disable-overlap-schedule"]
        return ProcessSpec("prefill", tuple(argv + list(cfg.extra_args)), _env(cfg, cfg.prefill_tp), ports.prefill)
    if role is Role.DECODE:
        argv = _server_base(cfg, model_path, builtin, ports.decode, ports.decode_dist, cfg.decode_tp)
        argv += ["--disaggregation-mode", "decode", "--disaggregation-transfer-backend", cfg.backend.value]
        if cfg.device == "cpu":
            argv += ["--disaggregation-decode-retraction-backup", "cpu_tensor"]
        return ProcessSpec("decode", tuple(argv + list(cfg.extra_args)), _env(cfg, cfg.decode_tp), ports.decode)
    raise ValueError(f"{role} is not a server role")


def _split_url(url: str, default_bootstrap: int | None) -> list[str]:
    """'http://h:p@8998' -> ['http://h:p', '8998']; bootstrap optional."""
    base, _, boot = url.partition("@")
    if boot:
        return [base, boot]
    return [base] + ([str(default_bootstrap)] if default_bootstrap else [])


def router_spec(cfg: LaunchConfig) -> ProcessSpec:
    ports = cfg.ports
    if cfg.role is Role.ALL:
        prefills = [[f"http://{cfg.host}:{ports.prefill}", str(ports.bootstrap)]]
        decodes = [f"http://{cfg.host}:{ports.decode}"]
    else:
        prefills = [_split_url(u, None) for u in cfg.prefill_urls]
        decodes = list(cfg.decode_urls)
    argv = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
            "--host", cfg.host, "--port", str(ports.front)]
    for p in prefills:
        argv += ["--prefill", *p]
    for d in decodes:
        argv += ["--decode", d]
    # The router's own health checks and retries would hide a dead worker for
    # tens of seconds; fail fast and let the client see the error.
    argv += ["--health-check-interval-secs", "2", "--health-failure-threshold", "2"]
    return ProcessSpec("router", tuple(argv), _env(cfg, 1), ports.front)
