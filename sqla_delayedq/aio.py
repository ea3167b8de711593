"""asyncio: queue operations on an ``AsyncSession``, and an asyncio worker.

:class:`AsyncQueue` wraps a :class:`~sqla_delayedq.DelayedQueue` and runs each operation on the
``AsyncSession``'s underlying Session (``run_sync``), so the statements, their round trips and
their guarantees are exactly those of the sync API, joined to the caller's async transaction::

    aq = AsyncQueue(DelayedQueue("emails"))
    async with async_session() as session, session.begin():
        session.add(user)
        await aq.offer(session, f"welcome/{user.id}", {"user_id": user.id})

:class:`AsyncWorker` runs ``async def`` handlers on ``concurrency`` tasks, with the same two
modes, wake-ups (``LISTEN`` through psycopg's async connection on PostgreSQL, in-process
wake-ups everywhere), lease heartbeats and graceful shutdown as the sync worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any, Generic, Literal, TypeVar

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from ._dialects import is_transient
from ._queue import DelayedQueue, OfferInput
from ._types import (
    Envelope,
    MessageFilter,
    MessageInfo,
    NackOutcome,
    OfferMode,
    OfferResult,
    QueueCounts,
)
from ._wakeup import channel_for, subscribe
from .errors import InvalidArgument
from .worker import WorkerHooks

__all__ = ["AsyncHandler", "AsyncQueue", "AsyncWorker"]

T = TypeVar("T")
log = logging.getLogger("sqla_delayedq.aio")

#: Lease mode: ``await handler(envelope)``; transactional: ``await handler(envelope, session)``.
AsyncHandler = Callable[..., Awaitable[Any]]


class AsyncQueue(Generic[T]):
    """The operations of ``queue`` on an ``AsyncSession``; none of them commits."""

    def __init__(self, queue: DelayedQueue[T]) -> None:
        self.queue = queue

    @property
    def name(self) -> str:
        return self.queue.name

    async def offer(
        self,
        session: AsyncSession,
        key: str | None,
        payload: T,
        at: datetime | None = None,
        *,
        mode: OfferMode | str = OfferMode.REPLACE,
    ) -> OfferResult:
        return await session.run_sync(lambda s: self.queue.offer(s, key, payload, at, mode=mode))

    async def offer_batch(
        self,
        session: AsyncSession,
        messages: Iterable[OfferInput],
        *,
        mode: OfferMode | str = OfferMode.REPLACE,
    ) -> list[OfferResult]:
        items = list(messages)
        return await session.run_sync(lambda s: self.queue.offer_batch(s, items, mode=mode))

    async def try_poll(
        self, session: AsyncSession, *, lease: timedelta | None = None
    ) -> Envelope[T] | None:
        return await session.run_sync(lambda s: self.queue.try_poll(s, lease=lease))

    async def try_poll_many(
        self, session: AsyncSession, n: int, *, lease: timedelta | None = None
    ) -> list[Envelope[T]]:
        return await session.run_sync(lambda s: self.queue.try_poll_many(s, n, lease=lease))

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

    async def release(self, session: AsyncSession, envelope: Envelope[Any]) -> bool:
        return await session.run_sync(lambda s: self.queue.release(s, envelope))

    async def extend(
        self, session: AsyncSession, envelope: Envelope[T], lease: timedelta | None = None
    ) -> Envelope[T] | None:
        return await session.run_sync(lambda s: self.queue.extend(s, envelope, lease))

    async def get(self, session: AsyncSession, key: str) -> MessageInfo | None:
        return await session.run_sync(lambda s: self.queue.get(s, key))

    async def contains(self, session: AsyncSession, key: str) -> bool:
        return await session.run_sync(lambda s: self.queue.contains(s, key))

    async def counts(self, session: AsyncSession) -> QueueCounts:
        return await session.run_sync(self.queue.counts)

    async def search(
        self, session: AsyncSession, where: MessageFilter | None = None, *, limit: int = 100
    ) -> list[MessageInfo]:
        return await session.run_sync(lambda s: self.queue.search(s, where, limit=limit))


@dataclass(frozen=True)
class _Registration:
    queue: AsyncQueue[Any]
    handler: AsyncHandler
    mode: Literal["lease", "transactional"]
    lease: timedelta
    handler_timeout: timedelta | None


class AsyncWorker:
    """Run ``async def`` handlers for one or more queues on ``concurrency`` tasks."""

    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        *,
        concurrency: int = 16,
        poll_interval: float = 5.0,
        batch_size: int = 1,
        listen: bool = True,
        drain_timeout: float = 30.0,
        hooks: WorkerHooks | None = None,
    ) -> None:
        if concurrency < 1 or poll_interval <= 0 or batch_size < 1:
            raise InvalidArgument("concurrency and batch_size must be >= 1, poll_interval > 0")
        self.sessions = sessions
        self.concurrency = concurrency
        self.poll_interval = poll_interval
        self.batch_size = batch_size
        self.listen = listen
        self.drain_timeout = drain_timeout
        self.hooks = hooks or WorkerHooks()
        self._registrations: list[_Registration] = []
        self._stopping = asyncio.Event()
        self._wake_future: asyncio.Future[None] | None = None
        self._in_flight: dict[int, tuple[_Registration, Envelope[Any], float]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    def register(
        self,
        queue: DelayedQueue[Any] | AsyncQueue[Any],
        handler: AsyncHandler,
        *,
        mode: Literal["lease", "transactional"] = "lease",
        lease: timedelta | None = None,
        handler_timeout: timedelta | None = None,
    ) -> AsyncWorker:
        if mode not in ("lease", "transactional"):
            raise InvalidArgument(f"unknown mode {mode!r}; use 'lease' or 'transactional'")
        aq = queue if isinstance(queue, AsyncQueue) else AsyncQueue(queue)
        self._registrations.append(
            _Registration(aq, handler, mode, lease or aq.queue.lease, handler_timeout)
        )
        return self

    def request_stop(self) -> None:
        self._stopping.set()
        self._bump()

    def _bump(self) -> None:
        """Wake every task waiting on the current generation (call on the loop's thread)."""
        fut, self._wake_future = self._wake_future, None
        if fut is not None and not fut.done():
            fut.set_result(None)

    def _generation(self) -> asyncio.Future[None]:
        if self._wake_future is None:
            self._wake_future = asyncio.get_running_loop().create_future()
        return self._wake_future

    def _notify(self, _queue: str | None = None) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._bump)

    async def run(self, *, install_signal_handlers: bool = True) -> bool:
        """Run until :meth:`request_stop` or SIGTERM/SIGINT; drain; True if all finished."""
        if not self._registrations:
            raise InvalidArgument("register at least one queue before running the worker")
        self._loop = asyncio.get_running_loop()
        if install_signal_handlers:
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._loop.add_signal_handler(sig, self.request_stop)
        tables = {r.queue.queue.table.name for r in self._registrations}
        unsubscribe = [subscribe(t, self._notify) for t in tables]
        side: list[asyncio.Task[None]] = []
        engine = self.sessions.kw.get("bind")
        if self.listen and engine is not None and engine.dialect.name == "postgresql":
            side.append(asyncio.create_task(self._listen(engine, sorted(tables))))
        side.append(asyncio.create_task(self._heartbeat()))
        tasks = [asyncio.create_task(self._task()) for _ in range(self.concurrency)]
        try:
            await self._stopping.wait()
            _, pending = await asyncio.wait(tasks, timeout=self.drain_timeout)
            for reg, env, _ in list(self._in_flight.values()):
                await self._settle(reg, env, functools.partial(reg.queue.release, envelope=env))
            for t in pending:
                t.cancel()
            return not pending
        finally:
            for t in side:
                t.cancel()
            for t in side:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
            for fn in unsubscribe:
                fn()
            if install_signal_handlers:
                for sig in (signal.SIGTERM, signal.SIGINT):
                    self._loop.remove_signal_handler(sig)

    async def _task(self) -> None:
        errors = 0
        while not self._stopping.is_set():
            seen = self._generation()
            try:
                worked, next_due = await self._poll_all()
                errors = 0
            except Exception as exc:
                errors += 1
                self.hooks.db_error(exc)
                log.warning(
                    "database error in async worker (transient=%s): %s", is_transient(exc), exc
                )
                await asyncio.sleep(min(0.05 * 2**errors, 5.0))
                continue
            if worked:
                continue
            timeout = self.poll_interval if next_due is None else min(self.poll_interval, next_due)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(seen), timeout)

    async def _poll_all(self) -> tuple[bool, float | None]:
        next_due: float | None = None
        for reg in self._registrations:
            if self._stopping.is_set():
                return True, None
            once = self._lease_once if reg.mode == "lease" else self._transactional_once
            if await once(reg):
                return True, None
            due = await self._next_due(reg)
            if due is not None:
                next_due = due if next_due is None else min(next_due, due)
        return False, next_due

    async def _next_due(self, reg: _Registration) -> float | None:
        q = reg.queue.queue
        now = q.now()
        t = q.table
        stmt = select(func.min(t.c.scheduled_at)).where(t.c.queue == q.name, t.c.scheduled_at > now)
        async with self.sessions() as s:
            when: datetime | None = (await s.execute(stmt)).scalar()
        return None if when is None else max(0.0, (when - now).total_seconds())

    def _observe(self, reg: _Registration, env: Envelope[Any]) -> None:
        if env.redelivered:
            self.hooks.redelivered(reg.queue.name, env)
        self.hooks.lag(reg.queue.name, (reg.queue.queue.now() - env.scheduled_at).total_seconds())

    async def _settle(
        self, reg: _Registration, env: Envelope[Any], op: Callable[[AsyncSession], Awaitable[Any]]
    ) -> Any:
        deadline = time.monotonic() + max(reg.lease.total_seconds(), 1.0)
        delay = 0.05
        while True:
            try:
                async with self.sessions() as s, s.begin():
                    return await op(s)
            except Exception as exc:
                self.hooks.db_error(exc)
                if time.monotonic() > deadline:
                    log.error(
                        "giving up settling %s/%s; its lease will expire", reg.queue.name, env.key
                    )
                    return None
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

    async def _lease_once(self, reg: _Registration) -> bool:
        async with self.sessions() as s, s.begin():
            envs = await reg.queue.try_poll_many(s, self.batch_size, lease=reg.lease)
        for env in envs:
            self._in_flight[env.id] = (reg, env, time.monotonic())
        for env in envs:
            try:
                if self._stopping.is_set():
                    await self._settle(reg, env, functools.partial(reg.queue.release, envelope=env))
                    continue
                self._observe(reg, env)
                started = time.monotonic()
                try:
                    await reg.handler(env)
                except Exception as exc:
                    cur = self._in_flight.get(env.id, (reg, env, 0.0))[1]
                    outcome = await self._settle(
                        reg, cur, functools.partial(reg.queue.nack, envelope=cur, error=exc)
                    )
                    self.hooks.failed(reg.queue.name, env, exc, outcome or NackOutcome.STALE)
                else:
                    cur = self._in_flight.get(env.id, (reg, env, 0.0))[1]
                    if await self._settle(reg, cur, functools.partial(reg.queue.ack, envelope=cur)):
                        self.hooks.processed(reg.queue.name, env, time.monotonic() - started)
            finally:
                self._in_flight.pop(env.id, None)
        return bool(envs)

    async def _transactional_once(self, reg: _Registration) -> bool:
        """The async form of :meth:`DelayedQueue.process_one`: one transaction per message."""
        q = reg.queue.queue
        failure: tuple[BaseException, NackOutcome] | None = None
        async with self.sessions() as session, session.begin():
            if self._stopping.is_set():
                return False
            taken = await session.run_sync(lambda s: q._consume_rows(s, 1))
            if not taken:
                return False
            env, row = taken[0]
            self._observe(reg, env)
            started = time.monotonic()
            try:
                async with session.begin_nested():
                    await reg.handler(env, session)
            except Exception as exc:
                if is_transient(exc):
                    raise
                outcome = await session.run_sync(q._put_back_failed, env, row, exc)
                failure = (exc, outcome)
        if failure is None:
            self.hooks.processed(reg.queue.name, env, time.monotonic() - started)
        else:
            self.hooks.failed(reg.queue.name, env, *failure)
        return True

    async def _heartbeat(self) -> None:
        while not self._stopping.is_set():
            await asyncio.sleep(0.5)
            now = time.monotonic()
            for env_id, (reg, env, started) in list(self._in_flight.items()):
                remaining = (env.lease_until - reg.queue.queue.now()).total_seconds()
                if remaining > reg.lease.total_seconds() / 2:
                    continue
                if (
                    reg.handler_timeout is not None
                    and now - started > reg.handler_timeout.total_seconds()
                ):
                    continue
                try:
                    async with self.sessions() as s, s.begin():
                        longer = await reg.queue.extend(s, env, reg.lease)
                except Exception as exc:
                    self.hooks.db_error(exc)
                    continue
                if longer is not None and env_id in self._in_flight:
                    self._in_flight[env_id] = (
                        reg,
                        replace(env, lease_until=longer.lease_until),
                        started,
                    )

    async def _listen(self, engine: Any, tables: list[str]) -> None:
        import psycopg

        url = engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
        backoff = 0.1
        while not self._stopping.is_set():
            try:
                conn = await psycopg.AsyncConnection.connect(url, autocommit=True)
            except Exception as exc:
                log.warning("LISTEN connection failed (%s); polling covers meanwhile", exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            backoff = 0.1
            try:
                for table in tables:
                    await conn.execute(f'LISTEN "{channel_for(table)}"')
                self._bump()
                async for _ in conn.notifies():
                    self._bump()
            except Exception as exc:
                log.warning("LISTEN connection lost (%s); reconnecting", exc)
            finally:
                with contextlib.suppress(Exception):
                    await conn.close()
