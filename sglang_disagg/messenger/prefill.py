"""Prefill side: decoders' orders become ordinary SGLang requests with max_new_tokens=0
(so the batch never samples), and each chunk's pages are written into the decoder's
pages, with the order's immediate, as soon as that chunk's forward ends.

Scheduler-side contract (messenger/contract.py; hooks.py calls these on every TP rank, in the
scheduler thread):
  leader_inputs()        (leader) decoders' Hello/orders/cancels, injected into the broadcast
  apply(input)           DecoderJoined / OrderTicket / CancelTicket / DecoderLeft, the same on every rank
  take(req)              a request reaching the queue: orders pass, anything else is refused
  after_forward(batch)   post the writes of every page the forward completed
  hold_release(req, cp)  a finished order keeps its pages until its writes completed
  step()                 once per iteration: agree with the other ranks, release, answer
  abort(recv_req)        orders still waiting in the queue
Worker side (backend threads): write futures completing only count down and wake the
scheduler. A decoder whose control connection is lost (it died, or the link dropped) gets
its orders cancelled at once: nobody would take their KV, and a decoder that reconnects
has failed them already (it asks for Released on the new connection). The control thread (leader) reads decoders' messages and answers first
contact; everything that touches the scheduler goes through the broadcast.

One messenger per server: the leader (TP rank 0; with DP, each group's leader, its writes
posted through group 0's backend: dp/owner.py) owns the only backend, the layer counter
and the streamer, and posts the writes of every rank's pages (Node maps the other ranks'
KV). The layer counter can live on the leader alone because the reduction of o_proj's
partial sums synchronises the ranks: once the leader's forward passed layer L + 1, every
rank computed layer L's KV (stream.py posts other ranks' pages one layer behind). The other ranks keep the same
order bookkeeping (so every rank releases the same requests at the same step) but post
nothing, and their writes count as done.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import time
from array import array
from typing import Any

from ..backends import PeerState
from ..devices import for_device
from . import wire
from .config import MessengerConfig
from .decoderlinks import DecoderLinks
from .inputs import CancelTicket, DecoderJoined, DecoderKey, DecoderLeft, MessengerInput, OrderTicket
from .intake import Intake
from .faults import ENV as FAULT_ENV, CorruptSource
from .layers import LayerCounter
from .node import Node
from .metrics import Cause, scheduler_state
from .orders import DecoderLink, Record
from .planner import ShardPlan
from .prefill_writes import ChunkWrites
from .requests import ORDER_ATTR, abort_matches, fail_request, release
from .stream import LAYER_TIMEOUT_S, Streamer, Ticket

logger = logging.getLogger("sglang_disagg.messenger")
TRACE = os.environ.get("SGLANG_DISAGG_TRACE") == "1"  # one timing line per order, for profiling
FINISHED_MAX = 1 << 14  # finished orders remembered for a late cancel (older: answered "posted unknown")


class PrefillMessenger(ChunkWrites):
    def __init__(self, cfg: MessengerConfig, scheduler: Any, device: str, counter: LayerCounter | None) -> None:
        """`device`: 'cpu' or 'cuda:N', where the forward runs; `counter`: the layer counter
        put on the model at load (hooks.model_loaded), needed by a streaming leader."""
        self.cfg, self.sched = cfg, scheduler
        self.node = Node(cfg, scheduler)
        self.ranks, self.backend = self.node.ranks, self.node.backend
        self.decoders = DecoderLinks()  # bounded: dropped when their decoder left (decoderlinks.py)
        self.records: dict[str, Record] = {}        # prefill rid -> record
        # (decoder, tag) -> writes posted, of the orders finished last: a cancel that comes
        # after the order ended (the decoder was cut off) is answered with it (leader).
        self.finished: collections.OrderedDict[tuple[DecoderKey, int], int] = collections.OrderedDict()
        self._seq = itertools.count()
        self.intake = Intake(self.node, self.ranks.size, int(scheduler.model_config.vocab_size)) \
            if self.ranks.is_leader else None
        self.stats = {"orders": 0, "orders_failed": 0, "writes_posted": 0, "pages_sent": 0}
        self.recent: collections.deque[dict] = collections.deque(maxlen=64)  # finished orders' timelines
        self.node.metrics.watch(self._gauges)
        self.streamer: Streamer | None = None
        self._ticket: Ticket | None = None
        # Test-only: every write into a decoder fails at posting, as when a decoder's region
        # descriptor names memory this server cannot map (issue 19).
        self._fail_writes = os.environ.get(FAULT_ENV) == "fail_writes"
        self._corrupt = CorruptSource.from_env() if self.ranks.is_leader else None
        if self._corrupt is not None and device != "cpu":
            raise ValueError(f"{FAULT_ENV}=corrupt_source writes host memory; this server's KV is on {device}")
        self.by_source: dict[int, int] = {}  # TP rank -> orders that read pages from it (leader)
        self.fence = for_device(device).fence()  # the forward's end, in stream order
        if cfg.stream and self.ranks.is_leader:
            if counter is None:
                raise RuntimeError("messenger: streaming is on but the model has no layer counter: "
                                   "sglang_disagg.hooks.model_loaded did not run (SGLang patch missing?)")
            early = os.environ.get(FAULT_ENV) == "early_writes"  # negative control: write before the KV exists
            self.streamer = Streamer(counter, self.node.view.target_layers, self._post, early=early,
                                     settle=self._settle)
        if self.intake is not None:
            self.node.start_reader(self.intake.on_message)

    def leader_inputs(self) -> list[MessengerInput]:
        return self.intake.drain(lambda key: [r.order.tag for r in self.records.values()
                                              if r.key == key and not r.cancelled])

    # ----- every rank: inputs from the broadcast --------------------------------------
    def apply(self, item: MessengerInput) -> None:
        if isinstance(item, DecoderJoined):
            self._join(item)
        elif isinstance(item, OrderTicket):
            self._admit(item)
        elif isinstance(item, CancelTicket):
            self._cancel(item)
        elif isinstance(item, DecoderLeft):
            self.decoders.leave(item.key, busy=self._busy(item.key))

    def _busy(self, key: DecoderKey) -> bool:
        return any(r.key == key for r in self.records.values())

    def _join(self, item: DecoderJoined) -> None:
        hello = item.hello
        link = DecoderLink(hello, ShardPlan.build(self.node.view.geometry, self.ranks.size, hello.kv.tp))
        # A decoder whose control connection dropped says Hello again: keep our connection to
        # it when that one lives (closing it would fail the decoder's transfers from us).
        kept = self.decoders.join(item.key, link)
        if not self.ranks.is_leader:
            return
        try:
            self._connect(link, kept if kept is not None and kept.id == hello.ranks[0].instance else None)
        except Exception as e:  # noqa: BLE001 - orders from this decoder will fail with it
            link.error = f"cannot reach decoder {hello.decoder}: {e}"
            logger.error("messenger: %s", link.error)

    def _connect(self, link: DecoderLink, kept: Any = None) -> None:
        """One data connection to the decoder's messenger, which holds every decode rank's
        regions (leader). `kept` is reused while it lives."""
        if kept is not None and kept.state is PeerState.CONNECTED:
            peer = kept
        else:
            peer = self.backend.connect(link.hello.ranks[0].address, self.cfg.connect_timeout_s)
        for d, endpoint in enumerate(link.hello.ranks):
            link.peers[d] = peer
            link.remote[d] = [peer.add_remote_region(desc) for desc in endpoint.regions]

    def _reconnect_if_lost(self, link: DecoderLink) -> None:
        """The data connection can be lost while the control connection lives (the decoder
        gave up on a prefill server that was stopped, then came back): connect again before
        writing this order, or every later order from that decoder would fail. A failure here
        is the order's, when its writes are posted (as on every rank)."""
        peer = link.peers.get(0)
        if peer is None or peer.state is PeerState.CONNECTED:
            return
        try:
            self._connect(link)
            logger.warning("messenger: data connection to decoder %s was lost; connected again", link.hello.decoder)
        except Exception as e:  # noqa: BLE001
            logger.error("messenger: decoder %s: data connection lost and not restored: %s", link.hello.decoder, e)

    def _admit(self, item: OrderTicket) -> None:
        from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
        from sglang.srt.sampling.sampling_params import SamplingParams

        o = item.order
        rec = Record(next(self._seq), f"mx-{item.key.instance[:12]}-{o.tag}", item.key, o, sent=o.start_page)
        rec.times["admit"] = time.monotonic()
        self.records[rec.rid] = rec
        self.stats["orders"] += 1
        link = self.decoders.get(item.key)
        if link is None or link.error:
            rec.failed = link.error if link else "unknown decoder"
            rec.held = True  # nothing to release: step() answers the decoder
            return
        if self.ranks.is_leader:
            self._reconnect_if_lost(link)
        params = SamplingParams(max_new_tokens=0, temperature=0.0)
        params.normalize(self.sched.tokenizer)
        self.sched.handle_generate_request(TokenizedGenerateReqInput(
            rid=rec.rid, input_text=None, input_ids=array("q", o.token_ids), input_embeds=None, mm_inputs=None,
            token_type_ids=None, sampling_params=params, return_logprob=False, logprob_start_len=-1,
            top_logprobs_num=0, token_ids_logprob=None, stream=False))
        if rec.req is None:  # refused at intake (too long, ...): SGLang said why in its log
            rec.failed, rec.held = "the prefill server refused the request at intake (see its log)", True
            rec.refused = True

    def _cancel(self, item: CancelTicket) -> None:
        rec = next((r for r in self.records.values() if r.key == item.key and r.order.tag == item.tag), None)
        if rec is None:
            # Already released (orders precede their cancel in the broadcast): nothing of it
            # is in our hands any more; say so, and how many writes it posted (some may still
            # be on their way: the decoder counts them in before it frees the pages).
            if self.intake is not None:
                self.intake.send(item.key, wire.Released(rid="", tag=item.tag,
                                                         posted=self.finished.get((item.key, item.tag))))
            return
        rec.cancelled = True
        if rec.req is not None and not rec.held:
            from sglang.srt.managers.io_struct import AbortReq

            self.sched.abort_request(AbortReq(rid=rec.rid))

    # ----- every rank: SGLang's request flow -----------------------------------------
    def take(self, req: Any) -> bool:
        rec = self.records.get(req.rid)
        if rec is not None:
            rec.req = req
            setattr(req, ORDER_ATTR, rec)
            return False
        fail_request(self.sched, req, "this is a prefill server in messenger mode: it takes requests from "
                                      "decode servers only; send requests to a decode server or the router")
        return True

    def before_forward(self, batch: Any) -> None:
        """The chunks this forward computes: streamed layer by layer as it runs."""
        if self.streamer is None:
            return
        chunks = [c for req in batch.reqs if (c := self._chunk(req, by_layer=True)) is not None]
        self._ticket = self.streamer.submit(chunks) if chunks else None

    def after_forward(self, batch: Any) -> None:
        """The forward was issued (on CUDA it may still run): what is posted now waits for
        the fence recorded here, i.e. for the forward's end on the device."""
        self.fence.record()
        if self.streamer is None:
            chunks = [c for req in batch.reqs if (c := self._chunk(req, by_layer=False)) is not None]
            done = self.fence.wait(LAYER_TIMEOUT_S) if chunks else True
            now = time.monotonic()
            for chunk in chunks:
                chunk.rec.times["forward_end"] = now
                if not done:
                    chunk.rec.failed = chunk.rec.failed or "the forward did not finish on the device"
                else:
                    self._post(chunk, chunk.ready)
            return
        ticket, self._ticket = self._ticket, None
        if ticket is not None:
            ok = self.streamer.wait(ticket) and self.fence.wait(LAYER_TIMEOUT_S)
            now = time.monotonic()
            for c in ticket.chunks:
                c.rec.times["forward_end"] = now
                if not ok:
                    c.rec.failed = c.rec.failed or "the layer streamer did not finish this forward"
            for c in ticket.chunks:  # other ranks' last layer: reduced by the forward's end
                if c.tail and not c.rec.failed:
                    self._post(c, c.tail)

    def draft_tail_tokens(self, batch: Any, tail: Any) -> Any:
        """A speculative draft's extend reads at each position the token after it: after an
        order's last position that is the prompt's last token (the order carries it), not
        a sampled one. A chunk before an order's last keeps SGLang's (the next prompt token)."""
        out = tail
        for i, req in enumerate(batch.reqs):
            rec = getattr(req, ORDER_ATTR, None)
            if rec is not None and req is not batch.chunked_req:
                out = tail.clone() if out is tail else out
                out[i] = rec.order.last_token
        return out

    def hold_release(self, req: Any, checkpoint: bool) -> bool:
        rec = getattr(req, ORDER_ATTR, None)
        if rec is None or rec.done:
            return False
        req.finished_output = True  # nobody at this server's HTTP side waits for it
        rec.held, rec.checkpoint = True, checkpoint
        if rec.sent < len(rec.order.dst_pages) and not rec.failed:
            rec.failed = f"the request ended after {rec.sent} of {len(rec.order.dst_pages)} pages (aborted?)"
        return True

    def step(self) -> None:
        self.node.wakeup.clear()
        self.node.stop_if_owner_gone(self._fail_all)
        with self.node.owner_may_go(self._fail_all):
            self._step()

    def _step(self) -> None:
        live = [r for r in self.records.values() if r.held]
        flags = []
        for r in live:
            flags += [int(r.writes_done), int(bool(r.failed))]
        sums = self.ranks.agree(flags)
        for i, r in enumerate(live):
            done, failed = sums[2 * i:2 * i + 2]
            if done == self.ranks.size:
                self._finish(r, failed > 0)
        if self.ranks.is_leader:
            self.node.stats_file.publish(self.snapshot)

    def _fail_all(self, reason: str) -> None:
        """No write of this group can be posted any more: every order fails."""
        for rec in self.records.values():
            rec.failed = rec.failed or reason

    def _gauges(self) -> dict[str, dict[str, float]]:  # metrics HTTP thread, at each scrape
        records = list(self.records.values())
        per_decoder = collections.Counter(r.key for r in records)
        return scheduler_state(self.sched, self.node.page_size) | self.node.backend_gauges() | {
            "sglang_disagg_requests_in_flight": {"orders": len(records)},
            "sglang_disagg_peer_outstanding": {link.hello.decoder: per_decoder[key]
                                               for key, link in self.decoders.items()}}

    def snapshot(self) -> dict:
        return self.node.describe(self.sched) | self.stats | {
            "decoders": len(self.decoders), "in_flight": len(self.records),
            "scheduler": scheduler_state(self.sched, self.node.page_size), "streaming": self.streamer is not None,
            "recent": list(self.recent), "requests_by_source": dict(self.by_source)} | (
            {"fault_corrupted": list(self._corrupt.corrupted)} if self._corrupt is not None else {})

    def _finish(self, rec: Record, failed: bool) -> None:
        rec.done = True
        rec.times["released"] = time.monotonic()
        self.recent.append({"rid": rec.order.rid, "tag": rec.order.tag, "tokens": len(rec.order.token_ids),
                            "failed": failed} | rec.times)
        if TRACE:
            t = rec.times | {"release": time.monotonic()}
            logger.info("messenger trace %s: admit at %.4f (monotonic), %d tokens; ms since admit: %s", rec.rid,
                        rec.times["admit"], len(rec.order.token_ids),
                        ", ".join(f"{k} {1000 * (v - t['admit']):.1f}" for k, v in t.items()))
        del self.records[rec.rid]
        self.decoders.settled(rec.key, busy=self._busy(rec.key))
        if rec.req is not None:
            release(self.sched, rec.req, checkpoint=rec.checkpoint)
        m, t = self.node.metrics, rec.times
        if failed:
            self.stats["orders_failed"] += 1
            m.fail(Cause.ABORTED if rec.cancelled else Cause.INTAKE if rec.refused else Cause.TRANSFER)
        elif rec.cancelled:
            m.requests.labels("cancelled").inc()
        else:
            m.requests.labels("served").inc()
            m.observe_ttft("queue", t.get("admit"), t.get("forward_start"))
            m.observe_ttft("compute", t.get("forward_start"), t.get("forward_end"))
            m.observe_ttft("tail", t.get("forward_end"), max(t.get("last_write", 0.0), t.get("forward_end", 0.0)))
            if "first_post" in t and "last_write" in t:
                m.transfer.observe(max(0.0, t["last_write"] - t["first_post"]))
        if self.intake is not None:
            self.node.dp.order_done(rec.key, rec.order.tag)
            self.finished[(rec.key, rec.order.tag)] = rec.writes
            while len(self.finished) > FINISHED_MAX:
                self.finished.popitem(last=False)
        if self.intake is not None and (rec.cancelled or failed):
            self.intake.send(rec.key, wire.Released(rid=rec.order.rid, tag=rec.order.tag, posted=rec.writes)
                             if rec.cancelled else
                             wire.OrderFailed(rid=rec.order.rid, tag=rec.order.tag,
                                              reason=rec.failed or "KV writes failed on another TP rank",
                                              blame=wire.Blame.ORDER if rec.refused else wire.Blame.SERVER,
                                              posted=rec.writes))

    def abort(self, recv_req: Any) -> None:
        # Orders still waiting in SGLang's queue hold nothing: finish them here, or SGLang
        # would drop them from the queue and this record would wait forever.
        for req in [r for r in self.sched.waiting_queue if getattr(r, ORDER_ATTR, None) is not None]:
            if abort_matches(recv_req, req.rid):
                self.sched.waiting_queue.remove(req)
                rec = getattr(req, ORDER_ATTR)
                rec.held, rec.failed = True, rec.failed or "aborted on the prefill server"
                req.finished_output = True

    @staticmethod
    def prefix_tree(req: Any, tree: Any) -> Any:
        return tree

    @staticmethod
    def rows_held(reqs: Any) -> int:
        """A prefill server's waiting requests hold no row before they run."""
        return 0

    def idle(self) -> bool:
        return not self.records

    def has_leader_work(self) -> bool:
        return self.intake is not None and self.intake.pending()

    def wakeup_fd(self) -> int | None:
        return self.node.wakeup_fd()


    def close(self) -> None:
        if self.streamer is not None:
            self.streamer.close()
        self.decoders.close()
        self.node.close()
