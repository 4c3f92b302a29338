"""DeepSeek-shaped models served colocated on CPU (torch_native, float32): the A/B reference
for the MLA messenger.

tiny-deepseek-v3 (MLA with q LoRA, MoE with grouped noaux_tc routing, a NEXTN layer the
server does not use without speculation) serves the suite's prompts (1 and 2 tokens, chat-like
texts, one longer than a prefill chunk, one sharing its first chunk, the long one again: a
radix-cache hit); the same tokens come back for a second request of each prompt and for the
prompts sent concurrently. Every token is the float64 reference's (models.deepseek.forward,
itself equal to transformers' DeepseekV3 within 1e-5: the unit tests), so the server
computes the model, not merely something repeatable, and every server start gives the same
tokens (one fixed reference; a second start in this module cost 16 s and proved no more). The
other config shapes promised through ``--model-path DIR`` (harness/deepseek.py: a V2
without q LoRA, a V3 without NEXTN) are generated here and checked the same way.
"""

from __future__ import annotations

import pytest

from harness.deepseek import V2_NO_Q_LORA, V3_NO_NEXTN, checkpoint
from sglang_disagg.launch import Role
from sglang_disagg.models import ensure_model, get_spec

from .conftest import OUTPUT_TOKENS, StackSpec, assert_same, prompts_for, run_concurrent, run_sequential

pytestmark = pytest.mark.e2e

MODEL = "tiny-deepseek-v3"
DP_TOKENS = 8


def reference(spec, path, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy continuations by the float64 reference implementation."""
    import torch
    from safetensors.numpy import load_file

    from sglang_disagg.models import deepseek

    w = deepseek.f64(load_file(str(path / "model.safetensors")))
    return [deepseek.greedy(w, spec, torch.tensor([p]), OUTPUT_TOKENS)[0, len(p):].tolist() for p in prompts]


def assert_reference(got, expected, prompts, what):
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"prompt {i} ({len(prompts[i])} tokens): {what} {g} != float64 reference {e}"


def test_tiny_deepseek_v3_serves_the_suite_prompts_deterministically(stacks, deepseek_reference):
    """On the stack of the MLA tests' reference (deepseek_pd.py; started for it, kept running)."""
    prompts = prompts_for(MODEL)
    stack = stacks.get(deepseek_reference.spec)
    outputs = run_sequential(stack.url, prompts)
    assert_same(outputs, deepseek_reference.outputs, prompts)  # what the MLA messenger tests compare with
    assert all(len(o) == OUTPUT_TOKENS for o in outputs)
    assert_same(run_sequential(stack.url, prompts), outputs, prompts)  # again: now from the radix cache
    assert_same(run_concurrent(stack.url, prompts), outputs, prompts)
    assert_reference(outputs, reference(get_spec(MODEL), ensure_model(MODEL), prompts), prompts, "served")


@pytest.mark.parametrize("spec", [V2_NO_Q_LORA, V3_NO_NEXTN], ids=["v2-no-q-lora", "v3-no-nextn"])
def test_other_deepseek_config_shapes_serve_from_a_directory(stacks, tmp_path_factory, spec):
    path = checkpoint(spec, tmp_path_factory.mktemp("deepseek"))
    prompts = prompts_for(MODEL)  # every generated model has the same tokenizer
    stack = stacks.get(StackSpec(role=Role.COLOCATED, model=str(path)))
    outputs = run_sequential(stack.url, prompts)
    assert_same(run_concurrent(stack.url, prompts), outputs, prompts)
    assert_reference(outputs, reference(spec, path, prompts), prompts, f"served {spec.name}")



def test_attention_dp_serves_the_tp1_tokens(stacks):
    """Data-parallel attention on CPU (--tp 2 --attn-dp-size 2: two DP groups of one
    attention rank each, MoE layers over both): the tokens of TP 1 (the float64 reference's
    first DP_TOKENS: each decode step here runs the DP collectives over gloo, about 0.1 s on
    2 cores, so the outputs are short), sequential and concurrent, and both groups served."""
    from concurrent.futures import ThreadPoolExecutor

    from sglang_disagg.launch.client import generate_ids, greedy, post_json

    prompts = prompts_for(MODEL)
    stack = stacks.get(StackSpec(role=Role.COLOCATED, model=MODEL, prefill_tp=2,
                                 extra_args=("--attn-dp-size", "2")))
    want = [r[:DP_TOKENS] for r in reference(get_spec(MODEL), ensure_model(MODEL), prompts)]
    assert_reference([generate_ids(stack.url, p, DP_TOKENS) for p in prompts], want, prompts, "attention DP")
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(lambda p: generate_ids(stack.url, p, DP_TOKENS), prompts))
    assert_reference(together, want, prompts, "attention DP, concurrent")
    groups = {post_json(f"{stack.url}/generate", {"input_ids": p, "sampling_params": greedy(1)})["meta_info"]
              ["dp_rank"] for p in prompts[:4]}
    assert groups == {0, 1}, f"requests went to DP groups {groups} only"
