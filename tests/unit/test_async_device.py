"""The streamer against an emulated asynchronous device: the forward's Python code only
enqueues work onto a "stream" (a thread that runs it later, slowly), as a CUDA forward
does, so a layer's o_proj hook runs long before that layer's K and V exist.

Through the counter's mechanism (the hook enqueues the increment, devices/base.py) the
streamer never posts a layer before its KV was written. The negative control is the
counter as it was before issue 15: a Python mirror bumped when the hook runs, i.e. at
enqueue time; with it the streamer posts layers whose KV is not written yet. The emulated
device is a fake by design: it tests the ordering logic in isolation, the real CUDA twin
is exercised by the device check (scripts/gpu-check).
"""

from __future__ import annotations

import queue
import threading
import time
from types import SimpleNamespace

import torch

from sglang_disagg.devices.base import LayerWord
from sglang_disagg.messenger.layers import LayerCounter
from sglang_disagg.messenger.stream import Chunk, Streamer

LAYERS = 6
OP_S = 0.01  # each enqueued op takes this long on the emulated device


class EmuStream:
    """In-order execution of enqueued callables on one worker thread."""

    def __init__(self) -> None:
        self._q: queue.Queue = queue.Queue()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def enqueue(self, fn) -> None:
        self._q.put(fn)

    def _run(self) -> None:
        while (fn := self._q.get()) is not None:
            time.sleep(OP_S)
            fn()

    def synchronize(self) -> None:
        done = threading.Event()
        self.enqueue(done.set)
        done.wait(10)

    def close(self) -> None:
        self._q.put(None)


class StreamWord(LayerWord):
    """The counter's mechanism on the emulated device: bump and arm are device work."""

    def __init__(self, stream: EmuStream) -> None:
        self.stream, self.value, self._cv = stream, 0, threading.Condition()

    def _set(self, v: int) -> None:
        with self._cv:
            self.value = v
            self._cv.notify_all()

    def bump(self) -> None:
        self.stream.enqueue(lambda: self._set(self.value + 1))

    def arm(self, base: int) -> None:
        self.stream.enqueue(lambda: self._set(base))

    def read(self) -> int:
        return self.value

    def wait_at_least(self, target: int, timeout_s: float) -> bool:
        with self._cv:
            return self._cv.wait_for(lambda: self.value >= target, timeout_s)


class EnqueueTimeWord(StreamWord):
    """Negative control: the pre-issue-15 counter, a Python count bumped when the hook runs."""

    def bump(self) -> None:
        self._set(self.value + 1)

    def arm(self, base: int) -> None:
        self._set(base)


class Attention(torch.nn.Module):
    def __init__(self, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id


class Block(torch.nn.Module):
    """Attention writes this layer's KV on the device; o_proj follows in stream order."""

    def __init__(self, layer_id: int, stream: EmuStream, kv: list) -> None:
        super().__init__()
        self.attn, self.o_proj = Attention(layer_id), torch.nn.Identity()
        self.layer_id, self.stream, self.kv = layer_id, stream, kv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        forward_id = int(x.item())
        self.stream.enqueue(lambda: self.kv.__setitem__(self.layer_id, forward_id))  # K and V written
        return self.o_proj(x)


def _run(word_cls: type) -> list[tuple[int, int, int]]:
    """Two forwards; per posted layer (forward, layer, KV's forward id when posted)."""
    stream = EmuStream()
    kv = [-1] * LAYERS
    model = torch.nn.Sequential(*[Block(i, stream, kv) for i in range(LAYERS)])
    counter = LayerCounter(model, word_cls(stream), Attention)
    posted: list[tuple[int, int, int]] = []
    current = {"forward": 0}

    def post(chunk, groups):
        for g in groups:
            posted.append((current["forward"], g.layer, kv[g.layer]))

    streamer = Streamer(counter, LAYERS, post)
    try:
        for forward in (1, 2):
            current["forward"] = forward
            chunk = Chunk(SimpleNamespace(failed="", times={}),
                          by_layer={layer: [SimpleNamespace(layer=layer)] for layer in range(LAYERS)})
            ticket = streamer.submit([chunk])
            model(torch.tensor([float(forward)]))  # returns at once: the device is far behind
            assert streamer.wait(ticket, 10.0) and not chunk.rec.failed, chunk.rec.failed
            stream.synchronize()
    finally:
        streamer.close()
        stream.close()
    return posted


def test_the_streamer_posts_a_layer_only_after_the_device_wrote_its_kv():
    posted = _run(StreamWord)
    assert [(f, layer) for f, layer, _ in posted] == [(f, layer) for f in (1, 2) for layer in range(LAYERS)]
    early = [(f, layer, seen) for f, layer, seen in posted if seen != f]
    assert not early, f"posted before the device wrote the layer's KV: {early}"


def test_negative_control_counting_at_hook_time_posts_before_the_kv_exists():
    posted = _run(EnqueueTimeWord)
    early = [(f, layer) for f, layer, seen in posted if seen != f]
    assert len(early) >= LAYERS, f"hook-time counting should post most layers too early, got {early}"
