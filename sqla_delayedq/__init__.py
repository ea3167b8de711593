"""sqla_delayedq: a delayed message queue in your own database, as an SQLAlchemy 2.x extension.

Add :class:`QueueMessageMixin` to a model (or use :class:`DelayedMessage`), create the table with
Alembic, and offer messages inside your own ``session.begin()`` block, so they commit or roll back
with your writes::

    queue = DelayedQueue("emails")
    with Session(engine) as session, session.begin():
        session.add(user)
        queue.offer(session, f"welcome/{user.id}", {"user_id": user.id})

Consumers take due messages with ``try_poll`` (``FOR UPDATE SKIP LOCKED`` where the backend has
it) and settle them with ``ack``, ``nack``, ``release`` or ``extend``, each guarded by the lock
token of the take.
"""

from __future__ import annotations

from ._dialects import is_transient
from ._engine import configure_sqlite, create_engine
from ._queue import DelayedQueue, OfferInput
from ._transaction import run_in_transaction
from ._types import (
    Buried,
    Delivery,
    Envelope,
    MessageFilter,
    MessageInfo,
    NackOutcome,
    OfferMode,
    OfferResult,
    Outcome,
    QueueCounts,
    State,
)
from .controls import QueueControls
from .cron import (
    CatchUp,
    CronConfig,
    CronHandle,
    CronInfo,
    CronSchedule,
    CronService,
    CronTick,
    DailySchedule,
    InstallResult,
    PeriodicTick,
    install_tick,
    list_cron,
    uninstall,
    uninstall_tick,
)
from .entity import EntityCounts, EntityQueue, EntityQueueMixin, EntityStatus
from .errors import (
    ConfirmationRequired,
    DecodeError,
    DelayedQueueError,
    EncodeError,
    HandlerMisuse,
    InvalidArgument,
    TransientError,
    UnsupportedBackend,
    WorkerError,
)
from .models import DelayedMessage, QueueMessageMixin
from .retry import ExponentialBackoff, RetryPolicy
from .serializers import (
    BytesSerializer,
    DataclassSerializer,
    JsonSerializer,
    PydanticSerializer,
    Serializer,
)

__version__ = "0.1.0"

__all__ = [
    "Buried",
    "BytesSerializer",
    "CatchUp",
    "ConfirmationRequired",
    "CronConfig",
    "CronHandle",
    "CronInfo",
    "CronSchedule",
    "CronService",
    "CronTick",
    "DailySchedule",
    "DataclassSerializer",
    "DecodeError",
    "DelayedMessage",
    "DelayedQueue",
    "DelayedQueueError",
    "Delivery",
    "EncodeError",
    "EntityCounts",
    "EntityQueue",
    "EntityQueueMixin",
    "EntityStatus",
    "Envelope",
    "ExponentialBackoff",
    "HandlerMisuse",
    "InstallResult",
    "InvalidArgument",
    "JsonSerializer",
    "MessageFilter",
    "MessageInfo",
    "NackOutcome",
    "OfferInput",
    "OfferMode",
    "OfferResult",
    "Outcome",
    "PeriodicTick",
    "PydanticSerializer",
    "QueueControls",
    "QueueCounts",
    "QueueMessageMixin",
    "RetryPolicy",
    "Serializer",
    "State",
    "TransientError",
    "UnsupportedBackend",
    "WorkerError",
    "configure_sqlite",
    "create_engine",
    "install_tick",
    "is_transient",
    "list_cron",
    "run_in_transaction",
    "uninstall",
    "uninstall_tick",
]
