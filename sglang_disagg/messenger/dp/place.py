"""Where a scheduler process sits in a data-parallel server, as the messenger needs it.

SGLang's two shapes of data parallelism both give each DP group its own scheduler, KV
pool and requests: attention DP (``--attn-dp-size D``: D groups of tp/D attention-TP
ranks, the MoE/MLP layers over all tp ranks) and replica DP (``--dp-size D``: D replicas of
tp ranks behind SGLang's data-parallel controller). A group's ranks act in lockstep as TP
ranks do without DP (SGLang broadcasts a group's requests within its attention-TP group),
so each group runs its own messenger over its own ranks (ranks.py); group 0's leader owns
the server's one transfer backend (owner.py), the others reach it (proxy.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .support import resolved
from .wire import socket_name


@dataclass(frozen=True, slots=True)
class Place:
    group: int       # this scheduler's DP group (0 without DP)
    groups: int      # DP groups in the server
    rank: int        # rank within the group (attention-TP rank; TP rank of a replica)
    size: int        # ranks in the group
    cpu_group: Any   # the group's CPU process group (ranks.agree/gather)
    key: str         # names the server's owner socket: one per server on this host

    def owner_socket(self, secret: bytes) -> str:
        """The owner's socket, named after the deployment's secret (the one the node already
        required: every group of the server derives the same name; without the secret no one
        could take the name first, so there is no fallback to a guessable one)."""
        return socket_name(self.key, secret)

    @classmethod
    def of(cls, scheduler: Any, role: str) -> Place:
        from sglang.srt.runtime_context import get_parallel

        par, args = get_parallel(), scheduler.server_args
        # The HTTP port names the server: every group of it sees the same, no two servers on
        # one host share one.
        key = f"{role}-{args.port}"
        view = resolved(args)  # the deprecated --enable-dp-attention --dp-size D is attention DP
        attn_dp, dp = int(getattr(view, "attn_dp_size", 1) or 1), int(getattr(view, "dp_size", 1) or 1)
        if attn_dp > 1:
            return cls(int(par.attn_dp_rank), attn_dp, int(par.attn_tp_rank), int(par.attn_tp_size),
                       scheduler.attn_tp_cpu_group, key)
        if dp > 1:
            return cls(int(par.dp_rank or 0), dp, int(par.tp_rank), int(par.tp_size), scheduler.tp_cpu_group, key)
        return cls(0, 1, int(par.tp_rank), int(par.tp_size), scheduler.tp_cpu_group, key)
