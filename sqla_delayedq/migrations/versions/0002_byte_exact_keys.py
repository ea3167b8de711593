"""Keys and queue names compare byte for byte on MariaDB/MySQL: a NO PAD binary collation.

Under 0001's ``utf8mb4_bin`` (PAD SPACE) the keys ``'k'`` and ``'k '`` were one message. A no-op
on PostgreSQL and SQLite, which compared them exactly already.

Revision ID: delayedq_0002
Revises: delayedq_0001
Create Date: 2026-11-23 18:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

from sqla_delayedq.migration import downgrade_key_collation, upgrade_key_collation

revision: str = "delayedq_0002"
down_revision: str | Sequence[str] | None = "delayedq_0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    upgrade_key_collation("delayed_queue")


def downgrade() -> None:
    downgrade_key_collation("delayed_queue")
