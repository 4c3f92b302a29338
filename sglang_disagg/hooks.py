"""The only functions our SGLang patches call.

Keeping the logic here, not inside SGLang, keeps each patch to a few lines that
say *where* we hook in; *what* happens is ordinary, tested Python in this
package. Every function is safe to call on GPU builds too (it decides itself
whether it has anything to do).
"""

from __future__ import annotations

import os
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


# --- Fault injection -------------------------------------------------------
# SGLANG_DISAGG_FAULT=drop_kv makes a decode server forget the KV it just
# received (zeroes the request's pages before its first decode step). It exists
# for one purpose: the negative control of the equivalence tests, proving that
# a decoder which did not get the prefill's KV produces different tokens, i.e.
# that the token comparison can fail.
FAULT_ENV = "SGLANG_DISAGG_FAULT"


def after_kv_received(scheduler: Any, req: Any) -> None:
    """Decode side: the transfer of ``req``'s prompt KV has completed."""
    if os.environ.get(FAULT_ENV, "") != "drop_kv":
        return
    kv = scheduler.token_to_kv_pool_allocator.get_kvcache()
    locs = scheduler.req_to_token_pool.req_to_token[req.kv.req_pool_idx, : len(req.origin_input_ids)]
    for layer in range(kv.start_layer, kv.start_layer + kv.layer_num):
        kv.get_key_buffer(layer)[locs] = 0
        kv.get_value_buffer(layer)[locs] = 0
