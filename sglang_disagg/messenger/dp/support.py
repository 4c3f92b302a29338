"""Data parallelism and the messenger: what a messenger server accepts, and where it is set.

SGLang runs data parallelism in two shapes: replica DP (``--dp-size N``: N schedulers behind
one data-parallel controller, each with its own model and KV pool) and attention DP
(``--attn-dp-size D``, deprecated spelling ``--enable-dp-attention --dp-size D``: D groups of
TP/D attention ranks, each group its own scheduler and KV pool, the MoE/MLP layers shared).
The messenger carries both, one at a time: one messenger per server, each DP group a
logical messenger of its own (its ranks, its KV pool, its requests), group 0's leader owning
the server's one transfer backend, its port and its listener; the other groups reach it over
a Unix socket. A decoder's group pairs with a prefill server's group as two TP groups of
that size do (launch/sharding.py checks the attention-TP sizes).

Where it is refused:
- SGLang's own flags in a messenger launch (``check_argv``, from ``LaunchConfig``): DP is set
  by the launcher's ``--prefill-attn-dp``/``--decode-attn-dp``/``--prefill-dp``/``--decode-dp``,
  which also give each rank its cores and GPUs and check the model's shape and the pair
  (launch/parallel.py); the same flag passed through would bypass all of that.
- every messenger server when its model is loaded (``check_server_args``, from
  ``hooks.model_loaded``, for servers started some other way too): both shapes at once, and
  DP on any device but CPU. On GPU a DP group's KV pool is device memory (cuMem) that group
  0's leader, owning the backend, would have to register: handing it over is not built.
Colocated servers (``--role colocated``) and ``--mode upstream`` run what SGLang runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# SGLang's spellings (server_args / arg_groups/fields/parallel.py) -> what they set.
SIZE_FLAGS = {"--dp-size": "replica", "--data-parallel-size": "replica", "--attn-dp-size": "attention",
              "--attention-data-parallel-size": "attention"}
SWITCH_FLAGS = ("--enable-dp-attention",)
LAUNCHER_FLAGS = {"attention": "--prefill-attn-dp/--decode-attn-dp", "replica": "--prefill-dp/--decode-dp"}
NOT_ON_DEVICE = ("data parallelism in messenger mode is verified on CPU only; on GPU the other groups' KV pools "
                 "(cuMem) would have to be handed to the owner process, not built yet")


class UnsupportedParallelism(ValueError):
    pass


def _use_launcher(what: str, kind: str) -> str:
    return (f"{what}: in messenger mode data parallelism is set by the launcher's {LAUNCHER_FLAGS[kind]} "
            f"({kind} DP; the other shape: {LAUNCHER_FLAGS['replica' if kind == 'attention' else 'attention']}), "
            f"which also size each server's cores and GPUs and check the model's KV heads against the "
            f"prefill -> decode pair; not by SGLang's own flag")


def check_argv(argv: Sequence[str]) -> None:
    """Refuse SGLang arguments that turn data parallelism on (a size above 1, or the switch),
    naming the launcher's flags that set it."""
    args = list(argv)
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if name in SWITCH_FLAGS:
            raise UnsupportedParallelism(_use_launcher(name, "attention"))
        if name not in SIZE_FLAGS:
            continue
        value = value if eq else (args[i + 1] if i + 1 < len(args) else "")
        try:
            size = int(value)
        except ValueError:
            continue  # SGLang's own parser reports a malformed size
        if size > 1:
            raise UnsupportedParallelism(_use_launcher(f"{name} {size}", SIZE_FLAGS[name]))


def resolved(server_args: Any) -> Any:
    """SGLang's resolved view of its arguments: the deprecated ``--enable-dp-attention
    --dp-size D`` leaves the raw dp_size at D and resolves to attn_dp_size D, dp_size 1."""
    try:
        from sglang.srt.arg_groups.model_override_base import resolving_view
    except ImportError:  # an SGLang without resolution: the fields are what they say
        return server_args
    return resolving_view(server_args)


def check_server_args(server_args: Any) -> None:
    """Refuse, for a messenger server's parsed arguments (SGLang's ServerArgs), what the
    messenger does not carry: attention DP and replica DP at once, DP off CPU."""
    view = resolved(server_args)
    replica, attention = (int(getattr(view, f, 1) or 1) for f in ("dp_size", "attn_dp_size"))
    if replica > 1 and attention > 1:
        raise UnsupportedParallelism(f"dp_size={replica} with attn_dp_size={attention}: replica DP and attention "
                                     f"DP on one server at once are not carried by the messenger; choose one")
    if max(replica, attention) > 1 and getattr(view, "device", None) != "cpu":
        kind = "replica" if replica > 1 else "attention"
        raise UnsupportedParallelism(f"{kind} DP ({'dp_size' if replica > 1 else 'attn_dp_size'}="
                                     f"{max(replica, attention)}) on device {getattr(view, 'device', None)}: "
                                     f"{NOT_ON_DEVICE}")
