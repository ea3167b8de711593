"""The L1X producer: a separate process offering at a fixed rate, as a web process would.

    python -m bench.producer SYSTEM URL N RATE

Offers ``N`` messages (payload ``user_id`` 0..N-1) at ``RATE`` per second, one per
transaction, through SYSTEM's public producer API (``ours``, ``procrastinate``, ``pgqueuer``),
after one warm-up offer (``user_id`` -1). Prints one JSON line: ``committed`` (the
``time.perf_counter()`` right after each commit returned; ``CLOCK_MONOTONIC``, so comparable
with the consumer's process) and ``cpu`` (this process's CPU seconds over the N offers).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable

from sqlalchemy.engine import make_url

from .peers import _bytes, _pgq_queries, _procrastinate_app, payload


def _paced(n: int, rate: float, offer: Callable[[int], None]) -> tuple[list[float], float]:
    offer(-1)
    committed: list[float] = []
    c0 = time.process_time()
    t0 = time.perf_counter()
    for i in range(n):
        delay = t0 + i / rate - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        offer(i)
        committed.append(time.perf_counter())
    return committed, time.process_time() - c0


async def _apaced(
    n: int, rate: float, offer: Callable[[int], Awaitable[object]]
) -> tuple[list[float], float]:
    await offer(-1)
    committed: list[float] = []
    c0 = time.process_time()
    t0 = time.perf_counter()
    for i in range(n):
        delay = t0 + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        await offer(i)
        committed.append(time.perf_counter())
    return committed, time.process_time() - c0


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

        committed, cpu = _paced(n, rate, offer)
        engine.dispose()
    elif system == "procrastinate":

        async def run_procrastinate() -> tuple[list[float], float]:
            app = _procrastinate_app(url, [])
            task = app.tasks["bench"]
            async with app.open_async():
                return await _apaced(n, rate, lambda i: task.defer_async(**payload(i)))

        committed, cpu = asyncio.run(run_procrastinate())
    elif system == "pgqueuer":

        async def run_pgqueuer() -> tuple[list[float], float]:
            conn, queries = await _pgq_queries(url)
            try:
                return await _apaced(n, rate, lambda i: queries.enqueue("bench", _bytes(i)))
            finally:
                await conn.close()

        committed, cpu = asyncio.run(run_pgqueuer())
    else:
        raise SystemExit(f"unknown system {system!r}")
    print(json.dumps({"committed": committed, "cpu": cpu}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
