"""What the driver hands to executors, and the checks it makes first.

Executors get a :class:`ConnectSpec`: where the database is and who to log in as, never the
password. libpq (psycopg) finds the password on the executor itself, in ``PGPASSWORD``,
``PGPASSFILE`` or ``~/.pgpass``; or the user supplies ``connection_factory``, a callable the
executor calls to get a connection (it should read its secret there, not close over it).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.compute as pc  # type: ignore[import-untyped]
from sqlalchemy.engine import URL, make_url

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
    def is_postgresql(self) -> bool:
        return self.backend == "postgresql"

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


def connect_spec(url: str | URL, factory: ConnectionFactory | None) -> ConnectSpec:
    """The executor-side view of ``url``: the same database, without any secret."""
    try:
        parsed = make_url(url)
    except Exception as exc:
        raise InvalidArgument(f"not a database URL: {exc}") from None
    if factory is not None and not callable(factory):
        raise InvalidArgument("connection_factory must be a zero-argument callable")
    backend = parsed.get_backend_name()
    safe = _strip_secrets(parsed)
    assert safe.password is None
    if parsed.password is not None or safe.query != parsed.query:
        log.info(
            "the password in the database URL stays on the driver; executors use %s",
            "connection_factory" if factory else "PGPASSWORD / PGPASSFILE / ~/.pgpass",
        )
    conninfo = _conninfo(safe) if backend == "postgresql" else ""
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


def _check_names(column: pa.Array, what: str, limit: int, partition: int) -> None:
    if not len(column):
        return
    if column.null_count:
        raise InvalidArgument(
            f"{column.null_count} rows of partition {partition} have a null {what}; every "
            f"message needs a {what} (a generated key would defeat idempotent retries)"
        )
    lengths = pc.utf8_length(column)
    bounds = pc.min_max(lengths).as_py()
    if bounds["min"] == 0 or bounds["max"] > limit:
        bad = pc.or_(pc.equal(lengths, 0), pc.greater(lengths, limit))
        example = column.filter(bad)[0].as_py()
        raise InvalidArgument(
            f"partition {partition} has a {what} of {len(example)} characters "
            f"({example[:40]!r}); a {what} must be 1 to {limit} characters"
        )


def normalise(batch: pa.RecordBatch, partition: int) -> pa.RecordBatch:
    """Validate one input batch and give its times an explicit UTC zone."""
    queue, key, payload, at = (batch.column(i) for i in range(4))
    _check_names(queue, "queue", QUEUE_MAX, partition)
    _check_names(key, "key", KEY_MAX, partition)
    # Zoned values are instants; naive ones were allowed on the driver only as UTC.
    at = pc.cast(at, pa.timestamp("us", tz="UTC"))
    return pa.RecordBatch.from_arrays([queue, key, payload, at], names=list(WRITE_COLUMNS))
