"""Layer-by-layer streaming and decode-side prefix reuse, on the default stack.

- Streaming happened: the first layer's writes of a chunk completed before that chunk's
  forward ended (timestamps from the prefill messenger, one clock: CLOCK_MONOTONIC).
- The negative control: posting a layer's writes before its KV exists (and waiting for
  them) gives different tokens, so the equivalence tests would catch a streamer that ran
  ahead of the forward.
- A 5-turn chat transfers only the pages of tokens new since the previous turn (the
  decoder's radix tree holds the rest) and stays token-exact.
"""

from __future__ import annotations

import time

import pytest

from sglang_disagg.testsupport import FAULT_ENV
from sglang_disagg.launch.client import generate_ids
from sglang_disagg.messenger.planner import pages_for

from .conftest import OUTPUT_TOKENS, StackSpec, conversation, conversation_refs, run_sequential, start_stack

pytestmark = pytest.mark.e2e

def _counters(stack, role, until, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = stack.messenger_stats(role)
        if stats and until(stats):
            return stats
        time.sleep(0.05)
    raise AssertionError(f"{role} counters never met the condition: {stack.messenger_stats(role)}")


def test_the_first_layer_is_written_before_the_last_layer_of_its_forward_ends(stack):
    prompt = [1] + [9 + (i * 13) % 3900 for i in range(700)]  # 11 chunks of 64, 44 pages
    generate_ids(stack.url, prompt, 1)
    stats = _counters(stack, "prefill", lambda s: any(r["tokens"] == 700 for r in s["recent"]))
    assert stats["streaming"]
    r = next(r for r in reversed(stats["recent"]) if r["tokens"] == 700)
    # Times of the order's last chunk: layer 0's writes were posted and had landed while the
    # forward still ran layers 1..3. When the last layer is posted relative to the forward's
    # return is a race between two threads on a busy machine (the last counter bump comes
    # microseconds before the return), so it is only ordered after layer 0.
    assert r["layer0_posted"] < r["layer0_written"] < r["forward_end"], r
    assert r["layer0_posted"] <= r["last_layer_posted"], r


def test_writes_posted_before_the_kv_exists_give_different_tokens(tmp_path, references):
    prompts, expected = references("tiny-llama")
    spec = StackSpec(backend="shmem", env=((FAULT_ENV, "early_writes"),))
    early = start_stack(tmp_path, spec)
    try:
        got = run_sequential(early.url, prompts)
    finally:
        early.stop()
    assert all(len(g) == OUTPUT_TOKENS for g in got)
    # The 2-token prompt prefills only <bos>, whose KV the launcher's readiness probe left in
    # the very page this request gets again: stale memory that happens to be right.
    stale_but_right = [i for i, p in enumerate(prompts) if len(p) == 2]
    carried = [i for i, p in enumerate(prompts) if len(p) > 2]
    differing = [i for i, (g, e) in enumerate(zip(got, expected)) if g != e]
    assert differing == carried, f"only prompts {differing} of {carried} differ with early writes"
    assert stale_but_right


def test_a_chat_transfers_only_the_pages_new_since_the_previous_turn(stack):
    seen: list[tuple[dict, int]] = []
    state = {"tree_tokens": 0}

    def before_turn(k, prompt):
        stats = _counters(stack, "decode", lambda s: True)
        if k:  # the previous turn has finished: its counters are published
            stats = _counters(stack, "decode", lambda s: s["requests_carried"] > seen[-1][0]["requests_carried"])
        seen.append((stats, len(prompt)))

    outputs = conversation(stack.url, "tiny-llama", on_turn=before_turn)
    assert outputs == conversation_refs["tiny-llama"]  # token-exact, every turn
    final = _counters(stack, "decode", lambda s: s["requests_carried"] > seen[-1][0]["requests_carried"])
    counts = [s for s, _ in seen[1:]] + [final]
    for k, ((before, n), after) in enumerate(zip(seen, counts)):
        # The tree holds the previous turn's prompt + answer (all but its last token) in
        # whole pages of 16; only the pages after them travel: 4 layers x K/V writes each.
        reused = state["tree_tokens"] // 16
        assert after["pages_reused"] - before["pages_reused"] == reused, (k, before, after)
        assert after["writes_received"] - before["writes_received"] == (pages_for(n - 1, 16) - reused) * 8
        state["tree_tokens"] = n + len(outputs[k]) - 1
        if k:
            assert reused > 0
