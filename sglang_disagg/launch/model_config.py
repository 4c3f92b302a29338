"""What a model's config.json says about its shape, known without generating, converting or
downloading it: the dry run and the deployment-file checks must refuse a TP size the model
cannot take on any machine, including one that has not made the model yet.

- a random-weight built-in: its ModelSpec is the shape (the generator writes it from there);
- a real built-in (smollm2-135m): the converted copy here if there is one, else the shape
  pinned below, read once from the converted checkpoint (a test holds the pin to the copy
  ``make setup`` converts);
- a directory: its config.json where the directory exists on this machine; elsewhere (a
  path on the cluster's nodes) None, and the caller says the shape was not checked.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# SmolLM2-135M-Instruct as converted by models.real (the fields sharding.Shape reads).
REAL_SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": {"architectures": ["LlamaForCausalLM"], "num_attention_heads": 9, "num_key_value_heads": 3,
                     "hidden_size": 576, "head_dim": 64, "intermediate_size": 1536},
}


def model_config(model: str) -> dict[str, Any] | None:
    """The config.json fields of `model` (a built-in name or a directory), or None when
    they cannot be known on this machine."""
    from sglang_disagg.models import BUILTIN_MODELS, REAL_MODELS

    if model in BUILTIN_MODELS:
        spec = BUILTIN_MODELS[model]
        cfg: dict[str, Any] = {"architectures": [spec.architecture.value], "num_attention_heads": spec.num_heads,
                               "num_key_value_heads": spec.num_kv_heads, "hidden_size": spec.hidden_size,
                               "head_dim": spec.resolved_head_dim, "intermediate_size": spec.intermediate_size}
        if spec.mla is not None:  # MLA: one latent KV replicated on every rank (sharding.Shape)
            cfg["kv_lora_rank"] = spec.mla.kv_lora_rank
        return cfg
    if model in REAL_MODELS:
        from sglang_disagg.env import models_dir

        # the converted copy, by name only: hashing its content (models.real.cached) takes seconds
        found = sorted(d for d in models_dir().glob(f"{model}-*") if len(d.name) == len(model) + 13)
        return (found and _read(found[0])) or dict(REAL_SHAPES[model])
    path = Path(model).expanduser()
    return _read(path) if path.is_dir() else None


def _read(directory: Path) -> dict[str, Any] | None:
    try:
        return json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return None  # the launcher's resolve_model_path names a missing config; SGLang a bad one


def architecture(model: str) -> str | None:
    """The model's architecture (``LlamaForCausalLM``), as OME matches models to runtimes."""
    cfg = model_config(model) or {}
    archs = cfg.get("architectures") or []
    return archs[0] if archs else None
