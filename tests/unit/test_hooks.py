"""Hooks our SGLang patches call."""

from __future__ import annotations

from sglang_disagg.hooks import nixl_agent_for_device


class RecordingAgent:
    name = "agent-1"

    def __init__(self):
        self.calls = []

    def register_memory(self, descs, mem_type="DRAM", backends=()):
        self.calls.append(("register_memory", descs, mem_type))
        return "handle"

    def get_xfer_descs(self, descs, mem_type=None):
        self.calls.append(("get_xfer_descs", descs, mem_type))
        return "xfer"


def test_nixl_agent_on_cpu_registers_dram():
    agent = RecordingAgent()
    wrapped = nixl_agent_for_device(agent, "cpu")
    assert wrapped.register_memory([(1, 2, 0)], "VRAM") == "handle"
    assert wrapped.get_xfer_descs([(1, 2, 0)], mem_type="VRAM") == "xfer"
    assert wrapped.name == "agent-1"  # non-callable attributes pass through
    assert [c[2] for c in agent.calls] == ["DRAM", "DRAM"]


def test_nixl_agent_on_gpu_is_untouched():
    agent = RecordingAgent()
    assert nixl_agent_for_device(agent, "cuda") is agent
