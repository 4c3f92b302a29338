"""Decoder A's relay of a migrated request: B's token stream, read on a thread of A's scheduler
process, handed to A's scheduler, which emits the tokens as the request's own (so the client's
stream, its usage and finish reason come out of A's unchanged pipeline, exactly as one decoder
would report them).

B is asked through its native /generate (SGLang's own API, with the deployment's API key):
input ids prompt + outputs, the reduced budgets (carry.Carried.resume), stream on, and the
migration's source in SGLang's bootstrap fields (host, port of A's messenger, the held
request's handle as the room): B's messenger then orders the KV from A instead of a prefill
server. Closing the relay closes the connection, which B's front end takes as the client's
departure and aborts the request there (patch tokenizer_manager-abort-a-departed-client).

A speculative request's counters (verify steps, accepted drafts, the acceptance histogram) are
B's for B's steps: A reports its own from before the cut plus B's latest (`merge_speculation`),
so the client's totals count every verify step the request had, on either decoder.

Thread contract: the relay thread only appends to `tokens`/sets `finish` or `error` under the
lock and wakes the scheduler; the scheduler thread takes them with `take()`.
"""

from __future__ import annotations

import http.client
import json
import logging
import threading
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

from ...threads import Thread as NamedThread

logger = logging.getLogger("sglang_disagg.migration")
MAX_LINE = 1 << 20  # one SSE event of B's stream (its cumulative ids of one request)
MAX_HISTOGRAM = 256  # drafts one verify step can accept (SGLang's draft tokens per step, far below)


@dataclass(slots=True, eq=False)
class Relay:
    url: str                      # B's HTTP front end
    body: dict
    api_key: str | None
    wake: Any                     # callable: wakes A's scheduler
    timeout_s: float = 30.0       # connect and between two events (a silent B is lost)
    tokens: list[int] = field(default_factory=list)
    taken: int = 0
    finish: dict | None = None    # B's finish_reason when its stream ended
    error: str = ""
    spec: tuple[int, int, tuple[int, ...]] = (0, 0, ())  # B's verify steps, accepted drafts, histogram
    _conn: Any = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _closed: bool = False

    def start(self) -> None:
        NamedThread(target=self._run, name="migration-relay", daemon=True).start()

    def take(self) -> tuple[list[int], dict | None, str]:
        """(new tokens since the last take, B's finish reason or None, error or "")."""
        with self._lock:
            new, self.taken = self.tokens[self.taken:], len(self.tokens)
            return new, self.finish, self.error

    @property
    def failed(self) -> str:
        with self._lock:
            return self.error

    def close(self) -> None:
        """Stop relaying (the client left, or A gives the request up): B aborts it."""
        with self._lock:
            self._closed = True
            conn = self._conn
        if conn is not None:
            try:
                conn.sock and conn.sock.shutdown(2)
            except OSError:
                pass
            conn.close()

    def _run(self) -> None:
        try:
            self._stream()
        except Refused as e:
            with self._lock:
                if not self._closed and self.finish is None and not self.error:
                    self.error = f"the decoder the request moved to ({self.url}) refused it: {e}"
        except Exception as e:  # noqa: BLE001 - the relay's end, whatever it was, is the request's
            with self._lock:
                if not self._closed and self.finish is None and not self.error:
                    self.error = f"the decoder the request moved to ({self.url}) was lost: {e}"
        finally:
            with self._lock:
                if self.finish is None and not self.error and not self._closed:
                    self.error = f"the decoder the request moved to ({self.url}) ended its stream without finishing it"
            self.wake()

    def _stream(self) -> None:
        u = urllib.parse.urlsplit(self.url)
        conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=self.timeout_s)
        with self._lock:
            if self._closed:
                return
            self._conn = conn
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        conn.request("POST", "/generate", json.dumps({**self.body, "stream": True}), headers)
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read(2048).decode(errors='replace')}")
        while True:
            line = resp.readline(MAX_LINE + 1)
            if not line:
                return
            if len(line) > MAX_LINE:
                raise RuntimeError(f"an event of over {MAX_LINE} bytes")
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                return
            self._event(json.loads(data))

    def _event(self, out: dict) -> None:
        if "error" in out:
            raise RuntimeError(str(out["error"])[:500])
        finish = (out.get("meta_info") or {}).get("finish_reason")
        if isinstance(finish, dict) and finish.get("type") == "abort":
            # B refused or dropped it (e.g. SGLang's input check): a failure, not an ending
            raise Refused(str(finish.get("message"))[:400])
        ids = [int(t) for t in out.get("output_ids") or ()]
        meta = out.get("meta_info") or {}
        with self._lock:
            # SGLang streams cumulative ids unless incremental streaming is on: its
            # completion count says which.
            if meta.get("completion_tokens") == len(ids) and len(ids) >= len(self.tokens):
                self.tokens.extend(ids[len(self.tokens):])
            else:
                self.tokens.extend(ids)
            if meta.get("finish_reason"):
                self.finish = dict(meta["finish_reason"])
            self.spec = _speculation(meta) or self.spec
        self.wake()

    def speculation(self) -> tuple[int, int, tuple[int, ...]]:
        with self._lock:
            return self.spec


def _speculation(meta: dict) -> tuple[int, int, tuple[int, ...]] | None:
    """B's cumulative speculative counters from one event's meta_info, or None without them
    (SGLang reports them once a verify step ran). Checked: B is a peer, not us."""
    verify, correct, hist = (meta.get(k) for k in ("spec_verify_ct", "spec_num_correct_drafts",
                                                   "spec_correct_drafts_histogram"))
    if not isinstance(verify, int) or verify <= 0:
        return None
    hist = hist if isinstance(hist, list) and len(hist) <= MAX_HISTOGRAM and \
        all(isinstance(x, int) and x >= 0 for x in hist) else []
    return verify, correct if isinstance(correct, int) and correct >= 0 else 0, tuple(hist)


def merge_speculation(req: Any, base: tuple[int, int, tuple[int, ...]], b: tuple[int, int, tuple[int, ...]]) -> None:
    """A's counters at the cut (`base`) plus B's (`b`), as the request's own."""
    if not b[0]:
        return
    req.spec_verify_ct = base[0] + b[0]
    req.spec_num_correct_drafts = base[1] + b[1]
    n = max(len(base[2]), len(b[2]))
    req.spec_correct_drafts_histogram = [(base[2][i] if i < len(base[2]) else 0) + (b[2][i] if i < len(b[2]) else 0)
                                         for i in range(n)]


class Refused(RuntimeError):
    """B aborted the request (its finish reason says abort): a failed migration, not an ending."""


def finish_reason(finish: dict, max_new_tokens: int):
    """B's finish reason (its meta_info) as the SGLang finish reason A reports: a length limit is
    the request's whole budget (B's was reduced by A's outputs), stops are B's as given."""
    from sglang.srt.managers.schedule_batch import (FINISH_ABORT, FINISH_LENGTH, FINISH_MATCHED_STR,
                                                    FINISH_MATCHED_TOKEN)

    kind, matched = finish.get("type"), finish.get("matched")
    if kind == "length":
        return FINISH_LENGTH(length=max_new_tokens)
    if kind == "stop" and isinstance(matched, int) and not isinstance(matched, bool):
        return FINISH_MATCHED_TOKEN(matched=matched)
    if kind == "stop" and isinstance(matched, str):
        return FINISH_MATCHED_STR(matched=matched)
    return FINISH_ABORT(str(finish.get("message") or "the migrated request ended")[:500])
