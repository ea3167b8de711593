"""A partial lock-token index on ``delayed_queue`` (PostgreSQL and SQLite).

``ix_delayed_queue_lock_token`` covers only rows that have a lock token (``WHERE lock_token IS
NOT NULL``): an offer writes no entry in it, so each message leaves one dead index entry fewer
for ``VACUUM`` (issue 19). MariaDB/MySQL have no partial indexes; nothing changes there. A host's
own message table gets the same index from
:func:`sqla_delayedq.migration.upgrade_lock_token_index` in a revision of its own.

Revision ID: delayedq_0007
Revises: delayedq_0006
Create Date: 2026-11-26 15:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

from sqla_delayedq.migration import downgrade_lock_token_index, upgrade_lock_token_index

revision: str = "delayedq_0007"
down_revision: str | Sequence[str] | None = "delayedq_0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    upgrade_lock_token_index("delayed_queue")


def downgrade() -> None:
    downgrade_lock_token_index("delayed_queue")
