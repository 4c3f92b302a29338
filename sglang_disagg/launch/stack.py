"""A set of processes started, health-checked and stopped together.

``Stack.for_config(cfg)`` builds the processes a role needs on this machine:
``all`` = prefill + decode (started concurrently) and the router, smg (in
messenger mode started with them and given the decoder once it is healthy; upstream, in PD
mode, once both servers are); ``colocated`` / ``prefill`` / ``decode`` = one server; ``router`` = the
router in front of remote workers. ``start()`` returns once the front door
answers a real request, or raises ``StartupError`` with the failing process's
log tail; ``stop()`` (or leaving the ``with`` block) tears everything down and removes the
private files the stack wrote in its log dir: the HTTP key files, the servers' ``--config``
files holding keys, and the secret it made itself (a ``--secret-file`` it was given is kept).
A later ``start()`` writes them again. Logs and ``ports.txt`` stay.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from sglang_disagg import private_files
from sglang_disagg.launch.checks import check_cores
from sglang_disagg.launch.client import RequestError, generate_ids, post_json
from sglang_disagg.launch.commands import launcher_registered_workers, router_spec, server_spec
from sglang_disagg.launch.config import LaunchConfig, Mode, Role
from sglang_disagg.launch.preflight import check_cuda, check_patches_applied, check_ports_free
from sglang_disagg.messenger.links import REFUSED_MARK
from sglang_disagg.launch.ports import Listener, listening
from sglang_disagg.launch.secret import with_secret
from sglang_disagg.launch import keys, sharding
from sglang_disagg.launch.process import STOP_GRACE_S, ManagedProcess, StartupError, log_tail, stop_on_sigterm
from sglang_disagg.models import is_builtin, resolve_model_path

Progress = Callable[[str], None]
LINK_WAIT_S = 20.0


class Stack:
    def __init__(self, cfg: LaunchConfig, servers: list[ManagedProcess], router: ManagedProcess | None,
                 log_dir: Path, model_path: Path, http_keys: keys.HttpKeys | None = None,
                 private: dict[Path, str] | None = None, scope: keys.Scope | None = None) -> None:
        self.cfg = cfg
        self.keys = http_keys  # None: no secret here, no keys (keys.Scope.NONE)
        # Which of them the ports ask for (keys.py): on loopback the admin key only.
        self.scope = scope if scope is not None else keys.Scope.ALL if http_keys else keys.Scope.NONE
        self.servers = servers
        self.router = router
        self.log_dir = log_dir
        self.model_path = model_path
        self.startup_s: float | None = None
        self.phases: dict[str, float] = {}  # "<name> healthy", "routable": seconds since the last (re)start
        self._t0 = 0.0
        self._private = dict(private or {})  # files this stack wrote, with their text: stop() removes them

    @classmethod
    def for_config(cls, cfg: LaunchConfig) -> Stack:
        check_cores(cfg)
        if cfg.device == "cuda" and cfg.role is not Role.ROUTER and cfg.gpus is None:
            cfg = dataclasses.replace(cfg, gpus=check_cuda(cfg))  # refuses now if CUDA cannot run here
        log_dir = Path(cfg.log_dir) if cfg.log_dir else Path(tempfile.mkdtemp(prefix=f"sglang-disagg-{cfg.role.value}-"))
        private_files.make_dir(log_dir)
        given = cfg.secret_file
        cfg = with_secret(cfg, log_dir)
        made = [Path(cfg.secret_file)] if cfg.secret_file != given else []  # ours, not the user's: removed at stop
        try:
            scope = keys.scope(cfg)
            try:
                http_keys = keys.load(cfg)
            except keys.KeysError as e:
                raise ValueError(str(e)) from None
            model_path = Path()
            servers: list[ManagedProcess] = []
            if cfg.role is not Role.ROUTER:
                model_path = resolve_model_path(cfg.model)
                sharding.check_launch(cfg, model_path)
                builtin = is_builtin(cfg.model)
                roles = [Role.PREFILL, Role.DECODE] if cfg.role is Role.ALL else [cfg.role]
                servers = [ManagedProcess(server_spec(cfg, r, str(model_path), builtin, log_dir), log_dir)
                           for r in roles]
            router = ManagedProcess(router_spec(cfg), log_dir) if cfg.role in (Role.ALL, Role.ROUTER) else None
            if http_keys:
                made += keys.write(http_keys, log_dir, [p.spec.name for p in servers], scope)
            private = {p: p.read_text() for p in made}
        except BaseException:
            private_files.remove(made)  # refused: nothing of ours stays behind
            raise
        return cls(cfg, servers, router, log_dir, model_path, http_keys, private, scope)

    @property
    def processes(self) -> list[ManagedProcess]:
        return self.servers + ([self.router] if self.router else [])

    @property
    def url(self) -> str:
        front = self.router or self.servers[0]
        return front.url

    @property
    def api_key(self) -> str:
        """The key serving asks for ("" where it asks none: loopback, keys.Scope)."""
        return self.keys.api if self.keys and self.scope.api else ""

    @property
    def admin_key(self) -> str:
        """The key the admin endpoints ask for (SGLang's, the router's /workers): "" where none."""
        return self.keys.admin if self.keys and self.scope.admin else ""

    @property
    def client_kw(self) -> dict:
        """What a client of this stack's front door passes to client.py's calls: its API key
        ("" where there is none, so a caller's SGLANG_DISAGG_API_KEY is not sent), the TLS trust."""
        front = self.router or self.servers[0]
        return {"api_key": self.api_key, "tls": front.tls}

    @property
    def admin_kw(self) -> dict:
        """client_kw for an admin endpoint (a server's /flush_cache, the router's /workers): the admin key."""
        front = self.router or self.servers[0]
        return {"api_key": self.admin_key, "tls": front.tls}

    def start(self, progress: Progress | None = None) -> None:
        stop_on_sigterm()  # a script killed with SIGTERM still stops what it started
        for path, text in self._private.items():  # a stack started again after a stop
            if not path.exists():
                private_files.write(path, text)
        if self.cfg.role is not Role.ROUTER:
            check_patches_applied()
        check_ports_free(self.cfg)
        t0 = self._t0 = time.monotonic()
        self.phases = {}
        deadline = t0 + self.cfg.startup_timeout_s
        try:
            late = launcher_registered_workers(self.cfg)
            # Servers sharing a GPU start one after the other: each sizes its KV pool from the
            # memory free when it starts (gpu.py), so the second must see the first's pool.
            one_by_one = self.cfg.device == "cuda" and len(self.servers) > 1 and bool(self.cfg.gpu_plan().shared)
            for p in self.servers:
                p.start()
                if one_by_one:
                    self._wait([p], deadline, progress)
            if self.router and late:
                self.router.start()  # its start-up overlaps the servers'; they are added below
            if not one_by_one:
                self._wait(self.servers, deadline, progress)
            if self.cfg.role is Role.DECODE and self.cfg.mode is Mode.MESSENGER:
                self._wait_links(self.servers[0], min(deadline, time.monotonic() + LINK_WAIT_S), progress)
                if self.cfg.router_url:
                    self._join(progress)
            if self.router:
                if not late:
                    self.router.start()
                self._wait([self.router], deadline, progress)
                for url in late:
                    self._add_worker(url)
                self._wait_routable(deadline, progress)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0
        (self.log_dir / "ports.txt").write_text("".join(f"{x}\n" for x in self.listening()))

    def _phase(self, name: str) -> None:
        self.phases[name] = time.monotonic() - self._t0

    def _add_worker(self, url: str) -> None:
        try:
            # The router's control plane takes the admin key (the API key does not open it). The
            # worker's API key goes in the body: smg presents its own --api-key only to the
            # workers named on its command line, and to a worker added here the key its body
            # names, none without (measured: the decoder answered its discovery requests 401).
            body = {"url": url} | ({"api_key": self.api_key} if self.api_key else {})
            post_json(f"{self.router.url}/workers", body, timeout=10, api_key=self.admin_key, tls=self.router.tls)
        except (RequestError, OSError) as e:
            raise StartupError(f"the router on {self.router.url} did not take worker {url}: {e}\n"
                               + log_tail(self.router.log_path)) from None

    def _join(self, progress: Progress | None) -> None:
        """--router: this decoder joins the deployment's worker list (membership.py)."""
        from sglang_disagg.launch.membership import Membership, MembershipError

        try:
            added = Membership(self.cfg.router_url, self.admin_key).join(self.cfg.member, self.api_key)
        except MembershipError as e:
            raise StartupError(f"the router did not take this decoder ({self.cfg.member}): {e}") from None
        if progress:
            progress(f"{'joined' if added else 'already on'} the worker list of the router at {self.cfg.router_url} "
                     f"as {self.cfg.member}")

    def _wait(self, procs: list[ManagedProcess], deadline: float, progress: Progress | None) -> None:
        pending = list(procs)
        last_report = 0.0
        while pending:
            for p in list(pending):
                p.check_alive()
                if p.healthy():
                    pending.remove(p)
                    self._phase(f"{p.spec.name} healthy")
                    if progress:
                        progress(f"{p.spec.name} healthy on {p.url} after {time.monotonic() - p.started_at:.0f}s")
            now = time.monotonic()
            if pending and now > deadline:
                names = ", ".join(p.spec.name for p in pending)
                raise StartupError(f"timed out waiting for {names}; last lines of {pending[0].log_path}:\n"
                                   + log_tail(pending[0].log_path))
            if pending and progress and now - last_report >= 5:
                last_report = now
                progress("waiting for " + ", ".join(f"{p.spec.name} ({now - p.started_at:.0f}s)" for p in pending))
            if pending:
                time.sleep(0.25)

    def restart(self, name: str, progress: Progress | None = None) -> None:
        """Start one server of the stack again (after it died or was killed) and wait until it
        is healthy; a messenger decoder also until it linked to a prefill server again."""
        proc = next(p for p in self.servers if p.spec.name == name)
        proc.stop()
        stats = self.log_dir / f"{name}.messenger.json"
        stats.unlink(missing_ok=True)  # the dead run's counters must not answer for the new one
        self._t0, self.phases = time.monotonic(), {}
        proc.start()
        deadline = self._t0 + self.cfg.startup_timeout_s
        self._wait([proc], deadline, progress)
        if name == Role.DECODE.value and self.cfg.mode is Mode.MESSENGER:
            self._wait_links(proc, min(deadline, time.monotonic() + LINK_WAIT_S), progress)

    def _wait_links(self, decoder: ManagedProcess, deadline: float, progress: Progress | None) -> None:
        """A decoder's first contact with its prefill servers: a refusal (different model,
        incompatible KV layout) stops the start-up with the prefill server's reason; a
        prefill server that is not up yet is only reported (it may start later)."""
        links: dict = {}
        while time.monotonic() < deadline:
            decoder.check_alive()
            links = (self.messenger_stats("decode") or {}).get("links", {})
            states = {v["state"] for v in links.values()}
            if "ready" in states:
                if progress:
                    progress("decoder linked to " + ", ".join(a for a, v in links.items() if v["state"] == "ready"))
                return
            if links and states == {"refused"}:
                raise StartupError("the decoder cannot use its prefill server(s): " + "; ".join(
                    f"{a}: {v['reason']}" for a, v in links.items()))
            time.sleep(0.5)
        if progress:
            progress("no prefill server reachable yet (" + "; ".join(f"{a}: {v['reason']}" for a, v in links.items())
                     + "); requests wait for one")

    def _wait_routable(self, deadline: float, progress: Progress | None) -> None:
        """The router's /health is green before it has discovered its workers:
        only a real request proves the PD path (router -> prefill + decode) works."""
        last_err = ""
        while time.monotonic() < deadline:
            for p in self.processes:
                p.check_alive()
            try:
                # Two tokens: in messenger mode a 1-token prompt never leaves the decoder.
                generate_ids(self.url, [1, 2], 1, timeout=30, **self.client_kw)
                self._phase("routable")
                if progress:
                    progress(f"router routes requests on {self.url}")
                return
            except (RequestError, OSError) as e:
                last_err = str(e)
                if REFUSED_MARK in last_err:  # first contact refused: retrying cannot help
                    raise StartupError(f"the decoder cannot use its prefill server: {last_err}") from None
                time.sleep(0.25)
        raise StartupError(f"router on {self.url} never routed a request: {last_err}\n" + log_tail(self.router.log_path))

    def stop(self, drain_s: float = 0.0, hold: Callable[[], bool] | None = None) -> None:
        """Stop every process. With `drain_s`, first let the servers that hold clients'
        requests (decoders, a colocated server) finish what is in flight, for at most
        `drain_s` seconds, while the router and prefill servers still serve them; past that,
        while `hold()` says streams migrated away are still relayed here, for at most
        RELAYS_MAX_S more (launch/drain.py)."""
        if drain_s > 0 or hold is not None:
            from sglang_disagg.launch.drain import RELAYS_MAX_S

            front = [p for p in self.servers if p.spec.name in ("decode", "colocated")]
            start = time.monotonic()
            end = start + drain_s
            for p in front:
                p.drain()
            for p in front:
                while not p.wait_exit(end - time.monotonic()):
                    if hold is None or time.monotonic() > start + drain_s + RELAYS_MAX_S or not hold():
                        break
                    end = time.monotonic() + 1.0
        try:
            # All at once: one grace for the stack, not one per process.
            for p in reversed(self.processes):
                p.terminate()
            deadline = time.monotonic() + STOP_GRACE_S
            for p in reversed(self.processes):
                p.reap(deadline)
        finally:
            private_files.remove(list(self._private))

    @property
    def private_paths(self) -> list[Path]:
        """The secret and key files this stack wrote (and stop() removes)."""
        return list(self._private)

    def listening(self) -> list[Listener]:
        """Every socket this stack's processes listen on, each with what it is for."""
        named = {port: what for what, port in self.cfg.ports.all(self.cfg.role, self.cfg.mode).items()}
        address = (self.messenger_stats("decode") or {}).get("address", "")
        if address:
            named.setdefault(int(address.rsplit(":", 1)[1]), "decode messenger (transfer control, ephemeral)")
        return listening(named, {p.pid: p.spec.name for p in self.processes if p.pid})

    def messenger_stats(self, role: str = "decode", group: int = 0) -> dict | None:
        """The messenger's published counters for `role` (messenger mode), or None. A DP
        server's group g > 0 publishes its own (messenger/node.group_stats_file)."""
        name = f"{role}.messenger.json" if group == 0 else f"{role}.messenger.group{group}.json"
        try:
            return json.loads((self.log_dir / name).read_text())
        except (OSError, ValueError):
            return None

    def dead(self) -> list[ManagedProcess]:
        return [p for p in self.processes if p.poll() is not None]

    def __enter__(self) -> Stack:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
