"""The messenger mode's own promises, on the launcher's default stack (shmem):
structured output is built on the decoder only, a request costs exactly the planner's
writes, a 1-token prompt never leaves the decoder, a prefill server serves decoders only,
and first contact refuses a decoder that runs another model."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from sglang_disagg.backends import auth

from sglang_disagg.launch import Role, StartupError
from sglang_disagg.launch.client import RequestError, generate_ids
from sglang_disagg.messenger.planner import pages_for

from .conftest import StackSpec, start_stack, structured, structured_refs

pytestmark = pytest.mark.e2e

def _stats(stack, role="decode", until=lambda s: True):
    """The messenger's counters once settled (published every 0.2 s at most while they
    change, so two equal reads 0.5 s apart are current) and satisfying `until`."""
    deadline = time.monotonic() + 10
    last = None
    while time.monotonic() < deadline:
        stats = stack.messenger_stats(role)
        if stats == last and until(stats):
            return stats
        last = stats
        time.sleep(0.5)
    raise AssertionError(f"{role} counters never settled or met the condition: {last}")


def test_structured_output_matches_colocated_and_prefill_builds_no_grammar(stack, references):
    prompts, _ = references("tiny-llama")
    got = structured(stack.url, prompts[-1])
    want = structured_refs["tiny-llama"]
    assert got["output_ids"] == want["output_ids"]
    assert got["text"] == want["text"] and got["text"].startswith("{")
    assert _stats(stack, "decode")["grammars_compiled"] >= 1
    assert _stats(stack, "prefill")["grammars_compiled"] == 0


@pytest.mark.parametrize("n_tokens", [2, 17, 100, 165])
def test_a_request_costs_pages_times_layers_writes(stack, n_tokens):
    before = _stats(stack)
    # a second token no other prompt here starts with, so no page is a prefix the
    # decoder already holds (decode-side prefix reuse would rightly skip its writes)
    generate_ids(stack.url, [1] + [2000 + 7 * n_tokens + i % 1000 for i in range(n_tokens - 1)], 2)
    after = _stats(stack, until=lambda s: s["requests_carried"] > before["requests_carried"])
    # prompt minus its last token, pages of 16, 4 layers, K and V, prefill TP 1 -> decode TP 1
    assert after["writes_received"] - before["writes_received"] == pages_for(n_tokens - 1, 16) * 4 * 2
    assert after["requests_carried"] - before["requests_carried"] == 1


def test_a_one_token_prompt_never_leaves_the_decoder(stack):
    before = _stats(stack)
    assert len(generate_ids(stack.url, [1], 4)) == 4
    after = _stats(stack, until=lambda s: s["requests_local"] > before["requests_local"])
    assert after["requests_local"] == before["requests_local"] + 1
    assert after["requests_carried"] == before["requests_carried"]


def test_the_stack_records_when_each_part_became_ready(stack):
    """First contact in order: both servers healthy, then the router, then a routed request
    (benchmarks/startup.py reports these phases)."""
    p = stack.phases
    assert set(p) == {"prefill healthy", "decode healthy", "router healthy", "routable"}, p
    assert max(p["prefill healthy"], p["decode healthy"]) <= p["router healthy"] <= p["routable"], p
    assert p["routable"] <= stack.startup_s


def test_the_openai_model_id_is_the_models_name(stack):
    with urllib.request.urlopen(stack.url + "/v1/models", timeout=10) as r:
        models = json.load(r)["data"]
    assert [m["id"] for m in models] == ["tiny-llama"]


def test_the_prefill_server_serves_decoders_only(stack):
    prefill_url = stack.servers[0].url
    with pytest.raises(RequestError) as err:
        generate_ids(prefill_url, [1, 2, 3], 4)
    assert "prefill server in messenger mode" in err.value.body


def test_first_contact_refuses_a_decoder_running_another_model(tmp_path):
    secret = tmp_path / "secret"  # servers started one by one share the deployment's secret
    secret.write_text(auth.new_secret())
    prefill = start_stack(tmp_path, StackSpec(role=Role.PREFILL, model="tiny-qwen3"), secret_file=str(secret))
    try:
        with pytest.raises(StartupError) as err:
            start_stack(tmp_path, StackSpec(role=Role.DECODE, model="tiny-llama"), secret_file=str(secret),
                        prefill_messengers=(f"127.0.0.1:{prefill.cfg.ports.bootstrap}",))
        message = str(err.value)
        assert "refused" in message and "model differs" in message
        assert "tiny-llama" in message and "tiny-qwen3" in message
    finally:
        prefill.stop()
    assert "Traceback" not in message, message  # a reason the launcher prints, not a stack dump
