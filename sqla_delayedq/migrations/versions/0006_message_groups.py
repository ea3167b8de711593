"""Message groups: a nullable ``group_key`` column on ``delayed_queue`` and its index.

A queue built with ``groups=True`` delivers the messages of one group one at a time, in schedule
order. Existing rows get no group. A host's own message table gets the same column and index from
:func:`sqla_delayedq.migration.add_group_column` in a revision of its own, or from autogenerate.

Revision ID: delayedq_0006
Revises: delayedq_0005
Create Date: 2026-11-26 12:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

from sqla_delayedq.migration import add_group_column, drop_group_column

revision: str = "delayedq_0006"
down_revision: str | Sequence[str] | None = "delayedq_0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    add_group_column("delayed_queue")


def downgrade() -> None:
    drop_group_column("delayed_queue")
