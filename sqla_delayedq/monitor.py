"""The workers registry and per-minute counters that the dashboard reads.

A monitored worker keeps one row of its own in ``delayedq_workers`` (name, host, pid, queues,
concurrency, start time, in-flight count, heartbeat) and adds its processed, failed and dead
counts per queue and minute to its own rows of ``delayedq_stats``. Both tables are created by the
packaged revision ``delayedq_0003`` (``delayedq db upgrade``)::

    from sqla_delayedq.monitor import monitor_worker

    worker = Worker(sessions)
    worker.register(emails, send_email)
    monitor_worker(worker)          # heartbeat every 10 s
    worker.run()

``delayedq worker`` monitors the worker it runs by default (``--no-monitor`` to opt out,
``--heartbeat`` for the interval); a worker built in code records nothing unless it calls
:func:`monitor_worker`: a library does not write tables the application did not ask for.

**Write cost.** One short transaction per heartbeat: one ``UPDATE`` of the worker's row, plus
one ``UPDATE`` (or, for a new minute, an ``INSERT``) per queue that processed or failed
something since the last heartbeat. At the default 10 s that is 6 transactions a minute per
worker, each of 1 + (active queues) single-row statements on primary keys. Every
:data:`PRUNE_EVERY` (10 minutes) one more transaction deletes counters older than ``history``
(24 h by default) and workers not seen for that long.

**Dead workers.** A worker that stops gracefully marks its row stopped. One that is killed
stops beating: the dashboard shows it dead once its heartbeat is older than
:data:`DEAD_AFTER_BEATS` heartbeat intervals (30 s at the default 10 s).

If the tables do not exist, the worker logs one warning and runs on without them. The monitor
uses only the worker's public ``add_hooks`` and ``add_periodic``, so it works for
:class:`~sqla_delayedq.worker.Worker` and :class:`~sqla_delayedq.aio.AsyncWorker` alike.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import delete, insert, inspect, or_, update
from sqlalchemy.orm import Session

from ._consumer import BaseWorker, WorkerHooks, retryable
from ._time import LONGEST, require_duration
from ._types import Buried, Envelope, NackOutcome, QueueName
from .errors import InvalidArgument
from .models import stats_table, table_key, workers_table

__all__ = [
    "DEAD_AFTER_BEATS",
    "DEFAULT_HEARTBEAT",
    "DEFAULT_HISTORY",
    "WorkerMonitor",
    "is_alive",
    "monitor_worker",
]

log = logging.getLogger("sqla_delayedq.monitor")

#: Seconds between two heartbeats, by default.
DEFAULT_HEARTBEAT = 10.0
#: How long counters and rows of gone workers are kept, by default.
DEFAULT_HISTORY = timedelta(hours=24)
#: A worker whose heartbeat is older than this many intervals is shown dead.
DEAD_AFTER_BEATS = 3
#: Seconds between two prunes of old rows.
PRUNE_EVERY = 600.0


def is_alive(heartbeat_at: datetime, heartbeat_seconds: float, now: datetime) -> bool:
    """Whether a worker that beat last at ``heartbeat_at`` counts as running at ``now``."""
    return now - heartbeat_at <= timedelta(seconds=DEAD_AFTER_BEATS * heartbeat_seconds)


def _minute(now: datetime) -> datetime:
    return now.replace(second=0, microsecond=0)


def _missing_table(session: Session) -> bool:
    """Whether a dashboard table is missing (checked after a statement failed)."""
    try:
        bind: Any = session.get_bind()
        engine = getattr(bind, "engine", bind)
        with engine.connect() as conn:
            names = set(inspect(conn).get_table_names())
    except Exception:
        return False
    return not {workers_table.name, stats_table.name} <= names


class WorkerMonitor(WorkerHooks):
    """Counts what a worker does and writes it, with a heartbeat, to the dashboard's tables.

    Built and attached by :func:`monitor_worker`; the hooks only add to counters in memory,
    the heartbeat (a periodic task of the worker) writes them.
    """

    def __init__(
        self,
        worker: BaseWorker[Any],
        *,
        heartbeat: float = DEFAULT_HEARTBEAT,
        history: timedelta = DEFAULT_HISTORY,
        started_by: str = "code",
        clock: Callable[[], datetime] | None = None,
    ) -> None:
        if heartbeat <= 0:
            raise InvalidArgument(f"heartbeat must be > 0 seconds, got {heartbeat}")
        require_duration(history, "history", most=LONGEST)
        self.worker = worker
        self.id = uuid.uuid4().hex
        self.heartbeat = float(heartbeat)
        self.history = history
        self.started_by = started_by
        self.clock = clock or (lambda: datetime.now(UTC))
        self.host = socket.gethostname()[:255]
        self.pid = os.getpid()
        self.disabled = False
        self._lock = threading.Lock()
        #: (table, queue, minute) -> [processed, failed, dead], not yet written.
        self._pending: dict[tuple[str, str, datetime], list[int]] = {}
        self._totals = [0, 0]
        self._registered = False
        self._last_prune = 0.0

    # -- hooks (called on the worker's threads or tasks) -----------------------------------

    def _table_of(self, queue: str) -> str:
        if isinstance(queue, QueueName) and queue.table:
            return queue.table  # the worker says which: two tables may have a queue of one name
        for q in self.worker.queues:
            if q.name == queue:
                return table_key(q.table)
        return ""

    def _count(self, queue: str, index: int, *more: int) -> None:
        key = (self._table_of(queue), queue, _minute(self.clock()))
        with self._lock:
            counts = self._pending.setdefault(key, [0, 0, 0])
            counts[index] += 1
            for i in more:
                counts[i] += 1
            self._totals[min(index, 1)] += 1

    def processed(self, queue: str, envelope: Envelope[Any], seconds: float) -> None:
        self._count(queue, 0)

    def failed(
        self, queue: str, envelope: Envelope[Any], error: BaseException, outcome: NackOutcome
    ) -> None:
        if outcome is NackOutcome.DEAD:
            self._count(queue, 1, 2)
        else:
            self._count(queue, 1)

    def buried(self, queue: str, buried: Buried) -> None:
        self._count(queue, 2)  # dead without an attempt of a handler

    # -- the heartbeat (a periodic task of the worker) -------------------------------------

    def _queues(self) -> str:
        return json.dumps([f"{table_key(q.table)}:{q.name}" for q in self.worker.queues])

    def _runtime(self) -> str:
        return "asyncio" if type(self.worker).__name__ == "AsyncWorker" else "threads"

    def beat(self, sessions: Callable[[], Session], *, stopping: bool = False) -> None:
        """Write the worker's row and the counters gathered since the last beat."""
        if self.disabled:
            return
        with self._lock:
            pending, self._pending = self._pending, {}
            totals = list(self._totals)
        try:
            with sessions() as session:
                try:
                    with session.begin():
                        self._write(session, pending, totals, stopping)
                except Exception as exc:
                    if not retryable(exc) and _missing_table(session):
                        self._disable()
                        return
                    raise
        except Exception:
            with self._lock:  # written next time
                for key, counts in pending.items():
                    mine = self._pending.setdefault(key, [0, 0, 0])
                    for i, n in enumerate(counts):
                        mine[i] += n
            raise
        if not stopping and time.monotonic() - self._last_prune > PRUNE_EVERY:
            self.prune(sessions)

    def _disable(self) -> None:
        self.disabled = True
        log.warning(
            "%s: the dashboard's tables (%s, %s) do not exist, so this worker is not shown "
            "there; create them with 'delayedq db upgrade' (revision delayedq_0003; beside an "
            "Alembic history of your own, see docs/alembic.md first), or run the worker without "
            "monitoring ('delayedq worker --no-monitor')",
            self.worker.name,
            workers_table.name,
            stats_table.name,
        )

    def _write(
        self,
        session: Session,
        pending: dict[tuple[str, str, datetime], list[int]],
        totals: list[int],
        stopping: bool,
    ) -> None:
        now = self.clock()
        w = workers_table
        values: dict[str, Any] = {
            "heartbeat_at": now,
            "in_flight": self.worker.in_flight,
            "processed": totals[0],
            "failed": totals[1],
        }
        if stopping:
            values["stopped_at"] = now
        if not self._registered:
            started = self.worker.started_at
            session.execute(
                insert(w).values(
                    id=self.id,
                    name=self.worker.name[:200],
                    host=self.host,
                    pid=self.pid,
                    runtime=self._runtime(),
                    started_by=self.started_by,
                    queues=self._queues(),
                    concurrency=self.worker.concurrency,
                    heartbeat_seconds=self.heartbeat,
                    started_at=now if started is None else datetime.fromtimestamp(started, UTC),
                    **values,
                )
            )
            self._registered = True
        else:
            session.execute(update(w).where(w.c.id == self.id).values(**values))
        s = stats_table
        for (table, queue, minute), (processed, failed, dead) in sorted(pending.items()):
            key = and_key(self.id, table, queue, minute)
            result: Any = session.execute(
                update(s)
                .where(*key)
                .values(
                    processed=s.c.processed + processed,
                    failed=s.c.failed + failed,
                    dead=s.c.dead + dead,
                )
            )
            if result.rowcount == 0:
                session.execute(
                    insert(s).values(
                        worker_id=self.id,
                        table_name=table,
                        queue=queue,
                        minute=minute,
                        processed=processed,
                        failed=failed,
                        dead=dead,
                    )
                )

    def prune(self, sessions: Callable[[], Session]) -> None:
        """Delete counters older than the history, and rows of workers not seen for as long."""
        self._last_prune = time.monotonic()
        cutoff = self.clock() - self.history
        w = workers_table
        with sessions() as session, session.begin():
            session.execute(delete(stats_table).where(stats_table.c.minute < cutoff))
            session.execute(
                delete(w).where(
                    w.c.id != self.id,
                    or_(w.c.heartbeat_at < cutoff, w.c.stopped_at < cutoff),
                )
            )

    def stop(self, sessions: Callable[[], Session]) -> None:
        """The last beat: counters written and the row marked stopped."""
        self.beat(sessions, stopping=True)


def and_key(worker_id: str, table: str, queue: str, minute: datetime) -> tuple[Any, ...]:
    s = stats_table
    return (
        s.c.worker_id == worker_id,
        s.c.table_name == table,
        s.c.queue == queue,
        s.c.minute == minute,
    )


def monitor_worker(
    worker: BaseWorker[Any],
    *,
    heartbeat: float = DEFAULT_HEARTBEAT,
    history: timedelta = DEFAULT_HISTORY,
    started_by: str = "code",
) -> WorkerMonitor:
    """Record ``worker`` (a ``Worker`` or an ``AsyncWorker``) in the dashboard's tables.

    Call it before the worker starts. ``heartbeat`` is the seconds between two writes (see the
    module docstring for their cost); ``history`` how long counters are kept. A worker that is
    monitored already keeps its monitor (returned), so one process never writes two rows.
    """
    if not isinstance(worker, BaseWorker):
        raise InvalidArgument(
            f"monitor_worker needs a Worker or an AsyncWorker, got {type(worker).__name__}"
        )
    for hooks in getattr(worker.hooks, "all", ()):
        if isinstance(hooks, WorkerMonitor):
            return hooks  # monitored already (in your code, then by ``delayedq worker``)
    monitor = WorkerMonitor(worker, heartbeat=heartbeat, history=history, started_by=started_by)
    worker.add_hooks(monitor)
    worker.add_periodic("workers registry", monitor.beat, heartbeat, on_stop=monitor.stop)
    return monitor
