"""The only functions our SGLang patches call.

Keeping the logic here, not inside SGLang, keeps each patch to a few lines that
say *where* we hook in; *what* happens is ordinary, tested Python in this
package. Every function is safe to call on GPU builds too (it decides itself
whether it has anything to do).
"""

from __future__ import annotations

from typing import Any

_DEVICE_MEM = "VRAM"
_HOST_MEM = "DRAM"


def _to_host_kind(value: Any) -> Any:
    return _HOST_MEM if isinstance(value, str) and value == _DEVICE_MEM else value


class HostMemoryNixlAgent:
    """A nixl_agent whose memory-type arguments say DRAM where SGLang says VRAM.

    SGLang's NIXL connector hard-codes "VRAM" in some thirty places because on
    GPU the KV cache is device memory. With ``--device cpu`` the same pages are
    host memory, and UCX must be told so or it tries CUDA memory detection.
    Translating at the agent boundary is one patch line instead of thirty.
    """

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


def nixl_agent_for_device(agent: Any, device: str) -> Any:
    """Wrap a nixl_agent so registrations match where the KV cache lives."""
    return HostMemoryNixlAgent(agent) if device == "cpu" else agent
