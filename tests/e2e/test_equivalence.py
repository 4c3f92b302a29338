"""Token-exact equivalence: router -> decode (-> prefill through the messenger) gives
exactly the greedy tokens of one colocated server, on every transfer backend (shmem,
libfabric tcp, NIXL, Mooncake), with prefill TP 2 -> decode TP 1 and 1 -> 2, on three
architectures (Llama, Qwen3, Qwen2), streaming each layer's KV as the prefill forward
passes it (the default) over several prefill chunks; and SGLang's own PD path (upstream
mode, the comparison baseline) does too."""

from __future__ import annotations

import pytest

from sglang_disagg.launch import Mode

from .conftest import StackSpec, assert_same, run_concurrent, run_sequential

pytestmark = pytest.mark.e2e

CONFIGS = [
    pytest.param(StackSpec(backend="libfabric", provider="tcp"), id="messenger-libfabric-tcp"),
    pytest.param(StackSpec(backend="nixl"), id="messenger-nixl"),
    pytest.param(StackSpec(backend="mooncake"), id="messenger-mooncake"),
    pytest.param(StackSpec(backend="shmem", prefill_tp=2), id="messenger-shmem-tp2-tp1"),
    pytest.param(StackSpec(backend="libfabric", provider="tcp", decode_tp=2), id="messenger-libfabric-tcp-tp1-tp2"),
    pytest.param(StackSpec(backend="nixl", model="tiny-qwen3"), id="messenger-nixl-qwen3"),
    pytest.param(StackSpec(backend="shmem", model="tiny-qwen2"), id="messenger-shmem-qwen2"),
    pytest.param(StackSpec(mode=Mode.UPSTREAM, backend="mooncake"), id="upstream-mooncake"),
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
