"""The old name of ``sglang_disagg.patchtool`` (the patch series tool), kept for one release so
that scripts running ``python -m sglang_disagg.patches ...`` or importing its modules go on
working; it says so (stderr for the command, a DeprecationWarning for an import). The series
itself is the repository's ``patches/`` folder, which the tool's new name no longer echoes."""

from __future__ import annotations

import importlib
import sys
import warnings

NOTICE = ("sglang_disagg.patches is now sglang_disagg.patchtool (python -m sglang_disagg.patchtool); "
          "the old name goes in the next release")
warnings.warn(NOTICE, DeprecationWarning, stacklevel=2)

# sglang_disagg.patches.X is the very module sglang_disagg.patchtool.X (one PatchError, not two).
for _name in ("check", "cli", "errors", "gitutil", "installed", "model", "rebase", "releases", "repos", "scratch",
              "workspace"):
    sys.modules[f"{__name__}.{_name}"] = globals()[_name] = importlib.import_module(f"sglang_disagg.patchtool.{_name}")
