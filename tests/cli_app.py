"""An application of the user's own, as ``delayedq worker`` and ``--app`` meet it.

Its queues live in its own mixin tables (``app_jobs``, and ``app_audit`` for the two-table app),
with a lease, a serializer and a retry policy that differ from every default of the command
line: a 2-hour lease, :class:`Order` payloads stored as ``{"id": 1, "total": "12.34"}``, and no
retry (one failed attempt and the message is dead). The handlers write one line per event to
``$DELAYEDQ_TEST_OUT``, with the payload's type and the lease left when the handler started, so
a test sees which lease and serializer the worker really used.

The database URL is the application's own setting, ``$DELAYEDQ_TEST_APP_URL`` (a synchronous
SQLAlchemy URL; the asyncio worker derives its async driver from it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import MetaData, String
from sqlalchemy.engine import make_url
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker

from sqla_delayedq import (
    DelayedQueue,
    Envelope,
    ExponentialBackoff,
    QueueMessageMixin,
    create_engine,
)
from sqla_delayedq.entity import EntityQueue, EntityQueueMixin
from sqla_delayedq.models import NAMING_CONVENTION
from sqla_delayedq.serializers import Storage
from sqla_delayedq.worker import Worker

URL_VAR = "DELAYEDQ_TEST_APP_URL"
LEASE = timedelta(hours=2)
ASYNC_DRIVERS = {
    "sqlite": "sqlite+aiosqlite",
    "postgresql": "postgresql+psycopg",
    "mysql": "mysql+aiomysql",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class JobMessage(QueueMessageMixin, Base):
    __tablename__ = "app_jobs"


class AuditMessage(QueueMessageMixin, Base):
    __tablename__ = "app_audit"


class Shipment(EntityQueueMixin, Base):
    """An entity-queue table: not a message table, whatever a command is told."""

    __tablename__ = "app_shipments"

    id: Mapped[int] = mapped_column(primary_key=True)
    address: Mapped[str] = mapped_column(String(200))


class Customer(Base):
    """A domain table with no queue columns at all."""

    __tablename__ = "app_customers"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(200))


@dataclass(frozen=True)
class Order:
    id: int
    total_cents: int


class OrderSerializer:
    """Orders as JSON with the total as a decimal string: not what the CLI's JSON would give."""

    type_name = "order"
    storage: Storage = "json"

    def encode(self, payload: Order) -> Any:
        return {"id": payload.id, "total": f"{payload.total_cents / 100:.2f}"}

    def decode(self, stored: Any) -> Order:
        return Order(int(stored["id"]), round(float(stored["total"]) * 100))


def jobs() -> DelayedQueue[Order]:
    return DelayedQueue(
        "jobs",
        model=JobMessage,
        serializer=OrderSerializer(),
        lease=LEASE,
        retry=ExponentialBackoff(max_attempts=1),
    )


def audit() -> DelayedQueue[Any]:
    return DelayedQueue("audit", model=AuditMessage)


def url() -> str:
    try:
        return os.environ[URL_VAR]
    except KeyError:
        raise RuntimeError(f"tests.cli_app needs ${URL_VAR}") from None


def note(text: str) -> None:
    with Path(os.environ["DELAYEDQ_TEST_OUT"]).open("a", encoding="utf-8") as f:
        f.write(text + "\n")


def record(envelope: Envelope[Any]) -> None:
    """``handled KEY TYPE TOTAL LEASE_SECONDS``; raises for keys starting ``fail/``."""
    lease_left = (envelope.lease_until - datetime.now(UTC)).total_seconds()
    payload = envelope.payload
    total = getattr(payload, "total_cents", "-")
    note(f"handled {envelope.key} {type(payload).__name__} {total} {lease_left:.0f}")
    if envelope.key.startswith("fail/"):
        raise RuntimeError(f"cannot handle {envelope.key}")


def handle(envelope: Envelope[Order]) -> None:
    record(envelope)


async def handle_async(envelope: Envelope[Order]) -> None:
    record(envelope)


def make_worker() -> Worker:
    """The application's worker: one queue on its own table."""
    engine = create_engine(url())
    w = Worker(sessionmaker(engine), concurrency=2, poll_interval=0.2, drain_timeout=10)
    w.register(jobs(), handle)
    return w


def make_two_table_worker() -> Worker:
    engine = create_engine(url())
    w = Worker(sessionmaker(engine), concurrency=2, poll_interval=0.2)
    w.register(jobs(), handle)
    w.register(audit(), handle)
    return w


def make_async_worker() -> Any:
    from sqlalchemy.ext.asyncio import async_sessionmaker

    from sqla_delayedq.aio import AsyncWorker, create_async_engine

    sync = make_url(url())
    engine = create_async_engine(sync.set(drivername=ASYNC_DRIVERS[sync.get_backend_name()]))
    w = AsyncWorker(async_sessionmaker(engine), concurrency=2, poll_interval=0.2, drain_timeout=10)
    w.register(jobs(), handle_async)
    return w


def ship(envelope: Envelope[Shipment]) -> None:
    note(f"shipped {envelope.payload.id} {envelope.payload.address}")


def make_entity_worker() -> Worker:
    """A message queue and an entity queue (on ``app_shipments``) in one worker."""
    engine = create_engine(url())
    w = Worker(sessionmaker(engine), concurrency=2, poll_interval=0.2, drain_timeout=10)
    w.register(jobs(), handle)
    w.register(EntityQueue(Shipment), ship)
    return w


def make_nothing() -> int:
    return 42


#: What ``delayedq worker tests.cli_app:worker`` runs: built when the module is imported.
worker = make_worker()

#: A worker with nothing registered: running it fails at once (the refused-flag tests point at
#: it, so a flag that is not refused ends the test instead of blocking it).
empty_worker = Worker(sessionmaker(create_engine(url())))
