"""Ordered delivery per group key: what it costs against the same run without groups.

    python -m bench.bench_groups                               # PostgreSQL and MariaDB, 3 rounds
    python -m bench.bench_groups --backends postgresql --runs 5 --groups 200 --per-group 20

As a deployment runs it (not in process): ``delayedq worker -p 4 -c 4`` in a subprocess (4
processes of 4 threads, poll interval 0.2 s, handlers of 2 ms), and this process as the producer:
one transaction offers ``--groups`` x ``--per-group`` messages, with a group key each
(``--groups`` on the worker) or without (the same run without groups), in two arrangements:

- **over time**: message i of every group is due before message i + 1 of any (each group's
  messages were offered as its events happened, all due now): the due order interleaves groups;
- **in bursts**: every message due at the same time, so the due order (then by id) is each
  group's 20 messages in a row, the worst case for the take, which walks past the messages of
  groups whose head is in flight.

The figure is messages per second from the producer's commit to the last acknowledgement (the
table is polled every 20 ms). Grouped and plain runs alternate within each round, in both
consumption modes, so drift on a shared machine hits both.

It prints a table (median, min and max over the rounds) and ``--json`` writes the figures. No
timed assertion anywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import URL
from sqlalchemy.orm import sessionmaker

from ._env import fresh_database, truncate

QUEUE = "groups"
REPO = Path(__file__).resolve().parents[1]


def handle(envelope: Any) -> None:
    """The workers' handler: 2 ms of work."""
    time.sleep(0.002)


def handle_transactional(envelope: Any, session: Any) -> None:
    time.sleep(0.002)


#: The deployment: worker processes and threads per process.
PROCESSES, THREADS = 4, 4


def _worker(url: URL, mode: str, grouped: bool, log: Path) -> subprocess.Popen[bytes]:
    target = "bench.bench_groups:handle" + ("" if mode == "lease" else "_transactional")
    cmd = [sys.executable, "-m", "sqla_delayedq.cli", "worker", target, "-q", QUEUE]
    cmd += ["-p", str(PROCESSES), "-c", str(THREADS), "--mode", mode]
    cmd += ["--poll-interval", "0.2", "--no-monitor"]
    if grouped:
        cmd.append("--groups")
    env = {**os.environ, "DELAYEDQ_DATABASE_URL": url.render_as_string(hide_password=False)}
    with log.open("w") as out:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stderr=out)


def drain(
    url: URL,
    mode: str,
    grouped: bool,
    burst: bool,
    groups: int,
    per_group: int,
    tmp: Path,
    analyze: bool = False,
) -> float:
    """One run: messages per second from the offer's commit to the last acknowledgement."""
    from datetime import datetime, timedelta

    from sqla_delayedq import DelayedQueue, create_engine

    truncate(url)
    log = tmp / "worker.log"
    proc = _worker(url, mode, grouped, log)
    engine = create_engine(url)
    try:
        deadline = time.monotonic() + 60
        while log.read_text().count(f"consuming {QUEUE} with") < PROCESSES:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"the workers did not start:\n{log.read_text()}")
            time.sleep(0.05)
        queue: DelayedQueue[Any] = DelayedQueue(QUEUE, groups=True)
        now = datetime.now(UTC)
        messages = [
            (
                f"g{g:04d}/{i:03d}",
                {"i": i},
                now if burst else now - timedelta(milliseconds=per_group - i),
                f"g{g:04d}" if grouped else None,
            )
            for i in range(per_group)
            for g in range(groups)
        ]
        with sessionmaker(engine).begin() as s:
            queue.offer_batch(s, messages)
        if analyze:  # fresh statistics (and plans) for the full table, as autovacuum's would be
            with engine.begin() as conn:
                conn.execute(sa.text("ANALYZE delayed_queue"))
        started = time.perf_counter()
        count = sa.text("SELECT count(*) FROM delayed_queue WHERE queue = :q")
        while True:
            with engine.connect() as conn:
                if conn.execute(count, {"q": QUEUE}).scalar_one() == 0:
                    break
            if time.perf_counter() - started > 600 or proc.poll() is not None:
                raise RuntimeError(f"the drain did not finish:\n{log.read_text()}")
            time.sleep(0.02)
        return len(messages) / (time.perf_counter() - started)
    finally:
        proc.terminate()
        proc.wait(60)
        engine.dispose()


def run(
    backends: list[str],
    runs: int,
    groups: int,
    per_group: int,
    modes: tuple[str, ...] = ("lease", "transactional"),
    analyze: bool = False,
) -> dict[str, Any]:
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for backend in backends:
            with fresh_database(backend, Path(tmp)) as url:
                for arrangement in ("over time", "in bursts"):
                    for mode in modes:
                        figures: dict[str, list[float]] = {"plain": [], "groups": []}
                        for r in range(runs):
                            order = (False, True) if r % 2 == 0 else (True, False)
                            for grouped in order:
                                burst = arrangement == "in bursts"
                                rate = drain(
                                    url, mode, grouped, burst, groups, per_group, Path(tmp), analyze
                                )
                                label = "groups" if grouped else "plain"
                                figures[label].append(rate)
                                print(
                                    f"  {backend} {arrangement} {mode} {label}: {rate:,.0f} msg/s",
                                    flush=True,
                                )
                        results.setdefault(backend, {})[f"{arrangement}, {mode}"] = figures
    return results


def report(results: dict[str, Any], groups: int, per_group: int, runs: int) -> str:
    lines = [
        f"\nGroups: {groups} groups x {per_group} messages, `delayedq worker -p 4 -c 4`, "
        f"producer in this process, handlers of 2 ms, {runs} rounds (median, min-max)",
        "| backend | arrangement, mode | without groups, msg/s | with groups, msg/s | ratio |",
        "|---|---|---|---|---|",
    ]
    for backend, modes in results.items():
        for mode, figures in modes.items():
            plain, grouped = (statistics.median(figures[k]) for k in ("plain", "groups"))

            def span(k: str, figures: dict[str, list[float]] = figures) -> str:
                return f"{min(figures[k]):,.0f}-{max(figures[k]):,.0f}"

            lines.append(
                f"| {backend} | {mode} | {plain:,.0f} ({span('plain')}) | "
                f"{grouped:,.0f} ({span('groups')}) | {grouped / plain:.2f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_groups", description=__doc__)
    parser.add_argument("--backends", default="postgresql,mariadb")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--groups", type=int, default=200)
    parser.add_argument("--per-group", type=int, default=20)
    parser.add_argument("--modes", default="lease,transactional")
    parser.add_argument(
        "--analyze",
        action="store_true",
        help="ANALYZE the table after the offer (fresh statistics, as autovacuum's would be)",
    )
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    results = run(backends, args.runs, args.groups, args.per_group, modes, args.analyze)
    print(report(results, args.groups, args.per_group, args.runs))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
