"""The equivalence test can fail: a decoder that does not have the prefill's KV
must produce different tokens from the colocated reference.

The stack is a real PD stack; the decode server runs with the fault
injection SGLANG_DISAGG_FAULT=drop_kv (sglang_disagg.hooks.after_kv_received),
which zeroes each request's received KV pages before its first decode step.
"""

from __future__ import annotations

import pytest

from sglang_disagg.hooks import FAULT_ENV
from sglang_disagg.launch import Role, TransferBackend

from .conftest import OUTPUT_TOKENS, run_sequential, start_stack

pytestmark = pytest.mark.e2e


def test_decode_without_transferred_kv_differs(tmp_path_factory, references):
    prompts, expected = references("tiny-llama")
    stack = start_stack(tmp_path_factory.mktemp("neg"), Role.ALL, "tiny-llama", TransferBackend.MOONCAKE,
                        env={FAULT_ENV: "drop_kv"})
    try:
        got = run_sequential(stack.url, prompts)
    finally:
        stack.stop()
    assert all(len(g) == OUTPUT_TOKENS for g in got)
    differing = [i for i, (g, e) in enumerate(zip(got, expected)) if g != e]
    assert differing == list(range(len(prompts))), f"only prompts {differing} differ without the KV"
    # The first token is sampled by prefill and travels as metadata, so it
    # still matches: the divergence is the decoder attending to missing KV.
    assert all(g[0] == e[0] for g, e in zip(got, expected))
