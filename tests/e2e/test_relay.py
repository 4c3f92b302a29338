"""An on-path attacker between a real decoder and a real prefill server (issue 41's relay test
at the messenger level; tests/backends/test_frame_auth.py does it for a bare backend link).

A second decoder (its own server, shmem) reaches the default stack's prefill server only
through harness/relay.py, which passes both handshakes untouched and then alters, replays,
injects or reorders one sealed frame carrying a PrefillOrder, every edit one that still
parses. For each: the fault is verified to have happened (the relay tampered, the prefill
server logged the failed seal, the decoder linked again through a new connection); the
requests in flight either come back token-exact (re-routed on the new link) or fail with a
reason, within a deadline; neither server holds a request or a page beyond its cache; the
next requests through the relay and through the stack's own decoder are token-exact."""

from __future__ import annotations

import time

import pytest

from harness.relay import Relay, prefill_order
from sglang_disagg.launch import Role
from sglang_disagg.launch.client import RequestError, generate_ids

from .conftest import OUTPUT_TOKENS, StackSpec, start_stack
from .faultlib import Call, wait_for, wait_released

pytestmark = pytest.mark.e2e

# A link reset fails the orders it carried at once (EOF); a failed request's pages then wait
# until the prefill server says what it posted (the Cancel is resent on the new link) or for
# every write to land: seconds, not the 30 s late-write limit (measured in the note).
ANSWER_S = 10.0
RELEASE_S = 10.0


@pytest.fixture(scope="module")
def relayed(stack, tmp_path_factory):
    relay = Relay(f"127.0.0.1:{stack.cfg.ports.bootstrap}", match=prefill_order)
    decoder = start_stack(tmp_path_factory.mktemp("relay"), StackSpec(role=Role.DECODE, backend="shmem"),
                          secret_file=stack.cfg.secret_file, prefill_messengers=(relay.address,))
    yield stack, decoder, relay
    decoder.stop()
    relay.close()


def _ready(decoder) -> bool:
    links = (decoder.messenger_stats("decode") or {}).get("links", {})
    return bool(links) and {v["state"] for v in links.values()} == {"ready"}


def _seal_failures(stack) -> int:
    prefill = next(p for p in stack.servers if p.spec.name == Role.PREFILL.value)
    return prefill.log_path.read_text(errors="replace").count("frame authentication failed")


@pytest.mark.parametrize("mode", ["alter", "replay", "inject", "swap"])
def test_a_relay_tampering_with_one_order_resets_the_link_and_loses_nothing(relayed, references, mode):
    stack, decoder, relay = relayed
    prompts, outputs = references("tiny-llama")
    wait_for("the relayed decoder's link", lambda: _ready(decoder), 10, 0.05)
    assert generate_ids(decoder.url, prompts[0], OUTPUT_TOKENS) == outputs[0]  # honest frames pass
    connections, failures = relay.connections, _seal_failures(stack)

    relay.arm(mode)
    calls = {i: Call(decoder.url, prompts[i], OUTPUT_TOKENS, timeout=ANSWER_S + 5) for i in (1, 2)}
    assert relay.done.wait(5.0), f"{mode}: the relay saw no order to tamper with"
    t0 = time.monotonic()
    wait_for("the prefill server refusing the tampered frame", lambda: _seal_failures(stack) > failures, 5, 0.05)
    for i, call in calls.items():
        call.result(ANSWER_S)
        if call.err is None:
            assert call.out == outputs[i], f"{mode}: prompt {i} {call.out} != colocated {outputs[i]}"
        else:
            # The reason names the prefill link that was reset (the relay's address, as the decoder knows it).
            assert isinstance(call.err, RequestError) and relay.address in call.err.body, f"{mode}: {call.err!r}"
    answered = max(c.done_at for c in calls.values()) - t0
    took_d, leak_d = wait_released("127.0.0.1", decoder.cfg.ports.decode_metrics, t0, RELEASE_S)
    took_p, leak_p = wait_released("127.0.0.1", stack.cfg.ports.prefill_metrics, t0, RELEASE_S)
    print(f"\nrelay | {mode} | answered {answered:.3f}s | decoder released {took_d:.3f}s | prefill released "
          f"{took_p:.3f}s | outcomes {['exact' if c.err is None else c.err.body[:160] for c in calls.values()]}",
          flush=True)
    assert leak_d == 0 and leak_p == 0, f"{mode}: held after the reset: decoder {leak_d}, prefill {leak_p}"

    wait_for("a new link through the relay", lambda: relay.connections > connections and _ready(decoder), 10, 0.05)
    for i in (3, 4):
        assert generate_ids(decoder.url, prompts[i], OUTPUT_TOKENS) == outputs[i], f"{mode}: prompt {i} after"
    assert generate_ids(stack.url, prompts[1], OUTPUT_TOKENS) == outputs[1]  # the stack's own decoder
