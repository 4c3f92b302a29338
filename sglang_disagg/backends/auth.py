"""Mutual challenge-response authentication of a control connection, before any frame.

Both ends prove they hold the deployment's shared secret without sending it: each sends
a fresh random nonce, then an HMAC-SHA256 over both nonces and its own role, and checks
the other's with a constant-time comparison. The role in the MAC stops a reflected proof
(an attacker echoing our own proof back); fresh nonces on both sides stop replays. Only
stdlib primitives (`secrets`, `hmac`, `hashlib`): no cryptography of our own.

Both messages have a fixed size, so nothing is length-prefixed and nothing is parsed
before authentication: an unauthenticated peer can make us read at most 69 bytes and
wait at most the handshake timeout, a deadline for the whole exchange (a peer trickling
one byte at a time is cut at it like a silent one).

The secret comes from ``SGLANG_DISAGG_SECRET_FILE`` (a file holding it; the launcher
writes one, mode 0600, for a local stack) or ``SGLANG_DISAGG_SECRET`` (the value). A
backend made without one (library use, the conformance suite) authenticates with a fixed
public key: both ends must then run without a secret, and a server with a secret refuses
every peer without it ("wrong or missing shared secret").
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
import struct
import time

from ..ipc import stream
from .errors import TransferError
from .frames import FrameKeys

SECRET_ENV = "SGLANG_DISAGG_SECRET"
SECRET_FILE_ENV = "SGLANG_DISAGG_SECRET_FILE"
MIN_SECRET_BYTES = 16
_MAGIC = b"SGDA"
_VERSION = 3  # 2: PING frames (heartbeats); 3: every frame after the handshake sealed (frames.py)
_NONCE = 32
_CHALLENGE = struct.Struct(f"!4sB{_NONCE}s")
_PROOF = hashlib.sha256().digest_size
_OPEN_KEY = b"sglang-disagg: no shared secret configured"


class AuthError(TransferError):
    """The peer did not prove the shared secret (or spoke another protocol)."""


def load_secret(environ: dict[str, str] | None = None) -> bytes | None:
    """The shared secret from the environment (file first), or None when neither is set."""
    env = os.environ if environ is None else environ
    path = env.get(SECRET_FILE_ENV, "")
    if path:
        try:
            with open(path, "rb") as f:
                value = f.read().strip()
        except OSError as e:
            raise AuthError(f"{SECRET_FILE_ENV}={path}: cannot read the shared secret: {e}") from None
        where = f"{SECRET_FILE_ENV}={path}"
    elif env.get(SECRET_ENV):
        value, where = env[SECRET_ENV].strip().encode(), SECRET_ENV
    else:
        return None
    if len(value) < MIN_SECRET_BYTES:
        raise AuthError(f"{where}: the shared secret is {len(value)} bytes, need at least {MIN_SECRET_BYTES}")
    return value


def new_secret() -> str:
    """A fresh secret for a deployment (what the launcher writes to its secret file)."""
    return secrets.token_hex(32)


def _proof(key: bytes, role: bytes, theirs: bytes, ours: bytes) -> bytes:
    return hmac.new(key, b"sglang-disagg control v1|" + role + b"|" + theirs + ours, hashlib.sha256).digest()


class _Deadline:
    """Sends and receives on `sock` that all end by one moment: the socket timeout is set
    to what is left before each call (a per-call timeout let a peer sending one byte
    every 1.9 s hold a 2 s handshake open for minutes)."""

    def __init__(self, sock: socket.socket, timeout_s: float) -> None:
        self.sock, self.timeout_s = sock, timeout_s
        self.at = time.monotonic() + timeout_s

    def _arm(self) -> None:
        left = self.at - time.monotonic()
        if left <= 0:  # settimeout(0) would make the socket non-blocking, not expire it
            raise socket.timeout
        self.sock.settimeout(left)

    def sendall(self, data: bytes) -> None:
        self._arm()  # sendall's timeout bounds the whole call (Python >= 3.5)
        self.sock.sendall(data)

    def recv_exact(self, n: int) -> bytes:
        try:
            return stream.recv_exactly(self.sock, n, "authentication", self.at)
        except EOFError:
            raise AuthError("connection closed during authentication (the peer may have refused our proof: "
                            "wrong or missing shared secret)") from None


def handshake(sock: socket.socket, secret: bytes | None, dialed: bool, timeout_s: float) -> FrameKeys:
    """Authenticate both ends of `sock`, all of it within `timeout_s` of the call (a deadline,
    not a per-recv timeout); raises AuthError. Returns the keys that seal every frame after it
    (frames.py), bound to this exchange's nonces. Callers pass BackendConfig.handshake_timeout_s
    (2 s by default; the messenger passes min(2 s, its connect timeout), a dialer no more
    than its connect timeout). The socket is left with a timeout of at most what was left
    (the caller sets its own once the peer is admitted)."""
    key = secret if secret is not None else _OPEN_KEY
    ours = secrets.token_bytes(_NONCE)
    me, them = (b"dialer", b"acceptor") if dialed else (b"acceptor", b"dialer")
    io = _Deadline(sock, timeout_s)
    try:
        io.sendall(_CHALLENGE.pack(_MAGIC, _VERSION, ours))
        magic, version, theirs = _CHALLENGE.unpack(io.recv_exact(_CHALLENGE.size))
        if magic != _MAGIC:
            raise AuthError("peer does not speak the sglang-disagg control protocol")
        if version != _VERSION:
            raise AuthError(f"peer's control protocol version {version}, this build speaks {_VERSION}")
        if theirs == ours:
            raise AuthError("peer echoed our challenge")
        if dialed:  # the acceptor proves first: a dialer never hands a proof to an impostor
            _verify(io.recv_exact(_PROOF), key, them, ours, theirs)
            io.sendall(_proof(key, me, theirs, ours))
        else:
            io.sendall(_proof(key, me, theirs, ours))
            _verify(io.recv_exact(_PROOF), key, them, ours, theirs)
    except socket.timeout:
        raise AuthError(f"no authentication within {timeout_s:.3g} s") from None
    except OSError as e:
        raise AuthError(f"connection error during authentication: {e}") from None
    return FrameKeys.derive(key, *((ours, theirs) if dialed else (theirs, ours)), dialed=dialed)


def _verify(got: bytes, key: bytes, them: bytes, ours: bytes, theirs: bytes) -> None:
    if not hmac.compare_digest(got, _proof(key, them, ours, theirs)):
        raise AuthError("authentication failed: wrong or missing shared secret")
