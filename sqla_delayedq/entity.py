"""Entity queues: queue-state columns on your own domain table, whose rows are the messages.

Some work belongs to a row that already exists: charge this order, send this invoice. Rather than
copying the row into a message, add :class:`EntityQueueMixin` to the mapped class. It adds six
columns, all prefixed ``queue_`` so they cannot clash with yours:

===========================  ==============================================================
``queue_status``             outcome of the last finished attempt: ``new`` (none yet),
                             ``succeeded`` or ``failed``; ``NOT NULL``, server default ``new``
``queue_next_attempt_at``    when the row is next due; ``NULL`` means nothing to do. Indexed.
                             A take moves it to the end of the lease (the schedule is the lock)
``queue_attempts``           finished attempts of the current run; ``NOT NULL``, default ``0``
``queue_last_attempt_at``    when the last attempt finished
``queue_last_error``         the error text of the last failed attempt (kept after a success)
``queue_lock_token``         set by a take; settling is guarded by ``id = :id AND token = :t``
===========================  ==============================================================

Whether a row is pending depends on ``queue_next_attempt_at`` alone, never on the status (seed
001): a failed row waiting for its retry has status ``failed`` and a next attempt time. Existing
rows get ``new`` and ``NULL`` when the migration adds the columns, so nothing is processed until
you schedule it (:meth:`EntityQueue.schedule`).

:class:`EntityQueue` has the message queue's semantics over those rows: take due rows with
``FOR UPDATE SKIP LOCKED`` and a lease, then ``succeed`` or ``fail`` through the retry policy.
Taken entities are loaded into the caller's Session, so in transactional mode a handler's changes
to the object commit together with the success mark. Searching and admin are plain SQLAlchemy on
your own columns: ``failed(Order).where(Order.company_id == 3345)`` is an ordinary ``Select``, and
``stop``, ``process_now`` and ``retry_failed`` take the same kind of ``WHERE`` conditions.
See ``docs/entity-queues.md`` for a worked example.
"""

from __future__ import annotations

import random
import secrets
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any, Final, Generic, TypeVar, cast

from sqlalchemy import Column, Integer, String, Table, Text, and_, case, delete, func, select
from sqlalchemy import inspect as sa_inspect
from sqlalchemy import update as sa_update
from sqlalchemy.engine import CursorResult, Result
from sqlalchemy.orm import Mapped, Mapper, Session, mapped_column, sessionmaker
from sqlalchemy.orm.attributes import set_committed_value
from sqlalchemy.sql import ColumnElement, Delete, Select, Update

from . import _statements as st
from ._dialects import Strategy, is_transient, strategy_for
from ._queue import error_text
from ._time import Clock, DateTimeUTC, require_aware, require_duration, system_clock
from ._types import Delivery, NackOutcome
from .errors import InvalidArgument
from .retry import ExponentialBackoff, RetryPolicy

__all__ = [
    "EntityCounts",
    "EntityLease",
    "EntityQueue",
    "EntityQueueMixin",
    "EntityStatus",
    "due",
    "failed",
    "pending",
    "retrying",
    "succeeded",
]


class EntityStatus:
    """The values of ``queue_status``: the outcome of the last finished attempt."""

    NEW: Final = "new"
    SUCCEEDED: Final = "succeeded"
    FAILED: Final = "failed"
    ALL: Final = (NEW, SUCCEEDED, FAILED)


#: How many times :meth:`EntityQueue.process_due` takes again after a transient error.
TAKE_ATTEMPTS: Final = 5


class _TakeFailed(Exception):
    """The take of a ``process_due`` pass failed: nothing was changed and no handler ran."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


class EntityQueueMixin:
    """Queue-state columns for an existing mapped class (see the module docstring).

    Put it before your ``Base``: ``class Order(EntityQueueMixin, Base)``. Your own
    ``__table_args__`` stay yours; the only index, on ``queue_next_attempt_at``, is declared on
    the column and named by your metadata's naming convention (``ix_<table>_queue_next_attempt_at``
    by default). Every column is nullable or has a server default, so adding the mixin to a
    populated table is a plain ``ALTER TABLE ... ADD COLUMN`` that leaves existing rows idle.
    """

    queue_status: Mapped[str] = mapped_column(
        String(16), nullable=False, default=EntityStatus.NEW, server_default=EntityStatus.NEW
    )
    queue_next_attempt_at: Mapped[datetime | None] = mapped_column(
        DateTimeUTC(), nullable=True, index=True
    )
    queue_attempts: Mapped[int] = mapped_column(
        Integer, nullable=False, default=0, server_default="0"
    )
    queue_last_attempt_at: Mapped[datetime | None] = mapped_column(DateTimeUTC(), nullable=True)
    queue_last_error: Mapped[str | None] = mapped_column(Text, nullable=True)
    # No index: every guard also names the primary key, and an index here would cost a write on
    # each take and settle of a domain table that may be large.
    queue_lock_token: Mapped[str | None] = mapped_column(String(64), nullable=True)


#: The mixin's attributes, as the ORM names them.
QUEUE_ATTRIBUTES: Final = (
    "queue_status",
    "queue_next_attempt_at",
    "queue_attempts",
    "queue_last_attempt_at",
    "queue_last_error",
    "queue_lock_token",
)

M = TypeVar("M", bound=EntityQueueMixin)

#: What :meth:`EntityQueue.process_due` calls for each taken entity.
Handler = Callable[[M], object]


@dataclass(frozen=True, eq=False)
class EntityLease(Generic[M]):
    """A taken entity. Pass it back to ``succeed``, ``fail``, ``release`` or ``extend``."""

    #: The primary key value.
    id: Any
    #: The domain object, loaded into the Session that took it.
    entity: M
    lock_token: str
    #: 1 for the first attempt of this run; finished attempts before this take plus one.
    attempt: int
    delivery: Delivery
    #: When the row was due before this take.
    scheduled_at: datetime
    lease_until: datetime

    @property
    def redelivered(self) -> bool:
        return self.delivery is Delivery.REDELIVERY


@dataclass(frozen=True)
class EntityCounts:
    """Rows per state. ``idle``: never scheduled, or stopped before any attempt finished."""

    due: int
    scheduled: int
    in_flight: int
    succeeded: int
    failed: int
    idle: int

    @property
    def pending(self) -> int:
        return self.due + self.scheduled + self.in_flight


# -- selects the user filters further ----------------------------------------------------


def pending(model: type[M]) -> Select[Any]:
    """Rows with something to do: due, scheduled for later, or in flight."""
    return select(model).where(model.queue_next_attempt_at.is_not(None))


def due(model: type[M], now: datetime) -> Select[Any]:
    """Rows due at ``now`` (including those whose lease ran out), oldest first."""
    at = model.queue_next_attempt_at
    return select(model).where(at <= require_aware(now, "now")).order_by(at)


def failed(model: type[M]) -> Select[Any]:
    """Rows whose last attempt failed and that have nothing more to do (out of retries, or
    stopped): what :meth:`EntityQueue.retry_failed` puts back."""
    return select(model).where(
        model.queue_status == EntityStatus.FAILED, model.queue_next_attempt_at.is_(None)
    )


def retrying(model: type[M]) -> Select[Any]:
    """Rows whose last attempt failed and that wait for their next attempt."""
    return select(model).where(
        model.queue_status == EntityStatus.FAILED, model.queue_next_attempt_at.is_not(None)
    )


def succeeded(model: type[M]) -> Select[Any]:
    """Rows whose last attempt succeeded and that have nothing more to do."""
    return select(model).where(
        model.queue_status == EntityStatus.SUCCEEDED, model.queue_next_attempt_at.is_(None)
    )


# -- pure statements -----------------------------------------------------------------------


def select_due(
    model: type[M], pk: Column[Any], now: datetime, limit: int, lock: st.Lock
) -> Select[Any]:
    """Due entities in order of next attempt, then primary key: a range scan of the index.

    With ``lock="update_skip_locked"`` the rows come back locked and rows other consumers hold
    are skipped, so the entities are loaded in the same statement that claims them.
    """
    at = model.queue_next_attempt_at
    stmt = select(model).where(at <= now).order_by(at, pk).limit(limit)
    return st.with_lock(stmt, lock).execution_options(populate_existing=True)


def take_ids(
    t: Table, pk: Column[Any], ids: Sequence[Any], now: datetime, until: datetime, token: str
) -> Update:
    """Take picked rows; ``next_attempt_at <= now`` makes it a compare-and-swap where the
    backend has no row locks (SQLite)."""
    return (
        sa_update(t)
        .where(pk.in_(ids), t.c.queue_next_attempt_at <= now)
        .values(queue_next_attempt_at=until, queue_lock_token=token)
    )


def by_token(model: type[M], pk: Column[Any], row_id: Any, token: str) -> ColumnElement[bool]:
    return and_(pk == row_id, model.queue_lock_token == token)


def settle(model: type[M], pk: Column[Any], row_id: Any, token: str) -> Update:
    """An ORM-enabled ``UPDATE`` guarded by the lease's token.

    ORM-enabled, so the Session flushes the handler's pending changes first and the copy of the
    entity in the Session is updated with the new queue state.
    """
    return sa_update(model).where(by_token(model, pk, row_id, token))


def delete_taken(model: type[M], pk: Column[Any], row_id: Any, token: str) -> Delete:
    return delete(model).where(by_token(model, pk, row_id, token))


def succeed_batch(
    model: type[M], pk: Column[Any], ids: Sequence[Any], token: str, now: datetime
) -> Update:
    """Mark the rows of one take as succeeded in one statement (a take shares one token)."""
    return (
        sa_update(model)
        .where(pk.in_(ids), model.queue_lock_token == token)
        .values(
            queue_status=EntityStatus.SUCCEEDED,
            queue_next_attempt_at=None,
            queue_lock_token=None,
            queue_attempts=model.queue_attempts + 1,
            queue_last_attempt_at=now,
        )
    )


def counts(model: type[M], now: datetime, where: Sequence[ColumnElement[bool]]) -> Select[Any]:
    """Rows per state in one scan."""
    at, token, status = model.queue_next_attempt_at, model.queue_lock_token, model.queue_status

    def n(cond: ColumnElement[bool]) -> Any:
        return func.coalesce(func.sum(case((cond, 1), else_=0)), 0)

    return select(
        n(at <= now).label("due"),
        n(and_(at > now, token.is_(None))).label("scheduled"),
        n(and_(at > now, token.is_not(None))).label("in_flight"),
        n(and_(at.is_(None), status == EntityStatus.SUCCEEDED)).label("succeeded"),
        n(and_(at.is_(None), status == EntityStatus.FAILED)).label("failed"),
        n(and_(at.is_(None), status == EntityStatus.NEW)).label("idle"),
    ).where(*where)


# -- the queue -----------------------------------------------------------------------------


def _rowcount(result: Result[Any]) -> int:
    return int(cast(CursorResult[Any], result).rowcount)


def _conditions(where: Iterable[Any]) -> list[ColumnElement[bool]]:
    conds = list(where)
    for cond in conds:
        if not isinstance(cond, ColumnElement):
            hint = (
                " (a Python bool: did you compare an instance attribute, order.id == 5, "
                "instead of a class attribute, Order.id == 5?)"
                if isinstance(cond, bool)
                else ""
            )
            raise InvalidArgument(
                f"filters must be SQL conditions such as Order.company_id == 3345, "
                f"got {type(cond).__name__}{hint}"
            )
    return conds


class EntityQueue(Generic[M]):
    """Take, settle, search and administer the rows of a class with :class:`EntityQueueMixin`.

    :param model: the mapped class; its table must hold the mixin's columns and have a
        single-column primary key.
    :param lease: how long a take hides an entity from other consumers.
    :param retry: when a failed entity is tried again, and after how many attempts it stays
        failed; :class:`~sqla_delayedq.ExponentialBackoff` by default.
    :param clock: the time source; inject one in tests instead of sleeping.
    :param delete_on_success: delete the row on success instead of marking it, for tables whose
        rows only stand for the work (seed 001).

    Every operation that takes a Session joins the caller's transaction and never commits it;
    only :meth:`process_due`, a convenience loop, opens and commits sessions of its own.
    """

    def __init__(
        self,
        model: type[M],
        *,
        lease: timedelta = timedelta(minutes=5),
        retry: RetryPolicy | None = None,
        clock: Clock = system_clock,
        delete_on_success: bool = False,
    ) -> None:
        mapper: Mapper[Any] | None = sa_inspect(model, raiseerr=False)
        if not isinstance(model, type) or not issubclass(model, EntityQueueMixin) or not mapper:
            raise InvalidArgument(
                f"model must be a mapped class with EntityQueueMixin, got {model!r}"
            )
        table = mapper.local_table
        if not isinstance(table, Table) or "queue_next_attempt_at" not in table.c:
            raise InvalidArgument(f"{model.__name__}'s own table must hold the queue columns")
        if len(mapper.primary_key) != 1:
            raise InvalidArgument(
                f"{model.__name__} has a composite primary key; entity queues need a "
                "single-column one"
            )
        self.model = model
        self.table: Table = table
        self.pk: Column[Any] = cast(Column[Any], mapper.primary_key[0])
        self._pk_key = mapper.get_property_by_column(self.pk).key
        self.lease = require_duration(lease, "lease")
        self.retry_policy: RetryPolicy = retry or ExponentialBackoff()
        if not isinstance(self.retry_policy, RetryPolicy):
            raise InvalidArgument("retry must have max_attempts and delay(attempts)")
        self.clock = clock
        self.delete_on_success = delete_on_success

    def __repr__(self) -> str:
        return f"EntityQueue({self.model.__name__}, table={self.table.name!r})"

    def now(self) -> datetime:
        return require_aware(self.clock(), "clock()")

    # -- scheduling ------------------------------------------------------------------------

    def schedule(
        self,
        session: Session,
        target: M | Iterable[M] | ColumnElement[bool],
        *,
        at: datetime | None = None,
    ) -> int:
        """Start a fresh run for ``target`` at ``at`` (now): attempts back to 0, lease reset.

        ``target`` is an entity (new or persistent; the change is flushed with it), several
        entities, or a ``WHERE`` condition on the model, e.g. ``Order.company_id == 3345`` or
        ``sqlalchemy.true()`` for every row. Returns how many rows were scheduled. A consumer
        holding one of them loses its lease: its ``succeed`` or ``fail`` becomes a no-op.
        """
        when = self.now() if at is None else require_aware(at, "at")
        values = {"queue_next_attempt_at": when, "queue_attempts": 0, "queue_lock_token": None}
        if isinstance(target, (ColumnElement, bool)):
            return self._update(session, _conditions([target]), values)
        if isinstance(target, self.model):
            entities: list[Any] = [target]
        elif isinstance(target, Iterable) and not isinstance(target, (str, Select)):
            entities = list(target)
        else:
            entities = [target]
        for entity in entities:
            if not isinstance(entity, self.model):
                hint = ""
                if isinstance(entity, Select):
                    hint = " (for a select, pass its condition: stmt.whereclause)"
                raise InvalidArgument(
                    f"schedule takes {self.model.__name__} entities or a SQL condition, "
                    f"got {type(entity).__name__}{hint}"
                )
        for entity in entities:
            for name, value in values.items():
                setattr(entity, name, value)
            session.add(entity)
        return len(entities)

    def stop(self, session: Session, *where: ColumnElement[bool]) -> int:
        """Clear the next attempt of matching pending rows; returns how many.

        The status stays as it was. A consumer holding one of them loses its lease. With no
        condition, every pending row stops.
        """
        conds = [*_conditions(where), self.model.queue_next_attempt_at.is_not(None)]
        return self._update(
            session, conds, {"queue_next_attempt_at": None, "queue_lock_token": None}
        )

    def process_now(self, session: Session, *where: ColumnElement[bool]) -> int:
        """Make matching rows that wait for a later time due now; returns how many.

        Rows in flight, due already, or with nothing to do are left alone; to start idle or
        finished rows, use :meth:`schedule`.
        """
        now = self.now()
        m = self.model
        conds = [
            *_conditions(where),
            m.queue_next_attempt_at > now,
            m.queue_lock_token.is_(None),
        ]
        return self._update(session, conds, {"queue_next_attempt_at": now})

    def retry_failed(
        self, session: Session, *where: ColumnElement[bool], at: datetime | None = None
    ) -> int:
        """Start a fresh run, at ``at`` (now), for matching rows of :func:`failed`."""
        when = self.now() if at is None else require_aware(at, "at")
        m = self.model
        conds = [
            *_conditions(where),
            m.queue_status == EntityStatus.FAILED,
            m.queue_next_attempt_at.is_(None),
        ]
        values = {"queue_next_attempt_at": when, "queue_attempts": 0, "queue_lock_token": None}
        return self._update(session, conds, values)

    def _update(
        self, session: Session, conds: Sequence[ColumnElement[bool]], values: dict[str, Any]
    ) -> int:
        """One set-based ``UPDATE``; then the queue state of this model's entities in the
        Session is expired, so it reloads on access.

        Expiring rather than SQLAlchemy's ``evaluate``/``fetch`` synchronisation: those skip
        attributes an object never loaded (a nullable column left unset on insert reads as None
        after the flush), and ``fetch`` costs an extra ``SELECT`` on MariaDB/MySQL.
        """
        stmt = sa_update(self.model).where(*conds).values(values)
        count = _rowcount(session.execute(stmt, execution_options={"synchronize_session": False}))
        for obj in list(session.identity_map.values()):
            if isinstance(obj, self.model):
                session.expire(obj, QUEUE_ATTRIBUTES)
        return count

    # -- taking ----------------------------------------------------------------------------

    def try_take(
        self, session: Session, n: int = 1, *, lease: timedelta | None = None
    ) -> list[EntityLease[M]]:
        """Take up to ``n`` due entities, oldest next attempt first, each with its lease.

        Rows other consumers hold are skipped (``FOR UPDATE SKIP LOCKED`` on PostgreSQL and
        MariaDB/MySQL; SQLite has one writer at a time). The entities are loaded into
        ``session`` with their current state, so a handler can change them and the changes
        commit with the success mark.
        """
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise InvalidArgument(f"n must be a positive integer, got {n!r}")
        lease = self.lease if lease is None else require_duration(lease, "lease")
        strategy = strategy_for(session)
        now = self.now()
        until = now + lease
        picked: list[M] = list(
            session.scalars(select_due(self.model, self.pk, now, n, strategy.poll_lock))
        )
        if not picked:
            return []
        token = secrets.token_hex(16)
        ids = [getattr(e, self._pk_key) for e in picked]
        stmt = take_ids(self.table, self.pk, ids, now, until, token)
        if _update_returning(strategy):
            taken = set(session.execute(stmt.returning(self.pk)).scalars())
        else:
            # MariaDB/MySQL: the picked rows are locked by this transaction, so all are taken.
            session.execute(stmt)
            taken = set(ids)
        leases = []
        for entity, row_id in zip(picked, ids, strict=True):
            if row_id not in taken:
                continue
            prev_token, prev_at = entity.queue_lock_token, entity.queue_next_attempt_at
            set_committed_value(entity, "queue_next_attempt_at", until)
            set_committed_value(entity, "queue_lock_token", token)
            leases.append(
                EntityLease(
                    id=row_id,
                    entity=entity,
                    lock_token=token,
                    attempt=entity.queue_attempts + 1,
                    delivery=Delivery.FIRST if prev_token is None else Delivery.REDELIVERY,
                    scheduled_at=cast(datetime, prev_at),
                    lease_until=until,
                )
            )
        return leases

    def try_take_one(
        self, session: Session, *, lease: timedelta | None = None
    ) -> EntityLease[M] | None:
        taken = self.try_take(session, 1, lease=lease)
        return taken[0] if taken else None

    # -- settling --------------------------------------------------------------------------

    def succeed(
        self, session: Session, lease: EntityLease[M], *, delete: bool | None = None
    ) -> bool:
        """Mark a taken entity succeeded (or delete its row), if the lease still holds.

        The Session's pending changes (the handler's) are flushed first, in the same
        transaction. Returns False, changing nothing, when the lease was lost: it ran out and
        another consumer took the row, or ``schedule``/``stop`` reset it.
        """
        if self.delete_on_success if delete is None else delete:
            stmt: Any = delete_taken(self.model, self.pk, lease.id, lease.lock_token)
        else:
            stmt = settle(self.model, self.pk, lease.id, lease.lock_token).values(
                queue_status=EntityStatus.SUCCEEDED,
                queue_next_attempt_at=None,
                queue_lock_token=None,
                queue_attempts=lease.attempt,
                queue_last_attempt_at=self.now(),
            )
        return _rowcount(session.execute(stmt)) == 1

    def succeed_many(self, session: Session, leases: Sequence[EntityLease[M]]) -> int:
        """Mark many taken entities succeeded, one statement per take; returns how many still
        held their lease."""
        by_token: dict[str, list[Any]] = {}
        for lease in leases:
            by_token.setdefault(lease.lock_token, []).append(lease.id)
        now = self.now()
        done = 0
        for token, ids in by_token.items():
            stmt = succeed_batch(self.model, self.pk, ids, token, now)
            done += _rowcount(session.execute(stmt))
        return done

    def fail(
        self,
        session: Session,
        lease: EntityLease[M],
        error: BaseException | str,
        *,
        at: datetime | None = None,
    ) -> NackOutcome:
        """Record a failed attempt: store the error, then retry later or give up.

        The retry is at ``at`` when given, else after the retry policy's delay. After
        ``max_attempts`` the row stays ``failed`` with no next attempt (``DEAD``) until
        :meth:`retry_failed` or :meth:`schedule`. ``STALE`` when the lease was lost.
        """
        now = self.now()
        attempts = lease.attempt
        gave_up = attempts >= self.retry_policy.max_attempts
        if gave_up:
            when = None
        elif at is not None:
            when = require_aware(at, "at")
        else:
            when = now + self.retry_policy.delay(attempts)
        stmt = settle(self.model, self.pk, lease.id, lease.lock_token).values(
            queue_status=EntityStatus.FAILED,
            queue_next_attempt_at=when,
            queue_lock_token=None,
            queue_attempts=attempts,
            queue_last_attempt_at=now,
            queue_last_error=error_text(error),
        )
        if _rowcount(session.execute(stmt)) != 1:
            return NackOutcome.STALE
        return NackOutcome.DEAD if gave_up else NackOutcome.RETRY_SCHEDULED

    def release(self, session: Session, lease: EntityLease[M]) -> bool:
        """Give a taken entity back, due now, without counting an attempt."""
        stmt = settle(self.model, self.pk, lease.id, lease.lock_token).values(
            queue_next_attempt_at=self.now(), queue_lock_token=None
        )
        return _rowcount(session.execute(stmt)) == 1

    def extend(
        self, session: Session, lease: EntityLease[M], by: timedelta | None = None
    ) -> EntityLease[M] | None:
        """Lengthen a lease to ``now + by`` (the queue's lease); None when already lost."""
        until = self.now() + (self.lease if by is None else require_duration(by, "by"))
        stmt = settle(self.model, self.pk, lease.id, lease.lock_token).values(
            queue_next_attempt_at=until
        )
        if _rowcount(session.execute(stmt)) != 1:
            return None
        return replace(lease, lease_until=until)

    # -- processing ------------------------------------------------------------------------

    def process_due(
        self,
        sessions: sessionmaker[Session],
        handler: Handler[M],
        *,
        limit: int = 1,
        transactional: bool = True,
    ) -> int:
        """Take up to ``limit`` due entities and run ``handler`` on each; returns how many.

        Transactional mode (default): take, handle and mark in one transaction; each handler
        runs in a savepoint, so a failure rolls back its changes and records the error, and a
        crash rolls back everything, leaving the entities due again at once.

        Lease mode (``transactional=False``): the take commits at once; each handler then runs
        outside any transaction on the entity loaded into a session of its own, and its changes
        commit together with the success mark. A crash means redelivery after the lease.

        A take that fails with a transient error (a deadlock, a lost connection) has changed
        nothing and run no handler, so it is tried again, up to ``TAKE_ATTEMPTS`` times.
        """
        attempt = 1
        while True:
            try:
                return self._process_due_once(sessions, handler, limit, transactional)
            except _TakeFailed as failed:
                if attempt == TAKE_ATTEMPTS or not is_transient(failed.error):
                    raise failed.error from None
            # A take that lost a deadlock (InnoDB's SKIP LOCKED on a secondary index can)
            # changed nothing and ran no handler: take again after a short, random pause.
            time.sleep(random.uniform(0, 0.01 * 2**attempt))
            attempt += 1

    def _take(self, session: Session, limit: int) -> list[EntityLease[M]]:
        try:
            return self.try_take(session, limit)
        except Exception as exc:
            raise _TakeFailed(exc) from exc

    def _process_due_once(
        self, sessions: sessionmaker[Session], handler: Handler[M], limit: int, transactional: bool
    ) -> int:
        if transactional:
            with sessions() as session, session.begin():
                leases = self._take(session, limit)
                for lease in leases:
                    savepoint = session.begin_nested()
                    try:
                        handler(lease.entity)
                        session.flush()
                    except Exception as exc:
                        savepoint.rollback()
                        self.fail(session, lease, exc)
                        continue
                    if self.succeed(session, lease):
                        savepoint.commit()
                    else:
                        savepoint.rollback()
            return len(leases)
        with sessions() as session, session.begin():
            leases = self._take(session, limit)
        for lease in leases:
            self._process_leased(sessions, handler, lease)
        return len(leases)

    def _process_leased(
        self, sessions: sessionmaker[Session], handler: Handler[M], lease: EntityLease[M]
    ) -> None:
        with sessions(expire_on_commit=False) as session:
            with session.begin():
                entity = session.get(self.model, lease.id, populate_existing=True)
            if entity is None or entity.queue_lock_token != lease.lock_token:
                return  # deleted, or the lease is already lost
            try:
                handler(entity)
                ok = self.succeed(session, lease)
            except Exception as exc:
                session.rollback()
                self.fail(session, lease, exc)
                session.commit()
                return
            if ok:
                session.commit()
            else:
                session.rollback()

    # -- read side -------------------------------------------------------------------------

    def pending(self) -> Select[Any]:
        """See :func:`pending`."""
        return pending(self.model)

    def due(self) -> Select[Any]:
        """See :func:`due`; due at the queue's clock."""
        return due(self.model, self.now())

    def failed(self) -> Select[Any]:
        """See :func:`failed`."""
        return failed(self.model)

    def retrying(self) -> Select[Any]:
        """See :func:`retrying`."""
        return retrying(self.model)

    def succeeded(self) -> Select[Any]:
        """See :func:`succeeded`."""
        return succeeded(self.model)

    def counts(self, session: Session, *where: ColumnElement[bool]) -> EntityCounts:
        """Rows per state, among those matching ``where`` (all rows when none)."""
        row = session.execute(counts(self.model, self.now(), _conditions(where))).one()
        return EntityCounts(**{k: int(v) for k, v in row._mapping.items()})


def _update_returning(strategy: Strategy) -> bool:
    """Whether ``UPDATE ... RETURNING`` exists: PostgreSQL and SQLite, not MariaDB/MySQL."""
    return strategy.update_returning
