"""Metrics and traces for queues and workers: Prometheus and OpenTelemetry, both optional.

Two kinds of signal, for either backend:

- **Worker events**, through :class:`~sqla_delayedq.worker.WorkerHooks` subclasses: messages
  processed, failed, dead and redelivered, database errors, handler duration and pickup lag
  (how late a message was taken). :class:`PrometheusHooks` (``pip install
  'sqla_delayedq[prometheus]'``) and :class:`OtelHooks` (``pip install 'sqla_delayedq[otel]'``);
  combine several with :class:`CompositeHooks`.
- **Queue depth and lag**, read from the table when scraped or collected: messages per queue and
  state, and the lag of the oldest due message. :class:`QueueStatsCollector` for Prometheus,
  :func:`observe_queues` for OpenTelemetry. Both read through a :class:`StatsCache`: the
  index-served queries of ``delayedq stats``, **bounded**: each count reads at most
  ``at_most + 1`` rows (1,000 by default; a count above it reads as 1,000 and is flagged
  capped, meaning "at least"), at most once per ``min_interval`` seconds, and never more than
  1 % of the time (after a read of 0.2 s, the next comes 20 s later at the soonest). So
  frequent scrapes cost one bounded query, and a slow database is read less often, not more.

And traces, with OpenTelemetry: :func:`instrument_queue` wraps a queue's ``offer`` and
``offer_batch`` in ``send <queue>`` producer spans and stores the trace context with each message
(its headers, W3C ``traceparent``); :func:`traced_handler` wraps a handler in a ``process <queue>``
consumer span that continues that trace, whatever process handles it: one trace shows the request
that offered and every attempt that handled, each attempt a child of the ``send`` span and linked
to it. Spans and metrics go to the global providers (and propagator) unless given.

::

    from prometheus_client import start_http_server
    from sqla_delayedq.metrics import PrometheusHooks, QueueStatsCollector

    QueueStatsCollector(Session).register()
    start_http_server(9100)
    worker = Worker(Session, hooks=PrometheusHooks())

This module imports neither ``prometheus_client`` nor ``opentelemetry`` until a class or function
that needs one is used.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy import Table
from sqlalchemy.orm import Session

from ._cli_stats import STATES, QueueStats, queue_stats
from ._codec import check_strings, encode_headers
from ._consumer import HOOKS
from ._handlers import check_callback, is_async_callable, is_interruption
from ._types import Buried, Envelope, NackOutcome, OfferMode, OfferResult, QueueName
from .errors import InvalidArgument
from .models import DelayedMessage, table_key
from .worker import Handler, WorkerHooks

if TYPE_CHECKING:
    from opentelemetry.metrics import CallbackOptions, Meter, Observation
    from opentelemetry.trace import Tracer
    from prometheus_client.metrics_core import Metric
    from prometheus_client.registry import CollectorRegistry

    from ._queue import DelayedQueue

__all__ = [
    "CompositeHooks",
    "HealthCollector",
    "OtelHooks",
    "PrometheusHooks",
    "QueueStatsCollector",
    "StatsCache",
    "instrument_queue",
    "observe_queues",
    "serve_prometheus",
    "traced_handler",
]

log = logging.getLogger("sqla_delayedq.metrics")

#: The exporters' cap on each count (:class:`StatsCache`): a count above it reads as this many,
#: flagged as capped. 1,000 rather than 10,000: with the vacuum horizon pinned, PostgreSQL read
#: a 10,000 cap's ranges whole (it expected them barely longer), as costly as an exact read,
#: while 1,000 stopped early (``bench/bench_stats.py``; docs/operators.md).
DEFAULT_AT_MOST = 1_000
#: The largest share of wall time a :class:`StatsCache` spends reading the table.
DEFAULT_READ_SHARE = 0.01
#: Handler durations from 5 ms to 10 min.
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
#: Pickup lags from 10 ms to 1 day.
LAG_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 900, 3600, 4 * 3600, 86400)
INSTRUMENTATION = "sqla_delayedq"

Q = TypeVar("Q", bound="DelayedQueue[Any]")
SessionFactory = Callable[[], Session]


def _version() -> str:
    from . import __version__

    return __version__


def _table_label(table: Table) -> str:
    """The ``table`` label of a message table's metrics: ``schema.name`` for a table in a
    schema; empty (no label) for one without a schema, whose series are what they were before
    tables in schemas had a label of their own."""
    return table_key(table) if table.schema else ""


def _table_labels(caches: Sequence[StatsCache]) -> list[str]:
    """The ``table`` label of each cache's series, as :func:`_table_label`, except that a
    table without a schema has one too when the caches read another table without a schema:
    else the two tables' series of a queue name would be the same series twice."""
    plain = sum(1 for cache in caches if not cache.table.schema)
    return [table_key(c.table) if plain > 1 else _table_label(c.table) for c in caches]


def _queue_table(queue: str) -> str:
    """The ``table`` label of a queue a worker reports, as :func:`_table_label` (``queue`` is
    a :class:`~sqla_delayedq.worker.QueueName`; a plain ``str`` says no table: empty)."""
    return queue.table if isinstance(queue, QueueName) and queue.schema else ""


def _attributes(queue: str, **more: str) -> dict[str, str]:
    """OpenTelemetry attributes of a queue: ``queue``, and ``table`` for a table in a schema
    (absent otherwise, as before)."""
    table = _queue_table(queue)
    return {"queue": queue, **({"table": table} if table else {}), **more}


# -- worker hooks ------------------------------------------------------------------------------


class _HandlerClock:
    """Per-consumer start time of the handler now running: per thread, or per asyncio task
    (an ``AsyncWorker``'s consumers share the event loop's thread).

    The worker reports ``lag`` just before it calls a handler and ``processed`` or ``failed``
    after, on the same consumer; the clock turns that into a duration for failures too (the
    ``failed`` hook carries none). A failed batch reports ``failed`` once per message, with
    the one error its handler raised: each gets the batch's duration.
    """

    def __init__(self) -> None:
        #: A consumer's handler start, or after a failure the error's id and its duration.
        self._started: dict[object, float | tuple[int, float]] = {}

    @staticmethod
    def _consumer() -> object:
        task = None
        aio = sys.modules.get("asyncio")  # no asyncio imported: no event loop runs anywhere
        if aio is not None:
            try:
                task = aio.current_task()
            except RuntimeError:  # no event loop in this thread
                task = None
        return (threading.get_ident(), None if task is None else id(task))

    def start(self) -> None:
        self._started[self._consumer()] = time.monotonic()

    def stop(self, error: BaseException | None = None) -> float | None:
        """The duration of the handler that returned, or raised ``error``."""
        consumer = self._consumer()
        started = self._started.pop(consumer, None)
        if isinstance(started, tuple):  # the rest of a failed batch: the same error
            if error is None or started[0] != id(error):
                return None
            self._started[consumer] = started
            return started[1]
        if started is None:
            return None
        seconds = time.monotonic() - started
        if error is not None:
            self._started[consumer] = (id(error), seconds)
        return seconds


def _guarded(method: Callable[..., object]) -> Callable[..., None]:
    """Hooks must not raise: log a failing metric update instead of breaking the worker
    (whatever it raised but an interruption, as the worker does for its hooks)."""

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        try:
            method(*args, **kwargs)
        except BaseException as exc:
            if is_interruption(exc):
                raise
            log.exception("metrics hook %s failed", method.__name__)

    return wrapper


class CompositeHooks(WorkerHooks):
    """Several hooks as one: each event goes to every hook, in order. They are plain
    functions: for ``async def`` hooks on the asyncio worker, give each to ``add_hooks``."""

    def __init__(self, *hooks: WorkerHooks) -> None:
        for hooks_ in hooks:
            for name in HOOKS:
                check_callback(
                    getattr(hooks_, name),
                    f"CompositeHooks: {type(hooks_).__name__}.{name}",
                    awaits=False,
                    caller="CompositeHooks",
                    instead="give it to AsyncWorker.add_hooks, which awaits it",
                )
        self.hooks = hooks

    @_guarded
    def processed(self, queue: str, envelope: Envelope[Any], seconds: float) -> None:
        for h in self.hooks:
            _guarded(h.processed)(queue, envelope, seconds)

    @_guarded
    def failed(
        self, queue: str, envelope: Envelope[Any], error: BaseException, outcome: NackOutcome
    ) -> None:
        for h in self.hooks:
            _guarded(h.failed)(queue, envelope, error, outcome)

    @_guarded
    def redelivered(self, queue: str, envelope: Envelope[Any]) -> None:
        for h in self.hooks:
            _guarded(h.redelivered)(queue, envelope)

    @_guarded
    def buried(self, queue: str, buried: Buried) -> None:
        for h in self.hooks:
            _guarded(h.buried)(queue, buried)

    @_guarded
    def lag(self, queue: str, seconds: float) -> None:
        for h in self.hooks:
            _guarded(h.lag)(queue, seconds)

    @_guarded
    def db_error(self, error: BaseException) -> None:
        for h in self.hooks:
            _guarded(h.db_error)(error)


class _Families:
    """Prometheus metrics whose series of a table in a schema carry a ``table`` label and the
    others do not: each metric is two of prometheus_client's (one without the label, one with
    it), collected as one family. So a table without a schema exposes exactly the series it
    did before tables in schemas had labels of their own.
    """

    def __init__(self) -> None:
        self.pairs: list[tuple[Any, Any]] = []

    def add(
        self, kind: Any, name: str, doc: str, labels: Sequence[str], **kw: Any
    ) -> tuple[Callable[..., Any], Any]:
        """A metric named ``name`` with ``labels`` (``queue`` first), and its twin with
        ``table`` after ``queue``. Returns ``series(queue, *values)``, which picks the series
        of a queue, and the metric without the label."""
        plain = kind(name, doc, list(labels), registry=None, **kw)
        placed = [labels[0], "table", *labels[1:]]
        qualified = kind(name, doc, placed, registry=None, **kw)
        self.pairs.append((plain, qualified))

        def series(queue: str, *values: str) -> Any:
            table = _queue_table(queue)
            if table:
                return qualified.labels(queue, table, *values)
            return plain.labels(queue, *values)

        return series, plain

    def describe(self) -> Iterator[Metric]:
        for plain, _ in self.pairs:
            yield from plain.describe()

    def collect(self) -> Iterator[Metric]:
        for plain, qualified in self.pairs:
            [family] = plain.collect()
            [more] = qualified.collect()
            family.samples = [*family.samples, *more.samples]
            yield family


class PrometheusHooks(WorkerHooks):
    """Worker events as Prometheus counters and histograms (labels: ``queue``, ``outcome``,
    and ``table`` for a queue whose table is in a schema).

    ``delayedq_processed_total``, ``delayedq_failed_total``, ``delayedq_dead_total``,
    ``delayedq_redelivered_total``, ``delayedq_db_errors_total{error}``,
    ``delayedq_handler_duration_seconds{queue,outcome}`` (outcome ``ok`` or ``failed``) and
    ``delayedq_pickup_lag_seconds{queue}``. The series of a queue whose table is in a schema
    also carry ``table="schema.name"``, so a worker serving the same queue name in two tenants'
    tables reports each apart; a table without a schema has no ``table`` label (its series are
    those of before).
    """

    def __init__(
        self, registry: CollectorRegistry | None = None, *, namespace: str = "delayedq"
    ) -> None:
        from prometheus_client import REGISTRY, Counter, Histogram

        reg = REGISTRY if registry is None else registry
        self._clock = _HandlerClock()
        families = _Families()
        q = ["queue"]

        def metric(
            kind: Any, name: str, doc: str, labels: list[str], **kw: Any
        ) -> tuple[Callable[..., Any], Any]:
            return families.add(kind, name, doc, labels, namespace=namespace, **kw)

        # The attributes ending in _total, _duration and _lag: the series without ``table``.
        self._processed, self.processed_total = metric(
            Counter, "processed", "Messages handled and acknowledged", q
        )
        self._failed, self.failed_total = metric(
            Counter, "failed", "Handler failures (retried or dead)", q
        )
        self._dead, self.dead_total = metric(
            Counter, "dead", "Messages that died after their last attempt (or buried by a take)", q
        )
        self._redelivered, self.redelivered_total = metric(
            Counter, "redelivered", "Messages taken again after a lease ran out", q
        )
        self._duration, self.handler_duration = metric(
            Histogram,
            "handler_duration_seconds",
            "Handler run time",
            ["queue", "outcome"],
            buckets=DURATION_BUCKETS,
        )
        self._lag, self.pickup_lag = metric(
            Histogram,
            "pickup_lag_seconds",
            "How late messages were taken after they became due",
            q,
            buckets=LAG_BUCKETS,
        )
        reg.register(families)
        self.db_errors_total = Counter(
            "db_errors",
            "Database errors in the worker (retried)",
            ["error"],
            namespace=namespace,
            registry=reg,
        )

    @_guarded
    def processed(self, queue: str, envelope: Envelope[Any], seconds: float) -> None:
        self._clock.stop()
        self._processed(queue).inc()
        self._duration(queue, "ok").observe(seconds)

    @_guarded
    def failed(
        self, queue: str, envelope: Envelope[Any], error: BaseException, outcome: NackOutcome
    ) -> None:
        seconds = self._clock.stop(error)
        self._failed(queue).inc()
        if outcome is NackOutcome.DEAD:
            self._dead(queue).inc()
        if seconds is not None:
            self._duration(queue, "failed").observe(seconds)

    @_guarded
    def redelivered(self, queue: str, envelope: Envelope[Any]) -> None:
        self._redelivered(queue).inc()

    @_guarded
    def buried(self, queue: str, buried: Buried) -> None:
        self._dead(queue).inc()

    @_guarded
    def lag(self, queue: str, seconds: float) -> None:
        self._clock.start()
        self._lag(queue).observe(max(0.0, seconds))

    @_guarded
    def db_error(self, error: BaseException) -> None:
        self.db_errors_total.labels(type(error).__name__).inc()


class OtelHooks(WorkerHooks):
    """Worker events as OpenTelemetry instruments (attributes: ``queue``, ``outcome``, and
    ``table``, ``schema.name``, for a queue whose table is in a schema).

    Counters ``delayedq.messages.processed``, ``.failed``, ``.dead``, ``.redelivered`` and
    ``delayedq.db.errors``; histograms ``delayedq.handler.duration`` and ``delayedq.pickup.lag``
    (seconds).
    """

    def __init__(self, meter: Meter | None = None) -> None:
        from opentelemetry import metrics

        m = meter or metrics.get_meter(INSTRUMENTATION, _version())
        self._clock = _HandlerClock()
        unit = "{message}"
        self.processed_counter = m.create_counter("delayedq.messages.processed", unit)
        self.failed_counter = m.create_counter("delayedq.messages.failed", unit)
        self.dead_counter = m.create_counter("delayedq.messages.dead", unit)
        self.redelivered_counter = m.create_counter("delayedq.messages.redelivered", unit)
        self.db_errors_counter = m.create_counter("delayedq.db.errors", "{error}")
        self.duration = m.create_histogram("delayedq.handler.duration", "s", "Handler run time")
        self.pickup_lag = m.create_histogram(
            "delayedq.pickup.lag", "s", "How late messages were taken after they became due"
        )

    @_guarded
    def processed(self, queue: str, envelope: Envelope[Any], seconds: float) -> None:
        self._clock.stop()
        self.processed_counter.add(1, _attributes(queue))
        self.duration.record(seconds, _attributes(queue, outcome="ok"))

    @_guarded
    def failed(
        self, queue: str, envelope: Envelope[Any], error: BaseException, outcome: NackOutcome
    ) -> None:
        seconds = self._clock.stop(error)
        self.failed_counter.add(1, _attributes(queue))
        if outcome is NackOutcome.DEAD:
            self.dead_counter.add(1, _attributes(queue))
        if seconds is not None:
            self.duration.record(seconds, _attributes(queue, outcome="failed"))

    @_guarded
    def redelivered(self, queue: str, envelope: Envelope[Any]) -> None:
        self.redelivered_counter.add(1, _attributes(queue))

    @_guarded
    def buried(self, queue: str, buried: Buried) -> None:
        self.dead_counter.add(1, _attributes(queue))

    @_guarded
    def lag(self, queue: str, seconds: float) -> None:
        self._clock.start()
        self.pickup_lag.record(max(0.0, seconds), _attributes(queue))

    @_guarded
    def db_error(self, error: BaseException) -> None:
        self.db_errors_counter.add(1, {"error": type(error).__name__})


# -- depth and lag -----------------------------------------------------------------------------


class StatsCache:
    """Queue stats read at most once per ``min_interval`` seconds, shared by collectors.

    :param sessions: a sessionmaker (or any callable returning a Session) for the database.
    :param table: the message table; the default ``delayed_queue`` when None.
    :param queues: the queues to report; every queue in the table when None.
    :param at_most: each count reads at most ``at_most + 1`` rows; a count above it is reported
        as ``at_most`` with its state in ``QueueStats.capped`` ("at least"). None: exact
        counts, which read the whole backlog.
    :param max_read_share: the largest share of wall time spent reading: after a read of
        ``d`` seconds the next waits ``d / max_read_share`` seconds when that is longer than
        ``min_interval`` (with 0.01, a read of 0.2 s makes the next wait 20 s). None: only
        ``min_interval``.
    :param clock: seconds on a monotonic clock (tests pass a manual one).
    """

    def __init__(
        self,
        sessions: SessionFactory,
        *,
        table: Table | None = None,
        queues: Sequence[str] | None = None,
        min_interval: float = 10.0,
        at_most: int | None = DEFAULT_AT_MOST,
        max_read_share: float | None = DEFAULT_READ_SHARE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_read_share is not None and not 0 < max_read_share <= 1:
            raise InvalidArgument(f"max_read_share must be in (0, 1] or None, got {max_read_share}")
        self.sessions = sessions
        self.table: Table = table if table is not None else DelayedMessage.__table__  # type: ignore[assignment]
        self.queues = None if queues is None else list(check_strings(queues, "queues"))
        self.min_interval = min_interval
        self.at_most = at_most
        self.max_read_share = max_read_share
        self.clock = clock
        self._lock = threading.Lock()
        self._read_at = -float("inf")
        self._stats: list[QueueStats] = []
        self._ok = False
        self._seconds = 0.0

    @property
    def interval(self) -> float:
        """Seconds from the end of one read to the next: ``min_interval``, or longer after a
        slow read (see ``max_read_share``)."""
        if self.max_read_share is None:
            return self.min_interval
        return max(self.min_interval, self._seconds / self.max_read_share)

    def get(self) -> tuple[list[QueueStats], bool, float]:
        """(the stats, whether the last read worked, how long it took in seconds)."""
        with self._lock:
            if self.clock() - self._read_at >= self.interval:
                started = self.clock()
                try:
                    with self.sessions() as s:
                        self._stats = queue_stats(
                            s,
                            self.table,
                            datetime.now(UTC),
                            self.queues,
                            include_missing=self.queues is not None,
                            at_most=self.at_most,
                        )
                    self._ok = True
                except Exception:
                    log.exception("reading queue stats failed")
                    self._ok = False
                self._read_at = self.clock()
                self._seconds = self._read_at - started
            return list(self._stats), self._ok, self._seconds


def _caches(
    sessions: SessionFactory | StatsCache | Sequence[StatsCache],
    table: Table | None,
    queues: Sequence[str] | None,
    min_interval: float,
    at_most: int | None,
) -> list[StatsCache]:
    """The caches a collector reads: those given, or one it makes. Each table once, or its
    series would be reported twice."""
    if isinstance(sessions, StatsCache):
        caches = [sessions]
    elif isinstance(sessions, Sequence):
        caches = list(sessions)
        if not caches or not all(isinstance(c, StatsCache) for c in caches):
            raise InvalidArgument("give a sessionmaker, a StatsCache or a list of StatsCaches")
    else:
        return [
            StatsCache(
                sessions, table=table, queues=queues, min_interval=min_interval, at_most=at_most
            )
        ]
    keys = [table_key(c.table) for c in caches]
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:
        raise InvalidArgument(f"two StatsCaches read table {twice[0]!r}: give each table once")
    return caches


class QueueStatsCollector:
    """A Prometheus collector for queue depth and lag, read from the table at scrape time.

    ``delayedq_messages{queue,state}``, ``delayedq_messages_capped{queue,state}`` (1 when that
    count stopped at the cap, ``at_most``: there are at least that many),
    ``delayedq_oldest_due_lag_seconds{queue}`` (0 when nothing is due), ``delayedq_stats_up`` (0
    when the last read failed) and ``delayedq_stats_duration_seconds``. After a failed read the
    last good values are kept. See :class:`StatsCache` for ``min_interval`` and ``at_most``.

    The series of a table in a schema also carry ``table="schema.name"``; a table without a
    schema has no ``table`` label (its series are those of before). To report several tables
    (one per tenant, in their schemas) from one registry, give a list of :class:`StatsCache`,
    one per table: one collector reports them all (``stats_up`` is 0 when a read of any
    failed, the duration is their sum), since two collectors of the same metrics cannot share
    a registry. Among them, tables without a schema carry ``table="name"`` too when there are
    two or more, so that queues of one name in two of them are two series, not one twice.
    """

    def __init__(
        self,
        sessions: SessionFactory | StatsCache | Sequence[StatsCache],
        *,
        table: Table | None = None,
        queues: Sequence[str] | None = None,
        min_interval: float = 10.0,
        at_most: int | None = DEFAULT_AT_MOST,
        namespace: str = "delayedq",
    ) -> None:
        self.caches = _caches(sessions, table, queues, min_interval, at_most)
        #: The first (usually the only) cache.
        self.cache = self.caches[0]
        self.namespace = namespace

    def register(self, registry: CollectorRegistry | None = None) -> QueueStatsCollector:
        from prometheus_client import REGISTRY

        (REGISTRY if registry is None else registry).register(self)
        return self

    def _families(self) -> tuple[Any, Any, Any, Any, Any]:
        from prometheus_client.core import GaugeMetricFamily

        n = self.namespace
        return (
            GaugeMetricFamily(
                f"{n}_messages", "Messages by queue and state", labels=["queue", "state"]
            ),
            GaugeMetricFamily(
                f"{n}_messages_capped",
                "1 when the count of messages stopped at the cap: there are at least that many",
                labels=["queue", "state"],
            ),
            GaugeMetricFamily(
                f"{n}_oldest_due_lag_seconds", "Lag of the oldest due message", labels=["queue"]
            ),
            GaugeMetricFamily(f"{n}_stats_up", "Whether the last stats query worked"),
            GaugeMetricFamily(f"{n}_stats_duration_seconds", "Time of the last stats query"),
        )

    def describe(self) -> Iterator[Metric]:
        """The metric names, without a query (so registering does not touch the database)."""
        yield from self._families()

    def collect(self) -> Iterator[Metric]:
        depth, capped, lag, up, duration = self._families()
        all_ok, total = True, 0.0
        for cache, table in zip(self.caches, _table_labels(self.caches), strict=True):
            stats, ok, seconds = cache.get()
            all_ok, total = all_ok and ok, total + seconds
            for q in stats:
                where = {"queue": q.queue, **({"table": table} if table else {})}
                for state in STATES:
                    at = {**where, "state": state}
                    depth.add_sample(depth.name, at, getattr(q, state))
                    capped.add_sample(capped.name, at, 1.0 if state in q.capped else 0.0)
                lag.add_sample(lag.name, where, q.lag_seconds)
        up.add_metric([], 1.0 if all_ok else 0.0)
        duration.add_metric([], total)
        yield from (depth, capped, lag, up, duration)


class HealthCollector:
    """A Prometheus collector for what :mod:`sqla_delayedq.doctor` diagnoses, at most once per
    ``min_interval`` seconds (catalog queries; no scan of the table).

    ``delayedq_horizon_age_seconds`` (how long the oldest transaction holding the vacuum horizon
    has been open; 0 when none), ``delayedq_horizon_holders``, ``delayedq_dead_rows{table}`` and
    ``delayedq_live_rows{table}`` (PostgreSQL's statistics), ``delayedq_innodb_history_length``
    (MariaDB/MySQL). Alert on the first: a queue slows down as it grows.
    """

    def __init__(
        self,
        engine: Any,
        tables: Sequence[str] = ("delayed_queue",),
        *,
        min_interval: float = 30.0,
        namespace: str = "delayedq",
    ) -> None:
        self.engine = engine
        self.tables = list(check_strings(tables, "tables"))
        self.min_interval = min_interval
        self.namespace = namespace
        self._lock = threading.Lock()
        self._read_at = -float("inf")
        self._found: Any = None

    def register(self, registry: CollectorRegistry | None = None) -> HealthCollector:
        from prometheus_client import REGISTRY

        (REGISTRY if registry is None else registry).register(self)
        return self

    def _diagnosis(self) -> Any:
        from .doctor import diagnose

        with self._lock:
            if time.monotonic() - self._read_at >= self.min_interval:
                try:
                    with self.engine.connect() as conn:
                        self._found = diagnose(conn, self.tables, threshold=0)
                except Exception:
                    log.exception("reading database health failed")
                self._read_at = time.monotonic()
            return self._found

    def _families(self) -> list[Any]:
        from prometheus_client.core import GaugeMetricFamily

        n = self.namespace
        return [
            GaugeMetricFamily(
                f"{n}_horizon_age_seconds",
                "How long the oldest transaction holding the vacuum horizon has been open",
            ),
            GaugeMetricFamily(f"{n}_horizon_holders", "Sessions, slots and prepared transactions"),
            GaugeMetricFamily(f"{n}_dead_rows", "Dead rows of a message table", labels=["table"]),
            GaugeMetricFamily(f"{n}_live_rows", "Live rows of a message table", labels=["table"]),
            GaugeMetricFamily(f"{n}_innodb_history_length", "InnoDB undo history not purged"),
        ]

    def describe(self) -> Iterator[Metric]:
        yield from self._families()

    def collect(self) -> Iterator[Metric]:
        age, holders, dead, live, history = self._families()
        found = self._diagnosis()
        if found is None:
            return
        age.add_metric([], found.horizon_age_seconds)
        holders.add_metric([], len(found.holders))
        for t in found.tables:
            dead.add_metric([t.table], t.dead_rows)
            live.add_metric([t.table], t.live_rows)
        yield from (age, holders, dead, live)
        if found.history_length is not None:
            history.add_metric([], found.history_length)
            yield history


def serve_prometheus(
    port: int,
    sessions: SessionFactory,
    *,
    addr: str = "0.0.0.0",
    table: Table | None = None,
    queues: Sequence[str] | None = None,
    registry: CollectorRegistry | None = None,
    at_most: int | None = DEFAULT_AT_MOST,
) -> PrometheusHooks:
    """Register the depth/lag collector (counts bounded by ``at_most``, see
    :class:`StatsCache`), serve ``/metrics`` on ``port`` (0: a free port, logged), return
    worker hooks. A port that cannot be bound raises :class:`OSError`, registering nothing."""
    from prometheus_client import REGISTRY, start_http_server

    reg = REGISTRY if registry is None else registry
    collector = QueueStatsCollector(sessions, table=table, queues=queues, at_most=at_most)
    collector.register(reg)
    try:
        server, _ = start_http_server(port, addr, registry=reg)
    except BaseException:
        reg.unregister(collector)
        raise
    log.info("serving Prometheus metrics on %s:%d", addr, server.server_port)
    return PrometheusHooks(reg)


def observe_queues(
    sessions: SessionFactory | StatsCache | Sequence[StatsCache],
    *,
    meter: Meter | None = None,
    table: Table | None = None,
    queues: Sequence[str] | None = None,
    min_interval: float = 10.0,
    at_most: int | None = DEFAULT_AT_MOST,
) -> StatsCache:
    """OpenTelemetry observable gauges ``delayedq.queue.depth`` {queue, state},
    ``delayedq.queue.depth.capped`` {queue, state} (1 when that count stopped at ``at_most``:
    there are at least that many) and ``delayedq.queue.lag`` {queue} (seconds), read from the
    table when the reader collects (see :class:`StatsCache`). A table in a schema adds the
    attribute ``table`` (``schema.name``); a list of :class:`StatsCache`, one per table, reports
    several tables through one set of instruments (and tables without a schema get ``table``
    too when there are two or more of them, as in :class:`QueueStatsCollector`). Returns the
    (first) cache."""
    from opentelemetry import metrics
    from opentelemetry.metrics import Observation

    caches = _caches(sessions, table, queues, min_interval, at_most)
    m = meter or metrics.get_meter(INSTRUMENTATION, _version())

    labels = _table_labels(caches)

    def read() -> Iterator[tuple[QueueStats, dict[str, str]]]:
        for cache, label in zip(caches, labels, strict=True):
            stats, _, _ = cache.get()
            for q in stats:
                yield q, ({"queue": q.queue, "table": label} if label else {"queue": q.queue})

    def depth(_options: CallbackOptions) -> Iterable[Observation]:
        return [
            Observation(getattr(q, state), {**attrs, "state": state})
            for q, attrs in read()
            for state in STATES
        ]

    def capped(_options: CallbackOptions) -> Iterable[Observation]:
        return [
            Observation(1 if state in q.capped else 0, {**attrs, "state": state})
            for q, attrs in read()
            for state in STATES
        ]

    def lag(_options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(q.lag_seconds, attrs) for q, attrs in read()]

    m.create_observable_gauge(
        "delayedq.queue.depth", [depth], "{message}", "Messages by queue and state"
    )
    m.create_observable_gauge(
        "delayedq.queue.depth.capped",
        [capped],
        "1",
        "1 when the count of messages stopped at the cap: there are at least that many",
    )
    m.create_observable_gauge("delayedq.queue.lag", [lag], "s", "Lag of the oldest due message")
    return caches[0]


# -- traces ------------------------------------------------------------------------------------


def _span_attributes(queue: str, key: str | None = None) -> dict[str, Any]:
    attrs: dict[str, Any] = {
        "messaging.system": INSTRUMENTATION,
        "messaging.destination.name": queue,
    }
    if key is not None:
        attrs["messaging.message.id"] = key
    return attrs


def traced_handler(handler: Handler, *, tracer: Tracer | None = None) -> Handler:
    """``handler`` inside a ``process <queue>`` consumer span (exceptions recorded).

    The span continues the trace stored with the message by an instrumented offer
    (:func:`instrument_queue`), in this process or any other. Works for both modes (the envelope
    is the first argument), for batch handlers (the list of envelopes: one span, linked to the
    trace of each message, as the messaging conventions ask for a batch) and for both kinds of
    handler: an ``async def`` handler gets an ``async def`` wrapper whose span covers the
    awaited work.
    """
    from opentelemetry import propagate, trace

    t = tracer or trace.get_tracer(INSTRUMENTATION, _version())

    def sent(envelope: Envelope[Any]) -> Any:
        """The offer's context stored with ``envelope`` and its span context, or Nones."""
        if not envelope.headers:
            return None, None
        parent = propagate.extract(envelope.headers)
        context = trace.get_current_span(parent).get_span_context()
        return parent, context if context.is_valid else None

    def span(arg: Envelope[Any] | list[Envelope[Any]]) -> Any:
        if isinstance(arg, list):
            return batch_span(arg)
        envelope = arg
        attrs = _span_attributes(envelope.queue, envelope.key)
        attrs["messaging.operation.type"] = "process"
        attrs["delayedq.attempt"] = envelope.attempt
        attrs["delayedq.delivery"] = envelope.delivery.value
        # The offer's trace context, when it stored one: this attempt continues its trace (a
        # child of the send span, which it also links to, as the messaging conventions ask).
        parent, context = sent(envelope)
        return t.start_as_current_span(
            f"process {envelope.queue}",
            context=parent,
            kind=trace.SpanKind.CONSUMER,
            attributes=attrs,
            links=None if context is None else [trace.Link(context)],
        )

    def batch_span(envelopes: list[Envelope[Any]]) -> Any:
        # Messages of many traces: the span starts its own, linked to each message's send span.
        queue = envelopes[0].queue if envelopes else ""
        attrs = _span_attributes(queue)
        attrs["messaging.operation.type"] = "process"
        attrs["messaging.batch.message_count"] = len(envelopes)
        contexts = [sent(envelope)[1] for envelope in envelopes]
        return t.start_as_current_span(
            f"process {queue}",
            kind=trace.SpanKind.CONSUMER,
            attributes=attrs,
            links=[trace.Link(context) for context in contexts if context is not None],
        )

    if is_async_callable(handler):

        @functools.wraps(handler)
        async def traced_async(envelope: Any, *args: Any, **kwargs: Any) -> Any:
            with span(envelope):
                return await handler(envelope, *args, **kwargs)

        return traced_async

    @functools.wraps(handler)
    def traced(envelope: Any, *args: Any, **kwargs: Any) -> Any:
        with span(envelope):
            return handler(envelope, *args, **kwargs)

    return traced


def _carrier(headers: Mapping[str, str] | None) -> dict[str, str]:
    """A copy of an offer's ``headers`` for the trace context to go in, checked as the queue
    checks them (the copy would accept a list of pairs, say, that the queue refuses)."""
    encode_headers(headers)
    return dict(headers or {})


def instrument_queue(queue: Q, *, tracer: Tracer | None = None) -> Q:
    """Wrap ``queue.offer`` and ``queue.offer_batch`` in ``send <queue>`` producer spans, and
    store the span's trace context with each message (in its headers, by the global propagator:
    W3C ``traceparent`` by default), for :func:`traced_handler` to continue.

    Returns the same queue object; calling it twice does not wrap twice. An
    :class:`~sqla_delayedq.aio.AsyncQueue` over the queue offers through it too.
    """
    from opentelemetry import propagate, trace

    if getattr(queue, "_delayedq_traced", False):
        return queue
    t = tracer or trace.get_tracer(INSTRUMENTATION, _version())
    offer, offer_batch = queue.offer, queue.offer_batch
    name = f"send {queue.name}"

    @functools.wraps(offer)
    def traced_offer(
        session: Session,
        key: str | None,
        payload: Any,
        at: datetime | None = None,
        *,
        mode: OfferMode | str = OfferMode.REPLACE,
        headers: Mapping[str, str] | None = None,
        **kwargs: Any,
    ) -> OfferResult:
        attrs = _span_attributes(queue.name, key)
        attrs["messaging.operation.type"] = "send"
        with t.start_as_current_span(name, kind=trace.SpanKind.PRODUCER, attributes=attrs) as span:
            carrier = _carrier(headers)
            propagate.inject(carrier)
            result = offer(session, key, payload, at, mode=mode, headers=carrier, **kwargs)
            span.set_attribute("messaging.message.id", result.key)
            span.set_attribute("delayedq.outcome", result.outcome.value)
            return result

    @functools.wraps(offer_batch)
    def traced_offer_batch(
        session: Session,
        messages: Iterable[Any],
        *,
        headers: Mapping[str, str] | None = None,
        **kwargs: Any,
    ) -> Any:
        items = list(messages)
        attrs = _span_attributes(queue.name)
        attrs["messaging.operation.type"] = "send"
        attrs["messaging.batch.message_count"] = len(items)
        with t.start_as_current_span(name, kind=trace.SpanKind.PRODUCER, attributes=attrs) as span:
            carrier = _carrier(headers)
            propagate.inject(carrier)
            results: list[OfferResult] = offer_batch(session, items, headers=carrier, **kwargs)
            for outcome in ("created", "updated", "ignored"):
                count = sum(1 for r in results if r.outcome.value == outcome)
                span.set_attribute(f"delayedq.{outcome}", count)
            return results

    setattr(queue, "offer", traced_offer)  # noqa: B010
    setattr(queue, "offer_batch", traced_offer_batch)  # noqa: B010
    setattr(queue, "_delayedq_traced", True)  # noqa: B010
    return queue
