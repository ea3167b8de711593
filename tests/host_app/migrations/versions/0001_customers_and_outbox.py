"""Customers, and the outbox queue table from sqla_delayedq's helper operations.

A hand-written revision: the domain table spelled out, the queue table built from the mixin.

Revision ID: 0001
Revises:
Create Date: 2026-11-22 14:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from sqla_delayedq.migration import create_queue_table, drop_queue_table

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "customers",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("email", sa.String(length=200), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("email"),
    )
    create_queue_table("outbox")


def downgrade() -> None:
    drop_queue_table("outbox")
    op.drop_table("customers")
