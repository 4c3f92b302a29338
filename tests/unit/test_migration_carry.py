"""What of a running request moves with it (migration/carry.py), read from SGLang's own Req
and SamplingParams: a greedy request cut after k outputs resumes on B with prompt + outputs as
input (the last output runs first there), the budget and minimum reduced by k; every state
that cannot move yet is refused with its reason, so the request stays on its decoder."""

from __future__ import annotations

from array import array

import pytest
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.sampling.sampling_params import SamplingParams

from sglang_disagg.messenger.migration.carry import Carried, refusals
from sglang_disagg.messenger.migration.source import MigrationRefused

PROMPT = [11, 12, 13, 14, 15, 16, 17]


def _req(outputs=(101, 102, 103, 104, 105), **params) -> Req:
    params = {"max_new_tokens": 80, "temperature": 0.0, **params}
    extra = {k: params.pop(k) for k in ("return_logprob", "lora_id", "custom_logit_processor") if k in params}
    r = Req("rid-1", "", array("q", PROMPT), SamplingParams(**params), **extra)
    r.output_ids = array("q", outputs)
    return r


def test_a_greedy_request_resumes_with_its_outputs_as_input_and_its_budgets_reduced():
    c = Carried.of(_req(min_new_tokens=8, stop_token_ids={2, 7}, ignore_eos=False))
    assert c.kv_tokens == len(PROMPT) + 4, "A writes the KV of all but the last output, which runs first on B"
    body = c.resume()
    assert body["input_ids"] == PROMPT + [101, 102, 103, 104, 105]
    sp = body["sampling_params"]
    assert (sp["max_new_tokens"], sp["min_new_tokens"], sp["temperature"]) == (75, 3, 0.0)
    assert sp["stop_token_ids"] == [2, 7]
    # B's parameters are valid SGLang sampling parameters as given.
    SamplingParams(**sp).verify(vocab_size=32000)


def test_the_minimum_does_not_go_below_zero_and_a_spent_budget_is_not_a_migration():
    assert Carried.of(_req(min_new_tokens=2)).resume()["sampling_params"]["min_new_tokens"] == 0
    with pytest.raises(ValueError, match="is done"):
        Carried.of(_req(outputs=tuple(range(80))))


@pytest.mark.parametrize("params,reason", [
    ({"temperature": 0.7, "sampling_seed": 5}, "other than greedy"),
    ({"frequency_penalty": 0.5}, "frequency penalty"),
    ({"presence_penalty": 0.5}, "presence penalty"),
    ({"repetition_penalty": 1.2}, "repetition penalty"),
    ({"stop": ["end"]}, "stop string"),
    ({"structural_tag": '{"structures": [], "triggers": []}'}, "structural tag"),
    ({"n": 2}, "n > 1"),
    ({"logit_bias": {"5": 1.0}}, "logit bias"),
    ({"return_logprob": True}, "logprobs"),
    ({"lora_id": "adapter"}, "LoRA"),
])
def test_what_cannot_move_yet_is_refused_with_its_reason(params, reason):
    req = _req(**params)
    assert any(reason in r for r in refusals(req)), refusals(req)
    with pytest.raises(MigrationRefused, match="cannot migrate"):
        Carried.of(req)


def test_waiting_and_finished_requests_are_not_migrated():
    assert any("no output token yet" in r for r in refusals(_req(outputs=())))
    assert refusals(_req()) == []


@pytest.mark.parametrize("rid,want", [
    ("migrate-after-5-x", (5, "http://b:1")), ("migrate-after-50-1", (50, "http://b:1")),
    ("migrate-after-5-port-4321-x", (5, "http://127.0.0.1:4321")), ("migrate-after-0-x", None),
    ("migrate-after-x", None), ("plain-1", None), ("migrate-after--5", None),
    ("migrate-after-5-x.m12", None), ("migrate-after-5-x.m12g5", None),  # arrived by migration: not sent on
])
def test_the_test_hook_reads_its_count_and_target_from_the_request_id(rid, want):
    from sglang_disagg.messenger.migration.hook import TestHook

    assert TestHook("http://b:1").after(rid) == want


@pytest.mark.parametrize("finish,want", [
    ({"type": "length", "length": 75}, ("length", 80)), ({"type": "stop", "matched": 2}, ("stop", 2)),
    ({"type": "stop", "matched": "END"}, ("stop", "END")), ({"type": "abort", "message": "gone"}, ("abort", "gone")),
    ({"type": "stop", "matched": True}, ("abort", "the migrated request ended")),
])
def test_the_new_decoders_finish_reason_is_reported_as_one_decoder_would(finish, want):
    from sglang_disagg.messenger.migration.relay import finish_reason

    got = finish_reason(finish, 80).to_json()
    kind, detail = want
    assert got["type"] == kind
    assert got.get("length", got.get("matched", got.get("message"))) == detail, got


def test_a_sampled_request_moves_only_under_deterministic_inference_with_its_distribution_and_seed():
    req = _req(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, sampling_seed=1234)
    assert any("--enable-deterministic-inference" in r for r in refusals(req))
    assert refusals(req, deterministic=True) == []
    sp = Carried.of(req, deterministic=True).resume()["sampling_params"]
    assert (sp["temperature"], sp["top_p"], sp["top_k"], sp["min_p"], sp["sampling_seed"]) == (0.7, 0.9, 40, 0.05, 1234)
    SamplingParams(**sp).verify(vocab_size=32000)
    # No seed: none is sent, and B draws from SGLang's default seed (42) at the same positions, as A did.
    unseeded = Carried.of(_req(temperature=0.7), deterministic=True).resume()["sampling_params"]
    assert "sampling_seed" not in unseeded and unseeded["temperature"] == 0.7
    greedy = Carried.of(_req(), deterministic=True).resume()["sampling_params"]
    assert greedy["temperature"] == 0.0 and "top_k" not in greedy


def test_the_new_decoder_refuses_what_it_could_not_continue_exactly():
    from types import SimpleNamespace

    from sglang_disagg.messenger.migration.carry import migration_refused
    from sglang_disagg.messenger.migration.room import SourceError

    plain = SimpleNamespace(enable_deterministic_inference=False, speculative_algorithm=None)
    migration_refused(plain, _req())  # greedy: any decoder
    with pytest.raises(SourceError, match="--enable-deterministic-inference"):
        migration_refused(plain, _req(temperature=0.7, sampling_seed=3))
    migration_refused(SimpleNamespace(enable_deterministic_inference=True, speculative_algorithm=None),
                      _req(temperature=0.7, sampling_seed=3))
    # a speculative decoder continues a greedy request (first contact checked the draft is A's)
    migration_refused(SimpleNamespace(enable_deterministic_inference=False, speculative_algorithm="EAGLE"), _req())


def test_a_grammar_moves_and_the_new_decoder_replays_the_outputs_through_it_first():
    from types import SimpleNamespace

    from sglang_disagg.messenger.migration.carry import migration_refused
    from sglang_disagg.messenger.migration.room import SourceError

    schema = '{"type": "object"}'
    c = Carried.of(_req(json_schema=schema))
    assert c.grammar and c.resume()["sampling_params"]["json_schema"] == schema

    class Grammar:  # records what it accepts; refuses token 999 as a grammar backend would
        def __init__(self):
            self.accepted = []

        def accept_token(self, t):
            if t == 999:
                raise ValueError("Tokens not accepted: 999")
            self.accepted.append(t)

    args = SimpleNamespace(enable_deterministic_inference=False, speculative_algorithm=None)
    b_req = _req()  # B's request: prompt + A's outputs as input
    b_req.origin_input_ids = array("q", PROMPT + [101, 102, 103])
    b_req.grammar = Grammar()
    migration_refused(args, b_req, replay=3)
    assert b_req.grammar.accepted == [101, 102, 103]
    b_req.grammar, b_req.origin_input_ids[-1] = Grammar(), 999
    with pytest.raises(SourceError, match="does not accept its outputs"):
        migration_refused(args, b_req, replay=3)
    b_req.grammar = None
    with pytest.raises(SourceError, match="no grammar"):
        migration_refused(args, b_req, replay=3)
