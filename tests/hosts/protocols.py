"""Each transfer library's protocol as an outsider speaks it (the clients outsider.py uses).

UCX tcp by hand over a plain socket (UCT's magic number, CONN_REQ, PUT_REQ), libfabric through
the project's own shim with an endpoint of the same provider (tcp;ofi_rxm), Mooncake through a
stock TransferEngine and raw on its TCP data port (24-byte SessionHeader). Each `*_live`
function is the harmless attempt made against the live stack (zero-length writes, reads).
"""

from __future__ import annotations

import random
import socket
import struct
import time

WRITE, READ = 4096, 1 << 16  # bytes an attempt writes, and reads
# UCX (src/uct/tcp/tcp.h): UCT_AM_ID_MAX = 32; CM, PUT_REQ and PUT_ACK are the next ids
UCT_MAGIC, UCT_CM, UCT_PUT_REQ, UCT_PUT_ACK = 0xCAFEBABE12345678, 32, 33, 34
UCT_CONN_REQ, UCT_CONN_ACK = 1, 2
# Mooncake (tcp_transport_session_impl.h): SessionHeader {u64 size; u64 addr; u8 opcode} = 24 bytes
MC_HEADER, MC_READ, MC_WRITE = struct.Struct("<QQB7x"), 0, 1


def _recv_exact(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            raise ConnectionError(f"closed after {len(out)} of {n} bytes")
        out += chunk
    return out


# ---- UCX tcp -------------------------------------------------------------------------------------

def uct_connect(own: str, address: str) -> socket.socket:
    """A UCT tcp connection made by hand: magic number, CONN_REQ; returns once CONN_ACK came."""
    host, port = address.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=3)
    ifaddr = struct.pack("<H", socket.AF_INET) + struct.pack("!H", 1) + socket.inet_aton(own) + bytes(8)
    req = struct.pack("<IBQ", UCT_CONN_REQ, 0, random.getrandbits(63)) + ifaddr
    s.sendall(struct.pack("<Q", UCT_MAGIC) + struct.pack("<BI", UCT_CM, len(req)) + req)
    am, length = struct.unpack("<BI", _recv_exact(s, 5))
    event = struct.unpack("<I", _recv_exact(s, length)[:4])[0]
    if (am, event) != (UCT_CM, UCT_CONN_ACK):
        s.close()
        raise ConnectionError(f"answered AM {am} event {event}, not CONN_ACK")
    return s


def uct_put(s: socket.socket, addr: int, data: bytes, sn: int) -> int:
    """One PUT_REQ; the sequence number the peer's PUT_ACK acknowledged."""
    s.sendall(struct.pack("<BI", UCT_PUT_REQ, 20) + struct.pack("<QQI", addr, len(data), sn) + data)
    am, length = struct.unpack("<BI", _recv_exact(s, 5))
    body = _recv_exact(s, length)
    if am != UCT_PUT_ACK:
        raise ConnectionError(f"answered AM {am}, not PUT_ACK")
    return struct.unpack("<I", body[:4])[0]


def ucx_live(own: str, address: str) -> str:
    try:
        with uct_connect(own, address) as s:
            acked = uct_put(s, 0, b"", 1)
        return f"UCT tcp: CONN_ACK to a hand-made CONN_REQ; zero-length PUT_REQ acknowledged (PUT_ACK sn {acked})"
    except (OSError, ConnectionError, struct.error) as e:
        return f"not UCT tcp ({type(e).__name__}: {e})"


# ---- libfabric tcp -------------------------------------------------------------------------------

class Fabric:
    """An endpoint of the tcp;ofi_rxm provider with one registered source buffer."""

    def __init__(self, own: str) -> None:
        from sglang_disagg.backends.libfabric.native import Errbuf, address_of, ffi, lib
        self.ffi, self.lib, self.err = ffi, lib, Errbuf()
        ep = ffi.new("shim_ep **")
        self._ok(lib.shim_open(b"tcp;ofi_rxm", own.encode(), 0, ep, self.err.buf, 256), "open")
        self.ep, self.own = ep[0], address_of(ep[0])  # a sockaddr_in: family, port, address, zeros
        self.buf = ffi.new("char[]", b"\x07" * WRITE)
        h, k, b = ffi.new("uint64_t *"), ffi.new("uint64_t *"), ffi.new("uint64_t *")
        self._ok(lib.shim_mr_reg(self.ep, self.buf, WRITE, 0, 0, h, k, b, self.err.buf, 256), "mr_reg")
        self.mr, self.batch = h[0], 0

    def _ok(self, ret: int, what: str) -> None:
        if ret:
            raise OSError(f"{what}: {self.err} ({ret})")

    def peer(self, address: str) -> int:
        host, port = address.rsplit(":", 1)
        raw = bytearray(self.own)
        raw[2:4], raw[4:8] = struct.pack("!H", int(port)), socket.inet_aton(host)
        out = self.ffi.new("uint64_t *")
        self._ok(self.lib.shim_av_insert(self.ep, bytes(raw), len(raw), out, self.err.buf, 256), "av_insert")
        return out[0]

    def write(self, peer: int, key: int, offset: int, length: int, imm: int, timeout: float = 4.0) -> str:
        """fi_writedata of `length` bytes of 7s; "sent" once the provider completed it locally."""
        a = lambda v: self.ffi.new("uint64_t[]", [v])  # noqa: E731
        self.batch += 1
        ret = self.lib.shim_post(self.ep, self.batch, peer, 1, a(self.mr), a(0), a(offset), a(key), a(length), imm,
                                 self.err.buf, 256)
        if ret:
            return f"refused at post: {self.err}"
        ev, end = self.ffi.new("shim_event[]", 8), time.monotonic() + timeout
        while time.monotonic() < end:
            for i in range(self.lib.shim_poll(self.ep, ev, 8, 100_000)):
                if ev[i].kind == 1 and ev[i].id == self.batch:
                    return "sent" if ev[i].status == 0 else f"failed: {self.ffi.string(ev[i].msg).decode()}"
        return "no completion"


def libfabric_live(fab: Fabric, address: str) -> str:
    try:
        got = fab.write(fab.peer(address), 1, 0, 0, 0)
    except OSError as e:
        return f"libfabric tcp: {e}"
    return (f"libfabric tcp;ofi_rxm: connection accepted, a zero-length fi_writedata to key 1 (immediate 0): {got}"
            if got == "sent" else f"not libfabric tcp (write {got})")


# ---- Mooncake ------------------------------------------------------------------------------------

class Mooncake:
    def __init__(self, own: str) -> None:
        import ctypes

        from mooncake import engine
        self.engine, self.te = engine, engine.TransferEngine()
        if self.te.initialize(own, "P2PHANDSHAKE", "tcp", ""):
            raise OSError("Mooncake initialize failed")
        self.session = f"{own}:{self.te.get_rpc_port()}"
        self.buf = ctypes.create_string_buffer(READ)
        self.addr = ctypes.addressof(self.buf)
        if self.te.register_memory(self.addr, READ):
            raise OSError("Mooncake register_memory failed")

    def sevens(self) -> int:
        """Our buffer filled with 7s (what we write); its address."""
        import ctypes
        ctypes.memset(self.addr, 7, READ)
        return self.addr

    def first_buffer(self, address: str) -> int:
        """The peer's first registered buffer, as its handshake port tells anyone (0: not one)."""
        try:
            return int(self.te.get_first_buffer_address(address))
        except Exception:  # noqa: BLE001 - not a handshake port
            return 0

    def read(self, address: str, remote: int, n: int) -> tuple[int, bytes]:
        rc = self.te.transfer_sync_read(address, self.addr, remote, n)
        return rc, self.buf.raw[:n]


def mooncake_raw(address: str, remote: int, opcode: int, data: bytes = b"", n: int = 8) -> str:
    """One SessionHeader straight to a TCP data port; what came back."""
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=3) as s:
            s.sendall(MC_HEADER.pack(n if opcode == MC_READ else len(data), remote, opcode) + data)
            if opcode == MC_READ:
                return f"answered {len(_recv_exact(s, n))} B"
            s.settimeout(1.5)
            return "closed" if not s.recv(1) else "answered"
    except socket.timeout:
        return "kept open (accepted)"
    except (OSError, ConnectionError) as e:
        return f"{type(e).__name__}"


def mooncake_live(mc: Mooncake, addresses: list[str]) -> dict[str, str]:
    out, first = {}, 0
    for address in addresses:
        first = mc.first_buffer(address)
        if first:
            rc, data = mc.read(address, first, READ)
            out[address] = (f"Mooncake handshake: served the segment (first registered buffer at {first:#x}); "
                            f"transfer_sync_read of {READ} B from it: rc {rc}"
                            + (f" (read: {sum(1 for b in data if b)} non-zero bytes)" if rc == 0 else ""))
            break
    for address in addresses:
        if address not in out:
            out[address] = ("Mooncake TCP data: raw SessionHeader READ of 8 B at that buffer: "
                            + mooncake_raw(address, first, MC_READ)) if first else "not identified"
    return out
