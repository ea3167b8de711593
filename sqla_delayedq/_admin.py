"""The read side and the admin side of a queue: inspect, search, drop, reschedule, requeue.

All of them are set-based statements on the caller's Session (one statement per call), with
filters built from :class:`~sqla_delayedq.MessageFilter` as bound parameters.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from sqlalchemy import Delete, Update, and_, case, delete, func, or_, select, update
from sqlalchemy.orm import Session
from sqlalchemy.sql import ColumnElement

from . import _filters as flt
from . import _statements as st
from ._cli_stats import queue_stats
from ._codec import Codec, check_strings, check_text, decode_headers
from ._dialects import transient_as_ours
from ._rules import check_priority
from ._time import LONGEST, require_aware, require_duration
from ._types import MessageFilter, MessageInfo, QueueCounts, State
from .errors import ConfirmationRequired, DecodeError, InvalidArgument

if TYPE_CHECKING:
    from sqlalchemy import Table

    from ._time import Clock


class AdminMixin:
    """Read and admin operations of :class:`~sqla_delayedq.DelayedQueue`."""

    name: str
    table: Table
    retention: timedelta | None
    clock: Clock

    codec: Codec[Any]

    if TYPE_CHECKING:

        def now(self) -> datetime: ...

    # -- read side -----------------------------------------------------------------------

    def condition(self, f: MessageFilter | None, now: datetime) -> ColumnElement[bool]:
        """The SQL condition of a filter on this queue at ``now`` (validated, all bound)."""
        f = f or MessageFilter()
        if not isinstance(f, MessageFilter):
            raise InvalidArgument(f"filter must be a MessageFilter, got {type(f).__name__}")
        if f.key_prefix is not None:
            if not isinstance(f.key_prefix, str):
                raise InvalidArgument(
                    f"key_prefix must be a str, got {type(f.key_prefix).__name__}"
                )
            check_text(f.key_prefix, "key_prefix")
        if not isinstance(f.payload, Mapping):
            raise InvalidArgument(
                f"payload filter must be a mapping of field to value, got "
                f"{type(f.payload).__name__}"
            )
        for name, value in f.payload.items():
            if not isinstance(name, str) or not name:
                raise InvalidArgument("payload filter field names must be non-empty strings")
            check_text(name, f"payload filter field {name!r}")
            if '"' in name or "\\" in name:
                raise InvalidArgument(
                    f"payload filter field {name!r}: a name with a quote or backslash cannot be "
                    "addressed portably; use MessageFilter(where=...)"
                )
            if not isinstance(value, (str, int, float, bool)):
                raise InvalidArgument(
                    f"payload filter {name!r}: only str, int, float and bool values are "
                    "supported; use MessageFilter(where=...) for anything else"
                )
            _check_field_value(name, value)
        return flt.filter_clause(
            self.table,
            self.name,
            now,
            state=None if f.state is None else State.parse(f.state).value,
            key_prefix=f.key_prefix,
            keys=None if f.keys is None else check_strings(f.keys, "keys"),
            payload=dict(f.payload),
            scheduled_before=None
            if f.scheduled_before is None
            else require_aware(f.scheduled_before, "scheduled_before"),
            scheduled_after=None
            if f.scheduled_after is None
            else require_aware(f.scheduled_after, "scheduled_after"),
            where=f.where,
        )

    def _info(self, row: Any, now: datetime) -> MessageInfo:
        payload, problem = None, None
        try:
            payload = self.codec.decode(row)
        except DecodeError as exc:
            problem = str(exc)
        if row.status != "pending":
            state = State(row.status)
        elif row.scheduled_at is not None and row.scheduled_at <= now:
            state = State.DUE
        elif row.lock_token is not None:
            state = State.IN_FLIGHT
        else:
            state = State.SCHEDULED
        return MessageInfo(
            id=row.id,
            queue=row.queue,
            key=row.key,
            payload_type=row.payload_type,
            payload=payload,
            status=row.status,
            state=state,
            scheduled_at=row.scheduled_at,
            scheduled_at_initially=row.scheduled_at_initially,
            created_at=row.created_at,
            attempts=row.attempts,
            last_attempt_at=row.last_attempt_at,
            last_error=row.last_error,
            lock_token=row.lock_token,
            decode_error=problem,
            headers=decode_headers(row.headers),
            group=row.group_key,
            priority=row.priority,
        )

    @transient_as_ours
    def get(self, session: Session, key: str) -> MessageInfo | None:
        """The message stored under ``key``, in any state, or None."""
        row = session.execute(st.select_by_key(self.table, self.name, _key(key))).first()
        return None if row is None else self._info(row, self.now())

    @transient_as_ours
    def contains(self, session: Session, key: str) -> bool:
        """Whether ``key`` is pending (due, scheduled or in flight) in this queue."""
        t = self.table
        stmt = select(t.c.id).where(
            t.c.queue == self.name, t.c.key == _key(key), t.c.status == "pending"
        )
        return session.execute(stmt).first() is not None

    @transient_as_ours
    def counts(self, session: Session, *, at_most: int | None = None) -> QueueCounts:
        """How many messages are due, scheduled, in flight, dead and done.

        Exact by default: that reads every row of the queue. With ``at_most``, each count reads
        at most ``at_most + 1`` rows through an index and stops; a count that stopped is a lower
        bound (``at_most`` at most), with its state in ``capped``. Dead and done share one read,
        and so do the messages in flight of every queue: they are capped together. Use it where
        counts are read often, as metrics do.
        """
        if at_most is None:
            row = session.execute(flt.count_by_state(self.table, self.name, self.now())).one()
            return QueueCounts(*(int(v) for v in row))
        (q,) = queue_stats(
            session, self.table, self.now(), [self.name], include_missing=True, at_most=at_most
        )
        return QueueCounts(q.due, q.scheduled, q.in_flight, q.dead, q.done, capped=q.capped)

    @transient_as_ours
    def oldest_due(self, session: Session) -> datetime | None:
        """The due time of the oldest due message (its lag is ``now - oldest_due``)."""
        stmt = st.oldest_due(st.message_shape(self.table), self.name, self.now())
        value: datetime | None = session.execute(stmt).scalar()
        return value

    @transient_as_ours
    def search(
        self,
        session: Session,
        where: MessageFilter | None = None,
        *,
        limit: int = 100,
        after_id: int | None = None,
    ) -> list[MessageInfo]:
        """Messages matching ``where``, by id; page with ``after_id`` (the last id seen)."""
        limit = _id_bound(limit, "limit", least=1)
        after_id = None if after_id is None else _id_bound(after_id, "after_id", least=0)
        t = self.table
        now = self.now()
        stmt = (
            select(*st.columns(t)).where(self.condition(where, now)).order_by(t.c.id).limit(limit)
        )
        if after_id is not None:
            stmt = stmt.where(t.c.id > after_id)
        return [self._info(r, now) for r in session.execute(stmt)]

    @transient_as_ours
    def count(self, session: Session, where: MessageFilter | None = None) -> int:
        """How many messages match ``where``."""
        t = self.table
        stmt = select(func.count()).select_from(t).where(self.condition(where, self.now()))
        return int(session.execute(stmt).scalar_one())

    @transient_as_ours
    def count_up_to(self, session: Session, where: MessageFilter | None = None) -> tuple[int, int]:
        """How many messages match ``where``, and the highest id among them (0 for none): what
        an operator confirms before a bulk change, which then touches no message with a higher
        id (offered since) and no more messages than that."""
        t = self.table
        stmt = select(func.count(), func.max(t.c.id)).where(self.condition(where, self.now()))
        count, highest = session.execute(stmt).one()
        return int(count), int(highest or 0)

    # -- admin side ----------------------------------------------------------------------

    @transient_as_ours
    def drop(self, session: Session, key: str) -> bool:
        """Delete the message stored under ``key``; False when there was none."""
        t = self.table
        stmt = delete(t).where(t.c.queue == self.name, t.c.key == _key(key))
        return bool(_delete(session, stmt))

    @transient_as_ours
    def drop_where(self, session: Session, where: MessageFilter) -> int:
        """Delete every message matching ``where``; returns how many."""
        if where is None or _is_empty(where):
            raise InvalidArgument(
                "drop_where needs at least one condition; use drop_all(confirm=...) to empty "
                "the queue"
            )
        stmt = delete(self.table).where(self.condition(where, self.now()))
        return _delete(session, stmt)

    @transient_as_ours
    def drop_all(self, session: Session, *, confirm: str | None = None) -> int:
        """Delete every message of the queue. ``confirm`` must repeat the queue's name."""
        if confirm != self.name:
            raise ConfirmationRequired(
                f"drop_all deletes every message of queue {self.name!r}; "
                f"pass confirm={self.name!r} to proceed"
            )
        t = self.table
        return _delete(session, delete(t).where(t.c.queue == self.name))

    @transient_as_ours
    def reschedule(
        self,
        session: Session,
        target: str | MessageFilter,
        at: datetime | None = None,
        *,
        priority: int | None = None,
    ) -> int:
        """Move pending messages (one key or a filter) to ``at``; now by default ("process now").
        With ``priority``, give them that priority too (taken first by a queue with
        ``priorities=True``).

        Messages in flight keep their lease: they are not rescheduled. A message whose lease
        ran out without an ack is left for the next take to settle when ``at`` is now or
        earlier: that take counts the lost attempt and buries the message when it used up
        ``max_attempts``, exactly as without the reschedule. Moved to a later time, its lease
        ends here and its lost attempt is counted (the take then buries a message whose
        attempts are used up): moving it never gives a message that kills its consumer its
        attempts back.
        """
        now = self.now()
        when = now if at is None else require_aware(at, "at")
        t = self.table
        token = t.c.lock_token
        if when <= now:
            # The lease that ran out stays for the take's rule (a held token's hold is over).
            values: list[tuple[Any, Any]] = [
                (t.c.scheduled_at, when),
                (token, case((st.is_held(token), None), else_=token)),
            ]
            moved = [t.c.scheduled_at == when, or_(token.is_(None), ~st.is_held(token))]
        else:
            # In order: the lost attempt is read before the token is cleared (MySQL's SET order).
            values = [
                (t.c.attempts, t.c.attempts + st.lost_attempt(token)),
                (t.c.scheduled_at, when),
                (token, None),
            ]
            moved = [t.c.scheduled_at == when, token.is_(None)]
        if priority is not None:
            if "priority" not in t.c:
                raise InvalidArgument(f"{t.name} has no priority column")
            values.append((t.c.priority, check_priority(priority)))
        if isinstance(target, str):
            target = MessageFilter(keys=(target,))
        elif not isinstance(target, MessageFilter):
            raise InvalidArgument(
                f"reschedule takes a key (str) or a MessageFilter, got {type(target).__name__}"
            )
        not_in_flight = flt.state_clause(t, "in_flight", now)
        stmt = (
            update(t)
            .where(self.condition(target, now), t.c.status == "pending", ~not_in_flight)
            .ordered_values(*values)
        )
        # Run again, the messages this statement moved are left out: they are where it put them.
        if priority is not None:
            moved.append(t.c.priority == priority)
        return _past_handlers(session, stmt, stmt.where(~and_(*moved)))

    @transient_as_ours
    def requeue_dead(
        self, session: Session, where: MessageFilter | None = None, at: datetime | None = None
    ) -> int:
        """Make dead messages pending again (attempts reset, last error kept for history)."""
        now = self.now()
        when = now if at is None else require_aware(at, "at")
        t = self.table
        stmt = (
            update(t)
            .where(self.condition(where, now), t.c.status == "dead")
            .values(status="pending", scheduled_at=when, lock_token=None, attempts=0)
        )
        return st.affected(session, stmt)

    @transient_as_ours
    def prune(self, session: Session, older_than: timedelta | None = None) -> int:
        """Delete done messages acknowledged more than ``older_than`` (the retention) ago."""
        keep = older_than if older_than is not None else self.retention
        if keep is None:
            raise InvalidArgument("prune needs older_than, or a queue created with retention")
        keep = require_duration(keep, "older_than", allow_zero=True, most=LONGEST)
        t = self.table
        stmt = delete(t).where(
            t.c.queue == self.name,
            t.c.status == "done",
            t.c.last_attempt_at < self.now() - keep,
        )
        return st.affected(session, stmt)


def _key(key: Any) -> str:
    """A key to look up: a string of storable text (else PostgreSQL fails on it)."""
    if not isinstance(key, str):
        raise InvalidArgument(f"key must be a string, got {type(key).__name__}")
    return check_text(key, "key")


#: The integers a payload filter compares exactly on every backend (SQLite binds 64 bits).
_INT_RANGE = range(-(2**63), 2**63)
#: Floats from here on stand for more than one integer.
_EXACT_FLOATS = 2.0**53


def _id_bound(value: Any, name: str, *, least: int) -> int:
    """A count or an id to page after: an int from ``least`` to the largest 64-bit id."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidArgument(f"{name} must be an int, got {type(value).__name__}")
    if not least <= value <= _INT_RANGE[-1]:
        raise InvalidArgument(f"{name} must be from {least} to {_INT_RANGE[-1]}, got {value}")
    return value


def _check_field_value(name: str, value: str | int | float | bool) -> None:
    """A payload filter value every backend can compare: storable text, a finite float, a
    64-bit integer (else PostgreSQL or SQLite fails on it, and the others match nothing)."""
    what = f"payload filter {name!r}"
    if isinstance(value, str):
        check_text(value, what)
    elif isinstance(value, float) and not math.isfinite(value):
        raise InvalidArgument(f"{what}: {value} is not a JSON number")
    elif isinstance(value, float) and abs(value) >= _EXACT_FLOATS:
        # Beyond 2**53 a double stands for many integers, and the backends disagree on which
        # stored numbers it matches.
        raise InvalidArgument(
            f"{what}: {value!r} is too large to compare exactly as a float; give an int"
        )
    elif isinstance(value, int) and not isinstance(value, bool) and value not in _INT_RANGE:
        raise InvalidArgument(
            f"{what}: {value} is outside the 64-bit integers every backend compares; "
            "use MessageFilter(where=...)"
        )


def _delete(session: Session, stmt: Delete) -> int:
    """Run a drop: the messages it matches are deleted, those whose transactional handler was
    running too (see :func:`_past_handlers`)."""
    return _past_handlers(session, stmt, stmt)


def _past_handlers(session: Session, stmt: Delete | Update, again: Delete | Update) -> int:
    """Run an admin change; returns how many messages it changed. A message whose
    transactional handler is running is changed as that handler's transaction leaves it, on
    every backend: gone if it succeeded, changed if it failed. The statement that waited for
    that transaction can miss the row it left: PostgreSQL's skips the row the take deleted and
    never sees the one the failure put back; MariaDB/MySQL's, reading through the due index,
    has passed the entry the row moved to (a queue with ``retention`` keeps it, done or dead).
    ``again`` (``stmt``, less what ``stmt`` changed already) runs after it, on every backend,
    and changes what the first one missed."""
    return st.affected(session, stmt) + st.affected(session, again)


def _is_empty(f: MessageFilter) -> bool:
    """No condition at all (compared field by field: ``where`` may be an SQL expression)."""
    return (
        f.state is None
        and not f.key_prefix
        and f.keys is None
        and not f.payload
        and f.scheduled_before is None
        and f.scheduled_after is None
        and f.where is None
    )
