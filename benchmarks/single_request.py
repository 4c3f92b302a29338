"""Single-request latency and throughput: colocated vs disaggregated, in one run.

    python benchmarks/single_request.py --out DIR [--model tiny-llama] [--backends mooncake nixl]
        [--prompt-tokens 32 512] [--output-tokens 64] [--repeats 5]

Starts a colocated server and one PD stack per backend (one at a time, so they
do not compete for the cores), sends the same greedy requests one after the
other, and reports per configuration: TTFT (a 1-output-token request), end-to-
end time and tokens/s of an ``--output-tokens`` request, as medians over
``--repeats``. Ratios are against the colocated baseline measured in the same
run. Writes DIR/single_request.json and DIR/single_request.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from sglang_disagg.launch import LaunchConfig, Role, Stack, TransferBackend
from sglang_disagg.launch.client import generate_ids


def measure(url: str, prompt: list[int], output_tokens: int, repeats: int) -> dict:
    generate_ids(url, prompt, 2)  # warm the path (first request compiles/allocates)
    ttft, e2e = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        generate_ids(url, prompt, 1)
        ttft.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        out = generate_ids(url, prompt, output_tokens)
        e2e.append(time.perf_counter() - t0)
        assert len(out) == output_tokens
    med_e2e = statistics.median(e2e)
    return {"ttft_ms": 1000 * statistics.median(ttft), "e2e_ms": 1000 * med_e2e,
            "tokens_per_s": output_tokens / med_e2e}


def run_config(name: str, cfg: LaunchConfig, prompts: dict[int, list[int]], args) -> dict:
    stack = Stack.for_config(cfg)
    print(f"[bench] starting {name} ...", flush=True)
    stack.start()
    try:
        rows = {n: measure(stack.url, p, args.output_tokens, args.repeats) for n, p in prompts.items()}
    finally:
        stack.stop()
    print(f"[bench] {name}: started in {stack.startup_s:.1f}s; " + "; ".join(
        f"{n} tok prompt: TTFT {r['ttft_ms']:.0f} ms, {r['tokens_per_s']:.1f} tok/s" for n, r in rows.items()),
        flush=True)
    return {"name": name, "startup_s": stack.startup_s, "by_prompt_tokens": rows}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--backends", nargs="+", default=["mooncake", "nixl"])
    ap.add_argument("--prompt-tokens", nargs="+", type=int, default=[32, 512])
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--port", type=int, default=32000)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # Token ids 8.. are ordinary tokens; a fixed pattern keeps every config's prompt identical.
    prompts = {n: [1] + [8 + (i * 37) % 4000 for i in range(n - 1)] for n in args.prompt_tokens}
    logs = Path(tempfile.mkdtemp(prefix="bench-single-"))
    common = dict(model=args.model, port=args.port, max_total_tokens=8192, log_dir=None)
    configs = [("colocated", LaunchConfig(role=Role.COLOCATED, **common | {"log_dir": str(logs / "colocated")}))]
    configs += [(f"pd-{b}", LaunchConfig(role=Role.ALL, backend=TransferBackend(b),
                                          **common | {"log_dir": str(logs / b)})) for b in args.backends]
    results = [run_config(name, cfg, prompts, args) for name, cfg in configs]
    base = results[0]["by_prompt_tokens"]
    for r in results:
        for n, row in r["by_prompt_tokens"].items():
            row["tokens_per_s_vs_colocated"] = row["tokens_per_s"] / base[n]["tokens_per_s"]
            row["ttft_overhead_ms"] = row["ttft_ms"] - base[n]["ttft_ms"]
    doc = {"model": args.model, "output_tokens": args.output_tokens, "repeats": args.repeats, "results": results}
    (out / "single_request.json").write_text(json.dumps(doc, indent=2))
    plot(doc, out / "single_request.png")
    print(f"[bench] wrote {out / 'single_request.json'} and single_request.png")
    return 0


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    names = [r["name"] for r in doc["results"]]
    sizes = list(doc["results"][0]["by_prompt_tokens"])
    width = 0.8 / len(sizes)
    for i, n in enumerate(sizes):
        xs = [j + i * width for j in range(len(names))]
        a.bar(xs, [r["by_prompt_tokens"][n]["ttft_ms"] for r in doc["results"]], width, label=f"{n}-token prompt")
        b.bar(xs, [r["by_prompt_tokens"][n]["tokens_per_s"] for r in doc["results"]], width, label=f"{n}-token prompt")
    for ax, title in ((a, "TTFT (ms, median)"), (b, f"tokens/s, {doc['output_tokens']}-token output")):
        ax.set_xticks([j + width * (len(sizes) - 1) / 2 for j in range(len(names))], names)
        ax.set_title(title)
        ax.legend()
    fig.suptitle(f"single request, {doc['model']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
