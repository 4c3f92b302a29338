"""Another user of this machine against the default `--role all` stack on 127.0.0.1.

Loopback keeps other machines out, not other users: any local account reaches 127.0.0.1. The
stack holds its secret, so it runs in keys.Scope.ADMIN: serving stays keyless (the printed curl
works as it is), while SGLang's admin endpoints and the router's control plane take the admin
key, which only the owner can read (LOG_DIR/admin-key, 0600 in a 0700 dir). Checked from a
process running as uid `nobody` (runuser; stdlib urllib only) against the stack the e2e modules
share (conftest.DEFAULT: no extra stack). Before, that user registered a worker of its own with
the router (POST /workers 202: it would have received the owner's prompts), flushed the
decoder's cache (200) and reached the decoder's weight loading.

Not covered here: a keyed (non-loopback) deployment refusing /generate and /v1/chat/completions
without the API key; that needs a stack of its own (tests/unit/test_http_keys.py checks SGLang's
decision with the keys the launcher writes; tests/hosts/http_keys.py the live cross-host stack).
"""

from __future__ import annotations

import json
import subprocess
import urllib.error
import urllib.request

from sglang_disagg.launch import keys
from sglang_disagg.launch.client import generate_ids, greedy

from .conftest import DEFAULT

NOBODY = "nobody"
PROMPT = [1, 450, 783, 310, 3444, 338]  # tiny-llama: a vocabulary of 4096
TOKENS = 8
WRONG = "0" * 64

# Runs as `nobody` with the system Python and the stdlib only: each call -> [status, body head].
_AS_NOBODY = r"""
import json, sys, urllib.error, urllib.request
calls, key_file = json.loads(sys.argv[1])
out = {"calls": [], "key_file": ""}
for method, url, body, key in calls:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} | ({"Authorization": "Bearer " + key} if key else {})
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, method=method, headers=headers),
                                    timeout=120) as r:
            out["calls"].append([r.status, r.read(4000).decode(errors="replace")])
    except urllib.error.HTTPError as e:
        out["calls"].append([e.code, e.read(400).decode(errors="replace")])
try:
    open(key_file).read()
    out["key_file"] = "read"
except OSError as e:
    out["key_file"] = type(e).__name__
print(json.dumps(out))
"""


def as_nobody(calls: list[tuple[str, str, dict | None, str]], key_file: str) -> dict:
    r = subprocess.run(["runuser", "-u", NOBODY, "--", "/usr/bin/python3", "-c", _AS_NOBODY,
                        json.dumps([calls, key_file])], capture_output=True, text=True, timeout=300, cwd="/",
                       check=False)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def call(method: str, url: str, body: dict | None = None, key: str = "") -> tuple[int, str]:
    """The owner's request (this process, root)."""
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    data = None if body is None else json.dumps(body).encode()
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, method=method, headers=headers),
                                    timeout=60) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read(400).decode(errors="replace")


def test_another_local_user_is_served_but_cannot_use_the_admin_endpoints(stacks):
    stack = stacks.get(DEFAULT)
    assert stack.scope is keys.Scope.ADMIN and stack.api_key == ""
    router = stack.router.url
    prefill, decode = (next(p.url for p in stack.servers if p.spec.name == n) for n in ("prefill", "decode"))
    key_file = stack.log_dir / keys.ADMIN_KEY_FILE
    admin = key_file.read_text().strip()
    assert admin == stack.admin_key and oct(key_file.stat().st_mode & 0o777) == "0o600"
    assert not (stack.log_dir / keys.API_KEY_FILE).exists()
    rogue = "http://127.0.0.1:9"  # a worker of that user's: it would receive the owner's prompts
    weights = {"model_path": str(stack.model_path)}  # a real path: through the door it would load them
    generate = {"input_ids": PROMPT, "sampling_params": greedy(TOKENS)}  # as generate_ids asks
    calls = [("GET", f"{router}/workers", None, ""),
             ("POST", f"{router}/workers", {"url": rogue}, ""),
             ("POST", f"{router}/flush_cache", {}, ""),
             ("GET", f"{router}/get_loads", None, ""),
             ("POST", f"{decode}/flush_cache", {}, ""),
             ("POST", f"{prefill}/flush_cache", {}, ""),
             ("POST", f"{decode}/update_weights_from_disk", weights, ""),
             ("POST", f"{router}/workers", {"url": rogue}, WRONG),  # a wrong admin key
             ("GET", f"{router}/workers", None, WRONG),
             ("POST", f"{decode}/flush_cache", {}, WRONG),
             ("POST", f"{decode}/update_weights_from_disk", weights, WRONG),
             ("POST", f"{router}/generate", generate, "")]  # serving: keyless on loopback
    got = as_nobody(calls, str(key_file))
    print("as nobody:", [(c[0], c[1], s) for c, (s, _) in zip(calls, got["calls"], strict=True)],
          "admin-key:", got["key_file"])
    *refused, (served, body) = got["calls"]
    assert [s for s, _ in refused] == [401] * len(refused), list(zip(calls, refused, strict=False))
    assert got["key_file"] == "PermissionError"
    assert served == 200, body
    owners = generate_ids(stack.url, PROMPT, TOKENS, **stack.client_kw)
    assert json.loads(body)["output_ids"] == owners and owners

    # The owner, with the admin key: the worker list (no rogue worker in it), the flushes.
    status, listed = call("GET", f"{router}/workers", key=admin)
    assert status == 200, listed
    urls = [w["url"] for w in json.loads(listed)["workers"]]
    assert rogue not in urls and decode in urls, urls
    for url in (decode, prefill):
        status, text = call("POST", f"{url}/flush_cache", {}, key=admin)
        assert status == 200, (url, text)
    status, text = call("POST", f"{router}/flush_cache", {}, key=admin)
    print("owner: router /flush_cache with the admin key:", status, text[:200])
    # Past the router's gate: not the answer the keyless call got (its flush of the workers, which
    # smg sends without a key, is docs/security.md's; each server is flushed above).
    assert (status, text) != tuple(got["calls"][2]), text
    assert generate_ids(stack.url, PROMPT, TOKENS, **stack.client_kw) == owners  # still served after the flushes
