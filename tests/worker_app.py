"""A worker program for the fault tests, and the handlers it runs.

Run it as ``python -m tests.worker_app URL --mode lease|transactional [options]``: it builds its
engine with :func:`sqla_delayedq.create_engine`, registers one handler on one queue and calls
:meth:`Worker.run`, which handles SIGTERM/SIGINT by draining. On exit it prints one JSON line
with its hook counts and exits 0 when every in-flight handler finished within the drain timeout
(3 otherwise).

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
from sqlalchemy.orm import Session, sessionmaker

from sqla_delayedq import DelayedQueue, Envelope, ExponentialBackoff, NackOutcome, create_engine
from sqla_delayedq.worker import Worker, WorkerHooks

metadata = sa.MetaData()

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


def _delivery_row(env: Envelope[Any], run_id: str, started: float) -> dict[str, Any]:
    return {
        "queue": env.queue,
        "key": env.key,
        "run_id": run_id,
        "lock_token": env.lock_token or None,
        "delivery": env.delivery.value,
        "attempt": env.attempt,
        "pid": os.getpid(),
        "started_at": started,
    }


def _mark(env: Envelope[Any], run_id: str, started: float) -> None:
    cfg = _config()
    row = {"key": env.key, "run_id": run_id, "pid": os.getpid(), "at": started}

    def write(_attempt: int) -> None:
        with cfg.engine.begin() as conn:
            conn.execute(marks.insert(), row)

    with_retries(write, "mark")


def _sleep(env: Envelope[Any]) -> None:
    cfg = _config()
    seconds = cfg.sleep
    if isinstance(env.payload, dict) and "sleep" in env.payload:
        seconds = float(env.payload["sleep"])
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
    cfg = _config()
    started, run_id = time.time(), uuid.uuid4().hex
    session.execute(deliveries.insert(), _delivery_row(env, run_id, started))
    if cfg.marks:
        _mark(env, run_id, started)
    _sleep(env)
    session.execute(
        deliveries.update().where(deliveries.c.run_id == run_id).values(finished_at=time.time())
    )


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
    return p.parse_args(argv)


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
    queue: DelayedQueue[Any] = DelayedQueue(
        args.queue,
        lease=timedelta(seconds=args.lease),
        retry=ExponentialBackoff(max_attempts=100, initial=timedelta(milliseconds=100)),
    )
    hooks = CountingHooks()
    worker = Worker(
        sessionmaker(engine),
        concurrency=args.concurrency,
        poll_interval=args.poll,
        batch_size=args.batch,
        listen=not args.no_listen,
        drain_timeout=args.drain,
        hooks=hooks,
        name=f"wk-{os.getpid()}",
    )
    handler = lease_handler if args.mode == "lease" else transactional_handler
    worker.register(
        queue,
        handler,
        mode=args.mode,
        lease=timedelta(seconds=args.lease),
        handler_timeout=None
        if args.handler_timeout is None
        else timedelta(seconds=args.handler_timeout),
    )
    print(json.dumps({"event": "starting", "pid": os.getpid()}), flush=True)
    drained = worker.run()
    print(json.dumps({"event": "stopped", "drained": drained, **hooks.counts}), flush=True)
    engine.dispose()
    return 0 if drained else 3


if __name__ == "__main__":
    sys.exit(main())
