"""Exceptions raised by transfer backends.

Every native failure is converted into one of these at the backend boundary, with the
library's own error text in the message; no integer status code escapes a backend.
"""

from __future__ import annotations


class TransferError(RuntimeError):
    """A transfer, registration or connection failed."""


class PeerLostError(TransferError):
    """The peer went away (process died, connection reset or closed)."""


class DeadlineExceeded(TransferError, TimeoutError):
    """An expectation or a wait did not complete in time."""


class DescriptorError(TransferError, ValueError):
    """A descriptor or a write request is malformed or out of bounds; nothing was posted."""


class UnsupportedMemory(DescriptorError):
    """register() was given a memory kind (e.g. CUDA device memory) this backend, its
    provider or this build of its library cannot register; the message names which and why."""


class BackendUnavailable(TransferError, ImportError):
    """The backend cannot run here (optional library missing, provider absent)."""


class UnknownBackendError(TransferError, LookupError):
    """No backend is registered under that name."""
