"""The message table: a declarative mixin and a ready default mapped class.

Add :class:`QueueMessageMixin` to a class of your own ``Base`` and name the table; Alembic's
autogenerate then sees the table, its constraints and indexes like any other model::

    class Base(DeclarativeBase):
        pass

    class Message(QueueMessageMixin, Base):
        __tablename__ = "messages"

Or use :class:`DelayedMessage`, mapped on this package's own :data:`metadata` (the table that
the migrations shipped in :mod:`sqla_delayedq.migrations` create: ``delayedq db upgrade``).

One row is one message. ``scheduled_at`` is the next due time and doubles as the lease: taking a
message moves it to ``now + lease`` and sets a fresh ``lock_token``; ``NULL`` means the message is
not pending (done or dead).
"""

from __future__ import annotations

import hashlib
from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    Double,
    Float,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
    Text,
    UniqueConstraint,
    column,
    text,
)
from sqlalchemy.dialects import mysql, postgresql
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, declared_attr, mapped_column
from sqlalchemy.sql import TableClause
from sqlalchemy.sql.naming import conv
from sqlalchemy.types import JSON, TypeDecorator

from ._engine import Family, family, is_mariadb
from ._time import DateTimeUTC
from .errors import UnsupportedBackend

__all__ = [
    "KEY_MAX",
    "QUEUE_MAX",
    "STATUSES",
    "DelayedMessage",
    "QueueMessageMixin",
    "metadata",
    "stats_table",
    "table_key",
    "workers_table",
]

KEY_MAX = 200
QUEUE_MAX = 100
#: The width of the ``table_name`` columns of our tables (controls, stats): :func:`table_key`.
TABLE_KEY_MAX = 100
ERROR_MAX = 8000
STATUSES = ("pending", "done", "dead")

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


#: NO PAD binary collations: ``'k' = 'k '`` is false, case and accents count, ``LIKE`` is literal.
MARIADB_EXACT_COLLATION = "utf8mb4_nopad_bin"
MYSQL_EXACT_COLLATION = "utf8mb4_0900_bin"  # MySQL 8.0.17+


def exact_collation(dialect: Dialect) -> str:
    """The byte-exact collation of a MariaDB or MySQL server.

    Chosen by ``dialect.is_mariadb``, not by the dialect name: a ``mysql://`` URL that reaches
    MariaDB keeps the name ``mysql`` (so ``with_variant(..., "mariadb")`` would not apply) while
    the dialect detects MariaDB on connect. Offline, ``mariadb://`` URLs say MariaDB.
    MySQL has it from 8.0.17; an older server is refused here, before any DDL.
    """
    if is_mariadb(dialect):
        return MARIADB_EXACT_COLLATION
    version = dialect.server_version_info
    if version is not None and version < (8, 0, 17):
        raise UnsupportedBackend(
            f"MySQL {'.'.join(map(str, version))} has no {MYSQL_EXACT_COLLATION} collation, "
            "which keys need to compare byte for byte; upgrade to MySQL 8.0.17 or later"
        )
    return MYSQL_EXACT_COLLATION


class ExactString(TypeDecorator[str]):
    """A ``VARCHAR`` compared byte for byte on every backend: keys and queue names.

    PostgreSQL (deterministic collations) and SQLite (``BINARY``) compare strings exactly
    already. MariaDB/MySQL's ``_bin`` collations are PAD SPACE (``'k' = 'k '``) and their default
    ones ignore case and accents, so there the column gets :func:`exact_collation`, decided when
    the DDL is compiled for a connected (or ``mariadb://``) dialect.
    """

    impl = String
    cache_ok = True

    def __init__(self, length: int) -> None:
        super().__init__(length)
        self.length = length

    def load_dialect_impl(self, dialect: Dialect) -> Any:
        if family(dialect) is Family.MYSQL:
            varchar = mysql.VARCHAR(
                self.length, charset="utf8mb4", collation=exact_collation(dialect)
            )
            return dialect.type_descriptor(varchar)
        return dialect.type_descriptor(String(self.length))


#: The payload's PostgreSQL variant; Alembic's hook knows the mixin's own by identity.
PG_JSONB = postgresql.JSONB()
JSON_TYPE = JSON().with_variant(PG_JSONB, "postgresql")
BYTES_TYPE = LargeBinary().with_variant(mysql.LONGBLOB(), "mysql", "mariadb")
ID_TYPE = BigInteger().with_variant(Integer(), "sqlite")


#: The lock-token index's predicate (partial where the backend has partial indexes).
LOCK_TOKEN_PREDICATE = "lock_token IS NOT NULL"


class QueueMessageMixin:
    """Columns, constraints and indexes of a message table. The user names the table."""

    __tablename__: str

    id: Mapped[int] = mapped_column(ID_TYPE, primary_key=True, autoincrement=True)
    queue: Mapped[str] = mapped_column(ExactString(QUEUE_MAX), nullable=False)
    key: Mapped[str] = mapped_column(ExactString(KEY_MAX), nullable=False)
    payload_type: Mapped[str] = mapped_column(String(100), nullable=False)
    payload: Mapped[Any | None] = mapped_column(JSON_TYPE, nullable=True)
    payload_bytes: Mapped[bytes | None] = mapped_column(BYTES_TYPE, nullable=True)
    status: Mapped[str] = mapped_column(String(16), nullable=False, server_default="pending")
    scheduled_at: Mapped[datetime | None] = mapped_column(DateTimeUTC(), nullable=True)
    scheduled_at_initially: Mapped[datetime] = mapped_column(DateTimeUTC(), nullable=False)
    created_at: Mapped[datetime] = mapped_column(DateTimeUTC(), nullable=False)
    lock_token: Mapped[str | None] = mapped_column(String(64), nullable=True)
    attempts: Mapped[int] = mapped_column(Integer, nullable=False, server_default="0")
    last_attempt_at: Mapped[datetime | None] = mapped_column(DateTimeUTC(), nullable=True)
    last_error: Mapped[str | None] = mapped_column(Text, nullable=True)
    #: Metadata offered with the message (a JSON object of strings), e.g. its trace context.
    headers: Mapped[str | None] = mapped_column(Text, nullable=True)
    #: The message's group (``DelayedQueue(groups=True)``): one of a group in flight at a time,
    #: in schedule order.
    group_key: Mapped[str | None] = mapped_column(ExactString(KEY_MAX), nullable=True)
    #: Higher is taken first among due messages (``DelayedQueue(priorities=True)``); 0 is the
    #: default and the lowest.
    priority: Mapped[int] = mapped_column(Integer, nullable=False, server_default="0")

    @declared_attr.directive
    def __table_args__(cls) -> tuple[Any, ...]:
        table = cls.__tablename__
        return (
            UniqueConstraint("queue", "key", name=conv(f"uq_{table}_queue_key")),
            # Due messages of one queue in order: an index range scan, never a table scan.
            Index(conv(f"ix_{table}_due"), "queue", "scheduled_at", "id"),
            # Leased rows (in-flight counts of limited queues): only rows that have a token
            # (partial) on PostgreSQL and SQLite, so an offer writes no entry here and a message
            # leaves one dead index entry fewer behind it.
            Index(
                conv(f"ix_{table}_lock_token"),
                "lock_token",
                postgresql_where=text(LOCK_TOKEN_PREDICATE),
                sqlite_where=text(LOCK_TOKEN_PREDICATE),
            ),
            # A group's earlier messages, for the head-of-group probe of a grouped take; only
            # rows with a group (MariaDB/MySQL have no partial indexes and index them all).
            Index(
                conv(f"ix_{table}_group"),
                "queue",
                "group_key",
                "scheduled_at_initially",
                "id",
                postgresql_where=text("group_key IS NOT NULL"),
                sqlite_where=text("group_key IS NOT NULL"),
            ),
            # Due boosted messages, highest priority first: the first probe of a take of a
            # queue with priorities; only boosted rows (partial) on PostgreSQL and SQLite.
            Index(
                conv(f"ix_{table}_priority"),
                "queue",
                column("priority").desc(),
                "scheduled_at",
                "id",
                postgresql_where=text("priority > 0"),
                sqlite_where=text("priority > 0"),
            ),
            CheckConstraint(
                "status IN ('pending', 'done', 'dead')", name=conv(f"ck_{table}_status")
            ),
            # An id is never reused (SQLite's rowid otherwise gives a new message the id of the
            # highest one deleted): a bulk change bounded by the highest id it counted never
            # reaches a message offered since.
            {"sqlite_autoincrement": True},
        )

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} id={self.id} queue={self.queue!r} key={self.key!r} "
            f"status={self.status} scheduled_at={self.scheduled_at}>"
        )


metadata = MetaData(naming_convention=NAMING_CONVENTION)


class _Base(DeclarativeBase):
    metadata = metadata


class DelayedMessage(QueueMessageMixin, _Base):
    """The default message table, ``delayed_queue``, created by the package's own migrations."""

    __tablename__ = "delayed_queue"


#: The workers registry of :mod:`sqla_delayedq.monitor` (revision ``delayedq_0003``): one row per
#: worker process, written by that worker only.
workers_table = Table(
    "delayedq_workers",
    metadata,
    Column("id", String(36), nullable=False),
    Column("name", String(200), nullable=False),
    Column("host", String(255), nullable=False),
    Column("pid", Integer, nullable=False),
    #: ``threads`` or ``asyncio``.
    Column("runtime", String(16), nullable=False),
    #: ``code`` (monitor_worker in the application) or ``cli`` (``delayedq worker``).
    Column("started_by", String(16), nullable=False),
    #: JSON list of ``table:queue``.
    Column("queues", Text, nullable=False),
    Column("concurrency", Integer, nullable=False),
    Column("heartbeat_seconds", Float, nullable=False),
    Column("started_at", DateTimeUTC(), nullable=False),
    Column("heartbeat_at", DateTimeUTC(), nullable=False),
    Column("stopped_at", DateTimeUTC(), nullable=True),
    Column("in_flight", Integer, nullable=False, server_default="0"),
    Column("processed", BigInteger, nullable=False, server_default="0"),
    Column("failed", BigInteger, nullable=False, server_default="0"),
    PrimaryKeyConstraint("id", name=conv("pk_delayedq_workers")),
)

#: Per-minute counters per worker and queue (revision ``delayedq_0003``), for the dashboard's
#: charts; each worker adds to its own rows and prunes rows older than its history.
stats_table = Table(
    "delayedq_stats",
    metadata,
    Column("worker_id", String(36), nullable=False),
    Column("table_name", String(100), nullable=False),
    Column("queue", ExactString(QUEUE_MAX), nullable=False),
    Column("minute", DateTimeUTC(), nullable=False),
    Column("processed", Integer, nullable=False, server_default="0"),
    Column("failed", Integer, nullable=False, server_default="0"),
    Column("dead", Integer, nullable=False, server_default="0"),
    PrimaryKeyConstraint(
        "worker_id", "table_name", "queue", "minute", name=conv("pk_delayedq_stats")
    ),
    Index(conv("ix_delayedq_stats_minute"), "minute"),
)


def table_key(table: TableClause) -> str:
    """How a message table is named wherever processes share it by name: in the
    ``table_name`` of its queue controls and per-minute counters, its wake-ups and its
    ``NOTIFY`` channel.

    A table without a schema is its bare name, as it always was (rows already stored keep
    working); a table with one is ``schema.name``, so same-named tables in two schemas (two
    databases of one MariaDB server) keep their queues' controls apart. A qualified name
    longer than :data:`TABLE_KEY_MAX` keeps its start and ends with a hash of the whole.
    """
    if table.schema is None:
        return table.name
    key = f"{table.schema}.{table.name}"
    if len(key) <= TABLE_KEY_MAX:
        return key
    digest = hashlib.blake2b(key.encode(), digest_size=8).hexdigest()
    return f"{key[: TABLE_KEY_MAX - len(digest) - 1]}~{digest}"


#: Queue controls (revision ``delayedq_0004``, :mod:`sqla_delayedq.controls`): one row per queue
#: that was ever paused or limited; a queue without a row is plain. ``table_name`` is the
#: :func:`table_key` of the queue's table, ``queue`` the queue's name (an entity queue's: its
#: table's).
controls_table = Table(
    "delayedq_queue_controls",
    metadata,
    Column("table_name", String(100), nullable=False),
    Column("queue", ExactString(QUEUE_MAX), nullable=False),
    Column("paused", Boolean, nullable=False),
    #: At most this many messages of the queue in flight at once, across every consumer.
    Column("max_in_flight", Integer, nullable=True),
    #: At most ``rate_limit`` takes per ``rate_period`` seconds (any window of that length).
    Column("rate_limit", Integer, nullable=True),
    #: Double precision on every backend (a ``FLOAT`` is single precision on MariaDB/MySQL).
    Column(
        "rate_period",
        Float().with_variant(Double(), "mysql", "mariadb"),
        nullable=True,
    ),
    #: The takes inside the current window: JSON ``[[epoch seconds, count], ...]``.
    Column("rate_log", Text, nullable=True),
    Column("updated_at", DateTimeUTC(), nullable=False),
    PrimaryKeyConstraint("table_name", "queue", name=conv("pk_delayedq_queue_controls")),
)
