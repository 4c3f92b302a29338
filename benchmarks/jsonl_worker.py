"""The request loop of a helper process driven over stdin/stdout with JSON lines.

The conformance tests and the transfer benchmark both run each side of a
transfer in its own process; this is their shared loop. Each line is
``{"op": name, **kwargs}``; the reply is ``{"ok": true, **result}`` or
``{"ok": false, **describe_error(exc)}``; ``{"op": "exit"}`` ends it.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any


def serve(target: Any, describe_error: Callable[[Exception], dict]) -> None:
    # Native libraries (UCX, glog) may print to fd 1: keep it for them, reply on a private copy.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    for line in sys.stdin:
        req = json.loads(line)
        op = req.pop("op")
        if op == "exit":
            break
        try:
            reply = {"ok": True, **getattr(target, op)(**req)}
        except Exception as e:  # noqa: BLE001 - reported to the driver, which decides
            reply = {"ok": False, **describe_error(e)}
        out.write(json.dumps(reply) + "\n")
        out.flush()
    out.flush()
    # NIXL crashes at interpreter exit: replies are flushed, leave without teardown.
    os._exit(0)
