"""The Engine form of an offer: ``q.offer(engine, ...)`` commits on its own, for a producer with
no transaction of its own to join (on PostgreSQL a new message is one autocommit statement)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from sqla_delayedq import DelayedMessage, DelayedQueue, InvalidArgument, Outcome
from sqla_delayedq._dialects import PostgreSQLStrategy
from sqla_delayedq.aio import AsyncQueue, create_async_engine
from sqla_delayedq.worker import Worker
from tests.fix_db import ASYNC_DRIVERS
from tests.fix_queue import record_sql
from tests.fix_workers import running

T = cast(sa.Table, DelayedMessage.__table__)


def stored(backend: Any, key: str) -> Any:
    """The row of ``key`` as another connection sees it (None: not committed)."""
    with backend.engine.connect() as conn:
        return conn.execute(sa.select(T.c.payload, T.c.scheduled_at).where(T.c.key == key)).first()


def test_an_offer_on_an_engine_commits_on_its_own_with_every_outcome(backend, make_queue, clock):
    q = make_queue()
    engine = backend.engine
    commits: list[int] = []

    def on_commit(conn: Any) -> None:
        commits.append(1)

    sa.event.listen(engine, "commit", on_commit)
    try:
        assert q.offer(engine, "k1", {"n": 1}).outcome is Outcome.CREATED
    finally:
        sa.event.remove(engine, "commit", on_commit)
    assert stored(backend, "k1").payload == {"n": 1}
    assert len(commits) == 1  # autocommit on PostgreSQL, a transaction elsewhere: one commit
    assert q.offer(engine, "k1", {"n": 1}).outcome is Outcome.IGNORED
    assert q.offer(engine, "k1", {"n": 2}).outcome is Outcome.UPDATED
    assert stored(backend, "k1").payload == {"n": 2}
    assert q.offer(engine, "k1", {"n": 3}, mode="skip").outcome is Outcome.IGNORED
    later = clock() + timedelta(minutes=5)
    assert q.offer(engine, "k1", {"n": 4}, later, mode="keep_schedule").outcome is Outcome.UPDATED
    row = stored(backend, "k1")
    assert row.payload == {"n": 4} and row.scheduled_at.replace(tzinfo=UTC) < later
    assert q.offer(engine, "k2", {"n": 5}, later).outcome is Outcome.CREATED
    assert stored(backend, "k2").scheduled_at.replace(tzinfo=UTC) == later
    generated = q.offer(engine, None, {"n": 6})
    assert generated.outcome is Outcome.CREATED and stored(backend, generated.key) is not None
    with backend.Session() as s:
        assert q.counts(s).pending == 3


def test_bad_input_on_an_engine_is_refused_before_any_sql(backend, make_queue):
    q = make_queue()
    with record_sql(backend.engine) as sql:
        with pytest.raises(ValueError, match="timezone"):
            q.offer(backend.engine, "k", {}, datetime(2030, 1, 1))
        with pytest.raises(InvalidArgument, match="no groups"):
            q.offer(backend.engine, "k", {}, group="g")
        with pytest.raises(InvalidArgument, match="key"):
            q.offer(backend.engine, "", {})
    assert sql == []
    assert stored(backend, "k") is None


def test_on_postgresql_a_new_message_is_one_autocommit_statement(pg, make_queue):
    """One round trip: the insert carries its ``NOTIFY`` and commits itself. An existing key
    goes on in a transaction; the pooled connection comes back out of autocommit."""
    assert PostgreSQLStrategy.autocommit_offer
    q = make_queue()
    seen: list[tuple[str, bool]] = []

    def before(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        seen.append((statement, conn.connection.dbapi_connection.autocommit))

    sa.event.listen(pg.engine, "before_cursor_execute", before)
    try:
        assert q.offer(pg.engine, "k", {"n": 1}).outcome is Outcome.CREATED
        new = list(seen)
        seen.clear()
        assert q.offer(pg.engine, "k", {"n": 2}).outcome is Outcome.UPDATED
        existing = list(seen)
        seen.clear()
        with pg.Session() as s, s.begin():
            s.execute(sa.text("SELECT 1"))
            assert s.connection().connection.dbapi_connection.autocommit is False
    finally:
        sa.event.remove(pg.engine, "before_cursor_execute", before)
    assert len(new) == 1, new
    statement, autocommit = new[0]
    assert autocommit and "INSERT INTO" in statement and "pg_notify" in statement
    # The first try of the existing key ran alone; the rest is one transaction.
    assert existing[0][1] is True and all(not auto for _, auto in existing[1:])
    assert any(s.startswith("UPDATE") for s, _ in existing)


def test_an_engine_offer_is_announced_to_listeners_in_other_processes(pg, make_queue):
    q = make_queue("announced")
    listener = psycopg.connect(
        pg.url.set(drivername="postgresql").render_as_string(hide_password=False),
        autocommit=True,
    )
    try:
        listener.execute(f'LISTEN "{PostgreSQLStrategy.channel(T.name)}"')
        q.offer(pg.engine, "k", {})
        got = [n.payload for n in listener.notifies(timeout=5, stop_after=1)]
    finally:
        listener.close()
    assert got == ["announced"]


def test_an_engine_offer_wakes_an_idle_worker_of_this_process(backend):
    q: DelayedQueue[Any] = DelayedQueue("woken")
    handled: list[float] = []
    worker = Worker(backend.Session, concurrency=1, poll_interval=30, listen=False)
    worker.register(q, lambda env: handled.append(time.monotonic()))
    with running(worker):
        time.sleep(0.3)  # the consumer's first take finds nothing; it waits up to 30 s
        offered = time.monotonic()
        q.offer(backend.engine, "k", {})
        deadline = time.monotonic() + 10
        while not handled and time.monotonic() < deadline:
            time.sleep(0.01)
    assert len(handled) == 1 and handled[0] - offered < 5  # woken, not the 30 s poll


#: A producer process offering with the Engine form, as a web request with no transaction.
PRODUCER = """
import sys
from sqla_delayedq import DelayedQueue, create_engine
engine, q = create_engine(sys.argv[1]), DelayedQueue(sys.argv[2])
for i in range(int(sys.argv[3])):
    assert q.offer(engine, f"m{i}", {"i": i}).outcome.value == "created"
print("ok", flush=True)
"""


def test_a_producer_process_offers_on_its_engine_and_a_worker_handles_each_once(server_backend):
    total = 40
    q: DelayedQueue[Any] = DelayedQueue("from-web")
    handled: list[str] = []
    lock = threading.Lock()

    def handle(env: Any) -> None:
        with lock:
            handled.append(env.key)

    listen = server_backend.name == "postgresql"
    worker = Worker(server_backend.Session, concurrency=4, poll_interval=30 if listen else 0.2)
    worker.register(q, handle)
    url = server_backend.url.render_as_string(hide_password=False)
    with running(worker):
        out = subprocess.run(
            [sys.executable, "-c", PRODUCER, url, "from-web", str(total)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        deadline = time.monotonic() + 30
        while len(handled) < total and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)
    assert {k: n for k, n in Counter(handled).items() if n > 1} == {}
    assert sorted(handled) == sorted(f"m{i}" for i in range(total))


@pytest.mark.parametrize("payloads", ["same", "different"])
def test_ten_threads_offer_one_new_key_on_an_engine_exactly_one_created(server_backend, payloads):
    q = DelayedQueue(f"race-engine-{payloads}")
    barrier = threading.Barrier(10)

    def offer(i: int) -> Outcome:
        barrier.wait()
        payload = {"same": True} if payloads == "same" else {"writer": i}
        return q.offer(server_backend.engine, "the-key", payload).outcome

    with ThreadPoolExecutor(10) as pool:
        outcomes = list(pool.map(offer, range(10)))
    assert outcomes.count(Outcome.CREATED) == 1
    rest = Outcome.IGNORED if payloads == "same" else Outcome.UPDATED
    assert outcomes.count(rest) == 9
    with server_backend.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(T)).scalar_one() == 1


def test_the_asyncio_queue_offers_on_an_async_engine(backend):
    url = backend.url.set(drivername=ASYNC_DRIVERS[backend.name])
    q = AsyncQueue(DelayedQueue[Any]("async-engine"))

    async def main() -> list[Outcome]:
        engine = create_async_engine(url)
        try:
            return [
                (await q.offer(engine, "k", {"n": 1})).outcome,
                (await q.offer(engine, "k", {"n": 1})).outcome,
                (await q.offer(engine, "k", {"n": 2})).outcome,
            ]
        finally:
            await engine.dispose()

    assert asyncio.run(main()) == [Outcome.CREATED, Outcome.IGNORED, Outcome.UPDATED]
    assert stored(backend, "k").payload == {"n": 2}
    with Session(backend.engine) as s:
        assert q.queue.counts(s).pending == 1


def test_a_bind_the_call_does_not_take_is_refused_naming_the_one_it_does(backend, make_queue):
    """A Connection, an Engine given to ``offer_batch``, an asyncio object given to the sync
    queue, an AsyncEngine given to ``offer_batch``: each failed with an ``AttributeError`` from
    deep inside (found in review). Nothing is written."""
    q = make_queue()
    url = backend.url.set(drivername=ASYNC_DRIVERS[backend.name])
    joins = r"Session\(bind=connection\) joins"
    with backend.engine.connect() as conn, pytest.raises(InvalidArgument, match=joins):
        q.offer(conn, "k", {})
    with pytest.raises(InvalidArgument, match="got Engine; only offer takes an Engine"):
        q.offer_batch(backend.engine, [("k", {})])
    with pytest.raises(InvalidArgument, match="got Engine"):
        q.try_poll(cast(Any, backend.engine))

    async def main() -> None:
        engine = create_async_engine(url)
        try:
            with pytest.raises(InvalidArgument, match="AsyncEngine is an asyncio object"):
                q.offer(cast(Any, engine), "k", {})
            async with AsyncSession(engine) as s:
                with pytest.raises(InvalidArgument, match="AsyncSession is an asyncio object"):
                    q.offer(cast(Any, s), "k", {})
            with pytest.raises(InvalidArgument, match="offer_batch takes an AsyncSession"):
                await AsyncQueue(q).offer_batch(cast(Any, engine), [("k", {})])
        finally:
            await engine.dispose()

    asyncio.run(main())
    assert stored(backend, "k") is None


def test_engine_offers_racing_a_worker_on_the_same_keys_never_fail(server_backend):
    """On MariaDB an offer's upsert and a transactional take of the same key lock the key
    and the row in opposite orders: about one Engine-form offer in six failed with a deadlock
    (``TransientError``) though the offer owns its whole transaction (found in review). The
    Engine form makes it again; every version offered last is handled."""
    q: DelayedQueue[Any] = DelayedQueue("racing")
    handled: dict[str, int] = {}
    errors: list[BaseException] = []
    worker = Worker(server_backend.Session, concurrency=3, poll_interval=0.01, listen=False)
    worker.register(
        q, lambda env, s: handled.__setitem__(env.key, env.payload["v"]), mode="transactional"
    )

    def produce(me: int) -> None:
        for v in range(120):
            for k in range(5):
                try:
                    q.offer(server_backend.engine, f"k{k}", {"v": v, "me": me})
                except Exception as exc:
                    errors.append(exc)

    with running(worker):
        producers = [threading.Thread(target=produce, args=(i,)) for i in range(3)]
        for t in producers:
            t.start()
        for t in producers:
            t.join()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with Session(server_backend.engine) as s:
                if q.counts(s).pending == 0:
                    break
            time.sleep(0.05)
    assert errors == []
    assert handled and all(v == 119 for v in handled.values()), handled
