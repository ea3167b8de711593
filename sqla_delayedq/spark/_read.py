"""``read_queue``: a queue's messages as a DataFrame, read in id ranges by the executors.

The driver asks the database once for the queue's id bounds and row count, cuts the id span
into equal ranges, and hands them to :class:`~._datasource.QueueDataSource`. Times come back
as ``TIMESTAMP`` (instants, exact to the microsecond); the payload as JSON text, and chosen
top-level payload fields as columns, extracted by the database (``payload ->> 'field'``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from sqlalchemy.engine import URL

from .._queue import check_name
from ..errors import InvalidArgument, UnsupportedBackend
from ..models import QUEUE_MAX
from ._common import (
    ROW_COLUMNS,
    ConnectionFactory,
    ReadPlan,
    connect_spec,
    driver_pg_connection,
    table_parts,
)

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.types import DataType

__all__ = ["read_queue"]

DeadLetters = Literal["exclude", "include", "only"]

#: Rows one read partition aims at when ``num_partitions`` is not given.
ROWS_PER_PARTITION = 500_000
#: Fewer rows than this per partition are not worth a task of their own.
MIN_ROWS_PER_PARTITION = 20_000

_BASE = tuple(name for name, _ in ROW_COLUMNS)


def _fields(
    payload_fields: Sequence[str] | Mapping[str, str | DataType] | None,
    columns: Sequence[str],
) -> dict[str, Any]:
    if payload_fields is None:
        return {}
    if isinstance(payload_fields, str):
        raise InvalidArgument("payload_fields must be a list of names or a {name: type} mapping")
    fields: dict[str, Any] = (
        dict(payload_fields)
        if isinstance(payload_fields, Mapping)
        else dict.fromkeys(payload_fields, "string")
    )
    for name in fields:
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"payload field names must be non-empty strings, got {name!r}")
        if name in columns:
            raise InvalidArgument(
                f"payload field {name!r} has the name of a message column; leave that column "
                "out with columns=[...], or read the field from the payload with from_json"
            )
    return fields


def _bounds(url: str | URL, factory: ConnectionFactory | None, plan: ReadPlan) -> tuple[int, ...]:
    """(min id, max id, rows) of what ``plan`` selects, asked on the driver."""
    spec_backend = connect_spec(url, factory).backend
    if spec_backend == "postgresql":
        from psycopg import sql

        from ._pg import status_conditions

        conds: list[sql.Composable] = [sql.SQL("TRUE")]
        if plan.queue is not None:
            conds.append(sql.SQL("queue = {}").format(sql.Literal(plan.queue)))
        conds += status_conditions(plan.dead_letters)
        query = sql.SQL("SELECT min(id), max(id), count(*) FROM {} WHERE {}").format(
            sql.Identifier(*plan.table), sql.SQL(" AND ").join(conds)
        )
        conn = driver_pg_connection(url, factory)
        try:
            row = conn.execute(query).fetchone()
        finally:
            conn.close()
    else:
        import sqlalchemy as sa

        from .._engine import create_engine
        from ._generic import _model_class

        t = _model_class(plan.table).__table__  # type: ignore[attr-defined]
        stmt = sa.select(sa.func.min(t.c.id), sa.func.max(t.c.id), sa.func.count())
        if plan.queue is not None:
            stmt = stmt.where(t.c.queue == plan.queue)
        if plan.dead_letters == "exclude":
            stmt = stmt.where(t.c.status != "dead")
        elif plan.dead_letters == "only":
            stmt = stmt.where(t.c.status == "dead")
        kwargs: dict[str, Any] = {"poolclass": sa.NullPool}
        if factory is not None:
            kwargs["creator"] = factory
        engine = create_engine(url, **kwargs)
        try:
            with engine.connect() as conn:
                row = conn.execute(stmt).one()
        finally:
            engine.dispose()
    lo, hi, count = row
    return (0, 0, 0) if count == 0 else (int(lo), int(hi), int(count))


def id_ranges(lo: int, hi: int, n: int) -> tuple[tuple[int, int], ...]:
    """``n`` half-open ranges of equal width covering ids ``lo..hi`` (inclusive)."""
    span = hi + 1 - lo
    n = max(1, min(n, span))
    edges = [lo + (span * i) // n for i in range(n + 1)]
    return tuple((edges[i], edges[i + 1]) for i in range(n))


def read_queue(
    spark: SparkSession,
    url: str | URL,
    queue: str | None,
    *,
    dead_letters: DeadLetters = "exclude",
    payload_fields: Sequence[str] | Mapping[str, str | DataType] | None = None,
    columns: Sequence[str] | None = None,
    table: str = "delayed_queue",
    schema: str | None = None,
    num_partitions: int | None = None,
    connection_factory: ConnectionFactory | None = None,
) -> DataFrame:
    """A queue's messages as a DataFrame, read by the executors in id ranges.

    :param queue: the queue's name; ``None`` reads every queue of the table.
    :param dead_letters: ``"exclude"`` (pending and done messages), ``"include"`` (all),
        or ``"only"`` (the dead letters alone).
    :param payload_fields: top-level payload fields to add as columns: a list of names
        (string columns) or ``{name: spark_type}`` (e.g. ``{"user_id": "long"}``); a value
        that does not convert is null.
    :param columns: which message columns to return (default: all of them).
    :param num_partitions: how many id ranges (tasks) to read; by default one per
        500,000 rows, at least the default parallelism, at most one per 20,000 rows.
    :param connection_factory: as for ``offer_dataframe``; also called on the driver.

    The DataFrame is a snapshot per partition, taken when each task runs: cache it if you
    use it more than once and need one consistent view.
    """
    from pyspark.sql import functions as F

    from ._datasource import NAME, QueueDataSource, ReadTask

    if queue is not None:
        check_name(queue, "queue name", QUEUE_MAX)
    if dead_letters not in ("exclude", "include", "only"):
        raise InvalidArgument(
            f"dead_letters must be 'exclude', 'include' or 'only', got {dead_letters!r}"
        )
    chosen = _BASE if columns is None else tuple(columns)
    unknown = [c for c in chosen if c not in _BASE]
    if unknown or isinstance(columns, str):
        raise InvalidArgument(f"unknown columns {unknown}; choose from {', '.join(_BASE)}")
    fields = _fields(payload_fields, chosen)
    if num_partitions is not None and (not isinstance(num_partitions, int) or num_partitions < 1):
        raise InvalidArgument(f"num_partitions must be a positive integer, got {num_partitions!r}")
    spec = connect_spec(url, connection_factory)
    if spec.backend not in ("postgresql", "mysql", "mariadb", "sqlite"):
        raise UnsupportedBackend(f"the {spec.backend!r} backend is not supported")
    plan = ReadPlan(
        table=table_parts(table, schema),
        columns=chosen,
        fields=tuple(fields),
        queue=queue,
        dead_letters=dead_letters,
    )
    lo, hi, count = _bounds(url, connection_factory, plan)
    if num_partitions is None:
        wanted = max(spark.sparkContext.defaultParallelism, math.ceil(count / ROWS_PER_PARTITION))
        num_partitions = max(1, min(wanted, math.ceil(count / MIN_ROWS_PER_PARTITION)))
    ranges = id_ranges(lo, hi, num_partitions) if count else ((0, 0),)
    types = dict(ROW_COLUMNS)
    ddl = ", ".join(
        [f"`{c}` {types[c]}" for c in chosen] + [f"`{f.replace('`', '``')}` STRING" for f in fields]
    )
    task = ReadTask(spec=spec, plan=plan, ranges=ranges, ddl=ddl)
    spark.dataSource.register(QueueDataSource)
    df = spark.read.format(NAME).schema(ddl).option("plan", task.encode()).load()
    for name, kind in fields.items():
        if kind != "string":
            df = df.withColumn(name, F.col(name).try_cast(kind))
    return df
