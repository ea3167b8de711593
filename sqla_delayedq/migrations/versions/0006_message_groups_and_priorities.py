"""Message groups and priorities: ``group_key`` and ``priority`` columns on ``delayed_queue``.

A queue built with ``groups=True`` delivers the messages of one group one at a time, in schedule
order; one built with ``priorities=True`` takes due messages of a higher priority first. Existing
rows get no group and priority 0. A host's own message table gets the same columns and indexes
from :func:`sqla_delayedq.migration.add_group_column` and
:func:`sqla_delayedq.migration.add_priority_column` in a revision of its own, or from
autogenerate.

Revision ID: delayedq_0006
Revises: delayedq_0005
Create Date: 2026-11-26 12:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

from sqla_delayedq.migration import (
    add_group_column,
    add_priority_column,
    drop_group_column,
    drop_priority_column,
)

revision: str = "delayedq_0006"
down_revision: str | Sequence[str] | None = "delayedq_0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    add_group_column("delayed_queue")
    add_priority_column("delayed_queue")


def downgrade() -> None:
    drop_priority_column("delayed_queue")
    drop_group_column("delayed_queue")
