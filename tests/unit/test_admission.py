"""Decode-side admission rules (messenger/admission.py) on stand-in requests; the page
allocation itself runs against SGLang's pools in the e2e tests."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sglang_disagg.messenger.admission import DECODE_CAP, decode_room, promised_room, runs_locally
from sglang_disagg.messenger.requests import HANDOFF_ATTR


def request(**kw):
    base = dict(to_finish=None, multimodal_inputs=None, input_embeds=None, return_logprob=False,
                logprob_start_len=-1, session=None, output_ids=[],
                sampling_params=SimpleNamespace(max_new_tokens=32), finished=lambda: False)
    return SimpleNamespace(**(base | kw))


@pytest.mark.parametrize("kw, n, why", [
    ({}, 5, ""),
    ({}, 0, "a 1-token prompt is its own first decode step"),
    ({"to_finish": "too long"}, 5, "already finished (rejected at intake)"),
    ({"multimodal_inputs": object()}, 5, "multimodal or embedding input"),
    ({"return_logprob": True, "logprob_start_len": 0}, 5, "input logprobs need the prompt's logits"),
    ({"return_logprob": True, "logprob_start_len": -1}, 5, ""),  # output logprobs only: carried
    ({"session": object()}, 5, "session request"),
])
def test_which_requests_the_messenger_carries(kw, n, why):
    assert runs_locally(request(**kw), n) == why


def test_decode_room_is_what_is_left_to_generate_capped_like_sglang_plus_a_page():
    assert decode_room(request(), 16) == 32 + 16
    assert decode_room(request(output_ids=[7] * 30), 16) == 2 + 16
    assert decode_room(request(output_ids=[7] * 40), 16) == 16  # past max_new_tokens: never negative
    huge = request(sampling_params=SimpleNamespace(max_new_tokens=10**6))
    assert decode_room(huge, 16) == DECODE_CAP + 16


def test_promised_room_counts_held_queued_handed_off_and_running_requests():
    held, queued, local, running = request(), request(), request(), request(output_ids=[1] * 16)
    setattr(queued, HANDOFF_ATTR, 10)
    sched = SimpleNamespace(waiting_queue=[queued, local], running_batch=SimpleNamespace(reqs=[running]))
    # `local` waits for the decoder's own prefill and holds no prompt pages of ours: not promised
    assert promised_room(sched, [held], 16) == (32 + 16) * 2 + (16 + 16)
