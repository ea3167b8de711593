"""L1X: latency from the producer's commit to the handler's start, producer in another process.

The consumer runs here, idle on ``LISTEN``/``NOTIFY`` with 4 consumers; ``python -m
bench.producer`` offers at 200 msg/s in a subprocess (one transaction per message) and reports
when each commit returned. Both processes read ``time.perf_counter()`` (``CLOCK_MONOTONIC``),
so the difference is the cross-process wake-up a user's web process would see.

- ours: ``Worker(concurrency=4)`` with ``listen=True`` (the default), transactional or lease mode.
- procrastinate: ``app.run_worker_async(concurrency=4)`` (``listen_notify`` on, the default).
- pgqueuer: one ``QueueManager.run()`` with its defaults (``LISTEN`` on its connection,
  ``batch_size=10``), what ``pgq run`` starts.

The client CPU figure of L1X is the consumer process's CPU per message; the producer's is
recorded beside it as ``producer_cpu_us_per_msg``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from sqlalchemy.engine import URL
from sqlalchemy.orm import sessionmaker

from sqla_delayedq import DelayedQueue, create_engine
from sqla_delayedq.worker import Worker

from ._env import Measure, Meter
from .peers import _libpq
from .workloads import QUEUE, _percentiles

RATE = 200.0
CONSUMERS = 4
ROOT = Path(__file__).resolve().parent.parent


def _producer_cmd(system: str, url: URL, n: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "bench.producer",
        system,
        url.render_as_string(hide_password=False),
        str(n),
        str(RATE),
    ]


def _result(m: Meter, n: int, out: str, started: dict[int, float]) -> Measure:
    produced = json.loads(out.strip().splitlines()[-1])
    committed = produced["committed"]
    warmup = produced["warmup_committed"]
    ids = list(range(n)) + [-1 - j for j in range(len(warmup))]
    missing = [i for i in ids if i not in started]
    if missing:
        raise RuntimeError(f"{len(missing)} of {len(ids)} messages never reached a handler")
    cold = sorted(started[-1 - j] - at for j, at in enumerate(warmup))
    return m.result(
        n,
        **_percentiles([started[i] - committed[i] for i in range(n)]),
        cold_p50_ms=statistics.median(cold) * 1000,
        cold_max_ms=cold[-1] * 1000,
        producer_cpu_us_per_msg=produced["cpu"] / n * 1e6,
    )


def _wait(started: dict[int, float], n: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while sum(1 for i in range(n) if i in started) < n and time.monotonic() < deadline:
        time.sleep(0.01)


def _ours(url: URL, backend: str, n: int, mode: str) -> Measure:
    engine = create_engine(url, pool_size=CONSUMERS + 2)
    sessions = sessionmaker(engine)
    q = DelayedQueue(QUEUE)
    started: dict[int, float] = {}

    if mode == "transactional":

        def handle(env: Any, session: Any) -> None:
            started[env.payload["user_id"]] = time.perf_counter()
    else:

        def handle(env: Any) -> None:  # type: ignore[misc]
            started[env.payload["user_id"]] = time.perf_counter()

    worker = Worker(sessions, concurrency=CONSUMERS, poll_interval=5.0)
    worker.register(q, handle, mode=mode)  # type: ignore[arg-type]
    worker.start()
    time.sleep(0.5)  # the listener connects
    with Meter(backend) as m:
        proc = subprocess.run(
            _producer_cmd("ours", url, n), cwd=ROOT, capture_output=True, text=True, check=True
        )
        _wait(started, n, 30)
    worker.stop(5)
    engine.dispose()
    return _result(m, n, proc.stdout, started)


def ours_l1x(url: URL, backend: str, n: int) -> Measure:
    """Transactional mode: the handler starts right after the take, before any commit."""
    return _ours(url, backend, n, "transactional")


def ours_lease_l1x(url: URL, backend: str, n: int) -> Measure:
    """Lease mode: the take commits, then the handler starts."""
    return _ours(url, backend, n, "lease")


async def _run_producer(system: str, url: URL, n: int) -> str:
    proc = await asyncio.create_subprocess_exec(
        *_producer_cmd(system, url, n), cwd=ROOT, stdout=asyncio.subprocess.PIPE
    )
    out, _ = await proc.communicate()
    if proc.returncode:
        raise RuntimeError(f"the {system} producer exited with {proc.returncode}")
    return out.decode()


async def _await_all(started: dict[int, float], n: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while sum(1 for i in range(n) if i in started) < n and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


def procrastinate_l1x(url: URL, backend: str, n: int) -> Measure:
    import procrastinate

    async def run() -> Measure:
        started: dict[int, float] = {}
        app = procrastinate.App(
            connector=procrastinate.PsycopgConnector(conninfo=_libpq(url), max_size=10)
        )

        @app.task(name="bench", queue=QUEUE)
        async def handle(user_id: int, kind: str, note: str) -> None:
            started[user_id] = time.perf_counter()

        async with app.open_async():
            worker = asyncio.create_task(
                app.run_worker_async(
                    queues=[QUEUE], concurrency=CONSUMERS, install_signal_handlers=False
                )
            )
            await asyncio.sleep(0.5)
            with Meter(backend) as m:
                out = await _run_producer("procrastinate", url, n)
                await _await_all(started, n, 30)
            worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await worker
        return _result(m, n, out, started)

    return asyncio.run(run())


def pgqueuer_l1x(url: URL, backend: str, n: int) -> Measure:
    import asyncpg
    from pgqueuer import QueueManager
    from pgqueuer.db import AsyncpgDriver
    from pgqueuer.queries import Queries

    async def run() -> Measure:
        started: dict[int, float] = {}
        conn = await asyncpg.connect(_libpq(url))
        qm = QueueManager(Queries(AsyncpgDriver(conn)))

        @qm.entrypoint("bench")
        async def handle(job: Any) -> None:
            started[json.loads(job.payload)["user_id"]] = time.perf_counter()

        consumer = asyncio.create_task(qm.run())
        await asyncio.sleep(0.5)
        with Meter(backend) as m:
            out = await _run_producer("pgqueuer", url, n)
            await _await_all(started, n, 30)
        qm.shutdown.set()
        await consumer
        await conn.close()
        return _result(m, n, out, started)

    return asyncio.run(run())


L1X = {
    "ours": ours_l1x,
    "ours_lease": ours_lease_l1x,
    "procrastinate": procrastinate_l1x,
    "pgqueuer": pgqueuer_l1x,
}
