"""asyncio: queue operations on an ``AsyncSession``, and an asyncio worker.

:class:`AsyncQueue` wraps a :class:`~sqla_delayedq.DelayedQueue` and runs each operation on the
``AsyncSession``'s underlying Session (``run_sync``), so the statements, their round trips and
their guarantees are exactly those of the sync API, joined to the caller's async transaction::

    aq = AsyncQueue(DelayedQueue("emails"))
    async with async_session() as session, session.begin():
        session.add(user)
        await aq.offer(session, f"welcome/{user.id}", {"user_id": user.id})

:class:`AsyncWorker` runs ``async def`` handlers on ``concurrency`` tasks. It is the thread
worker's core (:mod:`sqla_delayedq._consumer`) on an asyncio runtime: the same loops run in
greenlets on the event loop, as SQLAlchemy's asyncio extension runs its own sync core, so both
workers take, retry, extend, log, wake up and shut down by the same code.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import inspect
import logging
from collections.abc import (
    Awaitable,
    Callable,
    Coroutine,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from datetime import datetime, timedelta
from typing import Any, Generic, TypeVar

from sqlalchemy.engine import URL, Engine
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker
from sqlalchemy.ext.asyncio import create_async_engine as sa_create_async_engine
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.util import await_only, greenlet_spawn

from ._consumer import BaseWorker, Mode, WorkerHooks, hand_out, stop_signals
from ._dialects import Listener, is_transient
from ._engine import engine_options
from ._handlers import (
    check_async_handler,
    check_callback,
    check_transactional,
    is_async_callable,
    is_cancellation,
    refuse_unrun,
)
from ._offers import OfferInput
from ._queue import DelayedQueue
from ._transaction import backoff_delays
from ._types import (
    Envelope,
    MessageFilter,
    MessageInfo,
    NackOutcome,
    OfferMode,
    OfferResult,
    QueueCounts,
)
from ._wakeup import subscribe
from .controls import UNSET, QueueControls
from .errors import InvalidArgument

__all__ = [
    "AsyncHandler",
    "AsyncQueue",
    "AsyncWorker",
    "Mode",
    "WorkerHooks",
    "create_async_engine",
    "run_in_transaction_async",
]

T = TypeVar("T")
R = TypeVar("R")
log = logging.getLogger("sqla_delayedq.worker")

#: Lease mode: ``await handler(envelope)``; transactional: ``await handler(envelope, session)``.
AsyncHandler = Callable[..., Awaitable[Any]]


def create_async_engine(url: str | URL, **kwargs: Any) -> AsyncEngine:
    """``sqlalchemy.ext.asyncio.create_async_engine`` with the settings of
    :func:`sqla_delayedq.create_engine` (``READ COMMITTED`` on MariaDB/MySQL; WAL, a busy
    timeout and ``BEGIN IMMEDIATE`` on SQLite). Drivers: ``postgresql+psycopg://``,
    ``mysql+aiomysql://``, ``sqlite+aiosqlite://``."""
    options, configure = engine_options(url, kwargs)
    engine = sa_create_async_engine(url, **options)
    configure(engine.sync_engine)
    return engine


async def run_in_transaction_async(
    sessions: Callable[[], AsyncSession],
    work: Callable[[AsyncSession], Awaitable[R]],
    *,
    attempts: int = 5,
    initial_delay: float = 0.05,
    max_delay: float = 2.0,
) -> R:
    """The asyncio form of :func:`sqla_delayedq.run_in_transaction`: ``await work(session)``
    inside ``session.begin()``, run again from the start after a transient failure."""
    pauses = iter(backoff_delays(attempts, initial_delay, max_delay))
    attempt = 1
    while True:
        try:
            async with sessions() as session, session.begin():
                return await work(session)
        except Exception as exc:
            if attempt >= attempts or not is_transient(exc):
                raise
            log.info("transaction attempt %d of %d failed, retrying: %s", attempt, attempts, exc)
        await asyncio.sleep(next(pauses))
        attempt += 1


class AsyncQueue(Generic[T]):
    """Every operation of ``queue`` on an ``AsyncSession``; none of them commits.

    Each method is the :class:`~sqla_delayedq.DelayedQueue` method of the same name, run on the
    session's sync face through ``AsyncSession.run_sync``.
    """

    def __init__(self, queue: DelayedQueue[T]) -> None:
        self.queue = queue

    @property
    def name(self) -> str:
        return self.queue.name

    # -- offer and take --------------------------------------------------------------------

    async def offer(
        self,
        session: AsyncSession | AsyncEngine,
        key: str | None,
        payload: T,
        at: datetime | None = None,
        *,
        mode: OfferMode | str = OfferMode.REPLACE,
        headers: Mapping[str, str] | None = None,
        group: str | None = None,
        priority: int = 0,
    ) -> OfferResult:
        """With an ``AsyncEngine``, committed on its own (see :meth:`DelayedQueue.offer`)."""

        def offer(s: Session | Engine) -> OfferResult:
            return self.queue.offer(
                s, key, payload, at, mode=mode, headers=headers, group=group, priority=priority
            )

        if isinstance(session, AsyncEngine):
            return await greenlet_spawn(offer, session.sync_engine)
        return await session.run_sync(offer)

    async def offer_batch(
        self,
        session: AsyncSession,
        messages: Iterable[OfferInput],
        *,
        mode: OfferMode | str = OfferMode.REPLACE,
        headers: Mapping[str, str] | None = None,
        group: str | None = None,
        priority: int = 0,
    ) -> list[OfferResult]:
        if isinstance(session, AsyncEngine):
            raise InvalidArgument(
                f"offer_batch takes an AsyncSession, got {type(session).__name__}; only offer "
                "takes an AsyncEngine, to commit one message on its own"
            )
        items = list(messages)
        return await session.run_sync(
            lambda s: self.queue.offer_batch(
                s, items, mode=mode, headers=headers, group=group, priority=priority
            )
        )

    async def try_poll(
        self, session: AsyncSession, *, lease: timedelta | None = None
    ) -> Envelope[T] | None:
        return await session.run_sync(lambda s: self.queue.try_poll(s, lease=lease))

    async def try_poll_many(
        self, session: AsyncSession, n: int, *, lease: timedelta | None = None
    ) -> list[Envelope[T]]:
        return await session.run_sync(lambda s: self.queue.try_poll_many(s, n, lease=lease))

    async def holding(
        self, session: AsyncSession, envelopes: Sequence[Envelope[T]]
    ) -> list[Envelope[T]]:
        return await session.run_sync(lambda s: self.queue.holding(s, envelopes))

    async def consume(self, session: AsyncSession, n: int = 1) -> list[Envelope[T]]:
        return await session.run_sync(lambda s: self.queue.consume(s, n))

    async def process_one(
        self,
        session: AsyncSession,
        handler: Callable[[Envelope[T], AsyncSession], Awaitable[Any]],
    ) -> tuple[Envelope[T], BaseException | None, NackOutcome | None] | None:
        """:meth:`DelayedQueue.process_one` with an ``async def`` handler, which gets this
        ``AsyncSession`` (inside the savepoint the sync method opens)."""
        check_async_handler(handler, "AsyncQueue.process_one")
        check_transactional(handler, "AsyncQueue.process_one")

        def handle(envelope: Envelope[T], _sync: Session) -> Any:
            return await_only(handler(envelope, session))

        return await session.run_sync(lambda s: self.queue.process_one(s, handle))

    async def next_due(self, session: AsyncSession) -> datetime | None:
        return await session.run_sync(self.queue.next_due)

    # -- settle ----------------------------------------------------------------------------

    async def ack(self, session: AsyncSession, envelope: Envelope[Any]) -> bool:
        return await session.run_sync(lambda s: self.queue.ack(s, envelope))

    async def ack_many(self, session: AsyncSession, envelopes: Sequence[Envelope[Any]]) -> int:
        return await session.run_sync(lambda s: self.queue.ack_many(s, envelopes))

    async def nack(
        self,
        session: AsyncSession,
        envelope: Envelope[Any],
        error: BaseException | str,
        at: datetime | None = None,
    ) -> NackOutcome:
        return await session.run_sync(lambda s: self.queue.nack(s, envelope, error, at))

    retry = nack

    async def record_failure(
        self,
        session: AsyncSession,
        envelope: Envelope[Any],
        error: BaseException | str,
        at: datetime | None = None,
    ) -> NackOutcome:
        return await session.run_sync(lambda s: self.queue.record_failure(s, envelope, error, at))

    async def release(
        self, session: AsyncSession, envelope: Envelope[Any], *, at: datetime | None = None
    ) -> bool:
        return await session.run_sync(lambda s: self.queue.release(s, envelope, at=at))

    async def extend(
        self, session: AsyncSession, envelope: Envelope[T], lease: timedelta | None = None
    ) -> Envelope[T] | None:
        return await session.run_sync(lambda s: self.queue.extend(s, envelope, lease))

    # -- read side -------------------------------------------------------------------------

    async def get(self, session: AsyncSession, key: str) -> MessageInfo | None:
        return await session.run_sync(lambda s: self.queue.get(s, key))

    async def contains(self, session: AsyncSession, key: str) -> bool:
        return await session.run_sync(lambda s: self.queue.contains(s, key))

    async def counts(self, session: AsyncSession, *, at_most: int | None = None) -> QueueCounts:
        return await session.run_sync(lambda s: self.queue.counts(s, at_most=at_most))

    async def oldest_due(self, session: AsyncSession) -> datetime | None:
        return await session.run_sync(self.queue.oldest_due)

    async def search(
        self,
        session: AsyncSession,
        where: MessageFilter | None = None,
        *,
        limit: int = 100,
        after_id: int | None = None,
    ) -> list[MessageInfo]:
        return await session.run_sync(
            lambda s: self.queue.search(s, where, limit=limit, after_id=after_id)
        )

    async def count(self, session: AsyncSession, where: MessageFilter | None = None) -> int:
        return await session.run_sync(lambda s: self.queue.count(s, where))

    async def count_up_to(
        self, session: AsyncSession, where: MessageFilter | None = None
    ) -> tuple[int, int]:
        return await session.run_sync(lambda s: self.queue.count_up_to(s, where))

    # -- admin side ------------------------------------------------------------------------

    async def drop(self, session: AsyncSession, key: str) -> bool:
        return await session.run_sync(lambda s: self.queue.drop(s, key))

    async def drop_where(self, session: AsyncSession, where: MessageFilter) -> int:
        return await session.run_sync(lambda s: self.queue.drop_where(s, where))

    async def drop_all(self, session: AsyncSession, *, confirm: str | None = None) -> int:
        return await session.run_sync(lambda s: self.queue.drop_all(s, confirm=confirm))

    async def reschedule(
        self,
        session: AsyncSession,
        target: str | MessageFilter,
        at: datetime | None = None,
        *,
        priority: int | None = None,
    ) -> int:
        return await session.run_sync(
            lambda s: self.queue.reschedule(s, target, at, priority=priority)
        )

    async def requeue_dead(
        self, session: AsyncSession, where: MessageFilter | None = None, at: datetime | None = None
    ) -> int:
        return await session.run_sync(lambda s: self.queue.requeue_dead(s, where, at))

    async def prune(self, session: AsyncSession, older_than: timedelta | None = None) -> int:
        return await session.run_sync(lambda s: self.queue.prune(s, older_than))

    # -- controls --------------------------------------------------------------------------

    async def pause(self, session: AsyncSession) -> QueueControls:
        return await session.run_sync(self.queue.pause)

    async def resume(self, session: AsyncSession) -> QueueControls:
        return await session.run_sync(self.queue.resume)

    async def set_limits(
        self,
        session: AsyncSession,
        *,
        max_in_flight: int | None = UNSET,
        rate: tuple[int, timedelta | float] | None = UNSET,
    ) -> QueueControls:
        return await session.run_sync(
            lambda s: self.queue.set_limits(s, max_in_flight=max_in_flight, rate=rate)
        )

    async def controls(self, session: AsyncSession) -> QueueControls:
        return await session.run_sync(self.queue.controls)


def _cancelled_from_outside() -> bool:
    """Whether the running task was cancelled by ``cancel()``, as opposed to a
    ``CancelledError`` a handler raised or got from a future someone cancelled. (Python 3.10
    could not tell: the loop's end cancelling every task then counted the handlers' messages
    failed attempts, dead with one allowed; the package needs 3.11.)"""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


async def _to_its_end(work: Coroutine[Any, Any, None]) -> asyncio.CancelledError | None:
    """Run ``work`` in a task of its own to its end, whatever cancellations the awaiting task
    gets meanwhile (anyio delivers one again at each of its awaits until it ends); the last
    of them, for the caller to raise once ``work`` is done."""
    inner = asyncio.ensure_future(work)
    cancelled: asyncio.CancelledError | None = None
    while True:
        try:
            await asyncio.shield(inner)
            return cancelled
        except asyncio.CancelledError as exc:
            if inner.done():  # ``work`` itself was cancelled, more than it could absorb
                return exc
            cancelled = exc


async def _again_if_cancelled(step: Callable[[], Awaitable[Any]], tries: int = 3) -> None:
    """Await ``step()``, and again (up to ``tries`` in all) when a cancellation cut it short;
    the task's cancellation is then withdrawn (``uncancel``), as it was absorbed."""
    for attempt in range(tries):
        try:
            await step()
            return
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            if attempt == tries - 1:
                raise


#: The key, in a Session's ``info``, of the AsyncSession around it (``AsyncRuntime.session``).
_ASYNC_SESSION = "sqla_delayedq.async_session"


def _resolve(wakeup: asyncio.Future[None]) -> bool:
    """Wake one waiter; False when it no longer waits (timed out or cancelled)."""
    if wakeup.done():
        return False
    wakeup.set_result(None)
    return True


class AsyncRuntime:
    """Waiting, sleeping, sessions and handler calls for the core's loops in greenlets.

    Every method that blocks is called from a greenlet started by ``greenlet_spawn`` and
    suspends it with ``await_only`` while the event loop runs. ``notify`` may come from any
    thread (the ``LISTEN`` thread, a committing thread of the application).
    """

    late_hint = (
        "a handler or hook blocked the event loop, and the heartbeat runs on it: run blocking "
        "work off the loop with asyncio.to_thread or loop.run_in_executor"
    )

    def __init__(self, loop: asyncio.AbstractEventLoop, sessions: Callable[..., Any]) -> None:
        self.loop = loop
        self.sessions = sessions
        self._stopping = False
        self._drained = False
        self._stopped: asyncio.Future[None] = loop.create_future()
        self._waiting: collections.deque[asyncio.Future[None]] = collections.deque()
        self._generation = 0

    @property
    def stopping(self) -> bool:
        return self._stopping

    def request_stop(self) -> None:
        self._stopping = True
        self._soon(self._on_stop)

    def _on_stop(self) -> None:
        if not self._stopped.done():
            self._stopped.set_result(None)
        self._bump(None)

    async def stopped(self) -> None:
        await self._stopped

    def session(self) -> Session:
        async_session: AsyncSession = self.sessions(expire_on_commit=False)
        sync = async_session.sync_session
        # In the Session's own ``info``: both go together. (A WeakKeyDictionary's value held
        # its key through ``sync_session``, so every message's pair was kept forever.)
        sync.info[_ASYNC_SESSION] = async_session
        return sync

    def call(self, handler: Callable[..., Any], *args: Any) -> Any:
        # A transactional handler gets the AsyncSession around the core's Session.
        args = tuple(a.info.get(_ASYNC_SESSION, a) if isinstance(a, Session) else a for a in args)
        result = handler(*args)
        if inspect.isawaitable(result):
            try:
                result = await_only(result)
            except asyncio.CancelledError:
                if _cancelled_from_outside():
                    # Its consumer task was cancelled (the event loop shutting down cancels
                    # every task, run() among them, in no set order): a stop, not the
                    # handler's own failure. Its message is released, no attempt counted.
                    self.request_stop()
                raise
        # A plain result: the handler already ran to its end (awaiting it again would run
        # nothing twice). One that still holds work (a missing await) fails the attempt.
        return refuse_unrun(handler, result, awaits=True)

    def to_its_end(self, fn: Callable[[], Any]) -> Any:
        result: list[Any] = []

        async def work() -> None:
            result.append(await greenlet_spawn(fn))

        # The cancellations absorbed meanwhile: the caller is on its way out with the first.
        cancelled = await_only(_to_its_end(work()))
        if not result:  # ``work`` itself cancelled (not by the caller's task): not finished
            raise cancelled or asyncio.CancelledError()
        return result[0]

    def sleep(self, seconds: float) -> None:
        await_only(asyncio.sleep(seconds))

    def pause(self, seconds: float) -> None:
        await_only(self._pause(seconds))

    @property
    def drained(self) -> bool:
        return self._drained

    def mark_drained(self) -> None:
        self._drained = True

    async def _pause(self, seconds: float) -> None:
        if not self._stopped.done():
            await asyncio.wait([self._stopped], timeout=seconds)

    def caller(self) -> object:
        return asyncio.current_task(self.loop)

    def cut_by_stop(self, exc: BaseException) -> bool:
        return self.stopping and is_cancellation(exc) and _cancelled_from_outside()

    def generation(self) -> int:
        return self._generation

    def wait(self, seen: int, timeout: float) -> None:
        await_only(self._wait(seen, timeout))

    async def _wait(self, seen: int, timeout: float) -> None:
        if self._generation != seen or self._stopping:
            return
        wakeup: asyncio.Future[None] = self.loop.create_future()
        self._waiting.append(wakeup)
        try:
            await asyncio.wait([wakeup], timeout=timeout)
        finally:
            if not wakeup.done():  # timed out or cancelled: no longer a waiter to wake
                self._waiting.remove(wakeup)

    def notify(self, _key: str | None = None, count: int | None = None) -> None:
        self._soon(lambda: self._bump(count))

    def wake_idle(self, count: int) -> None:
        self._soon(lambda: self._lend(count))

    def _lend(self, count: int) -> None:
        hand_out(self._waiting, count, _resolve)

    def _bump(self, count: int | None) -> None:
        """Wake ``count`` waiters (every one when None), oldest first (see ``hand_out``)."""
        if hand_out(self._waiting, count, _resolve):
            self._generation += 1

    def _soon(self, fn: Callable[[], None]) -> None:
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(fn)


#: The workers each event loop's SIGTERM/SIGINT handler stops, and how to restore the handlers
#: the process had before the first of them started.
_signalled: dict[asyncio.AbstractEventLoop, tuple[set[AsyncWorker], contextlib.ExitStack]] = {}


@contextlib.contextmanager
def _stop_on_signals(loop: asyncio.AbstractEventLoop, worker: AsyncWorker) -> Iterator[None]:
    """SIGTERM and SIGINT stop ``worker``, and every other worker of ``loop`` running in such
    a block. An event loop has one handler per signal: each worker installing its own replaced
    the one before (a SIGTERM stopped only the last started), and the first to stop restored
    the process's handlers while the others still ran."""
    entry = _signalled.get(loop)
    if entry is None:
        restore = contextlib.ExitStack()
        restore.enter_context(
            stop_signals(
                lambda sig: loop.add_signal_handler(sig, _stop_every_worker, loop),
                loop.remove_signal_handler,
            )
        )
        entry = _signalled[loop] = (set(), restore)
    workers, restore = entry
    workers.add(worker)
    try:
        yield
    finally:
        workers.discard(worker)
        if not workers:
            del _signalled[loop]
            restore.close()


def _stop_every_worker(loop: asyncio.AbstractEventLoop) -> None:
    workers, _ = _signalled.get(loop, (set(), None))
    for worker in list(workers):
        worker.request_stop()


class AsyncWorker(BaseWorker[async_sessionmaker[AsyncSession]]):
    """Run ``async def`` handlers for one or more queues on ``concurrency`` tasks.

    The same configuration, modes, registrations (``register``, ``register_batch``,
    ``add_cron``), hooks, wake-ups, heartbeats and shutdown as
    :class:`~sqla_delayedq.worker.Worker`; ``sessions`` is an ``async_sessionmaker``. A
    transactional handler gets the ``AsyncSession`` of the transaction that takes and
    acknowledges its message. Hooks and periodic tasks (``add_hooks``, ``add_periodic``) may
    be ``async def`` or plain functions: an ``async def`` one is awaited.
    """

    default_name = "delayedq-async-worker"

    def _check_handler(self, handler: Any, where: str) -> None:
        check_async_handler(handler, where)

    def _check_callback(self, fn: Any, where: str) -> None:
        check_callback(fn, where, awaits=True)

    def _check_sessions(self, sessions: Any) -> None:
        if isinstance(sessions, sessionmaker):
            raise InvalidArgument(
                "AsyncWorker needs an async_sessionmaker (on an engine of "
                "sqla_delayedq.aio.create_async_engine), not a sessionmaker: for plain-function "
                "handlers on a sync engine use sqla_delayedq.worker.Worker"
            )

    def _side_sessions(self, fn: Callable[..., Any]) -> Callable[[], Any]:
        """An ``async def`` side task opens ``AsyncSession`` objects (``async with``); a plain
        one runs in the worker's greenlet, on the Sessions behind them."""
        if is_async_callable(fn):
            return functools.partial(self.sessions, expire_on_commit=False)
        return super()._side_sessions(fn)

    def _add(self, where: str, source: Any, handler: Any, **kwargs: Any) -> AsyncWorker:
        # An AsyncQueue is accepted wherever its DelayedQueue is.
        queue = source.queue if isinstance(source, AsyncQueue) else source
        return super()._add(where, queue, handler, **kwargs)

    async def run(self, *, install_signal_handlers: bool = True) -> bool:
        """Run until :meth:`request_stop` or SIGTERM/SIGINT; drain; True if all finished.

        Raises :class:`~sqla_delayedq.WorkerError` when the worker stopped on an error it must
        not retry (a bug, a missing table): it was logged with its traceback.
        """
        if install_signal_handlers:
            self._check_signal_thread()
        self._check_startable(once=True)
        loop = asyncio.get_running_loop()
        rt = AsyncRuntime(loop, self.sessions)
        self._rt = rt
        if self._stop_requested:
            rt.request_stop()
        handlers = (
            _stop_on_signals(loop, self) if install_signal_handlers else contextlib.nullcontext()
        )
        with handlers:
            unsubscribe = [subscribe(t, self._waiter(t)) for t in self._tables()]
            bind = self.sessions.kw.get("bind")
            listener = self._listener(bind, self._wake)
            side = [
                asyncio.create_task(greenlet_spawn(self._run_periodic, t))
                for t in self._side_tasks(bind)
            ]
            # Leases: lease mode's, and the takes of limited queues in transactional mode.
            side.append(asyncio.create_task(greenlet_spawn(self._heartbeat)))
            tasks = [asyncio.create_task(greenlet_spawn(self._consume)) for _ in self._slots()]
            log.info("%s started: %d tasks on %s", self.name, self.concurrency, self._tables())
            cancelled: asyncio.CancelledError | None = None
            try:
                try:
                    await rt.stopped()
                except asyncio.CancelledError as exc:
                    # run() itself was cancelled (a lifespan's or a task group's shutdown): stop
                    # as on a signal, then let the cancellation go on. Consumers left running
                    # would go on taking, with no heartbeat for their leases.
                    cancelled = exc
                    self.request_stop()
                try:
                    _, pending = await asyncio.wait(tasks, timeout=self.drain_timeout)
                except asyncio.CancelledError as exc:  # cancelled again while draining
                    cancelled = exc
                    pending = {t for t in tasks if not t.done()}
                # Whatever cancellation comes now (anyio's comes again at every await until
                # the task ends): cut short, the release left what handlers still held
                # leased under tokens nobody held, and the lease's end counted an attempt.
                cancelled = await _to_its_end(self._wind_down(rt, pending)) or cancelled
                log.info("%s stopped (%d tasks did not finish in time)", self.name, len(pending))
                if cancelled is not None:
                    raise cancelled
                self._raise_failure()
                return not pending
            finally:
                for t in tasks:  # whatever ended run(), no consumer outlives it
                    t.cancel()
                for t in side:
                    t.cancel()
                for fn in unsubscribe:
                    fn()
                # To its end: anyio cancels again at each await, which cut this short and
                # left the LISTEN thread and its connection running after run() returned.
                late = await _to_its_end(self._close_side(side, listener))
                if late is not None and cancelled is None:
                    raise late

    @staticmethod
    async def _close_side(side: list[asyncio.Task[Any]], listener: Listener | None) -> None:
        await asyncio.gather(*side, return_exceptions=True)
        if listener is not None:
            await asyncio.to_thread(listener.stop)

    async def _wind_down(self, rt: AsyncRuntime, pending: set[asyncio.Task[Any]]) -> None:
        """After the drain: cancel the consumers it left (each gives back what it took and
        has not started), release what handlers still hold, stop the periodic tasks. Each
        step is made again after a cancellation: ``asyncio.run``'s end cancels every task."""
        for t in pending:
            t.cancel()
        if pending:
            await _again_if_cancelled(lambda: asyncio.wait(pending))
        rt.mark_drained()  # the heartbeat kept the drained handlers' leases until now
        await _again_if_cancelled(lambda: greenlet_spawn(self._release_in_flight))
        await _again_if_cancelled(lambda: greenlet_spawn(self._stop_periodic))

    def _slots(self) -> range:
        return range(self.concurrency)

    async def process_due(self, limit: int | None = None) -> int:
        """Handle what is due now, on this task, and return how many were handled (see
        :meth:`Worker.process_due <sqla_delayedq.worker.Worker.process_due>`)."""
        self._check_startable()
        loop = asyncio.get_running_loop()
        # Lease-mode handlers that outlive half a lease need it extended here too.
        rt = self._due_enter(
            lambda: AsyncRuntime(loop, self.sessions),
            lambda: asyncio.create_task(greenlet_spawn(self._heartbeat)),
        )
        try:
            if not isinstance(rt, AsyncRuntime) or rt.loop is not loop:
                raise InvalidArgument(
                    f"{self.name}: process_due runs on another event loop; calls that run at "
                    "once share one loop"
                )
            count: int = await greenlet_spawn(self._process_due, limit)
        finally:
            beat = self._due_exit()
            if beat is not None:
                await asyncio.gather(beat, return_exceptions=True)
        return count
