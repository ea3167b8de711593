"""Backend strategies are chosen by capability and refuse servers that lack what the queue needs."""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone
from typing import cast

import pytest
import sqlalchemy as sa
from sqlalchemy.dialects import mysql, postgresql, sqlite
from sqlalchemy.orm import Session

from sqla_delayedq import DelayedMessage, UnsupportedBackend
from sqla_delayedq import _statements as st
from sqla_delayedq._dialects import (
    MariaDBStrategy,
    MySQLStrategy,
    PostgreSQLStrategy,
    is_transient,
    strategy_class,
    strategy_for,
)
from sqla_delayedq.testing import memory_engine

T = cast(sa.Table, DelayedMessage.__table__)
NOW = datetime(2030, 1, 1, tzinfo=timezone.utc)


def dialect_with(dialect, version):
    dialect.server_version_info = version
    return dialect


@pytest.mark.parametrize(
    ("dialect", "version", "message"),
    [
        (postgresql.dialect(), (11, 9), "PostgreSQL 11.9 is too old"),
        (mysql.dialect(), (8, 0, 16), "utf8mb4_0900_bin.*in 8.0.17"),
        (mysql.dialect(is_mariadb=True), (10, 5, 12), "SKIP LOCKED arrived in MariaDB 10.6"),
    ],
)
def test_older_servers_are_refused_with_a_clear_error(dialect, version, message):
    d = dialect_with(dialect, version)
    with pytest.raises(UnsupportedBackend, match=message):
        strategy_class(d)(d)


def test_strategies_are_chosen_by_capability_not_just_by_name():
    assert strategy_class(dialect_with(postgresql.dialect(), (15, 2))) is PostgreSQLStrategy
    assert strategy_class(dialect_with(mysql.dialect(), (8, 0, 36))) is MySQLStrategy
    maria = dialect_with(mysql.dialect(is_mariadb=True), (10, 11, 6))
    assert strategy_class(maria) is MariaDBStrategy
    assert not MySQLStrategy.update_returning and PostgreSQLStrategy.has_notify


def test_sqlite_polls_without_for_update_and_servers_skip_locked():
    due = st.select_due(T, "q", NOW, 5, None)
    assert "FOR UPDATE" not in str(due.compile(dialect=sqlite.dialect()))
    locked = st.select_due(T, "q", NOW, 5, "update_skip_locked")
    assert "FOR UPDATE SKIP LOCKED" in str(locked.compile(dialect=postgresql.dialect()))
    assert "FOR UPDATE SKIP LOCKED" in str(locked.compile(dialect=mysql.dialect()))


def test_transient_errors_are_recognised():
    from sqlalchemy.exc import OperationalError

    class PgError(Exception):
        sqlstate = "40P01"

    class MyError(Exception):
        pass

    assert is_transient(OperationalError("x", {}, PgError()))
    assert is_transient(OperationalError("x", {}, MyError(1213, "Deadlock found")))
    assert not is_transient(OperationalError("x", {}, MyError(1062, "Duplicate entry")))
    assert not is_transient(ValueError("not a database error"))


def test_a_statement_cut_off_by_a_timeout_is_transient(server_backend):
    """``statement_timeout`` (PostgreSQL 57014) and ``max_statement_time`` (MariaDB 1969) cut a
    statement off for running too long, as under load: no more permanent than a lock wait that
    ran out (a worker retries it rather than stop)."""
    with server_backend.engine.connect() as conn:
        if server_backend.name == "postgresql":
            conn.execute(sa.text("SET LOCAL statement_timeout = '50ms'"))
            slow = sa.text("SELECT pg_sleep(2)")
        else:
            slow = sa.text("SET STATEMENT max_statement_time=0.05 FOR SELECT SLEEP(2)")
        with pytest.raises(sa.exc.OperationalError) as caught:
            conn.execute(slow)
    assert is_transient(caught.value)


def test_the_database_servers_clock_is_read_now_and_in_utc(server_backend):
    """The clock-skew check's reading: the server's time as the statement runs (not the
    transaction's start), aware and in UTC, within a second of ours (server and tests share a
    host); SQLite has no clock of its own."""
    with server_backend.Session() as s:
        strategy = strategy_for(s)
        first = strategy.server_now(s)
        time.sleep(0.05)
        second = strategy.server_now(s)
    assert first is not None and second is not None
    assert first.tzinfo is timezone.utc
    assert second - first >= timedelta(seconds=0.04)  # in one transaction
    assert abs(datetime.now(timezone.utc) - second) < timedelta(seconds=1)
    engine = memory_engine()
    with Session(engine) as s:
        assert strategy_for(s).server_now(s) is None
    engine.dispose()
