"""Token-exact on a real model: smollm2-135m (30 layers, 9 / 3 heads), greedy, float32,
messenger mode on libfabric tcp and on shmem against one colocated server. Prompts: the
model's chat template around short and long questions (one longer than the prefill
chunk), a 1-token prompt (it never leaves the decoder) and a two-token one; then a chat
completion through the router answers a factual question in English."""

from __future__ import annotations

import pytest

from sglang_disagg.launch import Role
from sglang_disagg.launch.client import chat, generate_ids
from sglang_disagg.models import ensure_model

from .conftest import CHUNK, StackSpec, start_stack

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m"
TOKENS = 16
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Explain in two sentences why a transformer's KV cache grows with the prompt. "
    + "Consider prefill and decode servers that exchange the cache page by page over a network. " * 6,
]


def prompts() -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ensure_model(MODEL)))
    chats = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
             for q in QUESTIONS]
    chats = [list(c["input_ids"]) if isinstance(c, dict) or hasattr(c, "keys") else list(c) for c in chats]
    assert len(chats[-1]) > 2 * CHUNK, "one prompt must span several prefill chunks"
    return [[1], [1, 28], *chats]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, stacks):
    stacks.close()
    ps = prompts()
    colocated = start_stack(tmp_path_factory.mktemp("ref-smollm2"), StackSpec(role=Role.COLOCATED, model=MODEL))
    try:
        return ps, [generate_ids(colocated.url, p, TOKENS) for p in ps]
    finally:
        colocated.stop()


@pytest.mark.parametrize("spec", [StackSpec(model=MODEL, backend="libfabric", provider="tcp"),
                                  StackSpec(model=MODEL, backend="shmem")], ids=["libfabric-tcp", "shmem"])
def test_a_real_model_gives_the_colocated_tokens(stacks, reference, spec):
    ps, expected = reference
    stack = stacks.get(spec)
    got = [generate_ids(stack.url, p, TOKENS) for p in ps]
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"prompt {i} ({len(ps[i])} tokens): disaggregated {g} != colocated {e}"
    stats = stack.messenger_stats("decode")
    assert stats["requests_carried"] >= len(ps) - 1 and stats["requests_local"] >= 1, stats  # [1] stays local
    if spec.backend == "shmem":
        answer = chat(stack.url, QUESTIONS[0], MODEL, max_tokens=TOKENS)["choices"][0]["message"]["content"]
        assert answer == "The capital of France is Paris.", answer
