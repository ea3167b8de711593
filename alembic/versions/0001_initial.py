"""The default message table, ``delayed_queue``.

Revision ID: 0001
Revises:
Create Date: 2026-11-22 14:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

from sqla_delayedq.migration import create_queue_table, drop_queue_table

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    create_queue_table("delayed_queue")


def downgrade() -> None:
    drop_queue_table("delayed_queue")
