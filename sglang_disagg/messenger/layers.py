"""A counter of the attention layers a forward has finished, for streaming KV per layer.

After each attention layer's output projection (o_proj) a forward hook adds one to a
tensor. The hook is found generically: every SGLang attention op (RadixAttention) sits in
an attention module whose output projection is its ``o_proj`` (Llama, Qwen2/3, Mistral,
DeepSeek MLA, ...) or ``out_proj``; a model with an attention layer whose projection
cannot be found is refused at start-up, never streamed with a guess. When o_proj has run,
that layer's K and V are in this rank's pool (attention writes them first). With TP the
counter is the leader's: o_proj's partial sums are reduced later in the layer, so other
ranks' layer L is known written only once the leader passed layer L + 1 (stream.py).

The increment is device work issued by the hook (devices/: on CUDA a kernel writing a word
of device-mapped pinned host memory, on CPU a CPU op writing a tensor), and the hooks are
put on the model when it is loaded, before CUDA graph capture (hooks.model_loaded), so
capture records the increment and every replay runs it in stream order after the layer.
"""

from __future__ import annotations

from typing import Any

import torch

from ..devices.base import STRIDE, LayerWord

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
            # DeepSeek MLA: one attention module holds two ops (attn_mqa for the absorbed
            # path, attn_mha for the expanded one) with one layer id; whichever ran, the
            # module's o_proj runs once, so its hook counts the layer once.
            if found[layer_id] is proj:
                continue
            raise LayerHookError(f"{type(model).__name__}: two attention ops claim layer {layer_id}")
        found[layer_id] = proj
    if not found:
        raise LayerHookError(f"{type(model).__name__}: no attention layer ({attention_type.__name__}) found")
    return sorted(found.items())


class LayerCounter:
    """Hooks on every attention layer's output projection that bump a device-written word
    (devices/base.py: the contract), registered before any CUDA graph is captured so that
    capture records the bump and every replay runs it after that layer's kernels. The
    streamer waits on the word itself; nothing here counts in Python at hook time."""

    def __init__(self, model: torch.nn.Module, word: LayerWord, attention_type: type | None = None) -> None:
        self.layers = attention_projections(model, attention_type)
        self.word = word
        self._base = 0
        self._handles = [proj.register_forward_hook(self._hook) for _, proj in self.layers]

    def _hook(self, module: Any, args: Any, output: Any) -> None:
        self.word.bump()  # device work only: Python effects here would not replay under a graph

    def arm(self) -> int:
        """Before an announced forward (scheduler thread, in stream order before it): the
        base its layers count up from; layer L is done once the word reaches base + L + 1."""
        self._base += STRIDE
        self.word.arm(self._base)
        return self._base

    def wait_past(self, target: int, timeout_s: float) -> bool:
        """Block until the word is >= target; False on timeout."""
        return self.word.wait_at_least(target, timeout_s)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self.word.close()
