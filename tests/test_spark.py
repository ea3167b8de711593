"""Spark pipeline: offer_dataframe and read_queue against PostgreSQL on a local SparkSession.

``local[2,2]``: two cores, and each task may fail once and be retried, as on a cluster.
Every test here is a Spark test (``-k spark`` selects them); they skip when pyspark is absent.
"""

from __future__ import annotations

import os
import pickle
import sys
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

pytest.importorskip("pyspark", reason="pyspark is not installed (the 'spark' extra)")
pytest.importorskip("pyarrow")

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from sqla_delayedq import DelayedQueue, InvalidArgument
from sqla_delayedq.spark import OfferCounts, offer_dataframe, read_queue
from sqla_delayedq.spark._common import connect_spec, is_utc_zone
from sqla_delayedq.spark._datasource import ReadTask
from sqla_delayedq.spark._write import PartitionWriter
from tests.fix_db import Backend

pytestmark = pytest.mark.slow

UTC = timezone.utc
BASE_US = 1_767_225_600_000_000  # 2026-01-01T00:00:00Z in microseconds
SECRET = "s3cr3t-never-shipped"
ROWS = 200_000


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    session = (
        SparkSession.builder.master("local[2,2]")
        .appName("sqla_delayedq-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.driver.memory", "1g")
        .config("spark.python.worker.reuse", "true")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


def reminders(spark: SparkSession, n: int, partitions: int = 4) -> DataFrame:
    """n messages; due times with microseconds, payload as a struct."""
    return (
        spark.range(n, numPartitions=partitions)
        .withColumn("key", F.concat(F.lit("user/"), F.col("id").cast("string")))
        .withColumn(
            "payload",
            F.struct(F.col("id").alias("user_id"), F.lit("drink water").alias("text")),
        )
        .withColumn("due", F.timestamp_micros(F.lit(BASE_US) + F.col("id") * 7919 + 1))
    )


def table_rows(pg: Backend) -> list[tuple[Any, ...]]:
    with pg.engine.connect() as conn:
        return [
            tuple(r)
            for r in conn.execute(
                sa.text(
                    "SELECT id, queue, key, payload, scheduled_at, scheduled_at_initially, "
                    "created_at, status FROM delayed_queue ORDER BY key"
                )
            )
        ]


def test_spark_enqueue_200k_rerun_and_read_back_exactly(spark: SparkSession, pg: Backend) -> None:
    df = reminders(spark, ROWS)
    url = pg.url

    first = offer_dataframe(df, url, "reminders", scheduled_at="due")
    assert first == OfferCounts(
        created=ROWS, updated=0, ignored=0, partitions=4, retried_partitions=0
    )
    before = table_rows(pg)
    assert len(before) == ROWS

    again = offer_dataframe(df, url, "reminders", scheduled_at="due")
    assert (again.created, again.updated, again.ignored) == (0, 0, ROWS)
    assert table_rows(pg) == before  # same ids, same created_at: nothing changed

    back = read_queue(spark, url, "reminders", payload_fields={"user_id": "long", "text": "string"})
    written = df.select("key", F.col("due").alias("scheduled_at"), F.col("id").alias("user_id"))
    got = back.select("key", "scheduled_at", "user_id")
    assert back.count() == ROWS
    assert written.exceptAll(got).count() == 0
    assert got.exceptAll(written).count() == 0
    row = back.where(F.col("key") == "user/12345").first()
    assert row is not None
    expected = datetime.fromtimestamp(0, UTC) + timedelta(microseconds=BASE_US + 12345 * 7919 + 1)
    assert row.scheduled_at.replace(tzinfo=UTC) == expected  # session zone UTC: naive = UTC
    assert row.scheduled_at.microsecond == expected.microsecond != 0
    assert row.scheduled_at_initially == row.scheduled_at
    assert row.text == "drink water" and row.status == "pending" and row.attempts == 0


class FailOnceAfterFirstCommit:
    """Fault injection: each partition's first attempt dies right after its first commit."""

    def __init__(self, marker_dir: str) -> None:
        self.marker_dir = marker_dir

    def __call__(self, partition: int, committed: int) -> None:
        marker = Path(self.marker_dir) / f"partition-{partition}"
        if committed and not marker.exists():
            marker.write_text(str(committed))
            raise RuntimeError(f"injected failure after {committed} committed rows")


def test_spark_partition_retried_after_partial_commit_leaves_exact_rows(
    spark: SparkSession, pg: Backend, tmp_path: Path
) -> None:
    n = 40_000
    df = reminders(spark, n, partitions=2)
    counts = offer_dataframe(
        df,
        pg.url,
        "reminders",
        scheduled_at="due",
        commit_every=5_000,
        after_commit=FailOnceAfterFirstCommit(str(tmp_path)),
    )
    markers = sorted(p.name for p in tmp_path.iterdir())
    assert markers == ["partition-0", "partition-1"]  # both first attempts failed
    assert counts.retried_partitions == 2 and counts.approximate
    # The retries found each first slice already written, identical: ignored, not created.
    assert (counts.created, counts.updated, counts.ignored) == (n - 10_000, 0, 10_000)

    rows = table_rows(pg)
    assert len(rows) == n
    assert len({r[2] for r in rows}) == n
    assert sorted(r[2] for r in rows) == sorted(f"user/{i}" for i in range(n))


def test_spark_modes_match_offer(spark: SparkSession, pg: Backend) -> None:
    url = pg.url
    base = spark.createDataFrame(
        [(f"k{i}", f'{{"v": {i}}}', i) for i in range(6)], "key string, payload string, i int"
    ).withColumn("due", F.timestamp_micros(F.lit(BASE_US) + F.col("i")))
    assert offer_dataframe(base, url, "m", scheduled_at="due").created == 6

    changed = base.withColumn(
        "payload",
        F.when(F.col("i") < 2, F.lit('{"v": "new"}')).otherwise(F.col("payload")),
    ).withColumn(
        "due",
        F.when(F.col("i").between(2, 3), F.col("due") + F.expr("INTERVAL 1 HOUR")).otherwise(
            F.col("due")
        ),
    )
    skip = offer_dataframe(changed, url, "m", scheduled_at="due", mode="skip")
    assert (skip.created, skip.updated, skip.ignored) == (0, 0, 6)

    keep = offer_dataframe(changed, url, "m", scheduled_at="due", mode="keep_schedule")
    assert (keep.created, keep.updated, keep.ignored) == (0, 2, 4)  # only payload changes count

    replace = offer_dataframe(changed, url, "m", scheduled_at="due", mode="replace")
    assert (replace.created, replace.updated, replace.ignored) == (0, 2, 4)  # k2, k3 moved

    q: DelayedQueue[Any] = DelayedQueue("m")
    with pg.Session() as s:
        k0 = q.get(s, "k0")
        k2 = q.get(s, "k2")
    assert k0 is not None and k0.payload == {"v": "new"}
    assert k2 is not None
    assert k2.scheduled_at == datetime.fromtimestamp(0, UTC) + timedelta(
        microseconds=BASE_US + 2, hours=1
    )

    # No time given: "as soon as possible"; an identical payload is already there.
    asap = offer_dataframe(changed.drop("due"), url, "m", mode="replace")
    assert (asap.created, asap.updated, asap.ignored) == (0, 0, 6)


def test_spark_queue_column_payload_columns_and_dead_letters(
    spark: SparkSession, pg: Backend
) -> None:
    df = spark.createDataFrame(
        [("a", "k1", 1, "x"), ("a", "k2", 2, "y"), ("b", "k1", 3, "z")],
        "q string, key string, company_id long, note string",
    )
    counts = offer_dataframe(
        df, pg.url, queue_column="q", payload_columns=["company_id", "note"], mode="skip"
    )
    assert counts.created == 3
    with pg.engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE delayed_queue SET status = 'dead', scheduled_at = NULL WHERE key='k2'")
        )
    a = read_queue(spark, pg.url, "a", payload_fields={"company_id": "long"})
    assert [(r.key, r.company_id) for r in a.collect()] == [("k1", 1)]
    dead = read_queue(spark, pg.url, "a", dead_letters="only", columns=["key", "status"])
    assert [tuple(r) for r in dead.collect()] == [("k2", "dead")]
    every = read_queue(spark, pg.url, None, dead_letters="include", payload_fields=["note"])
    assert sorted((r.queue, r.key, r.note) for r in every.collect()) == [
        ("a", "k1", "x"),
        ("a", "k2", "y"),
        ("b", "k1", "z"),
    ]


def test_spark_naive_timestamps_need_a_utc_session(spark: SparkSession, pg: Backend) -> None:
    df = spark.createDataFrame(
        [("k", "{}", datetime(2026, 1, 1, 12, 0, 0, 123456))],
        "key string, payload string, due timestamp_ntz",
    )
    spark.conf.set("spark.sql.session.timeZone", "Europe/Paris")
    try:
        with pytest.raises(InvalidArgument, match="TIMESTAMP_NTZ"):
            offer_dataframe(df, pg.url, "tz", scheduled_at="due")
    finally:
        spark.conf.set("spark.sql.session.timeZone", "UTC")
    assert offer_dataframe(df, pg.url, "tz", scheduled_at="due").created == 1
    q: DelayedQueue[Any] = DelayedQueue("tz")
    with pg.Session() as s:
        info = q.get(s, "k")
    assert info is not None
    assert info.scheduled_at == datetime(2026, 1, 1, 12, 0, 0, 123456, tzinfo=UTC)


def test_spark_bad_input_is_refused_with_a_clear_error(spark: SparkSession, pg: Backend) -> None:
    df = spark.createDataFrame([("k", "{}", "2026-01-01")], "key string, payload string, d string")
    with pytest.raises(InvalidArgument, match="to_timestamp"):
        offer_dataframe(df, pg.url, "x", scheduled_at="d")
    with pytest.raises(InvalidArgument, match="exactly one"):
        offer_dataframe(df, pg.url)
    with pytest.raises(InvalidArgument, match="not in the DataFrame"):
        offer_dataframe(df, pg.url, "x", key="nope")
    with pytest.raises(InvalidArgument, match="unknown offer mode"):
        offer_dataframe(df, pg.url, "x", mode="upsert")
    nulls = spark.createDataFrame([(None, "{}")], "key string, payload string")
    with pytest.raises(Exception, match="null key"):
        offer_dataframe(nulls, pg.url, "x")
    assert table_rows(pg) == []


def test_spark_no_password_in_what_executors_receive(
    spark: SparkSession, pg: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pyspark import cloudpickle

    url = pg.url.set(password=SECRET)
    shipped: list[bytes] = []
    df = reminders(spark, 1000, partitions=2)
    frame = type(df)  # the classic (or Connect) DataFrame class
    real_map = frame.mapInArrow
    real_encode = ReadTask.encode

    def map_in_arrow(self: DataFrame, func: Any, *args: Any, **kwargs: Any) -> DataFrame:
        shipped.append(cloudpickle.dumps(func))
        return real_map(self, func, *args, **kwargs)

    def encode(self: ReadTask) -> str:
        text = real_encode(self)
        shipped.append(text.encode())
        shipped.append(cloudpickle.dumps(self))
        return text

    monkeypatch.setattr(frame, "mapInArrow", map_in_arrow)
    monkeypatch.setattr(ReadTask, "encode", encode)

    # The server trusts local connections, so the password-less executors still get in.
    assert offer_dataframe(df, url, "secrets", scheduled_at="due").created == 1000
    back = read_queue(spark, url, "secrets")
    assert back.count() == 1000
    assert len(shipped) == 3
    for blob in shipped:
        assert SECRET.encode() not in blob
        assert b"password" not in blob.lower()
    assert isinstance(pickle.loads(shipped[0]), PartitionWriter)
    assert SECRET not in back._jdf.queryExecution().toString()
    assert SECRET not in repr(connect_spec(url, None))


def test_spark_connection_factory_reads_and_writes(spark: SparkSession, pg: Backend) -> None:
    conninfo = f"host={pg.url.host} port={pg.url.port or 5432} dbname={pg.url.database} " + (
        f"user={pg.url.username}"
    )

    def connect() -> Any:
        import psycopg

        return psycopg.connect(conninfo)  # a real job would read its secret here

    df = reminders(spark, 2000, partitions=2)
    url = pg.url.set(username="nobody-uses-this")
    counts = offer_dataframe(df, pg.url, "factory", scheduled_at="due", connection_factory=connect)
    assert counts.created == 2000
    back = read_queue(
        spark, url, "factory", connection_factory=connect, payload_fields={"user_id": "long"}
    )
    assert back.count() == 2000
    assert back.agg(F.sum("user_id")).first()[0] == sum(range(2000))  # type: ignore[index]


def test_spark_utc_zone_names() -> None:
    for name in ("UTC", "Etc/UTC", "GMT", "Z", "+00:00", "-00:00", "UTC+0", "Etc/GMT+0"):
        assert is_utc_zone(name), name
    for name in ("Europe/Paris", "America/New_York", "+01:00", "Asia/Kolkata"):
        assert not is_utc_zone(name), name


def test_spark_sqlite_backend_goes_through_offer_batch(spark: SparkSession, tmp_path: Path) -> None:
    from sqla_delayedq import create_engine
    from sqla_delayedq.models import metadata

    url = f"sqlite:///{tmp_path / 'spark.sqlite'}"
    engine = create_engine(url)
    metadata.create_all(engine)
    engine.dispose()
    df = reminders(spark, 3000, partitions=2)
    assert offer_dataframe(df, url, "lite", scheduled_at="due").created == 3000
    again = offer_dataframe(df, url, "lite", scheduled_at="due")
    assert (again.created, again.updated, again.ignored) == (0, 0, 3000)
    back = read_queue(spark, url, "lite", payload_fields={"user_id": "long"})
    written = df.select("key", F.col("due").alias("scheduled_at"), F.col("id").alias("user_id"))
    got = back.select("key", "scheduled_at", "user_id")
    assert written.exceptAll(got).count() == 0 and got.exceptAll(written).count() == 0
