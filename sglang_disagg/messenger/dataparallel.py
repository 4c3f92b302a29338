"""Data parallelism and the messenger: refused in messenger mode, with the reason, until
the messenger serves more than one scheduler group per server.

SGLang runs data parallelism in two shapes: replica DP (``--dp-size N``: N schedulers behind
one data-parallel controller, each with its own model and KV pool) and attention DP
(``--attn-dp-size D``, deprecated spelling ``--enable-dp-attention --dp-size D``: D groups of
TP/D attention ranks, each group its own scheduler and KV pool, the MoE/MLP layers shared).
The messenger today keeps one endpoint per server built on the TP rank group (node.py: TP
rank 0 holds the backend, the ports and the layer counter, and maps every TP rank's pool): a
second group would open a second backend on the same port, or never be reached. So both are
refused at start-up, by the launcher (``LaunchConfig``) and by every messenger server when
its model is loaded (``hooks.model_loaded``, for servers started some other way). Colocated
servers (``--role colocated``, attention DP verified on CPU) and ``--mode upstream`` run
what SGLang runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# SGLang's spellings (server_args / arg_groups/fields/parallel.py) -> what they set.
SIZE_FLAGS = {"--dp-size": "replica", "--data-parallel-size": "replica", "--attn-dp-size": "attention",
              "--attention-data-parallel-size": "attention"}
SWITCH_FLAGS = ("--enable-dp-attention",)


class UnsupportedParallelism(ValueError):
    pass


def _refusal(what: str) -> str:
    return (f"data parallelism ({what}) is not carried by the messenger yet: a messenger server "
            f"serves one scheduler group (its TP ranks), so a second DP group's KV pool would be "
            f"neither registered nor reached. Run data parallelism with --role colocated, or "
            f"use --mode upstream")


def check_argv(argv: Sequence[str]) -> None:
    """Refuse SGLang arguments that turn data parallelism on (a size above 1, or the switch)."""
    args = list(argv)
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if name in SWITCH_FLAGS:
            raise UnsupportedParallelism(_refusal(name))
        if name not in SIZE_FLAGS:
            continue
        value = value if eq else (args[i + 1] if i + 1 < len(args) else "")
        try:
            size = int(value)
        except ValueError:
            continue  # SGLang's own parser reports a malformed size
        if size > 1:
            raise UnsupportedParallelism(_refusal(f"{name} {size}: {SIZE_FLAGS[name]} DP"))


def check_server_args(server_args: Any) -> None:
    """The same refusal for a server's parsed arguments (SGLang's ServerArgs)."""
    for field, kind in (("dp_size", "replica"), ("attn_dp_size", "attention")):
        size = int(getattr(server_args, field, 1) or 1)
        if size > 1:
            raise UnsupportedParallelism(_refusal(f"{field}={size}: {kind} DP"))
