"""The host's models: a domain table and its outbox of messages, on the host's own ``Base``."""

from __future__ import annotations

from sqlalchemy import String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from sqla_delayedq import QueueMessageMixin


class Base(DeclarativeBase):
    pass


class Customer(Base):
    __tablename__ = "customers"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(200))


class Outbox(QueueMessageMixin, Base):
    __tablename__ = "hostapp_outbox"
