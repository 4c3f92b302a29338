"""Typed environment variables and paths, read in one place.

Every knob sglang-disagg reads from the environment is declared here, so a
user can find them all with one grep.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where generated models and downloaded SGLang releases live.

    ``SGLANG_DISAGG_CACHE`` overrides the default ``~/.cache/sglang-disagg``.
    """
    override = os.environ.get("SGLANG_DISAGG_CACHE")
    if override:
        return Path(override).expanduser()
    return Path.home() / ".cache" / "sglang-disagg"


def models_dir() -> Path:
    return cache_dir() / "models"


# How a server starts its scheduler and detokenizer processes: "spawn" (SGLang's way) or
# "fork" (what the launcher asks of CPU servers; hooks.subprocess_start_method reads it).
SUBPROCESS_START_ENV = "SGLANG_DISAGG_SUBPROCESS_START"

# Set by a launcher that runs as a Slurm step for the servers it starts: their schedulers keep
# SIGTERM ignored (hooks.scheduler_ready), since a signal to the step reaches every process of
# it and only the launcher may decide when they stop (launch/process.py, _preexec).
IGNORE_SIGTERM_ENV = "SGLANG_DISAGG_IGNORE_SIGTERM"


# Environment every SGLang process started by us gets on CPU. The reasons:
# - SGLANG_USE_CPU_ENGINE: without it rotary embeddings import vLLM.
# - SGLANG_HOST_IP: bootstrap addresses must be loopback, not the VM's eth0.
# - MC_FORCE_TCP: Mooncake would otherwise probe RDMA devices.
# - UCX_*: NIXL's UCX must stay on loopback; sm/cma move the data between
#   local processes, tcp carries the wire-up.
CPU_SERVER_ENV: dict[str, str] = {
    "SGLANG_USE_CPU_ENGINE": "1",
    "SGLANG_HOST_IP": "127.0.0.1",
    "MC_FORCE_TCP": "1",
    "UCX_NET_DEVICES": "lo",
    "UCX_TLS": "tcp,self,sm,cma",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
