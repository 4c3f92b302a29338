"""An attention-DP decoder at low load: how long a request waits after its KV landed, and what
idling costs, with a fully idle group sleeping at most 50 ms (ours) or 1 s (SGLang's own
--sleep-on-idle).

    python benchmarks/dp_idle.py --out DIR [--model tiny-deepseek-v3] [--requests 8] [--repeats 3]

One stack per (sleep cap, repeat), the caps interleaved: a prefill server (TP 1) and a decoder of
2 attention-DP groups over TP 2 (shmem), `SGLANG_DISAGG_DP_IDLE_SLEEP_MS` set for it
(sglang_disagg/hooks.dp_idle_sleep_ms). Per stack: `requests` sequential requests (one at a
time, 24 prompt tokens, 4 outputs, so one group waits for its KV while the other has nothing);
per request, the decoder's hand-off delay (its messenger's `landed` -> `handoff` timeline: the
last write landed -> the request joined the waiting queue) and the client's time to first
token; then the whole stack's CPU seconds per second over `idle_s` seconds with no request
(psutil: every process of the stack). Writes DIR/dp_idle.json and DIR/dp_idle.png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from sglang_disagg.hooks import DP_IDLE_SLEEP_ENV
from sglang_disagg.launch import LaunchConfig, Role, Stack
from sglang_disagg.launch.client import generate_ids

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import results_doc  # noqa: E402

CAPS_MS = (1000, 50)  # SGLang's --sleep-on-idle, ours


def _stack_cpu_s(stack: Stack) -> float:
    import psutil

    procs = [psutil.Process(p.pid) for p in stack.processes if p.poll() is None]
    every = {p.pid: p for p in procs} | {c.pid: c for p in procs for c in p.children(recursive=True)}
    total = 0.0
    for p in every.values():
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def one(cap_ms: int, cfg: LaunchConfig, requests: int, idle_s: float) -> dict:
    with Stack.for_config(cfg) as stack:
        url = next(p for p in stack.servers if p.spec.name == Role.DECODE.value).url
        generate_ids(url, [7] * 24, 4, rid="warm")
        ttfts = []
        for i in range(requests):
            t = time.monotonic()
            generate_ids(url, [11 + i, 5, 9] * 8, 1, rid=f"ttft-{i}")  # one token: its latency is the TTFT
            ttfts.append(time.monotonic() - t)
        time.sleep(2.0)  # the last request's stats published, the stack settled
        delays = []
        for g in range(2):
            name = "decode.messenger.json" if g == 0 else f"decode.messenger.group{g}.json"
            recent = json.loads((stack.log_dir / name).read_text()).get("recent", [])
            delays += [r["handoff"] - r["landed"] for r in recent if str(r["rid"]).startswith("ttft-")]
        before, t0 = _stack_cpu_s(stack), time.monotonic()
        time.sleep(idle_s)
        idle = (_stack_cpu_s(stack) - before) / (time.monotonic() - t0)
    return {"cap_ms": cap_ms, "handoff_delay_ms": sorted(round(1000 * d, 1) for d in delays),
            "handoff_delay_p50_ms": round(1000 * statistics.median(delays), 1) if delays else None,
            "ttft_p50_ms": round(1000 * statistics.median(ttfts), 1), "idle_cpu_s_per_s": round(idle, 3)}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--model", default="tiny-deepseek-v3")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--idle-s", type=float, default=10.0)
    ap.add_argument("--port", type=int, default=30700)
    args = ap.parse_args(argv)
    record = results_doc.Run.begin(argv, __file__)
    args.out.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="bench-dp-idle-"))
    rows, t0 = [], time.time()
    for rep in range(args.repeats):
        for cap in CAPS_MS:
            cfg = LaunchConfig(role=Role.ALL, model=args.model, backend="shmem", decode_tp=2, decode_attn_dp=2,
                               max_total_tokens=4096, port=args.port, log_dir=str(logs / f"cap{cap}-{rep}"),
                               env=((DP_IDLE_SLEEP_ENV, str(cap)),))
            rows.append(one(cap, cfg, args.requests, args.idle_s) | {"repeat": rep})
            print(f"[bench] {rows[-1]}", flush=True)
    keys = ("handoff_delay_p50_ms", "ttft_p50_ms", "idle_cpu_s_per_s")
    summary = [{"cap_ms": cap} | {k: statistics.median(r[k] for r in rows if r["cap_ms"] == cap) for k in keys}
               for cap in CAPS_MS]
    doc = {"model": args.model, "requests": args.requests, "repeats": args.repeats, "idle_s": args.idle_s,
           "wall_s": round(time.time() - t0), "summary": summary, "rows": rows}
    record.write(args.out / "dp_idle.json", doc, indent=1,
                 raw_repeats=results_doc.group_repeats(rows, ("cap_ms",), ("repeat",) + keys),
                 notes=["summary: per sleep cap the median over repeats of each stack's figures (each a median "
                        "over its requests, idle CPU one measurement); rows: every stack, its hand-off delays sorted",
                        "idle CPU counts every process of the stack (prefill, both decoder groups, router, "
                        "launcher's children), not only the decoder"])
    plot(doc, args.out / "dp_idle.png")
    for s in summary:
        print(s)
    return 0


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(10, 3.2))
    for ax, key, label in zip(axes, ("handoff_delay_p50_ms", "ttft_p50_ms", "idle_cpu_s_per_s"),
                              ("hand-off delay p50 (ms)", "TTFT p50 (ms)", "idle CPU (s/s)")):
        for j, cap in enumerate(CAPS_MS):
            vals = [r[key] for r in doc["rows"] if r["cap_ms"] == cap and r[key] is not None]
            ax.bar(j, statistics.median(vals) if vals else 0, color=("tab:gray", "tab:blue")[j])
            ax.plot([j] * len(vals), vals, "k.", ms=4)
        ax.set_xticks(range(len(CAPS_MS)), [f"sleep <= {c} ms" for c in CAPS_MS], fontsize=8)
        ax.set_title(label)
    fig.suptitle(f"{doc['model']}: attention-DP 2 decoder at one request at a time ({doc['repeats']} repeats)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
