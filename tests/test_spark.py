"""Spark pipeline: offer_dataframe and read_queue against PostgreSQL on a local SparkSession.

``local[2,2]``: two cores, and each task may fail once and be retried, as on a cluster.
Every test here is a Spark test (``-k spark`` selects them); they skip when pyspark is absent.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

pytest.importorskip("pyspark", reason="pyspark is not installed (the 'spark' extra)")
pytest.importorskip("pyarrow")

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from sqla_delayedq import DelayedQueue, InvalidArgument, create_engine
from sqla_delayedq.spark import OfferCounts, offer_dataframe, read_queue
from sqla_delayedq.spark._common import connect_spec, is_utc_zone
from sqla_delayedq.spark._datasource import ReadTask
from sqla_delayedq.spark._write import PartitionWriter, prepare_offer
from tests.fix_db import Backend

pytestmark = pytest.mark.slow

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


def target_url(backend: str, pg: Backend, sqlite_file: Path) -> Any:
    """PostgreSQL's test database, or a SQLite file with the queue table created."""
    if backend != "sqlite":
        return pg.url
    from sqla_delayedq.models import metadata

    url = f"sqlite:///{sqlite_file}"
    engine = create_engine(url)
    metadata.create_all(engine)
    engine.dispose()
    return url


def good_rows(spark: SparkSession, n: int) -> DataFrame:
    """``n`` valid rows in one partition: keys ``good/<i>``, payloads ``{"i": i}``."""
    return spark.range(n, numPartitions=1).select(
        F.concat(F.lit("good/"), F.col("id").cast("string")).alias("key"),
        F.to_json(F.struct(F.col("id").alias("i"))).alias("payload"),
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
    # The retries found each first slice already written; the failed attempts' commits
    # still count as created by this call, and the counts know it.
    assert counts == OfferCounts(
        created=n, updated=0, ignored=0, partitions=2, retried_partitions=2, approximate=False
    )

    rows = table_rows(pg)
    assert len(rows) == n
    assert len({r[2] for r in rows}) == n
    assert sorted(r[2] for r in rows) == sorted(f"user/{i}" for i in range(n))


class HandleOneThenFailOnce:
    """Fault injection with a worker between: after the first commit of its partition's first
    attempt, a consumer takes one committed row, handles and acknowledges it; then the attempt
    dies, and Spark retries the partition."""

    def __init__(self, marker_dir: str, url: str, retention: timedelta | None) -> None:
        self.marker_dir, self.url, self.retention = marker_dir, url, retention

    def __call__(self, partition: int, committed: int) -> None:
        marker = Path(self.marker_dir) / f"partition-{partition}"
        if not committed or marker.exists():
            return
        from sqlalchemy.orm import Session

        engine = create_engine(self.url)
        try:
            q: DelayedQueue[Any] = DelayedQueue("reminders", retention=self.retention)
            with Session(engine) as s, s.begin():
                env = q.try_poll(s)
                assert env is not None
                assert q.ack(s, env)
        finally:
            engine.dispose()
        marker.write_text(env.key)
        raise RuntimeError(f"injected failure after {committed} committed rows")


@pytest.mark.parametrize("kept", [False, True], ids=["deleted", "kept with retention"])
def test_spark_retry_after_a_worker_handled_a_committed_row(
    spark: SparkSession, pg: Backend, tmp_path: Path, kept: bool
) -> None:
    """docs/spark.md, "With workers consuming while the job runs": a retry offers again a row
    that a worker acknowledged (deleted) after the failed attempt committed it, so it is
    created and delivered again; with the queue's ``retention`` and ``mode="skip"`` the
    handled row is still there, as done, and the retry leaves it alone."""
    n = 20
    url = pg.url.render_as_string(hide_password=False)
    counts = offer_dataframe(
        reminders(spark, n, partitions=1),
        pg.url,
        "reminders",
        scheduled_at="due",
        mode="skip" if kept else "replace",
        commit_every=5,
        after_commit=HandleOneThenFailOnce(str(tmp_path), url, timedelta(days=1) if kept else None),
    )
    handled = (tmp_path / "partition-0").read_text()
    assert counts.retried_partitions == 1
    with pg.engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT status FROM delayed_queue WHERE key = :k"), {"k": handled}
        ).all()
        total = conn.execute(sa.text("SELECT count(*) FROM delayed_queue")).scalar()
    assert total == n  # every key there: the handled one again, or kept as done
    if kept:
        assert [r.status for r in rows] == ["done"]  # not offered again
        assert counts.created == n
    else:
        assert [r.status for r in rows] == ["pending"]  # created again: delivered twice
        # Counted twice: 21 created of 20 offered, clamped and flagged (an overcount within
        # the rows offered, when some were there before, would not be).
        assert counts.created == n and counts.approximate


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


def test_spark_an_update_of_a_message_in_flight_is_held_as_offer_holds_it(
    spark: SparkSession, pg: Backend
) -> None:
    """The bulk upsert writes what ``offer`` writes for a message in flight: held for the old
    delivery (its token behind the hold's mark), never taken beside the old handler, and the
    old consumer's ack ends the hold without settling the new version."""
    from sqla_delayedq._rules import held_parts

    q: DelayedQueue[Any] = DelayedQueue("held", lease=timedelta(minutes=5))
    with pg.Session() as s, s.begin():
        q.offer_batch(s, [("keep", {"v": 1}), ("replace", {"v": 1}), ("late", {"v": 1})])
    with pg.Session() as s, s.begin():
        taken = {e.key: e for e in q.try_poll_many(s, 3)}
    assert set(taken) == {"keep", "replace", "late"}
    later = datetime.now(UTC).replace(microsecond=0) + timedelta(hours=1)
    rows = [("keep", '{"v": 2}', None), ("replace", '{"v": 2}', None), ("late", '{"v": 2}', later)]
    df = spark.createDataFrame(rows, "key string, payload string, due timestamp")
    keep = offer_dataframe(
        df.where("key = 'keep'").drop("due"), pg.url, "held", mode="keep_schedule"
    )
    replace = offer_dataframe(df.where("key <> 'keep'"), pg.url, "held", scheduled_at="due")
    assert (keep.updated, replace.updated) == (1, 2)
    # KEEP_SCHEDULE over a held message keeps the held version's own time, as offer does.
    again_late = spark.createDataFrame([("late", '{"v": 3}')], "key string, payload string")
    assert offer_dataframe(again_late, pg.url, "held", mode="keep_schedule").updated == 1
    t = q.table
    with pg.Session() as s:
        stored = {
            r.key: r
            for r in s.execute(sa.select(t.c.key, t.c.lock_token, t.c.scheduled_at, t.c.attempts))
        }
    for key, env in taken.items():  # held to the old lease's end, their own time in the token
        parts = held_parts(stored[key].lock_token)
        assert parts is not None and parts[1] == env.lock_token, stored[key]
        assert stored[key].scheduled_at == env.lease_until
        assert parts[0] is not None
        if key == "late":
            assert parts[0] == later
        else:
            assert parts[0] <= datetime.now(UTC)
    with pg.Session() as s, s.begin():
        assert q.try_poll_many(s, 5) == []  # never beside the old handlers
        assert not any(q.ack(s, env) for env in taken.values())  # each ends its hold
    with pg.Session() as s, s.begin():
        again = q.try_poll_many(s, 5)
        assert q.get(s, "late").scheduled_at == later  # due at its own time
    assert sorted(e.key for e in again) == ["keep", "replace"]
    assert all(e.payload == {"v": 2} and e.attempt == 1 for e in again)


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


def test_spark_payload_fields_with_a_dot_or_a_column_s_name_in_other_case(
    spark: SparkSession, pg: Backend
) -> None:
    """A typed field whose name holds a dot was read as a struct path (``UNRESOLVED_COLUMN``),
    and ``ID`` passed the check against the message columns, then failed as an ambiguous
    reference: Spark's names ignore case (found in review)."""
    q: DelayedQueue[Any] = DelayedQueue("dotted")
    with pg.Session.begin() as s:
        q.offer(s, "k", {"a.b": 7, "ID": "x"})
    df = read_queue(spark, pg.url, "dotted", payload_fields={"a.b": "long"})
    assert [r["a.b"] for r in df.collect()] == [7]
    with pytest.raises(InvalidArgument, match="'ID' has the name of a message column"):
        read_queue(spark, pg.url, "dotted", payload_fields=["ID"])
    with pytest.raises(InvalidArgument, match="'a' and 'A' differ only in case"):
        read_queue(spark, pg.url, "dotted", payload_fields={"a": "long", "A": "long"})


def test_spark_naive_timestamps_are_read_as_utc_under_a_utc_session(
    spark: SparkSession, pg: Backend
) -> None:
    df = spark.createDataFrame(
        [("k", "{}", datetime(2026, 1, 1, 12, 0, 0, 123456))],
        "key string, payload string, due timestamp_ntz",
    )
    assert offer_dataframe(df, pg.url, "tz", scheduled_at="due").created == 1
    q: DelayedQueue[Any] = DelayedQueue("tz")
    with pg.Session() as s:
        info = q.get(s, "k")
    assert info is not None
    assert info.scheduled_at == datetime(2026, 1, 1, 12, 0, 0, 123456, tzinfo=UTC)


#: Noon (with microseconds) the day before and the day after each zone's DST change in 2026.
DST_DAYS = {
    "Europe/Paris": ((3, 28), (3, 29), (10, 24), (10, 25)),
    "America/New_York": ((3, 7), (3, 8), (10, 31), (11, 1)),
    "Australia/Sydney": ((4, 4), (4, 5), (10, 3), (10, 4)),
}


@pytest.mark.parametrize("session_zone", sorted(DST_DAYS))
def test_spark_naive_timestamp_advice_gives_the_right_instant(
    spark: SparkSession, pg: Backend, session_zone: str
) -> None:
    """Under a non-UTC session the refusal's recipe, pasted, stores each wall-clock time's instant.

    Wall-clock times of the session's own zone (the usual case) and of another zone, on both
    sides of each DST change.
    """
    from zoneinfo import ZoneInfo

    walls = [datetime(2026, m, d, 12, 0, 0, 123456) for z in DST_DAYS.values() for m, d in z]
    naive = spark.createDataFrame(
        [(f"k{i}", "{}", w) for i, w in enumerate(walls)],
        "key string, payload string, due timestamp_ntz",
    )
    spark.conf.set("spark.sql.session.timeZone", session_zone)
    try:
        with pytest.raises(InvalidArgument, match="TIMESTAMP_NTZ") as refused:
            offer_dataframe(naive, pg.url, "tz", scheduled_at="due")
        recipe = re.search(r"`(F\.[^`]+)`", str(refused.value))
        assert recipe is not None, refused.value
        assert f"' {session_zone}'" in recipe[1]
        other = "Europe/Paris" if session_zone != "Europe/Paris" else "America/New_York"
        for queue, zone in ((session_zone, session_zone), (other, other)):
            code = recipe[1].replace(f"' {session_zone}'", f"' {zone}'")
            df = naive.withColumn("due", eval(code, {"F": F}))
            assert offer_dataframe(df, pg.url, queue, scheduled_at="due").created == len(walls)
    finally:
        spark.conf.set("spark.sql.session.timeZone", "UTC")
    for zone in (session_zone, other):
        q: DelayedQueue[Any] = DelayedQueue(zone)
        with pg.Session() as s:
            stored = [q.get(s, f"k{i}") for i in range(len(walls))]
        expected = [w.replace(tzinfo=ZoneInfo(zone)).astimezone(UTC) for w in walls]
        assert [m.scheduled_at if m else None for m in stored] == expected, zone


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
    assert table_rows(pg) == []


def test_spark_bad_rows_are_refused_naming_the_offending_key(
    spark: SparkSession, pg: Backend
) -> None:
    """A bad row fails its partition's transaction, and the error names the row's key."""
    n = 5000
    good = spark.range(n, numPartitions=1).select(
        F.concat(F.lit("good/"), F.col("id").cast("string")).alias("key"),
        F.to_json(F.struct(F.col("id").alias("i"))).alias("payload"),
    )

    def with_row(key: str | None, payload: str) -> DataFrame:
        bad = spark.createDataFrame([(key, payload)], "key string, payload string")
        return good.limit(3777).union(bad).union(good.offset(3777)).coalesce(1)

    with pytest.raises(InvalidArgument, match=r"null key \(the first: payload '\{\"who\": 7\}'\)"):
        offer_dataframe(with_row(None, '{"who": 7}'), pg.url, "bad")
    long_key = "reminder/" + "x" * 200
    with pytest.raises(InvalidArgument, match=r"key of 209 characters: 'reminder/xxx.*1 to 200"):
        offer_dataframe(with_row(long_key, "{}"), pg.url, "bad")
    with pytest.raises(InvalidArgument, match=r"payload of key 'user/not-json' .* not JSON"):
        offer_dataframe(with_row("user/not-json", '{"a": 1,}'), pg.url, "bad")
    with pytest.raises(InvalidArgument, match=r"payload of key 'user/nul' .* not JSON"):
        offer_dataframe(with_row("user/nul", '{"a": "\\u0000"}'), pg.url, "bad")
    assert table_rows(pg) == []  # each refused partition wrote nothing
    assert offer_dataframe(good, pg.url, "bad").created == n  # and the good rows go in


@pytest.mark.parametrize("backend", ["postgresql", "sqlite"])
def test_spark_unstorable_rows_are_refused_naming_their_key(
    spark: SparkSession, pg: Backend, tmp_path: Path, backend: str
) -> None:
    """A NUL character in a key or payload text, and payloads that JSON refuses (NaN,
    Infinity, a lone surrogate): an ``InvalidArgument`` naming the row's key, not a raw driver
    or encoder error from inside a task; nothing of the partition is written."""
    url = target_url(backend, pg, tmp_path / "unstorable.sqlite")
    good = good_rows(spark, 20)
    cases = [
        ("user/\x00nul", "{}", r"key with a NUL character"),
        ("user/raw-nul", '{"a": "x\x00y"}', r"NUL character \(key 'user/raw-nul'\)"),
        ("user/nan", '{"a": NaN}', r"'user/nan'"),
        ("user/inf", '{"a": Infinity}', r"'user/inf'"),
        ("user/surrogate", '{"a": "\\ud800"}', r"'user/surrogate'"),
    ]
    for key, payload, match in cases:
        bad = spark.createDataFrame([(key, payload)], "key string, payload string")
        with pytest.raises(InvalidArgument, match=match):
            offer_dataframe(good.union(bad).coalesce(1), url, "unstorable")
    q: DelayedQueue[Any] = DelayedQueue("unstorable")
    with create_engine(url).connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(q.table)).scalar_one() == 0


@pytest.mark.parametrize("backend", ["postgresql", "sqlite"])
def test_spark_non_finite_doubles_in_struct_payloads_are_refused_naming_their_key(
    spark: SparkSession, pg: Backend, tmp_path: Path, backend: str
) -> None:
    """Spark's ``to_json`` writes a double's NaN or infinity as the strings ``"NaN"`` and
    ``"Infinity"``: the row went in, and its handler got a string where the column was a
    double, where ``offer`` refuses the value (found in review). Anywhere in the payload: a
    field, a nested struct's, an array's element, a map's value, ``payload_columns``."""
    url = target_url(backend, pg, tmp_path / "nonfinite.sqlite")
    schema = (
        "key string, p struct<x: double, inner: struct<y: float>, xs: array<double>,"
        " m: map<string, double>>"
    )
    fine = ("user/fine", (1.5, (2.5,), [3.0, None], {"a": 4.0}))
    nan, inf = float("nan"), float("inf")
    cases = [
        ("user/field", (nan, (0.0,), [], {})),
        ("user/nested", (0.0, (-inf,), [], {})),
        ("user/element", (0.0, None, [1.0, inf], {})),
        ("user/value", (None, (0.0,), None, {"b": nan})),
    ]
    for key, value in cases:
        df = spark.createDataFrame([fine, (key, value)], schema).coalesce(1)
        with pytest.raises(InvalidArgument, match=f"'{key}'"):
            offer_dataframe(df, url, "nonfinite", payload="p")
    flat = spark.createDataFrame([("user/flat", nan, "a")], "key string, x double, s string")
    with pytest.raises(InvalidArgument, match="'user/flat'"):
        offer_dataframe(flat, url, "nonfinite", payload_columns=["x", "s"])
    q: DelayedQueue[Any] = DelayedQueue("nonfinite")
    with create_engine(url).connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(q.table)).scalar_one() == 0
    df = spark.createDataFrame([fine], schema)
    assert offer_dataframe(df, url, "nonfinite", payload="p").created == 1
    with create_engine(url).connect() as conn, Session(conn) as s:
        info = q.get(s, "user/fine")
    assert info is not None
    assert info.payload == {"x": 1.5, "inner": {"y": 2.5}, "xs": [3.0, None], "m": {"a": 4.0}}


@pytest.mark.parametrize("backend", ["postgresql", "sqlite"])
def test_spark_null_payloads_are_refused_not_buried_dead(
    spark: SparkSession, pg: Backend, tmp_path: Path, backend: str
) -> None:
    """A null payload (SQL NULL or the JSON text ``null``) is refused, naming its key.

    Written, it would read back like a missing payload: the row's first take would bury it
    dead without its handler running.
    """
    url = target_url(backend, pg, tmp_path / "nulls.sqlite")
    good = good_rows(spark, 50)
    for payload in (None, "null", " null\n"):
        bad = spark.createDataFrame([("user/empty", payload)], "key string, payload string")
        with pytest.raises(InvalidArgument, match=r"1 row with a null payload .*'user/empty'"):
            offer_dataframe(good.union(bad).coalesce(1), url, "nulls")
    structs = spark.createDataFrame(
        [("user/1", (1,)), ("user/2", None), ("user/3", None)], "key string, payload struct<a: int>"
    ).coalesce(1)
    with pytest.raises(InvalidArgument, match=r"2 rows with a null payload .*'user/2'"):
        offer_dataframe(structs, url, "nulls")
    # Nothing of a refused partition was written; the good rows then go in, fields null or not.
    check = create_engine(url)
    try:
        with check.connect() as conn:
            assert conn.execute(sa.text("SELECT count(*) FROM delayed_queue")).scalar() == 0
    finally:
        check.dispose()
    fine = spark.createDataFrame(
        [("user/1", (1,)), ("user/2", (None,))], "key string, payload struct<a: int>"
    )
    assert offer_dataframe(fine, url, "nulls").created == 2
    q: DelayedQueue[Any] = DelayedQueue("nulls")
    check = create_engine(url)
    try:
        with sa.orm.Session(check) as s:
            taken = q.try_poll_many(s, 10)
            assert sorted((m.key, m.payload) for m in taken) == [
                ("user/1", {"a": 1}),
                ("user/2", {"a": None}),
            ]
    finally:
        check.dispose()


def test_spark_in_memory_sqlite_is_refused_before_any_task(spark: SparkSession) -> None:
    df = spark.createDataFrame([("k", "{}")], "key string, payload string")
    for url in ("sqlite://", "sqlite:///:memory:", "sqlite:///file:m?mode=memory&uri=true"):
        with pytest.raises(InvalidArgument, match="in-memory SQLite"):
            offer_dataframe(df, url, "q")
        with pytest.raises(InvalidArgument, match="in-memory SQLite"):
            read_queue(spark, url, "q")


def test_spark_struct_payloads_keep_null_fields_and_utc_microseconds(
    spark: SparkSession, pg: Backend
) -> None:
    df = spark.createDataFrame(
        [
            (
                "k",
                datetime(2026, 7, 1, 12, 0, 0, 123456, tzinfo=UTC),
                datetime(2026, 7, 1, 8, 0, 0, 654321),
                None,
            )
        ],
        "key string, at timestamp, wall timestamp_ntz, missing int",
    ).select(
        "key",
        F.struct(
            "at",
            "missing",
            "wall",
            F.create_map(F.lit("x"), F.lit(None).cast("int")).alias("m"),
        ).alias("payload"),
        "at",
        "missing",
    )
    spark.conf.set("spark.sql.session.timeZone", "America/New_York")
    try:
        offer_dataframe(df, pg.url, "struct")
        offer_dataframe(df, pg.url, "columns", payload_columns=["at", "missing"])
    finally:
        spark.conf.set("spark.sql.session.timeZone", "UTC")
    q: DelayedQueue[Any] = DelayedQueue("struct")
    c: DelayedQueue[Any] = DelayedQueue("columns")
    with pg.Session() as s:
        struct, columns = q.get(s, "k"), c.get(s, "k")
    assert struct is not None and columns is not None
    assert struct.payload == {
        "at": "2026-07-01T12:00:00.123456Z",
        "missing": None,
        "wall": "2026-07-01T08:00:00.654321",  # TIMESTAMP_NTZ: the wall-clock text
        "m": {"x": None},
    }
    assert columns.payload == {"at": "2026-07-01T12:00:00.123456Z", "missing": None}


def test_spark_read_queue_dataframe_sees_rows_added_after_the_call(
    spark: SparkSession, pg: Backend
) -> None:
    empty = read_queue(spark, pg.url, "later", columns=["key"])
    offer_dataframe(reminders(spark, 1000, partitions=2), pg.url, "later")
    df = read_queue(spark, pg.url, "later", columns=["key"], num_partitions=3)
    assert df.count() == 1000 and empty.count() == 1000
    more = reminders(spark, 1500, partitions=2).where(F.col("id") >= 1000)
    offer_dataframe(more, pg.url, "later")
    assert df.count() == 1500 and empty.count() == 1500
    assert df.rdd.getNumPartitions() == 3
    assert sorted(r.key for r in df.collect()) == sorted(f"user/{i}" for i in range(1500))


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


def mixed_due_race(spark: SparkSession, n: int, version: int) -> DataFrame:
    """Two partitions offering the same n keys; each has due times on the keys the other lacks.

    In partition 0 the even keys carry a due time and the odd keys none; in partition 1 the
    reverse. Both partitions hold every key, so their writers contend for every row.
    """
    side = (F.col("id") / n).cast("int")
    k = F.col("id") % n
    return (
        spark.range(2 * n, numPartitions=2)
        .withColumn("key", F.concat(F.lit("race/"), F.lpad(k.cast("string"), 6, "0")))
        .withColumn("payload", F.to_json(F.struct(k.alias("k"), F.lit(version).alias("v"))))
        .withColumn(
            "due",
            F.when((k + side) % 2 == 0, F.timestamp_micros(F.lit(BASE_US) + k * 1000 + version)),
        )
    )


def test_spark_replace_with_mixed_due_times_never_deadlocks(
    spark: SparkSession, pg: Backend
) -> None:
    n = 20_000
    first = offer_dataframe(mixed_due_race(spark, n, 1), pg.url, "race", scheduled_at="due")
    # A deadlock kills one writer: its task is retried (or, a second time, the job fails).
    assert first.retried_partitions == 0, first
    assert (first.created, first.created + first.updated + first.ignored) == (n, 2 * n)
    again = offer_dataframe(mixed_due_race(spark, n, 2), pg.url, "race", scheduled_at="due")
    assert again.retried_partitions == 0, again
    assert again.created == 0 and again.updated >= n, again  # every key has a new payload
    with pg.engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT count(*), count(DISTINCT key), "
                "count(*) FILTER (WHERE payload->>'v' = '2'), "
                "count(*) FILTER (WHERE scheduled_at IS NULL) FROM delayed_queue"
            )
        ).one()
    assert tuple(rows) == (n, n, n, 0)


def test_spark_replace_mixing_rows_with_and_without_a_time_matches_offer(
    spark: SparkSession, pg: Backend
) -> None:
    """One partition, some rows timed and some not: the outcomes and rows of ``offer``."""
    now = datetime(2026, 2, 1, 9, 30, 0, 654321, tzinfo=UTC)
    t1 = datetime(2026, 3, 1, 8, 0, 0, 1, tzinfo=UTC)
    t2 = datetime(2026, 3, 2, 8, 0, 0, 2, tzinfo=UTC)
    before: list[tuple[str, dict[str, int], datetime | None]] = [
        ("same", {"v": 1}, t1),
        ("moved", {"v": 1}, t1),
        ("new-payload", {"v": 1}, t2),
    ]
    after: list[tuple[str, dict[str, int], datetime | None]] = [
        ("same", {"v": 1}, None),  # identical payload, no time: already there
        ("moved", {"v": 1}, t2),  # identical payload, another time: moved
        ("new-payload", {"v": 2}, None),  # new payload, no time: due now
        ("fresh-untimed", {"v": 1}, None),
        ("fresh-timed", {"v": 1}, t1),
    ]
    reference: DelayedQueue[Any] = DelayedQueue("by-offer", clock=lambda: now)
    expected = {}
    with pg.Session.begin() as s:
        for key, payload, at in before:
            reference.offer(s, key, payload, at)
    with pg.Session.begin() as s:
        for key, payload, at in after:
            expected[key] = reference.offer(s, key, payload, at).outcome.value

    schema = "key string, payload string, due timestamp"
    first = spark.createDataFrame([(k, json.dumps(p), at) for k, p, at in before], schema)
    offer_dataframe(first.coalesce(1), pg.url, "by-spark", scheduled_at="due", now=now)
    second = spark.createDataFrame([(k, json.dumps(p), at) for k, p, at in after], schema)
    counts = offer_dataframe(second.coalesce(1), pg.url, "by-spark", scheduled_at="due", now=now)
    outcomes = list(expected.values())
    assert (counts.created, counts.updated, counts.ignored) == tuple(
        outcomes.count(o) for o in ("created", "updated", "ignored")
    )
    with pg.engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT queue, key, payload, scheduled_at, scheduled_at_initially, created_at "
                "FROM delayed_queue ORDER BY key, queue"
            )
        ).all()
    by_queue: dict[str, dict[str, tuple[Any, ...]]] = {"by-offer": {}, "by-spark": {}}
    for r in rows:
        by_queue[r[0]][r[1]] = tuple(r[2:])
    assert by_queue["by-spark"] == by_queue["by-offer"]
    assert by_queue["by-spark"]["new-payload"][1] == now
    assert by_queue["by-spark"]["fresh-untimed"][1] == now


def test_spark_counts_what_a_stalled_speculative_copy_committed(
    spark: SparkSession, pg: Backend
) -> None:
    """A copy of a task commits its partition and never reports; the original finds the rows.

    Local mode never launches speculative copies (they must run on another host), so the test
    runs the copy itself, with the call's own plan, before the job's task of that partition.
    """
    n = 40_000
    df = reminders(spark, n, partitions=4)

    def with_copy_of_partition(frame: DataFrame, partition: int) -> OfferCounts:
        with prepare_offer(frame, pg.url, "reminders", scheduled_at="due") as call:
            copy = call.prepared.where(F.spark_partition_id() == partition).toArrow()
            assert copy.num_rows == n // 4
            list(PartitionWriter(call.spec, call.plan)(iter(copy.to_batches())))
            return call.run()

    first = with_copy_of_partition(df, 2)
    assert first == OfferCounts(
        created=n, updated=0, ignored=0, partitions=4, retried_partitions=0, approximate=False
    )
    changed = df.withColumn("payload", F.struct(F.col("id").alias("user_id"), F.lit("v2")))
    second = with_copy_of_partition(changed, 1)
    assert (second.created, second.updated, second.ignored, second.approximate) == (
        0,
        n,
        0,
        False,
    )
    assert len(table_rows(pg)) == n


def test_spark_counts_on_sqlite_say_approximate_after_a_retry(
    spark: SparkSession, tmp_path: Path
) -> None:
    from sqla_delayedq import create_engine
    from sqla_delayedq.models import metadata

    url = f"sqlite:///{tmp_path / 'retry.sqlite'}"
    engine = create_engine(url)
    metadata.create_all(engine)
    markers = tmp_path / "markers"
    markers.mkdir()
    df = reminders(spark, 4000, partitions=2)
    counts = offer_dataframe(
        df,
        url,
        "lite",
        scheduled_at="due",
        commit_every=1000,
        after_commit=FailOnceAfterFirstCommit(str(markers)),
    )
    assert counts.retried_partitions == 2 and counts.approximate
    assert counts.total == 4000 and counts.created == 4000 - 2000  # the first slices: ignored
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM delayed_queue")).scalar() == 4000
    engine.dispose()
