"""cpu/attention.py (torch_native's HND reads and new-rows extend) against plain references.

The HND gather must give exactly what the NHD row gather gives on the same KV (pure
indexing: bit-identical); the new-rows extend must give what upstream's redundant causal
square gives for the new rows (the same softmax over the same keys: float64 here, so any
masking mistake shows far above rounding).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.nn.functional import scaled_dot_product_attention

from sglang_disagg.cpu import attention as an

PAGE, HEADS, DIM, PAGES = 4, 3, 5, 8


def _caches() -> tuple[torch.Tensor, torch.Tensor]:
    """The same KV as NHD [slots, heads, dim] and as HND [pages, heads, page, dim]."""
    torch.manual_seed(0)
    nhd = torch.randn(PAGES * PAGE, HEADS, DIM)
    hnd = nhd.view(PAGES, PAGE, HEADS, DIM).transpose(1, 2).contiguous()
    return nhd, hnd


def _reference(nhd: torch.Tensor, slots: list[int]) -> torch.Tensor:
    """One slot at a time, stacked as [heads, slots, dim]."""
    return torch.stack([nhd[s] for s in slots], dim=1)


def _batch(req_to_token, lens, **kw):
    lens = torch.tensor(lens)
    return SimpleNamespace(req_pool_indices=torch.arange(len(lens)), seq_lens=lens, seq_lens_cpu=lens,
                           encoder_lens=None, extend_prefix_lens=lens,  # not a verify: read as is
                           forward_mode=SimpleNamespace(is_target_verify=lambda: False), **kw)


def _paged_rows(pages_per_req: list[list[int]]) -> torch.Tensor:
    """req_to_token rows for requests whose tokens fill the given pages in order."""
    rows = torch.zeros(len(pages_per_req), PAGES * PAGE, dtype=torch.int64)
    for r, pages in enumerate(pages_per_req):
        slots = [p * PAGE + o for p in pages for o in range(PAGE)]
        rows[r, : len(slots)] = torch.tensor(slots)
    return rows


HND_POOL = SimpleNamespace(use_hnd=True, page_size=PAGE)


def test_page_tables_list_each_requests_pages_in_order():
    rows = _paged_rows([[5, 2, 7], [0]])
    tables = an.page_tables(HND_POOL, rows, _batch(rows, [10, 3]))
    assert [t.tolist() for t in tables] == [[5, 2, 7], [0]]


def test_page_tables_are_none_when_they_cannot_hold():
    rows = _paged_rows([[5, 2, 7]])
    assert an.page_tables(SimpleNamespace(use_hnd=False, page_size=PAGE), rows, _batch(rows, [10])) is None
    assert an.page_tables(HND_POOL, rows, _batch(rows, [10])) is not None
    encoder = _batch(rows, [10])
    encoder.encoder_lens = torch.tensor([2])
    assert an.page_tables(HND_POOL, rows, encoder) is None
    rows[0, 5] = 30  # token 5 is not at offset 1 of its page: gathered slot by slot instead
    assert an.page_tables(HND_POOL, rows, _batch(rows, [10])) is None


def test_page_tables_read_a_verify_forward_with_its_draft_tokens():
    """A TARGET_VERIFY forward has no extend lengths: its tables cover prefix + drafts."""
    rows = _paged_rows([[3, 6]])
    verify = _batch(rows, [4], input_ids=torch.zeros(2, dtype=torch.int64))  # 4 verified + 2 drafts
    verify.extend_prefix_lens, verify.forward_mode = None, SimpleNamespace(is_target_verify=lambda: True)
    assert [t.tolist() for t in an.page_tables(HND_POOL, rows, verify)] == [[3, 6]]  # 6 slots: 2 pages


@pytest.mark.parametrize("pages,n", [([5, 2, 7], 10), ([1], 1), ([6, 0], 8)])
def test_gather_is_the_nhd_row_gather_bit_for_bit(pages, n):
    nhd, hnd = _caches()
    slots = torch.tensor([p * PAGE + o for p in pages for o in range(PAGE)][:n])
    want = _reference(nhd, slots.tolist())
    assert torch.equal(an.gather_heads_first(nhd, slots, None), want)  # NHD
    assert torch.equal(an.gather_heads_first(hnd, slots, torch.tensor(pages)), want)  # HND by pages
    assert torch.equal(an.gather_heads_first(hnd, slots, None), want)  # HND slot by slot


def test_gather_reads_scattered_slots_without_tables():
    nhd, hnd = _caches()
    slots = torch.tensor([9, 2, 30, 17])
    assert torch.equal(an.gather_heads_first(hnd, slots, None), _reference(nhd, slots.tolist()))


def _redundant(query, key, value, prefix, enable_gqa, scale):
    """Upstream torch_native: the whole sequence's causal square, new rows kept."""
    full = torch.zeros(query.shape[0], key.shape[1], query.shape[2], dtype=query.dtype)
    full[:, prefix:] = query
    out = scaled_dot_product_attention(full.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0), is_causal=True,
                                       enable_gqa=enable_gqa, scale=scale).squeeze(0)
    return out[:, prefix:].movedim(0, 1)  # [new, heads, dim]


@pytest.mark.parametrize("prefix,new,kv_heads", [(6, 3, 4), (6, 1, 4), (1, 5, 2), (9, 4, 1)])
def test_new_rows_match_the_redundant_square(prefix, new, kv_heads):
    torch.manual_seed(prefix * 10 + new)
    heads, dim = 4, 8
    q = torch.randn(heads, new, dim, dtype=torch.float64)
    k = torch.randn(kv_heads, prefix + new, dim, dtype=torch.float64)
    v = torch.randn(kv_heads, prefix + new, dim, dtype=torch.float64)
    gqa = kv_heads != heads
    out = torch.full((new, heads, dim), float("nan"), dtype=torch.float64)
    assert an.attend_new_rows(out, q, k, v, torch.tensor(prefix), causal=True, enable_gqa=gqa, scale=0.3)
    torch.testing.assert_close(out, _redundant(q, k, v, prefix, gqa, 0.3), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("prefix,causal", [(0, True), (4, False)])
def test_new_rows_leave_other_extends_to_the_original_path(prefix, causal):
    q, k = torch.randn(2, 3, 4), torch.randn(2, prefix + 3, 4)
    out = torch.full((3, 2, 4), 7.0)
    assert not an.attend_new_rows(out, q, k, k, prefix, causal=causal, enable_gqa=False, scale=None)
    assert torch.all(out == 7.0)  # nothing written
