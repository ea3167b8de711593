"""What the driver hands to executors, and the checks it makes first.

Executors get a :class:`ConnectSpec`: where the database is and who to log in as, never the
password. libpq (psycopg) finds the password on the executor itself, in ``PGPASSWORD``,
``PGPASSFILE`` or ``~/.pgpass``; or the user supplies ``connection_factory``, a callable the
executor calls to get a connection (it should read its secret there, not close over it).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.compute as pc  # type: ignore[import-untyped]
from sqlalchemy.engine import URL, make_url

from .._engine import Family, url_family
from .._types import OfferMode
from ..errors import InvalidArgument
from ..models import KEY_MAX, QUEUE_MAX

log = logging.getLogger("sqla_delayedq.spark")

#: The columns of a message row, in table order, as the read side returns them.
ROW_COLUMNS = (
    ("id", "BIGINT"),
    ("queue", "STRING"),
    ("key", "STRING"),
    ("payload_type", "STRING"),
    ("payload", "STRING"),
    ("payload_bytes", "BINARY"),
    ("status", "STRING"),
    ("scheduled_at", "TIMESTAMP"),
    ("scheduled_at_initially", "TIMESTAMP"),
    ("created_at", "TIMESTAMP"),
    ("lock_token", "STRING"),
    ("attempts", "INT"),
    ("last_attempt_at", "TIMESTAMP"),
    ("last_error", "STRING"),
)
TIMESTAMP_COLUMNS = frozenset(n for n, t in ROW_COLUMNS if t == "TIMESTAMP")

#: Input columns of a write, in this order: queue, key, payload (JSON text), at (timestamp).
WRITE_COLUMNS = ("queue", "key", "payload", "at")

ConnectionFactory = Callable[[], Any]

NO_PASSWORD_HINT = (
    "sqla_delayedq.spark never sends passwords to executors: give each executor "
    "PGPASSWORD, PGPASSFILE or ~/.pgpass, or pass connection_factory"
)

_SECRET_QUERY_KEYS = frozenset({"password", "passfile_password", "sslpassword"})

#: Session time zone ids that can only mean UTC, without an ``Etc/`` prefix, lower case.
_UTC_NAMES = frozenset({"utc", "gmt", "uct", "universal", "zulu", "z", "gmt0", "greenwich"})
_ZERO_OFFSET = re.compile(r"(?:utc|gmt)?[+-]?0?0(?::?00){0,2}")


def is_utc_zone(name: str) -> bool:
    """Whether a Spark session time zone id always means UTC (``UTC``, ``Etc/UTC``, ``+00:00``)."""
    n = name.strip().lower().removeprefix("etc/")
    return n in _UTC_NAMES or bool(_ZERO_OFFSET.fullmatch(n))


@dataclass(frozen=True)
class ConnectSpec:
    """How an executor connects. Picklable, and never holds a password.

    ``url`` is the SQLAlchemy URL without its password (it picks the backend and, off
    PostgreSQL, the driver); ``conninfo`` is the libpq connection string for PostgreSQL.
    """

    backend: str
    url: str
    conninfo: str
    factory: ConnectionFactory | None = None

    @property
    def family(self) -> Family | None:
        return url_family(self.url)

    @property
    def is_postgresql(self) -> bool:
        return self.family is Family.POSTGRESQL

    def connect_pg(self) -> Any:
        """A psycopg 3 connection (not autocommit), from the factory or from libpq settings."""
        if self.factory is not None:
            return self.factory()
        import psycopg

        try:
            return psycopg.connect(self.conninfo, autocommit=False)
        except psycopg.OperationalError as exc:
            if "password" in str(exc).lower():
                raise psycopg.OperationalError(f"{exc}\n{NO_PASSWORD_HINT}") from exc
            raise

    @contextmanager
    def pg(self) -> Iterator[Any]:
        conn = self.connect_pg()
        try:
            yield conn
        finally:
            conn.close()

    def engine(self) -> Any:
        """A SQLAlchemy engine for this partition (off PostgreSQL), closed by the caller."""
        import sqlalchemy as sa

        from .._engine import create_engine

        kwargs: dict[str, Any] = {"poolclass": sa.NullPool}
        if self.factory is not None:
            kwargs["creator"] = self.factory
        return create_engine(self.url, **kwargs)


def _strip_secrets(url: URL) -> URL:
    query = {k: v for k, v in url.query.items() if k.lower() not in _SECRET_QUERY_KEYS}
    # URL.set(password=None) means "leave it as it is": replace the field itself.
    return url.set(query=query)._replace(password=None)


def _conninfo(url: URL) -> str:
    from psycopg.conninfo import make_conninfo

    params: dict[str, Any] = {}
    for k, v in url.query.items():
        params[k] = ",".join(v) if isinstance(v, tuple) else v
    if url.host:
        params["host"] = url.host
    if url.port:
        params["port"] = url.port
    if url.database:
        params["dbname"] = url.database
    if url.username:
        params["user"] = url.username
    return str(make_conninfo("", **params))


def _sqlite_for_executors(url: URL) -> URL:
    """The same SQLite file for every executor: refuse in-memory databases, anchor relative paths.

    An in-memory database exists in one process only: each executor would open an empty one
    of its own. A relative path would resolve against each executor's working directory.
    """
    database = url.database or ""
    memory = (
        database in ("", ":memory:")
        or database.startswith("file::memory:")
        or "mode=memory" in database
        or url.query.get("mode") == "memory"
    )
    if memory:
        raise InvalidArgument(
            f"{url.render_as_string()!r} is an in-memory SQLite database: it exists only in the "
            "driver's process, and each executor would write to an empty one of its own; use "
            "a database file that every executor can reach, e.g. sqlite:////shared/app.sqlite"
        )
    if database.startswith("file:") or os.path.isabs(database):
        return url
    return url.set(database=os.path.abspath(database))


def connect_spec(url: str | URL, factory: ConnectionFactory | None) -> ConnectSpec:
    """The executor-side view of ``url``: the same database, without any secret."""
    try:
        parsed = make_url(url)
    except Exception as exc:
        raise InvalidArgument(f"not a database URL: {exc}") from None
    if factory is not None and not callable(factory):
        raise InvalidArgument("connection_factory must be a zero-argument callable")
    backend = parsed.drivername.split("+")[0]
    if url_family(parsed) is Family.SQLITE:
        parsed = _sqlite_for_executors(parsed)
    safe = _strip_secrets(parsed)
    assert safe.password is None
    if parsed.password is not None or safe.query != parsed.query:
        log.info(
            "the password in the database URL stays on the driver; executors use %s",
            "connection_factory" if factory else "PGPASSWORD / PGPASSFILE / ~/.pgpass",
        )
    conninfo = _conninfo(safe) if url_family(parsed) is Family.POSTGRESQL else ""
    return ConnectSpec(
        backend=backend,
        url=safe.render_as_string(hide_password=False),
        conninfo=conninfo,
        factory=factory,
    )


def driver_pg_connection(url: str | URL, factory: ConnectionFactory | None) -> Any:
    """A psycopg connection for the driver's own small queries; it may use the password."""
    if factory is not None:
        return factory()
    import psycopg

    parsed = make_url(url)
    password = parsed.password or parsed.query.get("password")
    conninfo = _conninfo(_strip_secrets(parsed))
    if password:
        return psycopg.connect(conninfo, password=str(password), autocommit=False)
    return psycopg.connect(conninfo, autocommit=False)


@dataclass(frozen=True)
class WritePlan:
    """What every partition of one ``offer_dataframe`` call does; picklable, no secrets."""

    table: tuple[str, ...]
    mode: OfferMode
    payload_type: str
    now: datetime
    commit_every: int | None = None
    notify: bool = True
    after_commit: Callable[[int, int], None] | None = None
    #: PostgreSQL: the channel each transaction reports its counts on (see ``_ledger``).
    ledger: str | None = None


@dataclass
class Counts:
    staged: int = 0
    created: int = 0
    updated: int = 0

    def add(self, other: Counts) -> None:
        self.staged += other.staged
        self.created += other.created
        self.updated += other.updated


@dataclass(frozen=True)
class ReadPlan:
    """What every partition of one ``read_queue`` call selects; picklable, no secrets."""

    table: tuple[str, ...]
    columns: tuple[str, ...]
    fields: tuple[str, ...]
    queue: str | None
    dead_letters: str


def table_parts(table: str, schema: str | None) -> tuple[str, ...]:
    if not isinstance(table, str) or not table:
        raise InvalidArgument("table must be a non-empty string")
    if schema is not None and (not isinstance(schema, str) or not schema):
        raise InvalidArgument("schema must be a non-empty string or None")
    return (table,) if schema is None else (schema, table)


# -- executor-side input checks ---------------------------------------------------------------


def _shown(value: str | None, limit: int = 60) -> str:
    if value is None:
        return "null"
    return repr(value) if len(value) <= limit else f"{value[:limit]!r}... ({len(value)} characters)"


def _check_names(
    column: pa.Array, what: str, limit: int, partition: int, key: pa.Array, payload: pa.Array
) -> None:
    """Refuse null, empty or over-long names, naming the first offending row by its key."""
    if not len(column):
        return
    if column.null_count:
        i = pc.index(pc.is_null(column), True).as_py()
        where = f"payload {_shown(payload[i].as_py())}"
        if what != "key":
            where = f"key {_shown(key[i].as_py())}, {where}"
        rows = "1 row" if column.null_count == 1 else f"{column.null_count} rows"
        raise InvalidArgument(
            f"partition {partition} has {rows} with a null {what} (the first: {where}); "
            f"every message needs a {what}"
            + (" (a generated key would defeat idempotent retries)" if what == "key" else "")
        )
    nul = pc.match_substring(column, "\x00")
    if pc.any(nul).as_py():
        i = pc.index(nul, True).as_py()
        where = "" if what == "key" else f" (key {_shown(key[i].as_py())})"
        raise InvalidArgument(
            f"partition {partition} has a {what} with a NUL character{where}: "
            f"{_shown(column[i].as_py())}; no backend can store it portably"
        )
    lengths = pc.utf8_length(column)
    bounds = pc.min_max(lengths).as_py()
    if bounds["min"] == 0 or bounds["max"] > limit:
        bad = pc.or_(pc.equal(lengths, 0), pc.greater(lengths, limit))
        i = pc.index(bad, True).as_py()
        value = column[i].as_py()
        where = "" if what == "key" else f" (key {_shown(key[i].as_py())})"
        raise InvalidArgument(
            f"partition {partition} has a {what} of {len(value)} characters{where}: "
            f"{_shown(value)}; a {what} must be 1 to {limit} characters"
        )


def _check_payloads(payload: pa.Array, partition: int, key: pa.Array) -> None:
    """Refuse null payloads: SQL NULL, or JSON text that is ``null``.

    Stored, JSON ``null`` reads back exactly like a missing payload, which a consumer takes for
    a damaged row and buries dead at its first take, without running its handler; so such a
    row is refused here, as ``offer`` refuses a ``None`` payload.
    """
    if not len(payload):
        return
    nul = pc.fill_null(pc.match_substring(payload, "\x00"), False)
    if pc.any(nul).as_py():
        i = pc.index(nul, True).as_py()
        raise InvalidArgument(
            f"partition {partition} has a payload with a raw NUL character (key "
            f"{_shown(key[i].as_py())}); it is not JSON"
        )
    null = pc.fill_null(pc.equal(pc.utf8_trim_whitespace(payload), "null"), True)
    count = pc.sum(null).as_py() or 0
    if count:
        i = pc.index(null, True).as_py()
        rows = "1 row" if count == 1 else f"{count} rows"
        raise InvalidArgument(
            f"partition {partition} has {rows} with a null payload (the first: key "
            f"{_shown(key[i].as_py())}); every message needs a payload, and JSON null reads "
            "back like a missing one; fill it, e.g. F.coalesce(F.col('payload'), F.lit('{}'))"
        )


def normalise(batch: pa.RecordBatch, partition: int) -> pa.RecordBatch:
    """Validate one input batch and give its times an explicit UTC zone."""
    queue, key, payload, at = (batch.column(i) for i in range(4))
    _check_names(key, "key", KEY_MAX, partition, key, payload)
    _check_names(queue, "queue", QUEUE_MAX, partition, key, payload)
    _check_payloads(payload, partition, key)
    # Zoned values are instants; naive ones were allowed on the driver only as UTC.
    at = pc.cast(at, pa.timestamp("us", tz="UTC"))
    return pa.RecordBatch.from_arrays([queue, key, payload, at], names=list(WRITE_COLUMNS))
