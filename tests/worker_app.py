"""A worker program for the fault tests, and the handlers it runs.

Run it as ``python -m tests.worker_app URL --mode lease|transactional [options]``: it builds its
engine with :func:`sqla_delayedq.create_engine`, registers one handler on one queue and calls
:meth:`Worker.run`, which handles SIGTERM/SIGINT by draining. On exit it prints one JSON line
with its hook counts and exits 0 when every in-flight handler finished within the drain timeout
(3 otherwise).

``--runtime asyncio`` runs an :class:`~sqla_delayedq.aio.AsyncWorker` instead (on the backend's
asyncio driver; handlers are ``async def``), and ``--source entities`` consumes the entity queue
of the ``wk_jobs`` table (:class:`Job`, with ``EntityQueueMixin``) instead of a message queue.

The handlers leave evidence in two tables of the test database (see :data:`metadata`):

- ``wk_deliveries``: one row per handled delivery, with the envelope's key, lock token,
  delivery kind and attempt, the process id and the handler's start and finish times
  (``time.time()``). In transactional mode the row is written through the handler's Session,
  so it commits with the message's removal or not at all; in lease mode it is written in a
  transaction of its own after the work, retried on database errors and made idempotent by a
  per-invocation ``run_id``, so a row appears once per handler run, whatever the connection does.
- ``wk_marks`` (with ``--marks``): a row when a handler starts, committed at once on another
  connection, so a test sees that a handler is running before it kills or stops the process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

from sqla_delayedq import (
    DelayedQueue,
    EntityQueue,
    EntityQueueMixin,
    Envelope,
    ExponentialBackoff,
    NackOutcome,
    create_engine,
)
from sqla_delayedq.worker import Worker, WorkerHooks

metadata = sa.MetaData()


class _JobBase(DeclarativeBase):
    metadata = metadata


class Job(EntityQueueMixin, _JobBase):
    """The entity source: one row per job, keyed like a message."""

    __tablename__ = "wk_jobs"

    id: Mapped[int] = mapped_column(
        sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True
    )
    key: Mapped[str] = mapped_column(sa.String(200), unique=True)
    sleep: Mapped[float | None] = mapped_column(sa.Float(), nullable=True)


deliveries = sa.Table(
    "wk_deliveries",
    metadata,
    sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True),
    sa.Column("queue", sa.String(100), nullable=False),
    sa.Column("key", sa.String(200), nullable=False),
    #: One handler invocation (the lock token cannot be used: transactional takes have none).
    sa.Column("run_id", sa.String(32), nullable=False),
    sa.Column("lock_token", sa.String(64), nullable=True),
    sa.Column("delivery", sa.String(16), nullable=False),
    sa.Column("attempt", sa.Integer, nullable=False),
    sa.Column("pid", sa.Integer, nullable=False),
    sa.Column("started_at", sa.Float(precision=53), nullable=False),
    sa.Column("finished_at", sa.Float(precision=53), nullable=True),
    sa.Index("ix_wk_deliveries_key", "key"),
    sa.Index("ix_wk_deliveries_run_id", "run_id"),
)

marks = sa.Table(
    "wk_marks",
    metadata,
    sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True),
    sa.Column("key", sa.String(200), nullable=False),
    sa.Column("run_id", sa.String(32), nullable=False),
    sa.Column("pid", sa.Integer, nullable=False),
    sa.Column("at", sa.Float(precision=53), nullable=False),
)


@dataclass
class Config:
    engine: Engine
    queue: str
    sleep: float = 0.0
    marks: bool = False


CONFIG: Config | None = None


def _config() -> Config:
    if CONFIG is None:
        raise RuntimeError("tests.worker_app handlers run only inside its main()")
    return CONFIG


def with_retries(fn: Any, what: str, attempts: int = 200) -> Any:
    """Run ``fn(attempt)`` until it returns, retrying database errors with backoff.

    Any ``DBAPIError`` is retried, not only those ``is_transient`` knows: while a server
    restarts, new connections are refused, which is not a transient error of a transaction.
    """
    for attempt in range(attempts):
        try:
            return fn(attempt)
        except sa.exc.DBAPIError as exc:
            if attempt == attempts - 1:
                raise
            logging.getLogger("worker_app").warning("%s failed, retrying: %s", what, exc)
            time.sleep(min(0.02 * 2**attempt, 1.0))
    raise AssertionError("unreachable")


def key_of(env: Envelope[Any]) -> str:
    """The job's key: a message's own, or an entity's ``key`` column."""
    return env.payload.key if isinstance(env.payload, Job) else env.key


def _delivery_row(env: Envelope[Any], run_id: str, started: float) -> dict[str, Any]:
    return {
        "queue": env.queue,
        "key": key_of(env),
        "run_id": run_id,
        "lock_token": env.lock_token or None,
        "delivery": env.delivery.value,
        "attempt": env.attempt,
        "pid": os.getpid(),
        "started_at": started,
    }


def _mark(env: Envelope[Any], run_id: str, started: float) -> None:
    cfg = _config()
    row = {"key": key_of(env), "run_id": run_id, "pid": os.getpid(), "at": started}

    def write(_attempt: int) -> None:
        with cfg.engine.begin() as conn:
            conn.execute(marks.insert(), row)

    with_retries(write, "mark")


def sleep_of(env: Envelope[Any]) -> float:
    """How long this job's handler works: the payload's ``sleep``, else ``--sleep``."""
    if isinstance(env.payload, dict) and "sleep" in env.payload:
        return float(env.payload["sleep"])
    if isinstance(env.payload, Job) and env.payload.sleep is not None:
        return float(env.payload.sleep)
    return _config().sleep


def _sleep(env: Envelope[Any]) -> None:
    seconds = sleep_of(env)
    if seconds:
        time.sleep(seconds)


def lease_handler(env: Envelope[Any]) -> None:
    """Lease mode: work, then record the delivery in a transaction of its own."""
    cfg = _config()
    started, run_id = time.time(), uuid.uuid4().hex
    if cfg.marks:
        _mark(env, run_id, started)
    _sleep(env)
    row = {**_delivery_row(env, run_id, started), "finished_at": time.time()}

    def record(attempt: int) -> None:
        with cfg.engine.begin() as conn:
            if attempt:  # the earlier attempt may have committed before its connection died
                seen = sa.select(deliveries.c.id).where(deliveries.c.run_id == run_id)
                if conn.execute(seen).first() is not None:
                    return
            conn.execute(deliveries.insert(), row)

    with_retries(record, "recording a delivery")


def transactional_handler(env: Envelope[Any], session: Session) -> None:
    """Transactional mode: the delivery row is written first, through the worker's Session.

    A start mark follows on another connection, so once the mark is visible the row is
    written in the still-open transaction: a test that kills the process then proves that
    the killed attempt's writes were rolled back.
    """
    run_id = transactional_start(env, session)
    _sleep(env)
    transactional_finish(run_id, session)


def transactional_start(env: Envelope[Any], session: Session) -> str:
    cfg = _config()
    started, run_id = time.time(), uuid.uuid4().hex
    session.execute(deliveries.insert(), _delivery_row(env, run_id, started))
    if cfg.marks:
        _mark(env, run_id, started)
    return run_id


def transactional_finish(run_id: str, session: Session) -> None:
    session.execute(
        deliveries.update().where(deliveries.c.run_id == run_id).values(finished_at=time.time())
    )


async def async_lease_handler(env: Envelope[Any]) -> None:
    await asyncio.to_thread(lease_handler, env)


async def async_transactional_handler(env: Envelope[Any], session: Any) -> None:
    """The transactional handler on the asyncio worker: its writes go through the
    transaction's AsyncSession, and its work awaits instead of blocking the event loop."""
    run_id = await session.run_sync(lambda s: transactional_start(env, s))
    seconds = sleep_of(env)
    if seconds:
        await asyncio.sleep(seconds)
    await session.run_sync(lambda s: transactional_finish(run_id, s))


class CountingHooks(WorkerHooks):
    """Counts of what the worker reported, printed as JSON when the program exits."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def _add(self, name: str) -> None:
        with self._lock:
            self.counts[name] += 1

    def processed(self, queue: str, envelope: Envelope[Any], seconds: float) -> None:
        self._add("processed")

    def failed(
        self, queue: str, envelope: Envelope[Any], error: BaseException, outcome: NackOutcome
    ) -> None:
        self._add(f"failed_{outcome.value}")

    def redelivered(self, queue: str, envelope: Envelope[Any]) -> None:
        self._add("redelivered")

    def db_error(self, error: BaseException) -> None:
        self._add("db_error")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tests.worker_app", description=__doc__)
    p.add_argument("url", help="SQLAlchemy URL of the database (password included)")
    p.add_argument("--queue", default="work")
    p.add_argument("--mode", choices=("lease", "transactional"), default="lease")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--poll", type=float, default=0.5, help="poll interval, seconds")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--lease", type=float, default=30.0, help="seconds")
    p.add_argument("--handler-timeout", type=float, default=None, help="seconds")
    p.add_argument("--no-listen", action="store_true", help="do not LISTEN on PostgreSQL")
    p.add_argument("--drain", type=float, default=10.0, help="drain timeout, seconds")
    p.add_argument("--sleep", type=float, default=0.0, help="seconds each handler sleeps")
    p.add_argument("--marks", action="store_true", help="record handler starts in wk_marks")
    p.add_argument("--log-level", default="WARNING")
    p.add_argument("--runtime", choices=("thread", "asyncio"), default="thread")
    p.add_argument("--source", choices=("messages", "entities"), default="messages")
    p.add_argument("--max-attempts", type=int, default=100)
    return p.parse_args(argv)


ASYNC_DRIVERS = {"postgresql": "postgresql+psycopg", "mysql": "mysql+aiomysql"}


def main(argv: list[str] | None = None) -> int:
    global CONFIG
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level,
        stream=sys.stderr,
        format="%(asctime)s %(process)d %(threadName)s %(levelname)s %(name)s: %(message)s",
    )
    engine = create_engine(args.url, pool_size=args.concurrency + 4, max_overflow=8)
    CONFIG = Config(engine, args.queue, sleep=args.sleep, marks=args.marks)
    lease = timedelta(seconds=args.lease)
    retry = ExponentialBackoff(max_attempts=args.max_attempts, initial=timedelta(milliseconds=100))
    queue: Any = (
        EntityQueue(Job, lease=lease, retry=retry)
        if args.source == "entities"
        else DelayedQueue(args.queue, lease=lease, retry=retry)
    )
    hooks = CountingHooks()
    options: dict[str, Any] = {
        "concurrency": args.concurrency,
        "poll_interval": args.poll,
        "batch_size": args.batch,
        "listen": not args.no_listen,
        "drain_timeout": args.drain,
        "hooks": hooks,
        "name": f"wk-{os.getpid()}",
    }
    registration: dict[str, Any] = {
        "mode": args.mode,
        "lease": lease,
        "handler_timeout": None
        if args.handler_timeout is None
        else timedelta(seconds=args.handler_timeout),
    }
    print(json.dumps({"event": "starting", "pid": os.getpid()}), flush=True)
    if args.runtime == "asyncio":
        drained = asyncio.run(run_async(args, queue, options, registration))
    else:
        worker = Worker(sessionmaker(engine), **options)
        handler = lease_handler if args.mode == "lease" else transactional_handler
        worker.register(queue, handler, **registration)
        drained = worker.run()
    print(json.dumps({"event": "stopped", "drained": drained, **hooks.counts}), flush=True)
    engine.dispose()
    return 0 if drained else 3


async def run_async(
    args: argparse.Namespace, queue: Any, options: dict[str, Any], registration: dict[str, Any]
) -> bool:
    from sqlalchemy.ext.asyncio import async_sessionmaker

    from sqla_delayedq.aio import AsyncWorker, create_async_engine

    url = sa.make_url(args.url)
    url = url.set(drivername=ASYNC_DRIVERS[url.get_backend_name()])
    engine = create_async_engine(url, pool_size=args.concurrency + 4, max_overflow=8)
    try:
        worker = AsyncWorker(async_sessionmaker(engine), **options)
        handler = async_lease_handler if args.mode == "lease" else async_transactional_handler
        worker.register(queue, handler, **registration)
        return await worker.run()
    finally:
        await engine.dispose()


if __name__ == "__main__":
    sys.exit(main())
