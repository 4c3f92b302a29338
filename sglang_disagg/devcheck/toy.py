"""A toy model with the shape the layer counter needs: L blocks, each an attention-like op
that writes its layer's KV into a pool, then an output projection (o_proj) that the counter
hooks. A delay per layer (a sleep kernel on CUDA, a host sleep on CPU) makes each layer
last long enough that "posted before the forward ended" cannot be noise."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Shape:
    layers: int
    tokens: int
    width: int
    pages: int          # per layer; a page is a contiguous slice of the layer's KV
    layer_delay_s: float

    def __post_init__(self) -> None:
        if (self.tokens * self.width * 4) % self.pages:
            raise ValueError(f"{self}: a layer's KV bytes must divide into {self.pages} pages")

    @property
    def layer_bytes(self) -> int:
        return self.tokens * self.width * 4

    @property
    def page_bytes(self) -> int:
        return self.layer_bytes // self.pages

    @property
    def pool_bytes(self) -> int:
        return self.layers * self.layer_bytes


SHAPES = {"cpu": Shape(layers=6, tokens=64, width=256, pages=8, layer_delay_s=0.02),
          "cuda": Shape(layers=8, tokens=2048, width=1024, pages=16, layer_delay_s=0.002)}


class Attention(torch.nn.Module):
    def __init__(self, layer_id: int, kv: torch.Tensor, width: int, delay_s: float) -> None:
        super().__init__()
        self.layer_id, self.kv, self.delay_s = layer_id, kv, delay_s
        g = torch.Generator().manual_seed(layer_id)
        self.w = torch.nn.Parameter(torch.randn(width, width, generator=g) / width ** 0.5, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            torch.cuda._sleep(int(self.delay_s * 1.5e9))  # ~1.5-2 GHz: a few ms of device time
        else:
            time.sleep(self.delay_s)
        self.kv.copy_(torch.tanh(x @ self.w))  # this layer's K and V, in the pool
        return x


class Block(torch.nn.Module):
    def __init__(self, layer_id: int, kv: torch.Tensor, width: int, delay_s: float) -> None:
        super().__init__()
        self.attn = Attention(layer_id, kv, width, delay_s)
        self.o_proj = torch.nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.o_proj(self.attn(x)))


class Toy(torch.nn.Module):
    def __init__(self, shape: Shape, pool: torch.Tensor) -> None:
        super().__init__()
        kv = pool.view(torch.float32).view(shape.layers, shape.tokens, shape.width)
        self.layers = torch.nn.ModuleList(Block(i, kv[i], shape.width, shape.layer_delay_s)
                                          for i in range(shape.layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.layers:
            x = b(x)
        return x


def build(shape: Shape, pool: torch.Tensor, device: str) -> tuple[Toy, torch.Tensor]:
    model = Toy(shape, pool).to(device).requires_grad_(False)  # the KV views are the pool's already
    return model, torch.zeros(shape.tokens, shape.width, device=device)


def capture(model: Toy, x: torch.Tensor) -> Any:
    """A CUDA graph of one forward (warm-up on a side stream first, as torch asks)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        model(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        model(x)
    return graph
