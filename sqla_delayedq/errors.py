"""The exception tree of sqla_delayedq.

Every error the library raises on purpose derives from :class:`DelayedQueueError`::

    DelayedQueueError
    ├── InvalidArgument (also a ValueError)   bad input, raised before any SQL runs
    ├── UnsupportedBackend                    dialect or server version we cannot serve safely
    ├── DecodeError                           a stored payload the serializer cannot read
    ├── EncodeError (also InvalidArgument)    a payload the serializer cannot write
    ├── ConfirmationRequired                  a destructive call made without its confirmation
    └── ConcurrentUpdate                      rows kept changing under the operation: retry
                                              the transaction (``is_transient`` says so)

Driver errors (deadlocks, lost connections) are not wrapped: they surface as SQLAlchemy's
``DBAPIError`` family so the caller's retry logic sees the usual types; see
:func:`sqla_delayedq.is_transient`.
"""

from __future__ import annotations

__all__ = [
    "ConcurrentUpdate",
    "ConfirmationRequired",
    "DecodeError",
    "DelayedQueueError",
    "EncodeError",
    "InvalidArgument",
    "UnsupportedBackend",
]


class DelayedQueueError(Exception):
    """Root of every error sqla_delayedq raises on purpose."""


class InvalidArgument(DelayedQueueError, ValueError):
    """An argument was rejected before any SQL ran; nothing was written."""


class UnsupportedBackend(DelayedQueueError):
    """The database, or its version, lacks a capability the queue needs."""


class DecodeError(DelayedQueueError):
    """A stored payload could not be decoded (wrong type tag, corrupt bytes)."""


class EncodeError(InvalidArgument):
    """The serializer could not encode a payload; nothing was written."""


class ConfirmationRequired(DelayedQueueError):
    """A destructive operation was called without its explicit confirmation."""


class ConcurrentUpdate(DelayedQueueError):
    """Concurrent transactions kept changing the rows; roll back and retry the transaction."""
