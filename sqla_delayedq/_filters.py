"""Filters and counts of the read and admin side, as pure SQL expressions.

Key prefixes are literal and case-sensitive on every backend (:class:`KeyStartsWith`); payload
fields compare JSON to JSON (:class:`JsonFieldEquals`); every value is a bound parameter.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Boolean, Integer, String, Table, and_, bindparam, case, func, select
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql import ColumnElement, Select
from sqlalchemy.sql.visitors import InternalTraversal

from .errors import InvalidArgument

__all__ = [
    "JsonFieldEquals",
    "KeyStartsWith",
    "count_by_state",
    "filter_clause",
    "parse_field_filters",
    "payload_field",
    "state_clause",
]


class KeyStartsWith(ColumnElement[bool]):
    """``column`` starts with ``prefix``: literal and case-sensitive on every backend.

    ``LIKE`` with ``%`` and ``_`` escaped, where it compares characters exactly (PostgreSQL,
    and MariaDB/MySQL under the binary collation of the key column); on SQLite, whose ``LIKE``
    ignores ASCII case, the prefix is compared with ``substr`` instead.
    """

    inherit_cache = True
    type = Boolean()

    def __init__(self, column: Any, prefix: str) -> None:
        self.column = column
        self.prefix = bindparam(None, prefix, type_=String())
        self.pattern = bindparam(None, _like_escape(prefix) + "%", type_=String())
        self.length = bindparam(None, len(prefix), type_=Integer())

    _traverse_internals = [
        ("column", InternalTraversal.dp_clauseelement),
        ("prefix", InternalTraversal.dp_clauseelement),
        ("pattern", InternalTraversal.dp_clauseelement),
        ("length", InternalTraversal.dp_clauseelement),
    ]


LIKE_ESCAPE = "/"


def _like_escape(text: str) -> str:
    return (
        text.replace(LIKE_ESCAPE, LIKE_ESCAPE * 2)
        .replace("%", LIKE_ESCAPE + "%")
        .replace("_", LIKE_ESCAPE + "_")
    )


@compiles(KeyStartsWith)
def _starts_with(element: KeyStartsWith, compiler: Any, **kw: Any) -> str:
    column = compiler.process(element.column, **kw)
    pattern = compiler.process(element.pattern, **kw)
    return f"({column} LIKE {pattern} ESCAPE '{LIKE_ESCAPE}')"


@compiles(KeyStartsWith, "sqlite")
def _starts_with_sqlite(element: KeyStartsWith, compiler: Any, **kw: Any) -> str:
    column = compiler.process(element.column, **kw)
    prefix = compiler.process(element.prefix, **kw)
    length = compiler.process(element.length, **kw)
    return f"(substr({column}, 1, {length}) = {prefix})"


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
    ``"5"`` to ``5``; this compares JSON to JSON instead: containment (``@>``, which a GIN index
    on the payload serves) on PostgreSQL, ``JSON_CONTAINS`` plus a ``JSON_TYPE`` that is not an
    array or object on MariaDB/MySQL, ``json_type`` plus ``json_extract`` on SQLite. Numbers
    compare by value (``5`` matches ``5.0``); strings, numbers and booleans never match each
    other, and a field holding an array or object never matches, even one that contains the value.
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
        #: What the SQL compiled for the value depends on (the JSON types SQLite accepts, an
        #: exact comparison of integers on MariaDB/MySQL): part of the statement cache key, or
        #: a filter on False would run the SQL compiled for True.
        self.exact = isinstance(value, int) and not isinstance(value, bool)
        self.kinds = ",".join(self.json_types()) + (",exact" if self.exact else "")

    _traverse_internals = [
        ("column", InternalTraversal.dp_clauseelement),
        ("document", InternalTraversal.dp_clauseelement),
        ("scalar", InternalTraversal.dp_clauseelement),
        ("path", InternalTraversal.dp_clauseelement),
        ("raw", InternalTraversal.dp_clauseelement),
        ("kinds", InternalTraversal.dp_string),
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
    # JSON_CONTAINS also finds a scalar among an array's members ([3345, 12] contains 3345):
    # the field must be a scalar itself, as on the other backends.
    sql = (
        f"JSON_CONTAINS({column}, {scalar}, {path}) = 1 "
        f"AND JSON_TYPE(JSON_EXTRACT({column}, {path})) NOT IN ('ARRAY', 'OBJECT')"
    )
    if element.exact:
        # JSON_CONTAINS compares numbers as doubles (2**53 + 1 matches 2**53): an integer is
        # compared exactly too, as PostgreSQL and SQLite do; CASE keeps text out of it.
        field = f"JSON_EXTRACT({column}, {path})"
        raw = compiler.process(element.raw, **kw)
        sql += (
            f" AND CASE WHEN JSON_TYPE({field}) IN ('INTEGER', 'UNSIGNED INTEGER', 'DOUBLE') "
            f"THEN {field} = {raw} END"
        )
    return f"({sql})"


@compiles(JsonFieldEquals, "sqlite")
def _json_eq_sqlite(element: JsonFieldEquals, compiler: Any, **kw: Any) -> str:
    column = compiler.process(element.column, **kw)
    path = compiler.process(element.path, **kw)
    types = ", ".join(f"'{t}'" for t in element.json_types())
    test = f"json_type({column}, {path}) IN ({types})"
    if not isinstance(element.value, bool):
        test += f" AND json_extract({column}, {path}) = {compiler.process(element.raw, **kw)}"
    # A message whose stored text is not JSON (SQLite stores any text) matches nothing, and
    # fails no query; CASE, because SQLite does not promise the order AND evaluates in.
    return f"(CASE WHEN json_valid({column}) THEN {test} END)"


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
        conds.append(KeyStartsWith(t.c.key, key_prefix))
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


def parse_field_filters(items: Sequence[str]) -> dict[str, Any]:
    """``FIELD=VALUE`` texts (the CLI's ``--where``, the dashboard's filter) -> payload filters.

    Values are JSON when they parse (``3345`` is a number, ``"3345"`` a string), else strings;
    ``null``, lists and objects cannot be matched. Raises :class:`InvalidArgument` with the fix.
    """
    fields: dict[str, Any] = {}
    for item in items:
        name, sep, raw = item.partition("=")
        name = name.strip()
        if not sep or not name:
            raise InvalidArgument(f"{item!r} is not FIELD=VALUE (e.g. companyId=3345)")
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        if isinstance(value, float) and not math.isfinite(value):
            value = raw
        if value is None or isinstance(value, (list, dict)):
            raise InvalidArgument(
                f"{item!r}: only strings, numbers and booleans can be matched; "
                f"quote the value to match it as a string: {name}='\"{raw}\"'"
            )
        if name in fields and not _same_json(fields[name], value):
            raise InvalidArgument(
                f"{name!r} is given twice ({fields[name]!r} and {value!r}); a field holds one "
                "value, so no message could match both: give it once"
            )
        fields[name] = value
    return fields


def _same_json(a: Any, b: Any) -> bool:
    """The same JSON value: ``1`` and ``true`` differ, ``1`` and ``1.0`` do not."""
    return (
        isinstance(a, bool) is isinstance(b, bool)
        and isinstance(a, str) is isinstance(b, str)
        and a == b
    )
