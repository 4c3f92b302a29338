"""The equivalence tests can fail: a decoder missing even a small part of the prefill's KV
must produce different tokens from the colocated reference.

Messenger mode: the decoder zeroes part of what it received (one layer; the last chunk's
pages; one page), right before the request enters the batch
(SGLANG_DISAGG_FAULT=zero_kv:..., see sglang_disagg/messenger/faults.py): partial-transfer
bugs of that size must be caught, not only a total loss. Upstream mode: the decoder drops all received KV
(SGLANG_DISAGG_FAULT=drop_kv, sglang_disagg.testsupport.drop_kv).
"""

from __future__ import annotations

import time

import pytest

from sglang_disagg.testsupport import FAULT_ENV
from sglang_disagg.launch import Mode

from sglang_disagg.launch.client import generate_ids

from .conftest import OUTPUT_TOKENS, StackSpec, run_sequential, start_stack

pytestmark = pytest.mark.e2e


def _outputs(tmp_path, spec: StackSpec, prompts: list[list[int]]) -> list[list[int]]:
    stack = start_stack(tmp_path, spec)
    try:
        return run_sequential(stack.url, prompts)
    finally:
        stack.stop()


# Partial losses, applied in turn, one per carried request (faults.py).
PARTIAL = {
    "one layer (layer 1, every page)": "zero_kv:layers=1",
    "the last chunk (last 3 pages of 16 tokens, every layer)": "zero_kv:pages=last:3",
    "one page (the last, every layer)": "zero_kv:pages=last",
}


def test_decode_missing_part_of_the_kv_differs(tmp_path, references):
    prompts, expected = references("tiny-llama")
    carried = [i for i, p in enumerate(prompts) if len(p) >= 2]
    spec = StackSpec(backend="shmem", env=((FAULT_ENV, "|".join(PARTIAL.values())),))
    stack = start_stack(tmp_path, spec)
    try:
        time.sleep(1)  # the readiness probe's counters are published
        served = stack.messenger_stats("decode")["requests_carried"]
        differing: dict[str, list[int]] = {name: [] for name in PARTIAL}
        for i in carried:
            for _ in PARTIAL:  # each prompt once under each fault, in the decoder's rotation
                name = list(PARTIAL)[served % len(PARTIAL)]
                served += 1
                got = generate_ids(stack.url, prompts[i], OUTPUT_TOKENS)
                assert len(got) == OUTPUT_TOKENS
                if got != expected[i]:
                    differing[name].append(i)
        assert generate_ids(stack.url, prompts[0], OUTPUT_TOKENS) == expected[0]  # 1 token: never left
    finally:
        stack.stop()
    for name in list(PARTIAL)[:2]:
        assert differing[name] == carried, f"{name}: only prompts {differing[name]} of {carried} differ"
    # A page holds 16 tokens of hundreds: it flips every prompt of up to 4 pages; on the
    # 165-token prompt the last page holds 4 tokens, too few to move 32 greedy tokens.
    short = [i for i in carried if len(prompts[i]) - 1 <= 64]
    assert set(short) <= set(differing["one page (the last, every layer)"]), differing


def test_upstream_decode_without_transferred_kv_differs(tmp_path, references):
    prompts, expected = references("tiny-llama")
    got = _outputs(tmp_path, StackSpec(mode=Mode.UPSTREAM, backend="mooncake", env=((FAULT_ENV, "drop_kv"),)),
                   prompts)
    assert all(len(g) == OUTPUT_TOKENS for g in got)
    differing = [i for i, (g, e) in enumerate(zip(got, expected)) if g != e]
    assert differing == list(range(len(prompts))), f"only prompts {differing} differ without the KV"
    # Upstream prefill samples the first token and sends it as metadata, so it still
    # matches: the divergence is the decoder attending to missing KV.
    assert all(g[0] == e[0] for g, e in zip(got, expected))
