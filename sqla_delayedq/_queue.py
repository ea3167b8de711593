"""The queue: offer, poll, acknowledge, fail, release and extend, on the caller's Session.

No operation commits. Each joins the caller's transaction, so a message is written (or taken, or
acknowledged) together with the caller's own rows, or not at all.
"""

from __future__ import annotations

import json
import secrets
import traceback
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any, Generic, TypeVar, cast

from sqlalchemy import Table, bindparam, func, literal, select, update
from sqlalchemy.orm import Session

from . import _statements as st
from ._admin import AdminMixin
from ._dialects import Claimed, Strategy, is_transient, strategy_for
from ._time import Clock, require_aware, require_duration, system_clock
from ._types import Delivery, Envelope, NackOutcome, OfferMode, OfferResult, Outcome
from ._wakeup import announce, channel_for, notify_pending
from .errors import ConcurrentUpdate, DecodeError, EncodeError, InvalidArgument
from .models import ERROR_MAX, KEY_MAX, QUEUE_MAX, DelayedMessage, QueueMessageMixin
from .retry import ExponentialBackoff, RetryPolicy
from .serializers import JsonSerializer, Serializer

T = TypeVar("T")

__all__ = ["DelayedQueue", "OfferInput"]

#: One message of a batch: ``(key, payload)`` or ``(key, payload, at)``; ``key`` may be None.
OfferInput = tuple[str | None, Any] | tuple[str | None, Any, datetime | None]

#: Columns an offer writes when it creates a row.
INSERT_COLUMNS = (
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
)

#: How many times a compare-and-swap is retried before giving up; each lost round means another
#: transaction changed the row in between, which row locks make rare outside SQLite.
CAS_ROUNDS = 32


def check_name(value: Any, what: str, limit: int) -> str:
    if not isinstance(value, str):
        raise InvalidArgument(f"{what} must be a string, got {type(value).__name__}")
    if not value:
        raise InvalidArgument(f"{what} must not be empty")
    if len(value) > limit:
        raise InvalidArgument(f"{what} is {len(value)} characters; the limit is {limit}")
    return value


def error_text(error: BaseException | str) -> str:
    if isinstance(error, BaseException):
        text = "".join(traceback.format_exception_only(type(error), error)).strip()
        tb = "".join(traceback.format_tb(error.__traceback__)) if error.__traceback__ else ""
        if tb:
            text = f"{text}\n{tb}"
    else:
        text = str(error)
    return text[:ERROR_MAX]


def _envelope(row: Any, payload: T, due_at: datetime, prev_token: str | None) -> Envelope[T]:
    """The envelope of a taken row; ``due_at`` and ``prev_token`` as they were before the take."""
    return Envelope(
        id=row.id,
        queue=row.queue,
        key=row.key,
        payload=payload,
        scheduled_at=due_at,
        scheduled_at_initially=row.scheduled_at_initially,
        created_at=row.created_at,
        delivery=Delivery.FIRST if prev_token is None else Delivery.REDELIVERY,
        attempt=row.attempts + 1,
        lock_token=row.lock_token,
        lease_until=row.scheduled_at,
    )


class DelayedQueue(AdminMixin, Generic[T]):
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
    """

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
    ) -> None:
        self.name = check_name(name, "queue name", QUEUE_MAX)
        self.model = model
        self.table: Table = cast(Table, model.__table__)  # type: ignore[attr-defined]
        self.serializer: Serializer[T] = serializer or cast(Serializer[T], JsonSerializer())
        if not isinstance(self.serializer, Serializer):
            raise InvalidArgument("serializer must have type_name, storage, encode and decode")
        self.lease = require_duration(lease, "lease")
        self.retry_policy: RetryPolicy = retry or ExponentialBackoff()
        self.retention = None if retention is None else require_duration(retention, "retention")
        self.clock = clock
        self.notify = notify
        self._statements: dict[tuple[type[Strategy], str], Any] = {}
        self._settles: dict[st.SettleName, Any] = {}
        #: JsonSerializer's own dumps: the batch path's per-message serialization, looked up once.
        self._dumps: Callable[[Any], str] | None = (
            self.serializer.dumps if isinstance(self.serializer, JsonSerializer) else None
        )

    def __repr__(self) -> str:
        return f"DelayedQueue({self.name!r}, table={self.table.name!r})"

    # -- helpers -------------------------------------------------------------------------

    def now(self) -> datetime:
        return require_aware(self.clock(), "clock()")

    def _key(self, key: str | None) -> str:
        return uuid.uuid4().hex if key is None else check_name(key, "key", KEY_MAX)

    def _encode(self, payload: T) -> dict[str, Any]:
        """The payload columns of a row holding ``payload`` (JSON normalised by a round trip)."""
        return self._stored(self._serialize(payload))

    def _serialize(self, payload: T) -> str | bytes:
        """``payload`` as it is stored: JSON text, or bytes; validated before any SQL runs."""
        if self._dumps is not None:
            return self._dumps(payload)
        if self.serializer.storage != "json":
            encoded: bytes = self.serializer.encode(payload)
            return encoded
        try:
            return json.dumps(self.serializer.encode(payload), allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise EncodeError(f"payload is not JSON-serializable: {exc}") from exc

    def _stored(self, stored: str | bytes) -> dict[str, Any]:
        """The payload columns for what :meth:`_serialize` returned."""
        json_storage = self.serializer.storage == "json"
        return {
            "payload_type": self.serializer.type_name,
            "payload": json.loads(stored) if json_storage else None,
            "payload_bytes": None if json_storage else stored,
        }

    def _decode(self, row: Any) -> T:
        if row.payload_type != self.serializer.type_name:
            raise DecodeError(
                f"payload type {row.payload_type!r} does not match this queue's "
                f"serializer {self.serializer.type_name!r}"
            )
        stored = row.payload if self.serializer.storage == "json" else row.payload_bytes
        if stored is None:
            raise DecodeError(f"no payload in the {self.serializer.storage} column")
        try:
            return self.serializer.decode(stored)
        except DecodeError:
            raise
        except Exception as exc:
            raise DecodeError(f"{type(exc).__name__}: {exc}") from exc

    @staticmethod
    def _same_payload(row: Any, values: dict[str, Any]) -> bool:
        return bool(
            row.payload_type == values["payload_type"]
            and row.payload == values["payload"]
            and row.payload_bytes == values["payload_bytes"]
        )

    def _changes(
        self,
        row: Any,
        values: dict[str, Any],
        at: datetime | None,
        now: datetime,
        mode: OfferMode,
    ) -> dict[str, Any] | None:
        """The update an offer makes to an existing row, or None when it is ``IGNORED``.

        ``at`` is None when the caller gave no time ("as soon as possible"): then an identical
        payload is ``IGNORED`` whatever the stored schedule, since the message is already there.
        """
        same_payload = self._same_payload(row, values)
        fresh = {"lock_token": None, "status": "pending", "attempts": 0, "last_error": None}
        if mode is OfferMode.REPLACE:
            if same_payload and (at is None or row.scheduled_at_initially == at):
                return None
            at = now if at is None else at
            return {**values, **fresh, "scheduled_at": at, "scheduled_at_initially": at}
        if mode is OfferMode.KEEP_SCHEDULE:
            if same_payload:
                return None
            if row.status != "pending":
                scheduled_at = at or now  # done or dead: it has no schedule left to keep
            elif row.lock_token is not None:
                scheduled_at = now  # in flight: the new payload is due as soon as possible
            else:
                scheduled_at = row.scheduled_at
            return {**values, **fresh, "scheduled_at": scheduled_at}
        return None

    def _new_row(
        self, key: str, values: dict[str, Any], at: datetime, now: datetime
    ) -> dict[str, Any]:
        return {
            "queue": self.name,
            "key": key,
            **values,
            "status": "pending",
            "scheduled_at": at,
            "scheduled_at_initially": at,
            "created_at": now,
            "attempts": 0,
        }

    def _wake(self, session: Session, strategy: Strategy) -> None:
        if self.notify:
            announce(session, self.table.name, self.name, strategy.has_notify)

    # -- offer ---------------------------------------------------------------------------

    def offer(
        self,
        session: Session,
        key: str | None,
        payload: T,
        at: datetime | None = None,
        *,
        mode: OfferMode | str = OfferMode.REPLACE,
    ) -> OfferResult:
        """Enqueue ``payload`` under ``key`` (generated when None), due at ``at`` (now).

        Returns the key and ``CREATED``, ``UPDATED`` or ``IGNORED`` (see :class:`OfferMode`).
        An update resets the lease, so a consumer still holding the old version cannot ack it.
        """
        mode = OfferMode.parse(mode)
        key = self._key(key)
        now = self.now()
        when = None if at is None else require_aware(at, "at")
        values = self._encode(payload)
        strategy = strategy_for(session)
        outcome = self._offer_one(session, strategy, key, values, when, now, mode)
        if outcome is not Outcome.IGNORED:
            self._wake(session, strategy)
        return OfferResult(key, outcome)

    def _statement(self, strategy: Strategy, name: str) -> Any:
        """Statements built once per queue and backend; executions only bind new values."""
        key = (type(strategy), name)
        stmt = self._statements.get(key)
        if stmt is None:
            t = self.table
            if name == "insert":
                stmt = strategy.insert_ignore(t)
                if strategy.insert_returning:
                    stmt = stmt.returning(t.c.id)
            else:  # insert and NOTIFY in one round trip; notifies only when a row was inserted
                values = {c: bindparam(c, type_=t.c[c].type) for c in INSERT_COLUMNS}
                ins = strategy.insert_ignore(t).values(values).returning(t.c.id).cte("ins")
                channel = literal(channel_for(t.name))
                stmt = select(ins.c.id, func.pg_notify(channel, literal(self.name)))
            self._statements[key] = stmt
        return stmt

    def _settle(
        self, session: Session, name: st.SettleName, envelope_id: int, token: str, **params: Any
    ) -> bool:
        """Run a settle statement (see :func:`_statements.settle`); True when it matched."""
        stmt = self._settles.get(name)
        if stmt is None:
            stmt = self._settles[name] = st.settle(self.table, name)
        params["s_id"] = envelope_id
        params["s_token"] = token
        return st.affected(session, stmt, params) == 1

    def _insert_one(self, session: Session, strategy: Strategy, row: dict[str, Any]) -> bool:
        if (
            self.notify
            and strategy.has_notify
            and notify_pending(session, self.table.name, self.name)
        ):
            inserted = session.execute(self._statement(strategy, "insert+notify"), row).first()
            if inserted is not None:
                announce(session, self.table.name, self.name, True, sent=True)
            return inserted is not None
        stmt = self._statement(strategy, "insert")
        if strategy.insert_returning:
            return session.execute(stmt, row).first() is not None
        return st.affected(session, stmt, row) == 1

    def _offer_one(
        self,
        session: Session,
        strategy: Strategy,
        key: str,
        values: dict[str, Any],
        at: datetime | None,
        now: datetime,
        mode: OfferMode,
    ) -> Outcome:
        t = self.table
        for _ in range(CAS_ROUNDS):
            if self._insert_one(session, strategy, self._new_row(key, values, at or now, now)):
                return Outcome.CREATED
            if mode is OfferMode.SKIP:
                return Outcome.IGNORED
            row = session.execute(st.select_by_key(t, self.name, key, strategy.offer_lock)).first()
            if row is None:
                continue  # acknowledged and deleted in between: insert again
            changes = self._changes(row, values, at, now, mode)
            if changes is None:
                return Outcome.IGNORED
            stmt = st.guarded_update(t, row.id, row.scheduled_at, row.lock_token).values(changes)
            if st.affected(session, stmt) == 1:
                return Outcome.UPDATED
        raise ConcurrentUpdate(
            f"offer of key {key!r} lost {CAS_ROUNDS} races in a row; retry the transaction"
        )

    def offer_batch(
        self,
        session: Session,
        messages: Iterable[OfferInput],
        *,
        mode: OfferMode | str = OfferMode.REPLACE,
    ) -> list[OfferResult]:
        """Offer many messages: one outcome per message, in input order.

        All input is validated and encoded before any SQL runs. Messages are written in chunks
        under the backend's parameter limit, with a constant number of statements per chunk. A
        key repeated in the batch behaves as repeated offers in input order; a key inserted by a
        concurrent transaction falls back to the single-message path for that key only.
        """
        from ._batch import offer_batch

        return offer_batch(self, session, messages, OfferMode.parse(mode))

    # -- poll ----------------------------------------------------------------------------

    def try_poll(self, session: Session, *, lease: timedelta | None = None) -> Envelope[T] | None:
        """Take the first due message (by ``scheduled_at``, then id), or None."""
        taken = self.try_poll_many(session, 1, lease=lease)
        return taken[0] if taken else None

    def try_poll_many(
        self, session: Session, n: int, *, lease: timedelta | None = None
    ) -> list[Envelope[T]]:
        """Take up to ``n`` due messages in schedule order, each with its own lock token.

        Rows whose payload cannot be decoded become dead with the decode error and are skipped,
        so a poison message never blocks the head of the queue.
        """
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise InvalidArgument(f"n must be a positive integer, got {n!r}")
        lease = self.lease if lease is None else require_duration(lease, "lease")
        strategy = strategy_for(session)
        envelopes: list[Envelope[T]] = []
        while len(envelopes) < n:
            now = self.now()
            prefix = secrets.token_hex(12) + "."
            claimed = strategy.claim(
                session, self.table, self.name, now, now + lease, n - len(envelopes), prefix
            )
            if not claimed:
                break
            poisoned = 0
            for c in claimed:
                envelope = self._envelope(session, c, now)
                if envelope is None:
                    poisoned += 1
                else:
                    envelopes.append(envelope)
            if not poisoned:
                break
        return envelopes

    def _envelope(self, session: Session, claimed: Claimed, now: datetime) -> Envelope[T] | None:
        row = claimed.row
        if claimed.prev_token is not None and row.attempts >= self.retry_policy.max_attempts:
            error = (
                f"lease ran out without an ack on {row.attempts} attempts (the consumer crashed, "
                "hung or outlived its lease); dead after max_attempts"
            )
            self._bury(session, row.id, row.lock_token, row.attempts, error, now)
            return None
        try:
            payload = self._decode(row)
        except DecodeError as exc:
            self._bury(session, row.id, row.lock_token, row.attempts + 1, error_text(exc), now)
            return None
        return _envelope(row, payload, claimed.prev_scheduled_at, claimed.prev_token)

    def consume(self, session: Session, n: int = 1) -> list[Envelope[T]]:
        """Take up to ``n`` due messages for processing inside the caller's transaction.

        The transactional mode of seed 002: the messages are deleted (marked done, with
        retention) in the caller's transaction, so they are gone when it commits together with
        the handler's writes, and due again at once when it rolls back. No ack is needed; the
        envelopes carry an empty lock token. After a rollback, record the failed attempt with
        :meth:`record_failure` in a new transaction.
        """
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise InvalidArgument(f"n must be a positive integer, got {n!r}")
        if self.retention is not None:
            envelopes = self.try_poll_many(session, n)
            self.ack_many(session, envelopes)
            return [replace(e, lock_token="") for e in envelopes]
        return [envelope for envelope, _ in self._consume_rows(session, n)]

    def _consume_rows(self, session: Session, n: int) -> list[tuple[Envelope[T], Any]]:
        strategy = strategy_for(session)
        taken: list[tuple[Envelope[T], Any]] = []
        while len(taken) < n:
            now = self.now()
            rows = strategy.consume(session, self.table, self.name, now, n - len(taken))
            if not rows:
                break
            poisoned = 0
            for row in rows:
                envelope = self._consumed(session, row, now)
                if envelope is None:
                    poisoned += 1
                else:
                    taken.append((envelope, row))
            if not poisoned:
                break  # a short take means the queue has nothing more due
        return taken

    def _put_back_failed(
        self, session: Session, envelope: Envelope[Any], row: Any, error: BaseException | str
    ) -> NackOutcome:
        """Re-create a consumed row with its failed attempt recorded (same transaction)."""
        now = self.now()
        attempts = envelope.attempt
        values = {c: getattr(row, c) for c in st.TAKE_COLUMNS}
        values |= {"attempts": attempts, "last_error": error_text(error), "last_attempt_at": now}
        values |= {"lock_token": None, "status": "pending"}
        dead = attempts >= self.retry_policy.max_attempts
        if dead:
            values |= {"status": "dead", "scheduled_at": None}
        else:
            values["scheduled_at"] = now + self.retry_policy.delay(attempts)
        session.execute(self.table.insert().values(values))
        return NackOutcome.DEAD if dead else NackOutcome.RETRY_SCHEDULED

    def process_one(
        self, session: Session, handler: Callable[[Envelope[T], Session], Any]
    ) -> tuple[Envelope[T], BaseException | None, NackOutcome | None] | None:
        """Transactional mode for one message, inside the caller's transaction.

        Consume the first due message, run ``handler(envelope, session)`` inside a savepoint,
        and return ``(envelope, None, None)``: the removal commits with the handler's writes.
        When the handler raises, its writes are rolled back to the savepoint and the failed
        attempt is recorded in the same transaction, so the message is never due again before
        its retry time: ``(envelope, error, outcome)``. Transient database errors are re-raised
        (roll back and retry: nothing is lost, no attempt is counted). None when nothing is due.
        """
        taken = self._consume_rows(session, 1)
        if not taken:
            return None
        envelope, row = taken[0]
        try:
            with session.begin_nested():
                handler(envelope, session)
        except Exception as exc:
            if is_transient(exc):
                raise
            return envelope, exc, self._put_back_failed(session, envelope, row, exc)
        return envelope, None, None

    def _consumed(self, session: Session, row: Any, now: datetime) -> Envelope[T] | None:
        """The envelope of a consumed row; an undecodable row is put back as dead instead."""
        try:
            payload = self._decode(row)
        except DecodeError as exc:
            dead = {c: getattr(row, c) for c in st.TAKE_COLUMNS}
            dead |= {"status": "dead", "scheduled_at": None, "lock_token": None}
            dead |= {"attempts": row.attempts + 1, "last_error": error_text(exc)}
            dead["last_attempt_at"] = now
            session.execute(self.table.insert().values(dead))
            return None
        # Consumed: no lease and no token; the row's own due time and token are the "before".
        return replace(
            _envelope(row, payload, row.scheduled_at, row.lock_token),
            lock_token="",
            lease_until=now,
        )

    def record_failure(
        self,
        session: Session,
        envelope: Envelope[Any],
        error: BaseException | str,
        at: datetime | None = None,
    ) -> NackOutcome:
        """Record a failed attempt of a consumed message whose transaction rolled back.

        Guarded by the row as it was before the take: if another consumer has taken the message
        since the rollback, its own attempt counts instead and nothing changes (``STALE``).
        """
        t = self.table
        now = self.now()
        attempts = envelope.attempt
        # Any take since the rollback moved scheduled_at (a lease) or removed the row.
        guard = [
            t.c.id == envelope.id,
            t.c.status == "pending",
            t.c.scheduled_at == envelope.scheduled_at,
        ]
        values: dict[str, Any] = {
            "attempts": attempts,
            "last_error": error_text(error),
            "last_attempt_at": now,
            "lock_token": None,
        }
        dead = attempts >= self.retry_policy.max_attempts
        if dead:
            values |= {"status": "dead", "scheduled_at": None}
        else:
            values["scheduled_at"] = (
                require_aware(at, "at")
                if at is not None
                else now + self.retry_policy.delay(attempts)
            )
        updated = st.affected(session, update(t).where(*guard).values(values)) == 1
        if not updated:
            return NackOutcome.STALE
        return NackOutcome.DEAD if dead else NackOutcome.RETRY_SCHEDULED

    def _bury(
        self, session: Session, row_id: int, token: str, attempts: int, error: str, now: datetime
    ) -> bool:
        return self._settle(
            session, "bury", row_id, token, s_attempts=attempts, s_error=error, s_now=now
        )

    # -- settle --------------------------------------------------------------------------

    def ack(self, session: Session, envelope: Envelope[Any]) -> bool:
        """Acknowledge a taken message: delete it (or mark it done, with retention).

        Guarded by the lock token: if the lease ran out and another consumer took the message,
        or an offer updated it, nothing happens and False is returned. A second ack is harmless.
        """
        if self.retention is None:
            return self._settle(session, "ack", envelope.id, envelope.lock_token)
        return self._settle(session, "done", envelope.id, envelope.lock_token, s_now=self.now())

    def ack_many(self, session: Session, envelopes: Sequence[Envelope[Any]]) -> int:
        """Acknowledge a batch in one statement; returns how many still held their lease."""
        if not envelopes:
            return 0
        from ._batch import ack_many

        return ack_many(self, session, envelopes)

    def nack(
        self,
        session: Session,
        envelope: Envelope[Any],
        error: BaseException | str,
        at: datetime | None = None,
    ) -> NackOutcome:
        """Record a failed attempt: store the error, then retry later or bury the message.

        The retry time is ``at`` when given, else the retry policy's delay. After
        ``max_attempts`` failed attempts the message is dead: never polled again, kept with
        its last error until requeued or dropped.
        """
        now = self.now()
        when = None if at is None else require_aware(at, "at")
        attempts = envelope.attempt
        text = error_text(error)
        if attempts >= self.retry_policy.max_attempts:
            buried = self._bury(session, envelope.id, envelope.lock_token, attempts, text, now)
            return NackOutcome.DEAD if buried else NackOutcome.STALE
        when = (
            require_aware(at, "at") if at is not None else now + self.retry_policy.delay(attempts)
        )
        updated = self._settle(
            session,
            "nack",
            envelope.id,
            envelope.lock_token,
            s_at=when,
            s_attempts=attempts,
            s_error=text,
            s_now=now,
        )
        return NackOutcome.RETRY_SCHEDULED if updated else NackOutcome.STALE

    retry = nack

    def release(self, session: Session, envelope: Envelope[Any]) -> bool:
        """Give a taken message back, due now, without counting an attempt."""
        return self._settle(session, "release", envelope.id, envelope.lock_token, s_at=self.now())

    def extend(
        self, session: Session, envelope: Envelope[T], lease: timedelta | None = None
    ) -> Envelope[T] | None:
        """Lengthen a lease to ``now + lease``; None when the lease was already lost."""
        lease = self.lease if lease is None else require_duration(lease, "lease")
        until = self.now() + lease
        if not self._settle(session, "extend", envelope.id, envelope.lock_token, s_at=until):
            return None
        return replace(envelope, lease_until=until)
