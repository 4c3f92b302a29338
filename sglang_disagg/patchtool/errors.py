"""The one exception type of the patch tool: expected failures, printed without a traceback."""

from __future__ import annotations


class PatchError(Exception):
    """An expected failure (bad input, conflict, wrong version); ``__main__`` prints it and exits."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code
