"""The peers: procrastinate 3 and pgqueuer 1, on PostgreSQL, through their documented public APIs.

Both are asyncio-first, so each workload runs their async API in one event loop, the way their
documentation shows it for throughput:

- procrastinate: ``App(connector=PsycopgConnector(...))``, an ``async def`` task,
  ``task.defer_async`` (E1), ``task.batch_defer_async`` (E2), ``app.run_worker_async(
  concurrency=4, wait=False)`` to drain (C1), ``delete_jobs="successful"`` so that the table
  does not grow. Its worker fetches and finishes one job per round trip: no C2.
- pgqueuer: an ``asyncpg`` connection (the driver its README uses), ``Queries.enqueue`` with one
  entrypoint (E1) or lists (E2), and four ``QueueManager`` objects, each on its own connection,
  ``run(mode=drain, batch_size=1)`` (C1) or ``batch_size=100`` (C2). Its status log is buffered
  and flushed per ``batch_size`` jobs (at ``batch_size=1``, per job).

E0 (a domain row and one message in the caller's transaction) uses what each documents for
that: procrastinate's ``task.configure(connection=conn).defer_async(...)`` on the caller's
psycopg ``AsyncConnection``, pgqueuer's ``Queries.enqueue`` inside ``connection.transaction()``
of the caller's asyncpg connection; the domain row is a plain ``INSERT`` on that connection.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from sqlalchemy.engine import URL

from ._env import Measure, Meter

CHANNEL_QUEUE = "bench"

#: Workloads a peer cannot express, with the reason (recorded as ``n/a`` in results.json).
NOT_EXPRESSIBLE = {
    "procrastinate": {
        "C2": "the worker fetches and acknowledges one job per round trip; no batch take or "
        "batch acknowledgement (3.x)",
    },
    "pgqueuer": {},
}


def _libpq(url: URL) -> str:
    return url.set(drivername="postgresql").render_as_string(hide_password=False)


def payload(i: int) -> dict[str, Any]:
    return {"user_id": i, "kind": "reminder", "note": "remember to renew your subscription"}


# -- schemas -------------------------------------------------------------------------------------


def install(url: URL) -> None:
    """Create procrastinate's and pgqueuer's tables in the benchmark database."""
    app = _procrastinate_app(url, [])
    with app.open():
        app.schema_manager.apply_schema()

    async def pgq() -> None:
        import asyncpg
        from pgqueuer.db import AsyncpgDriver
        from pgqueuer.queries import Queries

        conn = await asyncpg.connect(_libpq(url))
        await Queries(AsyncpgDriver(conn)).install()
        await conn.close()

    asyncio.run(pgq())


def truncate(url: URL) -> None:
    import psycopg

    with psycopg.connect(_libpq(url), autocommit=True) as conn:
        conn.execute("TRUNCATE procrastinate_jobs CASCADE")
        conn.execute("TRUNCATE pgqueuer, pgqueuer_log, pgqueuer_statistics")
        for table in ("procrastinate_jobs", "pgqueuer", "pgqueuer_log"):
            conn.execute(f"VACUUM ANALYZE {table}")


# -- procrastinate ----------------------------------------------------------------------------


def _procrastinate_app(url: URL, sink: list[int], *, max_size: int = 10) -> Any:
    import procrastinate

    app = procrastinate.App(
        connector=procrastinate.PsycopgConnector(conninfo=_libpq(url), max_size=max_size)
    )

    @app.task(name="bench", queue=CHANNEL_QUEUE)
    async def handle(user_id: int, kind: str, note: str) -> None:
        sink.append(user_id)

    return app


DOMAIN_INSERT_PSYCOPG = "INSERT INTO bench_orders (customer, created_at) VALUES (%s, now())"
DOMAIN_INSERT_ASYNCPG = "INSERT INTO bench_orders (customer, created_at) VALUES ($1, now())"


def procrastinate_e0(url: URL, backend: str, n: int) -> Measure:
    import psycopg

    async def run() -> Measure:
        app = _procrastinate_app(url, [])
        task = app.tasks["bench"]
        async with app.open_async():
            conn = await psycopg.AsyncConnection.connect(_libpq(url), autocommit=True)
            await conn.execute("DELETE FROM bench_orders")

            async def one(i: int) -> None:
                async with conn.transaction():
                    await conn.execute(DOMAIN_INSERT_PSYCOPG, (f"c{i}",))
                    await task.configure(connection=conn).defer_async(**payload(i))

            await one(-1)
            with Meter(backend) as m:
                for i in range(n):
                    await one(i)
            await conn.close()
        return m.result(n)

    return asyncio.run(run())


def procrastinate_e1(url: URL, backend: str, n: int) -> Measure:
    async def run() -> Measure:
        app = _procrastinate_app(url, [])
        task = app.tasks["bench"]
        async with app.open_async():
            await task.defer_async(**payload(-1))
            with Meter(backend) as m:
                for i in range(n):
                    await task.defer_async(**payload(i))
        return m.result(n)

    return asyncio.run(run())


def procrastinate_e2(url: URL, backend: str, n: int, batch: int = 1000) -> Measure:
    async def run() -> Measure:
        app = _procrastinate_app(url, [])
        task = app.tasks["bench"]
        async with app.open_async():
            await task.batch_defer_async(payload(-1))
            with Meter(backend) as m:
                for start in range(0, n, batch):
                    await task.batch_defer_async(*(payload(i) for i in range(start, start + batch)))
        return m.result(n)

    return asyncio.run(run())


async def _procrastinate_fill(app: Any, n: int) -> None:
    task = app.tasks["bench"]
    for start in range(0, n, 5000):
        await task.batch_defer_async(*(payload(i) for i in range(start, min(n, start + 5000))))


def procrastinate_c1(url: URL, backend: str, n: int, consumers: int = 4) -> Measure:
    async def run() -> Measure:
        done: list[int] = []
        app = _procrastinate_app(url, done)
        async with app.open_async():
            await _procrastinate_fill(app, n)
            with Meter(backend) as m:
                await app.run_worker_async(
                    queues=[CHANNEL_QUEUE],
                    concurrency=consumers,
                    wait=False,
                    delete_jobs="successful",
                    install_signal_handlers=False,
                )
        if len(done) != n:
            raise RuntimeError(f"procrastinate handled {len(done)} of {n}")
        return m.result(n)

    return asyncio.run(run())


# -- pgqueuer ------------------------------------------------------------------------------------


async def _pgq_queries(url: URL) -> tuple[Any, Any]:
    import asyncpg
    from pgqueuer.db import AsyncpgDriver
    from pgqueuer.queries import Queries

    conn = await asyncpg.connect(_libpq(url))
    return conn, Queries(AsyncpgDriver(conn))


def _bytes(i: int) -> bytes:
    return json.dumps(payload(i)).encode()


def pgqueuer_e0(url: URL, backend: str, n: int) -> Measure:
    async def run() -> Measure:
        conn, queries = await _pgq_queries(url)
        await conn.execute("DELETE FROM bench_orders")

        async def one(i: int) -> None:
            async with conn.transaction():
                await conn.execute(DOMAIN_INSERT_ASYNCPG, f"c{i}")
                await queries.enqueue("bench", _bytes(i))

        await one(-1)
        with Meter(backend) as m:
            for i in range(n):
                await one(i)
        await conn.close()
        return m.result(n)

    return asyncio.run(run())


def pgqueuer_e1(url: URL, backend: str, n: int) -> Measure:
    async def run() -> Measure:
        conn, queries = await _pgq_queries(url)
        await queries.enqueue("bench", _bytes(-1))
        with Meter(backend) as m:
            for i in range(n):
                await queries.enqueue("bench", _bytes(i))
        await conn.close()
        return m.result(n)

    return asyncio.run(run())


def pgqueuer_e2(url: URL, backend: str, n: int, batch: int = 1000) -> Measure:
    async def run() -> Measure:
        conn, queries = await _pgq_queries(url)
        await queries.enqueue(["bench"], [_bytes(-1)], [0])
        with Meter(backend) as m:
            for start in range(0, n, batch):
                await queries.enqueue(
                    ["bench"] * batch, [_bytes(i) for i in range(start, start + batch)], [0] * batch
                )
        await conn.close()
        return m.result(n)

    return asyncio.run(run())


async def _pgq_fill(queries: Any, n: int) -> None:
    for start in range(0, n, 5000):
        size = min(n, start + 5000) - start
        await queries.enqueue(
            ["bench"] * size, [_bytes(i) for i in range(start, start + size)], [0] * size
        )


async def _pgq_manager(url: URL, done: list[int]) -> tuple[Any, Any]:
    import asyncpg
    from pgqueuer import QueueManager
    from pgqueuer.db import AsyncpgDriver
    from pgqueuer.queries import Queries

    conn = await asyncpg.connect(_libpq(url))
    qm = QueueManager(Queries(AsyncpgDriver(conn)))

    @qm.entrypoint("bench")
    async def handle(job: Any) -> None:
        done.append(json.loads(job.payload)["user_id"])

    return conn, qm


def _pgqueuer_drain(url: URL, backend: str, n: int, consumers: int, batch: int) -> Measure:
    from datetime import timedelta

    from pgqueuer.types import QueueExecutionMode

    async def run() -> Measure:
        conn, queries = await _pgq_queries(url)
        await _pgq_fill(queries, n)
        await conn.close()
        done: list[int] = []
        managers = [await _pgq_manager(url, done) for _ in range(consumers)]
        with Meter(backend) as m:
            await asyncio.gather(
                *(
                    qm.run(
                        batch_size=batch,
                        mode=QueueExecutionMode.drain,
                        dequeue_timeout=timedelta(seconds=0.05),
                    )
                    for _, qm in managers
                )
            )
        for c, _ in managers:
            await c.close()
        if len(done) != n:
            raise RuntimeError(f"pgqueuer handled {len(done)} of {n}")
        return m.result(n)

    return asyncio.run(run())


def pgqueuer_c1(url: URL, backend: str, n: int, consumers: int = 4) -> Measure:
    return _pgqueuer_drain(url, backend, n, consumers, 1)


def pgqueuer_c2(url: URL, backend: str, n: int, consumers: int = 4, batch: int = 100) -> Measure:
    return _pgqueuer_drain(url, backend, n, consumers, batch)


PEERS: dict[str, dict[str, Any]] = {
    "procrastinate": {
        "E0": procrastinate_e0,
        "E1": procrastinate_e1,
        "E2": procrastinate_e2,
        "C1": procrastinate_c1,
    },
    "pgqueuer": {
        "E0": pgqueuer_e0,
        "E1": pgqueuer_e1,
        "E2": pgqueuer_e2,
        "C1": pgqueuer_c1,
        "C2": pgqueuer_c2,
    },
}
