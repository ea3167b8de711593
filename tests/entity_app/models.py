"""The host's ``orders`` table, before and after it gains the entity-queue columns.

``BeforeBase``/``OrderBefore`` is the application as it was (domain columns only);
``Base``/``Order`` is the same table with :class:`~sqla_delayedq.entity.EntityQueueMixin` added,
which is what Alembic autogenerates the ``ALTER`` migration from.
"""

from __future__ import annotations

from sqlalchemy import BigInteger, Integer, MetaData, String, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from sqla_delayedq.entity import EntityQueueMixin

TABLE = "eq_orders"
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "pk": "pk_%(table_name)s",
}
ID_TYPE = BigInteger().with_variant(Integer(), "sqlite")


class BeforeBase(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class OrderBefore(BeforeBase):
    __tablename__ = TABLE
    # The host's own table arguments: the mixin must not need to replace them.
    __table_args__ = (UniqueConstraint("reference"),)

    id: Mapped[int] = mapped_column(ID_TYPE, primary_key=True, autoincrement=True)
    reference: Mapped[str] = mapped_column(String(40), nullable=False)
    company_id: Mapped[int] = mapped_column(Integer, nullable=False, index=True)
    amount_cents: Mapped[int] = mapped_column(Integer, nullable=False)
    charge_count: Mapped[int] = mapped_column(Integer, nullable=False, server_default="0")
    payment_ref: Mapped[str | None] = mapped_column(String(64), nullable=True)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Order(EntityQueueMixin, Base):
    __tablename__ = TABLE
    __table_args__ = (UniqueConstraint("reference"),)

    id: Mapped[int] = mapped_column(ID_TYPE, primary_key=True, autoincrement=True)
    reference: Mapped[str] = mapped_column(String(40), nullable=False)
    company_id: Mapped[int] = mapped_column(Integer, nullable=False, index=True)
    amount_cents: Mapped[int] = mapped_column(Integer, nullable=False)
    charge_count: Mapped[int] = mapped_column(
        Integer, nullable=False, default=0, server_default="0"
    )
    payment_ref: Mapped[str | None] = mapped_column(String(64), nullable=True)
