"""Queue controls: pause a queue, cap how many of its messages are in flight, cap its start rate.

The controls of a queue are one row of ``delayedq_queue_controls`` (revision ``delayedq_0004``),
so every worker process and machine obeys the same switch. A queue without a row is *plain* and
takes exactly as before: consumers learn which queues are controlled from a per-process cache
(:data:`REFRESH` seconds old at most, invalidated at once in the process that changed it and,
on PostgreSQL, by ``NOTIFY`` in every process; a worker whose listener is connected and hears
those keeps it until a change, up to :data:`PUSHED_REFRESH`), so the plain path costs nothing
more.

- **Paused**: offers are accepted, nothing is taken. Messages already in flight finish.
  ``resume`` wakes idle consumers at once (through ``NOTIFY`` on PostgreSQL).
- **Max in flight**: at most N messages taken and not yet settled, across every consumer. A take
  of a limited queue locks its controls row, counts the leases still running (the lock-token
  index) and takes at most what is left, so racing consumers cannot exceed the limit.
- **Rate**: at most N takes in any window of ``period`` seconds. The controls row keeps the takes
  inside the window (time and count per take); a take under the row lock takes at most what
  the window has left, and a consumer that finds it full sleeps until it has room.

Both consumption modes obey them. A transactional take of a limited queue takes a lease under
the controls in a short transaction of its own (holding the controls row while the handler runs
would serialise the queue), then runs the handler and acknowledges by lock token in the
caller's transaction: the handler's writes and the acknowledgement still commit together, and
the lease counts in flight until then. Time is the queues' clock, like every other decision.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, NamedTuple, TypeVar

from sqlalchemy import Engine, insert, inspect, select, update
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.orm import Session

from . import _wakeup
from ._dialects import strategy_for
from ._statements import affected
from ._time import LONGEST, require_duration
from .errors import DelayedQueueError, InvalidArgument
from .models import QUEUE_MAX, controls_table

__all__ = [
    "PUSHED_REFRESH",
    "REFRESH",
    "UNSET",
    "Admission",
    "QueueControls",
    "admit",
    "change",
    "from_row",
    "invalidate",
    "keep_fresh",
    "lookup",
    "read",
    "record",
    "retry_after",
]

log = logging.getLogger("sqla_delayedq.controls")

#: How old, in seconds, a process's picture of which queues are controlled may be.
REFRESH = 1.0
#: How old the picture of a table's controls may be while a listener hears their every change
#: (:func:`pushed`, while its listener is connected): a safety net for a change made without
#: this API (by hand in SQL), which sends no ``NOTIFY``.
PUSHED_REFRESH = 30.0
#: How long a process believes the controls table is missing before it looks again.
MISSING_RECHECK = 30.0
#: How soon a consumer that found a queue at its in-flight limit tries again, at most.
LIMITED_RETRY = 0.25
#: Slack in the rate window's comparisons of epoch seconds (floats): below the microsecond
#: between two stamps, above a float's rounding of epoch seconds (about 0.24 µs).
ROUNDING = 5e-7
#: At most about this many entries in a rate window: beyond it, takes close in time share one
#: (``rate_log`` is a TEXT column, 65,535 bytes on MariaDB/MySQL: some 2,700 entries).
MAX_RATE_LOG = 500


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


#: An argument left out of :func:`change`: keep the current value.
UNSET: Any = _Unset()
T = TypeVar("T")
t = controls_table


@dataclass(frozen=True)
class QueueControls:
    """The controls of one queue (all off: a plain queue)."""

    paused: bool = False
    #: At most this many in flight across every consumer (None: no limit).
    max_in_flight: int | None = None
    #: At most ``rate_limit`` takes in any ``rate_period`` (None: no limit).
    rate_limit: int | None = None
    rate_period: timedelta | None = None

    @property
    def limited(self) -> bool:
        return self.max_in_flight is not None or self.rate_limit is not None

    @property
    def plain(self) -> bool:
        return not self.paused and not self.limited


class Admission(NamedTuple):
    """What a controlled queue lets one take have."""

    #: How many rows the take may take (0: none now).
    allowed: int
    #: When ``allowed`` is 0: seconds until the queue may have room (None: not before a change,
    #: it is paused).
    wait: float | None
    #: The rate window's takes, to which the take's count is added (None: no rate limit).
    window: list[list[float]] | None
    controls: QueueControls
    #: The time of the take: read once the row is locked, so a take that waited for the lock
    #: is counted when it happens.
    now: datetime


def from_row(row: Any) -> QueueControls:
    """The controls of a row of ``delayedq_queue_controls`` (any select of its columns)."""
    period = None if row.rate_period is None else timedelta(seconds=row.rate_period)
    return QueueControls(bool(row.paused), row.max_in_flight, row.rate_limit, period)


# -- the per-process picture ------------------------------------------------------------------

_lock = threading.Lock()
#: engine -> table -> (monotonic time read, {queue: controls} of the controlled queues, or None
#: when the table is missing).
_cache: weakref.WeakKeyDictionary[Engine, dict[str, tuple[float, dict[str, QueueControls] | None]]]
_cache = weakref.WeakKeyDictionary()
#: engine -> table -> how many listeners push every change of the table's controls to this
#: process (see :func:`pushed`).
_pushed: weakref.WeakKeyDictionary[Engine, dict[str, int]] = weakref.WeakKeyDictionary()
#: engine -> table -> how many threads of this process are reading the table's controls now.
_reading: weakref.WeakKeyDictionary[Engine, dict[str, int]] = weakref.WeakKeyDictionary()
#: Counts :func:`invalidate` calls: a read that began before one does not overwrite it.
_generation = 0


#: The shortest :data:`REFRESH` a worker can ask for: a refresh is a savepoint and a select.
MIN_REFRESH = 0.2


def keep_fresh(seconds: float) -> None:
    """Read the controls at least every ``seconds`` (not under :data:`MIN_REFRESH`) in this
    process: a worker asks for its poll interval, so a pause reaches it within one interval even
    without ``NOTIFY``."""
    global REFRESH
    with _lock:
        REFRESH = min(REFRESH, max(seconds, MIN_REFRESH))


def invalidate(table: str | None = None) -> None:
    """Forget what this process knows of ``table``'s controls (every table: None)."""
    global _generation
    with _lock:
        _generation += 1
        for tables in _cache.values():
            if table is None:
                tables.clear()
            else:
                tables.pop(table, None)


def lookup(session: Session, table: str, queue: str) -> QueueControls | None:
    """The controls of a controlled queue as this process last read them; None when plain.

    Reads every controlled queue of ``table`` at most every :data:`REFRESH` seconds, inside a
    savepoint of the session's transaction (a database without the table loses nothing).
    """
    engine = session.get_bind().engine
    fresh, controls = _peek(engine, table, queue)
    if fresh:
        return controls
    queues = _read(session, engine, table)
    return None if queues is None else queues.get(queue)


def _read(session: Session, engine: Engine, table: str) -> dict[str, QueueControls] | None:
    """Read ``table``'s controlled queues in ``session``'s transaction and keep them as this
    process's picture, unless an :func:`invalidate` came while the read ran (the picture it
    dropped may be older than the change that caused it: the next look reads again)."""
    with _lock:
        generation = _generation
        reading = _reading.setdefault(engine, {})
        reading[table] = reading.get(table, 0) + 1
    try:
        read_at = time.monotonic()
        queues = _read_table(session, table)
    finally:
        with _lock:
            reading[table] -= 1
            if not reading[table]:
                del reading[table]
    with _lock:
        if generation == _generation:
            _cache.setdefault(engine, {})[table] = (read_at, queues)
    return queues


def known(session: Session, table: str, queue: str) -> tuple[bool, QueueControls | None]:
    """:func:`lookup` without a read: ``(True, controls or None)`` while this process's picture
    of ``table`` is fresh, ``(False, None)`` when only a read would tell (for a statement that
    runs outside a transaction, where :func:`lookup`'s savepoint cannot)."""
    return _peek(session.get_bind().engine, table, queue)


def _peek(engine: Engine, table: str, queue: str) -> tuple[bool, QueueControls | None]:
    """``(True, controls or None)`` when this process's picture of ``table`` is fresh enough
    to use without reading; ``(False, None)`` when it must be read again.

    A picture just past its age while another thread of the process reads it again is still
    used (for up to :data:`REFRESH` more): the consumers of a busy worker would otherwise all
    find it stale at once and each read it, when one read serves them all a moment later.
    """
    with _lock:
        entry = _cache.get(engine, {}).get(table)
        if entry is None:
            return False, None
        read_at, queues = entry
        if queues is None:
            limit = MISSING_RECHECK
        else:
            limit = PUSHED_REFRESH if _pushed.get(engine, {}).get(table) else REFRESH
        age = time.monotonic() - read_at
        if age >= limit and not (age < limit + REFRESH and _reading.get(engine, {}).get(table)):
            return False, None
    return True, None if queues is None else queues.get(queue)


def pushed(engine: Engine, tables: list[str]) -> Callable[[bool], None]:
    """A switch for a listener of ``tables``' controls on ``engine`` (PostgreSQL's ``NOTIFY``,
    on which its worker calls :func:`invalidate`, as it does whenever the listener connects).

    The listener calls it with True once it is connected and hears every change: the picture
    is then read again only every :data:`PUSHED_REFRESH` seconds, so a worker's takes do not
    read it once a second. It calls it with False as soon as it loses its connection, and when
    it stops: a change sent meanwhile goes unheard, so the picture is kept only
    :data:`REFRESH` again and a pause reaches the worker as it would without ``NOTIFY``.
    A call that repeats the switch's state does nothing.
    """
    on = [False]

    def switch(connected: bool) -> None:
        with _lock:
            if connected == on[0]:
                return
            on[0] = connected
            counts = _pushed.setdefault(engine, {})
            for table in tables:
                counts[table] = counts.get(table, 0) + (1 if connected else -1)
                if not counts[table]:
                    del counts[table]

    return switch


def _read_table(session: Session, table: str) -> dict[str, QueueControls] | None:
    stmt = select(t.c.queue, t.c.paused, t.c.max_in_flight, t.c.rate_limit, t.c.rate_period)
    stmt = stmt.where(t.c.table_name == table)
    try:
        with session.begin_nested():
            rows = session.execute(stmt).all()
    except DBAPIError as exc:
        if not _table_missing(session, exc):
            raise  # a lost connection or a busy server: the take fails and is retried
        log.debug("no queue controls on this database (%s): queues are plain", exc.orig)
        return None
    found = {row.queue: from_row(row) for row in rows}
    return {q: c for q, c in found.items() if not c.plain}


# -- reading and changing ---------------------------------------------------------------------


MISSING = (
    "queue controls need the table delayedq_queue_controls (revision delayedq_0004): run "
    "`delayedq db upgrade` (or `alembic upgrade heads` with sqla_delayedq's revisions)"
)


def _guarded(session: Session, run: Callable[[], T]) -> T:
    """``run()`` in a savepoint; a missing controls table is a clear error that leaves the
    session's transaction usable."""
    try:
        with session.begin_nested():
            return run()
    except DBAPIError as exc:
        if _table_missing(session, exc):
            raise DelayedQueueError(MISSING) from exc
        raise


def _table_missing(session: Session, exc: DBAPIError) -> bool:
    """Whether ``exc`` (rolled back to a savepoint) was the controls table missing; never for
    a dropped connection or a transient refusal, which the caller must see as they are."""
    if exc.connection_invalidated or strategy_for(session).is_transient(exc):
        return False
    return not inspect(session.connection()).has_table(t.name)


def read(session: Session, table: str, queue: str) -> QueueControls:
    """The controls of ``queue`` as the database holds them now."""
    stmt = select(t.c.paused, t.c.max_in_flight, t.c.rate_limit, t.c.rate_period).where(
        t.c.table_name == table, t.c.queue == queue
    )
    row = _guarded(session, lambda: session.execute(stmt).first())
    return QueueControls() if row is None else from_row(row)


def _check_limit(value: Any, what: str) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidArgument(f"{what} must be a positive integer or None, got {value!r}")
    return value


def _check_rate(rate: Any) -> tuple[int | None, float | None]:
    if rate is None:
        return None, None
    if not isinstance(rate, tuple) or len(rate) != 2:
        raise InvalidArgument(f"rate must be (count, period) or None, got {rate!r}")
    count = _check_limit(rate[0], "the rate's count")
    period = rate[1]
    if not isinstance(period, timedelta):
        if (
            not isinstance(period, (int, float))
            or isinstance(period, bool)
            or not math.isfinite(period)
            or period <= 0
        ):
            raise InvalidArgument(f"the rate's period must be a positive duration, got {period!r}")
        # Seconds past what a timedelta holds are too long all the same (refused below).
        period = timedelta.max if period >= _LONGEST else timedelta(seconds=period)
    return count, require_duration(period, "the rate's period", most=LONGEST).total_seconds()


#: ``timedelta.max`` in seconds.
_LONGEST = timedelta.max.total_seconds()


def change(
    session: Session,
    table: str,
    queue: str,
    now: datetime,
    *,
    paused: bool | None = None,
    max_in_flight: int | None = UNSET,
    rate: tuple[int, timedelta | float] | None = UNSET,
) -> QueueControls:
    """Set some controls of ``queue`` in the session's transaction (the rest stay); the result.

    Consumers of every process see the change within :data:`REFRESH` seconds (at once in this
    process after the commit, and on PostgreSQL through ``NOTIFY``).
    """
    if not isinstance(queue, str) or not queue or len(queue) > QUEUE_MAX:
        raise InvalidArgument(f"queue must be a name of 1 to {QUEUE_MAX} characters")
    values: dict[str, Any] = {"updated_at": now}
    if paused is not None:
        values["paused"] = bool(paused)
    if max_in_flight is not UNSET:
        values["max_in_flight"] = _check_limit(max_in_flight, "max_in_flight")
    if rate is not UNSET:
        values["rate_limit"], values["rate_period"] = _check_rate(rate)
        if rate is None:
            # Only a rate removed forgets its takes: a rate set again (the same, by a deploy
            # run twice, or another) still counts those of its new period, or the takes of one
            # period went past its limit.
            values["rate_log"] = None
    where = (t.c.table_name == table, t.c.queue == queue)
    if not _guarded(session, lambda: affected(session, update(t).where(*where).values(values))):
        try:
            with session.begin_nested():
                row = {"table_name": table, "queue": queue, "paused": False, **values}
                session.execute(insert(t).values(row))
        except IntegrityError:  # another transaction inserted it first: now it is there
            session.execute(update(t).where(*where).values(values))
    strategy = strategy_for(session)
    _wakeup.announce(session, strategy, table, queue, control=True)
    return read(session, table, queue)


# -- a take of a controlled queue -------------------------------------------------------------


def admit(
    session: Session,
    table: str,
    queue: str,
    clock: Callable[[], datetime],
    wanted: int,
    in_flight: Callable[[datetime], int],
) -> Admission:
    """Lock ``queue``'s controls row for the session's transaction and say how many rows a
    take may have now. The caller takes at most that many, then calls :func:`record`."""
    stmt = (
        select(t.c.paused, t.c.max_in_flight, t.c.rate_limit, t.c.rate_period, t.c.rate_log)
        .where(t.c.table_name == table, t.c.queue == queue)
        .with_for_update()
    )
    row = session.execute(stmt).first()
    now = clock()
    if row is None:
        return Admission(wanted, None, None, QueueControls(), now)
    controls = from_row(row)
    if controls.paused:
        return Admission(0, None, None, controls, now)
    allowed, wait = wanted, None
    window: list[list[float]] | None = None
    if controls.rate_limit is not None and row.rate_period is not None:
        stamp = now.timestamp()
        # A take exactly one period ago still counts: no closed window holds more than the limit.
        # Half a microsecond of slack: floats hold neither the stamps nor a period of 0.1 s
        # exactly, and ``stamp - period`` could round past a take made one period ago.
        since = stamp - row.rate_period - ROUNDING
        window = [e for e in json.loads(row.rate_log or "[]") if e[0] >= since]
        room = controls.rate_limit - sum(int(e[1]) for e in window)
        if room <= 0:
            wait = max(0.0, min(e[0] for e in window) + row.rate_period - stamp) + 0.001
        allowed = min(allowed, max(room, 0))
    if controls.max_in_flight is not None and allowed > 0:
        room = controls.max_in_flight - in_flight(now)
        if room <= 0:
            wait = LIMITED_RETRY
        allowed = min(allowed, max(room, 0))
    return Admission(allowed, wait, window, controls, now)


def record(session: Session, table: str, queue: str, admission: Admission, taken: int) -> None:
    """Add a take of ``taken`` rows to the queue's rate window (under :func:`admit`'s lock)."""
    if admission.window is None or taken == 0:
        return
    window = [*admission.window, [admission.now.timestamp(), taken]]
    period = admission.controls.rate_period
    if len(window) > MAX_RATE_LOG and period is not None:
        window = _compact(window, period.total_seconds() / MAX_RATE_LOG)
    session.execute(
        update(t)
        .where(t.c.table_name == table, t.c.queue == queue)
        .values(rate_log=json.dumps(window))
    )


def _compact(window: list[list[float]], width: float) -> list[list[float]]:
    """Merge the takes of each ``width`` seconds into one entry stamped with the latest of
    them: each take then stays in the window at least as long as it should, so no window ever
    counts fewer takes than it had (a merged bucket may hold a take back a little longer)."""
    buckets: dict[int, list[float]] = {}
    for stamp, count in window:
        b = buckets.setdefault(math.floor(stamp / width), [stamp, 0])
        b[0], b[1] = max(b[0], stamp), b[1] + int(count)
    return sorted(buckets.values())


def retry_after(admission: Admission, taken: int) -> float:
    """After a take that used all ``admission`` allowed while more was due: seconds until the
    queue may have room again."""
    c, now = admission.controls, admission.now
    if admission.window is not None and c.rate_limit is not None and c.rate_period is not None:
        used = sum(int(e[1]) for e in admission.window) + taken
        if used >= c.rate_limit:
            oldest = min([e[0] for e in admission.window] + [now.timestamp()])
            return max(0.0, oldest + c.rate_period.total_seconds() - now.timestamp()) + 0.001
    return LIMITED_RETRY


_wakeup.on_control(invalidate)
