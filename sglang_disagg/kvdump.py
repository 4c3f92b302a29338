"""Test-only: what a server's KV pools hold for a prompt, written to files.

``SGLANG_DISAGG_KV_DUMP=DIR``: after an extend forward that completes a request's prompt,
a server writes, for requests whose rid starts with ``kvdump-``, the K and V rows of the
prompt's slots from the target's pool and a speculative draft's, to ``DIR/<rid>.pt`` (on a
messenger decoder all but the last slot arrived by transfer; the last one it computed
itself, the draft's from the hidden state of its own forward). With speculation, each
verify step's accepted draft count is appended to ``DIR/<rid>.steps``, one per line. The
same hooks run in colocated servers and decoders, so a test compares what a decoder
received and did with what a colocated server computed for itself, byte for byte. Off
(one dict lookup) otherwise.
"""

from __future__ import annotations

import os
from typing import Any

ENV = "SGLANG_DISAGG_KV_DUMP"
PREFIX = "kvdump-"


def _rows(pool: Any, slots: Any) -> list[Any]:
    """[layer][K|V] rows of `slots` as [slots, heads, dim], for NHD or HND buffers."""
    out = []
    for layer in range(pool.layer_num):
        pair = []
        for buf in (pool.k_buffer[layer], pool.v_buffer[layer]):
            if buf.dim() == 4:  # HND: [page, head, slot in page, dim]
                ps = buf.shape[2]
                pair.append(buf[slots // ps, :, slots % ps].clone().cpu())
            else:
                pair.append(buf[slots].clone().cpu())
        out.append(pair)
    return out


def after_forward(scheduler: Any, batch: Any) -> None:
    where = os.environ.get(ENV)
    mode = batch.forward_mode
    if not where or not mode.is_extend() or mode.is_target_verify() or getattr(scheduler, "tp_rank", 0) != 0:
        return
    import torch

    from sglang_disagg.messenger.speculative import draft_pool

    target = scheduler.token_to_kv_pool_allocator.get_kvcache()
    draft = draft_pool(scheduler)
    for req in batch.reqs:
        n = len(req.origin_input_ids)
        if not str(req.rid).startswith(PREFIX) or (getattr(req, "extend_end", None) or 0) < n or n < 2:
            continue
        slots = scheduler.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :n].long()
        dump = {"target": _rows(target, slots), "draft": _rows(draft, slots) if draft is not None else None}
        torch.save(dump, os.path.join(where, f"{req.rid}.pt"))


def verified(scheduler: Any, req: Any, num_correct_drafts: int) -> None:
    where = os.environ.get(ENV)
    if not where or getattr(scheduler, "tp_rank", 0) != 0 or not str(req.rid).startswith(PREFIX):
        return
    with open(os.path.join(where, f"{req.rid}.steps"), "a") as f:
        f.write(f"{int(num_correct_drafts)}\n")
