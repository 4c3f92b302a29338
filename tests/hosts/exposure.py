"""Exposure across hosts: every port of every node, probed from a host that is no part of the deployment.

``check(dep, net, outsider, reference)`` runs at the end of a cross-host test while its deployment
is up. It reads what each node listens on from the kernel inside the node's host (``ss``: TCP and
UDP, the owning process; the launcher's name for the port from ports.txt in the node's log dir),
then, from the outsider host (no secret, nothing of the deployment), dials each port and tries what
an attacker on the same network would:

- SGLang HTTP servers and the router: without a key, then with the API key a client holds
  (http_keys.py): promised that every endpoint but /health asks a key, the admin endpoints and the
  router's control plane take the admin key only, the router serves its API key, no answer holds
  a key; metrics endpoints: /metrics, no key asked (Prometheus), nothing promised.
- messenger control ports: the fuzz payloads of tests/e2e/test_fuzz.py, each closed within CLOSE_S,
  and a real backend holding a wrong secret, refused. Promised: they refuse an unauthenticated peer.
- every other port it reaches (the transfer libraries' listeners): garbage bytes and the library's
  own protocol (outsider.py), harmless against the live stack, full strength against a canary
  listener of the same backend started in the router's host. Promised: no read or write of
  registered memory without the secret.
- loopback-bound ports: promised unreachable.

Afterwards the stack must still serve the reference prompts token-exact from the router's host,
hold no KV page beyond its radix caches, and have lost no node; and neither HTTP key nor the
secret may show on any process's command line on the machine or in the nodes' logs. Each port gets a Row, printed as
``exposure | node | address:port | purpose | from outside | without the secret``. ``check`` asserts
every promise (all broken ones in one AssertionError, after every row is printed); ``probe`` returns
the rows and the broken promises without asserting.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from e2e.conftest import assert_same
from e2e.faultlib import wait_released
from e2e.test_fuzz import PAYLOADS, _hostile
from harness.hosts import inside
from harness.hosts.deployment import Deployment
from harness.hosts.netns import Network
from sglang_disagg.launch.config import Ports

from . import http_keys
from .conftest import ask

OUTSIDER = Path(__file__).with_name("outsider.py")
SS_LINE = re.compile(r"^(?P<proto>tcp|udp)\s+\S+\s+\d+\s+\d+\s+(?P<local>\S+):(?P<port>\d+)\s+\S+\s*(?P<users>.*)$")
USERS = re.compile(r'\("(?P<comm>[^"]+)",pid=(?P<pid>\d+)')
CLOSE_S = 2.5  # a messenger port hangs up on a hostile peer within this (as tests/e2e/test_fuzz.py)
REFUSED = re.compile("shared secret|refused our proof")
# what outsider.py's live attempt says a listener is -> its name in the rows
KINDS = {"libfabric tcp;ofi_rxm": "libfabric tcp;ofi_rxm endpoint", "UCT tcp": "UCX tcp interface (NIXL)",
         "Mooncake handshake": "Mooncake handshake (P2P metadata)", "Mooncake TCP data": "Mooncake TCP transport"}


@dataclass(frozen=True)
class Listener:
    node: str
    host: str       # the host's address (what the outsider dials)
    proto: str
    bound: str      # the address the socket is bound to
    port: int
    process: str
    purpose: str    # the launcher's name for it ("" when ports.txt does not list it)


@dataclass(frozen=True)
class Row:
    node: str
    bound: str            # loopback, the host's address, or every interface (0.0.0.0 / *)
    port: int
    purpose: str
    outside: str          # accepted / refused / timed out
    without_secret: str   # what the outsider could do
    promise: str = ""     # what must hold for this port ("" where nothing is promised)
    ok: bool = True

    def __str__(self) -> str:
        return (f"exposure | {self.node} | {self.bound}:{self.port} | {self.purpose} | {self.outside} | "
                f"{self.without_secret}")


def listeners(dep: Deployment) -> list[Listener]:
    """Every TCP/UDP socket each node's host listens on, read from the kernel there."""
    out = []
    for node in dep.nodes.values():
        ports, named = dep.root / node.name / "ports.txt", {}
        for line in ports.read_text().splitlines() if ports.exists() else []:
            where, _, what = line.partition("  ")
            named[int(where.rsplit(":", 1)[1])] = what.split(": ", 1)[-1]
        r = node.host.run(["ss", "-Hlntup"], timeout=10)
        assert r.returncode == 0, f"ss in {node.host.name}: {r.stderr}"
        for m in filter(None, (SS_LINE.match(line.strip()) for line in r.stdout.splitlines())):
            users = USERS.search(m["users"])
            process = f"{users['comm']} (pid {users['pid']})" if users else "?"
            out.append(Listener(node.name, node.host.address, m["proto"], m["local"].strip("[]"), int(m["port"]),
                                process, named.get(int(m["port"]), "")))
    return sorted(out, key=lambda x: (x.node, x.port))


def _dial(x: Listener) -> str:
    if x.proto == "udp":  # a datagram: the kernel answers a closed port with ICMP (ECONNREFUSED)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.settimeout(1.0)
            s.connect((x.host, x.port))
            try:
                s.send(b"\0")
                s.recv(1)
                return "accepted (answered)"
            except ConnectionRefusedError:
                return "refused"
            except socket.timeout:
                return "accepted (no answer)"
    try:
        socket.create_connection((x.host, x.port), timeout=1.5).close()
        return "accepted"
    except ConnectionRefusedError:
        return "refused"
    except socket.timeout:
        return "timed out"
    except OSError as e:
        return f"error: {e}"


def _ports(host, snapshot: set[str] | None = None) -> set[str]:
    """Listening TCP addresses in `host` (new ones only, given an earlier snapshot)."""
    now = {line.split()[3] for line in host.run(["ss", "-Hltn"]).stdout.splitlines() if line.strip()}
    return now - (snapshot or set())


def _canary_verdict(backend: str, got: dict, landed: dict, rc: int | None) -> tuple[str, bool]:
    """What the full-strength attempt at the canary did, and whether registered memory stayed private."""
    if "listener" not in got:
        return f"canary: the attempt reached no listener of the canary ({got}): nothing was tested", False
    text = f"canary {got['listener']}: "
    if backend == "libfabric":
        keys = got['keys_given_by_canary']
        kind = "sequential" if all(b - a == 1 for a, b in zip(keys, keys[1:])) else "not sequential"
        text += (f"keys {keys} ({kind}; addresses are offsets from 0); fi_writedata with guessed key 1 "
                 f"and 2: {got['write_key1']}, {got['write_key2']}")
    elif backend == "nixl":
        text += (f"raw UCT PUT_REQ (no rkey) into a registered buffer (PUT_ACK sn {got['put_registered']}) and into "
                 f"unregistered heap memory (PUT_ACK sn {got['put_unregistered']}); a PUT at 0x10: the process "
                 + ("died (SIGSEGV)" if rc in (139, -11) else f"exit status {rc}"))
    else:
        text += (f"handshake served its buffer {got['first_buffer']:#x}; write rc {got['write_registered']}; "
                 f"write outside registered memory: engine rc {got['write_unregistered_engine']}, raw "
                 f"{got.get('write_unregistered_raw')}; forged TransferNotify rc {got['forged_notify']}")
    if not landed:
        return text + " -> the canary reported nothing", False
    text += (f" -> {landed['registered']} B landed in registered memory, {landed['unregistered']} B in "
             "unregistered memory")
    if backend != "nixl":  # NIXL's notifications travel in UCP active messages: not forged here
        text += f", forged completion notice {'accepted' if landed['forged_completion'] else 'refused'}"
    return text, not (landed["registered"] or landed["unregistered"] or landed["forged_completion"])


def _outsider(dep: Deployment, net: Network, outsider: str, cfg: dict, control: list[Listener],
              data: list[Listener]) -> tuple[dict, dict, int | None]:
    """A canary in the router's host, then outsider.py probe in the outsider host, aimed at the live
    listeners and at the canary's (found as new ports in its host); its answer, what landed in the
    canary, and the canary's exit status."""
    host, d = net[dep.layout.router], dep.root / "canary"
    shutil.rmtree(d, ignore_errors=True)  # a second check on the same deployment starts afresh
    d.mkdir()
    before = _ports(host)
    canary = host.popen([sys.executable, str(OUTSIDER), "canary", cfg["backend"], cfg.get("provider") or "-",
                         host.address, str(d)], d / "canary.out")
    deadline = time.monotonic() + 60
    while not (d / "canary.json").exists():
        assert canary.poll() is None and time.monotonic() < deadline, \
            "the canary did not come up:\n" + (d / "canary.out").read_text()[-2000:]
        time.sleep(0.05)
    ports = [f"{host.address}:{a.rsplit(':', 1)[1]}" for a in sorted(_ports(host, before)) if not a.startswith("127.")]
    job = {"own": net[outsider].address, "backend": cfg["backend"], "provider": cfg.get("provider"),
           "control": [f"{x.host}:{x.port}" for x in control],
           "data": [{"node": x.node, "address": f"{x.host}:{x.port}"} for x in data],
           "canary": {"dir": str(d), "ports": ports}}
    (d / "job.json").write_text(json.dumps(job))
    r = net[outsider].run([sys.executable, str(OUTSIDER), "probe", str(d / "job.json")], timeout=120)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert r.returncode == 0 and lines, \
        f"outsider probe failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    try:
        rc = canary.wait(15)
    except subprocess.TimeoutExpired:
        canary.kill()
        rc = None
    landed = json.loads((d / "landed.json").read_text()) if (d / "landed.json").exists() else {}
    return json.loads(lines[-1]), landed, rc


def _row(x: Listener, reach: str, cfg: dict, res: dict, said: dict, fuzz: dict, canary: tuple[str, bool],
         shared: list[Listener] = ()) -> Row:
    address, name = f"{x.host}:{x.port}", (x.purpose or "not in the launcher's list") + f" [{x.process}]"
    row = lambda what, promise="", ok=True: Row(x.node, x.bound, x.port, name, reach, what, promise, ok)  # noqa: E731
    if x.bound.startswith("127.") or x.bound == "::1":
        # The outsider dials the host's address: a socket bound there (or to every address) on
        # the same port number is what answers, not this one (seen in CI: libfabric's ephemeral
        # endpoint took 10.77.0.2:45583 while an SGLang socket held 127.0.0.1:45583).
        other = next((y for y in shared if (y.node, y.proto, y.port) == (x.node, x.proto, x.port)
                      and not (y.bound.startswith("127.") or y.bound == "::1")), None)
        if other is not None:
            return row(f"nothing: bound to loopback (its port number is also bound on {other.bound}, which the "
                       f"dial reached: that socket has its own row)")
        return row("nothing: bound to loopback", "unreachable from another host", not reach.startswith("accepted"))
    if not reach.startswith("accepted"):
        return row("nothing: no connection")
    if x in fuzz:
        refusal = res["wrong_secret"].get(address, "not tried")
        return row(f"{len(PAYLOADS)} fuzz payloads, each closed in <= {max(fuzz[x]):.2f}s; a {cfg['backend']} backend "
                   f"with a wrong secret: {refusal}", "refuses an unauthenticated peer",
                   max(fuzz[x]) < CLOSE_S and bool(REFUSED.search(refusal)))
    if x in said:
        return row(*said[x])
    live = res["attempt"].get(address, "")
    kind = next((v for k, v in KINDS.items() if live.startswith(k)), "")
    unlisted = "" if x.purpose else " (not in the launcher's list)"
    name = f"{kind or 'unidentified'}{unlisted} [{x.process}]"
    what = f"garbage: {', '.join(res['garbage'].get(address, []))}; live: {live}"
    if not kind:
        return row(what)
    live_read = "(read" in live or "answered 8 B" in live  # Mooncake: the live stack's registered KV
    return row(f"{what}; {canary[0]}", "no read or write of registered memory", canary[1] and not live_read)


def probe(dep: Deployment, net: Network, outsider: str,
          reference: tuple[list[list[int]], list[list[int]]]) -> tuple[list[Row], list[str]]:
    """Rows, one per port, and the promises that failed (see the module docstring)."""
    t0, out = time.monotonic(), net[outsider]
    cfg = tomllib.loads(dep.file.read_text())["deployment"]
    found = listeners(dep)
    with ThreadPoolExecutor(16) as pool:
        reach = dict(zip(found, pool.map(lambda x: inside.call(out, _dial, x), found)))
    accepted = [x for x in found if reach[x].startswith("accepted")]
    control = [x for x in accepted if "messenger" in x.purpose]
    http = [x for x in accepted if x.purpose and x not in control and not x.purpose.startswith("internal")]
    data = [x for x in accepted if x not in control and x not in http]
    # Everything at once: a payload shorter than a handshake costs a full timeout (2 s on a
    # messenger port, 5 s on HTTP). The metrics ports get the payloads too, as in the e2e test.
    hostile = [(x, p) for x in control + [y for y in http if "metrics" in y.purpose] for p in PAYLOADS]
    with ThreadPoolExecutor(len(http) + len(hostile) + 1) as pool:
        attempts = pool.submit(_outsider, dep, net, outsider, cfg, control, data)
        api = http_keys.client_key(dep)
        said = {x: pool.submit(inside.call, out, http_keys.row, x.host, x.port, x.purpose, api, dep.keys.admin)
                for x in http}
        took = {xp: pool.submit(inside.call, out, _hostile, f"{xp[0].host}:{xp[0].port}", xp[1]) for xp in hostile}
        res, landed, rc = attempts.result()
        said = {x: f.result() for x, f in said.items()}
        fuzz = {x: [took[(x, p)].result() for p in PAYLOADS] for x in control}
    canary = _canary_verdict(cfg["backend"], res.get("canary", {}), landed, rc)
    rows = [_row(x, reach[x], cfg, res, said, fuzz, canary, found) for x in found]
    failed = [f"{r.node} {r.bound}:{r.port} {r.purpose}: {r.promise}: {r.without_secret}" for r in rows if not r.ok]
    probes_s = time.monotonic() - t0

    prompts, expected = reference
    try:
        assert_same(ask(dep, prompts)["outputs"], expected, prompts)
    except AssertionError as e:
        failed.append(f"after the probes the stack no longer serves token-exact: {e}")
    ports = Ports(dep.port)
    for host, port in [(net[h].address, ports.prefill_metrics) for h in dep.layout.prefill] + \
                      [(net[dep.layout.decode].address, ports.decode_metrics)]:
        _, leaked = inside.call(net[dep.layout.router], wait_released, host, port, time.monotonic(), 5.0)
        if leaked:
            failed.append(f"{host}:{port}: {leaked:g} KV pages held by no request after the probes")
    dead = [n.name for n in dep.nodes.values() if n.proc.poll() is not None]
    if dead:
        failed.append(f"nodes that exited during the probes: {dead}")
    cmdlines, shown = http_keys.visible(dep)
    failed += [f"a key where others read it: {s}" for s in shown]
    where = f"in {len(shown)} place(s)" if shown else f"in none of {cmdlines} command lines and the nodes' logs"
    print(f"\nexposure | {cfg['backend']} | {len(found)} ports, {len(accepted)} reachable from {outsider} | probes "
          f"{probes_s:.1f}s, then token-exact and pages {time.monotonic() - t0 - probes_s:.1f}s | keys and secret "
          f"{where}", flush=True)
    for r in rows:
        print(r, flush=True)
    return rows, failed


def check(dep: Deployment, net: Network, outsider: str,
          reference: tuple[list[list[int]], list[list[int]]]) -> list[Row]:
    """probe(), then assert every promise; returns the rows."""
    rows, failed = probe(dep, net, outsider, reference)
    assert not failed, f"{len(failed)} exposure promise(s) broken:\n" + "\n".join(failed)
    return rows
