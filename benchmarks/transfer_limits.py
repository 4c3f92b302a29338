"""Reference limits measured in the same run as the transfer benchmark: memcpy in one
process, one TCP stream over loopback, and process_vm_writev into another process."""

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


def memcpy_pages_gbps(size: int, page: int = 256 << 10, reps: int = 5) -> float:
    """memmove of `page`-sized pages to scattered destinations in one process: the physical
    limit of the page workloads (a KV transfer is many page copies, not one stream)."""
    import random

    a, b = mmap.mmap(-1, size), mmap.mmap(-1, size)
    a.write(b"\x01" * size)
    b.write(b"\x02" * size)
    pa, pb = (ctypes.addressof(ctypes.c_char.from_buffer(m)) for m in (a, b))
    n = size // page
    order = random.Random(0).sample(range(n), n)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for i, j in enumerate(order):
            ctypes.memmove(pb + j * page, pa + i * page, page)
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


_TARGET = r"""
import ctypes, mmap, os, sys
m = mmap.mmap(-1, int(sys.argv[1])); m.write(b"\x03" * len(m))
print(os.getpid(), ctypes.addressof(ctypes.c_char.from_buffer(m)), flush=True)
sys.stdin.read()
"""


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def process_vm_writev_gbps(size: int, page: int = 256 << 10, reps: int = 5) -> float:
    """One-copy writes into another process (CMA, what libfabric's shm provider uses for
    large messages): `page`-sized iovecs over `size` bytes, median of `reps`."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.process_vm_writev.restype = ctypes.c_ssize_t
    target = subprocess.Popen([sys.executable, "-c", _TARGET, str(size)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        pid, remote = (int(x) for x in target.stdout.readline().split())
        src = mmap.mmap(-1, size)
        src.write(b"\x01" * size)
        local = ctypes.addressof(ctypes.c_char.from_buffer(src))
        n = size // page
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            for start in range(0, n, 1024):  # IOV_MAX
                k = min(1024, n - start)
                liov = (_Iovec * k)(*[_Iovec(local + (start + i) * page, page) for i in range(k)])
                riov = (_Iovec * k)(*[_Iovec(remote + (start + i) * page, page) for i in range(k)])
                if libc.process_vm_writev(pid, liov, k, riov, k, 0) != k * page:
                    raise OSError(ctypes.get_errno(), "process_vm_writev failed")
            times.append(time.perf_counter() - t)
        return size / statistics.median(times) / 1e9
    finally:
        target.stdin.close()
        target.wait(10)
