"""The stacks the end-to-end benchmarks compare, named on the command line as
``colocated`` or ``MODE:BACKEND[:PROVIDER]`` (e.g. ``messenger:libfabric:shm``,
``upstream:mooncake``), turned into launcher configurations."""

from __future__ import annotations

from pathlib import Path

from sglang_disagg.launch import LaunchConfig, Mode, Role


def launch_config(text: str, model: str, port: int, logs: Path, max_total_tokens: int = 8192) -> LaunchConfig:
    common = dict(model=model, port=port, max_total_tokens=max_total_tokens,
                  log_dir=str(logs / text.replace(":", "-")))
    if text == "colocated":
        return LaunchConfig(role=Role.COLOCATED, **common)
    mode, _, rest = text.partition(":")
    backend, _, provider = rest.partition(":")
    try:
        return LaunchConfig(role=Role.ALL, mode=Mode(mode), backend=backend or None, provider=provider or None,
                            **common)
    except ValueError as e:
        raise SystemExit(f"configuration {text!r}: {e} (write colocated or MODE:BACKEND[:PROVIDER])") from None
