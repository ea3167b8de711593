"""What the dashboard reads and changes, with no web framework: queues, counts, history,
messages, actions in chunks, queue controls, workers, cron configurations and entity queues.

Everything goes through the library's own read and admin side (:mod:`sqla_delayedq._admin`,
:mod:`sqla_delayedq._filters`, :mod:`sqla_delayedq._cli_stats`), with bound parameters only.
Overview counts come from a :class:`Snapshot` shared by every viewer and refreshed at most every
``counts_ttl`` seconds, so a wall of open dashboards costs one count per interval.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Engine, and_, bindparam, func, inspect, not_, select
from sqlalchemy.exc import DBAPIError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from .. import _filters as flt
from .._cli_stats import QueueStats, list_queues, queue_stats
from .._codec import RawCodec, check_text
from .._consumer import BaseWorker
from .._engine import create_engine, sync_driver_url
from .._leases import LeasedQueue
from .._queue import DelayedQueue
from .._types import MessageFilter, MessageInfo, State
from ..controls import QueueControls, from_row
from ..entity import EntityCounts, EntityQueue, EntityStatus
from ..errors import DelayedQueueError, InvalidArgument, TransientError
from ..models import (
    DelayedMessage,
    QueueMessageMixin,
    controls_table,
    stats_table,
    table_key,
    workers_table,
)
from ..monitor import is_alive

__all__ = [
    "CHUNK",
    "ENTITY_STATES",
    "MAX_WHERE",
    "MESSAGE_STATES",
    "Data",
    "Job",
    "NotFound",
    "Overview",
    "database_problem",
]

log = logging.getLogger("sqla_delayedq.web")
#: Messages changed per transaction by a bulk action.
CHUNK = 1000
#: The most payload filters (``where=``) one request may give: each is a condition of the query.
MAX_WHERE = 20
#: Minutes of history on the overview's charts.
HISTORY_MINUTES = 60
MESSAGE_STATES = tuple(s.value for s in State)
ENTITY_STATES = ("due", "scheduled", "in_flight", "succeeded", "failed", "retrying", "idle")
ACTIONS = {
    "retry": "retry (requeue dead)",
    "process_now": "process now",
    "drop": "drop",
}


class NotFound(LookupError):
    """An unknown table, queue, message or job (a 404 page)."""


class RawQueue(DelayedQueue[Any]):
    """A queue for inspection: shows stored payloads whatever their serializer or type name."""

    def __init__(self, name: str, **kwargs: Any) -> None:
        super().__init__(name, notify=False, **kwargs)
        self.codec = RawCodec(self.serializer)


@dataclass
class MessageTable:
    """One message table and the queues configured on it."""

    name: str
    model: type[QueueMessageMixin]
    configured: tuple[str, ...] = ()

    @property
    def table(self) -> Any:
        return self.model.__table__  # type: ignore[attr-defined]


@dataclass(frozen=True)
class QueueRow:
    table: str
    stats: QueueStats
    retrying: int
    #: Processed, failed and dead per minute, oldest first (HISTORY_MINUTES entries).
    processed: tuple[int, ...]
    failed: tuple[int, ...]

    @property
    def queue(self) -> str:
        return self.stats.queue


@dataclass(frozen=True)
class Overview:
    """Counts of every queue, history of the last hour, and live workers, at ``taken_at``."""

    taken_at: datetime
    queues: tuple[QueueRow, ...]
    entities: tuple[tuple[str, EntityCounts], ...]
    #: None when the dashboard's tables are missing (no history, no registry).
    history: bool
    minutes: tuple[datetime, ...]
    live_workers: int | None
    #: ``time.monotonic()`` when it was taken.
    seconds: float
    #: The controls of the queues that have a row, by (table, queue); an entity queue's are under
    #: (its table, its table). None when the controls table is missing.
    controls: Mapping[tuple[str, str], QueueControls] | None = None

    def control(self, table: str, queue: str) -> QueueControls | None:
        """The controls of ``queue`` of ``table`` (None: the controls table is missing)."""
        if self.controls is None:
            return None
        return self.controls.get((table, queue), QueueControls())


@dataclass
class Job:
    """A bulk action running in chunks, for the progress page."""

    id: str
    action: str
    description: str
    total: int
    done: int = 0
    changed: int = 0
    finished: bool = False
    error: str | None = None
    started: float = field(default_factory=time.monotonic)


def _engine_of(target: Any) -> tuple[Engine, sessionmaker[Session], bool]:
    """(engine, sessionmaker, owned): a synchronous engine for the target's database."""
    if isinstance(target, Engine):
        return target, sessionmaker(target), False
    bind = getattr(target, "kw", {}).get("bind")
    if isinstance(bind, Engine):
        return bind, target, False
    if bind is not None and hasattr(bind, "sync_engine"):
        url = sync_driver_url(bind.url)
        if url is None:
            raise InvalidArgument(
                f"cannot derive a synchronous driver from {bind.url.drivername!r}; pass a "
                "sessionmaker bound to a synchronous engine of the same database"
            )
        engine = create_engine(url)
        return engine, sessionmaker(engine), True
    raise InvalidArgument(
        "dashboard() needs a Worker, an AsyncWorker, a sessionmaker bound to an engine, or an "
        f"Engine; got {type(target).__name__}"
    )


class Data:
    """The dashboard's view of one database: its message tables and entity queues."""

    def __init__(
        self,
        target: Any,
        *,
        queues: Iterable[Any] = (),
        tables: Iterable[type[QueueMessageMixin]] = (),
        counts_ttl: float = 5.0,
        clock: Callable[[], datetime] | None = None,
    ) -> None:
        if counts_ttl < 0:
            raise InvalidArgument(f"counts_ttl must be >= 0, got {counts_ttl}")
        sources: list[Any] = list(queues)
        if isinstance(target, BaseWorker):
            sources = [*target.queues, *sources]
            target = target.sessions
        self.engine, self.sessions, self._owned = _engine_of(target)
        self.clock = clock or (lambda: datetime.now(UTC))
        self.counts_ttl = counts_ttl
        self.tables: dict[str, MessageTable] = {}
        self.entities: dict[str, EntityQueue[Any]] = {}
        for q in sources:
            if isinstance(q, EntityQueue):
                self.entities.setdefault(q.name, q)
            elif isinstance(q, DelayedQueue):
                name = table_key(q.table)
                found = self.tables.setdefault(name, MessageTable(name, q.model))
                if q.name not in found.configured:
                    found.configured = (*found.configured, q.name)
            else:
                raise InvalidArgument(
                    f"queues must be DelayedQueue or EntityQueue objects, got {type(q).__name__}"
                )
        for model in tables:
            t = getattr(model, "__table__", None)
            if not isinstance(model, type) or not issubclass(model, QueueMessageMixin) or t is None:
                raise InvalidArgument(
                    f"tables must be mapped classes with QueueMessageMixin, got {model!r}"
                )
            self.tables.setdefault(table_key(t), MessageTable(table_key(t), model))
        if not self.tables and not self.entities:
            self.tables[DelayedMessage.__tablename__] = MessageTable(
                DelayedMessage.__tablename__, DelayedMessage
            )
        self._lock = threading.Lock()
        self._counting = threading.Lock()
        self._refreshing = False
        self._snapshot: Overview | None = None
        #: Bumped by every change (:meth:`invalidate`): a count begun before it is not kept.
        self._generation = 0
        self._jobs: dict[str, Job] = {}
        self._queues: dict[tuple[str, str], RawQueue] = {}

    def close(self) -> None:
        if self._owned:
            self.engine.dispose()

    def now(self) -> datetime:
        return self.clock()

    # -- lookups -------------------------------------------------------------------------

    def table(self, name: str) -> MessageTable:
        found = self.tables.get(name)
        if found is None:
            raise NotFound(f"unknown table {name!r}")
        return found

    def table_names(self) -> set[str]:
        """Every table the dashboard reads: the message tables, the entity queues' and ours."""
        return {
            *self.tables,
            *(table_key(eq.table) for eq in self.entities.values()),
            workers_table.name,
            stats_table.name,
            controls_table.name,
        }

    def entity(self, name: str) -> EntityQueue[Any]:
        found = self.entities.get(name)
        if found is None:
            raise NotFound(f"unknown entity queue {name!r}")
        return found

    def queue(self, table: str, name: str, *, known: bool = False) -> RawQueue:
        """The queue ``name`` of ``table``: configured, or holding at least one message
        (``known``: the caller just found it in the table)."""
        mt = self.table(table)
        key = (table, name)
        if key not in self._queues:
            if not known and name not in mt.configured:
                with self.sessions() as s:
                    if not self._exists(s, mt, name):
                        raise NotFound(f"unknown queue {name!r} in table {table!r}")
            self._queues[key] = RawQueue(name, model=mt.model)
        return self._queues[key]

    def _exists(self, s: Session, mt: MessageTable, name: str) -> bool:
        """Whether ``name`` holds a message of ``mt`` or has controls (a paused empty queue)."""
        check_text(name, "queue")  # a NUL: refused here, not by the database (PostgreSQL)
        t = mt.table
        if s.execute(select(t.c.id).where(t.c.queue == name).limit(1)).first() is not None:
            return True
        if not self.has_controls_table(s):
            return False
        c = controls_table.c
        stmt = select(c.queue).where(c.table_name == mt.name, c.queue == name)
        return s.execute(stmt).first() is not None

    def queue_names(self, session: Session, mt: MessageTable) -> list[str]:
        return sorted({*mt.configured, *list_queues(session, mt.table)})

    # -- the overview --------------------------------------------------------------------

    def overview(self) -> Overview:
        """The shared snapshot of the counts, recounted at most every ``counts_ttl`` seconds.

        One count at a time, whatever the number of viewers. Once a snapshot exists, a stale
        one is still served while a background thread recounts (so a page never waits for a
        count on a big table); only the first view, a view after an action, and
        ``counts_ttl=0`` count while the request waits.
        """
        with self._lock:
            snap = self._snapshot
            if snap is not None and self.counts_ttl > 0:
                if time.monotonic() - snap.seconds >= self.counts_ttl and not self._refreshing:
                    self._refreshing = True
                    threading.Thread(
                        target=self._refresh, name="delayedq-web-counts", daemon=True
                    ).start()
                return snap
        with self._counting:
            snap = self._snapshot
            if snap is not None and time.monotonic() - snap.seconds < max(self.counts_ttl, 0.001):
                return snap
            generation = self._generation
            snap = self._take_overview()
            self._keep(snap, generation)
            return snap

    def _refresh(self) -> None:
        try:
            with self._counting:
                generation = self._generation
                self._keep(self._take_overview(), generation)
        except Exception:
            log.warning("dashboard: recounting the overview failed", exc_info=True)
        finally:
            self._refreshing = False

    def _keep(self, snap: Overview, generation: int) -> None:
        """Share ``snap`` unless a change came since its count began (the view after an
        action counts again, rather than show what the action changed)."""
        with self._lock:
            if generation == self._generation:
                self._snapshot = snap

    def _take_overview(self) -> Overview:
        now = self.now()
        rows: list[QueueRow] = []
        minutes = tuple(
            now.replace(second=0, microsecond=0) - timedelta(minutes=i)
            for i in range(HISTORY_MINUTES - 1, -1, -1)
        )
        with self.sessions() as s:
            history = self._history(s, minutes[0])
            controls = self._controls(s)
            for mt in self.tables.values():
                controlled = [q for (t, q), c in (controls or {}).items() if t == mt.name]
                names = sorted({*self.queue_names(s, mt), *controlled})
                stats = queue_stats(s, mt.table, now, names, include_missing=True)
                retrying = self._retrying(s, mt, names)
                for st in stats:
                    series = history.get((mt.name, st.queue), {}) if history is not None else {}
                    rows.append(
                        QueueRow(
                            table=mt.name,
                            stats=st,
                            retrying=retrying.get(st.queue, 0),
                            processed=tuple(series.get(m, (0, 0))[0] for m in minutes),
                            failed=tuple(series.get(m, (0, 0))[1] for m in minutes),
                        )
                    )
            entities = tuple((name, eq.counts(s)) for name, eq in sorted(self.entities.items()))
            live = None
            if history is not None:
                live = sum(1 for w in self._worker_rows(s) if w["state"] == "running")
        return Overview(
            taken_at=now,
            queues=tuple(rows),
            entities=entities,
            history=history is not None,
            minutes=minutes,
            live_workers=live,
            seconds=time.monotonic(),
            controls=controls,
        )

    def _retrying(self, s: Session, mt: MessageTable, names: Sequence[str]) -> dict[str, int]:
        """Pending messages that failed before (attempts > 0), per queue."""
        if not names:
            return {}
        t = mt.table
        stmt = (
            select(t.c.queue, func.count())
            .where(
                t.c.queue.in_(list(names)),
                t.c.scheduled_at.is_not(None),
                t.c.status == "pending",
                t.c.attempts > 0,
            )
            .group_by(t.c.queue)
        )
        return {str(q): int(n) for q, n in s.execute(stmt)}

    def has_dashboard_tables(self, s: Session) -> bool:
        names = set(inspect(s.connection()).get_table_names())
        return {workers_table.name, stats_table.name} <= names

    def has_controls_table(self, s: Session) -> bool:
        return bool(inspect(s.connection()).has_table(controls_table.name))

    def _controls(self, s: Session) -> dict[tuple[str, str], QueueControls] | None:
        """The paused or limited queues of the dashboard's tables, by (table, queue); None
        without the controls table (an older schema: every queue is shown plain)."""
        if not self.has_controls_table(s):
            return None
        c = controls_table.c
        # An entity queue is shown by its name: its table's, without the schema.
        entities = {table_key(eq.table): name for name, eq in self.entities.items()}
        stmt = select(
            c.table_name, c.queue, c.paused, c.max_in_flight, c.rate_limit, c.rate_period
        ).where(c.table_name.in_([*self.tables, *entities]))
        found = {
            (entities.get(str(r.table_name), str(r.table_name)), str(r.queue)): from_row(r)
            for r in s.execute(stmt)
        }
        return {key: value for key, value in found.items() if not value.plain}

    def _history(
        self, s: Session, since: datetime
    ) -> dict[tuple[str, str], dict[datetime, tuple[int, int]]] | None:
        """Processed and failed per (table, queue) and minute since ``since``; None without
        the dashboard's tables."""
        if not self.has_dashboard_tables(s):
            return None
        t = stats_table
        stmt = (
            select(
                t.c.table_name,
                t.c.queue,
                t.c.minute,
                func.sum(t.c.processed),
                func.sum(t.c.failed),
            )
            .where(t.c.minute >= since)
            .group_by(t.c.table_name, t.c.queue, t.c.minute)
        )
        found: dict[tuple[str, str], dict[datetime, tuple[int, int]]] = {}
        for table, queue, minute, processed, failed in s.execute(stmt):
            found.setdefault((str(table), str(queue)), {})[minute] = (
                int(processed or 0),
                int(failed or 0),
            )
        return found

    # -- messages ------------------------------------------------------------------------

    def search(
        self, table: str, queue: str, where: MessageFilter, after: int | None, limit: int
    ) -> tuple[list[MessageInfo], bool]:
        """One page of messages by id (keyset), and whether there are more."""
        q = self.queue(table, queue)
        with self.sessions() as s:
            found = q.search(s, where, limit=limit + 1, after_id=after)
        return found[:limit], len(found) > limit

    def count(self, table: str, queue: str, where: MessageFilter, action: str | None = None) -> int:
        """How many messages match ``where`` (with ``action``: and would be changed by it)."""
        q = self.queue(table, queue)
        with self.sessions() as s:
            return q.count(s, self._changed_by(q, action, where))

    def bound(
        self, table: str, queue: str, where: MessageFilter, action: str | None = None
    ) -> tuple[int, int]:
        """What a confirmation shows and its action may then change: how many messages match
        ``where`` and would be changed by ``action``, and the highest id among them (0 for
        none)."""
        q = self.queue(table, queue)
        with self.sessions() as s:
            return q.count_up_to(s, self._changed_by(q, action, where))

    def message(
        self, table: str, queue: str, id: int, shown: datetime | None = None
    ) -> MessageInfo:
        """Message ``id``; with ``shown`` (the ``created_at`` of the message a page showed),
        only that message: an id can pass to a message offered since (SQLite reuses the
        highest id once its row is deleted), and an action must not reach that one."""
        q = self.queue(table, queue)
        t = q.table
        with self.sessions() as s:
            found = q.search(s, MessageFilter(where=t.c.id == id), limit=1)
        if not found:
            raise NotFound(f"no message {id} in queue {queue!r}")
        if shown is not None and found[0].created_at != shown:
            raise NotFound(
                f"message {id} of queue {queue!r} is no longer the one shown: it was removed, "
                "and a message offered since holds its id. Nothing was changed"
            )
        return found[0]

    # -- actions -------------------------------------------------------------------------

    @staticmethod
    def action_filter(action: str, where: MessageFilter) -> MessageFilter:
        """The filter an action really applies: retry takes dead messages only, process now
        pending ones (in-flight messages keep their lease)."""
        if action not in ACTIONS:
            raise InvalidArgument(f"unknown action {action!r}; use one of: {', '.join(ACTIONS)}")
        if action == "retry":
            if where.state not in (None, "dead"):
                raise InvalidArgument("retry applies to dead messages: filter by state dead")
            return replace(where, state="dead")
        if action == "process_now":
            if where.state not in (None, "due", "scheduled", "pending"):
                raise InvalidArgument(
                    "process now applies to pending messages (due, scheduled or pending)"
                )
            return replace(where, state=where.state or "pending")
        if not (where.state or where.key_prefix or where.payload or where.keys):
            raise InvalidArgument(
                "drop needs a filter (a state, a key prefix or a payload field); "
                "the dashboard never empties a queue"
            )
        return where

    @staticmethod
    def _changed_by(q: RawQueue, action: str | None, where: MessageFilter) -> MessageFilter:
        """``where`` narrowed to the messages ``action`` changes: process now leaves messages
        in flight alone (they keep their lease), so a count of pending ones leaves them out; so
        does a drop by filter, unless the filter asks for messages in flight: a message a
        worker took after the confirmation (or while the page was open) is being handled."""
        if action == "process_now":
            if where.state != "pending":
                return where
        elif action != "drop" or where.state == "in_flight":
            return where
        t = q.table
        now = bindparam(None, callable_=q.now, type_=t.c.scheduled_at.type)
        free = not_(flt.state_clause(t, "in_flight", now))  # type: ignore[arg-type]
        return replace(where, where=free if where.where is None else and_(where.where, free))

    def _apply(self, action: str, q: RawQueue, s: Session, where: MessageFilter) -> int:
        if action == "retry":
            return q.requeue_dead(s, where)
        if action == "process_now":
            return q.reschedule(s, where)
        return q.drop_where(s, where)

    def act_one(
        self, action: str, table: str, queue: str, id: int, shown: datetime | None = None
    ) -> tuple[MessageInfo, int]:
        """Apply ``action`` to one message (by id, and with ``shown`` the message a page
        showed, see :meth:`message`); returns it as it was and 0 or 1."""
        info = self.message(table, queue, id, shown)
        q = self.queue(table, queue)
        t = q.table
        # The row shown, not any row of that key, nor a row that took its id since.
        this = and_(t.c.id == id, t.c.created_at == info.created_at)
        where = self.action_filter(action, MessageFilter(keys=(info.key,), where=this))
        with self.sessions() as s, s.begin():
            return info, self._apply(action, q, s, where)

    def start_job(
        self,
        action: str,
        table: str,
        queue: str,
        where: MessageFilter,
        *,
        upto: int | None = None,
        at_most: int | None = None,
    ) -> Job:
        """Run ``action`` on every message matching ``where`` in a thread, ``CHUNK`` ids per
        transaction; each chunk re-applies the filter, so a message that changed meanwhile
        is left alone.

        ``upto`` and ``at_most`` are what the operator confirmed (:meth:`bound`): no message
        with a higher id (offered since), and never more messages than were shown, though more
        may match by now (died since the confirmation, say)."""
        q = self.queue(table, queue)
        where = self._changed_by(q, action, self.action_filter(action, where))
        if upto is not None:
            below = q.table.c.id <= upto
            where = replace(where, where=below if where.where is None else and_(where.where, below))
        total = self.count(table, queue, where)
        if at_most is not None:
            total = min(total, at_most)
        job = Job(uuid.uuid4().hex, action, describe(queue, where), total)
        with self._lock:
            self._jobs = {k: j for k, j in self._jobs.items() if not j.finished or _recent(j)}
            self._jobs[job.id] = job
        thread = threading.Thread(
            target=self._run_job,
            args=(job, q, where, at_most),
            name=f"delayedq-web-{action}",
            daemon=True,
        )
        thread.start()
        return job

    def _run_job(
        self, job: Job, q: RawQueue, where: MessageFilter, at_most: int | None = None
    ) -> None:
        t = q.table
        last: int | None = None
        try:
            while True:
                size = CHUNK if at_most is None else min(CHUNK, at_most - job.changed)
                if size <= 0:
                    break  # as many as were confirmed
                with self.sessions() as s, s.begin():
                    stmt = select(t.c.id).where(q.condition(where, q.now()))
                    if last is not None:
                        stmt = stmt.where(t.c.id > last)
                    ids = list(s.scalars(stmt.order_by(t.c.id).limit(size)))
                    if not ids:
                        break
                    among = t.c.id.in_(ids)
                    chunk = replace(
                        where, where=among if where.where is None else and_(where.where, among)
                    )
                    job.changed += self._apply(job.action, q, s, chunk)
                last = ids[-1]
                job.done = min(job.total, job.done + len(ids))
        except TransientError as exc:
            # A lock held too long (a transactional handler's), a deadlock, a lost connection.
            log.warning("dashboard: %s stopped: %s", job.description, exc)
            job.error = (
                "the database was busy (a lock wait, a deadlock or a lost connection); "
                "confirm the action again for the rest"
            )
        except DelayedQueueError as exc:  # ours: says what to do, no connection details
            job.error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        except SQLAlchemyError as exc:
            ref = uuid.uuid4().hex[:8]
            log.error("dashboard: %s failed (error id %s)", job.description, ref, exc_info=True)
            job.error = database_problem(exc, self.table_names(), ref)
        except Exception:
            ref = uuid.uuid4().hex[:8]
            log.error("dashboard: %s failed (error id %s)", job.description, ref, exc_info=True)
            job.error = (
                f"an unexpected error; the server's log has the details under error id {ref}"
            )
        finally:
            job.finished = True
            self.invalidate()

    def job(self, id: str) -> Job:
        found = self._jobs.get(id)
        if found is None:
            raise NotFound(f"no action {id!r} (actions are kept for an hour)")
        return found

    def invalidate(self) -> None:
        """The next overview recounts (after an action)."""
        with self._lock:
            self._generation += 1
            self._snapshot = None

    # -- queue controls ------------------------------------------------------------------

    def controls(self, table: str, queue: str) -> QueueControls | None:
        """The controls of a queue as the database holds them; None without the table."""
        q = self.queue(table, queue)
        with self.sessions() as s:
            return q.controls(s) if self.has_controls_table(s) else None

    def steer(
        self, target: str | tuple[str, str], paused: bool | None, limits: Mapping[str, Any]
    ) -> QueueControls:
        """Pause or resume (``paused``) and set ``limits`` (``set_limits``'s arguments) of a
        queue, ``(table, queue)``, or an entity queue by name, in one transaction."""
        q: LeasedQueue[Any] = (
            self.entity(target) if isinstance(target, str) else self.queue(*target)
        )
        with self.sessions() as s, s.begin():
            if paused is True:
                q.pause(s)
            elif paused is False:
                q.resume(s)
            if limits:
                q.set_limits(s, **limits)
            return q.controls(s)

    # -- workers, cron, entity queues ----------------------------------------------------

    def _worker_rows(self, s: Session) -> list[dict[str, Any]]:
        now = self.now()
        w = workers_table
        stmt = select(w).order_by(w.c.started_at.desc(), w.c.id).limit(500)
        rows = []
        for r in s.execute(stmt).mappings():
            row = dict(r)
            if row["stopped_at"] is not None:
                row["state"] = "stopped"
            elif is_alive(row["heartbeat_at"], row["heartbeat_seconds"], now):
                row["state"] = "running"
            else:
                row["state"] = "dead"
            try:
                row["queues"] = json.loads(row["queues"])
            except ValueError:
                row["queues"] = [row["queues"]]
            rows.append(row)
        order = {"running": 0, "dead": 1, "stopped": 2}
        rows.sort(key=lambda r: order[r["state"]])
        return rows

    def workers(self) -> list[dict[str, Any]] | None:
        """Every worker of the registry, running first; None without the tables."""
        with self.sessions() as s:
            if not self.has_dashboard_tables(s):
                return None
            return self._worker_rows(s)

    def cron(self) -> list[tuple[str, str, Any]]:
        """(table, queue, CronInfo) of every queue that holds cron configurations."""
        from ..cron import list_cron

        found: list[tuple[str, str, Any]] = []
        with self.sessions() as s:
            for mt in self.tables.values():
                for name in self.queue_names(s, mt):
                    q = self.queue(mt.name, name, known=True)
                    found.extend((mt.name, name, info) for info in list_cron(s, q))
        return found

    def entity_rows(
        self, name: str, state: str | None, after: Any, limit: int
    ) -> tuple[list[str], list[tuple[Any, ...]], bool]:
        """Columns and one page of rows of an entity queue's table, by primary key."""
        eq = self.entity(name)
        t = eq.table
        now = eq.now()
        stmt = select(t).order_by(eq.pk).limit(limit + 1)
        if state is not None:
            stmt = stmt.where(entity_state(t, state, now))
        if after is not None:
            stmt = stmt.where(eq.pk > after)
        with self.sessions() as s:
            rows = [tuple(r) for r in s.execute(stmt)]
        return [c.name for c in t.columns], rows[:limit], len(rows) > limit


def entity_state(t: Any, state: str, now: datetime) -> Any:
    at, token, status = t.c.queue_next_attempt_at, t.c.queue_lock_token, t.c.queue_status
    conditions = {
        "due": at <= now,
        "scheduled": and_(at > now, token.is_(None)),
        "in_flight": and_(at > now, token.is_not(None)),
        "succeeded": and_(at.is_(None), status == EntityStatus.SUCCEEDED),
        "failed": and_(at.is_(None), status == EntityStatus.FAILED),
        "retrying": and_(at.is_not(None), status == EntityStatus.FAILED),
        "idle": and_(at.is_(None), status == EntityStatus.NEW),
    }
    if state not in conditions:
        raise InvalidArgument(f"unknown state {state!r}; use one of: {', '.join(ENTITY_STATES)}")
    return conditions[state]


def _recent(job: Job) -> bool:
    return time.monotonic() - job.started < 3600


def database_problem(exc: SQLAlchemyError, tables: Iterable[str], ref: str) -> str:
    """What a page says about a database error: a missing table or column when the server says
    so (a table named only when it is one the dashboard reads), else the kind of error; never
    the server's own text, which may carry the database's name, a host or a user. ``ref`` ties
    the page to the log's entry."""
    orig = exc.orig if isinstance(exc, DBAPIError) and exc.orig is not None else exc
    missing = missing_schema(orig)
    if missing is None:
        return (
            f"The database could not answer ({type(exc).__name__}); the server's log has the "
            f"details under error id {ref}."
        )
    said = str(orig)
    names = [t for t in tables if re.search(rf"(?<![\w$]){re.escape(t)}(?![\w$])", said)]
    what = f"a {missing} is missing"
    if missing == "table" and names:
        what = f"no such table: {max(names, key=len)}"
    return (
        f"The database refused the query: {what}. A missing table or column of ours is created "
        "by 'delayedq db upgrade'; one of yours by your own migrations. (Error id "
        f"{ref}: the server's log has the details.)"
    )


#: How each server says a table or a column does not exist: PostgreSQL's SQL state, MySQL's and
#: MariaDB's error number, SQLite's message.
MISSING = {"42P01": "table", "42703": "column", 1146: "table", 1054: "column"}
SQLITE_MISSING = {"no such table": "table", "no such column": "column"}


def missing_schema(orig: BaseException) -> str | None:
    """``"table"`` or ``"column"`` when the server's error says one is missing, else None."""
    args: tuple[Any, ...] = getattr(orig, "args", ())
    for code in (getattr(orig, "sqlstate", None), args[0] if args else None):
        if isinstance(code, str | int) and code in MISSING:
            return MISSING[code]
    said = str(orig)
    return next((what for start, what in SQLITE_MISSING.items() if said.startswith(start)), None)


def describe(queue: str, f: MessageFilter) -> str:
    parts = [f"queue {queue}"]
    if f.state:
        parts.append(f"state {f.state}")
    if f.key_prefix:
        parts.append(f"keys starting {f.key_prefix!r}")
    if f.keys:
        parts.append(f"key {', '.join(f.keys)}")
    parts.extend(f"{k}={json.dumps(v)}" for k, v in f.payload.items())
    return "; ".join(parts)


def parse_filter(state: str | None, key_prefix: str | None, where: Sequence[str]) -> MessageFilter:
    """The CLI's filters from query parameters (same parser, same errors), at most
    ``MAX_WHERE`` payload fields."""
    if len(where) > MAX_WHERE:
        raise InvalidArgument(
            f"at most {MAX_WHERE} payload filters (where=) in one request, got {len(where)}"
        )
    if state is not None and state not in MESSAGE_STATES:
        raise InvalidArgument(f"unknown state {state!r}; use one of: {', '.join(MESSAGE_STATES)}")
    payload = flt.parse_field_filters([w for w in where if w.strip()])
    for name in payload:
        if '"' in name or "\\" in name:
            raise InvalidArgument(f"payload field {name!r}: quotes and backslashes cannot be used")
    return MessageFilter(state=state or None, key_prefix=key_prefix or None, payload=payload)
