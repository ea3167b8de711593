"""``delayedq doctor`` and :func:`sqla_delayedq.doctor.diagnose`: who pins the vacuum horizon.

Each test holds a transaction open on a connection of its own, the way a report or a forgotten
console session does, and checks that the diagnosis names that very session.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

import pytest
import sqlalchemy as sa

from sqla_delayedq import _skew
from sqla_delayedq.doctor import diagnose
from tests.test_cli import invoke, url_of


@contextmanager
def held_transaction(backend: Any, application: str) -> Iterator[int]:
    """A transaction left open, as a report would: yields its session's pid / thread id."""
    if backend.name == "postgresql":
        engine = sa.create_engine(backend.url.update_query_dict({"application_name": application}))
        begin = "SELECT txid_current()"  # an xid in progress holds the horizon back
        me = "SELECT pg_backend_pid()"
    else:
        engine = sa.create_engine(backend.url)
        begin = "START TRANSACTION WITH CONSISTENT SNAPSHOT"
        me = "SELECT CONNECTION_ID()"
    try:
        with engine.connect() as conn:
            pid = int(conn.exec_driver_sql(me).scalar_one())
            conn.commit()
            conn.exec_driver_sql(begin)
            conn.exec_driver_sql("SELECT 1")
            try:
                yield pid
            finally:
                conn.rollback()
    finally:
        engine.dispose()


def test_diagnose_names_the_session_holding_the_horizon(server_backend):
    with held_transaction(server_backend, "nightly-report") as pid:
        time.sleep(1.2)
        with server_backend.engine.connect() as conn:
            found = diagnose(conn, ["delayed_queue"], threshold=1)
    holders = [h for h in found.holders if h.pid == pid]
    assert len(holders) == 1, found.holders
    holder = holders[0]
    assert holder.kind == "session"
    assert holder.age_seconds is not None and holder.age_seconds >= 1
    if server_backend.name == "postgresql":
        assert holder.application == "nightly-report"
        assert holder.state == "idle in transaction"
        assert holder.xmin_age is not None
        assert any(f"pg_terminate_backend({pid})" in line for line in found.advice)
    else:
        assert any(f"KILL {pid}" in line for line in found.advice)
        assert found.history_length is not None
    assert not found.healthy


def test_a_short_transaction_is_not_reported(server_backend):
    with held_transaction(server_backend, "quick") as pid, server_backend.engine.connect() as conn:
        found = diagnose(conn, ["delayed_queue"], threshold=30)
    assert pid not in [h.pid for h in found.holders]


def test_doctor_command_names_the_blocking_session(server_backend):
    url = url_of(server_backend.url)
    with held_transaction(server_backend, "nightly-report") as pid:
        time.sleep(1.2)
        text = invoke(url, "doctor", "--threshold", "1s")
        data = invoke(url, "doctor", "--threshold", "1s", "--json")
    assert text.exit_code == 0, text.output
    assert str(pid) in text.stdout
    if server_backend.name == "postgresql":
        assert "nightly-report" in text.stdout
        assert "idle in transaction" in text.stdout
    assert data.exit_code == 0, data.output
    report = json.loads(data.stdout)
    assert pid in [h["pid"] for h in report["holders"]]
    assert report["healthy"] is False


def test_a_transaction_in_another_database_does_not_hold_this_one(pg):
    """A session of another database on the same server was named as holding the horizon and
    its termination advised, though VACUUM of this database's tables does not wait for it
    (found in review)."""
    elsewhere = SimpleNamespace(name=pg.name, url=pg.url.set(database="postgres"))
    with held_transaction(elsewhere, "other-app") as pid:
        time.sleep(1.2)
        with pg.engine.connect() as conn:
            found = diagnose(conn, ["delayed_queue"], threshold=1)
    assert pid not in [h.pid for h in found.holders]


def test_doctor_reads_a_table_whose_name_has_capitals(pg):
    """``to_regclass`` folds an unquoted ``JobQueue`` to ``jobqueue``: the table was not found,
    and its bloat went unreported (found in review)."""
    with pg.engine.begin() as conn:
        conn.exec_driver_sql('CREATE TABLE "JobQueue" (id int)')
    try:
        with pg.engine.connect() as conn:
            found = diagnose(conn, ["JobQueue", "public.JobQueue"], threshold=30)
        assert [t.table for t in found.tables] == ["JobQueue", "public.JobQueue"]
    finally:
        with pg.engine.begin() as conn:
            conn.exec_driver_sql('DROP TABLE "JobQueue"')


def test_doctor_reports_dead_rows_a_pinned_horizon_keeps(pg):
    """Rows deleted while a transaction is open stay dead; the advice says why and what to do."""
    with held_transaction(pg, "long-report"):
        with pg.engine.begin() as conn:
            conn.exec_driver_sql(
                "INSERT INTO delayed_queue (queue, key, payload_type, payload, status,"
                " scheduled_at, scheduled_at_initially, created_at, attempts)"
                " SELECT 'q', 'k' || g, 'json', '{}', 'pending', now(), now(), now(), 0"
                " FROM generate_series(1, 20000) g"
            )
        with pg.engine.begin() as conn:
            conn.exec_driver_sql("DELETE FROM delayed_queue")
        deadline = time.monotonic() + 10
        while True:  # table statistics reach pg_stat a moment after the commit
            with pg.engine.connect() as conn:
                found = diagnose(conn, ["delayed_queue"], threshold=0)
            if (found.tables and found.tables[0].dead_rows >= 20000) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    health = found.tables[0]
    assert health.dead_rows >= 20000, health
    assert health.live_rows < health.dead_rows  # an estimate: other tests' rows may linger in it
    assert health.index_bytes > 0
    advice = [line for line in found.advice if "dead rows" in line]
    assert len(advice) == 1, found.advice
    assert "holders above keep VACUUM" in advice[0]


def test_doctor_has_nothing_to_report_on_sqlite(tmp_path):
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'q.db'}")
    with engine.connect() as conn:
        found = diagnose(conn, ["delayed_queue"])
    assert found.healthy and not found.holders and not found.tables
    assert found.clock_skew_seconds is None  # the database runs on this host's clock
    result = invoke(f"sqlite:///{tmp_path / 'q.db'}", "doctor")
    assert result.exit_code == 0, result.output
    assert "nothing holds the horizon" in result.stdout


@pytest.mark.parametrize("threshold", ["-5s", "soon"])
def test_doctor_refuses_a_bad_threshold(threshold, tmp_path):
    result = invoke(f"sqlite:///{tmp_path / 'q.db'}", "doctor", "--threshold", threshold)
    assert result.exit_code == 2
    assert "threshold" in result.output


def test_the_health_collector_exports_the_horizon_age(server_backend):
    from prometheus_client import CollectorRegistry

    from sqla_delayedq.metrics import HealthCollector

    registry = CollectorRegistry()
    HealthCollector(server_backend.engine, min_interval=0).register(registry)
    with held_transaction(server_backend, "metrics-report"):
        time.sleep(1.5)
        held = registry.get_sample_value("delayedq_horizon_age_seconds")
        holders = registry.get_sample_value("delayedq_horizon_holders")
    assert held is not None and held >= 1.4
    assert holders is not None and holders >= 1
    if server_backend.name == "postgresql":
        dead = registry.get_sample_value("delayedq_dead_rows", {"table": "delayed_queue"})
        assert dead is not None and dead >= 0
    else:
        assert registry.get_sample_value("delayedq_innodb_history_length") is not None


def test_doctor_reports_how_far_this_hosts_clock_is_from_the_servers(server_backend, monkeypatch):
    """In step (server and tests share a host): the figure, and no advice. Ten minutes fast:
    the advice says what it risks and to sync the clocks."""
    with server_backend.engine.connect() as conn:
        found = diagnose(conn, ["delayed_queue"])
    assert found.clock_skew_seconds is not None and abs(found.clock_skew_seconds) < 1
    assert not [line for line in found.advice if "clock" in line], found.advice
    url = url_of(server_backend.url)
    assert "clock skew: this host is " in invoke(url, "doctor").stdout
    report = json.loads(invoke(url, "doctor", "--json").stdout)
    assert abs(report["clock_skew_seconds"]) < 1

    fast = lambda: datetime.now(UTC) + timedelta(minutes=10)  # noqa: E731
    monkeypatch.setattr(_skew, "system_clock", fast)
    with server_backend.engine.connect() as conn:
        found = diagnose(conn, ["delayed_queue"])
    assert found.clock_skew_seconds is not None and 599 < found.clock_skew_seconds < 601
    advice = [line for line in found.advice if "clock" in line]
    assert len(advice) == 1 and "600.0 s ahead of" in advice[0] and "NTP" in advice[0]
    assert not found.healthy
