"""The exception tree of sqla_delayedq.

Every error the library raises on purpose derives from :class:`DelayedQueueError`::

    DelayedQueueError
    ├── InvalidArgument (also a ValueError)   bad input, raised before any SQL runs
    ├── UnsupportedBackend                    dialect or server version we cannot serve safely
    ├── DecodeError                           a stored payload the serializer cannot read
    ├── EncodeError (also InvalidArgument)    a payload the serializer cannot write
    ├── ConfirmationRequired                  a destructive call made without its confirmation
    ├── TransientError                        the database refused the transaction for now
    │   │                                     (deadlock, serialization failure, lost
    │   │                                     connection): roll back and run it again
    │   └── ConcurrentUpdate                  rows kept changing under the operation
    ├── HandlerMisuse                         a transactional handler committed or rolled back
    │                                         the transaction it runs in
    └── WorkerError                           a worker stopped on an error it cannot retry

A transient driver error raised inside a queue operation is re-raised as
:class:`TransientError` with the driver's error as ``__cause__``. The caller's transaction is
then unusable: roll it back and run the whole unit of work again, for example with
:func:`sqla_delayedq.run_in_transaction`. Other driver errors (constraint violations, bad SQL)
surface unchanged as SQLAlchemy's ``DBAPIError`` family; :func:`sqla_delayedq.is_transient`
tells the two apart for both.
"""

from __future__ import annotations

__all__ = [
    "ConcurrentUpdate",
    "ConfirmationRequired",
    "DecodeError",
    "DelayedQueueError",
    "EncodeError",
    "HandlerMisuse",
    "InvalidArgument",
    "TransientError",
    "UnsupportedBackend",
    "WorkerError",
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


class TransientError(DelayedQueueError):
    """The database refused the transaction for now; roll it back and run it again."""


class ConcurrentUpdate(TransientError):
    """Concurrent transactions kept changing the rows; roll back and retry the transaction."""


class HandlerMisuse(DelayedQueueError):
    """A transactional handler committed or rolled back the transaction it runs in, which is
    the consumer's: its message's removal commits with the handler's writes when it returns."""


class WorkerError(DelayedQueueError):
    """A worker stopped because of an error it must not retry (a bug, a missing table)."""
