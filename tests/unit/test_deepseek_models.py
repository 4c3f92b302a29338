"""DeepSeek-shaped models (models.deepseek): the built-in tiny-deepseek-v3 and the config
shapes the tests generate (harness/deepseek.py): deterministic bytes, the names SGLang's
DeepSeek loader reads, a float64 reference that equals transformers' own DeepseekV3/V2, and
a NEXTN layer that follows its target."""

from __future__ import annotations

import hashlib
import json

import pytest

from harness.deepseek import V2_NO_Q_LORA, V3_NO_NEXTN, checkpoint
from sglang_disagg.models import ensure_model, get_spec
from sglang_disagg.models.specs import Architecture, MlaMoe, ModelSpec

MODEL = "tiny-deepseek-v3"


def _digest(path):
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


def test_generation_is_deterministic(tmp_path):
    assert _digest(ensure_model(MODEL)) == _digest(ensure_model(MODEL, tmp_path))
    a, b = checkpoint(V2_NO_Q_LORA, tmp_path / "a"), checkpoint(V2_NO_Q_LORA, tmp_path / "b")
    assert _digest(a) == _digest(b)


def test_other_models_keep_their_digests():
    """The DeepSeek fields of ModelSpec leave every other built-in's cache directory as it was."""
    assert [get_spec(n).dirname for n in ("tiny-llama", "tiny-llama-1l-eagle", "tiny-llama-draft", "small-llama")] == [
        "tiny-llama-4f35da5be4e9", "tiny-llama-1l-eagle-2eb02fe6c9a7", "tiny-llama-draft-f04ed7424c7d",
        "small-llama-20b801a695f5"]


def _expected_names(spec: ModelSpec) -> set[str]:
    """Every tensor name SGLang's DeepSeek loader reads for `spec`, listed independently."""
    m = spec.mla
    names = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    layers = list(range(spec.num_layers)) + ([spec.num_layers] if m.nextn else [])
    for i in layers:
        p = f"model.layers.{i}."
        attn = ["kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"]
        attn += ["q_proj"] if m.q_lora_rank is None else ["q_a_proj", "q_a_layernorm", "q_b_proj"]
        names |= {f"{p}self_attn.{a}.weight" for a in attn}
        names |= {f"{p}input_layernorm.weight", f"{p}post_attention_layernorm.weight"}
        proj = ("gate_proj", "up_proj", "down_proj")
        if i < m.first_k_dense_replace:
            names |= {f"{p}mlp.{x}.weight" for x in proj}
            continue
        names.add(f"{p}mlp.gate.weight")
        if spec.architecture is Architecture.DEEPSEEK_V3:
            names.add(f"{p}mlp.gate.e_score_correction_bias")
        names |= {f"{p}mlp.experts.{e}.{x}.weight" for e in range(m.n_routed_experts) for x in proj}
        names |= {f"{p}mlp.shared_experts.{x}.weight" for x in proj}
        if i == spec.num_layers:  # NEXTN: embedding and head are the target's
            names |= {f"{p}{x}.weight" for x in ("enorm", "hnorm", "eh_proj", "shared_head.norm")}
    return names


@pytest.mark.parametrize("shape", ["v3", "v3-no-nextn", "v2-no-q-lora"])
def test_config_and_weight_names(tmp_path, shape):
    from safetensors.numpy import load_file

    spec = {"v3": get_spec(MODEL), "v3-no-nextn": V3_NO_NEXTN, "v2-no-q-lora": V2_NO_Q_LORA}[shape]
    path = ensure_model(MODEL) if shape == "v3" else checkpoint(spec, tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    w = load_file(str(path / "model.safetensors"))
    assert set(w) == _expected_names(spec)
    assert cfg["rope_scaling"]["type"] == "yarn" and cfg["rope_scaling"]["factor"] == 1.0  # SGLang's CPU rope
    assert cfg["moe_layer_freq"] == 1 and cfg["num_key_value_heads"] == cfg["num_attention_heads"]
    if shape == "v2-no-q-lora":
        assert cfg["architectures"] == ["DeepseekV2ForCausalLM"] and cfg["q_lora_rank"] is None
        assert (cfg["topk_method"], cfg["scoring_func"], cfg["n_group"]) == ("greedy", "softmax", 1)
        assert "num_nextn_predict_layers" not in cfg
        return
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"] and cfg["q_lora_rank"] is not None
    assert (cfg["topk_method"], cfg["scoring_func"], cfg["norm_topk_prob"]) == ("noaux_tc", "sigmoid", True)
    assert cfg["n_group"] > 1 and cfg["first_k_dense_replace"] == 1
    assert cfg["num_nextn_predict_layers"] == (1 if shape == "v3" else 0)
    if shape == "v3":
        assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]) == (256, 3, 4)
        assert (cfg["q_lora_rank"], cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]) == (96, 128, 32)
        assert (cfg["n_routed_experts"], cfg["num_experts_per_tok"], cfg["n_shared_experts"]) == (8, 2, 1)
        assert w["model.layers.3.eh_proj.weight"].shape == (256, 512)


@pytest.mark.parametrize("shape", ["v3", "v2-no-q-lora"])
def test_reference_equals_transformers(tmp_path, shape):
    """models.deepseek.forward (float64) against transformers' own DeepseekV3/V2ForCausalLM
    (float32) on the same checkpoint: the generator's names and config mean to an independent
    implementation what they mean to ours (and SGLang serves the same greedy tokens: the e2e
    test)."""
    import torch
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    from sglang_disagg.models import deepseek

    spec = get_spec(MODEL) if shape == "v3" else V2_NO_Q_LORA
    path = ensure_model(MODEL) if shape == "v3" else checkpoint(spec, tmp_path)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    tokens = torch.tensor([[1, 50, 700, 1234, 9, 33, 4000, 17, 256, 3000, 5, 77]])
    with torch.no_grad():
        theirs = model(tokens).logits.double()
    w = deepseek.f64(load_file(str(path / "model.safetensors")))
    ours = deepseek.forward(w, spec, tokens) @ w["lm_head.weight"].T
    assert (theirs - ours).abs().max() < 1e-4
    assert torch.equal(theirs.argmax(-1), ours.argmax(-1))


def test_nextn_layer_follows_its_target():
    """tiny-deepseek-v3's NEXTN layer: not its target's last layer (its KV differs), and its
    greedy token equals the target's next one on about half the positions of prompts it was
    not built from (0.48 measured; chance is 1/4096)."""
    import numpy as np
    from safetensors.numpy import load_file

    from sglang_disagg.models.deepseek import agreement

    spec = get_spec(MODEL)
    w = load_file(str(ensure_model(MODEL) / "model.safetensors"))
    for sub in ("self_attn.kv_a_proj_with_mqa.weight", "mlp.experts.0.up_proj.weight", "mlp.gate.weight"):
        a, b = w[f"model.layers.3.{sub}"], w[f"model.layers.2.{sub}"]
        assert not np.array_equal(a, b) and np.abs(a - b).max() < 0.5 * np.abs(b).max(), sub
    assert agreement(spec, w, seed=99) > 0.4


def test_deepseek_specs_are_validated():
    mla = MlaMoe(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, n_routed_experts=4,
                 num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32, nextn=1)
    with pytest.raises(ValueError, match="NEXTN"):  # V2 has none in SGLang
        ModelSpec("x", Architecture.DEEPSEEK_V2, 64, 2, 4, 4, 128, mla=mla)
    with pytest.raises(ValueError, match="NEXTN"):  # SGLang reads a one-layer model's NEXTN from layer 0
        ModelSpec("x", Architecture.DEEPSEEK_V3, 64, 1, 4, 4, 128, mla=mla)
    with pytest.raises(ValueError, match="MlaMoe"):
        ModelSpec("x", Architecture.DEEPSEEK_V3, 64, 2, 4, 4, 128)
    with pytest.raises(ValueError, match="top two"):  # noaux_tc scores a group by its two best experts
        ModelSpec("x", Architecture.DEEPSEEK_V3, 64, 2, 4, 4, 128,
                  mla=MlaMoe(32, 16, 16, 16, 4, 1, 1, 32, n_group=4))
