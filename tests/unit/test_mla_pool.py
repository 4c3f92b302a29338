"""MLA (DeepSeek) latent pools in the messenger, in isolation: the pool as regions (one per
layer), the replicated plan bound to them, the test faults on latent rows, the wire fields
first contact compares, and the layer counter on a module holding two attention ops. The
real pool moving real pages is tests/e2e/test_deepseek_messenger.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from sglang_disagg.messenger import compat, wire
from sglang_disagg.messenger.faults import CorruptSource
from sglang_disagg.messenger.kvpool import KVPoolView, LayoutError
from sglang_disagg.messenger.layers import LayerHookError, attention_projections
from sglang_disagg.messenger.planner import Kind, ShardPlan

PAGE, LORA, ROPE = 16, 128, 32


def _mla(layers: int, lora: int = LORA, rope: int = ROPE, pages: int = 4):
    """The fields of SGLang's MLATokenToKVPool the view reads: one [slots, 1, lora + rope]
    buffer per layer (slots = size + page_size)."""
    bufs = [torch.randn(pages * PAGE, 1, lora + rope) for _ in range(layers)]
    return SimpleNamespace(kv_buffer=bufs, kv_lora_rank=lora, qk_rope_head_dim=rope, layer_num=layers,
                           page_size=PAGE, dtype=torch.float32, store_dtype=torch.float32)


def test_an_mla_pool_is_one_replicated_latent_head_per_layer():
    target, draft = _mla(3), _mla(1)
    view = KVPoolView.from_pool(target, 128, draft)  # 128: DeepSeek's num_key_value_heads, not the latent's
    g = view.geometry
    assert (g.num_layers, g.kv_heads, g.head_dim, g.v_head_dim, g.replicated) == (4, 1, LORA + ROPE, 0, True)
    assert g.kinds == (Kind.K,) and view.target_layers == 3 and view.draft_layers == 1
    assert view.tensors == tuple(target.kv_buffer) + tuple(draft.kv_buffer)
    assert [view.region(layer, Kind.K) for layer in range(4)] == [0, 1, 2, 3]
    assert g.page_bytes(Kind.K, 1) == PAGE * (LORA + ROPE) * 4  # one page of one layer: one contiguous range
    spec = view.spec("m", "f", 2)
    assert (spec.kv_heads, spec.head_dim, spec.kv_lora_rank, spec.rope_dim, spec.replicated) == (1, 160, 128, 32, True)
    with pytest.raises(LayoutError, match="speculative draft's KV pool"):
        KVPoolView.from_pool(target, 128, _mla(1, lora=64))
    packed = _mla(2)
    packed.kv_buffer = [torch.zeros(4 * PAGE, 1, 100) for _ in range(2)]  # e.g. DSA's packed fp8 rows
    with pytest.raises(LayoutError, match="hold 100 values, not kv_lora_rank"):
        KVPoolView.from_pool(packed, 1)


@pytest.mark.parametrize("src_tp,dst_tp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_each_destination_rank_reads_each_page_once_from_a_drawn_source(src_tp, dst_tp):
    view = KVPoolView.from_pool(_mla(3), 1)
    plan = ShardPlan.build(view.geometry, src_tp, dst_tp)
    sources = set()
    for tag in range(1, 41):
        drawn = plan.for_request(tag)
        assert drawn.for_request(tag) == drawn  # every prefill rank derives the same draw
        groups = drawn.groups([5, 6], [1, 2])
        # One write per page and layer per destination rank: never x source ranks.
        assert sum(g.writes for g in groups) == 2 * 3 * dst_tp == drawn.total_writes(2) == plan.total_writes(2)
        assert all(g.length == g.src_stride == g.dst_stride == PAGE * 160 * 4 for g in groups)
        for d in range(dst_tp):
            mine = {g.src_rank for g in groups if g.dst_rank == d}
            assert len(mine) == 1  # one source per destination rank and request
            sources |= mine
    assert sources == set(range(src_tp))  # over many requests every prefill rank sends


def test_faults_on_latent_rows():
    pool = _mla(3)
    view = KVPoolView.from_pool(pool, 1)
    before = [t.clone() for t in view.tensors]
    view.zero_pages([2], [1], (Kind.K, Kind.V))  # V has no buffer of its own in MLA: ignored
    assert torch.equal(view.tensors[0], before[0]) and torch.equal(view.tensors[2], before[2])
    assert not view.tensors[1][2 * PAGE:3 * PAGE].any()  # page 2 is slots 32..47
    assert torch.equal(view.tensors[1][:2 * PAGE], before[1][:2 * PAGE])
    assert torch.equal(view.tensors[1][3 * PAGE:], before[1][3 * PAGE:])

    # corrupt_source: the leader zeroes what it is about to read from rank R's pool, only R's.
    plan = ShardPlan.build(view.geometry, 2, 1)
    tag = next(t for t in range(1, 50) if plan.for_request(t).pieces[0].src_rank == 1)
    other = next(t for t in range(1, 50) if plan.for_request(t).pieces[0].src_rank == 0)
    rank1 = [t.clone() for t in view.tensors]
    fault = CorruptSource(1, [])
    addresses = [t.data_ptr() for t in rank1]
    fault.apply(addresses, view.region, plan.for_request(other).groups([0], [0]), "r-other")
    assert all(torch.equal(a, b) for a, b in zip(rank1, view.tensors)) and fault.corrupted == []
    fault.apply(addresses, view.region, plan.for_request(tag).groups([1], [0]), "r-drew-1")
    assert fault.corrupted == ["r-drew-1"]
    for layer in range(3):
        assert not rank1[layer][PAGE:2 * PAGE].any() and torch.equal(rank1[layer][:PAGE], view.tensors[layer][:PAGE])


def test_corrupt_source_spec(monkeypatch):
    monkeypatch.setenv("SGLANG_DISAGG_FAULT", "corrupt_source:1")
    assert CorruptSource.from_env() == CorruptSource(1, [])
    monkeypatch.setenv("SGLANG_DISAGG_FAULT", "corrupt_source:one")
    with pytest.raises(ValueError, match="corrupt_source:<TP rank>"):
        CorruptSource.from_env()
    monkeypatch.setenv("SGLANG_DISAGG_FAULT", "zero_kv")
    assert CorruptSource.from_env() is None


def test_first_contact_names_the_part_of_the_latent_that_differs():
    mine = KVPoolView.from_pool(_mla(3), 1).spec("m", "f", 1)
    assert wire.decode(wire.encode(wire.Welcome(prefill="p", kv=mine, ranks=()))).kv == mine
    narrower = KVPoolView.from_pool(_mla(3, lora=64), 1).spec("m", "f", 1)
    assert compat.differences(narrower, mine) == ["head_dim differs (decoder: 96, prefill: 160)",
                                                  "kv_lora_rank differs (decoder: 64, prefill: 128)"]
    split = KVPoolView.from_pool(_mla(3, lora=96, rope=64), 1).spec("m", "f", 1)
    assert compat.differences(split, mine) == ["kv_lora_rank differs (decoder: 96, prefill: 128)",
                                               "rope_dim differs (decoder: 64, prefill: 32)"]
    raw = json.loads(wire.encode(wire.Welcome(prefill="p", kv=mine, ranks=())))
    raw["kv"]["replicated"] = 1  # booleans are booleans on the wire
    with pytest.raises(wire.WireError, match="welcome.kv.replicated: expected true or false"):
        wire.decode(json.dumps(raw).encode())


class _Op(torch.nn.Module):
    def __init__(self, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id


class _MLA(torch.nn.Module):
    """DeepSeek's attention module: two ops (absorbed and expanded) with one layer id."""

    def __init__(self, layer_id: int) -> None:
        super().__init__()
        self.attn_mqa, self.attn_mha = _Op(layer_id), _Op(layer_id)
        self.o_proj = torch.nn.Linear(2, 2)


def test_two_ops_of_one_attention_module_are_one_layer():
    model = torch.nn.ModuleList([_MLA(0), _MLA(1)])
    assert [(i, p) for i, p in attention_projections(model, _Op)] == [(0, model[0].o_proj), (1, model[1].o_proj)]
    clash = torch.nn.ModuleList([_MLA(0), _MLA(0)])  # two modules claiming one layer is still a bug
    with pytest.raises(LayerHookError, match="two attention ops claim layer 0"):
        attention_projections(clash, _Op)
