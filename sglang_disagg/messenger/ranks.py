"""The TP ranks of one server, seen from the messenger.

SGLang runs one scheduler process per TP rank and keeps them in lockstep: rank 0 receives
requests and broadcasts them, and every rank takes the same scheduling decisions. The
messenger keeps that property: whatever changes the KV pools (allocating, handing a
request to the batch, freeing) happens on every rank in the same scheduler iteration.
Two tools make that possible:

- ``agree()``: one all-reduce (SUM) of per-request flags, so a transition that depends on
  what each rank saw locally (its writes landed, its writes completed) is taken by all
  ranks together;
- inputs the leader (rank 0) injects into SGLang's own request broadcast, for decisions
  only the leader can take (which prefill server, a decoder's first contact).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class RankGroup:
    def __init__(self, rank: int, size: int, cpu_group: Any = None) -> None:
        if size > 1 and cpu_group is None:
            raise ValueError("a TP group larger than 1 needs its CPU process group")
        self.rank, self.size, self._group = rank, size, cpu_group

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order (a collective: call on all ranks)."""
        if self.size == 1:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self._group)
        return out

    def agree(self, flags: Sequence[int]) -> list[int]:
        """Element-wise sum of `flags` over the ranks (a collective: every rank passes a
        vector of the same length, built from the same requests in the same order)."""
        if self.size == 1 or not flags:
            return list(flags)
        import torch
        import torch.distributed as dist

        t = torch.tensor(list(flags), dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self._group)
        return t.tolist()
