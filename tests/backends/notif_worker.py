"""transfer_worker.Worker with the deployment's secret, plus a forger: the notification tests'
processes (tests/unit/test_notifications.py).

A forger holds no backend and no secret: a bare NIXL agent or Mooncake engine that sends
notifications through the library's own API (NIXL send_notif, Mooncake's TransferNotify), naming
itself whatever it likes, as anyone who reaches the data plane can.

Run as a process by transfer_harness.Proc(..., worker="notif_worker.py"), like transfer_worker.py.
"""

from __future__ import annotations

import base64
import ctypes
import mmap
import traceback

from transfer_worker import Worker  # puts benchmarks/ (jsonl_worker) on sys.path
from jsonl_worker import serve

from sglang_disagg.backends import BackendConfig, create_backend
from sglang_disagg.backends.peers import Peer


class NotifWorker(Worker):
    def __init__(self) -> None:
        super().__init__()
        self.forger: dict | None = None

    def init(self, backend: str, provider: str | None = None, secret: str | None = None,
             forger: bool = False) -> dict:
        """`secret`: hex; `forger`: no backend, only `forge`."""
        if forger:
            self.forger = {"backend": backend}
            return {"address": ""}
        self.be = create_backend(backend, BackendConfig(provider=provider,
                                                        secret=bytes.fromhex(secret) if secret else None))
        # Record what this process sends, as a capture of the wire would (a test's eye, no fake).
        self._sealed: list[str] = []
        real = Peer.seal_notification

        def seal(peer: Peer, tag: int, count: int) -> str:
            text = real(peer, tag, count)
            self._sealed.append(text)
            return text
        Peer.seal_notification = seal
        return {"address": self.be.address}

    def instance(self) -> dict:
        return {"instance": self.be.instance}

    def sealed(self) -> dict:
        """Every notification text this backend sealed so far, oldest first: what someone
        capturing its data-plane traffic would hold."""
        return {"texts": list(self._sealed)}

    def endpoint(self) -> dict:
        """What peers learn of us in the HELLO: NIXL's agent name and metadata, Mooncake's session."""
        return self.be._endpoint_info()

    def peer_state(self, peer: str) -> dict:
        return {"state": self.peers[peer].state.value}

    def forge(self, target: dict, name: str, msgs: list, dst: int = 0) -> dict:
        """Send each of `msgs` (base64) to the backend whose endpoint is `target`, calling
        ourselves `name`; Mooncake's notification rides a 16-byte write at `dst` (an address
        the target registered: its transport delivers one only with a transfer)."""
        raw = [base64.b64decode(m) for m in msgs]
        if self.forger["backend"] == "nixl":
            return self._forge_nixl(target, name, raw)
        return self._forge_mooncake(target, name, raw, dst)

    def _forge_nixl(self, target: dict, name: str, msgs: list[bytes]) -> dict:
        from nixl._api import nixl_agent, nixl_agent_config

        from sglang_disagg.backends.nixl import progress_delay
        agent = self.forger.get("agent")
        if agent is None:
            # NIXL's own progress thread drives UCX after send_notif returns (the connection is
            # wired up and the messages leave in the background); 100 us between polls.
            with progress_delay(100):
                agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=True, backends=[]))
            agent.create_backend("UCX", {"ucx_error_handling_mode": "none"})
            self.forger["agent"] = agent
        remote = agent.add_remote_agent(base64.b64decode(target["md"]))
        for m in msgs:
            agent.send_notif(remote.decode() if isinstance(remote, bytes) else remote, m)
        return {"sent": len(msgs)}

    def _forge_mooncake(self, target: dict, name: str, msgs: list[bytes], dst: int) -> dict:
        from mooncake import engine
        if "te" not in self.forger:
            te = engine.TransferEngine()
            if te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
                raise RuntimeError("forger: Mooncake initialize failed")
            buf = mmap.mmap(-1, 4096)
            addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
            if te.register_memory(addr, 4096) != 0:
                raise RuntimeError("forger: Mooncake register_memory failed")
            self.forger.update(te=te, buf=buf, addr=addr)
        te, addr = self.forger["te"], self.forger["addr"]
        rcs = [te.batch_transfer_sync(target["session"], [addr], [dst], [16], engine.TransferOpcode.Write,
                                      engine.TransferNotify(name, m)) for m in msgs]
        return {"sent": len(msgs), "rcs": rcs}


def main() -> None:
    serve(NotifWorker(), lambda e: {"type": type(e).__name__, "msg": str(e), "tb": traceback.format_exc()})


if __name__ == "__main__":
    main()
