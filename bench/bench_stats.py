"""Time ``delayedq stats`` on a big PostgreSQL table.

Creates a database ``dq_bench_<random>`` on the local server, fills the default table with
``--rows`` messages over ``--queues`` queues in one ``INSERT ... SELECT generate_series``, runs
``VACUUM ANALYZE`` (index-only scans need the visibility map it sets), then times:

- ``delayedq stats --json`` end to end through click's CliRunner (engine, connection, queries,
  output), as an operator runs it;
- the statement behind it alone (:func:`sqla_delayedq._cli_read.collect_stats`, warm engine);
- for comparison, ``DelayedQueue.counts`` + ``oldest_due`` for every queue, the library's exact
  per-queue counts, which read every row of the queue;
- the same reads **bounded** (``at_most``, 10,000 and 1,000): ``collect_stats`` as
  ``delayedq stats --at-most N`` runs it, and ``counts(at_most=N)`` + ``oldest_due`` per queue;
- the stats statement again with the partial index proposed in ``docs/operators.md``;
- then, unless ``--bloat 0``, the reads of one more queue whose index ranges hold dead entries:
  a session holds a ``REPEATABLE READ`` snapshot open (a pinned vacuum horizon) while
  ``--bloat`` messages are offered, taken and acknowledged (500 per transaction), then
  ``--live`` messages are offered and stay due; each read is timed and its buffers counted
  (``EXPLAIN (ANALYZE, BUFFERS)``): pinned with the statistics from before the queue existed,
  pinned after an ``ANALYZE`` (autovacuum's would come within a minute: the queue changed more
  than 10 % of the table), and after the pin ends and ``VACUUM``.

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
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa
from click.testing import CliRunner
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.orm import sessionmaker

from sqla_delayedq import DelayedQueue, create_engine
from sqla_delayedq._cli_base import Db, model_for
from sqla_delayedq._cli_read import collect_stats
from sqla_delayedq._cli_stats import bounded_stats_stmt, stats_stmt
from sqla_delayedq.cli import cli
from sqla_delayedq.models import metadata

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


#: A cap for graphs, and the exporters' default (``sqla_delayedq.metrics.DEFAULT_AT_MOST``).
CAPS = (10_000, 1_000)
BLOAT_QUEUE = "bloated"


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


def buffers(engine: Engine, stmt: Any) -> int:
    """Shared buffers one run of ``stmt`` touches (hit or read), from EXPLAIN (ANALYZE, BUFFERS)."""
    sql = str(stmt.compile(engine, compile_kwargs={"literal_binds": True}))
    with engine.connect() as conn:
        (doc,) = conn.exec_driver_sql("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + sql).scalar()
    top = doc["Plan"]
    return int(top["Shared Hit Blocks"] + top["Shared Read Blocks"])


def bloated_reads(engine: Engine, db: Db, args: argparse.Namespace) -> None:
    """Exact and bounded reads of a queue whose ranges hold ``--bloat`` messages' dead entries
    (the horizon pinned while they went through), with ``--live`` due messages behind them."""
    q = DelayedQueue[Any](BLOAT_QUEUE, lease=timedelta(minutes=5))
    t = db.table
    pin = engine.connect()
    pin.exec_driver_sql("BEGIN ISOLATION LEVEL REPEATABLE READ")
    pin.exec_driver_sql("SELECT 1").all()  # takes the snapshot: the horizon stays here
    started = time.perf_counter()
    try:
        for first in range(0, args.bloat, 500):
            keys = [(f"gone/{i}", {"i": i}) for i in range(first, min(first + 500, args.bloat))]
            with db.sessions() as s, s.begin():
                q.offer_batch(s, keys)
            with db.sessions() as s, s.begin():
                taken = q.try_poll_many(s, len(keys))
            with db.sessions() as s, s.begin():
                q.ack_many(s, taken)
        with db.sessions() as s, s.begin():
            q.offer_batch(s, [(f"live/{i}", {"i": i}) for i in range(args.live)])
        print(f"\n{args.bloat:,} messages offered, taken and acknowledged with the horizon pinned, "
              f"then {args.live:,} left due, in {time.perf_counter() - started:.1f} s")  # fmt: skip
        measure_bloated(engine, db, q, t, args, "horizon pinned, statistics from before")
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql("ANALYZE delayed_queue")  # autovacuum's would come within 1 min
        measure_bloated(engine, db, q, t, args, "horizon pinned, after ANALYZE")
    finally:
        pin.rollback()
        pin.close()
    print(f"pin released; VACUUM ANALYZE: {vacuum(engine):.1f} s")
    measure_bloated(engine, db, q, t, args, "after VACUUM")


def measure_bloated(
    engine: Engine, db: Db, q: DelayedQueue[Any], t: Any, args: argparse.Namespace, phase: str
) -> None:
    now = datetime.now(UTC)
    names = (BLOAT_QUEUE,)
    rows: list[tuple[str, list[float], int | None]] = [
        ("exact stats of the queue (delayedq stats -q)",
         timed(lambda: collect_stats(db, names, missing_ok=True), args.runs),
         buffers(engine, stats_stmt(t, names, now))),
    ]  # fmt: skip
    for cap in CAPS:
        rows.append(
            (f"bounded stats of the queue, at_most={cap:,}",
             timed(lambda cap=cap: collect_stats(db, names, missing_ok=True, at_most=cap),
                   args.runs),
             buffers(engine, bounded_stats_stmt(t, names, now, cap)))
        )  # fmt: skip

    def lag() -> None:
        with db.sessions() as s:
            q.oldest_due(s)

    rows.append(("oldest_due (the lag: one probe)", timed(lag, args.runs), None))
    print(f"\n{phase}:")
    for label, times, touched in rows:
        extra = "" if touched is None else f"   {touched:,} buffers"
        print(summary(label, times) + extra)
    with db.sessions() as s:
        exact, bounded = (
            q.counts(s),
            q.counts(s, at_most=CAPS[0]),
        )
    print(f"    exact {exact}\n    bounded {bounded}")


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

        def bounded_counts(cap: int) -> None:
            with db.sessions() as s:
                for q in queues:
                    q.counts(s, at_most=cap)
                    q.oldest_due(s)

        results = [
            ("delayedq stats --json (CliRunner, end to end)", timed(cli_stats, args.runs)),
            ("stats statement only (collect_stats, warm engine)",
             timed(lambda: collect_stats(db, ()), args.runs)),
            ("for comparison: DelayedQueue.counts + oldest_due x queues",
             timed(library_counts, args.runs)),
        ]  # fmt: skip
        for cap in CAPS:
            results += [
                (f"bounded stats statement, at_most={cap:,} (collect_stats)",
                 timed(lambda cap=cap: collect_stats(db, (), at_most=cap), args.runs)),
                (f"bounded: counts(at_most={cap:,}) + oldest_due x queues",
                 timed(lambda cap=cap: bounded_counts(cap), args.runs)),
            ]  # fmt: skip
        capped = collect_stats(db, (), at_most=CAPS[0])
        print(f"bounded at {CAPS[0]:,}: capped {sorted({s for q in capped for s in q.capped})}")
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
        if args.bloat:
            bloated_reads(engine, db, args)
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
    parser.add_argument(
        "--bloat", type=int, default=50_000, help="messages through a queue, horizon pinned"
    )
    parser.add_argument("--live", type=int, default=20_000, help="due messages behind them")
    parser.add_argument("--explain", action="store_true", help="print the stats query plans")
    parser.add_argument("--keep", action="store_true", help="keep the database afterwards")
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
