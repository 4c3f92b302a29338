"""The stacks the end-to-end benchmarks compare, named on the command line as
``colocated`` or ``MODE:BACKEND[:PROVIDER]`` (e.g. ``messenger:libfabric:tcp``,
``upstream:mooncake``), optionally with ``+no-stream`` (the messenger writing each chunk
after its forward) and ``+spawn`` (servers spawn their scheduler and detokenizer, as SGLang
alone does, instead of the launcher's fork), turned into launcher configurations."""

from __future__ import annotations

from pathlib import Path

from sglang_disagg.env import SUBPROCESS_START_ENV
from sglang_disagg.launch import LaunchConfig, Mode, Role


def launch_config(text: str, model: str, port: int, logs: Path, max_total_tokens: int = 8192) -> LaunchConfig:
    common = dict(model=model, port=port, max_total_tokens=max_total_tokens,
                  log_dir=str(logs / text.replace(":", "-")))
    name, *flags = text.split("+")
    if set(flags) - {"no-stream", "spawn"}:
        raise SystemExit(f"configuration {text!r}: unknown option (only +no-stream, +spawn)")
    if "spawn" in flags:
        common["env"] = ((SUBPROCESS_START_ENV, "spawn"),)
    if name == "colocated":
        if "no-stream" in flags:
            raise SystemExit(f"configuration {text!r}: +no-stream is for the messenger")
        return LaunchConfig(role=Role.COLOCATED, **common)
    mode, _, rest = name.partition(":")
    backend, _, provider = rest.partition(":")
    extra = {"stream": False} if "no-stream" in flags else {}
    try:
        return LaunchConfig(role=Role.ALL, mode=Mode(mode), backend=backend or None, provider=provider or None,
                            **common, **extra)
    except ValueError as e:
        raise SystemExit(f"configuration {text!r}: {e} (write colocated or MODE:BACKEND[:PROVIDER])") from None
