"""Spark pipeline benchmark: ours beside ``write.jdbc`` and a hand-written ``foreachPartition``.

Run from the repository root::

    python bench/bench_spark.py --rows 1000000

It creates a database ``dq_bench_<random>`` on the server of ``--url`` (a user that may create
databases) with three tables of the same shape (the default message table and two copies with
the same indexes), builds the reminder job of ``docs/spark.md`` (one message per user, due at a
random moment of the next seven days), and in one Spark session times, on the same input:

- **write**: ``offer_dataframe``; Spark's ``write.jdbc`` (the PostgreSQL JDBC driver, batched,
  ``reWriteBatchedInserts=true``), which is plain ``INSERT``: it cannot be re-run; and a
  re-runnable ``foreachPartition`` as one would write it by hand (psycopg ``executemany`` of
  ``INSERT ... ON CONFLICT DO UPDATE ... WHERE changed``, one transaction per partition);
- **read**: ``read_queue`` of every column into Spark's ``noop`` sink, once right after the
  write (PostgreSQL sets the hint bits of every new row then), and after ``VACUUM (ANALYZE)``
  and a checkpoint, keeping the faster of two; ``spark.read.jdbc`` the same way (its id bounds
  asked first, as ``read_queue`` does);
- **re-run**: the same job again, all rows already there, for ours and ``foreachPartition``;
  ``write.jdbc`` again, to show it fails.

Each method first runs once on 1,000 rows, untimed (Spark starts each kind of Python worker,
or loads the JDBC driver, on first use). Before each write, first read and re-run, an untimed
``CHECKPOINT`` writes out the dirty pages
of the step before, so no step pays for another's. Each figure is printed with the 1-minute
load average before and after it, and ``ours/it``: our
rows/s for that step divided by the method's (above 1, ours is faster). On a shared machine
the absolute rows/s move with the load, while the ratios between the methods, measured minutes
apart, hold much better. Without the JDBC driver jar (``--jdbc-jar``; Debian's
``libpostgresql-jdbc-java`` installs ``/usr/share/java/postgresql.jar``) the JDBC rows are
skipped with a note. The database is dropped at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import URL, make_url

ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
JDBC_JAR = "/usr/share/java/postgresql.jar"
START_US = 1_767_225_600_000_000  # 2026-01-01T00:00:00Z

#: What a careful hand-written re-runnable writer sends: the offer rule of replace mode.
HAND_UPSERT = (
    "INSERT INTO {table} AS t (queue, key, payload_type, payload, status, scheduled_at, "
    "scheduled_at_initially, created_at, attempts) "
    "VALUES (%s, %s, 'json', %s::jsonb, 'pending', {due}, {due}, {created}, 0) "
    "ON CONFLICT (queue, key) DO UPDATE SET payload_type = EXCLUDED.payload_type, "
    "payload = EXCLUDED.payload, payload_bytes = NULL, status = 'pending', lock_token = NULL, "
    "attempts = 0, last_error = NULL, scheduled_at = EXCLUDED.scheduled_at, "
    "scheduled_at_initially = EXCLUDED.scheduled_at_initially "
    "WHERE (t.payload, t.scheduled_at_initially) IS DISTINCT FROM "
    "(EXCLUDED.payload, EXCLUDED.scheduled_at_initially)"
)


def load() -> float:
    return os.getloadavg()[0]


@dataclass
class Step:
    name: str
    rows: int
    seconds: float
    load_before: float
    load_after: float
    note: str = ""

    @property
    def rows_per_s(self) -> int:
        return round(self.rows / self.seconds)


def timed(
    name: str,
    rows: int,
    fn: Callable[[], Any],
    note: str = "",
    settle: Callable[[], Any] | None = None,
) -> Step:
    """Time ``fn``; ``settle`` runs first, untimed (a checkpoint: no step pays for the last
    one's dirty pages)."""
    if settle is not None:
        settle()
    before = load()
    t0 = time.perf_counter()
    fn()
    seconds = time.perf_counter() - t0
    return Step(name, rows, seconds, before, load(), note)


class HandWritten:
    """A re-runnable ``foreachPartition`` writer: psycopg ``executemany`` of an upsert."""

    def __init__(self, conninfo: str, table: str) -> None:
        self.conninfo = conninfo
        micros = "(timestamptz 'epoch' + %s * interval '1 microsecond')"
        self.sql = HAND_UPSERT.format(table=table, due=micros, created=micros)

    def __call__(self, rows: Iterator[Any]) -> None:
        import psycopg

        with psycopg.connect(self.conninfo) as conn, conn.cursor() as cur:
            batch: list[tuple[Any, ...]] = []
            for r in rows:
                batch.append((r.queue, r.key, r.payload, r.due_us, r.due_us, r.created_us))
                if len(batch) == 10_000:
                    cur.executemany(self.sql, batch)
                    batch.clear()
            if batch:
                cur.executemany(self.sql, batch)


def conninfo_of(url: URL) -> str:
    return f"host={url.host} port={url.port or 5432} dbname={url.database} user={url.username}"


def jdbc_url_of(url: URL) -> str:
    return (
        f"jdbc:postgresql://{url.host}:{url.port or 5432}/{url.database}"
        "?reWriteBatchedInserts=true&stringtype=unspecified"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--url", default=ADMIN_URL, help="server URL whose user can create DBs")
    parser.add_argument("--partitions", type=int, default=4, help="write tasks")
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--jdbc-jar", default=JDBC_JAR, help="PostgreSQL JDBC driver jar")
    parser.add_argument("--jdbc-batchsize", type=int, default=10_000)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON too")
    args = parser.parse_args(argv)

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    from sqla_delayedq.models import metadata
    from sqla_delayedq.spark import offer_dataframe, read_queue

    jar = args.jdbc_jar if Path(args.jdbc_jar).is_file() else None
    admin = make_url(args.url)
    name = f"dq_bench_{secrets.token_hex(4)}"
    admin_engine = sa.create_engine(admin, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)
    with admin_engine.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    url = admin.set(database=name)
    n = args.rows
    steps: list[Step] = []
    notes: list[str] = []
    spark = None
    try:
        engine = sa.create_engine(url, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)
        metadata.create_all(engine)
        with engine.connect() as conn:
            for copy in ("jdbc_queue", "hand_queue"):
                conn.exec_driver_sql(f"CREATE TABLE {copy} (LIKE delayed_queue INCLUDING ALL)")

        def sql(statement: str) -> None:
            with engine.connect() as conn:
                conn.exec_driver_sql(statement)

        def checkpoint() -> None:
            with admin_engine.connect() as conn:
                conn.exec_driver_sql("CHECKPOINT")

        builder = (
            SparkSession.builder.master(args.master)
            .appName("sqla_delayedq-bench")
            .config("spark.ui.enabled", "false")
            .config("spark.sql.shuffle.partitions", "4")
            .config("spark.sql.session.timeZone", "UTC")
            .config("spark.driver.memory", "2g")
        )
        if jar:
            builder = builder.config("spark.jars", jar)
        else:
            notes.append(
                f"no JDBC driver at {args.jdbc_jar}: write.jdbc and read.jdbc skipped "
                "(apt-get install libpostgresql-jdbc-java, or --jdbc-jar PATH)"
            )
        spark = builder.getOrCreate()
        spark.sparkContext.setLogLevel("ERROR")
        spark.range(1000).count()  # JVM and Python workers up before any clock starts

        now = datetime.now(UTC)

        def job(count: int, queue: str) -> tuple[Any, Any, Any]:
            """The reminders, and the same rows for the two other writers: times as
            microseconds for psycopg (a Python datetime from Spark is naive, in the worker's
            local zone), the columns of the message table for JDBC."""
            users = spark.range(count, numPartitions=args.partitions)
            reminders = users.select(
                F.concat(F.lit("reminder/"), F.col("id").cast("string")).alias("key"),
                F.struct(
                    F.col("id").alias("user_id"), F.lit("Time to stretch!").alias("text")
                ).alias("payload"),
                # A random moment of the next 7 days, with microseconds, per user.
                F.timestamp_micros(
                    F.lit(START_US) + (F.rand(seed=7) * 7 * 86_400 * 1_000_000).cast("long")
                ).alias("due"),
            )
            as_rows = reminders.select(
                F.lit(queue).alias("queue"),
                "key",
                F.to_json("payload").alias("payload"),
                F.unix_micros("due").alias("due_us"),
                F.unix_micros(F.lit(now)).alias("created_us"),
            )
            as_table = reminders.select(
                F.lit(queue).alias("queue"),
                "key",
                F.lit("json").alias("payload_type"),
                F.to_json("payload").alias("payload"),
                F.lit("pending").alias("status"),
                F.col("due").alias("scheduled_at"),
                F.col("due").alias("scheduled_at_initially"),
                F.lit(now).alias("created_at"),
                F.lit(0).alias("attempts"),
            )
            return reminders, as_rows, as_table

        reminders, as_rows, as_table = job(n, "reminders")
        jdbc_url = jdbc_url_of(url)
        jdbc_props = {
            "user": url.username or "",
            "driver": "org.postgresql.Driver",
            "batchsize": str(args.jdbc_batchsize),
        }
        hand = HandWritten(conninfo_of(url), "hand_queue")

        def ours() -> None:
            counts = offer_dataframe(reminders, url, "reminders", scheduled_at="due", now=now)
            assert (counts.created, counts.approximate) == (n, False), counts

        def ours_again() -> None:
            counts = offer_dataframe(reminders, url, "reminders", scheduled_at="due", now=now)
            assert (counts.created, counts.updated, counts.ignored) == (0, 0, n), counts

        def jdbc_write() -> None:
            as_table.write.jdbc(jdbc_url, "jdbc_queue", mode="append", properties=jdbc_props)

        # Every method once on 1,000 rows first, untimed: Spark starts the Python workers
        # (or loads the JDBC driver) of each kind of task on first use, and the first timed
        # step would otherwise pay for the ones after it.
        warm, warm_rows, warm_table = job(1000, "warmup")
        offer_dataframe(warm, url, "warmup", scheduled_at="due", now=now)
        read_queue(spark, url, "warmup").write.format("noop").mode("overwrite").save()
        warm_rows.foreachPartition(hand)
        if jar:
            warm_table.write.jdbc(jdbc_url, "jdbc_queue", mode="append", properties=jdbc_props)
            spark.read.jdbc(jdbc_url, "jdbc_queue", properties=jdbc_props).write.format(
                "noop"
            ).mode("overwrite").save()
        for table in ("delayed_queue", "jdbc_queue", "hand_queue"):
            sql(f"DELETE FROM {table}")
        sql("VACUUM delayed_queue, jdbc_queue, hand_queue")

        steps.append(timed("write: offer_dataframe", n, ours, settle=checkpoint))
        if jar:
            steps.append(
                timed(
                    "write: write.jdbc",
                    n,
                    jdbc_write,
                    f"batched ({args.jdbc_batchsize:,}), reWriteBatchedInserts",
                    settle=checkpoint,
                )
            )
        steps.append(timed("write: foreachPartition", n, lambda: as_rows.foreachPartition(hand)))

        def read_ours() -> None:
            read_queue(spark, url, "reminders").write.format("noop").mode("overwrite").save()

        def read_jdbc() -> None:
            with engine.connect() as conn:
                lo, hi = conn.exec_driver_sql("SELECT min(id), max(id) FROM jdbc_queue").one()
            spark.read.jdbc(
                jdbc_url,
                "jdbc_queue",
                column="id",
                lowerBound=lo,
                upperBound=hi + 1,
                numPartitions=spark.sparkContext.defaultParallelism,
                properties={**jdbc_props, "fetchsize": "10000"},
            ).write.format("noop").mode("overwrite").save()

        # The first scan of freshly committed rows sets their hint bits (PostgreSQL writes
        # every page once); later scans, and scans after autovacuum, do not pay for that.
        steps.append(
            timed("first read: read_queue", n, read_ours, "sets hint bits", settle=checkpoint)
        )
        if jar:
            steps.append(
                timed("first read: read.jdbc", n, read_jdbc, "sets hint bits", settle=checkpoint)
            )
        steps.append(
            timed(
                "vacuum (analyze) x3",
                3 * n,
                lambda: sql("VACUUM (ANALYZE) delayed_queue, jdbc_queue, hand_queue"),
            )
        )
        checkpoint()
        best = min(
            (timed("read: read_queue", n, read_ours) for _ in range(2)), key=lambda s: s.seconds
        )
        steps.append(best)
        if jar:
            best = min(
                (timed("read: read.jdbc", n, read_jdbc) for _ in range(2)),
                key=lambda s: s.seconds,
            )
            steps.append(best)

        steps.append(
            timed("re-run: offer_dataframe", n, ours_again, "all ignored", settle=checkpoint)
        )
        steps.append(
            timed(
                "re-run: foreachPartition",
                n,
                lambda: as_rows.foreachPartition(hand),
                "all unchanged",
                settle=checkpoint,
            )
        )
        if jar:
            before = load()
            spark.sparkContext.setLogLevel("OFF")  # the failing tasks' stack traces
            try:
                jdbc_write()
                notes.append("write.jdbc re-run succeeded: the table has no unique key?")
            except Exception as exc:
                duplicate = "duplicate key" in str(exc)
                notes.append(
                    f"re-run: write.jdbc fails ({'duplicate key' if duplicate else exc!s:.80}), "
                    f"load {before:.1f}: a plain INSERT cannot be re-run"
                )
            finally:
                spark.sparkContext.setLogLevel("ERROR")
        with engine.connect() as conn:
            for table in ("delayed_queue", "jdbc_queue", "hand_queue"):
                rows = conn.exec_driver_sql(f"SELECT count(*) FROM {table}").scalar()
                if rows not in (0, n):
                    notes.append(f"{table} has {rows:,} rows, expected {n:,}")
        engine.dispose()
    finally:
        if spark is not None:
            spark.stop()
        with admin_engine.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin_engine.dispose()

    reference = {s.name.split(": ")[0]: s for s in steps if "read_queue" in s.name}
    reference.update({s.name.split(": ")[0]: s for s in steps if "offer_dataframe" in s.name})
    print(f"{n:,} rows, {args.master}, {args.partitions} write partitions, {os.cpu_count()} CPUs")
    print(f"{'step':<28} {'rows/s':>10} {'seconds':>8} {'load 1m':>11} {'ours/it':>9}  note")
    for s in steps:
        ours_step = reference.get(s.name.split(": ")[0])
        ratio = (
            "" if ours_step is None or ours_step is s else f"{s.seconds / ours_step.seconds:.1f}×"
        )
        print(
            f"{s.name:<28} {s.rows_per_s:>10,} {s.seconds:>8.1f} "
            f"{s.load_before:>5.1f}→{s.load_after:<5.1f} {ratio:>9}  {s.note}"
        )
    for note in notes:
        print(f"note: {note}")
    if args.json:
        print(
            json.dumps(
                {
                    "rows": n,
                    "master": args.master,
                    "steps": [
                        {
                            "name": s.name,
                            "rows_per_s": s.rows_per_s,
                            "seconds": round(s.seconds, 2),
                            "load_before": s.load_before,
                            "load_after": s.load_after,
                        }
                        for s in steps
                    ],
                    "notes": notes,
                }
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
