"""The thread worker: ``concurrency`` threads that take messages, run handlers and settle them.

Two consumption modes:

- ``"lease"`` (at-least-once): take and commit at once, run the handler outside any
  transaction, ack in a new one. A crash means redelivery after the lease. Leases of long
  handlers are extended by a heartbeat until ``handler_timeout``.
- ``"transactional"`` (effectively exactly-once for database side effects): take, run the
  handler with the Session and acknowledge in one transaction (messages are deleted on take);
  the handler's writes commit with the acknowledgement. A failing handler's writes are rolled
  back to a savepoint and the failed attempt is recorded in the same transaction, so the
  message waits for its retry time; a crash rolls everything back and it is due again at once.

Idle threads sleep until the poll interval, the next due time, or a wake-up: ``NOTIFY`` on
PostgreSQL (sent by offers on commit) and in-process wake-ups on every backend. Transient
database errors are logged and retried with backoff; anything else stops the worker loudly.
The decisions live in :mod:`sqla_delayedq._consumer`, shared with the asyncio worker.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from ._consumer import BaseWorker, Mode, WorkerHooks, hand_out, require_option, stop_signals
from ._handlers import call_sync_handler, check_callback, check_sync_handler, is_cancellation
from ._types import QueueName
from ._wakeup import subscribe
from .errors import InvalidArgument

__all__ = ["Handler", "Mode", "QueueName", "Worker", "WorkerHooks"]

log = logging.getLogger("sqla_delayedq.worker")

#: How long a stop waits at least for the heartbeat and side threads once the drain is over.
DRAIN_JOIN = 1.0

#: Lease mode: ``handler(envelope)``; transactional mode: ``handler(envelope, session)``.
Handler = Callable[..., Any]


class _Slot:
    """A waiting thread's place in the queue, with the event that wakes only that thread."""

    __slots__ = ("event",)

    def __init__(self) -> None:
        self.event = threading.Event()


def _flag(slot: _Slot) -> bool:
    """Wake one waiting thread (its slot leaves the queue only when woken or timed out)."""
    slot.event.set()
    return True


#: How often ``run()`` looks whether a signal asked it to stop.
SIGNAL_LOOK = 0.1


class ThreadRuntime:
    """Waiting, sleeping, sessions and handler calls for threads."""

    late_hint = "the process was stalled: CPU starved, suspended or swapping"

    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self.sessions = sessions
        self._stop = threading.Event()
        self._drained = False
        self._lock = threading.Lock()
        self._generation = 0
        #: One slot per waiting thread, longest waiting first; ``notify`` sets a slot's event.
        self._waiting: collections.deque[_Slot] = collections.deque()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def request_stop(self) -> None:
        self._stop.set()
        self.notify()

    def session(self) -> Session:
        return self.sessions(expire_on_commit=False)

    def call(self, handler: Callable[..., Any], *args: Any) -> Any:
        return call_sync_handler(handler, *args)

    def to_its_end(self, fn: Callable[[], Any]) -> Any:
        return fn()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def pause(self, seconds: float) -> None:
        self._stop.wait(seconds)

    @property
    def drained(self) -> bool:
        return self._drained

    def mark_drained(self) -> None:
        self._drained = True

    def caller(self) -> object:
        return threading.get_ident()

    def cut_by_stop(self, exc: BaseException) -> bool:
        return self.stopping and is_cancellation(exc)

    def generation(self) -> int:
        with self._lock:
            return self._generation

    def wait(self, seen: int, timeout: float) -> None:
        with self._lock:
            if self._generation != seen or self._stop.is_set():
                return
            slot = _Slot()
            self._waiting.append(slot)
        slot.event.wait(timeout)
        with self._lock:
            if not slot.event.is_set():  # timed out: no longer a waiter to wake
                self._waiting.remove(slot)

    def notify(self, _key: str | None = None, count: int | None = None) -> None:
        """Wake ``count`` waiting threads, each by its own event (no thundering herd)."""
        with self._lock:
            if hand_out(self._waiting, count, _flag):
                self._generation += 1

    def wake_idle(self, count: int) -> None:
        with self._lock:
            hand_out(self._waiting, count, _flag)


class Worker(BaseWorker[sessionmaker[Session]]):
    """Run plain-function handlers for one or more queues on ``concurrency`` threads.

    :param sessions: a ``sessionmaker`` bound to the queues' database.
    :param concurrency: handler threads.
    :param poll_interval: the longest an idle thread sleeps between polls (seconds).
    :param batch_size: messages taken per poll in lease mode (each is acked on its own).
    :param listen: on PostgreSQL, ``LISTEN`` for offers committed in other processes.
    :param drain_timeout: on stop, how long in-flight handlers may run before their messages
        are released.
    :param hooks: metrics and logging hooks (:class:`WorkerHooks`).
    :param name: the worker's name in logs and thread names.
    :param keep_statistics: on PostgreSQL, ``ANALYZE`` a queue table whose planner statistics
        lag a burst (see :doc:`/operations`); False leaves them to autovacuum.

    Queues are :class:`~sqla_delayedq.DelayedQueue` or :class:`~sqla_delayedq.EntityQueue`
    objects; ``async def`` handlers, hooks and periodic tasks belong on
    :class:`~sqla_delayedq.aio.AsyncWorker` (refused here, where nothing would await them).
    """

    default_concurrency = 4
    default_name = "delayedq-worker"
    _threads: list[threading.Thread]
    _cleanup: list[Callable[[], Any]]

    def _check_handler(self, handler: Any, where: str) -> None:
        check_sync_handler(handler, where)

    def _check_sessions(self, sessions: Any) -> None:
        aio = sys.modules.get("sqlalchemy.ext.asyncio")  # not imported: not one of its makers
        if aio is not None and isinstance(sessions, aio.async_sessionmaker):
            raise InvalidArgument(
                "Worker needs a sessionmaker, not an async_sessionmaker: for async def "
                "handlers on an async engine use sqla_delayedq.aio.AsyncWorker"
            )

    def _check_callback(self, fn: Any, where: str) -> None:
        check_callback(fn, where, awaits=False)

    # -- lifecycle -----------------------------------------------------------------------

    def _spawn(self, target: Callable[[], None], name: str) -> threading.Thread:
        thread = threading.Thread(target=target, name=f"{self.name}-{name}", daemon=True)
        thread.start()
        self._threads.append(thread)
        return thread

    def start(self) -> None:
        """Start the threads and return; see :meth:`stop` and :meth:`run`."""
        self._check_startable(once=True)
        self._threads, self._cleanup = [], []
        rt = self._rt = ThreadRuntime(self.sessions)
        if self._stop_requested:
            rt.request_stop()
        for table in self._tables():
            self._cleanup.append(subscribe(table, self._waiter(table)))
        bind = self.sessions.kw.get("bind")
        listener = self._listener(bind, self._wake)
        if listener is not None:
            self._cleanup.append(listener.stop)
        for task in self._side_tasks(bind):
            self._spawn(lambda task=task: self._run_periodic(task), task.name)  # type: ignore[misc]
        self._live, self._live_lock = self.concurrency, threading.Lock()
        self._consumers = [
            self._spawn(self._consume_thread, str(i)) for i in range(self.concurrency)
        ]
        self._spawn(self._heartbeat, "hb")  # leases: lease mode's, and limited queues' takes
        log.info("%s started: %d threads on %s", self.name, self.concurrency, self._tables())

    def _consume_thread(self) -> None:
        """A consumer thread; the last one to end (a stop request, or a failure) ends the
        drain, so the heartbeat ends with it even when only request_stop() was called."""
        rt = self.rt
        try:
            self._consume()
        finally:
            with self._live_lock:
                self._live -= 1
                last = self._live == 0
            if last:
                rt.mark_drained()

    def stop(self, drain_timeout: float | None = None) -> bool:
        """Take nothing new, let in-flight handlers finish, release what cannot finish.

        Returns True when every handler finished within the drain timeout.
        """
        if drain_timeout is not None:
            require_option(drain_timeout, "drain_timeout", least=0)
        timeout = self.drain_timeout if drain_timeout is None else drain_timeout
        self.request_stop()
        deadline = time.monotonic() + timeout
        threads = getattr(self, "_threads", [])
        consumers = getattr(self, "_consumers", [])
        for t in consumers:  # the heartbeat keeps their leases meanwhile
            t.join(max(0.0, deadline - time.monotonic()))
        if self._rt is not None:
            self._rt.mark_drained()
        for t in threads:
            if t not in consumers:
                t.join(max(0.0, deadline - time.monotonic(), DRAIN_JOIN))
        stuck = [t for t in consumers if t.is_alive()]
        if self._rt is not None:
            self._release_in_flight()
            self._stop_periodic()
        for fn in getattr(self, "_cleanup", ()):
            fn()
        self._cleanup = []
        log.info("%s stopped (%d threads did not finish in time)", self.name, len(stuck))
        return not stuck

    def run(self, *, install_signal_handlers: bool = True) -> bool:
        """Start, block until SIGTERM/SIGINT (or :meth:`request_stop`), then stop gracefully.

        Returns True when every in-flight handler finished within the drain timeout. Raises
        :class:`~sqla_delayedq.WorkerError` when the worker stopped on an error it must not
        retry (a bug, a missing table): it was logged with its traceback.
        """
        # A signal handler runs on the main thread between two of its bytecodes, maybe while
        # it holds a lock of the runtime's (a first signal's stop request, a wait): one that
        # took such a lock itself waited on its own thread for ever (Ctrl-C on `delayedq worker
        # -p N` sends SIGINT, then the supervisor SIGTERM). It only notes the signal; the loop
        # below asks for the stop.
        if install_signal_handlers:
            self._check_signal_thread()
        signalled: list[int] = []
        handlers = (
            stop_signals(lambda sig: signal.signal(sig, lambda n, _: signalled.append(n)))
            if install_signal_handlers
            else contextlib.nullcontext()
        )
        with handlers:
            self.start()
            try:
                while not self.stopping:
                    if signalled:
                        self.request_stop()
                        break
                    self.rt.pause(SIGNAL_LOOK)
            except BaseException:
                self.stop()  # interrupted (KeyboardInterrupt without our signal handlers): no
                raise  # thread of ours goes on taking after run() is gone
            drained = self.stop()
        self._raise_failure()
        return drained

    def process_due(self, limit: int | None = None) -> int:
        """Handle what is due now, on the calling thread, and return how many were handled.

        The same takes, handlers, settles, hooks and logs as :meth:`run`, without threads,
        wake-ups or waiting: for a scheduled job that drains and exits, or a test. ``limit``
        stops after about that many messages.
        """
        self._check_startable()

        def heartbeat() -> threading.Thread:
            # Lease-mode handlers that outlive half a lease need it extended here too.
            beat = threading.Thread(target=self._heartbeat, name=f"{self.name}-hb", daemon=True)
            beat.start()
            return beat

        self._due_enter(lambda: ThreadRuntime(self.sessions), heartbeat)
        try:
            return self._process_due(limit)
        finally:
            beat = self._due_exit()
            if beat is not None:
                beat.join()
