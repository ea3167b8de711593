"""``read_queue``: a queue's messages as a DataFrame, read in id ranges by the executors.

The driver asks the database once for the queue's id bounds, cuts the id span
into equal ranges, and hands them to :class:`~._datasource.QueueDataSource`. Times come back
as ``TIMESTAMP`` (instants, exact to the microsecond); the payload as JSON text, and chosen
top-level payload fields as columns, extracted by the database (``payload ->> 'field'``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from sqlalchemy.engine import URL

from .._codec import check_name
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

#: Ids one read partition aims at when ``num_partitions`` is not given.
IDS_PER_PARTITION = 500_000
#: Fewer ids than this per partition are not worth a task of their own.
MIN_IDS_PER_PARTITION = 20_000

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
    folded = {c.casefold() for c in columns}
    seen: dict[str, str] = {}
    for name in fields:
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"payload field names must be non-empty strings, got {name!r}")
        other = seen.setdefault(name.casefold(), name)
        if other != name:  # Spark's column names ignore case by default
            raise InvalidArgument(
                f"payload fields {other!r} and {name!r} differ only in case, which Spark's "
                "column names ignore; read one of them from the payload with from_json"
            )
        if name.casefold() in folded:
            raise InvalidArgument(
                f"payload field {name!r} has the name of a message column; leave that column "
                "out with columns=[...], or read the field from the payload with from_json"
            )
    return fields


def _bounds(
    url: str | URL, factory: ConnectionFactory | None, plan: ReadPlan
) -> tuple[int, int] | None:
    """(min id, max id) of what ``plan`` selects, asked on the driver; None when nothing is.

    No ``count(*)``: the tasks scan the id span whatever the number of rows in it, and on a
    freshly written table a count would be one more full scan (the one that sets the hint bits).
    ``min``/``max`` walk the primary key from each end.
    """
    if connect_spec(url, factory).is_postgresql:
        from psycopg import sql

        from ._pg import status_conditions

        conds: list[sql.Composable] = [sql.SQL("TRUE")]
        if plan.queue is not None:
            conds.append(sql.SQL("queue = {}").format(sql.Literal(plan.queue)))
        conds += status_conditions(plan.dead_letters)
        query = sql.SQL("SELECT min(id), max(id) FROM {} WHERE {}").format(
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
        from ._generic import model_class

        t = model_class(plan.table).__table__  # type: ignore[attr-defined]
        stmt = sa.select(sa.func.min(t.c.id), sa.func.max(t.c.id))
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
    lo, hi = row
    return None if lo is None else (int(lo), int(hi))


Bounds = tuple[int | None, int | None]


def id_ranges(lo: int, hi: int, n: int) -> tuple[Bounds, ...]:
    """``n`` half-open ranges of equal width over ids ``lo..hi``, open at both outer ends.

    The first range has no lower bound and the last no upper bound, so the ranges cover every
    id: rows added after the call (new ids are higher) fall in the last range, and a reused
    DataFrame reads them. Only the balance between ranges is fixed when the call plans them.
    """
    span = hi + 1 - lo
    n = max(1, min(n, span))
    edges: list[int | None] = [lo + (span * i) // n for i in range(n + 1)]
    edges[0] = edges[-1] = None
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
    :param num_partitions: how many id ranges (tasks) to read; by default one per 500,000
        ids of the queue's id span, at least the default parallelism, at most one per 20,000.
    :param connection_factory: as for ``offer_dataframe``; also called on the driver.

    Like any Spark source, the DataFrame is read again by every action: each task reads its
    id range as it is when the task runs, and the last range is open-ended, so rows added
    since the call are included (all in that range: call ``read_queue`` again to spread a
    much grown queue over the tasks). ``cache()`` it for one consistent view over several
    actions.
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
    if spec.family is None:
        raise UnsupportedBackend(f"the {spec.backend!r} backend is not supported")
    plan = ReadPlan(
        table=table_parts(table, schema),
        columns=chosen,
        fields=tuple(fields),
        queue=queue,
        dead_letters=dead_letters,
    )
    bounds = _bounds(url, connection_factory, plan)
    if bounds is None:
        ranges: tuple[Bounds, ...] = ((None, None),)
    else:
        lo, hi = bounds
        span = hi + 1 - lo
        if num_partitions is None:
            wanted = max(spark.sparkContext.defaultParallelism, math.ceil(span / IDS_PER_PARTITION))
            num_partitions = max(1, min(wanted, math.ceil(span / MIN_IDS_PER_PARTITION)))
        ranges = id_ranges(lo, hi, num_partitions)
    types = dict(ROW_COLUMNS)
    ddl = ", ".join(
        [f"`{c}` {types[c]}" for c in chosen] + [f"`{f.replace('`', '``')}` STRING" for f in fields]
    )
    task = ReadTask(spec=spec, plan=plan, ranges=ranges, ddl=ddl)
    spark.dataSource.register(QueueDataSource)
    df = spark.read.format(NAME).schema(ddl).option("plan", task.encode()).load()
    for name, kind in fields.items():
        if kind != "string":
            column = F.col(f"`{name.replace('`', '``')}`")  # a dot is part of the name
            df = df.withColumn(name, column.try_cast(kind))
    return df
