"""Entity queues: queue-state columns on your own domain table, whose rows are the messages.

Some work belongs to a row that already exists: charge this order, send this invoice. Rather than
copying the row into a message, add :class:`EntityQueueMixin` to the mapped class. It adds six
columns, all prefixed ``queue_`` so they cannot clash with yours:

===========================  ==============================================================
``queue_status``             outcome of the last finished attempt: ``new`` (none yet),
                             ``succeeded`` or ``failed``; ``NOT NULL``, server default ``new``
``queue_next_attempt_at``    when the row is next due; ``NULL`` means nothing to do. Indexed.
                             A take moves it to the end of the lease (the schedule is the lock)
``queue_attempts``           finished attempts of the current run (a lease that ran out counts)
``queue_last_attempt_at``    when the last attempt finished
``queue_last_error``         the error text of the last failed attempt (kept after a success)
``queue_lock_token``         set by a take; settling is guarded by ``id = :id AND token = :t``
===========================  ==============================================================

Whether a row is pending depends on ``queue_next_attempt_at`` alone, never on the status: a
failed row waiting for its retry has status ``failed`` and a next attempt time. Existing rows get
``new`` and ``NULL`` when the migration adds the columns, so nothing is processed until you
schedule it (:meth:`EntityQueue.schedule`).

:class:`EntityQueue` is the same consumer contract as a message queue, over those rows, with the
same words: ``try_poll``/``try_poll_many`` take due rows (``FOR UPDATE SKIP LOCKED`` where the
backend has it) under a lease, and ``ack``, ``nack``, ``release`` and ``extend`` settle them with
the same statements and the same retry rules (:class:`~sqla_delayedq._leases.LeasedQueue`). The
envelope's ``payload`` is the entity. Workers serve entity queues like message queues
(``Worker.register(EntityQueue(Order), handler)``), with heartbeats, hooks and wake-ups.

- In **transactional mode** the entity is loaded into the transaction's Session: the handler's
  changes to it (and anything else it writes) commit together with the success mark.
- In **lease mode** the take commits at once and the handler gets the entity as a snapshot,
  outside any session. Changes it makes to the entity's own columns are written by ``ack``, in
  the statement that marks success and only while the lease holds; a failed attempt writes
  none of them. For relationships or other rows, use transactional mode.

Searching and admin are plain SQLAlchemy on your own columns:
``failed(Order).where(Order.company_id == 3345)`` is an ordinary ``Select``, and ``stop``,
``process_now`` and ``retry_failed`` take the same kind of ``WHERE`` conditions. See
``docs/entity-queues.md`` for a worked example.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from types import SimpleNamespace
from typing import Any, Final, TypeVar, cast

from sqlalchemy import Column, Integer, String, Table, Text, and_, case, func, or_, select
from sqlalchemy import inspect as sa_inspect
from sqlalchemy import update as sa_update
from sqlalchemy.engine import CursorResult, Result
from sqlalchemy.orm import Mapped, Mapper, Session, mapped_column
from sqlalchemy.orm.attributes import set_committed_value
from sqlalchemy.sql import ColumnElement, Select

from . import _statements as st
from ._dialects import Claimed, Claims, Strategy, strategy_for, transient_as_ours
from ._handlers import check_transactional
from ._leases import LeasedQueue, LeaseLost, Processed, leases_apart
from ._rules import HELD, held_due, held_prefix, lost_token
from ._time import Clock, DateTimeUTC, require_aware, require_lease, system_clock
from ._types import Delivery, Envelope, NackOutcome, built
from .errors import InvalidArgument
from .retry import ExponentialBackoff, RetryPolicy, check_policy

__all__ = [
    "EntityCounts",
    "EntityQueue",
    "EntityQueueMixin",
    "EntityStatus",
    "LeaseLost",
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


def entity_shape(table: Table, pk: Column[Any]) -> st.Shape:
    """The queue state of an entity table: the mixin's ``queue_`` columns; the owner's columns
    that update themselves are kept as they are (see ``Shape.kept``)."""
    c = table.c
    ours = set(QUEUE_ATTRIBUTES)
    kept = tuple(
        column
        for column in table.columns
        if column.name not in ours
        and (column.onupdate is not None or column.server_onupdate is not None)
    )
    return st.Shape(
        kept=kept,
        table=table,
        id=pk,
        due=c.queue_next_attempt_at,
        token=c.queue_lock_token,
        attempts=c.queue_attempts,
        error=c.queue_last_error,
        attempted_at=c.queue_last_attempt_at,
        status=c.queue_status,
        queue=None,
        done=EntityStatus.SUCCEEDED,
        dead=EntityStatus.FAILED,
        retrying=EntityStatus.FAILED,
        done_counts_attempt=True,
        fresh_when_done=True,
        row_tokens=False,  # one token per take: a primary key may be long text
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


def _fresh_run(when: datetime) -> dict[str, Any]:
    """The queue state of a fresh run due at ``when``: no attempts, no lease."""
    return {"queue_next_attempt_at": when, "queue_attempts": 0, "queue_lock_token": None}


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


class EntityQueue(LeasedQueue[M]):
    """Take, settle, search and administer the rows of a class with :class:`EntityQueueMixin`.

    :param model: the mapped class; its table must hold the mixin's columns and have a
        single-column primary key.
    :param lease: how long a take hides an entity from other consumers.
    :param retry: when a failed entity is tried again, and after how many attempts it stays
        failed; :class:`~sqla_delayedq.ExponentialBackoff` by default.
    :param clock: the time source; inject one in tests instead of sleeping.
    :param delete_on_success: delete the row on success instead of marking it, for tables whose
        rows only stand for the work.

    Every operation takes a Session, joins the caller's transaction and never commits it.
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
        self.name = table.name
        self.pk: Column[Any] = cast(Column[Any], mapper.primary_key[0])
        self._pk_key = mapper.get_property_by_column(self.pk).key
        self.shape = entity_shape(table, self.pk)
        self.lease = require_lease(lease)
        self.retry_policy: RetryPolicy = check_policy(
            ExponentialBackoff() if retry is None else retry
        )
        self.clock = clock
        self.delete_on_success = delete_on_success
        #: The columns a lease-mode handler's changes may write, by attribute name.
        self._own_columns = {
            attr.key: attr.columns[0]
            for attr in mapper.column_attrs
            if attr.key not in QUEUE_ATTRIBUTES and len(attr.columns) == 1
        }
        self._attr_of = {attr.columns[0]: attr.key for attr in mapper.column_attrs}
        self._init_leases()

    def __repr__(self) -> str:
        return f"EntityQueue({self.model.__name__}, table={self.table.name!r})"

    # -- scheduling ------------------------------------------------------------------------

    @transient_as_ours
    def schedule(
        self,
        session: Session,
        target: M | Iterable[M] | ColumnElement[bool],
        *,
        at: datetime | None = None,
    ) -> int:
        """Start a fresh run for ``target`` at ``at`` (now): attempts back to 0, lease reset.

        ``target`` is an entity (new or persistent), several entities, or a ``WHERE`` condition
        on the model, e.g. ``Order.company_id == 3345`` or ``sqlalchemy.true()`` for every row.
        Returns how many rows were scheduled. A new entity gets its run with its insert; stored
        ones are updated at once, whatever the Session loaded.

        An entity in flight is never run twice at once: its new run waits for the old delivery
        to end (the old consumer's ``ack``, ``nack`` or ``release``, which then settle nothing
        and return ``False``/``STALE``, or its lease's end) and then starts as a first
        delivery, at ``at`` or at once if that has passed.
        """
        when = self.now() if at is None else require_aware(at, "at")
        if isinstance(target, (ColumnElement, bool)):
            return self._restart(session, _conditions([target]), when)
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
        # A stored entity may have been taken since this Session loaded it: its run is
        # restarted by a statement that reads the row's lease as it is now (not the loaded one).
        stored = [sa_inspect(e).identity for e in entities if sa_inspect(e).has_identity]
        values = _fresh_run(when)
        for entity in entities:
            if not sa_inspect(entity).has_identity:
                for name, value in values.items():
                    setattr(entity, name, value)
            session.add(entity)
        restarted = 0
        if stored:
            restarted = self._restart(session, [self.pk.in_([key[0] for key in stored])], when)
        return len(entities) - len(stored) + restarted

    def _restart(
        self, session: Session, conds: Sequence[ColumnElement[bool]], when: datetime
    ) -> int:
        """Start a fresh run of the matching rows (see :func:`_statements.restart_values`)."""
        old = strategy_for(session).after_second(self.shape.token, HELD)
        restart = st.restart_values(self.shape, self.now(), when, held_prefix(when), old)
        return self._update(session, conds, restart)

    @transient_as_ours
    def stop(self, session: Session, *where: ColumnElement[bool]) -> int:
        """Clear the next attempt of matching pending rows; returns how many.

        The status stays as it was. A consumer holding one of them loses its lease, and a
        ``schedule`` after this does not wait for its handler to end (``schedule`` alone would).
        With no condition, every pending row stops.
        """
        conds = [*_conditions(where), self.model.queue_next_attempt_at.is_not(None)]
        return self._update(
            session, conds, {"queue_next_attempt_at": None, "queue_lock_token": None}
        )

    @transient_as_ours
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

    @transient_as_ours
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
        return self._update(session, conds, _fresh_run(when))

    def _update(
        self,
        session: Session,
        conds: Sequence[ColumnElement[bool]],
        values: dict[str, Any] | list[tuple[Any, Any]],
    ) -> int:
        """One set-based ``UPDATE``; then the queue state of this model's entities in the
        Session is expired, so it reloads on access.

        Expiring rather than SQLAlchemy's ``evaluate``/``fetch`` synchronisation: those skip
        attributes an object never loaded (a nullable column left unset on insert reads as None
        after the flush), and ``fetch`` costs an extra ``SELECT`` on MariaDB/MySQL.
        """
        stmt = sa_update(self.model).where(*conds)
        if isinstance(values, dict):
            stmt = stmt.values({**values, **st.keeping(self.shape)})
        else:
            stmt = stmt.ordered_values(*values, *st.keeping(self.shape).items())
        count = _rowcount(session.execute(stmt, execution_options={"synchronize_session": False}))
        for obj in list(session.identity_map.values()):
            if isinstance(obj, self.model):
                session.expire(obj, QUEUE_ATTRIBUTES)
        return count

    # -- take ------------------------------------------------------------------------------

    def _claim(
        self,
        session: Session,
        strategy: Strategy,
        now: datetime,
        until: datetime,
        limit: int,
        prefix: str,
        look_ahead: bool = True,
    ) -> Claims:
        """Load due entities with a locking select, then take them (the entities come back with
        the state the take gave them); with ``look_ahead`` the select looks at one more, to say
        whether more is due."""
        extra = 1 if look_ahead else 0
        stmt = st.select_due_entities(
            self.model, self.shape, now, limit + extra, strategy.poll_lock
        )
        picked: list[M] = list(session.scalars(stmt))
        if not picked:
            return Claims([], False)
        more, picked = len(picked) >= limit + extra, picked[:limit]
        ids = [getattr(e, self._pk_key) for e in picked]
        taken = strategy.take_picked(session, self.shape, ids, now, until, prefix)
        claimed = []
        for entity, row_id in zip(picked, ids, strict=True):
            if row_id not in taken:
                continue
            prev_token, prev_due = entity.queue_lock_token, entity.queue_next_attempt_at
            lost = lost_token(prev_token)  # as the take's SET counted it (st.take_values)
            fresh = prev_token is None and entity.queue_status == EntityStatus.SUCCEEDED
            attempts = 0 if fresh else entity.queue_attempts + (0 if lost is None else 1)
            if lost is not None:
                set_committed_value(entity, "queue_status", EntityStatus.FAILED)
            set_committed_value(entity, "queue_next_attempt_at", until)
            set_committed_value(entity, "queue_lock_token", prefix)
            set_committed_value(entity, "queue_attempts", attempts)
            row = SimpleNamespace(id=row_id, lock_token=prefix, attempts=attempts, entity=entity)
            claimed.append(Claimed(row, lost, cast(datetime, prev_due), held_due(prev_token)))
        return Claims(claimed, more)

    def _payload(self, claimed: Claimed) -> M:
        return cast(M, claimed.row.entity)

    def _envelope(self, claimed: Claimed, payload: M) -> Envelope[M]:
        row, due_at = claimed.row, claimed.prev_scheduled_at
        return built(
            Envelope,
            id=row.id,
            queue=self.name,
            key=str(row.id),
            payload=payload,
            scheduled_at=due_at,
            # An entity has no creation or first schedule of its own: the take's due time.
            scheduled_at_initially=due_at,
            created_at=due_at,
            delivery=Delivery.FIRST if claimed.prev_token is None else Delivery.REDELIVERY,
            attempt=row.attempts + 1,
            lock_token=row.lock_token,
            lease_until=payload.queue_next_attempt_at or due_at,
            headers={},
            group=None,
            priority=0,
        )

    # -- settle ----------------------------------------------------------------------------

    def _changes(self, session: Session, entity: Any) -> dict[Any, Any]:
        """What a lease-mode handler changed on its snapshot of the entity (own columns only).

        An entity in ``session`` is flushed instead: its changes go with the transaction.
        """
        state = sa_inspect(entity)
        if state.session is session:
            session.flush()
            return {}
        changes: dict[Any, Any] = {}
        for key, column in self._own_columns.items():
            history = state.attrs[key].history
            if history.added:
                changes[column] = history.added[0]
            elif history.deleted and not history.unchanged:
                changes[column] = None
        return changes

    def _ack(self, session: Session, envelope: Envelope[Any]) -> bool:
        """Mark the entity succeeded (or delete its row), with a lease-mode handler's changes."""
        changes = self._changes(session, envelope.payload)
        if self.delete_on_success:
            return self._settle(session, "ack", envelope.id, envelope.lock_token)
        if not changes:
            return self._settle(
                session,
                "done",
                envelope.id,
                envelope.lock_token,
                payload=envelope.payload,
                s_now=self.now(),
                s_attempts=envelope.attempt,
            )
        c = self.table.c
        values = {
            **changes,
            c.queue_status: EntityStatus.SUCCEEDED,
            c.queue_next_attempt_at: None,
            c.queue_lock_token: None,
            c.queue_attempts: envelope.attempt,
            c.queue_last_attempt_at: self.now(),
        }
        stmt = (
            sa_update(self.table)
            .where(self.pk == envelope.id, c.queue_lock_token == envelope.lock_token)
            .values(values)
        )
        if _rowcount(session.execute(stmt)) != 1:
            # Scheduled again while in flight: end the hold (see schedule), settle nothing.
            return self._settle_held(session, "done", envelope.id, envelope.lock_token, {})
        # The queue's columns only: the handler's changes stay changes on the snapshot until
        # this commits. Marked committed here, an ack made again after this transaction failed
        # (a deadlock, a lost connection) found none and wrote a success without them.
        self._mirror(envelope.payload, {k: v for k, v in values.items() if k not in changes})
        return True

    def _ack_many(self, session: Session, envelopes: Sequence[Envelope[Any]]) -> int:
        """One statement per take (a take's rows share a token), unless a lease-mode handler
        changed its entity: those are acknowledged one by one, with their changes."""
        if self.delete_on_success or any(
            sa_inspect(e.payload).session is not session for e in envelopes
        ):
            return super()._ack_many(session, envelopes)
        session.flush()
        by_token: dict[str, list[Envelope[Any]]] = {}
        for envelope in envelopes:
            by_token.setdefault(envelope.lock_token, []).append(envelope)
        now, c = self.now(), self.table.c
        done = 0
        for token, group in by_token.items():
            stmt = (
                sa_update(self.table)
                .where(self.pk.in_([e.id for e in group]), c.queue_lock_token == token)
                .values(
                    {
                        c.queue_status: EntityStatus.SUCCEEDED,
                        c.queue_next_attempt_at: None,
                        c.queue_lock_token: None,
                        c.queue_attempts: c.queue_attempts + 1,
                        c.queue_last_attempt_at: now,
                        **st.keeping(self.shape),
                    }
                )
            )
            matched = _rowcount(session.execute(stmt))
            done += matched
            if matched < len(group):  # some were scheduled again in flight: end their holds
                for e in group:
                    self._settle_held(session, "done", e.id, token, {})
            if matched == len(group):
                for e in group:
                    self._mirror(
                        e.payload,
                        {
                            c.queue_status: EntityStatus.SUCCEEDED,
                            c.queue_next_attempt_at: None,
                            c.queue_lock_token: None,
                            c.queue_attempts: e.attempt,
                            c.queue_last_attempt_at: now,
                        },
                    )
        return done

    def _mirror(self, payload: Any, values: dict[Any, Any]) -> None:
        """The entity shows what the settle wrote, without a reload."""
        for column, value in values.items():
            set_committed_value(payload, self._attr_of[column], value)

    def _adopt(self, session: Session, envelope: Envelope[M]) -> Envelope[M]:
        entity = session.get(self.model, envelope.id, populate_existing=True)
        if entity is None:  # deleted since the take: the ack will find nothing
            return envelope
        return replace(envelope, payload=entity)

    # -- transactional mode ----------------------------------------------------------------

    @transient_as_ours
    def process_one(
        self, session: Session, handler: Callable[[Envelope[M], Session], Any]
    ) -> Processed[M] | None:
        """Transactional mode for one entity, inside the caller's transaction.

        Take the first due entity in this transaction, run ``handler(envelope, session)`` in a
        savepoint, and mark it succeeded in the same transaction: the handler's changes commit
        with the mark, ``(envelope, None, None)``. When the handler raises, its changes are
        rolled back to the savepoint and the failed attempt is recorded: ``(envelope, error,
        outcome)``, a transient database error the handler raised included. A crash rolls
        everything back and the entity is due again at once. Transient database errors of the
        take or the mark, or one that ended the transaction, are re-raised. None when nothing
        is due.
        """
        check_transactional(handler, f"{type(self).__name__}.process_one")
        gate = self._transactional_gate(session)
        if gate == "paused":
            return None
        if gate == "limited":
            taken = self._limited_take(session, 1)
        else:
            taken = self._take_in_transaction(session, 1)
        if not taken:
            return None
        own = gate != "limited" or not leases_apart(session)
        return self._process_leased(session, handler, taken[0], own)

    @transient_as_ours
    def record_failure(
        self,
        session: Session,
        envelope: Envelope[Any],
        error: BaseException | str,
        at: datetime | None = None,
    ) -> NackOutcome:
        """Record a failed attempt of an entity whose transactional take rolled back (its
        handler raised ``SystemExit`` or another ``BaseException``): as :meth:`nack` would.

        A limited queue's take, a lease committed apart, outlived the rollback: it is nacked.
        Any other take went with the rollback, which put the row back as it was before it: the
        take is restored (its lock token), guarded by that state, and nacked. If another
        consumer has taken the entity since, or it was scheduled, stopped or processed
        meanwhile, nothing changes (``STALE``).
        """
        outcome = self.nack(session, envelope, error, at)
        if outcome is not NackOutcome.STALE:
            return outcome
        c = self.table.c
        # Before the take: due at the envelope's time, with the attempts the take found (one
        # fewer than it counted when it followed a lost lease), or a succeeded row without a
        # token, which the take started afresh (attempts from 0, see take_values).
        found: ColumnElement[bool] = c.queue_attempts.in_(
            (envelope.attempt - 1, envelope.attempt - 2)
        )
        if envelope.attempt == 1:
            fresh = and_(c.queue_status == EntityStatus.SUCCEEDED, c.queue_lock_token.is_(None))
            found = or_(found, fresh)
        restore = (
            sa_update(self.table)
            .where(self.pk == envelope.id, c.queue_next_attempt_at == envelope.scheduled_at, found)
            .values({c.queue_lock_token: envelope.lock_token, **st.keeping(self.shape)})
        )
        if _rowcount(session.execute(restore)) != 1:
            return NackOutcome.STALE
        return self.nack(session, envelope, error, at)

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

    @transient_as_ours
    def counts(self, session: Session, *where: ColumnElement[bool]) -> EntityCounts:
        """Rows per state, among those matching ``where`` (all rows when none)."""
        row = session.execute(counts(self.model, self.now(), _conditions(where))).one()
        return EntityCounts(**{k: int(v) for k, v in row._mapping.items()})
