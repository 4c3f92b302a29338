"""Shared real SGLang stacks for the end-to-end tests.

Starting an SGLang server costs 20-60 s on this 2-core machine, so each
configuration is started once per module (pytest groups the parametrized
tests by stack) and the colocated references are computed once per session.
Every server runs float32 with the same chunked-prefill size, so any
difference in tokens is a difference in the KV the decoder attended to.
"""

from __future__ import annotations

import itertools
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sglang_disagg.launch import LaunchConfig, Role, Stack, TransferBackend
from sglang_disagg.launch.client import generate_ids
from sglang_disagg.models import ensure_model

CHUNK = 64  # chunked-prefill size: the long prompt below spans 3 chunks
OUTPUT_TOKENS = 32
COMMON_ARGS = ("--chunked-prefill-size", str(CHUNK), "--dtype", "float32")

_ports = itertools.count(int(os.environ.get("SGLANG_DISAGG_TEST_PORT", "31000")), 10)


def prompts_for(model: str) -> list[list[int]]:
    """Six prompts: one token, short chat-like texts, and one longer than a prefill chunk."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ensure_model(model)))
    texts = [
        "Hello there, how are you today?",
        "Disaggregated prefill moves KV pages from one node to another.",
        "zou bai kou",
        "The quick brown fox jumps over the lazy dog. " * 2,
    ]
    ids = [[1]]  # a 1-token prompt: just <|bos|>
    ids += [tok(t)["input_ids"] for t in texts]
    long = tok(" ".join(f"word{i} gou bai" for i in range(60)))["input_ids"][: CHUNK * 2 + 37]
    assert len(long) > CHUNK * 2, "long prompt must span several prefill chunks"
    ids.append(long)
    return ids


def run_sequential(url: str, prompts: list[list[int]]) -> list[list[int]]:
    return [generate_ids(url, p, OUTPUT_TOKENS) for p in prompts]


def run_concurrent(url: str, prompts: list[list[int]]) -> list[list[int]]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: generate_ids(url, p, OUTPUT_TOKENS), prompts))


def start_stack(tmp_root: Path, role: Role, model: str, backend: TransferBackend = TransferBackend.MOONCAKE,
                prefill_tp: int = 1, decode_tp: int = 1, env: dict[str, str] | None = None) -> Stack:
    port = next(_ports)
    cfg = LaunchConfig(
        role=role, model=model, port=port, backend=backend, prefill_tp=prefill_tp, decode_tp=decode_tp,
        max_total_tokens=4096, extra_args=COMMON_ARGS, env=tuple((env or {}).items()),
        log_dir=str(tmp_root / f"{role.value}-{model}-{backend.value}-{prefill_tp}{decode_tp}-{port}"),
    )
    stack = Stack.for_config(cfg)
    stack.start()
    return stack


@pytest.fixture(scope="session")
def references(tmp_path_factory):
    """Greedy outputs of one colocated server per model, computed on first use."""
    cache: dict[str, tuple[list[list[int]], list[list[int]]]] = {}

    def get(model: str) -> tuple[list[list[int]], list[list[int]]]:
        if model not in cache:
            prompts = prompts_for(model)
            stack = start_stack(tmp_path_factory.mktemp("ref"), Role.COLOCATED, model)
            try:
                cache[model] = (prompts, run_sequential(stack.url, prompts))
            finally:
                stack.stop()
        return cache[model]

    return get
