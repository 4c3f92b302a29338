"""Token-exact equivalence: router -> decode (-> prefill through the messenger) gives
exactly the greedy tokens of one colocated server, on every transfer backend (shmem,
libfabric tcp, NIXL, Mooncake), with prefill TP 2 -> decode TP 1 and 1 -> 2, on three
architectures (Llama, Qwen3, Qwen2), streaming each layer's KV as the prefill forward
passes it (the default) over several prefill chunks; and SGLang's own PD path (upstream
mode, the comparison baseline) does too. And an idle decoder costs nothing for the
messenger: its threads of ours sleep, its scheduler thread spins no more than SGLang's
own PD decoder's."""

from __future__ import annotations

import pytest
from harness import threadcpu

from sglang_disagg.launch import Mode

from .conftest import StackSpec, assert_same, run_concurrent, run_sequential

pytestmark = pytest.mark.e2e

CONFIGS = [
    # First: its idle decoder is the baseline of test_an_idle_decoder_costs_nothing.
    pytest.param(StackSpec(mode=Mode.UPSTREAM, backend="mooncake"), id="upstream-mooncake"),
    pytest.param(StackSpec(backend="libfabric", provider="tcp"), id="messenger-libfabric-tcp"),
    pytest.param(StackSpec(backend="nixl"), id="messenger-nixl"),
    pytest.param(StackSpec(backend="mooncake"), id="messenger-mooncake"),
    pytest.param(StackSpec(backend="shmem", prefill_tp=2), id="messenger-shmem-tp2-tp1"),
    pytest.param(StackSpec(backend="libfabric", provider="tcp", decode_tp=2), id="messenger-libfabric-tcp-tp1-tp2"),
    pytest.param(StackSpec(backend="nixl", model="tiny-qwen3"), id="messenger-nixl-qwen3"),
    pytest.param(StackSpec(backend="shmem", model="tiny-qwen2"), id="messenger-shmem-qwen2"),
    # Last, so that test_messenger.py reuses this stack (the launcher's default).
    pytest.param(StackSpec(backend="shmem"), id="messenger-shmem"),
]


@pytest.fixture(scope="module", params=CONFIGS)
def pd(request, stacks, references):
    spec: StackSpec = request.param
    prompts, expected = references(spec.model)
    return stacks.get(spec), prompts, expected


def test_sequential_matches_colocated(pd):
    stack, prompts, expected = pd
    assert_same(run_sequential(stack.url, prompts), expected, prompts)


def test_concurrent_matches_colocated(pd):
    stack, prompts, expected = pd
    assert_same(run_concurrent(stack.url, prompts), expected, prompts)
    assert not stack.dead()  # nothing broke under concurrency
    if stack.cfg.mode is Mode.MESSENGER:
        stats = stack.messenger_stats("decode")
        # Every prompt of 2+ tokens went through a prefill server; none failed or leaked.
        assert stats["requests_failed"] == 0 and stats["pages_quarantined"] == 0
        assert stats["requests_carried"] >= 2 * (len(prompts) - 1)
        assert sum(stats["in_flight"].values()) == 0
        for role, tp in (("prefill", stack.cfg.prefill_tp), ("decode", stack.cfg.decode_tp)):
            node = stack.messenger_stats(role)  # one messenger per server, whatever its TP
            assert (node["tp"], node["backends"], node["ranks_driven"]) == (tp, 1, tp)


# The threads each backend's idle decoder must have (named by sglang_disagg.threads); a
# missing one means a rename or a thread that no longer starts, and would let this test
# measure nothing. Common to all: the control plane's heartbeat, acceptor and readers, the
# messenger's control reader and its link to the prefill server (named after its address).
COMMON_THREADS = {"sd:ctl-beat", "sd:ctl-acc", "sd:ctl-reader", "sd:msg-ctl", "sd:msg-link-127"}
BACKEND_THREADS = {"libfabric": {"sd:fab-prog", "sd:fab-wdog"}, "nixl": {"sd:nixl-prog"},
                   "mooncake": {"sd:mc-note", "sd:mc-lib"}, "shmem": {"sd:shmem-copy"}}
IDLE_WINDOW_S = 2.0  # threadcpu reads nanoseconds: 1 % of a core is 20 ms here
_idle_scheduler: dict[str, float] = {}  # stack label -> its busiest scheduler thread, % of a core


def test_an_idle_decoder_costs_nothing(pd):
    """Idle (the requests above finished), a decode server's threads of ours use under 1 %
    of a core together, and its scheduler thread at most 1 % more than SGLang's own PD
    decoder's idle scheduler (measured first, in the upstream stack)."""
    stack, _, _ = pd
    decoder = next(p for p in stack.servers if p.spec.name == "decode")
    threads = threadcpu.measure(decoder.pid, IDLE_WINDOW_S)
    table = threadcpu.by_name(threads)
    scheduler = max(t.percent for t in threads if t.scheduler)
    if stack.cfg.mode is Mode.UPSTREAM:
        _idle_scheduler["upstream"] = scheduler
        assert not any(t.ours for t in threads), table  # SGLang's PD decoder runs nothing of ours
        return
    names = {t.name for t in threads}
    missing = (COMMON_THREADS | BACKEND_THREADS[stack.cfg.transfer_backend]) - names
    assert not missing, f"threads not found by name: {sorted(missing)}; the decoder has {sorted(names)}"
    ours = sum(t.percent for t in threads if t.ours)
    assert ours < 1.0, f"our threads used {ours:.2f} % of a core over {IDLE_WINDOW_S} s idle: {table}"
    baseline = _idle_scheduler["upstream"]  # KeyError: the upstream stack did not run first
    assert scheduler <= baseline + 1.0, (f"idle scheduler thread {scheduler:.2f} % of a core, SGLang's PD "
                                         f"decoder's {baseline:.2f} %: {table}")
