"""Draining a decoder by live migration against waiting for its requests to end.

    python benchmarks/migration.py --out DIR [--requests 16] [--prompt-tokens 2048]
        [--output-tokens 512] [--backends shmem libfabric:tcp] [--port 33000]

Per backend: a prefill server and decoder A (launcher --role all) and decoder B (--role decode)
on the same prefill server, tiny-llama float32. Two phases on the same stacks, each with
--requests streaming greedy requests of --prompt-tokens fresh prompt tokens asking
--output-tokens, sent straight to A (as its router would):

- wait: once every stream has 5 tokens, how long until A holds no request (they all end there);
- drain: once every stream has 5 tokens, POST /drain {"to": [B]} on A's messenger port (admin
  key); how long until A's /drain says done and its pages are free (the streams go on on B).

Per phase: the largest gap between two tokens any client saw from the trigger on (the wait
phase's is the baseline: ordinary decoding under the same load), and for the drain the bytes A
wrote per request against the request's KV (the floor: its pages of every layer, once).
Writes DIR/migration.json and DIR/migration.png.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import results_doc  # noqa: E402
from single_request import prompt_of  # noqa: E402

from sglang_disagg.launch import LaunchConfig, Role, Stack  # noqa: E402
from sglang_disagg.launch.client import greedy  # noqa: E402
from sglang_disagg.messenger.planner import pages_for  # noqa: E402


class Stream(threading.Thread):
    """One streaming request: the arrival time of each token event."""

    def __init__(self, url: str, prompt: list[int], n: int) -> None:
        super().__init__(daemon=True)
        self.url, self.prompt, self.n = url, prompt, n
        self.times: list[float] = []
        self.tokens = 0
        self.err: str | None = None
        self.start()

    def run(self) -> None:
        try:
            host, port = self.url.removeprefix("http://").split(":")
            conn = http.client.HTTPConnection(host, int(port), timeout=600)
            conn.request("POST", "/generate", json.dumps({"input_ids": self.prompt, "stream": True,
                                                          "sampling_params": greedy(self.n)}),
                         {"Content-Type": "application/json"})
            for line in conn.getresponse():
                if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                    ev = json.loads(line[5:])
                    if "error" in ev:
                        raise RuntimeError(str(ev["error"]))
                    self.times.append(time.monotonic())
                    self.tokens = len(ev["output_ids"])
        except Exception as e:  # noqa: BLE001 - recorded in the results
            self.err = str(e)[:200]


def drain_call(a: Stack, method: str, body: dict | None = None) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", a.cfg.ports.decode_metrics, timeout=10)
    conn.request(method, "/drain", json.dumps(body).encode() if body else None,
                 {"Authorization": f"Bearer {a.admin_key}", "Content-Type": "application/json"})
    r = conn.getresponse()
    return json.loads(r.read() or b"{}")


def held(a: Stack) -> tuple[int, int]:
    """(requests, pages beyond the radix cache) A's decoder holds, from its published stats."""
    s = a.messenger_stats("decode") or {}
    sched = s.get("scheduler", {})
    q, kv = sched.get("sglang_disagg_queue_depth", {}), sched.get("sglang_disagg_kv_pages", {})
    return int(q.get("running", 1) + q.get("waiting", 0)), int(kv.get("allocated", 1) - kv.get("cached", 0))


def phase(a: Stack, b: Stack, args, variant: int, drain: bool) -> dict:
    url = next(p for p in a.servers if p.spec.name == Role.DECODE.value).url
    streams = [Stream(url, prompt_of(args.prompt_tokens, variant * 1000 + i), args.output_tokens)
               for i in range(args.requests)]
    deadline = time.monotonic() + 600
    while not all(s.tokens >= 5 or s.err for s in streams) and time.monotonic() < deadline:
        time.sleep(0.005)
    t0 = time.monotonic()
    if drain:
        drain_call(a, "POST", {"to": [b.url]})
        while not drain_call(a, "GET").get("done") and time.monotonic() < deadline:
            time.sleep(0.01)
    while held(a) != (0, 0) and time.monotonic() < deadline:
        time.sleep(0.01)
    t_free = time.monotonic() - t0
    for s in streams:
        s.join(600)
    gaps = [max((y - x for x, y in zip(s.times, s.times[1:]) if y >= t0), default=0.0) for s in streams]
    row = {"phase": "drain" if drain else "wait", "seconds_until_a_holds_nothing": round(t_free, 4),
           "largest_token_gap_ms": round(1000 * max(gaps), 2), "median_largest_gap_ms": round(1000 * statistics.median(gaps), 2),
           "errors": [s.err for s in streams if s.err], "tokens": [s.tokens for s in streams]}
    if drain:
        stats = a.messenger_stats("decode")
        traces = stats["migrations"][-args.requests:]
        floors = [pages_for(t["kv_tokens"], stats["page_size"]) * stats["kv_page_bytes"] for t in traces]
        row |= {"migrated": len(traces), "bytes_per_request": [t["bytes"] for t in traces], "kv_floor_bytes": floors,
                "bytes_over_floor": round(sum(t["bytes"] for t in traces) / sum(floors), 4) if floors else None,
                "hand_over_ms_median": round(1000 * statistics.median(t["hand_over_s"] for t in traces), 2)
                if traces else None, "status": drain_call(a, "GET")}
    return row


def run_backend(spec: str, args, logs: Path, port: int) -> dict:
    backend, _, provider = spec.partition(":")
    common = dict(model="tiny-llama", backend=backend, provider=provider or None,
                  max_total_tokens=args.requests * (args.prompt_tokens + args.output_tokens) + 4096,
                  extra_args=("--chunked-prefill-size", "2048", "--dtype", "float32"))
    a = Stack.for_config(LaunchConfig(role=Role.ALL, port=port, log_dir=str(logs / f"{backend}-a"), **common))
    b = None
    try:
        a.start()
        b = Stack.for_config(LaunchConfig(role=Role.DECODE, port=port + 10, log_dir=str(logs / f"{backend}-b"),
                                          secret_file=a.cfg.secret_file,
                                          prefill_messengers=(f"127.0.0.1:{a.cfg.ports.bootstrap}",), **common))
        b.start()
        rows = [phase(a, b, args, 1, drain=False), phase(a, b, args, 2, drain=True)]
    finally:
        if b is not None:
            b.stop()
        a.stop()
    wait, drain = rows
    return {"backend": spec, "rows": rows,
            "drain_over_wait": round(drain["seconds_until_a_holds_nothing"] / wait["seconds_until_a_holds_nothing"], 4)}


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (l, r) = plt.subplots(1, 2, figsize=(11, 4))
    names = [x["backend"] for x in doc["results"]]
    for i, key in enumerate(("wait", "drain")):
        xs = [j + i * 0.4 for j in range(len(names))]
        rows = [next(row for row in x["rows"] if row["phase"] == key) for x in doc["results"]]
        l.bar(xs, [row["seconds_until_a_holds_nothing"] for row in rows], 0.4, label=key)
        r.bar(xs, [row["largest_token_gap_ms"] for row in rows], 0.4, label=key)
    for ax, title in ((l, "seconds until decoder A holds nothing"), (r, "largest inter-token gap a client saw (ms)")):
        ax.set_xticks([j + 0.2 for j in range(len(names))], names)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    fig.suptitle(f"drain by migration vs waiting: {doc['requests']} streams, {doc['prompt_tokens']}-token prompts, "
                 f"{doc['output_tokens']} output tokens, tiny-llama", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--output-tokens", type=int, default=512)
    ap.add_argument("--backends", nargs="+", default=["shmem", "libfabric:tcp"])
    ap.add_argument("--port", type=int, default=33000)
    args = ap.parse_args(argv)
    record = results_doc.Run.begin(argv, __file__)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="bench-migration-"))
    results = [run_backend(spec, args, logs, args.port + 100 * i) for i, spec in enumerate(args.backends)]
    doc = {"requests": args.requests, "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens,
           "results": results}
    record.write(out / "migration.json", doc, indent=2, raw_repeats=None, notes=[
        "one run per backend; seconds_until_a_holds_nothing is measured from the moment every stream had 5 tokens",
        "largest_token_gap_ms: the largest gap between two token events any client saw after that moment "
        "(wait: ordinary decoding, the baseline)",
        "bytes_over_floor: bytes A wrote for the migrated requests over their KV (pages of every layer, each KV head "
        "once): 1.0 means nothing was sent twice or recomputed"])
    plot(doc, out / "migration.png")
    print(f"[bench] wrote {out / 'migration.json'} and migration.png")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
