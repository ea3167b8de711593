"""A pinned vacuum horizon at a fixed offered rate: does the queue keep delivering?

    python -m bench.bench_horizon                       # 4 min pinned, 200 msg/s, both modes
    python -m bench.bench_horizon --pin 2 --modes lease --rate 100

A producer (this process) offers ``--rate`` messages a second, one per transaction, for
``--warmup`` minutes, then for ``--pin`` minutes while another session holds a transaction open
(``SELECT txid_current()``, then idle: what a forgotten report does), then ``--after`` minutes
with the horizon free again. A worker in a separate process (``--workers`` threads, the given
mode) handles them and reports each take's duration. The table printed per minute:

- **offered** and **completed** messages, and completed as a share of offered;
- **take p50 / p99 / max**: how long one take took (lease mode: the claim; transactional mode:
  the take and the handler, which does nothing here, before the commit);
- **empty takes**: the share of takes that found nothing;
- at the end of the pinned phase, **dead rows per message** (PostgreSQL's ``n_dead_tup`` growth
  over the messages completed while nothing could be vacuumed) and the index bytes per message.

PostgreSQL only (the failure it measures is PostgreSQL's). No timed assertion anywhere: it
prints, and ``--json`` writes the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import sessionmaker

from ._env import fresh_database

QUEUE = "horizon"


# -- the worker process ---------------------------------------------------------------------------


def consume(url: str, mode: str, workers: int, out: Path) -> None:
    """Run a worker; every 5 s append ``{"t", "done", "takes": [seconds...], "empty"}``."""
    from sqla_delayedq import DelayedQueue, create_engine
    from sqla_delayedq.worker import Worker

    engine = create_engine(url, pool_size=workers + 4)
    queue: DelayedQueue[Any] = DelayedQueue(QUEUE)
    lock = threading.Lock()
    state: dict[str, Any] = {"done": 0, "takes": [], "empty": 0}
    take = queue.poll_batch

    def timed(session: Any, n: int, **kw: Any) -> Any:
        started = time.perf_counter()
        polled = take(session, n, **kw)
        with lock:
            state["takes"].append(time.perf_counter() - started)
            state["empty"] += not polled.envelopes
        return polled

    queue.poll_batch = timed  # type: ignore[method-assign]
    process = queue.process_next

    def timed_process(session: Any, handler: Any) -> Any:
        # Transactional mode: the take (a DELETE ... RETURNING) and the handler, in one call.
        started = time.perf_counter()
        result, ahead = process(session, handler)
        with lock:
            state["takes"].append(time.perf_counter() - started)
            state["empty"] += result is None
        return result, ahead

    if mode == "transactional":
        queue.process_next = timed_process  # type: ignore[method-assign]

    def handled(*_: Any) -> None:
        with lock:
            state["done"] += 1

    worker = Worker(sessionmaker(engine), concurrency=workers, poll_interval=1.0)
    if mode == "transactional":
        worker.register(queue, lambda env, session: handled(), mode="transactional")
    else:
        worker.register(queue, lambda env: handled())

    def report() -> None:
        while not worker.stopping:
            time.sleep(5)
            with lock:
                snap = {"t": time.time(), **state}
                state.update(done=0, takes=[], empty=0)
            with out.open("a") as f:
                f.write(json.dumps(snap) + "\n")

    threading.Thread(target=report, daemon=True).start()
    worker.run()


# -- the producer and the pin ---------------------------------------------------------------------


def table_stats(engine: sa.Engine) -> dict[str, int]:
    with engine.connect() as conn:
        row = conn.exec_driver_sql(
            "SELECT n_dead_tup, n_tup_ins, n_tup_upd, n_tup_hot_upd, n_tup_del,"
            " pg_indexes_size(relid) AS index_bytes, pg_relation_size(relid) AS heap_bytes"
            " FROM pg_stat_user_tables WHERE relname = 'delayed_queue'"
        ).one()
        return dict(row._mapping)


def run_mode(url: sa.URL, mode: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from sqla_delayedq import DelayedQueue, create_engine

    engine = create_engine(url)
    sessions = sessionmaker(engine)
    queue: DelayedQueue[Any] = DelayedQueue(QUEUE, notify=True)
    out = tmp / f"{mode}.jsonl"
    rendered = url.render_as_string(hide_password=False)
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bench.bench_horizon",
            "--consume",
            rendered,
            mode,
            str(args.workers),
            str(out),
        ]
    )
    time.sleep(3)
    phases = [("warmup", args.warmup), ("pinned", args.pin), ("after", args.after)]
    offered: list[tuple[float, int]] = []
    marks: dict[str, float] = {}
    stats: dict[str, dict[str, int]] = {}
    pin_conn = None
    interval = 1.0 / args.rate
    n = 0
    try:
        for phase, minutes in phases:
            marks[phase] = time.time()
            if phase == "pinned":
                pin = sa.create_engine(url, poolclass=sa.NullPool)
                pin_conn = pin.connect()
                pin_conn.exec_driver_sql("SELECT txid_current()")
                stats["pin_start"] = table_stats(engine)
            if phase == "after" and pin_conn is not None:
                stats["pin_end"] = table_stats(engine)
                pin_conn.rollback()
                pin_conn.close()
                pin_conn = None
            end = time.time() + minutes * 60
            next_at = time.monotonic()
            while time.time() < end:
                with sessions() as s, s.begin():
                    queue.offer(s, f"m{n}", {"n": n})
                n += 1
                offered.append((time.time(), 1))
                next_at += interval
                delay = next_at - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
        time.sleep(5)
    finally:
        if pin_conn is not None:
            pin_conn.rollback()
            pin_conn.close()
        worker.terminate()
        worker.wait(60)
    reports = [json.loads(line) for line in out.read_text().splitlines()]
    return summarise(mode, marks, offered, reports, stats, args)


def summarise(
    mode: str,
    marks: dict[str, float],
    offered: list[tuple[float, int]],
    reports: list[dict[str, Any]],
    stats: dict[str, dict[str, int]],
    args: argparse.Namespace,
) -> dict[str, Any]:
    start, bucket = marks["warmup"], args.bucket
    minutes: dict[int, dict[str, Any]] = {}

    def row(t: float) -> dict[str, Any]:
        empty: dict[str, Any] = {"offered": 0, "done": 0, "takes": [], "empty": 0}
        return minutes.setdefault(int((t - start) // bucket), empty)

    for t, _ in offered:
        row(t)["offered"] += 1
    for r in reports:
        m = row(r["t"])
        m["done"] += r["done"]
        m["takes"] += r["takes"]
        m["empty"] += r["empty"]
    rows = []
    for minute in sorted(minutes):
        m = minutes[minute]
        takes = sorted(m["takes"])
        phase = "warmup"
        for name in ("pinned", "after"):
            if start + minute * bucket >= marks[name] - 1:
                phase = name
        rows.append(
            {
                "minute": round((minute + 1) * bucket / 60, 2),
                "phase": phase,
                "offered": m["offered"],
                "completed": m["done"],
                "share": m["done"] / m["offered"] if m["offered"] else None,
                "take_p50_ms": 1000 * statistics.median(takes) if takes else None,
                "take_p99_ms": 1000 * takes[int(0.99 * (len(takes) - 1))] if takes else None,
                "take_max_ms": 1000 * takes[-1] if takes else None,
                "empty_share": m["empty"] / len(takes) if takes else None,
            }
        )
    result: dict[str, Any] = {
        "mode": mode,
        "rate": args.rate,
        "workers": args.workers,
        "minutes": rows,
    }
    if "pin_start" in stats and "pin_end" in stats:
        a, b = stats["pin_start"], stats["pin_end"]
        completed = b["n_tup_del"] - a["n_tup_del"]
        if completed:
            result["dead_rows_per_message"] = (b["n_dead_tup"] - a["n_dead_tup"]) / completed
            result["index_bytes_per_message"] = (b["index_bytes"] - a["index_bytes"]) / completed
            result["heap_bytes_per_message"] = (b["heap_bytes"] - a["heap_bytes"]) / completed
            result["updates_per_message"] = (b["n_tup_upd"] - a["n_tup_upd"]) / completed
            result["hot_updates_per_message"] = (
                b["n_tup_hot_upd"] - a["n_tup_hot_upd"]
            ) / completed
    return result


def show(result: dict[str, Any]) -> None:
    print(f"\n{result['mode']} mode, {result['rate']} msg/s offered, {result['workers']} threads")
    print(
        f"{'min':>3} {'phase':<7} {'offered':>7} {'done':>6} {'share':>6} {'take p50':>9} {'p99':>9} {'max':>9} {'empty':>6}"
    )
    for r in result["minutes"]:
        fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
        print(
            f"{r['minute']:>3} {r['phase']:<7} {r['offered']:>7} {r['completed']:>6} "
            f"{fmt(r['share'], '>6.0%')} {fmt(r['take_p50_ms'], '>7.1f')}ms "
            f"{fmt(r['take_p99_ms'], '>7.1f')}ms {fmt(r['take_max_ms'], '>7.0f')}ms "
            f"{fmt(r['empty_share'], '>6.0%')}"
        )
    if "dead_rows_per_message" in result:
        print(
            f"while pinned: {result['dead_rows_per_message']:.2f} dead rows, "
            f"{result['index_bytes_per_message']:.0f} index bytes, "
            f"{result['heap_bytes_per_message']:.0f} heap bytes, "
            f"{result['updates_per_message']:.2f} updates "
            f"({result['hot_updates_per_message']:.2f} HOT) per message"
        )


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--consume":
        url, mode, workers, out = sys.argv[2:6]
        consume(url, mode, int(workers), Path(out))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="lease,transactional")
    parser.add_argument("--rate", type=float, default=200.0)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--warmup", type=float, default=1.0, help="minutes")
    parser.add_argument("--pin", type=float, default=4.0, help="minutes")
    parser.add_argument("--after", type=float, default=1.0, help="minutes")
    parser.add_argument("--bucket", type=float, default=60.0, help="seconds per table row")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    results = []
    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes.split(","):
            with fresh_database("postgresql", Path(tmp)) as db_url:
                result = run_mode(db_url, mode, args, Path(tmp))
            show(result)
            results.append(result)
    print(f"\nload average at the start: {load[0]:.2f}, at the end: {os.getloadavg()[0]:.2f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
