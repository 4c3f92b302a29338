"""SGLang's own NIXL connector on CPU: its agent made to work with host memory.

Not our NIXL backend (``nixl.py``): this is for SGLang's disaggregation mode
(``--disaggregation-transfer-backend nixl``), whose connector builds its agent through
``hooks.nixl_agent_for_device`` (one patch line). Two things are wrong for CPU there:

* memory kinds: the connector hard-codes "VRAM" in some thirty places because on GPU the
  KV cache is device memory. With ``--device cpu`` the same pages are host memory and UCX
  must be told so, or it tries CUDA memory detection. ``HostMemoryNixlAgent`` translates
  at the agent boundary: one patch line instead of thirty.
* the progress thread: NIXL's Python agent hard-codes its delay to 0 us, so the thread
  busy-polls the core the forward needs (upstream NIXL PD measured 2.7x slower per request
  than Mooncake here). A short sleep between rounds (``progress_delay``, the one our
  backend uses) costs at most that much latency per completion.
"""

from __future__ import annotations

import os
from typing import Any

_DEVICE_MEM, _HOST_MEM = "VRAM", "DRAM"

PROGRESS_DELAY_ENV = "SGLANG_DISAGG_NIXL_PROGRESS_DELAY_US"
PROGRESS_DELAY_US = int(os.environ.get(PROGRESS_DELAY_ENV, "200"))


def _to_host_kind(value: Any) -> Any:
    return _HOST_MEM if isinstance(value, str) and value == _DEVICE_MEM else value


class HostMemoryNixlAgent:
    """A nixl_agent whose memory-type arguments say DRAM where SGLang says VRAM."""

    def __init__(self, agent: Any) -> None:
        self._agent = agent

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._agent, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            args = tuple(_to_host_kind(a) for a in args)
            kwargs = {k: _to_host_kind(v) for k, v in kwargs.items()}
            return attr(*args, **kwargs)

        call.__name__ = name
        return call


def _make_agent(make: Any) -> Any:
    from .nixl import progress_delay

    with progress_delay(PROGRESS_DELAY_US):
        return make()


def agent_for_device(agent: Any, device: str) -> Any:
    """The connector's nixl_agent, made by `agent()` (or given ready-made): on CPU its
    progress thread sleeps between rounds and its registrations say DRAM, not VRAM; on
    other devices SGLang's agent unchanged."""
    if callable(agent) and not hasattr(agent, "register_memory"):
        agent = _make_agent(agent) if device == "cpu" else agent()
    return HostMemoryNixlAgent(agent) if device == "cpu" else agent
