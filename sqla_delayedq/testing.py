"""Helpers for your own test suite: a clock you move by hand, a queue database, assertions on
what was offered, and running handlers without a worker's threads.

- :class:`ManualClock` is the injectable clock (``DelayedQueue(..., clock=clock)``); it only
  moves when the test moves it, so a test of a delay or a retry never sleeps.
  :meth:`ManualClock.use` lends it to queues your application already built.
- :func:`queue_database` gives a database with the queue table created: an in-memory SQLite
  one by default, or your own engine (tables it creates are dropped again, messages of the
  queues it made are deleted).
- :func:`assert_offered` and :func:`assert_not_offered` look at what a transaction (or the
  database) holds for a queue, by key and/or payload.
- :func:`drain` (:func:`drain_async` for an ``AsyncWorker``) runs what is due through a worker's
  registered handlers on the calling thread, including what the handlers offer, until nothing
  is due; with a :class:`ManualClock` it also moves time to each next due message (retries,
  delays). It is the worker's own ``process_due``: the same takes, settles and retries.
- :func:`inline` makes every committed offer run its handler as the transaction commits.

The package registers a pytest plugin (:mod:`sqla_delayedq.pytest_plugin`) with these as
fixtures; it loads only when pytest runs, and ``import sqla_delayedq`` never imports this
module.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, TypeVar, overload

import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import StaticPool

from ._consumer import BaseWorker, WorkerHooks
from ._engine import create_engine
from ._queue import DelayedQueue
from ._time import LONGEST, require_aware, require_duration
from ._types import Buried, Envelope, MessageFilter, MessageInfo, NackOutcome, State
from ._wakeup import subscribe
from .errors import InvalidArgument
from .models import DelayedMessage, QueueMessageMixin, controls_table, table_key
from .worker import Worker

if TYPE_CHECKING:
    from .aio import AsyncWorker
    from .serializers import Serializer

__all__ = [
    "DrainLimitExceeded",
    "Drained",
    "HandlerFailed",
    "Inline",
    "ManualClock",
    "QueueDatabase",
    "assert_not_offered",
    "assert_offered",
    "drain",
    "drain_async",
    "inline",
    "memory_engine",
    "queue_database",
]

T = TypeVar("T")

#: Where a :class:`ManualClock` starts unless told: fixed, so runs repeat exactly (with
#: microseconds, so precision bugs show).
DEFAULT_START = datetime(2030, 1, 1, 12, 0, 0, 123456, tzinfo=UTC)


# -- the clock -----------------------------------------------------------------------------------


class ManualClock:
    """A clock that stands still until the test moves it; thread-safe.

    Pass it as a queue's ``clock`` (or lend it with :meth:`use`); call it for the current time.
    """

    def __init__(self, start: datetime | None = None) -> None:
        self._now = DEFAULT_START if start is None else require_aware(start, "start")
        self._lock = threading.Lock()

    def __call__(self) -> datetime:
        with self._lock:
            return self._now

    def __repr__(self) -> str:
        return f"ManualClock({self().isoformat()})"

    def advance(self, delta: timedelta | float) -> datetime:
        """Move forward by ``delta`` (a ``timedelta`` or seconds, at most 365,000 days like
        every duration the library takes); returns the new time.

        A step that is not a duration, is longer, or would move the clock past the last time a
        datetime holds (year 9999) is an :class:`~sqla_delayedq.InvalidArgument` and leaves
        the clock where it was; use :meth:`set` to go to a given time.
        """
        if not isinstance(delta, timedelta):
            if isinstance(delta, bool) or not isinstance(delta, (int, float)):
                raise InvalidArgument(
                    f"delta must be a timedelta or seconds, got {type(delta).__name__}"
                )
            if isinstance(delta, float) and not math.isfinite(delta):
                raise InvalidArgument(f"delta must be a finite number of seconds, got {delta}")
            if delta < 0:
                raise InvalidArgument(f"a clock only moves forward; got {delta} seconds")
            if delta > LONGEST.total_seconds():
                raise InvalidArgument(
                    f"delta must be at most {LONGEST.total_seconds():.0f} seconds "
                    f"({LONGEST.days} days), got {delta}"
                )
            delta = timedelta(seconds=delta)
        if delta < timedelta(0):
            raise InvalidArgument(f"a clock only moves forward; got {delta}")
        require_duration(delta, "delta", allow_zero=True, most=LONGEST)
        with self._lock:
            try:
                self._now += delta
            except OverflowError:
                raise InvalidArgument(
                    f"advancing {self._now.isoformat()} by {delta} passes the last time a "
                    "datetime holds (9999-12-31)"
                ) from None
            return self._now

    def set(self, when: datetime) -> datetime:
        """Move to ``when`` (aware; not earlier than now); returns it."""
        when = require_aware(when, "when")
        with self._lock:
            if when < self._now:
                raise InvalidArgument(f"a clock only moves forward: {when} < {self._now}")
            self._now = when
            return when

    @contextlib.contextmanager
    def use(self, *queues: Any) -> Iterator[ManualClock]:
        """Make ``queues`` (built elsewhere, e.g. by your application; an ``AsyncQueue`` as the
        queue it wraps) read this clock inside the block; their own clocks come back after
        it."""
        queues = tuple(q if hasattr(q, "clock") else getattr(q, "queue", q) for q in queues)
        saved = [(q, q.clock) for q in queues]
        try:
            for q in queues:
                q.clock = self
            yield self
        finally:
            for q, clock in saved:
                q.clock = clock


# -- a database with the queue table -------------------------------------------------------------


def memory_engine(**kwargs: Any) -> Engine:
    """An in-memory SQLite database that every session and thread of the engine shares (one
    connection): fast, private to the test, gone when the engine is disposed."""
    kwargs.setdefault("poolclass", StaticPool)
    kwargs.setdefault("connect_args", {"check_same_thread": False})
    return create_engine("sqlite://", **kwargs)


@dataclass
class QueueDatabase:
    """What :func:`queue_database` yields: an engine with the queue tables, a ``sessionmaker``,
    the clock, and factories for queues and workers that use them."""

    engine: Engine
    sessions: sessionmaker[Session]
    clock: ManualClock
    #: The message model :meth:`queue` builds queues on: the first of ``models`` with
    #: :class:`~sqla_delayedq.QueueMessageMixin`.
    model: type[QueueMessageMixin] = DelayedMessage
    _made: list[DelayedQueue[Any]] = field(default_factory=list, init=False, repr=False)

    @overload
    def queue(
        self, name: str = ..., *, serializer: Serializer[T], **kwargs: Any
    ) -> DelayedQueue[T]: ...
    @overload
    def queue(
        self, name: str = ..., *, serializer: None = None, **kwargs: Any
    ) -> DelayedQueue[Any]: ...
    def queue(
        self, name: str = "test", *, serializer: Serializer[Any] | None = None, **kwargs: Any
    ) -> DelayedQueue[Any]:
        """A :class:`~sqla_delayedq.DelayedQueue` on this clock and :attr:`model` (other
        arguments as its own)."""
        kwargs.setdefault("clock", self.clock)
        kwargs.setdefault("model", self.model)
        queue: DelayedQueue[Any] = DelayedQueue(name, serializer=serializer, **kwargs)
        self._made.append(queue)
        return queue

    def worker(self, **kwargs: Any) -> Worker:
        """A thread :class:`~sqla_delayedq.worker.Worker` on these sessions, for :func:`drain`
        and :func:`inline` (one thread, no ``LISTEN``)."""
        kwargs.setdefault("concurrency", 1)
        kwargs.setdefault("listen", False)
        return Worker(self.sessions, **kwargs)

    def _cleanup(self, created: set[str]) -> None:
        """Delete the messages of the queues made here from tables that existed before, and
        their controls (a pause or a limit a test set would hold the next test's queue)."""
        controls = sa.inspect(self.engine).has_table(controls_table.name)
        with self.engine.begin() as conn:
            for q in self._made:
                key = table_key(q.table)
                if key not in created:
                    conn.execute(sa.delete(q.table).where(q.table.c.queue == q.name))
                if controls and controls_table.name not in created:
                    c = controls_table.c
                    conn.execute(
                        sa.delete(controls_table).where(c.table_name == key, c.queue == q.name)
                    )


@contextlib.contextmanager
def queue_database(
    engine: Engine | None = None,
    *,
    models: Iterable[type[Any]] = (DelayedMessage,),
    clock: ManualClock | None = None,
) -> Iterator[QueueDatabase]:
    """A database with the tables of ``models`` (the default message table): your ``engine``,
    or an in-memory SQLite one (:func:`memory_engine`) when None.

    Tables that did not exist are created and dropped again at the end; in tables that did,
    the messages of the queues made with :meth:`QueueDatabase.queue` are deleted. An engine made
    here is disposed.
    """
    own = engine is None
    bind = memory_engine() if engine is None else engine
    tables = [m.__table__ for m in models]
    inspector = sa.inspect(bind)
    missing = [t for t in tables if not inspector.has_table(t.name, schema=t.schema)]
    created = {table_key(t) for t in missing}
    if missing:
        tables[0].metadata.create_all(bind, tables=missing)
    messages = [m for m in models if issubclass(m, QueueMessageMixin)]
    model = messages[0] if messages else DelayedMessage
    db = QueueDatabase(bind, sessionmaker(bind), clock or ManualClock(), model)
    try:
        yield db
    finally:
        try:
            try:
                db._cleanup(created)
            finally:  # the tables made here go, whatever the clean-up met
                if missing:
                    tables[0].metadata.drop_all(bind, tables=missing)
        finally:
            if own:
                bind.dispose()


# -- assertions ----------------------------------------------------------------------------------

#: ``payload`` not given: any payload matches.
_ANY: Any = object()

_PENDING = (State.DUE, State.SCHEDULED, State.IN_FLIGHT)

Where = Session | Engine | Callable[[], Session]


@contextlib.contextmanager
def _session(where: Where) -> Iterator[Session]:
    """The caller's Session as it is (its uncommitted offers count), or a new one."""
    if isinstance(where, Session):
        yield where
    elif isinstance(where, Engine):
        with Session(where) as s:
            yield s
    elif callable(where):
        with where() as s:
            yield s
    else:
        raise InvalidArgument(
            f"expected a Session, an Engine or a sessionmaker, got {type(where).__name__}"
        )


def _pending(queue: DelayedQueue[Any], s: Session, key: str | None) -> list[MessageInfo]:
    if key is not None:
        info = queue.get(s, key)
        return [info] if info is not None and info.state in _PENDING else []
    found: list[MessageInfo] = []
    after: int | None = None
    while True:
        page = queue.search(s, MessageFilter(state=State.PENDING), limit=500, after_id=after)
        found += page
        if len(page) < 500:
            return found
        after = page[-1].id


def _matches(info: MessageInfo, payload: Any, at: datetime | None) -> bool:
    if payload is not _ANY and (info.decode_error is not None or info.payload != payload):
        return False
    return at is None or info.scheduled_at == require_aware(at, "at")


def _describe(queue: DelayedQueue[Any], infos: list[MessageInfo]) -> str:
    if not infos:
        return f"queue {queue.name!r} has no pending message"
    shown = ", ".join(
        f"{i.key!r}: {i.payload!r} at {i.scheduled_at}"
        if i.decode_error is None
        else f"{i.key!r}: undecodable ({i.decode_error})"
        for i in infos[:10]
    )
    more = f" and {len(infos) - 10} more" if len(infos) > 10 else ""
    return f"queue {queue.name!r} holds {shown}{more}"


def _wanted(key: str | None, payload: Any, at: datetime | None) -> str:
    parts = [f"key={key!r}"] if key is not None else []
    if payload is not _ANY:
        parts.append(f"payload={payload!r}")
    if at is not None:
        parts.append(f"at={at}")
    return ", ".join(parts) or "any message"


def assert_offered(
    queue: DelayedQueue[Any],
    where: Where,
    *,
    key: str | None = None,
    payload: Any = _ANY,
    at: datetime | None = None,
) -> MessageInfo:
    """Assert that ``queue`` holds a pending message with ``key`` and/or ``payload`` (compared
    with ``==`` after decoding, so a typed payload compares as its model) and due time ``at``.

    ``where`` is the caller's Session (its uncommitted offers count), an Engine or a
    ``sessionmaker`` (what is committed). Returns the message; raises ``AssertionError``
    showing what the queue holds instead.
    """
    with _session(where) as s:
        pending = _pending(queue, s, key)
        for info in pending:
            if _matches(info, payload, at):
                return info
        everything = pending if key is None else _pending(queue, s, None)
    raise AssertionError(
        f"no pending message with {_wanted(key, payload, at)}; {_describe(queue, everything)}"
    )


def assert_not_offered(
    queue: DelayedQueue[Any],
    where: Where,
    *,
    key: str | None = None,
    payload: Any = _ANY,
) -> None:
    """Assert that ``queue`` holds no pending message with ``key`` and/or ``payload`` (with
    neither: no pending message at all). ``where`` as in :func:`assert_offered`."""
    with _session(where) as s:
        found = [i for i in _pending(queue, s, key) if _matches(i, payload, None)]
    if found:
        raise AssertionError(
            f"expected no pending message with {_wanted(key, payload, None)}; "
            f"{_describe(queue, found)}"
        )


# -- running handlers ----------------------------------------------------------------------------


class DrainLimitExceeded(AssertionError):
    """:func:`drain` handled more than ``max_messages``: likely a handler that offers forever."""


class HandlerFailed(AssertionError):
    """A handler raised while :func:`drain` or :func:`inline` ran it with ``raise_errors``."""


#: One failed attempt: the envelope, the handler's error, and what it did to the message.
Failure = tuple[Envelope[Any], BaseException, NackOutcome]


@dataclass(frozen=True)
class Drained:
    """What :func:`drain` did."""

    #: Messages handled (each attempt counts, failed or not).
    handled: int
    #: Failed attempts, in order.
    failures: tuple[Failure, ...] = ()
    #: Messages a take buried without running a handler (attempts used up, or a payload that
    #: cannot be decoded), in order: dead, and not counted in ``handled``.
    buried: tuple[Buried, ...] = ()

    @property
    def succeeded(self) -> int:
        return self.handled - len(self.failures)


class _Sink:
    """What one recording saw: failed attempts, and messages takes buried."""

    def __init__(self) -> None:
        self.failures: list[Failure] = []
        self.buried: list[Buried] = []


class _Recorder(WorkerHooks):
    """Failed attempts and burials of one worker, while someone listens."""

    def __init__(self) -> None:
        self.lists: list[_Sink] = []

    def failed(
        self, queue: str, envelope: Envelope[Any], error: BaseException, outcome: NackOutcome
    ) -> None:
        for sink in self.lists:
            sink.failures.append((envelope, error, outcome))

    def buried(self, queue: str, buried: Buried) -> None:
        for sink in self.lists:
            sink.buried.append(buried)

    @contextlib.contextmanager
    def recording(self) -> Iterator[_Sink]:
        sink = _Sink()
        self.lists.append(sink)
        try:
            yield sink
        finally:
            self.lists.remove(sink)


_recorders: weakref.WeakKeyDictionary[BaseWorker[Any], _Recorder] = weakref.WeakKeyDictionary()


def _recorder(worker: BaseWorker[Any]) -> _Recorder:
    recorder = _recorders.get(worker)
    if recorder is None:
        recorder = _recorders[worker] = _Recorder()
        worker.add_hooks(recorder)
    return recorder


def _check_bound(handled: int, max_messages: int) -> None:
    if handled > max_messages:
        raise DrainLimitExceeded(
            f"drain handled more than {max_messages} messages and the queues are not quiet; "
            "does a handler offer a new message every time? (raise max_messages if not)"
        )


def _next_due(sources: Iterable[Any], session: Session) -> datetime | None:
    times = [t for t in (src.next_due(session) for src in sources) if t is not None]
    return min(times, default=None)


def _advance(clock: ManualClock | None, nxt: datetime | None, until: datetime | None) -> bool:
    """Move ``clock`` to the next due time; False when there is none (within ``until``)."""
    if clock is None:
        return False
    if nxt is None or (until is not None and nxt > until):
        if until is not None and until > clock():
            clock.set(until)
        return False
    clock.set(max(nxt, clock()))
    return True


def _result(handled: int, seen: _Sink, raise_errors: bool) -> Drained:
    failures, buried = seen.failures, seen.buried
    result = Drained(handled, tuple(failures), tuple(buried))
    if raise_errors and buried and not failures:
        first = buried[0]
        raise HandlerFailed(
            f"{len(buried)} message(s) were buried without a handler call; the first, "
            f"{first.queue}/{first.key}: {first.error.partition(chr(10))[0]}"
        )
    if raise_errors and failures:
        envelope, error, outcome = failures[0]
        raise HandlerFailed(
            f"{len(failures)} handler call(s) failed; the first, on {envelope.queue}/"
            f"{envelope.key} (attempt {envelope.attempt}, {outcome.value}): "
            f"{type(error).__name__}: {error}"
        ) from error
    return result


def _check_drain_args(clock: ManualClock | None, until: datetime | None, limit: int) -> None:
    if until is not None and clock is None:
        raise InvalidArgument("until needs the clock to move: pass clock=")
    if limit < 1:
        raise InvalidArgument(f"max_messages must be >= 1, got {limit}")


def drain(
    worker: Worker,
    *,
    clock: ManualClock | None = None,
    until: datetime | None = None,
    max_messages: int = 1000,
    raise_errors: bool = False,
) -> Drained:
    """Run every due message through ``worker``'s handlers on this thread, until quiet.

    Messages the handlers offer run too, when due. With ``clock`` (the queues' clock), time
    then moves to the next due message (a delay, a retry's backoff) and draining goes on, until
    nothing is scheduled or the next message is after ``until`` (where the clock is left).
    More than ``max_messages`` handled raises :class:`DrainLimitExceeded`. A failing handler is
    retried or buried by the retry policy as in production; ``raise_errors`` raises
    :class:`HandlerFailed` after the drain when any call failed, or when a take buried a
    message without a call (``Drained.buried``).
    """
    _check_drain_args(clock, until, max_messages)
    handled = 0
    with _recorder(worker).recording() as seen:
        while True:
            handled += worker.process_due(limit=max_messages - handled + 1)
            _check_bound(handled, max_messages)
            with worker.sessions() as s:
                nxt = _next_due(worker.queues, s)
            if not _advance(clock, nxt, until):
                break
        return _result(handled, seen, raise_errors)


async def drain_async(
    worker: AsyncWorker,
    *,
    clock: ManualClock | None = None,
    until: datetime | None = None,
    max_messages: int = 1000,
    raise_errors: bool = False,
) -> Drained:
    """:func:`drain` for an :class:`~sqla_delayedq.aio.AsyncWorker` (``async def`` handlers)."""
    _check_drain_args(clock, until, max_messages)
    handled = 0
    with _recorder(worker).recording() as seen:
        while True:
            handled += await worker.process_due(limit=max_messages - handled + 1)
            _check_bound(handled, max_messages)
            async with worker.sessions() as s:
                nxt = await s.run_sync(functools.partial(_next_due, worker.queues))
            if not _advance(clock, nxt, until):
                break
        return _result(handled, seen, raise_errors)


class Inline(_Sink):
    """What :func:`inline` yields: counts of what ran so far, the failures, and the messages
    takes buried."""

    def __init__(self, worker: Worker, max_messages: int) -> None:
        self.worker = worker
        self.max_messages = max_messages
        super().__init__()
        self.handled = 0
        #: An error that stopped a run (a database error, :class:`DrainLimitExceeded`).
        self.error: BaseException | None = None
        self._names = {q.name for q in worker.queues}
        self._lock = threading.Lock()
        self._running = False
        self._pending = False

    def _wake(self, queue: str, _count: int | None = 1) -> None:
        """After a commit that offered to ``queue``: run what is due, once at a time (a commit
        inside a handler only asks the running drain for another pass)."""
        if queue not in self._names:
            return
        with self._lock:
            self._pending = True
            if self._running:
                return
            self._running = True
        try:
            while True:
                with self._lock:
                    if not self._pending or self.error is not None:
                        return
                    self._pending = False
                self._run()
        finally:
            with self._lock:
                self._running = False

    def _run(self) -> None:
        try:
            result = drain(self.worker, max_messages=self.max_messages)
        except Exception as exc:  # never into the committing caller: raised when the block ends
            self.error = exc
            return
        self.handled += result.handled
        self.failures += result.failures
        self.buried += result.buried


@contextlib.contextmanager
def inline(
    worker: Worker, *, raise_errors: bool = False, max_messages: int = 1000
) -> Iterator[Inline]:
    """Inside the block, a transaction that offers to one of ``worker``'s queues runs what is
    due through the worker's handlers as it commits (``after_commit``), then returns.

    A rolled-back offer runs nothing; a message due later runs when :func:`drain` moves the
    clock. The handlers' sessions must see the commit (the same database, really committed).
    Errors never surface from the commit: a failing handler is retried or buried as in
    production and listed in ``Inline.failures`` (a message a take buried without a call
    in ``Inline.buried``); with ``raise_errors`` the block raises
    :class:`HandlerFailed` at its end. A database error is raised at the end of the block.
    """
    if not isinstance(worker, Worker):
        raise InvalidArgument(
            f"inline runs a thread Worker's handlers, got {type(worker).__name__}; for an "
            "AsyncWorker, await drain_async(worker) after the code under test"
        )
    silent = sorted(q.name for q in worker.queues if not getattr(q, "notify", True))
    if silent:
        # Their offers announce nothing in process: the block ran nothing, and said nothing.
        raise InvalidArgument(
            f"inline runs what an offer announces, and queue(s) {', '.join(map(repr, silent))} "
            "were built with notify=False, which announces nothing; build them with "
            "notify=True in the test, or call drain(worker) after the code under test"
        )
    state = Inline(worker, max_messages)
    unsubscribe = [subscribe(table, state._wake) for table in {q.wake_key for q in worker.queues}]
    try:
        yield state
    finally:
        for fn in unsubscribe:
            fn()
    if state.error is not None:
        raise state.error
    _result(state.handled, state, raise_errors)
