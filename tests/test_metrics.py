"""Metrics and traces: Prometheus hooks and collector, OpenTelemetry hooks, gauges and spans.

The hooks are checked event by event and through a real :class:`Worker`; the depth and lag
collectors against a seeded table on PostgreSQL and SQLite; the exporter over HTTP, from the
``delayedq worker --metrics-port`` command itself.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.orm import Session

from sqla_delayedq import (
    Buried,
    DelayedQueue,
    Delivery,
    Envelope,
    ExponentialBackoff,
    NackOutcome,
    Outcome,
)
from sqla_delayedq.errors import InvalidArgument
from sqla_delayedq.metrics import (
    CompositeHooks,
    OtelHooks,
    PrometheusHooks,
    QueueStatsCollector,
    StatsCache,
    instrument_queue,
    observe_queues,
    serve_prometheus,
    traced_handler,
)
from sqla_delayedq.worker import QueueName, Worker, WorkerHooks
from tests.fix_db import Backend

prometheus_client = pytest.importorskip("prometheus_client")
pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.metrics import MeterProvider  # noqa: E402
from opentelemetry.sdk.metrics.export import InMemoryMetricReader  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)
from opentelemetry.trace import SpanKind, StatusCode  # noqa: E402
from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
on_pg_and_sqlite = pytest.mark.parametrize("backend", ["sqlite", "postgresql"], indirect=True)


def envelope(
    key: str = "k", queue: str = "q", delivery: Delivery = Delivery.FIRST
) -> Envelope[Any]:
    now = datetime.now(UTC)
    return Envelope(
        id=1,
        queue=queue,
        key=key,
        payload={},
        scheduled_at=now,
        scheduled_at_initially=now,
        created_at=now,
        delivery=delivery,
        attempt=1,
        lock_token="t",
        lease_until=now + timedelta(minutes=5),
    )


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    value: float | None = registry.get_sample_value(name, labels)
    return value


def seed(backend: Backend) -> None:
    """emails: 2 due (the oldest 60 s late), 1 scheduled, 1 in flight, 1 dead."""
    now = datetime.now(UTC)
    q: DelayedQueue[Any] = DelayedQueue("emails", retry=ExponentialBackoff(max_attempts=1))
    with backend.Session() as s, s.begin():
        q.offer(s, "dead", {}, now - timedelta(seconds=300))
        q.offer(s, "flight", {}, now - timedelta(seconds=200))
    with backend.Session() as s, s.begin():
        dead, _flight = q.try_poll_many(s, 2, lease=timedelta(hours=1))
        q.nack(s, dead, "boom")
    with backend.Session() as s, s.begin():
        q.offer(s, "a", {}, now - timedelta(seconds=60))
        q.offer(s, "b", {}, now - timedelta(seconds=1))
        q.offer(s, "c", {}, now + timedelta(hours=1))


# -- Prometheus hooks --------------------------------------------------------------------------


def test_prometheus_hooks_count_worker_events() -> None:
    registry = CollectorRegistry()
    hooks = PrometheusHooks(registry)
    hooks.lag("q", 2.0)
    hooks.processed("q", envelope(), 0.25)
    hooks.lag("q", 0.5)
    hooks.failed("q", envelope(), RuntimeError("x"), NackOutcome.RETRY_SCHEDULED)
    hooks.lag("q", 0.5)
    hooks.failed("q", envelope(), RuntimeError("x"), NackOutcome.DEAD)
    hooks.redelivered("q", envelope(delivery=Delivery.REDELIVERY))
    hooks.db_error(ConnectionError("gone"))
    assert sample(registry, "delayedq_processed_total", queue="q") == 1
    assert sample(registry, "delayedq_failed_total", queue="q") == 2
    assert sample(registry, "delayedq_dead_total", queue="q") == 1
    assert sample(registry, "delayedq_redelivered_total", queue="q") == 1
    assert sample(registry, "delayedq_db_errors_total", error="ConnectionError") == 1
    ok = {"queue": "q", "outcome": "ok"}
    assert sample(registry, "delayedq_handler_duration_seconds_count", **ok) == 1
    assert sample(registry, "delayedq_handler_duration_seconds_sum", **ok) == 0.25
    failed = {"queue": "q", "outcome": "failed"}
    assert sample(registry, "delayedq_handler_duration_seconds_count", **failed) == 2
    assert sample(registry, "delayedq_pickup_lag_seconds_count", queue="q") == 3
    assert sample(registry, "delayedq_pickup_lag_seconds_sum", queue="q") == 3.0


def test_each_failed_message_of_a_batch_records_its_duration(
    backend: Backend, meter_provider: MeterProvider, reader: InMemoryMetricReader
) -> None:
    """A failed batch of 5 counted 5 failures and one failed duration: the first ``failed``
    took the handler's start, the other four found none. Each message records the batch's."""
    registry = CollectorRegistry()
    q: DelayedQueue[Any] = DelayedQueue("bad", retry=ExponentialBackoff(max_attempts=1))
    with backend.Session.begin() as s:
        q.offer_batch(s, [(f"k{i}", {}) for i in range(5)])
    handled: list[str] = []

    def fail(envs: list[Envelope[Any]]) -> None:
        handled.extend(e.key for e in envs)
        raise ValueError("batch failed")

    worker = Worker(backend.Session, listen=False, hooks=PrometheusHooks(registry))
    worker.add_hooks(OtelHooks(meter_provider.get_meter("test")))
    worker.register_batch(q, fail, batch_size=5)
    worker.process_due()
    assert sorted(handled) == [f"k{i}" for i in range(5)]
    assert sample(registry, "delayedq_failed_total", queue="bad") == 5
    failed = {"queue": "bad", "outcome": "failed"}
    assert sample(registry, "delayedq_handler_duration_seconds_count", **failed) == 5
    found = points(reader)
    assert sum(p.value for p in found["delayedq.messages.failed"]) == 5
    (duration,) = found["delayedq.handler.duration"]
    assert duration.attributes["outcome"] == "failed" and duration.count == 5


def test_prometheus_hooks_label_the_table_of_a_queue_in_a_schema_only() -> None:
    """Two tenants' queues of one name are two series, each with ``table``; a table without a
    schema keeps its series as they were, without the label."""
    registry = CollectorRegistry()
    hooks = PrometheusHooks(registry)
    tenant_a = QueueName("emails", "tenant_a.jobs", "tenant_a")
    for queue in (tenant_a, tenant_a, QueueName("emails", "tenant_b.jobs", "tenant_b")):
        hooks.lag(queue, 1.0)
        hooks.processed(queue, envelope(), 0.1)
    hooks.lag(QueueName("emails", "jobs", None), 1.0)
    hooks.failed(QueueName("emails", "jobs", None), envelope(), RuntimeError(), NackOutcome.DEAD)
    assert sample(registry, "delayedq_processed_total", queue="emails", table="tenant_a.jobs") == 2
    assert sample(registry, "delayedq_processed_total", queue="emails", table="tenant_b.jobs") == 1
    assert sample(registry, "delayedq_processed_total", queue="emails") is None
    assert sample(registry, "delayedq_dead_total", queue="emails") == 1
    ok = {"queue": "emails", "table": "tenant_a.jobs", "outcome": "ok"}
    assert sample(registry, "delayedq_handler_duration_seconds_count", **ok) == 2
    failed = {"queue": "emails", "outcome": "failed"}
    assert sample(registry, "delayedq_handler_duration_seconds_count", **failed) == 1
    text = generate_latest(registry).decode().splitlines()
    assert 'delayedq_dead_total{queue="emails"} 1.0' in text
    assert 'delayedq_processed_total{queue="emails",table="tenant_b.jobs"} 1.0' in text


def test_a_failure_without_a_start_records_no_duration() -> None:
    registry = CollectorRegistry()
    hooks = PrometheusHooks(registry)
    hooks.failed("q", envelope(), RuntimeError("x"), NackOutcome.STALE)
    assert sample(registry, "delayedq_failed_total", queue="q") == 1
    failed = {"queue": "q", "outcome": "failed"}
    assert sample(registry, "delayedq_handler_duration_seconds_count", **failed) is None


def test_failed_durations_are_timed_per_asyncio_consumer() -> None:
    """An ``AsyncWorker``'s consumers are tasks on one thread: the start of each handler was
    kept per thread, so each ``lag`` overwrote another consumer's and each failure cleared it
    (3 failures of 0.25 s and more recorded one duration of 0.07 s; found in review)."""
    import asyncio

    registry = CollectorRegistry()
    hooks = PrometheusHooks(registry)

    async def consumer(delay: float) -> None:
        hooks.lag("q", 0.0)
        await asyncio.sleep(delay)
        hooks.failed("q", envelope(), RuntimeError("x"), NackOutcome.RETRY_SCHEDULED)

    async def main() -> None:
        await asyncio.gather(consumer(0.2), consumer(0.25), consumer(0.3))

    asyncio.run(main())
    failed = {"queue": "q", "outcome": "failed"}
    assert sample(registry, "delayedq_handler_duration_seconds_count", **failed) == 3
    total = sample(registry, "delayedq_handler_duration_seconds_sum", **failed)
    assert total is not None and total >= 0.75


class Exploding(WorkerHooks):
    def processed(self, queue: str, envelope: Envelope[Any], seconds: float) -> None:
        raise RuntimeError("metrics backend down")


def test_composite_hooks_fan_out_and_never_raise() -> None:
    registry = CollectorRegistry()
    hooks = CompositeHooks(Exploding(), PrometheusHooks(registry))
    hooks.lag("q", 1.0)
    hooks.processed("q", envelope(), 0.1)
    assert sample(registry, "delayedq_processed_total", queue="q") == 1


@on_pg_and_sqlite
def test_prometheus_hooks_on_a_running_worker(backend: Backend) -> None:
    registry = CollectorRegistry()
    q: DelayedQueue[Any] = DelayedQueue("jobs", retry=ExponentialBackoff(max_attempts=1))
    with backend.Session() as s, s.begin():
        for key in ("ok-1", "ok-2", "ok-3", "bad"):
            q.offer(s, key, {"key": key})
    handled: list[str] = []

    def handler(env: Envelope[Any]) -> None:
        handled.append(env.key)
        if env.key == "bad":
            raise ValueError("bad message")

    worker = Worker(
        backend.Session, concurrency=2, poll_interval=0.1, hooks=PrometheusHooks(registry)
    )
    worker.register(q, handler)
    worker.start()
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            done = (sample(registry, "delayedq_processed_total", queue="jobs") or 0) + (
                sample(registry, "delayedq_failed_total", queue="jobs") or 0
            )
            if done == 4:
                break
            time.sleep(0.05)
    finally:
        worker.stop()
    assert sorted(handled) == ["bad", "ok-1", "ok-2", "ok-3"]
    assert sample(registry, "delayedq_processed_total", queue="jobs") == 3
    assert sample(registry, "delayedq_dead_total", queue="jobs") == 1
    failed = {"queue": "jobs", "outcome": "failed"}
    assert sample(registry, "delayedq_handler_duration_seconds_count", **failed) == 1
    assert sample(registry, "delayedq_pickup_lag_seconds_count", queue="jobs") == 4


# -- Prometheus collector ----------------------------------------------------------------------


@on_pg_and_sqlite
def test_collector_reports_depth_and_lag(backend: Backend) -> None:
    seed(backend)
    registry = CollectorRegistry()
    QueueStatsCollector(backend.Session, min_interval=0).register(registry)
    depth = {
        state: sample(registry, "delayedq_messages", queue="emails", state=state)
        for state in ("due", "scheduled", "in_flight", "dead", "done")
    }
    assert depth == {"due": 2, "scheduled": 1, "in_flight": 1, "dead": 1, "done": 0}
    lag = sample(registry, "delayedq_oldest_due_lag_seconds", queue="emails")
    assert lag is not None and 60 <= lag < 600
    assert sample(registry, "delayedq_stats_up") == 1
    duration = sample(registry, "delayedq_stats_duration_seconds")
    assert duration is not None and duration > 0


@on_pg_and_sqlite
def test_collector_caches_between_scrapes(backend: Backend) -> None:
    seed(backend)
    registry = CollectorRegistry()
    collector = QueueStatsCollector(backend.Session, min_interval=3600).register(registry)
    assert sample(registry, "delayedq_messages", queue="emails", state="due") == 2
    with backend.Session() as s, s.begin():
        DelayedQueue[Any]("emails").offer(s, "d", {})
    assert sample(registry, "delayedq_messages", queue="emails", state="due") == 2
    collector.cache.min_interval = 0
    collector.cache.max_read_share = None  # no wait after the last read's duration either
    assert sample(registry, "delayedq_messages", queue="emails", state="due") == 3


@on_pg_and_sqlite
def test_collector_of_named_queues_reports_empty_ones_as_zero(backend: Backend) -> None:
    seed(backend)
    registry = CollectorRegistry()
    QueueStatsCollector(backend.Session, queues=["idle"], min_interval=0).register(registry)
    assert sample(registry, "delayedq_messages", queue="idle", state="due") == 0
    assert sample(registry, "delayedq_messages", queue="emails", state="due") is None


def test_a_lone_name_is_refused_not_split_into_letters() -> None:
    """``queues="emails"`` was read as the queues ``e``, ``m``, ``a``... and reported zeros."""
    from sqla_delayedq.doctor import diagnose
    from sqla_delayedq.metrics import HealthCollector

    with pytest.raises(InvalidArgument, match=r"queues must be a collection.*\('emails',\)"):
        QueueStatsCollector(Session, queues="emails")
    with pytest.raises(InvalidArgument, match="tables must be a collection"):
        HealthCollector(None, tables="delayed_queue")
    with pytest.raises(InvalidArgument, match="tables must be a collection"):
        diagnose(None, "delayed_queue")  # type: ignore[arg-type]


on_all_backends = pytest.mark.parametrize(
    "backend", ["sqlite", "postgresql", "mariadb"], indirect=True
)


@on_all_backends
def test_collector_counts_are_bounded_and_flag_the_counts_that_stopped(backend: Backend) -> None:
    """emails holds 2 due, 1 scheduled, 1 in flight, 1 dead: with at_most=1 the due count
    stops at 1 and says so; the others are exact."""
    seed(backend)
    registry = CollectorRegistry()
    QueueStatsCollector(backend.Session, min_interval=0, at_most=1).register(registry)
    depth = {
        state: sample(registry, "delayedq_messages", queue="emails", state=state)
        for state in ("due", "scheduled", "in_flight", "dead", "done")
    }
    capped = {
        state: sample(registry, "delayedq_messages_capped", queue="emails", state=state)
        for state in ("due", "scheduled", "in_flight", "dead", "done")
    }
    assert depth == {"due": 1, "scheduled": 1, "in_flight": 1, "dead": 1, "done": 0}
    assert capped == {"due": 1, "scheduled": 0, "in_flight": 0, "dead": 0, "done": 0}
    lag = sample(registry, "delayedq_oldest_due_lag_seconds", queue="emails")
    assert lag is not None and 60 <= lag < 600


@on_pg_and_sqlite
def test_collector_is_bounded_by_default_and_exact_on_request(backend: Backend) -> None:
    seed(backend)
    assert QueueStatsCollector(backend.Session).cache.at_most == 1_000
    assert StatsCache(backend.Session).at_most == 1_000
    registry = CollectorRegistry()
    QueueStatsCollector(backend.Session, min_interval=0, at_most=None).register(registry)
    assert sample(registry, "delayedq_messages", queue="emails", state="due") == 2
    assert sample(registry, "delayedq_messages_capped", queue="emails", state="due") == 0


class ManualSeconds:
    """A monotonic clock that moves when told; a read of the table takes ``read`` seconds."""

    def __init__(self) -> None:
        self.now = 0.0
        self.read = 0.5
        self.reads: list[float] = []

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_stats_cache_spends_at_most_one_percent_of_the_time_reading(backend: Backend) -> None:
    clock = ManualSeconds()

    def sessions() -> Session:
        clock.now += clock.read
        clock.reads.append(clock.now)
        return backend.Session()

    cache = StatsCache(sessions, min_interval=10, clock=clock)
    cache.get()
    assert (clock.reads, cache.interval) == ([0.5], 50.0)  # a 0.5 s read: 50 s to the next
    for clock.now in (10.5, 40.0, 50.49):
        assert cache.get()[2] == 0.5
    assert clock.reads == [0.5]
    clock.now, clock.read = 50.5, 0.0625
    cache.get()
    assert (clock.reads, cache.interval) == ([0.5, 50.5625], 10.0)  # fast again: min_interval
    clock.now = 60.5
    cache.get()
    assert clock.reads == [0.5, 50.5625]
    clock.now = 60.5625
    cache.get()
    assert clock.reads == [0.5, 50.5625, 60.625]


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_stats_cache_without_a_read_share_waits_min_interval_only(backend: Backend) -> None:
    clock = ManualSeconds()

    def slow() -> Session:
        clock.now += 30.0
        clock.reads.append(clock.now)
        return backend.Session()

    cache = StatsCache(slow, min_interval=10, max_read_share=None, clock=clock)
    cache.get()
    assert cache.interval == 10
    clock.now = 40.0
    cache.get()
    assert clock.reads == [30.0, 70.0]
    with pytest.raises(InvalidArgument, match="max_read_share"):
        StatsCache(backend.Session, max_read_share=0)


def test_a_failed_read_counts_against_the_budget_too() -> None:
    clock = ManualSeconds()

    def broken() -> Session:
        clock.now += 2.0
        clock.reads.append(clock.now)
        raise ConnectionError("database down")

    cache = StatsCache(broken, min_interval=10, clock=clock)
    assert cache.get() == ([], False, 2.0)
    clock.now = 150.0
    cache.get()
    assert clock.reads == [2.0]  # 200 s after a 2 s attempt
    clock.now = 202.0
    cache.get()
    assert clock.reads == [2.0, 204.0]


def test_collector_reports_a_failed_read_as_down() -> None:
    def broken() -> Session:
        raise ConnectionError("database down")

    registry = CollectorRegistry()
    QueueStatsCollector(broken, min_interval=0).register(registry)
    assert sample(registry, "delayedq_stats_up") == 0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text: str = response.read().decode()
        return text


@on_pg_and_sqlite
def test_serve_prometheus_exposes_depth_and_worker_metrics(backend: Backend) -> None:
    seed(backend)
    registry = CollectorRegistry()
    port = free_port()
    hooks = serve_prometheus(port, backend.Session, addr="127.0.0.1", registry=registry)
    hooks.lag("emails", 1.0)
    hooks.processed("emails", envelope(queue="emails"), 0.1)
    text = scrape(port)
    assert 'delayedq_messages{queue="emails",state="due"} 2.0' in text
    assert 'delayedq_messages_capped{queue="emails",state="due"} 0.0' in text
    assert 'delayedq_processed_total{queue="emails"} 1.0' in text


def test_serve_prometheus_on_port_0_logs_the_port_it_serves(
    backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    """Port 0 binds a free port; the log named port 0, so nobody could find the metrics. A
    port that cannot be bound registers nothing: serving again on the same registry works."""
    registry = CollectorRegistry()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(OSError):
            serve_prometheus(
                taken.getsockname()[1], backend.Session, addr="127.0.0.1", registry=registry
            )
    caplog.set_level("INFO", logger="sqla_delayedq")
    serve_prometheus(0, backend.Session, addr="127.0.0.1", registry=registry)
    (served,) = [r.getMessage() for r in caplog.records if "Prometheus" in r.getMessage()]
    port = int(served.rsplit(":", 1)[1])
    assert port != 0 and "delayedq_messages" in scrape(port)


# -- OpenTelemetry -----------------------------------------------------------------------------


@pytest.fixture
def reader() -> InMemoryMetricReader:
    return InMemoryMetricReader()


@pytest.fixture
def meter_provider(reader: InMemoryMetricReader) -> Iterator[MeterProvider]:
    provider = MeterProvider(metric_readers=[reader])
    yield provider
    provider.shutdown()


def points(reader: InMemoryMetricReader) -> dict[str, list[Any]]:
    data = reader.get_metrics_data()
    found: dict[str, list[Any]] = {}
    if data is None:
        return found
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                found.setdefault(metric.name, []).extend(metric.data.data_points)
    return found


def test_otel_hooks_record_worker_events(
    meter_provider: MeterProvider, reader: InMemoryMetricReader
) -> None:
    hooks = OtelHooks(meter_provider.get_meter("test"))
    hooks.lag("q", 2.0)
    hooks.processed("q", envelope(), 0.25)
    hooks.lag("q", 0.5)
    hooks.failed("q", envelope(), RuntimeError("x"), NackOutcome.DEAD)
    hooks.redelivered("q", envelope())
    hooks.buried("q", Buried("q", "k", "no attempt left"))  # dead, though no handler failed
    hooks.db_error(ConnectionError("gone"))
    found = points(reader)

    def total(name: str) -> float:
        return float(sum(p.value for p in found[name]))

    assert total("delayedq.messages.processed") == 1
    assert total("delayedq.messages.failed") == 1
    assert total("delayedq.messages.dead") == 2
    assert total("delayedq.messages.redelivered") == 1
    assert total("delayedq.db.errors") == 1
    by_outcome = {p.attributes["outcome"]: p for p in found["delayedq.handler.duration"]}
    assert (by_outcome["ok"].count, by_outcome["ok"].sum) == (1, 0.25)
    assert by_outcome["failed"].count == 1
    (lag,) = found["delayedq.pickup.lag"]
    assert (lag.count, lag.sum, dict(lag.attributes)) == (2, 2.5, {"queue": "q"})


def test_otel_hooks_add_the_table_of_a_queue_in_a_schema_only(
    meter_provider: MeterProvider, reader: InMemoryMetricReader
) -> None:
    hooks = OtelHooks(meter_provider.get_meter("test"))
    hooks.processed(QueueName("emails", "tenant_a.jobs", "tenant_a"), envelope(), 0.1)
    hooks.processed(QueueName("emails", "tenant_b.jobs", "tenant_b"), envelope(), 0.1)
    hooks.processed(QueueName("emails", "jobs", None), envelope(), 0.1)
    found = points(reader)["delayedq.messages.processed"]
    assert sorted((sorted(p.attributes.items()), p.value) for p in found) == [
        ([("queue", "emails")], 1),
        ([("queue", "emails"), ("table", "tenant_a.jobs")], 1),
        ([("queue", "emails"), ("table", "tenant_b.jobs")], 1),
    ]


@on_pg_and_sqlite
def test_otel_gauges_report_depth_and_lag(
    backend: Backend, meter_provider: MeterProvider, reader: InMemoryMetricReader
) -> None:
    seed(backend)
    cache = observe_queues(backend.Session, meter=meter_provider.get_meter("test"), min_interval=0)
    assert isinstance(cache, StatsCache)
    found = points(reader)
    depth = {
        p.attributes["state"]: p.value
        for p in found["delayedq.queue.depth"]
        if p.attributes["queue"] == "emails"
    }
    assert depth == {"due": 2, "scheduled": 1, "in_flight": 1, "dead": 1, "done": 0}
    (lag,) = found["delayedq.queue.lag"]
    assert 60 <= lag.value < 600
    assert {p.value for p in found["delayedq.queue.depth.capped"]} == {0}


@on_pg_and_sqlite
def test_otel_gauges_flag_counts_that_stopped_at_the_cap(
    backend: Backend, meter_provider: MeterProvider, reader: InMemoryMetricReader
) -> None:
    seed(backend)
    observe_queues(backend.Session, meter=meter_provider.get_meter("t"), min_interval=0, at_most=1)
    found = points(reader)
    depth = {p.attributes["state"]: p.value for p in found["delayedq.queue.depth"]}
    capped = {p.attributes["state"]: p.value for p in found["delayedq.queue.depth.capped"]}
    assert depth == {"due": 1, "scheduled": 1, "in_flight": 1, "dead": 1, "done": 0}
    assert capped == {"due": 1, "scheduled": 0, "in_flight": 0, "dead": 0, "done": 0}


def two_plain_tables() -> list[StatsCache]:
    """Two message tables without a schema, each with a queue ``emails`` (2 and 1 due), in an
    in-memory database: one StatsCache each."""
    from sqlalchemy.orm import DeclarativeBase, sessionmaker

    from sqla_delayedq import QueueMessageMixin
    from sqla_delayedq.testing import memory_engine

    class Base(DeclarativeBase):
        pass

    models = [type(f"M{n}", (QueueMessageMixin, Base), {"__tablename__": n}) for n in "ab"]
    tables = [Base.metadata.tables[n] for n in "ab"]
    engine = memory_engine()
    Base.metadata.create_all(engine)
    sessions = sessionmaker(engine)
    with sessions.begin() as s:
        for model, keys in zip(models, (["a1", "a2"], ["b1"]), strict=True):
            for key in keys:
                DelayedQueue[Any]("emails", model=model).offer(s, key, {})
    return [StatsCache(sessions, table=t, min_interval=0) for t in tables]


def test_collectors_of_two_tables_without_a_schema_label_each(
    meter_provider: MeterProvider, reader: InMemoryMetricReader
) -> None:
    """Neither table has a schema, hence no ``table`` label: their queues of one name were
    the same series twice (Prometheus keeps one of them). Each now carries its table's."""
    caches = two_plain_tables()
    registry = CollectorRegistry()
    QueueStatsCollector(caches).register(registry)
    due = [line for line in generate_latest(registry).decode().splitlines() if "due" in line]
    assert sorted(line for line in due if line.startswith("delayedq_messages{")) == [
        'delayedq_messages{queue="emails",state="due",table="a"} 2.0',
        'delayedq_messages{queue="emails",state="due",table="b"} 1.0',
    ]
    observe_queues(caches, meter=meter_provider.get_meter("t"))
    found = points(reader)
    depth = sorted(
        (p.attributes["table"], p.value)
        for p in found["delayedq.queue.depth"]
        if p.attributes["state"] == "due"
    )
    assert depth == [("a", 2), ("b", 1)]
    alone = CollectorRegistry()
    QueueStatsCollector(caches[:1]).register(alone)  # one table: its series as they were
    assert sample(alone, "delayedq_messages", queue="emails", state="due") == 2


@pytest.fixture
def spans() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    provider.shutdown()


def test_traced_handler_spans_each_message(
    spans: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    provider, exporter = spans
    tracer = provider.get_tracer("test")
    ok = traced_handler(lambda env: env.key, tracer=tracer)
    transactional = traced_handler(lambda env, session: session, tracer=tracer)

    def fails(env: Envelope[Any]) -> None:
        raise ValueError("nope")

    assert ok(envelope("a", "mail")) == "a"
    assert transactional(envelope("b", "mail"), "session") == "session"
    with pytest.raises(ValueError):
        traced_handler(fails, tracer=tracer)(envelope("c", "mail"))
    first, second, failed = exporter.get_finished_spans()
    assert (first.name, first.kind) == ("process mail", SpanKind.CONSUMER)
    assert first.attributes is not None
    assert first.attributes["messaging.destination.name"] == "mail"
    assert first.attributes["messaging.message.id"] == "a"
    assert first.attributes["delayedq.attempt"] == 1
    assert second.attributes is not None and second.attributes["messaging.message.id"] == "b"
    assert failed.status.status_code is StatusCode.ERROR
    assert [e.name for e in failed.events] == ["exception"]


@on_pg_and_sqlite
def test_instrument_queue_spans_offers(
    backend: Backend, spans: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    provider, exporter = spans
    q: DelayedQueue[Any] = instrument_queue(
        DelayedQueue("mail"), tracer=provider.get_tracer("test")
    )
    assert instrument_queue(q) is q  # not wrapped twice
    with backend.Session() as s, s.begin():
        assert q.offer(s, "k1", {"n": 1}).outcome is Outcome.CREATED
        q.offer(s, "k1", {"n": 1})
        results = q.offer_batch(s, [("k1", {"n": 2}), ("k2", {"n": 1})])
    assert [r.outcome for r in results] == [Outcome.UPDATED, Outcome.CREATED]
    one, two, batch = exporter.get_finished_spans()
    assert (one.name, one.kind) == ("send mail", SpanKind.PRODUCER)
    assert one.attributes is not None and one.attributes["delayedq.outcome"] == "created"
    assert two.attributes is not None and two.attributes["delayedq.outcome"] == "ignored"
    assert batch.attributes is not None
    assert batch.attributes["messaging.batch.message_count"] == 2
    assert (batch.attributes["delayedq.created"], batch.attributes["delayedq.updated"]) == (1, 1)


# -- the worker command's exporter -------------------------------------------------------------


@on_pg_and_sqlite
def test_worker_command_serves_metrics(backend: Backend, tmp_path: Path) -> None:
    with backend.Session() as s, s.begin():
        DelayedQueue[Any]("jobs").offer(s, "job-1", {"sleep": 0.0})
    port = free_port()
    env = {
        **os.environ,
        "DELAYEDQ_DATABASE_URL": backend.url.render_as_string(hide_password=False),
        "DELAYEDQ_TEST_OUT": str(tmp_path / "events.txt"),
    }
    cmd = [sys.executable, "-m", "sqla_delayedq.cli", "worker", "tests.cli_handlers:slow"]
    cmd += ["-q", "jobs", "--poll-interval", "0.2", "--metrics-port", str(port)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    try:
        text = ""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                text = scrape(port)
            except OSError:
                text = ""
            if 'delayedq_processed_total{queue="jobs"} 1.0' in text:
                break
            assert proc.poll() is None, proc.communicate()[1]
            time.sleep(0.2)
        assert 'delayedq_processed_total{queue="jobs"} 1.0' in text
        assert 'delayedq_messages{queue="jobs",state="due"}' in text
        assert "delayedq_stats_up 1.0" in text
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr


def test_metrics_hooks_are_worker_hooks() -> None:
    hooks: list[Callable[[], WorkerHooks]] = [
        lambda: PrometheusHooks(CollectorRegistry()),
        lambda: OtelHooks(MeterProvider().get_meter("x")),
        CompositeHooks,
    ]
    assert all(isinstance(make(), WorkerHooks) for make in hooks)


class BailingHooks(WorkerHooks):
    def processed(self, queue: str, envelope: Envelope[Any], seconds: float) -> None:
        raise SystemExit("the metrics backend bails out")


class AsyncMetricsHooks(WorkerHooks):
    async def processed(self, queue: str, envelope: Envelope[Any], seconds: float) -> None:
        raise AssertionError("CompositeHooks never awaits it")


def test_composite_hooks_fan_out_past_a_base_exception_and_refuse_async_hooks() -> None:
    """A hook's ``SystemExit`` ended the fan-out (the hooks after it never heard of the event);
    an ``async def`` hook was called and never awaited, so it never ran."""
    registry = CollectorRegistry()
    hooks = CompositeHooks(BailingHooks(), PrometheusHooks(registry))
    hooks.processed("q", envelope(), 0.1)
    assert sample(registry, "delayedq_processed_total", queue="q") == 1
    with pytest.raises(InvalidArgument, match=r"AsyncMetricsHooks\.processed.*AsyncWorker"):
        CompositeHooks(WorkerHooks(), AsyncMetricsHooks())
