"""Run inside a host that is no part of the deployment: what the data-plane listeners let an outsider do.

    python tests/hosts/outsider.py probe JOB.json   # prints one JSON object: what each attempt did
    python tests/hosts/outsider.py canary BACKEND PROVIDER OWN_ADDR DIR  # a listener of our own to aim at

The outsider holds no secret and knows only what a port scan tells (address and port), as an
attacker on the same network would; it speaks each transfer library's own protocol
(protocols.py has the clients):

- libfabric tcp (tcp;ofi_rxm): its own endpoint of the same provider, the peer's address built from
  the scanned IP and port, fi_writedata with a guessed key at an offset: this provider grants
  mr_mode 0 (keys chosen by the shim, 1, 2, 3..., addresses are offsets into the region).
- UCX tcp (NIXL): 40 bytes of plain socket: UCT's magic number and a CONN_REQ, then a PUT_REQ
  (address, length, data). UCT's tcp transport writes a PUT wherever it says (uct_tcp_ep_handle_put_req:
  no rkey, no registration check), so the live stack gets zero-length PUTs only.
- Mooncake (TCP transport, P2P handshake): a stock TransferEngine asks the handshake port for the
  peer's segment (its first registered buffer's address), then reads it; the TCP data port is also
  spoken raw (24-byte SessionHeader), to see whether the server checks addresses itself.

Against the live stack every attempt is harmless (zero-length writes, reads); the full-strength
attempts (writing registered and unregistered memory, forged completion notices) go to the canary:
a backend of the deployment's kind that the test starts in one of the deployment's hosts, set up as
the servers set theirs up (the same factory, a shared secret, its host's address). It registers a
buffer, keeps an unregistered one beside it, expects two writes tagged CANARY_TAG, and reports what
landed in DIR/landed.json.
"""

from __future__ import annotations

import json
import os
import random
import resource
import socket
import struct
import sys
import time
from pathlib import Path

# the clients of each library's protocol (this script's directory is first on sys.path)
from protocols import (MC_READ, MC_WRITE, UCT_PUT_REQ, WRITE, Fabric, Mooncake, libfabric_live, mooncake_live,
                       mooncake_raw, uct_connect, uct_put, ucx_live)

CANARY_TAG, CANARY_BYTES = 77, 1 << 16
GARBAGE = [random.Random(5).randbytes(1 << 16), b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"]





def garbage(address: str) -> list[str]:
    """Random bytes, then an HTTP request: what the listener did with each."""
    host, port = address.rsplit(":", 1)
    out = []
    for payload in GARBAGE:
        t0 = time.monotonic()
        try:
            with socket.create_connection((host, int(port)), timeout=3) as s:
                s.sendall(payload)
                s.settimeout(3)
                got = 0
                while chunk := s.recv(4096):
                    got += len(chunk)
                out.append(f"closed after {time.monotonic() - t0:.2f}s" + (f" ({got} B answered)" if got else ""))
        except socket.timeout:
            out.append(f"still open after {time.monotonic() - t0:.1f}s")
        except OSError as e:
            out.append(f"{type(e).__name__} after {time.monotonic() - t0:.2f}s")
    return out


def is_control(address: str) -> bool:
    """A messenger control port speaks first: its challenge starts with SGDA (backends/auth.py)."""
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=1) as s:
            s.settimeout(0.3)
            return s.recv(4) == b"SGDA"
    except OSError:
        return False


# ---- the canary ----------------------------------------------------------------------------------

def canary(backend: str, provider: str, own: str, where: str) -> None:
    import torch

    from sglang_disagg.ipc import shm
    from sglang_disagg.backends import BackendConfig, create_backend

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # it may be killed on purpose (UCX): no core file
    d = Path(where)
    if backend == "nixl":
        os.environ["UCX_NET_DEVICES"] = "all"  # as the launcher sets it off loopback
    be = create_backend(backend, BackendConfig(provider=None if provider == "-" else provider, host=own,
                                               secret=os.urandom(32).hex().encode()))
    registered = shm.shared_zeros((CANARY_BYTES,), torch.uint8)
    unregistered = torch.zeros((CANARY_BYTES,), dtype=torch.uint8)
    _, desc = be.register(registered.data_ptr(), CANARY_BYTES)
    second = shm.shared_zeros((CANARY_BYTES,), torch.uint8)
    _, desc2 = be.register(second.data_ptr(), CANARY_BYTES)
    # as the decoder expects a request's writes: from the one peer it ordered them from
    expect = be.expect(CANARY_TAG, 2, 30.0, peer=("the-prefill-server-it-ordered-from",))
    info = {"registered": registered.data_ptr(), "unregistered": unregistered.data_ptr(),
            "keys": [json.loads(x)["key"] for x in (desc, desc2)] if backend == "libfabric" else []}
    (d / "canary.tmp").write_text(json.dumps(info))
    (d / "canary.tmp").rename(d / "canary.json")
    end = time.monotonic() + 90
    while not (d / "attacked").exists() and time.monotonic() < end:
        time.sleep(0.05)
    time.sleep(0.3)  # the last write's bytes
    landed = {"registered": int((registered != 0).sum() + (second != 0).sum()),
              "unregistered": int((unregistered != 0).sum()),
              "forged_completion": expect.done() and expect.exception() is None}
    (d / "landed.tmp").write_text(json.dumps(landed))
    (d / "landed.tmp").rename(d / "landed.json")
    end = time.monotonic() + 10  # the outsider may now aim at an address nothing maps: it would kill us
    while not (d / "finished").exists() and time.monotonic() < end:
        time.sleep(0.05)
    os._exit(0)


def _at_libfabric(fab: Fabric, ports: list[str], info: dict, own: str) -> dict:
    for address in ports:
        peer = fab.peer(address)
        if fab.write(peer, 1, 0, 0, 0, timeout=2.0) == "sent":
            return {"listener": address, "keys_given_by_canary": info["keys"],
                    "write_key1": fab.write(peer, 1, 0, WRITE, CANARY_TAG),     # guessed: the first key
                    "write_key2": fab.write(peer, 2, 8192, WRITE, CANARY_TAG)}  # the second, another offset
    return {}


def _at_ucx(ports: list[str], info: dict, own: str) -> dict:
    for address in ports:
        try:
            s = uct_connect(own, address)
        except (OSError, ConnectionError, struct.error):
            continue
        with s:
            return {"listener": address, "put_registered": uct_put(s, info["registered"], b"\x07" * WRITE, 1),
                    "put_unregistered": uct_put(s, info["unregistered"], b"\x07" * WRITE, 2)}
    return {}


def _at_mooncake(mc: Mooncake, ports: list[str], info: dict) -> dict:
    for address in ports:
        first = mc.first_buffer(address)
        if not first:
            continue
        out = {"listener": address, "first_buffer": first,
               "write_registered": mc.te.transfer_sync_write(address, mc.sevens(), first, WRITE),
               "write_unregistered_engine": mc.te.transfer_sync_write(address, mc.addr, info["unregistered"], WRITE)}
        for data_port in ports:  # the TCP data port: the one that serves a raw READ at that buffer
            if data_port != address and mooncake_raw(data_port, first, MC_READ).startswith("answered 8"):
                out["write_unregistered_raw"] = mooncake_raw(data_port, info["unregistered"], MC_WRITE,
                                                             b"\x07" * WRITE)
        note = mc.engine.TransferNotify(mc.session, f"sgd3 {'0' * 32} 0 {CANARY_TAG} 2 {'0' * 32}")  # no key: a guessed MAC
        out["forged_notify"] = mc.te.batch_transfer_sync(address, [mc.addr], [first + 2 * WRITE], [16],
                                                         mc.engine.TransferOpcode.Write, note)
        return out
    return {}


def attack_canary(job: dict, fab: Fabric | None, mc: Mooncake | None) -> dict:
    """The strongest attempts we know, at the canary's listeners (its control port left out)."""
    d, own, backend = Path(job["canary"]["dir"]), job["own"], job["backend"]
    info = json.loads((d / "canary.json").read_text())
    ports = [p for p in job["canary"]["ports"] if not is_control(p)]
    out = (_at_libfabric(fab, ports, info, own) if backend == "libfabric" else _at_ucx(ports, info, own)
           if backend == "nixl" else _at_mooncake(mc, ports, info))
    (d / "attacked").write_text("1")
    end = time.monotonic() + 10
    while not (d / "landed.json").exists() and time.monotonic() < end:
        time.sleep(0.05)
    if backend == "nixl" and out:  # a PUT to an address nothing maps (the canary has reported by now)
        try:
            with uct_connect(own, out["listener"]) as s:
                s.sendall(struct.pack("<BI", UCT_PUT_REQ, 20) + struct.pack("<QQI", 0x10, 8, 1) + bytes(8))
                s.settimeout(3)
                out["put_unmapped"] = "answered" if s.recv(16) else "connection closed"
        except (OSError, ConnectionError) as e:
            out["put_unmapped"] = type(e).__name__
    (d / "finished").write_text("1")
    return out


# ---- the probe -----------------------------------------------------------------------------------

def wrong_secret(job: dict) -> dict[str, str]:
    from sglang_disagg.backends import BackendConfig, TransferError, create_backend

    out = {}
    for address in job["control"]:
        with create_backend(job["backend"], BackendConfig(provider=job["provider"], host=job["own"],
                                                          secret=b"x" * 32)) as intruder:
            t0 = time.monotonic()
            try:
                intruder.connect(address, 5)
                out[address] = "ADMITTED"
            except TransferError as e:
                out[address] = f"refused in {time.monotonic() - t0:.2f}s: {e}"
    return out


def probe(job: dict) -> dict:
    own, backend = job["own"], job["backend"]
    fab = Fabric(own) if backend == "libfabric" else None
    mc = Mooncake(own) if backend == "mooncake" else None
    out = {"wrong_secret": wrong_secret(job), "garbage": {}, "attempt": {}}
    data = job["data"]
    if backend == "mooncake":  # the handshake port first: the data port is read at its buffer
        for node in {d["node"] for d in data}:
            out["attempt"] |= mooncake_live(mc, [d["address"] for d in data if d["node"] == node])
    for d in data:
        address = d["address"]
        if backend == "libfabric":
            out["attempt"][address] = libfabric_live(fab, address)
        elif backend == "nixl":
            out["attempt"][address] = ucx_live(own, address)
        out["garbage"][address] = garbage(address)
    if job.get("canary"):
        out["canary"] = attack_canary(job, fab, mc)
    return out


def main() -> None:
    if sys.argv[1] == "canary":
        canary(*sys.argv[2:6])
        return
    out = probe(json.loads(Path(sys.argv[2]).read_text()))
    print(json.dumps(out), flush=True)
    os._exit(0)  # transfer libraries' threads would hold the exit


if __name__ == "__main__":
    main()
