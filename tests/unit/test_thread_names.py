"""Our threads are visible by name to the OS (sglang_disagg.threads), and a polling
progress thread sleeps when nothing can arrive and wakes when something can (IdleGate)."""

from __future__ import annotations

import threading
import time

import pytest

from sglang_disagg import threads
from sglang_disagg.backends.idle import IdleGate


def _comm(tid: int) -> str:
    with open(f"/proc/self/task/{tid}/comm") as f:
        return f.read().strip()


@pytest.mark.parametrize("name, expected", [
    ("messenger-control", "sd:msg-ctl"),
    ("libfabric-progress", "sd:fab-prog"),
    ("control-heartbeat", "sd:ctl-beat"),
    ("mooncake-worker-0123456789", "sd:mc-w-0123456"),  # cut at the kernel's 15 bytes
])
def test_os_names_are_short_and_prefixed(name, expected):
    assert threads.os_name(name) == expected


def test_a_named_thread_shows_its_name_to_the_os():
    seen = {}

    def body():
        seen["comm"] = _comm(threading.get_native_id())

    t = threads.Thread(target=body, name="messenger-stream")
    t.start()
    t.join()
    assert seen["comm"] == "sd:msg-stream"


def test_threads_a_library_starts_inside_native_scope_are_ours():
    """A thread created while the creator's OS name is ours inherits it (as UCX's or
    Mooncake's threads do inside a backend's _native_open); the creator gets its own back."""
    before = threads.current_os_name()
    seen = {}
    with threads.native_scope("nixl-lib"):
        t = threading.Thread(target=lambda: seen.setdefault("comm", _comm(threading.get_native_id())))
        t.start()
        t.join()
    assert seen["comm"] == "sd:nixl-lib"
    assert threads.current_os_name() == before


def test_the_gate_sleeps_when_nothing_can_arrive_and_a_kick_wakes_it():
    gate = IdleGate(lambda: False, idle_s=5.0)
    for _ in range(IdleGate.SHORT_TURNS - 1):  # the fast turns after traffic
        gate.after(False)
    threading.Timer(0.2, gate.kick).start()
    t0 = time.monotonic()
    gate.after(False)  # blocks until the kick, not the 5 s
    assert 0.15 < time.monotonic() - t0 < 2.0 and gate.sleeps == 1
    t0 = time.monotonic()
    gate.after(True)  # traffic: straight back to fast turns
    took = time.monotonic() - t0
    assert took < 0.5, f"{took:.3f} s: traffic must not wait out the 5 s idle sleep (0.5 s leaves room for a loaded machine)"


def test_the_gate_never_sleeps_while_something_is_expected():
    work = [True]
    gate = IdleGate(lambda: work[0], idle_s=5.0)
    t0 = time.monotonic()
    for _ in range(IdleGate.SHORT_TURNS + 20):
        gate.after(False)
    assert gate.sleeps == 0 and time.monotonic() - t0 < 2.0
    work[0] = False
    threading.Timer(0.1, gate.kick).start()
    gate.after(False)
    assert gate.sleeps == 1
