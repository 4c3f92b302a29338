"""Whether a model can be sharded by the TP sizes asked for, decided from its config.json
before any server starts (`check` is pure: the config and the machine's core count come in;
`check_config` takes a launch configuration, with this machine's cores only for servers meant
to run here; `check_launch` reads the config.json of a model directory for the launcher).

SGLang shards attention by heads (QKVParallelLinear: query heads divide by TP; KV heads
divide by TP, or TP by KV heads, which then replicates them) and the MLP by its
intermediate size; the messenger's planner must map every prefill rank's KV heads onto the
decode ranks'; and on CPU every rank of a server needs a core. A size that fails any of
these would die minutes into start-up with a shape error from deep inside SGLang, or not
at all and produce wrong KV: refuse it now, naming the model's head counts and the sizes
that would work.

Data parallelism (parallel.py): with attention DP the heads are split over an attention-DP
group's tp/attn_dp ranks, not the TP group's (the MLP stays TP over all of them), and the
messenger pairs a prefill group with a decode group, so the pair check takes those sizes;
with replica DP a replica is a TP group as any other, and its tp * dp ranks need cores.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sglang_disagg.launch.config import LaunchConfig, Mode, Role
from sglang_disagg.launch.parallel import Parallel

MAX_TP = 16


@dataclass(frozen=True, slots=True)
class Shape:
    heads: int
    kv_heads: int
    intermediate: int
    head_dim: int
    replicated_kv: bool  # MLA: every rank holds the whole latent KV

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> Shape:
        cfg = cfg.get("text_config", cfg)
        heads = int(cfg["num_attention_heads"])
        kv = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
        return cls(heads, kv, int(cfg.get("intermediate_size") or 0), head_dim, "kv_lora_rank" in cfg)

    def describe(self) -> str:
        mlp = f", MLP intermediate size {self.intermediate}" if self.intermediate else ""
        return f"{self.heads} attention heads / {self.kv_heads} KV heads{mlp}"


def why_not(shape: Shape, tp: int | Parallel, cpus: int | None) -> str:
    """Why one server cannot run the model with this TP size, or parallel shape ("" if it can)."""
    p = tp if isinstance(tp, Parallel) else Parallel(tp)
    if p.tp < 1 or p.attn_dp < 1 or p.tp % p.attn_dp:
        return "TP must be >= 1 and divide into the attention-DP groups"
    group = p.attn_tp  # the ranks attention splits the heads over
    where = "" if p.attn_dp == 1 else (f" (with attention DP the heads are split over each group's tp/attn-dp = "
                                       f"{p.tp}/{p.attn_dp} = {group} ranks)")
    if shape.heads % group:
        return f"{shape.heads} attention heads do not divide by {group}{where}"
    if not shape.replicated_kv:
        from sglang_disagg.messenger.planner import rank_heads  # SGLang's KV split/replication rule

        try:
            rank_heads(shape.kv_heads, group, 0)
        except ValueError as e:
            return f"{e}{where}"
    if shape.intermediate and shape.intermediate % p.tp:  # the MLP stays TP over every rank
        return f"the MLP's intermediate size {shape.intermediate} does not divide by {p.tp}"
    if cpus is not None and p.processes > cpus:
        replicas = f" ({p.dp} replicas of TP {p.tp})" if p.dp > 1 else ""
        return f"{p.processes} ranks{replicas} need {p.processes} cores and this machine has {cpus}"
    return ""


def pair_problem(shape: Shape, prefill_tp: int, decode_tp: int) -> str:
    """Why the planner cannot map prefill TP ranks onto decode TP ranks ("" if it can)."""
    from sglang_disagg.messenger.planner import KVGeometry, ShardPlan

    geometry = KVGeometry(num_layers=1, kv_heads=shape.kv_heads, head_dim=shape.head_dim,
                          v_head_dim=shape.head_dim, page_size=16, dtype_bytes=4, replicated=shape.replicated_kv)
    try:
        ShardPlan.build(geometry, prefill_tp, decode_tp)
    except ValueError as e:
        return str(e)
    return ""


def _sizes(shape: Shape, p: Parallel, cpus: int | None) -> str:
    """The TP sizes that shard the model with `p`'s data parallelism ("1, 3 (with this machine's ...)")."""
    allowed = [t for t in range(p.attn_dp, MAX_TP + 1, p.attn_dp)
               if not why_not(shape, Parallel(t, p.attn_dp, p.dp), None)]
    fit = [t for t in allowed if cpus is None or t * p.dp <= cpus]
    return ", ".join(map(str, allowed)) + ("" if fit == allowed else
                                           f" (with this machine's {cpus} cores: {', '.join(map(str, fit)) or 'none'})")


def _kv_group(p: Parallel, label: str) -> str:
    """What one side of a messenger pair splits a KV pool over, said for an error."""
    if p.attn_dp > 1:
        return f"attention TP {p.attn_tp} ({label}: each attention-DP group's KV pool is split over tp/attn-dp ranks)"
    return f"TP {p.tp}" + (f" ({label}: each replica's KV pool is split over its TP ranks)" if p.dp > 1 else "")


def check(model: str, cfg: dict[str, Any], tps: dict[str, int | Parallel], cpus: int | None,
          messenger_pair: bool) -> None:
    """Raise ValueError when a server of `tps` ({"--prefill-tp": 2, ...}, a size or a
    Parallel shape by its TP flag) cannot shard the model, or (messenger_pair, with both
    given) the planner cannot pair them: prefill and decode attention-TP groups (parallel.py)."""
    try:
        shape = Shape.from_config(cfg)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return  # not a decoder-only config we can read: SGLang decides
    servers = {flag: tp if isinstance(tp, Parallel) else Parallel(tp) for flag, tp in tps.items()}
    for flag, p in servers.items():
        reason = why_not(shape, p, cpus)
        if reason:
            with_dp = {p.attn_dp > 1: f" with attn-dp {p.attn_dp}", p.dp > 1: f" with dp {p.dp}"}.get(True, "")
            raise ValueError(f"{p.label(flag)} cannot shard {model} ({shape.describe()}): {reason}; "
                             f"TP sizes that work{with_dp}: {_sizes(shape, p, cpus)}")
    if messenger_pair and len(servers) == 2:
        (pf, p), (df, d) = servers.items()
        reason = pair_problem(shape, p.attn_tp, d.attn_tp)
        if reason:
            raise ValueError(f"prefill {_kv_group(p, p.label(pf))} -> decode {_kv_group(d, d.label(df))} cannot "
                             f"carry {model}'s KV ({shape.describe()}): {reason}")


def launch_parallel(cfg: LaunchConfig) -> dict[str, Parallel]:
    """The parallel shapes of the servers a launch configuration starts, by TP flag."""
    return {("--decode-tp" if r is Role.DECODE else "--prefill-tp"): cfg.parallel(r) for r in cfg.server_roles}


def this_machines_cores() -> int:
    return len(os.sched_getaffinity(0))


def check_config(cfg: LaunchConfig, model_cfg: dict[str, Any], here: bool) -> None:
    """Refuse TP sizes the model (its config.json fields) cannot be sharded by; `here`: the
    servers run on this machine, so on CPU its cores count too."""
    cpus = this_machines_cores() if here and cfg.device == "cpu" else None
    check(cfg.served_model_name, model_cfg, launch_parallel(cfg), cpus, cfg.mode is Mode.MESSENGER)


def check_launch(cfg: LaunchConfig, model_path: Path) -> None:
    """Refuse TP sizes the model at `model_path` cannot be sharded by, before any server starts."""
    try:
        model_cfg = json.loads((model_path / "config.json").read_text())
    except (OSError, ValueError):
        return  # resolve_model_path checked it exists; SGLang reports a config it cannot read
    check_config(cfg, model_cfg, here=True)
