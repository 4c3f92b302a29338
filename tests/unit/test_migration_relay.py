"""Decoder A's relay of a migrated speculative request: B's counters (verify steps, accepted
drafts, histogram) are added to A's from before the cut, so the client's totals count every
verify step; what B sends is checked before it is believed (B is a peer)."""

from __future__ import annotations

from types import SimpleNamespace

from sglang_disagg.messenger.migration.relay import MAX_HISTOGRAM, Relay, merge_speculation


def _relay() -> Relay:
    return Relay("http://127.0.0.1:1", {}, None, lambda: None)


def _event(relay: Relay, **meta) -> None:
    relay._event({"output_ids": [1], "meta_info": {"completion_tokens": 1, **meta}})


def test_b_counters_are_added_to_a_counters_at_the_cut():
    relay = _relay()
    _event(relay, spec_verify_ct=3, spec_num_correct_drafts=2, spec_correct_drafts_histogram=[1, 2])
    _event(relay)  # an event without counters (no verify step yet reported) keeps the last ones
    req = SimpleNamespace(spec_verify_ct=4, spec_num_correct_drafts=1, spec_correct_drafts_histogram=[3, 1])
    merge_speculation(req, (4, 1, (3, 1)), relay.speculation())
    assert (req.spec_verify_ct, req.spec_num_correct_drafts, req.spec_correct_drafts_histogram) == (7, 3, [4, 3])
    merge_speculation(req, (4, 1, (3, 1)), relay.speculation())  # idempotent: B's counters are cumulative
    assert req.spec_verify_ct == 7


def test_a_request_b_never_verified_keeps_a_counters():
    req = SimpleNamespace(spec_verify_ct=4, spec_num_correct_drafts=1, spec_correct_drafts_histogram=[3, 1])
    merge_speculation(req, (4, 1, (3, 1)), _relay().speculation())
    assert (req.spec_verify_ct, req.spec_correct_drafts_histogram) == (4, [3, 1])


def test_malformed_counters_from_b_are_not_believed():
    relay = _relay()
    _event(relay, spec_verify_ct="3", spec_correct_drafts_histogram=[1])
    assert relay.speculation() == (0, 0, ())
    _event(relay, spec_verify_ct=2, spec_num_correct_drafts=-5, spec_correct_drafts_histogram=[0] * (MAX_HISTOGRAM + 1))
    assert relay.speculation() == (2, 0, ())
