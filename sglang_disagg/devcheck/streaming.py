"""Part `streaming` of the device check: the layer counter and streamer on a toy model,
each layer's KV written to another process through the same-host backend.

Runs, each from zeroed pools and a fresh input: `graph` (CUDA only: the forward captured
in a CUDA graph, our counter's bump recorded in it), `eager` (our counter, no graph), and
`hook_time` (the negative control: the counter is a CPU word bumped when the Python hook
runs, as before issue 15; on CUDA that is when o_proj is enqueued, long before it runs).
Per run: the receiver's bytes equal the sender's (sha256), and when layer 0 and the last
layer were posted against when the forward was enqueued and when it ended.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace
from typing import Any

import torch

from ..devices import for_device
from ..devices.cpu import CpuWord
from ..messenger.layers import LayerCounter
from ..messenger.stream import Chunk, Streamer
from . import memory, toy

_tags = itertools.count(1)


class Receiver:
    def __init__(self, device: str, nbytes: int, secret: bytes) -> None:
        env = dict(os.environ, SGLANG_DISAGG_DEVCHECK_SECRET=secret.hex())
        self.proc = subprocess.Popen([sys.executable, "-m", "sglang_disagg.devcheck.receiver", "--device", device,
                                      "--bytes", str(nbytes)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env)
        self.hello = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the receiver exited (rc {self.proc.wait()})")
        return json.loads(line)

    def ask(self, tag: int, count: int, timeout_s: float) -> None:
        self.proc.stdin.write(json.dumps({"tag": tag, "count": count, "timeout_s": timeout_s}) + "\n")
        self.proc.stdin.flush()

    def answer(self) -> dict:
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(10)


class Sender:
    def __init__(self, device: str, shape: toy.Shape, secret: bytes, receiver: Receiver) -> None:
        self.device, self.shape = device, shape
        self.pool = memory.zeros(device, shape.pool_bytes)
        self.be = memory.backend(device, secret)
        self.src, _ = self.be.register(self.pool.data_ptr(), shape.pool_bytes, for_device(device).memory())
        self.peer = self.be.connect(receiver.hello["address"], 10.0)
        self.dst = self.peer.add_remote_region(receiver.hello["desc"].encode())
        self.model, self.x = toy.build(shape, self.pool, device)
        self.futures: list[Any] = []

    def post(self, chunk: Chunk, groups: list) -> None:
        s = self.shape
        for g in groups:
            pages = list(range(g.layer * s.pages, (g.layer + 1) * s.pages))
            self.futures.append(self.be.write_pages(self.peer, self.src, pages, s.page_bytes, self.dst, pages,
                                                    s.page_bytes, s.page_bytes, chunk.rec.tag))

    def close(self) -> None:
        self.be.close()


def one_run(sender: Sender, receiver: Receiver, word: Any, graph: bool, seed: int) -> dict:
    s, dev = sender.shape, sender.device
    counter = LayerCounter(sender.model, word, toy.Attention)
    streamer = Streamer(counter, s.layers, sender.post)
    try:
        replay = toy.capture(sender.model, sender.x) if graph else None
        sender.pool.zero_()
        sender.x.copy_(torch.randn(s.tokens, s.width, generator=torch.Generator().manual_seed(seed)))
        memory.synchronize(dev)
        tag = next(_tags)
        rec = SimpleNamespace(failed="", times={}, tag=tag)
        receiver.ask(tag, s.layers * s.pages, 30.0)
        chunk = Chunk(rec, by_layer={layer: [SimpleNamespace(layer=layer)] for layer in range(s.layers)})
        t0 = time.monotonic()
        ticket = streamer.submit([chunk])
        replay.replay() if replay is not None else sender.model(sender.x)
        enqueued = time.monotonic()
        memory.synchronize(dev)
        ended = time.monotonic()
        streamed = streamer.wait(ticket, 30.0)
        for f in sender.futures:
            f.wait(30.0)
        sender.futures.clear()
        expected = hashlib.sha256(sender.pool.cpu().numpy().tobytes()).hexdigest()
        got = receiver.answer()
    finally:
        streamer.close()  # removes the hooks: the next run puts its own counter on the model
    t = rec.times
    return {"streamed": streamed and not rec.failed, "error": rec.failed or got.get("error", ""),
            "bytes_equal": got.get("sha256") == expected, "writes": s.layers * s.pages,
            "forward_enqueued_s": enqueued - t0, "forward_end_s": ended - t0,
            "layer0_posted_s": t["layer0_posted"] - t0 if "layer0_posted" in t else None,
            "last_layer_posted_s": t["last_layer_posted"] - t0 if "last_layer_posted" in t else None,
            "layer0_before_forward_end": "layer0_posted" in t and t["layer0_posted"] < ended}


def run(device: str, secret: bytes) -> dict:
    shape = toy.SHAPES[memory.kind(device)]
    receiver = Receiver(device, shape.pool_bytes, secret)
    sender = Sender(device, shape, secret, receiver)
    runs: dict[str, dict] = {}
    try:
        twin = for_device(device)
        if memory.kind(device) == "cuda":
            runs["graph"] = one_run(sender, receiver, twin.layer_word(), graph=True, seed=1)
        runs["eager"] = one_run(sender, receiver, twin.layer_word(), graph=False, seed=2)
        # A CPU word is bumped by the hook's own Python call: at enqueue time on a GPU.
        runs["hook_time"] = one_run(sender, receiver, CpuWord(), graph=False, seed=3)
    finally:
        sender.close()
        receiver.close()
    positive = [r for name, r in runs.items() if name != "hook_time"]
    ok = all(r["streamed"] and r["bytes_equal"] and r["layer0_before_forward_end"] for r in positive)
    return {"ok": ok, "shape": vars(shape), "backend": memory.BACKENDS[memory.kind(device)], "runs": runs,
            "negative_control_differs": not runs["hook_time"]["bytes_equal"]}
