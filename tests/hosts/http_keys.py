"""The HTTP keys of a deployment, tried from a host outside it (exposure.py runs these).

``row(host, port, purpose, api, admin)`` runs in the outsider's network: each HTTP port is asked
what an attacker on the network would ask, without a key, then what a client holding the API key
(read from the router's ``api-key`` file, where the launcher says a client finds it) would ask.
Promised (sglang_disagg/launch/keys.py):

- an SGLang server: every endpoint but /health refused without a key (/generate, /v1/models,
  /get_server_info, the admin endpoints /flush_cache and /update_weights_from_disk); with the API
  key /get_server_info is served, the admin endpoints still refused (they take the admin key only);
- the router: /generate refused without a key and served with the API key; its control plane
  (GET and POST /workers) refused without a key and with the API key (it takes the admin key only);
- no answer, to anyone, holds the API key or the admin key (SGLang's /get_server_info carried
  them before the patch that redacts them; the router forwards it from a worker).

The metrics ports answer without a key (Prometheus scrapes them; SGLang's /metrics is open too):
rows, no promise.

``visible(dep)`` reads every process's command line on the machine (any user can) and the
nodes' logs, for the two keys and the secret: promised to find none.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from pathlib import Path

from harness.hosts.deployment import Deployment

REFUSED = ("401", "403")
GENERATE = {"input_ids": [1, 9, 10], "sampling_params": {"max_new_tokens": 2}}
ANY, REFUSE, SERVE = "any", "refused", "served"


def _http(url: str, method: str, body: dict | None, key: str | None) -> tuple[str, str]:
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(), headers=headers,
                                 method=method)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return str(r.status), r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return str(e.code), e.read().decode(errors="replace")
    except OSError as e:
        return type(e).__name__, ""


def _tries(host: str, purpose: str) -> list[tuple[str, str, dict | None, bool, str]]:
    """(method, path, body, with the API key, expected) for a port."""
    if purpose == "router":
        worker = {"url": f"http://{host}:1"}  # a worker that is not there: harmless if it were taken
        return [("GET", "/health", None, False, ANY), ("GET", "/v1/models", None, False, ANY),
                ("POST", "/generate", GENERATE, False, REFUSE), ("GET", "/workers", None, False, REFUSE),
                ("POST", "/workers", worker, False, REFUSE), ("POST", "/generate", GENERATE, True, SERVE),
                ("GET", "/get_server_info", None, True, ANY), ("POST", "/workers", worker, True, REFUSE)]
    weights = {"model_path": "/nonexistent"}  # refused before it is read; a path nothing loads if it were not
    return [("GET", "/health", None, False, ANY), ("GET", "/v1/models", None, False, REFUSE),
            ("GET", "/get_server_info", None, False, REFUSE), ("POST", "/generate", GENERATE, False, REFUSE),
            ("POST", "/flush_cache", {}, False, REFUSE), ("POST", "/update_weights_from_disk", weights, False, REFUSE),
            ("GET", "/get_server_info", None, True, SERVE), ("POST", "/flush_cache", {}, True, REFUSE),
            ("POST", "/update_weights_from_disk", weights, True, REFUSE)]


def row(host: str, port: int, purpose: str, api: str, admin: str) -> tuple[str, str, bool]:
    """What the port answered (no key; API key), its promise, and whether the promise held."""
    base = f"http://{host}:{port}"
    if "metrics" in purpose:
        text = urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode()
        served = re.search(r'^\S+_requests_total\{outcome="served"\} (\S+)', text, re.M)
        return (f"GET /metrics: {sum(1 for ln in text.splitlines() if ln and ln[0] != '#')} samples"
                + (f" (requests served {served.group(1)})" if served else "") + "; no key asked (Prometheus)", "", True)
    said: dict[bool, list[str]] = {False: [], True: []}
    broken, leaked = [], False
    for method, path, body, keyed, want in _tries(host, purpose):
        status, text = _http(base + path, method, body, api if keyed else None)
        said[keyed].append(f"{method} {path} {status}")
        leaked |= api in text or admin in text
        if (want == REFUSE and status not in REFUSED) or (want == SERVE and status != "200"):
            broken.append(f"{method} {path} {'with the API key' if keyed else 'without a key'}: {status}, "
                          f"expected {want}")
    what = f"no key: {', '.join(said[False])}; API key: {', '.join(said[True])}"
    what += "; an answer held a key" if leaked else "; no answer held a key"
    promise = ("serves its API key, refuses a request without one; control plane with the admin key only"
               if purpose == "router" else "a key for all but /health; admin endpoints with the admin key only")
    return what + ("; BROKEN: " + "; ".join(broken) if broken else ""), promise, not broken and not leaked


def client_key(dep: Deployment) -> str:
    """The API key where the launcher tells a client to find it: the router node's log dir."""
    return (dep.root / "router" / "api-key").read_text().strip()


def visible(dep: Deployment) -> tuple[int, list[str]]:
    """How many command lines were read, and where a key or the secret shows: a process's
    command line (readable by any user of the machine) or a node's output and logs."""
    values = {"the API key": dep.keys.api, "the admin key": dep.keys.admin,
              "the secret": (dep.root / "secret").read_text().strip()}
    found, read = [], 0
    for f in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = f.read_bytes()
        except OSError:  # gone meanwhile
            continue
        read += 1
        name = argv.split(b"\0", 1)[0].decode(errors="replace")
        found += [f"{what} on the command line of pid {f.parent.name} ({name})" for what, v in values.items()
                  if v.encode() in argv]
    for log in [*dep.root.glob("*.out"), *dep.root.glob("*/*.log")]:
        text = log.read_text(errors="replace")
        found += [f"{what} in {log}" for what, v in values.items() if v in text]
    return read, found
