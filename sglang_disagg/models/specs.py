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
    DEEPSEEK_V2 = "DeepseekV2ForCausalLM"  # MLA + MoE, softmax top-k routing (models.deepseek)
    DEEPSEEK_V3 = "DeepseekV3ForCausalLM"  # MLA + MoE, grouped noaux_tc routing, NEXTN (models.deepseek)


# Bumped whenever the generator's output changes, so stale caches are not reused.
GENERATOR_VERSION = 1


@dataclass(frozen=True)
class MlaMoe:
    """What a DeepSeek-shaped model (DEEPSEEK_V2 / DEEPSEEK_V3) has beyond ModelSpec's fields:
    Multi-head Latent Attention (a q LoRA unless ``q_lora_rank`` is None, a kv LoRA of
    ``kv_lora_rank`` with a ``qk_rope_head_dim`` rope part shared by every head), dense MLP
    layers below ``first_k_dense_replace`` (ModelSpec.intermediate_size), MoE layers above
    (routed experts with shared ones), and ``nextn`` MTP layers after the last (V3 only)."""
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    moe_intermediate_size: int
    q_lora_rank: int | None = None
    n_group: int = 1
    topk_group: int = 1
    first_k_dense_replace: int = 1
    routed_scaling_factor: float = 1.0
    nextn: int = 0


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
    # DeepSeek-shaped models only (MLA, MoE, NEXTN); num_kv_heads = num_heads there, as in
    # DeepSeek's configs (the latent KV itself has one head).
    mla: MlaMoe | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.name}: num_heads {self.num_heads} not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(f"{self.name}: hidden_size {self.hidden_size} not divisible by num_heads {self.num_heads}")
        if self.vocab_size < 512:
            raise ValueError(f"{self.name}: vocab_size must be >= 512 (byte alphabet + merges)")
        deepseek = self.architecture in (Architecture.DEEPSEEK_V2, Architecture.DEEPSEEK_V3)
        if deepseek != (self.mla is not None):
            raise ValueError(f"{self.name}: a DeepSeek architecture, and only one, has an MlaMoe shape")
        if deepseek:
            m = self.mla
            if m.nextn and (self.architecture is not Architecture.DEEPSEEK_V3 or m.nextn != 1 or self.num_layers < 2):
                raise ValueError(f"{self.name}: one NEXTN layer, on a DeepSeek-V3 of two layers or more "
                                 "(SGLang's loader reads a one-layer model's NEXTN from layer 0)")
            if m.n_routed_experts % m.n_group or m.topk_group > m.n_group or m.qk_rope_head_dim % 2:
                raise ValueError(f"{self.name}: experts not divisible into {m.n_group} groups, "
                                 f"topk_group above n_group, or an odd rope dim")
            if self.architecture is Architecture.DEEPSEEK_V3 and m.n_routed_experts // m.n_group < 2:
                raise ValueError(f"{self.name}: noaux_tc routing scores a group by its top two experts")

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    @property
    def digest(self) -> str:
        payload = asdict(self) | {"generator": GENERATOR_VERSION}
        if self.base is None:  # not a draft: the digest models had before drafts existed
            del payload["base"], payload["perturb"]
        if self.mla is None:  # not DeepSeek-shaped: the digest models had before those existed
            del payload["mla"]
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
        # DeepSeek-V3-shaped (models.deepseek): MLA with q and kv LoRA and a rope part, a dense
        # first layer, then MoE layers (8 routed experts, 2 per token in grouped noaux_tc
        # routing, 1 shared), and one NEXTN (MTP) layer trained to follow the target.
        ModelSpec("tiny-deepseek-v3", Architecture.DEEPSEEK_V3, hidden_size=256, num_layers=3, num_heads=4,
                  num_kv_heads=4, intermediate_size=512, seed=10,
                  mla=MlaMoe(q_lora_rank=96, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=32,
                             v_head_dim=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                             moe_intermediate_size=128, n_group=2, topk_group=1, first_k_dense_replace=1,
                             routed_scaling_factor=2.5, nextn=1)),
        # Large enough that prefill visibly stalls decode on a CPU core (benchmarks).
        ModelSpec("small-llama", Architecture.LLAMA, hidden_size=1024, num_layers=8, num_heads=16,
                  num_kv_heads=4, intermediate_size=2816, max_position_embeddings=8192, seed=2),
    )
}

def checkpoint_tail(spec: ModelSpec) -> dict:
    """The config.json fields every generated checkpoint ends with: no biases or tied
    embeddings, the offline tokenizer's special ids, float32, and which built-in (name,
    digest) it is, so a cached copy can be recognised."""
    return {"attention_bias": False, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
            "pad_token_id": 3, "torch_dtype": "float32",
            "sglang_disagg_builtin": {"name": spec.name, "digest": spec.digest}}


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
