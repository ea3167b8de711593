"""Queue statistics that stay fast on a big table: the queries behind ``delayedq stats``.

No click here: :mod:`sqla_delayedq.metrics` uses the same queries for its depth and lag
collectors.

Exact per-state counts need ``status`` and ``lock_token``, which no index holds together with
``queue``; counting them row by row reads the whole heap, payloads included. Instead the counts
come from one statement in three parts, each served by an index that exists for polling anyway:

1. per queue, rows due (``scheduled_at <= now``), rows due later, and the oldest schedule: only
   columns of ``ix_<table>_due`` (queue, scheduled_at, id), so the planner can read that index
   alone (index-only), a fraction of the heap's size, when the heap is the bigger read;
2. rows in flight (a lock token, and a lease that has not run out), through
   ``ix_<table>_lock_token``, which holds only the few taken rows; "scheduled" is (1)'s "later"
   minus these;
3. rows with no schedule (dead, or done under retention) by status: one range of the ``due``
   index per queue, reading the heap only for those rows (an index-only scan with the partial
   index proposed in ``docs/operators.md``).

Being one statement, the three parts see one snapshot. The queue names come from a loose index
scan (a recursive CTE that jumps from one queue to the next in the ``due`` index), so finding ten
queues reads ten index entries, not a million. Due, scheduled and in-flight counts are read from
``scheduled_at`` and ``lock_token`` alone, as the library keeps them: ``scheduled_at`` is NULL for
every message that is not pending.

Exact counts cost as much as the backlog is long. **Bounded** counts (``at_most=N``,
:func:`bounded_stats_stmt`) read, per queue, at most the first N+1 matching rows of each range of
``ix_<table>_due``: the due rows (index-only, as the take reads them; the first of them is the
oldest due schedule, the lag), the scheduled rows after ``now`` (the heap says which are in
flight), and the rows without a schedule, which dead and done share: that range is read once for
both (N+1 rows), so when their sum passes N both are lower bounds. A count that stopped is
reported as N, with its state in ``capped``. Messages in flight come from one read of at most
N+1 leases of ``ix_<table>_lock_token`` (its entries with a token), for every queue of the table
at once: there are as many as the consumers hold, whatever the backlog; with more than N, every
queue's count in flight is a lower bound.

Each range is read in its index's order, so the plan is a range scan that stops at the LIMIT
when PostgreSQL expects the range to be much longer than N; when it expects a range about as
long as N or shorter (statistics older than the range included), it may read the range whole
with a bitmap scan instead, which costs what the exact count of that range does. One statement
per hundred queues; one per queue on PostgreSQL, whose JIT would compile several queues' reads
for longer than they take (see ``PostgreSQLStrategy.queues_per_bounded_stats``).

What a bound does not bound: index entries of rows deleted or updated since the oldest running
transaction began (a pinned vacuum horizon) are in their range until vacuum removes them, and
any read of that range walks them, bounded or exact, before it finds the live rows it counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    String,
    Table,
    and_,
    case,
    cast,
    func,
    literal,
    literal_column,
    null,
    select,
    true,
    union_all,
)
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.orm import Session
from sqlalchemy.sql import ColumnElement, Select
from sqlalchemy.sql.visitors import InternalTraversal

from . import _filters as flt
from . import _statements as st
from ._dialects import strategy_class
from .errors import InvalidArgument

__all__ = [
    "STATES",
    "QueueStats",
    "bounded_stats_stmt",
    "list_queues",
    "queue_stats",
    "queues_stmt",
    "stats_stmt",
]

#: The states counted, in the order of :class:`QueueStats`' fields.
STATES = ("due", "scheduled", "in_flight", "dead", "done")


@dataclass(frozen=True)
class QueueStats:
    """Counts of one queue by state, and how late its oldest due message is."""

    queue: str
    due: int
    scheduled: int
    in_flight: int
    dead: int
    done: int
    #: The schedule of the oldest due message, or None when nothing is due.
    oldest_due: datetime | None
    #: ``now - oldest_due`` in seconds; 0.0 when nothing is due.
    lag_seconds: float
    #: The states whose count stopped at the read's ``at_most``: there are at least that many.
    capped: frozenset[str] = field(default=frozenset(), kw_only=True)

    @property
    def pending(self) -> int:
        return self.due + self.scheduled + self.in_flight

    @property
    def exact(self) -> bool:
        """Whether every count is exact (none was capped)."""
        return not self.capped

    def as_dict(self) -> dict[str, Any]:
        return {
            "queue": self.queue,
            "due": self.due,
            "scheduled": self.scheduled,
            "in_flight": self.in_flight,
            "dead": self.dead,
            "done": self.done,
            "pending": self.pending,
            "oldest_due": None if self.oldest_due is None else self.oldest_due.isoformat(),
            "lag_seconds": self.lag_seconds,
            "capped": [state for state in STATES if state in self.capped],
        }


def queues_stmt(t: Table) -> Select[Any]:
    """Every queue name in the table, by a loose index scan of the ``due`` index."""
    first = select(func.min(t.c.queue).label("name"))
    walk = first.cte("queue_names", recursive=True)
    following = select(func.min(t.c.queue)).where(t.c.queue > walk.c.name).scalar_subquery()
    walk = walk.union_all(select(following).where(walk.c.name.is_not(None)))
    return select(walk.c.name).where(walk.c.name.is_not(None)).order_by(walk.c.name)


def list_queues(session: Session, t: Table) -> list[str]:
    """The names of the queues that have at least one message in ``t``."""
    return [str(name) for name in session.scalars(queues_stmt(t))]


def stats_stmt(
    t: Table, queues: Sequence[str], now: datetime, *, every: bool = False
) -> Select[Any]:
    """The three-part statement described in the module docstring, for the given queues.

    Rows: ``(part, queue, status, a, b, oldest)``; part 1 gives due and later counts and the
    oldest schedule, part 2 the in-flight count in ``a``, part 3 one count per status of
    unscheduled rows in ``a``. With ``every`` (``queues`` is then every queue of the table),
    parts 1 and 2 read their index whole instead of one range per queue.
    """
    names = list(queues)
    sched = t.c.scheduled_at

    def flag(cond: Any) -> Any:
        return case((cond, 1), else_=0)

    def of_queues(stmt: Select[Any]) -> Select[Any]:
        return stmt if every else stmt.where(t.c.queue.in_(names))

    by_schedule = select(
        literal_column("1").label("part"),
        t.c.queue.label("queue"),
        null().label("status"),
        func.sum(flag(sched <= now)).label("a"),
        func.sum(flag(sched > now)).label("b"),
        func.min(sched).label("oldest"),
    ).group_by(t.c.queue)
    by_schedule = of_queues(by_schedule)
    in_flight = (
        select(
            literal_column("2"),
            t.c.queue,
            null(),
            func.count(),
            literal_column("0"),
            null(),
        )
        .where(t.c.lock_token.is_not(None), sched > now)
        .group_by(t.c.queue)
    )
    in_flight = of_queues(in_flight)
    unscheduled = (
        select(
            literal_column("3"),
            t.c.queue,
            t.c.status,
            func.count(),
            literal_column("0"),
            null(),
        )
        .where(t.c.queue.in_(names), sched.is_(None))
        .group_by(t.c.queue, t.c.status)
    )
    u = union_all(by_schedule, in_flight, unscheduled).subquery("parts")
    return select(u.c.part, u.c.queue, u.c.status, u.c.a, u.c.b, u.c.oldest)


class UnscheduledOrder(ColumnElement[Any]):
    """ORDER BY for the rows without a schedule of one queue, in the due index's order.

    ``scheduled_at, id`` lets PostgreSQL read the range in index order and stop at the LIMIT
    (without it, a bitmap scan reads the whole range first); MariaDB/MySQL take ``IS NULL`` for
    no constant there and would sort the whole range, but stop early with ``id`` alone.
    """

    inherit_cache = True

    def __init__(self, t: Table) -> None:
        self.scheduled_at = t.c.scheduled_at
        self.id = t.c.id

    _traverse_internals = [
        ("scheduled_at", InternalTraversal.dp_clauseelement),
        ("id", InternalTraversal.dp_clauseelement),
    ]


@compiles(UnscheduledOrder)
def _unscheduled_order(element: UnscheduledOrder, compiler: Any, **kw: Any) -> str:
    return f"{compiler.process(element.scheduled_at, **kw)}, {compiler.process(element.id, **kw)}"


@compiles(UnscheduledOrder, "mysql")
@compiles(UnscheduledOrder, "mariadb")
def _unscheduled_order_mysql(element: UnscheduledOrder, compiler: Any, **kw: Any) -> str:
    return str(compiler.process(element.id, **kw))


def bounded_stats_stmt(
    t: Table, queues: Sequence[str], now: datetime, at_most: int, *, in_flight: bool = True
) -> Select[Any]:
    """Rows ``(queue, due, scheduled, in_flight, dead, done, oldest)``: one per queue of
    ``queues``, with ``in_flight`` NULL and the other counts each read through at most
    ``at_most + 1`` matching rows; with ``in_flight``, also one per queue of the table that has
    messages in flight, with only ``in_flight`` set (see the module docstring).

    Each range is read once: ``oldest`` (the oldest due schedule, or None) comes from the due
    rows read for ``due``, and ``dead`` and ``done`` from the same rows without a schedule; the
    counts in flight from one read of at most ``at_most + 1`` leases, for every queue at once.
    """
    if not queues:
        raise InvalidArgument("bounded_stats_stmt needs at least one queue")
    shape = st.message_shape(t)
    cap = at_most + 1

    def first(cond: ColumnElement[bool], *order: Any, column: Any = t.c.id) -> Any:
        # In the index's order: a range scan that stops after ``cap`` rows.
        by = order or (t.c.scheduled_at, t.c.id)
        return select(column).where(cond).order_by(*by).limit(cap).subquery()

    def of_status(rows: Any, status: str) -> Any:
        return func.coalesce(func.sum(case((rows.c.status == status, 1), else_=0)), 0)

    def row(name: str) -> Select[Any]:
        of_queue = t.c.queue == name
        # The take's filter (no status: a due row is pending by its schedule): index-only.
        due_rows = first(st.due_filter(shape, name, now), column=t.c.scheduled_at)
        due = select(
            func.count().label("n"), func.min(due_rows.c.scheduled_at).label("oldest")
        ).subquery()
        no_schedule = first(
            and_(of_queue, t.c.scheduled_at.is_(None)), UnscheduledOrder(t), column=t.c.status
        )
        unscheduled = select(
            of_status(no_schedule, "dead").label("dead"),
            of_status(no_schedule, "done").label("done"),
        ).subquery()
        scheduled = first(and_(of_queue, flt.state_clause(t, "scheduled", now)))
        return select(
            literal(name, String()).label("queue"),
            due.c.n.label("due"),
            select(func.count()).select_from(scheduled).scalar_subquery().label("scheduled"),
            cast(null(), BigInteger()).label("in_flight"),  # typed: PostgreSQL's UNION
            unscheduled.c.dead,
            unscheduled.c.done,
            due.c.oldest,
        ).select_from(due.join(unscheduled, true()))

    parts = [row(name) for name in queues]
    if in_flight:
        # The leases of every queue (as many as the consumers hold, whatever the backlog), in
        # the lock-token index's order: one read for all queues. A condition on the queue, or
        # a GROUP BY over the table, would let a planner read the due index instead.
        leases = first(flt.state_clause(t, "in_flight", now), t.c.lock_token, column=t.c.queue)
        parts.append(
            select(leases.c.queue, null(), null(), func.count(), null(), null(), null())
            .select_from(leases)
            .group_by(leases.c.queue)
        )
    if len(parts) == 1:
        return parts[0]
    u = union_all(*parts).subquery("per_queue")
    return select(*u.c)


def queue_stats(
    session: Session,
    t: Table,
    now: datetime,
    queues: Sequence[str] | None = None,
    *,
    include_missing: bool = False,
    at_most: int | None = None,
) -> list[QueueStats]:
    """Counts and lag of ``queues`` (every queue in the table when None), sorted by name.

    A queue with no rows is left out unless ``include_missing``, which reports it with zeros.
    Exact by default; with ``at_most``, each count reads at most ``at_most + 1`` rows and a
    count that stopped is reported as ``at_most`` with its state in ``QueueStats.capped``.
    """
    if at_most is not None and at_most < 1:
        raise InvalidArgument(f"at_most must be >= 1 (or None for exact counts), got {at_most}")
    names = list_queues(session, t) if queues is None else sorted(set(queues))
    if not names:
        return []
    if at_most is None:
        raw = _exact(session, t, now, names, every=queues is None)
    else:
        raw = _bounded(session, t, now, names, at_most)
    result = []
    for name in names:
        e = raw.get(name)
        if e is None:
            if not include_missing:
                continue
            e = _Raw()
        first = e.oldest
        oldest_due = first if first is not None and first <= now else None
        result.append(
            QueueStats(
                queue=name,
                due=e.due,
                scheduled=e.scheduled,
                in_flight=e.in_flight,
                dead=e.dead,
                done=e.done,
                oldest_due=oldest_due,
                lag_seconds=0.0
                if oldest_due is None
                else max(0.0, (now - oldest_due).total_seconds()),
                capped=frozenset(e.capped),
            )
        )
    return result


@dataclass
class _Raw:
    """One queue's counts as read, before they become a :class:`QueueStats`."""

    due: int = 0
    scheduled: int = 0
    in_flight: int = 0
    dead: int = 0
    done: int = 0
    oldest: datetime | None = None
    capped: set[str] = field(default_factory=set)


def _exact(
    session: Session, t: Table, now: datetime, names: list[str], *, every: bool
) -> dict[str, _Raw]:
    """Decode :func:`stats_stmt`: "scheduled" is the later rows minus those in flight."""
    raw: dict[str, _Raw] = {}
    later: dict[str, int] = {}
    for part, name, status, a, b, oldest in session.execute(stats_stmt(t, names, now, every=every)):
        e = raw.setdefault(str(name), _Raw())
        if part == 1:
            e.due, later[str(name)], e.oldest = int(a or 0), int(b or 0), oldest
        elif part == 2:
            e.in_flight = int(a or 0)
        elif status in ("dead", "done"):
            setattr(e, status, int(a or 0))
    for name, e in raw.items():
        e.in_flight = min(e.in_flight, later.get(name, 0))
        e.scheduled = later.get(name, 0) - e.in_flight
    return raw


def _bounded(
    session: Session, t: Table, now: datetime, names: list[str], at_most: int
) -> dict[str, _Raw]:
    """Decode :func:`bounded_stats_stmt`, one statement per hundred queues (per queue on
    PostgreSQL: see ``PostgreSQLStrategy``), the first also counting the messages in flight;
    a queue whose counts are all zero has no rows (every row is in one of the states) unless
    there were more leases than the read took."""
    read: dict[str, dict[str, Any]] = {name: {"oldest": None} for name in names}
    leases = 0
    step = strategy_class(session.get_bind().dialect).queues_per_bounded_stats
    for i in range(0, len(names), step):
        stmt = bounded_stats_stmt(t, names[i : i + step], now, at_most, in_flight=i == 0)
        for name, due, scheduled, in_flight, dead, done, oldest in session.execute(stmt):
            if due is None:
                leases += int(in_flight)
                if str(name) in read:
                    read[str(name)]["in_flight"] = int(in_flight)
            else:
                r = read[str(name)]
                r.update(due=int(due), scheduled=int(scheduled), dead=int(dead), done=int(done))
                r["oldest"] = oldest
    raw: dict[str, _Raw] = {}
    for name, r in read.items():
        counts = {state: r.get(state, 0) for state in STATES}
        if not any(counts.values()) and leases <= at_most:
            continue  # no row: (with more leases than read, it may hold one of those)
        e = raw[name] = _Raw(oldest=r["oldest"])
        for state in ("due", "scheduled"):
            if counts[state] > at_most:
                e.capped.add(state)
        if leases > at_most:  # the leases of all queues were read together
            e.capped.add("in_flight")
        if counts["dead"] + counts["done"] > at_most:
            e.capped.update(("dead", "done"))
        for state, n in counts.items():
            setattr(e, state, min(n, at_most))
    return raw
