"""Mutual challenge-response authentication of a control connection, before any frame.

Both ends prove they hold the deployment's shared secret without sending it: each sends
a fresh random nonce, then an HMAC-SHA256 over both nonces and its own role, and checks
the other's with a constant-time comparison. The role in the MAC stops a reflected proof
(an attacker echoing our own proof back); fresh nonces on both sides stop replays. Only
stdlib primitives (`secrets`, `hmac`, `hashlib`): no cryptography of our own.

Both messages have a fixed size, so nothing is length-prefixed and nothing is parsed
before authentication: an unauthenticated peer can make us read at most 69 bytes and
wait at most the handshake timeout.

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

from .errors import TransferError

SECRET_ENV = "SGLANG_DISAGG_SECRET"
SECRET_FILE_ENV = "SGLANG_DISAGG_SECRET_FILE"
MIN_SECRET_BYTES = 16
_MAGIC = b"SGDA"
_VERSION = 2  # 2: PING frames (heartbeats)
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


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise AuthError("connection closed during authentication (the peer may have refused our proof: "
                            "wrong or missing shared secret)")
        buf += chunk
    return bytes(buf)


def handshake(sock: socket.socket, secret: bytes | None, dialed: bool, timeout_s: float) -> None:
    """Authenticate both ends of `sock` within `timeout_s`; raises AuthError. The socket's
    timeout is left at `timeout_s` (the caller resets it once the peer is admitted)."""
    key = secret if secret is not None else _OPEN_KEY
    ours = secrets.token_bytes(_NONCE)
    me, them = (b"dialer", b"acceptor") if dialed else (b"acceptor", b"dialer")
    sock.settimeout(timeout_s)
    try:
        sock.sendall(_CHALLENGE.pack(_MAGIC, _VERSION, ours))
        magic, version, theirs = _CHALLENGE.unpack(_recv_exact(sock, _CHALLENGE.size))
        if magic != _MAGIC:
            raise AuthError("peer does not speak the sglang-disagg control protocol")
        if version != _VERSION:
            raise AuthError(f"peer's control protocol version {version}, this build speaks {_VERSION}")
        if theirs == ours:
            raise AuthError("peer echoed our challenge")
        if dialed:  # the acceptor proves first: a dialer never hands a proof to an impostor
            _verify(_recv_exact(sock, _PROOF), key, them, ours, theirs)
            sock.sendall(_proof(key, me, theirs, ours))
        else:
            sock.sendall(_proof(key, me, theirs, ours))
            _verify(_recv_exact(sock, _PROOF), key, them, ours, theirs)
    except socket.timeout:
        raise AuthError(f"no authentication within {timeout_s} s") from None
    except OSError as e:
        raise AuthError(f"connection error during authentication: {e}") from None


def _verify(got: bytes, key: bytes, them: bytes, ours: bytes, theirs: bytes) -> None:
    if not hmac.compare_digest(got, _proof(key, them, ours, theirs)):
        raise AuthError("authentication failed: wrong or missing shared secret")
