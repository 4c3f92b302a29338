"""The contract between ``hooks`` (SGLang's scheduler) and a messenger side.

``hooks.scheduler_ready`` builds one messenger per scheduler process (every TP rank) for
the server's role: ``PrefillMessenger(cfg, scheduler, device, counter)`` (prefill.py) or
``DecodeMessenger(cfg, scheduler)`` (decode.py). Everything a messenger needs from
outside is passed in then (the device it computes on, the prefill leader's layer counter
made at model load): a messenger never imports ``hooks``. Afterwards ``hooks`` calls only
the methods of ``Messenger`` below, and both sides implement all of them (a side with
nothing to do for one says so in its body), so ``hooks`` never probes for a method.

Scheduler side: every call comes from the scheduler thread of its TP rank, and every rank
makes the same calls in the same scheduler iteration (SGLang keeps the ranks in lockstep;
the messenger keeps that property, ranks.py). With data parallelism "the ranks" are one DP
group's, each group with its own messenger and leader (dp/place.py):

====================  =================  ================================================
method                ranks              when (the patch that calls it)
====================  =================  ================================================
wakeup_fd()           every (once)       right after construction: the leader's descriptor
                                         for the scheduler's idle poll; None elsewhere
leader_inputs()       leader (rank 0)    each iteration, before SGLang broadcasts its
                                         requests: decisions only the leader can take
apply(item)           every              as the broadcast delivers each of those inputs,
                                         in the same order on every rank
step()                every              once per iteration, after the inputs: a
                                         collective (agree()), never skipped on one rank
take(req)             every              a new request about to enter the waiting queue
                                         (health checks excluded); True: the messenger
                                         owns it from now on
prefix_tree(req, t)   every              a waiting request is matched against the radix
                                         tree `t`; None when its prompt KV is in its row
rows_held(reqs)       every              get_new_batch_prefill checks room for waiting
                                         requests: how many of `reqs` already hold their
                                         req_to_token row (decode: handed-off requests),
                                         which need no free row
abort(recv_req)       every              top of the scheduler's abort_request
before_forward(b)     every              an extend forward is about to run
after_forward(b)      every              that forward was issued, before its results are
                                         processed
draft_tail_tokens(b)  every              a speculative draft extend over a prefill batch
                                         reads the tokens after each request's last
                                         position; returns them (decode: unchanged)
hold_release(req, c)  every              release_kv_cache is about to free req's pages;
                                         True keeps them (writes still in flight)
idle()                every              is_fully_idle (not for health checks)
has_leader_work()     leader             busy with no batch: True, do not sleep
====================  =================  ================================================

Worker side: backend threads (a write or an expected write completed, a peer was lost),
the leader's control thread (peers' messages) and, on a streaming prefill leader, the
streamer thread (posting each layer's writes as the forward passes it) never touch the
scheduler or SGLang's state: they set flags or queue messages and wake the scheduler
through the descriptor of ``wakeup_fd()``; the scheduler side acts on them in ``step()``,
``leader_inputs()`` and ``after_forward()``.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Messenger(Protocol):
    """What ``hooks`` calls on a messenger side (see the table above)."""

    def wakeup_fd(self) -> int | None: ...

    def leader_inputs(self) -> list[Any]: ...

    def apply(self, item: Any) -> None: ...

    def step(self) -> None: ...

    def take(self, req: Any) -> bool: ...

    def prefix_tree(self, req: Any, tree: Any) -> Any: ...

    def rows_held(self, reqs: Any) -> int: ...

    def abort(self, recv_req: Any) -> None: ...

    def before_forward(self, batch: Any) -> None: ...

    def after_forward(self, batch: Any) -> None: ...

    def draft_tail_tokens(self, batch: Any, tail: Any) -> Any: ...

    def hold_release(self, req: Any, checkpoint: bool) -> bool: ...

    def idle(self) -> bool: ...

    def has_leader_work(self) -> bool: ...
