"""The consumer core: every decision a worker makes, once, for both workers and both queues.

:class:`BaseWorker` holds the registrations and runs the loops: the poll loop (take, observe,
run the handler, settle, retry transient errors with backoff, stop loudly on anything else),
the lease heartbeat, and cron installers. What differs between the thread worker and the
asyncio worker is only *how* to wait, sleep, open a session and call a handler; that is the
:class:`Runtime` each of them passes in. The asyncio runtime runs these same loops in greenlets
on the event loop, the way SQLAlchemy's own asyncio extension runs its sync core, so an
``async def`` handler is awaited exactly where a plain one is called.

What a worker consumes is a :class:`Source`: a :class:`~sqla_delayedq.DelayedQueue` or an
:class:`~sqla_delayedq.EntityQueue`, which share the consumer contract (take under a lease,
ack/nack/release/extend by lock token, transactional ``process_one``).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import math
import signal
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Generic, Literal, NamedTuple, Protocol, TypeVar, cast

from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import Session

from . import _planner, _skew, controls
from . import _statements as st
from ._dialects import (
    TAKE_ONLY,
    Listener,
    gave_up_waiting,
    is_transient,
    strategy_class,
    strategy_for,
)
from ._handlers import check_arity, check_transactional, is_cancellation, is_interruption
from ._leases import (
    APART,
    BURIED,
    FUSED,
    Ahead,
    LeasedQueue,
    Polled,
    TakeUnsure,
    leases_apart,
)
from ._time import Clock, require_duration, require_lease
from ._types import Buried, Envelope, NackOutcome, QueueName
from ._wakeup import Wake, sent_alone
from .errors import InvalidArgument, WorkerError

if TYPE_CHECKING:
    from typing import Self

    from .cron import CronService
    from .retry import RetryPolicy

__all__ = [
    "BaseWorker",
    "Mode",
    "Runtime",
    "Source",
    "WorkerHooks",
    "log_failure",
    "require_option",
    "retryable",
]

log = logging.getLogger("sqla_delayedq.worker")

#: How often the heartbeat looks at the leases in flight at most (seconds); see ``_heartbeat``.
HEARTBEAT_CHECK = 0.5
#: How often a stopping worker's heartbeat looks whether the drain is over (seconds).
DRAIN_LOOK = 0.05

#: Transient errors in a row that ``process_due`` retries before it raises the last one.
PROCESS_DUE_RETRIES = 5

T = TypeVar("T")
Mode = Literal["lease", "transactional"]

#: The signals ``run()`` stops on, gracefully.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextlib.contextmanager
def stop_signals(
    install: Callable[[signal.Signals], object],
    remove: Callable[[signal.Signals], object] = lambda sig: None,
) -> Iterator[None]:
    """SIGTERM and SIGINT go to ``install``'s handlers for the block, then to the handlers the
    process had before it, not to the defaults. A late signal then does what the process
    asked for: a supervised worker process ignores the supervisor's SIGTERM that comes after
    its own Ctrl-C stop, where the default action killed it with status -15. Each handler
    comes back right after ``remove`` (asyncio's sets the default on the way)."""
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    for sig in STOP_SIGNALS:
        install(sig)
    try:
        yield
    finally:
        for sig in STOP_SIGNALS:
            with contextlib.suppress(Exception):  # a closed event loop has none left
                remove(sig)
            handler = previous[sig]  # None: set outside Python, which cannot be restored
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)


def log_failure(
    queue: str, key: str, attempt: int, error: BaseException, outcome: NackOutcome | None
) -> None:
    """One log record per failed attempt, with the traceback, at a level shown by default."""
    if outcome is NackOutcome.DEAD:
        log.error(
            "handler failed on %s/%s (attempt %d); the message is dead: %s",
            queue,
            key,
            attempt,
            error,
            exc_info=error,
        )
    elif outcome is NackOutcome.STALE:
        log.warning(
            "handler failed on %s/%s (attempt %d); the failure was not recorded, as its lease "
            "was lost or its row changed since the take (taken again, scheduled, settled): %s",
            queue,
            key,
            attempt,
            error,
            exc_info=error,
        )
    else:
        log.warning(
            "handler failed on %s/%s (attempt %d); it will be retried: %s",
            queue,
            key,
            attempt,
            error,
            exc_info=error,
        )


def retryable(error: BaseException) -> bool:
    """Whether a consumer loop may retry after ``error``: only transient database errors.

    Anything else (a bug, a missing table, a bad configuration) would fail the same way again;
    the consumer stops and says so instead of spinning.
    """
    return is_transient(error)


def backoff(errors: int) -> float:
    """The pause after ``errors`` transient errors in a row: 0.1 s doubling, at most 5 s."""
    return min(0.05 * 2.0**errors, 5.0)


# -- hooks ---------------------------------------------------------------------------------------


#: What a hook returns: nothing, or on the asyncio worker an awaitable (an ``async def`` hook).
HookResult = Awaitable[None] | None


class WorkerHooks:
    """Metrics and logging hooks; subclass and override what you need.

    A hook that raises is logged and otherwise ignored: it never stops the worker or changes
    what happens to a message, whatever it raises (``SystemExit`` and other ``BaseException``
    subclasses too) except ``KeyboardInterrupt`` and a cancellation, which stop the worker as
    they would anywhere else. On :class:`~sqla_delayedq.aio.AsyncWorker` a hook may be an
    ``async def`` (it is awaited); :class:`~sqla_delayedq.worker.Worker` refuses those.

    ``queue`` is the queue's name, a :class:`~sqla_delayedq.worker.QueueName`: a ``str`` that
    also says the queue's table (``queue.table``), for a worker that serves queues of one name
    in two tables (one per tenant, in two schemas).
    """

    def processed(self, queue: str, envelope: Envelope[Any], seconds: float) -> HookResult:
        """A handler returned and the message was acknowledged."""

    def failed(
        self, queue: str, envelope: Envelope[Any], error: BaseException, outcome: NackOutcome
    ) -> HookResult:
        """A handler raised; ``outcome`` says whether a retry was scheduled or it died."""

    def redelivered(self, queue: str, envelope: Envelope[Any]) -> HookResult:
        """A message was taken again after a lease ran out."""

    def buried(self, queue: str, buried: Buried) -> HookResult:
        """A take buried a message instead of delivering it (see :class:`~sqla_delayedq.Buried`):
        its attempts were used up, by leases that ran out too, or its payload cannot be
        decoded. It is dead, and no handler ran, so :meth:`failed` is not called for it."""

    def lag(self, queue: str, seconds: float) -> HookResult:
        """How late a message was taken, relative to its due time."""

    def db_error(self, error: BaseException) -> HookResult:
        """A transient database error interrupted polling or settling (it is retried)."""


#: The methods of :class:`WorkerHooks`, each a hook the worker calls.
HOOKS = ("processed", "failed", "redelivered", "buried", "lag", "db_error")
#: Each hook as :class:`WorkerHooks` defines it: one that does nothing.
_NOOP = {name: getattr(WorkerHooks, name) for name in HOOKS}


def wants(hooks: WorkerHooks, name: str) -> bool:
    """Whether calling hook ``name`` of ``hooks`` can do anything: False when every hooks
    object behind it keeps :class:`WorkerHooks`' own, which does nothing (so the per-message
    work of a hook's arguments, a clock read for ``lag``, is skipped)."""
    every = hooks.all if isinstance(hooks, SafeHooks) else [hooks]
    return any(_hook(h, name) is not None for h in every)


def _hook(hooks: WorkerHooks, name: str) -> Callable[..., Any] | None:
    """Hook ``name`` of ``hooks``, or None when it has none that can do anything (it keeps
    :class:`WorkerHooks`' own, or it is missing from a subclass that deletes it)."""
    hook: Callable[..., Any] | None = getattr(hooks, name, None)
    if hook is None or getattr(hook, "__func__", None) is _NOOP[name]:
        return None
    return hook


class SafeHooks(WorkerHooks):
    """Every hooks object of the worker, each call guarded: a raising hook is logged, never
    fatal (but an interruption goes on up, see :func:`~sqla_delayedq._handlers.is_interruption`).

    ``call(hook, *args)`` runs a hook to its end: the worker's runtime, which awaits an
    ``async def`` hook on the asyncio worker.
    """

    def __init__(self, *hooks: WorkerHooks, call: Callable[..., Any]) -> None:
        self.all: list[WorkerHooks] = list(hooks)
        self.call = call

    @property
    def hooks(self) -> WorkerHooks:
        """The first hooks object (the one given to the worker)."""
        return self.all[0]

    @hooks.setter
    def hooks(self, value: WorkerHooks) -> None:
        self.all[0] = value

    def _call(self, name: str, *args: Any) -> None:
        for hooks in self.all:
            try:
                hook = _hook(hooks, name)
                if hook is not None:  # else nothing to run
                    self.call(hook, *args)
            except BaseException as exc:
                if is_interruption(exc):
                    raise
                log.exception("worker hook %s raised; ignored", name)

    def processed(self, queue: str, envelope: Envelope[Any], seconds: float) -> None:
        self._call("processed", queue, envelope, seconds)

    def failed(
        self, queue: str, envelope: Envelope[Any], error: BaseException, outcome: NackOutcome
    ) -> None:
        self._call("failed", queue, envelope, error, outcome)

    def redelivered(self, queue: str, envelope: Envelope[Any]) -> None:
        self._call("redelivered", queue, envelope)

    def buried(self, queue: str, buried: Buried) -> None:
        self._call("buried", queue, buried)

    def lag(self, queue: str, seconds: float) -> None:
        self._call("lag", queue, seconds)

    def db_error(self, error: BaseException) -> None:
        self._call("db_error", error)


# -- what a worker consumes, and how it runs -----------------------------------------------------


class Source(Protocol):
    """The consumer contract of :class:`~sqla_delayedq.DelayedQueue` and ``EntityQueue``."""

    name: str
    lease: timedelta
    clock: Clock
    retry_policy: RetryPolicy
    shape: st.Shape

    @property
    def grouping(self) -> str | None:
        """Ordering by group key (None: none), see ``_statements.group_head``."""
        ...

    @property
    def wake_key(self) -> str: ...
    def now(self) -> datetime: ...
    def try_poll_many(
        self, session: Session, n: int, *, lease: timedelta | None = None
    ) -> list[Envelope[Any]]: ...
    def poll_batch(
        self, session: Session, n: int, *, lease: timedelta | None = None
    ) -> Polled[Any]: ...
    def ack(self, session: Session, envelope: Envelope[Any]) -> bool: ...
    def ack_and_poll(
        self, session: Session, envelope: Envelope[Any], n: int, lease: timedelta
    ) -> tuple[bool, Polled[Any]] | None: ...
    def release_fused(self, session: Session, prefix: str, until: datetime) -> int: ...
    @property
    def takes_alone(self) -> bool: ...
    def poll_alone(self, session: Session, n: int, lease: timedelta) -> Polled[Any] | None: ...
    def ack_alone(self, session: Session, envelope: Envelope[Any]) -> bool | None: ...
    def ack_many(self, session: Session, envelopes: Sequence[Envelope[Any]]) -> int: ...
    def nack(
        self,
        session: Session,
        envelope: Envelope[Any],
        error: BaseException | str,
        at: datetime | None = None,
    ) -> NackOutcome: ...
    def release(
        self, session: Session, envelope: Envelope[Any], *, at: datetime | None = None
    ) -> bool: ...
    def record_failure(
        self,
        session: Session,
        envelope: Envelope[Any],
        error: BaseException | str,
        at: datetime | None = None,
    ) -> NackOutcome: ...
    def extend(
        self, session: Session, envelope: Envelope[Any], lease: timedelta | None = None
    ) -> Envelope[Any] | None: ...
    def process_next(
        self, session: Session, handler: Callable[[Envelope[Any], Session], Any]
    ) -> tuple[tuple[Envelope[Any], BaseException | None, NackOutcome | None] | None, Ahead]: ...
    def holding(
        self, session: Session, envelopes: Sequence[Envelope[Any]]
    ) -> list[Envelope[Any]]: ...
    def next_due(self, session: Session) -> datetime | None: ...
    def gate(self, session: Session) -> controls.QueueControls | None: ...


class Runtime(Protocol):
    """How a worker waits, sleeps, opens sessions and calls handlers (threads or asyncio)."""

    @property
    def stopping(self) -> bool: ...
    def request_stop(self) -> None: ...
    def session(self) -> Session:
        """A new Session (``expire_on_commit=False``), to be used in a ``with`` block."""
        ...

    def call(self, handler: Callable[..., Any], *args: Any) -> Any:
        """Run a handler, a hook or a side task to its end (await it, on the asyncio
        runtime)."""
        ...

    def to_its_end(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` run to its end, whatever cancellations the calling task gets meanwhile (on
        the asyncio runtime, in a task of its own; an anyio cancel scope cancels again at every
        await); for work the caller makes on its way out after an interruption."""
        ...

    def sleep(self, seconds: float) -> None:
        """Sleep; a stop request does not cut it short (settles finish during a drain)."""
        ...

    def pause(self, seconds: float) -> None:
        """Sleep until ``seconds`` pass or a stop is requested."""
        ...

    @property
    def drained(self) -> bool:
        """No consumer runs a handler any more (see :meth:`mark_drained`)."""
        ...

    def mark_drained(self) -> None:
        """After a stop's drain (or a ``process_due`` pass): the heartbeat may end. Until
        then it goes on through the drain, for handlers that run on after the stop request."""
        ...

    def caller(self) -> object:
        """Who runs the calling code: its thread, or its task on the asyncio runtime."""
        ...

    def cut_by_stop(self, exc: BaseException) -> bool:
        """Whether ``exc`` is the stop cutting the running code short (its drain timed out),
        not a failure: on the asyncio runtime, only a cancellation of the consumer's own task,
        not a ``CancelledError`` its handler raised or got from a future someone cancelled."""
        ...

    #: Why the heartbeat may look late, and the remedy: for the warning that leases may have
    #: run out under their handlers.
    late_hint: str

    def generation(self) -> int: ...
    def wait(self, seen: int, timeout: float) -> None:
        """Sleep until ``timeout``, a wake-up since generation ``seen``, or a stop request."""
        ...

    def notify(self, _key: str | None = None, count: int | None = None) -> None:
        """Wake ``count`` waiting consumers, or every one when None (from any thread)."""
        ...

    def wake_idle(self, count: int) -> None:
        """Wake up to ``count`` waiting consumers, if any wait; unlike :meth:`notify`, busy
        consumers are not told to look again (from a consumer)."""
        ...


W = TypeVar("W")


def hand_out(waiting: collections.deque[W], count: int | None, wake: Callable[[W], bool]) -> bool:
    """Give ``count`` wake-ups (every waiter when None) to idle consumers, longest waiting
    first; ``wake(waiter)`` wakes one and says whether it was still waiting.

    Returns whether some wake-ups found no idle consumer: the runtime then moves its
    generation, so every consumer busy in a pass looks again when it ends (an offer is never
    slept through). When idle consumers took them all, busy ones do not look again: each offer
    gets one take, not one per consumer that happened to be busy when it committed.
    """
    while waiting and (count is None or count > 0):
        if wake(waiting.popleft()) and count is not None:
            count -= 1
    return count is None or count > 0


#: How soon an idle consumer of a queue with groups looks again while due messages wait behind
#: the heads of their groups (seconds).
GROUPED_RETRY = 0.05
#: After a failed lease-mode attempt, how soon its consumer looks at the queue again.
FAILED_RETRY = 0.05
#: How many messages a lease-mode chain of takes handles before the consumer's pass goes on to
#: the worker's other queues, so a backlog in the first queue does not hold them back.
CHAIN_LIMIT = 10


class AloneSession:
    """What the statements that commit on their own (:meth:`BaseWorker._take_alone`,
    ``_ack_alone``, ``_ack_fused``) use of a Session, over one pooled connection in autocommit
    mode: ``execute``, ``info``, ``get_bind``, ``connection``, and ``commit``, which commits
    nothing (each statement did) but sends what they announced, as a Session's commit does
    (``NOTIFY``, this process's wake-ups). A Session's own transaction bookkeeping cost about
    a third of such a statement's client CPU (``docs/benchmarks.md``)."""

    def __init__(self, engine: Engine) -> None:
        self.info: dict[Any, Any] = {}
        self._engine = engine
        self._conn: Connection | None = None

    def connection(self) -> Connection:
        """Connected at first use, as a Session does: a lost database fails the statement
        inside its caller's error handling, not the making of this object."""
        if self._conn is None:
            # Its engine stays the sessions' own, by which this process's picture of the
            # queue controls is kept (see controls.known); the pool resets the level on return.
            self._conn = self._engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        return self._conn

    def execute(self, statement: Any, params: Any = None) -> Any:
        return self.connection().execute(statement, params)

    def get_bind(self) -> Connection:
        return self.connection()

    def commit(self) -> None:
        sent_alone(cast(Session, self))

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()

    def __enter__(self) -> Session:
        return cast(Session, self)

    def __exit__(self, *exc: object) -> None:
        self.close()


class Taken(NamedTuple):
    """What one take of a queue did."""

    handled: int
    #: It got all it asked for: more may be due now.
    more: bool
    #: Otherwise, seconds until the queue's next row is due (None: no row).
    due_in: float | None
    #: The next take may ride in this one's last acknowledgement (see ``_lease_once``): not
    #: for a queue with controls, where an acknowledgement that took again at once would keep
    #: its in-flight slot from every other consumer.
    chainable: bool = False


#: What :meth:`BaseWorker._handle` returns after a failed attempt (nacked, to be retried).
FAILED: Any = ([], Taken(0, True, None))


def _after_groups(taken: Taken, grouped: bool) -> Taken:
    """A take, once its messages are settled (``grouped``: some had a group): settling a
    message of a group may have made the next message of that group due (it waited behind
    it), so the consumer takes again at once instead of idling until an offer or the poll
    interval. Any message of the pass counts, not only the last take's: a take that rode in an
    acknowledgement (PostgreSQL's one statement) reads a snapshot from before that
    acknowledgement, and so never takes the acknowledged message's successor itself."""
    if not taken.more and grouped:
        return Taken(taken.handled, True, None)
    return taken


@dataclass(frozen=True)
class Periodic:
    """A side task of the worker: ``fn(sessions)`` every ``interval`` seconds while it runs, and
    ``on_stop(sessions)`` once after it drained."""

    name: str
    fn: Callable[[Callable[[], Session]], Any]
    interval: float
    on_stop: Callable[[Callable[[], Session]], Any] | None = None


@dataclass(frozen=True)
class Registration:
    source: Source
    handler: Callable[..., Any]
    mode: Mode
    lease: timedelta
    handler_timeout: timedelta | None
    #: Messages per take for batch handlers (``handler(envelopes)``); None for one at a time.
    batch: int | None = None

    @functools.cached_property
    def queue(self) -> QueueName:
        """The queue's name as hooks get it: with its table, so two tables' queues of one
        name (tenants in two schemas) are told apart (built once, not per message)."""
        src = self.source
        return QueueName(src.name, src.wake_key, src.shape.table.schema)


def require_option(
    value: Any,
    name: str,
    *,
    whole: bool = False,
    least: float | None = None,
    above: float | None = None,
) -> None:
    """Refuse a worker option that is not a number (an int where ``whole``) in its range; one
    that is not ``whole`` is seconds, at most :data:`threading.TIMEOUT_MAX` (about 292 years),
    the longest a thread's wait takes (a longer one stopped the worker with an OverflowError)."""
    if isinstance(value, bool) or not isinstance(value, int if whole else (int, float)):
        kind = "an int" if whole else "a number"
        raise InvalidArgument(f"{name} must be {kind}, got {type(value).__name__}")
    number = float(value)
    if not math.isfinite(number):  # a thread's wait would raise on it, or wait for ever
        raise InvalidArgument(f"{name} must be a finite number, got {value}")
    if not whole and number > threading.TIMEOUT_MAX:
        raise InvalidArgument(
            f"{name} must be at most {threading.TIMEOUT_MAX:.0f} seconds, got {value}"
        )
    if least is not None and number < least:
        raise InvalidArgument(f"{name} must be >= {least}, got {value}")
    if above is not None and number <= above:
        raise InvalidArgument(f"{name} must be > {above}, got {value}")


def heartbeat_every(registrations: Sequence[Registration]) -> float:
    """Seconds between the heartbeat's looks: every half second, or six times per shortest
    lease of a registration when that is sooner (but not more than 100 times a second, whatever
    the lease). Transactional registrations count: a limited queue's take is a lease."""
    leases = [r.lease.total_seconds() for r in registrations]
    return max(0.01, min([HEARTBEAT_CHECK, *(lease / 6 for lease in leases)]))


class InFlight:
    """Envelopes being handled under a lease (lease mode, and a limited queue's transactional
    take), for the heartbeat and for shutdown.

    Keyed by delivery (row id and lock token), not by row: an offer that replaces a message in
    flight makes it due again at once, so the same consumer may take the new version while a
    handler still runs the old one. Each handler then settles its own delivery, with its own
    token (the old one's ack is refused), and neither overwrites the other's entry here.
    """

    def __init__(self, caller: Callable[[], object]) -> None:
        self._lock = threading.Lock()
        self._items: dict[tuple[int, int, str], tuple[Registration, Envelope[Any], float]] = {}
        #: Who added each entry (its thread or task, see ``Runtime.caller``), so that a
        #: ``process_due`` call gives back what it holds and not what another call holds.
        self._owners: dict[tuple[int, int, str], object] = {}
        self._caller = caller

    @staticmethod
    def _key(reg: Registration, env: Envelope[Any]) -> tuple[int, int, str]:
        return (id(reg), env.id, env.lock_token)

    def add(self, reg: Registration, *envs: Envelope[Any]) -> None:
        started, owner = time.monotonic(), self._caller()
        with self._lock:
            for env in envs:
                key = self._key(reg, env)
                self._items[key] = (reg, env, started)
                self._owners[key] = owner

    def replace(self, reg: Registration, env: Envelope[Any]) -> None:
        """An extended lease (same delivery, same token) replaces the entry it extends."""
        with self._lock:
            key = self._key(reg, env)
            item = self._items.get(key)
            if item is not None:
                self._items[key] = (reg, env, item[2])

    def current(self, reg: Registration, envs: Sequence[Envelope[Any]]) -> list[Envelope[Any]]:
        """The envelopes as the heartbeat last extended them (or as given)."""
        with self._lock:
            items, key = self._items, self._key
            return [env if (item := items.get(key(reg, env))) is None else item[1] for env in envs]

    def holds(self, reg: Registration, env: Envelope[Any]) -> bool:
        with self._lock:
            return self._key(reg, env) in self._items

    def pop(self, reg: Registration, *envs: Envelope[Any]) -> None:
        with self._lock:
            for env in envs:
                key = self._key(reg, env)
                self._items.pop(key, None)
                self._owners.pop(key, None)

    def take_back(self) -> list[tuple[Registration, Envelope[Any]]]:
        """Remove and return the entries the calling thread or task added."""
        owner = self._caller()
        with self._lock:
            keys = [key for key, by in self._owners.items() if by == owner]
            for key in keys:
                del self._owners[key]
            return [self._items.pop(key)[:2] for key in keys]

    def snapshot(self) -> list[tuple[Registration, Envelope[Any], float]]:
        with self._lock:
            return list(self._items.values())


# -- the worker ----------------------------------------------------------------------------------


def check_source(source: Any, where: str) -> Source:
    """Workers serve :class:`DelayedQueue` and ``EntityQueue`` objects."""
    if isinstance(source, LeasedQueue):
        return source
    raise InvalidArgument(
        f"{where}: expected a DelayedQueue or an EntityQueue, got {type(source).__name__}"
    )


def _same_rows(a: Source, b: Source) -> bool:
    """Whether two sources take the same rows (the same queue of the same table)."""
    return a.name == b.name and a.shape.table.fullname == b.shape.table.fullname


S = TypeVar("S")


class BaseWorker(Generic[S]):
    """Registrations, configuration and the loops; :class:`~sqla_delayedq.worker.Worker` and
    :class:`~sqla_delayedq.aio.AsyncWorker` add the runtime and the lifecycle."""

    #: What the subclass runs on, for ``concurrency`` and ``name`` when not given.
    default_concurrency: int = 4
    default_name: str = "delayedq-worker"

    def __init__(
        self,
        sessions: S,
        *,
        concurrency: int | None = None,
        poll_interval: float = 5.0,
        batch_size: int = 1,
        listen: bool = True,
        drain_timeout: float = 30.0,
        hooks: WorkerHooks | None = None,
        name: str | None = None,
        keep_statistics: bool = True,
    ) -> None:
        concurrency = self.default_concurrency if concurrency is None else concurrency
        require_option(concurrency, "concurrency", whole=True, least=1)
        require_option(poll_interval, "poll_interval", above=0)
        require_option(batch_size, "batch_size", whole=True, least=1)
        require_option(drain_timeout, "drain_timeout", least=0)
        self._check_sessions(sessions)
        self.sessions = sessions
        self.concurrency = concurrency
        self.poll_interval = poll_interval
        self.batch_size = batch_size
        self.listen = listen
        #: On PostgreSQL, analyse a table whose planner statistics lag a burst (``_planner``).
        self.keep_statistics = keep_statistics
        self.drain_timeout = drain_timeout
        hooks = WorkerHooks() if hooks is None else hooks
        self._check_hooks(hooks, f"{type(self).__name__}: hooks")
        self.hooks: WorkerHooks = SafeHooks(hooks, call=self._call)
        self.name = name or self.default_name
        #: The error that stopped the worker, if one did (see ``run``).
        self.failure: BaseException | None = None
        self._registrations: list[Registration] = []
        self._periodic: list[Periodic] = []
        #: When the worker started (``time.time()``), None before.
        self.started_at: float | None = None
        self._in_flight = InFlight(lambda: self.rt.caller())
        #: Whether the database has the statement that acknowledges and takes (see
        #: :meth:`_ack_fused`); None until a session first says.
        self._fused_ack: bool | None = None
        #: The sessions' engine, once known (see ``_autocommit_session``).
        self._alone_engine: Engine | None = None
        self._rt: Runtime | None = None
        #: ``process_due`` calls running at once share one runtime and one heartbeat (see
        #: :meth:`_due_enter`): each call's own would stop the others' when it returned.
        self._due_lock = threading.Lock()
        self._due_calls = 0
        self._due_beat: Any = None
        self._started = False
        #: ``start``/``run`` was called: a worker starts once.
        self._ran = False
        #: A listener runs: offers from other processes wake this worker (see ``_after_one``).
        self._listening = False
        self._stop_requested = False

    # -- configuration -------------------------------------------------------------------

    def _check_handler(self, handler: Any, where: str) -> None:
        raise NotImplementedError

    def _check_callback(self, fn: Any, where: str) -> None:
        """Refuse a hook or side task this worker would call without running it."""
        raise NotImplementedError

    def _check_hooks(self, hooks: WorkerHooks, where: str) -> None:
        if not isinstance(hooks, WorkerHooks):
            raise InvalidArgument(
                f"{where}: expected a WorkerHooks, got {type(hooks).__name__}; subclass "
                "sqla_delayedq.WorkerHooks and override the hooks you need"
            )
        for name in HOOKS:
            fn = getattr(hooks, name, None)
            if fn is not None:  # a stand-in without it fails at the call, logged as ever
                self._check_callback(fn, f"{where}.{name}")

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a hook or side task to its end on the runtime (await it, on asyncio)."""
        return self.rt.call(fn, *args)

    def _side_sessions(self, fn: Callable[..., Any]) -> Callable[[], Any]:
        """What a side task ``fn`` gets to open sessions with: the runtime's Sessions."""
        return self.rt.session

    def _add(self, where: str, source: Any, handler: Any, **kwargs: Any) -> Self:
        if self._started:
            raise InvalidArgument("register handlers before starting the worker")
        src = check_source(source, where)
        self._check_handler(handler, where)
        if kwargs["mode"] == "transactional":
            check_transactional(handler, where)
        elif kwargs.get("batch") is None:
            check_arity(handler, 1, where, "handler(envelope) in lease mode")
        else:
            check_arity(handler, 1, where, "handler(envelopes) (a batch handler)")
        if any(_same_rows(r.source, src) for r in self._registrations):
            # Its messages would go to one handler or the other, whichever consumer took them.
            raise InvalidArgument(
                f"{where}: queue {src.name!r} of table {src.shape.table.fullname!r} is "
                "registered already; one handler per queue"
            )
        lease = kwargs.pop("lease", None)
        lease = src.lease if lease is None else require_lease(lease, f"{where}: lease")
        if kwargs.get("handler_timeout") is not None:
            require_duration(kwargs["handler_timeout"], f"{where}: handler_timeout")
        self._registrations.append(Registration(src, handler, lease=lease, **kwargs))
        return self

    def register(
        self,
        queue: Any,
        handler: Callable[..., Any],
        *,
        mode: Mode = "lease",
        lease: timedelta | None = None,
        handler_timeout: timedelta | None = None,
    ) -> Self:
        """Handle ``queue`` (a ``DelayedQueue`` or an ``EntityQueue``) with ``handler``.

        Lease mode calls ``handler(envelope)`` outside any transaction; transactional mode calls
        ``handler(envelope, session)`` inside the transaction that takes and acknowledges.
        """
        if mode not in ("lease", "transactional"):
            raise InvalidArgument(f"unknown mode {mode!r}; use 'lease' or 'transactional'")
        where = f"{type(self).__name__}.register"
        return self._add(
            where, queue, handler, mode=mode, lease=lease, handler_timeout=handler_timeout
        )

    def register_batch(
        self,
        queue: Any,
        handler: Callable[..., Any],
        *,
        batch_size: int = 100,
        lease: timedelta | None = None,
        handler_timeout: timedelta | None = None,
    ) -> Self:
        """Handle up to ``batch_size`` messages per call: ``handler(envelopes)`` (lease mode).

        The batch is taken with one statement and acknowledged with one when the handler
        returns; when it raises, every message of the batch is nacked with the error.
        """
        where = f"{type(self).__name__}.register_batch"
        require_option(batch_size, f"{where}: batch_size", whole=True, least=1)
        return self._add(
            where,
            queue,
            handler,
            mode="lease",
            lease=lease,
            handler_timeout=handler_timeout,
            batch=batch_size,
        )

    def add_cron(self, service: CronService, *, interval: timedelta | float | None = None) -> Self:
        """Run ``service``'s installer while the worker runs.

        Every worker process may do this: installs from many processes create each tick once.
        """
        from .cron import DEFAULT_INTERVAL

        seconds = service.interval_seconds(DEFAULT_INTERVAL if interval is None else interval)
        return self.add_periodic(f"cron {service.queue.name}", service.run_once, seconds)

    def add_periodic(
        self,
        name: str,
        fn: Callable[[Callable[[], Session]], Any],
        interval: float,
        *,
        on_stop: Callable[[Callable[[], Session]], Any] | None = None,
    ) -> Self:
        """Run ``fn(sessions)`` now and every ``interval`` seconds while the worker runs.

        ``sessions`` opens a Session on the worker's database (use it in a ``with`` block).
        An error is logged and the next interval tries again, whatever it is (``SystemExit``
        and other ``BaseException`` subclasses too) except ``KeyboardInterrupt`` and a
        cancellation, which stop the worker. ``on_stop(sessions)`` runs once when the worker
        has drained. Cron installers and the workers registry run this way.

        On :class:`~sqla_delayedq.aio.AsyncWorker`, ``fn`` and ``on_stop`` may be ``async def``:
        they are awaited, and ``sessions`` opens an ``AsyncSession`` (``async with``);
        :class:`~sqla_delayedq.worker.Worker` refuses them, as it could never await them.
        """
        if self._started:
            raise InvalidArgument("add periodic tasks before starting the worker")
        where = f"{type(self).__name__}.add_periodic"
        self._check_callback(fn, f"{where}: fn")
        if on_stop is not None:
            self._check_callback(on_stop, f"{where}: on_stop")
        require_option(interval, f"{where}: interval", above=0)
        self._periodic.append(Periodic(name, fn, float(interval), on_stop))
        return self

    def add_hooks(self, hooks: WorkerHooks) -> Self:
        """Report to ``hooks`` too, beside the worker's own (metrics, a registry)."""
        self._check_hooks(hooks, f"{type(self).__name__}.add_hooks: {type(hooks).__name__}")
        assert isinstance(self.hooks, SafeHooks)
        self.hooks.all.append(hooks)
        return self

    @property
    def in_flight(self) -> int:
        """How many messages handlers hold right now (lease mode)."""
        return len(self._in_flight.snapshot())

    @property
    def queues(self) -> tuple[Any, ...]:
        """The registered queues, in registration order (each once)."""
        return tuple(dict.fromkeys(r.source for r in self._registrations))

    @property
    def stopping(self) -> bool:
        return self._stop_requested or (self._rt is not None and self._rt.stopping)

    def request_stop(self) -> None:
        """Ask the worker to stop: take nothing new, let in-flight handlers finish."""
        self._stop_requested = True
        if self._rt is not None:
            self._rt.request_stop()

    def _tables(self) -> list[str]:
        return sorted({r.source.wake_key for r in self._registrations})

    def _wake(self, table: str | None, queue: str | None, count: int | None) -> None:
        """``count`` messages were offered to ``queue`` of ``table`` (a table key): wake as
        many idle consumers as it takes to take them (every one when the count is unknown).
        From any thread."""
        rt = self._rt
        if rt is None:
            return
        if queue is None or count is None:
            # Controls changed (or a listener reconnected, and may have missed that).
            controls.invalidate()
            rt.notify(queue, None)
            return
        sizes = [
            self._take_size(r)
            for r in self._registrations
            if r.source.name == queue and r.source.wake_key == table
        ]
        if sizes:  # another queue of the table, or a queue of that name elsewhere: not ours
            rt.notify(queue, -(-count // max(sizes)))

    def _waiter(self, table: str) -> Callable[[str, int | None], None]:
        """What :func:`~sqla_delayedq._wakeup.subscribe` calls after a local commit that
        offered to ``table``."""
        return functools.partial(self._wake, table)

    def _take_size(self, reg: Registration) -> int:
        """Messages one take of ``reg`` asks for."""
        if reg.mode == "transactional":
            return 1
        return reg.batch or self.batch_size

    def _listener(self, bind: Any, wake: Wake) -> Listener | None:
        """A started listener for offers from other processes, where the backend has one."""
        if not self.listen or bind is None:
            return None
        engine = getattr(bind, "sync_engine", bind)  # an AsyncEngine's sync face has the URL
        tables = self._tables()
        heard = controls.pushed(engine, tables)
        listener = strategy_class(engine.dialect).listener(engine.url, tables, wake, heard)
        if listener is None:
            return None
        listener.start()
        self._listening = True
        return listener

    def _side_tasks(self, bind: Any) -> list[Periodic]:
        """The periodic tasks to run: the registered ones, the clock skew check of the queues
        on the system clock, and where the backend needs it the planner statistics keeper of
        the worker's tables."""
        tasks = list(self._periodic)
        if bind is None:
            return tasks
        engine = getattr(bind, "sync_engine", bind)
        strategy = strategy_class(engine.dialect)
        checked = [r for r in self._registrations if _skew.checked(r.source)]
        if checked and strategy.has_server_clock:
            leases = [(r.source.name, r.lease) for r in checked]
            check = _skew.SkewCheck(self.name, checked[0].source.clock, leases)
            tasks.append(Periodic("clock skew check", check, _skew.CHECK_EVERY))
        if self.keep_statistics and strategy.keeps_statistics:
            tables = [r.source.shape.table for r in self._registrations]
            keeper = _planner.StatisticsKeeper(
                tables, engine.dialect.identifier_preparer.format_table
            )
            tasks.append(Periodic("planner statistics", keeper, _planner.INTERVAL))
        return tasks

    def _check_startable(self, *, once: bool = False) -> None:
        """Before a start (``once``: ``start``/``run``, which a worker does once) or a
        ``process_due`` pass: never a start beside a running pass, nor a pass beside a started
        worker, whose threads would outlive its stop (``process_due`` passes may run side by
        side, as several consumers of one worker)."""
        if not self._registrations:
            raise InvalidArgument("register at least one queue before starting the worker")
        running = self._rt is not None and not self._rt.drained
        if running and (once or self._ran):
            raise InvalidArgument(f"{self.name} is already running")
        if once:
            if self._ran:
                raise InvalidArgument(
                    f"{self.name} has run already: a worker starts once, make a new one"
                )
            self._ran = True
        controls.keep_fresh(self.poll_interval)
        self._started = True
        self.started_at = time.time()

    def _check_sessions(self, sessions: Any) -> None:
        """Refuse the other runtime's kind of session factory, which failed only once the
        worker ran."""

    def _check_signal_thread(self) -> None:
        """Before ``run()`` installs its SIGTERM/SIGINT handlers, which Python allows only on
        the main thread: refused before anything starts (an AsyncWorker whose install failed
        stayed marked as running, and refused a second ``run()``)."""
        if threading.current_thread() is not threading.main_thread():
            raise InvalidArgument(
                f"{self.name}: run() installs SIGTERM/SIGINT handlers, which only the main "
                "thread may; on another thread call run(install_signal_handlers=False) and stop "
                "the worker with request_stop()"
            )

    def _raise_failure(self) -> None:
        if self.failure is not None:
            raise WorkerError(
                f"{self.name} stopped on an error it cannot retry: "
                f"{type(self.failure).__name__}: {self.failure}"
            ) from self.failure

    # -- the loops (run on the runtime's threads or greenlets) ---------------------------

    @property
    def rt(self) -> Runtime:
        assert self._rt is not None, "the worker is not running"
        return self._rt

    def _fail(self, error: BaseException, where: str) -> None:
        """Stop the worker loudly on an error that retrying would only repeat."""
        if self.failure is None:
            self.failure = error
            log.critical(
                "%s is stopping: %s raised %s, which is not a transient database error",
                self.name,
                where,
                type(error).__name__,
                exc_info=error,
            )
        self.request_stop()

    def _db_error(self, error: BaseException) -> None:
        self.hooks.db_error(error)
        log.warning("transient database error, retrying: %s", error)

    def _consume(self) -> None:
        """One consumer: poll the queues in turn, handle what is due, sleep when idle."""
        rt = self.rt
        errors = 0
        while not rt.stopping:
            seen = rt.generation()
            try:
                worked, next_due = self._poll_all()
                errors = 0
            except Exception as exc:
                if not retryable(exc):
                    self._fail(exc, "the poll loop")
                    return
                errors += 1
                self._db_error(exc)
                rt.pause(backoff(errors))
                continue
            except BaseException as exc:
                # SystemExit, KeyboardInterrupt or a cancellation that is not the worker's
                # stop, from a handler (a transactional one: its take rolled back) or the loop:
                # the consumer would end without a word, the worker running on without it.
                if rt.stopping and is_cancellation(exc):
                    raise
                self._fail(exc, "a handler or the poll loop")
                return
            if worked or rt.stopping:
                continue
            # Nothing more was due (or every take was partial): wait for an offer, the next due
            # row, or the poll interval. An offer that committed during the pass has already
            # moved the generation past ``seen``, so it is never slept through.
            timeout = self.poll_interval
            if next_due is not None:
                timeout = max(0.0, min(timeout, next_due))
            rt.wait(seen, timeout)

    def _poll_all(self) -> tuple[bool, float | None]:
        """One pass over the queues: (poll again at once, seconds until the next due row).

        A take that got all it asked for means more may be due: poll again (from the first
        queue). A partial or empty take means its queue had nothing more to give at that moment
        (rows other consumers hold are theirs): no second, empty take of it.
        """
        next_due: float | None = None
        more = False
        for i, reg in enumerate(self._registrations):
            if self.rt.stopping:
                return True, None
            # A full take goes on to the next queue all the same, so a backlog in one queue
            # does not hold back those after it; only the first queue chains its takes.
            taken = self._once(reg, chain=i == 0)
            if taken.more:
                more = True
            elif taken.due_in is not None:
                next_due = min(next_due, taken.due_in) if next_due is not None else taken.due_in
        return more, None if more else next_due

    def _once(self, reg: Registration, chain: bool = False) -> Taken:
        """One take of ``reg``'s queue, handled. With ``chain`` (lease mode), while takes come
        back full, each last acknowledgement and the next take share one transaction."""
        if reg.mode == "transactional":
            return self._transactional_once(reg)
        return self._lease_once(reg, chain)

    def _idle(self, session: Session, reg: Registration) -> float | None:
        """After an empty take, in the same transaction: seconds until the next due row (None
        for a paused queue: its due rows wait for a wake-up or the poll interval; a limited
        queue's take may have been held back, so it looks again soon)."""
        gate = reg.source.gate(session)
        if gate is not None and gate.paused:
            return None
        if gate is not None:  # limited: due rows may be held back; look again soon
            return min(self.poll_interval, controls.LIMITED_RETRY)
        due_in = self._due_in(reg, reg.source.next_due(session))
        if due_in == 0 and reg.source.grouping is not None:
            # Due rows a take left wait behind their group's head: a consumer that settles a
            # head takes the next at once; the others look again soon, not in a busy loop.
            return min(self.poll_interval, GROUPED_RETRY)
        return due_in

    @staticmethod
    def _due_in(reg: Registration, when: datetime | None) -> float | None:
        """Seconds until ``when`` by the queue's clock (None: no row is pending)."""
        return None if when is None else max(0.0, (when - reg.source.now()).total_seconds())

    def _observe(self, reg: Registration, *envs: Envelope[Any]) -> None:
        """Report what a take saw (``redelivered``, ``lag``). It never fails the message: in
        transactional mode it runs inside the handler's call, where an error would count as
        the handler's."""
        name, hooks = reg.queue, self.hooks
        try:
            if wants(hooks, "redelivered"):
                for env in envs:
                    if env.redelivered:
                        hooks.redelivered(name, env)
            if wants(hooks, "lag"):
                now = reg.source.now()
                for env in envs:
                    hooks.lag(name, (now - env.scheduled_at).total_seconds())
        except Exception:
            log.exception("reporting a take of %s to the worker hooks failed; ignored", name)

    def _take(self, reg: Registration, n: int) -> tuple[list[Envelope[Any]], Taken]:
        """Up to ``n`` envelopes, and whether more is due now; when not, in the same
        transaction, when the next row is due. A take that failed at its commit but did commit
        is delivered all the same (see :meth:`_took`). Where the source allows, the take's
        statements commit on their own instead (:meth:`_take_alone`)."""
        alone = self._take_alone(reg, n)
        if alone is not None:
            return alone
        envs: list[Envelope[Any]] = []
        try:
            with self.rt.session() as s, s.begin():
                s.info[TAKE_ONLY] = True  # its commit need not wait for the WAL flush (PostgreSQL)
                envs, taken = self._take_in(s, reg, n)
            self._report_buried(reg, s)
        except Exception as exc:
            # ``envs`` is set once the take's statements ran: only its commit failed.
            if not (envs and retryable(exc)):
                raise
            got = self._took(reg, envs, exc, "handling them")
            if not got:
                raise  # it did not commit (or cannot be read): the loop retries, as before
            self.hooks.db_error(exc)
            envs = got
        except BaseException as exc:
            self._give_back_interrupted(reg, exc, envs)  # ``envs``: its commit may have happened
            raise
        return envs, taken

    def _take_alone(self, reg: Registration, n: int) -> tuple[list[Envelope[Any]], Taken] | None:
        """:meth:`_take` on an autocommit connection, where the source allows it (see
        ``LeasedQueue.poll_alone``): the take commits in its own statement, one round trip
        before the handlers start where a transaction costs three. None where it does not,
        before anything ran.

        When it fails, it may have committed (the connection lost after the statement was
        sent): what it holds is given back, due at once and uncounted, and the error goes to
        the consumer's loop as a failed take's does. Once the take returned, what it took is
        delivered whatever fails after it, but an interruption (see
        :meth:`_give_back_interrupted`)."""
        s = self._autocommit_session() if reg.source.takes_alone else None
        if s is None:
            return None
        polled: Polled[Any] | None = None
        try:
            with s:
                s.info[TAKE_ONLY] = True  # its commit need not wait for the WAL flush
                polled = reg.source.poll_alone(s, n, reg.lease)
                if polled is None:
                    return None
                s.commit()  # the statements committed: sends what they announced
        except Exception as exc:
            if polled is not None:  # it returned, so its statements committed: deliver them
                self.hooks.db_error(exc)
                log.warning(
                    "a take on %s returned, then its session failed: %s", reg.source.name, exc
                )
                self._report_buried(reg, s)
                return polled.envelopes, Taken(len(polled.envelopes), True, None)
            sent = s.info.get(FUSED)
            if sent is not None and self._settle(reg, None, "give back", sent):
                log.warning(
                    "taking on %s committed, though it raised (%s): the messages it took are "
                    "due again",
                    reg.source.name,
                    exc,
                )
            raise
        except BaseException as exc:
            taken = polled.envelopes if polled is not None else []
            self._give_back_interrupted(reg, exc, taken, s.info.get(FUSED))
            raise
        envs = polled.envelopes
        try:
            self._report_buried(reg, s)
            return envs, self._after_take(None, reg, polled)
        except Exception as exc:  # what it took is taken: handle it, then look again
            if not envs:
                raise
            if retryable(exc):
                self._db_error(exc)
            else:
                log.warning("reading %s after a take failed: %s", reg.source.name, exc)
            return envs, Taken(len(envs), True, None)
        except BaseException as exc:
            self._give_back_interrupted(reg, exc, envs)
            raise

    def _give_back_interrupted(
        self,
        reg: Registration,
        exc: BaseException,
        taken: Sequence[Envelope[Any]],
        sent: tuple[str, datetime] | None = None,
    ) -> None:
        """After an interruption (``exc``: ``KeyboardInterrupt``, ``SystemExit``, a task's
        cancellation, as a stop whose drain timed out sends) between a take's statement and
        the moment what it took is in flight: give back, due at once and uncounted, what the
        take may hold (``taken``: by their lock tokens; ``sent``: a statement with no reply, by
        its prefix and lease end), no handler having run. Also what a ``process_due`` call
        that ends on an error or an interruption holds unsettled. One try, in a transaction of
        its own; a failure is logged. Without it, the rows stayed leased under tokens nobody
        held, and the end of the lease counted an attempt that no handler made (dead
        unhandled, with one attempt allowed). Run to its end whatever cancellations follow."""
        if not (taken or sent):
            return  # the take's transaction never committed: it holds nothing
        source = reg.source

        def give() -> int:
            given = 0
            with self.rt.session() as s, s.begin():
                if sent is not None:
                    given += source.release_fused(s, *sent)
                for env in taken:
                    given += bool(source.release(s, env))
            return given

        try:
            # To its end: the cancellation that interrupted the take may come again (anyio).
            given: int = self.rt.to_its_end(give)
        except Exception as error:
            log.error(
                "a take on %s was interrupted (%r), and what it holds could not be given back "
                "(%s): it is due again when its lease ends, which counts as an attempt",
                source.name,
                exc,
                error,
            )
            return
        if given:
            log.warning(
                "a take on %s was interrupted (%r): the %d message(s) it took are due again, "
                "unhandled and uncounted",
                source.name,
                exc,
                given,
            )

    def _settle_again(
        self,
        reg: Registration,
        envs: Sequence[Envelope[Any]],
        exc: BaseException,
        error: BaseException | None = None,
    ) -> None:
        """After ``exc`` interrupted the settle of ``envs`` (the asyncio stop's cancel as its
        statement awaited the reply, Ctrl-C), whose handlers ran: acknowledge them again, or
        with ``error`` record their failure again. One try, in a transaction of its own,
        refused where the first committed, run to its end whatever cancellations follow.
        Without it the stop released them: a success ran again without a word, a failure went
        uncounted (a poison message, for ever)."""
        if not envs:
            return
        source = reg.source
        doing = "acknowledging" if error is None else "recording the failure of"

        def again() -> None:
            with self.rt.session() as s, s.begin():
                if error is None:
                    self._acknowledge(s, reg, list(envs))
                else:
                    for env in envs:
                        source.nack(s, env, error)

        try:
            # To its end: the cancellation that cut the first short may come again (anyio).
            self.rt.to_its_end(again)
        except Exception as failure:
            log.error(
                "%s %d message(s) on %s was interrupted (%r) and could not be made again "
                "(%s): the stop releases them, due when a lease ends",
                doing,
                len(envs),
                source.name,
                exc,
                failure,
            )
            return
        log.warning(
            "%s %d message(s) on %s was interrupted (%r): made again",
            doing,
            len(envs),
            source.name,
            exc,
        )

    def _autocommit_session(self) -> Session | None:
        """An :class:`AloneSession` for statements that commit on their own, where the
        database gains by them (see ``Strategy.fused_ack``: asked of the sessions' engine
        once, then known); None elsewhere (a sessionmaker bound to a connection, whose
        transaction they would step out of)."""
        engine = self._alone_engine
        if engine is None:
            if self._fused_ack is False:
                return None
            with self.rt.session() as s:
                bind = s.get_bind()
            if not isinstance(bind, Engine) or not strategy_class(bind.dialect).fused_ack:
                self._fused_ack = False
                return None
            self._fused_ack = True
            engine = self._alone_engine = bind
        return cast(Session, AloneSession(engine))

    def _report_buried(self, reg: Registration, s: Session) -> None:
        """After ``s`` committed: tell the hooks of each message its takes buried (see
        :data:`~sqla_delayedq._leases.BURIED`); its ``ERROR`` record is written already."""
        for buried in s.info.pop(BURIED, ()):
            self.hooks.buried(reg.queue, buried)

    def _took(
        self, reg: Registration, envs: list[Envelope[Any]], error: BaseException, then: str
    ) -> list[Envelope[Any]] | None:
        """After a take that failed at its commit (``error``), which may have happened (the
        connection lost after COMMIT was sent): the envelopes it took if it committed (the
        caller goes on with them, as ``then`` says), [] if it did not, None if that could not
        be read (the lease runs out as before, and counts as an attempt; logged).

        A lock token is written by its take alone: the take committed exactly when its rows
        carry their tokens. Read in a transaction of its own, retried on transient errors up to
        the lease, as a settle is. Left alone, such a take kept its messages leased under tokens
        nobody held, then counted an attempt no handler had made (dead, with one allowed)."""
        try:
            return self._read_took(reg, envs, error, then)
        except BaseException as exc:
            if not isinstance(exc, Exception):
                self._give_back_interrupted(reg, exc, envs)
            raise

    def _read_took(
        self, reg: Registration, envs: list[Envelope[Any]], error: BaseException, then: str
    ) -> list[Envelope[Any]] | None:
        source = reg.source
        delay = 0.05
        deadline = time.monotonic() + max(reg.lease.total_seconds(), 1.0)
        while True:
            try:
                with self.rt.session() as s, s.begin():
                    got = source.holding(s, envs)
                break
            except Exception as exc:
                if not retryable(exc):
                    self._fail(exc, f"reading whether a take on {source.name} committed")
                    return None
                self._db_error(exc)
                if time.monotonic() > deadline:
                    log.error(
                        "a take of %d message(s) on %s failed at its commit (%s), and whether "
                        "that commit happened cannot be read; if it did, they stay leased until "
                        "%s and that counts as an attempt (with one attempt allowed, they die "
                        "unhandled): %s",
                        len(envs),
                        source.name,
                        error,
                        min(e.lease_until for e in envs).isoformat(),
                        ", ".join(e.key for e in envs),
                    )
                    return None
                self.rt.sleep(delay)
                delay = min(delay * 2, 2.0)
        if got:
            log.warning(
                "a take of %d message(s) on %s committed, though its COMMIT raised (%s): %s",
                len(got),
                source.name,
                error,
                then,
            )
        else:
            log.info(
                "a take on %s failed at its commit, which did not happen: its messages are "
                "due again (%s)",
                source.name,
                error,
            )
        return got

    def _take_in(self, s: Session, reg: Registration, n: int) -> tuple[list[Envelope[Any]], Taken]:
        polled = reg.source.poll_batch(s, n, lease=reg.lease)
        return polled.envelopes, self._after_take(s, reg, polled)

    def _after_take(self, s: Session | None, reg: Registration, polled: Polled[Any]) -> Taken:
        """What a take that gave ``polled`` did, and what the consumer does next; what it must
        read for that (the controls, the next due time) is read in ``s``, the take's
        transaction, or, after a take that committed alone (``s`` None: on its autocommit
        connection a refresh of the controls could not take its savepoint), in a transaction
        of its own, only when needed. Such a take saw no controls (see
        ``LeasedQueue.poll_alone``), so its consumer may chain."""
        envs = polled.envelopes
        if polled.more:
            chainable = s is None or reg.source.gate(s) is None
            return Taken(len(envs), True, None, chainable)
        if polled.held:  # paused or at a limit: due rows wait for the controls
            return Taken(len(envs), False, polled.wait)
        if polled.ahead.known:  # the take's statement read when the next row is due
            return Taken(len(envs), False, self._due_in(reg, polled.ahead.next_at))
        if s is not None:
            return Taken(len(envs), False, self._idle(s, reg))
        with self.rt.session() as own, own.begin():
            return Taken(len(envs), False, self._idle(own, reg))

    def _lease_once(self, reg: Registration, chain: bool = False) -> Taken:
        """Take, handle and acknowledge in lease mode: one message at a time (up to
        ``batch_size`` per take), or a batch handler's batch at once.

        With ``chain``, a take that came back full is followed by the next without a
        transaction of its own: the last acknowledgement takes the next envelopes in its
        transaction (:meth:`_ack`), one commit fewer per take. A stop, a failed handler or a
        partial take ends the chain, and the consumer's loop goes on as usual.
        """
        size = reg.batch or self.batch_size
        envs, taken = self._take(reg, size)
        handled = 0
        failed = grouped = False
        while envs:
            if taken.more:
                # More is due than this take holds, and the row its pick looked ahead to was
                # locked until the take committed (a consumer woken for it skipped it): an idle
                # consumer takes it now, not this one after its handlers. A wake-up that meets
                # no idle consumer is dropped: busy ones take again on their own.
                self.rt.wake_idle(1)
            handled += len(envs)
            grouped = grouped or any(e.group is not None for e in envs)
            self._in_flight.add(reg, *envs)
            alone = len(self._registrations) == 1  # no other queue to give a turn to
            then = size if chain and taken.chainable and (alone or handled < CHAIN_LIMIT) else 0
            if reg.batch is not None:
                self._observe(reg, *envs)
                after = self._handle(reg, envs, list(envs), then)  # its own list to change
                failed = failed or after is FAILED
            else:
                after = None
                for i, env in enumerate(envs):
                    if self.rt.stopping:
                        for rest in envs[i:]:
                            self._settle(reg, rest, "release")
                            self._in_flight.pop(reg, rest)
                        handled -= len(envs) - i  # given back, not handled
                        break
                    self._observe(reg, env)
                    after = self._handle(reg, [env], env, then if i == len(envs) - 1 else 0)
                    failed = failed or after is FAILED
            if after is None or after is FAILED:
                break
            envs, taken = after
        if failed and not taken.more:
            # A nack rescheduled a message after the take read when the queue's next row is
            # due: look again soon, not a poll interval later; but not at once, or a retry
            # due at once (a zero delay) is taken in a busy loop that starves later queues.
            soon = min(self.poll_interval, FAILED_RETRY)
            due_in = soon if taken.due_in is None else min(taken.due_in, soon)
            taken = Taken(taken.handled, False, due_in)
        return _after_groups(taken._replace(handled=handled), grouped)

    def _handle(
        self, reg: Registration, envs: list[Envelope[Any]], arg: Any, then: int = 0
    ) -> tuple[list[Envelope[Any]], Taken] | None:
        """Run the handler on ``arg`` and settle ``envs`` by its outcome; with ``then``, a
        success's acknowledgement also takes up to ``then`` envelopes (returned with the take).

        A handler interrupted by cancellation (a drain that timed out on the asyncio worker)
        settles nothing: its envelopes stay in flight, and the stop releases them.
        """
        started = time.monotonic()
        after = None
        try:
            self.rt.call(reg.handler, arg)
        except Exception as exc:
            self._failed(reg, envs, exc)
            after = FAILED
        except BaseException as exc:
            if self.rt.cut_by_stop(exc):
                raise  # the drain's cancel: still in flight, the stop releases them
            # SystemExit, KeyboardInterrupt, a cancellation of the handler's own: the attempt
            # failed (counted, recorded), and the worker stops loudly rather than lose a
            # consumer without a word and keep the messages leased for ever.
            self._failed(reg, envs, exc)
            self._in_flight.pop(reg, *envs)
            self._fail(exc, f"the handler of {reg.source.name}")
            return None
        else:
            try:
                after = self._succeeded(reg, envs, started, then)
            except BaseException as exc:
                # Interrupted while it acknowledged (the asyncio stop's cancel as the statement
                # awaited its reply, Ctrl-C): the handlers succeeded, and the acknowledgement
                # may not have committed. Made again; else the stop released the messages, and
                # they ran again without a word.
                self._settle_again(reg, self._in_flight.current(reg, envs), exc)
                raise
        self._in_flight.pop(reg, *envs)
        return after

    def _succeeded(
        self, reg: Registration, envs: list[Envelope[Any]], started: float, then: int = 0
    ) -> tuple[list[Envelope[Any]], Taken] | None:
        current = self._in_flight.current(reg, envs)
        acked, after = self._ack(reg, current, then)
        elapsed = time.monotonic() - started
        if acked == len(envs):
            for env in envs:
                self.hooks.processed(reg.queue, env, elapsed)
        else:
            log.warning(
                "%d ack(s) on %s refused: the lease ran out, or an offer or schedule started a "
                "new run, before the handler returned",
                len(envs) - acked,
                reg.source.name,
            )
        return after

    def _ack(
        self, reg: Registration, envs: list[Envelope[Any]], then: int
    ) -> tuple[int, tuple[list[Envelope[Any]], Taken] | None]:
        """Acknowledge ``envs`` (how many were); with ``then`` and no stop requested, take up
        to ``then`` more in the same transaction. That transaction is the acknowledgement's:
        it commits durably. When it fails, none of it happened: the acknowledgement is made on
        its own, retried as usual, and the take is left to the consumer's loop. When it fails
        at its commit, which may have happened, what it took tells whether it did (see
        :meth:`_took`): if so, the consumer goes on with them."""
        if then and not self.rt.stopping and len(envs) == 1:
            fused = self._ack_fused(reg, envs[0], then)
            if fused is not None:
                return fused
        if then and not self.rt.stopping:
            committing = False
            taken: tuple[list[Envelope[Any]], Taken] = ([], Taken(0, False, None))
            try:
                with self.rt.session() as s, s.begin():
                    acked = self._acknowledge(s, reg, envs)
                    taken = self._take_in(s, reg, then)
                    committing = True  # only a failure from here on may hide a commit
                self._report_buried(reg, s)
            except Exception as exc:
                got = None
                if committing and taken[0] and retryable(exc):
                    # What it took tells whether the transaction committed, the ack with it.
                    got = self._took(reg, taken[0], exc, "handling them")
                    committing = got is None  # unless that could not be read, it is known
                if not got:
                    if retryable(exc):
                        self._db_error(exc)
                    else:  # the consumer's next take meets it again if it lasts, and stops on it
                        log.warning(
                            "acknowledging and taking on %s failed; acknowledging alone: %s",
                            reg.source.name,
                            exc,
                        )
                    ack = self._settle(reg, envs[0], "ack", envs, after_failure=committing)
                    return ack or 0, None
                self.hooks.db_error(exc)
                taken = (got, taken[1])
            except BaseException as exc:
                # Its commit may have happened, or not: what it took is given back (and the
                # acknowledgement made again, by _handle).
                self._give_back_interrupted(reg, exc, taken[0])
                raise
            # In flight from its commit on, so a stop that comes first releases them.
            self._in_flight.add(reg, *taken[0])
            return acked, taken
        if len(envs) == 1:
            alone = self._ack_alone(reg, envs[0])
            if alone is not None:
                return alone, None
        return self._settle(reg, envs[0], "ack", envs) or 0, None

    def _ack_alone(self, reg: Registration, env: Envelope[Any]) -> int | None:
        """Acknowledge ``env`` in one statement that commits on its own, where the source
        allows (see ``LeasedQueue.ack_alone``): one round trip where a transaction costs three.
        None when not done so (not allowed here, or refused: the caller acknowledges in a
        transaction, which reads why, a lost lease or a hold to end). When the statement fails
        it may have committed (the connection lost after it was sent): the acknowledgement is
        made again in a transaction, as after a failed commit (refused only if the first try
        committed, which the log then says)."""
        s = self._autocommit_session()
        if s is None:
            return None
        acked: bool | None = None
        try:
            with s:
                acked = reg.source.ack_alone(s, env)
                s.commit()  # the statement committed: sends what it announced
        except Exception as exc:
            if acked is not None:  # it returned, so it committed: a failure after it is moot
                self.hooks.db_error(exc)
                return 1 if acked else None
            if retryable(exc):
                self._db_error(exc)
            else:
                log.warning(
                    "acknowledging on %s failed; acknowledging again: %s", reg.source.name, exc
                )
            return self._settle(reg, env, "ack", [env], after_failure=True) or 0
        return 1 if acked else None

    def _ack_fused(
        self, reg: Registration, env: Envelope[Any], then: int
    ) -> tuple[int, tuple[list[Envelope[Any]], Taken] | None] | None:
        """:meth:`_ack` of one envelope in one statement that commits on its own, where its
        source allows (see ``LeasedQueue.ack_and_poll``); None where it does not, before
        anything ran. The statement commits durably, as an acknowledgement must.

        When the statement fails, it may have committed (the connection lost after it was
        sent): what it may have taken is given back, due at once and uncounted (found by its
        lock tokens' prefix and its lease end), and the acknowledgement is made on its own, as
        after a failed commit of :meth:`_ack`'s transaction. A failure after it returned (the
        session's own commit) loses nothing: it committed, and what it took is delivered."""
        got: tuple[bool, Polled[Any]] | None = None
        s = self._autocommit_session()
        if s is None:
            return None
        try:
            with s:
                got = reg.source.ack_and_poll(s, env, then, reg.lease)
                if got is None:
                    return None
                s.commit()  # the statement committed: sends what it announced
        except Exception as exc:
            if got is None:
                return self._unfused(reg, env, s.info.get(FUSED), exc)
            self.hooks.db_error(exc)
            log.warning(
                "acknowledging and taking on %s returned, then its session failed: %s",
                reg.source.name,
                exc,
            )
        except BaseException as exc:
            if got is None:  # the statement's outcome is unknown (_handle settles again)
                self._give_back_interrupted(reg, exc, [], s.info.get(FUSED))
            else:
                self._give_back_interrupted(reg, exc, got[1].envelopes)
            raise
        acked, polled = got
        envs = polled.envelopes
        # In flight from the commit on: the heartbeat keeps their leases, and a stop that comes
        # first releases them.
        self._in_flight.add(reg, *envs)
        self._report_buried(reg, s)
        if not acked:
            # Refused: its lease was lost, or an offer updated the message meanwhile, which
            # then holds it for this delivery: the settle alone ends the hold (see
            # LeasedQueue._settle_held), in a transaction of its own.
            acked = bool(self._settle(reg, env, "ack", [env]))
        if polled.more:  # no controls: chainable
            taken = Taken(len(envs), True, None, True)
        else:  # when the next row is due, as the statement read it (with groups: unknown)
            taken = Taken(len(envs), False, self._due_in(reg, polled.ahead.next_at))
        return int(acked), (envs, taken)

    def _unfused(
        self,
        reg: Registration,
        env: Envelope[Any],
        sent: tuple[str, datetime] | None,
        error: Exception,
    ) -> tuple[int, None]:
        """After :meth:`_ack_fused` failed (``sent``: its statement's take prefix and lease
        end; None: the statement was never sent): give back what it may have taken, and
        acknowledge alone (retried as a settle is)."""
        if retryable(error):
            self._db_error(error)
        else:
            log.warning(
                "acknowledging and taking on %s failed; acknowledging alone: %s",
                reg.source.name,
                error,
            )
        if sent is None:
            return self._settle(reg, env, "ack", [env]) or 0, None
        if self._settle(reg, env, "give back", sent):
            # It took rows, so it committed, the acknowledgement with them, unless that matched
            # nothing: an offer that updated the message holds it for this delivery, and only
            # an acknowledgement ends the hold (else the new version waits for the old lease's
            # end). The acknowledgement again does that, and nothing where the first matched.
            log.warning(
                "acknowledging and taking on %s committed, though it raised (%s): the "
                "messages it took are due again",
                reg.source.name,
                error,
            )
            self._settle(reg, env, "ack", [env])
            return 1, None
        return self._settle(reg, env, "ack", [env], after_failure=True) or 0, None

    @staticmethod
    def _acknowledge(s: Session, reg: Registration, envs: Sequence[Envelope[Any]]) -> int:
        """Acknowledge ``envs`` in ``s``; how many were (a lease that ran out is not)."""
        if len(envs) == 1:
            return int(bool(reg.source.ack(s, envs[0])))
        return reg.source.ack_many(s, envs)

    def _failed(self, reg: Registration, envs: list[Envelope[Any]], error: BaseException) -> None:
        """Record the failure of every envelope of ``envs``, then tell the hooks: a hook
        interrupted (Ctrl-C, the drain's cancel) must not leave the rest of a batch uncounted."""
        current = self._in_flight.current(reg, envs)
        outcomes: list[NackOutcome | None] = []
        for i, env in enumerate(current):
            try:
                outcomes.append(self._settle(reg, env, "nack", error))
            except BaseException as exc:
                # Interrupted while it recorded the failure (the asyncio stop's cancel as the
                # statement awaited its reply): recorded again, with the rest, or the stop
                # released them uncounted (a poison message stopped that way ran for ever).
                self._settle_again(reg, current[i:], exc, error)
                raise
            log_failure(reg.source.name, env.key, env.attempt, error, outcomes[-1])
        for env, outcome in zip(current, outcomes, strict=True):
            self.hooks.failed(reg.queue, env, error, outcome or NackOutcome.STALE)

    def _settle(
        self,
        reg: Registration,
        env: Envelope[Any] | None,
        what: str,
        arg: Any = None,
        *,
        after_failure: bool = False,
    ) -> Any:
        """Settle in a transaction of its own, retrying transient errors up to the lease.

        ``after_failure``: a transaction that held this settle already failed (its commit may
        have happened, the connection lost before the reply). ``env`` is None only to give
        back what a take holds ("give back", whose ``arg`` is the take's prefix and lease end:
        no message of its own)."""
        source = reg.source
        message = cast(Envelope[Any], env)  # None only to give back, which has no message
        ops: dict[str, Callable[[Session], Any]] = {
            "ack": lambda s: self._acknowledge(s, reg, arg),
            "nack": lambda s: source.nack(s, message, arg),
            "release": lambda s: source.release(s, message, at=arg),
            "record": lambda s: source.record_failure(s, message, arg),
            "give back": lambda s: source.release_fused(s, *arg),
        }
        op = ops[what]
        subject = source.name if env is None else f"{source.name}/{env.key}"
        delay = 0.05
        deadline = time.monotonic() + max(reg.lease.total_seconds(), 1.0)
        while True:
            committing = False
            try:
                with self.rt.session() as s, s.begin():
                    result = op(s)
                    committing = True  # only a failure from here on may hide a commit
                if (
                    after_failure
                    and env is not None
                    and what != "give back"  # nothing held is a normal answer there
                    and (result is NackOutcome.STALE or result is False or result == 0)
                ):
                    # Refused by its token: a lost lease, or the failed try did commit and only
                    # its reply was lost. Say so, rather than report what may be a death or an
                    # acknowledgement as "not recorded".
                    log.error(
                        "the %s of %s was refused after a try whose outcome is unknown (the "
                        "connection was lost, perhaps after its commit): the message may be %s",
                        what,
                        subject,
                        self._intended(reg, env, what),
                    )
                return result
            except Exception as exc:
                if not retryable(exc):
                    self._fail(exc, f"the {what} of {subject}")
                    return None
                after_failure = after_failure or committing
                self._db_error(exc)
                if time.monotonic() > deadline:
                    log.error(
                        "giving up on the %s of %s; the lease will expire",
                        what,
                        subject,
                    )
                    return None
                self.rt.sleep(delay)
                delay = min(delay * 2, 2.0)

    @staticmethod
    def _intended(reg: Registration, env: Envelope[Any], what: str) -> str:
        """What a settle that may have committed did to the message, for the log."""
        if what == "ack":
            return "acknowledged (its handler succeeded)"
        if what == "release":
            return "released"
        policy = reg.source.retry_policy
        if env.attempt >= policy.max_attempts:
            return f"dead (attempt {env.attempt} of {policy.max_attempts} failed)"
        return "rescheduled for a retry"

    def _transactional_once(self, reg: Registration) -> Taken:
        """Take, handle and acknowledge in one transaction (the source's ``process_one``)."""
        rt = self.rt
        #: The message whose handler runs, and a failure that rolled its take back (below).
        handling: list[Envelope[Any]] = []
        bailed: list[BaseException] = []
        idle = Taken(0, False, None)

        def handle(envelope: Envelope[Any], session: Session) -> Any:
            self._observe(reg, envelope)
            handling.append(envelope)
            if not (envelope.lock_token and leases_apart(session)):
                return rt.call(reg.handler, envelope, session)  # the row lock holds it
            # A limited queue's take is a lease committed apart: without the heartbeat it runs
            # out under a long handler, and another consumer runs the message beside it.
            self._in_flight.add(reg, envelope)
            try:
                result = rt.call(reg.handler, envelope, session)
            except BaseException as exc:
                if not rt.cut_by_stop(exc):
                    self._in_flight.pop(reg, envelope)
                # else the stop's cancel: still in flight, the stop releases it a lease from
                # now (its work may go on in a thread), as in lease mode
                raise
            self._in_flight.pop(reg, envelope)
            return result

        s = rt.session()
        #: A limited queue's leases, committed apart: a rollback of this transaction leaves them.
        apart: list[Envelope[Any]] = s.info.setdefault(APART, [])
        try:
            with s, s.begin():
                if rt.stopping:
                    return Taken(0, False, None)
                started = time.monotonic()
                try:
                    result, ahead = reg.source.process_next(s, handle)
                except BaseException as exc:
                    if not isinstance(exc, Exception) and not rt.cut_by_stop(exc):
                        # Stop before the rollback makes the message due again (see _consume).
                        bailed.append(exc)
                        where = "the handler of" if handling else "a take from"
                        self._fail(exc, f"{where} {reg.source.name}")
                    raise
                if result is None:  # nothing taken: how long to wait, read in its transaction
                    idle = Taken(0, False, self._idle(s, reg))
            self._report_buried(reg, s)
        except Exception as exc:
            # The transaction failed (a lost connection, a deadlock, a failed commit): as for a
            # plain take, the message is due again at once, no attempt counted. A lease taken
            # apart would otherwise hold it for a whole lease and count a lost attempt. (After
            # a commit that did happen, the release finds no such token and changes nothing.)
            # So is a lease whose own commit failed, if it happened: its handler never ran.
            leased = list(apart)
            if isinstance(exc, TakeUnsure):
                leased += self._took(reg, exc.envelopes, exc, "releasing them, uncounted") or []
            for env in leased:
                self._settle(reg, env, "release")
            raise
        except BaseException as exc:
            # SystemExit, KeyboardInterrupt, a cancellation of the handler's own: the rollback
            # took the attempt with it. Recorded apart (as a nack records a lease-mode one), or
            # the message is due again at once, uncounted: it stops the next worker too, and
            # never reaches its last attempt.
            if bailed and handling:
                self._record_bailed(reg, handling[-1], bailed[0])
            else:
                # No handler runs any more (one the stop's cancel left running is in flight,
                # released by the stop): a lease apart goes back at once, uncounted, or its end
                # counted an attempt that no handler made.
                free = [e for e in apart if not self._in_flight.holds(reg, e)]
                self._give_back_interrupted(reg, exc, free)
            raise
        if result is None:
            return idle
        envelope, error, outcome = result
        # Hooks run after the commit, so they report what the database now holds.
        if error is None:
            self.hooks.processed(reg.queue, envelope, time.monotonic() - started)
        else:
            log_failure(reg.source.name, envelope.key, envelope.attempt, error, outcome)
            self.hooks.failed(reg.queue, envelope, error, outcome or NackOutcome.STALE)
        return self._after_one(reg, ahead)

    def _record_bailed(self, reg: Registration, env: Envelope[Any], error: BaseException) -> None:
        """Record the failed attempt of a transactional handler whose transaction rolled back
        (``DelayedQueue.record_failure``, ``EntityQueue.record_failure``)."""
        outcome = self._settle(reg, env, "record", error)
        log_failure(reg.source.name, env.key, env.attempt, error, outcome)
        self.hooks.failed(reg.queue, env, error, outcome or NackOutcome.STALE)

    def _after_one(self, reg: Registration, ahead: Ahead) -> Taken:
        """After a transactional message: take again at once unless its take saw that nothing
        else is due. Trusted only with a listener: an offer committed by another process while
        the handler ran is then a wake-up, as for an idle consumer (in-process offers always
        wake); without one, the consumer takes again to see it, as before."""
        if not ahead.known or not self._listening:
            return Taken(1, True, None)
        due_in = self._due_in(reg, ahead.next_at)
        return Taken(1, True, None) if due_in == 0 else Taken(1, False, due_in)

    def _heartbeat(self) -> None:
        """Extend the leases of long handlers (lease mode, and a limited queue's transactional
        takes) at half-lease, up to ``handler_timeout``.

        It looks every half second, or six times per shortest lease when that is sooner, so an
        extension comes with at least a third of the lease to spare (a 1 s lease is extended
        with 0.33 s or more left, not 0.0-0.5 s).
        """
        rt = self.rt
        every = heartbeat_every(self._registrations)
        due = time.monotonic() + every
        blocked: set[tuple[int, int]] = set()
        while not rt.drained:
            # A stop request does not end it: handlers that run on through the drain keep
            # their leases (else another consumer runs their messages beside them, or counts
            # them as lost). It ends once the runtime is drained; meanwhile it looks often.
            if rt.stopping:
                rt.sleep(DRAIN_LOOK)
            else:
                rt.pause(max(0.0, due - time.monotonic()))
            now = time.monotonic()
            if rt.drained or now < due:
                continue
            self._warn_if_late(now - due)
            due = now + every
            # Rows whose lock the last look gave up waiting for go last, after every other.
            waited, blocked = blocked, set()
            snapshot = self._in_flight.snapshot()
            snapshot.sort(key=lambda item: (id(item[0]), item[1].id) in waited)
            for reg, env, started in snapshot:
                remaining = (env.lease_until - reg.source.now()).total_seconds()
                if remaining > reg.lease.total_seconds() / 2:
                    continue
                limit = reg.handler_timeout
                if limit is not None and now - started > limit.total_seconds():
                    continue  # hung: let the lease run out so another consumer retries it
                try:
                    with rt.session() as s, s.begin():
                        longer = self._extend(s, reg, env, every)
                except Exception as exc:
                    if gave_up_waiting(exc):
                        # Another transaction holds the row (a handler's own, which changed
                        # its entity): tried again at the next look, after the others. Waiting
                        # for it held up every other lease, which ran out under their handlers.
                        blocked.add((id(reg), env.id))
                        continue
                    if not retryable(exc):
                        self._fail(exc, "the lease heartbeat")
                        return
                    self._db_error(exc)
                    continue
                if longer is not None:
                    self._in_flight.replace(reg, longer)

    def _warn_if_late(self, late: float) -> None:
        """Warn when the heartbeat looked later than a third of a lease in flight: the lease
        may have run out before its extension, and another consumer run the message too."""
        late_for = {
            reg.source.name
            for reg, _, _ in self._in_flight.snapshot()
            if late > reg.lease.total_seconds() / 3
        }
        if late_for:
            log.warning(
                "%s: the lease heartbeat ran %.1f s late; leases of queue(s) %s may have run "
                "out under their handlers, and their messages may be delivered a second time "
                "(%s)",
                self.name,
                late,
                ", ".join(sorted(late_for)),
                self.rt.late_hint,
            )

    @staticmethod
    def _extend(s: Session, reg: Registration, env: Envelope[Any], wait: float) -> Any:
        """The heartbeat's extension of ``env``'s lease, waiting at most about ``wait`` seconds
        for a row lock (see ``Strategy.waiting_at_most``)."""
        restore = strategy_for(s).waiting_at_most(s, wait)
        if restore is None:
            return reg.source.extend(s, env, reg.lease)
        conn = s.connection()
        try:
            longer = reg.source.extend(s, env, reg.lease)
        except BaseException:
            # The extension's error is the one to report: putting the bound back fails too on
            # a lost connection (and its error said the worker must stop). A connection that
            # could not be given its bound back is not pooled again with the short one.
            try:
                restore()
            except Exception:
                conn.invalidate()
            raise
        restore()
        return longer

    def _run_periodic(self, task: Periodic) -> None:
        """A side task: a pass now and then every ``interval``, surviving every error but an
        interruption, which stops the worker as it would a consumer (see ``_consume``)."""
        rt = self.rt
        while not rt.stopping:
            try:
                self._call(task.fn, self._side_sessions(task.fn))
            except BaseException as exc:
                if is_interruption(exc):
                    if rt.stopping and is_cancellation(exc):
                        raise  # the stop's cancel of the side tasks
                    self._fail(exc, task.name)
                    return
                log.warning(
                    "%s: %s failed; it runs again in %.0f s",
                    self.name,
                    task.name,
                    task.interval,
                    exc_info=True,
                )
            rt.pause(task.interval)

    def _stop_periodic(self) -> None:
        for task in self._periodic:
            if task.on_stop is not None:
                try:
                    self._call(task.on_stop, self._side_sessions(task.on_stop))
                except BaseException as exc:
                    if is_interruption(exc):
                        raise
                    log.warning("%s: stopping %s failed", self.name, task.name, exc_info=True)

    def _release_in_flight(
        self, entries: Sequence[tuple[Registration, Envelope[Any]]] | None = None
    ) -> None:
        """On stop, after the drain: give back what handlers still hold, due when a lease from
        now ends, no attempt counted. Not at once: a thread cannot be killed, so a handler
        still running (on the asyncio worker, one whose work went on in a thread) would run
        beside the consumer that took it next. A handler that outlives that lease too may be
        redelivered, as any lease-mode handler that outlives its lease. ``entries``: those a
        ``process_due`` call held (taken back already); by default every one in flight."""
        if entries is None:
            entries = [(reg, env) for reg, env, _ in self._in_flight.snapshot()]
        for reg, env in entries:
            self._settle(reg, env, "release", reg.source.now() + reg.lease)
            self._in_flight.pop(reg, env)

    def _due_enter(self, runtime: Callable[[], Runtime], heartbeat: Callable[[], Any]) -> Runtime:
        """A ``process_due`` call begins: the first of the calls running at once makes the
        runtime they share (``runtime()``) and starts its heartbeat (``heartbeat()``, kept for
        the last call to wait for); returns the runtime."""
        with self._due_lock:
            if self._due_calls == 0:
                self._rt = runtime()
                self._due_beat = heartbeat()
            self._due_calls += 1
            return self.rt

    def _due_exit(self) -> Any:
        """A ``process_due`` call ended: the last of those running at once stops their runtime
        and gets its heartbeat to wait for; the others get None."""
        with self._due_lock:
            self._due_calls -= 1
            if self._due_calls:
                return None
            self.rt.mark_drained()
            self.rt.request_stop()
            beat, self._due_beat = self._due_beat, None
            return beat

    def _process_due(self, limit: int | None) -> int:
        """Handle what is due now, on the calling thread or task, until nothing is due (or
        about ``limit`` rows were handled); returns how many were.

        When it ends on an error or an interruption (Ctrl-C in a hook between a take and its
        handlers), what it took and did not settle is given back, due at once and uncounted:
        its handlers do not run any more, and the end of the lease would count an attempt.
        Only this call's: other threads or tasks may run ``process_due`` on the same worker."""
        handled, errors = 0, 0
        try:
            # A stop (request_stop, a cancelled call beside it) ends it: each take would give
            # back what it took, unhandled, and take it again.
            while (limit is None or handled < limit) and not self.rt.stopping:
                before = handled
                try:
                    for reg in self._registrations:
                        if self.rt.stopping:
                            break
                        handled += self._once(reg).handled
                        self._raise_failure()
                except Exception as exc:
                    if not retryable(exc) or errors >= PROCESS_DUE_RETRIES:
                        raise
                    errors += 1
                    self._db_error(exc)
                    self.rt.sleep(backoff(errors))
                    continue
                errors = 0
                if handled == before:
                    break
        except BaseException as exc:
            own = self._in_flight.take_back()
            if self.rt.stopping and is_cancellation(exc):
                # A handler the cancellation left running (its work in a thread) would run
                # beside the consumer that took its message next: given back as a stop does,
                # to its end whatever cancellations follow (anyio's come at every await).
                self.rt.to_its_end(lambda: self._release_in_flight(own))
                raise
            held: dict[int, tuple[Registration, list[Envelope[Any]]]] = {}
            for reg, env in own:
                held.setdefault(id(reg), (reg, []))[1].append(env)
            for reg, envs in held.values():
                self._give_back_interrupted(reg, exc, envs)
            raise
        return handled
