"""Reference limits measured in the same run as the transfer benchmark."""

from __future__ import annotations

import ctypes
import mmap
import socket
import statistics
import subprocess
import sys
import time

_SINK = r"""
import socket, sys
s = socket.create_server(("127.0.0.1", 0)); print(s.getsockname()[1], flush=True)
c, _ = s.accept(); buf = bytearray(1 << 20); mv = memoryview(buf); total = int(sys.argv[1])
while total > 0:
    n = c.recv_into(mv)
    if not n: break
    total -= n
c.sendall(b"k")
"""


def memcpy_gbps(size: int, reps: int = 5) -> float:
    """Single-thread memmove between two faulted-in buffers, median of `reps`."""
    a, b = mmap.mmap(-1, size), mmap.mmap(-1, size)
    a.write(b"\x01" * size)
    b.write(b"\x02" * size)
    pa, pb = (ctypes.addressof(ctypes.c_char.from_buffer(m)) for m in (a, b))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        ctypes.memmove(pb, pa, size)
        times.append(time.perf_counter() - t)
    return size / statistics.median(times) / 1e9


def tcp_loopback_gbps(size: int, chunk: int = 1 << 20) -> float:
    """One TCP stream over loopback to another process, 1 MiB sends."""
    sink = subprocess.Popen([sys.executable, "-c", _SINK, str(size)], stdout=subprocess.PIPE, text=True)
    try:
        port = int(sink.stdout.readline())
        payload = memoryview(bytes(chunk))
        with socket.create_connection(("127.0.0.1", port)) as s:
            t = time.perf_counter()
            sent = 0
            while sent < size:
                s.sendall(payload[: min(chunk, size - sent)])
                sent += min(chunk, size - sent)
            s.recv(1)
            dt = time.perf_counter() - t
        return size / dt / 1e9
    finally:
        sink.wait(10)
