"""Built-in models: deterministic, complete, loadable by the tokenizer stack."""

from __future__ import annotations

import hashlib
import json

import pytest

from sglang_disagg.models import BUILTIN_MODELS, ensure_model, get_spec
from sglang_disagg.models.generate import resolve_model_path


def _digest(path):
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


def test_generation_is_deterministic(tmp_path):
    a = ensure_model("tiny-llama", tmp_path / "a")
    b = ensure_model("tiny-llama", tmp_path / "b")
    assert _digest(a) == _digest(b)
    assert ensure_model("tiny-llama", tmp_path / "a") == a  # cached: same path, no regeneration


def test_tokenizer_covers_the_whole_vocab_and_round_trips(tmp_path):
    from transformers import AutoTokenizer

    path = ensure_model("tiny-qwen3", tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["num_key_value_heads"] == 2
    tok = AutoTokenizer.from_pretrained(str(path))
    assert len(tok) == cfg["vocab_size"]
    text = "Disaggregated prefill, décodé — 123!"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|user|>hi<|end|><|assistant|>"


def test_specs_are_gqa_and_validated():
    for spec in BUILTIN_MODELS.values():
        if spec.mla is None:  # DeepSeek's MLA has one latent KV head (models.deepseek)
            assert spec.num_heads > spec.num_kv_heads  # grouped-query attention
    with pytest.raises(ValueError, match="known: small-llama, tiny-deepseek-v3, tiny-llama, tiny-llama-1l, "
                                        "tiny-llama-1l-eagle, tiny-llama-draft, tiny-qwen2, tiny-qwen3"):
        get_spec("nope")


def test_resolve_model_path_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        resolve_model_path(str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_model_path(str(tmp_path))


def test_draft_is_its_base_perturbed():
    """tiny-llama-draft: tiny-llama's shape and tokenizer, every weight different, close."""
    import numpy as np
    from safetensors.numpy import load_file

    base = load_file(str(ensure_model("tiny-llama") / "model.safetensors"))
    draft = load_file(str(ensure_model("tiny-llama-draft") / "model.safetensors"))
    assert base.keys() == draft.keys()
    for name, w in base.items():
        d = draft[name]
        assert d.shape == w.shape and not np.array_equal(d, w), name
        assert np.abs(d - w).max() <= 0.5 * np.abs(w).max(), name
    assert (ensure_model("tiny-llama-draft") / "tokenizer.json").read_bytes() == \
        (ensure_model("tiny-llama") / "tokenizer.json").read_bytes()


def test_eagle_head_is_trained_deterministic_and_follows_its_target(tmp_path):
    """tiny-llama-1l-eagle: an EAGLE checkpoint (no ``model.`` prefix, no input norm, no final
    norm), the same bytes from a second generation, its layer not its target's, and its greedy
    guesses agreeing with the target's on prompts it was not trained on."""
    import numpy as np
    from safetensors.numpy import load_file

    from sglang_disagg.models.eagle import agreement

    path = ensure_model("tiny-llama-1l-eagle")
    again = ensure_model("tiny-llama-1l-eagle", tmp_path)
    digest = lambda p: hashlib.sha256((p / "model.safetensors").read_bytes()).hexdigest()  # noqa: E731
    assert digest(path) == digest(again)
    head = load_file(str(path / "model.safetensors"))
    target = load_file(str(ensure_model("tiny-llama-1l") / "model.safetensors"))
    assert sorted(head) == sorted(["embed_tokens.weight", "fc.weight", "fc.bias"] + [
        f"layers.0.{n}.weight" for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                         "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
                                         "post_attention_layernorm")])
    q = head["layers.0.self_attn.q_proj.weight"]
    assert not np.array_equal(q, target["model.layers.0.self_attn.q_proj.weight"])
    assert np.abs(head["fc.weight"][:, 256:]).max() > 0  # it reads the target's hidden state
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle"] and config["num_hidden_layers"] == 1
    spec, base = get_spec("tiny-llama-1l-eagle"), get_spec("tiny-llama-1l")
    assert agreement(spec, base, target, head, seed=99) > 0.6
