"""Hooks our SGLang patches call (the door itself: test_hooks_door.py)."""

from __future__ import annotations

import pytest
import torch

from sglang_disagg.cpu import ops as cpu_ops
from sglang_disagg.cpu import spec_ops
from sglang_disagg.ipc import shm
from sglang_disagg.env import SUBPROCESS_START_ENV
from sglang_disagg.hooks import cpu_op, kv_zeros, nixl_agent_for_device, subprocess_start_method
from sglang_disagg.launch import Role
from sglang_disagg.launch.__main__ import parse
from sglang_disagg.launch.commands import server_spec


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


def test_cpu_ops_come_through_hooks():
    assert cpu_op("assign_req_to_token_pool_cpu") is cpu_ops.assign_req_to_token_pool_cpu
    assert cpu_op("verify_tree_greedy_cpu") is spec_ops.verify_tree_greedy_cpu
    with pytest.raises(NotImplementedError, match="rotate_input_ids_cpu"):
        cpu_op("rotate_input_ids_cpu")()  # known at import, refused when called


def test_kv_pool_is_shared_memory_in_messenger_mode_only(monkeypatch):
    from sglang_disagg.messenger.config import ENV

    monkeypatch.delenv(ENV, raising=False)
    plain = kv_zeros((4, 1024), torch.float32, "cpu")
    with pytest.raises(shm.SharedMemoryError):
        shm.locate(plain.data_ptr(), plain.nbytes)
    monkeypatch.setenv(ENV, "{}")
    shared = kv_zeros((4, 1024), torch.float32, "cpu")
    assert shared.shape == (4, 1024) and shared.dtype == torch.float32 and not shared.any()
    assert "sglang-disagg-kv" in shm.locate(shared.data_ptr(), shared.nbytes).target


def test_servers_fork_their_subprocesses_on_cpu_only(monkeypatch):
    monkeypatch.delenv(SUBPROCESS_START_ENV, raising=False)
    assert subprocess_start_method("cpu") == "spawn"  # upstream's, unless asked
    monkeypatch.setenv(SUBPROCESS_START_ENV, "fork")
    assert subprocess_start_method("cpu") == "fork"
    assert subprocess_start_method("cuda") == "spawn"  # a CUDA context must not be inherited
    monkeypatch.setenv(SUBPROCESS_START_ENV, "forkserver")
    with pytest.raises(ValueError, match="write spawn or fork"):
        subprocess_start_method("cpu")


@pytest.mark.parametrize("role", [Role.PREFILL, Role.DECODE, Role.COLOCATED])
def test_the_launcher_asks_cpu_servers_to_fork_unless_told_otherwise(role, monkeypatch):
    monkeypatch.delenv(SUBPROCESS_START_ENV, raising=False)
    cfg, _ = parse(["--role", "colocated" if role is Role.COLOCATED else "all"])
    assert dict(server_spec(cfg, role, "/m", builtin=True).env)[SUBPROCESS_START_ENV] == "fork"
    monkeypatch.setenv(SUBPROCESS_START_ENV, "spawn")  # the user's word wins
    assert dict(server_spec(cfg, role, "/m", builtin=True).env)[SUBPROCESS_START_ENV] == "spawn"


def test_an_idle_attention_dp_group_sleeps_at_most_the_cap(monkeypatch):
    """SGLang's idle sleep (1 s) held every other DP group's iteration for up to 1 s (each starts
    with a collective); capped, no wait is longer than the cap, shorter ones are kept."""
    from sglang_disagg import hooks

    asked = []
    poller = type("Poller", (), {"poll": lambda self, timeout=None: asked.append(timeout)})()
    monkeypatch.delenv(hooks.DP_IDLE_SLEEP_ENV, raising=False)
    hooks._cap_poll(poller, hooks.dp_idle_sleep_ms())
    for timeout in (1000, None, -1, 10):
        poller.poll(timeout)
    assert asked == [50, 50, 50, 10]
    monkeypatch.setenv(hooks.DP_IDLE_SLEEP_ENV, "1000")
    assert hooks.dp_idle_sleep_ms() == 1000
    for bad in ("0", "1001", "5ms", ""):
        monkeypatch.setenv(hooks.DP_IDLE_SLEEP_ENV, bad)
        with pytest.raises(ValueError, match="expected milliseconds from 1 to 1000"):
            hooks.dp_idle_sleep_ms()
