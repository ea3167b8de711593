"""Alembic support: operations for a host's own message table, and the autogenerate renderer.

A host application gets its message table in one of two ways; both produce the table that
:class:`~sqla_delayedq.QueueMessageMixin` defines (columns, per-backend types, the unique
``(queue, key)`` constraint, the due and lock-token indexes, the status check, server defaults).

**Autogenerate.** Map a class with the mixin on the application's own ``Base``; ``alembic revision
--autogenerate`` then writes the table and its indexes into a revision like any other model. The
mixin's column types are written as plain SQLAlchemy (no import of this package in the revision)
by :func:`render_item`, which Alembic consults for those types only. Passing it to
``context.configure(render_item=...)`` in ``env.py`` is optional: a project with a hook of its own
keeps it, and ours is consulted after it.

**Hand-written migrations.** Call the operations from a revision's ``upgrade()`` and
``downgrade()``::

    from sqla_delayedq.migration import create_queue_table, drop_queue_table

    def upgrade() -> None:
        create_queue_table("outbox")

    def downgrade() -> None:
        drop_queue_table("outbox")

``create_queue_table`` builds the table from the mixin of the installed version. A table created
by an older version gets each later change from an operation shipped for it, which a revision of
the host's calls once: :func:`upgrade_key_collation` (keys compared byte for byte on
MariaDB/MySQL), :func:`add_headers_column` (message headers, the change of ``delayedq_0005``)
and :func:`add_group_column` and :func:`add_priority_column` (message groups and priorities,
``delayedq_0006``), :func:`upgrade_lock_token_index` (the lock-token index made partial,
``delayedq_0007``).
Each such operation emits fixed DDL and is harmless on a table that has the change
already, so a revision stays correct whichever version created the table.

This module imports Alembic; ``import sqla_delayedq`` does not import it.
"""

from __future__ import annotations

from typing import Any, Literal, cast

import sqlalchemy as sa
from alembic import op
from alembic.autogenerate.api import AutogenContext
from alembic.operations import ops
from sqlalchemy import MetaData, Table
from sqlalchemy.dialects import mysql
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase

from ._engine import Family, family
from ._time import DateTimeUTC
from .models import (
    LOCK_TOKEN_PREDICATE,
    MARIADB_EXACT_COLLATION,
    MYSQL_EXACT_COLLATION,
    NAMING_CONVENTION,
    PG_JSONB,
    ExactString,
    QueueMessageMixin,
    exact_collation,
)

__all__ = [
    "add_group_column",
    "add_headers_column",
    "add_priority_column",
    "create_queue_table",
    "downgrade_key_collation",
    "downgrade_lock_token_index",
    "drop_group_column",
    "drop_headers_column",
    "drop_priority_column",
    "drop_queue_table",
    "queue_table",
    "render_item",
    "upgrade_key_collation",
    "upgrade_lock_token_index",
]

DEFAULT_TABLE = "delayed_queue"

#: What :class:`DateTimeUTC` is in DDL on each backend, as plain SQLAlchemy (``sa`` prefix added).
DATETIME_UTC_DDL = "DateTime(timezone=True).with_variant(mysql.DATETIME(fsp=6), 'mysql', 'mariadb')"

#: The key columns of every message table created before keys became byte-exact: (name, length).
KEY_COLUMNS = (("queue", 100), ("key", 200))
#: Their collation then, on MariaDB/MySQL: binary, but PAD SPACE (``'k' = 'k '``).
PAD_SPACE_COLLATION = "utf8mb4_bin"


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


def upgrade_key_collation(table_name: str = DEFAULT_TABLE, *, schema: str | None = None) -> None:
    """Make ``queue`` and ``key`` compare byte for byte on MariaDB/MySQL; a no-op elsewhere.

    For a message table created by sqla_delayedq 0.1.0 (``utf8mb4_bin``, where ``'k'`` and
    ``'k '`` are one key): ``ALTER TABLE ... MODIFY`` both columns to the NO PAD binary collation
    (``utf8mb4_nopad_bin`` on MariaDB, ``utf8mb4_0900_bin`` on MySQL 8.0.17+). Rows are kept; no
    two existing keys can become equal. Harmless on a table that has the collation already. Its
    DDL is fixed: revisions call it, so a later release never changes what it emits. MariaDB is
    recognised on a live connection whatever the URL; offline (``--sql``) use a ``mariadb://``
    URL for MariaDB.
    """
    dialect = op.get_context().dialect
    if family(dialect) is Family.MYSQL:
        _alter_key_collation(table_name, schema, exact_collation(dialect))


def downgrade_key_collation(table_name: str = DEFAULT_TABLE, *, schema: str | None = None) -> None:
    """Undo :func:`upgrade_key_collation`: back to ``utf8mb4_bin``; a no-op elsewhere.

    Fails (duplicate key) while two keys of one queue differ only in trailing spaces.
    """
    if family(op.get_context().dialect) is Family.MYSQL:
        _alter_key_collation(table_name, schema, PAD_SPACE_COLLATION)


def add_headers_column(table_name: str = DEFAULT_TABLE, *, schema: str | None = None) -> None:
    """Add the nullable ``headers`` column (``TEXT``: a JSON object of strings) that messages
    carry (the default table got it in revision ``delayedq_0005``); existing rows get none.
    Harmless on a table that has it already (made by autogenerate or by a ``create_queue_table``
    that knows headers): the column is added only when a live connection shows it missing;
    offline (``--sql``) it is always emitted."""
    if _has_column(table_name, "headers", schema):
        return
    op.add_column(table_name, sa.Column("headers", sa.Text(), nullable=True), schema=schema)


def drop_headers_column(table_name: str = DEFAULT_TABLE, *, schema: str | None = None) -> None:
    """Undo :func:`add_headers_column`: the headers of stored messages are lost."""
    op.drop_column(table_name, "headers", schema=schema)


def add_group_column(table_name: str = DEFAULT_TABLE, *, schema: str | None = None) -> None:
    """Add the nullable ``group_key`` column (a key: ``VARCHAR(200)``, byte-exact) and its index
    ``ix_<table>_group`` (queue, group_key, scheduled_at_initially, id; partial, ``WHERE group_key
    IS NOT NULL``, on PostgreSQL and SQLite) that message groups need (``delayedq_0006`` for the
    default table); existing rows get no group. Harmless on a table that has the column already;
    offline (``--sql``) it is always emitted."""
    if _has_column(table_name, "group_key", schema):
        return
    dialect = op.get_context().dialect
    type_: Any = sa.String(200)
    if family(dialect) is Family.MYSQL:
        type_ = mysql.VARCHAR(200, charset="utf8mb4", collation=exact_collation(dialect))
    column = sa.Column("group_key", type_, nullable=True)
    index = ["queue", "group_key", "scheduled_at_initially", "id"]
    _add_indexed_column(table_name, column, "group", index, "group_key IS NOT NULL", schema)


def drop_group_column(table_name: str = DEFAULT_TABLE, *, schema: str | None = None) -> None:
    """Undo :func:`add_group_column`: the groups of stored messages are lost."""
    _drop_indexed_column(table_name, "group_key", "group", schema)


def add_priority_column(table_name: str = DEFAULT_TABLE, *, schema: str | None = None) -> None:
    """Add the ``priority`` column (``INTEGER NOT NULL DEFAULT 0``) and its index
    ``ix_<table>_priority`` (queue, priority DESC, scheduled_at, id; partial, ``WHERE priority >
    0``, on PostgreSQL and SQLite) that message priorities need (``delayedq_0006`` for the default
    table); existing rows get priority 0. Harmless on a table that has the column already;
    offline (``--sql``) it is always emitted."""
    if _has_column(table_name, "priority", schema):
        return
    column = sa.Column("priority", sa.Integer(), server_default="0", nullable=False)
    index = ["queue", sa.text("priority DESC"), "scheduled_at", "id"]
    _add_indexed_column(table_name, column, "priority", index, "priority > 0", schema)


def drop_priority_column(table_name: str = DEFAULT_TABLE, *, schema: str | None = None) -> None:
    """Undo :func:`add_priority_column`: the priorities of stored messages are lost."""
    _drop_indexed_column(table_name, "priority", "priority", schema)


def upgrade_lock_token_index(table_name: str = DEFAULT_TABLE, *, schema: str | None = None) -> None:
    """Make ``ix_<table>_lock_token`` partial (``WHERE lock_token IS NOT NULL``) on PostgreSQL
    and SQLite (``delayedq_0007`` for the default table); a no-op on MariaDB/MySQL, which have no
    partial indexes.

    Only leased rows have a token, and only they are looked up by it: an offer then writes no
    entry in this index, and each message leaves one dead index entry fewer for ``VACUUM``. The
    index is dropped and created again in the revision's transaction (the table is locked for
    the build; a queue table is small). Harmless on an index that is partial already; offline
    (``--sql``) it is always emitted.
    """
    _set_lock_token_index(table_name, schema, partial=True)


def downgrade_lock_token_index(
    table_name: str = DEFAULT_TABLE, *, schema: str | None = None
) -> None:
    """Undo :func:`upgrade_lock_token_index`: the index covers every row again."""
    _set_lock_token_index(table_name, schema, partial=False)


def _set_lock_token_index(table_name: str, schema: str | None, *, partial: bool) -> None:
    """Make ``ix_<table>_lock_token`` partial or full, unless it is already (or the backend has
    no partial indexes)."""
    if family(op.get_context().dialect) is Family.MYSQL:
        return
    state = _index_predicate(table_name, "lock_token", schema)
    if state == ("partial" if partial else "full"):
        return
    name = f"ix_{table_name}_lock_token"
    where: dict[str, Any] = {}
    if partial:
        predicate = sa.text(LOCK_TOKEN_PREDICATE)
        where = {"postgresql_where": predicate, "sqlite_where": predicate}
    if state != "missing":
        op.drop_index(name, table_name=table_name, schema=schema)
    op.create_index(name, table_name, ["lock_token"], schema=schema, **where)


def _index_predicate(
    table_name: str, suffix: str, schema: str | None
) -> Literal["partial", "full", "missing", "offline"]:
    """Whether ``ix_<table>_<suffix>`` has a ``WHERE`` clause, from the catalog's own DDL of it
    (PostgreSQL's ``pg_indexes``, SQLite's ``sqlite_master``); offline nothing is known."""
    context = op.get_context()
    if context.as_sql:
        return "offline"
    name = f"ix_{table_name}_{suffix}"
    if family(context.dialect) is Family.POSTGRESQL:
        query = sa.text(
            "SELECT indexdef FROM pg_indexes WHERE indexname = :name"
            " AND schemaname = coalesce(:schema, current_schema())"
        )
        params: dict[str, Any] = {"name": name, "schema": schema}
    else:
        master = "sqlite_master" if schema is None else f'"{schema}".sqlite_master'
        query = sa.text(f"SELECT sql FROM {master} WHERE type = 'index' AND name = :name")
        params = {"name": name}
    ddl = op.get_bind().execute(query, params).scalar()
    if ddl is None:
        return "missing"
    return "partial" if " WHERE " in ddl.upper() else "full"


def _add_indexed_column(
    table_name: str,
    column: sa.Column[Any],
    index_suffix: str,
    index_columns: list[Any],
    where: str,
    schema: str | None,
) -> None:
    """A column and its index ``ix_<table>_<suffix>``, partial (``WHERE where``) on PostgreSQL
    and SQLite; MariaDB/MySQL have no partial indexes and index every row."""
    op.add_column(table_name, column, schema=schema)
    op.create_index(
        f"ix_{table_name}_{index_suffix}",
        table_name,
        index_columns,
        schema=schema,
        postgresql_where=sa.text(where),
        sqlite_where=sa.text(where),
    )


def _drop_indexed_column(
    table_name: str, column: str, index_suffix: str, schema: str | None
) -> None:
    op.drop_index(f"ix_{table_name}_{index_suffix}", table_name=table_name, schema=schema)
    op.drop_column(table_name, column, schema=schema)


def _has_column(table_name: str, column: str, schema: str | None) -> bool:
    context = op.get_context()
    if context.as_sql:
        return False
    names = {c["name"] for c in sa.inspect(op.get_bind()).get_columns(table_name, schema=schema)}
    return column in names


def _alter_key_collation(table_name: str, schema: str | None, collation: str) -> None:
    for column, length in KEY_COLUMNS:
        op.alter_column(
            table_name,
            column,
            type_=mysql.VARCHAR(length, charset="utf8mb4", collation=collation),
            existing_nullable=False,
            schema=schema,
        )


def render_item(type_: str, obj: Any, autogen_context: AutogenContext) -> str | Literal[False]:
    """An Alembic ``render_item`` hook: renders the mixin's column types as plain SQLAlchemy.

    Returns ``False`` for everything else, so Alembic's default rendering (or another hook)
    applies. The key columns get their byte-exact collation per dialect name; when autogenerate
    runs against MariaDB through a ``mysql://`` URL, the ``mysql`` variant gets MariaDB's too, so
    the revision runs on the server it was generated against whatever its URL.
    """
    if type_ != "type":
        return False
    prefix = autogen_context.opts.get("sqlalchemy_module_prefix") or ""
    if isinstance(obj, DateTimeUTC):
        autogen_context.imports.add("from sqlalchemy.dialects import mysql")
        return f"{prefix}{DATETIME_UTC_DDL}"
    if isinstance(obj, ExactString):
        autogen_context.imports.add("from sqlalchemy.dialects import mysql")
        return f"{prefix}{_exact_string_ddl(obj.length, autogen_context.dialect)}"
    if obj is PG_JSONB:
        # Alembic prefixes astext_type only when the migration context is PostgreSQL's.
        autogen_context.imports.add("from sqlalchemy.dialects import postgresql")
        return f"postgresql.JSONB(astext_type={prefix}Text())"
    return False


def _exact_string_ddl(length: int, dialect: Dialect | None) -> str:
    """:class:`ExactString` as plain SQLAlchemy: a ``String`` with a variant per dialect name."""
    # The name 'mysql' means MySQL, unless autogenerate itself reached MariaDB under it.
    for_mysql = (
        exact_collation(dialect)
        if dialect is not None and family(dialect) is Family.MYSQL
        else MYSQL_EXACT_COLLATION
    )

    def varchar(collation: str) -> str:
        return f"mysql.VARCHAR(length={length}, charset='utf8mb4', collation='{collation}')"

    return (
        f"String(length={length})"
        f".with_variant({varchar(MARIADB_EXACT_COLLATION)}, 'mariadb')"
        f".with_variant({varchar(for_mysql)}, 'mysql')"
    )
