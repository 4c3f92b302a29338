"""Shared real SGLang stacks for the end-to-end tests.

Starting an SGLang server costs 20-60 s on this 2-core machine, so stacks are shared:
``stacks.get(StackSpec(...))`` returns a running stack for that configuration, started on
first use; one stack lives at a time (a new configuration stops the previous one), and
tests that share a configuration run back to back. The colocated references are
computed once per session and model. Every server runs float32 with the same
chunked-prefill size, so any difference in tokens is a difference in the KV the decoder
attended to.
"""

from __future__ import annotations

import itertools
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from sglang_disagg.launch import LaunchConfig, Mode, Role, Stack
from sglang_disagg.launch.client import generate_ids, post_json
from sglang_disagg.models import ensure_model

CHUNK = 64  # chunked-prefill size: the long prompt below spans 3 chunks
OUTPUT_TOKENS = 32
COMMON_ARGS = ("--chunked-prefill-size", str(CHUNK), "--dtype", "float32")

_ports = itertools.count(int(os.environ.get("SGLANG_DISAGG_TEST_PORT", "31000")), 10)


def prompts_for(model: str) -> list[list[int]]:
    """One token, two tokens, short chat-like texts, one longer than a prefill chunk, one
    sharing that long prompt's first chunk, and the long prompt again (radix caches)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ensure_model(model)))
    texts = [
        "Hello there, how are you today?",
        "Disaggregated prefill moves KV pages from one node to another.",
        "zou bai kou",
        "The quick brown fox jumps over the lazy dog. " * 2,
    ]
    ids = [[1], [1, 9]]  # a 1-token prompt (never leaves the decoder) and a 2-token one
    ids += [tok(t)["input_ids"] for t in texts]
    long = tok(" ".join(f"word{i} gou bai" for i in range(60)))["input_ids"][: CHUNK * 2 + 37]
    assert len(long) > CHUNK * 2, "long prompt must span several prefill chunks"
    shared = long[: CHUNK + 5] + tok(" a different ending for a shared prefix")["input_ids"][1:]
    ids += [long, shared, list(long)]
    return ids


def run_sequential(url: str, prompts: list[list[int]], **extra) -> list[list[int]]:
    return [generate_ids(url, p, OUTPUT_TOKENS, **extra) for p in prompts]


def run_concurrent(url: str, prompts: list[list[int]]) -> list[list[int]]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: generate_ids(url, p, OUTPUT_TOKENS), prompts))


def assert_same(got: list[list[int]], expected: list[list[int]], prompts: list[list[int]]) -> None:
    assert all(len(g) == OUTPUT_TOKENS for g in got)
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"prompt {i} ({len(prompts[i])} tokens): disaggregated {g} != colocated {e}"


@dataclass(frozen=True)
class StackSpec:
    role: Role = Role.ALL
    model: str = "tiny-llama"
    mode: Mode = Mode.MESSENGER
    backend: str | None = None
    provider: str | None = None
    prefill_tp: int = 1
    decode_tp: int = 1
    env: tuple[tuple[str, str], ...] = field(default=())
    extra_args: tuple[str, ...] = ()  # SGLang flags for every server, after COMMON_ARGS
    # data parallelism (the launcher's --prefill-attn-dp, --decode-attn-dp, --prefill-dp, --decode-dp)
    prefill_attn_dp: int = 1
    decode_attn_dp: int = 1
    prefill_dp: int = 1
    decode_dp: int = 1

    @property
    def dp(self) -> str:
        shape = (self.prefill_attn_dp, self.decode_attn_dp, self.prefill_dp, self.decode_dp)
        return "" if shape == (1, 1, 1, 1) else "-dp" + "".join(map(str, shape))

    @property
    def label(self) -> str:
        return (f"{self.role.value}-{self.mode.value}-{self.backend or 'default'}-{self.provider or ''}-"
                f"{self.model}-tp{self.prefill_tp}{self.decode_tp}{self.dp}")


def next_port(blocks: int = 1) -> int:
    """The next `blocks` blocks of ten ports for a stack (3 with attention DP: config.Ports),
    skipping blocks where something already listens: SGLang's internal listeners take ports
    of their own, which can land in a block the counter has not handed out yet (seen once: a
    colocated server's port in use)."""
    from sglang_disagg.launch.preflight import _held

    for _ in range(20):
        port = next(_ports)
        for _ in range(blocks - 1):
            next(_ports)
        if not any(_held("127.0.0.1", p) for p in range(port, port + 10 * blocks)):
            return port
    raise RuntimeError("20 blocks of ten test ports in a row are in use: is an earlier stack still running?")


def start_stack(tmp_root: Path, spec: StackSpec, **kwargs) -> Stack:
    port = next_port(3 if spec.dp else 1)
    cfg = LaunchConfig(
        role=spec.role, model=spec.model, port=port, mode=spec.mode, backend=spec.backend, provider=spec.provider,
        prefill_tp=spec.prefill_tp, decode_tp=spec.decode_tp, max_total_tokens=4096,
        prefill_attn_dp=spec.prefill_attn_dp, decode_attn_dp=spec.decode_attn_dp, prefill_dp=spec.prefill_dp,
        decode_dp=spec.decode_dp,
        extra_args=COMMON_ARGS + spec.extra_args,
        env=spec.env, log_dir=str(tmp_root / f"{spec.label}-{port}"), **kwargs,
    )
    stack = Stack.for_config(cfg)
    stack.start()
    return stack


class StackPool:
    """At most one live stack; asking for another configuration stops the current one."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.spec: StackSpec | None = None
        self.stack: Stack | None = None

    def get(self, spec: StackSpec) -> Stack:
        if self.spec != spec or self.stack is None or self.stack.dead():
            self.close()
            self.stack, self.spec = start_stack(self.root, spec), spec
        return self.stack

    def close(self) -> None:
        if self.stack is not None:
            self.stack.stop()
        self.stack = self.spec = None


@pytest.fixture(scope="session")
def stacks(tmp_path_factory):
    pool = StackPool(tmp_path_factory.mktemp("stacks"))
    yield pool
    pool.close()


DEFAULT = StackSpec(backend="shmem")  # what `--role all` starts (on CPU)


@pytest.fixture(scope="module")
def stack(stacks, references):
    """The launcher's default stack, shared by the modules that test the messenger's own
    promises (the pool keeps it running from one module to the next)."""
    references("tiny-llama")
    return stacks.get(DEFAULT)


TURNS = 5


def conversation(url: str, model: str, on_turn=None) -> list[list[int]]:
    """A 5-turn chat as token ids: each turn re-sends the whole history (previous prompt,
    its answer, a new user message), as chat clients do. `on_turn(k, prompt)` runs before
    turn k is sent."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ensure_model(model)))
    history = tok("You are a helpful assistant. Tell me about disaggregated serving.")["input_ids"]
    outputs = []
    for k in range(TURNS):
        if on_turn is not None:
            on_turn(k, history)
        out = generate_ids(url, history, 16)
        outputs.append(out)
        history = history + out + tok(f" Turn {k}: and what about page {k} of the KV cache?")["input_ids"][1:]
    return outputs


JSON_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                "size": {"type": "integer"}}, "required": ["name", "size"]}


def structured(url: str, prompt: list[int]) -> dict:
    """A JSON-schema constrained greedy request (EOS allowed: the grammar may end it)."""
    return post_json(f"{url}/generate", {"input_ids": prompt, "sampling_params": {
        "max_new_tokens": 48, "temperature": 0.0, "json_schema": json.dumps(JSON_SCHEMA)}})


@pytest.fixture(scope="session")
def references(tmp_path_factory):
    """Greedy outputs of one colocated server per model (plain prompts, then a structured
    request on the longest prompt), computed on first use."""
    cache: dict[str, tuple[list[list[int]], list[list[int]]]] = {}

    def get(model: str) -> tuple[list[list[int]], list[list[int]]]:
        if model not in cache:
            prompts = prompts_for(model)
            stack = start_stack(tmp_path_factory.mktemp("ref"), StackSpec(role=Role.COLOCATED, model=model))
            try:
                outputs = run_sequential(stack.url, prompts)
                structured_refs[model] = structured(stack.url, prompts[-1])
                conversation_refs[model] = conversation(stack.url, model)
                cache[model] = (prompts, outputs)
            finally:
                stack.stop()
        return cache[model]

    return get


structured_refs: dict[str, dict] = {}
conversation_refs: dict[str, list[list[int]]] = {}


@pytest.fixture(scope="session")
def deepseek_reference(tmp_path_factory, stacks):
    """The colocated TP 1 tiny-deepseek-v3 answers the MLA tests compare with (deepseek_pd.py)."""
    from .deepseek_pd import colocated_reference

    return colocated_reference(stacks, tmp_path_factory.mktemp("deepseek-pd"))


# Modules that run on the pool's default stack (the `stack` fixture, or stacks.get(DEFAULT)) run
# right after test_equivalence.py, whose last configuration is that stack, and in this order: a
# module in between that starts another configuration on the pool, or closes it to have the cores
# to itself, would make each of them start it again (~14 s each; "stack starts" in the summary).
# test_fuzz.py is last: its second flood runs on libfabric, which replaces the default stack.
ON_DEFAULT = ("test_messenger.py", "test_metrics.py", "test_liveness.py", "test_local_users.py",
              "test_relay.py", "test_streaming.py", "test_fuzz.py")
AFTER = "test_equivalence.py"


def pytest_collection_modifyitems(session, config, items):
    here = Path(__file__).parent
    mine = [i for i, item in enumerate(items) if Path(item.path).parent == here]
    if not mine:
        return
    block = [items[i] for i in mine]
    moved = [it for name in ON_DEFAULT for it in block if Path(it.path).name == name]
    rest = [it for it in block if Path(it.path).name not in ON_DEFAULT]
    cut = max((k + 1 for k, it in enumerate(rest) if Path(it.path).name == AFTER), default=0)
    for i, item in zip(mine, rest[:cut] + moved + rest[cut:]):
        items[i] = item
