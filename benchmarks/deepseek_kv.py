"""DeepSeek's latent KV across TP: bytes per token and writes per request, ours against upstream PD.

    python benchmarks/deepseek_kv.py --out DIR [--model tiny-deepseek-v3] [--prompt-tokens 128 512 1024]

For each TP pair (prefill -> decode) 2 -> 1 and 1 -> 2, two stacks on this machine: the
messenger (--role all, shmem) and SGLang's own PD (--mode upstream, Mooncake, with
--enable-metrics). Each stack serves the same distinct prompts (no radix-cache hit), greedy,
4 output tokens; every configuration must give the same tokens. Per configuration:
- messenger: KV bytes and writes the decoder counted (sglang_disagg_kv_bytes/writes_total,
  its metrics port) and what the prefill server sent, per request and per prompt token;
  which prefill ranks the per-request draw picked (the prefill's requests_by_source);
- upstream: SGLang's own account of the bytes each transfer moved (the prefill server's
  sglang:kv_transfer_total_mb histogram, sum over count: MB per request, which SGLang
  multiplies by its MLA replica factor); SGLang does not expose a write count.
The physical floor: one copy of the prompt's latent per destination rank = layers x
(kv_lora_rank + rope dims) x 4 bytes per token (float32). Writes DIR/deepseek_kv.json and
DIR/deepseek_kv.png.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from sglang_disagg.launch import LaunchConfig, Mode, Role, Stack
from sglang_disagg.launch.client import generate_ids
from sglang_disagg.models import resolve_model_path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import results_doc  # noqa: E402
from single_request import prompt_of  # noqa: E402

PAIRS = ((2, 1), (1, 2))
UPSTREAM_NOTE = (
    "upstream rows are SGLang's own accounting (sglang:kv_transfer_total_mb, every prefill rank's "
    "reports summed). Read from its code (disaggregation/common/conn.py, _resolve_rank_mapping): with "
    "MLA and prefill TP > decode TP a decode rank pulls from one prefill rank, always the first of its "
    "group (no draw), and sends dummy requests to the others; with prefill TP < decode TP each decode "
    "rank pulls its full copy from the one prefill rank. Its 2 -> 1 report of two transfers per request "
    "at twice the floor therefore counts the dummy rank's report too; upstream exposes no write count.")
OUT_TOKENS = 4


def _metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([0-9.e+-]+)$", text, re.M))


def run(name: str, cfg: LaunchConfig, prompts: list[list[int]]) -> dict:
    with Stack.for_config(cfg) as stack:
        generate_ids(stack.url, prompt_of(40, 999), 1)  # warm the path (its transfer is not counted)
        time.sleep(1.0)
        messenger = cfg.mode is Mode.MESSENGER
        if messenger:
            dec = f"http://127.0.0.1:{cfg.ports.decode_metrics}"
            pre = f"http://127.0.0.1:{cfg.ports.prefill_metrics}"
            before = {k: _metric(u, f"sglang_disagg_kv_{k}_total") for k, u in
                      (("bytes", dec), ("writes", dec))}
            sent_before = _metric(pre, "sglang_disagg_kv_bytes_total")
            sources_before = dict((stack.messenger_stats("prefill") or {}).get("requests_by_source", {}))
        else:
            pre = stack.servers[0].url
            mb_before = (_metric(pre, "sglang:kv_transfer_total_mb_sum"), _metric(pre, "sglang:kv_transfer_total_mb_count"))
        outputs = [generate_ids(stack.url, p, OUT_TOKENS) for p in prompts]
        time.sleep(1.0)  # counters published
        row = {"config": name, "prefill_tp": cfg.prefill_tp, "decode_tp": cfg.decode_tp, "outputs": outputs}
        if messenger:
            row["bytes_received"] = _metric(dec, "sglang_disagg_kv_bytes_total") - before["bytes"]
            row["writes_received"] = _metric(dec, "sglang_disagg_kv_writes_total") - before["writes"]
            row["bytes_sent"] = _metric(pre, "sglang_disagg_kv_bytes_total") - sent_before
            after = (stack.messenger_stats("prefill") or {}).get("requests_by_source", {})
            row["requests_by_source"] = {k: v - sources_before.get(k, 0) for k, v in after.items()}
        else:
            mb_sum = _metric(pre, "sglang:kv_transfer_total_mb_sum") - mb_before[0]
            count = _metric(pre, "sglang:kv_transfer_total_mb_count") - mb_before[1]
            row["bytes_reported"] = mb_sum * 1024 * 1024
            row["transfers_reported"] = count
        return row


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--model", default="tiny-deepseek-v3")
    ap.add_argument("--prompt-tokens", nargs="+", type=int, default=[128, 512, 1024])
    ap.add_argument("--port", type=int, default=34400)
    args = ap.parse_args(argv)
    record = results_doc.Run.begin(argv, __file__)
    args.out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((resolve_model_path(args.model) / "config.json").read_text())
    layers = cfg["num_hidden_layers"]
    floor = layers * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * 4  # bytes per token per destination rank
    prompts = [prompt_of(n, 300 + i) for i, n in enumerate(args.prompt_tokens)]
    carried_tokens = sum(len(p) - 1 for p in prompts)  # the decoder computes each prompt's last token
    pages = sum(-(-(len(p) - 1) // 16) for p in prompts)
    logs = Path(tempfile.mkdtemp(prefix="bench-deepseek-kv-"))
    rows, t0 = [], time.time()
    for k, (ptp, dtp) in enumerate(PAIRS):
        base = dict(role=Role.ALL, model=args.model, max_total_tokens=8192, prefill_tp=ptp, decode_tp=dtp,
                    extra_args=("--dtype", "float32"))
        for j, (name, extra) in enumerate((("messenger", dict(backend="shmem")),
                                           ("upstream", dict(mode=Mode.UPSTREAM, backend="mooncake",
                                                             extra_args=("--dtype", "float32", "--enable-metrics"))))):
            kw = base | extra
            c = LaunchConfig(port=args.port + 40 * k + 20 * j, log_dir=str(logs / f"{name}-{ptp}{dtp}"), **kw)
            rows.append(run(name, c, prompts))
            print(f"[bench] {name} {ptp}->{dtp}: { {x: y for x, y in rows[-1].items() if x != 'outputs'} }", flush=True)
    same = all(r["outputs"] == rows[0]["outputs"] for r in rows)
    for r in rows:
        n = len(prompts)
        moved = r.get("bytes_received", r.get("bytes_reported", 0.0))
        r["bytes_per_request"] = moved / n
        r["bytes_per_token"] = moved / carried_tokens
        r["vs_floor"] = r["bytes_per_token"] / (floor * r["decode_tp"])
        if "writes_received" in r:
            r["writes_per_request"] = r["writes_received"] / n
            r["writes_expected"] = pages * layers * r["decode_tp"]  # pages x layers x destination ranks
        r.pop("outputs")
    doc = {"model": args.model, "layers": layers, "latent_dims": cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"],
           "floor_bytes_per_token_per_decode_rank": floor, "prompt_tokens": [len(p) for p in prompts],
           "carried_tokens": carried_tokens, "pages": pages, "tokens_identical_across_configs": same,
           "wall_s": round(time.time() - t0), "rows": rows, "note": UPSTREAM_NOTE}
    record.write(args.out / "deepseek_kv.json", doc, indent=1, notes=[
        "each row is one stack serving every prompt once (no repeats): bytes and writes are its counters' "
        "deltas over those prompts, per request and per carried prompt token; how the upstream rows' "
        "figures are read: \"note\""])
    plot(doc, args.out / "deepseek_kv.png")
    for r in rows:
        w = f"writes/request {r['writes_per_request']:.1f} (planned {r['writes_expected'] / len(prompts):.1f})" \
            if "writes_per_request" in r else "writes/request not exposed"
        print(f"{r['config']:10s} {r['prefill_tp']}->{r['decode_tp']}: {r['bytes_per_token']:.0f} B/token "
              f"({r['vs_floor']:.2f}x floor), {w}")
    print(f"tokens identical across configurations: {same}")
    return 0 if same else 1


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["rows"]
    labels = [f"{r['config']}\n{r['prefill_tp']}->{r['decode_tp']}" for r in rows]
    fig, ax = plt.subplots(figsize=(7, 3.8))
    ax.bar(labels, [r["bytes_per_token"] for r in rows], color=["#2a7" if r["config"] == "messenger" else "#888"
                                                               for r in rows])
    for i, r in enumerate(rows):
        ax.hlines(doc["floor_bytes_per_token_per_decode_rank"] * r["decode_tp"], i - 0.4, i + 0.4, colors="k",
                  linestyles="dashed")
    ax.set_ylabel("KV bytes moved per prompt token")
    ax.set_title(f"{doc['model']}: latent KV across TP (dashed: one copy per decode rank)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
