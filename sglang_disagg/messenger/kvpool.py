"""Binding the planner to memory: one TP rank's SGLang KV pool as registered regions.

The planner speaks bytes inside a (layer, K|V) buffer; here each of those buffers is one
registered region, so a WriteGroup becomes one paged write between two regions. Page ids
are SGLang's: token slot ``i`` lives in page ``i // page_size`` (the paged allocator keeps a
request's token ``t`` at offset ``t % page_size`` of its page).

Two pool shapes: MHA pools (HND, a K and a V buffer per layer, heads sharded over TP) and
MLA pools (DeepSeek: one latent buffer per layer, ``[slots, 1, kv_lora_rank + rope_dim]``,
V a view of its first ``kv_lora_rank`` dims; every TP rank holds all of it). The latent is
planned as one K "head" of the latent and rope dims, replicated, with no V: one region and
one write per page and layer. With a single head HND and NHD are the same bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..backends import MemoryRegion, RemoteRegion
from ..backends.regions import HOST, Memory, cuda
from .planner import Kind, KVGeometry, Layout, WriteGroup
from .wire import KVSpec

if TYPE_CHECKING:
    from ..backends.base import TransferBackend


class LayoutError(RuntimeError):
    """The KV pool is not something the messenger can move page-shards of."""


def region_index(layer: int, kind: Kind, kinds: int = 2) -> int:
    """Index of the (layer, kind) buffer among a rank's regions (`kinds` buffers per layer)."""
    return layer * kinds + int(kind)


def memory_of(tensor: Any) -> Memory:
    """The backend memory kind of a torch tensor's storage: cuda:N -> cuda(N), cpu -> host (else LayoutError)."""
    kind = tensor.device.type
    if kind == "cuda":
        return cuda(tensor.get_device())
    if kind != "cpu":
        raise LayoutError(f"the messenger registers host or CUDA KV pools, not {kind} memory")
    return HOST


@dataclass(frozen=True, slots=True)
class KVPoolView:
    """The per-(layer, kind) buffers of one rank, in region_index order: the target's
    layers, then a speculative draft's (``draft_layers``; its pool shares the target's
    token slots, so a page id names the same tokens in both). The planner sees one pool of
    ``geometry.num_layers`` layers; only the target's are streamed by the layer counter."""

    geometry: KVGeometry
    tensors: tuple[Any, ...]  # torch tensors, contiguous
    dtype: str
    draft_layers: int = 0
    kv_lora_rank: int = 0  # MLA: the latent's compressed part (0 for MHA pools)

    @property
    def target_layers(self) -> int:
        return self.geometry.num_layers - self.draft_layers

    @property
    def rope_dim(self) -> int:
        """MLA: the rope part of the latent (0 for MHA pools)."""
        return self.geometry.head_dim - self.kv_lora_rank if self.kv_lora_rank else 0

    def region(self, layer: int, kind: Kind) -> int:
        return region_index(layer, kind, len(self.geometry.kinds))

    @classmethod
    def from_pool(cls, pool: Any, total_kv_heads: int, draft: Any = None) -> KVPoolView:
        """`total_kv_heads`: the model's KV heads over all ranks (MHA; an MLA latent is one)."""
        tensors = _buffers(pool, "")
        shape = _shape(pool)
        if draft is not None:
            if _shape(draft) != shape:
                raise LayoutError(f"the speculative draft's KV pool (heads per rank, head_dim, v_head_dim, "
                                  f"page_size, dtype = {_shape(draft)}) differs from the target's ({shape}): "
                                  f"the messenger plans one page geometry for both")
            tensors += _buffers(draft, "draft ")
        heads, head_dim, v_head_dim, page_size, dtype = shape
        mla = _is_mla(pool)
        geometry = KVGeometry(num_layers=len(tensors) // (1 if mla else 2), kv_heads=1 if mla else total_kv_heads,
                              head_dim=head_dim, v_head_dim=v_head_dim, page_size=page_size,
                              dtype_bytes=tensors[0].element_size(), layout=Layout.HND, replicated=mla)
        return cls(geometry, tuple(tensors), dtype, draft.layer_num if draft is not None else 0,
                   pool.kv_lora_rank if mla else 0)

    def spec(self, model: str, fingerprint: str, tp: int, draft: str = "", draft_hidden_size: int = 0) -> KVSpec:
        g = self.geometry
        return KVSpec(model=model, fingerprint=fingerprint, num_layers=self.target_layers, kv_heads=g.kv_heads,
                      head_dim=g.head_dim, v_head_dim=g.v_head_dim, page_size=g.page_size, dtype=self.dtype,
                      layout=g.layout.value, tp=tp, draft=draft, draft_layers=self.draft_layers,
                      draft_hidden_size=draft_hidden_size, kv_lora_rank=self.kv_lora_rank, rope_dim=self.rope_dim,
                      replicated=g.replicated)

    def register(self, backend: TransferBackend) -> tuple[list[MemoryRegion], list[str]]:
        regions, descriptors = [], []
        for t in self.tensors:
            region, desc = backend.register(t.data_ptr(), t.numel() * t.element_size(), memory_of(t))
            regions.append(region)
            descriptors.append(desc.decode())
        return regions, descriptors

    def zero_pages(self, pages: Sequence[int], layers: Sequence[int], kinds: Sequence[Kind] = tuple(Kind)) -> None:
        """Fault injection for negative controls: forget part of what was received."""
        for layer in layers:
            for kind in (k for k in kinds if k in self.geometry.kinds):
                t = self.tensors[self.region(layer, kind)]
                ps = self.geometry.page_size
                for p in pages:
                    if self.kv_lora_rank:  # MLA rows [slot, 1, dim]: page p is slots p * ps ..
                        t[p * ps:(p + 1) * ps].zero_()
                    else:  # HND [page, head, slot, dim]
                        t[p].zero_()


def _is_mla(pool: Any) -> bool:
    return hasattr(pool, "kv_buffer") and hasattr(pool, "kv_lora_rank")


def _buffers(pool: Any, which: str) -> list[Any]:
    if _is_mla(pool):
        if getattr(pool, "is_quantized_kv_cache", False) or pool.store_dtype != pool.dtype:
            raise LayoutError("the messenger does not move quantized KV caches yet")
        tensors = [pool.kv_buffer[layer] for layer in range(pool.layer_num)]
        for layer, buf in enumerate(tensors):
            if buf.shape[-1] != pool.kv_lora_rank + pool.qk_rope_head_dim:  # e.g. DSA's packed fp8 rows
                raise LayoutError(f"{which}MLA latent rows of layer {layer} hold {buf.shape[-1]} values, not "
                                  f"kv_lora_rank + rope dims ({pool.kv_lora_rank} + {pool.qk_rope_head_dim})")
            if not buf.is_contiguous():
                raise LayoutError(f"{which}MLA latent buffer of layer {layer} is not contiguous")
        return tensors
    if not getattr(pool, "use_hnd", False) or not hasattr(pool, "k_buffer"):
        raise LayoutError(f"the messenger needs an MHA {which}KV pool in HND layout (SGLANG_USE_HND_KVCACHE=1), "
                          f"got {type(pool).__name__} layout {getattr(pool, 'kv_cache_layout', '?')!r}")
    if getattr(pool, "is_quantized_kv_cache", False):
        raise LayoutError("the messenger does not move quantized KV caches yet")
    tensors = []
    for layer in range(pool.layer_num):
        for buf in (pool.k_buffer[layer], pool.v_buffer[layer]):
            if not buf.is_contiguous():
                raise LayoutError(f"{which}KV buffer of layer {layer} is not contiguous")
            tensors.append(buf)
    return tensors


def _shape(pool: Any) -> tuple:
    """(heads per rank, head_dim, v_head_dim, page_size, dtype) of a pool's page geometry."""
    if _is_mla(pool):
        latent = pool.kv_buffer[0]
        return (1, pool.kv_lora_rank + pool.qk_rope_head_dim, 0, pool.page_size,
                str(latent.dtype).removeprefix("torch."))
    k = pool.k_buffer[0]
    return (k.shape[1], pool.head_dim, pool.v_head_dim, pool.page_size, str(k.dtype).removeprefix("torch."))


def page_ids(slots: Sequence[int], page_size: int) -> list[int]:
    """Page of the first slot of each page-sized run of a request's slots."""
    return [int(s) // page_size for s in slots[::page_size]]


def post(backend: TransferBackend, peer: Any, group: WriteGroup, src: Sequence[MemoryRegion],
         dst: Sequence[RemoteRegion], tag: int, kinds: int = 2) -> Any:
    """One WriteGroup as one paged write; returns its TransferFuture. `kinds`: buffers per
    layer (2 for K and V, 1 for an MLA latent)."""
    i = region_index(group.layer, group.kind, kinds)
    return backend.write_pages(peer, src[i], group.src_pages, group.src_stride, dst[i], group.dst_pages,
                               group.dst_stride, group.length, tag, group.src_offset, group.dst_offset)
