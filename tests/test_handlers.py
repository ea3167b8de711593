"""Nothing is ever acknowledged without its handler having run, and every failure says so.

Each consumer (the thread worker in both modes and for batches, the asyncio worker, the entity
queue's ``process_due``) refuses a handler it cannot run at registration; a handler that slips
through anyway (a lambda returning a coroutine) fails its attempt instead of being acknowledged.
Failed attempts are logged with queue, key, attempt and traceback; errors a worker must not
retry stop it loudly instead of spinning.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import async_sessionmaker
from sqlalchemy.orm import Session, sessionmaker

from sqla_delayedq import (
    DelayedQueue,
    Envelope,
    ExponentialBackoff,
    InvalidArgument,
    MessageFilter,
    WorkerError,
    create_engine,
)
from sqla_delayedq.aio import AsyncQueue, AsyncWorker
from sqla_delayedq.worker import Worker, WorkerHooks

NO_RETRY_DELAY = ExponentialBackoff(max_attempts=2, initial=timedelta(0), jitter=0)


def wait_for(predicate: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


async def async_handler(env: Envelope[Any]) -> None:
    raise AssertionError("never awaited by a synchronous consumer")


class AsyncCallable:
    async def __call__(self, env: Envelope[Any]) -> None:
        raise AssertionError("never awaited")


def sync_handler(env: Envelope[Any]) -> None:
    pass


# -- refused at registration --------------------------------------------------------------------


@pytest.mark.parametrize(
    "handler",
    [async_handler, functools.partial(async_handler), AsyncCallable()],
    ids=["async-def", "partial", "async-callable"],
)
def test_the_thread_worker_refuses_async_handlers(backend, handler):
    q: DelayedQueue[Any] = DelayedQueue("h")
    worker = Worker(backend.Session)
    with pytest.raises(InvalidArgument, match=r"async function.*AsyncWorker"):
        worker.register(q, handler)
    with pytest.raises(InvalidArgument, match="async function"):
        worker.register(q, handler, mode="transactional")
    with pytest.raises(InvalidArgument, match="async function"):
        worker.register_batch(q, handler)


def generator_handler(env: Envelope[Any]) -> Any:
    yield env  # a generator: calling it runs none of this
    raise AssertionError("never run")


async def async_generator_handler(env: Envelope[Any]) -> Any:
    yield env
    raise AssertionError("never run")


class GeneratorCallable:
    def __call__(self, env: Envelope[Any]) -> Any:
        yield env


@pytest.mark.parametrize(
    ("handler", "kind"),
    [
        (generator_handler, "a generator function"),
        (functools.partial(generator_handler), "a generator function"),
        (GeneratorCallable(), "a generator function"),
        (async_generator_handler, "an async generator function"),
    ],
    ids=["generator", "partial", "callable", "async-generator"],
)
def test_both_workers_refuse_generator_handlers(backend, handler, kind):
    """Calling a generator function runs none of its body: the worker got a generator back,
    took it for success and acknowledged the message unhandled."""
    q: DelayedQueue[Any] = DelayedQueue("h")
    worker = Worker(backend.Session)
    with pytest.raises(InvalidArgument, match=f"is {kind} .*acknowledged unhandled"):
        worker.register(q, handler)
    with pytest.raises(InvalidArgument, match=kind):
        worker.register(q, handler, mode="transactional")
    with pytest.raises(InvalidArgument, match=kind):
        worker.register_batch(q, handler)
    aworker = AsyncWorker(async_sessionmaker())
    with pytest.raises(InvalidArgument, match=kind):
        aworker.register(q, handler)
    with pytest.raises(InvalidArgument, match=kind):
        aworker.register_batch(q, handler)


def test_the_asyncio_worker_refuses_plain_functions(async_backend):
    worker = AsyncWorker(async_backend.sessions)
    with pytest.raises(InvalidArgument, match=r"not an async function.*async def"):
        worker.register(DelayedQueue("h"), sync_handler)
    with pytest.raises(InvalidArgument, match="not an async function"):
        worker.register(AsyncQueue(DelayedQueue("h")), sync_handler, mode="transactional")
    worker.register(DelayedQueue("h"), async_handler)  # the right kind is accepted


def test_workers_refuse_the_wrong_kind_of_handler_for_entity_queues_too(backend):
    from sqla_delayedq import EntityQueue
    from tests.entity_app.models import Order

    with pytest.raises(InvalidArgument, match="async function"):
        Worker(backend.Session).register(EntityQueue(Order), async_handler)
    with pytest.raises(InvalidArgument, match="not an async function"):
        AsyncWorker(async_sessionmaker()).register(EntityQueue(Order), sync_handler)
    with pytest.raises(InvalidArgument, match="expected a DelayedQueue or an EntityQueue"):
        Worker(backend.Session).register("emails", sync_handler)


def one_arg(env):
    pass


def two_args(env, session):
    pass


async def async_one_arg(env):
    pass


async def async_two_args(env, session):
    pass


class Handles:
    def one(self, env):
        pass

    def both(self, env, session=None):
        pass


@pytest.mark.parametrize("kind", ["thread", "asyncio"])
@pytest.mark.parametrize(
    ("how", "wrong", "call"),
    [
        ("transactional", "one", r"handler\(envelope, session\) in transactional mode"),
        ("lease", "two", r"handler\(envelope\) in lease mode"),
        ("batch", "two", r"handler\(envelopes\) \(a batch handler\)"),
    ],
)
def test_workers_refuse_a_handler_that_cannot_take_what_its_mode_passes(kind, how, wrong, call):
    """A handler of the wrong arity failed each attempt with a TypeError until every message of
    its queue was dead; it is now refused where it is registered."""

    from sqla_delayedq.aio import create_async_engine

    engine: Any = create_engine("sqlite://") if kind == "thread" else None
    if kind == "thread":
        worker: Any = Worker(sessionmaker(engine))
    else:
        engine = create_async_engine("sqlite+aiosqlite://")
        worker = AsyncWorker(async_sessionmaker(engine))
    handlers = (
        {"one": one_arg, "two": two_args}
        if kind == "thread"
        else {"one": async_one_arg, "two": async_two_args}
    )

    def register(handler: Any, queue: str) -> None:
        if how == "batch":
            worker.register_batch(DelayedQueue(queue), handler)
        else:
            worker.register(DelayedQueue(queue), handler, mode=how)

    with pytest.raises(InvalidArgument, match=rf"cannot be called as {call}.*until it is dead"):
        register(handlers[wrong], "refused")
    right = handlers["two" if wrong == "one" else "one"]
    register(right, "accepted")
    if kind == "thread":  # also fit: defaults, *args, partials, bound methods
        register(functools.partial(two_args, None) if how != "transactional" else two_args, "p")
        register(lambda *args: None, "star")
        register(Handles().both, "method")
    if kind == "thread":
        engine.dispose()


def test_workers_check_an_entity_queue_s_handler_the_same_way(backend):
    from sqla_delayedq import EntityQueue
    from tests.entity_app.models import Order

    with pytest.raises(InvalidArgument, match="in transactional mode"):
        Worker(backend.Session).register(EntityQueue(Order), one_arg, mode="transactional")
    with pytest.raises(InvalidArgument, match="in lease mode"):
        Worker(backend.Session).register(EntityQueue(Order), Handles.one)  # unbound: 2 args
    Worker(backend.Session).register(EntityQueue(Order), Handles().one)


def test_process_one_refuses_a_handler_of_the_wrong_arity_before_it_takes_anything(
    backend, make_queue
):
    q = make_queue()
    with backend.Session.begin() as s:
        q.offer(s, "k", {"n": 1})
    with backend.Session.begin() as s, pytest.raises(InvalidArgument, match="process_one"):
        q.process_one(s, one_arg)
    with backend.Session() as s:
        info = q.get(s, "k")
        assert info is not None and info.attempts == 0 and info.lock_token is None
    done: list[str] = []
    with backend.Session.begin() as s:
        q.process_one(s, lambda env, session: done.append(env.key))
    assert done == ["k"]


@pytest.mark.parametrize(
    ("option", "value", "problem"),
    [
        ("lease", timedelta(seconds=-1), "must be > 0"),
        ("lease", timedelta(0), "must be > 0"),
        ("lease", 30, "must be a timedelta, got int"),
        # Accepted, then every take failed on a lease end past year 9999.
        ("lease", timedelta.max, "must be at most 365000 days"),
        ("lease", timedelta(days=365_001), "must be at most 365000 days"),
        ("handler_timeout", timedelta(seconds=-5), "must be > 0"),
        ("handler_timeout", "5s", "must be a timedelta, got str"),
    ],
)
def test_workers_refuse_a_lease_or_handler_timeout_that_is_not_a_positive_timedelta(
    option, value, problem
):
    """A negative lease would hand a running message to the next take at once; a number would
    only fail inside the worker's loop. Both workers, both kinds of registration, refuse them."""
    q: DelayedQueue[Any] = DelayedQueue("refused")
    sessions: Any = sessionmaker(create_engine("sqlite://"))  # both workers refuse first

    async def async_batch(envs: Any) -> None: ...

    cases = [
        lambda: Worker(sessions).register(q, sync_handler, **{option: value}),
        lambda: Worker(sessions).register_batch(q, lambda envs: None, **{option: value}),
        lambda: AsyncWorker(async_sessionmaker()).register(q, async_handler, **{option: value}),
        lambda: AsyncWorker(async_sessionmaker()).register_batch(q, async_batch, **{option: value}),
    ]
    for register in cases:
        with pytest.raises(InvalidArgument, match=f"register(_batch)?: {option} {problem}"):
            register()


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        (2.5, "batch_size must be an int, got float"),
        (True, "batch_size must be an int, got bool"),
        ("10", "batch_size must be an int, got str"),
        (0, "batch_size must be >= 1, got 0"),
    ],
)
@pytest.mark.parametrize("kind", [Worker, AsyncWorker])
def test_register_batch_refuses_a_batch_size_that_is_no_int_from_1(kind, value, problem):
    """Only ``< 1`` was checked: 2.5 and True were accepted (every take then asked for 2.5
    rows, or for True), and a string raised a TypeError instead of the library's error."""
    sessions: Any = sessionmaker(create_engine("sqlite://"))

    async def async_batch(envs: Any) -> None: ...

    handler = async_batch if kind is AsyncWorker else (lambda envs: None)
    with pytest.raises(InvalidArgument, match=f"register_batch: {problem}"):
        maker = async_sessionmaker() if kind is AsyncWorker else sessions
        kind(maker).register_batch(DelayedQueue("q"), handler, batch_size=value)


@pytest.mark.parametrize(
    ("option", "value", "problem"),
    [
        ("concurrency", 2.5, "concurrency must be an int, got float"),
        ("concurrency", True, "concurrency must be an int, got bool"),
        ("poll_interval", "1", "poll_interval must be a number, got str"),
        ("poll_interval", 0, "poll_interval must be > 0, got 0"),
        ("batch_size", 0, "batch_size must be >= 1, got 0"),
        ("drain_timeout", -1, "drain_timeout must be >= 0, got -1"),
    ],
)
@pytest.mark.parametrize("kind", [Worker, AsyncWorker])
def test_workers_refuse_options_out_of_range_or_of_the_wrong_type(kind, option, value, problem):
    sessions: Any = sessionmaker(create_engine("sqlite://"))  # both workers refuse first
    with pytest.raises(InvalidArgument, match=problem):
        kind(sessions, **{option: value})


def test_the_heartbeat_looks_often_enough_for_the_shortest_lease():
    """Every half second, or six times per lease: a 1 s lease is extended with a third of it
    left, where a half-second look could find it with nothing left."""
    from sqla_delayedq._consumer import Registration, heartbeat_every

    q: DelayedQueue[Any] = DelayedQueue("beats")

    def reg(mode: str, seconds: float) -> Registration:
        return Registration(q, sync_handler, mode, timedelta(seconds=seconds), None)  # type: ignore[arg-type]

    assert heartbeat_every([]) == 0.5
    assert heartbeat_every([reg("lease", 300)]) == 0.5
    assert heartbeat_every([reg("lease", 300), reg("lease", 1.2)]) == pytest.approx(0.2)
    # A transactional registration counts: a limited queue's take there is a lease.
    assert heartbeat_every([reg("transactional", 0.6), reg("lease", 6)]) == pytest.approx(0.1)
    assert heartbeat_every([reg("lease", 0.001)]) == 0.01  # no busy loop for an absurd lease


# -- a handler that slips through fails; it is never acknowledged -------------------------------


def _coroutine_returning(calls: list[str]) -> Callable[..., Any]:
    async def body(env: Envelope[Any]) -> None:
        calls.append(env.key)  # would only run if something awaited it

    return lambda env, *rest: body(env)


def _generator_returning(calls: list[str]) -> Callable[..., Any]:
    def body(env: Envelope[Any]) -> Any:
        calls.append(env.key)  # would only run if something iterated it
        yield

    return lambda env, *rest: body(env)


@pytest.mark.parametrize("returns", ["coroutine", "generator"])
@pytest.mark.parametrize("mode", ["lease", "transactional", "batch"])
def test_a_handler_returning_a_coroutine_fails_its_attempt_on_the_thread_worker(
    backend, mode, returns, caplog
):
    q: DelayedQueue[Any] = DelayedQueue(f"coro-{mode}", retry=NO_RETRY_DELAY)
    with backend.Session.begin() as s:
        q.offer(s, "k", {"v": 1})
    ran: list[str] = []
    worker = Worker(backend.Session, concurrency=1, poll_interval=0.05, listen=False)
    handler = (_coroutine_returning if returns == "coroutine" else _generator_returning)(ran)
    if mode == "batch":
        worker.register_batch(q, handler, batch_size=10)
    else:
        worker.register(q, handler, mode=mode)
    caplog.set_level(logging.WARNING, logger="sqla_delayedq")
    worker.start()
    try:

        def dead() -> bool:
            with backend.Session() as s:
                return q.counts(s).dead == 1

        assert wait_for(dead, 20)
    finally:
        worker.stop(5)
    assert ran == []  # the coroutine never ran ...
    with backend.Session() as s:
        (info,) = q.search(s, MessageFilter(state="dead"))
    assert info.attempts == 2  # ... so each attempt failed instead of being acknowledged
    if returns == "coroutine":
        assert "HandlerNotAwaited" in (info.last_error or "")
        assert "AsyncWorker" in (info.last_error or "")
    else:
        assert "HandlerNotRun" in (info.last_error or "")
        assert "generator, whose body never ran" in (info.last_error or "")
    assert any(r.levelno >= logging.ERROR and "dead" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("mode", ["lease", "transactional", "batch"])
def test_an_async_handler_that_returns_a_coroutine_unawaited_fails_its_attempt(
    async_backend, mode, caplog
):
    """``async def h(env): return send(env)``: the worker awaited ``h`` and acknowledged,
    and ``send`` never ran. Now the attempt fails, saying why."""
    q: DelayedQueue[Any] = DelayedQueue(f"forgot-{mode}", retry=NO_RETRY_DELAY)
    with async_backend.sync.Session.begin() as s:
        q.offer(s, "k", {"v": 1})
    sent: list[str] = []

    async def send(env: Any) -> None:
        sent.append("sent")

    async def forgot_await(env: Any, *session: Any) -> Any:
        return send(env)

    async def scenario() -> None:
        worker = AsyncWorker(async_backend.sessions, concurrency=1, poll_interval=0.05)
        if mode == "batch":
            worker.register_batch(q, forgot_await, batch_size=10)
        else:
            worker.register(q, forgot_await, mode=mode)
        task = asyncio.create_task(worker.run(install_signal_handlers=False))
        try:
            for _ in range(1000):  # the second attempt's failure buries it: logged as ERROR
                if any(r.levelno == logging.ERROR for r in caplog.records):
                    break
                await asyncio.sleep(0.02)
        finally:
            worker.request_stop()
            await task

    caplog.set_level(logging.WARNING, logger="sqla_delayedq")
    asyncio.run(scenario())
    assert sent == []
    with async_backend.sync.Session() as s:
        (info,) = q.search(s, MessageFilter(state="dead"))
    assert info.attempts == 2
    assert "HandlerNotAwaited" in (info.last_error or "")
    assert "missing await" in (info.last_error or "")


def test_an_async_handler_s_own_cancellation_fails_its_attempt_and_stops_the_worker(
    async_backend,
):
    """A handler that raises ``CancelledError`` of its own (it awaited a future someone else
    cancelled) ended its consumer task without a word: the worker ran on with no consumer, the
    heartbeat kept the message leased for ever, no attempt counted."""
    q: DelayedQueue[Any] = DelayedQueue("own-cancel", lease=timedelta(seconds=1))
    with async_backend.sync.Session.begin() as s:
        q.offer(s, "k", {"v": 1})
    runs: list[str] = []

    async def handler(env: Envelope[Any]) -> None:
        runs.append(env.key)
        raise asyncio.CancelledError()

    async def scenario() -> BaseException | None:
        worker = AsyncWorker(async_backend.sessions, concurrency=1, poll_interval=0.02)
        worker.register(q, handler)
        task = asyncio.create_task(worker.run(install_signal_handlers=False))
        try:
            await asyncio.wait_for(task, 30)
        except WorkerError as exc:
            return exc.__cause__
        return None

    error = asyncio.run(scenario())
    assert isinstance(error, asyncio.CancelledError)
    assert runs == ["k"]
    with async_backend.sync.Session() as s:
        info = q.get(s, "k")
    assert info is not None and info.lock_token is None and info.attempts == 1
    assert "CancelledError" in (info.last_error or "")


def test_a_cancelled_async_worker_run_leaves_no_consumer_behind(async_backend):
    """Cancelling the task that runs ``AsyncWorker.run()`` (a lifespan's shutdown) cancelled
    only its side tasks: the consumers went on taking, with no heartbeat. Now a cancelled
    ``run()`` stops like a signal (drains, then releases) and the cancellation goes on."""
    q: DelayedQueue[Any] = DelayedQueue("cancel-run", lease=timedelta(seconds=30))
    with async_backend.sync.Session.begin() as s:
        q.offer(s, "m1", {})
    started: list[str] = []
    finished: list[str] = []

    async def handler(env: Envelope[Any]) -> None:
        started.append(env.key)
        await asyncio.sleep(0.5)
        finished.append(env.key)

    async def scenario() -> None:
        worker = AsyncWorker(
            async_backend.sessions, concurrency=2, poll_interval=0.02, drain_timeout=10
        )
        worker.register(q, handler)
        task = asyncio.create_task(worker.run(install_signal_handlers=False))
        for _ in range(1500):
            if started:
                break
            await asyncio.sleep(0.02)
        assert started == ["m1"]
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert finished == ["m1"]  # drained, as on a signal

        def offer_m2() -> None:
            with async_backend.sync.Session.begin() as s:
                q.offer(s, "m2", {})

        await asyncio.to_thread(offer_m2)
        await asyncio.sleep(1.0)  # an orphaned consumer, polling every 20 ms, takes it now

    asyncio.run(scenario())
    assert started == ["m1"]
    with async_backend.sync.Session() as s:
        assert q.get(s, "m1") is None
        m2 = q.get(s, "m2")
        assert m2 is not None and m2.lock_token is None and m2.attempts == 0


def test_an_event_loop_shutdown_releases_the_async_handler_s_message_uncounted(async_backend):
    """``asyncio.run()`` ending with ``run()`` still in a task cancels every task left, the
    worker's consumers too, in no set order. A consumer cancelled before ``run()`` took the
    handler's ``CancelledError`` for the handler's own: the attempt counted (the last one
    buried the message, its handler never failed) and the worker stopped on a WorkerError. Now
    it is a stop: the message is released, no attempt counted."""
    q: DelayedQueue[Any] = DelayedQueue(
        "loop-shutdown", lease=timedelta(seconds=30), retry=ExponentialBackoff(max_attempts=1)
    )
    with async_backend.sync.Session.begin() as s:
        q.offer(s, "k", {"v": 1})
    started: list[str] = []

    async def handler(env: Envelope[Any]) -> None:
        started.append(env.key)
        await asyncio.sleep(30)

    async def scenario() -> AsyncWorker:
        worker = AsyncWorker(async_backend.sessions, concurrency=1, poll_interval=0.02)
        worker.register(q, handler)
        task = asyncio.create_task(worker.run(install_signal_handlers=False))
        for _ in range(1500):
            if started:
                break
            await asyncio.sleep(0.02)
        assert started == ["k"]
        # What asyncio.run() does on its way out, in the order that lost the message.
        for other in asyncio.all_tasks() - {task, asyncio.current_task()}:
            other.cancel()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return worker

    worker = asyncio.run(scenario())
    assert worker.failure is None
    with async_backend.sync.Session() as s:
        info = q.get(s, "k")
    assert info is not None and info.lock_token is None
    assert info.attempts == 0 and info.last_error is None  # released, not failed or dead


def test_the_asyncio_worker_does_not_run_a_handler_twice_when_it_returned_no_awaitable():
    """Defence in depth behind the registration check: a callable that returned a plain value
    has already run to its end; that is its outcome (awaiting it would fail and retry it)."""
    from sqla_delayedq.aio import AsyncRuntime

    ran: list[int] = []

    def plain(env: Any) -> str:
        ran.append(1)
        return "done"

    loop = asyncio.new_event_loop()
    try:
        assert AsyncRuntime(loop, lambda **kw: None).call(plain, None) == "done"
    finally:
        loop.close()
    assert ran == [1]


# -- failures are logged ------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["lease", "transactional"])
def test_a_failing_handler_is_logged_with_queue_key_attempt_and_traceback(backend, mode, caplog):
    q: DelayedQueue[Any] = DelayedQueue(f"log-{mode}", retry=NO_RETRY_DELAY)
    with backend.Session.begin() as s:
        q.offer(s, "order/7", {"v": 1})

    def boom(env: Envelope[Any], session: Session | None = None) -> None:
        raise ValueError("card declined")

    caplog.set_level(logging.WARNING, logger="sqla_delayedq")
    worker = Worker(backend.Session, concurrency=1, poll_interval=0.05, listen=False)
    worker.register(q, boom, mode=mode)
    worker.start()
    try:

        def dead() -> bool:
            with backend.Session() as s:
                return q.counts(s).dead == 1

        assert wait_for(dead, 20)
    finally:
        worker.stop(5)
    records = [r for r in caplog.records if "card declined" in r.getMessage()]
    retried = [r for r in records if r.levelno == logging.WARNING]
    died = [r for r in records if r.levelno == logging.ERROR]
    assert len(retried) == 1 and len(died) == 1
    for record, attempt in ((retried[0], 1), (died[0], 2)):
        text = record.getMessage()
        assert f"log-{mode}/order/7" in text and f"attempt {attempt}" in text
        assert record.exc_info is not None and record.exc_info[0] is ValueError
    assert "dead" in died[0].getMessage()


def test_a_failing_async_handler_is_logged(async_backend, caplog):
    q: DelayedQueue[Any] = DelayedQueue("alog", retry=NO_RETRY_DELAY)
    with async_backend.sync.Session.begin() as s:
        q.offer(s, "k", {})

    async def boom(env: Envelope[Any]) -> None:
        raise KeyError("missing")

    async def scenario() -> None:
        worker = AsyncWorker(async_backend.sessions, concurrency=1, poll_interval=0.05)
        worker.register(q, boom)
        task = asyncio.create_task(worker.run(install_signal_handlers=False))
        for _ in range(500):
            if any(r.levelno == logging.ERROR for r in caplog.records):
                break
            await asyncio.sleep(0.02)
        worker.request_stop()
        await task

    caplog.set_level(logging.WARNING, logger="sqla_delayedq")
    asyncio.run(scenario())
    died = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert died and "alog/k" in died[0].getMessage() and died[0].exc_info is not None


def test_a_failing_entity_handler_is_logged(backend, caplog):
    from sqla_delayedq import EntityQueue
    from tests.entity_app.models import Base, Order

    Base.metadata.create_all(backend.engine)
    try:
        eq = EntityQueue(Order)
        with backend.Session.begin() as s:
            order = Order(reference="r1", company_id=1, amount_cents=5)
            s.add(order)
            s.flush()
            eq.schedule(s, order)

        def boom(envelope: Envelope[Order], session: Session) -> None:
            raise RuntimeError("no stock")

        caplog.set_level(logging.WARNING, logger="sqla_delayedq")
        worker = Worker(backend.Session).register(eq, boom, mode="transactional")
        assert worker.process_due() == 1
        (record,) = [r for r in caplog.records if "no stock" in r.getMessage()]
        assert record.levelno == logging.WARNING and "attempt 1" in record.getMessage()
    finally:
        Base.metadata.drop_all(backend.engine)


class DuckHooks:
    """Hooks that look like WorkerHooks without being one (only ``processed``)."""

    def processed(self, queue: str, envelope: Envelope[Any], seconds: float) -> None:
        pass


@pytest.mark.parametrize("hooks", [DuckHooks(), 5, object()], ids=["duck-typed", "int", "object"])
def test_a_worker_refuses_hooks_that_are_not_worker_hooks(hooks):
    """``Worker(hooks=...)`` took any object (``add_hooks`` refused it): at the first take the
    worker stopped on a missing method, in transactional mode after failing the message."""
    kinds: Any = (
        (Worker, sessionmaker(create_engine("sqlite://"))),
        (AsyncWorker, async_sessionmaker()),
    )
    for worker_class, sessions in kinds:
        name = worker_class.__name__
        with pytest.raises(InvalidArgument, match=rf"{name}: hooks: expected a WorkerHooks"):
            worker_class(sessions, hooks=hooks)
        with pytest.raises(InvalidArgument, match=r"add_hooks: .*expected a WorkerHooks"):
            worker_class(sessions).add_hooks(hooks)


@pytest.mark.parametrize("mode", ["lease", "transactional"])
def test_a_hook_that_cannot_be_read_never_fails_the_message(backend, mode, caplog):
    """Reading a hook that raises (a property) failed the take's report outside the hooks'
    guard: in transactional mode it counted as the handler's failure, before the handler ran.
    A hook never changes what happens to a message; a missing one is one nobody wants."""

    class Hooks(WorkerHooks):
        broken = False  # from the first take on

        @property
        def lag(self) -> Any:
            if self.broken:
                raise RuntimeError("lag cannot be read")
            return super().lag

        @property
        def redelivered(self) -> Any:
            if self.broken:
                raise AttributeError("redelivered")  # as if missing
            return super().redelivered

    q: DelayedQueue[Any] = DelayedQueue("unreadable-hook", retry=NO_RETRY_DELAY)
    with backend.Session.begin() as s:
        q.offer(s, "m", {})
    calls: list[str] = []
    worker = Worker(backend.Session, hooks=Hooks())
    if mode == "lease":
        worker.register(q, lambda e: calls.append(e.key))
    else:
        worker.register(q, lambda e, s: calls.append(e.key), mode="transactional")
    Hooks.broken = True
    caplog.set_level(logging.ERROR, logger="sqla_delayedq")
    assert worker.process_due() == 1
    assert calls == ["m"] and worker.failure is None
    with backend.Session() as s:
        counts = q.counts(s)
    assert (counts.due, counts.scheduled, counts.in_flight, counts.dead) == (0, 0, 0, 0)
    assert any("lag cannot be read" in r.exc_text for r in caplog.records if r.exc_text)


# -- errors a worker must not retry stop it loudly ----------------------------------------------


def test_a_programming_error_in_the_loop_stops_the_worker_instead_of_spinning(backend, caplog):
    class Broken(DelayedQueue[Any]):
        def poll_batch(self, *args: Any, **kwargs: Any) -> Any:
            raise AttributeError("'Broken' object has no attribute 'process_one'")

    polls: list[int] = []
    q = Broken("broken")
    worker = Worker(backend.Session, concurrency=2, poll_interval=0.05, listen=False)
    worker.register(q, lambda env: polls.append(1))
    caplog.set_level(logging.WARNING, logger="sqla_delayedq")
    stopper = threading.Timer(10, worker.request_stop)  # only if it fails to stop by itself
    stopper.start()
    started = time.monotonic()
    try:
        with pytest.raises(WorkerError, match="AttributeError"):
            worker.run(install_signal_handlers=False)
    finally:
        stopper.cancel()
    assert time.monotonic() - started < 9  # stopped by itself, not by the 10 s stopper
    assert isinstance(worker.failure, AttributeError)
    critical = [r for r in caplog.records if r.levelno == logging.CRITICAL]
    assert critical and critical[0].exc_info is not None
    assert not any(
        "transient" in r.getMessage() and "retrying" in r.getMessage() for r in caplog.records
    )


def test_a_missing_table_stops_the_asyncio_worker_loudly(async_backend, caplog):
    from sqlalchemy.orm import DeclarativeBase

    from sqla_delayedq import QueueMessageMixin

    class Base(DeclarativeBase):
        pass

    class Missing(QueueMessageMixin, Base):
        __tablename__ = "no_such_table"

    async def handler(env: Envelope[Any]) -> None:
        pass

    async def scenario() -> None:
        worker = AsyncWorker(async_backend.sessions, concurrency=2, poll_interval=0.05)
        worker.register(DelayedQueue("q", model=Missing), handler)
        with pytest.raises(WorkerError):
            await asyncio.wait_for(worker.run(install_signal_handlers=False), 10)

    caplog.set_level(logging.WARNING, logger="sqla_delayedq")
    asyncio.run(scenario())
    assert any(r.levelno == logging.CRITICAL for r in caplog.records)


def test_a_raising_hook_is_logged_and_does_not_stop_the_worker(backend, caplog):
    class BadHooks(WorkerHooks):
        def processed(self, queue: str, envelope: Envelope[Any], seconds: float) -> None:
            raise RuntimeError("metrics backend down")

    q: DelayedQueue[Any] = DelayedQueue("hooks")
    with backend.Session.begin() as s:
        q.offer_batch(s, [(f"k{i}", {}) for i in range(3)])
    handled: list[str] = []
    worker = Worker(
        backend.Session, concurrency=1, poll_interval=0.05, listen=False, hooks=BadHooks()
    )
    worker.register(q, lambda env: handled.append(env.key))
    caplog.set_level(logging.WARNING, logger="sqla_delayedq")
    worker.start()
    try:
        assert wait_for(lambda: len(handled) == 3, 20)
    finally:
        worker.stop(5)
    assert worker.failure is None
    assert (
        sum("metrics backend down" in (r.exc_text or str(r.exc_info)) for r in caplog.records) == 3
    )


# -- async hooks and periodic tasks -------------------------------------------------------------


class AsyncHooks(WorkerHooks):
    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

    async def processed(self, queue: str, envelope: Envelope[Any], seconds: float) -> None:
        await asyncio.sleep(0)  # it does run on the event loop
        self.seen.append(("processed", envelope.key))

    async def lag(self, queue: str, seconds: float) -> None:
        self.seen.append(("lag", queue))


async def async_tick(sessions: Any) -> None:
    raise AssertionError("never awaited by the thread worker")


def generator_tick(sessions: Any) -> Any:
    yield sessions


def test_the_asyncio_worker_awaits_async_hooks_and_periodic_tasks(async_backend):
    """They were called and never awaited: the hook or task silently never ran (a "coroutine
    was never awaited" warning at best). An ``async def`` periodic task gets AsyncSessions."""
    q: DelayedQueue[Any] = DelayedQueue("async-hooks")
    with async_backend.sync.Session.begin() as s:
        q.offer(s, "m", {})
    given, extra = AsyncHooks(), AsyncHooks()
    ticks: list[int] = []
    stops: list[int] = []

    async def tick(sessions: Any) -> None:
        async with sessions() as session:
            ticks.append(int((await session.execute(sa.text("SELECT 1"))).scalar_one()))

    async def bye(sessions: Any) -> None:
        async with sessions() as session:
            stops.append(int((await session.execute(sa.text("SELECT 2"))).scalar_one()))

    async def handler(env: Envelope[Any]) -> None:
        pass

    async def scenario() -> bool:
        worker = AsyncWorker(
            async_backend.sessions, concurrency=1, poll_interval=0.05, listen=False, hooks=given
        )
        worker.register(q, handler).add_hooks(extra).add_periodic("tick", tick, 0.05, on_stop=bye)
        task = asyncio.create_task(worker.run(install_signal_handlers=False))
        try:
            for _ in range(500):
                if len(ticks) >= 3 and extra.seen and ("processed", "m") in extra.seen:
                    break
                await asyncio.sleep(0.02)
        finally:
            worker.request_stop()
        return await task

    assert asyncio.run(scenario())
    for hooks in (given, extra):
        assert hooks.seen == [("lag", "async-hooks"), ("processed", "m")]
    assert len(ticks) >= 3 and set(ticks) == {1}
    assert stops == [2]


@pytest.mark.parametrize(
    ("fn", "problem"),
    [
        (async_tick, r"async function; a thread worker would call it and never await it"),
        (functools.partial(async_tick), "async function"),
        (generator_tick, "is a generator function"),
        ("tick", "must be callable, not str"),
    ],
    ids=["async-def", "partial", "generator", "not-callable"],
)
def test_the_thread_worker_refuses_hooks_and_periodic_tasks_it_would_never_run(fn, problem):
    """An ``async def`` hook or periodic task on the thread worker was called, never awaited:
    it silently never ran. Refused where it is given, as async handlers are."""

    class Hooks(WorkerHooks):
        failed = fn

    sessions: Any = sessionmaker(create_engine("sqlite://"))
    if callable(fn):  # a hook must be callable to be one; the others are refused as such
        with pytest.raises(InvalidArgument, match=rf"Worker: hooks\.failed: .*{problem}"):
            Worker(sessions, hooks=Hooks())
        with pytest.raises(InvalidArgument, match=rf"add_hooks: Hooks\.failed: .*{problem}"):
            Worker(sessions).add_hooks(Hooks())
    with pytest.raises(InvalidArgument, match=rf"add_periodic: fn.*{problem}"):
        Worker(sessions).add_periodic("tick", fn, 1)
    with pytest.raises(InvalidArgument, match=rf"add_periodic: on_stop.*{problem}"):
        Worker(sessions).add_periodic("tick", lambda sessions: None, 1, on_stop=fn)
    aworker = AsyncWorker(async_sessionmaker())
    if fn in (async_tick,) or isinstance(fn, functools.partial):
        aworker.add_periodic("tick", fn, 1).add_hooks(Hooks())  # awaited there
    else:
        with pytest.raises(InvalidArgument, match=problem):
            aworker.add_periodic("tick", fn, 1)
