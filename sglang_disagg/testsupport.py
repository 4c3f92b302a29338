"""Test support that runs inside a server: fault injection and KV dumps (never in production).

Both are reached through ``hooks`` (SGLang's patches call nothing else of ours) and are off
unless a test sets their variable; they live in the package because the servers under test
import them, not the test process.

``SGLANG_DISAGG_FAULT=drop_kv`` (``FAULT_ENV``): a decode server of SGLang's own
disaggregation mode forgets the KV it just received (zeroes the request's pages before its
first decode step). It exists for the negative control of the equivalence tests: a decoder
without the prefill's KV gives different tokens, so the token comparison can fail. (The
messenger mode's partial faults, ``zero_kv:...``, are ``messenger/faults.py``.)

``SGLANG_DISAGG_KV_DUMP=DIR`` (``DUMP_ENV``): after an extend forward that completes a
request's prompt, a server writes, for requests whose rid holds ``kvdump-`` (a migrated
request's too: its rid on the new decoder is the old one with a suffix), the K
and V rows of the prompt's slots from the target's pool and a speculative draft's, to
``DIR/<rid>.pt`` (on a messenger decoder all but the last slot arrived by transfer; the
last one it computed itself, the draft's from the hidden state of its own forward). With
speculation, each verify step's accepted draft count is appended to ``DIR/<rid>.steps``,
one per line. The same hooks run in colocated servers and decoders, so a test compares
what a decoder received and did with what a colocated server computed for itself, byte for
byte. Off (one dict lookup) otherwise.
"""

from __future__ import annotations

import os
from typing import Any

FAULT_ENV = "SGLANG_DISAGG_FAULT"
DUMP_ENV = "SGLANG_DISAGG_KV_DUMP"
PREFIX = "kvdump-"


def drop_kv(scheduler: Any, req: Any) -> None:
    """Decode side (upstream mode), `req`'s prompt KV just arrived: zero it under drop_kv."""
    if os.environ.get(FAULT_ENV, "") != "drop_kv":
        return
    kv = scheduler.token_to_kv_pool_allocator.get_kvcache()
    locs = scheduler.req_to_token_pool.req_to_token[req.kv.req_pool_idx, : len(req.origin_input_ids)]
    for layer in range(kv.start_layer, kv.start_layer + kv.layer_num):
        kv.get_key_buffer(layer)[locs] = 0
        kv.get_value_buffer(layer)[locs] = 0


def _rows(pool: Any, slots: Any) -> list[Any]:
    """[layer][K|V] rows of `slots` as [slots, heads, dim], for NHD or HND buffers; an MLA
    pool's [layer][latent] rows as [slots, 1, kv_lora_rank + rope_dim]."""
    out = []
    for layer in range(pool.layer_num):
        pair = []
        mla = hasattr(pool, "kv_buffer") and hasattr(pool, "kv_lora_rank")
        for buf in (pool.kv_buffer[layer],) if mla else (pool.k_buffer[layer], pool.v_buffer[layer]):
            if buf.dim() == 4:  # HND: [page, head, slot in page, dim]
                ps = buf.shape[2]
                pair.append(buf[slots // ps, :, slots % ps].clone().cpu())
            else:
                pair.append(buf[slots].clone().cpu())
        out.append(pair)
    return out


def dump_kv(scheduler: Any, batch: Any) -> None:
    """After a forward: the KV of every `kvdump-` request whose prompt it completed."""
    where = os.environ.get(DUMP_ENV)
    if not where:
        return
    mode = batch.forward_mode
    # the first rank of the request's attention group (with attention DP each group's leader)
    rank = getattr(scheduler, "attn_tp_rank", None)
    if not mode.is_extend() or mode.is_target_verify() or (getattr(scheduler, "tp_rank", 0) if rank is None else rank) != 0:
        return
    import torch

    from sglang_disagg.messenger.speculative import draft_pool

    target = scheduler.token_to_kv_pool_allocator.get_kvcache()
    draft = draft_pool(scheduler)
    for req in batch.reqs:
        n = len(req.origin_input_ids)
        if PREFIX not in str(req.rid) or (getattr(req, "extend_end", None) or 0) < n or n < 2:
            continue
        slots = scheduler.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :n].long()
        dump = {"target": _rows(target, slots), "draft": _rows(draft, slots) if draft is not None else None}
        torch.save(dump, os.path.join(where, f"{req.rid}.pt"))


def dump_verified(scheduler: Any, req: Any, num_correct_drafts: int) -> None:
    """A verify step of `req` settled: append its accepted draft count (kvdump- rids)."""
    where = os.environ.get(DUMP_ENV)
    if not where or getattr(scheduler, "tp_rank", 0) != 0 or PREFIX not in str(req.rid):
        return
    with open(os.path.join(where, f"{req.rid}.steps"), "a") as f:
        f.write(f"{int(num_correct_drafts)}\n")
