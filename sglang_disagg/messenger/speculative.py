"""Which speculative-decoding configurations the messenger carries across the boundary.

A speculative decoder needs, besides the target's KV, the draft model's KV for the prompt:
without it the draft starts cold (acceptance falls) or reads whatever its pool held. The
messenger carries it for a standalone draft model (STANDALONE) and an EAGLE head (EAGLE):
the prefill server runs the draft over the prompt too (SGLang's draft extend, which reads at
each position the token after it, so the order carries the prompt's last token:
``PrefillOrder.last_token``; an EAGLE head reads the target's hidden states of that same
forward), and the draft pool's layers are registered after the target's, so its pages
travel with the same plan, tag and write count. No hidden state crosses: the decoder runs
the last prompt token itself, target and draft, as a colocated server's prefill would, and
that token's hidden state (the only one its draft still reads) comes from its own forward.

DeepSeek's NEXTN (MTP) is carried the same way: SGLang runs it as EAGLE with the target's
own checkpoint as the draft (its layer ``model.layers.{num_hidden_layers}``); its KV is a
one-layer MLA latent pool, registered after the target's layers. First contact names it
NEXTN. Anything else (EAGLE3, n-gram, DFLASH, ...: none run or tested here) is refused at
start-up rather than served with a cold or stale draft. Two places ask, with the same answer: the launcher,
before it starts anything (``LaunchConfig``), and every messenger server when its target
model is loaded (``hooks.model_loaded``), for servers started some other way. Colocated
servers (``--role colocated``) are not the messenger's business and run what SGLang runs.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Flags that turn speculative decoding on in SGLang's server arguments.
SPEC_FLAGS = ("--speculative-algorithm", "--speculative-draft-model-path")
# Algorithms the messenger moves the draft's state for. NEXTN (DeepSeek's MTP layer) is
# EAGLE inside SGLang (it rewrites the name): a draft layer over the target's hidden state
# with the target's embedding and head, its KV a one-layer latent pool.
CARRIED = frozenset({"EAGLE", "STANDALONE", "NEXTN"})


class UnsupportedSpeculation(ValueError):
    pass


def _refusal(algorithm: str) -> str:
    carried = ", ".join(sorted(CARRIED)) or "none yet"
    return (f"speculative decoding ({algorithm}) is not carried by the messenger: it transfers the "
            f"target model's KV only, so the decoder's draft would start without the prompt's draft "
            f"KV (cold, or reading stale pages). Algorithms it carries: {carried}. Run speculative "
            f"decoding with --role colocated, or use --mode upstream")


def check_argv(argv: Sequence[str]) -> None:
    """Refuse SGLang arguments that enable a speculative algorithm the messenger does not carry."""
    args = list(argv)
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if name not in SPEC_FLAGS:
            continue
        if name == "--speculative-algorithm":
            value = value if eq else (args[i + 1] if i + 1 < len(args) else "")
            algorithm = value.upper() or "?"
        else:
            continue  # the algorithm decides; SGLang refuses a draft path without one
        if algorithm not in CARRIED:
            raise UnsupportedSpeculation(_refusal(algorithm))


def check_server_args(server_args: Any) -> None:
    """The same refusal for a server's parsed arguments (SGLang's ServerArgs)."""
    algorithm = getattr(server_args, "speculative_algorithm", None)
    if algorithm and str(algorithm).upper() not in CARRIED:
        raise UnsupportedSpeculation(_refusal(str(algorithm).upper()))


def with_draft_paths(argv: Sequence[str]) -> list[str]:
    """`--speculative-draft-model-path NAME` of a built-in model -> its generated directory."""
    from sglang_disagg.models import BUILTIN_MODELS, ensure_model

    out = list(argv)
    for i, arg in enumerate(out):
        name, eq, value = arg.partition("=")
        if name != "--speculative-draft-model-path":
            continue
        if eq and value in BUILTIN_MODELS:
            out[i] = f"{name}={ensure_model(value)}"
        elif not eq and i + 1 < len(out) and out[i + 1] in BUILTIN_MODELS:
            out[i + 1] = str(ensure_model(out[i + 1]))
    return out


def draft_pool(scheduler: Any) -> Any:
    """The speculative draft's KV pool on this server, or None without speculation."""
    worker = getattr(scheduler, "draft_worker", None)
    if worker is None or not getattr(scheduler.server_args, "speculative_algorithm", None):
        return None
    check_server_args(scheduler.server_args)
    runner = getattr(getattr(worker, "draft_worker", None), "draft_runner", None)
    if runner is None:
        raise UnsupportedSpeculation(f"{type(worker).__name__} has no draft model runner the messenger can find")
    return runner.token_to_kv_pool


def draft_identity(server_args: Any) -> tuple[str, int]:
    """What first contact compares of the draft: "ALGORITHM:fingerprint" and its hidden size
    from its config.json (("", 0) without speculation; size 0 when the directory has no
    readable config: the fingerprint still tells two drafts apart)."""
    algorithm = getattr(server_args, "speculative_algorithm", None)
    if not algorithm:
        return "", 0
    from .compat import fingerprint

    path = str(server_args.speculative_draft_model_path)
    if path.rstrip("/") == str(getattr(server_args, "model_path", "")).rstrip("/"):
        algorithm = "NEXTN"  # the target's own MTP layer (SGLang runs NEXTN as EAGLE)
    try:
        hidden = int(json.loads((Path(path) / "config.json").read_text()).get("hidden_size", 0))
    except (OSError, ValueError, TypeError):
        hidden = 0
    return f"{str(algorithm).upper()}:{fingerprint(path)}", hidden
