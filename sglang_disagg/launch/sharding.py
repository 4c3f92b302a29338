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
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sglang_disagg.launch.config import LaunchConfig, Mode, Role

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


def why_not(shape: Shape, tp: int, cpus: int | None) -> str:
    """Why one server cannot run the model with this TP size ("" if it can)."""
    if tp < 1:
        return "TP must be >= 1"
    if shape.heads % tp:
        return f"{shape.heads} attention heads do not divide by {tp}"
    if not shape.replicated_kv:
        from sglang_disagg.messenger.planner import rank_heads  # SGLang's KV split/replication rule

        try:
            rank_heads(shape.kv_heads, tp, 0)
        except ValueError as e:
            return str(e)
    if shape.intermediate and shape.intermediate % tp:
        return f"the MLP's intermediate size {shape.intermediate} does not divide by {tp}"
    if cpus is not None and tp > cpus:
        return f"{tp} ranks need {tp} cores and this machine has {cpus}"
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


def check(model: str, cfg: dict[str, Any], tps: dict[str, int], cpus: int | None, messenger_pair: bool) -> None:
    """Raise ValueError when a server of `tps` ({"--prefill-tp": 2, ...}) cannot shard the
    model, or (messenger_pair, with both sizes given) the planner cannot pair them."""
    try:
        shape = Shape.from_config(cfg)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return  # not a decoder-only config we can read: SGLang decides
    allowed = [t for t in range(1, MAX_TP + 1) if not why_not(shape, t, None)]
    fit = [t for t in allowed if cpus is None or t <= cpus]
    sizes = ", ".join(map(str, allowed)) + ("" if fit == allowed else
                                            f" (with this machine's {cpus} cores: {', '.join(map(str, fit))})")
    for flag, tp in tps.items():
        reason = why_not(shape, tp, cpus)
        if reason:
            raise ValueError(f"{flag} {tp} cannot shard {model} ({shape.describe()}): {reason}; "
                             f"TP sizes that work: {sizes}")
    if messenger_pair and len(tps) == 2:
        p, d = tps.values()
        reason = pair_problem(shape, p, d)
        if reason:
            raise ValueError(f"prefill TP {p} -> decode TP {d} cannot carry {model}'s KV "
                             f"({shape.describe()}): {reason}")


def launch_tps(cfg: LaunchConfig) -> dict[str, int]:
    """The TP sizes of the servers a launch configuration starts, by flag."""
    return {Role.ALL: {"--prefill-tp": cfg.prefill_tp, "--decode-tp": cfg.decode_tp},
            Role.PREFILL: {"--prefill-tp": cfg.prefill_tp}, Role.DECODE: {"--decode-tp": cfg.decode_tp},
            Role.COLOCATED: {"--prefill-tp": cfg.prefill_tp}, Role.ROUTER: {}}[cfg.role]


def this_machines_cores() -> int:
    return len(os.sched_getaffinity(0))


def check_config(cfg: LaunchConfig, model_cfg: dict[str, Any], here: bool) -> None:
    """Refuse TP sizes the model (its config.json fields) cannot be sharded by; `here`: the
    servers run on this machine, so on CPU its cores count too."""
    cpus = this_machines_cores() if here and cfg.device == "cpu" else None
    check(cfg.served_model_name, model_cfg, launch_tps(cfg), cpus, cfg.mode is Mode.MESSENGER)


def check_launch(cfg: LaunchConfig, model_path: Path) -> None:
    """Refuse TP sizes the model at `model_path` cannot be sharded by, before any server starts."""
    try:
        model_cfg = json.loads((model_path / "config.json").read_text())
    except (OSError, ValueError):
        return  # resolve_model_path checked it exists; SGLang reports a config it cannot read
    check_config(cfg, model_cfg, here=True)
