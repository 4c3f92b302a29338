"""Serving under concurrency with SGLang's own client, one configuration after the other.

    python benchmarks/serving.py --out DIR [--quick] [--model tiny-llama]
        [--configs colocated messenger:shmem upstream:mooncake]
        [--num-prompts 64] [--input-len 256] [--output-len 32] [--range-ratio 0.5] [--max-concurrency 16]

For each configuration: start it with the launcher (`--role colocated` or `--role all`),
run ``python -m sglang.bench_serving --backend sglang --dataset-name random-ids`` against
its front door, stop it. Writes DIR/serving.json (one row per configuration: output tok/s,
TTFT and ITL median/p99, requests completed, and each metric's ratio to colocated in the
same run) and DIR/serving.png.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from sglang_disagg.launch import Stack
from sglang_disagg.models import resolve_model_path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import results_doc  # noqa: E402
from stack_configs import launch_config  # noqa: E402

METRICS = ["output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms",
           "median_e2e_latency_ms", "completed"]


def bench(stack: Stack, args, model_dir: Path, out_file: Path) -> dict:
    cmd = [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang", "--host", "127.0.0.1",
           "--port", str(stack.cfg.port), "--dataset-name", "random-ids", "--num-prompts", str(args.num_prompts),
           "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
           "--random-range-ratio", str(args.range_ratio), "--max-concurrency", str(args.max_concurrency),
           "--tokenizer", str(model_dir), "--seed", "1", "--output-file", str(out_file), "--disable-tqdm"]
    env = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if r.returncode != 0 or not out_file.exists():
        raise RuntimeError(f"bench_serving failed (rc {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    result = json.loads(out_file.read_text().splitlines()[-1])
    lost(result, args.num_prompts)
    return {k: result[k] for k in METRICS}


def lost(result: dict, num_prompts: int) -> None:
    """A run that lost requests fails: its latencies would describe a shorter, kinder
    sample (bench_serving itself only counts them)."""
    if result["completed"] < num_prompts:
        errors = sorted({e.strip().splitlines()[-1][:200] for e in result.get("errors", []) if e})
        raise RuntimeError(f"bench_serving served {result['completed']} of {num_prompts} requests; "
                           f"errors: {errors[:3]}")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--configs", nargs="+", default=["colocated", "messenger:shmem", "upstream:mooncake"])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--range-ratio", type=float, default=0.5)
    ap.add_argument("--max-concurrency", type=int, default=16)
    ap.add_argument("--port", type=int, default=32100)
    ap.add_argument("--quick", action="store_true", help="16 prompts at concurrency 4")
    args = ap.parse_args(argv)
    record = results_doc.Run.begin(argv, __file__)
    if args.quick:
        args.num_prompts, args.max_concurrency = 16, 4
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = resolve_model_path(args.model)
    logs = Path(tempfile.mkdtemp(prefix="bench-serving-"))
    rows = []
    for text in args.configs:
        cfg = launch_config(text, args.model, args.port, logs, max_total_tokens=16384)
        stack = Stack.for_config(cfg)
        print(f"[bench] starting {text} ...", flush=True)
        stack.start()
        try:
            row = {"config": text, "transfer": cfg.describe_transfer()} | bench(
                stack, args, model_dir, out / f"bench_serving-{text.replace(':', '-')}.jsonl")
        finally:
            stack.stop()
        print(f"[bench] {text}: {row['output_throughput']:.1f} output tok/s, TTFT median "
              f"{row['median_ttft_ms']:.0f} ms, ITL median {row['median_itl_ms']:.1f} ms, "
              f"{row['completed']}/{args.num_prompts} completed", flush=True)
        rows.append(row)
    base = next((r for r in rows if r["config"] == "colocated"), None)
    if base is not None:
        for r in rows:
            for k in ("output_throughput", "median_ttft_ms", "median_itl_ms"):
                r[f"{k}_vs_colocated"] = r[k] / base[k] if base[k] else None
    doc = {"model": args.model, "num_prompts": args.num_prompts, "input_len": args.input_len,
           "output_len": args.output_len, "range_ratio": args.range_ratio, "max_concurrency": args.max_concurrency,
           "results": rows}
    record.write(out / "serving.json", doc, indent=2, notes=[
        "one bench_serving run per configuration, no repeats: medians and p99 are over that run's requests; "
        "its full output is DIR/bench_serving-CONFIG.jsonl", "*_vs_colocated: ratio to the colocated row of this run"])
    plot(doc, out / "serving.png")
    print(f"[bench] wrote {out / 'serving.json'} and serving.png")
    return 0


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["config"] for r in doc["results"]]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, key, title in zip(axes, ("output_throughput", "median_ttft_ms", "median_itl_ms"),
                              ("output tokens/s", "TTFT median (ms)", "ITL median (ms)")):
        ax.bar(range(len(names)), [r[key] for r in doc["results"]])
        ax.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=8)
        ax.set_title(title)
    fig.suptitle(f"sglang.bench_serving, {doc['model']}, {doc['num_prompts']} prompts, "
                 f"concurrency {doc['max_concurrency']}, in {doc['input_len']} / out {doc['output_len']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
