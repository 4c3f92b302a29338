"""Minimal HTTP client for SGLang's native and OpenAI-compatible endpoints (stdlib only)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any


class RequestError(RuntimeError):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:500]}")
        self.status = status
        self.body = body


def post_json(url: str, payload: dict[str, Any], timeout: float = 120.0) -> dict[str, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise RequestError(e.code, e.read().decode(errors="replace")) from None


def greedy(max_new_tokens: int) -> dict[str, Any]:
    return {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}


def generate_ids(base_url: str, input_ids: list[int], max_new_tokens: int, timeout: float = 120.0,
                 **extra: Any) -> list[int]:
    """Greedy continuation of ``input_ids``; returns the output token ids."""
    out = post_json(f"{base_url}/generate",
                    {"input_ids": input_ids, "sampling_params": greedy(max_new_tokens), **extra}, timeout)
    return list(out["output_ids"])


def chat(base_url: str, content: str, model: str, max_tokens: int = 32, timeout: float = 120.0) -> dict[str, Any]:
    """Greedy chat completion; `model` is the served model name (the router routes by it)."""
    return post_json(
        f"{base_url}/v1/chat/completions",
        {"model": model, "messages": [{"role": "user", "content": content}],
         "max_tokens": max_tokens, "temperature": 0.0},
        timeout,
    )
