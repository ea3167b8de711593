"""The default message table, ``delayed_queue``: frozen literal DDL, never built from the mixin.

Revision ID: delayedq_0001
Revises:
Create Date: 2026-11-22 14:00:00
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql, postgresql

revision: str = "delayedq_0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = ("sqla_delayedq",)
depends_on: str | Sequence[str] | None = None


def utc_timestamp() -> sa.types.TypeEngine[datetime]:
    return sa.DateTime(timezone=True).with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")


def binary_string(length: int) -> sa.types.TypeEngine[str]:
    varchar = mysql.VARCHAR(length, charset="utf8mb4", collation="utf8mb4_bin")
    return sa.String(length).with_variant(varchar, "mysql", "mariadb")


def upgrade() -> None:
    op.create_table(
        "delayed_queue",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("queue", binary_string(100), nullable=False),
        sa.Column("key", binary_string(200), nullable=False),
        sa.Column("payload_type", sa.String(100), nullable=False),
        sa.Column(
            "payload",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=True,
        ),
        sa.Column(
            "payload_bytes",
            sa.LargeBinary().with_variant(mysql.LONGBLOB(), "mysql", "mariadb"),
            nullable=True,
        ),
        sa.Column("status", sa.String(16), server_default="pending", nullable=False),
        sa.Column("scheduled_at", utc_timestamp(), nullable=True),
        sa.Column("scheduled_at_initially", utc_timestamp(), nullable=False),
        sa.Column("created_at", utc_timestamp(), nullable=False),
        sa.Column("lock_token", sa.String(64), nullable=True),
        sa.Column("attempts", sa.Integer(), server_default="0", nullable=False),
        sa.Column("last_attempt_at", utc_timestamp(), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_delayed_queue")),
        sa.UniqueConstraint("queue", "key", name=op.f("uq_delayed_queue_queue_key")),
        sa.CheckConstraint(
            "status IN ('pending', 'done', 'dead')", name=op.f("ck_delayed_queue_status")
        ),
        sqlite_autoincrement=True,  # ids are never reused (see models.QueueMessageMixin)
    )
    # Names are final (op.f): the DDL must not depend on the naming convention of the env.
    op.create_index(op.f("ix_delayed_queue_due"), "delayed_queue", ["queue", "scheduled_at", "id"])
    op.create_index(op.f("ix_delayed_queue_lock_token"), "delayed_queue", ["lock_token"])


def downgrade() -> None:
    op.drop_table("delayed_queue")
