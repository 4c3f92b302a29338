"""Token-exact equivalence: router -> prefill + decode gives exactly the greedy
tokens of one colocated server, for both upstream transfer backends, another
architecture, and prefill TP 2 -> decode TP 1."""

from __future__ import annotations

import pytest

from sglang_disagg.launch import Role, TransferBackend

from .conftest import OUTPUT_TOKENS, run_concurrent, run_sequential, start_stack

pytestmark = pytest.mark.e2e

# (backend, model, prefill TP, decode TP)
CONFIGS = [
    pytest.param((TransferBackend.MOONCAKE, "tiny-llama", 1, 1), id="mooncake-llama-tp1-tp1"),
    pytest.param((TransferBackend.NIXL, "tiny-llama", 1, 1), id="nixl-llama-tp1-tp1"),
    pytest.param((TransferBackend.MOONCAKE, "tiny-llama", 2, 1), id="mooncake-llama-tp2-tp1"),
    pytest.param((TransferBackend.NIXL, "tiny-qwen3", 1, 1), id="nixl-qwen3-tp1-tp1"),
]


@pytest.fixture(scope="module", params=CONFIGS)
def pd(request, tmp_path_factory, references):
    backend, model, ptp, dtp = request.param
    prompts, expected = references(model)
    stack = start_stack(tmp_path_factory.mktemp("pd"), Role.ALL, model, backend, ptp, dtp)
    yield stack, prompts, expected
    stack.stop()


def _assert_same(got: list[list[int]], expected: list[list[int]], prompts: list[list[int]]) -> None:
    assert all(len(g) == OUTPUT_TOKENS for g in got)
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"prompt {i} ({len(prompts[i])} tokens): disaggregated {g} != colocated {e}"


def test_sequential_matches_colocated(pd):
    stack, prompts, expected = pd
    _assert_same(run_sequential(stack.url, prompts), expected, prompts)


def test_concurrent_matches_colocated(pd):
    stack, prompts, expected = pd
    _assert_same(run_concurrent(stack.url, prompts), expected, prompts)
    # Nothing broke under concurrency: the stack still serves.
    assert not stack.dead()
