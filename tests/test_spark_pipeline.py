"""The Spark pipeline against PostgreSQL, on a local SparkSession whose failed tasks are retried.

``local[2,2]``: two cores and two attempts per task, so a task that fails once is retried the way
a cluster retries it. Skipped cleanly when pyspark is not installed (CI installs the extra).
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

pyspark = pytest.importorskip("pyspark")
pytest.importorskip("pyarrow")

from pyspark.sql import SparkSession  # noqa: E402
from pyspark.sql import functions as F  # noqa: E402

from sqla_delayedq import DelayedMessage, DelayedQueue, InvalidArgument  # noqa: E402
from sqla_delayedq.spark import offer_dataframe, read_queue  # noqa: E402

T = DelayedMessage.__table__
BASE = datetime(2030, 1, 1, tzinfo=timezone.utc)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    os.environ["PYSPARK_PYTHON"] = sys.executable  # executors run this interpreter
    session = (
        SparkSession.builder.master("local[2,2]")
        .appName("sqla_delayedq-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.driver.memory", "2g")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


def url_of(pg: Any) -> str:
    return str(pg.url.render_as_string(hide_password=False))


def reminders(spark: SparkSession, n: int, partitions: int = 4) -> Any:
    """``n`` users, each with a reminder due at a distinct microsecond-precise time."""
    return spark.range(0, n, numPartitions=partitions).select(
        F.concat(F.lit("user/"), F.col("id").cast("string")).alias("key"),
        F.struct(F.col("id").alias("user_id"), F.lit("renew").alias("kind")).alias("payload"),
        F.timestamp_micros(
            F.lit(int(BASE.timestamp() * 1_000_000)) + F.col("id") * 1_000_003
        ).alias("due"),
    )


def stored(pg: Any, queue: str) -> dict[str, tuple[datetime, Any]]:
    with pg.engine.connect() as conn:
        rows = conn.execute(
            sa.select(T.c.key, T.c.scheduled_at, T.c.payload).where(T.c.queue == queue)
        ).all()
    return {k: (at, payload) for k, at, payload in rows}


def expected_due(i: int) -> datetime:
    return BASE + timedelta(microseconds=i * 1_000_003)


def test_200000_rows_enqueued_once_and_a_rerun_changes_nothing(spark, pg):
    n = 200_000
    df = reminders(spark, n)
    first = offer_dataframe(df, url_of(pg), "reminders", scheduled_at="due")
    assert (first.created, first.updated, first.ignored) == (n, 0, 0)
    assert not first.approximate
    rows = stored(pg, "reminders")
    assert len(rows) == n
    assert rows["user/12345"] == (expected_due(12345), {"user_id": 12345, "kind": "renew"})
    again = offer_dataframe(df, url_of(pg), "reminders", scheduled_at="due")
    assert (again.created, again.updated, again.ignored) == (0, 0, n)
    assert stored(pg, "reminders") == rows


def test_a_partition_that_fails_after_committing_part_of_its_rows_is_retried_exactly(
    spark, pg, tmp_path: Path
):
    n = 20_000
    marks = str(tmp_path)

    def fail_once(partition: int, committed: int) -> None:
        # Runs on the executor after each commit: the first attempt of every partition dies
        # after its first committed slice, like a task lost after a partial write.
        mark = Path(marks) / f"failed-{partition}"
        if not mark.exists():
            mark.write_text(str(committed))
            raise RuntimeError(f"injected failure in partition {partition} after {committed} rows")

    counts = offer_dataframe(
        reminders(spark, n),
        url_of(pg),
        "retried",
        scheduled_at="due",
        commit_every=1_000,
        after_commit=fail_once,
    )
    failed = sorted(p.name for p in tmp_path.iterdir())
    assert failed == [f"failed-{p}" for p in range(4)]  # every partition failed once
    assert counts.retried_partitions == 4 and counts.approximate
    assert counts.total == n
    rows = stored(pg, "retried")
    assert len(rows) == n  # no duplicates, nothing missing
    assert all(rows[f"user/{i}"][0] == expected_due(i) for i in range(0, n, 997))


def test_reading_back_equals_what_was_written_with_exact_timestamps(spark, pg):
    n = 5_000
    offer_dataframe(reminders(spark, n), url_of(pg), "readback", scheduled_at="due")
    df = read_queue(spark, url_of(pg), "readback", payload_fields={"user_id": "long"})
    got = {
        r["key"]: (r["due_us"], r["user_id"])
        for r in df.select(
            "key", F.unix_micros("scheduled_at").alias("due_us"), "user_id"
        ).collect()
    }
    want = {f"user/{i}": (int(expected_due(i).timestamp() * 1_000_000), i) for i in range(n)}
    assert got == want
    assert df.rdd.getNumPartitions() >= 1


def test_dead_letters_are_read_on_request(spark, pg, clock):
    q = DelayedQueue("dlq", clock=clock)
    with pg.Session() as s, s.begin():
        q.offer_batch(s, [(f"k{i}", {"i": i}) for i in range(10)])
        for _ in range(3):
            env = q.try_poll(s)
            s.execute(T.update().where(T.c.id == env.id).values(status="dead", scheduled_at=None))
    url = url_of(pg)
    assert read_queue(spark, url, "dlq").count() == 7
    assert read_queue(spark, url, "dlq", dead_letters="only").count() == 3
    assert read_queue(spark, url, "dlq", dead_letters="include").count() == 10


def test_passwords_never_travel_in_task_closures(pg):
    from sqla_delayedq.spark._common import connect_spec

    secret = "s3cret-Pa55word"
    url = pg.url.set(password=secret).render_as_string(hide_password=False)
    spec = connect_spec(url, None)
    assert secret not in repr(spec)
    assert secret.encode() not in pickle.dumps(spec)


def test_naive_timestamps_are_refused_unless_the_session_time_zone_is_utc(spark, pg):
    df = spark.range(0, 3).select(
        F.col("id").cast("string").alias("key"),
        F.to_json(F.struct("id")).alias("payload"),
        F.to_timestamp_ntz(F.lit("2030-01-01 00:00:00")).alias("due"),
    )
    spark.conf.set("spark.sql.session.timeZone", "Europe/Bucharest")
    try:
        with pytest.raises(InvalidArgument, match="TIMESTAMP_NTZ"):
            offer_dataframe(df, url_of(pg), "naive", scheduled_at="due")
    finally:
        spark.conf.set("spark.sql.session.timeZone", "UTC")
    counts = offer_dataframe(df, url_of(pg), "naive", scheduled_at="due")
    assert counts.created == 3
    assert stored(pg, "naive")["0"][0] == datetime(2030, 1, 1, tzinfo=timezone.utc)
