"""Backend strategies: one class per database family, chosen by capability.

A strategy holds class-level facts (``has_notify``, ``update_returning``, parameter limits, which
lock to take when reading a row an offer may update) and the operations whose statements or
round trips differ by backend: how to take due rows, how to insert-if-absent, how to wake
consumers in other processes (``NOTIFY`` and a ``LISTEN`` thread on PostgreSQL; nothing
elsewhere), which errors are transient. The server version is checked on first use; an older
server is refused with a clear error. Besides ``_engine``, this is the only module that looks at
dialect names.
"""

from __future__ import annotations

import abc
import functools
import hashlib
import json
import logging
import math
import secrets
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from types import SimpleNamespace
from typing import Any, ClassVar, NamedTuple, ParamSpec, Protocol, TypeVar

from sqlalchemy import (
    BigInteger,
    Boolean,
    String,
    Table,
    any_,
    bindparam,
    delete,
    event,
    func,
    literal,
    select,
    text,
    true,
    update,
)
from sqlalchemy import cast as sa_cast
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects import mysql, postgresql, sqlite
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.engine import URL, Connection, Dialect, Engine
from sqlalchemy.orm import Session
from sqlalchemy.sql import ColumnElement, Insert

from . import _statements as st
from ._engine import Family, family, is_mariadb
from ._rules import INSERT_COLUMNS, held_due, lost_token
from ._statements import P, Shape
from ._time import DateTimeUTC
from ._wakeup import Wake, payload_tail
from ._wakeup import parse as parse_wake
from .errors import DelayedQueueError, InvalidArgument, TransientError, UnsupportedBackend
from .models import table_key

__all__ = [
    "TAKE_ONLY",
    "Claimed",
    "Listener",
    "NewRow",
    "Strategy",
    "gave_up_waiting",
    "is_transient",
    "strategy_class",
    "strategy_for",
    "strategy_for_bind",
    "transient_as_ours",
]

log = logging.getLogger("sqla_delayedq.listener")

#: ``session.info`` key a worker sets on a transaction that holds nothing but its lease-mode
#: take: on PostgreSQL that commit need not wait for the WAL flush (``st.claim_returning``).
#: A user's ``try_poll`` in a transaction of their own never has it.
TAKE_ONLY = "sqla_delayedq.take_only"


#: ``json.dumps`` without its per-call set-up (the batch insert encodes a list per column).
_encode_json = json.JSONEncoder(separators=(",", ":")).encode


def _json_array(values: list[Any], absent: Any = None) -> str | None:
    """``values`` as a JSON array, or None (SQL NULL) when every one is ``absent``."""
    return None if values.count(absent) == len(values) else _encode_json(values)


def _spliced(texts: list[str | None]) -> str | None:
    """Payloads as serialized (JSON text) spliced into one JSON array; None when they are bytes
    (one serializer per queue: every payload is JSON text, or every one is bytes)."""
    if texts[0] is None:
        return None
    return f"[{','.join(texts)}]"  # type: ignore[arg-type]  # all text, as above


def _times(values: list[datetime | None]) -> str | None:
    """Times as a JSON array of ISO 8601 text, or None when there are none."""
    if values.count(None) == len(values):
        return None
    return _encode_json([None if v is None else v.isoformat() for v in values])


class NewRow(Protocol):
    """A row a batch inserts: the payload as JSON text or bytes; ``at`` None means now."""

    @property
    def key(self) -> str: ...
    @property
    def text(self) -> str | None: ...
    @property
    def raw(self) -> bytes | None: ...
    @property
    def at(self) -> datetime | None: ...
    @property
    def at0(self) -> datetime | None:
        """The first due time, when it differs from ``at``."""

    @property
    def headers(self) -> str | None:
        """The headers as stored (JSON text), or None."""

    @property
    def group(self) -> str | None: ...
    @property
    def priority(self) -> int: ...


#: Takes of at most this many rows are statements of their own, their ``LIMIT`` built in.
FIXED_LIMITS = 128


def take_limit(limit: int) -> tuple[int | None, Any]:
    """A take's ``limit`` as ``(key, expression)``: the number its cached statement is built
    with (its cache key; None when shared) and the ``LIMIT`` to build it with.

    Either way the number is in the statement's text (see :func:`~._statements.const`); built
    in, the statement is not rewritten at each execution (SQLAlchemy's post-compile step, a few
    percent of a take of one's client time). Larger limits share one statement, with
    :attr:`P.limit`, so the cache of statements stays small.
    """
    fixed = limit if 0 < limit <= FIXED_LIMITS else None
    return fixed, P.limit if fixed is None else fixed


class Listener(abc.ABC):
    """Wakes this process's consumers when another process offers (a daemon thread)."""

    @abc.abstractmethod
    def start(self) -> None: ...

    @abc.abstractmethod
    def stop(self, timeout: float = 2.0) -> None: ...


@dataclass(frozen=True, slots=True)
class Claimed:
    """A row as it is after the take, with what it was before."""

    row: Any
    prev_token: str | None
    prev_scheduled_at: datetime
    #: The new version's own time, when the row was held for an old delivery (_rules.hold).
    prev_held: datetime | None = None


class Claims(NamedTuple):
    """What a claim took, and whether more was due: the pick looks one row past ``limit``."""

    claimed: list[Claimed]
    more: bool
    #: The claim read when the queue's next pending row is due (``ahead``, PostgreSQL)...
    seen: bool = False
    #: ...and that is when (None: no row).
    next_at: datetime | None = None


class Strategy(abc.ABC):
    """Behaviour shared by all backends; subclasses override only what differs."""

    name: ClassVar[str]
    min_version: ClassVar[tuple[int, ...]]
    #: Bound parameters one statement may carry.
    max_params: ClassVar[int] = 30_000
    #: The most payload text (characters, or bytes of binary payloads) one batch insert may
    #: carry (None: no limit but ``max_params``): a server that takes a statement in one
    #: packet refuses a larger one.
    max_chunk_chars: ClassVar[int | None] = None
    #: Lock that holds a row until the transaction ends (None: the backend has no row locks).
    row_lock: ClassVar[st.Lock] = "update"
    #: Lock for reading a row that a single offer may then update.
    offer_lock: ClassVar[st.Lock] = "update"
    #: Lock for reading the existing rows of a batch offer.
    batch_lock: ClassVar[st.Lock] = "update"
    #: Whether ``NOTIFY`` exists to wake listeners on commit.
    has_notify: ClassVar[bool] = False
    #: Whether an offer with no transaction of the caller's (``offer(engine, ...)``) writes a
    #: new message in one autocommit statement. Elsewhere it takes a short transaction of its
    #: own: PyMySQL pays a round trip to turn autocommit on and one to turn it off, where a
    #: transaction costs the insert and ``COMMIT``; SQLite's writer lock is taken by ``BEGIN
    #: IMMEDIATE``.
    autocommit_offer: ClassVar[bool] = False
    #: Whether a batch insert takes a chunk's payloads as one JSON array (``insert_rows``'s
    #: ``payloads``), which the batch then encodes in one call instead of one per payload.
    payload_arrays: ClassVar[bool] = False
    #: Whether :meth:`ack_and_claim` exists: a lease-mode acknowledgement that takes the next
    #: message in one statement that commits on its own. Elsewhere the two share a transaction
    #: (and the connection is never switched to autocommit, which costs PyMySQL two round trips).
    fused_ack: ClassVar[bool] = False
    #: Whether a grouped take reads a group's leases in the group index's order, and first
    #: steps over the groups of a bounded read of the table's leases (see
    #: :func:`st.group_head`).
    ordered_group_probe: ClassVar[bool] = True
    #: Whether workers keep the planner's statistics of their tables fresh (``_planner``).
    keeps_statistics: ClassVar[bool] = False
    #: Whether ``UPDATE ... RETURNING`` exists.
    update_returning: ClassVar[bool] = True
    #: Whether transactional takes are one ``DELETE ... RETURNING``.
    delete_returning: ClassVar[bool] = True
    #: The lock a poll takes on the rows it picks (None: the backend has no row locks).
    poll_lock: ClassVar[st.Lock] = "update_skip_locked"
    #: Queues per statement of bounded depth counts (``_cli_stats.bounded_stats_stmt``); 100
    #: stays well under SQLite's limit of 500 selects in one compound statement.
    queues_per_bounded_stats: ClassVar[int] = 100

    def insert_one(
        self,
        session: Session | Connection,
        t: Table,
        row: dict[str, Any],
        *,
        notify: str | None = None,
    ) -> bool:
        """Insert-if-absent one new row; whether it was written (False: the key exists).

        ``notify``: a queue whose consumers the insert itself may wake on commit (PostgreSQL
        sends the ``NOTIFY`` in the same statement; elsewhere it is ignored). ``session`` may be
        a Core ``Connection`` (an autocommit offer of the Engine form).
        """
        stmt = self.cached(t, "insert_one", lambda: self.insert_ignore(t).returning(t.c.id))
        return session.execute(stmt, row).first() is not None

    def notify(self, session: Session, notes: Sequence[tuple[str, str]]) -> None:
        """Wake consumers in other processes of these ``(table, queue)`` when the transaction
        commits; backends without ``NOTIFY`` rely on polling."""
        return None

    @classmethod
    def listener(
        cls,
        url: URL,
        tables: Sequence[str],
        wake: Wake,
        connected: Callable[[bool], None] | None = None,
    ) -> Listener | None:
        """A listener that calls ``wake(table, queue, count)`` when another process offers to
        one of ``tables`` (table keys), and ``connected(True)`` / ``connected(False)`` when it
        starts and stops hearing them (its connection made, or lost, or the listener stopped)."""
        return None

    @staticmethod
    def new_rows(
        queue: str,
        type_name: str,
        now: datetime,
        rows: Sequence[NewRow],
        token: str | None = None,
    ) -> list[dict[str, Any]]:
        """The parameters of a multi-row insert of new messages."""
        return [
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
                "headers": r.headers,
                "group_key": r.group,
                "priority": r.priority,
                "lock_token": token,
            }
            for r in rows
        ]

    def insert_rows(
        self,
        session: Session,
        t: Table,
        queue: str,
        type_name: str,
        now: datetime,
        rows: Sequence[NewRow],
        *,
        notify: str | None = None,
        payloads: str | None = None,
        in_order: bool = False,
    ) -> set[str]:
        """Insert-if-absent many new rows, in the given (key) order; the keys written.

        ``in_order``: the rows are not in key order, and their order is what their ids must
        follow (a group's batch); the base inserts in the given order either way.
        ``notify``: as for :meth:`insert_one`, once for the rows written. ``payloads``: the
        rows' payloads as one JSON array, in their order, already checked (see
        :attr:`payload_arrays`), or None; a strategy that cannot use it reads each row's.
        """
        params = self.new_rows(queue, type_name, now, rows)
        stmt = self.cached(t, "insert_rows", lambda: self.insert_ignore(t).returning(t.c.key))
        return set(session.execute(stmt, params).scalars().all())

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

    def _due(
        self,
        session: Session,
        t: Table,
        queue: str,
        now: datetime,
        limit: int,
        grouping: st.Grouping = None,
        boosted: bool = False,
        transactional: bool = False,
    ) -> Any:
        fixed, limit_by = take_limit(limit)
        stmt = self.cached(
            t,
            f"due:{grouping}:{boosted}:{transactional}:{fixed}",
            lambda: st.select_due(
                t,
                P.queue,
                P.now,
                limit_by,
                self.poll_lock,
                grouping,
                boosted,
                self.group_hold(transactional),
                self.ordered_group_probe,
            ),
        )
        return session.execute(stmt, P.take(queue, now, now, limit, "")).all()

    def ack_by_tokens(self, t: Table, ids: list[int], tokens: list[str]) -> Any:
        """The WHERE clause of a batch ack: ids and tokens (tokens embed their row's id)."""
        return (t.c.id.in_(ids), t.c.lock_token.in_(tokens))

    @staticmethod
    def after_second(text: ColumnElement[str], mark: str) -> ColumnElement[str]:
        """``text`` after its second ``mark``, for text that starts with one (the old token of a
        held one, see :func:`~sqla_delayedq._rules.hold`)."""
        return func.substr(text, func.instr(func.substr(text, 2), mark) + 2)

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

    def waiting_at_most(self, session: Session, seconds: float) -> Callable[[], None] | None:
        """Bound the wait of the session's next statements for a row lock another transaction
        holds to about ``seconds`` (a lease heartbeat's extension, which must not hold up the
        others); what puts the connection's own bound back when the caller is done, or None.
        Nothing on SQLite, whose one writer at a time is waited for."""
        return None

    @classmethod
    def gave_up_waiting(cls, exc: BaseException) -> bool:
        """Whether ``exc`` is a statement giving up its wait for a lock (see
        :meth:`waiting_at_most`)."""
        return False

    #: Whether the database runs on a clock of its own (a server), for :meth:`server_now`.
    has_server_clock: ClassVar[bool] = False

    def server_now(self, session: Session | Connection) -> datetime | None:
        """The database server's current UTC time, read now (not at the transaction's start),
        for a clock-skew check; None where the database runs on this host's clock (SQLite)."""
        return None

    def snapshot_may_be_old(self, session: Session) -> bool:
        """Whether a plain read in the session's transaction may miss commits made before the
        transaction's last lock was granted (it then reads with a shared lock instead)."""
        return False

    def check_group_isolation(self, session: Session) -> None:
        """Refuse a grouped take whose head-of-group probe could read an old snapshot (see
        :func:`st.group_head`); checked once per pooled connection."""
        info = session.connection().connection.info
        old = info.get("delayedq_snapshot_may_be_old")
        if old is None:
            old = info["delayedq_snapshot_may_be_old"] = self.snapshot_may_be_old(session)
        if old:
            raise DelayedQueueError(
                "a queue with groups needs READ COMMITTED on MariaDB/MySQL, and this session "
                "runs REPEATABLE READ, where a take could miss a message of the group still "
                "pending: build the engine with sqla_delayedq.create_engine, or pass "
                "isolation_level='READ COMMITTED'"
            )

    def group_hold(self, transactional: bool) -> st.GroupLock | None:
        """How a take holds (or, for a lease take, checks) the groups of the messages it takes
        (see :func:`st.group_head`): a transactional take holds them until its transaction
        ends, since it leaves no mark a plain read sees. None where no other take can run
        meanwhile (SQLite has one writer)."""
        return None

    def ack_and_claim(
        self,
        session: Session,
        t: Table,
        ack: dict[str, Any],
        queue: str,
        now: datetime,
        lease_until: datetime,
        limit: int,
        prefix: str,
        grouping: st.Grouping = None,
    ) -> tuple[int, Claims] | None:
        """Acknowledge one taken message and take the next due ones of a queue without
        priorities or controls in one statement that commits on its own, where the backend has
        one (see :func:`st.ack_and_claim`): how many rows the acknowledgement matched, and the
        take. ``ack``: the parameters of the ``ack`` settle (``s_id``, ``s_token``), or of
        ``done`` with ``s_now`` for a queue with retention. None: not here (the caller
        acknowledges and takes in a transaction)."""
        return None

    def claim(
        self,
        session: Session,
        t: Table,
        queue: str,
        now: datetime,
        lease_until: datetime,
        limit: int,
        prefix: str,
        grouping: st.Grouping = None,
        boosted: bool = False,
        ahead: bool = False,
        look_ahead_row: bool = True,
    ) -> Claims:
        """Pick up to ``limit`` due rows (skipping locked ones) and take them; the pick looks
        at one row more, to say whether more is due (not without ``look_ahead_row``: a full
        take then says more). ``grouping``: see :func:`st.group_head`; ``boosted``: only rows
        with a priority, highest first; ``ahead``: read when the next row is due too, where the
        take's statement can (see :func:`st.claim_returning`)."""
        extra = st.look_ahead(grouping) if look_ahead_row else 0
        picked = self._due(session, t, queue, now, limit + extra, grouping, boosted)
        if not picked:
            return Claims([], False)
        more, picked = len(picked) >= limit + extra, picked[:limit]
        ids = [r.id for r in picked]
        taken = self.take_picked(session, st.message_shape(t), ids, now, lease_until, prefix)
        claimed = [
            Claimed(
                _taken(r, lease_until, prefix),
                lost_token(r.lock_token),
                r.scheduled_at,
                held_due(r.lock_token),
            )
            for r in picked
            if r.id in taken
        ]
        return Claims(claimed, more)

    def take_picked(
        self,
        session: Session,
        shape: Shape,
        ids: Sequence[Any],
        now: datetime,
        lease_until: datetime,
        prefix: str,
    ) -> set[Any]:
        """Take rows a locking select picked; the ids actually taken.

        With row locks every picked row is ours. Without them (SQLite) the guarded update says
        which rows were: another transaction may have taken one since the select.
        """
        take = st.take_ids(shape, ids, now, lease_until, prefix)
        if self.poll_lock is None:
            return set(session.execute(take.returning(shape.id)).scalars())
        session.execute(take)
        return set(ids)

    def consume(
        self,
        session: Session,
        t: Table,
        queue: str,
        now: datetime,
        limit: int,
        grouping: st.Grouping = None,
        boosted: bool = False,
        ahead: bool = False,
    ) -> list[Any]:
        """Take up to ``limit`` due rows by deleting them in the caller's transaction.

        One ``DELETE ... RETURNING`` where the backend has it, else a locking select and a
        delete; the rows come back in due order, as they were. With ``ahead`` (a take of one)
        a backend that can read it in the same statement (``SKIP LOCKED`` and ``RETURNING``)
        adds ``next_at`` to the row (see :func:`~sqla_delayedq._statements.next_pending`).
        """
        if not self.delete_returning:
            picked = self._due(session, t, queue, now, limit, grouping, boosted, True)
            if picked:
                session.execute(delete(t).where(t.c.id.in_([r.id for r in picked])))
            return list(picked)
        skip_locked = self.poll_lock is not None
        ahead = ahead and skip_locked
        fixed, limit_by = take_limit(limit)
        stmt = self.cached(
            t,
            f"consume:{grouping}:{boosted}:{ahead}:{fixed}",
            lambda: st.consume_returning(
                t,
                P.queue,
                P.now,
                limit_by,
                skip_locked,
                grouping,
                boosted,
                ahead,
                self.group_hold(True),
            ),
        )
        rows = list(session.execute(stmt, P.take(queue, now, now, limit, "")).all())
        rows.sort(key=lambda r: (-r.priority, r.scheduled_at, r.id))
        return rows

    @classmethod
    def is_transient(cls, exc: BaseException) -> bool:
        """Deadlocks, serialization failures, lost connections: safe to retry the transaction."""
        if isinstance(exc, TransientError):
            return True
        return isinstance(exc, sa_exc.DBAPIError) and bool(exc.connection_invalidated)


#: The seed of the advisory lock keys of groups (``hashtextextended``): keeps them apart from
#: the keys other code of the application hashes from the same text.
GROUP_LOCK_SEED = 0x6471_6772  # "dqgr"


def _hold_group(queue: ColumnElement[Any], group: ColumnElement[Any]) -> ColumnElement[bool]:
    """PostgreSQL: a transaction-scoped advisory lock on the group, tried without waiting. Two
    groups whose keys hash alike only wait for each other, never run together."""
    key = func.hashtextextended(queue + " " + group, GROUP_LOCK_SEED)
    return func.pg_try_advisory_xact_lock(key, type_=Boolean)


class PostgreSQLStrategy(Strategy):
    """PostgreSQL: one-statement takes, ``jsonb`` batch inserts, and ``NOTIFY``/``LISTEN``.

    An offer sends ``NOTIFY delayedq_<table>, '<queue>'`` inside its transaction (in the insert
    statement itself when it can), so it is delivered exactly when, and only if, the message
    becomes visible; a :class:`PgListener` thread per worker process wakes its consumers.
    """

    name = "PostgreSQL"
    #: One queue per statement: the planner's cost of several queues' bounded reads passes
    #: ``jit_above_cost`` (100,000 by default), and compiling them took longer than reading
    #: (ten queues at ``at_most=1,000``: 172 ms of JIT for about 50 ms of reads).
    queues_per_bounded_stats = 1
    min_version = (12,)
    why_min_version = "the minimum version sqla_delayedq is tested against"
    max_params = 60_000
    has_notify = True
    autocommit_offer = True
    payload_arrays = True
    fused_ack = True
    keeps_statistics = True
    has_server_clock = True

    def server_now(self, session: Session | Connection) -> datetime | None:
        # now() is the transaction's start; clock_timestamp() the moment it is read.
        return session.execute(select(func.clock_timestamp(type_=DateTimeUTC()))).scalar_one()

    def group_hold(self, transactional: bool) -> st.GroupLock:
        # A lease take holds the group too: only for its own short transaction, with no extra
        # round trip, and it keeps a lease take and a transactional one of a group apart.
        return _hold_group

    @staticmethod
    def channel(table: str) -> str:
        """The ``LISTEN``/``NOTIFY`` channel of a table, by its :func:`~.models.table_key`
        (an identifier of at most 63 bytes: a longer one keeps its start and ends with a hash
        of the whole, so two tables never share a channel and ``pg_notify`` never refuses it)."""
        channel = f"delayedq_{table}"
        if len(channel.encode()) <= 63:
            return channel
        digest = hashlib.blake2b(channel.encode(), digest_size=8).hexdigest()
        head = channel.encode()[: 63 - len(digest) - 1].decode(errors="ignore")
        return f"{head}~{digest}"

    def insert_one(
        self,
        session: Session | Connection,
        t: Table,
        row: dict[str, Any],
        *,
        notify: str | None = None,
    ) -> bool:
        if notify is None:
            return super().insert_one(session, t, row)
        # Insert and NOTIFY in one round trip; notifies only when a row was inserted.
        stmt = self.cached(t, f"insert_one+notify:{notify}", lambda: self._insert_notify(t, notify))
        return session.execute(stmt, row).first() is not None

    def _insert_notify(self, t: Table, queue: str) -> Any:
        values = {c: bindparam(c, type_=t.c[c].type) for c in INSERT_COLUMNS}
        ins = self.insert_ignore(t).values(values).returning(t.c.id).cte("ins")
        return select(ins.c.id, func.pg_notify(literal(self.channel(table_key(t))), literal(queue)))

    def waiting_at_most(self, session: Session, seconds: float) -> Callable[[], None] | None:
        # For the rest of the transaction only (SET LOCAL): nothing to put back.
        wait = f"{max(1, round(seconds * 1000))}ms"
        session.execute(select(func.set_config("lock_timeout", wait, true())))
        return None

    @classmethod
    def gave_up_waiting(cls, exc: BaseException) -> bool:
        return getattr(getattr(exc, "orig", None), "sqlstate", None) == "55P03"

    def notify(self, session: Session, notes: Sequence[tuple[str, str]]) -> None:
        if notes:
            calls = [func.pg_notify(self.channel(table), queue) for table, queue in sorted(notes)]
            session.execute(select(*calls))

    @classmethod
    def listener(
        cls,
        url: URL,
        tables: Sequence[str],
        wake: Wake,
        connected: Callable[[bool], None] | None = None,
    ) -> Listener | None:
        return PgListener(url, {cls.channel(t): t for t in tables}, wake, connected)

    def insert_rows(
        self,
        session: Session,
        t: Table,
        queue: str,
        type_name: str,
        now: datetime,
        rows: Sequence[NewRow],
        *,
        notify: str | None = None,
        payloads: str | None = None,
        in_order: bool = False,
    ) -> set[str]:
        # The chunk travels as one JSON array per column (see st.recordset_insert): each built
        # by one join or one encoder call, the payloads spliced in as already serialized.
        params = {
            "u_queue": queue,
            "u_type": type_name,
            "u_now": now,
            "u_k": _json_array([r.key for r in rows]),
            "u_p": _spliced([r.text for r in rows]) if payloads is None else payloads,
            "u_b": _json_array([None if r.raw is None else r.raw.hex() for r in rows]),
            "u_a": _times([r.at for r in rows]),
            "u_a0": _times([r.at0 for r in rows]),
            "u_h": _json_array([r.headers for r in rows]),
            "u_g": _json_array([r.group for r in rows]),
            "u_r": _json_array([r.priority for r in rows], 0),
        }
        by_key = not in_order
        order = "" if by_key else "+in-order"
        if notify is None:
            stmt = self.cached(
                t, f"insert_rows{order}", lambda: st.recordset_insert(t, by_key=by_key)
            )
        else:
            note = (self.channel(table_key(t)), payload_tail(notify))
            stmt = self.cached(
                t,
                f"insert_rows{order}+notify:{notify}",
                lambda: st.recordset_insert(t, note, by_key=by_key),
            )
        return set(session.execute(stmt, params).scalar() or ())

    #: 57014 (query_canceled: statement_timeout, pg_cancel_backend) is transient too: a
    #: statement cut off for running too long under load is no more permanent than a lock wait
    #: cut off.
    TRANSIENT_STATES = frozenset({"40001", "40P01", "55P03", "57014", "57P01", "57P02", "57P03"})

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
        grouping: st.Grouping = None,
        boosted: bool = False,
        ahead: bool = False,
        look_ahead_row: bool = True,
    ) -> Claims:
        relaxed = bool(session.info.get(TAKE_ONLY))
        ahead = ahead and grouping is None and not boosted
        fixed, limit_by = take_limit(limit)

        def build() -> Any:
            take = st.claim_returning(
                t,
                P.queue,
                P.now,
                P.until,
                limit_by,
                P.prefix,
                grouping,
                boosted,
                relaxed,
                self.group_hold(False),
                look_ahead_row=look_ahead_row,
            )
            return st.claim_ahead(take, t, P.queue, P.now) if ahead else take

        key = f"claim:{grouping}:{boosted}:{relaxed}:{ahead}:{fixed}:{look_ahead_row}"
        stmt = self.cached(t, key, build)
        rows = session.execute(stmt, P.take(queue, now, lease_until, limit, prefix)).all()
        extra = st.look_ahead(grouping) if look_ahead_row else 0
        return self._claims(rows, limit + extra, ahead)

    @staticmethod
    def _claims(rows: Sequence[Any], full: int, ahead: bool) -> Claims:
        """The rows a take returned; ``full``: how many rows its pick locked when more may be
        due (the limit and :func:`st.look_ahead`). A row of NULLs stands for an empty take
        (:func:`st.claim_ahead`, :func:`st.ack_and_claim`); with ``ahead`` the rows carry
        ``next_at``."""
        taken = [r for r in rows if r.id is not None]
        claimed = [
            Claimed(r, lost_token(r.prev_token), r.prev_scheduled_at, held_due(r.prev_token))
            for r in taken
        ]
        claimed.sort(key=lambda c: (-c.row.priority, c.prev_scheduled_at, c.row.id))
        more = bool(taken) and taken[0].picked >= full
        if ahead and not more:
            return Claims(claimed, more, True, rows[0].next_at)
        return Claims(claimed, more)

    def ack_and_claim(
        self,
        session: Session,
        t: Table,
        ack: dict[str, Any],
        queue: str,
        now: datetime,
        lease_until: datetime,
        limit: int,
        prefix: str,
        grouping: st.Grouping = None,
    ) -> tuple[int, Claims] | None:
        done = "s_now" in ack
        fixed, limit_by = take_limit(limit)
        stmt = self.cached(
            t,
            f"ack_and_claim:{done}:{grouping}:{fixed}",
            lambda: st.ack_and_claim(t, done, limit_by, grouping, self.group_hold(False)),
        )
        params = {**P.take(queue, now, lease_until, limit, prefix), **ack}
        rows = session.execute(stmt, params).all()
        # With groups a due row need not be one a take may pick: no next_at then.
        claims = self._claims(rows, limit + st.look_ahead(grouping), grouping is None)
        return int(rows[0].acked), claims

    @staticmethod
    def after_second(text: ColumnElement[str], mark: str) -> ColumnElement[str]:
        return func.split_part(text, mark, 3)  # no instr(); the rest holds no second mark

    def ack_by_tokens(self, t: Table, ids: list[int], tokens: list[str]) -> Any:
        # Two array parameters instead of one per id and token: one SQL text for every size.
        return (
            t.c.id == any_(sa_cast(literal(ids, ARRAY(BigInteger())), ARRAY(BigInteger()))),
            t.c.lock_token == any_(sa_cast(literal(tokens, ARRAY(String())), ARRAY(String()))),
        )

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


#: ``Connection.info`` flag: the connection's transaction took named locks of groups.
NAMED_LOCKS = "delayedq_group_locks"
_releasing: weakref.WeakSet[Engine] = weakref.WeakSet()


def _lock_name(queue: ColumnElement[Any], group: ColumnElement[Any]) -> ColumnElement[str]:
    """The named lock of a group (names are at most 64 characters, so the group is hashed)."""
    return func.concat("delayedq ", func.md5(func.concat(queue, " ", group)))


def _named_hold(queue: ColumnElement[Any], group: ColumnElement[Any]) -> ColumnElement[bool]:
    """MariaDB/MySQL: a named lock on the group (``GET_LOCK``, not waiting). Named locks belong
    to the session, not to the transaction: :func:`_release_at_end` gives them back when the
    transaction ends."""
    return func.get_lock(_lock_name(queue, group), 0, type_=Boolean)


def _named_free(queue: ColumnElement[Any], group: ColumnElement[Any]) -> ColumnElement[bool]:
    """MariaDB/MySQL: whether no session holds the group's named lock (``IS_FREE_LOCK``)."""
    return func.is_free_lock(_lock_name(queue, group), type_=Boolean)


def _release_at_end(session: Session) -> None:
    """Give back the named locks the session's transaction takes, at its commit or rollback
    (before either: the handlers of what it took have run by then)."""
    conn = session.connection()
    conn.info[NAMED_LOCKS] = True
    engine = conn.engine
    if engine not in _releasing:
        event.listen(engine, "commit", _release_named_locks)
        event.listen(engine, "rollback", _release_named_locks)
        _releasing.add(engine)


def _release_named_locks(conn: Connection) -> None:
    if conn.invalidated or conn.closed:
        return  # the session is gone, and its locks with it
    try:
        if not conn.info.pop(NAMED_LOCKS, False):
            return
        cursor = conn.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
        try:
            cursor.execute("DO RELEASE_ALL_LOCKS()")
        finally:
            cursor.close()
    except Exception:
        # A connection that cannot run this is lost, and its locks with its session; one that
        # can must not go back to the pool holding them.
        log.warning("could not release the group locks of a connection; closing it", exc_info=True)
        if not conn.invalidated:
            conn.invalidate()


class MySQLStrategy(Strategy):
    """MariaDB/MySQL: every insert-if-absent locks an existing key exclusively.

    InnoDB's ``INSERT IGNORE`` leaves a *shared* lock on a duplicate key. Racing offers of one
    key that all hold it and then need the row exclusively (to update it) deadlock. ``INSERT ...
    ON DUPLICATE KEY UPDATE id = id`` takes the exclusive lock at once, so racers queue for the
    row instead (a batch racing single offers of the same new keys can still deadlock: the two
    forms lock the row and its key's entry in opposite orders; ``TransientError``, retried by the
    caller); the insert id says whether the row is new (0 for a duplicate). A multi-row
    insert stamps its rows with a random lock token, reads back which keys carry it, and clears
    it before the transaction commits. The rows an upsert found are then read without a lock
    clause: they are already locked, and a locking read could wait on (and deadlock with) a
    racer's half-inserted row in a scan.
    """

    name = "MySQL"
    min_version: ClassVar[tuple[int, ...]] = (8, 0, 17)
    why_min_version = (
        "SKIP LOCKED arrived in MySQL 8.0.1, and utf8mb4_0900_bin, the NO PAD binary collation "
        "that makes keys compare byte for byte, in 8.0.17"
    )
    max_params = 60_000
    #: ``max_allowed_packet`` is 16 MiB by default on MariaDB (64 MiB on MySQL 8): a chunk of
    #: 1,000 payloads of 17 KB was refused ("server has gone away"). 2 M characters stay under
    #: 8 MiB in UTF-8 whatever the text.
    max_chunk_chars = 2_000_000
    update_returning = False
    delete_returning = False
    ordered_group_probe = False
    offer_lock = None
    batch_lock = None
    has_server_clock = True

    def insert_one(
        self,
        session: Session | Connection,
        t: Table,
        row: dict[str, Any],
        *,
        notify: str | None = None,
    ) -> bool:
        result: Any = session.execute(self.cached(t, "upsert", lambda: self.insert_or_lock(t)), row)
        return bool(result.lastrowid)

    def insert_rows(
        self,
        session: Session,
        t: Table,
        queue: str,
        type_name: str,
        now: datetime,
        rows: Sequence[NewRow],
        *,
        notify: str | None = None,
        payloads: str | None = None,
        in_order: bool = False,
    ) -> set[str]:
        token = f"new.{secrets.token_hex(12)}"
        params = self.new_rows(queue, type_name, now, rows, token)
        written = self._insert_stamped(session, t, params, token)
        if written:
            clear = self.cached(
                t,
                "clear_stamp",
                lambda: (
                    update(t)
                    .where(t.c.lock_token == bindparam("m_token", type_=t.c.lock_token.type))
                    .values(lock_token=None)
                ),
            )
            session.execute(clear, {"m_token": token})
        return written

    def _insert_stamped(
        self, session: Session, t: Table, params: list[dict[str, Any]], token: str
    ) -> set[str]:
        session.execute(self.cached(t, "upsert", lambda: self.insert_or_lock(t)), params)
        stamped = self.cached(
            t,
            "stamped",
            lambda: select(t.c.key).where(
                t.c.lock_token == bindparam("m_token", type_=t.c.lock_token.type)
            ),
        )
        return set(session.execute(stamped, {"m_token": token}).scalars())

    #: With 1317 (KILL QUERY), 1969 (MariaDB max_statement_time) and 3024 (MySQL
    #: max_execution_time): a statement interrupted, not a statement that cannot work.
    TRANSIENT_CODES = frozenset({1205, 1213, 1317, 1927, 1969, 2003, 2006, 2013, 2055, 3024, 4031})

    def insert_ignore(self, t: Table) -> Insert:
        return mysql.insert(t).prefix_with("IGNORE")

    def insert_or_lock(self, t: Table) -> Insert:
        # INSERT IGNORE leaves a shared lock on a duplicate; two transactions that both upgrade it
        # for the FOR UPDATE that follows deadlock. A no-op ON DUPLICATE KEY UPDATE locks it
        # exclusively instead.
        return mysql.insert(t).on_duplicate_key_update(id=t.c.id)

    def server_now(self, session: Session | Connection) -> datetime | None:
        return session.execute(select(func.utc_timestamp(6, type_=DateTimeUTC()))).scalar_one()

    def waiting_at_most(self, session: Session, seconds: float) -> Callable[[], None] | None:
        # A session variable, in whole seconds: kept on the pooled connection unless put back.
        before = session.execute(text("SELECT @@SESSION.innodb_lock_wait_timeout")).scalar_one()
        wait = text("SET SESSION innodb_lock_wait_timeout = :s")
        session.execute(wait, {"s": max(1, math.ceil(seconds))})

        def put_back() -> None:
            session.execute(wait, {"s": before})

        return put_back

    @classmethod
    def gave_up_waiting(cls, exc: BaseException) -> bool:
        args: tuple[Any, ...] = getattr(getattr(exc, "orig", None), "args", ())
        return bool(args) and args[0] == 1205

    def group_hold(self, transactional: bool) -> st.GroupLock:
        # A lease take only checks that no transactional take holds the group: its lease marks
        # the group once it commits, and a named lock would cost it a statement to give back.
        return _named_hold if transactional else _named_free

    def _due(
        self,
        session: Session,
        t: Table,
        queue: str,
        now: datetime,
        limit: int,
        grouping: st.Grouping = None,
        boosted: bool = False,
        transactional: bool = False,
    ) -> Any:
        if grouping is not None and transactional:
            _release_at_end(session)
        return super()._due(session, t, queue, now, limit, grouping, boosted, transactional)

    def snapshot_may_be_old(self, session: Session) -> bool:
        """InnoDB's ``REPEATABLE READ`` reads from the snapshot of the transaction's first plain
        read (our engines run ``READ COMMITTED``, where each read sees every commit)."""
        level = session.connection().get_isolation_level()
        return str(level).upper().replace("-", " ") == "REPEATABLE READ"

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

    def _insert_stamped(
        self, session: Session, t: Table, params: list[dict[str, Any]], token: str
    ) -> set[str]:
        # INSERT ... RETURNING (10.5+) returns duplicates too, each with its own lock token.
        stmt = self.cached(
            t, "upsert_returning", lambda: self.insert_or_lock(t).returning(t.c.key, t.c.lock_token)
        )
        return {key for key, stamp in session.execute(stmt, params) if stamp == token}


class SQLiteStrategy(Strategy):
    name = "SQLite"
    min_version = (3, 35)
    why_min_version = "RETURNING arrived in SQLite 3.35"
    max_params = 32_000
    # One writer at a time: transactions begin IMMEDIATE (see create_engine), no row locks.
    row_lock = None
    offer_lock = None
    batch_lock = None
    poll_lock = None

    @staticmethod
    def server_version(dialect: Dialect) -> tuple[int, ...]:
        return tuple(dialect.dbapi.sqlite_version_info)  # type: ignore[union-attr]

    def insert_ignore(self, t: Table) -> Insert:
        return sqlite.insert(t).on_conflict_do_nothing(index_elements=["queue", "key"])

    @classmethod
    def is_transient(cls, exc: BaseException) -> bool:
        if super().is_transient(exc):
            return True
        return isinstance(exc, sa_exc.OperationalError) and "locked" in str(exc.orig)


#: asyncpg's ``ssl=`` values that mean the same as libpq's ``sslmode``.
_SSL_MODES = frozenset({"disable", "allow", "prefer", "require", "verify-ca", "verify-full"})


def libpq_url(url: URL) -> tuple[URL, list[str]]:
    """``url`` (of any PostgreSQL driver) for a libpq connection (the listener's, through
    psycopg), and the query keys dropped on the way: libpq refuses a conninfo with a key it
    does not know, so an asyncpg URL's ``?prepared_statement_cache_size=0`` kept the listener
    from ever connecting. asyncpg's ``ssl=<mode>`` becomes ``sslmode``."""
    from psycopg import pq

    known = {o.keyword.decode() for o in pq.Conninfo.get_defaults()}
    query = dict(url.query)
    ssl = query.pop("ssl", None)
    if isinstance(ssl, str) and ssl in _SSL_MODES and "sslmode" not in query:
        query["sslmode"] = ssl
    elif ssl is not None:
        query["ssl"] = ssl  # not a mode libpq has: dropped below, and said so
    kept = {k: v for k, v in query.items() if k in known}
    return url.set(drivername="postgresql", query=kept), sorted(query.keys() - kept.keys())


class PgListener(Listener):
    """A daemon thread that ``LISTEN``s on the channels of tables (``channels``: channel ->
    table key) and calls ``wake(table, queue, count)`` per notification (see :mod:`._wakeup`
    for the payload).

    A notification only wakes pollers early; polling stays authoritative. The listener
    reconnects with backoff when its connection drops, and wakes everyone after reconnecting in
    case notifications were lost meanwhile. ``on_connected`` hears when it starts and stops
    hearing notifications: True once its ``LISTEN``s are in place, False as soon as the
    connection is lost (TCP keepalives find a silent loss within about 11 seconds) and when the
    listener stops; never True after a stop.
    """

    def __init__(
        self,
        url: URL,
        channels: Mapping[str, str],
        wake: Wake,
        on_connected: Callable[[bool], None] | None = None,
    ):
        self.url = url
        self.tables = dict(channels)
        self.channels = sorted(self.tables)
        self.wake = wake
        self.on_connected = on_connected
        self._stop = threading.Event()
        self._state = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="delayedq-listen", daemon=True)
        self.connected = threading.Event()
        self._conninfo: str | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        self._set_connected(False)
        self._thread.join(timeout)

    def _set_connected(self, connected: bool) -> None:
        """Say whether notifications are heard; once stopping, only that they are not."""
        with self._state:
            if connected and self._stop.is_set():
                return
            if connected:
                self.connected.set()
            else:
                self.connected.clear()
            if self.on_connected is not None:
                self.on_connected(connected)

    def _connect(self) -> Any:
        import psycopg

        if self._conninfo is None:  # once: the listener reconnects with it
            url, dropped = libpq_url(self.url)
            if dropped:
                log.warning(
                    "the LISTEN connection (libpq) leaves out URL parameters it does not know: "
                    "%s (the engine's own connections keep them); give libpq's own keywords "
                    "(sslmode=...) for what the listener needs too",
                    ", ".join(dropped),
                )
            self._conninfo = url.render_as_string(hide_password=False)
        conninfo = self._conninfo
        # TCP keepalives: an idle connection whose peer vanished without a word (a cable, a
        # firewall) is found dead within about 11 seconds (5 idle, then 3 probes 2 seconds
        # apart), where without them it could seem alive for hours.
        conn = psycopg.connect(
            conninfo,
            autocommit=True,
            keepalives=1,
            keepalives_idle=5,
            keepalives_interval=2,
            keepalives_count=3,
        )
        for channel in self.channels:
            conn.execute(f'LISTEN "{channel}"')
        return conn

    def _run(self) -> None:
        backoff = 0.1
        while not self._stop.is_set():
            try:
                conn = self._connect()
            except Exception as exc:
                log.warning("LISTEN connection failed (%s); polling covers meanwhile", exc)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            backoff = 0.1
            self._set_connected(True)
            self.wake(None, None, None)  # anything sent while we were away: wake everyone
            try:
                while not self._stop.is_set():
                    for note in conn.notifies(timeout=0.5):
                        self.wake(self.tables.get(note.channel), *parse_wake(note.payload))
            except Exception as exc:
                if not self._stop.is_set():
                    log.warning("LISTEN connection lost (%s); reconnecting", exc)
            finally:
                self._set_connected(False)
                try:
                    conn.close()
                except Exception:
                    log.debug("closing the LISTEN connection failed", exc_info=True)
            self._stop.wait(0.05)


def _taken(row: Any, lease_until: datetime, prefix: str) -> SimpleNamespace:
    """A picked row as the take left it."""
    lost = 0 if lost_token(row.lock_token) is None else 1  # as the take's SET counted it
    return SimpleNamespace(
        **{
            **row._mapping,
            "scheduled_at": lease_until,
            "lock_token": f"{prefix}{row.id}",
            "attempts": row.attempts + lost,
        }
    )


_cache: weakref.WeakKeyDictionary[Dialect, Strategy] = weakref.WeakKeyDictionary()


def strategy_class(dialect: Dialect) -> type[Strategy]:
    """The strategy class of a dialect, for its class-level facts (no version check)."""
    kind = family(dialect)
    if kind is Family.POSTGRESQL:
        return PostgreSQLStrategy
    if kind is Family.MYSQL:
        return MariaDBStrategy if is_mariadb(dialect) else MySQLStrategy
    if kind is Family.SQLITE:
        return SQLiteStrategy
    raise UnsupportedBackend(
        f"the {dialect.name!r} dialect is not supported; use PostgreSQL, MariaDB/MySQL or SQLite"
    )


def strategy_for(session: Session) -> Strategy:
    """The strategy for the database behind ``session`` (connects if it has not yet)."""
    if type(session) is not Session:
        require_session(session)
    return strategy_for_bind(session.get_bind(), session.connection)


def require_session(session: Any) -> None:
    """Refuse, naming the fix, what is not a Session (a subclass or a ``scoped_session`` is)."""
    if hasattr(session, "sync_session") or hasattr(session, "sync_engine"):
        raise InvalidArgument(
            f"{type(session).__name__} is an asyncio object: wrap the queue in "
            "AsyncQueue(queue) and await its methods"
        )
    if not callable(getattr(session, "get_bind", None)):
        hint = (
            " (a Session(bind=connection) joins that connection's transaction)"
            if isinstance(session, Connection)
            else ""
        )
        raise InvalidArgument(
            f"expected a SQLAlchemy Session, got {type(session).__name__}{hint}; only offer "
            "takes an Engine, to commit one message on its own"
        )


def strategy_for_bind(bind: Any, connect: Callable[[], Any] | None = None) -> Strategy:
    """The strategy for an engine or connection; ``connect`` fills in the server version."""
    dialect = bind.dialect
    strategy = _cache.get(dialect)
    if strategy is None:
        if dialect.server_version_info is None and family(dialect) is not Family.SQLITE:
            if connect is not None:
                connect()
            else:
                with bind.connect():
                    pass  # first connect fills in the server version
        strategy = strategy_class(dialect)(dialect)
        _cache[dialect] = strategy
    return strategy


P_ = ParamSpec("P_")
R_ = TypeVar("R_")


def transient_as_ours(fn: Callable[P_, R_]) -> Callable[P_, R_]:
    """Re-raise a transient driver error inside a queue operation as :class:`TransientError`.

    The caller's transaction is unusable afterwards; the message says what to do next. Other
    errors pass through unchanged.
    """

    @functools.wraps(fn)
    def operation(*args: P_.args, **kwargs: P_.kwargs) -> R_:
        try:
            return fn(*args, **kwargs)
        except sa_exc.DBAPIError as exc:
            if not is_transient(exc):
                raise
            cause = str(exc.orig if exc.orig is not None else exc).strip().splitlines()
            raise TransientError(
                f"{fn.__name__} hit a transient database error "
                f"({cause[0] if cause else type(exc).__name__}); roll back the transaction and "
                "run it again (sqla_delayedq.run_in_transaction does that)"
            ) from exc

    return operation


def gave_up_waiting(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it was raised from) is a statement that gave up its wait for a
    row lock (see ``Strategy.waiting_at_most``), on any supported backend."""
    errors = [exc] if exc.__cause__ is None else [exc, exc.__cause__]
    return any(
        cls.gave_up_waiting(e) for e in errors for cls in (PostgreSQLStrategy, MySQLStrategy)
    )


def is_transient(exc: BaseException) -> bool:
    """True when ``exc`` is a database error worth retrying the whole transaction for.

    Deadlocks, serialization failures, lock timeouts, lost connections and server restarts on
    any supported backend; constraint violations and bad SQL are not transient.
    """
    return any(cls.is_transient(exc) for cls in (PostgreSQLStrategy, MySQLStrategy, SQLiteStrategy))
