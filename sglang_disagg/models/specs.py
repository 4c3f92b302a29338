"""Shapes of the built-in models (pure data, no torch)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from enum import Enum


class Architecture(str, Enum):
    LLAMA = "LlamaForCausalLM"
    QWEN2 = "Qwen2ForCausalLM"
    QWEN3 = "Qwen3ForCausalLM"
    LLAMA_EAGLE = "LlamaForCausalLMEagle"  # an EAGLE draft head (models.eagle)


# Bumped whenever the generator's output changes, so stale caches are not reused.
GENERATOR_VERSION = 1


@dataclass(frozen=True)
class ModelSpec:
    name: str
    architecture: Architecture
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int = 4096
    head_dim: int | None = None
    max_position_embeddings: int = 4096
    seed: int = 0
    # A draft for speculative decoding: `base`'s weights, each scaled by (1 + perturb * N(0, 1))
    # from this spec's seed, so they differ from the target's (so does its KV) while its
    # greedy choices mostly agree. Same shape as `base`. An EAGLE head (LLAMA_EAGLE) is
    # instead trained on `base`'s hidden states from its layer perturbed so (models.eagle).
    base: str | None = None
    perturb: float = 0.0

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.name}: num_heads {self.num_heads} not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(f"{self.name}: hidden_size {self.hidden_size} not divisible by num_heads {self.num_heads}")
        if self.vocab_size < 512:
            raise ValueError(f"{self.name}: vocab_size must be >= 512 (byte alphabet + merges)")

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    @property
    def digest(self) -> str:
        payload = asdict(self) | {"generator": GENERATOR_VERSION}
        if self.base is None:  # not a draft: the digest models had before drafts existed
            del payload["base"], payload["perturb"]
        return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:12]

    @property
    def dirname(self) -> str:
        return f"{self.name}-{self.digest}"


BUILTIN_MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        # Fast tests and the default stack: ~4.5M parameters.
        ModelSpec("tiny-llama", Architecture.LLAMA, hidden_size=256, num_layers=4, num_heads=4,
                  num_kv_heads=2, intermediate_size=704),
        # Another GQA architecture (q/k norms, explicit head_dim) for tests.
        ModelSpec("tiny-qwen3", Architecture.QWEN3, hidden_size=256, num_layers=4, num_heads=4,
                  num_kv_heads=2, intermediate_size=704, head_dim=64, seed=1),
        # A third (biased q/k/v projections) for the streaming tests.
        ModelSpec("tiny-qwen2", Architecture.QWEN2, hidden_size=256, num_layers=4, num_heads=4,
                  num_kv_heads=2, intermediate_size=704, seed=3),
        # tiny-llama's speculative draft (STANDALONE): its weights perturbed by 5%.
        ModelSpec("tiny-llama-draft", Architecture.LLAMA, hidden_size=256, num_layers=4, num_heads=4,
                  num_kv_heads=2, intermediate_size=704, seed=7, base="tiny-llama", perturb=0.05),
        # A one-layer target and its EAGLE head (trained: models.eagle). One layer, because
        # a one-layer head can learn to follow it from the little data a generator affords.
        ModelSpec("tiny-llama-1l", Architecture.LLAMA, hidden_size=256, num_layers=1, num_heads=4,
                  num_kv_heads=2, intermediate_size=704, seed=8),
        ModelSpec("tiny-llama-1l-eagle", Architecture.LLAMA_EAGLE, hidden_size=256, num_layers=1,
                  num_heads=4, num_kv_heads=2, intermediate_size=704, seed=9, base="tiny-llama-1l",
                  perturb=0.05),
        # Large enough that prefill visibly stalls decode on a CPU core (benchmarks).
        ModelSpec("small-llama", Architecture.LLAMA, hidden_size=1024, num_layers=8, num_heads=16,
                  num_kv_heads=4, intermediate_size=2816, max_position_embeddings=8192, seed=2),
    )
}

# A real model (sglang_disagg.models.real): what `make run` and the launcher serve by default.
DEFAULT_MODEL = "smollm2-135m"


def get_spec(name: str) -> ModelSpec:
    """A random-weight model's shape (real models have none: see models.real)."""
    try:
        return BUILTIN_MODELS[name]
    except KeyError:
        from sglang_disagg.models.real import REAL_MODELS

        known = ", ".join(sorted(BUILTIN_MODELS) + sorted(REAL_MODELS))
        raise ValueError(f"unknown built-in model {name!r}; known: {known} (or pass a directory)") from None
