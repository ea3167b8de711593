"""Workers keep PostgreSQL's planner statistics from lagging a burst (``_planner``).

After a drained queue is analysed empty, a burst makes the take a bitmap scan and a sort of
every due row until something analyses the table again. Each test here runs on a database of
its own, whose statistics it controls.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import cast

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import URL, Engine
from sqlalchemy.orm import sessionmaker

from sqla_delayedq import DelayedMessage, DelayedQueue, _planner, create_engine
from sqla_delayedq import _statements as st
from sqla_delayedq._planner import StatisticsKeeper, stale
from sqla_delayedq.models import metadata
from sqla_delayedq.worker import Worker
from tests.fix_db import drop_database, make_database

T = cast(sa.Table, DelayedMessage.__table__)


def test_stale_only_when_the_planner_underestimates_a_table_of_some_size():
    assert stale(0, _planner.MIN_ROWS, None)  # analysed empty (or never), now a burst
    assert stale(-1, 50_000, 10.0)  # never analysed
    assert stale(1000, 2001, 10.0)  # the backlog more than doubled
    assert not stale(1000, 2000, 10.0)
    assert not stale(0, _planner.MIN_ROWS - 1, None)  # small: every plan is cheap
    assert not stale(100_000, 90_000, None)  # draining: an overestimate keeps the index
    assert not stale(0, 50_000, _planner.MIN_GAP / 2)  # someone analysed it just now


@pytest.fixture
def pg_db(tmp_path: Path) -> Iterator[Engine]:
    url: URL = make_database("postgresql", tmp_path)
    engine = create_engine(url)
    try:
        metadata.create_all(engine)
        yield engine
    finally:
        engine.dispose()
        drop_database("postgresql", url)


def _drained_then_burst(engine: Engine, n: int) -> DelayedQueue[dict[str, int]]:
    """A queue whose table was analysed empty after a drain, then got ``n`` due messages."""
    queue: DelayedQueue[dict[str, int]] = DelayedQueue("q")
    sessions = sessionmaker(engine)
    now = datetime.now(UTC)
    with sessions.begin() as s:
        queue.offer_batch(s, [(f"old{i}", {"i": i}, now) for i in range(2000)])
    with engine.begin() as conn:
        conn.execute(T.delete())
        conn.exec_driver_sql("ALTER TABLE delayed_queue SET (autovacuum_enabled = false)")
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.exec_driver_sql("VACUUM ANALYZE delayed_queue")
    with sessions.begin() as s:
        queue.offer_batch(s, [(f"k{i}", {"i": i}, now - timedelta(seconds=1)) for i in range(n)])
    return queue


def _take_plan(engine: Engine) -> str:
    now = datetime.now(UTC)
    stmt = st.claim_returning(T, "q", now, now + timedelta(minutes=5), 10, "tok.")
    compiled = stmt.compile(dialect=engine.dialect)
    with engine.connect() as conn:
        rows = conn.exec_driver_sql("EXPLAIN " + compiled.string, compiled.params).scalars()
        return "\n".join(rows)


def _analysed(engine: Engine) -> tuple[float, int]:
    """(reltuples, manual analyses) of the message table."""
    with engine.connect() as conn:
        row = conn.exec_driver_sql(
            "SELECT c.reltuples, pg_stat_get_analyze_count(c.oid) FROM pg_class c "
            "WHERE c.oid = 'delayed_queue'::regclass"
        ).one()
    return float(row[0]), int(row[1])


def _keeper(engine: Engine) -> StatisticsKeeper:
    return StatisticsKeeper([T], engine.dialect.identifier_preparer.format_table)


def _until(condition, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_the_keeper_analyses_a_burst_and_the_take_reads_the_due_index_again(pg_db):
    _drained_then_burst(pg_db, 20_000)
    assert "Bitmap Heap Scan" in _take_plan(pg_db)  # the stale plan this exists for
    keeper = _keeper(pg_db)
    sessions = sessionmaker(pg_db)
    pg_db.dispose()  # the producer's connection flushes its row counts when it goes idle
    assert keeper.names == ["delayed_queue"]

    def analysed() -> bool:
        keeper(sessions)
        return keeper.analysed.get("delayed_queue", 0) > 0

    _until(analysed)
    plan = _take_plan(pg_db)
    assert "Index Scan using ix_delayed_queue_due" in plan, plan
    assert "Bitmap" not in plan, plan
    reltuples, analyses = _analysed(pg_db)
    assert reltuples > 10_000 and analyses == 2  # the drain's and the keeper's
    for _ in range(3):  # fresh statistics: nothing more to do
        keeper(sessions)
    assert keeper.analysed == {"delayed_queue": 1}
    assert _analysed(pg_db)[1] == 2


def test_a_small_burst_is_left_alone(pg_db):
    _drained_then_burst(pg_db, _planner.MIN_ROWS // 2)
    pg_db.dispose()
    keeper = _keeper(pg_db)
    time.sleep(_planner.MIN_GAP + 0.5)
    keeper(sessionmaker(pg_db))
    assert keeper.analysed == {}
    assert _analysed(pg_db)[1] == 1


def test_a_role_that_may_not_analyse_is_told_once(pg_db, caplog):
    _drained_then_burst(pg_db, 5000)
    role = f"dq_reader_{int(time.time() * 1000) % 10**9}"
    with pg_db.begin() as conn:
        conn.exec_driver_sql(f"CREATE ROLE {role}")
        conn.exec_driver_sql(f"GRANT SELECT ON delayed_queue TO {role}")
    reader = pg_db.execution_options()

    @sa.event.listens_for(reader, "begin")
    def as_reader(conn):
        conn.exec_driver_sql(f"SET LOCAL ROLE {role}")

    try:
        pg_db.dispose()
        keeper = _keeper(reader)
        time.sleep(_planner.MIN_GAP + 0.5)
        with caplog.at_level(logging.INFO, "sqla_delayedq.worker"):
            for _ in range(3):
                keeper(sessionmaker(reader))
        told = [r for r in caplog.records if "may not ANALYZE" in r.getMessage()]
        assert len(told) == 1, caplog.text
        assert keeper.analysed == {}
        assert _analysed(pg_db)[1] == 1
    finally:
        with pg_db.begin() as conn:
            conn.exec_driver_sql(f"DROP OWNED BY {role}")
            conn.exec_driver_sql(f"DROP ROLE {role}")


def test_a_running_worker_keeps_the_statistics_and_can_be_told_not_to(pg_db):
    queue = _drained_then_burst(pg_db, 5000)
    pg_db.dispose()
    handled: list[str] = []
    idle = Worker(sessionmaker(pg_db), concurrency=1, keep_statistics=False)
    idle.register(DelayedQueue("other"), lambda e: handled.append(e.key))
    idle.start()
    try:
        time.sleep(_planner.MIN_GAP + 2 * _planner.INTERVAL + 0.5)
    finally:
        assert idle.stop(drain_timeout=5)
    assert _analysed(pg_db)[1] == 1  # only the drain's
    worker = Worker(sessionmaker(pg_db), concurrency=1)
    worker.register(DelayedQueue("other"), lambda e: handled.append(e.key))
    worker.start()
    try:
        _until(lambda: _analysed(pg_db)[1] == 2)
    finally:
        assert worker.stop(drain_timeout=5)
    assert _analysed(pg_db)[0] > 2500
    assert handled == [] and queue.name == "q"  # it analysed the table, not the queue


def test_the_asyncio_worker_runs_the_keeper_on_postgresql_only(pg_db, tmp_path):
    from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

    from sqla_delayedq.aio import AsyncWorker

    async def tasks(url: str) -> list[str]:
        engine = create_async_engine(url)
        try:
            worker = AsyncWorker(async_sessionmaker(engine))

            async def handler(_e):
                return None

            worker.register(DelayedQueue("q"), handler)
            # The clock skew check runs where the database has a clock of its own (not SQLite).
            return [t.name for t in worker._side_tasks(engine) if t.name != "clock skew check"]
        finally:
            await engine.dispose()

    pg_url = pg_db.url.set(drivername="postgresql+psycopg").render_as_string(hide_password=False)
    assert asyncio.run(tasks(pg_url)) == ["planner statistics"]
    assert asyncio.run(tasks(f"sqlite+aiosqlite:///{tmp_path / 'q.sqlite'}")) == []


def test_the_keeper_waits_out_a_database_outage_and_reports_a_bug():
    from sqla_delayedq.errors import TransientError

    keeper = StatisticsKeeper([T], lambda t: t.name)

    def away():
        raise TransientError("the server restarts")

    keeper(away)  # said at debug level: the consumers report outages
    assert keeper.analysed == {}

    def broken():
        raise RuntimeError("a bug")

    with pytest.raises(RuntimeError):
        keeper(broken)  # the worker's periodic runner logs it with its traceback
