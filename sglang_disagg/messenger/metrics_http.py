"""The messenger's Prometheus listener, bounded like every other port of ours.

prometheus_client's own ``start_http_server`` starts one thread per connection and reads
without a deadline, so anyone who reaches the port can hold threads for ever (one idle
connection each, or one byte now and then) and, with enough of them, keep the scraper out.
Here, as on the control ports (backends/control.py):

- at most ``MAX_CONNECTIONS`` at a time; a newcomer evicts the oldest (a scrape is answered
  in milliseconds, so the oldest is the one most likely doing nothing);
- one deadline for the client's part, ``REQUEST_DEADLINE_S`` from accept until a GET's
  request line and headers are read (a POST's until its answer is sent: its body is read by
  the app), however slowly the bytes trickle in. Our own answer is not under it: a scheduler
  busy on one core (a drain) may take seconds to render a scrape, and a scraper that waits
  for it (Prometheus: 10 s) must get it, not a cut connection. The answer has a deadline of
  its own, ``ANSWER_DEADLINE_S`` (a client that never reads it cannot hold a thread for ever);
- evictions and deadlines counted (``evicted``, ``timed_out``, both exported by the messenger as
  ``sglang_disagg_metrics_connections_dropped{why}``) and logged at a bounded rate.

The metrics are keyless by design (the numbers are operational, not secret; docs/security.md);
paths added through ``routes`` (a decoder's /drain) check their own key.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from .. import threads
from ..ratelog import RateLog

logger = logging.getLogger(__name__)

MAX_CONNECTIONS = 32
REQUEST_DEADLINE_S = 2.0
ANSWER_DEADLINE_S = 30.0  # from a GET read whole until its answer was sent
_SWEEP_S = 0.2  # how often the serving loop looks for connections past their deadline


class _Quiet(WSGIRequestHandler):
    def log_message(self, *args) -> None:  # a line per scrape (or per attacker) is noise
        pass

    def parse_request(self) -> bool:
        ok = super().parse_request()
        if ok and self.command == "GET":  # all the client sends is read: the rest is our answer
            self.server.read(self.request)
        return ok


class BoundedMetricsServer(ThreadingWSGIServer):
    daemon_threads = True
    # socketserver's listen backlog is 5: past it the kernel drops SYNs and a scraper's connect
    # waits out TCP's 1 s, 3 s, ... retries behind the flood, before any eviction could help.
    request_queue_size = 128

    def __init__(self, *args, **kwargs) -> None:
        self._lock = threading.Lock()
        self._live: dict[socket.socket, float] = {}  # oldest first: accept time (monotonic)
        self.evicted = self.timed_out = 0
        self._log = RateLog(10.0, logger)
        super().__init__(*args, **kwargs)

    def process_request(self, request, client_address) -> None:
        with self._lock:
            while len(self._live) >= MAX_CONNECTIONS:
                oldest = next(iter(self._live))
                del self._live[oldest]
                self.evicted += 1
                _cut(oldest)
            self._live[request] = time.monotonic()
        if self.evicted:
            self._log.warn("evicted", "messenger metrics: connection limit (%d) reached, oldest evicted; %d so far",
                           MAX_CONNECTIONS, self.evicted)
        super().process_request(request, client_address)

    def service_actions(self) -> None:
        """Called by the serving loop between accepts: cut what ran past its deadline."""
        late = time.monotonic() - REQUEST_DEADLINE_S
        with self._lock:
            expired = [s for s, t in self._live.items() if t < late]
            for s in expired:
                del self._live[s]
            self.timed_out += len(expired)
        for s in expired:
            _cut(s)
        if expired:
            self._log.warn("deadline", "messenger metrics: %d connection(s) cut at the %.0f s request deadline; "
                           "%d so far", len(expired), REQUEST_DEADLINE_S, self.timed_out)

    def read(self, request) -> None:
        """`request` was read whole: from now on under the answer's deadline (still evictable)."""
        with self._lock:
            if request in self._live:  # stored as when it was accepted, as the sweep compares
                self._live[request] = time.monotonic() + ANSWER_DEADLINE_S - REQUEST_DEADLINE_S

    def shutdown_request(self, request) -> None:
        with self._lock:
            self._live.pop(request, None)
        super().shutdown_request(request)

    def handle_error(self, request, client_address) -> None:
        pass  # a cut or reset connection; a traceback per attacker would be the flood's log

    def live(self) -> int:
        with self._lock:
            return len(self._live)


def _cut(sock: socket.socket) -> None:
    """Unblock the thread reading it; the thread then closes it."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class Routes:
    """The metrics app at any path but those added: ``add(path, handler)``, where
    ``handler(environ) -> (status, JSON-able body)`` answers that path (each checks its own key)."""

    def __init__(self, metrics: Callable) -> None:
        self._metrics, self._routes = metrics, {}

    def add(self, path: str, handler: Callable[[dict], tuple[str, dict]]) -> None:
        self._routes[path] = handler

    def __call__(self, environ: dict, start_response: Callable) -> list[bytes]:
        handler = self._routes.get(environ.get("PATH_INFO", ""))
        if handler is None:
            return self._metrics(environ, start_response)
        status, body = handler(environ)
        data = json.dumps(body).encode()
        start_response(status, [("Content-Type", "application/json"), ("Content-Length", str(len(data)))])
        return [data]


def serve(host: str, port: int, registry: CollectorRegistry) -> BoundedMetricsServer:
    """Listen on (host, port) and serve `registry` at any path, from a daemon thread; more
    paths through the server's ``routes``."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET

    class _Server(BoundedMetricsServer):
        address_family = family

    routes = Routes(make_wsgi_app(registry))
    httpd = make_server(host, port, routes, _Server, handler_class=_Quiet)
    httpd.routes = routes
    threads.Thread(target=httpd.serve_forever, args=(_SWEEP_S,), name="messenger-metrics", daemon=True).start()
    return httpd
