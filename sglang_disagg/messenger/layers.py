"""A counter of the attention layers a forward has finished, for streaming KV per layer.

After each attention layer's output projection (o_proj) a forward hook adds one to a
tensor. The hook is found generically: every SGLang attention op (RadixAttention) sits in
an attention module whose output projection is its ``o_proj`` (Llama, Qwen2/3, Mistral,
DeepSeek MLA, ...) or ``out_proj``; a model with an attention layer whose projection
cannot be found is refused at start-up, never streamed with a guess. When o_proj has run,
that layer's K and V are in this rank's pool (attention writes them first). With TP the
counter is the leader's: o_proj's partial sums are reduced later in the layer, so other
ranks' layer L is known written only once the leader passed layer L + 1 (stream.py).

The increment is a tensor operation (``add_``), which CUDA graph capture records; on GPU the
counter would live in host-mapped memory that a poller reads. On CPU the hook also wakes
the waiting streamer thread, which is a Python call and not graph-safe: CPU has no graphs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

PROJECTIONS = ("o_proj", "out_proj")


class LayerHookError(RuntimeError):
    """A model whose attention output projections cannot be located."""


def attention_projections(model: torch.nn.Module, attention_type: type | None = None) -> list[tuple[int, Any]]:
    """(layer_id, output projection) of every attention layer, in layer order."""
    if attention_type is None:
        from sglang.srt.layers.radix_attention import RadixAttention as attention_type
    parents = dict(model.named_modules())
    found: dict[int, Any] = {}
    for name, module in model.named_modules():
        if not isinstance(module, attention_type):
            continue
        parent = parents[name.rpartition(".")[0]] if "." in name else model
        proj = next((getattr(parent, p) for p in PROJECTIONS if isinstance(getattr(parent, p, None), torch.nn.Module)),
                    None)
        if proj is None:
            raise LayerHookError(
                f"{type(model).__name__}: attention layer {name} ({type(parent).__name__}) has no output projection "
                f"named {' or '.join(PROJECTIONS)}; the messenger cannot tell when its KV is written, so it does "
                "not stream this model (start it with streaming off, or teach layers.py its projection)")
        layer_id = int(getattr(module, "layer_id", len(found)))
        if layer_id in found:
            raise LayerHookError(f"{type(model).__name__}: two attention ops claim layer {layer_id}")
        found[layer_id] = proj
    if not found:
        raise LayerHookError(f"{type(model).__name__}: no attention layer ({attention_type.__name__}) found")
    return sorted(found.items())


class LayerCounter:
    """`value` counts o_proj completions since the counter was made; the waiter blocks
    until it passes a target, without spinning."""

    def __init__(self, model: torch.nn.Module, attention_type: type | None = None,
                 on_layer: Callable[[], None] | None = None) -> None:
        self.layers = attention_projections(model, attention_type)
        self.tensor = torch.zeros(1, dtype=torch.int64)
        self._cv = threading.Condition()
        self._count = 0  # mirror of the tensor the CPU waiter can read without a device sync
        self._on_layer = on_layer
        self._handles = [proj.register_forward_hook(self._hook) for _, proj in self.layers]

    def _hook(self, module: Any, args: Any, output: Any) -> None:
        self.tensor.add_(1)
        with self._cv:
            self._count += 1
            self._cv.notify_all()
        if self._on_layer is not None:
            self._on_layer()

    @property
    def value(self) -> int:
        return self._count

    def wait_past(self, target: int, timeout_s: float) -> bool:
        """Block until the counter is >= target; False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: self._count >= target, timeout_s)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        with self._cv:
            self._cv.notify_all()
