"""The HTTP keys of a deployment: which key opens which port, where each process gets it.

Which keys a node asks for is its Scope (scope()), from where its ports are bound and whether it
holds the deployment's secret:

- ALL: an HTTP port is reachable beyond this machine (a process binds an address that is not
  loopback: ``--host``, a deployment file, every rendering), or a router's workers are (it must
  present the key to them). Serving takes the API key, admin endpoints the admin key.
- ADMIN: every port on loopback, and the node holds the secret (``--role all``/``colocated``
  make one at start; a messenger server has one). Any user of this machine reaches loopback,
  so the admin endpoints (SGLang's, smg's /workers, /flush_cache, /get_loads) take the admin
  key, while serving stays keyless. Measured with smg 1.13 given only a control-plane key:
  /workers, /get_loads, /flush_cache 401 without it (and with a wrong one), 200/202 with it;
  /generate, /v1/chat/completions and /v1/models served without a key.
- NONE: loopback and no secret here (a server started on its own in upstream mode, given none).

Two keys, derived from the deployment's shared secret (secret.py), so every node derives the
same ones from what it already holds and nothing new is distributed; a new secret rotates them:

- the API key: clients present it to the router (``Authorization: Bearer KEY``), and the
  router to the SGLang servers. One key for both hops: smg 1.13 forwards the client's
  Authorization header on the serving path (measured: a tenant key of its own reached the
  worker as sent, and SGLang, which takes one --api-key, refused it). SGLang then asks it on
  every endpoint but /health* and /metrics (probes and scrapers need none).
- the admin key: SGLang's --admin-api-key (its admin endpoints: /flush_cache, weight updates,
  profiling...; once set they refuse the API key) and smg's control plane
  (--control-plane-api-keys: /workers, /flush_cache, /get_loads), which the API key does not open.

Never on a command line (any user reads /proc/*/cmdline): SGLang reads them from a YAML file
given with ``--config`` (0600, in the log dir), smg's router gets them in-process
(smg_router.py derives them from the secret), and the launcher writes ``api-key`` and
``admin-key`` (0600) in its log dir for clients and operators. A stopped stack removes all
three kinds (stack.py); they are derived, so the next start writes them again.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import os
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from sglang_disagg import private_files
from sglang_disagg.backends import auth
from sglang_disagg.launch.client import API_KEY_ENV  # noqa: F401 - what clients read (client.py)
from sglang_disagg.launch.config import LaunchConfig, Role

API_KEY_FILE = "api-key"
ADMIN_KEY_FILE = "admin-key"
ROUTER_ADMIN_ID = "sglang-disagg-admin"  # the control-plane key's id and name in smg's audit log
_LABEL = b"sglang-disagg http key v1|"


class KeysError(ValueError):
    """No secret to derive the keys from, or one that cannot be read."""


def is_loopback(host: str) -> bool:
    """Reachable from this machine only. 0.0.0.0 and :: are every interface: not loopback."""
    return host == "localhost" or host.startswith("127.") or host in ("::1", "[::1]")


class Scope(enum.Enum):
    """Which of the two keys a node's HTTP ports ask for (the module doc)."""

    NONE = "none"  # no key: loopback, no secret to derive one from
    ADMIN = "admin"  # the admin key on admin endpoints; serving keyless (loopback)
    ALL = "all"  # the API key on serving, the admin key on admin endpoints

    @property
    def api(self) -> bool:
        return self is Scope.ALL

    @property
    def admin(self) -> bool:
        return self is not Scope.NONE


def needed(cfg: LaunchConfig) -> bool:
    """Whether this node's HTTP ports (or, for a router, its workers') are reachable beyond this machine."""
    if not is_loopback(cfg.host):
        return True
    if cfg.role is not Role.ROUTER:
        return False
    urls = [u.partition("@")[0] for u in cfg.decode_urls + cfg.prefill_urls]
    return any(not is_loopback(urlsplit(u).hostname or "") for u in urls)


@dataclass(frozen=True)
class HttpKeys:
    """The deployment's two HTTP keys (hex). Left out of repr: a traceback or a log line
    showing the object must not show them."""

    api: str = field(repr=False)
    admin: str = field(repr=False)

    def __post_init__(self) -> None:
        for name, key in (("api", self.api), ("admin", self.admin)):
            if len(key) < 32 or any(c not in "0123456789abcdef" for c in key):
                raise ValueError(f"HttpKeys.{name}: expected at least 32 lowercase hex characters")
        if self.api == self.admin:
            raise ValueError("HttpKeys: the API key and the admin key must differ (the admin key opens more)")

    @classmethod
    def derive(cls, secret: bytes) -> HttpKeys:
        """HMAC-SHA256 of a fixed label per key under the secret: one-way, so a key says
        nothing about the secret (the messenger's) or about the other key."""
        def one(name: bytes) -> str:
            return hmac.new(secret, _LABEL + name, hashlib.sha256).hexdigest()
        return cls(api=one(b"api"), admin=one(b"admin"))

    def server_yaml(self, scope: Scope = Scope.ALL) -> str:
        """What SGLang's --config file holds: its keys in `scope` (ADMIN: the admin key only, so
        its serving endpoints stay open), nothing else (the rest stays on the command line,
        where an operator reads it)."""
        api = f'api-key: "{self.api}"\n' if scope.api else ""
        return api + (f'admin-api-key: "{self.admin}"\n' if scope.admin else "")

    def router_admin_entry(self) -> tuple[str, str, str, str]:
        """smg's control-plane key entry, as RouterArgs holds it: (id, name, key, role)."""
        return (ROUTER_ADMIN_ID, ROUTER_ADMIN_ID, self.admin, "admin")


def scope(cfg: LaunchConfig, environ: dict[str, str] | None = None) -> Scope:
    """ALL where a port reaches beyond this machine (needed), else ADMIN where the node holds the
    secret (--role all/colocated, which make one; its --secret-file; SGLANG_DISAGG_SECRET(_FILE)
    in the environment), else NONE."""
    if needed(cfg):
        return Scope.ALL
    env = os.environ if environ is None else environ
    made_here = cfg.role in (Role.ALL, Role.COLOCATED)  # one made at start if none given (secret.with_secret)
    held = made_here or cfg.secret_file or env.get(auth.SECRET_ENV) or env.get(auth.SECRET_FILE_ENV)
    return Scope.ADMIN if held else Scope.NONE


def load(cfg: LaunchConfig, environ: dict[str, str] | None = None) -> HttpKeys | None:
    """The keys `cfg` runs with (None: Scope.NONE), from its --secret-file or the environment's
    SGLANG_DISAGG_SECRET(_FILE); which of them its ports ask for is scope(cfg). Raises KeysError
    naming what is missing or unreadable."""
    if scope(cfg, environ) is Scope.NONE:
        return None
    return from_secret(cfg.secret_file, environ)


def from_secret(secret_file: str | None, environ: dict[str, str] | None = None) -> HttpKeys:
    env = dict(os.environ if environ is None else environ)
    if secret_file:
        env = {auth.SECRET_FILE_ENV: secret_file}
    try:
        secret = auth.load_secret(env)
    except auth.AuthError as e:
        raise KeysError(f"cannot derive the HTTP keys: {e}") from None
    if secret is None:
        raise KeysError(f"the HTTP keys derive from the deployment's shared secret: give --secret-file PATH or set "
                        f"{auth.SECRET_ENV} (or {auth.SECRET_FILE_ENV})")
    return HttpKeys.derive(secret)


def server_config(log_dir: Path, name: str) -> Path:
    """The YAML file a server's --config names (SGLang wants the .yaml suffix)."""
    return log_dir / f"{name}.keys.yaml"


def write(keys: HttpKeys, log_dir: Path, servers: list[str], scope: Scope = Scope.ALL) -> list[Path]:
    """The files of a node, each 0600 (private_files.py): the keys its ports ask for in `scope`
    (api-key for clients, admin-key for operators; ADMIN: admin-key only), and each server's
    --config file. Returns them: the stack removes them when it stops (stack.py)."""
    private_files.make_dir(log_dir)
    files = [(log_dir / API_KEY_FILE, keys.api + "\n")] if scope.api else []
    files += [(log_dir / ADMIN_KEY_FILE, keys.admin + "\n")] if scope.admin else []
    files += [(server_config(log_dir, name), keys.server_yaml(scope)) for name in servers]
    written: list[Path] = []
    try:
        for path, text in files:
            written.append(private_files.write(path, text))
    except BaseException:
        private_files.remove(written)  # all of them or none
        raise
    return written


def main(argv: list[str]) -> int:
    """``python -m sglang_disagg.launch key api|admin [--secret-file FILE]``: one key, derived from
    the secret (the file, else SGLANG_DISAGG_SECRET(_FILE)), on stdout: for a client on a machine
    that holds the secret but no launcher's log dir (a Kubernetes pod: ``kubectl exec``)."""
    import argparse
    import sys

    ap = argparse.ArgumentParser(prog="python -m sglang_disagg.launch key")
    ap.add_argument("which", choices=["api", "admin"])
    ap.add_argument("--secret-file", default=None)
    args = ap.parse_args(argv)
    try:
        http = from_secret(args.secret_file)
    except KeysError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(http.api if args.which == "api" else http.admin)
    return 0
