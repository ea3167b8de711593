"""Alembic support: operations that create and drop a message table, and an autogenerate hook.

A host application gets its message table in one of two ways; both produce the table that
:class:`~sqla_delayedq.QueueMessageMixin` defines (columns, per-backend types, the unique
``(queue, key)`` constraint, the due and lock-token indexes, the status check, server defaults).

**Autogenerate.** Map a class with the mixin on the application's own ``Base``; ``alembic revision
--autogenerate`` then writes the table and its indexes into a revision like any other model. Pass
:func:`render_item` to ``context.configure()`` in ``env.py``. Without it Alembic renders the
timestamp columns as ``sqla_delayedq._time.DateTimeUTC()``, a private type the revision does not
import, and, when it autogenerates against a database other than PostgreSQL, the payload column's
PostgreSQL variant as ``postgresql.JSONB(astext_type=Text())`` with ``Text`` undefined; either
makes the revision fail on every backend. With the hook both render as plain SQLAlchemy types, so
the revision is frozen DDL that runs anywhere::

    from sqla_delayedq.migration import render_item

    context.configure(connection=connection, target_metadata=Base.metadata,
                      render_item=render_item)

**Hand-written migrations.** Call the operations from a revision's ``upgrade()`` and
``downgrade()``::

    from sqla_delayedq.migration import create_queue_table, drop_queue_table

    def upgrade() -> None:
        create_queue_table("outbox")

    def downgrade() -> None:
        drop_queue_table("outbox")

They build the table from the mixin at the time the migration runs, so it cannot drift from the
model of the installed version. (A later version that changes the table ships the operations for
the change.) This is how the repository's own ``alembic/`` migrations create ``delayed_queue``.

This module imports Alembic; ``import sqla_delayedq`` does not import it.
"""

from __future__ import annotations

from typing import Any, Literal, cast

from alembic import op
from alembic.autogenerate.api import AutogenContext
from alembic.operations import ops
from sqlalchemy import MetaData, Table
from sqlalchemy.dialects import postgresql
from sqlalchemy.orm import DeclarativeBase

from ._time import DateTimeUTC
from .models import NAMING_CONVENTION, QueueMessageMixin

__all__ = ["create_queue_table", "drop_queue_table", "queue_table", "render_item"]

DEFAULT_TABLE = "delayed_queue"

#: What :class:`DateTimeUTC` is in DDL on each backend, as plain SQLAlchemy (``sa`` prefix added).
DATETIME_UTC_DDL = "DateTime(timezone=True).with_variant(mysql.DATETIME(fsp=6), 'mysql', 'mariadb')"


def queue_table(table_name: str = DEFAULT_TABLE, *, schema: str | None = None) -> Table:
    """The :class:`~sqlalchemy.schema.Table` the mixin defines, on a fresh ``MetaData``.

    Built by mapping a throwaway class, so it is exactly what a host's own model gets; the primary
    key is named by this package's naming convention (``pk_<table>``).
    """
    throwaway = MetaData(schema=schema, naming_convention=NAMING_CONVENTION)

    class _Base(DeclarativeBase):
        metadata = throwaway

    class _Message(QueueMessageMixin, _Base):
        __tablename__ = table_name

    return cast(Table, _Message.__table__)


def create_queue_table(table_name: str = DEFAULT_TABLE, *, schema: str | None = None) -> Table:
    """Create a message table and its indexes, as autogenerate would; returns the new table.

    Call inside a migration's ``upgrade()``; works online and in ``--sql`` (offline) mode.
    """
    table = queue_table(table_name, schema=schema)
    created: Table = op.invoke(ops.CreateTableOp.from_table(table))
    for index in sorted(table.indexes, key=lambda ix: str(ix.name)):
        op.invoke(ops.CreateIndexOp.from_index(index))
    return created


def drop_queue_table(table_name: str = DEFAULT_TABLE, *, schema: str | None = None) -> None:
    """Drop a message table; its indexes and constraints go with it on every backend."""
    op.drop_table(table_name, schema=schema)


def render_item(type_: str, obj: Any, autogen_context: AutogenContext) -> str | Literal[False]:
    """An Alembic ``render_item`` hook: renders the mixin's column types as plain SQLAlchemy.

    Returns ``False`` for everything else, so Alembic's default rendering applies; a project with
    its own hook can call this one first and fall back to its own.
    """
    if type_ != "type":
        return False
    prefix = autogen_context.opts.get("sqlalchemy_module_prefix") or ""
    if isinstance(obj, DateTimeUTC):
        autogen_context.imports.add("from sqlalchemy.dialects import mysql")
        return f"{prefix}{DATETIME_UTC_DDL}"
    if isinstance(obj, postgresql.JSON):
        # Alembic prefixes astext_type only when the migration context is PostgreSQL's.
        autogen_context.imports.add("from sqlalchemy.dialects import postgresql")
        args = [f"astext_type={prefix}{obj.astext_type!r}"]
        if obj.none_as_null:
            args.append("none_as_null=True")
        return f"postgresql.{type(obj).__name__}({', '.join(args)})"
    return False
