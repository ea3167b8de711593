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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Table, case, func, literal_column, null, select, union_all
from sqlalchemy.orm import Session
from sqlalchemy.sql import Select

__all__ = ["QueueStats", "list_queues", "queue_stats", "queues_stmt", "stats_stmt"]


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

    @property
    def pending(self) -> int:
        return self.due + self.scheduled + self.in_flight

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


def queue_stats(
    session: Session,
    t: Table,
    now: datetime,
    queues: Sequence[str] | None = None,
    *,
    include_missing: bool = False,
) -> list[QueueStats]:
    """Counts and lag of ``queues`` (every queue in the table when None), sorted by name.

    A queue with no rows is left out unless ``include_missing``, which reports it with zeros.
    """
    names = list_queues(session, t) if queues is None else sorted(set(queues))
    if not names:
        return []
    raw: dict[str, dict[str, Any]] = {}

    def entry(name: str) -> dict[str, Any]:
        return raw.setdefault(
            name, {"due": 0, "later": 0, "in_flight": 0, "dead": 0, "done": 0, "oldest": None}
        )

    stmt = stats_stmt(t, names, now, every=queues is None)
    for part, name, status, a, b, oldest in session.execute(stmt):
        e = entry(str(name))
        if part == 1:
            e["due"], e["later"], e["oldest"] = int(a or 0), int(b or 0), oldest
        elif part == 2:
            e["in_flight"] = int(a or 0)
        elif status in ("dead", "done"):
            e[status] = int(a or 0)
    result = []
    for name in names:
        if name not in raw and not include_missing:
            continue
        e = entry(name)
        first: datetime | None = e["oldest"]
        oldest_due = first if first is not None and first <= now else None
        in_flight = min(e["in_flight"], e["later"])
        result.append(
            QueueStats(
                queue=name,
                due=e["due"],
                scheduled=e["later"] - in_flight,
                in_flight=in_flight,
                dead=e["dead"],
                done=e["done"],
                oldest_due=oldest_due,
                lag_seconds=0.0
                if oldest_due is None
                else max(0.0, (now - oldest_due).total_seconds()),
            )
        )
    return result
