"""The workloads, each three times: sqla_delayedq through its public API, a hand-written baseline,
and a hand-written "same contract" reference.

The baseline is plain psycopg 3 with the best plain-SQL technique for each workload: autocommit
single-statement inserts (E1), ``COPY`` (E2), single-statement ``DELETE ... RETURNING`` takes
with ``SKIP LOCKED`` (C1, C2), ``LISTEN``/``NOTIFY`` (L1).

The reference is plain psycopg 3 too, held to what sqla_delayedq promises, with nothing else:
an offer joins a transaction the caller commits (E1: ``BEGIN``, insert, ``COMMIT``); a batch
offer is idempotent and reports each message's outcome (E2: one ``INSERT ... SELECT ... ON
CONFLICT DO NOTHING RETURNING`` per batch); a transactional take keeps the handler's writes in
a savepoint so a failure can be recorded in the same transaction (C1: ``BEGIN``, take,
``SAVEPOINT``, ``RELEASE``, ``COMMIT``); a lease-mode batch is taken and committed before the
handler runs and acknowledged by lock token after it (C2). It shows how much of each gap to the
baseline is the contract's round trips rather than this library's code.
"""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.engine import URL
from sqlalchemy.orm import sessionmaker

from sqla_delayedq import DelayedQueue, create_engine
from sqla_delayedq.models import metadata
from sqla_delayedq.worker import Worker

from ._env import Measure, Meter, server_cpu

QUEUE = "bench"


def payload(i: int) -> dict[str, Any]:
    return {"user_id": i, "kind": "reminder", "note": "remember to renew your subscription"}


def _libpq(url: URL) -> str:
    return url.set(drivername="postgresql").render_as_string(hide_password=False)


def _fill(url: URL, n: int) -> None:
    engine = create_engine(url)
    sessions = sessionmaker(engine)
    q = DelayedQueue(QUEUE)
    now = datetime.now(UTC)
    for start in range(0, n, 5000):
        with sessions.begin() as s:
            q.offer_batch(
                s, [(f"m{i}", payload(i), now) for i in range(start, min(n, start + 5000))]
            )
    engine.dispose()


def _wait_for(counter: Callable[[], int], n: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while counter() < n and time.monotonic() < deadline:
        time.sleep(0.002)
    if counter() < n:
        raise RuntimeError(f"only {counter()} of {n} messages handled in {timeout} s")


def _cpu_of(pids: list[int]) -> float:
    """User and system CPU seconds of processes, from ``/proc`` (Linux)."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


def _drain_processes(
    url: URL, backend: str, n: int, mode: str, batch: int = 0, processes: int = 2
) -> Measure:
    """A drain by ``delayedq worker bench.drain_app:make --processes 2``, each process with half
    of the 4 consumers: what a user runs on this 2-core machine, one GIL per core. Once every
    process is up, the messages are offered in one transaction; the clock runs from its commit
    until the queue is empty. Client CPU is the worker processes' own (``/proc``)."""
    consumers = 4 // processes
    engine = create_engine(url)
    sessions = sessionmaker(engine)
    q = DelayedQueue(QUEUE)
    with tempfile.TemporaryDirectory() as ready:
        env = {
            **os.environ,
            "DELAYEDQ_BENCH_URL": url.render_as_string(hide_password=False),
            "DELAYEDQ_BENCH_MODE": mode,
            "DELAYEDQ_BENCH_BATCH": str(batch),
            "DELAYEDQ_BENCH_CONSUMERS": str(consumers),
            "DELAYEDQ_BENCH_READY": ready,
            "PYTHONPATH": str(Path(__file__).resolve().parent.parent),
        }
        command = [sys.executable, "-m", "sqla_delayedq.cli", "worker", "bench.drain_app:make"]
        supervisor = subprocess.Popen(
            [*command, "--processes", str(processes), "--no-monitor", "--log-level", "WARNING"],
            env=env,
        )
        try:
            deadline = time.monotonic() + 60
            while len(os.listdir(ready)) < processes:
                if time.monotonic() > deadline or supervisor.poll() is not None:
                    raise RuntimeError("the worker processes did not start")
                time.sleep(0.05)
            pids = [int(p) for p in os.listdir(ready)]
            time.sleep(0.5)  # their consumer threads start and find the queue empty
            now = datetime.now(UTC)
            with sessions.begin() as s:
                for start in range(0, n, 5000):
                    q.offer_batch(
                        s, [(f"m{i}", payload(i), now) for i in range(start, min(n, start + 5000))]
                    )
                c0, s0 = _cpu_of(pids), server_cpu(backend)
            t0 = time.perf_counter()
            left = sa.select(sa.literal(1)).select_from(metadata.tables["delayed_queue"]).limit(1)
            with engine.connect() as conn:
                while conn.execute(left).first() is not None:
                    conn.rollback()
                    time.sleep(0.005)
            seconds = time.perf_counter() - t0
            client, server = _cpu_of(pids) - c0, server_cpu(backend) - s0
        finally:
            supervisor.send_signal(signal.SIGTERM)
            supervisor.wait(60)
    engine.dispose()
    return Measure(seconds, n, client, server, {})


def ours_c1_processes(url: URL, backend: str, n: int) -> Measure:
    """C1 in transactional mode by 2 worker processes of 2 consumers each."""
    return _drain_processes(url, backend, n, "transactional")


def ours_c1_lease_processes(url: URL, backend: str, n: int) -> Measure:
    """C1 in lease mode by 2 worker processes of 2 consumers each."""
    return _drain_processes(url, backend, n, "lease")


def ours_c2_processes(url: URL, backend: str, n: int) -> Measure:
    """C2 (batches of 100, lease mode) by 2 worker processes of 2 consumers each."""
    return _drain_processes(url, backend, n, "lease", batch=100)


# -- E0: the marginal cost of an offer in the caller's own transaction ---------------------------

#: The domain row a user's transaction writes beside the message (E0).
DOMAIN = sa.Table(
    "bench_orders",
    sa.MetaData(),
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("customer", sa.String(100), nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
)


def create_domain(url: URL) -> None:
    engine = create_engine(url)
    DOMAIN.metadata.create_all(engine)
    engine.dispose()


def _e0(
    url: URL, backend: str, n: int, offer: Callable[[Any, DelayedQueue, int], object]
) -> Measure:
    """``n`` transactions, each a Core insert of one domain row then ``offer(session, q, i)``."""
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(DOMAIN.delete())
    sessions = sessionmaker(engine)
    q = DelayedQueue(QUEUE)
    insert = DOMAIN.insert()

    def one(i: int) -> None:
        with sessions.begin() as s:
            s.execute(insert, {"customer": f"c{i}", "created_at": datetime.now(UTC)})
            offer(s, q, i)

    one(-1)  # connect and warm the statement caches outside the timing
    with Meter(backend) as m:
        for i in range(n):
            one(i)
    engine.dispose()
    return m.result(n)


def ours_e0(url: URL, backend: str, n: int) -> Measure:
    """The domain row and ``q.offer(s, key, payload)`` in one Session transaction."""
    return _e0(url, backend, n, lambda s, q, i: q.offer(s, f"e0-{i}", payload(i)))


def hand_e0(url: URL, backend: str, n: int) -> Measure:
    """The same transaction with the message row written by hand: a Core ``INSERT`` into the
    queue table with every column the schema needs, as a user without the library would."""
    table = metadata.tables["delayed_queue"]

    def offer(s: Any, q: DelayedQueue, i: int) -> None:
        now = datetime.now(UTC)
        s.execute(
            table.insert(),
            {
                "queue": QUEUE,
                "key": f"e0-{i}",
                "payload_type": "json",
                "payload": payload(i),
                "status": "pending",
                "scheduled_at": now,
                "scheduled_at_initially": now,
                "created_at": now,
                "attempts": 0,
            },
        )

    return _e0(url, backend, n, offer)


# -- E1: one message per transaction --------------------------------------------------------


def ours_e1(url: URL, backend: str, n: int) -> Measure:
    engine = create_engine(url)
    sessions = sessionmaker(engine)
    q = DelayedQueue(QUEUE)
    with sessions.begin() as s:  # connect and warm the statement cache outside the timing
        q.offer(s, "warm-up", payload(-1))
    with Meter(backend) as m:
        for i in range(n):
            with sessions.begin() as s:
                q.offer(s, f"e1-{i}", payload(i))
    engine.dispose()
    return m.result(n)


def ours_e1_engine(url: URL, backend: str, n: int) -> Measure:
    """The Engine form, for a producer with no transaction of its own: ``q.offer(engine, ...)``
    (one autocommit statement per new message on PostgreSQL)."""
    engine = create_engine(url)
    q = DelayedQueue(QUEUE)
    q.offer(engine, "warm-up", payload(-1))
    with Meter(backend) as m:
        for i in range(n):
            q.offer(engine, f"e1-{i}", payload(i))
    engine.dispose()
    return m.result(n)


def base_e1(url: URL, backend: str, n: int) -> Measure:
    import psycopg
    from psycopg.types.json import Jsonb

    sql = (
        "INSERT INTO delayed_queue (queue, key, payload_type, payload, status, scheduled_at,"
        " scheduled_at_initially, created_at, attempts) VALUES (%s, %s, 'json', %s, 'pending',"
        " %s, %s, %s, 0) ON CONFLICT (queue, key) DO NOTHING"
    )
    with psycopg.connect(_libpq(url), autocommit=True) as conn:
        now = datetime.now(UTC)
        conn.execute(sql, (QUEUE, "warm-up", Jsonb(payload(-1)), now, now, now))
        with Meter(backend) as m:
            for i in range(n):
                now = datetime.now(UTC)
                conn.execute(sql, (QUEUE, f"e1-{i}", Jsonb(payload(i)), now, now, now))
    return m.result(n)


# -- E2: batches of 1,000 -------------------------------------------------------------------


def ours_e2(url: URL, backend: str, n: int, batch: int = 1000) -> Measure:
    engine = create_engine(url)
    sessions = sessionmaker(engine)
    q = DelayedQueue(QUEUE)
    with sessions.begin() as s:
        q.offer_batch(s, [("warm-up", payload(-1))])
    with Meter(backend) as m:
        for start in range(0, n, batch):
            with sessions.begin() as s:
                q.offer_batch(s, [(f"e2-{i}", payload(i)) for i in range(start, start + batch)])
    engine.dispose()
    return m.result(n)


def base_e2(url: URL, backend: str, n: int, batch: int = 1000) -> Measure:
    import psycopg
    from psycopg.types.json import Jsonb

    copy = (
        "COPY delayed_queue (queue, key, payload_type, payload, status, scheduled_at,"
        " scheduled_at_initially, created_at, attempts) FROM STDIN"
    )
    with psycopg.connect(_libpq(url)) as conn, Meter(backend) as m:
        for start in range(0, n, batch):
            now = datetime.now(UTC)
            with conn.transaction(), conn.cursor().copy(copy) as cp:
                for i in range(start, start + batch):
                    cp.write_row(
                        (QUEUE, f"e2-{i}", "json", Jsonb(payload(i)), "pending", now, now, now, 0)
                    )
    return m.result(n)


# -- C1 / C2: drains with 4 consumers ---------------------------------------------------------


def ours_c1(url: URL, backend: str, n: int, consumers: int = 4) -> Measure:
    """Take and ack per message: the worker's transactional mode (delete-on-take)."""
    _fill(url, n)
    engine = create_engine(url, pool_size=consumers + 2)
    sessions = sessionmaker(engine)
    q = DelayedQueue(QUEUE)
    done: list[int] = []
    worker = Worker(sessions, concurrency=consumers, poll_interval=0.05, listen=False)
    worker.register(q, lambda env, session: done.append(1), mode="transactional")
    with Meter(backend) as m:
        worker.start()
        _wait_for(lambda: len(done), n, 600)
    worker.stop(5)
    engine.dispose()
    return m.result(n)


def ours_c1_lease(url: URL, backend: str, n: int, consumers: int = 4) -> Measure:
    """Take and ack per message in lease mode (``batch_size=1``, the worker's default): the take
    commits, the handler runs outside any transaction, the ack commits."""
    _fill(url, n)
    engine = create_engine(url, pool_size=consumers + 2)
    sessions = sessionmaker(engine)
    q = DelayedQueue(QUEUE)
    done: list[int] = []
    worker = Worker(sessions, concurrency=consumers, poll_interval=0.05, listen=False)
    worker.register(q, lambda env: done.append(1), mode="lease")
    with Meter(backend) as m:
        worker.start()
        _wait_for(lambda: len(done), n, 600)
    worker.stop(5)
    engine.dispose()
    return m.result(n)


def ours_c2(url: URL, backend: str, n: int, consumers: int = 4, batch: int = 100) -> Measure:
    """Up to 100 per take, ack per batch: a batch handler in lease mode."""
    _fill(url, n)
    engine = create_engine(url, pool_size=consumers + 2)
    sessions = sessionmaker(engine)
    q = DelayedQueue(QUEUE)
    done: list[int] = []
    lock = threading.Lock()

    def handle(envelopes: list[Any]) -> None:
        with lock:
            done.append(len(envelopes))

    worker = Worker(sessions, concurrency=consumers, poll_interval=0.05, listen=False)
    worker.register_batch(q, handle, batch_size=batch)
    with Meter(backend) as m:
        worker.start()
        _wait_for(lambda: sum(done), n, 600)
    worker.stop(5)
    engine.dispose()
    return m.result(n)


BASE_TAKE = (
    "DELETE FROM delayed_queue WHERE id = ANY(ARRAY(SELECT id FROM delayed_queue"
    " WHERE queue = %s AND scheduled_at <= %s ORDER BY scheduled_at, id LIMIT %s"
    " FOR UPDATE SKIP LOCKED)) RETURNING id, key, payload"
)


def _drain(
    url: URL,
    backend: str,
    n: int,
    consumers: int,
    take: Callable[[Any], int],
    *,
    autocommit: bool,
) -> Measure:
    """Fill ``n`` due messages, then ``consumers`` psycopg threads call ``take(conn)`` until it
    returns 0 (it returns how many messages it took)."""
    import psycopg

    _fill(url, n)
    return _consumers(
        backend, n, consumers, take, lambda: psycopg.connect(_libpq(url), autocommit=autocommit)
    )


def _consumers(
    backend: str,
    n: int,
    consumers: int,
    take: Callable[[Any], int],
    connect: Callable[[], contextlib.AbstractContextManager[Any]],
) -> Measure:
    """``consumers`` threads, each in ``with connect() as conn``, call ``take(conn)`` until it
    returns 0; measured, and checked to have taken the ``n`` messages the queue held."""
    counts: list[int] = []
    lock = threading.Lock()

    def consume() -> None:
        with connect() as conn:
            while taken := take(conn):
                with lock:
                    counts.append(taken)

    with Meter(backend) as m:
        threads = [threading.Thread(target=consume) for _ in range(consumers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if sum(counts) != n:
        raise RuntimeError(f"drained {sum(counts)} of {n}")
    return m.result(n)


def _base_drain(url: URL, backend: str, n: int, consumers: int, batch: int) -> Measure:
    def take(conn: Any) -> int:
        return len(conn.execute(BASE_TAKE, (QUEUE, datetime.now(UTC), batch)).fetchall())

    return _drain(url, backend, n, consumers, take, autocommit=True)


def base_c1(url: URL, backend: str, n: int, consumers: int = 4) -> Measure:
    return _base_drain(url, backend, n, consumers, 1)


def base_c2(url: URL, backend: str, n: int, consumers: int = 4, batch: int = 100) -> Measure:
    return _base_drain(url, backend, n, consumers, batch)


# -- L1: latency from offer commit to handler start ---------------------------------------------


def _percentiles(latencies: list[float]) -> dict[str, float]:
    qs = statistics.quantiles(latencies, n=100, method="inclusive")
    return {"p50_ms": qs[49] * 1000, "p95_ms": qs[94] * 1000, "p99_ms": qs[98] * 1000}


def ours_l1(url: URL, backend: str, n: int, rate: float = 200.0) -> Measure:
    engine = create_engine(url, pool_size=4)
    producer_engine = create_engine(url)
    sessions = sessionmaker(engine)
    producer = sessionmaker(producer_engine)
    q = DelayedQueue(QUEUE)
    committed: dict[int, float] = {}
    started: dict[int, float] = {}

    def handle(env: Any, session: Any) -> None:
        started[env.payload["user_id"]] = time.perf_counter()

    # Transactional mode: the handler starts right after the take, before any commit.
    worker = Worker(sessions, concurrency=1, poll_interval=1.0)
    worker.register(q, handle, mode="transactional")
    worker.start()
    time.sleep(0.5)  # the listener connects
    with Meter(backend) as m:
        t0 = time.perf_counter()
        for i in range(n):
            delay = t0 + i / rate - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            with producer.begin() as s:
                q.offer(s, f"l1-{i}", payload(i))
            committed[i] = time.perf_counter()
        _wait_for(lambda: len(started), n, 60)
    worker.stop(5)
    engine.dispose()
    producer_engine.dispose()
    return m.result(n, **_percentiles([started[i] - committed[i] for i in range(n)]))


def base_l1(url: URL, backend: str, n: int, rate: float = 200.0) -> Measure:
    import psycopg
    from psycopg.types.json import Jsonb

    libpq = _libpq(url)
    committed: dict[int, float] = {}
    started: dict[int, float] = {}
    stop = threading.Event()

    def listen() -> None:
        with psycopg.connect(libpq, autocommit=True) as conn:
            conn.execute("LISTEN delayedq_bench")
            ready.set()
            while not stop.is_set():
                for _ in conn.notifies(timeout=0.2, stop_after=1):
                    break
                while True:
                    rows = conn.execute(BASE_TAKE, (QUEUE, datetime.now(UTC), 1)).fetchall()
                    if not rows:
                        break
                    started[rows[0][2]["user_id"]] = time.perf_counter()

    ready = threading.Event()
    listener = threading.Thread(target=listen)
    listener.start()
    ready.wait()
    insert = (
        "INSERT INTO delayed_queue (queue, key, payload_type, payload, status, scheduled_at,"
        " scheduled_at_initially, created_at, attempts) VALUES (%s, %s, 'json', %s, 'pending',"
        " %s, %s, %s, 0) ON CONFLICT (queue, key) DO NOTHING"
    )
    with psycopg.connect(libpq) as conn, Meter(backend) as m:
        t0 = time.perf_counter()
        for i in range(n):
            delay = t0 + i / rate - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            now = datetime.now(UTC)
            with conn.transaction():
                conn.execute(insert, (QUEUE, f"l1-{i}", Jsonb(payload(i)), now, now, now))
                conn.execute("NOTIFY delayedq_bench")
            committed[i] = time.perf_counter()
        _wait_for(lambda: len(started), n, 60)
    stop.set()
    listener.join()
    return m.result(n, **_percentiles([started[i] - committed[i] for i in range(n)]))


# -- the same-contract reference ---------------------------------------------------------------

INSERT_ONE = (
    "INSERT INTO delayed_queue (queue, key, payload_type, payload, status, scheduled_at,"
    " scheduled_at_initially, created_at, attempts) VALUES (%s, %s, 'json', %s, 'pending',"
    " %s, %s, %s, 0) ON CONFLICT (queue, key) DO NOTHING RETURNING id"
)


def contract_e1(url: URL, backend: str, n: int) -> Measure:
    """An offer inside a transaction of its own: ``BEGIN``, insert, ``COMMIT``."""
    import psycopg
    from psycopg.types.json import Jsonb

    with psycopg.connect(_libpq(url)) as conn:
        now = datetime.now(UTC)
        with conn.transaction():
            conn.execute(INSERT_ONE, (QUEUE, "warm-up", Jsonb(payload(-1)), now, now, now))
        with Meter(backend) as m:
            for i in range(n):
                now = datetime.now(UTC)
                with conn.transaction():
                    conn.execute(INSERT_ONE, (QUEUE, f"e1-{i}", Jsonb(payload(i)), now, now, now))
    return m.result(n)


INSERT_MANY = (
    "INSERT INTO delayed_queue (queue, key, payload_type, payload, status, scheduled_at,"
    " scheduled_at_initially, created_at, attempts)"
    " SELECT %s, r.k, 'json', r.p, 'pending', %s, %s, %s, 0"
    " FROM jsonb_to_recordset(%s::jsonb) AS r(k text, p jsonb) ORDER BY r.k"
    " ON CONFLICT (queue, key) DO NOTHING RETURNING key"
)


def contract_e2(url: URL, backend: str, n: int, batch: int = 1000) -> Measure:
    """An idempotent batch that says which keys it wrote: one insert-select per batch."""
    import json

    import psycopg

    with psycopg.connect(_libpq(url)) as conn, Meter(backend) as m:
        for start in range(0, n, batch):
            now = datetime.now(UTC)
            doc = json.dumps(
                [{"k": f"e2-{i}", "p": payload(i)} for i in range(start, start + batch)]
            )
            with conn.transaction():
                written = conn.execute(INSERT_MANY, (QUEUE, now, now, now, doc)).fetchall()
            if len(written) != batch:
                raise RuntimeError(f"wrote {len(written)} of {batch}")
    return m.result(n)


def contract_c1(url: URL, backend: str, n: int, consumers: int = 4) -> Measure:
    """Transactional mode: take, savepoint around the handler, commit, per message."""

    def take(conn: Any) -> int:
        with conn.transaction():
            rows = conn.execute(BASE_TAKE, (QUEUE, datetime.now(UTC), 1)).fetchall()
            if rows:
                with conn.transaction():  # SAVEPOINT ... RELEASE around the handler
                    pass
        return len(rows)

    return _drain(url, backend, n, consumers, take, autocommit=False)


LEASE_TAKE = (
    "UPDATE delayed_queue SET scheduled_at = %s, lock_token = %s || id::text"
    " WHERE id = ANY(ARRAY(SELECT id FROM delayed_queue WHERE queue = %s AND scheduled_at <= %s"
    " ORDER BY scheduled_at, id LIMIT %s FOR UPDATE SKIP LOCKED)) RETURNING id, lock_token, payload"
)
LEASE_ACK = "DELETE FROM delayed_queue WHERE id = ANY(%s) AND lock_token = ANY(%s)"


def contract_c2(url: URL, backend: str, n: int, consumers: int = 4, batch: int = 100) -> Measure:
    """Lease mode in batches: take and commit, handle, acknowledge by lock token and commit."""
    import secrets

    def take(conn: Any) -> int:
        now = datetime.now(UTC)
        lease = (now + timedelta(minutes=5), secrets.token_hex(12) + ".", QUEUE, now, batch)
        with conn.transaction():
            rows = conn.execute(LEASE_TAKE, lease).fetchall()
        if rows:
            with conn.transaction():
                conn.execute(LEASE_ACK, ([r[0] for r in rows], [r[1] for r in rows]))
        return len(rows)

    return _drain(url, backend, n, consumers, take, autocommit=False)


# -- the SQLAlchemy floor -----------------------------------------------------------------------
#
# The same-contract reference's SQL sent through SQLAlchemy, with no code of ours: what any
# library that offers on the caller's Session (or on a pooled Core connection), or consumes
# through Sessions, pays before it does anything of its own. Reference -> floor is SQLAlchemy's
# cost; floor -> ours is ours (for the drains: the worker runtime's).


#: INSERT_ONE and INSERT_MANY with named parameters, for ``text()``.
FLOOR_INSERT_ONE = sa.text(
    "INSERT INTO delayed_queue (queue, key, payload_type, payload, status, scheduled_at,"
    " scheduled_at_initially, created_at, attempts) VALUES (:queue, :key, 'json', :payload,"
    " 'pending', :now, :now, :now, 0) ON CONFLICT (queue, key) DO NOTHING RETURNING id"
).bindparams(sa.bindparam("payload", type_=JSONB))
FLOOR_INSERT_MANY = sa.text(
    "INSERT INTO delayed_queue (queue, key, payload_type, payload, status, scheduled_at,"
    " scheduled_at_initially, created_at, attempts)"
    " SELECT :queue, r.k, 'json', r.p, 'pending', :now, :now, :now, 0"
    " FROM jsonb_to_recordset(CAST(:doc AS jsonb)) AS r(k text, p jsonb) ORDER BY r.k"
    " ON CONFLICT (queue, key) DO NOTHING RETURNING key"
)


def _floor_params(key: str, value: dict[str, Any]) -> dict[str, Any]:
    return {"queue": QUEUE, "key": key, "payload": value, "now": datetime.now(UTC)}


def floor_e1(url: URL, backend: str, n: int) -> Measure:
    """The reference's ``INSERT ... RETURNING id`` in a Session transaction of its own
    (``with sessions.begin() as s: s.execute(...)``), on a plain ``sqlalchemy.create_engine``."""
    engine = sa.create_engine(url)
    sessions = sessionmaker(engine)
    with sessions.begin() as s:
        s.execute(FLOOR_INSERT_ONE, _floor_params("warm-up", payload(-1))).all()
    with Meter(backend) as m:
        for i in range(n):
            with sessions.begin() as s:
                s.execute(FLOOR_INSERT_ONE, _floor_params(f"e1-{i}", payload(i))).all()
    engine.dispose()
    return m.result(n)


def floor_e1_connection(url: URL, backend: str, n: int) -> Measure:
    """The same insert as one autocommit statement on a pooled Core connection per offer: the
    floor of the Engine form (``q.offer(engine, ...)``)."""
    engine = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    with engine.connect() as c:
        c.execute(FLOOR_INSERT_ONE, _floor_params("warm-up", payload(-1))).all()
    with Meter(backend) as m:
        for i in range(n):
            with engine.connect() as c:
                c.execute(FLOOR_INSERT_ONE, _floor_params(f"e1-{i}", payload(i))).all()
    engine.dispose()
    return m.result(n)


def floor_e2(url: URL, backend: str, n: int, batch: int = 1000) -> Measure:
    """The reference's insert-select per batch, in a Session transaction each."""
    import json

    engine = sa.create_engine(url)
    sessions = sessionmaker(engine)
    with Meter(backend) as m:
        for start in range(0, n, batch):
            now = datetime.now(UTC)
            doc = json.dumps(
                [{"k": f"e2-{i}", "p": payload(i)} for i in range(start, start + batch)]
            )
            with sessions.begin() as s:
                params = {"queue": QUEUE, "now": now, "doc": doc}
                written = s.execute(FLOOR_INSERT_MANY, params).all()
            if len(written) != batch:
                raise RuntimeError(f"wrote {len(written)} of {batch}")
    engine.dispose()
    return m.result(n)


FLOOR_TAKE = sa.text(
    "DELETE FROM delayed_queue WHERE id = ANY(ARRAY(SELECT id FROM delayed_queue"
    " WHERE queue = :queue AND scheduled_at <= :now ORDER BY scheduled_at, id LIMIT :limit"
    " FOR UPDATE SKIP LOCKED)) RETURNING id, key, payload"
)
FLOOR_LEASE_TAKE = sa.text(
    "UPDATE delayed_queue SET scheduled_at = :until, lock_token = :prefix || CAST(id AS text)"
    " WHERE id = ANY(ARRAY(SELECT id FROM delayed_queue WHERE queue = :queue"
    " AND scheduled_at <= :now ORDER BY scheduled_at, id LIMIT :limit FOR UPDATE SKIP LOCKED))"
    " RETURNING id, lock_token, payload"
)
FLOOR_LEASE_ACK = sa.text(
    "DELETE FROM delayed_queue WHERE id = ANY(:ids) AND lock_token = ANY(:tokens)"
)


def _floor_drain(
    url: URL, backend: str, n: int, consumers: int, take: Callable[[Any], int]
) -> Measure:
    """:func:`_drain` through SQLAlchemy: ``consumers`` threads call ``take(sessions)`` (a
    ``sessionmaker`` on a plain ``sqlalchemy.create_engine``) until it returns 0."""
    _fill(url, n)
    engine = sa.create_engine(url, pool_size=consumers + 2)
    sessions = sessionmaker(engine)
    try:
        return _consumers(backend, n, consumers, take, lambda: contextlib.nullcontext(sessions))
    finally:
        engine.dispose()


def floor_c1(url: URL, backend: str, n: int, consumers: int = 4) -> Measure:
    """The reference's transactional take per message in a Session transaction, the handler's
    savepoint a ``begin_nested()``."""

    def take(sessions: Any) -> int:
        with sessions.begin() as s:
            params = {"queue": QUEUE, "now": datetime.now(UTC), "limit": 1}
            rows = s.execute(FLOOR_TAKE, params).all()
            if rows:
                with s.begin_nested():
                    pass
        return len(rows)

    return _floor_drain(url, backend, n, consumers, take)


def floor_c2(url: URL, backend: str, n: int, consumers: int = 4, batch: int = 100) -> Measure:
    """The reference's lease-mode batch: take and commit, then acknowledge by lock token and
    commit, a Session transaction each."""
    import secrets

    def take(sessions: Any) -> int:
        now = datetime.now(UTC)
        lease = {
            "until": now + timedelta(minutes=5),
            "prefix": secrets.token_hex(12) + ".",
            "queue": QUEUE,
            "now": now,
            "limit": batch,
        }
        with sessions.begin() as s:
            rows = s.execute(FLOOR_LEASE_TAKE, lease).all()
        if rows:
            with sessions.begin() as s:
                ack = {"ids": [r[0] for r in rows], "tokens": [r[1] for r in rows]}
                s.execute(FLOOR_LEASE_ACK, ack)
        return len(rows)

    return _floor_drain(url, backend, n, consumers, take)


#: Our other mode, measured beside ``OURS`` where it applies (``ours_lease`` in results.json).
OURS_LEASE = {"C1": ours_c1_lease}
#: The Engine form of an offer, beside the Session form (``ours_engine`` in results.json).
OURS_ENGINE = {"E1": ours_e1_engine}
#: The drains by two worker processes (``delayedq worker --processes 2``).
OURS_PROCESSES = {"C1": ours_c1_processes, "C2": ours_c2_processes}
OURS_LEASE_PROCESSES = {"C1": ours_c1_lease_processes}
#: Every form of ours measured beside ``OURS``, by its key in results.json.
OURS_VARIANTS: dict[str, dict[str, Callable[..., Measure]]] = {
    "ours_lease": OURS_LEASE,
    "ours_engine": OURS_ENGINE,
    "ours_2proc": OURS_PROCESSES,
    "ours_lease_2proc": OURS_LEASE_PROCESSES,
}
#: The reference's SQL through SQLAlchemy (``floor``), and the Engine form's (``floor_engine``).
FLOOR = {"E1": floor_e1, "E2": floor_e2, "C1": floor_c1, "C2": floor_c2}
FLOOR_ENGINE = {"E1": floor_e1_connection}
CONTRACT = {"E1": contract_e1, "E2": contract_e2, "C1": contract_c1, "C2": contract_c2}
OURS = {"E0": ours_e0, "E1": ours_e1, "E2": ours_e2, "C1": ours_c1, "C2": ours_c2, "L1": ours_l1}
BASE = {"E0": hand_e0, "E1": base_e1, "E2": base_e2, "C1": base_c1, "C2": base_c2, "L1": base_l1}
SIZES = {
    "E0": 3_000,
    "L1X": 2_000,
    "E1": 5_000,
    "E2": 100_000,
    "C1": 20_000,
    "C2": 100_000,
    "L1": 2_000,
}
