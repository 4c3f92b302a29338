"""The only module of ours that SGLang's patches call, and the only functions they call.

Each patch is a few lines that say *where* we hook in; *what* happens is ordinary, tested
Python elsewhere in this package, which these functions only reach: the messenger
(through the Protocol of messenger/contract.py), the CPU ops (cpu/ops, cpu/spec_ops), CPU
speculation (cpu/speculative), torch_native's attention (cpu/attention), the KV allocation
policy (kvalloc), SGLang's NIXL connector on CPU (backends/nixl_connector) and the test
faults and dumps (testsupport). Nothing those import comes back here: the messenger is
given what it needs at construction. Every function is safe to call on GPU builds too (it
decides itself whether it has anything to do). tests/unit/test_hooks_door.py checks that
patches import nothing else of ours and call only functions defined here.
"""

from __future__ import annotations

import os
import signal
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sglang_disagg.messenger.contract import Messenger


def nixl_agent_for_device(agent: Any, device: str) -> Any:
    """SGLang's NIXL connector makes its nixl_agent here (`agent()`, or given ready-made):
    on CPU one that registers host memory and does not busy-poll (backends/nixl_connector.py)."""
    from sglang_disagg.backends.nixl_connector import agent_for_device

    return agent_for_device(agent, device)


def client_abort_delay_s() -> float:
    """Seconds SGLang waits before aborting the request of a streaming client that went
    away (upstream: 2 s). The launcher sets SGLANG_DISAGG_CLIENT_ABORT_DELAY_S=0.2: a
    disconnected client's KV pages and batch slot go back within the fault deadline, and a
    request that finished meanwhile is not aborted (only requests still in flight are)."""
    try:
        return max(0.0, float(os.environ.get("SGLANG_DISAGG_CLIENT_ABORT_DELAY_S", "2")))
    except ValueError:
        return 2.0


def subprocess_start_method(device: str) -> str:
    """How a server starts its scheduler and detokenizer processes (upstream: always spawn).
    Spawned, each re-imports torch and SGLang (~10 s of CPU apiece here); forked from the
    server process, which has imported them already, they start at once (on CPU only: no
    CUDA context to inherit; the server process has one Python thread when it forks, and
    OpenBLAS, numpy's one native thread pool, is fork-safe). SGLang alone keeps spawning; the
    launcher asks CPU servers to fork (launch/commands.py) unless the user's environment
    says spawn."""
    from sglang_disagg.env import SUBPROCESS_START_ENV

    method = os.environ.get(SUBPROCESS_START_ENV, "spawn")
    if method not in ("spawn", "fork"):
        raise ValueError(f"{SUBPROCESS_START_ENV}={method!r}: write spawn or fork")
    return method if device == "cpu" else "spawn"


def cpu_op(name: str) -> Any:
    """sgl_kernel's CPU op `name` where sgl_kernel cannot provide it (the PyPI wheel is a
    CUDA build): a native torch version (cpu/ops.py, cpu/spec_ops.py), or one that raises
    NotImplementedError naming the op when called."""
    from sglang_disagg.cpu import ops

    return getattr(ops, name)


def draft_extend_backend(draft_model_runner: Any) -> Any:
    """torch_native's entry in SGLang's draft-extend backend map (cpu/speculative.py)."""
    from sglang_disagg.cpu import speculative

    return speculative.draft_extend_backend(draft_model_runner)


def extend_view(forward_batch: Any) -> Any:
    """The batch torch_native's extend reads: a verify forward with its lengths (cpu/speculative.py)."""
    from sglang_disagg.cpu import speculative

    return speculative.extend_view(forward_batch)


def attention_page_tables(pool: Any, req_to_token: Any, forward_batch: Any) -> Any:
    """torch_native, once per forward: each request's pages when the pool is HND, else None
    (cpu/attention.py)."""
    from sglang_disagg.cpu import attention

    return attention.page_tables(pool, req_to_token, forward_batch)


def attention_gather(cache: Any, slots: Any, page_tables: Any, seq_idx: int) -> Any:
    """torch_native: K or V of request `seq_idx`'s `slots` as [heads, tokens, dim], from an
    NHD or HND pool (cpu/attention.py)."""
    from sglang_disagg.cpu import attention

    pages = page_tables[seq_idx] if page_tables is not None else None
    return attention.gather_heads_first(cache, slots, pages)


def attention_new_rows(out: Any, query: Any, key: Any, value: Any, prefix_len: Any, *, causal: bool,
                       enable_gqa: bool, scale: Any) -> bool:
    """torch_native's extend of one request after a cached prefix: attend with the new rows
    only, into `out`; False when the original path must run (cpu/attention.py)."""
    from sglang_disagg.cpu import attention

    return attention.attend_new_rows(out, query, key, value, prefix_len, causal=causal,
                                     enable_gqa=enable_gqa, scale=scale)


def after_kv_received(scheduler: Any, req: Any) -> None:
    """Decode side of SGLang's own disaggregation: the transfer of ``req``'s prompt KV has
    completed (only the drop_kv test fault acts here: testsupport.py)."""
    from sglang_disagg import testsupport

    testsupport.drop_kv(scheduler, req)


# --- The messenger mode ----------------------------------------------------------------
# Active only when the launcher put a MessengerConfig in the environment
# (SGLANG_DISAGG_MESSENGER); otherwise every hook below returns at once and SGLang runs
# unchanged. One messenger per scheduler process (TP rank); what it must implement, and
# when each method is called, is messenger/contract.py.
_messenger: Messenger | None = None
_waiter: Any = None
_counter: Any = None  # the prefill leader's LayerCounter, made at model load (before graph capture)


def _device_name(model_runner: Any) -> str:
    """'cpu' or 'cuda:N' for the device a model runner computes on."""
    device = str(model_runner.device)
    return f"{device}:{model_runner.gpu_id}" if device == "cuda" else device


def model_loaded(model_runner: Any) -> None:
    """End of ModelRunner.initialize(): the model exists and no CUDA graph was captured yet.
    A streaming prefill server's leader puts its layer counter on the model now, so that
    capture records the counter's device work and every replay runs it (hooks added after
    capture, as at scheduler_ready, would never run under replay)."""
    global _counter
    from sglang_disagg.messenger.config import MessengerConfig, MessengerRole

    cfg = MessengerConfig.from_env()
    if cfg is None:
        return
    from sglang_disagg.messenger import speculative
    from sglang_disagg.messenger.dp import support as dataparallel

    speculative.check_server_args(model_runner.server_args)  # before a draft is loaded, not after
    dataparallel.check_server_args(model_runner.server_args)
    if cfg.role is not MessengerRole.PREFILL or not cfg.stream or model_runner.is_draft_worker:
        return
    from sglang.srt.runtime_context import get_parallel

    # The leader streams for every rank of its group (stream.py); each DP group has its own
    # (attention DP: its attention-TP rank 0; replica DP: its replica's TP rank 0).
    if get_parallel().attn_tp_rank != 0:
        return
    from sglang_disagg.devices import for_device
    from sglang_disagg.messenger.layers import LayerCounter

    _counter = LayerCounter(model_runner.model, for_device(_device_name(model_runner)).layer_word())


def kv_zeros(shape: Any, dtype: Any, device: Any) -> Any:
    """The KV pool's buffers, zeroed: shared memory in messenger mode (kvalloc.py)."""
    from sglang_disagg.kvalloc import kv_zeros as zeros

    return zeros(shape, dtype, device)


def scheduler_ready(scheduler: Any) -> None:
    """End of Scheduler.__init__ (every TP rank): start the messenger for this role."""
    from sglang_disagg.env import IGNORE_SIGTERM_ENV
    from sglang_disagg.messenger.config import MessengerConfig

    try:
        _scheduler_ready(scheduler, MessengerConfig.from_env())
    finally:
        if os.environ.get(IGNORE_SIGTERM_ENV) == "1":
            # In a Slurm step the step's signal is the launcher's to act on (env.py); a handler
            # the scheduler's start installed over the inherited SIG_IGN is undone here
            signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _scheduler_ready(scheduler: Any, cfg: Any) -> None:
    global _messenger, _waiter, _wait_ms
    from sglang_disagg.messenger.config import MessengerRole

    if cfg is None:
        return
    from sglang.utils import TypeBasedDispatcher

    from sglang_disagg.messenger.contract import Messenger
    from sglang_disagg.messenger.inputs import MessengerInput

    if cfg.role is MessengerRole.PREFILL:
        from sglang_disagg.messenger.prefill import PrefillMessenger

        side: Any = PrefillMessenger(cfg, scheduler, _device_name(scheduler.tp_worker.model_runner), _counter)
    else:
        from sglang_disagg.messenger.decode import DecodeMessenger

        side = DecodeMessenger(cfg, scheduler)
    if not isinstance(side, Messenger):
        raise TypeError(f"{type(side).__name__} does not implement messenger.contract.Messenger")
    _messenger = side
    # Leader decisions arrive on every rank through SGLang's request broadcast.
    scheduler._request_dispatcher += TypeBasedDispatcher([(MessengerInput, side.apply)])
    fd = side.wakeup_fd()
    if fd is not None:  # the leader
        import zmq

        if scheduler.idle_sleeper is not None:  # --sleep-on-idle: wake on messenger events too
            scheduler.idle_sleeper.poller.register(fd, zmq.POLLIN)
        _waiter = zmq.Poller()
        for sock in (scheduler.ipc_channels.recv_from_tokenizer, scheduler.ipc_channels.recv_from_rpc):
            if sock is not None:
                _waiter.register(sock, zmq.POLLIN)
        _waiter.register(fd, zmq.POLLIN)
    from sglang_disagg.messenger.dp.support import resolved

    if int(getattr(resolved(scheduler.server_args), "attn_dp_size", 1) or 1) > 1:
        _wait_ms = _DP_IDLE_WAIT_MS
        if scheduler.idle_sleeper is not None:
            _cap_poll(scheduler.idle_sleeper.poller, dp_idle_sleep_ms())


def _cap_poll(poller: Any, cap_ms: int) -> None:
    """Attention DP: a group with nothing to do sleeps in SGLang's IdleSleeper (--sleep-on-idle)
    for up to 1 s, and every iteration of the other groups starts with a collective it must join:
    a group waiting for its KV (no batch yet) then ran one iteration per second, so each of its
    hand-offs waited ~1 s after the last write landed (0.93-1.0 s measured on a DP 2 decoder, 0 on
    TP 1). Capping the sleep bounds that wait; an idle group then runs an iteration every cap."""
    poll = poller.poll

    def capped(timeout: Any = None, *args: Any) -> Any:
        return poll(cap_ms if timeout is None or timeout < 0 or timeout > cap_ms else timeout, *args)

    poller.poll = capped


def leader_inputs(scheduler: Any) -> list:
    """TP rank 0, before SGLang broadcasts this iteration's requests: the messenger's
    decisions, so that every rank applies them in the same iteration."""
    return _messenger.leader_inputs() if _messenger is not None else []


def after_inputs(scheduler: Any) -> None:
    """Every rank, once per scheduler iteration, after the requests were dispatched."""
    if _messenger is not None:
        _messenger.step()


def take_request(scheduler: Any, req: Any) -> bool:
    """A new request about to enter the waiting queue; True if the messenger took it."""
    if _messenger is None:
        return False
    from sglang.srt.constants import HEALTH_CHECK_RID_PREFIX

    if req.rid.startswith(HEALTH_CHECK_RID_PREFIX):  # probes check this server, not its peers
        return False
    return _messenger.take(req)


def prefix_tree(req: Any, tree_cache: Any) -> Any:
    """What a waiting request matches its prefix against: None when it already holds the
    KV of its prompt (a decoder's request whose KV came from a prefill server)."""
    if _messenger is None:
        return tree_cache
    return _messenger.prefix_tree(req, tree_cache)


def rows_held(scheduler: Any, reqs: Any) -> int:
    """How many of the waiting `reqs` already hold their req_to_token row: SGLang's admission
    checks count free rows (and rows of requests already admitted to the batch), so a
    decoder whose rows all went to handed-off requests (each takes its row with its pages)
    would never admit one of them."""
    return 0 if _messenger is None else _messenger.rows_held(reqs)


def abort(scheduler: Any, recv_req: Any) -> None:
    if _messenger is not None:
        _messenger.abort(recv_req)


def is_idle(scheduler: Any) -> bool:
    return _messenger is None or _messenger.idle()


# Every event the leader acts on sets the messenger's wakeup (a write completing, an order or
# an answer arriving, a link changing), whatever the TP size: the one backend counts the writes
# into every rank's pages, and other ranks post none. So this bounds a missed wakeup; it is no
# polling period.
_IDLE_WAIT_MS = 50
# Attention DP: every group takes part in each iteration's MLP collective, so a group asleep
# here holds up a group that has work (its KV landed, a request arrived at it): it sleeps at
# most this long.
_DP_IDLE_WAIT_MS = 2
DP_IDLE_SLEEP_ENV = "SGLANG_DISAGG_DP_IDLE_SLEEP_MS"  # a fully idle group's longest sleep (_cap_poll)


def dp_idle_sleep_ms() -> int:
    """How long a fully idle attention-DP group sleeps at most: 50 ms unless the environment says
    (1000 is SGLang's own --sleep-on-idle; benchmarks/dp_idle.py compares the two)."""
    raw = os.environ.get(DP_IDLE_SLEEP_ENV, "50")
    if not raw.isdigit() or not 1 <= int(raw) <= 1000:
        raise ValueError(f"{DP_IDLE_SLEEP_ENV}={raw!r}: expected milliseconds from 1 to 1000")
    return int(raw)


_wait_ms = _IDLE_WAIT_MS


def wait_while_busy(scheduler: Any) -> None:
    """No batch to run but requests in flight: sleep until the messenger or a new request
    needs the scheduler (never spin: on a small machine that starves the peer server)."""
    if _messenger is None or _waiter is None or _messenger.has_leader_work():
        return
    _waiter.poll(_wait_ms)


def before_forward(scheduler: Any, batch: Any) -> None:
    """A forward is about to run: prefill announces the chunks it computes, so that each
    layer's pages are written while the forward continues."""
    if _messenger is not None and batch.forward_mode.is_extend():
        _messenger.before_forward(batch)


def after_forward(scheduler: Any, batch: Any) -> None:
    """A forward finished (before its results are processed): prefill writes the KV pages
    it completed (and a test's KV dump is written: testsupport.py)."""
    if _messenger is not None and batch.forward_mode.is_extend():
        _messenger.after_forward(batch)
    from sglang_disagg import testsupport

    testsupport.dump_kv(scheduler, batch)


def spec_verified(scheduler: Any, req: Any, num_correct_drafts: int) -> None:
    """A speculative verify step of `req` settled, accepting `num_correct_drafts` draft
    tokens (recorded only for the test dumps: testsupport.py)."""
    from sglang_disagg import testsupport

    testsupport.dump_verified(scheduler, req, num_correct_drafts)


def draft_tail_tokens(batch: Any, tail_tokens: Any) -> Any:
    """SGLang's draft extend over a prefill batch reads, after each request's last
    position, `tail_tokens` (the sampled token); a messenger order's is the prompt's last
    token instead (prefill never samples, and the decoder runs that token itself)."""
    return tail_tokens if _messenger is None else _messenger.draft_tail_tokens(batch, tail_tokens)


def hold_release(req: Any, checkpoint: bool) -> bool:
    """release_kv_cache is about to free `req`'s pages: True keeps them (the prefill
    messenger still has writes from them in flight and releases later)."""
    if _messenger is None:
        return False
    return _messenger.hold_release(req, checkpoint)


# --- DeepSeek on CPU (cpu/deepseek) ----------------------------------------------------------


def mla_forward_method(attn: Any, forward_batch: Any) -> Any:
    """torch_native's handler in SGLang's AttentionBackendRegistry: how a DeepSeek attention
    layer computes this forward; always the absorbed MLA path."""
    from sglang_disagg.cpu import deepseek

    return deepseek.forward_method(attn, forward_batch)


def eager_on_cpu(fn: Any, is_cpu: bool) -> Any:
    """A torch.compile'd MoE routing function of SGLang (at import): the function itself on
    CPU, where compiling it made a fresh machine's first request take 24 s; unchanged
    elsewhere."""
    from sglang_disagg.cpu import deepseek

    return deepseek.eager_on_cpu(fn, is_cpu)


def synchronize(device: Any) -> None:
    """DeepSeek's draft (NEXTN) shares the target's embedding and head, then waits for the
    device: torch.cuda.synchronize() on CUDA; nothing to wait for on CPU, where the call
    would initialise CUDA in a forked scheduler and kill it."""
    import torch

    if getattr(device, "type", str(device)).startswith("cuda"):
        torch.cuda.synchronize(device)


def padded_seq_len() -> int:
    """torch_native on CPU: the sequence length DP attention gives the rows it pads a DP
    group's batch with (so every group runs the MoE/MLP collectives on the same token
    count): 1, as SGLang's CPU (AMX) backend, a padded row attending to one slot."""
    return 1


def wait_readable(socket: Any, timeout_s: float = 1.0) -> None:
    """SGLang's data-parallel controller, its queue drained: block until the tokenizer's
    socket has a message (or `timeout_s`: its loop feeds a watchdog), instead of polling it
    in a loop that kept a whole core busy while idle (measured: 100 % of one of 2 cores)."""
    import zmq

    zmq.select([socket], [], [], timeout_s)
