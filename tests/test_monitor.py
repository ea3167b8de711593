"""The workers registry and per-minute counters (sqla_delayedq.monitor).

A ``delayedq worker`` process shows in the registry within one heartbeat and is shown dead within
``DEAD_AFTER_BEATS`` heartbeats of a SIGKILL; thread and asyncio workers write their row and their
counters; a worker without the tables warns once and works on.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import sessionmaker

from sqla_delayedq import Buried, DelayedQueue, ExponentialBackoff, create_engine
from sqla_delayedq.errors import InvalidArgument
from sqla_delayedq.models import DelayedMessage, stats_table, workers_table
from sqla_delayedq.monitor import DEAD_AFTER_BEATS, monitor_worker
from sqla_delayedq.worker import QueueName, Worker
from tests.fix_db import Backend
from tests.fix_workers import AsyncRunner, running

REPO = Path(__file__).resolve().parents[1]
HEARTBEAT = 0.3


def handler(envelope: Any) -> None:
    if envelope.payload.get("fail"):
        raise RuntimeError("cannot")


def until(check: Callable[[], Any], timeout: float = 20.0, every: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(every)
    raise AssertionError(f"not within {timeout} s")


def worker_rows(backend: Backend) -> list[dict[str, Any]]:
    with backend.engine.connect() as conn:
        return [dict(r) for r in conn.execute(sa.select(workers_table)).mappings()]


def stats_rows(backend: Backend) -> dict[tuple[str, str], tuple[int, int, int]]:
    s = stats_table
    stmt = sa.select(
        s.c.table_name,
        s.c.queue,
        sa.func.sum(s.c.processed),
        sa.func.sum(s.c.failed),
        sa.func.sum(s.c.dead),
    ).group_by(s.c.table_name, s.c.queue)
    with backend.engine.connect() as conn:
        return {(t, q): (int(p), int(f), int(d)) for t, q, p, f, d in conn.execute(stmt)}


def offer_work(backend: Backend) -> DelayedQueue[Any]:
    q: DelayedQueue[Any] = DelayedQueue("jobs", retry=ExponentialBackoff(max_attempts=1))
    with backend.Session() as s, s.begin():
        for i in range(5):
            q.offer(s, f"ok/{i}", {"i": i})
        for i in range(2):
            q.offer(s, f"bad/{i}", {"fail": True})
    return q


@pytest.mark.parametrize("kind", ["thread", "asyncio"])
def test_a_monitored_worker_writes_its_row_and_counters(backend: Backend, kind: str) -> None:
    q = offer_work(backend)
    if kind == "thread":
        worker: Any = Worker(backend.Session, concurrency=2, poll_interval=0.1, name="w-thread")
        worker.register(q, handler)
        target = worker
    else:
        worker = AsyncRunner(backend, concurrency=2, poll_interval=0.1, name="w-async")
        worker.register(q, handler)
        target = worker.worker
    monitor = monitor_worker(target, heartbeat=HEARTBEAT)
    with running(worker):
        until(lambda: stats_rows(backend).get(("delayed_queue", "jobs")) == (5, 2, 2))
        [row] = until(lambda: [r for r in worker_rows(backend) if r["processed"] == 5])
        assert row["id"] == monitor.id and row["pid"] == os.getpid()
        assert row["runtime"] == ("threads" if kind == "thread" else "asyncio")
        assert row["started_by"] == "code" and row["concurrency"] == 2
        assert row["queues"] == '["delayed_queue:jobs"]'
        assert row["failed"] == 2 and row["stopped_at"] is None
        assert row["heartbeat_seconds"] == HEARTBEAT
        first = row["heartbeat_at"]
        until(lambda: worker_rows(backend)[0]["heartbeat_at"] > first)
    [row] = worker_rows(backend)
    assert row["stopped_at"] is not None


def test_a_message_a_take_buried_counts_dead_not_failed(backend: Backend) -> None:
    worker = Worker(backend.Session).register(DelayedQueue("jobs"), handler)
    monitor = monitor_worker(worker)
    monitor.buried(QueueName("jobs", "delayed_queue"), Buried("jobs", "k", "no attempt left"))
    [(key, counts)] = monitor._pending.items()
    assert key[:2] == ("delayed_queue", "jobs") and counts == [0, 0, 1]


def test_without_the_tables_a_worker_warns_once_and_works_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    engine = create_engine(f"sqlite:///{tmp_path / 'plain.sqlite'}")
    DelayedMessage.__table__.create(engine)  # type: ignore[attr-defined]
    sessions = sessionmaker(engine)
    q: DelayedQueue[Any] = DelayedQueue("jobs")
    with sessions.begin() as s:
        for i in range(3):
            q.offer(s, f"k/{i}", {"i": i})
    worker = Worker(sessions, poll_interval=0.05).register(q, handler)
    monitor = monitor_worker(worker, heartbeat=0.05)
    with caplog.at_level(logging.WARNING, "sqla_delayedq"), running(worker):
        until(lambda: worker.hooks.all[1]._totals[0] == 3)  # type: ignore[attr-defined]
        until(lambda: monitor.disabled, timeout=10)  # its first beat found no tables
    warnings = [r for r in caplog.records if "dashboard's tables" in r.getMessage()]
    assert len(warnings) == 1 and "delayedq db upgrade" in warnings[0].getMessage()
    assert monitor.disabled
    with sessions() as s:
        assert q.counts(s).due == 0
    engine.dispose()


def test_prune_deletes_old_counters_and_long_gone_workers(backend: Backend) -> None:
    worker = Worker(backend.Session).register(DelayedQueue("jobs"), handler)
    monitor = monitor_worker(worker, history=timedelta(hours=1))
    now = datetime.now(UTC).replace(second=0, microsecond=0)
    with backend.engine.begin() as conn:
        for minute in (now - timedelta(hours=2), now - timedelta(minutes=5)):
            conn.execute(
                stats_table.insert().values(
                    worker_id="old",
                    table_name="delayed_queue",
                    queue="jobs",
                    minute=minute,
                    processed=1,
                    failed=0,
                    dead=0,
                )
            )
        for id, beat in (("gone", now - timedelta(hours=3)), ("recent", now)):
            conn.execute(
                workers_table.insert().values(
                    id=id,
                    name=id,
                    host="h",
                    pid=1,
                    runtime="threads",
                    started_by="code",
                    queues="[]",
                    concurrency=1,
                    heartbeat_seconds=10.0,
                    started_at=beat,
                    heartbeat_at=beat,
                )
            )
    monitor.prune(backend.Session)
    with backend.engine.connect() as conn:
        minutes = conn.scalars(sa.select(stats_table.c.minute)).all()
        ids = conn.scalars(sa.select(workers_table.c.id)).all()
    assert len(minutes) == 1 and ids == ["recent"]


def test_a_worker_is_monitored_once(backend: Backend) -> None:
    worker = Worker(backend.Session).register(DelayedQueue("jobs"), handler)
    first = monitor_worker(worker, heartbeat=5)
    assert monitor_worker(worker, heartbeat=1, started_by="cli") is first
    assert sum(isinstance(h, type(first)) for h in worker.hooks.all) == 1  # type: ignore[attr-defined]


def test_monitor_worker_checks_its_arguments(backend: Backend) -> None:
    worker = Worker(backend.Session)
    with pytest.raises(InvalidArgument, match="needs a Worker or an AsyncWorker"):
        monitor_worker("worker")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="heartbeat must be > 0"):
        monitor_worker(worker, heartbeat=0)
    with pytest.raises(InvalidArgument, match="history must be > 0"):
        monitor_worker(worker, history=timedelta(0))
    # Accepted, then every prune of the counters (now - history) failed with an OverflowError.
    with pytest.raises(InvalidArgument, match="history must be at most 365000 days"):
        monitor_worker(worker, history=timedelta.max)


# -- a `delayedq worker` process -----------------------------------------------------------------


@pytest.fixture
def worker_process(backend: Backend, tmp_path: Path) -> Iterator[Callable[..., Any]]:
    procs: list[subprocess.Popen[str]] = []

    def start(*args: str) -> tuple[subprocess.Popen[str], list[str]]:
        env = {
            **os.environ,
            "DELAYEDQ_DATABASE_URL": backend.url.render_as_string(hide_password=False),
            "DELAYEDQ_TEST_OUT": str(tmp_path / "events"),
        }
        cmd = [sys.executable, "-m", "sqla_delayedq.cli", "worker", *args]
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        procs.append(proc)
        lines: list[str] = []

        def drain() -> None:
            assert proc.stderr is not None
            for line in proc.stderr:
                lines.append(line)

        threading.Thread(target=drain, daemon=True).start()
        return proc, lines

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_a_cli_worker_appears_within_one_heartbeat_and_is_dead_soon_after_sigkill(
    backend: Backend, worker_process: Callable[..., Any]
) -> None:
    from sqla_delayedq.web._data import Data

    heartbeat = 2.0  # long enough that a loaded machine's late beat is not a missed one
    proc, lines = worker_process(
        "tests.cli_handlers:slow", "-q", "jobs", "--heartbeat", str(heartbeat)
    )
    until(lambda: any(" started: " in line for line in lines) or proc.poll() is not None, 60)
    assert proc.poll() is None, "".join(lines)
    started = time.monotonic()
    [row] = until(lambda: worker_rows(backend), timeout=15, every=0.02)
    assert time.monotonic() - started <= heartbeat  # the first beat is at the start
    assert row["pid"] == proc.pid and row["started_by"] == "cli"
    assert row["queues"] == '["delayed_queue:jobs"]'

    data = Data(backend.Session, counts_ttl=0)
    assert [w["state"] for w in data.workers() or []] == ["running"]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed = time.monotonic()
    assert [w["state"] for w in data.workers() or []] == ["running"]  # not yet: no beat missed

    until(lambda: [w["state"] for w in data.workers() or []] == ["dead"], timeout=20, every=0.05)
    took = time.monotonic() - killed
    assert took <= DEAD_AFTER_BEATS * heartbeat + 2.0, took
    data.close()

    from starlette.testclient import TestClient

    from sqla_delayedq.web import dashboard

    board = dashboard(backend.Session, token="t")
    page = TestClient(board, headers={"authorization": "Bearer t"}).get("/workers").text
    assert f'data-pid="{proc.pid}" data-state="dead"' in page
    assert "password" not in "".join(lines).lower()


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_a_cli_worker_with_no_monitor_writes_nothing_and_stops_cleanly(
    backend: Backend, worker_process: Callable[..., Any]
) -> None:
    proc, lines = worker_process("tests.cli_handlers:slow", "-q", "jobs", "--no-monitor")
    until(lambda: any(" started: " in line for line in lines) or proc.poll() is not None, 60)
    time.sleep(0.3)
    assert worker_rows(backend) == []
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_a_cli_worker_marks_its_row_stopped_on_sigterm(
    backend: Backend, worker_process: Callable[..., Any]
) -> None:
    proc, lines = worker_process("tests.cli_handlers:slow", "-q", "jobs", "--heartbeat", "0.2")
    until(lambda: worker_rows(backend), 60)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0, "".join(lines)
    [row] = worker_rows(backend)
    assert row["stopped_at"] is not None
