"""Message tables in a schema (on MariaDB/MySQL: in another database of the server): two
tenants with the same table and queue names keep their controls, wake-ups, metrics, hooks and
command-line access apart."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase

from sqla_delayedq import (
    DelayedQueue,
    Envelope,
    InvalidArgument,
    QueueControls,
    QueueMessageMixin,
)
from sqla_delayedq._dialects import PostgreSQLStrategy
from sqla_delayedq.models import controls_table, stats_table, table_key
from sqla_delayedq.monitor import monitor_worker
from sqla_delayedq.worker import Worker, WorkerHooks
from tests.fix_db import Backend, server_for
from tests.fix_workers import make_thread_worker, running, waiting
from tests.test_cli import invoke, url_of


@dataclass
class Tenants:
    backend: Backend
    schemas: tuple[str, str]
    models: tuple[type[QueueMessageMixin], type[QueueMessageMixin]]

    def queues(self, name: str, **kwargs: Any) -> tuple[DelayedQueue[Any], DelayedQueue[Any]]:
        a, b = (DelayedQueue(name, model=m, **kwargs) for m in self.models)
        return a, b


def _model(schema: str) -> type[QueueMessageMixin]:
    class Base(DeclarativeBase):
        metadata = sa.MetaData(schema=schema)

    return type(f"Message_{schema}", (QueueMessageMixin, Base), {"__tablename__": "delayed_queue"})


@pytest.fixture
def tenants(server_backend: Backend) -> Iterator[Tenants]:
    """``delayed_queue`` in two schemas (PostgreSQL) or two databases (MariaDB) beside the
    session's database, which holds the controls table."""
    yield from _tenants(server_backend)


@pytest.fixture
def pg_tenants(pg: Backend) -> Iterator[Tenants]:
    """:func:`tenants` on PostgreSQL alone (``NOTIFY``)."""
    yield from _tenants(pg)


def _tenants(b: Backend) -> Iterator[Tenants]:
    if b.name == "postgresql":
        token = secrets.token_hex(4)
        schemas = (f"tenant_a_{token}", f"tenant_b_{token}")
        with b.engine.begin() as conn:
            for schema in schemas:
                conn.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
    else:
        server = server_for(b.name)
        a, b_ = (server.create_database().database for _ in range(2))
        assert a is not None and b_ is not None
        schemas = (a, b_)
    models = (_model(schemas[0]), _model(schemas[1]))
    for m in models:
        m.__table__.metadata.create_all(b.engine)  # type: ignore[attr-defined]
    try:
        yield Tenants(b, schemas, models)
    finally:
        if b.name == "postgresql":
            with b.engine.begin() as conn:
                for schema in schemas:
                    conn.exec_driver_sql(f'DROP SCHEMA "{schema}" CASCADE')
        else:
            server = server_for(b.name)
            for schema in schemas:
                server.drop_database(b.url.set(database=schema))


def offer(backend: Backend, q: DelayedQueue[Any], *keys: str) -> None:
    with backend.Session() as s, s.begin():
        q.offer_batch(s, [(k, {}) for k in keys])


def take(backend: Backend, q: DelayedQueue[Any], n: int = 10) -> list[str]:
    with backend.Session() as s, s.begin():
        return [e.key for e in q.try_poll_many(s, n)]


def test_pausing_a_queue_in_one_schema_leaves_the_same_queue_of_another_delivering(tenants):
    b = tenants.backend
    qa, qb = tenants.queues("emails")
    offer(b, qa, "a1")
    offer(b, qb, "b1")
    with b.Session() as s, s.begin():
        qa.pause(s)
    with b.Session() as s:
        assert qa.controls(s).paused
        assert qb.controls(s) == QueueControls()
    assert take(b, qa) == []
    assert take(b, qb) == ["b1"]
    with b.Session() as s, s.begin():
        qa.resume(s)
    assert take(b, qa) == ["a1"]


def test_limits_in_one_schema_do_not_throttle_the_same_queue_of_another(tenants):
    b = tenants.backend
    qa, qb = tenants.queues("emails")
    with b.Session() as s, s.begin():
        qa.set_limits(s, max_in_flight=1, rate=(2, timedelta(hours=1)))
    offer(b, qa, *(f"a{i}" for i in range(5)))
    offer(b, qb, *(f"b{i}" for i in range(5)))
    assert take(b, qa) == ["a0"]  # one in flight at most
    assert len(take(b, qb)) == 5  # neither limit is B's
    with b.Session() as s:
        assert qb.controls(s) == QueueControls()


def test_a_table_without_a_schema_keeps_its_controls_key(server_backend):
    """Rows written before tables in schemas had keys of their own still apply."""
    b = server_backend
    q: DelayedQueue[Any] = DelayedQueue("legacy")
    assert table_key(q.table) == "delayed_queue"
    with b.engine.begin() as conn:
        conn.execute(
            sa.insert(controls_table).values(
                table_name="delayed_queue",
                queue="legacy",
                paused=True,
                updated_at=q.now(),
            )
        )
    offer(b, q, "k")
    with b.Session() as s:
        assert q.controls(s).paused
    assert take(b, q) == []


def test_a_long_qualified_name_gets_a_key_that_fits_its_column():
    t = controls_table.c.table_name.type
    long_a = sa.table("delayed_queue_of_a_tenant", schema="s" * 80 + "a")
    long_b = sa.table("delayed_queue_of_a_tenant", schema="s" * 80 + "b")
    keys = {table_key(long_a), table_key(long_b)}
    assert len(keys) == 2
    assert all(len(k) <= t.length for k in keys)  # type: ignore[attr-defined]
    assert table_key(sa.table("x", schema="s")) == "s.x"


@pytest.mark.parametrize("name", ["t" * 63, "é" * 31, "tenant.delayed_queue"])
def test_a_channel_fits_in_a_postgresql_identifier(pg, name):
    channel = PostgreSQLStrategy.channel(name)
    assert len(channel.encode()) <= 63
    with pg.engine.connect() as conn:  # pg_notify refuses a channel name of 64 bytes or more
        conn.execute(sa.select(sa.func.pg_notify(channel, "x")))
    assert PostgreSQLStrategy.channel(name + "2") != channel


def test_offers_in_one_schema_notify_only_its_own_channel(pg_tenants):
    tenants = pg_tenants
    import psycopg

    b = tenants.backend
    qa, qb = tenants.queues("emails")
    channels = [PostgreSQLStrategy.channel(q.wake_key) for q in (qa, qb)]
    assert channels[0] != channels[1]
    conninfo = b.url.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(conninfo, autocommit=True) as listener:
        listener.execute(f'LISTEN "{channels[1]}"')
        offer(b, qa, "a1")
        assert list(listener.notifies(timeout=0.5)) == []
        offer(b, qb, "b1")
        assert [n.channel for n in listener.notifies(timeout=2, stop_after=1)] == [channels[1]]


def test_the_cli_reads_and_steers_a_table_named_schema_dot_name(tenants):
    b = tenants.backend
    qa, qb = tenants.queues("emails")
    offer(b, qa, "a1")
    offer(b, qb, "b1", "b2")
    u = url_of(b.url)
    table_a, table_b = (f"{schema}.delayed_queue" for schema in tenants.schemas)
    stats = json.loads(invoke(u, "stats", "--table", table_b, "--json").stdout)
    assert [(q["queue"], q["due"]) for q in stats["queues"]] == [("emails", 2)]
    listed = json.loads(invoke(u, "ls", "--table", table_a, "--json").stdout)
    assert [m["key"] for m in listed["messages"]] == ["a1"]
    assert invoke(u, "pause", "--table", table_a, "-q", "emails").stdout == "emails: paused\n"
    with b.Session() as s:
        assert qa.controls(s).paused
        assert not qb.controls(s).paused
    assert invoke(u, "controls", "--table", table_b).stdout.startswith("every queue is plain")
    assert json.loads(invoke(u, "controls", "--table", table_a, "--json").stdout) == {
        "emails": {"paused": True, "max_in_flight": None, "rate": None}
    }
    assert take(b, qb) == ["b1", "b2"]
    missing = invoke(u, "stats", "--table", "no_such_schema.delayed_queue")
    assert missing.exit_code != 0
    assert "'no_such_schema.delayed_queue' does not exist" in missing.stderr


def test_the_dashboard_shows_and_steers_each_schema_s_table_apart(tenants):
    from sqla_delayedq.web import _data

    b = tenants.backend
    qa, qb = tenants.queues("emails")
    offer(b, qa, "a1")
    offer(b, qb, "b1")
    data = _data.Data(b.Session, queues=[qa, qb], counts_ttl=0)
    assert set(data.tables) == {table_key(qa.table), table_key(qb.table)}
    data.steer((table_key(qa.table), "emails"), True, {})
    snap = data.overview()
    assert snap.control(table_key(qa.table), "emails") == QueueControls(paused=True)
    assert snap.control(table_key(qb.table), "emails") == QueueControls()


def test_the_spark_writer_notifies_the_channel_workers_of_a_schema_s_table_listen_on(pg):
    import psycopg

    from sqla_delayedq.spark import _pg

    q: DelayedQueue[Any] = DelayedQueue("emails", model=_model("tenant_a"))
    with psycopg.connect(pg.url.set(drivername="postgresql").render_as_string(False)) as conn:
        sent = _pg.notify(("tenant_a", "delayed_queue")).as_string(conn)
    assert f"pg_notify('{PostgreSQLStrategy.channel(q.wake_key)}'" in sent


# -- one worker for two tenants: hooks, metrics and wake-ups keep them apart -------------------


def wait_for(predicate: Callable[[], Any], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "not within the timeout"
        time.sleep(0.02)


class Seen(WorkerHooks):
    """What the worker told its hooks, in a list (a set would hide a duplicate)."""

    def __init__(self) -> None:
        self.processed_by: list[tuple[str, str]] = []

    def processed(self, queue: str, envelope: Envelope[Any], seconds: float) -> None:
        self.processed_by.append((queue, getattr(queue, "table", "")))  # a QueueName


def test_one_worker_serving_two_tenants_reports_each_apart(tenants):
    """Hooks, Prometheus series and the dashboard's per-minute counters tell the two tenants'
    ``emails`` queues apart by table; the queue label stays the plain name."""
    from prometheus_client import CollectorRegistry

    from sqla_delayedq.metrics import PrometheusHooks

    b = tenants.backend
    qa, qb = tenants.queues("emails")
    ta, tb = table_key(qa.table), table_key(qb.table)
    offer(b, qa, "a1", "a2")
    offer(b, qb, "b1")
    registry, seen = CollectorRegistry(), Seen()
    handled: list[str] = []
    worker = Worker(b.Session, concurrency=2, poll_interval=0.1, listen=False, hooks=seen)
    worker.add_hooks(PrometheusHooks(registry))
    worker.register(qa, lambda env: handled.append(env.key))
    worker.register(qb, lambda env: handled.append(env.key))
    monitor = monitor_worker(worker, heartbeat=0.2)
    with running(worker):
        wait_for(lambda: len(seen.processed_by) == 3)
    monitor.beat(b.Session)
    assert sorted(handled) == ["a1", "a2", "b1"]
    assert sorted(seen.processed_by) == sorted([("emails", ta), ("emails", ta), ("emails", tb)])

    def processed(**labels: str) -> float | None:
        return registry.get_sample_value("delayedq_processed_total", labels)

    assert processed(queue="emails", table=ta) == 2
    assert processed(queue="emails", table=tb) == 1
    assert processed(queue="emails") is None  # no series without a table for these
    lag = "delayedq_pickup_lag_seconds_count"
    assert registry.get_sample_value(lag, {"queue": "emails", "table": ta}) == 2
    s = stats_table
    stmt = sa.select(s.c.table_name, sa.func.sum(s.c.processed)).where(s.c.queue == "emails")
    with b.engine.connect() as conn:
        counted = {t: n for t, n in conn.execute(stmt.group_by(s.c.table_name))}
    assert {t: int(n) for t, n in counted.items() if t in (ta, tb)} == {ta: 2, tb: 1}


def test_a_collector_of_two_tenants_tables_reports_each_apart(tenants):
    from prometheus_client import CollectorRegistry

    from sqla_delayedq.metrics import QueueStatsCollector, StatsCache

    b = tenants.backend
    qa, qb = tenants.queues("emails")
    offer(b, qa, "a1", "a2")
    offer(b, qb, "b1")
    registry = CollectorRegistry()
    caches = [StatsCache(b.Session, table=q.table, min_interval=0) for q in (qa, qb)]
    QueueStatsCollector(caches).register(registry)

    def due(**labels: str) -> float | None:
        return registry.get_sample_value("delayedq_messages", {**labels, "state": "due"})

    assert due(queue="emails", table=table_key(qa.table)) == 2
    assert due(queue="emails", table=table_key(qb.table)) == 1
    assert due(queue="emails") is None
    assert registry.get_sample_value("delayedq_stats_up") == 1
    with pytest.raises(InvalidArgument, match="give each table once"):
        QueueStatsCollector([caches[0], StatsCache(b.Session, table=qa.table)])


def recording_wakes(worker: Any) -> list[tuple[str, int]]:
    """The wake-ups the worker hands its consumers, ``(queue, consumers)``, in a list."""
    rt = getattr(worker, "worker", worker)._rt
    woken: list[tuple[str, int]] = []
    notify = rt.notify

    def record(key: str | None = None, count: int | None = None) -> None:
        if key is not None and count is not None:
            woken.append((key, count))
        notify(key, count)

    rt.notify = record
    return woken


def two_tenants_worker(tenants, make_worker, **options: Any) -> tuple[Any, DelayedQueue[Any]]:
    """A worker of tenant A's ``emails`` (one message a take) and ``sms``, and of tenant B's
    ``emails`` (100 a take); returns it and tenant B's ``sms``, which it does not serve."""
    qa, qb = tenants.queues("emails")
    sms_a, sms_b = tenants.queues("sms")
    worker = make_worker(tenants.backend, concurrency=2, poll_interval=30, batch_size=1, **options)
    worker.register(qa, lambda env: None)
    worker.register(sms_a, lambda env: None)
    worker.register_batch(qb, lambda envs: None, batch_size=100)
    return worker, sms_b


def test_an_offer_wakes_the_consumers_of_its_own_table_s_queue(tenants, make_worker):
    """Five messages to tenant A's ``emails`` (taken one at a time) wake five consumers, not
    as many as tenant B's ``emails`` (100 a take) would need; an offer to tenant B's ``sms``,
    which the worker does not serve, wakes nobody, though it serves A's ``sms``."""
    b = tenants.backend
    worker, sms_b = two_tenants_worker(tenants, make_worker, listen=False)
    qa, _ = tenants.queues("emails")
    with running(worker):
        wait_for(lambda: waiting(worker) == 2)
        woken = recording_wakes(worker)
        offer(b, sms_b, "s1", "s2", "s3", "s4")
        offer(b, qa, *(f"a{i}" for i in range(5)))
        assert woken == [("emails", 5)]


def test_a_notify_wakes_the_consumers_of_its_own_table_s_queue(pg_tenants):
    """The same through ``LISTEN``: a notification says its table by its channel."""
    import psycopg

    from sqla_delayedq._wakeup import payload

    b = pg_tenants.backend
    worker, sms_b = two_tenants_worker(pg_tenants, make_thread_worker, listen=True)
    qa, _ = pg_tenants.queues("emails")
    channel = PostgreSQLStrategy.channel
    last = max(channel(q.wake_key) for q in (qa, sms_b))
    listening = sa.text(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
        "AND query = :listen"
    ).bindparams(listen=f'LISTEN "{last}"')
    conninfo = b.url.set(drivername="postgresql").render_as_string(hide_password=False)
    with running(worker):
        wait_for(lambda: waiting(worker) == 2)
        woken = recording_wakes(worker)
        with b.engine.connect() as conn:
            wait_for(lambda: conn.execute(listening).scalar_one() == 1)
        with psycopg.connect(conninfo, autocommit=True) as conn, conn.transaction():
            # Delivered in this order: once the second has woken anyone, the first was read.
            conn.execute("SELECT pg_notify(%s, %s)", (channel(sms_b.wake_key), payload("sms", 4)))
            conn.execute("SELECT pg_notify(%s, %s)", (channel(qa.wake_key), payload("emails", 5)))
        wait_for(lambda: woken)
        assert woken == [("emails", 5)]
