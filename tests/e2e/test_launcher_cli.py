"""The launcher as a user runs it: `--role all --smoke`, and its start-up errors."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from sglang_disagg.launch.client import generate_ids

from .conftest import _ports

pytestmark = pytest.mark.e2e


def _launch(*args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sglang_disagg.launch", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_role_all_smoke_runs_through_the_messenger_by_default(tmp_path):
    """The default: the real model smollm2-135m, disaggregated, answers a factual question
    in English (weights, tokenizer and chat template survived the conversion and the KV
    the transfer)."""
    r = _launch("--role", "all", "--smoke", "--port", str(next(_ports)), "--log-dir", str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "router routes requests" in r.stdout
    assert "with model" in r.stdout and "smollm2-135m-" in r.stdout
    lines = r.stdout.splitlines()
    asked = next(i for i, line in enumerate(lines) if "asked 'What is the capital of France?'" in line)
    assert lines[asked + 1].strip() == "The capital of France is Paris.", lines[asked:asked + 2]
    # The launcher says which mode and backend carried the request, from the decoder's counters.
    carried = next(line for line in r.stdout.splitlines() if "carried by:" in line)
    assert "mode messenger, backend shmem:" in carried  # every server on this host: shmem
    assert "0 request(s)" not in carried and "KV writes received" in carried
    # The router talks to the decoder only; the prefill server got work from its messenger.
    decode_log = (tmp_path / "decode.log").read_text(errors="replace")
    prefill_log = (tmp_path / "prefill.log").read_text(errors="replace")
    assert '"POST /v1/chat/completions HTTP/1.1" 200' in decode_log
    assert "/v1/chat/completions" not in prefill_log
    assert "Prefill batch" in prefill_log
    # Every port the stack opened is listed with its purpose.
    assert "prefill messenger" in r.stdout and "decode server" in r.stdout
    # On loopback serving asks no key, the admin endpoints the admin key, and the launcher says so.
    assert "HTTP keys: admin only; every HTTP port is bound to 127.0.0.1 (loopback)" in r.stdout
    assert f"take the admin key in {tmp_path}/admin-key" in r.stdout


def _this_machines_address() -> str:
    import psutil

    found = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
             if a.family == socket.AF_INET and not a.address.startswith("127.")]
    assert found, "this test binds a non-loopback address: the machine has none (psutil.net_if_addrs)"
    return found[0]


def _serving(*args: str) -> tuple[subprocess.Popen, list[str], threading.Thread]:
    """The launcher started with `args` and serving (its "serving on" line printed): the process,
    its output lines so far (a thread keeps reading them) and that thread."""
    proc = subprocess.Popen([sys.executable, "-m", "sglang_disagg.launch", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + 300
    while not any("serving on" in line for line in out):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail("the launcher did not come up:\n" + "".join(out))
        time.sleep(0.5)
    return proc, out, reader


def _status(method: str, url: str, body: dict | None = None, key: str | None = None) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={
        "Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def test_role_all_off_loopback_asks_keys_and_says_where_a_client_finds_its_own(tmp_path):
    """Bound to an address other machines reach, the same stack asks every HTTP request for a
    key: without one or with a wrong one /generate and /v1/chat/completions are refused (401),
    at the router and at the decode server; the API key serves, but does not open the router's
    control plane, which the admin key does. The launcher's own requests (adding the decoder
    to the router, the routability check) present the keys, and it says where a client finds
    the API key; stopped, it removes the key files it wrote."""
    from sglang_disagg.backends import auth
    from sglang_disagg.launch import keys

    host, port = _this_machines_address(), next(_ports)
    secret = tmp_path / "given-secret"  # given, so the key is known here after the stack removed its files
    secret.write_text(auth.new_secret() + "\n")
    secret.chmod(0o600)
    logs = tmp_path / "logs"
    proc, out, reader = _serving("--role", "all", "--host", host, "--port", str(port), "--log-dir", str(logs),
                                 "--secret-file", str(secret))
    try:
        api, admin = (logs / "api-key").read_text().strip(), (logs / "admin-key").read_text().strip()
        derived = keys.HttpKeys.derive(auth.load_secret({auth.SECRET_FILE_ENV: str(secret)}))
        assert (api, admin) == (derived.api, derived.admin) and len(api) == 64
        router, decode = f"http://{host}:{port}", f"http://{host}:{port + 2}"
        status, text = _status("GET", f"{router}/v1/models", key=api)
        assert status == 200, text
        model = json.loads(text)["data"][0]["id"]
        gen = {"input_ids": [1, 9, 42], "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}}
        ask = {"model": model, "messages": [{"role": "user", "content": "What is the capital of France?"}],
               "max_tokens": 32, "temperature": 0.0}
        refused = {(path, where, key): _status("POST", f"{url}{path}", body, key)[0]
                   for path, body in (("/generate", gen), ("/v1/chat/completions", ask))
                   for where, url in (("router", router), ("decode", decode))
                   for key in (None, "wrong-" + api[6:])}
        assert set(refused.values()) == {401}, refused
        status, text = _status("POST", f"{router}/v1/chat/completions", ask, api)
        assert status == 200 and "Paris" in json.loads(text)["choices"][0]["message"]["content"], text
        assert _status("POST", f"{router}/generate", gen, api)[0] == 200
        assert _status("GET", f"{router}/workers", key=api)[0] == 401  # serving key, not the control plane
        status, text = _status("GET", f"{router}/workers", key=admin)
        assert status == 200 and decode in text, text
    finally:
        proc.send_signal(signal.SIGINT)  # Ctrl-C: stop now
        rc = proc.wait(60)
        reader.join(10)
    text = "".join(out)
    assert rc == 130, text
    assert "HTTP keys: on (HTTP ports of this deployment reach beyond this machine)" in text
    assert f"export SGLANG_DISAGG_API_KEY=$(cat {logs}/api-key)" in text
    assert api not in text and admin not in text
    # Stopped, the stack removed the key files it wrote and kept the secret it was given.
    assert not (logs / "api-key").exists() and not (logs / "admin-key").exists() and secret.exists()


def test_upstream_mode_smoke(tmp_path):
    r = _launch("--role", "all", "--mode", "upstream", "--smoke", "--model-path", "tiny-llama",
                "--port", str(next(_ports)), "--log-dir", str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "carried by: mode upstream, backend mooncake" in r.stdout
    # SGLang's own PD path: the router sent the chat request to both servers.
    for role in ("prefill", "decode"):
        log = (tmp_path / f"{role}.log").read_text(errors="replace")
        assert '"POST /v1/chat/completions HTTP/1.1" 200' in log, f"{role} never served the completion"


def test_server_dying_during_startup_shows_its_log(tmp_path):
    r = _launch("--role", "colocated", "--model-path", "tiny-llama", "--port", str(next(_ports)),
                "--log-dir", str(tmp_path), "--attention-backend", "no-such-backend", timeout=120)
    assert r.returncode == 1
    assert "colocated exited with code" in r.stderr
    assert "no-such-backend" in r.stderr  # SGLang's own complaint, from the log tail


def test_missing_model_path_is_a_clear_error(tmp_path):
    r = _launch("--role", "colocated", "--model-path", str(tmp_path / "nope"), timeout=60)
    assert r.returncode == 2
    assert "is not a directory" in r.stderr and "tiny-llama" in r.stderr


def test_provider_shm_is_refused_saying_why(tmp_path):
    """libfabric's shm provider is not offered: the launcher stops before starting anything,
    with the reason and what to use instead."""
    r = _launch("--role", "all", "--provider", "shm", "--port", str(next(_ports)), "--log-dir", str(tmp_path),
                timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "--provider shm: libfabric provider 'shm' is not offered" in r.stderr, r.stderr
    assert "cannot be bounded from outside using libfabric's public API" in r.stderr, r.stderr
    assert "use the shmem backend on one host, libfabric provider tcp across hosts" in r.stderr, r.stderr
    assert not list(tmp_path.glob("*.log"))  # no server was started


def test_sigterm_lets_the_request_in_flight_finish_then_stops_everything(tmp_path):
    port = next(_ports)
    proc, out, _ = _serving("--role", "all", "--port", str(port), "--model-path", "tiny-llama",
                            "--log-dir", str(tmp_path), "--drain-timeout", "60")
    try:
        got: list = []
        request = threading.Thread(target=lambda: got.append(
            generate_ids(f"http://127.0.0.1:{port}", [1] + list(range(100, 160)), 1000)))
        request.start()
        time.sleep(2)  # the request is decoding
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        request.join(120)
        rc = proc.wait(120)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert got and len(got[0]) == 1000, "the request in flight did not finish: " + "".join(out[-20:])
    assert rc == 0 and took < 90, (rc, took)
    assert any("draining in-flight requests" in line for line in out)
    for p in range(port, port + 10):  # nothing left listening
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", p))


def test_a_port_taken_after_the_check_stops_the_launch_with_one_line(tmp_path, monkeypatch):
    """Another process takes a planned port between the launcher's check and the server's
    bind (in the ephemeral range any outgoing connection can): one line naming the port and
    its purpose, not the server's traceback."""
    from sglang_disagg.launch import LaunchConfig, Role, Stack, stack as stack_mod
    from sglang_disagg.launch.process import StartupError

    monkeypatch.setattr(stack_mod, "check_ports_free", lambda cfg: None)  # the race: checked free, then taken
    cfg = LaunchConfig(role=Role.COLOCATED, model="tiny-llama", port=next(_ports), log_dir=str(tmp_path))
    s = Stack.for_config(cfg)
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("127.0.0.1", cfg.port))
        holder.listen()
        with pytest.raises(StartupError) as e:
            s.start()
    msg = str(e.value)
    assert msg.startswith(f"colocated exited during start-up: could not bind port {cfg.port} (colocated server)"), msg
    assert "Traceback" not in msg and "\n" not in msg
