"""Time each dashboard page on a big PostgreSQL table (server-side, in process).

Creates a database ``dq_bench_<random>`` on the local server, fills the default table with
``--rows`` messages over ``--queues`` queues (the same fill as ``bench/bench_stats.py``), adds an
hour of per-minute counters from four workers and the workers' rows, runs ``VACUUM ANALYZE``,
then requests every page through Starlette's TestClient (no network; the time is routing,
queries and rendering) with ``counts_ttl=0``, so every overview recounts. Prints min, median
and max per page; the target is under 300 ms. Run from the repository root::

    .venv/bin/python bench/bench_web.py --rows 1000000 --queues 10
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import time
import warnings
from datetime import UTC, datetime, timedelta

import sqlalchemy as sa
from sqlalchemy.engine import make_url
from sqlalchemy.orm import sessionmaker

from bench.bench_stats import ADMIN_URL, FILL, vacuum
from sqla_delayedq import create_engine
from sqla_delayedq.models import metadata, stats_table, workers_table

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

from sqla_delayedq.web import dashboard

TOKEN = "bench"
TARGET_MS = 300.0


def fill_history(engine: sa.Engine, queues: int) -> None:
    now = datetime.now(UTC)
    minute = now.replace(second=0, microsecond=0)
    with engine.begin() as conn:
        conn.execute(
            stats_table.insert(),
            [
                {
                    "worker_id": f"w{w}",
                    "table_name": "delayed_queue",
                    "queue": f"queue-{q}",
                    "minute": minute - timedelta(minutes=m),
                    "processed": 100 + m,
                    "failed": m % 3,
                    "dead": 0,
                }
                for w in range(4)
                for q in range(queues)
                for m in range(24 * 60)  # a day of history: the overview reads the last hour
            ],
        )
        conn.execute(
            workers_table.insert(),
            [
                {
                    "id": f"w{w}",
                    "name": f"worker-{w}",
                    "host": "bench",
                    "pid": 1000 + w,
                    "runtime": "threads",
                    "started_by": "cli",
                    "queues": "[]",
                    "concurrency": 8,
                    "heartbeat_seconds": 10.0,
                    "started_at": now - timedelta(hours=1),
                    "heartbeat_at": now,
                }
                for w in range(4)
            ],
        )


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
        fill_history(engine, args.queues)
        print(f"filled {args.rows:,} rows over {args.queues} queues in "
              f"{time.perf_counter() - started:.1f} s")  # fmt: skip
        print(f"VACUUM ANALYZE: {vacuum(engine):.1f} s")
        with engine.connect() as conn:
            last_id = conn.scalar(sa.text("SELECT max(id) FROM delayed_queue"))
            some_id = conn.scalar(sa.text("SELECT id FROM delayed_queue WHERE queue = 'queue-3' "
                                          "AND status = 'dead' LIMIT 1"))  # fmt: skip
        sessions = sessionmaker(engine)
        counting = dashboard(sessions, token=TOKEN, actions=True, counts_ttl=0)
        board = dashboard(sessions, token=TOKEN, actions=True, counts_ttl=1)
        auth = {"authorization": f"Bearer {TOKEN}"}
        recount = TestClient(counting, headers=auth)
        client = TestClient(board, headers=auth)
        q = "table=delayed_queue&queue=queue-3"
        pages = [
            ("overview, counting in the request", "/", recount),
            ("overview fragment, counting in the request", "/fragments/overview", recount),
            ("overview, shared snapshot (counts_ttl=1)", "/", client),
            ("overview fragment, shared snapshot", "/fragments/overview", client),
            ("messages, first page", f"/messages?{q}", client),
            ("messages, dead", f"/messages?{q}&state=dead", client),
            ("messages, dead + companyId=3345", f"/messages?{q}&state=dead&where=companyId%3D3345", client),
            ("messages, key prefix", f"/messages?{q}&key_prefix=k/3001", client),
            ("messages, a page near the end", f"/messages?{q}&after={int(last_id) - 200_000}", client),
            ("message", f"/message?{q}&id={some_id}", client),
            ("confirm retry dead + companyId", f"/confirm?action=retry&{q}&state=dead"
             "&where=companyId%3D3345", client),
            ("confirm retry all dead of a queue", f"/confirm?action=retry&{q}&state=dead", client),
            ("workers", "/workers", client),
            ("cron", "/cron", client),
        ]  # fmt: skip
        rows: list[tuple[str, list[float]]] = []
        for label, path, http in pages:
            response = http.get(path)  # warm: statement cache, connection pool
            if response.status_code != 200:
                raise SystemExit(f"{path}: {response.status_code}")
            times = []
            for _ in range(args.runs):
                if "snapshot" in label:
                    time.sleep(args.pause)  # let the shared snapshot go stale between requests
                started = time.perf_counter()
                response = http.get(path)
                times.append((time.perf_counter() - started) * 1000)
                assert response.status_code == 200
            rows.append((label, times))
        print()
        worst = 0.0
        for label, times in rows:
            median = statistics.median(times)
            worst = max(worst, median)
            flag = "" if median < TARGET_MS else "  over target"
            print(f"{label:<40} min {min(times):7.1f} ms   median {median:7.1f} ms   "
                  f"max {max(times):7.1f} ms{flag}")  # fmt: skip
        print(f"\nslowest median {worst:.1f} ms (target {TARGET_MS:.0f} ms); "
              f"at {datetime.now(UTC).isoformat(timespec='seconds')} on PostgreSQL "
              f"{engine.dialect.server_version_info}")  # fmt: skip
        # The background recount of the shared snapshot: how stale the counts can be.
        started = time.perf_counter()
        board.data._take_overview()
        print(f"one recount of the shared snapshot (in the background): "
              f"{(time.perf_counter() - started) * 1000:.0f} ms")  # fmt: skip
        board.data.close()
        counting.data.close()
    finally:
        engine.dispose()
        if args.keep:
            print(f"kept database {name}")
        else:
            with admin.connect() as conn:
                conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--queues", type=int, default=10)
    parser.add_argument("--runs", type=int, default=5, help="timed requests per page")
    parser.add_argument("--pause", type=float, default=1.1, help="seconds between requests")
    parser.add_argument("--payload-pad", type=int, default=20, help="extra payload bytes")
    parser.add_argument("--admin-url", default=ADMIN_URL, help="a URL that may CREATE DATABASE")
    parser.add_argument("--keep", action="store_true", help="keep the database")
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
