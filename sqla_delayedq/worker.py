"""The sync worker: threads that take messages, run handlers and settle them.

Two consumption modes (DESIGN §4):

- ``"lease"`` (at-least-once): take and commit at once, run the handler outside any
  transaction, ack in a new one. A crash means redelivery after the lease. Leases of long
  handlers are extended by a heartbeat until ``handler_timeout``.
- ``"transactional"`` (effectively exactly-once for database side effects): take, run the
  handler with the Session and remove the message in one transaction (seed 002's delete-on-take);
  the handler's writes commit with the removal. A failing handler's writes are rolled back to a
  savepoint and the failed attempt is recorded in the same transaction, so the message waits for
  its retry time; a crash rolls everything back and the message is due again at once.

Idle threads sleep until the poll interval, the next due time, or a wake-up: ``NOTIFY`` on
PostgreSQL (sent by offers on commit) and in-process wake-ups on every backend. Transient
database errors are logged and retried with backoff; the worker keeps running.
"""

from __future__ import annotations

import functools
import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Literal

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from ._dialects import is_transient
from ._queue import DelayedQueue
from ._types import Envelope, NackOutcome
from ._wakeup import channel_for, subscribe
from .errors import InvalidArgument

if TYPE_CHECKING:
    from .cron import CronService

__all__ = ["Handler", "Mode", "Worker", "WorkerHooks"]

log = logging.getLogger("sqla_delayedq.worker")

Mode = Literal["lease", "transactional"]
#: Lease mode: ``handler(envelope)``; transactional mode: ``handler(envelope, session)``.
Handler = Callable[..., Any]


class WorkerHooks:
    """Metrics and logging hooks; subclass and override what you need. Must not raise."""

    def processed(self, queue: str, envelope: Envelope[Any], seconds: float) -> None:
        """A handler returned and the message was acknowledged."""

    def failed(
        self, queue: str, envelope: Envelope[Any], error: BaseException, outcome: NackOutcome
    ) -> None:
        """A handler raised; ``outcome`` says whether a retry was scheduled or it died."""

    def redelivered(self, queue: str, envelope: Envelope[Any]) -> None:
        """A message was taken again after a lease ran out."""

    def lag(self, queue: str, seconds: float) -> None:
        """How late a message was taken, relative to its due time."""

    def db_error(self, error: BaseException) -> None:
        """A database error interrupted polling or settling (it is retried)."""


@dataclass(frozen=True)
class _Registration:
    queue: DelayedQueue[Any]
    handler: Handler
    mode: Mode
    lease: timedelta
    handler_timeout: timedelta | None
    #: Messages per take for batch handlers (``handler(envelopes)``); None for one at a time.
    batch: int | None = None


class _Wakeup:
    """Generation counter plus condition: waiters wake on any change since they looked."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._generation = 0

    def generation(self) -> int:
        with self._cond:
            return self._generation

    def notify(self, _queue: str | None = None) -> None:
        with self._cond:
            self._generation += 1
            self._cond.notify_all()

    def wait(self, seen: int, timeout: float) -> None:
        with self._cond:
            if self._generation == seen:
                self._cond.wait(timeout)


class _InFlight:
    """Envelopes being handled in lease mode, for the heartbeat and for shutdown."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: dict[int, tuple[_Registration, Envelope[Any], float]] = {}

    def add(self, reg: _Registration, *envs: Envelope[Any]) -> None:
        started = time.monotonic()
        with self._lock:
            for env in envs:
                self._items[env.id] = (reg, env, started)

    def replace(self, env: Envelope[Any]) -> None:
        with self._lock:
            if env.id in self._items:
                reg, _, started = self._items[env.id]
                self._items[env.id] = (reg, env, started)

    def current(self, env: Envelope[Any]) -> Envelope[Any]:
        return self.current_all([env])[0]

    def current_all(self, envs: list[Envelope[Any]]) -> list[Envelope[Any]]:
        """The envelopes as the heartbeat last extended them (or as given)."""
        with self._lock:
            items = self._items
            return [env if (item := items.get(env.id)) is None else item[1] for env in envs]

    def pop(self, *envs: Envelope[Any]) -> None:
        with self._lock:
            for env in envs:
                self._items.pop(env.id, None)

    def snapshot(self) -> list[tuple[_Registration, Envelope[Any], float]]:
        with self._lock:
            return list(self._items.values())


class Worker:
    """Run handlers for one or more queues on ``concurrency`` threads.

    :param sessions: a ``sessionmaker`` bound to the queue's database.
    :param concurrency: handler threads.
    :param poll_interval: the longest an idle thread sleeps between polls (seconds).
    :param batch_size: messages taken per poll in lease mode (each is acked on its own).
    :param listen: on PostgreSQL, ``LISTEN`` for offers committed elsewhere.
    :param drain_timeout: on stop, how long in-flight handlers may run before their messages
        are released.
    """

    def __init__(
        self,
        sessions: sessionmaker[Session],
        *,
        concurrency: int = 4,
        poll_interval: float = 5.0,
        batch_size: int = 1,
        listen: bool = True,
        drain_timeout: float = 30.0,
        hooks: WorkerHooks | None = None,
        name: str = "delayedq-worker",
    ) -> None:
        if concurrency < 1:
            raise InvalidArgument(f"concurrency must be >= 1, got {concurrency}")
        if poll_interval <= 0:
            raise InvalidArgument(f"poll_interval must be > 0, got {poll_interval}")
        if batch_size < 1:
            raise InvalidArgument(f"batch_size must be >= 1, got {batch_size}")
        self.sessions = sessions
        self.concurrency = concurrency
        self.poll_interval = poll_interval
        self.batch_size = batch_size
        self.listen = listen
        self.drain_timeout = drain_timeout
        self.hooks = hooks or WorkerHooks()
        self.name = name
        self._registrations: list[_Registration] = []
        self._wakeup = _Wakeup()
        self._stopping = threading.Event()
        self._in_flight = _InFlight()
        self._idle = threading.local()
        self._threads: list[threading.Thread] = []
        self._cleanup: list[Callable[[], Any]] = []
        self._crons: list[tuple[CronService, timedelta | float | None]] = []
        self._started = False

    # -- configuration -------------------------------------------------------------------

    def register(
        self,
        queue: DelayedQueue[Any],
        handler: Handler,
        *,
        mode: Mode = "lease",
        lease: timedelta | None = None,
        handler_timeout: timedelta | None = None,
    ) -> Worker:
        """Handle messages of ``queue`` with ``handler`` in the given mode."""
        if mode not in ("lease", "transactional"):
            raise InvalidArgument(f"unknown mode {mode!r}; use 'lease' or 'transactional'")
        if self._started:
            raise InvalidArgument("register handlers before starting the worker")
        self._registrations.append(
            _Registration(queue, handler, mode, lease or queue.lease, handler_timeout)
        )
        return self

    def register_batch(
        self,
        queue: DelayedQueue[Any],
        handler: Callable[[list[Envelope[Any]]], Any],
        *,
        batch_size: int = 100,
        lease: timedelta | None = None,
        handler_timeout: timedelta | None = None,
    ) -> Worker:
        """Handle up to ``batch_size`` messages per call: ``handler(envelopes)`` (lease mode).

        The batch is taken with one statement and acknowledged with one when the handler
        returns; when it raises, every message of the batch is nacked with the error.
        """
        if batch_size < 1:
            raise InvalidArgument(f"batch_size must be >= 1, got {batch_size}")
        if self._started:
            raise InvalidArgument("register handlers before starting the worker")
        self._registrations.append(
            _Registration(
                queue, handler, "lease", lease or queue.lease, handler_timeout, batch_size
            )
        )
        return self

    def add_cron(
        self, service: CronService, *, interval: timedelta | float | None = None
    ) -> Worker:
        """Run ``service``'s installer while the worker runs (started by :meth:`start`).

        Every worker process may do this: installs from many processes create each tick once.
        """
        if self._started:
            raise InvalidArgument("add cron services before starting the worker")
        self._crons.append((service, interval))
        return self

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Start the threads and return; see :meth:`stop` and :meth:`run`."""
        if not self._registrations:
            raise InvalidArgument("register at least one queue before starting the worker")
        self._started = True
        engine: Any = self.sessions.kw.get("bind")
        tables = {r.queue.table.name for r in self._registrations}
        for table in tables:
            self._cleanup.append(subscribe(table, self._wakeup.notify))
        if self.listen and engine is not None and engine.dialect.name == "postgresql":
            from ._listener import PgListener

            listener = PgListener(engine, [channel_for(t) for t in tables], self._wakeup.notify)
            listener.start()
            self._cleanup.append(listener.stop)
        for service, interval in self._crons:
            kwargs = {} if interval is None else {"interval": interval}
            self._cleanup.append(service.install(self.sessions, **kwargs).stop)
        for i in range(self.concurrency):
            t = threading.Thread(target=self._loop, name=f"{self.name}-{i}", daemon=True)
            t.start()
            self._threads.append(t)
        if any(r.mode == "lease" for r in self._registrations):
            hb = threading.Thread(target=self._heartbeat, name=f"{self.name}-hb", daemon=True)
            hb.start()
            self._threads.append(hb)
        log.info("%s started: %d threads on %s", self.name, self.concurrency, sorted(tables))

    def stop(self, drain_timeout: float | None = None) -> bool:
        """Take nothing new, let in-flight handlers finish, release what cannot finish.

        Returns True when every handler finished within the drain timeout.
        """
        timeout = self.drain_timeout if drain_timeout is None else drain_timeout
        self._stopping.set()
        self._wakeup.notify()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        stuck = [t for t in self._threads if t.is_alive()]
        for reg, env, _ in self._in_flight.snapshot():
            self._settle(reg, env, functools.partial(reg.queue.release, envelope=env), "release")
        for fn in self._cleanup:
            fn()
        self._cleanup.clear()
        log.info("%s stopped (%d threads did not finish in time)", self.name, len(stuck))
        return not stuck

    def run(self, *, install_signal_handlers: bool = True) -> bool:
        """Start, block until SIGTERM/SIGINT (or :meth:`request_stop`), then stop gracefully."""
        if install_signal_handlers:
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: self.request_stop())
        self.start()
        while not self._stopping.wait(0.5):
            pass
        return self.stop()

    def request_stop(self) -> None:
        """Ask the worker to stop; :meth:`run` then drains and returns."""
        self._stopping.set()
        self._wakeup.notify()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    # -- the loop ------------------------------------------------------------------------

    def _loop(self) -> None:
        errors = 0
        while not self._stopping.is_set():
            seen = self._wakeup.generation()
            try:
                worked, next_due = self._poll_all()
                errors = 0
            except Exception as exc:
                errors += 1
                self._db_error(exc)
                self._stopping.wait(min(0.05 * 2**errors, 5.0))
                continue
            if worked or self._stopping.is_set():
                continue
            timeout = self.poll_interval
            if next_due is not None:
                timeout = max(0.0, min(timeout, next_due))
            self._wakeup.wait(seen, timeout)

    def _db_error(self, exc: BaseException) -> None:
        self.hooks.db_error(exc)
        if is_transient(exc):
            log.warning("transient database error, retrying: %s", exc)
        else:
            log.error("database error in worker loop, retrying", exc_info=exc)

    def _poll_all(self) -> tuple[bool, float | None]:
        """One pass over the queues; returns (did work, seconds until the next due message)."""
        next_due: float | None = None
        for reg in self._registrations:
            self._idle.next_due = None
            if self._stopping.is_set():
                return True, None
            once = self._lease_once if reg.mode == "lease" else self._transactional_once
            if once(reg):
                return True, None
            due_in = getattr(self._idle, "next_due", None)
            if due_in is not None:
                next_due = due_in if next_due is None else min(next_due, due_in)
        return False, next_due

    def _note_idle(self, session: Session, reg: _Registration) -> None:
        """After an empty take, in the same transaction: how long until the next due message."""
        t = reg.queue.table
        now = reg.queue.now()
        # Strictly later than now: due rows that a poll skipped are locked by another consumer.
        stmt = select(func.min(t.c.scheduled_at)).where(
            t.c.queue == reg.queue.name, t.c.scheduled_at > now
        )
        when: datetime | None = session.execute(stmt).scalar()
        self._idle.next_due = None if when is None else max(0.0, (when - now).total_seconds())

    def _observe(self, reg: _Registration, *envs: Envelope[Any]) -> None:
        name, hooks, now = reg.queue.name, self.hooks, reg.queue.now()
        for env in envs:
            if env.redelivered:
                hooks.redelivered(name, env)
            hooks.lag(name, (now - env.scheduled_at).total_seconds())

    def _lease_once(self, reg: _Registration) -> bool:
        if reg.batch is not None:
            return self._batch_once(reg)
        with self.sessions() as s, s.begin():
            envs = reg.queue.try_poll_many(s, self.batch_size, lease=reg.lease)
            if not envs:
                self._note_idle(s, reg)
        self._in_flight.add(reg, *envs)
        for i, env in enumerate(envs):
            if self._stopping.is_set():
                for rest in envs[i:]:
                    self._settle(
                        reg, rest, functools.partial(reg.queue.release, envelope=rest), "release"
                    )
                    self._in_flight.pop(rest)
                break
            self._observe(reg, env)
            started = time.monotonic()
            try:
                reg.handler(env)
            except Exception as exc:
                current = self._in_flight.current(env)
                outcome = self._settle(
                    reg,
                    current,
                    functools.partial(reg.queue.nack, envelope=current, error=exc),
                    "nack",
                )
                self.hooks.failed(reg.queue.name, env, exc, outcome or NackOutcome.STALE)
            else:
                current = self._in_flight.current(env)
                if self._settle(
                    reg, current, functools.partial(reg.queue.ack, envelope=current), "ack"
                ):
                    self.hooks.processed(reg.queue.name, env, time.monotonic() - started)
                else:
                    log.warning("ack of %s/%s lost: its lease ran out", reg.queue.name, env.key)
            finally:
                self._in_flight.pop(env)
        return bool(envs)

    def _batch_once(self, reg: _Registration) -> bool:
        assert reg.batch is not None
        with self.sessions() as s, s.begin():
            envs = reg.queue.try_poll_many(s, reg.batch, lease=reg.lease)
            if not envs:
                self._note_idle(s, reg)
        if not envs:
            return False
        self._in_flight.add(reg, *envs)
        self._observe(reg, *envs)
        started = time.monotonic()
        try:
            reg.handler(envs)
        except Exception as exc:
            for env in envs:
                cur = self._in_flight.current(env)
                outcome = self._settle(
                    reg, cur, functools.partial(reg.queue.nack, envelope=cur, error=exc), "nack"
                )
                self.hooks.failed(reg.queue.name, env, exc, outcome or NackOutcome.STALE)
        else:
            current = self._in_flight.current_all(envs)
            self._settle(reg, envs[0], lambda s: reg.queue.ack_many(s, current), "ack")
            elapsed = time.monotonic() - started
            for env in envs:
                self.hooks.processed(reg.queue.name, env, elapsed)
        finally:
            self._in_flight.pop(*envs)
        return True

    def _settle(
        self, reg: _Registration, env: Envelope[Any], op: Callable[[Session], Any], what: str
    ) -> Any:
        """Run a settle operation in its own transaction, retrying transient errors."""
        delay = 0.05
        deadline = time.monotonic() + max(reg.lease.total_seconds(), 1.0)
        while True:
            try:
                with self.sessions() as s, s.begin():
                    return op(s)
            except Exception as exc:
                self._db_error(exc)
                if time.monotonic() > deadline:
                    log.error(
                        "giving up on %s of %s/%s; the lease will expire",
                        what,
                        reg.queue.name,
                        env.key,
                    )
                    return None
                time.sleep(delay)
                delay = min(delay * 2, 2.0)

    def _transactional_once(self, reg: _Registration) -> bool:
        """Consume, handle and commit in one transaction (:meth:`DelayedQueue.process_one`)."""
        with self.sessions() as s, s.begin():
            if self._stopping.is_set():
                return False
            started = time.monotonic()
            result = reg.queue.process_one(s, self._observed(reg))
            if result is None:
                self._note_idle(s, reg)
                return False
        envelope, error, outcome = result
        # Hooks run after the commit, so they report what the database now holds.
        if error is None:
            self.hooks.processed(reg.queue.name, envelope, time.monotonic() - started)
        else:
            self.hooks.failed(reg.queue.name, envelope, error, outcome or NackOutcome.STALE)
        return True

    def _observed(self, reg: _Registration) -> Callable[[Envelope[Any], Session], Any]:
        def handle(envelope: Envelope[Any], session: Session) -> Any:
            self._observe(reg, envelope)
            return reg.handler(envelope, session)

        return handle

    # -- heartbeat -----------------------------------------------------------------------

    def _heartbeat(self) -> None:
        """Extend leases of long lease-mode handlers at half-lease, up to ``handler_timeout``."""
        while not self._stopping.wait(0.5):
            now = time.monotonic()
            for reg, env, started in self._in_flight.snapshot():
                if reg.mode != "lease":
                    continue
                remaining = (env.lease_until - reg.queue.now()).total_seconds()
                if remaining > reg.lease.total_seconds() / 2:
                    continue
                limit = reg.handler_timeout
                if limit is not None and now - started > limit.total_seconds():
                    continue  # hung: let the lease run out so another consumer retries it
                try:
                    with self.sessions() as s, s.begin():
                        longer = reg.queue.extend(s, env, reg.lease)
                except Exception as exc:
                    self._db_error(exc)
                    continue
                if longer is not None:
                    self._in_flight.replace(longer)
