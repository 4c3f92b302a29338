"""Small helpers on SGLang's Req/scheduler used by both sides (kept in one place so the
messenger touches SGLang internals through a short, reviewable list)."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

# Attributes the messenger sets on SGLang Req objects.
LOCK_ATTR = "_sglang_disagg_prefix_lock"  # decoder: our radix lock on a reused prefix, until admission
HANDOFF_ATTR = "sglang_disagg_prefix"   # decode: prompt tokens whose KV arrived from prefill
ORDER_ATTR = "sglang_disagg_order"      # prefill: the order this request serves


def fail_request(scheduler: Any, req: Any, message: str, status: HTTPStatus = HTTPStatus.SERVICE_UNAVAILABLE) -> None:
    """Finish `req` with an error the client sees (no KV is released here)."""
    from sglang.srt.disaggregation.utils import prepare_abort

    if req.finished():
        return
    prepare_abort(req, message, status_code=status)
    scheduler.retire_unadmitted_request(req)


def release(scheduler: Any, req: Any, checkpoint: bool = False) -> None:
    """Give the request's KV row back through SGLang's own release path."""
    from sglang.srt.mem_cache.common import release_kv_cache

    if req.kv.holds_kv:
        release_kv_cache(req, scheduler.tree_cache, checkpoint=checkpoint)


def abort_matches(recv_req: Any, rid: str) -> bool:
    """SGLang's own rule: an AbortReq names a rid prefix, or all requests."""
    return bool(recv_req.abort_all) or rid.startswith(recv_req.rid)
