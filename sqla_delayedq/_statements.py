"""Pure statement builders: each returns a Core construct and does no I/O.

Unit tests compile them for each dialect and read the SQL; operations execute them on the
caller's Session. Every value is a bound parameter, so SQLAlchemy's compiled-statement cache
serves repeated calls.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any, Literal

from sqlalchemy import (
    BigInteger,
    Boolean,
    DateTime,
    Integer,
    String,
    Table,
    and_,
    any_,
    bindparam,
    case,
    cast,
    column,
    delete,
    func,
    literal,
    select,
    update,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql import ColumnElement, Delete, Select, Update
from sqlalchemy.sql.visitors import InternalTraversal

from ._time import DateTimeUTC

Lock = Literal["update", "share", "update_skip_locked"] | None

# Every column of a message row, in a fixed order, for selects and RETURNING.
ROW_COLUMNS = (
    "id",
    "queue",
    "key",
    "payload_type",
    "payload",
    "payload_bytes",
    "status",
    "scheduled_at",
    "scheduled_at_initially",
    "created_at",
    "lock_token",
    "attempts",
    "last_attempt_at",
    "last_error",
)


#: What a take needs of a row: everything but the status and the last failure's details (an
#: error text can be kilobytes; a take never reads it).
TAKE_COLUMNS = tuple(c for c in ROW_COLUMNS if c not in ("status", "last_attempt_at", "last_error"))


def affected(session: Any, stmt: Any, params: Any = None) -> int:
    """Execute a DML statement and return how many rows it matched."""
    result: Any = session.execute(stmt, params)
    return int(result.rowcount)


def columns(t: Table, names: tuple[str, ...] = ROW_COLUMNS) -> list[Any]:
    return [t.c[name] for name in names]


class P:
    """Named bind parameters of the statements that strategies build once and cache."""

    queue = bindparam("c_queue", type_=String())
    now = bindparam("c_now", type_=DateTimeUTC())
    until = bindparam("c_until", type_=DateTimeUTC())
    limit = bindparam("c_limit", type_=Integer())
    prefix = bindparam("c_prefix", type_=String())
    ids = bindparam("c_ids", type_=postgresql.ARRAY(BigInteger()))
    tokens = bindparam("c_tokens", type_=postgresql.ARRAY(String()))

    @staticmethod
    def take(queue: str, now: datetime, until: datetime, limit: int, prefix: str) -> dict[str, Any]:
        return {
            "c_queue": queue,
            "c_now": now,
            "c_until": until,
            "c_limit": limit,
            "c_prefix": prefix,
        }


def with_lock(stmt: Select[Any], lock: Lock) -> Select[Any]:
    if lock == "update":
        return stmt.with_for_update()
    if lock == "share":
        return stmt.with_for_update(read=True)
    if lock == "update_skip_locked":
        return stmt.with_for_update(skip_locked=True)
    return stmt


def select_by_key(t: Table, queue: str, key: str, lock: Lock = None) -> Select[Any]:
    stmt = select(*columns(t)).where(t.c.queue == queue, t.c.key == key)
    return with_lock(stmt, lock)


def select_by_keys(t: Table, queue: str, keys: Sequence[str], lock: Lock = None) -> Select[Any]:
    stmt = select(*columns(t)).where(t.c.queue == queue, t.c.key.in_(keys)).order_by(t.c.key)
    return with_lock(stmt, lock)


def due_filter(t: Table, queue: Any, now: Any) -> ColumnElement[bool]:
    return and_(t.c.queue == queue, t.c.scheduled_at <= now)


def select_due(t: Table, queue: Any, now: Any, limit: Any, lock: Lock) -> Select[Any]:
    """Due messages of one queue in schedule order: a range scan of the ``due`` index."""
    stmt = (
        select(*columns(t, TAKE_COLUMNS))
        .where(due_filter(t, queue, now))
        .order_by(t.c.scheduled_at, t.c.id)
        .limit(limit)
    )
    return with_lock(stmt, lock)


class ArrayOf(ColumnElement[Any]):
    """PostgreSQL's ``ARRAY(subquery)``: the subquery's rows as one array value.

    ``id = ANY(ARRAY(SELECT id FROM picked))`` is evaluated once, before the scan, so the
    planner probes the primary key instead of hash-joining a sequential scan of the table.
    """

    inherit_cache = True

    def __init__(self, subquery: Select[Any]) -> None:
        self.subquery = subquery
        self.type = postgresql.ARRAY(BigInteger())

    _traverse_internals = [("subquery", InternalTraversal.dp_clauseelement)]


@compiles(ArrayOf, "postgresql")
def _compile_array_of(element: ArrayOf, compiler: Any, **kw: Any) -> str:
    return f"ARRAY({compiler.process(element.subquery, **kw)})"


def take_values(t: Table, lease_until: Any, prefix: Any) -> list[tuple[Any, Any]]:
    """SET clauses of a take, in order: MySQL evaluates them left to right on updated values.

    A take that follows an expired lease (the lock token is still set) counts the lost attempt,
    so a message that keeps killing or hanging its consumers ends up dead.
    """
    lost = case((t.c.lock_token.is_(None), 0), else_=1)
    return [
        (t.c.attempts, t.c.attempts + lost),
        (t.c.scheduled_at, lease_until),
        (t.c.lock_token, token_expr(t, prefix)),
    ]


def token_expr(t: Table, prefix: Any) -> ColumnElement[str]:
    """A per-row lock token: a random per-take prefix joined to the row id."""
    if isinstance(prefix, str):
        prefix = literal(prefix, String)
    return prefix + cast(t.c.id, String)  # type: ignore[no-any-return]


def claim_returning(
    t: Table, queue: Any, now: Any, lease_until: Any, limit: Any, prefix: Any
) -> Update:
    """PostgreSQL: pick with ``SKIP LOCKED`` and take in one statement.

    ``RETURNING`` carries the picked row's previous lock token and due time, so delivery
    (first or redelivery) is decided from the row as it was before the take.
    """
    picked = (
        select(
            t.c.id.label("id"),
            t.c.lock_token.label("prev_token"),
            t.c.scheduled_at.label("prev_scheduled_at"),
        )
        .where(due_filter(t, queue, now))
        .order_by(t.c.scheduled_at, t.c.id)
        .limit(limit)
        .with_for_update(skip_locked=True)
        .cte("picked")
    )
    return (
        update(t)
        .where(t.c.id == picked.c.id, t.c.id == any_(ArrayOf(select(picked.c.id))))
        .ordered_values(*take_values(t, lease_until, prefix))
        .returning(*columns(t, TAKE_COLUMNS), picked.c.prev_token, picked.c.prev_scheduled_at)
    )


def consume_returning(t: Table, queue: Any, now: Any, limit: Any, skip_locked: bool) -> Any:
    """Take due rows by deleting them inside the caller's transaction (seed 002).

    The rows come back as they were; a rollback restores them, due at once.
    """
    picked = select(t.c.id).where(due_filter(t, queue, now)).order_by(t.c.scheduled_at, t.c.id)
    picked = picked.limit(limit)
    if skip_locked:
        picked = picked.with_for_update(skip_locked=True)
        cond = t.c.id == any_(ArrayOf(picked))
    else:
        cond = t.c.id.in_(picked.scalar_subquery())
    return delete(t).where(cond).returning(*columns(t, TAKE_COLUMNS))


def recordset_insert(t: Table) -> Any:
    """PostgreSQL: insert a whole chunk from one JSON document, skipping existing keys.

    The rows travel as one ``jsonb`` parameter expanded by ``jsonb_to_recordset``: one statement
    and four parameters whatever the chunk size; payloads are spliced into the document as the
    serializer wrote them, and a missing due time means ``u_now``. Rows go in in key order, so
    concurrent batches take their unique-index locks in the same order; ``RETURNING key`` says
    which were written.
    """
    r = (
        func.jsonb_to_recordset(cast(bindparam("u_rows", type_=String()), postgresql.JSONB()))
        .table_valued(
            column("k", String()),
            column("p", postgresql.JSONB()),
            column("b", String()),
            column("a", DateTime(timezone=True)),
            column("a0", DateTime(timezone=True)),
        )
        .render_derived(name="r", with_types=True)
    )
    now = bindparam("u_now", type_=DateTime(timezone=True))
    rows = select(
        bindparam("u_queue", type_=String()),
        r.c.k,
        bindparam("u_type", type_=String()),
        r.c.p,
        func.decode(r.c.b, literal("hex")),
        literal("pending"),
        func.coalesce(r.c.a, now),
        func.coalesce(r.c.a0, r.c.a, now),
        now,
        literal(0),
    ).order_by(r.c.k)
    names = [
        "queue",
        "key",
        "payload_type",
        "payload",
        "payload_bytes",
        "status",
        "scheduled_at",
        "scheduled_at_initially",
        "created_at",
        "attempts",
    ]
    return (
        postgresql.insert(t)
        .from_select(names, rows)
        .on_conflict_do_nothing(index_elements=["queue", "key"])
        .returning(t.c.key)
    )


def take_ids(t: Table, ids: Sequence[int], now: Any, lease_until: Any, prefix: Any) -> Update:
    """Take already-picked rows; the ``scheduled_at <= now`` guard makes it a compare-and-swap."""
    return (
        update(t)
        .where(t.c.id.in_(ids), t.c.scheduled_at <= now)
        .ordered_values(*take_values(t, lease_until, prefix))
    )


def guarded_update(
    t: Table, row_id: int, seen_scheduled_at: datetime | None, seen_token: str | None
) -> Update:
    """Update one row only if it is still as it was read (compare-and-swap)."""
    return update(t).where(
        t.c.id == row_id,
        t.c.scheduled_at.is_not_distinct_from(seen_scheduled_at),
        t.c.lock_token.is_not_distinct_from(seen_token),
    )


#: The statements behind ack, nack, release, extend and a burial, by name.
SettleName = Literal["ack", "done", "nack", "bury", "release", "extend"]


def settle(t: Table, name: SettleName) -> Delete | Update:
    """A settle statement guarded by (id, lock token), built once per table.

    Named parameters: ``s_id`` and ``s_token`` always; ``s_at`` (the new due time) for nack,
    release and extend; ``s_now`` for done, nack and bury; ``s_attempts`` and ``s_error`` for
    nack and bury. Building it once spares each call the construction and cache-key walk.
    """
    c = t.c
    guard = and_(
        c.id == bindparam("s_id", type_=c.id.type),
        c.lock_token == bindparam("s_token", type_=c.lock_token.type),
    )
    if name == "ack":
        return delete(t).where(guard)
    at = bindparam("s_at", type_=c.scheduled_at.type)
    now = bindparam("s_now", type_=c.scheduled_at.type)
    failure = {
        "attempts": bindparam("s_attempts", type_=c.attempts.type),
        "last_error": bindparam("s_error", type_=c.last_error.type),
        "last_attempt_at": now,
    }
    values: dict[str, Any]
    if name == "done":
        values = {
            "status": "done",
            "scheduled_at": None,
            "lock_token": None,
            "last_attempt_at": now,
        }
    elif name == "nack":
        values = {"scheduled_at": at, "lock_token": None, **failure}
    elif name == "bury":
        values = {"status": "dead", "scheduled_at": None, "lock_token": None, **failure}
    elif name == "release":
        values = {"scheduled_at": at, "lock_token": None}
    elif name == "extend":
        values = {"scheduled_at": at}
    else:
        raise ValueError(f"unknown settle statement {name!r}")
    return update(t).where(guard).values(values)


def count_by_state(t: Table, queue: str, now: datetime) -> Select[Any]:
    """Counts per state for one queue in one scan of its rows."""
    leased = and_(t.c.status == "pending", t.c.lock_token.is_not(None), t.c.scheduled_at > now)
    due = and_(t.c.status == "pending", t.c.scheduled_at <= now)
    later = and_(t.c.status == "pending", t.c.lock_token.is_(None), t.c.scheduled_at > now)

    def n(cond: ColumnElement[bool]) -> Any:
        return func.coalesce(func.sum(case((cond, 1), else_=0)), 0)

    return select(
        n(due).label("due"),
        n(later).label("scheduled"),
        n(leased).label("in_flight"),
        n(t.c.status == "dead").label("dead"),
        n(t.c.status == "done").label("done"),
    ).where(t.c.queue == queue)


def state_clause(t: Table, state: str, now: datetime) -> ColumnElement[bool]:
    """SQL for one :class:`~sqla_delayedq.State` value."""
    pending = t.c.status == "pending"
    if state == "due":
        return and_(pending, t.c.scheduled_at <= now)
    if state == "scheduled":
        return and_(pending, t.c.lock_token.is_(None), t.c.scheduled_at > now)
    if state == "in_flight":
        return and_(pending, t.c.lock_token.is_not(None), t.c.scheduled_at > now)
    if state == "pending":
        return pending
    return t.c.status == state


class JsonFieldEquals(ColumnElement[bool]):
    """``payload.<name> == value`` comparing JSON values, types included, on every backend.

    A cast (``->>`` then ``::int``) would fail on rows whose field holds text and would match
    ``"5"`` to ``5``; this compares JSON to JSON instead: containment (``@>``) on PostgreSQL,
    ``JSON_CONTAINS`` on MariaDB/MySQL, ``json_type`` plus ``json_extract`` on SQLite. Numbers
    compare by value (``5`` matches ``5.0``); strings, numbers and booleans never match each other.
    """

    inherit_cache = True
    type = Boolean()

    def __init__(self, column: Any, name: str, value: str | int | float | bool) -> None:
        self.column = column
        self.name = name
        self.value = value
        self.document = bindparam(None, json.dumps({name: value}), type_=String())
        self.scalar = bindparam(None, json.dumps(value), type_=String())
        self.path = bindparam(None, "$." + json.dumps(name), type_=String())
        self.raw: Any = bindparam(None, value)

    _traverse_internals = [
        ("column", InternalTraversal.dp_clauseelement),
        ("document", InternalTraversal.dp_clauseelement),
        ("scalar", InternalTraversal.dp_clauseelement),
        ("path", InternalTraversal.dp_clauseelement),
        ("raw", InternalTraversal.dp_clauseelement),
    ]

    def json_types(self) -> tuple[str, ...]:
        if isinstance(self.value, bool):
            return ("true",) if self.value else ("false",)
        if isinstance(self.value, (int, float)):
            return ("integer", "real")
        return ("text",)


@compiles(JsonFieldEquals, "postgresql")
def _json_eq_pg(element: JsonFieldEquals, compiler: Any, **kw: Any) -> str:
    column = compiler.process(element.column, **kw)
    return f"({column} @> CAST({compiler.process(element.document, **kw)} AS JSONB))"


@compiles(JsonFieldEquals, "mysql")
@compiles(JsonFieldEquals, "mariadb")
def _json_eq_mysql(element: JsonFieldEquals, compiler: Any, **kw: Any) -> str:
    column = compiler.process(element.column, **kw)
    scalar = compiler.process(element.scalar, **kw)
    path = compiler.process(element.path, **kw)
    return f"(JSON_CONTAINS({column}, {scalar}, {path}) = 1)"


@compiles(JsonFieldEquals, "sqlite")
def _json_eq_sqlite(element: JsonFieldEquals, compiler: Any, **kw: Any) -> str:
    column = compiler.process(element.column, **kw)
    path = compiler.process(element.path, **kw)
    types = ", ".join(f"'{t}'" for t in element.json_types())
    same_type = f"json_type({column}, {path}) IN ({types})"
    if isinstance(element.value, bool):
        return f"({same_type})"
    return (
        f"({same_type} AND json_extract({column}, {path}) = {compiler.process(element.raw, **kw)})"
    )


def payload_field(t: Table, name: str, value: Any) -> ColumnElement[bool]:
    """Equality on a top-level JSON payload field, comparing JSON types (see JsonFieldEquals)."""
    return JsonFieldEquals(t.c.payload, name, value)


def filter_clause(
    t: Table,
    queue: str,
    now: datetime,
    *,
    state: str | None = None,
    key_prefix: str | None = None,
    keys: Sequence[str] | None = None,
    payload: dict[str, Any] | None = None,
    scheduled_before: datetime | None = None,
    scheduled_after: datetime | None = None,
    where: Any = None,
) -> ColumnElement[bool]:
    conds: list[Any] = [t.c.queue == queue]
    if state is not None:
        conds.append(state_clause(t, state, now))
    if key_prefix:
        conds.append(t.c.key.startswith(key_prefix, autoescape=True))
    if keys is not None:
        conds.append(t.c.key.in_(list(keys)))
    for name, value in (payload or {}).items():
        conds.append(payload_field(t, name, value))
    if scheduled_before is not None:
        conds.append(t.c.scheduled_at < scheduled_before)
    if scheduled_after is not None:
        conds.append(t.c.scheduled_at >= scheduled_after)
    if where is not None:
        conds.append(where)
    return and_(*conds)
