"""The test hook that triggers migrations by token count (never by timing): a decoder started
with SGLANG_DISAGG_TEST_MIGRATE=to=URL migrates each request whose rid starts with
``migrate-after-K-`` once it has K output tokens (counted on the decoder the client asked: a
request that arrived here by migration is not sent on again). A fault injector too: a request whose rid
holds ``-stall-`` has half of its KV writes held back for STALL_S seconds once the new decoder
ordered them, so a test can kill that decoder or cut the link mid-migration."""

from __future__ import annotations

import os
from dataclasses import dataclass

from .room import migrated_rid

TEST_ENV = "SGLANG_DISAGG_TEST_MIGRATE"
STALL_S = 3.0


@dataclass(frozen=True, slots=True)
class TestHook:
    """Test hook (by token count, not timing): a request whose rid starts with
    ``migrate-after-K-`` migrates to decoder `to` once it has K output tokens."""

    to: str
    PREFIX = "migrate-after-"

    @classmethod
    def from_env(cls) -> TestHook | None:
        raw = os.environ.get(TEST_ENV, "")
        if not raw:
            return None
        kv = dict(part.split("=", 1) for part in raw.split(",") if "=" in part)
        if not kv.get("to", "").startswith("http"):
            raise ValueError(f"{TEST_ENV}={raw!r}: expected to=URL")
        return cls(kv["to"].rstrip("/"))

    @staticmethod
    def stalls(rid: str) -> bool:
        """Whether half of this request's writes wait STALL_S seconds (a mid-migration fault test)."""
        return rid.startswith(TestHook.PREFIX) and "-stall-" in rid

    def after(self, rid: str) -> tuple[int, str] | None:
        """(K, target URL) for a request named migrate-after-K-*; migrate-after-K-port-P-*
        targets 127.0.0.1:P instead (a fault test's decoder that dies or never answers)."""
        if not rid.startswith(self.PREFIX) or migrated_rid(rid):
            return None
        parts = rid[len(self.PREFIX):].split("-")
        if not parts[0].isdigit() or int(parts[0]) < 1:
            return None
        if len(parts) > 2 and parts[1] == "port" and parts[2].isdigit():
            return int(parts[0]), f"http://127.0.0.1:{int(parts[2])}"
        return int(parts[0]), self.to
