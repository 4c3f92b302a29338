"""Decode-side admission: which requests the messenger carries, and the KV pages a carried
request gets before any prefill server is asked for its prompt.

Runs in the scheduler thread of every TP rank, on state that is the same on all of them
(SGLang's queues and pools), so every rank admits the same requests into the same pages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch

from .kvpool import page_ids
from .planner import pages_for
from .requests import HANDOFF_ATTR

DECODE_CAP = 4096  # SGLang's own admission caps a request's new tokens at this when reserving


@dataclass(frozen=True)
class Admitted:
    pages: tuple[int, ...]  # the prompt's pages (minus its last token), in order
    start_page: int         # pages before it were already in this decoder's radix tree


def rejected(req: Any) -> bool:
    """SGLang refused `req` at its intake (it carries its own finish, e.g. input too long)."""
    return req.finished() or req.to_finish is not None


def runs_locally(req: Any, n_tokens: int) -> str:
    """Why `req` is left to the decoder's own prefill ('' when the messenger carries it)."""
    if rejected(req):
        return "already finished (rejected at intake)"
    if n_tokens < 1:
        return "a 1-token prompt is its own first decode step"
    if getattr(req, "multimodal_inputs", None) is not None or getattr(req, "input_embeds", None) is not None:
        return "multimodal or embedding input"
    if req.return_logprob and 0 <= req.logprob_start_len < n_tokens:
        return "input logprobs need the prompt's logits"
    if getattr(req, "session", None) is not None:
        return "session request"
    return ""


def decode_room(req: Any, page_size: int) -> int:
    """KV tokens a request may still write while decoding, plus one page of rounding."""
    left = min(req.sampling_params.max_new_tokens or 0, DECODE_CAP) - len(req.output_ids)
    return max(0, left) + page_size


def promised_room(sched: Any, held: Iterable[Any], page_size: int) -> int:
    """KV tokens that requests holding prompt pages here may still need to decode: `held`
    (waiting for their writes), those handed to SGLang's queue, and those running."""
    queued = [r for r in sched.waiting_queue if getattr(r, HANDOFF_ATTR, None)]
    running = getattr(sched.running_batch, "reqs", None) or []
    return sum(decode_room(r, page_size) for r in [*held, *queued, *running])


def allocate(sched: Any, req: Any, n_tokens: int, page_size: int, reuse_prefix: bool,
             promised: int) -> Admitted | None:
    """Pages for the first `n_tokens` of the prompt, or None when they do not fit yet. What
    the radix tree already holds of it (earlier turns of a chat) is reused and locked; only
    the pages after it are allocated, and only beyond the decode room of this request and of
    every request already `promised` some: otherwise prompts fill the pool and none of them
    can run. (A request whose decode alone cannot fit gets what the pool has, as in SGLang.)"""
    from sglang.srt.mem_cache.common import match_kv_cache

    tree, alloc, ps = sched.tree_cache, sched.token_to_kv_pool_allocator, page_size
    if sched.req_to_token_pool.available_size() < 1:
        return None
    if reuse_prefix:
        match_kv_cache(req, tree, req.origin_input_ids[:n_tokens], max_prefix_len=n_tokens)
    else:  # every prompt comes whole from a prefill server (a benchmark baseline)
        req.last_node = req.last_host_node = req.best_match_node = tree.root_node_handle(req.extra_key)
        req.prefix_len = req.host_hit_length = req.num_matched_prefix_tokens = 0
    reused = req.prefix_len - req.prefix_len % ps  # whole pages: the transfer unit
    req.prefix_len = reused
    req.lock = tree.lock(req.last_node)
    prefix = tree.prefix_device_indices(req) if reused else None
    need = (pages_for(n_tokens, ps) - reused // ps) * ps
    reserve = min(decode_room(req, ps), max(0, alloc.size - need)) + promised
    if alloc.available_size() < need + reserve:
        alloc.evict_to_free_tokens(tree, need + reserve)
    slots = alloc.alloc(need) if alloc.available_size() >= need + reserve else None
    if slots is None and need:
        tree.unlock(req.lock)
        req.lock, req.prefix_len = None, 0
        return None
    sched.req_to_token_pool.alloc([req])
    row = (req.kv.req_pool_idx, slice(0, n_tokens))
    fresh = slots[:n_tokens - reused] if need else slots
    sched.req_to_token_pool.write(row, torch.cat([prefix, fresh]) if reused else fresh)
    req.kv.kv_allocated_len = req.kv.kv_committed_len = n_tokens
    req.kv.cache_protected_len = reused  # the tree owns [0, reused)
    pages = page_ids(prefix.tolist(), ps) if reused else []
    return Admitted(tuple(pages + (page_ids(slots.tolist(), ps) if need else [])), reused // ps)
