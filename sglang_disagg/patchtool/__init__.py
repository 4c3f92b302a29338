"""The SGLang patch series tool: ``python -m sglang_disagg.patchtool COMMAND``.

Module map:
- ``model``      ``patches/UPSTREAM`` and ``patches/series`` (frozen dataclasses), touched paths
- ``releases``   wheel download cache + sha256, unpacking, the installed sglang and its version
- ``gitutil``    git with pinned config (deterministic format-patch), isolated ``git apply``
- ``scratch``    scratch copies of touched files; all-or-nothing apply to site-packages
- ``installed``  ``apply`` / ``status`` against an installed sglang (+ marker file)
- ``workspace``  throw-away git workspaces (``git am -3``) and ``export`` (``format-patch``)
- ``check``      series consistency, pristine applicability, installed copy byte-for-byte
- ``rebase``     replay the series onto another release, 3-way; CHANGELOG line
- ``cli``        argparse front end; ``PatchError`` -> message + exit code, no traceback

Workflow: patches/README.md.
"""
