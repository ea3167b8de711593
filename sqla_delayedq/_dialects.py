"""Backend strategies: one class per database family, chosen by capability.

A strategy holds class-level facts (``skip_locked``, ``insert_returning``, parameter limits, which
lock to take when reading a row an offer may update) and the few operations whose round trips
differ by backend: how to take due messages, how to insert-if-absent, which errors are transient.
The server version is checked on first use; an older server is refused with a clear error.
"""

from __future__ import annotations

import abc
import json
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from json.encoder import encode_basestring_ascii
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, ClassVar

from sqlalchemy import BigInteger, String, Table, any_, delete, literal
from sqlalchemy import cast as sa_cast
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects import mysql, postgresql, sqlite
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import Session
from sqlalchemy.sql import Insert

from . import _statements as st
from ._statements import P
from .errors import ConcurrentUpdate, UnsupportedBackend

if TYPE_CHECKING:
    from ._batch import NewRow

__all__ = ["Claimed", "Strategy", "is_transient", "strategy_for"]


@dataclass(frozen=True, slots=True)
class Claimed:
    """A row as it is after the take, with what it was before."""

    row: Any
    prev_token: str | None
    prev_scheduled_at: datetime


class Strategy(abc.ABC):
    """Behaviour shared by all backends; subclasses override only what differs."""

    name: ClassVar[str]
    min_version: ClassVar[tuple[int, ...]]
    #: Bound parameters one statement may carry.
    max_params: ClassVar[int] = 30_000
    #: Lock for reading a row that a single offer may then update.
    offer_lock: ClassVar[st.Lock] = "update"
    #: Lock for reading the existing rows of a batch offer.
    batch_lock: ClassVar[st.Lock] = "update"
    #: Whether ``INSERT ... RETURNING`` tells which rows of a multi-row insert were written.
    insert_returning: bool = True
    #: Whether ``NOTIFY`` exists to wake listeners on commit.
    has_notify: ClassVar[bool] = False
    #: Whether ``UPDATE ... RETURNING`` exists.
    update_returning: ClassVar[bool] = True
    #: The lock a poll takes on the rows it picks (None: the backend has no row locks).
    poll_lock: ClassVar[st.Lock] = "update_skip_locked"
    #: Batch offers insert first and read only the keys that were not written. Backends whose
    #: insert-if-absent takes shared locks on existing rows (MySQL) read-lock first instead.
    batch_insert_first: ClassVar[bool] = True

    def insert_rows(
        self,
        session: Session,
        t: Table,
        queue: str,
        type_name: str,
        now: datetime,
        rows: list[NewRow],
    ) -> set[str] | None:
        """Insert-if-absent many new rows; the keys written, or None when the driver cannot tell."""
        params = [
            {
                "queue": queue,
                "key": r.key,
                "payload_type": type_name,
                "payload": None if r.text is None else json.loads(r.text),
                "payload_bytes": r.raw,
                "status": "pending",
                "scheduled_at": r.at or now,
                "scheduled_at_initially": r.at0 or r.at or now,
                "created_at": now,
                "attempts": 0,
            }
            for r in rows
        ]
        stmt = self.insert_ignore(t)
        if not self.insert_returning:
            result: Any = session.execute(stmt, params)
            return {r.key for r in rows} if result.rowcount == len(rows) else None
        return set(session.execute(stmt.returning(t.c.key), params).scalars().all())

    def __init__(self, dialect: Dialect) -> None:
        self.dialect = dialect
        self._statements: dict[tuple[Table, str], Any] = {}
        version = self.server_version(dialect)
        if version < self.min_version:
            raise UnsupportedBackend(
                f"{self.name} {'.'.join(map(str, version))} is too old for sqla_delayedq: "
                f"{'.'.join(map(str, self.min_version))} or newer is required "
                f"({self.why_min_version})"
            )

    why_min_version: ClassVar[str] = ""

    def cached(self, t: Table, name: str, build: Callable[[], Any]) -> Any:
        """A statement built once per table (with named bind parameters, see ``P``)."""
        stmt = self._statements.get((t, name))
        if stmt is None:
            stmt = self._statements[(t, name)] = build()
        return stmt

    def _due(self, session: Session, t: Table, queue: str, now: datetime, limit: int) -> Any:
        stmt = self.cached(
            t, "due", lambda: st.select_due(t, P.queue, P.now, P.limit, self.poll_lock)
        )
        return session.execute(stmt, P.take(queue, now, now, limit, "")).all()

    def ack_by_tokens(self, t: Table, ids: list[int], tokens: list[str]) -> Any:
        """The WHERE clause of a batch ack: ids and tokens (tokens embed their row's id)."""
        return (t.c.id.in_(ids), t.c.lock_token.in_(tokens))

    @staticmethod
    def server_version(dialect: Dialect) -> tuple[int, ...]:
        info = dialect.server_version_info or ()
        return tuple(int(v) for v in info if isinstance(v, int))

    @abc.abstractmethod
    def insert_ignore(self, t: Table) -> Insert:
        """``INSERT`` that skips rows whose (queue, key) exists, waiting on racing inserts."""

    def insert_or_lock(self, t: Table) -> Insert:
        """Insert-if-absent for a row the transaction will then lock ``FOR UPDATE``."""
        return self.insert_ignore(t)

    def claim(
        self,
        session: Session,
        t: Table,
        queue: str,
        now: datetime,
        lease_until: datetime,
        limit: int,
        prefix: str,
    ) -> list[Claimed]:
        """Pick up to ``limit`` due rows (skipping locked ones) and take them."""
        picked = self._due(session, t, queue, now, limit)
        if not picked:
            return []
        take = st.take_ids(t, [r.id for r in picked], now, lease_until, prefix)
        if self.poll_lock is None:
            # No row locks (SQLite): the guarded update itself says which rows were ours.
            taken = set(session.execute(take.returning(t.c.id)).scalars())
            picked = [r for r in picked if r.id in taken]
        else:
            session.execute(take)
        return [
            Claimed(_taken(r, lease_until, prefix), r.lock_token, r.scheduled_at) for r in picked
        ]

    def consume(
        self, session: Session, t: Table, queue: str, now: datetime, limit: int
    ) -> list[Any]:
        """Take up to ``limit`` due rows by deleting them in the caller's transaction."""
        picked = self._due(session, t, queue, now, limit)
        if picked:
            session.execute(delete(t).where(t.c.id.in_([r.id for r in picked])))
        return list(picked)

    @classmethod
    def is_transient(cls, exc: BaseException) -> bool:
        """Deadlocks, serialization failures, lost connections: safe to retry the transaction."""
        if isinstance(exc, ConcurrentUpdate):
            return True
        return isinstance(exc, sa_exc.DBAPIError) and bool(exc.connection_invalidated)


class PostgreSQLStrategy(Strategy):
    name = "PostgreSQL"
    min_version = (12,)
    why_min_version = "the minimum version sqla_delayedq is tested against"
    max_params = 60_000
    has_notify = True

    def insert_rows(
        self,
        session: Session,
        t: Table,
        queue: str,
        type_name: str,
        now: datetime,
        rows: list[NewRow],
    ) -> set[str] | None:
        # The chunk travels as one JSON document; payloads are spliced in as already serialized.
        quote = encode_basestring_ascii  # json.dumps of a str, without the call overhead
        parts = []
        for r in rows:
            doc = '{"k":' + quote(r.key)
            if r.text is not None:
                doc += ',"p":' + r.text
            if r.raw is not None:
                doc += ',"b":"' + r.raw.hex() + '"'
            if r.at is not None:
                doc += ',"a":"' + r.at.isoformat() + '"'
            if r.at0 is not None:
                doc += ',"a0":"' + r.at0.isoformat() + '"'
            parts.append(doc + "}")
        params = {
            "u_queue": queue,
            "u_type": type_name,
            "u_now": now,
            "u_rows": f"[{','.join(parts)}]",
        }
        stmt = self.cached(t, "insert_rows", lambda: st.recordset_insert(t))
        return set(session.execute(stmt, params).scalars().all())

    TRANSIENT_STATES = frozenset({"40001", "40P01", "55P03", "57P01", "57P02", "57P03"})

    def insert_ignore(self, t: Table) -> Insert:
        return postgresql.insert(t).on_conflict_do_nothing(index_elements=["queue", "key"])

    def claim(
        self,
        session: Session,
        t: Table,
        queue: str,
        now: datetime,
        lease_until: datetime,
        limit: int,
        prefix: str,
    ) -> list[Claimed]:
        stmt = self.cached(
            t, "claim", lambda: st.claim_returning(t, P.queue, P.now, P.until, P.limit, P.prefix)
        )
        rows = session.execute(stmt, P.take(queue, now, lease_until, limit, prefix)).all()
        claimed = [Claimed(r, r.prev_token, r.prev_scheduled_at) for r in rows]
        claimed.sort(key=lambda c: (c.prev_scheduled_at, c.row.id))
        return claimed

    def ack_by_tokens(self, t: Table, ids: list[int], tokens: list[str]) -> Any:
        # Two array parameters instead of one per id and token: one SQL text for every size.
        return (
            t.c.id == any_(sa_cast(literal(ids, ARRAY(BigInteger())), ARRAY(BigInteger()))),
            t.c.lock_token == any_(sa_cast(literal(tokens, ARRAY(String())), ARRAY(String()))),
        )

    def consume(
        self, session: Session, t: Table, queue: str, now: datetime, limit: int
    ) -> list[Any]:
        stmt = self.cached(
            t, "consume", lambda: st.consume_returning(t, P.queue, P.now, P.limit, True)
        )
        rows = list(session.execute(stmt, P.take(queue, now, now, limit, "")).all())
        rows.sort(key=lambda r: (r.scheduled_at, r.id))
        return rows

    @classmethod
    def is_transient(cls, exc: BaseException) -> bool:
        if super().is_transient(exc):
            return True
        orig = getattr(exc, "orig", None)
        state = getattr(orig, "sqlstate", None) or ""
        if not state and type(orig).__module__.startswith("psycopg"):
            # No SQL state: the connection itself failed (refused while the server restarts).
            return isinstance(exc, sa_exc.OperationalError)
        return state in cls.TRANSIENT_STATES or state.startswith("08")


class MySQLStrategy(Strategy):
    name = "MySQL"
    min_version: ClassVar[tuple[int, ...]] = (8, 0, 1)
    why_min_version = "SKIP LOCKED arrived in MySQL 8.0.1"
    max_params = 60_000
    # A shared read, so racing offers of one key that all find it identical never deadlock
    # upgrading locks; only an offer that must change the row upgrades to an exclusive lock.
    offer_lock = "share"
    insert_returning = False
    batch_insert_first = False
    update_returning = False

    TRANSIENT_CODES = frozenset({1205, 1213, 1927, 2003, 2006, 2013, 2055, 4031})

    def insert_ignore(self, t: Table) -> Insert:
        return mysql.insert(t).prefix_with("IGNORE")

    def insert_or_lock(self, t: Table) -> Insert:
        # INSERT IGNORE leaves a shared lock on a duplicate; two transactions that both upgrade it
        # for the FOR UPDATE that follows deadlock. A no-op ON DUPLICATE KEY UPDATE locks it
        # exclusively instead.
        return mysql.insert(t).on_duplicate_key_update(id=t.c.id)

    @classmethod
    def is_transient(cls, exc: BaseException) -> bool:
        if super().is_transient(exc):
            return True
        orig = getattr(exc, "orig", None)
        args: tuple[Any, ...] = getattr(orig, "args", ())
        return bool(args) and args[0] in cls.TRANSIENT_CODES


class MariaDBStrategy(MySQLStrategy):
    name = "MariaDB"
    min_version = (10, 6)
    why_min_version = "SKIP LOCKED arrived in MariaDB 10.6"
    insert_returning = True  # INSERT ... RETURNING since 10.5


class SQLiteStrategy(Strategy):
    name = "SQLite"
    min_version = (3, 35)
    why_min_version = "RETURNING arrived in SQLite 3.35"
    max_params = 32_000
    # One writer at a time: transactions begin IMMEDIATE (see create_engine), no row locks.
    offer_lock = None
    batch_lock = None
    poll_lock = None

    @staticmethod
    def server_version(dialect: Dialect) -> tuple[int, ...]:
        return tuple(dialect.dbapi.sqlite_version_info)  # type: ignore[union-attr]

    def insert_ignore(self, t: Table) -> Insert:
        return sqlite.insert(t).on_conflict_do_nothing(index_elements=["queue", "key"])

    def consume(
        self, session: Session, t: Table, queue: str, now: datetime, limit: int
    ) -> list[Any]:
        stmt = self.cached(
            t, "consume", lambda: st.consume_returning(t, P.queue, P.now, P.limit, False)
        )
        rows = list(session.execute(stmt, P.take(queue, now, now, limit, "")).all())
        rows.sort(key=lambda r: (r.scheduled_at, r.id))
        return rows

    @classmethod
    def is_transient(cls, exc: BaseException) -> bool:
        if super().is_transient(exc):
            return True
        return isinstance(exc, sa_exc.OperationalError) and "locked" in str(exc.orig)


def _taken(row: Any, lease_until: datetime, prefix: str) -> SimpleNamespace:
    """A picked row as the take left it."""
    lost = 0 if row.lock_token is None else 1  # as the take's SET counted it
    return SimpleNamespace(
        **{
            **row._mapping,
            "scheduled_at": lease_until,
            "lock_token": f"{prefix}{row.id}",
            "attempts": row.attempts + lost,
        }
    )


_cache: weakref.WeakKeyDictionary[Dialect, Strategy] = weakref.WeakKeyDictionary()


def _strategy_class(dialect: Dialect) -> type[Strategy]:
    if dialect.name == "postgresql":
        return PostgreSQLStrategy
    if dialect.name in ("mysql", "mariadb"):
        return MariaDBStrategy if getattr(dialect, "is_mariadb", False) else MySQLStrategy
    if dialect.name == "sqlite":
        return SQLiteStrategy
    raise UnsupportedBackend(
        f"the {dialect.name!r} dialect is not supported; use PostgreSQL, MariaDB/MySQL or SQLite"
    )


def strategy_for(session: Session) -> Strategy:
    """The strategy for the database behind ``session`` (connects if it has not yet)."""
    dialect = session.get_bind().dialect
    strategy = _cache.get(dialect)
    if strategy is None:
        if dialect.server_version_info is None and dialect.name != "sqlite":
            session.connection()  # first connect fills in the server version
        strategy = _strategy_class(dialect)(dialect)
        _cache[dialect] = strategy
    return strategy


def is_transient(exc: BaseException) -> bool:
    """True when ``exc`` is a database error worth retrying the whole transaction for.

    Deadlocks, serialization failures, lock timeouts, lost connections and server restarts on
    any supported backend; constraint violations and bad SQL are not transient.
    """
    return any(cls.is_transient(exc) for cls in (PostgreSQLStrategy, MySQLStrategy, SQLiteStrategy))
