"""``offer_dataframe``: enqueue a DataFrame from the executors, partition by partition.

The driver checks the arguments and the column types, shapes the DataFrame into four columns
(queue, key, payload as JSON text, due time), and runs one ``mapInArrow`` job: each task opens
its own connection, writes its partition (``_pg`` or ``_generic``) and returns one row of counts.
On PostgreSQL the driver takes ``created`` and ``updated`` from the ledger of committed
transactions instead (``_ledger``). Nothing secret is in what the tasks receive (see
``_common``).
"""

from __future__ import annotations

import functools
import operator
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, cast

import pyarrow as pa  # type: ignore[import-untyped]
from sqlalchemy.engine import URL

from .._codec import check_name
from .._time import require_aware, system_clock
from .._types import OfferMode
from ..errors import InvalidArgument, UnsupportedBackend
from ..models import QUEUE_MAX
from ..serializers import JsonSerializer
from ._common import (
    ConnectionFactory,
    ConnectSpec,
    Counts,
    WritePlan,
    connect_spec,
    is_utc_zone,
    table_parts,
)
from ._ledger import Ledger

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame

__all__ = ["OfferCounts", "offer_dataframe"]

_COUNTS_SCHEMA = "partition INT, attempt INT, staged BIGINT, created BIGINT, updated BIGINT"
_COUNTS_ARROW = pa.schema(
    [
        ("partition", pa.int32()),
        ("attempt", pa.int32()),
        ("staged", pa.int64()),
        ("created", pa.int64()),
        ("updated", pa.int64()),
    ]
)

#: How struct, map and array payloads become JSON: times as UTC instants with microseconds
#: (``2026-01-01T12:00:00.123456Z``; ``TIMESTAMP_NTZ`` as wall-clock text without a zone),
#: whatever the session time zone, and null fields kept (``{"a": null}``, not ``{}``).
JSON_OPTIONS = {
    "timestampFormat": "yyyy-MM-dd'T'HH:mm:ss.SSSSSSXXX",
    "timestampNTZFormat": "yyyy-MM-dd'T'HH:mm:ss.SSSSSS",
    "timeZone": "UTC",
    "ignoreNullFields": "false",
}


@dataclass(frozen=True)
class OfferCounts:
    """What an :func:`offer_dataframe` call did, summed over the partitions.

    On PostgreSQL the counts are exact whatever Spark ran: every write transaction reports
    what it created and updated when it commits (see ``_ledger``), so rows that a retried,
    speculative or lost attempt committed count as this call's, once. ``ignored`` is the rest
    of the rows offered. On MariaDB/MySQL and SQLite each partition reports what its
    successful attempt saw; after a retry, or with ``spark.speculation`` on, another attempt
    may have committed rows first, and they are then counted as ``ignored`` (or ``updated``)
    instead of ``created``: ``approximate`` says so. The table is exact either way.
    """

    created: int
    updated: int
    ignored: int
    #: Partitions written (tasks that succeeded).
    partitions: int
    #: Partitions whose successful attempt was a retry.
    retried_partitions: int
    #: True when rows may have moved between the three counts (see above).
    approximate: bool = False

    @property
    def total(self) -> int:
        """Rows offered: ``created + updated + ignored``."""
        return self.created + self.updated + self.ignored


class PartitionWriter:
    """The function each task runs (``mapInArrow``): write one partition, yield its counts."""

    def __init__(self, spec: ConnectSpec, plan: WritePlan) -> None:
        self.spec = spec
        self.plan = plan

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        partition = ctx.partitionId() if ctx else 0
        attempt = ctx.attemptNumber() if ctx else 0
        first = next(batches, None)
        if first is None:  # an empty partition opens no connection
            counts = Counts()
        else:
            rest = _chain(first, batches)
            if self.spec.is_postgresql:
                from . import _pg

                counts = _pg.write_partition(self.spec, self.plan, rest, partition)
            else:
                from . import _generic

                counts = _generic.write_partition(self.spec, self.plan, rest, partition)
        row = [partition, attempt, counts.staged, counts.created, counts.updated]
        yield pa.RecordBatch.from_arrays([pa.array([v]) for v in row], schema=_COUNTS_ARROW)


def _chain(first: pa.RecordBatch, rest: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    yield first
    yield from rest


def _column(df: DataFrame, name: str, what: str) -> Any:
    if not isinstance(name, str) or name not in df.columns:
        raise InvalidArgument(
            f"{what} column {name!r} is not in the DataFrame (columns: {', '.join(df.columns)})"
        )
    return df.schema[name].dataType


def _key_expr(df: DataFrame, key: str) -> Column:
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    kind = _column(df, key, "key")
    if isinstance(kind, T.StringType):
        return F.col(key)
    if isinstance(kind, (T.IntegerType, T.LongType, T.ShortType, T.ByteType)):
        return F.col(key).cast("string")
    raise InvalidArgument(
        f"key column {key!r} is {kind.simpleString()}; use a string (or integer) column, "
        "e.g. F.concat(F.lit('reminder/'), F.col('user_id'))"
    )


def _payload_expr(df: DataFrame, payload: str | None, columns: Sequence[str] | None) -> Column:
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    if payload is not None and columns is not None:
        raise InvalidArgument("give payload or payload_columns, not both")
    if columns is not None:
        if isinstance(columns, str) or not columns:
            raise InvalidArgument("payload_columns must be a non-empty list of column names")
        for c in columns:
            _column(df, c, "payload")
        struct = F.struct(*(F.col(c) for c in columns))
        kinds = T.StructType([df.schema[c] for c in columns])
        return _refusing_nonfinite(struct, kinds, F.to_json(struct, JSON_OPTIONS))
    name = "payload" if payload is None else payload
    kind = _column(df, name, "payload")
    if isinstance(kind, T.StringType):
        return F.col(name)  # JSON text, checked by the database as it parses it
    if isinstance(kind, (T.StructType, T.MapType, T.ArrayType)):
        return _refusing_nonfinite(F.col(name), kind, F.to_json(F.col(name), JSON_OPTIONS))
    raise InvalidArgument(
        f"payload column {name!r} is {kind.simpleString()}; give JSON text (string), a struct, "
        "map or array, or name the fields with payload_columns=[...]"
    )


def _refusing_nonfinite(value: Column, kind: Any, text: Column) -> Column:
    """``text`` (``value`` as JSON), or the bare token ``NaN`` for a row whose doubles or floats
    hold NaN or an infinity: Spark writes those as the strings ``"NaN"`` and ``"Infinity"``, a
    payload changed without a word, where ``offer`` refuses them. The bare token is not JSON, so
    the row is refused by the same check as JSON text that holds it, naming its key."""
    from pyspark.sql import functions as F

    bad = _nonfinite(value, kind)
    return text if bad is None else F.when(bad, F.lit("NaN")).otherwise(text)


def _nonfinite(value: Column, kind: Any) -> Column | None:
    """Whether ``value`` (of Spark type ``kind``) holds a non-finite double or float anywhere
    (struct fields, array elements, map values), never null; None when its type has none."""
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    if not _has_floats(kind):
        return None
    if isinstance(kind, (T.DoubleType, T.FloatType)):
        infinite = F.lit(float("inf"))
        found = F.isnan(value) | (value == infinite) | (value == -infinite)
    elif isinstance(kind, T.StructType):
        fields = [_nonfinite(value.getField(f.name), f.dataType) for f in kind.fields]
        found = functools.reduce(operator.or_, [f for f in fields if f is not None])
    else:  # an array or a map, by its elements or values
        inner = kind.elementType if isinstance(kind, T.ArrayType) else kind.valueType
        items = value if isinstance(kind, T.ArrayType) else F.map_values(value)
        found = F.exists(items, lambda x: cast("Column", _nonfinite(x, inner)))
    return F.coalesce(found, F.lit(False))


def _has_floats(kind: Any) -> bool:
    from pyspark.sql import types as T

    if isinstance(kind, (T.DoubleType, T.FloatType)):
        return True
    if isinstance(kind, T.StructType):
        return any(_has_floats(f.dataType) for f in kind.fields)
    if isinstance(kind, T.ArrayType):
        return _has_floats(kind.elementType)
    if isinstance(kind, T.MapType):
        return _has_floats(kind.valueType)
    return False


def _at_expr(df: DataFrame, at: str | None) -> Column:
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    if at is None:
        return F.lit(None).cast("timestamp")
    kind = _column(df, at, "scheduled_at")
    if isinstance(kind, T.TimestampType):
        return F.col(at)  # an instant: exact whatever the session time zone
    if isinstance(kind, T.TimestampNTZType):
        zone = df.sparkSession.conf.get("spark.sql.session.timeZone") or ""
        if not is_utc_zone(zone):
            raise InvalidArgument(
                f"scheduled_at column {at!r} is TIMESTAMP_NTZ (wall-clock times without a "
                f"zone) and the session time zone is {zone!r}, so the instants are ambiguous; "
                "convert the column to TIMESTAMP, naming the zone its times are in, e.g. "
                f"`{wall_clock_recipe(at, zone)}` (right under any session time zone), or set "
                "spark.sql.session.timeZone to UTC if they are UTC times"
            )
        return F.col(at)  # naive values, read as UTC
    raise InvalidArgument(
        f"scheduled_at column {at!r} is {kind.simpleString()}; it must be TIMESTAMP "
        "(or TIMESTAMP_NTZ under a UTC session time zone); parse strings with F.to_timestamp"
    )


def wall_clock_recipe(column: str, zone: str) -> str:
    """A PySpark expression that reads wall-clock ``column`` (TIMESTAMP_NTZ) in ``zone``.

    The text of the value with the zone appended, cast to ``TIMESTAMP``: the zone in the text
    decides the instant, so the session time zone plays no part (``F.to_utc_timestamp``
    would apply the session zone first, then the given one). Across a DST change the offset
    of each value's own date applies; a time that is skipped or repeated takes the earlier
    offset.
    """
    return f"F.concat(F.col({column!r}).cast('string'), F.lit(' {zone}')).cast('timestamp')"


def _queue_expr(df: DataFrame, queue: str | None, queue_column: str | None) -> Column:
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    if (queue is None) == (queue_column is None):
        raise InvalidArgument("give exactly one of queue (a name) and queue_column")
    if queue is not None:
        return F.lit(check_name(queue, "queue name", QUEUE_MAX))
    assert queue_column is not None
    kind = _column(df, queue_column, "queue")
    if not isinstance(kind, T.StringType):
        raise InvalidArgument(f"queue column {queue_column!r} must be a string column")
    return F.col(queue_column)


def offer_dataframe(
    df: DataFrame,
    url: str | URL,
    queue: str | None = None,
    *,
    key: str = "key",
    payload: str | None = None,
    payload_columns: Sequence[str] | None = None,
    scheduled_at: str | None = None,
    queue_column: str | None = None,
    mode: OfferMode | str = OfferMode.REPLACE,
    table: str = "delayed_queue",
    schema: str | None = None,
    payload_type: str = "json",
    partitions: int | None = None,
    commit_every: int | None = None,
    connection_factory: ConnectionFactory | None = None,
    notify: bool = True,
    now: datetime | None = None,
    after_commit: Callable[[int, int], None] | None = None,
) -> OfferCounts:
    """Offer every row of ``df`` as a message, writing from the executors.

    :param url: the database (SQLAlchemy URL). Its password never leaves the driver: executors
        take it from ``PGPASSWORD`` / ``PGPASSFILE`` / ``~/.pgpass``, or use
        ``connection_factory``.
    :param queue: the queue of every row; or ``queue_column`` names a string column.
    :param key: the key column (string, or integer cast to string); null keys are refused.
    :param payload: a column of JSON text, or a struct/map/array column (sent as JSON);
        defaults to ``"payload"``. Or ``payload_columns``: the payload is a JSON object of
        those columns.
    :param scheduled_at: the due-time column (``TIMESTAMP``; ``TIMESTAMP_NTZ`` only under a
        UTC session time zone); ``None`` or a null value means "as soon as possible".
    :param mode: ``replace``, ``keep_schedule`` or ``skip``, as for ``DelayedQueue.offer``.
    :param partitions: repartition by (queue, key) into this many tasks (one connection each)
        first; otherwise the DataFrame's own partitions are written as they are.
    :param commit_every: commit every this many rows of a partition instead of once at its end.
    :param connection_factory: a zero-argument callable run on the executors that returns a
        connection (psycopg 3 on PostgreSQL, a DB-API connection elsewhere); on PostgreSQL
        the driver also calls it once, for the connection that collects the counts.
    :param notify: on PostgreSQL, ``NOTIFY`` the queue's workers when a partition commits.
    :param now: the creation time (and the time of rows with no schedule); default: now.
    :param after_commit: called on the executor after each commit with the partition number
        and the rows that task has committed so far (for progress, or fault injection).

    Safe to run again: rows already there as offered are ``ignored`` (one a worker has
    acknowledged since is gone, and offered again, unless the queue keeps handled messages
    with ``retention`` and ``mode="skip"``; see docs/spark.md). On PostgreSQL the counts
    are exact whichever task attempts committed; elsewhere they may be approximate after a
    retry (see :class:`OfferCounts`). A bad row (null or over-long key, null payload or one
    that is not JSON) fails its partition's transaction and the call, with an
    :class:`InvalidArgument` naming the row.
    """
    with prepare_offer(
        df,
        url,
        queue,
        key=key,
        payload=payload,
        payload_columns=payload_columns,
        scheduled_at=scheduled_at,
        queue_column=queue_column,
        mode=mode,
        table=table,
        schema=schema,
        payload_type=payload_type,
        partitions=partitions,
        commit_every=commit_every,
        connection_factory=connection_factory,
        notify=notify,
        now=now,
        after_commit=after_commit,
    ) as call:
        return call.run()


@dataclass
class OfferCall:
    """One ``offer_dataframe`` call, prepared on the driver: run it once, inside ``with``.

    ``prepared`` is the four-column DataFrame the tasks write; ``spec`` and ``plan`` are what
    they receive. On PostgreSQL the ledger listens from before the job starts (see
    ``_ledger``), so it hears every transaction any attempt of any task commits. Tests use
    the split to run a copy of a task with the call's own plan, as speculation would.
    """

    prepared: DataFrame
    spec: ConnectSpec
    plan: WritePlan
    ledger: Ledger | None
    speculation: bool

    def __enter__(self) -> OfferCall:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.ledger is not None:
            self.ledger.close()

    def run(self) -> OfferCounts:
        writer = PartitionWriter(self.spec, self.plan)
        try:
            rows = self.prepared.mapInArrow(writer, _COUNTS_SCHEMA).collect()
        except Exception as exc:
            refusal = executor_refusal(exc)
            if refusal is not None:
                raise InvalidArgument(refusal) from exc
            raise
        offered = sum(r.staged for r in rows)
        retried = sum(1 for r in rows if r.attempt > 0)
        settled = self.ledger.settle() if self.ledger is not None else None
        if settled is not None:
            created, updated = settled
            approximate = created + updated > offered  # input that differs between attempts
            updated = min(updated, offered - min(created, offered))
            created = min(created, offered)
        else:
            created = sum(r.created for r in rows)
            updated = sum(r.updated for r in rows)
            approximate = retried > 0 or self.speculation
        return OfferCounts(
            created=created,
            updated=updated,
            ignored=offered - created - updated,
            partitions=len(rows),
            retried_partitions=retried,
            approximate=approximate,
        )


_REFUSAL = re.compile(r"sqla_delayedq\.errors\.(?:InvalidArgument|EncodeError): (.+)")


def executor_refusal(exc: BaseException) -> str | None:
    """The message of an ``InvalidArgument`` a task raised (bad input), if that failed the job."""
    found = _REFUSAL.findall(str(exc))
    return found[-1].strip() if found else None


def prepare_offer(
    df: DataFrame,
    url: str | URL,
    queue: str | None = None,
    *,
    key: str = "key",
    payload: str | None = None,
    payload_columns: Sequence[str] | None = None,
    scheduled_at: str | None = None,
    queue_column: str | None = None,
    mode: OfferMode | str = OfferMode.REPLACE,
    table: str = "delayed_queue",
    schema: str | None = None,
    payload_type: str = "json",
    partitions: int | None = None,
    commit_every: int | None = None,
    connection_factory: ConnectionFactory | None = None,
    notify: bool = True,
    now: datetime | None = None,
    after_commit: Callable[[int, int], None] | None = None,
) -> OfferCall:
    """Check the arguments and shape the DataFrame; the arguments of :func:`offer_dataframe`."""
    from pyspark.sql import DataFrame

    if not isinstance(df, DataFrame):
        raise InvalidArgument(f"df must be a pyspark DataFrame, got {type(df).__name__}")
    mode = OfferMode.parse(mode)
    JsonSerializer(payload_type)  # validates the type name
    if commit_every is not None and (
        not isinstance(commit_every, int) or isinstance(commit_every, bool) or commit_every < 1
    ):
        raise InvalidArgument(f"commit_every must be a positive integer, got {commit_every!r}")
    if partitions is not None and (not isinstance(partitions, int) or partitions < 1):
        raise InvalidArgument(f"partitions must be a positive integer, got {partitions!r}")
    spec = connect_spec(url, connection_factory)
    if spec.family is None:
        raise UnsupportedBackend(
            f"the {spec.backend!r} backend is not supported; use PostgreSQL, MariaDB/MySQL "
            "or SQLite"
        )
    prepared = df.select(
        _queue_expr(df, queue, queue_column).alias("queue"),
        _key_expr(df, key).alias("key"),
        _payload_expr(df, payload, payload_columns).alias("payload"),
        _at_expr(df, scheduled_at).alias("at"),
    )
    if partitions is not None:
        prepared = prepared.repartition(partitions, "queue", "key")
    speculation = (df.sparkSession.conf.get("spark.speculation", "false") or "").lower() == "true"
    parts = table_parts(table, schema)
    now = system_clock() if now is None else require_aware(now, "now")
    ledger = Ledger.open(url, connection_factory) if spec.is_postgresql else None
    plan = WritePlan(
        table=parts,
        mode=mode,
        payload_type=payload_type,
        now=now,
        commit_every=commit_every,
        notify=notify,
        after_commit=after_commit,
        ledger=None if ledger is None else ledger.channel,
    )
    return OfferCall(prepared, spec, plan, ledger, speculation)
