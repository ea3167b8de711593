"""Workers for the worker suite, as a pytest plugin: the same test runs on both workers.

``make_worker(backend, **options)`` builds a :class:`~sqla_delayedq.worker.Worker`, or an
:class:`~sqla_delayedq.aio.AsyncWorker` on the backend's asyncio driver running in a thread of
its own, behind one interface (``register``, ``register_batch``, ``start``, ``stop``). The test
bodies write plain handlers; for the asyncio worker they are wrapped the way a user would call
blocking code from ``async def``: lease-mode handlers run in a thread (``asyncio.to_thread``),
transactional ones on the transaction's Session (``AsyncSession.run_sync``).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any, cast

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from sqla_delayedq import TransientError
from sqla_delayedq.aio import AsyncWorker, create_async_engine
from sqla_delayedq.worker import Worker
from tests.fix_db import ASYNC_DRIVERS, Backend

WORKER_KINDS = ("thread", "asyncio")


def as_async(handler: Callable[..., Any], mode: str) -> Callable[..., Any]:
    if mode == "transactional":

        async def transactional(envelope: Any, session: Any) -> Any:
            return await session.run_sync(lambda s: handler(envelope, s))

        return transactional

    async def lease(envelope: Any) -> Any:
        return await asyncio.to_thread(handler, envelope)

    return lease


class AsyncRunner:
    """An AsyncWorker on its own event loop thread, driven like a thread Worker."""

    def __init__(self, backend: Backend, **options: Any) -> None:
        from sqlalchemy.ext.asyncio import async_sessionmaker

        url = backend.url.set(drivername=ASYNC_DRIVERS[backend.name.split("-")[0]])
        self.engine = create_async_engine(url, poolclass=sa.NullPool)
        self.worker = AsyncWorker(async_sessionmaker(self.engine), **options)
        self._thread: threading.Thread | None = None
        self.result: bool | None = None
        self.error: BaseException | None = None

    @property
    def hooks(self) -> Any:
        return self.worker.hooks

    def register(self, queue: Any, handler: Callable[..., Any], **kw: Any) -> AsyncRunner:
        self.worker.register(queue, as_async(handler, kw.get("mode", "lease")), **kw)
        return self

    def register_batch(self, queue: Any, handler: Callable[..., Any], **kw: Any) -> AsyncRunner:
        self.worker.register_batch(queue, as_async(handler, "lease"), **kw)
        return self

    def start(self) -> None:
        def main() -> None:
            try:
                self.result = asyncio.run(self._run())
            except BaseException as exc:
                self.error = exc

        self._thread = threading.Thread(target=main, name="async-worker", daemon=True)
        self._thread.start()

    async def _run(self) -> bool:
        try:
            return await self.worker.run(install_signal_handlers=False)
        finally:
            await self.engine.dispose()

    def request_stop(self) -> None:
        self.worker.request_stop()

    def process_due(self, limit: int | None = None) -> int:
        """The asyncio worker's ``process_due`` on an event loop of the calling thread's own."""
        return asyncio.run(self.worker.process_due(limit))

    def stop(self, drain_timeout: float | None = None) -> bool:
        if drain_timeout is not None:
            self.worker.drain_timeout = drain_timeout
        self.worker.request_stop()
        assert self._thread is not None
        self._thread.join((drain_timeout or self.worker.drain_timeout) + 10)
        if self.error is not None:
            raise self.error
        return bool(self.result)


def make_thread_worker(backend: Backend, **options: Any) -> Worker:
    return Worker(backend.Session, **options)


@pytest.fixture(params=WORKER_KINDS)
def make_worker(request: pytest.FixtureRequest) -> Callable[..., Any]:
    """``make_worker(backend, **options)``: each kind of worker in turn."""
    if request.param == "thread":
        return make_thread_worker
    return AsyncRunner


def waiting(worker: Any) -> int:
    """How many of the worker's consumers wait for a wake-up (each took, and found its fill):
    what a test waits for before it counts, rather than guessing with a sleep."""
    rt = getattr(worker, "worker", worker)._rt
    return 0 if rt is None else len(rt._waiting)


def stopped_by(worker: Any, until: Callable[[], bool], timeout: float = 30) -> BaseException | None:
    """Start ``worker``, wait for ``until`` and for the worker to stop on its own, stop it, and
    return what stopped it (the thread worker's ``failure``; the asyncio worker's ``run()``
    raises it as a ``WorkerError``'s cause)."""
    import time

    from sqla_delayedq import WorkerError

    def wait(condition: Callable[[], bool]) -> bool:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    worker.start()
    try:
        assert wait(until)
        assert wait(lambda: getattr(worker, "worker", worker).stopping)
    finally:
        try:
            worker.stop(5)
            error = getattr(worker, "worker", worker).failure
        except WorkerError as exc:
            error = exc.__cause__
    return error


@contextlib.contextmanager
def running(worker: Any, drain_timeout: float = 10.0) -> Iterator[Any]:
    worker.start()
    try:
        yield worker
    finally:
        worker.stop(drain_timeout)


@contextlib.contextmanager
def losing_a_commit_reply(which: Callable[[Session], bool]) -> Iterator[list[bool]]:
    """Lose the reply of the next commit ``which`` picks once armed (append True to the list
    yielded): the commit happens, then the error a dropped connection raises is injected. Not
    a savepoint's release (the controls are read in one), which fires the event too."""
    from sqla_delayedq._consumer import AloneSession

    armed: list[bool] = []

    def lose_the_reply(session: Session) -> None:
        if session.in_nested_transaction():
            return
        if armed and which(session) and armed.pop():
            raise TransientError("injected: the connection was lost after COMMIT")

    # Statements that commit on their own run on an AloneSession, whose commit only sends what
    # they announced: the reply lost there is a failure after the statement returned.
    real_commit = AloneSession.commit

    def commit_alone(self: AloneSession) -> None:
        real_commit(self)
        if armed and which(cast(Session, self)) and armed.pop():
            raise TransientError("injected: the connection was lost after the statement")

    sa.event.listen(Session, "after_commit", lose_the_reply)
    AloneSession.commit = commit_alone  # type: ignore[method-assign]
    try:
        yield armed
    finally:
        sa.event.remove(Session, "after_commit", lose_the_reply)
        AloneSession.commit = real_commit  # type: ignore[method-assign]
