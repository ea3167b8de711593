"""Message headers: a nullable ``headers`` column on ``delayed_queue`` (a JSON object of strings).

Offers may send headers along with a message (a trace context, a request id); a worker reads them
back in ``Envelope.headers``. Existing rows keep no headers. A host's own message table gets the
same column from :func:`sqla_delayedq.migration.add_headers_column` in a revision of its own, or
from autogenerate.

Revision ID: delayedq_0005
Revises: delayedq_0004
Create Date: 2026-11-26 11:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

from sqla_delayedq.migration import add_headers_column, drop_headers_column

revision: str = "delayedq_0005"
down_revision: str | Sequence[str] | None = "delayedq_0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    add_headers_column("delayed_queue")


def downgrade() -> None:
    drop_headers_column("delayed_queue")
