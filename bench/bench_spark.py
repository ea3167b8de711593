"""Spark pipeline benchmark: enqueue N reminders from ``local[2]``, then read them back.

Run from the repository root::

    python bench/bench_spark.py --rows 1000000

It creates a database ``dq_bench_<random>`` on the server of ``--url`` (a user that may create
databases), creates the default table, runs the reminder job of ``docs/spark.md`` (one message
per user, due at a random minute of the next seven days), reads the whole queue back (every
column, into Spark's ``noop`` sink: once right after the write, when PostgreSQL still sets
the hint bits of every new row, then twice more after ``VACUUM (ANALYZE)`` (what
autovacuum does after a bulk insert) and a checkpoint, keeping the faster), re-runs the job (all rows already there), reports the
backlog by due hour, prints rows/s for each step, and drops the database.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import time
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import make_url

ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
START_US = 1_767_225_600_000_000  # 2026-01-01T00:00:00Z


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--url", default=ADMIN_URL, help="server URL whose user can create DBs")
    parser.add_argument("--partitions", type=int, default=4, help="write tasks")
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON too")
    args = parser.parse_args(argv)

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    from sqla_delayedq.models import metadata
    from sqla_delayedq.spark import offer_dataframe, read_queue

    admin = make_url(args.url)
    name = f"dq_bench_{secrets.token_hex(4)}"
    admin_engine = sa.create_engine(admin, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)
    with admin_engine.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    url = admin.set(database=name)
    figures: dict[str, Any] = {"rows": args.rows, "master": args.master}
    spark = None
    try:
        engine = sa.create_engine(url, poolclass=sa.NullPool)
        metadata.create_all(engine)
        engine.dispose()
        spark = (
            SparkSession.builder.master(args.master)
            .appName("sqla_delayedq-bench")
            .config("spark.ui.enabled", "false")
            .config("spark.sql.shuffle.partitions", "4")
            .config("spark.sql.session.timeZone", "UTC")
            .config("spark.driver.memory", "2g")
            .getOrCreate()
        )
        spark.sparkContext.setLogLevel("ERROR")
        spark.range(1000).count()  # JVM and Python workers up before any clock starts

        users = spark.range(args.rows, numPartitions=args.partitions).withColumnRenamed(
            "id", "user_id"
        )
        reminders = users.select(
            F.concat(F.lit("reminder/"), F.col("user_id").cast("string")).alias("key"),
            F.struct("user_id", F.lit("Time to stretch!").alias("text")).alias("payload"),
            # A random minute of the next 7 days, with microseconds, per user.
            F.timestamp_micros(
                F.lit(START_US) + (F.rand(seed=7) * 7 * 86_400 * 1_000_000).cast("long")
            ).alias("due"),
        )

        t0 = time.perf_counter()
        counts = offer_dataframe(reminders, url, "reminders", scheduled_at="due")
        write_s = time.perf_counter() - t0
        assert counts.created == args.rows, counts

        def read_all() -> float:
            t0 = time.perf_counter()
            read_queue(spark, url, "reminders").write.format("noop").mode("overwrite").save()
            return time.perf_counter() - t0

        # The first scan of freshly committed rows sets their hint bits (PostgreSQL writes
        # every page once); later scans, and scans after autovacuum, do not pay for that.
        cold_s = read_all()
        # What autovacuum does after a bulk insert, then a checkpoint so the read does not
        # pay for writing out the pages the first scan dirtied.
        t0 = time.perf_counter()
        vacuum = sa.create_engine(url, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)
        with vacuum.connect() as conn:
            conn.exec_driver_sql("VACUUM (ANALYZE) delayed_queue")
        vacuum.dispose()
        vacuum_s = time.perf_counter() - t0
        with admin_engine.connect() as conn:
            conn.exec_driver_sql("CHECKPOINT")
        read_s = min(read_all(), read_all())

        t0 = time.perf_counter()
        again = offer_dataframe(reminders, url, "reminders", scheduled_at="due")
        rerun_s = time.perf_counter() - t0
        assert (again.created, again.updated, again.ignored) == (0, 0, args.rows), again

        t0 = time.perf_counter()
        backlog = (
            read_queue(spark, url, "reminders", columns=["scheduled_at"])
            .groupBy(F.date_trunc("hour", "scheduled_at").alias("due_hour"))
            .count()
            .orderBy("due_hour")
            .collect()
        )
        backlog_s = time.perf_counter() - t0
        assert sum(r["count"] for r in backlog) == args.rows

        figures |= {
            "write_s": round(write_s, 2),
            "write_rows_per_s": round(args.rows / write_s),
            "first_read_s": round(cold_s, 2),
            "first_read_rows_per_s": round(args.rows / cold_s),
            "vacuum_s": round(vacuum_s, 2),
            "read_s": round(read_s, 2),
            "read_rows_per_s": round(args.rows / read_s),
            "rerun_s": round(rerun_s, 2),
            "rerun_rows_per_s": round(args.rows / rerun_s),
            "backlog_hours": len(backlog),
            "backlog_s": round(backlog_s, 2),
        }
        print(f"rows                      {args.rows:>12,}  ({args.master})")
        print(
            f"write  (offer_dataframe)  {figures['write_rows_per_s']:>12,} rows/s  {write_s:.1f} s"
        )
        print(
            f"first read after write    {figures['first_read_rows_per_s']:>12,} rows/s  "
            f"{cold_s:.1f} s  (sets hint bits)"
        )
        print(f"vacuum (analyze)          {'':>12}         {vacuum_s:.1f} s")
        print(f"read   (read_queue, all)  {figures['read_rows_per_s']:>12,} rows/s  {read_s:.1f} s")
        print(
            f"re-run (all ignored)      {figures['rerun_rows_per_s']:>12,} rows/s  {rerun_s:.1f} s"
        )
        print(f"backlog by due hour       {len(backlog):>12,} hours   {backlog_s:.1f} s")
        if args.json:
            print(json.dumps(figures))
    finally:
        if spark is not None:
            spark.stop()
        with admin_engine.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin_engine.dispose()
    return 0


if __name__ == "__main__":
    sys.exit(main())
