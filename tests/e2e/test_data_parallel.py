"""Data parallelism through the messenger: one messenger per server whatever its DP shape.

Each DP group of a server runs its own scheduler, KV pool and requests; group 0's leader
owns the server's one transfer backend and port, the other groups reach it over a Unix
socket (messenger/dpowner.py, dpproxy.py). Checked against colocated servers (greedy,
float32):
- attention DP (tiny-deepseek-v3, --tp 2 with 2 attention-DP groups of one rank) on the
  decoder, on the prefill server, and on both: the float64 reference's tokens, sequential and
  concurrent; on a DP decoder both groups carried requests (SGLang's DP controller picks the
  group; that group allocates and its Hello names its pool); on a DP prefill server both
  groups computed orders (the owner gives each order to the group with the fewest
  outstanding); the server has one backend instance (every group's describe names the same
  address);
- replica DP (tiny-llama, --dp-size 2 on the decoder): the colocated server's tokens, both
  replicas carried requests.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from sglang_disagg.launch import Role
from sglang_disagg.launch.client import generate_ids, greedy, post_json
from sglang_disagg.models import ensure_model, get_spec

from .conftest import StackSpec, assert_same, prompts_for, run_concurrent, run_sequential
from .test_deepseek_colocated import DP_TOKENS, assert_reference, reference

pytestmark = pytest.mark.e2e

DEEPSEEK = "tiny-deepseek-v3"
SHAPES = {  # (prefill attention-DP, decode attention-DP) over TP 2 where > 1
    "dp2-to-tp1": (2, 1),
    "tp1-to-dp2": (1, 2),
    "dp2-to-dp2": (2, 2),
}


def _spec(prefill_attn_dp: int, decode_attn_dp: int) -> StackSpec:
    return StackSpec(model=DEEPSEEK, prefill_tp=prefill_attn_dp, decode_tp=decode_attn_dp,
                     prefill_attn_dp=prefill_attn_dp, decode_attn_dp=decode_attn_dp)


def _groups_stats(stack, role: str, groups: int) -> list[dict]:
    return [stack.messenger_stats(role, g) or {} for g in range(groups)]


def _through_messenger(stack, groups: int) -> int:
    return sum(s.get("requests_carried", 0) + s.get("requests_local", 0) for s in _groups_stats(stack, "decode", groups))


@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_attention_dp_gives_the_reference_tokens(stacks, shape):
    p_dp, d_dp = SHAPES[shape]
    stack = stacks.get(_spec(p_dp, d_dp))
    prompts = prompts_for(DEEPSEEK)
    want = [r[:DP_TOKENS] for r in reference(get_spec(DEEPSEEK), ensure_model(DEEPSEEK), prompts)]
    time.sleep(0.3)  # the stack's own warm-up request is counted by then
    before = _through_messenger(stack, d_dp)
    assert_reference([generate_ids(stack.url, p, DP_TOKENS) for p in prompts], want, prompts, shape)
    with ThreadPoolExecutor(len(prompts)) as pool:  # both decode groups hold requests at once
        together = list(pool.map(lambda p: generate_ids(stack.url, p, DP_TOKENS), prompts))
    assert_reference(together, want, prompts, f"{shape}, concurrent")
    for role, dp in (("prefill", p_dp), ("decode", d_dp)):
        stats = _groups_stats(stack, role, dp)
        assert len({s.get("address") for s in stats}) == 1, f"{role}: more than one backend: {stats}"
        assert all(s.get("dp_groups") == dp for s in stats), stats
        counter = "orders" if role == "prefill" else "requests_carried"
        assert all(s.get(counter, 0) > 0 for s in stats), \
            f"{role}: {counter} per DP group {[s.get(counter) for s in stats]}: a group served nothing"
    # Every request went through a group's messenger (a 1-token prompt runs on the decoder:
    # local); the stats files are rewritten at most every 0.2 s, while the schedulers step.
    deadline, seen = time.monotonic() + 3.0, 0
    while time.monotonic() < deadline and seen != before + 2 * len(prompts):
        seen = _through_messenger(stack, d_dp)
        time.sleep(0.1)
    assert seen == before + 2 * len(prompts)


def test_replica_dp_decoder_gives_the_colocated_tokens(stacks):
    prompts = prompts_for("tiny-llama")
    colocated = run_sequential(stacks.get(StackSpec(role=Role.COLOCATED)).url, prompts)
    stack = stacks.get(StackSpec(model="tiny-llama", decode_dp=2))
    assert_same(run_sequential(stack.url, prompts), colocated, prompts)
    assert_same(run_concurrent(stack.url, prompts), colocated, prompts)
    stats = _groups_stats(stack, "decode", 2)
    assert [s.get("dp_group") for s in stats] == [0, 1]
    assert all(s.get("requests_carried", 0) > 0 for s in stats), [s.get("requests_carried") for s in stats]
    replicas = {post_json(f"{stack.url}/generate", {"input_ids": p, "sampling_params": greedy(1)})["meta_info"]
                .get("dp_rank") for p in prompts[:4]}
    assert replicas == {0, 1}, replicas
