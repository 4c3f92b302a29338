"""The only functions our SGLang patches call.

Keeping the logic here, not inside SGLang, keeps each patch to a few lines that
say *where* we hook in; *what* happens is ordinary, tested Python in this
package. Every function is safe to call on GPU builds too (it decides itself
whether it has anything to do).
"""

from __future__ import annotations

import logging
import os
from typing import Any

logger = logging.getLogger("sglang_disagg.hooks")

_DEVICE_MEM = "VRAM"
_HOST_MEM = "DRAM"


def _to_host_kind(value: Any) -> Any:
    return _HOST_MEM if isinstance(value, str) and value == _DEVICE_MEM else value


class HostMemoryNixlAgent:
    """A nixl_agent whose memory-type arguments say DRAM where SGLang says VRAM.

    SGLang's NIXL connector hard-codes "VRAM" in some thirty places because on
    GPU the KV cache is device memory. With ``--device cpu`` the same pages are
    host memory, and UCX must be told so or it tries CUDA memory detection.
    Translating at the agent boundary is one patch line instead of thirty.
    """

    def __init__(self, agent: Any) -> None:
        self._agent = agent

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._agent, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            args = tuple(_to_host_kind(a) for a in args)
            kwargs = {k: _to_host_kind(v) for k, v in kwargs.items()}
            return attr(*args, **kwargs)

        call.__name__ = name
        return call


# NIXL's Python agent hard-codes its progress thread's delay to 0 us: the thread
# busy-polls a core. On CPU that core is the one the forward needs (upstream NIXL PD
# measured 2.7x slower per request than Mooncake here); a short sleep between progress
# rounds costs at most that much latency per completion.
NIXL_PROGRESS_DELAY_US = int(os.environ.get("SGLANG_DISAGG_NIXL_PROGRESS_DELAY_US", "200"))


def nixl_agent_for_device(agent: Any, device: str) -> Any:
    """The connector's nixl_agent, made by `agent()` (or given ready-made): on CPU its
    progress thread sleeps between rounds and its registrations say DRAM, not VRAM."""
    if callable(agent) and not hasattr(agent, "register_memory"):
        agent = _make_nixl_agent(agent) if device == "cpu" else agent()
    return HostMemoryNixlAgent(agent) if device == "cpu" else agent


def client_abort_delay_s() -> float:
    """Seconds SGLang waits before aborting the request of a streaming client that went
    away (upstream: 2 s). The launcher sets SGLANG_DISAGG_CLIENT_ABORT_DELAY_S=0.2: a
    disconnected client's KV pages and batch slot go back within the fault deadline, and a
    request that finished meanwhile is not aborted (only requests still in flight are)."""
    try:
        return max(0.0, float(os.environ.get("SGLANG_DISAGG_CLIENT_ABORT_DELAY_S", "2")))
    except ValueError:
        return 2.0


SUBPROCESS_START_ENV = "SGLANG_DISAGG_SUBPROCESS_START"


def subprocess_start_method(device: str) -> str:
    """How a server starts its scheduler and detokenizer processes (upstream: always spawn).
    Spawned, each re-imports torch and SGLang (~10 s of CPU apiece here); forked from the
    server process, which has imported them already, they start at once (on CPU only: no
    CUDA context to inherit; the server process has one Python thread when it forks, and
    OpenBLAS, numpy's one native thread pool, is fork-safe). SGLang alone keeps spawning; the
    launcher asks CPU servers to fork (launch/commands.py) unless the user's environment
    says spawn."""
    method = os.environ.get(SUBPROCESS_START_ENV, "spawn")
    if method not in ("spawn", "fork"):
        raise ValueError(f"{SUBPROCESS_START_ENV}={method!r}: write spawn or fork")
    return method if device == "cpu" else "spawn"


def _make_nixl_agent(make: Any) -> Any:
    from sglang_disagg.backends.nixl import progress_delay

    with progress_delay(NIXL_PROGRESS_DELAY_US):
        return make()


# --- Fault injection -------------------------------------------------------
# SGLANG_DISAGG_FAULT=drop_kv makes a decode server forget the KV it just
# received (zeroes the request's pages before its first decode step). It exists
# for one purpose: the negative control of the equivalence tests, proving that
# a decoder which did not get the prefill's KV produces different tokens, i.e.
# that the token comparison can fail.
FAULT_ENV = "SGLANG_DISAGG_FAULT"
_KV_DUMP = "SGLANG_DISAGG_KV_DUMP"  # kvdump.ENV, without importing it on every forward


def after_kv_received(scheduler: Any, req: Any) -> None:
    """Decode side: the transfer of ``req``'s prompt KV has completed."""
    if os.environ.get(FAULT_ENV, "") != "drop_kv":
        return
    kv = scheduler.token_to_kv_pool_allocator.get_kvcache()
    locs = scheduler.req_to_token_pool.req_to_token[req.kv.req_pool_idx, : len(req.origin_input_ids)]
    for layer in range(kv.start_layer, kv.start_layer + kv.layer_num):
        kv.get_key_buffer(layer)[locs] = 0
        kv.get_value_buffer(layer)[locs] = 0


# --- The messenger mode ----------------------------------------------------------------
# Active only when the launcher put a MessengerConfig in the environment
# (SGLANG_DISAGG_MESSENGER); otherwise every hook below returns at once and SGLang runs
# unchanged. One messenger per scheduler process (TP rank).
_messenger: Any = None
_waiter: Any = None
_counter: Any = None  # the prefill leader's LayerCounter, made at model load (before graph capture)


def messenger() -> Any:
    return _messenger


def device_name(model_runner: Any) -> str:
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
    from sglang_disagg.messenger.speculative import check_server_args

    check_server_args(model_runner.server_args)  # before a draft is loaded, not after
    if cfg.role is not MessengerRole.PREFILL or not cfg.stream or model_runner.is_draft_worker:
        return
    from sglang.srt.runtime_context import get_parallel

    if get_parallel().tp_rank != 0:  # the leader streams for every rank (stream.py)
        return
    from sglang_disagg.devices import for_device
    from sglang_disagg.messenger.layers import LayerCounter

    _counter = LayerCounter(model_runner.model, for_device(device_name(model_runner)).layer_word())


def layer_counter() -> Any:
    return _counter


def kv_zeros(shape: Any, dtype: Any, device: Any) -> Any:
    """The KV pool's buffers: in messenger mode, memory the server's messenger (TP rank 0)
    and same-host peers can map - on CPU zeroed shared memory (a memfd, shm.py), on GPU
    cuMem allocations exportable as file descriptors (cumem.py); plain torch.zeros otherwise."""
    import torch

    from sglang_disagg.messenger.config import ENV

    if str(device) == "cpu" and os.environ.get(ENV):
        from sglang_disagg.shm import shared_zeros

        return shared_zeros(tuple(shape), dtype)
    if str(device).startswith("cuda") and os.environ.get(ENV):
        from sglang_disagg.cumem import exportable_zeros

        return exportable_zeros(tuple(shape), dtype, device)
    return torch.zeros(shape, dtype=dtype, device=device)


def scheduler_ready(scheduler: Any) -> None:
    """End of Scheduler.__init__ (every TP rank): start the messenger for this role."""
    global _messenger, _waiter
    from sglang_disagg.messenger.config import MessengerConfig, MessengerRole

    cfg = MessengerConfig.from_env()
    if cfg is None:
        return
    from sglang.utils import TypeBasedDispatcher

    from sglang_disagg.messenger.inputs import MessengerInput

    if cfg.role is MessengerRole.PREFILL:
        from sglang_disagg.messenger.prefill import PrefillMessenger as cls
    else:
        from sglang_disagg.messenger.decode import DecodeMessenger as cls
    _messenger = cls(cfg, scheduler)
    # Leader decisions arrive on every rank through SGLang's request broadcast.
    scheduler._request_dispatcher += TypeBasedDispatcher([(MessengerInput, _messenger.apply)])
    if _messenger.ranks.is_leader:
        import zmq

        fd = _messenger.node.wakeup.fd
        if scheduler.idle_sleeper is not None:  # --sleep-on-idle: wake on messenger events too
            scheduler.idle_sleeper.poller.register(fd, zmq.POLLIN)
        _waiter = zmq.Poller()
        for sock in (scheduler.ipc_channels.recv_from_tokenizer, scheduler.ipc_channels.recv_from_rpc):
            if sock is not None:
                _waiter.register(sock, zmq.POLLIN)
        _waiter.register(fd, zmq.POLLIN)


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


def abort(scheduler: Any, recv_req: Any) -> None:
    if _messenger is not None:
        _messenger.abort(recv_req)


def is_idle(scheduler: Any) -> bool:
    return _messenger is None or _messenger.idle()


def wait_while_busy(scheduler: Any) -> None:
    """No batch to run but requests in flight: sleep until the messenger or a new request
    needs the scheduler (never spin: on a small machine that starves the peer server)."""
    if _messenger is None or _waiter is None or _messenger.has_leader_work():
        return
    _waiter.poll(50 if _messenger.ranks.size == 1 else 2)


def before_forward(scheduler: Any, batch: Any) -> None:
    """A forward is about to run: prefill announces the chunks it computes, so that each
    layer's pages are written while the forward continues."""
    if _messenger is not None and batch.forward_mode.is_extend():
        _messenger.before_forward(batch)


def after_forward(scheduler: Any, batch: Any) -> None:
    """A forward finished (before its results are processed): prefill writes the KV pages
    it completed."""
    if _messenger is not None and batch.forward_mode.is_extend():
        _messenger.after_forward(batch)
    if _KV_DUMP in os.environ:
        from sglang_disagg import kvdump

        kvdump.after_forward(scheduler, batch)


def spec_verified(scheduler: Any, req: Any, num_correct_drafts: int) -> None:
    """A speculative verify step of `req` settled, accepting `num_correct_drafts` draft
    tokens (recorded only for the test dumps)."""
    if _KV_DUMP in os.environ:
        from sglang_disagg import kvdump

        kvdump.verified(scheduler, req, num_correct_drafts)


def draft_tail_tokens(batch: Any, tail_tokens: Any) -> Any:
    """SGLang's draft extend over a prefill batch reads, after each request's last
    position, `tail_tokens` (the sampled token); a messenger order's is the prompt's last
    token instead (prefill never samples, and the decoder runs that token itself)."""
    fn = getattr(_messenger, "draft_tail_tokens", None)
    return tail_tokens if fn is None else fn(batch, tail_tokens)


def hold_release(req: Any, checkpoint: bool) -> bool:
    """release_kv_cache is about to free `req`'s pages: True keeps them (the prefill
    messenger still has writes from them in flight and releases later)."""
    if _messenger is None:
        return False
    return _messenger.hold_release(req, checkpoint)


# --- DeepSeek on CPU (deepseek_cpu) ----------------------------------------------------------


def mla_forward_method(attn: Any, forward_batch: Any) -> Any:
    """torch_native's handler in SGLang's AttentionBackendRegistry: how a DeepSeek attention
    layer computes this forward; always the absorbed MLA path."""
    from sglang_disagg import deepseek_cpu

    return deepseek_cpu.forward_method(attn, forward_batch)


def eager_on_cpu(fn: Any, is_cpu: bool) -> Any:
    """A torch.compile'd MoE routing function of SGLang (at import): the function itself on
    CPU, where compiling it made a fresh machine's first request take 24 s; unchanged
    elsewhere."""
    from sglang_disagg import deepseek_cpu

    return deepseek_cpu.eager_on_cpu(fn, is_cpu)
