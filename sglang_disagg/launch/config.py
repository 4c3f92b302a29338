"""What a launch is: roles, modes, transfer backends, ports, validated up front."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from enum import Enum

from sglang_disagg.launch import gpu
from sglang_disagg.launch.parallel import Parallel, flags as parallel_flags, problem as parallel_problem


class Role(str, Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    ROUTER = "router"
    ALL = "all"  # 1 prefill + 1 decode + the router (smg), on this machine
    COLOCATED = "colocated"  # one ordinary SGLang server: the A/B baseline


class Mode(str, Enum):
    """How prefill and decode cooperate."""

    MESSENGER = "messenger"  # ours: decoders drive prefill servers, KV through sglang_disagg.backends
    UPSTREAM = "upstream"    # SGLang's own PD path and connectors (the comparison baseline)


class UpstreamBackend(str, Enum):
    """SGLang's upstream PD transfer backends usable on CPU (--mode upstream)."""

    MOONCAKE = "mooncake"
    NIXL = "nixl"
    FAKE = "fake"  # decode only, no KV moves: for negative controls


class DrainMode(str, Enum):
    """What a decoder's launcher does with its running requests on SIGTERM."""

    WAIT = "wait"        # they finish here, within --drain-timeout (then everything stops)
    MIGRATE = "migrate"  # they move to the router's other decoders first (launch/drain.py)


MESSENGER_PROVIDERS = ("tcp",)  # libfabric providers that run on this kind of machine (shm: refused)
DEFAULT_BACKEND = {Mode.MESSENGER: "libfabric", Mode.UPSTREAM: UpstreamBackend.MOONCAKE.value}
SAME_HOST_BACKEND = "shmem"  # the messenger's default when every server is on this machine (--role all, CPU)
MESSENGER_PAGE_SIZE = 16  # tokens per KV page: one write moves a page's head-shard


@dataclass(frozen=True)
class Ports:
    """Every port a local stack binds, derived from the front door so that two
    stacks started with different ``--port`` never collide."""

    front: int

    @property
    def prefill(self) -> int:
        return self.front + 1

    @property
    def decode(self) -> int:
        return self.front + 2

    @property
    def bootstrap(self) -> int:
        """Upstream: the prefill bootstrap server. Messenger: the prefill messenger."""
        return self.front + 3

    @property
    def prefill_dist(self) -> int:
        return self.front + 4

    def attn_dp_base(self, role: Role) -> int:
        """An attention-DP server's internal ports (SGLang's ZMQ over TCP): 7 from here, in
        the ten after the stack's own (prefill and colocated) or the ten after those (decode)."""
        return self.front + (20 if role is Role.DECODE else 10)

    @property
    def decode_dist(self) -> int:
        return self.front + 5

    @property
    def colocated_dist(self) -> int:
        return self.front + 6

    @property
    def router_metrics(self) -> int:
        return self.front + 7

    @property
    def prefill_metrics(self) -> int:
        """Messenger mode: the prefill server's messenger metrics (Prometheus)."""
        return self.front + 8

    @property
    def decode_metrics(self) -> int:
        return self.front + 9

    def all(self, role: Role, mode: Mode = Mode.MESSENGER) -> dict[str, int]:
        if role is Role.COLOCATED:
            return {"colocated server": self.front, "colocated dist-init": self.colocated_dist}
        link = "prefill messenger" if mode is Mode.MESSENGER else "prefill bootstrap"
        ports = {
            "router": self.front,
            "prefill server": self.prefill,
            "decode server": self.decode,
            link: self.bootstrap,
            "prefill dist-init": self.prefill_dist,
            "decode dist-init": self.decode_dist,
            "router metrics": self.router_metrics,
        }
        if mode is Mode.MESSENGER:
            ports |= {"prefill metrics": self.prefill_metrics, "decode metrics": self.decode_metrics}
        keep = {
            Role.ALL: ports.keys(),
            Role.PREFILL: ("prefill server", link, "prefill dist-init", "prefill metrics"),
            Role.DECODE: ("decode server", "decode dist-init", "decode metrics"),
            Role.ROUTER: ("router", "router metrics"),
        }[role]
        return {k: v for k, v in ports.items() if k in keep}


@dataclass(frozen=True)
class LaunchConfig:
    role: Role
    model: str  # a built-in model name or a directory
    port: int = 30000
    host: str = "127.0.0.1"
    mode: Mode = Mode.MESSENGER
    backend: str | None = None  # None: shmem (messenger, --role all on CPU), libfabric (messenger), mooncake (upstream)
    provider: str | None = None  # libfabric provider; None: tcp
    rails: tuple[str, ...] = ()  # messenger data-path interfaces (names, or ("auto",)); (): one on --host
    device: str = "cpu"
    prefill_tp: int = 1
    decode_tp: int = 1
    # data parallelism per side (parallel.py): attention-DP groups inside the TP group, or
    # replicas of it; the colocated server takes the prefill values, as it takes prefill_tp
    prefill_attn_dp: int = 1
    decode_attn_dp: int = 1
    prefill_dp: int = 1
    decode_dp: int = 1
    dtype: str | None = None  # None: float32 for built-in models, SGLang's default otherwise
    max_total_tokens: int = 8192
    page_size: int | None = None  # None: 16 in messenger mode, SGLang's default upstream
    prefill_urls: tuple[str, ...] = ()  # router role (upstream): "http://host:port[@bootstrap_port]"
    decode_urls: tuple[str, ...] = ()
    prefill_messengers: tuple[str, ...] = ()  # decode role (messenger): "host:port" of prefill messengers
    extra_args: tuple[str, ...] = ()  # passed through to every SGLang server
    log_dir: str | None = None
    startup_timeout_s: float = 300.0
    pin_cores: bool = False  # --role all on CPU: pin prefill and decode servers to their own cores
    drain_timeout_s: float = 30.0  # SIGTERM: how long in-flight requests may take to finish
    drain_mode: DrainMode = DrainMode.WAIT
    # --role decode (messenger): the deployment's router, whose worker list this decoder joins at
    # start and leaves when it drains (membership.py), and the URL that list names it by
    router_url: str | None = None
    member_url: str | None = None  # None: http://--host:its port
    transfer_timeout_s: float = 60.0
    migration_rate_mb_s: float = 0.0  # decoder: cap on its outgoing live migrations, MB/s (0: none)
    link_recheck_s: float = 1.0  # messenger: first wait before a failing prefill server is tried again
    # router: seconds of upstream silence before smg puts an SSE comment (": ping") on a stream;
    # 0 sends none, as a colocated SGLang server sends none (its own benchmark client reads
    # every line as JSON and fails on one). Behind an idle-timeout proxy: set below its timeout.
    sse_keepalive_s: float = 0.0
    stream: bool = True  # messenger: write each layer's pages as the prefill forward passes it
    reuse_prefix: bool = True  # messenger: decoders send only what their radix cache lacks
    secret_file: str | None = None  # the deployment's shared secret (None: --role all makes one); keys.py
    # the router's front door over HTTPS (smg's --tls-cert-path/--tls-key-path, PEM files on its machine)
    tls_cert_path: str | None = None
    tls_key_path: str | None = None
    attention_backend: str | None = None  # None: torch_native on CPU, fa3 on CUDA with the messenger, else SGLang's
    deterministic: bool = False  # --enable-deterministic-inference on every server (equivalence runs)
    # --device cuda (gpu.py): the GPUs of this machine (None: detected), each server's, the share of a shared one
    gpus: int | None = None
    prefill_gpus: tuple[int, ...] = ()
    decode_gpus: tuple[int, ...] = ()
    shared_gpu_fraction: float = gpu.DEFAULT_SHARE
    env: tuple[tuple[str, str], ...] = field(default=())

    def __post_init__(self) -> None:
        if not 1024 <= self.port <= 65535 - 9:
            raise ValueError(f"--port {self.port}: must be in 1024..65526 (the stack uses port..port+9)")
        # Whether this machine has the cores for the TP sizes is not checked here: a deployment
        # file's node may be meant for another machine (checks.check_cores, at start).
        for side in (Role.PREFILL, Role.DECODE):
            reason = parallel_problem(self.parallel(side), parallel_flags(side.value))
            if reason:
                raise ValueError(reason)
        if not 0 <= self.sse_keepalive_s <= 86400:
            raise ValueError(f"--sse-keepalive-secs {self.sse_keepalive_s:g}: must be 0 (none) to 86400 seconds")
        if not 0 <= self.migration_rate_mb_s < float("inf"):
            raise ValueError(f"--migration-rate {self.migration_rate_mb_s:g}: must be 0 (no cap) or a positive MB/s")
        if self.max_total_tokens < 256:
            raise ValueError("--max-total-tokens must be >= 256")
        if self.page_size is not None and self.page_size < 1:
            raise ValueError(f"--page-size must be >= 1, got {self.page_size}")
        keyed = [a for a in self.extra_args if a.split("=", 1)[0] in ("--api-key", "--admin-api-key")]
        if keyed:
            raise ValueError(f"{keyed[0].split('=', 1)[0]}: a key on a command line is readable by any user of the "
                             f"machine; off loopback the launcher gives every server keys derived from the "
                             f"deployment's secret, through a file (keys.py)")
        if bool(self.tls_cert_path) != bool(self.tls_key_path):
            raise ValueError("--tls-cert-path and --tls-key-path come together: the router's certificate and its key")
        if self.tls_cert_path and self.role not in (Role.ALL, Role.ROUTER):
            raise ValueError(f"--tls-cert-path: TLS is the router's (--role all or router), not --role {self.role.value}")
        if self.mode is Mode.UPSTREAM:
            self._check_upstream()
        else:
            self._check_messenger()
        self._check_gpus()
        self._check_membership()

    def _check_gpus(self) -> None:
        if self.device != "cuda":
            given = [f for f, v in (("--gpus", self.gpus), ("--prefill-gpus", self.prefill_gpus),
                                    ("--decode-gpus", self.decode_gpus)) if v]
            if given:
                raise ValueError(f"{', '.join(given)}: GPU placement applies to --device cuda, not {self.device}")
            return
        if self.gpus is not None:
            if self.gpus < 1:
                raise ValueError(f"--gpus must be >= 1, got {self.gpus}")
            self.gpu_plan()  # the placement's own checks, now rather than at start
        if self.mode is Mode.MESSENGER and self.role is not Role.COLOCATED:
            problem = gpu.attention_problem(gpu.attention_backends(self.attention_backend, self.extra_args),
                                            self.deterministic, self.dtype)
            if problem:
                raise ValueError(problem)

    def parallel(self, role: Role) -> Parallel:
        """The parallel shape of the `role` server (the colocated server's: the prefill flags)."""
        if role is Role.DECODE:
            return Parallel(self.decode_tp, self.decode_attn_dp, self.decode_dp)
        return Parallel(self.prefill_tp, self.prefill_attn_dp, self.prefill_dp)

    @property
    def server_roles(self) -> tuple[Role, ...]:
        """The servers this launch starts on its machine."""
        return {Role.ALL: (Role.PREFILL, Role.DECODE), Role.ROUTER: ()}.get(self.role, (self.role,))

    def gpu_plan(self) -> gpu.GpuPlan:
        """Which GPUs this machine's servers run on (--device cuda, with the GPU count known)."""
        if self.gpus is None:
            raise ValueError("the number of GPUs is not known: pass --gpus N")
        roles = self.server_roles
        prefill = next((r for r in roles if r is not Role.DECODE), None)  # the colocated server's too
        tps = (self.prefill_tp if prefill else None, self.decode_tp if Role.DECODE in roles else None)
        # replica DP: SGLang puts replica d's rank r on GPU base + (d * tp + r) * step (gpu.py)
        return gpu.plan(self.gpus, *tps, prefill_gpus=self.prefill_gpus, decode_gpus=self.decode_gpus,
                        share=self.shared_gpu_fraction, prefill_dp=self.prefill_dp, decode_dp=self.decode_dp)

    @property
    def cuda_attention_backend(self) -> str | None:
        """What --attention-backend the servers get on CUDA: the messenger's KV pool is HND,
        which fa3 reads; without the messenger SGLang chooses."""
        if self.attention_backend or self.mode is not Mode.MESSENGER or self.role is Role.COLOCATED:
            return self.attention_backend
        return gpu.DEFAULT_CUDA_BACKEND

    def _check_rails(self) -> None:
        from sglang_disagg.rails.choose import check_names

        object.__setattr__(self, "rails", check_names(self.rails))
        if self.rails and self.transfer_backend not in ("libfabric", "nixl"):
            raise ValueError(f"--rails: backend {self.transfer_backend} takes no interface list (libfabric opens "
                             "an endpoint per rail, nixl hands them to UCX; Mooncake's tcp transport sends "
                             "through the route to the peer; shmem stays on one host): docs/backends.md, Rails")

    def _check_upstream(self) -> None:
        values = [b.value for b in UpstreamBackend]
        if self.transfer_backend not in values:
            raise ValueError(f"--backend {self.transfer_backend!r}: upstream mode takes {', '.join(values)}")
        if self.provider is not None:
            raise ValueError("--provider applies to the messenger's libfabric backend, not to upstream mode")
        if self.transfer_backend == UpstreamBackend.FAKE.value and self.role is not Role.DECODE:
            raise ValueError("--backend fake only works for --role decode (SGLang refuses it on prefill)")
        if self.role is Role.ROUTER and not (self.prefill_urls and self.decode_urls):
            raise ValueError("--role router in upstream mode needs at least one --prefill-url and one --decode-url")

    def _check_messenger(self) -> None:
        from sglang_disagg.backends import list_backends

        known = list_backends()
        if self.transfer_backend not in known:
            raise ValueError(f"--backend {self.transfer_backend!r}: the messenger's transfer backends are "
                             f"{', '.join(known)}")
        if self.provider == "shm":
            from sglang_disagg.backends.libfabric import SHM_REFUSED

            raise ValueError(f"--provider shm: {SHM_REFUSED}")
        if self.provider is not None and self.transfer_backend != "libfabric":
            raise ValueError(f"--provider is a libfabric setting; backend {self.transfer_backend} has none")
        if self.provider is not None and self.provider not in MESSENGER_PROVIDERS + ("efa", "verbs", "net"):
            raise ValueError(f"--provider {self.provider!r}: choose tcp (or efa/verbs on such hardware)")
        self._check_rails()
        if self.role is Role.ROUTER and not self.decode_urls:
            raise ValueError("--role router in messenger mode needs at least one --decode-url (decoders "
                             "reach prefill servers themselves)")
        if self.role is Role.DECODE and not self.prefill_messengers:
            raise ValueError("--role decode in messenger mode needs at least one --prefill-messenger host:port")
        if self.role is not Role.COLOCATED:
            from sglang_disagg.messenger import speculative
            from sglang_disagg.messenger.dp import support as dataparallel

            speculative.check_argv(self.extra_args)
            dataparallel.check_argv(self.extra_args)
            for role in self.server_roles if self.device != "cpu" else ():  # as every server refuses it
                p = self.parallel(role)
                _, attn, dp = parallel_flags("decode" if role is Role.DECODE else "prefill")
                if p.attn_dp > 1 or p.dp > 1:
                    asked = f"{attn} {p.attn_dp}" if p.attn_dp > 1 else f"{dp} {p.dp}"
                    raise ValueError(f"{asked} on --device {self.device}: {dataparallel.NOT_ON_DEVICE}")

    def _check_membership(self) -> None:
        from sglang_disagg.launch.membership import normal

        given = [f for f, v in (("--router", self.router_url), ("--member-url", self.member_url),
                                ("--drain-mode migrate", self.drain_mode is DrainMode.MIGRATE)) if v]
        if given and (self.role is not Role.DECODE or self.mode is not Mode.MESSENGER):
            raise ValueError(f"{given[0]}: a messenger decoder's (--role decode), the member of a router's "
                             f"worker list that migrates to the others")
        if self.drain_mode is DrainMode.MIGRATE and not self.router_url:
            raise ValueError("--drain-mode migrate needs --router URL: the decoders to migrate to are its others")
        for flag, url in (("--router", self.router_url), ("--member-url", self.member_url)):
            if url:
                try:
                    normal(url)
                except ValueError as e:
                    raise ValueError(f"{flag}: {e}") from None

    @property
    def member(self) -> str:
        """This decoder's URL in the router's worker list."""
        return self.member_url or f"http://{self.host}:{self.ports.decode}"

    @property
    def served_model_name(self) -> str:
        """What /v1/models calls the model, and what OpenAI clients must send as "model":
        a built-in model's name, a directory's last component, or --served-model-name."""
        args = list(self.extra_args)
        for i, a in enumerate(args):
            if a == "--served-model-name" and i + 1 < len(args):
                return args[i + 1]
            if a.startswith("--served-model-name="):
                return a.split("=", 1)[1]
        return os.path.basename(self.model.rstrip("/")) or self.model

    @property
    def ports(self) -> Ports:
        return Ports(self.port)

    @property
    def transfer_backend(self) -> str:
        """--backend, else: every server on this machine (--role all on CPU, no --provider) shmem;
        libfabric (tcp) across machines and on CUDA; upstream mooncake."""
        if self.backend:
            return self.backend
        if self.mode is Mode.MESSENGER and self.role is Role.ALL and self.device == "cpu" and self.provider is None:
            return SAME_HOST_BACKEND
        return DEFAULT_BACKEND[self.mode]

    @property
    def transfer_provider(self) -> str | None:
        if self.transfer_backend != "libfabric" or self.mode is not Mode.MESSENGER:
            return None
        return self.provider or "tcp"

    @property
    def kv_page_size(self) -> int | None:
        if self.page_size is not None:
            return self.page_size
        return MESSENGER_PAGE_SIZE if self.mode is Mode.MESSENGER else None

    def describe_transfer(self) -> str:
        if self.role is Role.COLOCATED:
            return "colocated (no transfer)"
        provider = self.transfer_provider
        return f"mode {self.mode.value}, backend {self.transfer_backend}" + (f"/{provider}" if provider else "")
