"""The layer counter (a hook after each attention layer's output projection that issues
device work bumping a word) and the streamer that posts each layer's writes once the word
says the forward has passed that layer. The CPU twin is the counter of CPU servers; an
emulated asynchronous device (tests/unit/emu_device.py) shows that the streamer follows
what the device did, not what Python enqueued."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from sglang_disagg.devices.base import STRIDE
from sglang_disagg.devices.cpu import CpuWord
from sglang_disagg.messenger.layers import LayerCounter, LayerHookError, attention_projections
from sglang_disagg.messenger.stream import Chunk, Streamer


class FakeAttention(torch.nn.Module):
    """Stands in for SGLang's RadixAttention (the op the hook looks for)."""

    def __init__(self, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id


class Block(torch.nn.Module):
    def __init__(self, layer_id: int, projection: str | None = "o_proj", delay_s: float = 0.0) -> None:
        super().__init__()
        self.attn = FakeAttention(layer_id)
        self.delay_s = delay_s
        if projection:
            setattr(self, projection, torch.nn.Linear(4, 4))
        self.projection = projection

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.delay_s)  # the layer's attention and MLP
        return getattr(self, self.projection)(x) if self.projection else x


class Model(torch.nn.Module):
    def __init__(self, blocks: list[Block]) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.layers:
            x = b(x)
        return x


def test_counter_advances_once_per_attention_layer_in_the_word_the_op_writes():
    model = Model([Block(i) for i in range(3)] + [Block(3, "out_proj")])
    counter = LayerCounter(model, CpuWord(), FakeAttention)
    assert [layer for layer, _ in counter.layers] == [0, 1, 2, 3]
    model(torch.zeros(1, 4))  # an unannounced forward (a warm-up): counts, below any base
    base = counter.arm()
    assert base == STRIDE and counter.word.read() == base
    model(torch.zeros(1, 4))
    assert counter.word.read() == base + 4 and int(counter.word.tensor.item()) == base + 4
    assert counter.wait_past(base + 4, 0.01) and not counter.wait_past(base + 5, 0.01)
    assert counter.arm() == 2 * STRIDE and counter.word.read() == 2 * STRIDE  # a new forward's base
    counter.close()
    model(torch.zeros(1, 4))
    assert counter.word.read() == 2 * STRIDE  # hooks removed


def test_the_cpu_waiter_blocks_instead_of_spinning():
    word = CpuWord()
    t0, c0 = time.monotonic(), time.thread_time()
    assert not word.wait_at_least(1, 0.3)
    assert time.monotonic() - t0 >= 0.3
    assert time.thread_time() - c0 < 0.05, "the waiter burned CPU while it waited"


def test_a_model_whose_projection_cannot_be_found_is_refused():
    with pytest.raises(LayerHookError, match=r"layers\.1\.attn .*no output projection named o_proj or out_proj"):
        attention_projections(Model([Block(0), Block(1, projection=None)]), FakeAttention)
    with pytest.raises(LayerHookError, match="no attention layer"):
        attention_projections(torch.nn.Linear(2, 2), FakeAttention)


def _streamer(delay_s: float, early: bool = False):
    model = Model([Block(i, delay_s=delay_s) for i in range(4)])
    counter = LayerCounter(model, CpuWord(), FakeAttention)
    posted: list[tuple[int, int, float]] = []  # (layer, word when posted, time)

    def post(chunk, groups):
        for g in groups:
            posted.append((g.layer, counter.word.read(), time.monotonic()))

    return model, counter, Streamer(counter, 4, post, early=early), posted


def _chunk(layers: int = 4) -> Chunk:
    rec = SimpleNamespace(failed="", times={})
    return Chunk(rec, ready=[SimpleNamespace(layer=-1)],
                 by_layer={layer: [SimpleNamespace(layer=layer)] for layer in range(layers)})


def test_each_layer_is_posted_once_the_forward_passed_it_and_before_the_forward_ends():
    model, counter, streamer, posted = _streamer(delay_s=0.05)
    try:
        model(torch.zeros(1, 4))  # an earlier forward: the ticket's base is armed at submit
        ticket = streamer.submit([_chunk()])
        t0 = time.monotonic()
        model(torch.zeros(1, 4))
        forward_end = time.monotonic()
        assert streamer.wait(ticket, 5.0)
    finally:
        streamer.close()
    layers = [p for p in posted if p[0] >= 0]
    assert [p[0] for p in posted] == [-1, 0, 1, 2, 3]  # the cached prefix first, then layer by layer
    for layer, seen, _ in layers:
        assert seen >= STRIDE + layer + 1, f"layer {layer} posted before the forward passed it"
    assert layers[0][2] < forward_end - 0.1, "layer 0 was not posted while the forward still ran"
    assert layers[0][2] > t0


def test_early_posting_is_what_the_negative_control_does():
    model, _, streamer, posted = _streamer(delay_s=0.02, early=True)
    try:
        ticket = streamer.submit([_chunk()])
        assert streamer.wait(ticket, 5.0)  # everything posted before any layer ran
        assert all(seen == STRIDE for _, seen, _ in posted)  # armed, no layer done
        model(torch.zeros(1, 4))
    finally:
        streamer.close()


def test_a_forward_that_never_reaches_a_layer_fails_its_chunks(monkeypatch):
    monkeypatch.setattr("sglang_disagg.messenger.stream.LAYER_TIMEOUT_S", 0.1)
    _, _, streamer, _ = _streamer(delay_s=0.0)
    chunk = _chunk()
    try:
        ticket = streamer.submit([chunk])
        assert streamer.wait(ticket, 5.0)
    finally:
        streamer.close()
    assert "never finished layer 0" in chunk.rec.failed


@pytest.mark.parametrize("src_tp,dst_tp", [(1, 1), (2, 1), (4, 2), (1, 2)])
def test_other_ranks_pages_wait_one_layer_for_the_reduction_that_proves_them_written(src_tp, dst_tp):
    from sglang_disagg.messenger.planner import KVGeometry, Layout, ShardPlan

    geometry = KVGeometry(num_layers=4, kv_heads=4, head_dim=8, v_head_dim=8, page_size=16, dtype_bytes=4,
                          layout=Layout.HND)
    groups = ShardPlan.build(geometry, src_tp, dst_tp).groups([3, 4], [7, 8])
    chunk = _chunk(layers=0)
    chunk.place(groups, own_rank=0, num_layers=4)
    filed = [(layer, g) for layer, gs in chunk.by_layer.items() for g in gs] + [(4, g) for g in chunk.tail]
    assert sorted(id(g) for _, g in filed) == sorted(id(g) for g in groups)  # every group, once
    for layer, g in filed:
        assert layer == (g.layer if g.src_rank == 0 else g.layer + 1)
