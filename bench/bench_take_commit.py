"""What a lease take's commit costs with and without waiting for the WAL flush (PostgreSQL).

A worker's lease-mode take is alone in its transaction, so its commit need not wait for the
disk (``_dialects.TAKE_ONLY``; see ``docs/backends.md``). This times, in one process and
interleaved (so drift hits both), ``--n`` takes of one message each, every one in its own
transaction with the flag (relaxed) and without it (durable, as a user's ``try_poll`` in a
transaction of their own), each followed by its acknowledgement (not timed), on a fresh
database with ``synchronous_commit`` on. In process: the figure is the take's round trips and
commit, not a wake-up across processes (``make bench``'s L1X measures that).

    .venv/bin/python -m bench.bench_take_commit --n 3000
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from sqlalchemy.orm import sessionmaker

from sqla_delayedq import DelayedQueue, create_engine
from sqla_delayedq._dialects import TAKE_ONLY

from ._env import fresh_database


def percentiles(samples: list[float]) -> str:
    xs = sorted(samples)
    n = len(xs)
    return " / ".join(f"{xs[min(n - 1, int(n * q))]:.2f}" for q in (0.5, 0.95, 0.99))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_take_commit", description=__doc__)
    parser.add_argument("--n", type=int, default=3000)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp, fresh_database("postgresql", Path(tmp)) as url:
        engine = create_engine(url)
        sessions = sessionmaker(engine)
        queue: DelayedQueue[dict[str, int]] = DelayedQueue("q")
        with sessions.begin() as s:
            queue.offer_batch(s, [(f"k{i}", {"i": i}, None) for i in range(2 * args.n)])
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.n):
            for relaxed in (False, True):
                started = time.perf_counter()
                with sessions() as s, s.begin():
                    if relaxed:
                        s.info[TAKE_ONLY] = True
                    (envelope,) = queue.poll_batch(s, 1).envelopes
                times[relaxed].append((time.perf_counter() - started) * 1000)
                with sessions.begin() as s:
                    queue.ack(s, envelope)
        engine.dispose()
    print(f"Lease take and commit, one message, {args.n} each, interleaved, in process")
    print("| commit | p50 / p95 / p99 |")
    print("|---|---|")
    print(f"| waits for the WAL flush (a user's take) | {percentiles(times[False])} ms |")
    print(f"| relaxed (a worker's take) | {percentiles(times[True])} ms |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
