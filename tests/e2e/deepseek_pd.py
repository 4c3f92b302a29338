"""What the MLA messenger tests share (test_deepseek_messenger.py, test_deepseek_faults.py,
and the colocated reference of test_deepseek_colocated.py): the model, its draw prompts, and
the one colocated TP 1 tiny-deepseek-v3 server's answers, computed once per session on the
stack pool's DeepSeek stack (the colocated module's first test reuses that very stack)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from sglang_disagg.launch import Role
from sglang_disagg.launch.client import greedy, post_json
from sglang_disagg.models import get_spec
from sglang_disagg.testsupport import DUMP_ENV

from .conftest import OUTPUT_TOKENS, StackSpec, prompts_for, structured
from .faultlib import scrape, value

MODEL = "tiny-deepseek-v3"
PAGE = 16  # the messenger's default page size
LAYERS = get_spec(MODEL).num_layers  # the target's; NEXTN is not loaded without speculation
MTP = ("--speculative-algorithm", "NEXTN", "--speculative-num-steps", "1", "--speculative-eagle-topk", "1",
       "--speculative-num-draft-tokens", "2")
STATS = ("spec_verify_ct", "spec_correct_drafts_histogram", "completion_tokens")


def draw_prompts(n: int = 12) -> list[list[int]]:
    """Distinct one-chunk prompts of 20 tokens with distinct first tokens: no two share a
    page, so no prefill forward ever reads another request's (corrupted) latent."""
    rng = random.Random(27)
    firsts = rng.sample(range(10, 4000), n)
    return [[f] + [rng.randrange(10, 4000) for _ in range(19)] for f in firsts]


def run_prompts(url: str, prompts, rid: str | None = None, stats: bool = False) -> list:
    """Greedy outputs, one request at a time; `rid` names each request kvdump-RID-i (latent
    dumps); `stats`: (tokens, the speculative counters) pairs."""
    out = []
    for i, p in enumerate(prompts):
        extra = {"rid": f"kvdump-{rid}-{i}"} if rid else {}
        r = post_json(f"{url}/generate", {"input_ids": p, "sampling_params": greedy(OUTPUT_TOKENS), **extra})
        tokens = list(r["output_ids"])
        out.append((tokens, {k: r["meta_info"].get(k) for k in STATS}) if stats else tokens)
    return out


def kv_writes(stack, role: str = "decode") -> float:
    """The writes a server of `stack` counted (posted, on prefill; arrived, on decode)."""
    return value(scrape("127.0.0.1", getattr(stack.cfg.ports, f"{role}_metrics")), "sglang_disagg_kv_writes_total")


@dataclass(frozen=True)
class Reference:
    root: Path                  # where the MLA tests' stacks keep their logs
    dumps: Path                 # latent dumps (DUMP_ENV): the reference's are kvdump-col-i.pt
    spec: StackSpec             # the colocated stack it came from (in the pool)
    prompts: list[list[int]]    # the suite's prompts
    outputs: list[list[int]]    # ... their greedy outputs
    draws: list[list[int]]      # draw_prompts()'s outputs
    json: dict                  # the JSON-schema constrained answer on the longest prompt


def colocated_reference(stacks, root: Path) -> Reference:
    dumps = root / "dumps"
    dumps.mkdir()
    spec = StackSpec(role=Role.COLOCATED, model=MODEL, env=((DUMP_ENV, str(dumps)),))
    stack = stacks.get(spec)
    prompts = prompts_for(MODEL)
    return Reference(root, dumps, spec, prompts, run_prompts(stack.url, prompts, rid="col"),
                     run_prompts(stack.url, draw_prompts()), structured(stack.url, prompts[-1]))
