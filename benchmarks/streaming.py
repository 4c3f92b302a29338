"""The transfer tail: from the end of the prefill forward to decode-ready, streaming vs not.

    python benchmarks/streaming.py --out DIR [--quick] [--model small-llama]
        [--prompt-tokens 512 2048 4096] [--repeats 3]

Configurations, one at a time on the same cores: colocated (the TTFT baseline), the
messenger streaming each layer's writes as the prefill forward passes it (``streaming``),
the messenger writing a chunk's pages after its forward (``after_forward``), and
upstream SGLang PD over Mooncake (``upstream``). Every request has its own prompt (no
radix-cache hit anywhere). Writes DIR/streaming.json, one row per (config, prompt
length): config, prompt_tokens, tail_ms, ttft_ms, colocated_ttft_ms (a colocated server
on all cores), colocated_prefill_cores_ttft_ms (one held to the prefill server's share of
the cores: on one machine the prefill computes on half of them), and for the
messenger one_layer_ms (the time to write one layer of the request: its last layer,
from posting to completion); plus DIR/streaming.png. Then a 5-turn chat through the
messenger with and without decode-side prefix reuse: bytes transferred per turn.

How the tail is measured: messenger rows from the two messengers' own timestamps (one
clock, CLOCK_MONOTONIC: the prefill's end of the last chunk's forward, the decoder's
hand-off of the request to its batch). Upstream has no such hook: its row is SGLang's
own ``sglang:kv_transfer_latency_ms`` of the prefill server (end of the last chunk's
forward until the prefill saw the transfer done), which stops before the decoder has
polled and built its batch, so it understates upstream's tail. A negative tail is real:
the last layer's KV is written at its o_proj, so streamed writes can land while the
forward still runs that layer's MLP, before the forward returns.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from sglang_disagg.launch import LaunchConfig, Mode, Role, Stack
from sglang_disagg.launch.client import generate_ids
from sglang_disagg.launch.commands import server_cores

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import results_doc  # noqa: E402
from single_request import prompt_of  # noqa: E402


def _configs(model: str, port: int, logs: Path) -> dict[str, LaunchConfig]:
    base = dict(model=model, port=port, max_total_tokens=16384)
    messenger = LaunchConfig(role=Role.ALL, backend="shmem", **base)
    # The prefill server of a one-machine stack computes on its share of the cores only;
    # a colocated server held to that share is the baseline that isolates disaggregation.
    prefill_threads = str(len(server_cores(messenger, Role.PREFILL)))
    return {
        "colocated": LaunchConfig(role=Role.COLOCATED, **base, log_dir=str(logs / "colocated")),
        "colocated_prefill_cores": LaunchConfig(role=Role.COLOCATED, **base, env=(("OMP_NUM_THREADS", prefill_threads),),
                                                log_dir=str(logs / "colocated_prefill_cores")),
        "streaming": dataclasses.replace(messenger, log_dir=str(logs / "streaming")),
        "after_forward": dataclasses.replace(messenger, stream=False, log_dir=str(logs / "after_forward")),
        "upstream": LaunchConfig(role=Role.ALL, mode=Mode.UPSTREAM, backend="mooncake", **base,
                                 extra_args=("--enable-metrics",), log_dir=str(logs / "upstream")),
    }


def _recent(stack: Stack, role: str, rid: str, key: str = "rid", timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for r in (stack.messenger_stats(role) or {}).get("recent", []):
            if r.get(key) == rid:
                return r
        time.sleep(0.05)
    raise RuntimeError(f"{role} messenger never published request {rid}")


def _upstream_transfer_ms(stack: Stack) -> tuple[float, float]:
    text = urllib.request.urlopen(stack.servers[0].url + "/metrics", timeout=10).read().decode()
    values = {}
    for name in ("sum", "count"):
        m = re.search(rf"^sglang:kv_transfer_latency_ms_{name}\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M)
        values[name] = float(m.group(1)) if m else 0.0
    return values["sum"], values["count"]


def measure(name: str, stack: Stack, n: int, repeats: int) -> tuple[dict, dict]:
    """The row (medians over the repeats) and each repeat's raw values."""
    generate_ids(stack.url, prompt_of(n, 0), 1)  # warm-up
    ttft, tail, layer = [], [], []
    for k in range(repeats):
        rid = f"bench-{name}-{n}-{k}"
        before = _upstream_transfer_ms(stack) if name == "upstream" else None
        t0 = time.perf_counter()
        generate_ids(stack.url, prompt_of(n, 100 + k), 1, rid=rid)
        ttft.append(1000 * (time.perf_counter() - t0))
        if name == "upstream":
            time.sleep(0.5)
            after = _upstream_transfer_ms(stack)
            if after[1] > before[1]:
                tail.append((after[0] - before[0]) / (after[1] - before[1]))
        elif not name.startswith("colocated"):
            dec = _recent(stack, "decode", rid)
            pre = _recent(stack, "prefill", rid)
            tail.append(1000 * (dec["handoff"] - pre["forward_end"]))
            if "last_layer_written" in pre:
                layer.append(1000 * (pre["last_layer_written"] - pre["last_layer_posted"]))
    row = {"config": name, "prompt_tokens": n, "ttft_ms": statistics.median(ttft)}
    if tail:
        row["tail_ms"] = statistics.median(tail)
    if layer:
        row["one_layer_ms"] = statistics.median(layer)
    # A repeat without a tail (upstream's histogram did not move) has none: the lists may be shorter.
    return row, {"config": name, "prompt_tokens": n, "ttft_ms": ttft, "tail_ms": tail, "one_layer_ms": layer}


def chat_bytes(cfg: LaunchConfig, page_bytes_per_write: int) -> list[int]:
    """Bytes the decoder received per turn of the 5-turn chat of the tests."""
    sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
    from e2e.conftest import conversation

    stack = Stack.for_config(cfg)
    stack.start()
    seen: list[int] = []

    def before_turn(k: int, prompt: list[int]) -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            stats = stack.messenger_stats("decode") or {}
            if stats.get("requests_carried", 0) >= k + 1:  # the readiness probe, then each turn
                seen.append(stats["writes_received"])
                return
            time.sleep(0.05)
        raise RuntimeError("decoder counters did not move")

    try:
        conversation(stack.url, cfg.model, on_turn=before_turn)
        before_turn(len(seen), [])
    finally:
        stack.stop()
    return [(b - a) * page_bytes_per_write for a, b in zip(seen, seen[1:])]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--model", default="small-llama")
    ap.add_argument("--prompt-tokens", nargs="+", type=int, default=[512, 2048, 4096])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--port", type=int, default=32200)
    ap.add_argument("--quick", action="store_true", help="tiny-llama, 512/2048-token prompts, 2 repeats")
    args = ap.parse_args(argv)
    record = results_doc.Run.begin(argv, __file__)
    if args.quick:
        args.model, args.prompt_tokens, args.repeats = "tiny-llama", [512, 2048], 2
    args.out.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="bench-streaming-"))
    configs = _configs(args.model, args.port, logs)
    rows, raw = [], []
    for name, cfg in configs.items():
        stack = Stack.for_config(cfg)
        print(f"[bench] starting {name} ...", flush=True)
        stack.start()
        try:
            for n in args.prompt_tokens:
                row, values = measure(name, stack, n, args.repeats)
                rows.append(row)
                raw.append(values)
                print(f"[bench] {name} {n} tokens: {rows[-1]}", flush=True)
        finally:
            stack.stop()
    for base in ("colocated", "colocated_prefill_cores"):
        ttft = {r["prompt_tokens"]: r["ttft_ms"] for r in rows if r["config"] == base}
        for r in rows:
            r[f"{base}_ttft_ms"] = ttft.get(r["prompt_tokens"])
    rows = [r for r in rows if not r["config"].startswith("colocated")]
    from sglang_disagg.models import resolve_model_path

    model_cfg = json.loads((resolve_model_path(args.model) / "config.json").read_text())
    if "kv_lora_rank" in model_cfg:  # MLA: one write is a page of one layer's latent (one "head", no V)
        write_bytes = 16 * (model_cfg["kv_lora_rank"] + model_cfg["qk_rope_head_dim"]) * 4
    else:
        head_dim = model_cfg.get("head_dim") or model_cfg["hidden_size"] // model_cfg["num_attention_heads"]
        write_bytes = 16 * model_cfg["num_key_value_heads"] * head_dim * 4  # one page of K or V, float32
    streaming = configs["streaming"]
    turns = {"with_reuse": chat_bytes(dataclasses.replace(streaming, log_dir=str(logs / "chat-reuse")), write_bytes),
             "without_reuse": chat_bytes(dataclasses.replace(streaming, reuse_prefix=False,
                                                             log_dir=str(logs / "chat-noreuse")), write_bytes)}
    print(f"[bench] chat bytes per turn: {turns}", flush=True)
    doc = {"model": args.model, "repeats": args.repeats, "rows": rows, "chat_bytes_per_turn": turns}
    record.write(args.out / "streaming.json", doc, indent=2, raw_repeats=raw, notes=[
        "rows: medians over the repeats, each repeat its own prompt; raw_repeats: each repeat's values, "
        "the colocated baselines' too (their medians are the rows' colocated_*_ttft_ms)",
        "upstream tail_ms: SGLang's kv_transfer_latency_ms (ends before the decoder builds its batch: it "
        "understates upstream's tail); a repeat whose histogram did not move has no tail value"])
    plot(doc, args.out / "streaming.png")
    print(f"[bench] wrote {args.out / 'streaming.json'} and streaming.png")
    return 0


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["rows"]
    sizes = sorted({r["prompt_tokens"] for r in rows})
    names = list(dict.fromkeys(r["config"] for r in rows))
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        by = {r["prompt_tokens"]: r for r in rows if r["config"] == name}
        xs = [j + i * width for j in range(len(sizes))]
        a.bar(xs, [by[n].get("tail_ms", 0) for n in sizes], width, label=name)
        b.bar(xs, [by[n]["ttft_ms"] - (by[n]["colocated_prefill_cores_ttft_ms"] or 0) for n in sizes], width,
              label=name)
    for ax, title in ((a, "prefill forward end -> decode-ready (ms)"),
                      (b, "TTFT - TTFT of colocated on the prefill's cores (ms)")):
        ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(sizes))], [f"{n} tok" for n in sizes])
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=8)
    turns = doc["chat_bytes_per_turn"]
    for i, (name, vals) in enumerate(turns.items()):
        c.bar([k + i * 0.4 for k in range(len(vals))], [v / 1024 for v in vals], 0.4, label=name)
    c.set_title("KV received per chat turn (KiB)", fontsize=9)
    c.set_xlabel("turn")
    c.legend(fontsize=8)
    fig.suptitle(f"layer streaming, {doc['model']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
