"""KV-shaped transfer workloads for benchmarks/transfer.py (pure: offsets only, no memory).

A workload is one request's worth of writes from a prefill rank to a decode rank, grouped
in batches (one per layer, as the messenger sends them). "page-*" workloads are plain
scattered pages (one batch); "kv-*" workloads slice real KV layouts for a TP 1 -> 2 split,
where the decode rank holds half the KV heads:
  HND (heads, tokens, dim inside a page): the half-head slice is contiguous -> 1 write/page;
  NHD (tokens, heads, dim): the slice is strided -> one write per token per page.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Workload:
    name: str
    kind: str               # "page" or "kv"
    page_bytes: int         # bytes of one full source page (kv: one layer's K or V page)
    pages: int              # pages per layer (kv) or per request (page)
    layers: int = 1
    kv_heads: int = 0
    head_dim: int = 0
    page_tokens: int = 0
    layout: str = ""        # "HND" / "NHD" for kv
    dtype_bytes: int = 2

    def to_dict(self) -> dict:
        return asdict(self)


def kv(name: str, layers: int, kv_heads: int, head_dim: int, page_tokens: int, tokens: int, layout: str) -> Workload:
    return Workload(name, "kv", page_tokens * kv_heads * head_dim * 2, tokens // page_tokens, layers, kv_heads,
                    head_dim, page_tokens, layout)


def page(size: int, total: int) -> Workload:
    label = f"{size >> 20}M" if size >= 1 << 20 else f"{size >> 10}K"
    return Workload(f"page-{label}", "page", size, max(1, total // size))


def workloads(quick: bool, request_mib: int | None = None) -> list[Workload]:
    total = (request_mib or (16 if quick else 64)) << 20
    out = [page(s, total) for s in ((16 << 10, 256 << 10, 1 << 20) if quick else
                                    (4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20))]
    layers, tokens = (4, 512) if quick else (32, 1024)
    out += [kv("kv-llama8b-hnd", layers, 8, 128, 16, tokens, "HND"),
            kv("kv-llama8b-nhd", layers, 8, 128, 16, tokens, "NHD")]
    if not quick:
        out.append(kv("kv-llama70b-p64-hnd", 80, 8, 128, 64, 1024, "HND"))
    return out


def region_bytes(w: Workload) -> tuple[int, int]:
    """(source, destination) region sizes."""
    if w.kind == "page":
        return w.pages * w.page_bytes, w.pages * w.page_bytes
    n = w.layers * 2 * w.pages
    return n * w.page_bytes, n * w.page_bytes // 2


def batches(w: Workload, seed: int = 0) -> list[list[tuple[int, int, int]]]:
    """Per batch, the (src_offset, dst_offset, length) writes of one request."""
    rng = random.Random(seed)
    if w.kind == "page":
        src, dst = rng.sample(range(w.pages), w.pages), rng.sample(range(w.pages), w.pages)
        return [[(s * w.page_bytes, d * w.page_bytes, w.page_bytes) for s, d in zip(src, dst)]]
    n_pages = w.layers * 2 * w.pages
    dst_pages = rng.sample(range(n_pages), n_pages)        # decode-side page ids are arbitrary
    half = w.page_bytes // 2
    row = w.kv_heads * w.head_dim * w.dtype_bytes          # one token, all heads (NHD)
    out = []
    for layer in range(w.layers):
        batch = []
        for kvi in range(2):
            for p in range(w.pages):
                src_page = (layer * 2 + kvi) * w.pages + p
                s0, d0 = src_page * w.page_bytes, dst_pages[src_page] * half
                if w.layout == "HND":   # decode rank 0 gets heads [0, H/2): first half of the page
                    batch.append((s0, d0, half))
                else:                   # per token: heads [0, H/2) of that token's row
                    batch.extend((s0 + t * row, d0 + t * row // 2, row // 2) for t in range(w.page_tokens))
        out.append(batch)
    return out
