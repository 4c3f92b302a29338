"""Throughput against interactivity, the way the field compares PD systems (InferenceX:
throughput per GPU against tokens/s per user), here per core on a CPU machine.

    python benchmarks/pareto.py --out DIR [--configs colocated upstream:mooncake messenger:shmem
        messenger:libfabric:tcp] [--concurrency 1 2 4 8 16] [--input-len 512] [--output-len 128]

For each configuration one stack of smollm2-135m is started (`--role all --pin-cores`:
prefill server + router on core 0, decode server on core 1; colocated: one server on both
cores) and SGLang's own client runs against its front door at each concurrency C, with
max(8, 2 x C) random prompts of exactly --input-len tokens and --output-len output tokens
(`--random-range-ratio 1.0`; bench_serving ignores EOS unless told otherwise). Per level:
- output tokens/s per core: bench_serving's output throughput / the cores the stack uses (2);
- tokens/s per user: the median over requests of (output tokens - 1) / decode time, decode
  time = first token to last (the sum of the request's inter-token gaps);
- TTFT p50/p99, ITL p50/p99 (bench_serving's).
A level that lost a request fails the run (its latencies would describe a kinder sample).
DIR/pareto.json holds every level; DIR/pareto.png plots tokens/s per core against tokens/s
per user (one curve per configuration, points labelled by concurrency) and TTFT p50.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import results_doc  # noqa: E402
from serving import lost  # noqa: E402
from stack_configs import launch_config  # noqa: E402

from sglang_disagg.launch import Role, Stack  # noqa: E402
from sglang_disagg.models import resolve_model_path  # noqa: E402

MODEL = "smollm2-135m"
CONFIGS = ["colocated", "upstream:mooncake", "messenger:shmem", "messenger:libfabric:tcp"]
CORES = 2  # the stack's cores: --pin-cores uses both, a colocated server is not pinned


def level(port: int, model_dir: Path, concurrency: int, args, out_file: Path) -> dict:
    prompts = max(8, 2 * concurrency)
    cmd = [sys.executable, "-m", "sglang.benchmark.serving", "--backend", "sglang", "--host", "127.0.0.1",
           "--port", str(port), "--dataset-name", "random-ids", "--num-prompts", str(prompts),
           "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
           "--random-range-ratio", "1.0", "--max-concurrency", str(concurrency), "--tokenizer", str(model_dir),
           "--seed", str(concurrency), "--output-file", str(out_file), "--output-details", "--disable-tqdm"]
    env = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if r.returncode != 0 or not out_file.exists():
        raise RuntimeError(f"bench_serving failed (rc {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    res = json.loads(out_file.read_text().splitlines()[-1])
    lost(res, prompts)
    per_user = [(n - 1) / sum(itl) for n, itl in zip(res["output_lens"], res["itls"]) if n > 1 and sum(itl) > 0]
    return {"concurrency": concurrency, "prompts": prompts, "completed": res["completed"],
            "duration_s": round(res["duration"], 2), "output_tok_s": round(res["output_throughput"], 2),
            "output_tok_s_per_core": round(res["output_throughput"] / CORES, 2),
            "tok_s_per_user_median": round(statistics.median(per_user), 2),
            "ttft_p50_ms": round(res["median_ttft_ms"], 1), "ttft_p99_ms": round(res["p99_ttft_ms"], 1),
            "itl_p50_ms": round(res["median_itl_ms"], 2), "itl_p99_ms": round(res["p99_itl_ms"], 2)}


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.8))
    for config, levels in doc["results"].items():
        xs = [lv["tok_s_per_user_median"] for lv in levels]
        a.plot(xs, [lv["output_tok_s_per_core"] for lv in levels], marker="o", label=config)
        for lv, x in zip(levels, xs):
            a.annotate(str(lv["concurrency"]), (x, lv["output_tok_s_per_core"]), fontsize=7,
                       textcoords="offset points", xytext=(3, 3))
        b.plot([lv["concurrency"] for lv in levels], [lv["ttft_p50_ms"] / 1000 for lv in levels], marker="o",
               label=config)
    a.set_xlabel("tokens/s per user (median over requests)")
    a.set_ylabel("output tokens/s per core")
    a.set_title("throughput against interactivity (labels: concurrency)")
    b.set_xscale("log", base=2)
    b.set_xlabel("concurrency")
    b.set_ylabel("TTFT p50, s")
    b.set_title("time to first token")
    for ax in (a, b):
        ax.grid(alpha=0.3)
    a.legend(fontsize=8)
    fig.suptitle(f"sglang.bench_serving, {doc['model']}, random {doc['input_len']} in / {doc['output_len']} out, "
                 f"{doc['cores']} cores")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--configs", nargs="+", default=CONFIGS)
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--port", type=int, default=29500)
    args = ap.parse_args(argv)
    record = results_doc.Run.begin(argv, __file__)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = resolve_model_path(MODEL)
    logs = Path(tempfile.mkdtemp(prefix="pareto-"))
    started, results = record.started, {}
    tokens = max(args.concurrency) * (args.input_len + args.output_len) + 4096
    for text in args.configs:
        cfg = launch_config(text, MODEL, args.port, logs, max_total_tokens=tokens)
        if cfg.role is Role.ALL:
            cfg = dataclasses.replace(cfg, pin_cores=True)
        with Stack.for_config(cfg) as stack:
            levels = []
            for c in args.concurrency:
                row = level(stack.cfg.port, model_dir, c, args, out / f"bench-{text.replace(':', '-')}-c{c}.jsonl")
                print(f"[pareto] {text:26s} C={c:<3d} {row['output_tok_s_per_core']:7.2f} tok/s/core "
                      f"{row['tok_s_per_user_median']:6.2f} tok/s/user TTFT p50 {row['ttft_p50_ms']:.0f} ms "
                      f"ITL p50 {row['itl_p50_ms']:.1f} ms", flush=True)
                levels.append(row)
        results[text] = levels
    base = {lv["concurrency"]: lv for lv in results.get("upstream:mooncake", [])}
    for text, levels in results.items():
        for lv in levels:
            b = base.get(lv["concurrency"])
            if b and text != "upstream:mooncake":
                lv["vs_upstream_pd"] = {k: round(lv[k] / b[k], 3) for k in
                                        ("output_tok_s_per_core", "tok_s_per_user_median", "ttft_p50_ms")}
    doc = {"model": MODEL, "input_len": args.input_len, "output_len": args.output_len, "cores": CORES,
           "time": record.date, "duration_s": round(time.time() - started),
           "layout": "--role all --pin-cores (prefill + router on core 0, decode on core 1); colocated unpinned",
           "results": results}
    record.write(out / "pareto.json", doc, indent=1, notes=[
        "one bench_serving run per (configuration, concurrency), no repeats: its percentiles are over that "
        "run's requests; tok_s_per_user_median: the median over its requests",
        "the per-request bench_serving files (bench-*.jsonl) are deleted after the run"])
    for f in out.glob("bench-*.jsonl"):  # per-request details: large, the summary above is what is kept
        f.unlink()
    plot(doc, out / "pareto.png")
    print(f"[pareto] wrote {out / 'pareto.json'} and pareto.png in {doc['duration_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
