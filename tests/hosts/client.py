"""Run inside a host: greedy requests to a front door, and the decoder's KV byte counter.

    python tests/hosts/client.py JOB.json  ->  prints {"outputs": [[ids]], "kv_bytes": N | null}

JOB: {"url", "prompts", "max_new_tokens", "metrics": "http://decode:port/metrics" | null, "api_key"}. The
test process lives in the root namespace, where no host address exists: it asks from inside.
"""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path

# Run as a script inside a host, so pytest's path is not ours: the harness lives at the
# repository's root, outside the installed package.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from harness.hosts.tail import KV_BYTES  # noqa: E402
from sglang_disagg.launch.client import generate_ids  # noqa: E402



def kv_bytes(url: str | None) -> float | None:
    if not url:
        return None
    with urllib.request.urlopen(url, timeout=10) as r:
        m = KV_BYTES.search(r.read().decode())
    return float(m.group(1)) if m else None


def main() -> None:
    job = json.loads(open(sys.argv[1]).read())
    out = {"kv_bytes_before": kv_bytes(job.get("metrics"))}
    out["outputs"] = [generate_ids(job["url"], p, job["max_new_tokens"], api_key=job.get("api_key"))
                      for p in job["prompts"]]
    out["kv_bytes"] = kv_bytes(job.get("metrics"))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
