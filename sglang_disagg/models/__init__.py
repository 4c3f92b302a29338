"""Built-in random-weight models for plumbing, tests and benchmarks.

These models have random weights: their text is gibberish. They exist so that
every node of a disaggregated deployment can load *identical* weights without
network access, and so that greedy decoding is a sharp equality test for KV
transfer. A real model is passed with ``--model-path``.

``ensure_model(name)`` generates a model on first use into the cache directory
(``sglang_disagg.env.models_dir()``) and returns its path; later calls return
the cached copy. Generation is deterministic (fixed seed), so two machines
produce byte-identical files.
"""

from sglang_disagg.models.specs import BUILTIN_MODELS, DEFAULT_MODEL, ModelSpec, get_spec
from sglang_disagg.models.generate import ensure_model, resolve_model_path

__all__ = [
    "BUILTIN_MODELS",
    "DEFAULT_MODEL",
    "ModelSpec",
    "ensure_model",
    "get_spec",
    "resolve_model_path",
]
