"""Speculative decoding across the boundary: acceptance and decode speed per user.

    python benchmarks/speculative.py --out DIR [--algorithm STANDALONE|EAGLE|NEXTN] [--prompts 8] [--output-tokens 64]

Four configurations, one after another on this machine, float32, chunked prefill 64, the
messenger's page size (16) everywhere: ``colocated_spec`` (one SGLang server with
speculation, one step, top-k 1, two draft tokens: STANDALONE, tiny-llama with the built-in
draft tiny-llama-draft; or EAGLE, tiny-llama-1l with its built-in head tiny-llama-1l-eagle; or
NEXTN, tiny-deepseek-v3 with its own MTP layer), ``messenger_spec`` (--role all, shmem, the same speculation: the
draft's KV crosses with the target's), ``messenger_spec_cold_draft`` (the same, the decoder
zeroing the draft's layers of what it received: a draft whose state did not cross) and
``messenger`` (--role all without speculation).
Requests are sequential (one user), streamed, each prompt new to every server; per request:
decode tokens/s = (output tokens - 1) / (last token's arrival - first token's), the
acceptance length (SGLang's spec_accept_length: tokens per verify step, 1 to 2 here) and the
output ids (every configuration must give the same). Writes DIR/speculative.json and
DIR/speculative.png (EAGLE: speculative-eagle.json/png; NEXTN: speculative-nextn.json/png). The STANDALONE draft is the
target's size (the target perturbed), the EAGLE head a one-layer target's size, so on CPU
speculation costs about what it saves: the figures measure what the messenger changes
(acceptance, per-step cost), not a speed-up.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from sglang_disagg.launch import LaunchConfig, Role, Stack
from sglang_disagg.launch.client import greedy
from sglang_disagg.models import get_spec

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import results_doc  # noqa: E402
from single_request import prompt_of  # noqa: E402
from sse import data_of  # noqa: E402

ONE_STEP = ("--speculative-num-steps", "1", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "2")
COMMON = ("--chunked-prefill-size", "64", "--dtype", "float32")
# algorithm -> (built-in draft, results file stem); the target is the draft spec's base.
# NEXTN: tiny-deepseek-v3's own MTP layer (no separate draft; its KV is one latent layer).
DRAFTS = {"STANDALONE": ("tiny-llama-draft", "speculative"), "EAGLE": ("tiny-llama-1l-eagle", "speculative-eagle"),
          "NEXTN": (None, "speculative-nextn")}
NEXTN_TARGET = "tiny-deepseek-v3"


def target_of(algorithm: str) -> str:
    draft = DRAFTS[algorithm][0]
    return NEXTN_TARGET if draft is None else get_spec(draft).base


def configs(algorithm: str) -> dict:
    draft = DRAFTS[algorithm][0]
    if draft is None:
        layers, spec = 1, ("--speculative-algorithm", algorithm) + ONE_STEP
    else:
        layers = get_spec(draft).num_layers
        spec = ("--speculative-algorithm", algorithm, "--speculative-draft-model-path", draft) + ONE_STEP
    return {
        "colocated_spec": (Role.COLOCATED, spec, ()),
        "messenger_spec": (Role.ALL, spec, ()),
        # What a decoder would see if the draft's KV did not cross: the draft's layers zeroed.
        "messenger_spec_cold_draft": (Role.ALL, spec, (("SGLANG_DISAGG_FAULT", f"zero_kv:layers=last:{layers}"),)),
        "messenger": (Role.ALL, (), ()),
    }


def stream(url: str, prompt: list[int], n: int) -> dict:
    body = json.dumps({"input_ids": prompt, "sampling_params": greedy(n), "stream": True}).encode()
    req = urllib.request.Request(f"{url}/generate", data=body, headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first = last = None
    ids: list[int] = []
    meta: dict = {}
    with urllib.request.urlopen(req, timeout=300) as r:
        for raw in r:
            chunk = data_of(raw)
            if chunk is None:  # a keep-alive comment, a blank line, [DONE]
                continue
            now = time.perf_counter()
            meta = chunk["meta_info"]
            got = chunk.get("output_ids") or []
            ids = list(got) if len(got) == meta["completion_tokens"] else ids + list(got)
            first = first if first is not None else now
            last = now
    assert len(ids) == n, f"{len(ids)} of {n} tokens"
    return {"ttft_ms": (first - t0) * 1e3, "decode_tok_s": (n - 1) / (last - first),
            "accept_length": meta.get("spec_accept_length"), "output_ids": ids}


def run(algorithm: str, name: str, prompts: list[list[int]], n: int, root: Path, port: int) -> list[dict]:
    role, spec, env = configs(algorithm)[name]
    cfg = LaunchConfig(role=role, model=target_of(algorithm), port=port, max_total_tokens=8192, page_size=16,
                       extra_args=COMMON + spec, env=env, log_dir=str(root / name))
    with Stack.for_config(cfg) as stack:
        stream(stack.url, prompt_of(40, 999), 4)  # warm the path
        return [stream(stack.url, p, n) for p in prompts]


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    names = [r["config"] for r in rows]
    a.bar(names, [r["decode_tok_s"] for r in rows], color=["#888", "#2a7", "#c74", "#27a"])
    a.set_ylabel("decode tokens/s per user (median)")
    b.bar(names[:3], [r["accept_length"] for r in rows[:3]], color=["#888", "#2a7", "#c74"])
    b.set_ylim(1, 2)
    b.set_ylabel("acceptance length (tokens per step)")
    for ax in (a, b):
        ax.tick_params(axis="x", labelsize=7, rotation=15)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--algorithm", choices=sorted(DRAFTS), default="STANDALONE")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--port", type=int, default=34000)
    args = ap.parse_args(argv)
    record = results_doc.Run.begin(argv, __file__)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = [prompt_of(n, v) for v, n in enumerate([24, 60, 130, 250, 24, 60, 130, 250][:args.prompts], 1)]
    t0 = record.started
    samples = {}
    with tempfile.TemporaryDirectory(prefix="spec-bench-") as tmp:
        for k, name in enumerate(configs(args.algorithm)):
            samples[name] = run(args.algorithm, name, prompts, args.output_tokens, Path(tmp), args.port + 20 * k)
            print(f"{name}: done", flush=True)
    reference = [s["output_ids"] for s in samples["colocated_spec"]]
    rows = []
    for name, got in samples.items():
        accept = [s["accept_length"] for s in got if s["accept_length"] is not None]
        rows.append({
            "config": name,
            "decode_tok_s": statistics.median(s["decode_tok_s"] for s in got),
            "ttft_ms": statistics.median(s["ttft_ms"] for s in got),
            "accept_length": statistics.mean(accept) if accept else None,
            "tokens_match_colocated_spec": [s["output_ids"] for s in got] == reference,
            "samples": [{k: v for k, v in s.items() if k != "output_ids"} for s in got],
        })
    base = next(r for r in rows if r["config"] == "colocated_spec")["decode_tok_s"]
    for r in rows:
        r["decode_vs_colocated_spec"] = r["decode_tok_s"] / base
    (draft, stem), target = DRAFTS[args.algorithm], target_of(args.algorithm)
    result = {"model": target, "draft": draft, "algorithm": args.algorithm,
              "speculation": list(configs(args.algorithm)["colocated_spec"][1]),
              "prompt_tokens": [len(p) for p in prompts], "output_tokens": args.output_tokens,
              "wall_s": round(time.time() - t0), "rows": rows}
    per_request = [{"config": r["config"], **x} for r in rows for x in r["samples"]]
    record.write(out / f"{stem}.json", result, indent=1,
                 raw_repeats=results_doc.group_repeats(per_request, ("config",),
                                                       ("ttft_ms", "decode_tok_s", "accept_length")),
                 notes=["one request per prompt, sequential (one user), each prompt new to every server: "
                        "decode_tok_s and ttft_ms are medians over the prompts, accept_length their mean; "
                        "raw_repeats (and each row's samples): every request's, in prompt order"])
    plot(rows, out / f"{stem}.png", f"{target} + {draft or 'its NEXTN layer'} ({args.algorithm}, 1 step, top-k 1), CPU")
    for r in rows:
        acc = f"{r['accept_length']:.3f}" if r["accept_length"] else "-"
        print(f"{r['config']:26s} decode {r['decode_tok_s']:7.1f} tok/s ({r['decode_vs_colocated_spec']:.2f}x) "
              f"accept {acc}  ttft {r['ttft_ms']:.0f} ms  tokens match: {r['tokens_match_colocated_spec']}")
    return 0 if all(r["tokens_match_colocated_spec"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
