"""The L1X producer: a separate process offering at a fixed rate, as a web process would.

    python -m bench.producer SYSTEM URL N RATE

Offers ``N`` messages (payload ``user_id`` 0..N-1) at ``RATE`` per second, one per
transaction, through SYSTEM's public producer API (``ours``, ``procrastinate``, ``pgqueuer``),
after :data:`WARMUP` warm-up offers at the same rate (``user_id`` -1, -2, ...). Prints one
JSON line: ``committed`` (the ``time.perf_counter()`` right after each commit returned;
``CLOCK_MONOTONIC``, so comparable with the consumer's process), ``warmup_committed`` (the
same for the warm-up offers, ``user_id`` -1 first) and ``cpu`` (this process's CPU seconds
over the N offers).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable

from sqlalchemy.engine import make_url

from .peers import _bytes, _pgq_queries, _procrastinate_app, payload

#: Offers before the measured ones, at the same rate: a consumer that has just started pays for
#: its connections' first statements over its first few dozen messages (PostgreSQL parses and
#: plans a statement anew on each connection until the driver prepares it; psycopg does at its
#: 5th execution there). A user's workers run for days, so L1X measures the steady state after
#: these and reports their latencies apart, as the cold start (``cold_p50_ms``,
#: ``cold_max_ms``).
WARMUP = 50

#: The warm-up offers' commit times (``user_id`` -1 first), the measured ones', and the CPU
#: seconds of the measured ones.
Paced = tuple[list[float], list[float], float]


def _slots(n: int, rate: float) -> list[tuple[int, float]]:
    """Each offer's ``user_id`` and its time after the first, warm-up offers first."""
    ids = [-1 - j for j in range(WARMUP)] + list(range(n))
    return [(i, k / rate) for k, i in enumerate(ids)]


def _paced(n: int, rate: float, offer: Callable[[int], None]) -> Paced:
    committed: list[float] = []
    c0 = 0.0
    t0 = time.perf_counter()
    for i, at in _slots(n, rate):
        if i == 0:
            c0 = time.process_time()
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        offer(i)
        committed.append(time.perf_counter())
    return committed[:WARMUP], committed[WARMUP:], time.process_time() - c0


async def _apaced(n: int, rate: float, offer: Callable[[int], Awaitable[object]]) -> Paced:
    committed: list[float] = []
    c0 = 0.0
    t0 = time.perf_counter()
    for i, at in _slots(n, rate):
        if i == 0:
            c0 = time.process_time()
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        await offer(i)
        committed.append(time.perf_counter())
    return committed[:WARMUP], committed[WARMUP:], time.process_time() - c0


def main(argv: list[str]) -> int:
    system, raw_url, n, rate = argv[0], argv[1], int(argv[2]), float(argv[3])
    url = make_url(raw_url)
    if system == "ours":
        from sqlalchemy.orm import sessionmaker

        from sqla_delayedq import DelayedQueue, create_engine

        from .workloads import QUEUE

        engine = create_engine(url)
        sessions = sessionmaker(engine)
        q = DelayedQueue(QUEUE)

        def offer(i: int) -> None:
            with sessions.begin() as s:
                q.offer(s, f"l1x-{i}", payload(i))

        warmup, committed, cpu = _paced(n, rate, offer)
        engine.dispose()
    elif system == "procrastinate":

        async def run_procrastinate() -> Paced:
            app = _procrastinate_app(url, [])
            task = app.tasks["bench"]
            async with app.open_async():
                return await _apaced(n, rate, lambda i: task.defer_async(**payload(i)))

        warmup, committed, cpu = asyncio.run(run_procrastinate())
    elif system == "pgqueuer":

        async def run_pgqueuer() -> Paced:
            conn, queries = await _pgq_queries(url)
            try:
                return await _apaced(n, rate, lambda i: queries.enqueue("bench", _bytes(i)))
            finally:
                await conn.close()

        warmup, committed, cpu = asyncio.run(run_pgqueuer())
    else:
        raise SystemExit(f"unknown system {system!r}")
    print(json.dumps({"committed": committed, "warmup_committed": warmup, "cpu": cpu}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
