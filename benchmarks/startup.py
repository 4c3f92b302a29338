"""First contact: how long `--role all` takes to be ready, against one colocated server, in one run.

    python benchmarks/startup.py --out DIR [--model tiny-llama] [--repeats 3]
        [--configs colocated messenger:shmem colocated+spawn ...]

Starts each configuration `--repeats` times, alternating (so a slow minute of a shared
machine hits both), with the launcher's own definition of ready: every server healthy, and
for `--role all` a real request routed router -> prefill -> decode. Records each phase as
the launcher reports it (server healthy, router healthy, first request routed) and writes
DIR/startup.json with the median per configuration and its ratio to colocated's.
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

from sglang_disagg.launch import Stack

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import results_doc  # noqa: E402
from stack_configs import launch_config  # noqa: E402

# +spawn: the same stacks with SGLang's own start method, for how much the launcher's fork saves.
DEFAULT_CONFIGS = ["colocated", "messenger:shmem", "colocated+spawn", "messenger:shmem+spawn"]


def start_once(name: str, model: str, port: int, logs: Path) -> dict:
    stack = Stack.for_config(launch_config(name, model, port, logs))
    try:
        stack.start()
    finally:
        stack.stop()
    return {"startup_s": round(stack.startup_s, 2), "phases_s": {k: round(v, 2) for k, v in stack.phases.items()}}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--port", type=int, default=32400)
    args = ap.parse_args(argv)
    record = results_doc.Run.begin(argv, __file__)
    if "colocated" not in args.configs:
        raise SystemExit("--configs needs colocated: the ratios are against it")
    args.out.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="bench-startup-"))
    runs: dict[str, list[dict]] = {c: [] for c in args.configs}
    for k in range(args.repeats):
        for name in args.configs:
            run = start_once(name, args.model, args.port, logs / f"{k}")
            runs[name].append(run)
            print(f"[startup] {name} #{k + 1}: {json.dumps(run)}", flush=True)
            time.sleep(1)
    base = statistics.median(r["startup_s"] for r in runs["colocated"])
    rows = []
    for name, rs in runs.items():
        med = statistics.median(r["startup_s"] for r in rs)
        rows.append({"config": name, "startup_s_median": round(med, 2), "ratio_to_colocated": round(med / base, 2),
                     "startup_s": [r["startup_s"] for r in rs], "phases_s": [r["phases_s"] for r in rs]})
    doc = {"model": args.model, "rows": rows}
    record.write(args.out / "startup.json", doc, indent=2,
                 raw_repeats=[{"config": name, "startup_s": [r["startup_s"] for r in rs],
                               "phases_s": [r["phases_s"] for r in rs]} for name, rs in runs.items()],
                 notes=["configurations alternate within each repeat; startup_s_median: the median over repeats, "
                        "ratio_to_colocated: that median over colocated's"])
    for r in rows:
        print(f"[startup] {r['config']}: median {r['startup_s_median']} s ({r['ratio_to_colocated']}x colocated)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
