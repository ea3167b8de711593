"""Time ``delayedq stats`` on a big PostgreSQL table.

Creates a database ``dq_bench_<random>`` on the local server, fills the default table with
``--rows`` messages over ``--queues`` queues in one ``INSERT ... SELECT generate_series``, runs
``VACUUM ANALYZE`` (index-only scans need the visibility map it sets), then times:

- ``delayedq stats --json`` end to end through click's CliRunner (engine, connection, queries,
  output), as an operator runs it;
- the statement behind it alone (:func:`sqla_delayedq._cli_read.collect_stats`, warm engine);
- for comparison, ``DelayedQueue.counts`` + ``oldest_due`` for every queue, the library's exact
  per-queue counts, which read every row of the queue;
- the stats statement again with the partial index proposed in ``docs/operators.md``.

The database is dropped at the end (``--keep`` keeps it). Run from the repository root::

    .venv/bin/python bench/bench_stats.py --rows 1000000 --queues 10
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import sqlalchemy as sa
from click.testing import CliRunner
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.orm import sessionmaker

from sqla_delayedq import DelayedQueue, create_engine
from sqla_delayedq._cli_base import Db, model_for
from sqla_delayedq._cli_read import collect_stats
from sqla_delayedq.cli import cli
from sqla_delayedq.models import metadata

UTC = timezone.utc
ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"

# Per 1,000 consecutive ids (one queue): 30 dead, 10 done, 300 due (up to an hour late),
# 1 in flight, 659 scheduled over the next day. Payloads are small JSON documents.
FILL = """
INSERT INTO delayed_queue (queue, key, payload_type, payload, status, scheduled_at,
                           scheduled_at_initially, created_at, lock_token, attempts, last_error)
SELECT 'queue-' || mod(i / 1000, :queues),
       'k/' || i,
       'json',
       jsonb_build_object('companyId', mod(i, 5000), 'n', i, 'text', repeat('x', :pad)),
       CASE WHEN mod(i, 1000) < 30 THEN 'dead' WHEN mod(i, 1000) < 40 THEN 'done'
            ELSE 'pending' END,
       CASE WHEN mod(i, 1000) < 40 THEN NULL
            WHEN mod(i, 1000) < 340 THEN now() - mod(i, 3600) * interval '1 second'
            WHEN mod(i, 1000) = 340 THEN now() + interval '5 minutes'
            ELSE now() + mod(i, 86400) * interval '1 second' END,
       now() - interval '1 hour',
       now() - interval '1 hour',
       CASE WHEN mod(i, 1000) = 340 THEN 'bench.' || i END,
       CASE WHEN mod(i, 1000) < 30 THEN 5 ELSE 0 END,
       CASE WHEN mod(i, 1000) < 30 THEN 'RuntimeError: boom' END
FROM generate_series(1, :rows) AS i
"""
PROPOSED_INDEX = (
    "CREATE INDEX ix_delayed_queue_unscheduled ON delayed_queue (queue, status) "
    "WHERE scheduled_at IS NULL"
)


def timed(fn: Callable[[], Any], runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return times


def summary(label: str, times: list[float]) -> str:
    ms = [t * 1000 for t in times]
    return (
        f"{label:<58} min {min(ms):7.1f} ms   median {statistics.median(ms):7.1f} ms   "
        f"max {max(ms):7.1f} ms"
    )


def explain(engine: Engine, db: Db) -> None:
    """Print the plan of the stats statement, with timings and buffers."""
    from sqla_delayedq._cli_stats import list_queues, stats_stmt

    with db.sessions() as s:
        names = list_queues(s, db.table)
        stmt = stats_stmt(db.table, names, datetime.now(UTC), every=True)
        sql = str(stmt.compile(engine, compile_kwargs={"literal_binds": True}))
        for (line,) in s.execute(sa.text("EXPLAIN (ANALYZE, BUFFERS) " + sql)):
            print("   ", line)


def vacuum(engine: Engine) -> float:
    started = time.perf_counter()
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.exec_driver_sql("VACUUM ANALYZE delayed_queue")
    return time.perf_counter() - started


def run(args: argparse.Namespace) -> None:
    admin = sa.create_engine(args.admin_url, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)
    name = f"dq_bench_{secrets.token_hex(4)}"
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    url = make_url(args.admin_url).set(database=name)
    engine = create_engine(url)
    try:
        metadata.create_all(engine)
        started = time.perf_counter()
        with engine.begin() as conn:
            params = {"rows": args.rows, "queues": args.queues, "pad": args.payload_pad}
            conn.execute(sa.text(FILL), params)
        print(f"filled {args.rows:,} rows over {args.queues} queues in "
              f"{time.perf_counter() - started:.1f} s")  # fmt: skip
        print(f"VACUUM ANALYZE: {vacuum(engine):.1f} s")
        with engine.connect() as conn:
            sizes = conn.exec_driver_sql(
                "SELECT pg_size_pretty(pg_relation_size('delayed_queue')), "
                "pg_size_pretty(pg_relation_size('ix_delayed_queue_due'))"
            ).one()
        print(f"heap {sizes[0]}, ix_delayed_queue_due {sizes[1]}")

        rendered = url.render_as_string(hide_password=False)
        runner = CliRunner()
        output: list[str] = []

        def cli_stats() -> None:
            result = runner.invoke(cli, ["stats", "--json", "--url", rendered])
            if result.exit_code != 0:
                raise SystemExit(f"stats failed: {result.output}")
            output.append(result.stdout)

        db = Db(rendered, "delayed_queue", engine, sessionmaker(engine), model_for("delayed_queue"))
        queues = [DelayedQueue[Any](f"queue-{i}") for i in range(args.queues)]

        def library_counts() -> None:
            with db.sessions() as s:
                for q in queues:
                    q.counts(s)
                    q.oldest_due(s)

        results = [
            ("delayedq stats --json (CliRunner, end to end)", timed(cli_stats, args.runs)),
            ("stats statement only (collect_stats, warm engine)",
             timed(lambda: collect_stats(db, ()), args.runs)),
            ("for comparison: DelayedQueue.counts + oldest_due x queues",
             timed(library_counts, args.runs)),
        ]  # fmt: skip
        if args.explain:
            print("\nplan without the proposed index:")
            explain(engine, db)
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql(PROPOSED_INDEX)
        vacuum(engine)
        results += [
            ("with the proposed partial index: delayedq stats --json",
             timed(cli_stats, args.runs)),
            ("with the proposed partial index: stats statement only",
             timed(lambda: collect_stats(db, ()), args.runs)),
        ]  # fmt: skip
        if args.explain:
            print("\nplan with the proposed index:")
            explain(engine, db)
        print()
        for label, times in results:
            print(summary(label, times))
        doc = json.loads(output[-1])
        total = {k: sum(q[k] for q in doc["queues"]) for k in ("due", "scheduled", "in_flight")}
        dead = sum(q["dead"] for q in doc["queues"])
        print(f"\nchecked: {len(doc['queues'])} queues, {total}, dead {dead:,}")
        print(f"at {datetime.now(UTC).isoformat(timespec='seconds')} on PostgreSQL "
              f"{engine.dialect.server_version_info}")  # fmt: skip
    finally:
        engine.dispose()
        if args.keep:
            print(f"kept database {name}")
        else:
            with admin.connect() as conn:
                conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--queues", type=int, default=10)
    parser.add_argument("--runs", type=int, default=5, help="timed runs of each variant")
    parser.add_argument("--payload-pad", type=int, default=20, help="extra payload bytes")
    parser.add_argument(
        "--admin-url", default=ADMIN_URL, help="a server URL that may CREATE DATABASE"
    )
    parser.add_argument("--explain", action="store_true", help="print the stats query plans")
    parser.add_argument("--keep", action="store_true", help="keep the database afterwards")
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
