"""Live migration with an attention-DP decoder on either side (tiny-deepseek-v3, float32, shmem):
decoder A runs attention DP 2 over TP 2 (two scheduler groups, each with its own KV pool and
requests, one messenger address whose owner is group 0: messenger/dp/owner.py), decoder B runs
TP 1, both on A's prefill server. Requests are cut after 5 output tokens (test hook) and must end
exactly as on one colocated server (all OUTPUT_TOKENS).

- Out of A, from both groups: B's order for a request group 1 holds reaches group 1 (before, the
  owner gave every message of B to group 0, which held nothing: the request stayed on A).
- Into A, alternating between its groups: each group's KV lands in its own pool (before, B keyed
  its links by A's backend instance, so group 0's Hello took group 1's later orders and their KV
  went into group 0's pool: group 1 continued from the wrong KV, different tokens).
Nothing recomputed (one prefill order per request, B's KV from A) and nothing held afterwards, in
either group. Own module: the reference stack closes first (one stack pair at a time on 2 cores).
"""

from __future__ import annotations

import pytest

from sglang_disagg.launch.client import generate_ids
from sglang_disagg.messenger.planner import pages_for

from .conftest import OUTPUT_TOKENS
from .deepseek_pd import MODEL
from .faultlib import wait_until
from .test_migration import decoder_pair, _decoder, _free, _served

pytestmark = pytest.mark.e2e

GROUPS = 2


@pytest.fixture(scope="module")
def dp_pair(tmp_path_factory, deepseek_reference, stacks):
    stacks.close()  # the pool's reference stack would compete for the 2 cores
    with decoder_pair(tmp_path_factory.mktemp("migration-dp"), MODEL, "shmem", a_tp=GROUPS,
                      decode_attn_dp=GROUPS, b_to_a=True) as pair:
        yield pair


def _groups(a) -> list[dict]:
    return [a.messenger_stats("decode", g) or {} for g in range(GROUPS)]


def _four(deepseek_reference) -> list[int]:
    """Four prompts, long (several latent pages) to one token: alternating groups take them."""
    n = len(deepseek_reference.prompts)
    return [n - 3, n - 2, 1, 2]


def _held(s: dict) -> int:
    """Requests and relays a group's messenger holds, and KV pages held by nothing (allocated
    beyond the radix cache's, or locked), from its stats file (faultlib.leaked_pages's rule)."""
    pages = s.get("scheduler", {}).get("sglang_disagg_kv_pages", {})
    queues = s.get("scheduler", {}).get("sglang_disagg_queue_depth", {})
    return (sum(s.get("in_flight", {"?": 1}).values()) + s.get("relays_active", 1) + queues.get("running", 1)
            + pages.get("allocated", 1) - pages.get("cached", 0) + pages.get("locked", 0))


def _nothing_held(a, b) -> None:
    _free(b)
    # A's metrics port is group 0's; each group publishes its own stats file (0.2 s apart at most)
    assert wait_until(lambda: not any(_held(s) for s in _groups(a)), 5.0), \
        f"A's groups still hold something: {[_held(s) for s in _groups(a)]}: {_groups(a)}"


def test_requests_cut_in_either_group_of_an_attention_dp_decoder_end_exact_on_a_tp1_one(dp_pair, deepseek_reference):
    a, b = dp_pair
    prompts, outputs = deepseek_reference.prompts, deepseek_reference.outputs
    for i, k in enumerate(_four(deepseek_reference)):
        served = _served(a)
        got = generate_ids(_decoder(a).url, prompts[k], OUTPUT_TOKENS, rid=f"migrate-after-5-out{i}")
        assert got == outputs[k], f"out of A, prompt {k}: {got} != colocated {outputs[k]}"
        assert _served(a) == served + 1, "B recomputed nothing: its KV came from A"
    assert wait_until(lambda: sum(len(s.get("migrations", [])) for s in _groups(a)) == 4, 5.0), _groups(a)
    traces = {g: s["migrations"] for g, s in enumerate(_groups(a))}
    assert all(traces.values()), f"every group handed a request over: {traces}"
    for s in _groups(a):
        for t in s["migrations"]:
            assert t["outputs_at_cut"] == 5, t
            assert t["bytes"] == pages_for(t["kv_tokens"], s["page_size"]) * s["kv_page_bytes"], t
    _nothing_held(a, b)


def test_requests_cut_on_a_tp1_decoder_end_exact_in_either_group_of_an_attention_dp_one(dp_pair, deepseek_reference):
    a, b = dp_pair
    prompts, outputs = deepseek_reference.prompts, deepseek_reference.outputs
    for i, k in enumerate(_four(deepseek_reference) * 2):  # each group takes several, after the other said Hello
        served = _served(a)
        got = generate_ids(b.url, prompts[k], OUTPUT_TOKENS, rid=f"migrate-after-5-in{i}")
        assert got == outputs[k], f"into A, request {i} (prompt {k}): {got} != colocated {outputs[k]}"
        assert _served(a) == served + 1, "A recomputed nothing: its KV came from B"
    took = [[r["rid"] for r in s.get("recent", []) if "migrate-after-5-in" in r["rid"]] for s in _groups(a)]
    assert all(len(t) >= 2 for t in took), f"each of A's groups took migrated requests more than once: {took}"
    _nothing_held(a, b)
