"""The queue: offer, poll, acknowledge, fail, release and extend, on the caller's Session.

No operation commits. Each joins the caller's transaction, so a message is written (or taken, or
acknowledged) together with the caller's own rows, or not at all.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any, TypeVar, cast

from sqlalchemy import Engine, Table, delete, select, update
from sqlalchemy.orm import Session

from . import _offers
from . import _statements as st
from ._admin import AdminMixin
from ._codec import Codec, check_name, decode_headers, encode_headers, error_text, verbatim
from ._dialects import Claimed, Claims, Strategy, strategy_for, transient_as_ours
from ._handlers import check_transactional, run_in_savepoint
from ._leases import (
    UNSEEN,
    Ahead,
    LeasedQueue,
    Processed,
    check_count,
    leases_apart,
    log_buried,
)
from ._offers import OfferInput
from ._rules import after_failure, attempts_used_up, check_priority, held_due, lost_token
from ._time import LONGEST, Clock, require_aware, require_duration, require_lease, system_clock
from ._types import Delivery, Envelope, NackOutcome, OfferMode, OfferResult, Outcome, built
from .errors import DecodeError, InvalidArgument
from .models import KEY_MAX, QUEUE_MAX, DelayedMessage, QueueMessageMixin
from .retry import ExponentialBackoff, RetryPolicy, check_policy
from .serializers import JsonSerializer, Serializer

T = TypeVar("T")

__all__ = ["DelayedQueue", "OfferInput"]


def _envelope(
    row: Any,
    payload: T,
    due_at: datetime,
    prev_token: str | None,
    lock_token: str | None = None,
    lease_until: datetime | None = None,
    attempts: int | None = None,
) -> Envelope[T]:
    """The envelope of a taken row; ``due_at`` and ``prev_token`` as they were before the take.
    ``lock_token``, ``lease_until`` and ``attempts`` (those used before this one) are the row's
    own unless given (a consumed row has no token, is leased "until now", and its stored
    attempts miss a lost lease's)."""
    return built(
        Envelope,
        id=row.id,
        queue=row.queue,
        key=row.key,
        payload=payload,
        scheduled_at=due_at,
        scheduled_at_initially=row.scheduled_at_initially,
        created_at=row.created_at,
        delivery=Delivery.FIRST if prev_token is None else Delivery.REDELIVERY,
        attempt=(row.attempts if attempts is None else attempts) + 1,
        lock_token=row.lock_token if lock_token is None else lock_token,
        lease_until=row.scheduled_at if lease_until is None else lease_until,
        headers=decode_headers(row.headers),
        group=row.group_key,
        priority=row.priority,
    )


class DelayedQueue(LeasedQueue[T], AdminMixin):
    """A named queue of payloads of type ``T``, stored in ``model``'s table.

    :param name: the queue's name; many queues share one table.
    :param model: a mapped class with :class:`~sqla_delayedq.QueueMessageMixin`.
    :param serializer: how payloads are stored; JSON by default.
    :param lease: how long a take hides a message from other consumers.
    :param retry: when a failed message is retried and when it is dead.
    :param retention: keep acknowledged messages as ``done`` for this long instead of deleting.
    :param clock: the time source; inject one in tests instead of sleeping.
    :param notify: wake idle workers when an offer commits (``NOTIFY`` on PostgreSQL, in-process
        wake-ups everywhere).
    :param groups: messages offered with a ``group`` are delivered one of a group at a time, in
        schedule order (first schedule, then offer order); other groups are not held back.
    :param dead_blocks_group: with ``groups``, a dead message holds the rest of its group back
        until it is requeued or dropped (by default the next message goes on).
    :param priorities: due messages offered with a ``priority`` above 0 are taken first, highest
        first, then by schedule and id.
    :param priority_aging: with ``priorities``, a message due for longer than this is taken
        before any boosted one (oldest first), so no priority starves.
    """

    takes_alone = True  # every claim is one statement (two probes with priorities)

    def __init__(
        self,
        name: str,
        *,
        model: type[QueueMessageMixin] = DelayedMessage,
        serializer: Serializer[T] | None = None,
        lease: timedelta = timedelta(minutes=5),
        retry: RetryPolicy | None = None,
        retention: timedelta | None = None,
        clock: Clock = system_clock,
        notify: bool = True,
        groups: bool = False,
        dead_blocks_group: bool = False,
        priorities: bool = False,
        priority_aging: timedelta | None = None,
    ) -> None:
        self.name = check_name(name, "queue name", QUEUE_MAX)
        if dead_blocks_group and not groups:
            raise InvalidArgument("dead_blocks_group needs groups=True")
        if priority_aging is not None and not priorities:
            raise InvalidArgument("priority_aging needs priorities=True")
        self.priorities = priorities
        self.priority_aging = (
            None
            if priority_aging is None
            else require_duration(priority_aging, "priority_aging", most=LONGEST)
        )
        self.grouping: st.Grouping = (
            None if not groups else "dead_blocks" if dead_blocks_group else "dead_skips"
        )
        self.model = model
        self.table: Table = cast(Table, model.__table__)  # type: ignore[attr-defined]
        self.shape = st.message_shape(self.table)
        self.codec: Codec[T] = Codec(serializer or cast(Serializer[T], JsonSerializer()))
        self.serializer: Serializer[T] = self.codec.serializer
        self.lease = require_lease(lease)
        self.retry_policy: RetryPolicy = check_policy(
            ExponentialBackoff() if retry is None else retry
        )
        self.retention = (
            None if retention is None else require_duration(retention, "retention", most=LONGEST)
        )
        self.clock = clock
        self.notify = notify
        self._init_leases()

    def __repr__(self) -> str:
        return f"DelayedQueue({self.name!r}, table={self.table.name!r})"

    # -- offer ---------------------------------------------------------------------------

    @transient_as_ours
    def offer(
        self,
        session: Session | Engine,
        key: str | None,
        payload: T,
        at: datetime | None = None,
        *,
        mode: OfferMode | str = OfferMode.REPLACE,
        headers: Mapping[str, str] | None = None,
        group: str | None = None,
        priority: int = 0,
    ) -> OfferResult:
        """Enqueue ``payload`` under ``key`` (generated when None), due at ``at`` (now).

        Returns the key and ``CREATED``, ``UPDATED`` or ``IGNORED`` (see :class:`OfferMode`).
        An update starts a fresh run: a consumer still holding the old version cannot ack it,
        and the new version waits, in flight, until that old delivery ends (its ack, failure,
        release, or the end of its lease): never handled beside it.
        ``headers`` (str to str, for example a trace context) travel with the message to
        :attr:`Envelope.headers`; they are not part of its identity (an offer that changes only
        them is ``IGNORED``), and an update stores the updating offer's. ``group`` (a queue with
        ``groups=True``) puts a new message in that group; an update keeps the message's group.
        ``priority`` (a queue with ``priorities=True``): 0 (the default, lowest) to
        32767; an update stores the updating offer's.

        With an ``Engine`` instead of a Session, the offer is committed on its own, for a
        producer with no transaction to join: on PostgreSQL a new message is then one
        autocommit statement (one round trip); an existing key, or another backend, takes a
        short transaction of its own, made again when the database refuses it for now (a
        deadlock, a lost connection; up to ``ENGINE_ATTEMPTS`` times).
        """
        mode = OfferMode.parse(mode)
        key = _offers.message_key(key)
        now = self.now()
        when = None if at is None else require_aware(at, "at")
        values = self.codec.values(payload)
        values["headers"] = encode_headers(headers)
        values["priority"] = self._check_priority(priority)
        group = self._check_group(group)
        if isinstance(session, Engine):
            outcome = _offers.offer_on_engine(self, session, key, values, when, now, mode, group)
            return OfferResult(key, outcome)
        strategy = strategy_for(session)
        outcome = _offers.offer_one(self, session, strategy, key, values, when, now, mode, group)
        if outcome is not Outcome.IGNORED:
            _offers.wake(self, session, strategy, 1)
        return OfferResult(key, outcome)

    @transient_as_ours
    def offer_batch(
        self,
        session: Session,
        messages: Iterable[OfferInput],
        *,
        mode: OfferMode | str = OfferMode.REPLACE,
        headers: Mapping[str, str] | None = None,
        group: str | None = None,
        priority: int = 0,
    ) -> list[OfferResult]:
        """Offer many messages: one outcome per message, in input order.

        All input is validated and encoded before any SQL runs. Messages are written in chunks
        under the backend's parameter limit, with a constant number of statements per chunk. A
        key repeated in the batch behaves as repeated offers in input order; a key inserted by a
        concurrent transaction falls back to the single-message path for that key only.
        ``headers`` and ``priority`` go with every message of the batch, and ``group`` with every
        new one (as in :meth:`offer`).
        """
        stored = encode_headers(headers)
        group = self._check_group(group)
        priority = self._check_priority(priority)
        mode = OfferMode.parse(mode)
        return _offers.offer_batch(self, session, messages, mode, stored, group, priority)

    def _check_priority(self, priority: int) -> int:
        if priority == 0 and type(priority) is int:
            return 0
        if not self.priorities:
            raise InvalidArgument(
                f"queue {self.name!r} has no priorities: build it with DelayedQueue(..., "
                "priorities=True) in the producer and in the worker"
            )
        return check_priority(priority)

    def _check_group(self, group: str | None) -> str | None:
        if group is None:
            return None
        if self.grouping is None:
            raise InvalidArgument(
                f"queue {self.name!r} has no groups: build it with DelayedQueue(..., groups=True) "
                "in the producer and in the worker"
            )
        return check_name(group, "group", KEY_MAX)

    # -- take ----------------------------------------------------------------------------

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
        if self.grouping is not None:
            strategy.check_group_isolation(session)
        if not self.priorities:
            # The take reads when the next row is due in its own statement (an idle lease
            # consumer then needs no statement to know how long to sleep).
            return strategy.claim(
                session,
                self.table,
                self.name,
                now,
                until,
                limit,
                prefix,
                self.grouping,
                ahead=True,
                look_ahead_row=look_ahead,
            )
        claimed: list[Claimed] = []
        for due, boosted in self._probes(now):
            got = strategy.claim(
                session,
                self.table,
                self.name,
                due,
                until,
                limit - len(claimed),
                prefix,
                self.grouping,
                boosted,
                look_ahead_row=look_ahead,
            )
            claimed += got.claimed
            if len(claimed) >= limit:
                return Claims(claimed, True)  # filled by a probe: take again to find out
        return Claims(claimed, False)

    def _probes(self, now: datetime) -> list[tuple[datetime, bool]]:
        """A take of a queue with priorities, probe by probe (each an index range scan): the
        messages due for longer than the aging (oldest first), the boosted ones (highest
        first), then every due one (by schedule). A probe that fills the take ends it."""
        probes = [(now, True), (now, False)]
        if self.priority_aging is not None:
            probes.insert(0, (now - self.priority_aging, False))
        return probes

    def _payload(self, claimed: Claimed) -> T:
        return self.codec.decode(claimed.row)

    def _envelope(self, claimed: Claimed, payload: T) -> Envelope[T]:
        return _envelope(claimed.row, payload, claimed.prev_scheduled_at, claimed.prev_token)

    # -- settle --------------------------------------------------------------------------

    def _ack_params(self, envelope: Envelope[Any]) -> dict[str, Any] | None:
        if self.priorities:
            return None  # a take of boosted messages first, then the rest: two statements
        params = {"s_id": envelope.id, "s_token": envelope.lock_token}
        if self.retention is not None:
            params["s_now"] = self.now()
        return params

    def _ack(self, session: Session, envelope: Envelope[Any]) -> bool:
        """Delete the message, or mark it done when the queue keeps acknowledged messages."""
        if self.retention is None:
            return self._settle(session, "ack", envelope.id, envelope.lock_token)
        return self._settle(session, "done", envelope.id, envelope.lock_token, s_now=self.now())

    def _ack_many(self, session: Session, envelopes: Sequence[Envelope[Any]]) -> int:
        """One statement for the whole batch: tokens embed the row id, so they identify it."""
        t = self.table
        cond = strategy_for(session).ack_by_tokens(
            t, [e.id for e in envelopes], [e.lock_token for e in envelopes]
        )
        if self.retention is None:
            stmt: Any = delete(t).where(*cond)
        else:
            stmt = (
                update(t)
                .where(*cond)
                .values(
                    status="done", scheduled_at=None, lock_token=None, last_attempt_at=self.now()
                )
            )
        acked = st.affected(session, stmt)
        if acked < len(envelopes):  # some were replaced in flight: end their holds
            for e in envelopes:
                if e.lock_token:
                    self._settle_held(session, "ack", e.id, e.lock_token, {})
        return acked

    # -- transactional mode --------------------------------------------------------------

    @transient_as_ours
    def consume(self, session: Session, n: int = 1) -> list[Envelope[T]]:
        """Take up to ``n`` due messages for processing inside the caller's transaction.

        The messages are deleted (marked done, with retention) in the caller's transaction, so
        they are gone when it commits together with the handler's writes, and due again at once
        when it rolls back. No ack is needed. After a rollback, record the failed attempt with
        :meth:`record_failure` in a new transaction. (A queue with an in-flight or rate limit
        takes its messages under a lease committed apart, on PostgreSQL and MariaDB, so the
        limit sees them: after a rollback they are due again when :meth:`record_failure` says,
        or when that lease ends; their envelopes carry its lock token.)
        """
        check_count(n)
        gate = self._transactional_gate(session)
        if gate == "paused":
            return []
        if gate == "limited" or self.retention is not None:
            if gate == "limited":
                envelopes = self._limited_take(session, n)
            else:
                envelopes = self._take_in_transaction(session, n)
            self.ack_many(session, envelopes)
            if gate == "limited" and leases_apart(session):
                # The lease was committed apart: after a rollback the row is still under it,
                # and record_failure finds the row by its token.
                return envelopes
            # As a consumed row's envelope (``_consumed``): no token; record_failure finds the
            # row as it was before the take (a lost lease's count rolled back with it).
            return [replace(e, lock_token="") for e in envelopes]
        return [envelope for envelope, _ in self._consume_rows(session, n)]

    def _consume_rows(
        self, session: Session, n: int, *, ahead: bool = False
    ) -> list[tuple[Envelope[T], Any]]:
        strategy = strategy_for(session)
        if self.grouping is not None:
            strategy.check_group_isolation(session)
        taken: list[tuple[Envelope[T], Any]] = []
        while len(taken) < n:
            now = self.now()
            rows: list[Any] = []
            for due, boosted in self._probes(now) if self.priorities else [(now, False)]:
                rows += strategy.consume(
                    session,
                    self.table,
                    self.name,
                    due,
                    n - len(taken) - len(rows),
                    self.grouping,
                    boosted,
                    ahead,
                )
                if len(taken) + len(rows) >= n:
                    break
                if self.grouping is not None and any(r.group_key is not None for r in rows):
                    # The rows this transaction deleted no longer hold their groups back from
                    # its own next statement: a later probe would take the next message of a
                    # group whose head is in this batch. The take ends short instead.
                    break
            if not rows:
                break
            buried = 0
            for row in rows:
                envelope = self._consumed(session, row, now)
                if envelope is None:
                    buried += 1
                else:
                    taken.append((envelope, row))
            if not buried:
                break  # a short take means the queue has nothing more due
            if self.grouping is not None and any(e.group is not None for e, _ in taken):
                break  # as above: another round would see past this batch's own heads
        return taken

    def _consumed(self, session: Session, row: Any, now: datetime) -> Envelope[T] | None:
        """The envelope of a consumed row; one whose hold ended with the old lease before its
        own time is put back due then, and one a take never hands out (no attempt left, as
        :meth:`_deliver` decides: a lost lease counted, or undecodable) is put back dead."""
        held = held_due(row.lock_token)
        if held is not None and held > now:
            values = {c: verbatim(getattr(row, c)) for c in st.TAKE_COLUMNS}
            values |= {"lock_token": None, "scheduled_at": held, "status": "pending"}
            session.execute(self.table.insert().values(values))
            return None
        lost = lost_token(row.lock_token)
        attempts = row.attempts + (lost is not None)
        used_up = attempts_used_up(lost, attempts, self.retry_policy)
        if used_up is not None:
            self._put_back(session, row, attempts, used_up, None, now)
            log_buried(session, self.name, row.key, used_up)
            return None
        try:
            payload = self.codec.decode(row)
        except DecodeError as exc:
            error = error_text(exc)
            self._put_back(session, row, row.attempts + 1, error, None, now)
            log_buried(session, self.name, row.key, error)
            return None
        # Consumed: no lease and no token; the row's own due time and token are the "before",
        # and the attempt counts a lost lease's, as a lease take's does.
        return _envelope(row, payload, row.scheduled_at, lost, "", now, attempts)

    def _put_back(
        self,
        session: Session,
        row: Any,
        attempts: int,
        error: str,
        next_at: datetime | None,
        now: datetime,
    ) -> None:
        """Re-create a consumed row with a failed attempt recorded (same transaction): due at
        ``next_at``, or dead when it is None."""
        values = {c: verbatim(getattr(row, c)) for c in st.TAKE_COLUMNS}
        values |= {"attempts": attempts, "last_error": error, "last_attempt_at": now}
        values |= {"lock_token": None, "status": "pending", "scheduled_at": next_at}
        if next_at is None:
            values["status"] = "dead"
        session.execute(self.table.insert().values(values))

    @transient_as_ours
    def process_one(
        self, session: Session, handler: Callable[[Envelope[T], Session], Any]
    ) -> Processed[T] | None:
        """Transactional mode for one message, inside the caller's transaction.

        Consume the first due message, run ``handler(envelope, session)`` inside a savepoint,
        and return ``(envelope, None, None)``: the removal (under retention: the mark done, as
        :meth:`consume` makes it) commits with the handler's writes.
        When the handler raises, its writes are rolled back to the savepoint and the failed
        attempt is recorded in the same transaction, so the message is never due again before
        its retry time: ``(envelope, error, outcome)``; a transient database error the handler
        raised counts like any other (lease mode counts it too). Transient errors of the take
        or the acknowledgement, or a handler error that ended the whole transaction (InnoDB's
        deadlock), are re-raised: roll back and retry, nothing is lost, no attempt is counted.
        None when nothing is due.
        """
        return self.process_next(session, handler)[0]

    @transient_as_ours
    def process_next(
        self, session: Session, handler: Callable[[Envelope[T], Session], Any]
    ) -> tuple[Processed[T] | None, Ahead]:
        """:meth:`process_one`, and what its take saw of the queue beyond the message it took
        (PostgreSQL reads it in the take's statement, for a queue without groups, priorities or
        controls; elsewhere :data:`~sqla_delayedq._leases.UNSEEN`)."""
        check_transactional(handler, f"{type(self).__name__}.process_one")
        gate = self._transactional_gate(session)
        if gate == "paused":
            return None, UNSEEN
        if gate == "limited":
            leased = self._limited_take(session, 1)
            if not leased:
                return None, UNSEEN
            own = not leases_apart(session)
            return self._process_leased(session, handler, leased[0], own), UNSEEN
        if self.retention is not None:
            return self._process_kept(session, handler), UNSEEN
        plain = self.grouping is None and not self.priorities
        taken = self._consume_rows(session, 1, ahead=plain)
        if not taken:
            return None, UNSEEN
        envelope, row = taken[0]
        ahead = Ahead(True, row.next_at) if "next_at" in row._fields else UNSEEN
        savepoint, exc = run_in_savepoint(session, handler, envelope)
        if exc is None:
            savepoint.commit()
            return (envelope, None, None), ahead
        # Any error of the handler's is a failed attempt, a transient one too (its writes are
        # rolled back, the transaction goes on): re-raised, it ran the message again and again,
        # never counted, when it was the handler's own (another database down).
        now = self.now()
        failure = after_failure(self.retry_policy, envelope.attempt, now)
        self._put_back(session, row, failure.attempts, error_text(exc), failure.next_at, now)
        outcome = NackOutcome.DEAD if failure.dead else NackOutcome.RETRY_SCHEDULED
        # The retry time is not in what the take saw: the consumer looks again.
        return (envelope, exc, outcome), UNSEEN

    def _process_kept(
        self, session: Session, handler: Callable[[Envelope[T], Session], Any]
    ) -> Processed[T] | None:
        """:meth:`process_next` under retention, where a handled message is kept as done, as
        :meth:`consume` keeps it: taken under a lease in the caller's transaction (the row lock
        keeps other consumers off it) and marked done by its ack, in that transaction. The
        handler gets the envelope :meth:`consume` would give (no token), which
        :meth:`record_failure` finds the row by after a rollback."""
        taken = self._take_in_transaction(session, 1)
        if not taken:
            return None
        leased = taken[0]
        envelope = replace(leased, lock_token="")
        savepoint, exc = run_in_savepoint(session, handler, envelope)
        if exc is not None:
            return envelope, exc, self.nack(session, leased, exc)
        # Refused only for the handler's own change to the row (an offer that updated it), as
        # a plain consume's removal would be: that change commits with its other writes.
        self.ack(session, leased)
        savepoint.commit()
        return envelope, None, None

    @transient_as_ours
    def record_failure(
        self,
        session: Session,
        envelope: Envelope[Any],
        error: BaseException | str,
        at: datetime | None = None,
    ) -> NackOutcome:
        """Record a failed attempt of a consumed message whose transaction rolled back.

        Guarded by the row as it was before the take: if another consumer has taken the message
        since the rollback, its own attempt counts instead and nothing changes (``STALE``); so
        does an offer that replaced it since (a new version, whose first attempt this is not).
        """
        t = self.table
        now = self.now()
        when = None if at is None else require_aware(at, "at")
        failure = after_failure(self.retry_policy, envelope.attempt, now, when)
        # The attempts as before the take: a lost lease's, which the envelope's attempt counts,
        # was rolled back with it (unless the take was a lease committed apart).
        before = envelope.attempt - 1 - (envelope.redelivered and not envelope.lock_token)
        # Any take since the rollback moved scheduled_at (a lease) or removed the row; an offer
        # that changed it reset its attempts or changed its payload (the offer's own rule of
        # what is the same message), which only reading the row can tell.
        guard = [
            t.c.id == envelope.id,
            t.c.status == "pending",
            # A limited queue's consume leased the row in a transaction of its own: the
            # rollback left it under that lease (see consume).
            t.c.lock_token == envelope.lock_token
            if envelope.lock_token
            else t.c.scheduled_at == envelope.scheduled_at,
            t.c.attempts == before,
        ]
        found = session.execute(
            select(t.c.payload_type, t.c.payload, t.c.payload_bytes).where(*guard).with_for_update()
        ).first()
        if found is None and envelope.lock_token:
            # An offer updated it since: held for this delivery, which ends here (as a nack).
            self._settle_held(session, "nack", envelope.id, envelope.lock_token, {})
        if found is None or not self.codec.same(found, self.codec.values(envelope.payload)):
            return NackOutcome.STALE
        values: dict[str, Any] = {
            "attempts": failure.attempts,
            "last_error": error_text(error),
            "last_attempt_at": now,
            "lock_token": None,
            "scheduled_at": failure.next_at,
        }
        if failure.dead:
            values["status"] = "dead"
        if st.affected(session, update(t).where(*guard).values(values)) != 1:
            return NackOutcome.STALE
        return NackOutcome.DEAD if failure.dead else NackOutcome.RETRY_SCHEDULED
