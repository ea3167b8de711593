"""Taking under a lease and settling by lock token: one implementation for both kinds of queue.

A :class:`~sqla_delayedq.DelayedQueue` (rows of a message table) and an
:class:`~sqla_delayedq.EntityQueue` (rows of your own table) are the same consumer contract:
``try_poll``/``try_poll_many`` take due rows with a lease and a fresh lock token, and ``ack``,
``nack``, ``release`` and ``extend`` settle them, each guarded by that token. This base class
is that contract; the two queues only say how rows are picked and what the payload is. The
statements come from the table's :class:`~sqla_delayedq._statements.Shape`, the failure
decisions from :mod:`~sqla_delayedq._rules`, so a rule changed here changes for both.
"""

from __future__ import annotations

import abc
import logging
import secrets
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any, ClassVar, Generic, NamedTuple, TypeVar

from sqlalchemy import update
from sqlalchemy.orm import Session

from . import _statements as st
from . import controls as ctl
from ._codec import error_text
from ._dialects import (
    TAKE_ONLY,
    Claimed,
    Claims,
    Strategy,
    is_transient,
    strategy_for,
    transient_as_ours,
)
from ._handlers import run_in_savepoint
from ._rules import after_failure, attempts_used_up, carries, held_parts, hold
from ._time import Clock, require_aware, require_lease
from ._types import Buried, Envelope, NackOutcome
from ._wakeup import announce
from .errors import DecodeError, InvalidArgument, TransientError
from .models import table_key
from .retry import RetryPolicy

T = TypeVar("T")

#: The workers' logger: a message a take buries is logged where its failed attempts are.
log = logging.getLogger("sqla_delayedq.worker")

__all__ = [
    "APART",
    "BURIED",
    "FUSED",
    "UNSEEN",
    "Ahead",
    "LeaseLost",
    "LeasedQueue",
    "Processed",
    "TakeUnsure",
    "check_count",
    "log_buried",
]

#: What transactional processing of one row returns: the envelope, the handler's error (None:
#: handled and acknowledged in the caller's transaction) and what the failure did.
Processed = tuple[Envelope[T], BaseException | None, NackOutcome | None]


class Ahead(NamedTuple):
    """What a transactional take saw of its queue beyond the message it took."""

    #: False: the take cannot tell (the backend, a queue with groups, priorities or controls,
    #: a failed attempt whose retry time it did not see, an entity queue): take again to see.
    known: bool
    #: When known: the due time of the queue's next pending row (None: there is none).
    next_at: datetime | None


UNSEEN = Ahead(False, None)


#: ``Session.info`` key: (prefix, lease end) of an :meth:`LeasedQueue.ack_and_poll` or
#: :meth:`LeasedQueue.poll_alone` whose takes are not all delivered; left there when one raised.
FUSED = "sqla_delayedq.fused"

#: ``Session.info`` key: the messages the session's transaction buried at a take, a list of
#: :class:`~sqla_delayedq.Buried`. A worker reports them to its hooks once that transaction
#: committed (a rollback put them back as they were).
BURIED = "sqla_delayedq.buried"

#: ``Session.info`` key: the leases a transactional take of a limited queue committed apart
#: (see :meth:`LeasedQueue._limited_take`), for the caller to give back if its transaction
#: fails before their handler settles them: the caller's rollback leaves them.
APART = "sqla_delayedq.apart"


def log_buried(session: Session, queue: str, key: Any, error: str) -> None:
    """A message a take buried instead of delivering it (its attempts used up, its payload
    undecodable): no handler ran to fail, so nothing else would say it. One ``ERROR`` record
    now, and a :class:`~sqla_delayedq.Buried` on the session for the worker's hooks (see
    :data:`BURIED`)."""
    log.error(
        "%s/%s is dead: the take buried it without delivering it: %s",
        queue,
        key,
        error.partition("\n")[0],
    )
    session.info.setdefault(BURIED, []).append(Buried(queue, str(key), error))


class LeaseLost(Exception):
    """The handler finished, but its lease was lost meanwhile; nothing was acknowledged."""


class TakeUnsure(TransientError):
    """A take committed apart failed at its commit, which may have happened (the connection
    was lost after COMMIT was sent): ``envelopes`` are what it took, which a consumer finds
    still leased under their tokens if it did (see :meth:`LeasedQueue.holding`)."""

    def __init__(self, queue: str, envelopes: Sequence[Envelope[Any]]) -> None:
        super().__init__(
            f"the take of {len(envelopes)} message(s) on {queue} failed at its commit, which "
            "may have happened; roll back and run the transaction again"
        )
        self.envelopes = list(envelopes)


def check_count(n: Any) -> int:
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise InvalidArgument(f"n must be a positive integer, got {n!r}")
    return n


class Polled(NamedTuple, Generic[T]):
    """What :meth:`LeasedQueue.poll_batch` took, and whether more was due."""

    envelopes: list[Envelope[T]]
    #: More rows were due than the take asked for; for a queue with groups, the take got all
    #: it asked for (more may be due: its take looks no further).
    more: bool
    #: The queue's controls held due rows back (paused, or at a limit): take again after
    #: ``wait`` seconds (None: when woken or after the poll interval).
    held: bool = False
    wait: float | None = None
    #: When the take saw that nothing more was due: what it read of the queue beyond (see
    #: :class:`Ahead`; known only where the take's own statement could read it).
    ahead: Ahead = UNSEEN


def leases_apart(session: Session) -> bool:
    """Whether a transactional take of a limited queue commits its lease in a transaction of
    its own (see :meth:`LeasedQueue._limited_take`), so that, until the caller's transaction
    acknowledges it, the lease is all that keeps other consumers from the row: a worker keeps
    it extended while the handler runs. Not on SQLite, whose one writer takes it in the
    caller's transaction."""
    return strategy_for(session).poll_lock is not None


class LeasedQueue(abc.ABC, Generic[T]):
    """Take, acknowledge, fail, release and extend rows of one :class:`Shape` (see module)."""

    #: For logs, hooks and wake-ups: the queue's name (an entity queue: its table's).
    name: str
    shape: st.Shape
    lease: timedelta
    retry_policy: RetryPolicy
    clock: Clock
    #: How messages sharing a group key are ordered (None: no groups; an entity queue has none).
    grouping: st.Grouping = None
    #: Whether a row that becomes due wakes idle consumers (a message queue's ``notify``).
    notify: bool = True

    def _init_leases(self) -> None:
        self._settles: dict[str, Any] = {}

    def now(self) -> datetime:
        return require_aware(self.clock(), "clock()")

    @property
    def wake_key(self) -> str:
        """Its table's name in its controls and wake-ups: ``schema.name`` in a schema."""
        return table_key(self.shape.table)

    # -- what the two kinds of queue say ------------------------------------------------------

    @abc.abstractmethod
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
        """Pick up to ``limit`` due rows (skipping rows other consumers hold) and take them,
        and say whether more was due: with ``look_ahead``, by picking one row more, which a
        locking pick holds until the transaction ends; without it, a full take says more."""

    def _ack_params(self, envelope: Envelope[Any]) -> dict[str, Any] | None:
        """The parameters of a queue's acknowledgement, for
        :meth:`~sqla_delayedq._dialects.Strategy.ack_and_claim`; None: the queue's takes cannot
        be fused with it (priorities, an entity queue)."""
        return None

    @abc.abstractmethod
    def _payload(self, claimed: Claimed) -> T:
        """The payload a handler gets; :class:`DecodeError` buries the row instead."""

    @abc.abstractmethod
    def _envelope(self, claimed: Claimed, payload: T) -> Envelope[T]:
        """The envelope of a taken row."""

    @abc.abstractmethod
    def process_one(
        self, session: Session, handler: Callable[[Envelope[T], Session], Any]
    ) -> Processed[T] | None:
        """Transactional mode for one row, inside the caller's transaction."""

    @abc.abstractmethod
    def record_failure(
        self,
        session: Session,
        envelope: Envelope[Any],
        error: BaseException | str,
        at: datetime | None = None,
    ) -> NackOutcome:
        """Record a failed attempt of a row whose transactional take rolled back."""

    @transient_as_ours
    def process_next(
        self, session: Session, handler: Callable[[Envelope[T], Session], Any]
    ) -> tuple[Processed[T] | None, Ahead]:
        """:meth:`process_one`, and what its take saw of the queue beyond the row it took (a
        consumer that knows nothing more is due does not take again only to find nothing)."""
        return self.process_one(session, handler), UNSEEN

    # -- take ----------------------------------------------------------------------------------

    @transient_as_ours
    def try_poll(self, session: Session, *, lease: timedelta | None = None) -> Envelope[T] | None:
        """Take the first due row (by due time, then id), or None."""
        taken = self.try_poll_many(session, 1, lease=lease)
        return taken[0] if taken else None

    @transient_as_ours
    def try_poll_many(
        self, session: Session, n: int, *, lease: timedelta | None = None
    ) -> list[Envelope[T]]:
        """Take up to ``n`` due rows in due order, each with its lease and lock token.

        A row that cannot be delivered (its payload does not decode, or lost leases used up its
        attempts) is buried on the way and the take goes on, so it never blocks the queue.
        """
        return self.poll_batch(session, n, lease=lease).envelopes

    @transient_as_ours
    def poll_batch(self, session: Session, n: int, *, lease: timedelta | None = None) -> Polled[T]:
        """:meth:`try_poll_many`, and whether more rows were due than it took (a consumer that
        got all it asked for takes again only then)."""
        check_count(n)
        lease = self.lease if lease is None else require_lease(lease)
        strategy = strategy_for(session)
        gate = self.gate(session)
        if gate is not None:
            if gate.paused:  # as last read: no lock, no round trip until a change or refresh
                return Polled([], False, True, None)
            return self._controlled_poll(session, strategy, n, lease)
        return self._poll(session, strategy, n, lease)

    def _take_in_transaction(self, session: Session, n: int) -> list[Envelope[T]]:
        """A lease take in a transaction that goes on to run the handlers (a transactional
        take that keeps its rows, a plain queue's): no row looked ahead to, which the
        transaction would hold from other consumers until it ends."""
        return self._poll(session, strategy_for(session), n, self.lease, look_ahead=False).envelopes

    def _controlled_poll(
        self, session: Session, strategy: Strategy, n: int, lease: timedelta
    ) -> Polled[T]:
        """A take of a paused or limited queue: at most what its controls admit now."""
        session.info.pop(TAKE_ONLY, None)  # the controls' records must outlive a server crash
        table = self.wake_key

        def in_flight(now: datetime) -> int:
            lock = strategy.snapshot_may_be_old(session)
            stmt = st.in_flight(self.shape, self.name, now, lock)
            return int(session.execute(stmt).scalar_one())

        admission = ctl.admit(session, table, self.name, self.now, n, in_flight)
        if admission.allowed == 0:
            return Polled([], False, True, admission.wait)
        polled = self._poll(session, strategy, admission.allowed, lease, admission.now)
        taken = len(polled.envelopes)
        ctl.record(session, table, self.name, admission, taken)
        if polled.more and admission.allowed < n:
            return Polled(polled.envelopes, False, True, ctl.retry_after(admission, taken))
        return polled._replace(ahead=UNSEEN)  # the controls may hold what is due back

    def _poll(
        self,
        session: Session,
        strategy: Strategy,
        n: int,
        lease: timedelta,
        at: datetime | None = None,
        prefix: str | None = None,
        look_ahead: bool = True,
    ) -> Polled[T]:
        """The take itself; ``at``: the time every claim of it uses (else the clock's, per
        claim); ``prefix``: the lock tokens' prefix of every claim (else a new one per claim);
        ``look_ahead``: see :meth:`_claim` (off for a take whose transaction runs the handler)."""
        envelopes: list[Envelope[T]] = []
        more = False
        ahead = UNSEEN
        fixed = prefix
        while len(envelopes) < n:
            now = self.now() if at is None else at
            prefix = fixed or secrets.token_hex(12) + "."
            claims = self._claim(
                session, strategy, now, now + lease, n - len(envelopes), prefix, look_ahead
            )
            more = claims.more
            if not claims.claimed:
                ahead = Ahead(True, claims.next_at) if claims.seen else UNSEEN
                break
            buried = 0
            for c in claims.claimed:
                envelope = self._deliver(session, c, now)
                if envelope is None:
                    buried += 1
                else:
                    envelopes.append(envelope)
            if not buried:  # a short take means nothing more is due
                ahead = Ahead(True, claims.next_at) if claims.seen else UNSEEN
                break
        return Polled(envelopes, more, ahead=ahead)

    #: Whether a take may run with each statement committing on its own (see
    #: :meth:`poll_alone`): every claim of the queue is one statement that locks nothing it
    #: needs after it returns.
    takes_alone: ClassVar[bool] = False

    @transient_as_ours
    def poll_alone(self, session: Session, n: int, lease: timedelta) -> Polled[T] | None:
        """:meth:`poll_batch` with each statement committing on its own, where the backend
        gains by it (PostgreSQL, see ``Strategy.fused_ack``) and the queue allows it (see
        :attr:`takes_alone`; no controls to apply): ``session`` must be on an autocommit
        connection. A take is then one round trip, where a transaction of its own adds
        ``BEGIN`` and ``COMMIT`` before the handler can start. None when not allowed here,
        before anything ran.

        The take's prefix and lease end are in ``session.info`` under :data:`FUSED` until what
        it took is delivered: after a failure, which may follow a commit, :meth:`release_fused`
        gives back what it holds."""
        strategy = strategy_for(session)
        if not (self.takes_alone and strategy.fused_ack):
            return None
        check_count(n)
        fresh, controls = ctl.known(session, self.wake_key, self.name)
        if not fresh or controls is not None:
            return None  # a read, or controls to apply: only a transaction's take does that
        now = self.now()
        prefix = secrets.token_hex(12) + "."
        session.info[FUSED] = (prefix, now + lease)
        polled = self._poll(session, strategy, n, lease, now, prefix)
        del session.info[FUSED]
        return polled

    @transient_as_ours
    def ack_and_poll(
        self, session: Session, envelope: Envelope[Any], n: int, lease: timedelta
    ) -> tuple[bool, Polled[T]] | None:
        """Acknowledge ``envelope`` and take up to ``n`` more in one statement that commits on
        its own, where the backend and the queue allow it (PostgreSQL, a queue without
        priorities or controls, see
        :func:`~sqla_delayedq._statements.ack_and_claim`); ``session`` must be on an
        autocommit connection. Whether the acknowledgement matched, and what was taken; None
        when not allowed here, before anything ran (acknowledge and take in a transaction).

        The take's prefix and lease end are in ``session.info`` under :data:`FUSED` until the
        statement returned: after a failure that may have committed, :meth:`release_fused`
        gives back what it took."""
        params = self._ack_params(envelope)
        if params is None or not envelope.lock_token:
            return None
        fresh, controls = ctl.known(session, self.wake_key, self.name)
        if not fresh or controls is not None:
            return None  # a read, or controls to apply: only a transaction's take does that
        now = self.now()
        until, prefix = now + lease, secrets.token_hex(12) + "."
        session.info[FUSED] = (prefix, until)
        got = strategy_for(session).ack_and_claim(
            session, self.shape.table, params, self.name, now, until, n, prefix, self.grouping
        )
        if got is None:
            del session.info[FUSED]
            return None
        acked, claims = got
        envelopes = []
        for c in claims.claimed:
            taken = self._deliver(session, c, now)
            if taken is not None:
                envelopes.append(taken)
        del session.info[FUSED]  # from here on nothing can fail: what it took is delivered
        buried = len(envelopes) < len(claims.claimed)
        ahead = Ahead(True, claims.next_at) if claims.seen and not buried else UNSEEN
        # Some buried: more may be due behind them (a short take otherwise means none is).
        return acked > 0, Polled(envelopes, claims.more or buried, ahead=ahead)

    @transient_as_ours
    def ack_alone(self, session: Session, envelope: Envelope[Any]) -> bool | None:
        """:meth:`ack`'s one statement on an autocommit session (it commits durably on its
        own), where the backend gains by it and the queue allows it (as for
        :meth:`ack_and_poll`): True when it acknowledged; False when refused (a lost lease, or
        a hold that only :meth:`ack`, in a transaction, ends); None when not allowed here,
        before anything ran."""
        params = self._ack_params(envelope)
        if params is None or not envelope.lock_token or not strategy_for(session).fused_ack:
            return None
        stmt = self._settle_statement("done" if "s_now" in params else "ack")
        return st.affected(session, stmt, params) == 1

    @transient_as_ours
    def release_fused(self, session: Session, prefix: str, until: datetime) -> int:
        """Give back, due at once and uncounted, what a take of :meth:`ack_and_poll` or
        :meth:`poll_alone` with ``prefix`` and lease end ``until`` holds, if it committed: a
        statement failed without a reply. How many rows it gave back."""
        shape = self.shape
        stmt = (
            update(shape.table)
            .where(
                st.due_filter(shape, self.name, until),
                shape.due == until,
                shape.token.startswith(prefix, autoescape=True),
            )
            .values({shape.token: None, shape.due: self.now(), **st.keeping(shape)})
        )
        return st.affected(session, stmt)

    def _deliver(self, session: Session, claimed: Claimed, now: datetime) -> Envelope[T] | None:
        row = claimed.row
        if claimed.prev_held is not None and claimed.prev_held > now:
            # A hold that ended with the old lease (its consumer died) before the new version's
            # own time: the row is due at that time, not delivered now (no attempt counted).
            self._settle(session, "release", row.id, row.lock_token, s_at=claimed.prev_held)
            return None
        error = attempts_used_up(claimed.prev_token, row.attempts, self.retry_policy)
        attempts = row.attempts
        if error is None:
            try:
                payload = self._payload(claimed)
            except DecodeError as exc:
                error, attempts = error_text(exc), row.attempts + 1
            else:
                return self._envelope(claimed, payload)
        if self._bury(session, row.id, row.lock_token, attempts, error, now):
            log_buried(session, self.name, getattr(row, "key", row.id), error)
        return None

    # -- controls ------------------------------------------------------------------------------

    @transient_as_ours
    def gate(self, session: Session) -> ctl.QueueControls | None:
        """This queue's controls as this process last read them (at most
        :data:`~sqla_delayedq.controls.REFRESH` seconds ago); None when it is plain."""
        return ctl.lookup(session, self.wake_key, self.name)

    def _transactional_gate(self, session: Session) -> str:
        """Before a transactional take: ``"plain"``, ``"paused"`` or ``"limited"`` (take
        with :meth:`_limited_take`, so the limits see it)."""
        gate = self.gate(session)
        if gate is None:
            return "plain"
        return "paused" if gate.paused else "limited"

    def _limited_take(self, session: Session, n: int) -> list[Envelope[T]]:
        """A transactional take of a limited queue: a lease, taken under the queue's controls
        in a transaction of its own that commits at once, so the controls row is not held
        while the handler runs and the limits count it like any lease. The caller settles it
        by lock token in its own transaction. SQLite runs one writer at a time, so there the
        lease is taken in the caller's transaction. On a server the lease's transaction borrows
        a second pooled connection for a moment (a pool of ``concurrency + 2``, as workers
        want anyway, is enough)."""
        if not leases_apart(session):
            return self.poll_batch(session, n).envelopes
        bind = session.get_bind()
        taken: list[Envelope[T]] = []
        try:
            with Session(bind=bind.engine, expire_on_commit=False) as side, side.begin():
                taken = self.poll_batch(side, n).envelopes
        except Exception as exc:
            if taken and is_transient(exc):  # it failed at its commit, which may have happened
                raise TakeUnsure(self.name, taken) from exc
            raise
        session.info.setdefault(APART, []).extend(taken)
        return [self._adopt(session, e) for e in taken]

    @transient_as_ours
    def holding(self, session: Session, envelopes: Sequence[Envelope[T]]) -> list[Envelope[T]]:
        """Those of ``envelopes`` whose rows are still theirs to settle (they carry their lock
        tokens): after a take whose commit's outcome is unknown, the ones it took if it
        committed, none if it did not (a token is written by its take alone)."""
        if not envelopes:
            return []
        rows = session.execute(st.tokens_of(self.shape, [e.id for e in envelopes])).all()
        tokens = {row_id: token for row_id, token in rows}
        return [e for e in envelopes if carries(tokens.get(e.id), e.lock_token)]

    def _adopt(self, session: Session, envelope: Envelope[T]) -> Envelope[T]:
        """An envelope taken in another session, for use in ``session`` (an entity queue loads
        its entity there; a message payload is a plain value)."""
        return envelope

    def _process_leased(
        self,
        session: Session,
        handler: Callable[[Envelope[T], Session], Any],
        envelope: Envelope[T],
        own: bool,
    ) -> Processed[T]:
        """Transactional mode for a leased row: ``handler(envelope, session)`` in a savepoint,
        then the ack in the caller's transaction; a failure rolls the handler's writes back
        and records the attempt in that transaction instead.

        ``own``: the row was taken in the caller's transaction, whose lock keeps every other
        one off it; an ack it refuses was refused for the handler's own change to the row (it
        scheduled, stopped or deleted it), which commits with the handler's other writes."""
        savepoint, exc = run_in_savepoint(session, handler, envelope)
        if exc is not None:  # a transient one too: see DelayedQueue.process_next
            return envelope, exc, self.nack(session, envelope, exc)
        if self.ack(session, envelope) or own:
            savepoint.commit()
            return envelope, None, None
        savepoint.rollback()  # the lease taken apart ran out, or another session changed the row
        lost = LeaseLost(f"{self.name}/{envelope.key}: the lease was lost before the ack")
        return envelope, lost, NackOutcome.STALE

    @transient_as_ours
    def pause(self, session: Session) -> ctl.QueueControls:
        """Stop every consumer of this queue, in every process, from taking (offers are still
        accepted; messages in flight finish). Takes effect when the session commits."""
        return ctl.change(session, self.wake_key, self.name, self.now(), paused=True)

    @transient_as_ours
    def resume(self, session: Session) -> ctl.QueueControls:
        """Undo :meth:`pause`; idle consumers wake at once (on PostgreSQL, in every process)."""
        return ctl.change(session, self.wake_key, self.name, self.now(), paused=False)

    @transient_as_ours
    def set_limits(
        self,
        session: Session,
        *,
        max_in_flight: int | None = ctl.UNSET,
        rate: tuple[int, timedelta | float] | None = ctl.UNSET,
    ) -> ctl.QueueControls:
        """Limit the queue across every consumer: at most ``max_in_flight`` messages in flight,
        at most ``rate[0]`` takes in any ``rate[1]`` (a timedelta or seconds). None removes a
        limit; an argument left out is kept. Takes effect when the session commits."""
        return ctl.change(
            session,
            self.wake_key,
            self.name,
            self.now(),
            max_in_flight=max_in_flight,
            rate=rate,
        )

    @transient_as_ours
    def controls(self, session: Session) -> ctl.QueueControls:
        """The queue's controls as the database holds them now."""
        return ctl.read(session, self.wake_key, self.name)

    @transient_as_ours
    def next_due(self, session: Session) -> datetime | None:
        """When the next row becomes due after now (None: nothing scheduled)."""
        now = self.now()
        stmt = st.next_due(self.shape, self.name if self.shape.queue is not None else None, now)
        when: datetime | None = session.execute(stmt).scalar()
        return when

    # -- settle --------------------------------------------------------------------------------

    def _settle(
        self,
        session: Session,
        name: st.SettleName,
        row_id: Any,
        token: str,
        *,
        payload: Any = None,
        **params: Any,
    ) -> bool:
        """Run a settle statement (see :func:`_statements.settle`); True when it matched.

        ``payload``: the envelope's payload, which :meth:`_mirror` may update to match.
        """
        stmt = self._settle_statement(name)
        if st.affected(session, stmt, {**params, "s_id": row_id, "s_token": token}) != 1:
            return bool(token) and self._settle_held(session, name, row_id, token, params)
        if payload is not None:
            self._mirror(payload, st.settled_values(self.shape, name, params))
        return True

    def _settle_statement(self, name: st.SettleName) -> Any:
        """The settle statement ``name`` of the queue's table, built once."""
        stmt = self._settles.get(name)
        if stmt is None:
            stmt = self._settles[name] = st.settle(self.shape, name)
        return stmt

    def _settle_held(
        self, session: Session, name: st.SettleName, row_id: Any, token: str, params: Any
    ) -> bool:
        """A settle of a delivery whose message an offer updated meanwhile (held under a token
        that carries this one, see :func:`~sqla_delayedq._rules.hold`): ``extend`` lengthens
        the hold (True); anything else ends it, the new version due at its own time or at once
        (``release(at=)``: not before ``at``), and settles nothing (False)."""
        shape = self.shape
        found = session.execute(st.select_held(shape, row_id, token)).first()
        parts = None if found is None else held_parts(found[0])
        if found is None or parts is None or parts[1] != token:
            return False
        held_token, held_due = found
        due = parts[0] if parts[0] is not None else held_due  # the new version's own time
        if name == "extend":
            until = params["s_at"]
            if until > held_due:
                new_token, new_due = hold(token, until, due)
                session.execute(st.set_held(shape, row_id, held_token, new_token, new_due))
            return True
        at = params["s_at"] if name == "release" else None
        ends = max(due, at or self.now())
        session.execute(st.set_held(shape, row_id, held_token, None, ends))
        if self.notify:
            # The new version is due now (or at its own time), sooner than the lease's end that
            # idle consumers read: wake one on commit, as the offer that updated it did.
            announce(session, strategy_for(session), self.wake_key, self.name, 1)
        return False

    def _mirror(self, payload: Any, values: dict[Any, Any]) -> None:
        """After a settle: make an object that mirrors the row show what was written (an
        entity queue's entities); nothing for message payloads."""

    def _bury(
        self,
        session: Session,
        row_id: Any,
        token: str,
        attempts: int,
        error: str,
        now: datetime,
        payload: Any = None,
    ) -> bool:
        return self._settle(
            session,
            "bury",
            row_id,
            token,
            payload=payload,
            s_attempts=attempts,
            s_error=error,
            s_now=now,
        )

    @transient_as_ours
    def ack(self, session: Session, envelope: Envelope[Any]) -> bool:
        """Acknowledge a taken row. Guarded by the lock token: when the lease ran out and
        another consumer took it, or it was updated meanwhile, nothing happens and False is
        returned. A second ack is harmless."""
        return self._ack(session, envelope)

    @abc.abstractmethod
    def _ack(self, session: Session, envelope: Envelope[Any]) -> bool: ...

    @transient_as_ours
    def ack_many(self, session: Session, envelopes: Sequence[Envelope[Any]]) -> int:
        """Acknowledge a batch; returns how many still held their lease."""
        if not envelopes:
            return 0
        return self._ack_many(session, envelopes)

    def _ack_many(self, session: Session, envelopes: Sequence[Envelope[Any]]) -> int:
        return sum(self._ack(session, e) for e in envelopes)

    @transient_as_ours
    def nack(
        self,
        session: Session,
        envelope: Envelope[Any],
        error: BaseException | str,
        at: datetime | None = None,
    ) -> NackOutcome:
        """Record a failed attempt: store the error, then retry later or bury the row.

        The retry time is ``at`` when given, else the retry policy's delay. After
        ``max_attempts`` failed attempts the row is dead: never taken again, kept with its last
        error until requeued. ``STALE`` when the lease was lost (nothing changed).
        """
        now = self.now()
        when = None if at is None else require_aware(at, "at")
        failure = after_failure(self.retry_policy, envelope.attempt, now, when)
        text = error_text(error)
        payload = envelope.payload
        if failure.dead:
            buried = self._bury(
                session, envelope.id, envelope.lock_token, failure.attempts, text, now, payload
            )
            return NackOutcome.DEAD if buried else NackOutcome.STALE
        updated = self._settle(
            session,
            "nack",
            envelope.id,
            envelope.lock_token,
            payload=payload,
            s_at=failure.next_at,
            s_attempts=failure.attempts,
            s_error=text,
            s_now=now,
        )
        return NackOutcome.RETRY_SCHEDULED if updated else NackOutcome.STALE

    retry = nack

    @transient_as_ours
    def release(
        self, session: Session, envelope: Envelope[Any], *, at: datetime | None = None
    ) -> bool:
        """Give a taken row back, due now (or at ``at``), without counting an attempt."""
        when = self.now() if at is None else require_aware(at, "at")
        return self._settle(
            session,
            "release",
            envelope.id,
            envelope.lock_token,
            payload=envelope.payload,
            s_at=when,
        )

    @transient_as_ours
    def extend(
        self, session: Session, envelope: Envelope[T], lease: timedelta | None = None
    ) -> Envelope[T] | None:
        """Lengthen a lease to ``now + lease``; None when the lease was already lost."""
        lease = self.lease if lease is None else require_lease(lease)
        until = self.now() + lease
        extended = self._settle(
            session,
            "extend",
            envelope.id,
            envelope.lock_token,
            payload=envelope.payload,
            s_at=until,
        )
        if not extended:
            return None
        return replace(envelope, lease_until=until)
