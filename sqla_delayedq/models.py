"""The message table: a declarative mixin and a ready default mapped class.

Add :class:`QueueMessageMixin` to a class of your own ``Base`` and name the table; Alembic's
autogenerate then sees the table, its constraints and indexes like any other model::

    class Base(DeclarativeBase):
        pass

    class Message(QueueMessageMixin, Base):
        __tablename__ = "messages"

Or use :class:`DelayedMessage`, mapped on this package's own :data:`metadata` (the table that
the repository's ``alembic/`` migrations create).

One row is one message. ``scheduled_at`` is the next due time and doubles as the lease: taking a
message moves it to ``now + lease`` and sets a fresh ``lock_token``; ``NULL`` means the message is
not pending (done or dead).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.dialects import mysql, postgresql
from sqlalchemy.orm import DeclarativeBase, Mapped, declared_attr, mapped_column
from sqlalchemy.sql.naming import conv
from sqlalchemy.types import JSON

from ._time import DateTimeUTC

__all__ = [
    "KEY_MAX",
    "QUEUE_MAX",
    "STATUSES",
    "DelayedMessage",
    "QueueMessageMixin",
    "metadata",
]

KEY_MAX = 200
QUEUE_MAX = 100
ERROR_MAX = 8000
STATUSES = ("pending", "done", "dead")

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def _case_sensitive_string(length: int) -> Any:
    # MySQL's default collations are case-insensitive; keys "A" and "a" must not collide.
    return String(length).with_variant(
        mysql.VARCHAR(length, charset="utf8mb4", collation="utf8mb4_bin"), "mysql", "mariadb"
    )


JSON_TYPE = JSON().with_variant(postgresql.JSONB(), "postgresql")
BYTES_TYPE = LargeBinary().with_variant(mysql.LONGBLOB(), "mysql", "mariadb")
ID_TYPE = BigInteger().with_variant(Integer(), "sqlite")


class QueueMessageMixin:
    """Columns, constraints and indexes of a message table. The user names the table."""

    __tablename__: str

    id: Mapped[int] = mapped_column(ID_TYPE, primary_key=True, autoincrement=True)
    queue: Mapped[str] = mapped_column(_case_sensitive_string(QUEUE_MAX), nullable=False)
    key: Mapped[str] = mapped_column(_case_sensitive_string(KEY_MAX), nullable=False)
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

    @declared_attr.directive
    def __table_args__(cls) -> tuple[Any, ...]:
        table = cls.__tablename__
        return (
            UniqueConstraint("queue", "key", name=conv(f"uq_{table}_queue_key")),
            # Due messages of one queue in order: an index range scan, never a table scan.
            Index(conv(f"ix_{table}_due"), "queue", "scheduled_at", "id"),
            Index(conv(f"ix_{table}_lock_token"), "lock_token"),
            CheckConstraint(
                "status IN ('pending', 'done', 'dead')", name=conv(f"ck_{table}_status")
            ),
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
    """The default message table, ``delayed_queue``, created by the repository's migrations."""

    __tablename__ = "delayed_queue"
