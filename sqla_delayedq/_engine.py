"""Engine set-up that the queue relies on for each backend.

:func:`create_engine` is ``sqlalchemy.create_engine`` plus what a queue needs:

- SQLite: WAL journal, a busy timeout, and ``BEGIN IMMEDIATE`` for every transaction, so a
  consumer takes the write lock before it reads and two takers never race on one snapshot
  (SQLAlchemy's documented recipe for pysqlite's transaction handling).
- PostgreSQL: a JSON loader (``json_deserializer``) that reads a value nested too deep to
  parse as a corrupt payload of its own message (psycopg and asyncpg decode JSON columns
  themselves: the RecursionError failed the whole take).
- MariaDB/MySQL: ``READ COMMITTED``, which avoids the gap locks that ``REPEATABLE READ``
  takes on range scans, so producers are not blocked by consumers polling the same range. And
  a connection that goes back to the pool is rolled back unless its last transaction ended
  with its ``Connection``'s commit or rollback and the server says none is open: the drivers
  (PyMySQL, aiomysql) send ``ROLLBACK`` whenever they are asked, so the pool's reset cost a
  round trip after every commit (one of the four of a transactional take, two of the seven of
  a lease-mode one).

Use :func:`configure_sqlite` on an engine you built yourself.

This module and the strategies (``_dialects``) are the only places that look at a dialect's
name; everything else asks :func:`family`.
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import Dialect, Engine, make_url

from ._codec import lenient_loads
from .errors import InvalidArgument

__all__ = [
    "SYNC_DRIVERS",
    "Family",
    "configure_sqlite",
    "create_engine",
    "family",
    "is_mariadb",
    "sync_driver_url",
    "url_family",
]

#: Asynchronous driver -> the synchronous driver that reads the same database (the command line
#: and the dashboard read an ``AsyncWorker``'s database synchronously).
SYNC_DRIVERS = {
    "sqlite+aiosqlite": "sqlite",
    "mysql+aiomysql": "mysql+pymysql",
    "mysql+asyncmy": "mysql+pymysql",
    "mariadb+aiomysql": "mariadb+pymysql",
    "mariadb+asyncmy": "mariadb+pymysql",
    "postgresql+psycopg": "postgresql+psycopg",
    "postgresql+psycopg_async": "postgresql+psycopg",
    "postgresql+asyncpg": "postgresql+psycopg",
}


def sync_driver_url(url: sa.URL) -> sa.URL | None:
    """The synchronous driver's URL for an asynchronous engine's database; None if unknown."""
    driver = url.drivername if "+" in url.drivername else f"{url.drivername}+"
    sync = SYNC_DRIVERS.get(driver)
    return None if sync is None else url.set(drivername=sync)


class Family(enum.Enum):
    """The database families sqla_delayedq serves."""

    POSTGRESQL = "postgresql"
    MYSQL = "mysql"  # MySQL and MariaDB
    SQLITE = "sqlite"


_FAMILIES = {
    "postgresql": Family.POSTGRESQL,
    "mysql": Family.MYSQL,
    "mariadb": Family.MYSQL,
    "sqlite": Family.SQLITE,
}


def family(dialect: Dialect) -> Family | None:
    """The family of a dialect; None for one sqla_delayedq does not serve."""
    return _FAMILIES.get(dialect.name)


def url_family(url: str | sa.URL) -> Family | None:
    """:func:`family` of a database URL, without connecting."""
    return _FAMILIES.get(make_url(url).get_backend_name())


def is_mariadb(dialect: Dialect) -> bool:
    """MariaDB, whatever the URL said: the MySQL dialect detects it on connect."""
    return family(dialect) is Family.MYSQL and bool(getattr(dialect, "is_mariadb", False))


SQLITE_BUSY_TIMEOUT_MS = 30_000

#: What each configured engine was configured with: ``(busy_timeout_ms, synchronous)``.
_configured: weakref.WeakKeyDictionary[Engine, tuple[int, str]] = weakref.WeakKeyDictionary()

#: ``PRAGMA synchronous`` levels that keep WAL safe (``OFF`` can corrupt it on power loss).
SQLITE_SYNCHRONOUS = ("NORMAL", "FULL", "EXTRA")

#: The connection record's ``info``: this connection has the queue's settings.
_SET_UP = "delayedq_sqlite_set_up"


def configure_sqlite(
    engine: Engine,
    *,
    busy_timeout_ms: int = SQLITE_BUSY_TIMEOUT_MS,
    synchronous: str = "NORMAL",
) -> Engine:
    """Make a pysqlite engine safe for concurrent queue use (idempotent).

    Connections the engine made before are set up too, when next checked out. ``synchronous``
    is the durability of a commit: ``NORMAL`` (the default) loses nothing when the application
    crashes, but a power loss or an operating system crash may lose the last transactions
    committed (offers, and acknowledgements: their messages are delivered again); ``FULL``
    waits for the disk at every commit. Configuring an engine again with other settings is
    refused: its connections have the first ones.
    """
    if family(engine.dialect) is not Family.SQLITE:
        return engine
    if (
        not isinstance(busy_timeout_ms, int)
        or isinstance(busy_timeout_ms, bool)
        or not 0 <= busy_timeout_ms < 2**31
    ):
        raise InvalidArgument(
            f"busy_timeout_ms must be an int of milliseconds from 0, got {busy_timeout_ms!r}"
        )
    level = synchronous.upper() if isinstance(synchronous, str) else synchronous
    if level not in SQLITE_SYNCHRONOUS:
        raise InvalidArgument(
            f"synchronous must be one of {', '.join(SQLITE_SYNCHRONOUS)}, got {synchronous!r}"
        )
    settings = (busy_timeout_ms, level)
    done = _configured.get(engine)
    if done is not None:
        if done != settings:
            raise InvalidArgument(
                f"this engine is configured already with busy_timeout_ms={done[0]}, "
                f"synchronous={done[1]!r}; configure it once, before its first use"
            )
        return engine
    _configured[engine] = settings

    @event.listens_for(engine, "checkout")
    def _on_checkout(dbapi_conn: Any, record: Any, _proxy: Any) -> None:
        if record.info.get(_SET_UP):
            return
        # Let SQLAlchemy, not the driver, decide when transactions begin.
        dbapi_conn.isolation_level = None
        cursor = dbapi_conn.cursor()
        cursor.execute(f"PRAGMA busy_timeout = {busy_timeout_ms}")
        if engine.url.database not in (None, "", ":memory:"):
            cursor.execute("PRAGMA journal_mode = WAL")
            cursor.execute(f"PRAGMA synchronous = {level}")
        cursor.close()
        record.info[_SET_UP] = True

    @event.listens_for(engine, "begin")
    def _on_begin(conn: sa.Connection) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


def engine_options(
    url: str | sa.URL, kwargs: dict[str, Any]
) -> tuple[dict[str, Any], Callable[[Engine], Engine]]:
    """``kwargs`` plus the per-backend engine options the queue relies on, and what to do to
    the (synchronous) engine built with them."""
    reset_if_open = False
    if url_family(url) is Family.POSTGRESQL:  # psycopg and asyncpg decode JSON themselves
        kwargs.setdefault("json_deserializer", lenient_loads)
    if url_family(url) is Family.MYSQL:
        kwargs.setdefault("isolation_level", "READ COMMITTED")
        if "pool_reset_on_return" not in kwargs and "pool" not in kwargs:  # the caller's stand
            kwargs["pool_reset_on_return"] = None
            reset_if_open = True

    def configure(engine: Engine) -> Engine:
        if reset_if_open:
            event.listen(engine, "begin", _began)
            event.listen(engine, "commit", _ended)
            event.listen(engine, "rollback", _ended)
            event.listen(engine, "reset", _rollback_if_open)
        return configure_sqlite(engine, busy_timeout_ms=busy_timeout_ms)

    # sqlite3's own wait (``connect_args={"timeout": seconds}``) is the busy timeout asked for.
    timeout = kwargs.get("connect_args", {}).get("timeout")
    busy_timeout_ms = SQLITE_BUSY_TIMEOUT_MS if timeout is None else int(float(timeout) * 1000)
    return kwargs, configure


#: The server's status flag for an open transaction (``SERVER_STATUS_IN_TRANS``), which
#: MariaDB and MySQL send with every OK reply (not with a result set's end, nor an error).
_IN_TRANS = 1

#: The pool record's ``info``: the last transaction of the connection ended through its
#: ``Connection`` (SQLAlchemy's commit or rollback), nothing began since.
_ENDED = "delayedq_transaction_ended"


def _driver(dbapi_connection: Any) -> Any:
    """The driver's connection (the asyncio adapters keep it as ``_connection``)."""
    return getattr(dbapi_connection, "_connection", dbapi_connection)


def _began(conn: sa.Connection) -> None:
    conn.info.pop(_ENDED, None)


def _ended(conn: sa.Connection) -> None:
    if not (conn.invalidated or conn.closed):
        conn.info[_ENDED] = True


def _rollback_if_open(dbapi_connection: Any, record: Any, state: Any) -> None:
    """The pool's reset on MariaDB/MySQL: ``ROLLBACK`` unless the connection's own
    ``Connection`` already rolled back (``transaction_was_reset``), or its last transaction
    ended with the ``Connection``'s commit or rollback, no statement ran on the driver's
    connection since, and the server's last reply said no transaction is open. The flag alone
    is not enough: it is stale after a result set or an error, so a transaction that only read
    (``SELECT ... FOR UPDATE``) and was never ended (a ``Connection`` left to the garbage
    collector, the raw driver connection used after a commit) would go back to the pool holding
    its locks and snapshot. A driver that does not keep the status is always rolled back, as
    the pool would have."""
    ended = record is not None and record.info.pop(_ENDED, False)
    if state.transaction_was_reset or not state.asyncio_safe:
        return
    raw = _driver(dbapi_connection)
    status = getattr(raw, "server_status", None)
    # PyMySQL (and aiomysql) drop the last result at COMMIT and ROLLBACK: one there is from a
    # statement run since on the driver's connection.
    untouched = getattr(raw, "_result", None) is None
    if ended and untouched and isinstance(status, int) and not status & _IN_TRANS:
        return
    dbapi_connection.rollback()


def create_engine(url: str | sa.URL, **kwargs: Any) -> Engine:
    """``sqlalchemy.create_engine`` with the per-backend settings described above."""
    options, configure = engine_options(url, kwargs)
    return configure(sa.create_engine(url, **options))
