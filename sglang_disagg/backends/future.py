"""A once-only completion shared by batches and expectations."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from .errors import DeadlineExceeded

log = logging.getLogger(__name__)


class TransferFuture:
    """Completes exactly once, with a value or an exception.

    Callbacks run on the thread that completes the future (a backend's progress
    thread): keep them short and never block in them. An exception raised by a callback
    is logged and swallowed: it belongs to the caller's code, and letting it propagate
    would kill the progress thread and with it every other transfer of the backend.
    """

    __slots__ = ("_callbacks", "_error", "_event", "_lock", "_value", "label")

    def __init__(self, label: str = "") -> None:
        self.label = label
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[TransferFuture], Any]] = []
        self._value: Any = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        return self._event.is_set()

    def exception(self) -> BaseException | None:
        return self._error if self._event.is_set() else None

    def wait(self, timeout: float | None = None) -> Any:
        """Return the value, or raise the failure; DeadlineExceeded if `timeout` passes first."""
        if not self._event.wait(timeout):
            raise DeadlineExceeded(f"{self.label or 'transfer'}: not complete after {timeout} s")
        if self._error is not None:
            raise self._error
        return self._value

    def add_done_callback(self, fn: Callable[[TransferFuture], Any]) -> None:
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def set_result(self, value: Any = None) -> bool:
        return self._finish(value, None)

    def set_exception(self, error: BaseException) -> bool:
        return self._finish(None, error)

    def _finish(self, value: Any, error: BaseException | None) -> bool:
        with self._lock:
            if self._event.is_set():
                return False
            self._value, self._error = value, error
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            try:
                fn(self)
            except Exception:  # noqa: BLE001 - see the class docstring
                log.exception("callback of %s raised; ignored", self.label or "transfer future")
        return True
