"""What our patches change in SGLang's torch_native attention backend (the CPU one).

Two changes, each reached from its patch through ``hooks`` (``attention_page_tables``,
``attention_gather``, ``attention_new_rows``), so that the patches only say where:

* **HND reads.** The messenger mode keeps the KV pool in HND layout
  (``SGLANG_USE_HND_KVCACHE=1``: ``[pages, heads, page, dim]``, heads before tokens within
  a page) so that a page's head-shard is one contiguous range and moves with one write.
  torch_native gathers K/V with ``cache[slots]``, which assumes NHD rows
  (``[slots, heads, dim]``). ``page_tables`` computes each request's pages once per
  forward and ``gather_heads_first`` reads whole pages as ``[heads, tokens, dim]``:
  about the cost of the NHD row gather (recomputing the tables per layer doubled the
  attention time of a 16-request decode batch). Pure indexing: bit-identical values.
* **New rows only.** torch_native's extend attends with a "redundant" query of the whole
  sequence and keeps the new rows: e new tokens after a prefix of p cost a (p+e)^2 causal
  square. ``attend_new_rows`` attends with the e new rows, row i masked to keys up to
  p + i (one row needs no mask, as in a decode step). Same softmax over the same keys:
  the equivalence tests stay token-exact.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.functional import scaled_dot_product_attention


def page_tables(pool: Any, req_to_token: torch.Tensor, forward_batch: Any) -> list[torch.Tensor] | None:
    """For an HND pool, each request's pages in order (every layer's K and V reuse them);
    None for an NHD pool, for encoder-decoder batches, and when a request's slots do not
    fill whole pages in order (the paged allocator keeps token t at offset t % page, but
    this is checked): `gather_heads_first` then reads slot by slot. A speculative verify
    forward is read with its lengths (``speculative.extend_view``)."""
    from sglang_disagg.cpu import speculative

    forward_batch = speculative.extend_view(forward_batch)
    if not getattr(pool, "use_hnd", False) or forward_batch.encoder_lens is not None:
        return None
    page_size = pool.page_size
    ramp = torch.arange(page_size, device=req_to_token.device)
    lens = forward_batch.seq_lens_cpu
    lens = forward_batch.seq_lens if lens is None else lens
    tables = []
    for idx, n in zip(forward_batch.req_pool_indices.tolist(), lens.tolist()):
        slots = req_to_token[idx, :n]
        pages = slots[::page_size] // page_size
        if not torch.equal((pages[:, None] * page_size + ramp).flatten()[:n], slots):
            return None
        tables.append(pages)
    return tables


def gather_heads_first(cache: torch.Tensor, slots: torch.Tensor, pages: torch.Tensor | None) -> torch.Tensor:
    """K or V of `slots` as [heads, len(slots), dim]. NHD `cache` is [slots, heads, dim];
    HND is [pages, heads, page, dim], where a slot is (page, :, offset, :), not a row.
    `pages` (the request's page table, covering `slots` in order) reads whole pages."""
    if cache.dim() != 4:
        return cache[slots].movedim(0, 1)
    if pages is not None:
        # index_select copies whole [heads, page, dim] blocks; advanced indexing (cache[pages])
        # moved them element by element, 2.5-3x slower on CPU (bf16, 16 requests of 600
        # tokens: 1.1 against 0.4 ms per layer's K), which made our decode step slower than
        # SGLang's NHD one at the same batch.
        blocks = torch.index_select(cache, 0, pages).transpose(0, 1)  # [heads, pages, page, dim]
        return blocks.reshape(blocks.shape[0], -1, blocks.shape[-1])[:, : slots.shape[0]]
    page_size = cache.shape[2]
    return cache[slots // page_size, :, slots % page_size].movedim(0, 1)


def attend_new_rows(out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    prefix_len: int, *, causal: bool, enable_gqa: bool, scale: float | None) -> bool:
    """One request of a causal extend whose first `prefix_len` keys are a cached prefix:
    writes the attention of its new rows into `out` ([new, heads, dim]) and returns True;
    returns False (nothing written, the caller's path runs) without a prefix or when the
    extend is not plainly causal (sliding window, cross or encoder attention).
    `query` is [heads, new, dim]; `key`/`value` [kv_heads, prefix + new, dim]."""
    prefix_len = int(prefix_len)
    if not causal or prefix_len <= 0:
        return False
    new, total = query.shape[1], key.shape[1]
    mask = None
    if new > 1:  # row i sees keys 0 .. prefix + i
        rows = torch.arange(new, device=query.device)
        mask = torch.arange(total, device=query.device)[None, :] <= rows[:, None] + prefix_len
    got = scaled_dot_product_attention(query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0),
                                       attn_mask=mask, enable_gqa=enable_gqa, scale=scale)
    out.copy_(got.squeeze(0).movedim(1, 0))
    return True
