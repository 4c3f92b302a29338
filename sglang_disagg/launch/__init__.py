"""Launcher: ``python -m sglang_disagg.launch --role prefill|decode|router|all|colocated``.

``--role all`` runs a whole disaggregated stack on this machine (1 prefill +
1 decode SGLang server + the router, smg) and serves the OpenAI-compatible
API on ``--port``; ``--role colocated`` runs one ordinary SGLang server with the
same model and flags, for A/B comparisons. ``--mode messenger`` (default) is
sglang_disagg's disaggregation; ``--mode upstream`` is SGLang's own PD path.
"""

from sglang_disagg.launch.config import LaunchConfig, Mode, Ports, Role, UpstreamBackend
from sglang_disagg.launch.process import StartupError
from sglang_disagg.launch.stack import Stack

__all__ = ["LaunchConfig", "Mode", "Ports", "Role", "Stack", "StartupError", "UpstreamBackend"]
