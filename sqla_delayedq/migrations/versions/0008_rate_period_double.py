"""The rate limit's period in double precision on MariaDB/MySQL.

``delayedq_queue_controls.rate_period`` was a ``FLOAT``, single precision there: a period of
more than six significant digits read back rounded (``12 days, 1 s`` as ``12 days``), so the
window was shorter than the one set. PostgreSQL's and SQLite's were double precision already;
nothing changes there. The periods stored keep their rounded value: set a limit again to store
it exactly.

Revision ID: delayedq_0008
Revises: delayedq_0007
Create Date: 2026-11-29 07:30:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from sqla_delayedq._engine import Family, family

revision: str = "delayedq_0008"
down_revision: str | Sequence[str] | None = "delayedq_0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _period(to: sa.types.TypeEngine[float], was: sa.types.TypeEngine[float]) -> None:
    if family(op.get_context().dialect) is not Family.MYSQL:
        return
    op.alter_column(
        "delayedq_queue_controls",
        "rate_period",
        type_=to,
        existing_type=was,
        existing_nullable=True,
    )


def upgrade() -> None:
    _period(sa.Double(), sa.Float())


def downgrade() -> None:
    _period(sa.Float(), sa.Double())
