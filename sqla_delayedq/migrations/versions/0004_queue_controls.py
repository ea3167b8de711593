"""Queue controls: pause, a global concurrency limit and a global rate limit per queue.

``delayedq_queue_controls`` holds one row per queue that was paused or limited; see
:mod:`sqla_delayedq.controls`. Message tables are not changed, so host tables made from the
mixin need no migration of their own.

Revision ID: delayedq_0004
Revises: delayedq_0003
Create Date: 2026-11-24 12:00:00
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

from sqla_delayedq._engine import Family, family
from sqla_delayedq.models import exact_collation

revision: str = "delayedq_0004"
down_revision: str | Sequence[str] | None = "delayedq_0003"
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
        "delayedq_queue_controls",
        sa.Column("table_name", sa.String(100), nullable=False),
        sa.Column("queue", exact_string(100), nullable=False),
        sa.Column("paused", sa.Boolean(), nullable=False),
        sa.Column("max_in_flight", sa.Integer(), nullable=True),
        sa.Column("rate_limit", sa.Integer(), nullable=True),
        sa.Column("rate_period", sa.Float(), nullable=True),
        sa.Column("rate_log", sa.Text(), nullable=True),
        sa.Column("updated_at", utc_timestamp(), nullable=False),
        sa.PrimaryKeyConstraint("table_name", "queue", name=op.f("pk_delayedq_queue_controls")),
    )


def downgrade() -> None:
    op.drop_table("delayedq_queue_controls")
