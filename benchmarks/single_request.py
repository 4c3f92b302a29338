"""Single-request latency and throughput: colocated vs the messenger vs upstream PD, one run.

    python benchmarks/single_request.py --out DIR [--model tiny-llama] [--quick]
        [--configs colocated messenger:shmem messenger:nixl upstream:mooncake ...]
        [--prompt-tokens 32 512 2048] [--output-tokens 64] [--repeats 5]

Starts each configuration in turn (one at a time, so they do not compete for the cores),
sends the same greedy requests one after the other (every measured request has its own
prompt, so none is a radix-cache hit: TTFT includes the whole prefill and transfer), and
reports per configuration and prompt length: TTFT (a 1-output-token request), end-to-end
time and tokens/s of an ``--output-tokens`` request (medians over ``--repeats``), and the KV writes one request
took: measured from the decoder's counters for the messenger, computed with the planner for
upstream SGLang's token-slot scheme (NHD rows, one write per token slot when TP differs).
Ratios are against the colocated baseline of the same run. Writes DIR/single_request.json
and DIR/single_request.png.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from sglang_disagg.launch import Stack
from sglang_disagg.launch.client import generate_ids
from sglang_disagg.messenger.planner import KVGeometry, Layout, ShardPlan, pages_for
from sglang_disagg.models import BUILTIN_MODELS

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import results_doc  # noqa: E402
from stack_configs import launch_config  # noqa: E402

DEFAULT_CONFIGS = ["colocated", "messenger:shmem", "messenger:libfabric:tcp", "messenger:nixl",
                   "messenger:mooncake", "upstream:mooncake"]


def settled_stats(stack: Stack, timeout: float = 5.0) -> dict:
    """The decoder's counters once two reads 0.4 s apart agree (they lag by <= 0.2 s)."""
    last, deadline = None, time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = stack.messenger_stats("decode") or {}
        if stats == last:
            return stats
        last = stats
        time.sleep(0.4)
    return last or {}


def prompt_of(n: int, variant: int) -> list[int]:
    """A fixed n-token prompt; each variant differs from its second token on, so no
    measured request is a radix-cache hit on any server (token ids 8.. are ordinary)."""
    return [1] + [8 + ((i + 7919 * variant) * 37) % 4000 for i in range(n - 1)]


def measure(stack: Stack, n: int, output_tokens: int, repeats: int) -> tuple[dict, dict]:
    """The row (medians over the repeats) and each repeat's raw values."""
    url = stack.url
    generate_ids(url, prompt_of(n, 0), 2)  # warm the path (first request compiles/allocates)
    before = settled_stats(stack)
    ttft, e2e = [], []
    for k in range(repeats):
        t0 = time.perf_counter()
        generate_ids(url, prompt_of(n, 1 + 2 * k), 1)
        ttft.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        out = generate_ids(url, prompt_of(n, 2 + 2 * k), output_tokens)
        e2e.append(time.perf_counter() - t0)
        assert len(out) == output_tokens
    med = statistics.median(e2e)
    row = {"ttft_ms": 1000 * statistics.median(ttft), "ttft_min_ms": 1000 * min(ttft), "e2e_ms": 1000 * med,
           "tokens_per_s": output_tokens / med}
    after = settled_stats(stack)
    if after.get("requests_carried") is not None:
        carried = after["requests_carried"] - before.get("requests_carried", 0)
        row["writes_per_request"] = (after["writes_received"] - before.get("writes_received", 0)) / max(carried, 1)
    raw = {"ttft_ms": [1000 * x for x in ttft], "e2e_ms": [1000 * x for x in e2e],
           "tokens_per_s": [output_tokens / x for x in e2e]}
    return row, raw


def upstream_writes(model: str, prompt_tokens: int, prefill_tp: int = 1, decode_tp: int = 1) -> int:
    """SGLang's upstream scheme for one request, by the planner: KV rows of one token slot
    (NHD, page size 1), whole rows when both sides hold the same heads, one write per token
    slot and head-slice otherwise; prefill sends the whole prompt."""
    spec = BUILTIN_MODELS[model]
    g = KVGeometry(spec.num_layers, spec.num_kv_heads, spec.resolved_head_dim, spec.resolved_head_dim, 1, 4,
                   Layout.NHD)
    return ShardPlan.build(g, prefill_tp, decode_tp).total_writes(prompt_tokens)


def run_config(name: str, args, logs: Path) -> tuple[dict, list[dict]]:
    cfg = launch_config(name, args.model, args.port, logs)
    stack = Stack.for_config(cfg)
    print(f"[bench] starting {name} ...", flush=True)
    stack.start()
    try:
        measured = {n: measure(stack, n, args.output_tokens, args.repeats) for n in args.prompt_tokens}
    finally:
        stack.stop()
    print(f"[bench] {name}: started in {stack.startup_s:.1f}s; " + "; ".join(
        f"{n} tok: TTFT {r['ttft_ms']:.0f} ms, {r['tokens_per_s']:.1f} tok/s"
        + (f", {r['writes_per_request']:.0f} writes" if "writes_per_request" in r else "")
        for n, (r, _) in measured.items()), flush=True)
    rows = {n: row for n, (row, _) in measured.items()}
    raw = [{"config": name, "prompt_tokens": n, **values} for n, (_, values) in measured.items()]
    return {"name": name, "startup_s": stack.startup_s, "transfer": cfg.describe_transfer(),
            "by_prompt_tokens": rows}, raw


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS)
    ap.add_argument("--prompt-tokens", nargs="+", type=int, default=[32, 512, 2048])
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--port", type=int, default=32000)
    ap.add_argument("--quick", action="store_true", help="2 repeats, 32/512-token prompts, fewer configs")
    args = ap.parse_args(argv)
    record = results_doc.Run.begin(argv, __file__)
    if args.quick:
        args.repeats, args.prompt_tokens = 2, [32, 512]
        args.configs = ["colocated", "messenger:shmem", "upstream:mooncake"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="bench-single-"))
    measured = [run_config(c, args, logs) for c in args.configs]
    results = [result for result, _ in measured]
    base = next((r for r in results if r["name"] == "colocated"), None)
    for r in results:
        for n, row in r["by_prompt_tokens"].items():
            if base is not None:
                ref = base["by_prompt_tokens"][n]
                row["tokens_per_s_vs_colocated"] = row["tokens_per_s"] / ref["tokens_per_s"]
                row["ttft_overhead_ms"] = row["ttft_ms"] - ref["ttft_ms"]
            if r["name"] != "colocated":
                row["upstream_scheme_writes"] = upstream_writes(args.model, n)
                row["upstream_scheme_writes_tp2_to_tp1"] = upstream_writes(args.model, n, 2, 1)
                row["messenger_writes_tp2_to_tp1"] = _messenger_writes(args.model, n, 2, 1)
    doc = {"model": args.model, "output_tokens": args.output_tokens, "repeats": args.repeats, "results": results}
    record.write(out / "single_request.json", doc, indent=2, raw_repeats=[r for _, raw in measured for r in raw],
                 notes=["ttft_ms, e2e_ms, tokens_per_s: medians over the repeats (raw_repeats: each repeat's, "
                        "every request its own prompt); ttft_min_ms: the fastest repeat",
                        "writes_per_request: the decoder's counters over the measured requests; upstream_scheme_*: "
                        "computed with the planner, not measured"])
    plot(doc, out / "single_request.png")
    print(f"[bench] wrote {out / 'single_request.json'} and single_request.png")
    return 0


def _messenger_writes(model: str, prompt_tokens: int, prefill_tp: int, decode_tp: int) -> int:
    spec = BUILTIN_MODELS[model]
    g = KVGeometry(spec.num_layers, spec.num_kv_heads, spec.resolved_head_dim, spec.resolved_head_dim, 16, 4)
    return ShardPlan.build(g, prefill_tp, decode_tp).total_writes(pages_for(prompt_tokens - 1, 16))


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5))
    names = [r["name"] for r in doc["results"]]
    sizes = list(doc["results"][0]["by_prompt_tokens"])
    width = 0.8 / len(sizes)
    for i, n in enumerate(sizes):
        xs = [j + i * width for j in range(len(names))]
        a.bar(xs, [r["by_prompt_tokens"][n]["ttft_ms"] for r in doc["results"]], width, label=f"{n}-token prompt")
        b.bar(xs, [r["by_prompt_tokens"][n]["tokens_per_s"] for r in doc["results"]], width,
              label=f"{n}-token prompt")
    for ax, title in ((a, "TTFT (ms, median)"), (b, f"tokens/s, {doc['output_tokens']}-token output")):
        ax.set_xticks([j + width * (len(sizes) - 1) / 2 for j in range(len(names))], names, rotation=20,
                      ha="right", fontsize=8)
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.suptitle(f"single request, {doc['model']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
