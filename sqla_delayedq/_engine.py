"""Engine set-up that the queue relies on for each backend.

:func:`create_engine` is ``sqlalchemy.create_engine`` plus what a queue needs:

- SQLite: WAL journal, a busy timeout, and ``BEGIN IMMEDIATE`` for every transaction, so a
  consumer takes the write lock before it reads and two takers never race on one snapshot
  (SQLAlchemy's documented recipe for pysqlite's transaction handling).
- MariaDB/MySQL: ``READ COMMITTED``, which avoids the gap locks that ``REPEATABLE READ``
  takes on range scans, so producers are not blocked by consumers polling the same range.

Use :func:`configure_sqlite` on an engine you built yourself.
"""

from __future__ import annotations

import weakref
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import Engine, make_url

__all__ = ["configure_sqlite", "create_engine"]

SQLITE_BUSY_TIMEOUT_MS = 30_000

_configured: weakref.WeakSet[Engine] = weakref.WeakSet()


def configure_sqlite(engine: Engine, *, busy_timeout_ms: int = SQLITE_BUSY_TIMEOUT_MS) -> Engine:
    """Make a pysqlite engine safe for concurrent queue use (idempotent)."""
    if engine.dialect.name != "sqlite" or engine in _configured:
        return engine
    _configured.add(engine)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # Let SQLAlchemy, not the driver, decide when transactions begin.
        dbapi_conn.isolation_level = None
        cursor = dbapi_conn.cursor()
        cursor.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
        if engine.url.database not in (None, "", ":memory:"):
            cursor.execute("PRAGMA journal_mode = WAL")
            cursor.execute("PRAGMA synchronous = NORMAL")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: sa.Connection) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


def create_engine(url: str | sa.URL, **kwargs: Any) -> Engine:
    """``sqlalchemy.create_engine`` with the per-backend settings described above."""
    backend = make_url(url).get_backend_name()
    if backend in ("mysql", "mariadb"):
        kwargs.setdefault("isolation_level", "READ COMMITTED")
    engine = sa.create_engine(url, **kwargs)
    return configure_sqlite(engine)
