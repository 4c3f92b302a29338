"""What the layer-counter poller costs on CPU: streaming against `--no-stream`, same stack.

    python benchmarks/poller_cost.py --out DIR [--runs 3] [--summarize]

Runs benchmarks/serving.py (SGLang's bench_serving, 64 random prompts of ~256 tokens, 32
output tokens, concurrency 16, tiny-llama, shmem) `--runs` times, each run both
configurations one after the other, into DIR/runN/; then writes DIR/summary.json: per
configuration the median over runs of input tok/s (prefill work under load), output tok/s,
TTFT and ITL medians, and streaming's ratio to --no-stream. On this 2-core machine runs
differ by up to ~2x in TTFT, so only the medians over runs are compared, never one run.
`--summarize` only rebuilds summary.json from existing run directories.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import results_doc  # noqa: E402

CONFIGS = ("messenger:shmem", "messenger:shmem+no-stream")
METRICS = ("input_throughput", "output_throughput", "median_ttft_ms", "median_itl_ms")


def summarize(out: Path, record: results_doc.Run) -> dict:
    runs = sorted(p for p in out.glob("run*") if (p / "serving.json").exists())
    rows: dict[str, dict[str, list[float]]] = {c: {m: [] for m in METRICS} for c in CONFIGS}
    for run in runs:
        for config in CONFIGS:
            name = config.replace(":", "-")
            line = (run / f"bench_serving-{name}.jsonl").read_text().splitlines()[-1]
            d = json.loads(line)
            for m in METRICS:
                rows[config][m].append(d[m])
    medians = {c: {m: statistics.median(v) for m, v in ms.items()} for c, ms in rows.items()}
    stream, plain = (medians[c] for c in CONFIGS)
    summary = {"runs": len(runs), "per_run": rows, "median": medians,
               "streaming_over_no_stream": {m: stream[m] / plain[m] for m in METRICS}}
    record.write(out / "summary.json", summary, indent=2,
                 raw_repeats=[{"config": c, "run": [p.name for p in runs], **ms} for c, ms in rows.items()],
                 notes=["median: per configuration the median over runs of bench_serving's figures; "
                        "per_run and raw_repeats: each run's (the same values)",
                        "each runN/serving.json records the command and machine of its own run; with "
                        "--summarize this document's are those of the summarizing command"])
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--summarize", action="store_true")
    args = ap.parse_args(argv)
    record = results_doc.Run.begin(argv, __file__)
    if not args.summarize:
        for i in range(1, args.runs + 1):
            subprocess.run([sys.executable, str(Path(__file__).parent / "serving.py"), "--out",
                            str(args.out / f"run{i}"), "--model", "tiny-llama", "--configs", *CONFIGS], check=True)
    print(json.dumps(summarize(args.out, record)["streaming_over_no_stream"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
