"""The dashboard's tables: the workers registry and per-minute counters per queue.

``delayedq_workers`` holds one row per worker process (name, host, pid, queues, heartbeat);
``delayedq_stats`` holds processed, failed and dead counts per worker, table, queue and minute.
Workers write them only when monitored (``delayedq worker``, or ``monitor_worker`` in code); see
:mod:`sqla_delayedq.monitor`.

Revision ID: delayedq_0003
Revises: delayedq_0002
Create Date: 2026-11-24 09:00:00
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

from sqla_delayedq._engine import Family, family
from sqla_delayedq.models import exact_collation

revision: str = "delayedq_0003"
down_revision: str | Sequence[str] | None = "delayedq_0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def utc_timestamp() -> sa.types.TypeEngine[datetime]:
    return sa.DateTime(timezone=True).with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")


def exact_string(length: int) -> sa.types.TypeEngine[str]:
    """Queue names compare byte for byte (NO PAD binary collation on MariaDB/MySQL)."""
    dialect = op.get_context().dialect
    if family(dialect) is Family.MYSQL:
        return mysql.VARCHAR(length, charset="utf8mb4", collation=exact_collation(dialect))
    return sa.String(length)


def upgrade() -> None:
    op.create_table(
        "delayedq_workers",
        sa.Column("id", sa.String(36), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("runtime", sa.String(16), nullable=False),
        sa.Column("started_by", sa.String(16), nullable=False),
        sa.Column("queues", sa.Text(), nullable=False),
        sa.Column("concurrency", sa.Integer(), nullable=False),
        sa.Column("heartbeat_seconds", sa.Float(), nullable=False),
        sa.Column("started_at", utc_timestamp(), nullable=False),
        sa.Column("heartbeat_at", utc_timestamp(), nullable=False),
        sa.Column("stopped_at", utc_timestamp(), nullable=True),
        sa.Column("in_flight", sa.Integer(), server_default="0", nullable=False),
        sa.Column("processed", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("failed", sa.BigInteger(), server_default="0", nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_delayedq_workers")),
    )
    op.create_table(
        "delayedq_stats",
        sa.Column("worker_id", sa.String(36), nullable=False),
        sa.Column("table_name", sa.String(100), nullable=False),
        sa.Column("queue", exact_string(100), nullable=False),
        sa.Column("minute", utc_timestamp(), nullable=False),
        sa.Column("processed", sa.Integer(), server_default="0", nullable=False),
        sa.Column("failed", sa.Integer(), server_default="0", nullable=False),
        sa.Column("dead", sa.Integer(), server_default="0", nullable=False),
        sa.PrimaryKeyConstraint(
            "worker_id", "table_name", "queue", "minute", name=op.f("pk_delayedq_stats")
        ),
    )
    op.create_index(op.f("ix_delayedq_stats_minute"), "delayedq_stats", ["minute"])


def downgrade() -> None:
    op.drop_table("delayedq_stats")
    op.drop_table("delayedq_workers")
