"""Live migration from a TP 2 decoder to a TP 1 one (issue 43), over NIXL (UCX), on real
SGLang servers (test_migration.py covers shmem and libfabric tcp, test_migration_mla.py Mooncake): A's leader decides each cut and each settling, every rank applies it in the
same scheduler iteration (messenger/migration/lockstep.py), and A's leader writes both
ranks' head shards into B's pages (the prefill-to-decode planner, TP 2 -> 1).

- a request cut after 5 and after 50 tokens ends exactly as the same request never moved
  (and as the colocated server), A wrote the request's KV and nothing more (the floor);
- the other way, B (TP 1) to A (TP 2), cut after 5 tokens: exact, B's leader writing each page's
  heads into A's two ranks, half each (the floor again);
- a migration whose target dies leaves the request on A (both ranks take it back into their
  waiting queue together): exact again;
- a drain moves 4 concurrent streams while A's batch keeps changing: each ends exact.
A and B hold no request and no page after each. A runs with ``--migration-rate`` (RATE_MB_S):
no migration's KV went out faster than the cap allows (bytes <= rate x hand-over time + one
bucket + one group), and the drain took at least what its bytes need at that rate.

Stack: decoder_pair (test_migration.py) with A's decoder at TP 2 and B's test hook aimed at A."""

from __future__ import annotations

import time

import pytest

from sglang_disagg.launch.client import generate_ids
from sglang_disagg.messenger.migration.pacer import BURST_S
from sglang_disagg.messenger.planner import pages_for
from sglang_disagg.models import get_spec

from .conftest import OUTPUT_TOKENS
from .faultlib import wait_for, wait_released
from .test_migration import (LONG, Streamed, _decoder, _drain, _free, _m, _migrations, _served, _traced,
                             decoder_pair, dying_target_leaves_it_on_a)
from .faultlib import value

pytestmark = pytest.mark.e2e

RATE_MB_S = 2.0  # a request here holds 0.45-0.6 MB of KV: 0.2-0.3 s at the cap, 10-70 ms without
SLACK = RATE_MB_S * 1e6 * BURST_S + (64 << 10)  # one bucket, and one write group past it


def _within_cap(trace: dict) -> None:
    assert trace["bytes"] <= RATE_MB_S * 1e6 * trace["hand_over_s"] + SLACK, \
        f"{trace['bytes']} bytes in {trace['hand_over_s']} s: faster than --migration-rate {RATE_MB_S} MB/s"


@pytest.fixture(scope="module")
def tp_pair(tmp_path_factory, references):
    references("tiny-llama")  # the colocated reference first: one stack at a time on 2 cores
    with decoder_pair(tmp_path_factory.mktemp("migration-tp2"), "tiny-llama", "nixl", None, a_tp=2, b_to_a=True,
                      migration_rate_mb_s=RATE_MB_S) as pair:
        yield pair


def test_a_tp2_decoder_hands_a_request_to_a_tp1_one_after_5_and_50_tokens_exact(tp_pair, references):
    a, b = tp_pair
    assert a.cfg.decode_tp == 2 and b.cfg.decode_tp == 1
    prompts, outputs = references("tiny-llama")
    url, prompt = _decoder(a).url, prompts[-2]
    plain = generate_ids(url, prompt, LONG, rid="plain-tp2")
    assert plain[:OUTPUT_TOKENS] == outputs[-2], "A at TP 2 gives the colocated tokens"
    for n, k in enumerate((5, 50), 1):
        served = _served(a)
        got = generate_ids(url, prompt, LONG, rid=f"migrate-after-{k}-tp2")
        assert got == plain, f"migrated TP 2 -> 1 after {k} tokens: {got} != unmigrated {plain}"
        assert _served(a) == served + 1, "one prefill order (A's own): nothing recomputed for B"
        stats = _traced(a, n)
        trace = stats["migrations"][-1]
        assert trace["outputs_at_cut"] == k and trace["kv_tokens"] == len(prompt) + k - 1, trace
        # kv_page_bytes: one page of every layer, each KV head once (both ranks' shards together)
        floor = pages_for(trace["kv_tokens"], stats["page_size"]) * stats["kv_page_bytes"]
        assert trace["bytes"] == floor, f"A wrote {trace['bytes']} bytes, the request's KV is {floor}"
        _within_cap(trace)
        print(f"\nmigration | TP 2 -> 1 after {k}: {trace['kv_tokens']} tokens of KV, {trace['bytes']} bytes "
              f"({trace['writes']} writes), hand-over {trace['hand_over_s'] * 1000:.1f} ms")
    dying_target_leaves_it_on_a(a, prompts[4], outputs[4], "tp2")  # BACK: both ranks' waiting queues
    _free(a, b)


def test_a_tp1_decoder_hands_a_request_to_a_tp2_one_exact(tp_pair, references):
    a, b = tp_pair
    prompts, outputs = references("tiny-llama")
    prompt = prompts[-2]
    plain = generate_ids(b.url, prompt, LONG, rid="plain-tp1")
    assert plain[:OUTPUT_TOKENS] == outputs[-2], "B at TP 1 gives the colocated tokens"
    served, handed = _served(a), _migrations(b, "handed_over")
    got = generate_ids(b.url, prompt, LONG, rid="migrate-after-5-tp1")
    assert got == plain, f"migrated TP 1 -> 2 after 5 tokens: {got} != unmigrated {plain}"
    assert _served(a) == served + 1, "one prefill order (B's own): nothing recomputed for A"
    assert _migrations(b, "handed_over") == handed + 1
    stats = _traced(b, 1)
    trace = stats["migrations"][-1]
    assert trace["outputs_at_cut"] == 5 and trace["kv_tokens"] == len(prompt) + 4, trace
    pages = pages_for(trace["kv_tokens"], stats["page_size"])
    assert trace["bytes"] == pages * stats["kv_page_bytes"], "the request's KV, the floor"
    assert trace["writes"] == pages * get_spec("tiny-llama").num_layers * 2 * 2, \
        "each page's K and V of every layer in two writes, half the heads into each of A's ranks"
    print(f"\nmigration | TP 1 -> 2 after 5: {trace['bytes']} bytes ({trace['writes']} writes), "
          f"hand-over {trace['hand_over_s'] * 1000:.1f} ms")
    _free(a, b)


def test_a_drain_of_a_tp2_decoder_moves_its_streams_while_its_batch_changes(tp_pair, references):
    a, b = tp_pair
    prompts, _ = references("tiny-llama")
    url, n = _decoder(a).url, 120
    chosen = [prompts[k] for k in (2, 3, 4, 5)]
    plain = [generate_ids(url, p, n, rid=f"plain-tp2-drain-{i}") for i, p in enumerate(chosen)]
    handed = _migrations(a, "handed_over")
    streams = [Streamed(url, p, n, f"tp2-drain-{i}") for i, p in enumerate(chosen)]
    wait_for("every stream decoding", lambda: all(t.events >= 5 for t in streams), 60, 0.01)
    code, body = _drain(a, "POST", {"to": [b.url]})
    assert code == 202 and body["draining"], body
    t0 = time.monotonic()
    wait_for("the drained decoder holding nothing", lambda: _drain(a)[1].get("done"), 20, 0.05)
    t_free, leaked = wait_released(a.cfg.host, a.cfg.ports.decode_metrics, t0, 10.0)
    assert leaked == 0
    for t in streams:
        t.join(120)
    assert [t.err for t in streams] == [None] * len(streams), [repr(t.err) for t in streams]
    for i, t in enumerate(streams):
        assert t.out == plain[i], f"stream {i}: drained from TP 2 != unmigrated"
    assert _migrations(a, "handed_over") - handed == len(streams)
    traces = [t for t in _traced(a, 1)["migrations"] if str(t["rid"]).startswith("tp2-drain-")]
    assert len(traces) == len(streams)
    for trace in traces:
        _within_cap(trace)
    moved = sum(t["bytes"] for t in traces)
    assert t_free >= (moved - SLACK) / (RATE_MB_S * 1e6), f"{moved} bytes left A in {t_free:.2f} s"
    assert value(_m(a), "sglang_disagg_migration_relays") == 0
    _free(a, b)
    print(f"\nmigration | drain of {len(streams)} streams from a TP 2 decoder at --migration-rate {RATE_MB_S}: "
          f"{moved} bytes, A held nothing {t_free:.2f}s after (the cap's floor {moved / RATE_MB_S / 1e6:.2f}s)")
