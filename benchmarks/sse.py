"""Reading a server-sent-events stream the way the SSE specification says.

A line starting with ':' is a comment: routers and proxies send them as keep-alives on a
silent stream (smg sends ': ping' after `--sse-keepalive-secs`), and a reader must ignore
them, as it ignores blank lines, other fields (event:, id:, retry:) and the closing
'data: [DONE]'. Every stream reader of our benchmarks goes through `data_of`, so a router
that does send keep-alives cannot fail a run, and `Comments` counts what was skipped so a
test can tell that comments were there to skip.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass
class Comments:
    """How many comment lines a reader skipped (keep-alives seen)."""

    count: int = 0


def data_of(raw: bytes, comments: Comments | None = None) -> dict | None:
    """The JSON payload of one stream line, or None for anything that carries none."""
    line = raw.strip()
    if line.startswith(b":"):
        if comments is not None:
            comments.count += 1
        return None
    if not line.startswith(b"data:"):
        return None
    payload = line[5:].strip()
    if payload == b"[DONE]":
        return None
    return json.loads(payload)
