"""Backend strategies are chosen by capability and refuse servers that lack what the queue needs."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import pytest
import sqlalchemy as sa
from sqlalchemy.dialects import mysql, postgresql, sqlite
from sqlalchemy.orm import Session

from sqla_delayedq import DelayedMessage, InvalidArgument, UnsupportedBackend, create_engine
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
NOW = datetime(2030, 1, 1, tzinfo=UTC)


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
    assert first.tzinfo is UTC
    assert second - first >= timedelta(seconds=0.04)  # in one transaction
    assert abs(datetime.now(UTC) - second) < timedelta(seconds=1)
    engine = memory_engine()
    with Session(engine) as s:
        assert strategy_for(s).server_now(s) is None
    engine.dispose()


def _counting_rollbacks(monkeypatch: pytest.MonkeyPatch, cls: Any) -> list[int]:
    """Count the ``ROLLBACK`` a driver's connection class sends (every call sends one)."""
    calls: list[int] = []
    rollback = cls.rollback

    def counted(self, *args, **kwargs):
        calls.append(1)
        return rollback(self, *args, **kwargs)

    monkeypatch.setattr(cls, "rollback", counted)
    return calls


def test_mariadb_a_committed_connection_goes_back_to_the_pool_without_a_rollback(
    mariadb, monkeypatch
):
    """The pool's reset sent a ``ROLLBACK`` after every commit (PyMySQL sends one whenever it
    is asked): a round trip in each transaction of a producer or a consumer, for nothing. The
    engines of ``create_engine`` roll back only a connection whose server says a transaction
    is open; one built with the caller's own ``pool_reset_on_return`` keeps it."""
    import pymysql

    calls = _counting_rollbacks(monkeypatch, pymysql.connections.Connection)
    engine = mariadb.new_engine()
    own = mariadb.new_engine(pool_reset_on_return="rollback")
    try:
        for e in (engine, own):  # the first connection's set-up rolls back once: not counted
            e.connect().close()
        calls.clear()
        with Session(engine) as s, s.begin():
            s.execute(sa.text("SELECT 1"))
        assert calls == []
        with Session(own) as s, s.begin():
            s.execute(sa.text("SELECT 1"))
        assert calls == [1]
    finally:
        engine.dispose()
        own.dispose()


def test_mariadb_a_connection_returned_in_a_transaction_is_still_rolled_back(mariadb):
    """What the reset is for: a connection that goes back to the pool with a transaction open
    (its writes made through the driver, which the ``Connection`` did not see) is rolled back,
    so the next user of the pooled connection does not commit them."""
    engine = mariadb.new_engine(pool_size=1, max_overflow=0)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE reset_probe (x INT) ENGINE=InnoDB"))
        raw = engine.raw_connection()
        cursor = raw.cursor()
        cursor.execute("INSERT INTO reset_probe VALUES (1)")
        cursor.close()
        raw.close()  # back to the pool, uncommitted
        with engine.connect() as conn:  # the same pooled connection
            conn.commit()  # would commit the insert had the reset not rolled it back
            assert conn.execute(sa.text("SELECT count(*) FROM reset_probe")).scalar_one() == 0
        with Session(engine) as s:  # and a Session that ends without a commit
            s.execute(sa.text("INSERT INTO reset_probe VALUES (2)"))
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT count(*) FROM reset_probe")).scalar_one() == 0
    finally:
        with engine.begin() as conn:
            conn.execute(sa.text("DROP TABLE IF EXISTS reset_probe"))
        engine.dispose()


def test_mariadb_a_connection_left_unended_after_a_read_is_still_rolled_back(mariadb):
    """The server's in-transaction flag comes with OK replies only: after a commit, a
    transaction that only read (``SELECT ... FOR UPDATE``) leaves it saying "none open". A
    ``Connection`` left to the garbage collector went back to the pool with that transaction,
    its row locks and its snapshot, and the next user of the pooled connection inherited them."""
    import gc

    engine = mariadb.new_engine(pool_size=1, max_overflow=0)
    other = sa.create_engine(mariadb.url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE reset_read (id INT PRIMARY KEY) ENGINE=InnoDB"))
            conn.execute(sa.text("INSERT INTO reset_read VALUES (1)"))

        def forgotten() -> None:
            conn = engine.connect()
            conn.execute(sa.text("SELECT id FROM reset_read WHERE id = 1 FOR UPDATE")).all()

        forgotten()
        gc.collect()
        with other.begin() as conn:  # the row is free: the pool rolled the reader back
            conn.execute(sa.text("SET SESSION innodb_lock_wait_timeout = 1"))
            conn.execute(sa.text("SELECT id FROM reset_read WHERE id = 1 FOR UPDATE")).all()
        with engine.connect() as conn:
            open_trx = conn.execute(
                sa.text(
                    "SELECT count(*) FROM information_schema.innodb_trx"
                    " WHERE trx_mysql_thread_id = CONNECTION_ID()"
                )
            ).scalar_one()
            assert open_trx == 0
    finally:
        other.dispose()
        with engine.begin() as conn:
            conn.execute(sa.text("DROP TABLE IF EXISTS reset_read"))
        engine.dispose()


def test_mariadb_a_read_on_the_raw_connection_after_a_commit_is_still_rolled_back(mariadb):
    """After a commit through the ``Connection``, a ``SELECT ... FOR UPDATE`` on the raw driver
    connection opened a transaction the server's last OK reply did not report: the connection
    went back to the pool holding the row lock, and consumers skipped the row (found in
    review)."""
    engine = mariadb.new_engine(pool_size=1, max_overflow=0)
    other = sa.create_engine(mariadb.url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE reset_raw (id INT PRIMARY KEY) ENGINE=InnoDB"))
            conn.execute(sa.text("INSERT INTO reset_raw VALUES (1)"))
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT 1")).all()
            conn.commit()
            cursor = conn.connection.dbapi_connection.cursor()
            cursor.execute("SELECT id FROM reset_raw WHERE id = 1 FOR UPDATE")
            cursor.fetchall()
            cursor.close()
        with other.begin() as conn:  # the row is free: the pool rolled the raw read back
            conn.execute(sa.text("SET SESSION innodb_lock_wait_timeout = 1"))
            conn.execute(sa.text("SELECT id FROM reset_raw WHERE id = 1 FOR UPDATE")).all()
    finally:
        other.dispose()
        with engine.begin() as conn:
            conn.execute(sa.text("DROP TABLE IF EXISTS reset_raw"))
        engine.dispose()


def test_mariadb_an_engine_on_a_pool_of_the_callers_is_accepted(mariadb):
    """``create_engine(url, pool=...)``: the pool is the caller's, reset included (passing
    ``pool_reset_on_return`` beside it is a ``TypeError``)."""
    import pymysql

    url = mariadb.url
    pool = sa.pool.QueuePool(
        lambda: pymysql.connect(
            host=url.host,
            port=url.port or 3306,
            user=url.username,
            password=url.password or "",
            database=url.database,
        ),
        pool_size=1,
    )
    engine = mariadb.new_engine(pool=pool)
    try:
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT 1")).scalar_one() == 1
    finally:
        engine.dispose()


def test_mariadb_asyncio_engines_skip_the_rollback_after_a_commit_too(mariadb, monkeypatch):
    import asyncio

    import aiomysql  # type: ignore[import-untyped]

    from sqla_delayedq.aio import create_async_engine

    calls = _counting_rollbacks(monkeypatch, aiomysql.Connection)

    async def main() -> int:
        engine = create_async_engine(mariadb.url.set(drivername="mariadb+aiomysql"))
        try:
            async with engine.connect():  # the first connection's set-up rolls back once
                pass
            calls.clear()
            async with engine.begin() as conn:
                await conn.execute(sa.text("SELECT 1"))
            committed = len(calls)
            async with engine.connect() as conn:  # ends without a commit: rolled back
                await conn.execute(sa.text("SELECT 1"))
            assert len(calls) == committed + 1
            return committed
        finally:
            await engine.dispose()

    assert asyncio.run(main()) == 0


def _sqlite_settings(engine: Any) -> tuple[int, str, int, Any]:
    with engine.connect() as conn:
        raw = conn.connection.dbapi_connection
        return (
            conn.exec_driver_sql("PRAGMA busy_timeout").scalar_one(),
            conn.exec_driver_sql("PRAGMA journal_mode").scalar_one(),
            conn.exec_driver_sql("PRAGMA synchronous").scalar_one(),
            raw.isolation_level,
        )


def test_sqlite_configured_after_its_first_use_an_engine_sets_up_its_pooled_connections(
    tmp_path,
):
    """``configure_sqlite`` on an engine that had connected left its pooled connection as it
    was (5 s timeout, rollback journal, the driver's own transactions), and a timeout asked
    of an engine configured already was ignored (found in review)."""
    from sqla_delayedq import configure_sqlite

    engine = sa.create_engine(f"sqlite:///{tmp_path}/late.db")
    try:
        DelayedMessage.metadata.create_all(engine)  # a pooled connection, not set up
        configure_sqlite(engine)
        assert _sqlite_settings(engine) == (30_000, "wal", 1, None)  # 1: NORMAL
        assert configure_sqlite(engine) is engine  # the same settings again: nothing to do
        with pytest.raises(InvalidArgument, match="configured already with busy_timeout_ms"):
            configure_sqlite(engine, busy_timeout_ms=120_000)
        with pytest.raises(InvalidArgument, match="synchronous must be one of"):
            configure_sqlite(sa.create_engine(f"sqlite:///{tmp_path}/o.db"), synchronous="OFF")
    finally:
        engine.dispose()
    full = configure_sqlite(
        sa.create_engine(f"sqlite:///{tmp_path}/full.db"), synchronous="full", busy_timeout_ms=7
    )
    try:
        assert _sqlite_settings(full) == (7, "wal", 2, None)  # 2: FULL
    finally:
        full.dispose()
    own = create_engine(f"sqlite:///{tmp_path}/own.db", connect_args={"timeout": 120})
    try:  # sqlite3's own wait is the busy timeout asked for
        assert _sqlite_settings(own)[0] == 120_000
    finally:
        own.dispose()
