"""DeepSeek checkpoint shapes the tests generate besides the built-in ``tiny-deepseek-v3``:
the config shapes promised to serve through ``--model-path DIR``.

* ``V2_NO_Q_LORA``: DeepSeek-V2(-Lite) style, ``DeepseekV2ForCausalLM`` with ``q_lora_rank:
  null`` (a plain ``q_proj``), softmax top-k routing (``topk_method: greedy``, one group, no
  correction bias, not renormalized), 2 shared experts, no NEXTN.
* ``V3_NO_NEXTN``: ``DeepseekV3ForCausalLM`` like the built-in (q LoRA, noaux_tc routing in
  groups), other sizes, ``num_nextn_predict_layers: 0`` and no ``model.layers.{N}``.

Both come from the built-in generator (``models.generate.write_model``: seeded weights,
names as SGLang's DeepSeek loader reads them); ``checkpoint`` writes one once per
directory and returns it.
"""

from __future__ import annotations

from pathlib import Path

from sglang_disagg.models.specs import Architecture, MlaMoe, ModelSpec

V2_NO_Q_LORA = ModelSpec(
    "test-deepseek-v2-no-q-lora", Architecture.DEEPSEEK_V2, hidden_size=256, num_layers=3, num_heads=8,
    num_kv_heads=8, intermediate_size=512, seed=21,
    mla=MlaMoe(q_lora_rank=None, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
               n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2, moe_intermediate_size=96,
               first_k_dense_replace=1),
)

V3_NO_NEXTN = ModelSpec(
    "test-deepseek-v3-no-nextn", Architecture.DEEPSEEK_V3, hidden_size=192, num_layers=2, num_heads=6,
    num_kv_heads=6, intermediate_size=384, seed=22,
    mla=MlaMoe(q_lora_rank=64, kv_lora_rank=96, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=24,
               n_routed_experts=12, num_experts_per_tok=3, n_shared_experts=1, moe_intermediate_size=64,
               n_group=3, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=1.5),
)

SHAPES = {spec.name: spec for spec in (V2_NO_Q_LORA, V3_NO_NEXTN)}


def checkpoint(spec: ModelSpec, root: Path) -> Path:
    """`spec` generated under `root` (once: a directory named after its digest)."""
    from sglang_disagg.models.generate import write_model

    out = root / spec.dirname
    if not (out / "config.json").exists():
        write_model(spec, out)
    return out
