"""Minimal HTTP client for SGLang's native and OpenAI-compatible endpoints (stdlib only).

A deployment with HTTP keys (keys.py) asks for its API key: pass ``api_key``, or set
``SGLANG_DISAGG_API_KEY`` (the key in the launcher's ``LOG_DIR/api-key``), which every call
here sends as ``Authorization: Bearer`` when no key is passed. ``tls``: an SSL context for a
router serving HTTPS (``tls_context`` trusts its certificate).
"""

from __future__ import annotations

import json
import os
import ssl
import urllib.error
import urllib.request
from typing import Any

API_KEY_ENV = "SGLANG_DISAGG_API_KEY"  # keys.API_KEY_ENV (not imported: this module stays stdlib-only)


class RequestError(RuntimeError):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:500]}")
        self.status = status
        self.body = body


def headers(api_key: str | None = None) -> dict[str, str]:
    """JSON headers, with the API key (given, or from SGLANG_DISAGG_API_KEY) when there is one."""
    key = api_key if api_key is not None else os.environ.get(API_KEY_ENV, "").strip()
    return {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})


def tls_context(cert_path: str) -> ssl.SSLContext:
    """Trusts exactly the router's certificate (self-signed or not: the certificate itself is the
    anchor), as the launcher's own checks reach a router it started over HTTPS by address."""
    ctx = ssl.create_default_context(cafile=cert_path)
    ctx.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    ctx.check_hostname = False  # pinned to this one certificate: the name it carries adds nothing
    return ctx


def post_json(url: str, payload: dict[str, Any], timeout: float = 120.0, *, api_key: str | None = None,
              tls: ssl.SSLContext | None = None) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), headers=headers(api_key))
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=tls) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise RequestError(e.code, e.read().decode(errors="replace")) from None


def greedy(max_new_tokens: int) -> dict[str, Any]:
    return {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}


def generate_ids(base_url: str, input_ids: list[int], max_new_tokens: int, timeout: float = 120.0, *,
                 api_key: str | None = None, tls: ssl.SSLContext | None = None, **extra: Any) -> list[int]:
    """Greedy continuation of ``input_ids``; returns the output token ids."""
    out = post_json(f"{base_url}/generate",
                    {"input_ids": input_ids, "sampling_params": greedy(max_new_tokens), **extra}, timeout,
                    api_key=api_key, tls=tls)
    return list(out["output_ids"])


def chat(base_url: str, content: str, model: str, max_tokens: int = 32, timeout: float = 120.0, *,
         api_key: str | None = None, tls: ssl.SSLContext | None = None) -> dict[str, Any]:
    """Greedy chat completion; `model` is the served model name (the router routes by it)."""
    return post_json(
        f"{base_url}/v1/chat/completions",
        {"model": model, "messages": [{"role": "user", "content": content}],
         "max_tokens": max_tokens, "temperature": 0.0},
        timeout, api_key=api_key, tls=tls,
    )
