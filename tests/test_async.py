"""The queue through ``AsyncSession`` on PostgreSQL (psycopg async), and the async worker."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from datetime import timedelta
from typing import Any, cast

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

from sqla_delayedq import DelayedMessage, DelayedQueue, Delivery, Outcome
from sqla_delayedq.aio import AsyncQueue, AsyncWorker

T = cast(sa.Table, DelayedMessage.__table__)


@pytest.fixture
def async_sessions(pg):
    engine = create_async_engine(pg.url.set(drivername="postgresql+psycopg"))
    yield async_sessionmaker(engine, expire_on_commit=False)
    asyncio.run(engine.dispose())


def test_offer_poll_ack_through_async_session(async_sessions, clock):
    aq = AsyncQueue(DelayedQueue("aq", clock=clock, lease=timedelta(seconds=10)))

    async def scenario() -> None:
        async with async_sessions() as s, s.begin():
            assert (await aq.offer(s, "k", {"v": 1})).outcome is Outcome.CREATED
            assert (await aq.offer(s, "k", {"v": 1})).outcome is Outcome.IGNORED
            results = await aq.offer_batch(s, [("a", 1), ("b", 2)])
            assert [r.outcome for r in results] == [Outcome.CREATED] * 2
        with pytest.raises(RuntimeError):
            async with async_sessions() as s, s.begin():
                await aq.offer(s, "rolled-back", 1)
                raise RuntimeError("caller failed")
        async with async_sessions() as s, s.begin():
            assert not await aq.contains(s, "rolled-back")
            env = await aq.try_poll(s)
            assert env.key == "k" and env.delivery is Delivery.FIRST
        clock.advance(11)
        async with async_sessions() as s, s.begin():
            envs = await aq.try_poll_many(s, 10)
            assert {e.key for e in envs} == {"k", "a", "b"}
            again = next(e for e in envs if e.key == "k")
            assert again.delivery is Delivery.REDELIVERY
            assert env is not None
            assert not await aq.ack(s, env)  # the expired take's late ack loses
            assert await aq.ack_many(s, envs) == 3
        async with async_sessions() as s:
            assert (await aq.counts(s)).pending == 0

    asyncio.run(scenario())


#: What ``DelayedQueue`` has and ``AsyncQueue`` deliberately does not: synchronous helpers with
#: no I/O (reach them as ``aq.queue.<name>``), and the worker's own forms of public methods.
NOT_WRAPPED = {
    "condition": "builds an SQL condition, no I/O",
    "now": "reads the queue's clock, no I/O",
    "gate": "the worker's in-memory view of the controls",
    "poll_batch": "the worker's form of try_poll_many",
    "process_next": "the worker's form of process_one",
    "ack_and_poll": "the worker's acknowledgement that takes the next, on an autocommit session",
    "release_fused": "the worker's recovery after ack_and_poll failed",
    "poll_alone": "the worker's take on an autocommit session",
    "ack_alone": "the worker's acknowledgement on an autocommit session",
}


def test_async_queue_wraps_every_public_method_of_the_queue():
    import inspect

    public = {
        n for n, v in inspect.getmembers(DelayedQueue) if not n.startswith("_") and callable(v)
    }
    wrapped = {n for n, _ in inspect.getmembers(AsyncQueue) if not n.startswith("_")}
    assert sorted(public - wrapped - NOT_WRAPPED.keys()) == []
    assert NOT_WRAPPED.keys() <= public  # no stale exception
    for name in public & wrapped:
        assert inspect.iscoroutinefunction(getattr(AsyncQueue, name)), name


def test_async_count_up_to_counts_and_bounds(async_sessions):
    aq = AsyncQueue(DelayedQueue("aq-up-to"))

    async def scenario() -> None:
        async with async_sessions() as s, s.begin():
            assert await aq.count_up_to(s) == (0, 0)
            await aq.offer_batch(s, [("a", 1), ("b", 2)])
        async with async_sessions() as s:
            count, highest = await aq.count_up_to(s)
            ids = await s.execute(sa.select(sa.func.max(T.c.id)).where(T.c.queue == "aq-up-to"))
            assert (count, highest) == (2, ids.scalar_one())

    asyncio.run(scenario())


@pytest.mark.parametrize("mode", ["lease", "transactional"])
def test_async_worker_with_16_tasks_handles_each_message_once(async_sessions, pg, mode):
    q = DelayedQueue("aw")
    total = 5000
    with pg.Session() as s, s.begin():
        q.offer_batch(s, [(f"m{i:05d}", {"i": i}) for i in range(total)])
    seen: list[int] = []

    async def handler(env, session=None) -> None:
        seen.append(env.payload["i"])
        await asyncio.sleep(0)

    async def scenario() -> None:
        worker = AsyncWorker(async_sessions, concurrency=16, poll_interval=0.2)
        worker.register(q, handler, mode=mode)
        runner = asyncio.create_task(worker.run(install_signal_handlers=False))
        for _ in range(3600):  # up to 3 minutes on a loaded machine
            if len(seen) >= total:
                break
            await asyncio.sleep(0.05)
        async with async_sessions() as s:
            for _ in range(100):
                left = (await s.execute(sa.select(sa.func.count()).select_from(T))).scalar_one()
                if left == 0:
                    break
                await asyncio.sleep(0.05)
        worker.request_stop()
        assert await runner is True

    asyncio.run(scenario())
    assert sorted(seen) == list(range(total))
    with pg.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(T)).scalar_one() == 0


def test_async_worker_frees_each_transactional_session_after_its_message(async_sessions, pg):
    """The runtime mapped each core Session to its AsyncSession in a WeakKeyDictionary whose
    value held the key (``sync_session``): every message's pair stayed alive for as long as the
    worker, 1,000 more per 1,000 messages."""
    import gc
    import weakref

    q = DelayedQueue("aw-free")
    total = 30
    with pg.Session() as s, s.begin():
        q.offer_batch(s, [(f"m{i:02d}", i) for i in range(total)])
    seen: list[int] = []
    handled: list[weakref.ref[object]] = []

    async def handler(env, session) -> None:
        seen.append(env.payload)
        handled.append(weakref.ref(session))

    async def scenario() -> None:
        worker = AsyncWorker(async_sessions, concurrency=2, poll_interval=0.2)
        worker.register(q, handler, mode="transactional")
        runner = asyncio.create_task(worker.run(install_signal_handlers=False))
        for _ in range(1200):
            if len(seen) >= total:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)
        gc.collect()
        alive_while_running = sum(r() is not None for r in handled)
        worker.request_stop()
        assert await runner is True
        gc.collect()
        assert alive_while_running <= 2  # at most the sessions of the messages in hand
        assert [r for r in handled if r() is not None] == []

    asyncio.run(scenario())
    assert sorted(seen) == list(range(total))


def test_async_worker_cancelled_by_an_anyio_scope_stops_its_listener(async_sessions):
    """anyio cancels again at every await until the task ends: ``run()``'s last awaits were
    cut short, and the ``LISTEN`` thread, its connection and the in-process wake-up
    subscription outlived it (one more at each restart of a lifespan-hosted worker)."""
    import threading

    import anyio

    from sqla_delayedq import _wakeup

    handled: list[int] = []

    async def handler(env) -> None:
        handled.append(env.payload)

    async def scenario() -> None:
        worker = AsyncWorker(async_sessions, poll_interval=0.2)
        worker.register(DelayedQueue("aw-scope"), handler)
        with anyio.move_on_after(1):
            await worker.run(install_signal_handlers=False)
        assert worker._listening

    asyncio.run(scenario())
    listening = [t.name for t in threading.enumerate() if t.name.startswith("delayedq-listen")]
    assert listening == []
    assert sum(len(w) for w in _wakeup._waiters.values()) == 0


def test_async_handler_blocking_the_loop_past_its_lease_is_warned_about(async_sessions, pg, caplog):
    """The heartbeat runs on the event loop: a handler that blocks it (``time.sleep``, a sync
    SDK call) longer than its lease keeps it from extending the lease, and another consumer
    may run the message a second time. Nothing said so; the late heartbeat now warns, naming
    the queue and the remedy."""
    import logging
    import time

    q = DelayedQueue("aw-blocks", lease=timedelta(seconds=1))
    with pg.Session() as s, s.begin():
        q.offer(s, "k", 1)
    runs: list[int] = []

    async def handler(env) -> None:
        runs.append(env.payload)
        time.sleep(2)

    async def scenario() -> None:
        worker = AsyncWorker(async_sessions, concurrency=1, poll_interval=0.2)
        worker.register(q, handler)
        runner = asyncio.create_task(worker.run(install_signal_handlers=False))
        for _ in range(600):
            if runs:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # the heartbeat's look after the handler let the loop go
        worker.request_stop()
        await runner

    with caplog.at_level(logging.WARNING, logger="sqla_delayedq.worker"):
        asyncio.run(scenario())
    late = [r.getMessage() for r in caplog.records if "heartbeat ran" in r.getMessage()]
    assert late, "no warning"
    assert "aw-blocks" in late[0] and "second time" in late[0]
    assert "asyncio.to_thread" in late[0]


TWO_ON_ONE_LOOP = """
import asyncio, os, signal, sys
from sqlalchemy.ext.asyncio import async_sessionmaker
from sqla_delayedq import DelayedQueue
from sqla_delayedq.aio import AsyncWorker, create_async_engine
from sqla_delayedq.models import metadata
import sqlalchemy as sa

url = sys.argv[1]
engine = sa.create_engine(url.replace("+aiosqlite", ""))
metadata.create_all(engine)
engine.dispose()
stopped_by_the_process = []
signal.signal(signal.SIGTERM, lambda *_: stopped_by_the_process.append("TERM"))

async def handle(env):
    pass

async def main():
    engine = create_async_engine(url)
    sessions = async_sessionmaker(engine)
    first = AsyncWorker(sessions, name="first", poll_interval=0.1, listen=False)
    second = AsyncWorker(sessions, name="second", poll_interval=0.1, listen=False)
    first.register(DelayedQueue("a"), handle)
    second.register(DelayedQueue("b"), handle)
    runs = [asyncio.create_task(w.run()) for w in (first, second)]
    await asyncio.sleep(0.5)
    os.kill(os.getpid(), signal.SIGTERM)
    done, _ = await asyncio.wait(runs, timeout=20)
    print("stopped:", len(done))
    for w in (first, second):
        w.request_stop()
    await asyncio.gather(*runs)
    await engine.dispose()
    os.kill(os.getpid(), signal.SIGTERM)  # back to the process's own handler
    print("after:", stopped_by_the_process)

asyncio.run(main())
"""


def test_sigterm_stops_every_async_worker_of_the_event_loop(tmp_path):
    """Each AsyncWorker installed its own handler on the loop, replacing the one before: a
    SIGTERM stopped only the last started, and once that one stopped, the handler it restored
    was asyncio's (SIGTERM ignored) while the first still ran. One handler per loop now stops
    every worker running on it, and the process's own comes back after the last."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'two.db'}"
    proc = subprocess.run(
        [sys.executable, "-c", TWO_ON_ONE_LOOP, url], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["stopped: 2", "after: ['TERM']"]


def test_async_worker_has_the_thread_worker_s_default_concurrency(async_sessions):
    """The docs give both workers one configuration; the asyncio worker ran 16 tasks, and
    16 transactional handlers outran an async engine's default pool (5 + 10)."""
    from sqla_delayedq.worker import Worker

    worker = AsyncWorker(async_sessions)
    assert worker.concurrency == Worker.default_concurrency == 4


def test_run_off_the_main_thread_is_refused_clearly_and_the_worker_can_run_after(tmp_path):
    """``run()`` installs signal handlers, which only the main thread may: off it, asyncio's
    ``RuntimeError: set_wakeup_fd only works in main thread`` came after the worker was marked
    running, and the retry with ``install_signal_handlers=False`` was refused ("already
    running"). The first call is now refused before anything starts, saying what to do."""
    import threading

    from sqla_delayedq import create_engine
    from sqla_delayedq.aio import create_async_engine as our_async_engine
    from sqla_delayedq.errors import InvalidArgument
    from sqla_delayedq.models import metadata

    path = tmp_path / "off-main.db"
    sync = create_engine(f"sqlite:///{path}")
    metadata.create_all(sync)
    sync.dispose()
    outcomes: list[object] = []

    async def handle(env) -> None:
        pass

    async def main() -> None:
        engine = our_async_engine(f"sqlite+aiosqlite:///{path}")
        worker = AsyncWorker(async_sessionmaker(engine), poll_interval=0.1, listen=False)
        worker.register(DelayedQueue("off-main"), handle)
        try:
            await worker.run()
        except Exception as exc:
            outcomes.append(exc)
        asyncio.get_running_loop().call_later(0.3, worker.request_stop)
        outcomes.append(await worker.run(install_signal_handlers=False))
        await engine.dispose()

    thread = threading.Thread(target=lambda: asyncio.run(main()))
    thread.start()
    thread.join(60)
    assert len(outcomes) == 2, outcomes
    assert isinstance(outcomes[0], InvalidArgument)
    assert "install_signal_handlers=False" in str(outcomes[0])
    assert outcomes[1] is True


def test_each_worker_refuses_the_other_kind_of_sessionmaker(async_sessions, pg):
    """``AsyncWorker(sessionmaker(...))`` died later with an AttributeError, and
    ``Worker(async_sessionmaker(...))`` started, then died with a TypeError."""
    from sqla_delayedq.errors import InvalidArgument
    from sqla_delayedq.worker import Worker

    with pytest.raises(InvalidArgument, match=r"use sqla_delayedq\.worker\.Worker"):
        AsyncWorker(pg.Session)
    with pytest.raises(InvalidArgument, match=r"use sqla_delayedq\.aio\.AsyncWorker"):
        Worker(async_sessions)


def test_bytes_payloads_go_through_every_asyncio_driver(async_backend):
    """aiomysql (0.3.2) with PyMySQL 1.2.3 and later failed every bytes offer (``'str' object
    is not callable``): the ``asyncio`` extra keeps PyMySQL below 1.2.1 (found in review)."""
    from sqla_delayedq.serializers import BytesSerializer

    q = AsyncQueue(DelayedQueue[bytes]("bytes", serializer=BytesSerializer()))
    blob = bytes(range(256)) * 3

    async def main() -> tuple[Any, Any]:
        async with async_backend.sessions() as s, s.begin():
            offered = await q.offer(s, "blob", blob)
        async with async_backend.sessions() as s, s.begin():
            envelope = await q.try_poll(s)
            assert envelope is not None
            await q.ack(s, envelope)
        return offered.outcome, envelope.payload

    assert asyncio.run(main()) == (Outcome.CREATED, blob)
