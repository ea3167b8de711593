"""The host's orders table as it was before entity queues: domain columns only.

Revision ID: 0001
Revises:
Create Date: 2026-11-22 14:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "eq_orders",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("reference", sa.String(length=40), nullable=False),
        sa.Column("company_id", sa.Integer(), nullable=False),
        sa.Column("amount_cents", sa.Integer(), nullable=False),
        sa.Column("charge_count", sa.Integer(), server_default="0", nullable=False),
        sa.Column("payment_ref", sa.String(length=64), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_eq_orders")),
        sa.UniqueConstraint("reference", name=op.f("uq_eq_orders_reference")),
    )
    op.create_index(op.f("ix_eq_orders_company_id"), "eq_orders", ["company_id"])


def downgrade() -> None:
    op.drop_index(op.f("ix_eq_orders_company_id"), table_name="eq_orders")
    op.drop_table("eq_orders")
